"""Sweeps with hydra/launcher=local (submitit, one subprocess per job, no Slurm): what the driver
prints while it waits, and jobs running side by side.

The same driver code waits for Slurm jobs; tests/test_slurm.py runs it against a real cluster,
with a killed job and the same sweep resuming it (hydra.sweep.dir).
"""

import re
from datetime import datetime
from pathlib import Path

import pytest
from conftest import run_cli
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf
from submitit.core.utils import JobPaths, UncompletedJobError

from rft.reporting.monitor import read_metrics
from rft.reporting.sweep import watch

# two RL steps of 4 tasks x 2 rollouts from the built tiny model, everything in the job's process
TINY = ["stages=[]", "cluster=inline", "monitor=console", "buffer.batch_size=4", "algorithm.repeat_times=2",
        "buffer.total_steps=2", "explorer.eval_interval=2", "trainer.save_interval=2",
        "hydra.launcher.timeout_min=10"]


# ---------------------------------------------------------------- the driver's wait, with stand-in jobs

class FakeJob:
    """A submitit job as the driver sees it: done after `polls` calls of done(), then its result."""

    def __init__(self, job_id, folder, polls, outcome):
        self.job_id, self.paths, self.polls, self.outcome = job_id, JobPaths(folder, job_id, 0), polls, outcome

    def done(self):
        self.polls -= 1
        return self.polls <= 0

    def results(self):
        assert self.polls <= 0, "results() asked for before the job ended"
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return [self.outcome]


def test_the_driver_reports_jobs_as_they_end_and_raises_for_a_dead_one_after_the_others(tmp_path, capsys):
    sweep, folder = tmp_path, tmp_path / ".submitit" / "%j"
    cfg = OmegaConf.create({"objective": "eval/accuracy"})
    dead = UncompletedJobError(f"Job 7_1 (task: 0) with path {sweep}/.submitit/7_1/7_1_0_result.pkl\n"
                               "has not produced any output (state: CANCELLED by 0)\nError stream produced:\n...")
    jobs = [
        FakeJob("7_0", folder, 3, JobReturn(cfg=cfg, status=JobStatus.COMPLETED, _return_value=0.3125)),
        FakeJob("7_1", folder, 2, dead),
        FakeJob("7_2", folder, 1, JobReturn(cfg=cfg, status=JobStatus.FAILED,
                                            _return_value=RuntimeError("boom\nmore of it"))),
    ]
    overrides = [[f"seed={s}", "lr=0.1", "hydra.launcher.timeout_min=10"] for s in (1, 2, 3)]
    with pytest.raises(UncompletedJobError) as e:
        watch(jobs, overrides, 4, str(sweep), poll_s=0.01)
    assert e.value is dead  # raised once every job ended: the last to end (7_0) is reported above
    assert capsys.readouterr().out.splitlines() == [
        f"[sweep] job 4 is 7_0 (seed=1): outputs in {sweep}/4, log in {sweep}/.submitit/7_0/7_0_0_log.out and .err",
        f"[sweep] job 5 is 7_1 (seed=2): outputs in {sweep}/5, log in {sweep}/.submitit/7_1/7_1_0_log.out and .err",
        f"[sweep] job 6 is 7_2 (seed=3): outputs in {sweep}/6, log in {sweep}/.submitit/7_2/7_2_0_log.out and .err",
        "[sweep] job 6 (7_2) failed: RuntimeError: boom [1/3 ended]",
        "[sweep] job 5 (7_1) ended with state CANCELLED by 0 and no result [2/3 ended]",
        "[sweep] job 4 (7_0) finished, eval/accuracy = 0.3125 [3/3 ended]",
    ]


def test_a_requeued_job_is_waited_for_not_reported_dead(tmp_path, capsys, monkeypatch):
    # submitit read a preempted attempt's state (FAILED) and kept it as the job's, finished, while
    # Slurm had queued the job again: the sweep stopped, "ended with state FAILED and no result"
    import rft.reporting.sweep as S

    cfg = OmegaConf.create({"objective": "eval/accuracy"})
    folder = tmp_path / ".submitit" / "%j"
    requeued = FakeJob("8_0", folder, 1, JobReturn(cfg=cfg, status=JobStatus.COMPLETED, _return_value=0.5))
    other = FakeJob("8_1", folder, 2, JobReturn(cfg=cfg, status=JobStatus.COMPLETED, _return_value=0.25))
    listed = iter([True, True, True])  # squeue lists 8_0 for three polls, then no more: its last attempt ended
    monkeypatch.setattr(S, "requeued", lambda job: job.job_id == "8_0" and next(listed, False))
    watch([requeued, other], [["seed=1"], ["seed=2"]], 0, str(tmp_path), poll_s=0.01)
    assert capsys.readouterr().out.splitlines()[2:] == [
        "[sweep] job 1 (8_1) finished, eval/accuracy = 0.25 [1/2 ended]",
        "[sweep] job 0 (8_0) finished, eval/accuracy = 0.5 [2/2 ended]",
    ]
    assert next(listed, "none") == "none"  # asked until squeue no longer listed it


# ---------------------------------------------------------------- real sweeps

def _submitted(stdout: str) -> dict[int, tuple[str, Path]]:
    """{job number: (submitit job id, its stdout log)} from the driver's lines."""
    found = re.findall(r"^\[sweep\] job (\d+) is (\S+) \(.*\): outputs in .*, log in (\S+) and \.err$", stdout, re.M)
    return {int(num): (job_id, Path(log)) for num, job_id, log in found}


def _log_time(log: Path, pattern: str) -> datetime:
    """When submitit's line matching `pattern` was written to a job's log."""
    stamp = re.search(r"submitit INFO \((\S+ \S+)\) - " + pattern, log.read_text())[1]
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f")


