"""Review of the reaper, redaction, connection slots and the morning's other changes."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time

import psutil

from rft.runtime import reaper


def _sleeper(session: str) -> subprocess.Popen:
    """A process of this user whose command line names a Ray session's directory, as a Ray worker's does."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"/tmp/ray/{session}/logs"])


def test_the_reaper_leaves_a_session_of_an_earlier_process_that_had_the_drivers_pid():
    # pids are reused (32768 of them on many machines): a `ray start` that exited long ago may have had
    # the driver's pid, and its cluster's workers started during the run are younger than the driver
    me = psutil.Process()
    started = me.create_time()
    old = f"session_2020-01-01_00-00-00_000000_{me.pid}"
    now = f"session_{datetime.datetime.today().strftime('%Y-%m-%d_%H-%M-%S_%f')}_{me.pid}"
    theirs_old, ours = _sleeper(old), _sleeper(now)
    try:
        deadline = time.time() + 10  # its command line is there once the child has exec'd
        while time.time() < deadline and ours.pid not in reaper._theirs({}, me.pid, started, -1):
            time.sleep(0.05)
        found = reaper._theirs({}, me.pid, started, -1)
        assert ours.pid in found  # this driver's own session (begun after it started)
        assert theirs_old.pid not in found  # a session of 2020 is not this driver's
    finally:
        for p in (theirs_old, ours):
            p.kill()
            p.wait()


def test_two_stages_differing_in_a_reward_argument_named_token_do_not_share_a_stage_cache_key():
    # redact masks any key named token (a remote reward's secret), and the stage's identity is
    # masked to compare with the saved record; a reward of the user's whose argument `token` is the
    # tag it looks for then gave two sweep jobs one cache key: the second reused the first's stage
    from conftest import compose_cfg

    from rft.plan.batch import stage_configs
    from rft.runtime import rundir

    def key(tag: str) -> str:
        cfg = compose_cfg([f"buffer.explorer_input.taskset.reward_fn=[{{fn: exact_match, args: {{token: '{tag}'}}}}]"])
        return rundir.cache_key(stage_configs(cfg)[-1], "start")

    assert key("<answer>") != key("</think>")
    assert key("<answer>") == key("<answer>")
