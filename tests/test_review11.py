"""Defects a review found in the servers' slow-client drop (36b8f8b) and the studio's runs page
(d1494c3), each shown by a test that failed before its fix."""

import socket
import threading
import time

import pytest

# ---------------------------------------------------------------- a slow reader with the kernel's buffers (36b8f8b)


def _serve(body: bytes, request_timeout: float):
    """tests/test_review8's server (a send buffer of a few kB) answering every request with `body`:
    (server, port)."""
    from test_review8 import _serve_in_thread

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    return _serve_in_thread(app, request_timeout)


def _ask(port: int, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    return s


@pytest.mark.slow  # 10 s of reading
def test_a_client_reading_steadily_with_the_kernels_buffers_is_not_dropped():
    # Measured before: a client with the kernel's default receive buffer took the first 175,713
    # bytes of an answer at once, and more only once it had read about half of them (its window
    # reopens when half its buffer is free; the server's send queue stood still 15 s while a client
    # read 8 KiB/s), so the transport's buffer, the only progress the server looked at, stood still
    # while the client read: with --request-timeout 1 a client reading 16 KiB/s was dropped after
    # 10.8 s at 175,713 bytes of 327,777 (with the default 10 s, one reading 8 KiB/s, as through an
    # ssh tunnel, after 21.7 s). Bytes its kernel acknowledges now count, and a client is given the
    # time to read all its kernel may hold at 1 KiB/s before it is taken for one reading nothing.
    # Read here at 32 KiB/s, in half the time of 16 KiB/s: the ~88 KB a client reads before its window
    # reopens still take it ~2.7 s, past the 1 s the buffer alone is given (the rule before, still the
    # one where the kernel does not say: with it this client is dropped at 175,616 bytes)
    body = bytes(range(256)) * 1280  # 320 KiB: 10 s at 32 KiB/s
    server, port = _serve(body, request_timeout=1)
    try:
        s, got = _ask(port), b""
        while not got.endswith(body):
            chunk = s.recv(1024)  # 1 KiB each 1/32 s: 32 KiB/s
            if not chunk:
                break
            got += chunk
            time.sleep(1 / 32)
        s.close()
        assert len(got.split(b"\r\n\r\n", 1)[1]) == 327_680  # 1280 x 256, not a connection dropped midway
    finally:
        server.should_exit = True


@pytest.mark.slow  # ~7 s of waiting
def test_a_client_that_reads_nothing_is_still_dropped():
    # it is given the time to read what its kernel took at 1 KiB/s: a receive buffer of 4096 bytes
    # (the kernel doubles it) takes under 8 KiB, so under 8 s, then looked at each 1/4 s (measured:
    # 6,242 bytes taken, dropped ~7.3 s after the request). Waited for until the server has let the
    # connection go, 10 s at most: the client's kernel says nothing of it, the server's FIN waiting
    # behind the answer's bytes it cannot take
    body = bytes(range(256)) * 4096  # 1 MiB
    server, port = _serve(body, request_timeout=1)
    try:
        s = _ask(port, rcvbuf=4096)
        seen = False
        for _ in range(100):
            seen = seen or bool(server.server_state.connections)  # the server has taken it
            if seen and not server.server_state.connections:
                break
            time.sleep(0.1)
        s.settimeout(10)
        got = b""
        try:
            while chunk := s.recv(1 << 20):
                got += chunk
        except ConnectionResetError:  # the abort's RST
            pass
        s.close()
        assert 0 < len(got) < 16384  # what its kernel held when the connection was dropped, not the 1 MiB
    finally:
        server.should_exit = True


# ---------------------------------------------------------------- the runs page's sweeps, read once (d1494c3)

def _plan(lrs: str, seeds: str) -> str:
    return ("hydra:\n  sweeper:\n    _target_: hydra._internal.core_plugins.basic_sweeper.BasicSweeper\n"
            f"    params:\n      algorithm.optimizer.lr: {lrs}\n      seed: {seeds}\n"
            "  overrides:\n    task: []\n")


def test_a_sweeps_plan_is_read_again_only_when_its_multirun_yaml_changed(tmp_path, monkeypatch):
    # Measured before: every poll of the runs page (each 2 s) expanded every sweep's multirun.yaml
    # again, 31-63 ms a sweep on a loaded machine: ~1 s of CPU a poll at 20 sweeps
    import os

    from rft.reporting import report
    from rft.studio import runs

    reads, expand = [], report.planned_jobs
    monkeypatch.setattr(report, "planned_jobs", lambda d: reads.append(d) or expand(d))
    sweep = tmp_path / "rft" / "multirun" / "2026-01-01_00-00-00"
    sweep.mkdir(parents=True)
    plan = sweep / "multirun.yaml"
    plan.write_text(_plan("1e-4,3e-4", "1,2,3"))
    assert [runs._planned(sweep) for _ in range(3)] == [6, 6, 6]  # 2 lrs x 3 seeds
    assert reads == [sweep]  # read once, not at each poll
    plan.write_text(_plan("1e-4,3e-4", "1,2,3,4"))  # another size
    assert runs._planned(sweep) == 8 and len(reads) == 2  # 2 x 4
    size, mtime = plan.stat().st_size, plan.stat().st_mtime_ns
    plan.write_text(_plan("1e-4,3e-4,1e-3", "56"))  # the same size: 9 + 7 characters then, 14 + 2 now
    os.utime(plan, ns=(mtime, mtime + 10**9))  # written a second later
    assert plan.stat().st_size == size
    assert runs._planned(sweep) == 3 and len(reads) == 3  # 3 x 1
    assert runs._planned(sweep) == 3 and len(reads) == 3
    plan.unlink()
    assert runs._planned(sweep) is None and runs._planned(sweep) is None  # no plan: nothing to remember


@pytest.mark.slow  # 1.0 s alone, over the fast tier's second
def test_a_connection_whose_answer_is_under_way_keeps_its_slot():
    # 02f5649: over --max-connections a new connection closes the oldest one that has not sent the
    # token, and that was also one whose request was being answered: a page or asset the studio
    # serves without the token, cut after its headers under a burst of connections (a review
    # reproduced it with a limit of 3). Idle ones without the token make room; this one is answered
    import asyncio

    import uvicorn

    from rft.serving.auth import server_config

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await asyncio.sleep(1.0)  # an answer under way while the others connect
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]})
        await send({"type": "http.response.body", "body": b"asset"})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(server_config(app, max_connections=3, token="tok", log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    port = sock.getsockname()[1]
    try:
        page = _ask(port)  # no token: the studio's static files need none
        time.sleep(0.2)
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]  # past the limit of 3
        page.settimeout(10)
        got = b""
        while not got.endswith(b"asset"):
            chunk = page.recv(1024)
            assert chunk, f"closed mid-answer after {got!r}"  # before: closed, nothing or the head only
            got += chunk
        assert got.startswith(b"HTTP/1.1 200")
        for s in idle + [page]:
            s.close()
    finally:
        server.should_exit = True
