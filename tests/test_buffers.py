"""The experience buffers: one interface over queue, sql and file storage; replay; the viewer."""

import json
import pickle
import subprocess
import sys
import threading
import time
from dataclasses import fields

import pytest
from conftest import ROOT
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from rft.config import ExperienceBufferConfig
from rft.data.buffer import (
    BUFFERS,
    FileBuffer,
    QueueBuffer,
    SQLBuffer,
    count_experiences,
    make_buffer,
    read_experiences,
)
from rft.data.experience import Experience, is_experience_file
from rft.errors import ConfigError

WHERE = "buffer.trainer_input.experience_buffer"


def buf_cfg(storage_type="queue", **keys):
    """The schema's buffer config with dotted `keys` set, e.g. **{"replay_buffer.enable": True}."""
    cfg = OmegaConf.structured(ExperienceBufferConfig(storage_type=storage_type))
    for key, value in keys.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def exps(n, start=0):
    return [
        Experience(tokens=[i, i + 1, i + 2, i + 3], prompt_length=2, logprobs=[-0.1 * i, -1 / 3],
                   reward=i / 7, group_id=f"g{i // 2}", task_id=f"t{i}", policy_version=i)
        for i in range(start, start + n)
    ]


def ids(batch):
    return [e.task_id for e in batch]


@pytest.fixture(params=sorted(BUFFERS))
def storage(request, tmp_path):
    """A fresh buffer of each storage type."""
    path = {"queue": None, "sql": str(tmp_path / "b.db"), "file": str(tmp_path / "b.jsonl")}[request.param]
    buf = make_buffer(buf_cfg(request.param, path=path))
    yield buf
    buf.close()


def test_experience_round_trip_is_exact():
    e = Experience(tokens=[5, 6, 7, 8], prompt_length=1, logprobs=[0.1 + 0.2, -1e-300, -2 / 3], reward=1 / 3,
                   group_id="g", task_id="t", policy_version=4, info={"prompt": "1+1", "nested": [1.5, {"a": None}]})
    d = json.loads(json.dumps(e.to_dict()))
    assert set(d) == {f.name for f in fields(Experience)}  # every field, whatever is added later
    back = Experience.from_dict(d)
    assert back == e
    assert back.logprobs[0] == 0.30000000000000004 and back.reward == 1 / 3  # bit for bit


def test_every_storage_keeps_the_reward_parts(storage):
    # rft/rewards/scoring.py: the reward is the weighted sum, the parts are stored beside it
    batch = exps(3)
    for e in batch:
        e.reward_parts = {"exact_match": 1.0, "format/tags": 0.5}
    storage.put(batch)
    if isinstance(storage, QueueBuffer):  # a checkpoint of a queue holds its unread experiences
        restored = make_buffer(buf_cfg("queue"))
        restored.restore(pickle.loads(pickle.dumps(storage.state())))
        assert [e.reward_parts for e in restored.get(3, timeout=1)] == [e.reward_parts for e in batch]
    got = storage.get(3, timeout=1)
    assert [e.reward_parts for e in got] == [{"exact_match": 1.0, "format/tags": 0.5}] * 3


def test_put_then_get_in_order(storage):
    storage.put(exps(4))
    storage.put(exps(6, start=4))
    assert len(storage) == 10
    got = storage.get(10, timeout=1)
    assert got == exps(10)
    assert len(storage) == 0


def test_get_returns_what_is_there_after_the_timeout(storage):
    storage.put(exps(3))
    t0 = time.monotonic()
    got = storage.get(5, timeout=0.3)
    assert ids(got) == ["t0", "t1", "t2"]
    assert time.monotonic() - t0 >= 0.3


def test_get_on_empty_is_a_timeout_error(storage):
    message = (f"buffer 'experience_buffer': no experiences arrived within 0.1s (wanted 2). The writer "
               f"(explorer) may have stopped or be slow; raise {WHERE}.max_read_timeout to wait longer.")
    with pytest.raises(TimeoutError) as e:
        storage.get(2, timeout=0.1)
    assert str(e.value) == message


def test_state_and_restore(storage):
    storage.put(exps(10))
    assert ids(storage.get(3, timeout=1)) == ["t0", "t1", "t2"]
    state = json.loads(json.dumps(storage.state()))  # what a checkpoint stores
    assert ids(storage.get(2, timeout=1)) == ["t3", "t4"]
    storage.restore(state)
    assert len(storage) == 7
    assert ids(storage.get(7, timeout=1)) == [f"t{i}" for i in range(3, 10)]


