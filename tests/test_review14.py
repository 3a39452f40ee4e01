"""Review of the logs and records read back (size, URL and quote characters), attacked as a careless
user or a handed-over run directory would."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import compose_cfg


@pytest.mark.slow  # MLflow makes its SQLite store with its migrations (~5 s)
def test_mlflow_store_and_runs_under_url_and_quote_characters(tmp_path):
    """monitor=mlflow under checkpoint_root_dir 'lr?seed=1#2%41' and run directories named with ' and ":
    the store was parsed from f"sqlite:///{path}" ('?' began its query: the store was <tmp>/lr, '%41'
    was decoded), and the run was found by a filter string quoting the directory in ' (a ' in it:
    'Invalid clause(s) in filter string'). Each stage's run now lies in <root>/<project>/mlflow.db,
    its artifacts beside it, and a resumed stage goes on in its run, one of an older rft's too."""
    pytest.importorskip("mlflow")
    import sqlalchemy as sa
    from mlflow.tracking import MlflowClient

    from rft.reporting.monitor import MLflow

    cfg = compose_cfg(["monitor=mlflow"])
    cfg.checkpoint_root_dir = str(tmp_path / "lr?seed=1#2%41")
    root = (tmp_path / "lr?seed=1#2%41" / "rft").resolve()  # made by the tracker: the runs lie elsewhere
    runs = tmp_path.resolve() / "runs"
    dirs = [runs / "it's" / "grpo", runs / 'say "hi", it\'s' / "grpo"]
    ids = []
    for d in dirs:
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text('{"step": 1, "x": 0.5}\n')
        for start in (0, 1):  # the stage, then its resume
            tracker = MLflow(cfg, d, "grpo", start)
            tracker.log(1, {"x": 0.5})
            tracker.close()
            ids.append(tracker.run_id)
    assert ids[0] == ids[1] != ids[2] == ids[3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lr?seed=1#2%41", "runs"]  # the old store: <tmp>/lr
    client = MlflowClient(sa.URL.create("sqlite", database=str(root / "mlflow.db")).render_as_string())
    exp = client.get_experiment_by_name("rft").experiment_id
    assert {r.data.tags["rft.stage_dir"] for r in client.search_runs([exp])} == {str(d) for d in dirs}
    assert (root / "mlartifacts" / ids[0] / "artifacts" / "metrics.jsonl").is_file()  # not under <tmp>/lr?seed=1#2A
    # a run an rft before rft.stage_key started (its directory alone as a tag) goes on in that run
    older = runs / "o'ld" / "grpo"
    older.mkdir(parents=True)
    run_id = client.create_run(exp, tags={"rft.stage_dir": str(older)}).info.run_id
    tracker = MLflow(cfg, older, "grpo", 1)
    tracker.close()
    assert tracker.run_id == run_id


def _sparse(path: Path, size: int) -> Path:
    """A file of `size` zero bytes that takes no disk (truncate -s): a damaged or planted record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def test_hydra_records_past_the_bound_are_one_warning_each_in_the_report(tmp_path, capsys):
    """A job's .hydra/ files of more than manifest.MAX_RECORD (64 MiB + 1 here; 20 GB reads the same)
    were read whole by the report and the studio's runs table (MemoryError, or the OOM killer); each is
    now refused from its size, said once (config.yaml and hydra.yaml were silent), and the job reported
    from its metrics as a configuration of its own."""
    from rft import manifest
    from rft.reporting import report

    job = tmp_path / "0"
    for name in ("config.yaml", "overrides.yaml", "hydra.yaml"):
        _sparse(job / ".hydra" / name, manifest.MAX_RECORD + 1)
    (job / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n{"step": 2, "reward/mean": 0.75}\n')
    got = report.read_job(job)
    assert got.overrides == {} and got.config == ("run", "0") and [m["step"] for m in got.metrics] == [1, 2]
    assert report.searchpath_override(job) is None
    big = f"larger than {manifest.MAX_RECORD} bytes, which no record rft writes is"
    assert capsys.readouterr().err.splitlines() == [
        f"rft.reporting.report: warning: {job / '.hydra/overrides.yaml'} does not read ({big}); job 0 is reported as "
        f"a configuration of its own, without its overrides.",
        *(f"rft.reporting.report: warning: {job / '.hydra' / name} does not read ({big}): not the file Hydra wrote; "
          f"its job is reported as if it had none. Move it out of the run's directory to silence this warning."
          for name in ("config.yaml", "hydra.yaml"))]


def test_the_studios_diff_and_bench_refuse_files_past_the_bound_in_one_sentence(tmp_path):
    """The studio's diff page read both runs' .hydra/config.yaml whole, its bench page bench/results.csv
    (a sparse 64 MiB + 1: csv's raw 'line contains NUL', a 500); a results.csv whose field passes csv's
    limit (128 kB) was a raw csv.Error too."""
    from rft import manifest
    from rft.studio.runs import Runs

    (tmp_path / "a" / ".hydra").mkdir(parents=True)
    (tmp_path / "a" / ".hydra" / "config.yaml").write_text("seed: 1\n")
    _sparse(tmp_path / "b" / ".hydra" / "config.yaml", manifest.MAX_RECORD + 1)
    big = f"larger than {manifest.MAX_RECORD} bytes, which no record rft writes is"
    with pytest.raises(ValueError) as e:
        Runs(tmp_path).diff("a", "b")
    assert str(e.value) == f"b: its config (config.yaml) does not read: {big}"
    _sparse(tmp_path / "b" / "bench" / "results.csv", manifest.MAX_RECORD + 1)
    with pytest.raises(ValueError) as e:
        Runs(tmp_path).bench("b")
    assert str(e.value) == (f"b: its bench table (bench/results.csv) does not read ({big}): not the table mode=bench "
                            f"writes; run it again with mode=bench to write it anew.")
    (tmp_path / "b" / "bench" / "results.csv").write_text("step,eval/a/accuracy\n" + "1," + "9" * 200_000 + "\n")
    with pytest.raises(ValueError) as e:
        Runs(tmp_path).bench("b")
    assert str(e.value) == ("b: its bench table (bench/results.csv) does not read as CSV (field larger than field "
                            "limit (131072)): run it again with mode=bench to write it anew.")
    (tmp_path / "b" / "bench" / "results.csv").write_text("step,eval/a/accuracy\n0,0.25\n2,0.5\n")  # as bench writes it
    assert Runs(tmp_path).bench("b")["rows"] == [{"step": "0", "eval/a/accuracy": "0.25"},
                                                  {"step": "2", "eval/a/accuracy": "0.5"}]


def _holed_log(path: Path, hole: int) -> Path:
    """metrics.jsonl: step 1, a line of `hole` zero bytes that takes no disk (a sparse file's hole, as
    truncate -s makes), step 2, and a last line cut short."""
    with open(path, "wb") as f:
        f.write(b'{"step": 1, "reward/mean": 0.5}\n')
        f.seek(hole, os.SEEK_CUR)
        f.write(b'\n{"step": 2, "reward/mean": 0.75}\n{"step": 3, "rew')
    return path


def _peak(fn):
    """(fn(), the most memory Python held while it ran, in MiB)."""
    import tracemalloc

    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def test_the_report_the_studio_and_the_monitor_read_a_log_a_line_at_a_time(tmp_path, capsys):
    """metrics.jsonl and batches.jsonl were read whole (and decoded, and split) by the report, the
    studio's index and the monitor: a sparse 20 GB file was a MemoryError or the OOM killer. With a
    160 MiB line of zeros (old: each held 320 MiB or more; a 20 GB one took ~0.3 s now) each holds at
    most ~2 of manifest.MAX_LINE (16 MiB), the line is left out as a damaged one (the monitor says so)
    and the rows around it are read as before."""
    from rft import manifest
    from rft.reporting import monitor, report
    from rft.studio.index import CachedFiles

    log = _holed_log(tmp_path / "metrics.jsonl", 160 << 20)
    rows = [{"step": 1, "reward/mean": 0.5}, {"step": 2, "reward/mean": 0.75}]
    for read in (report.read_jsonl, monitor.read_metrics, CachedFiles().jsonl):
        got, peak = _peak(lambda: read(log))
        assert got == rows and peak < 40, (read, peak)  # MiB: a line of 16 MiB and the next 17 as it grows
    assert capsys.readouterr().err == (f"rft: warning: {log} line 2 is longer than 16 MiB, which no record is (damage "
                                       f"from elsewhere, or a sparse file); it is left out of what is read.\n")
    # a line of 16 MiB is still one (exactly at the bound); 16 MiB + 1 is not
    for size, want in ((manifest.MAX_LINE, True), (manifest.MAX_LINE + 1, False)):
        line = b'{"step": 4, "x": "' + b"a" * (size - 20) + b'"}'
        assert len(line) == size
        (tmp_path / "b.jsonl").write_bytes(line + b"\n")
        assert (report.read_jsonl(tmp_path / "b.jsonl") != []) is want


def test_a_resume_sets_aside_a_log_holding_a_line_too_long_to_copy(tmp_path, capsys):
    """A resume rewrites the log with its rows up to the checkpoint (monitor._reopen), damaged lines kept
    as they are: a line of gigabytes cannot be, so the whole file is moved aside (never deleted) and the
    log goes on with its rows. The old code read it whole, and dropped such a last line as a kill's cut."""
    from rft.reporting import monitor

    log = tmp_path / "batches.jsonl"
    with open(log, "wb") as f:
        f.write(b'{"step": 1, "digest": "ab"}\n{"step": 2, "digest": "cd"}\n')
        f.truncate(f.tell() + (32 << 20))  # as truncate -s leaves it: a hole to the end, no newline
    f, steps = monitor._reopen(log, 1)
    f.close()
    assert steps == {1} and log.read_text() == '{"step": 1, "digest": "ab"}\n'
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("batches.jsonl.damaged-")]
    assert len(aside) == 1 and aside[0].stat().st_size == 56 + (32 << 20)  # 28 + 28 bytes of rows, then the hole
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"rft: warning: {log} holds a line longer than 16 MiB (see above), which rft does not copy; the file is moved "
        f"to {aside[0].name} beside it, and the log goes on without that line.")
