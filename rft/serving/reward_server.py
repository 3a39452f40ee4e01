"""Any registered reward served over HTTP (`python -m rft.serving.reward_server`); its client, the
served reward `remote`, is rft/rewards/remote.py.

    python -m rft.serving.reward_server --reward math --port 8000       # prints its URL, and a token it generated
    export RFT_REWARD_TOKEN=<that token>                         # where the run starts
    python run.py 'buffer.explorer_input.taskset.reward_fn=[{fn: remote, args: {url: "http://127.0.0.1:8000"}}]'

`--reward` takes what a taskset's reward_fn takes (a name, a dotted path, or a JSON list of parts such as
'[{"fn": "math"}, {"fn": "reward_model", "weight": 0.5, "args": {...}}]'), built by rft.rewards.scoring.build.
The server binds 127.0.0.1 unless --host says otherwise and answers only `Authorization: Bearer <token>`
(the first line of --token-file, else $RFT_REWARD_TOKEN, else a generated one: never on the command line,
where `ps` shows it to every local user). It accepts bodies up to --max-body-mb (32), requests that arrive
whole within --request-timeout seconds (10; a client reading nothing of its answer as long is dropped)
and --max-connections (256) connections at once (rft.serving.auth),
and at most --max-responses (1024) responses in a request (a group: algorithm.repeat_times of them).
The client's token defaults to $RFT_REWARD_TOKEN (or `args: {url: ..., token: ...}`; the config is saved
with the run). Protocol: `make_app`; args: `RemoteReward`.
"""

import argparse
import logging
import math
import secrets
import sys

from rft.rewards.remote import NEW_TOKEN, TOKEN_ENV, UNSENDABLE, sendable
from rft.serving.auth import is_loopback, listening_socket, positive

log = logging.getLogger(__name__)

# a request is one group of responses, algorithm.repeat_times of them; without a bound, 1,000,000
# responses of "1" (4 MB, under the body limit) held a worker thread for 388 s of `math`
MAX_RESPONSES = 1024


# ---------------------------------------------------------------- the server

def make_app(scorer, token: str, max_body: int | None = None, max_responses: int = MAX_RESPONSES):
    """The FastAPI app that serves `scorer` (an `rft.rewards.scoring.Scorer`, or any callable
    `(prompt, responses, task) -> list[float | dict]`) to clients holding `token`, reading request
    bodies of at most `max_body` bytes (default rft.serving.auth.MAX_BODY) and at most `max_responses`
    responses.

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
    422 for a malformed body or one of more than `max_responses` responses, 500 with the exception's text when the reward raises (the client
    retries, then fails the task).
    Each request is scored on a worker thread, so a slow reward does not hold up the others.
    """
    from fastapi import FastAPI, Request
    from fastapi.concurrency import run_in_threadpool
    from fastapi.responses import JSONResponse

    from rft.serving.auth import MAX_BODY, BodyLimit, bearer_refusal

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
            prompt, responses, task = _request(await request.json(), max_responses)
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


def _request(body, max_responses: int = MAX_RESPONSES):
    """(prompt, responses, Task) from a request's JSON, or ValueError saying what is wrong."""
    from rft.data.tasks import Task

    if not isinstance(body, dict):
        raise ValueError(f"the body is {type(body).__name__}, not an object")
    prompt, responses, task = body.get("prompt"), body.get("responses"), body.get("task", {})
    if not isinstance(prompt, str):
        raise ValueError("'prompt' must be a string")
    if not isinstance(responses, list) or not all(isinstance(r, str) for r in responses):
        raise ValueError("'responses' must be a list of strings")
    if len(responses) > max_responses:
        raise ValueError(f"{len(responses)} responses in one request, over the {max_responses} this server scores at "
                         f"once (--max-responses); send a group of at most {max_responses}, or start the server with "
                         f"a larger --max-responses")
    if not isinstance(task, dict):
        raise ValueError("'task' must be an object {task_id, answer, row}")
    row, messages = task.get("row") or {}, task.get("messages") or []
    if not isinstance(row, dict) or not isinstance(messages, list):
        raise ValueError("'task.row' must be an object and 'task.messages' a list")
    return prompt, responses, Task(task_id=str(task.get("task_id", "")), messages=messages,
                                   answer=task.get("answer"), row=row)


