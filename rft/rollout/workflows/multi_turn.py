"""Multi-turn conversations held as token ids: the `multi_turn` workflow and SFT on conversations.

Token in, token out. A conversation is never re-tokenised from its text: re-encoding what the
model wrote can give other ids than it sampled (BPE merges across a turn boundary, a newline the
template drops; verl#3720, verl#6921), and the trainer would then compute log-probs of tokens the
engine never sampled. So the workflow holds the ids and appends:

- an assistant turn: exactly the ids the engine sampled, with their log-probs (loss mask 1);
- the rest of that turn's rendering: what the chat template writes after the sampled ids (the
  newline after <|im_end|>; <|im_end|> itself when a stop string ended the turn) (mask 0);
- an environment's message (a tool's answer, a user's reply): the ids the chat template adds for
  it, the next generation prompt included (`message_ids`, the difference of two renderings) (mask 0).

The trainer sees `Experience.tokens` = the first prompt, then all of that, and `loss_mask` is 1
exactly on the sampled tokens: it learns only what the model itself said.

Drift check. At the end the whole conversation (its messages as text) is rendered by the chat
template and compared with the ids held. A template that renders a turn differently once later
turns exist (Qwen3 drops earlier <think> blocks), or text that re-encodes to other ids, shows up
as a mismatch: counted (`rollout/drift_frac`, info["drift"] names the turn and token), and with
workflow_args.strict=true the run stops naming the turn and the first differing token.

workflow_args of `multi_turn`:
    env              a name in rft.rollout.environments.tools.ENVIRONMENTS or a class's dotted path (required)
    env_args         keyword arguments of the environment's constructor
    max_turns        assistant turns at most (default 4); a conversation that reaches it ends,
                     info["turn_limit"] is set, and its reward is what the environment gave so far
    max_total_tokens the whole conversation's budget (default model.max_prompt_tokens +
                     model.max_response_tokens): an assistant turn is cut to what is left (finish
                     reason "length"), and a message that does not fit ends the conversation
                     before it (info["budget_truncated"]); a first prompt that fills it fails
                     its task (rollout/failed_tasks); never an error of the run
    stop             strings that end every assistant turn (besides rollout_args.stop and the
                     environment's own `stop`)
    strict           true: a drift stops the run (default false: counted)

Batching: each turn, the active conversations of all tasks go to the engine in one `generate`
call (the first turn as `n` samples of each prompt, sharing its prefill); their environments step
on the explorer's workflow runners (`ctx.call`: explorer.max_timeout each). An environment that
raises or times out fails its task (no experiences; counted in rollout/failed_tasks).
"""

from __future__ import annotations

import copy
import logging
import math
import numbers
from collections.abc import Mapping
from types import SimpleNamespace

from rft.config import near_args
from rft.data.chat import closing_ids, common_prefix, message_ids, render
from rft.data.experience import Experience
from rft.errors import ConfigError, RunError

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- the workflow

class Conversation:
    """One rollout: the ids held so far, which of them were sampled, and the messages as text."""

    def __init__(self, task, env, messages: list[dict], prompt: list[int]):
        self.task, self.env = task, env
        self.messages = messages
        self.ids = list(prompt)
        self.prompt_length = len(prompt)
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        # (start, end, turn number, role) of each appended span: where a drift sits
        self.spans: list[tuple[int, int, int, str]] = [(0, len(prompt), 0, "prompt")]
        self.parts: dict[str, float] = {}
        self.turns = 0
        self.done = False
        self.failed: str | None = None
        self.finish_reason = "stop"
        self.info: dict = {}

    def add(self, ids: list[int], sampled: bool, role: str, logprobs=None) -> None:
        self.spans.append((len(self.ids), len(self.ids) + len(ids), self.turns, role))
        self.ids += ids
        self.mask += [int(sampled)] * len(ids)
        self.logprobs += list(logprobs) if sampled else [0.0] * len(ids)


def _env_class(name: str, key: str):
    from rft.registry import resolve
    from rft.rollout.environments.tools import ENVIRONMENTS

    return resolve(ENVIRONMENTS, name, key)


def _env_name(env_cls) -> str:
    return f"{env_cls.__module__}.{env_cls.__qualname__}"


