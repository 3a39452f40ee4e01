"""Any registered reward served over HTTP (`python -m rft.reward_server`), and its client, the served reward `remote`.

    python -m rft.reward_server --reward math --port 8000       # prints its URL, and a token it generated
    export RFT_REWARD_TOKEN=<that token>                         # where the run starts
    python run.py 'buffer.explorer_input.taskset.reward_fn=[{fn: remote, args: {url: "http://127.0.0.1:8000"}}]'

`--reward` takes what a taskset's reward_fn takes (a name, a dotted path, or a JSON list of parts such as
'[{"fn": "math"}, {"fn": "reward_model", "weight": 0.5, "args": {...}}]'), built by rft.scoring.build.
The server binds 127.0.0.1 unless --host says otherwise and answers only `Authorization: Bearer <token>`
(the first line of --token-file, else $RFT_REWARD_TOKEN, else a generated one: never on the command line,
where `ps` shows it to every local user). It accepts bodies up to --max-body-mb (32), requests that arrive
whole within --request-timeout seconds (10) and --max-connections (256) connections at once (rft.serving).
The client's token defaults to $RFT_REWARD_TOKEN (or `args: {url: ..., token: ...}`; the config is saved
with the run). Protocol: `make_app`; args: `RemoteReward`.
"""

import argparse
import ipaddress
import json
import logging
import math
import os
import secrets
import socket
import sys
import threading
import time

import httpx

log = logging.getLogger(__name__)

TOKEN_ENV = "RFT_REWARD_TOKEN"


# ---------------------------------------------------------------- the server

def make_app(scorer, token: str, max_body: int | None = None):
    """The FastAPI app that serves `scorer` (an `rft.scoring.Scorer`, or any callable
    `(prompt, responses, task) -> list[float | dict]`) to clients holding `token`, reading request
    bodies of at most `max_body` bytes (default rft.serving.MAX_BODY).

    POST /score   {"prompt": str, "responses": [str, ...],
                   "task": {"task_id": str, "answer": any, "row": {...}, "messages": [...] (optional)}}
                  -> {"rewards": [float | {part: float}, ...]}, one per response. A reward of one
                  part is a float; one of several parts (or a dict reward) is a dict of each part's
                  weight * value, so that the dict's sum, which the client's run takes as the
                  reward, is the server's weighted sum; its run logs and stores each entry.
    GET /health   -> {"status": "ok", "reward": <the reward config, in short>}. It needs the token
                  too (a client checks its token with it before a run starts; it tells nothing to
                  anyone else).

    Errors are JSON `{"detail": "..."}`: 401 without the right token, 413 for a body over the limit,
    422 for a malformed body, 500 with the exception's text when the reward raises (the client
    retries, then fails the task).
    Each request is scored on a worker thread, so a slow reward does not hold up the others.
    """
    from fastapi import FastAPI, Request
    from fastapi.concurrency import run_in_threadpool
    from fastapi.responses import JSONResponse

    from rft.serving import MAX_BODY, BodyLimit, bearer_refusal

    if not token:
        raise ValueError("the reward server needs a token")
    expected = token.encode()
    summary = _summary(scorer)
    app = FastAPI(title="rft reward server", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, limit=max_body or MAX_BODY, hint=" (--max-body-mb)")

    def refused(request):
        return bearer_refusal(request, expected,
                              f"the token this server was started with (--token-file or ${TOKEN_ENV})")

    @app.get("/health")
    async def health(request: Request):
        return refused(request) or {"status": "ok", "reward": summary}

    @app.post("/score")
    async def score(request: Request):
        denied = refused(request)
        if denied is not None:
            return denied
        try:
            prompt, responses, task = _request(await request.json())
        except (ValueError, RecursionError) as e:  # json.JSONDecodeError; JSON nested too deep
            return JSONResponse({"detail": f"malformed request: {e}"}, status_code=422)
        try:
            values = await run_in_threadpool(scorer, prompt, responses, task)
            return {"rewards": _wire(scorer, values, len(responses))}
        except Exception as e:
            log.exception("the reward raised on task %s", task.task_id)
            return JSONResponse({"detail": f"{type(e).__name__}: {e}"}, status_code=500)

    return app


def _summary(scorer) -> str:
    parts = getattr(scorer, "parts", None)
    if parts:
        return " + ".join(f"{p.weight:g} * {p.name}" for p in parts)
    return getattr(scorer, "__name__", type(scorer).__name__)


