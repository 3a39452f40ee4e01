"""The kv_lookup study's own code, given to rft as dotted paths (README "Multi-turn agents and
tools", "Extension points"): a stock "database" and its tool, the environment that offers it, the
reward of the final answer, and an advantage function."""

import hashlib
import string

import torch

from rft.rollout.environments.tools import ToolEnv, ToolError

LETTERS = string.ascii_lowercase


def stock_of(sku: str) -> str:
    """The database: every three-letter lowercase SKU has a stock of 10..99 (a digest of its
    name, so the table needs no file and the model cannot guess it)."""
    return str(10 + int(hashlib.sha256(sku.encode()).hexdigest(), 16) % 90)


def stock(sku: str) -> str:
    """The tool: the stock of `sku`; an SKU the database does not hold is a failed call, which the
    model reads back as `error: <reason>`."""
    if len(sku) != 3 or any(c not in LETTERS for c in sku):
        raise ToolError(f"no such sku {sku!r}: three lowercase letters")
    return stock_of(sku)


def graded(answer: str, truth: str, tool_calls: int) -> dict:
    """The reward's parts: `correct` 1 for the exact stock, and `guessed` -0.2 for an answer given
    without looking it up (a number copied from nowhere)."""
    return {"correct": float(answer.strip() == truth), "guessed": -0.2 if tool_calls == 0 else 0.0}


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
