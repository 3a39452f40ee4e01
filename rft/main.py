"""The entry point behind run.py: stages, the batch plan, Ray, and clean errors.

`main(cfg)` splits the composed config into stages (each stage dict merged onto the global
config), checks every stage's batch plan before anything heavy starts, then runs the stages in
order, each starting from the previous stage's final model.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rft.errors import ConfigError, RunError

log = logging.getLogger(__name__)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(cfg: DictConfig) -> float | None:
    """Run the configured job; returns the last value of the metric `objective` (a sweeper's
    objective; eval/accuracy by default)."""
    try:
        return _main(cfg)
    except ConfigError as e:
        # raised inside a Ray actor it arrives wrapped; its cause holds the message
        print(f"\nrft: configuration error: {getattr(e, 'cause', e)}\n", file=sys.stderr)
        sys.exit(2)
    except RunError as e:
        print(f"\nrft: the run stopped: {e}\n", file=sys.stderr)
        sys.exit(1)


def run_dir_of(cfg: DictConfig) -> Path:
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        try:
            return Path(HydraConfig.get().runtime.output_dir)
        except Exception:  # composed without a run (tests, notebooks): no output dir chosen
            pass
    return Path(os.path.expanduser(cfg.checkpoint_root_dir)) / cfg.project / cfg.name


def stage_configs(cfg: DictConfig) -> list[DictConfig]:
    """One config per stage: the global config with the stage's dict merged on top."""
    base = cfg.copy()
    OmegaConf.resolve(base)
    stages = list(base.stages)
    base.stages = []
    if not stages:
        return [base]
    out, names = [], set()
    for i, stage in enumerate(stages):
        if not isinstance(stage, DictConfig) or "stage_name" not in stage:
            raise ConfigError(f"stages[{i}] must be a mapping with a stage_name (got {stage!r}).")
        try:
            merged = OmegaConf.merge(base, stage)
            OmegaConf.resolve(merged)
        except OmegaConfBaseException as e:
            raise ConfigError(f"stages[{i}] ({stage.get('stage_name')}): {_first_line(e)}") from e
        if merged.stage_name in names:
            raise ConfigError(f"stages[{i}].stage_name={merged.stage_name!r} is used twice; stage names must be unique.")
        names.add(merged.stage_name)
        out.append(merged)
    return out


def _first_line(e: Exception) -> str:
    return " ".join(str(e).split("\n")[:2])


def dataset_size(cfg: DictConfig) -> int:
    """Rows the stage iterates over: the taskset (mode=both|explore), the stored experiences or
    the training dataset (mode=train)."""
    from rft.plan import stored_experiences
    from rft.tasks import ensure_task_data, load_rows, load_tasks

    inp = cfg.buffer.explorer_input
    ensure_task_data(inp)
    eb = cfg.buffer.trainer_input.experience_buffer
    if cfg.mode == "train" and eb.storage_type in ("sql", "file") and eb.path and stored_experiences(eb):
        from rft.buffer import count_experiences

        n = count_experiences(eb.path)
        if n == 0 and cfg.buffer.total_steps is None:
            raise ConfigError(
                f"buffer.trainer_input.experience_buffer.path={eb.path!r} holds no experiences yet. "
                f"Run mode=explore first, or set buffer.total_steps to train while one writes them."
            )
        return n
    if cfg.mode in ("both", "explore"):
        # load every taskset here, in the driver, so a bad row fails before anything starts
        size = len(load_tasks(inp.taskset, "buffer.explorer_input.taskset"))
        for i, ts in enumerate(inp.eval_tasksets):
            load_tasks(ts, f"buffer.explorer_input.eval_tasksets[{i}]")
        return size
    if eb.storage_type not in ("sql", "file") or not eb.path:
        raise ConfigError(
            "mode=train reads its data from buffer.trainer_input.experience_buffer.path, which is "
            "not set: give the buffer a mode=explore run wrote (buffer=sql "
            "buffer.trainer_input.experience_buffer.path=<its buffer.db>), or a dataset of "
            "prompt/response rows (storage_type=file path=<dataset>)."
        )
    return len(load_rows(eb.path, eb.split, key="buffer.trainer_input.experience_buffer.path"))


def _move_aside(run_dir: Path) -> None:
    """continue_from_checkpoint=false on a used directory: keep the old outputs, start clean."""
    old = [p for p in run_dir.iterdir() if p.name not in (".hydra",) and not p.name.endswith(".log")]
    if not old:
        return
    backup = run_dir / f"previous_{datetime.datetime.now():%Y%m%d_%H%M%S}"
    backup.mkdir()
    for p in old:
        if not p.name.startswith("previous_"):
            shutil.move(str(p), backup / p.name)
    print(f"continue_from_checkpoint=false: moved the earlier outputs to {backup}")


def ray_namespace(cfg: DictConfig, run_dir: Path) -> str:
    """Actor names are unique within a Ray namespace: runs sharing one Ray cluster (a sweep's jobs
    often have the same name, differing by seed) each get their own, from their output dir."""
    import hashlib

    return f"{cfg.project}/{cfg.name}/{hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:8]}"


def _start_ray(cfg: DictConfig, run_dir: Path) -> bool:
    import ray

    if ray.is_initialized():
        return False
    local = cfg.cluster.ray_address is None
    ray.init(
        # "local": always a new instance of our own. With None, Ray joins the cluster named in
        # /tmp/ray/ray_current_cluster (the last `ray start` here), and waits forever if that one
        # died without `ray stop`
        address="local" if local else cfg.cluster.ray_address,
        num_cpus=cfg.cluster.num_cpus if local else None,
        include_dashboard=False,
        log_to_driver=False,
        namespace=ray_namespace(cfg, run_dir),
        logging_level=logging.WARNING,
    )
    return True


def _main(cfg: DictConfig) -> float | None:
    from rft.models import ensure_model
    from rft.plan import format_plan, make_plan

    if cfg.mode == "bench":
        from rft.bench import bench

        return bench(cfg, run_dir_of(cfg))
    stages = stage_configs(cfg)
    plans = []
    for s in stages:
        try:
            plans.append(make_plan(s, dataset_size(s)))
        except ConfigError as e:
            raise ConfigError(f"stage {s.stage_name}: {e}" if s.stage_name else str(e)) from e
    if cfg.dry_run:
        for s, p in zip(stages, plans):
            print(format_plan(p, title=f"batch plan: stage {s.stage_name or s.name} ({s.algorithm.algorithm_type})"))
            print()
        return None

    from rft.monitor import read_metrics
    from rft.placement import check_allocation
    from rft.runner import run_stage

    check_allocation(cfg)

    run_dir = run_dir_of(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not cfg.continue_from_checkpoint:
        _move_aside(run_dir)
    ensure_model(stages[0].model)
    started_ray = stages[0].cluster.backend == "ray" and _start_ray(stages[0], run_dir)
    try:
        init_path = None
        for s, plan in zip(stages, plans):
            stage_dir = run_dir / s.stage_name if s.stage_name else run_dir
            title = s.stage_name or s.algorithm.algorithm_type
            init_path = str(run_stage(s, plan, stage_dir, init_path, title))
    finally:
        if started_ray:
            import ray

            ray.shutdown()
    print(f"outputs: {run_dir}")
    values = [m[cfg.objective] for m in read_metrics(stage_dir / "metrics.jsonl") if cfg.objective in m]
    if not values:
        print(f"rft: warning: objective={cfg.objective} was never logged in {stage_dir / 'metrics.jsonl'}, "
              f"so the run returns None; set objective to one of its metric names (e.g. reward/mean).",
              file=sys.stderr)
        return None
    return values[-1]
