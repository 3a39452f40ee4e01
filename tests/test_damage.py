"""Damaged or partial state: each damaged file of the newest checkpoint, in turn, makes the run fall
back to the previous complete checkpoint (saying which file and why) and end exactly where an
undamaged run ends; a damaged or missing buffer is named, never waited on; a finished stage
without its model is redone from its previous checkpoint, never handed on as "None"."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import rft.main
from conftest import compose_cfg
from rft.errors import ConfigError, RunError
from rft.monitor import read_metrics

pytestmark = pytest.mark.slow

# steps 1..3 with a checkpoint after each; the resumed runs go on to step 4
TINY = ["stages=[]", "cluster=inline", "monitor=console", "buffer.batch_size=4", "algorithm.repeat_times=2",
        "explorer.eval_interval=2", "trainer.save_interval=1", "explorer.eval_on_startup=false",
        "stage_cache_dir=null", "algorithm.optimizer.lr=1e-3"]


@pytest.fixture(scope="module")
def made(tmp_path_factory, warm_start):
    """A run of 3 steps (checkpoints 1, 2, 3) to damage copies of, and an undamaged run of 4; from
    the warm start, whose rewards differ, so the optimizer's moments are not all zero."""
    from types import SimpleNamespace

    root = tmp_path_factory.mktemp("damage")
    args = [*TINY, f"model.model_path={warm_start}", "model.builder=null"]
    rft.main.main(compose_cfg([*args, f"checkpoint_root_dir={root}", "name=base", "buffer.total_steps=3"]))
    rft.main.main(compose_cfg([*args, f"checkpoint_root_dir={root}", "name=whole", "buffer.total_steps=4"]))
    return SimpleNamespace(root=root, args=args)


def resume_damaged(made, tmp_path, name, damage, capsys):
    """Copy the 3-step run, damage it, resume it to step 4; returns (console, run dir)."""
    run = tmp_path / "rft" / name
    shutil.copytree(made.root / "rft" / "base", run)
    damage(run / "checkpoints" / "step_3")
    rft.main.main(compose_cfg([*made.args, f"checkpoint_root_dir={tmp_path}", f"name={name}", "buffer.total_steps=4",
                               "resume_with_changes=true"]))
    return capsys.readouterr().out, run


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


DAMAGES = {
    "zeroed_weights": (zero_bytes, "model.safetensors: its weights are not the ones saved"),
    "truncated_weights": (truncate("hf/model.safetensors"), "model.safetensors: does not load"),
    "missing_weights": (delete("hf/model.safetensors"), "model.safetensors: missing"),
    "missing_hf_config": (delete("hf/config.json"), "config.json: missing"),
    "truncated_hf_config": (truncate("hf/config.json"), "config.json: does not parse"),
    "truncated_trainer_state": (truncate("trainer_state.pt"), "trainer_state.pt: does not read as the archive"),
    "zeroed_trainer_state": (zero_optimizer_bytes, "trainer_state.pt: its entry trainer_state/data/"),
    "state_json_without_step": (lambda ckpt: (ckpt / "state.json").write_text("{}"), "state.json holds no step"),
    "missing_trainer_state": (delete("trainer_state.pt"), "trainer_state.pt: missing"),
    "truncated_state_json": (truncate("state.json"), "state.json: state.json does not parse"),
}