def _request(body):
    """(prompt, responses, Task) from a request's JSON, or ValueError saying what is wrong."""
    from rft.tasks import Task

    if not isinstance(body, dict):
        raise ValueError(f"the body is {type(body).__name__}, not an object")
    prompt, responses, task = body.get("prompt"), body.get("responses"), body.get("task", {})
    if not isinstance(prompt, str):
        raise ValueError("'prompt' must be a string")
    if not isinstance(responses, list) or not all(isinstance(r, str) for r in responses):
        raise ValueError("'responses' must be a list of strings")
    if not isinstance(task, dict):
        raise ValueError("'task' must be an object {task_id, answer, row}")
    row, messages = task.get("row") or {}, task.get("messages") or []
    if not isinstance(row, dict) or not isinstance(messages, list):
        raise ValueError("'task.row' must be an object and 'task.messages' a list")
    return prompt, responses, Task(task_id=str(task.get("task_id", "")), messages=messages,
                                   answer=task.get("answer"), row=row)


def _wire(scorer, values, n: int) -> list:
    """The scorer's values as JSON: a float, or {part: weight * value} (see make_app)."""
    from rft.scoring import Reward

    if len(values) != n:
        raise ValueError(f"the reward returned {len(values)} values for {n} responses")
    weights = scorer.weights() if hasattr(scorer, "weights") else {}
    out = []
    for v in values:
        if isinstance(v, Reward) and v.parts and weights:
            if len(weights) == 1 and list(v.parts) == list(weights):
                out.append(_finite(float(v), "reward"))
            else:
                out.append({k: _finite(weights.get(k.split("/")[0], 1.0) * x, k) for k, x in v.parts.items()})
        elif isinstance(v, dict):
            out.append({str(k): _finite(float(x), str(k)) for k, x in v.items()})
        else:
            out.append(_finite(float(v), "reward"))
    return out


def _finite(x: float, name: str) -> float:
    if not math.isfinite(x):
        raise ValueError(f"{name} is {x}, which JSON cannot carry")
    return x


# ---------------------------------------------------------------- the HTTP helper (shared with rft/judge.py)

