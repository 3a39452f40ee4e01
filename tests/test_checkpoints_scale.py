"""Checkpoints that scale: sharded safetensors read everywhere weights are read, pruning
(trainer.max_ckpt_to_keep), a chosen checkpoint to resume from (trainer.resume_from_path), LoRA
checkpoints without the merged model (trainer.save_hf_checkpoint), and `python -m rft.runtime.export`.
(What a checkpoint's manifest catches: test_checkpoints_manifest.py.)"""

import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, compose_cfg
from transformers import AutoModelForCausalLM, AutoTokenizer

import rft.runtime.main
from rft import manifest
from rft.data.experience import collate
from rft.errors import ConfigError
from rft.models import load_hf_weights, load_model
from rft.plan.batch import make_plan, stage_configs
from rft.reporting.monitor import read_metrics
from rft.rollout.engines.hf import HFEngine
from rft.runtime import checkpoint
from rft.runtime.checkpoint import Owner, damage, list_checkpoints, read_checkpoint
from rft.runtime.export import export
from rft.sync.weights import hf_weight_files, same_weights
from rft.trainer.logprobs import token_logprobs

OWNER = Owner(run="rft/t", stage="grpo", config="c0ffee", model="tiny")
from test_fsdp import configs, fsdp_group, local_ray  # noqa: F401 (local_ray: a fixture)
from test_trainer import experiences, make_trainer


def seal(d, step=1, **state):
    """state.json and the manifest, as checkpoint.write adds them after the trainer's save."""
    (d / "state.json").write_text(json.dumps({"step": step, **state, "manifest": manifest.FORMAT}))
    manifest.seal(d, OWNER.identity(step))


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
    t.save(str(d))
    shard(d / "hf", t.model)
    seal(d)
    return t, d


def test_sharded_weights_load_into_the_trainer_the_engine_and_pass_the_damage_check(trained):
    t, d = trained
    assert damage(read_checkpoint(d)) is None
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


def test_the_optimizer_state_is_hashed_once_by_the_manifest_not_by_torch_save_too(trained):
    """torch.save's CRC32 of each record was a second hash of the optimizer's moments (2 GB at the
    0.5B shape) that torch.load never checks: the manifest's digest is the check."""
    import zipfile

    from torch.serialization import get_crc32_options

    t, d = trained
    with zipfile.ZipFile(d / "trainer_state.pt") as z:
        records = [i for i in z.infolist() if "/data/" in i.filename]
        # one record per tensor: each Adam moment (2 per parameter), the RNG state and step counts
        assert len(records) > 2 * len(list(t.model.parameters())) and {i.CRC for i in records} == {0}
    assert get_crc32_options() is True  # torch's setting for other callers is left as it was
    state = torch.load(d / "trainer_state.pt", weights_only=True)["optimizer"]["state"]
    moments = t.optimizer.state_dict()["state"]
    assert all(torch.equal(state[i]["exp_avg_sq"], moments[i]["exp_avg_sq"]) for i in moments)


def test_a_folder_without_weights_is_named(trained, tmp_path):
    _, d = trained
    with pytest.raises(FileNotFoundError) as e:
        load_hf_weights(torch.nn.Linear(1, 1), tmp_path)
    assert str(e.value) == (f"{tmp_path} holds no model weights (neither model.safetensors nor "
                            f"model.safetensors.index.json with its shards)")
    copy = tmp_path / "checkpoints" / "step_1"
    shutil.copytree(d, copy)
    shards = hf_weight_files(copy / "hf")
    for f in shards:
        f.unlink()
    (copy / "hf" / "model.safetensors.index.json").unlink()
    assert damage(read_checkpoint(copy)) == f"{shards[0]}: missing"  # the first the manifest lists


