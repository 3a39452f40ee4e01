"""SIGKILLs in the layouts experiments/kill_anywhere's first figures did not try (trainer=fsdp2's
ranks, PPO's critic, LoRA, multi-turn, sync_interval > 1, DPO): what its random kills found, each
at the point it fell, checked by the run's words and a resume that ends the stage."""

import re

import pytest
from resume_support import run_to_end

from rft.reporting.monitor import read_metrics

# one trainer rank (rank 1 of 2) SIGKILLs itself in the first call the stage's start makes to the
# trainer (its check of the dataset's token budgets): Ray's worker processes run this file first, as
# every Python process on PYTHONPATH does; the driver never imports the trainer
KILL_RANK_AT_START = """
import os, sys
if sys.argv and sys.argv[0].endswith("default_worker.py") and os.environ.get("KILL_RANK_AT_START"):
    import rft.trainer.fsdp as f
    checks = f.FSDPTrainer.token_budget_warnings
    def hooked(self):
        if self.rank == 1:
            os.kill(os.getpid(), 9)
        return checks(self)
    f.FSDPTrainer.token_budget_warnings = hooked
"""

# one step of 2 tasks x 2 rollouts (an experience a rank): the kill comes before any step, and the run
# after it is the stage whole, whatever its length
FSDP = ["stages=[]", "cluster=local", "cluster.num_cpus=3", "trainer=fsdp2", "trainer.ranks=2", "monitor=console",
        "buffer.total_steps=1", "trainer.save_interval=1", "buffer.batch_size=2", "algorithm.repeat_times=2",
        "explorer.eval_interval=100", "explorer.eval_on_startup=false", "synchronizer.sync_offset=0", "name=ranks"]


@pytest.mark.slow  # two Ray runs of a trainer of two ranks
def test_a_rank_killed_as_the_stage_starts_is_said_and_the_same_command_resumes(tmp_path):
    # found by experiments/kill_anywhere (--layout fsdp2 --rank-frac): rank 0 SIGKILLed 23 s into the
    # RL stage, while the stage's start asked the trainer for its token-budget warnings, ended the run
    # in Hydra's 'Error executing job' and Ray's ActorDiedError traceback (exit 1): that call went to
    # the ranks directly, past TrainerCalls, which says a trainer's death as a paragraph
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(KILL_RANK_AT_START)
    env = {"RFT_CHECKPOINT_ROOT_DIR": str(tmp_path), "KILL_RANK_AT_START": "1"}
    killed = run_to_end(FSDP, env, tmp_path / "killed", hook / "sitecustomize.py")
    assert killed.returncode == 1, killed.stderr[-3000:]
    assert "Traceback" not in killed.stderr, killed.stderr[-3000:]
    log = tmp_path / "rft" / "ranks" / "log" / "grpo_trainer_1.log"
    said = re.search(r"rft: the run stopped: the trainer actor died \((\w+): grpo_trainer_1, its log (\S+)\)\. "
                     r"Its newest checkpoint: none yet \(the stage restarts from its beginning\)\. "
                     r"Run the same command again to resume from it\.", killed.stderr)
    assert said and said[1].endswith("ActorDiedError") and said[2] == str(log), killed.stderr[-3000:]
    assert log.exists()

    # the same command, nothing killed: the stage from its beginning to its end (its one step)
    again = run_to_end(FSDP, {"RFT_CHECKPOINT_ROOT_DIR": str(tmp_path)}, tmp_path / "again")
    assert again.returncode == 0, again.stderr[-3000:]
    assert [m["step"] for m in read_metrics(tmp_path / "rft" / "ranks" / "metrics.jsonl")] == [1]
    assert (tmp_path / "rft" / "ranks" / "checkpoints" / "step_1" / "manifest.json").exists()
