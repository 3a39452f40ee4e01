"""Every option of every config group works on the embedded default with only that override:
each plans (dry run), and each sync method trains a few steps of the default study (each
algorithm: tests/test_algorithm_configs.py)."""

import pytest
from conftest import CONF, compose_cfg

import rft.data.tasks
import rft.runtime.main
from rft.reporting.monitor import read_metrics

GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name not in ("hydra", "experiment"))
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]
# options whose data or model only a hub has: on a machine without it, a clear error
NEEDS_HUB = {("task", "gsm8k")}
# options that read a local copy the user provides (task=math: RFT_MATH_PATH): a clear error without it
NEEDS_LOCAL = {("task", "math")}
# options that need a model the user names (algorithm=opd: its teacher): a clear error without it
NEEDS_TEACHER = {("algorithm", "opd")}
# a study's own task, whose data its prepare.py writes (experiments/word_sort): written here, in this
# test's own folder (the session's cache_dir is another test's to fill)
PREPARED = {("task", "word_sort")}


@pytest.mark.slow  # ~40 s for all of them
@pytest.mark.parametrize("group,option", OPTIONS)
def test_every_option_plans_on_the_default(group, option, tmp_path, monkeypatch, capsys):
    import datasets

    real = datasets.load_dataset

    def no_hub(path, *a, **k):  # fail at once where a hub would be asked (no network here)
        if not str(path).startswith(("/", ".")) and path not in ("json", "parquet", "csv"):
            raise ConnectionError(f"Couldn't reach '{path}' on the Hub")
        return real(path, *a, **k)

    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    monkeypatch.setattr(rft.data.tasks, "_hub_cached", lambda path: False)  # whatever this machine downloaded
    monkeypatch.setattr(rft.data.tasks, "_hub_unreachable", lambda path: None)  # ask load_dataset, patched above
    extra = []
    if (group, option) in PREPARED:
        from experiments.word_sort.prepare import write_data

        data = write_data(tmp_path / "data")
        extra = [f"buffer.explorer_input.taskset.path={data}", f"buffer.explorer_input.eval_tasksets.0.path={data}"]
    cfg = compose_cfg([f"{group}={option}", "dry_run=true", f"checkpoint_root_dir={tmp_path}", *extra])
    if (group, option) in NEEDS_HUB:
        with pytest.raises(rft.runtime.main.ConfigError, match="there is no such local file or directory .*, and loading "
                                                       "it as a Hugging Face dataset id failed"):
            rft.runtime.main._main(cfg)
        return
    if (group, option) in NEEDS_LOCAL:
        with pytest.raises(rft.runtime.main.ConfigError, match=r"\.path='.*': no such file or directory"):
            rft.runtime.main._main(cfg)
        return
    if (group, option) in NEEDS_TEACHER:
        with pytest.raises(rft.runtime.main.ConfigError, match="distils from a teacher, but "
                                                               "algorithm.teacher_model_path is not set"):
            rft.runtime.main._main(cfg)
        return
    assert rft.runtime.main._main(cfg) is None
    out = capsys.readouterr().out
    assert "batch plan: stage" in out and "outputs        " in out


# the default study on a budget: 2 warm-up steps, then 2 GRPO steps (every algorithm on it:
# tests/test_algorithm_configs.py)
BUDGET = ["stages.0.buffer.total_steps=2", "stages.0.algorithm.optimizer.warmup_steps=0", "buffer.total_steps=2",
          "buffer.batch_size=4", "algorithm.repeat_times=2", "explorer.eval_interval=2", "monitor=console"]


@pytest.mark.slow
@pytest.mark.parametrize("sync", sorted(p.stem for p in (CONF / "sync").glob("*.yaml")))
def test_every_sync_method_trains_on_the_default_study(sync, tmp_path):
    # collective broadcasts between processes: through Ray (cluster=local, the default); the
    # others in this process
    where = [] if sync == "collective" else ["cluster=inline"]
    cfg = compose_cfg([f"sync={sync}", *BUDGET, *where, f"checkpoint_root_dir={tmp_path}"])
    rft.runtime.main.main(cfg)
    steps = read_metrics(tmp_path / "rft" / cfg.name / "grpo" / "metrics.jsonl")
    assert [m["sync/version"] for m in steps[1:]] == [1, 2]
    # mode=train (the warm-up) evaluates through the same sync method
    warm = read_metrics(tmp_path / "rft" / cfg.name / "sft_warmup" / "metrics.jsonl")
    assert warm[-1]["sync/version"] == 2 and "eval/accuracy" in warm[-1]
