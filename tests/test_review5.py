"""Review of the sandbox's latest walls (rft/rollout/environments/sandbox.py): each still holds in a
caller that holds many descriptors. Isolation needs bubblewrap: without it these tests skip."""

from __future__ import annotations

import os
import resource
import uuid

import pytest
from test_sandbox import host_pids_with, isolated, no_guard  # noqa: F401 (fixtures: bubblewrap or skip; past the hook)
from test_sandbox_attacks import DAEMON

from rft.rollout.environments import sandbox


@pytest.fixture
def high_fds():
    """Descriptors 0..1099 taken, so the call's own pipes and pidfd get numbers past select()'s 1024
    (FD_SETSIZE): an explorer under vLLM or Ray runs with its soft RLIMIT_NOFILE raised and may hold as many."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"RLIMIT_NOFILE's hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_daemon_does_not_outlive_the_call_in_a_caller_of_many_descriptors(no_guard, high_fds):
    # before: bwrap's info pipe was waited on with select.select, which takes no descriptor past
    # 1023: its ValueError was taken for "no pid 1" and the pipe closed unread, bwrap died of SIGPIPE
    # writing to it, and the call ended "timed out after 10 s (killed)" with the code never run (2
    # calls of 3); a pidfd past 1023 would have raised out of run_python from _end_namespace
    markers = [f"rft-{uuid.uuid4().hex}" for _ in range(20)]
    seen = []
    try:
        for marker in markers:
            r = sandbox.run_python(f"MARKER = {marker!r}\n" + DAEMON, timeout_s=10)
            assert (r.ok, r.stdout) == (True, "returned\n")
            seen += host_pids_with(marker)
        assert seen == []
    finally:
        for pid in [pid for marker in markers for pid in host_pids_with(marker)]:
            os.kill(pid, 9)


def test_verls_clip_ratio_as_a_loss_arg_is_told_both_clip_keys_not_the_dual_clip(tmp_path):
    # before (905ebef): the nearest spelling among algorithm's keys, 'Did you mean algorithm.clip_ratio_c
    # (not clip_ratio)? ... set algorithm.clip_ratio_c=<value>': the dual clip's constant (> 1), not
    # verl's clip_ratio, which is the clip's epsilon on both sides (rft.foreign_keys says so)
    import rft.runtime.main
    from conftest import compose_cfg

    from rft.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        rft.runtime.main._main(compose_cfg(["stages=[]", "+algorithm.args.clip_ratio=0.2", "dry_run=true",
                                            f"checkpoint_root_dir={tmp_path}"]))
    assert str(e.value).endswith(
        "Did you mean algorithm.clip_ratio_low and algorithm.clip_ratio_high (not clip_ratio)? Those are keys of "
        "algorithm itself, which the function reads from cfg, not arguments: set algorithm.clip_ratio_low=<value>, "
        "algorithm.clip_ratio_high=<value>, and drop clip_ratio from the args.")


def test_a_bwrap_without_info_fd_is_no_sandbox_rather_than_every_call_failing(tmp_path):
    # before: isolation()'s probe ran bwrap without --info-fd (f95ed93 added it to run_python only),
    # so such a bwrap passed it and every call then ended 'exited with status 1: bwrap: Unknown option
    # --info-fd', the model's code never run: the environment scored it as failing code
    fake = tmp_path / "bwrap"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = "--info-fd" ] && { echo "bwrap: Unknown option --info-fd" >&2; '
                    f'exit 1; }}; done\nexec {sandbox.shutil.which("bwrap")} "$@"\n')
    fake.chmod(0o755)
    assert sandbox.isolation(str(fake)) == (None, f"{fake} failed: bwrap: Unknown option --info-fd")


def test_a_call_whose_fork_fails_leaves_no_descriptor_behind(monkeypatch):
    # before: the info pipe's read end stayed open when Popen raised (f95ed93): one descriptor a
    # failed call, 20 calls 20 more
    import errno

    def no_fork(*args, **kwargs):
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    monkeypatch.setattr(sandbox.subprocess, "Popen", no_fork)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        with pytest.raises(OSError, match="Resource temporarily unavailable"):
            sandbox.run_python("print(1)")
    assert len(os.listdir("/proc/self/fd")) == before
