"""A researcher's own reward function and workflow, misbehaving: each mistake either fails its task
(left out, counted, warned) or stops the run with one paragraph naming the function, the task and
the fix; never a silently wrong reward, a NaN in the loss, or a run that trains on garbage."""

import math
import threading

import numpy as np
import pytest
import torch
from conftest import compose_cfg

import rft.rollout.explorer as explorer
from rft.data.experience import Experience
from rft.data.tasks import Task
from rft.errors import ConfigError, RunError
from rft.rewards.scoring import Part, Scorer, _per_response
from rft.rollout.explorer import run_jobs
from rft.rollout.workflows.single_turn import check_output, single_turn


def _task():
    return Task("t/7", [{"role": "user", "content": "042+315"}], "357", {"question": "042+315", "answer": "357"})


def _scorer(*fns):
    # a function is scored per response; an object (a served reward) gets the group
    return Scorer([Part(f"p{i}", 1.0, _per_response(fn, {}) if hasattr(fn, "__code__") else fn)
                   for i, fn in enumerate(fns)])


# ---------------------------------------------------------------- 1. what a reward returns


@pytest.mark.parametrize("value, said", [
    (float("nan"), "reward 'p0' returned nan, not a finite number"),
    (float("-inf"), "reward 'p0' returned -inf, not a finite number"),
    (np.float64("inf"), "reward 'p0' returned inf, not a finite number"),
    (None, "reward 'p0' returned NoneType None, not a number"),
    ("1.0", "reward 'p0' returned str '1.0', not a number (text is never read as one: return a float, e.g. "
            "float(answer == task.answer))"),
    ({"correct": float("nan")}, "reward 'p0/correct' returned nan, not a finite number"),
])
def test_a_reward_that_is_no_finite_number_fails_its_task_and_is_counted(value, said):
    results, c = run_jobs(lambda job: _scorer(lambda p, r, t: value)(*job), [("q", ["357", "1"], _task())],
                          runners=1, timeout=5.0, retries=1)
    # the task is left out (None), never scored 0 or NaN. A value that is no number is a bug of the
    # reward's, which a retry returns again: 1 try. An infinite one, 1 try + 1 retry, both raise
    assert results == [None]
    retried = isinstance(value, float) or isinstance(value, dict)
    assert (c["errors"], c["retries"], c["failed"]) == ((2, 1, 1) if retried else (1, 0, 1))
    assert c["last_error"] == f"ValueError: {said}"


@pytest.mark.parametrize("value, expected", [
    (True, 1.0), (np.float64(0.25), 0.25), (torch.tensor(0.5), 0.5), (np.int64(2), 2.0),
])
def test_a_bool_or_numpy_or_torch_scalar_reward_is_its_value(value, expected):
    [r] = _scorer(lambda p, r, t: value)("q", ["357"], _task())
    assert type(r.parts["p0"]) is float and r.parts["p0"] == expected and float(r) == expected


class Served:
    """A served reward (a class called with the group) that returns `value`."""

    def __init__(self, value):
        self.value = value

    def __call__(self, prompt, responses, task):
        return self.value


@pytest.mark.parametrize("value, said", [
    ([1.0], "returned 1 values for 2 responses"),
    (1.0, "returned float 1.0 for a group of 2 responses: a served reward returns a list of one reward per "
          "response"),
    ({"rewards": [1.0, 0.0]}, "returned dict {'rewards': [1.0, 0.0]} for a group of 2 responses: a served reward "
                             "returns a list of one reward per response"),
])
def test_a_batch_reward_of_the_wrong_kind_or_length_fails_its_task(value, said):
    # before, a float for the group was "TypeError: object of type 'float' has no len()" and a dict
    # of two keys "KeyError: 0" (of one key, the message below about its length)
    results, c = run_jobs(lambda job: _scorer(Served(value))(*job), [("q", ["357", "1"], _task())],
                          runners=1, timeout=5.0, retries=0)
    assert results == [None] and c["failed"] == 1
    assert c["last_error"] == f"ValueError: reward 'p0' {said}"


