"""Summarise a multirun of the embedded default: eval accuracy at the start and end of each stage.

    python run.py -m seed=1,3,5,7,11,42 cluster=inline
    python experiments/tiny_arithmetic/summarize.py checkpoints/rft/multirun/<date_time>
"""

import json
import sys
from pathlib import Path

import yaml


def main(sweep_dir: str) -> None:
    print("| seed | GRPO start | GRPO end | gain | eval steps |")
    print("|---|---|---|---|---|")
    for job in sorted(Path(sweep_dir).glob("*/grpo/metrics.jsonl"), key=lambda p: int(p.parts[-3])):
        overrides = yaml.safe_load((job.parents[1] / ".hydra" / "overrides.yaml").read_text())
        seed = next((o.split("=")[1] for o in overrides if o.startswith("seed=")), "42")
        evals = [(m["step"], m["eval/accuracy"]) for m in map(json.loads, job.read_text().splitlines())
                 if "eval/accuracy" in m]
        (_, start), (_, end) = evals[0], evals[-1]
        curve = " ".join(f"{a:.2f}" for _, a in evals)
        print(f"| {seed} | {start:.3f} | {end:.3f} | {end - start:+.3f} | {curve} |")


if __name__ == "__main__":
    main(sys.argv[1])
