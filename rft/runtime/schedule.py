"""A stage's schedule: which explore, train, sync, eval and save each step makes, and in what order.

mode=both, per step k = 1..total_steps (o = synchronizer.sync_offset):
    explorers.explore(k - 1 + o) is started      # runs while the trainer trains: o steps ahead
    experiences of explore step k - 1 -> buffer; batch = buffer.get(train_batch_size)
    metrics = trainer.train_step(batch)          # experiences staler than max_staleness dropped
    sync trainer -> explorers every sync_interval steps (and before an eval or a checkpoint)
    checkpoint every save_interval steps (and at the step in progress when Slurm warns that it will
    stop the job: rft/runtime/preemption.py); eval every eval_interval steps (and at 0 and the end)
mode=explore: the explorer half, writing every step to the buffer (sql or file) and taking new
    weights from synchronizer.checkpoint_dir every sync_interval steps.
mode=train: the trainer half, reading from a stored buffer or a dataset.

The explorer's work for step s is a function of (seed, s, the weights it serves), and calls on one
actor run in the order they were made: an explore started before a sync uses the old weights,
one started after it the new. So the schedule (which weights made which experiences) is fixed by
the config, and a resumed run repeats it exactly: a checkpoint holds the trainer, the buffer's
read position and its unread experiences (those explored ahead), and the next step to explore
(`Schedule._save` writes that state, `Schedule.__init__` reads it back).
"""

from __future__ import annotations

import time
from collections import Counter

from rft.algorithms.off_policy import staleness
from rft.data.curriculum import make_curriculum
from rft.config import fixed_policy
from rft.data.pipeline import ExperiencePipeline, experience_operators
from rft.data.experience import batch_record
from rft.errors import RunError
from rft.rewards import scoring
from rft.rollout.explorer import step_metrics
from rft.runtime import preemption
from rft.runtime.explorers import ExplorerPool
from rft.runtime.faults import LearningSignal, TrainerCalls
from rft.runtime.saving import StageCheckpoints


def token_ages(exps: list, version: int) -> dict:
    """The age of every trained response token (versions between the one that sampled it and
    `version`, the trainer's): with partial rollouts one experience holds tokens of several ages."""
    ages: Counter = Counter()
    for e in exps:
        if e.token_versions:
            ages.update(version - v for v in e.token_versions)
        else:
            ages[version - e.policy_version] += e.response_length
    total = sum(ages.values())
    if not total:
        return {}
    m = {"staleness/token_mean": sum(a * c for a, c in ages.items()) / total}
    m.update({f"staleness/token_frac_{a}": c / total for a, c in sorted(ages.items())})
    return m


def reward_norm(cfg, saved: dict) -> scoring.RunningNorm:
    """The running statistics of the reward parts marked normalize: true (rft/rewards/scoring.py),
    as the checkpoint left them."""
    inp = cfg.buffer.explorer_input
    parts = scoring.entries(scoring.spec_of(inp.taskset.reward_fn, inp.default_reward_fn_type),
                            "buffer.explorer_input.taskset.reward_fn")
    norm = scoring.RunningNorm({e["name"]: e["weight"] for e in parts}, [e["name"] for e in parts if e["normalize"]])
    norm.load(saved.get("reward_norm"))
    return norm


def read_timeout(cfg, plan, step: int, e: TimeoutError) -> str:
    """The paragraph of a step whose experiences did not arrive within max_read_timeout; in
    mode=train from a stored buffer most often a buffer.total_steps past what an explore job wrote."""
    text = f"step {step} of {plan.total_steps}: {e}"
    if plan.input_kind == "experiences":
        text += (f" In mode=train the stage has buffer.total_steps={plan.total_steps} steps: if no explore job "
                 f"writes to {cfg.buffer.trainer_input.experience_buffer.path} any more, it holds no more; set "
                 f"buffer.total_steps=null (the steps stored) and resume_with_changes=true (the same command "
                 f"with both goes on from the newest checkpoint).")
    return text


