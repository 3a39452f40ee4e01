"""Stop what a killed driver leaves running, and a driver whose ray.init never returns:
`python -m rft.runtime.reaper <driver pid>`.

Ray's own processes share the fate of the driver that started them (they die with it), but the
dashboard and runtime-env agents, which the raylet starts, outlive a driver killed with SIGKILL
(they wait on a GCS that is gone). `rft.runtime.main` starts this watcher before it starts a local
Ray instance: every second it notes the driver's descendants; once the driver is gone it kills those
still running (the same processes: same pid and start time), and the processes of the Ray session
the driver started (its directory is named with the driver's pid) that it had not seen yet: one
started during Ray's start or in the second before the kill.

While the driver is in ray.init it says so on its stdin (a JSON line: `{"init": <bound in s>,
"progress": <s>, "resume": <how to resume>}`, then `{"init": null}` once ray.init is done). ray.init has no bound of
its own (Ray's maintainers suggest a timer of the caller's: ray-project/ray#46863), and a driver
whose raylet stalls (a machine out of memory, a load of 18) waits in Ray's C++ code holding
Python's lock, where no thread or signal handler of its own runs again: this process, outside it,
prints a line while it waits, and past the bound one paragraph, then stops the driver and Ray's
processes.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import sys
import threading
import time

import psutil


def watch(driver_pid: int, poll_s: float = 1.0, commands=None) -> None:
    me = psutil.Process()
    seen: dict[int, float] = {}  # pid -> start time
    # the driver's ray.init in progress (its bound, when it began, the next line's time), or None:
    # the reader puts a new dict in place, so the one read here never changes keys under the loop
    waiting: list[dict | None] = [None]
    reader = threading.Thread(target=_read, args=(commands or sys.stdin, waiting), daemon=True)
    reader.start()
    driver_started = 0.0
    try:
        driver = psutil.Process(driver_pid)
        driver_started = driver.create_time()
        while driver.is_running() and driver.status() != psutil.STATUS_ZOMBIE:
            _note(driver, me, seen)
            wait = waiting[0]
            if wait is not None and _waited_too_long(driver, me, seen, wait):
                return
            time.sleep(poll_s)
    except psutil.NoSuchProcess:
        pass
    theirs = _theirs(seen, driver_pid, driver_started, me.pid)
    _kill(theirs)
    reader.join(2)  # the driver's last line (ray.init done, then an exit) read before its end is judged
    wait = waiting[0]
    if wait is not None:
        # Ray's own end of a driver whose raylet does not answer: after 30 s, one line of its C++ code
        # ("Failed to get the system config from raylet because it is dead") and exit 1
        _say(f"the run's process ended {time.monotonic() - wait['since']:.0f} s into ray.init, before Ray's local "
             f"instance answered (Ray's line above, if any, says why).", wait, theirs, driver_pid)


def _read(commands, waiting: list) -> None:
    """The driver's lines (the module's docstring); its end (EOF) is the driver's."""
    for line in commands:
        try:
            said = json.loads(line)
        except ValueError:
            continue
        waiting[0] = None if said.get("init") is None else {
            "bound": float(said["init"]), "resume": said.get("resume", ""), "since": time.monotonic(),
            # the first line "starting Ray... (N s)" then, and each at twice the time of the one before
            "next": float(said.get("progress", 15))}


def _note(driver: psutil.Process, me: psutil.Process, seen: dict) -> None:
    for p in driver.children(recursive=True):
        if p.pid != me.pid:
            try:
                seen[p.pid] = p.create_time()
            except psutil.Error:
                pass


def _waited_too_long(driver: psutil.Process, me: psutil.Process, seen: dict, wait: dict) -> bool:
    """A line on the driver's stderr (inherited) as it waits; past the bound the paragraph, and
    the driver and Ray's processes stopped (True)."""
    waited = time.monotonic() - wait["since"]
    if waited < wait["bound"]:
        if waited >= wait["next"]:
            print(f"rft: starting Ray... ({waited:.0f} s)", file=sys.stderr, flush=True)
            wait["next"] *= 2
        return False
    # the paragraph first, while the driver, blocked in ray.init, prints nothing; then the driver
    # killed, so that the shell's prompt comes after the paragraph, and before Ray's processes, so
    # that it does not wake to their end and print Ray's errors and a paragraph of another cause.
    # (Frozen with SIGSTOP instead, a terminal's shell took it for a job stopped: '[1]+ Stopped',
    # status 147, its prompt back before the paragraph.)
    theirs = _theirs(seen, driver.pid, driver.create_time(), me.pid)
    print(f"\nrft: the run stopped: Ray's local instance did not start: ray.init waited {waited:.0f} s for its GCS and "
          f"raylet to answer, past cluster.init_timeout_s={wait['bound']:g}, and the driver is stopped (exit 137). "
          f"{_paragraph(wait, {}, driver.pid)}\n", file=sys.stderr, flush=True)
    driver.kill()
    _kill(theirs)
    left = _gone_or_left(theirs)
    if left:
        # no "rft: " of its own: the paragraph above stays the line that says why the run stopped
        # (rft.reporting.report reads a sweep job's last one)
        print(f"(These of the run's Ray processes remain: {_listed(left)}.)", file=sys.stderr, flush=True)
    return True