def test_a_reward_that_edits_the_task_or_the_responses_changes_nothing_else():
    # part 0 rewrites the answer (task.answer and task.row) and, called per group, the responses;
    # part 1 checks the response against the answer. Before, part 1 read the edited answer "999"
    # (0 for the right response), the buffer's texts were the edited ones, and the taskset's task
    # kept "999" for every later epoch
    class Edits:
        def __call__(self, prompt, responses, task):
            task.answer = task.row["answer"] = "999"
            responses[0] = "999"
            return [0.0] * len(responses)

    def right(prompt, response, task):
        seen.append((response, task.answer, task.row["answer"]))
        value = float(response == task.answer)
        task.answer = "edited by the first call"  # the second call must not see it
        return value

    seen, task, responses = [], _task(), ["357", "1"]
    rewards = _scorer(Edits(), right)("q", responses, task)
    assert seen == [("357", "357", "357"), ("1", "357", "357")]
    # 0 x 1 (p0) + 1 x (357 == 357) = 1.0; the second response 0 + 0
    assert [float(r) for r in rewards] == [1.0, 0.0]
    assert responses == ["357", "1"] and (task.answer, task.row) == ("357", {"question": "042+315", "answer": "357"})


# ---------------------------------------------------------------- 2. a reward that hangs


def test_calls_that_hang_past_the_timeout_are_counted_and_bounded(monkeypatch):
    # a call past explorer.max_timeout is abandoned, not stopped: it keeps its thread. Before, 50
    # such calls left 50 more threads (threading.active_count()) and nothing bounded them; now
    # each is counted while it runs (rollout/hung_calls) and one past MAX_HUNG_CALLS stops the run
    release = threading.Event()
    monkeypatch.setattr(explorer, "MAX_HUNG_CALLS", 4)
    scorer = _scorer(lambda p, r, t: release.wait() and 0.0 if t.task_id != "ok" else 1.0)
    ok = Task("ok", [], "357", {})
    try:
        results, c = run_jobs(lambda job: scorer(*job), [("q", ["357"], _task()), ("q", ["357"], ok)],
                              runners=2, timeout=0.2, retries=1, what=scorer.describe())
        # t/7 hangs twice (1 try + 1 retry): 2 calls hold a thread, under the bound of 4
        assert results == [None, [1.0]] and (c["timeouts"], c["failed"]) == (2, 1)
        assert len(explorer._THREADS.hung) == 2
        # the bound counts calls still running a timeout after they were abandoned: the 2 above, then
        # these 3 once their retries time out too (2 + 3 = 5 > 4)
        with pytest.raises(RunError) as e:
            run_jobs(lambda job: scorer(*job), [("q", ["357"], _task())] * 3, runners=3, timeout=0.2, retries=2,
                     what=scorer.describe())
        assert str(e.value) == (
            "5 calls of reward 'p0' (the last on task 't/7') ran past explorer.max_timeout (0.2 s) and have not "
            "returned 0.2 s after that. A call past the timeout is abandoned, not stopped (Python cannot stop a thread): each keeps "
            "its thread and what it holds, and a call that hangs on a task hangs there again every epoch, so the "
            "run stops before they pile up. Give the function a timeout of its own (a request's timeout, a bound "
            "on its loop), or raise explorer.max_timeout if it is only slow; then run the same command again to "
            "resume from the newest checkpoint.")
    finally:
        release.set()
    # once they return, they hold nothing: the count goes back to 0
    for _ in range(200):
        if not explorer._THREADS.hung:
            break
        threading.Event().wait(0.01)
    assert not explorer._THREADS.hung


# ---------------------------------------------------------------- 4. what a workflow returns


def _exp(tokens=(5, 6, 7, 8), prompt_length=2, **kw):
    kw.setdefault("logprobs", [-1.0] * (len(tokens) - prompt_length))
    kw.setdefault("group_id", "0/1/t/1")
    return Experience(list(tokens), prompt_length, task_id="t/1", **kw)


@pytest.mark.parametrize("group, said", [
    ([], "returned an empty list for task 't/1'"),
    (_exp(), "returned Experience for task 't/1'"),
    ([_exp(), {"tokens": [1, 2]}], "returned a list holding ['dict'] for task 't/1'"),
])
def test_a_workflow_entry_that_is_not_a_list_of_experiences_is_named(group, said):
    with pytest.raises(ConfigError) as e:
        check_output([group], [Task("t/1", [], "", {})], "my.workflow")
    assert str(e.value) == (
        f"workflow 'my.workflow' {said}; a task's entry is a non-empty list of Experience (rft.data.experience), "
        f"or None for a task that failed (it is then counted in rollout/failed_tasks; an empty list would leave "
        f"the task out without a count).")


def test_the_same_experience_twice_is_named():
    # it would be trained on twice and the overlong penalty would shape its reward twice
    e = _exp()
    with pytest.raises(ConfigError) as err:
        check_output([[e], [e]], [0, 1], "my.workflow")
    assert str(err.value) == (
        "workflow 'my.workflow' returned the same Experience object twice (task 't/1'): it would be trained on "
        "twice and its reward shaped twice. Build one Experience per rollout.")
    check_output([[_exp(), _exp()]], [0], "my.workflow")  # equal copies are two rollouts (greedy sampling)


