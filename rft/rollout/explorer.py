"""The explorer: a rollout engine plus workflows, turning tasks into experiences.

It holds no state that is not derived from the step number and the weights it was last given:
the tasks of step k and the sampling seed of step k are functions of (seed, k). That is what
makes a resumed run sample exactly what an uninterrupted one would, and what lets a restarted
explorer redo a step. With several explorers (explorer.rollout_model.engine_num), explorer i of E
takes tasks i, i+E, i+2E, ... of each step.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import random
import statistics
import threading
import time

from rft.algorithms.shaping import apply_overlong
from rft.data.curriculum import rollout_outcomes
from rft.data.readers import budget_report, epoch_batch, prompt_ids, step_seed
from rft.data.pipeline import keeps_order, taskset_of
from rft.data.tasks import load_tasks
from rft.errors import ConfigError, RunError
from rft.models import load_tokenizer, local_device, peak_memory
from rft.registry import ENGINES, resolve, study_frame
from rft.rewards.eval_metrics import rollout_samples
from rft.rewards.scoring import build as build_scorer
from rft.rewards.scoring import part_metrics, spec_of
from rft.rollout.evaluation import conversation_metrics, evaluate_sets
from rft.rollout.workflows.single_turn import WORKFLOWS, WorkflowContext, check_output
from rft.rollout.partial import PartialRollouts, Replay, WeightGate
from rft.rollout.weights import WeightsMixin
from rft.sync.weights import node_id

log = logging.getLogger(__name__)


def _flat(group) -> bool:
    """All rollouts of the group got the same reward: no signal for a group baseline."""
    return len({e.reward for e in group}) == 1


def engine_class(engine_type: str, key: str = "explorer.rollout_model.engine_type"):
    """The engine class (rft/rollout/engines/base.py says what one implements): a name of
    rft.registry.ENGINES, imported when chosen (vLLM is optional), or a study's dotted path."""
    return resolve(ENGINES, engine_type, key)


class _Threads:
    """Daemon threads kept between calls of run_jobs: starting a thread per reward call cost
    ~0.1 ms each (~1.5 ms a step of 16 tasks, more inside a Ray actor). A call that hangs keeps
    its thread; the next call that finds no idle thread starts one, so a hung call never blocks
    another and the count of threads is at most the most calls ever running (or hung) at once."""

    def __init__(self):
        self.work: queue.SimpleQueue = queue.SimpleQueue()
        self.idle = 0
        self.lock = threading.Lock()
        self.running: set = set()  # tokens of the calls on a thread now
        # those of them abandoned (past their timeout), each holding a thread: rollout/hung_calls;
        # token -> when it was abandoned (time.monotonic)
        self.hung: dict = {}

    def start(self, fn, args: tuple, deliver) -> object:
        """Run fn(*args) on a kept thread, then deliver(its result); returns the call's token."""
        token = object()
        with self.lock:
            spawn = self.idle == 0
            self.idle -= not spawn
            self.running.add(token)
        if spawn:
            threading.Thread(target=self._serve, daemon=True, name="rft-job").start()
        self.work.put((fn, args, deliver, token))
        return token

    def abandon(self, token, now: float, grace: float) -> int:
        """The call no longer holds the step (it timed out); returns how many such calls still run
        `grace` seconds after they were abandoned: a call only a little slower than its timeout (a
        burst of them, 128 agents at once) returns meanwhile and is not one that piles up."""
        with self.lock:
            if token in self.running:
                self.hung[token] = now
            return sum(at <= now - grace for at in self.hung.values())

    def _serve(self) -> None:
        while True:
            fn, args, deliver, token = self.work.get()
            result = fn(*args)  # never raises: _JobRun.call catches every exception
            # idle before the result is seen: the caller's next job, started on that result,
            # finds this thread idle instead of starting another
            with self.lock:
                self.idle += 1
                self.running.discard(token)
                self.hung.pop(token, None)
            deliver(result)


# abandoned calls that may still hold a thread each (and what they hold) in one process: a reward
# that hangs on some task hangs there every epoch, so without a bound they pile up over a long run
MAX_HUNG_CALLS = 64


_THREADS = _Threads()


