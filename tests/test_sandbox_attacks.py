"""Attacks on the sandbox (rft/rollout/environments/sandbox.py) beyond tests/test_sandbox.py, written as a
model would write them, past the audit hook (the `no_guard` fixture): each must fail, and say so.

Isolation needs bubblewrap: without it these tests skip, unless RFT_REQUIRE_SANDBOX=1 (CI).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
from test_sandbox import isolated, no_bwrap, no_guard, unguarded  # noqa: F401 (fixtures: bubblewrap or skip; none; past the hook)

from rft.rollout.environments import sandbox


# 30 socketpairs, each sender's buffer raised to the kernel's most (net.core.wmem_max) and filled:
# kernel memory that no process's resident count holds
SOCKET_BUFFERS = r"""
import socket
total = 0
for _ in range(30):
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 30)
    a.setblocking(False)
    try:
        while True:
            total += a.send(b"x" * 65536)
    except BlockingIOError:
        pass
print("queued MiB", total >> 20)
"""


def test_socket_buffers_cannot_hold_memory_past_the_limit(no_guard):
    # before: a sandbox of 128 MiB queued 235 MiB in one process (net.core.wmem_max 4 MiB: 8 MiB a
    # pair) and ran to the end; 4 processes took 1.1 GB off MemAvailable, and max_processes=32 would
    # take ~7.5 GB. No socket is needed inside (the hook refuses them; the network is its own loopback)
    r = sandbox.run_python(SOCKET_BUFFERS, memory_mb=128, timeout_s=10)
    assert r.stdout == ""
    assert r.reason == "exited with status 1: PermissionError: [Errno 1] Operation not permitted"


def test_a_tcp_server_on_its_own_loopback_is_refused_too(no_guard):
    # TCP buffers (net.ipv4.tcp_wmem: 4 MiB a socket) are the same memory, through its loopback
    r = sandbox.run_python("import socket\ns = socket.create_server(('127.0.0.1', 0))\nprint('listening')",
                           timeout_s=10)
    assert r.stdout == ""
    assert r.reason == "exited with status 1: PermissionError: [Errno 1] Operation not permitted"


# io_uring's IORING_OP_SOCKET (Linux 5.19) makes a socket without the socket syscall the filter refuses:
# the socket buffers above, through a ring. Setting one up is the step the filter can see
IO_URING = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
params = ctypes.create_string_buffer(120)  # struct io_uring_params
fd = libc.syscall(425, 4, params)  # io_uring_setup(4 entries); 425 on every architecture
print("io_uring_setup", fd, os.strerror(ctypes.get_errno()) if fd < 0 else "")
"""


def test_io_uring_cannot_be_set_up_so_it_cannot_open_sockets_past_the_filter(no_guard):
    # before: io_uring_setup returned fd 3 inside the sandbox (kernel.io_uring_disabled 0 here)
    r = sandbox.run_python(IO_URING, timeout_s=10)
    assert r.stdout == "io_uring_setup -1 Operation not permitted\n"
    assert r.ok


# memfd_secret (Linux 5.14): pages that leave no process's resident count once unmapped, and whose
# descriptor reads "/secretmem (deleted)", not "/memfd:...", so the count of memfds misses them too.
# Each mapping is charged to RLIMIT_MEMLOCK (8 MiB) only while mapped: 5 MiB at a time fills a file
SECRET_MEMORY = r"""
import ctypes, mmap, os
libc = ctypes.CDLL(None, use_errno=True)
held = 0
for _ in range(20):
    fd = libc.syscall(447, 0)  # memfd_secret(0); 447 on x86_64 and arm64 alike
    if fd < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    os.ftruncate(fd, 15 << 20)  # under RLIMIT_FSIZE (16 MiB)
    for i in range(3):
        m = mmap.mmap(fd, 5 << 20, offset=i * (5 << 20))
        for j in range(0, 5 << 20, 4096):
            m[j] = 1
        m.close()
        held += 5
print("secret MiB held", held)
"""


