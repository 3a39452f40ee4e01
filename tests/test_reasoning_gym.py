"""task=reasoning_gym: reasoning-gym's datasets by name and in weighted mixes, generated from our
seed and sizes into a directory named by the section, scored by each dataset's own score_answer."""

import json
import sys
from pathlib import Path

import pytest
from conftest import compose_cfg
from omegaconf import OmegaConf

from rft.data.reasoning_gym import dir_name, write
from rft.data.tasks import Task, ensure_task_data
from rft.errors import ConfigError
from rft.rewards.reasoning_gym import reasoning_gym as reward

pytest.importorskip("reasoning_gym", reason="pip install -e '.[reasoning-gym]' (make test does)")

KEY = "buffer.explorer_input.reasoning_gym"
ADD = {"name": "basic_arithmetic", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                                              "operators": ["+"], "allow_parentheses": False, "allow_negation": False}}
SPELL = {"name": "spell_backward", "config": {"min_word_len": 3, "max_word_len": 5}}
CHAIN = {"name": "chain_sum", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}
MIX = [dict(ADD, weight=2.0), dict(SPELL, weight=1.0), dict(CHAIN, weight=1.0)]


def rows(path, split):
    return [json.loads(line) for line in (path / f"{split}.jsonl").read_text().splitlines()]


def task_of(row: dict) -> Task:
    return Task("t/0", [{"role": "user", "content": row["question"]}], row["answer"], row)


def test_the_same_section_gives_the_same_bytes_and_another_seed_other_rows(tmp_path):
    section = {"datasets": [SPELL], "size": 300, "eval_size": 50, "seed": 0}
    a, b = write(tmp_path / "a", section), write(tmp_path / "b", section)
    for split in ("train", "test"):
        assert (a / f"{split}.jsonl").read_bytes() == (b / f"{split}.jsonl").read_bytes()
    train, test = rows(a, "train"), rows(a, "test")
    assert (len(train), len(test)) == (300, 50)
    assert len({r["question"] for r in test}) == 50  # distinct, and none of them trained on
    assert not {r["question"] for r in test} & {r["question"] for r in train}
    # reasoning-gym's seed s + 1 gives seed s's rows shifted by one (item idx from Random(seed + idx)):
    # its seeds 0 and 1 share 299 of 300 rows. Ours are spread first: seed 1 shares 6 words with seed 0
    other = rows(write(tmp_path / "c", {**section, "seed": 1}), "train")
    assert len({r["question"] for r in other} & {r["question"] for r in train}) == 6


@pytest.mark.slow  # composes (and writes) the config
def test_the_directory_is_named_by_the_section():
    base = {"datasets": [SPELL], "size": 300, "eval_size": 50, "seed": 0}
    names = {dir_name(base), dir_name({**base, "seed": 1}), dir_name({**base, "size": 301}),
             dir_name({**base, "eval_size": 51}), dir_name({**base, "datasets": [dict(SPELL, weight=2.0)]}),
             dir_name({**base, "datasets": [ADD]}), dir_name({**base, "datasets": [SPELL, ADD]}),
             dir_name({**base, "datasets": [{"name": "spell_backward", "config": {"min_word_len": 4}}]})}
    assert len(names) == 8 and all(n.startswith("reasoning-gym-") and len(n) == 14 + 12 for n in names)
    assert dir_name(base) == dir_name(dict(base))  # the same section, the same name
    # the composed task names its path the same way, from the section's resolved value
    cfg = compose_cfg(["task=reasoning_gym", f"{KEY}.seed=3"])
    inp = cfg.buffer.explorer_input
    assert inp.taskset.path.endswith("/data/" + dir_name(inp.reasoning_gym))
    assert inp.eval_tasksets[0].path == inp.taskset.path
    assert compose_cfg(["task=reasoning_gym"]).buffer.explorer_input.taskset.path != inp.taskset.path


