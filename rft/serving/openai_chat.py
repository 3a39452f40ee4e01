"""What the OpenAI endpoint's chat requests and replies carry besides text (rft/serving/openai_api.py
serves them): tools, tool calls and tool results, and the streamed form of a reply.

Tools. A request's `tools` (`[{"type": "function", "function": {"name", "description",
"parameters"}}]`) are handed to the model's chat template (transformers' `apply_chat_template(...,
tools=...)`; a template that does not use them renders the conversation without them). The reply is
read with the model's tool-call parser (model.tool_call_parser, rft/data/tool_calls.py); when it
holds calls that all parse, the choice's message carries them in OpenAI's shape (`id`, `type:
function`, `function: {name, arguments}`, the arguments a JSON string), its content is the text
around them (None when there is none), and its finish_reason is "tool_calls". A reply whose calls
do not parse is plain content, as a model's text. `tool_choice`: "auto" (the default) or "none"
(the tools are rendered and the reply is not read for calls); "required" or a named function is a
400: the endpoint samples freely and cannot force a call.

Sent back. An assistant message with `tool_calls` (arguments a JSON string, as the client got them)
is rendered with its arguments as JSON objects, the convention of chat templates (vLLM does the
same); a `tool` message (with its `tool_call_id`) as the template renders that role. A template that
writes calls as the model samples them (model=tiny_tools's, Qwen's) renders the reply to the ids
that were sampled, so the next call's prompt continues them and the openai_agent workflow merges the
calls into one experience (the tool's answer masked out).

Streaming (`stream: true`). The reply is sampled whole (the engines return whole samples), then sent
as server-sent events in OpenAI's chunk shape: per choice a chunk with the role, one with the content
(and its log-probs), one with the tool calls, one with the finish_reason; the usage in a last chunk
when `stream_options.include_usage`; then `data: [DONE]`.
"""

from __future__ import annotations

import json
import logging
import secrets
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)


class Function(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["function"]
    function: Function


class CalledFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: str
    arguments: str  # JSON text, OpenAI's wire format


class CalledTool(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    tool_calls: list[CalledTool] | None = None
    tool_call_id: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


def template_messages(messages: list[Message]) -> list[dict]:
    """The messages as the chat template reads them: the fields the client sent (no None for those
    it did not), an assistant's call arguments as JSON values. ValueError naming the arguments
    that are not JSON."""
    out = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_unset=True)
        for j, call in enumerate(d.get("tool_calls") or []):
            f = call["function"]
            try:
                f["arguments"] = json.loads(f["arguments"])
            except (ValueError, RecursionError) as e:  # "[[[[...": nested too deep for the reader
                raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON ({e}): "
                                 f"{f['arguments'][:100]!r}") from None
        out.append(d)
    return out


def reply_message(text: str, finish_reason: str, parser, read_calls: bool) -> tuple[dict, str]:
    """(the choice's message, its finish_reason) for a sampled `text`: its tool calls in OpenAI's
    shape where `read_calls` and the parser finds calls that all parse, else the text as content."""
    if read_calls:
        try:
            content, calls = parser(text)
        except Exception as e:  # a study's parser that raises: the text stands, never a 500
            log.warning("the tool-call parser raised %s: %s; the reply is returned as content", type(e).__name__, e)
            content, calls = text, []
        if calls and all(c.error is None for c in calls):
            return {"role": "assistant", "content": content or None, "tool_calls": [
                {"id": f"call_{secrets.token_hex(12)}", "type": "function",
                 "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False,
                                                                      separators=(",", ":"))}}
                for c in calls]}, "tool_calls"
    return {"role": "assistant", "content": text}, finish_reason


def sse(reply: dict, include_usage: bool):
    """A whole reply (chat.completion or text_completion) as OpenAI's server-sent events."""
    chat = reply["object"] == "chat.completion"
    head = {"id": reply["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": reply["created"], "model": reply["model"]}

    def event(choices, **more) -> bytes:
        return b"data: " + json.dumps({**head, "choices": choices, **more}).encode() + b"\n\n"

    for c in reply["choices"]:
        i = c["index"]
        if not chat:
            yield event([{"index": i, "text": c["text"], "logprobs": c["logprobs"], "finish_reason": None}])
        else:
            m = c["message"]
            yield event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
            if m["content"]:
                yield event([{"index": i, "delta": {"content": m["content"]}, "logprobs": c["logprobs"],
                              "finish_reason": None}])
            if m.get("tool_calls"):
                yield event([{"index": i, "delta": {"tool_calls": [{"index": k, **t} for k, t in enumerate(m["tool_calls"])]},
                              "logprobs": None, "finish_reason": None}])
        yield event([{"index": i, **({"delta": {}} if chat else {"text": ""}), "logprobs": None,
                      "finish_reason": c["finish_reason"]}])
    if include_usage:
        yield event([], usage=reply["usage"])
    yield b"data: [DONE]\n\n"
