"""The `openai_agent` workflow: agent code written against the official `openai` client, run
against the explorer's OpenAI-compatible endpoint (rft/serving/openai_api.py, whose docstring says
what the server records and checks).

    explorer.rollout_model.enable_openai_api: true
    buffer.explorer_input.taskset.workflow: openai_agent
    buffer.explorer_input.taskset.workflow_args: {agent: my_study.agent.solve}

`ctx.n` runs of the agent per task, each under a rollout key of its own; the policy calls the
server recorded under that key are the rollout's experiences (`experiences_of`), and the agent's
return value (a float, a dict of parts, or None: the taskset's reward on its last answer) their
reward. A step's agents run at once (up to MAX_AGENTS), so the endpoint batches their requests
(rft/serving/batching.py): the calculator study's GRPO step cost 2.6x the multi_turn workflow's
instead of 13x (experiments/agent_cost/).
"""

import logging
import ssl

import httpx

from rft.data.experience import Experience
from rft.errors import ConfigError
from rft.serving.openai_api import ROLLOUT_HEADER, Call

log = logging.getLogger(__name__)

# agents run at once, each waiting on the endpoint (not the CPU): a step's rollouts up to this many,
# whatever explorer.runner_per_model; below the server's connection cap (rft.serving.auth)
MAX_AGENTS = 128


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

    server, agent, args = _agent_and_args(ctx)
    jobs = [(i, task, j) for i, task in enumerate(tasks) for j in range(ctx.n)]
    key = lambda i, task, j: f"{ctx.step}/{ctx.seed}/{task.task_id}/{j}"  # noqa: E731
    # all at once on the explorer's runners, all opened first: each request waits for every open
    # rollout's (rft/serving/batching.py), so the batches are the same in every run; else (more
    # agents than that, or no runners: one after another) each is opened when it starts
    together = ctx.call is not None and len(jobs) <= MAX_AGENTS
    if together:
        for job in jobs:
            server.open(key(*job), ctx.rollout_args)
    tls = ssl.create_default_context()  # what each client would load again (~35 ms), never used on 127.0.0.1

    def run(job):
        i, task, j = job
        if not together:
            server.open(key(*job), ctx.rollout_args)
        # a connection pool per agent (one shared by 128 agents queued them on its lock)
        client = openai.OpenAI(base_url=server.url, api_key=server.token, max_retries=0,
                               http_client=httpx.Client(verify=tls, timeout=None),
                               default_headers={ROLLOUT_HEADER: key(*job)})
        try:
            result = agent(client, task, model=server.policy, seed=(ctx.seed + i * ctx.n + j) % (2**31), **args)
        finally:  # an agent that raises leaves no history behind
            client.close()
            calls = server.take_history(key(*job))
        return result, calls

    try:
        results = (ctx.call or (lambda fn, js, runners: [fn(x) for x in js]))(run, jobs, runners=min(len(jobs), MAX_AGENTS))
    finally:
        for job in jobs:  # an agent still running past the explorer's timeout is recorded no more
            server.take_history(key(*job))
    out: list = [[] for _ in tasks]
    for (i, task, j), res in zip(jobs, results):
        if out[i] is None:
            continue
        if res is None or not res[1]:
            log.warning("task %s failed: its agent %s", task.task_id, "raised or timed out" if res is None else "made no policy call")
            out[i] = None
            continue
        value, calls = res
        reward = _reward(value, calls, task, ctx)
        if reward is None:  # the taskset's reward failed: the task's group is incomplete
            out[i] = None
            continue
        out[i] += _experiences(calls, reward, task, j, ctx)
    return out


def _agent_and_args(ctx):
    """(the explorer's endpoint, the agent function, the rest of workflow_args: the agent's keyword
    arguments); a ConfigError naming the setting that is missing."""
    from rft.registry import resolve

    server = ctx.openai
    if server is None:
        raise ConfigError("workflow openai_agent needs the explorer's endpoint: set "
                          "explorer.rollout_model.enable_openai_api=true.")
    args = dict(ctx.args)
    if "agent" not in args:
        raise ConfigError("workflow openai_agent needs workflow_args.agent: the dotted path of a function "
                          "agent(client, task, model, seed, **workflow_args).")
    agent = resolve({}, args.pop("agent"), "workflow_args.agent")
    return server, agent, args


def _reward(value, calls: list[Call], task, ctx):
    """The Reward of one run from the agent's return value: None from the agent is the taskset's
    reward on its last answer (None again when that scoring failed), a dict its parts, a number
    the reward itself."""
    from rft.rewards.scoring import Reward

    if value is None:
        last = calls[-1]
        scored = ctx.score([(last.prompt_text, [last.response_text], task)])[0]
        return None if scored is None else scored[0]
    if isinstance(value, dict):
        return Reward(sum(float(v) for v in value.values()), {k: float(v) for k, v in value.items()})
    return Reward(float(value), {"agent": float(value)})


def _experiences(calls: list[Call], reward, task, j: int, ctx) -> list[Experience]:
    """Run `j`'s experiences (experiences_of its calls), each with the run's reward."""
    return [Experience(
        tokens=tokens, prompt_length=plen, logprobs=lps, reward=reward,
        group_id=f"{ctx.step}/{ctx.seed}/{task.task_id}", task_id=task.task_id,
        policy_version=ctx.policy_version, sampling=dict(c.sampling), loss_mask=mask,
        info={"finish_reason": c.finish_reason, "prompt": c.prompt_text, "response": c.response_text,
              "rollout": j, "call": n, "prompt_truncated": False})
        for n, (tokens, plen, lps, mask, c) in enumerate(experiences_of(calls))]
