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


# ---------------------------------------------------------------- the studio's stop of a Ray run

@pytest.mark.slow  # processes started and signalled (~1 s)
def test_the_studios_stop_leaves_rays_processes_to_the_runs_driver(tmp_path):
    """The studio's stop sent SIGTERM to the launch's whole process group, a Ray instance's GCS and
    raylet with it: the run's ray.shutdown then waited ~8 s on the dead GCS (a Ray run stopped from the
    page ended 10.0 s after the signal, 2.8 s when the driver alone had it; tests/test_review8.py
    runs one). A group as a run's: the driver, a Ray worker (renamed ray::...) and what it started, a
    Ray service naming its session's folder, and a process of the run's own (a sandboxed tool)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from rft.studio.launch import _terminate

    # the service's session folder comes in the environment: the driver's own command line names none
    script = f"""
import os, subprocess, sys, time
sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
procs = [subprocess.Popen(["bash", "-c", "exec -a ray::IDLE bash -c 'sleep 60 & wait'"]),
         subprocess.Popen([*sleep, os.environ["SESSION_LOGS"]]),
         subprocess.Popen(sleep)]
open({str(tmp_path / 'pids')!r}, "w").write(" ".join(str(p.pid) for p in procs))
time.sleep(60)
"""
    env = {**os.environ, "SESSION_LOGS": "--log_dir=/tmp/ray/session_2026-11-29_19-35-24_481651_5244/logs"}
    driver = subprocess.Popen([sys.executable, "-c", script], start_new_session=True, env=env)
    try:
        while not (tmp_path / "pids").exists() or len((tmp_path / "pids").read_text().split()) < 3:
            time.sleep(0.05)
        worker, service, own = map(int, (tmp_path / "pids").read_text().split())
        time.sleep(0.5)  # the worker's child started, its name set
        worker_child = [int(p) for p in open(f"/proc/{worker}/task/{worker}/children").read().split()]
        assert len(worker_child) == 1
        _terminate(driver.pid)
        assert driver.wait(timeout=10) == -signal.SIGTERM
        deadline = time.time() + 10
        while _alive(own) and time.time() < deadline:
            time.sleep(0.05)
        assert not _alive(own)
        assert all(_alive(p) for p in (worker, service, *worker_child))
    finally:
        os.killpg(driver.pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Running, not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# ---------------------------------------------------------------- resuming after an update of rft that added keys

def _as_an_older_rft(monkeypatch):
    """rft as it was before explorer.bench_on_starting_model and an eval set's pass_threshold were
    keys: its records (a stage's config.yaml, the config fingerprint of its checkpoints) lack them."""
    import copy

    from omegaconf import OmegaConf

    import rft.runtime.rundir as rundir

    def older(cfg, resolve=True) -> dict:
        tree = copy.deepcopy(cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=resolve,
                                                                                     enum_to_str=True))
        if "explorer" in tree:  # a run's config, not Hydra's own (hydra.yaml)
            tree["explorer"].pop("bench_on_starting_model")
            for ts in tree["buffer"]["explorer_input"]["eval_tasksets"]:
                ts.pop("pass_threshold")
        return tree

    flat, config_yaml = rundir.flat, rundir.config_yaml
    monkeypatch.setattr(rundir, "flat", lambda cfg: flat(older(cfg)))
    monkeypatch.setattr(rundir, "config_yaml", lambda cfg, resolve=False: config_yaml(older(cfg, resolve)))


@pytest.mark.slow  # three short runs of the tiny model in this process (~20 s)
def test_a_run_resumes_after_an_update_that_added_keys_at_their_defaults(tmp_path, monkeypatch, capsys):
    """A run made before rft added a key (40b750b's explorer.bench_on_starting_model, found by a new
    user whose run spanned that commit): the same command refused to resume it ("the run directory
    ... holds a run made with another configuration (stage grpo: explorer.bench_on_starting_model:
    '(absent)' -> False)") unless resume_with_changes=true. A key new since, at its default, is no
    change; set to another value it still is one."""
    base = ["stages=[]", "cluster=inline", "monitor=console", "name=upgraded", f"checkpoint_root_dir={tmp_path}",
            "trainer.save_interval=1", "explorer.eval_interval=1000"]
    with monkeypatch.context() as m:
        _as_an_older_rft(m)
        rft.runtime.main.main(compose_cfg([*base, "buffer.total_steps=2"]))
    run = tmp_path / "rft" / "upgraded"
    assert "bench_on_starting_model" not in (run / "config.yaml").read_text()
    capsys.readouterr()
    rft.runtime.main.main(compose_cfg([*base, "buffer.total_steps=3"]))  # refused before
    steps = [m["step"] for m in read_metrics(run / "metrics.jsonl")]
    assert steps == [0, 1, 2, 3], steps  # step 3 trained from step 2's checkpoint, nothing again
    # named by the eval set's key (the refusal showed both eval set lists whole, ~900 characters)
    with pytest.raises(ConfigError, match=r"holds a run made with another configuration \(stage grpo: "
                                          r"buffer\.explorer_input\.eval_tasksets\.0\.pass_threshold: 1\.0 -> 0\.5\)\. "):
        rft.runtime.main._main(compose_cfg([*base, "buffer.total_steps=4",
                                            "buffer.explorer_input.eval_tasksets.0.pass_threshold=0.5"]))
