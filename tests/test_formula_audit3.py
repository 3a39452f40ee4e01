"""A third audit of rft/algorithms at the edges a careless batch brings, in float32 and float64:
a KL of a policy next to its reference (float32's exp(x) - 1 rounds it away), half-precision
inputs and a bfloat16 model, groups of every size interleaved in one batch with rewards of 1e6 and
1e-8, an 8k-token row beside a one-token row and an empty one under each aggregation mode and cut
into micro-batches (with TIS weights and a k3 term), and DPO's margin of 8k-token answers.
Expected values are written from the formulas (the papers rft/algorithms cites) with the
arithmetic in the comments, never by calling rft.
"""

import math

import pytest
import torch
from omegaconf import OmegaConf

from rft.algorithms import KL_FNS, POLICY_LOSS_FNS, rollout_is
from rft.config import AlgorithmConfig

F32, F64 = torch.float32, torch.float64


def algo(**kw):
    return OmegaConf.structured(AlgorithmConfig(**kw))


def call_loss(name, logp, old, adv, mask, **kw):
    batch = {"old_logp": old, "advantages": adv, "response_mask": mask, "ref_logp": None}
    return POLICY_LOSS_FNS[name](logp, batch, algo(**kw))


# ---------------------------------------------------------------- KL near 0

# x = logp - ref, powers of two: exact in float32, so the float64 formula below is the value of
# the very inputs rft gets
SMALL_X = [2.0**-10, -(2.0**-10), 2.0**-13, -(2.0**-13), 2.0**-16]


def k3_exact(x: float) -> float:
    """exp(-x) - (-x) - 1 = expm1(-x) + x, ~ x^2 / 2 - x^3 / 6: x = 2^-13 = 1.2207e-4 gives
    7.4506e-9 - 3.0e-13 = 7.45028e-9; x = 2^-10 = 9.766e-4 gives 4.7684e-7 - 1.55e-10 = 4.76682e-7."""
    return math.expm1(-x) + x


@pytest.mark.parametrize("name", ["k3", "low_var_kl", "ppo_clip", "gspo", "gmpo", "cpgd"])
def test_a_kl_next_to_the_reference_survives_float32(name):
    # exp(-x) - 1 in float32 has a rounding step of 6e-8 near 1: k3 of x = 1.2e-4 (7.45e-9) came out
    # exactly 0, so actor/kl and the k3 KL penalty read 0 for a policy that had moved, and
    # actor/approx_kl (the same estimator on the ratio to the old policy) likewise
    x = torch.tensor([SMALL_X], dtype=F32)
    base = torch.full_like(x, -2.0)  # -2 + 2^-16 is exact too (float32 has 2^-22 steps at 2)
    if name in ("k3", "low_var_kl"):
        got = KL_FNS[name](base + x, base)[0].tolist()
        assert got == pytest.approx([k3_exact(v) for v in SMALL_X], rel=1e-3)
        assert all(v > 0 for v in got)  # k3 >= 0 always; it was 0 for the three smallest
    else:
        # approx KL(old || new) = sum_t exp(x_t) - 1 - x_t, x_t = logp - old: k3 at -x_t;
        # 4.77e-7 x 2 + 7.45e-9 x 2 + 1.16e-10 = 9.6847e-7 (the small ones were 1.5% of it, and lost)
        _, metrics = call_loss(name, base + x, base, torch.ones_like(x), torch.ones_like(x))
        assert metrics["actor/approx_kl"] == pytest.approx(math.fsum(k3_exact(-v) for v in SMALL_X), rel=1e-3)


