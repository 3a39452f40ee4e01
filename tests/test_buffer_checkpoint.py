"""A queue buffer's part of a checkpoint: its experiences packed in a safetensors file beside
state.json (sealed by the manifest with the rest), read back bit for bit; a checkpoint of the
JSON form before it still restores; a hand-edited entry is one paragraph naming the file.

`python tests/test_buffer_checkpoint.py` prints what a checkpoint of a replay buffer of 256 and of
4,096 experiences of 1,024 tokens costs, written as JSON numbers in state.json and packed."""

import json
import time

import numpy as np
import pytest
from omegaconf import OmegaConf
from test_buffers import buf_cfg, exps

from rft import manifest
from rft.data.buffer import EXPERIENCES_FILE, QueueBuffer, pack_experiences, unpack_experiences
from rft.data.experience import Experience
from rft.errors import RunError
from rft.runtime import checkpoint
from rft.runtime.saving import StageCheckpoints

REPLAY = {"replay_buffer.enable": True, "replay_buffer.reuse_cooldown_time": 0.0}


def long_experiences(n: int, prompt: int = 512, response: int = 512) -> list[Experience]:
    """Experiences of `prompt` + `response` token ids below a 151,000-token vocabulary, and float32
    log-probs (as an engine hands them out, made Python floats)."""
    rng = np.random.default_rng(0)
    return [Experience(rng.integers(0, 151_000, prompt + response).tolist(), prompt,
                       (-rng.exponential(1.0, response)).astype(np.float32).tolist(), reward=i % 2,
                       group_id=f"{i // 4}/77/t{i}", task_id=f"t{i}", policy_version=i % 5,
                       sampling={"temperature": 1.0, "top_p": 1.0, "top_k": -1}) for i in range(n)]


