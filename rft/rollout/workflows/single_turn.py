"""Workflows: `fn(tasks, engine, ctx) -> list[list[Experience] | None]`, one entry per task.

A workflow turns tasks into experiences: prompt -> n rollouts -> rewards. It takes a batch of
tasks (not one) so the engine can sample them all in one batched call. A taskset chooses its
workflow by name (`workflow`, a key of WORKFLOWS, or the dotted path of a function of the same
signature) and gives it keyword arguments (`workflow_args`, in `ctx.args`).

A multi-turn workflow puts the whole conversation after the first prompt into one experience and
says which of its tokens the model is trained on (`Experience.loss_mask`: 0 for the user's or an
environment's turns, whose `logprobs` entries are then ignored). The buffers and the trainer need
nothing else. Rewards go through
`ctx.score(jobs)`, which the explorer runs on its workflow runners: each task's reward call is
bounded by `explorer.max_timeout` and retried `explorer.max_retry_times` times; a task that still
fails comes back as None (no experiences), and the explorer counts it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from rft.data.experience import Experience
from rft.data.readers import chat_ids, prompt_ids
from rft.registry import Registry


@dataclass
class WorkflowContext:
    tokenizer: object
    n: int  # rollouts per task
    rollout_args: object  # temperature, top_p, top_k, max_tokens
    max_prompt_tokens: int
    policy_version: int
    seed: int
    step: int
    # score([(prompt_text, [response_text, ...], task), ...]) -> [[reward, ...] | None, ...]; each
    # reward is an rft.rewards.scoring.Reward: a float that carries its parts into the Experience built with it
    score: Callable
    # the taskset's workflow_args
    args: dict = field(default_factory=dict)
    # model.max_response_tokens (a multi-turn conversation's budget is prompt + response tokens)
    max_response_tokens: int = 0
    # call(fn, jobs, runners=None) -> [fn(job) | None, ...]: jobs on the explorer's workflow runners
    # (at most `runners`, default explorer.runner_per_model, at once), each bounded by
    # explorer.max_timeout and not retried; a job that raised or timed out gives None (an
    # environment's step, a tool call)
    call: Callable | None = None
    # explorer.rollout_model.enable_openai_api: the explorer's OpenAI-compatible server
    # (rft.serving.openai_api.OpenAIServer), else None
    openai: object = None
    # explorer.auxiliary_models: name -> engine (the same `generate` as the rollout engine; never trained)
    auxiliary: dict = field(default_factory=dict)


class Auxiliary:
    """An auxiliary model (explorer.auxiliary_models) as a workflow sees it: `ctx.auxiliary[name]`.

    `generate` is the engine's (token ids in, samples out), one call at a time (engines are not
    thread-safe, and environments step on several runner threads); `chat` is the short way to
    ask it something: messages in, the reply's text out (greedy unless told otherwise)."""

    def __init__(self, name: str, engine, tokenizer, max_tokens: int):
        import threading

        self.name, self.engine, self.tokenizer, self.max_tokens = name, engine, tokenizer, max_tokens
        self.lock = threading.Lock()

    def generate(self, prompts, n, args, seed):
        with self.lock:
            return self.engine.generate(prompts, n, args, seed=seed)

    def chat(self, messages: list[dict], temperature: float = 0.0, max_tokens: int | None = None,
             seed: int = 0, stop: list[str] | tuple = ()) -> str:
        from types import SimpleNamespace

        args = SimpleNamespace(temperature=temperature, top_p=1.0, top_k=-1, stop=list(stop),
                               max_tokens=max_tokens or self.max_tokens)
        sample = self.generate([chat_ids(self.tokenizer, messages)], 1, args, seed)[0][0]
        return self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)


def single_turn(tasks, engine, ctx: WorkflowContext) -> list[list[Experience] | None]:
    """One prompt per task, `ctx.n` sampled responses, one scalar reward each."""
    tok = ctx.tokenizer
    full = prompt_ids(tok, [t.messages for t in tasks])
    prompts = [ids[-ctx.max_prompt_tokens:] for ids in full]
    samples = engine.generate(prompts, ctx.n, ctx.rollout_args, seed=ctx.seed)
    prompt_texts = [tok.decode(p, skip_special_tokens=True) for p in prompts]
    responses = [[tok.decode(s.token_ids, skip_special_tokens=True) for s in group] for group in samples]
    rewards = ctx.score(list(zip(prompt_texts, responses, tasks)))
    args = ctx.rollout_args
    sampling = {"temperature": float(args.temperature), "top_p": float(args.top_p), "top_k": int(args.top_k)}
    out = []
    for task, prompt, whole, text, group, texts, rs in zip(tasks, prompts, full, prompt_texts, samples, responses, rewards):
        if rs is None:
            out.append(None)
            continue
        out.append([
            Experience(
                tokens=prompt + s.token_ids,
                prompt_length=len(prompt),
                logprobs=s.logprobs,
                reward=r,  # with its parts (Experience.reward_parts)
                # the seed tells apart two draws of the same task in one step
                group_id=f"{ctx.step}/{ctx.seed}/{task.task_id}",
                task_id=task.task_id,
                # a partial rollout's tokens may come from several versions: the oldest is its age
                policy_version=min(s.versions) if s.versions else ctx.policy_version,
                token_versions=list(s.versions or []),
                sampling=dict(sampling),
                # the texts are for people reading a stored buffer (python -m rft.data.buffer)
                info={"finish_reason": s.finish_reason, "prompt": text, "response": response,
                      "prompt_truncated": len(whole) > len(prompt)},
            )
            for s, response, r in zip(group, texts, rs)
        ])
    return out


