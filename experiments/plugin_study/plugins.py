"""A study's own algorithm, reward and experience operator, each given to rft as a dotted path
(README "Extension points"); rft/ is not touched."""

import torch


def sign_advantage(batch, cfg, scale: float = 1.0):
    """+scale for a rollout above its group's mean reward, -scale below, 0 at it: a constant per
    group and sign, on every response token."""
    rewards, groups, mask = batch["rewards"], batch["group_index"], batch["response_mask"]
    n = int(groups.max()) + 1
    total = rewards.new_zeros(n).index_add_(0, groups, rewards)
    count = rewards.new_zeros(n).index_add_(0, groups, torch.ones_like(rewards))
    adv = scale * torch.sign(rewards - (total / count)[groups])
    return adv.to(mask.dtype)[:, None] * mask


def reinforce_loss(logp, batch, cfg, weight: float = 1.0):
    """Plain REINFORCE: -weight x advantage x log p(token), no ratio and no clipping."""
    mask = batch["response_mask"]
    loss = -weight * batch["advantages"] * torch.where(mask > 0, logp, torch.zeros_like(logp))
    return loss * mask, {}


def length_reward(prompt, response, task, per_char: float = 0.25):
    """per_char x the response's length in characters, at most 1: a reward of known values."""
    return min(1.0, per_char * len(response))


def add_bonus(experiences, bonus: float = 0.5):
    """An experience operator: `bonus` added to every reward (a reward part of its own)."""
    for e in experiences:
        e.reward += bonus
        e.reward_parts["bonus"] = bonus
    return experiences
