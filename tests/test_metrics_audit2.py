"""The audit of tests/test_metrics_audit.py in other layouts: a step's logged figures on two
trainer=fsdp2 ranks (gloo, CPU), with packed rows and with token-budget micro-batches, each equal
to one unpacked trainer=torch process's on the same experiences, and checked against counts made
here from the rows themselves and the starting weights (never from rft's metric code).

The rows (tests/test_trainer.experiences): 4 groups of 8, a prompt of 15 tokens and a response of
1 to 6, so micro-batches and ranks hold unequal token counts; the engine's log-probs are all 0,
so each token's rollout IS weight is its probability under the trainer's weights.
"""

import math
import statistics

import pytest
import torch
from conftest import compose_cfg
from test_fsdp import configs, fsdp_group, local_ray  # noqa: F401  (the module's Ray instance)
from test_metrics_audit import _policy_stats
from test_trainer import experiences

from rft.models import ensure_model
from rft.plan.batch import make_plan, stage_configs
from rft.trainer.trainer import Trainer

# the figures that describe the layout's own work or time, not the batch: compared below as
# token counts (x timing/train_compute_s) or not at all
LAYOUT = ("timing/", "perf/tflops", "perf/mfu", "perf/padding_frac", "perf/shared_prompt_frac", "perf/max_memory_gb",
          "train/tokens_per_s", "perf/trainer_tokens_per_s")

GRPO = ["trainer.mini_batch_size=16",  # two updates a step of 32 rows
        "algorithm.clip_ratio_low=0.01", "algorithm.clip_ratio_high=0.01",  # step 2's stale ratios cross them
        "algorithm.optimizer.warmup_steps=2"]
PPO = ["algorithm=ppo", "algorithm.critic_warmup=0", "algorithm.kl_loss_fn=k3", "algorithm.kl_loss_coef=0.01",
       "algorithm.kl_penalty_fn=k1", "algorithm.kl_penalty_coef=0.1"]


def _steps(train_step, batches):
    return [train_step(b) for b in batches]


def _grpo_batches():
    batch = experiences(n_groups=4, group=8)
    # groups 0, 1, 3, 2: the likeliest response token (row 23 of the generated order) on rank 1
    batch = batch[:16] + batch[24:] + batch[16:24]
    # 32 rows; the same 32, now a step stale; then 9 rows (one update): ceil(9 / 2) = 5 rows on
    # rank 0 (micro-batches of 4 and 1), 4 on rank 1, which runs a dead pass to keep in step
    return [batch, batch, batch[:9]]


@pytest.fixture(scope="module")
def grpo_layouts(local_ray, tmp_path_factory):  # noqa: F811
    """GRPO's 3 steps on one process (its clip_grad_norm_ returns kept) and on two ranks."""
    (one_cfg, one_plan), (two_cfg, two_plan) = configs(*GRPO)
    norms = []
    real = torch.nn.utils.clip_grad_norm_

    def clip(params, *a, **k):
        norm = real(params, *a, **k)
        norms.append(float(norm))
        return norm

    one = Trainer(one_cfg, one_plan)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.nn.utils, "clip_grad_norm_", clip)
        m_one = _steps(one.train_step, _grpo_batches())
    two = fsdp_group(two_cfg, two_plan, tmp_path_factory.mktemp("grpo2"), name="audit_grpo")
    try:
        m_two = _steps(lambda b: two.call("train_step", b), _grpo_batches())
    finally:
        two.kill()
    return one_cfg, m_one, m_two, norms


@pytest.fixture(scope="module")
def ppo_layouts(local_ray, tmp_path_factory):  # noqa: F811
    (one_cfg, one_plan), (two_cfg, two_plan) = configs(*PPO)
    batch = experiences(n_groups=4, group=8)
    m_one = _steps(Trainer(one_cfg, one_plan).train_step, [batch, batch])
    two = fsdp_group(two_cfg, two_plan, tmp_path_factory.mktemp("ppo2"), name="audit_ppo")
    try:
        m_two = _steps(lambda b: two.call("train_step", b), [batch, batch])
    finally:
        two.kill()
    return m_one, m_two


def assert_same_figures(m_one: dict, m_two: dict):
    """Every figure of the batch equal (up to float summation order), none missing on either side."""
    keys = {k for k in m_one if not k.startswith(LAYOUT)}
    assert keys == {k for k in m_two if not k.startswith(LAYOUT)}
    for k in sorted(keys):
        assert m_two[k] == pytest.approx(m_one[k], rel=1e-5, abs=1e-7), k


def rows_of(batch):
    return [{"tokens": e.tokens, "prompt_length": e.prompt_length, "sampling": {}} for e in batch]


