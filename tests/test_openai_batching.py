"""The OpenAI endpoint's batching (rft/serving/batching.py): the requests of the open rollouts go to
the engine together, in rollout order, one call per sampling setting; a request alone is sampled
as the engine samples it with its own seed; a rollout that does not ask holds nobody up for long."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from rft.serving.batching import Asking, Batcher

ARGS = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=4, stop=[])


class Recording:
    """An engine that answers each prompt with its own first id, recording each call."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, n, args, seed):
        self.calls.append(([p[0] for p in prompts], n, args.temperature, seed))
        return [[p[0]] * n for p in prompts]


def ask_together(batcher, requests):
    """Each (rollout, first id, args, seed) from a thread of its own, in the order given."""
    out, threads = {}, []
    for rollout, first, args, seed in requests:
        t = threading.Thread(target=lambda r=rollout, f=first, a=args, s=seed:
                             out.__setitem__(r, batcher.generate(r, [f, 9], 1, a, s)))
        t.start()
        threads.append(t)
        time.sleep(0.01)
    for t in threads:
        t.join()
    return out


def test_the_open_rollouts_requests_are_one_engine_call_in_rollout_order():
    engine, open_ = Recording(), ["a", "b", "c"]
    batcher = Batcher(engine, Asking(lambda: open_), idle_s=5.0)
    hot = SimpleNamespace(**{**vars(ARGS), "temperature": 0.5})
    # they arrive c, a, b; b asks at another temperature: two calls, each in rollout order
    out = ask_together(batcher, [("c", 3, ARGS, 30), ("a", 1, ARGS, 10), ("b", 2, hot, 20)])
    assert out == {"a": [1], "b": [2], "c": [3]}
    # a call of several is seeded by all their seeds (the same batch, the same seed, every run)
    assert engine.calls == [([1, 3], 1, 1.0, hash((10, 30)) % 2**31), ([2], 1, 0.5, 20)]


def test_a_request_alone_is_sampled_with_its_own_seed():
    engine, open_ = Recording(), ["a"]
    batcher = Batcher(engine, Asking(lambda: open_), idle_s=5.0)
    assert batcher.generate("a", [7, 9], 2, ARGS, 123) == [7, 7]
    open_.clear()  # its agent is done (take_history); a request under no open rollout goes at once
    assert batcher.generate("", [8, 9], 1, ARGS, 5) == [8]
    assert engine.calls == [([7], 2, 1.0, 123), ([8], 1, 1.0, 5)]


def test_a_rollout_that_does_not_ask_holds_the_others_up_for_idle_s_only():
    engine = Recording()
    batcher = Batcher(engine, Asking(lambda: ["a", "b", "quiet"]), idle_s=0.3)
    t = time.monotonic()
    assert ask_together(batcher, [("a", 1, ARGS, 1), ("b", 2, ARGS, 2)]) == {"a": [1], "b": [2]}
    # "quiet" never asked: a and b went together once nothing happened for 0.3 s
    assert 0.3 <= time.monotonic() - t < 2.0 and engine.calls == [([1, 2], 1, 1.0, hash((1, 2)) % 2**31)]


def test_an_engine_error_is_each_requests_error():
    class Broken:
        def generate(self, *a, **k):
            raise RuntimeError("out of memory")

    batcher = Batcher(Broken(), Asking(lambda: []), idle_s=5.0)
    try:
        batcher.generate("", [1], 1, ARGS, 0)
    except RuntimeError as e:
        assert str(e) == "out of memory"
    else:
        raise AssertionError("the engine's error was not raised")
    assert batcher.busy is False and batcher.waiting == [] and batcher.asking.count == {}
