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
