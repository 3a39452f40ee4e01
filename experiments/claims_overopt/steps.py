"""Claim 4's table: per arm, mean ± std over seeds of the gold eval at chosen steps, of the proxy
(the reward model's score) and the KL to the starting policy over windows of steps, and each
seed's peak and final gold eval.

    python experiments/claims_overopt/steps.py checkpoints/rft/claims_overopt/multirun/<date_time>

The report (`python -m rft.reporting.report`) gives each job's final and best values and the
curves; this gives the rise and fall in numbers. A step's `reward/mean` swings by 1-2 from step
to step (16 tasks), so the proxy and the KL are window means: each column's the mean over the steps
after the column before it up to its own (steps 6-10 for column 10); column 0 is step 1's
rollouts, those of the starting policy.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rft.reporting.report import differing_keys, group_label, groups, mean_std, read_jobs  # noqa: E402

STEPS = (0, 3, 5, 10, 20, 30)  # 3: about where the gold eval peaks
WINDOWS = [(1, 1)] + [(a + 1, b) for a, b in zip(STEPS, STEPS[1:])]


def window_mean(job, key: str, first: int, last: int) -> float | None:
    values = [v for s, v in zip(*job.series(key)) if first <= s <= last]
    return statistics.fmean(values) if values else None


def cell(values: list) -> str:
    mean, std = mean_std(values)
    return "-" if mean is None else f"{mean:.3f} ± {std or 0:.3f}"


def main(sweep_dir: str) -> None:
    jobs = read_jobs(Path(sweep_dir), "grpo")
    keys = differing_keys(jobs)
    print("| arm | metric | " + " | ".join(f"step {s}" for s in STEPS) + " |")
    print("|---|---|" + "---|" * len(STEPS))
    for js in groups(jobs):
        arm = group_label(js, keys)
        gold = [dict(zip(*j.series("eval/accuracy"))) for j in js]
        print(f"| {arm} | gold (eval/accuracy) | " + " | ".join(cell([g.get(s) for g in gold]) for s in STEPS) + " |")
        for key, name in (("reward/mean", "proxy (reward/mean)"), ("actor/kl", "KL (actor/kl)")):
            print(f"| {arm} | {name} | " + " | ".join(cell([window_mean(j, key, a, b) for j in js]) for a, b in WINDOWS) + " |")
    print("\n| arm | seed | peak gold (step) | final gold |\n|---|---|---|---|")
    for j in jobs:
        best, step = j.best("eval/accuracy")
        print(f"| {j.overrides.get('+stages.2.algorithm')} | {j.overrides.get('seed')} | {best:.3f} ({step}) | "
              f"{j.last('eval/accuracy'):.3f} |")


if __name__ == "__main__":
    main(sys.argv[1])
