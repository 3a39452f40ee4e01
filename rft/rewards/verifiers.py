"""Reward functions: `fn(prompt, response, task) -> float`, registered by name.

`prompt` and `response` are decoded text, `task` is the `rft.data.tasks.Task` (its `answer` is the
reference from the taskset's `response_key`, `row` the whole dataset row). Add one by writing the
function and putting it in `REWARD_FNS`; select it with
`buffer.explorer_input.default_reward_fn_type=<name>`.

- `exact_match`: the response equals the reference (both stripped).
- `last_number`: the last number of the response equals the reference's last number (GSM8K); what a
  number is (`1,000`, `.5`, `−5`, `1e16`, `1/2`) is rft/rewards/numbers.py's.
- `math`: the response's final answer (its last `\\boxed{}`) is mathematically equal to the
  reference's (the last `\\boxed{}` of a MATH solution, or a plain answer), by `math_verify`.
- `format`: the response, stripped, matches a regular expression (`args: {pattern: ...}`): a
  format reward, usually a weighted part beside a verifier (README, "Writing a reward").
- `countdown`: the response is an arithmetic expression that uses exactly the row's `numbers`
  (each once, all of them) and equals its `target` (`check_countdown` says why not).

This module imports nothing heavy: `math_verify` (and sympy) load on the first `math` call.
"""

from __future__ import annotations

import ast
import functools
import logging
import re
import threading
import unicodedata
from collections import Counter
from fractions import Fraction

from rft.registry import Registry
from rft.rewards.numbers import equal, last_value, spelling
from rft.rewards.workers import NoWorker, Workers, serve

log = logging.getLogger(__name__)

def exact_match(prompt: str, response: str, task) -> float:
    """1.0 if the response, stripped, equals the reference answer, stripped: as written (case, Unicode
    forms and inner whitespace count). A blank reference matches nothing: a blank response scored 1
    against a row whose answer was blank, a reward for saying nothing."""
    want = str(task.answer).strip()
    return float(bool(want) and response.strip() == want)


def last_number(prompt: str, response: str, task) -> float:
    """1.0 if the last number in the response equals the reference's final number.

    The reference may be a GSM8K-style solution ending in `#### 42`; its last number is used. A
    number is read as rft/rewards/numbers.py says: scientific notation is one number (`1e16` is
    10000000000000000, not 16), a fraction its value (`1/2` is 0.5), `−5` (U+2212) is -5, `.5` is
    0.5, `1,000` is 1000; values compare exactly (as floats, 12345678901234567 equalled
    12345678901234568). No number, or one too large to work with, scores 0.
    """
    got, want = last_value(str(response)), last_value(str(task.answer))
    return float(got is not None and want is not None and equal(got, want))


