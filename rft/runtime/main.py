"""The entry point behind run.py: stages, the batch plan, Ray, and clean errors.

`main(cfg)` splits the composed config into stages (each stage dict merged onto the global
config), checks every stage's batch plan before anything heavy starts, then runs the stages in
order, each starting from the previous stage's final model.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import sys
from pathlib import Path

from omegaconf import DictConfig

from rft.errors import ConfigError, RunError
from rft.runtime import preemption, rundir, stage_models

log = logging.getLogger(__name__)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(cfg: DictConfig) -> float | None:
    """Run the configured job; returns the last value of the metric `objective` (a sweeper's
    objective; eval/accuracy by default)."""
    try:
        # in a Slurm job, from the start (what starts after inherits it): Slurm's warning before a
        # preemption or the time limit saves the step in progress, then requeues the job
        # elsewhere SIGTERM (kill, timeout, a scheduler, the studio's stop) stops the run as Ctrl-C does, and
        # the paragraph below says so: it died without a word
        with preemption.watch(), preemption.sigterm_stops():
            return _main(cfg)
    except ConfigError as e:
        rundir.remove_if_unused(run_dir_of(cfg))  # Hydra made it; a run stopped by its config leaves nothing
        # raised inside a Ray actor it arrives wrapped; its cause holds the message
        print(f"\nrft: configuration error: {getattr(e, 'cause', e)}\n", file=sys.stderr)
        sys.exit(2)
    except RunError as e:
        # raised inside a Ray actor it arrives wrapped too
        text = str(getattr(e, "cause", e))
        sweep = _sweep_dir()
        if sweep and "same command" in text:
            text += (f" In this sweep, the same command is the sweep with hydra.sweep.dir={sweep} added; without "
                     f"it, the sweep starts over in a new directory.")
        print(f"\nrft: the run stopped: {text}\n", file=sys.stderr)
        sys.exit(1)
    except preemption.Refused as e:  # Slurm's warning, and submitit would not requeue the job
        print(f"\nrft: the run stopped: {e.paragraph(_resume_point(cfg), _sweep_dir())}\n", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as e:
        # Ctrl-C or SIGTERM: what was saved is safe (checkpoints are written whole, then renamed into place)
        if preemption.terminated(e) is not None:
            _say_terminated(cfg, e)
            sys.exit(128 + 15)  # a shell's status of a process SIGTERM ended
        print(f"\nrft: interrupted. {_how_to_resume(cfg)}{_env_note()}\n", file=sys.stderr)
        sys.exit(130)
    except OSError as e:
        # a disk that fills (or turns read-only) while a log, buffer or record is written; a
        # checkpoint's save says so itself (rft.runtime.checkpoint.write)
        cause = getattr(e, "cause", None) or e  # raised in a Ray actor, it arrives wrapped
        if getattr(cause, "errno", None) not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            raise
        print(f"\nrft: the run stopped: {_disk_failed(cfg, cause)}\n", file=sys.stderr)
        sys.exit(1)
    except Exception as e:
        from rft.runtime.faults import ray_out_of_memory  # here: the dry run imports no checkpoint code

        if not ray_out_of_memory(e):
            raise
        print(f"\nrft: the run stopped: {_out_of_memory(cfg, e)}\n", file=sys.stderr)
        sys.exit(1)


def _say_terminated(cfg: DictConfig, e: KeyboardInterrupt) -> None:
    """The paragraph of a run SIGTERM stopped, once. Said before Ray's shutdown too (`_run_locked`):
    after a SIGTERM to the whole process group (the studio's stop) Ray's GCS is dead, and the
    shutdown waits seconds on it, at times past the studio's SIGKILL 15 s after its SIGTERM."""
    if getattr(e, "said", False):
        return
    e.said = True
    text = f"stopped by SIGTERM {preemption.terminated(e)}. {_how_to_resume(cfg)} The command: {_resume_command()}"
    log.info(text)  # run.log ended mid-stage without a word
    print(f"\nrft: {text}\n", file=sys.stderr, flush=True)


def _how_to_resume(cfg: DictConfig) -> str:
    where = _resume_point(cfg)
    sweep = _sweep_dir()
    how = (f"with hydra.sweep.dir={sweep} to resume this sweep ({where}); without it, the sweep starts over in "
           f"a new directory." if sweep else f"to resume ({where}).")
    return f"Run the same command again {how}"


def _resume_command() -> str:
    """The command line of this process, with the sweep's directory for a sweep (SIGTERM often comes
    from a program, not from the terminal the command was typed in), after the RFT_* variables it
    was started with: typed in a new shell without `RFT_CHECKPOINT_ROOT_DIR=/x`, it started a fresh
    run in ./checkpoints instead of resuming."""
    import shlex

    argv = ["python", *sys.argv]
    sweep = _sweep_dir()
    if sweep and not any(a.startswith("hydra.sweep.dir=") for a in argv):
        argv.append(f"hydra.sweep.dir={sweep}")
    shown, secret = _rft_environment()
    line = " ".join([*(f"{k}={shlex.quote(v)}" for k, v in shown.items()), shlex.join(argv)])
    return line + (f" ({_secrets_named(secret)})" if secret else "")


# rft sets these itself (an actor's devices; the Ray-on-Slurm script's requeue signal): not the user's
_OWN_VARIABLES = frozenset({"RFT_DEVICES", "RFT_REQUEUE_SIGNAL"})
_SECRET_PARTS = ("TOKEN", "KEY", "SECRET", "PASSWORD")


def _rft_environment() -> tuple[dict[str, str], list[str]]:
    """The RFT_* variables set for this run (conf/ reads RFT_CHECKPOINT_ROOT_DIR, RFT_CACHE_DIR, ...
    through oc.env; a study's own config may read others), by name: those a resume needs again, and
    the names of secrets among them (a token is never printed, and a log keeps what is)."""
    names = sorted(k for k in os.environ if k.startswith("RFT_") and k not in _OWN_VARIABLES)
    secret = [k for k in names if any(p in k for p in _SECRET_PARTS)]
    return {k: os.environ[k] for k in names if k not in secret}, secret


def _secrets_named(names: list[str], too: str = " too") -> str:
    return f"set {', '.join(names)} again{too}: {'a secret' if len(names) == 1 else 'secrets'}, not shown here"


def _env_note() -> str:
    """For Ctrl-C's paragraph, which names no command (it was typed just now): the RFT_* variables
    a new shell needs set again, where any were set."""
    import shlex

    shown, secret = _rft_environment()
    if not shown:
        return f" In a new shell, {_secrets_named(secret, '')}." if secret else ""
    text = " ".join(f"{k}={shlex.quote(v)}" for k, v in shown.items())
    return f" In a new shell, set the same environment: {text}" + (f" ({_secrets_named(secret)})" if secret else "") + "."


def _out_of_memory(cfg: DictConfig, e: Exception) -> str:
    """Ray's memory monitor killed one of the run's workers (the node past its threshold, 0.95 of its
    memory, whoever used it): Hydra's 'Error executing job' and Ray's traceback said so in Ray's words."""
    import re

    used = re.search(r"was ([\d.]+ ?[KMGT]i?B) / ([\d.]+ ?[KMGT]i?B)", str(e))
    how_full = f" ({used[1]} of {used[2]} in use)" if used else ""
    return (f"Ray's memory monitor killed one of the run's workers: the machine's memory was nearly full{how_full}. "
            f"{_how_to_resume(cfg)} If other programs held the memory, run again when they are done; if this run did, "
            f"`dry_run=true` prints each role's memory: lower the batch or the number of actors (cluster.num_cpus, "
            f"explorer.rollout_model.engine_num). Ray's own settings: RAY_memory_usage_threshold (0.95), "
            f"RAY_memory_monitor_refresh_ms=0 turns the monitor off.")


def _resume_point(cfg: DictConfig) -> str:
    newest = _newest_checkpoint(run_dir_of(cfg))
    return f"the newest checkpoint: {newest}" if newest else "no checkpoint was saved yet: the run starts over"


def _disk_failed(cfg: DictConfig, e: OSError) -> str:
    run_dir = run_dir_of(cfg)
    try:
        free = f"{shutil.disk_usage(e.filename or run_dir).free / 2**30:.1f} GiB free"
    except (OSError, TypeError):
        free = "an unknown amount of space free"
    what = f"OSError: [Errno {e.errno}] {e.strerror}"
    return (f"writing {'in ' + str(run_dir) if e.filename is None else e.filename} failed ({what}); that disk has "
            f"{free}. {'Make it writable' if e.errno == errno.EROFS else 'Make room'} (or point checkpoint_root_dir "
            f"at another disk), then run the same command again to "
            f"resume ({_resume_point(cfg)}).")


def _sweep_dir() -> str | None:
    """The directory of the sweep (-m) this job is part of; None for a single run. Hydra names a
    sweep's directory by the time it started, so the same command makes a new one."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    return str(HydraConfig.get().sweep.dir)


def _newest_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint of any stage of the run in `run_dir` (None: none yet)."""
    from rft.runtime.checkpoint import latest_checkpoint

    stages = [p for p in run_dir.glob("*") if p.is_dir() and not p.name.startswith("previous_")]
    found = [c for d in [run_dir, *stages] if (c := latest_checkpoint(d)) is not None]
    return max(found, key=lambda c: c.path.stat().st_mtime).path if found else None


def run_dir_of(cfg: DictConfig) -> Path:
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        try:
            return Path(HydraConfig.get().runtime.output_dir)
        except Exception:  # composed without a run (tests, notebooks): no output dir chosen
            pass
    return Path(os.path.expanduser(cfg.checkpoint_root_dir)) / cfg.project / cfg.name


def dataset_size(cfg: DictConfig, sources: dict | None = None) -> int:
    """Rows the stage iterates over: the taskset (mode=both|explore), the stored experiences or
    the training dataset (mode=train). Every dataset the stage reads is loaded and checked here,
    before anything starts, so a bad path, row or column fails first (in the driver, or for a Ray
    run in a child process of it: `dataset_sizes_in_child`)."""
    from rft.data.pipeline import in_input, taskset_of
    from rft.data.tasks import check_columns, ensure_task_data, load_rows, load_tasks
    from rft.plan.batch import label, stored_experiences

    sources = sources or {}
    inp = cfg.buffer.explorer_input
    ensure_task_data(inp)
    eb = cfg.buffer.trainer_input.experience_buffer
    ebk = "buffer.trainer_input.experience_buffer"
    if cfg.algorithm.sft_loss_weight > 0:
        from rft.plan.batch import sft_buffer_config

        aux, where = sft_buffer_config(cfg)
        check_columns(load_rows(aux.path, aux.split, key=f"{where}.path", fmt=aux.format), aux.format, where, aux.path,
                      every_row=True, split=aux.split)
    if cfg.mode == "train" and eb.storage_type in ("sql", "file") and eb.path and stored_experiences(eb):
        from rft.data.buffer import count_experiences

        n = count_experiences(eb.path, key=f"{ebk}.path")
        if n == 0 and cfg.buffer.total_steps is None:
            raise ConfigError(
                f"{ebk}.path={eb.path!r} holds no experiences yet. Run mode=explore first, or set "
                f"buffer.total_steps to train while one writes them."
            )
        return n
    if cfg.mode in ("both", "explore"):
        # with data_processor.task_pipeline its output (a dry run before it ran: its input)
        try:
            size = len(load_tasks(taskset_of(cfg, before_run=True), "buffer.explorer_input.taskset"))
        except ConfigError as e:
            raise in_input(cfg, e) from None
        for i, ts in enumerate(inp.eval_tasksets):
            load_tasks(ts, f"buffer.explorer_input.eval_tasksets[{i}]")
        return size
    if eb.storage_type not in ("sql", "file") and eb.path:  # the path is set, the queue would not read it
        raise ConfigError(
            f"mode=train reads a dataset or a stored buffer, but {ebk}.storage_type={eb.storage_type} (in memory, empty "
            f"when the stage starts), so its path={eb.path!r} is not read. Set {ebk}.storage_type=file for a dataset "
            f"(algorithm=sft and dpo set it), or sql for the buffer.db a mode=explore run wrote.")
    if eb.storage_type not in ("sql", "file") or not eb.path:
        raise ConfigError(
            "mode=train reads its data from buffer.trainer_input.experience_buffer.path, which is "
            "not set: give the buffer a mode=explore run wrote (buffer=sql "
            "buffer.trainer_input.experience_buffer.path=<its buffer.db>), or a dataset of "
            "prompt/response rows (storage_type=file path=<dataset>)."
        )
    for i, ts in enumerate(inp.eval_tasksets):
        load_tasks(ts, f"buffer.explorer_input.eval_tasksets[{i}]")
    rows = load_rows(eb.path, eb.split, key=label(sources, f"{ebk}.path"), fmt=eb.format)
    check_columns(rows, eb.format, ebk, eb.path, pairs=True, sources=sources, every_row=True, split=eb.split)
    return len(rows)


def ray_namespace(cfg: DictConfig, run_dir: Path) -> str:
    """Actor names are unique within a Ray namespace: runs sharing one Ray cluster (a sweep's jobs
    often have the same name, differing by seed) each get their own, from their output dir."""
    import hashlib

    return f"{cfg.project}/{cfg.name}/{hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:8]}"


def _start_ray(cfg: DictConfig, run_dir: Path) -> bool:
    local = cfg.cluster.ray_address is None
    if local and "ray" not in sys.modules:
        # an instance of our own takes a token on its ports (Ray's default for a new local
        # instance, the token in ~/.ray/auth_token), chosen here explicitly: Ray then does not warn
        # on every run how to turn it off. Ray reads it when imported, so only before that; a value
        # the user set is kept
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        ray_token()
    import ray

    if ray.is_initialized():
        return False
    if not local:
        _check_ray_answers(cfg.cluster.ray_address)
    if local and cfg.monitor.ray_dashboard:
        _check_dashboard_packages()
    if local and not cfg.monitor.ray_dashboard:
        # Ray's own config, read from the environment by every process the instance starts: no
        # metrics export from each worker to the node's metrics agent (CPU time taken from the
        # explorer and trainer on a small machine). A value the user set is kept.
        os.environ.setdefault("RAY_enable_metrics_collection", "0")
    if local:
        # before ray.init: what a kill during it leaves is stopped too, and it bounds ray.init's wait
        _start_reaper()
        _tell_reaper({"init": cfg.cluster.init_timeout_s, "progress": INIT_PROGRESS_S,
                      "resume": f"{_how_to_resume(cfg)} The command: {_resume_command()}"})
    try:
        _init_ray(cfg, local, run_dir)
    except ConnectionError as e:  # `auto` on a node where no `ray start` ran: Ray's traceback
        if local:
            raise
        raise ConfigError(f"cluster.ray_address={cfg.cluster.ray_address}: no Ray cluster runs on this node "
                          f"(Ray: {str(e).splitlines()[0].rstrip('.')}). {_NO_RAY_FIX}") from None
    except Exception as e:
        if not local or "timed out during startup" not in str(e):
            raise
        # Ray's own bound (30 s for the raylet to register), raised as a bare Exception: its traceback
        raise RunError(f"Ray's local instance did not start: its raylet did not register within Ray's own 30 s "
                       f"(Ray: {str(e).splitlines()[0]}). The machine may be short of memory or heavily loaded, or "
                       f"Ray's session files (/tmp/ray) on a full disk. {_how_to_resume(cfg)} The command: "
                       f"{_resume_command()}") from None
    finally:
        if local:
            _tell_reaper({"init": None})
    return True


def _check_dashboard_packages() -> None:
    """Ray's dashboard needs ray[default]'s packages, which the project's install (minimal Ray) lacks:
    ray.init raised 'Cannot include dashboard with missing packages' after its own log lines."""
    from ray._private.utils import get_dashboard_dependency_error

    missing = get_dashboard_dependency_error()
    if missing:
        raise ConfigError(f"monitor.ray_dashboard=true: Ray's dashboard needs the packages of ray[default], and this "
                          f"environment has minimal Ray ({missing}). Install them (pip install 'ray[default]'), or "
                          f"set monitor.ray_dashboard=false (the run's metrics are in its monitor: console, "
                          f"tensorboard, wandb or mlflow).")


_NO_RAY_FIX = ("Start the Ray cluster before the run (`ray start --head` on the head node, `ray start --address=<head>:6379` on "
               "the others; launchers/ray_slurm.sbatch does both in a Slurm job), give the head's host:port "
               "(`ray status` there prints it), or set cluster.ray_address=null for a Ray instance of the run's own.")


def _check_ray_answers(address: str) -> None:
    """Something listens at a host:port the run joins: where nothing does, ray.init printed GCS
    retry lines for minutes before it failed."""
    import socket

    if address == "auto":  # Ray finds the node's own cluster, or says there is none (above)
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
    except OSError as e:
        reason = e.strerror or type(e).__name__  # a timeout has no strerror
        raise ConfigError(f"cluster.ray_address={address}: nothing answers at {host}:{port} ({reason}). "
                          f"{_NO_RAY_FIX}") from None


def _init_ray(cfg: DictConfig, local: bool, run_dir: Path) -> None:
    import ray

    try:
        ray.init(
            # "local": always a new instance of our own. With None, Ray joins the cluster named in
            # /tmp/ray/ray_current_cluster (the last `ray start` here), and waits forever if that one
            # died without `ray stop`
            address="local" if local else cfg.cluster.ray_address,
            num_cpus=cfg.cluster.num_cpus if local else None,
            include_dashboard=cfg.monitor.ray_dashboard if local else None,
            log_to_driver=False,
            namespace=ray_namespace(cfg, run_dir),
            logging_level=logging.WARNING,
        )
        preemption.retake_sigterm()  # from Ray's core worker, which took it over
    except SystemExit as e:  # SIGTERM before the retake: Ray's handler exits with 15, nothing said
        stop = preemption.ray_exit_as_terminated(e)
        if stop is None:
            raise
        raise stop from None


def ray_token() -> None:
    """The token of this run's new local instance, settled before ray.init. Ray writes a new one to
    ~/.ray/auth_token where none is: two runs starting at once on a fresh machine (a sweep's jobs)
    each wrote theirs, and the one whose Ray processes read the other's token failed ("Failed to
    start GCS ... InvalidAuthToken"). Here the file is made whole under a name of its own and
    linked in place, which fails where another process was first: every run then reads the one
    token. Where HOME cannot be written (a service account's, a read-only one; Ray's init failed
    there with NotADirectoryError), the instance takes a token through the environment, which every
    process Ray starts inherits. A token the user gave is kept."""
    import secrets

    if os.environ.get("RAY_AUTH_MODE") != "token" or os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return
    try:
        home = Path.home() / ".ray"
        if (home / "auth_token").is_file():
            return
        rundir.check_writable(home, "HOME")
        _link_new_token(home / "auth_token", secrets.token_hex(32))
    except (ConfigError, RuntimeError):  # RuntimeError: no HOME and no passwd entry to find one
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)


