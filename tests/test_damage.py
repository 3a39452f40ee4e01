"""Damaged or partial state: each damaged file of the newest checkpoint, in turn, makes the run fall
back to the previous complete checkpoint (saying which file and why) and end exactly where an
undamaged run ends; a damaged or missing buffer is named, never waited on; a finished stage
without its model is redone from its previous checkpoint, never handed on as "None"."""

import json
import os
import re
import shutil

import pytest
import torch
from conftest import compose_cfg
from safetensors.torch import load_file

import rft.runtime.main
from rft.errors import ConfigError, RunError
from rft.reporting.monitor import read_metrics

pytestmark = pytest.mark.slow

# steps 1..3 with a checkpoint after each; the resumed runs go on to step 4. The reward is
# normalised by running statistics, which state.json carries.
TINY = ["stages=[]", "cluster=inline", "monitor=console", "buffer.batch_size=4", "algorithm.repeat_times=2",
        "explorer.eval_interval=2", "trainer.save_interval=1", "explorer.eval_on_startup=false",
        "stage_cache_dir=null", "algorithm.optimizer.lr=1e-3",
        "buffer.explorer_input.taskset.reward_fn=[{fn: exact_match, weight: 1.0, normalize: true}]"]
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "algorithm.optimizer.lr=1e-2"]


def make_runs(root, args):
    """A run of 3 steps (checkpoints 1, 2, 3) to damage copies of, and an undamaged run of 4."""
    from types import SimpleNamespace

    rft.runtime.main.main(compose_cfg([*args, f"checkpoint_root_dir={root}", "name=base", "buffer.total_steps=3"]))
    rft.runtime.main.main(compose_cfg([*args, f"checkpoint_root_dir={root}", "name=whole", "buffer.total_steps=4"]))
    return SimpleNamespace(root=root, args=args)


@pytest.fixture(scope="module")
def made(tmp_path_factory, warm_start):
    """From the warm start, whose rewards differ, so the optimizer's moments are not all zero."""
    return make_runs(tmp_path_factory.mktemp("damage"), [*TINY, f"model.model_path={warm_start}", "model.builder=null"])


@pytest.fixture(scope="module")
def made_lora(tmp_path_factory, warm_start):
    """The same with LoRA adapters: hf/ (the merged model) and adapter/ (what resume reads) in each."""
    return make_runs(tmp_path_factory.mktemp("damage_lora"),
                     [*TINY, *LORA, f"model.model_path={warm_start}", "model.builder=null"])


def resume_damaged(made, tmp_path, name, damage, capsys):
    """Copy the 3-step run, damage it, resume it to step 4; returns (console, run dir)."""
    run = tmp_path / "rft" / name
    shutil.copytree(made.root / "rft" / "base", run, symlinks=True)
    damage(run / "checkpoints" / "step_3")
    rft.runtime.main.main(compose_cfg([*made.args, f"checkpoint_root_dir={tmp_path}", f"name={name}", "buffer.total_steps=4",
                               "resume_with_changes=true"]))
    return capsys.readouterr().out, run


def falls_back(out, run, whole, files=("hf/model.safetensors",)):
    """The run said why step 3 is damaged, resumed from step 2, and ended as the undamaged run."""
    assert "[grpo] checkpoint step 3 is damaged (" in out
    assert "falling back to the previous complete checkpoint" in out
    assert "resuming from step 2" in out
    (aside,) = (run / "checkpoints").glob("step_3.damaged-*")  # kept for a look, out of the way
    # steps 3 and 4 were run again: the log and the weights are those of an undamaged run
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4]
    for f in files:
        a = load_file(whole / "checkpoints" / "step_4" / f)
        b = load_file(run / "checkpoints" / "step_4" / f)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def zero_bytes(ckpt):
    path = ckpt / "hf" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-4096:-2048] = bytes(2048)  # inside the last tensor's data: the file still loads
    path.write_bytes(data)


