"""The sandbox's syscall filter (rft/rollout/environments/sandbox.py hands it to bwrap's --seccomp): a short deny list.

The sandbox's walls are namespaces, rlimits and a memory count from /proc. Ten things the kernel
offers every process pass all of them, and model-written code reaches each from pure Python (a
fresh interpreter started through `_posixsubprocess` has no audit hook, and has ctypes):

- user namespaces (when the caller is root, the code's uid may create one): inside, the code may
  mount a tmpfs of its own, whose pages no process's memory counts;
- SysV shared memory and message queues: a segment outlives every mapping of it, so it counts as
  no process's memory either;
- the kernel's keyrings, which no namespace separates: the code would possess the caller's session
  keyring (and read its keys) and could leave keys there for the next call;
- sockets, even on its own loopback: the data queued in a socket's buffers (up to net.core.wmem_max,
  4 MiB a socket here, doubled by the kernel) is kernel memory no process's count holds: 30
  socketpairs held 235 MiB in a sandbox of 128 MiB, 32 processes would hold ~7.5 GB. No code needs
  one there (the audit hook refuses sockets, and the network namespace has nothing to reach);
- io_uring: its IORING_OP_SOCKET (Linux 5.19) makes a socket without the socket call, so a ring
  would pass the rule above;
- memfd_secret: its pages leave every process's resident count once unmapped, and its files are no
  "/memfd:" the count finds (a sandbox of 128 MiB held 300 MiB in them);
- bpf: where kernel.unprivileged_bpf_disabled is 0 (the kernel's default), any uid may create BPF
  maps, kernel memory no process's count holds (one array map takes max_entries x value_size);
- AIO contexts (io_setup): the kernel bounds their events by fs.aio-max-nr for the whole machine
  (65536), and one call took them all: every other process's io_setup (libaio) failed while it ran;
- perf_event_open: where kernel.perf_event_paranoid is 0 or less, an event on a whole CPU counts
  every process that runs there (the explorer's, the trainer's), and its ring buffers are locked
  memory of the uid's; refused at every setting, as kernel surface no code here needs;
- userfaultfd: it stalls page faults at the code's choosing, the kernel-race tool of many exploits
  (user faults only where vm.unprivileged_userfaultfd is 0, yet still surface no code here needs).

So these calls fail with EPERM: socket, socketpair, unshare, setns, clone with a namespace flag,
the mount calls, shmget, msgget, add_key, request_key, keyctl, io_uring_setup/enter/register, memfd_secret, bpf, io_setup,
perf_event_open, userfaultfd. clone3, whose flags a filter cannot read, fails with
ENOSYS, on which the C library falls back to clone. The filter is compiled by libseccomp (through
pyseccomp), which knows each architecture's syscall numbers; calls of another ABI than the
machine's own (x32, or 32-bit code on a 64-bit kernel) fail with ENOSYS.
"""

from __future__ import annotations

import errno
import tempfile

DENIED = ("socket", "socketpair", "unshare", "setns", "mount", "umount2", "pivot_root", "open_tree", "move_mount",
          "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "shmget", "msgget", "add_key", "request_key", "keyctl",
          "io_uring_setup", "io_uring_enter", "io_uring_register", "memfd_secret", "bpf", "io_setup",
          "perf_event_open", "userfaultfd")
# CLONE_NEWTIME, NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET: clone with any of them is
# refused; fork and threads use clone without them
CLONE_NAMESPACES = (0x80, 0x20000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)


def program() -> bytes:
    """The filter as BPF (struct sock_filter[], as bwrap's --seccomp reads it); ValueError saying
    why where libseccomp is missing or does not know a call on this machine."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError) as e:  # pyseccomp loads libseccomp.so.2 when imported
        raise ValueError(f"libseccomp, which compiles the sandbox's syscall filter, does not load ({e}; "
                         f"`apt-get install libseccomp2`, `pip install pyseccomp`)") from None
    f = sc.SyscallFilter(sc.ALLOW)
    f.set_attr(sc.Attr.ACT_BADARCH, sc.ERRNO(errno.ENOSYS))
    try:
        for name in DENIED:
            f.add_rule(sc.ERRNO(errno.EPERM), name)
        for flag in CLONE_NAMESPACES:
            f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(_clone_flags_arg(), sc.MASKED_EQ, flag, flag))
        f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    except (OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"libseccomp cannot build the sandbox's syscall filter on this machine ({e})") from None
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        return out.read()


def _clone_flags_arg() -> int:
    """Which argument of clone holds its flags: the first, except on s390 (the second)."""
    import platform

    return 1 if platform.machine().startswith("s390") else 0
