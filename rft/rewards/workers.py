"""Scoring in child processes: what reads a model's text with a library that may hang, eat memory
or run it as code.

Two verifiers need this. `math` (rft/rewards/verifiers.py): math_verify bounds its work with
signal.alarm, which works only in a process's main thread, and an answer such as `9^{9^{9}}` makes
sympy compute a huge integer in C while holding the GIL, which freezes the whole explorer (its
explorer.max_timeout watchdog is a thread too: a late call is abandoned, never stopped).
`reasoning_gym` (rft/rewards/reasoning_gym.py): several of its datasets' `score_answer` pass the
model's answer to `eval` (spiral_matrix, string_insertion, binary_matrix, n_queens) or to sympy's
`parse_expr`, which is `eval` too (puzzle24, countdown, polynomial_multiplication, the
integrations): in the explorer's process `<answer>__import__('os').system('...')</answer>` ran a
shell command, and `9**9**9**9` froze it.

So such a call goes to a child process (`Workers`), started on first use and kept for the next
call; if it has not answered within the call's `timeout_seconds` it is killed and the answer scores
0. At most one child per CPU core this process may use (the work is CPU-bound; each child holds
sympy, ~100 MB): more concurrent callers wait for a free one, and that wait is not part of their
timeout. Requests and answers are JSON lines over the child's stdin and stdout.

A child is confined once its libraries are loaded (`confine`), before it takes a request:
- memory: RLIMIT_AS of MEMORY_BYTES (a MemoryError, or a kill, scores 0);
- code: an audit hook refuses to compile any source that is not an expression of literals, names
  and calls of names (what sympy's parse_expr and a list answer compile to): no attribute, no
  subscript, no lambda or statement, no name that starts with `_` and none of REFUSED_NAMES. So the
  text a library evaluates cannot reach `os` or `sys`, write the answer line itself (a forged
  score), or read the request stream (`breakpoint()`); it also refuses subprocesses, sockets,
  ctypes, code objects built by hand and files opened for writing;
- kernel: a syscall filter (libseccomp) refuses execve, fork (a clone without CLONE_THREAD),
  sockets, signals to other processes, tracing, opening a file for writing, changing the file
  system, limits or namespaces, and the keyrings: a wall that holds whatever got past the hook.
"""

from __future__ import annotations

import ast
import atexit
import errno
import json
import os
import re
import resource
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

MEMORY_BYTES = 4 << 30  # RLIMIT_AS of a child: sympy and reasoning-gym need ~0.5 GiB of address space
START_TIMEOUT = 120.0  # importing sympy in a fresh process, on a loaded machine

# names the code a library compiles may not call or read: each reaches the interpreter's own
# machinery (attributes, frames, files, the request stream), not a value
REFUSED_NAMES = frozenset({
    "getattr", "setattr", "delattr", "hasattr", "vars", "globals", "locals", "dir", "open", "exec", "eval",
    "compile", "breakpoint", "input", "help", "print", "exit", "quit", "type", "object", "super", "memoryview",
    "classmethod", "staticmethod", "property", "id", "lambdify", "preview", "init_session", "init_printing",
    "sys", "os", "builtins"})
# what a library compiles of its own, not of the model's text: sympy's parse_expr (each call), and
# collections.namedtuple's constructor (a module imported late)
TRUSTED_SOURCES = frozenset({"from sympy import *"})
_NAMEDTUPLE = re.compile(r"lambda _cls, [\w, ]*: _tuple_new\(_cls, \([\w, ]*\)\)")
_SAFE_NODES = (ast.Module, ast.Expression, ast.Expr, ast.Constant, ast.Name, ast.Load, ast.Call, ast.keyword,
               ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.List, ast.Tuple, ast.Set, ast.Dict,
               ast.operator, ast.unaryop, ast.boolop, ast.cmpop)


class NoWorker(Exception):
    pass


class Workers:
    """Child processes that each run `module:function` (a `serve` loop); `call(request, timeout)`
    sends one request (a JSON list) to an idle child and returns its JSON answer, or raises
    TimeoutError (the child was late, or died: it is killed)."""

    def __init__(self, entry: str):
        self.entry = entry
        self._lock = threading.Lock()
        self._idle: list[subprocess.Popen] = []
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        self._slots = threading.Semaphore(max(1, cores or 1))
        self._pid = os.getpid()
        self._registered = False

    def call(self, request: list, timeout_seconds: float, setup: str | None = None):
        """`setup` names what the child makes once and keeps (a dataset to score with): a child that
        has not made it yet gets START_TIMEOUT more for this call."""
        with self._slots:
            proc = self._take()
            made = proc.__dict__.setdefault("rft_made", set())
            wait = timeout_seconds + (START_TIMEOUT if setup is not None and setup not in made else 0.0)
            try:
                proc.stdin.write((json.dumps(request) + "\n").encode())
                proc.stdin.flush()
                answer = json.loads(read_line(proc.stdout.fileno(), time.monotonic() + wait))
            except Exception as e:  # past its time, or the child died: stop it, the answer is not accepted
                stop(proc)
                raise TimeoutError(f"no answer within {wait:g} s") from e
            made.add(setup)
            with self._lock:
                self._idle.append(proc)
            return answer

    def _take(self) -> subprocess.Popen:
        with self._lock:
            if os.getpid() != self._pid:  # a forked copy of this process: the children are not ours
                self._idle, self._pid = [], os.getpid()
            while self._idle:
                proc = self._idle.pop()
                if proc.poll() is None:
                    return proc
            if not self._registered:
                atexit.register(self.close)
                self._registered = True
        module, fn = self.entry.split(":")
        root = str(Path(__file__).resolve().parents[2])
        code = f"import sys; sys.path.insert(0, {root!r}); from {module} import {fn}; {fn}()"
        try:
            proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        except OSError as e:
            raise NoWorker(f"no worker process could start ({e})") from e
        try:
            if read_line(proc.stdout.fileno(), time.monotonic() + START_TIMEOUT) != b"ready\n":
                raise EOFError
        except Exception as e:
            stop(proc)
            raise NoWorker(f"the worker process did not start ({type(e).__name__}; its error, if any, is on "
                           f"stderr)") from e
        return proc

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for proc in idle:
            stop(proc)


