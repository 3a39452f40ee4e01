"""The sandbox's syscall filter (rft/sandbox.py hands it to bwrap's --seccomp): a short deny list.

The sandbox's walls are namespaces, rlimits and a memory count from /proc. Three things the kernel
offers every process pass all of them, and model-written code reaches each from pure Python (a
fresh interpreter started through `_posixsubprocess` has no audit hook, and has ctypes):

- user namespaces (when the caller is root, the code's uid may create one): inside, the code may
  mount a tmpfs of its own, whose pages no process's memory counts;
- SysV shared memory and message queues: a segment outlives every mapping of it, so it counts as
  no process's memory either;
- the kernel's keyrings, which no namespace separates: the code would possess the caller's session
  keyring (and read its keys) and could leave keys there for the next call.

So these calls fail with EPERM: unshare, setns, clone with a namespace flag, the mount calls,
shmget, msgget, add_key, request_key, keyctl. clone3, whose flags a filter cannot read, fails with
ENOSYS, on which the C library falls back to clone. Calls of another ABI (x32, or 32-bit code on a
64-bit kernel) fail with ENOSYS: the numbers below are the native ABI's.
"""

from __future__ import annotations

import errno
import platform
import struct

# (AUDIT_ARCH, {name: number}) for the native ABI of each machine the filter is written for
_X86_64 = {"unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155, "shmget": 29,
           "msgget": 68, "add_key": 248, "request_key": 249, "keyctl": 250, "clone": 56}
_AARCH64 = {"unshare": 97, "setns": 268, "mount": 40, "umount2": 39, "pivot_root": 41, "shmget": 194,
            "msgget": 186, "add_key": 217, "request_key": 218, "keyctl": 219, "clone": 220}
# the same number on every architecture (the new mount API, clone3)
_COMMON = {"open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
           "mount_setattr": 442}
CLONE3 = 435
ARCHES = {"x86_64": (0xC000003E, _X86_64), "aarch64": (0xC00000B7, _AARCH64)}
X32_BIT = 0x40000000  # x86_64: a syscall number with this bit is the x32 ABI's
# CLONE_NEWTIME, NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
CLONE_NAMESPACES = 0x80 | 0x20000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000

_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, ..., BPF_RET|K
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
# offsets in struct seccomp_data: nr, arch, args[0] (its low 32 bits: little-endian machines only)
_NR, _ARCH, _ARG0 = 0, 4, 16


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def program(machine: str | None = None) -> bytes:
    """The filter for this machine (struct sock_filter[], as bwrap's --seccomp reads it); ValueError
    naming the machine where there is none."""
    machine = machine or platform.machine()
    if machine not in ARCHES:
        raise ValueError(f"no syscall filter is written for this machine's architecture ({machine}; "
                         f"there is one for {', '.join(ARCHES)})")
    arch, numbers = ARCHES[machine]
    eperm, enosys = _ERRNO | errno.EPERM, _ERRNO | errno.ENOSYS
    ops = [_op(_LD_ABS, _ARCH), _op(_JEQ, arch, jt=1), _op(_RET, enosys), _op(_LD_ABS, _NR)]
    if machine == "x86_64":
        ops += [_op(_JGE, X32_BIT, jf=1), _op(_RET, enosys)]
    denied = [(n, eperm) for name, n in {**numbers, **_COMMON}.items() if name != "clone"] + [(CLONE3, enosys)]
    for number, answer in denied:
        ops += [_op(_JEQ, number, jf=1), _op(_RET, answer)]
    # clone: refused only with a namespace flag (fork and threads use it without one)
    ops += [_op(_JEQ, numbers["clone"], jf=3), _op(_LD_ABS, _ARG0), _op(_JSET, CLONE_NAMESPACES, jf=1),
            _op(_RET, eperm), _op(_RET, _ALLOW)]
    return b"".join(ops)
