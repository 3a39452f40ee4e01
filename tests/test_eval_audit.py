"""An audit of the numbers an eval reports and of the online curriculum's draws, against references
written here from the definitions alone (exact fractions, float64), on the edge cases: pass@k
(Chen et al. 2021's unbiased estimator) for k = n, c = 0, c = n, n = 1 and n = 128, k = 64; maj@n's
vote with ties and unanswered samples; partial credit; a failed task; eval sets of different
sizes (the explorer's `_evaluate`, on a workflow's output given by hand); the curriculum's weights,
its draws without replacement, its seeds; the task operators on a NaN difficulty."""

import math
from collections import Counter
from fractions import Fraction
from types import SimpleNamespace

import pytest

from rft.data import operators as ops
from rft.data.curriculum import OnlineCurriculum
from rft.data.experience import Experience
from rft.errors import ConfigError
from rft.rewards.eval_metrics import eval_metrics, majority, pass_at_k, task_values

# ---------------------------------------------------------------- references from the definitions


def ref_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """1 - C(n - c, k) / C(n, k), exact (math.comb is 0 when n - c < k: every draw of k holds a right one)."""
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def ref_majority_correct(rewards, answers, threshold) -> float:
    """The answer given most often (None: no answer, no vote); of equals, the one whose first
    sample came first; right when that first sample's reward >= threshold."""
    votes = [a for a in answers if a is not None]
    if not votes:
        return 0.0
    top = max(votes.count(a) for a in votes)
    first = min(answers.index(a) for a in votes if votes.count(a) == top)
    return float(rewards[first] >= threshold)


# ---------------------------------------------------------------- pass@k


def test_pass_at_k_equals_the_exact_fraction_up_to_n_128():
    # every c for n in 1..128 and k in {1, 2, 4, ..., 64, n}: within 1e-15 of the exact value
    worst = 0.0
    for n in range(1, 129):
        for c in range(n + 1):
            for k in {1, 2, 4, 8, 16, 32, 64, n} & set(range(1, n + 1)):
                worst = max(worst, abs(pass_at_k(n, c, k) - float(ref_pass_at_k(n, c, k))))
    assert worst < 1e-15


@pytest.mark.parametrize("n, c, k, want", [
    (1, 0, 1, 0.0), (1, 1, 1, 1.0),            # one sample: right or wrong
    (8, 0, 8, 0.0), (8, 8, 1, 1.0),            # c = 0: never; c = n: always
    (8, 1, 8, 1.0),                            # k = n: the right one is among them
    (128, 1, 64, 0.5),                         # 1 - C(127, 64)/C(128, 64) = 1 - 64/128
    (128, 2, 64, 1 - 4032 / 16256),            # 1 - (64*63)/(128*127) = 0.751968...
    (128, 64, 64, 1 - 1 / math.comb(128, 64)),  # 1 - 1/2.4e37: the float nearest is 1.0
])
def test_pass_at_k_edge_cases(n, c, k, want):
    assert pass_at_k(n, c, k) == want


def test_pass_at_k_refuses_k_above_n_and_c_out_of_range():
    for n, c, k in [(4, 1, 5), (4, 5, 1), (4, -1, 1), (4, 1, 0)]:
        with pytest.raises(ValueError, match=r"pass@k needs 0 <= c <= n and 1 <= k <= n"):
            pass_at_k(n, c, k)


# ---------------------------------------------------------------- maj@n, partial credit


@pytest.mark.parametrize("rewards, answers", [
    ([1.0, 0.0, 0.0, 1.0], ["7", "8", "8", "7"]),  # tie 7/8: 7 sampled first, right
    ([0.0, 1.0, 1.0, 0.0], ["8", "7", "7", "8"]),  # tie: 8 first, wrong
    ([0.0, 1.0, 1.0], [None, "7", "7"]),          # the unanswered does not vote
    ([0.0, 0.0], [None, None]),                   # no answer at all: wrong
    ([0.0, 1.0, 0.0, 0.0, 1.0], ["5", "7", "6", None, "7"]),  # 7 twice beats 5 and 6 once
])
def test_maj_at_n_is_the_reference_vote(rewards, answers):
    assert task_values(rewards, answers, [], 1.0)[f"maj@{len(rewards)}"] == ref_majority_correct(rewards, answers, 1.0)


