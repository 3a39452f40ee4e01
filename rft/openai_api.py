"""The explorer's OpenAI-compatible endpoint, and the `openai_agent` workflow that trains on it.

Agent code written against the official `openai` client runs unchanged inside a workflow:

    explorer.rollout_model.enable_openai_api: true      # each explorer serves its engine
    buffer.explorer_input.taskset.workflow: openai_agent
    buffer.explorer_input.taskset.workflow_args: {agent: my_study.agent.solve}

    # my_study/agent.py
    def solve(client, task, model, seed):
        reply = client.chat.completions.create(model=model, seed=seed, messages=task.messages)
        answer = reply.choices[0].message.content
        return float(answer.strip() == str(task.answer))   # or {part: value}, or None: the taskset's reward

The server (FastAPI on uvicorn, in a thread of the explorer) serves `/v1/chat/completions`,
`/v1/completions` and `/v1/models` from the policy's engine (hf or vllm) and from the auxiliary
models (explorer.auxiliary_models, under their names). It binds to 127.0.0.1 only and refuses a
request without its token (`Authorization: Bearer`, a fresh random token per explorer, never
logged); the workflow hands the agent a client that has both. One engine call at a time per model
(engines are not thread-safe); agents run concurrently on the explorer's workflow runners.

History (explorer.rollout_model.enable_history, default true). Every policy call's prompt ids,
sampled ids and sampling log-probs are recorded under the rollout that made it (the client sends
`X-RFT-Rollout`) and become that rollout's experiences: the ids the engine sampled, never
re-tokenised from the text the agent saw. Each call is one experience, unless a call's prompt ids
start with the previous call's prompt + sampled ids (an agent continuing its own token ids
through /v1/completions): then they are one experience, the loss mask 1 on both calls' sampled
tokens and 0 between. A chat agent re-sends text, which the chat template re-renders (after
<|im_end|> it adds a newline the model never sampled), so its calls are separate experiences; the
token-exact multi-turn alternative is the multi_turn workflow (rft/multi_turn.py). Every
experience of a rollout gets the rollout's reward.

Seeds. A request's `seed` is passed to the engine: the same seed, prompt and sampling give the
same tokens as a direct `engine.generate(...)` call (the test compares them). The workflow hands
each rollout a seed derived from the step's; a request without one gets a counter's (not
reproducible across runs). Sampling the request does not set comes from the taskset's
rollout_args (greedy for an eval set at temperature 0).
"""


import itertools
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

from rft.chat import render
from rft.errors import ConfigError
from rft.experience import Experience

log = logging.getLogger(__name__)

ROLLOUT_HEADER = "X-RFT-Rollout"


@dataclass
class Call:
    """One sampled completion of the policy, as the engine gave it."""
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    sampling: dict
    prompt_text: str
    response_text: str
    rollout: str