class RewardRequestError(RuntimeError):
    """A reward request that failed: refused (4xx, at once) or failing after all its retries."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


# a token travels in `Authorization: Bearer <token>`: HTTP headers are ASCII, and a space or a line
# break inside would cut or break the header (httpx raises, echoing it)
UNSENDABLE = "holds a character an HTTP header cannot carry (a letter outside ASCII, a space, a line break)"
NEW_TOKEN = "make one with python -c 'import secrets; print(secrets.token_urlsafe(24))'"


def sendable(token: str) -> bool:
    return token.isascii() and token.isprintable() and not any(c.isspace() for c in token)


def bearer_header(token: str | None, what: str, fix: str = NEW_TOKEN) -> dict:
    """{"Authorization": "Bearer <token>"} ({} without a token), the token stripped of the spaces
    and line break around it (a secret file's last line); a ConfigError naming `what`, never the
    token, for one no header can carry."""
    from rft.errors import ConfigError

    token = token.strip() if isinstance(token, str) else token
    if not token:
        return {}
    if not sendable(token):
        raise ConfigError(f"{what} {UNSENDABLE}: {fix}.")
    return {"Authorization": f"Bearer {token}"}


# statuses worth another try: the server's errors, and "too many requests" / "request timeout"
RETRY_STATUSES = (408, 429)


class RetryingHTTP:
    """One httpx.Client shared by the explorer's runner threads, with a bound on concurrent requests,
    retries and counters (for `RemoteReward` and `rft.judge.JudgeReward`).

    A request is tried up to `1 + retries` times: again after a timeout, a connection error, a 5xx,
    408 or 429, sleeping `backoff * 2**k` seconds (at most `max_backoff`; a 429's Retry-After up to
    that cap) before try k + 2. A 401 or 403 raises at once with `auth_hint`; any other 4xx raises
    at once too (asking again would not change the answer). At most `max_concurrency` requests are
    in flight at once (a BoundedSemaphore, released while a retry waits). `timeout` is seconds per
    try, to connect and for each read (httpx.Timeout).

    Counters (`take_counters`, reset on each take): requests (calls), retries (tries after the
    first), timeouts (tries that timed out), failures (calls that raised in the end).
    """

    COUNTERS = ("requests", "retries", "timeouts", "failures")

    def __init__(self, *, timeout: float = 30.0, retries: int = 3, backoff: float = 0.5, max_backoff: float = 8.0,
                 max_concurrency: int = 8, headers: dict | None = None, auth_hint: str = ""):
        from rft.errors import ConfigError

        for key, value in [("timeout", timeout), ("backoff", backoff), ("max_backoff", max_backoff)]:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (key == "timeout" and not value):
                raise ConfigError(f"{key}={value!r} must be a number " + ("> 0." if key == "timeout" else ">= 0."))
        for key, value, lo in [("retries", retries, 0), ("max_concurrency", max_concurrency, 1)]:
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ConfigError(f"{key}={value!r} must be an integer >= {lo}.")
        self.retries, self.backoff, self.max_backoff = retries, float(backoff), float(max_backoff)
        self.auth_hint = auth_hint
        self.client = httpx.Client(
            timeout=httpx.Timeout(float(timeout)), headers=headers or {},
            limits=httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency))
        self.slots = threading.BoundedSemaphore(max_concurrency)
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self.COUNTERS, 0)

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + n

    def take_counters(self) -> dict:
        with self._lock:
            out, self._counts = self._counts, dict.fromkeys(self.COUNTERS, 0)
        return out

    def request(self, method: str, url: str, *, json_body=None, counted: bool = True):
        """The response's JSON; raises RewardRequestError (counted in failures) when it cannot."""
        if counted:
            self.count("requests")
        try:
            return self._request(method, url, json_body, counted)
        except Exception:
            if counted:
                self.count("failures")
            raise

    def _request(self, method, url, json_body, counted):
        # (a NaN in a dataset row goes as NaN, which Python's json, the server's, reads back)
        content = None if json_body is None else json.dumps(json_body, default=_jsonable).encode()
        headers = {"Content-Type": "application/json"} if content is not None else {}
        last, wait = "", None
        for attempt in range(self.retries + 1):
            if attempt:
                if counted:
                    self.count("retries")
                time.sleep(min(self.backoff * 2 ** (attempt - 1), self.max_backoff) if wait is None else wait)
            wait = None
            try:
                with self.slots:
                    r = self.client.request(method, url, content=content, headers=headers)
            except httpx.TimeoutException as e:
                if counted:
                    self.count("timeouts")
                last = f"timed out ({type(e).__name__})"
                continue
            except httpx.TransportError as e:
                last = f"could not connect or read ({type(e).__name__}: {e})"
                continue
            if r.status_code < 300:
                try:
                    return r.json()
                except ValueError:
                    raise RewardRequestError(f"{method} {url}: the answer is not JSON: {r.text[:200]!r}", r.status_code) from None
            detail = _detail(r)
            if r.status_code in (401, 403):
                raise RewardRequestError(f"{method} {url} was refused ({r.status_code}): {detail.rstrip('.')}. {self.auth_hint}",
                                         r.status_code)
            if r.status_code >= 500 or r.status_code in RETRY_STATUSES:
                last = f"answered {r.status_code}: {detail}"
                after = r.headers.get("retry-after")
                if r.status_code == 429 and after and after.replace(".", "", 1).isdigit():
                    wait = min(float(after), self.max_backoff)
                continue
            raise RewardRequestError(f"{method} {url} answered {r.status_code}: {detail}", r.status_code)
        raise RewardRequestError(f"{method} {url} failed after {self.retries + 1} tries; the last {last}")

    def close(self) -> None:
        self.client.close()


def _detail(r) -> str:
    try:
        body = r.json()
    except ValueError:
        return r.text[:500] or r.reason_phrase
    if isinstance(body, dict):
        d = body.get("detail", body.get("error", body))
        if isinstance(d, dict) and "message" in d:  # OpenAI's {"error": {"message": ...}}
            d = d["message"]
        return str(d)[:500]
    return str(body)[:500]


def _jsonable(o):
    """What json cannot write by itself in a dataset row: numpy values, then anything as text."""
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "item"):
        return o.item()
    return str(o)


# ---------------------------------------------------------------- the client

