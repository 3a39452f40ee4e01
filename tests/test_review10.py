"""A review of the model paths a run starts from and of the hints for misplaced algorithm args:
each test a case the fixes before it left open."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import compose_cfg
from omegaconf import OmegaConf

from rft.errors import ConfigError
from rft.models import build_tiny_model, ensure_model


def test_lr_given_as_an_arg_is_not_told_to_set_the_critics_learning_rate(tmp_path):
    # 'lr' is verl's name of the actor's learning rate (algorithm.optimizer.lr) and of its critic's
    # (algorithm.critic_lr); only the one in algorithm itself was named: a GRPO user who followed
    # 'Did you mean algorithm.critic_lr' set a key GRPO never reads, and trained at the old rate
    import rft.runtime.main

    with pytest.raises(ConfigError) as e:
        rft.runtime.main._main(compose_cfg(["stages=[]", "+algorithm.advantage_args.lr=1e-5", "dry_run=true",
                                            f"checkpoint_root_dir={tmp_path}"]))
    assert str(e.value) == ("algorithm.advantage_args has ['lr'], which algorithm.advantage_fn=grpo does not take; its "
                            "own arguments are [] (the rest of its settings are the algorithm.* keys it reads from "
                            "cfg).")


def test_names_of_one_meaning_still_get_their_hint():
    from rft.config import near_args

    # verl's clip_ratio is both clip bounds; TRL's num_generations the group size
    assert near_args(["clip_ratio"], [], section="algorithm").startswith(
        " Did you mean algorithm.clip_ratio_low and algorithm.clip_ratio_high (not clip_ratio)?")
    assert near_args(["num_generations"], [], section="algorithm").startswith(
        " Did you mean algorithm.repeat_times (not num_generations)?")


def _checkpoints(tmp_path: Path, with_hf: dict[int, bool]) -> Path:
    ckpts = tmp_path / "run" / "grpo" / "checkpoints"
    for step, hf in with_hf.items():
        (ckpts / f"step_{step}").mkdir(parents=True)
        (ckpts / f"step_{step}" / "manifest.json").write_text("{}")
        if hf:
            (ckpts / f"step_{step}" / "hf").mkdir()
    return ckpts


def test_a_checkpoint_without_its_model_is_not_said_to_be_missing(tmp_path):
    # step_40 is there, saved without hf/ (trainer.save_hf_checkpoint=last, a mode=explore stage):
    # the paragraph said 'has no step_40' and then offered step_40/hf, the path given, to start from
    ckpts = _checkpoints(tmp_path, {20: True, 40: False})
    given = ckpts / "step_40" / "hf"
    with pytest.raises(ConfigError) as e:
        ensure_model(OmegaConf.create({"builder": "tiny", "model_path": str(given), "extra_tokens": []}))
    assert str(e.value) == (
        f"model.model_path={str(given)!r} does not exist: {ckpts / 'step_40'} holds no hf/ (a checkpoint saved "
        f"without its model). The checkpoints there: step_20; start from one's hf/ ({ckpts / 'step_20' / 'hf'}). "
        f"model.builder=tiny builds a random model only where there is none yet, never in a run's checkpoints.")
    assert sorted(p.name for p in (ckpts / "step_40").iterdir()) == ["manifest.json"]  # nothing built there


def test_no_checkpoint_with_a_model_is_said_so(tmp_path):
    ckpts = _checkpoints(tmp_path, {40: False})
    with pytest.raises(ConfigError) as e:
        ensure_model(OmegaConf.create({"builder": "tiny", "model_path": str(ckpts / "step_50" / "hf"),
                                       "extra_tokens": []}))
    assert (f"{ckpts} has no step_50. It holds no complete checkpoint with a model (its hf/ beside a "
            f"manifest.json).") in str(e.value)


@pytest.mark.parametrize("builder", ["tiny", "null"])
def test_a_link_to_a_checkpoint_given_as_the_model_is_told_to_give_its_hf_folder(tmp_path, builder):
    # best -> <stage>/checkpoints/step_40: the check went by the name given, so a link passed it; with the
    # tiny builder the run then built a random model over the link or failed on the tokenizer
    from rft.plan.batch import check_config

    step = tmp_path / "run" / "grpo" / "checkpoints" / "step_40"
    (step / "hf").mkdir(parents=True)
    (step / "hf" / "config.json").write_text("{}")
    (tmp_path / "best").symlink_to(step)
    with pytest.raises(ConfigError) as e:
        check_config(compose_cfg(["stages=[]", f"model.model_path={tmp_path / 'best'}", f"model.builder={builder}"]))
    assert str(e.value) == (f"model.model_path={str(tmp_path / 'best')!r} is a run's checkpoint, not a model: its "
                            f"model is in its hf/ folder. Give model.model_path={str(tmp_path / 'best' / 'hf')!r}.")


def test_extra_tokens_a_started_from_model_lacks_are_refused(tmp_path):
    # model=tiny with model.model_path=<a checkpoint's hf/> is started from as it is (not built); its
    # tokenizer was the check of model.extra_tokens, skipped there: a token it lacks was spelt one
    # character a token, without a word
    built = build_tiny_model(tmp_path / "base")
    hf = tmp_path / "run" / "grpo" / "checkpoints" / "step_8" / "hf"
    shutil.copytree(built, hf)
    (hf / "manifest.json").unlink()  # as a checkpoint's hf/ is: its manifest is the checkpoint's
    with pytest.raises(ConfigError) as e:
        ensure_model(OmegaConf.create({"builder": "tiny", "model_path": str(hf), "extra_tokens": ["<convert>"]}))
    assert str(e.value) == (
        f"model.model_path={hf} holds a model rft did not build here (a checkpoint's hf/, an export) whose "
        f"tokenizer has not the model.extra_tokens ['<convert>']: they are added only when the tiny model is "
        f"built. Give model.extra_tokens as the run that trained it had them, or start from a model built with these.")
    ensure_model(OmegaConf.create({"builder": "tiny", "model_path": str(hf), "extra_tokens": ["system"]}))  # it has it
    assert sorted(p.name for p in hf.parent.iterdir()) == ["hf"]  # nothing moved aside or built


@pytest.mark.slow  # 1.4 s alone, over the fast tier's second
def test_a_hub_id_under_a_builder_is_refused_not_built_as_a_random_model(tmp_path, monkeypatch):
    # model.model_path=<hub id> keeping model=tiny's builder: the builder built a random tiny model in
    # ./Qwen/Qwen2.5-0.5B-Instruct and the run trained it, exit 0 (the dry run said nothing)
    from rft.plan.batch import check_config

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        check_config(compose_cfg(["stages=[]", "model.model_path=Qwen/Qwen2.5-0.5B-Instruct"]))
    assert str(e.value) == (
        "model.model_path='Qwen/Qwen2.5-0.5B-Instruct' reads as a hub id (org/name: there is no Qwen/ here), and "
        "model.builder=tiny builds a model of its own with random weights where model_path is not there yet: the run "
        "would train that, not the hub's model. For a model from the hub (or a folder of your own) set "
        "model.builder=null too (model=qwen2.5-0.5b does); for a new tiny model built there, write the path as "
        "./Qwen/Qwen2.5-0.5B-Instruct.")
    check_config(compose_cfg(["stages=[]", "model.model_path=./Qwen/Qwen2.5-0.5B-Instruct"]))  # built there
    check_config(compose_cfg(["stages=[]", "model.model_path=Qwen/Qwen2.5-0.5B-Instruct", "model.builder=null"]))
    (tmp_path / "models").mkdir()
    check_config(compose_cfg(["stages=[]", "model.model_path=models/tiny"]))  # a folder of this machine's
