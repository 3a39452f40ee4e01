"""The explorer's OpenAI-compatible endpoint; the `openai_agent` workflow that trains on it is
rft/rollout/workflows/openai_agent.py.

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
(engines are not thread-safe); a step's agents run at once, and their requests are batched: each
waits until every open rollout has one waiting, then they go to the engine together
(rft/serving/batching.py), as the multi_turn workflow samples a turn of every conversation at once.

History (explorer.rollout_model.enable_history, default true). Every policy call's prompt ids,
sampled ids and sampling log-probs are recorded under the rollout that made it (the client sends
`X-RFT-Rollout`) and become that rollout's experiences: the ids the engine sampled, never
re-tokenised from the text the agent saw (a call whose client left before its reply, a timeout, is not
recorded: the agent never read it). Each call is one experience, unless a call's prompt ids
start with the previous call's prompt + sampled ids: then they are one experience, the loss mask 1
on both calls' sampled tokens and 0 between. That holds for an agent continuing its own token ids
through /v1/completions, and for a chat agent wherever the template renders the conversation so
far to the ids sampled (model=tiny_tools's, whose template writes nothing after <|im_end|>,
tool calls included: rft/serving/openai_chat.py); where it re-renders them otherwise (Qwen's adds
a newline after <|im_end|> that the model never sampled) the calls are separate experiences, and
the token-exact multi-turn alternative is the multi_turn workflow
(rft/rollout/workflows/multi_turn.py). Every experience of a rollout gets the rollout's reward.

Tools, tool calls and streaming: rft/serving/openai_chat.py. A call under a rollout the workflow did not
open (no header, or one already taken) is answered and not recorded; at most MAX_OPEN_ROLLOUTS
rollouts are open at once, and opening one more drops the oldest's calls, counted and warned
about (an agent still running after the explorer gave up on its task).

Requests (OpenAI's error shape, `param` naming the field): n from 1 to 128 (OpenAI's cap), no
top_logprobs (chat) or logprobs over 0 (completions): only each sampled token's log-prob is returned,
presence/frequency/repetition penalties, min_p and logit_bias at their neutral values only (not
applied here), max_tokens at most the model's model.max_response_tokens, prompt ids inside the vocabulary (an id
outside it would take the engine down on CUDA), prompt + max_tokens within the model's context (a
text over context x the longest token's bytes, or more messages than context tokens, refused untokenised),
and every other field of the right type and range, else 400; a body over 32 MiB 413
(rft.serving.auth, with the same timeouts and connection cap as the reward server).

Seeds. A request alone is sampled with its `seed`: the same seed, prompt and sampling give the
same tokens as a direct `engine.generate(...)` call (the test compares them); requests batched
together are one engine call, in the order of their rollout keys, seeded by all their seeds, so the
same agents with the same seeds make the same batches and samples in every run. The workflow hands
each rollout a seed derived from the step's; a request without one gets a counter's (not
reproducible across runs). Sampling the request does not set comes from the taskset's
rollout_args (greedy for an eval set at temperature 0).
"""


import asyncio
import itertools
import logging
import secrets
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rft.data.chat import render
from rft.data.tool_calls import TOOL_CALL_PARSERS
from rft.registry import resolve
from rft.serving.batching import Asking, Batcher
from rft.serving.openai_chat import Message, StreamOptions, Tool, reply_message, sse, template_messages

log = logging.getLogger(__name__)

ROLLOUT_HEADER = "X-RFT-Rollout"
MAX_N = 128  # OpenAI's own cap on n: what an agent written against its API may ask for
MAX_STOP = 4  # OpenAI's cap on stop sequences
# the length rollout_args.stop allows a stop string (rft/plan/batch.py MAX_STOP_CHARS): the engine
# searches each after every token, untimed, so an unbounded one cost every rollout in the batch
MAX_STOP_CHARS = 256
MAX_TOOLS = 128  # OpenAI's cap on tools per request
MAX_OPEN_ROLLOUTS = 1024  # rollouts in flight are the explorer's runner threads: far fewer
GREEDY_BELOW = 1e-5  # a temperature this small samples greedily (as vLLM does): 1e-40 overflows logits / t
# a smaller one (not greedy) is sampled at this one, as vLLM's SamplingParams raises it (its _MAX_TEMP): the
# engines and the trainer's recomputation (the call's recorded sampling) then use the same distribution
MIN_TEMPERATURE = 0.01


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