class RemoteReward:
    """The served reward `remote`: scores each group by POST <url>/score to `python -m rft.reward_server`.

    args:
        url              the server's base URL, e.g. http://127.0.0.1:8000
        token            its token (default: $RFT_REWARD_TOKEN; keep it out of the saved config)
        timeout          seconds per try (connect, and each read); a slower answer is a timeout
        retries          tries after the first, after a timeout, a connection error or a 5xx, with
        backoff          sleeps of backoff * 2**k seconds, at most max_backoff; 401/403 and other
        max_backoff      4xx raise at once
        max_concurrency  requests in flight at once from this client (the explorer's runner threads share it)
        check            ask GET /health (with the token) when built, so that a server that is down
                         or a wrong token stops the run before it starts

    A request that fails after its retries raises: the explorer retries the task
    (explorer.max_retry_times), then counts it as failed, and the run goes on. Keep
    (1 + retries) * timeout plus the sleeps below explorer.max_timeout, or the explorer gives up first.
    Counters, logged as reward/<part>/<counter>: requests, retries, timeouts, failures.
    """

    def __init__(self, url: str, token: str | None = None, timeout: float = 30.0, retries: int = 3,
                 backoff: float = 0.5, max_backoff: float = 8.0, max_concurrency: int = 8, check: bool = True):
        from rft.errors import ConfigError

        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(f"url={url!r}: give the reward server's URL, e.g. http://127.0.0.1:8000.")
        self.url = url.rstrip("/").removesuffix("/score")
        token = token if token is not None else os.environ.get(TOKEN_ENV)
        hint = (f"Give the token the server printed or was started with: set ${TOKEN_ENV} where the explorer runs, "
                f"or args.token of the remote reward part.")
        headers = bearer_header(token, f"the remote reward's token (args.token or ${TOKEN_ENV})")
        self.http = RetryingHTTP(timeout=timeout, retries=retries, backoff=backoff, max_backoff=max_backoff,
                                 max_concurrency=max_concurrency, auth_hint=hint, headers=headers)
        if not headers:
            log.warning("remote reward %s: no token (args.token or $%s); the server will refuse the requests",
                        self.url, TOKEN_ENV)
        if check:
            try:
                self.http.request("GET", self.url + "/health", counted=False)
            except RewardRequestError as e:
                raise ConfigError(f"the remote reward at {self.url} cannot be used: {e}"
                                  + ("" if e.status else " Start it with `python -m rft.reward_server --reward <spec> "
                                                         "--port <port>` (or fix args.url).")) from None

    def __call__(self, prompt: str, responses: list[str], task) -> list:
        if not responses:
            return []
        body = {"prompt": prompt, "responses": list(responses),
                "task": {"task_id": getattr(task, "task_id", ""), "answer": getattr(task, "answer", None),
                         "row": getattr(task, "row", None) or {}, "messages": getattr(task, "messages", None) or []}}
        answer = self.http.request("POST", self.url + "/score", json_body=body)
        try:
            return _rewards(answer, len(responses))
        except ValueError as e:
            self.http.count("failures")
            raise RewardRequestError(f"POST {self.url}/score: {e}") from None

    def take_counters(self) -> dict:
        return self.http.take_counters()

    def close(self) -> None:
        self.http.close()


def _rewards(answer, n: int) -> list:
    """The answer's rewards, checked: one float or {part: float} per response."""
    rewards = answer.get("rewards") if isinstance(answer, dict) else None
    if not isinstance(rewards, list):
        raise ValueError(f"the answer has no list 'rewards': {str(answer)[:200]}")
    if len(rewards) != n:
        raise ValueError(f"the answer has {len(rewards)} rewards for {n} responses")
    for v in rewards:
        ok = (isinstance(v, (int, float)) and not isinstance(v, bool)) or (
            isinstance(v, dict) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v.values()))
        if not ok:
            raise ValueError(f"a reward is {v!r}, not a number or a dict of numbers")
    return [dict(v) if isinstance(v, dict) else float(v) for v in rewards]


# ---------------------------------------------------------------- the command

