"""From a taskset's reward config to rewards: the parts, their weights, their sum.

A taskset's `reward_fn` (or `buffer.explorer_input.default_reward_fn_type`) is either
- one reward: a name in `rft.rewards.verifiers.REWARD_FNS`, a served reward in `REWARD_CLIENTS` below, or
  the dotted path of a function of the study's own (`module.function`); or
- a list of parts, each `{fn: <as above>, weight: 1.0, args: {...}, name: <fn>, normalize: false}`.

A reward function is `fn(prompt, response, task, **args) -> float | dict[str, float]`: a dict is
named parts, and its value is their sum. The experience's reward is the weighted sum
`sum(weight * value)` over the parts; `Experience.reward_parts` keeps each part's value before
weighting (under its name, or `<name>/<key>` for a dict's entries), and each is logged as
`reward/<part>/mean`. Shaping adds parts of its own the same way (`rft.data.experience.add_part`): DAPO's overlong
penalty is the part `overlong`, weight 1.

A served reward (a reward model on its own worker, a remote reward server, an LLM judge) is a class,
built once per explorer from the part's `args`, and called once per task with all its responses:
`client(prompt, responses, task) -> list[float | dict]` (one batch per group). It may count what
went wrong on its side (`take_counters() -> {"failures": n, ...}`, the counts since the last call):
the explorer logs them as `reward/<name>/<counter>`. A function may carry one too (`fn.take_counters`:
`math` counts the responses it scored 0 because scoring ran out of time).

`normalize: true` scales that part by running statistics over the run's rollouts, (value - mean)
/ std, updated with each step's values before they are used (`RunningNorm`, kept by the driver and
saved in checkpoints, so a resumed run normalises as an uninterrupted one).
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import logging
import math
import os
import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rft.config import near_args
from rft.errors import ConfigError
from rft.registry import Registry
from rft.rewards import stdout_cap

log = logging.getLogger(__name__)

# served rewards: name -> class, imported when chosen
REWARD_CLIENTS = Registry("reward_fn", {
    "remote": "rft.rewards.remote.RemoteReward",
    "judge": "rft.rewards.judge.JudgeReward",
    "reward_model": "rft.rewards.reward_model.RewardModelReward",
})

_ENTRY_KEYS = ("fn", "weight", "args", "name", "normalize")
# what a reward's third parameter is called by someone who expects the answer there, not the task
_ANSWER_NAMES = {"answer", "answers", "ground_truth", "gt", "reference", "ref", "label", "target", "solution",
                 "expected", "truth"}


def wrong_type(text: str) -> ValueError:
    """The error of a reward that returned what is no reward (text, None, a dict of no parts, a list
    of another length than the group's): a bug of the reward's own, which returns the same again
    when called again. rft.rollout.explorer.run_jobs retries an error explorer.max_retry_times times,
    as for a flaky one (a server that dropped the call), unless it says `retry = False`: the task
    fails at once. A ValueError still, as its message names it."""
    e = ValueError(text)
    e.retry = False
    return e


class Reward(float):
    """A reward as a float that also carries its parts (`.parts`, values before weighting).

    What `ctx.score` hands a workflow: it works wherever a float does, and an Experience built
    with it stores the parts (`Experience.reward_parts`)."""

    parts: dict

    def __new__(cls, value: float, parts: dict | None = None):
        r = super().__new__(cls, value)
        r.parts = dict(parts or {})
        return r

    def __reduce__(self):  # pickles (to Ray actors) with its parts
        return (Reward, (float(self), self.parts))


@dataclass
class Part:
    name: str
    weight: float
    # (prompt, responses, task) -> [value per response]
    call: Callable
    normalize: bool = False


@dataclass
class Scorer:
    """The parts of one taskset's reward; `scorer(prompt, responses, task)` scores a group."""

    parts: list[Part] = field(default_factory=list)
    # a dict part's keys as first seen, to warn once when a later response's differ
    keys: dict = field(default_factory=dict)
    printed: stdout_cap.Budget = field(default_factory=stdout_cap.Budget)  # what its rewards printed

    def __call__(self, prompt: str, responses: list[str], task) -> list[Reward]:
        per_part = []
        for p in self.parts:
            # each part gets copies: one that edits the list or the task (task.row["answer"] = ...) would
            # change what the next part scores, the texts the buffer keeps, and the taskset's task for
            # every later epoch
            with stdout_cap.capped(p.name, self.printed):  # a print in it is multiplied by every response
                values = p.call(prompt, list(responses), own_copy(task))
            if not isinstance(values, (list, tuple)):  # a dict of 2 keys would pass as 2 rewards (its keys)
                raise wrong_type(f"reward {p.name!r} returned {type(values).__name__} {_short(values)} for a group of "
                                 f"{len(responses)} responses: a served reward returns a list of one reward per response")
            if len(values) != len(responses):
                raise wrong_type(f"reward {p.name!r} returned {len(values)} values for {len(responses)} responses")
            per_part.append(values)
        out = []
        for i in range(len(responses)):
            parts: dict[str, float] = {}
            total = 0.0
            for p, values in zip(self.parts, per_part):
                if isinstance(values[i], dict):
                    self._same_keys(p.name, values[i])
                for key, v in _named(p.name, values[i]).items():
                    parts[key] = v
                    total += p.weight * v
            out.append(Reward(total, parts))
        return out

    def _same_keys(self, name: str, value: dict) -> None:
        """Warn once a part when a response's dict has other keys than the first one's: a missing key
        adds 0 to the reward, while reward/<part>/<key>/mean averages the responses that have it."""
        first = self.keys.setdefault(name, sorted(value))
        if first is not None and sorted(value) != first:
            self.keys[name] = None  # warned
            log.warning("reward %r returned a dict with keys %s for one response and %s for another: a missing key "
                        "adds 0 to the reward, and reward/%s/<key>/mean averages only the responses that have it "
                        "(it would read 1.0 where 1 response of 8 was scored 1.0). Return every key, 0.0 where it "
                        "does not apply (warned once).", name, first, sorted(value), name)

    def take_counters(self) -> dict[str, float]:
        """Served rewards' counts since the last call, as reward/<part>/<counter>."""
        out = {}
        for p in self.parts:
            take = getattr(p.call, "take_counters", None)
            for k, v in (take() if take else {}).items():
                out[f"reward/{p.name}/{k}"] = v
        return out

    def describe(self) -> str:
        """The parts by name, for messages: `reward 'correct' + 'format'`."""
        return "reward " + " + ".join(repr(p.name) for p in self.parts)

    def weights(self) -> dict[str, float]:
        return {p.name: p.weight for p in self.parts}

    def normalized(self) -> list[str]:
        return [p.name for p in self.parts if p.normalize]


def own_copy(task):
    """A reward call's own copy of `task`. A task of a study's own may hold what cannot be copied (a
    lock, an open file, a process: every call raised 'TypeError: cannot pickle ...' and every task
    failed): that is shared, and the rest copied around it, the task's fields and the dicts, lists
    and tuples in them, so that a reward's task.row["answer"] = ... still reaches neither the next
    part nor a later epoch. Only the task itself is copied field by field: an object in it that
    cannot be deep-copied is shared whole (a copy.copy of a subprocess.Popen, a second object of
    one process, could reap it under the first)."""
    try:
        return copy.deepcopy(task)
    except Exception:  # TypeError (cannot pickle), copy.Error, an object's own __deepcopy__ failing
        pass
    fields = getattr(task, "__dict__", None)
    if isinstance(fields, dict) and type(task) not in (dict, list, tuple):
        try:
            twin = copy.copy(task)  # the task's own kind, its fields then each copied where they can be
        except Exception:
            return task
        if twin is not task and getattr(twin, "__dict__", None) is not fields:
            twin.__dict__.update({k: _copied_around(v, 3) for k, v in fields.items()})
            return twin
    return _copied_around(task, 4)


def _copied_around(x, depth: int):
    """`x` deep-copied, or where it cannot be, a dict, list or tuple of its items so copied (`depth`
    levels down); anything else that cannot be copied is `x` itself."""
    try:
        return copy.deepcopy(x)
    except Exception:
        pass
    if depth and type(x) in (dict, list, tuple):
        items = [(k, _copied_around(v, depth - 1)) for k, v in (x.items() if type(x) is dict else enumerate(x))]
        return dict(items) if type(x) is dict else type(x)(v for _, v in items)
    return x


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _named(name: str, value) -> dict[str, float]:
    """A reward's value as {part: float}: a float is the part `name`, a dict's entries `name/key`."""
    if isinstance(value, dict):
        if not value:  # its sum would be a reward of 0 that no part explains
            raise wrong_type(f"reward {name!r} returned an empty dict: give it at least one part, e.g. {{'correct': 0.0}}")
        return {f"{name}/{k}": _number(v, f"{name}/{k}") for k, v in value.items()}
    return {name: _number(value, name)}


def _number(v, name: str) -> float:
    if isinstance(v, (str, bytes)):  # float("357") would make a regex's match, the model's answer, the reward
        raise wrong_type(f"reward {name!r} returned {type(v).__name__} {v!r}, not a number (text is never read as "
                         f"one: return a float, e.g. float(answer == task.answer))")
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise wrong_type(f"reward {name!r} returned {type(v).__name__} {v!r}, not a number") from None
    if not math.isfinite(x):  # one inf makes every mean, std and advantage of its step inf or NaN
        raise ValueError(f"reward {name!r} returned {x}, not a finite number")
    return x


def spec_of(reward_fn, default=None) -> Any:
    """The reward config a taskset uses (its own reward_fn, else the default), as plain Python."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    spec = reward_fn if reward_fn is not None else default
    return OmegaConf.to_container(spec, resolve=True) if isinstance(spec, (DictConfig, ListConfig)) else spec


def describe(spec) -> str:
    """A short text of a reward config, for the dry run and messages. A part's args are shown: a
    sweep over `reward_fn.0.args.<name>` is checked by the dry run's reward line, which showed
    `1 * fn` for every value (and a part given as one dict as Python's repr of it)."""
    if isinstance(spec, dict):
        spec = [spec]
    if isinstance(spec, (list, tuple)):
        return " + ".join(_describe_part(e) if isinstance(e, dict) else str(e) for e in spec)
    return str(spec)


def _describe_part(e: dict) -> str:
    from rft.reporting.redact import redact

    args = redact(e.get("args") or {})  # a remote reward's token, a judge's api_key: shown as ***
    shown = f" (args: {', '.join(f'{k}={v!r}' for k, v in args.items())})" if args else ""
    return f"{e.get('weight', 1.0):g} * {e.get('name') or e.get('fn')}{shown}"


def entries(spec, where: str) -> list[dict]:
    """A reward config as a checked list of part entries (no function is imported)."""
    if isinstance(spec, str):
        spec = [{"fn": spec}]
    elif isinstance(spec, dict):
        spec = [spec]
    if not isinstance(spec, (list, tuple)) or not spec:
        raise ConfigError(
            f"{where}={spec!r}: give a reward name (e.g. exact_match), a dotted path (module.function), "
            f"or a list of parts [{{fn: <name>, weight: 1.0, args: {{}}}}, ...]."
        )
    out, names = [], set()
    for i, e in enumerate(spec):
        key = f"{where}[{i}]"
        if isinstance(e, str):
            e = {"fn": e}
        if not isinstance(e, dict) or "fn" not in e:
            raise ConfigError(f"{key}={e!r}: each part is a name or a dict with at least `fn` (and weight, args, name, normalize).")
        unknown = sorted(set(e) - set(_ENTRY_KEYS))
        if unknown:
            raise ConfigError(f"{key} has {unknown}, which a reward part does not take; its keys are {list(_ENTRY_KEYS)}.")
        name = str(e.get("name") or str(e["fn"]).rpartition(".")[2])
        if "/" in name:
            raise ConfigError(f"{key}.name={name!r}: a part's name cannot contain '/' (it separates a dict reward's entries).")
        if name in names:
            raise ConfigError(
                f"{key}: two parts are named {name!r}; give one a `name` of its own (the parts are logged "
                f"and stored by name)."
            )
        names.add(name)
        try:
            weight = float(e.get("weight", 1.0))
        except (TypeError, ValueError):
            raise ConfigError(f"{key}.weight={e.get('weight')!r} is not a number.") from None
        if not math.isfinite(weight):  # one NaN or inf weight makes every reward of the run NaN or inf
            raise ConfigError(f"{key}.weight={weight} is not a finite number; give a weight such as 1.0 (0 turns "
                              f"the part off).")
        args = e.get("args") or {}
        if not isinstance(args, dict):
            raise ConfigError(f"{key}.args={args!r}: give the function's keyword arguments as a dict.")
        out.append({"fn": str(e["fn"]), "weight": weight, "args": dict(args), "name": name,
                    "normalize": bool(e.get("normalize", False))})
    return out


def resolve_fn(name: str, where: str):
    """A reward function or a served reward's class (a class is told apart by `isinstance(_, type)`)."""
    from rft.registry import resolve
    from rft.rewards.verifiers import REWARD_FNS

    if name in REWARD_CLIENTS:
        return REWARD_CLIENTS[name]
    try:
        return resolve(REWARD_FNS, name, where)
    except ConfigError as e:
        if name not in REWARD_FNS and "." not in name:  # list the served rewards too
            raise ConfigError(
                f"{where}={name!r} is not one of {sorted(REWARD_FNS)} (functions) or {sorted(REWARD_CLIENTS)} "
                f"(served rewards); give a registered name or the dotted path of a function with the same "
                f"signature (module.function)."
            ) from None
        raise e


def check(spec, where: str) -> list[dict]:
    """A reward config's parts exist and take the args they are given (what the plan checks)."""
    parts = entries(spec, where)
    for i, e in enumerate(parts):
        key = f"{where}[{i}].fn" if isinstance(spec, (list, tuple)) else where
        fn = resolve_fn(e["fn"], key)
        if isinstance(fn, type) and not any("__call__" in vars(k) for k in fn.__mro__[:-1]):
            raise ConfigError(f"{key}={e['fn']!r} is a class whose instances cannot be called: a served reward is a "
                              f"class with __call__(prompt, responses, task) -> list of rewards (rft/rewards/scoring.py); a "
                              f"plain reward is a function fn(prompt, response, task).")
        target = fn.__init__ if isinstance(fn, type) else fn
        params = inspect.signature(target).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            skip = 1 if isinstance(fn, type) else 3  # self | prompt, response, task
            known = [n for n in list(params)[skip:]]
            unknown = sorted(set(e["args"]) - set(known))
            if unknown:
                raise ConfigError(
                    f"{where}[{i}].args has {unknown}, which {e['fn']} does not take; its arguments are {known}."
                    f"{near_args(unknown, known)}"
                )
        third = list(params.values())[2:3] if not isinstance(fn, type) else []
        if third and third[0].name in _ANSWER_NAMES and third[0].kind is not third[0].VAR_POSITIONAL:
            raise ConfigError(
                f"{key}={e['fn']!r}: its third parameter is named {third[0].name!r}, but a reward function is called "
                f"as fn(prompt, response, task, **args): it would receive the task. Name it task and read the "
                f"reference answer as task.answer (task.row has the whole row).")
        if not isinstance(fn, type):
            try:  # what _per_response calls it with: a function of the wrong shape fails here, not in every task
                inspect.signature(fn).bind("prompt", "response", "task", **e["args"])
            except TypeError as err:
                raise ConfigError(
                    f"{key}={e['fn']!r} cannot be called as fn(prompt, response, task, **args) "
                    f"({err}); its signature is {e['fn']}{inspect.signature(fn)}. A reward function takes the "
                    f"prompt, the response and the task, then any args, and returns a float or a dict of parts."
                ) from None
    return parts


def build(spec, where: str) -> Scorer:
    """The Scorer for a reward config (served rewards are built here, once per explorer)."""
    parts = []
    for e in check(spec, where):
        fn = resolve_fn(e["fn"], where)
        if isinstance(fn, type):
            call = fn(**e["args"])
        else:
            call = _per_response(fn, e["args"])
        parts.append(Part(e["name"], e["weight"], call, e["normalize"]))
    return Scorer(parts)


def _per_response(fn, args: dict) -> Callable:
    def call(prompt, responses, task):
        # a task of its own per call: one response's call that edits it would change the next one's
        return [fn(prompt, r, own_copy(task), **args) for r in responses]

    if callable(getattr(fn, "take_counters", None)):  # a function's own counts (math: its timeouts)
        call.take_counters = fn.take_counters
    return call


def part_metrics(exps, prefix: str = "reward") -> dict:
    """`<prefix>/<part>/mean` for every part the experiences carry. A part missing from a single
    turn's experience is absent (the overlong penalty: its mean is over those it penalised); one
    missing from a conversation (info "turns": rft/rollout/workflows/multi_turn.py) counts 0, since
    its reward is the sum of the parts its environment returned: a `solved` given only when the
    game is won read 1.0 over the winners alone, beside a reward/mean of 0.03."""
    sums: dict[str, list] = {}
    for e in exps:
        for k, v in e.reward_parts.items():
            s = sums.setdefault(k, [0.0, 0])
            s[0] += v
            s[1] += 1
    convs = [e for e in exps if "turns" in e.info]
    for k, s in sums.items():
        s[1] += sum(k not in e.reward_parts for e in convs)
    return {f"{prefix}/{k}/mean": s[0] / s[1] for k, s in sorted(sums.items())}


class RunningNorm:
    """Running mean and variance of the parts marked `normalize: true`, over every rollout so far.

    Each step's values join the statistics first (Chan et al.'s parallel update, float64), then
    each normalised part becomes (value - mean) / max(std, eps) and the reward is the weighted sum
    again. While every value so far is equal (std 0), the part contributes 0: it carries no signal. The parts keep their raw values; `reward_normalized` on the experience says it was done.
    """

    def __init__(self, weights: dict[str, float], names: list[str], eps: float = 1e-6):
        self.weights, self.names, self.eps = weights, list(names), eps
        self.stats = {n: [0, 0.0, 0.0] for n in self.names}  # count, mean, M2

    def state(self) -> dict:
        return {n: list(s) for n, s in self.stats.items()}

    def load(self, state: dict | None) -> None:
        for n, s in (state or {}).items():
            if n in self.stats:
                self.stats[n] = [int(s[0]), float(s[1]), float(s[2])]

    def update(self, name: str, values: list[float]) -> None:
        if not values:
            return
        n_b = len(values)
        mean_b = math.fsum(values) / n_b
        m2_b = math.fsum((v - mean_b) ** 2 for v in values)
        n_a, mean_a, m2_a = self.stats[name]
        n = n_a + n_b
        delta = mean_b - mean_a
        self.stats[name] = [n, mean_a + delta * n_b / n, m2_a + m2_b + delta * delta * n_a * n_b / n]

    def mean_std(self, name: str) -> tuple[float, float]:
        n, mean, m2 = self.stats[name]
        return mean, math.sqrt(m2 / n) if n else 0.0

    def apply(self, exps) -> dict:
        """Update with these experiences' parts, then rewrite their rewards; returns metrics."""
        if not self.names or not exps:
            return {}
        m = {}
        for name in self.names:
            self.update(name, [_part_value(e, name) for e in exps if _has_part(e, name)])
            mean, std = self.mean_std(name)
            m[f"reward/{name}/running_mean"], m[f"reward/{name}/running_std"] = mean, std
        for e in exps:
            # parts not normalised keep weight * value (shaping parts such as overlong: weight 1)
            total = sum(self.weights.get(k.split("/")[0], 1.0) * v for k, v in e.reward_parts.items()
                        if k.split("/")[0] not in self.stats)
            for name in self.names:
                if _has_part(e, name):
                    mean, std = self.mean_std(name)
                    total += self.weights[name] * (_part_value(e, name) - mean) / max(std, self.eps)
            e.reward = total
            e.info["reward_normalized"] = True
        return m


def _has_part(exp, name: str) -> bool:
    return any(k == name or k.startswith(name + "/") for k in exp.reward_parts)


def _part_value(exp, name: str) -> float:
    """A part's value: the float, or the sum of a dict reward's entries."""
    return sum(v for k, v in exp.reward_parts.items() if k == name or k.startswith(name + "/"))


# ---------------------------------------------------------------- reward_model parts (rft/rewards/reward_model.py)
# their args, checked when planning (no torch), and the name of the worker that serves them

KINDS = ("classifier", "yes_no")

DEFAULT_CLASSIFIER_TEMPLATE = "{prompt}{response}"
DEFAULT_JUDGE_TEMPLATE = (
    "Question: {prompt}\nReference answer: {answer}\nResponse: {response}\n"
    "Is the response correct? Answer yes or no:"
)
_FIELDS = {"prompt", "response", "answer"}


def worker_args(model_path=None, kind="classifier", batch_size=8, template=None, yes_token=None, no_token=None,
                chat_template=False, max_length=None, dtype=None, num_cpus=None, colocate=False) -> dict:
    """A reward_model part's `args`, checked, with every default filled in (no torch is imported).

    Equal dicts mean one worker: `worker_name` is a hash of this."""
    if not model_path or not isinstance(model_path, str):
        raise ConfigError(f"model_path={model_path!r}: give the reward model's local directory or hub id.")
    if kind not in KINDS:
        raise ConfigError(f"kind={kind!r} is not a reward model kind; choose one of {list(KINDS)}.")
    for key, value, lo in [("batch_size", batch_size, 1), ("max_length", max_length, 1), ("num_cpus", num_cpus, 1)]:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < lo):
            raise ConfigError(f"{key}={value!r} must be an integer >= {lo}" + (" (or null)." if key != "batch_size" else "."))
    for key, value in [("chat_template", chat_template), ("colocate", colocate)]:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} must be true or false.")
    if dtype is not None:
        from rft.config import DTYPES

        if dtype not in DTYPES:
            raise ConfigError(f"dtype={dtype!r} is not a dtype; choose one of {', '.join(DTYPES)} (or null).")
    if kind == "classifier":
        if chat_template and template is not None:
            raise ConfigError("template is not used with chat_template=true for kind=classifier (the chat is "
                              "[user: question, assistant: response]); leave one of them out.")
        if yes_token is not None or no_token is not None:
            raise ConfigError("yes_token and no_token are for kind=yes_no, not kind=classifier.")
        if template is None and not chat_template:
            template = DEFAULT_CLASSIFIER_TEMPLATE
    else:
        template = DEFAULT_JUDGE_TEMPLATE if template is None else template
        yes_token = yes_token if yes_token is not None else ("Yes" if chat_template else " yes")
        no_token = no_token if no_token is not None else ("No" if chat_template else " no")
        for key, value in [("yes_token", yes_token), ("no_token", no_token)]:
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{key}={value!r} must be a non-empty string.")
        if yes_token == no_token:
            raise ConfigError(f"yes_token and no_token are both {yes_token!r}.")
    if template is not None:
        check_template(template, _FIELDS, "the model")
    return {"model_path": model_path, "kind": kind, "batch_size": batch_size, "template": template,
            "yes_token": yes_token, "no_token": no_token, "chat_template": chat_template, "max_length": max_length,
            "dtype": dtype, "num_cpus": num_cpus, "colocate": colocate}


