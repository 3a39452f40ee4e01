"""The reward server (`python -m rft.serving.reward_server`) and its client `remote`, over real HTTP on loopback.

Each test starts a server in a background thread (uvicorn on 127.0.0.1, port 0) serving a reward
config through `rft.rewards.scoring.build`, as the command does; the rewards below are named by dotted path
(`test_reward_server.<fn>`: this directory is on sys.path, as for test_scoring). Two tests start the
command itself as a subprocess. All of it, with the judge's (tests/test_judge.py), takes ~30 s:

    .venv/bin/python -m pytest tests/test_reward_server.py tests/test_judge.py
"""

import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import uvicorn
from conftest import ROOT, compose_cfg

from rft.data.tasks import Task
from rft.errors import ConfigError
from rft.rewards.remote import RemoteReward, RewardRequestError
from rft.rewards.scoring import build
from rft.rollout.explorer import run_jobs
from rft.serving.auth import server_config
from rft.serving.reward_server import make_app

# real HTTP servers and subprocesses: in `make test`, out of the fast tier
pytestmark = pytest.mark.slow

TOKEN = "test-token-1234"


# ---------------------------------------------------------------- rewards the servers serve

class Calls:
    """What the server side saw: calls, and the most calls in flight at once."""

    def __init__(self):
        self.lock = threading.Lock()
        self.reset()

    def reset(self):
        self.n = self.now = self.most = 0

    def enter(self) -> int:
        with self.lock:
            self.n += 1
            self.now += 1
            self.most = max(self.most, self.now)
            return self.n

    def leave(self):
        with self.lock:
            self.now -= 1


CALLS = Calls()


def slow_first(prompt, response, task, sleep=1.0, slow_calls=1):
    """Sleeps `sleep` seconds on the first `slow_calls` calls, then answers exact_match at once."""
    n = CALLS.enter()
    try:
        if n <= slow_calls:
            time.sleep(sleep)
        return float(response.strip() == str(task.answer).strip())
    finally:
        CALLS.leave()


def always_raises(prompt, response, task):
    CALLS.enter()
    CALLS.leave()
    raise ValueError(f"no reward for {task.task_id}")


def slow(prompt, response, task, sleep=0.3):
    CALLS.enter()
    time.sleep(sleep)
    CALLS.leave()
    return 1.0


def refused(task_id: str) -> bool:
    """Whether `refuses_some` refuses the task: the last number of its id is a multiple of 5."""
    return int(re.findall(r"\d+", task_id)[-1]) % 5 == 0


def refuses_some(prompt, response, task):
    """Raises for the tasks `refused` names, else exact_match."""
    if refused(task.task_id):
        raise ValueError(f"refused task {task.task_id}")
    return float(response.strip() == str(task.answer).strip())


@pytest.fixture(autouse=True)
def fresh_calls(monkeypatch):
    CALLS.reset()
    monkeypatch.delenv("RFT_REWARD_TOKEN", raising=False)


@contextlib.contextmanager
def serving(spec, token=TOKEN, **limits):
    """A reward server for `spec` on 127.0.0.1 (a free port) in a background thread; yields its URL."""
    with serving_app(make_app(build(spec, "spec"), token), **limits) as url:
        yield url


@contextlib.contextmanager
def serving_app(app, **limits):
    """An ASGI app on 127.0.0.1 (a free port) in a background thread, served as the command serves
    (rft.serving.auth.server_config, `limits` its arguments); yields its URL (test_judge too)."""
    server = uvicorn.Server(server_config(app, host="127.0.0.1", port=0, log_level="warning", **limits))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def task(task_id="t1", answer="357"):
    return Task(task_id=task_id, messages=[{"role": "user", "content": "042+315"}], answer=answer,
                row={"question": "042+315", "answer": answer})


# ---------------------------------------------------------------- scoring

