"""The sql buffer under load: four writer processes at once, and writers killed mid-write."""

import os
import signal
import subprocess
import sys
import time

import pytest
import sqlalchemy as sa
from conftest import ROOT
from omegaconf import OmegaConf

from rft.config import ExperienceBufferConfig
from rft.data.buffer import SQLBuffer, read_experiences

TXN = 100  # experiences per put (one transaction)

# argv: path, writer, count (0: until killed), experiences per put, stall. Prints the number
# committed after each commit. With stall=1, once 1000 are committed the next put inserts its
# rows, prints "stalled" and sleeps before its commit: a kill then lands inside the transaction.
WRITER = """
import sys, time
import sqlalchemy as sa
from omegaconf import OmegaConf
from rft.data.buffer import SQLBuffer
from rft.config import ExperienceBufferConfig
from rft.data.experience import Experience

path, writer, count, txn, stall = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
buf = SQLBuffer(OmegaConf.structured(ExperienceBufferConfig(storage_type="sql", path=path)))
i = 0

@sa.event.listens_for(buf.engine, "commit")
def before_commit(conn):
    if stall and i >= 1000:
        print("stalled", flush=True)
        time.sleep(600)
while count == 0 or i < count:
    buf.put([Experience(tokens=list(range(j % 50, j % 50 + 40)), prompt_length=20, logprobs=[-0.5] * 20,
                        reward=1.0, task_id=f"{writer}/{j}", policy_version=j // 1000) for j in range(i, i + txn)])
    i += txn
    print(i, flush=True)
"""


def start_writer(path, writer, count, stall=False):
    args = [str(path), writer, str(count), str(TXN), str(int(stall))]
    return subprocess.Popen([sys.executable, "-c", WRITER, *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def reader(path):
    return SQLBuffer(OmegaConf.structured(ExperienceBufferConfig(storage_type="sql", path=str(path))))


def split(task_id):
    writer, i = task_id.split("/")
    return writer, int(i)


@pytest.mark.slow  # a real engine, Ray or training run
def test_four_writers_one_reader(tmp_path):
    path, n, writers = tmp_path / "b.db", 10_000, ["w0", "w1", "w2", "w3"]
    t0 = time.monotonic()
    procs = [start_writer(path, w, n) for w in writers]
    buf = reader(path)
    got, deadline = [], time.monotonic() + 50
    while len(got) < 4 * n and time.monotonic() < deadline:
        try:
            got += [e.task_id for e in buf.get(1000, timeout=0.2)]
        except TimeoutError:
            assert all(p.poll() in (None, 0) for p in procs), [p.communicate()[1] for p in procs if p.poll()]
    for p in procs:
        assert p.wait(timeout=30) == 0, p.stderr.read()
    print(f"4 x {n} experiences written and read in {time.monotonic() - t0:.1f}s")
    assert len(got) == 4 * n
    assert len(set(got)) == 4 * n
    for w in writers:
        # each writer's experiences in the order it wrote them, none missing
        assert [i for x, i in map(split, got) if x == w] == list(range(n))
    assert len(buf) == 0 and buf.state() == {"cursor": 4 * n, "last_id": 4 * n}


def kill_mid_write(path, writer, fraction):
    """Start a writer and SIGKILL it: `fraction` of a put's time after a commit, or (None) while
    it holds a transaction whose rows are inserted but not committed. Returns the last count it
    reported."""
    victim = start_writer(path, writer, 0, stall=fraction is None)
    try:
        reported, times = 0, {}
        while reported < 1000:  # let it commit a few transactions
            line = victim.stdout.readline()
            assert line, victim.stderr.read()
            reported = int(line)
            times[reported] = time.monotonic()
        if fraction is None:
            assert victim.stdout.readline() == "stalled\n"
        else:  # about half of a put is spent inside its transaction, the rest making rows
            time.sleep(fraction * (times[1000] - times[500]) / 5)
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=10)
    finally:
        if victim.poll() is None:  # a failed assertion above: do not leave it writing
            victim.kill()
    lines = [x for x in victim.stdout.read().split() if x != "stalled"]  # reported before it died
    return int(lines[-1]) if lines else reported


@pytest.mark.slow  # a real engine, Ray or training run
def test_killed_writers_leave_whole_transactions(tmp_path):
    path = tmp_path / "b.db"
    victims = {"k0": None, "k1": 0.3, "k2": 0.7}
    reported = {w: kill_mid_write(path, w, fraction) for w, fraction in victims.items()}

    engine = sa.create_engine(f"sqlite:///{path}")
    with engine.connect() as c:
        assert c.exec_driver_sql("PRAGMA integrity_check").scalar() == "ok"
    engine.dispose()
    stored = [split(e.task_id) for e in read_experiences(str(path), limit=10**9)]
    kept = {}
    for w in victims:
        written = [i for x, i in stored if x == w]
        m = kept[w] = len(written)
        print(f"{w}: killed after reporting {reported[w]}; {m} stored")
        assert written == list(range(m))  # a prefix, in order
        assert m >= reported[w] and m % TXN == 0  # every reported commit, and no half transaction

    # the database still takes writes, and a reader reads everything, in the order written
    assert start_writer(path, "after", 500).wait(timeout=30) == 0
    buf, got = reader(path), []
    while len(got) < len(stored) + 500:
        got += buf.get(len(stored) + 500, timeout=2)
    expected = [(w, i) for w in victims for i in range(kept[w])] + [("after", i) for i in range(500)]
    assert [split(e.task_id) for e in got] == expected
