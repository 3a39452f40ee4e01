"""One stage of a run, top to bottom: set up -> (explore -> train -> sync)* -> clean up.

StageRun starts the stage's parts and ends them (`close`, also after a failed start); the parts:
    rft.runtime.schedule   Schedule: the step loop, which explore, train, sync, eval and save each
                           step makes (the order, and why a resumed run repeats it exactly)
    rft.runtime.explorers  ExplorerPool: the explorer actors, the weights they serve, restarts
    rft.runtime.saving     StageCheckpoints: resume (trainer, buffer) and save
    rft.runtime.faults     what a failure says: a dead actor, tasks that all fail, no signal
"""

from __future__ import annotations

import logging

import gc
import sys
from pathlib import Path

from omegaconf import open_dict

from rft.data.buffer import make_buffer
from rft.data.pipeline import write_report
from rft.plan.placement import torch_threads
from rft.reporting.monitor import Monitor, read_metrics
from rft.runtime import checkpoint, preemption
from rft.runtime.actors import ACTOR_BACKENDS, long_lived, start_explorers, start_trainer
from rft.runtime.checkpoint import Checkpoint, Owner, latest_checkpoint, usable_checkpoint
from rft.runtime.explorers import ExplorerPool
from rft.runtime.faults import LearningSignal, TrainerCalls
from rft.runtime.saving import StageCheckpoints
from rft.runtime.dynamic import DynamicSchedule
from rft.runtime.schedule import Schedule, reward_norm
from rft.config import fixed_policy, lora_adapter_sync
from rft.sync.weights import SYNC_METHODS


def run_stage(cfg, plan, stage_dir: Path, init_path: str | None, title: str, owner: Owner) -> Path | None:
    """Run one stage to its last step; returns its final HF-format model's directory (None for a
    stage that trains nothing: mode=explore). `owner`: the identity its checkpoints carry, and the
    one those it resumes from must have (rft.runtime.checkpoint)."""
    stage_dir.mkdir(parents=True, exist_ok=True)
    write_report(cfg, stage_dir)  # data_processor.task_pipeline: the rows in and out of its operators
    trains = cfg.mode in ("both", "train")
    if cfg.trainer.resume_from_path:
        latest = checkpoint.chosen_checkpoint(stage_dir, cfg.trainer.resume_from_path, owner, title, print)
    else:
        latest = (usable_checkpoint(stage_dir, owner, title, print, finished_at=plan.total_steps)
                  if cfg.continue_from_checkpoint else None)
    if latest is None:  # from its beginning: nothing in it is a stage cache copy's (one killed before its checkpoint)
        (stage_dir / "reused_from").unlink(missing_ok=True)
    if latest is not None and latest.step >= plan.total_steps:
        print(f"[{title}] already finished (step {latest.step}); outputs in {stage_dir}")
        metrics = latest.state.get("metrics")
        if metrics is not None and not any(m["step"] == latest.step for m in read_metrics(stage_dir / "metrics.jsonl")):
            # killed between its last checkpoint and logging that step: the checkpoint kept the row
            monitor = Monitor(cfg, stage_dir, plan.total_steps, latest.step, title)
            monitor.ensure_logged(latest.step, metrics)
            monitor.close()
        return latest.hf_path if trains else None
    with long_lived():  # the driver's modules, datasets and buffer: frozen for its collections
        stage = StageRun(cfg, plan, stage_dir, init_path, title, latest, owner)
    try:
        stage.loop()
    finally:
        stage.close()
    # read back from the log, so a resumed run reports its whole stage too
    evals = [m["eval/accuracy"] for m in read_metrics(stage_dir / "metrics.jsonl") if "eval/accuracy" in m]
    if len(evals) > 1:
        print(f"[{title}] eval accuracy: start {evals[0]:.3f} -> end {evals[-1]:.3f}")
    return latest_checkpoint(stage_dir).hf_path if trains else None


