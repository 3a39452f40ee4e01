"""Which swept key moves eval accuracy more: per key, the median over every other key and seed.

    python experiments/lr_vs_group/medians.py <sweep dir> [--seeds 1,3]

For each eval step and each swept key (the overrides that differ between jobs, as the report
finds them), the median eval accuracy of each value, pooled over the other keys and the seeds, and
the range of those medians: the larger the range, the more the key matters. Medians, not the
report's means: a seed whose warm-up did not learn is an outlier of 0.3 among 0.9s.
"""

import argparse
import statistics
from pathlib import Path

from rft.reporting import report

EVAL = "eval/arithmetic_test/accuracy"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument("--seeds", default=None, help="comma-separated seeds to keep (default: all)")
    args = parser.parse_args()
    jobs = [j for j in report.read_jobs(args.sweep_dir) if j.metrics]
    if args.seeds:
        jobs = [j for j in jobs if j.overrides.get("seed") in args.seeds.split(",")]
    keys = report.differing_keys(jobs)
    steps = sorted({s for j in jobs for s in j.series(EVAL)[0]})
    print(f"{len(jobs)} jobs; median {EVAL} per value (pooled over the other keys and the seeds)")
    for step in steps:
        for key in keys:
            values = sorted({j.overrides[key] for j in jobs}, key=float)
            medians = {}
            for v in values:
                at = [dict(zip(*j.series(EVAL))).get(step) for j in jobs if j.overrides[key] == v]
                medians[v] = statistics.median(a for a in at if a is not None)
            spread = max(medians.values()) - min(medians.values())
            cells = "  ".join(f"{v}: {m:.3f}" for v, m in medians.items())
            print(f"step {step:>3}  {key:<24} {cells}   range {spread:.3f}")


if __name__ == "__main__":
    main()