def test_partial_credit_counts_as_correct_only_at_the_threshold():
    """reasoning_gym's fractions: rewards 0.5, 0.5, 1.0 with pass_threshold 1: c = 1, pass@1 = 1/3,
    pass@2 = 1 - C(2, 2)/C(3, 2) = 2/3; mean@3 = 2/3 (the fractions count); best@3 = 1. With the
    threshold at 0.5, all three are right: pass@1 = 1."""
    v = task_values([0.5, 0.5, 1.0], ["a", "a", "b"], [1, 2], 1.0)
    assert v == pytest.approx({"mean@3": 2 / 3, "best@3": 1.0, "pass@1": 1 / 3, "pass@2": 2 / 3, "maj@3": 0.0})
    assert task_values([0.5, 0.5, 1.0], ["a", "a", "b"], [1], 0.5)["pass@1"] == 1.0


def test_standard_errors_over_tasks():
    """Three tasks, n = 2, rewards (1,1), (1,0), (0,0): mean@2 per task 1, 0.5, 0 -> 0.5; its
    sample stdev sqrt(((0.5)^2 + 0 + (0.5)^2) / 2) = 0.5, se 0.5/sqrt(3) = 0.288675."""
    m = eval_metrics([([1.0, 1.0], ["1", "1"], None), ([1.0, 0.0], ["1", "2"], None),
                      ([0.0, 0.0], ["2", "2"], None)], [1, 2], 1.0, "e")
    assert m["e/mean@2"] == 0.5 and m["e/mean@2_se"] == pytest.approx(0.5 / math.sqrt(3), rel=1e-12)
    # pass@2 per task 1, 1, 0 -> 2/3
    assert m["e/pass@2"] == pytest.approx(2 / 3, rel=1e-12)


# ---------------------------------------------------------------- the explorer's _evaluate


def exp(reward: float, response: str, task: str, **info) -> Experience:
    return Experience([0, 1], 1, [], reward=reward, task_id=task, group_id=task, info={"response": response, **info})


def evaluate(sets: list) -> dict:
    """The explorer's `_evaluate` over eval sets [(name, n, pass_k, groups)], `groups` what the
    workflow returned (one entry per task, None: failed): no engine, no model."""
    from rft.rollout.explorer import Explorer

    ex = object.__new__(Explorer)
    ex.cfg = SimpleNamespace(buffer=SimpleNamespace(explorer_input=SimpleNamespace(default_reward_fn_type="exact_match")))
    ex.eval_tasksets, out = [], {}
    for name, n, pass_k, groups in sets:
        ts = SimpleNamespace(name=name, repeat_times=n, pass_k=pass_k, pass_threshold=1.0, group_by=None,
                             reward_fn="exact_match", workflow="single_turn")
        ex.eval_tasksets.append((ts, [SimpleNamespace(task_id=f"{name}/{i}", row={}) for i in range(len(groups))], None))
        out[name] = groups
    ex._run = lambda ts, scorer, tasks, n, step, salt, counters: out[ts.name]
    return ex._evaluate(0)


def test_a_failed_task_counts_as_n_wrong_samples_and_eval_accuracy_is_the_first_sets():
    """Set a: 2 tasks, n = 2: rewards (1, 0) and (1, 1): accuracy 3/4. Set b (3 tasks): (1, 1),
    (0, 0), and a failed task (None) counting as (0, 0): accuracy 2/6 = 1/3, failed_tasks 1;
    pass@1 per task 1, 0, 0 -> 1/3; maj@2 1, 0, 0 -> 1/3. eval/accuracy is set a's 0.75, not the
    mean over sets (0.75 + 1/3)/2 = 0.5417 nor over samples 5/10."""
    m = evaluate([("a", 2, [], [[exp(1, "4", "a/0"), exp(0, "5", "a/0")], [exp(1, "6", "a/1"), exp(1, "6", "a/1")]]),
                  ("b", 2, [1, 2], [[exp(1, "1", "b/0"), exp(1, "1", "b/0")], [exp(0, "9", "b/1"), exp(0, "8", "b/1")], None])])
    assert m["eval/a/accuracy"] == 0.75 and m["eval/accuracy"] == 0.75 and m["eval/failed_tasks"] == 0
    assert m["eval/b/accuracy"] == pytest.approx(1 / 3) and m["eval/b/failed_tasks"] == 1
    assert m["eval/b/pass@1"] == pytest.approx(1 / 3) and m["eval/b/maj@2"] == pytest.approx(1 / 3)
    assert m["eval/b/pass@2"] == pytest.approx(1 / 3) and m["eval/b/mean@2"] == pytest.approx(1 / 3)
    # set a (n = 2) has them too: maj@2 task 0's tie 4/5 goes to 4 (right), task 1's 6: 1
    assert m["eval/a/maj@2"] == 1.0 and m["eval/a/best@2"] == 1.0


