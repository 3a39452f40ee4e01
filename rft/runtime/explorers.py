"""A stage's explorers, as the driver sees them: the actors, the weights they serve, and the explore
steps in flight (rft.runtime.schedule decides when each is started, synced or evaluated).

A sync is started and waited for later (`sync_all`, `finish_sync`), before the driver next needs
an explorer's result. An explorer whose process died is restarted by Ray and its work redone on
the weights the schedule gave it (`_result`, `_revive`, `_serve`), so a run with a restart makes
the experiences an uninterrupted one would.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from rft.config import fixed_policy
from rft.errors import RunError
from rft.runtime.checkpoint import Owner, not_served_yet, served_checkpoint, train_stage_dir
from rft.runtime.faults import TrainerCalls, actor_died, culprit, resume_point
from rft.sync.weights import wait as wait_for

log = logging.getLogger(__name__)


@dataclass
class Pending:
    """An explore step submitted to the explorers, with the weights version they serve for it."""
    step: int
    futures: list
    version: int
    t0: float
    # the task rows the online curriculum drew for it (rft/data/curriculum.py); None: the explorers' own
    rows: list | None = None
    # with `rows`: the (task id, passed) of its rollouts that left no experience (a failed task's), from all explorers
    unreturned: list = field(default_factory=list)

    @property
    def args(self) -> tuple:
        """The explore call's arguments (a restarted explorer's redo makes the same call)."""
        return (self.step,) if self.rows is None else (self.step, self.rows)


class ExplorerPool:
    """The explorer actors (started and killed by rft.runtime.runner.StageRun) and the weights they
    serve: `synced`, the version they serve (mode=explore: the checkpoint step they picked up)."""

    def __init__(self, cfg, explorers: list, trainer: TrainerCalls | None, sync, synced: int, monitor,
                 stage_dir: Path, title: str, owner: Owner):
        self.cfg, self.explorers, self.trainer, self.sync, self.monitor = cfg, explorers, trainer, sync, monitor
        self.dir, self.title, self.owner = stage_dir, title, owner
        self.synced = synced
        self.unfinished_sync = None  # (version, the sync's pairs) while explorers may be loading it
        self.pending: deque[Pending] = deque()
        self.asleep = False
        self.not_served: set = set()  # mode=explore: the damaged checkpoints of the train run, named once
        sc = cfg.synchronizer
        # weights snapshots for restarted explorers (see _serve); not needed when the explorers
        # always serve the trainer's current weights, nor when nothing can restart
        # synchronizer.sync_style=dynamic_by_explorer: an explore is made on whatever weights its
        # explorer picked up, and a redone one on the weights served now (no snapshots)
        self.dynamic = sc.sync_style == "dynamic_by_explorer"
        # algorithm.rm_pairs=groups: the explorers serve the stage's starting policy throughout (the
        # trainer's model is a reward model), which a restarted explorer loads again by itself
        self.fixed = fixed_policy(cfg)
        self.snapshots = (cfg.mode == "both" and not self.fixed and cfg.cluster.backend == "ray" and cfg.cluster.max_actor_restarts > 0
                          and (sc.sync_offset > 0 or sc.sync_interval > 1) and not self.dynamic)
        # explorer.partial_rollout: each explorer's groups in flight after its last collected
        # explore step (rft/rollout/partial.py), given back to it when Ray restarts it, and saved
        self.partial_states: list = [None] * len(explorers)

    def awake(self, awake: bool) -> None:
        """explorer.rollout_model.enable_sleep_mode: the engines give the GPU to the trainer while it trains."""
        if self.cfg.explorer.rollout_model.enable_sleep_mode and self.asleep == awake:
            for e in self.explorers:
                e.call("wake_up" if awake else "sleep")
            self.asleep = not awake

    def submit(self, step: int, rows: list | None = None) -> None:
        """Start explore step `step` on every explorer, on the weights they serve now (`rows`: its
        tasks as the online curriculum drew them)."""
        self.awake(True)
        p = Pending(step, [], self.synced, time.perf_counter(), rows)
        p.futures = [e.submit("explore", *p.args) for e in self.explorers]
        self.pending.append(p)

    def collect(self) -> tuple[Pending, list, dict, tuple | None]:
        """Wait for the oldest explore step: it, its experiences, its counters summed over the
        explorers, and the last error one of them recorded."""
        self.finish_sync()  # an explore after a failed sync ran on the old weights: it must not count
        p = self.pending[0]  # still pending while its results are taken: a restart redoes it (_redo_explores)
        exps, counters, last_error, unreturned = [], {}, None, []
        for i, f in enumerate(p.futures):
            e, c = self._result(i, f, "explore", *p.args, version=p.version)
            if "partial_state" in c:
                self.partial_states[i] = c.pop("partial_state")
            unreturned += c.pop("unreturned", [])  # not a count: for the curriculum
            exps += e
            last_error = c.pop("last_error", None) or last_error
            for k, v in c.items():  # a peak is the largest, not a sum
                counters[k] = max(counters.get(k, 0), v) if k.startswith("max_") else counters.get(k, 0) + v
        p.unreturned = unreturned
        self.pending.popleft()
        return p, exps, counters, last_error

    def evaluate(self, step: int) -> dict:
        t0 = time.perf_counter()
        self.finish_sync()  # the eval is of the weights just synced: the explorers must hold them
        metrics = self._result(0, self.explorers[0].submit("evaluate", step, str(self.dir / "eval_trajectories")), "evaluate", step)
        metrics["timing/eval_s"] = time.perf_counter() - t0
        failed = metrics.pop("eval_failed", None)
        if failed and self.cfg.explorer.max_failed_steps:
            # a reward that fails on every eval task fails on every training task too: say so now,
            # not after a stage (an SFT warm-up) trained to its end with evals of 0
            i, last, source, timed_out = failed
            ts = self.cfg.buffer.explorer_input.eval_tasksets[i]
            what, fix = culprit(self.cfg.buffer.explorer_input, ts, source, self.dir / "log", timed_out)
            raise RunError(
                f"every task of the eval set buffer.explorer_input.eval_tasksets[{i}] ({ts.name}) failed at "
                f"step {step} (the last error: {last}; from its {what}), so the eval measures nothing. Each "
                f"explorer's log in {self.dir / 'log'} has the details. {fix}, then run the same command again "
                f"to resume from the newest checkpoint: {resume_point(self.dir)}. explorer.max_failed_steps=0 lets a run go on regardless."
            )
        if "eval/accuracy" in metrics:
            failed = metrics.get("eval/failed_tasks", 0)
            note = f" ({failed} eval tasks failed and count as 0; see {self.dir / 'log'})" if failed else ""
            self.monitor.print(f"[{self.title}] step {step}: eval accuracy {metrics['eval/accuracy']:.3f}{note}")
        return metrics

    # ------------------------------------------------------------------ weights

    def sync_all(self, version: int) -> None:
        """Start the sync of every explorer to the trainer's weights, `version`: the driver goes on
        while they load them (`finish_sync` waits, before the driver next needs an explorer's
        result or the trainer moves on). Waiting here took ~5 ms of each step of the default study,
        where the trainer is the longer half: 43 -> 39 ms a step (experiments/trl_comparison)."""
        self.finish_sync()
        self.awake(True)
        pairs = self._synced_to(version, None, wait=False)
        self.synced = version
        if self.snapshots:  # waited for with the sync: the trainer may still be in the step it follows
            trainer = self.trainer.actor
            pairs.append((trainer, trainer.submit("keep_snapshots", *self.snapshots_kept())))
        self.unfinished_sync = (version, pairs)

    def finish_sync(self) -> None:
        """Wait for the explorers' side of the sync `sync_all` started (a check that failed, or a
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
                    pairs = self.sync(self.trainer.actor, self.explorers, version)
                if wait:
                    wait_for(pairs, self.cfg.synchronizer.sync_timeout)
                return pairs
            except Exception as e:
                pairs = None
                if not actor_died(e):
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
                    raise self.trainer.died(e) from e
        raise AssertionError("unreachable: the last attempt returns or raises")

    def snapshots_kept(self) -> tuple[int, list[int]]:
        """With the explorers behind the trainer (sync_offset > 0 or sync_interval > 1), the trainer
        keeps the weights they serve, and those pending explores were made on, for a restart: the
        trainer's keep_snapshots arguments."""
        return self.synced, sorted({self.synced, *(p.version for p in self.pending)})

    def load_partial(self, states: list | None) -> None:
        """explorer.partial_rollout: each explorer's groups in flight, as a checkpoint kept them."""
        if self.cfg.explorer.partial_rollout and states:
            self.partial_states = list(states)
            for explorer, state in zip(self.explorers, states):
                explorer.call("load_partial", state)

    def pick_up_checkpoint(self, explorers, force: bool = False) -> None:
        """mode=explore: serve the newest checkpoint under synchronizer.checkpoint_dir, if it is new."""
        ckpt_dir = self.cfg.synchronizer.checkpoint_dir
        if not ckpt_dir:
            return
        stage_dir = train_stage_dir(ckpt_dir, self.owner.stage)
        warning = not_served_yet(ckpt_dir, self.owner.stage) if force else None  # a misspelt path: served never
        if warning:
            self.monitor.print(f"[{self.title}] WARNING: {warning}")
        newest = served_checkpoint(stage_dir, self.owner, -1 if force else self.synced, self.not_served, self.title,
                                   self.monitor.print)
        if newest is None:
            return
        for e in explorers:
            e.call("load_weights", str(newest.hf_path), newest.step, newest.state.get("fingerprint"))
        self.synced = newest.step
        log.info("explorers now serve checkpoint step %d", newest.step)

    # ------------------------------------------------------------------ restarts

    def _result(self, i: int, future, method: str, *args, version: int | None = None):
        """The result of explorer i's call. If its process died, Ray restarts it and the call is
        redone, on the weights the schedule gave it (`version`: the version the explorers served
        when the call was made; an explore made before a sync is redone on the older weights)."""
        for attempt in range(self.cfg.cluster.max_actor_restarts + 1):
            try:
                return self.explorers[i].get(future)
            except Exception as e:
                if not actor_died(e) or attempt == self.cfg.cluster.max_actor_restarts:
                    raise
                self._revive(i, e)
                if self.cfg.explorer.partial_rollout and method == "explore":  # redone by _revive, in order
                    future = next(p.futures[i] for p in self.pending if p.step == args[0])
                    continue
                redo_on = version if version is not None and self.trainer is not None and not self.dynamic else self.synced
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
                if not actor_died(e) or time.monotonic() > deadline:
                    raise RunError(
                        f"{explorer.name} died and did not come back within explorer.restart_timeout="
                        f"{self.cfg.explorer.restart_timeout:g} s ({e})."
                    ) from e
                time.sleep(1.0)
        if self.cfg.explorer.partial_rollout and self.cfg.synchronizer.fixed_interrupts:
            explorer.call("open_gate")  # the test mode's fixed pickups cannot be redone: weights go in as they come
        if self.fixed:
            pass  # it restarted on the stage's starting policy: what it serves
        elif self.trainer is not None:
            # it restarted on the stage's starting weights
            if hasattr(self.sync, "reset"):
                self.sync.reset(self.trainer.actor, self.explorers)  # the old group lost a member
            if serve or self.cfg.explorer.partial_rollout:  # (the redone explores start at once)
                self._serve(i, self.synced)
        else:
            self.pick_up_checkpoint([explorer], force=True)
        if self.cfg.explorer.partial_rollout:
            self._redo_explores(i)
        self.monitor.print(f"[{self.title}] {explorer.name} is back (process {pid}); redoing its work")

    def _redo_explores(self, i: int) -> None:
        """Partial rollouts: explorer i's explore steps lost with its process are submitted again,
        in order, from its groups in flight after the last one it finished (collected or not: a
        finished one's result outlives the process). Each explore step's groups depend on the one
        before, so nothing is trained twice or lost."""
        explorer, state, lost = self.explorers[i], self.partial_states[i], False
        for p in self.pending:
            if not lost:
                try:
                    state = explorer.get(p.futures[i], timeout=0)[1].get("partial_state", state)
                    continue
                except Exception as e:
                    if not actor_died(e):
                        raise
                    lost = True
                    explorer.call("load_partial", state)
            p.futures[i] = explorer.submit("explore", *p.args)
        if not lost:
            explorer.call("load_partial", state)

    def _serve(self, i: int, version: int) -> None:
        """Explorer i gets the weights of `version`: the trainer's own if it is at that version,
        else the snapshot it kept (an explorer restarted while the trainer was ahead)."""
        explorer = self.explorers[i]
        if version == self.trainer("get_version"):
            weights, expected = self.trainer.submit("weights"), self.trainer("engine_fingerprint")
        else:
            weights, expected = self.trainer.submit("snapshot_weights", version), self.trainer("snapshot_fingerprint", version)
        explorer.get(explorer.submit("update_weights", weights, version, expected))
