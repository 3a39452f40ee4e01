"""What a run directory holds, and what running the same name again does with it.

    <run>/.run.lock          held by the run writing the directory (run_lock)
    <run>/.hydra/            config.yaml (as composed), overrides.yaml, hydra.yaml. Written here
                             (conf/config.yaml sets hydra.output_subdir=null) once the run is
                             about to start: a dry run writes nothing, and a run moved aside by
                             continue_from_checkpoint=false keeps its own record
    <stage>/config.yaml      the stage's resolved config, its fingerprint on the first line
    <stage>/data.json        the digest of each local dataset file the stage reads
    <stage>/config_changes.log  what resume_with_changes=true accepted, and when
    <stage>/reused_from      the stage cache entry this stage was copied from

Running a name again resumes it. A stage that already has outputs must be asked for with the same
config, except for the keys that say where the run is written, where it runs and how it is
watched (`WHERE_AND_HOW`) and `buffer.total_steps` going up (not on a stage a later stage has
trained from: its result would stay that of the shorter stage), and with the same bytes in its
local datasets: otherwise the run stops before anything starts, listing the differences and the
three ways on.

The stage cache (`stage_cache_dir`): a finished stage that a later stage starts from (a warm-up;
not a run's last stage, which a re-run of the same config means to train) is published with its
final checkpoint and logs under `<stage_cache_dir>/<key>/`; a stage with the same key (the same
config except `WHERE_AND_HOW`, the same starting model and the same data files, and the same other
models: a teacher, reward models, an earlier stage's reward model by its key) is copied from
there instead of trained again: a sweep over the RL stage's learning rate runs its shared SFT
warm-up once per seed. Files are hard-linked where the filesystem allows. A lock per key makes concurrent jobs (a
sweep on Slurm, on a filesystem with working file locks) wait for the one that trains the stage.
An entry is sealed like a checkpoint (rft/manifest.py: every file's size and digest, and whose
stage it is) and checked before it is copied: a damaged one is moved aside and the stage trains.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from rft import manifest
from rft.config import flat
from rft.errors import ConfigError, RunError
from rft.reporting.redact import config_yaml, redact, redact_overrides
from rft.reporting.sweep import OWN_LOG
from rft.runtime.checkpoint import Owner, describe, read_checkpoint, shown

log = logging.getLogger(__name__)

# where a run is written, where it runs, how it is watched: may change between a run and its
# resume, and never make two stages' results differ
WHERE_AND_HOW = (
    "name", "project", "checkpoint_root_dir", "cache_dir", "stage_cache_dir", "dry_run",
    "continue_from_checkpoint", "resume_with_changes", "objective", "monitor", "log", "cluster",
    "synchronizer.sync_timeout", "buffer.trainer_input.experience_buffer.max_read_timeout",
    # which checkpoint a run resumes from, how many it keeps and which of them hold hf/
    "trainer.resume_from_path", "trainer.max_ckpt_to_keep", "trainer.save_hf_checkpoint",
)
# the keys of the taskset's reward (reward_fn, or its parts reward_fn.<i>.*): read only where the
# stage explores (cache_key)
TASKSET_REWARD = "buffer.explorer_input.taskset.reward_fn"
# may go up on resume (a longer run); anything else that differs is a change
MAY_GROW = ("buffer.total_steps",)
# in the run directory: held by the run writing it (run_lock)
RUN_LOCK = ".run.lock"
# <stage>/data.json: the digest of every dataset file the stage reads, as it started (or was
# last accepted with resume_with_changes=true)
DATA_RECORD = "data.json"


# ---------------------------------------------------------------- fingerprints


def identity(cfg, masked: bool = True) -> dict[str, Any]:
    """What determines a stage's results: its flat config without WHERE_AND_HOW, nor a teacher that
    distillation does not read (a warm-up stage inherits the RL stage's: grpo and opd arms of a
    sweep share their warm-up). `masked`: secrets as the saved config holds them (***), for what is
    compared with it; the stage cache's key takes them whole, since a key named `token` may be a
    reward's argument that changes its results (a tag to look for), not a secret."""
    keys = redact(flat(cfg)) if masked else flat(cfg)
    unused = () if keys.get("algorithm.distill_coef") else ("algorithm.teacher_model_path",)
    return {k: v for k, v in keys.items()
            if not any(k == w or k.startswith(w + ".") for w in WHERE_AND_HOW) and k not in unused}


def fingerprint(obj) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def config_fingerprint(cfg, masked: bool = True) -> str:
    """The fingerprint a stage's checkpoints carry: its identity, less the keys that may grow on
    resume (what check_unchanged lets pass without resume_with_changes)."""
    return fingerprint({k: v for k, v in identity(cfg, masked).items() if k not in MAY_GROW})