# ---------------------------------------------------------------- half precision


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_are_computed_in_float32(dtype):
    # log-ratios 15, 15, 0.125, -15 (old -2: exact in both halves), A = 0 (a flat group's), 1, 1, -1
    x, a = [15.0, 15.0, 0.125, -15.0], [0.0, 1.0, 1.0, -1.0]
    old = torch.full((1, 4), -2.0, dtype=dtype)
    logp = (old + torch.tensor([x], dtype=dtype)).requires_grad_()
    adv, mask = torch.tensor([a], dtype=dtype), torch.ones(1, 4, dtype=dtype)
    loss, _ = call_loss("ppo_clip", logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    # max(-A r, -A clip(r, 0.8, 1.28)): A = 0: 0 (in float16 e^15 = 3.3e6 overflowed 65504: 0 x inf
    # = NaN, value and gradient); -1.28 (clipped, no gradient); -e^0.125 = -1.133148, gradient the
    # same (bfloat16's exp gave 1.1328); A = -1, r = e^-15: max(3.1e-7, 0.8) = 0.8 (clipped)
    e = math.exp(0.125)
    assert loss.dtype == F32 and grad.dtype == dtype  # the gradient reaches the half-precision logp
    assert loss[0].tolist() == pytest.approx([0.0, -1.28, -e, 0.8], rel=1e-6)
    assert grad[0].float().tolist() == pytest.approx([0.0, 0.0, -e, 0.0], rel=4e-3)  # (grad rounded to dtype)
    kl = KL_FNS["k3"](logp, old)
    (grad,) = torch.autograd.grad(kl.sum(), logp)
    # k3 = exp(-x) + x - 1, clamped to 10: x = 15: 14.0000003 -> 10; x = 0.125: 0.0074969;
    # x = -15: e^15 - 16 -> 10 (float16: e^15 = inf, 10 after the clamp, its gradient 0 x inf = NaN);
    # gradient 1 - exp(-x) where not clamped: 1 - e^-0.125 = 0.117503
    assert kl.dtype == F32 and kl[0].tolist() == pytest.approx([10.0, 10.0, math.expm1(-0.125) + 0.125, 10.0], rel=1e-6)
    assert grad[0].float().tolist() == pytest.approx([0.0, 0.0, -math.expm1(-0.125), 0.0], rel=4e-3)


def test_a_bfloat16_models_loss_is_computed_in_float32():
    # what the trainer does (rft.trainer.logprobs): the logits of a bfloat16 model are made float32
    # before the log-softmax, so the log-probs, the ratio and the loss are float32, the gradient
    # reaching the bfloat16 weights
    from transformers import LlamaConfig, LlamaForCausalLM

    from rft.trainer.logprobs import token_logprobs

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2)).to(torch.bfloat16)
    ids = torch.randint(0, 64, (2, 6))
    logp, entropy = token_logprobs(model, ids, torch.ones_like(ids))
    mask = torch.ones_like(logp)
    loss, _ = call_loss("ppo_clip", logp, logp.detach() - 0.1, torch.ones_like(logp), mask)
    assert logp.dtype == entropy.dtype == loss.dtype == F32
    loss.sum().backward()
    head = model.get_output_embeddings().weight
    assert head.grad is not None and head.grad.dtype == torch.bfloat16 and head.grad.abs().sum() > 0


# ---------------------------------------------------------------- advantages of a careless batch

