"""An LLM judge through an OpenAI-compatible chat-completions API: the served reward `judge`.

    buffer.explorer_input.taskset.reward_fn:
      - {fn: math, weight: 1.0}
      - {fn: judge, weight: 0.2, args: {base_url: "http://127.0.0.1:8001/v1", model: Qwen/Qwen2.5-7B-Instruct}}

or on the command line: 'buffer.explorer_input.taskset.reward_fn=[{fn: judge, args: {base_url:
"https://api.openai.com/v1", model: gpt-4o-mini}}]' (the key from $OPENAI_API_KEY). Any server that
speaks POST <base_url>/chat/completions works: OpenAI, vLLM (`vllm serve <model>`), SGLang, llama.cpp.
Each response is one request at temperature 0 (the API has no batch), a group's requests go out
concurrently up to `max_concurrency`, and each is retried like the `remote` reward's
(`rft.rewards.remote.RetryingHTTP`). Arguments and how the score is read: `JudgeReward`.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

from rft.errors import ConfigError
from rft.reporting.redact import MASK
from rft.rewards.remote import RetryingHTTP, bearer_header
from rft.rewards.scoring import check_template

log = logging.getLogger(__name__)

DEFAULT_SCORE_TEMPLATE = (
    "You are grading a response to a question.\n\n"
    "Question:\n{question}\n\n"
    "Reference answer (may be empty):\n{answer}\n\n"
    "Response:\n{response}\n\n"
    "How correct and complete is the response? Reason briefly if you need to, then end your reply with "
    "a last line of the form \"Score: N\", N an integer from 0 (wrong) to {max_score} (fully correct)."
)
DEFAULT_YES_NO_TEMPLATE = (
    "Question:\n{question}\n\n"
    "Reference answer (may be empty):\n{answer}\n\n"
    "Response:\n{response}\n\n"
    "Is the response correct? Answer with one word: yes or no."
)
FIELDS = {"prompt", "question", "response", "answer", "max_score"}
PARSERS = ("number", "yes_no")

_NUMBER = r"[-\u2212]?(?:\d+(?:\.\d+)?|\.\d+)"  # U+2212 and .5 too: "Score: −3" read 3, "Score: .5" 5
_SCORE = re.compile(r"score[^\w\-\u2212]{0,5}?(" + _NUMBER + ")", re.I)  # "Score: 7", "**Score:** 7/10", "score = 7"
# a number with its scale ("7/10", "7 out of 10") is the number: the scale, the last number, read 10 (1.0)
_ANY_NUMBER = re.compile("(" + _NUMBER + r")(?:\s*(?:/|out of)\s*\d+(?:\.\d+)?)?", re.I)
_YES_NO = re.compile(r"\b(yes|no)\b", re.I)


def parse_number(reply: str, max_score: float = 10.0) -> float | None:
    """The judge's score in [0, 1]: the last "Score: N" of the reply (else its last number, a scale
    after it read as one: "7/10" and "7 out of 10" are 7),
    clamped to [0, max_score] and divided by max_score; None when the reply has no number.
    A reasoning model's `<think>...</think>` is dropped first."""
    text = reply.rsplit("</think>", 1)[-1]
    found = _SCORE.findall(text) or _ANY_NUMBER.findall(text)
    if not found:
        return None
    return min(max(float(found[-1].replace("\u2212", "-")), 0.0), max_score) / max_score


def parse_yes_no(reply: str, max_score: float = 10.0) -> float | None:
    """1.0 when the reply's last yes/no word is yes, 0.0 when it is no, None when it has neither."""
    found = _YES_NO.findall(reply.rsplit("</think>", 1)[-1])
    return None if not found else float(found[-1].lower() == "yes")


def _question(task, prompt: str) -> str:
    """The task's last user message (the policy's prompt without its chat template), else the prompt."""
    for m in reversed(getattr(task, "messages", None) or []):
        if isinstance(m, dict) and m.get("role") == "user":
            return str(m.get("content", ""))
    return prompt


