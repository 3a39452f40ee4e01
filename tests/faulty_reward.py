"""A reward function that fails on purpose, for tests/test_runtime.py (selected by dotted path).

Which tasks fail is a function of the task id, so a test can count them: h = md5(task_id) % 100;
h < 10 raises, 10 <= h < 15 sleeps 3 s (past the test's explorer.max_timeout), else exact match.
"""

import hashlib
import time

from rft.rewards.verifiers import exact_match


def fault_class(task_id: str) -> str:
    h = int(hashlib.md5(task_id.encode()).hexdigest(), 16) % 100
    return "raise" if h < 10 else "hang" if h < 15 else "ok"


def flaky(prompt, response, task):
    kind = fault_class(task.task_id)
    if kind == "raise":
        raise ValueError(f"flaky reward refuses task {task.task_id}")
    if kind == "hang":
        time.sleep(3.0)
    return exact_match(prompt, response, task)


def always_raises(prompt, response, task):
    raise ValueError(f"no reward for {task.task_id}")


def hangs(prompt, response, task):
    time.sleep(5.0)
    return 0.0


def constant(prompt, response, task):
    """The same non-dyadic value for every response: no signal at all."""
    return 0.9