def owner(cfg, title: str, after: str | None, saved: dict | None = None) -> Owner:
    """Whose checkpoints stage `title` writes: this run, this stage, its config, and what it starts
    from (model.model_path, then the stage `after`, whose final model a later stage starts from).
    `saved`: the config the stage ran with (saved_config), whose checkpoints an rft that has added
    keys since resumes (`upgraded`)."""
    model = os.path.expanduser(str(cfg.model.model_path))
    return Owner(run=f"{cfg.project}/{cfg.name}", stage=title, config=config_fingerprint(cfg),
                 unmasked_config=config_fingerprint(cfg, masked=False),
                 upgraded_config=config_fingerprint(upgraded(saved, cfg)) if saved else "",
                 model=model if after is None else f"{model}, then stage {after}",
                 changes_ok=bool(cfg.resume_with_changes))


_NO = object()  # no schema default to compare with


def upgraded(saved: dict, cfg) -> dict:
    """`cfg`, a stage's config now (as containers), less each key that its `saved` config (the one it
    ran with) lacks and that holds the schema's default: a key an update of rft added since the stage
    ran, at the value that keeps what the rft before it did. Without this a run could not resume after
    such an update ("explorer.bench_on_starting_model: '(absent)' -> False") unless
    resume_with_changes=true. A new key at another value (the command's, a conf file's) stays a change."""
    from rft.config import Config

    current = cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    return _less_new_defaults(saved, current, OmegaConf.structured(Config))


def _less_new_defaults(saved, current, schema):
    if isinstance(saved, dict) and isinstance(current, dict):
        return {k: v if k not in saved else _less_new_defaults(saved[k], v, _schema_part(schema, k))
                for k, v in current.items() if k in saved or _default(_schema_part(schema, k)) != v}
    if isinstance(saved, list) and isinstance(current, list) and len(saved) == len(current):
        # a list of structured entries (eval_tasksets): each entry against its type's defaults
        kind = getattr(getattr(schema, "_metadata", None), "element_type", None)
        entry = OmegaConf.structured(kind) if isinstance(kind, type) and hasattr(kind, "__dataclass_fields__") else _NO
        return [_less_new_defaults(a, b, entry) for a, b in zip(saved, current)]
    return current


def _schema_part(schema, key: str):
    """The schema's node or value under `key`, or _NO (no such key, or no value without a run's config)."""
    from omegaconf import DictConfig

    try:
        return schema[key] if isinstance(schema, DictConfig) and key in schema else _NO
    except Exception:  # an interpolation or a mandatory value (???) the schema alone cannot resolve
        return _NO


def _default(part):
    """A schema part's default as a config's containers hold it (_NO where there is none)."""
    from omegaconf import Container

    if part is _NO:
        return _NO
    try:
        return OmegaConf.to_container(part, resolve=True, enum_to_str=True) if isinstance(part, Container) else (
            part.name if hasattr(part, "name") and hasattr(type(part), "__members__") else part)
    except Exception:
        return _NO