# ---------------------------------------------------------------- what a request may say

class Sampling(BaseModel):
    """The fields of a request the endpoint reads, with OpenAI's ranges (strict types: "5" is not
    5); other fields a client sends are ignored. A field out of range is a 400 naming it."""
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = None
    # "" is in every text: it would end each completion after its first token (rollout_args.stop refuses it too)
    stop: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] | None = Field(None, max_length=MAX_STOP)
    # the reply as server-sent events (rft/serving/openai_chat.py sse)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # sampling the endpoint does not apply (the trainer recomputes log-probs under temperature,
    # top_p and top_k alone): their neutral values pass, as clients send them by default
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    min_p: float | None = Field(None, ge=0, le=1)
    logit_bias: dict[str, float] | None = None

    def unapplied(self) -> tuple[str, Any] | None:
        """The first field set to a value that would change sampling here, and that value."""
        neutral = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "min_p": 0}
        for name, value in neutral.items():
            if getattr(self, name) not in (None, value):
                return name, getattr(self, name)
        return ("logit_bias", self.logit_bias) if self.logit_bias else None

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, v):
        return [v] if isinstance(v, str) else v


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Any = None  # "auto" | "none": checked in tools_read (a 400 that says why for the rest)

    def tools_read(self) -> bool:
        """Whether the reply is read for tool calls: tools were sent and tool_choice is not "none"."""
        if self.tool_choice not in (None, "auto", "none"):
            raise Invalid("tool_choice", f"tool_choice={str(self.tool_choice)[:100]}: this endpoint samples the model "
                                         f"freely and cannot force a tool call; send \"auto\" or \"none\"")
        return bool(self.tools) and self.tool_choice != "none"

    def alternatives(self) -> tuple[str, int]:
        return "top_logprobs", self.top_logprobs or 0


class CompletionRequest(Sampling):
    prompt: Any = None  # text or token ids: checked against the tokenizer (prompt_ids)
    logprobs: int | None = Field(None, ge=0, le=5)

    def alternatives(self) -> tuple[str, int]:
        return "logprobs", self.logprobs or 0


class Refusal(Exception):
    """A request the endpoint answers with an error, in OpenAI's shape (`param` names the field)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param


class Invalid(Refusal):
    """A request field the endpoint refuses: a 400 naming it."""

    def __init__(self, param: str, message: str):
        super().__init__(400, message, param=param)


def parsed(kind: type[Sampling], body) -> Sampling:
    """The request `body` (parsed JSON) as `kind`, or Invalid naming the first field that is wrong."""
    if not isinstance(body, dict):
        raise Invalid("body", f"the request body must be a JSON object, not {type(body).__name__}")
    try:
        return kind.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in err["loc"]).lstrip(".")
        raise Invalid(str(err["loc"][0]) if err["loc"] else "body",
                      f"{where}: {err['msg']} (got {str(err.get('input'))[:100]})") from None


def prompt_ids(tok, prompt, limits: "Limits | None" = None) -> list[int]:
    """/v1/completions' prompt as token ids: text (encoded without special tokens), or ids, or
    either as a one-entry list (what the client sends for one prompt); a text too long for
    `limits`' context is refused before it is encoded."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        if limits is not None:
            limits.check_text(prompt, "prompt")
        return tok.encode(prompt, add_special_tokens=False)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    raise Invalid("prompt", f"prompt must be one non-empty text or list of token ids (one prompt per request), "
                            f"not {str(prompt)[:100]}")