def _first_messages(first, env_cls) -> list[dict]:
    """reset()'s answer as messages; anything else is the environment's mistake, named (a run
    would otherwise fail every task and blame them)."""
    if isinstance(first, str):
        return [{"role": "user", "content": first}]
    if isinstance(first, dict) and isinstance(first.get("content"), str):
        return [dict(first)]
    if isinstance(first, (list, tuple)) and first and all(isinstance(m, dict) for m in first):
        return [dict(m) for m in first]
    raise ConfigError(f"{_env_name(env_cls)}.reset(task) returned {type(first).__name__} {_short(first)}; it must "
                      f"return the first message(s): a str (a user message), a message dict with a str "
                      f"'content', or a non-empty list of message dicts (rft/rollout/environments/tools.py).")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _step_result(result, env_cls, turn: int) -> tuple:
    """step()'s answer as (message | None, {part: float}, done), checked: a wrong shape is the
    environment's mistake, named with its class, not a TypeError in the workflow."""
    shape = ("it must return (message | None, {part name: number}, done), e.g. (None, {'correct': 1.0}, True) "
             "(rft/rollout/environments/tools.py)")
    where = f"{_env_name(env_cls)}.step(text) (turn {turn})"
    if not isinstance(result, (tuple, list)) or len(result) != 3:
        raise ConfigError(f"{where} returned {type(result).__name__} {_short(result)}; {shape}.")
    msg, parts, done = result
    if not (msg is None or isinstance(msg, str) or (isinstance(msg, dict) and isinstance(msg.get("content"), str))):
        raise ConfigError(f"{where} returned the message {_short(msg)}: a str, a message dict with a str "
                          f"'content', or None; {shape}.")
    if not isinstance(parts or {}, dict):
        raise ConfigError(f"{where} returned the reward parts {_short(parts)}, not a dict; {shape}.")
    for k, v in (parts or {}).items():
        # bool is an int: True counts 1 (a check passed); numpy's scalars are numbers.Real too
        if not isinstance(v, numbers.Real) or not math.isfinite(v):
            raise ConfigError(f"{where} returned the reward part {k!r}={_short(v)}, not a finite number; {shape}.")
    # a str or None read by its truth: done="False" ended every conversation at its first turn
    if not (isinstance(done, numbers.Integral) or getattr(getattr(done, "dtype", None), "kind", None) == "b"):
        raise ConfigError(f"{where} returned done={_short(done)}, a {type(done).__name__}: give True (the conversation "
                          f"ends) or False (the model speaks again); {shape}.")
    return msg, {k: float(v) for k, v in (parts or {}).items()}, bool(done)


def _as_message(msg) -> dict:
    return {"role": "user", "content": msg} if isinstance(msg, str) else dict(msg)


def drift_at(tok, conv: Conversation) -> tuple[int, int, str] | None:
    """(token index, turn, role) of the first id where the template's rendering of the whole
    conversation departs from the ids held; None when the held ids are what it renders (up to the
    closing tokens of a last turn that ended the conversation)."""
    rendered = rendered_whole(tok, conv)
    at = common_prefix(rendered, conv.ids)
    if at == len(conv.ids):
        return None
    turn, role = next(((t, r) for s, e, t, r in conv.spans if s <= at < e), (conv.turns, "?"))
    return at, turn, role


def rendered_whole(tok, conv: Conversation) -> list[int]:
    """The template's ids of the whole conversation. One that max_turns ended after an environment's
    reply holds the next generation prompt too (the reply's ids are taken with it): rendered without
    it, every such conversation read as drift, and strict=true stopped the run."""
    return render(tok, conv.messages, generation_prompt=conv.messages[-1]["role"] != "assistant")


def drift_message(tok, conv: Conversation, at: int, turn: int, role: str) -> str:
    rendered = rendered_whole(tok, conv)
    held = conv.ids[at] if at < len(conv.ids) else None
    want = rendered[at] if at < len(rendered) else None
    show = lambda t: "nothing" if t is None else f"{t} ({tok.decode([t])!r})"  # noqa: E731
    return (f"task {conv.task.task_id!r}: the chat template renders turn {turn} ({role}) differently from the "
            f"token ids the conversation holds: at token {at} it holds {show(held)}, the template gives "
            f"{show(want)}. The trainer trains on the held ids (what the engine sampled); set "
            f"workflow_args.strict=false to count such conversations (rollout/drift_frac) instead of "
            f"stopping, or fix the template (model.custom_chat_template).")