def test_secret_memory_cannot_hold_memory_past_the_limit(no_guard):
    # before: a sandbox of 128 MiB held 300 MiB (20 files x 15 MiB) at a resident size of ~10 MiB and
    # ran to the end; 64 descriptors x 16 MiB would be 1 GiB a process, 32 GiB for 32 processes
    r = sandbox.run_python(SECRET_MEMORY, memory_mb=128, timeout_s=10)
    assert r.stdout == ""
    assert r.reason == "exited with status 1: PermissionError: [Errno 1] Operation not permitted"


def test_secret_memory_counts_in_an_unisolated_run(no_bwrap, no_guard):
    # no filter there (allow_unisolated: true): the memory count must see secret memory's files itself.
    # before: 300 MiB held past memory_mb=128 and the run ended "ok" after its 2 s sleep
    r = sandbox.run_python(SECRET_MEMORY + "import time\ntime.sleep(2)\n", memory_mb=128, timeout_s=10,
                           allow_unisolated=True)
    assert r.reason == "memory limit of 128 MiB exceeded (all its processes together; killed)"


# the filter loaded by hand (prctl, as bwrap's --seccomp does), then bpf(BPF_MAP_CREATE) of an array
# map of 1 entry of 64 KiB; x86_64's bpf is call 321, BPF_MAP_TYPE_ARRAY is 2
BPF_MAP = r"""
import ctypes, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
prog = sys.stdin.buffer.read()
buf = ctypes.create_string_buffer(prog, len(prog))
fprog = struct.pack("HxxxxxxQ", len(prog) // 8, ctypes.addressof(buf))
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
assert libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
attr = ctypes.create_string_buffer(struct.pack("IIII", 2, 4, 65536, 1), 128)
print(libc.syscall(321, 0, attr, 128), ctypes.get_errno())
"""


@pytest.mark.skipif(os.geteuid() != 0 or platform.machine() != "x86_64",
                    reason="root (whom the kernel lets make BPF maps whatever the sysctl) on x86_64")
def test_bpf_maps_are_refused_by_the_filter():
    # where kernel.unprivileged_bpf_disabled is 0 any uid makes BPF maps: kernel memory no process's
    # count holds. The filter alone must refuse them: run as root so the kernel itself would not.
    # before: "3 0" (a map's fd); now bpf fails with EPERM (errno 1)
    from rft.rollout.environments import seccomp

    r = subprocess.run([sys.executable, "-c", BPF_MAP], input=seccomp.program(), capture_output=True, timeout=60)
    assert r.stdout.decode() == "-1 1\n", r.stderr.decode()


# io_setup(65536 events): the kernel bounds AIO contexts by fs.aio-max-nr (65536) for the whole machine
AIO_CONTEXT = r"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
ctx = ctypes.c_ulong(0)
print(libc.syscall(206, 65536, ctypes.byref(ctx)), ctypes.get_errno())
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="io_setup is call 206 on x86_64")
def test_aio_contexts_are_refused(no_guard):
    # before: "0 0": one call took all of fs.aio-max-nr (65536 events), and every other process of the
    # machine (libaio in the trainer) got EAGAIN from io_setup while it ran; now EPERM (errno 1)
    r = sandbox.run_python(AIO_CONTEXT, memory_mb=128, timeout_s=10)
    assert r.stdout == "-1 1\n"


# empty files in its 64 MiB /tmp: the tmpfs's size counts their data, not their inodes and names,
# which are kernel memory (a shmem inode, a dentry, a name past 32 bytes) no process's count holds
EMPTY_FILES = r"""
import os, time
for n in range(150000):
    os.close(os.open(f"/tmp/{n:0200d}", os.O_CREAT | os.O_WRONLY))
print("files", n + 1, flush=True)
time.sleep(3)
"""


