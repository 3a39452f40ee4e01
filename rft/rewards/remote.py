"""The served reward `remote`: the client of `python -m rft.serving.reward_server`, and the HTTP
helper it shares with the judge (rft/rewards/judge.py).

    buffer.explorer_input.taskset.reward_fn=[{fn: remote, args: {url: "http://127.0.0.1:8000"}}]

The token defaults to $RFT_REWARD_TOKEN (or the first line of `args: {url: ..., token_file: ...}`; or
`args: {url: ..., token: ...}`, which the saved config, the trackers and the report show as `***`,
and which `ps` shows when typed on the command line: the run warns of that). Each group is one request, retried on timeouts, connection errors and 5xx
(`RetryingHTTP`); args: `RemoteReward`. The server is rft/serving/reward_server.py: this client
imports none of it.
"""

import json
import logging
import os
import threading
import time

from rft.reporting.redact import MASK

log = logging.getLogger(__name__)

TOKEN_ENV = "RFT_REWARD_TOKEN"


# ---------------------------------------------------------------- the HTTP helper (shared with rft/rewards/judge.py)

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
    retries and counters (for `RemoteReward` and `rft.rewards.judge.JudgeReward`).

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
        import httpx  # here, not at the top: planning reads this module's classes, and starts no client

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
        import httpx

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


def read_token_file(path: str) -> str:
    """The first line of the remote reward's args.token_file; a ConfigError naming the file (never its
    text) where it cannot be read or is empty, and a warning where other users may read it."""
    import stat

    from rft.errors import ConfigError

    where = os.path.expanduser(str(path))
    try:
        with open(where, encoding="utf-8") as f:
            first = f.readline(4097)
        mode = os.stat(where).st_mode
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"the remote reward's args.token_file {path}: cannot read it "
                          f"({getattr(e, 'strerror', None) or type(e).__name__}). Write the token on its first line "
                          f"(or give it in ${TOKEN_ENV}).") from None
    if not first.strip():
        raise ConfigError(f"the remote reward's args.token_file {path} is empty: write the token on its first line.")
    if stat.S_IMODE(mode) & 0o044:
        log.warning("the remote reward's args.token_file %s can be read by other users (mode %o): `chmod 600 %s` "
                    "keeps the token yours", path, stat.S_IMODE(mode), path)
    return first.strip()


# ---------------------------------------------------------------- the client

class RemoteReward:
    """The served reward `remote`: scores each group by POST <url>/score to `python -m rft.serving.reward_server`.

    args:
        url              the server's base URL, e.g. http://127.0.0.1:8000
        token            its token (default: the first line of token_file, else $RFT_REWARD_TOKEN; typed
                         here it is in `ps` and the launcher's files: give it by either of those)
        token_file       a file holding the token on its first line (keep it yours: chmod 600)
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
                 backoff: float = 0.5, max_backoff: float = 8.0, max_concurrency: int = 8, check: bool = True,
                 token_file: str | None = None):
        from rft.errors import ConfigError

        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(f"url={url!r}: give the reward server's URL, e.g. http://127.0.0.1:8000.")
        self.url = url.rstrip("/").removesuffix("/score")
        # MASK: a saved record's masked token (rft/reporting/redact.py) composed again; the file or the environment has it
        if token in (None, MASK):
            token = read_token_file(token_file) if token_file else os.environ.get(TOKEN_ENV)
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
                                  + ("" if e.status else " Start it with `python -m rft.serving.reward_server --reward <spec> "
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
