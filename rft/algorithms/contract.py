"""What a study's own advantage function and policy loss (a dotted path: README "Extension points")
must return, checked each time the trainer calls one.

A registered function is called as it is: its output is right by its tests (tests/test_formula_audit.py).
A study's function is new code, and its mistakes were a raw traceback from deep in the trainer
(`'NoneType' object has no attribute 'to'`, a size mismatch in the metrics) or, worse, a run that
exited 0 having trained on something else: a policy loss returning `loss.mean()` (a scalar) was
broadcast over the tokens, so rft's aggregation, rollout IS weights and KL term applied to a number
that already averaged the prompt and padding positions in. Each such mistake is one paragraph here,
naming the key, the function and the fix; a function that raises names itself and its line, its
traceback going to the trainer's log.
"""

from __future__ import annotations

import logging

import torch

from rft.algorithms.aggregation import masked
from rft.errors import ConfigError, RunError
from rft.registry import study_frame

log = logging.getLogger(__name__)

ADVANTAGE_KEY, LOSS_KEY = "algorithm.advantage_fn", "algorithm.policy_loss_fn"


def checked(registry, name: str, fn):
    """`fn` (registry `registry`'s entry `name`, its args bound) as the trainer calls it: as it is
    for a registered name, else wrapped in the checks of its registry's contract."""
    if name in registry:
        return fn
    if registry.key == ADVANTAGE_KEY:
        def advantages(batch, cfg):
            adv = _call(fn, name, ADVANTAGE_KEY, batch, cfg)
            check_advantages(adv, batch["response_mask"], name)
            # 0 off the mask, as the registered functions give: the trainer's advantage/mean summed
            # every position (a value broadcast over a row's padding counted in it), its skip of
            # zero-advantage rows kept a row whose only non-zero was off the mask, and gmpo read it
            return masked(adv, batch["response_mask"])
        return advantages

    def policy_loss(logp, batch, cfg):
        out = _call(fn, name, LOSS_KEY, logp, batch, cfg)
        check_loss(out, logp, name)
        return out
    return policy_loss


def _call(fn, name: str, key: str, *args):
    """fn(*args); an exception of the study's code is a RunError naming the function and its line
    (its traceback logged: the trainer's log, <stage>/log/)."""
    try:
        return fn(*args)
    except (ConfigError, RunError):
        raise
    except Exception as e:
        frame = study_frame(e)
        at = f" ({frame.filename}, line {frame.lineno})" if frame else ""
        log.info("%s=%s raised", key, name, exc_info=True)
        raise RunError(f"{key}={name} raised {type(e).__name__}: {e}{at}, in the trainer; its traceback is in the "
                       f"trainer's log under <stage>/log/. Fix the function, then run the same command again: it "
                       f"resumes from the newest checkpoint.") from None


def _shape(x) -> str:
    return str(list(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


def check_advantages(adv, mask: torch.Tensor, name: str) -> None:
    """An advantage function returns a real tensor of response_mask's shape [N, T], finite where the
    mask is 1 (what it holds elsewhere is set to 0 by `checked`)."""
    want = (f"a tensor of one advantage per response token, of batch['response_mask']'s shape "
            f"{list(mask.shape)} (N rows x T positions)")
    if not isinstance(adv, torch.Tensor) or adv.shape != mask.shape or adv.is_complex():
        got = f"a tensor of shape {_shape(adv)}" if isinstance(adv, torch.Tensor) else f"{type(adv).__name__}"
        raise ConfigError(f"{ADVANTAGE_KEY}={name} returned {got} where {want} goes. A value per sequence is "
                          f"broadcast over its tokens as `adv[:, None] * batch['response_mask']` "
                          f"(rft/algorithms/advantages.py).")
    if adv.dtype == torch.bool:  # a comparison (adv > 0) where its values were meant: it trained on 1 and 0
        raise ConfigError(f"{ADVANTAGE_KEY}={name} returned a bool tensor (a comparison?) where {want} goes: return "
                          f"the advantages' values, or `.float()` of it if 1 and 0 are the advantages meant.")
    bad = ~torch.isfinite(adv.double()) & (mask > 0)
    if bad.any():
        rows = sorted(set(bad.nonzero()[:, 0].tolist()))
        raise ConfigError(f"{ADVANTAGE_KEY}={name} returned NaN or inf at {int(bad.sum())} of the batch's "
                          f"{int((mask > 0).sum())} response tokens (rows {rows[:8]}{' ...' if len(rows) > 8 else ''}) "
                          f"from finite rewards (batch['rewards']): a division by a zero std or count? Nothing "
                          f"was trained on them; fix the function.")


def check_loss(out, logp: torch.Tensor, name: str) -> None:
    """A policy loss returns (loss, metrics): the loss per token, of logp's shape [N, T], through
    logp's graph; metrics a dict of numbers (masked sums over tokens) or (sum, count) pairs."""
    if not isinstance(out, tuple) or len(out) != 2:
        got = f"a tuple of {len(out)}" if isinstance(out, tuple) else f"a {_shape(out)} {type(out).__name__}"
        raise ConfigError(f"{LOSS_KEY}={name} returned {got}; a policy loss returns a pair (loss, metrics): the "
                          f"loss per token, of logp's shape {list(logp.shape)}, and a dict of metrics ({{}} for none).")
    loss, metrics = out
    if not isinstance(loss, torch.Tensor) or loss.shape != logp.shape:
        raise ConfigError(f"{LOSS_KEY}={name} returned a loss of shape {_shape(loss)} where the loss per token, of "
                          f"logp's shape {list(logp.shape)}, goes: return it before any mean or sum. The trainer "
                          f"weights each token (algorithm.rollout_is), adds the KL and entropy terms and aggregates "
                          f"over the response tokens by algorithm.loss_agg_mode (rft/algorithms/losses.py).")
    if logp.requires_grad and not loss.requires_grad:
        raise ConfigError(f"{LOSS_KEY}={name} returned a loss without a gradient: it does not depend on logp (a "
                          f"detached or recomputed log-prob?), so the update would not change the policy. Compute "
                          f"it from the logp it is given.")
    if not isinstance(metrics, dict) or not all(isinstance(k, str) and _number(v) for k, v in metrics.items()):
        bad = "" if not isinstance(metrics, dict) else next(f" ({k!r}: {_shown(v)})" for k, v in metrics.items()
                                                            if not (isinstance(k, str) and _number(v)))
        raise ConfigError(f"{LOSS_KEY}={name} returned metrics of the wrong kind{bad}: a dict of name -> number "
                          f"(a sum over the micro-batch's tokens, added up over micro-batches), or name -> (sum, "
                          f"count) for a mean over something else; {{}} for none.")


def _shown(v) -> str:
    """A wrong metric value in a message: a tensor by its shape (a per-row tensor's repr filled the
    paragraph with every row's value over many lines), anything else its repr, cut to 80 characters."""
    if isinstance(v, torch.Tensor):
        return f"a {v.dtype} tensor of shape {list(v.shape)}"
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _number(v) -> bool:
    if isinstance(v, tuple):
        return len(v) == 2 and all(_number(x) for x in v)
    if isinstance(v, torch.Tensor):
        return v.numel() == 1 and not v.is_complex()
    return isinstance(v, (int, float)) and not isinstance(v, bool)