def test_empty_files_in_its_tmpfs_count_against_the_memory_limit(no_guard):
    # before: one process made 343000 such files in 2.5 s: ~420 MiB of slab (shmem_inode_cache 246,
    # kmalloc-rcl-256 84, dentry 57: ~1.25 KiB a file) in a sandbox of 512 MiB whose tmpfs read
    # "0 bytes used", and ran to the end. Here 150000 files x 1.25 KiB = ~183 MiB, past 128 MiB
    r = sandbox.run_python(EMPTY_FILES, memory_mb=128, timeout_s=20)
    assert r.reason == "memory limit of 128 MiB exceeded (all its processes together; killed)"


# mappings of one page each, shared and anonymous, so none merges with the next: each is a
# vm_area_struct plus a shmem inode, file and dentry (~1.3 KiB of slab), no resident page at all
MANY_MAPPINGS = r"""
import mmap, os, time
for _ in range(4):
    if os.fork() == 0:
        maps = [mmap.mmap(-1, 4096) for _ in range(40000)]
        print("maps", len(maps), flush=True)
        time.sleep(5)
        os._exit(0)
time.sleep(5)
"""


@pytest.mark.slow  # 1.3 s alone, over the fast tier's second
def test_many_mappings_count_against_the_memory_limit(no_guard):
    # before: 65477 mappings held 82 MiB of slab (vm_area_struct 12, shmem_inode_cache 47, filp 12,
    # dentry 6) at ~15 MiB resident; RLIMIT_AS (memory_mb) allows 65530 (vm.max_map_count) a process,
    # so 32 processes held ~2.6 GB. Here 4 x 40000 mappings (156 MiB of address space each, under
    # RLIMIT_AS) x ~1.3 KiB = ~200 MiB past 4 x ~12 MiB resident, in a sandbox of 256 MiB that ended
    # "ok" after its 5 s sleep
    r = sandbox.run_python(MANY_MAPPINGS, memory_mb=256, timeout_s=20)
    assert r.reason == "memory limit of 256 MiB exceeded (all its processes together; killed)"


def test_the_inode_count_never_charges_this_machines_own_tmp():
    # before bwrap has moved into the sandbox's root, its processes' root is this machine's: a /tmp
    # and /work on a disk with 1.5 million inodes in use (without the check: 1502236 here) would
    # charge 2.2 GB and kill a sandbox of 512 MiB at its first poll. This process's root is such a
    # root: nothing counts
    assert os.statvfs("/tmp").f_blocks * os.statvfs("/tmp").f_frsize != sandbox.TMPFS_BYTES
    assert sandbox._tmpfs_inodes([os.getpid()]) == 0


# perf_event_open of a software clock on itself, user space only (what perf_event_paranoid 2 allows
# any uid), and userfaultfd in user mode only (what vm.unprivileged_userfaultfd 0 allows)
PERF_AND_USERFAULTFD = r"""
import ctypes, platform, struct
libc = ctypes.CDLL(None, use_errno=True)
perf_event_open, userfaultfd = {"x86_64": (298, 323), "aarch64": (241, 282)}[platform.machine()]
attr = ctypes.create_string_buffer(struct.pack("IIQQQQQ", 1, 64, 0, 0, 0, 0, (1 << 5) | (1 << 6)) + bytes(16), 64)
print("perf_event_open", libc.syscall(perf_event_open, attr, 0, -1, -1, 0), ctypes.get_errno(), flush=True)
print("userfaultfd", libc.syscall(userfaultfd, 1), ctypes.get_errno(), flush=True)
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="the calls' numbers on x86_64 and aarch64")
def test_perf_events_and_userfaultfd_are_refused(no_guard):
    # before: "perf_event_open 3 0" and "userfaultfd 4 0" (descriptors). Where perf_event_paranoid is
    # 0 or less, perf events on a whole CPU count every process that runs there (the explorer's, the
    # trainer's); userfaultfd stalls page faults at the code's choosing, the kernel-race tool of many
    # exploits. No code here needs either; both now fail with EPERM (errno 1)
    r = sandbox.run_python(unguarded(PERF_AND_USERFAULTFD), memory_mb=128, timeout_s=10)
    assert r.stdout == "perf_event_open -1 1\nuserfaultfd -1 1\n", r.stderr


# pseudo-terminals from its /dev/ptmx: the kernel bounds them for the whole machine (kernel.pty.max
# 4096, of which every devpts but the machine's first shares 4096 - kernel.pty.reserve = 3072)
PTYS = r"""
import os
n, error = 0, None
try:
    for _ in range(60):
        os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY)
        n += 1
    os.openpty()
