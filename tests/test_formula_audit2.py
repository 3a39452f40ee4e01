"""A second, independent audit of rft/algorithms: the edge cases tests/test_formula_audit.py leaves
out. Rewards of +-1e30 (float32 and float64), bfloat16 rewards, log-ratios of +-700 in float32
(exp overflows there past 88.7), a clip_ratio_low of 1 or more, a decoupled weight of two -inf
log-probs, a batch without a response token, multi-turn masks with gamma < 1, and micro-batch
splits of the whole trainer step for every aggregation mode and sequence-level loss. Expected
values are computed by hand here (the arithmetic in the comments), never by calling rft.
"""

import math
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from rft.algorithms import ADVANTAGE_FNS, POLICY_LOSS_FNS, agg_loss, off_policy
from rft.config import AGG_MODES, AlgorithmConfig

F32, F64 = torch.float32, torch.float64


def algo(**kw):
    return OmegaConf.structured(AlgorithmConfig(**kw))


def advantages(name, rewards, groups, dtype, **kw):
    mask = torch.ones(len(rewards), 2)
    batch = {"rewards": torch.tensor(rewards, dtype=dtype), "group_index": torch.tensor(groups), "response_mask": mask}
    return ADVANTAGE_FNS[name](batch, algo(**kw))


# ---------------------------------------------------------------- advantages

# three groups: {1e30, -1e30}, {1e30} alone, {-1e30, 5, 5}
HUGE = [1e30, -1e30, 1e30, -1e30, 5.0, 5.0]
HUGE_GROUPS = [0, 0, 1, 2, 2, 2]
S3 = 1 / math.sqrt(3)
HUGE_WANT = {
    # {1e30, -1e30}: mean 0, unbiased std sqrt(2e60 / 1) = 1.41421e30 -> +-1/sqrt(2)
    # {1e30}: a group of one -> 0
    # {-1e30, 5, 5}: mean -3.3333e29 (5 is below 1e30's spacing), deviations -6.6667e29, 3.3333e29 x2,
    #   std sqrt((4.4444e59 + 2 x 1.1111e59) / 2) = 5.7735e29 -> -2/sqrt(3), 1/sqrt(3), 1/sqrt(3)
    "grpo": [math.sqrt(0.5), -math.sqrt(0.5), 0.0, -2 * S3, S3, S3],
    # R - mean: +-1e30; 0; -6.6667e29, 3.3333e29, 3.3333e29
    "dr_grpo": [1e30, -1e30, 0.0, -2e30 / 3, 1e30 / 3, 1e30 / 3],
    # R_i - mean of the others: 1e30 - -1e30 = 2e30, -2e30; 0; -1e30 - 5, 5 - (-1e30 + 5) / 2 = 5e29 (x2)
    "rloo": [2e30, -2e30, 0.0, -1e30, 5e29, 5e29],
    # baseline tau (logsumexp(R / tau) - log G) with tau = 1, M = the group max:
    # {1e30, -1e30}: M + log((1 + e^-2e30) / 2) = 1e30 - log 2 -> A = log 2 = 0.693147, -2e30 + log 2 = -2e30
    # {1e30}: 0; {-1e30, 5, 5}: 5 + log((e^-1e30 + 2) / 3) = 5 + log(2/3) -> A = -1e30, -log(2/3) = 0.405465 x2
    "logavgexp": [math.log(2), -2e30, 0.0, -1e30, -math.log(2 / 3), -math.log(2 / 3)],
}


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "logavgexp"])
def test_outcome_advantages_of_rewards_of_1e30(name, dtype):
    kw = dict(opmd_baseline="logavgexp", tau=1.0) if name == "logavgexp" else {}
    got = advantages("opmd" if name == "logavgexp" else name, HUGE, HUGE_GROUPS, dtype, **kw)
    assert got.dtype == dtype and torch.isfinite(got).all()
    # float32's 1e30 is 1.0000000150e30: the same ratios, the same values to 1e-6 of their size
    torch.testing.assert_close(got[:, 0].double(), torch.tensor(HUGE_WANT[name], dtype=F64), rtol=1e-6, atol=1e-6)
    assert (got[:, 0] == got[:, 1]).all()  # broadcast over the response tokens
    assert got[4, 0] == got[5, 0]  # equal rewards, equal advantages, whatever the group's spread


def test_bfloat16_rewards_give_float32_advantages_of_their_values():
    # {1, 0, 0, 0}: mean 0.25, unbiased var (0.75^2 + 3 x 0.25^2) / 3 = 0.25, std 0.5 (+1e-6)
    # -> 0.75 / 0.5 = 1.5, -0.25 / 0.5 = -0.5 (x 0.999998)
    got = advantages("grpo", [1.0, 0.0, 0.0, 0.0], [0, 0, 0, 0], torch.bfloat16)
    assert got.dtype == F32
    torch.testing.assert_close(got[:, 0], torch.tensor([1.5, -0.5, -0.5, -0.5]) / (1 + 2e-6))