def _link_new_token(path: Path, token: str) -> None:
    """`path` holds `token` unless another process made it first (then that one's is kept): never
    an empty or half-written file for a reader."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{token[:8]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with open(fd, "w") as f:
            f.write(token)
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)


_reaper = None
INIT_PROGRESS_S = 15.0  # ray.init's wait is said after this (rft.runtime.reaper); usually it takes 3-5 s


def _start_reaper() -> None:
    """Once per process: a watcher that stops what a SIGKILL of this process would leave of Ray, and
    this process where ray.init outlasts cluster.init_timeout_s (`_tell_reaper`). Its stderr is this
    process's: it prints there while ray.init waits."""
    global _reaper
    if _reaper is None or _reaper.poll() is not None:
        import subprocess

        _reaper = subprocess.Popen([sys.executable, "-m", "rft.runtime.reaper", str(os.getpid())], start_new_session=True,
                                   stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)


def _tell_reaper(said: dict) -> None:
    """A line to the reaper: ray.init begins (its bound, how to resume) or is done (rft.runtime.reaper)."""
    import json

    if _reaper is None or _reaper.poll() is not None:
        return
    try:
        _reaper.stdin.write(json.dumps(said) + "\n")
        _reaper.stdin.flush()
    except OSError:  # it ended since: then there is nothing to bound
        pass


