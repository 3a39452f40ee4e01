"""A reward model trained in the run (algorithm=rm): the Bradley-Terry loss, the reward head's
scores, the stage:<title> reference, and the three-stage pipeline (SFT -> RM -> GRPO on it)."""

import json
import math

import pytest
import torch
import yaml
from conftest import compose_cfg

from rft.algorithms import agg_loss
from rft.algorithms.losses import bradley_terry_loss
from rft.data.experience import Experience
from rft.data.operators import best_worst_pairs
from rft.data.pipeline import ExperiencePipeline, experience_operators
from rft.errors import ConfigError
from rft.plan.batch import make_plan, stage_configs
from rft.reporting.monitor import read_metrics


def test_the_bradley_terry_loss_and_its_gradient_on_two_pairs():
    # two pairs (chosen, rejected): scores (2.0, 0.5) and (-1.0, 1.0), each at its row's last token
    # (rows of 2, 1, 3 and 2 response tokens)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    scores = torch.tensor([2.0, 0.5, -1.0, 1.0], requires_grad=True)
    last = torch.tensor([1, 0, 2, 1])
    logp = torch.zeros(4, 3).index_put((torch.arange(4), last), scores)
    loss_mat, metrics = bradley_terry_loss(logp, {"response_mask": mask}, None)
    loss = agg_loss(loss_mat, mask, "seq-mean-token-sum", 4, int(mask.sum()), 3)
    # margins 1.5 and -2.0: -log sigmoid(1.5) = log(1 + e^-1.5) = 0.201413,
    # -log sigmoid(-2.0) = log(1 + e^2) = 2.126928; the mean over the 2 pairs = 1.164170
    assert loss.item() == pytest.approx((math.log(1 + math.exp(-1.5)) + math.log(1 + math.exp(2.0))) / 2, abs=1e-6)
    assert loss.item() == pytest.approx(1.164170, abs=1e-6)
    loss.backward()
    # d/dr_chosen = -(1 - sigmoid(margin)) / 2 pairs; d/dr_rejected the opposite:
    # pair 1: -(1 - 0.817574) / 2 = -0.091213; pair 2: -(1 - 0.119203) / 2 = -0.440399
    assert scores.grad.tolist() == pytest.approx([-0.091213, 0.091213, -0.440399, 0.440399], abs=1e-6)
    # the chosen row is scored higher in the first pair only; margins sum to 1.5 - 2.0
    assert metrics["rm/accuracy"] == (1.0, 2.0)
    assert metrics["rm/margin"] == (pytest.approx(-0.5), 2.0)
    # a tie counts as wrong (as TRL counts it): a head that scores both rows alike is right on 0 of 1,
    # and its loss is log 2 = 0.693147
    tied = torch.zeros(2, 3).index_put((torch.arange(2), torch.tensor([0, 0])), torch.tensor([0.3, 0.3]))
    loss_mat, metrics = bradley_terry_loss(tied, {"response_mask": mask[:2]}, None)
    assert metrics["rm/accuracy"] == (0.0, 1.0)
    assert agg_loss(loss_mat, mask[:2], "seq-mean-token-sum", 2, int(mask[:2].sum()), 3).item() == pytest.approx(
        math.log(2), abs=1e-6)


@pytest.mark.slow  # a tiny model built and a trainer started (~5 s)
def test_the_reward_head_scores_a_row_as_the_served_reward_model_does(tmp_path):
    """The trainer's score of a (question, response) row equals what the saved model scores as a
    reward_model part (kind classifier, chat_template) once the stage is over."""
    from rft.data.experience import collate
    from rft.data.readers import DatasetReader
    from rft.data.tasks import ensure_task_data, load_rows
    from rft.models import ensure_model
    from rft.rewards.reward_model import RewardModelWorker
    from rft.trainer.trainer import Trainer

    cfg = stage_configs(compose_cfg(["cluster=inline", "algorithm=rm", "stages=[]", "buffer.total_steps=2"]))[0]
    ensure_model(cfg.model)
    ensure_task_data(cfg.buffer.explorer_input)
    trainer = Trainer(cfg, make_plan(cfg, 2000))
    assert type(trainer.model).__name__ == "Qwen2ForSequenceClassification"
    trainer.train_dataset_step(1, 16)
    trainer.save(str(tmp_path / "ckpt"))
    eb = cfg.buffer.trainer_input.experience_buffer
    rows = DatasetReader(eb, trainer.tokenizer, cfg.model.max_prompt_tokens, cfg.model.max_response_tokens, 0).items[:4]
    accuracy = trainer.pair_accuracy(rows)
    served = RewardModelWorker(str(tmp_path / "ckpt" / "hf"), kind="classifier", chat_template=True)
    ds = load_rows(eb.path, eb.split)
    data = [ds[i] for i in range(4)]
    chosen = served.score([r["question"] for r in data], [r["answer"] for r in data])
    rejected = served.score([r["question"] for r in data], [r["rejected"] for r in data])
    with torch.no_grad():
        full = collate([e for pair in rows for e in pair], trainer.tokenizer.pad_token_id)
        (out, _), _ = trainer._forward(trainer.model, full, 0, 8)
    mine = out.sum(-1).tolist()
    assert mine[0::2] == pytest.approx(chosen, abs=1e-4) and mine[1::2] == pytest.approx(rejected, abs=1e-4)
    assert accuracy == sum(c > r for c, r in zip(chosen, rejected)) / 4


