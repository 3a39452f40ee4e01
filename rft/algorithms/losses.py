"""Policy losses: `fn(logp, batch, cfg) -> (loss [N, T], metrics)`.

`logp` [N, T] is the current policy's log-prob of each target token (with gradient). `batch`
holds, also [N, T] over the same positions: `old_logp` (the policy before this step's updates),
`advantages`, `response_mask`, and `ref_logp` (the frozen reference; None unless a KL term or the
loss itself needs it). The returned loss is per token, before aggregation
(`rft.algorithms.aggregation.agg_loss` owns the normaliser). Metrics are masked sums over tokens,
so callers can add them up across micro-batches exactly; a metric averaged over something else
is a (sum, count) pair, added up the same way (DPO's, over preference pairs).

Positions outside `response_mask` may hold anything (an environment's tokens, -inf or NaN
log-probs): each loss reads its inputs there through `masked` (0 instead), so that nothing there
reaches the loss, a sequence's sum, the metrics or the gradient, and returns 0 there. Inputs in
half precision are computed in float32 (`wide`).
"""

from __future__ import annotations

import math

import torch

from rft.algorithms.aggregation import masked, wide

# exp() of a log-ratio beyond this overflows nothing but means the sample is useless; clamp it
LOG_RATIO_CLAMP = 20.0


def _ratio_metrics(log_ratio, pg_loss1, pg_loss2, advantages, mask) -> dict:
    """Clip fractions (low and high bound separately, as clip-higher users watch) and approx KL.
    `log_ratio` is each token's own (clamped) log-ratio, also for a loss whose ratio is per sequence:
    approx KL means the same for every loss."""
    clipped = (pg_loss2 > pg_loss1).float() * mask
    # approx KL(old || new): Schulman's k3 on the token's ratio (a metric: no autograd graph), as
    # expm1: exp(x) - 1 - x is rounding in float32 below |x| ~ 3e-4, 0 at 1.2e-4 (rft.algorithms.kl.k3)
    log_ratio = log_ratio.detach()
    approx_kl = torch.expm1(log_ratio) - log_ratio
    return {
        "actor/clip_frac": clipped.sum().item(),
        "actor/clip_frac_low": (clipped * (advantages < 0)).sum().item(),
        "actor/clip_frac_high": (clipped * (advantages > 0)).sum().item(),
        "actor/approx_kl": (approx_kl * mask).sum().item(),
    }


def ppo_clip_loss(logp, batch, cfg):
    """PPO clipped surrogate (Schulman et al. 2017), with DAPO's clip-higher bounds.

    ratio = exp(logp - old_logp); pg_loss1 = -A * ratio;
    pg_loss2 = -A * clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high);
    loss = max(pg_loss1, pg_loss2). The log-ratio is clamped to +-20 first.
    Dual clip (arXiv 1912.09729), when clip_ratio_c is set: for A < 0 the loss is capped at
    -A * clip_ratio_c, so a huge ratio on a bad token cannot dominate.
    """
    logp, old_logp, advantages, mask = wide(logp, batch["old_logp"], batch["advantages"], batch["response_mask"])
    log_ratio = torch.clamp(masked(logp - old_logp, mask), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    loss = torch.maximum(pg_loss1, pg_loss2)
    if cfg.clip_ratio_c is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * cfg.clip_ratio_c), loss)
    return masked(loss, mask), _ratio_metrics(log_ratio, pg_loss1, pg_loss2, advantages, mask)


