"""The weight sync: the contract between trainer and explorers, and the synchronizers.

The contract: `fingerprint` (what both sides compare after a sync), `weight_sums`, and
`for_safetensors` (the state dict as a file holds it). The trainer and the engines both import
this module and never each other.

Synchronizers move the trainer's weights to the explorers, then verify them.

Each is `sync(trainer, explorers, version)`. After loading, every explorer compares a fingerprint
of the weights it now serves with the trainer's; a mismatch raises instead of training on
silently stale weights.

- memory: through shared memory when the explorers are on the trainer's node, else the Ray
  object store, as numpy arrays (a plain reference with cluster.backend=inline).
- checkpoint: through a safetensors file on disk; works when explorer and trainer share only a
  filesystem.
- collective: a torch.distributed broadcast from the trainer (rank 0) to the explorers (ranks
  1..E) in a process group of its own: nccl on GPU, gloo on CPU. The hf engine receives each
  tensor straight into its parameters; vLLM receives and loads them tensor by tensor.
"""

from __future__ import annotations

import datetime
import logging
import secrets
import socket
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rft.errors import ConfigError, RunError
from rft.registry import Registry

# ---------------------------------------------------------------- the contract: what both sides agree on


def hf_weight_files(hf_dir) -> list[Path]:
    """The safetensors files of a Hugging Face model folder: model.safetensors, or the shards its
    model.safetensors.index.json lists (save_pretrained shards a model above max_shard_size)."""
    d = Path(hf_dir)
    index = d / "model.safetensors.index.json"
    if index.exists():
        return _shards(d, index)
    if (d / "model.safetensors").exists():
        return [d / "model.safetensors"]
    raise FileNotFoundError(f"{d} holds no model weights (neither model.safetensors nor "
                            f"model.safetensors.index.json with its shards)")