def test_a_weighted_mix_draws_each_dataset_by_its_weight(tmp_path):
    """Weights 2:1:1 over 1000 training rows: expected 500, 250, 250 (binomial sd 15.8, 13.7, 13.7);
    seed 0 draws 498, 244, 258, fixed by the seed (reasoning-gym's CompositeDataset draws). Datasets
    of many problems: a held-out question is drawn again rarely, so no training row is left out."""
    mix = [{"name": "spell_backward", "weight": 2.0}, {"name": "chain_sum"}, {"name": "gcd"}]
    train = rows(write(tmp_path / "mix", {"datasets": mix, "size": 1000, "eval_size": 30}), "train")
    counts = {name: sum(r["dataset"] == name for r in train) for name in ("spell_backward", "chain_sum", "gcd")}
    assert counts == {"spell_backward": 498, "chain_sum": 244, "gcd": 258}


def test_each_dataset_scores_with_its_own_scorer(tmp_path):
    train = rows(write(tmp_path / "mix", {"datasets": MIX, "size": 200, "eval_size": 20}), "train")
    first = {name: next(r for r in train if r["dataset"] == name) for name in ("basic_arithmetic", "spell_backward", "chain_sum")}
    # every row's own answer scores 1.0 after its entry's trip through JSON
    assert all(reward("", r["answer"], task_of(r)) == 1.0 for r in train)
    add = task_of(first["basic_arithmetic"])
    a = add.answer  # the default scorer: exact 1.0; the answer inside a longer one len(a)/len(response)
    assert reward("", f"<answer>{a}</answer>", add) == 1.0  # the last <answer> tag, when there is one
    assert reward("", str(int(a) + 1), add) == 0.0
    assert reward("", "1" + a, add) == pytest.approx(len(a) / (len(a) + 1))
    spell = task_of(first["spell_backward"])
    word = spell.answer
    assert reward("", word.upper(), spell) == 1.0  # spell_backward's scorer ignores case
    # one letter wrong at the end: the letters right in place, 1/len each
    assert reward("", word[:-1] + "#", spell) == pytest.approx((len(word) - 1) / len(word))
    chain = task_of(first["chain_sum"])
    assert reward("", "+0" + chain.answer + ".00", chain) == 1.0  # chain_sum's: a sign, leading zeros, decimals
    assert reward("", str(int(chain.answer) + 1), chain) == 0.0
    assert reward("", chain.answer + "1", chain) == pytest.approx(len(chain.answer) / (len(chain.answer) + 1))


def test_a_misspelt_dataset_is_one_paragraph_with_the_close_names(tmp_path):
    cfg = compose_cfg(["task=reasoning_gym", f"checkpoint_root_dir={tmp_path}",
                       f"{KEY}.datasets=[{{name: basic_arithmetc}}]"])
    with pytest.raises(ConfigError) as e:
        ensure_task_data(cfg.buffer.explorer_input)
    assert str(e.value) == (
        f"{KEY}.datasets.0.name='basic_arithmetc' is not a reasoning-gym dataset. Did you mean 'basic_arithmetic' or "
        f"'bitwise_arithmetic' or 'decimal_arithmetic'? "
        f"Its 106 datasets are listed by `python -c \"import reasoning_gym; print(sorted(reasoning_gym.factory.DATASETS))\"`; "
        f"set {KEY}.datasets.0.name to one of them.")
    with pytest.raises(ConfigError, match=r"datasets.0.config has \['max_digit'\], which basic_arithmetic's config "
                                          r"\(BasicArithmeticDatasetConfig\) does not take; its keys are \['min_terms'"):
        write(tmp_path / "x", {"datasets": [{"name": "basic_arithmetic", "config": {"max_digit": 2}}]})
    with pytest.raises(ConfigError, match=r"reasoning-gym rejects basic_arithmetic's config \{'min_digits': 3, "
                                          r"'max_digits': 1\} \(AssertionError: max_digits must be >= min_digits\)"):
        write(tmp_path / "x", {"datasets": [{"name": "basic_arithmetic", "config": {"min_digits": 3, "max_digits": 1}}]})
    with pytest.raises(ConfigError, match=r"datasets.0.config sets \['seed'\]: the rows' seed and count are"):
        write(tmp_path / "x", {"datasets": [{"name": "gcd", "config": {"seed": 3}}]})
    with pytest.raises(ConfigError, match=r"datasets is empty: name at least one"):
        write(tmp_path / "x", {"datasets": []})
    # 121 additions of 0..10 cannot hold 100 held out and 400 training rows beside them... they can
    # (training rows repeat); 130 distinct held-out questions cannot be drawn from 121
    with pytest.raises(ConfigError, match=r"too few for eval_size=130 held out and size=10 rows beside them"):
        write(tmp_path / "x", {"datasets": [ADD], "size": 10, "eval_size": 130})


