"""A new user's study from the README alone (experiments/dpo_then_grpo/): DPO on the study's own
preference pairs, GRPO from its model, the export used outside rft. Each test is a defect that
study met, or a promise it checked."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from rft.models import build_tiny_model, ensure_model
from rft.reporting.monitor import read_metrics
from conftest import ROOT, load_script
from resume_support import kill_when, run_to_end


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


STUDY = ROOT / "experiments" / "dpo_then_grpo"


def _study_data(tmp_path: Path) -> Path:
    """The study's data (make_data.py's rows), cut to 64 training and 16 test rows."""
    data = tmp_path / "data"
    load_script("experiments/dpo_then_grpo/make_data.py", "make_data").main(str(data))
    for name, n in (("train.jsonl", 64), ("test.jsonl", 16)):
        lines = (data / name).read_text().splitlines(keepends=True)
        (data / name).write_text("".join(lines[:n]))
    return data


def _study_args(data: Path, name: str) -> list[str]:
    """The study's command (its README), shortened: 4 warm-up, 2 DPO and 4 GRPO steps."""
    return [f"hydra.searchpath=[file://{STUDY / 'conf'}]", "experiment=dpo_then_grpo", f"name={name}",
            "cluster=inline", "monitor=console", "stage_cache_dir=null", "trainer.save_interval=2",
            f"buffer.explorer_input.taskset.path={data}", f"buffer.explorer_input.eval_tasksets.0.path={data}",
            "stages.0.buffer.total_steps=4", "stages.0.algorithm.optimizer.warmup_steps=1", "stages.1.buffer.total_steps=2", "buffer.total_steps=4",
            "buffer.batch_size=4", "algorithm.repeat_times=4"]


