"""Model-written code runs in a sandbox (rft/rollout/environments/sandbox.py): each wall stops or refuses, says why, and
the calling process is unharmed.

The escapes a security review made on the sandbox that was an audit hook plus `unshare -rn` are
each a test here, written as the attack: it must fail now. Most switch the audit hook off first,
both ways: `NO_HOOK` is the review's own switch (the hook kept its state in `__main__`), and the
`no_guard` fixture starts the code without the hook, so the wall under test holds on its own.

Isolation needs bubblewrap: without it these tests skip, unless RFT_REQUIRE_SANDBOX=1 (CI), where
they fail. The tests of a machine without it (`no_bwrap`) run everywhere.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import tracemalloc
import uuid
from pathlib import Path

import pytest

from rft.data.tasks import Task, tool_call_text
from rft.errors import ConfigError
from rft.rollout.environments import sandbox, seccomp
from rft.rollout.environments.tools import PythonEnv

# the review's way to switch the old hook off; harmless now (the code gets a fresh __main__)
NO_HOOK = "import __main__\n__main__.refuse = lambda why: None\n"
PROJECT_FILE = str(Path(sandbox.__file__).resolve())


@pytest.fixture(autouse=True)
def isolated(request):
    if "no_bwrap" in request.fixturenames:
        return
    mode, why = sandbox.isolation(sandbox._BWRAP)
    if mode is None:
        if os.environ.get("RFT_REQUIRE_SANDBOX"):
            pytest.fail(f"no sandbox on this machine (RFT_REQUIRE_SANDBOX=1): {why}")
        pytest.skip(f"no sandbox on this machine: {why} (as root: apt-get install bubblewrap)")


@pytest.fixture
def no_guard(monkeypatch):
    monkeypatch.setattr(sandbox, "_guard", False, raising=False)


@pytest.fixture
def no_bwrap(monkeypatch):
    monkeypatch.setattr(sandbox, "_BWRAP", "rft-no-such-bwrap", raising=False)


def run(code, **kw):
    r = sandbox.run_python(code, **kw)
    assert os.getpid() > 0  # this process is alive (a child's os.kill of its parent would have ended it)
    return r


def host_pids_with(marker: str) -> list[int]:
    """Processes of this machine whose command line holds `marker`."""
    out = []
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and marker.encode() in open(f"/proc/{p}/cmdline", "rb").read():
                out.append(int(p))
        except OSError:
            pass
    return out


# ---------------------------------------------------------------- what code may do, and the reasons

def test_plain_code_runs_and_its_output_comes_back():
    r = run("print(sum(range(10)))")
    assert (r.ok, r.stdout, r.reason, r.returncode) == (True, "45\n", None, 0)  # 0 + 1 + ... + 9 = 45
    r = run("x = input(); print(x[::-1])", stdin="abc\n")
    assert r.stdout == "cba\n"
    # its own directory is writable, and the standard library readable
    r = run("open('in.txt', 'w').write('hi'); print(open('in.txt').read()); import json; print(json.dumps([1]))")
    assert r.ok and r.stdout == "hi\n[1]\n"


def test_an_exception_is_a_failure_with_its_message():
    r = run("1/0")
    assert not r.ok and r.reason == "exited with status 1: ZeroDivisionError: division by zero"
    assert "Traceback" in r.stderr and r.returncode == 1
    # a lone surrogate (valid in a JSON tool call) is the code's error, not the caller's
    r = run("print('\ud800')")
    assert r.reason.startswith("exited with status 1: SyntaxError: (unicode error) 'utf-8' codec can't decode")


@pytest.mark.slow
def test_code_that_loops_forever_is_killed_at_the_time_limit():
    r = run("while True: pass", timeout_s=1)
    assert not r.ok and r.reason == "timed out after 1 s (killed)"
    assert 1 <= r.seconds < 10


def test_code_that_allocates_10_gib_is_stopped():
    r = run("x = bytearray(10 * 1024**3)", memory_mb=256)
    assert not r.ok and r.reason == "memory limit of 256 MiB exceeded"
    r = run("l = []\nwhile True: l.append(' ' * 10**7)", memory_mb=256)
    assert r.reason == "memory limit of 256 MiB exceeded"


THREADS = """
import threading
ev, n = threading.Event(), 0
try:
    for _ in range(40):
        threading.Thread(target=ev.wait).start()
        n += 1
