"""The guess_number study's own parts, given to rft as dotted paths (README "Extension points"):
a multi-turn game environment and a GRPO variant whose advantages are clipped."""

import re

from rft.algorithms.advantages import grpo_advantage
from rft.rollout.environments.tools import Environment


class GuessEnv(Environment):
    """Guess a secret digit (the task's answer column): each wrong guess is answered "higher" or
    "lower"; a turn without a digit is answered "a digit 1-9". Reward parts: `solved` 1 for the
    right digit, `guesses` -penalty for each guess after the first."""

    def __init__(self, penalty: float = 0.1):
        super().__init__()
        self.penalty = penalty
        self.info = {"guesses": 0}

    def reset(self, task):
        self.secret = int(task.answer)
        return task.messages

    def step(self, text: str):
        found = re.search(r"[1-9]", text)
        if found is None:
            return "a digit 1-9", {}, False
        guess = int(found.group())
        self.info["guesses"] += 1
        extra = {"guesses": -self.penalty} if self.info["guesses"] > 1 else {}
        if guess == self.secret:
            return None, {"solved": 1.0, **extra}, True
        return ("higher" if guess < self.secret else "lower"), extra, False


def clipped_grpo(batch, cfg, clip: float = 1.0):
    """GRPO's group-normalised advantage, clipped to [-clip, clip]: one lucky rollout in a group of
    failures gets +clip, not +(n-1)/sqrt(n)."""
    return grpo_advantage(batch, cfg).clamp(-clip, clip)
