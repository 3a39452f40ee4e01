"""Sweeps on a real Slurm cluster (hydra/launcher=slurm through submitit), a job that dies under
Slurm, and one run over a Slurm allocation with launchers/ray_slurm.sbatch.

The Slurm tests need a cluster that answers `sinfo` and keeps accounting (`sacct`): on a Debian
machine, as root, `launchers/slurm_local.sh start` makes one on localhost (.ci/run does). Without
one they skip and say so; with RFT_REQUIRE_SLURM=1 (set by .ci/run) they fail instead.
"""

import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import CONF, ROOT, compose_cfg, run_cli

from rft.errors import ConfigError
from rft.plan.placement import check_allocation
from rft.reporting.monitor import read_metrics
from rft.reporting.sweep import explain, log_tail
from rft.runtime.checkpoint import latest_checkpoint, list_checkpoints
from rft.runtime.main import ray_namespace

# two RL steps of 4 tasks x 2 rollouts from the built tiny model, everything in the job's process
TINY = ["stages=[]", "cluster=inline", "monitor=console", "buffer.batch_size=4", "algorithm.repeat_times=2",
        "buffer.total_steps=2", "explorer.eval_interval=2", "trainer.save_interval=2",
        "hydra.launcher.timeout_min=10"]


def _slurm_problem() -> str | None:
    """None when a Slurm cluster with accounting answers here, else why not."""
    for tool in ("sbatch", "sinfo", "sacct", "scancel"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on PATH"
    try:
        states = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=20)
        if not re.search(r"^(idle|mix|alloc)", states.stdout, re.M):
            return f"sinfo shows no node taking jobs: {(states.stdout + states.stderr).strip()!r}"
        acct = subprocess.run(["sacct", "-n", "-X", "-S", "now-1minutes"], capture_output=True, text=True, timeout=20)
        if acct.returncode != 0:
            return f"sacct fails (no accounting: a dead job would never be noticed): {acct.stderr.strip()!r}"
    except subprocess.TimeoutExpired:
        return "sinfo/sacct did not answer within 20 s"
    return None


@pytest.fixture(scope="module")
def slurm():
    problem = _slurm_problem()
    if problem:
        msg = (f"no usable Slurm cluster ({problem}); start one on this machine with "
               f"`sudo launchers/slurm_local.sh start` (Debian, root), as .ci/run does")
        if os.environ.get("RFT_REQUIRE_SLURM") == "1":
            pytest.fail(msg)
        pytest.skip(msg)


def sweep_jobs(sweep) -> dict[str, str]:
    """{array task id: Slurm state} from sacct, for the jobs in the sweep's submitit folder."""
    ids = sorted(p.name for p in (sweep / ".submitit").iterdir() if re.fullmatch(r"\d+_\d+", p.name))
    (array,) = {i.split("_")[0] for i in ids}  # one Slurm job array for the whole sweep
    for _ in range(30):  # accounting can lag the job's end by a moment
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", array],
                             capture_output=True, text=True, check=True).stdout
        states = dict(line.split("|", 1) for line in out.splitlines() if line)
        if set(states) >= set(ids) and all(not s.startswith(("RUNNING", "PENDING")) for s in states.values()):
            return states
        time.sleep(1)
    return states


# ---------------------------------------------------------------- the launcher configs

