"""Attacks on the ports rft listens on (the studio, the reward server, the explorer's OpenAI
endpoint), each against the real server started as the README says, by a client holding no token
(a local user, or anyone on the network with --host). What test_studio_guard.py,
test_reward_server.py and test_openai_api.py already try is not repeated here.
"""

import socket
import time

import pytest
from test_studio import _stop, _studio


def _hold_unread(port: int, path: str, n: int) -> list[socket.socket]:
    """`n` connections that each ask for `path` and then read nothing of the answer (a receive
    buffer of a few kB, so the kernel takes little of it for them)."""
    held = []
    for _ in range(n):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", port))
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        held.append(s)
    return held


@pytest.mark.slow
def test_clients_that_never_read_their_answer_cannot_lock_the_studio_out(tmp_path):
    """Measured before: ten connections asking for /static/plotly.min.js (4.8 MB; no token needed)
    and reading none of it held a studio of --max-connections 8 at 503 for every request of its
    own page, still after 30 s (uvicorn waits for a client to read for ever). Now a client that
    reads nothing for --request-timeout seconds (1 here) while more is to be sent is dropped."""
    import httpx

    proc, url, token = _studio(tmp_path, args=("--request-timeout", "1", "--max-connections", "8"))
    held = []
    try:
        port = int(url.rsplit(":", 1)[1])
        auth = {"Authorization": f"Bearer {token}"}
        held = _hold_unread(port, "/static/plotly.min.js", 10)
        time.sleep(0.3)
        assert httpx.get(url + "/api/launches", headers=auth).status_code == 503  # 10 held, 8 allowed
        time.sleep(3)  # each dropped ~1 s after its transport's buffer filled
        assert httpx.get(url + "/api/launches", headers=auth).status_code == 200
    finally:
        for s in held:
            s.close()
        _stop(proc)
