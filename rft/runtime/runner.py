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

import gc
import logging
import os
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from omegaconf import open_dict

from rft.algorithms.off_policy import staleness
from rft.data.buffer import make_buffer
from rft.data.experience import batch_record
from rft.errors import RunError
from rft.plan.placement import torch_threads
from rft.reporting.monitor import Monitor, read_metrics
from rft.rewards import scoring
from rft.rewards.scoring import describe as describe_reward
from rft.rewards.scoring import spec_of
from rft.rollout.explorer import step_metrics
from rft.runtime import checkpoint
from rft.runtime.actors import ACTOR_BACKENDS, long_lived, start_explorers, start_trainer
from rft.runtime.checkpoint import Checkpoint, Owner, latest_checkpoint, served_checkpoint, set_aside, usable_checkpoint
from rft.sync.weights import SYNC_METHODS
from rft.sync.weights import wait as wait_for

log = logging.getLogger(__name__)


def _actor_died(e: Exception) -> bool:
    # without Ray imported no Ray actor ran (cluster=inline): importing it here, on an error of a
    # run in one process, would cost ~50 MB and set up Ray's logging for nothing
    exceptions = sys.modules.get("ray.exceptions")
    return exceptions is not None and isinstance(e, exceptions.RayActorError)


def run_stage(cfg, plan, stage_dir: Path, init_path: str | None, title: str, owner: Owner) -> Path | None:
    """Run one stage to its last step; returns its final HF-format model's directory (None for a
    stage that trains nothing: mode=explore). `owner`: the identity its checkpoints carry, and the
    one those it resumes from must have (rft.runtime.checkpoint)."""
    stage_dir.mkdir(parents=True, exist_ok=True)
    trains = cfg.mode in ("both", "train")
    if cfg.trainer.resume_from_path:
        latest = checkpoint.chosen_checkpoint(stage_dir, cfg.trainer.resume_from_path, owner, title, print)
    else:
        latest = usable_checkpoint(stage_dir, owner, title, print) if cfg.continue_from_checkpoint else None
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


@dataclass
class Pending:
    """An explore step submitted to the explorers, with the weights version they serve for it."""
    step: int
    futures: list
    version: int
    t0: float


def culprit(inp, ts, source: str | None) -> tuple[str, str]:
    """(what failed, its fix) when every task of taskset `ts` failed: the reward function, or,
    when the workflow's own jobs failed (`source`), the environment (multi_turn) or the workflow."""
    if source == "workflow" and ts.workflow == "multi_turn":
        return f"environment {ts.workflow_args.get('env')!r} (workflow_args.env)", "Fix the environment (its constructor, reset or step)"
    if source == "workflow":
        return f"workflow {ts.workflow!r}, in the jobs it ran", "Fix the workflow"
    reward = describe_reward(spec_of(ts.reward_fn, inp.default_reward_fn_type))
    return f"reward function {reward!r}", "Fix the reward function"