def test_a_stage_reference_must_name_an_earlier_reward_model_stage():
    from rft.runtime import stage_models

    cfg = compose_cfg(["experiment=rm_pipeline"])
    stages = stage_configs(cfg)
    plans = [make_plan(s, 2000) for s in stages]
    stage_models.check(stages, plans)  # rm comes before grpo
    assert stage_models.references(stages[2]) == [("buffer.explorer_input.taskset.reward_fn.0.args.model_path", "rm")]
    resolved = stage_models.resolve(stages[2], {"rm": "/runs/rm/checkpoints/step_150/hf"})
    assert resolved.buffer.explorer_input.taskset.reward_fn[0].args.model_path == "/runs/rm/checkpoints/step_150/hf"
    assert stages[2].buffer.explorer_input.taskset.reward_fn[0].args.model_path == "stage:rm"  # left as it was
    with pytest.raises(ConfigError) as e:
        stage_models.check([stages[0], stages[2]], [plans[0], plans[2]])
    assert str(e.value) == (
        "stage grpo: buffer.explorer_input.taskset.reward_fn.0.args.model_path=stage:rm names no reward-model stage "
        "before it (earlier reward-model stages: none). stage:<title> is the final model of an earlier stage that "
        "trains a reward model (algorithm=rm); put that stage first, or give a directory.")
    # a reward model is trained from pairs in a dataset, never from rollouts
    with pytest.raises(ConfigError) as e:
        make_plan(stage_configs(compose_cfg(["algorithm=grpo", "stages=[]", "algorithm.policy_loss_fn=bradley_terry"]))[0], 2000)
    assert "trains a reward model from preference pairs in a dataset" in str(e.value)


@pytest.mark.slow  # three stages: 1 warm-up step, 60 reward-model steps, 10 GRPO steps (~60 s)
def test_sft_then_a_reward_model_then_grpo_on_its_scores(warm_start, tmp_path):
    cfg = compose_cfg(["experiment=rm_pipeline", f"checkpoint_root_dir={tmp_path}", f"model.model_path={warm_start}",
                       "model.builder=null", "stages.0.buffer.total_steps=1", "stages.0.algorithm.optimizer.warmup_steps=0",
                       "stages.0.algorithm.optimizer.lr=1e-9", "stages.1.buffer.total_steps=60",
                       "stages.1.explorer.eval_interval=30", "buffer.total_steps=10", "explorer.eval_interval=10"])
    import rft.runtime.main

    rft.runtime.main.main(cfg)
    run = tmp_path / "rft" / "rm_pipeline"
    rm = read_metrics(run / "rm" / "metrics.jsonl")
    accuracy = [m["eval/pair_accuracy"] for m in rm if "eval/pair_accuracy" in m]
    assert len(accuracy) == 2 and accuracy[-1] >= 0.8, accuracy  # held-out pairs; chance is 0.5
    grpo = read_metrics(run / "grpo" / "metrics.jsonl")
    # rewarded by the reward model alone (its logit: not 0/1), evaluated by the exact verifier
    assert all(set(m) >= {"reward/reward_model/mean"} for m in grpo if "reward/mean" in m)
    evals = [m["eval/accuracy"] for m in grpo if "eval/accuracy" in m]
    warm = [m["eval/accuracy"] for m in read_metrics(run / "sft_warmup" / "metrics.jsonl") if "eval/accuracy" in m]
    assert evals[0] == warm[-1]  # the RL stage starts from the warm-up's policy, not the reward model
    assert evals[-1] >= evals[0] + 0.3, evals
    saved = json.dumps(yaml.safe_load((run / "grpo" / "config.yaml").read_text()))
    assert "stage:rm" in saved  # the stage's config on disk keeps the reference


# ---------------------------------------------------------------- pairs from a fixed policy's groups

# a reward model trained on the pairs of the explorers' groups (algorithm.rm_pairs=groups): 16
# tasks a step, 8 responses each, from the stage's starting policy
ONLINE = ["algorithm=rm", "stages=[]", "mode=both", "algorithm.rm_pairs=groups", "algorithm.repeat_times=8",
          "buffer.trainer_input.experience_buffer.storage_type=queue", "buffer.batch_size=16"]