def zero_optimizer_bytes(ckpt):
    """2 KiB of the largest Adam moment in trainer_state.pt zeroed where it is not zero already:
    the file still loads (zeros are floats like any), and would train on."""
    path = ckpt / "trainer_state.pt"
    moments = [t for st in torch.load(path, weights_only=False)["optimizer"]["state"].values()
               for k, t in st.items() if k == "exp_avg"]
    raw = max(moments, key=lambda t: t.numel()).contiguous().numpy().tobytes()
    data = bytearray(path.read_bytes())
    at = data.find(raw)  # its bytes as stored in the archive
    assert at >= 0
    start = at + next(a for a in range(0, len(raw) - 2048, 2048) if any(raw[a: a + 2048]))
    data[start: start + 2048] = bytes(2048)
    path.write_bytes(data)


def truncate(relative):
    def damage(ckpt):
        path = ckpt / relative
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return damage


def delete(relative):
    return lambda ckpt: (ckpt / relative).unlink()


def alter_reward_statistics(ckpt):
    """One digit of the running count of the normalised reward part changed: state.json still
    parses, the same size, and a resume would normalise rewards by other statistics."""
    path = ckpt / "state.json"
    state = json.loads(path.read_text())
    assert state["reward_norm"]["exact_match"][0] == 24  # 3 steps x 4 tasks x 2 rollouts
    text = path.read_text()
    at = text.index('"reward_norm": {"exact_match": [24,') + len('"reward_norm": {"exact_match": [')
    path.write_text(text[:at] + "31" + text[at + 2:])


def trainer_state_of_step_2(ckpt):
    """A valid trainer_state.pt, of another step: its archive's checksums all hold."""
    shutil.copy2(ckpt.parent / "step_2" / "trainer_state.pt", ckpt / "trainer_state.pt")


def step_2_as_step_3(ckpt):
    """A whole, valid checkpoint copied over another."""
    shutil.rmtree(ckpt)
    shutil.copytree(ckpt.parent / "step_2", ckpt)


def add_outside_entry(ckpt):
    path = ckpt / "manifest.json"
    sealed = json.loads(path.read_text())
    sealed["files"]["../x"] = [1, "0" * 32]
    path.write_text(json.dumps(sealed))


def link_tokenizer_outside(ckpt):
    """hf/tokenizer.json a link to a copy outside the checkpoint (the same bytes)."""
    outside = ckpt.parents[2] / "elsewhere.json"
    shutil.copy2(ckpt / "hf" / "tokenizer.json", outside)
    (ckpt / "hf" / "tokenizer.json").unlink()
    os.symlink(outside, ckpt / "hf" / "tokenizer.json")


def legacy_with_weights_cut(ckpt):
    """Step 3 as an rft from before manifests wrote it (nothing checks its files before the load),
    its hf/model.safetensors cut: the trainer's load fails on that file, which the message named
    trainer_state.pt."""
    (ckpt / "manifest.json").unlink()
    state = json.loads((ckpt / "state.json").read_text())
    del state["manifest"]
    (ckpt / "state.json").write_text(json.dumps(state))
    truncate("hf/model.safetensors")(ckpt)


