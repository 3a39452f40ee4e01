"""Metrics: progress on the console, metrics.jsonl always, TensorBoard and wandb on request."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import sys
import time
from pathlib import Path

from tqdm import tqdm

from rft.config import flat
from rft.manifest import MAX_LINE, open_regular, put_aside, read_lines, write_atomic
from rft.registry import Registry, resolve
from rft.reporting.redact import redact, redacted_argv


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a per-step JSONL log (metrics.jsonl, batches.jsonl), in order."""
    return [record for _, record, _ in _read(Path(path)) if record is not None]


def _read(path: Path):
    """Each line of a JSONL log, read a line at a time: (its text, None where it is longer than
    manifest.MAX_LINE; its record, None where the line is not one; whether it is the last line).

    Each record is written and flushed whole before the next, so a kill can cut short only the
    last line: that one is left out without a word (a resumed run logs its step again). A bad
    line before the last is damage from elsewhere (two runs writing one directory, an edit by
    hand). It is left out too, since one bad line must not hide a whole run's metrics, but never
    silently: each read warns, naming the file and line, and rft never deletes it (see _reopen),
    so what it held can still be recovered by hand. So is a line longer than any record, wherever
    it is (a sparse 20 GB file is one line of zeros: read whole, the OOM killer).
    """
    if not path.exists():
        return
    # a FIFO or device in its place is an OSError (rft.manifest.open_regular), not a hang or /dev/zero read to
    # the end of memory; a run's own directory holds none (rft.runtime.rundir.run_lock refuses one)
    with open_regular(path) as f:
        ahead = None  # a line held until the next says it is not the last
        for n, (raw, _) in enumerate(read_lines(f), 1):
            if raw is not None and not raw.strip():
                continue
            if ahead is not None:
                yield _record(path, *ahead, last=False)
            ahead = (n, raw)
        if ahead is not None:
            yield _record(path, *ahead, last=True)


def _record(path: Path, n: int, raw: bytes | None, last: bool) -> tuple[str | None, dict | None, bool]:
    """(line n's text, its record or None, last) for _read, warning of a damaged line."""
    if raw is None:
        print(f"rft: warning: {path} line {n} is longer than {MAX_LINE >> 20} MiB, which no record is (damage from "
              f"elsewhere, or a sparse file); it is left out of what is read.", file=sys.stderr)
        return None, None, last
    line = raw.decode(errors="replace").rstrip("\r\n")
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, RecursionError):  # RecursionError: a line nested a thousand deep
        record = None
    # a step that is not a whole number (text, null: an edit, another program's log) is no row: it
    # is compared with the checkpoint's step on resume, a raw TypeError there ('str' <= 'int')
    if not (isinstance(record, dict) and type(record.get("step")) is int):
        record = None
        if not last:
            print(f"rft: warning: {path} line {n} is not a JSON record (a kill cuts only the last line, "
                  f"so something else damaged it); it is left out of what is read and kept in the file. "
                  f"Repair or delete that line to silence this warning.", file=sys.stderr)
    return line, record, last


def _line_every(total_steps: int) -> int:
    """Steps between two progress lines: 1, 2 or 5 times a power of ten, so that a run prints
    10 to 20 of them (every step of a run of up to 20)."""
    for power in itertools.count():
        for m in (1, 2, 5):
            if total_steps <= 20 * m * 10**power:
                return m * 10**power


def start_trackers(cfg, run_dir: Path, stage: str, start_step: int) -> list:
    """The trackers of monitor.monitor_type (MONITORS below, or a study's dotted path), started.
    One that raises (wandb without a login, a study's tracker whose server is down) is one
    paragraph naming it; the ones started before it are closed."""
    from rft.errors import ConfigError

    trackers = []
    for name in cfg.monitor.monitor_type:
        cls = resolve(MONITORS, name, "monitor.monitor_type")
        try:
            trackers.append(cls(cfg, run_dir, stage, start_step))
        except Exception as e:
            for tracker in trackers:
                tracker.close()
            raise ConfigError(f"monitor.monitor_type: the tracker {name} did not start: {type(e).__name__}: {e}. "
                              f"{getattr(cls, 'fix', 'Fix what it needs')}, or leave it out of monitor.monitor_type (the console and "
                              f"metrics.jsonl are always on).") from None
    return trackers


