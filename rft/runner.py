"""One stage of a run, top to bottom: set up -> (explore -> train -> sync)* -> clean up.

mode=both, per step k = 1..total_steps:
    experiences = explorer.explore(k - 1)          # tasks and sampling seed are functions of k
    buffer.put(experiences); batch = buffer.get(train_batch_size)
    metrics = trainer.train_step(batch)
    sync trainer -> explorer every sync_interval steps (and before an eval or a checkpoint)
    checkpoint every save_interval steps; eval every eval_interval steps (and at 0 and the end)
mode=train: the same loop with the batch read from a dataset instead of an explorer.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from rft.actors import ACTOR_BACKENDS
from rft.buffer import DatasetReader, QueueBuffer
from rft.explorer import Explorer
from rft.monitor import Monitor, read_metrics
from rft.sync import SYNC_METHODS
from rft.trainer import Trainer

log = logging.getLogger(__name__)


@dataclass
class Checkpoint:
    step: int
    path: Path

    @property
    def hf_path(self) -> Path:
        return self.path / "hf"


def latest_checkpoint(stage_dir: Path) -> Checkpoint | None:
    """The newest complete checkpoint (its state.json is written last, so a killed save is ignored)."""
    found = []
    for d in (stage_dir / "checkpoints").glob("step_*"):
        if (d / "state.json").exists():
            found.append(Checkpoint(json.loads((d / "state.json").read_text())["step"], d))
    return max(found, key=lambda c: c.step, default=None)


def _save(trainer, stage_dir: Path, step: int) -> Checkpoint:
    final = stage_dir / "checkpoints" / f"step_{step}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    trainer.call("save", str(tmp))
    (tmp / "state.json").write_text(json.dumps({"step": step}))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return Checkpoint(step, final)


def run_stage(cfg, plan, stage_dir: Path, init_path: str | None, title: str) -> Path:
    """Run one stage to its last step; returns the directory of its final HF-format model."""
    stage_dir.mkdir(parents=True, exist_ok=True)
    latest = latest_checkpoint(stage_dir) if cfg.continue_from_checkpoint else None
    if latest is not None and latest.step >= plan.total_steps:
        print(f"[{title}] already finished (step {latest.step}); model at {latest.hf_path}")
        return latest.hf_path
    start = latest.step if latest else 0
    weights = str(latest.hf_path) if latest else init_path

    Actor = ACTOR_BACKENDS[cfg.cluster.backend]
    common = dict(log_dir=str(stage_dir / "log"), level=cfg.log.level, num_cpus=cfg.cluster.cpus_per_actor)
    # the trainer starts from the stage's starting model (its reference model, if any, must be
    # that one), then a resumed run loads the checkpoint over it
    trainer = Actor(Trainer, cfg, plan, init_path, name=f"{title}_{cfg.trainer.name}", **common)
    if latest is not None:
        trainer.call("load", str(latest.path))
        log.info("resumed %s from %s", title, latest.path)
    explorer = None
    # mode=both explores with it; mode=train still evaluates with it when there are eval tasksets
    if cfg.mode == "both" or cfg.buffer.explorer_input.eval_tasksets:
        explorer = Actor(Explorer, cfg, weights, start, name=f"{title}_{cfg.explorer.name}", **common)
    source = None
    if cfg.mode == "train":
        from rft.models import load_tokenizer

        source = DatasetReader(
            cfg.buffer.trainer_input.experience_buffer, load_tokenizer(cfg.model),
            cfg.model.max_prompt_tokens, cfg.model.max_response_tokens, cfg.seed,
        )
    sync = SYNC_METHODS[cfg.synchronizer.sync_method](stage_dir, cfg.synchronizer)
    buffer = QueueBuffer()
    monitor = Monitor(cfg, stage_dir, plan.total_steps, start, title)
    if start:
        monitor.print(f"[{title}] resuming from step {start} ({latest.path})")

    def evaluate(step: int) -> dict:
        t0 = time.perf_counter()
        metrics = explorer.call("evaluate", step)
        metrics["timing/eval_s"] = time.perf_counter() - t0
        if "eval/accuracy" in metrics:
            monitor.print(f"[{title}] step {step}: eval accuracy {metrics['eval/accuracy']:.3f}")
        return metrics

    explores = source is None
    try:
        if explorer is not None and start == 0 and cfg.explorer.eval_on_startup:
            monitor.log(0, evaluate(0), advance=False)
        synced = start
        for step in range(start + 1, plan.total_steps + 1):
            t_step = time.perf_counter()
            metrics = {}
            if explores:
                t0 = time.perf_counter()
                exps, m = explorer.call("explore", step - 1)
                metrics.update(m)
                metrics["timing/rollout_s"] = time.perf_counter() - t0
                buffer.put(exps)
                batch = buffer.get(plan.experiences_per_step, cfg.buffer.trainer_input.experience_buffer.max_read_timeout)
                metrics["staleness/mean"] = sum(step - 1 - e.policy_version for e in batch) / len(batch)
            else:
                batch = source.batch(step - 1, plan.experiences_per_step)
            t0 = time.perf_counter()
            metrics.update(trainer.call("train_step", batch))
            metrics["timing/train_s"] = time.perf_counter() - t0

            last = step == plan.total_steps
            want_eval = explorer is not None and (step % cfg.explorer.eval_interval == 0 or last)
            want_save = step % cfg.trainer.save_interval == 0 or last
            # an eval needs the explorer on the trainer's weights; so does a checkpoint, for a
            # resumed run to explore from the weights an uninterrupted one would have
            if want_eval or (explores and (step % cfg.synchronizer.sync_interval == 0 or want_save)):
                t0 = time.perf_counter()
                sync(trainer, explorer, step)
                synced = step
                metrics["timing/sync_s"] = time.perf_counter() - t0
            metrics["sync/version"] = synced
            metrics["timing/step_s"] = time.perf_counter() - t_step
            if want_eval:
                metrics.update(evaluate(step))
            if want_save:
                t0 = time.perf_counter()
                ckpt = _save(trainer, stage_dir, step)
                metrics["timing/save_s"] = time.perf_counter() - t0
            monitor.log(step, metrics)
    finally:
        monitor.close()
        for actor in (trainer, explorer):
            if actor is not None:
                actor.kill()
    # read back from the log, so a resumed run reports its whole stage too
    evals = [m["eval/accuracy"] for m in read_metrics(stage_dir / "metrics.jsonl") if "eval/accuracy" in m]
    if len(evals) > 1:
        print(f"[{title}] eval accuracy: start {evals[0]:.3f} -> end {evals[-1]:.3f}")
    return ckpt.hf_path
