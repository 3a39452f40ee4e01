"""Running model-written Python in a sandboxed subprocess (the `python` tool, rft/environments.py).

Code a model wrote never runs in the explorer's or the trainer's process. `run_python(code)` runs
it in a child process, `python -I` (isolated: no user site, no PYTHON* variables), with an empty
environment but PATH, in a fresh temporary directory (its working directory, removed afterwards),
in a session of its own, behind these walls:

- time: killed (its whole process group) after `timeout_s` of wall-clock; RLIMIT_CPU backs it up;
- memory: RLIMIT_AS of `memory_mb` (an allocation past it is a MemoryError);
- files: RLIMIT_FSIZE (16 MiB per file), no core dumps; writes, renames and deletions outside
  its directory are refused (reading is allowed: imports read the standard library);
- network: a network namespace of its own with no interfaces (`unshare -rn`, where the machine
  allows user namespaces), and, always, the socket audit events are refused;
- processes: no subprocesses, fork, exec, signals to other processes (`os.kill` of its parent),
  no ctypes (native code could undo the rest).

The refusals are a CPython audit hook (PEP 578) installed before the code is compiled; an audit
hook cannot be removed. It is a guard against a model's mistakes and casual escapes, not a
security boundary against a determined attacker: native code or an interpreter bug can get past
it. The namespace and the resource limits are the real walls; for hostile code, run the explorer
in a container (gVisor, nsjail) as well.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache

# the first refusal, written on the child's stderr after this marker (and parsed out of it)
_MARK = "@@rft-sandbox-refused:"

# runs in the child before the user's code: limits, then the audit hook, then the code
_BOOTSTRAP = r'''
import os, resource, sys
mem, cpu, root, mark = int(sys.argv[1]), int(sys.argv[2]), os.path.realpath(sys.argv[3]), sys.argv[4]
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
code = open("main.py").read()
refused = []
def refuse(why):
    if not refused:
        refused.append(why)
        os.write(2, (mark + why + "\n").encode())
    raise PermissionError("refused: " + why)
def inside(path):
    try:
        p = os.path.realpath(os.fsdecode(path) if not isinstance(path, int) else "/")
    except Exception:
        return False
    return p == root or p.startswith(root + os.sep)
DENY = {"os.system": "os.system (no subprocesses)", "subprocess.Popen": "subprocess.Popen (no subprocesses)",
        "os.fork": "os.fork (no subprocesses)", "os.forkpty": "os.fork (no subprocesses)",
        "os.posix_spawn": "os.posix_spawn (no subprocesses)", "os.spawn": "os.spawn (no subprocesses)",
        "os.exec": "os.exec (no subprocesses)", "os.kill": "os.kill (signals to other processes)",
        "os.killpg": "os.killpg (signals to other processes)",
        "signal.pthread_kill": "signal.pthread_kill (signals to other processes)",
        "ctypes.dlopen": "ctypes (native code)", "ctypes.dlsym": "ctypes (native code)",
        "ctypes.cdata": "ctypes (native code)", "ctypes.call_function": "ctypes (native code)",
        "os.putenv": None, "sys.addaudithook": None}
WRITES = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link", "os.symlink",
          "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move")
def hook(event, args):
    if event.startswith("socket."):
        refuse("network access (" + event + ")")
    if event in DENY and DENY[event]:
        refuse(DENY[event])
    if event == "open" and len(args) >= 3:
        path, mode, flags = args[0], args[1], args[2]
        writing = (mode is not None and any(c in str(mode) for c in "wax+")) or (flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND))
        if writing and path is not None and not inside(path):
            refuse("writing outside the sandbox directory: " + str(path))
    if event in WRITES:
        for p in args[:2]:
            if isinstance(p, (str, bytes, os.PathLike)) and not inside(p):
                refuse(event + " outside the sandbox directory: " + os.fsdecode(p))
sys.addaudithook(hook)
exec(compile(code, "main.py", "exec"), {"__name__": "__main__"})
'''


@dataclass
class SandboxResult:
    ok: bool  # ran to the end with exit status 0
    stdout: str
    stderr: str
    reason: str | None  # None when ok: else one sentence a model (and a person) can read
    returncode: int | None
    seconds: float


@lru_cache(maxsize=1)
def _unshare() -> list[str]:
    """`unshare -rn` (a network namespace with no interfaces) when this machine allows it."""
    exe = shutil.which("unshare")
    if exe is None:
        return []
    try:
        ok = subprocess.run([exe, "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return [exe, "-rn"] if ok else []


_use_unshare = True  # tests turn it off to check the audit hook alone


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n... [cut: {len(text) - limit} more characters]"


def run_python(code: str, timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 4000,
               stdin: str = "") -> SandboxResult:
    """Run `code` in a sandboxed child process (module docstring); never raises for what the code does."""
    d = tempfile.mkdtemp(prefix="rft-sandbox-")
    t0 = time.monotonic()
    try:
        with open(os.path.join(d, "main.py"), "w") as f:
            f.write(code)
        cmd = (_unshare() if _use_unshare else []) + [
            sys.executable, "-I", "-c", _BOOTSTRAP, str(memory_mb << 20), str(max(1, int(timeout_s) + 1)), d, _MARK]
        p = subprocess.Popen(cmd, cwd=d, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"},
                             start_new_session=True)
        timed_out = False
        try:
            out, err = p.communicate(stdin.encode(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = p.communicate()
        out, err = out.decode(errors="replace"), err.decode(errors="replace")
        refused = None
        if _MARK in err:
            lines = err.split("\n")
            refused = next(l for l in lines if l.startswith(_MARK))[len(_MARK):]
            err = "\n".join(l for l in lines if not l.startswith(_MARK))
        rc = p.returncode
        last = (err.strip().splitlines() or [""])[-1]
        if timed_out:
            reason = f"timed out after {timeout_s:g} s (killed)"
        elif refused is not None:
            reason = f"refused: {refused}"
        elif "MemoryError" in last or rc == -signal.SIGKILL:
            reason = f"memory limit of {memory_mb} MiB exceeded"
        elif rc == -signal.SIGXCPU:
            reason = f"CPU time limit of {int(timeout_s) + 1} s exceeded (killed)"
        elif rc != 0:
            reason = f"exited with status {rc}" + (f": {last}" if last else "")
        else:
            reason = None
        return SandboxResult(reason is None, _cut(out, max_output_chars), _cut(err, max_output_chars), reason, rc,
                             time.monotonic() - t0)
    finally:
        shutil.rmtree(d, ignore_errors=True)
