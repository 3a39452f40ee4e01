"""`algorithm.rollout_is`: the correction for the gap between the rollout engine and the trainer.

The explorer stores the log-prob of each token it sampled (Experience.logprobs, "pi_engine"); the
trainer recomputes the log-probs of the same weights ("old", pi_old) with its own kernels. They
differ (vLLM vs Hugging Face kernels, bf16, batch-dependent reductions), so an update that takes
pi_old as the policy that sampled is in fact slightly off-policy (verl#2953, TRL#3867,
slime#179). Each token's policy loss is weighted, without gradient, by

    r = exp(old_logp - sampling_logp)                  pi_old / pi_engine
    tis: w = min(r, C)                                 truncated IS (Yao et al. 2025, "Your
                                                       efficient RL framework secretly brings you
                                                       off-policy RL training"; TRL's
                                                       vllm_importance_sampling_correction, C = 2)
    mis: w = r if r <= C else 0                        masked IS, one-sided (TRL's token_mask
                                                       mode): a token beyond the cap adds
                                                       nothing (it still counts in the loss's
                                                       normaliser, as a weight of 0 does)
    none: w = 1

with C = algorithm.rollout_is_cap (inf: plain IS). verl's mask mode and IcePop mask both sides,
r outside [1/C, C] (verl's default lower bound) or [0.5, 5]: here a token far below 1 keeps its
small weight r (e^-3 = 0.05 at r = e^-3) rather than 0. Where this departs from the formulas: a weight
is never above e^20 (LOG_RATIO_CLAMP, the bound the policy losses put on their ratio), whatever
C: with C = inf a token 100 nats off would otherwise weigh e^100, inf in float32, and a
zero-advantage token's loss 0 * inf would be NaN. mis compares the true log r with log C (a token
of r = e^21 is masked by C = e^20.5 although its bounded weight would be e^20); a token whose two
log-probs are both -inf has no measurable r and counts as beyond the cap.

The trainer multiplies the policy loss by w right after the policy loss function (one place,
every loss of the registry), before the optional terms (KL to the reference, behaviour weights,
entropy bonus), as TRL and verl weight the policy-gradient term only. Not for losses that are
not policy gradients over sampled tokens (sft, dpo: their Needs.imitation).

Which tokens are weighted (`weighted_rows`): response tokens the loss counts (response_mask 1) of
experiences that carry sampling log-probs (dataset rows have none: weight 1), whose old log-probs
`algorithm.off_policy_correction` leaves as the trainer's recomputation:

- fresh experiences (staleness 0): always;
- stale ones (staleness >= 1) with off_policy_correction=behavior: no. Their old log-probs are
  replaced by the sampling log-probs (rft.algorithms.off_policy.correct), so r = 1 by
  construction and the PPO ratio is taken against the engine's log-probs directly;
- stale ones with decoupled: no. They are already weighted by pi_prox / pi_behav, capped at
  behavior_weight_cap, where pi_prox is the trainer's recomputation and pi_behav the engine's
  sampling log-prob: that weight is r itself (engine gap and policy lag together), so weighting
  again would correct twice;
- stale ones with off_policy_correction=none ("treated as fresh"): yes, as fresh ones are; then r
  also holds the policy lag (pi_current / pi_sampling weights), which is what truncated IS in an
  asynchronous run corrects (verl applies rollout_is to every row).

So each token carries at most one importance weight.

Metrics (the trainer logs them whenever some weighted token exists, with rollout_is=none too:
they measure the gap): actor/tis_weight_mean and actor/tis_weight_max of the uncapped r (its
log clamped at LOG_RATIO_CLAMP, so a broken sample gives a large number, not inf), and
actor/tis_capped_frac, the fraction of the tokens with r > C (truncated by tis, masked by mis).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

# torch is imported where it is used: check_config stays light for the plan (no torch to plan a run)
if TYPE_CHECKING:
    import torch

def check_config(algo) -> None:
    """A cap that makes no sense is a ConfigError naming the keys. C <= 1 truncates (tis) or masks
    (mis) at least about half of the tokens, whose r is 1 up to float noise (1 +- 1e-5 with the hf
    engine), so the cap must exceed 1; TRL and verl use 2."""
    from rft.errors import ConfigError

    cap = algo.rollout_is_cap
    if algo.rollout_is != "none" and not cap > 1:  # (nan fails too; inf: plain IS)
        raise ConfigError(
            f"algorithm.rollout_is_cap={cap} must be > 1 with algorithm.rollout_is="
            f"{algo.rollout_is}: each token's weight pi_trainer / pi_engine is about 1, so a cap at or "
            f"below 1 would {'truncate' if algo.rollout_is == 'tis' else 'mask'} at least about half of the tokens "
            f"for float noise alone. 2 is the usual value (TRL, verl); algorithm.rollout_is=none turns "
            f"the correction off."
        )


def weighted_rows(exps, version: int, cfg) -> list[bool]:
    """Per experience: whether its tokens take a rollout IS weight (see the module docstring):
    it has sampling log-probs, and off_policy_correction leaves its old log-probs alone (it is
    fresh, or the correction is none)."""
    from rft.algorithms.off_policy import staleness

    every = cfg.off_policy_correction == "none"  # read once: a config lookup costs ~10 us a row
    return [bool(e.logprobs) and (every or staleness(e.policy_version, version) <= 0) for e in exps]


def weights(old_logp: torch.Tensor, sampling_logp: torch.Tensor, mask: torch.Tensor, mode: str, cap: float):
    """The per-token weights [n, T] (None for mode none) and the metrics' sums over `mask`.

    `old_logp` is the trainer's log-prob of each token under the weights that sampled it (no
    gradient is taken through it), `sampling_logp` the engine's, `mask` the tokens counted (1;
    elsewhere the weight is 1 and nothing is counted). Returns (w, stats) with stats
    {"rollout_is/weight_sum": sum of r, "rollout_is/capped": tokens with r > cap,
    "rollout_is/tokens": tokens} and the max of r (0.0 without tokens) as "rollout_is/max".
    """
    import torch

    from rft.algorithms.losses import LOG_RATIO_CLAMP

    counted = mask > 0
    log_ratio = (old_logp.detach() - sampling_logp).masked_fill(~counted, 0.0)
    # both log-probs -inf (a broken sample): a ratio nobody can measure is beyond any cap
    log_ratio = torch.where(log_ratio.isnan(), math.inf, log_ratio)
    log_cap = math.log(cap)
    # every weight is at most e^LOG_RATIO_CLAMP, the losses' bound on a ratio: with cap=inf r = e^100
    # would be inf in float32, and a zero-advantage token's loss 0 * inf NaN
    bounded = log_ratio.clamp(max=LOG_RATIO_CLAMP)
    ratio = torch.exp(bounded)  # uncapped r, for the metrics
    over = (log_ratio > log_cap) & counted  # the true log-ratio: the same test for weights and metrics
    if mode == "tis":
        w = torch.exp(bounded.clamp(max=log_cap))
    elif mode == "mis":
        w = torch.where(over, torch.zeros_like(ratio), ratio)
    else:
        w = None
    if w is not None:
        w = torch.where(counted, w, torch.ones_like(w))
    r = ratio.masked_fill(~counted, 0.0)
    zero = r.new_zeros(())
    # one device-to-host copy for the four numbers
    values = torch.stack([r.sum(), over.sum().to(r.dtype), counted.sum().to(r.dtype),
                          r.max() if r.numel() else zero]).tolist()
    return w, dict(zip(("rollout_is/weight_sum", "rollout_is/capped", "rollout_is/tokens", "rollout_is/max"), values))
