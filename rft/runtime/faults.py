"""What a stage says when something goes wrong: an actor that died (the trainer's death names the
checkpoint a rerun resumes from; a dead explorer is restarted, rft.runtime.explorers), user code
that failed every task (`culprit`), and a run that cannot learn (`LearningSignal`). Apart from the
schedule and the explorer pool so that each reads as what it does when nothing fails."""

from __future__ import annotations

import sys
from pathlib import Path

from rft.errors import RunError
from rft.plan.batch import agent_scores, environment_scores, scored_by
from rft.rewards.scoring import describe as describe_reward
from rft.rewards.scoring import spec_of
from rft.runtime.checkpoint import latest_checkpoint


def actor_died(e: Exception) -> bool:
    # without Ray imported no Ray actor ran (cluster=inline): importing it here, on an error of a
    # run in one process, would cost ~50 MB and set up Ray's logging for nothing
    exceptions = sys.modules.get("ray.exceptions")
    return exceptions is not None and isinstance(e, exceptions.RayActorError)


def ray_out_of_memory(e: Exception) -> bool:
    # Ray's memory monitor killed a worker (a task's error, not RayActorError); imported as actor_died's
    exceptions = sys.modules.get("ray.exceptions")
    return exceptions is not None and isinstance(e, exceptions.OutOfMemoryError)


def resume_point(stage_dir: Path) -> str:
    """The checkpoint a rerun of the same command resumes from, for a message."""
    latest = latest_checkpoint(stage_dir)
    return f"step {latest.step} ({latest.path})" if latest else "none yet"


class TrainerDied(RunError):
    """A trainer that died, said as TrainerCalls.died says it: code that tells an actor's death from
    the errors of a call (rft.runtime.saving's checkpoint load) treats it as a death still."""


class _Guarded:
    """The trainer's actor (or its ranks, trainer=fsdp2) as the stage calls it directly: its start's
    checks, the checkpoint load, weight syncs. The same calls; a death (a rank SIGKILLed as the stage
    started) is TrainerCalls.died's paragraph, not Ray's ActorDiedError under Hydra's traceback."""

    def __init__(self, actor, died):
        self._actor, self._died = actor, died

    def __getattr__(self, name: str):
        if name.startswith("_"):  # not set yet (copy, pickle): no recursion through _actor
            raise AttributeError(name)
        return getattr(self._actor, name)

    def get(self, future, timeout: float | None = None):
        try:
            return self._actor.get(future, timeout)
        except Exception as e:
            if not actor_died(e):
                raise
            raise self._died(e) from e

    def call(self, method: str, *args):
        return self.get(self._actor.submit(method, *args))


class TrainerCalls:
    """The stage's trainer actor (`actor`), whose results are taken here: a trainer that died stops
    the run with a RunError naming the checkpoint a rerun resumes from, not a raw Ray error."""

    def __init__(self, actor, stage_dir: Path):
        self.actor, self.dir = _Guarded(actor, self.died), stage_dir

    def __call__(self, method: str, *args):
        return self.result(self.actor.submit(method, *args))

    def submit(self, method: str, *args):
        return self.actor.submit(method, *args)

    def result(self, future):
        return self.actor.get(future)  # a death: died's paragraph (_Guarded)

    def died(self, e: Exception) -> TrainerDied:
        latest = latest_checkpoint(self.dir)
        where = f"step {latest.step} ({latest.path})" if latest else "none yet (the stage restarts from its beginning)"
        who = f": {e.rft_actor}, its log {e.rft_log}" if getattr(e, "rft_actor", None) else ""
        return TrainerDied(f"the trainer actor died ({type(e).__name__}{who}). Its newest checkpoint: {where}. "
                           f"Run the same command again to resume from it.")


SLOW = " (or raise explorer.max_timeout if it is only slow)"


def culprit(inp, ts, source: str | tuple | None, log_dir: Path | None = None,
            timed_out: bool = True) -> tuple[str, str]:
    """(what failed, its fix) when every task of taskset `ts` failed: the reward function, or,
    when the workflow's own jobs failed (`source`), the environment (multi_turn) or the workflow,
    or, when a reward model's worker died (source ("reward_model", worker, model_path):
    rft.rewards.reward_model.WorkerDied), that reward model, with its worker's log in `log_dir`.
    `timed_out`: some of the calls timed out; only then is a longer explorer.max_timeout a fix (a
    reward that returns a string fails as fast on every retry)."""
    slow = SLOW if timed_out else ""
    if isinstance(source, tuple) and source[0] == "reward_model":
        _, worker, model_path = source
        log = Path(log_dir) / f"{worker}.log" if log_dir is not None else f"<stage>/log/{worker}.log"
        # a worker is killed, not slow: a longer timeout would not help
        return (f"reward model {model_path!r}, whose worker {worker} died",
                f"Find why the worker died in its log, {log} (or the system's, for the OOM killer: give the reward "
                f"model more memory, a smaller args.batch_size or args.max_length, or a device of its own with "
                f"args.colocate=false)")
    if source == "workflow" and environment_scores(ts):
        return (f"environment {ts.workflow_args.get('env')!r} (workflow_args.env)",
                f"Fix the environment (its constructor, reset or step){slow}")
    if source == "workflow":
        return f"workflow {ts.workflow!r}, in the jobs it ran", f"Fix the workflow{slow}"
    reward = describe_reward(spec_of(ts.reward_fn, inp.default_reward_fn_type))
    return f"reward function {reward!r}", f"Fix the reward function{slow}"