def plan_stages(cfg: DictConfig, isolated: bool = False) -> tuple[list, list, list[Path]]:
    """Every stage's config, batch plan and output directory, each checked against its data; the
    whole of what a dry run does. Imports nothing that trains (no torch, no Ray). `isolated`: the
    datasets are read in a child process (`dataset_sizes_in_child`)."""
    stages, sources = split_stages(cfg)
    sizes = (dataset_sizes_in_child if isolated else dataset_sizes)(stages, sources)
    plans = per_stage(checked_plan, stages, sizes, sources)
    run_dir = run_dir_of(cfg)
    return stages, plans, [run_dir / s.stage_name if s.stage_name else run_dir for s in stages]


def checked_plan(stage: DictConfig, dataset_size: int):
    """The stage's batch plan, then its data_processor checked: the pipelines' operators and args
    and the online curriculum (the plan reads no data code; rft/data/pipeline.py holds these)."""
    from rft.data.pipeline import check_operators
    from rft.plan.batch import make_plan

    plan = make_plan(stage, dataset_size)
    check_operators(stage)
    return plan


def split_stages(cfg: DictConfig) -> tuple[list, list]:
    """Every stage's config and the keys its dict sets by interpolation (rft.plan.batch.stage_sources)."""
    from rft.config import MODES
    from rft.plan.batch import check_algorithm_label, stage_configs, stage_sources

    # cfg.mode is an Enum field (checked when composed); a stage's dict is merged later
    stage_modes = [(f"stages[{i}].mode", s.get("mode")) for i, s in enumerate(cfg.stages or []) if isinstance(s, DictConfig)]
    for key, mode in stage_modes:
        if mode is not None and mode not in MODES:
            raise ConfigError(f"{key}={mode!r} is not a mode; choose one of {', '.join(MODES)}.")
    stages, sources = stage_configs(cfg), stage_sources(cfg)
    per_stage(check_algorithm_label, stages, [None] * len(stages), sources)  # a Trinity-RFT habit
    return stages, sources


