"""A sweep's results on one page: `python -m rft.report <multirun dir>`.

    python run.py -m algorithm=grpo,dr_grpo seed=1,2
    python -m rft.report checkpoints/rft/multirun/<date_time>

Reads every job directory of a Hydra multirun (`0/`, `1/`, ...: `.hydra/overrides.yaml`,
`.hydra/config.yaml`, and `metrics.jsonl`, directly or under one directory per stage) and writes
into the multirun directory:

    report.md     one row per job: the overrides that differ between jobs, the stage reported,
                  status, steps, final reward/mean, final and best eval/accuracy, time
    report.csv    the same rows
    rewards.png   reward/mean over steps, one curve per job (and eval/accuracy beside it)

With stages, the last stage that logged metrics is reported (the `stage` column names it).
`time_s` is the seconds the job's metrics account for (steps, evals and saves of every stage; not
process start or model loading). A job without metrics is a row that says so. A single run's
directory (one with `.hydra/` in it) works too, as a sweep of one job.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from omegaconf import OmegaConf


TIMING_KEYS = ("timing/step_s", "timing/eval_s", "timing/save_s")


@dataclass
class Job:
    num: str
    path: Path
    overrides: dict[str, str] = field(default_factory=dict)
    stage: str = ""  # "" when metrics.jsonl sits in the job directory itself
    status: str = "no metrics"
    metrics: list[dict] = field(default_factory=list)
    time_s: float | None = None

    def series(self, key: str) -> tuple[list[int], list[float]]:
        points = [(m["step"], m[key]) for m in self.metrics if key in m]
        return [s for s, _ in points], [v for _, v in points]

    def last(self, key: str) -> float | None:
        values = self.series(key)[1]
        return values[-1] if values else None

    def best(self, key: str) -> tuple[float | None, int | None]:
        steps, values = self.series(key)
        if not values:
            return None, None
        i = max(range(len(values)), key=values.__getitem__)  # the first step that reached the best
        return values[i], steps[i]


def find_jobs(sweep_dir: Path) -> list[Path]:
    if (sweep_dir / ".hydra").is_dir():  # a single run
        return [sweep_dir]
    # Hydra names job directories by job number (hydra.sweep.subdir); a job that never started
    # may have none, one that started has .hydra/
    jobs = [p for p in sweep_dir.iterdir() if p.is_dir() and (p.name.isdigit() or (p / ".hydra").is_dir())]
    numbered = sorted((p for p in jobs if p.name.isdigit()), key=lambda p: int(p.name))
    return numbered + sorted(p for p in jobs if not p.name.isdigit())


def parse_overrides(job_dir: Path) -> dict[str, str]:
    path = job_dir / ".hydra" / "overrides.yaml"
    if not path.exists():
        return {}
    out = {}
    for item in yaml.safe_load(path.read_text()) or []:
        key, _, value = str(item).partition("=")
        out[key] = value
    return out


def planned_stages(job_dir: Path) -> list[tuple[str, int | None]]:
    """(stage name, buffer.total_steps or None) per configured stage, in order; [] without stages.

    Values are read lazily, so interpolations the report cannot resolve (`${hydra:...}` in `name`)
    do no harm; a stage whose name cannot be read is left out."""
    path = job_dir / ".hydra" / "config.yaml"
    if not path.exists():
        return []
    out = []
    try:
        cfg = OmegaConf.load(path)
        base = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "stages"])
        for stage in cfg.get("stages") or []:
            merged = OmegaConf.merge(base, stage)
            name = OmegaConf.select(merged, "stage_name", throw_on_resolution_failure=False)
            total = OmegaConf.select(merged, "buffer.total_steps", throw_on_resolution_failure=False)
            if name is not None:
                out.append((str(name), total if isinstance(total, int) else None))
    except Exception:  # a config this code cannot read: report without the plan, by file times
        return []
    return out


def read_jsonl(path: Path) -> list[dict]:
    """metrics.jsonl, leaving out a line a killed job cut short."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return [m for m in out if isinstance(m, dict) and "step" in m]


def read_job(job_dir: Path) -> Job:
    job = Job(job_dir.name, job_dir, parse_overrides(job_dir))
    logged = {p.parent.name: p for p in job_dir.glob("*/metrics.jsonl") if not p.parent.name.startswith("previous_")}
    if (job_dir / "metrics.jsonl").exists():
        logged[""] = job_dir / "metrics.jsonl"
    if not logged:
        job.status = "no metrics (failed before its first step, or not started)"
        return job
    plan = planned_stages(job_dir)
    order = [name for name, _ in plan]
    # the last configured stage that logged anything; unknown stage names sort by time of writing
    job.stage = max(logged, key=lambda s: (s in order, order.index(s) if s in order else 0, logged[s].stat().st_mtime))
    job.metrics = read_jsonl(logged[job.stage])
    every = [m for p in logged.values() for m in read_jsonl(p)]
    job.time_s = sum(m.get(k, 0.0) for m in every for k in TIMING_KEYS) or None
    steps = job.metrics[-1]["step"] if job.metrics else 0
    total = dict(plan).get(job.stage)
    if plan and job.stage != order[-1]:
        job.status = f"stopped before stage {order[-1]}"
    elif total is not None and steps < total:
        job.status = f"incomplete ({steps}/{total} steps)"
    elif total is None and not (logged[job.stage].parent / "checkpoints" / f"step_{steps}").exists():
        # without a planned step count, the final checkpoint (saved after the last step) tells
        job.status = "incomplete (no final checkpoint)"
    else:
        job.status = "done"
    return job


