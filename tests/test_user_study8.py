"""A new user's study from the README alone (experiments/guess_number/): a multi-turn game of the
study's own (guess a digit, told "higher" or "lower"), a GRPO variant whose advantages are clipped
to [-clip, clip], both given as dotted paths, after a short SFT warm-up. Each test is a defect that
study met, or a promise it checked."""

import dataclasses
import json

import pytest
import torch
from conftest import ROOT, compose_cfg, load_script

import rft.runtime.main
from rft.algorithms import ADVANTAGE_FNS, check_args
from rft.algorithms.contract import check_advantages
from rft.data.experience import Experience
from rft.data.tasks import Task
from rft.errors import ConfigError
from rft.plan.overlays import check, search_dirs
from rft.rewards.scoring import Reward, part_metrics
from rft.rollout.environments.tools import Environment
from rft.rollout.workflows import multi_turn as mt

STUDY = ["hydra.searchpath=[file://experiments/guess_number/conf]", "experiment=guess_number"]


def _study():
    return load_script("experiments/guess_number/study.py", "guess_number_study")


def test_the_prepared_data_is_what_the_study_reads():
    rows = [json.loads(x) for x in (ROOT / "experiments/guess_number/data/train.jsonl").read_text().splitlines()]
    test = [json.loads(x) for x in (ROOT / "experiments/guess_number/data/test.jsonl").read_text().splitlines()]
    assert len(rows) == 200 and rows[0] == {"ask": "guess:1-9", "secret": "7", "teacher_answer": "7"}
    # each secret twice in the held-out set
    assert sorted(r["secret"] for r in test) == [str(d) for d in range(1, 10) for _ in range(2)]


def test_the_studys_environment_and_advantage_give_hand_computed_values():
    study = _study()
    env = study.GuessEnv(penalty=0.1)
    assert env.reset(Task("g/0", [{"role": "user", "content": "guess:1-9"}], "7", {})) == [
        {"role": "user", "content": "guess:1-9"}]
    assert env.step("x") == ("a digit 1-9", {}, False)  # no digit: no guess counted
    assert env.step("5") == ("higher", {}, False)  # the first guess is free
    assert env.step("9") == ("lower", {"guesses": -0.1}, False)
    assert env.step("7") == (None, {"solved": 1.0, "guesses": -0.1}, True)
    assert env.info == {"guesses": 3}
    # one group of 4, rewards [1, 0, 0, 0]: mean 0.25, unbiased std sqrt((0.75^2 + 3 x 0.25^2) / 3) = 0.5,
    # GRPO's A = [1.5, -0.5, -0.5, -0.5] (up to its eps of 1e-6), clipped to [-1, 1]: [1, -0.5, -0.5, -0.5]
    batch = {"rewards": torch.tensor([1.0, 0.0, 0.0, 0.0]), "group_index": torch.tensor([0, 0, 0, 0]),
             "response_mask": torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])}
    adv = study.clipped_grpo(batch, None, clip=1.0)
    assert torch.allclose(adv, torch.tensor([[1.0, 1.0], [-0.5, 0.0], [-0.5, -0.5], [-0.5, -0.5]]), atol=1e-5)


def test_a_part_an_environment_gives_only_to_winners_is_averaged_over_every_conversation():
    """`solved` is returned only when the game is won: reward/solved/mean read 1.0 (the mean over
    the winners) beside a reward/mean of 0.027 in the study's first run. A conversation's reward is
    the sum of the parts it got, so a part it never got counts 0: the part means add up to
    reward/mean. A single turn's missing part (the overlong penalty) stays absent."""
    def conv(parts):
        return Experience([1, 2, 3], 1, [0.0, 0.0], reward=Reward(sum(parts.values()), parts), info={"turns": 2})

    exps = [conv({"solved": 1.0}), conv({"solved": 1.0, "guesses": -0.1}), conv({"guesses": -0.3}), conv({})]
    # solved (1 + 1 + 0 + 0) / 4 = 0.5; guesses (0 - 0.1 - 0.3 + 0) / 4 = -0.1; their sum 0.4 = the mean reward
    assert part_metrics(exps) == pytest.approx({"reward/guesses/mean": -0.1, "reward/solved/mean": 0.5})
    single = [Experience([1, 2], 1, [0.0], reward=Reward(1.0, {"exact_match": 1.0, "overlong": -0.25})),
              Experience([1, 2], 1, [0.0], reward=Reward(0.0, {"exact_match": 0.0}))]
    assert part_metrics(single) == {"reward/exact_match/mean": 0.5, "reward/overlong/mean": -0.25}


