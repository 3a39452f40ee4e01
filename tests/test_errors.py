"""User mistakes end in one clear paragraph, a non-zero exit, and nothing started."""

import json
import re

import pytest

import rft.main
from conftest import compose_cfg, run_cli


@pytest.fixture
def run_root(tmp_path):
    return {"RFT_CHECKPOINT_ROOT_DIR": str(tmp_path / "ck"), "RFT_CACHE_DIR": str(tmp_path / "cache")}


def assert_nothing_started(env):
    from pathlib import Path

    # no model built, no checkpoint written
    assert not (Path(env["RFT_CACHE_DIR"]) / "models").exists()
    assert not list(Path(env["RFT_CHECKPOINT_ROOT_DIR"]).rglob("checkpoints"))


def test_misspelt_key(run_root):
    r = run_cli("algorithm.repeat_time=4", env=run_root)
    assert r.returncode != 0
    assert "Could not override 'algorithm.repeat_time'" in r.stderr
    assert "Key 'repeat_time' not in 'AlgorithmConfig'" in r.stderr
    assert "Traceback" not in r.stderr
    assert_nothing_started(run_root)


def test_wrong_type(run_root):
    r = run_cli("buffer.batch_size=lots", env=run_root)
    assert r.returncode != 0
    assert "Value 'lots' of type 'str' could not be converted to Integer" in r.stderr
    assert_nothing_started(run_root)


def test_non_divisible_batch(run_root):
    r = run_cli("trainer.mini_batch_size=48", env=run_root)
    assert r.returncode == 2
    # the override applies to both stages; the first stage (64 experiences per step) fails first
    assert (
        "rft: configuration error: stage sft_warmup: trainer.mini_batch_size=48 must divide "
        "buffer.train_batch_size=64 (experiences per step) into whole optimizer steps."
    ) in r.stderr
    assert "Traceback" not in r.stderr
    assert_nothing_started(run_root)


def test_missing_dataset_file(run_root, tmp_path):
    missing = tmp_path / "nowhere" / "train.jsonl"
    r = run_cli("buffer.explorer_input.generator=null", f"buffer.explorer_input.taskset.path={missing}",
                "stages=[]", env=run_root)
    assert r.returncode == 2
    assert f"buffer.explorer_input.taskset.path='{missing}': no such file or directory." in r.stderr
    assert "Traceback" not in r.stderr
    assert_nothing_started(run_root)


def test_row_without_prompt_key(run_root, tmp_path):
    data = tmp_path / "tasks.jsonl"
    rows = [{"question": "1+1", "answer": "2"}, {"question": "2+2", "answer": "4"}, {"prompt": "3+3", "answer": "6"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = run_cli("buffer.explorer_input.generator=null", f"buffer.explorer_input.taskset.path={data}",
                "buffer.batch_size=1", "stages=[]", env=run_root)
    assert r.returncode == 2
    assert (
        f"buffer.explorer_input.taskset: row 2 (line 3 of its JSONL file) of '{data}' has no 'question' "
        f"(format.prompt_key); its keys are ['answer', 'prompt']."
    ) in r.stderr
    assert "Traceback" not in r.stderr
    assert_nothing_started(run_root)


def test_dry_run_prints_the_plan_and_starts_nothing(run_root):
    r = run_cli("dry_run=true", env=run_root)
    assert r.returncode == 0, r.stderr
    assert "batch plan: stage sft_warmup (sft)" in r.stdout
    assert "batch plan: stage grpo (grpo)" in r.stdout
    assert re.search(r"experiences per step +128  buffer.train_batch_size", r.stdout)
    assert_nothing_started(run_root)


def test_dry_run_never_touches_ray_or_a_model(monkeypatch):
    """In-process: dry_run returns before any model load or Ray start (both would raise here)."""
    import ray

    import rft.models

    def boom(*a, **k):
        raise AssertionError("dry_run must not start this")

    monkeypatch.setattr(ray, "init", boom)
    monkeypatch.setattr(rft.models, "load_model", boom)
    monkeypatch.setattr(rft.models, "ensure_model", boom)
    assert rft.main.main(compose_cfg(["dry_run=true"])) is None