def test_reinforce_pp_discounts_over_the_counted_tokens_of_a_multi_turn_row():
    # row 0: reward 1, counted tokens at 0, 1, 3 (2 is an environment token); row 1: reward -1, one token.
    # gamma 0.9 per counted token after it: 0.81, 0.9, -, 1.0 and -1.0
    # whitened over the 4 tokens: mean 1.71 / 4 = 0.4275, deviations 0.3825, 0.4725, 0.5725, -1.4275,
    # unbiased var 2.735075 / 3 = 0.9116917, std 0.9548255 -> 0.400597, 0.494855, 0.599586, -1.495037
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    batch = {"rewards": torch.tensor([1.0, -1.0], dtype=F64), "group_index": torch.tensor([0, 1]), "response_mask": mask}
    got = ADVANTAGE_FNS["reinforce_pp"](batch, algo(gamma=0.9))
    want = torch.tensor([[0.400597, 0.494855, 0.0, 0.599586], [-1.495037, 0.0, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)


# ---------------------------------------------------------------- policy losses at |log-ratio| = 700

def call(name, x, adv, **kw):
    """Loss, gradient and metrics of `name` at log-ratios x (old log-prob -2) in float32."""
    old = torch.full((1, len(x)), -2.0)
    logp = (old + torch.tensor([x])).requires_grad_()
    batch = {"old_logp": old, "advantages": torch.tensor([adv]), "response_mask": torch.ones(1, len(x)), "ref_logp": None}
    loss, metrics = POLICY_LOSS_FNS[name](logp, batch, algo(**kw))
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    assert loss.dtype == F32 and torch.isfinite(loss).all() and torch.isfinite(grad).all()
    assert all(math.isfinite(v) for v in metrics.values())
    return loss[0].tolist(), grad[0].tolist()


E20 = math.exp(20.0)  # the log-ratio is clamped to +-20 before exp (exp(700) is inf in float32)


@pytest.mark.parametrize("c", [None, 3.0])
def test_ppo_clip_at_log_ratio_700_in_float32(c):
    loss, grad = call("ppo_clip", [700.0, -700.0, 700.0, -700.0], [1.0, 1.0, -1.0, -1.0],
                      clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=c)
    # A = 1, r = e^20: max(-e^20, -1.28) = -1.28; A = 1, r = e^-20: max(-2.06e-9, -0.8) = -2.06e-9
    # A = -1, r = e^20: max(e^20, 1.28) = 4.85165e8, dual clip min(., 3) = 3; A = -1, r = e^-20: max(2.06e-9, 0.8) = 0.8
    want = [-1.28, -1 / E20, E20 if c is None else 3.0, 0.8]
    assert loss == pytest.approx(want, rel=1e-6)
    assert grad == [0.0] * 4  # every token beyond the clamp or the clip: no gradient


def test_sequence_ratio_losses_at_log_ratio_700_in_float32():
    x = [700.0, -700.0, 700.0]
    # GSPO: s = exp(mean log-ratio = 233.3, capped at 10) = e^10 = 22026.47 on every token
    # A = 1: max(-e^10, -(1 + 4e-4)) = -1.0004; A = -1: max(e^10, 1 - 3e-4) = 22026.47
    for a, want in [(1.0, -1.0004), (-1.0, math.exp(10.0))]:
        loss, grad = call("gspo", x, [a] * 3, clip_ratio_low=3e-4, clip_ratio_high=4e-4)
        assert loss == pytest.approx([want] * 3, rel=1e-6)
        assert grad == [0.0] * 3
    # GMPO, log-ratios clamped to +-20, then clipped to [-0.4, 0.4] pessimistically:
    # A = 1: min(x, clip) = 0.4, -20, 0.4 -> exp(-19.2 / 3 = -6.4) = 1.661557e-3, loss -1.661557e-3
    # A = -1: max(x, clip) = 20, -0.4, 20 -> exp(39.6 / 3 = 13.2) = 540364.94, loss 540364.94
    for a, want in [(1.0, -math.exp(-6.4)), (-1.0, math.exp(13.2))]:
        loss, _ = call("gmpo", x, [a] * 3, clip_ratio_low=0.4, clip_ratio_high=0.4)
        assert loss == pytest.approx([want] * 3, rel=1e-5)


def test_cpgd_at_log_ratio_700_in_float32():
    loss, grad = call("cpgd", [700.0, -700.0, 700.0, -700.0], [1.0, 1.0, -1.0, -1.0],
                      clip_ratio_low=0.2, clip_ratio_high=0.28)
    # A = 1: min(logp, old + log 1.28 = -1.753143) -> loss 1.753143 (clamped, no gradient); logp = -702 -> 702 (grad -1)
    # A = -1: max(logp = 698, old + log 0.8 = -2.223144) -> loss 698 (grad 1); logp = -702 -> -2.223144 (clamped)
    assert loss == pytest.approx([2 - math.log(1.28), 702.0, 698.0, -2 + math.log(0.8)], rel=1e-6)
    assert grad == [0.0, -1.0, 1.0, 0.0]


@pytest.mark.parametrize("low", [1.0, 1.5, math.inf])
def test_cpgd_with_clip_ratio_low_of_1_or_more_has_no_lower_bound(low):
    # the plan accepts clip_ratio_low in [0, inf] ("inf: no lower clip"); 1 - low <= 0 has no log,
    # and math.log1p(-low) raised "math domain error" from inside the trainer
    loss, grad = call("cpgd", [-1.0, 0.1, -50.0], [-1.0, 1.0, -2.0], clip_ratio_low=low, clip_ratio_high=0.28)
    # A = -1, logp = -3: no lower bound, loss -A logp = -3 (grad 1); A = 1, logp = -1.9 below
    # old + log 1.28 = -1.753: loss 1.9 (grad -1); A = -2, logp = -52: loss -104 (grad 2)
    assert loss == pytest.approx([-3.0, 1.9, -104.0])
    assert grad == [1.0, -1.0, 2.0]


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "gmpo", "cpgd", "opmd", "sft"])
def test_a_batch_without_a_response_token_gives_a_loss_and_gradient_of_0(name, mode):
    logp = torch.full((2, 3), -1.0).requires_grad_()
    mask = torch.zeros(2, 3)
    batch = {"old_logp": torch.full((2, 3), -50.0), "advantages": torch.zeros(2, 3), "response_mask": mask, "ref_logp": None}
    loss_mat, metrics = POLICY_LOSS_FNS[name](logp, batch, algo())
    loss = agg_loss(loss_mat, mask, mode, num_seqs=2, num_tokens=0, max_len=3)
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == 0.0 and (grad == 0).all()
    assert all(v == 0 for v in metrics.values())


