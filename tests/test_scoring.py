"""Rewards of several parts (rft/rewards/scoring.py): the weighted sum, the parts logged and stored, the
config errors, running normalisation, and a run whose stored experiences carry the parts."""

import json
import pickle
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import compose_cfg

import rft.runtime.main
from rft.data.buffer import read_experiences
from rft.data.experience import Experience, add_part
from rft.errors import ConfigError
from rft.reporting.monitor import read_metrics
from rft.rewards.scoring import Reward, RunningNorm, build, check, part_metrics

TASK = SimpleNamespace(task_id="t/0", answer="357", row={})


def short(prompt, response, task, limit=3):
    """A test part: 1 when the response has at most `limit` characters."""
    return float(len(response) <= limit)


def split(prompt, response, task):
    """A test part that returns a dict: its value is the sum of its entries."""
    return {"digits": sum(c.isdigit() for c in response) / 10, "spaces": float(" " in response)}


def test_a_list_of_parts_is_their_weighted_sum_and_keeps_each_part():
    scorer = build([{"fn": "exact_match", "weight": 1.0},
                    {"fn": "test_scoring.short", "weight": 0.5, "args": {"limit": 3}}], "reward_fn")
    got = scorer("042+315", ["357", "3570", "12"], TASK)
    # "357": exact 1, short 1 -> 1 + 0.5 = 1.5; "3570": 0 + 0 = 0; "12": 0 + 0.5 * 1 = 0.5
    assert [float(r) for r in got] == [1.5, 0.0, 0.5]
    assert got[0].parts == {"exact_match": 1.0, "short": 1.0}
    assert got[1].parts == {"exact_match": 0.0, "short": 0.0}


def test_a_dict_reward_is_the_sum_of_its_entries_each_stored_under_name_slash_key():
    scorer = build([{"fn": "test_scoring.split", "weight": 2.0, "name": "shape"}], "reward_fn")
    (r,) = scorer("p", ["12 3"], TASK)
    # digits 3/10 = 0.3, spaces 1 -> 2 * (0.3 + 1) = 2.6
    assert float(r) == pytest.approx(2.6)
    assert r.parts == {"shape/digits": pytest.approx(0.3), "shape/spaces": 1.0}


@pytest.mark.parametrize("response, pattern, expected", [
    ("<answer>2+3*7</answer>", None, 1.0),  # the default: the answer inside <answer> tags
    ("  <answer>\n7\n</answer> ", None, 1.0),  # stripped; `.` crosses lines
    ("2+3*7", None, 0.0),  # no tags
    ("<answer>7</answer> and more", None, 0.0),  # the whole response must match
    ("2+3*7", r"[0-9+\-*/() ]+", 1.0),  # an expression and nothing else
    ("2+3*7=23", r"[0-9+\-*/() ]+", 0.0),
])
def test_the_format_reward(response, pattern, expected):
    from rft.rewards.verifiers import REWARD_FNS

    args = {} if pattern is None else {"pattern": pattern}
    assert REWARD_FNS["format"]("p", response, TASK, **args) == expected


def test_a_format_part_beside_a_verifier():
    scorer = build([{"fn": "countdown"}, {"fn": "format", "weight": 0.1, "args": {"pattern": r"[0-9+\-*]+"}}],
                   "reward_fn")
    task = SimpleNamespace(task_id="c/0", answer="2+3*7", row={"numbers": [2, 3, 7], "target": 23})
    got = scorer("2,3,7->23", ["2+3*7", "2+3*8", "23!"], task)
    # right: 1 + 0.1; wrong number but well-formed: 0 + 0.1; malformed: 0 + 0
    assert [float(r) for r in got] == pytest.approx([1.1, 0.1, 0.0])


def test_a_single_name_is_one_part_of_weight_one():
    (r,) = build("exact_match", "reward_fn")("p", ["357"], TASK)
    assert float(r) == 1.0 and r.parts == {"exact_match": 1.0}


def test_the_reward_carries_its_parts_into_the_experience_and_through_pickle_and_json():
    r = Reward(1.5, {"exact_match": 1.0, "short": 1.0})
    r2 = pickle.loads(pickle.dumps(r))  # how it reaches a Ray actor
    assert float(r2) == 1.5 and r2.parts == r.parts
    e = Experience([1, 2, 3], 1, [-0.1, -0.2], reward=r2)
    assert type(e.reward) is float and e.reward_parts == {"exact_match": 1.0, "short": 1.0}
    back = Experience.from_dict(json.loads(json.dumps(e.to_dict())))
    assert back.reward_parts == e.reward_parts and back.reward == 1.5
    # an experience written before parts existed reads with none
    old = e.to_dict()
    del old["reward_parts"]
    assert Experience.from_dict(old).reward_parts == {}


