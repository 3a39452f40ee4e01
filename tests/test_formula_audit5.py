"""Fifth formula audit: the formulas outside the policy losses and advantages, each against a
plain float64 version written from the published formula and the README (not from rft's code):
eval metrics (pass@k, maj@n, mean@n, best@n and their standard errors), reward parts and their
running normalisation, DAPO's overlong penalty, the KL penalty, the learning-rate schedule, the
online curriculum's weights, gradient accumulation over micro-batches, and the plan's memory sums.
Edge cases: k = n, n = 1, all or no sample correct, ties in maj@n, steps past the schedule's end,
one-token rows, micro-batches of unequal token counts."""
import copy
import math
import random
from fractions import Fraction
from itertools import combinations

import pytest

from rft.algorithms import shaping
from rft.rewards import eval_metrics as em


# ---------------------------------------------------------------- eval metrics (Chen et al. 2021)

def ref_pass_at_k(n: int, c: int, k: int) -> float:
    """The definition itself: over every k-subset of the n samples, the share holding a correct one
    (exact, by enumeration; Chen et al.'s estimator 1 - C(n-c, k)/C(n, k) is this count)."""
    samples = [1] * c + [0] * (n - c)
    subsets = list(combinations(range(n), k))
    hit = sum(1 for s in subsets if any(samples[i] for i in s))
    return float(Fraction(hit, len(subsets)))


def ref_majority_correct(rewards, answers, threshold) -> float:
    """maj@n of one task, as the README says: the answer most samples gave (answers equal as
    strings), a tie to the answer sampled first, no answer no vote; correct when that answer's
    first sample is."""
    counts, first = {}, {}
    for i, a in enumerate(answers):
        if a is None:
            continue
        counts[a] = counts.get(a, 0) + 1
        first.setdefault(a, i)
    if not counts:
        return 0.0
    top = max(counts.values())
    winner = min((first[a] for a in counts if counts[a] == top))
    return float(rewards[winner] >= threshold)