def test_a_group_is_scored_as_the_reward_would_score_it_here():
    responses = ["357", " 357 ", "358", "the answer is 357"]
    with serving("exact_match") as url:
        client = RemoteReward(url, token=TOKEN)
        assert client("042+315", responses, task()) == [1.0, 1.0, 0.0, 0.0]
        assert client("042+315", [], task()) == []
        assert client.take_counters() == {"requests": 1, "retries": 0, "timeouts": 0, "failures": 0}
        assert client.take_counters() == {"requests": 0, "retries": 0, "timeouts": 0, "failures": 0}
    # two parts: each part's weight * value, which sum to the server's reward
    with serving([{"fn": "exact_match"}, {"fn": "last_number", "weight": 0.5}]) as url:
        client = RemoteReward(url, token=TOKEN)
        assert client("042+315", responses, task()) == [
            {"exact_match": 1.0, "last_number": 0.5},  # 1 + 0.5 * 1
            {"exact_match": 1.0, "last_number": 0.5},
            {"exact_match": 0.0, "last_number": 0.0},  # 358 != 357
            {"exact_match": 0.0, "last_number": 0.5},  # last number 357
        ]
        # as a part of the run's own reward config (the registry name `remote`), weight 2
        scorer = build([{"fn": "remote", "weight": 2.0, "args": {"url": url, "token": TOKEN}}], "reward_fn")
        rewards = scorer("042+315", responses, task())
        assert [float(r) for r in rewards] == [3.0, 3.0, 0.0, 1.0]
        assert rewards[3].parts == {"remote/exact_match": 0.0, "remote/last_number": 0.5}
        assert scorer.take_counters() == {"reward/remote/requests": 1, "reward/remote/retries": 0,
                                          "reward/remote/timeouts": 0, "reward/remote/failures": 0}


def test_a_missing_or_wrong_token_is_refused_at_once(monkeypatch):
    with serving("test_reward_server.slow_first") as url:
        for token in [None, "wrong"]:
            # the run checks its token before it starts
            with pytest.raises(ConfigError, match=rf"the remote reward at {url} cannot be used: GET {url}/health was "
                                                  rf"refused \(401\): refused: .* Give the token the server printed"):
                RemoteReward(url, token=token)
            client = RemoteReward(url, token=token, check=False, retries=3, backoff=1.0)
            t0 = time.monotonic()
            with pytest.raises(RewardRequestError, match=rf"POST {url}/score was refused \(401\): refused: "
                                                         rf"(no Authorization header|a wrong token)\..* set \$RFT_REWARD_TOKEN"):
                client("042+315", ["357"], task())
            assert time.monotonic() - t0 < 0.9  # no backoff sleep: not retried
            assert client.take_counters() == {"requests": 1, "retries": 0, "timeouts": 0, "failures": 1}
        # what a client without one sees, raw
        r = httpx.post(url + "/score", json={"prompt": "p", "responses": ["357"], "task": {}})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json() == {"detail": "refused: no Authorization header. Send 'Authorization: Bearer <token>', the "
                                      "token this server was started with (--token-file or $RFT_REWARD_TOKEN)."}
        assert httpx.get(url + "/health").status_code == 401
        assert httpx.get(url + "/health", headers={"Authorization": "Bearer " + TOKEN}).json() == {
            "status": "ok", "reward": "1 * slow_first"}
        # the token from the environment
        monkeypatch.setenv("RFT_REWARD_TOKEN", TOKEN)
        assert RemoteReward(url)("042+315", ["357"], task()) == [1.0]
    assert CALLS.n == 1  # only the last request reached the reward


def test_a_malformed_request_is_a_422_and_not_retried():
    with serving("exact_match") as url:
        auth = {"Authorization": "Bearer " + TOKEN}
        r = httpx.post(url + "/score", json={"prompt": "p", "responses": "357"}, headers=auth)
        assert r.status_code == 422 and r.json() == {"detail": "malformed request: 'responses' must be a list of strings"}
        # JSON nested deeper than Python's reader goes (a 500 at 0ef6a02: RecursionError)
        r = httpx.post(url + "/score", content=b"[" * 100_000, headers=auth)
        assert r.status_code == 422 and r.json() == {
            "detail": "malformed request: maximum recursion depth exceeded while decoding a JSON array from a "
                      "unicode string"}