def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listening_socket(host: str, port: int, prog: str) -> tuple[socket.socket, str, int]:
    """A socket bound and listening on host:port (0: any free port), for uvicorn to serve on:
    (socket, the host as a URL writes it, the port). A port in use exits with one line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        raise SystemExit(f"{prog}: cannot listen on {host}:{port}: {e}. Choose another --port (0: any free one).")
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock, f"[{host}]" if family == socket.AF_INET6 else host, sock.getsockname()[1]


def _parse_spec(text: str):
    """--reward: a name or dotted path as it is; a list or dict as JSON (or YAML flow: [{fn: math}])."""
    text = text.strip()
    if text[:1] in "[{":
        import yaml

        try:
            return yaml.safe_load(text)  # JSON is YAML
        except yaml.YAMLError as e:
            raise SystemExit(f"rft.reward_server: --reward {text!r} is not a JSON list of parts: {e}")
    return text


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text} must be > 0")
        return value
    return parse


def _parser() -> argparse.ArgumentParser:
    from rft.serving import MAX_BODY, MAX_CONNECTIONS, REQUEST_TIMEOUT

    p = argparse.ArgumentParser(
        prog="python -m rft.reward_server", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reward", required=True,
                   help="a registered reward (exact_match, math, ...), a dotted path (module.function), or a JSON "
                        "list of parts [{\"fn\": ..., \"weight\": ..., \"args\": {...}}], as a taskset's reward_fn")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free one; default 8000)")
    p.add_argument("--token-file", default=None,
                   help=f"a file whose first line is the token clients must send (default ${TOKEN_ENV}; without "
                        f"either, one is generated and printed)")
    p.add_argument("--token", help=argparse.SUPPRESS)  # refused with a message: see main
    p.add_argument("--max-body-mb", type=_positive(float), default=MAX_BODY / 2**20,
                   help=f"largest request body in MiB; a larger one is answered 413 (default {MAX_BODY / 2**20:g})")
    p.add_argument("--request-timeout", type=_positive(float), default=REQUEST_TIMEOUT,
                   help=f"seconds a request has to arrive whole; a slower one's connection is closed "
                        f"(default {REQUEST_TIMEOUT:g})")
    p.add_argument("--max-connections", type=_positive(int), default=MAX_CONNECTIONS,
                   help=f"connections at once; beyond, requests are answered 503 (default {MAX_CONNECTIONS})")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--access-log", action="store_true", help="log every request")
    return p


def _token(args) -> str:
    from rft.serving import read_token

    if args.token is not None:
        raise SystemExit(f"rft.reward_server: --token is not taken: a token on the command line is visible to every "
                         f"local user in `ps`. Set ${TOKEN_ENV}, or write it on the first line of a file only you can "
                         f"read and give --token-file <file>.")
    token = read_token(TOKEN_ENV, args.token_file, "rft.reward_server")
    if token and not sendable(token):
        where = f"--token-file {args.token_file}" if args.token_file else f"${TOKEN_ENV}"
        raise SystemExit(f"rft.reward_server: the token in {where} {UNSENDABLE}: {NEW_TOKEN}.")
    if not token:
        token = secrets.token_urlsafe(32)
        print(f"rft.reward_server: generated token (give it to the clients as ${TOKEN_ENV}): {token}", flush=True)
    return token


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s: %(message)s")

    from rft.errors import ConfigError
    from rft.scoring import build, describe
    from rft.serving import server_config

    token = _token(args)
    spec = _parse_spec(args.reward)
    if isinstance(spec, list) and any(isinstance(e, dict) and e.get("normalize") for e in spec):
        raise SystemExit("rft.reward_server: normalize is done by the run's driver over the whole run; set "
                         "`normalize: true` on the remote part of the run's reward config, not here.")
    try:
        scorer = build(spec, "--reward")
    except ConfigError as e:
        raise SystemExit(f"rft.reward_server: {e}")

    if not _is_loopback(args.host):
        print(f"rft.reward_server: WARNING: listening on {args.host}, not loopback: anyone who can reach this port "
              f"and has the token can ask for rewards, and the traffic (token included) is plain HTTP. Use it on "
              f"a trusted network, or behind a TLS proxy.", file=sys.stderr, flush=True)

    import uvicorn

    sock, host, port = listening_socket(args.host, args.port, "rft.reward_server")
    print(f"rft.reward_server: serving {describe(spec)} at http://{host}:{port} (POST /score, GET /health)", flush=True)
    app = make_app(scorer, token, max_body=int(args.max_body_mb * 2**20))
    config = server_config(app, request_timeout=args.request_timeout, max_connections=args.max_connections,
                           log_level=args.log_level, access_log=args.access_log)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