def _shards(d: Path, index: Path) -> list[Path]:
    """The shard files `index` lists, each a file of folder `d` itself: a name with a folder in it,
    '..', an absolute path or a link out of `d` would have the engine load weights from elsewhere."""
    import json
    import os

    from rft.manifest import read_record

    try:
        # bounded (an index is ~100 bytes a tensor: a few MB for the largest models): a damaged or
        # planted 10 GB index was read whole into memory before it failed to parse
        weight_map = json.loads(read_record(index))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, RecursionError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{index} does not read as a safetensors index, {{\"weight_map\": {{<tensor>: <shard "
                          f"file>}}}} ({type(e).__name__}: {e}). Save the model again with save_pretrained, or "
                          f"remove the index where {d} holds one model.safetensors.") from None
    root = os.path.realpath(d)
    for name in names:
        inside = (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
                  and "\0" not in name and os.path.dirname(os.path.realpath(d / name)) == root)
        if not inside:
            tensor = next(k for k, v in weight_map.items() if v == name)
            raise ConfigError(f"{index} lists {name!r} as the shard of {tensor!r} (and maybe more), which is not a "
                              f"file of {d} itself: a shard is named by its file name beside the index, with no "
                              f"folder, '..' or absolute path, and is no link out of the folder. Save the model "
                              f"again with save_pretrained (it writes its shards there), or copy the shards into "
                              f"{d} and name them so.")
    return [d / name for name in names]


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
    """A short summary of weights, equal on both sides of a sync iff the weights are (up to a
    rearrangement of their elements).

    `tensors`: a state dict, or any iterable of tensors (e.g. `model.parameters()`). It is
    `<elements>:<sum>`: how many elements the distinct tensors hold (shared ones, like tied
    embeddings, count once) and the sum, modulo 2**64, of each element's bits read as a signed
    integer of its own width (a bfloat16 as an int16). Integer sums are exact, so the two sides
    agree to the bit whatever the order, chunking or device of the summation, and the number is
    independent of names and layout (the same for the trainer's weights and for an engine that
    stores them fused); any change to any one element (one flipped bit included) changes it, as
    does a cast to another dtype. On a CPU it reads ~4 GB/s on one thread: 0.3 s for a 0.5B
    model in bfloat16, where float64 sums took 1.4-2.4 s. Compare two with `same_weights`.
    """
    return format_fingerprint(*weight_sums(tensors))


def format_fingerprint(count: int, total: int) -> str:
    return f"{count}:{total % 2**64:016x}"


_AS_INT = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


def weight_sums(tensors) -> list[int]:
    """[elements, sum of their bits as integers mod 2**64] over the distinct tensors. Each is a
    sum, so a data-parallel trainer adds up its ranks' shards (rft.trainer.fsdp) to get the whole
    model's."""
    import torch

    if isinstance(tensors, dict):
        tensors = tensors.values()
    seen, on_cpu, on_device = set(), [], []
    with torch.no_grad():
        for t in tensors:
            key = (t.data_ptr(), t.numel())
            if key in seen or not t.numel():
                continue
            seen.add(key)
            size = t.element_size()  # wider (complex128): its bytes, as int8
            bits = t.detach().view(getattr(torch, _AS_INT[size])) if size in _AS_INT else t.detach().contiguous().view(torch.int8)
            (on_cpu if bits.device.type == "cpu" else on_device).append(bits)
        count = sum(t.numel() for t in on_cpu + on_device)  # (complex128: 16 per element)
        total = sum(in_threads(_bits_sum, pieces(on_cpu)))
        if on_device:  # summed where they are; one read back at the end
            total += int(torch.stack([t.sum(dtype=torch.int64) for t in on_device]).sum().item())
    return [count, total % 2**64]


def _bits_sum(bits) -> int:
    import numpy as np

    # numpy: torch's integer reductions on a CPU are 9x slower (2.8 s against 0.3 for 0.5B)
    return int(bits.numpy().sum(dtype=np.int64))


# ---------------------------------------------------------------- big copies and sums, on every core

_PIECE = 1 << 22  # elements: a model's big tensors split so that the threads share them evenly
_THREADED = 1 << 24  # elements: below this (a 32 MB bfloat16 model) one thread (no hand-offs)
_POOL: list = []


def pieces(tensors, others=None) -> list:
    """The tensors as pieces of at most _PIECE elements (flat views of contiguous ones; a strided
    one whole); with `others` (same shapes), pairs of matching pieces, for copies."""
    out = []
    for i, t in enumerate(tensors):
        o = None if others is None else others[i]
        if t.numel() > _PIECE and t.is_contiguous() and (o is None or o.is_contiguous()):
            parts = t.view(-1).split(_PIECE)
            out += parts if o is None else list(zip(parts, o.view(-1).split(_PIECE)))
        else:
            out.append(t if o is None else (t, o))
    return out


def in_threads(fn, items: list) -> list:
    """fn(item) for each item, on up to 4 threads of this process when there are many elements
    (numpy's sums and torch's copies let go of the GIL): a sync's copies and fingerprints of a
    0.5B model take half the time on 2 cores (copy 0.20 -> 0.12 s, sums 0.36 -> 0.21 s). The
    sync runs when its process has the CPUs to itself (the synchronous schedule takes turns)."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    size = sum((i[0] if isinstance(i, tuple) else i).numel() for i in items)
    # macOS has no sched_getaffinity: its CPU count (one thread there made its syncs twice as long)
    threads = min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    if size < _THREADED or threads < 2:
        return [fn(i) for i in items]
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(threads, thread_name_prefix="rft-sync"))
    return list(_POOL[0].map(fn, items))


def same_tensor(t) -> tuple:
    """Equal for two names of one tensor (a tied output layer and its embedding), not for two views
    of one storage that differ in place, shape or type."""
    return t.data_ptr(), t.dtype, tuple(t.shape), t.stride()


def copy_pairs(pairs) -> None:
    """dst.copy_(src) for each (dst, src) pair of CPU tensors, big ones on every core; a
    destination listed twice (a tied output layer and its embedding) is copied into once."""
    def copy(pair) -> None:  # returns nothing: no view of a shared segment outlives the copies
        pair[0].copy_(pair[1])

    once = {same_tensor(d): (d, s) for d, s in pairs}
    in_threads(copy, pieces([d for d, _ in once.values()], [s for _, s in once.values()]))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and bits (a NaN equals the same NaN: compared as same-size integers)."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.device != b.device:  # an engine on a GPU checks the CPU copies the trainer sent
        b = b.to(a.device)
    as_int = _AS_INT.get(a.element_size())
    if as_int is None or a.is_complex():
        return torch.equal(a, b)
    return torch.equal(a.view(getattr(torch, as_int)), b.view(getattr(torch, as_int)))




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


# ---------------------------------------------------------------- same-node memory sync


@dataclass(frozen=True)
class SharedWeights:
    """What memory sync sends when trainer and explorer share a node: where the weights lie in a
    shared-memory segment (its name; per tensor: name, byte offset, shape, dtype), not the weights.
    A 2 MB state dict through Ray's object store cost ~6-10 ms a sync on 2 CPUs; this, two copies
    of 0.1 ms."""

    segment: str
    layout: tuple  # ((name, offset, shape, dtype name), ...)


class SharedWriter:
    """The trainer's segment, named `<prefix><random>`: made at the first sync (again when the
    weights' layout changes), unlinked by `close`; if the trainer dies first, by the driver's
    MemorySync (`sweep`), which chose the prefix."""

    def __init__(self, prefix: str = "rft_"):
        self.prefix = prefix
        self.shm, self.layout = None, None

    def write(self, state_dict: dict) -> SharedWeights:
        import torch

        layout, offset, placed = [], 0, {}
        for k, v in state_dict.items():
            key = same_tensor(v)
            if key not in placed:  # a tied tensor (the output layer's embedding) is written once
                placed[key] = offset
                offset += -(-v.numel() * v.element_size() // 64) * 64  # each tensor 64-byte aligned
            layout.append((k, placed[key], tuple(v.shape), str(v.dtype).removeprefix("torch.")))
        layout = tuple(layout)
        if self.shm is None or layout != self.layout:
            self.close()
            self.shm = _segment(create=True, size=max(offset, 1), prefix=self.prefix)
            self.layout = layout
            logging.getLogger(__name__).info("memory sync through shared memory: segment %s, %.1f MB",
                                             self.shm.name, offset / 2**20)
        written = {off: v for (_, off, _, _), v in zip(layout, state_dict.values()) if v.numel()}
        pairs = [(torch.frombuffer(self.shm.buf, dtype=v.dtype, count=v.numel(), offset=off).view(v.shape), v.detach())
                 for off, v in written.items()]
        copy_pairs(pairs)
        del pairs  # no tensor may keep the buffer exported past here (close would fail)
        return SharedWeights(self.shm.name, layout)

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm.unlink()
            self.shm = None


def shared_fits(nbytes: int) -> bool:
    """Whether the node's shared memory (/dev/shm) has room for a segment of `nbytes`: a container
    often gives it 64 MB, and writing past what it has kills the process (SIGBUS)."""
    import os

    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return False
    return st.f_bavail * st.f_frsize > 2 * nbytes  # room for the segment of a restarted trainer too


_ATTACHED: dict = {}  # segment name -> SharedMemory, in an explorer


def read_shared(weights: SharedWeights) -> dict:
    """The tensors of `weights`, as views of the segment (load them, which copies, before the
    trainer's next sync writes it again)."""
    from math import prod

    import torch

    shm = _ATTACHED.get(weights.segment)
    if shm is None:
        for name in list(_ATTACHED):  # the trainer made a new segment: the old one is done with
            try:
                _ATTACHED.pop(name).close()
            except BufferError:  # a view still held somewhere: the mapping goes with it
                pass
        shm = _ATTACHED[weights.segment] = _segment(name=weights.segment)
    return {k: torch.frombuffer(shm.buf, dtype=getattr(torch, dtype), count=prod(shape), offset=off).view(shape)
            if prod(shape) else torch.empty(shape, dtype=getattr(torch, dtype))
            for k, off, shape, dtype in weights.layout}


def _segment(name: str | None = None, create: bool = False, size: int = 0, prefix: str = "rft_"):
    """A SharedMemory segment; one attached to (not made) is not left to this process's resource
    tracker, which would unlink it when this process exits while the trainer still uses it."""
    from multiprocessing import resource_tracker, shared_memory

    if create:
        shm = shared_memory.SharedMemory(name=f"{prefix}{secrets.token_hex(6)}", create=True, size=size)
        _MADE_HERE.add(shm.name)
        return shm
    try:
        return shared_memory.SharedMemory(name=name, track=False)  # Python >= 3.13
    except TypeError:
        shm = shared_memory.SharedMemory(name=name)
        if name not in _MADE_HERE:  # one tracker per process: the maker's registration stays
            resource_tracker.unregister(shm._name, "shared_memory")
        return shm


_MADE_HERE: set = set()


@contextmanager
def one_thread():
    """torch on this thread alone for a sync's copies and sums: they are short, and with the
    actors of a synchronous step sharing the CPUs, a parallel region waits for a thread the other
    actor's still-spinning OpenMP threads keep off a CPU (a 2 MB load took 7 ms, not 1)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def node_id() -> str:
    """This process's Ray node ("" outside Ray): memory sync shares memory within one."""
    import sys

    ray = sys.modules.get("ray")  # not imported: not in Ray (importing it to ask costs 50 MB)
    try:
        return ray.get_runtime_context().get_node_id() if ray is not None and ray.is_initialized() else ""
    except Exception:
        return ""


def segment_prefix() -> str:
    """rft_<driver pid>_<driver host>_: what the trainer's segments of this run are named after
    (a pid means something only on its own host)."""
    import hashlib
    import os

    return f"rft_{os.getpid()}_{hashlib.sha1(socket.gethostname().encode()).hexdigest()[:6]}_"


def pid_alive(pid: int) -> bool:
    """Whether a process of this host runs under `pid` (another user's counts as running)."""
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(prefix: str | None = None) -> None:
    """Unlink the segments of this run (`prefix`) or, with None, those of runs whose driver was
    on this host and is gone: a trainer killed with its process group leaves its segment."""
    import os
    import re

    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return
    here = segment_prefix().split("_")[2]
    for name in names:
        m = re.fullmatch(r"rft_(\d+)_([0-9a-f]{6})_[0-9a-f]+", name)
        if not m or (prefix is not None and not name.startswith(prefix)):
            continue
        if prefix is None:
            if m.group(2) != here:
                continue  # a driver elsewhere (its trainer on this node): not ours to judge
            if pid_alive(int(m.group(1))):
                continue  # its driver is alive (or another user's process: not ours to judge)
        try:
            os.unlink(f"/dev/shm/{name}")
        except OSError:
            pass


def from_payload(weights) -> dict:
    """The tensors of what `Trainer.sync_payload` sent: views of numpy arrays or of a segment."""
    return read_shared(weights) if isinstance(weights, SharedWeights) else from_arrays(weights)


def same_weights(got: str, expected: str) -> bool:
    """Whether two fingerprints are of the same weights. An `expected` one in the form before
    fingerprints became exact (three float sums "a/b/c", in a checkpoint written by an older
    version) cannot be compared: the load is taken unverified, with a warning."""
    if "/" in expected and "/" not in got:
        logging.getLogger(__name__).warning(
            "the weights' fingerprint %s was written by an older version of rft (float sums): the "
            "weights just loaded (%s) are not verified against it", expected, got)
        return True
    return got == expected


# ---------------------------------------------------------------- the synchronizers (driver side)


def wait(pairs, timeout: float) -> None:
    """Wait for every (actor, future) of one sync (what a sync method returns), each within
    synchronizer.sync_timeout; an explorer's failed check raises here."""
    for actor, future in pairs:
        try:
            actor.get(future, timeout)
        except TimeoutError as e:
            raise RunError(
                f"a weight sync did not finish within synchronizer.sync_timeout={timeout:g} s ({e}). "
                f"The newest checkpoint is kept; raise sync_timeout if the model is large, then run "
                f"the same command again to resume."
            ) from e


# A sync method, called as sync(trainer, explorers, version), makes the calls of one sync and returns
# the (actor, future) pairs that finish it, not waited for: an explorer runs its calls in order, so
# an explore submitted after them runs on the new weights, and the driver (rft.runtime.runner) waits for
# them with `wait` when it next needs the explorers, while they load the weights.


class MemorySync:
    """The weights and their fingerprint in one trainer call, handed to each explorer: in one
    process (cluster=inline) the trainer's tensors as numpy views (no fingerprint: the explorer
    compares what it loaded with those tensors, bit for bit); with Ray, through a
    shared-memory segment when every explorer is on the trainer's node (and /dev/shm has room),
    else through the object store (mapped, not copied, into each explorer)."""

    def __init__(self, stage_dir: Path, cfg):
        self.timeout = cfg.sync_timeout
        # actor handle -> its Ray node ("" in one process); a restarted explorer is a new handle
        self.nodes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.prefix = segment_prefix()  # the trainer's segments: this driver's to clean up
        sweep()  # those of runs killed before they could

    def _node(self, actor) -> str:
        if actor not in self.nodes:
            self.nodes[actor] = actor.call("node")
        return self.nodes[actor]

    def __call__(self, trainer, explorers, version: int) -> list:
        node = self._node(trainer)  # "": one process (cluster=inline), where the arrays are views
        if not node:  # of the trainer's tensors, which the explorer checks its engine against
            payload = trainer.submit("sync_payload", None, False)
        else:
            shared = all(self._node(e) == node for e in explorers)
            payload = trainer.submit("sync_payload", self.prefix if shared else None)
        return [(e, e.submit("receive_weights", payload, version)) for e in explorers]

    def close(self, trainer) -> None:
        """Unlink the trainer's segment (`sweep` after it, for a trainer that died first)."""
        try:
            trainer.get(trainer.submit("close_shared"), 30)  # a trainer stuck in a step is killed next
        finally:
            sweep(self.prefix)


class CheckpointSync:
    def __init__(self, stage_dir: Path, cfg):
        self.dir = stage_dir / "sync"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.timeout = cfg.sync_timeout

    def __call__(self, trainer, explorers, version: int) -> list:
        path = str(self.dir / "model.safetensors")  # the next sync writes it after this one's loads
        expected = trainer.call("save_weights", path)
        return [(e, e.submit("load_weights", path, version, expected)) for e in explorers]


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
        wait(futures, self.timeout)
        self.members = (trainer, *explorers)

    def reset(self, trainer, explorers) -> None:
        """After an explorer died the old group is broken: a new one forms (new port, every member)."""
        self.setup(trainer, explorers)

    def __call__(self, trainer, explorers, version: int) -> list:
        if self.members is None:
            self.setup(trainer, explorers)
        expected = trainer.call("sync_fingerprint")
        futures = [(trainer, trainer.submit("collective_send"))]
        return futures + [(e, e.submit("collective_receive", version, expected)) for e in explorers]


# synchronizer.sync_method -> the synchronizer class(stage_dir, synchronizer config)
SYNC_METHODS = Registry("synchronizer.sync_method", {
    "memory": "rft.sync.weights.MemorySync",
    "checkpoint": "rft.sync.weights.CheckpointSync",
    "collective": "rft.sync.weights.CollectiveSync",
})


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


def open_group(address: str, port: int, world: int, rank: int, timeout_s: float, device):
    """A process group of its own (not torch.distributed's default one, which a trainer's FSDP or
    vLLM's tensor parallelism may hold): the trainer is rank 0 and hosts the rendezvous store.

    `device`: where this member's tensors of the broadcast are. NCCL for CUDA tensors, gloo for
    CPU ones: chosen by the tensors, not by whether the machine has a GPU (a CPU run on a GPU
    machine sends CPU tensors, which NCCL refuses). Both wait at most `timeout_s` for a broadcast."""
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world, is_master=rank == 0, timeout=timeout)
    if torch.device(device).type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout  # (NCCL's default is its own 10 minutes, not sync_timeout)
        return dist.ProcessGroupNCCL(store, rank, world, options)
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
