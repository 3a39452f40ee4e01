"""The weight sync: the contract between trainer and explorers, and the synchronizers.

The contract: `fingerprint` (what both sides compare after a sync), `weight_sums`, and
`for_safetensors` (the state dict as a file holds it). The trainer and the engines both import
this module and never each other.

Synchronizers move the trainer's weights to the explorers, then verify them.

Each is `sync(trainer, explorers, version)`. After loading, every explorer compares a fingerprint
of the weights it now serves with the trainer's; a mismatch raises instead of training on
silently stale weights.

- memory: through the Ray object store as numpy arrays (a plain reference with
  cluster.backend=inline).
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

from rft.errors import RunError


# ---------------------------------------------------------------- the contract: what both sides agree on


def hf_weight_files(hf_dir) -> list[Path]:
    """The safetensors files of a Hugging Face model folder: model.safetensors, or the shards its
    model.safetensors.index.json lists (save_pretrained shards a model above max_shard_size)."""
    import json

    d = Path(hf_dir)
    index = d / "model.safetensors.index.json"
    if index.exists():
        return [d / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if (d / "model.safetensors").exists():
        return [d / "model.safetensors"]
    raise FileNotFoundError(f"{d} holds no model weights (neither model.safetensors nor "
                            f"model.safetensors.index.json with its shards)")


def hf_tensors(path):
    """(name, tensor) of a safetensors file, or of every shard of a Hugging Face folder, one file
    at a time (a large model's weights need not sit in memory twice)."""
    from safetensors.torch import load_file

    p = Path(path)
    for f in hf_weight_files(p) if p.is_dir() else [p]:
        yield from load_file(f).items()


def for_safetensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict as safetensors can save it: each tensor contiguous, and a tied tensor (the
    embedding shared with the output layer) cloned, since safetensors refuses shared storage."""
    seen, out = set(), {}
    for k, v in state_dict.items():
        key = (v.data_ptr(), v.shape)
        out[k] = (v.clone() if key in seen else v).contiguous()
        seen.add(key)
    return out


def fingerprint(tensors) -> str:
    """A short summary of weights, equal on both sides of a sync iff the weights are.

    `tensors`: a state dict, or any iterable of tensors (e.g. `model.parameters()`). It is the
    float64 sum, sum of absolute values and sum of squares over every distinct tensor (shared
    ones, like tied embeddings, count once). Being independent of names and layout, it is the same
    for the trainer's weights and for an engine that stores them differently (vLLM fuses q/k/v and
    pads the vocabulary with zeros); any realistic corruption (a missing, stale or garbled tensor)
    changes it. Compare two with `same_weights`.
    """
    return format_fingerprint(weight_sums(tensors))


def weight_sums(tensors) -> list[float]:
    """[sum, sum of |x|, sum of x^2] in float64 over the distinct tensors. Each is a sum, so a
    data-parallel trainer adds up its ranks' shards (rft.fsdp) to get the whole model's."""
    import torch

    if isinstance(tensors, dict):
        tensors = tensors.values()
    seen, parts = set(), []
    with torch.no_grad():
        for t in tensors:
            key = (t.data_ptr(), t.numel())
            if key in seen:
                continue
            seen.add(key)
            # in float64, a chunk at a time (a bounded copy: converting first is 2-3x faster on CPU
            # than reducing with dtype=float64); one read back at the end, not one per tensor
            for chunk in t.detach().flatten().split(_CHUNK if t.is_cuda else _CPU_CHUNK):
                d = chunk.to(torch.float64)
                parts.append(torch.stack([d.sum(), d.abs().sum(), torch.dot(d, d)]))
    return torch.stack([p.cpu() for p in parts]).sum(0).tolist() if parts else [0.0, 0.0, 0.0]


_CHUNK = 1 << 24  # elements: a 128 MiB float64 copy at most (on a GPU: few kernel launches)
# on a CPU, a copy that stays in cache while the three sums read it: 6x faster than _CHUNK
# (64M float32 elements: 74 ms against 460 ms, 1 thread)
_CPU_CHUNK = 1 << 18


def to_arrays(state_dict: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """The weights as (numpy array, torch dtype name) pairs, for memory sync: Ray's object store
    maps numpy arrays into the reader's process without a copy, where torch tensors are unpickled
    by copying. CPU tensors are viewed, not copied; dtypes numpy lacks (bfloat16) travel as
    same-size integers."""
    import torch

    same_size_int = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.int8, torch.float8_e5m2: torch.int8}
    out = {}
    for k, v in state_dict.items():
        v = v.detach().cpu()
        raw = v.view(same_size_int[v.dtype]) if v.dtype in same_size_int else v
        out[k] = (raw.numpy(), str(v.dtype).removeprefix("torch."))
    return out


def from_arrays(arrays: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """`to_arrays`'s weights as tensors (views of the arrays: loading them copies once)."""
    import warnings

    import torch

    out = {}
    with warnings.catch_warnings():
        # the object store's arrays are read-only; the tensors are only read (load_state_dict copies)
        warnings.simplefilter("ignore", UserWarning)
        for k, (arr, dtype) in arrays.items():
            t = torch.from_numpy(arr)
            out[k] = t.view(getattr(torch, dtype)) if t.dtype != getattr(torch, dtype) else t
    return out


def format_fingerprint(sums) -> str:
    s, sa, sq = sums
    return f"{s:.15e}/{sa:.15e}/{sq:.15e}"


def same_weights(a: str, b: str, rtol: float = 1e-9) -> bool:
    """Two fingerprints agree up to float64 summation order (one changed weight is far above it)."""
    (s1, a1, q1), (s2, a2, q2) = (map(float, x.split("/")) for x in (a, b))
    scale = max(a1, a2, 1e-30)
    return abs(s1 - s2) <= rtol * scale and abs(a1 - a2) <= rtol * scale and abs(q1 - q2) <= rtol * max(q1, q2, 1e-30)


# ---------------------------------------------------------------- the synchronizers (driver side)


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
        # the weights as numpy arrays and their fingerprint, in one call; with Ray the object
        # travels trainer -> explorers directly, mapped (not copied) into each explorer
        payload = trainer.submit("sync_payload")
        _wait([(e, e.submit("receive_weights", payload, version)) for e in explorers], self.timeout)


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
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world, is_master=rank == 0, timeout=timeout)
    if torch.cuda.is_available():
        return dist.ProcessGroupNCCL(store, rank, world)
    return dist.ProcessGroupGloo(store, rank, world, timeout)


def broadcast(group, tensors) -> None:
    """Rank 0's tensors into every other rank's tensors of the same shapes, in order."""
    import torch
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    with torch.no_grad():
        for t in tensors:
            group.broadcast([t], opts).wait()
