"""The eval metrics papers report (rft/rewards/eval_metrics.py): pass@k's unbiased estimator,
maj@n's vote, best@n and mean@n with standard errors and per-group values, hand-computed; and an
eval set's metrics equal to those recomputed from its saved per-sample records."""

import json
import math
from types import SimpleNamespace

import pytest
from conftest import compose_cfg

from rft.data.experience import Experience
from rft.errors import ConfigError
from rft.rewards.eval_metrics import eval_metrics, majority, pass_at_k
from rft.rewards.verifiers import answer_of, same_answer


@pytest.mark.parametrize("k, want", [(1, 0.4), (2, 0.7), (3, 0.9), (4, 1.0), (5, 1.0)])
def test_pass_at_k_on_five_samples_two_correct(k, want):
    """n=5, c=2: 1 - C(3, k) / C(5, k): k=1 1 - 3/5; k=2 1 - 3/10; k=3 1 - 1/10; k=4, 5: C(3, k) = 0."""
    assert pass_at_k(5, 2, k) == pytest.approx(want, abs=1e-12)


def test_pass_at_k_equals_the_binomial_formula_everywhere_small():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)
    # n=200 (a large binomial) without overflow: 1 - C(190, 10) / C(200, 10)
    assert pass_at_k(200, 10, 10) == pytest.approx(1 - math.comb(190, 10) / math.comb(200, 10), rel=1e-12)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(3, 1, 4)


def test_a_tied_vote_goes_to_the_answer_sampled_first_and_unanswered_samples_do_not_vote():
    assert majority(["7", "8", "8", "7", None]) == 0  # 7 and 8 twice each: 7 came first
    assert majority([None, "8", "7", "7"]) == 2  # 7 twice
    assert majority([None, None]) is None


def test_maj_at_n_votes_answers_the_verifier_calls_equal_together():
    """math: 1/2, 0.5 and \\frac{1}{2} are one answer (math_verify), 0.3 another. Samples (reward):
    0.3 (0), 1/2 (1), 0.3 (0), 0.5 (1), \\frac{1}{2} (1). As strings 0.3 has 2 votes and the others
    1: the vote is 0.3, wrong, maj@5 0. As the verifier judges: one half has 3 votes, 0.3 has 2: the
    vote is sample 1's 1/2, right, maj@5 1."""
    same = same_answer("math")
    answers, rewards = ["0.3", "1/2", "0.3", "0.5", r"\frac{1}{2}"], [0.0, 1.0, 0.0, 1.0, 1.0]
    assert majority(answers) == 0 and majority(answers, same) == 1
    assert eval_metrics([(rewards, answers, None)], [1], 1.0, "e")["e/maj@5"] == 0.0  # strings: the defect
    assert eval_metrics([(rewards, answers, None)], [1], 1.0, "e", same)["e/maj@5"] == 1.0
    # a tie between two answers of 2 votes each goes to the answer sampled first: 2 (as 4/2) before one
    # half, whichever form came first; as strings 4 answers of one vote each, the same first sample
    assert majority(["0.5", "4/2", "1/2", "2"], same) == 0 and majority(["4/2", "0.5", "2", "1/2"], same) == 0
    # the vote is the answer's first sample; samples without an answer do not vote, also beside equal forms
    assert majority([None, "7", "0.5", None, "1/2", "7.0", "7"], same) == 1  # 7: 3 votes; one half: 2
    assert majority([None, None], same) is None
    # countdown: 3+7 and 7+3 use the same numbers to the same value; 1+9 other numbers: as strings
    # three answers of one vote (the first, 1+9); as the verifier judges, 3+7 with 2 votes
    cd = same_answer([{"fn": "countdown", "weight": 1.0, "args": {"integer_steps": True}}])
    assert majority(["1+9", "3+7", "7+3"]) == 0 and majority(["1+9", "3+7", "7+3"], cd) == 1
    # exact_match and last_number compare their answers as strings, as their verifiers do
    assert not same_answer("exact_match")("2", "4/2") and not same_answer("last_number")("2", "4/2")


