"""Runs and sweeps started from the studio: `python run.py [-m] <overrides>` as child processes in
a session of their own, each one's console (stdout and stderr) written to a log file that the
page reads as it grows; stop sends SIGTERM to the child's whole process group but a Ray instance's
own processes, which the run's driver stops itself (SIGKILL to the whole group 15 s later).

Every launch is recorded in `<root>/.studio/jobs.json` (its command, process, log, times, exit
code, and the run or sweep directory it writes), so the jobs panel lists them after a reload and
after the studio restarts. A launch restored from the file whose process still runs (a studio
killed before it could stop it) can be stopped; one that ended while no studio watched has no
exit code, and its run's own status says how it ended.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from rft import manifest

STOP_GRACE_S = 15
STATE = "jobs.json"
# the launches a state file keeps (the oldest go first, their logs with them)
KEEP = 200


@dataclass
class Launch:
    id: int
    argv: list[str]
    log: Path  # its console, in the studio's directory (the record keeps its name)
    pid: int
    started: float = field(default_factory=time.time)
    stopped: bool = False
    returncode: int | None = None
    ended: float | None = None
    run: str | None = None  # the run directory it writes (under the root), for a single run
    sweep: str | None = None  # the sweep directory its jobs write, for a sweep
    proc: subprocess.Popen | None = field(default=None, repr=False, compare=False)

    @property
    def command(self) -> str:
        return " ".join(shlex.quote(a) for a in ["python", "run.py", *self.argv[2:]])

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        if self.returncode is not None:
            return False
        from rft.studio.index import _started

        started = _started(self.pid)  # a pid used again later started after this launch
        return started is not None and started <= self.started + 5

    def status(self) -> str:
        if self.alive():
            return "stopping" if self.stopped else "running"
        if self.stopped:
            return "stopped"
        if self.returncode is None:
            return "ended (exit code unknown: the studio was not running)"
        return "finished" if self.returncode == 0 else f"failed (exit {self.returncode})"

    def state(self) -> dict:
        if self.proc is not None and self.returncode is None and self.proc.poll() is not None:
            self.returncode = self.proc.returncode
        return {"id": self.id, "command": self.command, "status": self.status(), "returncode": self.returncode,
                "started": self.started, "ended": self.ended, "pid": self.pid, "run": self.run, "sweep": self.sweep}

    def record(self) -> dict:
        return {k: getattr(self, k) for k in RECORDED} | {"log": self.log.name}


RECORDED = [f.name for f in fields(Launch) if f.name != "proc"]


def command(overrides: list[str], sweep: bool = False, sweep_args: list[str] = (), launcher: str | None = None) -> list[str]:
    """run.py's arguments: `-m` for a sweep, the composed overrides, the sweep's values
    (`seed=1,2,3`, `algorithm.optimizer.lr=1e-3,3e-3`), `hydra/launcher=<launcher>`."""
    args = ["-m"] if sweep else []
    args += overrides
    if sweep:
        args += list(sweep_args)
        if launcher and launcher != "basic":
            args.append(f"hydra/launcher={launcher}")
    return args


def newest_bars(text: str) -> str:
    """`text` with each line cut to what follows its last carriage return (a progress bar's newest
    form); a CR of a CRLF stays. In one pass: the regex it replaces, [^\\n\\r]*\\r(?!\\n), scanned the
    rest of a line from each of its characters, so a long line (a big dict logged whole) cost the
    square of its length: 11 s of the studio's CPU, under the GIL its other requests wait on, for
    one line of 80 kB in the console."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        crlf = i < len(lines) - 1 and line.endswith("\r")
        body = line[:-1] if crlf else line
        lines[i] = body[body.rfind("\r") + 1:] + ("\r" if crlf else "")
    return "\n".join(lines)


