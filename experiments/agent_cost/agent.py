"""The calculator study's conversation written as an agent against the `openai` client: what
`workflow: multi_turn` with `env: calculator` does (rft/rollout/workflows/multi_turn.py), as
`workflow: openai_agent` runs it, so the two workflows' cost per step compares like for like.

    python run.py experiment=calculator_tool explorer.rollout_model.enable_openai_api=true \
        buffer.explorer_input.taskset.workflow=openai_agent '~buffer.explorer_input.taskset.workflow_args.env' \
        +buffer.explorer_input.taskset.workflow_args.agent=experiments.agent_cost.agent.solve
"""

from rft.rollout.environments.tools import CalculatorEnv


def solve(client, task, model, seed, max_turns=3):
    """Up to `max_turns` replies: a tool call is answered by the calculator (a `tool` message), an
    answer ends the conversation and is scored by exact match, as the environment does."""
    env = CalculatorEnv()
    messages = list(env.reset(task))
    for turn in range(max_turns):
        reply = client.chat.completions.create(model=model, messages=messages, seed=seed + turn, stop=env.stop)
        text = reply.choices[0].message.content
        message, parts, done = env.step(text)
        messages.append({"role": "assistant", "content": text})
        if done:
            return parts["correct"]
        messages.append(message)
    return 0.0
