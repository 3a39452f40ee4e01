"""Attacks on the ports rft listens on (the studio, the reward server, the explorer's OpenAI
endpoint), each against the real server started as the README says, by a client holding no token
(a local user, or anyone on the network with --host). What test_studio_guard.py,
test_reward_server.py and test_openai_api.py already try is not repeated here.
"""

import socket
import subprocess
import sys
import time

import pytest
from test_studio import _stop, _studio, browser  # noqa: F401  (browser: a fixture)


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
        # 10 held, 8 allowed: the oldest without the token gives its slot up to the request with it
        # (rft.serving.auth; tests/test_secrets.py); the rest are dropped as they read nothing
        assert httpx.get(url + "/api/launches", headers=auth).status_code == 200
        time.sleep(3)  # each dropped ~1 s after its transport's buffer filled
        assert httpx.get(url + "/api/launches", headers=auth).status_code == 200
    finally:
        for s in held:
            s.close()
        _stop(proc)


@pytest.mark.slow
def test_a_token_of_any_printable_ascii_reaches_the_api_from_the_printed_link(browser, tmp_path):  # noqa: F811
    """Measured before: $RFT_STUDIO_TOKEN with a '%' printed a link whose page stopped on "URI
    malformed" (its script decodes the fragment), and one with an '&' a page whose every request was
    refused (the token cut at the '&'). The link now holds the token quoted."""
    token = "abcd%zz&efgh#ij+k/l=m%41"
    proc, url, printed = _studio(tmp_path, extra_env={"RFT_STUDIO_TOKEN": token})
    try:
        assert printed == "abcd%25zz%26efgh%23ij%2Bk%2Fl%3Dm%2541"  # quote(token, safe="")
        page = browser.new_context(bypass_csp=True).new_page()
        errors, answers = [], []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("response", lambda r: answers.append((r.url.removeprefix(url), r.status)))
        page.goto(proc.link)
        page.wait_for_function("document.body.dataset.composed")
        assert errors == [] and ("/api/page/compose", 200) in answers, (errors, answers)
        assert page.evaluate("localStorage.getItem('rft-studio-token')") == token
    finally:
        _stop(proc)


def test_a_token_no_header_can_carry_or_a_token_file_that_is_not_text_is_one_line(tmp_path, monkeypatch):
    from rft.studio.__main__ import read_token

    monkeypatch.setenv("RFT_STUDIO_TOKEN", "a-token-of-twenty-€-signs")
    with pytest.raises(SystemExit) as e:
        read_token(None)
    assert str(e.value) == ("rft.studio: the token in $RFT_STUDIO_TOKEN holds a character an HTTP header cannot carry "
                            "(a letter outside ASCII, a space, a line break): make one with python -c 'import secrets; "
                            "print(secrets.token_urlsafe(24))'.")
    binary = tmp_path / "token"
    binary.write_bytes(b"\xff\xfe a key file, not text")
    binary.chmod(0o600)
    with pytest.raises(SystemExit) as e:  # was a UnicodeDecodeError's traceback
        read_token(str(binary))
    assert str(e.value) == f"rft.studio: --token-file {binary}: cannot read it (not UTF-8 text)."


def test_a_console_line_of_a_mebibyte_is_read_in_one_pass():
    """Each console read dropped a progress bar's older forms with a regex that scanned the rest of
    a line from each of its characters: an 80 kB line took 11 s of the studio's CPU, under the GIL
    every other request waits on, and a 1 MiB one (what a read returns at most) far longer."""
    import re

    from rft.studio.launch import newest_bars

    # a bar's newest form is kept; a CRLF's CR stays; a lone CR at the end of what was read ends a
    # form not yet drawn over, so the line shows nothing until it is (the regex's rule, kept)
    assert newest_bars("10%\r50%\r100%\ndone\r\nnext\r") == "100%\ndone\r\n"
    assert newest_bars("a\rb\n\r\n\rc") == "b\n\r\nc"
    old = r"[^\n\r]*\r(?!\n)"
    for text in ("10%\r50%\r100%\ndone\r\nnext\r", "a\rb\n\r\n\rc", "\r\r\n\n\r", "x\ry\rz"):
        assert newest_bars(text) == re.sub(old, "", text), repr(text)
    # a line of 1 MiB without a CR (the regex's worst case), then a bar, in a process given a minute
    # (it takes milliseconds; a regex holds the GIL, so a thread could not be timed out)
    script = ("import sys; from rft.studio.launch import newest_bars; "
              "sys.stdout.write(newest_bars('x' * (1 << 20) + '\\n10%\\r100%\\n')[-7:])")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (0, "x\n100%\n"), r.stderr


