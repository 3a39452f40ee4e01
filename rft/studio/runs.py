"""The studio's runs page, without the page: every run and sweep under the checkpoint root, their
curves, a sweep's report table, two runs' config differences, a bench run's table. It reads what
`python -m rft.reporting.report` reads (rft/reporting/report.py): `.hydra/` and each stage's
`metrics.jsonl`, through the studio's index (index.py: each file read again only when it changed,
a growing log from where the last read stopped); nothing here writes.
"""

from __future__ import annotations

import base64
import csv
import errno
import io
import math
import os
import threading
import time
from pathlib import Path

import yaml

from rft import manifest
from rft.reporting import report
from rft.reporting.redact import redact
from rft.studio import index as X

# metrics the curves offer first (where the runs logged them), then the rest in logged order
FIRST_METRICS = ("eval/accuracy", "reward/mean", "loss/policy", "actor/entropy", "actor/clip_frac",
                 "staleness/mean", "timing/step_s")
# overrides that name a run rather than configure it: never a column of their own
NOT_PARAMS = ("name",)
# a bench run's plot is sent inside its JSON answer: at most this big
MAX_PNG = 4 << 20


def _skip(p: Path) -> bool:
    return p.name.startswith((".", "previous_")) or p.name in ("stage_cache", "checkpoints", "eval_trajectories")


def find(root: Path) -> tuple[list[Path], list[Path]]:
    """(run directories, sweep directories) under root, at most five levels down. A run is a
    directory with `.hydra/` (a sweep's jobs included); a sweep is a directory inside one named
    `multirun` (`<root>/<project>/multirun/<date_time>`, or a study's `<name>/multirun/...`)."""
    runs, sweeps = [], []
    top = Path(root).resolve()

    def walk(d: Path, depth: int):
        # a link that leaves the root (to another user's folder, to /) is not followed: the
        # routes refuse what it leads to (inside), so the list does not show it either
        for p in sorted(Path(x.path) for x in os.scandir(d) if x.is_dir() and not _skip(Path(x.path))
                        and (not x.is_symlink() or _within(top, Path(x.path)))):
            is_run = (p / ".hydra").is_dir()
            if is_run:
                runs.append(p)
            elif d.name == "multirun":
                sweeps.append(p)
            if depth < 5 and not is_run:  # a run's own directories hold no runs
                walk(p, depth + 1)

    if Path(root).is_dir():
        walk(Path(root), 1)
    return runs, sweeps


