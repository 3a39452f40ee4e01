"""The runtime end to end: modes, durable buffers, async (sync_offset) runs and their resume, faults,
killed actors, several explorers with collective sync, the Ray timeline.

Every run starts from the session's SFT warm start (conftest.warm_start), without the warm-up stage.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, compose_cfg, run_cli
from faulty_reward import fault_class
from resume_support import forked_to_end, kill_when, run_here, run_to_end
from safetensors.torch import load_file

from rft.data.buffer import read_experiences
from rft.data.readers import epoch_batch, step_seed
from rft.data.tasks import load_tasks
from rft.reporting.monitor import read_metrics

pytestmark = pytest.mark.slow


def base(warm_start, name, *extra):
    return ["stages=[]", f"model.model_path={warm_start}", "model.builder=null", "monitor=console",
            f"name={name}", *extra]


def evals(metrics):
    return [m["eval/accuracy"] for m in metrics if "eval/accuracy" in m]


def env_for(tmp_path):
    return {"RFT_CHECKPOINT_ROOT_DIR": str(tmp_path)}


def test_explore_writes_sql_then_train_learns_from_it_then_bench(warm_start, tmp_path):
    db = tmp_path / "exp.db"
    sql = ["buffer=sql", f"buffer.trainer_input.experience_buffer.path={db}"]
    run_here(base(warm_start, "explorer", "cluster=inline", "mode=explore", "buffer.total_steps=10", *sql), tmp_path)
    listing = subprocess.run([sys.executable, "-m", "rft.data.buffer", str(db), "--limit", "2"],
                             capture_output=True, text=True, cwd=ROOT)
    assert listing.returncode == 0 and "reward" in listing.stdout, listing.stdout + listing.stderr

    # 10 steps x 16 tasks x 8 rollouts = 1280 stored experiences = 10 training steps of 128
    run_here(base(warm_start, "learner", "cluster=inline", "mode=train", "explorer.eval_interval=10",
                       "buffer.total_steps=10", "trainer.save_interval=5", *sql), tmp_path)
    metrics = read_metrics(tmp_path / "rft" / "learner" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(11))
    start, end = evals(metrics)
    assert end >= start + 0.2, (start, end)
    # stored experiences carry the version that made them (0: the explorer never got new weights),
    # so the k-th step trains on experiences k - 1 steps stale; PPO's ratio is then taken against
    # their sampling log-probs (algorithm.off_policy_correction=behavior), and the clip binds
    assert [m["staleness/max"] for m in metrics[1:]] == list(range(10))
    assert metrics[1]["actor/clip_frac"] == 0 and max(m["actor/clip_frac"] for m in metrics[2:]) > 0

    # the later commands each in a process forked from one that imported torch (resume_support.Forked):
    # mode=bench evaluates in its own process (no Ray), the explorers below are cluster=inline
    env = {**os.environ, **env_for(tmp_path)}
    r = forked_to_end(base(warm_start, "learner", "mode=bench"), env, tmp_path / "bench_run")
    assert r.returncode == 0, r.stderr[-3000:]
    bench = tmp_path / "rft" / "learner" / "bench"
    rows = (bench / "results.csv").read_text().splitlines()
    assert rows[0].startswith("stage,step,eval/")
    assert [row.split(",")[1] for row in rows[1:]] == ["0", "5", "10"]
    # greedy evaluation of the same weights: bench agrees with the training run's own evals
    acc = {int(row.split(",")[1]): float(row.split(",")[2]) for row in rows[1:]}
    assert acc[0] == pytest.approx(start) and acc[10] == pytest.approx(end)
    assert "| stage | step |" in (bench / "results.md").read_text()

    # an explorer that follows a trainer's checkpoints serves (and stamps) the newest one
    db2 = tmp_path / "exp2.db"
    r = run_to_end(base(warm_start, "follower", "cluster=inline", "mode=explore", "buffer.total_steps=1", "buffer=sql",
                        f"buffer.trainer_input.experience_buffer.path={db2}",
                        f"synchronizer.checkpoint_dir={tmp_path / 'rft' / 'learner'}"), env, tmp_path / "follower_run")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "synchronizer.checkpoint_dir" not in r.stdout + r.stderr
    stored = read_experiences(str(db2), limit=1000)
    assert len(stored) == 128 and {e.policy_version for e in stored} == {10}
    # a misspelt directory serves nothing, ever: said at the start, not silent
    db3 = tmp_path / "exp3.db"
    typo = tmp_path / "rft" / "lerner"
    r = run_to_end(base(warm_start, "typo", "cluster=inline", "mode=explore", "buffer.total_steps=1", "buffer=sql",
                        f"buffer.trainer_input.experience_buffer.path={db3}", f"synchronizer.checkpoint_dir={typo}"),
                   env, tmp_path / "typo_run")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (f"WARNING: synchronizer.checkpoint_dir='{typo}': no such directory yet; the explorers serve their "
            f"starting weights until a train run writes checkpoints there") in r.stdout
    assert {e.policy_version for e in read_experiences(str(db3), limit=1000)} == {0}


def test_async_run_learns_through_ray_with_a_timeline(warm_start, tmp_path):
    """sync_offset=1: the explorer samples step k+1 while the trainer trains step k."""
    r = run_cli(*base(warm_start, "async", "synchronizer.sync_offset=1", "synchronizer.max_staleness=1",
                      "buffer.total_steps=12", "explorer.eval_interval=12", "monitor.enable_ray_timeline=true"),
                env=env_for(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "rft" / "async"
    metrics = read_metrics(run / "metrics.jsonl")
    start, end = evals(metrics)
    assert end >= start + 0.2, (start, end)
    # step 1 trains on step 0's rollouts of the starting weights (stale by 0); every later step
    # on rollouts of the weights one step older than the trainer's (stale by 1)
    assert metrics[1]["staleness/count_0"] == 128
    assert all(m["staleness/count_1"] == 128 and m["staleness/dropped"] == 0 for m in metrics[2:])
    timeline = json.loads((run / "monitor" / "timeline.json").read_text())
    names = {e.get("name", "") for e in timeline}
    assert any("explore" in n or "run" in n for n in names), sorted(names)[:20]


ASYNC = ["cluster=inline", "synchronizer.sync_offset=1", "buffer.total_steps=8", "trainer.save_interval=4",
         "explorer.eval_interval=4"]


def test_killed_async_run_resumes_on_the_same_experiences(warm_start, tmp_path):
    env = {**os.environ, **env_for(tmp_path)}
    run_here(base(warm_start, "straight", *ASYNC), tmp_path)

    run = tmp_path / "rft" / "killed"
    kill_when(base(warm_start, "killed", *ASYNC), env, lambda: (run / "checkpoints" / "step_4" / "state.json").exists(),
              tmp_path / "killed_run")
    assert not (run / "checkpoints" / "step_8").exists(), "killed too late to test anything"
    # the checkpoint holds the step explored ahead (step index 4), not yet trained on
    state = json.loads((run / "checkpoints" / "step_4" / "state.json").read_text())
    assert state["next_explore"] == 5 and state["buffer"]["items"] == 128  # packed beside it (QueueBuffer.stored_state)

    resumed = run_to_end(base(warm_start, "killed", *ASYNC), env, tmp_path / "resumed_run")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from step 4" in resumed.stdout
    assert "has no line for step" not in resumed.stderr  # a kill costs batches.jsonl no line
    a = read_metrics(tmp_path / "rft" / "straight" / "batches.jsonl")
    b = read_metrics(run / "batches.jsonl")
    assert [x["step"] for x in b] == list(range(1, 9))
    assert a == b  # the same groups, policy versions and token digests, step by step
    wa = load_file(tmp_path / "rft" / "straight" / "checkpoints" / "step_8" / "hf" / "model.safetensors")
    wb = load_file(run / "checkpoints" / "step_8" / "hf" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_failing_and_hanging_reward_is_retried_counted_and_the_run_goes_on(warm_start, tmp_path):
    # one eval, the last step's, whose failing tasks must not count in that step's rollout/ figures
    r = run_to_end(base(warm_start, "faulty", "cluster=inline", "buffer.total_steps=3", "explorer.eval_interval=3",
                         "explorer.eval_on_startup=false", "buffer.explorer_input.default_reward_fn_type=faulty_reward.flaky",
                         "explorer.max_timeout=0.5", "explorer.max_retry_times=1"),
                   {**os.environ, **env_for(tmp_path), "PYTHONPATH": str(ROOT / "tests")}, tmp_path / "run")
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = read_metrics(tmp_path / "rft" / "faulty" / "metrics.jsonl")
    batches = read_metrics(tmp_path / "rft" / "faulty" / "batches.jsonl")
    cfg = compose_cfg(base(warm_start, "faulty"))
    tasks = load_tasks(cfg.buffer.explorer_input.taskset, "taskset")
    assert [m["step"] for m in metrics] == [1, 2, 3]  # no step-0 row: no eval on startup
    for m, b in zip(metrics, batches):
        step = m["step"] - 1
        ids = [tasks[i].task_id for i in epoch_batch(len(tasks), 16, step, lambda e: step_seed(42, e, salt=1))]
        kinds = [fault_class(t) for t in ids]
        trained = {g.split("/", 2)[2] for g in b["groups"]}
        assert trained == {t for t, k in zip(ids, kinds) if k == "ok"}
        # each failing task: tried twice (max_retry_times=1), then recorded as failed
        assert m["rollout/failed_tasks"] == kinds.count("raise") + kinds.count("hang")
        assert m["rollout/errors"] == 2 * kinds.count("raise")
        assert m["rollout/timeouts"] == 2 * kinds.count("hang")
        assert m["rollout/retries"] == kinds.count("raise") + kinds.count("hang")
        assert m["train/experiences"] == 8 * kinds.count("ok")
    assert sum(m["rollout/failed_tasks"] for m in metrics) > 0


def _pid(log_file: Path) -> int:
    return int(re.findall(r"started in process (\d+)", log_file.read_text())[-1])


def _wait_for_step(proc, metrics_file: Path, step: int, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not any(m["step"] >= step for m in read_metrics(metrics_file)):
        assert proc.poll() is None and time.time() < deadline, "the run ended early"
        time.sleep(0.1)


def test_killed_trainer_leaves_a_resumable_checkpoint(warm_start, tmp_path):
    run = tmp_path / "rft" / "fragile"
    args = base(warm_start, "fragile", "buffer.total_steps=6", "trainer.save_interval=2", "explorer.eval_interval=100",
                "explorer.eval_on_startup=false")
    proc = subprocess.Popen([sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT,
                            env={**os.environ, **env_for(tmp_path)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (run / "checkpoints" / "step_2" / "state.json").exists():
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    os.kill(_pid(run / "log" / "grpo_trainer.log"), signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-3000:]
    assert "rft: the run stopped: the trainer actor died" in err
    assert "Run the same command again to resume from it." in err
    assert "Traceback" not in err

    # resumed in one process (cluster=inline): what is checked is the checkpoint the kill left; a
    # resume under Ray is test_lora_sync's and test_resume_matrix's fsdp2 case
    again = run_to_end([*args, "cluster=inline", "synchronizer.sync_offset=1"], {**os.environ, **env_for(tmp_path)},
                       tmp_path / "again")
    assert again.returncode == 0, again.stderr[-3000:]
    assert re.search(r"resuming from step [2-5] ", again.stdout)
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == list(range(1, 7))  # no eval on startup: no step 0


def test_two_explorers_with_collective_sync(warm_start, tmp_path):
    """Two explorer actors share each step's tasks; weights reach both by a gloo broadcast."""
    r = run_cli(*base(warm_start, "collective", "sync=collective", "explorer.rollout_model.engine_num=2",
                      "cluster.num_cpus=3", "buffer.total_steps=3", "explorer.eval_interval=3",
                      "explorer.eval_on_startup=false"),
                env=env_for(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "rft" / "collective"
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]  # no eval on startup: no step-0 row
    assert [m["sync/version"] for m in metrics] == [1, 2, 3]
    assert all(m["rollout/experiences"] == 128 for m in metrics)
    batches = read_metrics(run / "batches.jsonl")
    # 16 distinct tasks a step, 8 from each explorer (their sampling seeds differ)
    assert all(len(b["groups"]) == 16 for b in batches)
    assert len({g.split("/")[1] for g in batches[0]["groups"]}) == 2
    for i in (0, 1):
        assert "started in process" in (run / "log" / f"grpo_explorer_{i}.log").read_text()


def test_a_cluster_too_small_for_the_actors_is_a_config_error(warm_start, tmp_path):
    r = run_cli(*base(warm_start, "small", "explorer.rollout_model.engine_num=2", "cluster.num_cpus=2",
                      "buffer.total_steps=1"), env=env_for(tmp_path))
    assert r.returncode == 2
    assert ("the actors need 3 CPU (cluster.cpus_per_actor=1, gpu_per_node=0, "
            "explorer.rollout_model.engine_num=2, colocate=False) but the Ray cluster has 2.") in r.stderr


OFFSET_SQL = ["synchronizer.sync_offset=1", "buffer=sql", "buffer.total_steps=6", "trainer.save_interval=100", "buffer.batch_size=8",
              "explorer.eval_interval=100", "explorer.eval_on_startup=false"]


def test_killed_explorer_with_sync_offset_redoes_its_step_on_the_scheduled_weights(warm_start, tmp_path):
    """The explorer runs one step ahead; killed while it explores step k on the weights of version
    k - 1 (the trainer is at k already), it is restarted and redoes step k on version k - 1: the
    run ends bit-identical to the uninterrupted one."""
    env = {**os.environ, **env_for(tmp_path)}
    # the uninterrupted run in one process (cluster=inline): with sync_offset=1 its actors get the
    # threads Ray's do (cluster.cpus_per_actor; rft.plan.placement.torch_threads), so the same bits
    run_here(base(warm_start, "straight", "cluster=inline", *OFFSET_SQL), tmp_path)
    run = tmp_path / "rft" / "killed"
    proc = subprocess.Popen([sys.executable, str(ROOT / "run.py"), *base(warm_start, "killed", *OFFSET_SQL)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for_step(proc, run / "metrics.jsonl", 3)
    os.kill(_pid(run / "log" / "grpo_explorer.log"), signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "grpo_explorer died" in out and "grpo_explorer is back" in out
    a = read_metrics(tmp_path / "rft" / "straight" / "batches.jsonl")
    b = read_metrics(run / "batches.jsonl")
    assert [x["step"] for x in b] == list(range(1, 7))
    assert a == b  # the same groups, the same policy versions (staleness 1 after step 1), the same tokens
    assert all(set(x["versions"]) == {x["step"] - 2} for x in b[1:])
    wa = load_file(tmp_path / "rft" / "straight" / "checkpoints" / "step_6" / "hf" / "model.safetensors")
    wb = load_file(run / "checkpoints" / "step_6" / "hf" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_stale_stored_experiences_beyond_max_staleness_are_dropped_in_mode_train(warm_start, tmp_path):
    db = tmp_path / "exp.db"
    sql = ["buffer=sql", f"buffer.trainer_input.experience_buffer.path={db}", "buffer.batch_size=4",
           "algorithm.repeat_times=2", "cluster=inline"]
    run_here(base(warm_start, "explorer", "mode=explore", "buffer.total_steps=5", *sql), tmp_path)
    # 5 stored steps of 8, all made by version 0; trained at steps 1..5 they are 0..4 steps stale
    run_here(base(warm_start, "learner", "mode=train", "buffer.total_steps=5", "synchronizer.max_staleness=2",
                       "explorer.eval_interval=100", *sql), tmp_path)
    metrics = read_metrics(tmp_path / "rft" / "learner" / "metrics.jsonl")[1:]
    assert [m["staleness/max"] for m in metrics] == [0, 1, 2, 3, 4]
    assert [m["staleness/dropped"] for m in metrics] == [0, 0, 0, 8, 8]
    # steps 4 and 5 trained on nothing: they count as steps, but no experiences were trained on
    assert ["train/experiences" in m for m in metrics] == [True, True, True, False, False]
    batches = read_metrics(tmp_path / "rft" / "learner" / "batches.jsonl")
    assert [b["step"] for b in batches] == [1, 2, 3]


FAILING = ["cluster=inline", "buffer.batch_size=4", "algorithm.repeat_times=2", "buffer.total_steps=10",
           "explorer.eval_interval=100", "explorer.max_retry_times=0", "explorer.eval_on_startup=false"]


@pytest.mark.parametrize("reward,last_error", [
    ("faulty_reward.always_raises", "the last error: ValueError: no reward for arithmetic_train/"),
    ("faulty_reward.hangs", "the last error: none recorded (timeouts)"),
])
def test_a_run_whose_every_task_fails_stops_instead_of_finishing_with_nothing_learned(warm_start, tmp_path,
                                                                                      reward, last_error):
    r = run_to_end(base(warm_start, "nothing", *FAILING, f"buffer.explorer_input.default_reward_fn_type={reward}",
                         "explorer.max_timeout=0.2"),
                   {**os.environ, **env_for(tmp_path), "PYTHONPATH": str(ROOT / "tests")}, tmp_path / "run")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "rft: the run stopped: every task of the last 3 steps failed (reward function " in r.stderr
    assert last_error in r.stderr and "Traceback" not in r.stderr
    assert "explorer.max_failed_steps=3 sets how many such steps stop a run (0: never)" in r.stderr
    metrics = read_metrics(tmp_path / "rft" / "nothing" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]  # the third failed step stopped the run before its log


def test_identical_rewards_and_failed_eval_tasks_are_reported(warm_start, tmp_path):
    # explorer.max_failed_steps=0: an eval whose every task failed is logged as 0, and the run goes on
    r = run_to_end(base(warm_start, "flat", *FAILING, "buffer.total_steps=3", "explorer.eval_interval=3",
                         "explorer.max_failed_steps=0",
                         "buffer.explorer_input.default_reward_fn_type=faulty_reward.constant",
                         "buffer.explorer_input.eval_tasksets.0.reward_fn=faulty_reward.always_raises"),
                   {**os.environ, **env_for(tmp_path), "PYTHONPATH": str(ROOT / "tests")}, tmp_path / "run")
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("[grpo] WARNING: every reward of the first 3 steps was 0.9: the advantages are all 0 and nothing "
            "is learned.") in r.stdout
    metrics = read_metrics(tmp_path / "rft" / "flat" / "metrics.jsonl")
    assert all(m["advantage/abs_mean"] == 0.0 for m in metrics)  # exactly: equal rewards, no signal
    assert metrics[-1]["eval/failed_tasks"] == 200 and metrics[-1]["eval/accuracy"] == 0.0
    assert "(200 eval tasks failed and count as 0; see" in r.stdout


def test_an_eval_whose_every_task_fails_stops_the_run_before_it_trains(warm_start, tmp_path):
    # a broken reward found by the first eval, not after a whole stage of evals of 0
    r = run_to_end(base(warm_start, "broken", *FAILING, "explorer.eval_on_startup=true",
                         "buffer.explorer_input.default_reward_fn_type=faulty_reward.always_raises"),
                   {**os.environ, **env_for(tmp_path), "PYTHONPATH": str(ROOT / "tests")}, tmp_path / "run")
    assert r.returncode == 1, r.stderr[-3000:]
    assert ("rft: the run stopped: every task of the eval set buffer.explorer_input.eval_tasksets[0] "
            "(arithmetic_test) failed at step 0 (the last error: ValueError: no reward for arithmetic_test/") in r.stderr
    assert "resume from the newest checkpoint: none yet. explorer.max_failed_steps=0 lets a run go on" in r.stderr
    # it raised on every try, none timed out: a longer explorer.max_timeout is no fix to offer
    assert "Fix the reward function, then run the same command again" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "rft" / "broken" / "checkpoints").exists()  # nothing trained


# a driver SIGKILLed leaves no process of Ray's behind: checked on the Ray run whose driver
# tests/test_dynamic.py kills (test_a_killed_driver_leaves_no_ray_process_and_resumes_...)
