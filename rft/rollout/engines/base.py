"""What a rollout engine is: the methods the explorer, the workflows and the synchronizers call.

A new engine is one file with a class of these methods, plus one line in rft.registry.ENGINES
(`"name": ("module.Class", EngineInfo(...))`); or, from a study's own files, no line at all:
`explorer.rollout_model.engine_type=my_study.engine.MyEngine`, the class carrying its
`info = EngineInfo(...)` (what planning checks: rft.registry.EngineInfo). tests/test_seams.py adds
one that way. The engine is built in the explorer's process as
`cls(model_cfg, rollout_cfg, tokenizer, path, device)`: `path` is a checkpoint's hf/ directory
or None (the model's own weights, model_cfg.model_path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass
class Sample:
    """One response: its tokens, the log-prob of each under the distribution it was sampled from
    (the policy ratio's denominator), and why it ended."""
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop token, rft.data.chat.stop_ids, or a stop string) or "length" (hit max_tokens)
    # the weights version that sampled each token (partial rollouts: rft/rollout/partial.py);
    # None: the explorer's version when it was generated, for all of them
    versions: list[int] | None = None


@runtime_checkable
class Engine(Protocol):
    # seconds spent generating, summed over calls (the runtime benchmark's "model compute")
    busy_s: float

    def generate(self, prompts: list[list[int]], n: int, args: Any, seed: int) -> list[list[Sample]]:
        """`n` samples of each prompt (token ids), with `args` the rollout's sampling settings
        (temperature, top_p, top_k, max_tokens, stop, logprobs of the processed distribution);
        the same seed gives the same samples."""

    def update_weights(self, state_dict: dict[str, Any]) -> None:
        """Take the trainer's weights (synchronizer.sync_method=memory): names as the trainer's
        state dict, every tensor replaced."""

    def load_weights_file(self, path: str) -> None:
        """Take the weights from a safetensors file or a checkpoint's hf/ directory
        (sync_method=checkpoint, and an explorer revived after a crash)."""

    def collective_init(self, address: str, port: int, world: int, rank: int, timeout_s: float, manifest) -> None:
        """Join the trainer's process group (sync_method=collective) as `rank` of `world`."""

    def collective_receive(self) -> None:
        """Receive the trainer's broadcast of every parameter (rft.sync.weights.broadcast order)."""

    def fingerprint(self) -> str:
        """A digest of the weights the engine serves (rft.sync.weights.fingerprint): the
        synchronizer checks that the engine holds what the trainer sent."""

    def sleep(self) -> None:
        """Free the device while the trainer trains on it (explorer.rollout_model.enable_sleep_mode)."""

    def wake_up(self) -> None:
        """Take the device back after sleep."""
