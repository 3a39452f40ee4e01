"""KL estimators of KL(pi || ref), per token: `fn(logp, ref_logp) -> [N, T]`.

J. Schulman, "Approximating KL divergence" (2020); x = logp - ref_logp on tokens sampled from pi.
Half-precision inputs are computed in float32 (rft.algorithms.aggregation.wide: k3's exp(20) is inf in
float16, and its gradient NaN).
"""

from __future__ import annotations

import torch

from rft.algorithms.aggregation import wide


def k1(logp, ref_logp):
    """k1 = x (unbiased, high variance, can be negative)."""
    logp, ref_logp = wide(logp, ref_logp)
    return logp - ref_logp


def k2(logp, ref_logp):
    """k2 = x^2 / 2 (biased, low variance)."""
    logp, ref_logp = wide(logp, ref_logp)
    return 0.5 * (logp - ref_logp) ** 2


def k3(logp, ref_logp):
    """k3 = exp(-x) - (-x) - 1 (unbiased, low variance; verl's low_var_kl).

    The input is clamped to +-20 and the output to +-10, as verl does, so one wild token cannot
    dominate the loss. Computed as expm1(-x) + x: exp(-x) - 1 in float32 is rounding below |x| ~ 3e-4
    (the KL of a policy near its reference, x^2 / 2 ~ 5e-8, lost to exp's rounding of ~6e-8: 0 at
    x = 1.2e-4, where the KL is 7.45e-9), where expm1 keeps it to ~1e-3 of its value.
    """
    logp, ref_logp = wide(logp, ref_logp)
    neg_x = torch.clamp(ref_logp - logp, -20.0, 20.0)
    return torch.clamp(torch.expm1(neg_x) - neg_x, -10.0, 10.0)


def abs_kl(logp, ref_logp):
    """|x|."""
    logp, ref_logp = wide(logp, ref_logp)
    return (logp - ref_logp).abs()

