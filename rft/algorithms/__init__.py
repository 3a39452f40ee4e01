"""The algorithm registries: pure tensor functions, one signature per registry.

    ADVANTAGE_FNS[name](batch, cfg) -> advantages [N, T]
    POLICY_LOSS_FNS[name](logp, batch, cfg) -> (loss [N, T], metrics)
    KL_FNS[name](logp, ref_logp) -> kl [N, T]
    agg_loss(loss, mask, mode, num_seqs, num_tokens, max_len) -> scalar

The trainer looks each name up once (`rft.trainer`, through `resolve`); nothing else branches on
algorithm names. To add an algorithm: write the function, add it to the dict, add a
`conf/algorithm/<name>.yaml`, and a test with hand-computed values. To try one without touching
the package, give a dotted path instead of a name: `algorithm.advantage_fn=my_study.adv.my_fn`.
"""

import importlib

from rft.errors import ConfigError

from rft.algorithms.advantages import ADVANTAGE_FNS
from rft.algorithms.aggregation import AGG_MODES, agg_loss
from rft.algorithms.kl import KL_FNS
from rft.algorithms.losses import POLICY_LOSS_FNS

__all__ = ["ADVANTAGE_FNS", "AGG_MODES", "KL_FNS", "POLICY_LOSS_FNS", "agg_loss", "resolve"]


def resolve(registry: dict, name: str, key: str):
    """The function registered as `name`, or the one at dotted path `name` (module.function)."""
    if name in registry:
        return registry[name]
    if "." in name:
        module, _, attr = name.rpartition(".")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"{key}={name!r}: cannot import it ({type(e).__name__}: {e}).") from e
    raise ConfigError(
        f"{key}={name!r} is not one of {sorted(registry)}; give a registered name or the dotted "
        f"path of a function with the same signature (module.function)."
    )