def check_template(template, allowed: set, reader: str) -> None:
    """A served reward's prompt template: a format string of the `allowed` fields, with {response}."""
    listed = ", ".join("{" + f + "}" for f in sorted(allowed))
    if not isinstance(template, str):
        raise ConfigError(f"template={template!r} must be a string with some of {listed}, {{response}} among them.")
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise ConfigError(f"template={template!r} is not a format string ({e}); write a literal brace as {{{{ or }}}}.") from None
    if fields - allowed:
        raise ConfigError(f"template={template!r} has {sorted(fields - allowed)}; it may use {listed}.")
    if "response" not in fields:
        raise ConfigError(f"template={template!r} has no {{response}}: {reader} would not see what it scores.")


# args that say where the worker runs, not what it computes
PLACEMENT_ARGS = ("num_cpus", "colocate")


def worker_name(args: dict) -> str:
    """The Ray actor's name for these (filled-in) args: the runner starts it, the clients find it."""
    digest = hashlib.sha1(json.dumps(args, sort_keys=True).encode()).hexdigest()[:8]
    base = re.sub(r"[^A-Za-z0-9_.-]+", "_", os.path.basename(os.path.normpath(args["model_path"])))[:40]
    return f"reward_model_{base}_{digest}"


# <...>.reward_fn.<i>.args.<name> (or default_reward_fn_type's): an argument of a listed part;
# without <i>, of a reward_fn given as one part ({fn: ..., args: {...}})
_ARGS_OVERRIDE = re.compile(r"(?P<parts>.*(?:\.reward_fn|default_reward_fn_type))(?:\.(?P<i>\d+))?\.args\.(?P<name>[^.]+)")


