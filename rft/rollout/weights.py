"""The explorer's side of a weight sync: take the trainer's weights into the engine by whichever
way the synchronizer (rft.sync.weights) sent them, check them against the trainer's fingerprint,
and time both (timing/sync_load_s and timing/sync_check_s in the next explore's metrics).

`WeightsMixin` reads the Explorer's `engine`, `cfg`, `version`, `gate` and `sync_s` (rft.rollout.explorer).
"""

from __future__ import annotations

import functools
import time

from rft.sync.weights import SharedWeights, fingerprint, from_payload, one_thread, same_weights


def gated(method):
    """A weight load that waits for the explorer's generation to leave the engine (partial rollouts
    load between two chunks: rft.rollout.partial.WeightGate), then records the new version there."""

    @functools.wraps(method)
    def load(self, *args):
        with self.gate.loading():
            out = method(self, *args)
            self.gate.set_version(self.version)
            return out

    return load


class WeightsMixin:
    @gated
    def update_weights(self, state_dict, version: int, expected_fingerprint: str) -> str:
        self._load(self.engine.update_weights, state_dict)
        return self._check(version, expected_fingerprint)

    @gated
    def receive_weights(self, payload: tuple, version: int) -> str | None:
        """Memory sync: the trainer's `sync_payload` (the weights as numpy arrays or where they lie
        in shared memory; their fingerprint, None in one process: there the arrays are views of
        the trainer's own tensors, and what the engine loaded is checked against them bit for bit)."""
        weights, expected = payload
        with one_thread():
            if isinstance(weights, SharedWeights) and expected is not None and hasattr(self.engine, "load_shared"):
                # an engine in processes of its own (vLLM's workers) reads the segment itself
                self._load(self.engine.load_shared, weights)
                return self._check(version, expected)
            state = from_payload(weights)
            if expected is not None:
                return self.update_weights(state, version, expected)
            self._load(self.engine.update_weights, state)
            differs = getattr(self.engine, "differs", None)
            if differs is None:  # an engine that keeps the weights elsewhere (vLLM's own process)
                return self._check(version, fingerprint(state))
            t0 = time.perf_counter()
            wrong = differs(state)
            self._add("sync_check_s", time.perf_counter() - t0)
            if wrong:
                raise RuntimeError(
                    f"weight sync to version {version} failed: after loading, the explorer's {wrong[0]} "
                    f"(and {len(wrong) - 1} more of {len(state)} tensors) differ from the trainer's"
                )
            self.version = version
            return None

    @gated
    def load_weights(self, path: str, version: int, expected_fingerprint: str | None) -> str:
        """A safetensors file (sync=checkpoint) or a checkpoint's hf/ directory (mode=explore, bench)."""
        self._load(self.engine.load_weights_file, path)
        if expected_fingerprint is None:  # a checkpoint saved before fingerprints were recorded
            self.version = version
            return self.engine.fingerprint()
        return self._check(version, expected_fingerprint)

    def collective_init(self, address: str, port: int, world: int, rank: int, manifest) -> None:
        self.engine.collective_init(address, port, world, rank, self.cfg.synchronizer.sync_timeout, manifest)

    @gated
    def collective_receive(self, version: int, expected_fingerprint: str) -> str:
        self._load(self.engine.collective_receive)
        return self._check(version, expected_fingerprint)

    def _add(self, part: str, seconds: float) -> None:
        self.sync_s[part] = self.sync_s.get(part, 0.0) + seconds

    def _load(self, method, *args) -> None:
        """The engine takes new weights, timed: sync_load_s, and sync_check_s for the part of it an
        engine spent fingerprinting what it received (vLLM's workers: `check_s`)."""
        t0 = time.perf_counter()
        method(*args)
        inner = getattr(self.engine, "check_s", 0.0)
        self._add("sync_load_s", time.perf_counter() - t0 - inner)
        self._add("sync_check_s", inner)

    def _check(self, version: int, expected: str) -> str:
        t0 = time.perf_counter()
        got = self.engine.fingerprint()
        self._add("sync_check_s", time.perf_counter() - t0)
        if not same_weights(got, expected):
            raise RuntimeError(
                f"weight sync to version {version} failed: the explorer now serves weights with "
                f"fingerprint {got}, the trainer sent {expected}"
            )
        self.version = version
        return got
