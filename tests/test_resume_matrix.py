"""A run killed with SIGKILL and run again with the same command ends where the uninterrupted run
ends (README, Resume), for each feature a study turns on: the final weights bit for bit, every
piece of state a checkpoint carries (optimizer, scheduler, RNG, critic, the schedule's state.json:
buffer position, experiences explored ahead, curriculum, reward statistics), the batches trained
on and the metric rows.

Each case is a short run from the session's SFT warm start (conftest.warm_start): 4 GRPO steps of
4 tasks x 4 rollouts, a checkpoint every 2, no eval set (but for the eval case). It runs straight,
then again, SIGKILLed once its step-2 checkpoint is written (or, in the middle of a step, by
itself the moment its buffer has taken an explore step's experiences that no checkpoint accounts
for yet), then the same command once more. rft has no fault hooks of its own: the self-kill is a
sitecustomize the killed run's process runs first. The straight run runs in the test's process (the
same files, bit for bit, without a fresh interpreter's imports); the killed run and the resumed one
each in a process of its own (resume_support.launch).
"""


from pathlib import Path

import pytest
import torch
from resume_support import NO_EVAL, SHORT, check_resumes, run_here, weights

from rft.reporting.monitor import read_metrics

pytestmark = pytest.mark.slow


MIX_DATA = ["algorithm=mix", "algorithm.sft_batch_size=8",
            "+buffer.trainer_input.auxiliary_buffers.sft_dataset.path=${buffer.explorer_input.taskset.path}",
            "+buffer.trainer_input.auxiliary_buffers.sft_dataset.format.response_key=answer"]

# features that do not touch each other share a case (each case is three runs, ~16 s): the checks
# below see each at work
CASES = {
    # a KL loss to the reference model (k3) and a KL penalty on the reward (k1), an entropy bonus, a
    # warm-up and cosine schedule, a reward part normalised by running statistics (kept by the driver,
    # in state.json)
    "kl-entropy-schedule-reward-normalisation": [
        "algorithm.kl_loss_fn=k3", "algorithm.kl_loss_coef=0.1", "algorithm.kl_penalty_fn=k1",
        "algorithm.kl_penalty_coef=0.1", "algorithm.entropy_coef=0.01", "algorithm.optimizer.warmup_steps=3",
        "algorithm.optimizer.warmup_style=cosine", "algorithm.optimizer.min_lr_ratio=0.1",
        "buffer.explorer_input.taskset.reward_fn=[{fn:exact_match,weight:1.0,normalize:true}]"],
    # several optimizer steps a step (mini-batches, two epochs), gradient accumulation over
    # micro-batches, micro-batches by token count; replay that never reads a used experience again
    # (the newest version always ranks first)
    "epochs-minibatches-accumulation-replay": [
        "trainer.ppo_epochs=2", "trainer.mini_batch_size=8", "trainer.micro_batch_size_per_gpu=4",
        "trainer.use_dynamic_bsz=true", "trainer.max_token_len_per_gpu=64",
        "buffer.trainer_input.experience_buffer.replay_buffer.enable=true",
        "buffer.trainer_input.experience_buffer.replay_buffer.reuse_cooldown_time=0"],
    # DAPO's dynamic sampling with the online curriculum: tests/test_trained_on.py
    # the auxiliary SFT buffer's read position
    "mix-auxiliary-sft": MIX_DATA,
    # LoRA resumed from a checkpoint without hf/ (the adapter alone; with hf/: tests/test_lora.py,
    # tests/test_lora_sync.py)
    "lora-hf-last": ["model.lora.rank=4", "model.lora.alpha=8", "algorithm.optimizer.lr=1e-2",
                     "trainer.save_hf_checkpoint=last"],
    # PPO: the critic (its weights and optimizer in trainer_state.pt) and GAE; killed at step 2 in
    # its warm-up (the critic alone trains until step 3), step 4 trains the actor too
    "ppo-critic-warmup": ["algorithm=ppo", "algorithm.critic_lr=1e-3", "algorithm.critic_warmup=3"],
    "sft-dataset": ["algorithm=sft", "algorithm.optimizer.lr=1e-3"],
    "two-engines-async-checkpoint-sync": ["explorer.rollout_model.engine_num=2", "synchronizer.sync_offset=1",
                                          "sync=checkpoint"],
    # partial rollouts: tests/test_dynamic.py kills and resumes them bit for bit in the test mode (fixed
    # interrupts; free-running, which version writes which token depends on timing)
    # Ray actors (cluster=local): the trainer's two ranks and the explorer each restore in their own
    # process (an explorer actor killed and restarted mid-run: tests/test_runtime.py). The ranks
    # shard PPO's critic (gathered into trainer_state.pt) and LoRA's frozen base with the adapters,
    # and rank 0 broadcasts the merged model to the explorer (sync=collective), fingerprint-checked
    # at each sync: this case is the run that shows those (a Ray run costs ~20 s to start)
    "fsdp2-two-ranks-ppo-lora-collective": ["trainer=fsdp2", "trainer.ranks=2", "cluster=local", "cluster.num_cpus=3",
                                            "algorithm=ppo", "model.lora.rank=4", "model.lora.alpha=8",
                                            "algorithm.optimizer.lr=1e-2", "sync=collective"],
}


