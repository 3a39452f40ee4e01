"""Leftovers of earlier reviews: each test is a defect or a gap found and left then, shown fixed."""

import csv

import pytest
from conftest import compose_cfg

import rft.runtime.main
from rft.errors import ConfigError
from rft.reporting.monitor import read_metrics

# ---------------------------------------------------------------- an eval-only run of the starting model


def test_a_bench_with_no_checkpoints_says_how_to_evaluate_the_starting_model_alone(tmp_path):
    """There was no eval-only run of a model (verl's trainer.val_only): mode=bench refused a run
    without checkpoints, and its paragraph named no way to score the starting model alone."""
    cfg = compose_cfg(["mode=bench", "stages=[]", "name=nothing_yet", f"checkpoint_root_dir={tmp_path}",
                       "model.model_path=/models/base", "model.builder=null"])
    with pytest.raises(ConfigError) as e:
        rft.runtime.main._main(cfg)
    assert str(e.value) == (
        f"mode=bench found no checkpoints under {tmp_path / 'rft' / 'nothing_yet'}. Give the trained run's name "
        f"(name=...) and the same project and checkpoint_root_dir; or, to evaluate the starting model alone "
        f"(model.model_path=/models/base), add explorer.bench_on_starting_model=true.")


def test_the_starting_model_alone_and_the_newest_checkpoint_alone_are_not_asked_together(tmp_path):
    cfg = compose_cfg(["mode=bench", "stages=[]", "name=x", f"checkpoint_root_dir={tmp_path}",
                       "explorer.bench_on_starting_model=true", "explorer.bench_on_latest_checkpoint=true"])
    with pytest.raises(ConfigError, match=r"^explorer\.bench_on_starting_model=true evaluates the starting model alone, "
                                          r"and explorer\.bench_on_latest_checkpoint=true the newest checkpoint alone: "
                                          r"set one of them\.$"):
        rft.runtime.main._main(cfg)


@pytest.mark.slow  # the session's warm start (shared), then one eval of 200 problems in this process
def test_the_starting_model_alone_scores_as_the_runs_own_step_0_eval_and_a_trained_runs_table_is_kept(
        warm_start, tmp_path, capsys):
    """The warm start's run (the default, its GRPO stage one step) evaluated the warm-up's final
    model at its step 0; a bench of that model alone, greedy, on the same eval set, scores the same.
    Over the trained run's own outputs it is refused: its bench table would lose every checkpoint's row."""
    run_dir = warm_start.parents[3]
    step0 = [m["eval/accuracy"] for m in read_metrics(run_dir / "grpo" / "metrics.jsonl") if m["step"] == 0]
    cfg = compose_cfg(["mode=bench", "stages=[]", "name=base_eval", f"checkpoint_root_dir={tmp_path}",
                       f"model.model_path={warm_start}", "model.builder=null", "explorer.bench_on_starting_model=true"])
    got = rft.runtime.main._main(cfg)
    out = capsys.readouterr().out
    assert f"[bench] evaluating the starting model alone (explorer.bench_on_starting_model): {warm_start}" in out
    with open(tmp_path / "rft" / "base_eval" / "bench" / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["stage"], r["step"], r["checkpoint"]) for r in rows] == [("start", "0", str(warm_start))]
    assert len(step0) == 1 and got == pytest.approx(step0[0]) and 0 < got < 1
    # the trained run: its sft_warmup stage holds step_400's checkpoint
    cfg = compose_cfg(["mode=bench", f"name={run_dir.name}", f"checkpoint_root_dir={run_dir.parents[1]}",
                       "explorer.bench_on_starting_model=true"])
    with pytest.raises(ConfigError, match=rf"^explorer\.bench_on_starting_model=true, but {run_dir} holds a trained run "
                                          r"\(\d+ checkpoints\): its bench table would be overwritten"):
        rft.runtime.main._main(cfg)
    assert not (run_dir / "bench").exists()


def test_verls_val_only_names_the_eval_only_bench():
    from omegaconf import OmegaConf

    from rft.config import Config, key_mistake

    assert key_mistake(OmegaConf.structured(Config), "trainer.val_only") == (
        "that is verl's key, not rft's; rft's is explorer.bench_on_starting_model. It is a mode=bench run's, with a "
        "name of its own: python run.py mode=bench explorer.bench_on_starting_model=true name=base_eval (the table "
        "in <run>/bench/results.md).")