# ---------------------------------------------------------------- the online curriculum


def observed(n: int, outcomes: dict, window: int = 4, eps: float = 0.05, seed: int = 0) -> OnlineCurriculum:
    cur = OnlineCurriculum(n, "ts", window=window, eps=eps, threshold=1.0, seed=seed)
    for row, rewards in outcomes.items():
        cur.observe([exp(r, "", f"ts/{row}") for r in rewards])
    return cur


def test_curriculum_weights_are_the_float64_formula():
    """p over the last window = 4 outcomes: task 0 (1,0,0,1,1,1) -> its last 4 (0,1,1,1), p = 3/4,
    w = 3/16 + 0.05 = 0.2375; task 1 (0.99 is below the threshold 1, NaN too) -> p = 0, w = 0.05;
    task 2 unseen -> 0.25 + 0.05 = 0.3; task 3 (1, 0) -> p = 1/2, w = 0.3. Another taskset's
    task and a row past the taskset's end are not counted."""
    cur = observed(4, {0: [1, 0, 0, 1, 1, 1], 1: [0.99, math.nan], 3: [1, 0]})
    cur.observe([exp(1.0, "", "other/2"), exp(1.0, "", "ts/9")])
    ref = [p * (1 - p) + 0.05 for p in (0.75, 0.0, 0.5, 0.5)]
    assert cur.weights() == pytest.approx(ref, abs=1e-15) and ref == pytest.approx([0.2375, 0.05, 0.3, 0.3])
    assert cur.metrics() == {"curriculum/solved_frac": 0.0, "curriculum/unsolved_frac": 1 / 3,
                             "curriculum/seen_frac": 0.75}


def test_curriculum_draws_without_replacement_by_weight():
    """Weights 0.05, 0.3, 0.3 (W = 0.65), two tasks a step: drawn one after the other in proportion
    to the weights left, so P({0, 1}) = w0/W * w1/(W - w0) + w1/W * w0/(W - w1)
    = 0.05/0.65 * 0.3/0.6 + 0.3/0.65 * 0.05/0.35 = 0.03846 + 0.06593 = 0.10440, as {0, 2};
    P({1, 2}) = 1 - 2 * 0.10440 = 0.79121. 6000 steps: a share's se is <= sqrt(0.25/6000) = 0.0065;
    0.025 is 3.9 of them."""
    cur = observed(3, {0: [1, 1], 1: [1, 0]}, window=2)
    w = cur.weights()
    assert w == pytest.approx([0.05, 0.3, 0.3])
    W = sum(w)
    counts = Counter(frozenset(cur.draw(step, 2)) for step in range(6000))
    for i, j in [(0, 1), (0, 2), (1, 2)]:
        ref = w[i] / W * w[j] / (W - w[i]) + w[j] / W * w[i] / (W - w[j])
        assert counts[frozenset((i, j))] / 6000 == pytest.approx(ref, abs=0.025)
    assert all(len(set(cur.draw(step, 3))) == 3 for step in range(20))  # never a task twice


def test_curriculum_seeds_and_small_tasksets():
    cur = observed(5, {})
    # the same (seed, step): the same draw; another step or seed: another (these differ)
    assert cur.draw(3, 2) == cur.draw(3, 2) == observed(5, {}).draw(3, 2)
    assert len({tuple(cur.draw(s, 5)) for s in range(10)}) > 1
    assert {tuple(observed(5, {}, seed=s).draw(3, 5)) for s in range(10)} != {tuple(cur.draw(3, 5))}
    # one task: it, whatever k; more asked than there are: each once
    assert observed(1, {}).draw(0, 4) == [0]
    assert sorted(cur.draw(0, 8)) == [0, 1, 2, 3, 4]



