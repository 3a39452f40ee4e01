"""Partial rollouts (explorer.partial_rollout): generation that new weights can interrupt.

Responses are generated `explorer.partial_chunk_tokens` at a time, each chunk by the engine's own
`generate` (one sample per row, the prompt being the task's prompt followed by the row's tokens so
far: the engine encodes that prefix again under whatever weights it holds now). Between chunks the
engine is free for a weight load (`WeightGate`): the rows keep their tokens, and each token records
the version that sampled it and its log-prob under that version. This is the same for every
engine (HF, vLLM): an interrupted request is resubmitted as a continuation of its own output.

An explore step admits its tasks into the rows in flight and returns as soon as `quota` groups
(every sample of a task) are finished, oldest first; the unfinished ones go on in the next step
instead of holding this one (the long tail of response lengths no longer sets the step's time).
What is in flight is plain data (`state`, `load`): a checkpoint keeps it, and an explorer that Ray
restarted gets it back from the driver, so a task in flight is neither lost nor done twice.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from rft.rollout.engines.base import Sample


class WeightGate:
    """Generation and weight loads take turns on the engine.

    `generating()` holds the engine for one chunk (with partial rollouts) or one explore step;
    `loading()` waits until no chunk runs, and a chunk that wants to start while a load waits lets
    it go first (a load is never starved by back-to-back chunks). With `fixed` (the test mode
    synchronizer.fixed_interrupts) a load waits for `open_at(version)` instead, which the explorer
    calls at a fixed token count and which waits for that version to arrive.
    """

    def __init__(self, version: int = 0, fixed: bool = False):
        self.cond = threading.Condition()
        self.version = version  # the version the engine holds (the explorer sets it after a load)
        self.fixed, self.open = fixed, not fixed
        self.generating_now, self.loads_waiting = False, 0
        self.loader: int | None = None  # the thread loading now (a load inside a load passes through)

    @contextmanager
    def generating(self):
        with self.cond:
            while self.loads_waiting and self.open or self.loader is not None:
                self.cond.wait()
            self.generating_now = True
        try:
            yield self.version
        finally:
            with self.cond:
                self.generating_now = False
                self.cond.notify_all()

    @contextmanager
    def loading(self):
        me = threading.get_ident()
        if self.loader == me:  # receive_weights -> update_weights: one load
            yield
            return
        with self.cond:
            self.loads_waiting += 1
            while self.generating_now or not self.open or self.loader is not None:
                self.cond.wait()
            self.loads_waiting -= 1
            self.loader = me
        try:
            yield
        finally:
            with self.cond:
                self.loader = None
                self.cond.notify_all()

    def set_version(self, version: int) -> None:
        with self.cond:
            self.version = version
            self.cond.notify_all()

    def open_for_good(self) -> None:
        """Test mode: no explore step is left to open the gate; loads go in whenever they come."""
        with self.cond:
            self.fixed, self.open = False, True
            self.cond.notify_all()

    def open_at(self, version: int, timeout: float) -> None:
        """Test mode: let loads in until the engine holds `version`, then close again."""
        with self.cond:
            self.open = True
            self.cond.notify_all()
            ok = self.cond.wait_for(lambda: self.version >= version, timeout)
            self.open = False
        if not ok:
            raise TimeoutError(f"synchronizer.fixed_interrupts: version {version} did not arrive within {timeout:g} s")


@dataclass
class Row:
    """One sample in flight: its tokens so far, their log-probs and versions; `finish` once ended."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None


@dataclass
class Group:
    """A task's n samples in flight, with the step that admitted it (its group id and seed)."""
    task_index: int  # the task's row in the explorer's taskset
    prompt: list[int]
    step: int
    rows: list[Row]

    @property
    def done(self) -> bool:
        return all(r.finish for r in self.rows)


def stop_cut(tokenizer, prompt: list[int], before: list[int], new: list[int], stop: list[str]) -> int | None:
    """With stop strings, the number of `new` tokens to keep when a stop string ends inside them
    after `before` (a string split between two chunks, which the engine, seeing one chunk, cannot
    find); None when none does."""
    if not stop or not new:
        return None
    start = len(tokenizer.decode(prompt, skip_special_tokens=True))
    seen = tokenizer.decode(prompt + before, skip_special_tokens=True)[start:]
    for j in range(1, len(new) + 1):
        text = tokenizer.decode(prompt + before + new[:j], skip_special_tokens=True)[start:]
        if any(s in text[max(0, len(seen) - len(s) + 1):] for s in stop):
            return j
    return None