except RuntimeError:
    pass
ev.set()
print(n)
"""


def test_threads_are_bounded_by_their_stacks_reservation_until_the_code_makes_stacks_smaller():
    # RLIMIT_AS (memory_mb, 512) counts each thread's 8 MiB stack reservation: fewer than 31 start
    # (14 here); with 256 KiB stacks the process cap of 32 is what stops them: 31 beside the main one
    r = run(THREADS)
    assert r.ok and 0 < int(r.stdout) < 31
    r = run("import threading; threading.stack_size(256 * 1024)\n" + THREADS)
    assert r.ok and int(r.stdout) == 31


def test_output_is_cut_at_the_limit():
    r = run("print('x' * 10**6)", max_output_bytes=100)
    assert r.ok and r.stdout == "x" * 100 + "\n... [cut: 999901 more bytes]"  # 10**6 + 1 (newline) - 100


def test_any_bytes_the_code_writes_come_back_as_text_and_never_raise():
    # invalid UTF-8 and NUL on stdout; on stderr the refusal marker mid-line (before, StopIteration
    # escaped run_python: the marker was found, yet no line started with it)
    r = run("import sys\nsys.stdout.buffer.write(b'\\xff\\xfe\\x00ok')\n"
            f"sys.stderr.write('x{sandbox._MARK}forged')")
    assert (r.ok, r.reason, r.stdout, r.stderr) == (True, None, "\ufffd\ufffd\x00ok", f"x{sandbox._MARK}forged")


def test_the_guard_refuses_mistakes_with_a_reason():
    r = run("import os, signal; os.kill(os.getppid(), signal.SIGKILL)")
    assert r.reason == "refused: os.kill (signals to other processes)"
    assert run("import os; os.system('echo hi')").reason == "refused: os.system (no subprocesses)"
    assert run("import subprocess; subprocess.run(['ls'])").reason == "refused: subprocess.Popen (no subprocesses)"
    assert run("import ctypes; ctypes.CDLL(None)").reason == "refused: ctypes (native code)"
    assert run("import socket; socket.socket().connect(('127.0.0.1', 80))").reason == \
        "refused: network access (socket.__new__)"
    assert run("import urllib.request; urllib.request.urlopen('http://127.0.0.1:1')").reason == \
        "refused: network access (socket.getaddrinfo)"
    assert run("open('/tmp/x', 'w')").reason == "refused: writing outside the sandbox directory: /tmp/x"
    assert run("import sqlite3; sqlite3.connect('/tmp/x.db')").reason == \
        "refused: sqlite3.connect outside the sandbox directory: /tmp/x.db"
    # a refusal the code catches is still reported
    r = run("import os\ntry:\n    os.kill(os.getppid(), 9)\nexcept Exception:\n    pass\nprint('after')")
    assert r.stdout == "after\n" and r.reason == "refused: os.kill (signals to other processes)" and not r.ok


def test_it_sees_little_writes_only_its_small_tmpfs_and_runs_unprivileged(no_guard):
    r = run("import os\nprint(sorted(os.listdir('/')))\nfor p in ('/usr/rft-x', '/dev/shm/rft-x'):\n    try:\n"
            "        open(p, 'w')\n    except OSError as e:\n        print(e.errno)\nst = open('/proc/self/status').read()\n"
            "print(os.getuid(), [ln.split()[1] for ln in st.splitlines() if ln.startswith(('CapEff', 'NoNewPrivs'))])")
    top = set(r.stdout.splitlines()[0][2:-2].split("', '"))
    # /usr and its links, the interpreter's prefix (here under /root: that path alone), and its own
    prefix_top = Path(sys.base_prefix).resolve().parts[1]
    assert {"usr", "work", "tmp", "proc", "dev"} <= top <= {"usr", "work", "tmp", "proc", "dev", "bin", "sbin", "lib",
                                                            "lib32", "lib64", prefix_top}, top
    uid = int(r.stdout.split()[-3])
    assert r.stdout.splitlines()[1:] == ["30", "30", f"{uid} ['0000000000000000', '1']"]  # EROFS; no capabilities
    assert uid != 0 and (os.geteuid() != 0 or uid >= 2**30)
    if os.geteuid() == 0:  # a fresh uid each call: RLIMIT_NPROC counts one sandbox's processes
        assert int(run("import os; print(os.getuid())").stdout) not in (uid, 0)
    # a file past 16 MiB fails (EFBIG, 27); /work holds four files of 15 MiB (64 MiB), not five (ENOSPC, 28)
    r = run("import os\ntry:\n    open('big', 'wb').write(b'x' * (17 << 20))\nexcept OSError as e:\n    print(e.errno)\n"
            "os.remove('big')\nn = 0\ntry:\n    while True:\n        open(f'f{n}', 'wb').write(b'x' * (15 << 20))\n"
            "        n += 1\nexcept OSError as e:\n    print(n, e.errno)")
    assert r.stdout == "27\n4 28\n"
    # its stdin is read-only (and no one can write the memfd behind it: below)
    r = run("import os\ntry:\n    os.write(0, b'x')\nexcept OSError as e:\n    print(e.errno)", stdin="abc")
    assert r.stdout == "9\n"  # EBADF


# ---------------------------------------------------------------- the review's escapes, as attacks

def test_the_guard_cannot_be_switched_off_from_the_code(tmp_path):
    target = tmp_path / "ctypes.txt"
    r = run(NO_HOOK + f"import ctypes\nctypes.CDLL(None).system(b'touch {target}')")
    assert r.reason == "refused: ctypes (native code)" and not target.exists()
    # its state is nowhere the code can look: not in __main__, not through the garbage collector
    r = run("import __main__\nprint(sorted(k for k in vars(__main__) if not k.startswith('__')))")
    assert r.stdout == "[]\n"
    r = run("import gc\nhook = [f for f in gc.get_objects() if getattr(f, '__name__', '') == 'hook']")
    assert r.reason == "refused: gc introspection"


@pytest.mark.parametrize("guard", [True, False])
def test_files_outside_cannot_be_written_by_ways_the_guard_does_not_see(tmp_path, monkeypatch, guard):
    # dir_fd and _posixsubprocess raise no event the hook can check, sqlite3 none the old one did;
    # with the hook on, and off (the walls alone)
    monkeypatch.setattr(sandbox, "_guard", guard, raising=False)
    args = "-1, None, None, None, -1, None, True" if sys.version_info >= (3, 11) else "None, None, None, -1, None"
    attacks = {
        "dirfd.txt": f"import os\nfd = os.open({str(tmp_path)!r}, os.O_RDONLY)\n"
                     "os.close(os.open('dirfd.txt', os.O_CREAT | os.O_WRONLY, dir_fd=fd))",
        "db.sqlite": NO_HOOK + f"import sqlite3\nsqlite3.connect({str(tmp_path / 'db.sqlite')!r}).execute('create table t(x int)')",
        "sh.txt": "import os, _posixsubprocess\nr, w = os.pipe()\n"
                  f"pid = _posixsubprocess.fork_exec([b'/bin/sh', b'-c', b'echo x > {tmp_path}/sh.txt'], [b'/bin/sh'], "
                  f"True, (), None, None, -1, -1, -1, -1, -1, -1, r, w, False, False, {args})\n"
                  "print(os.waitpid(pid, 0)[1] >> 8)",
    }
    for name, code in attacks.items():
        r = run(code)
        assert not (tmp_path / name).exists(), (name, r)
    assert r.stdout == "2\n"  # the shell ran, and found no such directory (exit status 2)


def test_the_hosts_files_and_processes_cannot_be_read(tmp_path):
    secret = tmp_path / "token.txt"
    secret.write_text("hunter2")
    paths = ["/etc/shadow", PROJECT_FILE, str(secret)]
    r = run(f"for p in {paths!r}:\n    try:\n        print(p, open(p).read()[:10])\n"
            "    except OSError as e:\n        print(p, type(e).__name__)")
    assert r.stdout == "".join(f"{p} FileNotFoundError\n" for p in paths)
    # nor this machine's name (it saw it: its UTS namespace kept the host's)
    assert run("import os; print(os.uname().nodename)").stdout == "sandbox\n"
    # the standard library only: neither the project nor the venv's packages
    assert run("import rft").reason == "exited with status 1: ModuleNotFoundError: No module named 'rft'"
    assert run("import pytest").reason == "exited with status 1: ModuleNotFoundError: No module named 'pytest'"
    # a host process with a token on its command line: the sandbox sees only its own two processes
    marker = f"--token=rft-{uuid.uuid4().hex}"
    host = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])
    try:
        r = run("import os\npids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
                f"print(len(pids), [p for p in pids if {marker!r}.encode() in open(f'/proc/{{p}}/cmdline', 'rb').read()])")
        assert r.stdout == "2 []\n"  # bwrap's pid 1 and the code itself
    finally:
        host.kill()
        host.wait()


def test_host_sockets_cannot_be_reached(tmp_path, no_guard, monkeypatch):
    # a socket file, an abstract socket and a port on the host's loopback; the syscall filter, which
    # refuses every socket (tests/test_sandbox_attacks.py), lets them be made here: the namespaces hold alone
    monkeypatch.setattr(seccomp, "DENIED", tuple(n for n in seccomp.DENIED if n not in ("socket", "socketpair")))
    path, abstract = str(tmp_path / "s.sock"), f"\0rft-{uuid.uuid4().hex}"
    servers = []
    for family, address in ((socket.AF_UNIX, path), (socket.AF_UNIX, abstract), (socket.AF_INET, ("127.0.0.1", 0))):
        s = socket.socket(family)
        s.bind(address)
        s.listen()
        servers.append(s)
    port = servers[-1].getsockname()[1]
    try:
        r = run(NO_HOOK + f"import socket\nfor a in {[path, abstract, ('127.0.0.1', port)]!r}:\n"
                "    s = socket.socket(socket.AF_UNIX if isinstance(a, str) else socket.AF_INET)\n"
                "    try:\n        s.connect(a); print('connected')\n    except OSError as e:\n        print(type(e).__name__)")
        assert r.stdout == "FileNotFoundError\nConnectionRefusedError\nConnectionRefusedError\n"
    finally:
        for s in servers:
            s.close()


@pytest.mark.slow
def test_every_process_of_the_sandbox_dies_at_the_timeout_setsid_too(no_guard):
    marker = f"rft-{uuid.uuid4().hex}"
    code = NO_HOOK + ("import os, sys, time\nif os.fork() == 0:\n    os.setsid()\n"
                      f"    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
                      "time.sleep(60)")
    try:
        r = run(code, timeout_s=1)
        assert r.reason == "timed out after 1 s (killed)"
        assert r.seconds < 30  # the caller never waits for the child's life (60 s; the old sandbox did)
        assert host_pids_with(marker) == []
    finally:
        for pid in host_pids_with(marker):
            os.kill(pid, 9)


def test_output_past_the_limit_kills_it_and_the_caller_stays_small():
    tracemalloc.start()
    try:
        r = run("import sys\nsys.stdout.write('x' * 10**8)")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert r.reason == "output limit of 1048576 bytes exceeded (killed)"
    assert re.fullmatch(r"x{4000}\n\.\.\. \[cut: \d+ more bytes\]", r.stdout)
    assert peak < 4 << 20  # 100 MB printed; the caller held 64 KiB reads and 4000 bytes (the old one: 300 MB)
    r = run("while True: print('x' * 1000)", timeout_s=5)
    assert r.reason == "output limit of 1048576 bytes exceeded (killed)"  # not the 5 s timeout


def test_memory_is_capped_for_all_its_processes_together(no_guard):
    # 3 children of 400 MiB each: each under the 512 MiB per process, 1.2 GiB together
    code = NO_HOOK + ("import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n"
                      "        b = b'x' * (400 << 20)\n        time.sleep(30)\n        os._exit(0)\ntime.sleep(30)")
    r = run(code, memory_mb=512, timeout_s=10)
    assert r.reason == "memory limit of 512 MiB exceeded (all its processes together; killed)"  # not the timeout


def test_memory_in_memfds_counts_too():
    # 40 memfds of 16 MiB (the largest file) = 640 MiB held open, no page of it mapped (not resident)
    code = ("import os, time\nfds = []\nfor i in range(40):\n    fds.append(os.memfd_create(f'm{i}'))\n"
            "    os.write(fds[-1], b'x' * (16 << 20))\ntime.sleep(30)")
    r = run(code, memory_mb=512, timeout_s=10)
    assert r.reason == "memory limit of 512 MiB exceeded (all its processes together; killed)"


def test_processes_are_capped(no_guard):
    code = NO_HOOK + ("import os, time\nn = 0\nfor _ in range(64):\n    try:\n        pid = os.fork()\n"
                      "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(5)\n        os._exit(0)\n"
                      "    n += 1\nprint(n)")
    r = run(code)
    assert r.ok and r.stdout == "31\n"  # max_processes=32: the code and 31 children


@pytest.mark.slow
def test_a_fork_bomb_is_contained_and_leaves_nothing_behind(no_guard):
    code = ("import os\nprint(os.readlink('/proc/self/ns/pid'), flush=True)\n"
            "while True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    r = run(code, timeout_s=2, max_processes=8)
    assert r.reason == "timed out after 2 s (killed)"
    ns = r.stdout.splitlines()[0]
    assert re.fullmatch(r"pid:\[\d+\]", ns)
    left = []
    for p in os.listdir("/proc"):
        try:
            left += [p] if p.isdigit() and os.readlink(f"/proc/{p}/ns/pid") == ns else []
        except OSError:
            pass
    assert left == []


# ---------------------------------------------------------------- past the guard: the kernel's shared parts

def unguarded(code: str) -> str:
    """Sandbox code that runs `code` in a fresh interpreter: one started through _posixsubprocess
    (which raises no audit event) has no audit hook, so ctypes is open to it; the walls are not."""
    args = "-1, None, None, None, -1, None, True" if sys.version_info >= (3, 11) else "None, None, None, -1, None"
    return ("import os, sys, _posixsubprocess\nr, w = os.pipe()\nexe = sys.executable.encode()\n"
            f"pid = _posixsubprocess.fork_exec([exe, b'-I', b'-S', b'-c', {code.encode()!r}], [exe], True, (), None, "
            f"None, -1, -1, -1, -1, -1, -1, r, w, False, False, {args})\nos.waitpid(pid, 0)\n")


# add_key, keyctl (the caller's side of the keyring attack; the numbers of the native ABI)
KEY_CALLS = {"x86_64": (248, 250), "aarch64": (217, 219)}
NATIVE = r"""
import ctypes, platform
libc = ctypes.CDLL(None, use_errno=True)
def show(what, ret):
    print(what, ret, ctypes.get_errno() if ret == -1 else 0, flush=True)
