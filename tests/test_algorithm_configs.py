"""Every conf/algorithm/*.yaml trains on the default study with only that override (on a budget:
two warm-up steps, then two steps of the algorithm): finite losses, metrics, the plan kept."""

import math

import pytest
from conftest import CONF, compose_cfg

import rft.runtime.main
from rft.reporting.monitor import read_metrics

ALGORITHMS = sorted(p.stem for p in (CONF / "algorithm").glob("*.yaml"))
OFFLINE = {"sft", "dpo", "rm"}  # they set mode=train and read the taskset's answers / pairs

MIX_DATA = ["+buffer.trainer_input.auxiliary_buffers.sft_dataset.path=${buffer.explorer_input.taskset.path}",
            "+buffer.trainer_input.auxiliary_buffers.sft_dataset.format.response_key=answer"]
# the default study on a budget: 2 warm-up steps, then 2 steps of 4 tasks x 4 rollouts (or 16 rows)
BUDGET = ["stages.0.buffer.total_steps=2", "stages.0.algorithm.optimizer.warmup_steps=0", "buffer.total_steps=2",
          "buffer.batch_size=4", "algorithm.repeat_times=4", "trainer.mini_batch_size=8",
          "trainer.micro_batch_size_per_gpu=4", "cluster=inline", "monitor=console", "explorer.eval_interval=2",
          "explorer.eval_on_startup=false"]


@pytest.fixture(scope="module")
def warm_up_cache(tmp_path_factory):
    """One stage cache for the rows below: their warm-up stages are one stage (the same config,
    starting model and data: 15 of the 16 rows; rm's differs), trained by the first row and copied
    by the others, as a user's sweep over the algorithm reuses it (each row's RL stage starts from
    the same model either way; a row took ~4.2 s, ~2.6 s with the copy, on 2 busy cores)."""
    return tmp_path_factory.mktemp("stage_cache")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.slow  # a training run
def test_every_algorithm_trains_on_the_default_study(algorithm, tmp_path, warm_up_cache):
    extra = ["buffer.train_batch_size=16"] if algorithm in OFFLINE else []
    if algorithm == "opd":  # a teacher: another tiny model (other weights, the same tokenizer)
        from rft.models import build_tiny_model

        extra = [f"algorithm.teacher_model_path={build_tiny_model(tmp_path / 'teacher', seed=1)}"]
    cfg = compose_cfg([f"algorithm={algorithm}", *BUDGET, *extra, f"checkpoint_root_dir={tmp_path}",
                       f"stage_cache_dir={warm_up_cache}"])
    rft.runtime.main.main(cfg)
    run = tmp_path / "rft" / cfg.name
    assert [m["step"] for m in read_metrics(run / "sft_warmup" / "metrics.jsonl")] == [1, 2]
    steps = read_metrics(run / algorithm / "metrics.jsonl")
    # a reward model's eval is its held-out pairs (eval/pair_accuracy), not generated answers
    evaluated = "eval/pair_accuracy" if algorithm == "rm" else "eval/accuracy"
    assert [m["step"] for m in steps] == [1, 2] and evaluated in steps[-1]
    for m in steps:
        assert math.isfinite(m["loss/policy"]) and math.isfinite(m["actor/grad_norm"])
        # 4 tasks x 4 rollouts = 16 experiences (16 rows offline); 16 / 8 = 2 optimizer steps per step
        assert m["train/experiences"] == 16
        assert "actor/entropy" in m and "advantage/std" in m
        if algorithm in OFFLINE:
            # two warm-up steps leave the model answering nothing right: RL gets no signal, but
            # the supervised algorithms learn from their data
            assert m["loss/policy"] > 0 and m["actor/grad_norm"] > 0
        elif algorithm == "dapo":
            # the untrained model is rarely right; only the overlong penalty makes rewards differ.
            # Dynamic sampling either filled the batch with groups that carry signal, or used all
            # 4 draws and topped it up with flat groups (the size never changes)
            tries, flat = m["rollout/sampling_tries"], m["rollout/zero_variance_group_frac"]
            assert 1 <= tries <= 4 and (flat == 0.0 or tries == 4)
            assert m["rollout/generated"] == tries * 4 * 4  # each try: 4 tasks x 4 rollouts, kept or not
        else:
            assert m["rollout/sampling_tries"] == 1
            if algorithm not in OFFLINE:
                assert m["rollout/generated"] == 16
        if algorithm == "opd":  # two different random models: the reverse KL is positive
            assert m["distill/reverse_kl"] > 0 and m["advantage/abs_mean"] > 0
        if algorithm == "mix":  # its SFT term on the taskset's answers: 0.1 x -log p, at most
            assert 0.0 < m["loss/sft"] < 0.6  # ~ 0.1 x ln(103 tokens) = 0.46 untrained


OFFLINE_DATA = ["mode=train", "stages=[]", "cluster=inline", "monitor=console", "buffer.total_steps=3",
                "buffer.train_batch_size=8", "trainer.micro_batch_size_per_gpu=4",
                "explorer.eval_interval=3", "buffer.trainer_input.experience_buffer.storage_type=file",
                "buffer.trainer_input.experience_buffer.path=${buffer.explorer_input.taskset.path}"]


@pytest.mark.slow  # a real engine, Ray or training run
def test_sft_algorithm_trains_from_a_dataset(tmp_path):
    cfg = compose_cfg(["algorithm=sft", *OFFLINE_DATA, f"checkpoint_root_dir={tmp_path}"])
    rft.runtime.main.main(cfg)
    steps = read_metrics(tmp_path / "rft" / cfg.name / "metrics.jsonl")
    # eval at 0 and 3 (mode=train still evaluates on the eval tasksets)
    assert [m["step"] for m in steps] == [0, 1, 2, 3]
    assert "eval/accuracy" in steps[0] and "eval/accuracy" in steps[3]
    assert all(m["loss/policy"] > 0 for m in steps[1:])


