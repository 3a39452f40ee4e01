"""A sweep's results on one page: `python -m rft.reporting.report <multirun, run or runs directory>`.

    python run.py -m algorithm.optimizer.lr=1e-4,3e-4 seed=1,2,3
    python -m rft.reporting.report checkpoints/rft/multirun/<date_time>                     # the last stage
    python -m rft.reporting.report checkpoints/rft/multirun/<date_time> --stage sft_warmup  # another stage
    python -m rft.reporting.report checkpoints/rft/multirun/<date_time> --stage all --metrics reward/mean,loss/policy
    python -m rft.reporting.report checkpoints/rft                                          # every run in it

The directory is a Hydra multirun (job directories `0/`, `1/`, ...), one run's directory (with
`.hydra/` in it), or a directory holding run directories one or two levels down (each one a job,
named by its path). A job has `.hydra/overrides.yaml`, `.hydra/config.yaml` and `metrics.jsonl`,
directly or under one directory per stage. Writes into the directory:

    report.md     one row per job: the overrides that differ between jobs, the stage reported,
                  status, steps, each metric's final value (eval accuracies: also the best value and
                  its step), time; then, where jobs differ only in `seed`, one row per
                  configuration with `mean ± std` over its seeds
    report.csv    the same rows (a configuration's row: `n`, `<column> mean` and `<column> std`)
    rewards.png   a panel per metric (with --stage all, a row of them per stage): a curve per
                  configuration, the mean over its seeds with a band of ± one std (with --no-group,
                  a curve per job)

--stage: by default each job's last configured stage that logged metrics (the `stage` column
names it); NAME reports that stage of every job; `all` every stage, a row per job and stage.
--metrics: comma-separated; by default reward/mean and each eval set's `eval/<set>/accuracy`, in
the order the runs logged them (`eval/accuracy`, the first set's alias, only when the runs logged
no per-set accuracy). An eval accuracy's best is its highest.
Seeds: jobs whose overrides are the same but for `seed` are one configuration (--no-group: none
are). Its row's values are over its finished jobs (`done`), `n` their count (where none has
finished, over those with metrics in the stage); std is the sample std (N-1) over them. Its curve
is over every job with metrics, the band covering the steps every one of them logged.
`time_s` is the seconds the reported stage's metrics account for (its steps, evals and saves; not
process start or model loading): a warm-up that one job of a configuration trained and the others
copied from the stage cache does not count in the RL stage's time; a stage copied from the cache
(`reused_from`) has none. A job without metrics is a row that says so; directories named
`previous_*` (earlier outputs moved aside) are ignored.
"""

from __future__ import annotations

import argparse
import csv
import errno
import io
import json
import math
import os
import re
import shlex
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from rft import manifest
from rft.config import near_args
from rft.reporting.redact import redact_overrides
from rft.reporting.sweep import OWN_LOG, own_log

TIMING_KEYS = ("timing/step_s", "timing/eval_s", "timing/save_s")
NO_METRICS = "no metrics (failed before its first step, or not started)"
NOT_STARTED = "not started (no job directory)"


# a sweep's planned jobs are listed as rows: beyond these, multirun.yaml is not one Hydra ran (Slurm's
# default MaxArraySize is 1001), and listing them would take minutes and gigabytes (~0.5 KiB a job)
MAX_PLANNED_JOBS = 100_000
MAX_MULTIRUN_BYTES = 16 << 20  # Hydra's multirun.yaml is the composed config: kilobytes


class ReportError(ValueError):
    """A mistake in the report's arguments: main prints it as one paragraph, exit code 2."""


@dataclass
class Job:
    """One job's results in one stage."""

    num: str  # the job's name: its number in a multirun, else its path below the directory given
    path: Path
    overrides: dict[str, str] = field(default_factory=dict)
    config: tuple = ()  # jobs with the same config (the overrides but seed) are seeds of one
    stage: str = ""  # "" when metrics.jsonl sits in the job directory itself
    slot: int = 0  # with --stage all, the stage's place counted back from the job's last: a row of panels each
    status: str = NO_METRICS
    metrics: list[dict] = field(default_factory=list)
    time_s: float | None = None
    rollouts: int | None = None  # responses generated in the stage (rollout/generated summed), kept or not

    def series(self, key: str) -> tuple[list[int], list[float]]:
        # numbers only: a text or list under a metric's key (a damaged or foreign log) is no point
        points = [(m["step"], m[key]) for m in self.metrics if is_number(m.get(key))]
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


# ---------------------------------------------------------------- reading


class Files:
    """How a job's files are read: each call reads them anew. The studio's index
    (rft/studio/index.py) answers the same calls from what it read before, while the files are
    unchanged or only grew."""

    def jsonl(self, path: Path) -> list[dict]:
        return read_jsonl(path)

    def plan(self, job_dir: Path) -> list[tuple[str, int | None]]:
        return planned_stages(job_dir)

    def overrides(self, job_dir: Path, name: str) -> dict[str, str] | None:
        return parse_overrides(job_dir, name)


FILES = Files()


def _job_order(p: Path):
    # numbered job directories by number (10 after 9), then the others by name
    return (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name)


def _subdirs(d: Path, within: Path | None = None) -> list[Path]:
    # not .submitit/ (launcher logs), nor previous_*/ (outputs moved aside); with `within`, no link
    # that leads out of it
    return sorted((p for p in d.iterdir() if p.is_dir() and not p.name.startswith((".", "previous_"))
                   and (within is None or not p.is_symlink() or within in p.resolve().parents)),
                  key=_job_order)


