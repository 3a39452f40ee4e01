"""Runs and sweeps started from the studio: `python run.py [-m] <overrides>` as child processes in
a session of their own, each one's console (stdout and stderr) written to a log file that the
page reads as it grows; stop sends SIGTERM to the child's whole process group (SIGKILL 15 s later).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

STOP_GRACE_S = 15


@dataclass
class Launch:
    id: int
    argv: list[str]
    log: Path
    proc: subprocess.Popen
    started: float = field(default_factory=time.time)
    stopped: bool = False

    @property
    def command(self) -> str:
        return " ".join(shlex.quote(a) for a in ["python", "run.py", *self.argv[2:]])

    def state(self) -> dict:
        code = self.proc.poll()
        status = "running" if code is None else "stopped" if self.stopped else "finished" if code == 0 else f"failed (exit {code})"
        return {"id": self.id, "command": self.command, "status": status, "returncode": code, "started": self.started,
                "pid": self.proc.pid}


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


class Launches:
    def __init__(self, repo: Path, log_dir: Path, env: dict | None = None):
        self.repo, self.log_dir = Path(repo), Path(log_dir)
        self.env = env if env is not None else dict(os.environ)
        self.all: dict[int, Launch] = {}
        self._lock = threading.Lock()

    def start(self, args: list[str]) -> Launch:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with self._lock:
            n = max(self.all, default=0) + 1
            # created here, never reopened: a name no one can guess and take first (the root may
            # be a folder other users write to), readable by this user only
            fd, log = tempfile.mkstemp(prefix=f"launch_{n}_", suffix=".log", dir=self.log_dir)
            log = Path(log)
            argv = [sys.executable, str(self.repo / "run.py"), *args]
            f = os.fdopen(fd, "wb")
            # a session of its own: stop reaches the run's children (Ray, ranks) and the
            # studio's own Ctrl-C does not reach the run
            proc = subprocess.Popen(argv, cwd=self.repo, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**self.env, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
            f.close()
            self.all[n] = Launch(n, argv, log, proc)
            return self.all[n]

    def get(self, n: int) -> Launch:
        if n not in self.all:
            raise KeyError(f"no launch {n}")
        return self.all[n]

    def read(self, n: int, offset: int = 0) -> dict:
        """The console from byte `offset` on: {"text", "offset" (the next one), **state}. A
        progress bar's carriage returns keep only the bar's newest form. An offset before the
        start or past the end is a ValueError."""
        launch = self.get(n)
        size = launch.log.stat().st_size
        if not 0 <= offset <= size:
            raise ValueError(f"offset={offset}: launch {n}'s console has {size} bytes; give an offset from 0 to {size} "
                             f"(the `offset` the last answer returned).")
        with open(launch.log, "rb") as f:
            f.seek(offset)
            data = f.read(1 << 20)
        # up to the last whole line or carriage return: a half-written line comes whole next time
        cut = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1 if launch.proc.poll() is None else len(data)
        text = data[:cut].decode("utf-8", "replace")
        text = re.sub(r"[^\n\r]*\r(?!\n)", "", text)
        return {"text": text, "offset": offset + cut, **launch.state()}

    def stop(self, n: int) -> dict:
        launch = self.get(n)
        if launch.proc.poll() is None:
            launch.stopped = True
            _signal(launch.proc.pid, signal.SIGTERM)

            def kill_later():
                try:
                    launch.proc.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    _signal(launch.proc.pid, signal.SIGKILL)
                    launch.proc.wait()

            threading.Thread(target=kill_later, daemon=True).start()
        return launch.state()

    def stopped_runs(self) -> frozenset[str]:
        """The runs (their paths under the root) of the launches stopped from the page."""
        return frozenset()

    def stop_all(self) -> None:
        for n in list(self.all):
            self.stop(n)


def _signal(pid: int, sig) -> None:
    try:
        os.killpg(pid, sig)  # the child leads its session's process group
    except ProcessLookupError:
        pass