@pytest.mark.slow
def test_study_stages_say_what_they_start_from_and_a_kill_in_grpo_resumes_there(tmp_path):
    data, env = _study_data(tmp_path), {**os.environ, "RFT_CHECKPOINT_ROOT_DIR": str(tmp_path / "out")}
    # each command a run.py process forked from one that imported torch (resume_support: the same
    # command, output and files without a fresh interpreter's imports, ~4 s a run)
    straight = run_to_end(_study_args(data, "straight"), env, tmp_path / "straight_run")
    assert straight.returncode == 0, straight.stderr[-3000:]
    run = tmp_path / "out" / "rft" / "straight"
    # each later stage names the model it starts from (its config.yaml's model.model_path is the
    # run's first model): the warm-up's last checkpoint for DPO, DPO's for GRPO
    assert f"[dpo] starts from sft_warmup's final model: {run}/sft_warmup/checkpoints/step_4/hf" in straight.stdout
    assert f"[grpo] starts from dpo's final model: {run}/dpo/checkpoints/step_2/hf" in straight.stdout
    assert "[sft_warmup] starts from" not in straight.stdout
    # the DPO stage read the study's own columns: each step's pairs are `good` over `bad`
    dpo = read_metrics(run / "dpo" / "metrics.jsonl")
    assert [m["train/experiences"] for m in dpo if m["step"] > 0] == [64, 64]  # 32 pairs a step, 2 rows each
    assert all(0 <= m["dpo/accuracy"] <= 1 for m in dpo if m["step"] > 0)

    killed = tmp_path / "out" / "rft" / "killed"
    kill_when(_study_args(data, "killed"), env, lambda: (killed / "grpo" / "checkpoints" / "step_2" / "state.json").exists(),
              tmp_path / "killed_run")
    resumed = run_to_end(_study_args(data, "killed"), env, tmp_path / "resumed_run")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # the finished stages are not trained again; GRPO goes on from its step-2 checkpoint
    assert "[sft_warmup] already finished (step 4)" in resumed.stdout
    assert "[dpo] already finished (step 2)" in resumed.stdout
    assert f"[grpo] resuming from step 2 ({killed}/grpo/checkpoints/step_2)" in resumed.stdout
    # and ends where the uninterrupted run did: the same batches, the same final weights
    assert read_metrics(killed / "grpo" / "batches.jsonl") == read_metrics(run / "grpo" / "batches.jsonl")
    a = load_file(run / "grpo" / "checkpoints" / "step_4" / "hf" / "model.safetensors")
    b = load_file(killed / "grpo" / "checkpoints" / "step_4" / "hf" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_export_of_a_step_that_is_not_there_names_the_checkpoints_that_are(tmp_path):
    # `python -m rft.runtime.export <stage>/checkpoints/step_70 out/` where the stage saved steps 30
    # and 60: the paragraph said step_70 "is not a checkpoint ... (one without it is a save that did
    # not finish)", as if a save had been cut, and named none the user could export
    from rft.errors import ConfigError
    from rft.runtime.export import export

    stage = tmp_path / "run" / "grpo"
    for step in (30, 60):
        (stage / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (stage / "checkpoints" / f"step_{step}" / "manifest.json").write_text("{}")
    (stage / "checkpoints" / "step_90.tmp").mkdir()  # a save that did not finish: not offered
    ckpts = stage / "checkpoints"
    for given in (ckpts / "step_70", stage, ckpts / "step_60" / "hf"):
        with pytest.raises(ConfigError) as e:
            export(given, tmp_path / "out")
        assert str(e.value).endswith(f"The checkpoints there: {ckpts / 'step_30'}, {ckpts / 'step_60'}.")
    with pytest.raises(ConfigError) as e:
        export(ckpts / "step_70", tmp_path / "out")
    assert str(e.value).startswith(f"{ckpts / 'step_70'} does not exist: a checkpoint is a directory ")
    assert not (tmp_path / "out").exists()


def test_a_dpo_stage_without_storage_type_file_is_told_that_not_that_its_path_is_unset():
    # a DPO stage written from the README's "the file's keys" without dpo.yaml's `buffer: file`
    # (the run's buffer is the queue): the paragraph said experience_buffer.path "is not set",
    # while it was set (to the taskset's file), sending the user after the wrong key
    from conftest import compose_cfg

    from rft.errors import ConfigError
    from rft.runtime.main import dataset_size

    cfg = compose_cfg(["algorithm=dpo", "stages=[]", "buffer.trainer_input.experience_buffer.storage_type=queue"])
    with pytest.raises(ConfigError) as e:
        dataset_size(cfg)
    path = cfg.buffer.trainer_input.experience_buffer.path
    assert str(e.value) == (
        f"mode=train reads a dataset or a stored buffer, but buffer.trainer_input.experience_buffer.storage_type=queue "
        f"(in memory, empty when the stage starts), so its path={path!r} is not read. Set "
        f"buffer.trainer_input.experience_buffer.storage_type=file for a dataset (algorithm=sft and dpo set it), or "
        f"sql for the buffer.db a mode=explore run wrote.")


@pytest.mark.parametrize("text", ["", "\n\n", " \n\t\n"])
def test_a_preference_file_of_blank_lines_is_empty_as_an_empty_one_is(tmp_path, text):
    # a data script that wrote a newline per row and no JSON: the dry run printed datasets' own
    # 'split='train': Instruction "train" corresponds to no data!', where an empty file is named
    from rft.data.tasks import load_rows
    from rft.errors import ConfigError

    f = tmp_path / "prefs.jsonl"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_rows(str(f), "train", key="buffer.trainer_input.experience_buffer.path")
    assert str(e.value) == f"buffer.trainer_input.experience_buffer.path={str(f)!r} is empty: it holds no rows."


@pytest.mark.parametrize("given", ["step_50/hf", "step_50"])
def test_model_tiny_started_from_a_checkpoint_that_is_not_there_is_refused(tmp_path, given):
    # a mistyped step (step_50 where the stage saved 30 and 40): model=tiny's builder wrote a random
    # model at <stage>/checkpoints/step_50/hf, the run trained from it (eval 0.000, exit 0), and the
    # stage's checkpoints gained a step_50 that no save wrote
    from rft.errors import ConfigError

    ckpts = tmp_path / "run" / "dpo" / "checkpoints"
    for step in (30, 40):
        (ckpts / f"step_{step}" / "hf").mkdir(parents=True)
        (ckpts / f"step_{step}" / "manifest.json").write_text("{}")
    with pytest.raises(ConfigError) as e:
        ensure_model(OmegaConf.create({"builder": "tiny", "model_path": str(ckpts / given), "extra_tokens": []}))
    assert str(e.value) == (
        f"model.model_path={str(ckpts / given)!r} does not exist: {ckpts} has no step_50. The checkpoints there: "
        f"step_30, step_40; start from one's hf/ ({ckpts / 'step_40' / 'hf'}). model.builder=tiny builds a random "
        f"model only where there is none yet, never in a run's checkpoints.")
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_30", "step_40"]


@pytest.mark.parametrize("builder", ["tiny", None])
def test_a_checkpoint_given_as_the_model_is_told_to_give_its_hf_folder(tmp_path, builder):
    # model.model_path=<stage>/checkpoints/step_40 (not .../hf): with the tiny builder the dry run passed and
    # the run failed on the tokenizer, naming neither; without one it said 'no config.json (it holds hf)'
    from conftest import compose_cfg

    from rft.errors import ConfigError
    from rft.plan.batch import check_config

    step = tmp_path / "run" / "dpo" / "checkpoints" / "step_40"
    (step / "hf").mkdir(parents=True)
    (step / "hf" / "config.json").write_text("{}")
    cfg = compose_cfg(["stages=[]", f"model.model_path={step}", f"model.builder={builder or 'null'}"])
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    assert str(e.value) == (f"model.model_path={str(step)!r} is a run's checkpoint, not a model: its model is in its "
                            f"hf/ folder. Give model.model_path={str(step / 'hf')!r}.")
    (step / "config.json").write_text("{}")  # a model's own folder that happens to be called step_40: not refused
    check_config(compose_cfg(["stages=[]", f"model.model_path={step}", "model.builder=null"]))


def test_a_tiny_build_whose_manifest_is_damaged_is_still_built_again(tmp_path, capsys):
    # not_built_here (above) starts from a folder no builder made as it is; a build of the tiny model whose
    # manifest.json was cut could be read as one (no 'built' identity), trained from unverified weights
    from rft import manifest

    path = build_tiny_model(tmp_path / "tiny")
    (path / "model.safetensors").write_bytes(b"\0" * 64)  # its weights damaged too
    (path / "manifest.json").write_text('{"format": ')
    ensure_model(OmegaConf.create({"builder": "tiny", "model_path": str(path), "extra_tokens": []}))
    assert manifest.verify(path) is None  # built again, whole
    (aside,) = tmp_path.glob("tiny.damaged-*")
    assert (aside / "manifest.json").read_text() == '{"format": '
    assert "is damaged" in capsys.readouterr().err
