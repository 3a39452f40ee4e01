"""The study experiments/algorithm_claims, shortened: each claim's arms run for a few steps from
the same start, and where the full study found a difference, its direction is asserted (slow).

Claims 1 and 2 on countdown after its SFT warm-up (seed 0, shared by every arm through the stage
cache, and trained by the shortened `python run.py task=countdown` that this file checks first),
claim 3 on long_tail after its own (seed 1), claim 4 on arithmetic after the default's warm-up (the
session's warm start, seed 42) and its own reward model.
"""

import os

import pytest
from conftest import compose_cfg
from resume_support import forked_to_end

import rft.runtime.main
from rft.reporting.monitor import read_metrics

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def countdown(tmp_path_factory):
    """`python run.py task=countdown seed=0` with a shorter GRPO stage (20 of its 60 steps) in a
    checkpoint root of its own; its warm-up, published in the root's stage cache, is the one claims
    1 and 2 start from (experiment=claims_teacher composes the same warm-up: the teacher reuses it
    instead of training it again). In one process (cluster=inline), forked from one that imported
    torch (resume_support.forked_to_end): the claim is the task's, not Ray's; Ray's actors and a
    fresh interpreter's imports cost ~1/3 of the run and other tests check the default run on Ray."""
    where = tmp_path_factory.mktemp("claims")
    try:
        return where, forked_to_end(["task=countdown", "seed=0", "cluster=inline", "buffer.total_steps=20",
                                     "explorer.eval_interval=10"],
                                    {**os.environ, "RFT_CHECKPOINT_ROOT_DIR": str(where)}, where / "countdown")
    except AssertionError as e:  # still running after 600 s (killed): the test below fails on it; the claims'
        return where, e  # teacher trains the warm-up


def test_countdown_default_run_learns(countdown):
    """The warm-up imitates a teacher whose last number is one too high in 60% of its answers, so
    greedy decoding repeats the habit; GRPO against the verifier removes it. Measured (seeds 42, 1,
    2) over the full 60 steps, 2026-11-29 (README "Countdown"): GRPO's eval accuracy went 0.100 ->
    0.600, 0.130 -> 0.590, 0.195 -> 0.645 (at step 20: 0.610 for seed 42); here seed 0 (the claims'
    warm-up) in one process: 0.070 -> 0.560 (step 10) -> 0.570 (step 20), as in the teacher's first
    20 steps (through Ray, as this run was before: 0.070 -> 0.545 -> 0.580)."""
    where, r = countdown
    assert not isinstance(r, AssertionError), r
    assert r.returncode == 0, r.stderr[-3000:]
    run = where / "rft" / "grpo-tiny-countdown"
    grpo = evals(read_metrics(run / "grpo" / "metrics.jsonl"))
    sft = evals(read_metrics(run / "sft_warmup" / "metrics.jsonl"))
    start, end = grpo[0], grpo[-1]
    assert len(grpo) == 3 and sft[-1] == start  # evals at GRPO steps 0, 10, 20; it starts from the warm-up
    assert end >= start + 0.2, grpo
    assert f"[grpo] eval accuracy: start {start:.3f} -> end {end:.3f}" in r.stdout


@pytest.fixture(scope="module")
def root(countdown):
    """The checkpoint root holding claim 1's teacher (experiment=claims_teacher: the warm-up, then 60
    GRPO steps; eval 0.07 -> 0.59, ~15 s) and the warm-up in its stage cache."""
    where = countdown[0]
    rft.runtime.main.main(compose_cfg(["experiment=claims_teacher", f"checkpoint_root_dir={where}"]))
    return where


def arm(root, experiment, name, stage, overrides, seed=0):
    """Run one arm of `experiment`; the metrics of its RL stage, step by step."""
    cfg = compose_cfg([f"experiment={experiment}", f"seed={seed}", f"checkpoint_root_dir={root}", f"name={name}",
                       *overrides])
    rft.runtime.main.main(cfg)
    return read_metrics(root / "rft" / name / stage / "metrics.jsonl")


def evals(metrics):
    return [m["eval/accuracy"] for m in metrics if "eval/accuracy" in m]


def test_claim_1_on_policy_distillation_is_ahead_of_grpo_early(root):
    # the full study (30 steps, seeds 1-3): opd ahead at step 5 in every seed, equal from step 10
    five = ["buffer.total_steps=5", "explorer.eval_interval=1"]
    grpo = evals(arm(root, "claims_opd", "arm_grpo", "grpo", ["algorithm=grpo", *five]))
    opd = evals(arm(root, "claims_opd", "arm_opd", "opd", ["algorithm=opd", *five]))
    assert grpo[0] == opd[0]  # the same start (measured 0.07)
    # measured, steps 1-5: grpo 0.155 0.175 0.225 0.305 0.340; opd 0.165 0.195 0.325 0.410 0.495
    assert opd[-1] >= grpo[-1] + 0.05, (grpo, opd)
    assert sum(opd[1:]) > sum(grpo[1:]), (grpo, opd)


