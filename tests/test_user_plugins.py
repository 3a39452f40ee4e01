"""A new user's study that extends rft from its own folder (experiments/plugin_study/plugins.py, each
part a dotted path, rft/ untouched): an advantage estimator, a policy loss, a reward and an
experience operator of its own. Their values reach the loss exactly; a careless plugin's mistake
is one paragraph naming it and the fix (rft.algorithms.contract, rft.data.pipeline), never a raw
traceback or a run that exits 0 having trained on something else; the plugin run resumes after a
SIGKILL to the uninterrupted result, and a -m sweep over it and a built-in reports both."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, compose_cfg
from resume_support import forked_to_end, kill_when, run_to_end

from rft.algorithms.contract import check_advantages, check_loss, checked
from rft.data.experience import Experience
from rft.errors import ConfigError, RunError

P = "experiments.plugin_study.plugins"
STUDY = [f"algorithm.advantage_fn={P}.sign_advantage", "+algorithm.advantage_args.scale=0.5",
         f"algorithm.policy_loss_fn={P}.reinforce_loss",
         f"buffer.explorer_input.taskset.reward_fn={{fn: {P}.length_reward, args: {{per_char: 0.25}}}}",
         f"data_processor.experience_pipeline.operators=[{{name: {P}.add_bonus, args: {{bonus: 0.5}}}}]"]
TINY = ["stages=[]", "cluster=inline", "monitor=console", "buffer.batch_size=4", "algorithm.repeat_times=2",
        "explorer.eval_on_startup=false", "buffer.explorer_input.eval_tasksets=[]", "model.max_response_tokens=4"]


# ---------------------------------------------------------------- the study's functions by hand


def test_the_study_advantage_is_a_constant_per_group_and_sign():
    from experiments.plugin_study.plugins import reinforce_loss, sign_advantage

    # group 0: rewards 1.5, 1.0 (mean 1.25); group 1: 0.5, 0.5 (mean 0.5, equal)
    batch = {"rewards": torch.tensor([1.5, 1.0, 0.5, 0.5], dtype=torch.float64), "group_index": torch.tensor([0, 0, 1, 1]),
             "response_mask": torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0]])}
    adv = sign_advantage(batch, None, scale=0.5)
    assert adv.tolist() == [[0.5, 0.5, 0.0], [-0.5, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    logp = torch.tensor([[-1.0, -2.0, float("nan")], [-3.0, 0.0, 0.0], [-1.0, -1.0, -1.0], [0.0, -1.0, -1.0]])
    loss, metrics = reinforce_loss(logp, {**batch, "advantages": adv}, None)
    # -A x logp: row 0: -0.5 x -1 = 0.5, -0.5 x -2 = 1.0; row 1: 0.5 x -3 = -1.5; a NaN off the mask stays out
    assert loss.tolist() == [[0.5, 1.0, 0.0], [-1.5, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]] and metrics == {}


# ---------------------------------------------------------------- a careless plugin's outputs

MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
SHAPE = "a tensor of one advantage per response token, of batch['response_mask']'s shape [2, 3] (N rows x T positions)"
BROADCAST = ("A value per sequence is broadcast over its tokens as `adv[:, None] * batch['response_mask']` "
             "(rft/algorithms/advantages.py).")


@pytest.mark.parametrize("adv, got", [
    (None, "NoneType"),
    ([[0.0] * 3] * 2, "list"),
    (torch.zeros(2), "a tensor of shape [2]"),
    (torch.zeros(2, 1), "a tensor of shape [2, 1]"),  # would broadcast silently in the loss
    (torch.zeros(2, 4), "a tensor of shape [2, 4]"),  # would be cut to [2, 3] silently
])
def test_an_advantage_of_the_wrong_kind_or_shape_is_named(adv, got):
    with pytest.raises(ConfigError) as e:
        check_advantages(adv, MASK, "my.adv")
    assert str(e.value) == f"algorithm.advantage_fn=my.adv returned {got} where {SHAPE} goes. {BROADCAST}"


def test_a_nan_advantage_on_a_response_token_is_named_and_one_off_the_mask_is_not():
    check_advantages(torch.tensor([[1.0, 1.0, float("nan")], [1.0, float("inf"), 0.0]]), MASK, "my.adv")
    # an integer advantage (torch.sign of ints) is converted by the trainer, not refused
    check_advantages(torch.tensor([[1, -1, 0], [1, 0, 0]]), MASK, "my.adv")
    with pytest.raises(ConfigError) as e:
        check_advantages(torch.tensor([[1.0, float("nan"), 0.0], [float("inf"), 0.0, 0.0]]), MASK, "my.adv")
    assert str(e.value) == (
        "algorithm.advantage_fn=my.adv returned NaN or inf at 2 of the batch's 3 response tokens (rows [0, 1]) from "
        "finite rewards (batch['rewards']): a division by a zero std or count? Nothing was trained on them; fix "
        "the function.")


LOGP = torch.zeros(2, 3, requires_grad=True)
PAIR = ("a policy loss returns a pair (loss, metrics): the loss per token, of logp's shape [2, 3], and a dict of "
        "metrics ({} for none).")
PER_TOKEN = ("where the loss per token, of logp's shape [2, 3], goes: return it before any mean or sum. The trainer "
             "weights each token (algorithm.rollout_is), adds the KL and entropy terms and aggregates over the "
             "response tokens by algorithm.loss_agg_mode (rft/algorithms/losses.py).")
METRICS = ("a dict of name -> number (a sum over the micro-batch's tokens, added up over micro-batches), or name -> "
           "(sum, count) for a mean over something else; {} for none.")


@pytest.mark.parametrize("out, message", [
    (LOGP * 2, f"returned a [2, 3] Tensor; {PAIR}"),  # the loss alone: two rows would unpack as (loss, metrics)
    ((LOGP * 2, {}, {}), f"returned a tuple of 3; {PAIR}"),
    # loss.mean(): it ran and exited 0, the aggregation, IS weights and KL applied to a number
    (((LOGP * 2).mean(), {}), f"returned a loss of shape [] {PER_TOKEN}"),
    (((LOGP * 2).sum(-1), {}), f"returned a loss of shape [2] {PER_TOKEN}"),
    ((LOGP.detach() * 2, {}), "returned a loss without a gradient: it does not depend on logp (a detached or "
                              "recomputed log-prob?), so the update would not change the policy. Compute it from the "
                              "logp it is given."),
    ((LOGP * 2, None), f"returned metrics of the wrong kind: {METRICS}"),
    ((LOGP * 2, {"my/x": "abc"}), f"returned metrics of the wrong kind ('my/x': 'abc'): {METRICS}"),
])
def test_a_policy_loss_of_the_wrong_kind_or_shape_is_named(out, message):
    with pytest.raises(ConfigError) as e:
        check_loss(out, LOGP, "my.loss")
    assert str(e.value) == f"algorithm.policy_loss_fn=my.loss {message}"
    # what the built-in losses return passes: numbers, 0-d tensors, (sum, count) pairs
    check_loss((LOGP * 2, {"a": 1.0, "b": torch.tensor(2.0), "c": (3.0, 2)}), LOGP, "my.loss")


def raises_keyerror(batch, cfg):
    return batch["values"]


def test_a_study_function_that_raises_names_itself_and_its_line_and_a_registered_one_is_not_wrapped():
    from rft.algorithms import ADVANTAGE_FNS

    fn = checked(ADVANTAGE_FNS, "test_user_plugins.raises_keyerror", raises_keyerror)
    with pytest.raises(RunError) as e:
        fn({}, None)
    line = raises_keyerror.__code__.co_firstlineno + 1
    assert str(e.value) == (
        f"algorithm.advantage_fn=test_user_plugins.raises_keyerror raised KeyError: 'values' ({__file__}, line {line}), "
        f"in the trainer; its traceback is in the trainer's log under <stage>/log/. Fix the function, then run the "
        f"same command again: it resumes from the newest checkpoint.")
    assert checked(ADVANTAGE_FNS, "grpo", ADVANTAGE_FNS["grpo"]) is ADVANTAGE_FNS["grpo"]


def op_none(experiences):
    return None


def op_generator(experiences):
    return (e for e in experiences)


def op_dicts(experiences):
    return [e.to_dict() for e in experiences]


def op_nan(experiences):
    for e in experiences:
        e.reward = float("nan")
    return experiences


def op_raises(experiences):
    if experiences:
        raise ValueError("no such part")
    return experiences


@pytest.mark.parametrize("op, message", [
    ("op_none", "returned NoneType, not a list: {fix}."),
    ("op_generator", "returned generator, not a list: {fix}."),
    ("op_dicts", "returned a list whose entry 0 is a dict: {fix}."),
    # a NaN reward trained on NaN advantages, every update skipped, and a 2-step run exited 0
    ("op_nan", "set experience 0's reward (task 't/0') to nan: a reward is a finite number (float), which the "
               "advantages are computed from."),
])
def test_an_experience_operator_returning_the_wrong_thing_is_named(op, message):
    from rft.data.pipeline import ExperiencePipeline

    name = f"test_user_plugins.{op}"
    with pytest.raises(ConfigError) as e:
        # planning's call on no experiences finds the first two; the step's, the others
        ExperiencePipeline([{"name": name}])([Experience([1, 2, 3], 2, [-1.0], reward=1.0, task_id="t/0")])
    fix = f"{name} must return the experiences it keeps, a list of Experience (rft/data/experience.py)"
    assert str(e.value) == f"data_processor.experience_pipeline.operators[0] ({name}) " + message.format(fix=fix)


def test_an_experience_operator_that_raises_names_itself_and_its_line():
    from rft.data.pipeline import ExperiencePipeline

    pipeline = ExperiencePipeline([{"name": "test_user_plugins.op_raises"}])
    with pytest.raises(RunError) as e:
        pipeline([Experience([1, 2, 3], 2, [-1.0], reward=1.0)] * 2)
    line = op_raises.__code__.co_firstlineno + 2
    assert str(e.value) == (
        f"data_processor.experience_pipeline.operators[0] (test_user_plugins.op_raises) raised ValueError: no such part "
        f"({__file__}, line {line}), called on a step's 2 experiences; its traceback is in the run's log. Fix the "
        f"operator, then run the same command again: it resumes from the newest checkpoint.")


def test_a_study_cannot_replace_a_shipped_registry_entry():
    """A study module that set ADVANTAGE_FNS["grpo"] changed every config naming grpo, and only in
    the processes that imported it (not Ray's actors): refused; a name of its own is added."""
    from rft.algorithms import ADVANTAGE_FNS

    with pytest.raises(ConfigError) as e:
        ADVANTAGE_FNS["grpo"] = f"{P}.sign_advantage"
    assert str(e.value).startswith(
        "algorithm.advantage_fn: 'grpo' is rft's own entry (rft.algorithms.advantages.grpo_advantage); a study's entry "
        "takes a name not taken (taken: dr_grpo, gae, grpo, ")
    assert ADVANTAGE_FNS.path("grpo") == "rft.algorithms.advantages.grpo_advantage"
    ADVANTAGE_FNS["grpo"] = "rft.algorithms.advantages.grpo_advantage"  # the same entry again: a re-import
    ADVANTAGE_FNS["sign"] = f"{P}.sign_advantage"
    try:
        from experiments.plugin_study.plugins import sign_advantage

        assert ADVANTAGE_FNS["sign"] is sign_advantage
        ADVANTAGE_FNS["sign"] = f"{P}.reinforce_loss"  # a study's own entry may be replaced
    finally:
        del ADVANTAGE_FNS["sign"]


# ---------------------------------------------------------------- a run of the study


def _stored(run):
    from rft.data.buffer import read_experiences

    return [{"group_id": e.group_id, "reward": e.reward, "reward_parts": e.reward_parts, "prompt_length": e.prompt_length,
             "tokens": e.tokens, "sampling": e.sampling} for e in read_experiences(str(run / "buffer.db"), 100)]


@pytest.mark.slow  # one 2-step run of the tiny model (~5 s)
def test_the_study_plugins_values_reach_the_metrics_the_buffer_and_the_loss_exactly(tmp_path):
    import rft.runtime.main
    from transformers import AutoModelForCausalLM

    from rft.models import load_tokenizer

    cfg = compose_cfg([*TINY, *STUDY, "buffer=sql", "buffer.total_steps=2", "trainer.save_interval=1",
                       f"checkpoint_root_dir={tmp_path}", "name=study"])
    rft.runtime.main.main(cfg)
    run = tmp_path / "rft" / "study"
    m2 = json.loads((run / "metrics.jsonl").read_text().splitlines()[1])
    batch = json.loads((run / "batches.jsonl").read_text().splitlines()[1])
    rows = [r for r in _stored(run) if r["group_id"] in batch["groups"]]
    assert m2["step"] == batch["step"] == 2 and len(rows) == 8
    tok = load_tokenizer(cfg.model)
    for r in rows:
        # the reward: 0.25 x the response's characters, at most 1; the operator's 0.5 on top, a part of its own
        text = tok.decode(r["tokens"][r["prompt_length"]:], skip_special_tokens=True)
        assert r["reward_parts"] == {"length_reward": min(1.0, 0.25 * len(text)), "bonus": 0.5}
        assert r["reward"] == r["reward_parts"]["length_reward"] + 0.5
    # reward/mean is the reward function's (before the operator), over the step's 8 rollouts
    assert m2["reward/length_reward/mean"] == m2["reward/mean"] == sum(r["reward_parts"]["length_reward"] for r in rows) / 8
    assert m2["experience_pipeline/in"] == m2["experience_pipeline/kept"] == 8
    # the loss by hand: step 2 trains the step-1 checkpoint's weights; A = 0.5 x sign(r - group mean)
    # on every response token; REINFORCE's -A log p, token-mean over the batch (grpo's loss_agg_mode)
    model = AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "step_1" / "hf", dtype=torch.float32).eval()
    means = {g: sum(r["reward"] for r in rows if r["group_id"] == g) / 2 for g in batch["groups"]}
    total, tokens, abs_adv = 0.0, 0, 0.0
    with torch.no_grad():
        for r in rows:
            a = 0.5 * ((r["reward"] > means[r["group_id"]]) - (r["reward"] < means[r["group_id"]]))
            lp = torch.log_softmax(model(torch.tensor([r["tokens"]])).logits[0].double() / r["sampling"]["temperature"], -1)
            for t in range(r["prompt_length"], len(r["tokens"])):
                total += -a * lp[t - 1, r["tokens"][t]].item()
                tokens, abs_adv = tokens + 1, abs_adv + abs(a)
    assert abs_adv > 0, "a group whose rewards differ, or the check is of 0 = 0"
    assert m2["advantage/abs_mean"] == pytest.approx(abs_adv / tokens, abs=1e-7)
    assert m2["loss/policy"] == pytest.approx(total / tokens, abs=1e-5)


