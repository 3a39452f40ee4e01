"""The trainer's step at size: padded vs packed vs packed + token-budget micro-batches vs + chunked
log-probs, on a ~100M-parameter model built here and a batch of long-tailed lengths.

    .venv/bin/python experiments/trainer_benchmark/benchmark.py [--rows 32] [--repeats 2] [--small]

Each arm is an RL step of the real trainer (rft.trainer.trainer.Trainer.train_step: GRPO, one optimizer
step, on-policy), timed after one warm-up step, in a fresh process, arms interleaved `--repeats` times (A B C D A B C D ...):

    padded          trainer.use_remove_padding=false, 8 rows per micro-batch, each padded to its longest
    packed          the same micro-batches, sequences packed end to end (no padding)
    packed+budget   + trainer.use_dynamic_bsz: micro-batches of max_token_len_per_gpu tokens
    +chunked        + trainer.logprob_chunk_size: the output layer 1024 positions at a time

and prints, per arm, the median trainer tokens/s (real tokens forwarded / the step's seconds) and
the steps' peak memory (the process's peak resident set during the two steps, over its resident
set just before; the optimizer's state, allocated in the first, is in every arm), then the ratios to
padded and the size of the largest micro-batch's float32 logits tensor, which chunking never
holds whole. `--small`: a 2-layer model and 8 rows (seconds; what the test runs).

    .venv/bin/python experiments/trainer_benchmark/benchmark.py --logprobs [--rows 8] [--response 128]

measures instead what one micro-batch's log-probs (rft.trainer.logprobs.token_logprobs, packed,
from the last prompt token, as the trainer calls it) allocate at the Qwen2.5-0.5B shape
(model=qwen2.5-0.5b-shape, bfloat16, vocabulary 151,936) through their forward and backward,
whole and in chunks of 256 positions: the peak of the bytes torch allocates beyond the model's
weights (`live_bytes`: exact, not the process's resident set, which the allocator's caching blurs),
the gradients of the weights included, and that peak over one float32 [positions, vocabulary] tensor.

A shared 2-core machine is noisy: read the ratios from one invocation, not the absolute figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

ARMS = {
    "padded": ["trainer.use_remove_padding=false"],
    "packed": [],
    "packed+budget": ["trainer.use_dynamic_bsz=true"],
    "+chunked": ["trainer.use_dynamic_bsz=true", "trainer.logprob_chunk_size=1024"],
}
PROMPT = 32  # tokens
SIZES = {  # Qwen2 shapes: ~100M parameters (tied embeddings), or a small one for the test
    "full": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, vocab_size=32000, max_len=512),
    "small": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=4000, max_len=128),
}


def build_model(directory: Path, size: str) -> None:
    """A randomly initialised Qwen2 of the given shape, with the tiny model's tokenizer (the
    trainer reads only its pad id; the model's vocabulary may be larger than a tokenizer's)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from rft.models import ensure_model

    if (directory / "config.json").exists():
        return
    shape = dict(SIZES[size])
    max_len = shape.pop("max_len")
    torch.manual_seed(0)
    config = Qwen2Config(**shape, max_position_embeddings=2 * max_len, tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    tiny = _compose(["stages=[]"]).model
    ensure_model(tiny)
    AutoTokenizer.from_pretrained(os.path.expanduser(tiny.model_path)).save_pretrained(directory)


def lengths(rows: int, max_len: int, seed: int = 0) -> list[int]:
    """Response lengths with a long tail: log-normal around max_len/8, cut to [8, max_len - prompt]."""
    rng = random.Random(seed)
    return [int(min(max(rng.lognormvariate(math.log(max_len / 8), 1.0), 8), max_len - PROMPT)) for _ in range(rows)]


def experiences(rows: int, size: str):
    from rft.data.experience import Experience

    rng = random.Random(1)
    vocab, max_len = SIZES[size]["vocab_size"], SIZES[size]["max_len"]
    out = []
    for i, n in enumerate(lengths(rows, max_len)):
        tokens = [rng.randrange(3, vocab) for _ in range(PROMPT + n)]
        # groups of 4 with rewards 1, 0, 1, 0: every row has a non-zero advantage
        out.append(Experience(tokens, PROMPT, [0.0] * n, reward=float(i % 2), group_id=f"0/{i // 4}"))
    return out


def _compose(overrides: list[str]):
    """The config as `python run.py <overrides>` composes it."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    import rft.config  # noqa: F401

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def arm(name: str, model_dir: str, rows: int, size: str) -> dict:
    """One arm, in this (fresh) process: a trainer, one step, its throughput and peak memory."""
    import torch

    from rft.plan.batch import make_plan, stage_configs
    from rft.trainer.trainer import Trainer

    torch.set_num_threads(os.cpu_count() or 1)
    max_len = SIZES[size]["max_len"]
    cfg = stage_configs(_compose([
        "stages=[]", "cluster=inline", f"model.model_path={model_dir}", "model.builder=null", "model.dtype=float32",
        f"model.max_prompt_tokens={PROMPT}", f"model.max_response_tokens={max_len - PROMPT}",
        f"buffer.batch_size={rows // 4}", "algorithm.repeat_times=4", "trainer.micro_batch_size_per_gpu=8",
        # the budget: what a padded micro-batch of 8 rows of the longest length may hold
        f"trainer.max_token_len_per_gpu={8 * max_len}", *ARMS[name]]))[0]
    trainer = Trainer(cfg, make_plan(cfg, 1000))
    exps = experiences(rows, size)
    before = _rss()
    trainer.train_step(exps)  # warm-up: first-call costs, the optimizer's state allocated
    t0 = time.perf_counter()
    metrics = trainer.train_step(exps)
    elapsed = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    real = sum(len(e.tokens) for e in exps)
    micro = ([(s, e) for s, e in trainer._micro_batches([len(e.tokens) for e in exps], 0, rows)])
    biggest = max(sum(len(x.tokens) - 1 for x in exps[s:e]) for s, e in micro)
    return {"arm": name, "tokens_per_s": real / elapsed, "peak_mb": (peak - before) / 2**20,
            "padding_frac": metrics["perf/padding_frac"], "micro_batches": len(micro),
            "logits_mb": biggest * SIZES[size]["vocab_size"] * 4 / 2**20}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def summarize(results: list[dict]) -> dict:
    """Per arm: median tokens/s and peak memory; ratios to the padded arm."""
    by = {}
    for r in results:
        by.setdefault(r["arm"], []).append(r)
    out = {}
    for name, rs in by.items():
        out[name] = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                     "peak_mb": statistics.median(r["peak_mb"] for r in rs),
                     "padding_frac": rs[0]["padding_frac"], "micro_batches": rs[0]["micro_batches"],
                     "logits_mb": rs[0]["logits_mb"]}
    base = out["padded"]
    for v in out.values():
        v["speedup"] = v["tokens_per_s"] / base["tokens_per_s"]
    return out


def live_bytes(*before):
    """Within `with live_bytes(*tensors) as mem:`, the bytes of the tensors torch makes that are
    alive (mem.live) and their peak (mem.peak), counted by storage as each op returns and freed
    as each storage goes; storages made before (the given tensors: inputs, weights) are not
    counted, nor views of them. (A TorchDispatchMode: torch is imported when it is made.)"""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    class Mode(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.known = {t.untyped_storage().data_ptr() for t in before}
            self.live = self.peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            tree_map(self._track, out)
            return out

        def _track(self, t):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.known:
                    self.known.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, storage.nbytes())
            return t

        def _free(self, key, n):
            self.known.discard(key)
            self.live -= n

    return Mode()


def logprob_peaks(rows: int, response: int, chunks=(None, 256)) -> list[dict]:
    """The --logprobs measurement (module docstring), one dict per chunk size."""
    import torch

    from rft.models import ensure_model, load_model
    from rft.trainer.logprobs import token_logprobs

    torch.set_num_threads(os.cpu_count() or 1)
    cfg = _compose(["stages=[]", "model=qwen2.5-0.5b-shape"]).model
    ensure_model(cfg)
    model = load_model(cfg)
    prompt, vocab = 20, model.config.vocab_size
    ids = torch.randint(3, vocab, (rows, prompt + response), generator=torch.Generator().manual_seed(0))
    one = rows * response * vocab * 4  # float32 [positions, vocabulary]
    out = []
    for chunk in chunks:
        model.zero_grad(set_to_none=True)
        with live_bytes(ids, *model.parameters()) as mem:
            logp, entropy = token_logprobs(model, ids, torch.ones_like(ids), packed=True, chunk_size=chunk,
                                           first=torch.full((rows,), prompt - 1))
            forward = mem.peak
            (logp.sum() + entropy.sum()).backward()
        out.append({"positions": rows * response, "chunk": chunk or rows * response, "forward_mb": forward / 2**20,
                    "peak_mb": mem.peak / 2**20, "forward_x": forward / one, "peak_x": mem.peak / one,
                    "logits_mb": one / 2**20})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=None, help="experiences in the step (default 32; --small 8)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="a 2-layer model: seconds, for the test")
    ap.add_argument("--logprobs", action="store_true", help="the log-probs' peak allocation at the 0.5B shape")
    ap.add_argument("--response", type=int, default=128, help="--logprobs: response tokens a row")
    ap.add_argument("--arm", help=argparse.SUPPRESS)  # internal: run one arm, print its JSON
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    size = "small" if args.small else "full"
    rows = args.rows or (8 if args.small or args.logprobs else 32)
    if args.logprobs:
        print(f"{'positions':>9} {'chunk':>6} {'forward MB':>11} {'peak MB':>9} {'forward / logits':>17} "
              f"{'peak / logits':>14} {'logits MB':>10}")
        for r in logprob_peaks(rows, args.response):
            print(f"{r['positions']:9d} {r['chunk']:6d} {r['forward_mb']:11.0f} {r['peak_mb']:9.0f} {r['forward_x']:17.2f} "
                  f"{r['peak_x']:14.2f} {r['logits_mb']:10.0f}")
        return
    if args.arm:
        print(json.dumps(arm(args.arm, args.model_dir, rows, size)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / f"qwen2-{size}"
        build_model(model_dir, size)
        print(f"model: {size} Qwen2 in {model_dir}; {rows} rows, response lengths {sorted(lengths(rows, SIZES[size]['max_len']))}",
              flush=True)
        results = []
        for rep in range(args.repeats):
            for name in ARMS:
                cmd = [sys.executable, __file__, "--arm", name, "--model-dir", str(model_dir), "--rows", str(rows)]
                out = subprocess.run(cmd + (["--small"] if args.small else []), capture_output=True, text=True)
                if out.returncode:
                    sys.exit(f"arm {name} failed:\n{out.stderr[-3000:]}")
                results.append(json.loads(out.stdout.strip().splitlines()[-1]))
                r = results[-1]
                print(f"  repeat {rep + 1} {name:<14} {r['tokens_per_s']:9.0f} tok/s  peak {r['peak_mb']:8.0f} MB",
                      flush=True)
    table = summarize(results)
    print(f"\n{'arm':<14} {'tokens/s':>9} {'x padded':>9} {'peak MB':>9} {'padding':>8} {'micro-batches':>14}")
    for name, v in table.items():
        print(f"{name:<14} {v['tokens_per_s']:9.0f} {v['speedup']:9.2f} {v['peak_mb']:9.0f} {v['padding_frac']:8.2f} "
              f"{v['micro_batches']:14d}")
    saved = table["packed+budget"]["peak_mb"] - table["+chunked"]["peak_mb"]
    print(f"\nchunking saved {saved:.0f} MB of peak memory; the largest micro-batch's float32 logits: "
          f"{table['packed+budget']['logits_mb']:.0f} MB")
    print(json.dumps(table))


if __name__ == "__main__":
    main()