class _JobRun:
    """The state of one run_jobs call: which jobs wait, run (since when) and are done, and the
    counters. Calls answer on `finished`; an answer is taken only from a job's latest attempt."""

    def __init__(self, fn, jobs: list, retries: int, what: str | None = None):
        self.fn, self.jobs, self.retries, self.what = fn, jobs, retries, what
        self.results: list = [None] * len(jobs)
        self.tries = [0] * len(jobs)
        self.counters = {"errors": 0, "timeouts": 0, "retries": 0, "failed": 0, "over_rollout_dropped": 0}
        self.last_error = None
        # whose failure the last error says it is (an exception's `failure_source`: a reward
        # model's dead worker), None where it says nothing: the caller's source then
        self.last_source = None
        self.logged: set[str] = set()  # each error once: a broken reward fails every call alike
        self.repeats = 0
        self.late = 0  # calls timed out (the first is logged)
        self.todo = list(range(len(jobs)))
        self.running: dict[int, float] = {}  # job -> start time
        self.tokens: dict[int, object] = {}  # job -> its latest call's token (_Threads)
        self.finished: queue.Queue = queue.Queue()  # (job, attempt, ok, value)
        self.done = 0

    def call(self, i: int, attempt: int) -> tuple:
        """(job, attempt, ok, its result or error), delivered to `finished`."""
        try:
            return i, attempt, True, self.fn(self.jobs[i])
        except BaseException as e:  # a failing reward function must not end the run; nor its
            # sys.exit() or KeyboardInterrupt (Ctrl-C reaches the main thread only): an error of
            # the call, not a thread that dies and a call that times out
            return i, attempt, False, e

    def failed(self, i: int, retry: bool = True) -> None:
        if retry and self.tries[i] <= self.retries:
            self.counters["retries"] += 1
            self.todo.append(i)
        else:
            self.counters["failed"] += 1
            self.done += 1

    def start(self, runners: int) -> None:
        """Start waiting jobs while fewer than `runners` run."""
        while self.todo and len(self.running) < runners:
            i = self.todo.pop(0)
            self.tries[i] += 1
            self.running[i] = time.monotonic()
            self.tokens[i] = _THREADS.start(self.call, (i, self.tries[i]), self.finished.put)

    def take_answer(self) -> None:
        """Take one call's answer, waiting for it at most 0.01 s (the loop then checks timeouts)."""
        try:
            i, attempt, ok, value = self.finished.get(timeout=0.01)
        except queue.Empty:
            return
        if i in self.running and attempt == self.tries[i]:  # not a late answer from an abandoned call
            del self.running[i]
            if ok:
                self.results[i] = value
                self.done += 1
            else:
                self.counters["errors"] += 1
                self.last_error = describe_error(value)
                self.last_source = getattr(value, "failure_source", None)
                if self.last_error in self.logged:
                    self.repeats += 1
                else:
                    self.logged.add(self.last_error)
                    log.warning("job %d attempt %d raised %s", i, attempt, self.last_error)
                # a reward of the wrong type (rft.rewards.scoring.wrong_type) returns it again: a bug, not flakiness
                self.failed(i, getattr(value, "retry", True))

    def abandon_late(self, now: float, timeout: float) -> None:
        """Calls running longer than `timeout` no longer hold a runner: they time out."""
        for i, t0 in list(self.running.items()):
            if now - t0 > timeout:
                del self.running[i]
                self.counters["timeouts"] += 1
                if _THREADS.abandon(self.tokens[i], now, timeout) > MAX_HUNG_CALLS:
                    raise RunError(self.too_many_hung(i, timeout))
                # a hanging reward shows here alone (it raised nothing): name the key that bounds it, once
                # a step (a reward that hangs on every task would log a line per call and retry)
                if not self.late:
                    log.warning("job %d attempt %d timed out after %.1f s (explorer.max_timeout: its generation and "
                                "reward together)", i, self.tries[i], timeout)
                self.late += 1
                self.failed(i)

    def abandon_all(self, now: float, timeout: float) -> None:
        """over_rollout's cut: the calls still running no longer hold the step, and keep their
        threads as timed-out ones do: rollout/hung_calls, under the same bound."""
        for i in list(self.running):
            del self.running[i]
            if _THREADS.abandon(self.tokens[i], now, timeout) > MAX_HUNG_CALLS:
                raise RunError(self.too_many_hung(i, timeout))

    def too_many_hung(self, i: int, timeout: float) -> str:
        if self.what:  # the reward's: its job is (prompt, responses, task)
            what = f"calls of {self.what} (the last on task {getattr(self.jobs[i][2], 'task_id', '?')!r})"
        else:
            what = "calls of the workflow's jobs (an environment's steps, say)"
        return (f"{MAX_HUNG_CALLS + 1} {what} ran past explorer.max_timeout ({timeout:g} s) and have not returned "
                f"{timeout:g} s after that. "
                f"A call past the timeout is abandoned, not stopped (Python cannot stop a thread): each keeps its "
                f"thread and what it holds, and a call that hangs on a task hangs there again every epoch, so the "
                f"run stops before they pile up. Give the function a timeout of its own (a request's timeout, a "
                f"bound on its loop), or raise explorer.max_timeout if it is only slow; then run the same command "
                f"again to resume from the newest checkpoint.")