def test_an_overlay_stage_named_like_the_models_that_lost_its_keys_is_refused(tmp_path):
    """`stages: [{stage_name: sft_warmup, buffer: {total_steps: 60}}, ...]` in the study's overlay (to
    shorten model=tiny's warm-up) replaced the model's whole list: the "sft_warmup" stage ran 60 GRPO
    steps on the game, and the dry run's only sign was "stage sft_warmup (grpo)"."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "short.yaml").write_text(
        "# @package _global_\n# python run.py experiment=short\ndefaults:\n  - override /model: tiny\n  - _self_\n\n"
        "stages:\n  - stage_name: sft_warmup\n    buffer:\n      total_steps: 60\n"
        "  - stage_name: ${algorithm.algorithm_type}\n")
    args = [f"hydra.searchpath=[file://{tmp_path}]", "experiment=short"]
    assert check(args, search_dirs(args, ROOT / "conf")) == (
        f"{tmp_path}/experiment/short.yaml, line 8: its stages entry 'sft_warmup' lacks algorithm, explorer, mode, "
        "trainer, which conf/model/tiny.yaml's entry of that name has. A `stages:` list in an overlay replaces the "
        "model's whole list (Hydra replaces lists; it does not merge them), so this stage would run without them. "
        "Copy that entry whole and change what differs (conf/experiment/calculator_tool.yaml does), change one key "
        "on the command line instead (stages.0.buffer.total_steps=60), or give a new stage a name of its own.")
    # the study's own overlay copies the entry whole; a model without stages, or stages=[], has nothing replaced
    assert check(STUDY, search_dirs(STUDY, ROOT / "conf")) is None
    assert check([*args, "model=tiny_tools"], search_dirs(args, ROOT / "conf")) is None
    assert check([*args, "stages=[]"], search_dirs(args, ROOT / "conf")) is None


def test_the_dry_run_shows_the_advantage_functions_own_settings(capsys):
    """The dry run named `advantage_fn=...clipped_grpo` alone: whether `clip` from the stage's entry
    (or a sweep) reached it showed nowhere before the run."""
    rft.runtime.main._main(compose_cfg([*STUDY, "dry_run=true", "stages.1.algorithm.advantage_args.clip=0.5"]))
    out = capsys.readouterr().out
    assert ("algorithm      grpo: advantage_fn=experiments.guess_number.study.clipped_grpo(clip=0.5), "
            "policy_loss_fn=ppo_clip, loss_agg_mode=token-mean") in out
    assert "algorithm      sft: advantage_fn=none, policy_loss_fn=sft, loss_agg_mode=token-mean" in out


def no_cfg(batch):
    return batch["response_mask"]


def test_an_advantage_function_missing_cfg_is_told_its_signature_even_with_settings():
    """`def clipped_grpo(batch, clip=1.0)` given `clip` was told "has ['clip'], which ... does not take;
    its own arguments are []": the cfg it lacks shifted `clip` into the fixed parameters."""
    with pytest.raises(ConfigError) as e:
        check_args(ADVANTAGE_FNS, "test_user_study8.no_cfg", {"clip": 1.0}, "algorithm.advantage_args")
    assert str(e.value) == (
        "algorithm.advantage_fn=test_user_study8.no_cfg cannot be called as fn(batch, cfg, "
        "**algorithm.advantage_args): too many positional arguments. Give it the signature of the registry's "
        "functions (rft/algorithms/__init__.py).")


def test_advantages_returned_as_a_comparison_are_refused():
    """`return adv > 0` trained on advantages of 1 and 0 and the run ended well."""
    mask = torch.ones(2, 3)
    with pytest.raises(ConfigError) as e:
        check_advantages(torch.ones(2, 3) > 0, mask, "my.adv")
    assert str(e.value).startswith("algorithm.advantage_fn=my.adv returned a bool tensor (a comparison?) where a "
                                   "tensor of one advantage per response token, of batch['response_mask']'s shape "
                                   "[2, 3] (N rows x T positions) goes")
    check_advantages(torch.ones(2, 3, dtype=torch.long), mask, "my.adv")  # -1/0/1 as integers are values


class Guess(Environment):
    def step(self, text):
        return "higher", {}, "False"


