"""Environments for the multi-turn workflow (rft/rollout/workflows/multi_turn.py), their tools, and the tool-call parser.

An environment is a small class: the workflow makes one per conversation (`env(**env_args)`) and
calls

    reset(task)        -> the first message(s): a str (a user message), a message dict, or a list
                          of them (a system prompt first, say)
    step(text)         -> (message | None, reward parts, done): `text` is the assistant's turn as
                          decoded; `message` the reply (a str is a user message; a dict may have any
                          role the chat template knows, "tool" for a tool's answer); the parts are
                          {name: value} added to the conversation's reward (each name summed over
                          the turns; the reward is the sum of all of them)
    stop               -> strings that end an assistant turn (kept in it), e.g. "</tool_call>", so
                          the model stops to wait for the tool's answer
    info               -> a dict the workflow stores with the conversation (counters such as
                          tool_calls and tool_failures, logged as rollout/<name>)

`ToolEnv` does the common case: the assistant either calls tools (parsed by `parse_tool_calls`)
and gets their answers as a "tool" message, or answers, which ends the conversation and is scored
against the task's answer. A tool is a plain function of its JSON arguments returning a string; it
raises `ToolError(reason)` for a call that fails (the reason goes back to the model, and the call
is counted in info["tool_failures"]). Two worked environments: `CalculatorEnv` (an arithmetic
evaluator, no eval) and `PythonEnv`, whose code runs in a sandbox (rft/rollout/environments/sandbox.py), never in
the explorer's process.
"""

from __future__ import annotations

import ast
import operator

# the parsers are shared with the OpenAI endpoint (rft/data/tool_calls.py); named here as before
from rft.data.tool_calls import ToolCall, parse_tool_calls  # noqa: F401
from rft.registry import Registry
from rft.rewards.verifiers import exact_match


class ToolError(Exception):
    """A tool call that failed; its message is what the model reads back."""


# ---------------------------------------------------------------- environments

class Environment:
    """The interface; subclass it (or write any class with these three methods and two attributes)."""

    stop: list[str] = []

    def __init__(self):
        self.info: dict = {}

    def reset(self, task):
        return task.messages

    def step(self, text: str):
        raise NotImplementedError


def final_answer(text: str) -> str:
    """The answer in an assistant turn that calls no tool: its text, stripped."""
    return text.strip()


class ToolEnv(Environment):
    """Tools until the model answers; the answer scores `correct` (exact match with task.answer).

    `tools`: name -> fn(**arguments) -> str. `max_tool_calls`: calls allowed per conversation;
    past it, a call is answered with an error and counted as failed.
    """

    stop = ["</tool_call>"]
    tools: dict = {}

    def __init__(self, max_tool_calls: int = 4):
        super().__init__()
        self.max_tool_calls = max_tool_calls
        self.info = {"tool_calls": 0, "tool_failures": 0, "tool_errors": []}

    def reset(self, task):
        self.task = task
        return task.messages

    def call(self, c: ToolCall) -> str:
        self.info["tool_calls"] += 1
        try:
            if c.error:
                raise ToolError(c.error)
            if self.info["tool_calls"] > self.max_tool_calls:
                raise ToolError(f"no more tool calls: {self.max_tool_calls} per conversation")
            if c.name not in self.tools:
                raise ToolError(f"unknown tool {c.name[:80]!r}; the tools are {sorted(self.tools)}")
            try:
                return str(self.tools[c.name](**c.arguments))
            except TypeError as e:  # wrong argument names
                raise ToolError(f"{c.name}: {e}") from None
        except ToolError as e:
            self.info["tool_failures"] += 1
            self.info["tool_errors"].append(str(e))
            return f"error: {e}"

    def step(self, text: str):
        calls = parse_tool_calls(text)
        if calls:
            return {"role": "tool", "content": "\n".join(self.call(c) for c in calls)}, {}, False
        return None, {"correct": exact_match("", final_answer(text), self.task)}, True