def test_a_split_of_more_rows_than_can_be_generated_is_one_paragraph_before_any_is(tmp_path):
    # size=10**12: the dry run generated rows into a list for ever (every row is made before the run starts)
    with pytest.raises(ConfigError) as e:
        write(tmp_path / "x", {"datasets": [ADD], "size": 10**12})
    assert str(e.value) == (
        f"{KEY}.size=1000000000000, .eval_size=200: at most 1000000 rows a split. The rows are generated before the "
        f"run starts and held in memory while written (~600 bytes each: a million is ~0.6 GB and minutes of "
        f"generating). Lower them to what the run reads: a step reads buffer.batch_size rows of the train split.")
    assert not (tmp_path / "x").exists()  # refused before anything was written
    with pytest.raises(ConfigError, match=r"size=10, .eval_size=1000001: at most 1000000 rows a split"):
        write(tmp_path / "x", {"datasets": [ADD], "size": 10, "eval_size": 10**6 + 1})


def test_the_missing_package_names_the_extra(monkeypatch):
    from rft.rewards.reasoning_gym import library

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym raises ImportError
    with pytest.raises(ConfigError, match=r"needs the reasoning-gym package, which is not installed here .*Install "
                                          r"the project's extra: pip install -e '\.\[reasoning-gym\]'"):
        library()


def test_a_path_of_another_section_is_not_reused(tmp_path):
    cfg = compose_cfg(["task=reasoning_gym", f"checkpoint_root_dir={tmp_path}", f"{KEY}.size=20", f"{KEY}.eval_size=5"])
    inp = cfg.buffer.explorer_input
    stale = tmp_path / "reasoning-gym-000000000000"
    stale.mkdir()
    OmegaConf.update(cfg, "buffer.explorer_input.taskset.path", str(stale))
    with pytest.raises(ConfigError, match=r"is reasoning-gym data of another buffer.explorer_input.reasoning_gym "
                                          r"than this run's \(which writes 'reasoning-gym-[0-9a-f]{12}'\)"):
        ensure_task_data(inp)


@pytest.mark.slow  # composes (and writes) the config
def test_the_study_fits_the_tiny_model(tmp_path):
    """experiment=reasoning_gym: every prompt and answer within the tiny model's budgets and
    characters (one token a character, spaces included, 5 tokens of chat template)."""
    import string

    cfg = compose_cfg(["experiment=reasoning_gym"])
    data = write(tmp_path / "spell", cfg.buffer.explorer_input.reasoning_gym)
    every = rows(data, "train") + rows(data, "test")
    known = set(string.ascii_letters + string.digits + string.punctuation)
    assert all(set(r["question"]) <= known | {" "} and set(r["answer"]) <= known for r in every)
    # "Spell this word backward (example: sun -> nus): " is 48 characters (8 spaces), the word 3..5
    assert max(len(r["question"]) for r in every) + 5 == 58 == cfg.model.max_prompt_tokens
    assert max(len(r["answer"]) for r in every) == 5 == cfg.model.max_response_tokens - 1  # and end-of-sequence
    # the sloppy teacher: 60% of demonstrations end one letter too high
    assert sum(r["teacher_answer"] != r["answer"] for r in every) / len(every) == pytest.approx(0.6, abs=0.03)