add_key, keyctl = {"x86_64": (248, 250), "aarch64": (217, 219)}[platform.machine()]
# the caller's session keyring: KEYCTL_SEARCH (10) it for the caller's key, then KEYCTL_READ (11)
buf = ctypes.create_string_buffer(64)
kid = libc.syscall(keyctl, 10, -3, b"user", b"rft-secret", 0)
show("search", kid)
n = libc.syscall(keyctl, 11, kid, buf, 64)
print("read", buf.raw[:max(0, n)])
show("add_key", libc.syscall(add_key, b"user", b"rft-left-behind", b"x", 1, -3))
# a user and mount namespace of its own: a tmpfs there would be memory no process counts
show("unshare", libc.unshare(0x10000000 | 0x20000))
# SysV shared memory: 4 x 50 MiB touched and unmapped, outside every process (memory_mb=128)
libc.shmat.restype = ctypes.c_void_p
for _ in range(4):
    sid = libc.shmget(0, 50 << 20, 0o600)
    if sid == -1:
        break
    p = libc.shmat(sid, None, 0)
    ctypes.memset(p, 1, 50 << 20)
    libc.shmdt(ctypes.c_void_p(p))
show("shmget", sid)
show("msgget", libc.msgget(0, 0o600))
"""


def test_code_past_the_guard_reaches_no_keyring_namespace_or_shared_memory(tmp_path):
    # the caller holds a secret in its session keyring (a fresh one, in a process of its own, so
    # this one's is left alone); the keyrings are the kernel's, in no namespace
    caller = tmp_path / "caller.py"
    caller.write_text(f"import ctypes, platform, sys\nfrom rft.rollout.environments import sandbox\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                      f"add_key, keyctl = {KEY_CALLS!r}[platform.machine()]\n"
                      "assert libc.syscall(keyctl, 1, b'rft-test') > 0  # KEYCTL_JOIN_SESSION_KEYRING\n"
                      "assert libc.syscall(add_key, b'user', b'rft-secret', b'hunter2', 7, -3) > 0\n"
                      f"r = sandbox.run_python(sys.stdin.read(), memory_mb=128, timeout_s=10)\n"
                      "print(r.stdout + str(r.reason), end='')\n"
                      "print('\\nleft', libc.syscall(keyctl, 10, -3, b'user', b'rft-left-behind', 0) > 0)\n")
    project = str(Path(sandbox.__file__).resolve().parents[3])
    p = subprocess.run([sys.executable, str(caller)], input=unguarded(NATIVE), capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PYTHONPATH": project})
    assert p.returncode == 0, p.stderr
    # each refused (EPERM = 1): before, the search found the caller's key and read 'hunter2', the
    # key was left in the caller's keyring, unshare succeeded (root), and 200 MiB sat in SysV
    # segments of a sandbox of 128 MiB that was never stopped
    assert p.stdout.splitlines() == ["search -1 1", "read b''", "add_key -1 1", "unshare -1 1", "shmget -1 1",
                                     "msgget -1 1", "None", "left False"]
    # fork, exec and threads still work (clone without a namespace flag; clone3 falls back to it)
    r = run("import threading\nt = threading.Thread(target=print, args=('thread',), kwargs={'flush': True})\nt.start()\nt.join()\n"
            + unguarded("print('fresh')"))
    assert (r.ok, r.stdout) == (True, "thread\nfresh\n")


@pytest.mark.slow
def test_no_one_can_write_the_file_behind_its_stdin():
    # stdin was a temporary file on the caller's disk, opened read-only; through /proc/self/fd/0 the
    # file could be opened again for writing by its owner: in user mode (a caller that is not root)
    # the code's uid maps to the caller's, and it wrote 16 MiB there (measured as uid 65534). Here,
    # as root, this process does what that code did, to the sandbox's stdin while it runs
    import threading

    def sandbox_pids():
        out = []
        for pid in host_pids_with(sandbox._MARK):  # the bootstrap's arguments hold the marker
            ppid = pid
            while ppid > 1 and ppid != os.getpid():
                ppid = int(open(f"/proc/{ppid}/stat").read().rsplit(")", 1)[1].split()[1])
            out += [pid] if ppid == os.getpid() else []
        return out

    done = []
    t = threading.Thread(target=lambda: done.append(run("import time; time.sleep(3); print(input())", stdin="abc\n")))
    t.start()
    try:
        for _ in range(100):
            pids = sandbox_pids()
            if pids:
                break
            time.sleep(0.05)
        assert pids
        fd = os.open(f"/proc/{pids[-1]}/fd/0", os.O_WRONLY)
        try:
            with pytest.raises(PermissionError):  # EPERM: a sealed memfd, in no one's disk
                os.write(fd, b"x" * 1000)
        finally:
            os.close(fd)
    finally:
        t.join()
    assert done[0].stdout == "abc\n"


# ---------------------------------------------------------------- a machine without isolation

def test_without_bwrap_model_code_is_refused_with_one_paragraph(no_bwrap):
    msg = ("The python environment runs model-written code only inside an isolated sandbox, and this machine "
           "cannot make one: bubblewrap (rft-no-such-bwrap) is not installed. Install bubblewrap (as root: "
           "`apt-get install bubblewrap`, which `make test` does)")
    with pytest.raises(ConfigError) as e:
        sandbox.run_python("print(1)")
    assert str(e.value).startswith(msg) and "\n" not in str(e.value)
    assert "`workflow_args.env_args.allow_unisolated: true` on the python environment" in str(e.value)
    with pytest.raises(ConfigError, match="cannot make one: bubblewrap"):
        PythonEnv()


def test_a_bwrap_that_cannot_make_namespaces_is_refused_with_its_reason(tmp_path, monkeypatch):
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sandbox, "_BWRAP", str(fake))
    with pytest.raises(ConfigError, match=re.escape(f"cannot make one: {fake} failed: bwrap: No permissions to "
                                                    "create new namespace. Install bubblewrap")):
        sandbox.run_python("print(1)")


def test_a_machine_without_libseccomp_is_refused_with_its_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyseccomp", None)  # its import fails, as without libseccomp.so.2
    with pytest.raises(ValueError, match=r"^libseccomp, which compiles the sandbox's syscall filter, does not "
                                         r"load \("):
        seccomp.program()
    sandbox.isolation.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"cannot make one: libseccomp, which compiles the sandbox's syscall "
                                              r"filter, does not load \(.*`apt-get install libseccomp2`, `pip "
                                              r"install pyseccomp`\)\. Install bubblewrap"):
            sandbox.run_python("print(1)")
    finally:
        sandbox.isolation.cache_clear()


@pytest.mark.slow
def test_the_unisolated_opt_out_keeps_the_limits_and_the_guard(no_bwrap, tmp_path):
    r = sandbox.run_python("print(6*7)", allow_unisolated=True)
    assert (r.ok, r.stdout) == (True, "42\n")
    assert sandbox.run_python("while True: pass", timeout_s=1, allow_unisolated=True).reason == \
        "timed out after 1 s (killed)"
    assert sandbox.run_python("x = bytearray(10 * 1024**3)", memory_mb=256, allow_unisolated=True).reason == \
        "memory limit of 256 MiB exceeded"
    r = sandbox.run_python(f"open({str(tmp_path / 'x')!r}, 'w')", allow_unisolated=True)
    assert r.reason == f"refused: writing outside the sandbox directory: {tmp_path / 'x'}"
    assert sandbox.run_python("import socket; socket.socket()", allow_unisolated=True).reason == \
        "refused: network access (socket.__new__)"
    env = PythonEnv(allow_unisolated=True)
    env.reset(Task("t/0", [{"role": "user", "content": "6*7"}], "42", {}))
    assert env.step(tool_call_text("python", {"code": "print(6*7)"}))[0] == {"role": "tool", "content": "42"}


# ---------------------------------------------------------------- the tool, in a conversation

@pytest.mark.slow
def test_the_python_tool_answers_failures_with_their_reason_and_the_conversation_goes_on():
    env = PythonEnv(max_tool_calls=8, timeout_s=1, memory_mb=256)
    env.reset(Task("t/0", [{"role": "user", "content": "37*48"}], "1776", {}))
    call = lambda code: tool_call_text("python", {"code": code})  # noqa: E731
    msg, parts, done = env.step(call("print(37*48)"))
    assert (msg, parts, done) == ({"role": "tool", "content": "1776"}, {}, False)
    for code, reason in [("while True: pass", "timed out after 1 s (killed)"),
                         ("x = bytearray(10 * 1024**3)", "memory limit of 256 MiB exceeded"),
                         ("import socket; socket.create_connection(('127.0.0.1', 80))", "refused: network access (socket.getaddrinfo)"),
                         ("open('/etc/rft_x', 'w')", "refused: writing outside the sandbox directory: /etc/rft_x"),
                         ("import os; os.kill(os.getppid(), 9)", "refused: os.kill (signals to other processes)")]:
        msg, parts, done = env.step(call(code))
        assert msg == {"role": "tool", "content": f"error: {reason}"} and not done, code
    assert env.info["tool_calls"] == 6 and env.info["tool_failures"] == 5
    assert env.step("1776") == (None, {"correct": 1.0}, True)


def test_the_python_environment_runs_in_the_multi_turn_workflow_on_the_explorers_runners(tools_model):
    """workflow multi_turn with env=python: the explorer's runner threads (run_jobs) call the
    sandbox, 4 conversations at once; the tool's answer is in each conversation."""
    from test_multi_turn import HASH_TEMPLATE, Scripted, ctx_for, tokenizer

    from rft.rollout.explorer import run_jobs
    from rft.rollout.workflows.multi_turn import multi_turn

    tok = tokenizer(tools_model, HASH_TEMPLATE)
    engine = Scripted(tok, [(tool_call_text("python", {"code": "print(7*8)"}), "stop"), ("56", "stop")])
    call = lambda fn, jobs: run_jobs(fn, jobs, 4, 30.0, 0)[0]  # noqa: E731
    task = Task("calc/0", [{"role": "user", "content": "7*8"}], "56", {})
    [group] = multi_turn([task], engine, ctx_for(tok, {"env": "python"}, n=4, call=call))
    assert len(group) == 4
    for e in group:
        assert [m["content"] for m in e.info["conversation"] if m["role"] == "tool"] == ["56"]
        assert e.reward == 1.0 and e.info["tool_calls"] == 1 and e.info["tool_failures"] == 0


@pytest.fixture(scope="module")
def tools_model(cache_dir):
    from rft.models import build_tiny_model

    return build_tiny_model(cache_dir / "models" / "tiny-qwen2-tools-v4", tools=True)


@pytest.mark.slow  # 1.0 s alone, over the fast tier's second
def test_a_run_with_the_python_environment_on_a_machine_without_a_sandbox_stops_when_planned(no_bwrap):
    # before, the plan passed; every conversation's environment then failed to build, and the run
    # stopped only after explorer.max_failed_steps steps of failed tasks, blaming its tasks
    from test_config import CALC, TS, plan_for

    with pytest.raises(ConfigError, match=r"^The python environment runs model-written code only inside an "
                                          r"isolated sandbox, and this machine cannot make one: bubblewrap"):
        plan_for(["stages=[]", *CALC, f"{TS}.workflow_args.env=python"])
    plan_for(["stages=[]", *CALC, f"{TS}.workflow_args.env=python",
              f"+{TS}.workflow_args.env_args.allow_unisolated=true"])  # the opt-out plans
