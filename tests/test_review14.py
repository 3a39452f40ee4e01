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