def describe_error(e: BaseException) -> str:
    """`Type: message`, and the line of the study's code that raised it (a reward function's), so
    that the run's last message says where to look."""
    where = study_frame(e)
    return f"{type(e).__name__}: {e}" + (f" ({where.filename}, line {where.lineno})" if where else "")


def run_jobs(fn, jobs: list, runners: int, timeout: float, retries: int,
             min_done: int | None = None, wait_after_min: float = 0.0, what: str | None = None):
    """`fn(job)` for every job on at most `runners` threads at once; returns (results, counters).

    A call that raises, or runs longer than `timeout` seconds, is retried up to `retries` times;
    then its result is None. A timed-out call is abandoned, not killed (Python cannot stop a
    thread): it keeps its thread until it returns, but no longer holds a runner or the step.
    The calls run on `_THREADS`, threads kept from one call of run_jobs to the next.
    With `min_done`, once that many jobs have finished the rest get `wait_after_min` seconds more
    and are then dropped (explorer.over_rollout; counters["dropped_jobs"] lists them, if any).
    """
    run = _JobRun(fn, jobs, retries, what)
    min_reached_at = None
    while run.todo or run.running:
        run.start(runners)
        run.take_answer()
        now = time.monotonic()
        run.abandon_late(now, timeout)
        if min_done is not None and run.done >= min_done:
            min_reached_at = min_reached_at or now
            if now - min_reached_at >= wait_after_min and (run.todo or run.running):
                run.counters["over_rollout_dropped"] = len(run.todo) + len(run.running)
                run.counters["dropped_jobs"] = sorted([*run.todo, *run.running])  # not a count: which
                run.abandon_all(now, timeout)
                break
    if run.late > 1:
        log.warning("%d more calls timed out (the first is logged above, once a step; rollout/timeouts counts them, "
                    "rollout/hung_calls those still running)", run.late - 1)
    if run.repeats:
        log.warning("%d more calls raised an error logged above (each error is logged once a step; rollout/errors "
                    "counts them)", run.repeats)
    if run.last_error is not None:
        run.counters["last_error"] = run.last_error  # a string: for the message when every task fails
    if run.last_source is not None:
        run.counters["last_source"] = run.last_source
    return run.results, run.counters


def last_failure(counters: dict, source: str) -> tuple:
    """(whose failure, the last error) of run_jobs' counters, taken out of them: the last error's own
    failure_source where it has one (rft.rewards.reward_model.WorkerDied), else `source` (reward,
    workflow); what rft.runtime.faults.culprit names when every task failed."""
    own = counters.pop("last_source", None)
    return own or source, counters.pop("last_error", None)


def rollout_metrics(exps: list, groups: list, counters: dict, elapsed: float) -> dict:
    """Metrics of one step's rollouts (from all explorers)."""
    # plain Python, not torch: the runner computes these in a process that never imports torch
    rewards = [float(e.reward) for e in exps]
    lengths = [e.response_length for e in exps]
    # a step whose every task failed scored nothing: it logs no reward (a 0 there would read as a
    # real reward in plots, reports and a sweep's objective), only the failure counts below
    m = {} if not exps else {
        "reward/mean": math.fsum(rewards) / len(rewards),
        "reward/std": statistics.stdev(rewards) if len(exps) > 1 else 0.0,  # n - 1 in the denominator
        "reward/min": min(rewards),
        "reward/max": max(rewards),
        "response_length/mean": sum(lengths) / len(lengths),
        "response_length/max": float(max(lengths)),
        "response_length/min": float(min(lengths)),  # verl's too: a collapse to short answers shows here first
    }
    m |= {
        "rollout/truncated_frac": sum(e.info.get("finish_reason") == "length" for e in exps) / max(len(exps), 1),
        "rollout/tokens_per_s": sum(lengths) / max(elapsed, 1e-9),
        "rollout/zero_variance_group_frac": sum(map(_flat, groups)) / max(len(groups), 1),
        # prompts longer than model.max_prompt_tokens, cut from the left (one per task)
        "rollout/truncated_prompts": sum(bool(g[0].info.get("prompt_truncated")) for g in groups),
        "rollout/experiences": len(exps),
    }
    # Dr. GRPO's length claim (experiments/algorithm_claims): correct (reward >= 1, a 0/1 verifier's
    # full credit; a shaped reward may stay under it) and incorrect responses' lengths apart; a step
    # with none of a kind logs no value for it, not a 0 that would pull the mean over seeds down
    for kind, part in (("correct", [e for e in exps if e.reward >= 1.0]), ("incorrect", [e for e in exps if e.reward < 1.0])):
        if part:
            m[f"response_length/{kind}_mean"] = sum(e.response_length for e in part) / len(part)
    # served rewards' counters (rft/rewards/scoring.py) are named already: reward/<part>/<counter>
    m.update({k if k.startswith("reward/") else f"rollout/{k}": v for k, v in counters.items()})
    # each reward part (rft/rewards/scoring.py), shaping's overlong penalty included
    m.update(part_metrics(exps))
    m.update(conversation_metrics(exps))
    return m