def test_a_done_that_is_not_a_bool_is_named():
    """done="False" read as True: every conversation ended at its first turn, reward 0, no error."""
    with pytest.raises(ConfigError) as e:
        mt._step_result(Guess().step("5"), Guess, 1)
    assert str(e.value) == (
        "test_user_study8.Guess.step(text) (turn 1) returned done='False', a str: give True (the conversation ends) "
        "or False (the model speaks again); it must return (message | None, {part name: number}, done), e.g. "
        "(None, {'correct': 1.0}, True) (rft/rollout/environments/tools.py).")
    import numpy as np

    for done in (True, 0, np.bool_(True)):
        assert mt._step_result((None, {}, done), Guess, 1)[2] is bool(done)


class StrStop(Environment):
    stop = "</g>"

    def step(self, text):
        return None, {}, True


def test_a_stop_given_as_one_string_is_refused_when_planning():
    """`stop = "</g>"` is a sequence of characters: every assistant turn ended at its first '<', '/',
    'g' or '>', silently (responses of 1 to 6 tokens, the reward still logged)."""
    with pytest.raises(ConfigError) as e:
        mt.check_args({"env": "test_user_study8.StrStop"})
    assert str(e.value) == ("test_user_study8.StrStop.stop='</g>': give a list of strings, each of which ends an "
                            "assistant turn (e.g. ['</g>']); a str is read as its characters, each one a stop.")
    with pytest.raises(ConfigError, match=r"^workflow_args.stop='\\n': give a list of strings"):
        mt.check_args({"env": "calculator", "stop": "\n"})


class NoInfo:
    """An environment as README says one may be: any class with reset and step (no Environment base)."""

    def reset(self, task):
        return task.messages

    def step(self, text):
        return None, {"solved": 1.0}, True


class Echo:
    def __init__(self):
        self.ids = [5, 6]

    def generate(self, prompts, n, args, seed):
        from rft.rollout.engines.hf import Sample

        return [[Sample(list(self.ids), [-0.5, -0.5], "stop") for _ in range(n)] for _ in prompts]


class ListInfo(NoInfo):
    info = ["guesses"]


