"""A new user's study from the README alone (experiments/word_sort/): a task of the study's own
(sort three or four letters, data written by its prepare.py), a partial-credit reward of its own by
dotted path, RLOO after the tiny model's SFT warm-up, a local sweep over the reward's argument, a
run stopped by SIGTERM and resumed. Each test is a defect that study met, or a promise it checked."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from conftest import ROOT, compose_cfg, load_script, run_cli
from rft.plan.batch import make_plan, stage_configs
from rft.rewards.scoring import describe
from rft.runtime import main

STUDY = ROOT / "experiments" / "word_sort"
PARTIAL = "buffer.explorer_input.taskset.reward_fn.0.args.partial"


def _prepare():
    return load_script("experiments/word_sort/prepare.py", "word_sort_prepare")


def _credit():
    return load_script("experiments/word_sort/rewards.py", "word_sort_rewards").sorted_credit


@pytest.fixture(scope="module")
def data(cache_dir):
    """prepare.py's data where the study's task file reads it: ${cache_dir}/data/word_sort."""
    return _prepare().write_data(cache_dir / "data" / "word_sort")


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_prepared_data_is_what_the_study_reads(tmp_path):
    train, test = (_rows(_prepare().write_data(tmp_path) / f"{s}.jsonl") for s in ("train", "test"))
    assert (len(train), len(test)) == (400, 100)
    # seed 0's first row, by hand: the letters g a e h sorted are a e g h; the teacher swapped the last two
    assert train[0] == {"letters": "sort gaeh", "ordered": "aegh", "teacher_answer": "aehg"}
    assert all(r["ordered"] == "".join(sorted(r["letters"][5:])) for r in train + test)
    # held out: no test prompt is a training prompt
    assert not {r["letters"] for r in train} & {r["letters"] for r in test}
    # the sloppy teacher: wrong in about half of the rows (197 of 400), always by the last two letters
    wrong = [r for r in train if r["teacher_answer"] != r["ordered"]]
    assert len(wrong) == 197
    assert all(r["teacher_answer"] == r["ordered"][:-2] + r["ordered"][:-3:-1] for r in wrong)


def test_the_studys_reward_gives_hand_computed_values():
    credit, task = _credit(), SimpleNamespace(answer="abcd")
    assert credit("p", " abcd\n", task) == 1.0  # the letters in order, whitespace around them aside
    assert credit("p", "abdc", task) == 0.25  # 2 of 4 positions right: 0.5 x 2/4
    assert credit("p", "abdc", task, partial=0.0) == 0.0  # the eval's: exact answers only
    assert credit("p", "dcba", task) == 0.0  # no position right
    assert credit("p", "abc", task) == 0.0  # another length: not the same letters
    assert credit("p", "bacd", SimpleNamespace(answer="abcd"), partial=0.25) == 0.125  # 0.25 x 2/4


@pytest.mark.parametrize("sweep", [False, True])
def test_a_misspelt_reward_argument_override_names_the_arguments_the_part_lists(sweep, data):
    """`...reward_fn.0.args.partail=0.0` (partial misspelt) ended in Hydra's "Key 'partail' is not in
    struct" with its advice to add it with `+` (exit 1), which only moved the error to the plan; a
    sweep printed the same after a UserWarning of Hydra's callback. Now one paragraph (exit 2)."""
    key = PARTIAL.replace("partial", "partail")
    value = "0.0,0.5" if sweep else "0.0"
    r = run_cli(*(["-m"] if sweep else []), "experiment=word_sort", "dry_run=true", f"{key}={value}")
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip() == (
        f"rft: configuration error: {key}={value}: part 0 of buffer.explorer_input.taskset.reward_fn "
        f"(experiments.word_sort.rewards.sorted_credit) lists args ['partial'], not 'partail' (Hydra: Key 'partail' "
        f"is not in struct). Did you mean partial (not partail)? Fix the name; an argument of the function that the "
        f"part does not list yet is added with a plus, +{key}={value} (checked against the function's signature "
        f"when planning).")


def test_a_misspelt_argument_of_a_reward_given_as_one_part_is_the_same_paragraph(data):
    # the study's eval set gives its reward as one dict, {fn: ..., args: {partial: 0.0}}: no index
    key = "buffer.explorer_input.eval_tasksets.0.reward_fn.args.parial"
    r = run_cli("experiment=word_sort", "dry_run=true", f"{key}=0.0")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "buffer.explorer_input.eval_tasksets.0.reward_fn (experiments.word_sort.rewards.sorted_credit) lists " \
           "args ['partial'], not 'parial'" in r.stderr
    assert "Did you mean partial (not parial)?" in r.stderr