def test_sql_state_values(tmp_path):
    buf = SQLBuffer(buf_cfg("sql", path=str(tmp_path / "b.db")))
    assert buf.state() == {"cursor": 0, "last_id": 0}
    buf.put(exps(5))
    buf.get(2, timeout=1)
    assert buf.state() == {"cursor": 2, "last_id": 5}


def test_sql_cursor_survives_a_restart(tmp_path):
    cfg = buf_cfg("sql", path=str(tmp_path / "b.db"))
    first = SQLBuffer(cfg)
    first.put(exps(10))
    assert ids(first.get(4, timeout=1)) == ["t0", "t1", "t2", "t3"]
    first.close()
    again = SQLBuffer(cfg)  # a restarted reader
    assert len(again) == 6
    assert ids(again.get(2, timeout=1)) == ["t4", "t5"]
    # a reader of another name has its own cursor
    other = SQLBuffer(buf_cfg("sql", path=str(tmp_path / "b.db"), name="other"))
    assert ids(other.get(1, timeout=1)) == ["t0"]
    # read_experiences and count_experiences read without moving any cursor
    assert ids(read_experiences(str(tmp_path / "b.db"), limit=3, offset=1)) == ["t1", "t2", "t3"]
    assert count_experiences(str(tmp_path / "b.db")) == 10
    assert ids(again.get(1, timeout=1)) == ["t6"]


def test_sql_truncate_after(tmp_path):
    buf = SQLBuffer(buf_cfg("sql", path=str(tmp_path / "b.db")))
    buf.put(exps(5))
    checkpoint = buf.state()
    assert checkpoint["last_id"] == 5
    buf.put(exps(3, start=5))  # written after the checkpoint
    assert buf.truncate_after(checkpoint["last_id"]) == 3
    assert buf.truncate_after(checkpoint["last_id"]) == 0
    buf.put(exps(2, start=100))  # rewritten: new ids, never the deleted ones
    assert buf.state()["last_id"] == 10
    assert ids(buf.get(10, timeout=0.2)) == ["t0", "t1", "t2", "t3", "t4", "t100", "t101"]


def test_file_truncate_after(tmp_path):
    buf = FileBuffer(buf_cfg("file", path=str(tmp_path / "b.jsonl")))
    buf.put(exps(5))
    checkpoint = buf.state()
    assert checkpoint["last_id"] == (tmp_path / "b.jsonl").stat().st_size
    buf.put(exps(3, start=5))  # written after the checkpoint
    assert buf.truncate_after(checkpoint["last_id"]) == 3
    assert buf.truncate_after(checkpoint["last_id"]) == 0
    buf.put(exps(2, start=100))
    assert ids(buf.get(10, timeout=0.2)) == ["t0", "t1", "t2", "t3", "t4", "t100", "t101"]


@pytest.mark.parametrize("kind", ["sql", "file"])
def test_the_unread_digest_sees_a_changed_unread_experience_only(tmp_path, kind):
    """What a checkpoint records of the experiences it explored ahead (rft.runtime.saving): a row
    read before it, or written after it, is not in it; a changed token id of one still to be read is."""
    import sqlite3

    path = tmp_path / ("b.db" if kind == "sql" else "b.jsonl")
    buf = make_buffer(buf_cfg(kind, path=str(path)))
    buf.put(exps(6))
    buf.get(2, timeout=1)  # t0, t1 read; t2..t5 unread
    state = buf.state()
    span = (state.get("cursor", state.get("offset")), state["last_id"])
    before = buf.unread_digest(*span)
    buf.put(exps(1, start=50))  # after the checkpoint

    def edit(old: str, new: str) -> None:  # one token id, in place
        if kind == "sql":
            with sqlite3.connect(path) as c:
                c.execute("UPDATE experiences SET tokens = ? WHERE tokens = ?", (new, old))
        else:
            path.write_bytes(path.read_bytes().replace(f'"tokens": {old}'.encode(), f'"tokens": {new}'.encode()))

    edit("[1, 2, 3, 4]", "[1, 2, 3, 9]")  # t1's, read already
    reopened = make_buffer(buf_cfg(kind, path=str(path)))  # as a resumed run opens it
    assert reopened.unread_digest(*span) == before
    edit("[5, 6, 7, 8]", "[5, 6, 7, 9]")  # t5's, unread
    assert reopened.unread_digest(*span) != before
    buf.close(), reopened.close()


