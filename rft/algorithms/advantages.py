"""Advantage estimators: `fn(batch, cfg) -> advantages [N, T]`.

`batch` holds `rewards` [N] (one scalar per sequence), `group_index` [N] (which task's group
each sequence belongs to, as 0..G-1) and `response_mask` [N, T]. Sequence-level estimators
broadcast their value over the response tokens; masked positions are 0.

Equal rewards give advantages of exactly 0, whatever the value and dtype. Means are not enough for
that: the float mean of three 0.9s is one rounding step off 0.9 (in float64 too), and dividing by
the std that step makes gives advantages of +-0.05..0.3 from nothing. So every mean here is taken
of deviations from a member of the set (mean = ref + mean(x - ref)), in float64: equal values then
have deviations of exactly 0. The result is float32, or float64 for float64 inputs.
"""

from __future__ import annotations

import torch

EPS = 1e-6


def _out_dtype(*tensors) -> torch.dtype:
    """float32, or wider where an input is wider (bfloat16 and float16 rewards give float32)."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _group_max(x: torch.Tensor, group_index: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Each sequence's group maximum: a member of the group, the reference value deviations are
    taken from."""
    top = x.new_zeros(n_groups).scatter_reduce(0, group_index, x, "amax", include_self=False)
    return top[group_index]


def _group_stats(rewards: torch.Tensor, group_index: torch.Tensor):
    """Per sequence, in float64: R_i - mean_g, the unbiased group std, and the group size.

    The mean is of the deviations from the group's maximum, so a group of equal rewards gives
    centred rewards and std of exactly 0.
    """
    r = rewards.double()
    n_groups = int(group_index.max()) + 1
    dev = r - _group_max(r, group_index, n_groups)
    count = r.new_zeros(n_groups).index_add_(0, group_index, torch.ones_like(r))
    centred = dev - (r.new_zeros(n_groups).index_add_(0, group_index, dev) / count)[group_index]
    # squares of deviations taken over the group's largest one: |R| above ~1e154 squared to inf
    # (and A to 0) in float64, ~1e19 in float32
    scale = _group_max(centred.abs(), group_index, n_groups)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    sq = r.new_zeros(n_groups).index_add_(0, group_index, (centred / scale) ** 2)
    # unbiased (N - 1); a group of one has no spread to measure
    std = scale * torch.sqrt(sq[group_index] / (count[group_index] - 1).clamp(min=1))
    return centred, std, count[group_index]


def grpo_advantage(batch: dict, cfg) -> torch.Tensor:
    """GRPO (DeepSeekMath, arXiv 2402.03300): A_i = (R_i - mean_g) / (std_g + eps).

    std is unbiased (N-1), eps = 1e-6. Departure from verl: a group of one gets A = 0 (verl uses
    mean 0, std 1 there, i.e. A = R) — we prefer no signal to an unbaselined one. A group whose
    rewards are all equal gets A = 0.
    """
    rewards, mask = batch["rewards"], batch["response_mask"]
    centred, std, count = _group_stats(rewards, batch["group_index"])
    adv = torch.where(count > 1, centred / (std + EPS), torch.zeros_like(centred))
    return adv.to(_out_dtype(rewards))[:, None] * mask


def dr_grpo_advantage(batch: dict, cfg) -> torch.Tensor:
    """Dr. GRPO (arXiv 2503.20783): A_i = R_i - mean_g, no division by the group std.

    Pair it with loss_agg_mode=seq-mean-token-sum-norm (a constant length normaliser), as the paper
    does: together they remove GRPO's length and difficulty biases. A group of one gets A = 0.
    """
    rewards, mask = batch["rewards"], batch["response_mask"]
    centred, _, _ = _group_stats(rewards, batch["group_index"])
    return centred.to(_out_dtype(rewards))[:, None] * mask


def rloo_advantage(batch: dict, cfg) -> torch.Tensor:
    """RLOO (arXiv 2402.14740): A_i = R_i - mean_{j != i} R_j = G / (G - 1) * (R_i - mean_g).

    Each rollout's baseline is the mean of the others in its group (unbiased). A group of one has
    no others: A = 0.
    """
    rewards, mask = batch["rewards"], batch["response_mask"]
    centred, _, count = _group_stats(rewards, batch["group_index"])
    scale = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.zeros_like(count))
    return (scale * centred).to(_out_dtype(rewards))[:, None] * mask


def opmd_advantage(batch: dict, cfg) -> torch.Tensor:
    """OPMD (Trinity-RFT, arXiv 2505.17826): A = R - baseline_g.

    baseline = group mean (`opmd_baseline: mean`), or the soft maximum
    tau * (logsumexp(R / tau) - log G) (`opmd_baseline: logavgexp`), which tends to the group max as
    tau -> 0 and to the mean as tau -> inf. The soft maximum is computed as
    M + tau * log(mean_g exp((R - M) / tau)) with M the group max: no overflow however small tau,
    and a group of equal rewards (a group of one too) gets exactly M, so A = 0.
    """
    rewards, mask, gi = batch["rewards"], batch["response_mask"], batch["group_index"]
    if cfg.opmd_baseline == "mean":
        adv, _, _ = _group_stats(rewards, gi)
    else:
        r = rewards.double()
        n_groups = int(gi.max()) + 1
        dev = r - _group_max(r, gi, n_groups)  # <= 0, and 0 for the max itself: the sum below >= 1
        count = r.new_zeros(n_groups).index_add_(0, gi, torch.ones_like(r))
        mean_exp = r.new_zeros(n_groups).index_add_(0, gi, torch.exp(dev / cfg.tau)) / count
        adv = dev - cfg.tau * torch.log(mean_exp)[gi]
    return adv.to(_out_dtype(rewards))[:, None] * mask