@pytest.mark.slow  # a real engine, Ray or training run
def test_dpo_algorithm_trains_from_preference_pairs(tmp_path):
    cfg = compose_cfg(["algorithm=dpo", *OFFLINE_DATA, f"checkpoint_root_dir={tmp_path}",
                       "buffer.trainer_input.experience_buffer.format.chosen_key=answer",
                       "buffer.trainer_input.experience_buffer.format.rejected_key=rejected"])
    rft.runtime.main.main(cfg)
    steps = read_metrics(tmp_path / "rft" / cfg.name / "metrics.jsonl")[1:]
    # 8 experiences = 4 pairs per step; the first step's policy is the reference: margin 0,
    # loss log 2 = 0.693147 per pair
    assert all(m["train/experiences"] == 8 for m in steps)
    assert steps[0]["dpo/reward_margin"] == pytest.approx(0.0, abs=1e-6)
    assert steps[0]["loss/policy"] == pytest.approx(math.log(2), abs=1e-5)


def test_odd_batch_with_preference_pairs_is_a_config_error(tmp_path):
    from rft.errors import ConfigError

    cfg = compose_cfg(["algorithm=dpo", *OFFLINE_DATA, "buffer.train_batch_size=6",
                       "trainer.micro_batch_size_per_gpu=3",
                       "buffer.trainer_input.experience_buffer.format.chosen_key=answer",
                       "buffer.trainer_input.experience_buffer.format.rejected_key=rejected"])
    with pytest.raises(ConfigError, match="trainer.micro_batch_size_per_gpu=3 must be even with preference pairs"):
        rft.runtime.main._main(cfg)


@pytest.mark.parametrize("algorithm,loss", [("dpo", "dpo"), ("rm", "bradley_terry")])
def test_a_pair_loss_under_another_aggregation_is_a_config_error(algorithm, loss):
    # each pair's loss l is spread as 2l/n over the n tokens of its two rows: seq-mean-token-sum (rows' sums,
    # over the rows) gives sum(2l)/(2 pairs) = the mean over pairs; seq-mean-token-mean gave each pair
    # 2 * (2l/n) / rows: a pair of 2 tokens 50x one of 100 (no error, exit 0)
    from rft.errors import ConfigError
    from rft.plan.batch import make_plan

    for mode, why in [("seq-mean-token-mean", "would weight each pair by 1 over its length"),
                      ("token-mean", "would scale it by 1 over the step's tokens, a different factor each step"),
                      ("seq-mean-token-sum-norm", "would scale it by 1 over model.max_response_tokens")]:
        cfg = compose_cfg([f"algorithm={algorithm}", f"algorithm.loss_agg_mode={mode}"])
        with pytest.raises(ConfigError) as e:
            make_plan(cfg, 1000)
        assert str(e.value) == (
            f"algorithm.loss_agg_mode={mode} with algorithm.policy_loss_fn={loss}: its loss is one value per "
            f"preference pair, spread over the pair's tokens so that seq-mean-token-sum gives the mean over pairs; "
            f"{mode} {why}. Set algorithm.loss_agg_mode=seq-mean-token-sum (algorithm={algorithm}'s).")
    make_plan(compose_cfg([f"algorithm={algorithm}"]), 1000)  # the algorithm's own mode plans


@pytest.mark.slow  # a real engine, Ray or training run
def test_mix_adds_a_weighted_sft_loss_from_an_auxiliary_buffer(tmp_path):
    cfg = compose_cfg(["algorithm=mix", "stages=[]", "cluster=inline", "monitor=console",
                       "buffer.total_steps=2", "buffer.batch_size=4", "algorithm.repeat_times=4",
                       "explorer.eval_on_startup=false", f"checkpoint_root_dir={tmp_path}", *MIX_DATA])
    rft.runtime.main.main(cfg)
    steps = read_metrics(tmp_path / "rft" / cfg.name / "metrics.jsonl")
    # the untrained model: -log p of a 4-token answer is ~ln(103 tokens) = 4.6 per token, x 0.1
    assert all(0.2 < m["loss/sft"] < 0.6 for m in steps)


def test_mix_without_an_auxiliary_buffer_learns_from_the_tasksets_answers(tmp_path):
    from rft.errors import ConfigError
    from rft.plan.batch import sft_buffer_config

    cfg = compose_cfg(["algorithm=mix", "stages=[]", "cluster=inline", "monitor=console",
                       "buffer.total_steps=1", f"checkpoint_root_dir={tmp_path}"])
    sft, where = sft_buffer_config(cfg)
    ts = cfg.buffer.explorer_input.taskset
    assert (sft.path, sft.split, sft.format.prompt_key, sft.format.response_key, where) == (
        ts.path, "train", "question", "answer", "buffer.explorer_input.taskset")
    # no answers to learn from either: the error names both ways to give it some
    cfg = compose_cfg(["algorithm=mix", "stages=[]", "buffer.explorer_input.taskset.format.response_key=null"])
    with pytest.raises(ConfigError, match=r"algorithm.sft_loss_weight=0.1 needs expert data: an auxiliary "
                                          r"buffer algorithm.sft_buffer='sft_dataset' in buffer.trainer_input.auxiliary_buffers"):
        sft_buffer_config(cfg)