def test_the_unread_digest_holds_across_a_column_a_later_version_adds(tmp_path, monkeypatch):
    """A checkpoint's digest of a SQLite buffer's unread rows, resumed by an rft whose table has one
    more column (as `sampling` and `extra` were added): opening the file adds it (NULL in every
    stored row), and the digest of the rows the checkpoint counted on is still theirs; a false
    alarm would stop a legitimate resume, with no key to go on."""
    import sqlalchemy as sa

    import rft.data.buffer as B

    path = tmp_path / "b.db"
    buf = make_buffer(buf_cfg("sql", path=str(path)))
    buf.put(exps(6))
    buf.get(2, timeout=1)  # cursor 2, last_id 6: rows 3..6 unread
    before = buf.unread_digest(2, 6)
    buf.close()
    newer = B._experiences.to_metadata(sa.MetaData())
    newer.append_column(sa.Column("later", sa.Text))
    monkeypatch.setattr(B, "_experiences", newer)
    reopened = make_buffer(buf_cfg("sql", path=str(path)))  # ALTER TABLE experiences ADD COLUMN later
    with reopened.engine.connect() as c:
        assert "later" in {r[1] for r in c.exec_driver_sql("PRAGMA table_info(experiences)")}
    assert reopened.unread_digest(2, 6) == before
    with reopened.engine.begin() as c:  # and a changed reward of an unread row is still seen
        c.exec_driver_sql("UPDATE experiences SET reward = reward + 1 WHERE id = 4")
    assert reopened.unread_digest(2, 6) != before
    reopened.close()