def test_claim_2_clip_higher_the_clip_binds_too_rarely_to_matter(root):
    # the full study found no difference in entropy (0.228 -> 0.104 and -> 0.107) because the
    # clip binds on ~0.3-0.5% of tokens; the shortened arms show the same, and that the raised
    # upper bound does clip fewer tokens with a positive advantage
    runs = {}
    for high in (0.2, 0.28):
        runs[high] = [m for m in arm(root, "claims_clip_higher", f"clip_{high}", "grpo",
                                     ["buffer.total_steps=10", "explorer.eval_interval=10",
                                      "+stages.1.trainer={mini_batch_size: 32}",
                                      f"+stages.1.algorithm={{clip_ratio_high: {high}}}"]) if "actor/entropy" in m]
    for high, steps in runs.items():
        assert len(steps) == 10
        # measured: 0.53% (0.2) and 0.48% (0.28) of tokens clipped, averaged over the 10 steps
        assert sum(m["actor/clip_frac"] for m in steps) / 10 < 0.02, high
    # the entropies step by step within 0.03 (measured: at most 0.007 apart)
    assert all(abs(a["actor/entropy"] - b["actor/entropy"]) < 0.03 for a, b in zip(runs[0.2], runs[0.28]))
    # measured: 1.95% vs 0.52% summed over the steps' clip_frac_high
    assert sum(m["actor/clip_frac_high"] for m in runs[0.28]) < sum(m["actor/clip_frac_high"] for m in runs[0.2])


def test_claim_3_dr_grpo_arms_share_their_rollouts_and_differ_in_the_loss_alone(root):
    # the full study (long_tail, 60 steps, seeds 1-3) found no direction across seeds (incorrect
    # responses longer under seq-mean-token-mean by +8.6, +2.1, -0.1 tokens): nothing to assert on
    # the lengths; the shortened arms show what the comparison rests on: the same warm-up and the
    # same rollouts at step 1, then a loss that differs in the aggregation alone
    runs = {}
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum-norm"):
        metrics = arm(root, "claims_dr_grpo", f"drgrpo_{mode}", "grpo",
                      ["buffer.total_steps=3", "buffer.explorer_input.eval_tasksets=[]",  # evals: not compared
                       f"+stages.1.algorithm={{loss_agg_mode: {mode}}}"], seed=1)
        runs[mode] = [m for m in metrics if "loss/policy" in m]
    a, b = runs["seq-mean-token-mean"], runs["seq-mean-token-sum-norm"]
    assert len(a) == len(b) == 3
    for key in ("reward/mean", "response_length/mean", "response_length/incorrect_mean"):
        assert a[0][key] == b[0][key], key  # one warm-up, one seed: the same rollouts
    assert a[0]["loss/policy"] != b[0]["loss/policy"]  # each response over its own length vs over 160
    # the long answers are there to grow or shrink: a wrong response is longer than a right one
    assert all(m["response_length/incorrect_mean"] > m["response_length/correct_mean"] for m in a + b if
               "response_length/correct_mean" in m)


def test_claim_4_without_a_kl_term_the_proxy_rises_while_the_gold_reward_falls(tmp_path, warm_cache):
    # the full study (30 steps, seeds 1-3, a 150-step reward model, an eval every step): the gold
    # eval reaches 0.89-0.945 by step 4 in every arm; with no KL term it is at most 0.03 from step 8
    # while the reward model's score climbs; with KL k3 coef 1.0 it ends at 0.69-0.955. Shortened:
    # seed 42, whose warm-up is the default's (the pipeline's warm-up stage has the default's config:
    # the session's warm start, copied from its stage cache), a 60-step reward model (shared by the
    # two arms: the stage cache), 10 GRPO steps (~15 s). Seed 2 with its own warm-up, as before, measured
    # much the same (in brackets below)
    runs = {}
    for kl in ("{kl_loss_fn: none}", "{kl_loss_fn: k3, kl_loss_coef: 1.0}"):
        runs[kl] = arm(tmp_path, "claims_overopt", f"overopt_{len(runs)}", "grpo",
                       [f"stage_cache_dir={warm_cache}", "stages.1.buffer.total_steps=60",
                        "stages.1.explorer.eval_interval=30", "buffer.total_steps=10", f"+stages.2.algorithm={kl}"],
                       seed=42)
    assert (tmp_path / "rft" / "overopt_0" / "sft_warmup" / "reused_from").exists()  # the session's warm-up
    assert (tmp_path / "rft" / "overopt_1" / "rm" / "reused_from").exists()  # one reward model for both
    free, held = runs["{kl_loss_fn: none}"], runs["{kl_loss_fn: k3, kl_loss_coef: 1.0}"]
    proxy = {name: [m["reward/mean"] for m in r if "reward/mean" in m] for name, r in (("free", free), ("held", held))}
    assert len(proxy["free"]) == len(proxy["held"]) == 10
    assert proxy["free"][:2] == proxy["held"][:2]  # the same start, the same first rollouts (measured 0.35, 2.06)
    # measured, the eval at steps 0-10: no KL 0.195 0.705 0.900 0.920 0.530 0.245 0.095 0.060 0.015 0 0
    # (seed 2: 0.100 0.725 0.870 0.945 0.910 0.540 0.145 0.035 0 0 0); KL 1.0 0.195 0.705 0.900 0.920
    # 0.925 0.920 0.910 0.895 0.885 0.900 0.900 (0.100 0.725 0.855 0.920 0.885 0.845 0.800 0.765 0.715 0.700 0.720)
    gold_free, gold_held = evals(free), evals(held)
    assert len(gold_free) == len(gold_held) == 11
    assert max(gold_free[1:5]) >= gold_free[0] + 0.5, gold_free  # up by step 4 (the reward model helps first) ...
    assert gold_free[-1] <= max(gold_free) - 0.5, gold_free  # ... then down
    assert gold_held[-1] >= gold_free[-1] + 0.4 and gold_held[-1] >= gold_held[0] + 0.4, (gold_free, gold_held)
    # the proxy meanwhile rises: measured, the mean of steps 1-3 -> 8-10, no KL 1.49 -> 3.99 (KL 1.0: -> 2.42;
    # seed 2: 0.55 -> 2.93, KL 1.0 -> 1.44)
    first, last = sum(proxy["free"][:3]) / 3, sum(proxy["free"][-3:]) / 3
    assert last >= first + 1.0 and last > sum(proxy["held"][-3:]) / 3, proxy