@dataclass
class Limits:
    """What a served model takes: `budget` new tokens at most (its max_response_tokens), ids below
    `vocab`, prompt + new tokens within `context` (None: its engine does not say). `token_bytes`:
    the UTF-8 length of the vocabulary's longest token (special ones included), so that a prompt
    text of more than context x token_bytes bytes cannot fit and is refused before it is tokenised
    (20 MB of text took 20 s of CPU to tokenise, to be refused as over a context of 256 tokens)."""
    budget: int
    vocab: int
    context: int | None
    token_bytes: int = 0

    @classmethod
    def of(cls, engine, tok, default_budget: int) -> "Limits":
        inner = getattr(engine, "engine", engine)  # an auxiliary model wraps its engine
        budget = getattr(inner, "max_response_tokens", None) or getattr(engine, "max_tokens", None) or default_budget
        llm_config = getattr(getattr(inner, "llm", None), "model_config", None)  # vLLM
        hf_config = getattr(getattr(inner, "model", None), "config", None)
        vocab = min(len(tok), getattr(hf_config, "vocab_size", None) or len(tok))
        # a byte-level token's text is one character per byte; a sentencepiece one's is longer than its text
        token_bytes = max((len(t.encode()) for t in tok.get_vocab()), default=0)
        if llm_config is not None:
            vocab = min(vocab, llm_config.get_vocab_size())
            return cls(budget, vocab, llm_config.max_model_len, token_bytes)
        return cls(budget, vocab, getattr(hf_config, "max_position_embeddings", None), token_bytes)

    def check_text(self, text: str, param: str) -> None:
        """Refuse a prompt text too long to fit the context, whatever its tokens (see token_bytes)."""
        if self.context is None or not self.token_bytes:
            return
        limit = self.context * self.token_bytes
        if len(text) > limit and len(text.encode()) > limit:  # len(text) <= its UTF-8 length: no encode below
            raise Invalid(param, f"the prompt's {len(text.encode())} bytes of text are over the {limit} bytes that "
                                 f"can fit the model's context of {self.context} tokens ({self.token_bytes} bytes "
                                 f"per token at most); it was not tokenised")

    def check(self, prompt: list[int], max_tokens: int, asked: bool) -> None:
        """Invalid when the request would index outside the model (a CUDA device assert takes the
        explorer down) or run past its budget or context."""
        if asked and max_tokens > self.budget:
            raise Invalid("max_tokens", f"max_tokens={max_tokens} is over this model's budget of {self.budget} new "
                                        f"tokens (model.max_response_tokens)")
        bad = next((t for t in prompt if not 0 <= t < self.vocab), None)
        if bad is not None:
            raise Invalid("prompt", f"prompt: token id {bad} is outside the vocabulary (0 <= id < {self.vocab})")
        if self.context is not None and len(prompt) + max_tokens > self.context:
            raise Invalid("max_tokens" if asked else "prompt",
                          f"the prompt's {len(prompt)} tokens and max_tokens={max_tokens} are over the model's "
                          f"context of {self.context} tokens")


def tool_parsers(cfg) -> dict[str, str]:
    """Each served model's model.tool_call_parser: the policy's and the auxiliary models'."""
    return {"policy": cfg.model.tool_call_parser,
            **{a.name: a.model.tool_call_parser for a in cfg.explorer.auxiliary_models}}


# ---------------------------------------------------------------- the server