def per_stage(fn, stages: list, args: list, sources: list | None = None) -> list:
    """fn(stage, arg) for each stage and its arg; a ConfigError names the stage, and with the
    stages' `sources` (split_stages) the stage's key of a `key=value` it names that the stage's own
    entry sets."""
    out = []
    for i, (s, arg) in enumerate(zip(stages, args)):
        try:
            out.append(fn(s, arg))
        except ConfigError as e:
            # one stage: nothing is merged into another, so the merged-args hint does not apply
            hint = _merged_args_hint(str(e), i, sources[i]) if sources and len(stages) > 1 else ""
            message = str(e) + (_own_key_hint(str(e), sources[i]) if hint is None else hint)
            raise ConfigError(f"stage {s.stage_name}: {message}" if s.stage_name else message) from e
    return out


def _merged_args_hint(message: str, index: int, sources: dict) -> str | None:
    """A function's `*_args` holding what the stage's function does not take: set globally and
    merged into every stage (a stage's `advantage_args: {}` adds nothing and removes nothing), so
    the fix is to set it in the entry of the stage that uses it, not to change this stage's function."""
    import re

    m = re.match(r"(algorithm\.\w+_args) has (\[[^]]*\])", message)
    if not m:
        return None  # not about a function's arguments
    if " Did you mean algorithm." in message:
        return ""  # an algorithm.* key given as an argument (rft.config.near_args): the fix is that key
    key, unknown = m[1], re.findall(r"'(\w+)'", m[2])
    if any(sources.get(f"{key}.{k}", "").startswith("stages.") for k in unknown):
        return ""  # the stage's own entry sets it: a misspelt argument, which the message names
    return (f" A stage's entry is merged onto the global config, a dict key by key: `{key.split('.')[-1]}: {{}}` "
            f"in it clears nothing. Set {key} only in the entry of the stage whose function takes it "
            f"(stages.<i>.{key}), not globally; this is stages.{index}.")


