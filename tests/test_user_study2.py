"""A new user's study made from the README alone (experiments/digit_max/): its own dataset (a
directory of train.jsonl and test.jsonl, columns `puzzle` and `target`), a system prompt, a local
base model whose tokenizer has no chat template (so a template of the study's own), rewards of its
own by dotted path (a built-in verifier plus a length penalty, as named parts; one that raises
sometimes), kept outside conf/ behind `hydra.searchpath`, swept with `-m` and read with the report."""

from __future__ import annotations

import json
import os
import shutil

import pytest


def test_a_reward_that_hangs_times_out_naming_the_key_that_bounds_it(caplog):
    """A reward that hangs raises nothing: the warning was "job 0 attempt 1 timed out after 3.0 s",
    which named neither what was slow nor the key to raise; it names explorer.max_timeout now."""
    import logging
    import threading

    from rft.rollout.explorer import run_jobs

    release = threading.Event()
    with caplog.at_level(logging.WARNING, logger="rft.rollout.explorer"):
        results, counters = run_jobs(lambda job: release.wait(5), [0], runners=1, timeout=0.05, retries=0)
    release.set()  # the abandoned call's thread ends
    assert results == [None] and counters["timeouts"] == 1 and counters["failed"] == 1
    assert [r.getMessage() for r in caplog.records] == [
        "job 0 attempt 1 timed out after 0.1 s (explorer.max_timeout: its generation and reward together)"]
