"""End-to-end runs of the real entry point: the default learns, and a killed run resumes exactly."""

import os
from pathlib import Path

import pytest
import torch
from conftest import driver_modules_env, run_cli
from resume_support import VOLATILE, kill_when, run_here, run_to_end
from safetensors.torch import load_file

from rft.reporting.monitor import read_metrics

pytestmark = pytest.mark.slow


def evals(metrics):
    return [m["eval/accuracy"] for m in metrics if "eval/accuracy" in m]


def test_shortened_default_learns_through_ray(tmp_path, warm_cache):
    """The default (Ray actors, SFT warm-up then GRPO) with a shorter GRPO stage raises eval accuracy.
    Its warm-up is the session's (conftest.warm_start), taken from the stage cache."""
    hook_env, modules = driver_modules_env(tmp_path)
    r = run_cli("buffer.total_steps=30", "explorer.eval_interval=30", "trainer.save_interval=30",
                f"stage_cache_dir={warm_cache}", env={"RFT_CHECKPOINT_ROOT_DIR": str(tmp_path),
                                                      **hook_env})
    assert r.returncode == 0, r.stderr[-3000:]
    # token authentication on (RAY_AUTH_MODE=token, set before Ray is imported), without Ray's
    # warning on how to turn it off
    assert "Token authentication" not in r.stderr
    # the driver (the model built, the warm-up reused, the datasets read by a child, the budgets
    # checked by the explorer) holds neither torch nor transformers nor datasets: each would be a
    # second copy (~0.3 GB for torch and transformers, 0.1 GB for datasets) besides the actors'
    driver = set(modules.read_text().split())
    assert "ray" in driver and "rft.runtime.main" in driver
    heavy = driver & {"torch", "transformers", "datasets", "pandas"}
    assert not heavy, heavy
    run = tmp_path / "rft" / "grpo-tiny-arithmetic"
    grpo = read_metrics(run / "grpo" / "metrics.jsonl")
    start, end = evals(grpo)
    assert end >= start + 0.3, (start, end)
    assert f"[grpo] eval accuracy: start {start:.3f} -> end {end:.3f}" in r.stdout
    # the warm-up trained too, and alone it stays below where GRPO ends
    sft = read_metrics(run / "sft_warmup" / "metrics.jsonl")
    losses = [m["loss/policy"] for m in sft if "loss/policy" in m]
    assert len(losses) == 400 and losses[-1] < losses[0]
    sft_end = evals(sft)[-1]
    assert sft_end == start and sft_end < end - 0.3
    assert "[sft_warmup] reused: the same stage (same config, starting model and data) finished in " in r.stdout
    assert [m["step"] for m in grpo] == list(range(0, 31))
    for key in ["reward/mean", "reward/std", "response_length/mean", "actor/entropy", "actor/clip_frac",
                "actor/approx_kl", "actor/grad_norm", "actor/lr", "timing/rollout_s", "timing/train_s",
                "timing/sync_s", "rollout/tokens_per_s"]:
        assert key in grpo[1], key
    # each sync's parts, reported with the steps after it: the trainer's (its weights into the
    # shared-memory segment, their fingerprint) and the explorer's (its engine's load, its check)
    for m in grpo[3:]:
        for part in ("send", "fingerprint", "load", "check"):
            assert m[f"timing/sync_{part}_s"] > 0, (m["step"], part)
    # Ray with actors of their own: the explorer runs one step ahead (a null sync_offset is 1), so
    # step 1 learns from fresh experiences and every later step from ones a step stale
    assert [m["staleness/max"] for m in grpo[1:]] == [0] + [1] * 29
    assert grpo[2]["staleness/mean"] == 1.0 and grpo[1]["staleness/mean"] == 0.0
    # the engine samples (temperature 1) what the trainer recomputes: hf and the trainer share the
    # model and the float32 math, so the gap is ~0 and the rollout-IS weights ~1 (rft.algorithms.rollout_is),
    # measured on fresh experiences (the stale ones are corrected by off_policy_correction instead)
    measured = [m for m in grpo[1:] if "actor/tis_weight_mean" in m]
    assert [m["step"] for m in measured] == [1]
    for m in measured:
        assert abs(m["rollout/logprob_diff"]) < 1e-4, m["rollout/logprob_diff"]
        assert abs(m["actor/tis_weight_mean"] - 1) < 1e-4 and m["actor/tis_weight_max"] < 1 + 1e-3
        assert m["actor/tis_capped_frac"] == 0
    # one log per actor, TensorBoard files, an HF-format model that from_pretrained loads
    assert (run / "grpo" / "log" / "grpo_explorer.log").exists()
    assert (run / "grpo" / "log" / "grpo_trainer.log").exists()
    # the weights went to the explorer through a shared-memory segment (one node), unlinked at the end
    import re

    made = re.findall(r"memory sync through shared memory: segment (\S+),", (run / "grpo" / "log" / "grpo_trainer.log").read_text())
    assert len(made) == 1 and not (Path("/dev/shm") / made[0]).exists()
    assert list((run / "grpo" / "tensorboard").glob("events.out.tfevents.*"))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = run / "grpo" / "checkpoints" / "step_30" / "hf"
    assert AutoModelForCausalLM.from_pretrained(final).config.model_type == "qwen2"
    assert AutoTokenizer.from_pretrained(final).chat_template