def _own_key_hint(message: str, sources: dict) -> str:
    """Where the first `key=value` of a message is set by the stage's entry (stages.<i>.<key>): a
    setting of the same key outside the stage, as the message suggests, is overridden by it."""
    import re

    for key in re.findall(r"(?<![\w.])([a-z_]+(?:\.\w+)+)=", message):
        own = sources.get(key, "")
        if own.startswith("stages.") and own not in message:
            return (f" The stage's own entry sets {key}: change it there, {own} (the same key outside the stage "
                    f"does not change it).")
    return ""


def dataset_sizes(stages: list, sources: list) -> list[int]:
    """`dataset_size` of each stage (a ConfigError names the stage)."""
    return per_stage(dataset_size, stages, sources)


def dataset_sizes_in_child(stages: list, sources: list) -> list[int]:
    """`dataset_sizes` in a child process, for a driver that stays small: reading the datasets
    imports `datasets` (with pandas and pyarrow: 108 MB of the Ray driver's 173 MB), which the
    driver of a Ray run would otherwise hold to its end, while the actors read the data again.
    The child has this process's working directory and environment, so relative paths and the
    caches are the same; its ConfigError is raised here, unchanged."""
    return job_sizes_in_child([(stages, sources)])[0]


def job_sizes_in_child(jobs: list[tuple[list, list]]) -> list[list[int]]:
    """`dataset_sizes` of each job's (stages, sources), all in one child process (a sweep's jobs
    are planned before the first starts); a ConfigError is raised here, with `.job` the index of
    the job at fault."""
    import json
    import subprocess
    import tempfile

    from omegaconf import OmegaConf

    with tempfile.TemporaryDirectory(prefix="rft_sizes_") as tmp:
        ask, answer = Path(tmp) / "stages.json", Path(tmp) / "sizes.json"
        ask.write_text(json.dumps({"jobs": [
            {"stages": [OmegaConf.to_container(s, resolve=True, enum_to_str=True) for s in stages], "sources": sources}
            for stages, sources in jobs]}))
        # the child imports this package from where this process did, ahead of anything of the
        # same name in the working directory (a study run from another directory, or another copy)
        root = str(Path(__file__).resolve().parents[2])
        code = f"import sys; sys.path.insert(0, {root!r}); from rft.runtime.main import _sizes_of; _sizes_of(*sys.argv[1:])"
        rc = subprocess.run([sys.executable, "-c", code, str(ask), str(answer)], stdin=subprocess.DEVNULL).returncode
        got = _answer(answer)
    if not isinstance(got, dict) or not ("error" in got or isinstance(got.get("sizes"), list)):
        raise RunError(f"checking the stages' datasets in a child process failed (exit {rc}); "
                       + ("its traceback is above." if rc else f"its answer did not read back ({got})."))
    if "error" in got:
        error = ConfigError(got["error"])
        error.job = got["job"]
        raise error
    return got["sizes"]