@pytest.fixture(scope="module")
def two_job_sweep(tmp_path_factory):
    sweep = tmp_path_factory.mktemp("local") / "sweep"
    r = run_cli("-m", "hydra/launcher=local", "seed=1,2", *TINY, f"hydra.sweep.dir={sweep}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return sweep, r.stdout


@pytest.mark.slow
def test_the_driver_says_where_each_job_is_and_how_it_ended(two_job_sweep):
    sweep, stdout = two_job_sweep
    jobs = _submitted(stdout)
    assert sorted(jobs) == [0, 1]
    for num, (job_id, log) in jobs.items():
        # the local launcher's job id is the process id of the job's controller
        assert log == sweep / ".submitit" / job_id / f"{job_id}_0_log.out" and log.exists()
        assert log.with_suffix(".err").exists()
        # the job's own record of it, which the report reads when the job dies (the folder's name is no job number)
        assert (sweep / str(num) / ".launcher_log").read_text() == f".submitit/{job_id}/{job_id}_0_log.err\n"
        assert f"[sweep] job {num} is {job_id} (seed={num + 1}): outputs in {sweep}/{num}, " in stdout
        assert f"outputs: {sweep}/{num}\n" in log.read_text()  # the job's own last word, in its log
        metrics = read_metrics(sweep / str(num) / "metrics.jsonl")
        objective = [m["eval/accuracy"] for m in metrics if "eval/accuracy" in m][-1]
        assert re.search(rf"^\[sweep\] job {num} \({job_id}\) finished, eval/accuracy = {objective:.4g} "
                         rf"\[[12]/2 ended\]$", stdout, re.M), stdout
    # every job is listed before any has ended
    assert stdout.index("[sweep] job 1 is") < stdout.index(") finished, ")


@pytest.mark.slow
def test_the_local_launcher_runs_the_jobs_side_by_side(two_job_sweep):
    """Each job's time span, from submitit's own log lines: the second began before the first ended."""
    sweep, stdout = two_job_sweep
    spans = [(_log_time(log, "Starting with JobEnvironment"), _log_time(log, "Job completed successfully"))
             for _, log in _submitted(stdout).values()]
    assert len(spans) == 2 and max(start for start, _ in spans) < min(end for _, end in spans), spans


# ---------------------------------------------------------------- every job planned before the first starts

@pytest.mark.slow
def test_a_sweep_value_that_cannot_plan_stops_the_sweep_before_any_job_runs(tmp_path):
    # job 0 trained to its end before job 1 (batch size 0) was found out
    env = {"RFT_CHECKPOINT_ROOT_DIR": str(tmp_path)}
    r = run_cli("-m", *TINY[:-1], "buffer.batch_size=4,0", env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert ("rft: configuration error: job 1 of the sweep (buffer.batch_size=0): buffer.batch_size=0 must be >= 1 "
            "(tasks per step). No job has started: every job is planned first.") in r.stderr
    assert not list(tmp_path.rglob("metrics.jsonl"))
    # a value that fits no dataset is found too: the datasets of every job are read first
    r = run_cli("-m", *TINY[:-1], "buffer.total_steps=null", "buffer.batch_size=4,4000", env=env)
    assert r.returncode == 2, r.stderr[-2000:]
    assert ("rft: configuration error: job 1 of the sweep (buffer.batch_size=4000): the dataset has 2000 rows, fewer "
            "than buffer.batch_size=4000: one epoch would be 0 steps.") in r.stderr
    assert not list(tmp_path.rglob("metrics.jsonl"))


def test_a_sweeps_jobs_are_its_params_and_the_command_lines_values():
    from conftest import compose_cfg
    from omegaconf import read_write

    from rft.runtime.callbacks import sweep_jobs

    cfg = compose_cfg(["experiment=tiny_seeds"], keep_hydra=True)
    with read_write(cfg.hydra.overrides.task):  # as `-m experiment=tiny_seeds algorithm=grpo,dr_grpo`
        cfg.hydra.overrides.task.append("algorithm=grpo,dr_grpo")
    # tiny_seeds' params (seed: 1,2,3) x the command line's 2 algorithms = 6 jobs, seeds outermost
    jobs = sweep_jobs(cfg)
    assert [j[:2] for j in jobs] == [["seed=1", "experiment=tiny_seeds"], ["seed=1", "experiment=tiny_seeds"],
                                     ["seed=2", "experiment=tiny_seeds"], ["seed=2", "experiment=tiny_seeds"],
                                     ["seed=3", "experiment=tiny_seeds"], ["seed=3", "experiment=tiny_seeds"]]
    assert [j[2] for j in jobs] == ["algorithm=grpo", "algorithm=dr_grpo"] * 3


def test_a_sweep_kept_in_config_run_without_m_is_warned_about():
    # `python run.py experiment=tiny_seeds` ran one job of seed 42 (the default: none of the study's
    # seeds 1, 2, 3), and hydra/launcher=local without -m ran in the foreground, each without a word
    from conftest import compose_cfg

    from rft.runtime.callbacks import unswept

    assert unswept(compose_cfg(["experiment=tiny_seeds"], keep_hydra=True)) == (
        "this config sets a sweep (hydra.sweeper.params: seed=1,2,3), which only `python run.py -m ...` runs: "
        "this is one run, with seed=42. Add -m to run the sweep.")
    assert unswept(compose_cfg(["hydra/launcher=local"], keep_hydra=True)) == (
        "hydra/launcher=local takes effect only with -m: this is one run, in this process. Add -m to launch it.")
    assert unswept(compose_cfg(["experiment=tiny_seeds", "seed=2"], keep_hydra=True)).endswith(
        "this is one run, with seed=2. Add -m to run the sweep.")
    assert unswept(compose_cfg([], keep_hydra=True)) is None
