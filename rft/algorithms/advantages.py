"""Advantage estimators: `fn(batch, cfg) -> advantages [N, T]`.

`batch` holds `rewards` [N] (one scalar per sequence), `group_index` [N] (which task's group
each sequence belongs to, as 0..G-1) and `response_mask` [N, T]. Sequence-level estimators
broadcast their value over the response tokens; masked positions are 0.
"""

from __future__ import annotations

import torch

EPS = 1e-6


def _group_stats(rewards: torch.Tensor, group_index: torch.Tensor):
    """Per-sequence group mean, unbiased group std and group size."""
    n_groups = int(group_index.max()) + 1
    count = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, group_index, torch.ones_like(rewards))
    total = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, group_index, rewards)
    mean = total / count
    sq = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(
        0, group_index, (rewards - mean[group_index]) ** 2
    )
    # unbiased (N - 1); a group of one has no spread to measure
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    return mean[group_index], std[group_index], count[group_index]


def grpo_advantage(batch: dict, cfg) -> torch.Tensor:
    """GRPO (DeepSeekMath, arXiv 2402.03300): A_i = (R_i - mean_g) / (std_g + eps).

    std is unbiased (N-1), eps = 1e-6. Departure from verl: a group of one gets A = 0 (verl uses
    mean 0, std 1 there, i.e. A = R) — we prefer no signal to an unbaselined one. A group whose
    rewards are all equal gets A = 0.
    """
    rewards, mask = batch["rewards"], batch["response_mask"]
    mean, std, count = _group_stats(rewards, batch["group_index"])
    adv = torch.where(count > 1, (rewards - mean) / (std + EPS), torch.zeros_like(rewards))
    return adv[:, None] * mask


def no_advantage(batch: dict, cfg) -> torch.Tensor:
    """For losses that ignore advantages (SFT): zeros."""
    return torch.zeros_like(batch["response_mask"], dtype=torch.float32)


ADVANTAGE_FNS = {"grpo": grpo_advantage, "none": no_advantage}