def _answer(path: Path) -> dict | str:
    """The child's answer (job_sizes_in_child), or why it does not read: a child killed while it
    wrote leaves it cut short (json's error was a traceback), and the bound keeps a damaged one
    from being read whole. Its question (stages.json) is this process's own, unbounded: it grows
    with the sweep, and no one else writes the private folder it is in."""
    import json

    from rft.manifest import read_record

    try:
        return json.loads(read_record(path))
    except FileNotFoundError:
        return "none written"
    except (OSError, ValueError, RecursionError) as e:
        return f"{type(e).__name__}: {e}"


def _sizes_of(ask: str, answer: str) -> None:
    """The child's side of `job_sizes_in_child`."""
    import json

    from omegaconf import OmegaConf

    sizes, known = [], {}
    got: dict = {"sizes": sizes}
    # unbounded: the parent's own question, written a moment before (_answer says why)
    for i, job in enumerate(json.loads(Path(ask).read_text())["jobs"]):
        # a sweep's jobs mostly differ in what dataset_size does not read (seeds, algorithms): a
        # stage is read once per distinct (mode, buffer, auxiliary SFT data, sources)
        keys = [json.dumps([s["mode"], s["buffer"], s["algorithm"]["sft_loss_weight"], s["algorithm"]["sft_buffer"],
                            src, s.get("data_processor")], sort_keys=True) for s, src in zip(job["stages"], job["sources"])]
        try:
            todo = [(s, src, k) for s, src, k in zip(job["stages"], job["sources"], keys) if k not in known]
            done = dataset_sizes([OmegaConf.create(s) for s, _, _ in todo], [src for _, src, _ in todo])
            known.update({k: n for (_, _, k), n in zip(todo, done)})
            sizes.append([known[k] for k in keys])
        except ConfigError as e:
            got = {"error": str(e), "job": i}
            break
    Path(answer).write_text(json.dumps(got))


