"""Tool calls in a model's text: the parsers, one per way models write them.

A parser is `fn(text) -> (content, calls)`: the text outside the calls, and the calls in order
(`[]`: the text calls none). A call whose JSON does not parse is returned with `error` set, so a
caller can answer it with the reason (rft/rollout/environments/tools.py) or return the whole text
as plain content (the OpenAI endpoint, rft/serving/openai_api.py).

model.tool_call_parser names the one a model's replies are read with on the OpenAI endpoint:

    hermes    <tool_call>{"name": ..., "arguments": {...}}</tool_call>, several in one turn
              (Qwen2.5/3, Hermes, and model=tiny_tools, which writes the JSON compact)
    mistral   [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]

or the dotted path of a study's own function of the same signature.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from rft.registry import Registry


@dataclass
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)
    # set when the call could not be parsed: the call fails with this reason
    error: str | None = None


_TAGGED = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)  # an unclosed last one too
_MISTRAL = re.compile(r"\[TOOL_CALLS\]\s*(\[.*\])", re.S)


def _call_of(obj) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", error=f"a tool call needs a JSON object with a \"name\"; got {json.dumps(obj)[:80]}")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # OpenAI's wire format carries the arguments as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError) as e:
            return ToolCall(obj["name"], error=f"the arguments are not JSON ({_why(e)}): {args[:80]!r}")
    if not isinstance(args, dict):
        return ToolCall(obj["name"], error=f"the arguments must be a JSON object; got {json.dumps(args)[:80]}")
    return ToolCall(obj["name"], args)


def _why(e: Exception) -> str:
    # a RecursionError, not a failed task: "[[[[..." is a model's (degenerate) text like any other
    return "nested too deep" if isinstance(e, RecursionError) else e.args[0].split(":")[0]


def hermes(text: str) -> tuple[str, list[ToolCall]]:
    """`<tool_call>{json}</tool_call>` calls ("parameters" is taken for "arguments", which may also
    be a JSON string); the content is the text around them."""
    calls = []
    for body in _TAGGED.findall(text):
        try:
            calls.append(_call_of(json.loads(body.strip())))
        except (ValueError, RecursionError) as e:
            calls.append(ToolCall("", error=f"the tool call is not valid JSON ({_why(e)}): {body.strip()[:80]!r}"))
    return (_TAGGED.sub("", text).strip() if calls else text), calls


def mistral(text: str) -> tuple[str, list[ToolCall]]:
    """`[TOOL_CALLS][{...}, ...]`; the content is the text before it."""
    m = _MISTRAL.search(text)
    if not m:
        return text, []
    try:
        items = json.loads(m.group(1))
    except (ValueError, RecursionError) as e:
        return text, [ToolCall("", error=f"the tool calls are not valid JSON ({_why(e)}): {m.group(1)[:80]!r}")]
    return text[: m.start()].strip(), [_call_of(o) for o in (items if isinstance(items, list) else [items])]


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls in an assistant turn, in order, in either format (hermes first); [] when it
    calls none. What the multi-turn environments read (any model's turns)."""
    return hermes(text)[1] or mistral(text)[1]


# model.tool_call_parser: name -> fn(text) -> (content, calls)
TOOL_CALL_PARSERS = Registry("model.tool_call_parser", {
    "hermes": "rft.data.tool_calls.hermes",
    "mistral": "rft.data.tool_calls.mistral",
}, shape="a function text -> (content, list of ToolCall) (module.function)")