class OpenAIServer:
    """`models`: name -> (engine, tokenizer); `policy` the trained one (its calls are recorded);
    `defaults` the sampling of requests that do not set it; `max_tokens` the default budget;
    `tool_parsers` name -> the model's model.tool_call_parser (default hermes).

    History: `open(key)` before a rollout, `take_history(key)` after. The calls of a key nobody
    opened are served and not recorded; at most `max_rollouts` keys are open: opening one more drops
    the oldest (counted in `dropped_rollouts`, with a warning), a rollout whose history was never
    taken (its agent still running past the explorer's timeout)."""

    def __init__(self, models: dict, policy: str, defaults, max_tokens: int, history: bool = True,
                 host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 max_rollouts: int = MAX_OPEN_ROLLOUTS, tool_parsers: dict[str, str] | None = None):
        self.models, self.policy, self.defaults, self.max_tokens = models, policy, defaults, max_tokens
        self.parsers = {name: resolve(TOOL_CALL_PARSERS, (tool_parsers or {}).get(name, "hermes"),
                                      "model.tool_call_parser" if name == policy else
                                      f"the auxiliary model {name}'s model.tool_call_parser") for name in models}
        self.history_on, self.host, self.port = history, host, port
        self.token = token or secrets.token_urlsafe(32)
        # one engine call at a time per model, each request batched with the other rollouts' (batching.py)
        self.asking = Asking(self._open)
        self.batchers = {name: Batcher(engine, self.asking) for name, (engine, _) in models.items()}
        # a thread for each request the server lets in, as each waits in its batch for every open
        # rollout's: anyio's default pool of 40 threads held the rest back (the calculator study's
        # 128 agents went in batches of 40, each cut by the idle timeout)
        from rft.serving.auth import MAX_CONNECTIONS

        self.pool = ThreadPoolExecutor(max_workers=MAX_CONNECTIONS, thread_name_prefix="openai-api")
        self.limits = {name: Limits.of(engine, tok, max_tokens) for name, (engine, tok) in models.items()}
        contexts = [lim.context for lim in self.limits.values()]
        self.max_messages = None if None in contexts else max(contexts)
        self.rollouts: OrderedDict[str, tuple[object, list[Call]]] = OrderedDict()  # key -> (defaults, calls)
        self.max_rollouts, self.dropped_rollouts = max_rollouts, 0
        self.seeds = itertools.count(1)
        self.guard = threading.Lock()
        self.server = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    # ------------------------------------------------------------ lifecycle

    def start(self) -> "OpenAIServer":
        import uvicorn

        from rft.serving.auth import server_config

        self.server = uvicorn.Server(server_config(self.app(), host=self.host, port=self.port, token=self.token,
                                                   log_level="warning"))
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
        """Record the policy calls of `rollout`, sampled with `defaults` where they do not say otherwise."""
        with self.guard:
            self.rollouts[rollout] = (defaults, [])
            self.rollouts.move_to_end(rollout)
            while len(self.rollouts) > self.max_rollouts:
                oldest, (_, calls) = self.rollouts.popitem(last=False)
                self.dropped_rollouts += 1
                log.warning("OpenAI endpoint: rollout %r was opened and its calls never taken; dropped its %d calls "
                            "to keep %d rollouts open at most (%d dropped so far)", oldest, len(calls),
                            self.max_rollouts, self.dropped_rollouts)
        self._poke()

    def take_history(self, rollout: str) -> list[Call]:
        """The policy calls `rollout` made, in order (and forget them)."""
        with self.guard:
            calls = self.rollouts.pop(rollout, (None, []))[1]
        self._poke()
        return calls

    def _open(self) -> list[str]:
        with self.guard:
            return list(self.rollouts)

    def _poke(self) -> None:
        """The open rollouts changed: the batches waiting for them may be complete."""
        for b in self.batchers.values():
            b.poke()

    # ------------------------------------------------------------ serving

    def _sample(self, req: Sampling, prompt: list[int], rollout: str) -> list[Call]:
        model = req.model
        tok = self.models[model][1]
        with self.guard:
            base = self.rollouts[rollout][0] if rollout in self.rollouts else self.defaults
        stop = req.stop if req.stop is not None else list(getattr(base, "stop", []) or [])
        temperature = base.temperature if req.temperature is None else req.temperature
        asked = req.max_completion_tokens or req.max_tokens
        args = SimpleNamespace(
            temperature=0.0 if temperature < GREEDY_BELOW else max(temperature, MIN_TEMPERATURE),
            top_p=base.top_p if req.top_p is None else req.top_p, top_k=base.top_k if req.top_k is None else req.top_k,
            stop=list(stop), max_tokens=asked or base.max_tokens or self.max_tokens)
        self.limits[model].check(prompt, args.max_tokens, bool(asked))
        seed = req.seed if req.seed is not None else next(self.seeds)
        group = self.batchers[model].generate(rollout, prompt, req.n, args, seed % (2**31))
        sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
        prompt_text = tok.decode(prompt, skip_special_tokens=True)
        calls = [Call(list(prompt), list(s.token_ids), list(s.logprobs), s.finish_reason, dict(sampling), prompt_text,
                      tok.decode(s.token_ids, skip_special_tokens=True), rollout) for s in group]
        return calls

    def _record(self, model: str, rollout: str, calls: list[Call]) -> None:
        """The policy's `calls` become `rollout`'s history (if it is open)."""
        if model == self.policy and self.history_on:
            with self.guard:
                if rollout in self.rollouts:
                    self.rollouts[rollout][1].extend(calls)

    async def _checked(self, request, kind: type[Sampling], expected: bytes) -> Sampling:
        """The request as `kind`, its model set; a Refusal for a 401, 404 or 400."""
        from rft.serving.auth import bearer_refusal

        denied = bearer_refusal(request, expected, "the explorer's token (the workflow's client has it)")
        if denied is not None:
            raise Refusal(401, "refused: " + denied.body.decode().split("refused: ", 1)[-1].rstrip('"}'))
        try:
            body = await request.json()
        except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError; nested too deep
            raise Invalid("body", f"malformed JSON: {e}") from None
        messages = body.get("messages") if isinstance(body, dict) else None
        if isinstance(messages, list) and self.max_messages is not None and len(messages) > self.max_messages:
            # checked before they are validated, on the event loop every agent's request shares:
            # 1,000,000 messages (30 MB) took 4 s there; each message's role markers are a token at least
            raise Invalid("messages", f"{len(messages)} messages cannot fit the served models' context of "
                                      f"{self.max_messages} tokens (a message is one token at least)")
        req = parsed(kind, body)
        field, k = req.alternatives()
        if k:  # answered with none, they would read as "no alternative was likely" (was: silently)
            raise Invalid(field, f"{field}={k}: this endpoint returns the log-prob of each sampled token only, not "
                                 f"the most likely alternatives; send {field}=0 or leave it out")
        unapplied = req.unapplied()
        if unapplied:  # sampled without it, the agent would get (and train on) other text than it asked for
            name, value = unapplied
            raise Invalid(name, f"{name}={str(value)[:100]}: this endpoint samples by temperature, top_p, top_k and "
                                f"seed only (the trainer recomputes each token's log-prob under those); leave "
                                f"{name} out or send its neutral value")
        req.model = req.model or self.policy
        if req.model not in self.models:
            raise Refusal(404, f"model {req.model!r} is not served here; the models are {sorted(self.models)}",
                          "not_found_error", "model")
        return req

    async def _sampled(self, request, req: Sampling, prompt) -> tuple[list[int], list[Call]]:
        """(the prompt's ids, the calls): `prompt()` renders or tokenises it, which may take seconds
        (20,000 messages: 5 s), on a worker thread as the engine call, never on the event loop
        that every other agent's request waits on. A client gone before the reply (its timeout, an
        asyncio cancel) never sees it: its calls are not recorded, so the rollout does not train on
        samples its agent never read (a retry after a timeout made two experiences of one turn)."""
        rollout = request.headers.get(ROLLOUT_HEADER, "")

        def work():
            ids = prompt()
            return ids, self._sample(req, ids, rollout)

        ids, calls = await asyncio.get_running_loop().run_in_executor(self.pool, work)
        if await request.is_disconnected():
            log.info("OpenAI endpoint: the client of rollout %r left before its reply; its %d samples are not "
                     "recorded", rollout, len(calls))
        else:
            self._record(req.model, rollout, calls)
        return ids, calls

    def app(self):
        from fastapi import FastAPI, Request

        from rft.serving.auth import MAX_BODY, BodyLimit, BodyTooLarge, bearer_refusal

        app = FastAPI(title="rft OpenAI-compatible endpoint", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_middleware(BodyLimit, limit=MAX_BODY)
        expected = self.token.encode()

        @app.exception_handler(BodyTooLarge)
        async def too_large(request, e):
            return _error(Refusal(413, e.detail), headers=e.headers)

        @app.exception_handler(Refusal)
        async def refused(request, e):
            return _error(e)

        @app.get("/v1/models")
        async def models(request: Request):
            denied = bearer_refusal(request, expected, "the explorer's token")
            return denied or {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "rft"} for m in self.models]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            req = await self._checked(request, ChatRequest, expected)
            tok, read, limits = self.models[req.model][1], req.tools_read(), self.limits[req.model]
            prompt, calls = await self._sampled(request, req, lambda: chat_prompt(tok, req.messages, req.tools, limits))
            choices = []
            for i, c in enumerate(calls):
                message, finish = reply_message(c.response_text, c.finish_reason, self.parsers[req.model], read)
                choices.append({"index": i, "message": message, "finish_reason": finish,
                                "logprobs": _logprobs(tok, c, True) if req.logprobs else None})
            return _reply(req, {"id": f"chatcmpl-{secrets.token_hex(8)}", "object": "chat.completion",
                                "created": int(time.time()), "model": req.model, "usage": _usage(prompt, calls),
                                "choices": choices})

        @app.post("/v1/completions")
        async def completions(request: Request):
            req = await self._checked(request, CompletionRequest, expected)
            tok = self.models[req.model][1]
            prompt, calls = await self._sampled(request, req, lambda: prompt_ids(tok, req.prompt, self.limits[req.model]))
            return _reply(req, {"id": f"cmpl-{secrets.token_hex(8)}", "object": "text_completion",
                                "created": int(time.time()), "model": req.model, "usage": _usage(prompt, calls),
                                "choices": [{"index": i, "text": c.response_text, "finish_reason": c.finish_reason,
                                             "logprobs": _logprobs(tok, c, False) if req.logprobs is not None else None}
                                            for i, c in enumerate(calls)]})

        return app