def find_jobs(sweep_dir: Path, within: Path | None = None) -> list[Path]:
    """The job directories: the directory itself if it is a run, else those one level down
    (Hydra's numbered job directories: one that never started may have no .hydra/) and, under a
    directory that is neither, the runs two levels down (e.g. checkpoints/<project>/<name>/).
    `within` (resolved; the studio's root): a link to a directory outside it is not followed; the
    command line's report follows links (a folder of links to runs compares them)."""
    if (sweep_dir / ".hydra").is_dir():  # a single run
        return [sweep_dir]
    jobs = []
    for p in _subdirs(sweep_dir, within):
        if p.name.isdigit() or (p / ".hydra").is_dir():
            jobs.append(p)
        else:
            jobs += [q for q in _subdirs(p, within) if (q / ".hydra").is_dir()]
    return jobs


# the .hydra/ files said to be too large, with their size: a report reads a job's plan more than once
# (read_job, job_stages) and the studio at each change, and each is said once
_WARNED: set[tuple[Path, int]] = set()


def hydra_record(path: Path) -> bytes:
    """A run's .hydra/ file (YAML of kilobytes), read within manifest.read_record's bound: read whole, a
    damaged or planted one of gigabytes (a sparse file) took that memory, or the OOM killer, before it
    failed to parse. One too large is said once (its size), then raised as an OSError as any that does
    not read, which the callers take for a missing file."""
    try:
        return manifest.read_record(path)
    except OSError as e:
        if e.errno == errno.EFBIG and (seen := (path, path.stat().st_size)) not in _WARNED:
            _WARNED.add(seen)
            print(f"rft.reporting.report: warning: {path} does not read ({e.strerror}): not the file Hydra "
                  f"wrote; its job is reported as if it had none. Move it out of the run's directory to "
                  f"silence this warning.", file=sys.stderr)
        raise


def parse_overrides(job_dir: Path, name: str) -> dict[str, str] | None:
    """The job's overrides; None when its record is missing or does not read (cut short, edited):
    the job is then a configuration of its own, and one damaged record does not stop the report."""
    path = job_dir / ".hydra" / "overrides.yaml"
    if not path.exists():
        return None
    try:
        items = manifest.written_yaml(manifest.read_record(path).decode()) or []
    except (yaml.YAMLError, RecursionError, UnicodeDecodeError, OSError) as e:
        why = f"does not read ({e.strerror})" if isinstance(e, OSError) else f"does not parse as YAML ({str(e).splitlines()[0]})"
        print(f"rft.reporting.report: warning: {path} {why}; job {name} is "
              f"reported as a configuration of its own, without its overrides.", file=sys.stderr)
        return None
    out = {}
    # a token typed on the command line is in the record (a run of an older rft, or one whose
    # record was written unmasked): the report, a page others read, shows it masked
    for item in redact_overrides(items) if isinstance(items, list) else []:
        key, _, value = item.partition("=")
        out[key] = value
    return out


def searchpath_override(job_dir: Path) -> str | None:
    """The job's `hydra.searchpath=[...]` override, where it had one (a study kept outside the
    repository): the common line needs it to be a command that runs; Hydra records it among its own
    overrides in .hydra/hydra.yaml, not in overrides.yaml. None where absent or unreadable."""
    try:
        doc = manifest.written_yaml(hydra_record(job_dir / ".hydra" / "hydra.yaml").decode())
        items = doc["hydra"]["overrides"]["hydra"]
    except (OSError, yaml.YAMLError, RecursionError, UnicodeDecodeError, KeyError, TypeError):
        return None
    return next((str(i) for i in items if str(i).startswith("hydra.searchpath=")), None) if isinstance(items, list) else None


def planned_stages(job_dir: Path) -> list[tuple[str, int | None]]:
    """(stage name, buffer.total_steps or None) per configured stage, in order; [] without stages.

    Values are read lazily, so interpolations the report cannot resolve (`${hydra:...}` in `name`)
    do no harm; a stage whose name cannot be read is left out."""
    path = job_dir / ".hydra" / "config.yaml"
    if not path.exists():
        return []
    try:
        # as rft wrote it (no aliases): nine of nine, expanded by OmegaConf, never ended (the report, the
        # studio's runs table); a file that does not read is reported without its plan, by file times
        plain = manifest.written_yaml(hydra_record(path).decode())
    except (yaml.YAMLError, RecursionError, UnicodeDecodeError, OSError):
        return []
    try:
        return _plain_plan(plain)
    except Exception:  # an interpolation beyond a plain ${a.b}: OmegaConf's way
        pass
    out = []
    try:
        cfg = OmegaConf.create(plain)
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


class _NotPlain(Exception):
    pass


def _plain_plan(cfg: dict) -> list[tuple[str, int | None]]:
    """planned_stages from the YAML as plain values, where every value it reads is plain or a
    `${a.b}` of one (_NotPlain otherwise): a merge by OmegaConf took ~40 ms a stage, which the
    studio's runs table paid for each run it first listed."""
    def merged(base, over):
        if not isinstance(base, dict) or not isinstance(over, dict):
            return over
        return {**base, **{k: merged(base.get(k), v) for k, v in over.items()}}

    def get(tree, key, depth=0):
        for part in key.split("."):
            tree = tree.get(part) if isinstance(tree, dict) else None
        if isinstance(tree, str) and "${" in tree:
            m = re.fullmatch(r"\$\{([\w.]+)\}", tree)
            if m is None or depth > 8:
                raise _NotPlain(tree)
            return get(whole, m.group(1), depth + 1)
        return tree

    base = {k: v for k, v in cfg.items() if k != "stages"}
    out = []
    for stage in cfg.get("stages") or []:
        whole = merged(base, stage)
        name, total = get(whole, "stage_name"), get(whole, "buffer.total_steps")
        if name is not None:
            out.append((str(name), total if isinstance(total, int) and not isinstance(total, bool) else None))
    return out