def sharded_critic_and_adapters(rows, state, end: Path) -> bool:
    """The critic (from the warm start: some rollouts are rewarded, so the returns and the value loss
    are not 0) and the policy trained at every step; the explorer took each version by broadcast; the
    checkpoint holds the critic gathered from the ranks, and the adapter beside the merged hf/."""
    trained = [m for m in rows if "critic/value_loss" in m]
    critic = torch.load(end / "trainer_state.pt", weights_only=True)["critic"]
    return ([m["step"] for m in trained] == [1, 2, 3, 4] and all(m["critic/value_loss"] > 0 for m in trained)
            and [m["step"] for m in rows if "loss/policy" in m] == [1, 2, 3, 4]
            and [m["sync/version"] for m in rows if "sync/version" in m][-4:] == [1, 2, 3, 4]
            and critic is not None and "head.weight" in critic["model"]
            and (end / "adapter" / "adapter_model.safetensors").exists() and (end / "hf" / "model.safetensors").exists())


# that the feature was at work in the run (metrics rows, the final state.json, the final checkpoint)
AT_WORK = {
    # the critic trained at every step, the policy at step 4 alone (versions 0-2 warm the critic up)
    "ppo-critic-warmup": lambda rows, state, end: (all("critic/value_loss" in m for m in rows if m["step"] > 0)
                                                   and [m["step"] for m in rows if "loss/policy" in m] == [4]),
    "mix-auxiliary-sft": lambda rows, state, end: "loss/sft" in rows[-1],
    # 4 steps x 16 rewards normalised; the penalty on the reward; the lr warming up over steps 1-3
    # (measured: 0, 6.7e-5, 1.3e-4, then 2e-4)
    "kl-entropy-schedule-reward-normalisation": lambda rows, state, end: (
        state["reward_norm"]["exact_match"][0] == 4 * 16 and rows[-1]["reward/kl_penalty"] != 0
        and rows[0]["actor/lr"] < rows[1]["actor/lr"] < rows[2]["actor/lr"] < rows[3]["actor/lr"]),
    "fsdp2-two-ranks-ppo-lora-collective": sharded_critic_and_adapters,
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_killed_run_resumes_to_the_uninterrupted_one(name, warm_start, tmp_path):
    rows, state = check_resumes(tmp_path, warm_start, CASES[name])
    end = tmp_path / "rft" / "straight" / "checkpoints" / "step_4"
    assert AT_WORK.get(name, lambda rows, state, end: True)(rows, state, end)


# an eval at the start and every 2 steps, sampled (temperature 1, 2 samples a task)
SAMPLED_EVAL = ["explorer.eval_interval=2", "explorer.eval_on_startup=true",
                "buffer.explorer_input.eval_tasksets.0.rollout_args.temperature=1.0",
                "+buffer.explorer_input.eval_tasksets.0.repeat_times=2"]


def test_a_run_with_sampled_evals_resumes_and_its_evals_draw_nothing_training_draws(warm_start, tmp_path):
    """The resumed run skips the eval at step 0 that the uninterrupted one made: the same result
    means the eval's sampling shifted nothing of training's; and a run without evals trains the
    same weights on the same batches."""
    rows, _ = check_resumes(tmp_path, warm_start, SAMPLED_EVAL)
    assert [m["step"] for m in rows if "eval/arithmetic_test/maj@2" in m] == [0, 2, 4]
    run_here([*SHORT, *NO_EVAL, f"model.model_path={warm_start}", "model.builder=null", "name=no_eval"], tmp_path)
    a, b = tmp_path / "rft" / "straight", tmp_path / "rft" / "no_eval"
    wa, wb = weights(a / "checkpoints" / "step_4"), weights(b / "checkpoints" / "step_4")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert read_metrics(a / "batches.jsonl") == read_metrics(b / "batches.jsonl")


