"""The studio's dashboard, without the page: every metric of the runs asked for, each run's
stages one after another (a stage's steps after the steps of the stages before it, as the runs
page's "every stage"), with the seconds its steps, evals and saves took so far (the clock the
sweep report's `time_s` reads: the metrics hold no wall-clock times) and the experiences its
trainer consumed so far (`train/experiences` summed), and per configuration
(the runs whose overrides differ only in the seed) the mean ± std over its runs at the steps all
of them logged: rft.reporting.report.mean_curve, what the sweep report's plot draws.
"""

from __future__ import annotations

import math
from pathlib import Path

from rft.reporting import report
from rft.studio.runs import _num, inside, short_names

# the panels' order on the page: these prefixes first, then the others by name
FIRST_PREFIXES = ("reward", "eval", "loss", "actor", "advantage", "rollout", "response_length", "staleness", "timing")


def _run(runs, rel: str) -> tuple[report.Job, dict]:
    """(a Job whose metrics are the run's stages one after another, each row with its offset
    "step", "_time" and "_exps"; {"id", "stages": [{"stage", "step", "time", "experiences"}: where
    each starts]})."""
    run = inside(runs.root, rel)
    logged = report.logged_stages(run)
    wanted = [s for s in report.job_stages(run, runs.full) if s in logged] or [None]
    rows, stages, step0, clock, seen = [], [], 0, 0.0, 0
    job = None
    for s in wanted:
        job = report.read_job(run, s, rel, runs.full)
        stages.append({"stage": job.stage, "step": step0, "time": clock if math.isfinite(clock) else None,
                       "experiences": seen})
        for m in job.metrics:
            clock += sum(_num(m.get(k)) or 0.0 for k in report.TIMING_KEYS)
            seen += _num(m.get("train/experiences")) or 0
            rows.append({**{k: v for k, v in m.items() if _num(v) is not None}, "step": m["step"] + step0,
                         "_time": clock if math.isfinite(clock) else None,  # times that overflow: not JSON
                         "_exps": seen})
        step0 += job.metrics[-1]["step"] if job.metrics else 0
    merged = report.Job(num=rel, path=Path(run), overrides=job.overrides, config=job.config, metrics=rows)
    return merged, {"id": rel, "stages": stages}


def _columns(rows: list[dict], keys: list[str]) -> dict:
    return {k: [r.get(k) for r in rows] for k in keys}


def _bands(jobs: list[report.Job], keys: list[str]) -> dict:
    """{metric: {"step", "time", "experiences", "mean", "std"}} over the jobs (two or more) at the
    steps all of them logged; "time" and "experiences": the jobs' means at those steps."""
    def mean_at(key):
        curve = report.mean_curve(jobs, key)
        return dict(zip(curve[0], curve[1])) if curve else {}

    at, seen = mean_at("_time"), mean_at("_exps")
    out = {}
    for k in keys:
        curve = report.mean_curve(jobs, k)
        if curve and curve[3] > 1:  # a metric only one of them logged has no spread to show
            steps, mean, std, _ = curve
            out[k] = {"step": steps, "time": [at.get(s) for s in steps], "experiences": [seen.get(s) for s in steps],
                      "mean": mean, "std": std}
    return out


def dashboard(runs, ids: list[str]) -> dict:
    """{"runs": [{"id", "name", "config", "stages", "step", "time", "experiences", "metrics": {key: values}}],
    "prefixes": [the panels' groups in order], "configs": [{"config", "runs", "bands"}] for the
    configurations two or more of the runs share}."""
    short = short_names(ids)
    jobs, out = [], []
    for rel in ids:
        job, info = _run(runs, rel)
        jobs.append(job)
        keys = sorted({k for m in job.metrics for k in m} - {"step", "_time", "_exps"})
        out.append({**info, "name": short[rel], "config": " ".join(f"{k}={v}" for k, v in job.config) or "(defaults)",
                    "step": [m["step"] for m in job.metrics], "time": [m["_time"] for m in job.metrics],
                    "experiences": [m["_exps"] for m in job.metrics],
                    "metrics": _columns(job.metrics, keys)})
    found = {k.split("/")[0] for r in out for k in r["metrics"]}
    prefixes = [p for p in FIRST_PREFIXES if p in found] + sorted(found - set(FIRST_PREFIXES))
    configs = []
    for config in dict.fromkeys(r["config"] for r in out):
        members = [j for j, r in zip(jobs, out) if r["config"] == config]
        if len(members) > 1:
            keys = sorted({k for r in out if r["config"] == config for k in r["metrics"]})
            configs.append({"config": config, "runs": [j.num for j in members], "bands": _bands(members, keys)})
    return {"runs": out, "prefixes": prefixes, "configs": configs}