def args_override_mistake(args: list[str], conf_dir) -> str | None:
    """The message for an override of an argument of a reward part whose entry lists no `args`
    (`...reward_fn.0.args.tag=answer`), or whose `args` lack that name (a misspelt `partail` for
    `partial`): Hydra's was "Could not override ... Key 'args' (or 'partail') is not in struct" with
    its HYDRA_FULL_ERROR hint, and its "use +" advice, which for a misspelt name only moves the error. Run before Hydra (run.py); only when such an override is
    given does it compose the config (without those overrides) to look at the parts. None for
    anything else, or a config that does not compose: Hydra says that."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser, hits, rest = OverridesParser.create(), [], []
    for a in args:
        if a.startswith("-"):
            continue
        try:
            [o] = parser.parse_overrides([a]) if "=" in a else [None]
        except Exception:
            return None  # unparsable: Hydra (or run.py's other checks) word it
        m = None if o is None or o.is_add() or o.is_force_add() or o.is_delete() else _ARGS_OVERRIDE.fullmatch(o.key_or_group)
        if m:
            hits.append((a, m))
        elif o is None or not o.is_sweep_override():  # a sweep's values cannot compose: left out (parts are rarely swept)
            rest.append(a)
    if not hits:
        return None
    try:
        cfg = _composed(rest, conf_dir)
    except Exception:
        return None
    from omegaconf import DictConfig, OmegaConf

    for arg, m in hits:
        message = _args_message(arg, m, OmegaConf.select(cfg, m["parts"], default=None))
        if message:
            return message
    return None


def _args_message(arg: str, m, parts) -> str | None:
    """args_override_mistake's paragraph for one override (`m`: its _ARGS_OVERRIDE match) of the
    composed reward config `parts`, or None where the override names an argument the part lists."""
    from omegaconf import DictConfig, OmegaConf

    if m["i"] is None:  # reward_fn as one part: its keys are the part's own
        part, label = (parts if isinstance(parts, DictConfig) else None), m["parts"]
    else:
        i = int(m["i"])
        part = parts[i] if parts is not None and not isinstance(parts, (str, DictConfig)) and i < len(parts) else None
        label = f"part {i} of {m['parts']}"
    if not isinstance(part, DictConfig):
        return None
    key, value = arg.split("=", 1)
    if "args" not in part:
        return (f"{arg}: {label} ({OmegaConf.to_container(part)}) lists no args, so it has no "
                f"args.{m['name']} to override (Hydra: Key 'args' is not in struct); its keys are {sorted(part)}. "
                f"Add the argument with a plus: +{key}={value}, or give the part `args: {{{m['name']}: ...}}` where "
                f"it is written, so that a sweep can vary it.")
    listed = part.args if isinstance(part.args, DictConfig) else {}
    if m["name"] in listed:
        return None
    return (f"{arg}: {label} ({part.get('fn')}) lists args {sorted(map(str, listed))}, not {m['name']!r} (Hydra: Key "
            f"{m['name']!r} is not in struct).{near_args([m['name']], listed)} Fix the name; an argument of the "
            f"function that the part does not list yet is added with a plus, +{key}={value} (checked against the "
            f"function's signature when planning).")


def _composed(overrides: list[str], conf_dir):
    """The config `python run.py <overrides>` composes (no sweep values: those raise)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import rft.config  # noqa: F401  the typed schema, in Hydra's ConfigStore

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(Path(conf_dir).resolve()), version_base="1.3"):
            return compose("config", overrides=overrides)
    finally:
        GlobalHydra.instance().clear()
