"""Running model-written Python in a sandbox (the `python` tool, rft/rollout/environments/tools.py).

Code a model wrote never runs in the explorer's or the trainer's process. `run_python(code)` runs
it in `python -I -S` (the standard library only) inside bubblewrap (`bwrap`), behind these walls:

- files: a mount namespace whose root holds only /usr (and /bin, /lib...) and the interpreter's
  prefix, read-only, its own /proc, a minimal read-only /dev (no ptys), and two tmpfs of TMPFS_BYTES each:
  /work (its working directory) and /tmp. The project, the venv, /etc, /home, the host's sockets:
  not there. RLIMIT_FSIZE caps a file at FILE_BYTES. Its stdin is a sealed memfd (no one can write
  it, and it counts in its memory).
- processes: a pid namespace of its own (it sees only itself). At a wall, the caller kills the
  sandbox's pid 1 (the kernel then kills every process of the namespace, setsid or not) and then
  bwrap; `--die-with-parent` does the same if the caller dies. At every end the caller kills that
  pid 1 and waits for it (through a pidfd from bwrap's --info-fd), so nothing outlives the call.
  RLIMIT_NPROC caps its processes and threads at `max_processes`.
- network: a network namespace with only its own loopback; also IPC and UTS namespaces (its host
  name is `sandbox`, not this machine's).
- user: an unprivileged uid with no capabilities and no_new_privs.
- kernel: a syscall filter (rft/rollout/environments/seccomp.py) refuses what no namespace here separates or counts:
  sockets (their buffers), namespaces of its own (a tmpfs there), SysV shared memory and message
  queues, the keyrings (the caller's session keyring among them), io_uring (sockets past the rule),
  memfd_secret (memory no count sees), BPF, AIO contexts, perf events, userfaultfd.
- time, memory, output: the caller reads stdout and stderr in chunks while the code runs, keeps at
  most `max_output_bytes` of each, and kills the sandbox at `timeout_s`, when the output passes
  `output_limit_bytes`, or when the resident memory of all its processes together passes
  `memory_mb` (summed from /proc every POLL_S); RLIMIT_AS caps each process as well. The caller
  never waits on the code past the timeout plus a few GRACE_S.

Why an unprivileged uid, and which. RLIMIT_NPROC counts the processes of a real uid; root is
exempt from it, and a user namespace created by root maps the sandbox's uid back to root. So when
the caller is root, bwrap itself runs as root without a user namespace (it can then bind an
interpreter under /root) and the code runs under `setpriv` as a fresh random uid in
[2**30, 2**31): RLIMIT_NPROC then counts this sandbox's processes only. A caller that is not root
runs bwrap in a user namespace (uid 65534 inside, user namespaces disabled below it); the kernel
counts RLIMIT_NPROC per user namespace there (Linux 5.14 or newer).

Why memory is summed from /proc rather than a cgroup: cgroups differ between machines (v1 or v2,
delegated or not, writable only by root); /proc works for every caller. The sum counts each
process's resident pages and the memfds it holds open (SysV shared memory, which no process's
count holds once unmapped, is refused by the filter), and KERNEL_BYTES for each mapping of a process and
each inode of its tmpfs (empty files and one-page mappings are kernel memory that neither a
resident count nor a tmpfs's size sees: 343000 empty files held ~420 MiB); an allocation faster
than POLL_S is caught late.

The audit hook (PEP 578) refuses, with a readable reason, what a model does by mistake:
subprocesses, signals, ctypes, sockets, writes outside its directory. It is a guard against
accidents, not a wall: its state lives in a closure that no module, global or frame the code can
reach holds (the code runs in a fresh `__main__`; gc introspection is refused), but a fresh
interpreter started through `_posixsubprocess` (which raises no audit event) runs without it, and
native code or an interpreter bug gets past it.

Where bwrap is missing or cannot create namespaces, `run_python` refuses (ConfigError) unless the
caller allows unisolated runs (`workflow_args.env_args.allow_unisolated: true` for the python
environment): then the code runs as a plain child process with every rlimit, the hook, the
output cap and the timeout (its process group and descendants killed), and can read what the
caller can read.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import select
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache

from rft.errors import ConfigError
from rft.rollout.environments import seccomp

FILE_BYTES = 16 << 20  # RLIMIT_FSIZE: the largest file the code may write
TMPFS_BYTES = 64 << 20  # /work and /tmp, each
OPEN_FILES = 64  # RLIMIT_NOFILE
POLL_S = 0.05  # how often the sandbox's memory is summed
GRACE_S = 2.0  # after a kill: how long its pipes may take to close
CHUNK = 1 << 16
# kernel memory charged for each mapping of a sandbox's process and each inode of its tmpfs, which
# no resident count holds: measured 1.3 KiB of slab for a one-page shared anonymous mapping (its
# vm_area_struct and a shmem inode, file and dentry) and 1.25 KiB for an empty file with a 200-byte
# name; a plain Python process has ~100 mappings (150 KiB)
KERNEL_BYTES = 1536

# the first refusal, written on the child's stderr after this marker (and parsed out of it)
_MARK = "@@rft-sandbox-refused:"

_BWRAP = "bwrap"  # tests point it elsewhere to see a machine without it
_guard = True  # tests turn the audit hook off to check that each wall holds on its own

# runs in the child before the user's code: limits, the audit hook (unreachable afterwards), the code
_BOOTSTRAP = r'''
import os, resource, sys, types

def start(mem, cpu, nproc, fsize, nofile, code_fd, root, mark, guard):
    with open(int(code_fd), "rb") as f:
        code = f.read()
    for which, n in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_FSIZE, fsize),
                     (resource.RLIMIT_NOFILE, nofile), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(which, (int(n), int(n)))
    resource.setrlimit(resource.RLIMIT_CPU, (int(cpu), int(cpu) + 1))
    if guard == "1":
        sys.addaudithook(make_hook(os.path.realpath(root), mark))
    return code

def make_hook(root, mark):
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
    sub, sig, native = "(no subprocesses)", "(signals to other processes)", "ctypes (native code)"
    deny = {"os.system": "os.system " + sub, "subprocess.Popen": "subprocess.Popen " + sub, "os.fork": "os.fork " + sub,
            "os.forkpty": "os.fork " + sub, "os.posix_spawn": "os.posix_spawn " + sub, "os.spawn": "os.spawn " + sub,
            "os.exec": "os.exec " + sub, "os.kill": "os.kill " + sig, "os.killpg": "os.killpg " + sig,
            "signal.pthread_kill": "signal.pthread_kill " + sig, "ctypes.dlopen": native, "ctypes.dlsym": native,
            "ctypes.cdata": native, "ctypes.call_function": native,
            "gc.get_objects": "gc introspection", "gc.get_referrers": "gc introspection",
            "gc.get_referents": "gc introspection"}
    writes = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link", "os.symlink",
              "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move", "sqlite3.connect"}
    def hook(event, args):
        if event.startswith("socket."):
            refuse("network access (" + event + ")")
        if event in deny:
            refuse(deny[event])
        if event == "open" and len(args) >= 3:
            path, mode, flags = args[0], args[1], args[2]
            writing = ((mode is not None and any(c in str(mode) for c in "wax+"))
                       or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND))
            if writing and path is not None and not inside(path):
                refuse("writing outside the sandbox directory: " + str(path))
        if event in writes:
            for p in args[:2]:
                if isinstance(p, (str, bytes, os.PathLike)) and not inside(p) and p != ":memory:":
                    refuse(event + " outside the sandbox directory: " + os.fsdecode(p))
    return hook

code = start(*sys.argv[1:])
del start, make_hook
sys.argv = ["main.py"]
sys.modules["__main__"] = main = types.ModuleType("__main__")
exec(compile(code, "main.py", "exec"), main.__dict__)
'''


@dataclass
class SandboxResult:
    ok: bool  # ran to the end with exit status 0
    stdout: str
    stderr: str
    reason: str | None  # None when ok: else one sentence a model (and a person) can read
    returncode: int | None
    seconds: float


def _missing(why: str) -> str:
    return (f"The python environment runs model-written code only inside an isolated sandbox, and this "
            f"machine cannot make one: {why}. Install bubblewrap (as root: `apt-get install bubblewrap`, "
            f"which `make test` does); where bwrap is installed but cannot create namespaces as a user that "
            f"is not root, allow unprivileged user namespaces (`sysctl kernel.unprivileged_userns_clone=1`, "
            f"or on Ubuntu `sysctl kernel.apparmor_restrict_unprivileged_userns=0`). On a trusted machine "
            f"only, `workflow_args.env_args.allow_unisolated: true` on the python environment runs the code "
            f"without isolation (resource limits and the audit hook only: it can read what this process reads).")


@lru_cache(maxsize=None)
def isolation(bwrap: str) -> tuple[str | None, str]:
    """("root" or "user", "") when `bwrap` can make the sandbox here, else (None, why not); tried once."""
    exe = shutil.which(bwrap)
    if exe is None:
        return None, f"bubblewrap ({bwrap}) is not installed"
    mode = "root" if os.geteuid() == 0 else "user"
    if mode == "root" and shutil.which("setpriv") is None:
        return None, "setpriv (util-linux) is not installed"
    try:
        fd = _filter_fd()
    except ValueError as e:
        return None, str(e)
    # with run_python's --info-fd: a bwrap without it passed here, and every call then failed
    # 'exited with status 1: bwrap: Unknown option --info-fd' (model code never run, scored as wrong)
    info_r, info_w = os.pipe()
    try:
        args = _bwrap_args(exe, mode, str(1 << 30), fd)
        args[1:1] = ["--info-fd", str(info_w)]
        p = subprocess.run(args + [sys._base_executable, "-I", "-S", "-c", "pass"],
                           capture_output=True, text=True, timeout=30, pass_fds=(fd, info_w))
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{exe} did not run ({e})"
    finally:
        os.close(fd), os.close(info_w), os.close(info_r)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1]
        return None, f"{exe} failed: {last}"
    return mode, ""


def check(allow_unisolated: bool = False) -> str | None:
    """The sandbox's mode ("root", "user"), or None for an allowed unisolated run; raises
    ConfigError (one paragraph: what is missing, how to get it, the opt-out key) otherwise."""
    if not sys.platform.startswith("linux"):
        # even unisolated, the walls need Linux: stdin is a sealed memfd, memory is summed from /proc
        raise ConfigError(
            f"The python environment runs model-written code in a sandbox made of Linux namespaces "
            f"(bubblewrap), a sealed memfd and /proc, which this platform ({sys.platform}) does not have, "
            f"not even for `workflow_args.env_args.allow_unisolated: true`. Run tasks with the python tool "
            f"on a Linux machine (or a Linux VM or container); every other task runs here.")
    mode, why = isolation(_BWRAP)
    if mode is None and not allow_unisolated:
        raise ConfigError(_missing(why))
    return mode


def _filter_fd() -> int:
    """A pipe's read end holding the syscall filter (rft/rollout/environments/seccomp.py), for bwrap's --seccomp (compiled
    anew each call: 0.13 ms); ValueError where libseccomp cannot build it."""
    program = seccomp.program()
    r, w = os.pipe()
    os.write(w, program)  # a few hundred bytes: within a pipe's buffer
    os.close(w)
    return r


def _bwrap_args(exe: str, mode: str, uid: str, filter_fd: int) -> list[str]:
    """bwrap's command line up to the command (module docstring: root mode runs it under `setpriv`)."""
    a = [exe, "--seccomp", str(filter_fd), "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
         "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv",
         "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8", "--setenv", "HOME", "/work",
         "--ro-bind", "/usr", "/usr"]
    if mode == "user":
        a[1:1] = ["--unshare-user", "--disable-userns", "--uid", "65534", "--gid", "65534"]
    for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):  # merged-/usr symlinks, or real directories
        if os.path.islink(d):
            a += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            a += ["--ro-bind", d, d]
    for prefix in sorted({os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)}):
        if prefix != "/usr" and not prefix.startswith("/usr/"):
            # bwrap copies the modes of the parents it creates (/root: 0700); the uid must pass them
            parents = [p for p in _parents(prefix) if p != "/"]
            a += [x for p in parents for x in ("--perms", "0755", "--dir", p)] + ["--ro-bind", prefix, prefix]
    # /dev read-only: in user mode bwrap's /dev tmpfs (no size limit) would be the code's to fill
    # and its /dev/ptmx read-only /dev/null: the machine's ptys are few (kernel.pty.max), and one
    # sandbox's processes took 1891 of the 3072 that every container shares
    a += ["--proc", "/proc", "--dev", "/dev", "--ro-bind", "/dev/null", "/dev/pts/ptmx", "--remount-ro", "/dev"]
    for d in ("/tmp", "/work"):
        a += ["--size", str(TMPFS_BYTES), "--perms", "1777", "--tmpfs", d]
    a += ["--chdir", "/work"]
    if mode == "root":
        a += [shutil.which("setpriv"), "--reuid", uid, "--regid", uid, "--clear-groups", "--inh-caps=-all",
              "--bounding-set=-all", "--"]
    return a


