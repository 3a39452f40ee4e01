"""Workflows: `fn(tasks, engine, reward_fn, ctx) -> list[Experience]`.

A workflow turns tasks into experiences: prompt -> n rollouts -> rewards. It takes a batch of
tasks (not one) so the engine can sample them all in one batched call.
"""

from __future__ import annotations

from dataclasses import dataclass

from rft.errors import ConfigError
from rft.experience import Experience


@dataclass
class WorkflowContext:
    tokenizer: object
    n: int  # rollouts per task
    rollout_args: object  # temperature, top_p, top_k, max_tokens
    max_prompt_tokens: int
    policy_version: int
    seed: int
    step: int
    reward_name: str


def encode_prompt(tokenizer, messages: list[dict], max_prompt_tokens: int) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if hasattr(ids, "keys"):  # transformers may return a BatchEncoding
        ids = ids["input_ids"]
    # keep the end of an over-long prompt: the question and the generation prompt sit there
    return list(ids)[-max_prompt_tokens:]


def single_turn(tasks, engine, reward_fn, ctx: WorkflowContext) -> list[Experience]:
    """One prompt per task, `ctx.n` sampled responses, one scalar reward each."""
    tok = ctx.tokenizer
    prompts = [encode_prompt(tok, t.messages, ctx.max_prompt_tokens) for t in tasks]
    samples = engine.generate(prompts, ctx.n, ctx.rollout_args, seed=ctx.seed)
    exps = []
    for task, prompt, group in zip(tasks, prompts, samples):
        prompt_text = tok.decode(prompt, skip_special_tokens=True)
        for s in group:
            response = tok.decode(s.token_ids, skip_special_tokens=True)
            try:
                reward = float(reward_fn(prompt_text, response, task))
            except Exception as e:
                raise ConfigError(
                    f"reward function {ctx.reward_name!r} raised {type(e).__name__}: {e} on task "
                    f"{task.task_id} with response {response!r}. Fix the reward function."
                ) from e
            exps.append(
                Experience(
                    tokens=prompt + s.token_ids,
                    prompt_length=len(prompt),
                    logprobs=s.logprobs,
                    reward=reward,
                    # the seed tells apart two draws of the same task in one step
                    group_id=f"{ctx.step}/{ctx.seed}/{task.task_id}",
                    task_id=task.task_id,
                    policy_version=ctx.policy_version,
                    info={"finish_reason": s.finish_reason},
                )
            )
    return exps


WORKFLOWS = {"single_turn": single_turn}
