"""Requests to one engine, sampled together: the OpenAI endpoint's batching (rft/serving/openai_api.py).

An agent's requests arrive one at a time, and an engine call of one row costs nearly what a call of
a hundred does (the tiny model on CPU: a conversation turn alone took 30-50 ms, the calculator
study's 128 at once 0.1 s), so the agent workflow cost ~10x the multi-turn workflow per step
(experiments/agent_cost/). Here each request waits until every rollout that is open on the
server (its agent running) has a request waiting, to this model or another one the server serves,
as the multi-turn workflow takes a turn of every conversation at once; then the waiting requests
go to the engine together, one call per
sampling setting (n, temperature, top_p, top_k, max_tokens, stop), in the order of their rollout
keys, seeded by their seeds. The batch is then the same in every run of the same seeds, and a
request alone is sampled as `engine.generate([prompt], n, args, seed)` samples it.

A request also goes after `idle_s` with no new request and no rollout closed (an agent busy in a
slow tool, or one that stopped calling): batching never waits for an agent that does not ask, and
a batch so cut is the one place where timing decides which requests share a call.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

IDLE_S = 0.5  # agents starting up send their first request some ms apart; a tool call may take seconds


@dataclass
class Request:
    rollout: str
    prompt: list[int]
    n: int
    args: object  # temperature, top_p, top_k, max_tokens, stop
    seed: int
    order: int
    samples: list | None = None
    error: BaseException | None = None
    done: bool = field(default=False)

    def setting(self) -> tuple:
        a = self.args
        return self.n, a.temperature, a.top_p, a.top_k, a.max_tokens, tuple(a.stop or ())


class Asking:
    """Which rollouts have a request waiting or being sampled, on any of the server's engines; the
    server's `open_rollouts()` says which rollouts are open."""

    def __init__(self, open_rollouts):
        self.open_rollouts, self.lock, self.count = open_rollouts, threading.Lock(), {}

    def add(self, rollouts: list[str], k: int) -> None:
        with self.lock:
            for r in rollouts:
                self.count[r] = self.count.get(r, 0) + k
                if not self.count[r]:
                    del self.count[r]

    def everyone(self) -> bool:
        """Every open rollout has a request in flight."""
        with self.lock:
            return all(r in self.count for r in self.open_rollouts())


class Batcher:
    """`generate(rollout, prompt, n, args, seed)` for one engine, batched with the requests of the
    other open rollouts (module docstring)."""

    def __init__(self, engine, asking: Asking, idle_s: float = IDLE_S):
        self.engine, self.asking, self.idle_s = engine, asking, idle_s
        self.cond = threading.Condition()
        self.waiting: list[Request] = []
        self.busy = False  # a thread is running a batch on the engine
        self.last_event = time.monotonic()
        self.count = 0
        self.calls = 0  # engine calls made (a test reads how requests were batched)

    def poke(self) -> None:
        """A rollout opened or closed: the waiting requests may be complete now."""
        with self.cond:
            self.last_event = time.monotonic()
            self.cond.notify_all()

    def generate(self, rollout: str, prompt: list[int], n: int, args, seed: int) -> list:
        with self.cond:
            self.count += 1
            req = Request(rollout, prompt, n, args, seed, self.count)
            self.waiting.append(req)
            self.asking.add([rollout], 1)
            self.last_event = time.monotonic()
            self.cond.notify_all()
            while not req.done:
                if not self.busy and self.waiting and self._complete():
                    self._run_batch()
                else:
                    self.cond.wait(timeout=self.idle_s / 10)
        if req.error is not None:
            raise req.error
        return req.samples

    def _complete(self) -> bool:
        """Every open rollout has a request in flight, or nothing has happened here for idle_s."""
        return time.monotonic() - self.last_event >= self.idle_s or self.asking.everyone()

    def _run_batch(self) -> None:
        """The waiting requests on the engine (the condition's lock released meanwhile, so new
        requests queue for the next batch), one call per sampling setting."""
        batch, self.waiting, self.busy = sorted(self.waiting, key=lambda r: (r.rollout, r.order)), [], True
        self.cond.release()
        try:
            groups: dict[tuple, list[Request]] = {}
            for r in batch:
                groups.setdefault(r.setting(), []).append(r)
            for reqs in groups.values():
                seed = reqs[0].seed if len(reqs) == 1 else hash(tuple(r.seed for r in reqs)) % (2**31)
                try:
                    self.calls += 1
                    out = self.engine.generate([r.prompt for r in reqs], reqs[0].n, reqs[0].args, seed=seed)
                    for r, samples in zip(reqs, out):
                        r.samples = samples
                except BaseException as e:  # each request of the call answers the engine's error
                    for r in reqs:
                        r.error = e
        finally:
            self.cond.acquire()
            for r in batch:
                r.done = True
            self.asking.add([r.rollout for r in batch], -1)  # before any waiting request looks again
            self.busy = False
            self.last_event = time.monotonic()
            self.cond.notify_all()