def _say(head: str, wait: dict, theirs: dict[int, float], driver_pid: int) -> None:
    """The paragraph on the driver's stderr, once the processes killed (`theirs`) are gone (or 5 s)."""
    print(f"\nrft: the run stopped: {head} {_paragraph(wait, _gone_or_left(theirs), driver_pid)}\n", file=sys.stderr,
          flush=True)


def _gone_or_left(theirs: dict[int, float]) -> dict[int, str]:
    """Those of the processes killed (`theirs`) still running after up to 5 s."""
    gone_by = time.monotonic() + 5
    while time.monotonic() < gone_by and _alive(theirs):
        time.sleep(0.1)
    return _alive(theirs)


def _listed(left: dict[int, str]) -> str:
    return ", ".join(f"{pid} ({name})" for pid, name in left.items())


def _paragraph(wait: dict, left: dict[int, str], driver_pid: int) -> str:
    """What the machine looked like, what to try, how to resume."""
    mem = psutil.virtual_memory()
    load = os.getloadavg()[0]
    others = [p for p in _ray_processes() if p.info["name"] == "raylet" and f"_{driver_pid}/" not in " ".join(
        p.info["cmdline"] or [])]
    causes = [f"memory or load (the machine's memory is {mem.percent:.0f}% in use, {mem.available / 2**30:.1f} GiB "
              f"available, its load {load:.1f} on {os.cpu_count()} cores: Ray's processes start slowly, or stall, "
              f"where either is high)"]
    if others:
        causes.append(f"{len(others)} other Ray instance(s) running here (another program's, or one an earlier run "
                      f"left: `ray stop` stops every one of this user's)")
    causes.append("or Ray's session files (/tmp/ray) are on a disk that is full or slow")
    remain = (f"These of its processes remain: {_listed(left)}."
              if left else "Ray's processes of this run are stopped.")
    return (f"Likely causes: {'; '.join(causes)}. {remain} Try again when memory and load are lower (or with a larger "
            f"cluster.init_timeout_s where the machine is slow but not stuck; cluster=inline runs without Ray): "
            f"{wait['resume']}")


def _ray_processes():
    return psutil.process_iter(["name", "cmdline", "uids", "create_time"])


def _theirs(seen: dict, driver_pid: int, driver_started: float, me: int) -> dict[int, float]:
    """`seen` and the processes of the Ray session the driver started that are this user's and younger
    than the driver: Ray names a session's directory session_<local date>_<time>_<microseconds>_<pid of
    its starter>. The session must also be younger than the driver: the pid of a `ray start` that
    exited long ago (its cluster still running, its new workers younger than the driver) may be the
    driver's now, pids being reused."""
    found = dict(seen)
    session = re.compile(rf"/session_(\d{{4}}-\d\d-\d\d_\d\d-\d\d-\d\d_\d{{6}})_{driver_pid}(/|\s|$)")
    uid = os.getuid()
    for p in _ray_processes():
        try:
            named = session.search(" ".join(p.info["cmdline"] or []))
            if (p.pid != me and p.pid not in found and p.info["uids"] and p.info["uids"].real == uid
                    and p.info["create_time"] >= driver_started and named and _ray_kind(p.info["name"])
                    # 1 s: the process's start time is counted in clock ticks, the session's in microseconds
                    and _session_began(named.group(1)) >= driver_started - 1):
                found[p.pid] = p.info["create_time"]
        except (psutil.Error, TypeError, ValueError):  # ValueError: a name of no real date
            pass
    return found


# the processes of a Ray session that name its folder on their command lines: its GCS, its raylet, and
# Python ones (the log monitor, the dashboard, agents); the workers and agents it renames (ray::...) are
# found as the driver's descendants. Not a tool of the user's that names a file of the session: a
# `tail -f` or `less` of its logs, an editor, were killed with the session. (pt_main_thread: a name
# torch may give a Python process's main thread, which /proc then shows as the process's)
RAY_KINDS = ("gcs_server", "raylet", "python", "ray", "pt_main_thread")


def _ray_kind(name) -> bool:
    return isinstance(name, str) and name.lower().startswith(RAY_KINDS)


def _session_began(date: str) -> float:
    """When a session began, from its name (Ray writes the local time: datetime.today())."""
    return datetime.datetime.strptime(date, "%Y-%m-%d_%H-%M-%S_%f").timestamp()


def _kill(procs: dict[int, float]) -> None:
    for pid, started in procs.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == started:
                p.kill()
        except psutil.Error:
            pass


def _alive(procs: dict[int, float]) -> dict[int, str]:
    """Those of `procs` still running (a zombie has ended: its parent has not read its status yet)."""
    left = {}
    for pid, started in procs.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                left[pid] = p.name()
        except psutil.Error:
            pass
    return left


if __name__ == "__main__":
    watch(int(sys.argv[1]))