def _whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(x - mean) / (std + eps) over the masked-in entries of the whole batch (unbiased std), in
    float64; masked entries 0. The mean is of the deviations from one masked-in entry, so equal
    entries whiten to exactly 0."""
    x, m = x.double(), mask.double()
    # the first masked-in entry (entry 0 when there is none: nothing is kept then); take() keeps it
    # on the device, where indexing with a 0-d tensor would wait for the host
    ref = x.take((m.flatten() != 0).to(torch.uint8).argmax())
    dev = (x - ref) * m
    n = m.sum().clamp(min=1)
    centred = (dev - dev.sum() / n) * m
    scale = centred.abs().max().clamp(min=torch.finfo(centred.dtype).tiny)  # squares that stay finite, as above
    std = scale * torch.sqrt(((centred / scale) ** 2).sum() / (n - 1).clamp(min=1))
    return centred / (std + EPS)


def _discounted_whitened(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """The reward sits on each sequence's last response token; return_t = gamma^(last - t) * R,
    t counting the tokens the loss counts only: a multi-turn row's environment tokens are stepped
    over, as gae_returns does, so every turn of the row sees its reward; then whiten over every
    response token of the batch."""
    pos = mask.double().cumsum(-1)  # 1..len on response tokens
    last = pos.max(-1, keepdim=True).values  # response length per row
    returns = rewards.double()[:, None] * gamma ** (last - pos)
    return _whiten(returns, mask)


def reinforce_pp_advantage(batch: dict, cfg) -> torch.Tensor:
    """REINFORCE++ (arXiv 2501.03262): gamma-discounted per-token return, whitened over the batch.

    Departure: the paper folds a per-token KL penalty into each token's reward; here
    algorithm.kl_penalty_fn subtracts one sum per sequence from the reward before the advantages
    (rft.algorithms.shaping.kl_penalty), or KL is a loss term (kl_loss_fn).
    """
    rewards, mask = batch["rewards"], batch["response_mask"]
    return _discounted_whitened(rewards, mask, cfg.gamma).to(_out_dtype(rewards, mask))


def reinforce_pp_baseline_advantage(batch: dict, cfg) -> torch.Tensor:
    """REINFORCE++-baseline: subtract the group mean reward first, then as reinforce_pp.

    A batch whose groups are each flat gets A = 0. In a batch with signal, a flat group's tokens
    get (0 - batch mean) / batch std, as in the reference implementations' whitening.
    """
    rewards, mask = batch["rewards"], batch["response_mask"]
    centred, _, _ = _group_stats(rewards, batch["group_index"])
    return _discounted_whitened(centred, mask, cfg.gamma).to(_out_dtype(rewards, mask))


def gae_returns(rewards, values, mask, gamma: float, lam: float):
    """GAE (arXiv 1506.02438) with the sequence reward on its last response token.

    delta_t = r_t + gamma V_{t+1} - V_t;  A_t = delta_t + gamma lam A_{t+1};  returns = A + V.
    V_{t+1} and A_{t+1} are 0 after the last response token. t+1 is the next token the loss counts:
    tokens outside the mask inside a response (a multi-turn row's environment or user turns) are
    stepped over, so an earlier turn sees the reward and the values after them, as in verl's
    multi-turn GAE. Returns (advantages, returns), [N, T], in float32 or the inputs' wider dtype.
    """
    out = _out_dtype(rewards, values, mask)
    return tuple(t.to(out) for t in _gae(rewards, values, mask, gamma, lam))


def _gae(rewards, values, mask, gamma: float, lam: float):
    """gae_returns in float64, whatever the inputs' dtypes (a float32 mask must not round the rewards)."""
    rewards, values, mask = rewards.double(), values.double(), mask.double()
    T = mask.shape[1]
    last = (mask * torch.arange(T, device=mask.device)).argmax(-1)  # index of each row's last response token
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(len(rewards), device=mask.device), last] = rewards * (mask.sum(-1) > 0)
    adv = torch.zeros_like(mask)
    next_adv = rewards.new_zeros(len(rewards))
    next_value = rewards.new_zeros(len(rewards))
    for t in reversed(range(T)):
        counted = mask[:, t] > 0
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(counted, a, 0.0)
        # a token the loss does not count passes the next counted token's advantage and value on
        next_adv = torch.where(counted, a, next_adv)
        next_value = torch.where(counted, values[:, t], next_value)
    return adv, (adv + values) * mask


def gae_advantage(batch: dict, cfg) -> torch.Tensor:
    """PPO's advantages: GAE on the critic's values (batch["values"]), whitened over the batch.

    Equal GAE advantages (equal rewards with gamma = lam = 1 and constant values) whiten to 0.
    """
    rewards, values, mask = batch["rewards"], batch["values"], batch["response_mask"]
    adv, _ = _gae(rewards, values, mask, cfg.gamma, cfg.lam)
    return _whiten(adv, mask).to(_out_dtype(rewards, values, mask))


# advantage functions that need a critic's values in batch["values"]


def no_advantage(batch: dict, cfg) -> torch.Tensor:
    """For losses that ignore advantages (SFT): zeros."""
    return torch.zeros_like(batch["response_mask"], dtype=torch.float32)