def step_metrics(exps: list, counters: dict, explorers: int) -> dict:
    """One explore step's metrics from what its explorers returned (their counters summed)."""
    # groups of this step: explorers return whole groups, one after another
    groups: dict = {}
    for e in exps:
        groups.setdefault(e.group_id, []).append(e)
    m = rollout_metrics(exps, list(groups.values()), counters, counters.get("explore_s", 0.0) / max(explorers, 1))
    # per explorer (they run side by side)
    for k in ("reward_s", "generate_s", "sync_load_s", "sync_check_s"):
        if k in counters or k in ("reward_s", "generate_s"):  # the sync's: after a sync only
            m[f"timing/{k}"] = counters.get(k, 0.0) / max(explorers, 1)
    if "max_memory_gb" in counters:
        m["perf/explorer_max_memory_gb"] = counters["max_memory_gb"]
    for k in ("explore_s", "reward_s", "workflow_s", "generate_s", "sync_load_s", "sync_check_s", "max_memory_gb"):
        m.pop(f"rollout/{k}", None)
    if "rollout/max_sampling_tries" in m:
        m["rollout/sampling_tries"] = m.pop("rollout/max_sampling_tries")
    return m


def task_rows_of(n: int, per_step: int, step: int, seed: int, in_order: bool) -> list[int]:
    """Step `step`'s task rows: epoch-wise shuffles seeded by (seed, epoch); `in_order` (the task
    pipeline's curriculum_order): the rows in their order, epoch after epoch."""
    if in_order:
        pos = step % (n // per_step)
        return list(range(pos * per_step, (pos + 1) * per_step))
    return epoch_batch(n, per_step, step, lambda epoch: step_seed(seed, epoch, salt=1))


def extra_rows_of(n: int, drawn: list[int], step: int, seed: int, in_order: bool, count: int) -> list[int]:
    """DAPO dynamic sampling's extra task rows of step `step`, in the order its tries take them:
    at most `count`, none of the step's `drawn` rows (all explorers'), none twice, so a step trains
    no task twice. `in_order` (the task pipeline's curriculum_order): the rows that follow the
    step's in that order, from its start again after its end, so that the extras keep to the
    order's place (easy to hard); else uniformly at random, seeded by (seed, step)."""
    taken = set(drawn)
    if in_order:
        after = drawn[-1] + 1
        return [r for r in ((after + j) % n for j in range(n)) if r not in taken][:count]
    rest = [r for r in range(n) if r not in taken]
    return random.Random(step_seed(seed, step, salt=99)).sample(rest, min(count, len(rest)))


def pass_rates(explorer: "Explorer", n: int) -> list[float]:
    """Each task's share of n rollouts (the training workflow, sampling and reward) whose reward is
    >= the taskset's pass_threshold, per rollout; a failed task counts 0 (the task pipeline's
    llm_difficulty_score_filter, rft/runtime/pipelines.py)."""
    ts = explorer.cfg.buffer.explorer_input.taskset
    groups = explorer._run(ts, explorer.scorer, explorer.taskset, n, 0, 3, {})
    return [sum(r >= ts.pass_threshold for r, _ in s) / len(s) for s in (rollout_samples(g, n) for g in groups)]


def vocab_size(engine, tokenizer) -> int | None:
    """The ids the trainer's embedding takes: the model's vocab_size where the engine says it (hf,
    vLLM; it may be padded past the tokenizer's), else the tokenizer's length (None: neither known)."""
    hf_config = getattr(getattr(engine, "model", None), "config", None)
    llm_config = getattr(getattr(engine, "llm", None), "model_config", None)
    if llm_config is not None:
        return int(llm_config.get_vocab_size())
    return getattr(hf_config, "vocab_size", None) or (len(tokenizer) if hasattr(tokenizer, "__len__") else None)


def token_budget(model_cfg, workflow: str, args: dict) -> int | None:
    """The most tokens an experience of this workflow may hold: the context the run is sized for
    (model.max_model_len, else the prompt's and the response's budgets); None for an agent's (its
    calls are bounded by the model's context: rft/serving/openai_api.py). A multi-turn
    conversation's workflow_args.max_total_tokens is at most that context (the plan refuses a
    larger one: vLLM's engine holds no more), so the max below is the context; it stays so a
    budget that reaches here unplanned is the larger, as before, not a refusal of every experience."""
    if WORKFLOWS.info(workflow).endpoint:
        return None
    context = model_cfg.max_model_len or model_cfg.max_prompt_tokens + model_cfg.max_response_tokens
    return max(context, int(args.get("max_total_tokens") or 0))


class Explorer(WeightsMixin):
    def __init__(self, cfg, weights_path: str | None = None, version: int = 0, shard: int = 0):
        import torch

        self.cfg = cfg
        # denormal floats (tiny Adam moments, decayed weights) make CPU math many times slower
        torch.set_flush_denormal(True)
        self.tokenizer = load_tokenizer(cfg.model)
        rollout = cfg.explorer.rollout_model
        self.engine = engine_class(rollout.engine_type)(cfg.model, rollout, self.tokenizer, weights_path,
                                                   device=local_device(cfg.cluster))
        # explorer.auxiliary_models: engines a workflow may call, on this explorer's device
        self.auxiliary = {}
        for aux in cfg.explorer.auxiliary_models:
            from rft.models import ensure_model
            from rft.rollout.workflows.single_turn import Auxiliary

            ensure_model(aux.model)
            tok = load_tokenizer(aux.model, chat=False)  # a workflow may prompt it with plain text
            engine = engine_class(aux.rollout_model.engine_type)(aux.model, aux.rollout_model, tok, None,
                                                               device=local_device(cfg.cluster))
            self.auxiliary[aux.name] = Auxiliary(aux.name, engine, tok, aux.model.max_response_tokens)
        self._openai = None
        inp = cfg.buffer.explorer_input
        self.taskset = load_tasks(taskset_of(cfg), "buffer.explorer_input.taskset")  # a task pipeline's output
        # each taskset's reward (rft/rewards/scoring.py; served rewards connect here, once)
        self.scorer = build_scorer(spec_of(inp.taskset.reward_fn, inp.default_reward_fn_type), "buffer.explorer_input.taskset.reward_fn")
        self.eval_tasksets = [
            (ts, load_tasks(ts, f"buffer.explorer_input.eval_tasksets[{i}]"),
             build_scorer(spec_of(ts.reward_fn, inp.default_reward_fn_type), f"buffer.explorer_input.eval_tasksets[{i}].reward_fn"))
            for i, ts in enumerate(inp.eval_tasksets)
        ]
        self.version = version  # the trainer step whose weights this explorer serves
        ex, sc = cfg.explorer, cfg.synchronizer
        # generation and weight loads take turns on the engine; with partial rollouts a load comes
        # in between two chunks of an explore step (its call runs beside the explore's: rft.runtime.actors)
        self.gate = WeightGate(version, fixed=bool(ex.partial_rollout and sc.fixed_interrupts))
        self.partial = (PartialRollouts(self.engine, self.tokenizer, self.gate, ex.partial_chunk_tokens,
                                        cfg.model.max_response_tokens) if ex.partial_rollout and cfg.mode == "both" else None)
        self.sync_s: dict[str, float] = {}  # the loads and checks since the last explore (_load)
        self.shard, self.num_shards = shard, rollout.engine_num
        log.info("explorer %d/%d ready: %d tasks, %d eval tasksets", shard, self.num_shards,
                 len(self.taskset), len(self.eval_tasksets))

    def openai_server(self):
        """The OpenAI-compatible server (explorer.rollout_model.enable_openai_api), started on first
        use and kept for the explorer's life; None when it is off."""
        rollout = self.cfg.explorer.rollout_model
        if not rollout.enable_openai_api:
            return None
        if self._openai is None:
            from rft.serving.openai_api import OpenAIServer, tool_parsers

            models = {"policy": (self.engine, self.tokenizer)}
            # an Auxiliary's generate takes its lock: the server and workflows share the engine
            models.update({name: (a, a.tokenizer) for name, a in self.auxiliary.items()})
            self._openai = OpenAIServer(models, "policy", self.cfg.buffer.explorer_input.taskset.rollout_args,
                                        self.cfg.model.max_response_tokens, history=rollout.enable_history,
                                        tool_parsers=tool_parsers(self.cfg)).start()
            log.info("OpenAI-compatible endpoint at %s (token not logged)", self._openai.url)
        return self._openai

    def ping(self) -> int:
        return os.getpid()

    def token_budget_warnings(self) -> list[str]:
        """One sentence per taskset whose first prompts are longer than model.max_prompt_tokens
        (they will be cut, and a run would not say so). Checked here, where the tokenizer is
        loaded anyway: in the driver it would cost the driver of a Ray run torch's memory."""
        inp, todo = self.cfg.buffer.explorer_input, []
        if self.cfg.mode in ("both", "explore"):
            todo.append((inp.taskset, "buffer.explorer_input.taskset"))
        if self.cfg.mode in ("both", "train"):
            todo += [(ts, f"buffer.explorer_input.eval_tasksets[{i}]") for i, ts in enumerate(inp.eval_tasksets)]
        texts = (budget_report(ds, self.tokenizer, self.cfg.model, False, where) for ds, where in todo)
        return [t for t in texts if t]

    def task_rows(self, step: int) -> list[int]:
        """This explorer's share of step `step`'s tasks, as rows of the taskset (`task_rows_of`)."""
        rows = task_rows_of(len(self.taskset), self.cfg.buffer.batch_size, step, self.cfg.seed, keeps_order(self.cfg))
        return rows[self.shard :: self.num_shards]

    def extra_tries(self, step: int, rows: list[int] | None = None) -> list[list[int]]:
        """This explorer's task rows for each of dynamic sampling's extra tries of step `step`: the
        step's extras (with the online curriculum, `rows` past batch_size, drawn by its weights;
        else `extra_rows_of`) batch_size a try, of which it takes its share as of the step's own
        tasks. Every explorer computes the same extras, so two never run the same task."""
        bs, tries = self.cfg.buffer.batch_size, self.cfg.algorithm.dynamic_sampling_max_tries
        if tries <= 1:
            return []
        if rows is None:
            drawn = task_rows_of(len(self.taskset), bs, step, self.cfg.seed, keeps_order(self.cfg))
            rows = drawn + extra_rows_of(len(self.taskset), drawn, step, self.cfg.seed, keeps_order(self.cfg),
                                         (tries - 1) * bs)
        return [rows[i : i + bs][self.shard :: self.num_shards] for i in range(bs, len(rows), bs)]

    def tasks_for_step(self, step: int):
        return [self.taskset[i] for i in self.task_rows(step)]

    def _run(self, ts_cfg, scorer, tasks, n: int, step: int, salt: int, counters: dict, min_done=None, engine=None,
             dropped_ids: set | None = None):
        """Run the workflow on `tasks`; returns one list of experiences per task (None: failed, or
        dropped by over_rollout: their task ids go into `dropped_ids`)."""
        ex = self.cfg.explorer

        dropped = 0  # tasks over_rollout dropped (None, but not failed)

        def merge(c: dict, source: str) -> None:
            nonlocal dropped
            if c.get("errors") or c.get("timeouts"):
                # whose failure: the reward's (or its reward model's), or the workflow's own jobs'
                # (a multi-turn environment); the message None: timeouts only
                counters["last_error"] = last_failure(c, source)
            last_failure(c, source)  # taken out where there was none: they are not counts
            c.pop("failed", None)  # counted below, once per task, from what the workflow returned
            dropped += c.get("over_rollout_dropped", 0)
            for k, v in [*c.items(), *scorer.take_counters().items()]:
                counters[k] = counters.get(k, 0) + v

        def score(jobs):
            t0 = time.perf_counter()
            results, c = run_jobs(lambda job: scorer(*job), jobs, ex.runner_per_model, ex.max_timeout, ex.max_retry_times,
                                  min_done, ex.over_rollout.wait_after_min, what=scorer.describe())
            gone = {getattr(jobs[i][2], "task_id", None) for i in c.pop("dropped_jobs", [])}  # job: (prompt, responses, task)
            (set() if dropped_ids is None else dropped_ids).update(gone)
            counters["reward_s"] = counters.get("reward_s", 0.0) + time.perf_counter() - t0
            merge(c, "reward")
            return results

        def call(fn, jobs, runners=None):
            results, c = run_jobs(fn, jobs, runners or ex.runner_per_model, ex.max_timeout, 0)
            merge(c, "workflow")
            return results

        ctx = WorkflowContext(
            tokenizer=self.tokenizer,
            n=n,
            rollout_args=ts_cfg.rollout_args,
            max_prompt_tokens=self.cfg.model.max_prompt_tokens,
            policy_version=self.version,
            seed=step_seed(self.cfg.seed, step, salt),
            step=step,
            score=score,
            args=dict(ts_cfg.workflow_args),
            max_response_tokens=self.cfg.model.max_response_tokens,
            call=call,
            openai=self.openai_server(),
            auxiliary=self.auxiliary,
        )
        t0 = time.perf_counter()
        out = self._call_workflow(ts_cfg.workflow, tasks, ctx, step, engine or self.engine)
        counters["failed"] = counters.get("failed", 0) + sum(g is None for g in out) - dropped
        counters["workflow_s"] = counters.get("workflow_s", 0.0) + time.perf_counter() - t0
        return out

    def _call_workflow(self, name: str, tasks, ctx, step: int, engine) -> list:
        """The workflow's output for `tasks`, checked; an error of its own stops the run."""
        try:
            out = resolve(WORKFLOWS, name, "workflow")(tasks, engine, ctx)
        except (ConfigError, RunError):
            raise  # a mistake of the study's own code, named (an environment's wrong answer, calls that hang): as it is
        except Exception as e:
            # a reward that raises is one failed task (ctx.score retries it); a workflow that
            # raises has no task to blame: the step cannot be made. The traceback goes to the
            # log file only (INFO): the terminal gets the one paragraph below
            log.info("workflow %s raised at step %d", name, step, exc_info=True)
            raise RunError(
                f"workflow {name!r} raised {type(e).__name__}: {e} (at step {step}; the traceback "
                f"is in the explorer's log under <stage>/log/). Fix the workflow, then run the same "
                f"command again to resume from the newest checkpoint."
            ) from None
        check_output(out, tasks, name, vocab_size(self.engine, self.tokenizer), token_budget(self.cfg.model, name, ctx.args))
        return out

    def _rollouts(self, tasks, n: int, step: int, salt: int, counters: dict, lost: list) -> list[list]:
        """Training rollouts, reward-shaped, as one list per task (a group); failed tasks (and those
        over_rollout dropped) left out, a failed task's n rollouts each added to `lost` as a fail."""
        ts, algo = self.cfg.buffer.explorer_input.taskset, self.cfg.algorithm
        ratio = self.cfg.explorer.over_rollout.ratio
        min_done = math.ceil((1 - ratio) * len(tasks)) if ratio > 0 else None
        dropped: set = set()
        out = self._run(ts, self.scorer, tasks, n, step, salt, counters, min_done, dropped_ids=dropped)
        # a task over_rollout dropped is no outcome: its rollouts did not finish, fail or pass (as a
        # fail, a task slow to score was drawn less for its timing: rft/data/curriculum.py)
        lost += [(task.task_id, 0) for task, g in zip(tasks, out) if g is None and task.task_id not in dropped
                 for _ in range(n)]
        groups = [g for g in out if g is not None]
        counters["generated"] = counters.get("generated", 0) + n * len(tasks)  # asked for, kept or not: its cost
        apply_overlong([e for g in groups for e in g], algo, ts.rollout_args.max_tokens or self.cfg.model.max_response_tokens)
        return groups

    def explore(self, step: int, rows: list[int] | None = None):
        """This explorer's experiences of step `step` and counters (tasks `rows`: the online curriculum's
        draw, its first batch_size the step's tasks, the rest dynamic sampling's extras)."""
        t0, busy0 = time.perf_counter(), self.engine.busy_s
        ts = self.cfg.buffer.explorer_input.taskset
        n = ts.repeat_times or self.cfg.algorithm.repeat_times
        counters: dict = {}
        # salts keep the explorers' sampling seeds apart (shard 0 keeps the single-explorer seeds)
        salt = 1000 * self.shard
        if self.partial is not None:
            return self._explore_partial(step, n, salt, counters, t0, busy0)
        own = self.task_rows(step) if rows is None else rows[: self.cfg.buffer.batch_size][self.shard :: self.num_shards]
        tasks = [self.taskset[i] for i in own]
        lost: list = []  # the outcomes of rollouts the step's experiences will not hold
        groups = self._rollouts(tasks, n, step, salt, counters, lost)
        tries = 1
        if self.cfg.algorithm.dynamic_sampling_max_tries > 1:
            # DAPO dynamic sampling: groups whose rewards are all equal carry no signal; draw more
            # tasks until the batch is full of groups that do, or the tries (or the taskset) run
            # out (then the batch is topped up with flat groups, so its size never changes)
            keep = [g for g in groups if not _flat(g)]
            flat = [g for g in groups if _flat(g)]
            for extra in self.extra_tries(step, rows):
                if len(keep) >= len(tasks) or not extra:
                    break
                more = self._rollouts([self.taskset[i] for i in extra], n, step, 100 + tries + salt, counters, lost)
                keep += [g for g in more if not _flat(g)]
                flat += [g for g in more if _flat(g)]
                tries += 1
            groups = (keep + flat)[: len(tasks)]
            dropped = [e for g in (keep + flat)[len(tasks):] for e in g]
            lost += rollout_outcomes(dropped, self.cfg.buffer.explorer_input.taskset.pass_threshold)
        # the most tries an explorer took (a sum over explorers would read as more than max_tries)
        counters["max_sampling_tries"] = tries
        if rows is not None:
            # the online curriculum's draw: it learns of every task it drew, also of those the
            # experiences leave out (rft/data/curriculum.py OnlineCurriculum.observe)
            counters["unreturned"] = lost
        return self._explored(groups, counters, t0, busy0)

    def _explored(self, groups: list, counters: dict, t0: float, busy0: float):
        """An explore step's experiences and counters, with its time, memory and weight loads."""
        counters["failed_tasks"], counters["hung_calls"] = counters.pop("failed", 0), len(_THREADS.hung)
        counters["explore_s"] = time.perf_counter() - t0
        counters["generate_s"] = self.engine.busy_s - busy0
        # this process's (with vLLM, not its engine's own processes); the explorers' largest
        counters["max_memory_gb"] = peak_memory(local_device(self.cfg.cluster)) / 2**30
        counters.update(self.sync_s)  # the weights this step was explored with: their load and check
        self.sync_s = {}
        return [e for g in groups for e in g], counters

    def _explore_partial(self, step: int, n: int, salt: int, counters: dict, t0: float, busy0: float):
        """explorer.partial_rollout: this step's tasks join those in flight; the step ends with
        batch_size finished groups (rft/rollout/partial.py), built and scored by the workflow."""
        ts, sc = self.cfg.buffer.explorer_input.taskset, self.cfg.synchronizer
        quota = len(self.task_rows(step))

        def share(s: int):  # this explorer's tasks of explore step s, and their prompts
            rows = self.task_rows(s)
            prompts = prompt_ids(self.tokenizer, [self.taskset[i].messages for i in rows])
            return rows, [p[-self.cfg.model.max_prompt_tokens:] for p in prompts]

        # explorer.partial_in_flight steps' worth of groups in flight: the short ones fill the step
        self.partial.refill(math.ceil(quota * self.cfg.explorer.partial_in_flight), n, share)
        opened = [not (self.gate.fixed and step >= 1)]

        def interrupt(chunks: int) -> None:  # the test mode: version `step` after the first chunk
            if not opened[0]:
                opened[0] = True
                self.gate.open_at(step, sc.sync_timeout)

        done, c = self.partial.run(quota, ts.rollout_args, step_seed(self.cfg.seed, step, salt), interrupt)
        interrupt(0)  # no chunk ran (the finished groups were in flight already): take it now
        counters.update(c)
        groups = []
        for admitted in sorted({g.step for g in done}):  # each group as the step that admitted it
            cohort = [g for g in done if g.step == admitted]
            out = self._run(ts, self.scorer, [self.taskset[g.task_index] for g in cohort], n, admitted, salt,
                            counters, engine=Replay(cohort))
            groups += [g for g in out if g is not None]
        apply_overlong([e for g in groups for e in g], self.cfg.algorithm,
                       ts.rollout_args.max_tokens or self.cfg.model.max_response_tokens)
        exps, counters = self._explored(groups, counters, t0, busy0)
        counters["partial_state"] = self.partial.state()
        return exps, counters

    def open_gate(self) -> None:
        """synchronizer.fixed_interrupts with no explore step left: weights go in as they come."""
        self.gate.open_for_good()

    def load_partial(self, state: dict | None) -> None:
        self.partial.load(state)  # as a checkpoint, or the driver for a restarted explorer, kept them

    def evaluate(self, step: int, save_dir: str | None = None) -> dict:
        # no weight load in the middle of an eval (partial rollouts load between chunks)
        with self.gate.generating():
            return self._evaluate(step, save_dir)

    def _evaluate(self, step: int, save_dir: str | None = None) -> dict:
        return evaluate_sets(self, step, save_dir)  # rft/rollout/evaluation.py

    def node(self) -> str:
        return node_id()

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()