def _api_key(value: str | None) -> str | None:
    """`api_key` is the name of an environment variable (its value is taken) or the key itself."""
    if not value:
        return None
    if value == MASK:  # a saved record's masked key (rft/reporting/redact.py) composed again
        raise ConfigError("api_key is '***', a key masked in a saved record: set api_key to the name of the "
                          "environment variable that holds the key (default OPENAI_API_KEY).")
    if value in os.environ:
        return os.environ[value]
    if re.fullmatch(r"[A-Z_][A-Z0-9_]*", value):  # the name of a variable that is not set
        log.warning("judge: $%s is not set; the requests go without an Authorization header", value)
        return None
    return value


class JudgeReward:
    """The served reward `judge`: an LLM's grade of each response, in [0, 1].

    args:
        base_url         the API's base, e.g. https://api.openai.com/v1 or http://127.0.0.1:8001/v1
                         (requests go to <base_url>/chat/completions)
        model            the model name the server expects
        api_key          the name of an environment variable holding the key (default OPENAI_API_KEY;
                         unset: no Authorization header, as a local vLLM needs), or the key itself
                         (then it is saved with the run's config)
        template         the user message, a format string of {question} (the task's last user
                         message), {prompt} (the policy's prompt as decoded), {response},
                         {answer} (the reference; "" without one) and {max_score}; default
                         DEFAULT_SCORE_TEMPLATE, or DEFAULT_YES_NO_TEMPLATE with parse=yes_no
        system           a system message before it (default none)
        parse            number: the last "Score: N" (else the last number), clamped to
                         [0, max_score], / max_score; yes_no: 1 for yes, 0 for no (the last such word);
                         or the dotted path of a function `(reply, max_score) -> float | None`
        max_score        the top of the judge's scale (default 10)
        max_tokens       the reply's token budget (default: the server's)
        temperature      0 (the same reply for the same question, where the server is deterministic)
        timeout, retries, backoff, max_backoff, max_concurrency
                         as the `remote` reward's (rft.rewards.remote.RemoteReward); defaults 60 s, 3,
                         0.5 s, 8 s, 8 requests in flight

    A reply the parser cannot read scores 0 and is counted (`unparsed`); a reply with no text (content
    null: a reasoning judge out of max_tokens, a tool call) and a request that fails after its
    retries fail the task (the explorer retries it, then counts it). Counters, logged as
    reward/<part>/<counter>: requests (one per response), retries, timeouts, failures, unparsed.
    """

    def __init__(self, base_url: str, model: str, api_key: str | None = "OPENAI_API_KEY", template: str | None = None,
                 system: str | None = None, parse: str = "number", max_score: float = 10.0,
                 max_tokens: int | None = None, temperature: float = 0.0, timeout: float = 60.0, retries: int = 3,
                 backoff: float = 0.5, max_backoff: float = 8.0, max_concurrency: int = 8):
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"base_url={base_url!r}: give the API's base URL, e.g. http://127.0.0.1:8001/v1.")
        if not isinstance(model, str) or not model:
            raise ConfigError(f"model={model!r}: give the model name the server serves.")
        if isinstance(max_score, bool) or not isinstance(max_score, (int, float)) or max_score <= 0:
            raise ConfigError(f"max_score={max_score!r} must be a number > 0.")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
            raise ConfigError(f"max_tokens={max_tokens!r} must be an integer >= 1 (or null).")
        self.parse = _parser(parse)
        template = template if template is not None else (
            DEFAULT_YES_NO_TEMPLATE if parse == "yes_no" else DEFAULT_SCORE_TEMPLATE)
        _check_template(template)
        base = base_url.rstrip("/")
        self.url = base if base.endswith("/chat/completions") else base + "/chat/completions"
        self.model, self.template, self.system = model, template, system
        self.max_score, self.max_tokens, self.temperature = float(max_score), max_tokens, float(temperature)
        headers = bearer_header(_api_key(api_key), "the judge's API key (api_key, or the variable it names)",
                                "give the key as its provider issued it")
        # the key itself is never shown: this hint ends up in logs
        named = repr(api_key) if api_key is None or re.fullmatch(r"[A-Z_][A-Z0-9_]*", str(api_key)) else "a key, not a name"
        hint = (f"Check the API key: api_key names an environment variable (now {named}) that must hold a key "
                f"this server accepts.")
        self.http = RetryingHTTP(timeout=timeout, retries=retries, backoff=backoff, max_backoff=max_backoff,
                                 max_concurrency=max_concurrency, auth_hint=hint, headers=headers)
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="judge")
        self._lock = threading.Lock()
        self._unparsed = 0

    def messages(self, prompt: str, response: str, task) -> list[dict]:
        answer = getattr(task, "answer", None)
        text = self.template.format(prompt=prompt, question=_question(task, prompt), response=response,
                                    answer="" if answer is None else str(answer), max_score=f"{self.max_score:g}")
        return ([{"role": "system", "content": self.system}] if self.system else []) + [{"role": "user", "content": text}]

    def body(self, prompt: str, response: str, task) -> dict:
        body = {"model": self.model, "messages": self.messages(prompt, response, task), "temperature": self.temperature}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        return body

    def score_one(self, prompt: str, response: str, task) -> float:
        answer = self.http.request("POST", self.url, json_body=self.body(prompt, response, task))
        try:
            choice = answer["choices"][0]
            reply = choice["message"]["content"]
        except (KeyError, IndexError, TypeError):
            self.http.count("failures")
            raise ValueError(f"POST {self.url}: not a chat completion: {str(answer)[:300]}") from None
        if not isinstance(reply, str):
            # no text to grade (a reasoning judge cut short, a tool call): scored 0 it would count
            # as a real grade, the same for every response of a judge that is always cut short
            self.http.count("failures")
            raise ValueError(f"POST {self.url}: the judge's reply has no text ({_why_no_text(reply, choice, self.max_tokens)})")
        value = self.parse(reply, self.max_score)
        if value is None:
            with self._lock:
                self._unparsed += 1
            log.debug("judge: no score in the reply %r", reply)
            return 0.0
        return float(value)

    def __call__(self, prompt: str, responses: list[str], task) -> list[float]:
        if len(responses) <= 1:
            return [self.score_one(prompt, r, task) for r in responses]
        futures = [self._pool.submit(self.score_one, prompt, r, task) for r in responses]
        wait(futures, return_when=FIRST_EXCEPTION)
        for f in futures:  # one response failed: the group fails, the ones not yet asked are not
            f.cancel()
        wait(futures)  # those being asked finish (within their timeouts and retries), their counts complete
        errors = [f.exception() for f in futures if not f.cancelled() and f.exception() is not None]
        if errors:
            raise errors[0]
        return [f.result() for f in futures]

    def take_counters(self) -> dict:
        out = self.http.take_counters()
        with self._lock:
            out["unparsed"], self._unparsed = self._unparsed, 0
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.http.close()


def _why_no_text(reply, choice, max_tokens) -> str:
    """What a chat completion without a text reply says about why."""
    finish = choice.get("finish_reason") if isinstance(choice, dict) else None
    why = f"content {str(reply)[:100]}, finish_reason {finish!r}"
    if finish == "length":
        limit = f"max_tokens={max_tokens}" if max_tokens else "the server's default max_tokens"
        return f"{why}: it ran out of {limit} before its answer; raise max_tokens"
    return why


def _parser(parse):
    if parse == "number":
        return parse_number
    if parse == "yes_no":
        return parse_yes_no
    if isinstance(parse, str) and "." in parse:
        module, _, name = parse.rpartition(".")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"parse={parse!r}: cannot import it ({type(e).__name__}: {e}).") from None
    raise ConfigError(f"parse={parse!r}: choose one of {list(PARSERS)} or give the dotted path of a function "
                      f"(reply, max_score) -> float | None.")


def _check_template(template) -> None:
    check_template(template, FIELDS, "the judge")
