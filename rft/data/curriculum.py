"""The online curriculum (data_processor.online_curriculum): each step's tasks drawn by priority,
so that tasks the model always or never solves are drawn less.

A task's priority is p(1 - p) + eps, p its pass rate over its last `window` rollouts (the share
with reward >= the taskset's pass_threshold, the reward as the reward function gave it: before
DAPO's overlong penalty); a task not yet seen counts as p = 0.5, the highest
priority, so every task is tried early. p(1 - p) is the variance of a rollout's pass/fail: the
tasks whose groups carry a learning signal for a group-relative advantage (a group all right or
all wrong has none); eps keeps every task drawable, as a pass rate of 0 or 1 over a few rollouts
may be luck.

It lives in the driver (rft.runtime.schedule.Schedule): it learns from each explore step's
experiences as they are collected, in step order (and from the drawn tasks that left none: a failed
task's rollouts are fails; a task explorer.over_rollout dropped, unfinished, is no outcome), and
draws a step's tasks when that step is submitted, from a generator seeded by (seed, step). Collects and submissions happen at points the
config fixes, so the draws are a function of the config; its state (the outcomes it holds) is
saved in the checkpoint, and a resumed run draws what an uninterrupted one would.
"""

from __future__ import annotations

from rft.data.readers import step_seed


def rollout_outcomes(exps: list, threshold: float) -> list[tuple[str, int]]:
    """Each rollout's (task id, 1 if it passed else 0), in order: an openai_agent run of several
    experiences (one `info["rollout"]`, one reward) is one outcome, not one each."""
    runs, out = set(), []
    for e in exps:
        run = (e.group_id, e.info.get("rollout")) if "rollout" in e.info else None
        if run is not None and run in runs:
            continue
        runs.add(run)
        # solved as the reward function judged it: DAPO's overlong penalty (the part `overlong`,
        # weight 1, added by the explorer) made a right answer near the length limit a fail
        out.append((e.task_id, int(e.reward - e.reward_parts.get("overlong", 0.0) >= threshold)))
    return out


class OnlineCurriculum:
    def __init__(self, n_tasks: int, taskset_name: str, window: int, eps: float, threshold: float, seed: int,
                 extra_tries: int = 0):
        self.n, self.name, self.window, self.eps = n_tasks, taskset_name, window, eps
        self.threshold, self.seed = threshold, seed
        # DAPO dynamic sampling's extra tries (algorithm.dynamic_sampling_max_tries - 1): each step's
        # draw holds their tasks too, drawn by the same weights (`draw`)
        self.extra_tries = extra_tries
        # task row -> its last `window` outcomes (1: passed), oldest first
        self.outcomes: dict[int, list[int]] = {}

    def _row(self, task_id: str) -> int | None:
        """The taskset row of a task id (rft.data.tasks.load_tasks names them <taskset name>/<row>)."""
        name, _, row = task_id.rpartition("/")
        return int(row) if name == self.name and row.isdigit() and int(row) < self.n else None

    def observe(self, exps: list, unreturned: list | None = None) -> None:
        """Record each rollout's outcome against its task, in the order given: the step's experiences,
        then `unreturned`, the (task id, passed) of the rollouts of tasks drawn whose experiences the
        step does not hold (rft.rollout.explorer: a failed task's, each a fail; a group dynamic
        sampling dropped, as it scored; none of a task over_rollout dropped, which did not finish):
        else a task that always fails would keep p = 0.5, the top priority, and be drawn again and
        again."""
        for task_id, passed in [*rollout_outcomes(exps, self.threshold), *(unreturned or [])]:
            row = self._row(task_id)
            if row is not None:
                seen = self.outcomes.setdefault(row, [])
                seen.append(int(passed))
                del seen[:-self.window]

    def pass_rate(self, row: int) -> float | None:
        seen = self.outcomes.get(row)
        return sum(seen) / len(seen) if seen else None

    def weights(self) -> list[float]:
        """Each task's priority p(1 - p) + eps (p = 0.5 for a task not yet seen)."""
        w = [0.25 + self.eps] * self.n
        for row in self.outcomes:
            p = self.pass_rate(row)
            w[row] = p * (1 - p) + self.eps
        return w

    def draw(self, step: int, k: int) -> list[int]:
        """Step `step`'s k task rows: drawn without replacement, each with probability in
        proportion to its weight, by a generator seeded by (seed, step). With `extra_tries`, then
        up to extra_tries * k more, the tasks dynamic sampling's tries take k at a time (in this
        order: rft.rollout.explorer.Explorer.extra_tries): drawn alike from the tasks not drawn
        yet, by a generator of their own, so that the step's k are those a run without them draws."""
        import numpy as np

        w = np.asarray(self.weights(), dtype=np.float64)
        rng = np.random.default_rng(step_seed(self.seed, step, salt=17))
        rows = [int(i) for i in rng.choice(self.n, size=min(k, self.n), replace=False, p=w / w.sum())]
        more = min(self.extra_tries * k, self.n - len(rows))
        if more > 0:
            w[rows] = 0.0  # a task once a step: every weight is > 0 (eps), so the rest can fill `more`
            rng = np.random.default_rng(step_seed(self.seed, step, salt=18))
            rows += [int(i) for i in rng.choice(self.n, size=more, replace=False, p=w / w.sum())]
        return rows

    def metrics(self) -> dict:
        """The share of the tasks seen so far that were always solved, never solved, and seen."""
        rates = [self.pass_rate(r) for r in self.outcomes]
        seen = max(len(rates), 1)
        return {"curriculum/solved_frac": sum(p == 1 for p in rates) / seen,
                "curriculum/unsolved_frac": sum(p == 0 for p in rates) / seen,
                "curriculum/seen_frac": len(rates) / max(self.n, 1)}

    def state(self) -> dict:
        return {"outcomes": {str(r): "".join(map(str, o)) for r, o in sorted(self.outcomes.items())}}

    def load(self, state: dict | None) -> None:
        self.outcomes = {int(r): [int(c) for c in o] for r, o in ((state or {}).get("outcomes") or {}).items()}


def make_curriculum(cfg, n_tasks: int) -> OnlineCurriculum | None:
    """The stage's online curriculum (None: off, or a stage that explores nothing)."""
    dp = cfg.get("data_processor")
    if dp is None or not dp.online_curriculum.enable or cfg.mode not in ("both", "explore"):
        return None
    ts, cur = cfg.buffer.explorer_input.taskset, dp.online_curriculum
    extra = max(cfg.algorithm.dynamic_sampling_max_tries - 1, 0)  # 0 and 1: dynamic sampling off
    return OnlineCurriculum(n_tasks, ts.name, cur.window, cur.eps, ts.pass_threshold, cfg.seed, extra)
