"""Advantage estimators: `fn(batch, cfg) -> advantages [N, T]`.

`batch` holds `rewards` [N] (one scalar per sequence), `group_index` [N] (which task's group
each sequence belongs to, as 0..G-1) and `response_mask` [N, T]. Sequence-level estimators
broadcast their value over the response tokens; masked positions are 0.
"""

from __future__ import annotations

import math

import torch

EPS = 1e-6


def _group_stats(rewards: torch.Tensor, group_index: torch.Tensor):
    """Per-sequence group mean, unbiased group std and group size."""
    n_groups = int(group_index.max()) + 1
    count = rewards.new_zeros(n_groups).index_add_(0, group_index, torch.ones_like(rewards))
    total = rewards.new_zeros(n_groups).index_add_(0, group_index, rewards)
    mean = total / count
    sq = rewards.new_zeros(n_groups).index_add_(
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


def dr_grpo_advantage(batch: dict, cfg) -> torch.Tensor:
    """Dr. GRPO (arXiv 2503.20783): A_i = R_i - mean_g, no division by the group std.

    Pair it with loss_agg_mode=seq-mean-token-sum-norm (a constant length normaliser), as the paper
    does: together they remove GRPO's length and difficulty biases. A group of one gets A = 0.
    """
    rewards, mask = batch["rewards"], batch["response_mask"]
    mean, _, _ = _group_stats(rewards, batch["group_index"])
    return (rewards - mean)[:, None] * mask


def rloo_advantage(batch: dict, cfg) -> torch.Tensor:
    """RLOO (arXiv 2402.14740): A_i = R_i - mean_{j != i} R_j = G / (G - 1) * (R_i - mean_g).

    Each rollout's baseline is the mean of the others in its group (unbiased). A group of one has
    no others: A = 0.
    """
    rewards, mask = batch["rewards"], batch["response_mask"]
    mean, _, count = _group_stats(rewards, batch["group_index"])
    scale = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.zeros_like(count))
    return (scale * (rewards - mean))[:, None] * mask


def opmd_advantage(batch: dict, cfg) -> torch.Tensor:
    """OPMD (Trinity-RFT, arXiv 2505.17826): A = R - baseline_g.

    baseline = group mean (`opmd_baseline: mean`), or the soft maximum
    tau * (logsumexp(R / tau) - log G) (`opmd_baseline: logavgexp`), which tends to the group max as
    tau -> 0 and to the mean as tau -> inf.
    """
    rewards, mask, gi = batch["rewards"], batch["response_mask"], batch["group_index"]
    if cfg.opmd_baseline == "mean":
        baseline, _, _ = _group_stats(rewards, gi)
    else:
        n_groups = int(gi.max()) + 1
        baseline = rewards.new_empty(n_groups)
        for g in range(n_groups):
            r = rewards[gi == g]
            baseline[g] = cfg.tau * (torch.logsumexp(r / cfg.tau, 0) - math.log(len(r)))
        baseline = baseline[gi]
    return (rewards - baseline)[:, None] * mask


def _discounted_whitened(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """The reward sits on each sequence's last response token; return_t = gamma^(last - t) * R;
    then whiten over every response token of the batch."""
    last = mask.cumsum(-1).max(-1, keepdim=True).values  # response length per row
    pos = mask.cumsum(-1)  # 1..len on response tokens
    returns = rewards[:, None] * gamma ** (last - pos) * mask
    n = mask.sum().clamp(min=1)
    mean = returns.sum() / n
    var = (((returns - mean) * mask) ** 2).sum() / (n - 1).clamp(min=1)
    return (returns - mean) / (var.sqrt() + EPS) * mask


def reinforce_pp_advantage(batch: dict, cfg) -> torch.Tensor:
    """REINFORCE++ (arXiv 2501.03262): gamma-discounted per-token return, whitened over the batch.

    Departure: the paper also folds a per-token KL penalty into the reward; here KL is available as
    a loss term (kl_loss_fn) instead.
    """
    return _discounted_whitened(batch["rewards"], batch["response_mask"], cfg.gamma)


def reinforce_pp_baseline_advantage(batch: dict, cfg) -> torch.Tensor:
    """REINFORCE++-baseline: subtract the group mean reward first, then as reinforce_pp."""
    mean, _, _ = _group_stats(batch["rewards"], batch["group_index"])
    return _discounted_whitened(batch["rewards"] - mean, batch["response_mask"], cfg.gamma)


def gae_returns(rewards, values, mask, gamma: float, lam: float):
    """GAE (arXiv 1506.02438) with the sequence reward on its last response token.

    delta_t = r_t + gamma V_{t+1} - V_t;  A_t = delta_t + gamma lam A_{t+1};  returns = A + V.
    V_{t+1} and A_{t+1} are 0 after the last response token. Returns (advantages, returns), [N, T].
    """
    T = mask.shape[1]
    last = (mask * torch.arange(T, device=mask.device)).argmax(-1)  # index of each row's last response token
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(len(rewards), device=mask.device), last] = rewards * (mask.sum(-1) > 0)
    adv = torch.zeros_like(mask)
    next_adv = rewards.new_zeros(len(rewards))
    next_value = rewards.new_zeros(len(rewards))
    for t in reversed(range(T)):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv[:, t] = (delta + gamma * lam * next_adv) * mask[:, t]
        next_adv, next_value = adv[:, t], values[:, t] * mask[:, t]
    return adv, (adv + values) * mask


def gae_advantage(batch: dict, cfg) -> torch.Tensor:
    """PPO's advantages: GAE on the critic's values (batch["values"]), whitened over the batch."""
    mask = batch["response_mask"]
    adv, _ = gae_returns(batch["rewards"], batch["values"], mask, cfg.gamma, cfg.lam)
    n = mask.sum().clamp(min=1)
    mean = adv.sum() / n
    std = torch.sqrt((((adv - mean) * mask) ** 2).sum() / (n - 1).clamp(min=1))
    return (adv - mean) / (std + EPS) * mask


# advantage functions that need a critic's values in batch["values"]
NEEDS_CRITIC = {"gae"}


def no_advantage(batch: dict, cfg) -> torch.Tensor:
    """For losses that ignore advantages (SFT): zeros."""
    return torch.zeros_like(batch["response_mask"], dtype=torch.float32)


ADVANTAGE_FNS = {
    "grpo": grpo_advantage,
    "dr_grpo": dr_grpo_advantage,
    "rloo": rloo_advantage,
    "opmd": opmd_advantage,
    "reinforce_pp": reinforce_pp_advantage,
    "reinforce_pp_baseline": reinforce_pp_baseline_advantage,
    "gae": gae_advantage,
    "none": no_advantage,
}
