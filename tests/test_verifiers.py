"""The verifiers of rft/rewards/verifiers.py on hand-written cases (math, countdown, last_number), the math
task's config on a small MATH-format file, and the countdown generator's answers."""

import json
import threading
import time
from types import SimpleNamespace

import pytest
from conftest import compose_cfg

from rft.data.tasks import countdown_problems, countdown_prompt, generate_countdown, load_tasks
from rft.errors import ConfigError
from rft.rewards.verifiers import REWARD_FNS, check_countdown, countdown, last_boxed, last_number
from rft.rewards.verifiers import math as math_reward


def task(answer, **row):
    return SimpleNamespace(answer=answer, row={"answer": answer, **row}, task_id="t/0")


def test_exact_match_reads_the_stripped_text_and_a_blank_reference_matches_nothing():
    from rft.rewards.verifiers import exact_match

    assert exact_match("", "42\r\n", task(" 42 ")) == 1.0  # CRLF and spaces around either are dropped
    assert exact_match("", "4 2", task("42")) == 0.0  # inner whitespace counts
    assert exact_match("", "ＡＢ", task("AB")) == 0.0  # as written: no Unicode normalisation (documented)
    # a row whose answer is blank scored a blank response 1.0 (a reward for saying nothing)
    assert exact_match("", "", task("")) == 0.0
    assert exact_match("", " \r\n", task("  ")) == 0.0


# ---------------------------------------------------------------- math

MATH_CASES = [
    # (reference, response, score, why)
    (r"So the answer is $\boxed{\frac{1}{2}}$.", r"\boxed{0.5}", 1.0, "a fraction equals its decimal"),
    (r"\frac{1}{2}", r"The answer is \boxed{1/2}.", 1.0, "a plain LaTeX reference; a slash fraction"),
    (r"\boxed{\frac12}", r"$\boxed{\dfrac{1}{2}}$", 1.0, r"\frac12 shorthand and \dfrac are the same fraction"),
    ("0.5", r"\boxed{\frac{2}{4}}", 1.0, "an unreduced fraction equals the reference's value"),
    (r"\boxed{2\sqrt{2}}", r"\boxed{\sqrt{8}}", 1.0, "equivalent radicals are simplified to the same value"),
    ("3", r"so \boxed{x=3}", 1.0, "an assignment counts as its value"),
    ("x=3", r"\boxed{3}", 1.0, "and the other way round"),
    (r"\boxed{(x+1)^2}", r"\boxed{x^2+2x+1}", 1.0, "symbolically equal polynomials"),
    (r"\boxed{\{1,2\}}", r"\boxed{\{2,1\}}", 1.0, "a set in another order"),
    (r"\boxed{3, 5}", r"\boxed{5, 3}", 1.0, "several answers in another order"),
    (r"\boxed{[1,3)}", r"\boxed{[1,3)}", 1.0, "an interval"),
    (r"\boxed{(1,3)}", r"\boxed{(1,3]}", 0.0, "an interval with the wrong bracket is another interval"),
    ("5", r"\boxed{5\text{ cm}}", 1.0, "units text is dropped before comparing"),
    ("5 cm", r"\boxed{5 \text{ m}}", 1.0, "documented: math_verify drops units, it does not convert them"),
    (r"The total is $\boxed{1,000}$", r"\boxed{1000}", 1.0, "a thousands comma"),
    (r"\boxed{10\%}", r"\boxed{10}", 1.0, "a percent sign is dropped"),
    (r"\boxed{90^\circ}", r"\boxed{90}", 1.0, "a degree sign is dropped"),
    (42, r"\boxed{42}", 1.0, "a number (not a string) as the reference"),
    (r"\boxed{\frac{\pi}{4}}", r"\boxed{\pi/4}", 1.0, "pi in two notations"),
    (r"\boxed{-3}", r"\boxed{3}", 0.0, "a wrong sign is wrong"),
    (r"\boxed{\frac{1}{2}}", r"\boxed{\frac{1}{3}}", 0.0, "a wrong fraction is wrong"),
    (r"\boxed{10}", r"\boxed{0.1}", 0.0, "10% is not read as 0.1 when the reference is 10"),
    (r"\boxed{2\sqrt{2}}", r"\boxed{2\sqrt{3}}", 0.0, "a wrong radical is wrong"),
    ("42", "I have no idea.", 0.0, "no parseable answer scores 0"),
    ("42", "", 0.0, "an empty response scores 0"),
    ("7", r"First \boxed{7}, no wait, \boxed{8}", 0.0, "only the last box counts"),
    ("8", r"First \boxed{7}, no wait, \boxed{8}", 1.0, "... and it is the one taken"),
    ("7", r"It is \boxed{7} but then \boxed{", 0.0, "a last box never closed is no answer, not the earlier one"),
    ("7", "The final answer is 7.", 1.0, "without a box, math_verify finds the final number in the text"),
    (r"First $\boxed{2}$, then the answer is $\boxed{\frac{3}{4}}$.", r"\boxed{0.75}", 1.0,
     "the reference's last box is its answer"),
    ("Sam has 3 + 4 = 7 apples.\n#### 7", r"\boxed{7}", 1.0, "a GSM8K-style reference: the answer after ####"),
    # scored 0 before: math_verify reads neither other scripts' digits nor a thin space between digit groups
    ("5", "\\boxed{\uff15}", 1.0, "full-width digits"),
    ("5", "\\boxed{\u0665}", 1.0, "Arabic-Indic digits"),
    (r"\frac{1}{2}", "\\boxed{\\frac{\uff11}{\uff12}}", 1.0, "full-width digits in LaTeX"),
    ("10000", r"\boxed{10\,000}", 1.0, r"thousands grouped by LaTeX's thin space \, (it read 0)"),
    (r"\boxed{10\,000}", r"\boxed{10000}", 1.0, "... in the reference too"),
    ("1000", "\\boxed{1\u202f000}", 1.0, "thousands grouped by a narrow no-break space"),
    # held, and written down
    ("-5", "\\boxed{\u22125}", 1.0, "U+2212 MINUS SIGN"),
    ("0.5", r"\boxed{.5}", 1.0, "a leading point"),
    ("5", r"\boxed 5", 1.0, "a box without braces: math_verify reads it"),
    ("5", "\\boxed{\r\n5\r\n}\r\n", 1.0, "CRLF"),
    (r"2\,3", r"\boxed{23}", 0.0, "a thin space between digits not in groups of three is not a separator"),
    ("10000000000000000", r"\boxed{1e16}", 0.0, "LaTeX has no e-notation: write 10^{16} (documented)"),
    ("5", r"\boxed{nan}", 0.0, "nan is no number"),
]