except OSError as e:
    error = type(e).__name__
print(n, error)
"""


def test_it_cannot_take_the_machines_pseudo_terminals(no_guard):
    # before: "60 OSError" (60 ptys opened), and 31 processes opening ptys until RLIMIT_NOFILE held 1891
    # (/proc/sys/kernel/pty/nr): two sandboxes at once take all 3072 that containers (and other
    # sandboxes) share, whose terminals then fail to open. No code here needs one
    r = sandbox.run_python(PTYS, timeout_s=10)
    assert r.stdout == "0 PermissionError\n"


# a daemon as a model would write one: setsid, fork again, close its descriptors, burn CPU; the call
# itself returns at once
DAEMON = r"""
import os, sys
r, w = os.pipe()  # close-on-exec: its read ends once the daemon runs
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        for fd in (0, 1, 2):
            os.close(fd)
        os.execv(sys.executable, [sys.executable, "-c", "while True: pass", sys.argv[0] + MARKER])
    os._exit(0)
os.close(w)
os.read(r, 1)
print("returned")
"""


@pytest.mark.parametrize("unisolated", [False, True])
def test_a_daemon_does_not_outlive_a_call_that_returned(no_guard, unisolated, monkeypatch):
    # the kernel ends a pid namespace's processes with its pid 1 (bwrap's), which ends after the code.
    # before: bwrap returned first, and its pid 1 ended a moment later: the daemon was still running
    # when the call had returned in 5 calls of 60 (for up to 30 ms), so 20 calls saw it ~4 times in 5.
    # Unisolated (allow_unisolated: true) a process in a session of its own outlives the call, as the
    # README says: the same test sees it there, so it would see it in the sandbox
    import uuid

    from test_sandbox import host_pids_with

    if unisolated:
        monkeypatch.setattr(sandbox, "_BWRAP", "rft-no-such-bwrap")
    markers = [f"rft-{uuid.uuid4().hex}" for _ in range(1 if unisolated else 20)]
    try:
        for marker in markers:
            r = sandbox.run_python(f"MARKER = {marker!r}\n" + DAEMON, timeout_s=10, allow_unisolated=unisolated)
            assert (r.ok, r.stdout) == (True, "returned\n")
            assert (host_pids_with(marker) != []) == unisolated
    finally:
        for pid in [pid for marker in markers for pid in host_pids_with(marker)]:
            os.kill(pid, 9)


SIGNALS = r"""
import os, signal, time
child = os.fork()
if child == 0:
    time.sleep(30)
for what, pid in (("parent", os.getppid()), ("pid 1", 1)):
    try:
        os.kill(pid, signal.SIGKILL)
        print(what, "killed")
    except OSError as e:
        print(what, e.strerror)