def test_a_damaged_or_missing_shard_is_named(trained, tmp_path):
    _, d = trained
    copy = tmp_path / "checkpoints" / "step_1"
    shutil.copytree(d, copy)
    files = hf_weight_files(copy / "hf")
    # zeroed bytes in the middle of a shard: it loads, but it is not what was saved
    data = bytearray(files[-1].read_bytes())
    data[-64:-32] = bytes(32)
    files[-1].write_bytes(bytes(data))
    assert damage(read_checkpoint(copy)) == f"{files[-1]}: its contents are not the ones saved (their digest differs)"
    files[0].unlink()
    assert damage(read_checkpoint(copy)) == f"{files[0]}: missing"


def fake_checkpoints(stage, steps):
    for s in steps:
        checkpoint.write(stage, s, {}, owner=OWNER)


def test_max_ckpt_to_keep_deletes_the_oldest_after_a_save(tmp_path):
    fake_checkpoints(tmp_path, [10, 20, 30])
    (tmp_path / "checkpoints" / "step_5.damaged-20260101_000000").mkdir()
    said = []
    checkpoint.write(tmp_path, 40, {}, keep=2, say=said.append)
    assert [c.step for c in list_checkpoints(tmp_path)] == [30, 40]
    assert said == [f"deleted checkpoint step {s} ({tmp_path / 'checkpoints' / f'step_{s}'}): keeping the newest 2"
                    for s in (10, 20)]
    assert (tmp_path / "checkpoints" / "step_5.damaged-20260101_000000").exists()  # never touched
    checkpoint.write(tmp_path, 50, {}, keep=None)
    assert [c.step for c in list_checkpoints(tmp_path)] == [30, 40, 50]
    checkpoint.write(tmp_path, 60, {}, keep=1)
    assert [c.step for c in list_checkpoints(tmp_path)] == [60]