def test_a_rollout_of_several_experiences_is_one_sample():
    """openai_agent: a run whose calls do not continue each other is several experiences, each
    with the run's reward and info['rollout'] = the run. n = 2, task 0: run 0 (reward 1, calls
    answering "3" then "7") and run 1 (reward 0, "8"): its samples are (1, "7") and (0, "8"), so
    mean@2 = 1/2, pass@1 = 1/2, pass@2 = 1, maj@2: the tie 7/8 goes to 7 (right) = 1. Task 1:
    runs (1, "7"), (1, "7"): mean 1, pass@1 1, maj 1. The set: accuracy (1 + 0 + 1 + 1)/4 = 3/4,
    pass@1 (1/2 + 1)/2 = 3/4. Counting experiences, the accuracy was (1 + 1 + 0 + 1 + 1)/4 = 5/4
    and task 0's n was 3 (mean@3 beside task 1's mean@2: a KeyError)."""
    task0 = [exp(1, "3", "a/0", rollout=0, call=0), exp(1, "7", "a/0", rollout=0, call=1), exp(0, "8", "a/0", rollout=1, call=0)]
    task1 = [exp(1, "7", "a/1", rollout=0, call=0), exp(1, "7", "a/1", rollout=1, call=0)]
    m = evaluate([("a", 2, [1, 2], [task0, task1])])
    assert m["eval/a/accuracy"] == 0.75
    assert m["eval/a/mean@2"] == 0.75 and m["eval/a/pass@1"] == 0.75 and m["eval/a/pass@2"] == 1.0
    assert m["eval/a/maj@2"] == 1.0 and m["eval/a/best@2"] == 1.0


def test_more_rollouts_than_the_set_asks_for_is_one_paragraph_naming_the_workflow():
    """A workflow of a study's own returning 3 rollouts for a task of an n = 2 set: that task's
    metrics were mean@3 beside the others' mean@2, and the summary a KeyError ('mean@3')."""
    too_many = [exp(1, "7", "a/0"), exp(0, "8", "a/0"), exp(1, "7", "a/0")]
    with pytest.raises(ConfigError) as e:
        evaluate([("a", 2, [1], [too_many, [exp(1, "7", "a/1"), exp(1, "7", "a/1")]])])
    assert str(e.value) == (
        "eval set 'a': workflow 'single_turn' returned 3 rollouts for task 'a/0', and the set asks for 2 (its "
        "repeat_times): a workflow returns at most n rollouts per task (an openai_agent run of several calls is "
        "one, by its info['rollout']).")


def test_an_empty_group_counts_as_n_wrong_samples():
    """A workflow may return [] for a task (no experience, not None): n = 2 samples of reward 0,
    as a failed task; it was n = 0 (ZeroDivisionError in mean@0). Task 0 (1, 1), task 1 []:
    accuracy 2/4, pass@1 (1 + 0)/2."""
    m = evaluate([("a", 2, [1], [[exp(1, "1", "a/0"), exp(1, "1", "a/0")], []])])
    assert m["eval/a/accuracy"] == 0.5 and m["eval/a/pass@1"] == 0.5 and m["eval/a/mean@2"] == 0.5


def test_the_difficulty_scores_pass_rate_is_per_rollout():
    """llm_difficulty_score_filter's pass rate (rft.rollout.explorer.pass_rates), n = 2, on task 0
    and task 1 above and a failed task: 1/2, 1, 0. Counting experiences it was 2/2 for task 0
    (difficulty 0: kept as easy)."""
    from rft.rollout.explorer import pass_rates

    task0 = [exp(1, "3", "a/0", rollout=0, call=0), exp(1, "7", "a/0", rollout=0, call=1), exp(0, "8", "a/0", rollout=1, call=0)]
    task1 = [exp(1, "7", "a/1", rollout=0, call=0), exp(1, "7", "a/1", rollout=1, call=0)]
    ex = SimpleNamespace(cfg=SimpleNamespace(buffer=SimpleNamespace(explorer_input=SimpleNamespace(
        taskset=SimpleNamespace(pass_threshold=1.0)))), scorer=None, taskset=[None] * 3,
        _run=lambda *a: [task0, task1, None])
    assert pass_rates(ex, 2) == [0.5, 1.0, 0.0]


