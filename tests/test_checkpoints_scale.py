"""Checkpoints that scale: sharded safetensors read everywhere weights are read, pruning
(trainer.max_ckpt_to_keep), a chosen checkpoint to resume from (trainer.resume_from_path), LoRA
checkpoints without the merged model (trainer.save_hf_checkpoint), and `python -m rft.export`."""

import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

import rft.main
from conftest import ROOT, compose_cfg
from rft import checkpoint
from rft.checkpoint import damage, list_checkpoints, read_checkpoint
from rft.engine import HFEngine
from rft.errors import ConfigError
from rft.experience import collate
from rft.logprobs import token_logprobs
from rft.models import load_hf_weights, load_model
from rft.monitor import read_metrics
from rft.plan import make_plan, stage_configs
from rft.sync import hf_weight_files, same_weights
from test_trainer import experiences, make_trainer


def shard(hf_dir, model, size="100KB"):
    """Rewrite a checkpoint's hf/ as save_pretrained shards a large model: an index and files."""
    for f in hf_dir.glob("*.safetensors"):
        f.unlink()
    model.save_pretrained(hf_dir, max_shard_size=size)
    files = hf_weight_files(hf_dir)
    assert len(files) > 1 and (hf_dir / "model.safetensors.index.json").exists()
    return files


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A trainer after one step, its checkpoint step_1 with hf/ sharded (state.json as the runner writes it)."""
    t = make_trainer(128, ["algorithm.optimizer.lr=1e-2"])
    t.train_step(experiences())
    d = tmp_path_factory.mktemp("stage") / "checkpoints" / "step_1"
    d.mkdir(parents=True)
    saved = t.save(str(d))
    shard(d / "hf", t.model)
    (d / "state.json").write_text(json.dumps({"step": 1, "saved_fingerprint": saved}))
    return t, d


def test_sharded_weights_load_into_the_trainer_the_engine_and_pass_the_damage_check(trained):
    t, d = trained
    assert damage(read_checkpoint(d), has_model=True) is None
    # resume (Trainer.load) and mode=explore's pickup (the engine's load) read every shard
    resumed = make_trainer(128)
    resumed.load(str(d))
    assert resumed.version == 1 and same_weights(resumed.fingerprint(), t.fingerprint())
    engine = HFEngine(t.cfg.model, SimpleNamespace(generate_batch_size=4), t.tokenizer)
    engine.load_weights_file(str(d / "hf"))
    assert same_weights(engine.fingerprint(), t.fingerprint())
    fresh = load_model(t.cfg.model)
    load_hf_weights(fresh, d / "hf")
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), t.model.state_dict().values()))


def test_a_damaged_or_missing_shard_is_named(trained, tmp_path):
    _, d = trained
    copy = tmp_path / "checkpoints" / "step_1"
    shutil.copytree(d, copy)
    files = hf_weight_files(copy / "hf")
    # flipped bytes in the middle of a shard: it loads, but its sums are not the saved ones
    data = bytearray(files[-1].read_bytes())
    data[-64:-32] = bytes(32)
    files[-1].write_bytes(bytes(data))
    assert damage(read_checkpoint(copy), True).startswith(f"{copy / 'hf'}: its weights are not the ones saved")
    files[0].unlink()
    assert damage(read_checkpoint(copy), True) == f"{files[0]}: missing"


def fake_checkpoints(stage, steps):
    for s in steps:
        (stage / "checkpoints" / f"step_{s}").mkdir(parents=True)
        (stage / "checkpoints" / f"step_{s}" / "state.json").write_text(json.dumps({"step": s}))


def test_max_ckpt_to_keep_deletes_the_oldest_after_a_save(tmp_path):
    fake_checkpoints(tmp_path, [10, 20, 30])
    (tmp_path / "checkpoints" / "step_5.damaged-20260101_000000").mkdir()
    checkpoint.write(tmp_path, 40, {}, keep=2)
    assert [c.step for c in list_checkpoints(tmp_path)] == [30, 40]
    assert (tmp_path / "checkpoints" / "step_5.damaged-20260101_000000").exists()  # never touched
    checkpoint.write(tmp_path, 50, {}, keep=None)
    assert [c.step for c in list_checkpoints(tmp_path)] == [30, 40, 50]
    checkpoint.write(tmp_path, 60, {}, keep=1)
    assert [c.step for c in list_checkpoints(tmp_path)] == [60]


def test_resume_from_path_picks_that_checkpoint_and_moves_newer_ones_aside(tmp_path):
    fake_checkpoints(tmp_path, [1, 2, 3])
    said = []
    ckpt = checkpoint.chosen_checkpoint(tmp_path, str(tmp_path / "checkpoints" / "step_2"), False, "grpo", said.append)
    assert ckpt.step == 2 and [c.step for c in list_checkpoints(tmp_path)] == [1, 2]
    assert len(said) == 1 and said[0].startswith("[grpo] trainer.resume_from_path: resuming from step 2; the newer "
                                                 "checkpoint step 3 is moved to step_3.superseded-")
    with pytest.raises(ConfigError) as e:
        checkpoint.chosen_checkpoint(tmp_path, str(tmp_path / "nope"), False, "grpo", said.append)
    assert str(e.value) == (
        f"trainer.resume_from_path={str(tmp_path / 'nope')!r}: no such directory. Give a directory "
        f"<run>/<stage>/checkpoints/step_<N>; this stage's checkpoints: {tmp_path / 'checkpoints' / 'step_1'}, "
        f"{tmp_path / 'checkpoints' / 'step_2'}. Or leave it null to resume from the newest.")
    with pytest.raises(ConfigError) as e:
        checkpoint.chosen_checkpoint(tmp_path, str(tmp_path / "checkpoints"), False, "grpo", said.append)
    assert "not a checkpoint (no state.json" in str(e.value)


def test_checkpoint_settings_are_checked():
    def error(*overrides):
        with pytest.raises(ConfigError) as e:
            make_plan(stage_configs(compose_cfg(["stages=[]", *overrides]))[0], 2000)
        return str(e.value)

    assert error("trainer.max_ckpt_to_keep=0") == (
        "trainer.max_ckpt_to_keep=0 must be >= 1 (or null to keep every checkpoint): a run resumes from its newest.")
    assert error("trainer.save_hf_checkpoint=last") == (
        "trainer.save_hf_checkpoint=last: only a LoRA run (model.lora.rank > 0) can leave out hf/, as it resumes "
        "from its adapter/; full fine-tuning resumes from hf/, written at every save. Use trainer.max_ckpt_to_keep "
        "to bound the disk instead.")
    assert error("model.lora.rank=4", "trainer.save_hf_checkpoint=sometimes") == (
        "trainer.save_hf_checkpoint='sometimes': choose always, last or never.")


def logprobs(model, tok):
    full = collate(experiences(2, 2, seed=5), tok.pad_token_id)
    with torch.no_grad():
        return token_logprobs(model, full["input_ids"], full["attention_mask"])[0]


@pytest.mark.slow
def test_a_lora_run_saves_adapters_resumes_from_a_chosen_one_and_exports(warm_start, tmp_path):
    # from the warm start, so that rewards vary and every step moves the adapters
    lora = ["model.lora.rank=4", "model.lora.alpha=8", "algorithm.optimizer.lr=1e-2",
            f"model.model_path={warm_start}", "model.builder=null", "trainer.save_hf_checkpoint=last",
            "trainer.save_interval=1", "trainer.max_ckpt_to_keep=3", "stages=[]", "cluster=inline",
            "monitor=console", f"checkpoint_root_dir={tmp_path}", "explorer.eval_interval=100", "name=lora"]
    rft.main.main(compose_cfg([*lora, "buffer.total_steps=4"]))
    stage = tmp_path / "rft" / "lora"
    ckpts = {c.step: c for c in list_checkpoints(stage)}
    # 4 saves, the newest 3 kept; only the last holds the merged model, every one the adapter
    assert sorted(ckpts) == [2, 3, 4]
    assert [ckpts[s].hf_path.exists() for s in (2, 3, 4)] == [False, False, True]
    assert all((ckpts[s].path / "adapter" / "adapter_model.safetensors").exists() for s in (2, 3, 4))
    assert all(damage(c, True) is None for c in ckpts.values())
    # export: step 4 from its hf/ (the trainer's merge), step 3 from its adapter and base (PEFT's
    # merge), against a LoRA trainer that resumed step 3 (the trainer's merge)
    for step in (4, 3):
        r = subprocess.run([sys.executable, "-m", "rft.export", str(ckpts[step].path), str(tmp_path / f"out{step}")],
                           capture_output=True, text=True, cwd=ROOT)
        assert r.returncode == 0, r.stderr
    t = make_trainer(8, lora[:5])
    t.load(str(ckpts[3].path))
    want = logprobs(t.model, t.tokenizer)
    got = logprobs(AutoModelForCausalLM.from_pretrained(tmp_path / "out3"), t.tokenizer)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    four = logprobs(AutoModelForCausalLM.from_pretrained(tmp_path / "out4"), t.tokenizer)
    assert (four - want).abs().max() > 1e-3  # a step later: another model
    # resume from step 2 (adapter only) for 2 more steps: step 3 is redone, the old 3 and 4 set aside
    rft.main.main(compose_cfg([*lora, "buffer.total_steps=4", f"trainer.resume_from_path={ckpts[2].path}"]))
    aside = sorted(p.name.split(".")[0] for p in (stage / "checkpoints").glob("*.superseded-*"))
    assert aside == ["step_3", "step_4"]
    assert [c.step for c in list_checkpoints(stage)] == [2, 3, 4]
    steps = [m["step"] for m in read_metrics(stage / "metrics.jsonl") if "loss/policy" in m]
    assert steps[-2:] == [3, 4]


def test_export_refuses_what_is_not_a_checkpoint(tmp_path):
    r = subprocess.run([sys.executable, "-m", "rft.export", str(tmp_path), str(tmp_path / "out")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    assert r.stderr == (f"error: {tmp_path} is not a checkpoint: a checkpoint is a directory <run>/<stage>/"
                        f"checkpoints/step_<N> with a state.json (one without it is a save that did not finish).\n")