# single_turn: one prompt, n responses; multi_turn: conversations with an environment
# (multi_turn.py); openai_agent: agent code against the explorer's OpenAI-compatible endpoint
# (openai_agent.py). Imported when first used: planning reads the names only
@dataclass(frozen=True)
class WorkflowInfo:
    """What planning and the messages need to know of a workflow (a study's own carries it as its
    attribute `info`)."""
    # its environment's step scores each conversation (workflow_args.env): no reward function is
    # called, and a failed task is the environment's
    environment: bool = False
    # "module.function"(args: dict, where: str) that checks its workflow_args when planning
    check_args: str | None = None
    # it calls the explorer's OpenAI-compatible endpoint (ctx.openai): planning requires
    # explorer.rollout_model.enable_openai_api, else the run stops only at its first explore step
    endpoint: bool = False


WORKFLOWS = Registry("workflow", info="info", default=WorkflowInfo(), table={
    "single_turn": ("rft.rollout.workflows.single_turn.single_turn", WorkflowInfo()),
    "multi_turn": ("rft.rollout.workflows.multi_turn.multi_turn",
                   WorkflowInfo(environment=True, check_args="rft.rollout.workflows.multi_turn.check_args")),
    "openai_agent": ("rft.rollout.workflows.openai_agent.openai_agent",
                     WorkflowInfo(endpoint=True, check_args="rft.rollout.workflows.single_turn.check_agent_args")),
})


def check_agent_args(args, where: str = "workflow_args") -> None:
    """The workflow_args of `openai_agent` fit its agent, called as agent(client, task, model=...,
    seed=..., **the rest): a key it does not take would fail every task with a TypeError at the
    first explore step, after any warm-up. Here rather than in openai_agent.py, whose HTTP client
    and server imports planning keeps out."""
    import inspect

    from rft.errors import ConfigError
    from rft.registry import resolve

    if "agent" not in args:
        raise ConfigError(f"workflow openai_agent needs {where}.agent: the dotted path of a function "
                          f"agent(client, task, model, seed, **workflow_args).")
    rest = {k: v for k, v in args.items() if k != "agent"}
    agent = resolve({}, args["agent"], f"{where}.agent")
    name, sig = args["agent"], inspect.signature(agent)
    params = list(sig.parameters.values())
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        unknown = sorted(set(rest) - {p.name for p in params[2:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)})
        if unknown:
            raise ConfigError(f"{where} has {unknown}, which the agent {name}{sig} does not take: it is called as "
                              f"agent(client, task, model=..., seed=..., **workflow_args without agent). Remove the key "
                              f"(~{where}.{unknown[0]} on the command line) or give the agent a parameter of that name "
                              f"(or **kwargs).")
    try:
        sig.bind("client", "task", **{"model": "policy", "seed": 0, **rest})
    except TypeError as e:
        missing = [p.name for p in params[2:] if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                   and p.name not in {"model", "seed", *rest}]
        if missing:
            raise ConfigError(f"the agent {name}{sig} needs {missing}, which have no default: set "
                              f"+{where}.{missing[0]}=<value>.") from None
        raise ConfigError(f"the agent {name}{sig} cannot be called as agent(client, task, model=..., seed=..., "
                          f"**{where} without agent) ({e}).") from None


def check_output(out, tasks, name: str, vocab: int | None = None, max_tokens: int | None = None) -> None:
    """What a workflow returned has the shape the buffers and the trainer rely on; a workflow of
    a study's own gets one clear message naming it, not a failure later in the trainer (or, worse,
    a step that trains on what it should not). `vocab`: the model's vocabulary size (a token id
    past it is an index error in the trainer's embedding, a device assert on a GPU); `max_tokens`:
    the most tokens an experience may hold (what the memory plan and the loss's normalisation
    assume)."""
    from rft.errors import ConfigError

    if not isinstance(out, list) or len(out) != len(tasks):
        raise ConfigError(
            f"workflow {name!r} returned {type(out).__name__} of {len(out) if hasattr(out, '__len__') else '?'} "
            f"entries for {len(tasks)} tasks; it must return one entry per task: a list of Experience, "
            f"or None for a task that failed."
        )
    seen: set[int] = set()
    owners: dict[str, str] = {}  # group_id -> the task whose entry holds it
    for task, group in zip(tasks, out):
        if group is None:
            continue
        tid = getattr(task, "task_id", task)
        if not isinstance(group, list) or not group or not all(isinstance(e, Experience) for e in group):
            got = (f"{type(group).__name__}" if not isinstance(group, list) else "an empty list" if not group else
                   f"a list holding {sorted({type(e).__name__ for e in group if not isinstance(e, Experience)})}")
            raise ConfigError(
                f"workflow {name!r} returned {got} for task {tid!r}; a task's entry is a non-empty list of "
                f"Experience (rft.data.experience), or None for a task that failed (it is then counted in "
                f"rollout/failed_tasks; an empty list would leave the task out without a count)."
            )
        for e in group:
            if id(e) in seen:  # trained twice, and shaped twice (the overlong penalty rewrites e.reward)
                raise ConfigError(
                    f"workflow {name!r} returned the same Experience object twice (task {e.task_id!r}): it would "
                    f"be trained on twice and its reward shaped twice. Build one Experience per rollout."
                )
            seen.add(id(e))
            _check_group(e, owners.setdefault(e.group_id, tid), tid, name)
            _check_experience(e, name, vocab, max_tokens)