def tokens(m: dict) -> tuple[float, float]:
    """(response tokens, the rows' tokens the forwards took) a step's throughputs count."""
    t = m["timing/train_compute_s"]
    return round(m["train/tokens_per_s"] * t, 6), round(m["perf/trainer_tokens_per_s"] * t, 6)


@pytest.mark.slow  # two ranks and one process, 3 steps each
def test_two_ranks_log_one_process_figures_and_the_counts(grpo_layouts):
    cfg, m_one, m_two, norms = grpo_layouts
    for a, b in zip(m_one, m_two):
        assert_same_figures(a, b)
    # step 1: HF's warm-up, update k takes 1e-3 x min(1, k / 2): 0, then 5e-4 -> actor/lr (0 + 5e-4) / 2
    assert m_two[0]["actor/lr"] == pytest.approx(2.5e-4, rel=1e-12)
    # the first update took lr 0, so the second forwarded the starting weights too: every ratio 1
    assert (m_two[0]["actor/approx_kl"], m_two[0]["actor/clip_frac"]) == (0.0, 0.0)
    # ... and actor/entropy is the starting model's entropy per response token of the 32 rows (a
    # token mean over both ranks' rows, not a mean of the ranks' or micro-batches' means)
    batch = _grpo_batches()[0]
    logp, ent = _policy_stats(cfg.model.model_path, rows_of(batch))
    assert len(ent) == sum(e.response_length for e in batch) == 103
    assert m_two[0]["actor/entropy"] == pytest.approx(statistics.fmean(ent), rel=1e-5)
    # the rollout IS weight of a token, exp(trainer log-prob - 0), over all 103 tokens: its mean,
    # and a max over every rank's rows (the largest is on rank 1's: rows 8-15 and 24-31 of the step)
    assert m_two[0]["actor/tis_weight_mean"] == pytest.approx(statistics.fmean(map(math.exp, logp)), rel=1e-5)
    assert m_two[0]["actor/tis_weight_max"] == pytest.approx(math.exp(max(logp)), rel=1e-5)
    owner = [i for i, e in enumerate(batch) for _ in range(e.response_length)][logp.index(max(logp))]
    assert 8 <= owner % 16  # (rank 1's)
    # actor/grad_norm: the mean over a step's updates of the whole model's gradient norm (what
    # clip_grad_norm_ returned in one process), not one shard's
    assert len(norms) == 5  # 2 + 2 + 1 updates
    for m, part in zip(m_two, (norms[0:2], norms[2:4], norms[4:])):
        assert m["actor/grad_norm"] == pytest.approx(statistics.fmean(part), rel=1e-5)
    # loss/policy: the loss each update back-propagated (its micro-batches' parts, each over the
    # update's 16 rows' tokens, summed over micro-batches and ranks), a mean over the 2 updates;
    # at ratio 1 the clipped loss of a token is -A, GRPO's A = (r - group mean) / (group std + 1e-6),
    # times its rollout IS weight min(p, 2) = p (algorithm.rollout_is=tis, the default)
    groups: dict = {}
    for e in batch:
        groups.setdefault(e.group_id, []).append(e.reward)
    tok = [((e.reward - statistics.fmean(groups[e.group_id])) / (statistics.stdev(groups[e.group_id]) + 1e-6), i)
           for i, e in enumerate(batch) for _ in range(e.response_length)]  # (A, row) per token, as logp's
    per_update = [sum(-a * math.exp(lp) for (a, i), lp in zip(tok, logp) if j <= i < j + 16)
                  / sum(e.response_length for e in batch[j:j + 16]) for j in (0, 16)]
    assert m_two[0]["loss/policy"] == pytest.approx(statistics.fmean(per_update), abs=1e-6)
    # step 2's stale rows crossed the clip bounds: the clip fractions compared something
    assert m_two[1]["actor/clip_frac"] > 0.1 and m_two[1]["actor/approx_kl"] > 0.1


@pytest.mark.slow  # the module's runs
def test_throughputs_count_real_tokens_not_a_dead_pass(grpo_layouts):
    """train/tokens_per_s x timing/train_compute_s is the batch's response tokens, and
    perf/trainer_tokens_per_s x the same the rows' tokens the forwards took: each row twice (its old
    log-probs', its update's), on either layout. Step 3's rank 1 runs a dead pass on row 0 (18
    tokens) in each forward so that both ranks run 2; it was counted as real tokens (336 + 2 x 18
    = 372): it is padding (perf/padding_frac), as the one process has none."""
    _, m_one, m_two, _ = grpo_layouts
    for m1, m2, batch in zip(m_one, m_two, _grpo_batches()):
        response, rows = sum(e.response_length for e in batch), sum(len(e.tokens) for e in batch)
        assert tokens(m1) == tokens(m2) == (response, 2 * rows)
    # step 3: 9 rows of 17 to 21 tokens, 33 response tokens
    assert tokens(m_two[2]) == (33, 2 * 168) and len(_grpo_batches()[2][0].tokens) == 18
    assert m_one[2]["perf/padding_frac"] == 0 < m_two[2]["perf/padding_frac"]