def test_shaping_adds_a_part_and_the_parts_are_logged():
    a = Experience([1, 2], 1, [0.0], reward=Reward(1.0, {"exact_match": 1.0}))
    b = Experience([1, 2], 1, [0.0], reward=Reward(0.0, {"exact_match": 0.0}))
    add_part(a, "overlong", -0.25)
    assert a.reward == 0.75 and a.reward_parts == {"exact_match": 1.0, "overlong": -0.25}
    # means over the experiences that have the part: exact (1 + 0) / 2; overlong only a's
    assert part_metrics([a, b]) == {"reward/exact_match/mean": 0.5, "reward/overlong/mean": -0.25}


def response_only(response):
    return 1.0


def needs_limit(prompt, response, task, limit):
    return float(len(response) <= limit)


@pytest.mark.parametrize(
    "spec, message",
    [
        ([{"fn": "exact_match", "wieght": 1}],
         "reward_fn[0] has ['wieght'], which a reward part does not take; its keys are "
         "['fn', 'weight', 'args', 'name', 'normalize']."),
        ([{"fn": "exact_match"}, {"fn": "exact_match"}],
         "reward_fn[1]: two parts are named 'exact_match'; give one a `name` of its own"),
        ([{"fn": "exact_match", "weight": "high"}], "reward_fn[0].weight='high' is not a number."),
        ([{"fn": "test_scoring.short", "args": {"limt": 3}}],
         "reward_fn[0].args has ['limt'], which test_scoring.short does not take; its arguments are ['limit']. Did you mean limit (not limt)?"),
        ([{"fn": "exact_match", "name": "a/b"}], "reward_fn[0].name='a/b': a part's name cannot contain '/'"),
        ([{"weight": 1.0}], "reward_fn[0]={'weight': 1.0}: each part is a name or a dict with at least `fn`"),
        ([], "reward_fn=[]: give a reward name (e.g. exact_match), a dotted path (module.function), or a list of parts"),
        ([{"fn": "exact"}], "reward_fn[0].fn='exact' is not one of"),
        # a function that cannot take (prompt, response, task): found before the run, not in every task
        ("test_scoring.response_only",
         "reward_fn='test_scoring.response_only' cannot be called as fn(prompt, response, task, **args) (too many "
         "positional arguments); its signature is test_scoring.response_only(response). A reward function takes"),
        # called with the task as `answer`: `response == answer` was never true, a run of rewards 0 (exit 0)
        ("test_scoring.answer_third",
         "reward_fn='test_scoring.answer_third': its third parameter is named 'answer', but a reward function is "
         "called as fn(prompt, response, task, **args): it would receive the task. Name it task and read the "
         "reference answer as task.answer (task.row has the whole row)."),
        ([{"fn": "test_scoring.needs_limit"}],
         "reward_fn[0].fn='test_scoring.needs_limit' cannot be called as fn(prompt, response, task, **args) "
         "(missing a required argument: 'limit'); its signature is test_scoring.needs_limit(prompt, response, task, limit)"),
    ],
)
def test_reward_config_errors_name_the_key_and_the_fix(spec, message):
    with pytest.raises(ConfigError) as e:
        check(spec, "reward_fn")
    assert message in str(e.value)


def test_a_reward_that_returns_no_number_is_an_error_of_that_task():
    scorer = build("test_scoring.bad", "reward_fn")
    with pytest.raises(ValueError, match="reward 'bad' returned str 'yes', not a number"):
        scorer("p", ["x"], TASK)


def answer_third(prompt, response, answer):
    return float(response == answer)


def bad(prompt, response, task):
    return "yes"


