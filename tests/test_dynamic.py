"""synchronizer.sync_style=dynamic_by_explorer with partial rollouts, end to end: a driver killed
(no process of Ray's left behind) and resumed (in the test mode synchronizer.fixed_interrupts: bit
for bit the uninterrupted run), an explorer killed mid-generation (every group trained once), the
dry run's account of it.

Runs start from the session's SFT warm start (conftest.warm_start), without the warm-up stage.
"""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from conftest import ROOT, run_cli
from resume_support import forked_to_end
from safetensors.torch import load_file

from rft.reporting.monitor import read_metrics

pytestmark = pytest.mark.slow

# chunks of 2 tokens: the arithmetic answers (3 digits and the end token) span two chunks, so an
# explore step takes new weights in the middle of its responses
DYNAMIC = ["synchronizer.sync_style=dynamic_by_explorer", "explorer.partial_rollout=true",
           "explorer.partial_chunk_tokens=2"]
FIXED = [*DYNAMIC, "synchronizer.fixed_interrupts=true", "buffer.total_steps=6", "trainer.save_interval=3",
         "explorer.eval_interval=3"]


def base(warm_start, name, *extra):
    return ["stages=[]", f"model.model_path={warm_start}", "model.builder=null", "monitor=console",
            f"name={name}", *extra]


def _pid(log_file) -> int:
    import re

    return int(re.findall(r"started in process (\d+)", log_file.read_text())[-1])


@pytest.fixture(scope="module")
def straight(warm_start, tmp_path_factory):
    """The uninterrupted run in the test mode (FIXED), once for both kill tests (a Ray run, ~20 s):
    the driver's kill resumes to it bit for bit; the explorer's kill, free-running, trains its
    groups, since explore step k's groups are the tasks of step k's seed whichever weights sample
    them (measured: the same 16 groups at each of the 6 steps in both modes)."""
    root = tmp_path_factory.mktemp("dynamic")
    r = run_cli(*base(warm_start, "straight", *FIXED), env={**os.environ, "RFT_CHECKPOINT_ROOT_DIR": str(root)})
    assert r.returncode == 0, r.stderr[-3000:]
    return root / "rft" / "straight"


def test_a_killed_driver_leaves_no_ray_process_and_resumes_to_the_uninterrupted_run_bit_for_bit(warm_start, straight,
                                                                                                 tmp_path):
    env = {**os.environ, "RFT_CHECKPOINT_ROOT_DIR": str(tmp_path)}
    metrics = read_metrics(straight / "metrics.jsonl")
    # explore step s >= 1 takes version s after its first chunk: responses hold tokens of two
    # versions (three, for a group carried over from the step before), of several ages
    assert {m["rollout/max_token_versions"] for m in metrics[2:] if "rollout/max_token_versions" in m} <= {2, 3}
    assert any(m.get("staleness/token_frac_0", 0) > 0 and m.get("staleness/token_frac_1", 0) > 0 for m in metrics[2:])

    # the driver SIGKILLed once its step-3 checkpoint is written: what it started of Ray goes with it
    # (the dashboard and runtime-env agents outlive a driver so killed: rft.runtime.reaper ends them),
    # checked on this run rather than on a Ray run of its own
    run = tmp_path / "rft" / "killed"
    proc = subprocess.Popen([sys.executable, str(ROOT / "run.py"), *base(warm_start, "killed", *FIXED)], cwd=ROOT,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (run / "checkpoints" / "step_3" / "state.json").exists():
        assert proc.poll() is None and time.time() < deadline, "the run ended before its step-3 checkpoint"
        time.sleep(0.02)
    started = psutil.Process(proc.pid).children(recursive=True)
    names = {p.name() for p in started}
    assert any("raylet" in n for n in names), names
    proc.kill()
    proc.wait()
    gone, alive = psutil.wait_procs(started, timeout=30)
    assert not alive, [(p.pid, p.name()) for p in alive]  # the dashboard and runtime-env agents too
    assert not (run / "checkpoints" / "step_6").exists(), "killed too late to test anything"
    state = json.loads((run / "checkpoints" / "step_3" / "state.json").read_text())
    assert "partial" in state and "available" in state  # the groups in flight, the unread experiences

    resumed = run_cli(*base(warm_start, "killed", *FIXED), env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from step 3" in resumed.stdout
    a = read_metrics(straight / "batches.jsonl")
    b = read_metrics(run / "batches.jsonl")
    assert [x["step"] for x in b] == list(range(1, 7))
    assert a == b  # the same groups, policy versions and tokens, step by step
    groups = [g for x in b for g in x["groups"]]
    assert len(groups) == len(set(groups))  # no group trained twice
    wa = load_file(straight / "checkpoints" / "step_6" / "hf" / "model.safetensors")
    wb = load_file(run / "checkpoints" / "step_6" / "hf" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_an_explorer_killed_mid_generation_leaves_every_group_trained_once(warm_start, straight, tmp_path):
    """Free-running dynamic mode (which version writes which token depends on timing): the explorer
    is killed while it generates; Ray restarts it, the driver gives it back its groups in flight and
    it redoes the lost explore steps. Every step trains a full batch, no group twice, and the
    groups trained are those of the uninterrupted run (the module's, of the same 6 steps)."""
    args = [*DYNAMIC, "buffer.total_steps=6", "trainer.save_interval=100", "explorer.eval_interval=100",
            "explorer.eval_on_startup=false"]
    env = {**os.environ, "RFT_CHECKPOINT_ROOT_DIR": str(tmp_path)}
    run = tmp_path / "rft" / "killed"
    proc = subprocess.Popen([sys.executable, str(ROOT / "run.py"), *base(warm_start, "killed", *args)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while not any(m["step"] >= 3 for m in read_metrics(run / "metrics.jsonl")):
        assert proc.poll() is None and time.time() < deadline, "the run ended early"
        time.sleep(0.05)
    os.kill(_pid(run / "log" / "grpo_explorer.log"), signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "grpo_explorer died" in out and "grpo_explorer is back" in out
    b = read_metrics(run / "batches.jsonl")
    assert [x["step"] for x in b] == list(range(1, 7))
    assert all(len(x["versions"]) == 128 for x in b)  # buffer.batch_size 16 x repeat_times 8
    groups = [g for x in b for g in x["groups"]]
    assert len(groups) == len(set(groups)) == 6 * 16
    assert set(groups) == {g for x in read_metrics(straight / "batches.jsonl") for g in x["groups"]}


def test_dry_run_says_how_weights_reach_the_explorers(warm_start, tmp_path):
    # forked (resume_support.forked_to_end): a dry run starts no Ray, a fresh interpreter would add only its imports
    r = forked_to_end(base(warm_start, "dry", *DYNAMIC, "synchronizer.max_staleness=2", "dry_run=true"),
                      {**os.environ, "RFT_CHECKPOINT_ROOT_DIR": str(tmp_path)}, tmp_path / "dry")
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("sync_style=dynamic_by_explorer: new weights after every training step, taken between generate "
            "chunks of 2 tokens (partial rollouts: a sequence in flight keeps its tokens and goes on under the "
            "new weights; 1.5 steps' worth of groups in flight, an explore step ends with the batch_size that "
            "finish first, the others go on in the next); tokens older than 2 versions drop their experience") in " ".join(r.stdout.split())