def gspo_loss(logp, batch, cfg):
    """GSPO (arXiv 2507.18071): one importance ratio per sequence, clipped per sequence.

    s_i = exp(mean_t (logp - old_logp)) over the response tokens of sequence i. The token form
    s_it = sg[s_i] * exp(logp_t - sg[logp_t]) has the value s_i and the gradient of the sequence
    ratio, so the usual clipped surrogate on s_it is GSPO. Use loss_agg_mode=seq-mean-token-mean
    and the paper's small clip ranges (3e-4, 4e-4). Departure (as verl): the log-ratio is capped
    at 10 before exp, so a sequence far off the old policy with A < 0 costs at most -A e^10, with
    no gradient, instead of overflowing.
    """
    logp, old_logp, advantages, mask = wide(logp, batch["old_logp"], batch["advantages"], batch["response_mask"])
    token_log_ratio = masked(logp - old_logp, mask)
    seq_log_ratio = token_log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)
    logp = masked(logp, mask)
    log_ratio = logp - logp.detach() + seq_log_ratio.detach()[:, None]
    log_ratio = torch.clamp(log_ratio, max=10.0)
    ratio = torch.exp(log_ratio)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    loss = torch.maximum(pg_loss1, pg_loss2)
    # the clip fractions are of the sequence ratio; approx KL of the tokens' own (the sequence's k3,
    # exp(s) - 1 - s of the mean log-ratio s, is 0 for token log-ratios +0.5 and -0.5)
    token_log_ratio = torch.clamp(token_log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return masked(loss, mask), _ratio_metrics(token_log_ratio, pg_loss1, pg_loss2, advantages, mask)


def gmpo_loss(logp, batch, cfg):
    """GMPO (arXiv 2507.20673): the geometric mean of the token ratios, clipped in log space.

    Per token, the log-ratio is clipped to [-clip_ratio_low, clip_ratio_high] pessimistically for
    the sign of A (min of clipped and unclipped for A > 0, max for A < 0); the sequence ratio is
    exp(mean_t clipped log-ratio) and the sequence loss -A * ratio. Here clip_ratio_low/high are
    bounds on the *log*-ratio (the paper uses 0.4). The per-token loss returned is the sequence's
    loss on each of its tokens: use loss_agg_mode=seq-mean-token-mean. With per-token advantages
    (gae, distill_coef), A is their mean over the row's response tokens, and its sign sets the
    side of every token's clip.
    Departure from verl's geo_mean loss (which leaves its +-20 clamp commented out): each
    token's log-ratio is clamped to +-20 first, as ppo_clip's, so a token 30 nats above the old
    policy with A < 0 counts as 20 (no gradient) instead of overflowing the sequence ratio.
    """
    logp, old_logp, advantages, mask = wide(logp, batch["old_logp"], batch["advantages"], batch["response_mask"])
    log_ratio = torch.clamp(masked(logp - old_logp, mask), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    # the sequence sums below multiply by the mask: an advantage of inf or NaN outside it (which
    # the advantage contract allows, rft.algorithms.contract) gave 0 x NaN = NaN to the whole row
    advantages = masked(advantages, mask)
    seq_adv = (advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    # the side of the clip is the sign of the advantage the ratio is multiplied by, the row's (the
    # paper's sgn(A_i)): a token's own sign, where per-token advantages differ in sign (gae,
    # distill_coef), clipped that token on the optimistic side for the row's loss
    sign = torch.sign(seq_adv)[:, None]
    clipped = torch.clamp(log_ratio, -cfg.clip_ratio_low, cfg.clip_ratio_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clipped)
    seq_ratio = torch.exp((pessimistic * mask).sum(-1) / mask.sum(-1).clamp(min=1))
    loss = masked((-seq_adv * seq_ratio)[:, None].expand_as(logp), mask)
    metrics = {
        # the tokens whose clip binds: the upper bound for A > 0, the lower for A < 0
        "actor/clip_frac": ((pessimistic != log_ratio).float() * (sign != 0) * mask).sum().item(),
        "actor/approx_kl": ((torch.expm1(log_ratio) - log_ratio).detach() * mask).sum().item(),
    }
    return loss, metrics


def cpgd_loss(logp, batch, cfg):
    """CPGD (arXiv 2505.12504): a policy-gradient loss on a clamped log-prob.

    logp_c = min(logp, old + log(1 + clip_ratio_high)) where A > 0,
             max(logp, old + log(1 - clip_ratio_low))  where A < 0;
    loss = -A * logp_c. Once a token's probability has moved far enough it gets no more gradient.
    Departure: the paper also adds a policy-drift term (a KL divergence between the old and the
    current policy, with a coefficient of its own) to the clipped objective; it is not part of this
    loss (algorithm.kl_loss_fn regularises towards the frozen reference, not the old policy).
    A clip_ratio_low of 1 or more (inf included) leaves no lower bound: a ratio is never below
    1 - clip_ratio_low <= 0, whose log does not exist (math.log1p raised "math domain error").
    """
    logp, old_logp, advantages, mask = wide(logp, batch["old_logp"], batch["advantages"], batch["response_mask"])
    logp, old_logp = masked(logp, mask), masked(old_logp, mask)
    upper = old_logp + math.log1p(cfg.clip_ratio_high)
    lower = old_logp + (math.log1p(-cfg.clip_ratio_low) if cfg.clip_ratio_low < 1 else -math.inf)
    # where, not minimum/maximum: those split the gradient of a tie in half, so a token exactly on
    # its bound (float32 lands there) got half its gradient; the paper's clip(log r, log(1 - eps),
    # log(1 + eps)) passes all of it there, as torch.clamp and ppo_clip's bounds do
    clamped = torch.where(advantages > 0, torch.where(logp > upper, upper, logp),
                          torch.where(logp < lower, lower, logp))
    log_ratio = torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    metrics = {
        # the tokens whose clamp binds (an advantage of 0 has no bound)
        "actor/clip_frac": ((clamped != logp).float() * (advantages != 0) * mask).sum().item(),
        "actor/approx_kl": ((torch.expm1(log_ratio) - log_ratio).detach() * mask).sum().item(),
    }
    return masked(-advantages * clamped, mask), metrics


def opmd_loss(logp, batch, cfg):
    """OPMD (Trinity-RFT, arXiv 2505.17826): -A * logp / (1 + tau), no importance ratio."""
    logp, advantages, mask = wide(logp, batch["advantages"], batch["response_mask"])
    return masked(-advantages * masked(logp, mask) / (1.0 + cfg.tau), mask), {}


def sft_loss(logp, batch, cfg):
    """Supervised fine-tuning: -log p(token) on response tokens."""
    logp, mask = wide(logp, batch["response_mask"])
    return -masked(logp, mask), {}


def dpo_loss(logp, batch, cfg):
    """DPO (arXiv 2305.18290): -log sigmoid(beta * ((lp_c - ref_c) - (lp_r - ref_r))).

    Rows come in pairs, chosen then rejected (rows 2k and 2k+1; `rft.data.readers.DatasetReader` with
    format.chosen_key/rejected_key builds them), and lp / ref are sequence log-probs (sums over
    response tokens). Each pair's loss l_k is spread evenly over the n_k tokens of both its rows,
    2 * l_k / n_k on each, so that loss_agg_mode=seq-mean-token-sum (which divides by the number of
    rows, two per pair) gives the mean over pairs, also when one row of a pair has no response
    tokens (dpo.yaml sets that mode). A pair with no response tokens at all has nowhere to put its
    loss: it contributes 0 (its rows still count in the normaliser).
    """
    logp, mask, ref = wide(logp, batch["response_mask"], batch["ref_logp"])
    # log pi(y) - log ref(y) as a sum of the tokens' differences, not a difference of two sums: a
    # long answer's sums (-20000 at 8k tokens, float32's spacing 0.002 there) rounded it by ~5e-3
    log_ratio = masked(logp - ref, mask).sum(-1)
    chosen_reward = cfg.dpo_beta * log_ratio[0::2]
    rejected_reward = cfg.dpo_beta * log_ratio[1::2]
    pair_loss = -torch.nn.functional.logsigmoid(chosen_reward - rejected_reward)
    # spread over the pair's tokens, not each row's own: a row without tokens must not take half
    pairs_tokens = (mask[0::2].sum(-1) + mask[1::2].sum(-1)).repeat_interleave(2)
    weights = mask / pairs_tokens[:, None].clamp(min=1)  # sums to 1 over a pair's tokens
    loss = 2 * pair_loss.repeat_interleave(2)[:, None] * weights
    margin = (chosen_reward - rejected_reward).detach()
    # means over the pairs that have tokens (a data-parallel rank's padding pairs have none), as
    # (sum, count): the same whatever the micro-batches
    counted = (pairs_tokens[0::2] > 0).to(margin.dtype)
    n = counted.sum().item()
    metrics = {
        "dpo/reward_margin": ((margin * counted).sum().item(), n),
        "dpo/accuracy": (((margin > 0).to(margin.dtype) * counted).sum().item(), n),
    }
    return loss, metrics



def bradley_terry_loss(logp, batch, cfg):
    """A reward model's Bradley-Terry loss (Ouyang et al., arXiv 2203.02155; TRL's RewardTrainer):
    -log sigmoid(r_chosen - r_rejected) per preference pair.

    With Needs.reward_head the trainer's model is a scalar head and `logp` holds each row's score r
    at its last response token (0 elsewhere), so a row's score is (logp * mask).sum(-1). Rows come
    in pairs, chosen then rejected (rows 2k, 2k+1), as for DPO, and the pair's loss is spread over
    its tokens the same way (dpo_loss), so loss_agg_mode=seq-mean-token-sum gives the mean over
    pairs. d loss / d r_chosen = -(1 - sigmoid(r_c - r_r)) = -d loss / d r_rejected.
    """
    logp, mask = wide(logp, batch["response_mask"])
    score = masked(logp, mask).sum(-1)
    margin = score[0::2] - score[1::2]
    pair_loss = -torch.nn.functional.logsigmoid(margin)
    pairs_tokens = (mask[0::2].sum(-1) + mask[1::2].sum(-1)).repeat_interleave(2)
    loss = 2 * pair_loss.repeat_interleave(2)[:, None] * mask / pairs_tokens[:, None].clamp(min=1)
    counted = (pairs_tokens[0::2] > 0).to(margin.dtype)
    n = counted.sum().item()
    m = margin.detach()
    return loss, {"rm/margin": ((m * counted).sum().item(), n),
                  "rm/accuracy": (((m > 0).to(m.dtype) * counted).sum().item(), n)}