class PartialRollouts:
    """The groups in flight on one explorer and the chunk loop that advances them."""

    def __init__(self, engine, tokenizer, gate: WeightGate, chunk_tokens: int, max_tokens: int):
        self.engine, self.tok, self.gate = engine, tokenizer, gate
        self.chunk_tokens, self.max_tokens = chunk_tokens, max_tokens
        self.groups: list[Group] = []
        self.chunks = 0  # chunks generated so far: each one's seed (the same in a resumed run)
        # the next task to admit: (explore step, position in this explorer's share of it)
        self.cursor = [0, 0]

    def state(self) -> dict:
        return {"groups": [asdict(g) for g in self.groups], "chunks": self.chunks, "cursor": list(self.cursor)}

    def load(self, state: dict | None) -> None:
        state = state or {}
        self.groups = [Group(g["task_index"], g["prompt"], g["step"], [Row(**r) for r in g["rows"]])
                       for g in state.get("groups", [])]
        self.chunks = state.get("chunks", 0)
        self.cursor = list(state.get("cursor", [0, 0]))

    def admit(self, task_indices: list[int], prompts: list[list[int]], n: int, step: int) -> None:
        self.groups += [Group(i, p, step, [Row() for _ in range(n)]) for i, p in zip(task_indices, prompts)]

    def refill(self, capacity: int, n: int, share) -> None:
        """Admit the next tasks, in the order of the explore steps they belong to, until `capacity`
        groups are in flight (finished ones not yet returned count: they are the next step's first).
        `share(step)`: (task rows, prompts) of this explorer's share of step."""
        while len(self.groups) < capacity:
            step, at = self.cursor
            rows, prompts = share(step)
            take = min(len(rows) - at, capacity - len(self.groups))
            self.admit(rows[at:at + take], prompts[at:at + take], n, step)
            self.cursor = [step + 1, 0] if at + take >= len(rows) else [step, at + take]

    def run(self, quota: int, args, seed: int, interrupt=None) -> tuple[list[Group], dict]:
        """Advance the rows in flight, a chunk at a time, until `quota` groups are done (or none is
        left in flight); returns the `quota` oldest done groups (taken out) and counters.
        `interrupt(chunks)`: called after each chunk of this call (the test mode's fixed pickup)."""
        calls, t0 = 0, time.perf_counter()
        while sum(g.done for g in self.groups) < quota and any(not g.done for g in self.groups):
            self._chunk(args, seed)
            calls += 1
            if interrupt is not None:
                interrupt(calls)
        done = [g for g in self.groups if g.done][:quota]
        taken = {id(g) for g in done}
        self.groups = [g for g in self.groups if id(g) not in taken]
        versions = {v for g in done for r in g.rows for v in r.versions}
        return done, {"partial_chunks": calls, "partial_carried": len(self.groups),
                      "max_token_versions": len(versions), "partial_s": time.perf_counter() - t0}

    def _chunk(self, args, seed: int) -> None:
        """One chunk: every unfinished row gets up to partial_chunk_tokens more tokens, all under
        the weights the engine holds now (the gate keeps a load out until the chunk ends)."""
        max_new = args.max_tokens or self.max_tokens
        live = [(g, r) for g in self.groups for r in g.rows if not r.finish]
        k = min(self.chunk_tokens, max(max_new - len(r.tokens) for _, r in live))
        chunk_args = _with_max(args, k)
        self.chunks += 1
        stop = list(getattr(args, "stop", None) or [])
        with self.gate.generating() as version:
            for j, bucket in enumerate(_buckets(live)):
                samples = self.engine.generate([g.prompt + r.tokens for g, r in bucket], 1, chunk_args,
                                               seed=(seed * 1_000_003 + self.chunks * 64 + j) % 2**63)
                for (g, r), [s] in zip(bucket, samples):
                    self._extend(g, r, s, version, max_new, stop)

    def _extend(self, g: Group, r: Row, s: Sample, version: int, max_new: int, stop: list[str]) -> None:
        new = s.token_ids[: max_new - len(r.tokens)]
        cut = stop_cut(self.tok, g.prompt, r.tokens, new, stop) if s.finish_reason != "stop" else None
        if cut is not None:
            new = new[:cut]
        r.tokens += new
        r.logprobs += list(s.logprobs[: len(new)])
        r.versions += [version] * len(new)
        if cut is not None or (s.finish_reason == "stop" and len(new) == len(s.token_ids)):
            r.finish = "stop"
        elif len(r.tokens) >= max_new:
            r.finish = "length"


def _buckets(live: list) -> list[list]:
    """The rows in flight in batches of similar prefix length (each at most twice its shortest):
    a batch is padded to its longest prefix, and a new row beside a 150-token one would cost as
    much as it (the tiny model, 200 rows x 16 tokens: 0.20 s from 24-token prefixes, 0.77 s from
    120-token ones)."""
    rows = sorted(live, key=lambda gr: len(gr[0].prompt) + len(gr[1].tokens))
    out: list[list] = []
    for gr in rows:
        if out and len(gr[0].prompt) + len(gr[1].tokens) <= 2 * (len(out[-1][0][0].prompt) + len(out[-1][0][1].tokens)):
            out[-1].append(gr)
        else:
            out.append([gr])
    return out


def _with_max(args, k: int):
    """A copy of rollout args (an OmegaConf node or a namespace) with max_tokens = k."""
    from types import SimpleNamespace

    fields = {name: getattr(args, name) for name in ("temperature", "top_p", "top_k") if hasattr(args, name)}
    fields["stop"] = list(getattr(args, "stop", None) or [])
    return SimpleNamespace(**fields, max_tokens=k)


class Replay:
    """An engine that returns finished groups' samples: the workflow (single_turn) builds and
    scores their experiences as it does a fresh generation's."""

    def __init__(self, groups: list[Group]):
        self.groups = groups
        self.busy_s = 0.0

    def generate(self, prompts, n, args, seed):
        if [g.prompt for g in self.groups] != [list(p) for p in prompts]:
            raise RuntimeError("partial rollouts: the workflow asked for other prompts than those generated")
        return [[Sample(r.tokens, r.logprobs, r.finish, r.versions) for r in g.rows] for g in self.groups]
