"""One stage of a run, top to bottom: set up -> (explore -> train -> sync)* -> clean up.

mode=both, per step k = 1..total_steps (o = synchronizer.sync_offset):
    explorers.explore(k - 1 + o) is started      # runs while the trainer trains: o steps ahead
    experiences of explore step k - 1 -> buffer; batch = buffer.get(train_batch_size)
    metrics = trainer.train_step(batch)          # experiences staler than max_staleness dropped
    sync trainer -> explorers every sync_interval steps (and before an eval or a checkpoint)
    checkpoint every save_interval steps; eval every eval_interval steps (and at 0 and the end)
mode=explore: the explorer half, writing every step to the buffer (sql or file) and taking new
    weights from synchronizer.checkpoint_dir every sync_interval steps.
mode=train: the trainer half, reading from a stored buffer or a dataset.

The explorer's work for step s is a function of (seed, s, the weights it serves), and calls on one
actor run in the order they were made: an explore started before a sync uses the old weights,
one started after it the new. So the schedule (which weights made which experiences) is fixed by
the config, and a resumed run repeats it exactly: a checkpoint holds the trainer, the buffer's
read position and its unread experiences (those explored ahead), and the next step to explore.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import open_dict

from rft.actors import ACTOR_BACKENDS
from rft.buffer import DatasetReader, is_experience_file, make_buffer
from rft.errors import RunError
from rft.explorer import Explorer, rollout_metrics
from rft.monitor import Monitor, read_metrics
from rft.sync import SYNC_METHODS
from rft.fsdp import start_trainer, trainer_ranks

log = logging.getLogger(__name__)


@dataclass
class Checkpoint:
    step: int
    path: Path
    state: dict = field(default_factory=dict)

    @property
    def hf_path(self) -> Path:
        return self.path / "hf"


def list_checkpoints(stage_dir: Path) -> list[Checkpoint]:
    """Complete checkpoints, oldest first (state.json is written last, so a killed save is ignored)."""
    found = []
    for d in (Path(stage_dir) / "checkpoints").glob("step_*"):
        if (d / "state.json").exists():
            state = json.loads((d / "state.json").read_text())
            found.append(Checkpoint(state["step"], d, state))
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(stage_dir: Path) -> Checkpoint | None:
    found = list_checkpoints(stage_dir)
    return found[-1] if found else None


def _actor_died(e: Exception) -> bool:
    try:
        from ray.exceptions import RayActorError
    except ImportError:
        return False
    return isinstance(e, RayActorError)


def run_stage(cfg, plan, stage_dir: Path, init_path: str | None, title: str) -> Path | None:
    """Run one stage to its last step; returns the directory of its final HF-format model."""
    stage_dir.mkdir(parents=True, exist_ok=True)
    latest = latest_checkpoint(stage_dir) if cfg.continue_from_checkpoint else None
    if latest is not None and latest.step >= plan.total_steps:
        print(f"[{title}] already finished (step {latest.step}); outputs in {stage_dir}")
        return latest.hf_path if latest.hf_path.exists() else init_path
    stage = StageRun(cfg, plan, stage_dir, init_path, title, latest)
    try:
        stage.loop()
    finally:
        stage.close()
    # read back from the log, so a resumed run reports its whole stage too
    evals = [m["eval/accuracy"] for m in read_metrics(stage_dir / "metrics.jsonl") if "eval/accuracy" in m]
    if len(evals) > 1:
        print(f"[{title}] eval accuracy: start {evals[0]:.3f} -> end {evals[-1]:.3f}")
    final = latest_checkpoint(stage_dir)
    return final.hf_path if final.hf_path.exists() else init_path


class StageRun:
    def __init__(self, cfg, plan, stage_dir: Path, init_path, title: str, latest: Checkpoint | None):
        self.cfg, self.plan, self.dir, self.title = cfg, plan, stage_dir, title
        self.init_path = init_path
        self.latest = latest
        self.start = latest.step if latest else 0
        saved = latest.state if latest else {}
        mode = cfg.mode
        self.explores = mode in ("both", "explore")
        self.trains = mode in ("both", "train")
        self.trainer, self.explorers, self.source, self.pg = None, [], None, None
        self.monitor = None

        Actor = ACTOR_BACKENDS[cfg.cluster.backend]
        common = dict(log_dir=str(stage_dir / "log"), level=cfg.log.level)
        options = self._placement()
        if self.trains:
            # the trainer starts from the stage's starting model (its reference model, if any,
            # must be that one), then a resumed run loads the checkpoint over it
            ranks = [options.pop(0) for _ in range(trainer_ranks(cfg))]
            self.trainer = start_trainer(Actor, cfg, self.plan, init_path, f"{title}_{cfg.trainer.name}", common, ranks)
            if latest is not None:
                self.trainer.call("load", str(latest.path))
                log.info("resumed %s from %s", title, latest.path)
        # mode=train still evaluates with an explorer when there are eval tasksets
        if self.explores or cfg.buffer.explorer_input.eval_tasksets:
            resumed = latest is not None and latest.hf_path.exists()
            weights = str(latest.hf_path) if resumed else init_path
            n = cfg.explorer.rollout_model.engine_num if self.explores else 1
            for i in range(n):
                name = f"{title}_{cfg.explorer.name}" + (f"_{i}" if n > 1 else "")
                restarts = dict(max_restarts=cfg.cluster.max_actor_restarts) if cfg.cluster.backend == "ray" else {}
                self.explorers.append(Actor(Explorer, cfg, weights, self.start if resumed else 0, i, name=name, **common,
                                            **options[i], **restarts))

        eb = cfg.buffer.trainer_input.experience_buffer
        if eb.storage_type in ("sql", "file") and not eb.path:
            with open_dict(cfg):
                eb.path = str(stage_dir / ("buffer.db" if eb.storage_type == "sql" else "experiences.jsonl"))
        if mode == "train" and eb.storage_type == "file" and not is_experience_file(eb.path):
            from rft.models import load_tokenizer

            self.source = DatasetReader(eb, load_tokenizer(cfg.model), cfg.model.max_prompt_tokens,
                                        cfg.model.max_response_tokens, cfg.seed)
            self.buffer = None
        else:
            self.buffer = make_buffer(eb)
            state = saved.get("buffer")
            if mode == "both" and hasattr(self.buffer, "truncate_after"):
                # this run is the only writer: what it wrote after its checkpoint (or, with no
                # checkpoint, at all) is written again, identically
                dropped = self.buffer.truncate_after(state["last_id"] if state else 0)
                if dropped:
                    log.info("dropped %d experiences written after the checkpoint", dropped)
            if state:
                self.buffer.restore(state)
            elif eb.storage_type == "sql":
                self.buffer.restore({"cursor": 0})  # a fresh run reads from the start
        self.sync = SYNC_METHODS[cfg.synchronizer.sync_method](stage_dir, cfg.synchronizer)
        # the version the explorers serve (mode=explore: what it picks up; see loop)
        self.synced = 0 if mode == "explore" else saved.get("version", self.start)
        self.next_explore = saved.get("next_explore", self.start)
        self.pending: deque = deque()  # (explore step, one future per explorer)
        self.asleep = False
        self.explore_metrics = {int(k): v for k, v in saved.get("explore_metrics", {}).items()}
        self.monitor = Monitor(cfg, stage_dir, plan.total_steps, self.start, title)
        if mode == "explore":
            self.monitor.print(f"[{title}] experiences go to {eb.path} (view them: python -m rft.buffer {eb.path})")
        if self.start:
            self.monitor.print(f"[{title}] resuming from step {self.start} ({latest.path})")

    def _placement(self) -> list[dict]:
        if self.cfg.cluster.backend != "ray":
            return [{}] * (trainer_ranks(self.cfg) + self.cfg.explorer.rollout_model.engine_num)
        from rft.placement import placement_for

        self.pg, options = placement_for(self.cfg)
        return options

    # ------------------------------------------------------------------ explorers

    def _awake(self, awake: bool) -> None:
        """explorer.rollout_model.enable_sleep_mode: the engines give the GPU to the trainer while it trains."""
        if self.cfg.explorer.rollout_model.enable_sleep_mode and self.asleep == awake:
            for e in self.explorers:
                e.call("wake_up" if awake else "sleep")
            self.asleep = not awake

    def _submit_explore(self, step: int) -> None:
        self._awake(True)
        self.pending.append((step, [e.submit("explore", step) for e in self.explorers], time.perf_counter()))

    def _collect(self) -> None:
        """Wait for the oldest explore step; its experiences go into the buffer."""
        step, futures, t0 = self.pending.popleft()
        exps, counters = [], {}
        for i, f in enumerate(futures):
            e, c = self._explorer_result(i, f, "explore", step)
            exps += e
            for k, v in c.items():
                counters[k] = counters.get(k, 0) + v
        # groups of this step: explorers return whole groups, one after another
        groups = {}
        for e in exps:
            groups.setdefault(e.group_id, []).append(e)
        m = rollout_metrics(exps, list(groups.values()), counters, counters.get("explore_s", 0.0) / max(len(futures), 1))
        m["timing/rollout_s"] = time.perf_counter() - t0
        # per explorer (they run side by side)
        for k in ("reward_s", "generate_s"):
            m[f"timing/{k}"] = counters.get(k, 0.0) / max(len(futures), 1)
        for k in ("explore_s", "reward_s", "workflow_s", "generate_s"):
            m.pop(f"rollout/{k}", None)
        self.explore_metrics[step] = m
        if exps:
            self.buffer.put(exps)

    def _explorer_result(self, i: int, future, method: str, *args):
        """The result of explorer i's call; if its process died, Ray restarts it and the call is redone."""
        for attempt in range(self.cfg.cluster.max_actor_restarts + 1):
            try:
                return self.explorers[i].get(future)
            except Exception as e:
                if not _actor_died(e) or attempt == self.cfg.cluster.max_actor_restarts:
                    raise
                self._revive(i, e)
                future = self.explorers[i].submit(method, *args)

    def _revive(self, i: int, error: Exception) -> None:
        explorer = self.explorers[i]
        self.monitor.print(f"[{self.title}] {explorer.name} died ({type(error).__name__}); waiting for Ray to restart it")
        deadline = time.monotonic() + 300
        while True:
            try:
                pid = explorer.call("ping")
                break
            except Exception as e:
                if not _actor_died(e) or time.monotonic() > deadline:
                    raise RunError(f"{explorer.name} died and did not come back within 300 s ({e}).") from e
                time.sleep(1.0)
        if self.trainer is not None:
            # it restarted on the stage's starting weights: give it the trainer's current ones
            version = self.trainer.call("get_version")
            if hasattr(self.sync, "reset"):
                self.sync.reset(self.trainer, self.explorers)
                self.sync(self.trainer, self.explorers, version)
            else:
                self.sync(self.trainer, [explorer], version)
        else:
            self._pick_up_checkpoint([explorer], force=True)
        self.monitor.print(f"[{self.title}] {explorer.name} is back (process {pid}); redoing its work")

    def _evaluate(self, step: int) -> dict:
        t0 = time.perf_counter()
        metrics = self._explorer_result(0, self.explorers[0].submit("evaluate", step), "evaluate", step)
        metrics["timing/eval_s"] = time.perf_counter() - t0
        if "eval/accuracy" in metrics:
            self.monitor.print(f"[{self.title}] step {step}: eval accuracy {metrics['eval/accuracy']:.3f}")
        return metrics

    def _pick_up_checkpoint(self, explorers, force: bool = False) -> None:
        """mode=explore: serve the newest checkpoint under synchronizer.checkpoint_dir, if it is new."""
        ckpt_dir = self.cfg.synchronizer.checkpoint_dir
        if not ckpt_dir:
            return
        ckpt_dir = Path(os.path.expanduser(ckpt_dir))
        # the train-mode run's stage directory, or the checkpoints/ directory in it
        newest = latest_checkpoint(ckpt_dir.parent if ckpt_dir.name == "checkpoints" else ckpt_dir)
        if newest is None or (newest.step <= self.synced and not force) or not newest.hf_path.exists():
            return
        for e in explorers:
            e.call("load_weights", str(newest.hf_path), newest.step, newest.state.get("fingerprint"))
        self.synced = newest.step
        log.info("explorers now serve checkpoint step %d", newest.step)

    # ------------------------------------------------------------------ trainer

    def _trainer(self, method: str, *args):
        try:
            return self.trainer.call(method, *args)
        except Exception as e:
            if not _actor_died(e):
                raise
            latest = latest_checkpoint(self.dir)
            where = f"step {latest.step} ({latest.path})" if latest else "none yet (the stage restarts from its beginning)"
            raise RunError(
                f"the trainer actor died ({type(e).__name__}). Its newest checkpoint: {where}. "
                f"Run the same command again to resume from it."
            ) from e

    def _read_batch(self, step: int, produced: int | None) -> tuple[list, dict]:
        """This step's experiences, without those staler than synchronizer.max_staleness.

        `produced`: in mode=both, how many the explorers made for this step (fewer than planned
        when tasks failed), so the read never waits for experiences that will not come.
        """
        if self.source is not None:
            return self.source.batch(step - 1, self.plan.experiences_per_step), {}
        if produced == 0:
            return [], {}
        eb = self.cfg.buffer.trainer_input.experience_buffer
        batch = self.buffer.get(produced or self.plan.experiences_per_step, eb.max_read_timeout)
        # staleness: trainer steps between the weights that generated an experience and the
        # weights about to learn from it (step - 1 of them are trained so far)
        stale = [step - 1 - e.policy_version for e in batch]
        bound = self.cfg.synchronizer.max_staleness
        kept = [e for e, s in zip(batch, stale) if bound is None or s <= bound]
        m = {"staleness/mean": sum(stale) / len(stale), "staleness/max": max(stale),
             "staleness/dropped": len(batch) - len(kept)}
        for s in sorted(set(stale)):
            m[f"staleness/count_{s}"] = stale.count(s)
        self.monitor.histogram(step, "staleness", stale)
        return kept, m

    # ------------------------------------------------------------------ the loop

    def loop(self) -> None:
        cfg, plan, sc = self.cfg, self.plan, self.cfg.synchronizer
        offset = sc.sync_offset if cfg.mode == "both" else 0
        if self.explorers and self.start == 0 and cfg.explorer.eval_on_startup and cfg.mode != "explore":
            self.monitor.log(0, self._evaluate(0), advance=False)
        if cfg.mode == "explore":
            self._pick_up_checkpoint(self.explorers, force=True)
        for step in range(self.start + 1, plan.total_steps + 1):
            t_step = time.perf_counter()
            metrics: dict = {}
            if self.explores:
                # keep the explorers `offset` steps ahead of the trainer
                while self.next_explore <= min(step - 1 + offset, plan.total_steps - 1):
                    self._submit_explore(self.next_explore)
                    self.next_explore += 1
                t0 = time.perf_counter()
                while self.pending and self.pending[0][0] <= step - 1:
                    self._collect()
                metrics["timing/wait_rollout_s"] = time.perf_counter() - t0
                metrics.update(self.explore_metrics.pop(step - 1, {}))
            if self.trains:
                if self.explores:
                    self._awake(False)
                t0 = time.perf_counter()
                batch, m = self._read_batch(step, metrics.get("rollout/experiences"))
                metrics.update(m)
                metrics["timing/read_s"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                if batch:
                    metrics.update(self._trainer("train_step", batch))
                    self.monitor.record_batch(step, batch)
                else:
                    self._trainer("skip_step")
                metrics["timing/train_s"] = time.perf_counter() - t0

            last = step == plan.total_steps
            want_eval = bool(self.explorers) and cfg.mode != "explore" and (step % cfg.explorer.eval_interval == 0 or last)
            # mode=explore saves its place every step (a small state.json): a resumed explorer
            # writes again at most the step it was killed in
            want_save = step % cfg.trainer.save_interval == 0 or last or cfg.mode == "explore"
            if cfg.mode == "explore":
                if step % sc.sync_interval == 0:
                    self._pick_up_checkpoint(self.explorers)
            # an eval needs the explorer on the trainer's weights; so does a checkpoint, for a
            # resumed run to explore from the weights an uninterrupted one would have
            elif self.trainer is not None and self.explorers and (
                want_eval or (self.explores and (step % sc.sync_interval == 0 or want_save))
            ):
                t0 = time.perf_counter()
                self._sync_all(step)
                metrics["timing/sync_s"] = time.perf_counter() - t0
            metrics["sync/version"] = self.synced
            metrics["timing/step_s"] = time.perf_counter() - t_step
            if want_eval:
                metrics.update(self._evaluate(step))
            if want_save:
                t0 = time.perf_counter()
                self._save(step)
                metrics["timing/save_s"] = time.perf_counter() - t0
            self.monitor.log(step, metrics)

    def _sync_all(self, version: int) -> None:
        self._awake(True)
        for attempt in range(self.cfg.cluster.max_actor_restarts + 1):
            try:
                self.sync(self.trainer, self.explorers, version)
                break
            except Exception as e:
                if not _actor_died(e) or attempt == self.cfg.cluster.max_actor_restarts:
                    raise
                for i, explorer in enumerate(self.explorers):
                    try:
                        explorer.call("ping")
                    except Exception as dead:
                        self._revive(i, dead)
        self.synced = version

    def _save(self, step: int) -> None:
        """A checkpoint: the trainer (if any), then state.json, written last, with the buffer state."""
        # explores started ahead are finished and kept: a resumed run trains on them, not on new ones
        while self.pending:
            self._collect()
        final = self.dir / "checkpoints" / f"step_{step}"
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        state = {"step": step, "version": self.synced, "next_explore": self.next_explore,
                 "explore_metrics": self.explore_metrics}
        if self.trainer is not None:
            self._trainer("save", str(tmp))
            state["fingerprint"] = self._trainer("fingerprint")
        if self.buffer is not None:
            state["buffer"] = self.buffer.state()
        (tmp / "state.json").write_text(json.dumps(state))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        if self.trainer is None:  # an explorer's place: only the newest matters
            for old in list_checkpoints(self.dir)[:-1]:
                shutil.rmtree(old.path, ignore_errors=True)

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
        if self.cfg.monitor.enable_ray_timeline and self.cfg.cluster.backend == "ray":
            import ray

            (self.dir / "monitor").mkdir(exist_ok=True)
            ray.timeline(filename=str(self.dir / "monitor" / "timeline.json"))
        for actor in (self.trainer, *self.explorers):
            if actor is not None:
                try:
                    actor.kill()
                except Exception:
                    pass
        if self.buffer is not None:
            self.buffer.close()
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