def plan_text(stages: list, plans: list, stage_dirs: list[Path]) -> str:
    """What a dry run prints (and the studio shows): each stage's batch plan and description."""
    from rft.data.pipeline import describe_rows
    from rft.plan.batch import describe, format_plan

    return "\n".join(
        format_plan(p, title=f"batch plan: stage {s.stage_name or s.name} ({s.algorithm.algorithm_type})")
        + "\n" + describe(s, d, p, describe_rows(s)) + "\n" for s, p, d in zip(stages, plans, stage_dirs))


def _main(cfg: DictConfig) -> float | None:
    if cfg.mode == "bench":
        from rft.runtime.bench import bench

        return bench(cfg, run_dir_of(cfg))
    # the tiny model and generated tasksets are built there (a dry run plans from them too); its
    # default is under HOME, which a laptop's sandboxed or service account may not be able to write
    rundir.check_writable(Path(os.path.expanduser(str(cfg.cache_dir))), "cache_dir")
    rundir.check_writable(rundir.datasets_cache(), "HF_DATASETS_CACHE")  # `datasets` writes every taskset it reads there
    if not cfg.dry_run:  # a GPU run on a machine without them stops before it reads anything
        from rft.plan.memory import check_gpus_here, check_model_here

        check_gpus_here(cfg)
        check_model_here(cfg)
        # data_processor.task_pipeline: its output is the taskset the plan counts (rft/runtime/pipelines.py)
        from rft.runtime.pipelines import prepare_tasks

        prepare_tasks(split_stages(cfg)[0])
    # a Ray driver waits on its actors to the end of the run: it reads no dataset itself
    stages, plans, stage_dirs = plan_stages(cfg, isolated=cfg.cluster.backend == "ray" and not cfg.dry_run)
    stage_models.check(stages, plans)  # reward models of earlier stages (stage:<title>)
    run_dir = run_dir_of(cfg)
    if cfg.dry_run:
        from rft.models import check_tokenizer_here

        per_stage(lambda s, _: check_tokenizer_here(s.model), stages, [None] * len(stages))  # what the run's actors check
        print(plan_text(stages, plans, stage_dirs))
        _remove_if_empty(run_dir)  # Hydra made it; a dry run leaves nothing behind
        return None
    return _run(cfg, stages, plans, stage_dirs, run_dir)


def _run(cfg: DictConfig, stages: list, plans: list, stage_dirs: list[Path], run_dir: Path) -> float | None:
    """Check the outputs' place and take it (rundir.run_lock), start Ray, run the stages in order
    (each from the one before)."""
    from rft.plan.memory import check_memory
    from rft.plan.placement import check_allocation

    check_allocation(cfg)
    check_memory(stages, plans)
    for s in stages[:-1]:
        if s.trainer.save_hf_checkpoint == "never" and s.mode != "explore":
            raise ConfigError(f"stage {s.stage_name or s.algorithm.algorithm_type!r}: trainer.save_hf_checkpoint=never "
                              f"leaves no model for the next stage to start from. Use last (the merged model of "
                              f"its final step only).")
    rundir.check_writable(run_dir)
    with rundir.run_lock(run_dir) as before:
        return _run_locked(cfg, stages, plans, stage_dirs, run_dir, rundir.requeued(before))


