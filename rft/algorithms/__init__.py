"""The algorithm registries: pure tensor functions, one signature per registry, and their needs.

    ADVANTAGE_FNS[name](batch, cfg) -> advantages [N, T]
    POLICY_LOSS_FNS[name](logp, batch, cfg) -> (loss [N, T], metrics)
    KL_FNS[name](logp, ref_logp) -> kl [N, T]
    agg_loss(loss, mask, mode, num_seqs, num_tokens, max_len) -> scalar

Each entry says what the function needs besides the batch (`Needs`: a frozen reference model, a
critic, whole groups of rollouts, preference pairs from a dataset). The plan checks a config
against them and the trainer builds what they ask for; nothing else branches on algorithm names.

This module imports no torch: the tables below name where each function lives, and a function is
imported when it is first looked up, so planning a run (and `dry_run`) stays light.

To add an algorithm: write the function, add a line to the table, add a
`conf/algorithm/<name>.yaml`, and a test with hand-computed values. To try one without touching
the package, give a dotted path instead of a name (`algorithm.policy_loss_fn=my_study.losses.fn`)
and declare its needs on it with the `needs` decorator:

    from rft.algorithms import needs

    @needs(reference=True)
    def my_loss(logp, batch, cfg): ...   # batch["ref_logp"] is filled
"""

from __future__ import annotations

import importlib
import sys
import traceback
from collections.abc import Mapping
from dataclasses import dataclass

from rft.config import AGG_MODES
from rft.errors import ConfigError


@dataclass(frozen=True)
class Needs:
    # batch["ref_logp"]: log-probs of the frozen starting model (DPO, a KL term)
    reference: bool = False
    # batch["values"]: a value model trained beside the policy (PPO's GAE)
    critic: bool = False
    # compares the rollouts of one task: algorithm.repeat_times >= 2 and whole groups per step
    grouped: bool = False
    # rows 2k, 2k+1 are a preference pair (chosen, rejected) read from a dataset
    paired: bool = False
    # (a loss's declaration, not a need) each token's loss is its advantage times a finite term:
    # a row whose advantages are all 0 adds nothing to the loss or the gradient, whatever its
    # ratio, so an update may skip it (its ratio metrics are then over the other rows)
    # (trainer.skip_zero_advantage)
    zero_at_zero_advantage: bool = False


def needs(**kwargs):
    """Declare what a function given as a dotted path needs (see Needs)."""
    spec = Needs(**kwargs)

    def mark(fn):
        fn.needs = spec
        return fn

    return mark


class Registry(Mapping):
    """name -> function, imported on first use from the "module.attribute" the table gives."""

    def __init__(self, key: str, table: dict[str, tuple[str, Needs]]):
        self.key, self._table, self._loaded = key, table, {}

    def __getitem__(self, name: str):
        if name not in self._loaded:
            path = self._table[name][0]
            module, _, attr = path.rpartition(".")
            self._loaded[name] = getattr(importlib.import_module(module), attr)
        return self._loaded[name]

    def __contains__(self, name) -> bool:  # without importing the function (Mapping's would)
        return name in self._table

    def __iter__(self):
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def needs(self, name: str) -> Needs:
        """What `name` needs: from the table, or from a dotted-path function's `needs` decorator
        (importing it: a study's own module). Errors name the config key."""
        if name in self._table:
            return self._table[name][1]
        return getattr(resolve(self, name, self.key), "needs", Needs())

    def check(self, name: str) -> None:
        """A misspelt name fails here, without importing anything (dotted paths are imported)."""
        if name not in self._table:
            resolve(self, name, self.key)


_ADV = "rft.algorithms.advantages."
ADVANTAGE_FNS = Registry("algorithm.advantage_fn", {
    "grpo": (_ADV + "grpo_advantage", Needs(grouped=True)),
    "dr_grpo": (_ADV + "dr_grpo_advantage", Needs(grouped=True)),
    "rloo": (_ADV + "rloo_advantage", Needs(grouped=True)),
    "opmd": (_ADV + "opmd_advantage", Needs(grouped=True)),
    "reinforce_pp": (_ADV + "reinforce_pp_advantage", Needs()),
    "reinforce_pp_baseline": (_ADV + "reinforce_pp_baseline_advantage", Needs(grouped=True)),
    "gae": (_ADV + "gae_advantage", Needs(critic=True)),
    "none": (_ADV + "no_advantage", Needs()),
})