def test_a_reward_that_returns_text_or_no_parts_is_an_error_not_a_number_read_from_it():
    # float("1") read a regex's match as the reward (the model's own answer, 357 here: exit 0), and
    # {} a reward of 0 with no parts
    scorer = build("test_scoring.matched_text", "reward_fn")
    with pytest.raises(ValueError) as e:
        scorer("p", ["357"], TASK)
    assert str(e.value) == ("reward 'matched_text' returned str '357', not a number (text is never read as one: "
                            "return a float, e.g. float(answer == task.answer))")
    scorer = build("test_scoring.no_parts", "reward_fn")
    with pytest.raises(ValueError) as e:
        scorer("p", ["357"], TASK)
    assert str(e.value) == "reward 'no_parts' returned an empty dict: give it at least one part, e.g. {'correct': 0.0}"
    # numbers of other types are numbers: numpy's, a one-element tensor's, a bool
    for value, expected in [(np.float32(0.5), 0.5), (torch.tensor(0.25), 0.25), (True, 1.0)]:
        scorer = build([{"fn": "test_scoring.given", "args": {"value": value}}], "reward_fn")
        assert scorer("p", ["x"], TASK) == [expected]


def matched_text(prompt, response, task):
    return re.search(r"\d+", response).group()


def no_parts(prompt, response, task):
    return {}


def given(prompt, response, task, value):
    return value


def test_a_reward_that_is_not_finite_is_an_error_of_that_task():
    # one inf would make its step's mean, std and every advantage of the group inf or NaN
    for value in ["inf", "-inf", "nan"]:
        scorer = build([{"fn": "test_scoring.not_finite", "args": {"value": value}}], "reward_fn")
        with pytest.raises(ValueError, match=f"reward 'not_finite' returned {value}, not a finite number"):
            scorer("p", ["x"], TASK)
    scorer = build("test_scoring.inf_part", "reward_fn")
    with pytest.raises(ValueError, match="reward 'inf_part/b' returned inf, not a finite number"):
        scorer("p", ["x"], TASK)


def not_finite(prompt, response, task, value):
    return float(value)


def inf_part(prompt, response, task):
    return {"a": 1.0, "b": float("inf")}


def test_running_normalisation_hand_computed_and_resumable():
    norm = RunningNorm({"exact_match": 1.0, "short": 0.5}, ["short"])
    exps = [Experience([1, 2], 1, [0.0], reward=Reward(1.0 + 0.5 * s, {"exact_match": 1.0, "short": s}))
            for s in (0.0, 2.0)]
    m = norm.apply(exps)
    # short's values 0, 2: mean 1, std (population) 1 -> normalised -1, +1
    assert m == {"reward/short/running_mean": 1.0, "reward/short/running_std": 1.0}
    assert [e.reward for e in exps] == [1.0 - 0.5, 1.0 + 0.5]  # exact 1 + 0.5 * (-1 | +1)
    assert exps[0].reward_parts["short"] == 0.0  # the raw value stays
    # a second step joins the statistics: values 0, 2, 4 -> mean 2, var (4 + 0 + 4) / 3
    saved = norm.state()
    more = [Experience([1, 2], 1, [0.0], reward=Reward(2.0, {"exact_match": 0.0, "short": 4.0}))]
    norm.apply(more)
    std = (8 / 3) ** 0.5
    assert more[0].reward == pytest.approx(0.5 * (4.0 - 2.0) / std)
    # a resumed run loads the saved statistics and normalises the same
    again = RunningNorm({"exact_match": 1.0, "short": 0.5}, ["short"])
    again.load(json.loads(json.dumps(saved)))
    same = [Experience([1, 2], 1, [0.0], reward=Reward(2.0, {"exact_match": 0.0, "short": 4.0}))]
    again.apply(same)
    assert same[0].reward == more[0].reward