def _run_locked(cfg: DictConfig, stages: list, plans: list, stage_dirs: list[Path], run_dir: Path,
                requeued: str | None = None) -> float | None:
    from rft.models import ensure_model
    from rft.reporting.monitor import read_metrics

    if not cfg.continue_from_checkpoint and requeued:
        # the outputs are this job's own earlier attempt: moved aside, it would start over at every
        # requeue (and, requeued at each time limit, never end)
        print(f"continue_from_checkpoint=false, but this is a requeued job ({requeued}) and the outputs "
              f"are its own: it resumes them")
        for c in (cfg, *stages):  # each stage reads it (rft.runtime.runner)
            c.continue_from_checkpoint = True
    if not cfg.continue_from_checkpoint:
        moved = rundir.move_aside(run_dir)
        if moved:
            print(f"continue_from_checkpoint=false: moved the earlier outputs to {moved}")
    changes = rundir.check_unchanged(cfg, stages, stage_dirs, run_dir)
    cache = cfg.stage_cache_dir and Path(os.path.expanduser(cfg.stage_cache_dir))
    if cache:
        rundir.check_writable(cache, "stage_cache_dir")
    ensure_model(stages[0].model)
    started_ray = stages[0].cluster.backend == "ray" and _start_ray(stages[0], run_dir)
    try:
        # once the model and Ray are there: a start they refuse (a ConfigError) leaves no record of
        # a run that never ran (main removes the lock of a directory left empty)
        rundir.write_record(cfg, run_dir)
        init_path, before = None, None
        reward_models: dict[str, str] = {}  # a reward-model stage's title -> its final model
        for i, (s, plan, stage_dir, key) in enumerate(zip(stages, plans, stage_dirs, cache_keys(stages, plans))):
            title = s.stage_name or s.algorithm.algorithm_type
            owner = rundir.owner(s, title, before, rundir.saved_config(stage_dir))  # whose checkpoints it writes and resumes
            # a stage another one starts from (a warm-up), not the run's own last stage: a re-run
            # of a whole config (a benchmark, a check of reproducibility) trains, not copies
            shared = i < len(stages) - 1 and rundir.cacheable(s)
            entry = cache / key if cache and shared else None
            final = _run_or_reuse(s, plan, stage_dir, init_path, owner, entry, changes.get(title), reward_models)
            if plan.needs.reward_head:  # a reward model (algorithm=rm): the next stage starts from
                reward_models[title] = str(final)  # the policy before it and may read it as stage:<title>
                continue
            before = title  # the next stage starts where this one ends
            init_path = str(final) if final is not None else init_path
    finally:
        if started_ray:
            import ray

            if preemption.terminated(sys.exc_info()[1]) is not None:
                _say_terminated(cfg, sys.exc_info()[1])  # before the shutdown, which may outlast the stop's grace
            ray.shutdown()
    print(f"outputs: {run_dir}")
    values = [m[cfg.objective] for m in read_metrics(stage_dir / "metrics.jsonl") if cfg.objective in m]
    if not values:
        # mode=explore evaluates nothing (the mode=train job reading its buffer does): the default
        # objective, eval/accuracy, is never there
        why = " (mode=explore runs no evals: the mode=train job that reads its buffer does)" if stages[-1].mode == "explore" else ""
        print(f"rft: warning: objective={cfg.objective} was never logged in {stage_dir / 'metrics.jsonl'}{why}, "
              f"so the run returns None; set objective to one of its metric names (e.g. reward/mean).",
              file=sys.stderr)
        return None
    return values[-1]


def cache_keys(stages: list, plans: list) -> list[str]:
    """Each stage's key in the stage cache (rundir.cache_key): a stage starts from the key of the
    policy stage before it (the first from the model's files), and one scored by an earlier
    reward-model stage (stage:<title>) holds that stage's key: trained on another reward model, it
    is another stage, though its config says the same."""
    start, keys, reward_models = rundir.start_identity(stages[0].model), [], {}
    for s, plan in zip(stages, plans):
        keys.append(rundir.cache_key(s, start, {t: reward_models[t] for _, t in stage_models.references(s)}))
        if plan.needs.reward_head:  # a reward model is no policy: the next stage starts before it
            reward_models[s.stage_name or s.algorithm.algorithm_type] = keys[-1]
        else:
            start = f"stage:{keys[-1]}"
    return keys


def _run_or_reuse(cfg, plan, stage_dir: Path, init_path, owner, entry: Path | None, changes: list | None,
                  reward_models: dict | None = None):
    """Run stage `owner.stage`, or copy it from the stage cache (`entry`, None: no cache) if it
    finished there and this run has no checkpoint of it (without one it would start from its
    beginning); returns its final model's directory (None: none)."""
    from rft.runtime.checkpoint import list_checkpoints
    from rft.runtime.runner import run_stage

    title = owner.stage
    with rundir.stage_lock(entry, title, print):
        if entry is not None and cfg.continue_from_checkpoint and not list_checkpoints(stage_dir):
            reused = rundir.reuse(entry, stage_dir, owner, title, print, cfg)
            if reused is not None:
                return reused
        if changes:
            rundir.note_changes(stage_dir, changes)
        saved = rundir.saved_config(stage_dir)
        # a longer run is recorded too: a later stage's check reads how far this one went
        if changes or saved is None or not rundir.has_outputs(stage_dir) or rundir.grown(saved, cfg):
            rundir.write_config(cfg, stage_dir)
        # (the config as written above keeps stage:<title>: a re-run compares it unresolved)
        final = run_stage(stage_models.resolve(cfg, reward_models or {}), plan, stage_dir, init_path, title, owner)
        if entry is not None and final is not None:
            rundir.publish(entry, stage_dir, final.parent, print)
        return final


def _remove_if_empty(path: Path) -> None:
    try:
        path.rmdir()  # only succeeds when empty
    except OSError:
        pass
