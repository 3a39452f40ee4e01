"""How a run's weight syncs will travel, told before it starts (the dry run's `weight sync` line,
and a warning at the start of a run whose choice moves a large model the slow way every step).

    memory      cluster=inline: the trainer's tensors handed over in the process (the hf engine
                copies them; vLLM's own processes take them as bytes through its RPC)
                one node: a shared-memory segment the trainer writes and the explorers (vLLM's
                workers) read where it lies; more nodes: Ray's object store between them
    checkpoint  a safetensors file written and read back every sync
    collective  a broadcast from the trainer (nccl on GPUs, gloo on CPUs)

Planning only (rft.plan.memory): the size comes from the model's safetensors headers when it is
on this machine, else from its shape (a config.json, model.architecture), else from the parameter
count in its name ("Qwen2.5-7B": 7e9), and nothing is loaded.
"""

from __future__ import annotations

from rft.config import lora_adapter_sync
from rft.errors import ConfigError
from rft.plan.memory import check_lora_targets, dtype_bytes, lora_parameters, parameter_count, shape_of

# bytes per sync from which moving the weights as bytes through an RPC, or through a file on
# disk, every step is worth a warning: a 0.5B model in bfloat16 (~1 GB) through vLLM's RPC took
# ~16 s a sync on 2 CPU cores, 8x its generate
LARGE = 5 * 10**8



def route(cfg) -> tuple[str, str | None]:
    """(what the dry run says about the weight sync, a warning or None)."""
    s, c = cfg.synchronizer, cfg.cluster
    n, known = parameter_count(cfg.model.model_path)
    if known != "its files":  # counted from its shape (config.json, model.architecture) rather than its name
        shape, source = shape_of(cfg.model)
        n, known = (shape.parameters, source) if shape else (n, known)
    adapters = lora_adapter_sync(cfg.model)
    if adapters:  # the adapters alone (model.lora.sync=adapter), counted from the shape
        shape, source = shape_of(cfg.model)
        n, known = (lora_parameters(shape, cfg.model.lora), source) if shape else (None, known)
    nbytes = None if n is None else n * dtype_bytes(cfg.model.dtype)
    what = "LoRA adapter parameters (model.lora.sync=adapter)" if adapters else "parameters"
    size = ("size unknown (the model is not on this machine)" if nbytes is None else
            f"{_size(nbytes)} per sync ({f'{n / 1e6:,.1f}M' if n >= 10**5 else f'{n:,}'} {what} in {cfg.model.dtype}, "
            f"from {known})")
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
    if adapters:
        way = way.replace("vLLM's workers", "the explorers") + ", served by vLLM as a LoRA request on the base weights it keeps"
        slow = False
    text = f"{method} (synchronizer.sync_method), {every}: {size}, {way}"
    if not (slow and s.sync_interval == 1 and nbytes is not None and nbytes >= LARGE):
        return text, None
    better = ("cluster=local or ray with the explorers on the trainer's node (the shared-memory segment), "
              "or sync=collective" if method == "memory" else
              "sync=memory (explorers on the trainer's node) or sync=collective")
    return text, (f"weight sync: {_size(nbytes)} {every} {way}; for a model this size use {better}, "
                  f"or sync less often (synchronizer.sync_interval)")


def check_lora_sync(cfg) -> None:
    """model.lora.sync=adapter: what can serve and carry the adapters alone (and, as it reads the
    model's files as this module does, that model.lora.target_modules names modules of it)."""
    check_lora_targets(cfg.model.lora, cfg.model.model_path)
    if not lora_adapter_sync(cfg.model):
        return
    rm, method = cfg.explorer.rollout_model, str(cfg.synchronizer.sync_method)
    if rm.engine_type != "vllm":
        raise ConfigError(f"model.lora.sync=adapter needs explorer=vllm, which serves the adapters as a LoRA request "
                          f"on the base weights (explorer.rollout_model.engine_type={rm.engine_type} takes whole "
                          f"weights). Use explorer=vllm, or model.lora.sync=merged.")
    if method == "collective":
        raise ConfigError("model.lora.sync=adapter sends the adapters with sync=memory or sync=checkpoint (they are "
                          "small; sync=collective broadcasts whole weights). Set synchronizer.sync_method=memory, "
                          "or model.lora.sync=merged.")


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 10**9 else f"{nbytes / 1e6:.1f} MB"