class Launches:
    def __init__(self, repo: Path, log_dir: Path, env: dict | None = None):
        self.repo, self.log_dir = Path(repo), Path(log_dir)
        self.env = env if env is not None else dict(os.environ)
        self._lock = threading.Lock()
        self.all: dict[int, Launch] = self._load()

    # ------------------------------------------------------------ the state file

    def _load(self) -> dict[int, Launch]:
        """The launches recorded by this studio before; none from a file another user could have
        written (the root may be a shared folder: a record names a process the page can signal)."""
        path = self.log_dir / STATE
        try:
            st = path.stat()
            if st.st_uid != os.getuid() or st.st_mode & 0o022 or self.log_dir.stat().st_mode & 0o022:
                print(f"rft.studio: WARNING: {path} (or its folder) is not this user's alone: its launches are not "
                      f"listed.", file=sys.stderr, flush=True)
                return {}
            # a FIFO in its place: an OSError, not a studio that never starts (rft.manifest.read_record)
            records = json.loads(manifest.read_record(path).decode())
            if not isinstance(records, list) or not all(map(_recorded, records)):
                raise ValueError("not a list of launch records as the studio writes them")
            launches = [Launch(**{k: r[k] for k in RECORDED if k in r} | {"log": self.log_dir / r["log"]})
                        for r in records if _own_log(r.get("log"))]
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError, KeyError) as e:
            print(f"rft.studio: WARNING: {path} does not read ({e}); the earlier launches are not listed.",
                  file=sys.stderr, flush=True)
            return {}
        return {launch.id: launch for launch in launches}

    def _save(self) -> None:
        """The records, written aside and renamed into place (a studio killed mid-write keeps the old)."""
        records = [launch.record() for launch in sorted(self.all.values(), key=lambda x: x.id)][-KEEP:]
        fd, tmp = tempfile.mkstemp(prefix=".jobs_", dir=self.log_dir)
        with os.fdopen(fd, "w") as f:
            json.dump(records, f)
        os.replace(tmp, self.log_dir / STATE)

    # ------------------------------------------------------------ launching

    def start(self, args: list[str], run: str | None = None, sweep: str | None = None) -> Launch:
        """Start run.py with args; `run` / `sweep`: the directory under the root it writes."""
        self.log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        with self._lock:
            n = max(self.all, default=0) + 1
            # created here, never reopened: a name no one can guess and take first (the root may
            # be a folder other users write to), readable by this user only
            fd, log = tempfile.mkstemp(prefix=f"launch_{n}_", suffix=".log", dir=self.log_dir)
            argv = [sys.executable, str(self.repo / "run.py"), *args]
            f = os.fdopen(fd, "wb")
            # a session of its own: stop reaches the run's children (Ray, ranks) and the
            # studio's own Ctrl-C does not reach the run
            proc = subprocess.Popen(argv, cwd=self.repo, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**self.env, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
            f.close()
            launch = self.all[n] = Launch(n, argv, Path(log), proc.pid, run=run, sweep=sweep, proc=proc)
            self._save()
        threading.Thread(target=self._reap, args=(launch,), daemon=True).start()
        return launch

    def _reap(self, launch: Launch) -> None:
        """Wait for the child; record its exit."""
        launch.returncode = launch.proc.wait()
        launch.ended = time.time()
        with self._lock:
            self._save()

    def get(self, n: int) -> Launch:
        if n not in self.all:
            raise KeyError(f"no launch {n}")
        return self.all[n]

    def read(self, n: int, offset: int = 0) -> dict:
        """The console from byte `offset` on: {"text", "offset" (the next one), **state}. A
        progress bar's carriage returns keep only the bar's newest form. An offset before the
        start or past the end is a ValueError."""
        launch = self.get(n)
        path = launch.log
        size = path.stat().st_size
        if not 0 <= offset <= size:
            raise ValueError(f"offset={offset}: launch {n}'s console has {size} bytes; give an offset from 0 to {size} "
                             f"(the `offset` the last answer returned).")
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(1 << 20)
        # up to the last whole line or carriage return: a half-written line comes whole next time
        cut = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1 if launch.alive() else len(data)
        return {"text": newest_bars(data[:cut].decode("utf-8", "replace")), "offset": offset + cut, **launch.state()}

    def stop(self, n: int) -> dict:
        launch = self.get(n)
        if launch.alive():
            launch.stopped = True
            with self._lock:
                self._save()
            _terminate(launch.pid)
            threading.Thread(target=self._kill_later, args=(launch,), daemon=True).start()
        return launch.state()

    def _kill_later(self, launch: Launch) -> None:
        deadline = time.time() + STOP_GRACE_S
        while launch.alive() and time.time() < deadline:
            time.sleep(0.2)
        if launch.alive():
            _signal(launch.pid, signal.SIGKILL)

    def stopped_runs(self, root: Path) -> frozenset[str]:
        """The runs (their paths under the root) of the launches stopped from the page: a sweep's, every job's."""
        from rft.reporting.report import find_jobs

        out = set()
        for launch in list(self.all.values()):
            if launch.stopped and launch.run:
                out.add(launch.run)
            if launch.stopped and launch.sweep and (Path(root) / launch.sweep).is_dir():
                out |= {j.relative_to(root).as_posix() for j in find_jobs(Path(root) / launch.sweep)}
        return frozenset(out)

    def stop_all(self) -> None:
        for n in list(self.all):
            if self.all[n].proc is not None:  # those this studio started
                self.stop(n)


def _recorded(r) -> bool:
    """Whether `r` is a record as Launch.record writes it: a JSON object with each field of its type.
    Read as it came, a damaged jobs.json (an object for the list, a pid or time as text) stopped the
    studio's start with a traceback, or every later /api/launches; a pid of 0 or below would have
    had "stop" signal the studio's own process group (os.killpg(0, ...))."""
    def whole(v) -> bool:
        return type(v) is int

    def number(v) -> bool:
        return type(v) in (int, float)

    return (isinstance(r, dict) and whole(r.get("id")) and whole(r.get("pid")) and r["pid"] > 0
            and isinstance(r.get("argv"), list) and all(isinstance(a, str) for a in r["argv"])
            and number(r.get("started", 0.0)) and type(r.get("stopped", False)) is bool
            and (r.get("returncode") is None or whole(r["returncode"]))
            and (r.get("ended") is None or number(r["ended"]))
            and all(r.get(k) is None or isinstance(r[k], str) for k in ("run", "sweep")))


def _own_log(name) -> bool:
    """A record's log is a file name the studio made (launch_<n>_....log), not a path elsewhere."""
    return isinstance(name, str) and re.fullmatch(r"launch_\d+_[\w-]+\.log", name) is not None


def _signal(pid: int, sig) -> None:
    try:
        os.killpg(pid, sig)  # the child leads its session's process group
    except (ProcessLookupError, PermissionError):
        pass


def _terminate(pgid: int) -> None:
    """SIGTERM to each process of the launch's process group but a Ray instance's own (its GCS, raylet,
    agents, workers, and what they started): the run's driver, told, stops them in its ray.shutdown
    (~3 s). Signalled with it, they ended first, and that shutdown waited ~8 s more on the dead GCS,
    past the stop's grace on a busy machine. A process not known as Ray's gets the signal as before."""
    import psutil

    group = {}
    for p in psutil.process_iter(["ppid", "cmdline"]):
        try:
            if os.getpgid(p.pid) == pgid:
                group[p.pid] = p.info
        except (ProcessLookupError, PermissionError):
            pass
    for pid in group:
        if not _under_ray(pid, group, pgid):
            try:
                os.kill(pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass


def _under_ray(pid: int, group: dict, leader: int) -> bool:
    """Whether the process or one it descends from within the group, below its leader (the run's driver,
    never Ray's), is Ray's: a Ray session's folder on its command line (the GCS, raylet, log monitor,
    dashboard), or a name Ray gives (ray::IDLE, ray::Trainer)."""
    seen = set()
    while pid in group and pid != leader and pid not in seen:
        seen.add(pid)
        argv = group[pid].get("cmdline") or []
        if (argv and argv[0].startswith("ray::")) or re.search(r"/session_\d{4}-\d\d-\d\d_", " ".join(argv)):
            return True
        pid = group[pid].get("ppid")
    return False