def sweep_process(args: list[str]) -> subprocess.Popen:
    """`python run.py <args>` started in the background (a sweep that waits for its Slurm jobs)."""
    return subprocess.Popen([sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_step(proc, metrics, step: int, never: str, within: float = 300) -> None:
    """Until a job's metrics.jsonl has a row of `step` or later; fails with `never` if the sweep
    ends first or it takes longer than `within` seconds."""
    deadline = time.monotonic() + within
    while not any(m["step"] >= step for m in read_metrics(metrics)):
        assert proc.poll() is None and time.monotonic() < deadline, never
        time.sleep(0.2)


@pytest.mark.parametrize("launcher, target", [("slurm", "SlurmLauncher"), ("local", "LocalLauncher")])
def test_launcher_configs_compose(launcher, target):
    cfg = compose_cfg([f"hydra/launcher={launcher}"], keep_hydra=True)
    assert cfg.hydra.launcher._target_ == f"hydra_plugins.hydra_submitit_launcher.submitit_launcher.{target}"
    assert cfg.hydra.launcher.timeout_min == 240
    # each job's submitit logs sit inside the sweep's own directory
    assert (CONF / "hydra" / "launcher" / f"{launcher}.yaml").read_text().count("submitit_folder: ${hydra.sweep.dir}")


def test_allocation_must_match_the_config():
    cfg = compose_cfg(["cluster.node_num=2", "cluster.gpu_per_node=0"])
    check_allocation(cfg, env={})  # not inside Slurm: nothing to check
    check_allocation(cfg, env={"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2"})
    with pytest.raises(ConfigError) as e:
        check_allocation(cfg, env={"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1"})
    assert str(e.value) == (
        "cluster.node_num=2 but this Slurm job (7) has 1 node(s) (SLURM_JOB_NUM_NODES). Set "
        "cluster.node_num=1, or ask Slurm for 2 node(s) (sbatch --nodes=2 launchers/ray_slurm.sbatch ...).")
    cfg = compose_cfg(["cluster.gpu_per_node=8"])
    with pytest.raises(ConfigError) as e:
        check_allocation(cfg, env={"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1", "SLURM_GPUS_ON_NODE": "4"})
    assert str(e.value).startswith("cluster.gpu_per_node=8 but this Slurm job (7) has 4 GPU(s) on each node")
    assert "hydra.launcher.gpus_per_node=8" in str(e.value)


def test_sweep_jobs_sharing_a_ray_cluster_have_namespaces_of_their_own(tmp_path):
    """Jobs of one sweep share the name (grpo-tiny-arithmetic) and differ by output dir: their
    named actors (grpo_trainer, ...) must not collide on one Ray cluster."""
    cfg = compose_cfg([])
    a, b = ray_namespace(cfg, tmp_path / "0"), ray_namespace(cfg, tmp_path / "1")
    assert a.startswith("rft/grpo-tiny-arithmetic/") and b.startswith("rft/grpo-tiny-arithmetic/")
    assert a != b and a == ray_namespace(cfg, tmp_path / "x" / ".." / "0")  # the same dir, spelt otherwise


def test_cluster_local_always_starts_its_own_ray(tmp_path, monkeypatch):
    """address=None would join the cluster of the last `ray start` on this machine (its address
    file outlives a killed cluster, and ray.init then waits forever); "local" never does."""
    import ray

    import rft.runtime.main

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    assert rft.runtime.main._start_ray(compose_cfg(["cluster=local", "cluster.num_cpus=3"]), tmp_path)
    assert rft.runtime.main._start_ray(compose_cfg(["cluster=ray"]), tmp_path)
    assert [(c["address"], c["num_cpus"]) for c in calls] == [("local", 3), ("auto", None)]


def test_a_dead_jobs_error_names_the_job_state_and_log(tmp_path):
    folder = tmp_path / ".submitit" / "12_1"
    folder.mkdir(parents=True)
    # tqdm redraws with carriage returns; only the last lines that are not progress bars are kept
    (folder / "12_1_0_log.err").write_text(
        "grpo:   0%|   | 0/400 [00:00<?, ?it/s]\n\n"
        "grpo:   1%|   | 4/400 [00:01<01:52,  3.51it/s]\rgrpo:   2%| | 8/400\n"
        "slurmstepd-vm: error: *** JOB 12 ON vm CANCELLED AT 2026-11-22T12:39:12 ***\n"
        "srun: Force Terminated StepId=12.0\n")
    error = Exception(f"Job 12_1 (task: 0) with path {folder}/12_1_0_result.pkl\n"
                      "has not produced any output (state: CANCELLED by 0)\nError stream produced:\n...")
    text = explain(error, str(tmp_path))
    assert text.startswith("rft: the sweep stopped: job 12_1 ended with state CANCELLED by 0 and no result")
    assert ("\n    slurmstepd-vm: error: *** JOB 12 ON vm CANCELLED AT 2026-11-22T12:39:12 ***\n"
            "    srun: Force Terminated StepId=12.0\n") in text
    assert "it/s" not in text and f"{folder}/12_1_0_log.err" in text
    assert f"hydra.sweep.dir={tmp_path} resumes each job" in text
    # the driver waited for the other jobs before saying so
    assert "The other jobs ran to their end (the lines above say how each ended)" in text
    assert log_tail(tmp_path / "missing.err") == []


def test_a_job_slurm_ended_is_reported_without_waiting_for_a_result_file(tmp_path, monkeypatch, capsys):
    """submitit's results() waits 15 s for a job's result file (a shared filesystem may show it
    late), also for a job Slurm cancelled, which writes none: each such job kept the sweep 15 s
    longer. A job that failed by itself (FAILED: rft's error may be in a result file on its way)
    is still waited for. Real submitit Slurm jobs, `sacct` and `squeue` stood in; submitit's clock
    is a fake one that moves only when submitit sleeps."""
    from submitit.core import core
    from submitit.core.utils import UncompletedJobError
    from submitit.slurm.slurm import SlurmInfoWatcher, SlurmJob

    from rft.reporting.sweep import watch

    class Clock:
        now, slept = 1000.0, 0.0

        def time(self):
            return self.now

        def sleep(self, s):
            self.now += s
            self.slept += s

    clock = Clock()
    monkeypatch.setattr(core, "_time", clock)
    monkeypatch.setattr(SlurmJob, "watcher", SlurmInfoWatcher(delay_s=600))  # not the process's own
    (tmp_path / "bin").mkdir()
    for tool, text in (("sacct", "JobID|State|NodeList\n12_0|FAILED|vm\n12_1|CANCELLED by 0|vm\n"), ("squeue", "")):
        (tmp_path / "bin" / tool).write_text(f"#!/bin/sh\nprintf '{text}'\n")
        (tmp_path / "bin" / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    jobs = [SlurmJob(folder=tmp_path, job_id=f"12_{i}") for i in (0, 1)]
    with pytest.raises(UncompletedJobError) as e:
        watch(jobs, [["seed=1"], ["seed=2"]], 0, str(tmp_path))
    assert "(state: FAILED)" in str(e.value)  # the first dead job by number
    out = capsys.readouterr().out
    assert "[sweep] job 0 (12_0) ended with state FAILED and no result [1/2 ended]\n" in out
    assert "[sweep] job 1 (12_1) ended with state CANCELLED by 0 and no result [2/2 ended]\n" in out
    assert clock.slept == 15  # the FAILED job's 15 s (15 x 1 s); the cancelled one's 15 s no more


def test_slurms_line_in_a_jobs_log_has_its_end_seen_at_once(tmp_path, monkeypatch):
    """submitit asks sacct for a job's state every age/2 (up to every 10 min): a job cancelled
    20 min into a sweep was reported ended up to 10 min later. Slurm's line in the job's .err
    ("*** JOB 12 ON vm CANCELLED AT ...") has sacct asked at the next poll. `sacct` and `squeue`
    stood in; submitit's clock moves 10 ms a look, so its own schedule (2 s at the least) does not
    ask again."""
    from submitit.core import core
    from submitit.slurm.slurm import SlurmInfoWatcher, SlurmJob

    from rft.reporting.sweep import _ended, _slurm_ended_it

    looks = iter(range(10**6))
    monkeypatch.setattr(core, "_time", type("Slow", (), {"time": staticmethod(lambda: 1000 + next(looks) / 100)})())
    monkeypatch.setattr(SlurmJob, "watcher", SlurmInfoWatcher(delay_s=600))
    (tmp_path / "state").write_text("RUNNING")
    (tmp_path / "bin").mkdir()
    for tool, text in (("sacct", f"printf 'JobID|State|NodeList\\n12_1|%s|vm\\n' \"$(cat {tmp_path}/state)\""),
                       ("squeue", "true")):
        (tmp_path / "bin" / tool).write_text(f"#!/bin/sh\n{text}\n")
        (tmp_path / "bin" / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    job = SlurmJob(folder=tmp_path, job_id="12_1")
    line = "slurmstepd-vm: error: *** JOB 12 ON vm CANCELLED AT 2026-11-22T12:39:12 ***\n"
    polls, sleep = [], time.sleep

    def poll(s):
        if s != 1.0:  # subprocess's own waits for sacct and squeue
            return sleep(s)
        polls.append(s)
        if len(polls) == 2:  # cancelled meanwhile
            (tmp_path / "state").write_text("CANCELLED by 0")
            job.paths.stderr.write_text("step 40\n" + line)
        assert len(polls) < 6, "the cancelled job was not seen ended"

    monkeypatch.setattr(time, "sleep", poll)
    assert next(_ended([job], 1.0)) is job and polls == [1.0, 1.0]  # seen at the poll after the line
    # the line is taken once, and only whole: a line half written is read at the next look
    looked = {}
    job.paths.stderr.write_text(line[:30])
    assert not _slurm_ended_it(job, looked) and looked == {"12_1": 0}
    job.paths.stderr.write_text(line)
    assert _slurm_ended_it(job, looked) and looked == {"12_1": len(line)}
    assert not _slurm_ended_it(job, looked)
    # a progress bar's redraws (\r, no \n) are read once: 2 x 14 bytes, then Slurm's line after them
    bar = "steps: 1/9\x1b[A\r" * 2
    job.paths.stderr.write_text(line + bar)
    assert not _slurm_ended_it(job, looked) and looked == {"12_1": len(line) + 28}
    job.paths.stderr.write_text(line + bar + line)
    assert _slurm_ended_it(job, looked) and looked == {"12_1": 2 * len(line) + 28}
    # a FIFO in the log's place is no log (opened plainly, the sweep waited on it for ever)
    job.paths.stderr.unlink()
    os.mkfifo(job.paths.stderr)
    assert not _slurm_ended_it(job, {})


def test_a_submission_slurm_refuses_is_one_paragraph_naming_the_launchers_keys():
    """submitit's sbatch failed (a partition the cluster lacks, GPUs its nodes do not have, Slurm
    down): it raised FailedJobError holding sbatch's stderr, which rft called 'a job of the sweep
    failed' under Hydra's HYDRA_FULL_ERROR line, though no job had been queued."""
    from submitit.core.utils import FailedJobError

    stderr = "sbatch: error: invalid partition specified: nosuch\nsbatch: error: Batch job submission failed: Invalid partition name specified"
    try:
        raise FailedJobError(stderr) from subprocess.CalledProcessError(1, ["sbatch", "/s/submission_file.sh"], stderr=stderr)
    except FailedJobError as e:
        text = explain(e, "/s")
    assert text == (
        "rft: Slurm refused the sweep's jobs, so none was queued: sbatch: error: invalid partition specified: nosuch "
        "sbatch: error: Batch job submission failed: Invalid partition name specified. Check the launcher's keys against "
        "the cluster's partitions and nodes (hydra.launcher.partition, gpus_per_node, cpus_per_task, mem_gb, timeout_min, "
        "additional_parameters: `python run.py -m <the same overrides> --cfg hydra -p hydra.launcher` prints them; `sinfo` "
        "lists what the cluster has) and that Slurm answers (`sinfo`), then run the same command again.")


@pytest.mark.slow
def test_a_sweep_with_a_partition_slurm_lacks_stops_with_that_paragraph(slurm, tmp_path):
    r = run_cli("-m", "hydra/launcher=slurm", *TINY, "hydra.launcher.partition=nosuch", f"hydra.sweep.dir={tmp_path}")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "rft: Slurm refused the sweep's jobs, so none was queued: sbatch: error: " in r.stderr, r.stderr[-3000:]
    assert "nosuch" in r.stderr.split("so none was queued:")[1].split(". Check")[0]
    assert "Traceback" not in r.stderr and "HYDRA_FULL_ERROR" not in r.stderr


def test_slurms_reason_stays_in_the_tail_when_the_job_printed_on_after_it(tmp_path):
    # submitit ignores scancel's SIGTERM, so the job prints on until KillWait runs out
    log = tmp_path / "12_1_0_log.err"
    log.write_text("slurmstepd-vm: error: *** STEP 12.0 ON vm CANCELLED AT 2026-11-22T12:39:12 ***\n"
                   "slurmstepd-vm: error: *** JOB 12 ON vm CANCELLED AT 2026-11-22T12:39:12 ***\n"
                   + "".join(f"warning {i}\n" for i in range(20)) + "srun: error: vm: task 0: Killed\n")
    assert log_tail(log, 3) == ["slurmstepd-vm: error: *** STEP 12.0 ON vm CANCELLED AT 2026-11-22T12:39:12 ***",
                                "slurmstepd-vm: error: *** JOB 12 ON vm CANCELLED AT 2026-11-22T12:39:12 ***",
                                "warning 18", "warning 19", "srun: error: vm: task 0: Killed"]


# ---------------------------------------------------------------- on the real cluster

@pytest.mark.slow
def test_a_sweep_of_two_tiny_runs_on_slurm_and_its_report(slurm, tmp_path):
    sweep = tmp_path / "sweep"
    r = run_cli("-m", "hydra/launcher=slurm", "seed=1,2", *TINY, f"hydra.sweep.dir={sweep}")
    assert r.returncode == 0, r.stderr[-3000:]
    # one Slurm array of two tasks, both finished, as accounting records them
    states = sweep_jobs(sweep)
    assert sorted(states.values()) == ["COMPLETED", "COMPLETED"], states
    # the driver named each task, its outputs and its log as it submitted them, then each as it ended
    (array,) = {task.split("_")[0] for task in states}
    for num in (0, 1):
        task = f"{array}_{num}"
        log = sweep / ".submitit" / task / f"{task}_0_log.out"
        assert (f"[sweep] job {num} is {task} (seed={num + 1}): outputs in {sweep}/{num}, log in {log} and .err\n"
                in r.stdout), r.stdout
        metrics = read_metrics(sweep / str(num) / "metrics.jsonl")
        objective = [m["eval/accuracy"] for m in metrics if "eval/accuracy" in m][-1]
        finished = rf"^\[sweep\] job {num} \({task}\) finished, eval/accuracy = {objective:.4g} \[[12]/2 ended\]$"
        assert re.search(finished, r.stdout, re.M), r.stdout
    # each job wrote its own metrics under its own number, with its own seed
    for num, seed in (("0", 1), ("1", 2)):
        assert [m["step"] for m in read_metrics(sweep / num / "metrics.jsonl")] == [0, 1, 2]
        assert (sweep / num / ".hydra" / "overrides.yaml").read_text().count(f"seed={seed}") == 1
    r = subprocess.run([sys.executable, "-m", "rft.reporting.report", str(sweep)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = [line for line in (sweep / "report.md").read_text().splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[:5] for row in rows[1:3]] == [["| 0", "1", "", "done", "2"], ["| 1", "2", "", "done", "2"]]
    assert rows[4].startswith("| 1,2 |  | done | 2 |")  # the two seeds grouped: mean ± std
    assert (sweep / "rewards.png").stat().st_size > 10_000


@pytest.mark.slow
def test_a_killed_slurm_job_ends_the_sweep_with_a_clear_error_and_the_same_sweep_resumes_it(slurm, tmp_path):
    """Job 1 (700 steps, a checkpoint every 100) is cancelled while it trains; job 0 (2 steps)
    finishes. The sweep ends with one paragraph naming the job and its state, not a traceback, and
    not a wait forever. The same sweep again skips job 0, resumes job 1 from its newest checkpoint,
    and job 1's metrics end up whole: each step once.

    submitit's job ignores scancel's SIGTERM; Slurm kills it KillWait seconds later (5 with
    launchers/slurm_local.sh), so job 1 must have well more than that left to run when cancelled:
    a tiny step takes ~0.02 s on 2 cores, so 200 steps were not enough on a quiet machine; 700
    leave ~590 after step ~110 (cancelled once step 101 is logged, polled every 0.2 s): ~12 s there,
    2.4 x KillWait (1000 steps left 3.6 x, at the cost of 300 more steps for the resumed job: ~12 s
    in CI at ~0.04 s a step). (A checkpoint every 100, not 10: the resumed job saves 6 checkpoints,
    not 60.)"""
    sweep = tmp_path / "sweep"
    args = ["-m", "hydra/launcher=slurm", *TINY, "buffer.total_steps=2,700", "trainer.save_interval=100",
            "explorer.eval_interval=1000", f"hydra.sweep.dir={sweep}"]
    proc = sweep_process(args)
    try:
        wait_for_step(proc, sweep / "1" / "metrics.jsonl", 101, "job 1 never got to step 101")  # past its checkpoint
        (task,) = [p.name for p in (sweep / ".submitit").iterdir() if p.name.endswith("_1")]
        subprocess.run(["scancel", task], check=True)
        stdout, stderr = proc.communicate(timeout=300)  # a hang fails here
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, stderr[-3000:]
    assert f"rft: the sweep stopped: job {task} ended with state CANCELLED" in stderr, stderr[-3000:]
    assert "*** JOB" in stderr and f"{task}_0_log.err" in stderr
    assert "Traceback" not in stderr and "it/s" not in stderr and "HYDRA_FULL_ERROR" not in stderr
    assert sweep_jobs(sweep)[task].startswith("CANCELLED")
    assert re.search(rf"^\[sweep\] job 1 \({task}\) ended with state CANCELLED.* and no result", stdout, re.M), stdout
    assert re.search(r"^\[sweep\] job 0 \(\S+_0\) finished, eval/accuracy = ", stdout, re.M), stdout
    # the other job's outputs are kept
    assert [m["step"] for m in read_metrics(sweep / "0" / "metrics.jsonl")] == [0, 1, 2]
    newest = latest_checkpoint(sweep / "1").step
    assert 100 <= newest < 700 and newest % 100 == 0

    r = run_cli(*args)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    submitted = r"^\[sweep\] job (\d+) is \S+ \(.*\): outputs in .*, log in (\S+) and \.err$"
    logs = dict(re.findall(submitted, r.stdout, re.M))
    assert "[grpo] already finished (step 2)" in Path(logs["0"]).read_text()
    assert f"[grpo] resuming from step {newest} (" in Path(logs["1"]).read_text()
    assert [m["step"] for m in read_metrics(sweep / "0" / "metrics.jsonl")] == [0, 1, 2]
    assert [m["step"] for m in read_metrics(sweep / "1" / "metrics.jsonl")] == list(range(701))


def test_the_slurm_launcher_requeues_a_job_by_default():
    launcher = compose_cfg(["hydra/launcher=slurm"], keep_hydra=True).hydra.launcher
    assert (launcher.max_num_timeout, launcher.signal_delay_s) == (3, 120)
    assert launcher.additional_parameters == {"requeue": True}  # sbatch --requeue
    # README: sbatch options of one's own are added with +, and the requeue stays (Hydra merges
    # the dict); hydra.launcher.additional_parameters.requeue=false turns it off
    added = compose_cfg(["hydra/launcher=slurm", "+hydra.launcher.additional_parameters={mail_type: END}"],
                        keep_hydra=True).hydra.launcher
    assert added.additional_parameters == {"requeue": True, "mail_type": "END"}
    off = compose_cfg(["hydra/launcher=slurm", "hydra.launcher.additional_parameters.requeue=false"],
                      keep_hydra=True).hydra.launcher
    assert off.additional_parameters == {"requeue": False}


def test_a_requeued_slurm_job_knows_its_own_earlier_attempt(tmp_path, monkeypatch):
    """The run lock names the Slurm job that wrote the directory; the same job requeued (Slurm's
    SLURM_RESTART_COUNT > 0, the job id kept) is that run's next attempt, any other run is not."""
    from rft.runtime.rundir import requeued, run_lock
    from rft.studio.index import holder_alive

    monkeypatch.setenv("SLURM_JOB_ID", "7")
    with run_lock(tmp_path) as before:
        assert before == ""  # no run wrote here before
        assert (tmp_path / ".run.lock").read_text() == f"pid {os.getpid()} on {socket.gethostname()} (Slurm job 7)\n"
        assert holder_alive(tmp_path) is True  # the studio still reads the holder's pid and host
    with run_lock(tmp_path) as before:
        assert before == f"pid {os.getpid()} on {socket.gethostname()} (Slurm job 7)"
    assert requeued(before, {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"}) == "Slurm job 7, restart 1"
    assert requeued(before, {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "0"}) is None  # its first attempt
    assert requeued(before, {"SLURM_JOB_ID": "8", "SLURM_RESTART_COUNT": "1"}) is None  # another job's outputs
    assert requeued(before, {"SLURM_RESTART_COUNT": "1"}) is None  # not in Slurm
    assert requeued("pid 12 on vm", {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "2"}) is None  # written outside Slurm


# ---------------------------------------------------------------- Slurm's warning, without Slurm

class FakeSubmitit:
    """submitit's SignalHandler as rft.runtime.preemption sees it: the verdict time limit or
    preemption (`has_timed_out`), and the handler that requeues the job and exits."""

    def __init__(self):
        self.verdicts, self.calls = 0, []

    def has_timed_out(self) -> bool:
        self.verdicts += 1
        return False

    def checkpoint_and_try_requeue(self, signum, frame):
        self.calls.append((signum, threading.current_thread().name, self.has_timed_out()))
        sys.exit(-1)


@pytest.fixture
def warned(monkeypatch):
    """A watcher of SIGUSR2 in this process, as in a submitit Slurm job; `start(window_s)`."""
    from rft.runtime import preemption

    made = []

    def start(window_s: float = 120.0, time_left=lambda: None, fake=None):  # (None: no end time of the job read)
        fake = fake or FakeSubmitit()
        watcher = preemption.Preemption(signal.SIGUSR2, fake.checkpoint_and_try_requeue, window_s, time_left)
        watcher.start()
        made.append(watcher)
        monkeypatch.setattr(preemption, "current", watcher)
        return watcher, fake

    yield start
    for watcher in made:
        watcher.stop()
    assert signal.SIGUSR2 not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # unblocked again


def signal_until(watcher, within: float = 5.0) -> None:
    """SIGUSR2 to this process, as Slurm sends it; until the watcher took it."""
    os.kill(os.getpid(), signal.SIGUSR2)
    deadline = time.monotonic() + within
    while not watcher.signalled:
        assert time.monotonic() < deadline, "the watcher never took the signal"
        time.sleep(0.01)


def test_slurms_warning_during_a_step_saves_that_step_then_requeues(warned, caplog):
    from rft.runtime import preemption

    caplog.set_level(logging.INFO, logger="rft.runtime.preemption")

    def slow_squeue():  # the job's end time read at the signal, slowly: the step that ends meanwhile
        time.sleep(0.2)  # is not saved for it, and the watcher's line comes before the saving step's
        return None

    watcher, fake = warned(time_left=slow_squeue)
    # started after the watcher: the signal reaches it blocked, and it lives on (SIGUSR2's
    # default action ends a process: Ray's actors, reward workers, vLLM's engine)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(20)"])
    lines = []
    try:
        with pytest.raises(SystemExit) as e, watcher.steps("grpo", lines.append):
            assert preemption.due(6) is False  # no warning yet: step 6 goes on as planned
            os.kill(os.getpid(), signal.SIGUSR2)
            step = 7
            while not preemption.due(step):  # steps end, one every millisecond
                time.sleep(0.001)
                step += 1
            assert step > 7  # (the steps during the 0.2 s were not saved)
            os.kill(child.pid, signal.SIGUSR2)
            assert fake.calls == [] and fake.verdicts == 1  # the verdict is taken at the signal
            preemption.requeue_if_signalled()  # after that step's checkpoint
        time.sleep(0.2)
        assert child.poll() is None
    finally:
        child.kill()
    assert e.value.code == -1
    # submitit's handler ran once, in the main thread, with the verdict of the signal's time
    assert fake.calls == [(signal.SIGUSR2, "MainThread", False)] and fake.verdicts == 1
    assert lines == [  # (no end time of the job read here: signal_delay_s 120 - 30 s = 90 s)
        "[grpo] preemption signal (SIGUSR2): the step in progress ends and its checkpoint is saved, then the job "
        "is requeued (if that takes more than 90 s, it is requeued without that checkpoint)",
        f"[grpo] preemption signal: saving the checkpoint at step {step}, then requeue"]
    assert [r.getMessage() for r in caplog.records] == lines  # and in the run's log


def test_the_step_that_ends_after_the_warning_is_saved_logged_and_then_requeued(warned):
    """The schedule's side (rft/runtime/schedule.py): a step's end saves a checkpoint only every
    trainer.save_interval steps (10), and the step that ends after the warning too; it is logged
    after its checkpoint, as any step (a kill between them must not lose the row), then the job is
    requeued."""
    from types import SimpleNamespace

    from rft.runtime.schedule import Schedule

    watcher, fake = warned()
    done = []
    run = object.__new__(Schedule)
    run.cfg = compose_cfg(["trainer.save_interval=10"])
    run.plan = SimpleNamespace(total_steps=20)
    run.trainer, run.explores = None, True  # (no trainer, no explorer: no sync, no eval)
    run.pool = SimpleNamespace(explorers=[], synced=0)
    run.monitor = SimpleNamespace(log=lambda step, metrics: done.append(("log", step)))
    run._save = lambda step, metrics: done.append(("save", step))
    with pytest.raises(SystemExit), watcher.steps("grpo", lambda text: None):
        run._end_step(3, {}, time.perf_counter())
        signal_until(watcher)
        assert fake.calls == []
        run._end_step(4, {}, time.perf_counter())
    assert done == [("log", 3), ("save", 4), ("log", 4)] and len(fake.calls) == 1


def test_slurms_warning_outside_the_step_loop_requeues_at_once(warned, capsys):
    watcher, fake = warned()
    with pytest.raises(SystemExit):  # in the main thread, at its next bytecode, as submitit's own
        os.kill(os.getpid(), signal.SIGUSR2)
        for _ in range(500):
            time.sleep(0.01)
    assert fake.calls == [(signal.SIGUSR2, "MainThread", False)]
    assert "preemption signal: no step in progress to save; the job is requeued now" in capsys.readouterr().out


def test_how_long_the_step_and_its_save_may_take_after_the_warning():
    from rft.runtime import preemption

    def deadline(window_s, left):
        return preemption.Preemption(signal.SIGUSR2, None, window_s, lambda: left)._deadline_s()

    assert deadline(120, 200) == 170  # Slurm's end time in 200 s: 30 s kept for the requeue
    assert deadline(120, 40) == 20  # a short GraceTime: max(40 - 30, 40 / 2)
    assert deadline(120, None) == 90  # no end time read (no squeue): signal_delay_s - 30


def test_a_step_and_save_that_outlast_the_warning_are_cut_by_the_requeue(warned):
    """signal_delay_s 0.4 (no end time): the watcher waits max(0.4 - 30, 0.4 / 2) = 0.2 s, then
    requeues the job itself (a late save must not cost the requeue), and the main thread exits."""
    watcher, fake = warned(window_s=0.4)
    lines = []
    t0 = time.monotonic()
    with pytest.raises(SystemExit), watcher.steps("grpo", lines.append):
        signal_until(watcher)
        for _ in range(500):  # a long step: never at a step's end
            time.sleep(0.01)
    assert 0.2 <= time.monotonic() - t0 < 3
    assert fake.calls == [(signal.SIGUSR2, "rft-preemption", False)]  # once, by the watcher
    assert lines[-1] == ("[grpo] preemption signal: the step and its checkpoint did not end within 0 s "
                         "(30 s before Slurm stops the job): the job is requeued now, without it; it resumes "
                         "from its newest whole checkpoint")


def test_a_step_that_fails_after_the_warning_requeues_the_job_as_before(warned):
    watcher, fake = warned()
    lines = []
    with pytest.raises(SystemExit), watcher.steps("grpo", lines.append):
        signal_until(watcher)
        raise RuntimeError("the trainer actor died")
    assert fake.calls == [(signal.SIGUSR2, "MainThread", False)]
    assert lines[-1] == ("[grpo] preemption signal: the step or its checkpoint failed (RuntimeError: the trainer "
                         "actor died); the job is requeued without it")


class RefusingSubmitit(FakeSubmitit):
    """submitit's handler where the job has reached its time limit max_num_timeout times: no requeue."""

    def checkpoint_and_try_requeue(self, signum, frame):
        from submitit.core.utils import UncompletedJobError

        self.calls.append((signum, threading.current_thread().name, self.has_timed_out()))
        raise UncompletedJobError("Job not requeued because: timed-out too many times.")


@pytest.mark.parametrize("late", [False, True])
def test_a_refused_requeue_ends_the_job_with_one_paragraph_not_a_traceback(warned, late, monkeypatch, tmp_path,
                                                                           capsys):
    """submitit refuses the requeue (the job reached its time limit hydra.launcher.max_num_timeout
    times) after the warning's step was saved (`late`: the watcher's own requeue, the step and its
    save too slow): its UncompletedJobError was raised in the job, Hydra caught it, and the sweep
    ended with its traceback after the summary. Now the job stops with one paragraph (exit 1), which
    the sweep's own paragraph shows in the job's log lines; an `except Exception` on the way (a
    checkpoint's save, a trainer's load) does not take it for their own failure."""
    from rft.runtime import main as entry
    from rft.runtime import preemption

    watcher, fake = warned(window_s=0.4 if late else 120.0, fake=RefusingSubmitit())
    with pytest.raises(preemption.Refused) as e, watcher.steps("grpo", lambda text: None):
        signal_until(watcher)
        try:
            if late:  # a long step: never at a step's end (the watcher requeues after 0.2 s)
                for _ in range(500):
                    time.sleep(0.01)
            else:
                assert preemption.due(7)
                preemption.requeue_if_signalled()  # after step 7's checkpoint
        except Exception:
            pytest.fail("the refusal was caught as an Exception")
    assert len(fake.calls) == 1
    assert not isinstance(e.value, Exception)  # (SystemExit's kind: past any `except Exception`)

    # rft.runtime.main: the paragraph, the newest whole checkpoint of the run, how to go on
    (tmp_path / "0" / "checkpoints" / "step_7").mkdir(parents=True)
    (tmp_path / "0" / "checkpoints" / "step_7" / "state.json").write_text('{"step": 7}')
    monkeypatch.setattr(entry, "_main", lambda cfg: (_ for _ in ()).throw(e.value))
    monkeypatch.setattr(entry, "run_dir_of", lambda cfg: tmp_path / "0")
    monkeypatch.setattr(entry, "_sweep_dir", lambda: str(tmp_path))
    monkeypatch.setattr(preemption, "_launcher_key", {"timeout_min": 10, "max_num_timeout": 0}.get)
    with pytest.raises(SystemExit) as exit_:
        entry.main(compose_cfg([]))
    assert exit_.value.code == 1
    assert capsys.readouterr().err == (
        "\nrft: the run stopped: Slurm's warning came (SIGUSR2, the job's time limit near or a preemption) and "
        "submitit did not requeue the job: Job not requeued because: timed-out too many times (a job outlives its "
        "time limit, hydra.launcher.timeout_min=10, by a requeue hydra.launcher.max_num_timeout=0 times). The job "
        f"ends here; the newest checkpoint: {tmp_path / '0' / 'checkpoints' / 'step_7'}. To go on from it, run the "
        f"sweep again with hydra.sweep.dir={tmp_path} (its finished jobs are skipped; this one resumes from that "
        "checkpoint), with a larger hydra.launcher.timeout_min or hydra.launcher.max_num_timeout.\n\n")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lora", "explore"])
def test_the_warning_saves_the_step_of_a_lora_run_and_of_an_explorer_then_it_resumes_from_it(warned, kind, tmp_path):
    """The save the warning asks for, in a run of trainer=torch with LoRA (adapter/ is what resumes)
    and in a mode=explore run (its place, state.json, and the experiences it wrote): the whole run in
    this process, Slurm's signal sent once step 3 is logged, save_interval 1000 (no regular
    checkpoint before the last step). The same run again resumes from the saved step and writes
    each step (and, explored, each task's group) once. (On the local Slurm the same two runs were
    preempted and requeued by submitit: tests take this path, which adds no minute of Slurm.)"""
    import rft.runtime.main
    from rft.data.buffer import read_experiences
    from rft.runtime import preemption

    db = tmp_path / "exp.db"
    args = ["stages=[]", "cluster=inline", "monitor=console", "buffer.batch_size=4", "algorithm.repeat_times=2",
            "explorer.eval_interval=1000", "trainer.save_interval=1000", "explorer.eval_on_startup=false",
            "buffer.total_steps=12", "stage_cache_dir=null", f"checkpoint_root_dir={tmp_path}", "name=run",
            *(["model.lora.rank=4", "model.lora.alpha=8"] if kind == "lora" else
              ["mode=explore", "buffer=sql", f"buffer.trainer_input.experience_buffer.path={db}"])]
    run = tmp_path / "rft" / "run"
    watcher, fake = warned()

    def signal_at_step_3():
        while not any(m["step"] >= 3 for m in read_metrics(run / "metrics.jsonl")):
            time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGUSR2)

    threading.Thread(target=signal_at_step_3, daemon=True).start()
    with pytest.raises(SystemExit):  # submitit's requeue (its handler exits)
        rft.runtime.main.main(compose_cfg(args))
    assert len(fake.calls) == 1
    saved = latest_checkpoint(run)
    assert 3 <= saved.step < 12 and [c.step for c in list_checkpoints(run)] == [saved.step]
    assert sorted(p.name for p in saved.path.iterdir()) == (
        ["adapter", "hf", "manifest.json", "state.json", "trainer_state.pt"] if kind == "lora"
        else ["manifest.json", "state.json"])
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == list(range(1, saved.step + 1))  # (no eval)

    watcher.stop()  # the job requeued: its next attempt, here without a watcher
    preemption.current = None
    rft.runtime.main.main(compose_cfg(args))
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == list(range(1, 13))
    if kind == "explore":  # 12 steps x 4 tasks x 2 rollouts, each task's group once
        stored = read_experiences(str(db), limit=10_000)
        assert len(stored) == 96 and len({e.task_id for e in stored}) == 48


def test_a_job_script_that_forwards_the_warning_requeues_its_own_job(monkeypatch, tmp_path, capsys):
    """launchers/ray_slurm.sbatch (no submitit) sets RFT_REQUEUE_SIGNAL=USR2: the watcher's
    handler is then `requeue_self`, `scontrol requeue <its job>` (stood in here), then exit; where
    scontrol fails, one paragraph saying to submit the script again."""
    from rft.runtime import main as entry
    from rft.runtime import preemption

    monkeypatch.setenv("RFT_REQUEUE_SIGNAL", "USR2")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    assert preemption._submitit_handler() == (signal.SIGUSR2, preemption.requeue_self)
    monkeypatch.delenv("SLURM_JOB_ID")
    assert preemption._submitit_handler() == (None, None)  # not in Slurm: SIGUSR2 as before
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/called\n[ -e {tmp_path}/refuse ] || exit 0\n'
                        'echo "scontrol: error: Requested operation is presently disabled for job 7" >&2; exit 1\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    for refuse in (False, True):
        if refuse:
            (tmp_path / "refuse").touch()
        watcher = preemption.Preemption(signal.SIGUSR2, preemption.requeue_self, 120.0)
        watcher.start()
        try:
            with pytest.raises(SystemExit) as e, watcher.steps("grpo", lambda text: None):
                monkeypatch.setattr(preemption, "current", watcher)
                signal_until(watcher)
                assert preemption.due(4)
                preemption.requeue_if_signalled()
        finally:
            watcher.stop()
        assert isinstance(e.value, preemption.Refused) == refuse
    assert (tmp_path / "called").read_text() == "requeue 7\nrequeue 7\n"
    assert capsys.readouterr().out.count(  # once per signal, said before scontrol is called
        "rft: requeueing Slurm job 7 (scontrol requeue): it runs again and resumes from its newest checkpoint\n") == 2
    monkeypatch.setattr(entry, "_main", lambda cfg: (_ for _ in ()).throw(e.value))
    monkeypatch.setattr(entry, "_resume_point", lambda cfg: "the newest checkpoint: /r/checkpoints/step_4")
    monkeypatch.setattr(preemption, "current", None)
    with pytest.raises(SystemExit) as exit_:
        entry.main(compose_cfg([]))
    assert exit_.value.code == 1
    assert capsys.readouterr().err == (
        "\nrft: the run stopped: Slurm's warning came (SIGUSR2, the job's time limit near or a preemption) and the "
        "job could not requeue itself: `scontrol requeue 7` failed: scontrol: error: Requested operation is "
        "presently disabled for job 7. The job ends here; the newest checkpoint: /r/checkpoints/step_4. To go on "
        "from it, submit the same job script with the same overrides again (sbatch launchers/ray_slurm.sbatch ...): "
        "it resumes from that checkpoint.\n\n")


def test_the_watcher_is_there_only_in_a_submitit_slurm_job(monkeypatch):
    from submitit.core.job_environment import SignalHandler

    from rft.runtime import preemption

    handler = SignalHandler(None, None, None).checkpoint_and_try_requeue
    before = signal.signal(signal.SIGUSR2, handler)
    try:
        monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
        with preemption.watch():
            assert preemption.current is None  # not in a submitit job: SIGUSR2 as before
        monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
        monkeypatch.setattr(preemption, "_signal_delay_s", lambda: 120.0)  # hydra.launcher.signal_delay_s
        with preemption.watch():
            watcher = preemption.current
            assert watcher.requeue_fn == handler and watcher.window_s == 120
            assert watcher.time_left is preemption._slurm_time_left  # Slurm's end time of the job
            assert signal.SIGUSR2 in signal.pthread_sigmask(signal.SIG_BLOCK, [])
        assert preemption.current is None and signal.getsignal(signal.SIGUSR2) == handler
        assert signal.SIGUSR2 not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)  # something else handles it: left alone
        with preemption.watch():
            assert preemption.current is None
    finally:
        signal.signal(signal.SIGUSR2, before)


@pytest.mark.slow
def test_a_preempted_slurm_job_saves_the_step_it_is_at_and_resumes_from_it(slurm, tmp_path):
    """SIGUSR2 while the job trains, as Slurm sends it on preemption (submitit calls a SIGUSR2
    before 80% of timeout_min a preemption, later a timeout), between two regular checkpoints
    (save_interval 1000 > the 24 steps: the only regular one is the last). The step in progress
    ends, its checkpoint is saved, then submitit requeues the job; the requeued job resumes the same
    directory from that step, even with continue_from_checkpoint=false (the outputs are its own
    first attempt's), runs to its last step, and the sweep reports its result and exits 0 with no
    re-run by hand. On Ray (cluster=local), with two FSDP2 ranks and the explorer a step ahead into
    a SQLite buffer: Slurm signals every process of the job, and the actors must outlive it for the
    save; both ranks take part in it (a rank left out would hang the gather, and the job would not
    be requeued within the test's wait); the experiences explored ahead are kept. Slurm holds a
    requeued job for ~2 minutes before it may start again; the test lets it start at once
    (StartTime=now)."""
    sweep = tmp_path / "sweep"
    on_ray = [a if a != "cluster=inline" else "cluster=local" for a in TINY]
    args = ["-m", "hydra/launcher=slurm", *on_ray, "trainer=fsdp2", "trainer.ranks=2", "cluster.num_cpus=3",
            "buffer=sql", "synchronizer.sync_offset=1", "buffer.total_steps=24", "trainer.save_interval=1000",
            "explorer.eval_interval=24", "continue_from_checkpoint=false", "hydra.launcher.timeout_min=60",
            f"hydra.sweep.dir={sweep}"]
    metrics = sweep / "0" / "metrics.jsonl"
    proc = sweep_process(args)
    try:
        wait_for_step(proc, metrics, 5, "the job never got to step 5")
        (job,) = [p.name for p in (sweep / ".submitit").iterdir() if p.name.isdigit()]  # one job: no array
        assert latest_checkpoint(sweep / "0") is None  # before it: a requeue would start over at step 0
        subprocess.run(["scancel", "--signal=USR2", job], check=True)  # to the job's processes, as Slurm does
        deadline = time.monotonic() + 300
        while subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True).stdout.strip() != "PENDING":
            assert proc.poll() is None and time.monotonic() < deadline, "the job was not requeued"
            time.sleep(0.2)
        # what the first attempt left: a checkpoint of the step it had ended last, no step after it
        preempted = latest_checkpoint(sweep / "0")
        newest = preempted.step
        assert [m["step"] for m in read_metrics(metrics)] == list(range(newest + 1))
        assert 5 <= newest < 24
        # the explorer a step ahead (sync_offset=1): the 8 experiences (4 tasks x 2) it made for step
        # newest + 1 are in the checkpoint, unread, with their digest; 16 where the signal came after
        # step newest had already started the explore step after that one (queued behind the sync)
        buffer = preempted.state["buffer"]
        assert buffer["last_id"] - buffer["cursor"] in (8, 16) and buffer["unread_digest"]
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)
        stdout, stderr = proc.communicate(timeout=300)  # a hang fails here
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    objective = [m["eval/accuracy"] for m in read_metrics(metrics) if "eval/accuracy" in m][-1]
    assert re.search(rf"^\[sweep\] job 0 \({job}\) finished, eval/accuracy = {objective:.4g} \[1/1 ended\]$", stdout, re.M), stdout
    log = sweep / ".submitit" / job / f"{job}_0_log"
    assert "Caught signal SIGUSR2 on " in Path(f"{log}.err").read_text()
    assert "this job is preempted" in Path(f"{log}.err").read_text()
    out = Path(f"{log}.out").read_text()
    # scancel is no preemption: Slurm's end time stays the time limit's, 60 min after the start, less
    # the 30 s kept for the requeue and the minute or two the job ran
    said = re.search(r"^\[grpo\] preemption signal \(SIGUSR2\): the step in progress ends and its checkpoint is "
                         r"saved, then the job is requeued \(if that takes more than (\d+) s, it is requeued without "
                         r"that checkpoint\)$", out, re.M)
    assert said and 3300 < int(said[1]) <= 3570, out[-3000:]
    assert f"[grpo] preemption signal: saving the checkpoint at step {newest}, then requeue\n" in out
    # max_num_timeout=3, and a preemption is not counted: the requeued job ran from a pickle whose countdown
    # is still 3. submitit logs it ("Requeued job N (3 remaining timeouts)") after `scontrol requeue`, which
    # has Slurm stop the job: the line is lost where the stop comes first
    from submitit.core.utils import DelayedSubmission

    assert DelayedSubmission.load(sweep / ".submitit" / job / f"{job}_submitted.pkl")._timeout_countdown == 3
    said = re.search(rf"^.*Requeued job {job} \((\d+) remaining timeouts\)$", out, re.M)
    assert said is None or said[1] == "3", said
    assert (f"continue_from_checkpoint=false, but this is a requeued job (Slurm job {job}, restart 1) and the "
            f"outputs are its own: it resumes them") in out
    assert f"[grpo] resuming from step {newest} (" in out
    assert f"[grpo] preemption signal: saving the checkpoint at step {newest}, then requeue\n" in (
        sweep / "0" / "run.log").read_text()
    # each step once, in order: the requeued attempt went on from the step after the signal's
    assert [m["step"] for m in read_metrics(metrics)] == list(range(25))
    assert latest_checkpoint(sweep / "0").step == 24 and not list((sweep / "0").glob("previous_*"))
    for _ in range(30):  # accounting can lag the job's end by a moment
        states = subprocess.run(["sacct", "-n", "-X", "-P", "-D", "-o", "State", "-j", job],
                                capture_output=True, text=True).stdout.split()
        if states[-1:] != ["RUNNING"]:
            break
        time.sleep(1)
    assert states == ["REQUEUED", "COMPLETED"], states  # both attempts, as accounting records them
    script = (sweep / ".submitit" / job / f"{job}_submission.sh").read_text()
    assert "#SBATCH --signal=USR2@120\n" in script and "#SBATCH --requeue\n" in script


@pytest.mark.slow
def test_ray_on_slurm_launcher_trains_on_a_one_node_allocation(slurm, warm_start, tmp_path):
    """launchers/ray_slurm.sbatch: Ray head on the allocation's node, the driver joined to it,
    10 GRPO steps from the warm start learn. Slurm's warning to the script's shell (B:, as its
    #SBATCH --signal asks) once step 3 is logged: the script passes it to the driver, which saves
    the step in progress (save_interval 1000: no other checkpoint before the last) and requeues the
    job; the job runs the script again and resumes from that step (Slurm holds a requeued job ~2
    minutes: the test lets it start at once)."""
    out = tmp_path / "job.out"
    env = {**os.environ, "RFT_PYTHON": sys.executable, "RFT_RAY_WAIT_S": "120"}
    r = subprocess.run(
        ["sbatch", "--parsable", "--cpus-per-task=2", f"--output={out}", "launchers/ray_slurm.sbatch",
         "stages=[]", f"model.model_path={warm_start}", "model.builder=null", "monitor=console", "name=on_slurm",
         "buffer.total_steps=10", "explorer.eval_interval=10", "trainer.save_interval=1000",
         f"checkpoint_root_dir={tmp_path}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    job = r.stdout.strip()
    run = tmp_path / "rft" / "on_slurm"

    def state():
        return subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True).stdout.strip()

    def until(done, what, within=300):
        deadline = time.monotonic() + within
        while not done():
            assert time.monotonic() < deadline, what + (out.read_text()[-4000:] if out.exists() else "")
            time.sleep(0.2)

    try:
        until(lambda: any(m["step"] >= 3 for m in read_metrics(run / "metrics.jsonl")), "never at step 3: ")
        subprocess.run(["scancel", "--batch", "--signal=USR2", job], check=True)
        until(lambda: state() == "PENDING", "not requeued: ")
        saved = latest_checkpoint(run).step
        assert 3 <= saved < 10
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)
        until(lambda: state() == "", "the requeued job did not end: ")
    finally:
        subprocess.run(["scancel", job])
    log = out.read_text()
    assert log.count("ray_slurm: 1 Ray node(s) up") == 2 and "run.py exited with status 0" in log, log[-4000:]
    assert "ray_slurm: Slurm warns that it will stop this job: passed on to the driver\n" in log
    assert "[grpo] preemption signal (SIGUSR2): the step in progress ends and its checkpoint is saved" in log
    assert f"[grpo] preemption signal: saving the checkpoint at step {saved}, then requeue\n" in log
    assert (f"rft: requeueing Slurm job {job} (scontrol requeue): it runs again and resumes from its newest "
            "checkpoint\n") in log
    assert f"[grpo] resuming from step {saved} (" in log
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == list(range(11))
    # the job's Ray kept its files in a temp dir of its own: a later plain ray.init() on this
    # node must not find (and wait on) the job's dead cluster
    head = re.search(r"Ray head at (\S+)\n", log)[1]
    current = Path("/tmp/ray/ray_current_cluster")
    assert not current.exists() or head not in current.read_text()
    for _ in range(30):  # accounting can lag the job's end by a moment
        states = subprocess.run(["sacct", "-n", "-X", "-P", "-D", "-o", "State", "-j", job], capture_output=True,
                                text=True).stdout.split()
        if states[-1:] == ["COMPLETED"]:
            break
        time.sleep(1)
    assert states == ["REQUEUED", "COMPLETED"]  # both attempts
    metrics = read_metrics(tmp_path / "rft" / "on_slurm" / "metrics.jsonl")
    start, end = [m["eval/accuracy"] for m in metrics if "eval/accuracy" in m]
    assert end >= start + 0.2, (start, end)
    # the driver joined the Ray cluster the script started (cluster=ray at the head's address)
    overrides = (tmp_path / "rft" / "on_slurm" / ".hydra" / "overrides.yaml").read_text()
    assert "- cluster=ray\n" in overrides and f"- cluster.ray_address={head}\n" in overrides