os.kill(-1, signal.SIGKILL)  # every process it may signal but itself
print("sibling", os.waitpid(child, 0)[1])
"""


def test_its_signals_reach_its_own_processes_only(no_guard):
    # its parent is bwrap's pid 1 (another uid, and a pid namespace's init ignores SIGKILL from
    # inside); kill(-1) reaches only its own child (status 9); this process and its group live on
    me = os.getpid()
    r = sandbox.run_python(SIGNALS, timeout_s=10)
    assert r.stdout == "parent Operation not permitted\npid 1 Operation not permitted\nsibling 9\n", r.stderr
    assert os.getpid() == me and os.getpgid(0) > 0


# code that would rather not end: SIGTERM and friends ignored, every signal blocked, and a child and
# itself blocked in a read of a pipe whose write end it holds open (no EOF ever)
STUBBORN = r"""
import os, signal
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGALRM, signal.SIGXCPU):
    signal.signal(s, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.valid_signals()))
r, w = os.pipe()
os.fork()
print("reading", flush=True)
os.read(r, 1)
"""


@pytest.mark.slow  # 2.0 s alone, over the fast tier's second
def test_code_that_ignores_signals_and_blocks_in_a_read_still_times_out(no_guard):
    # SIGKILL is neither blocked nor ignored, and a pipe read sleeps interruptibly: the tool call
    # answers the timeout's reason, and the caller never waits on the code
    from rft.rollout.environments.tools import ToolError, run_python

    r = sandbox.run_python(STUBBORN, timeout_s=1)
    assert (r.reason, r.stdout) == ("timed out after 1 s (killed)", "reading\nreading\n")
    assert r.seconds < 10  # 1 s and the kill; never the code's own time
    with pytest.raises(ToolError, match=r"^timed out after 1 s \(killed\)$"):
        run_python(STUBBORN, timeout_s=1)


# user extended attributes on files of its tmpfs (Linux 6.6 and newer): their values are kernel
# memory, outside the tmpfs's size, which the kernel counts in the tmpfs's inode space instead
XATTRS = r"""
import os, time
for i in range(3000):
    open(f"/tmp/{i}", "w").close()
    try:
        os.setxattr(f"/tmp/{i}", "user.x", b"x" * 60000)
    except OSError as e:
        print(e.strerror, flush=True)
        raise SystemExit
print("xattr MiB", 3000 * 60000 >> 20, flush=True)
time.sleep(3)
"""


def test_extended_attributes_in_its_tmpfs_count_against_the_memory_limit(no_guard):
    # before: "xattr MiB 171" in a sandbox of 128 MiB whose tmpfs read 0 bytes used, and ran to the end
    r = sandbox.run_python(XATTRS, memory_mb=128, timeout_s=20)
    if r.stdout.startswith("Operation not supported"):
        pytest.skip("this kernel's tmpfs has no user extended attributes (Linux 6.6 and newer)")
    assert r.reason == "memory limit of 128 MiB exceeded (all its processes together; killed)"


# address space past memory_mb without touching it: MAP_NORESERVE, a huge sparse mapping, a mapping
# grown by mremap; and /dev/shm, the tmpfs of POSIX shared memory
MAPPINGS_AND_SHM = r"""
import mmap
def attempt(what, f):
    try:
        f()
        print(what, "ok")
    except OSError as e:
        print(what, e.strerror)
attempt("noreserve", lambda: mmap.mmap(-1, 4 << 30, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000))
attempt("sparse", lambda: mmap.mmap(-1, 100 << 30))
m = mmap.mmap(-1, 64 << 20)
attempt("mremap", lambda: m.resize(2 << 30))
attempt("shm", lambda: open("/dev/shm/x", "wb"))
"""


def test_address_space_and_dev_shm_past_the_limit_are_refused(no_guard):
    # RLIMIT_AS (memory_mb) counts reserved address space, touched or not (ENOMEM); /dev is
    # read-only, its shm directory too (EROFS). Each held when tried; the test keeps them so
    r = sandbox.run_python(MAPPINGS_AND_SHM, memory_mb=128, timeout_s=10)
    assert r.stdout == ("noreserve Cannot allocate memory\nsparse Cannot allocate memory\n"
                        "mremap Cannot allocate memory\nshm Read-only file system\n"), r.stderr
