"""Synchronizers: move the trainer's weights to the explorers, then verify them.

Each is `sync(trainer, explorers, version)`. After loading, every explorer compares a fingerprint
of the weights it now serves with the trainer's; a mismatch raises instead of training on
silently stale weights.

- memory: through the Ray object store (a plain reference with cluster.backend=inline).
- checkpoint: through a safetensors file on disk; works when explorer and trainer share only a
  filesystem.
- collective: a torch.distributed broadcast from the trainer (rank 0) to the explorers (ranks
  1..E) in a process group of its own: nccl on GPU, gloo on CPU. The hf engine receives each
  tensor straight into its parameters; vLLM receives and loads them tensor by tensor.
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
        # what the trainer sends, in order: an engine that lays weights out its own way (vLLM)
        # receives into buffers of these names and shapes, then loads them
        manifest = trainer.call("weights_manifest")
        world = 1 + len(explorers)
        # every member joins at once: the rendezvous waits until all have
        futures = [(trainer, trainer.submit("collective_init", address, port, world, 0))]
        futures += [(e, e.submit("collective_init", address, port, world, i + 1, manifest))
                    for i, e in enumerate(explorers)]
        _wait(futures, self.timeout)
        self.members = (trainer, *explorers)

    def reset(self, trainer, explorers) -> None:
        """After an explorer died the old group is broken: a new one forms (new port, every member)."""
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


def open_group(address: str, port: int, world: int, rank: int, timeout_s: float):
    """A process group of its own (not torch.distributed's default one, which a trainer's FSDP or
    vLLM's tensor parallelism may hold): the trainer is rank 0 and hosts the rendezvous store."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world, is_master=rank == 0, timeout=timeout)
    if torch.cuda.is_available():
        return dist.ProcessGroupNCCL(store, rank, world)
    return dist.ProcessGroupGloo(store, rank, world, timeout)


@torch.no_grad()
def broadcast(group, tensors) -> None:
    """Rank 0's tensors into every other rank's tensors of the same shapes, in order."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    for t in tensors:
        group.broadcast([t], opts).wait()