# ---------------------------------------------------------------- math (MATH-style answers)

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# only the end of an answer without \boxed{} is parsed: the final answer sits there, and
# math_verify's regexes are slow on long adversarial text
_TAIL_CHARS = 2000


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced.

    None when there is none, or when the last one is never closed (a response cut short): an
    earlier box is not taken for the final answer.
    """
    starts = list(_BOXED.finditer(text))
    if not starts:
        return None
    depth, start = 1, starts[-1].end()
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


# a thin space between digit groups (`10\\,000`, `1 000` with U+202F): math_verify read `10\\,000` as 0
_GROUP_SPACE = re.compile(r"(?<=\d)(?:\\[, ]|[\u00a0\u2009\u202f])(?=\d{3}(?!\d))")


def _plain_digits(text: str) -> str:
    """`text` with other scripts' decimal digits as ASCII (`５`, `٥` -> 5: math_verify scored `\\boxed{５}`
    0 against 5) and the thin spaces between digit groups dropped (`10\\,000` -> 10000)."""
    if not text.isascii():
        text = re.sub(r"\d", lambda m: str(unicodedata.digit(m[0])), text)
    return _GROUP_SPACE.sub("", text)


def _parse_answer(answer: str, timeout: int | None) -> list:
    """math_verify's parse of one bare answer (LaTeX or plain): first as `\\boxed{answer}`, then, if
    that gave no sympy object, as `$answer$` (`10\\%` parses only the second way, `\\frac{1}{2}\\%`
    only the first). A list of candidates (sympy objects and strings), [] for nothing parseable."""
    from math_verify import parse

    first = parse("\\boxed{" + answer + "}", parsing_timeout=timeout)
    if any(not isinstance(x, str) for x in first):
        return first
    second = parse("$" + answer + "$", parsing_timeout=timeout)
    return second if any(not isinstance(x, str) for x in second) else first or second


def _gold(reference: str, timeout: int | None) -> list:
    """The reference's answer: the last box of a solution, else after a GSM8K `####`, else the
    whole string as a bare answer, else whatever math_verify finds in it."""
    reference = _plain_digits(reference)
    box = last_boxed(reference)
    if box is not None:
        return _parse_answer(box, timeout)
    if "####" in reference:
        reference = reference.rsplit("####", 1)[1]
    from math_verify import parse

    return _parse_answer(reference.strip(), timeout) or parse(reference, parsing_timeout=timeout)


def _prediction(response: str, timeout: int | None) -> list:
    """The response's final answer: its last box; without one, math_verify's extraction from the
    end of the text ("the answer is $\\frac{1}{2}$", "... so x = 3"). A last box never closed is
    no answer."""
    from math_verify import parse

    response = _plain_digits(response)
    if _BOXED.search(response):
        box = last_boxed(response)
        return [] if box is None else _parse_answer(box, timeout)
    return parse(response[-_TAIL_CHARS:], parsing_timeout=timeout)


def _math_score(reference: str, response: str, timeout: int | None) -> float:
    """1.0 or 0.0; `timeout` (seconds, or None) bounds each math_verify parse and comparison with
    its signal.alarm timeouts, so it is not None only in a process's main thread."""
    from math_verify import verify

    gold = _gold(reference, timeout)
    if not gold:
        return 0.0
    pred = _prediction(response, timeout)
    if not pred:
        return 0.0
    return float(verify(gold, pred, timeout_seconds=timeout))


def _op_timeout(timeout_seconds: float) -> int:
    # signal.alarm takes whole seconds; a call parses and compares a few times, each bounded by this
    return max(1, int(timeout_seconds / 4))


