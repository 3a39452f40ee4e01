"""Where a step's time goes, and what running the explorer one step ahead buys.

    .venv/bin/python experiments/runtime_benchmark/benchmark.py [--steps 20] [--repeats 2] [extra overrides]

Runs the default GRPO stage (tiny model, Ray actors) from the default SFT warm-up's last
checkpoint (made once, first) synchronously (sync_offset=0) and asynchronously (sync_offset=1),
alternating `--repeats` times, and prints:

- per step, medians over steps 3..N (the first steps warm up): rollout wait, train, sync, the rest;
- the framework's overhead: the share of a synchronous step not spent in model compute
  (engine generate + the trainer's train_step), i.e. rewards, tokenising, Ray transfers, buffer,
  sync, logging;
- the step throughput of sync_offset=1 over sync_offset=0, as a ratio of median step times.

Timings on a shared 2-core machine are noisy: compare ratios from one invocation, not numbers
across machines.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def run(overrides: list[str], root: str) -> list[dict]:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    import rft.config  # noqa: F401
    import rft.runtime.main
    from rft.reporting.monitor import read_metrics

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, f"checkpoint_root_dir={root}"], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    rft.runtime.main.main(cfg)
    path = Path(root) / "rft" / cfg.name / "metrics.jsonl"  # a run of several stages has one per stage
    return read_metrics(path) if path.exists() else []


def med(metrics: list[dict], key: str) -> float:
    return statistics.median(m.get(key, 0.0) for m in metrics)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for both runs")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # from random weights every reward is 0 and every advantage too: nothing to train. The
        # warm start is the default SFT stage's last checkpoint, as `python run.py` trains from.
        run(["name=warm", "monitor=console", "buffer.total_steps=1", "explorer.eval_on_startup=false"], tmp)
        warm = sorted(Path(tmp, "rft", "warm", "sft_warmup", "checkpoints").glob("step_*/hf"),
                      key=lambda p: int(p.parent.name.split("_")[1]))[-1]
        results = measure(args, warm, tmp)
    report(args, results)


def measure(args, warm: Path, tmp: str) -> dict[int, list[dict]]:
    common = ["stages=[]", "monitor=console", f"model.model_path={warm}", "model.builder=null",
              f"buffer.total_steps={args.steps}",
              f"explorer.eval_interval={args.steps * 10}", "explorer.eval_on_startup=false",
              f"trainer.save_interval={args.steps * 10}", *args.overrides]
    results: dict[int, list[dict]] = {0: [], 1: []}
    for r in range(args.repeats):
        for offset in (0, 1):
            metrics = run([*common, f"synchronizer.sync_offset={offset}", f"name=bench{offset}_{r}"], tmp)
            # steps 3.. (warm-up excluded); the last step also saves a checkpoint
            results[offset] += [m for m in metrics if 3 <= m["step"] < args.steps]
    return results


def report(args, results: dict[int, list[dict]]) -> None:
    rows = []
    for offset, ms in results.items():
        parts = {k: med(ms, f"timing/{k}") for k in ("wait_rollout_s", "read_s", "train_s", "sync_s")}
        # each step's own overhead (its time minus its own generate and compute), then the median
        overhead = statistics.median(1 - (m.get("timing/generate_s", 0.0) + m.get("timing/train_compute_s", 0.0))
                                     / m["timing/step_s"] for m in ms)
        rows.append((offset, med(ms, "timing/step_s"), parts, med(ms, "timing/generate_s"),
                     med(ms, "timing/train_compute_s"), overhead))
    print(f"\nmedians over {len(results[0])} steps per mode (steps 3..{args.steps - 1}, {args.repeats} runs each)")
    print("| sync_offset | step s | rollout wait s | train s | sync s | other s | generate s | train compute s | overhead |")
    print("|---|---|---|---|---|---|---|---|---|")
    for offset, step, p, gen, train, share in rows:
        other = step - sum(p.values())
        # with the explorer ahead, generation overlaps training: no single critical path to split
        overhead = f"{share:.0%}" if offset == 0 else "overlapped"
        print(f"| {offset} | {step:.3f} | {p['wait_rollout_s']:.3f} | {p['train_s']:.3f} | {p['sync_s']:.3f} | "
              f"{other:.3f} | {gen:.3f} | {train:.3f} | {overhead} |")
    print(f"\nthroughput of sync_offset=1 vs 0 (ratio of median step times): {rows[0][1] / rows[1][1]:.2f}x")
    print("overhead: the share of a synchronous step outside model compute (engine generate + the "
          "trainer's train_step): rewards, tokenising, Ray calls and transfers, buffer, sync, logging")


if __name__ == "__main__":
    main()