def _parents(path: str) -> list[str]:
    out = []
    while path != os.path.dirname(path):
        path = os.path.dirname(path)
        out.append(path)
    return out[::-1]


def _processes(root: int) -> list[int]:
    """`root` and its descendants now (from /proc: a pid namespace's processes all descend from its bwrap)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rindex(b")") + 2 :].split()[1]), []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _memory(pids: list[int], isolated: bool) -> int:
    """Resident bytes of these processes, plus the memfds and secret memory files they hold open
    (not resident until mapped, or once unmapped), plus KERNEL_BYTES for each of their mappings and
    each inode of the sandbox's tmpfs (kernel memory that neither a resident count nor a tmpfs's
    size holds)."""
    total, seen = 0, set()
    if isolated:
        total += _tmpfs_inodes(pids[1:]) * KERNEL_BYTES
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm", "rb") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            with open(f"/proc/{pid}/maps", "rb") as f:  # a line a mapping
                total += sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(CHUNK), b"")) * KERNEL_BYTES
            for fd in os.listdir(f"/proc/{pid}/fd"):
                # memfd_secret's files read "/secretmem (deleted)" and report no blocks, so their
                # size counts (the filter refuses them; an unisolated run has no filter)
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith(("/memfd:", "/secretmem")):
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                    if (st.st_dev, st.st_ino) not in seen:
                        seen.add((st.st_dev, st.st_ino))
                        total += st.st_size if link.startswith("/secretmem") else st.st_blocks * 512
        except OSError:  # it ended meanwhile
            continue
    return total


def _tmpfs_inodes(pids: list[int]) -> int:
    """Inodes in use on the sandbox's /tmp and /work, seen through the root of one of its processes
    (bwrap's own is this machine's): each is a shmem inode and a dentry whatever its size (an
    empty file, a directory, a link)."""
    for pid in pids:
        try:
            used = 0
            for d in ("/tmp", "/work"):
                st = os.statvfs(f"/proc/{pid}/root{d}")
                if st.f_blocks * st.f_frsize != TMPFS_BYTES:
                    return 0  # not the sandbox's tmpfs: bwrap has not yet moved into its root (this machine's /tmp)
                used += st.f_files - st.f_ffree
            return used
        except OSError:  # it ended meanwhile
            continue
    return 0


def _readable(fd: int, timeout_s: float) -> bool:
    """Whether `fd` becomes readable (or its other end closes) within `timeout_s`. poll, not
    select.select: a caller holding over 1024 descriptors (vLLM and Ray raise RLIMIT_NOFILE) gets
    numbers select.select refuses (ValueError), and bwrap, its info pipe closed unread, died of
    SIGPIPE: calls ended 'timed out' with the code never run."""
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    return bool(poll.poll(max(0, int(timeout_s * 1000))))


def _namespace_init(info_r: int, bwrap: int, timeout_s: float) -> int | None:
    """A pidfd of the sandbox's pid 1 (its "child-pid" on bwrap's --info-fd, which this closes), or
    None where it has ended already. bwrap exits as soon as the code does, and its pid 1, no
    longer a descendant of this process, ends a moment later (bwrap's --die-with-parent) with its
    namespace: a daemon the code left outlived the call by up to 30 ms (5 calls of 60) unless the
    call waits for that pid 1."""
    info, until = b"", time.monotonic() + timeout_s + GRACE_S
    try:
        # bwrap writes it in pieces and closes it; never waited on past the code's own time
        while _readable(info_r, until - time.monotonic()):
            chunk = os.read(info_r, CHUNK)
            if not chunk:
                break
            info += chunk
        pid = int(json.loads(info)["child-pid"])
        fd = os.pidfd_open(pid)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    finally:
        os.close(info_r)
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        signal.pidfd_send_signal(fd, 0)  # still alive: so the stat read was its own, not a reused pid's
        if ppid == bwrap:
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _end_namespace(init: int | None) -> None:
    """Kills the sandbox's pid 1 and waits (GRACE_S at most) until it has ended: the kernel ends a
    pid namespace's init only after every other process of it."""
    if init is None:
        return
    try:
        signal.pidfd_send_signal(init, signal.SIGKILL)
        _readable(init, GRACE_S)  # readable once it has exited
    except OSError:  # ended already
        pass
    finally:
        os.close(init)


def _running(p: subprocess.Popen) -> bool:
    """Whether the child still runs; an ended child is left unreaped (WNOWAIT), so its pid and
    process group cannot be reused by another process before `_kill` is done with them."""
    try:
        return os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:
        return False


def _kill(p: subprocess.Popen, isolated: bool) -> None:
    """Ends every process of the sandbox, whatever they did: its descendants first (bwrap's pid 1
    among them: the kernel then kills the rest of its pid namespace, and bwrap reaps it, so no
    zombie is left to this machine's init), then bwrap itself, or an unisolated run's child."""
    for pid in _processes(p.pid)[1:]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    until = time.monotonic() + GRACE_S
    while isolated and _running(p) and time.monotonic() < until:
        time.sleep(0.005)
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.kill(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _watch(p: subprocess.Popen, isolated: bool, timeout_s: float, memory: int, keep: int, limit: int):
    """Reads the child's stdout and stderr until it has ended, or kills it at a wall; returns
    ({fd: bytes kept}, {fd: bytes read}, the wall that killed it or None)."""
    kept = {p.stdout.fileno(): bytearray(), p.stderr.fileno(): bytearray()}
    read = dict.fromkeys(kept, 0)
    wall, next_poll = None, 0.0
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        for fd in kept:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map() or _running(p):
            now = time.monotonic()
            if now >= deadline:
                if wall is not None:
                    break  # killed, yet a pipe is still open: never wait longer
                wall, deadline = "time", now + GRACE_S
                _kill(p, isolated)
            for key, _ in sel.select(max(0.0, min(POLL_S, deadline - now))):
                chunk = os.read(key.fd, CHUNK)
                if not chunk:
                    sel.unregister(key.fd)
                read[key.fd] += len(chunk)
                kept[key.fd] += chunk[: max(0, keep - len(kept[key.fd]))]
            if wall is None and sum(read.values()) > limit:
                wall, deadline = "output", time.monotonic() + GRACE_S
                _kill(p, isolated)
            if wall is None and time.monotonic() >= next_poll:
                next_poll = time.monotonic() + POLL_S
                if _memory(_processes(p.pid), isolated) > memory:
                    wall, deadline = "memory", time.monotonic() + GRACE_S
                    _kill(p, isolated)
    return kept, read, wall


def _text(data: bytes, total: int) -> str:
    text = data.decode(errors="replace")
    return text if total <= len(data) else text + f"\n... [cut: {total - len(data)} more bytes]"


def _reason(wall, rc, err: str, refused, timeout_s, memory_mb, limit, isolated) -> str | None:
    last = (err.strip().splitlines() or [""])[-1]
    sig = -rc if rc is not None and rc < 0 else (rc - 128 if isolated and rc is not None and rc > 128 else None)
    if wall == "time":
        return f"timed out after {timeout_s:g} s (killed)"
    if wall == "memory" or "MemoryError" in last:
        return f"memory limit of {memory_mb} MiB exceeded" + (" (all its processes together; killed)" if wall else "")
    if wall == "output":
        return f"output limit of {limit} bytes exceeded (killed)"
    if refused is not None:
        return f"refused: {refused}"
    if sig == signal.SIGXCPU:
        return f"CPU time limit of {max(1, int(timeout_s) + 1)} s exceeded (killed)"
    if sig is not None:
        return f"killed by signal {sig} ({signal.strsignal(sig)})"
    if rc != 0:
        return f"exited with status {rc}" + (f": {last}" if last else "")
    return None


def _sealed(data: bytes):
    """`data` in a sealed memfd, opened read-only: the code's stdin. A file on the caller's disk
    could be opened again for writing through /proc/self/fd/0 by its owner, whose uid the code has
    in user mode (it wrote 16 MiB there); a sealed memfd no one can write, and it is on no disk."""
    fd = os.memfd_create("rft-sandbox-stdin", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        with open(fd, "wb", closefd=False) as f:
            f.write(data)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
        return open(f"/proc/self/fd/{fd}", "rb")
    finally:
        os.close(fd)


def run_python(code: str, timeout_s: float = 5.0, memory_mb: int = 512, max_output_bytes: int = 4000,
               stdin: str = "", max_processes: int = 32, output_limit_bytes: int = 1 << 20,
               allow_unisolated: bool = False) -> SandboxResult:
    """Run `code` in the sandbox (module docstring); never raises for what the code does. Raises
    ConfigError where no sandbox can be made and `allow_unisolated` is false."""
    mode = check(allow_unisolated)
    t0 = time.monotonic()
    # a lone surrogate (JSON allows "\ud800") becomes a SyntaxError of the code, not an error here
    with tempfile.TemporaryFile() as src, _sealed(stdin.encode(errors="surrogatepass")) as stdin_ro, \
            tempfile.TemporaryDirectory(prefix="rft-sandbox-") as work:
        src.write(code.encode(errors="surrogatepass"))
        src.seek(0)
        # one slot more in user mode: bwrap's pid 1 is in the user namespace whose processes count
        nproc = max_processes + (mode == "user")
        boot = [sys._base_executable, "-I", "-S", "-c", _BOOTSTRAP, str(memory_mb << 20), str(max(1, int(timeout_s) + 1)),
                str(nproc), str(FILE_BYTES), str(OPEN_FILES), str(src.fileno()), "/work" if mode else work, _MARK,
                "1" if _guard else "0"]
        uid = str((1 << 30) + secrets.randbelow((1 << 30) - 1))
        filter_fd, (info_r, info_w) = (_filter_fd(), os.pipe()) if mode else (-1, (-1, -1))
        cmd = _bwrap_args(shutil.which(_BWRAP), mode, uid, filter_fd) + boot if mode else boot
        cmd[1:1] = ["--info-fd", str(info_w)] if mode else []
        try:
            p = subprocess.Popen(cmd, cwd=work, stdin=stdin_ro, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 pass_fds=(src.fileno(),) + ((filter_fd, info_w) if mode else ()), start_new_session=True,
                                 env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": work})
        except BaseException:  # no fork (EAGAIN, ENOMEM): the info pipe's read end is left to no one
            if mode:
                os.close(info_r)
            raise
        finally:
            if mode:
                os.close(filter_fd), os.close(info_w)
        init = _namespace_init(info_r, p.pid, timeout_s) if mode else None
        fds = p.stdout.fileno(), p.stderr.fileno()
        try:
            kept, read, wall = _watch(p, mode is not None, timeout_s, memory_mb << 20, max_output_bytes, output_limit_bytes)
        finally:
            _kill(p, mode is not None)  # what an unisolated run left behind in its group; then reap it
            _end_namespace(init)
            try:
                p.wait(GRACE_S)
            except subprocess.TimeoutExpired:
                pass
            p.stdout.close(), p.stderr.close()
    (out, n_out), (err, n_err) = [(kept[fd], read[fd]) for fd in fds]
    err_text, refused = _text(err, n_err), None
    lines = err_text.split("\n")
    # the hook writes its line at the start of one; the code may write the marker anywhere
    refused = next((ln[len(_MARK):] for ln in lines if ln.startswith(_MARK)), None)
    if refused is not None:
        err_text = "\n".join(ln for ln in lines if not ln.startswith(_MARK))
    reason = _reason(wall, p.returncode, err_text, refused, timeout_s, memory_mb, output_limit_bytes, mode is not None)
    return SandboxResult(reason is None, _text(out, n_out), err_text, reason, p.returncode, time.monotonic() - t0)