@pytest.mark.slow  # 2.2 s alone, over the fast tier's second
def test_the_dry_run_shows_the_reward_arguments_a_sweep_varies(data):
    """The dry run's reward line said `1 * experiments.word_sort.rewards.sorted_credit` whatever
    `reward_fn.0.args.partial` was, so a sweep's override could not be seen to reach it; a reward
    given as one dict was Python's repr of it, with a remote reward's token in clear."""
    r = run_cli("experiment=word_sort", "dry_run=true", f"{PARTIAL}=0.25")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {line[:15].strip(): line[15:] for line in r.stdout.splitlines() if line[:15].strip()}
    fn = "experiments.word_sort.rewards.sorted_credit"
    assert rows["reward"] == (f"1 * {fn} (args: partial=0.25), each fn(prompt, response, task), with task.answer = "
                              f"column 'ordered'")
    assert rows["eval sets"].endswith(f"split test): 1 * {fn} (args: partial=0.0), every 10 steps")
    # a secret among the args is masked, as the trackers and the saved config mask it
    remote = {"fn": "remote", "args": {"url": "http://127.0.0.1:8000", "token": "s3cret"}}
    assert describe(remote) == "1 * remote (args: url='http://127.0.0.1:8000', token='***')"
    assert describe([{"fn": "exact_match"}, {"fn": "format", "weight": 0.1}]) == "1 * exact_match + 0.1 * format"
    assert describe("exact_match") == "exact_match"


def _keys(*overrides):
    stages = stage_configs(compose_cfg(["experiment=word_sort", *overrides]))
    return main.cache_keys(stages, [make_plan(s, 400) for s in stages])


@pytest.mark.slow  # 1.4 s alone, over the fast tier's second
def test_a_sweep_over_the_rl_reward_shares_the_sft_warm_up(data):
    """`-m hydra/launcher=local experiment=word_sort ...reward_fn.0.args.partial=0.0,0.5` trained
    the same SFT warm-up in both jobs at once (two stage-cache keys): the warm-up's key held the
    taskset's reward, which a stage of mode=train never calls."""
    warm0, rl0 = _keys(f"{PARTIAL}=0.0")
    warm1, rl1 = _keys(f"{PARTIAL}=0.5")
    assert warm0 == warm1  # one warm-up, trained once
    assert rl0 != rl1  # the RL stages differ as their reward does
    # what the warm-up does read still tells it apart: its own learning rate, the eval's reward
    assert _keys("stages.0.algorithm.optimizer.lr=1e-3")[0] != warm1
    assert _keys("buffer.explorer_input.eval_tasksets.0.reward_fn.args.partial=0.5")[0] != warm1
    # a task pipeline may choose the rows by the reward (llm_difficulty_score_filter): kept in the key
    pipeline = "data_processor.task_pipeline.operators=[{name: llm_difficulty_score_filter, args: {n: 2}}]"
    assert _keys(pipeline, f"{PARTIAL}=0.0")[0] != _keys(pipeline, f"{PARTIAL}=0.5")[0]


SHORT = ["cluster=inline", "monitor=console", "buffer=sql", "buffer.batch_size=4", "algorithm.repeat_times=4",
         "buffer.total_steps=2", "explorer.eval_interval=2", "trainer.save_interval=30",
         "stages.0.buffer.total_steps=30", "stages.0.algorithm.optimizer.warmup_steps=0",
         "stages.0.explorer.eval_interval=30"]


@pytest.mark.slow
def test_the_study_scores_with_the_swept_argument_and_a_second_arm_reuses_the_warm_up(tmp_path, data, capsys):
    """Two arms of the study's sweep, one after the other: every stored experience's reward is the
    study's reward at the arm's `partial`, by hand; the eval's is exact (0 or 1); the second arm
    copies the warm-up the first trained (it trained its own: the key held the taskset's reward),
    and the same command again finds both its stages finished."""
    credit, answers = _credit(), [r["ordered"] for r in _rows(data / "train.jsonl")]
    from rft.data.buffer import read_experiences

    for name, partial in (("arm0", 0.25), ("arm1", 0.5)):
        cfg = compose_cfg(["experiment=word_sort", *SHORT, f"checkpoint_root_dir={tmp_path}", f"name={name}",
                           f"{PARTIAL}={partial}"])
        main.main(cfg)
        run = tmp_path / "rft" / name
        rows = read_experiences(str(run / "rloo" / "buffer.db"), 1000)
        assert len(rows) == 2 * 4 * 4  # 2 steps of 4 tasks x 4 rollouts
        for e in rows:
            answer = answers[int(e.task_id.split("/")[-1])]
            assert e.reward == credit("", e.info["response"], SimpleNamespace(answer=answer), partial=partial)
        # partial credit reached the buffer: a response of the right length but not in order
        assert any(0 < e.reward < 1 for e in rows)
        evals = _rows(run / "rloo" / "eval_trajectories" / "step_2" / "word_sort_test.jsonl")
        assert len(evals) == 100 and {e["reward"] for e in evals} <= {0.0, 1.0}
    out = capsys.readouterr().out
    assert f"[sft_warmup] reused: the same stage (same config, starting model and data) finished in " \
           f"{tmp_path / 'rft' / 'arm0' / 'sft_warmup'}" in out
    # the copy's config.yaml is this arm's (arm0's made the same command again stop as a changed config)
    main.main(cfg)
    out = capsys.readouterr().out
    assert f"[sft_warmup] already finished (step 30); outputs in {tmp_path / 'rft' / 'arm1' / 'sft_warmup'}" in out
    assert f"[rloo] already finished (step 2)" in out
