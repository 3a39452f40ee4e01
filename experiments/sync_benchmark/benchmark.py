"""What a weight sync costs, measured in real runs: seconds per sync and its parts, per engine and
sync method, at the tiny and the Qwen2.5-0.5B shapes (see README.md).

    .venv/bin/python experiments/sync_benchmark/benchmark.py                   # every case, ~20 min
    .venv/bin/python experiments/sync_benchmark/benchmark.py --shapes 0.5b --engines vllm --methods memory

Each case is one synchronous run (`cluster=local synchronizer.sync_offset=0`, Ray actors on this
machine; 2 tasks x 4 rollouts x at most 16 tokens a step, eval off) of --steps steps. From its
metrics.jsonl: the medians over steps 3.. of the step, generate (inside the engine), train
(inside the trainer) and the rest (step - generate - train, and its share of the step), and of
the sync's parts as the run reports them (timing/sync_*: the trainer's weights into the
transport, its fingerprint; the explorer's engine load, its fingerprint check); the first sync's
parts (step 2: a segment to make, a group to form) apart.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHAPES = {"tiny": "tiny", "0.5b": "qwen2.5-0.5b-shape"}
PARTS = ("send", "fingerprint", "load", "check")


def overrides(shape: str, engine: str, method: str, steps: int, train_all: bool) -> list[str]:
    return [f"model={SHAPES[shape]}", f"explorer={engine}", f"sync={method}", "cluster=local",
            "synchronizer.sync_offset=0", "buffer.batch_size=2", "algorithm.repeat_times=4",
            "model.max_response_tokens=16", f"buffer.total_steps={steps}", "explorer.eval_interval=1000",
            "explorer.eval_on_startup=false", "buffer.explorer_input.eval_tasksets=[]", "stages=[]",
            "monitor=console", "trainer.save_interval=1000",
            # the 0.5B shape's rewards are 0: without this the trainer skips every row
            f"trainer.skip_zero_advantage={str(not train_all).lower()}"]


def run_case(shape: str, engine: str, method: str, steps: int, train_all: bool, root: Path) -> dict:
    name = f"{shape}-{engine}-{method}-{'train' if train_all else 'skip'}"
    cmd = [sys.executable, str(ROOT / "run.py"), *overrides(shape, engine, method, steps, train_all), f"name={name}"]
    env = {**os.environ, "RFT_CHECKPOINT_ROOT_DIR": str(root)}
    print(f"[sync_benchmark] {name}: {' '.join(cmd[2:])}", flush=True)
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    try:
        if r.returncode != 0:
            said = [line for line in r.stderr.splitlines() if line.startswith("rft:")]
            return {"case": name, "error": said[-1] if said else r.stderr[-2000:]}
        rows = [json.loads(line) for line in (root / "rft" / name / "metrics.jsonl").read_text().splitlines()]
        return summarise(name, [m for m in rows if m.get("step", 0) >= 1])
    finally:  # a 0.5B run's checkpoint is ~6 GB: one case's at a time
        shutil.rmtree(root / "rft" / name, ignore_errors=True)


def summarise(name: str, rows: list[dict]) -> dict:
    """Medians over steps 3.. (the first sync's parts from step 2, where they are reported)."""
    steady = [m for m in rows if m["step"] >= 3]

    def med(key: str) -> float:
        vals = [m[key] for m in steady if key in m]
        return statistics.median(vals) if vals else float("nan")

    rest = [m["timing/step_s"] - m.get("timing/generate_s", 0.0) - m.get("timing/train_compute_s", 0.0) for m in steady]
    share = [r / m["timing/step_s"] for r, m in zip(rest, steady)]
    out = {"case": name, "steps": len(steady), "step_s": med("timing/step_s"), "generate_s": med("timing/generate_s"),
           "train_s": med("timing/train_compute_s"), "rest_s": statistics.median(rest), "rest_share": statistics.median(share)}
    first = next((m for m in rows if f"timing/sync_{PARTS[0]}_s" in m), {})
    for part in PARTS:
        out[f"sync_{part}_s"] = med(f"timing/sync_{part}_s")
        out[f"first_sync_{part}_s"] = first.get(f"timing/sync_{part}_s", float("nan"))
    out["sync_s"] = sum(out[f"sync_{p}_s"] for p in PARTS)
    return out


def table(results: list[dict]) -> str:
    head = ("| case | step s | generate s | train s | rest s (share) | sync s | send | fingerprint | load | check "
            "| first sync s |\n|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['case']} | failed: {r['error'][-300:]} |")
            continue
        first = sum(r[f"first_sync_{p}_s"] for p in PARTS)
        lines.append(f"| {r['case']} | {r['step_s']:.2f} | {r['generate_s']:.2f} | {r['train_s']:.2f} | "
                     f"{r['rest_s']:.2f} ({r['rest_share']:.0%}) | {r['sync_s']:.3f} | "
                     + " | ".join(f"{r[f'sync_{p}_s']:.3f}" for p in PARTS) + f" | {first:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    ap.add_argument("--methods", nargs="+", default=["memory", "checkpoint", "collective"],
                    choices=["memory", "checkpoint", "collective"])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--skip-zero-advantage", action="store_true",
                    help="as the defaults do: the 0.5B shape's all-zero rewards leave the trainer nothing to train")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="rft_sync_bench_") as tmp:
        for shape in args.shapes:
            for engine in args.engines:
                if engine == "vllm" and shape == "tiny":
                    continue  # vLLM's CPU attention needs heads of 32 dimensions; the tiny model's are 16
                for method in args.methods:
                    results.append(run_case(shape, engine, method, args.steps, not args.skip_zero_advantage, Path(tmp)))
                    print(table(results[-1:]).splitlines()[-1], flush=True)
    print(table(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
