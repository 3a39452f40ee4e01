"""synchronizer.sync_style=dynamic_by_explorer: the schedule without a step grid between explorers
and trainer.

mode=both, per training step k = 1..total_steps (o = synchronizer.sync_offset >= 1):
    explore steps up to k - 1 + o are submitted          # the explorers never idle on the trainer
    explore steps are collected, oldest first, until the buffer holds a batch
    batch = buffer.get(train_batch_size)                  # older than max_staleness: dropped, counted
    metrics = trainer.train_step(batch); the new weights are published to every explorer
which takes them at its next safe point: between two generate chunks with explorer.partial_rollout
(rft/rollout/partial.py: the rows in flight keep their tokens, and an explore step ends with its
batch_size finished groups, the unfinished ones going on in the next), else between explore steps.
Each token records the version that sampled it (Experience.token_versions).

Which version wrote which token depends on timing, so two runs of one config differ; with
synchronizer.fixed_interrupts (a test mode) explore step s takes version s after its first chunk
and at no other point, and a resumed run equals an uninterrupted one bit for bit. A checkpoint
holds, beside the trainer and the buffer, each explorer's groups in flight; an explorer Ray
restarts gets its groups back from the driver (rft.runtime.explorers), so no task is lost or done
twice.
"""

from __future__ import annotations

import time

from rft.runtime.schedule import Schedule


class DynamicSchedule(Schedule):
    """Schedule's parts and checkpoints; the trainer takes a batch as soon as the buffer holds
    one, whichever explore steps made it."""

    def __init__(self, cfg, plan, start: int, saved: dict, norm, **parts):
        super().__init__(cfg, plan, start, saved, norm, **parts)
        # experiences in the buffer the trainer has not read (a resumed run: those the checkpoint kept)
        self.available = saved.get("available", 0)

    def run(self) -> None:
        if self.pool.explorers and self.start == 0 and self.cfg.explorer.eval_on_startup:
            self.monitor.log(0, self.pool.evaluate(0), advance=False)
        for step in range(self.start + 1, self.plan.total_steps + 1):
            t_step = time.perf_counter()
            metrics = self._explore_until(step)
            metrics.update(self._train(step, None))
            self._end_step(step, metrics, t_step)

    def _explore_until(self, step: int) -> dict:
        """Collect explore steps until the buffer holds a batch (or nothing more will come); the
        metrics of the newest one collected, and how many were."""
        self._submit_explores(step)
        t0, collected = time.perf_counter(), 0
        while self.available < self.plan.experiences_per_step and self.pool.pending:
            self.available += self._collect()
            collected += 1
            self._submit_explores(step)
        if self.cfg.synchronizer.fixed_interrupts and self.next_explore >= self.plan.total_steps and not self.pool.pending:
            for explorer in self.pool.explorers:  # no explore step is left to take the next weights
                explorer.call("open_gate")
        metrics = {"timing/wait_rollout_s": time.perf_counter() - t0, "rollout/explore_steps": collected}
        for k in sorted(self.explore_metrics):
            metrics.update(self.explore_metrics.pop(k))
        return metrics

    def _read_batch(self, step: int, produced: int | None) -> tuple[list, dict]:
        take = min(self.available, self.plan.experiences_per_step)
        self.available -= take
        return super()._read_batch(step, take)

    def _save(self, step: int, metrics: dict) -> None:
        self.pool.finish_sync()
        while self.pool.pending:
            self.available += self._collect()
        super()._save(step, metrics)

    def _state(self) -> dict:
        return {**super()._state(), "available": self.available, "partial": self.pool.partial_states}
