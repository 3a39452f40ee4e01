"""Synchronous against asynchronous RL on long-tailed response lengths (task=long_tail, model=tiny).

    .venv/bin/python experiments/async_long_tail/benchmark.py [--seeds 1 2 3] [--steps 30] [--arms A B C D]

1. Makes the warm start once: the default SFT warm-up stage (conf/model/tiny.yaml) on task=long_tail
   with model.max_response_tokens=160 (~85% of answers 4 tokens, ~15% 45-160: rft/data/tasks.py).
2. Runs the arms interleaved, seed by seed (A B C D A B C D ...), each a fresh `python run.py` with
   cluster=local (Ray: an explorer and a trainer actor, 1 CPU each), from the warm start:
     A  fixed, synchronizer.sync_offset=0   (on-policy: the actors take turns, each with both cores)
     B  fixed, synchronizer.sync_offset=1   (the explorer one step ahead)
     C  synchronizer.sync_style=dynamic_by_explorer
     D  dynamic_by_explorer + explorer.partial_rollout=true
   Each evaluates every --eval-interval steps (greedy, the 200 held-out problems); eval and
   checkpoint time are outside the step times.
3. Prints, per arm, over seeds: trained experiences per second (experiences in batches.jsonl over
   the sum of timing/step_s), its ratio to A and to B (medians over seeds, and each seed's ratio
   from the same interleaved round), the same ratio for trained response tokens per second, the eval curve against experiences consumed (mean, min..max
   over seeds), the loop time to the first eval >= --target, and the age of the trained tokens
   (staleness/token_frac_*, averaged over steps); writes results.json and curves.png to --out.

Timings on a shared machine are noisy: compare the ratios of one invocation.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TASK = ["task=long_tail", "model.max_response_tokens=160"]
ARMS = {
    "A": ("fixed, sync_offset=0", ["synchronizer.sync_offset=0"]),
    "B": ("fixed, sync_offset=1", ["synchronizer.sync_offset=1"]),
    "C": ("dynamic_by_explorer", ["synchronizer.sync_style=dynamic_by_explorer"]),
    "D": ("dynamic_by_explorer + partial rollouts", ["synchronizer.sync_style=dynamic_by_explorer",
                                                     "explorer.partial_rollout=true"]),
}


def run(cmd: list[str], log: Path) -> None:
    with open(log, "w") as f:
        r = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{log.read_text()[-3000:]}")


def warm_start(out: Path) -> Path:
    root = out / "warm"
    hf = root / "rft" / "warm" / "sft_warmup" / "checkpoints" / "step_400" / "hf"
    if not hf.exists():
        print("warm start: the SFT warm-up stage on task=long_tail (about a minute)", flush=True)
        run([sys.executable, "run.py", "name=warm", f"checkpoint_root_dir={root}", "monitor=console", *TASK,
             "cluster=inline", "buffer.total_steps=1", "explorer.eval_on_startup=false"], out / "warm.log")
    return hf


def arm_run(arm: str, seed: int, args, warm: Path, out: Path) -> dict:
    name = f"{arm}-{seed}"
    d = out / "runs" / "rft" / name
    shutil.rmtree(d, ignore_errors=True)  # a run of an earlier invocation: this one starts afresh
    run([sys.executable, "run.py", "stages=[]", f"model.model_path={warm}", "model.builder=null", *TASK,
         "cluster=local", "monitor=console", f"name={name}", f"checkpoint_root_dir={out / 'runs'}", f"seed={seed}",
         f"buffer.total_steps={args.steps}", f"explorer.eval_interval={args.eval_interval}",
         "trainer.save_interval=100000", *ARMS[arm][1]], out / f"{name}.log")
    metrics = [json.loads(line) for line in open(d / "metrics.jsonl")]
    batches = [json.loads(line) for line in open(d / "batches.jsonl")]
    steps = [m for m in metrics if "timing/step_s" in m]
    per_step = {b["step"]: len(b["versions"]) for b in batches}
    consumed, loop_s, curve, t_target = 0, 0.0, [], None
    for m in metrics:
        loop_s += m.get("timing/step_s", 0.0)
        consumed += per_step.get(m["step"], 0)
        if "eval/accuracy" in m:
            curve.append((consumed, m["eval/accuracy"]))
            if t_target is None and m["eval/accuracy"] >= args.target:
                t_target = loop_s
    # trained response tokens: a step's experiences times their mean length (partial rollouts end
    # a run with long groups still in flight, so experiences alone would flatter them)
    tokens = sum(m["response_length/mean"] * per_step.get(m["step"], 0) for m in steps)
    ages: dict[str, float] = {}
    for m in steps:
        for k, v in m.items():
            if k.startswith("staleness/token_frac_"):
                ages[k.rsplit("_", 1)[1]] = ages.get(k.rsplit("_", 1)[1], 0.0) + v / len(steps)
    return {"arm": arm, "seed": seed, "experiences": sum(per_step.values()), "loop_s": loop_s,
            "exps_per_s": sum(per_step.values()) / loop_s, "tokens_per_s": tokens / loop_s, "curve": curve, "time_to_target_s": t_target,
            "token_ages": ages, "dropped": sum(m.get("staleness/dropped", 0) for m in steps)}


def spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} ({min(values):.3f}..{max(values):.3f})"


def report(runs: list[dict], args) -> str:
    by = {a: [r for r in runs if r["arm"] == a] for a in args.arms}
    seed_of = {(r["arm"], r["seed"]): r for r in runs}
    lines = ["| arm | experiences/s (median) | vs A | vs B | trained tokens/s vs A | final eval, mean (min..max) | "
             f"loop s to eval >= {args.target:g} | token ages 0/1/2/3+ |", "|---|---|---|---|---|---|---|---|"]
    for a, rs in by.items():
        med = statistics.median(r["exps_per_s"] for r in rs)

        def ratio(base: str, key: str = "exps_per_s") -> str:
            if base not in by:
                return "-"
            each = [seed_of[(a, s)][key] / seed_of[(base, s)][key] for s in args.seeds]
            return f"{statistics.median(each):.2f}x ({', '.join(f'{x:.2f}' for x in each)})"

        finals = [r["curve"][-1][1] for r in rs if r["curve"]]
        reach = [r["time_to_target_s"] for r in rs]
        reached = f"{statistics.median([t for t in reach if t is not None]):.1f} ({sum(t is not None for t in reach)}/{len(rs)} seeds)" \
            if any(t is not None for t in reach) else f"not reached (0/{len(rs)})"
        ages = [statistics.mean(r["token_ages"].get(str(k), 0.0) for r in rs) for k in range(3)]
        ages.append(1 - sum(ages))
        lines.append(f"| {a}: {ARMS[a][0]} | {med:.0f} | {ratio('A')} | {ratio('B')} | {ratio('A', 'tokens_per_s')} | "
                     f"{spread(finals)} | {reached} | "
                     + "/".join(f"{x:.2f}" for x in ages) + " |")
    lines.append("")
    lines.append("eval against experiences consumed (mean over seeds):")
    for a, rs in by.items():
        points = zip(*[r["curve"] for r in rs])
        lines.append(f"  {a}: " + "  ".join(f"{p[0][0]}: {statistics.mean(x[1] for x in p):.3f}" for p in points))
    return "\n".join(lines)


def plot(runs: list[dict], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for a in args.arms:
        rs = [r for r in runs if r["arm"] == a]
        xs = [p[0] for p in rs[0]["curve"]]
        ys = [statistics.mean(r["curve"][i][1] for r in rs) for i in range(len(xs))]
        left.plot(xs, ys, marker="o", label=f"{a}: {ARMS[a][0]}")
        ages = [statistics.mean(r["token_ages"].get(str(k), 0.0) for r in rs) for k in range(6)]
        right.bar([k + 0.2 * "ABCD".index(a) for k in range(6)], ages, width=0.2, label=a)
    left.set_xlabel("experiences consumed")
    left.set_ylabel("eval accuracy (greedy, 200 held-out)")
    left.legend(fontsize=8)
    right.set_xlabel("token age (versions between sampling and training)")
    right.set_ylabel("fraction of trained tokens")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--eval-interval", type=int, default=10)
    p.add_argument("--target", type=float, default=0.5)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="async_long_tail_"))
    out.mkdir(parents=True, exist_ok=True)
    warm = warm_start(out)
    runs = []
    for seed in args.seeds:
        for arm in args.arms:
            r = arm_run(arm, seed, args, warm, out)
            print(f"{arm} seed {seed}: {r['exps_per_s']:.0f} experiences/s, eval {[round(c[1], 3) for c in r['curve']]}",
                  flush=True)
            runs.append(r)
    (out / "results.json").write_text(json.dumps(runs, indent=1))
    plot(runs, args, out / "curves.png")
    print(report(runs, args))
    print(f"results: {out / 'results.json'}, plot: {out / 'curves.png'}")


if __name__ == "__main__":
    main()