@pytest.mark.slow  # three short runs of run.py (~25 s)
def test_the_study_resumes_after_a_kill_to_the_uninterrupted_result_and_sweeps_against_a_builtin(tmp_path):
    import os

    env = {**os.environ, "RFT_CHECKPOINT_ROOT_DIR": str(tmp_path)}
    args = [*TINY, *STUDY, "buffer.total_steps=3", "trainer.save_interval=1", "objective=reward/mean"]
    # each command a run.py process forked from one that imported torch (resume_support: the same
    # command, argv and working directory without a fresh interpreter's imports, ~4 s a run)
    assert run_to_end([*args, "name=whole"], env, tmp_path / "whole_run").returncode == 0
    killed = tmp_path / "rft" / "killed"
    kill_when([*args, "name=killed"], env, lambda: (killed / "checkpoints" / "step_1" / "state.json").exists(),
              tmp_path / "killed_run")
    r = run_to_end([*args, "name=killed"], env, tmp_path / "resumed_run")
    assert r.returncode == 0, r.stderr[-2000:]
    whole, killed = tmp_path / "rft" / "whole", tmp_path / "rft" / "killed"
    assert (killed / "batches.jsonl").read_text() == (whole / "batches.jsonl").read_text()
    keys = ("reward/mean", "loss/policy", "advantage/mean", "actor/grad_norm")
    for a, b in zip(*[[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (whole, killed)]):
        assert [a[k] for k in keys] == [b[k] for k in keys]
    final = "checkpoints/step_3/hf/model.safetensors"
    assert (killed / final).read_bytes() == (whole / final).read_bytes()

    # a sweep: the study's advantage against grpo's, then the sweep report naming both
    sweep = [a for a in args if not a.startswith(("algorithm.advantage_fn", "+algorithm.advantage_args"))]
    r = forked_to_end(["-m", f"algorithm.advantage_fn=grpo,{P}.sign_advantage", *sweep, "buffer.total_steps=2",
                       "name=sweep"], env, tmp_path / "sweep_run")
    assert r.returncode == 0, r.stderr[-2000:]
    (multirun,) = (tmp_path / "rft" / "multirun").iterdir()
    r = subprocess.run([sys.executable, "-m", "rft.reporting.report", str(multirun)], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    rows = [line.split(" | ")[:5] for line in (multirun / "report.md").read_text().splitlines() if line.startswith("| ")]
    assert rows[0] == ["| job", "algorithm.advantage_fn", "stage", "status", "steps"]
    assert rows[1:3] == [["| 0", "grpo", "", "done", "2"], ["| 1", f"{P}.sign_advantage", "", "done", "2"]]