GROUPS = ("the trainer groups rollouts by group_id (a group's advantages are relative to its mean), so each "
          "task's rollouts need one of their own, e.g. group_id=f\"{ctx.step}/{ctx.seed}/{task.task_id}\" as "
          "single_turn gives them.")


def test_an_experience_without_a_group_of_its_own_is_named():
    # before, Experience's default group_id "" made every task's rollouts one group: GRPO's baseline
    # was the mean over the whole batch, with exit 0
    tasks = [Task("t/1", [], "", {}), Task("t/2", [], "", {})]
    with pytest.raises(ConfigError) as e:
        check_output([[_exp(group_id="")], None], tasks, "my.workflow")
    assert str(e.value) == f"{HEAD} with no group_id: {GROUPS}"
    with pytest.raises(ConfigError) as e:
        check_output([[_exp(group_id="g")], [_exp(group_id="g")]], tasks, "my.workflow")
    assert str(e.value) == ("workflow 'my.workflow' returned an experience (task 't/2') with group_id 'g', which "
                            f"task 't/1''s experiences have too: {GROUPS}")
    # the same task twice in a step (a batch larger than the taskset) keeps one group, as before
    check_output([[_exp(group_id="g")], [_exp(group_id="g")]], [tasks[0], tasks[0]], "my.workflow")


HEAD = "workflow 'my.workflow' returned an experience (task 't/1')"


@pytest.mark.parametrize("exp, said", [
    (_exp((5, 6), 2, logprobs=[]), "with no response tokens (tokens has 2, prompt_length 2): every experience needs "
                                   "at least one token after the prompt; return None for a task without a response (counted in "
                                   "rollout/failed_tasks)."),
    (_exp(logprobs=[-1.0]), "whose logprobs has 1 entries for its 2 response tokens: it needs one per token after "
                            "the prompt (tokens[prompt_length:]), or none."),
    (_exp((5, 6, 7, 8, 9, 10, 11)), "of 7 tokens, more than the 6 of model.max_prompt_tokens + "
                                    "model.max_response_tokens (model.max_model_len where set), the context the memory plan "
                                    "sized the run for: "
                                    "cut the response to fit, or raise the key that sets it."),
    (_exp((5, 6, 7, 100)), "with token ids [100] outside the model's vocabulary (ints 0..99): the trainer could "
                           "not embed them. Give the tokenizer's ids (ctx.tokenizer)."),
    (_exp((5, 6, -1, 8)), "with token ids [-1] outside the model's vocabulary (ints 0..99): the trainer could "
                          "not embed them. Give the tokenizer's ids (ctx.tokenizer)."),
    (_exp((5, 6, 7.0, 8)), "with token ids [7.0] outside the model's vocabulary (ints 0..99): the trainer could "
                           "not embed them. Give the tokenizer's ids (ctx.tokenizer)."),
    (_exp(reward=float("nan")), "with reward nan: rewards must be finite numbers. Score through ctx.score (which "
                                "leaves such a task out and counts it), or return None for the task."),
    (_exp(logprobs=[-1.0, float("nan")]), "whose logprobs are not finite at response tokens [1] the loss trains on: "
                                          "the ratio to the new policy would be NaN or inf. Give the engine's "
                                          "sampling log-probs (samples' logprobs)."),
])
def test_an_experience_the_trainer_cannot_use_is_named(exp, said):
    with pytest.raises(ConfigError) as e:
        check_output([[exp]], [0], "my.workflow", vocab=100, max_tokens=6)
    assert str(e.value) == f"{HEAD} {said}"


def test_the_token_budget_is_the_context_the_run_is_sized_for():
    from omegaconf import OmegaConf

    from rft.rollout.explorer import token_budget

    model = OmegaConf.create({"max_prompt_tokens": 64, "max_response_tokens": 32, "max_model_len": None})
    assert token_budget(model, "single_turn", {}) == 96  # 64 + 32
    assert token_budget(model, "multi_turn", {"max_total_tokens": 200}) == 200
    assert token_budget(model, "openai_agent", {}) is None  # the endpoint bounds its calls by the model's context
    # rollout_args.max_tokens may exceed max_response_tokens where max_model_len holds it (rft/plan/batch.py)
    model.max_model_len = 512
    assert token_budget(model, "single_turn", {}) == 512