def _check_group(e: Experience, owner, tid, name: str) -> None:
    """The trainer's groups are the experiences of one group_id (GRPO's baseline is their mean): one
    without it, or one that shares another task's, would be scored against other tasks' rollouts."""
    from rft.errors import ConfigError

    if not e.group_id or owner != tid:
        said = "no group_id" if not e.group_id else f"group_id {e.group_id!r}, which task {owner!r}'s experiences have too"
        raise ConfigError(
            f"workflow {name!r} returned an experience (task {tid!r}) with {said}: the trainer groups rollouts by "
            f"group_id (a group's advantages are relative to its mean), so each task's rollouts need one of their "
            f"own, e.g. group_id=f\"{{ctx.step}}/{{ctx.seed}}/{{task.task_id}}\" as single_turn gives them.")


def _token_id(t) -> int:
    """A token id as an int, -1 where it is none: an int, a numpy or a torch integer (engines' ids;
    Experience.to_dict stores them as ints) but not a bool or a float. operator.index also takes a
    torch bool (as 0 or 1) and a tensor or array of one element (tensor([5]): tokens from a [T, 1]
    tensor), which are no ids: refused by their dtype and shape."""
    import operator

    if isinstance(t, bool) or getattr(t, "ndim", 0) or str(getattr(t, "dtype", "")) in ("bool", "torch.bool"):
        return -1
    try:
        return operator.index(t)
    except TypeError:  # a float, a string, a float tensor
        return -1


def _check_experience(e: Experience, name: str, vocab: int | None, max_tokens: int | None) -> None:
    """One experience of a workflow's output (check_output)."""
    import math

    from rft.errors import ConfigError

    head = f"workflow {name!r} returned an experience (task {e.task_id!r})"
    if e.prompt_length < 1:
        raise ConfigError(
            f"{head} with prompt_length {e.prompt_length}: the response's first token is predicted from the "
            f"prompt, so prompt_length must be at least 1 (the prompt's token count: tokens[:prompt_length]).")
    if e.response_length < 1:  # nothing to train on, yet its reward would move its group's baseline
        raise ConfigError(
            f"{head} with no response tokens (tokens has {len(e.tokens)}, prompt_length {e.prompt_length}): every "
            f"experience needs at least one token after the prompt; return None for a task without a response (counted "
            f"in rollout/failed_tasks).")
    for field_name in ("logprobs", "loss_mask"):
        n = len(getattr(e, field_name))
        if n and n != e.response_length:
            raise ConfigError(
                f"{head} whose {field_name} has {n} entries for its {e.response_length} response tokens: it "
                f"needs one per token after the prompt (tokens[prompt_length:]), or none.")
    if max_tokens is not None and len(e.tokens) > max_tokens:
        raise ConfigError(
            f"{head} of {len(e.tokens)} tokens, more than the {max_tokens} of model.max_prompt_tokens + "
            f"model.max_response_tokens (model.max_model_len where set), the "
            f"context the memory plan sized the run for: cut the response to fit, or raise the key that sets it.")
    top = vocab or 1 << 62
    if not all(type(t) is int for t in e.tokens) or min(e.tokens) < 0 or max(e.tokens) >= top:  # C-speed first
        bad = [t for t in e.tokens if not 0 <= _token_id(t) < top]
        if bad:
            raise ConfigError(
                f"{head} with token ids {bad[:5]} outside the model's vocabulary (ints 0..{top - 1}): the trainer "
                f"could not embed them. Give the tokenizer's ids (ctx.tokenizer).")
    if not math.isfinite(e.reward):  # a NaN reward makes every advantage of its group NaN
        raise ConfigError(
            f"{head} with reward {e.reward}: rewards must be finite numbers. Score through ctx.score (which "
            f"leaves such a task out and counts it), or return None for the task.")
    if math.isfinite(sum(e.logprobs)):
        return
    mask = e.loss_mask or [1] * len(e.logprobs)
    odd = [i for i, (x, m) in enumerate(zip(e.logprobs, mask)) if m and not math.isfinite(x)]
    if odd:
        raise ConfigError(
            f"{head} whose logprobs are not finite at response tokens {odd[:5]} the loss trains on: the "
            f"ratio to the new policy would be NaN or inf. Give the engine's sampling log-probs (samples' logprobs).")