def test_sql_path_forms(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    SQLBuffer(buf_cfg("sql", path="~/deep/dir/b.db")).put(exps(1))
    assert (tmp_path / "deep" / "dir" / "b.db").is_file()
    buf = SQLBuffer(buf_cfg("sql", path=f"sqlite:///{tmp_path}/u/b.db"))
    buf.put(exps(2))
    assert ids(read_experiences(f"sqlite:///{tmp_path}/u/b.db", limit=5)) == ["t0", "t1"]


def test_sql_and_file_buffers_survive_pickling(tmp_path):
    """A copy sent to another process (a Ray actor) opens the same storage and reads on."""
    for buf in (SQLBuffer(buf_cfg("sql", path=str(tmp_path / "b.db"))),
                FileBuffer(buf_cfg("file", path=str(tmp_path / "b.jsonl")))):
        buf.put(exps(4))
        buf.get(1, timeout=1)
        copy = pickle.loads(pickle.dumps(buf))
        assert ids(copy.get(1, timeout=1)) == ["t1"]


def test_file_buffer_waits_for_a_half_written_line(tmp_path):
    path = tmp_path / "b.jsonl"
    buf = FileBuffer(buf_cfg("file", path=str(path)))
    buf.put(exps(2))
    line = json.dumps(exps(1, start=2)[0].to_dict()) + "\n"
    with open(path, "a") as f:  # another writer, half way through its line
        f.write(line[:10])
    assert len(buf) == 2
    assert ids(buf.get(3, timeout=0.2)) == ["t0", "t1"]
    with pytest.raises(TimeoutError):
        buf.get(1, timeout=0.1)
    with open(path, "a") as f:
        f.write(line[10:])
    assert ids(buf.get(1, timeout=0.2)) == ["t2"]


def test_file_buffer_cuts_a_line_left_by_a_killed_writer(tmp_path):
    path = tmp_path / "b.jsonl"
    buf = FileBuffer(buf_cfg("file", path=str(path)))
    buf.put(exps(1))
    with open(path, "a") as f:
        f.write('{"tokens": [1, 2')  # a writer killed mid-line; the next put holds the lock
    buf.put(exps(1, start=1))
    assert [json.loads(line)["task_id"] for line in path.read_text().splitlines()] == ["t0", "t1"]
    assert ids(buf.get(5, timeout=0.1)) == ["t0", "t1"]


def test_a_damaged_line_of_a_file_buffer_is_named_and_nothing_is_read_past_it(tmp_path):
    from rft.errors import RunError

    path = tmp_path / "b.jsonl"
    buf = FileBuffer(buf_cfg("file", path=str(path)))
    buf.put(exps(2))
    lines = path.read_text().splitlines(keepends=True)
    buf.put(exps(2, start=2))
    assert ids(buf.get(2, timeout=0.1)) == ["t0", "t1"]
    # line 4 (t3), not yet read, damaged in the middle of the file's unread part
    text = path.read_text().splitlines(keepends=True)
    text[3] = text[3][:20] + "#" + text[3][21:]
    path.write_text("".join(text))
    with pytest.raises(RunError) as e:
        buf.get(2, timeout=0.1)
    assert str(e.value).startswith(f"the buffer {path}: line 4 is not a stored experience (JSONDecodeError: ")
    assert buf.state()["offset"] == len("".join(lines))  # the read did not move past t2 and t3
    # a line that is JSON but not an experience
    text[3] = '{"tokenz": [1, 2]}\n'
    path.write_text("".join(text))
    with pytest.raises(RunError, match=r"line 4 is not a stored experience \(TypeError: "):
        buf.get(2, timeout=0.1)


def test_a_sql_buffer_damaged_while_in_use_is_named(tmp_path):
    from rft.errors import RunError

    path = tmp_path / "b.db"
    buf = SQLBuffer(buf_cfg("sql", path=str(path)))
    big = [Experience(list(range(50)), 10, [0.0] * 40, task_id=f"t{i}", info={"pad": "x" * 200}) for i in range(200)]
    buf.put(big)
    buf.close()
    # the last pages (rows), not the header or the schema that opening reads, overwritten
    data = bytearray(path.read_bytes())
    for page in range(len(data) // 4096 - 3, len(data) // 4096):
        data[page * 4096: page * 4096 + 100] = b"\xff" * 100
    path.write_bytes(data)
    buf = SQLBuffer(buf_cfg("sql", path=str(path)))
    with pytest.raises(RunError) as e:
        buf.get(200, timeout=0.1)
    assert str(e.value).startswith(f"the buffer {path} is damaged (database disk image is malformed), so its "
                                   f"experiences cannot be read or written.")
    assert buf.cursor == 0  # nothing counted as read


def test_queue_put_waits_for_room(tmp_path):
    buf = QueueBuffer(buf_cfg(capacity=4, max_read_timeout=10))
    buf.put(exps(4))
    writer = threading.Thread(target=buf.put, args=(exps(2, start=4),))
    writer.start()
    time.sleep(0.2)
    assert writer.is_alive() and len(buf) == 4  # blocked: 4 + 2 > capacity
    assert ids(buf.get(2, timeout=1)) == ["t0", "t1"]
    writer.join(timeout=5)
    assert not writer.is_alive()
    assert ids(buf.get(4, timeout=1)) == ["t2", "t3", "t4", "t5"]


def test_queue_put_without_a_reader_times_out():
    buf = QueueBuffer(buf_cfg(capacity=4, max_read_timeout=0.2))
    buf.put(exps(3))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as e:
        buf.put(exps(2, start=3))
    assert time.monotonic() - t0 >= 0.2
    assert str(e.value) == (
        f"buffer 'experience_buffer' is full (4 unread experiences) and no reader made room within 0.2s. "
        f"The trainer may have stopped; raise {WHERE}.capacity or {WHERE}.max_read_timeout if it is only slow."
    )
    assert len(buf) == 3  # nothing of the failed put went in


def test_queue_put_larger_than_capacity_is_a_config_error():
    buf = QueueBuffer(buf_cfg(capacity=4))
    with pytest.raises(ConfigError) as e:
        buf.put(exps(5))
    assert str(e.value) == (
        f"{WHERE}.capacity=4 is smaller than one write of 5 experiences, which could never fit. "
        f"Raise {WHERE}.capacity to at least 5."
    )


def two_writers(buf, ours: str, theirs: str):
    """This writer's rows and another's, interleaved after a checkpoint of 2 rows of each."""
    def rows(start, group):
        out = exps(2, start=start)
        for e in out:
            e.group_id = group
        return out

    buf.put(rows(0, ours) + rows(2, theirs))
    checkpoint = buf.state()
    buf.put(rows(4, ours))
    buf.put(rows(6, theirs))
    buf.put(rows(8, ours))
    return checkpoint


@pytest.mark.parametrize("kind", ["sql", "file"])
def test_a_resumed_writer_keeps_its_rows_after_the_checkpoint_and_writes_only_the_rest(tmp_path, kind):
    """A resumed mode=explore run removes nothing: its rows after the checkpoint stay, and exploring
    their step again it leaves out, per group, as many rows as are stored (a write killed midway
    stored the first of each group); another writer's rows are never its own."""
    path = str(tmp_path / ("b.db" if kind == "sql" else "b.jsonl"))
    buf = make_buffer(buf_cfg(kind, path=path))
    checkpoint = two_writers(buf, ours="2/77/a", theirs="2/99/a")  # t4 t5 and t8 t9 ours after it
    resumed = make_buffer(buf_cfg(kind, path=path))
    assert resumed.keep_written(checkpoint["last_id"], lambda g: g == "2/77/a") == 4
    # its step explored again: t4 t5 t8 t9 stored, t10 of the same group not (the write was cut
    # before it), t11 of the next step
    again = [e for e in exps(8, start=4) if e.task_id not in ("t6", "t7")]
    for e in again:
        e.group_id = "3/77/a" if e.task_id == "t11" else "2/77/a"
    resumed.put(again)
    reader = make_buffer(buf_cfg(kind, path=path))
    # the first 4 of group 2/77/a are left out, as 4 are stored; t10 and t11 written
    assert ids(reader.get(20, timeout=0.2)) == [f"t{i}" for i in range(12)]
    resumed.put(exps(1, start=100))  # past what was stored: written
    assert ids(reader.get(20, timeout=0.2)) == ["t100"]


def test_a_file_writer_resumed_after_a_cut_line_keeps_the_whole_lines(tmp_path):
    buf = FileBuffer(buf_cfg("file", path=str(tmp_path / "b.jsonl")))
    checkpoint = two_writers(buf, ours="2/77/a", theirs="2/99/a")
    with open(tmp_path / "b.jsonl", "ab") as f:
        f.write(b'{"tokens": [1')  # a write killed midway: no newline, and no group
    assert buf.keep_written(checkpoint["last_id"], lambda g: g == "2/77/a") == 4
    buf.put(exps(1, start=100))
    assert (tmp_path / "b.jsonl").read_bytes().endswith(b"\n")
    assert ids(buf.get(20, timeout=0.2)) == ["t0", "t1", "t2", "t3", "t4", "t5", "t6", "t7", "t8", "t9", "t100"]


def big_rows(n: int, start: int = 0, tokens: int = 20_000) -> list:
    """n experiences of `tokens` token ids each (a line of ~140 KB in a file buffer), 2 a group."""
    out = exps(n, start)
    for e in out:
        e.tokens, e.logprobs = list(range(tokens)), [-0.5] * (tokens - e.prompt_length)
    return out


@pytest.mark.slow  # 1.9 s alone, over the fast tier's second
def test_a_resumed_file_writer_reads_the_rows_after_its_checkpoint_a_line_at_a_time(tmp_path):
    """keep_written over 40 lines of ~140 KB each (5.6 MB after the checkpoint; in a run other
    explorers' rows among them, written while this one was down): Python's allocations peak at
    about one line and its parsed JSON (under 3 MB), where reading the rows whole peaked at 19.9 MB
    (at 4,096 rows of 4,096 tokens, a 296 MB file: 564 MiB more RSS)."""
    import tracemalloc

    path = tmp_path / "b.jsonl"
    buf = FileBuffer(buf_cfg("file", path=str(path)))
    buf.put(big_rows(40))
    assert path.stat().st_size > 5_000_000
    resumed = FileBuffer(buf_cfg("file", path=str(path)))
    tracemalloc.start()
    try:
        kept = resumed.keep_written(0, lambda g: g in ("g0", "g19"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert kept == 4  # groups g0 (t0, t1) and g19 (t38, t39)
    assert peak < 3_000_000, peak


def test_a_damaged_line_far_into_a_file_buffer_is_named_without_reading_the_file_before_it(tmp_path):
    """The message's line number is counted a MiB at a time: the 40 lines of ~140 KB read before
    the damaged one (5.6 MB) were read whole to count them (a peak of 10 MB); now under 3 MB (a
    chunk, the next one read, and the line)."""
    import tracemalloc

    from rft.errors import RunError

    path = tmp_path / "b.jsonl"
    buf = FileBuffer(buf_cfg("file", path=str(path)))
    buf.put(big_rows(40))
    assert ids(buf.get(40, timeout=0.1))[-1] == "t39"
    with open(path, "ab") as f:
        f.write(b"not json\n")
    tracemalloc.start()
    try:
        with pytest.raises(RunError) as e:
            buf.get(1, timeout=0.1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(e.value).startswith(f"the buffer {path}: line 41 is not a stored experience (JSONDecodeError: ")
    assert peak < 3_000_000, peak


LIVE_READER = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, "tests")
from test_buffers import buf_cfg
from rft.data.buffer import make_buffer
kind, path, signals = sys.argv[1], sys.argv[2], Path(sys.argv[3])
buf = make_buffer(buf_cfg(kind, path=path))
got = [e.task_id for e in buf.get(3, timeout=10)]
(signals / "read").write_text("")
while not (signals / "go").exists():
    time.sleep(0.01)
try:
    while True:
        got += [e.task_id for e in buf.get(1, timeout=1)]
except TimeoutError:
    pass
print(json.dumps(got))
"""


@pytest.mark.slow  # 3.3 s alone, over the fast tier's second
@pytest.mark.parametrize("kind", ["sql", "file"])
def test_a_trainer_reading_live_reads_each_row_once_across_an_explorers_resume(tmp_path, kind):
    """README's explore/train split: a mode=train job reads the buffer while the mode=explore run
    is killed after explore step 2's rows, before their checkpoint, and resumes. Before, the resume
    removed those rows and wrote them again: the reader, past the first of them, read 'own0' twice
    (sql: its id above the reader's cursor again), or, in a file, read 'own0' twice and never 'oth0'
    (its byte offset now mid-file; exit 0) or, where the lines differ in length, from the middle of
    a line (RunError: line 3 is not a stored experience)."""
    path = str(tmp_path / ("b.db" if kind == "sql" else "b.jsonl"))

    def rows(*names, group):
        return [Experience(tokens=[0, 1, 2, 3], prompt_length=1, logprobs=[-0.5] * 3, task_id=n, group_id=group)
                for n in names]

    ours = "2/77/a"
    explorer = make_buffer(buf_cfg(kind, path=path))
    explorer.put(rows("c0", "c1", group="1/77/a"))
    checkpoint = explorer.state()  # the explorer's checkpoint of step 1
    explorer.put(rows("own0", "own1", group=ours))  # explore step 2, killed before its checkpoint
    make_buffer(buf_cfg(kind, path=path)).put(rows("oth0", "oth1", group="2/99/a"))  # another explorer
    reader = subprocess.Popen([sys.executable, "-c", LIVE_READER, kind, path, str(tmp_path)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    while not (tmp_path / "read").exists():  # it has read c0, c1, own0
        assert reader.poll() is None
        time.sleep(0.01)
    resumed = make_buffer(buf_cfg(kind, path=path))  # what rft.runtime.saving.restore_buffer does
    assert resumed.keep_written(checkpoint["last_id"], lambda g: g == ours) == 2
    resumed.put(rows("own0", "own1", group=ours))  # explore step 2 again
    resumed.put(rows("next0", "next1", group="3/77/a"))
    (tmp_path / "go").write_text("")
    read = json.loads(reader.communicate(timeout=60)[0])
    assert read == ["c0", "c1", "own0", "own1", "oth0", "oth1", "next0", "next1"]
    assert [e.task_id for e in read_experiences(path, 20)] == read


def test_own_groups_knows_this_runs_group_ids_from_another_explorers():
    """A group id is <explore step>/<step_seed(seed, step, salt)>/<task>: salt 1000 x the shard
    (+ 100 + tries under DAPO's dynamic sampling)."""
    from rft.data.readers import step_seed
    from rft.runtime.saving import own_groups

    cfg = OmegaConf.create({"seed": 42, "explorer": {"rollout_model": {"engine_num": 2}}})
    own = own_groups(cfg, first_step=2)
    assert own(f"2/{step_seed(42, 2)}/t0") and own(f"3/{step_seed(42, 3)}/t0")
    assert own(f"2/{step_seed(42, 2, salt=1000)}/t0")  # the second explorer's
    assert own(f"2/{step_seed(42, 2, salt=1000 + 100 + 3)}/t0")  # its fourth DAPO try
    assert not own(f"2/{step_seed(42, 2, salt=2000)}/t0")  # a third explorer's: this run has two
    assert not own(f"2/{step_seed(43, 2)}/t0") and not own(f"2/{step_seed(7, 2)}/t0")  # another run's seed
    assert not own(f"1/{step_seed(42, 1)}/t0")  # before the checkpoint's next explore step
    assert not own("g1") and not own("2/x/t0") and not own("")


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def replay_buffer(clock, cooldown, **keys):
    cfg = buf_cfg(**{"replay_buffer.enable": True, "replay_buffer.reuse_cooldown_time": cooldown, **keys})
    return QueueBuffer(cfg, clock=clock)


def test_replay_cooldown():
    clock = FakeClock()
    buf = replay_buffer(clock, cooldown=10.0)
    buf.put(exps(1))
    assert ids(buf.get(1, timeout=0)) == ["t0"]
    assert len(buf) == 0  # read, now cooling down
    with pytest.raises(TimeoutError):
        buf.get(1, timeout=0.1)
    clock.t += 9.9
    with pytest.raises(TimeoutError):
        buf.get(1, timeout=0.1)
    clock.t += 0.2
    assert ids(buf.get(1, timeout=0)) == ["t0"]


def test_replay_without_cooldown_reads_once():
    buf = replay_buffer(FakeClock(), cooldown=None)
    buf.put(exps(2))
    assert ids(buf.get(2, timeout=0)) == ["t1", "t0"]  # policy_version 1 before 0
    with pytest.raises(TimeoutError):
        buf.get(1, timeout=0.1)


def test_replay_linear_decay_priority():
    buf = replay_buffer(FakeClock(), cooldown=0.0, **{"replay_buffer.priority_fn_args": {"decay": 2.0}})
    a, b, c = exps(3)
    a.policy_version, b.policy_version, c.policy_version = 5, 4, 1
    buf.put([a, b, c])
    # priority = policy_version - 2 * times_used: a 5, b 4, c 1
    assert ids(buf.get(2, timeout=0)) == ["t0", "t1"]
    # a 5-2=3, b 4-2=2, c 1
    assert ids(buf.get(3, timeout=0)) == ["t0", "t1", "t2"]
    # a 5-4=1, b 4-4=0, c 1-2=-1, and a new d (version 1) ties with a: the older, a, first
    d = exps(1, start=3)[0]
    d.policy_version = 1
    buf.put([d])
    assert ids(buf.get(4, timeout=0)) == ["t0", "t3", "t1", "t2"]


def test_replay_used_experiences_make_room():
    """Over capacity, the lowest-priority used experiences go; unread ones are never dropped."""
    buf = replay_buffer(FakeClock(), cooldown=0.0, capacity=3, max_read_timeout=0.1)
    buf.put(exps(3))  # versions 0, 1, 2
    buf.get(3, timeout=0)  # all used once: priorities -2, -1, 0
    buf.put(exps(2, start=3))  # drops t0 and t1, the lowest
    state = buf.state()  # what a checkpoint holds: capacity experiences at most
    assert (ids(map(Experience.from_dict, state["items"])), [u["exp"]["task_id"] for u in state["used"]]) == \
        (["t3", "t4"], ["t2"])
    assert ids(buf.get(5, timeout=0.1)) == ["t4", "t3", "t2"]


def test_a_restored_replay_buffer_reads_what_the_original_would():
    """A priority that ranks a used experience above a new one (decay -2: each use adds 2): the
    checkpoint keeps the used experience with its use count and the cooldown it has left."""
    clock_a, clock_b = FakeClock(), FakeClock()
    clock_b.t = 50.0  # another process: another monotonic clock
    a = replay_buffer(clock_a, cooldown=10.0, **{"replay_buffer.priority_fn_args": {"decay": -2.0}})
    a.put(exps(3))  # versions 0, 1, 2
    assert ids(a.get(1, timeout=0)) == ["t2"]  # priority 2, then 2 + 2 = 4, ready at 1010
    clock_a.t += 4
    state = a.state()
    assert (state["item_seqs"], state["next_seq"]) == ([0, 1], 3)
    assert [(u["seq"], u["uses"], u["cooldown_left"], u["exp"]["task_id"]) for u in state["used"]] == [(2, 1, 6.0, "t2")]
    b = replay_buffer(clock_b, cooldown=10.0, **{"replay_buffer.priority_fn_args": {"decay": -2.0}})
    b.restore(json.loads(json.dumps(state)))  # as state.json holds it
    for buf, clock in ((a, clock_a), (b, clock_b)):
        assert len(buf) == 2
        assert ids(buf.get(3, timeout=0.1)) == ["t1", "t0"]  # t2 cools down 6 s more
        clock.t += 6
        assert ids(buf.get(3, timeout=0.1)) == ["t2"]  # t1, t0 cool down 4 s more
        clock.t += 10
        # t2 2 + 2 x 2 = 6, t1 1 + 2 = 3, t0 0 + 2 = 2
        assert ids(buf.get(3, timeout=0)) == ["t2", "t1", "t0"]


def test_a_replay_buffer_restores_a_checkpoint_that_kept_unread_experiences_only():
    """A checkpoint written before used experiences were kept: its unread ones come back, oldest first."""
    buf = replay_buffer(FakeClock(), cooldown=0.0)
    buf.restore({"items": [e.to_dict() for e in exps(2)]})
    assert len(buf) == 2 and buf.state()["item_seqs"] == [0, 1] and buf.state()["used"] == []
    assert ids(buf.get(2, timeout=0)) == ["t1", "t0"]  # policy_version 1 before 0
    buf.put(exps(1, start=2))
    assert buf.state()["next_seq"] == 3


def test_unknown_priority_fn():
    with pytest.raises(ConfigError) as e:
        QueueBuffer(buf_cfg(**{"replay_buffer.enable": True, "replay_buffer.priority_fn": "fifo"}))
    assert str(e.value) == f"{WHERE}.replay_buffer.priority_fn='fifo' is not known; choose one of ['linear_decay']."


def test_make_buffer_errors(tmp_path):
    with pytest.raises(ValidationError, match=r"Invalid value 'redis', expected one of \[queue, sql, file\]"):
        make_buffer(buf_cfg("redis"))  # a closed set of names (rft.config.StorageType)
    with pytest.raises(ConfigError) as e:
        make_buffer(buf_cfg("sql"))
    assert str(e.value) == (
        f"{WHERE}.storage_type=sql needs {WHERE}.path: the SQLite file that holds the experiences. "
        f"Set it, e.g. {WHERE}.path=~/rft-buffers/experience_buffer.db, or set {WHERE}.storage_type=queue."
    )
    with pytest.raises(ConfigError) as e:
        make_buffer(buf_cfg("file"), where="here")
    assert str(e.value) == (
        "here.storage_type=file needs here.path: the JSONL file that holds the experiences. "
        "Set it, e.g. here.path=~/rft-buffers/experience_buffer.jsonl, or set here.storage_type=queue."
    )
    with pytest.raises(ConfigError, match=r"replay_buffer.enable=true works with .*storage_type=queue only"):
        make_buffer(buf_cfg("sql", path=str(tmp_path / "b.db"), **{"replay_buffer.enable": True}))


def test_is_experience_file(tmp_path):
    stored = tmp_path / "stored.jsonl"
    FileBuffer(buf_cfg("file", path=str(stored))).put(exps(1))
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text('\n{"question": "1+1", "answer": "2"}\n')
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "junk.jsonl").write_text("not json\n")
    (tmp_path / "stored.json").write_text(stored.read_text())
    assert is_experience_file(stored)
    for other in ("rows.jsonl", "empty.jsonl", "junk.jsonl", "stored.json", "missing.jsonl"):
        assert not is_experience_file(tmp_path / other), other


def view(*args):
    return subprocess.run([sys.executable, "-m", "rft.data.buffer", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_viewer_prints_prompts_and_responses(tmp_path):
    rows = exps(3)
    for i, e in enumerate(rows):
        e.info = {"prompt": f"{i}+1=", "response": f"{i + 1}"}
    rows[1].reward_parts = {"exact_match": 1.0, "format": 0.5}
    path = str(tmp_path / "b.db")
    SQLBuffer(buf_cfg("sql", path=path)).put(rows)
    r = view(path, "--limit", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == f"{path}: 3 experiences; showing 2 from offset 0"
    assert "[1] task_id=t0 group_id=g0 policy_version=0 reward=0" in r.stdout
    assert "prompt:   '0+1='" in r.stdout and "response: '1'" in r.stdout
    assert "prompt:   '1+1='" in r.stdout and "response: '2'" in r.stdout
    assert "  parts:    exact_match=1, format=0.5\n" in r.stdout  # only the row that has parts
    assert r.stdout.count("parts:") == 1
    assert "2+1=" not in r.stdout  # the third is past --limit


def test_viewer_shows_token_ids_without_texts(tmp_path):
    path = str(tmp_path / "b.jsonl")
    FileBuffer(buf_cfg("file", path=path)).put(exps(3))
    assert count_experiences(path) == 3
    r = view(path, "--limit", "1", "--offset", "2")
    assert r.returncode == 0, r.stderr
    assert "[2] task_id=t2 group_id=g1 policy_version=2" in r.stdout
    assert "prompt:   token ids [2, 3]" in r.stdout and "response: token ids [4, 5]" in r.stdout


def test_viewer_missing_path(tmp_path):
    path = str(tmp_path / "nope.db")
    r = view(path)
    assert r.returncode == 2
    assert r.stderr == f"rft.data.buffer: {path}: no such file\n"
    assert not (tmp_path / "nope.db").exists()  # looking did not create it


def test_another_tools_experiences_table_is_refused_and_left_as_it_was(tmp_path):
    # a table of that name another tool made had rft's columns added and rows written into it, found
    # only when reading them back (a RunError then)
    import sqlite3

    path = tmp_path / "theirs.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE experiences (id INTEGER PRIMARY KEY, x TEXT)")
        db.execute("INSERT INTO experiences (x) VALUES ('theirs')")
    db.close()
    with pytest.raises(ConfigError) as e:
        make_buffer(buf_cfg("sql", path=str(path)))
    assert str(e.value) == (
        f"{WHERE}.path='{path}' holds a table `experiences` that rft did not write (it has no column created_at, "
        f"policy_version, task_id, group_id, reward, prompt_length, response_length, tokens, logprobs, info; another "
        f"tool's database?). rft changes nothing in it: point {WHERE}.path at a file of its own (a new one is started "
        f"there).")
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall() == [("experiences",)]
        assert [r[1] for r in db.execute("PRAGMA table_info(experiences)")] == ["id", "x"]
        assert db.execute("SELECT * FROM experiences").fetchall() == [(1, "theirs")]
        assert db.execute("PRAGMA journal_mode").fetchone() == ("delete",)  # not switched to rft's WAL
    db.close()