def logged_stages(job_dir: Path) -> dict[str, Path]:
    """{stage name: its metrics.jsonl} ("" for metrics.jsonl in the job directory itself)."""
    logged = {p.parent.name: p for p in job_dir.glob("*/metrics.jsonl")
              if not p.parent.name.startswith("previous_")}
    if (job_dir / "metrics.jsonl").exists():
        logged[""] = job_dir / "metrics.jsonl"
    return logged


def job_stages(job_dir: Path, files: Files = FILES) -> list[str]:
    """The job's stages in order: those it logged but no longer configures (by time of writing),
    then the configured ones, logged or not."""
    logged, order = logged_stages(job_dir), [name for name, _ in files.plan(job_dir)]
    return sorted((s for s in logged if s not in order), key=lambda s: logged[s].stat().st_mtime) + order


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_row(m) -> bool:
    """A metrics row: a JSON object whose step is a whole number. Any other line (a text or null
    step, from a damaged or foreign log) is left out as a cut-short line is: its step is added to
    and compared with numbers (the studio's tables and curves, the report's statuses)."""
    return isinstance(m, dict) and isinstance(m.get("step"), int) and not isinstance(m.get("step"), bool)


def read_jsonl(path: Path) -> list[dict]:
    """metrics.jsonl, leaving out a line a killed job cut short; none, said, from a FIFO or device
    in its place (manifest.open_regular: the report hung, or read /dev/zero until memory ran out).
    Read a line at a time (manifest.read_lines): read whole, a sparse 20 GB file was the OOM killer;
    a line longer than any row is left out as a damaged one is."""
    out = []
    try:
        with manifest.open_regular(path) as f:
            for line, _ in manifest.read_lines(f):
                if line is None:
                    continue
                try:
                    # bytes that are not UTF-8 (damage from elsewhere) make their line unreadable, not the whole report
                    m = json.loads(line.decode(errors="replace"))
                except (json.JSONDecodeError, RecursionError):  # RecursionError: a line nested a thousand deep
                    continue
                if is_row(m):
                    out.append(m)
    except OSError as e:
        print(f"rft.reporting.report: warning: {path} does not read ({e.strerror}); its job is reported without "
              f"metrics.", file=sys.stderr)
        return []
    return out


def read_job(job_dir: Path, stage: str | None = None, name: str | None = None, files: Files = FILES) -> Job:
    """The job's results in `stage`; None: its last configured stage that logged metrics."""
    name = name or job_dir.name
    overrides = files.overrides(job_dir, name)
    # a run without an overrides file is a configuration of its own, whatever its (empty) overrides
    config = ("run", name) if overrides is None else tuple((k, v) for k, v in overrides.items() if k != "seed")
    job = Job(name, job_dir, overrides or {}, config, stage or "")
    logged = logged_stages(job_dir)
    if not logged:
        return job
    plan = files.plan(job_dir)
    order = [s for s, _ in plan]
    if stage is None:  # the last configured stage that logged; else the one written last
        job.stage = [s for s in job_stages(job_dir, files) if s in logged][-1]
    if job.stage not in logged:
        # a configured stage after every one the job logged: the job stopped before it
        stopped = job.stage in order and all(order.index(s) < order.index(job.stage) for s in logged if s in order)
        job.status = f"stopped before stage {job.stage}" if stopped else "no metrics in this stage"
        return job
    job.metrics = files.jsonl(logged[job.stage])
    # the stage's own time: a warm-up is another stage's (and, copied from the stage cache
    # (reused_from), another job's), so configurations compare by what they trained themselves
    if not (logged[job.stage].parent / "reused_from").exists():
        total = sum(m[k] for m in job.metrics for k in TIMING_KEYS if is_number(m.get(k)))
        job.time_s = total if total and math.isfinite(total) else None  # NaN or inf: not JSON, not a time
        generated = [m["rollout/generated"] for m in job.metrics if is_number(m.get("rollout/generated"))]
        job.rollouts = int(sum(generated)) if generated else None
    steps = job.metrics[-1]["step"] if job.metrics else 0
    total = dict(plan).get(job.stage)
    if stage is None and plan and job.stage != order[-1]:
        job.status = f"stopped before stage {order[-1]}"  # the job's state, as its last stage shows it
    elif total is not None and steps < total:
        job.status = f"incomplete ({steps}/{total} steps)"
    elif total is None and not (logged[job.stage].parent / "checkpoints" / f"step_{steps}").exists():
        # without a planned step count, the final checkpoint (saved after the last step) tells
        job.status = "incomplete (no final checkpoint)"
    else:
        job.status = "done"
    return job


