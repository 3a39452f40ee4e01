"""A third audit of rft/algorithms at the edges a careless batch brings, in float32 and float64:
a KL of a policy next to its reference (float32's exp(x) - 1 rounds it away), groups of every
size interleaved in one batch with rewards of 1e6 and 1e-8, an 8k-token row beside a one-token
row and an empty one under each aggregation mode and micro-batch split, half-precision inputs, and
the rollout IS weights on both sides of their cap. Expected values are written from the formulas
(/ALGORITHMS.md, the papers) with the arithmetic in the comments, never by calling rft.
"""

import math

import pytest
import torch
from omegaconf import OmegaConf

from rft.algorithms import KL_FNS, POLICY_LOSS_FNS
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
