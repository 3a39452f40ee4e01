"""What a trainer backend is: the methods the stage (rft/runtime) and the synchronizers
(rft/sync) call on it, by name, in its own process.

A new backend is one file with a class of these methods (most subclass rft.trainer.trainer.Trainer
and override its "(data parallel)" hooks, as rft.trainer.fsdp.FSDPTrainer does), plus one line in
rft.registry.TRAINER_BACKENDS (`"name": ("module.Class", TrainerBackendInfo(...))`); or, from a
study's own files, no line at all: `trainer.trainer_strategy=my_study.trainer.MyTrainer`, the class
carrying its `info = TrainerBackendInfo(...)` (what planning checks: rft.registry.TrainerBackendInfo).
tests/test_seams.py adds one that way. It is built as `cls(cfg, plan, init_path)`, or, for a
backend of ranks (`info.ranks`), once per rank as `cls(cfg, plan, init_path, rank, world,
(host, port))` with a TCP store at (host, port) for the ranks to meet. A resumed stage then calls
`load(checkpoint)`; a backend whose info says `builds_from_checkpoint` is given that checkpoint's
directory as one more last argument, to read its trained weights as it builds instead of the
starting model's (which it still reads for what is the starting model: a reference model).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class TrainerBackend(Protocol):
    # ---- the step
    def train_step(self, exps: list) -> dict:
        """One step on the stage's experiences (rft.data.experience.Experience); its metrics."""

    def train_dataset_step(self, step: int, size: int) -> tuple[dict, dict]:
        """One step on the SFT/DPO dataset's rows (mode=train without explorers); metrics and
        what it read."""

    def skip_step(self) -> None:
        """A step with no experiences (every group filtered out): the version goes on."""

    def get_version(self) -> int:
        """Optimizer steps taken: the version of the weights."""

    def token_budget_warnings(self) -> list[str]:
        """Sequences the token budget could not hold whole, once per run."""

    # ---- the weights, to the engines (rft/sync/weights.py)
    def weights(self) -> dict[str, Any]:
        """A CPU copy of what the engines load: the full model's tensors, named as its Hugging Face
        state dict (with LoRA: merged; with model.lora.sync=adapter the adapters alone)."""

    def fingerprint(self) -> str:
        """A digest of the weights (rft.sync.weights.fingerprint), which the engines' must equal."""

    def engine_fingerprint(self) -> str:
        """The fingerprint of what `weights` gives the engines: `fingerprint`'s, or with
        model.lora.sync=adapter the adapters' alone."""

    def sync_fingerprint(self) -> str:
        """The fingerprint a sync sends (timed as a part of the sync)."""

    def sync_timing(self) -> dict[str, float]:
        """The trainer's side of the syncs since the last call (timing/sync_send_s,
        timing/sync_fingerprint_s); train_step's metrics include it."""

    def sync_payload(self, shared: str | None = None, with_fingerprint: bool = True) -> tuple:
        """What memory sync sends in one call: (the weights, their fingerprint or None), the weights
        written into a shared-memory segment named after `shared`, or as arrays in the reply."""

    def close_shared(self) -> None:
        """Free the shared-memory segment of sync_payload."""

    def save_weights(self, path: str) -> str:
        """Write the weights to one safetensors file at `path` (checkpoint sync); returns their
        fingerprint."""

    def node(self) -> str:
        """The id of the node this process runs on (memory sync shares memory only on one node)."""

    def collective_address(self) -> tuple[str, int]:
        """A free (host, port) for the collective's group."""

    def weights_manifest(self) -> list[tuple[str, list[int], str]]:
        """(name, shape, dtype) of each tensor the collective sends, in its order."""

    def collective_init(self, address: str, port: int, world: int, rank: int) -> None:
        """Open the group with the engines (this is rank 0)."""

    def collective_send(self) -> None:
        """Broadcast every parameter to the engines."""

    def keep_snapshots(self, version: int, keep: list[int]) -> None:
        """Keep a copy of the current weights as `version` and drop those not in `keep`
        (sync_offset > 0: an explorer revived mid-run serves the version its step was scheduled on)."""

    def snapshot_weights(self, version: int) -> dict[str, Any]:
        """The kept copy of `version`'s weights."""

    def snapshot_fingerprint(self, version: int) -> str:
        """A digest of snapshot_weights(version)."""

    # ---- its state (rft/runtime/checkpoint.py)
    def save(self, directory: str, with_hf: bool = True) -> None:
        """Write everything a resumed run needs (weights, optimizer, scheduler, RNG, version) into
        `directory`, and the Hugging Face model under hf/ when `with_hf`."""

    def load(self, directory: str) -> None:
        """Restore what save wrote: the step after it is the one an uninterrupted run takes."""

    def ping(self) -> int:
        """Its process id: the stage asks whether it is alive, and whether Ray restarted it."""