def read_jobs(sweep_dir: Path, stage: str | None = None, files: Files = FILES, within: Path | None = None) -> list[Job]:
    """Every job's results in `stage` (None: each job's last; "all": a Job per job and stage,
    ordered by stage, then job), the jobs a sweep planned and never started included. `files`:
    how they are read (the studio's index); `within`: find_jobs'."""
    dirs = find_jobs(sweep_dir, within)
    if not dirs:
        raise FileNotFoundError(
            f"{sweep_dir} holds no job directories (0/, 1/, ... or run directories, with .hydra/ "
            f"inside). Give the directory a `python run.py -m ...` sweep printed, e.g. "
            f"checkpoints/rft/multirun/<date_time>, or a run's, e.g. checkpoints/rft/<name>."
        )
    names = {d: d.name if d == sweep_dir else d.relative_to(sweep_dir).as_posix() for d in dirs}
    jobs = _read_stage(sweep_dir, dirs, names, stage, files)
    planned = planned_jobs(sweep_dir)
    for j in jobs:
        # a job killed before rft wrote its record (.hydra/ comes once the run is about to start) is
        # an empty directory: its planned overrides, or its row has blank sweep keys and a
        # configuration of its own, and every key common to the sweep becomes a column
        if j.num.isdigit() and int(j.num) < len(planned) and not (j.path / ".hydra").exists():
            j.overrides = planned[int(j.num)]
            j.config = tuple((k, v) for k, v in j.overrides.items() if k != "seed")
    slot = max((j.slot for j in jobs), default=0)
    unstarted = [Job(str(i), sweep_dir / str(i), o, tuple((k, v) for k, v in o.items() if k != "seed"), slot=slot,
                     status=NOT_STARTED) for i, o in enumerate(planned) if str(i) not in names.values()]
    if not unstarted:
        return jobs
    return sorted(jobs + unstarted, key=lambda j: (j.slot, _job_order(Path(j.num))))  # a multirun's: numbered


def planned_jobs(sweep_dir: Path) -> list[dict[str, str]]:
    """The overrides of every job a Hydra sweep (its multirun.yaml) planned, in job order
    (rft.reporting.sweep.planned_jobs); [] for another sweeper, a sweep it cannot expand without
    the config (glob), or no sweep."""
    from rft.reporting.sweep import TooManyJobs
    from rft.reporting.sweep import planned_jobs as expand

    path = sweep_dir / "multirun.yaml"
    try:
        # read as Hydra writes it: no aliases (nine of nine expand to a billion values), not nested past
        # libyaml's limit; within its bound as it is read (a file grown past it after a stat was read whole)
        text = manifest.read_record(path, MAX_MULTIRUN_BYTES).decode()
        jobs = expand(OmegaConf.create(manifest.written_yaml(text)).hydra, most=MAX_PLANNED_JOBS)
    except TooManyJobs as e:
        raise ReportError(f"{path} plans {e} (its hydra.sweeper.params and hydra.overrides.task), more than the "
                          f"{MAX_PLANNED_JOBS:,} a report lists: not a sweep Hydra ran, or one no table could show. "
                          f"If it is not the file Hydra wrote, move it out of {sweep_dir} and report again: the "
                          f"report then lists the job directories found, without the jobs never started.") from None
    except Exception:  # no multirun.yaml, a damaged one, or overrides only Hydra's config can expand
        return []
    # masked as a started job's record is (Hydra writes multirun.yaml itself, the token whole): a job
    # never started showed it, and with it was a configuration of its own beside its started seeds
    return [dict(o.partition("=")[::2] for o in redact_overrides(job)) for job in jobs]


def _read_stage(sweep_dir: Path, dirs: list[Path], names: dict, stage: str | None,
                files: Files = FILES) -> list[Job]:
    if stage is None:
        return [read_job(d, None, names[d], files) for d in dirs]
    per_job = {d: job_stages(d, files) for d in dirs}
    found = list(dict.fromkeys(s for stages in per_job.values() for s in stages if s))
    if stage == "all":
        jobs = []
        # stages side by side counted from the last, whatever their names (grpo, dr_grpo): a run of
        # one stage (no warm-up) beside runs of two has its RL stage beside theirs, not their warm-up
        most = max(len(per_job[d] or [""]) for d in dirs)
        for d in dirs:
            own = per_job[d] or [""]
            for i, s in enumerate(own):
                jobs.append(read_job(d, s, names[d], files))
                jobs[-1].slot = most - len(own) + i
        return sorted(jobs, key=lambda j: j.slot)  # stable: within a stage, jobs keep their order
    if stage not in found and not found:
        raise ReportError(f"--stage {stage}: the jobs in {sweep_dir} have no stages (each one's metrics.jsonl "
                          f"sits in its own directory). Leave --stage out.")
    if stage not in found:
        raise ReportError(f"--stage {stage}: no job in {sweep_dir} has a stage of that name. The stages "
                          f"found: {', '.join(found)}. Give one of them, or --stage all for every stage.")
    return [read_job(d, stage, names[d], files) for d in dirs]


# ---------------------------------------------------------------- metrics and rows


def metrics_found(jobs: list[Job]) -> list[str]:
    """Every numeric metric the jobs logged, in the order logged."""
    return list(dict.fromkeys(k for j in jobs for m in j.metrics for k, v in m.items()
                              if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)))


def default_metrics(found: list[str]) -> list[str]:
    """reward/mean and every eval set's accuracy; eval/accuracy repeats the first set's, so it is
    shown only for runs that logged no per-set accuracy."""
    evals = [k for k in found if k.startswith("eval/") and k.endswith("/accuracy") and k != "eval/accuracy"]
    if not evals and "eval/accuracy" in found:
        evals = ["eval/accuracy"]
    return [k for k in ["reward/mean"] if k in found] + evals or ["reward/mean"]