@pytest.mark.parametrize("kind", sorted(DAMAGES))
def test_a_damaged_checkpoint_falls_back_to_the_previous_one(made, tmp_path, kind, capsys):
    damage, why = DAMAGES[kind]
    out, run = resume_damaged(made, tmp_path, kind, damage, capsys)
    assert "[grpo] checkpoint step 3 is damaged (" in out and why in out, out
    assert "falling back to the previous complete checkpoint" in out
    assert "resuming from step 2" in out
    (aside,) = (run / "checkpoints").glob("step_3.damaged-*")  # kept for a look, out of the way
    # steps 3 and 4 were run again: the log and the weights are those of an undamaged run
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4]
    a = load_file(made.root / "rft" / "whole" / "checkpoints" / "step_4" / "hf" / "model.safetensors")
    b = load_file(run / "checkpoints" / "step_4" / "hf" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


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
    rft.main.main(compose_cfg([*args, "name=two"]))
    warm = tmp_path / "rft" / "two" / "sft_warmup" / "checkpoints"
    final = load_file(warm / "step_4" / "hf" / "model.safetensors")
    shutil.rmtree(warm / "step_4" / "hf")
    shutil.rmtree(tmp_path / "rft" / "two" / "grpo")
    capsys.readouterr()
    rft.main.main(compose_cfg([*args, "name=two"]))
    out = capsys.readouterr().out
    assert "[sft_warmup] checkpoint step 4 is damaged" in out and "resuming from step 2" in out
    again = load_file(warm / "step_4" / "hf" / "model.safetensors")
    assert all(torch.equal(final[k], again[k]) for k in final)  # redone exactly
    assert "None" not in out and [m["step"] for m in read_metrics(tmp_path / "rft" / "two" / "grpo" / "metrics.jsonl")] == [1]


ASYNC_SQL = ["stages=[]", "cluster=inline", "monitor=console", "buffer.batch_size=4", "algorithm.repeat_times=2",
             "buffer=sql", "synchronizer.sync_offset=1", "buffer.total_steps=4", "trainer.save_interval=2",
             "explorer.eval_interval=4", "explorer.eval_on_startup=false", "stage_cache_dir=null"]


def test_a_deleted_or_damaged_buffer_is_named_not_waited_for(tmp_path):
    rft.main.main(compose_cfg([*ASYNC_SQL, f"checkpoint_root_dir={tmp_path}", "name=a"]))
    run = tmp_path / "rft" / "a"
    shutil.rmtree(run / "checkpoints" / "step_4")  # as if killed before it: the resume starts at step 2
    state = json.loads((run / "checkpoints" / "step_2" / "state.json").read_text())
    assert state["buffer"]["cursor"] < state["buffer"]["last_id"]  # the step explored ahead is unread
    db = run / "buffer.db"
    for f in run.glob("buffer.db*"):
        f.unlink()
    more = [*ASYNC_SQL, f"checkpoint_root_dir={tmp_path}", "name=a", "buffer.total_steps=4"]
    with pytest.raises(RunError) as e:
        rft.main._main(compose_cfg(more))
    assert str(e.value) == (
        f"the buffer {db} no longer holds the experiences checkpoint step 2 explored ahead and had not "
        f"trained on yet (it was deleted, replaced or cut since). Put the file back, or start this stage "
        f"again (continue_from_checkpoint=false)."
    )
    for f in run.glob("buffer.db*"):
        f.unlink()
    db.write_bytes(b"this is no database " * 200)  # what a damaged file reads as
    with pytest.raises(ConfigError) as e:
        rft.main._main(compose_cfg(more))
    assert str(e.value).startswith(
        f"buffer.trainer_input.experience_buffer.path='{db}' is not a SQLite database of experiences, or it is damaged (")
    assert str(e.value).endswith("Move the file away (a new buffer is then started there) or point "
                                 "buffer.trainer_input.experience_buffer.path at another file.")


def test_a_deleted_buffer_with_nothing_left_to_read_is_no_loss(tmp_path, capsys):
    on_policy = [a for a in ASYNC_SQL if not a.startswith("synchronizer.sync_offset")]
    rft.main.main(compose_cfg([*on_policy, f"checkpoint_root_dir={tmp_path}", "name=b", "buffer.total_steps=2"]))
    run = tmp_path / "rft" / "b"
    for f in run.glob("buffer.db*"):
        f.unlink()
    rft.main.main(compose_cfg([*on_policy, f"checkpoint_root_dir={tmp_path}", "name=b", "buffer.total_steps=4"]))
    assert "was deleted or cut since the checkpoint; nothing in it was still to be read" in capsys.readouterr().out
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4]