ARGS = {"env", "env_args", "max_turns", "max_total_tokens", "stop", "strict"}


def check_args(args, where: str = "workflow_args"):
    """The workflow_args of `multi_turn` (checked when planning, and again by the workflow);
    returns the environment class."""
    if "env" not in args:
        raise ConfigError(f"workflow multi_turn needs {where}.env: a name in rft.rollout.environments.tools.ENVIRONMENTS "
                          f"(calculator, python) or the dotted path of an environment class.")
    if set(args) - ARGS:
        raise ConfigError(f"{where} has {sorted(set(args) - ARGS)}, which workflow multi_turn does not take; "
                          f"its arguments are {sorted(ARGS)}.{near_args(set(args) - ARGS, ARGS)}")
    # max_turns 0 would end every conversation before the model speaks: empty responses, reward 0
    for key, default, least in [("max_turns", 4, 1), ("max_total_tokens", None, 1)]:
        value = args.get(key, default)
        if value is not None and (type(value) is not int or value < least):
            raise ConfigError(f"{where}.{key}={value!r} must be a whole number >= {least}"
                              f"{' (or null: the model budgets)' if default is None else ''}.")
    if not isinstance(args.get("env_args") or {}, Mapping):
        raise ConfigError(f"{where}.env_args={args['env_args']!r}: give the environment's keyword arguments as a dict.")
    env_cls = _env_class(args["env"], f"{where}.env")
    _check_env_class(env_cls, args, where)
    return env_cls


def _check_env_class(env_cls, args, where: str) -> None:
    """The environment is a class with reset and step that takes env_args (else each conversation
    would fail, and the run would blame its tasks)."""
    import inspect

    name = args["env"]
    missing = [m for m in ("reset", "step") if not callable(getattr(env_cls, m, None))]
    if not isinstance(env_cls, type) or missing:
        raise ConfigError(f"{where}.env={name!r} is not an environment: it needs to be a class with reset(task) and "
                          f"step(text) methods (rft/rollout/environments/tools.py), and "
                          f"{'is a ' + type(env_cls).__name__ if not isinstance(env_cls, type) else 'has no ' + ' or '.join(missing)}.")
    given, known = dict(args.get("env_args") or {}), list(inspect.signature(env_cls).parameters)
    try:
        inspect.signature(env_cls).bind(**given)
    except TypeError as e:
        raise ConfigError(f"{where}.env_args={given!r} does not fit {name}{inspect.signature(env_cls)} "
                          f"({e}). Give the keyword arguments its constructor takes."
                          f"{near_args(sorted(set(given) - set(known)), known)}") from None
    # a str is a sequence of one-character strings: stop = "</g>" ended each turn at its first '<', '/', 'g' or '>'
    for what, stop in [(f"{name}.stop", getattr(env_cls, "stop", [])), (f"{where}.stop", args.get("stop"))]:
        if stop is not None and (isinstance(stop, str) or not all(isinstance(s, str) for s in stop)):
            example = [stop] if isinstance(stop, str) else ["</answer>"]
            raise ConfigError(f"{what}={_short(stop)}: give a list of strings, each of which ends an assistant turn "
                              f"(e.g. {example!r}); a str is read as its characters, each one a stop.")
    # an environment may check its arguments against this machine too (python: is there a sandbox?)
    if callable(getattr(env_cls, "check_config", None)):
        env_cls.check_config(**dict(args.get("env_args") or {}))


def multi_turn(tasks, engine, ctx) -> list[list[Experience] | None]:
    """`ctx.n` conversations per task between the model and an environment (module docstring)."""
    tok, a = ctx.tokenizer, dict(ctx.args)
    env_cls = check_args(a)
    max_turns = int(a.get("max_turns", 4))
    budget = int(a.get("max_total_tokens") or ctx.max_prompt_tokens + ctx.max_response_tokens)
    strict = bool(a.get("strict", False))
    call = ctx.call or (lambda fn, jobs: [fn(j) for j in jobs])

    convs, groups = _start_conversations(tasks, env_cls, a, ctx, call, budget)
    args, sampling = _sampling_args(ctx, a, env_cls)
    for turn in range(max_turns):
        active = [c for c in convs if not c.done and not c.failed]
        if not active:
            break
        _assistant_turn(engine, active, groups, turn, args, ctx, budget)
        _environment_turn([c for c in active if not c.done], call, env_cls, tok, budget)
    for c in convs:
        if not c.done and not c.failed:
            c.info["turn_limit"] = True
    return _experiences(tasks, convs, ctx, strict, sampling)


