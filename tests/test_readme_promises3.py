"""README.md's promises of the sentences added or changed beside the report's "Jobs that stopped" and
Ray's start (`cluster.init_timeout_s`) that no other test shows: a sweep job still running is not
listed as stopped, whatever rft printed on its way; a job that stopped after a warning is listed with
why it stopped, not with the warning; the 180 s bound and the 15 s line are the numbers the README
gives. All fast: files written by hand, the report read in this process, no run."""

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, compose_cfg

from rft.reporting import report
from test_user_study6 import _sweep_with_a_stopped_job as _sweep  # job 0 done, job 1 at 6 of 30

README = (ROOT / "README.md").read_text()

# lines rft prints to a job's stderr (its launcher log) while the job runs on: none says why it stopped
WHILE_RUNNING = ("rft: warning: stage grpo: reward/mean was 0 for 5 steps\n"
                 "rft: starting Ray... (15 s)\n"
                 "rft: requeueing Slurm job 173_1 (scontrol requeue): it runs again and resumes from its newest "
                 "checkpoint\n"
                 "rft: reward 'judge' printed more than 100,000 characters: what this taskset's rewards print from "
                 "here on is left out\n")


def _why(sweep: Path) -> dict[str, tuple[str, Path] | None]:
    return {j.num: report.why_stopped(j) for j in report.read_jobs(sweep)}


