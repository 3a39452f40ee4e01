"""Synchronizers: move the trainer's weights to the explorer, then verify them.

Each is `sync(trainer, explorer, version)`. After loading, the explorer compares a fingerprint
of the weights it now serves with the trainer's; a mismatch raises instead of training on
silently stale weights.
"""

from __future__ import annotations

from pathlib import Path


class MemorySync:
    """Through the Ray object store (or a plain reference with cluster.backend=inline)."""

    def __init__(self, stage_dir: Path, cfg):
        pass

    def __call__(self, trainer, explorer, version: int) -> None:
        expected = trainer.call("fingerprint")
        weights = trainer.submit("weights")  # with Ray: travels trainer -> explorer directly
        explorer.call("update_weights", weights, version, expected)


class CheckpointSync:
    """Through a safetensors file on disk: works when explorer and trainer share only a filesystem."""

    def __init__(self, stage_dir: Path, cfg):
        self.dir = stage_dir / "sync"
        self.dir.mkdir(parents=True, exist_ok=True)

    def __call__(self, trainer, explorer, version: int) -> None:
        path = str(self.dir / "model.safetensors")
        expected = trainer.call("save_weights", path)
        explorer.call("load_weights", path, version, expected)


SYNC_METHODS = {"memory": MemorySync, "checkpoint": CheckpointSync}
