"""The task pipeline's run before a run's stages (rft/data/pipeline.py): each stage that explores
with data_processor.task_pipeline gets its output (made, or reused from the cache) before its plan
counts the taskset; the report goes to the terminal (and to <stage>/task_pipeline.json as the stage
starts).

An operator that samples the model (llm_difficulty_score_filter) gets `pass_rates`: an Explorer
of the stage's config (its engine, workflow, sampling and reward, as the run makes rollouts) over
the rows, released when the pipeline is done. With cluster=ray that happens in a child process
(`_in_child`): the driver neither keeps the engine's memory (a GPU's, which the explorers' engines
then take) nor the modules it loaded.
"""

from __future__ import annotations

import gc
import json
import tempfile
from pathlib import Path

from omegaconf import OmegaConf, open_dict

from rft.config import frozen
from rft.data.pipeline import cached_report, format_report, has_task_pipeline, run_task_pipeline, samples_model
from rft.errors import ConfigError, RunError


def pass_rates(cfg, rows: list[dict], n: int) -> list[float]:
    """Each row's pass rate over n rollouts of cfg's model, made by an Explorer of cfg whose
    taskset is these rows (in a temporary JSONL file, with no eval sets and no task pipeline)."""
    from rft.models import ensure_model
    from rft.rollout.explorer import Explorer
    from rft.rollout.explorer import pass_rates as rates

    ensure_model(cfg.model)
    with tempfile.TemporaryDirectory(prefix="rft_scores_") as tmp:
        path = Path(tmp) / "train.jsonl"
        path.write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))
        c = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
        with open_dict(c):
            inp = c.buffer.explorer_input
            inp.taskset.path, inp.taskset.split, inp.taskset.subset_name = str(path), "train", None
            inp.eval_tasksets, inp.generator = [], None
            c.data_processor.task_pipeline.operators = []
        explorer = Explorer(frozen(c))
        try:
            return rates(explorer, n)
        finally:
            del explorer
            gc.collect()


def prepare_tasks(stages: list, say=print) -> None:
    """Run (or reuse) the task pipeline of every stage that has one, and say what it did (each
    stage's directory gets its report as the stage starts: rft.data.pipeline.write_report)."""
    from rft.data.tasks import ensure_task_data
    from rft.models import ensure_model

    for s in stages:
        if not has_task_pipeline(s):
            continue
        ensure_task_data(s.buffer.explorer_input)
        ensure_model(s.model)  # built first: a sampling operator's cache key holds the model's files
        made = s.cluster.backend == "ray" and samples_model(s) and cached_report(s) is None
        if made:
            _in_child(s)  # then found in the cache below
        report = run_task_pipeline(s, pass_rates=lambda rows, n, s=s: pass_rates(s, rows, n), say=say)
        report["cached"] = report["cached"] and not made
        say(f"task pipeline{' (cached)' if report['cached'] else ''}: {format_report(report)}; the taskset is now "
            f"{report['output']}")


def _in_child(cfg) -> None:
    """`run_task_pipeline` of cfg in a child process (this one's working directory, environment
    and package); its ConfigError is raised here, unchanged."""
    import subprocess
    import sys

    with tempfile.TemporaryDirectory(prefix="rft_pipeline_") as tmp:
        ask, error = Path(tmp) / "config.json", Path(tmp) / "error.txt"
        ask.write_text(json.dumps(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)))
        root = str(Path(__file__).resolve().parents[2])
        code = f"import sys; sys.path.insert(0, {root!r}); from rft.runtime.pipelines import _child; _child(*sys.argv[1:])"
        rc = subprocess.run([sys.executable, "-c", code, str(ask), str(error)], stdin=subprocess.DEVNULL).returncode
        if error.is_file():
            raise ConfigError(error.read_text())
    if rc:
        raise RunError(f"the task pipeline's child process failed (exit {rc}); its traceback is above.")


def _child(ask: str, error: str) -> None:
    """The child's side of `_in_child`."""
    # not read_record's bound: the parent wrote it a moment before into a folder of its own (0700)
    # from the config it holds, so its size is what that process already held; nothing else writes it
    cfg = OmegaConf.create(json.loads(Path(ask).read_text()))
    try:
        run_task_pipeline(cfg, pass_rates=lambda rows, n: pass_rates(cfg, rows, n))
    except ConfigError as e:
        Path(error).write_text(str(e))
