"""Reward shaping: the one place that changes a reward after the reward function gave it.

Two optional components, each logged as its own metric:
- DAPO's overlong penalty (`algorithm.overlong_buffer_frac`), applied by the explorer to each
  rollout's reward as the reward part `overlong` (rft/scoring.py: stored in
  Experience.reward_parts, logged as `reward/overlong/mean`, <= 0).
- the KL penalty to the reference model (`algorithm.kl_penalty_fn`), applied by the trainer, which
  has the reference log-probs: `reward/kl_penalty` (mean KL sum per sequence, before the coefficient).
"""

from __future__ import annotations


def overlong_penalty(length: int, max_len: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft overlong punishment (arXiv 2503.14476), added to the reward.

    0 up to max_len - buffer_len tokens, then falling linearly to -factor at max_len:
    min(-(length - (max_len - buffer_len)) / buffer_len * factor, 0).
    """
    return min(-(length - (max_len - buffer_len)) / buffer_len * factor, 0.0)


def apply_overlong(exps, algo, max_len: int) -> None:
    """Add the overlong penalty to each experience's reward, as its part `overlong`."""
    from rft.scoring import add_part

    if algo.overlong_buffer_frac <= 0:
        return
    buffer_len = max(1, round(algo.overlong_buffer_frac * max_len))
    for e in exps:
        add_part(e, "overlong", overlong_penalty(e.response_length, max_len, buffer_len, algo.overlong_penalty_factor))


def kl_penalty(kl_fn, old_logp, ref_logp, mask):
    """The KL of each sampled response to the reference, summed over its tokens, [n]; the trainer
    subtracts kl_penalty_coef times it from the reward. Departure from REINFORCE++'s per-token
    placement: one sum per sequence."""
    return (kl_fn(old_logp, ref_logp) * mask).sum(-1)
