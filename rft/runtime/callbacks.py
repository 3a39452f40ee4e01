"""Hydra callbacks (conf/config.yaml, hydra.callbacks): checks of what Hydra does itself before
rft runs, which would otherwise end in its traceback or after work was done.

- a run's directory (hydra.run.dir, under checkpoint_root_dir) or a sweep's (hydra.sweep.dir)
  that cannot be written: Hydra makes it before rft runs, so a checkpoint_root_dir under a file
  or in a read-only place raised NotADirectoryError or PermissionError from Hydra's mkdir (and a
  name of '..' parts made a directory outside the project's);
- a sweep whose job cannot plan (`-m buffer.batch_size=4,0`): every job is planned before the
  first starts (plan_jobs), not when its turn comes after the others trained; on Slurm, each job
  also asks for the GPUs it plans for, and fits them (`_check_launch`); and two jobs would not
  write to one directory (a hydra.sweep.subdir that does not differ between them: `_shared_dir`).

Each ends the command with one paragraph and status 2, as rft's other configuration errors.

And one record: a submitit sweep's job writes which launcher log is its own into its folder as it
starts (on_job_start; rft.reporting.sweep.record_own_log), for the report to find it if the job dies.
A secret typed on the command line is warned of (one line: `ps` shows it), and masked in the
sweep's multirun.yaml, which Hydra writes whole (rft.reporting.redact).
"""

from __future__ import annotations

import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from rft.errors import ConfigError


class Checks(Callback):
    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        _warn_of_typed_secrets(config)
        _exit_on(lambda: _check_dir(config, "hydra.run.dir"))
        warning = unswept(config)
        if warning:
            print(f"rft: warning: {warning}", file=sys.stderr, flush=True)

    def on_multirun_start(self, config: DictConfig, config_name: str | None = None, **kwargs) -> None:
        # resolved once: its name holds the time (${now:...}), which on_multirun_end must not read anew
        self.sweep_dir = Path(str(OmegaConf.select(config, "hydra.sweep.dir")))
        _warn_of_typed_secrets(config)
        made = not self.sweep_dir.exists()
        _exit_on(lambda: _check_dir(config, "hydra.sweep.dir"))
        # a sweep refused before it starts leaves no directory: a README's way to find a sweep
        # killed outright is the newest one under multirun/
        _exit_on(lambda: _raise(plan_jobs(config, config_name)), on_error=lambda: made and _rmdir(self.sweep_dir))

    def on_job_start(self, config: DictConfig, **kwargs) -> None:
        if str(OmegaConf.select(config, "hydra.mode")).endswith("MULTIRUN"):  # RunMode.MULTIRUN
            # Hydra's basic sweeper wrote multirun.yaml, the command line's secrets whole, just before
            # its first job (a submitit launcher's driver masks it before it submits: rft.reporting.sweep)
            from rft.reporting.redact import redact_file

            redact_file(Path(str(config.hydra.sweep.dir)) / "multirun.yaml")
        # a sweep's job says which launcher log is its own, in its own folder: the report finds it
        # there when the job dies (the local launcher names its log folders by process id)
        if "submitit" in str(OmegaConf.select(config, "hydra.launcher._target_") or "").lower():
            from rft.reporting.sweep import record_own_log

            record_own_log(Path(str(config.hydra.runtime.output_dir)))

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        # a dry run writes nothing, but Hydra's basic sweeper wrote multirun.yaml into the sweep's
        # directory before the jobs printed their plans: a sweep of no jobs, newest under multirun/
        sweep = getattr(self, "sweep_dir", None)
        if sweep is not None and OmegaConf.select(config, "dry_run") is True and \
                sorted(p.name for p in sweep.iterdir()) == ["multirun.yaml"]:
            (sweep / "multirun.yaml").unlink()
            _rmdir(sweep)


def _warn_of_typed_secrets(config: DictConfig) -> None:
    from rft.reporting.redact import command_line_warning

    warning = command_line_warning([*(config.hydra.overrides.get("task") or []),
                                    *(config.hydra.overrides.get("hydra") or [])])
    if warning:
        print(f"rft: warning: {warning}", file=sys.stderr, flush=True)