def test_maj_at_n_asks_the_verifier_only_where_the_vote_can_change_the_value():
    """With no sample passing the vote cannot pick a passing one (maj 0), with every sample passing it
    cannot pick a failing one (maj 1, when any sample answered): the verifier's comparisons (~6 ms
    each for math, n(n-1)/2 of them for an untrained model's n different answers) are skipped there."""
    from rft.rewards.eval_metrics import task_values

    calls = []

    def same(a, b):
        calls.append((a, b))
        return a == b

    wrong, right = [0.0] * 4, [1.0] * 4
    assert task_values(wrong, ["1", "2", "3", "4"], [], 1.0, same)["maj@4"] == 0.0 and calls == []
    assert task_values(right, ["1", "2", "3", "4"], [], 1.0, same)["maj@4"] == 1.0 and calls == []
    assert task_values(right, [None] * 4, [], 1.0, same)["maj@4"] == 0.0  # no answer: no vote, as before
    # mixed: the vote is judged. 1, 2, 2, 3 with only the 2s passing: 2 has 2 votes, right; compared
    # 2 with 1, then 3 with 1 and 2 (the second 2 is the same string: judged once)
    assert task_values([0.0, 1.0, 1.0, 0.0], ["1", "2", "2", "3"], [], 1.0, same)["maj@4"] == 1.0
    assert calls == [("1", "2"), ("1", "3"), ("2", "3")]


def test_an_eval_sets_maj_at_n_votes_as_its_verifier_judges():
    """paper_metrics over a math set of 2 tasks, n = 3 (the answers the math reward reads): task A
    says \\boxed{0.5}, \\boxed{7}, \\boxed{1/2} (rewards 1, 0, 1): one half 2 votes, right; task B
    says \\boxed{9}, \\boxed{2/4}, \\boxed{\\frac12} (0, 1, 1): one half 2 votes, right. maj@3 = 1
    (as strings each task's 3 answers tie, the first sample wins: A right, B wrong, 0.5)."""
    from rft.data.experience import Experience
    from rft.rewards.eval_metrics import paper_metrics

    def group(task, pairs):
        return [Experience([0, 1], 1, [], reward=r, task_id=task, group_id=task, info={"response": rf"so \boxed{{{a}}}"})
                for a, r in pairs]

    ts = SimpleNamespace(name="m", repeat_times=3, pass_k=[1], group_by=None, pass_threshold=1.0, workflow="single_turn")
    tasks = [SimpleNamespace(task_id="m/0", row={}), SimpleNamespace(task_id="m/1", row={})]
    groups = [group("m/0", [("0.5", 1.0), ("7", 0.0), ("1/2", 1.0)]),
              group("m/1", [("9", 0.0), ("2/4", 1.0), (r"\frac12", 1.0)])]
    assert paper_metrics(ts, tasks, groups, "math", "eval/m")["eval/m/maj@3"] == 1.0
    votes = [([e.reward for e in g], [answer_of("math", e.info["response"]) for e in g], None) for g in groups]
    assert votes[1][1] == ["9", "2/4", r"\frac12"]
    assert eval_metrics(votes, [1], 1.0, "eval/m")["eval/m/maj@3"] == 0.5  # as strings


def test_metrics_of_two_tasks_with_standard_errors_and_groups():
    """Task A: rewards 1,0,0,1,0 (c=2), answers 7,8,8,7,9; task B: all 0, answers 1,1,2,-,-.
    mean@5: A 0.4, B 0 -> 0.2, se stdev(0.4, 0)/sqrt(2) = 0.2828/1.4142 = 0.2. best@5: 1, 0 -> 0.5,
    se 0.7071/1.4142 = 0.5. pass@1: 0.4, 0 -> 0.2; pass@3: 0.9, 0 -> 0.45. maj@5: A's tie 7/8 goes
    to 7, correct -> 1; B's 1 is wrong -> 0: 0.5. Per group: level=1 is A alone (se 0)."""
    samples = [([1.0, 0.0, 0.0, 1.0, 0.0], ["7", "8", "8", "7", "9"], "level=1"),
               ([0.0] * 5, ["1", "1", "2", None, None], "level=2")]
    m = eval_metrics(samples, [1, 3], 1.0, "eval/x")
    assert m["eval/x/mean@5"] == pytest.approx(0.2) and m["eval/x/mean@5_se"] == pytest.approx(0.2)
    assert m["eval/x/best@5"] == pytest.approx(0.5) and m["eval/x/best@5_se"] == pytest.approx(0.5)
    assert m["eval/x/pass@1"] == pytest.approx(0.2) and m["eval/x/pass@3"] == pytest.approx(0.45)
    assert m["eval/x/maj@5"] == pytest.approx(0.5)
    assert m["eval/x/level=1/pass@3"] == pytest.approx(0.9) and m["eval/x/level=1/pass@3_se"] == 0.0
    assert m["eval/x/level=2/maj@5"] == 0.0
    # a threshold of 0.5 on rewards of 0.6: correct
    assert eval_metrics([([0.6, 0.0], ["a", "b"], None)], [1], 0.5, "e")["e/pass@1"] == pytest.approx(0.5)