@pytest.mark.slow
def test_the_reward_server_takes_its_token_only_exactly_and_only_in_the_header():
    """Held (tried against the command, as the README starts it): the token in another case, cut,
    lengthened, in the query string, under another scheme or in a 60 kB header is refused; a page of
    another origin (or a rebinding DNS name) gets no CORS answer, so its script can neither send the
    header nor read a reply; a 1 GiB body without the token is answered 401 before any of it is sent."""
    import httpx
    from test_reward_server import TOKEN, command, stopped

    proc, url = command()
    try:
        body = {"prompt": "p", "responses": ["357"], "task": {"answer": "357"}}

        def status(path="/score", **headers):
            return httpx.post(url + path, json=body, headers=headers).status_code

        assert status(Authorization=f"Bearer {TOKEN}") == 200
        assert status(Authorization=f"bearer {TOKEN}") == 200  # the scheme is case-blind (RFC 7235)
        for wrong in (TOKEN.upper(), TOKEN[:-1], TOKEN + "x", f"{TOKEN} {TOKEN}", "A" * 60_000):
            assert status(Authorization=f"Bearer {wrong}") == 401, wrong[:40]
        assert status(Authorization=f"Basic {TOKEN}") == 401
        assert status(path=f"/score?token={TOKEN}&access_token={TOKEN}") == 401
        preflight = httpx.options(url + "/score", headers={"Origin": "http://evil.example",
                                                           "Access-Control-Request-Method": "POST",
                                                           "Access-Control-Request-Headers": "authorization"})
        assert preflight.status_code == 405 and not any(k.startswith("access-control") for k in preflight.headers)
        s = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        s.sendall(b"POST /score HTTP/1.1\r\nHost: evil.example\r\nContent-Length: 1073741824\r\n"
                  b"Content-Type: application/json\r\n\r\n")
        s.settimeout(10)
        assert s.recv(12) == b"HTTP/1.1 401"
        s.close()
    finally:
        stopped(proc)


def test_a_source_linked_out_of_the_run_is_listed_unread(tmp_path):
    """A run directory handed over may hold links. Reading a source through one is refused (its path
    leaves the run), while the list of sources counted the lines of the file it points to: 3 here,
    the lines of a file outside the checkpoint root. A link within the run is a source as any."""
    from rft.studio import rollouts as R

    outside = tmp_path / "outside.jsonl"
    outside.write_text('{"secret": 1}\n{"secret": 2}\n{"secret": 3}\n')
    run = tmp_path / "root" / "rft" / "r"
    step = run / "grpo" / "eval_trajectories" / "step_1"
    step.mkdir(parents=True)
    (step / "set.jsonl").write_text('{"task_id": "0", "reward": 1.0, "messages": []}\n')
    (step / "linked.jsonl").symlink_to(outside)
    (step / "here.jsonl").symlink_to(step / "set.jsonl")
    (run / "grpo" / "experiences.jsonl").symlink_to(outside)
    (run / "notes.txt").symlink_to(outside)  # not a source: not listed
    assert R.sources(run) == [
        {"path": "grpo/eval_trajectories/step_1/here.jsonl", "kind": "eval", "count": 1},
        {"path": "grpo/eval_trajectories/step_1/linked.jsonl", "kind": "eval", "count": None,
         "error": "a link out of the run directory: not read"},
        {"path": "grpo/eval_trajectories/step_1/set.jsonl", "kind": "eval", "count": 1},
        {"path": "grpo/experiences.jsonl", "kind": "experiences", "count": None,
         "error": "a link out of the run directory: not read"}]
    with pytest.raises(ValueError, match="'grpo/eval_trajectories/step_1/linked.jsonl' is not under the checkpoint root"):
        R.read(run, "grpo/eval_trajectories/step_1/linked.jsonl")
