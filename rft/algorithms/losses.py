"""Policy losses: `fn(logp, old_logp, advantages, mask, cfg) -> (loss [N, T], metrics)`.

All tensors are [N, T] over response positions. The returned loss is per token, before
aggregation (`rft.algorithms.aggregation.agg_loss` owns the normaliser). Metrics are masked
sums with their token count, so callers can add them up across micro-batches exactly.
"""

from __future__ import annotations

import torch

# exp() of a log-ratio beyond this overflows nothing but means the sample is useless; clamp it
LOG_RATIO_CLAMP = 20.0


def ppo_clip_loss(logp, old_logp, advantages, mask, cfg):
    """PPO clipped surrogate (Schulman et al. 2017), with DAPO's clip-higher bounds.

    ratio = exp(logp - old_logp); pg_loss1 = -A * ratio;
    pg_loss2 = -A * clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high);
    loss = max(pg_loss1, pg_loss2). The log-ratio is clamped to +-20 first.
    """
    log_ratio = torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    loss = torch.maximum(pg_loss1, pg_loss2)
    clipped = (pg_loss2 > pg_loss1).float()
    # approx KL(old || new), Schulman's k3 on the ratio
    approx_kl = ratio - 1.0 - log_ratio
    metrics = {
        "actor/clip_frac": (clipped * mask).sum().item(),
        "actor/approx_kl": (approx_kl.detach() * mask).sum().item(),
    }
    return loss, metrics


def sft_loss(logp, old_logp, advantages, mask, cfg):
    """Supervised fine-tuning: -log p(token) on response tokens."""
    return -logp, {}


POLICY_LOSS_FNS = {"ppo_clip": ppo_clip_loss, "sft": sft_loss}