@pytest.mark.parametrize("reference,response,score,why", MATH_CASES, ids=[c[3] for c in MATH_CASES])
def test_math_cases(reference, response, score, why):
    # time enough that the verdict is math_verify's, not its 2-second alarm on a loaded machine
    # (sympy's first simplify of a polynomial ran out of it beside other tests: a 0 for an equal answer)
    assert math_reward("", response, task(reference), timeout_seconds=120) == score, why


@pytest.mark.parametrize("response", [None, "}}}{{{", r"\boxed{}", r"\boxed{\frac{", "$" * 500, r"\left(" * 300,
                                      "\x00\xff", r"\boxed{\begin{matrix}}"])
def test_math_garbage_scores_zero_without_raising(response):
    # whatever a model emits, the verifier answers 0 (an exception would cost retries and a task)
    assert math_reward("", response, task("42")) == 0.0


def test_last_boxed_balances_braces():
    # the content may hold braces of its own
    assert last_boxed(r"x \boxed{\frac{1}{2}} y \boxed{\sqrt{\frac{a}{b}}}") == r"\sqrt{\frac{a}{b}}"
    assert last_boxed("no box") is None
    assert last_boxed(r"\boxed{1} \boxed{2") is None


def test_math_from_worker_threads_agrees_with_the_main_thread():
    """The explorer calls rewards from threads, where math_verify's signal timeouts raise: there the
    call runs in a child process (rft.rewards.workers.Workers; two threads at once, two processes)
    and gives the same scores."""
    cases = MATH_CASES[:8] + MATH_CASES[19:24]
    results = {}

    def score(part):
        for i in part:
            ref, resp, _, _ = cases[i]
            results[i] = math_reward("", resp, task(ref))

    threads = [threading.Thread(target=score, args=(range(k, len(cases), 2),)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == {i: c[2] for i, c in enumerate(cases)}


@pytest.mark.slow
@pytest.mark.parametrize("bomb", [r"\boxed{9^{9^{9}}}", r"\boxed{\binom{1000000000}{500000000}}"])
def test_math_bounds_a_slow_answer_on_a_worker_thread(bomb):
    """An answer whose value sympy cannot compute in time (a power tower: a C-level big-integer
    power that holds the GIL) scores 0 within about timeout_seconds, from a thread too."""
    math_reward("", r"\boxed{1}", task("1"))  # warm a worker process up: its start is not the answer's time
    out = {}

    def call():
        t0 = time.monotonic()
        out["score"] = math_reward("", bomb, task("3"), timeout_seconds=4)
        out["s"] = time.monotonic() - t0

    math_reward.take_counters()  # what other tests in this process counted
    t = threading.Thread(target=call)
    t.start()
    t.join(60)
    assert out["score"] == 0.0 and out["s"] < 15, out
    assert math_reward.take_counters() == {"timeouts": 1}  # a 0 from the clock, not from the answer


@pytest.mark.slow
def test_math_counts_its_timeouts_as_a_parts_counter_and_warns_once(caplog):
    """math_verify swallows its own alarm and scores 0: the same as a wrong answer in the rewards.
    A part `math` counts such responses (reward/math/timeouts, since the last take), a wrong or
    right answer is not counted, and the first timeout is one warning naming the key to raise."""
    from rft.rewards.scoring import build
    import rft.rewards.verifiers as verifiers

    scorer = build([{"fn": "math", "args": {"timeout_seconds": 4}}], "test")  # 4 / 4: 1 s per comparison
    scorer.take_counters()
    verifiers._TIMEOUTS.warned = False
    with caplog.at_level("WARNING", logger="rft.rewards.verifiers"):
        # main thread: math_verify's alarm ends the comparison with 9^(9^(9^9)) after 1 s
        scores = scorer("", [r"\boxed{9^{9^{9^{9}}}}", r"\boxed{4}", r"\boxed{3}", r"\boxed{9^{9^{9^{9}}}}"], task("3"))
    assert [float(x) for x in scores] == [0.0, 0.0, 1.0, 0.0]
    assert scorer.take_counters() == {"reward/math/timeouts": 2}  # the two towers; the 4 is only wrong
    assert scorer.take_counters() == {"reward/math/timeouts": 0}
    warned = [r.getMessage() for r in caplog.records if "ran out of time" in r.getMessage()]
    assert warned == ["math reward: scoring a response ran out of time (timeout_seconds=4) and it scored 0, as a "
                      "wrong answer does; such responses are counted as reward/<part>/timeouts. If the count is not "
                      "small, give the part a longer time (args: {timeout_seconds: 30})."]


# ---------------------------------------------------------------- countdown

COUNTDOWN_CASES = [
    # (expression, numbers, target, reason, why)
    ("2+3*7", [2, 3, 7], 23, "ok", "precedence: 2+21"),
    ("(2+3)*7", [2, 3, 7], 35, "ok", "parentheses are allowed"),
    (" 7*3 + 2 ", [2, 3, 7], 23, "ok", "any order of the numbers, spaces allowed"),
    ("5+5-1", [5, 1, 5], 9, "ok", "a number given twice is used twice"),
    ("8/(3-8/3)", [8, 3, 8, 3], 24, "ok", "fractions in between are exact (8/3), as in TinyZero"),
    ("2+3", [2, 3, 7], 5, "wrong numbers", "all the numbers must be used"),
    ("2+3*3", [2, 3, 7], 11, "wrong numbers", "a number used twice (and 7 not at all)"),
    ("2+3*8", [2, 3, 7], 26, "wrong numbers", "a number that was not given (the teacher's mistake)"),
    ("23+7", [2, 3, 7], 30, "wrong numbers", "digits may not be glued into a new number"),
    ("2+3*7", [2, 3, 7], 35, "wrong value", "the right numbers but not the target"),
    ("7/(3-3)+2", [2, 3, 3, 7], 1, "division by zero", "division by zero is caught, not raised"),
    ("2**3+7", [2, 3, 7], 15, "malformed", "no powers"),
    ("7//3+2", [2, 3, 7], 4, "malformed", "no floor division"),
    ("-2+3*7", [2, 3, 7], 19, "malformed", "no unary minus"),
    ("2+3*7=23", [2, 3, 7], 23, "malformed", "the expression only, no equation"),
    ("2.0+3*7", [2, 3, 7], 23, "malformed", "integers only"),
    ("(2+3*7", [2, 3, 7], 23, "malformed", "unbalanced parentheses"),
    ("__import__('os')", [2, 3, 7], 23, "malformed", "anything else is refused before parsing"),
    ("07+3*2", [2, 3, 7], 13, "malformed", "a leading zero is not a Python integer"),
    ("", [2, 3, 7], 23, "empty", "an empty answer"),
    ("(" * 150 + "2" + ")" * 150 + "+3*7", [2, 3, 7], 23, "malformed", "longer than 200 characters"),
    # "malformed" before: a right answer scored 0 for its spelling
    ("2 +\r\n3*7", [2, 3, 7], 23, "ok", "a line break (CRLF) inside the expression"),
    ("2\t+3*7", [2, 3, 7], 23, "ok", "a tab"),
    ("2+3×7", [2, 3, 7], 23, "ok", "× is *"),
    ("(7\u22122)÷(3+2)", [2, 3, 7, 2], 1, "ok", "U+2212 is -, ÷ is /"),
    ("２+３*７", [2, 3, 7], 23, "ok", "full-width digits"),
    # held: the value and the numbers are checked as before
    ("2+3×8", [2, 3, 7], 26, "wrong numbers", "× does not let a number in that was not given"),
    ("2+3*7.", [2, 3, 7], 23, "malformed", "a trailing full stop (documented: the expression only)"),
    ("+2+3*7", [2, 3, 7], 23, "malformed", "no unary plus"),
    (" \r\n ", [2, 3, 7], 23, "empty", "a blank answer"),
]


@pytest.mark.parametrize("expression,numbers,target,reason,why", COUNTDOWN_CASES, ids=[c[4] for c in COUNTDOWN_CASES])
def test_countdown_cases(expression, numbers, target, reason, why):
    assert check_countdown(expression, numbers, target) == (float(reason == "ok"), reason), why


def test_countdown_integer_steps():
    # the TV game's rule, on request: 8/3 is not a whole number
    assert check_countdown("8/(3-8/3)", [8, 3, 8, 3], 24, integer_steps=True) == (0.0, "non-integer step")
    assert check_countdown("(8-2)/3*7", [8, 2, 3, 7], 14, integer_steps=True) == (1.0, "ok")


def test_countdown_reward_reads_the_row_and_answer_tags():
    t = task("2+3*7", numbers=[2, 3, 7], target=23)
    assert REWARD_FNS["countdown"] is countdown
    assert countdown("2,3,7->23", "7*3+2", t) == 1.0  # any solution, not only the stored one
    assert countdown("", "<think>...</think><answer>(3*7)+2</answer>", t) == 1.0
    assert countdown("", "2+3*8", t) == 0.0
    with pytest.raises(ValueError, match="'numbers' and 'target'"):
        countdown("", "2+3*7", task("2+3*7"))


def test_countdown_problems_are_all_solvable_and_unique():
    problems = countdown_problems()
    assert len(problems) == 1313
    for (numbers, target), answer in problems.items():
        assert check_countdown(answer, numbers, target, integer_steps=True) == (1.0, "ok")
        assert len(answer) == 5 and 1 <= target <= 99 and list(numbers) == sorted(numbers)


def test_countdown_problems_with_division_keep_only_whole_steps():
    """ops with / stopped on a bare AssertionError: a solution such as 1/2*4 (whole at the end,
    not on the way) was kept, against the docstring's rule, and failed the generator's own check."""
    problems = countdown_problems(ops="*/")
    # (1, 2, 4) -> 2: 1/2*4 is 2, but 1/2 is not whole; 4/2*1 is the kept solution (permutations
    # of the sorted numbers in order: (1,2,4): 1*2*4=8, 1/2.. skipped; (1,4,2): 1*4/2 = 2, whole)
    assert problems[((1, 2, 4), 2)] == "1*4/2"
    for (numbers, target), answer in problems.items():
        assert check_countdown(answer, numbers, target, integer_steps=True) == (1.0, "ok"), answer
    # every problem that + - * solve is kept with / added (242 more: 1313 + 242 = 1555)
    mixed = countdown_problems(ops="+-*/")
    assert len(mixed) == 1555 and set(countdown_problems()) <= set(mixed)


def read_splits(path):
    return {s: [json.loads(l) for l in (path / f"{s}.jsonl").read_text().splitlines()] for s in ("train", "test")}


def test_countdown_generator_answers_verify_and_the_teacher_errs_at_its_rate(tmp_path):
    rows = read_splits(generate_countdown(tmp_path / "countdown"))
    assert (len(rows["train"]), len(rows["test"])) == (1113, 200)
    key = lambda r: (tuple(sorted(r["numbers"])), r["target"])  # noqa: E731
    assert not {key(r) for r in rows["train"]} & {key(r) for r in rows["test"]}  # held out
    for split in rows.values():
        for r in split:
            t = SimpleNamespace(answer=r["answer"], row=r, task_id="t")
            assert countdown(r["question"], r["answer"], t) == 1.0
            assert check_countdown(r["rejected"], r["numbers"], r["target"])[1] == "wrong numbers"
            assert r["teacher_answer"] in (r["answer"], r["rejected"])
            # the prompt shows the numbers in the order of the stored solution, then the target
            assert r["question"] == countdown_prompt(r["numbers"], r["target"])
            assert r["answer"][::2] == "".join(map(str, r["numbers"]))
    teacher = [countdown("", r["teacher_answer"], SimpleNamespace(answer=None, row=r, task_id="t"))
               for r in rows["train"]]
    assert 0.55 < 1 - sum(teacher) / len(teacher) < 0.65  # teacher_error_rate 0.6


def test_countdown_generator_sorted_order_and_sizes(tmp_path):
    # the TV game's presentation: sorted numbers, the solution's order is the model's to find
    rows = read_splits(generate_countdown(tmp_path / "sorted", order="sorted", n_train=100, n_test=20))
    assert (len(rows["train"]), len(rows["test"])) == (100, 20)
    for r in rows["train"]:
        assert r["numbers"] == sorted(r["numbers"])
        assert check_countdown(r["answer"], r["numbers"], r["target"]) == (1.0, "ok")
    with pytest.raises(ConfigError, match="only 1313"):
        generate_countdown(tmp_path / "too_many", n_train=2000)


def test_countdown_prompts_and_answers_fit_the_tiny_model():
    """The tiny model's budget (conf/model/tiny.yaml): 24 prompt tokens (5 of them the chat
    template), 6 response tokens (5 characters and the end-of-sequence token)."""
    assert countdown_prompt([8, 2, 3], 3) == "8,2,3->3"  # commas: no spaces, a token fewer each
    problems = countdown_problems()
    assert max(len(countdown_prompt(numbers, target)) for numbers, target in problems) + 5 <= 24
    assert max(len(a) for a in problems.values()) + 1 <= 6


# ---------------------------------------------------------------- last_number

LAST_NUMBER_CASES = [
    # (reference, response, score, why)
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "So she sold 72 clips.", 1.0, "a GSM8K reference: the number after ####"),
    ("#### 72", "48 + 24 = 72", 1.0, "the response's last number"),
    ("#### 72", "72 clips, since 48 + 24", 0.0, "... and only its last number"),
    ("#### 1,234", "The total is 1234.", 1.0, "a thousands comma in the reference"),
    ("#### 1234", "The total is $1,234.", 1.0, "and in the response"),
    ("#### -5", "The temperature fell to -5 degrees.", 1.0, "a negative number"),
    ("#### 5", "The temperature fell to -5 degrees.", 0.0, "the sign counts"),
    ("#### 2.5", "It takes 2.50 hours.", 1.0, "decimals compare as numbers"),
    ("#### 3", "3.0", 1.0, "an integer and its decimal form are equal"),
    ("#### 3", "3.5", 0.0, "a decimal is not cut to its integer part"),
    ("#### 42", "I do not know.", 0.0, "a response without a number scores 0"),
    ("no number here", "42", 0.0, "a reference without a number matches nothing"),
    (42, "42", 1.0, "a number as the reference"),
    # measured before the fix: both read as the float 1.2345678901234568e16, a reward of 1.0 for a wrong answer
    ("#### 12345678901234567", "12345678901234568", 0.0, "numbers past 2**53 compare exactly"),
    ("#### 100", "1" + "0" * 1_000_000, 0.0, "a million digits are a number, not an overflow (0.004 s)"),
    # hostile spellings (rft/rewards/numbers.py). Down to "the number is 7" each scored the other way before:
    # the old reader took the digits after the last non-digit ("1e16" -> 16, ".5" -> 5, "−5" -> 5, "1/2" -> 2)
    ("#### 10000000000000000", "about 1e16", 1.0, "scientific notation is one number: 1e16 = 10**16"),
    ("#### 16", "about 1e16", 0.0, "... not its exponent"),
    ("#### 1500", r"1.5 \times 10^{3}", 1.0, "scientific notation as LaTeX writes it"),
    ("#### -3", "so 10^{-3}", 0.0, "a power is its value (0.001), not its exponent"),
    ("#### 1024", "2^10", 1.0, "a power of integers is its value"),
    ("#### 0.5", "It is .5", 1.0, "a leading point: .5 is 0.5"),
    ("#### 5", "It is .5", 0.0, "... not 5"),
    ("#### -5", "It fell to \u22125.", 1.0, "U+2212 MINUS SIGN is a minus"),
    ("#### 5", "It fell to \u22125.", 0.0, "... so -5 is not 5"),
    ("#### 0.5", "1/2", 1.0, "a fraction is its value"),
    ("#### 2", "1/2", 0.0, "... not its denominator"),
    ("#### 1.5", "1 1/2 cups", 1.0, "a mixed number (the old reader: 2; the fraction alone: 0.5)"),
    ("#### 3.5", "3 7/2", 1.0, "... only with a proper fraction: 3 7/2 is 3, then 7/2"),
    ("#### 1000", "1\u202f000", 1.0, "thousands grouped by a narrow no-break space (SI)"),
    ("#### 123", "1,2,3", 0.0, "commas between groups that are not of three digits separate numbers (was 123)"),
    ("#### -7", "pages 5-7", 0.0, "a minus right after a digit is a range or a subtraction, not a sign (was -7)"),
    ("#### 7", "pages 5-7", 1.0, "... the number is 7"),
    # conventions that held, now written down, and the bounds
    ("#### 5", "\uff15", 1.0, "full-width digits are digits, as int() reads them"),
    ("#### 5", "\u0665", 1.0, "Arabic-Indic digits too"),
    ("#### 0", "-0", 1.0, "-0 is 0"),
    ("#### 5", "+5\r\n", 1.0, "a plus sign, CRLF"),
    ("#### 5", "The answer is 5.", 1.0, "a full stop after the number"),
    ("#### 2", "multiply by x2", 1.0, "a number inside a word counts (documented)"),
    ("#### 1000", "1 000", 0.0, "a plain space separates two numbers: 1 and 000 (documented)"),
    ("#### 123456", "1,23,456", 1.0, "the Indian grouping of thousands and lakhs"),
    ("#### 1234567.5", "12,34,567.5", 1.0, "... with a decimal part"),
    ("#### 0", "nan", 0.0, "nan and inf are not numbers"),
    ("#### 0", " \r\n\t", 0.0, "a blank response has no number"),
    ("#### 1", "1/0", 0.0, "a fraction over zero is no number"),
    # too large to work with: no number, at once (9^99999999 has 95 million digits; 10**16 digits below)
    ("#### 9", "9^99999999", 0.0, "a power of over 10,000 digits is no number"),
    ("#### 1", "1e99999999999999999", 0.0, "an exponent over 10**15 is no number"),
    ("#### 1", "1/" + "3" * 1_000_000, 0.0, "a fraction with a side of over 10,000 digits is no number"),
    ("#### 1", "1e1" + "0" * 1_000_000, 0.0, "an exponent of a million digits is no number, not a MemoryError"),
    # found by fuzzing the reader (random strings of digits, signs, letters): each raised
    ("#### 5", "1ea5", 1.0, "a letter breaks an exponent (it raised ValueError: [+-−] was a range from + to −)"),
    ("#### -47", "\uff0d47E7478300", 0.0, "a negative number of a large exponent (negating it overflowed the default context)"),
]


@pytest.mark.parametrize("reference,response,score,why", LAST_NUMBER_CASES, ids=[c[3] for c in LAST_NUMBER_CASES])
def test_last_number_cases(reference, response, score, why):
    assert last_number("", response, task(reference)) == score, why


# ---------------------------------------------------------------- the math task's config


MATH_ROWS = [
    {"problem": "What is $1+1$?", "solution": r"We add: $1+1=\boxed{2}$.", "level": "Level 1", "type": "Prealgebra"},
    {"problem": "Simplify $\\frac{2}{4}$.", "solution": r"Divide both by 2: $\boxed{\frac{1}{2}}$.",
     "level": "Level 1", "type": "Prealgebra"},
    {"problem": "Solve $2x=6$.", "solution": r"So $x=\boxed{3}$.", "level": "Level 2", "type": "Algebra"},
    {"problem": "Simplify $\\sqrt{8}$.", "solution": r"$\sqrt{8}=\sqrt{4\cdot 2}=\boxed{2\sqrt{2}}$.",
     "level": "Level 2", "type": "Algebra"},
]
MATH_RESPONSES = [r"\boxed{2}", r"\boxed{0.5}", r"x = \boxed{3}", r"\boxed{\sqrt{8}}"]


def test_math_task_reads_a_local_math_file_and_its_reward_scores_the_rows(tmp_path, monkeypatch):
    data = tmp_path / "math"
    data.mkdir()
    for split, rows in {"train": MATH_ROWS[:3], "test": MATH_ROWS[3:]}.items():
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv("RFT_MATH_PATH", str(data))
    cfg = compose_cfg(["task=math"])
    ei = cfg.buffer.explorer_input
    assert ei.default_reward_fn_type == "math" and ei.generator is None
    tasks = load_tasks(ei.taskset, "buffer.explorer_input.taskset")
    (test_task,) = load_tasks(ei.eval_tasksets[0], "buffer.explorer_input.eval_tasksets[0]")
    assert [t.answer for t in tasks + [test_task]] == [r["solution"] for r in MATH_ROWS]
    system, user = tasks[0].messages
    assert system["role"] == "system" and r"\boxed{}" in system["content"]
    assert user == {"role": "user", "content": "What is $1+1$?"}
    assert tasks[0].row["level"] == "Level 1" and tasks[0].row["type"] == "Prealgebra"
    reward = REWARD_FNS[ei.default_reward_fn_type]
    for t, right in zip(tasks + [test_task], MATH_RESPONSES):
        assert reward(t.messages[-1]["content"], right, t) == 1.0
        assert reward(t.messages[-1]["content"], r"\boxed{7}", t) == 0.0


# ---------------------------------------------------------------- hostile responses

class Scanned(str):
    """A response that counts the characters its `find` calls pass over."""

    scanned = 0

    def find(self, sub, start=0, *rest):
        i = str.find(self, sub, start, *rest)
        Scanned.scanned += (len(self) if i < 0 else i + len(sub)) - start
        return i


def test_the_answer_tag_is_found_in_one_pass_over_the_response():
    """countdown's `<answer>(.*?)</answer>` regex scanned to the end from every unclosed tag: 100 KB of
    them took 4.4 s, 400 KB 75 s, in the explorer's process with the GIL held. `last_tagged` passes
    over each character at most twice, and finds what the regex found."""
    import re

    from rft.rewards.verifiers import countdown_answer, last_tagged

    for text in ["<answer>1+2</answer>", "a<answer>1</answer>b<answer>2</answer>c", "<answer>1</answer><answer>2",
                 "<answer><answer>3</answer>", "<answer>\n4\n</answer>", "</answer><answer>", "none", ""]:
        tags = re.findall(r"<answer>(.*?)</answer>", text, re.S)
        assert countdown_answer(text) == (tags[-1] if tags else text), text
    bomb = Scanned("<answer>" * 12_500)  # 100 KB
    Scanned.scanned = 0
    assert last_tagged(bomb) is None and countdown(None, bomb, task(None, numbers=[1, 2], target=3)) == 0.0
    assert Scanned.scanned <= 2 * len(bomb)


def run_confined(code: str, walls: str) -> dict:
    """`code` (setting `out`) in a fresh interpreter behind `walls`: the syscall filter alone, or all of confine()."""
    import subprocess
    import sys

    start = ("from rft.rewards.workers import _syscall_filter; _syscall_filter().load()" if walls == "kernel"
             else "from rft.rewards.workers import confine; confine()")
    prog = f"import json, os, socket, sys, threading\n{start}\nout = {{}}\n{code}\nsys.stderr.write(json.dumps(out))"
    p = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=60)
    return json.loads(p.stderr.strip().splitlines()[-1])