def path_identity(path: str | None) -> Any:
    """A local file or directory by its files' names, sizes and modification times; anything
    else (a hub id) by its name."""
    if not path:
        return None
    p = Path(os.path.expanduser(str(path).removeprefix("sqlite:///")))
    if p.is_file():
        st = p.stat()
        return [str(p), st.st_size, st.st_mtime_ns]
    if p.is_dir():
        # a manifest says what the other files are: sealing a directory in place (rft.manifest.install) keeps its identity
        files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.endswith(".lock")
                       and f.relative_to(p).as_posix() != manifest.MANIFEST)
        return [str(p)] + [[str(f.relative_to(p)), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    return str(path)


def data_paths(cfg) -> list:
    inp, tin = cfg.buffer.explorer_input, cfg.buffer.trainer_input
    paths = [inp.taskset.path, *(ts.path for ts in inp.eval_tasksets), tin.experience_buffer.path]
    paths += [v.get("path") if hasattr(v, "get") else None for v in tin.auxiliary_buffers.values()]
    return paths


def cacheable(cfg) -> bool:
    """Stages that train from data that stays put: not one reading a buffer another job may still
    be writing (mode=train on sql), not an explorer (no model of its own)."""
    eb = cfg.buffer.trainer_input.experience_buffer
    return cfg.mode == "both" or (cfg.mode == "train" and eb.storage_type == "file")


def model_paths(cfg) -> list:
    """The models a stage reads beside the one it starts from, given by directory or hub id: its
    distillation teacher (when it distils) and its reward models (stage:<title> ones are keyed by
    that stage's key: cache_key's `reads`)."""
    from rft.runtime import stage_models

    teacher = [cfg.algorithm.teacher_model_path] if cfg.algorithm.get("distill_coef") else []
    return [p for p in teacher + stage_models.fixed_paths(cfg) if p]


def cache_key(cfg, start: str, reads: dict[str, str] | None = None) -> str:
    """The stage's key: its identity, its starting point (the model's files, or the previous
    stage's key), the identity of every data file it reads, and of every other model it reads (a
    teacher's or reward model's files; `reads`: the keys of the earlier stages whose reward models
    it reads as stage:<title>). Each only when there is one: the key of a stage without stays as it was."""
    models = [path_identity(p) for p in model_paths(cfg)]
    stage = identity(cfg, masked=False)
    if not reads_taskset_reward(cfg):  # a sweep over the RL stage's reward trained its warm-up once per job
        stage = {k: v for k, v in stage.items() if not k.startswith(TASKSET_REWARD)}
    return fingerprint({"stage": stage, "start": start, "data": [path_identity(p) for p in data_paths(cfg)],
                        **({"models": models} if models else {}), **({"reads": reads} if reads else {})})


def reads_taskset_reward(cfg) -> bool:
    """Whether the stage calls the taskset's reward: a stage that explores nothing (mode=train) never
    does (its eval sets name their own, or default_reward_fn_type), unless a task pipeline, which
    may choose its rows by that reward (llm_difficulty_score_filter), runs before it."""
    return cfg.mode != "train" or bool(cfg.data_processor.task_pipeline.operators)


def start_identity(model_cfg) -> str:
    return fingerprint(path_identity(model_cfg.model_path))


# ---------------------------------------------------------------- a stage's config on disk


def has_outputs(stage_dir: Path) -> bool:
    metrics, checkpoints = stage_dir / "metrics.jsonl", stage_dir / "checkpoints"
    return (checkpoints.is_dir() and any(checkpoints.iterdir())) or (metrics.exists() and metrics.stat().st_size > 0)


def saved_config(stage_dir: Path) -> dict | None:
    """The config a stage ran with, as write_config saved it (None: none, or damaged: record_problem)."""
    path = stage_dir / "config.yaml"
    if not path.exists():
        return None
    try:
        cfg = manifest.written_yaml(manifest.read_record(path).decode())
    except (yaml.YAMLError, RecursionError, UnicodeDecodeError, OSError):  # RecursionError: without libyaml
        return None
    return cfg if isinstance(cfg, dict) else None


def record_problem(stage_dir: Path) -> str | None:
    """What is wrong with a started stage's config.yaml, or None: missing, not YAML, or not what
    was saved (its first line's fingerprint, of the config below it, no longer matches: cut short
    or edited)."""
    path = stage_dir / "config.yaml"
    if not path.exists():
        return "is missing"
    cfg = saved_config(stage_dir)
    if cfg is None:
        return "does not parse as a config"
    head = manifest.read_record(path).decode().split("\n", 1)[0]  # read whole just above
    # unmasked: the record of an rft from before secrets were masked in it, holding a token whole
    if head not in (f"# fingerprint: {fingerprint(identity(cfg))}", f"# fingerprint: {fingerprint(identity(cfg, False))}"):
        return "is not the one saved (its first line's fingerprint does not match what follows: cut short or edited)"
    return None


def write_config(cfg, stage_dir: Path) -> None:
    stage_dir.mkdir(parents=True, exist_ok=True)
    text = config_yaml(cfg, resolve=True)
    manifest.write_atomic(stage_dir / "config.yaml", f"# fingerprint: {fingerprint(identity(cfg))}\n{text}")
    manifest.write_atomic(stage_dir / DATA_RECORD, json.dumps(data_digests(cfg), indent=1, sort_keys=True))


def data_digests(cfg) -> dict[str, dict[str, str]]:
    """{path: {file: digest}} of the local datasets a stage reads (its tasksets and eval sets, a
    training dataset, auxiliary ones; not a buffer another job writes, not a hub id): what a re-run
    compares, so rows written anew under the same path are not resumed as the old ones. By
    content, so a copy or a checkout of the same bytes is no change."""
    from rft.plan.batch import stored_experiences

    inp, tin = cfg.buffer.explorer_input, cfg.buffer.trainer_input
    paths = [inp.taskset.path, *(ts.path for ts in inp.eval_tasksets)]
    eb = tin.experience_buffer
    if cfg.mode == "train" and eb.storage_type == "file" and eb.path and not stored_experiences(eb):
        paths.append(eb.path)
    paths += [aux.get("path") for aux in tin.auxiliary_buffers.values() if hasattr(aux, "get")]
    out = {}
    for path in dict.fromkeys(str(p) for p in paths if p):
        p = Path(os.path.expanduser(path))
        files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else []
        if files:
            out[path] = {(f.name if f == p else f.relative_to(p).as_posix()): manifest.digest(f)
                         for f in files if not f.name.endswith(".lock")}
    return out


def data_differences(stage_dir: Path, cfg) -> list[str]:
    """'path: file, ... changed since the stage started' for each dataset whose files' bytes
    differ from the stage's record (none for a stage recorded before there was one). A record that
    does not read is a difference itself: taken for none, a changed dataset would pass unnoticed."""
    record = stage_dir / DATA_RECORD
    if not record.exists():
        return []
    try:
        old = json.loads(manifest.read_record(record))
        if not all(isinstance(v, dict) for v in old.values()):
            raise ValueError
    except (OSError, ValueError, AttributeError, RecursionError):
        return [f"{record} (the digests of the datasets the stage started with) does not parse (cut short or "
                f"overwritten), so whether they changed cannot be told"]
    new = data_digests(cfg)
    out = []
    for path in sorted(set(old) & set(new)):
        names = sorted(set(old[path]) | set(new[path]))
        for what, which in (("changed", lambda a, b: a and b and a != b), ("is new", lambda a, b: not a),
                            ("is gone", lambda a, b: not b)):
            hit = [n for n in names if which(old[path].get(n), new[path].get(n))]
            if hit:
                out.append(f"{path}: {', '.join(hit)} {what} since the stage started")
    return out


def differences(old: dict, new: dict) -> list[str]:
    """'key: old -> new' for each key whose value differs, but for MAY_GROW keys going up."""
    missing = "(absent)"
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k, missing), new.get(k, missing)
        if a == b:
            continue
        if k in MAY_GROW and isinstance(a, int) and isinstance(b, int) and b > a:
            continue
        if isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(isinstance(x, dict) for x in a + b):
            # a list of sections (eval sets): the keys that differ in them, not both lists whole
            out += differences(*({f"{k}.{i}.{key}": v for i, x in enumerate(side) for key, v in flat(x).items()}
                                 for side in (a, b)))
            continue
        out.append(f"{k}: {a!r} -> {b!r}")
    return out


def grown(saved: dict, cfg) -> list[tuple[str, int, int]]:
    """(key, old, new) of each MAY_GROW key that went up since the saved config."""
    old, new = identity(saved), identity(cfg)
    return [(k, old[k], new[k]) for k in MAY_GROW
            if isinstance(old.get(k), int) and isinstance(new.get(k), int) and new[k] > old[k]]


def check_unchanged(cfg, stages, stage_dirs, run_dir: Path) -> dict[str, list[str]]:
    """The differences between each started stage's saved config and this run's; a ConfigError
    unless there are none or resume_with_changes=true (then returned, to be logged)."""
    found = {}
    for i, (s, d) in enumerate(zip(stages, stage_dirs)):
        if not has_outputs(d):
            continue
        name = s.stage_name or s.algorithm.algorithm_type
        problem = record_problem(d)
        if problem and not cfg.resume_with_changes:
            raise ConfigError(
                f"{d / 'config.yaml'}, the record of the configuration stage {name} ran with, {problem}, so rft "
                f"cannot tell whether this run's configuration is the same. Put the file back (the whole "
                f"run's config is in {run_dir / '.hydra' / 'config.yaml'}), go on with this run's configuration "
                f"from the newest checkpoint (resume_with_changes=true), or start over "
                f"(continue_from_checkpoint=false: the old outputs move to {run_dir}/previous_<time>/)."
            )
        saved = None if problem else saved_config(d)
        diff = [f"config.yaml {problem}: written anew"] if problem else differences(identity(saved), identity(upgraded(saved, s)))
        diff += data_differences(d, s)
        later = next((t.stage_name for t, e in zip(stages[i + 1:], stage_dirs[i + 1:]) if has_outputs(e)), None)
        if later and not problem:
            # a longer run of the last stage is allowed; of a stage another one started from, it
            # changes what that stage started from
            diff += [f"{k}: {a} -> {b}, but stage {later} already trained from its {a}-step model"
                     for k, a, b in grown(saved_config(d), s)]
        if diff:
            found[name] = diff
    if found and not cfg.resume_with_changes:
        listed = "; ".join(f"stage {name}: " + ", ".join(diff) for name, diff in found.items())
        raise ConfigError(
            f"the run directory {run_dir} holds a run made with another configuration ({listed}). "
            f"Running the same name resumes that run, so the change would be skipped or mixed in "
            f"silently. Either give this run another name (name=...), start this one again "
            f"(continue_from_checkpoint=false: the old outputs move to {run_dir}/previous_<time>/), "
            f"or continue it with the new values from its newest checkpoint (resume_with_changes=true)."
        )
    return found


def note_changes(stage_dir: Path, diff: list[str]) -> None:
    fd = os.open(stage_dir / "config_changes.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    with open(fd, "a") as f:
        f.write(f"{datetime.datetime.now():%Y-%m-%d %H:%M:%S} resume_with_changes=true: " + "; ".join(diff) + "\n")


# ---------------------------------------------------------------- the run's record


# what to point at a writable directory, by the key checked (conf/config.yaml: the environment
# variable each key's default reads)
_POINT = {"cache_dir": "cache_dir (or RFT_CACHE_DIR)",
          "HF_DATASETS_CACHE": "the environment variable HF_DATASETS_CACHE (or HF_HOME: Hugging Face's cache)"}


def check_writable(run_dir: Path, key: str = "checkpoint_root_dir") -> None:
    """Fail now, not at the first checkpoint after training steps are lost."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write_test_{os.getpid()}"
        probe.unlink(missing_ok=True)  # a link of that name goes, its target untouched (opening it truncated that)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666))
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"cannot write to {run_dir} ({type(e).__name__}: {e.strerror or e}). Point "
            f"{_POINT.get(key, f'{key} (or RFT_CHECKPOINT_ROOT_DIR)')} at a writable directory."
        ) from e


def datasets_cache() -> Path:
    """Where `datasets` caches what it reads (its config's HF_DATASETS_CACHE, without importing
    `datasets` in the driver): under HOME unless the environment says otherwise."""
    from huggingface_hub import constants

    return Path(os.path.expanduser(os.environ.get("HF_DATASETS_CACHE") or os.path.join(constants.HF_HOME, "datasets")))


@contextmanager
def run_lock(run_dir: Path):
    """Held while a run writes `run_dir`: a second run of the same directory (the same command
    started twice, a job requeued while it still runs) stops before it moves or writes anything,
    naming the process that holds it. An flock, released by the kernel when the holder dies.
    Yields what the run before wrote into the lock file ("pid N on host (Slurm job J)"; `requeued`)."""
    import fcntl
    import socket

    path = run_dir / RUN_LOCK
    refuse_links(run_dir)
    # errors="replace": the text is a note (who held it), and bytes that are not UTF-8 (a damaged
    # file) must not stop every later run of the name; it is rewritten below
    with open(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666), "r+", errors="replace") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "a process that has not said its id yet"
            raise RunError(
                f"another rft process ({holder}) is running in {run_dir} (it holds {path}); two runs writing one "
                f"directory overwrite each other's checkpoints and logs. Wait for it to end (or stop it), or give "
                f"this run another name (name=...).") from None
        except OSError as e:  # a filesystem without locks: the run goes on unguarded, as it did before
            log.warning("could not lock %s (%s): a second run of this name at once would not be stopped", path, e)
        finished = finish_move_aside(run_dir)
        if finished is not None:
            log.warning("a move of %s's earlier outputs, cut short by a kill, is finished: they are all in %s",
                        run_dir, finished)
        f.seek(0)
        before = f.read().strip()
        f.seek(0)
        f.truncate()
        job = os.environ.get("SLURM_JOB_ID")  # kept by a requeued job
        f.write(f"pid {os.getpid()} on {socket.gethostname()}{f' (Slurm job {job})' if job else ''}\n")
        f.flush()
        yield before


def remove_if_unused(run_dir: Path) -> None:
    """`run_dir` removed if it holds nothing but its unheld lock and this process's log (Hydra's
    run.log: a line or two before the refusal, which the terminal showed): what a start refused
    after run_lock leaves (with it, `continue_from_checkpoint=false` later moved it aside as "the
    earlier outputs", and a folder with no run was listed beside the runs). A lock another run holds
    now stays, and so does every folder with anything else in it."""
    import fcntl

    lock = run_dir / RUN_LOCK
    try:
        here = run_dir.resolve()
        logs = [h for h in logging.getLogger().handlers
                if isinstance(h, logging.FileHandler) and Path(h.baseFilename).parent == here]
        if any(p.name != RUN_LOCK and p.resolve() not in {Path(h.baseFilename) for h in logs} for p in run_dir.iterdir()):
            return
        for h in logs:  # taken off too: a line logged later would make the file, or fail, again
            logging.getLogger().removeHandler(h)
            h.close()
            Path(h.baseFilename).unlink(missing_ok=True)
        if lock.is_file() and not lock.is_symlink():
            with open(lock, "rb") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError (an OSError): held
                lock.unlink()
        run_dir.rmdir()  # only succeeds when empty
    except OSError:
        pass


def planted_links(run_dir: Path) -> list[Path]:
    """The links in `run_dir` a run could write through: each one not to a folder (to a file, or to
    nothing); and the FIFOs, sockets and devices, which a run reading its logs back would wait on
    forever (or read without end); and a folder where rft writes a file (`_folder_for_a_file`). rft
    makes none; a link to a folder (checkpoints on a scratch
    disk) is the user's own and not entered. Not looked into: the checkpoints, sealed and never
    written into once made (their manifest refuses a link: rft.manifest), earlier outputs
    moved aside (previous_*), and wandb's folder, which rft never writes and whose logs are links
    wandb makes (wandb/debug.log to its latest run's; debug-core.log into ~/.cache/wandb): with
    them, every resume of a monitor_type=[wandb] run was refused."""
    found = []
    for root, dirs, names in os.walk(run_dir):  # followlinks=False
        here = Path(root)
        found += [here / n for n in dirs + names if (here / n).is_symlink() and not (here / n).is_dir()
                  or not ((here / n).is_symlink() or (here / n).is_dir() or (here / n).is_file())
                  or _folder_for_a_file(here / n, here == run_dir)]
        dirs[:] = [d for d in dirs if not (d.startswith("previous_") and here == run_dir)
                   and not (here.name == "checkpoints" and d.startswith("step_")) and d != "wandb"]
    return sorted(found)


# a folder under one of these names is where rft writes a file: run.log, .run.lock, and below the run's
# top level its records and logs (.hydra/config.yaml, <stage>/metrics.jsonl, data.json, log/<actor>.log)
TOP_FILES = ("run.log", RUN_LOCK)
FILE_SUFFIXES = (".log", ".jsonl", ".json", ".yaml", ".lock")


def _folder_for_a_file(p: Path, top: bool) -> bool:
    """Whether `p` is a folder (not a link to one) under a name rft writes a file of: opened, read or
    replaced by the run, it ended in a raw IsADirectoryError. A stage's folder is named by its
    stage_name, so at the top level only rft's own names count."""
    return (p.is_dir() and not p.is_symlink()
            and (p.name in TOP_FILES if top else p.name.endswith(FILE_SUFFIXES) or p.name == "reused_from"))


def refuse_links(run_dir: Path) -> None:
    """A RunError naming the first of `planted_links`: run.log, metrics.jsonl, .run.lock, a
    config.yaml.tmp linked to a file elsewhere (a run directory handed over as "resume from mine", a
    results folder others write to) had the run truncate that file, or append its log to it (a
    ~/.bashrc, whose lines a shell runs)."""
    links = planted_links(run_dir)
    first = shown(links[0]) if links else ""  # its name came with the run: an escape sequence is shown as text
    if links and links[0].is_dir() and not links[0].is_symlink():
        raise RunError(
            f"{first} is a folder, where rft writes a file of that name in the run directory {run_dir} (its log, "
            f"a record it reads back on resume). It was put there by hand or came with a copy of the run. Move it "
            f"away (a file of its contents, if any, is the run's own), or give this run another name (name=...).")
    if links and not links[0].is_symlink():
        raise RunError(
            f"{first} is not a regular file (a FIFO, a socket or a device): rft writes only files and folders in "
            f"the run directory {run_dir}, and a run reading it back would wait on it forever. It was put there by "
            f"hand or came with a copy of the run. Remove it (`find {run_dir} ! -type f ! -type d` lists such "
            f"entries), or give this run another name (name=...).")
    if links:
        more = f" (and {len(links) - 1} more)" if len(links) > 1 else ""
        raise RunError(
            f"{first} is a link (to {shown(os.readlink(links[0]))}){more}: rft writes its own files in the run directory "
            f"{run_dir} and never makes a link there, so a run would write through it into the file it points to. It "
            f"was put there by hand or came with a copy of the run. Remove the link{'s' if more else ''} (`find "
            f"{run_dir} -type l` lists them; a link to a folder may stay), or give this run another name (name=...).")


def requeued(before: str, env=os.environ) -> str | None:
    """'Slurm job J, restart N' when this run is a Slurm job that was requeued (preempted, past its
    time limit: conf/hydra/launcher/slurm.yaml max_num_timeout) and this directory's last writer
    (`before`, from run_lock) was the same job: its own earlier attempt, which it continues."""
    job, restarts = env.get("SLURM_JOB_ID"), env.get("SLURM_RESTART_COUNT", "0")
    if job and restarts.isdigit() and int(restarts) > 0 and before.endswith(f"(Slurm job {job})"):
        return f"Slurm job {job}, restart {restarts}"
    return None


def move_aside(run_dir: Path) -> Path | None:
    """continue_from_checkpoint=false on a used directory: every earlier output, its .hydra/
    record and logs included, moves to previous_<time>/ (not the lock this run holds), whole or
    not at all: into previous_<time>.tmp/ first, renamed when all are in (a kill midway split
    them over two previous_ folders, or left a resume half of them)."""
    earlier = finish_move_aside(run_dir)  # (run_lock has finished one already)
    if not _outputs(run_dir):
        return earlier
    stamp = f"previous_{datetime.datetime.now():%Y%m%d_%H%M%S}"
    backup, n = run_dir / stamp, 1
    while backup.exists() or backup.with_name(backup.name + ".tmp").exists():  # twice in a second, clock set back
        n += 1
        backup = run_dir / f"{stamp}-{n}"
    backup.with_name(backup.name + ".tmp").mkdir()
    moved = finish_move_aside(run_dir)
    # a log file this process has open (Hydra's run.log) moved with the rest: let its handler
    # start a new one at the old path on its next line
    for h in logging.getLogger().handlers:
        if isinstance(h, logging.FileHandler) and Path(h.baseFilename).parent == run_dir:
            h.close()
    return moved


def _outputs(run_dir: Path) -> list[Path]:
    # a sweep job's record of its launcher log (rft.reporting.sweep.OWN_LOG) is this attempt's: it stays
    return [p for p in run_dir.iterdir() if not p.name.startswith("previous_") and p.name not in (RUN_LOCK, OWN_LOG)]


def finish_move_aside(run_dir: Path) -> Path | None:
    """Move every output into the previous_<time>.tmp/ a move aside began (a kill midway left it,
    and run_lock finishes it before a run reads the directory), then rename it previous_<time>/;
    returns that, or None when no move was begun. Renames within one directory: nothing is copied."""
    done = None
    # a link named so (run_lock refuses one to a file) is no move of rft's: the outputs would go where it points
    for tmp in sorted(p for p in run_dir.glob("previous_*.tmp") if p.is_dir() and not p.is_symlink()):
        for p in _outputs(run_dir):
            dst, n = tmp / p.name, 1
            while dst.exists():  # written again after the kill (this run's run.log): both kept
                n += 1
                dst = tmp / f"{p.name}-{n}"
            os.rename(p, dst)
        done = tmp.with_name(tmp.name.removesuffix(".tmp"))
        os.rename(tmp, done)
    if done is not None:
        fd = os.open(run_dir, os.O_RDONLY)
        try:
            os.fsync(fd)  # the renames reach the disk before the run writes anew
        finally:
            os.close(fd)
    return done


def write_record(cfg, run_dir: Path) -> None:
    """The run's .hydra/ record, as Hydra writes it (Hydra's own writing is turned off)."""
    from hydra.core.hydra_config import HydraConfig

    d = run_dir / ".hydra"
    d.mkdir(parents=True, exist_ok=True)
    # each file whole or not at all: every run of the name writes them again (a resumed sweep's
    # finished jobs too), and one cut by a kill still parsed, as a plan of fewer stages or fewer overrides
    manifest.write_atomic(d / "config.yaml", config_yaml(cfg))
    if HydraConfig.initialized():
        hydra_cfg = HydraConfig.instance().cfg
        manifest.write_atomic(d / "hydra.yaml", config_yaml(hydra_cfg))
        manifest.write_atomic(d / "overrides.yaml", OmegaConf.to_yaml(redact_overrides(hydra_cfg.hydra.overrides.task)))


# ---------------------------------------------------------------- the stage cache


def _link_tree(src: Path, dst: Path) -> None:
    """A copy of src at dst, hard-linking files where the filesystem allows."""
    def link(s, d):
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)

    shutil.copytree(src, dst, copy_function=link)


@contextmanager
def stage_lock(entry: Path | None, title: str, say):
    """Hold the cache key's lock while the stage is reused or trained: another job with the same
    stage waits here (and says so once) instead of training it a second time."""
    if entry is None:
        yield
        return
    from filelock import FileLock, Timeout

    entry.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(entry) + ".lock")

    def acquire():
        try:
            lock.acquire(timeout=1)
        except Timeout:
            say(f"[{title}] waiting for another job that trains the same stage (lock {entry}.lock)")
            t0 = time.monotonic()
            lock.acquire()
            say(f"[{title}] the other job finished after {time.monotonic() - t0:.0f} s")

    try:  # both acquires: the lock may become a link while this job waits
        acquire()
    except OSError as e:  # (Timeout is an OSError too: caught inside) a link there: filelock opens with O_NOFOLLOW
        path = Path(str(entry) + ".lock")
        why = f"it is a link (to {os.readlink(path)}), which rft never makes there" if path.is_symlink() else e.strerror
        raise RunError(
            f"[{title}] the stage cache's lock {path} cannot be opened: {why}. Remove it (rft makes the lock again), "
            f"or run without the stage cache (stage_cache_dir=null). A stage cache others can write to is not "
            f"guarded: keep it writable by you alone.") from None
    try:
        yield
    finally:
        lock.release()


def reuse(entry: Path, stage_dir: Path, owner: Owner, title: str, say, cfg=None) -> Path | None:
    """Copy a published stage into stage_dir; returns its final model's directory (None: no entry,
    or one that is damaged or not this stage's, which is moved aside to <entry>.damaged-<time>:
    the stage runs, and publishes anew). The copy's manifest names this run. `cfg`: the stage's
    config; where its key leaves the taskset's reward out (reads_taskset_reward), the publisher's
    config may hold another reward: its fingerprint is not compared, and the copy's config.yaml is
    this stage's (the publisher's made the same command's rerun stop as a changed configuration)."""
    same_config = cfg is None or reads_taskset_reward(cfg)
    ckpt = read_checkpoint(entry / "checkpoint")
    if ckpt is None:
        return None
    # its trainer_state.pt is not read here: checked by size (and in full if this stage ever resumes)
    why = manifest.verify(entry, skip=("checkpoint/trainer_state.pt",))
    if manifest.read(entry) == (None, None):
        why = f"{entry / manifest.MANIFEST}: missing (written by an rft from before entries carried one: it cannot be checked)"
    keys = ("stage", "model", "config") if same_config else ("stage", "model")
    if why is None and ckpt.identity is not None and owner.differences(ckpt.identity, keys):
        why = f"it is {describe(ckpt.identity)}, and this stage is {describe(owner.identity(ckpt.step))}"
    if why is not None:
        aside = manifest.put_aside(entry, "damaged")
        say(f"[{title}] the stage cache's copy of this stage is damaged ({shown(why)}); moved it to {shown(aside)} "
            f"and running the stage")
        return None
    final = stage_dir / "checkpoints" / f"step_{ckpt.step}"
    try:
        _copy_entry(entry, stage_dir, final, owner.identity(ckpt.step), None if same_config else cfg)
    except OSError as e:  # a full disk, most likely: the stage's own run then says so at its first save
        shutil.rmtree(final.with_name(final.name + ".tmp"), ignore_errors=True)
        say(f"[{title}] copying the stage cache's {shown(entry)} failed ({type(e).__name__}: {e}); running the stage")
        return None
    source = _source(entry)
    say(f"[{title}] reused: the same stage (same config, starting model and data) finished in "
        f"{shown(source)}; copied from the stage cache {shown(entry)}")  # escaped: names are the user's
    return final / "hf"


def _source(entry: Path) -> str:
    """Where a cache entry's stage ran, as the console shows it ('?' where its record does not read)."""
    try:
        return manifest.read_record(entry / "source", 4096).decode().strip()
    except (OSError, UnicodeDecodeError):
        return "?"


def _copy_entry(entry: Path, stage_dir: Path, final: Path, identity: dict, cfg=None) -> None:
    """The entry's logs into `stage_dir` (config.yaml first, `cfg`'s own where given, each whole or not at all), then its
    checkpoint as `final`, its manifest naming this run (written anew, which replaces the link: the
    entry's own file stays), moved into place last. A copy killed midway leaves no checkpoint, and a
    stage without one is copied again (_run_or_reuse); the checkpoint alone was a stage without its
    config.yaml, whose resume stopped."""
    stage_dir.mkdir(parents=True, exist_ok=True)
    if cfg is not None:
        write_config(cfg, stage_dir)
    for name in ("config.yaml", "metrics.jsonl", "batches.jsonl"):
        if (entry / name).exists() and not (name == "config.yaml" and cfg is not None):
            shutil.copy2(entry / name, stage_dir / f"{name}.tmp")
            os.replace(stage_dir / f"{name}.tmp", stage_dir / name)
    # before the checkpoint, as the logs: a stage with the copied checkpoint is told copied (the report
    # counts no time of its own for it); written after, a kill between left the other job's time this
    # one's. A copy killed before its checkpoint leaves it to a stage that trains itself (run_stage drops it)
    source = _source(entry)
    manifest.write_atomic(stage_dir / "reused_from", f"{entry}\n{source}\n")
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    _link_tree(entry / "checkpoint", tmp)
    sealed, _ = manifest.read(tmp)
    manifest.seal(tmp, identity, known=sealed["files"])
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)