class Monitor:
    def __init__(self, cfg, run_dir: Path, total_steps: int, start_step: int, stage: str):
        # the trackers of monitor.monitor_type first: one that does not start opens no file here
        self.trackers = start_trackers(cfg, run_dir, stage, start_step)
        self.keys = list(cfg.monitor.console_keys)
        self.path = run_dir / "metrics.jsonl"
        # a resumed run rewrites the steps after its checkpoint: drop what the killed run logged
        self.file, kept = _reopen(self.path, start_step)
        _say_missing(self.path, kept, start_step)
        # what each step trained on: group ids, policy versions and a digest of the tokens
        self.batches_path = run_dir / "batches.jsonl"
        self.batches, self.batch_steps = _reopen(self.batches_path, start_step)
        # on a terminal a bar; in a file (a Slurm log, `> run.log`, CI) the bar's carriage-return
        # redraws would pile up, so there one plain line every few steps, the first and the last
        self.stage, self.total, self.every, self.first = stage, total_steps, _line_every(total_steps), True
        self.bar = None
        if sys.stderr.isatty():
            self.bar = tqdm(total=total_steps, initial=start_step, desc=stage, dynamic_ncols=True, leave=True)
        self.shown: dict[str, float] = {}

    def log(self, step: int, metrics: dict, advance: bool = True) -> None:
        record = {"step": step, **metrics}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        for tracker in self.trackers:
            tracker.log(step, metrics)
        # an eval's values are shown until the next eval; any other value is this step's or none (a
        # step whose every task failed logs no reward, and must not show the step before's)
        self.shown = {k: v for k, v in self.shown.items() if k.startswith("eval/")}
        self.shown.update({k: metrics[k] for k in self.keys if k in metrics})
        shown = {k.replace("/", "."): f"{self.shown[k]:.3g}" for k in self.keys if k in self.shown}
        if self.bar is not None:
            self.bar.set_postfix(shown, refresh=False)
            if advance:
                self.bar.update(step - self.bar.n)
        elif self.first or step % self.every == 0 or step == self.total:
            self.print(f"[{self.stage}] step {step}/{self.total}  " + " ".join(f"{k}={v}" for k, v in shown.items()))
        self.first = False

    def ensure_logged(self, step: int, metrics: dict | None) -> None:
        """A resumed run's first step: the checkpoint's own row, if a kill came between saving the
        checkpoint and logging its step (the checkpoint keeps a copy); then batches.jsonl's lines
        checked against the rows (_say_missing_batches)."""
        rows = read_metrics(self.path)
        if metrics is not None and not any(m["step"] == step for m in rows):
            self.log(step, metrics, advance=False)
            rows.append({"step": step, **metrics})
        _say_missing_batches(self.batches_path, self.batch_steps, rows, step)

    def record_batch(self, record: dict) -> None:
        """One line of batches.jsonl: rft.data.experience.batch_record of what a step trained on."""
        self.batches.write(json.dumps(record) + "\n")
        self.batches.flush()

    def histogram(self, step: int, name: str, values: list) -> None:
        for tracker in self.trackers:
            if values and hasattr(tracker, "histogram"):
                tracker.histogram(step, name, values)

    def print(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)  # above the bar, which is drawn again below
        else:
            print(text, flush=True)  # a file written in blocks would hold it back

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.file.close()
        self.batches.close()
        for tracker in self.trackers:
            tracker.close()