def _scorer_kind(ts) -> str:
    """What scores taskset `ts`, in a word: its environment, its agent, or the reward function."""
    return "environment" if environment_scores(ts) else "agent" if agent_scores(ts) else "reward function"


class LearningSignal:
    """A run that cannot learn must not run to the end and exit 0: it stops after
    explorer.max_failed_steps steps in a row in which every task failed or the experience pipeline
    kept no experience (or after every step of a run shorter than that), and warns loudly when every reward of the first steps is the same (no
    advantage, no learning). Fed each explore step's metrics in step order (`check`)."""

    def __init__(self, cfg, plan, start: int, stage_dir: Path, title: str, monitor):
        self.cfg, self.plan, self.start, self.dir, self.title, self.monitor = cfg, plan, start, stage_dir, title, monitor
        # steps in a row in which every task failed, or the experience pipeline kept nothing
        # (explorer.max_failed_steps stops the run)
        self.failed_steps = self.emptied_steps = 0
        self.first_rewards: set = set()  # the rewards of the first steps (all equal: a warning)

    def check(self, step: int, m: dict, last_error: tuple | None) -> None:
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
            what, fix = culprit(inp, inp.taskset, source, self.dir / "log", m.get("rollout/timeouts", 0) > 0)
            raise RunError(
                f"every task of the last {self.failed_steps} steps failed ({what}: "
                f"{m.get('rollout/errors', 0)} errors and {m.get('rollout/timeouts', 0)} timeouts in the "
                f"last step; the last error: {last or 'none recorded (timeouts)'}), so nothing "
                f"can be learned. Each explorer's log in {self.dir / 'log'} has the details. {fix}, "
                f"then run the same command again to resume from the newest checkpoint: {resume_point(self.dir)}. "
                f"explorer.max_failed_steps={cfg.explorer.max_failed_steps} sets how many such steps stop a "
                f"run (0: never)."
            )
        self._check_pipeline(m, limit)
        first = min(3, self.plan.total_steps)
        if self.start == 0 and step < first and m["rollout/experiences"]:
            self.first_rewards.update({m["reward/min"], m["reward/max"]})
            if step == first - 1 and len(self.first_rewards) == 1:
                value = self.first_rewards.pop()
                msg = (f"[{self.title}] WARNING: every reward of the first {first} steps was {value:g}: the "
                       f"advantages are all 0 and nothing is learned. Check the "
                       f"{_scorer_kind(inp.taskset)} "
                       f"({scored_by(inp.taskset, inp.default_reward_fn_type)!r}) "
                       f"and that buffer.explorer_input.taskset.format.response_key="
                       f"{inp.taskset.format.response_key!r} names the column of reference answers "
                       f"(task.answer).")
                self.monitor.print(msg)

    def _check_pipeline(self, m: dict, limit: int) -> None:
        """data_processor.experience_pipeline keeping none of a step's experiences, `limit` steps in
        a row: the trainer trained on nothing and the run went on to exit 0."""
        emptied = m.get("experience_pipeline/in", 0) > 0 and m.get("experience_pipeline/kept") == 0
        self.emptied_steps = self.emptied_steps + 1 if emptied else 0
        if limit <= 0 or self.emptied_steps < limit:
            return
        outs = [(k.split("/")[1], v) for k, v in m.items() if k.startswith("experience_pipeline/") and k.endswith("/out")]
        name = next((n for n, v in outs if v == 0), "?")
        raise RunError(
            f"the experience pipeline (data_processor.experience_pipeline.operators) kept none of the experiences "
            f"of the last {self.emptied_steps} steps ({m['experience_pipeline/in']} in the last step; {name} left "
            f"none), so nothing was trained on. Loosen {name}'s args or remove it, then run the same command again "
            f"to resume from the newest checkpoint: {resume_point(self.dir)}. explorer.max_failed_steps="
            f"{self.cfg.explorer.max_failed_steps} sets how many such steps stop a run (0: never).")