def _error(e: Refusal, headers=None):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": str(e), "type": e.kind, "param": e.param, "code": e.status}},
                        status_code=e.status, headers=headers)


def _reply(req: Sampling, reply: dict):
    """The reply as JSON, or streamed (`stream: true`) as server-sent events."""
    if not req.stream:
        return reply
    from fastapi.responses import StreamingResponse

    usage = bool(req.stream_options and req.stream_options.include_usage)
    return StreamingResponse(sse(reply, usage), media_type="text/event-stream")


def _usage(prompt, calls) -> dict:
    done = sum(len(c.token_ids) for c in calls)
    return {"prompt_tokens": len(prompt), "completion_tokens": done, "total_tokens": len(prompt) + done}


def _logprobs(tok, c: Call, chat: bool) -> dict:
    if chat:
        return {"content": [{"token": tok.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
                            for t, lp in zip(c.token_ids, c.logprobs)]}
    return {"tokens": [tok.decode([t]) for t in c.token_ids], "token_logprobs": c.logprobs,
            "top_logprobs": None, "text_offset": None}


def chat_prompt(tok, messages: list[Message], tools: list[Tool] | None = None,
                limits: Limits | None = None) -> list[int]:
    """The chat template's ids of `messages` (and `tools`) and the generation prompt; a template
    that cannot render them (a Jinja error, a content it does not take) is the request's error. The
    rendered text is first measured against `limits`: rendering is cheap (1,000,000 messages: 0.2 s),
    tokenising is not (14 s), and a text too long to fit is refused untokenised."""
    try:
        rendered = template_messages(messages)
    except ValueError as e:
        raise Invalid("messages", str(e)) from None
    schemas = [t.model_dump(exclude_unset=True) for t in tools] if tools else None
    try:
        if limits is not None:
            limits.check_text(tok.apply_chat_template(rendered, tools=schemas, tokenize=False,
                                                      add_generation_prompt=True), "messages")
        return render(tok, rendered, generation_prompt=True, tools=schemas)
    except Invalid:
        raise
    except Exception as e:
        raise Invalid("messages", f"messages: the chat template cannot render them: {type(e).__name__}: {e}") from None