def test_the_curriculum_counts_an_agents_run_once():
    """A run of two experiences (rollout 0, reward 1) and one of one (rollout 1, reward 0): p = 1/2,
    w = 0.25 + 0.05 = 0.3. Per experience it was p = 2/3, w = 2/9 + 0.05 = 0.2722."""
    cur = observed(1, {})
    cur.observe([exp(1, "3", "ts/0", rollout=0, call=0), exp(1, "7", "ts/0", rollout=0, call=1),
                 exp(0, "8", "ts/0", rollout=1, call=0)])
    assert cur.weights() == [0.3]


# ---------------------------------------------------------------- task operators on a NaN difficulty

CTX = ops.TaskContext(text=lambda row: row["question"])


def test_a_nan_difficulty_is_named_not_sorted_or_dropped_silently():
    """difficulties 0.5, NaN, 0.1: sorted() compared NaN false both ways and left the rows as they
    were (0.5 before 0.1: the curriculum not easy to hard), and difficulty_filter dropped the NaN
    row without a word (NaN is in no range)."""
    rows = [{"question": "a", "difficulty": 0.5}, {"question": "b", "difficulty": math.nan},
            {"question": "c", "difficulty": 0.1}]
    with pytest.raises(ConfigError) as e:
        ops.curriculum_order(rows, CTX)
    assert str(e.value) == ("row 1 has no number in column 'difficulty' (it holds nan); score the rows first "
                            "(llm_difficulty_score_filter) or name the column that holds the difficulty.")
    with pytest.raises(ConfigError) as e2:
        ops.difficulty_filter(rows, CTX)
    assert str(e2.value) == str(e.value)
    # without the NaN row: easy to hard
    assert [r["question"] for r in ops.curriculum_order([rows[0], rows[2]], CTX)] == ["c", "a"]


def test_curriculum_order_on_values_that_do_not_compare_names_them():
    # a number and a text: sorted() raised TypeError, reported as if the operator's args were wrong
    rows = [{"question": "a", "level": 2}, {"question": "b", "level": "hard"}]
    with pytest.raises(ConfigError) as e:
        ops.curriculum_order(rows, CTX, column="level")
    assert str(e.value) == ("column 'level' holds values that do not compare (row 0: 2, row 1: 'hard'); order by a "
                            "column of numbers, or of texts, in every row.")
    assert [r["question"] for r in ops.curriculum_order([{"question": "x", "level": "b"}, {"question": "y", "level": "a"}],
                                                        CTX, column="level")] == ["y", "x"]


def test_a_blank_response_is_no_answer_and_does_not_vote():
    """exact_match reads the stripped response: two blank responses (rewards 0) and "42" (1).
    README: samples without an answer do not vote, so the majority is 42, right: maj@3 = 1. The
    blanks voted "" twice and outvoted it: 0."""
    m = evaluate([("a", 3, [], [[exp(0, "", "a/0"), exp(0, "  \n", "a/0"), exp(1, "42", "a/0")]])])
    assert m["eval/a/maj@3"] == 1.0 and m["eval/a/accuracy"] == pytest.approx(1 / 3)


def test_the_curriculum_judges_a_right_answer_before_the_overlong_penalty():
    """DAPO's overlong penalty is added by the explorer as the reward part `overlong` (weight 1):
    a right answer near the length limit, 1.0 - 0.4 = 0.6, counted as a fail at the threshold 1,
    so the curriculum saw task 0 as never solved (p = 0, weight eps). As the reward function gave
    it: 2 solved of 2, p = 1, w = 0 + 0.05; task 1 wrong and penalised (0 - 0.4): p = 0, w = 0.05;
    task 2 (1.0, 0.0 unpenalised): p = 1/2, w = 0.3."""
    from rft.data.experience import add_part

    cur = OnlineCurriculum(3, "ts", window=4, eps=0.05, threshold=1.0, seed=0)
    rollouts = [exp(1.0, "", "ts/0"), exp(1.0, "", "ts/0"), exp(0.0, "", "ts/1"), exp(1.0, "", "ts/2"), exp(0.0, "", "ts/2")]
    for e in rollouts[:3]:
        add_part(e, "overlong", -0.4)
    assert [e.reward for e in rollouts[:3]] == pytest.approx([0.6, 0.6, -0.4])
    cur.observe(rollouts)
    assert [cur.pass_rate(r) for r in range(3)] == [1.0, 0.0, 0.5]
    assert cur.weights() == pytest.approx([0.05, 0.05, 0.3], abs=1e-15)