class Schedule:
    """The step loop (`run`) over the stage's parts: the explorer pool, the trainer (None in
    mode=explore), the buffer (None when the trainer reads a dataset), the monitor, the checkpoints.
    `start`: the step the stage resumes after (0: a fresh stage); `saved`: its checkpoint's state."""

    preempted_at: int | None = None  # the step saved because Slurm warned that it will stop the job

    def __init__(self, cfg, plan, start: int, saved: dict, norm: scoring.RunningNorm, *, pool: ExplorerPool,
                 trainer: TrainerCalls | None, buffer, monitor, checkpoints: StageCheckpoints, signal: LearningSignal):
        self.cfg, self.plan, self.start = cfg, plan, start
        self.pool, self.trainer, self.buffer, self.monitor = pool, trainer, buffer, monitor
        self.checkpoints, self.signal = checkpoints, signal
        self.explores = cfg.mode in ("both", "explore")
        self.trains = cfg.mode in ("both", "train")
        self.next_explore = saved.get("next_explore", start)
        self.explore_metrics = {int(k): v for k, v in saved.get("explore_metrics", {}).items()}
        self.reward_norm = norm
        # data_processor.online_curriculum: draws each explore step's tasks (None: the explorers' shuffles)
        self.curriculum = make_curriculum(cfg, plan.dataset_size)
        if self.curriculum is not None:
            self.curriculum.load(saved.get("curriculum"))
        # (algorithm.rm_pairs=groups: best_worst_pairs last, the pairs the reward model learns from)
        self.experience_pipeline = ExperiencePipeline(experience_operators(cfg))

    def run(self) -> None:
        cfg = self.cfg
        if self.pool.explorers and self.start == 0 and cfg.explorer.eval_on_startup and cfg.mode != "explore":
            self.monitor.log(0, self._evaluate(0), advance=False)
        if cfg.mode == "explore":
            self.pool.pick_up_checkpoint(self.pool.explorers, force=True)
        if self.pool.snapshots:
            self.trainer("keep_snapshots", *self.pool.snapshots_kept())
        for step in range(self.start + 1, self.plan.total_steps + 1):
            t_step = time.perf_counter()
            metrics: dict = {}
            if self.explores:
                metrics.update(self._explore_until(step))
            if self.trains:
                produced = metrics.get("experience_pipeline/kept", metrics.get("rollout/experiences"))
                metrics.update(self._train(step, produced))
            self._end_step(step, metrics, t_step)

    # ------------------------------------------------------------------ explore

    def _submit_explores(self, step: int) -> None:
        """Submit the explore steps due by training step `step`: synchronizer.sync_offset ahead."""
        offset = self.cfg.synchronizer.sync_offset if self.cfg.mode == "both" else 0
        while self.next_explore <= min(step - 1 + offset, self.plan.total_steps - 1):
            rows = self.curriculum.draw(self.next_explore, self.cfg.buffer.batch_size) if self.curriculum else None
            self.pool.submit(self.next_explore, rows)
            self.next_explore += 1

    def _explore_until(self, step: int) -> dict:
        """Keep the explorers synchronizer.sync_offset steps ahead of the trainer; wait for the
        explore step this training step learns from (step - 1); its metrics."""
        self._submit_explores(step)
        t0 = time.perf_counter()
        while self.pool.pending and self.pool.pending[0].step <= step - 1:
            self._collect()
        return {"timing/wait_rollout_s": time.perf_counter() - t0, **self.explore_metrics.pop(step - 1, {})}

    def _collect(self) -> int:
        """Wait for the oldest explore step; its experiences go into the buffer (how many)."""
        p, exps, counters, last_error = self.pool.collect()
        m = step_metrics(exps, counters, len(p.futures))
        if self.curriculum is not None:  # the pass rates of the rewards as the reward function gave them
            self.curriculum.observe(exps, p.unreturned)  # and of the tasks drawn that left no experience
            m.update(self.curriculum.metrics())
        # parts marked normalize: true (rft/rewards/scoring.py), in step order: a resumed run normalises the same
        m.update(self.reward_norm.apply(exps))
        if self.experience_pipeline:
            # data_processor.experience_pipeline, here where experiences enter the buffer: in the
            # driver, in step order, after the explorers' shaping (overlong) and the normalisation,
            # so what the buffer (and a checkpoint) holds is what the trainer trains on
            exps, pm = self.experience_pipeline(exps)
            m.update(pm)
        m["timing/rollout_s"] = time.perf_counter() - p.t0
        self.explore_metrics[p.step] = m
        self.signal.check(p.step, m, last_error)
        if exps:
            self.buffer.put(exps)
        return len(exps)

    # ------------------------------------------------------------------ train

    def _train(self, step: int, produced: int | None) -> dict:
        self.pool.finish_sync()  # a dead explorer is synced again to the weights the trainer has now
        if self.explores:
            self.pool.awake(False)
        if self.plan.input_kind == "dataset":
            t0 = time.perf_counter()
            metrics, record = self.trainer("train_dataset_step", step, self.plan.experiences_per_step)
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
            self.pool.sync_all(step)
            metrics["timing/sync_s"] = time.perf_counter() - t1
            # not before an eval (it would wait behind that explore) or a checkpoint (it would
            # wait to keep that explore's experiences), nor once Slurm warned it will stop the job
            if not (self._wants_eval(step) or self._wants_save(step) or preemption.signalled()):
                self._submit_explores(step + 1)
        result = self.trainer.result(future)
        if batch:
            metrics.update(result)
            self.monitor.record_batch(batch_record(step, batch))
        metrics["timing/train_s"] = time.perf_counter() - t0 - metrics.get("timing/sync_s", 0.0)  # each once
        return metrics

    def _read_batch(self, step: int, produced: int | None) -> tuple[list, dict]:
        """This step's experiences, without those staler than synchronizer.max_staleness.

        `produced`: in mode=both, how many the explorers made for this step (fewer than planned
        when tasks failed), so the read never waits for experiences that will not come.
        """
        if produced == 0:
            return [], {}
        eb = self.cfg.buffer.trainer_input.experience_buffer
        try:
            batch = self.buffer.get(produced or self.plan.experiences_per_step, eb.max_read_timeout)
        except TimeoutError as e:  # a paragraph, not a traceback: what stopped, and what to set
            raise RunError(read_timeout(self.cfg, self.plan, step, e)) from None
        if self.fixed_policy:  # sampled by the fixed policy: no staleness to count or bound
            return batch, {}
        # step - 1 trainer steps are trained so far: the version about to learn from them
        stale = [staleness(e.policy_version, step - 1) for e in batch]
        bound = self.cfg.synchronizer.max_staleness
        kept = [e for e, s in zip(batch, stale) if bound is None or s <= bound]
        m = {"staleness/mean": sum(stale) / len(stale), "staleness/max": max(stale),
             "staleness/dropped": len(batch) - len(kept)}
        for s in sorted(set(stale)):
            m[f"staleness/count_{s}"] = stale.count(s)
        m.update(token_ages(kept, step - 1))
        self.monitor.histogram(step, "staleness", stale)
        return kept, m

    # ------------------------------------------------------------------ the end of a step

    def _end_step(self, step: int, metrics: dict, t_step: float) -> None:
        """Sync, evaluate and save when the schedule says so, then log the step."""
        cfg = self.cfg
        # Slurm's warning came (rft/runtime/preemption.py): this step is saved (and synced before,
        # as for any checkpoint), then the job is requeued
        self.preempted_at = step if preemption.due(step) else None
        want_eval, want_save = self._wants_eval(step), self._wants_save(step)
        if cfg.mode == "explore":
            if step % cfg.synchronizer.sync_interval == 0:
                self.pool.pick_up_checkpoint(self.pool.explorers)
        elif self._syncs_at(step) and self.pool.synced != step:  # not started by _train already
            t0 = time.perf_counter()
            self.pool.sync_all(step)
            # starting it: the explorers load the weights while the driver goes on, and the driver's
            # wait for them, if any, counts where it waits (timing/wait_rollout_s, mostly)
            metrics["timing/sync_s"] = time.perf_counter() - t0
        metrics["sync/version"] = self.pool.synced
        metrics["timing/step_s"] = time.perf_counter() - t_step
        if want_eval:
            metrics.update(self._evaluate(step))
        if want_save:
            t0 = time.perf_counter()
            self._save(step, metrics)
            metrics["timing/save_s"] = time.perf_counter() - t0
        self.monitor.log(step, metrics)
        if want_save:  # logged after its checkpoint: a warning that came by now requeues from here
            preemption.requeue_if_signalled()

    def _save(self, step: int, metrics: dict) -> None:
        """A checkpoint: the trainer (if any), then state.json, written last, with the buffer state
        and the step's metrics (logged after the save: a kill between the two must not lose them)."""
        # explores started ahead are finished and kept: a resumed run trains on them, not on new ones
        self.pool.finish_sync()
        while self.pool.pending:
            self._collect()
        state, files = {**self._state(), "metrics": metrics}, {}
        if self.buffer is not None:
            state["buffer"], files = self.checkpoints.buffer_state(self.buffer)
        self.checkpoints.write(step, state, self.trainer, self.monitor.print, files)

    def _state(self) -> dict:
        """Where the schedule stands, for a resumed run to go on from there."""
        return {"version": self.pool.synced, "next_explore": self.next_explore,
                "explore_metrics": self.explore_metrics, "reward_norm": self.reward_norm.state(),
                **({"curriculum": self.curriculum.state()} if self.curriculum is not None else {})}

    @property
    def fixed_policy(self) -> bool:
        """A reward model learning from the groups of the stage's starting policy, which the explorers
        serve throughout: no sync (the trainer's model is the reward model), its eval its pairs'."""
        return fixed_policy(self.cfg)

    def _evaluate(self, step: int) -> dict:
        """The eval: the explorers' eval tasksets; with a fixed policy (the explorers' model never
        changes) the reward model's accuracy on its held-out pairs (experience_buffer.eval_split)."""
        return self.trainer("pair_eval") if self.fixed_policy else self.pool.evaluate(step)

    def _wants_eval(self, step: int) -> bool:
        cfg = self.cfg
        return bool(self.pool.explorers) and cfg.mode != "explore" and (step % cfg.explorer.eval_interval == 0
                                                                        or step == self.plan.total_steps)

    def _wants_save(self, step: int) -> bool:
        # mode=explore saves its place every step (a small state.json): a resumed explorer keeps
        # the rows it wrote after its checkpoint, its own (rft.runtime.saving.own_groups), and
        # does not write them again (killed before its first checkpoint: those after where the
        # buffer ended when the stage first started, rft.runtime.checkpoint.explore_start)
        cfg = self.cfg
        return (step % cfg.trainer.save_interval == 0 or step == self.plan.total_steps or cfg.mode == "explore"
                or self.preempted_at == step)

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
        return (self.trainer is not None and bool(self.pool.explorers) and self.cfg.mode != "explore"
                and not self.fixed_policy and (
            self._wants_eval(step)
            or (self.explores and (step % self.cfg.synchronizer.sync_interval == 0 or self._wants_save(step)))))