def _rmdir(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass  # not empty (not only what this sweep made), or already gone


def _check_dir(config: DictConfig, key: str) -> None:
    from rft.plan.batch import check_run_name
    from rft.runtime import rundir

    HydraConfig.instance().set_config(config)  # the directory's name reads hydra's choices
    check_run_name(config)  # name=../.. would make a directory outside the project's
    rundir.check_writable(Path(str(OmegaConf.select(config, key))))


def unswept(config: DictConfig) -> str | None:
    """The warning for a run without -m of a config that sets a sweep's values or its launcher:
    Hydra then runs the config once, the swept keys at their defaults, and says nothing."""
    choices = config.hydra.runtime.choices
    params = config.hydra.sweeper.get("params") or {}
    if params:
        swept = ", ".join(f"{k}={v}" for k, v in params.items())
        now = ", ".join(f"{k}={choices[k] if k in choices else OmegaConf.select(config, k)}" for k in params)
        return (f"this config sets a sweep (hydra.sweeper.params: {swept}), which only `python run.py -m ...` "
                f"runs: this is one run, with {now}. Add -m to run the sweep.")
    launcher = choices.get("hydra/launcher")
    if launcher not in (None, "basic"):
        return (f"hydra/launcher={launcher} takes effect only with -m: this is one run, in this process. Add -m "
                f"to launch it.")
    return None


def _raise(message: str | None) -> None:
    if message:
        raise ConfigError(message)


def _exit_on(check, on_error=None) -> None:
    try:
        check()
    except ConfigError as e:
        if on_error:
            on_error()
        print(f"\nrft: configuration error: {e}\n", file=sys.stderr)
        sys.exit(2)


# ---------------------------------------------------------------- every job planned first


def sweep_jobs(config) -> list[list[str]]:
    """Each job's overrides, as Hydra's basic sweeper will launch them; [] for another sweeper."""
    from rft.reporting.sweep import planned_jobs

    return planned_jobs(config.hydra)


def plan_jobs(config, config_name: str | None) -> str | None:
    """The message for the first job of a sweep whose plan fails (a batch size of 0 among the
    values); None when every job plans. A job's mistake would otherwise be found when it starts,
    after the jobs before it trained. The datasets of all jobs are read in one child process."""
    from hydra import compose
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from rft.reporting.sweep import distinct_overrides
    from rft.runtime.main import checked_plan, job_sizes_in_child, per_stage, split_stages

    jobs = sweep_jobs(config)
    queued = "submitit" in str(config.hydra.launcher.get("_target_", "")).lower()
    if len(jobs) < 2 and not queued:
        return None  # a lone local job plans itself before it starts anything (queued: after its wait)
    saved, own, planned, dirs, dry = HydraConfig.instance().cfg, distinct_overrides(jobs), [], {}, []
    # a study's config groups kept outside conf/ (hydra.searchpath on the command line: a hydra
    # override, not one of the jobs'): without it a job naming one of its options does not compose
    search = [o for o in config.hydra.overrides.get("hydra") or [] if o.lstrip("+").startswith("hydra.searchpath=")]
    try:
        for i, job in enumerate(jobs):
            cfg = compose(config_name=config_name, overrides=[*search, *job], return_hydra_config=True)
            HydraConfig.instance().set_config(cfg)  # the run's name reads hydra's choices
            dirs.setdefault(_job_subdir(config, cfg, i), []).append(i)
            dry.append(bool(cfg.get("dry_run")))
            with open_dict(cfg):
                del cfg["hydra"]
            if cfg.mode != "bench":
                try:
                    planned.append((i, *split_stages(cfg)))
                except ConfigError as e:
                    return _job_error(i, own[i], e)
    finally:
        HydraConfig.instance().cfg = saved
    shared = next(((d, js) for d, js in dirs.items() if len(js) > 1), None)
    if shared:
        return _shared_dir(config, *shared, own)
    try:
        sizes = job_sizes_in_child([(stages, sources) for _, stages, sources in planned])
        warnings = {}  # a warning once, however many jobs it holds for
        for (i, stages, sources), n in zip(planned, sizes):
            for w in _check_launch(config.hydra.launcher, stages, per_stage(checked_plan, stages, n, sources)):
                warnings.setdefault(w, i)
    except ConfigError as e:
        i = planned[e.job][0] if hasattr(e, "job") else i
        return _job_error(i, own[i], e)
    for w, i in warnings.items():
        print(f"rft: warning: job {i} of the sweep ({' '.join(own[i]) or 'no overrides'}): {w}", file=sys.stderr, flush=True)
    if queued and dry and all(dry):
        # a dry run starts nothing: queued, each job would wait for its allocation to print a plan
        print(f"dry_run=true: the sweep's {len(jobs)} job{'s' * (len(jobs) != 1)} planned here and fit; nothing "
              f"was queued. One job's whole plan: `python run.py <its overrides> dry_run=true` (without -m); "
              f"without dry_run=true the sweep queues them.", flush=True)
        try:
            Path(str(config.hydra.sweep.dir)).rmdir()  # Hydra made it; a dry run leaves nothing behind
        except OSError:
            pass  # not empty: another sweep's, or not made
        sys.exit(0)
    return None


def _job_subdir(config, cfg, i: int) -> str:
    """Job i's directory under the sweep's, as Hydra's launcher names it: the command line's
    hydra.sweep.subdir (a hydra override: not among the job's own) read in the job's config, its
    number set."""
    with read_write(cfg.hydra), open_dict(cfg.hydra):  # Hydra's own section is read-only
        cfg.hydra.sweep.subdir = OmegaConf.to_container(config.hydra.sweep, resolve=False)["subdir"]
        cfg.hydra.job.num = cfg.hydra.job.id = i
    return str(OmegaConf.select(cfg, "hydra.sweep.subdir"))


def _shared_dir(config, subdir: str, jobs: list[int], own: list[list[str]]) -> str:
    """Jobs that would write to one directory: the second stopped on the first's run, after the first
    trained, advising name=... (which does not move a sweep's job) or continue_from_checkpoint=false
    (which moves the first's results aside)."""
    raw = OmegaConf.to_container(config.hydra.sweep, resolve=False)["subdir"]
    names = " and ".join(str(i) for i in jobs[:2]) + (f" (and {len(jobs) - 2} more)" if len(jobs) > 2 else "")
    return (f"jobs {names} of the sweep ({'; '.join(' '.join(own[i]) for i in jobs[:2])}) would write to one "
            f"directory, {Path(str(config.hydra.sweep.dir)) / subdir} (hydra.sweep.subdir={raw}): each job needs "
            f"its own, or the second finds the first's run there. Leave hydra.sweep.subdir at its default, "
            f"${{hydra.job.num}}, or make it differ between the jobs (e.g. ${{hydra.job.override_dirname}}). No job "
            f"has started: every job is planned first.")


def _check_launch(launcher, stages: list, plans: list) -> list[str]:
    """A sweep on Slurm (hydra/launcher=slurm): each job asks Slurm for the GPUs it plans for, and
    what surely cannot fit them stops the sweep before anything is queued (rft.plan.memory; this
    machine, a login node, plans with cluster.gpu_memory_gb or an assumed 80 GiB GPU). Returns the
    warnings: a stage whose save at Slurm's early warning would not fit in it (rft.plan.disk)."""
    from rft.plan.disk import slow_save
    from rft.plan.memory import check_memory
    from rft.runtime.preemption import REQUEUE_MARGIN_S

    if "slurm" not in str(launcher.get("_target_", "")).lower():
        return []
    c, asked = stages[-1].cluster, launcher.get("gpus_per_node")
    if (asked or 0) != c.gpu_per_node:
        raise ConfigError(f"cluster.gpu_per_node={c.gpu_per_node}, but hydra.launcher.gpus_per_node="
                          f"{'null' if asked is None else asked} asks Slurm for {asked or 0} GPUs a node. Set "
                          f"hydra.launcher.gpus_per_node={c.gpu_per_node} (or cluster.gpu_per_node to what the "
                          f"nodes have).")
    check_memory(stages, plans)
    delay = launcher.get("signal_delay_s")
    return [w for w in (slow_save(s, p, delay, REQUEUE_MARGIN_S) for s, p in zip(stages, plans)) if w]


def _job_error(i: int, overrides: list[str], error: Exception) -> str:
    return (f"job {i} of the sweep ({' '.join(overrides) or 'no overrides'}): {error} No job has started: "
            f"every job is planned first.")
