"""A new user's study from the README alone (experiments/dpo_then_grpo/): DPO on the study's own
preference pairs, GRPO from its model, the export used outside rft. Each test is a defect that
study met, or a promise it checked."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from rft.models import build_tiny_model, ensure_model


def _trained_copy(tmp_path: Path) -> Path:
    """A checkpoint's hf/ as the trainer leaves it: the tiny model's files, other weights, no
    manifest of its own (the checkpoint's manifest.json, one level up, lists them)."""
    built = build_tiny_model(tmp_path / "base")
    hf = tmp_path / "run" / "sft_warmup" / "checkpoints" / "step_800" / "hf"
    shutil.copytree(built, hf)
    (hf / "manifest.json").unlink()
    weights = load_file(hf / "model.safetensors")
    save_file({k: v + 1.0 for k, v in weights.items()}, hf / "model.safetensors")  # "trained"
    return hf


def test_model_tiny_started_from_a_checkpoint_keeps_its_weights(tmp_path, capsys):
    # `python run.py model.model_path=<run>/<stage>/checkpoints/step_N/hf` keeps model=tiny's
    # `builder: tiny`. The builder took the folder for an older build of its own, moved the trained
    # weights to hf.damaged-<time> and wrote a random tiny model in their place: the run trained
    # from random weights, exit 0, and the checkpoint no longer matched its manifest.
    hf = _trained_copy(tmp_path)
    before = load_file(hf / "model.safetensors")
    ensure_model(OmegaConf.create({"builder": "tiny", "model_path": str(hf), "extra_tokens": []}))
    after = load_file(hf / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert sorted(p.name for p in hf.parent.iterdir()) == ["hf"]  # nothing moved aside, no lock left
    assert "damaged" not in capsys.readouterr().err
