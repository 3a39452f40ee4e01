"""Attacks on the sandbox (rft/rollout/environments/sandbox.py) beyond tests/test_sandbox.py, written as a
model would write them, past the audit hook (the `no_guard` fixture): each must fail, and say so.

Isolation needs bubblewrap: without it these tests skip, unless RFT_REQUIRE_SANDBOX=1 (CI).
"""

from __future__ import annotations

from test_sandbox import isolated, no_guard  # noqa: F401 (fixtures: bubblewrap or skip; past the hook)

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