class StageRun:
    """The stage's actors, buffer, weight sync and monitor, from their start to their end: what
    `close` must end, whatever failed. The loop over them is its Schedule (`loop`)."""

    def __init__(self, cfg, plan, stage_dir: Path, init_path, title: str, latest: Checkpoint | None, owner: Owner):
        self.cfg, self.plan, self.dir, self.title = cfg, plan, stage_dir, title
        self.init_path, self.owner = init_path, owner
        self.checkpoints = StageCheckpoints(cfg, plan, stage_dir, title, owner, init_path)
        self.trainer, self.explorers, self.pg, self.buffer = None, [], None, None
        self.monitor = None
        try:
            self._start(latest)
        except BaseException:
            self.close()  # what started before the error: actors, the buffer's file, the placement
            raise

    def _start(self, latest: Checkpoint | None) -> None:
        cfg, mode, fixed = self.cfg, self.cfg.mode, fixed_policy(self.cfg)
        trains = mode in ("both", "train")
        self._default_buffer_path()  # before any actor gets its copy of the config
        Actor = ACTOR_BACKENDS[cfg.cluster.backend]
        common = dict(log_dir=str(self.dir / "log"), level=cfg.log.level, threads=torch_threads(cfg))
        options = self._placement()
        if trains:
            ranks = [options.pop(0) for _ in range(self.plan.dp_size)]
            self.trainer = self._start_trainer(Actor, common, ranks, latest)
            loaded = self.checkpoints.load(self.trainer, latest)
            if latest is not None and loaded is None:  # none loads: the stage starts over, from the starting model
                self.trainer.actor.kill()
                self.trainer = self._start_trainer(Actor, common, ranks, None)
            latest = loaded
        start = latest.step if latest else 0
        saved = latest.state if latest else {}
        # reward models on workers of their own (rft/rewards/reward_model.py), found by name by the
        # explorers' reward clients; with cluster=inline none: each client builds its own
        from rft.runtime.actors import start_reward_models, wait_reward_models

        self.reward_models = start_reward_models(Actor, cfg, common, options)
        # mode=train still evaluates with an explorer when there are eval tasksets (plan.explorers)
        # (model.lora.sync=adapter: the engines keep the stage's starting model as the base, and
        # the resumed adapters come by a sync below; a fixed policy's checkpoint is a reward model's)
        resumed = latest is not None and latest.hf_path.exists() and not lora_adapter_sync(cfg.model) and not fixed
        self.explorers = start_explorers(Actor, cfg, self.plan.explorers, str(latest.hf_path) if resumed else self.init_path,
                                         start if resumed else 0, self.title, common, options)
        wait_reward_models(self.reward_models)  # a model that does not load: a ConfigError naming it
        # prompts (and a training dataset's responses) past the token budgets, checked where the
        # tokenizers are: the explorer's tasksets, the trainer's dataset
        checkers = self.explorers[:1] + ([self.trainer.actor] if self.trainer is not None else [])
        for text in (t for actor in checkers for t in actor.call("token_budget_warnings")):
            print(f"rft: warning: stage {self.title}: {text}", flush=True)
        self._open_input(saved, latest)
        self.sync = SYNC_METHODS[cfg.synchronizer.sync_method](self.dir, cfg.synchronizer)
        for warning in plan_warnings(cfg, self.plan, self.dir, fixed):
            print(f"rft: warning: stage {self.title}: {warning}", flush=True)
        norm = reward_norm(cfg, saved)
        self.monitor = Monitor(cfg, self.dir, self.plan.total_steps, start, self.title)
        # the version the explorers serve (mode=explore: what it picks up; see Schedule.run)
        synced = 0 if mode == "explore" else saved.get("version", start)
        self.pool = ExplorerPool(cfg, self.explorers, self.trainer, self.sync, synced, self.monitor, self.dir,
                                 self.title, self.owner)
        self.pool.load_partial(saved.get("partial"))  # explorer.partial_rollout: the groups in flight
        # synchronizer.sync_style: the step grid (rft/runtime/schedule.py) or none (rft/runtime/dynamic.py)
        schedule = DynamicSchedule if cfg.synchronizer.sync_style == "dynamic_by_explorer" and mode == "both" else Schedule
        self.schedule = schedule(cfg, self.plan, start, saved, norm, pool=self.pool, trainer=self.trainer,
                                 buffer=self.buffer, monitor=self.monitor, checkpoints=self.checkpoints,
                                 signal=LearningSignal(cfg, self.plan, start, self.dir, self.title, self.monitor))
        self._announce(start, saved, latest)
        if start and trains and self.explorers and not resumed and not fixed:
            # a LoRA checkpoint without hf/ (trainer.save_hf_checkpoint): the explorers started from
            # the stage's starting model; the trainer gives them the resumed weights, as hf/ would
            self.pool.sync_all(start)
            self.pool.synced = synced

    def _start_trainer(self, Actor, common: dict, ranks: list[dict], latest: Checkpoint | None) -> TrainerCalls:
        """The trainer, built for the checkpoint it loads next (`latest`) where it can: the policy's
        weights read from its hf/ once, not the starting model's that its load would overwrite (at 7B
        a 15-30 GB read); the starting model is still read for what is that one (the reference
        model, LoRA's base). Not for a checkpoint written before manifests (nothing checked its
        hf/) or of another starting model (resume_with_changes=true: its hf/ may be another
        architecture, which the load refuses and falls back from)."""
        same = latest is not None and latest.identity and "model" not in self.owner.differences(latest.identity)
        return TrainerCalls(start_trainer(Actor, self.cfg, self.plan, self.init_path, f"{self.title}_{self.cfg.trainer.name}",
                                          common, ranks, resume=str(latest.path) if same else None), self.dir)

    def _announce(self, start: int, saved: dict, latest: Checkpoint | None) -> None:
        """The resumed step's row in the metrics log, if it was lost; where the run stands."""
        if start:
            self.monitor.ensure_logged(start, saved.get("metrics"))
        if self.cfg.mode == "explore":
            eb = self.cfg.buffer.trainer_input.experience_buffer
            self.monitor.print(f"[{self.title}] experiences go to {eb.path} (view them: python -m rft.data.buffer {eb.path})")
        if start:
            self.monitor.print(f"[{self.title}] resuming from step {start} ({latest.path})")
        elif self.init_path:  # its config.yaml's model.model_path is the run's first model, not this one
            # named by the stage that wrote it: after a reward-model stage (whose model scores and
            # is not started from) or an explore-only one, that is not the stage just before
            src = Path(self.init_path)
            whose = f"{src.parents[2].name}'s" if src.name == "hf" and src.parents[1].name == "checkpoints" else (
                "the previous stage's")
            self.monitor.print(f"[{self.title}] starts from {whose} final model: {self.init_path}")

    def _default_buffer_path(self) -> None:
        """A sql or file buffer without a path lives in the stage directory."""
        eb = self.cfg.buffer.trainer_input.experience_buffer
        if eb.storage_type in ("sql", "file") and not eb.path:
            with open_dict(self.cfg):
                eb.path = str(self.dir / ("buffer.db" if eb.storage_type == "sql" else "experiences.jsonl"))

    def _open_input(self, saved: dict, latest: Checkpoint | None) -> None:
        """What the trainer reads (plan.input_kind): the buffer, put back where the checkpoint left
        it (a dataset the trainer reads itself: Trainer.train_dataset_step)."""
        if self.plan.input_kind != "dataset":
            self.buffer = make_buffer(self.cfg.buffer.trainer_input.experience_buffer)
            self.checkpoints.restore_buffer(self.buffer, saved.get("buffer"), latest)

    def _placement(self) -> list[dict]:
        if self.cfg.cluster.backend != "ray":
            return [{}] * (self.plan.dp_size + self.plan.explorers)
        from rft.runtime.actors import placement_for

        self.pg, options = placement_for(self.cfg)
        return options

    def loop(self) -> None:
        # in a Slurm job, the warning before a preemption or the time limit saves the step in
        # progress and then requeues the job (rft/runtime/preemption.py)
        with preemption.steps(self.title, self.monitor.print):
            self.schedule.run()

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
        if self.cfg.monitor.enable_ray_timeline and self.cfg.cluster.backend == "ray":
            import ray

            (self.dir / "monitor").mkdir(exist_ok=True)
            ray.timeline(filename=str(self.dir / "monitor" / "timeline.json"))
        trainer = self.trainer.actor if self.trainer is not None else None
        if trainer is not None and hasattr(getattr(self, "sync", None), "close"):
            try:
                self.sync.close(trainer)
            except Exception:  # a dead trainer: its resource tracker unlinks the segment
                pass
        for actor in (trainer, *self.explorers, *getattr(self, "reward_models", [])):
            if actor is not None:
                try:
                    actor.kill()
                except Exception:
                    pass
        if self.buffer is not None:
            self.buffer.close()
        # stopped by Ctrl-C or SIGTERM, the process ends and its placement group with it; removing it
        # waits on Ray's GCS, which a SIGTERM to the whole process group (the studio's stop) ended too:
        # until the studio's SIGKILL 15 s later, with no word of where the run stopped
        if self.pg is not None and not isinstance(sys.exc_info()[1], KeyboardInterrupt):
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
        gc.unfreeze()  # what the stage froze (rft.runtime.actors.long_lived) can be collected again


def plan_warnings(cfg, plan, stage_dir: Path, fixed: bool) -> list[str]:
    """What the dry run warns of, said again as the stage starts: kept checkpoints that would not
    fit where they go (now, not when the disk fills), and a weight sync that moves a large model
    the slow way every step (mode=both; a fixed policy is never synced)."""
    from rft.plan.disk import describe_disk
    from rft.plan.sync import route

    warnings = []
    if cfg.mode != "explore":
        warnings.append(describe_disk(cfg, plan, stage_dir)[1])
    if cfg.mode == "both" and not fixed:
        way, warning = route(cfg)
        logging.getLogger(__name__).info("weight sync: %s", way)
        warnings.append(warning)
    return [w for w in warnings if w]