def _start_conversations(tasks, env_cls, a: dict, ctx, call, budget: int) -> tuple[list[Conversation], list[list[Conversation]]]:
    """`ctx.n` conversations per task, each with an environment of its own, and the conversations
    grouped by task. A conversation whose reset failed fails its whole group, and so does one whose
    first prompt fills the budget (no response token: the budget is never an error of the run)."""
    tok = ctx.tokenizer

    # one conversation per rollout; reset on the runners (an environment may do work there)
    def start(task):
        env = env_cls(**dict(a.get("env_args") or {}))
        return env, env.reset(task)

    jobs = [t for t in tasks for _ in range(ctx.n)]
    convs: list[Conversation] = []
    for task, got in zip(jobs, call(start, jobs)):
        if got is None:
            c = Conversation(task, None, [], [])
            c.failed = "the environment's reset raised or timed out"
        else:
            messages = _first_messages(got[1], env_cls)
            c = Conversation(task, got[0], messages, render(tok, messages, generation_prompt=True))
            if c.prompt_length >= budget:
                c.failed = (f"its first prompt is {c.prompt_length} tokens, which leaves no room for the model under "
                            f"the conversation's budget of {budget} tokens (workflow_args.max_total_tokens; default "
                            f"model.max_prompt_tokens + model.max_response_tokens): raise it, or shorten the task's "
                            f"first message")
        convs.append(c)
    groups = [convs[i : i + ctx.n] for i in range(0, len(convs), ctx.n)]
    for g in groups:  # a task fails as a whole: its group is incomplete
        bad = next((c.failed for c in g if c.failed), None)
        for c in g:
            c.failed = c.failed or bad
    return convs, groups


def _sampling_args(ctx, a: dict, env_cls) -> tuple[SimpleNamespace, dict]:
    """(the engine's sampling arguments for every assistant turn, the sampling the experiences
    record); the stop strings are rollout_args', workflow_args' and the environment's."""
    r = ctx.rollout_args
    stop = list(getattr(r, "stop", []) or []) + list(a.get("stop") or [])
    stop += [s for s in getattr(env_cls, "stop", []) if s not in stop]
    args = SimpleNamespace(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, stop=stop,
                           max_tokens=r.max_tokens or ctx.max_response_tokens)
    sampling = {"temperature": float(r.temperature), "top_p": float(r.top_p), "top_k": int(r.top_k)}
    return args, sampling


def _assistant_turn(engine, active: list[Conversation], groups, turn: int, args, ctx, budget: int) -> None:
    """One engine call for the active conversations; each appends what was sampled, cut to the
    conversation's budget (which then ends it)."""
    seed = (ctx.seed + 7919 * turn) % (2**31)
    live = [g for g in groups if not g[0].failed]
    if turn == 0 and all(c.ids == g[0].ids for g in live for c in g):
        # n samples of each prompt: the group shares its prefill (an environment whose reset
        # differs between a task's conversations takes the general path below)
        samples = [s for g in engine.generate([g[0].ids for g in live], ctx.n, args, seed=seed) for s in g]
    else:
        samples = [g[0] for g in engine.generate([c.ids for c in active], 1, args, seed=seed)]
    tok = ctx.tokenizer
    for c, s in zip(active, samples):
        ids, lps, reason = list(s.token_ids), list(s.logprobs), s.finish_reason
        room = budget - len(c.ids)
        if len(ids) > room:  # the conversation's budget ends inside this turn
            ids, lps, reason = ids[:max(room, 0)], lps[:max(room, 0)], "length"
            c.info["budget_truncated"] = True
        c.turns += 1
        history = list(c.messages)
        text = tok.decode(ids, skip_special_tokens=True)
        c.add(ids, True, "assistant", lps)
        c.messages.append({"role": "assistant", "content": text})
        c.finish_reason = reason
        c.pending = (history, ids, text)
        if c.info.get("budget_truncated"):
            c.done = True