RESUME_ARGS = [
    # the killed run copies the straight one's warm-up from the stage cache, and trains GRPO
    "cluster=inline", "monitor=console", "stages.0.buffer.total_steps=150",
    "buffer.total_steps=8", "trainer.save_interval=4", "explorer.eval_interval=4",
]


def stable(metrics, first):
    return [{k: v for k, v in m.items() if not k.startswith(VOLATILE) and not k.endswith(VOLATILE)}
            for m in metrics if m["step"] >= first]


def test_killed_run_resumes_bit_exactly(tmp_path):
    env = {**os.environ, "RFT_CHECKPOINT_ROOT_DIR": str(tmp_path)}
    # the straight run in this process, the killed and the resumed one each a run.py process forked
    # from one that imported torch (resume_support: the same bits and output without a fresh
    # interpreter's imports, ~4 s a run; the resume is still a new process reading what the kill left)
    run_here([*RESUME_ARGS, "name=straight"], tmp_path)

    # the same command, killed with SIGKILL once the step-4 checkpoint of the GRPO stage exists
    grpo_dir = tmp_path / "rft" / "killed" / "grpo"
    kill_when([*RESUME_ARGS, "name=killed"], env, lambda: (grpo_dir / "checkpoints" / "step_4" / "state.json").exists(),
              tmp_path / "killed_run")
    assert not (grpo_dir / "checkpoints" / "step_8").exists(), "killed too late to test anything"

    resumed = run_to_end([*RESUME_ARGS, "name=killed"], env, tmp_path / "resumed_run")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "[sft_warmup] already finished" in resumed.stdout

    a = load_file(tmp_path / "rft" / "straight" / "grpo" / "checkpoints" / "step_8" / "hf" / "model.safetensors")
    b = load_file(grpo_dir / "checkpoints" / "step_8" / "hf" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # the weights did move in the second half, so equality above means something
    mid = load_file(grpo_dir / "checkpoints" / "step_4" / "hf" / "model.safetensors")
    assert any(not torch.equal(a[k], mid[k]) for k in a)

    ma = read_metrics(tmp_path / "rft" / "straight" / "grpo" / "metrics.jsonl")
    mb = read_metrics(grpo_dir / "metrics.jsonl")
    assert [m["step"] for m in mb] == list(range(0, 9))
    assert stable(ma, 5) == stable(mb, 5)
    assert any(m["reward/mean"] > 0 for m in stable(mb, 5))


def test_checkpoint_sync_wandb_offline_and_inline_cluster(tmp_path):
    """The other sync method and monitor, in one process: a short run completes and logs."""
    # forked (resume_support.run_to_end): a run of one process gains nothing from a fresh interpreter
    r = run_to_end(["stages=[]", "cluster=inline", "sync=checkpoint", "monitor=wandb", "buffer.total_steps=2",
                    "buffer.batch_size=4", "algorithm.repeat_times=4", "explorer.eval_interval=1", "name=other"],
                   {**os.environ, "RFT_CHECKPOINT_ROOT_DIR": str(tmp_path), "WANDB_MODE": "offline",
                    "WANDB_SILENT": "true"}, tmp_path / "run")
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "rft" / "other"
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert all("eval/accuracy" in m for m in metrics)
    assert metrics[2]["sync/version"] == 2
    assert (run / "sync" / "model.safetensors").exists()
    assert list((run / "wandb").glob("offline-run-*"))
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))


def test_a_finished_stage_killed_before_its_last_row_was_logged_logs_it_on_the_rerun(tmp_path):
    """A kill after the last checkpoint and before its step's row reached metrics.jsonl: the rerun
    finds the stage finished and writes the row from the checkpoint (the run's objective, the final
    eval, comes from it)."""
    env = {**os.environ, "RFT_CHECKPOINT_ROOT_DIR": str(tmp_path)}
    args = ["stages=[]", "cluster=inline", "monitor=console", "name=cut", "buffer.total_steps=2", "buffer.batch_size=4",
            "algorithm.repeat_times=4", "explorer.eval_interval=1", "trainer.save_interval=2"]
    # the first run in this process (resume_support.run_here), the rerun a process of its own (forked)
    run_here(args, tmp_path)
    path = tmp_path / "rft" / "cut" / "metrics.jsonl"
    rows = read_metrics(path)
    assert [m["step"] for m in rows] == [0, 1, 2] and "eval/accuracy" in rows[2]
    # what the kill leaves: the step-2 checkpoint, and the log without its row
    path.write_text("".join(line + "\n" for line in path.read_text().splitlines()[:2]))
    r = run_to_end(args, env, tmp_path / "rerun")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "already finished (step 2)" in r.stdout
    again = read_metrics(path)
    assert [m["step"] for m in again] == [0, 1, 2]
    # the row the checkpoint kept: as the first run logged it, less the save's own time (taken after)
    assert again[2] == {k: v for k, v in rows[2].items() if k != "timing/save_s"}