_LOSS = "rft.algorithms.losses."
POLICY_LOSS_FNS = Registry("algorithm.policy_loss_fn", {
    "ppo_clip": (_LOSS + "ppo_clip_loss", Needs(zero_at_zero_advantage=True)),
    "gspo": (_LOSS + "gspo_loss", Needs(zero_at_zero_advantage=True)),
    "gmpo": (_LOSS + "gmpo_loss", Needs(zero_at_zero_advantage=True)),
    "cpgd": (_LOSS + "cpgd_loss", Needs(zero_at_zero_advantage=True)),
    "opmd": (_LOSS + "opmd_loss", Needs(zero_at_zero_advantage=True)),
    "sft": (_LOSS + "sft_loss", Needs()),
    "dpo": (_LOSS + "dpo_loss", Needs(reference=True, paired=True)),
})

_KL = "rft.algorithms.kl."
# every KL function needs the reference model: the config's "none" turns the term off
KL_FNS = Registry("algorithm.kl_loss_fn", {
    name: (_KL + fn, Needs(reference=True))
    for name, fn in [("k1", "k1"), ("kl", "k1"), ("k2", "k2"), ("mse", "k2"), ("k3", "k3"),
                     ("low_var_kl", "k3"), ("abs", "abs_kl")]
})



def __getattr__(name: str):
    # agg_loss is a torch function: imported when asked for, not with the registries
    if name == "agg_loss":
        from rft.algorithms.aggregation import agg_loss

        return agg_loss
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def algorithm_needs(algo) -> Needs:
    """What an algorithm config needs, over all its functions (advantage, loss, KL terms)."""
    parts = [ADVANTAGE_FNS.needs(algo.advantage_fn), POLICY_LOSS_FNS.needs(algo.policy_loss_fn)]
    parts += [KL_FNS.needs(name) for name in (algo.kl_loss_fn, algo.kl_penalty_fn) if name != "none"]
    return Needs(**{f: any(getattr(p, f) for p in parts) for f in Needs.__dataclass_fields__})


__all__ = ["ADVANTAGE_FNS", "AGG_MODES", "KL_FNS", "POLICY_LOSS_FNS", "Needs", "Registry", "agg_loss",
           "algorithm_needs", "needs", "resolve"]


def _study_frame(e: BaseException):
    """The innermost frame of `e` in the study's own files: not the interpreter's, not the
    installed packages' (a failed os.environ lookup is the line that made it)."""
    installed = (sys.prefix, sys.base_prefix)
    frames = traceback.extract_tb(e.__traceback__)
    return next((f for f in reversed(frames) if not f.filename.startswith(("<", *installed))), frames[-1])


def resolve(registry: Mapping, name: str, key: str):
    """The function registered as `name`, or the one at dotted path `name` (module.function)."""
    if name in registry:
        return registry[name]
    if "." in name:
        module, _, attr = name.rpartition(".")
        try:
            found = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"{key}={name!r}: cannot import it ({type(e).__name__}: {e}).") from e
        except SyntaxError as e:
            raise ConfigError(f"{key}={name!r}: cannot import it: {e.filename}, line {e.lineno}: "
                              f"{type(e).__name__}: {e.msg}. Fix that line.") from e
        except Exception as e:  # the study's module raised while it was imported (a raw traceback)
            where = _study_frame(e)
            raise ConfigError(f"{key}={name!r}: importing {module} raised {type(e).__name__}: {e} "
                              f"({where.filename}, line {where.lineno}). Fix the module: its top-level code "
                              f"runs when it is imported.") from e
        if not callable(found):  # a module, a constant, a registry dict: nothing to call
            raise ConfigError(f"{key}={name!r} is a {type(found).__name__}, not a function or class; give the "
                              f"dotted path of a function (module.function) or a registered name.")
        return found
    raise ConfigError(
        f"{key}={name!r} is not one of {sorted(registry)}; give a registered name or the dotted "
        f"path of a function with the same signature (module.function)."
    )