def _tool_hint(env_cls) -> str:
    """What a ToolEnv's failed step most often is: a tool that raised its own exception (a KeyError
    for a key the model made up), which fails the whole task where a ToolError would be a failed call
    the model reads back and is scored on."""
    if not isinstance(getattr(env_cls, "tools", None), dict):
        return ""
    return (" (a tool that raises anything but ToolError fails its whole task, left out of training and "
            "counted in rollout/failed_tasks; the exception and its line are in the warning before this one. "
            "For a call the model got wrong, raise rft.rollout.environments.tools.ToolError(reason): the model "
            "reads `error: <reason>` back and the conversation goes on)")


def _environment_turn(stepping: list[Conversation], call, env_cls, tok, budget: int) -> None:
    """The environments answer the assistant turns just sampled (on the runners): each adds its
    reward parts, then ends the conversation or appends its message (with the rest of the
    assistant turn's rendering before it), unless that would not fit the budget."""
    def step(c):
        return c.env.step(c.messages[-1]["content"])

    for c, result in zip(stepping, call(step, stepping)):
        if result is None:
            c.failed = f"the environment's step raised or timed out at turn {c.turns}{_tool_hint(env_cls)}"
            continue
        msg, parts, done = _step_result(result, env_cls, c.turns)
        for k, v in parts.items():
            c.parts[k] = c.parts.get(k, 0.0) + float(v)
        history, ids, text = c.pending
        if done or msg is None:
            c.done = True
            continue
        closing, departs = closing_ids(tok, history, ids, text)
        if departs is not None:
            c.info.setdefault("drift_turns", []).append(c.turns)
        msg = _as_message(msg)
        try:
            delta = message_ids(tok, c.messages, msg, generation_prompt=True)
        except ConfigError as e:
            raise ConfigError(f"task {c.task.task_id!r}, turn {c.turns}: {e}") from None
        if len(c.ids) + len(closing) + len(delta) >= budget:  # no room for the reply and an answer
            c.info["budget_truncated"] = True
            c.done = True
            continue
        c.add(closing, False, "assistant")
        c.add(delta, False, msg.get("role", "user"))
        c.messages.append(msg)


def _experiences(tasks, convs: list[Conversation], ctx, strict: bool, sampling: dict) -> list[list[Experience] | None]:
    """Per task, its conversations' experiences, or None when one of them failed."""
    out = []
    for i, task in enumerate(tasks):
        group = convs[i * ctx.n : (i + 1) * ctx.n]
        bad = next((c for c in group if c.failed), None)
        if bad is not None:
            log.warning("task %s failed: %s", task.task_id, bad.failed)
            out.append(None)
            continue
        out.append([_experience(task, c, ctx, strict, sampling) for c in group])
    return out


def _experience(task, c: Conversation, ctx, strict: bool, sampling: dict) -> Experience:
    """One conversation as an experience: its reward is the sum of the environment's parts; a
    drift is recorded in its info (or, strict, stops the run)."""
    tok = ctx.tokenizer
    drift = drift_at(tok, c)
    if drift is not None and strict:
        raise RunError(drift_message(tok, c, *drift))
    from rft.rewards.scoring import Reward

    own = getattr(c.env, "info", None) or {}  # an environment without counters has no `info`
    if not isinstance(own, Mapping):
        raise ConfigError(f"{_env_name(type(c.env))}.info is a {type(own).__name__}: make it a dict of counters "
                          f"(name -> number, logged as rollout/<name>_mean), or leave it out.")
    info = {**own, **c.info}
    info.update({
        "finish_reason": c.finish_reason, "turns": c.turns, "drift": drift is not None,
        "prompt": tok.decode(c.ids[: c.prompt_length], skip_special_tokens=True),
        "response": tok.decode(c.ids[c.prompt_length :], skip_special_tokens=True),
        # the turns as text, for people and for saved eval trajectories
        "conversation": copy.deepcopy(c.messages), "prompt_truncated": False,
    })
    if drift is not None:
        info["drift_at"] = {"token": drift[0], "turn": drift[1], "role": drift[2]}
    return Experience(
        tokens=c.ids, prompt_length=c.prompt_length, logprobs=c.logprobs,
        reward=Reward(sum(c.parts.values()), c.parts),
        group_id=f"{ctx.step}/{ctx.seed}/{task.task_id}", task_id=task.task_id,
        policy_version=ctx.policy_version, sampling=dict(sampling), info=info, loss_mask=c.mask,
    )