def choose_metrics(jobs: list[Job], metrics: list[str] | str | None) -> list[str]:
    found = metrics_found(jobs)
    if metrics is None:
        return default_metrics(found)
    if isinstance(metrics, str):
        metrics = metrics.split(",")
    metrics = [m.strip() for m in metrics if m.strip()]
    unknown = [m for m in metrics if m not in found]
    if not metrics or (unknown and found):  # with no metrics logged at all, there is nothing to check against
        raise ReportError(
            f"--metrics {','.join(unknown) or '(empty)'}: not logged by any job in the stage reported."
            f"{near_args(unknown, found)} The metrics "
            f"found: {', '.join(found)}. Give a comma-separated list of them, e.g. "
            f"--metrics {','.join(default_metrics(found))}.")
    return metrics


def differing_keys(jobs: list[Job]) -> list[str]:
    """Override keys whose value is not the same in every job (all keys for a sweep of one)."""
    jobs = list({j.path: j for j in jobs}.values())  # with --stage all, a job counts once
    keys = list(dict.fromkeys(k for j in jobs for k in j.overrides))
    if len(jobs) < 2:
        return keys
    return [k for k in keys if len({j.overrides.get(k) for j in jobs}) > 1]


def label(job: Job, keys: list[str]) -> str:
    parts = [f"{k}={job.overrides[k]}" for k in keys if k in job.overrides]
    return " ".join(parts) or f"job {job.num}"


def rows(jobs: list[Job], keys: list[str], metrics: list[str]) -> list[dict]:
    out = []
    for j in jobs:
        row = {"job": j.num, **{k: j.overrides.get(k, "") for k in keys}, "stage": j.stage, "status": j.status,
               "steps": j.metrics[-1]["step"] if j.metrics else None}
        for m in metrics:
            row[f"final {m}"] = j.last(m)
            if m.startswith("eval/") and m.endswith("accuracy"):  # the highest is the best
                row[f"best {m}"], row[f"best {m} at step"] = j.best(m)
        row["time_s"] = j.time_s
        if any(k.rollouts is not None for k in jobs):  # runs that count them: what each arm generated
            row["rollouts"] = j.rollouts
        out.append(row)
    return out


def groups(jobs: list[Job], group: bool = True) -> list[list[Job]]:
    """The jobs by configuration and stage, in job order (one job each when group is False). A
    seed that stopped in an earlier stage is a group of its own (its metrics are another stage's);
    one without metrics joins its configuration's group, so that its status is counted there."""
    out: dict[tuple, list[Job]] = {}
    for j in sorted(jobs, key=lambda j: not j.metrics):  # stable; jobs with metrics first: they name the stage
        key = (j.config if group else j.path, j.slot)
        if not j.metrics:
            key = next((k for k in out if k[:2] == key), (*key, j.stage))
        else:
            key = (*key, j.stage)
        out.setdefault(key, []).append(j)
    pos = {id(j): i for i, j in enumerate(jobs)}
    return sorted((sorted(js, key=lambda j: pos[id(j)]) for js in out.values()), key=lambda js: pos[id(js[0])])


def lead(js: list[Job]) -> Job:
    """The group's first job with metrics: its stage and status speak for the group's curves."""
    return next((j for j in js if j.metrics), js[0])


def group_label(js: list[Job], keys: list[str]) -> str:
    seeds = [j.overrides["seed"] for j in js if "seed" in j.overrides]
    name = " ".join(f"{k}={js[0].overrides[k]}" for k in keys if k != "seed" and k in js[0].overrides)
    if len(js) == 1:
        return label(js[0], keys)
    return name or (f"seed={','.join(seeds)}" if seeds else f"jobs {','.join(j.num for j in js)}")


def mean_std(values: list) -> tuple[float | None, float | None]:
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.fmean(values), _stdev(values) if len(values) > 1 else None


def _stdev(values: list) -> float:
    """The sample std; NaN where a value is NaN or infinite (a diverged seed), where statistics.stdev
    raises (AttributeError on a NaN)."""
    return statistics.stdev(values) if all(math.isfinite(v) for v in values) else math.nan


def group_rows(gs: list[list[Job]], keys: list[str], table: list[dict]) -> list[dict]:
    """A row per configuration: each value column's (mean, std) over its finished jobs' rows, and
    their count `n`; where none has finished (a sweep still running), over those with metrics. A
    job stopped midway is left out where another finished: its last values are of an earlier step,
    and averaged in they passed for a final result."""
    by_job = {(r["job"], r["stage"]): r for r in table}
    cols = [c for c in table[0] if c.startswith(("final ", "best ")) and not c.endswith(" at step")]
    out = []
    for js in gs:
        done = sum(j.status == "done" for j in js)
        rs = [by_job[j.num, j.stage] for j in js if j.metrics and (j.status == "done" or not done)]
        row = {**{k: js[0].overrides.get(k, "") for k in keys if k != "seed"},
               **({"seed": ",".join(j.overrides.get("seed", "") for j in js)} if "seed" in keys else {}),
               "stage": lead(js).stage,
               "status": js[0].status if len(js) == 1 else "done" if done == len(js) else f"{done}/{len(js)} done",
               "n": len(rs)}
        for c in [*cols, "time_s", *(["rollouts"] if "rollouts" in table[0] else [])]:
            values = [r[c] for r in rs]
            row[c] = mean_std(values)
            have = sum(v is not None for v in values)
            if 0 < have < len(rs):  # a seed without the metric (none logged): the mean is over fewer than n
                row[c] = (*row[c], (have, len(rs)))
        out.append(row)
    return out