CUT = "when saved (cut short or written over)"
CHANGED = "its contents are not the ones saved (their digest differs)"
DAMAGES = {
    "zeroed_weights": (zero_bytes, f"step_3/hf/model.safetensors: {CHANGED}"),
    "truncated_weights": (truncate("hf/model.safetensors"), "step_3/hf/model.safetensors: "),
    "missing_weights": (delete("hf/model.safetensors"), "step_3/hf/model.safetensors: missing"),
    "missing_hf_config": (delete("hf/config.json"), "step_3/hf/config.json: missing"),
    "truncated_hf_config": (truncate("hf/config.json"), "step_3/hf/config.json: "),
    "truncated_trainer_state": (truncate("trainer_state.pt"), "step_3/trainer_state.pt: "),
    "zeroed_trainer_state": (zero_optimizer_bytes, f"step_3/trainer_state.pt: {CHANGED}"),
    "state_json_without_step": (lambda ckpt: (ckpt / "state.json").write_text("{}"), f"step_3/state.json: 2 bytes, "),
    "missing_trainer_state": (delete("trainer_state.pt"), "step_3/trainer_state.pt: missing"),
    "truncated_state_json": (truncate("state.json"), "step_3/state.json: "),
    # each of these resumed before checkpoints carried a manifest
    "altered_reward_statistics": (alter_reward_statistics, f"step_3/state.json: {CHANGED}"),
    "trainer_state_of_another_step": (trainer_state_of_step_2, "step_3/trainer_state.pt: "),
    "missing_tokenizer": (delete("hf/tokenizer.json"), "step_3/hf/tokenizer.json: missing"),
    "added_file": (lambda ckpt: (ckpt / "hf" / "notes.txt").write_text("x"),
                   "step_3/hf/notes.txt: not in manifest.json (added after the save)"),
    "linked_file": (link_tokenizer_outside, "step_3/hf/tokenizer.json: a link or other special file"),
    "another_checkpoint_copied_over": (step_2_as_step_3, "step_3/manifest.json: it is the checkpoint of step 2, "
                                                         "in the directory of step 3"),
    "manifest_not_json": (lambda ckpt: (ckpt / "manifest.json").write_text('{"format": 1, "files": {"hf/'),
                          "step_3/manifest.json: does not parse"),
    "manifest_outside_entry": (add_outside_entry, "step_3/manifest.json: lists '../x', which is not a path "
                                                  "inside its directory (not followed)"),
    "missing_manifest": (delete("manifest.json"), "step_3/manifest.json: missing"),
    # the manifest whole, hf/ another whole model of the same shape (step 2's): the trainer is built from hf/
    "hf_of_another_checkpoint": (lambda ckpt: (shutil.rmtree(ckpt / "hf"), shutil.copytree(ckpt.parent / "step_2" / "hf",
                                                                                           ckpt / "hf")),
                                 f"step_3/hf/model.safetensors: {CHANGED}"),
    "legacy_with_weights_cut": (legacy_with_weights_cut, "step_3/hf/model.safetensors does not load (SafetensorError: "),
}


@pytest.mark.parametrize("kind", sorted(DAMAGES))
def test_a_damaged_checkpoint_falls_back_to_the_previous_one(made, tmp_path, kind, capsys):
    damage, why = DAMAGES[kind]
    out, run = resume_damaged(made, tmp_path, kind, damage, capsys)
    assert why in out, out
    if kind.startswith(("truncated", "state_json")):
        assert CUT in out
    falls_back(out, run, made.root / "rft" / "whole")


def test_a_lora_adapter_zeroed_falls_back_to_the_previous_checkpoint(made_lora, tmp_path, capsys):
    """A LoRA run resumes from adapter/, not hf/: a zeroed block there is caught too."""
    def zero_adapter(ckpt):
        path = ckpt / "adapter" / "adapter_model.safetensors"
        data = bytearray(path.read_bytes())
        data[-1024:-512] = bytes(512)  # inside the last tensor's data: the file still loads
        path.write_bytes(data)

    out, run = resume_damaged(made_lora, tmp_path, "lora", zero_adapter, capsys)
    assert f"step_3/adapter/adapter_model.safetensors: {CHANGED}" in out, out
    falls_back(out, run, made_lora.root / "rft" / "whole",
               files=("adapter/adapter_model.safetensors", "hf/model.safetensors"))


REPLAY = ["buffer.trainer_input.experience_buffer.replay_buffer.enable=true",
          "buffer.trainer_input.experience_buffer.replay_buffer.reuse_cooldown_time=0",
          "buffer.trainer_input.experience_buffer.replay_buffer.priority_fn_args.decay=-2"]