class OpenAIServer:
    """`models`: name -> (engine, tokenizer); `policy` the trained one (its calls are recorded);
    `defaults` the sampling of requests that do not set it; `max_tokens` the default budget."""

    def __init__(self, models: dict, policy: str, defaults, max_tokens: int, history: bool = True,
                 host: str = "127.0.0.1", port: int = 0, token: str | None = None):
        self.models, self.policy, self.defaults, self.max_tokens = models, policy, defaults, max_tokens
        self.history_on, self.host, self.port = history, host, port
        self.token = token or secrets.token_urlsafe(32)
        self.locks = {name: threading.Lock() for name in models}
        self.history: dict[str, list[Call]] = {}
        self.rollout_defaults: dict[str, object] = {}
        self.seeds = itertools.count(1)
        self.guard = threading.Lock()
        self.server = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    # ------------------------------------------------------------ lifecycle

    def start(self) -> "OpenAIServer":
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(self.app(), host=self.host, port=self.port, log_level="warning"))
        threading.Thread(target=self.server.run, daemon=True, name="openai-api").start()
        t0 = time.monotonic()
        while not self.server.started:
            if time.monotonic() - t0 > 30:
                raise RuntimeError("the OpenAI-compatible server did not start in 30 s")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True

    # ------------------------------------------------------------ history

    def open(self, rollout: str, defaults) -> None:
        """The calls of `rollout` are sampled with `defaults` where they do not say otherwise."""
        with self.guard:
            self.rollout_defaults[rollout] = defaults
            self.history[rollout] = []

    def take_history(self, rollout: str) -> list[Call]:
        """The policy calls `rollout` made, in order (and forget them)."""
        with self.guard:
            self.rollout_defaults.pop(rollout, None)
            return self.history.pop(rollout, [])

    # ------------------------------------------------------------ serving

    def _sample(self, model: str, prompt: list[int], body: dict, rollout: str) -> list[Call]:
        engine, tok = self.models[model]
        base = self.rollout_defaults.get(rollout, self.defaults)
        stop = body.get("stop") if body.get("stop") is not None else list(getattr(base, "stop", []) or [])
        args = SimpleNamespace(
            temperature=float(body.get("temperature", base.temperature)), top_p=float(body.get("top_p", base.top_p)),
            top_k=int(body.get("top_k", base.top_k)), stop=[stop] if isinstance(stop, str) else list(stop),
            max_tokens=int(body.get("max_completion_tokens") or body.get("max_tokens") or base.max_tokens or self.max_tokens))
        seed = int(body["seed"]) if body.get("seed") is not None else next(self.seeds)
        with self.locks[model]:
            [group] = engine.generate([prompt], int(body.get("n", 1)), args, seed=seed % (2**31))
        sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
        prompt_text = tok.decode(prompt, skip_special_tokens=True)
        calls = [Call(list(prompt), list(s.token_ids), list(s.logprobs), s.finish_reason, dict(sampling), prompt_text,
                      tok.decode(s.token_ids, skip_special_tokens=True), rollout) for s in group]
        if model == self.policy and self.history_on:
            with self.guard:
                self.history.setdefault(rollout, []).extend(calls)
        return calls

    def app(self):
        from fastapi import FastAPI, Request
        from fastapi.concurrency import run_in_threadpool
        from fastapi.responses import JSONResponse

        from rft.serving import bearer_refusal

        app = FastAPI(title="rft OpenAI-compatible endpoint", docs_url=None, redoc_url=None, openapi_url=None)
        expected = self.token.encode()

        def error(status: int, message: str, kind: str):
            return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)

        async def checked(request: Request):
            denied = bearer_refusal(request, expected, "the explorer's token (the workflow's client has it)")
            if denied is not None:
                return None, error(401, "refused: " + denied.body.decode().split("refused: ", 1)[-1].rstrip('"}'),
                                   "invalid_request_error")
            try:
                body = await request.json()
            except ValueError as e:
                return None, error(400, f"malformed JSON: {e}", "invalid_request_error")
            model = body.get("model") or self.policy
            if model not in self.models:
                return None, error(404, f"model {model!r} is not served here; the models are {sorted(self.models)}",
                                   "not_found_error")
            body["model"] = model
            return body, None

        def usage(prompt, calls):
            done = sum(len(c.token_ids) for c in calls)
            return {"prompt_tokens": len(prompt), "completion_tokens": done, "total_tokens": len(prompt) + done}

        def logprobs_of(tok, c, chat: bool):
            if chat:
                return {"content": [{"token": tok.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
                                    for t, lp in zip(c.token_ids, c.logprobs)]}
            return {"tokens": [tok.decode([t]) for t in c.token_ids], "token_logprobs": c.logprobs,
                    "top_logprobs": None, "text_offset": None}

        @app.get("/v1/models")
        async def models(request: Request):
            denied = bearer_refusal(request, expected, "the explorer's token")
            return denied or {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "rft"} for m in self.models]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body, denied = await checked(request)
            if denied is not None:
                return denied
            tok = self.models[body["model"]][1]
            prompt = render(tok, list(body.get("messages") or []), generation_prompt=True)
            calls = await run_in_threadpool(self._sample, body["model"], prompt, body, request.headers.get(ROLLOUT_HEADER, ""))
            return {"id": f"chatcmpl-{secrets.token_hex(8)}", "object": "chat.completion", "created": int(time.time()),
                    "model": body["model"], "usage": usage(prompt, calls),
                    "choices": [{"index": i, "message": {"role": "assistant", "content": c.response_text},
                                 "finish_reason": c.finish_reason,
                                 "logprobs": logprobs_of(tok, c, True) if body.get("logprobs") else None}
                                for i, c in enumerate(calls)]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            body, denied = await checked(request)
            if denied is not None:
                return denied
            tok = self.models[body["model"]][1]
            p = body.get("prompt")
            if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
                p = p[0]  # the client sends one prompt as a one-entry list
            prompt = list(p) if isinstance(p, list) else tok.encode(str(p or ""), add_special_tokens=False)
            calls = await run_in_threadpool(self._sample, body["model"], prompt, body, request.headers.get(ROLLOUT_HEADER, ""))
            return {"id": f"cmpl-{secrets.token_hex(8)}", "object": "text_completion", "created": int(time.time()),
                    "model": body["model"], "usage": usage(prompt, calls),
                    "choices": [{"index": i, "text": c.response_text, "finish_reason": c.finish_reason,
                                 "logprobs": logprobs_of(tok, c, False) if body.get("logprobs") is not None else None}
                                for i, c in enumerate(calls)]}

        return app


# ---------------------------------------------------------------- the workflow

def experiences_of(calls: list[Call]) -> list[tuple[list[int], int, list[float], list[int], Call]]:
    """(tokens, prompt_length, logprobs, loss_mask, last call) per experience: a call whose prompt
    starts with the previous call's prompt + sampled ids continues that experience."""
    out = []
    for c in calls:
        if out:
            tokens, plen, lps, mask, _ = out[-1]
            if c.prompt_ids[: len(tokens)] == tokens:
                gap = len(c.prompt_ids) - len(tokens)
                out[-1] = (c.prompt_ids + c.token_ids, plen, lps + [0.0] * gap + c.logprobs,
                           mask + [0] * gap + [1] * len(c.token_ids), c)
                continue
        out.append((c.prompt_ids + c.token_ids, len(c.prompt_ids), list(c.logprobs), [1] * len(c.token_ids), c))
    return out


def openai_agent(tasks, engine, ctx) -> list[list[Experience] | None]:
    """`ctx.n` runs of the agent (workflow_args.agent) per task against the explorer's endpoint;
    their recorded policy calls are the experiences (module docstring)."""
    import openai

    from rft.algorithms import resolve
    from rft.scoring import Reward

    server = ctx.openai
    if server is None:
        raise ConfigError("workflow openai_agent needs the explorer's endpoint: set "
                          "explorer.rollout_model.enable_openai_api=true.")
    args = dict(ctx.args)
    if "agent" not in args:
        raise ConfigError("workflow openai_agent needs workflow_args.agent: the dotted path of a function "
                          "agent(client, task, model, seed, **workflow_args).")
    agent = resolve({}, args.pop("agent"), "workflow_args.agent")
    jobs = [(i, task, j) for i, task in enumerate(tasks) for j in range(ctx.n)]

    def run(job):
        i, task, j = job
        key = f"{ctx.step}/{ctx.seed}/{task.task_id}/{j}"
        server.open(key, ctx.rollout_args)
        client = openai.OpenAI(base_url=server.url, api_key=server.token, max_retries=0,
                               default_headers={ROLLOUT_HEADER: key})
        try:
            result = agent(client, task, model=server.policy, seed=(ctx.seed + i * ctx.n + j) % (2**31), **args)
        finally:
            client.close()
        return result, server.take_history(key)

    results = (ctx.call or (lambda fn, js: [fn(x) for x in js]))(run, jobs)
    out: list = [[] for _ in tasks]
    for (i, task, j), res in zip(jobs, results):
        if out[i] is None:
            continue
        if res is None or not res[1]:
            log.warning("task %s failed: its agent %s", task.task_id, "raised or timed out" if res is None else "made no policy call")
            out[i] = None
            continue
        value, calls = res
        if value is None:  # the taskset's reward on the last answer
            last = calls[-1]
            scored = ctx.score([(last.prompt_text, [last.response_text], task)])[0]
            if scored is None:
                out[i] = None
                continue
            reward = scored[0]
        elif isinstance(value, dict):
            reward = Reward(sum(float(v) for v in value.values()), {k: float(v) for k, v in value.items()})
        else:
            reward = Reward(float(value), {"agent": float(value)})
        for n, (tokens, plen, lps, mask, c) in enumerate(experiences_of(calls)):
            out[i].append(Experience(
                tokens=tokens, prompt_length=plen, logprobs=lps, reward=reward,
                group_id=f"{ctx.step}/{ctx.seed}/{task.task_id}", task_id=task.task_id,
                policy_version=ctx.policy_version, sampling=dict(c.sampling), loss_mask=mask,
                info={"finish_reason": c.finish_reason, "prompt": c.prompt_text, "response": c.response_text,
                      "rollout": j, "call": n, "prompt_truncated": False}))
    return out
