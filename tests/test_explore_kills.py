"""mode=explore SIGKILLed where the buffer and the checkpoints disagree: before its first checkpoint,
in the middle of a file buffer's write, and again while it resumes. Each resumed run's buffer holds
the rows an uninterrupted run writes, each once, beside what was there before it; a reader never
sees half a row. (A kill after a step's rows and before its checkpoint: tests/test_resume_kills.py.)"""

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from resume_support import NO_EVAL, SHORT, killed_after_put, run_here, run_to_end, stored_rows

from rft.config import ExperienceBufferConfig
from rft.data.buffer import make_buffer

pytestmark = pytest.mark.slow

SUFFIX = {"sql": ".db", "file": ".jsonl"}


def explore_args(tmp_path: Path, kind: str, name: str, buffer: str) -> list[str]:
    """A mode=explore run of 4 steps of 4 tasks x 4 rollouts (16 rows a step) from the config's own
    model, into the buffer file `buffer` (no suffix)."""
    return [*SHORT, *NO_EVAL, "mode=explore", f"buffer={kind}",
            f"buffer.trainer_input.experience_buffer.path={tmp_path / buffer}{SUFFIX[kind]}", f"name={name}"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted explore run of each kind, run once for the module (the three tests compare
    with the same run), in this process (run_here: only its buffer is read); kind -> its buffer file."""
    made = {}

    def run(kind: str) -> Path:
        if kind not in made:
            root = tmp_path_factory.mktemp(f"straight_{kind}")
            run_here(explore_args(root, kind, "straight", "straight"), root)
            made[kind] = root / f"straight{SUFFIX[kind]}"
        return made[kind]
    return run


@pytest.fixture
def straight(uninterrupted, tmp_path):
    """The uninterrupted explore run of `kind`, its buffer copied to tmp_path; returns (env, its rows)."""
    def run(kind: str) -> tuple[dict, list[dict]]:
        shutil.copy(uninterrupted(kind), tmp_path / f"straight{SUFFIX[kind]}")
        rows = stored_rows(tmp_path / f"straight{SUFFIX[kind]}")
        assert len(rows) == 4 * 16
        return {**os.environ, "RFT_CHECKPOINT_ROOT_DIR": str(tmp_path)}, rows
    return run


@pytest.mark.parametrize("kind", ["sql", "file"])
def test_an_explorer_killed_before_its_first_checkpoint_writes_step_0_once(kind, straight, tmp_path):
    """Killed the moment explore step 0's 16 rows are in, before any checkpoint (the first is step
    1's), in a buffer that already holds an earlier run's 64 rows of the same seed (the uninterrupted
    run's own, copied: rows a resume must not take for its own). The resume wrote step 0 again: 80
    rows of its own, 16 twice, which a mode=train job read and trained on (exit 0). It now holds
    64 + 64, its own equal to the uninterrupted run's."""
    env, rows = straight(kind)
    path = tmp_path / f"killed{SUFFIX[kind]}"
    shutil.copy(tmp_path / f"straight{SUFFIX[kind]}", path)
    args = explore_args(tmp_path, kind, "killed", "killed")
    killed_after_put(args, env, tmp_path, 1)
    assert not (tmp_path / "rft" / "killed" / "checkpoints").exists()  # killed before the first checkpoint
    assert len(stored_rows(path)) == 64 + 16
    resumed = run_to_end(args, env, tmp_path / "resumed_run")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    stored = stored_rows(path)
    assert len(stored) == 64 + 64, len(stored)  # 64 + 80 before the fix
    assert stored[:64] == rows and stored[64:] == rows


# the run kills itself (SIGKILL) at KILL_AT=<where>:<n>, the n-th time it gets there (rft has no
# fault hooks of its own: a sitecustomize on its PYTHONPATH wraps the buffer or the manifest)
KILL_AT = """
import os, sys, time
if sys.argv and sys.argv[0].endswith("run.py") and os.environ.get("KILL_AT"):
    import json
    import rft.data.buffer as b
    import rft.manifest as m
    where, n = os.environ["KILL_AT"].split(":")
    calls = [0]

    def due():
        calls[0] += 1
        return calls[0] == int(n)

    file_put, sql_put, keep_written, seal = b.FileBuffer.put, b.SQLBuffer.put, b._KeepsWhatItWrote.keep_written, m.seal

    def cut_file_put(self, exps):  # a write killed midway: its first half there, the last line cut
        if not due():
            return file_put(self, exps)
        data = "".join(json.dumps(e.to_dict()) + "\\n" for e in self._unwritten(exps)).encode()
        with open(self.path, "ab") as f:
            f.write(data[: len(data) // 2])
        os.kill(os.getpid(), 9)

    def uncommitted_sql_put(self, exps):  # killed inside the transaction: rows inserted, no commit
        if not due():
            return sql_put(self, exps)
        with self.engine.begin() as c:
            c.execute(b._experiences.insert(), [b._row(e, time.time()) for e in self._unwritten(exps)])
            os.kill(os.getpid(), 9)

    def killed_in_restore(self, *args):  # the resume has looked at the buffer; nothing written yet
        out = keep_written(self, *args)
        if due():
            os.kill(os.getpid(), 9)
        return out

    def killed_in_save(d, *args, **kwargs):  # a checkpoint's files in step_<N>.tmp, no manifest, no rename
        if str(d).endswith(".tmp") and due():
            os.kill(os.getpid(), 9)
        return seal(d, *args, **kwargs)

    b.FileBuffer.put, b.SQLBuffer.put = cut_file_put, uncommitted_sql_put
    b._KeepsWhatItWrote.keep_written, m.seal = killed_in_restore, killed_in_save
    if where != "put":
        b.FileBuffer.put, b.SQLBuffer.put = file_put, sql_put
    if where != "restore":
        b._KeepsWhatItWrote.keep_written = keep_written
    if where != "save":
        m.seal = seal
"""


def killed_at(args, env, tmp_path: Path, where: str, n: int) -> None:
    """`python run.py <args>`, killed by itself the n-th time it gets to `where` (KILL_AT); forked
    (resume_support.run_to_end, the hook run first as a fresh interpreter's sitecustomize would be)."""
    hook = tmp_path / "kill_at"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(KILL_AT)
    r = run_to_end(args, {**env, "KILL_AT": f"{where}:{n}"}, tmp_path / f"killed_at_{where}", hook / "sitecustomize.py")
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]


def drained(reader) -> list:
    """Every experience the reader has not read yet (a mode=train job reading the buffer live)."""
    out = []
    try:
        while True:
            out += reader.get(64, timeout=0.2)
    except TimeoutError:
        return out


@pytest.mark.parametrize("kind", ["sql", "file"])
def test_an_explorer_killed_mid_write_then_while_resuming_holds_each_row_once(kind, straight, tmp_path):
    """Killed in the middle of explore step 2's write (file: its first half written, the last line
    cut; sql: inside its transaction), then, resuming, right after it looked at the buffer (before
    any write), then once more after its first write (the rest of step 2); then it runs to the end.
    A reader reading the buffer live between the kills reads whole rows only, each once: together,
    what the uninterrupted run wrote; and the buffer holds that, each row once."""
    env, rows = straight(kind)
    path = tmp_path / f"killed{SUFFIX[kind]}"
    args = explore_args(tmp_path, kind, "killed", "killed")
    reader = make_buffer(OmegaConf.structured(ExperienceBufferConfig(storage_type=kind, path=str(path))))
    killed_at(args, env, tmp_path, "put", 3)
    partial = len(stored_rows(path)) if kind == "sql" else path.read_bytes().count(b"\n")
    # the whole rows of steps 0 and 1, and (file) a few of step 2's
    assert partial == 32 if kind == "sql" else 32 < partial < 48, partial
    read = drained(reader)
    assert len(read) == partial
    killed_at(args, env, tmp_path, "restore", 1)
    read += drained(reader)
    killed_after_put(args, env, tmp_path, 1)
    read += drained(reader)
    resumed = run_to_end(args, env, tmp_path / "resumed_run")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    read += drained(reader)
    stored = stored_rows(path)
    assert stored == rows
    assert [(e.group_id, e.task_id, e.tokens) for e in read] == [
        (r["group_id"], r["task_id"], r["tokens"] if kind == "file" else json.loads(r["tokens"])) for r in rows]


@pytest.mark.parametrize("kind", ["sql", "file"])
def test_an_explorer_killed_while_saving_resumes_from_the_checkpoint_before(kind, straight, tmp_path):
    """Killed as it writes the step-3 checkpoint (explore step 2's rows in, step_3.tmp not sealed):
    the resume is from step 2's, and explore step 2's rows, after it, stay and are not written again."""
    env, rows = straight(kind)
    path = tmp_path / f"killed{SUFFIX[kind]}"
    args = explore_args(tmp_path, kind, "killed", "killed")
    killed_at(args, env, tmp_path, "save", 3)
    checkpoints = tmp_path / "rft" / "killed" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_2", "step_3.tmp"]
    assert len(stored_rows(path)) == 48
    resumed = run_to_end(args, env, tmp_path / "resumed_run")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from step 2" in resumed.stdout
    assert stored_rows(path) == rows
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_4"]
