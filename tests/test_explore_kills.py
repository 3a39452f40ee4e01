"""mode=explore SIGKILLed where the buffer and the checkpoints disagree: before its first checkpoint,
in the middle of a file buffer's write, and again while it resumes. Each resumed run's buffer holds
the rows an uninterrupted run writes, each once, beside what was there before it; a reader never
sees half a row. (A kill after a step's rows and before its checkpoint: tests/test_resume_kills.py.)"""

import json
import os
import shutil
import sqlite3
from pathlib import Path

import pytest
from conftest import run_cli
from resume_support import NO_EVAL, SHORT, killed_after_put

pytestmark = pytest.mark.slow

SUFFIX = {"sql": ".db", "file": ".jsonl"}


def stored_rows(path: Path) -> list[dict]:
    """A sql or file buffer's rows in order, without a SQLite row's id and write time."""
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines()]
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        db.row_factory = sqlite3.Row
        return [{k: r[k] for k in r.keys() if k not in ("id", "created_at")}
                for r in db.execute("select * from experiences order by id")]


def explore_args(tmp_path: Path, kind: str, name: str, buffer: str) -> list[str]:
    """A mode=explore run of 4 steps of 4 tasks x 4 rollouts (16 rows a step) from the config's own
    model, into the buffer file `buffer` (no suffix)."""
    return [*SHORT, *NO_EVAL, "mode=explore", f"buffer={kind}",
            f"buffer.trainer_input.experience_buffer.path={tmp_path / buffer}{SUFFIX[kind]}", f"name={name}"]


@pytest.fixture
def straight(tmp_path):
    """Runs the uninterrupted explore run of `kind` once; returns (env, its rows)."""
    def run(kind: str) -> tuple[dict, list[dict]]:
        env = {**os.environ, "RFT_CHECKPOINT_ROOT_DIR": str(tmp_path)}
        r = run_cli(*explore_args(tmp_path, kind, "straight", "straight"), env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        rows = stored_rows(tmp_path / f"straight{SUFFIX[kind]}")
        assert len(rows) == 4 * 16
        return env, rows
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
    resumed = run_cli(*args, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    stored = stored_rows(path)
    assert len(stored) == 64 + 64, len(stored)  # 64 + 80 before the fix
    assert stored[:64] == rows and stored[64:] == rows