# A tracker is a class of monitor.monitor_type: built as cls(cfg, run_dir, stage, start_step) when
# a stage starts (start_step > 0: a resumed run, which logs the steps after it again), then
# log(step, metrics) each step, histogram(step, name, values) if it has one, close() at the end.
# A study's own is a dotted path in monitor.monitor_type (an MLflow client, say).


class TensorBoard:
    """Event files under <stage>/tensorboard through the tensorboard package's own writer and
    protos: what torch's SummaryWriter wraps, without importing torch into the driver of a Ray run
    (~0.2 GB there)."""

    def __init__(self, cfg, run_dir: Path, stage: str, start_step: int):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        # TensorBoard hides what a killed run logged from purge_step on: the steps run again
        purge_step = start_step + 1 if start_step else 0
        self.pb, self.summary = event_pb2, summary_pb2
        self.writer = EventFileWriter(str(run_dir / "tensorboard"))
        # a session start at purge_step: TensorBoard drops what earlier files logged from it on
        self._event(purge_step, file_version="brain.Event:2")
        self._event(purge_step, session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START))

    def _event(self, step: int, **fields) -> None:
        self.writer.add_event(self.pb.Event(wall_time=time.time(), step=int(step), **fields))

    def log(self, step: int, metrics: dict) -> None:
        values = [self.summary.Summary.Value(tag=k, simple_value=float(v)) for k, v in metrics.items()]
        self._event(step, summary=self.summary.Summary(value=values))

    def histogram(self, step: int, tag: str, values: list[int]) -> None:
        """Whole-number values (staleness), one bucket per number: k counts into (k - 0.5, k + 0.5].
        TensorBoard's buckets are given by their right limits, so an empty first one sets the left."""
        lo, hi = min(values), max(values)
        counts = [0] * (hi - lo + 2)
        for v in values:
            counts[v - lo + 1] += 1
        histo = self.summary.HistogramProto(
            min=lo, max=hi, num=len(values), sum=sum(values), sum_squares=sum(v * v for v in values),
            bucket_limit=[lo - 0.5 + i for i in range(len(counts))], bucket=counts)
        self._event(step, summary=self.summary.Summary(value=[self.summary.Summary.Value(tag=tag, histo=histo)]))

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A wandb run per stage, named <name>/<stage>; a resumed run goes on with the same one
    (WANDB_MODE=offline works without an account)."""

    # what start_trackers says when wandb.init raises: its own errors name neither variable
    fix = ("wandb takes its key from WANDB_API_KEY (or `wandb login`); without a network to its server, "
           "WANDB_MODE=offline logs into the run's directory (`wandb sync` uploads it later), and WANDB_HTTPS_PROXY "
           "sets a proxy for wandb alone (HTTPS_PROXY would take a judge's and a remote reward's requests too), each "
           "in the environment run.py starts from")

    def __init__(self, cfg, run_dir: Path, stage: str, start_step: int):
        import wandb

        # wandb's run metadata records the command line: a token typed on it is masked there too
        with redacted_argv():
            self.run = wandb.init(project=cfg.project, name=f"{cfg.name}/{stage}", dir=str(run_dir),
                                  config={"stage": stage, **config_dict(cfg)}, resume="allow", id=_wandb_id(run_dir))

    def log(self, step: int, metrics: dict) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


def config_dict(cfg) -> dict:
    """The stage's whole composed config, resolved, as plain containers, its secrets masked
    (rft/reporting/redact.py: a tracker's copy is uploaded and shared)."""
    from omegaconf import DictConfig, OmegaConf

    return redact(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True) if isinstance(cfg, DictConfig) else dict(cfg))


def mlflow_name(key: str) -> str:
    """A metric's name as MLflow takes it (alphanumerics, _ - . / : and spaces): eval/x/pass@4 ->
    eval/x/pass_at_4, level=2 -> level_eq_2, anything else -> _."""
    import re

    return re.sub(r"[^\w\-./: ]", "_", key.replace("@", "_at_").replace("=", "_eq_"))