# ---------------------------------------------------------------- writing


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, tuple):  # (mean, std[, (seeds with a value, n)]); one seed: its value alone
        return (_cell(v[0]) + (f" ± {_cell(v[1])}" if v[1] is not None else "")
                + (f" ({v[2][0]} of {v[2][1]})" if len(v) > 2 else ""))
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 100 else f"{v:.3f}"
    return str(v).replace("|", "\\|")


def _md_table(table: list[dict]) -> list[str]:
    header = list(table[0])
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(_cell(r[h]) for h in header) + " |" for r in table)]


# how a launcher's job ended, in its submitit log: rft's paragraph (one line, "rft: ..."), else Slurm's
# own line of the end of a job or step it killed or cancelled
_SLURM_END = re.compile(r"\*\*\* (?:JOB|STEP) \S+ ON \S+ [A-Z].*\*\*\*")
# rft's paragraphs of a run's end (rft.runtime.main, the reaper); its other lines are of a job that
# runs on (a warning, Ray's start, a requeue, a reward's prints cut), never why it stopped
_ENDS = ("rft: the run stopped: ", "rft: configuration error: ", "rft: interrupted. ", "rft: stopped by SIGTERM")


def _local_launcher(sweep: Path) -> bool:
    """Whether hydra/launcher=local ran the sweep (its multirun.yaml names submitit's LocalLauncher)."""
    try:
        path = sweep / "multirun.yaml"
        return path.stat().st_size <= MAX_MULTIRUN_BYTES and b".LocalLauncher\n" in manifest.read_regular(path)
    except OSError:
        return False


def _launcher_log(job: Job) -> Path | None:
    """The job's newest launcher log: the one it recorded as its own as it started
    (rft.reporting.sweep.OWN_LOG), else found by its folder's name under <sweep>/.submitit/."""
    log = own_log(job.path)
    if log is not None and log.is_file() and _owned(str(log), str(job.path.parent), f"job {job.num}"):
        return log
    sub = job.path.parent / ".submitit"
    if not sub.is_dir():
        return None
    # <id>_<job number>/<id>_<job number>_0_log.err in a job array; a sweep of one job is no array:
    # <id>/<id>_0_log.err. hydra/launcher=local names every job's folder so, <id> its process id: one
    # is job 0's only in a sweep of one job (else another job's error would read as job 0's); a job
    # of rft's that recorded its own log is not left to this guess
    alone = not _local_launcher(job.path.parent) or sum(d.name.isdigit() for d in job.path.parent.iterdir()) == 1
    dirs = [d for d in sub.iterdir()
            if (m := re.fullmatch(r"\d+(?:_(\d+))?", d.name)) and (m[1] or "0") == job.path.name and (m[1] or alone)]
    logs = [d / f"{d.name}_0_log.err" for d in dirs if (d / f"{d.name}_0_log.err").is_file()]
    return max(logs, key=lambda p: p.stat().st_mtime) if logs else None  # a resumed sweep's newest attempt


_WARNED: set[tuple[str, str]] = set()  # (log, sweep) refused and said: a job's stages each ask


def _owned(log: str, sweep: str, job: str) -> bool:
    """Whether the launcher log a job recorded as its own (`log`) lies in the sweep's folder or in its
    configured hydra.launcher.submitit_folder, a link followed: else, with a warning naming it, it is
    not read. The record is in a folder others may write to: it named a *_log.err anywhere (another
    sweep's, another user's), and the report quoted that file's last line as the job's end."""
    root = _submitit_root(Path(sweep))
    real = Path(log).resolve()
    if any(real.is_relative_to(d.resolve()) for d in (Path(sweep), root) if d is not None):
        return True
    if (log, sweep) in _WARNED:
        return False
    _WARNED.add((log, sweep))
    where = f"nor in its hydra.launcher.submitit_folder ({root})" if root is not None else "(and no submitit_folder of its own)"
    print(f"rft.reporting.report: warning: {job}'s {OWN_LOG} names {log}{f' (a link to {real})' if str(real) != log else ''}, "
          f"which is not in the sweep's folder {sweep} {where}: a log the sweep does not own, not read.", file=sys.stderr)
    return False


def _submitit_root(sweep: Path) -> Path | None:
    """The folder the sweep's multirun.yaml names in hydra.launcher.submitit_folder, up to its first
    part with a % (<folder>/%j: each job's own below it), relative ones from Hydra's runtime.cwd;
    None where it names none or does not resolve here."""
    try:
        path = sweep / "multirun.yaml"
        if path.stat().st_size > MAX_MULTIRUN_BYTES:
            return None
        cfg = OmegaConf.create(manifest.read_regular(path).decode())
        # the sweep is here (its ${now:...} would resolve to another time now)
        OmegaConf.update(cfg, "hydra.sweep.dir", str(sweep), force_add=True)
        folder, cwd = OmegaConf.select(cfg, "hydra.launcher.submitit_folder"), OmegaConf.select(cfg, "hydra.runtime.cwd")
    except Exception:  # no such file, not YAML, an interpolation that does not resolve here: the sweep's folder alone
        return None
    if not isinstance(folder, str):
        return None
    parts = []
    for part in Path(os.path.expanduser(folder)).parts:
        if "%" in part:
            break
        parts.append(part)
    root = Path(*parts) if parts else None
    if root is None or not (root.is_absolute() or isinstance(cwd, str)):
        return None
    return root if root.is_absolute() else Path(cwd) / root


