"""Every option of every config group works on the embedded default with only that override:
each plans (dry run), and each algorithm and sync method trains a few steps of the default study."""

import math

import pytest

import rft.main
from conftest import CONF, compose_cfg
from rft.monitor import read_metrics

GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name not in ("hydra", "experiment"))
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]
# options whose data or model only a hub has: on a machine without it, a clear error
NEEDS_HUB = {("task", "gsm8k")}


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
    cfg = compose_cfg([f"{group}={option}", "dry_run=true", f"checkpoint_root_dir={tmp_path}"])
    if (group, option) in NEEDS_HUB:
        with pytest.raises(rft.main.ConfigError, match="there is no such local file or directory .*, and loading "
                                                       "it as a Hugging Face dataset id failed"):
            rft.main._main(cfg)
        return
    assert rft.main._main(cfg) is None
    out = capsys.readouterr().out
    assert "batch plan: stage" in out and "outputs        " in out


# the default study on a budget: 2 warm-up steps, then 2 steps of the algorithm
BUDGET = ["stages.0.buffer.total_steps=2", "stages.0.algorithm.optimizer.warmup_steps=0", "buffer.total_steps=2",
          "buffer.batch_size=4", "algorithm.repeat_times=2", "explorer.eval_interval=2", "monitor=console"]


def algorithms():
    return sorted(p.stem for p in (CONF / "algorithm").glob("*.yaml"))


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", algorithms())
def test_every_algorithm_trains_on_the_default_study(algorithm, tmp_path):
    cfg = compose_cfg([f"algorithm={algorithm}", *BUDGET, "cluster=inline", f"checkpoint_root_dir={tmp_path}"])
    rft.main.main(cfg)
    run = tmp_path / "rft" / cfg.name
    warm = read_metrics(run / "sft_warmup" / "metrics.jsonl")
    steps = read_metrics(run / algorithm / "metrics.jsonl")
    assert [m["step"] for m in warm] == [0, 1, 2] and [m["step"] for m in steps] == [0, 1, 2]
    for m in steps[1:]:
        assert math.isfinite(m["loss/policy"]) and math.isfinite(m["actor/grad_norm"])
        # two warm-up steps leave the model answering nothing right: RL gets no signal, but the
        # supervised algorithms learn from their data
        if algorithm in ("sft", "dpo"):
            assert m["actor/grad_norm"] > 0 and m["loss/policy"] > 0
    assert "eval/accuracy" in steps[-1]


@pytest.mark.slow
@pytest.mark.parametrize("sync", sorted(p.stem for p in (CONF / "sync").glob("*.yaml")))
def test_every_sync_method_trains_on_the_default_study(sync, tmp_path):
    # through Ray (cluster=local, the default), as collective needs
    cfg = compose_cfg([f"sync={sync}", *BUDGET, f"checkpoint_root_dir={tmp_path}"])
    rft.main.main(cfg)
    steps = read_metrics(tmp_path / "rft" / cfg.name / "grpo" / "metrics.jsonl")
    assert [m["sync/version"] for m in steps[1:]] == [1, 2]
    # mode=train (the warm-up) evaluates through the same sync method
    warm = read_metrics(tmp_path / "rft" / cfg.name / "sft_warmup" / "metrics.jsonl")
    assert warm[-1]["sync/version"] == 2 and "eval/accuracy" in warm[-1]