def _rollout(group: str, k: int, reward: float) -> Experience:
    """Response k of a group: prompt [7, 8], response [10 + k], sampled (log-prob -0.5) by version 3."""
    return Experience([7, 8, 10 + k], 2, [-0.5], reward=reward, group_id=group, task_id=f"t/{group}",
                      policy_version=3, info={"k": k})


def test_each_group_gives_its_first_best_over_its_first_worst_response_and_equal_rewards_no_pair():
    rewards = {"a": [1.0, 0.0, 0.0, 1.0], "b": [0.0, 0.0, 0.0, 0.0], "c": [0.5, 1.0, 0.0]}
    # interleaved as concurrent tasks finish: a0 b0 c0 a1 b1 c1 a2 b2 c2 a3 b3 (11 rollouts)
    exps = [_rollout(g, k, r[k]) for k in range(4) for g, r in rewards.items() if k < len(r)]
    pairs = best_worst_pairs(exps)
    # a: the best reward 1 first at k=0 (k=3 ties, later), the worst 0 first at k=1 (k=2 ties);
    # b: every reward 0, no pair; c: best 1 at k=1, worst 0 at k=2 (0.5 is neither)
    assert [(e.group_id, e.info["k"], e.info["preference"], e.reward) for e in pairs] == [
        ("a", 0, "chosen", 1.0), ("a", 1, "rejected", 0.0), ("c", 1, "chosen", 1.0), ("c", 2, "rejected", 0.0)]
    assert [e.tokens for e in pairs] == [[7, 8, 10], [7, 8, 11], [7, 8, 11], [7, 8, 12]]
    assert all(e.logprobs == [] and e.prompt_length == 2 for e in pairs)  # no sampling log-probs to weigh
    assert exps[0].logprobs == [-0.5] and "preference" not in exps[0].info  # the rollouts are left as they were
    assert best_worst_pairs([_rollout("b", k, 0.0) for k in range(4)]) == []
    # the stage puts it last in its experience pipeline, after the study's own operators
    cfg = stage_configs(compose_cfg(ONLINE + ["+data_processor.experience_pipeline.operators=[{name: reward_filter}]"]))[0]
    assert [op["name"] for op in experience_operators(cfg)] == ["reward_filter", "best_worst_pairs"]
    kept, m = ExperiencePipeline(experience_operators(cfg))(exps)
    assert len(kept) == 4 and m == {"experience_pipeline/in": 11, "experience_pipeline/reward_filter/out": 11,
                                    "experience_pipeline/best_worst_pairs/out": 4, "experience_pipeline/kept": 4}
    assert experience_operators(stage_configs(compose_cfg(["algorithm=rm", "stages=[]"]))[0]) == []


@pytest.mark.slow  # a dry run and nine configs composed (~1.3 s)
def test_a_reward_model_on_the_groups_pairs_plans_and_a_wrong_combination_is_one_paragraph(capsys):
    import rft.runtime.main

    plan = make_plan(stage_configs(compose_cfg(ONLINE))[0], 2000)
    # 16 tasks x 8 responses sampled; one pair at most a task: up to 16 pairs, 32 experiences a step
    assert (plan.input_kind, plan.tasks_per_step, plan.rollouts_per_task, plan.experiences_per_step,
            plan.optimizer_steps_per_step, plan.explorers) == ("rollouts", 16, 8, 32, 1, 1)
    rft.runtime.main._main(compose_cfg(ONLINE + ["dry_run=true"]))
    out = capsys.readouterr().out
    assert "serves the stage's starting policy throughout, never synced: the trainer's model is the reward model" in out
    assert "experience pipeline  best_worst_pairs, over each explore step's experiences" in out
    assert "eval/pair_accuracy on " in out and "(split test), every 10 steps" in out and "weight sync" not in out

    def error(*overrides, base=ONLINE) -> str:
        with pytest.raises(ConfigError) as e:
            make_plan(stage_configs(compose_cfg([*base, *overrides]))[0], 2000)
        return str(e.value)

    assert error("buffer.train_batch_size=128") == (
        "buffer.train_batch_size=128 must equal 2 x buffer.batch_size (16) = 32 with algorithm.rm_pairs=groups: it "
        "counts experiences, and each task's group of 8 responses gives at most one pair, two experiences (chosen, "
        "rejected), so a step trains on up to 16 pairs (fewer when some groups' rewards are all equal). Remove "
        "buffer.train_batch_size (it defaults to 2 x batch_size) or set it to 32.")
    # algorithm=rm's own mode=train (a dataset's pairs) with the groups' pairs asked for
    assert error("algorithm.rm_pairs=groups", base=["algorithm=rm", "stages=[]"]) == (
        "algorithm.rm_pairs=groups trains the reward model on pairs made from each explore step's groups, so the stage "
        "explores and trains at once (mode=both), but mode=train. Set mode=both, or algorithm.rm_pairs=dataset to "
        "learn from the pairs in buffer.trainer_input.experience_buffer (mode=train).")
    assert error("buffer.trainer_input.experience_buffer.storage_type=file").startswith(
        "algorithm.rm_pairs=groups passes the pairs to the trainer in memory, so buffer.trainer_input.experience_buffer."
        "storage_type must be queue (it is file;")
    assert "gives groups of one (no pair ever)" in error("algorithm.repeat_times=1")
    assert "trains no reward model (bradley_terry does)" in error("algorithm=grpo")
    # pairs stay whole in a mini-batch: mini-batches of one experience would split each
    assert error("trainer.mini_batch_size=1") == (
        "trainer.mini_batch_size=1 must be even with preference pairs (algorithm.rm_pairs=groups): each pair is two "
        "experiences that stay together.")


