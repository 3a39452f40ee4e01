"""The greedy eval's answer lengths by kind of problem and correctness, per arm (mean ± std over seeds).

    python experiments/claims_dr_grpo/eval_lengths.py checkpoints/rft/claims_dr_grpo/multirun/<date_time>

The training metrics' `response_length/incorrect_mean` mixes long_tail's plain problems (3-character
answers) with its marked ones (63..143) in whatever share a step's 16 tasks have; the eval set is the
same 200 problems at every eval, so its wrong answers to the marked problems ("?w" in the question)
are measured on the same tasks each time. Lengths are the answer's characters (the tiny model's
tokenizer has a token per character; the end token is not counted). Reads each job's
eval_trajectories/step_<n>/*.jsonl of its last stage.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rft.reporting.report import differing_keys, group_label, groups, mean_std, read_jobs  # noqa: E402

KINDS = ("marked wrong", "marked right", "plain wrong", "plain right")


def lengths(rows: list[dict]) -> dict[str, float]:
    """The mean answer length of each kind of row present (a kind with no row is left out)."""
    by: dict[str, list[int]] = {}
    for r in rows:
        marked = "?w" in r["messages"][0]["content"]
        kind = f"{'marked' if marked else 'plain'} {'right' if r['reward'] >= 1.0 else 'wrong'}"
        by.setdefault(kind, []).append(len(r["messages"][-1]["content"]))
    return {k: statistics.fmean(v) for k, v in by.items()}


def job_lengths(job_dir: Path) -> dict[int, dict[str, float]]:
    """step -> kind -> mean length, from the job's eval trajectories."""
    out = {}
    for d in job_dir.glob("eval_trajectories/step_*"):
        rows = [json.loads(line) for f in sorted(d.glob("*.jsonl")) for line in f.read_text().splitlines() if line]
        out[int(d.name.split("_")[1])] = lengths(rows)
    return out


def table(sweep_dir: Path) -> list[str]:
    jobs = read_jobs(sweep_dir)
    keys = differing_keys(jobs)
    lines = ["| arm | step | " + " | ".join(KINDS) + " |", "|---" * (len(KINDS) + 2) + "|"]
    for js in groups(jobs):
        per_job = [job_lengths(j.path / j.stage if j.stage else j.path) for j in js]
        for step in sorted(set.intersection(*(set(p) for p in per_job))):
            cells = []
            for kind in KINDS:
                m, s = mean_std([p[step].get(kind) for p in per_job])
                cells.append("" if m is None else f"{m:.1f}" + ("" if s is None else f" ± {s:.1f}"))
            lines.append(f"| {group_label(js, keys)} | {step} | " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    print("\n".join(table(Path(sys.argv[1]))))