def test_an_answer_of_the_wrong_shape_fails_the_request():
    """The client checks one value per response (a server of another version, a proxy's page...)."""
    from fastapi import FastAPI

    app = FastAPI()
    answers = iter([{"rewards": [1.0]}, {"rewards": [1.0, "high"]}, {"scores": [1.0, 1.0]}])
    app.get("/health")(lambda: {"status": "ok"})
    app.post("/score")(lambda: next(answers))
    with serving_app(app) as url:
        client = RemoteReward(url, token=TOKEN, backoff=0.01)
        for message in ["the answer has 1 rewards for 2 responses", "a reward is 'high', not a number",
                        "the answer has no list 'rewards'"]:
            with pytest.raises(RewardRequestError, match=rf"POST {url}/score: {message}"):
                client("p", ["357", "358"], task())
        assert client.take_counters() == {"requests": 3, "retries": 0, "timeouts": 0, "failures": 3}
    # a server-side reward (any callable) with the wrong count is a 500
    with serving_app(make_app(lambda prompt, responses, task: [1.0], TOKEN)) as url:
        with pytest.raises(RewardRequestError, match="the last answered 500: ValueError: the reward returned 1 "
                                                     "values for 2 responses"):
            RemoteReward(url, token=TOKEN, retries=0)("p", ["357", "358"], task())


def test_a_slow_answer_times_out_and_the_retry_gets_it():
    with serving("test_reward_server.slow_first") as url:
        client = RemoteReward(url, token=TOKEN, timeout=0.3, retries=2, backoff=0.05)
        assert client("042+315", ["357"], task()) == [1.0]
        assert client.take_counters() == {"requests": 1, "retries": 1, "timeouts": 1, "failures": 0}
    assert CALLS.n == 2  # the first try (it slept past the timeout), then the retry


def test_a_failing_reward_is_retried_then_raises():
    with serving("test_reward_server.always_raises") as url:
        client = RemoteReward(url, token=TOKEN, retries=2, backoff=0.01)
        with pytest.raises(RewardRequestError, match=rf"POST {url}/score failed after 3 tries; the last answered "
                                                     rf"500: ValueError: no reward for t1"):
            client("042+315", ["357"], task())
        assert client.take_counters() == {"requests": 1, "retries": 2, "timeouts": 0, "failures": 1}
    assert CALLS.n == 3


def test_bad_client_args_fail_when_built():
    with pytest.raises(ConfigError, match=r"url='127.0.0.1:8000': give the reward server's URL"):
        RemoteReward("127.0.0.1:8000", token=TOKEN)
    with pytest.raises(ConfigError, match=r"retries=-1 must be an integer >= 0"):
        RemoteReward("http://127.0.0.1:8000", token=TOKEN, retries=-1, check=False)
    with pytest.raises(ConfigError, match=r"timeout=0 must be a number > 0"):
        RemoteReward("http://127.0.0.1:8000", token=TOKEN, timeout=0, check=False)
    with pytest.raises(ConfigError, match=r"args has \['retry'\], which remote does not take; its arguments are "
                                          r"\['url', 'token', 'timeout', 'retries', 'backoff', 'max_backoff', "
                                          r"'max_concurrency', 'check', 'token_file'\]\. Did you mean retries \(not retry\)\?"):
        build([{"fn": "remote", "args": {"url": "http://127.0.0.1:8000", "retry": 1}}], "reward_fn")


def test_a_server_that_is_not_there():
    with serving("exact_match") as url:
        pass  # stopped: its port is free now
    with pytest.raises(ConfigError, match=rf"{url} cannot be used: GET {url}/health failed after 2 tries; the last "
                                          rf"could not connect.*Start it with `python -m rft.serving.reward_server"):
        RemoteReward(url, token=TOKEN, retries=1, backoff=0.01)
    client = RemoteReward(url, token=TOKEN, retries=1, backoff=0.01, check=False)
    with pytest.raises(RewardRequestError, match="failed after 2 tries; the last could not connect"):
        client("p", ["357"], task())
    assert client.take_counters() == {"requests": 1, "retries": 1, "timeouts": 0, "failures": 1}


