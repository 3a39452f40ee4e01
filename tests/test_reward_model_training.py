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