def attempt(name: str, what: str) -> str:
    # the hook's refusal is a PermissionError too (rft.rewards.workers.Refused)
    return (f"try:\n    {what}\n    out[{name!r}] = 'done'\nexcept Exception as e:\n"
            f"    out[{name!r}] = 'PermissionError' if isinstance(e, PermissionError) else type(e).__name__\n")


ESCAPES = [("exec", "os.execv('/bin/true', ['true'])"), ("fork", "os.fork() or os._exit(0)"),
           ("socket", "socket.socket()"), ("write", "open('/tmp/rft-confined-' + str(os.getpid()), 'w')"),
           ("signal", "os.kill(os.getppid(), 0)")]


@pytest.mark.parametrize("walls", ["kernel", "all"])
def test_a_scoring_child_cannot_exec_fork_connect_write_or_signal(walls):
    """The walls of a scoring child (rft/rewards/workers.py), each alone: the syscall filter refuses
    what got past the audit hook (EPERM: PermissionError); a thread still starts and a file still reads."""
    code = "".join(attempt(n, w) for n, w in ESCAPES)
    code += attempt("thread", "t = threading.Thread(target=int); t.start(); t.join()")
    code += attempt("read", "open(os.__file__).read(10)")
    out = run_confined(code, walls)
    assert out == {**{n: "PermissionError" for n, _ in ESCAPES}, "thread": "done", "read": "done"}