def replay_with_used(n: int, make=exps) -> QueueBuffer:
    """A replay buffer of `n` experiences, the first half read once (used), the rest unread."""
    buf = QueueBuffer(buf_cfg(capacity=max(n, 1), **REPLAY))
    buf.put(make(n // 2))
    buf.get(n // 2, timeout=0)
    buf.put(make(n - n // 2))
    return buf


def stage(tmp_path, buf: QueueBuffer) -> StageCheckpoints:
    cfg = OmegaConf.create({"mode": "both", "trainer": {"save_hf_checkpoint": "never"},
                            "buffer": {"trainer_input": {"experience_buffer": buf_cfg(**REPLAY)}}})
    return StageCheckpoints(cfg, None, tmp_path, "grpo", None, None)


def save(tmp_path, buf: QueueBuffer, step: int = 2) -> checkpoint.Checkpoint:
    """A checkpoint of `buf` as the schedule writes one (StageCheckpoints.buffer_state, then write)."""
    stages = stage(tmp_path, buf)
    state, files = stages.buffer_state(buf)
    stages.write(step, {"buffer": state}, None, print, files)
    return checkpoint.read_checkpoint(tmp_path / "checkpoints" / f"step_{step}")


def restored(tmp_path, latest: checkpoint.Checkpoint) -> QueueBuffer:
    buf = QueueBuffer(buf_cfg(**REPLAY))
    stage(tmp_path, buf).restore_buffer(buf, latest.state["buffer"], latest)
    return buf


def test_packed_experiences_read_back_bit_for_bit():
    a, b, c = exps(3)
    a.logprobs = [0.1 + 0.2, -1e-300]  # not float32 values: kept as float64
    a.tokens[0] = 2**40  # past int32: the token ids kept as int64
    a.info, a.reward_parts = {"prompt": "1+1", "nested": [1.5, {"x": None}]}, {"exact_match": 1.0}
    b.loss_mask, b.token_versions, b.reward = [1, 0], [3, 4], 1 / 3
    c.logprobs = []  # an SFT row's
    c.reward_parts = {"format": np.float32(0.5)}  # a reward function's numpy scalar: to_dict makes it a float
    back = unpack_experiences(pack_experiences([a, b, c]))
    assert [e.to_dict() for e in back] == [e.to_dict() for e in (a, b, c)]
    assert type(back[2].reward_parts["format"]) is float
    assert back[0].logprobs[0] == 0.30000000000000004 and back[1].reward == 1 / 3
    assert unpack_experiences(pack_experiences([])) == []


def test_a_checkpoint_packs_1024_token_experiences_in_6_kb_each(tmp_path):
    """state.json held each as JSON numbers: 18,544 bytes (a token id ~8 characters, a float32
    log-prob ~21); packed, the bytes of their arrays and one JSON text of the small fields."""
    buf = replay_with_used(8, long_experiences)
    latest = save(tmp_path, buf)
    data = (latest.path / EXPERIENCES_FILE).read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")  # safetensors: its length, then the header
    fields = [{"group_id": e.group_id, "task_id": e.task_id, "sampling": e.sampling, "info": {}, "reward_parts": {}}
              for e in long_experiences(4) * 2]
    # a token id 4 bytes (int32: below 151,000), a log-prob 4 (float32), 4 lengths, prompt_length,
    # policy_version and reward 8 each: 1024 x 4 + 512 x 4 + 4 x 8 + 3 x 8 = 6200 bytes an experience
    assert len(data) - header == 8 * 6200 + len(json.dumps(fields))
    assert manifest.read(latest.path)[0]["files"][EXPERIENCES_FILE][0] == len(data)  # sealed with the rest
    assert latest.state["buffer"] == {"items": 4, "item_seqs": [4, 5, 6, 7], "next_seq": 8,
                                      "used": [{"seq": s, "uses": 1, "cooldown_left": 0.0} for s in range(4)],
                                      "experiences": EXPERIENCES_FILE}
    assert restored(tmp_path, latest).state() == buf.state()


def test_unpacking_holds_little_beside_the_experiences_it_makes():
    """A restore's memory beyond the experiences it gives back (which the queue then holds): the
    arrays read from the file, about the file's size. It held a list of every token besides (8 bytes
    a token): 2.3 x the file's size here, now under 1.5 x. (4,096 experiences of 4,096 tokens, a
    129 MiB file, held in 1,030 MiB: a restore's peak was 1,413 MiB, now 1,287.)"""
    import tracemalloc

    data = pack_experiences(long_experiences(32, 2048, 2048))
    tracemalloc.start()
    try:
        out = unpack_experiences(data)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(out) == 32 and len(out[0].tokens) == 4096
    assert peak - held < 1.5 * len(data), (peak - held) / len(data)


def test_a_plain_queue_packs_its_unread_experiences_and_an_empty_one_writes_no_file(tmp_path):
    """A run a step ahead (sync_offset=1) checkpoints the step it explored and has not trained on."""
    buf = QueueBuffer(buf_cfg())
    buf.put(exps(3))
    buf.get(1, timeout=0)
    stages = stage(tmp_path, buf)
    state, files = stages.buffer_state(buf)
    assert state == {"items": 2, "experiences": EXPERIENCES_FILE} and unpack_experiences(files[EXPERIENCES_FILE]) == exps(2, 1)
    stages.write(2, {"buffer": state}, None, print, files)
    latest = checkpoint.read_checkpoint(tmp_path / "checkpoints" / "step_2")
    again = QueueBuffer(buf_cfg())
    stages.restore_buffer(again, latest.state["buffer"], latest)
    assert again.get(3, timeout=0) == exps(2, 1)
    buf.get(2, timeout=0)  # trained on all it explored: nothing to keep
    assert stages.buffer_state(buf) == ({"items": 0}, {})
    stages.write(3, {"buffer": {"items": 0}}, None, print, {})
    latest = checkpoint.read_checkpoint(tmp_path / "checkpoints" / "step_3")
    assert sorted(p.name for p in latest.path.iterdir()) == ["manifest.json", "state.json"]
    stages.restore_buffer(again, latest.state["buffer"], latest)
    assert len(again) == 0


def test_a_byte_changed_in_the_packed_experiences_is_damage_named(tmp_path):
    latest = save(tmp_path, replay_with_used(4))
    path = latest.path / EXPERIENCES_FILE
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    assert checkpoint.damage(latest) == f"{path}: its contents are not the ones saved (their digest differs)"


def test_a_checkpoint_of_the_json_form_still_restores(tmp_path):
    """Written before the experiences were packed: state.json holds them (QueueBuffer.state)."""
    buf = replay_with_used(4)
    checkpoint.write(tmp_path, 2, {"buffer": buf.state()})
    latest = checkpoint.read_checkpoint(tmp_path / "checkpoints" / "step_2")
    assert len(latest.state["buffer"]["items"]) == 2 and not (latest.path / EXPERIENCES_FILE).exists()
    assert restored(tmp_path, latest).state() == buf.state()


def resealed(latest: checkpoint.Checkpoint, edit) -> checkpoint.Checkpoint:
    """`latest` with state.json edited by `edit(buffer state)` and its manifest sealed again."""
    state = json.loads((latest.path / "state.json").read_text())
    edit(state["buffer"])
    (latest.path / "state.json").write_text(json.dumps(state))
    manifest.seal(latest.path, {"step": latest.step})
    again = checkpoint.read_checkpoint(latest.path)
    assert checkpoint.damage(again) is None  # the seal hides the edit: only the restore can tell
    return again


def refusal(path, why: str, ckpt) -> str:
    return (f"{path}: the buffer's part of checkpoint step 2 does not restore ({why}); rft writes it whole, so it was "
            f"edited or damaged since (and the checkpoint's manifest sealed again). Put it back as it was, or move "
            f"{ckpt} away to resume from the checkpoint before it, or start this stage again "
            f"(continue_from_checkpoint=false).")


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("edit, why", [
    (lambda u: u.pop("uses"), """its "used" entry 0 ({"seq": 0, "cooldown_left": 0.0}) has no 'uses'"""),
    (lambda u: u.update(seq="0"), """its "used" entry 0 ({"seq": "0", "uses": 1, "cooldown_left": 0.0}) "seq" is """
                                  """not a whole number"""),
    # 0 uses: read back as unread, it was a new experience again (no error, another priority)
    (lambda u: u.update(uses=0), """its "used" entry 0 ({"seq": 0, "uses": 0, "cooldown_left": 0.0}) "uses" is not """
                                 """a whole number of 1 or more"""),
    (lambda u: u.update(cooldown_left=None), """its "used" entry 0 ({"seq": 0, "uses": 1, "cooldown_left": null}) """
                                             """"cooldown_left" is not a number of seconds, 0 or more"""),
])
def test_a_hand_edited_used_entry_is_one_paragraph_naming_the_file_and_entry(tmp_path, packed, edit, why):
    """Before, a raw KeyError ('uses') from QueueBuffer.restore, or a TypeError at the trainer's
    first read of the buffer, mid-run."""
    buf = replay_with_used(4)
    if packed:
        latest = save(tmp_path, buf)
    else:
        checkpoint.write(tmp_path, 2, {"buffer": buf.state()})
        latest = checkpoint.read_checkpoint(tmp_path / "checkpoints" / "step_2")
    latest = resealed(latest, lambda b: edit(b["used"][0]))
    with pytest.raises(RunError) as e:
        restored(tmp_path, latest)
    assert str(e.value) == refusal(latest.path / "state.json", why, latest.path)


def test_a_used_entry_without_its_experience_is_named(tmp_path):
    buf = replay_with_used(4)
    checkpoint.write(tmp_path, 2, {"buffer": buf.state()})
    latest = resealed(checkpoint.read_checkpoint(tmp_path / "checkpoints" / "step_2"),
                      lambda b: b["used"][1]["exp"].pop("tokens"))
    with pytest.raises(RunError) as e:
        restored(tmp_path, latest)
    why = ("""its "used" entry 1's "exp" is not a stored experience (TypeError: Experience.__init__() missing 1 """
           """required positional argument: 'tokens')""")
    assert str(e.value) == refusal(latest.path / "state.json", why, latest.path)


@pytest.mark.parametrize("edit, why", [
    (lambda b: b.update(items=9), """its "items" (9) is not a whole number from 0 to the 4 experiences stored"""),
    (lambda b: b["used"].pop(), """its "used" is not a list of 2 entries (one a used experience)"""),
    (lambda b: b.update(experiences="../../x.safetensors"),
     """its "experiences" (../../x.safetensors) is not the name of a .safetensors file beside it"""),
])
def test_a_packed_state_that_does_not_match_its_file_is_named(tmp_path, edit, why):
    latest = resealed(save(tmp_path, replay_with_used(4)), edit)
    with pytest.raises(RunError) as e:
        restored(tmp_path, latest)
    assert str(e.value) == refusal(latest.path / "state.json", why, latest.path)


@pytest.mark.parametrize("arrays, why", [
    # one token id fewer than the lengths say
    (lambda a: a.update(tokens=a["tokens"][:-1]), "its 'tokens' is not lists of the 4 experiences its 'fields' lists"),
    (lambda a: a.update(tokens=a["tokens"].astype(np.float32)), "its 'tokens' is of float32, not of integers"),
    (lambda a: a.update(prompt_length=np.full(4, 9, dtype=np.int64)),
     "experience 0 is not a stored experience (ValueError: prompt_length 9 is not a whole number from 1 to the 4 tokens)"),
    (lambda a: a.update(fields=np.frombuffer(b"[1, 2", dtype=np.uint8)),
     "not a safetensors file of experiences (JSONDecodeError: Expecting ',' delimiter: line 1 column 6 (char 5))"),
])
def test_an_edited_experiences_file_is_named(tmp_path, arrays, why):
    from safetensors.numpy import load, save as save_arrays

    latest = save(tmp_path, replay_with_used(4))
    path = latest.path / EXPERIENCES_FILE
    changed = dict(load(path.read_bytes()))
    arrays(changed)
    path.write_bytes(save_arrays(changed))
    latest = resealed(latest, lambda b: None)
    with pytest.raises(RunError) as e:
        restored(tmp_path, latest)
    assert str(e.value) == refusal(path, why, latest.path)


def measure(capacity: int, tmp) -> dict:
    """Bytes and seconds of one checkpoint of a replay buffer of `capacity` experiences of 1,024
    tokens, half of them used, as JSON in state.json and packed (written, then verified and read)."""
    buf = replay_with_used(capacity, long_experiences)
    out = {}
    for how in ("json", "packed"):
        d = tmp / f"{how}{capacity}"
        t0 = time.perf_counter()
        if how == "json":
            checkpoint.write(d, 1, {"buffer": buf.state()})
        else:
            state, data = buf.stored_state()
            checkpoint.write(d, 1, {"buffer": state}, files={EXPERIENCES_FILE: data})
        t1 = time.perf_counter()
        latest = checkpoint.read_checkpoint(d / "checkpoints" / "step_1")
        assert checkpoint.damage(latest) is None
        restored(d, latest)
        t2 = time.perf_counter()
        size = sum(f.stat().st_size for f in latest.path.iterdir())
        out[how] = (size, t1 - t0, t2 - t1)
    return out


if __name__ == "__main__":
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        for capacity in (256, 4096):
            for how, (size, write_s, read_s) in measure(capacity, Path(tmp)).items():
                print(f"capacity {capacity:5d} {how:6s}: {size:>10,d} bytes ({size / capacity:,.0f} an experience), "
                      f"save {write_s:.2f} s, verify and restore {read_s:.2f} s")
