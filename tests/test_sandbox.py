"""Model-written code runs in a sandboxed subprocess (rft/sandbox.py): each wall stops or refuses,
says why, and the calling process is unharmed."""

from __future__ import annotations

import os

import pytest

from rft import sandbox
from rft.environments import PythonEnv
from rft.tasks import Task, tool_call_text


def run(code, **kw):
    r = sandbox.run_python(code, **kw)
    assert os.getpid() > 0  # this process is alive (a child's os.kill of its parent would have ended it)
    return r


def test_plain_code_runs_and_its_output_comes_back():
    r = run("print(sum(range(10)))")
    assert (r.ok, r.stdout, r.reason, r.returncode) == (True, "45\n", None, 0)  # 0 + 1 + ... + 9 = 45
    r = run("x = input(); print(x[::-1])", stdin="abc\n")
    assert r.stdout == "cba\n"


def test_an_exception_is_a_failure_with_its_message():
    r = run("1/0")
    assert not r.ok and r.reason == "exited with status 1: ZeroDivisionError: division by zero"
    assert "Traceback" in r.stderr and r.returncode == 1


def test_code_that_loops_forever_is_killed_at_the_time_limit():
    r = run("while True: pass", timeout_s=1)
    assert not r.ok and r.reason == "timed out after 1 s (killed)"
    assert 1 <= r.seconds < 10


def test_code_that_allocates_10_gib_is_stopped():
    r = run("x = bytearray(10 * 1024**3)", memory_mb=256)
    assert not r.ok and r.reason == "memory limit of 256 MiB exceeded"
    r = run("l = []\nwhile True: l.append(' ' * 10**7)", memory_mb=256)
    assert r.reason == "memory limit of 256 MiB exceeded"


@pytest.mark.parametrize("unshare", [True, False])
def test_network_access_is_refused(monkeypatch, unshare):
    # with and without the network namespace: the audit hook refuses on its own
    monkeypatch.setattr(sandbox, "_use_unshare", unshare)
    r = run("import socket; socket.socket().connect(('127.0.0.1', 80))")
    assert r.reason == "refused: network access (socket.__new__)"
    r = run("import urllib.request; urllib.request.urlopen('http://127.0.0.1:1')")
    assert r.reason == "refused: network access (socket.getaddrinfo)"


def test_writing_outside_its_directory_is_refused_and_inside_works(tmp_path):
    outside = tmp_path / "outside.txt"
    r = run(f"open({str(outside)!r}, 'w').write('x')")
    assert r.reason == f"refused: writing outside the sandbox directory: {outside}" and not outside.exists()
    assert run("open('../escape.txt', 'w')").reason == "refused: writing outside the sandbox directory: ../escape.txt"
    assert run(f"import pathlib; pathlib.Path({str(outside)!r}).write_text('x')").reason.startswith(
        "refused: writing outside the sandbox directory")
    keep = tmp_path / "keep.txt"
    keep.write_text("mine")
    r = run(f"import os; os.remove({str(keep)!r})")
    assert r.reason == f"refused: os.remove outside the sandbox directory: {keep}" and keep.read_text() == "mine"
    r = run("open('in.txt', 'w').write('hi'); print(open('in.txt').read()); import json; print(json.dumps([1]))")
    assert r.ok and r.stdout == "hi\n[1]\n"  # its own directory, and reading the standard library


def test_killing_its_parent_and_starting_processes_are_refused():
    r = run("import os, signal; os.kill(os.getppid(), signal.SIGKILL)")
    assert r.reason == "refused: os.kill (signals to other processes)"
    assert run("import os; os.system('echo hi')").reason == "refused: os.system (no subprocesses)"
    assert run("import subprocess; subprocess.run(['ls'])").reason == "refused: subprocess.Popen (no subprocesses)"
    assert run("import ctypes; ctypes.CDLL(None)").reason == "refused: ctypes (native code)"
    # a refusal the code catches is still reported
    r = run("import os\ntry:\n    os.kill(os.getppid(), 9)\nexcept Exception:\n    pass\nprint('after')")
    assert r.stdout == "after\n" and r.reason == "refused: os.kill (signals to other processes)" and not r.ok


def test_output_is_cut_at_the_limit():
    r = run("print('x' * 10**6)", max_output_chars=100)
    assert r.ok and r.stdout == "x" * 100 + "\n... [cut: 999901 more characters]"  # 10**6 + 1 (newline) - 100


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
