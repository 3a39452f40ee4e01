"""Faults in what one stage hands the next: the stage cache must not copy a stage that read another
model than this run's (a reward model of an earlier stage, stage:<title>; a teacher or a reward
model given by directory), as if it were the same stage."""

import pytest
from conftest import compose_cfg
from omegaconf import OmegaConf, open_dict

from rft.plan.batch import make_plan, stage_configs
from rft.runtime import main


def _keys(*overrides, teacher: str | None = None):
    """The stage-cache keys of rm_pipeline (SFT -> RM -> GRPO on its scores) with a fourth stage
    after the GRPO stage, so that the GRPO stage is one another starts from (cached)."""
    cfg = compose_cfg(["experiment=rm_pipeline", *overrides])
    with open_dict(cfg):
        cfg.stages.append(OmegaConf.create({"stage_name": "final"}))
        if teacher:  # the GRPO stage mixes in a teacher's grade (algorithm.distill_coef)
            cfg.stages[2].algorithm.update({"distill_coef": 0.5, "teacher_model_path": teacher})
    stages = stage_configs(cfg)
    return main.cache_keys(stages, [make_plan(s, 2000) for s in stages])


@pytest.mark.slow  # 1.5 s alone, over the fast tier's second
def test_a_stage_reading_a_reward_model_of_the_run_is_cached_by_that_reward_model(tmp_path):
    """Two runs whose reward-model stages differ (its learning rate) trained their GRPO stages on
    different reward models: the second copied the first's GRPO stage from the stage cache ("reused:
    the same stage"), the key holding stage:rm as a name only."""
    sft, rm, grpo, final = _keys()
    other = _keys("stages.1.algorithm.optimizer.lr=5e-2")
    assert other[0] == sft  # the warm-up, the same in both, is still shared
    assert other[1] != rm  # another reward model ...
    assert other[2] != grpo and other[3] != final  # ... so another GRPO stage, and what starts from it
    assert _keys() == [sft, rm, grpo, final]  # the same config: the same keys (found again)


def test_a_teacher_changed_in_place_changes_the_key(tmp_path):
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "model.safetensors").write_bytes(b"1" * 10)
    before = _keys(teacher=str(teacher))
    (teacher / "model.safetensors").write_bytes(b"2" * 20)  # trained again at the same path
    after = _keys(teacher=str(teacher))
    assert after[:2] == before[:2] and after[2] != before[2]