class MLflow:
    """An MLflow run per stage, named <name>/<stage>, in the experiment <project>: the whole config
    as params (flattened, at the run's start), every step's metrics (names through `mlflow_name`),
    and metrics.jsonl and batches.jsonl as artifacts at the end. A resumed stage goes on in the same
    run (found by its tag rft.stage_key, a digest of the stage's directory, rft.stage_dir); the steps
    after its checkpoint are logged again (MLflow keeps both values: the later is the resumed run's)."""

    def __init__(self, cfg, run_dir: Path, stage: str, start_step: int):
        # a server that does not answer: a few seconds to the message, not MLflow's 7 retries with
        # backoff (4 minutes); the environment's own settings win
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        from mlflow.tracking import MlflowClient

        import sqlalchemy as sa

        root = Path(cfg.checkpoint_root_dir).expanduser().resolve() / cfg.project
        # the URL made from its parts, never parsed from text (as rft.data.buffer._engine's): in
        # f"sqlite:///{path}" a '?' in checkpoint_root_dir or the project began the URL's query (the store was
        # another file, <dir>/lr, shared), and '%41' was decoded (a folder that is not there: 100 s of retries).
        # sqlite+pysqlite (the same driver), as MLflow makes the folder of a sqlite:/// URL from its text,
        # undecoded (an empty <dir>/lr%3Fseed...); rft makes it just below
        own = sa.URL.create("sqlite+pysqlite", database=str(root / "mlflow.db")).render_as_string(hide_password=False)
        uri = cfg.monitor.mlflow_tracking_uri or own
        if uri.startswith(("sqlite:///", "sqlite+pysqlite:///")):
            Path(sa.make_url(uri).database).parent.mkdir(parents=True, exist_ok=True)
        self.client, self.dir = MlflowClient(uri), run_dir
        exp = self.client.get_experiment_by_name(cfg.project)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(
            cfg.project, artifact_location=None if cfg.monitor.mlflow_tracking_uri else (root / "mlartifacts").as_uri())
        tag = str(run_dir.resolve())
        key = hashlib.sha256(os.fsencode(tag)).hexdigest()[:32]
        self.run_id = self._found(exp_id, tag, key)
        if self.run_id is not None:
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(exp_id, run_name=f"{cfg.name}/{stage}", tags={
                "rft.stage_dir": tag, "rft.stage_key": key, "rft.stage": stage}).info.run_id
            self._params({k: str(v) for k, v in flat(config_dict(cfg)).items()})

    def _found(self, exp_id: str, tag: str, key: str) -> str | None:
        """The run of this stage's directory `tag`, where one was started (by its digest `key`)."""
        # by the digest, hex digits: a filter's value is quoted text that MLflow's parser never unescapes,
        # so a ' in the run's name ended the start in 'Invalid clause(s) in filter string'
        found = self.client.search_runs([exp_id], filter_string=f"tags.`rft.stage_key` = '{key}'", max_results=1)
        if not found and not ("'" in tag and '"' in tag):  # a run an rft before rft.stage_key started
            q = '"' if "'" in tag else "'"
            found = self.client.search_runs([exp_id], filter_string=f"tags.`rft.stage_dir` = {q}{tag}{q}", max_results=1)
            if found:
                self.client.set_tag(found[0].info.run_id, "rft.stage_key", key)
        return found[0].info.run_id if found else None

    def _params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k[:250], v[:6000]) for k, v in sorted(params.items())]
        for i in range(0, len(items), 100):  # MLflow takes 100 params a batch
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log(self, step: int, metrics: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(mlflow_name(k), float(v), now, int(step)) for k, v in metrics.items()
                 if isinstance(v, (int, float))]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i:i + 1000])

    def close(self) -> None:
        for name in ("metrics.jsonl", "batches.jsonl"):
            if (self.dir / name).exists():
                self.client.log_artifact(self.run_id, str(self.dir / name))
        self.client.set_terminated(self.run_id)


