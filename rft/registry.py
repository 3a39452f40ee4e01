"""Names to code: every name table of rft is a `Registry`, and `resolve` looks a name up in one or
imports it from a dotted path.

The tables: algorithms (ADVANTAGE_FNS, POLICY_LOSS_FNS, KL_FNS: rft/algorithms), rewards
(REWARD_FNS: rft/rewards/verifiers.py; REWARD_CLIENTS: rft/rewards/scoring.py), workflows
(rft/rollout/workflows/single_turn.py), environments (rft/rollout/environments/tools.py), engines
and trainer backends (here, at the end: planning reads what they offer), synchronizers
(rft/sync/weights.py), buffers and priority functions (rft/data/), task generators
(rft/data/tasks.py), data pipeline operators (TASK_OPERATORS, EXPERIENCE_OPERATORS:
rft/data/pipeline.py), model builders (rft/models.py), actor backends (rft/runtime/actors.py),
trackers (MONITORS: rft/reporting/monitor.py), other systems' config keys and what they are here
(FOREIGN_KEYS: rft/foreign_keys.py, whose entries are the translations, not code). Each
entry is a "module.attribute" string, imported on first use, so planning reads the names (and
what each entry needs or offers) without importing the code. A config may name a table's entry or
give the dotted path of its own (`module.function`); a study may also add an entry at import time
(`TABLE["mine"] = "my_study.module.fn"`). Errors are one paragraph naming the key and the fix.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rft.errors import ConfigError


class Registry(Mapping):
    """A name table: name -> function or class, imported on first use from the "module.attribute"
    the table gives, so reading names (planning, a dry run) imports none of them. Each entry may
    carry what the code needs or offers (`info`: an algorithm's Needs, say); a dotted path given
    instead of a name carries it as its attribute `info` (set by a decorator), else `default`."""

    def __init__(self, key: str, table: dict[str, str | tuple[str, Any]], info: str | None = None,
                 default: Any = None, shape: str = "a function with the same signature (module.function)",
                 foreign: dict[str, str] | None = None):
        self.key, self._loaded, self._attr, self._default = key, {}, info, default
        self.shape = shape  # what a study's own entry is, for the error naming a misspelt one
        # names other systems (Trinity-RFT, verl) give for an entry: the sentence that error adds
        self.foreign = foreign or {}
        self._table = {n: v if isinstance(v, tuple) else (v, default) for n, v in table.items()}

    def __getitem__(self, name: str):
        if name not in self._loaded:
            target = self._table[name][0]
            if not isinstance(target, str):  # added as the object itself
                return target
            module, _, attr = target.rpartition(".")
            self._loaded[name] = getattr(importlib.import_module(module), attr)
        return self._loaded[name]

    def __setitem__(self, name: str, target) -> None:
        """Add an entry: a "module.attribute" string, or the function or class itself; a pair
        (target, info) says what it needs or offers. A name rft ships (an "rft." path) is not
        replaced: a study's module that did so changed what every config naming it runs, and only in
        the processes that imported that module (not in Ray's actors, which never do)."""
        shipped = self.path(name)
        # the same path again (a study's module imported twice) keeps what the entry needs: it was
        # reset to the default, and grpo lost its `grouped` need (repeat_times 1 then passed planning)
        same = shipped is not None and not isinstance(target, tuple) and target == shipped
        entry = target if isinstance(target, tuple) else (target, self._table[name][1] if same else self._default)
        if shipped and shipped.startswith("rft.") and entry[0] != shipped:
            raise ConfigError(f"{self.key}: {name!r} is rft's own entry ({shipped}); a study's entry takes a name not "
                              f"taken (taken: {', '.join(sorted(self._table))}), or the config gives the dotted path "
                              f"of the study's function.")
        self._table[name] = entry
        self._loaded.pop(name, None)

    def __delitem__(self, name: str) -> None:
        del self._table[name]
        self._loaded.pop(name, None)

    def __contains__(self, name) -> bool:  # without importing the function (Mapping's would)
        return name in self._table

    def __iter__(self):
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def path(self, name: str) -> str | None:
        """The "module.attribute" a registered name imports (None: an object added as itself, or
        not a registered name)."""
        target = self._table[name][0] if name in self._table else None
        return target if isinstance(target, str) else None

    def info(self, name: str) -> Any:
        """What `name` needs or offers: from the table, or from a dotted-path function's attribute
        (importing it: a study's own module). Errors name the config key."""
        if name in self._table:
            return self._table[name][1]
        found = resolve(self, name, self.key)
        return getattr(found, self._attr, self._default) if self._attr else self._default

    def check(self, name: str) -> None:
        """A misspelt name fails here, without importing anything (dotted paths are imported)."""
        if name not in self._table:
            resolve(self, name, self.key)


def study_frame(e: BaseException):
    """The innermost frame of `e` in the study's own files, below rft's last: not the interpreter's,
    not the installed packages' (a failed os.environ lookup is the line that made it); None when it
    has none (rft raised it, or a package it called: the caller of rft is not where it raised)."""
    own = os.path.dirname(os.path.abspath(__file__)) + os.sep
    found = None
    for f in traceback.extract_tb(e.__traceback__):
        if f.filename.startswith(own):
            found = None
        elif not f.filename.startswith(("<", sys.prefix, sys.base_prefix)):
            found = f
    return found


def _near(module, attr: str) -> str:
    """" Did you mean ...?" with the module's own functions and classes nearest to a misspelt name."""
    import difflib
    import inspect

    own = [n for n, v in vars(module).items() if not n.startswith("_") and callable(v)
           and getattr(v, "__module__", None) == module.__name__ and not inspect.ismodule(v)]
    near = difflib.get_close_matches(attr, own, n=3, cutoff=0.75)
    return f" Did you mean {' or '.join(f'{module.__name__}.{n}' for n in near)}?" if near else ""


def _where_python_looks(e: ImportError, module: str) -> str:
    """Where a study's own package is looked for, when it is the one not found: `python
    ../rft/run.py` from the study's folder puts run.py's folder on the path, not the one run from."""
    top = module.partition(".")[0]
    if not isinstance(e, ModuleNotFoundError) or e.name != top:
        return ""  # a module inside it, or a package it imports: the message says which
    return (f" Python looks for {top} in the folder of run.py and the folders in PYTHONPATH, not in the folder you "
            f"run from (unless that is run.py's own): run with PYTHONPATH=<the folder that holds {top}> (Ray's "
            f"workers and a sweep's jobs inherit it).")


def resolve(registry: Mapping, name: str, key: str):
    """The function registered as `name`, or the one at dotted path `name` (module.function)."""
    if name in registry:
        return registry[name]
    if "." in name:
        module, _, attr = name.rpartition(".")
        try:
            imported = importlib.import_module(module)
            found = getattr(imported, attr)
        except AttributeError as e:  # the module is there, the name in it is not
            raise ConfigError(f"{key}={name!r}: cannot import it ({type(e).__name__}: {e}).{_near(imported, attr)}") from e
        except ImportError as e:
            raise ConfigError(f"{key}={name!r}: cannot import it ({type(e).__name__}: {e}).{_where_python_looks(e, module)}") from e
        except SyntaxError as e:
            raise ConfigError(f"{key}={name!r}: cannot import it: {e.filename}, line {e.lineno}: "
                              f"{type(e).__name__}: {e.msg}. Fix that line.") from e
        except Exception as e:  # the study's module raised while it was imported (a raw traceback)
            where = study_frame(e) or traceback.extract_tb(e.__traceback__)[-1]
            raise ConfigError(f"{key}={name!r}: importing {module} raised {type(e).__name__}: {e} "
                              f"({where.filename}, line {where.lineno}). Fix the module: its top-level code "
                              f"runs when it is imported.") from e
        if not callable(found):  # a module, a constant, a registry dict: nothing to call
            raise ConfigError(f"{key}={name!r} is a {type(found).__name__}, not a function or class; give the "
                              f"dotted path of a function (module.function) or a registered name.")
        return found
    import difflib

    shape = getattr(registry, "shape", "a function with the same signature (module.function)")
    foreign = getattr(registry, "foreign", {}).get(name)  # another system's name for one of ours
    # a misspelt registered name (workflow=multiturn) was left to be found in the list by eye
    near = difflib.get_close_matches(name, sorted(registry), n=1) if not foreign else []
    raise ConfigError(
        f"{key}={name!r} is not one of {sorted(registry)}; give a registered name or the dotted "
        f"path of {shape}.{' ' + foreign if foreign else ''}{f' Did you mean {near[0]}?' if near else ''}"
    )


# ---------------------------------------------------------------- the tables planning reads
# Their code lives in parts that planning must not import (engines load vLLM, trainers torch), so
# what planning checks is written beside each name. A study's own engine or trainer backend is a
# dotted path whose class carries the same record as its attribute `info`.

@dataclass(frozen=True)
class EngineInfo:
    """What a rollout engine offers (rft/rollout/engines/base.py: the methods it implements)."""
    # synchronizer.sync_method=collective with rollout_model.tensor_parallel_size > 1: each
    # tensor-parallel worker would need a rank of its own in the trainer's group
    collective_tensor_parallel: bool = True


@dataclass(frozen=True)
class TrainerBackendInfo:
    """What a trainer backend offers (rft/trainer/base.py: the methods it implements)."""
    # True: one process per rank, built as cls(cfg, plan, init_path, rank, world, (host, port)),
    # meeting at a TCP store the driver holds; False: one process, cls(cfg, plan, init_path)
    ranks: bool = False
    # trainer.param_offload / optimizer_offload move its shards between the CPU and the device
    offload: bool = False
    # model.lora.rank > 0 trains adapters
    lora: bool = True
    # trainer.fp32_master_weights: float32 weights and optimizer state under model.dtype compute
    mixed_precision: bool = False
    # True: a resumed stage builds it with the checkpoint's directory as one more last argument
    # (cls(cfg, plan, init_path[, rank, world, (host, port)], resume)), and it reads the trained
    # weights from there once, not the starting model's that `load(resume)` would overwrite;
    # False: built as for a fresh stage, then `load` puts the checkpoint over it
    builds_from_checkpoint: bool = False


# explorer.rollout_model.engine_type -> the engine class
ENGINES = Registry("explorer.rollout_model.engine_type", info="info", default=EngineInfo(),
                   shape="a class with the methods of rft/rollout/engines/base.py (module.Class)",
                   foreign={"vllm_async": "Trinity-RFT's vllm_async is vllm here (explorer=vllm)."}, table={
    "hf": ("rft.rollout.engines.hf.HFEngine", EngineInfo()),
    "vllm": ("rft.rollout.engines.vllm.VLLMEngine", EngineInfo(collective_tensor_parallel=False)),
})

# trainer.trainer_strategy -> the trainer class
TRAINER_BACKENDS = Registry("trainer.trainer_strategy", info="info", default=TrainerBackendInfo(),
                            shape="a class with the methods of rft/trainer/base.py (module.Class)", foreign={
    "fsdp": "Trinity-RFT's and verl's fsdp is fsdp2 here (trainer=fsdp2).",
    "megatron": "There is no Megatron backend here: trainer=fsdp2 shards the weights, gradients and optimizer state "
                "over its ranks."}, table={
    "torch": ("rft.trainer.trainer.Trainer", TrainerBackendInfo(builds_from_checkpoint=True)),
    "fsdp2": ("rft.trainer.fsdp.FSDPTrainer", TrainerBackendInfo(ranks=True, offload=True, mixed_precision=True,
                                                                 builds_from_checkpoint=True)),
})