def read_line(fd: int, deadline: float) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError
        chunk = os.read(fd, 4096)
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()
    for f in (proc.stdin, proc.stdout):
        if f:
            f.close()


def serve(fn) -> None:
    """A child's loop: `confine` it, say "ready", then one JSON list in, `fn(*request)` out (JSON),
    per line. `fn` answers its own errors; one that escapes it answers None."""
    out, sys.stdout = sys.stdout, sys.stderr  # whatever a library prints must not break the protocol
    inp = sys.stdin
    sys.stdin = open(os.devnull)  # nor may what it reads come from the requests
    confine()
    out.write("ready\n")
    out.flush()
    for line in inp:  # ends when the parent closes the pipe or dies
        try:
            answer = fn(*json.loads(line))
        except BaseException:  # math_verify's TimeoutException is a BaseException
            answer = None
        out.write(json.dumps(answer) + "\n")
        out.flush()


def confine() -> None:
    """This process's walls (module docstring): the memory limit, the audit hook, the syscall filter."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:
        syscalls = _syscall_filter()
    except (ImportError, OSError, ValueError, RuntimeError) as e:  # no libseccomp: the hook and the limits only
        print(f"rft scoring worker: no syscall filter ({e})", file=sys.stderr, flush=True)
        syscalls = None
    sys.addaudithook(_hook())
    if syscalls is not None:
        syscalls.load()


class Refused(PermissionError):
    """What the audit hook raises: the model's text tried something a scorer never needs."""


def safe_source(source) -> bool:
    """Whether compiled `source` (text, bytes or an ast) is an expression of literals, names and
    calls of names (no attribute, subscript, lambda or statement; no private or refused name)."""
    if isinstance(source, bytes):
        source = source.decode("utf-8", "replace")
    if isinstance(source, str) and (source in TRUSTED_SOURCES or _NAMEDTUPLE.fullmatch(source)):
        return True
    try:
        tree = source if isinstance(source, ast.AST) else ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return True  # it will not compile either
    for node in ast.walk(tree):
        if not isinstance(node, _SAFE_NODES):
            return False
        if isinstance(node, ast.Name) and (node.id.startswith("_") or node.id in REFUSED_NAMES):
            return False
        if isinstance(node, ast.Call) and not isinstance(node.func, ast.Name):
            return False
    return True


def _hook():
    busy = []  # the hook's own ast.parse raises "compile" again
    denied = ("os.system", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.kill", "os.killpg",
              "subprocess.Popen", "pty.spawn", "code.__new__", "function.__new__", "sys.settrace", "sys.setprofile",
              "signal.pthread_kill")
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def hook(event, args):
        if busy:
            return
        if event in denied or event.startswith(("socket.", "ctypes.", "shutil.", "webbrowser.")):
            raise Refused(f"refused: {event}")
        if event == "open" and len(args) >= 3 and ((args[1] is not None and any(c in str(args[1]) for c in "wax+"))
                                                   or (args[2] or 0) & writing):
            raise Refused(f"refused: writing {args[0]}")
        if event == "compile":
            busy.append(1)
            try:
                ok = safe_source(args[0])
            finally:
                busy.pop()
            if not ok:
                raise Refused("refused: compiling code that is not an expression of values and calls")
    return hook


def _syscall_filter():
    import pyseccomp as sc

    f = sc.SyscallFilter(sc.ALLOW)
    f.set_attr(sc.Attr.ACT_BADARCH, sc.ERRNO(errno.ENOSYS))
    deny = sc.ERRNO(errno.EPERM)
    for name in ("execve", "execveat", "fork", "vfork", "socket", "socketpair", "ptrace", "process_vm_writev",
                 "process_vm_readv", "tkill", "pidfd_open", "pidfd_send_signal", "creat", "unlink", "unlinkat",
                 "rename", "renameat", "renameat2", "mkdir", "mkdirat", "rmdir", "link", "linkat", "symlink",
                 "symlinkat", "chmod", "fchmod", "fchmodat", "chown", "fchown", "lchown", "fchownat", "truncate",
                 "ftruncate", "setrlimit", "prlimit64", "unshare", "setns", "mount", "umount2", "pivot_root",
                 "chroot", "add_key", "request_key", "keyctl", "shmget", "msgget", "bpf", "perf_event_open"):
        f.add_rule(deny, name)
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # its flags sit in a struct: the C library falls back to clone
    f.add_rule(sc.ERRNO(errno.ENOSYS), "openat2")
    clone_thread = 0x10000
    f.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, clone_thread, 0))  # a new process, not a thread
    pid = os.getpid()
    f.add_rule(deny, "kill", sc.Arg(0, sc.NE, pid))
    f.add_rule(deny, "tgkill", sc.Arg(0, sc.NE, pid))
    for flag in (os.O_WRONLY, os.O_RDWR, os.O_CREAT, os.O_TRUNC, os.O_APPEND):
        f.add_rule(deny, "openat", sc.Arg(2, sc.MASKED_EQ, flag, flag))
        f.add_rule(deny, "open", sc.Arg(1, sc.MASKED_EQ, flag, flag))
    return f
