"""The memory a run will take, per role and device, estimated before anything is loaded (the dry
run's `devices` and `memory` lines; a run that cannot fit stops before loading the model).

The devices planned for: cluster.node_num x gpu_per_node GPUs of cluster.gpu_memory_gb each (null:
this machine's GPUs' memory, as nvidia-smi reports it; 80 GiB assumed where this machine has none,
a login node planning a GPU job); with gpu_per_node=0, this machine's memory, shared by every actor.

Per trainer rank (P parameters, b bytes each in model.dtype, N = the data-parallel ranks: FSDP2
shards the weights, gradients and optimizer state; trainer=torch is N = 1):

    weights      P b / N                (param_offload: in CPU memory)
    gradients    P' b / N               (P' = the trained parameters: all, or LoRA's adapters)
    Adam         2 P' b / N             (torch's AdamW keeps both moments in the weights' dtype;
                                         optimizer_offload: in CPU memory)
    reference    P b / N                (an algorithm with a KL term or DPO; LoRA: the base, no copy;
                                         ref_offload: in CPU memory)
    teacher      P_t b / N              (on-policy distillation's frozen teacher, P_t from its files or
                                         its name, else P; ref_offload: in CPU memory)
    teacher top-k  R x S x k x 12       (distill_divergence=jsd: the teacher's top k log-probs, float32,
                                         and ids, int64, at each position of the step's R rows of S
                                         tokens at most; every rank holds the whole step's)
    critic       (2 + 2) P b / N more   (PPO's value model: weights, gradients, Adam; critic_offload:
                                         in CPU memory)
    gathered     2 layers' weights      (FSDP2 unshards one layer at a time, the next prefetched;
                                         also on one rank with fp32 master weights: the cast copies)
                 + V H b (x2 untied)    (the root unit's embedding and head, which FSDP2 does not
                                         reshard after the forward: whole until its backward)
    fp32 master weights (trainer.fp32_master_weights): weights, gradients, Adam and the critic's
                 at 4 bytes instead of b; the reference stays at b
    activations  T tokens x L layers x (6 H + 2 kv + 4 I) b   (what autograd keeps of a decoder
                 layer: the norms' and projections' inputs, q k v, the attention's output, the
                 MLP's gate, up and product); gradient_checkpointing: T x L x H b (each layer's
                 input) + one layer's whole
    logits       C x V x 12             (at the backward's peak, three [C, V] float32 tensors: the
                                         log-softmax kept for it, the gradient of the target's
                                         log-prob and the entropy together, the logits' gradient;
                                         the forward's peak is 2.25: rft/trainer/logprobs.py;
                                         C = logprob_chunk_size or T; x 20 with
                                         distill_divergence=jsd: five, the gradients of the rest
                                         bucket and of the teacher's tokens' log-probs besides)
    runtime      1 GiB on a GPU (CUDA context, allocator slack); on CPU the process itself
                 (python, torch, transformers, Ray's worker: CPU_RUNTIME)
    host copies  in CPU memory: sync=memory's shared-memory segment P b (one node, Ray: mapped by
                 the trainer and each hf explorer, so in each one's resident set); with the
                 explorers running ahead (sync_offset > 0 or sync_interval > 1) the trainer's
                 snapshots for an explorer Ray restarts, 3 P b at the moment a new one is taken;
                 fsdp2's whole weights gathered on rank 0 for a memory or checkpoint sync, P b

T, the tokens of a micro-batch: trainer.max_token_len_per_gpu with use_dynamic_bsz, else
micro_batch_size_per_gpu x max_model_len (every row at its longest).

Per engine (E bytes per parameter in the engine's dtype, TP = tensor_parallel_size):

    vllm (GPU)   per GPU, gpu_memory_utilization x the GPU's memory, taken whole: weights P E / TP,
                 ~2 GiB of activations and graphs, the rest KV cache (2 L kv E bytes per token / TP);
                 the engine's cache must hold one sequence of max_model_len tokens
    vllm (CPU)   weights P E + rollout_model.cpu_kvcache_space_gb + runtime
    hf           weights P E + the KV cache of the rows one generate() call holds (min of
                 generate_batch_size and the step's rollouts per engine) at max_model_len tokens
                 + three [rows, V] float32 score tensors + runtime

Not counted: reward-model and auxiliary-model workers, the explorer's task data, Ray's object store,
AdamW's step temporaries (a weights-sized one), what the C heap keeps of freed copies.
Checked against measured peaks: experiments/memory_plan/README.md. Planning only: no torch.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from rft.config import DTYPES, colocated, device_mapping
from rft.errors import ConfigError

log = logging.getLogger(__name__)

GiB = 2**30
GPU_RUNTIME = 1 * GiB
# a CPU actor's resident set before its model (python, torch, transformers, Ray's worker), measured
# (experiments/memory_plan/README.md)
CPU_RUNTIME = int(0.6 * GiB)
VLLM_ACTIVATIONS = 2 * GiB
ASSUMED_GPU_GIB = 80  # a login node planning a GPU job: an 80 GiB GPU (A100-80G, H100)
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_HEADER_DTYPES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}
_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")


@dataclass(frozen=True)
class Shape:
    """What the estimate reads of a decoder-only transformer (its config.json's numbers)."""
    parameters: int
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv: int  # key/value width per token and layer: num_key_value_heads x head_dim
    head_dim: int
    vocab: int
    tied: bool


@dataclass(frozen=True)
class Devices:
    gpus: int  # per node; 0: CPU only
    nodes: int
    memory: int  # bytes: one GPU's, or (CPU) this machine's
    source: str  # how the memory is known
    local_gpus: tuple = ()  # this machine's GPUs (name, bytes)


@dataclass(frozen=True)
class Role:
    name: str
    count: int  # processes (or engines) of it
    parts: tuple  # (label, bytes)
    total: int
    # a check the role fails, as (what, the keys to change, certain: its weights and optimizer
    # state alone exceed the device, whatever the estimate of activations), or None
    problem: tuple | None = None


# ---------------------------------------------------------------- the model's shape

def _read_config(model_cfg) -> tuple[dict | None, str]:
    """config.json of a local model directory, or of a hub id in the Hugging Face cache (read, never
    downloaded), else model.architecture."""
    path = Path(os.path.expanduser(str(model_cfg.model_path)))
    file = path / "config.json" if path.is_dir() else None
    if file is None and not path.exists():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(str(model_cfg.model_path), "config.json")
            file = Path(cached) if isinstance(cached, str) else None
        except Exception:  # not a valid hub id: nothing cached under it
            file = None
    if file is not None and file.is_file():
        try:
            return json.loads(file.read_text()), f"{file}"
        except (OSError, ValueError):
            pass  # a damaged config.json: loading the model says so, with its own message
    arch = model_cfg.get("architecture")
    return (dict(arch), "model.architecture") if arch else (None, "")


def shape_of(model_cfg) -> tuple[Shape | None, str]:
    """(the model's Shape, where it was read) or (None, "") when neither its config.json nor
    model.architecture is here. The parameter count is the safetensors headers' when the weights
    are on this machine, else counted from the shape (a Qwen2 / Llama decoder)."""
    raw, source = _read_config(model_cfg)
    if raw is None:
        return None, ""
    numbers, bad = _numbers(raw)
    if bad:
        if source == "model.architecture":
            raise ConfigError(f"model.architecture {bad}: give the model's config.json numbers ({', '.join(_KEYS)}, "
                              f"each a positive integer; num_key_value_heads, head_dim and tie_word_embeddings "
                              f"optional), or set it to null.")
        return None, ""  # not a decoder this estimate knows (a multimodal config nests its text model's)
    layers, h, inter, heads, vocab = (numbers[k] for k in _KEYS)
    head_dim = numbers.get("head_dim") or h // heads
    kv = (numbers.get("num_key_value_heads") or heads) * head_dim
    shape = Shape(0, layers, h, inter, heads, kv, head_dim, vocab, bool(raw.get("tie_word_embeddings", False)))
    # the safetensors headers' exact count where the weights are here; never the guess from a name
    counted, how = parameter_count(str(model_cfg.model_path))
    return Shape(counted if how == "its files" else _count(shape), *list(shape.__dict__.values())[1:]), source


def _numbers(raw) -> tuple[dict, str]:
    """The shape's integers of a config (the required _KEYS, and head_dim, num_key_value_heads where
    given), or what is wrong with them."""
    missing = [k for k in _KEYS if raw.get(k) is None]
    if missing:
        return {}, f"lacks {', '.join(missing)}"
    out = {}
    for k in (*_KEYS, "head_dim", "num_key_value_heads"):
        v = raw.get(k)
        if v is None and k not in _KEYS:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            return {}, f"has {k}={v!r}"
        out[k] = v
    return out, ""


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


def _header(path: Path) -> dict:
    """A safetensors file's header (its first 8 bytes: the header's length)."""
    with open(path, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        if not 0 < size <= 100 * 2**20:  # the format caps its header at 100 MB
            raise ValueError(f"{path}: not a safetensors header")
        return json.loads(fh.read(size))


def weight_modules(model_path: str) -> dict[str, list[int]] | None:
    """The modules with a 2-D weight (linear layers, embeddings) in a local model directory's
    safetensors headers, by full name as PEFT sees them, with the weight's [out, in] shape; None
    when the weights are not here or cannot be read (loading the model then says why)."""
    path = Path(os.path.expanduser(model_path))
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    try:
        found = {n.removesuffix(".weight"): v["shape"] for f in files for n, v in _header(f).items()
                 if n != "__metadata__" and n.endswith(".weight") and len(v["shape"]) == 2}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return dict(sorted(found.items())) or None


def adapter_parameters(model_path: str, lora) -> int | None:
    """LoRA's parameters counted on the model's own layers (rank x (in + out) for each adapted one),
    where its weights are here: all-linear as PEFT takes it (every linear layer but the output
    layer; embeddings are no linear layer), a list by PEFT's suffix rule, a string as a regular
    expression over full names. None when the weights are not here."""
    modules = weight_modules(model_path)
    if modules is None:
        return None
    tm = lora.target_modules
    if tm == "all-linear":
        chosen = [m for m in modules if "embed" not in m.rsplit(".", 1)[-1] and m.rsplit(".", 1)[-1] != "lm_head"]
    elif isinstance(tm, str):
        chosen = [m for m in modules if re.fullmatch(tm, m)]
    else:
        chosen = [m for m in modules if any(m == t or m.endswith(f".{t}") for t in tm)]
    return lora.rank * sum(modules[m][0] + modules[m][1] for m in chosen)


def check_lora_targets(lora, model_path: str) -> None:
    """Each name of a model.lora.target_modules list matches a module of the model, where its weights
    are here: PEFT refuses a list that matches nothing only when the trainer is built (after a sweep
    is queued), and skips a name that matches nothing while another matches (a misspelt v_proj:
    q_proj alone adapted, silently)."""
    tm = lora.target_modules
    if not lora.rank or isinstance(tm, str) or tm is None:  # all-linear, or a regular expression
        return
    modules = list(weight_modules(model_path) or [])
    if not modules:
        return
    for name in tm:  # PEFT's rule for a list: the full name, or its end after a dot
        if not any(m == name or m.endswith(f".{name}") for m in modules):
            linear = sorted({m.rsplit(".", 1)[-1] for m in modules if ".layers." in m or ".h." in m})
            example = next((m for m in modules if m.endswith(f".{linear[0]}")), modules[0]) if linear else modules[0]
            raise ConfigError(f"model.lora.target_modules: {name!r} names no module of the model at model.model_path "
                              f"(its linear layers: {', '.join(linear) or ', '.join(modules)}). PEFT matches a name "
                              f"against the end of each module's full name ({example.rsplit('.', 1)[-1]}: {example}); "
                              f"give those names, or all-linear.")


def _header_parameters(path: Path) -> int:
    """The parameters a safetensors file's header lists."""
    header = _header(path)
    total = 0
    for name, v in header.items():
        if name != "__metadata__" and v["dtype"] in _HEADER_DTYPES:
            n = 1
            for d in v["shape"]:
                n *= d
            total += n
    return total


def _count(s: Shape) -> int:
    """Parameters of a Qwen2 / Llama decoder (biases left out: < 0.1%)."""
    q = s.heads * s.head_dim
    layer = s.hidden * q + 2 * s.hidden * s.kv + q * s.hidden + 3 * s.hidden * s.intermediate + 2 * s.hidden
    return s.vocab * s.hidden * (1 if s.tied else 2) + s.layers * layer + s.hidden


def lora_parameters(s: Shape, lora) -> int:
    """The adapters' parameters: rank x (in + out) per adapted linear layer of every decoder layer
    (target_modules all-linear: q k v o, gate up down)."""
    q = s.heads * s.head_dim
    sizes = {"q_proj": s.hidden + q, "k_proj": s.hidden + s.kv, "v_proj": s.hidden + s.kv, "o_proj": q + s.hidden,
             "gate_proj": s.hidden + s.intermediate, "up_proj": s.hidden + s.intermediate,
             "down_proj": s.intermediate + s.hidden}
    tm = lora.target_modules
    if tm == "all-linear":
        targets = sizes
    elif isinstance(tm, str):  # a regular expression PEFT matches against each module's full name
        targets = {m: n for m, n in sizes.items() if re.search(tm, f"model.layers.0.{m}")}
    else:
        targets = {m: sizes.get(m, 0) for m in tm}
    return lora.rank * s.layers * sum(targets.values())


def dtype_bytes(name) -> int:
    return _BYTES[DTYPES.get(str(name).lower(), "float32")]


# ---------------------------------------------------------------- the devices

def local_gpus() -> list[tuple[str, int]]:
    """This machine's GPUs as (name, bytes of memory), from nvidia-smi; [] without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        name, _, mib = line.rpartition(",")
        if mib.strip().isdigit():
            gpus.append((name.strip(), int(mib) * 2**20))
    return gpus


def host_memory(root: str = "/") -> int:
    """The memory this process may use: the machine's, or less where its control group caps it (a
    container's --memory, a Kubernetes pod's limit, a Slurm job's --mem), past which the kernel
    kills the run however much the machine has."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min([physical, *_cgroup_limits(Path(root))])


def _cgroup_limits(root: Path) -> list[int]:
    """The memory limits of this process's control group and of each group above it (a limit on a
    parent holds for its children): cgroup v2's memory.max, v1's memory.limit_in_bytes ("max", or
    v1's huge number, means none)."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        if line.count(":") < 2:
            continue  # not a hierarchy line: the limit is left to the rest, not a traceback at planning
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base, name = root / "sys/fs/cgroup", "memory.max"
        elif "memory" in controllers.split(","):
            base, name = root / "sys/fs/cgroup/memory", "memory.limit_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            try:
                text = (base.joinpath(*parts[:depth]) / name).read_text().strip()
            except OSError:
                continue
            if text.isdigit():
                found.append(int(text))
    return found


def planned_devices(cfg) -> Devices:
    c = cfg.cluster
    here = tuple(local_gpus())
    if not c.gpu_per_node:
        return Devices(0, c.node_num, host_memory(), "this machine's memory", here)
    if c.gpu_memory_gb is not None:  # (> 0 and finite: rft.plan.ranges)
        return Devices(c.gpu_per_node, c.node_num, int(c.gpu_memory_gb * GiB), "cluster.gpu_memory_gb", here)
    if here:
        name, size = min(here, key=lambda g: g[1])
        return Devices(c.gpu_per_node, c.node_num, size, f"this machine's {name}", here)
    return Devices(c.gpu_per_node, c.node_num, ASSUMED_GPU_GIB * GiB,
                   "assumed: this machine has no GPU; set cluster.gpu_memory_gb", here)


def gib(n: float) -> str:
    return f"{n / GiB:.1f}" if n >= GiB / 10 else f"{n / GiB:.2f}"


# ---------------------------------------------------------------- the roles

def longest(model) -> int:
    """Tokens of the longest sequence: model.max_model_len, or prompt + response budgets."""
    return model.max_model_len or model.max_prompt_tokens + model.max_response_tokens


def _tokens(cfg, plan) -> int:
    """Tokens of one micro-batch at its largest."""
    return plan.max_token_len_per_gpu or plan.micro_batch_size * longest(cfg.model)


def _activations(cfg, s: Shape, tokens: int) -> tuple[str, int]:
    b = dtype_bytes(cfg.model.dtype)
    q = s.heads * s.head_dim
    layer = tokens * (4 * s.hidden + 2 * q + 2 * s.kv + 4 * s.intermediate) * b
    if cfg.trainer.gradient_checkpointing:
        return f"activations ({tokens:,} tokens, checkpointed)", tokens * s.layers * s.hidden * b + layer
    return f"activations ({tokens:,} tokens)", s.layers * layer


def trainer_role(cfg, plan, s: Shape, dev: Devices) -> Role:
    """One trainer rank's memory (the module docstring's formulas)."""
    t, m = cfg.trainer, cfg.model
    n, b, gpu = plan.dp_size, dtype_bytes(m.dtype), dev.gpus > 0
    # trainer.fp32_master_weights: weights, gradients and Adam in float32, computed in model.dtype
    mb = 4 if t.fp32_master_weights else b
    trained = lora_parameters(s, m.lora) if m.lora.rank else s.parameters
    where = " in CPU memory"
    parts = [("weights" + where * (gpu and t.param_offload), s.parameters * mb // n),
             ("gradients" + where * (gpu and t.param_offload), trained * mb // n),
             ("Adam" + where * (gpu and t.optimizer_offload), 2 * trained * mb // n)]
    if plan.needs.reference and not m.lora.rank:
        parts.append(("reference" + where * (gpu and (t.ref_offload or t.param_offload)), s.parameters * b // n))
    if plan.needs.teacher:  # its own size: from its files or its name, else as large as the policy
        count, _ = parameter_count(str(cfg.algorithm.teacher_model_path))
        parts.append(("teacher" + where * (gpu and (t.ref_offload or t.param_offload)), (count or s.parameters) * b // n))
        if str(cfg.algorithm.distill_divergence) == "jsd":
            k = cfg.algorithm.distill_top_k
            parts.append((f"teacher top-{k}", plan.experiences_per_step * longest(m) * k * 12))
    if plan.needs.critic:
        parts.append(("critic" + where * (gpu and (t.critic_offload or t.param_offload)), 4 * s.parameters * mb // n))
    if n > 1 or mb != b:  # a block's weights whole (or cast) for its compute, and the next one's
        outer = s.vocab * s.hidden * (1 if s.tied else 2)  # the embedding and the head: the root unit's
        parts.append(("gathered layers", 2 * (s.parameters - outer) // s.layers * b))
        # the root unit is whole from its forward to its backward (FSDP2 does not reshard the root
        # after the forward: torch's FSDPState._lazy_init), beside the shard "weights" counts
        parts.append(("gathered embedding and head", outer * b))
    parts += [(k + where * gpu, v) for k, v in _host_copies(cfg, s.parameters * b, ranks=n, gathered=s.parameters * mb)]
    tokens = _tokens(cfg, plan)
    parts.append(_activations(cfg, s, tokens))
    chunk = min(t.logprob_chunk_size or tokens, tokens)
    # the JSD's rest bucket (the student's log-probs with the teacher's top ids masked out, which the
    # logsumexp keeps for its backward: rft.trainer.logprobs._outside) and the log-probs at those ids:
    # their gradients make the backward's peak five [C, V] float32 tensors (measured)
    per = 20 if plan.needs.teacher and str(cfg.algorithm.distill_divergence) == "jsd" else 12
    parts.append((f"logits ({chunk:,}-token {'chunks' if chunk < tokens else 'micro-batch'})", chunk * s.vocab * per))
    parts.append(("runtime", GPU_RUNTIME if gpu else CPU_RUNTIME))
    total = sum(v for k, v in parts if where not in k)  # on a GPU, what its memory holds
    problem = None
    if gpu and total > dev.memory:
        static = sum(v for k, v in parts if k.split(" (")[0] in _STATE)
        problem = (f"{'a trainer rank' if n > 1 else 'the trainer'} needs ~{gib(total)} GiB of its GPU's {gib(dev.memory)}",
                   _trainer_fixes(cfg, parts), static > dev.memory)
    return Role(f"trainer rank (x{n})" if n > 1 else "trainer", n, tuple(parts), total, problem)


_STATE = ("weights", "gradients", "Adam", "reference", "teacher", "critic")


def _host_copies(cfg, nbytes: int, ranks: int = 0, gathered: int = 0) -> list:
    """Whole copies of the weights a process keeps in host memory at its peak: the shared-memory
    segment of sync=memory on one node with Ray (mapped by the trainer and each explorer: it counts
    in each one's resident set, one copy on the machine); the trainer's (ranks > 0) snapshots of the
    versions the explorers serve and explore with while they run ahead, for an explorer Ray
    restarts (rft.runtime.explorers: 2 versions with sync_offset 1, and a third while the newest is
    taken before the oldest is dropped); fsdp2's whole weights, gathered on rank 0 for a memory or
    checkpoint sync (a collective one gathers a tensor at a time), `gathered` bytes (float32 master
    weights: gathered as they are, then cast)."""
    c, sc = cfg.cluster, cfg.synchronizer
    ray = cfg.mode == "both" and c.backend == "ray"
    out = [("sync segment", nbytes)] if ray and c.node_num == 1 and sc.sync_method == "memory" else []
    if ranks and ray and c.max_actor_restarts > 0 and (sc.sync_offset > 0 or sc.sync_interval > 1):
        out.append(("snapshots" + " (rank 0)" * (ranks > 1), 3 * nbytes))
    if ranks > 1 and cfg.mode == "both" and sc.sync_method in ("memory", "checkpoint"):
        out.append(("weights gathered for a sync (rank 0)", max(gathered, nbytes) + (gathered > nbytes) * nbytes))
    return out


def _trainer_fixes(cfg, parts) -> str:
    """The keys that lower a trainer rank's largest parts."""
    big = max((p for p in parts if "in CPU memory" not in p[0]), key=lambda p: p[1])[0]
    fsdp = cfg.trainer.trainer_strategy == "fsdp2"
    if big.startswith("activations"):
        return ("trainer.gradient_checkpointing=true, " if not cfg.trainer.gradient_checkpointing else "") + \
            "a lower trainer.max_token_len_per_gpu (use_dynamic_bsz) or micro_batch_size_per_gpu"
    if big.startswith("logits"):
        return "trainer.logprob_chunk_size (e.g. 2048), or fewer tokens per micro-batch"
    spread = ("more ranks (trainer.ranks, cluster.gpu_per_node, cluster.node_num), "
              "trainer.param_offload=true and optimizer_offload=true"
              + ", trainer.fp32_master_weights=false (half the bytes)" * bool(cfg.trainer.fp32_master_weights) if fsdp else
              "trainer=fsdp2 (the weights, gradients and Adam sharded over ranks), or model.lora.rank (e.g. 64)")
    return f"{spread}; or a smaller model"


def engine_role(cfg, plan, s: Shape, dev: Devices) -> Role | None:
    """One engine's memory (the module docstring's formulas); None for a study's own engine."""
    rm, m = cfg.explorer.rollout_model, cfg.model
    e = dtype_bytes(rm.dtype or m.dtype)
    seq, tp = longest(m), rm.tensor_parallel_size
    per_token = 2 * s.layers * s.kv * e
    name = f"explorer (x{plan.explorers})" if plan.explorers > 1 else "explorer"
    if rm.engine_type == "vllm" and dev.gpus:
        total = int(rm.gpu_memory_utilization * dev.memory) * tp
        weights = s.parameters * e
        cache = total - weights - VLLM_ACTIVATIONS * tp
        rows = max(plan.tasks_per_step * plan.rollouts_per_task // max(plan.explorers, 1), 1)
        holds = max(cache, 0) // (per_token * seq)
        # per GPU, as the trainer's: the engine's tensor-parallel ranks split the weights and the cache
        parts = (("weights", weights // tp), ("activations", VLLM_ACTIVATIONS),
                 (f"KV cache (holds {min(holds, rows):,} of {rows:,} sequences at {seq:,} tokens)", max(cache, 0) // tp))
        problem = None if holds >= 1 else (
            f"the vLLM engine's weights ({gib(weights / tp)} GiB a GPU) leave no room in explorer.rollout_model."
            f"gpu_memory_utilization={rm.gpu_memory_utilization:g} of {gib(dev.memory)} GiB for one sequence's "
            f"KV cache ({seq:,} tokens)", "explorer.rollout_model.tensor_parallel_size (GPUs per engine), "
            "gpu_memory_utilization, or a lower model.max_response_tokens", weights / tp > total / tp)
        label = name + (f", per GPU of {tp}" if tp > 1 else "")
        return Role(label, plan.explorers * tp, parts, total // tp, problem)
    runtime = GPU_RUNTIME if dev.gpus else CPU_RUNTIME
    if rm.engine_type == "vllm":
        parts = (("weights", s.parameters * e), ("KV cache (cpu_kvcache_space_gb)", rm.cpu_kvcache_space_gb * GiB),
                 ("runtime", runtime))
    elif rm.engine_type == "hf":
        rows = min(rm.generate_batch_size, max(-(-plan.tasks_per_step * plan.rollouts_per_task // max(plan.explorers, 1)), 1))
        host = [(k + " in CPU memory" * bool(dev.gpus), v) for k, v in _host_copies(cfg, s.parameters * e)]
        parts = (("weights", s.parameters * e), *host, (f"KV cache ({rows} rows x {seq:,} tokens)", rows * seq * per_token),
                 (f"scores ({rows} rows)", 3 * rows * s.vocab * 4), ("runtime", runtime))
    else:
        return None
    total = sum(v for k, v in parts if "in CPU memory" not in k)
    problem = None
    if dev.gpus and total > dev.memory:
        problem = (f"an explorer needs ~{gib(total)} GiB of its GPU's {gib(dev.memory)}",
                   "explorer=vllm with tensor_parallel_size, or a lower explorer.rollout_model.generate_batch_size",
                   parts[0][1] > dev.memory)
    return Role(name, plan.explorers, parts, total, problem)


# ---------------------------------------------------------------- the plan's memory, told and checked

@dataclass(frozen=True)
class Estimate:
    devices: Devices
    shape: Shape | None
    source: str
    roles: tuple
    problems: tuple  # Role.problem's


def estimate(cfg, plan) -> Estimate:
    """Every role's memory against the planned devices, and what does not fit."""
    dev = planned_devices(cfg)
    s, source = shape_of(cfg.model)
    if s is None:
        return Estimate(dev, None, "", (), ())
    roles = []
    if cfg.mode in ("both", "train"):
        roles.append(trainer_role(cfg, plan, s, dev))
    if plan.explorers:
        roles.append(engine_role(cfg, plan, s, dev))
    roles = [r for r in roles if r is not None]
    problems = [r.problem for r in roles if r.problem]
    c, here = cfg.cluster, len(dev.local_gpus)
    if dev.gpus and here and here < dev.gpus and c.ray_address is None:  # a run here stops (check_gpus_here)
        problems.insert(0, (f"this machine has {here} GPU{'s' * (here > 1)} and the plan asks for {dev.gpus} "
                            f"(cluster.gpu_per_node)", f"cluster.gpu_per_node={here} and the engines and trainer "
                            f"ranks to fit it, or run on a machine with {dev.gpus}", False))
    if dev.gpus and colocated(cfg) and len(roles) == 2 and not cfg.explorer.rollout_model.enable_sleep_mode:
        both = roles[0].total + roles[1].total
        if both > dev.memory:
            problems.append((f"colocated, the trainer (~{gib(roles[0].total)} GiB) and the engine "
                             f"(~{gib(roles[1].total)}) share a GPU of {gib(dev.memory)} GiB",
                             "explorer.rollout_model.enable_sleep_mode=true (the engine releases the GPU while "
                             "the trainer trains), a lower gpu_memory_utilization, or "
                             + ("cluster.colocate=false" if device_mapping(cfg) is None else
                                "cluster.device_mapping lists of trainer and explorer that do not overlap"), False))
    problems += _tensor_parallel_problem(cfg, s)
    if dev.gpus and colocated(cfg) and len(roles) == 2 and cfg.explorer.rollout_model.enable_sleep_mode:
        problems += _wake_problem(cfg, roles, dev)
    if not dev.gpus:
        both = sum(r.count * r.total for r in roles)
        # certain: the weights and optimizer state alone are over this machine's memory
        state = sum(r.count * v for r in roles for k, v in r.parts if k.split(" (")[0] in _STATE)
        if both > dev.memory:
            problems.append((f"the actors need ~{gib(both)} GiB together and this machine has {gib(dev.memory)}",
                             "a smaller model, fewer explorers (explorer.rollout_model.engine_num) or trainer ranks",
                             state > dev.memory))
    return Estimate(dev, s, source, tuple(roles), tuple(problems))


def _tensor_parallel_problem(cfg, s: Shape) -> list:
    """vLLM gives each of an engine's tensor-parallel GPUs an equal share of the attention heads,
    and of the key/value heads (or copies of one, when there are fewer than GPUs)."""
    rm = cfg.explorer.rollout_model
    tp, kv_heads = rm.tensor_parallel_size, s.kv // s.head_dim
    if rm.engine_type != "vllm" or tp <= 1 or (s.heads % tp == 0 and (kv_heads % tp == 0 or tp % kv_heads == 0)):
        return []
    most = cfg.cluster.gpu_per_node or s.heads  # an engine's GPUs are on one node
    fits = [d for d in range(1, min(s.heads, most) + 1) if s.heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)]
    return [(f"explorer.rollout_model.tensor_parallel_size={tp} does not divide the model's {s.heads} attention heads "
             f"and {kv_heads} key/value heads evenly (vLLM splits them over the engine's GPUs)",
             f"tensor_parallel_size to one of {', '.join(map(str, fits))}", True)]


def _wake_problem(cfg, roles: list, dev: Devices) -> list:
    """Colocated with sleep mode: the engine takes its gpu_memory_utilization of the GPU again each
    time it wakes, while the trainer keeps its weights and optimizer state there between steps
    (its activations and gradients are freed and handed back)."""
    trainer, engine = roles
    kept = sum(v for k, v in trainer.parts if k.split(" (")[0] in ("weights", "Adam", "reference", "teacher", "critic", "runtime"))
    if kept + engine.total <= dev.memory:
        return []
    rm = cfg.explorer.rollout_model
    room = (dev.memory - kept) / dev.memory
    fix = (f"explorer.rollout_model.gpu_memory_utilization={max(room, 0) // 0.01 / 100:.2f} or lower, "
           if room > 0.1 else "") + "trainer.param_offload=true and optimizer_offload=true (trainer=fsdp2)"
    return [(f"colocated, the engine takes gpu_memory_utilization={rm.gpu_memory_utilization:g} x {gib(dev.memory)} = "
             f"{gib(engine.total)} GiB each time it wakes, while the trainer keeps ~{gib(kept)} GiB (weights, Adam, "
             f"reference, runtime) on the same GPU", fix, True)]


def describe_devices(cfg, est: Estimate) -> list[tuple[str, str]]:
    """The dry run's rows: the devices, the placement per role, the memory per role, what does not fit."""
    dev = est.devices
    if dev.gpus:
        rows = [("devices", f"{dev.nodes} node{'s' * (dev.nodes > 1)} x {dev.gpus} GPUs (cluster.node_num, gpu_per_node) "
                            f"of {gib(dev.memory)} GiB ({dev.source})" + _here(dev))]
    else:
        rows = [("devices", f"CPU only (cluster.gpu_per_node=0): {gib(dev.memory)} GiB of memory on this machine")]
    rows.append(("placement", _placement(cfg)))
    if est.shape is None:
        rows.append(("memory", "not estimated: the model's config.json is not on this machine and model.architecture "
                               "is not set"))
        return rows
    where = "a GPU" if dev.gpus else "this machine"
    n = est.shape.parameters
    count = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    rows.append(("memory", f"GiB on {where}, for {count} parameters (shape from {est.source})"))
    rows += _lora_row(cfg, est.shape)
    for r in est.roles:
        on = " + ".join(f"{k} {gib(v)}" for k, v in r.parts)
        rows.append(("", f"{r.name}: ~{gib(r.total)} = {on}"))
    for what, keys, _ in est.problems:
        rows.append(("does not fit", f"{what}; change: {keys}"))
    return rows


def _lora_row(cfg, s: Shape) -> list[tuple[str, str]]:
    """What LoRA trains (the dry run's `lora` row): rank 0 is no LoRA, so a study's other LoRA keys
    set beside it are named, as a sweep over them would change nothing."""
    lora = cfg.model.lora
    tm = lora.target_modules
    shown = tm if isinstance(tm, str) else f"[{', '.join(map(str, tm))}]"
    if not lora.rank:
        set_ = [f"model.lora.alpha={lora.alpha:g}"] * (lora.alpha != 16) + [f"model.lora.target_modules={shown}"] * (
            tm != "all-linear")
        return [("lora", f"off (model.lora.rank=0): every weight trains, though {' and '.join(set_)} "
                         f"{'is' if len(set_) == 1 else 'are'} set")] if set_ else []
    n = adapter_parameters(str(cfg.model.model_path), lora)
    n = lora_parameters(s, lora) if n is None else n
    return [("lora", f"rank {lora.rank}, alpha {lora.alpha:g} (updates scaled by alpha / rank = "
                     f"{lora.alpha / lora.rank:g}), target_modules {shown}: {n:,} adapter parameters train, "
                     f"{n / s.parameters:.1%} of the {s.parameters:,}; the base weights are frozen")]


def _here(dev: Devices) -> str:
    if not dev.local_gpus:
        return "; this machine has none: plan only, a run here stops"
    if len(dev.local_gpus) < dev.gpus:
        return f"; this machine has {len(dev.local_gpus)}"
    return ""


def _placement(cfg) -> str:
    from rft.plan.placement import explorer_count, reward_models, trainer_ranks

    rm, tr, c = cfg.explorer.rollout_model, cfg.trainer, cfg.cluster
    if device_mapping(cfg) is not None:
        return _mapped_placement(cfg)
    each = f"{rm.tensor_parallel_size} GPU{'s' * (rm.tensor_parallel_size > 1)} each" if c.gpu_per_node else \
        f"{c.cpus_per_actor} CPU each"
    out = []
    if explorer_count(cfg):
        out.append(f"{explorer_count(cfg)} {rm.engine_type} engine{'s' * (explorer_count(cfg) > 1)} on {each} "
                   f"(explorer.rollout_model.engine_num, tensor_parallel_size)")
    if cfg.mode in ("both", "train"):
        n = trainer_ranks(cfg)
        out.append(f"trainer {tr.trainer_strategy}, {n} rank{'s' * (n > 1)}" + (" on a GPU each" if c.gpu_per_node else ""))
    out += [_reward_model_place(c, r) for r in reward_models(cfg)]
    out.append(f"weights by sync={cfg.synchronizer.sync_method}" if cfg.mode == "both" else "")
    return "; ".join(o for o in out if o) + ("; colocated (cluster.colocate)" if c.colocate else "")


def _reward_model_place(c, r) -> str:
    """A reward-model worker's part of the placement row, as rft.plan.placement places it (they reserve
    CPUs or a GPU like the actors, so the row says where they go)."""
    if c.colocate:
        where = "sharing the one bundle"
    elif r.args["colocate"]:
        where = "sharing bundle 0 (args.colocate)"
    elif c.gpu_per_node:
        where = "on a GPU of its own"
    else:
        where = f"on {r.args['num_cpus'] or 1} CPU (args.num_cpus)"
    return f"reward model {r.where} {where}"


def _mapped_placement(cfg) -> str:
    """The dry run's placement row for cluster.device_mapping: each role's devices."""
    from rft.plan.placement import explorer_count, reward_models, trainer_ranks

    m, rm, tr = device_mapping(cfg), cfg.explorer.rollout_model, cfg.trainer
    engines, workers = explorer_count(cfg), len(reward_models(cfg))
    out = []
    if engines:
        out.append(f"{engines} {rm.engine_type} engine{'s' * (engines > 1)} on "
                   f"{_spans(m['explorer'][:engines * rm.tensor_parallel_size])} ({rm.tensor_parallel_size} each)")
    if cfg.mode in ("both", "train"):
        n = trainer_ranks(cfg)
        out.append(f"trainer {tr.trainer_strategy}, {n} rank{'s' * (n > 1)} on {_spans(m['trainer'])}")
    if workers:
        out.append(f"reward models on {_spans(m['reward_model'][:workers])}")
    out.append(f"weights by sync={cfg.synchronizer.sync_method}" if cfg.mode == "both" else "")
    shared = "colocated" if colocated(cfg) else "separated"
    return "; ".join(o for o in out if o) + f"; {shared} (cluster.device_mapping)"


def _spans(devices: list[int]) -> str:
    """[0, 1, 2, 3, 6] -> "devices 0-3, 6"; [2] -> "device 2"."""
    runs = []
    for d in devices:
        if runs and d == runs[-1][1] + 1:
            runs[-1][1] = d
        else:
            runs.append([d, d])
    return f"device{'s' * (len(devices) > 1)} " + ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def check_gpus_here(cfg) -> None:
    """Before a run plans or loads anything: the GPUs it plans for are on this machine, when it runs
    here (its own Ray instance, or inline; in a Slurm job rft.plan.placement.check_allocation checks
    the allocation, and a Ray cluster it joins has its own)."""
    c = cfg.cluster
    if not c.gpu_per_node or c.ray_address is not None:
        return
    here = local_gpus()
    if not here:
        raise ConfigError(_no_gpu(cfg))
    if len(here) < c.gpu_per_node:
        raise ConfigError(
            f"cluster.gpu_per_node={c.gpu_per_node}, but this machine has {len(here)} GPU"
            f"{'s' * (len(here) > 1)} ({', '.join(n for n, _ in here)}). Set cluster.gpu_per_node={len(here)} "
            f"(and check the plan with dry_run=true: the engines and trainer ranks must fit them), or run on "
            f"a machine with {c.gpu_per_node}.")


def check_model_here(cfg) -> None:
    """Before a run starts anything: a hub id (model.model_path, critic_model_path) that is neither a
    directory here nor in the Hugging Face cache must be reachable on the hub, or the run would
    stop minutes later, in an actor, at the download."""
    m = cfg.model
    if cfg.cluster.ray_address is not None:  # a Ray cluster it joins: the model may be on its nodes
        return
    for key in ("model_path", "critic_model_path"):
        hub_id = m.get(key)
        # a local path (the plan says when it is missing) or the project's own builder: no hub id
        local = os.path.expanduser(str(hub_id)).startswith(("/", ".")) or str(hub_id).count("/") > 1
        if not hub_id or local or (key == "model_path" and m.builder) or Path(os.path.expanduser(str(hub_id))).exists():
            continue
        try:
            from huggingface_hub import try_to_load_from_cache

            if isinstance(try_to_load_from_cache(str(hub_id), "config.json"), str):
                continue  # downloaded before: transformers loads it from the cache
        except Exception:  # not a valid hub id: the hub's answer below says what is wrong
            pass
        reason = _hub_answer(str(hub_id))
        if reason:
            raise ConfigError(
                f"model.{key}={hub_id!r} is not a directory on this machine nor in its Hugging Face cache, and "
                f"{reason}. Download it where the hub is reachable (huggingface-cli download {hub_id}) and set "
                f"model.{key} to its directory (or copy that machine's cache, HF_HOME, here).")


def _hub_answer(hub_id: str) -> str | None:
    """Why `hub_id` cannot be downloaded from here, or None when the hub has it for us."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set (no download is tried)"
    try:
        HfApi().model_info(hub_id, timeout=10)
    except GatedRepoError:
        return "it is gated on the hub: accept its license there and set HF_TOKEN"
    except RepositoryNotFoundError:
        return "the hub has no model of that name (or it is private: set HF_TOKEN)"
    except Exception as e:  # no network, DNS, a proxy, a timeout
        return f"the hub cannot be reached from here ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return None


def check_memory(stages: list, plans: list) -> None:
    """What surely cannot fit the devices (a trainer rank's weights and optimizer state alone, an
    engine's weights) stops the run before it loads the model; an estimate over a device's memory
    that might still fit is a warning."""
    for s, plan in zip(stages, plans):
        for what, keys, certain in estimate(s, plan).problems:
            if certain:
                raise ConfigError(f"the plan cannot fit: {what}. Change {keys} (the whole estimate: dry_run=true).")
            log.warning("memory: %s (an estimate; dry_run=true shows it). If the run "
                                                "runs out of memory, change %s.", what, keys)


def _no_gpu(cfg) -> str:
    c, rm = cfg.cluster, cfg.explorer.rollout_model
    return (f"this run is planned for GPUs, and this machine has none (nvidia-smi finds no GPU), so nothing was "
            f"started or loaded. It needs {c.node_num} node{'s' * (c.node_num > 1)} x {c.gpu_per_node} GPUs "
            f"(cluster.node_num, gpu_per_node) for {cfg.model.model_path}, with {rm.engine_type} engines and a "
            f"{cfg.trainer.trainer_strategy} trainer (dry_run=true shows the plan and the memory per role). Here, "
            f"run the same loop at a size this machine can: `python run.py` (the tiny default: a model built "
            f"locally, its reward rises within minutes), or `python run.py model=qwen2.5-0.5b-shape` (Qwen2.5-0.5B's "
            f"shape with random weights, on CPU). For this plan: run it on GPU nodes (hydra/launcher=slurm, or "
            f"launchers/ray_slurm.sbatch) or join a Ray cluster that has them (cluster=ray "
            f"cluster.ray_address=HOST:PORT).")
