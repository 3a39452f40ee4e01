"""How a run's weight syncs will travel, told before it starts (the dry run's `weight sync` line,
and a warning at the start of a run whose choice moves a large model the slow way every step).

    memory      cluster=inline: the trainer's tensors handed over in the process (the hf engine
                copies them; vLLM's own processes take them as bytes through its RPC)
                one node: a shared-memory segment the trainer writes and the explorers (vLLM's
                workers) read where it lies; more nodes: Ray's object store between them
    checkpoint  a safetensors file written and read back every sync
    collective  a broadcast from the trainer (nccl on GPUs, gloo on CPUs)

Planning only: the size comes from the model's safetensors headers when it is on this machine,
else from the parameter count in its name ("Qwen2.5-7B": 7e9), and nothing is loaded.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from rft.config import DTYPES

# bytes per sync from which moving the weights as bytes through an RPC, or through a file on
# disk, every step is worth a warning: a 0.5B model in bfloat16 (~1 GB) through vLLM's RPC took
# ~16 s a sync on 2 CPU cores, 8x its generate
LARGE = 5 * 10**8

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # by rft.config.DTYPES' canonical names
_HEADER_DTYPES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}


def parameter_count(model_path: str) -> tuple[int | None, str]:
    """(parameters, how that is known): summed from the shapes in the safetensors headers of a
    local model directory (a tied output layer is stored once, and sent once), else read from a
    name like "Qwen2.5-7B-Instruct"; (None, "") when neither says."""
    path = Path(os.path.expanduser(model_path))
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if files:
        try:
            return sum(_header_parameters(f) for f in files), "its files"
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None, ""  # a damaged file: loading the model says which, with its own message
    m = re.search(r"(?<![\d.])(\d+(?:\.\d+)?)b(?![a-z])", path.name.lower())
    return (round(float(m.group(1)) * 1e9), "its name") if m else (None, "")


def _header_parameters(path: Path) -> int:
    """The parameters a safetensors file's header lists (its first 8 bytes: the header's length)."""
    with open(path, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        if not 0 < size <= 100 * 2**20:  # the format caps its header at 100 MB
            raise ValueError(f"{path}: not a safetensors header")
        header = json.loads(fh.read(size))
    total = 0
    for name, v in header.items():
        if name != "__metadata__" and v["dtype"] in _HEADER_DTYPES:
            n = 1
            for d in v["shape"]:
                n *= d
            total += n
    return total


def route(cfg) -> tuple[str, str | None]:
    """(what the dry run says about the weight sync, a warning or None)."""
    s, c = cfg.synchronizer, cfg.cluster
    n, known = parameter_count(cfg.model.model_path)
    nbytes = None if n is None else n * _BYTES[DTYPES.get(str(cfg.model.dtype).lower(), "float32")]
    size = ("size unknown (the model is not on this machine)" if nbytes is None else
            f"{_size(nbytes)} per sync ({n / 1e6:,.1f}M parameters in {cfg.model.dtype}, from {known})")
    every = "every step" if s.sync_interval == 1 else f"every {s.sync_interval} steps"
    vllm = cfg.explorer.rollout_model.engine_type == "vllm"
    method = str(s.sync_method.value if hasattr(s.sync_method, "value") else s.sync_method)
    if method == "memory" and c.backend == "inline":
        way = ("as safetensors bytes through vLLM's RPC into its own processes" if vllm else
               "in this process: the engine copies the trainer's tensors")
        slow = vllm
    elif method == "memory" and c.node_num == 1:
        way = ("through a shared-memory segment the trainer writes on its node, read there by "
               + ("vLLM's workers" if vllm else "the explorers") + " (Ray's object store if /dev/shm is too small)")
        slow = False
    elif method == "memory":
        way = "through a shared-memory segment to explorers on the trainer's node, Ray's object store to the others"
        slow = vllm  # on another node, vLLM then takes them as bytes through its RPC
    elif method == "checkpoint":
        way = "through a safetensors file on disk, written by the trainer and read by each explorer"
        slow = True
    else:
        way = f"by a broadcast from the trainer ({'nccl' if c.gpu_per_node else 'gloo'})"
        slow = False
    text = f"{method} (synchronizer.sync_method), {every}: {size}, {way}"
    if not (slow and s.sync_interval == 1 and nbytes is not None and nbytes >= LARGE):
        return text, None
    better = ("cluster=local or ray with the explorers on the trainer's node (the shared-memory segment), "
              "or sync=collective" if method == "memory" else
              "sync=memory (explorers on the trainer's node) or sync=collective")
    return text, (f"weight sync: {_size(nbytes)} {every} {way}; for a model this size use {better}, "
                  f"or sync less often (synchronizer.sync_interval)")


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 10**9 else f"{nbytes / 1e6:.1f} MB"