def test_resume_from_path_picks_that_checkpoint_and_moves_newer_ones_aside(tmp_path):
    fake_checkpoints(tmp_path, [1, 2, 3])
    said = []
    ckpt = checkpoint.chosen_checkpoint(tmp_path, str(tmp_path / "checkpoints" / "step_2"), OWNER, "grpo", said.append)
    assert ckpt.step == 2 and [c.step for c in list_checkpoints(tmp_path)] == [1, 2]
    assert len(said) == 1 and said[0].startswith("[grpo] trainer.resume_from_path: resuming from step 2; the newer "
                                                 "checkpoint step 3 is moved to step_3.superseded-")
    with pytest.raises(ConfigError) as e:
        checkpoint.chosen_checkpoint(tmp_path, str(tmp_path / "nope"), OWNER, "grpo", said.append)
    assert str(e.value) == (
        f"trainer.resume_from_path={str(tmp_path / 'nope')!r}: no such directory. Give a directory "
        f"<run>/<stage>/checkpoints/step_<N>; this stage's checkpoints: {tmp_path / 'checkpoints' / 'step_1'}, "
        f"{tmp_path / 'checkpoints' / 'step_2'}. Or leave it null to resume from the newest.")
    (tmp_path / "checkpoints" / "step_4.tmp").mkdir()  # a save that was killed: no manifest.json
    with pytest.raises(ConfigError) as e:
        checkpoint.chosen_checkpoint(tmp_path, str(tmp_path / "checkpoints" / "step_4.tmp"), OWNER, "grpo", said.append)
    assert str(e.value) == (
        f"trainer.resume_from_path={str(tmp_path / 'checkpoints' / 'step_4.tmp')!r}: not a checkpoint (no manifest.json: "
        f"not a step_<N> directory, or a save that did not finish). Give a directory <run>/<stage>/checkpoints/"
        f"step_<N>; this stage's checkpoints: {tmp_path / 'checkpoints' / 'step_1'}, "
        f"{tmp_path / 'checkpoints' / 'step_2'}. Or leave it null to resume from the newest.")


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
def test_a_lora_run_saves_adapters_resumes_from_a_chosen_one_and_exports(warm_start, tmp_path, capsys):
    # from the warm start, so that rewards vary and every step moves the adapters
    lora = ["model.lora.rank=4", "model.lora.alpha=8", "algorithm.optimizer.lr=1e-2",
            f"model.model_path={warm_start}", "model.builder=null", "trainer.save_hf_checkpoint=last",
            "trainer.save_interval=1", "trainer.max_ckpt_to_keep=3", "stages=[]", "cluster=inline",
            "monitor=console", f"checkpoint_root_dir={tmp_path}", "explorer.eval_interval=100", "name=lora"]
    rft.runtime.main.main(compose_cfg([*lora, "buffer.total_steps=4"]))
    stage = tmp_path / "rft" / "lora"
    ckpts = {c.step: c for c in list_checkpoints(stage)}
    # 4 saves, the newest 3 kept; only the last holds the merged model, every one the adapter
    assert sorted(ckpts) == [2, 3, 4]
    printed = capsys.readouterr()
    assert (f"[grpo] trainer.max_ckpt_to_keep: deleted checkpoint step 1 ({stage / 'checkpoints' / 'step_1'}): "
            f"keeping the newest 3\n") in printed.out + printed.err
    assert [ckpts[s].hf_path.exists() for s in (2, 3, 4)] == [False, False, True]
    assert all((ckpts[s].path / "adapter" / "adapter_model.safetensors").exists() for s in (2, 3, 4))
    assert all(damage(c) is None for c in ckpts.values())
    # export: step 4 from its hf/ (the trainer's merge), step 3 from its adapter and base (PEFT's
    # merge), against a LoRA trainer that resumed step 3 (the trainer's merge)
    for step in (4, 3):
        r = subprocess.run([sys.executable, "-m", "rft.runtime.export", str(ckpts[step].path), str(tmp_path / f"out{step}")],
                           capture_output=True, text=True, cwd=ROOT)
        assert r.returncode == 0, r.stderr
    t = make_trainer(8, lora[:5])
    t.load(str(ckpts[3].path))
    # in float64: x W + (x A) B unmerged against x (W + A B) merged differ in float32 by rounding
    # alone (1.2e-4 in one log-prob of magnitude 18 after three lr=1e-2 steps, where the
    # trainer's float32 arithmetic took another path); in float64 by 2.4e-6, the float32 rounding of
    # logits near 18 (2^-19 x 16 = 1.9e-6) that token_logprobs' head casts to on both sides
    want = logprobs(t.model.double(), t.tokenizer)
    got = logprobs(AutoModelForCausalLM.from_pretrained(tmp_path / "out3", dtype=torch.float64), t.tokenizer)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    four = logprobs(AutoModelForCausalLM.from_pretrained(tmp_path / "out4"), t.tokenizer)
    assert (four - want).abs().max() > 1e-3  # a step later: another model
    # resume from step 2 (adapter only) for 2 more steps: step 3 is redone, the old 3 and 4 set aside
    rft.runtime.main.main(compose_cfg([*lora, "buffer.total_steps=4", f"trainer.resume_from_path={ckpts[2].path}"]))
    aside = sorted(p.name.split(".")[0] for p in (stage / "checkpoints").glob("*.superseded-*"))
    assert aside == ["step_3", "step_4"]
    assert [c.step for c in list_checkpoints(stage)] == [2, 3, 4]
    steps = [m["step"] for m in read_metrics(stage / "metrics.jsonl") if "loss/policy" in m]
    assert steps[-2:] == [3, 4]