def test_a_scoring_child_compiles_expressions_only():
    """The audit hook's rule for code a scorer compiles from the model's text: literals, names and
    calls of names (a list answer, what parse_expr makes of `2*x + 1`), nothing that reaches an
    attribute, a private or refused name, or a statement."""
    from rft.rewards.workers import safe_source

    for ok in ["[1, 2, 3]", "Integer (2 )*Symbol ('x' )+Integer (1 )", "{'a': (1, -2.5)}", "sin(x) ** 2 < 1",
               b"['A', 'B']", "1 +"]:
        assert safe_source(ok), ok
    for bad in ["__import__('os')", "().__class__", "x[0]", "lambda: 1", "import os", "getattr(x, 'y')",
                "open('f', 'w')", "breakpoint()", "[c for c in x]", "f(x)(y)", "_x", "print(1)"]:
        assert not safe_source(bad), bad


def test_the_number_reader_never_raises_and_spells_each_value_one_way():
    """Seeded random strings of digits, signs, separators, exponents, powers and letters: last_value
    never raises (it raised ValueError and decimal.Overflow on two such strings), two values are
    equal exactly when their spellings are (the vote joins what the reward calls equal), and a plain
    spelling reads back as its value."""
    import random

    from rft.rewards.numbers import equal, last_value, spelling

    pieces = list("0123456789" * 3) + list("-+.,/^{}eExX* a\u2212\uff0d\u202f\u0665\uff15\u00d7\\") + [
        "\\times", "10^", "e-", "/0", "\r\n", "e999999999999999", "^99999", "^{-9}"]
    rng = random.Random(0)
    read = []
    for _ in range(5000):
        s = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        value = last_value(s)
        if value is not None:
            read.append((s, value, spelling(value)))
    assert len(read) > 4000  # most strings hold a number: the checks below are not vacuous
    for s, value, spelt in read[:150]:
        for t, other, other_spelt in read[:150]:
            assert equal(value, other) == (spelt == other_spelt), (s, t)
        if "e" not in spelt and "/" not in spelt:
            assert equal(last_value(spelt), value), (s, spelt)
