"""Rollout throughput of the vllm engine vs the hf engine on this machine, as ratios.

    .venv/bin/python experiments/vllm_benchmark/benchmark.py [--repeats 3] [--prompts 64] [--n 4] [--tokens 32]

Two models built the same way as the embedded tiny one (Qwen2 architecture, the character
tokenizer): `tiny` (0.5M parameters) and `100m` (~99M: hidden 768, 14 layers, 12 heads of 64).
Each engine samples `--n` responses of at most `--tokens` tokens for `--prompts` arithmetic
prompts at temperature 1, `--repeats` times, alternating engines; the table has the median
generated tokens per second and the ratio vllm / hf.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MODELS = {
    "tiny": {},
    "100m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=14, num_attention_heads=12,
                 num_key_value_heads=12, head_dim=64),
}


def main() -> None:
    from omegaconf import OmegaConf

    from rft.config import ModelConfig, RolloutArgs, RolloutModelConfig
    from rft.rollout.engines.hf import HFEngine
    from rft.models import build_tiny_model, load_tokenizer
    from rft.data.tasks import generate_arithmetic
    from rft.rollout.engines.vllm import VLLMEngine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        import json

        data = generate_arithmetic(Path(tmp) / "data")
        questions = [json.loads(line)["question"] for line in (data / "test.jsonl").read_text().splitlines()]
        for name, arch in MODELS.items():
            path = build_tiny_model(Path(tmp) / name, arch=arch)
            mc = OmegaConf.structured(ModelConfig(model_path=str(path), dtype="float32", max_prompt_tokens=32,
                                                  max_response_tokens=args.tokens))
            rc = OmegaConf.structured(RolloutModelConfig())
            tok = load_tokenizer(mc)
            prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                               add_generation_prompt=True) for q in questions[: args.prompts]]
            prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
            engines = {"hf": HFEngine(mc, rc, tok), "vllm": VLLMEngine(mc, rc, tok)}
            sampling = OmegaConf.structured(RolloutArgs(temperature=1.0, max_tokens=args.tokens))
            rates: dict[str, list[float]] = {k: [] for k in engines}
            for r in range(args.repeats + 1):  # the first round warms up
                for label, engine in engines.items():
                    t0 = time.perf_counter()
                    out = engine.generate(prompts, args.n, sampling, seed=r)
                    elapsed = time.perf_counter() - t0
                    if r:
                        rates[label].append(sum(len(s.token_ids) for g in out for s in g) / elapsed)
            params = sum(p.numel() for p in engines["hf"].model.parameters())
            hf, vl = statistics.median(rates["hf"]), statistics.median(rates["vllm"])
            rows.append((name, params, hf, vl))
            del engines
    print(f"\n{args.prompts} prompts x {args.n} samples x <= {args.tokens} tokens, temperature 1, "
          f"median of {args.repeats}")
    print("| model | parameters | hf tokens/s | vllm tokens/s | vllm / hf |")
    print("|---|---|---|---|---|")
    for name, params, hf, vl in rows:
        print(f"| {name} | {params / 1e6:.1f}M | {hf:,.0f} | {vl:,.0f} | {vl / hf:.2f} |")


if __name__ == "__main__":  # vLLM starts its engine in a new process
    main()