def test_what_the_trainer_can_use_passes():
    # numpy ids (an engine's), the last id of the vocabulary, a NaN log-prob off the loss mask (an
    # environment's turn) and exactly max_tokens tokens
    check_output([[_exp((np.int64(5), 6, 7, 99), logprobs=[-1.0, float("nan")], loss_mask=[1, 0])], None], [0, 1],
                 "my.workflow", vocab=100, max_tokens=4)
    assert math.isnan(_exp(logprobs=[-1.0, float("nan")]).logprobs[1])


# ---------------------------------------------------------------- a run with a careless workflow

MODE = {"mode": None}


def careless(tasks, engine, ctx):
    """single_turn, then one mistake of MODE's on the first task's first experience."""
    out = single_turn(tasks, engine, ctx)
    e = out[0][0]
    if MODE["mode"] == "vocab":
        e.tokens[-1] = 10**6
    elif MODE["mode"] == "long":
        extra = ctx.max_prompt_tokens + ctx.max_response_tokens  # past any prompt's length + the budget
        e.tokens += e.tokens[-1:] * extra
        e.logprobs += [-1.0] * extra
    elif MODE["mode"] == "empty":
        out[1] = []
    elif MODE["mode"] == "group":
        for group in out:
            for x in group:
                x.group_id = ""
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode, said", [
    ("vocab", "with token ids [{}] outside the model's vocabulary"),
    ("long", "tokens, more than the {} of model.max_prompt_tokens + model.max_response_tokens"),
    ("empty", "returned an empty list for task"),
    ("group", "with no group_id: the trainer groups rollouts by group_id"),
])
def test_a_run_with_a_careless_workflow_stops_with_its_paragraph(tmp_path, capsys, mode, said):
    # before, out-of-vocabulary ids reached the trainer's embedding (IndexError there, a device assert
    # on a GPU), a longer response was trained on past the planned length, and a task with no
    # experiences was left out with no count
    import rft.runtime.main

    MODE["mode"] = mode
    cfg = compose_cfg(["stages=[]", "cluster=inline", "monitor=console", f"checkpoint_root_dir={tmp_path}",
                       "buffer.batch_size=2", "algorithm.repeat_times=2", "buffer.total_steps=1",
                       "explorer.eval_on_startup=false", "buffer.explorer_input.eval_tasksets=[]",
                       "model.max_response_tokens=4", "buffer.explorer_input.taskset.workflow=test_user_faults.careless"])
    with pytest.raises(SystemExit) as e:  # a ConfigError: its paragraph, exit status 2
        rft.runtime.main.main(cfg)
    value = 10**6 if mode == "vocab" else cfg.model.max_prompt_tokens + 4
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert "workflow 'test_user_faults.careless' " in err and said.format(value) in err


def test_a_dict_reward_whose_keys_differ_between_responses_is_warned_about_once(caplog):
    # before, nothing said so: reward/p0/correct/mean read 1.0 where 1 response of 8 had the key
    scorer = _scorer(lambda p, r, t: {"correct": 1.0} if r == "357" else {"format": 0.5})
    with caplog.at_level("WARNING", logger="rft.rewards.scoring"):
        rewards = scorer("q", ["357", "1", "2"], _task()) + scorer("q", ["357", "1"], _task())
    # a missing key adds 0: 1.0, 0.5, 0.5, then 1.0, 0.5
    assert [float(r) for r in rewards] == [1.0, 0.5, 0.5, 1.0, 0.5]
    assert [r.getMessage() for r in caplog.records] == [
        "reward 'p0' returned a dict with keys ['correct'] for one response and ['format'] for another: a missing "
        "key adds 0 to the reward, and reward/p0/<key>/mean averages only the responses that have it (it would "
        "read 1.0 where 1 response of 8 was scored 1.0). Return every key, 0.0 where it does not apply (warned once)."]


def test_calls_that_time_out_are_logged_once_a_step_then_counted(caplog):
    # before, every timed-out call logged its own line: a reward hanging on every task of a step of
    # 64 tasks, 3 tries each, logged 192 lines a step
    release = threading.Event()
    try:
        with caplog.at_level("WARNING", logger="rft.rollout.explorer"):
            results, c = run_jobs(lambda job: release.wait(), [0, 1, 2], runners=3, timeout=0.05, retries=1)
    finally:
        release.set()
    # 3 jobs x (1 try + 1 retry) = 6 timeouts: one line, then the count of the other 5
    assert results == [None] * 3 and c["timeouts"] == 6
    assert [r.getMessage() for r in caplog.records] == [
        "job 0 attempt 1 timed out after 0.1 s (explorer.max_timeout: its generation and reward together)",
        "5 more calls timed out (the first is logged above, once a step; rollout/timeouts counts them, "
        "rollout/hung_calls those still running)"]