def publish(entry: Path, stage_dir: Path, final: Path, say) -> None:
    """Put a finished stage's final checkpoint and logs into the cache (if not there yet), sealed:
    the checkpoint's digests are its manifest's (the files are links to it), the logs' are new.
    One that cannot be written is said and left out: the run has its outputs."""
    ckpt = read_checkpoint(final)
    if entry.exists() or ckpt is None or not ckpt.identity:
        return
    tmp = entry.with_name(entry.name + f".tmp{os.getpid()}")
    try:
        # under the key's lock (stage_lock) no other publish is under way: any <key>.tmp<pid> is what
        # a killed one left
        for left in entry.parent.glob(f"{entry.name}.tmp*"):
            shutil.rmtree(left, ignore_errors=True)
        tmp.mkdir(parents=True)
        _link_tree(final, tmp / "checkpoint")
        for name in ("metrics.jsonl", "batches.jsonl", "config.yaml"):
            if (stage_dir / name).exists():
                shutil.copy2(stage_dir / name, tmp / name)
        (tmp / "source").write_text(f"{stage_dir}\n")
        sealed, _ = manifest.read(final)
        manifest.seal(tmp, ckpt.identity, known={f"checkpoint/{rel}": v for rel, v in sealed["files"].items()})
        os.replace(tmp, entry)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        say(f"rft: warning: the stage cache {shown(entry.parent)} did not take this stage ({type(e).__name__}: {e}); "
            f"a later run with the same stage trains it again")
