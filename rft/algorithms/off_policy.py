"""Experiences from older weights: how stale they are, and `algorithm.off_policy_correction`.

One definition of staleness serves both the runner (which drops experiences staler than
synchronizer.max_staleness) and the trainer (which corrects the rest): the number of trainer
steps between the weights that generated an experience and the weights about to learn from it.
"""

from __future__ import annotations

import math


def staleness(policy_version: int, trainer_version: int) -> int:
    """Trainer steps the weights have moved since they sampled: 0 is on-policy."""
    return trainer_version - policy_version


def correct(exps, old_logp: torch.Tensor, mask: torch.Tensor, version: int, cfg):
    """algorithm.off_policy_correction for the experiences with staleness >= 1.

    behavior: their rows of old_logp become the sampling log-probs the explorer stored (in place);
    returns None. decoupled: returns per-token weights pi_prox / pi_behav (old_logp, recomputed by
    the current weights, over the sampling log-prob), capped at behavior_weight_cap. Fresh
    experiences are left alone, so on-policy runs are unchanged.
    """
    import torch  # here: the runner (no torch in its process) imports `staleness` from this module

    stale = [i for i, e in enumerate(exps) if staleness(e.policy_version, version) > 0 and e.logprobs]
    if cfg.off_policy_correction == "none" or not stale:
        return None
    w = torch.ones_like(mask)
    cap = math.log(cfg.behavior_weight_cap)
    for i in stale:
        e = exps[i]
        start, end = e.prompt_length - 1, e.prompt_length - 1 + len(e.logprobs)
        behav = torch.tensor(e.logprobs, dtype=old_logp.dtype, device=old_logp.device)
        if cfg.off_policy_correction == "behavior":
            old_logp[i, start:end] = behav
        else:
            w[i, start:end] = torch.exp((old_logp[i, start:end] - behav).clamp(max=cap))
    return None if cfg.off_policy_correction == "behavior" else w