def _num(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _within(top: Path, path: Path) -> bool:
    """Whether `path`, its links followed, is `top` (resolved) or under it: inside's rule."""
    path = path.resolve()
    return path == top or top in path.parents


def inside(root: Path, rel: str) -> Path:
    """root/rel, refusing a path that leaves root (the page names runs by their path under it)."""
    root = Path(root).resolve()
    path = (root / rel).resolve()
    if not _within(root, path):
        raise ValueError(f"{rel!r} is not under the checkpoint root")
    return path


def _mtime(p: Path) -> float | None:
    try:
        return p.stat().st_mtime
    except OSError:
        return None


_PLANNED: dict[Path, tuple[tuple[int, int], int | None]] = {}  # sweep -> ((mtime_ns, size), planned)
_PLANNED_MOST = 1024  # sweeps remembered; the oldest remembered is forgotten first
_PLANNED_LOCK = threading.Lock()  # the page's polls are answered in threads


def _planned(sweep: Path) -> int | None:
    """How many jobs the sweep planned (its multirun.yaml, as the report reads it): the list said
    "4 jobs" of a sweep of 6 whose 2 last never started. None where that is not known (another
    sweeper, no multirun.yaml, or more than a report lists). Read again only when the file's
    modification time or size changed: expanding one took 31-63 ms on a loaded machine, for each
    sweep at each poll of the runs page (every 2 s), where a sweep's plan is written once."""
    try:
        st = (sweep / "multirun.yaml").stat()
        key = (st.st_mtime_ns, st.st_size)
    except OSError:
        key = None
    known = _PLANNED.get(sweep)
    if key is not None and known is not None and known[0] == key:
        return known[1]
    try:
        planned = len(report.planned_jobs(sweep)) or None
    except report.ReportError:
        planned = None
    if key is not None:
        with _PLANNED_LOCK:
            _PLANNED.pop(sweep, None)
            if len(_PLANNED) >= _PLANNED_MOST:
                del _PLANNED[next(iter(_PLANNED))]
            _PLANNED[sweep] = (key, planned)
    return planned


def short_names(ids: list[str]) -> dict[str, str]:
    """Each run's name less the directories every one of them shares: `rft/multirun/<time>/3` -> `3`."""
    parts = [i.split("/") for i in ids]
    common = 0
    while len(ids) > 1 and all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
        common += 1
    return {i: "/".join(p[common:]) for i, p in zip(ids, parts)}


class Runs:
    """The runs under `root`, read through one index for the life of the studio."""

    def __init__(self, root: Path):
        self.root = Path(root)
        # the table's rows keep a few keys of each metrics row; curves and tables read every key
        # of the few runs asked for
        self.listed = X.CachedFiles(X.LISTED)
        self.full = X.CachedFiles(None, most=32, shared=self.listed)

    def summary(self, run: Path, stopped: bool = False) -> dict:
        """One run's row: where, stage, status, steps, last eval accuracy, its stage's training
        time, when it started and for how long it ran, its overrides."""
        rel = run.relative_to(self.root).as_posix()
        job = report.read_job(run, None, rel, self.listed)
        last_eval = next((m["eval/accuracy"] for m in reversed(job.metrics) if _num(m.get("eval/accuracy")) is not None), None)
        logged = report.logged_stages(run)
        updated = max((t for t in map(_mtime, logged.values()) if t), default=0)
        status = X.status(job, run, updated, stopped)
        # the run's record is written as it starts (and again as a resume starts)
        started = _mtime(run / ".hydra" / "config.yaml")
        end = time.time() if status in ("running", "starting") else updated
        params = {k: v for k, v in job.overrides.items() if k not in NOT_PARAMS}
        return {"id": rel, "stage": job.stage, "status": status, "detail": job.status,
                "steps": job.metrics[-1]["step"] if job.metrics else 0, "last_eval": last_eval, "train_s": job.time_s,
                "started": started, "updated": updated,
                "duration_s": (end - started) if started and end and end >= started else None,
                "params": params, "config": " ".join(f"{k}={v}" for k, v in params.items() if k != "seed") or "(defaults)",
                "bench": (run / "bench" / "results.csv").is_file()}

    def listing(self, stopped: frozenset[str] = frozenset()) -> dict:
        """{"runs": [summary, ...] newest first, "columns": the overrides whose values differ
        between the runs, "sweeps": [{"id", "jobs"}, ...]}. `stopped`: the runs the studio stopped."""
        runs, sweeps = find(self.root)
        rows = [self.summary(r, r.relative_to(self.root).as_posix() in stopped) for r in runs]
        rows.sort(key=lambda r: -(r["updated"] or r["started"] or 0))
        keys = list(dict.fromkeys(k for r in rows for k in r["params"]))
        columns = [k for k in keys if len({r["params"].get(k) for r in rows}) > 1] if len(rows) > 1 else keys
        return {"runs": rows, "columns": columns,
                "sweeps": [{"id": s.relative_to(self.root).as_posix(), "jobs": len(report.find_jobs(s, self.root.resolve())),
                            "planned": _planned(s)} for s in sorted(sweeps, key=lambda s: -(_mtime(s) or 0))]}

    def _job(self, rel: str, stage: str | None = None) -> report.Job:
        return report.read_job(inside(self.root, rel), stage, rel, self.full)

    def metric_names(self, ids: list[str]) -> list[str]:
        found = report.metrics_found([self._job(i) for i in ids])
        return [m for m in FIRST_METRICS if m in found] + [m for m in found if m not in FIRST_METRICS]

    def stages(self, ids: list[str]) -> list[str]:
        """The stages the runs logged, in order (a run without stages logs in its own directory: none)."""
        return list(dict.fromkeys(s for i in ids for s in report.job_stages(inside(self.root, i), self.full)
                                  if s and s in report.logged_stages(inside(self.root, i))))

    def curves(self, ids: list[str], metric: str, stage: str = "") -> list[dict]:
        """Each run's `metric` over steps, {"name", "run", "stage", "x", "step", "y", "offset"}: one
        trace per run from its last logged stage (stage ""), from the stage named, or one per logged
        stage ("all"), each stage after the one before: its x is its step plus the steps of the
        run's stages before it (`offset`). `name`: the part of the run's name that tells it from
        the others', with its stage."""
        short = short_names(ids)
        out = []
        for i in ids:
            run = inside(self.root, i)
            logged = report.logged_stages(run)
            wanted = ([s for s in report.job_stages(run, self.full) if s in logged] or [None]) if stage == "all" else [stage or None]
            offset = 0
            for s in wanted:
                if s is not None and s not in logged:
                    continue  # this run has no such stage
                job = report.read_job(run, s, i, self.full)
                points = [(m["step"], _num(m.get(metric))) for m in job.metrics if _num(m.get(metric)) is not None]
                out.append({"name": f"{short[i]} ({job.stage})" if job.stage else short[i], "run": i, "stage": job.stage,
                            "x": [p[0] + offset for p in points], "step": [p[0] for p in points],
                            "y": [p[1] for p in points], "offset": offset})
                if stage == "all":
                    offset += job.metrics[-1]["step"] if job.metrics else 0
        return out

    def sweep_table(self, sweep: str) -> dict:
        """A sweep's report (rft.reporting.report): one row per job, then one per configuration
        with (mean, std) over its seeds. {"jobs": [...], "configs": [...]}"""
        d = inside(self.root, sweep)
        dirs = report.find_jobs(d, self.root.resolve())
        if not dirs:
            raise ValueError(f"{sweep} holds no job directories")
        # the report's reading: a killed job with its planned overrides, the jobs never started
        jobs = report.read_jobs(d, None, self.full, self.root.resolve())
        keys = report.differing_keys(jobs)
        metrics = report.choose_metrics(jobs, None)
        table = report.rows(jobs, keys, metrics)
        configs = report.group_rows(report.groups(jobs), keys, table) if any(j.metrics for j in jobs) else []

        def cell(v):
            if isinstance(v, tuple):  # (mean, std[, (seeds with a value, n)]: fewer than n had one)
                mean, std = v[:2]
                return None if mean is None else (f"{mean:.4g}" + (f" ± {std:.2g}" if std is not None else "")
                                                  + (f" ({v[2][0]} of {v[2][1]})" if len(v) > 2 else ""))
            return f"{v:.4g}" if isinstance(v, float) else v

        return {"jobs": [{k: cell(v) for k, v in r.items()} for r in table],
                "configs": [{k: cell(v) for k, v in r.items()} for r in configs]}

    def diff(self, a: str, b: str) -> list[dict]:
        """The keys whose values differ between two runs' configs (`.hydra/config.yaml`, as
        composed, every stage's entries included): [{"key", "a", "b"}], by key."""
        def config(rel):
            path = inside(self.root, rel) / ".hydra" / "config.yaml"
            try:
                # within manifest.read_record's bound: a config.yaml of gigabytes (damage, a sparse file) was read whole
                cfg = manifest.written_yaml(manifest.read_record(path).decode())
            except (OSError, yaml.YAMLError, RecursionError, UnicodeDecodeError) as e:
                raise ValueError(f"{rel}: its config ({path.name}) does not read: "
                                 f"{e.strerror if isinstance(e, OSError) else e}") from None
            return _flat(redact(cfg) if isinstance(cfg, dict) else {})  # a record written unmasked shows none

        left, right = config(a), config(b)
        missing = "(absent)"
        return [{"key": k, "a": _text(left.get(k, missing)), "b": _text(right.get(k, missing))}
                for k in sorted(set(left) | set(right)) if left.get(k, missing) != right.get(k, missing)]

    def bench(self, rel: str) -> dict:
        """A bench run's table (bench/results.csv: a row per checkpoint, a column per eval set and
        metric) and its plot (bench/results.png, as a data: URL)."""
        d = inside(self.root, rel) / "bench"
        try:
            # a row per checkpoint: kilobytes; one of gigabytes (damage, a sparse file) was read whole
            text = manifest.read_record(d / "results.csv").decode(errors="replace")
            rows = list(csv.DictReader(io.StringIO(text, newline="")))
        except OSError as e:
            if e.errno == errno.EFBIG:
                raise ValueError(f"{rel}: its bench table (bench/results.csv) does not read ({e.strerror}): not the "
                                 f"table mode=bench writes; run it again with mode=bench to write it anew.") from None
            raise ValueError(f"{rel} has no bench table ({e.strerror}): run it with mode=bench") from None
        except csv.Error as e:  # a field past csv's limit (128 kB): damage, not a 500
            raise ValueError(f"{rel}: its bench table (bench/results.csv) does not read as CSV ({e}): run it again "
                             f"with mode=bench to write it anew.") from None
        png = d / "results.png"
        image = None
        if png.is_file() and png.stat().st_size <= MAX_PNG:
            image = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
        return {"columns": list(rows[0]) if rows else [], "rows": rows, "png": image}


def _flat(tree: dict) -> dict:
    """rft.config.flat, and a list of dicts (stages) entry by entry: `stages[1].algorithm.optimizer.lr`."""
    from rft.config import flat

    out = {}
    for k, v in flat(tree).items():
        if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            out.update({f"{k}[{n}].{kk}": vv for n, x in enumerate(v) for kk, vv in _flat(x).items()})
        else:
            out[k] = v
    return out


def _text(v) -> str:
    return v if isinstance(v, str) else "null" if v is None else str(v).lower() if isinstance(v, bool) else repr(v)


# a spreadsheet runs a cell that starts so as a formula (CSV injection): such text gets a leading '
FORMULA = ("=", "+", "-", "@", "\t", "\r")
CSV_FIELDS = ("id", "status", "detail", "stage", "steps", "last_eval", "train_s", "started", "duration_s")


def csv_cell(v):
    if v is None:
        return ""
    if isinstance(v, str) and v.startswith(FORMULA):
        try:
            float(v)  # a number written as text (-0.5) is a number in the sheet, not a formula
            return v
        except ValueError:
            return "'" + v
    return v


def csv_text(listing: dict) -> str:
    """The runs table as CSV: a row per run, its fields and a column per override that differs;
    times as ISO dates. Text that a spreadsheet would run as a formula is quoted with a leading '."""
    import datetime
    import io

    out = io.StringIO()
    w = csv.writer(out)
    w.writerow([*CSV_FIELDS, *listing["columns"]])
    for r in listing["runs"]:
        row = dict(r, started=datetime.datetime.fromtimestamp(r["started"]).isoformat(timespec="seconds")
                   if r["started"] else None, duration_s=round(r["duration_s"], 1) if r["duration_s"] is not None else None)
        w.writerow([csv_cell(row[f]) for f in CSV_FIELDS] + [csv_cell(r["params"].get(c)) for c in listing["columns"]])
    return out.getvalue()
