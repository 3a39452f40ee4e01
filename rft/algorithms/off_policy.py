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


def fresh_tokens(exps, version: int, like, at_most: bool = False):
    """[n, L-1] like `like` (the response mask): 1 at each response token sampled by `version`
    (staleness 0; `at_most`: <= 0), 0 at older ones. A partial rollout's tokens have versions of
    their own (Experience.token_versions); any other experience's are all its policy_version's."""
    import torch

    def fresh(v: int) -> float:
        s = staleness(v, version)
        return float(s <= 0 if at_most else s == 0)

    flags = torch.tensor([fresh(e.policy_version) for e in exps], dtype=like.dtype,
                         device=like.device)[:, None].expand_as(like).clone()
    for i, e in enumerate(exps):
        if e.token_versions:
            start = e.prompt_length - 1
            flags[i, start:start + len(e.token_versions)] = torch.tensor(
                [fresh(v) for v in e.token_versions], dtype=like.dtype, device=like.device)
    return flags


def correct(exps, old_logp: torch.Tensor, mask: torch.Tensor, version: int, cfg):
    """algorithm.off_policy_correction for the experiences with staleness >= 1.

    behavior: their rows of old_logp become the sampling log-probs the explorer stored (in place);
    returns None. decoupled: returns per-token weights pi_prox / pi_behav (old_logp, recomputed by
    the current weights, over the sampling log-prob), capped at behavior_weight_cap. Fresh
    experiences are left alone, so on-policy runs are unchanged; so are the fresh tokens of a
    partial rollout (Experience.token_versions), whose older tokens are corrected.

    Departure from AReaL (arXiv 2505.24298), which drops a token whose weight exceeds the cap
    (weight 0): here the weight is truncated to the cap, as truncated IS does (min(w, cap)). A
    token whose two log-probs are both -inf has no measurable weight; it counts as beyond the cap
    (as in rft.algorithms.rollout_is), where -inf - -inf = NaN made the loss, the gradient and the
    update NaN (skipped).
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
        # a partial rollout's tokens of the current version are fresh: left alone, as a fresh row's
        old = None if not e.token_versions else torch.tensor(
            [staleness(v, version) > 0 for v in e.token_versions], device=old_logp.device)
        if cfg.off_policy_correction == "behavior":
            old_logp[i, start:end] = behav if old is None else torch.where(old, behav, old_logp[i, start:end])
        else:
            log_w = old_logp[i, start:end] - behav
            r = torch.exp(torch.where(log_w.isnan(), math.inf, log_w).clamp(max=cap))
            w[i, start:end] = r if old is None else torch.where(old, r, torch.ones_like(r))
    return None if cfg.off_policy_correction == "behavior" else w