@pytest.mark.slow  # two ranks and one process, 2 steps each
def test_two_ranks_log_one_process_critic_and_kl_figures(ppo_layouts):
    """PPO with a critic, a k3 KL term and a k1 KL penalty: every figure equal to one process's.
    Step 1 by hand: the critic's zero head values every token 0, the policy is its own reference
    (KL penalty 0), so gamma = lam = 1 make every token's return its row's reward: value loss
    0.5 x token mean of reward^2 over both ranks' rows (one update), explained variance 0."""
    m_one, m_two = ppo_layouts
    for a, b in zip(m_one, m_two):
        assert_same_figures(a, b)
    batch = experiences(n_groups=4, group=8)
    n = [e.response_length for e in batch]
    ret2 = sum(e.reward ** 2 * k for e, k in zip(batch, n)) / sum(n)
    assert 0.2 < ret2 < 0.8  # rewards of 0 and 1 both: the figure below is not a trivial 0 or 0.5
    first = m_two[0]
    assert first["critic/value_loss"] == pytest.approx(0.5 * ret2, rel=1e-6)
    assert (first["critic/values_mean"], first["critic/explained_variance"], first["reward/kl_penalty"]) == (0, 0, 0)
    assert first["actor/kl"] == 0 and first["critic/vf_clip_frac"] == 0
    # step 2: the critic and the policy moved, the figures compared above were not 0
    assert m_two[1]["critic/values_mean"] != 0 and m_two[1]["critic/explained_variance"] != 0
    assert m_two[1]["actor/kl"] > 1e-4 and m_two[1]["reward/kl_penalty"] != 0


@pytest.mark.slow  # three one-process trainers, 2 steps each
def test_packing_and_token_budgets_log_the_unpacked_figures():
    """Packed rows (trainer.use_remove_padding, the default) in fixed micro-batches of 4 and in
    token-budget ones (use_dynamic_bsz, 60 packed tokens: 3 rows a pass): the same figures as
    padded micro-batches of 4, and the same tokens counted (the padding is not)."""
    batch = experiences(n_groups=4, group=8)
    runs = {}
    for name, extra in (("padded", ["trainer.use_remove_padding=false"]), ("packed", []),
                        ("budget_packed", ["trainer.use_dynamic_bsz=true", "trainer.max_token_len_per_gpu=60"])):
        cfg = stage_configs(compose_cfg(["stages=[]", "cluster=inline", "trainer.micro_batch_size_per_gpu=4",
                                         "algorithm.optimizer.lr=1e-3", *GRPO, *extra]))[0]
        ensure_model(cfg.model)
        runs[name] = _steps(Trainer(cfg, make_plan(cfg, 2000)).train_step, [batch, batch])
    for name, ms in runs.items():
        for m, ref in zip(ms, runs["padded"]):
            assert_same_figures(ref, m)
            assert tokens(m) == (103, 2 * 583), name  # 32 x 15 prompt + 103 response tokens, twice
    assert runs["padded"][0]["perf/padding_frac"] > 0  # rows padded to their micro-batch's longest
    assert runs["packed"][0]["perf/padding_frac"] == 0


@pytest.mark.slow  # a one-process trainer, one step
def test_value_loss_is_the_mean_over_the_critic_updates_that_ran():
    """critic/value_loss of a step is the mean over its critic updates of each one's token-mean
    loss, like loss/policy. The plan counts 128 rows a step (8 updates of 16); a step of 32 rows
    (failed tasks, stale rows dropped, a pipeline's filter) runs 2, and the sum of their losses
    was divided by the plan's 8, logging a quarter of the loss. critic_lr 0 keeps every value at
    the zero head's 0, so update j's loss is 0.5 x the token mean of reward^2 over its 16 rows."""
    cfg = stage_configs(compose_cfg(["stages=[]", "cluster=inline", *PPO, "trainer.mini_batch_size=16",
                                     "algorithm.critic_lr=0.0"]))[0]
    ensure_model(cfg.model)
    plan = make_plan(cfg, 2000)
    assert plan.optimizer_steps_per_step == 8
    batch = experiences(n_groups=4, group=8)
    m = Trainer(cfg, plan).train_step(batch)
    per_update = []
    for part in (batch[:16], batch[16:]):
        n = [e.response_length for e in part]
        per_update.append(0.5 * sum(e.reward ** 2 * k for e, k in zip(part, n)) / sum(n))
    assert per_update[0] != per_update[1]  # a mean of the two, not either one
    assert m["critic/value_loss"] == pytest.approx(statistics.fmean(per_update), rel=1e-6)