def test_an_environment_without_info_is_scored(cache_dir):
    """A class without `info` (its counters) stopped the run: "workflow 'multi_turn' raised
    AttributeError: 'NoInfo' object has no attribute 'info' ... Fix the workflow"."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from rft.models import build_tiny_model, load_tokenizer
    from rft.rollout.workflows.single_turn import WorkflowContext

    path = build_tiny_model(cache_dir / "models" / "tiny-qwen2-v2")
    tok = load_tokenizer(OmegaConf.create(dict(model_path=str(path), trust_remote_code=False, custom_chat_template=None)))
    ctx = WorkflowContext(tokenizer=tok, n=2, rollout_args=SimpleNamespace(temperature=1.0, top_p=1.0, top_k=-1,
                          max_tokens=None, stop=[]), max_prompt_tokens=24, policy_version=0, seed=5, step=1,
                          score=None, args={"env": "test_user_study8.NoInfo"}, max_response_tokens=6, call=None)
    [group] = mt.multi_turn([Task("g/0", [{"role": "user", "content": "guess:1-9"}], "7", {})], Echo(), ctx)
    assert [(e.reward, e.reward_parts, e.info["turns"]) for e in group] == [(1.0, {"solved": 1.0}, 1)] * 2
    with pytest.raises(ConfigError, match=r"^test_user_study8.ListInfo.info is a list: make it a dict of counters"):
        mt.multi_turn([Task("g/0", [{"role": "user", "content": "guess:1-9"}], "7", {})], Echo(),
                      dataclasses.replace(ctx, args={"env": "test_user_study8.ListInfo"}))


@pytest.mark.slow
def test_the_study_runs_its_clip_and_its_part_means_add_up_to_the_reward(tmp_path):
    """Two GRPO steps of the game from the tiny model's random weights (no warm-up), clip 0.25: the
    study's advantage function is what trained (every advantage within [-0.25, 0.25]: GRPO's own had
    an absolute mean of 0.65 in the study's run), and each step's part means add up to its mean reward."""
    cfg = compose_cfg([*STUDY, "stages=[]", "cluster=inline", "monitor=console", "buffer.total_steps=2",
                       "buffer.batch_size=4", "algorithm.repeat_times=4", "explorer.eval_interval=100",
                       "algorithm.advantage_fn=experiments.guess_number.study.clipped_grpo",
                       "+algorithm.advantage_args.clip=0.25", f"checkpoint_root_dir={tmp_path}"])
    rft.runtime.main.main(cfg)
    rows = [json.loads(x) for x in (tmp_path / "rft" / "guess_number" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert 0 < r["advantage/abs_mean"] <= 0.25
        parts = sum(v for k, v in r.items() if k.startswith("reward/") and k.endswith("/mean") and k != "reward/mean")
        assert parts == pytest.approx(r["reward/mean"], abs=1e-9)
    assert any("reward/solved/mean" in r for r in steps)


def test_a_shipped_entry_added_again_with_its_own_path_keeps_its_needs():
    """README: a study's module "may also add a table line at import time". Adding rft's own line
    again (a module imported twice, or copied from rft) reset the entry's Needs to the default: grpo
    no longer needed grouped rollouts, so `algorithm.repeat_times=1` passed planning, in every later
    config of the process (tests/test_seams.py's needs test failed after tests/test_user_plugins.py)."""
    from rft.algorithms import ADVANTAGE_FNS, Needs, algorithm_needs

    ADVANTAGE_FNS["grpo"] = "rft.algorithms.advantages.grpo_advantage"
    assert ADVANTAGE_FNS.info("grpo") == Needs(grouped=True)
    assert algorithm_needs(compose_cfg([]).algorithm).grouped


def test_an_unknown_environment_name_is_told_to_give_a_class_and_a_near_name_is_offered():
    """`env: guess` was told to give "the dotted path of a function with the same signature" (an
    environment is a class), and `workflow: multiturn` found no "Did you mean multi_turn?"."""
    from rft.registry import resolve
    from rft.rollout.environments.tools import ENVIRONMENTS
    from rft.rollout.workflows.single_turn import WORKFLOWS

    with pytest.raises(ConfigError) as e:
        mt.check_args({"env": "guess"})
    assert str(e.value) == (
        "workflow_args.env='guess' is not one of ['calculator', 'python']; give a registered name or the dotted path "
        "of an environment class with reset(task) and step(text) (module.Class; rft/rollout/environments/tools.py).")
    with pytest.raises(ConfigError) as e:
        resolve(WORKFLOWS, "multiturn", "buffer.explorer_input.taskset.workflow")
    assert str(e.value).endswith("(module.function). Did you mean multi_turn?")
    with pytest.raises(ConfigError) as e:
        resolve(ENVIRONMENTS, "calculater", "workflow_args.env")
    assert str(e.value).endswith("Did you mean calculator?")


def test_a_per_row_metric_of_a_loss_is_named_by_its_shape():
    """A length-normalised REINFORCE loss returning {"tokens": mask.sum(-1)} (a value per row, where a
    sum over tokens goes) was told so with the tensor's repr: 64 values over 5 lines in the paragraph."""
    from rft.algorithms.contract import check_loss

    logp = torch.zeros(64, 18, requires_grad=True)
    with pytest.raises(ConfigError) as e:
        check_loss((logp * 2, {"tokens": torch.full((64,), 18.0)}), logp, "my.len_reinforce")
    assert str(e.value) == (
        "algorithm.policy_loss_fn=my.len_reinforce returned metrics of the wrong kind ('tokens': a torch.float32 "
        "tensor of shape [64]): a dict of name -> number (a sum over the micro-batch's tokens, added up over "
        "micro-batches), or name -> (sum, count) for a mean over something else; {} for none.")


def test_a_study_overlay_chosen_without_its_search_path_is_pointed_at_it():
    """`python run.py experiment=guess_number` (the study's search path left out) was told only that
    conf/experiment/ lacks it and which overlays conf/ has."""
    args = ["experiment=guess_number"]
    message = check(args, search_dirs(args, ROOT / "conf"))
    assert message.startswith("experiment=guess_number: there is no conf/experiment/guess_number.yaml (the options ")
    assert message.endswith(
        "). experiments/guess_number/conf/experiment/guess_number.yaml has it: a study's folder comes in through "
        f"Hydra's search path, 'hydra.searchpath=[file://experiments/guess_number/conf]' (run from {ROOT}).")
    args = ["experiment=no_such_study"]  # no study has it: the message as before
    message = check(args, search_dirs(args, ROOT / "conf"))
    assert message.endswith(").") and "search path" not in message