@pytest.mark.slow  # a warm-up step, 30 reward-model steps on the policy's groups, 2 GRPO steps on its scores (~25 s)
def test_a_reward_model_learns_the_policys_groups_and_rewards_the_next_stage(warm_start, tmp_path):
    cfg = compose_cfg(["experiment=rm_online", f"checkpoint_root_dir={tmp_path}", f"model.model_path={warm_start}",
                       "model.builder=null", "stages.0.buffer.total_steps=1", "stages.0.algorithm.optimizer.warmup_steps=0",
                       "stages.0.algorithm.optimizer.lr=1e-9", "stages.1.buffer.total_steps=30",
                       "stages.1.explorer.eval_interval=15", "buffer.total_steps=2", "explorer.eval_interval=2"])
    import rft.runtime.main

    rft.runtime.main.main(cfg)
    run = tmp_path / "rft" / "rm_online"
    rm = read_metrics(run / "rm" / "metrics.jsonl")
    # the held-out dataset pairs (the right answer over the sloppy teacher's), a kind it never trains
    # on: at chance before its first step, well above it after (measured 0.505 -> 0.80 -> 0.725; the
    # 200 pairs' standard error is ~0.03)
    accuracy = [m["eval/pair_accuracy"] for m in rm if "eval/pair_accuracy" in m]
    assert len(accuracy) == 3 and 0.4 <= accuracy[0] <= 0.6 and min(accuracy[1:]) >= 0.7, accuracy
    steps = [m for m in rm if "train/experiences" in m]
    # each step 32 groups of 8 rollouts in; out, two experiences from each group whose rewards differ
    assert all(m["experience_pipeline/in"] == 256 and m["train/experiences"] == m["experience_pipeline/kept"] <= 64
               and m["train/experiences"] % 2 == 0 for m in steps)
    assert {m["sync/version"] for m in steps} == {0}  # the explorers served the starting policy throughout
    online = [m["rm/online_accuracy"] for m in steps]  # each step's pairs, before it learns them
    assert sum(online[-10:]) / 10 >= sum(online[:5]) / 5 + 0.1, online
    grpo = read_metrics(run / "grpo" / "metrics.jsonl")
    assert all(set(m) >= {"reward/reward_model/mean"} for m in grpo if "reward/mean" in m)  # stage:rm, scored
    evals = [m["eval/accuracy"] for m in grpo if "eval/accuracy" in m]
    warm = [m["eval/accuracy"] for m in read_metrics(run / "sft_warmup" / "metrics.jsonl") if "eval/accuracy" in m]
    assert evals[0] == warm[-1]  # the RL stage starts from the warm-up's policy, not the reward model


@pytest.mark.slow  # the arithmetic data generated and a tokenizer loaded (~1.5 s)
def test_an_eval_split_the_data_lacks_is_named_by_its_own_key():
    from rft.data.tasks import ensure_task_data
    from rft.models import ensure_model, load_tokenizer
    from rft.trainer.trainer import _held_out_pairs

    cfg = stage_configs(compose_cfg(["algorithm=rm", "stages=[]", "cluster=inline",
                                     "buffer.trainer_input.experience_buffer.eval_split=tset"]))[0]
    ensure_model(cfg.model)
    ensure_task_data(cfg.buffer.explorer_input)
    with pytest.raises(ConfigError) as e:
        _held_out_pairs(cfg, load_tokenizer(cfg.model))
    msg = str(e.value)
    assert msg.startswith("buffer.trainer_input.experience_buffer.eval_split='tset' (the held-out pairs of "
                          "eval/pair_accuracy): buffer.trainer_input.experience_buffer.path=")
    assert "Unknown split \"tset\"" in msg and msg.endswith("Name a split the data has, or unset eval_split.")