class _TimeoutLog(logging.Handler):
    """Counts, per thread, math_verify's "Timeout during parsing/comparison" warnings: its parse and
    verify catch their own alarm, log it and give up, so a slow comparison is a 0 like a wrong answer."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.local = threading.local()

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("Timeout"):
            self.local.n = getattr(self.local, "n", 0) + 1


@functools.cache
def _timeout_log() -> _TimeoutLog:
    handler = _TimeoutLog()
    logger = logging.getLogger("math_verify")
    logger.addHandler(handler)
    logger.propagate = False  # counted (reward/<part>/timeouts) and warned about once, not a line each
    return handler


def _extracted(response: str, timeout: int | None) -> str | None:
    """The answer math_verify finds in a response without a box, as its text (`\\frac{1}{2}` of
    "the answer is $\\frac{1}{2}$"), None for none: what the reward scores, so what maj@n votes on."""
    try:
        found = _prediction(response, timeout)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:  # math_verify's TimeoutException is a BaseException
        return None
    return next((x.strip() for x in found if isinstance(x, str) and x.strip()), None)


def _timed_score(reference: str | None, response: str, timeout: int | None) -> list:
    """[score, whether a math_verify timeout made it 0]; with no reference, [the answer math_verify
    finds in the response (`_extracted`), False]."""
    if reference is None:
        return [_extracted(response, timeout), False]
    counts = _timeout_log().local
    counts.n = 0
    score = _guarded(reference, response, timeout)
    return [score, score == 0.0 and counts.n > 0]


def _math_worker() -> None:
    """A math scoring child (rft/rewards/workers.py): `[reference, response, timeout]` in, `[score,
    timed out]` out."""
    _math_score("1", "\\boxed{1}", 5)  # sympy and the LaTeX parser load before "ready", not in a call's time
    serve(_timed_score)


class _Timeouts:
    """Responses the math reward scored 0 because a parse or comparison ran out of time (in this
    process, since the last take): the explorer logs them as reward/<part>/timeouts, and the first
    one is a warning, because from the rewards alone a timeout looks like a wrong answer."""

    def __init__(self):
        self.lock, self.n, self.warned = threading.Lock(), 0, False

    def add(self, timeout_seconds: float) -> None:
        with self.lock:
            self.n += 1
            warn, self.warned = not self.warned, True
        if warn:
            log.warning("math reward: scoring a response ran out of time (timeout_seconds=%g) and it scored 0, "
                        "as a wrong answer does; such responses are counted as reward/<part>/timeouts. If the "
                        "count is not small, give the part a longer time (args: {timeout_seconds: 30}).",
                        timeout_seconds)

    def take(self) -> dict[str, float]:
        with self.lock:
            n, self.n = self.n, 0
        return {"timeouts": n}


# off the main thread, math_verify runs in child processes killed when late (rft/rewards/workers.py)
_WORKERS = Workers("rft.rewards.verifiers:_math_worker")


def math(prompt: str, response: str, task, timeout_seconds: float = 10.0) -> float:
    """1.0 if the response's final answer equals the reference's, by math_verify (else 0.0).

    The reference (`task.answer`) is a MATH solution, whose last `\\boxed{}` holds the answer, or a
    plain answer (`"\\frac{1}{2}"`, `"x=3"`, `42`). The response's answer is its last `\\boxed{}`;
    without one, math_verify extracts the final answer from the text (its last 2000 characters).
    Equal means what math_verify's `verify` accepts: numerically (`\\frac{1}{2}` = 0.5 = 1/2,
    `1,000` = 1000), symbolically (`2\\sqrt{2}` = `\\sqrt{8}`, `(x+1)^2` = `x^2+2x+1`), an
    assignment to its value (`x=3` = 3), sets in any order, intervals with their brackets, and
    `90^\\circ` = 90, `10\\%` = 10. Units are dropped before comparing: `5 cm`, `5\\text{ cm}` and
    even `5 m` all equal 5 (math_verify strips unit words; it does not convert them).

    Never raises: an answer that does not parse, a last box never closed, or a comparison that
    runs out of time scores 0 (a timeout is counted: `reward/<part>/timeouts`, and the first one
    warned about). `timeout_seconds` bounds one call: in a process's main thread it goes to
    math_verify's own (signal.alarm) timeouts; on any other thread (the explorer's reward runners)
    the call runs in a child process that is killed when it is late (rft/rewards/workers.py).
    """
    if task.answer is None or response is None:
        return 0.0
    score, late = _math_call(str(task.answer), str(response), timeout_seconds)
    if late:
        _TIMEOUTS.add(timeout_seconds)
    return float(score)


def _math_call(reference: str, response: str, timeout_seconds: float) -> tuple[float, bool]:
    """(the math score, whether a timeout made it 0), bounded as `math` says."""
    _require_math_verify()  # not installed: an error, not rewards of 0
    if threading.current_thread() is threading.main_thread():
        score, late = _timed_score(reference, response, _op_timeout(timeout_seconds))
        return score, late
    try:
        score, late = _WORKERS.call([reference, response, _op_timeout(timeout_seconds)], timeout_seconds) or [0.0, False]
    except TimeoutError:  # past its time: the child is killed, the answer not accepted
        return 0.0, True
    except NoWorker as e:
        log.warning("math reward: %s; scoring in this thread, without a timeout", e)
        return _guarded(reference, response, None), False
    return score, late


_TIMEOUTS = _Timeouts()
math.take_counters = _TIMEOUTS.take  # a function part's counters (rft.rewards.scoring.Scorer.take_counters)


@functools.cache
def _require_math_verify() -> None:
    import importlib.util

    if importlib.util.find_spec("math_verify") is None:
        raise ImportError("the math reward needs math_verify: pip install 'math-verify[antlr4_9_3]'")


def _guarded(reference: str, response: str, timeout: int | None) -> float:
    try:
        return _math_score(reference, response, timeout)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:  # math_verify's TimeoutException is a BaseException
        return 0.0


# ---------------------------------------------------------------- countdown

_COUNTDOWN_CHARS = re.compile(r"[0-9+\-*/() ]+")
_COUNTDOWN_MAX_CHARS = 200
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b}


class _CountdownError(Exception):
    pass


# the signs a model writes for the four operations (× ÷ −), read as + - * /; any whitespace as a space
_COUNTDOWN_SIGNS = str.maketrans({"×": "*", "÷": "/", "\u2212": "-", "\u2013": "-"})


def _countdown_tree(expression: str):
    """(the expression's ast, the integers it uses), or raise _CountdownError("malformed")."""
    if len(expression) > _COUNTDOWN_MAX_CHARS:
        raise _CountdownError("malformed")
    # `3 ×\n7` and `３+７` are 3*7 and 3+7 (they were "malformed": a right answer scored 0)
    expression = " ".join(_plain_digits(expression).translate(_COUNTDOWN_SIGNS).split())
    if not _COUNTDOWN_CHARS.fullmatch(expression):
        raise _CountdownError("malformed")
    try:
        tree = ast.parse(expression, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise _CountdownError("malformed") from None
    used = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp):
            if type(node.op) not in _OPS:
                raise _CountdownError("malformed")  # ** or //
        elif isinstance(node, ast.Constant):
            if type(node.value) is not int:
                raise _CountdownError("malformed")
            used.append(node.value)
        elif not isinstance(node, ast.operator):
            raise _CountdownError("malformed")  # a unary minus
    return tree, used


def _countdown_value(tree, integer_steps: bool) -> Fraction:
    """The exact value of a checked tree, or raise _CountdownError (division by zero, non-integer step)."""
    if isinstance(tree, ast.Constant):
        return Fraction(tree.value)
    a, b = _countdown_value(tree.left, integer_steps), _countdown_value(tree.right, integer_steps)
    if isinstance(tree.op, ast.Div) and b == 0:
        raise _CountdownError("division by zero")
    v = _OPS[type(tree.op)](a, b)
    if integer_steps and v.denominator != 1:
        raise _CountdownError("non-integer step")
    return v


def countdown_value(expression: str, integer_steps: bool = False) -> Fraction | None:
    """The exact value of a Countdown expression (as `check_countdown` reads it), None if it has none."""
    try:
        return _countdown_value(_countdown_tree(str(expression).strip())[0], integer_steps)
    except (_CountdownError, RecursionError):
        return None


def check_countdown(expression: str, numbers, target, integer_steps: bool = False) -> tuple[float, str]:
    """Score a Countdown answer: (1.0, "ok") iff `expression` uses exactly `numbers` and equals `target`.

    The expression is integer literals, `+ - * /` and parentheses (any whitespace allowed), e.g.
    `(3+7)*9`; `×`, `÷`, `−` (U+2212) and `–` are read as `*`, `/` and `-`, other scripts' digits
    (`３`) as ASCII ones. The rules are the standard Countdown / TinyZero ones: every given number is used
    exactly once, all of them (a repeated number must appear as often as it is given), no other
    number; no unary minus, no powers, no `//`, no decimals, no `=`. Division is exact
    (fractions), and intermediate values may be fractions (`8/(3-8/3)` = 24), as in TinyZero,
    unless `integer_steps=True` (the TV game's rule: every intermediate value a whole number).
    The evaluation walks the `ast` tree itself: nothing is ever `eval`-ed.

    The reason is one of "ok", "empty", "malformed" (not such an expression, or longer than 200
    characters), "wrong numbers" (a number missing, reused or not given), "division by zero",
    "non-integer step" (only with integer_steps), "wrong value".
    """
    expression = str(expression).strip() if expression is not None else ""
    if not expression:
        return 0.0, "empty"
    try:
        tree, used = _countdown_tree(expression)
        if Counter(used) != Counter(int(n) for n in numbers):
            return 0.0, "wrong numbers"
        got = _countdown_value(tree, integer_steps)
    except _CountdownError as e:
        return 0.0, str(e)
    except RecursionError:
        return 0.0, "malformed"
    return (1.0, "ok") if got == Fraction(target) else (0.0, "wrong value")


def last_tagged(text: str, tag: str = "answer") -> str | None:
    """The content of the last `<tag>...</tag>` in `text` (as the last match of the regex
    `<tag>(.*?)</tag>`, DOTALL, would find it), None when there is none. One pass of `str.find`:
    that regex took 4 s on 100 KB of unclosed `<answer>` tags (each start scans to the end), in
    the explorer's process, holding the GIL."""
    tagged, pos, opening, closing = None, 0, f"<{tag}>", f"</{tag}>"
    while (start := text.find(opening, pos)) >= 0:
        end = text.find(closing, start + len(opening))
        if end < 0:
            break
        tagged, pos = text[start + len(opening) : end], end + len(closing)
    return tagged


def countdown_answer(response: str) -> str:
    """The expression in a response: the last `<answer>...</answer>` if there is one, else all of it."""
    tagged = last_tagged(response)
    return response if tagged is None else tagged


def countdown(prompt: str, response: str, task, integer_steps: bool = False) -> float:
    """1.0 if the response is an expression of exactly the row's `numbers` (each once, all of
    them) equal to its `target` (`check_countdown`); the expression may sit in `<answer>` tags."""
    row = task.row or {}
    if "numbers" not in row or "target" not in row:
        raise ValueError(
            f"the countdown reward reads the row's 'numbers' and 'target' columns; this row has "
            f"{sorted(row)} (task {task.task_id})"
        )
    return check_countdown(countdown_answer(str(response)), row["numbers"], row["target"], integer_steps)[0]


def format_match(prompt: str, response: str, task, pattern: str = r"<answer>.*</answer>") -> float:
    """1.0 if the whole response, stripped, matches the regular expression `pattern` (re.fullmatch,
    DOTALL: `.` crosses lines), else 0.0. The default asks for the answer inside <answer> tags."""
    return float(re.fullmatch(pattern, response.strip(), flags=re.DOTALL) is not None)


def _last_number_answer(response: str) -> str | None:
    """The response's last number (as last_number reads it) in one spelling per value (`numbers.spelling`:
    `1/2`, `.5` and `5e-1` are `0.5`, `-0` is `0`, `٥` is `5`): the vote splits and joins where the reward does."""
    value = last_value(response)
    return None if value is None else spelling(value)


def _math_answer(response: str, timeout_seconds: float = 10.0) -> str | None:
    """What the math reward scores: the last box's content; a last box never closed is no answer
    (the reward scores it 0; the vote took the number in it); without a box, what math_verify
    extracts (the vote took the last number: `$\\frac{1}{2}$` voted 2 where the reward read 1/2)."""
    if _BOXED.search(response):
        boxed = last_boxed(response)
        return None if boxed is None else boxed.strip() or None
    _require_math_verify()
    if threading.current_thread() is threading.main_thread():
        return _extracted(response, _op_timeout(timeout_seconds))
    try:
        answer = _WORKERS.call([None, response, _op_timeout(timeout_seconds)], timeout_seconds)
    except TimeoutError:
        return None
    except NoWorker:
        return _extracted(response, None)
    return (answer or [None])[0]


# reward name -> what its verifier reads from a response as the answer (None: no answer), the votes
# of maj@n (rft/rewards/eval_metrics.py); a reward not named here votes with the stripped response
ANSWERS = {
    "exact_match": lambda response: response.strip(),
    "last_number": _last_number_answer,
    "math": _math_answer,
    "countdown": lambda response: countdown_answer(response).strip() or None,
    "reasoning_gym": lambda response: _reasoning_gym_answer(response),
}


def _reasoning_gym_answer(response: str) -> str | None:
    # as rft.rewards.reasoning_gym.answer_of reads it (that module imports this one)
    tagged = last_tagged(response)
    return (response if tagged is None else tagged).strip() or None


def _same_math(a: str, b: str, task=None, timeout_seconds: float = 10.0) -> bool:
    """The math reward's judgement: `b` (as a response's last box) equals `a` (as the reference):
    `1/2`, `0.5` and `\\frac{1}{2}` are one answer. A comparison that runs out of time is "not the
    same" (and not counted as a reward's timeout)."""
    return _math_call(a, "\\boxed{" + b + "}", timeout_seconds)[0] == 1.0


def _same_countdown(a: str, b: str, task=None, integer_steps: bool = False) -> bool:
    """The countdown reward scores two expressions alike on every task when they use the same
    numbers and have the same value: `3+7` and `7+3` are one answer."""
    def key(expression: str):
        try:
            used = sorted(_countdown_tree(expression)[1])
        except (_CountdownError, RecursionError):
            return None
        value = countdown_value(expression, integer_steps)
        return None if value is None else (used, value)

    return key(a) is not None and key(a) == key(b)


# reward name -> whether two answers it reads (ANSWERS) are one, as its verifier judges them: maj@n's
# votes go together (rft/rewards/eval_metrics.py); a reward not named here compares the answers as
# strings (exact_match's verifier does; last_number's answer is its number already written one way).
# Each judge takes the task too (`task=`): reasoning-gym's scorers judge an answer against the row's entry
SAME_ANSWER = Registry("same_answer", {"math": "rft.rewards.verifiers._same_math",
                                      "countdown": "rft.rewards.verifiers._same_countdown",
                                      "reasoning_gym": "rft.rewards.reasoning_gym.same_answer"})


def _voting_part(spec) -> tuple[str | None, dict]:
    """The name and args of the reward `spec`'s part whose answers maj@n votes on: a name's; of
    parts (or one part as a dict), the first whose fn reads an answer (ANSWERS: a verifier), else
    the first. With a format part listed before the verifier ([format, math]), or one part given as
    {fn: math}, the vote was on whole responses, which differ where their answers agree."""
    if isinstance(spec, str):
        return spec, {}
    spec = [spec] if isinstance(spec, dict) else spec  # reward_fn={fn: math, args: {...}}: one part
    parts = [p for p in spec if isinstance(p, dict)] if isinstance(spec, list) else []
    part = next((p for p in parts if p.get("fn") in ANSWERS), parts[0] if parts else None)
    return (None, {}) if part is None else (part.get("fn"), dict(part.get("args") or {}))


def answer_of(spec, response: str) -> str | None:
    """The answer a response gives, as the reward `spec` (a name, or parts: `_voting_part`'s fn)
    reads it; None for none, a blank one too (maj@n: blank responses must not outvote an answer)."""
    return ANSWERS.get(_voting_part(spec)[0], lambda r: r.strip())(response) or None


def same_answer(spec, task=None):
    """`same(a, b)`: whether answers a and b (answer_of's, not None) of `task` are one vote of maj@n,
    as the reward `spec`'s verifier (a name, or parts: `_voting_part`'s, with its args) judges them
    equal; equal strings always are."""
    name, args = _voting_part(spec)
    judge = SAME_ANSWER.get(name)
    if judge is None:
        return lambda a, b: a == b
    return lambda a, b: a == b or judge(a, b, task=task, **args)


# the rewards above that compare a response with the task's reference answer (task.answer, the
# taskset's format.response_key): planning refuses them on a taskset without one (rft/plan/batch.py)
READS_ANSWER = frozenset({"exact_match", "last_number", "math"})

_HERE = "rft.rewards.verifiers."
REWARD_FNS = Registry("reward_fn", {name: _HERE + fn for name, fn in [
    ("exact_match", "exact_match"), ("last_number", "last_number"), ("math", "math"), ("countdown", "countdown"),
    ("format", "format_match")]})
REWARD_FNS["reasoning_gym"] = "rft.rewards.reasoning_gym.reasoning_gym"  # the row's dataset's own scorer