# the largest result the calculator computes: a tower of powers (((10**64)**64)**64)**64 ran for
# hours in the explorer's process; 1000 digits are 3322 bits
MAX_DIGITS, _MAX_BITS = 1000, 3322
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """An arithmetic expression's value ("37*48" -> "1776"): numbers, + - * / // % ** and
    parentheses, evaluated from its syntax tree (never `eval`); integers stay exact, and a whole
    float prints without ".0"."""
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ToolError("exponent too large (at most 64)")
            _check_size(node.op, left, right)
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ToolError(f"not arithmetic: {expression!r} (numbers, + - * / // % ** and parentheses only)")

    try:
        value = ev(ast.parse(str(expression), mode="eval"))
    except SyntaxError:
        raise ToolError(f"not an expression: {expression!r}") from None
    except (RecursionError, MemoryError):  # the parser's or ev's stack: "-" * 100000 + "1"
        raise ToolError("not an expression: nested too deep") from None
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except OverflowError as e:  # a float past 1.8e308, an int too large to divide as one
        raise ToolError(f"the result is out of range ({e.args[-1]})") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _check_size(op, left, right) -> None:
    """ToolError before an integer product or power past MAX_DIGITS is computed (its bits
    estimated from the operands')."""
    if not (type(left) is int and type(right) is int):
        return
    if isinstance(op, ast.Pow) and right > 0:
        bits = max(abs(left).bit_length() - 1, 0) * right
    elif isinstance(op, ast.Mult):
        bits = abs(left).bit_length() + abs(right).bit_length()
    else:
        return
    if bits > _MAX_BITS:
        raise ToolError(f"the result is too large (over {MAX_DIGITS} digits)")


class CalculatorEnv(ToolEnv):
    """The calculator tool: `{"name": "calculator", "arguments": {"expression": "37*48"}}`."""

    tools = {"calculator": calculate}


def run_python(code: str, timeout_s: float = 5.0, memory_mb: int = 512, allow_unisolated: bool = False) -> str:
    """The `python` tool: runs `code` in the sandbox (rft/rollout/environments/sandbox.py) and answers its output; a run
    that fails, is killed or is refused answers the reason (a failed tool call)."""
    from rft.rollout.environments import sandbox
    r = sandbox.run_python(str(code), timeout_s=timeout_s, memory_mb=memory_mb, allow_unisolated=allow_unisolated)
    if not r.ok:
        raise ToolError(r.reason)
    return r.stdout.strip()


class PythonEnv(ToolEnv):
    """The code tool: `{"name": "python", "arguments": {"code": "print(37*48)"}}`; the code runs in
    a sandbox (rft/rollout/environments/sandbox.py: namespaces, time, memory, process and output limits, no network).
    Where this machine cannot make one, building the environment raises ConfigError saying how to
    get it, unless `allow_unisolated` (a trusted machine only: rlimits and the audit hook alone).
    """

    def __init__(self, max_tool_calls: int = 4, timeout_s: float = 5.0, memory_mb: int = 512,
                 allow_unisolated: bool = False):
        super().__init__(max_tool_calls)
        self.check_config(allow_unisolated=allow_unisolated)
        self.tools = {"python": lambda code: run_python(code, timeout_s, memory_mb, allow_unisolated)}


    @staticmethod
    def check_config(allow_unisolated: bool = False, **_) -> None:
        """Called with env_args when the run is planned (rft.rollout.workflows.multi_turn.check_args), so a machine
        without a sandbox stops before anything starts, not after max_failed_steps of failed tasks."""
        from rft.rollout.environments import sandbox

        sandbox.check(allow_unisolated)


# workflow_args.env: a name here, or the dotted path of a class with the same methods
# (`shape`: an unknown name was told to give "a function with the same signature", for a class)
ENVIRONMENTS = Registry("workflow_args.env", {
    "calculator": "rft.rollout.environments.tools.CalculatorEnv",
    "python": "rft.rollout.environments.tools.PythonEnv",
}, shape="an environment class with reset(task) and step(text) (module.Class; rft/rollout/environments/tools.py)")