def why_stopped(job: Job) -> tuple[str, Path] | None:
    """(why, the log saying it) for a job of a submitit sweep (hydra/launcher=slurm or local) that did
    not finish and whose newest launcher log (_launcher_log) says how it ended; None for a finished
    job, one still running, or one without such a log. Its last 64 kB are read (a FIFO or device in
    its place is left out, manifest.open_regular)."""
    if job.status == "done" or not job.path.name.isdigit():
        return None
    log = _launcher_log(job)
    if log is None:
        return None
    try:
        with manifest.open_regular(log) as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 65536))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith(_ENDS):
            return line.removeprefix("rft: ").strip(), log
    for line in reversed(lines):
        if m := _SLURM_END.search(line):
            return f"Slurm: {m.group(0)}", log
    return None


def _stopped_lines(jobs: list[Job]) -> list[str]:
    stopped = [(j, w) for j in jobs if (w := why_stopped(j))]
    lines = [f"- job {j.num}, {j.status}: {why} ({log})" for j, (why, log) in stopped]
    return ["", "## Jobs that stopped", "", *lines] if lines else []


def write_markdown(path: Path, sweep_dir: Path, jobs: list[Job], keys: list[str], table: list[dict],
                   by_config: list[dict]) -> None:
    # each quoted for a POSIX shell where it needs it (brackets are glob characters; a value read from a
    # job's .hydra/ in a folder others write to may hold `$(...)`, run by whoever pastes the line)
    common = [shlex.quote(f"{k}={v}") for k, v in jobs[0].overrides.items() if k not in keys] if jobs else []
    if jobs and (search := searchpath_override(jobs[0].path)):
        common.insert(0, shlex.quote(search))
    # a sweep's directory holds Hydra's multirun.yaml; any other (one run's, a folder of runs) is no sweep
    kind = "Sweep report" if (sweep_dir / "multirun.yaml").exists() else "Report"
    lines = [f"# {kind}: {sweep_dir.name}", ""]
    if common:
        lines += ["Common to all jobs: `" + " ".join(common) + "`", ""]
    lines += _md_table(table) + _stopped_lines(jobs)
    if by_config:
        lines += ["", "## By configuration: mean ± std over seeds", ""] + _md_table(by_config)
    lines += ["", "![the metrics over steps](rewards.png)", "",
              "`time_s`: seconds in the steps, evals and saves of the stage reported (not an earlier stage "
              "such as a shared warm-up, nor start-up or model loading; none for a stage copied from the stage cache)."
              + (" `rollouts`: the responses the stage generated, those it did not train on included (DAPO's "
                 "dynamic sampling draws more when groups are all right or all wrong; `reward/mean` is over the "
                 "kept ones), for comparing configurations at equal generation." if "rollouts" in table[0] else "")
              + (" `n`: the seeds a configuration's values are over, its finished ones (a seed stopped midway "
                 "is in the table above, not in the mean; where none has finished, those with metrics); std "
                 "over them (N-1); a value over fewer (seeds that never logged the metric) says how many, `(2 of 3)`." if by_config else ""), ""]
    manifest.write_atomic(path, "\n".join(lines))


def write_csv(path: Path, table: list[dict], by_config: list[dict]) -> None:
    fields = list(table[0])
    if by_config:  # a configuration's row: no job, its seeds in `seed`, n, and a mean and std per column
        fields += ["n"] + [f"{c} {s}" for c, v in by_config[0].items() if isinstance(v, tuple)
                           for s in ("mean", "std")]
        # a column some configuration averaged over fewer seeds than its n: how many, beside it
        fields += [f"{c} n" for c in dict.fromkeys(c for r in by_config for c, v in r.items()
                                                   if isinstance(v, tuple) and len(v) > 2)]
    # the table in memory, then the file whole or not at all: a report run again over a sweep and killed
    # midway left a report.csv of fewer rows (or none), which read as a table of fewer jobs
    with io.StringIO(newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, restval="")
        w.writeheader()
        w.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in table)
        for r in by_config:
            flat = {}
            for c, v in r.items():
                if isinstance(v, tuple):
                    flat[f"{c} mean"], flat[f"{c} std"] = v[:2]
                    if len(v) > 2:
                        flat[f"{c} n"] = v[2][0]
                else:
                    flat[c] = v
            w.writerow({k: ("" if v is None else v) for k, v in flat.items()})
        manifest.write_atomic(path, f.getvalue())


def mean_curve(js: list[Job], key: str) -> tuple[list[int], list[float], list[float], int] | None:
    """(steps, mean, std, n) over the jobs that logged `key`, at the steps all of them logged."""
    series = [dict(zip(*j.series(key))) for j in js]
    series = [s for s in series if s]
    steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
    if not steps:
        return None
    values = [[s[t] for s in series] for t in steps]
    return (steps, [statistics.fmean(v) for v in values],
            [_stdev(v) if len(v) > 1 else 0.0 for v in values], len(series))