def ref_eval(tasks, ks, threshold):
    """mean@n, best@n, pass@k, maj@n over tasks, each with its standard error: the sample standard
    deviation (n - 1) of the per-task values over sqrt(tasks), 0 with one task."""
    per = []
    for rewards, answers in tasks:
        n = len(rewards)
        c = sum(r >= threshold for r in rewards)
        row = {f"mean@{n}": sum(rewards) / n, f"best@{n}": max(rewards), f"maj@{n}": ref_majority_correct(rewards, answers, threshold)}
        row.update({f"pass@{k}": ref_pass_at_k(n, c, k) for k in ks})
        per.append(row)
    out = {}
    for key in per[0]:
        vals = [p[key] for p in per]
        mean = sum(vals) / len(vals)
        se = 0.0 if len(vals) == 1 else math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) / math.sqrt(len(vals))
        out[key], out[key + "_se"] = mean, se
    return out


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_subset_count_for_every_c_and_k(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert em.pass_at_k(n, c, k) == pytest.approx(ref_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_hand_values():
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5; n=1: pass@1 is the sample itself
    assert em.pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert em.pass_at_k(1, 1, 1) == 1.0 and em.pass_at_k(1, 0, 1) == 0.0
    # all correct: 1 for every k; none correct: 0 for every k
    assert [em.pass_at_k(6, 6, k) for k in (1, 3, 6)] == [1.0, 1.0, 1.0]
    assert [em.pass_at_k(6, 0, k) for k in (1, 3, 6)] == [0.0, 0.0, 0.0]


def test_pass_at_k_past_n_is_refused_not_guessed():
    # k > n has no estimator (C(n, k) = 0): a value here would be made up
    with pytest.raises(ValueError, match=r"1 <= k <= n \(n=3, c=1, k=5\)"):
        em.pass_at_k(3, 1, 5)


def test_eval_metrics_match_the_reference_on_random_tasks():
    rng = random.Random(5)
    for trial in range(40):
        n = rng.choice([1, 2, 3, 4, 6])
        tasks = []
        for _ in range(rng.randint(1, 6)):
            rewards = [rng.choice([0.0, 0.5, 1.0]) for _ in range(n)]
            answers = [rng.choice(["7", "8", "9", None]) for _ in range(n)]
            tasks.append((rewards, answers))
        ks = sorted({1, n})
        got = em.eval_metrics([(r, a, None) for r, a in tasks], ks, 1.0, "e")
        want = ref_eval(tasks, ks, 1.0)
        assert set(got) == {f"e/{k}" for k in want}, trial
        for key, v in want.items():
            assert got[f"e/{key}"] == pytest.approx(v, abs=1e-12), (trial, key, tasks)


def test_maj_ties_go_to_the_answer_sampled_first_and_no_answer_is_no_vote():
    # "8" (wrong) and "7" (right) each twice; "8" came first: the vote is wrong -> maj 0
    assert em.task_values([0, 1, 0, 1], ["8", "7", "8", "7"], [1], 1.0)["maj@4"] == 0.0
    # "7" first this time -> 1; three samples without an answer outvote nothing
    assert em.task_values([1, 0, 0, 0, 1], ["7", None, None, None, "7"], [1], 1.0)["maj@5"] == 1.0
    # nobody answered: no majority, counted wrong (not skipped)
    assert em.task_values([1, 1], [None, None], [1], 1.0)["maj@2"] == 0.0


def test_the_vote_is_judged_by_its_first_sample_reward():
    # answer "7" wins 2-1 but its samples scored 1.0 and 0.0 (a reward with a format part):
    # the README says the vote's answer is its first sample's -> its reward 0.0 -> maj 0
    assert em.task_values([0.0, 1.0, 1.0], ["7", "7", "9"], [1], 1.0)["maj@3"] == 0.0


def test_eval_standard_error_hand_values():
    # pass@1 per task 1, 0, 0.5: mean 0.5, sample sd sqrt((0.25+0.25+0)/2) = 0.5, se 0.5/sqrt(3)
    tasks = [([1, 1], ["a", "a"], None), ([0, 0], ["b", "b"], None), ([1, 0], ["a", "b"], None)]
    got = em.eval_metrics(tasks, [1], 1.0, "e")
    assert got["e/pass@1"] == pytest.approx(0.5)
    assert got["e/pass@1_se"] == pytest.approx(0.5 / math.sqrt(3))
    # one task: se 0
    assert em.eval_metrics(tasks[:1], [1], 1.0, "e")["e/pass@1_se"] == 0.0


# ---------------------------------------------------------------- DAPO overlong penalty (arXiv 2503.14476, eq. 13)

def ref_overlong(length, max_len, buffer_len, factor):
    """DAPO's R_length: 0 for L <= Lmax - Lcache; (Lmax - Lcache - L)/Lcache in between; -1 past Lmax;
    scaled by the factor."""
    if length <= max_len - buffer_len:
        return 0.0
    if length <= max_len:
        return (max_len - buffer_len - length) / buffer_len * factor
    return -1.0 * factor


@pytest.mark.parametrize("length", [0, 1, 11, 12, 13, 15, 16, 17, 40])
def test_overlong_penalty_matches_dapo(length):
    # max 16, buffer 4, factor 0.5: zero to 12, then -0.125 a token to -0.5 at 16, held there
    assert shaping.overlong_penalty(length, 16, 4, 0.5) == pytest.approx(ref_overlong(length, 16, 4, 0.5), abs=1e-15)


def test_overlong_penalty_one_token_buffer():
    # buffer 1: 0 at max - 1, -factor at max
    assert shaping.overlong_penalty(7, 8, 1, 1.0) == 0.0
    assert shaping.overlong_penalty(8, 8, 1, 1.0) == pytest.approx(-1.0)


# ---------------------------------------------------------------- learning-rate schedule

def ref_lr(k: int, lr: float, warmup: int, total: int, style: str, min_ratio: float) -> float:
    """The lr update k (from 0) applies: the README's warm-up, lr x min(1, k / warmup) (the first
    update takes 0), then lr (constant) or lr x (m + (1 - m) x (1 + cos(pi x p)) / 2) with
    p = (k - warmup) / (total - warmup) (cosine to lr x min_lr_ratio, as verl's
    get_cosine_schedule_with_warmup and Loshchilov & Hutter's SGDR without restarts): the lr
    reaches lr x m at update `total`, one past the last planned one."""
    if k < warmup:
        return lr * k / warmup
    if style == "constant":
        return lr
    p = (k - warmup) / max(1, total - warmup)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def _scheduled(style, warmup, total, min_ratio=0.1, lr=1e-3):
    """The trainer's own optimizer and schedule (Trainer._build_optimizer) on a one-weight model."""
    import torch
    from types import SimpleNamespace as NS
    from rft.trainer.trainer import Trainer
    opt = NS(lr=lr, betas=(0.9, 0.999), weight_decay=0.0, warmup_steps=warmup, warmup_style=style, min_lr_ratio=min_ratio)
    t = NS(cfg=NS(algorithm=NS(optimizer=opt)), plan=NS(total_steps=total, optimizer_steps_per_step=1),
           model=torch.nn.Linear(1, 1, bias=False))
    Trainer._build_optimizer(t)
    return t


def _applied(t, n):
    """The lr each of n updates applies (read before the update, stepped after it, as the trainer does)."""
    out = []
    for _ in range(n):
        out.append(t.optimizer.param_groups[0]["lr"])
        t.optimizer.step()
        t.scheduler.step()
    return out


@pytest.mark.parametrize("style,warmup,total", [("constant", 0, 6), ("constant", 4, 10), ("cosine", 0, 8),
                                                ("cosine", 3, 10), ("cosine", 1, 2)])
def test_lr_schedule_matches_the_formula_at_every_planned_update(style, warmup, total):
    t = _scheduled(style, warmup, total)
    got = _applied(t, total)
    want = [ref_lr(k, 1e-3, warmup, total, style, 0.1) for k in range(total)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-18)


def test_lr_schedule_hand_values():
    # constant, warm-up 4: 0, 2.5e-4, 5e-4, 7.5e-4, then 1e-3 (the first update takes 0)
    assert _applied(_scheduled("constant", 4, 10), 6) == pytest.approx([0, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    # cosine, warm-up 2 of 6, min 0.1: 0, 5e-4, then p = 0/4 .. 3/4:
    # 1e-4 + 9e-4 x (1 + cos(p pi)) / 2 = 1e-3, 8.682e-4, 5.5e-4, 2.318e-4 (update 6 would take 1e-4)
    c = math.cos(math.pi / 4)
    want = [0, 5e-4, 1e-3, 1e-4 + 9e-4 * (1 + c) / 2, 5.5e-4, 1e-4 + 9e-4 * (1 - c) / 2]
    assert _applied(_scheduled("cosine", 2, 6), 6) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("style", ["constant", "cosine"])
def test_lr_after_a_resume_is_the_uninterrupted_one(style):
    # 3 updates, a checkpoint's scheduler state into a fresh trainer, then the rest: the same lrs
    # as one run of 10 (rft.trainer.state.CheckpointMixin._configured_optimizer sets the group's lr)
    from rft.trainer.state import CheckpointMixin
    whole = _applied(_scheduled(style, 4, 10), 10)
    first = _scheduled(style, 4, 10)
    head = _applied(first, 3)
    second = _scheduled(style, 4, 10)
    second.optimizer.load_state_dict(first.optimizer.state_dict())
    second.scheduler.load_state_dict(first.scheduler.state_dict())
    CheckpointMixin._configured_optimizer(second)
    assert head + _applied(second, 7) == pytest.approx(whole, rel=1e-12, abs=1e-18)


# ---------------------------------------------------------------- gradient accumulation, every loss_agg_mode

AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _rows(model, seed=3):
    """4 groups of 2 (GRPO), responses of 1 to 6 tokens (one-token rows among them), the third
    group's rewards equal (advantages 0: set aside by skip_zero_advantage, yet in the normaliser).
    Sampling log-probs are the model's own (on-policy: rollout_is's weight is 1)."""
    import torch
    from rft.data.experience import Experience
    rng = random.Random(seed)
    rewards = [(1.0, 0.0), (0.0, 1.0), (1.0, 1.0), (1.0, 0.0)]
    lengths = [(1, 6), (3, 1), (2, 5), (6, 4)]
    exps = []
    for g in range(4):
        prompt = [1, 5, 102] + [rng.randint(7, 16) for _ in range(4)] + [2, 102, 1, 6, 102]
        for j in range(2):
            response = [rng.randint(7, 16) for _ in range(lengths[g][j] - 1)] + [2]
            with torch.no_grad():
                logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float()
                logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
            exps.append(Experience(prompt + response, len(prompt), logp.tolist(),
                                   reward=rewards[g][j], group_id=f"0/{g}"))
    return exps


def ref_grpo_advantages(rewards, group=2):
    """ALGORITHMS.md: (R - mean_g) / (std_g + 1e-6), std unbiased."""
    out = []
    for g in range(0, len(rewards), group):
        r = rewards[g:g + group]
        mean = sum(r) / len(r)
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / (len(r) - 1))
        out += [(x - mean) / (std + 1e-6) for x in r]
    return out


def ref_aggregate(token_losses, mode, max_len):
    """ALGORITHMS.md's loss aggregation over the whole mini-batch (lists of per-row token losses)."""
    n = len(token_losses)
    if mode == "token-mean":
        return sum(sum(r) for r in token_losses) / sum(len(r) for r in token_losses)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in token_losses) / n
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in token_losses) / n
    return sum(sum(r) for r in token_losses) / (n * max_len)


def ref_gradient_and_entropy(model, exps, mode, max_len):
    """One big batch in float64, each row forwarded alone (no padding): the policy gradient at
    ratio 1 (loss -A x exp(logp - sg[logp]) per token: ppo_clip with old = current), aggregated as
    ALGORITHMS.md says, and the token-weighted mean entropy over the rows with a signal."""
    import torch
    m = copy.deepcopy(model).double()
    adv = ref_grpo_advantages([e.reward for e in exps])
    losses, ent_sum, ent_tokens = [], 0.0, 0
    for e, a in zip(exps, adv):
        ids = torch.tensor([e.tokens])
        logits = m(ids).logits[0, e.prompt_length - 1:-1].double()
        logp_all = torch.log_softmax(logits, -1)
        logp = logp_all.gather(-1, ids[0, e.prompt_length:, None])[:, 0]
        losses.append([-a * torch.exp(x - x.detach()) for x in logp])
        if a != 0:
            ent_sum += float(-(logp_all.exp() * logp_all).sum().detach())
            ent_tokens += len(logp)
    loss = ref_aggregate(losses, mode, max_len)
    loss.backward()
    return {n: p.grad for n, p in m.named_parameters() if p.grad is not None}, ent_sum / ent_tokens


@pytest.fixture(scope="module")
def zero_lr_trainer():
    """The real trainer on the tiny model, lr 0 (its weights never move, so each step's gradient is
    of the same weights), 8 rows a step in one optimizer step."""
    from conftest import compose_cfg
    from rft.models import ensure_model
    from rft.plan.batch import make_plan, stage_configs
    from rft.trainer.trainer import Trainer
    cfg = stage_configs(compose_cfg(["stages=[]", "cluster=inline", "algorithm.optimizer.lr=0", "buffer.batch_size=4",
                                     "algorithm.repeat_times=2", "trainer.micro_batch_size_per_gpu=8",
                                     "trainer.grad_clip=1e9"]))[0]
    ensure_model(cfg.model)
    t = Trainer(cfg, make_plan(cfg, 2000), None, None)
    return t, _rows(t.model)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_1_2_4_micro_batches_give_the_one_batch_gradient_and_the_formula(zero_lr_trainer, mode):
    import dataclasses
    t, rows = zero_lr_trainer
    t.cfg.algorithm.loss_agg_mode = mode
    want, entropy = ref_gradient_and_entropy(t.model, rows, mode, t.cfg.model.max_response_tokens)
    # 8 rows as 1, 2 and 4 micro-batches of unequal token counts (rows of 1 to 6 tokens)
    for micro in (8, 4, 2):
        t.plan = dataclasses.replace(t.plan, micro_batch_size=micro)
        metrics = t.train_step(copy.deepcopy(rows))
        got = {n: p.grad for n, p in t.model.named_parameters() if p.grad is not None}
        assert set(got) == set(want)
        for name, g in want.items():
            torch_close(got[name], g, f"{mode}, micro-batches of {micro}: {name}")
        # actor/entropy: token-weighted over the rows forwarded (the flat group set aside)
        assert metrics["actor/entropy"] == pytest.approx(entropy, rel=1e-5), (mode, micro)


@pytest.mark.parametrize("mode,packed", [("token-mean", True), ("seq-mean-token-mean", False)])
def test_token_budget_micro_batches_give_the_formula_gradient(zero_lr_trainer, mode, packed):
    """trainer.use_dynamic_bsz: micro-batches by a token budget (rows of 13 to 18 tokens: 40 packed
    tokens hold 2 or 3 rows, padded 2), packed or padded rows: the same gradient as the formula."""
    import dataclasses
    t, rows = zero_lr_trainer
    t.cfg.algorithm.loss_agg_mode = mode
    t.cfg.trainer.use_dynamic_bsz, t.cfg.trainer.use_remove_padding = True, packed
    t.plan = dataclasses.replace(t.plan, max_token_len_per_gpu=40)
    try:
        assert len(t._micro_batches([len(e.tokens) for e in rows], 0, 8)) >= 3  # several, of unequal rows
        want, _ = ref_gradient_and_entropy(t.model, rows, mode, t.cfg.model.max_response_tokens)
        t.train_step(copy.deepcopy(rows))
        for name, p in t.model.named_parameters():
            if p.grad is not None:
                torch_close(p.grad, want[name], f"{mode}, budget 40, packed={packed}: {name}")
    finally:
        t.cfg.trainer.use_dynamic_bsz, t.cfg.trainer.use_remove_padding = False, True


def torch_close(got, want, msg):
    import torch
    torch.testing.assert_close(got.double(), want, rtol=2e-4, atol=1e-7, msg=msg)


# ---------------------------------------------------------------- reward parts, running normalisation

def test_reward_is_the_weighted_sum_of_its_parts_before_weighting_kept():
    from types import SimpleNamespace as NS
    from rft.rewards import scoring
    s = scoring.build([{"fn": "exact_match", "weight": 0.7}, {"fn": "last_number", "weight": -0.2, "name": "ln"}], "t")
    got = s("p", ["12", "x 12", "13"], NS(answer="12", row={}, task_id="t/0"))
    # 0.7 x 1 - 0.2 x 1 = 0.5; 0.7 x 0 - 0.2 x 1 = -0.2; 0
    assert [float(r) for r in got] == pytest.approx([0.5, -0.2, 0.0], abs=1e-15)
    assert [r.parts for r in got] == [{"exact_match": 1.0, "ln": 1.0}, {"exact_match": 0.0, "ln": 1.0},
                                      {"exact_match": 0.0, "ln": 0.0}]


def test_running_normalisation_over_every_rollout_so_far():
    """(value - mean) / std over all values so far, this step's included first; the std is the
    population one (divided by the count: a running statistic over every rollout, as the running
    mean-std of OpenAI baselines' RunningMeanStd), computed here from the whole list in float64."""
    from rft.data.experience import Experience
    from rft.rewards.scoring import RunningNorm
    norm = RunningNorm({"a": 2.0, "b": 0.5}, ["a"])
    seen = []

    def step(values):
        exps = [Experience([1, 2], 1, [0.0], reward=2 * a + 0.5 * b, reward_parts={"a": a, "b": b}) for a, b in values]
        metrics = norm.apply(exps)
        seen.extend(a for a, _ in values)
        mean = sum(seen) / len(seen)
        std = math.sqrt(sum((x - mean) ** 2 for x in seen) / len(seen))
        assert metrics["reward/a/running_mean"] == pytest.approx(mean, rel=1e-12)
        assert metrics["reward/a/running_std"] == pytest.approx(std, rel=1e-12)
        want = [2 * (a - mean) / std + 0.5 * b for a, b in values]
        assert [e.reward for e in exps] == pytest.approx(want, rel=1e-12)
        assert [e.reward_parts for e in exps] == [{"a": a, "b": b} for a, b in values]  # raw values kept

    # step 1: a = 1, 2, 3: mean 2, std sqrt(2/3); the first reward 2 x (1 - 2) / 0.8165 + 0.5 = -1.9495
    step([(1.0, 1.0), (2.0, 0.0), (3.0, 4.0)])
    # step 2: one value, 5: mean 11/4, std sqrt(8.75 / 4) over the four
    step([(5.0, 0.0)])
    step([(-1.0, 2.0), (0.5, 0.5)])


def test_running_normalisation_of_equal_values_adds_nothing():
    # std 0: the part carries no signal and contributes 0 (the docstring's choice), not inf or NaN
    from rft.data.experience import Experience
    from rft.rewards.scoring import RunningNorm
    norm = RunningNorm({"a": 1.0, "b": 1.0}, ["a"])
    exps = [Experience([1, 2], 1, [0.0], reward=3.0 + 0.25, reward_parts={"a": 3.0, "b": 0.25}) for _ in range(3)]
    norm.apply(exps)
    assert [e.reward for e in exps] == [0.25, 0.25, 0.25]


# ---------------------------------------------------------------- KL penalty (k1..k3, Schulman 2020)

def ref_kl(name, logp, ref):
    x = logp - ref
    if name == "k1":
        return x
    if name == "abs":
        return abs(x)
    if name == "k2":
        return x * x / 2
    y = max(-20.0, min(20.0, ref - logp))  # k3 = exp(ref - logp) - (ref - logp) - 1, clamped
    return max(-10.0, min(10.0, math.exp(y) - y - 1))


@pytest.mark.parametrize("name", ["k1", "k2", "k3", "abs"])
def test_kl_penalty_is_the_masked_sum_per_response(name):
    import torch
    from rft.algorithms import KL_FNS
    logp = [[-0.5, -1.2, -3.0, -0.1], [-2.0, float("nan"), float("nan"), float("nan")], [-1.0, -1.0, -1.0, -1.0],
            [-30.0, -0.7, -0.2, float("-inf")]]
    ref = [[-0.7, -1.0, -2.0, -0.4], [-0.3, 0.0, 0.0, 0.0], [-2.0, -2.0, -2.0, -2.0], [-0.5, -0.7, -1.9, 0.0]]
    mask = [[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]]  # a one-token row, a fully masked row
    got = shaping.kl_penalty(KL_FNS.get(name), torch.tensor(logp, dtype=torch.float64),
                             torch.tensor(ref, dtype=torch.float64), torch.tensor(mask, dtype=torch.float64))
    want = [sum(ref_kl(name, a, b) for a, b, m in zip(lr, rr, mr) if m) for lr, rr, mr in zip(logp, ref, mask)]
    assert got.tolist() == pytest.approx(want, rel=1e-12, abs=1e-12)


# ---------------------------------------------------------------- online curriculum weights

def _curriculum_with_outcomes():
    from rft.data.curriculum import OnlineCurriculum
    from rft.data.experience import Experience
    cur = OnlineCurriculum(n_tasks=4, taskset_name="t", window=4, eps=0.05, threshold=1.0, seed=0)
    # task 0: 0 1 1 1 1 (the last 4: p = 1, the first fail out of the window); task 1: 1 0 0 (p = 1/3); task 2: 0 0 (p = 0); task 3 unseen
    outcomes = [(0, 0), (0, 1), (0, 1), (0, 1), (0, 1), (1, 1), (1, 0), (1, 0), (2, 0), (2, 0)]
    cur.observe([Experience([1, 2], 1, [0.0], reward=float(r), task_id=f"t/{i}", group_id=f"0/{i}") for i, r in outcomes])
    return cur


def test_curriculum_weight_is_p_times_1_minus_p_plus_eps():
    # p = 1: 0 + 0.05; p = 1/3: 2/9 + 0.05 = 0.27222; p = 0: 0.05; unseen (p = 0.5): 0.25 + 0.05
    assert _curriculum_with_outcomes().weights() == pytest.approx([0.05, 2 / 9 + 0.05, 0.05, 0.3], rel=1e-12)


def test_curriculum_draws_in_proportion_to_the_weights_without_replacement():
    cur = _curriculum_with_outcomes()
    w = cur.weights()
    W = sum(w)
    steps = 3000
    ones = [0] * 4
    pairs_with_1 = 0
    for step in range(steps):
        ones[cur.draw(step, 1)[0]] += 1
        pair = cur.draw(step, 2)
        assert len(set(pair)) == 2
        pairs_with_1 += 1 in pair
    # one draw: task i with w_i / W (0.05 / 0.62222 = 0.0804, ...); 4 standard errors at most
    for i in range(4):
        p = w[i] / W
        assert ones[i] / steps == pytest.approx(p, abs=4 * math.sqrt(p * (1 - p) / steps)), i
    # two draws without replacement (successive sampling): P(1 drawn) = 1 - P(neither draw is 1)
    # = 1 - sum_{j != 1} w_j / W x (W - w_j - w_1) / (W - w_j)
    p1 = 1 - sum(w[j] / W * (W - w[j] - w[1]) / (W - w[j]) for j in range(4) if j != 1)
    assert pairs_with_1 / steps == pytest.approx(p1, abs=4 * math.sqrt(p1 * (1 - p1) / steps))


# ---------------------------------------------------------------- the plan's memory (rft/plan/memory.py)

def test_qwen7b_memory_parts_by_hand():
    """`algorithm=grpo model=qwen7b`: 4 fsdp2 ranks with fp32 master weights (4 bytes), bfloat16
    compute (2 bytes), 16,384-token micro-batches checkpointed, 2,048-token log-prob chunks; 4 vllm
    engines at 0.9 of 80 GiB. Qwen2.5-7B: H 3584, I 18944, 28 layers, 28 heads of 128, kv 4 x 128,
    V 152064, untied."""
    from conftest import compose_cfg
    from rft.plan import memory
    from rft.plan.batch import make_plan, stage_configs
    cfg = stage_configs(compose_cfg(["algorithm=grpo", "model=qwen7b"]))[-1]
    est = memory.estimate(cfg, make_plan(cfg, 2000))
    H, I, L, V, kv, q = 3584, 18944, 28, 152064, 512, 28 * 128
    layer = H * q + 2 * H * kv + q * H + 3 * H * I + 2 * H  # q k v o, gate up down, two norms: 233,053,184
    P = 2 * V * H + L * layer + H  # 7,615,487,488: Qwen2.5-7B's 7,615,616,512 less its 129,024 q/k/v biases
    assert est.shape.parameters == P == 7_615_487_488
    trainer, explorer = (dict(r.parts) for r in est.roles)
    assert trainer["weights"] == P * 4 // 4 and trainer["gradients"] == P and trainer["Adam"] == 2 * P
    # checkpointed: T x L x H x 2 for each layer's input, + one layer's whole, T x (6H + 2kv + 4I) x 2
    # = 3,288,334,336 + 3,221,225,472
    T = 16384
    assert trainer["activations (16,384 tokens, checkpointed)"] == T * L * H * 2 + T * (6 * H + 2 * kv + 4 * I) * 2
    assert trainer["logits (2,048-token chunks)"] == 2048 * V * 12  # three [C, V] float32 tensors
    assert trainer["snapshots (rank 0) in CPU memory"] == 3 * P * 2
    # vllm: 0.9 x 80 GiB taken whole = bf16 weights + 2 GiB + the KV cache, 2 L kv 2 bytes a token
    gib = 2 ** 30
    assert explorer["weights"] == 2 * P
    kv_bytes = int(0.9 * 80 * gib) - 2 * P - 2 * gib
    assert explorer["KV cache (holds 64 of 64 sequences at 4,096 tokens)"] == kv_bytes
    assert kv_bytes // (2 * L * kv * 2) // 4096 >= 64  # 255 sequences of 4,096 tokens fit
    # FSDP2 keeps the root unit (embedding and untied head) whole from its forward to its backward
    assert trainer["gathered embedding and head"] == 2 * V * H * 2
    # two decoder layers in bfloat16: what is not embedding or head, over the layers (the final norm's
    # H shared among them): 2 x (L layer + H) / L x 2 bytes
    assert trainer["gathered layers"] == 2 * (L * layer + H) // L * 2 == 932_213_248
    # the README's line: ~41.8 GiB a rank (GPU parts only)
    gpu = sum(v for k, v in trainer.items() if "CPU" not in k)
    assert round(gpu / gib, 1) == 41.8


# ---------------------------------------------------------------- the experience pipeline's reward shaping

@pytest.mark.parametrize("op,v,want", [("ADD", 4.0, 0.8 + 0.5 * 4), ("SUB", 4.0, 0.8 - 0.5 * 4),
                                       ("MUL", 4.0, 0.8 * 0.5 * 4), ("DIV", 4.0, 0.8 / (0.5 * 4))])
def test_reward_shaping_ops_by_hand(op, v, want):
    from rft.data import operators
    from rft.data.experience import Experience
    e = Experience([1, 2], 1, [0.0], reward=0.8, reward_parts={"acc": 0.8, "format": v})
    operators.reward_shaping_mapper([e], [{"stats_key": "format", "op_type": op, "weight": 0.5}])
    assert e.reward == pytest.approx(want, rel=1e-15)
    assert e.reward_parts[f"{op.lower()}_format"] == pytest.approx(want - 0.8, rel=1e-12)


@pytest.mark.parametrize("op,v,says", [
    ("DIV", 0.0, "DIV by stats_key 'format' = 0.0 (weight 0.5) on experience 't/3', whose reward is 0.8, divides it "
                 "by 0.5 x 0.0 = 0: give DIV a stats_key that is never 0 (or use SUB, or ADD with a negative weight)."),
    ("ADD", float("nan"), "ADD by stats_key 'format' = nan (weight 0.5) on experience 't/3', whose reward is 0.8, makes "
                          "it nan: a reward must stay a finite number; give a stats_key whose values are finite."),
])
def test_reward_shaping_that_breaks_the_reward_names_it(op, v, says):
    # was a bare ZeroDivisionError mid-run, and a NaN reward passed on to the advantages silently
    from rft.data import operators
    from rft.data.experience import Experience
    from rft.errors import ConfigError
    e = Experience([1, 2], 1, [0.0], reward=0.8, reward_parts={"acc": 0.8, "format": v}, task_id="t/3")
    with pytest.raises(ConfigError) as err:
        operators.reward_shaping_mapper([e], [{"stats_key": "format", "op_type": op, "weight": 0.5}])
    assert str(err.value) == "reward_shaping_configs: " + says


def test_tiny_default_memory_parts_by_hand():
    """The default (`stages=[]`, the tiny model, float32, one trainer, one hf explorer, CPU):
    H 128, I 512, 2 layers, 4 heads of 32, kv 4 x 32, V 103, tied; 16 tasks x 8 rollouts, micro 128
    rows of 24 + 6 tokens."""
    from conftest import compose_cfg
    from rft.models import ensure_model
    from rft.plan import memory
    from rft.plan.batch import make_plan, stage_configs
    cfg = stage_configs(compose_cfg(["stages=[]"]))[-1]
    ensure_model(cfg.model)
    est = memory.estimate(cfg, make_plan(cfg, 2000))
    H, I, L, V, kv, q = 128, 512, 2, 103, 128, 128
    # from the files: 103 x 128 + 2 x (q k v o, MLP, norms, q/k/v biases 3 x 128) + norm = 538,880
    P = V * H + L * (H * q + 2 * H * kv + q * H + 3 * H * I + 2 * H + 3 * 128) + H
    assert est.shape.parameters == P == 538_880
    trainer, explorer = (dict(r.parts) for r in est.roles)
    assert (trainer["weights"], trainer["gradients"], trainer["Adam"]) == (4 * P, 4 * P, 8 * P)
    # not checkpointed: L x T x (6H + 2kv + 4I) x 4 bytes, T = 128 rows x 30 = 3,840: 94,371,840
    T = 128 * 30
    assert trainer["activations (3,840 tokens)"] == L * T * (6 * H + 2 * kv + 4 * I) * 4 == 94_371_840
    assert trainer["logits (3,840-token micro-batch)"] == T * V * 12
    # hf: min(generate_batch_size 256, 128 rollouts) rows x 30 tokens x 2 (k, v) x L x kv x 4 bytes
    assert explorer["KV cache (128 rows x 30 tokens)"] == 128 * 30 * 2 * L * kv * 4 == 7_864_320
    assert explorer["scores (128 rows)"] == 3 * 128 * V * 4


def test_group_diversity_filter_uses_the_population_std_inclusive():
    # groups: [1, 0] (std 0.5), [0.5, 0.5] (0), [1, 0, 0, 0] (sqrt(3/16) = 0.433)
    from rft.data import operators
    from rft.data.experience import Experience
    groups = {"a": [1, 0], "b": [0.5, 0.5], "c": [1, 0, 0, 0]}
    exps = [Experience([1, 2], 1, [0.0], reward=float(r), group_id=f"0/{g}") for g, rs in groups.items() for r in rs]

    def kept(min_std):
        return sorted({e.group_id[2:] for e in operators.group_diversity_filter(exps, min_std=min_std)})
    assert kept(0.0) == ["a", "c"]
    assert kept(0.43) == ["a", "c"] and kept(0.44) == ["a"]
    assert kept(0.5) == []  # <= min_std is dropped


def test_lr_after_a_resume_into_a_longer_plan_follows_the_new_length():
    # 5 updates of a 10-update cosine plan, resumed with 20 (a run made longer): update k takes the
    # 20-update schedule's lr at k (warm-up 2, min 0.1), as rft.trainer.state says
    from rft.trainer.state import CheckpointMixin
    first = _scheduled("cosine", 2, 10)
    head = _applied(first, 5)
    second = _scheduled("cosine", 2, 20)
    second.optimizer.load_state_dict(first.optimizer.state_dict())
    second.scheduler.load_state_dict(first.scheduler.state_dict())
    CheckpointMixin._configured_optimizer(second)
    assert head == pytest.approx([ref_lr(k, 1e-3, 2, 10, "cosine", 0.1) for k in range(5)], rel=1e-12, abs=1e-18)
    assert _applied(second, 15) == pytest.approx([ref_lr(k, 1e-3, 2, 20, "cosine", 0.1) for k in range(5, 20)], rel=1e-12)
