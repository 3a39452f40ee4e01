"""The reasoning_gym study's table: the GRPO stage's held-out eval by step, per seed and their mean.

    python run.py -m experiment=reasoning_gym
    python experiments/reasoning_gym/summarize.py checkpoints/rft/reasoning_gym/multirun/<date_time>

Two numbers a cell: the mean reward (eval/accuracy: spell_backward's scorer gives 1/length for each
letter in its place) / the share reversed exactly (eval/reasoning_gym_test/pass@1).
"""

import json
import sys
from pathlib import Path

import yaml

EXACT = "eval/reasoning_gym_test/pass@1"


def evals(metrics: Path) -> dict[int, tuple[float, float]]:
    rows = map(json.loads, metrics.read_text().splitlines())
    return {m["step"]: (m["eval/accuracy"], m[EXACT]) for m in rows if "eval/accuracy" in m}


def main(sweep_dir: str) -> None:
    runs = {}
    for job in sorted(Path(sweep_dir).glob("*/grpo/metrics.jsonl"), key=lambda p: int(p.parts[-3])):
        overrides = yaml.safe_load((job.parents[1] / ".hydra" / "overrides.yaml").read_text())
        runs[next(o.split("=")[1] for o in overrides if o.startswith("seed="))] = evals(job)
    print("| GRPO step | " + " | ".join(f"seed {s}" for s in runs) + " | mean |")
    print("|---" * (len(runs) + 2) + "|")
    for step in sorted(set.intersection(*(set(r) for r in runs.values()))):
        cells = [r[step] for r in runs.values()]
        mean = tuple(sum(c[i] for c in cells) / len(cells) for i in (0, 1))
        print(f"| {step} | " + " | ".join(f"{a:.3f} / {e:.3f}" for a, e in [*cells, mean]) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
