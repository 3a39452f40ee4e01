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


def test_a_run_with_a_token_in_its_config_resumes_from_what_an_rft_before_masking_wrote(tmp_path):
    # 99a0d97 masked secrets in the stage's identity: the record's first-line fingerprint and the
    # checkpoints' config fingerprint that an earlier rft wrote (the token whole) no longer matched,
    # and resuming such a run after the upgrade was refused ('... is not the one saved (cut short
    # or edited)', then the checkpoint 'of another configuration')
    from conftest import compose_cfg
    from omegaconf import OmegaConf

    from rft.plan.batch import stage_configs
    from rft.runtime import rundir

    cfg = stage_configs(compose_cfg(
        ['buffer.explorer_input.taskset.reward_fn=[{fn: remote, args: {url: "http://127.0.0.1:9", token: s3cret}}]']))[-1]
    old = rundir.fingerprint(rundir.identity(cfg, masked=False))  # how the earlier rft wrote it
    assert old != rundir.fingerprint(rundir.identity(cfg))
    (tmp_path / "config.yaml").write_text(f"# fingerprint: {old}\n{OmegaConf.to_yaml(cfg, resolve=True)}")
    assert rundir.record_problem(tmp_path) is None
    assert rundir.differences(rundir.identity(rundir.saved_config(tmp_path)), rundir.identity(cfg)) == []
    owner = rundir.owner(cfg, "grpo", None)
    written = {**owner.identity(3), "config": rundir.config_fingerprint(cfg, masked=False)}
    assert owner.differences(written) == []
    assert owner.differences({**written, "config": "0123456789abcdef"}) == ["config"]  # another config still differs


def test_a_driver_past_the_init_bound_is_killed_after_the_paragraph_never_frozen(capsys):
    # it was frozen (SIGSTOP) while Ray's processes were stopped and the paragraph written: a terminal's
    # shell, which waits for its foreground job with WUNTRACED, said '[1]+ Stopped' (status 147, not the
    # README's 137) and gave its prompt back before the paragraph
    import os
    import signal
    import threading

    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    seen = {}

    def shell():
        seen["status"] = os.waitpid(driver.pid, os.WUNTRACED)[1]
        seen["printed"] = capsys.readouterr().err  # what the terminal showed as the prompt came back

    t = threading.Thread(target=shell)
    t.start()
    try:
        wait = {"bound": 0.0, "resume": "Run the same command again.", "since": time.monotonic(), "next": 100.0}
        assert reaper._waited_too_long(psutil.Process(driver.pid), psutil.Process(), {}, wait)
        t.join(10)
    finally:
        if t.is_alive() or not seen:
            driver.kill()
            t.join(10)
        driver.returncode = -9  # reaped by the thread
    assert not os.WIFSTOPPED(seen["status"])
    assert os.WIFSIGNALED(seen["status"]) and os.WTERMSIG(seen["status"]) == signal.SIGKILL  # a shell's 137
    assert "\nrft: the run stopped: Ray's local instance did not start: ray.init waited 0 s for its GCS and raylet " \
           "to answer, past cluster.init_timeout_s=0, and the driver is stopped (exit 137). Likely causes: " in seen["printed"]
    assert seen["printed"].rstrip().endswith("Run the same command again.")


def test_a_sweeps_jobs_never_started_show_a_token_masked_as_the_started_ones(tmp_path):
    # multirun.yaml is Hydra's own file, with the command line's token whole: the report's rows of the
    # jobs it planned and never started (and of one killed before its record) showed it, and their
    # configuration (token=abc) was another than their started seeds' (token=***)
    from rft.reporting import report

    d = tmp_path / "2026-11-29_08-00-00"
    (d / "0" / ".hydra").mkdir(parents=True)
    (d / "0" / ".hydra" / "overrides.yaml").write_text("- x.args.token=***\n- seed=1\n")
    (d / "multirun.yaml").write_text(
        "hydra:\n  sweeper:\n    _target_: hydra._internal.core_plugins.basic_sweeper.BasicSweeper\n"
        "    max_batch_size: null\n    params: {}\n  overrides:\n    task: [x.args.token=s3cr3t, 'seed=1,2']\n")
    assert report.planned_jobs(d) == [{"x.args.token": "***", "seed": "1"}, {"x.args.token": "***", "seed": "2"}]


def test_a_session_name_of_no_real_date_is_left_and_does_not_stop_the_reaper():
    # strptime's ValueError (month 13) ended the reaper with a traceback before it stopped anything
    me = psutil.Process()
    odd = _sleeper(f"session_2026-13-40_00-00-00_000000_{me.pid}")
    try:
        deadline = time.time() + 10  # its command line is there once the child has exec'd
        while time.time() < deadline and "session_2026-13" not in " ".join(psutil.Process(odd.pid).cmdline()):
            time.sleep(0.05)
        assert odd.pid not in reaper._theirs({}, me.pid, me.create_time(), -1)
    finally:
        odd.kill()
        odd.wait()