def differing_keys(jobs: list[Job]) -> list[str]:
    """Override keys whose value is not the same in every job (all keys for a sweep of one)."""
    keys = list(dict.fromkeys(k for j in jobs for k in j.overrides))
    if len(jobs) < 2:
        return keys
    return [k for k in keys if len({j.overrides.get(k) for j in jobs}) > 1]


def label(job: Job, keys: list[str]) -> str:
    parts = [f"{k}={job.overrides[k]}" for k in keys if k in job.overrides]
    return " ".join(parts) or f"job {job.num}"


COLUMNS = ["stage", "status", "steps", "final reward/mean", "final eval/accuracy",
           "best eval/accuracy", "best at step", "time_s"]


def rows(jobs: list[Job], keys: list[str]) -> list[dict]:
    out = []
    for j in jobs:
        best, best_step = j.best("eval/accuracy")
        row = {"job": j.num, **{k: j.overrides.get(k, "") for k in keys},
               "stage": j.stage, "status": j.status,
               "steps": j.metrics[-1]["step"] if j.metrics else None,
               "final reward/mean": j.last("reward/mean"),
               "final eval/accuracy": j.last("eval/accuracy"),
               "best eval/accuracy": best, "best at step": best_step,
               "time_s": j.time_s}
        out.append(row)
    return out


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 100 else f"{v:.3f}"
    return str(v).replace("|", "\\|")


def write_markdown(path: Path, sweep_dir: Path, jobs: list[Job], keys: list[str], table: list[dict]) -> None:
    common = [f"{k}={v}" for k, v in jobs[0].overrides.items() if k not in keys] if jobs else []
    header = ["job", *keys, *COLUMNS]
    lines = [f"# Sweep report: {sweep_dir.name}", ""]
    if common:
        lines += ["Common to all jobs: `" + " ".join(common) + "`", ""]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(r[h]) for h in header) + " |" for r in table]
    lines += ["", "![reward/mean per job](rewards.png)", "",
              "`time_s`: seconds in steps, evals and saves, all stages (not start-up or model loading).", ""]
    path.write_text("\n".join(lines))


def write_csv(path: Path, keys: list[str], table: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["job", *keys, *COLUMNS])
        w.writeheader()
        w.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in table)


def plot(jobs: list[Job], keys: list[str], title: str):
    """The figure: reward/mean per job over steps, and eval/accuracy beside it when logged.
    Returns it (matplotlib's Figure; one line per job with that metric on each panel)."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed

    with_eval = any(j.series("eval/accuracy")[0] for j in jobs)
    fig = Figure(figsize=(12 if with_eval else 7, 4.5), layout="constrained")
    axes = fig.subplots(1, 2 if with_eval else 1, squeeze=False)[0]
    panels = [("reward/mean", axes[0])] + ([("eval/accuracy", axes[1])] if with_eval else [])
    for key, ax in panels:
        for j in jobs:
            steps, values = j.series(key)
            if steps:
                ax.plot(steps, values, marker="o" if len(steps) < 15 else None, markersize=3, label=label(j, keys))
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.set_title(key)
        ax.grid(alpha=0.3)
    if axes[0].lines:
        axes[0].legend(fontsize="small")
    fig.suptitle(title)
    return fig


def report(sweep_dir: Path) -> dict[str, Path]:
    """Write report.md, report.csv and rewards.png into sweep_dir; returns their paths."""
    jobs = [read_job(p) for p in find_jobs(sweep_dir)]
    if not jobs:
        raise FileNotFoundError(
            f"{sweep_dir} holds no job directories (0/, 1/, ... with .hydra/ inside). Give the "
            f"directory a `python run.py -m ...` sweep printed, e.g. checkpoints/rft/multirun/<date_time>."
        )
    keys = differing_keys(jobs)
    table = rows(jobs, keys)
    out = {"md": sweep_dir / "report.md", "csv": sweep_dir / "report.csv"}
    write_markdown(out["md"], sweep_dir, jobs, keys, table)
    write_csv(out["csv"], keys, table)
    stages = sorted({j.stage for j in jobs if j.stage})
    title = f"{sweep_dir.name}" + (f" (stage {', '.join(stages)})" if stages else "")
    try:
        fig = plot(jobs, keys, title)
    except ImportError:
        print("rft.report: matplotlib is not installed, so no rewards.png (pip install matplotlib).", file=sys.stderr)
    else:
        out["png"] = sweep_dir / "rewards.png"
        fig.savefig(out["png"], dpi=100)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rft.report", description=__doc__.split("\n")[0])
    parser.add_argument("sweep_dir", type=Path, help="a multirun directory, e.g. checkpoints/rft/multirun/<date_time>")
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        print(f"rft.report: {args.sweep_dir} is not a directory. Give the multirun directory that "
              f"`python run.py -m ...` printed (e.g. checkpoints/rft/multirun/<date_time>).", file=sys.stderr)
        return 2
    try:
        out = report(args.sweep_dir)
    except FileNotFoundError as e:
        print(f"rft.report: {e}", file=sys.stderr)
        return 2
    print("wrote " + ", ".join(str(p) for p in out.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
