"""What the runs page reads of each run, kept between its polls: a run's files are read again only
when their size or modification time changed, and a growing `metrics.jsonl` only from where the
last read stopped (a file replaced, as a resumed run rewrites its log, is read whole again). The
report's own reading (rft.reporting.report.read_job) goes through `Files`, so the studio's rows,
statuses and tables are the report's.

Whether a run is running is read from its lock (`.run.lock`, rft.runtime.rundir.run_lock): the
process named there still alive on this machine, and started before it wrote the lock (a pid used
again by another process later is not the run). A run on another machine (a shared filesystem)
is running while its metrics keep changing.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import threading
import time
from pathlib import Path

from rft import manifest
from rft.reporting import report

# a run on another machine whose metrics changed this recently, and that is not done, is running
ACTIVE_S = 120
# what the runs table needs of each metrics row (a row of a GRPO step holds ~65 keys)
LISTED = ("step", "eval/accuracy", *report.TIMING_KEYS)


def _stamp(path: Path):
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


class _Log:
    """A metrics.jsonl read so far: its rows, the bytes read (to the last whole line), and the last
    bytes of them (a file rewritten in place under the same name reads whole again)."""

    __slots__ = ("stamp", "offset", "tail", "rows")

    def __init__(self):
        self.stamp, self.offset, self.tail, self.rows = None, 0, b"", []


class CachedFiles(report.Files):
    """report.Files kept between calls. `keys`: the metrics keys each row keeps (None: every key);
    `most`: how many metrics files are kept (the least recently read go first)."""

    def __init__(self, keys: tuple[str, ...] | None = None, most: int | None = None,
                 shared: CachedFiles | None = None):
        self.keys, self.most = keys, most
        self._logs: collections.OrderedDict[Path, _Log] = collections.OrderedDict()
        # the configs and overrides of runs: one cache for the listing and the curves alike
        self._small = shared._small if shared is not None else {}
        self._lock = shared._lock if shared is not None else threading.RLock()

    def _cached(self, path: Path, read):
        try:
            stamp = _stamp(path)
        except OSError:
            stamp = None
        with self._lock:
            hit = self._small.get(path)
            if hit is not None and hit[0] == stamp:
                return hit[1]
        value = read()
        with self._lock:
            self._small[path] = (stamp, value)
        return value

    def plan(self, job_dir: Path):
        return self._cached(job_dir / ".hydra" / "config.yaml", lambda: report.planned_stages(job_dir))

    def overrides(self, job_dir: Path, name: str):
        return self._cached(job_dir / ".hydra" / "overrides.yaml", lambda: report.parse_overrides(job_dir, name))

    def jsonl(self, path: Path) -> list[dict]:
        with self._lock:
            log = self._logs.pop(path, None) or _Log()
            self._logs[path] = log  # the newest read last
            while self.most is not None and len(self._logs) > self.most:
                self._logs.popitem(last=False)
            self._update(path, log)
            return log.rows

    def _update(self, path: Path, log: _Log) -> None:
        stamp = _stamp(path)
        if stamp == log.stamp:
            return
        try:
            f = manifest.open_regular(path)  # a FIFO or /dev/zero in a log's place: no rows, not a hung page
        except OSError:
            log.offset, log.rows, log.tail, log.stamp = 0, [], b"", stamp
            return
        with f:
            grown = log.stamp is not None and stamp[0] == log.stamp[0] and stamp[1] >= log.offset
            if grown and log.tail:
                f.seek(log.offset - len(log.tail))
                grown = f.read(len(log.tail)) == log.tail
            if not grown:
                log.offset, log.rows, log.tail = 0, [], b""
            # a line at a time (rft.manifest.read_lines), not the rest of the file at once: a sparse 20 GB
            # metrics.jsonl (a handed-over run's) was read whole at each change, a MemoryError or the OOM killer
            for line, end in manifest.read_lines(f, log.offset):
                if line is not None and not line.endswith(b"\n"):
                    break  # a line being written comes whole next time (one too long to hold is passed)
                log.offset = end
                try:
                    m = json.loads(line)
                except (TypeError, ValueError, RecursionError):
                    continue  # as report.read_jsonl: a line a killed run cut short, or too long (None)
                if report.is_row(m):
                    log.rows.append(m if self.keys is None else {k: m[k] for k in self.keys if k in m})
            if log.offset:  # the last bytes read, to know the file again (a shorter one rewritten in place)
                log.tail = os.pread(f.fileno(), min(64, log.offset), log.offset - min(64, log.offset))
        log.stamp = stamp


# ---------------------------------------------------------------- is it running


def _started(pid: int) -> float | None:
    """When process pid started (seconds since the epoch); None where unknown or ended. From psutil
    (a dependency of Ray), not /proc: macOS has none, and every run there showed as not running."""
    import psutil

    try:
        p = psutil.Process(pid)
        return None if p.status() == psutil.STATUS_ZOMBIE else p.create_time()  # a zombie: ended, waiting for its parent
    except psutil.Error:
        return None


def holder_alive(run: Path) -> bool | None:
    """True: the process that holds the run's lock is alive on this machine; False: it is not;
    None: the lock names another machine, or no lock was taken."""
    path = run / ".run.lock"
    try:
        words = manifest.read_regular(path, 4096).decode(errors="replace").split()[:4]  # a FIFO: an OSError
        written = path.stat().st_mtime
    except OSError:
        return None
    # "pid <n> on <host>", then " (Slurm job <id>)" in a Slurm job
    if len(words) != 4 or words[0] != "pid" or not words[1].isdigit() or words[3] != socket.gethostname():
        return None
    started = _started(int(words[1]))
    # a pid the kernel gave to another process after the run ended started after the lock was written
    return started is not None and started <= written + 1


def status(job: report.Job, run: Path, updated: float, stopped: bool) -> str:
    """running | starting | done | stopped | failed: the report's status of the run's last stage,
    and whether its process is alive (its lock), or the studio stopped it."""
    alive = holder_alive(run)
    if alive is None and job.status != "done" and updated and time.time() - updated < ACTIVE_S:
        alive = True  # another machine's run, still writing
    if alive:
        return "running" if updated else "starting"
    if job.status == "done":
        return "done"
    return "stopped" if stopped else "failed"
