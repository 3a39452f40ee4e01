"""A researcher's sweep study (experiments/lr_vs_group/): what the sweep and its report showed."""

import json

import pytest
from conftest import run_cli
from test_report import GRPO, MULTIRUN, SFT, tables, write_job

from rft.reporting import report


def test_a_job_killed_before_its_record_is_reported_with_its_planned_overrides(tmp_path):
    """`kill -9` of a sweep two seconds into its last job left that job's directory empty (rft
    writes .hydra/ only once the run is about to start). The report gave the job no overrides: its
    row had blank sweep keys, the keys common to every job became columns ("Common to all jobs" was
    gone), and the by-configuration table showed it as a configuration of its own with blank keys.
    Its overrides are the ones multirun.yaml planned for its number, as for a job never started."""
    d = tmp_path / "2026-11-29_01-39-17"
    write_job(d, 0, ["algorithm=grpo", "seed=1", "experiment=cmp"], "grpo", {"sft_warmup": SFT, "grpo": GRPO})
    write_job(d, 1, ["algorithm=grpo", "seed=2", "experiment=cmp"], "grpo", {"sft_warmup": SFT, "grpo": GRPO})
    (d / "2").mkdir()  # killed before its record: the directory alone
    (d / "multirun.yaml").write_text(MULTIRUN)  # 4 jobs: grpo 1, grpo 2, dapo 1, dapo 2
    out = report.report(d)
    text = out["md"].read_text()
    assert "Common to all jobs: `experiment=cmp`" in text
    table, by_config = tables(out["md"])
    assert table[0].split(" | ")[:5] == ["| job", "algorithm", "seed", "stage", "status"]
    assert [r.split(" | ")[:5] for r in table[2:]] == [
        ["| 0", "grpo", "1", "grpo", "done"], ["| 1", "grpo", "2", "grpo", "done"],
        ["| 2", "dapo", "1", "", report.NO_METRICS],
        ["| 3", "dapo", "2", "", "not started (no job directory)"]]
    # grpo: both seeds done; dapo: job 2 (killed) and job 3 (never started), none done
    assert [r.split(" | ")[:5] for r in by_config[2:]] == [["| grpo", "1,2", "grpo", "done", "2"],
                                                         ["| dapo", "1,2", "", "0/2 done", "0"]]


def test_a_local_job_killed_outright_is_not_said_to_have_finished(tmp_path, capsys):
    """`kill -9` of a hydra/launcher=local job's process at step 29 of 200: submitit's local state
    for it is FINISHED (its controller, the process the sweep names, exited normally), and the
    sweep printed "[sweep] job 1 (25795) ended with state FINISHED and no result", then "the sweep
    stopped: job 25795 ended with state FINISHED": a killed job read as one that finished. The
    state of a job with no result is now told as what it is."""
    from submitit.core.utils import UncompletedJobError
    from test_sweep_local import FakeJob

    from rft.reporting.sweep import explain, watch

    dead = UncompletedJobError(f"Job 25795 (task: 0) with path {tmp_path}/.submitit/25795/25795_0_result.pkl\n"
                               "has not produced any output (state: FINISHED)\nError stream produced:\n...")
    (tmp_path / ".submitit" / "25795").mkdir(parents=True)
    (tmp_path / ".submitit" / "25795" / "25795_0_log.out").write_text("[grpo] step 20: eval accuracy 1.000\n")
    try:
        watch([FakeJob("25795", tmp_path / ".submitit" / "%j", 1, dead)], [["seed=1"]], 1, str(tmp_path), poll_s=0.01)
    except UncompletedJobError as e:
        text = explain(e, str(tmp_path))
    line = capsys.readouterr().out.splitlines()[-1]
    assert line == ("[sweep] job 1 (25795) ended with no result: its process stopped without one (submitit's "
                    "local launcher calls that state FINISHED) [1/1 ended]")
    assert text.startswith("rft: the sweep stopped: job 25795 ended with no result: its process stopped without "
                           "one (submitit's local launcher calls that state FINISHED). It was killed, cancelled, "
                           "out of memory or time, its node lost, or rft exited on an error. The last lines of its "
                           "log (25795_0_log.out):\n    [grpo] step 20: eval accuracy 1.000\n")


def test_the_studio_sweep_table_lists_every_planned_job_as_the_report_does(tmp_path):
    """The README: the studio's sweep table "is python -m rft.reporting.report's". For a sweep
    killed in its third of four jobs the report listed four rows (a killed job with its planned
    overrides, a job never started), but the studio read the job directories alone: three rows,
    the killed one with blank keys, and 'experiment' a column, as if it differed."""
    from rft.studio.runs import Runs

    d = tmp_path / "rft" / "multirun" / "2026-11-29_01-39-17"
    write_job(d, 0, ["algorithm=grpo", "seed=1", "experiment=cmp"], "grpo", {"sft_warmup": SFT, "grpo": GRPO})
    write_job(d, 1, ["algorithm=grpo", "seed=2", "experiment=cmp"], "grpo", {"sft_warmup": SFT, "grpo": GRPO})
    (d / "2").mkdir()  # killed before its record
    (d / "multirun.yaml").write_text(MULTIRUN)  # 4 jobs: grpo 1, grpo 2, dapo 1, dapo 2
    table = Runs(tmp_path).sweep_table("rft/multirun/2026-11-29_01-39-17")
    assert [(r["job"], r["algorithm"], r["seed"], r["status"]) for r in table["jobs"]] == [
        ("0", "grpo", "1", "done"), ("1", "grpo", "2", "done"), ("2", "dapo", "1", report.NO_METRICS),
        ("3", "dapo", "2", report.NOT_STARTED)]
    assert "experiment" not in table["jobs"][0]  # common to all four: no column
    assert [(c["algorithm"], c["n"]) for c in table["configs"]] == [("grpo", 2), ("dapo", 0)]