# groups interleaved as rows arrive, of sizes 3, 2, 4 and 1: {1e6, 1e6 + 1, 1e6 + 3} (float32 holds
# each: its spacing at 1e6 is 0.0625), {1e-8, 3e-8}, {0.9 x 4}, {5}
ROWS = [(0, 1e6), (1, 1e-8), (2, 0.9), (3, 5.0), (0, 1e6 + 1), (2, 0.9), (1, 3e-8), (2, 0.9), (0, 1e6 + 3), (2, 0.9)]
STD0 = math.sqrt(((4 / 3) ** 2 + (1 / 3) ** 2 + (5 / 3) ** 2) / 2)  # sqrt(42 / 9 / 2) = sqrt(7 / 3) = 1.527525
# group 0's mean is 1e6 + 4/3: deviations -4/3, -1/3, 5/3; group 1's 2e-8: deviations -1e-8, 1e-8
DEV = {0: [-4 / 3, -1 / 3, 5 / 3], 1: [-1e-8, 1e-8], 2: [0.0] * 4, 3: [0.0]}
LSE0 = math.log((math.exp(-3) + math.exp(-2) + 1) / 3)  # log((0.049787 + 0.135335 + 1) / 3) = -0.928755
LSE1 = math.log((math.exp(-2e-8) + 1) / 2)  # = -1e-8 + 1e-16 / 2 ... = -9.9999999e-9
WANT = {
    # (R - mean) / (unbiased std + 1e-6): -0.872872, -0.218218, 1.091089; -1e-8 / (1.414214e-8 + 1e-6)
    # = -0.00986055, +0.00986055; a flat group and a group of one: 0
    "grpo": {0: [d / (STD0 + 1e-6) for d in DEV[0]], 1: [d / (math.sqrt(2) * 1e-8 + 1e-6) for d in DEV[1]]},
    "dr_grpo": DEV,
    # G / (G - 1) x (R - mean): 1.5 x -> -2, -0.5, 2.5; 2 x -> -2e-8, 2e-8
    "rloo": {0: [-2.0, -0.5, 2.5], 1: [-2e-8, 2e-8]},
    # (R - max) - tau log(mean exp((R - max) / tau)), tau 1: -3 + 0.928755 = -2.071245, -1.071245, 0.928755;
    # -2e-8 - LSE1 = -1e-8, 0 - LSE1 = 1e-8
    "logavgexp": {0: [-3 - LSE0, -2 - LSE0, -LSE0], 1: [-2e-8 - LSE1, -LSE1]},
}


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "logavgexp"])
def test_interleaved_groups_of_every_size_with_rewards_of_1e6_and_1e_8(name, dtype):
    from rft.algorithms import ADVANTAGE_FNS

    groups, rewards = zip(*ROWS)
    mask = torch.ones(len(ROWS), 3, dtype=dtype)
    mask[3, 1:] = 0  # the group of one has a single token; row 5 none (truncated to nothing)
    mask[5] = 0
    kw = dict(opmd_baseline="logavgexp", tau=1.0) if name == "logavgexp" else {}
    batch = {"rewards": torch.tensor(rewards, dtype=dtype), "group_index": torch.tensor(groups), "response_mask": mask}
    got = ADVANTAGE_FNS["opmd" if name == "logavgexp" else name](batch, algo(**kw))
    seen = {g: iter(WANT[name].get(g, [0.0] * 4)) for g in range(4)}
    want = torch.tensor([[next(seen[g])] * 3 for g in groups], dtype=F64) * mask.double()
    assert got.dtype == dtype
    # float32's 1e-8 and 3e-8 are 1e-8 x (1 - 6e-9) and 3e-8 x (1 - 7e-9): the same to 1e-6
    tol = dict(rtol=1e-6, atol=1e-12) if dtype == F32 else dict(rtol=1e-9, atol=1e-15)
    torch.testing.assert_close(got.double(), want, **tol)
    assert (got[[2, 3, 5, 7, 9]] == 0).all()  # no signal is exactly 0, not a rounding step


# ---------------------------------------------------------------- 8k tokens, aggregation, micro-batches

LENS = [8192, 1, 0, 3]  # a long answer, a one-token one, one truncated to nothing, a short one
N_TOK, N_SEQ, MAX_LEN = 8196, 4, 8192
# per mode: the loss of -logp at logp = -0.5 on every token, and d loss / d logp per row's token
AGG_WANT = {
    "token-mean": (0.5, [-1 / N_TOK] * 4),  # 0.5 x 8196 / 8196; each token 1/8196
    "seq-mean-token-sum": (0.5 * N_TOK / N_SEQ, [-1 / N_SEQ] * 4),  # 4098 / 4 = 1024.5
    # (0.5 + 0.5 + 0 + 0.5) / 4 = 0.375: a token of the 8k answer weighs 1/(4 x 8192), 8192 times
    # less than the one-token answer's (GRPO's length bias)
    "seq-mean-token-mean": (0.375, [-1 / (N_SEQ * 8192), -1 / N_SEQ, 0.0, -1 / (N_SEQ * 3)]),
    # Dr. GRPO: 4098 / (4 x 8192) = 0.125061; every token the same weight, whatever its answer's length
    "seq-mean-token-sum-norm": (0.5 * N_TOK / (N_SEQ * MAX_LEN), [-1 / (N_SEQ * MAX_LEN)] * 4),
}