def test_a_job_still_running_is_not_listed_as_stopped_whatever_rft_printed(tmp_path):
    # README: under "Jobs that stopped" each job that did not finish, with why, "and that log's path
    # (a job still running has none)". A running job's log holds rft's warnings, Ray's start line
    # and a requeue's note; each was read as why it stopped (the last line starting "rft: "), so a
    # job running on read "Jobs that stopped: job 1 ...: requeueing Slurm job ..."
    sweep = _sweep(tmp_path, WHILE_RUNNING)
    assert _why(sweep) == {"0": None, "1": None}
    out = subprocess.run([sys.executable, "-m", "rft.reporting.report", str(sweep)], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    md = (sweep / "report.md").read_text()
    assert "| 1 | 1e-3 | grpo | incomplete (6/30 steps) | 6 |" in md
    assert "Jobs that stopped" not in md


@pytest.mark.parametrize("end, why", [
    # rft's paragraph, after the lines a run prints on its way
    ("rft: the run stopped: every task of the eval set failed at step 0. Fix the reward function.\n"
     "srun: error: vm: task 0: Exited with exit code 1\n",
     "the run stopped: every task of the eval set failed at step 0. Fix the reward function."),
    # Slurm's line of a time limit (README: "Slurm's line of its end: `CANCELLED`, a time limit"):
    # rft printed nothing of its end, its warning before is not why
    ("slurmstepd-vm: error: *** JOB 173 ON vm CANCELLED AT 2026-11-29T08:00:00 DUE TO TIME LIMIT ***\n",
     "Slurm: *** JOB 173 ON vm CANCELLED AT 2026-11-29T08:00:00 DUE TO TIME LIMIT ***"),
])
def test_a_stopped_job_is_listed_with_why_it_stopped_not_a_warning_before(tmp_path, end, why):
    sweep = _sweep(tmp_path, WHILE_RUNNING + end)
    log = sweep / ".submitit" / "173_1" / "173_1_0_log.err"
    assert _why(sweep) == {"0": None, "1": (why, log)}


def test_rays_start_bound_and_its_line_are_the_readmes():
    # README: "within `cluster.init_timeout_s` (`conf/cluster/local.yaml`: 180 s; from 15 s on a line
    # `rft: starting Ray... (N s)` says how long it has waited)"
    from rft.runtime import main

    words = (r"`cluster.init_timeout_s` (`conf/cluster/local.yaml`: (\d+) s; from (\d+) s on a line "
             r"`rft: starting Ray... (N s)`")
    # the README's words as a pattern: its line breaks anywhere, its numbers read
    pattern = r"\s+".join(re.escape(w).replace(r"\(\\d\+\)", r"(\d+)") for w in words.split())
    bound, first = re.findall(pattern, README)[0]
    assert compose_cfg(["cluster=local"]).cluster.init_timeout_s == float(bound) == 180
    assert main.INIT_PROGRESS_S == float(first) == 15


def test_the_reaper_says_the_wait_from_15_s_on_each_at_twice_the_last(capsys):
    # the reaper's view of a driver in ray.init, as it reads it from the driver's line; the driver
    # (suspended and killed past the bound) is not reached before the bound: None stands for it
    from rft.runtime import main, reaper

    wait = {"bound": 180.0, "resume": "", "next": main.INIT_PROGRESS_S}
    for waited, said in ((14, ""), (16, "rft: starting Ray... (16 s)\n"), (20, ""),
                         (31, "rft: starting Ray... (31 s)\n")):
        wait["since"] = time.monotonic() - waited
        assert reaper._waited_too_long(None, None, {}, wait) is False
        assert capsys.readouterr().err == said
    assert wait["next"] == 60  # 15, then 30, then 60: each line at twice the time of the one before


def test_the_start_line_names_the_stage_whose_final_model_a_stage_starts_from(tmp_path):
    # README ("Stages"): a reward-model stage's final model "is read, not started from: the stage after
    # it starts from the policy before it", and the stage "says whose as it starts ([grpo] starts from
    # dpo's final model: <run>/dpo/checkpoints/step_40/hf)". The run hands a stage the last policy's
    # path (rft.runtime.main skips a reward-model stage's, test_reward_model_training shows the
    # weights); the line names the stage that wrote it, here the warm-up before the `rm` stage
    from types import SimpleNamespace

    from rft.runtime.runner import StageRun

    said = []
    hf = tmp_path / "run" / "sft_warmup" / "checkpoints" / "step_4" / "hf"
    stage = SimpleNamespace(title="grpo", init_path=str(hf), cfg=SimpleNamespace(mode="both"),
                            monitor=SimpleNamespace(print=said.append))
    StageRun._announce(stage, 0, {}, None)
    assert said == [f"[grpo] starts from sft_warmup's final model: {hf}"]
    assert re.search(r"\(`\[grpo\] starts from dpo's final model:\s+<run>/dpo/checkpoints/step_40/hf`", README)


@pytest.mark.slow  # a refused start and a 1-step run on the tiny model (~20 s)
def test_a_configuration_error_as_the_trainer_is_built_leaves_a_record_the_fixed_command_takes_over(tmp_path):
    # README: a run stopped by a configuration error before its model and Ray are there leaves no run
    # directory (tests/test_leftovers5.py); "one found later, as a stage builds its trainer (a
    # `model.lora.target_modules` pattern that matches no module), leaves the directory with its record
    # and no checkpoint, which the corrected command takes over as its own"
    from conftest import run_cli

    args = ["cluster=inline", "stages=[]", "model.lora.rank=4", "buffer.total_steps=1",
            f"checkpoint_root_dir={tmp_path}", "name=fixed"]
    run = tmp_path / "rft" / "fixed"
    out = run_cli(*args, "model.lora.target_modules=nothing_here_.*")
    assert out.returncode == 2, out.stderr[-3000:]
    assert ("rft: configuration error: model.lora.target_modules='nothing_here_.*': Target modules nothing_here_.* "
            "not found in the base model.") in out.stderr
    assert (run / ".hydra" / "config.yaml").is_file() and not (run / "checkpoints").exists()
    out = run_cli(*args, "model.lora.target_modules=all-linear")
    assert out.returncode == 0, out.stderr[-3000:]
    assert (run / "checkpoints" / "step_1" / "adapter").is_dir()  # a LoRA run's checkpoint: the corrected one
    assert "target_modules: all-linear" in (run / "config.yaml").read_text()
    assert "nothing_here_" not in (run / ".hydra" / "config.yaml").read_text()


@pytest.mark.slow  # the tiny model's engine loaded, 255 connections opened (~7 s)
def test_the_explorers_endpoint_gives_a_slot_held_without_the_token_to_a_client_with_it(cache_dir):
    # README's threat table: "connections without the token keeping a client with it out (the
    # `--max-connections` slots are the server's ...: a connection that has not sent the token gives
    # its slot up to a new one when all are taken, the oldest first" for the reward server and the
    # explorer's OpenAI endpoint; tests/test_secrets.py shows the reward server, test_studio_guard the
    # studio, this the endpoint (its limit: rft.serving.auth.MAX_CONNECTIONS)
    import httpx
    from test_openai_api import ARGS, engine_for
    from test_reward_server import closed_by_server, raw

    from rft.models import build_tiny_model
    from rft.serving.auth import MAX_CONNECTIONS
    from rft.serving.openai_api import OpenAIServer

    engine, tok = engine_for(build_tiny_model(cache_dir / "models" / "tiny-qwen2-v2"))
    server = OpenAIServer({"policy": (engine, tok)}, "policy", ARGS, 6).start()
    base = f"http://{server.host}:{server.port}"
    held = []
    try:
        # all slots but one held by half-sent heads: with the client's, at uvicorn's limit (503 before)
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: "
        held = [raw(base, head) for _ in range(MAX_CONNECTIONS - 1)]
        deadline = time.monotonic() + 10
        while len(server.server.server_state.connections) < MAX_CONNECTIONS - 1 and time.monotonic() < deadline:
            time.sleep(0.05)  # each accepted: the client's connection is the one at the limit
        assert len(server.server.server_state.connections) == MAX_CONNECTIONS - 1
        r = httpx.get(server.url + "/models", headers={"Authorization": f"Bearer {server.token}"})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "policy"
        assert closed_by_server(held[0], 2.0)  # the oldest gave its slot up; the next ones hold theirs
        assert not any(closed_by_server(s, 0.05) for s in held[1:4])
    finally:
        for s in held:
            s.close()
        server.stop()


def _local_sweep(tmp_path: Path, jobs: int) -> Path:
    """A sweep's directory as hydra/launcher=local leaves it: each job's launcher folder named by its
    process id, no job number (.submitit/<pid>/<pid>_0_log.err), jobs started in order; job 0 killed
    at 6 of 30 steps (its log says nothing of its end), the last job stopped by a configuration error."""
    tmp_path.mkdir()
    sweep = _sweep(tmp_path, "")
    (sweep / "multirun.yaml").write_text(
        "hydra:\n  launcher:\n    _target_: hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher\n")
    for job in ("0", "1"):
        (sweep / ".submitit" / f"173_{job}" / f"173_{job}_0_log.err").unlink()
        (sweep / ".submitit" / f"173_{job}").rmdir()
    (sweep / "0" / "grpo" / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    for n, pid in enumerate((32598, 32609)[:jobs]):
        (sweep / ".submitit" / str(pid)).mkdir()
        (sweep / ".submitit" / str(pid) / f"{pid}_0_log.err").write_text(
            "rft: configuration error: model.lora.target_modules='x': no such module.\n" if n == jobs - 1 else "")
        time.sleep(0.01)  # the later job's log the newer
    if jobs == 1:
        (sweep / "1").rename(tmp_path / "not_of_this_sweep")
    return sweep


def test_a_local_sweeps_logs_named_by_process_are_not_read_as_job_0s(tmp_path):
    # hydra/launcher=local names each job's folder by its process id, so every folder read as job 0's
    # (the form of a one-job Slurm sweep): job 1's configuration error was listed as why job 0,
    # killed, stopped. Which job a process ran is not in its folder: in a local sweep of more than
    # one job none is listed (the sweep's closing message said how each ended), in one of one it is
    # job 0's (README: "Jobs that stopped", a local sweep of one job)
    sweep = _local_sweep(tmp_path / "two", jobs=2)
    assert _why(sweep) == {"0": None, "1": None}
    sweep = _local_sweep(tmp_path / "one", jobs=1)
    log = sweep / ".submitit" / "32598" / "32598_0_log.err"
    assert _why(sweep) == {"0": ("configuration error: model.lora.target_modules='x': no such module.", log)}


@pytest.mark.slow  # the tiny model loaded before the reward is built (~8 s)
def test_a_remote_reward_that_does_not_answer_leaves_a_record_with_its_token_masked(tmp_path):
    # README: a configuration error found "as a stage builds its trainer or rewards (... a remote
    # reward that does not answer) leaves the directory with its record"; the threat table: a
    # remote reward's args.token is "shown as `***` in the run's own record (`.hydra/`, each stage's
    # `config.yaml`)". Port 9 (discard) has no server here
    from conftest import run_cli

    token = "t0ken-of-a-remote-reward"
    remote = f"{{fn: remote, args: {{url: 'http://127.0.0.1:9', token: {token}}}}}"
    out = run_cli("cluster=inline", "stages=[]", "buffer.total_steps=1", f"checkpoint_root_dir={tmp_path}",
                  "name=remote", f"buffer.explorer_input.taskset.reward_fn=[{remote}]")
    assert out.returncode == 2, out.stderr[-3000:]
    assert "rft: configuration error: the remote reward at http://127.0.0.1:9 cannot be used: GET " in out.stderr
    run = tmp_path / "rft" / "remote"
    assert (run / ".hydra" / "config.yaml").is_file() and not (run / "checkpoints").exists()
    assert "token: '***'" in (run / "config.yaml").read_text()
    assert [p for p in run.rglob("*") if p.is_file() and token.encode() in p.read_bytes()] == []


@pytest.mark.slow  # a reward server and a 2-step run on the tiny model (~20 s)
def test_a_token_typed_in_args_is_in_no_file_the_run_writes(tmp_path):
    # README (the remote reward): "`args: {token: ...}` works, but is shown as `***`"; the threat table:
    # such a token is held as `***` in the run's own record. The whole run directory is searched:
    # record, logs, metrics, TensorBoard, checkpoints (trainer_state.pt, state.json, manifest) included
    import os

    from test_reward_server import TOKEN, command, stopped

    proc, url = command()
    try:
        env = {k: v for k, v in os.environ.items() if k != "RFT_REWARD_TOKEN"}  # the args' token alone
        out = subprocess.run(
            [sys.executable, str(ROOT / "run.py"), "cluster=inline", "stages=[]", "buffer.total_steps=2",
             f"checkpoint_root_dir={tmp_path}", "name=typed",
             f"buffer.explorer_input.taskset.reward_fn=[{{fn: remote, args: {{url: '{url}', token: {TOKEN}}}}}]"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    finally:
        stopped(proc)
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "rft" / "typed"
    files = [p for p in run.rglob("*") if p.is_file()]
    assert (run / "checkpoints" / "step_2" / "trainer_state.pt") in files
    assert [p for p in files if TOKEN.encode() in p.read_bytes()] == []


def test_a_slow_readers_allowance_is_the_readmes_1_kib_a_second_and_256_s_at_most():
    # README (the reward server, the endpoint and the studio alike): a client that reads nothing of its
    # answer is dropped after --request-timeout "or for the time to read at 1 KiB/s what its kernel
    # took (at most 256 s: a client reading at least 1 KiB/s is never dropped)"
    from types import SimpleNamespace

    from rft.serving.auth import TimedH11

    said = r"or for the time to read at (\d+) KiB/s what its kernel took \(at most (\d+) s:"
    rate, most = re.findall(said, README)[0]
    assert (int(rate), int(most)) == (1, 256)
    conn = SimpleNamespace(config=SimpleNamespace(request_timeout=10.0))
    allowance = {taken: TimedH11._allowance(conn, taken) for taken in (None, 4096, 175_713, 2**20)}
    # nothing known, or 4 KiB (4 s at 1 KiB/s): the request timeout; 175,713 B / 1024 B/s = 171.6 s;
    # 1 MiB: capped at 256 KiB, 256 s
    assert allowance == {None: 10.0, 4096: 10.0, 175_713: 175_713 / 1024, 2**20: 256.0}
