"""Reward functions: `fn(prompt, response, task) -> float`, registered by name.

`prompt` and `response` are decoded text, `task` is the `rft.tasks.Task` (its `answer` is the
reference from the taskset's `response_key`). Add one by writing the function and putting it in
`REWARD_FNS`; select it with `buffer.explorer_input.default_reward_fn_type=<name>`.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def exact_match(prompt: str, response: str, task) -> float:
    """1.0 if the response, stripped, equals the reference answer, stripped."""
    return float(response.strip() == str(task.answer).strip())


def last_number(prompt: str, response: str, task) -> float:
    """1.0 if the last number in the response equals the reference's final number.

    The reference may be a GSM8K-style solution ending in `#### 42`; its last number is used.
    """
    got = _NUMBER.findall(response.replace(",", ""))
    want = _NUMBER.findall(str(task.answer).replace(",", ""))
    return float(bool(got) and bool(want) and float(got[-1]) == float(want[-1]))


REWARD_FNS = {"exact_match": exact_match, "last_number": last_number}
