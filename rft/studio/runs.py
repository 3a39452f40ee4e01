"""The studio's runs page, without the page: every run and sweep under the checkpoint root, their
curves, and a sweep's report table. It reads what `python -m rft.reporting.report` reads (rft/reporting/report.py):
`.hydra/` and each stage's `metrics.jsonl`; nothing here writes.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from rft.reporting import report

# a run whose metrics.jsonl changed this recently, and that is not done, is shown as running
ACTIVE_S = 120
# metrics the curves offer first (where the runs logged them), then the rest in logged order
FIRST_METRICS = ("eval/accuracy", "reward/mean", "loss/policy", "actor/entropy", "actor/clip_frac",
                 "staleness/mean", "timing/step_s")


def _skip(p: Path) -> bool:
    return p.name.startswith((".", "previous_")) or p.name in ("stage_cache", "checkpoints", "eval_trajectories")


def find(root: Path) -> tuple[list[Path], list[Path]]:
    """(run directories, sweep directories) under root, at most five levels down. A run is a
    directory with `.hydra/` (a sweep's jobs included); a sweep is a directory inside one named
    `multirun` (`<root>/<project>/multirun/<date_time>`, or a study's `<name>/multirun/...`)."""
    runs, sweeps = [], []

    def walk(d: Path, depth: int):
        for p in sorted(x for x in d.iterdir() if x.is_dir() and not _skip(x)):
            if (p / ".hydra").is_dir():
                runs.append(p)
            elif d.name == "multirun":
                sweeps.append(p)
            if depth < 5 and not (p / ".hydra").is_dir():  # a run's own directories hold no runs
                walk(p, depth + 1)

    if Path(root).is_dir():
        walk(Path(root), 1)
    return runs, sweeps


def _num(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def summary(root: Path, run: Path) -> dict:
    """One run's row: where, stage, status, steps, last eval accuracy, time."""
    job = report.read_job(run, None, run.relative_to(root).as_posix())
    last_eval = next((m["eval/accuracy"] for m in reversed(job.metrics) if _num(m.get("eval/accuracy")) is not None), None)
    logged = report.logged_stages(run)
    newest = max((p.stat().st_mtime for p in logged.values()), default=0)
    status = job.status
    if status != "done" and newest and time.time() - newest < ACTIVE_S:
        status = "running"
    return {"id": job.num, "stage": job.stage, "status": status, "steps": job.metrics[-1]["step"] if job.metrics else 0,
            "last_eval": last_eval, "time_s": job.time_s, "updated": newest}


def listing(root: Path) -> dict:
    """{"runs": [summary, ...], "sweeps": [{"id", "jobs"}, ...]}, newest first."""
    root = Path(root)
    runs, sweeps = find(root)
    rows = sorted((summary(root, r) for r in runs), key=lambda r: -r["updated"])
    return {"runs": rows,
            "sweeps": [{"id": s.relative_to(root).as_posix(), "jobs": len(report.find_jobs(s))}
                       for s in sorted(sweeps, key=lambda s: -s.stat().st_mtime)]}


def inside(root: Path, rel: str) -> Path:
    """root/rel, refusing a path that leaves root (the page names runs by their path under it)."""
    root = Path(root).resolve()
    path = (root / rel).resolve()
    if path != root and root not in path.parents:
        raise ValueError(f"{rel!r} is not under the checkpoint root")
    return path


def metric_names(root: Path, ids: list[str]) -> list[str]:
    jobs = [report.read_job(inside(root, i), None, i) for i in ids]
    found = report.metrics_found(jobs)
    return [m for m in FIRST_METRICS if m in found] + [m for m in found if m not in FIRST_METRICS]


def stages(root: Path, ids: list[str]) -> list[str]:
    """The stages the runs logged, in order (a run without stages logs in its own directory: none)."""
    return list(dict.fromkeys(s for i in ids for s in report.job_stages(inside(root, i))
                              if s and s in report.logged_stages(inside(root, i))))


def curves(root: Path, ids: list[str], metric: str, stage: str = "") -> list[dict]:
    """Each run's `metric` over steps, {"name", "run", "stage", "x", "y"}: one trace per run from
    its last logged stage (stage ""), from the stage named, or one per logged stage ("all")."""
    out = []
    for i in ids:
        run = inside(root, i)
        logged = report.logged_stages(run)
        if stage == "all":
            wanted = [s for s in report.job_stages(run) if s in logged] or [None]
        else:
            wanted = [stage or None]
        for s in wanted:
            if s is not None and s not in logged:
                continue  # this run has no such stage
            job = report.read_job(run, s, i)
            points = [(m["step"], _num(m.get(metric))) for m in job.metrics if _num(m.get(metric)) is not None]
            out.append({"name": f"{i} ({job.stage})" if job.stage else i, "run": i, "stage": job.stage,
                        "x": [p[0] for p in points], "y": [p[1] for p in points]})
    return out


def sweep_table(root: Path, sweep: str) -> dict:
    """A sweep's report (rft.reporting.report): one row per job, then one per configuration with
    (mean, std) over its seeds. {"jobs": [...], "configs": [...], "columns": [...]}"""
    jobs = report.read_jobs(inside(root, sweep))
    keys = report.differing_keys(jobs)
    metrics = report.choose_metrics(jobs, None)
    table = report.rows(jobs, keys, metrics)
    configs = report.group_rows(report.groups(jobs), keys, table) if any(j.metrics for j in jobs) else []

    def cell(v):
        if isinstance(v, tuple):
            mean, std = v
            return None if mean is None else f"{mean:.4g}" + (f" ± {std:.2g}" if std is not None else "")
        return f"{v:.4g}" if isinstance(v, float) else v

    return {"jobs": [{k: cell(v) for k, v in r.items()} for r in table],
            "configs": [{k: cell(v) for k, v in r.items()} for r in configs]}