def plot(jobs: list[Job], keys: list[str], title: str, metrics: list[str] | None = None, group: bool = True):
    """The figure: a panel per metric, a row of panels per stage; per configuration its mean curve
    and, over two or more seeds, a band of ± one std (group=False: a curve per job). Returns it
    (matplotlib's Figure); a configuration has the same colour in every panel."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed
    from matplotlib.ticker import MaxNLocator

    metrics = metrics or default_metrics(metrics_found(jobs))
    slots = sorted({j.slot for j in jobs if j.metrics}) or [0]
    gs = groups(jobs, group)
    colors = list(dict.fromkeys(js[0].config if group else js[0].path for js in gs))
    fig = Figure(figsize=(7 if len(metrics) == 1 else 6 * len(metrics), 4.5 * len(slots)), layout="constrained")
    axes = fig.subplots(len(slots), len(metrics), squeeze=False)
    for row, slot in zip(axes, slots):
        stages = ", ".join(dict.fromkeys(j.stage for j in jobs if j.slot == slot and j.metrics and j.stage))
        for key, ax in zip(metrics, row):
            for js in (js for js in gs if js[0].slot == slot):
                curve = mean_curve(js, key)
                if curve is None:
                    continue
                steps, mean, std, n = curve
                color = f"C{colors.index(js[0].config if group else js[0].path) % 10}"
                name = group_label(js, keys) + (f" ({n} seeds)" if n > 1 else "")
                if lead(js).status.startswith("stopped before"):  # an earlier stage drawn among later ones
                    name += f" (stage {lead(js).stage})"
                ax.plot(steps, mean, color=color, marker="o" if len(steps) < 15 else None, markersize=3,
                        label=_wrapped(name))
                if n > 1:
                    ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                                    color=color, alpha=0.2, linewidth=0)
            ax.set_xlabel("step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
            ax.set_ylabel(key)
            ax.set_title(f"{stages}: {key}" if len(slots) > 1 and stages else key)
            ax.grid(alpha=0.3)
    # one legend for every panel (a configuration missing from the first panel is still named),
    # beside them: inside a panel it hid curves
    handles = {line.get_label(): line for ax in axes.flat for line in ax.lines}
    if handles:
        fig.legend(handles.values(), handles.keys(), loc="outside right upper", fontsize="small")
    fig.suptitle(title)
    return fig


def _wrapped(label: str, width: int = 60) -> str:
    """A legend entry on lines of `width` characters at most: runs that differ by a long override
    list (a path, a dotted name) made a legend wider than the figure, over its title and panels,
    and matplotlib gave up its layout with a warning."""
    import textwrap

    return "\n".join(textwrap.wrap(label, width, break_on_hyphens=False)) if len(label) > width else label


def report(sweep_dir: Path, stage: str | None = None, metrics: list[str] | str | None = None,
           group: bool = True) -> dict[str, Path]:
    """Write report.md, report.csv and rewards.png into sweep_dir; returns their paths.

    stage: None (each job's last), a stage name, or "all"; metrics: names (a list, or one
    comma-separated string), None for the default; group: seeds into mean ± std rows and curves.
    A mistake in stage or metrics raises ReportError, naming what was found."""
    sweep_dir = Path(sweep_dir)
    jobs = read_jobs(sweep_dir, stage)
    metrics = choose_metrics(jobs, metrics)
    keys = differing_keys(jobs)
    table = rows(jobs, keys, metrics)
    gs = groups(jobs, group)
    by_config = group_rows(gs, keys, table) if len(gs) < len(jobs) else []  # only where seeds were merged
    out = {"md": sweep_dir / "report.md", "csv": sweep_dir / "report.csv"}
    write_markdown(out["md"], sweep_dir, jobs, keys, table, by_config)
    write_csv(out["csv"], table, by_config)
    stages = list(dict.fromkeys(j.stage for j in jobs if j.stage))
    title = f"{sweep_dir.name}" + (f" (stage {', '.join(stages)})" if stages else "")
    try:
        fig = plot(jobs, keys, title, metrics, group)
    except ImportError:
        print("rft.reporting.report: matplotlib is not installed, so no rewards.png (pip install matplotlib).", file=sys.stderr)
    else:
        out["png"] = sweep_dir / "rewards.png"
        png = io.BytesIO()  # rendered in memory, then written whole (or the earlier one kept)
        fig.savefig(png, dpi=100, format="png")
        manifest.write_atomic(out["png"], png.getvalue())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rft.reporting.report", description=__doc__.split("\n")[0])
    parser.add_argument("sweep_dir", type=Path, help="a multirun directory (e.g. "
                        "checkpoints/rft/multirun/<date_time>), a run's directory, or a directory of runs "
                        "(e.g. checkpoints/rft)")
    parser.add_argument("--stage", help="the stage to report: a stage name (e.g. sft_warmup), or all; "
                        "default: each job's last configured stage that logged metrics")
    parser.add_argument("--metrics", help="comma-separated metrics for the columns and panels, e.g. "
                        "reward/mean,eval/accuracy; default: reward/mean and every eval/<set>/accuracy")
    parser.add_argument("--no-group", action="store_true", help="a row and a curve per job only: no mean ± std "
                        "over the seeds of a configuration")
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        print(f"rft.reporting.report: {args.sweep_dir} is not a directory. Give the multirun directory that "
              f"`python run.py -m ...` printed (e.g. checkpoints/rft/multirun/<date_time>).", file=sys.stderr)
        return 2
    try:
        out = report(args.sweep_dir, stage=args.stage, metrics=args.metrics, group=not args.no_group)
    except (FileNotFoundError, ReportError) as e:
        print(f"rft.reporting.report: {e}", file=sys.stderr)
        return 2
    print("wrote " + ", ".join(str(p) for p in out.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