def _long_batch(dtype):
    mask = torch.zeros(len(LENS), max(LENS), dtype=dtype)
    for i, n in enumerate(LENS):
        mask[i, :n] = 1
    return mask


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("mode", list(AGG_WANT))
def test_an_8k_token_row_beside_short_and_empty_ones(mode, dtype):
    from rft.algorithms import agg_loss

    mask = _long_batch(dtype)
    logp = torch.full(mask.shape, -0.5, dtype=dtype, requires_grad=True)
    loss, _ = call_loss("sft", logp, None, None, mask)
    total = agg_loss(loss, mask, mode, N_SEQ, N_TOK, MAX_LEN)
    (grad,) = torch.autograd.grad(total, logp)
    value, per_row = AGG_WANT[mode]
    assert total.dtype == dtype and total.item() == pytest.approx(value, rel=1e-6)
    want = torch.tensor(per_row, dtype=F64)[:, None] * mask.double()
    torch.testing.assert_close(grad.double(), want, rtol=1e-6, atol=0)

    # the trainer's composition, micro-batch by micro-batch, each cut to its own longest row and
    # normalised by the whole batch's counts, adds up to the one-batch loss and gradient: ppo_clip
    # at log-ratios up to +-50, times a TIS weight (cap 2), plus 0.1 x k3 to the reference
    g = torch.Generator().manual_seed(0)
    x = torch.randn(mask.shape, generator=g, dtype=dtype) * 0.3
    x[0, :4] = torch.tensor([50.0, -50.0, 3.0, -3.0], dtype=dtype)
    old = torch.full(mask.shape, -2.0, dtype=dtype)
    engine = old + torch.randn(mask.shape, generator=g, dtype=dtype)
    ref = old + torch.randn(mask.shape, generator=g, dtype=dtype) * 0.1
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=dtype)[:, None] * mask
    logp = (old + x).requires_grad_()

    def loss_of(s, e):
        L = max(max(LENS[s:e]), 1)
        cut = lambda t: t[s:e, :L]  # noqa: E731
        m = cut(mask)
        lp = logp[s:e, :L]
        loss, _ = call_loss("ppo_clip", lp, cut(old), cut(adv), m, clip_ratio_c=3.0, clip_ratio_high=0.28)
        w, _ = rollout_is.weights(cut(old), cut(engine), m, "tis", 2.0)
        loss = loss * w + 0.1 * KL_FNS["k3"](lp, cut(ref))
        return agg_loss(loss, m, mode, N_SEQ, N_TOK, MAX_LEN)

    whole = loss_of(0, 4)
    (g_whole,) = torch.autograd.grad(whole, logp)
    split = [loss_of(s, e) for s, e in [(0, 1), (1, 3), (3, 4)]]
    (g_split,) = torch.autograd.grad(sum(split), logp)
    tol = dict(rtol=1e-5, atol=1e-9) if dtype == F32 else dict(rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(sum(split), whole, **tol)
    torch.testing.assert_close(g_split, g_whole, **tol)
    # log-ratios +-50: beyond the +-20 clamps of the ratio and of k3, no gradient; at 3 the ratio is
    # clipped (A = 1 > 0, e^3 > 1.28) but k3 still pulls towards the reference: 0.1 x (1 - e^-x) > 0,
    # times the mode's normaliser
    assert torch.isfinite(g_whole).all() and (g_whole[0, :2] == 0).all() and g_whole[0, 2] > 0


def test_dpo_margin_of_8k_token_answers_in_float32():
    # DPO's implicit reward beta (log pi(y) - log ref(y)) of an 8192-token answer: each sequence
    # log-prob is ~ -20000, where float32's spacing is 0.002, so the difference of the two sums
    # was off by ~5e-3 nats (its rounding) against a signal of ~8; summed per token, the
    # difference log pi - log ref of each token is exact (Sterbenz) and only their sum rounds
    T = 8192
    ref = -(torch.arange(T, dtype=F32) % 5 + 0.5)[None].expand(2, T).clone()  # -0.5 .. -4.5
    step = torch.tensor([[1e-3], [-1e-3]])  # chosen: 1e-3 above the reference per token, rejected: below
    logp = (ref + step).requires_grad_()
    mask = torch.ones(2, T)
    loss, metrics = POLICY_LOSS_FNS["dpo"](logp, {"response_mask": mask, "ref_logp": ref}, algo(dpo_beta=0.1))
    # the reference from the float32 inputs themselves, in float64: z = beta (sum_c - sum_r) ~ 0.1 x 16.4
    d = (logp.detach().double() - ref.double()).sum(-1)
    z = 0.1 * (d[0] - d[1]).item()
    margin, pairs = metrics["dpo/reward_margin"]
    assert pairs == 1 and margin == pytest.approx(z, abs=1e-5)
    # the pair's loss -log sigmoid(z) spread over its 2 x 8192 tokens, 2 l / n on each
    assert loss.sum().item() == pytest.approx(2 * math.log1p(math.exp(-z)), rel=1e-5)