@pytest.mark.slow
def test_a_two_part_reward_run_logs_each_part_and_stores_them(warm_start, tmp_path):
    """Three GRPO steps from the warm start with exact_match (normalised by running statistics) +
    0.5 * short (a response of at most 3 characters): each part and the weighted sum are logged, and
    the stored experiences carry the raw parts (the sql buffer here; test_buffers checks every
    storage keeps them) and the reward computed from the step's running statistics."""
    reward = ("[{fn: exact_match, weight: 1.0, normalize: true}, "
              "{fn: test_scoring.short, weight: 0.5, args: {limit: 3}}]")
    cfg = compose_cfg(["stages=[]", f"model.model_path={warm_start}", "model.builder=null",
                       "buffer.total_steps=3", "explorer.eval_interval=3", "buffer.batch_size=4",
                       "cluster=inline", "monitor=console", f"checkpoint_root_dir={tmp_path}",
                       "buffer=sql",
                       f"buffer.explorer_input.taskset.reward_fn={reward}"])
    rft.runtime.main.main(cfg)
    stage = tmp_path / "rft" / cfg.name
    steps = [m for m in read_metrics(stage / "metrics.jsonl") if "reward/mean" in m]
    assert len(steps) == 3
    for m in steps:  # reward/mean is before normalisation
        assert m["reward/mean"] == pytest.approx(m["reward/exact_match/mean"] + 0.5 * m["reward/short/mean"])
    by_step = {m["step"]: m for m in steps}
    # the eval logs each part of its reward too (the eval set uses the default, one part: no parts)
    exps = read_experiences(str(stage / "buffer.db"), limit=1000)
    assert len(exps) == 3 * 4 * 8
    assert len({e.reward for e in exps}) > 1  # the parts vary: the test can see a wrong sum
    for e in exps:
        assert set(e.reward_parts) == {"exact_match", "short"}
        assert e.reward_parts["short"] == float(len(e.info["response"]) <= 3)
        # explored at step s (group_id "s/..."), logged with training step s + 1
        m = by_step[int(e.group_id.split("/")[0]) + 1]
        mean, std = m["reward/exact_match/running_mean"], m["reward/exact_match/running_std"]
        assert 0 < std < 1  # the warm start is right on some problems, wrong on others
        assert e.reward == pytest.approx((e.reward_parts["exact_match"] - mean) / std + 0.5 * e.reward_parts["short"])
    # the statistics run over the whole run: step 3's count all 3 * 32 values, so its mean is theirs
    assert by_step[3]["reward/exact_match/running_mean"] == pytest.approx(
        sum(e.reward_parts["exact_match"] for e in exps) / len(exps))


def test_an_argument_of_a_part_without_args_is_one_paragraph_naming_the_plus_fix(tmp_path):
    """`...reward_fn.0.args.x=1` on a part that lists no args was Hydra's "Could not override ... Key
    'args' is not in struct" with a HYDRA_FULL_ERROR hint (status 1); run.py now says it in one paragraph
    (status 2) before Hydra composes, and the `+` form it names composes."""
    from conftest import run_cli

    ts = "buffer.explorer_input.taskset.reward_fn"
    env = {"RFT_CHECKPOINT_ROOT_DIR": str(tmp_path / "ck"), "RFT_CACHE_DIR": str(tmp_path / "cache")}
    r = run_cli(f"{ts}=[{{fn: last_number}}, {{fn: format, weight: 0.1, args: {{pattern: x}}}}]",
                f"{ts}.0.args.x=1", "dry_run=true", env=env)
    assert r.returncode == 2 and "HYDRA_FULL_ERROR" not in r.stderr, r.stderr
    assert r.stderr.strip() == (
        f"rft: configuration error: {ts}.0.args.x=1: part 0 of {ts} ({{'fn': 'last_number'}}) lists no args, so it "
        f"has no args.x to override (Hydra: Key 'args' is not in struct); its keys are ['fn']. Add the argument "
        f"with a plus: +{ts}.0.args.x=1, or give the part `args: {{x: ...}}` where it is written, so that a sweep "
        f"can vary it.")
    # the part that lists args takes the override (no message of ours), and the + form composes
    cfg = compose_cfg([f"{ts}=[{{fn: last_number}}, {{fn: format, args: {{pattern: x}}}}]", f"{ts}.1.args.pattern=y",
                       f"+{ts}.0.args.x=1"])
    assert cfg.buffer.explorer_input.taskset.reward_fn[0].args.x == 1
    assert cfg.buffer.explorer_input.taskset.reward_fn[1].args.pattern == "y"


def test_a_misspelt_workflow_argument_is_named_with_its_close_match():
    # multi_turn read max_turns; max_turn was listed among what it takes, its match left to the eye
    from rft.rollout.workflows.multi_turn import check_args

    with pytest.raises(ConfigError) as e:
        check_args({"env": "calculator", "max_turn": 3}, "buffer.explorer_input.taskset.workflow_args")
    assert str(e.value) == (
        "buffer.explorer_input.taskset.workflow_args has ['max_turn'], which workflow multi_turn does not take; its "
        "arguments are ['env', 'env_args', 'max_total_tokens', 'max_turns', 'stop', 'strict']. Did you mean "
        "max_turns (not max_turn)?")
