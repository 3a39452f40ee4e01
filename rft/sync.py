"""Synchronizers: move the trainer's weights to the explorers, then verify them.

Each is `sync(trainer, explorers, version)`. After loading, every explorer compares a fingerprint
of the weights it now serves with the trainer's; a mismatch raises instead of training on
silently stale weights.

- memory: through the Ray object store (a plain reference with cluster.backend=inline).
- checkpoint: through a safetensors file on disk; works when explorer and trainer share only a
  filesystem.
- collective: a torch.distributed broadcast from the trainer (rank 0) to the explorers (ranks
  1..E): nccl on GPU, gloo on CPU. Each tensor is received straight into the engine's parameters.
"""

from __future__ import annotations

import datetime
import socket
from pathlib import Path

import torch

from rft.errors import RunError


def _wait(pairs, timeout: float) -> None:
    """Wait for every (actor, future) of one sync, each within synchronizer.sync_timeout."""
    for actor, future in pairs:
        try:
            actor.get(future, timeout)
        except TimeoutError as e:
            raise RunError(
                f"a weight sync did not finish within synchronizer.sync_timeout={timeout:g} s ({e}). "
                f"The newest checkpoint is kept; raise sync_timeout if the model is large, then run "
                f"the same command again to resume."
            ) from e


class MemorySync:
    def __init__(self, stage_dir: Path, cfg):
        self.timeout = cfg.sync_timeout

    def __call__(self, trainer, explorers, version: int) -> None:
        expected = trainer.call("fingerprint")
        weights = trainer.submit("weights")  # with Ray: travels trainer -> explorers directly
        _wait([(e, e.submit("update_weights", weights, version, expected)) for e in explorers], self.timeout)


class CheckpointSync:
    def __init__(self, stage_dir: Path, cfg):
        self.dir = stage_dir / "sync"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.timeout = cfg.sync_timeout

    def __call__(self, trainer, explorers, version: int) -> None:
        path = str(self.dir / "model.safetensors")
        expected = trainer.call("save_weights", path)
        _wait([(e, e.submit("load_weights", path, version, expected)) for e in explorers], self.timeout)


class CollectiveSync:
    """The process group is set up on the first sync and again after an explorer restarts."""

    def __init__(self, stage_dir: Path, cfg):
        self.members = None
        self.timeout = cfg.sync_timeout

    def setup(self, trainer, explorers) -> None:
        address, port = trainer.call("collective_address")
        world = 1 + len(explorers)
        # every member joins at once: init_process_group blocks until all have
        futures = [(trainer, trainer.submit("collective_init", address, port, world, 0))]
        futures += [(e, e.submit("collective_init", address, port, world, i + 1)) for i, e in enumerate(explorers)]
        _wait(futures, self.timeout)
        self.members = (trainer, *explorers)

    def reset(self, trainer, explorers) -> None:
        """After an explorer died: the old group is broken; every member leaves it, then a new one forms."""
        for actor in (trainer, *explorers):
            try:
                actor.call("collective_destroy")
            except Exception:  # the restarted explorer never joined the old group
                pass
        self.setup(trainer, explorers)

    def __call__(self, trainer, explorers, version: int) -> None:
        if self.members is None:
            self.setup(trainer, explorers)
        expected = trainer.call("fingerprint")
        futures = [(trainer, trainer.submit("collective_send"))]
        futures += [(e, e.submit("collective_receive", version, expected)) for e in explorers]
        _wait(futures, self.timeout)


SYNC_METHODS = {"memory": MemorySync, "checkpoint": CheckpointSync, "collective": CollectiveSync}


# ---------------------------------------------------------------- the collective, in each actor


def free_address() -> tuple[str, int]:
    """This node's address and a free TCP port, for the group's rendezvous."""
    try:
        import ray

        host = ray.util.get_node_ip_address()
    except Exception:
        host = "127.0.0.1"
    with socket.socket() as s:
        s.bind(("", 0))
        return host, s.getsockname()[1]


def collective_init(address: str, port: int, world: int, rank: int, timeout_s: float) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(
        backend="nccl" if torch.cuda.is_available() else "gloo",
        init_method=f"tcp://{address}:{port}",
        world_size=world,
        rank=rank,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def collective_destroy() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@torch.no_grad()
def broadcast_model(model) -> None:
    """Rank 0 sends every tensor of `model`'s state dict; the other ranks receive into theirs.

    Both sides hold the same architecture, so sorted names give the same order. Tied tensors
    (an embedding shared with the output layer) appear twice and are simply sent twice.
    """
    import torch.distributed as dist

    sd = model.state_dict()
    for name in sorted(sd):
        dist.broadcast(sd[name], src=0)