def test_answers_are_what_each_verifier_reads():
    assert answer_of("last_number", "so it is 42") == answer_of("last_number", "42.0") == "42"
    assert answer_of("last_number", "no number") is None
    assert answer_of("math", r"thus \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert answer_of("exact_match", "  357 ") == "357"
    assert answer_of("countdown", "x <answer>1+2</answer>") == "1+2"
    assert answer_of([{"fn": "last_number", "weight": 1.0}], "= 7") == "7"
    assert answer_of("my_study.reward", " free text ") == "free text"


def last_number_maj(reference: str, responses: list[str]) -> float:
    """maj@n of one task of the last_number reward, as an eval set computes it (its rewards, its answers)."""
    from rft.rewards.verifiers import last_number

    task = SimpleNamespace(answer=reference, row={}, task_id="t/0")
    rewards = [last_number("", r, task) for r in responses]
    answers = [answer_of("last_number", r) for r in responses]
    return eval_metrics([(rewards, answers, None)], [1], 1.0, "e", same_answer("last_number"))[f"e/maj@{len(responses)}"]


def test_last_number_votes_numbers_the_reward_calls_equal_together_and_no_others():
    """The reward compares exact decimals; the vote compared floats (repr), which merged and split
    answers the reward does not. Each case: maj@n 1.0 (it was 0.0).
    - 10000000000000000 (wrong), 10000000000000001 (right) twice, 7 twice: as floats one answer of
      3 votes whose first sample is wrong; exactly, the right one (2) ties 7 (2) and came first.
    - 0, -0 (both right for 0: Decimal("-0") == 0), 5, 5: as floats 0.0 1, -0.0 1, 5.0 2: 5 wins.
    - 400 2s (wrong), 400 1s (right) twice, 7 twice: both inf as floats, one answer led by the wrong.
    """
    assert last_number_maj("10000000000000001", ["10000000000000000", "10000000000000001", "10000000000000001", "7", "7"]) == 1.0
    assert last_number_maj("0", ["0", "-0", "5", "5"]) == 1.0
    assert last_number_maj("1" * 400, ["2" * 400, "1" * 400, "1" * 400, "7", "7"]) == 1.0
    # one spelling per value: leading zeros, trailing zeros, a sign on zero; thousands commas, as the reward
    assert [answer_of("last_number", r) for r in ["007.50", "-0.0", "-000", "1,000", "-12.340", "0.05"]] == \
        ["7.5", "0", "0", "1000", "-12.34", "0.05"]
    # 5000 digits (over int()'s 4300-digit limit): read as text, no ValueError, no inf
    assert answer_of("last_number", "9" * 5000) == "9" * 5000
    assert last_number_maj("9" * 5000, ["9" * 4999 + "8", "9" * 5000, "9" * 5000]) == 1.0


def test_reasoning_gym_votes_answers_its_scorer_calls_equal_together():
    """chain_sum's scorer takes "1,000", "+01000.00" and "1000" for one number (Decimal, commas
    dropped); spell_backward's is blind to case. Task 0 of each (seed 1) with its answer A: samples
    A spelled two ways (both right), then a wrong answer twice. As strings: 1, 1, 2: the wrong one
    wins, maj@4 0. As the scorer judges: A 2 votes, first sampled, right: maj@4 1. A wrong answer
    never joins a right one, also where the scorer gives partial credit (spell_backward's 0.8)."""
    from test_reasoning_gym import entry_task

    from rft.rewards.eval_metrics import paper_metrics
    from rft.rewards.reasoning_gym import reasoning_gym as reward

    def maj(task, responses):
        ts = SimpleNamespace(name="g", repeat_times=len(responses), pass_k=[1], group_by=None, pass_threshold=1.0,
                             workflow="single_turn")
        group = [Experience([0, 1], 1, [], reward=reward("", r, task), task_id=task.task_id, group_id="g",
                            info={"response": r}) for r in responses]
        assert [e.reward for e in group][:2] == [1.0, 1.0]  # the reward: both spellings right
        return paper_metrics(ts, [task], [group], "reasoning_gym", "eval/g")["eval/g/maj@4"]

    chain = entry_task("chain_sum")
    a = int(chain.answer)
    assert maj(chain, [f"<answer>{a}.00</answer>", str(a), str(a + 1), str(a + 1)]) == 1.0
    spell = entry_task("spell_backward")
    word = spell.answer
    assert maj(spell, [word.upper(), word, word[:-1], word[:-1]]) == 1.0
    same = same_answer("reasoning_gym", spell)
    assert same(word.upper(), word) and not same(word, word[:-1] + "#") and not same(word, word + "x")
    assert not same_answer("reasoning_gym")(word.upper(), word)  # no task: equal strings only


def test_pass_k_above_the_samples_per_task_is_a_config_error():
    from rft.plan.batch import check_config

    with pytest.raises(ConfigError) as e:
        check_config(compose_cfg(["buffer.explorer_input.eval_tasksets.0.pass_k=[1,8]",
                                  "buffer.explorer_input.eval_tasksets.0.repeat_times=4"]))
    assert ("buffer.explorer_input.eval_tasksets[0].pass_k=[1, 8]: each k must be in 1..4, the samples per task "
            "(its repeat_times)") in str(e.value)


@pytest.mark.slow  # an engine: 200 eval tasks x 4 samples
def test_an_eval_sets_metrics_equal_those_recomputed_from_its_saved_samples(warm_start, tmp_path):
    from rft.data.tasks import ensure_task_data
    from rft.rollout.explorer import Explorer

    cfg = compose_cfg(["cluster=inline", f"model.model_path={warm_start}", "model.builder=null",
                       "buffer.explorer_input.eval_tasksets.0.repeat_times=4",
                       "buffer.explorer_input.eval_tasksets.0.rollout_args.temperature=1.0",
                       "buffer.explorer_input.eval_tasksets.0.pass_k=[1,2,4]"])
    ensure_task_data(cfg.buffer.explorer_input)
    m = Explorer(cfg).evaluate(0, str(tmp_path))
    rows = [json.loads(line) for line in open(tmp_path / "step_0" / "arithmetic_test.jsonl")]
    assert len(rows) == 200 * 4 and all(r["messages"][1]["role"] == "assistant" for r in rows)
    by_task: dict = {}
    for r in rows:
        by_task.setdefault(r["task_id"], []).append(r)
    assert all(len(g) == 4 for g in by_task.values())
    # recomputed here from the records, by the formulas written out
    correct = [sum(r["reward"] >= 1.0 for r in g) for g in by_task.values()]
    for k in (1, 2, 4):
        want = sum(1 - math.comb(4 - c, k) / math.comb(4, k) for c in correct) / len(correct)
        assert m[f"eval/arithmetic_test/pass@{k}"] == pytest.approx(want, abs=1e-12)
    assert m["eval/arithmetic_test/mean@4"] == pytest.approx(m["eval/accuracy"])
    assert 0 < m["eval/arithmetic_test/pass@1"] < m["eval/arithmetic_test/pass@4"] < 1  # the warm start solves some
    votes = 0
    for g in by_task.values():
        answers = [r["answer"] for r in g]
        top = max(answers.count(a) for a in answers)
        first = next(r for r in g if answers.count(r["answer"]) == top)
        votes += first["reward"] >= 1.0
    assert m["eval/arithmetic_test/maj@4"] == pytest.approx(votes / len(by_task))


@pytest.mark.slow  # a 2-step training run, then bench over its checkpoints
def test_a_bench_table_over_two_checkpoints_and_two_sets_matches_its_samples(warm_start, tmp_path):
    from conftest import run_cli

    from rft.rewards.eval_metrics import pass_at_k

    env = {"RFT_CHECKPOINT_ROOT_DIR": str(tmp_path)}
    base = ["stages=[]", f"model.model_path={warm_start}", "model.builder=null", "monitor=console", "name=b",
            "cluster=inline"]
    r = run_cli(*base, "buffer.total_steps=2", "trainer.save_interval=1", "explorer.eval_interval=100", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    sets = ",".join(f"{{name:{name},path:'${{cache_dir}}/data/arithmetic-v4',split:{split},repeat_times:3,"
                    f"pass_k:[1,3],rollout_args:{{temperature:1.0}}}}" for name, split in (("a", "test"), ("b", "test")))
    r = run_cli(*base, "mode=bench", "explorer.bench_on_latest_checkpoint=false",
                f"buffer.explorer_input.eval_tasksets=[{sets}]", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    bench = tmp_path / "rft" / "b" / "bench"
    import csv

    rows = list(csv.DictReader(open(bench / "results.csv")))
    assert (bench / "results.png").stat().st_size > 10_000  # a panel per set
    assert [(row["stage"], row["step"]) for row in rows] == [("start", "0"), ("grpo", "1"), ("grpo", "2")]
    for row in rows:
        for name in ("a", "b"):
            records = [json.loads(line) for line in
                       open(bench / "samples" / row["stage"] / f"step_{row['step']}" / f"{name}.jsonl")]
            by_task: dict = {}
            for rec in records:
                by_task.setdefault(rec["task_id"], []).append(rec["reward"])
            assert len(by_task) == 200 and all(len(v) == 3 for v in by_task.values())
            for k in (1, 3):
                want = sum(pass_at_k(3, sum(x >= 1.0 for x in v), k) for v in by_task.values()) / 200
                assert float(row[f"eval/{name}/pass@{k}"]) == pytest.approx(want, abs=1e-9)
            mean = sum(sum(v) for v in by_task.values()) / 600
            assert float(row[f"eval/{name}/mean@3"]) == pytest.approx(mean, abs=1e-9)


def test_the_vote_reads_the_verifier_part_of_a_reward_of_several_parts():
    """reward_fn=[format, math] (a format part first) and reward_fn={fn: math} (one part, as a dict)
    vote on math's answers, as reward_fn=math does. Samples "so 0.3", \boxed{1/2}, "so 0.3",
    \boxed{0.5}, \boxed{1/2} (rewards 0, 1, 0, 1, 1): one half has 3 votes (1/2, 0.5 and 1/2
    again), 0.3 has 2: maj@5 1. On the whole responses (before, for those two specs) "so 0.3" has 2
    votes and each other response 1: the vote is sample 0, wrong, maj@5 0."""
    from rft.rewards.eval_metrics import paper_metrics

    responses = ["so 0.3", r"I get \boxed{1/2}", "so 0.3", r"thus \boxed{0.5}", r"it is \boxed{1/2}"]
    rewards = [0.0, 1.0, 0.0, 1.0, 1.0]
    group = [Experience([0, 1], 1, [], reward=r, task_id="m/0", group_id="m", info={"response": t})
             for t, r in zip(responses, rewards)]
    ts = SimpleNamespace(name="m", repeat_times=5, pass_k=[1], group_by=None, pass_threshold=1.0, workflow="single_turn")
    task = SimpleNamespace(task_id="m/0", row={})
    for spec in ["math", [{"fn": "format", "weight": 0.1, "args": {"pattern": ".*"}}, {"fn": "math", "weight": 1.0}],
                 {"fn": "math"}]:
        assert [answer_of(spec, t) for t in responses] == ["0.3", "1/2", "0.3", "0.5", "1/2"], spec
        assert paper_metrics(ts, [task], [group], spec, "eval/m")["eval/m/maj@5"] == 1.0, spec
    # a reward without a verifier part votes on the stripped responses
    assert answer_of([{"fn": "format", "args": {"pattern": ".*"}}], " so 0.3 ") == "so 0.3"


HOSTILE_NUMBERS = ["1e16", "10000000000000000", "10^16", "1.5 \\times 10^{3}", "1500", "1,500", ".5", "1/2", "0.50",
                   "5e-1", "\u22125", "-5", "5", "+5", "\uff15", "\u0665", "-0", "0", "1/3", "2/6", "pages 5-7", "7",
                   "1\u202f000", "1,000", "1000.0", "1e999999", "1/0", "nan", "x2", "2"]


def test_last_number_vote_joins_exactly_the_answers_its_reward_calls_equal():
    """For every pair of hostile responses a, b: the reward with a as the reference scores b 1.0 iff
    a's and b's votes are one answer. Before, the vote split full-width `５` and Arabic-Indic `٥` from
    `5` (their text differed; the reward read 5 in each) and read 1e16 as 16, as the reward did."""
    from rft.rewards.verifiers import last_number

    for a in HOSTILE_NUMBERS:
        for b in HOSTILE_NUMBERS:
            reward = last_number("", b, SimpleNamespace(answer=a, row={}, task_id="t/0"))
            va, vb = answer_of("last_number", a), answer_of("last_number", b)
            assert reward == float(va is not None and va == vb), (a, b, reward, va, vb)
    assert [answer_of("last_number", r) for r in ["1e16", "1/2", "\uff15", "2/6", "1e999999", "1/0", "nan"]] == \
        ["10000000000000000", "0.5", "5", "1/3", "1e999999", None, None]
    # one half three ways, right, against 7 twice: one vote of 3 (as strings, 1 each: 7 would win)
    assert last_number_maj("0.5", ["1/2", ".5", "5e-1", "7", "7"]) == 1.0


@pytest.mark.slow  # 2.5 s alone, over the fast tier's second
def test_math_votes_on_what_its_reward_scores():
    """The vote read a response without a box by its last number ("the answer is $\\frac{1}{2}$"
    voted 2, which the reward scored as 1/2) and a last box never closed by the number in it (the
    reward scores it 0: no answer). Now the vote reads what the reward does."""
    from rft.rewards.verifiers import math as math_reward

    half, cut = "The answer is $\\frac{1}{2}$", "It is \\boxed{2} and then \\boxed{"
    assert answer_of("math", half) == "\\frac{1}{2}"  # was "2"
    assert answer_of("math", cut) is None  # was "2"
    assert answer_of("math", "\\boxed 5") == "5" and answer_of("math", "no answer here") is None
    # an answer math_verify reads as text only (no sympy object) is scored too (1.0 against \text{Monday}): it votes
    assert answer_of("math", "so $\\text{Monday}$") == "\\text{Monday}"
    # reference 2: only \boxed{2} is right; its one vote loses to the two halves: maj@4 0
    task = SimpleNamespace(answer="2", row={}, task_id="t/0")
    responses = [cut, half, "\\boxed{2}", half]
    rewards = [math_reward("", r, task) for r in responses]
    assert rewards == [0.0, 0.0, 1.0, 0.0]
    answers = [answer_of("math", r) for r in responses]
    assert answers == [None, "\\frac{1}{2}", "2", "\\frac{1}{2}"]
    assert eval_metrics([(rewards, answers, None)], [1], 1.0, "e", same_answer("math"))["e/maj@4"] == 0.0
    # reference 1/2: the halves are right and win: maj@4 1 (before, all four answers read "2": one vote whose
    # first sample, the cut box, scored 0: maj@4 0)
    task = SimpleNamespace(answer="\\frac{1}{2}", row={}, task_id="t/0")
    rewards = [math_reward("", r, task) for r in responses]
    assert rewards == [0.0, 1.0, 0.0, 1.0]
    assert eval_metrics([(rewards, answers, None)], [1], 1.0, "e", same_answer("math"))["e/maj@4"] == 1.0
    # off the main thread (the explorer's evals) the extraction runs in a scoring child: the same answers
    import threading

    off_main: list = []
    worker = threading.Thread(target=lambda: off_main.extend(answer_of("math", r) for r in responses))
    worker.start()
    worker.join()
    assert off_main == answers