@pytest.fixture(scope="module")
def made_replay(tmp_path_factory, warm_start):
    """A replay buffer that reads used experiences again: each checkpoint holds them, in
    buffer_experiences.safetensors beside state.json."""
    return make_runs(tmp_path_factory.mktemp("damage_replay"),
                     [*TINY, *REPLAY, f"model.model_path={warm_start}", "model.builder=null"])


def test_a_replay_buffers_experiences_damaged_fall_back_to_the_previous_checkpoint(made_replay, tmp_path, capsys):
    """A bit flipped in a log-prob of the stored experiences: the file loads (any bits are a float)
    and would be trained on; the manifest names it, and the run resumes from step 2 as if undamaged."""
    def flip(ckpt):
        path = ckpt / "buffer_experiences.safetensors"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 1
        path.write_bytes(data)

    out, run = resume_damaged(made_replay, tmp_path, "replay", flip, capsys)
    assert f"step_3/buffer_experiences.safetensors: {CHANGED}" in out, out
    falls_back(out, run, made_replay.root / "rft" / "whole")


def test_a_replay_state_edited_and_sealed_again_stops_with_one_paragraph(made_replay, tmp_path):
    """A used entry without its use count, the manifest sealed again (so no digest tells): it was
    a raw KeyError ('uses') from the buffer's restore."""
    from rft import manifest

    run = tmp_path / "rft" / "edited"
    shutil.copytree(made_replay.root / "rft" / "base", run, symlinks=True)
    ckpt = run / "checkpoints" / "step_3"
    state = json.loads((ckpt / "state.json").read_text())
    used = state["buffer"]["used"][0]
    del used["uses"]
    (ckpt / "state.json").write_text(json.dumps(state))
    manifest.seal(ckpt, manifest.read(ckpt)[0]["identity"])
    with pytest.raises(RunError) as e:
        rft.runtime.main._main(compose_cfg([*made_replay.args, f"checkpoint_root_dir={tmp_path}", "name=edited",
                                            "buffer.total_steps=4"]))
    assert str(e.value) == (
        f"{ckpt / 'state.json'}: the buffer's part of checkpoint step 3 does not restore (its \"used\" entry 0 "
        f"({json.dumps(used)}) has no 'uses'); rft writes it whole, so it was edited or damaged since (and the "
        f"checkpoint's manifest sealed again). Put it back as it was, or move {ckpt} away to resume from the "
        f"checkpoint before it, or start this stage again (continue_from_checkpoint=false).")


def test_every_checkpoint_damaged_starts_the_stage_again(made, tmp_path, capsys):
    def damage_all(ckpt):
        for step in (1, 2, 3):
            zero_bytes(ckpt.parent / f"step_{step}")
    out, run = resume_damaged(made, tmp_path, "all_damaged", damage_all, capsys)
    assert out.count("is damaged") == 3 and "resuming from step" not in out
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4]


def test_a_finished_stage_without_its_model_is_redone_not_handed_on_as_none(tmp_path, capsys):
    args = ["cluster=inline", "monitor=console", "stages.0.buffer.total_steps=4", "+stages.0.trainer.save_interval=2",
            "stages.0.algorithm.optimizer.warmup_steps=0", "buffer.total_steps=1", "buffer.batch_size=4",
            "algorithm.repeat_times=2", "explorer.eval_on_startup=false", f"checkpoint_root_dir={tmp_path}",
            "stage_cache_dir=null"]
    rft.runtime.main.main(compose_cfg([*args, "name=two"]))
    warm = tmp_path / "rft" / "two" / "sft_warmup" / "checkpoints"
    final = load_file(warm / "step_4" / "hf" / "model.safetensors")
    shutil.rmtree(warm / "step_4" / "hf")
    shutil.rmtree(tmp_path / "rft" / "two" / "grpo")
    capsys.readouterr()
    rft.runtime.main.main(compose_cfg([*args, "name=two"]))
    out = capsys.readouterr().out
    assert "[sft_warmup] checkpoint step 4 is damaged" in out and "resuming from step 2" in out
    again = load_file(warm / "step_4" / "hf" / "model.safetensors")
    assert all(torch.equal(final[k], again[k]) for k in final)  # redone exactly
    assert "None" not in out and [m["step"] for m in read_metrics(tmp_path / "rft" / "two" / "grpo" / "metrics.jsonl")] == [1]