# ---------------------------------------------------------------- decoupled weights


def test_a_decoupled_weight_of_two_minus_inf_log_probs_is_the_cap_not_nan():
    # one stale row: w = min(exp(old - behav), 5): exp(-1 + 1.5) = 1.648721; -inf - -inf has no value:
    # beyond the cap, 5 (it was NaN, and so were the loss, the gradient and the update); -1 - -inf: 5
    stale = SimpleNamespace(policy_version=0, logprobs=[-1.5, -math.inf, -math.inf], prompt_length=2, token_versions=None)
    old = torch.tensor([[0.0, -1.0, -math.inf, -1.0]], dtype=F64)
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]], dtype=F64)
    w = off_policy.correct([stale], old, mask, 2, SimpleNamespace(off_policy_correction="decoupled", behavior_weight_cap=5.0))
    torch.testing.assert_close(w, torch.tensor([[1.0, math.exp(0.5), 5.0, 5.0]], dtype=F64))


# ---------------------------------------------------------------- the trainer's micro-batches


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    ["algorithm=gspo"],  # seq-mean-token-mean, a sequence ratio
    ["algorithm=gmpo"],
    ["algorithm=dr_grpo"],  # seq-mean-token-sum-norm
    ["algorithm.loss_agg_mode=seq-mean-token-sum", "algorithm.kl_loss_fn=k3", "algorithm.kl_loss_coef=0.1",
     "algorithm.entropy_coef=0.01"],  # every row trained: the KL and entropy terms read them all
], ids=["gspo", "gmpo", "dr_grpo", "kl_entropy"])
def test_micro_batches_give_the_one_batch_gradient_for_every_mode(extra):
    from test_trainer import experiences, make_trainer

    batch = experiences(n_groups=6, group=4)  # 24 rows of 1 to 6 response tokens
    whole, split = make_trainer(64, extra), make_trainer(4, extra)  # 1 micro-batch against 6 of unequal tokens
    m_whole, m_split = whole.train_step(batch), split.train_step(batch)
    for (name, a), (_, b) in zip(whole.model.named_parameters(), split.model.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-7, msg=name)
    assert m_split["loss/policy"] == pytest.approx(m_whole["loss/policy"], rel=1e-5, abs=1e-8)
    assert m_split["actor/grad_norm"] == pytest.approx(m_whole["actor/grad_norm"], rel=1e-5)


@pytest.mark.slow  # a Ray run of two fsdp2 ranks
@pytest.mark.parametrize("extra", [
    ["algorithm=gspo"],  # seq-mean-token-mean: each rank divides by the whole mini-batch's rows
    ["algorithm.loss_agg_mode=seq-mean-token-sum", "algorithm.kl_loss_fn=k3", "algorithm.kl_loss_coef=0.1",
     "algorithm.entropy_coef=0.01"],
], ids=["gspo", "kl_entropy"])
def test_two_ranks_update_as_one_process_for_the_sequence_modes(tmp_path, extra):
    import ray
    from test_fsdp import two_ranks_as_one_process

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        # 128 rows then 9 (5 + 4 over the ranks): the same loss, grad norm and weights as one process
        m_two, _, _ = two_ranks_as_one_process(tmp_path, extra)
    finally:
        ray.shutdown()
    assert m_two["train/experiences"] == 9
