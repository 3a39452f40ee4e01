"""Where a run writes at a path that a config key gives, besides its run directory: what the
studio's launch checks against its checkpoint root (rft/studio/app.py launch_args), as the run
resolves each stage's config.

- cache_dir: the models the project builds, the tasksets it generates, the task pipeline's output
  (rft/models.py, rft/data/tasks.py, rft/data/pipeline.py). conf/config.yaml's own value, the
  machine's cache shared by every run ($RFT_CACHE_DIR or ~/.cache/rft), is allowed where it is.
- stage_cache_dir: finished warm-up stages, published for reuse (rft/runtime/main.py).
- buffer.trainer_input.experience_buffer.path: a sql buffer's database in any mode (its tables
  and the reader's cursor are written there), a file buffer's JSONL where the explorer writes it
  (mode both or explore). mode=train reading a file of experiences or a dataset only reads it.
- monitor.mlflow_tracking_uri with monitor_type mlflow: a local store (sqlite:///, file:, a path).

- model.model_path with a model.builder, and a taskset's path with a generator, where nothing is
  there yet: the project builds the model (rft/models.py ensure_model) or generates the data (by a
  dry run's plan too) there; in the shared cache, allowed.

Paths a run only reads are not here (model.model_path and a taskset's path that exist,
algorithm.teacher_model_path, trainer.resume_from_path, synchronizer.checkpoint_dir, auxiliary
buffers): a researcher reads data from anywhere.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from omegaconf import OmegaConf

BUFFER = "buffer.trainer_input.experience_buffer"
# what leaving each key as conf/ sets it gives: the refusal's fix
KEPT = {"cache_dir": "leave it as conf/config.yaml sets it (the machine's shared cache of built models and data)",
        "stage_cache_dir": "leave it as conf/config.yaml sets it (under the root), or null (no reuse)",
        f"{BUFFER}.path": "leave it unset (the stage's own buffer.db or experiences.jsonl, in its directory)",
        "monitor.mlflow_tracking_uri": "leave it unset (mlflow.db under the root), or give a server's http(s):// address",
        "model.model_path": "leave it as the model's config sets it (built in the shared cache), or give a model that exists",
        "buffer.explorer_input.taskset.path": "leave it as the task sets it (generated in the shared cache), or give "
                                              "data that exists"}
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


@dataclass(frozen=True)
class Write:
    key: str
    value: str  # as composed
    path: str  # the local path the run writes, `~` expanded
    stage: str | None = None  # the stage whose own value it is (None: the config's, every stage's)


def local_path(value: str, uri: bool = False) -> str:
    """The file or folder a value names, as the run opens it: sqlite:///x is x (the buffer and
    MLflow both strip it); with `uri`, file:x is x and any other scheme (a server) is ""."""
    if value.startswith("sqlite:///"):
        value = value[len("sqlite:///"):]
    elif uri and value.startswith("file:"):
        value = urlparse(value).path
    elif uri and SCHEME.match(value):
        return ""
    return os.path.expanduser(value)


def shared_cache(conf_dir: Path) -> str:
    """conf/config.yaml's cache_dir, resolved (as the run's environment gives it), `~` expanded."""
    try:
        value = OmegaConf.load(Path(conf_dir) / "config.yaml").get("cache_dir")
    except Exception:  # no such file, or an interpolation that needs the whole config
        value = None
    return os.path.expanduser(str(value)) if value is not None else ""


def _built(stage) -> list[tuple[str, object, bool]]:
    """A model the project would build, a taskset it would generate, where nothing is yet."""
    out = []
    m, inp = stage.get("model") or {}, stage.buffer.get("explorer_input") or {}
    for key, value, maker in (("model.model_path", m.get("model_path"), m.get("builder")),
                              ("buffer.explorer_input.taskset.path", (inp.get("taskset") or {}).get("path"),
                               inp.get("generator"))):
        if maker and value and not Path(local_path(str(value))).exists():
            out.append((key, value, False))
    return out


def _stage_writes(stage) -> list[tuple[str, object, bool]]:
    """(key, value, whether it is a URI) for each place this stage's config makes it write."""
    out = [("cache_dir", stage.get("cache_dir"), False), *_built(stage)]
    eb = stage.buffer.trainer_input.experience_buffer
    if str(eb.storage_type) == "sql" or (str(eb.storage_type) == "file" and str(stage.mode) in ("both", "explore")):
        out.append((f"{BUFFER}.path", eb.get("path"), False))
    if "mlflow" in list(stage.monitor.monitor_type or []):
        out.append(("monitor.mlflow_tracking_uri", stage.monitor.get("mlflow_tracking_uri"), True))
    return out


def written(job, stages: list, cache: str, planning: bool = False) -> list[Write]:
    """Every place the run of `job` (its stages' configs as rft.plan.batch.stage_configs merges
    them) writes at a path a key gives; cache_dir at `cache` (shared_cache) left out. A dry run
    writes nothing but what its plan does (`planning`: a generated taskset's data, into cache_dir)."""
    if job.get("dry_run") and not planning:
        return []
    if planning:
        found = [(key, value, uri, s.get("stage_name")) for s in stages  # (a model is built when the run starts)
                 for key, value, uri in [("cache_dir", s.get("cache_dir"), False), *_built(s)] if key != "model.model_path"]
        return _writes(job, found, cache)
    found = [("stage_cache_dir", job.get("stage_cache_dir"), False, None)]  # read from the run's config only
    for s in stages:
        found += [(key, value, uri, s.get("stage_name")) for key, value, uri in _stage_writes(s)]
    return _writes(job, found, cache)


def _writes(job, found: list, cache: str) -> list[Write]:
    """(key, value, is a URI, stage) -> the Writes, cache_dir at `cache` left out, each once."""
    out = []
    for key, value, uri, stage in found:
        path = local_path(str(value), uri) if value not in (None, "") else ""
        if not path or (key == "cache_dir" and path == cache) or (key in _BUILT and _under(path, cache)):
            continue
        # the stage is named where the value is its own, not the config's that every stage has
        own = stage is not None and str(OmegaConf.select(job, key, default=None, throw_on_resolution_failure=False)) != str(value)
        write = Write(key, str(value), path, stage if own else None)
        if write not in out:
            out.append(write)
    return out


_BUILT = ("model.model_path", "buffer.explorer_input.taskset.path")


def _under(path: str, folder: str) -> bool:
    return bool(folder) and Path(path).is_absolute() and Path(path).resolve().is_relative_to(Path(folder).resolve())


def refusal(root: Path, writes: list[Write]) -> str | None:
    """The one paragraph for the first write outside `root` (a relative path is one: the run reads
    it from its working directory), or None."""
    base = Path(root).resolve()
    for w in writes:
        absolute = Path(w.path).is_absolute()
        if absolute and Path(w.path).resolve().is_relative_to(base):
            continue
        where = f"{w.key}={w.value}" + (f" (stage {w.stage})" if w.stage else "")
        shown = (str(Path(w.path).resolve()) if absolute
                 else f"{w.path} (a relative path: in the run's working directory, the repository)")
        return (f"{where}: the run would write to {shown}, outside the checkpoint root {root} that this studio shows "
                f"and launches into. Give a path under {root}, or {KEPT[w.key]}, or start the studio with --root on "
                f"a folder that holds it (python -m rft.studio --root DIR).")
    return None