ASYNC_SQL = ["stages=[]", "cluster=inline", "monitor=console", "buffer.batch_size=4", "algorithm.repeat_times=2",
             "buffer=sql", "synchronizer.sync_offset=1", "buffer.total_steps=4", "trainer.save_interval=2",
             "explorer.eval_interval=4", "explorer.eval_on_startup=false", "stage_cache_dir=null"]


def test_a_deleted_or_damaged_buffer_is_named_not_waited_for(tmp_path):
    rft.runtime.main.main(compose_cfg([*ASYNC_SQL, f"checkpoint_root_dir={tmp_path}", "name=a"]))
    run = tmp_path / "rft" / "a"
    shutil.rmtree(run / "checkpoints" / "step_4")  # as if killed before it: the resume starts at step 2
    state = json.loads((run / "checkpoints" / "step_2" / "state.json").read_text())
    assert state["buffer"]["cursor"] < state["buffer"]["last_id"]  # the step explored ahead is unread
    db = run / "buffer.db"
    for f in run.glob("buffer.db*"):
        f.unlink()
    more = [*ASYNC_SQL, f"checkpoint_root_dir={tmp_path}", "name=a", "buffer.total_steps=4"]
    with pytest.raises(RunError) as e:
        rft.runtime.main._main(compose_cfg(more))
    assert str(e.value) == (
        f"the buffer {db} no longer holds the experiences checkpoint step 2 explored ahead and had not "
        f"trained on yet (it was deleted, replaced or cut since). Put the file back, or start this stage "
        f"again (continue_from_checkpoint=false)."
    )
    for f in run.glob("buffer.db*"):
        f.unlink()
    db.write_bytes(b"this is no database " * 200)  # what a damaged file reads as
    with pytest.raises(ConfigError) as e:
        rft.runtime.main._main(compose_cfg(more))
    assert str(e.value).startswith(
        f"buffer.trainer_input.experience_buffer.path='{db}' is not a SQLite database of experiences, or it is damaged (")
    assert str(e.value).endswith("Move the file away (a new buffer is then started there) or point "
                                 "buffer.trainer_input.experience_buffer.path at another file.")


def test_an_edited_experience_explored_ahead_stops_the_resume_naming_the_buffer(tmp_path):
    """SQLite checksums no row: a reward changed in the experiences a checkpoint explored ahead
    was trained on unnoticed (a byte flipped in a token id too); the checkpoint holds their digest."""
    import sqlite3

    rft.runtime.main.main(compose_cfg([*ASYNC_SQL, f"checkpoint_root_dir={tmp_path}", "name=c"]))
    run = tmp_path / "rft" / "c"
    shutil.rmtree(run / "checkpoints" / "step_4")  # as if killed before it: the resume starts at step 2
    cursor = json.loads((run / "checkpoints" / "step_2" / "state.json").read_text())["buffer"]["cursor"]
    with sqlite3.connect(run / "buffer.db") as c:  # the first unread experience's reward, 0 <-> 1
        assert c.execute("UPDATE experiences SET reward = 1 - reward WHERE id = ?", (cursor + 1,)).rowcount == 1
    with pytest.raises(RunError) as e:
        rft.runtime.main._main(compose_cfg([*ASYNC_SQL, f"checkpoint_root_dir={tmp_path}", "name=c"]))
    assert str(e.value) == (
        f"the buffer {run / 'buffer.db'} does not hold the experiences checkpoint step 2 explored ahead and had "
        f"not trained on yet as it saved them (their digest differs: the file was damaged or edited since). Put "
        f"the file back, or start this stage again (continue_from_checkpoint=false)."
    )


