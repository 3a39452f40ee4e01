"""A study that compares algorithms on the tiny default with a sweep (`python run.py -m
algorithm=grpo,dr_grpo,dapo seed=1,2,3`), then reads it with the report: what each arm trains,
what the sweep checks before its first job, and what the report counts."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import CONF, compose_cfg

# the algorithms that train online after model=tiny's SFT warm-up (sft, dpo and rm are offline
# stages of their own: mode=train)
ONLINE = sorted(p.stem for p in (CONF / "algorithm").glob("*.yaml")
                if "mode: train" not in p.read_text())


def _warmup(algorithm: str):
    from rft.plan.batch import stage_configs

    return stage_configs(compose_cfg([f"algorithm={algorithm}"]))[0]


@pytest.mark.slow
def test_every_arm_of_an_algorithm_sweep_starts_from_the_same_warm_up():
    """The warm-up inherits the global algorithm section: algorithm=dr_grpo's loss_agg_mode
    (seq-mean-token-sum-norm) trained the SFT warm-up with another loss, so its arm started RL from
    another model (seed 1: eval 0.205 where grpo's warm-up ended at 0.120), and dapo's clip and
    shaping keys, which SFT never reads, gave its warm-up another stage-cache key: a 3-arm x 3-seed
    sweep trained 9 warm-ups, not 3. Every online algorithm's warm-up is now grpo's, key for key."""
    from rft.runtime.rundir import identity

    assert {"grpo", "dr_grpo", "dapo", "gspo", "ppo", "opmd", "mix", "opd"} <= set(ONLINE)
    grpo = identity(_warmup("grpo"))
    assert grpo["algorithm.loss_agg_mode"] == "token-mean"
    for name in ONLINE:
        other = identity(_warmup(name))
        assert {k: (grpo.get(k), v) for k, v in other.items() if grpo.get(k) != v} == {}, name


def _planned(overrides: list[str], swept: list[str]) -> str | None:
    """plan_jobs's message for `python run.py -m <overrides> <swept>`."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import read_write

    from rft.runtime.callbacks import plan_jobs

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["stages=[]", *overrides], return_hydra_config=True)
        with read_write(cfg.hydra.overrides.task):
            cfg.hydra.overrides.task.extend(swept)
        try:
            return plan_jobs(cfg, "config")
        finally:
            GlobalHydra.instance().clear()


@pytest.mark.slow  # three sweeps of two jobs planned (~3 s)
def test_a_sweep_whose_jobs_share_a_directory_stops_before_the_first_job():
    """`-m seed=1,2 hydra.sweep.subdir=one`: job 0 trained in <sweep>/one, then job 1 stopped on its
    run directory ("holds a run made with another configuration (seed: 1 -> 2)"), advising
    name=... (which does not move a sweep's job) or continue_from_checkpoint=false (which would move
    job 0's results aside)."""
    said = _planned(["hydra.sweep.dir=/tmp/sw", "hydra.sweep.subdir=one"], ["seed=1,2"])
    assert said == (
        "jobs 0 and 1 of the sweep (seed=1; seed=2) would write to one directory, /tmp/sw/one "
        "(hydra.sweep.subdir=one): each job needs its own, or the second finds the first's run there. Leave "
        "hydra.sweep.subdir at its default, ${hydra.job.num}, or make it differ between the jobs (e.g. "
        "${hydra.job.override_dirname}). No job has started: every job is planned first.")
    # a subdir that names what is swept is one per job; the default is the job's number
    assert _planned(["hydra.sweep.dir=/tmp/sw", "hydra.sweep.subdir=s${seed}"], ["seed=1,2"]) is None
    assert _planned(["hydra.sweep.dir=/tmp/sw"], ["seed=1,2"]) is None
