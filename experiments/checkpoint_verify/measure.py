"""What checking a checkpoint against its manifest costs, next to loading it.

    .venv/bin/python experiments/checkpoint_verify/measure.py [--dir /tmp/ckpt_1gb] [--repeats 3]

Writes a checkpoint of a Qwen2.5-0.5B-shaped model (random weights, bf16: ~1 GB in hf/) with
checkpoint.write, then times, from the page cache (warm) and with its files evicted from it (cold:
posix_fadvise DONTNEED): manifest.verify of the whole checkpoint; safetensors' load_file of the
weights (memory-mapped: it reads nothing yet); what resume does (rft.models.load_hf_weights: the
weights copied into a model built beforehand); from_pretrained (what an explorer or the next stage
does); and, cold, verify followed by resume's load, which then reads from the cache verify filled.
Medians of --repeats runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rft import manifest

from rft.runtime import checkpoint
from rft.models import load_hf_weights


def evict(d: Path) -> None:
    """Drop the folder's files from the page cache, so that the next read comes from the disk."""
    for f in d.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed(fn, d: Path, repeats: int, cold: bool) -> float:
    times = []
    for _ in range(repeats):
        if cold:
            evict(d)
        else:
            fn()  # warm the cache
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def build() -> Qwen2ForCausalLM:
    cfg = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                      num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, torch_dtype="bfloat16")
    torch.set_default_dtype(torch.bfloat16)
    model = Qwen2ForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    return model


def make(stage: Path, model) -> Path:
    t0 = time.perf_counter()
    final = checkpoint.write(stage, 1, {}, lambda tmp: model.save_pretrained(tmp / "hf") or {},
                             owner=checkpoint.Owner("rft/measure", "grpo", "0" * 16, "qwen2.5-0.5b-shape"))
    print(f"checkpoint.write (save_pretrained + seal): {time.perf_counter() - t0:.2f} s")
    return final


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/ckpt_1gb")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    stage = Path(args.dir)
    d = stage / "checkpoints" / "step_1"
    model = build()
    if not (d / manifest.MANIFEST).exists():
        d = make(stage, model)
    size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
    t0 = time.perf_counter()
    manifest.seal(d, manifest.read(d)[0]["identity"])
    print(f"seal (hash every file, page cache): {time.perf_counter() - t0:.3f} s")
    jobs = {"verify": lambda: manifest.verify(d),
            "load_file": lambda: load_file(d / "hf" / "model.safetensors"),
            "resume": lambda: load_hf_weights(model, d / "hf"),
            "from_pretrained": lambda: AutoModelForCausalLM.from_pretrained(d / "hf", dtype=torch.bfloat16),
            "verify+resume": lambda: (manifest.verify(d), load_hf_weights(model, d / "hf"))}
    print(f"checkpoint {d}: {size / 1e9:.3f} GB")
    print("| cache | verify s | load_file s | resume's load s | from_pretrained s | verify, then resume's load s |")
    print("|---|---|---|---|---|---|")
    for cold in (False, True):
        t = {name: timed(fn, d, args.repeats, cold) for name, fn in jobs.items()}
        print(f"| {'cold' if cold else 'warm'} | " + " | ".join(f"{t[k]:.3f}" for k in jobs) + " |")
        print(f"  verify / resume's load: {t['verify'] / t['resume']:.2f}; verify / from_pretrained: "
              f"{t['verify'] / t['from_pretrained']:.2f}; verify+resume / resume: {t['verify+resume'] / t['resume']:.2f}")


if __name__ == "__main__":
    main()