def test_a_deleted_buffer_with_nothing_left_to_read_is_no_loss(tmp_path, capsys):
    on_policy = [a for a in ASYNC_SQL if not a.startswith("synchronizer.sync_offset")]
    rft.runtime.main.main(compose_cfg([*on_policy, f"checkpoint_root_dir={tmp_path}", "name=b", "buffer.total_steps=2"]))
    run = tmp_path / "rft" / "b"
    for f in run.glob("buffer.db*"):
        f.unlink()
    rft.runtime.main.main(compose_cfg([*on_policy, f"checkpoint_root_dir={tmp_path}", "name=b", "buffer.total_steps=4"]))
    assert "was deleted or cut since the checkpoint; nothing in it was still to be read" in capsys.readouterr().out
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4]


class _RunsCode:
    """Unpickled, it would create the file `marker` (a stand-in for any code a file can name)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def runs_code(marker):
    """The damage: trainer_state.pt replaced together with its manifest (the digest cannot catch
    that), by one whose unpickling would create `marker`."""
    from rft import manifest

    def replace(ckpt):
        path = ckpt / "trainer_state.pt"
        state = torch.load(path, weights_only=True)
        torch.save({**state, "optimizer": _RunsCode(marker)}, path)
        sealed = json.loads((ckpt / "manifest.json").read_text())
        manifest.seal(ckpt, sealed["identity"])
    return replace


def policy_loads(monkeypatch) -> list:
    """Where the trainer's models are read from, in order (the stages run in this process)."""
    import rft.trainer.trainer

    paths, real = [], rft.trainer.trainer.load_model
    monkeypatch.setattr(rft.trainer.trainer, "load_model", lambda m, p=None, *a, **k: paths.append(p) or real(m, p, *a, **k))
    return paths


def test_a_trainer_state_that_would_run_code_falls_back_and_the_code_never_runs(made, tmp_path, capsys, monkeypatch):
    """Refused when loaded, named with why, and the run falls back as for any damage: the trainer,
    built from step 3's weights (the checkpoint a resumed stage loads first), loads step 2's."""
    marker = tmp_path / "the_code_ran"
    loads = policy_loads(monkeypatch)
    out, run = resume_damaged(made, tmp_path, "runs_code", runs_code(marker), capsys)
    assert not marker.exists()
    assert (f"step_3/trainer_state.pt is refused: it holds a call of io.open, which is not a tensor, number, "
            f"string or container of them, and loading it would run that code") in out, out
    assert loads == [str(run / "checkpoints" / "step_3" / "hf")]  # the starting model's weights never read
    falls_back(out, run, made.root / "rft" / "whole")


def test_every_trainer_state_refused_starts_the_stage_again_from_the_starting_model(made, tmp_path, capsys,
                                                                                    monkeypatch):
    """The trainer was built from step 3's weights; no checkpoint loading, it is built again from
    the starting model, and the stage ends as the run that never stopped (step 4's weights)."""
    marker = tmp_path / "the_code_ran"

    def replace_all(ckpt):
        for step in (1, 2, 3):
            runs_code(marker)(ckpt.parent / f"step_{step}")

    loads = policy_loads(monkeypatch)
    out, run = resume_damaged(made, tmp_path, "all_refused", replace_all, capsys)
    # ("resuming from step 3 of run rft/base" is the check of whose checkpoint it is, before its load)
    assert not marker.exists() and out.count("is refused") == 3 and not re.search(r"resuming from step \d \(", out)
    assert loads == [str(run / "checkpoints" / "step_3" / "hf"), None]  # None: model.model_path
    a = load_file(made.root / "rft" / "whole" / "checkpoints" / "step_4" / "hf" / "model.safetensors")
    b = load_file(run / "checkpoints" / "step_4" / "hf" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
