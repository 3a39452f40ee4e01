"""A new user's study from the README alone (experiments/lora_sweep/): LoRA against full
fine-tuning on the tiny model, a task of the study's own (reverse a three-letter word), swept on
Slurm, the best adapter used outside rft. Each test is a defect that study met, or a promise it
checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import ROOT, compose_cfg, load_script
from rft.errors import ConfigError
from rft.plan.batch import describe, make_plan, stage_configs

STUDY = ROOT / "experiments" / "lora_sweep"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """The tiny model's files (its weights are what the plan reads module names from)."""
    from rft.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _plan(*overrides):
    cfg = stage_configs(compose_cfg(["stages=[]", *overrides]))[0]
    return cfg, make_plan(cfg, 2000)


def _plan_error(*overrides) -> str:
    with pytest.raises(ConfigError) as e:
        _plan(*overrides)
    return str(e.value)


def test_a_target_module_the_model_lacks_stops_the_dry_run(tiny):
    # `model.lora.target_modules=[qkv_proj]` (a fused name of other architectures) passed the dry run,
    # whose checkpoint row then read "trainer state 0.0 MB", and a Slurm sweep queued every job, each
    # failing as its trainer was built. A list naming one module right and one wrong ([q_proj, v_prj])
    # ran with q_proj alone adapted: PEFT skips a name that matches nothing while another matches.
    # The plan now reads the module names from the model's safetensors headers (the tiny model's:
    # q/k/v/o_proj, gate/up/down_proj; embed_tokens) and names each one that matches none.
    at = f"model.model_path={tiny}"
    linear = "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"
    assert _plan_error(at, "model.lora.rank=4", "model.lora.target_modules=[qkv_proj]") == (
        f"model.lora.target_modules: 'qkv_proj' names no module of the model at model.model_path (its linear "
        f"layers: {linear}). PEFT matches a name against the end of each module's full name "
        f"(down_proj: model.layers.0.mlp.down_proj); give those names, or all-linear.")
    assert "'v_prj' names no module" in _plan_error(at, "model.lora.rank=4",
                                                    "model.lora.target_modules=[q_proj,v_prj]")
    # full names and suffixes of them match, as PEFT matches them
    _plan(at, "model.lora.rank=4", "model.lora.target_modules=[self_attn.q_proj,model.layers.1.mlp.up_proj]")