class StageRun:
    def __init__(self, cfg, plan, stage_dir: Path, init_path, title: str, latest: Checkpoint | None, owner: Owner):
        self.cfg, self.plan, self.dir, self.title = cfg, plan, stage_dir, title
        self.init_path, self.owner = init_path, owner
        self.not_served: set = set()  # mode=explore: the damaged checkpoints of the train run, named once
        self.trainer, self.explorers, self.pg, self.buffer = None, [], None, None
        self.unfinished_sync = None  # (version, the sync's pairs) while explorers may be loading it
        self.monitor = None
        try:
            self._start(latest)
        except BaseException:
            self.close()  # what started before the error: actors, the buffer's file, the placement
            raise

    def _start(self, latest: Checkpoint | None) -> None:
        cfg, mode = self.cfg, self.cfg.mode
        self.explores = mode in ("both", "explore")
        self.trains = mode in ("both", "train")
        self._default_buffer_path()  # before any actor gets its copy of the config
        Actor = ACTOR_BACKENDS[cfg.cluster.backend]
        common = dict(log_dir=str(self.dir / "log"), level=cfg.log.level, threads=torch_threads(cfg))
        options = self._placement()
        if self.trains:
            # the trainer starts from the stage's starting model (its reference model, if any,
            # must be that one), then a resumed run loads the checkpoint over it
            ranks = [options.pop(0) for _ in range(self.plan.dp_size)]
            self.trainer = start_trainer(Actor, cfg, self.plan, self.init_path, f"{self.title}_{cfg.trainer.name}",
                                         common, ranks)
            latest = self._load(latest)
        self.start = latest.step if latest else 0
        saved = latest.state if latest else {}
        # reward models on workers of their own (rft/rewards/reward_model.py), found by name by the
        # explorers' reward clients; with cluster=inline none: each client builds its own
        from rft.runtime.actors import start_reward_models, wait_reward_models

        self.reward_models = start_reward_models(Actor, cfg, common, options)
        # mode=train still evaluates with an explorer when there are eval tasksets (plan.explorers)
        resumed = latest is not None and latest.hf_path.exists()
        self.explorers = start_explorers(Actor, cfg, self.plan.explorers, str(latest.hf_path) if resumed else self.init_path,
                                         self.start if resumed else 0, self.title, common, options)
        wait_reward_models(self.reward_models)  # a model that does not load: a ConfigError naming it
        # prompts (and a training dataset's responses) past the token budgets, checked where the
        # tokenizers are: the explorer's tasksets, the trainer's dataset
        checkers = self.explorers[:1] + ([self.trainer] if self.trainer is not None else [])
        for text in (t for actor in checkers for t in actor.call("token_budget_warnings")):
            print(f"rft: warning: stage {self.title}: {text}", flush=True)
        self._open_input(saved, latest)
        self.sync = SYNC_METHODS[cfg.synchronizer.sync_method](self.dir, cfg.synchronizer)
        self._schedule_state(saved)
        self.monitor = Monitor(cfg, self.dir, self.plan.total_steps, self.start, self.title)
        if self.start:
            self.monitor.ensure_logged(self.start, saved.get("metrics"))
        if mode == "explore":
            eb = cfg.buffer.trainer_input.experience_buffer
            self.monitor.print(f"[{self.title}] experiences go to {eb.path} (view them: python -m rft.data.buffer {eb.path})")
        if self.start:
            self.monitor.print(f"[{self.title}] resuming from step {self.start} ({latest.path})")
        if self.start and self.trains and self.explorers and not resumed:
            # a LoRA checkpoint without hf/ (trainer.save_hf_checkpoint): the explorers started from
            # the stage's starting model; the trainer gives them the resumed weights, as hf/ would
            synced = self.synced
            self._sync_all(self.start)
            self.synced = synced

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
            self._restore_buffer(saved.get("buffer"), latest)

    def _schedule_state(self, saved: dict) -> None:
        """Where the schedule stands: a fresh stage, or what the checkpoint saved."""
        cfg, sc = self.cfg, self.cfg.synchronizer
        # the version the explorers serve (mode=explore: what it picks up; see loop)
        self.synced = 0 if cfg.mode == "explore" else saved.get("version", self.start)
        self.next_explore = saved.get("next_explore", self.start)
        self.pending: deque[Pending] = deque()
        self.asleep = False
        self.explore_metrics = {int(k): v for k, v in saved.get("explore_metrics", {}).items()}
        inp = cfg.buffer.explorer_input
        parts = scoring.entries(scoring.spec_of(inp.taskset.reward_fn, inp.default_reward_fn_type),
                                "buffer.explorer_input.taskset.reward_fn")
        self.reward_norm = scoring.RunningNorm({e["name"]: e["weight"] for e in parts},
                                               [e["name"] for e in parts if e["normalize"]])
        self.reward_norm.load(saved.get("reward_norm"))
        # steps in a row in which every task failed (explorer.max_failed_steps stops the run)
        self.failed_steps = 0
        self.first_rewards: set = set()  # the rewards of the first steps (all equal: a warning)
        # weights snapshots for restarted explorers (see _serve); not needed when the explorers
        # always serve the trainer's current weights, nor when nothing can restart
        self.snapshots = (cfg.mode == "both" and cfg.cluster.backend == "ray" and cfg.cluster.max_actor_restarts > 0
                          and (sc.sync_offset > 0 or sc.sync_interval > 1))

    def _load(self, latest: Checkpoint | None) -> Checkpoint | None:
        """Load the newest whole checkpoint into the trainer; a trainer_state.pt that does not load
        sets that checkpoint aside and the one before is tried (None: start from the beginning)."""
        while latest is not None:
            try:
                self.trainer.call("load", str(latest.path))
                log.info("resumed %s from %s", self.title, latest.path)
                return latest
            except Exception as e:
                if _actor_died(e):
                    raise
                cause = getattr(e, "cause", e)
                # a refused pickle says why itself (rft.trainer.state.load_state: it would run code)
                why = (str(cause).split(". ")[0] if type(cause).__name__ == "UnpicklingError" and "is refused" in str(cause)
                       else f"{latest.path / 'trainer_state.pt'} does not load: {type(cause).__name__}")
                set_aside(latest, why, self.title, print)
                latest = usable_checkpoint(self.dir, self.owner, self.title, print, before=latest.step)
        return None

    def _restore_buffer(self, state: dict | None, latest: Checkpoint | None) -> None:
        """Put the buffer back where the checkpoint left it, and make sure it still holds what the
        checkpoint counts on: the experiences explored ahead and not yet read."""
        eb = self.cfg.buffer.trainer_input.experience_buffer
        if self.cfg.mode == "both" and hasattr(self.buffer, "truncate_after"):
            # this run is the only writer: what it wrote after its checkpoint (or, with no
            # checkpoint, at all) is written again, identically
            dropped = self.buffer.truncate_after(state["last_id"] if state else 0)
            if dropped:
                log.info("dropped %d experiences written after the checkpoint", dropped)
            if state and self.buffer.state()["last_id"] < state["last_id"]:
                # the file was deleted, replaced or cut since the checkpoint
                if state.get("cursor", state.get("offset")) != state["last_id"]:
                    raise RunError(
                        f"the buffer {eb.path} no longer holds the experiences checkpoint step "
                        f"{latest.step} explored ahead and had not trained on yet (it was deleted, "
                        f"replaced or cut since). Put the file back, or start this stage again "
                        f"(continue_from_checkpoint=false)."
                    )
                print(f"[{self.title}] the buffer {eb.path} was deleted or cut since the checkpoint; "
                      f"nothing in it was still to be read, so the run goes on")
                state = self.buffer.state()  # read from its (new) end
                state = {**state, "cursor": state["last_id"], "offset": state["last_id"]}
        if state:
            self.buffer.restore(state)
        elif eb.storage_type == "sql":
            self.buffer.restore({"cursor": 0})  # a fresh run reads from the start

    def _placement(self) -> list[dict]:
        if self.cfg.cluster.backend != "ray":
            return [{}] * (self.plan.dp_size + self.plan.explorers)
        from rft.runtime.actors import placement_for

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
        futures = [e.submit("explore", step) for e in self.explorers]
        self.pending.append(Pending(step, futures, self.synced, time.perf_counter()))

    def _collect(self) -> None:
        """Wait for the oldest explore step; its experiences go into the buffer."""
        self._finish_sync()  # an explore after a failed sync ran on the old weights: it must not count
        p = self.pending.popleft()
        exps, counters, last_error = [], {}, None
        for i, f in enumerate(p.futures):
            e, c = self._explorer_result(i, f, "explore", p.step, version=p.version)
            exps += e
            last_error = c.pop("last_error", None) or last_error
            for k, v in c.items():
                counters[k] = counters.get(k, 0) + v
        m = step_metrics(exps, counters, len(p.futures))
        # parts marked normalize: true (rft/rewards/scoring.py), in step order: a resumed run normalises the same
        m.update(self.reward_norm.apply(exps))
        m["timing/rollout_s"] = time.perf_counter() - p.t0
        self.explore_metrics[p.step] = m
        self._check_signal(p.step, m, last_error)
        if exps:
            self.buffer.put(exps)

    def _resume_point(self) -> str:
        """The checkpoint a rerun of the same command resumes from, for a message."""
        latest = latest_checkpoint(self.dir)
        return f"step {latest.step} ({latest.path})" if latest else "none yet"

    def _check_signal(self, step: int, m: dict, last_error: tuple | None) -> None:
        """A run that cannot learn must not run to the end and exit 0: stop after
        explorer.max_failed_steps steps in a row in which every task failed (or after every step of
        a run shorter than that); warn loudly when every reward of the first steps is the same (no
        advantage, no learning)."""
        cfg, inp = self.cfg, self.cfg.buffer.explorer_input
        if m["rollout/experiences"] == 0 and m.get("rollout/failed_tasks", 0) > 0:
            self.failed_steps += 1
        else:
            self.failed_steps = 0
        # a run of fewer steps than max_failed_steps whose every step failed trained on nothing:
        # it must not save the unchanged model and exit 0
        limit = min(cfg.explorer.max_failed_steps, self.plan.total_steps - self.start)
        if limit > 0 and self.failed_steps >= limit:
            source, last = last_error or (None, None)
            what, fix = culprit(inp, inp.taskset, source)
            raise RunError(
                f"every task of the last {self.failed_steps} steps failed ({what}: "
                f"{m.get('rollout/errors', 0)} errors and {m.get('rollout/timeouts', 0)} timeouts in the "
                f"last step; the last error: {last or 'none recorded (timeouts)'}), so nothing "
                f"can be learned. Each explorer's log in {self.dir / 'log'} has the details. {fix} "
                f"(or raise explorer.max_timeout if it is only slow), then run the same "
                f"command again to resume from the newest checkpoint: {self._resume_point()}. "
                f"explorer.max_failed_steps={cfg.explorer.max_failed_steps} sets how many such steps stop a "
                f"run (0: never)."
            )
        first = min(3, self.plan.total_steps)
        if self.start == 0 and step < first and m["rollout/experiences"]:
            self.first_rewards.update({m["reward/min"], m["reward/max"]})
            if step == first - 1 and len(self.first_rewards) == 1:
                value = self.first_rewards.pop()
                msg = (f"[{self.title}] WARNING: every reward of the first {first} steps was {value:g}: the "
                       f"advantages are all 0 and nothing is learned. Check the "
                       f"{'environment' if inp.taskset.workflow == 'multi_turn' else 'reward function'} "
                       f"({scoring.source(inp.taskset, inp.default_reward_fn_type)!r}) "
                       f"and that buffer.explorer_input.taskset.format.response_key="
                       f"{inp.taskset.format.response_key!r} names the column of reference answers "
                       f"(task.answer).")
                self.monitor.print(msg)

    def _explorer_result(self, i: int, future, method: str, *args, version: int | None = None):
        """The result of explorer i's call. If its process died, Ray restarts it and the call is
        redone, on the weights the schedule gave it (`version`: the version the explorers served
        when the call was made; an explore made before a sync is redone on the older weights)."""
        for attempt in range(self.cfg.cluster.max_actor_restarts + 1):
            try:
                return self.explorers[i].get(future)
            except Exception as e:
                if not _actor_died(e) or attempt == self.cfg.cluster.max_actor_restarts:
                    raise
                self._revive(i, e)
                redo_on = version if version is not None and self.trainer is not None else self.synced
                if redo_on != self.synced:
                    self._serve(i, redo_on)
                future = self.explorers[i].submit(method, *args)
                if redo_on != self.synced:
                    self._serve(i, self.synced)  # calls run in order: the explore uses redo_on

    def _revive(self, i: int, error: Exception, serve: bool = True) -> None:
        """Wait for Ray to restart explorer i, then give it the weights the explorers serve now
        (serve=False: the caller is about to sync every explorer anyway)."""
        explorer = self.explorers[i]
        self.monitor.print(f"[{self.title}] {explorer.name} died ({type(error).__name__}); waiting for Ray to restart it")
        deadline = time.monotonic() + self.cfg.explorer.restart_timeout
        while True:
            try:
                pid = explorer.call("ping")
                break
            except Exception as e:
                if not _actor_died(e) or time.monotonic() > deadline:
                    raise RunError(
                        f"{explorer.name} died and did not come back within explorer.restart_timeout="
                        f"{self.cfg.explorer.restart_timeout:g} s ({e})."
                    ) from e
                time.sleep(1.0)
        if self.trainer is not None:
            # it restarted on the stage's starting weights
            if hasattr(self.sync, "reset"):
                self.sync.reset(self.trainer, self.explorers)  # the old group lost a member
            if serve:
                self._serve(i, self.synced)
        else:
            self._pick_up_checkpoint([explorer], force=True)
        self.monitor.print(f"[{self.title}] {explorer.name} is back (process {pid}); redoing its work")

    def _serve(self, i: int, version: int) -> None:
        """Explorer i gets the weights of `version`: the trainer's own if it is at that version,
        else the snapshot it kept (an explorer restarted while the trainer was ahead)."""
        explorer = self.explorers[i]
        if version == self._trainer("get_version"):
            weights, expected = self.trainer.submit("weights"), self._trainer("fingerprint")
        else:
            weights, expected = self.trainer.submit("snapshot_weights", version), self._trainer("snapshot_fingerprint", version)
        explorer.get(explorer.submit("update_weights", weights, version, expected))

    def _snapshots_kept(self) -> tuple[int, list[int]]:
        """With the explorers behind the trainer (sync_offset > 0 or sync_interval > 1), the trainer
        keeps the weights they serve, and those pending explores were made on, for a restart: the
        trainer's keep_snapshots arguments."""
        return self.synced, sorted({self.synced, *(p.version for p in self.pending)})

    def _evaluate(self, step: int) -> dict:
        t0 = time.perf_counter()
        self._finish_sync()  # the eval is of the weights just synced: the explorers must hold them
        metrics = self._explorer_result(0, self.explorers[0].submit("evaluate", step, str(self.dir / "eval_trajectories")), "evaluate", step)
        metrics["timing/eval_s"] = time.perf_counter() - t0
        failed = metrics.pop("eval_failed", None)
        if failed and self.cfg.explorer.max_failed_steps:
            # a reward that fails on every eval task fails on every training task too: say so now,
            # not after a stage (an SFT warm-up) trained to its end with evals of 0
            i, last, source = failed
            ts = self.cfg.buffer.explorer_input.eval_tasksets[i]
            what, fix = culprit(self.cfg.buffer.explorer_input, ts, source)
            raise RunError(
                f"every task of the eval set buffer.explorer_input.eval_tasksets[{i}] ({ts.name}) failed at "
                f"step {step} (the last error: {last}; from its {what}), so the eval measures nothing. Each "
                f"explorer's log in {self.dir / 'log'} has the details. {fix} (or raise explorer.max_timeout "
                f"if it is only slow), then run the same command again to resume from the newest checkpoint: "
                f"{self._resume_point()}. explorer.max_failed_steps=0 lets a run go on regardless."
            )
        if "eval/accuracy" in metrics:
            failed = metrics.get("eval/failed_tasks", 0)
            note = f" ({failed} eval tasks failed and count as 0; see {self.dir / 'log'})" if failed else ""
            self.monitor.print(f"[{self.title}] step {step}: eval accuracy {metrics['eval/accuracy']:.3f}{note}")
        return metrics

    def _pick_up_checkpoint(self, explorers, force: bool = False) -> None:
        """mode=explore: serve the newest checkpoint under synchronizer.checkpoint_dir, if it is new."""
        ckpt_dir = self.cfg.synchronizer.checkpoint_dir
        if not ckpt_dir:
            return
        ckpt_dir = Path(os.path.expanduser(ckpt_dir))
        # the train-mode run's stage directory, or the checkpoints/ directory in it
        newest = served_checkpoint(ckpt_dir.parent if ckpt_dir.name == "checkpoints" else ckpt_dir, self.owner,
                                   -1 if force else self.synced, self.not_served, self.title, self.monitor.print)
        if newest is None:
            return
        for e in explorers:
            e.call("load_weights", str(newest.hf_path), newest.step, newest.state.get("fingerprint"))
        self.synced = newest.step
        log.info("explorers now serve checkpoint step %d", newest.step)

    # ------------------------------------------------------------------ trainer

    def _trainer(self, method: str, *args):
        return self._trainer_result(self.trainer.submit(method, *args))

    def _trainer_result(self, future):
        try:
            return self.trainer.get(future)
        except Exception as e:
            if not _actor_died(e):
                raise
            raise self._trainer_died(e) from e

    def _trainer_died(self, e: Exception) -> RunError:
        latest = latest_checkpoint(self.dir)
        where = f"step {latest.step} ({latest.path})" if latest else "none yet (the stage restarts from its beginning)"
        return RunError(f"the trainer actor died ({type(e).__name__}). Its newest checkpoint: {where}. "
                        f"Run the same command again to resume from it.")

    def _read_batch(self, step: int, produced: int | None) -> tuple[list, dict]:
        """This step's experiences, without those staler than synchronizer.max_staleness.

        `produced`: in mode=both, how many the explorers made for this step (fewer than planned
        when tasks failed), so the read never waits for experiences that will not come.
        """
        if produced == 0:
            return [], {}
        eb = self.cfg.buffer.trainer_input.experience_buffer
        batch = self.buffer.get(produced or self.plan.experiences_per_step, eb.max_read_timeout)
        # step - 1 trainer steps are trained so far: the version about to learn from them
        stale = [staleness(e.policy_version, step - 1) for e in batch]
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
        cfg = self.cfg
        if self.explorers and self.start == 0 and cfg.explorer.eval_on_startup and cfg.mode != "explore":
            self.monitor.log(0, self._evaluate(0), advance=False)
        if cfg.mode == "explore":
            self._pick_up_checkpoint(self.explorers, force=True)
        if self.snapshots:
            self._trainer("keep_snapshots", *self._snapshots_kept())
        for step in range(self.start + 1, self.plan.total_steps + 1):
            t_step = time.perf_counter()
            metrics: dict = {}
            if self.explores:
                metrics.update(self._explore_until(step))
            if self.trains:
                metrics.update(self._train(step, metrics.get("rollout/experiences")))
            self._end_step(step, metrics, t_step)

    def _submit_explores(self, step: int) -> None:
        """Submit the explore steps due by training step `step`: synchronizer.sync_offset ahead."""
        offset = self.cfg.synchronizer.sync_offset if self.cfg.mode == "both" else 0
        while self.next_explore <= min(step - 1 + offset, self.plan.total_steps - 1):
            self._submit_explore(self.next_explore)
            self.next_explore += 1

    def _explore_until(self, step: int) -> dict:
        """Keep the explorers synchronizer.sync_offset steps ahead of the trainer; wait for the
        explore step this training step learns from (step - 1); its metrics."""
        self._submit_explores(step)
        t0 = time.perf_counter()
        while self.pending and self.pending[0].step <= step - 1:
            self._collect()
        return {"timing/wait_rollout_s": time.perf_counter() - t0, **self.explore_metrics.pop(step - 1, {})}

    def _train(self, step: int, produced: int | None) -> dict:
        self._finish_sync()  # a dead explorer is synced again to the weights the trainer has now
        if self.explores:
            self._awake(False)
        if self.plan.input_kind == "dataset":
            t0 = time.perf_counter()
            metrics, record = self._trainer("train_dataset_step", step, self.plan.experiences_per_step)
            metrics["timing/train_s"] = time.perf_counter() - t0
            self.monitor.record_batch(record)
            return metrics
        t0 = time.perf_counter()
        batch, metrics = self._read_batch(step, produced)
        metrics["timing/read_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        future = self.trainer.submit("train_step" if batch else "skip_step", *([batch] if batch else []))
        if self._syncs_at(step) and self.sync_behind_step:
            # queued behind the step on each actor: the trainer hands over its new weights, the
            # explorers load them and explore the next step, without waiting for the driver to take
            # this step's result first (~2 ms a synchronous step, experiments/trl_comparison)
            t1 = time.perf_counter()
            self._sync_all(step)
            metrics["timing/sync_s"] = time.perf_counter() - t1
            # not before an eval (it would wait behind that explore) or a checkpoint (it would
            # wait to keep that explore's experiences)
            if not (self._wants_eval(step) or self._wants_save(step)):
                self._submit_explores(step + 1)
        result = self._trainer_result(future)
        if batch:
            metrics.update(result)
            self.monitor.record_batch(batch_record(step, batch))
        metrics["timing/train_s"] = time.perf_counter() - t0 - metrics.get("timing/sync_s", 0.0)  # each once
        return metrics

    def _end_step(self, step: int, metrics: dict, t_step: float) -> None:
        """Sync, evaluate and save when the schedule says so, then log the step."""
        cfg = self.cfg
        want_eval, want_save = self._wants_eval(step), self._wants_save(step)
        if cfg.mode == "explore":
            if step % cfg.synchronizer.sync_interval == 0:
                self._pick_up_checkpoint(self.explorers)
        elif self._syncs_at(step) and self.synced != step:  # not started by _train already
            t0 = time.perf_counter()
            self._sync_all(step)
            # starting it: the explorers load the weights while the driver goes on, and the driver's
            # wait for them, if any, counts where it waits (timing/wait_rollout_s, mostly)
            metrics["timing/sync_s"] = time.perf_counter() - t0
        metrics["sync/version"] = self.synced
        metrics["timing/step_s"] = time.perf_counter() - t_step
        if want_eval:
            metrics.update(self._evaluate(step))
        if want_save:
            t0 = time.perf_counter()
            self._save(step, metrics)
            metrics["timing/save_s"] = time.perf_counter() - t0
        self.monitor.log(step, metrics)

    def _wants_eval(self, step: int) -> bool:
        cfg = self.cfg
        return bool(self.explorers) and cfg.mode != "explore" and (step % cfg.explorer.eval_interval == 0
                                                                   or step == self.plan.total_steps)

    def _wants_save(self, step: int) -> bool:
        # mode=explore saves its place every step (a small state.json): a resumed explorer
        # writes again at most the step it was killed in
        cfg = self.cfg
        return step % cfg.trainer.save_interval == 0 or step == self.plan.total_steps or cfg.mode == "explore"

    @property
    def sync_behind_step(self) -> bool:
        """Whether a sync is queued on the actors behind the train step it follows (`_train`): with
        Ray actors (in one process a call runs when it is made) whose engines stay awake while the
        trainer trains (sleep mode gives the trainer the GPU until the sync)."""
        return self.cfg.cluster.backend == "ray" and not self.cfg.explorer.rollout_model.enable_sleep_mode

    def _syncs_at(self, step: int) -> bool:
        """Whether the explorers get the trainer's weights after training step `step`: every
        synchronizer.sync_interval steps; before an eval, which is of the trainer's weights; and
        before a checkpoint, for a resumed run to explore from the weights an uninterrupted one would."""
        return (self.trainer is not None and bool(self.explorers) and self.cfg.mode != "explore" and (
            self._wants_eval(step)
            or (self.explores and (step % self.cfg.synchronizer.sync_interval == 0 or self._wants_save(step)))))

    def _sync_all(self, version: int) -> None:
        """Start the sync of every explorer to the trainer's weights, `version`: the driver goes on
        while they load them (`_finish_sync` waits, before the driver next needs an explorer's
        result or the trainer moves on). Waiting here took ~5 ms of each step of the default study,
        where the trainer is the longer half: 43 -> 39 ms a step (experiments/trl_comparison)."""
        self._finish_sync()
        self._awake(True)
        pairs = self._synced_to(version, None, wait=False)
        self.synced = version
        if self.snapshots:  # waited for with the sync: the trainer may still be in the step it follows
            pairs.append((self.trainer, self.trainer.submit("keep_snapshots", *self._snapshots_kept())))
        self.unfinished_sync = (version, pairs)

    def _finish_sync(self) -> None:
        """Wait for the explorers' side of the sync `_sync_all` started (a check that failed, or a
        sync_timeout passed, raises here; a dead explorer is restarted and synced again)."""
        if self.unfinished_sync is not None:
            (version, pairs), self.unfinished_sync = self.unfinished_sync, None
            self._synced_to(version, pairs, wait=True)

    def _synced_to(self, version: int, pairs: list | None, wait: bool) -> list:
        """The sync method's (actor, future) pairs for `version`: `pairs` if given, else a new sync's;
        waited for if `wait`. An explorer that died on the way is restarted and the sync made again."""
        for attempt in range(self.cfg.cluster.max_actor_restarts + 1):
            try:
                if pairs is None:
                    pairs = self.sync(self.trainer, self.explorers, version)
                if wait:
                    wait_for(pairs, self.cfg.synchronizer.sync_timeout)
                return pairs
            except Exception as e:
                pairs = None
                if not _actor_died(e):
                    raise
                revived = False
                for i, explorer in enumerate(self.explorers):
                    try:
                        explorer.call("ping")
                    except Exception as dead:
                        if attempt == self.cfg.cluster.max_actor_restarts:
                            raise e from dead
                        self._revive(i, dead, serve=False)
                        revived = True
                if not revived:  # every explorer answers: the actor that died is the trainer
                    raise self._trainer_died(e) from e
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _save(self, step: int, metrics: dict) -> None:
        """A checkpoint: the trainer (if any), then state.json, written last, with the buffer state
        and the step's metrics (logged after the save: a kill between the two must not lose them)."""
        # explores started ahead are finished and kept: a resumed run trains on them, not on new ones
        self._finish_sync()
        while self.pending:
            self._collect()
        state = {"version": self.synced, "next_explore": self.next_explore,
                 "explore_metrics": self.explore_metrics, "metrics": metrics,
                 "reward_norm": self.reward_norm.state()}
        if self.buffer is not None:
            state["buffer"] = self.buffer.state()

        def save_trainer(tmp: Path) -> dict:
            # the parameters' fingerprint: what an explorer serving this checkpoint checks its load
            # against (the files themselves are checked by the manifest checkpoint.write adds)
            self._trainer("save", str(tmp), with_hf)
            out = {"fingerprint": self._trainer("fingerprint")}
            if self.cfg.model.lora.rank:  # the base the adapter goes on (python -m rft.runtime.export merges them)
                out["lora_base"] = os.path.abspath(os.path.expanduser(self.init_path or self.cfg.model.model_path))
            return out

        # LoRA (trainer.save_hf_checkpoint): the merged model in hf/ at every save, the last, or never
        when = self.cfg.trainer.save_hf_checkpoint
        with_hf = when == "always" or (when == "last" and step >= self.plan.total_steps)
        # an explorer's place (mode=explore): only the newest matters, its pruning not worth a line
        if self.trainer is None:
            checkpoint.write(self.dir, step, state, keep=1, owner=self.owner)
        else:
            checkpoint.write(self.dir, step, state, save_trainer, keep=self.cfg.trainer.max_ckpt_to_keep,
                             say=lambda m: self.monitor.print(f"[{self.title}] trainer.max_ckpt_to_keep: {m}"),
                             owner=self.owner)

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
        if self.cfg.monitor.enable_ray_timeline and self.cfg.cluster.backend == "ray":
            import ray

            (self.dir / "monitor").mkdir(exist_ok=True)
            ray.timeline(filename=str(self.dir / "monitor" / "timeline.json"))
        if self.trainer is not None and hasattr(getattr(self, "sync", None), "close"):
            try:
                self.sync.close(self.trainer)
            except Exception:  # a dead trainer: its resource tracker unlinks the segment
                pass
        for actor in (self.trainer, *self.explorers, *getattr(self, "reward_models", [])):
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
        gc.unfreeze()  # what the stage froze (rft.runtime.actors.long_lived) can be collected again