def test_failing_remote_rewards_are_failed_tasks_and_the_others_go_on():
    """run_jobs, as the explorer scores a step: a task whose remote reward fails is retried
    (max_retry_times=1), then counted as failed; the other tasks get their rewards."""
    tasks = [task(f"t{i}") for i in range(1, 7)]  # t5 is refused
    with serving("test_reward_server.refuses_some") as url:
        scorer = build([{"fn": "remote", "args": {"url": url, "token": TOKEN, "retries": 1, "backoff": 0.01}}], "r")
        results, counters = run_jobs(lambda job: scorer(*job), [("042+315", ["357", "1"], t) for t in tasks],
                                     runners=3, timeout=10, retries=1)
        assert [None if r is None else [float(x) for x in r] for r in results] == [[1.0, 0.0]] * 4 + [None, [1.0, 0.0]]
        assert counters == {"errors": 2, "timeouts": 0, "retries": 1, "failed": 1, "over_rollout_dropped": 0,
                            "last_error": f"RewardRequestError: POST {url}/score failed after 2 tries; the last "
                                          f"answered 500: ValueError: refused task t5"}
        # 5 tasks of one request; 1 task of 2 tries (run_jobs) of a request of 2 tries each
        assert scorer.take_counters() == {"reward/remote/requests": 5 + 2, "reward/remote/retries": 2,
                                          "reward/remote/timeouts": 0, "reward/remote/failures": 2}


def test_an_explorer_step_with_a_remote_reward_part(tmp_path):
    """An explorer built from the documented override scores through the server: the tasks the
    server refuses are failed tasks, the others' experiences carry the remote part, and the client's
    counters reach the step's counters."""
    from rft.data.tasks import ensure_task_data
    from rft.models import ensure_model
    from rft.rollout.explorer import Explorer

    with serving("test_reward_server.refuses_some") as url:
        cfg = compose_cfg([
            "cluster=inline", "buffer.batch_size=4", "algorithm.repeat_times=2", "explorer.max_retry_times=1",
            f'buffer.explorer_input.taskset.reward_fn=[{{fn: remote, args: {{url: "{url}", token: {TOKEN}, '
            f'retries: 0}}}}, {{fn: exact_match, name: local}}]',
        ])
        ensure_model(cfg.model)
        ensure_task_data(cfg.buffer.explorer_input)
        explorer = Explorer(cfg)
        refused_ids = {t.task_id for t in explorer.tasks_for_step(0) if refused(t.task_id)}
        exps, counters = explorer.explore(0)
    assert len(refused_ids) == 2  # arithmetic_train/1095 and /1755 of the 4 (/33, /797)
    assert counters["failed_tasks"] == 2
    assert len(exps) == 2 * 2 and not refused_ids & {e.task_id for e in exps}
    for e in exps:
        assert set(e.reward_parts) == {"remote", "local"}
        assert e.reward_parts["remote"] == e.reward_parts["local"]  # both exact_match
        assert e.reward == 2 * e.reward_parts["local"]
    assert counters["reward/remote/requests"] == 2 + 2 * 2  # each refused task tried twice
    assert counters["reward/remote/failures"] == 2 * 2