# what varies between two runs of one config: the clock, and what is measured by it or by the process
UNEVEN = ("timing/", "tokens_per_s", "perf/")


@pytest.mark.slow
def test_a_sweep_in_one_process_repeats_a_config_exactly_and_a_seed_changes_it(tmp_path):
    """`-m seed=1,1,2` with the basic launcher: the three jobs run one after another in one process
    (cluster=inline), so anything a job leaves behind (a random state, a cache) would reach the
    next. The two seed-1 jobs log the same values at every step; seed 2 differs."""
    sweep = tmp_path / "sweep"
    r = run_cli("-m", "seed=1,1,2", "stages=[]", "cluster=inline", "monitor=console", "buffer.batch_size=4",
                "algorithm.repeat_times=2", "buffer.total_steps=3", "explorer.eval_interval=3",
                "stage_cache_dir=null", f"checkpoint_root_dir={tmp_path}", f"hydra.sweep.dir={sweep}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]

    def logged(job):
        rows = [json.loads(line) for line in (sweep / str(job) / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in m.items() if not any(u in k for u in UNEVEN)} for m in rows]

    first, again, other = logged(0), logged(1), logged(2)
    assert [m["step"] for m in first] == [0, 1, 2, 3]
    assert first == again
    # untrained, every reward is 0 and nothing is learned: seed 2 samples other responses (seed 1's
    # first step: 5.5 tokens on average, seed 2's: 6.0, the cap)
    assert [m.get("response_length/mean") for m in first] != [m.get("response_length/mean") for m in other]


def _sweeps(root):
    """The sweep directories under a checkpoint root's multirun/ (what 'the newest' is picked from)."""
    d = root / "rft" / "multirun"
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


@pytest.mark.slow  # 2.7 s alone, over the fast tier's second
def test_a_sweep_refused_before_it_starts_leaves_no_sweep_directory(tmp_path):
    """The README: a sweep killed outright prints nothing, and "its directory is the newest under
    <checkpoint_root_dir>/<project>/multirun/". A sweep refused at its plan (a batch size of 0 among
    the values) left an empty directory there, newer than the killed one: the README's way to find
    it then found the empty one."""
    r = run_cli("-m", "buffer.batch_size=4,0", "cluster=inline", f"checkpoint_root_dir={tmp_path}")
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
    assert "rft: configuration error: job 1 of the sweep (buffer.batch_size=0)" in r.stderr
    assert _sweeps(tmp_path) == []


@pytest.mark.slow
def test_a_dry_run_sweep_leaves_no_sweep_directory(tmp_path):
    """`-m ... dry_run=true` printed each job's plan and wrote nothing of the jobs, but left the
    sweep's directory with Hydra's multirun.yaml alone in it: the newest under multirun/ (the
    README's way to find a killed sweep), a sweep of no jobs in the studio's list, and one the
    report refused ('holds no job directories'). A dry run leaves nothing behind."""
    r = run_cli("-m", "seed=1,2", "dry_run=true", "cluster=inline", f"checkpoint_root_dir={tmp_path}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.count("tasks per step") == 2  # each job's plan printed
    assert _sweeps(tmp_path) == []


def test_a_local_job_whose_printed_process_is_killed_stops_its_task_too(tmp_path, capsys):
    """`kill -9` of the process id the sweep printed for a hydra/launcher=local job (submitit's
    controller): the sweep said the job "ended with state INTERRUPTED and no result" and exited,
    while the job's own process, orphaned, trained on to its last step in the job's directory (a
    resume then met its run lock). The task (SUBMITIT_LOCAL_JOB_ID=<that id> in its environment)
    is now stopped as its controller was, and the line says so."""
    import os
    import subprocess
    import sys

    from submitit.core.utils import UncompletedJobError
    from test_sweep_local import FakeJob

    from rft.reporting.sweep import watch

    job_id = f"t{os.getpid()}x"  # no real controller's id: a test's own
    task = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                            env={**os.environ, "SUBMITIT_LOCAL_JOB_ID": job_id, "SUBMITIT_LOCAL_COMMAND":
                                 f"{sys.executable} -u -m submitit.core._submit '{tmp_path}/%j'"})
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                 env={**os.environ, "SUBMITIT_LOCAL_JOB_ID": job_id + "0"})
    try:
        dead = UncompletedJobError(f"Job {job_id} (task: 0) with path {tmp_path}/{job_id}_0_result.pkl\n"
                                   "has not produced any output (state: INTERRUPTED)")
        class Killed(FakeJob):
            state = "INTERRUPTED"  # submitit's LocalJob.state once its controller died of a signal

            def results(self):
                # stopped before results(), which for a real job waits 15 s for a result file
                # (the task trained 17 s on after the kill)
                assert task.wait(timeout=5) == -9
                return super().results()

        job = Killed(job_id, tmp_path / "%j", 1, dead)
        with pytest.raises(UncompletedJobError):
            watch([job], [["seed=1"]], 1, str(tmp_path), poll_s=0.01)
        assert task.wait(timeout=10) == -9  # killed as its controller was
        assert bystander.poll() is None  # another job's task runs on
        assert capsys.readouterr().out.splitlines()[-1] == (
            f"[sweep] job 1 ({job_id}) ended with state INTERRUPTED and no result; its process {task.pid}, "
            f"which outlived it, stopped [1/1 ended]")
    finally:
        for p in (task, bystander):
            p.kill()
            p.wait()