# monitor.monitor_type: name -> tracker class (console and metrics.jsonl are always on)
MONITORS = Registry("monitor.monitor_type", {"tensorboard": "rft.reporting.monitor.TensorBoard",
                                            "wandb": "rft.reporting.monitor.WandB",
                                            "mlflow": "rft.reporting.monitor.MLflow"},
                    shape="a tracker class with log and close (module.Class; rft/reporting/monitor.py)")


def _reopen(path: Path, start_step: int):
    """Open a per-step JSONL log for appending, for a run that starts after the checkpoint of
    `start_step`, or from nothing when it is 0 (step 0, the startup eval, included). It logs those
    steps again, so what a killed run logged of them goes, and so does a last line it cut short. A
    damaged line, whose step is unknown, stays as it is unless the run starts from nothing (see _read).
    Returns the file and the steps of the rows kept."""
    # a last line that is no record is what a kill cut short
    kept = [(line, m) for line, m, last in _read(path)
            if start_step > 0 and (m is None or m["step"] <= start_step) and not (last and m is None and line is not None)]
    if any(line is None for line, _ in kept):  # a line too long to hold: the file is kept whole aside
        aside = put_aside(path, "damaged")
        print(f"rft: warning: {path} holds a line longer than {MAX_LINE >> 20} MiB (see above), which rft does not "
              f"copy; the file is moved to {aside.name} beside it, and the log goes on without that line.",
              file=sys.stderr)
        kept = [(line, m) for line, m in kept if line is not None]
    # written aside, then renamed over the log: a kill in between leaves the old log whole (and a
    # link in the place of either is replaced, never written through: rft.manifest.write_atomic)
    write_atomic(path, "".join(line + "\n" for line, _ in kept))
    return open(path, "a"), {m["step"] for _, m in kept if m is not None}


def _spans(steps: list[int]) -> str:
    """Sorted steps as text, runs of consecutive ones as a span: "2, 5-7"."""
    spans = []
    for s in steps:
        if spans and spans[-1][1] == s - 1:
            spans[-1][1] = s
        else:
            spans.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _say_missing_batches(path: Path, steps: set, rows: list[dict], start_step: int) -> None:
    """batches.jsonl holds a line for each step that trained on experiences (its metrics row has
    train/experiences; a step whose every task failed has neither), written before the step's
    checkpoint: a kill never costs one. Say which ones of the steps up to the checkpoint's a cut or
    an edit took (a last line cut short is left out as a kill's would be), as no checkpoint holds them."""
    trained = {m["step"] for m in rows if m.get("train/experiences") and isinstance(m["step"], int)}
    missing = sorted({s for s in trained if s <= start_step} - steps)
    if missing:
        print(f"rft: warning: {path} has no line for step{'s' if len(missing) > 1 else ''} {_spans(missing)}, which "
              f"this run trained up to its checkpoint of step {start_step} (metrics.jsonl has their rows): the file was "
              f"cut or edited since, and no checkpoint holds what those steps trained on, so it goes on without them.",
              file=sys.stderr)


def _say_missing(path: Path, steps: set, start_step: int) -> None:
    """A resumed run's log holds a row for each step before its checkpoint's (whose own row the
    checkpoint restores: Monitor.ensure_logged); say which ones a cut or an edit took since, as no
    checkpoint holds them."""
    missing = [s for s in range(1, start_step) if s not in steps]
    if missing:
        listed = _spans(missing)
        print(f"rft: warning: {path} has no row for step{'s' if len(missing) > 1 else ''} {listed}, which this run "
              f"logged before its checkpoint of step {start_step}: the file was cut or edited since, and no "
              f"checkpoint holds them, so the log goes on without them.", file=sys.stderr)


def _wandb_id(run_dir: Path) -> str:
    import hashlib

    return hashlib.sha1(os.fspath(run_dir.resolve()).encode()).hexdigest()[:12]