def test_concurrent_requests_are_bounded_by_max_concurrency():
    with serving("test_reward_server.slow") as url:
        for limit, most in [(2, 2), (6, 6)]:  # the server itself does serve 6 at once
            CALLS.reset()
            client = RemoteReward(url, token=TOKEN, max_concurrency=limit)
            threads = [threading.Thread(target=client, args=("p", ["r"], task(f"t{i}"))) for i in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert CALLS.n == 6 and CALLS.most == most, (limit, CALLS.most)
            assert client.take_counters()["requests"] == 6


def command(*args, env=None):
    """`python -m rft.serving.reward_server --reward exact_match --port 0 *args` with $RFT_REWARD_TOKEN=TOKEN
    (or `env`); its process, once it printed its serving line, and its URL."""
    env = {**os.environ, "RFT_REWARD_TOKEN": TOKEN} if env is None else env
    proc = subprocess.Popen([sys.executable, "-m", "rft.serving.reward_server", "--reward", "exact_match", "--port", "0",
                             "--log-level", "warning", *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    assert "serving" in line, line + proc.stderr.read()
    return proc, line.split(" at ")[1].split()[0]


def stopped(proc) -> str:
    proc.terminate()
    proc.wait(10)
    return proc.stderr.read()


def test_the_command(tmp_path):
    """`python -m rft.serving.reward_server` on its default host prints its URL, answers, and stops."""
    proc, url = command()
    try:
        assert url.startswith("http://127.0.0.1:")
        assert RemoteReward(url, token=TOKEN)("042+315", ["357", "35"], task()) == [1.0, 0.0]
    finally:
        assert "WARNING" not in stopped(proc)  # loopback: no warning


def test_the_command_generates_a_token_and_warns_off_loopback():
    proc = subprocess.Popen([sys.executable, "-m", "rft.serving.reward_server", "--reward",
                             '[{"fn": "exact_match"}, {"fn": "last_number", "weight": 0.5}]', "--host", "0.0.0.0",
                             "--port", "0", "--log-level", "warning"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={k: v for k, v in os.environ.items() if k != "RFT_REWARD_TOKEN"})
    try:
        generated = proc.stdout.readline()
        assert generated.startswith("rft.serving.reward_server: generated token (give it to the clients as $RFT_REWARD_TOKEN): ")
        token = generated.rsplit(" ", 1)[1].strip()
        assert len(token) >= 40
        serving_line = proc.stdout.readline()
        assert "serving 1 * exact_match + 0.5 * last_number at http://0.0.0.0:" in serving_line
        port = serving_line.split("http://0.0.0.0:")[1].split()[0]
        assert RemoteReward(f"http://127.0.0.1:{port}", token=token)("p", ["357"], task()) == [
            {"exact_match": 1.0, "last_number": 0.5}]
    finally:
        proc.terminate()
        proc.wait(10)
    assert "WARNING: listening on 0.0.0.0, not loopback" in proc.stderr.read()


# ---------------------------------------------------------------- tokens off the command line

def test_a_token_on_the_command_line_is_refused_and_nothing_is_served():
    proc = subprocess.run([sys.executable, "-m", "rft.serving.reward_server", "--reward", "exact_match", "--port", "0",
                           "--token", "t0ken-in-ps"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == (
        "rft.serving.reward_server: --token is not taken: a token on the command line is visible to every local user in "
        "`ps`. Set $RFT_REWARD_TOKEN, or write it on the first line of a file only you can read and give "
        "--token-file <file>.\n")


def test_the_token_from_a_file_and_what_a_bad_file_says(tmp_path):
    path = tmp_path / "token"
    path.write_text("from-the-file-0123456789\n")
    path.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if k != "RFT_REWARD_TOKEN"}
    proc, url = command("--token-file", str(path), env=env)
    try:
        assert RemoteReward(url, token="from-the-file-0123456789")("p", ["357"], task()) == [1.0]
        with pytest.raises(ConfigError, match="refused"):
            RemoteReward(url, token=TOKEN)
    finally:
        assert stopped(proc) == ""  # a file only its owner reads: no warning
    path.chmod(0o644)
    proc, url = command("--token-file", str(path), env=env)
    assert stopped(proc) == (f"rft.serving.reward_server: WARNING: {path} can be read by other users (mode 644); "
                             f"`chmod 600 {path}` keeps the token yours.\n")
    for bad, why in [(tmp_path / "missing", "cannot read it (No such file or directory). Write the token on its "
                                             "first line, or set $RFT_REWARD_TOKEN instead."),
                     (tmp_path, "cannot read it (Is a directory). Write the token on its first line, or set "
                                "$RFT_REWARD_TOKEN instead.")]:
        r = subprocess.run([sys.executable, "-m", "rft.serving.reward_server", "--reward", "exact_match", "--token-file",
                            str(bad)], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert (r.returncode, r.stderr) == (1, f"rft.serving.reward_server: --token-file {bad}: {why}\n")
    path.write_text("\n")
    r = subprocess.run([sys.executable, "-m", "rft.serving.reward_server", "--reward", "exact_match", "--token-file",
                        str(path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.stderr == f"rft.serving.reward_server: --token-file {path} is empty: write the token on its first line.\n"


def test_a_token_that_no_http_header_can_carry_is_refused_by_name_and_never_shown(tmp_path):
    # HTTP headers are ASCII: before, a client with 'pässwörd...' raised a bare UnicodeEncodeError
    # from httpx; one with a line break inside retried 4 times as a connection failure and then said
    # "Illegal header value b'Bearer <the token>'", and a server could never match either
    for secret in ["pässwörd-1234567890", "test-token\n1234", "test token 1234"]:
        with pytest.raises(ConfigError) as e:
            RemoteReward("http://127.0.0.1:1", token=secret)
        assert str(e.value) == ("the remote reward's token (args.token or $RFT_REWARD_TOKEN) holds a character an "
                                "HTTP header cannot carry (a letter outside ASCII, a space, a line break): make "
                                "one with python -c 'import secrets; print(secrets.token_urlsafe(24))'.")
        env = {**os.environ, "RFT_REWARD_TOKEN": secret}
        r = subprocess.run([sys.executable, "-m", "rft.serving.reward_server", "--reward", "exact_match", "--port", "0"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
        assert (r.returncode, r.stderr) == (1, "rft.serving.reward_server: the token in $RFT_REWARD_TOKEN holds a character "
                                               "an HTTP header cannot carry (a letter outside ASCII, a space, a line "
                                               "break): make one with python -c 'import secrets; "
                                               "print(secrets.token_urlsafe(24))'.\n")
    # the judge's API key goes the same way (a key given as itself is not shown either)
    from rft.rewards.judge import JudgeReward

    with pytest.raises(ConfigError) as e:
        JudgeReward("http://127.0.0.1:1/v1", "m", api_key="sk-pässwörd")
    assert str(e.value) == ("the judge's API key (api_key, or the variable it names) holds a character an HTTP "
                            "header cannot carry (a letter outside ASCII, a space, a line break): give the key as "
                            "its provider issued it.")
    # around it, a line break (a secret file's last line, pasted) is not part of the token, on both sides
    with serving("exact_match") as url:
        assert RemoteReward(url, token=f"  {TOKEN}\n")("p", ["357"], task()) == [1.0]


# ---------------------------------------------------------------- limits: body, slow requests, connections

def peak_mib(pid: int) -> float:
    """The process's peak resident memory (VmHWM), MiB."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_the_servers_documented_defaults():
    """README: the server binds 127.0.0.1 (port 8000) and takes bodies up to --max-body-mb 32, requests
    whole within --request-timeout 10 s, --max-connections 256."""
    from rft.serving.reward_server import _parser

    a = _parser().parse_args(["--reward", "math"])
    assert (a.host, a.port, a.max_body_mb, a.request_timeout, a.max_connections) == ("127.0.0.1", 8000, 32.0, 10.0, 256)
    assert a.max_responses == 1024


def test_more_responses_than_the_server_scores_at_once_are_a_422_before_any_is_scored():
    """Measured at ca8cf29 (no bound): 1,000,000 responses of "1" (a 4 MB body, under the 32 MiB
    limit) were scored, 200 after 388 s of `math` on a worker thread. Now a 422 (not retried) that
    names --max-responses, and the reward is never called."""
    called = []

    def reward(prompt, responses, task):
        called.append(len(responses))
        return [1.0] * len(responses)

    with serving_app(make_app(reward, TOKEN, max_responses=3)) as url:
        auth = {"Authorization": "Bearer " + TOKEN}
        r = httpx.post(url + "/score", json={"prompt": "p", "responses": ["1"] * 4, "task": {}}, headers=auth)
        assert r.status_code == 422 and r.json() == {"detail": (
            "malformed request: 4 responses in one request, over the 3 this server scores at once (--max-responses); "
            "send a group of at most 3, or start the server with a larger --max-responses")}
        assert called == []
        r = httpx.post(url + "/score", json={"prompt": "p", "responses": ["1"] * 3, "task": {}}, headers=auth)
        assert r.status_code == 200 and r.json() == {"rewards": [1.0, 1.0, 1.0]} and called == [3]


def test_a_200_mb_body_is_a_413_and_never_held():
    """Measured at 0ef6a02 (no limit): the server read and parsed it, 200, its peak memory 59 -> 660
    MiB. Now 413 at once, from the Content-Length, and the peak does not move (60 -> 60 MiB)."""
    proc, url = command()
    try:
        time.sleep(0.3)
        before = peak_mib(proc.pid)
        body = b'{"prompt": "' + b"x" * (200 * 2**20) + b'", "responses": ["1"], "task": {}}'
        r = httpx.post(url + "/score", content=body, headers={"Authorization": "Bearer " + TOKEN}, timeout=60)
        assert r.status_code == 413 and r.json() == {
            "detail": "the request body is over the 32 MiB this server accepts (--max-body-mb)."}
        assert peak_mib(proc.pid) - before < 20
    finally:
        stopped(proc)


def test_a_chunked_body_is_cut_at_the_limit_and_one_below_it_is_served():
    def chunks(n):  # no Content-Length: the server counts what arrives
        for _ in range(n):
            yield b" " * 2**16

    with serving_app(make_app(build("exact_match", "spec"), TOKEN, max_body=2**20)) as url:
        auth = {"Authorization": "Bearer " + TOKEN}
        r = httpx.post(url + "/score", content=chunks(32), headers=auth)  # 2 MiB
        assert r.status_code == 413 and r.json()["detail"].startswith("the request body is over the 1 MiB")
        # 1 MiB less the JSON around it: served
        body = b'{"prompt": "p", "responses": ["357"], "task": {"answer": "357"}}'
        r = httpx.post(url + "/score", content=body + b" " * (2**20 - len(body)), headers=auth)
        assert r.status_code == 200 and r.json() == {"rewards": [1.0]}
        # without the token nothing of the body is read: 401, not 413
        assert httpx.post(url + "/score", content=chunks(32)).status_code == 401


def raw(url: str, data: bytes):
    host, port = url.split("//")[1].split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(data)
    return s


def closed_by_server(s, wait: float) -> bool:
    """Whether the server closed the connection within `wait` seconds (an answer then EOF counts)."""
    s.settimeout(wait)
    try:
        while s.recv(65536):
            pass
        return True
    except (socket.timeout, TimeoutError):
        return False
    except ConnectionResetError:
        return True


def test_half_sent_requests_are_dropped_and_connections_are_capped():
    """Measured at 0ef6a02: 200 requests whose head never ends were all still open after 15 s. Now
    each connection has --request-timeout seconds for its request to arrive whole; meanwhile no more
    than --max-connections are served (503 beyond: RemoteReward retries it)."""
    proc, url = command("--request-timeout", "1", "--max-connections", "8")
    try:
        t0 = time.monotonic()
        slow_heads = [raw(url, b"POST /score HTTP/1.1\r\nHost: x\r\nX-Slow: ") for _ in range(20)]
        slow_body = raw(url, b"POST /score HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
                        + b"\r\nContent-Length: 100\r\n\r\n{")
        time.sleep(0.2)
        r = httpx.get(url + "/health", headers={"Authorization": "Bearer " + TOKEN})
        # 21 connections held, 8 allowed: those without the token give up their slots to one with
        # it (tests/test_secrets.py), the others wait for their deadline
        assert r.status_code == 200
        assert all(closed_by_server(s, 3.0) for s in slow_heads + [slow_body])
        assert time.monotonic() - t0 < 3.0  # dropped after ~1 s
        r = httpx.get(url + "/health", headers={"Authorization": "Bearer " + TOKEN})
        assert r.status_code == 200
        # a head growing past 16 KiB unfinished: 400 from h11's limit at once, and closed (what one
        # read brings in whole, up to 64 KiB, is parsed)
        s = raw(url, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000)
        s.settimeout(3)
        assert s.recv(100).startswith(b"HTTP/1.1 400") and closed_by_server(s, 3.0)
    finally:
        stopped(proc)


def test_a_slow_reward_is_not_cut_by_the_request_timeout():
    # the deadline is for the request to arrive: the reward's 1.5 s after it are its own
    with serving("test_reward_server.slow_first", request_timeout=0.5) as url:
        fn = RemoteReward(url, token=TOKEN, retries=0)
        assert fn("p", ["357"], task()) == [1.0] and CALLS.n == 1
        time.sleep(0.7)  # an idle kept-alive connection past the deadline: closed, and the next call reconnects
        assert fn("p", ["357"], task()) == [1.0]
