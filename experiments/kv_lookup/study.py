"""The kv_lookup study's own code, given to rft as dotted paths (README "Multi-turn agents and
tools", "Extension points"): a stock "database" and its tool, the environment that offers it, the
reward of the final answer, and an advantage function."""

import hashlib

import torch

from rft.rollout.environments.tools import ToolEnv, ToolError

def stock_of(sku: str) -> str:
    """The database: every SKU, two numbers of 32..99 joined by a dash ("47-83"), has a stock of
    1000..9999 (a digest of its name, so the table needs no file and the model cannot guess it)."""
    return str(1000 + int(hashlib.sha256(sku.encode()).hexdigest(), 16) % 9000)


def is_sku(sku: str) -> bool:
    parts = sku.split("-")
    return len(parts) == 2 and all(len(p) == 2 and p.isdigit() and 32 <= int(p) <= 99 for p in parts)


def stock(sku: str) -> str:
    """The tool: the stock of `sku`; an SKU the database does not hold is a failed call, which the
    model reads back as `error: <reason>`."""
    if not is_sku(sku):
        raise ToolError(f"no such sku {sku!r}: two numbers of 32..99 joined by a dash")
    return stock_of(sku)


def graded(answer: str, truth: str, tool_calls: int) -> dict:
    """The reward's parts: `correct` 1 for the exact stock; `digits` the share of the stock's digits
    the answer has in their places (partial credit: a model that copies the tool's reply digit by
    digit is rewarded on the way); `guessed` -0.2 for an answer given without looking it up."""
    answer = answer.strip()
    same = sum(a == b for a, b in zip(answer, truth)) if len(answer) == len(truth) else 0
    return {"correct": float(answer == truth), "digits": same / len(truth),
            "guessed": -0.2 if tool_calls == 0 else 0.0}


class StockEnv(ToolEnv):
    """ToolEnv with the stock tool; its final answer scored by `graded` instead of exact match."""

    tools = {"stock": stock}

    def step(self, text: str):
        reply, parts, done = super().step(text)
        if done:
            parts = graded(text, self.task.answer, self.info["tool_calls"])
        return reply, parts, done


def centred(batch, cfg, scale: float = 1.0):
    """scale x (reward - its group's mean), no division by the group's std: a group whose rewards
    barely differ gets small advantages, not unit ones."""
    rewards, groups, mask = batch["rewards"], batch["group_index"], batch["response_mask"]
    n = int(groups.max()) + 1
    total = rewards.new_zeros(n).index_add_(0, groups, rewards)
    count = rewards.new_zeros(n).index_add_(0, groups, torch.ones_like(rewards))
    adv = scale * (rewards - (total / count)[groups])
    return adv.to(mask.dtype)[:, None] * mask