@pytest.mark.slow
def test_three_datasets_plan_and_a_weighted_mix_of_them_trains_a_step(tmp_path, capsys):
    """Each of three datasets alone plans (a dry run: the data is generated and checked); their
    2:1:1 mix trains one GRPO step on the tiny model (no warm-up) and evaluates per dataset."""
    import rft.runtime.main
    from rft.reporting.monitor import read_metrics

    base = ["task=reasoning_gym", f"checkpoint_root_dir={tmp_path}", "stages=[]", "model.max_prompt_tokens=64",
            f"{KEY}.size=40", f"{KEY}.eval_size=20"]
    for spec in (ADD, SPELL, CHAIN):
        one = json.dumps([spec]).replace('"', "")
        assert rft.runtime.main._main(compose_cfg([*base, "dry_run=true", f"{KEY}.datasets={one}"])) is None
        assert "reward         reasoning_gym(prompt, response, task)" in capsys.readouterr().out
    mix = json.dumps(MIX).replace('"', "")
    cfg = compose_cfg([*base, f"{KEY}.datasets={mix}", "cluster=inline", "monitor=console", "buffer.batch_size=4",
                       "algorithm.repeat_times=2", "buffer.total_steps=1", "explorer.eval_interval=1"])
    rft.runtime.main.main(cfg)
    metrics = read_metrics(tmp_path / "rft" / cfg.name / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1]
    assert 0.0 <= metrics[1]["reward/mean"] <= 1.0
    # the eval set's metrics per dataset (its group_by: dataset), whose means make the whole set's
    test = rows(Path(cfg.buffer.explorer_input.taskset.path), "test")
    counts = {n: sum(r["dataset"] == n for r in test) for n in ("basic_arithmetic", "spell_backward", "chain_sum")}
    assert counts == {"basic_arithmetic": 13, "spell_backward": 5, "chain_sum": 2}  # seed 0's draw of 2:1:1
    per = {n: metrics[1][f"eval/reasoning_gym_test/dataset={n}/mean@1"] for n in counts}
    assert sum(counts[n] * per[n] for n in per) / len(test) == pytest.approx(metrics[1]["eval/accuracy"])


def entry_task(name: str) -> Task:
    """Task 0 of reasoning-gym's `name` (seed 1), as a row of task=reasoning_gym carries it."""
    from rft.rewards.reasoning_gym import make_dataset

    entry = make_dataset(name, {"seed": 1, "size": 1}, "test")[0]
    return task_of({"question": entry["question"], "answer": entry["answer"], "dataset": name,
                    "entry": json.dumps(entry, default=str), "dataset_config": json.dumps({"seed": 1, "size": 1})})


def test_an_answer_a_scorer_evaluates_runs_nothing_and_forges_no_score(tmp_path):
    """spiral_matrix's score_answer passes the answer to eval, puzzle24's and countdown's to sympy's
    parse_expr (an eval too): measured before the fix, each created the file below from the
    explorer's process. Scored in the confined child, they run nothing, score as a wrong answer of
    their dataset (puzzle24 and countdown give 0.01 to any answer), and an answer that writes a
    score line of its own does not become the reward (nor shift the next one)."""
    pwned = tmp_path / "pwned"
    attacks = [f"__import__('os').system('touch {pwned}')", f"open('{pwned}', 'w').write('x')",
               "__import__('os').write(1, b'{\"score\": 1.0}\\n')", "breakpoint()", "[].__class__.__base__"]
    for name, wrong in [("spiral_matrix", 0.0), ("puzzle24", 0.01), ("countdown", 0.01)]:
        t = entry_task(name)
        assert [reward("", f"<answer>{a}</answer>", t) for a in attacks] == [wrong] * len(attacks), name
        assert reward("", f"<answer>{t.answer}</answer>", t) == 1.0
    assert not pwned.exists()


@pytest.mark.slow
def test_a_power_tower_scores_0_and_the_next_answer_scores_as_before():
    """`9**9**9**9` through countdown's parse_expr (sympy's exact integers) held the explorer's
    process, GIL included, for good; in the child it is killed at timeout_seconds and scores 0, and
    a new child scores the next answer."""
    t = entry_task("countdown")
    assert reward("", "<answer>9**9**9**9</answer>", t, timeout_seconds=1) == 0.0
    assert reward("", f"<answer>{t.answer}</answer>", t) == 1.0


def test_the_answer_tag_is_read_as_reasoning_gym_reads_it():
    """answer_of finds what extract_answer's regex finds (the last non-overlapping
    <answer>...</answer>, stripped), in one pass: the regex took seconds per 100 KB of unclosed tags."""
    from reasoning_gym.utils import extract_answer

    from rft.rewards.reasoning_gym import answer_of

    for text in ["<answer> 7 </answer>", "<answer>1</answer> <answer>2</answer>", "<answer>1</answer><answer>2",
                 "<answer><answer>3</answer>", "<answer>a\nb</answer>x", "</answer><answer>", "<answer></answer>",
                 "no tag", "<answer>4</answer></answer>"]:
        tagged = extract_answer(text)
        assert answer_of(text) == (tagged if tagged is not None else text.strip()), text
