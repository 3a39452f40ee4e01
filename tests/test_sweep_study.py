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