@pytest.mark.slow
def test_export_refuses_what_is_not_a_checkpoint(tmp_path):
    r = subprocess.run([sys.executable, "-m", "rft.runtime.export", str(tmp_path), str(tmp_path / "out")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    assert r.stderr == (f"error: {tmp_path} is not a checkpoint: a checkpoint is a directory <run>/<stage>/"
                        f"checkpoints/step_<N> with a manifest.json (one without it is a save that did not finish).\n")


def logits(model, tok):
    ids = collate(experiences(2, 2, seed=5), tok.pad_token_id)["input_ids"]
    with torch.no_grad():
        return model.eval()(ids).logits


def test_export_writes_a_sharded_checkpoint_as_a_model_from_pretrained_loads(trained, tmp_path):
    t, d = trained
    out = export(d, tmp_path / "out", max_shard_size="100KB")
    assert len(hf_weight_files(out)) > 1  # the export shards as asked
    # sealed: whole now, and saying where it came from
    assert manifest.verify(out) is None
    assert manifest.read(out)[0]["identity"] == {**OWNER.identity(1), "exported_from": str(d.resolve())}
    with pytest.raises(ConfigError) as e:  # a manifest of a folder holding other things would seal them too
        export(d, out)
    assert str(e.value) == (f"{out} is not an empty folder: the export is sealed with a manifest of every file in "
                            f"its folder. Give a new folder (or empty this one).")
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(out), t.tokenizer),
                               logits(t.model, t.tokenizer), rtol=0, atol=0)
    assert AutoTokenizer.from_pretrained(out)("12+34=").input_ids == t.tokenizer("12+34=").input_ids


def test_a_lora_checkpoint_without_hf_resumes_and_exports_the_merged_model(tmp_path):
    lora = ["model.lora.rank=4", "model.lora.alpha=8", "algorithm.optimizer.lr=1e-2"]
    t = make_trainer(128, lora)
    t.train_step(experiences())
    d = tmp_path / "checkpoints" / "step_1"
    d.mkdir(parents=True)
    t.save(str(d), False)  # trainer.save_hf_checkpoint=last|never, not the last step
    assert not (d / "hf").exists() and (d / "adapter" / "adapter_model.safetensors").exists()
    seal(d, lora_base=t.cfg.model.model_path)
    assert damage(read_checkpoint(d)) is None
    resumed = make_trainer(128, lora)
    resumed.load(str(d))
    assert resumed.version == 1 and same_weights(resumed.fingerprint(), t.fingerprint())
    want = logits(t.model, t.tokenizer)
    got = logits(AutoModelForCausalLM.from_pretrained(export(d, tmp_path / "out")), t.tokenizer)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    base = logits(load_model(t.cfg.model), t.tokenizer)
    assert (got - base).abs().max() > 1e-3  # the adapter is in it: not the base model


@pytest.mark.slow  # Ray and two trainer=fsdp2 ranks
def test_export_writes_a_trainer_fsdp2_checkpoint(local_ray, tmp_path):
    (one_cfg, _), (two_cfg, two_plan) = configs()
    two = fsdp_group(two_cfg, two_plan, tmp_path)
    try:
        two.call("train_step", experiences())
        d = tmp_path / "checkpoints" / "step_1"
        d.mkdir(parents=True)
        two.call("save", str(d))
        seal(d)
        whole = load_model(one_cfg.model)
        whole.load_state_dict(two.call("weights"))  # the ranks' shards gathered
    finally:
        two.kill()
    tok = AutoTokenizer.from_pretrained(one_cfg.model.model_path)
    got = logits(AutoModelForCausalLM.from_pretrained(export(d, tmp_path / "out")), tok)
    torch.testing.assert_close(got, logits(whole, tok), rtol=0, atol=0)
    assert (got - logits(load_model(one_cfg.model), tok)).abs().max() > 1e-4  # trained: not the starting model


def test_checking_a_checkpoint_imports_no_torch(trained):
    """The Ray driver checks the checkpoint it resumes from and the stage cache entry it reuses."""
    _, d = trained  # hf/ in shards, trainer_state.pt beside it
    code = (f"import sys; import rft.runtime.rundir; from rft.runtime.checkpoint import damage, read_checkpoint; "
            f"print(damage(read_checkpoint({str(d)!r})), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.split() == ["None", "False"]