def _wire(scorer, values, n: int) -> list:
    """The scorer's values as JSON: a float, or {part: weight * value} (see make_app)."""
    from rft.rewards.scoring import Reward

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


# ---------------------------------------------------------------- the command

def _parse_spec(text: str):
    """--reward: a name or dotted path as it is; a list or dict as JSON (or YAML flow: [{fn: math}])."""
    text = text.strip()
    if text[:1] in "[{":
        import yaml

        try:
            return yaml.safe_load(text)  # JSON is YAML
        except yaml.YAMLError as e:
            raise SystemExit(f"rft.serving.reward_server: --reward {text!r} is not a JSON list of parts: {e}")
    return text


def _parser() -> argparse.ArgumentParser:
    from rft.serving.auth import MAX_BODY, MAX_CONNECTIONS, REQUEST_TIMEOUT

    p = argparse.ArgumentParser(
        prog="python -m rft.serving.reward_server", description=__doc__,
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
    p.add_argument("--max-body-mb", type=positive(float), default=MAX_BODY / 2**20,
                   help=f"largest request body in MiB; a larger one is answered 413 (default {MAX_BODY / 2**20:g})")
    p.add_argument("--request-timeout", type=positive(float), default=REQUEST_TIMEOUT,
                   help=f"seconds a request has to arrive whole, and a client to read on in its answer; a slower one's "
                        f"connection is closed (default {REQUEST_TIMEOUT:g})")
    p.add_argument("--max-connections", type=positive(int), default=MAX_CONNECTIONS,
                   help=f"connections at once; beyond, requests are answered 503 (default {MAX_CONNECTIONS})")
    p.add_argument("--max-responses", type=positive(int), default=MAX_RESPONSES,
                   help=f"most responses in one request (a group of algorithm.repeat_times); more are answered 422 "
                        f"(default {MAX_RESPONSES})")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--access-log", action="store_true", help="log every request")
    return p


def _token(args) -> str:
    from rft.serving.auth import read_token

    if args.token is not None:
        raise SystemExit(f"rft.serving.reward_server: --token is not taken: a token on the command line is visible to every "
                         f"local user in `ps`. Set ${TOKEN_ENV}, or write it on the first line of a file only you can "
                         f"read and give --token-file <file>.")
    token = read_token(TOKEN_ENV, args.token_file, "rft.serving.reward_server")
    if token and not sendable(token):
        where = f"--token-file {args.token_file}" if args.token_file else f"${TOKEN_ENV}"
        raise SystemExit(f"rft.serving.reward_server: the token in {where} {UNSENDABLE}: {NEW_TOKEN}.")
    if not token:
        token = secrets.token_urlsafe(32)
        print(f"rft.serving.reward_server: generated token (give it to the clients as ${TOKEN_ENV}): {token}", flush=True)
    return token


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s: %(message)s")

    from rft.errors import ConfigError
    from rft.rewards.scoring import build, describe
    from rft.serving.auth import server_config

    token = _token(args)
    spec = _parse_spec(args.reward)
    if isinstance(spec, list) and any(isinstance(e, dict) and e.get("normalize") for e in spec):
        raise SystemExit("rft.serving.reward_server: normalize is done by the run's driver over the whole run; set "
                         "`normalize: true` on the remote part of the run's reward config, not here.")
    try:
        scorer = build(spec, "--reward")
    except ConfigError as e:
        raise SystemExit(f"rft.serving.reward_server: {e}")

    if not is_loopback(args.host):
        print(f"rft.serving.reward_server: WARNING: listening on {args.host}, not loopback: anyone who can reach this port "
              f"and has the token can ask for rewards, and the traffic (token included) is plain HTTP. Use it on "
              f"a trusted network, or behind a TLS proxy.", file=sys.stderr, flush=True)

    import uvicorn

    sock, host, port = listening_socket(args.host, args.port, "rft.serving.reward_server")
    print(f"rft.serving.reward_server: serving {describe(spec)} at http://{host}:{port} (POST /score, GET /health)", flush=True)
    app = make_app(scorer, token, max_body=int(args.max_body_mb * 2**20), max_responses=args.max_responses)
    config = server_config(app, request_timeout=args.request_timeout, max_connections=args.max_connections,
                           token=token, log_level=args.log_level, access_log=args.access_log)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
