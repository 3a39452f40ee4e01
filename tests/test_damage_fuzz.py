"""What experiments/damage_fuzz found: damage to a file a run reads back that ended in a raw
traceback, a hang or a silently different result, pinned case by case."""

import os
import time

import pytest

from rft.errors import RunError
from rft.runtime import rundir


def test_a_run_lock_holding_bytes_that_are_not_text_is_rewritten(tmp_path):
    # the fuzzer's case: 64 random bytes appended to .run.lock (a disk error, a copy gone wrong).
    # The lock's text is only a note of who held it (shown if it is still held, and compared for a
    # requeued Slurm job), yet reading it as UTF-8 ended every later run of the name in a raw
    # UnicodeDecodeError from run_lock, before anything started
    lock = tmp_path / rundir.RUN_LOCK
    lock.write_bytes(b"pid 12 on node7\n\x9b\xff\xfe garbage")
    with rundir.run_lock(tmp_path) as before:
        # each undecodable byte read as U+FFFD: 3 of them after the earlier holder's line
        assert before == "pid 12 on node7\n\ufffd\ufffd\ufffd garbage"
        assert rundir.requeued(before, {"SLURM_JOB_ID": "5", "SLURM_RESTART_COUNT": "1"}) is None
    # the note is this run's again
    assert lock.read_text().startswith(f"pid {os.getpid()} on ")


def test_a_stage_cache_lock_replaced_by_a_link_is_one_paragraph(tmp_path):
    # the fuzzer's case: <stage_cache_dir>/<key>.lock a link to /dev/zero. filelock opens it with
    # O_NOFOLLOW, and the run ended in a raw "OSError: [Errno 40] Too many levels of symbolic links"
    entry = tmp_path / "stage_cache" / "aa683dad4e9a4289"
    entry.parent.mkdir()
    (tmp_path / "stage_cache" / "aa683dad4e9a4289.lock").symlink_to("/dev/zero")
    with pytest.raises(RunError) as e:
        with rundir.stage_lock(entry, "sft_warmup", print):
            pass
    assert str(e.value) == (
        f"[sft_warmup] the stage cache's lock {entry}.lock cannot be opened: it is a link (to /dev/zero), which rft "
        f"never makes there. Remove it (rft makes the lock again), or run without the stage cache "
        f"(stage_cache_dir=null). A stage cache others can write to is not guarded: keep it writable by you alone.")


@pytest.mark.slow  # 1.1 s alone, over the fast tier's second
def test_a_stage_cache_lock_that_becomes_a_link_while_a_job_waits_is_the_same_paragraph(tmp_path):
    # another job holds the lock; while this one waits, the lock file is replaced by a link. The
    # wait's own acquire was outside the handler: a raw "OSError: [Errno 40]" after the wait
    import threading

    from filelock import FileLock

    entry = tmp_path / "stage_cache" / "aa683dad4e9a4289"
    entry.parent.mkdir()
    lock_path = tmp_path / "stage_cache" / "aa683dad4e9a4289.lock"
    said, held = [], threading.Event()

    def other_job():  # a thread: filelock refuses a second holder in the same thread
        other = FileLock(str(lock_path))
        other.acquire()
        held.set()
        while not said:  # this job has said it waits
            time.sleep(0.05)
        other.release()
        lock_path.unlink()
        lock_path.symlink_to("/dev/zero")

    t = threading.Thread(target=other_job)
    t.start()
    held.wait()
    with pytest.raises(RunError) as e:
        with rundir.stage_lock(entry, "sft_warmup", said.append):
            pass
    t.join()
    assert said == [f"[sft_warmup] waiting for another job that trains the same stage (lock {entry}.lock)"]
    assert str(e.value).startswith(f"[sft_warmup] the stage cache's lock {entry}.lock cannot be opened: it is a "
                                   f"link (to /dev/zero), which rft never makes there.")
