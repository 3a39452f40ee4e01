"""The data pipelines (rft/data/pipeline.py, rft/data/operators.py) and the online curriculum
(rft/data/curriculum.py): each operator on rows with a known answer, the task pipeline's cache,
the curriculum's draws against fixed pass rates, the errors; one short run through run.py."""

import json
import os
import random
from collections import Counter

import pytest
from omegaconf import OmegaConf

from conftest import ROOT
from resume_support import run_to_end
from rft.config import Config
from rft.data import operators as ops
from rft.data.curriculum import OnlineCurriculum
from rft.data.experience import Experience
from rft.data.pipeline import (TASK_OPERATORS, ExperiencePipeline, check_operators, describe_rows, run_task_pipeline,
                               taskset_of)
from rft.errors import ConfigError

CTX = ops.TaskContext(text=lambda row: row["question"])


def rows(*questions, **columns):
    return [{"question": q, **{k: v[i] for k, v in columns.items()}} for i, q in enumerate(questions)]


def questions(rs):
    return [r["question"] for r in rs]


# ---------------------------------------------------------------- task operators


def test_text_length_filter_keeps_the_lengths_in_range():
    # lengths 3, 5, 7: only "12+34" is within 4..5
    assert questions(ops.text_length_filter(rows("1+1", "12+34", "123+456"), CTX, min_len=4, max_len=5)) == ["12+34"]
    # max_len null: no upper bound
    assert questions(ops.text_length_filter(rows("1+1", "12+34", "123+456"), CTX, min_len=5)) == ["12+34", "123+456"]
    # another column than the prompt
    r = rows("a", "b", answer=["long answer", "x"])
    assert questions(ops.text_length_filter(r, CTX, max_len=3, key="answer")) == ["b"]


def test_document_deduplicator_keeps_the_first_of_each_text():
    r = rows("A b", "a b", "A b", "a-b")
    assert questions(ops.document_deduplicator(r, CTX)) == ["A b", "a b", "a-b"]
    assert questions(ops.document_deduplicator(r, CTX, lowercase=True)) == ["A b", "a-b"]
    # without whitespace and punctuation all four are "ab"
    assert questions(ops.document_deduplicator(r, CTX, lowercase=True, ignore_non_character=True)) == ["A b"]


def test_minhash_deduplicator_drops_near_duplicates_by_their_shingles():
    t1 = "abcdefghijklmnopqrstuvwxyz"
    t2 = t1 + "!"        # 5-shingles: t1 has 26 - 5 + 1 = 22, t2 those and "vwxyz!": 23; Jaccard 22/23 = 0.9565
    t3 = t1[::-1]        # no 5-shingle in common with t1: Jaccard 0
    assert ops.jaccard(ops.shingles(t1, 5), ops.shingles(t2, 5)) == pytest.approx(22 / 23)
    r = rows(t1, t2, t3)
    assert questions(ops.document_minhash_deduplicator(r, CTX, jaccard_threshold=0.9)) == [t1, t3]
    assert questions(ops.document_minhash_deduplicator(r, CTX, jaccard_threshold=0.96)) == [t1, t2, t3]
    # exact duplicates are near ones too
    assert questions(ops.document_minhash_deduplicator(rows(t1, t3, t1), CTX)) == [t1, t3]


def test_llm_difficulty_score_filter_scores_by_pass_rate_and_keeps_a_range():
    asked = []

    def pass_rates(rs, n):
        asked.append((questions(rs), n))
        return [0.0, 0.25, 0.75, 1.0]

    ctx = ops.TaskContext(text=lambda row: row["question"], pass_rates=pass_rates)
    r = rows("q0", "q1", "q2", "q3")
    # difficulty = 1 - pass rate: 1, 0.75, 0.25, 0; in [0.2, 0.8]: q1 and q2
    kept = ops.llm_difficulty_score_filter(r, ctx, n=4, min_score=0.2, max_score=0.8)
    assert asked == [(["q0", "q1", "q2", "q3"], 4)]
    assert [(k["question"], k["pass_rate"], k["difficulty"]) for k in kept] == [("q1", 0.25, 0.75), ("q2", 0.75, 0.25)]


def test_difficulty_filter_and_curriculum_order():
    r = rows("hard", "easy", "mid", "easy2", difficulty=[0.9, 0.1, 0.5, 0.1])
    assert questions(ops.difficulty_filter(r, CTX, min_score=0.4, max_score=1.0)) == ["hard", "mid"]
    # easy to hard, equal difficulties in their order
    assert questions(ops.curriculum_order(r, CTX)) == ["easy", "easy2", "mid", "hard"]
    assert questions(ops.curriculum_order(r, CTX, descending=True)) == ["hard", "mid", "easy", "easy2"]
    assert questions(ops.curriculum_order(rows("b", "a", "c", level=[2, 3, 1]), CTX, column="level")) == ["c", "b", "a"]
    with pytest.raises(ConfigError) as e:
        ops.difficulty_filter(rows("x"), CTX)
    assert str(e.value) == ("row 0 has no number in column 'difficulty' (it holds None); score the rows first "
                            "(llm_difficulty_score_filter) or name the column that holds the difficulty.")


# ---------------------------------------------------------------- experience operators


def exp(reward, group="g", length=3, **info):
    return Experience(list(range(2 + length)), 2, [], reward=reward, group_id=group, task_id=f"t/{group}", info=info)


def test_reward_shaping_mapper_adds_and_multiplies_and_records_a_part():
    e = exp(1.0, quality=0.5)
    ops.reward_shaping_mapper([e], [{"stats_key": "quality", "op_type": "ADD", "weight": 2.0}])
    assert e.reward == 2.0 and e.reward_parts == {"add_quality": 1.0}  # 1 + 2 * 0.5
    e = exp(0.5, quality=2.0)
    ops.reward_shaping_mapper([e], [{"stats_key": "quality", "op_type": "mul", "weight": 3.0}])
    assert e.reward == 3.0 and e.reward_parts == {"mul_quality": 2.5}  # 0.5 * 3 * 2 = 3, a change of 2.5
    e = exp(1.0)
    e.reward_parts = {"format": 1.0}
    ops.reward_shaping_mapper([e], [{"stats_key": "format", "op_type": "SUB", "weight": 0.25}])
    assert e.reward == 0.75  # 1 - 0.25 * 1
    with pytest.raises(ConfigError) as err:
        ops.reward_shaping_mapper([exp(1.0, other=1)], [{"stats_key": "quality"}])
    assert str(err.value) == ("stats_key 'quality' is not a number on experience 't/g' (its reward parts: [], info "
                              "keys: ['other']); name one of those.")


def test_experience_filters():
    es = [exp(0.0, "a", length=1), exp(1.0, "a", length=4), exp(1.0, "b", length=2), exp(1.0, "b", length=6)]
    assert [e.reward for e in ops.reward_filter(es, min_reward=0.5)] == [1.0, 1.0, 1.0]
    assert [e.response_length for e in ops.response_length_filter(es, min_tokens=2, max_tokens=4)] == [4, 2]
    # group a: rewards 0, 1 (std 0.5); group b: 1, 1 (std 0): only a has a signal
    assert [e.group_id for e in ops.group_diversity_filter(es)] == ["a", "a"]
    assert ops.group_diversity_filter(es, min_std=0.5) == []


def test_experience_pipeline_runs_in_order_and_counts():
    pipe = ExperiencePipeline(OmegaConf.create([{"name": "reward_filter", "args": {"min_reward": 0.5}},
                                                {"name": "response_length_filter", "args": {"max_tokens": 3}}]))
    kept, m = pipe([exp(0.0, length=1), exp(1.0, length=2), exp(1.0, length=5)])
    assert [e.response_length for e in kept] == [2]
    assert m == {"experience_pipeline/in": 3, "experience_pipeline/reward_filter/out": 2,
                 "experience_pipeline/response_length_filter/out": 1, "experience_pipeline/kept": 1}
    assert not ExperiencePipeline([])


# ---------------------------------------------------------------- errors


def config(tmp_path, task_ops=(), exp_ops=(), **curriculum):
    cfg = OmegaConf.structured(Config)
    cfg.cache_dir = str(tmp_path / "cache")
    cfg.model.model_path = str(tmp_path / "model")
    cfg.buffer.explorer_input.taskset.path = str(tmp_path / "tasks.jsonl")
    cfg = OmegaConf.merge(cfg, {"data_processor": {"task_pipeline": {"operators": list(task_ops)},
                                                   "experience_pipeline": {"operators": list(exp_ops)}}})
    for k, v in curriculum.items():
        cfg.data_processor.online_curriculum[k] = v
    return cfg


@pytest.mark.parametrize("task_ops, exp_ops, message", [
    ([{"name": "text_lenght_filter"}], [],
     "data_processor.task_pipeline.operators[0].name='text_lenght_filter' is not an operator. Did you mean "
     "text_length_filter or difficulty_filter? The operators are text_length_filter, document_deduplicator, "
     "document_minhash_deduplicator, llm_difficulty_score_filter, difficulty_filter, curriculum_order "
     "(rft/data/operators.py), or give the dotted path of your own (a function fn(rows, ctx, **args) -> rows "
     "(module.function))."),
    ([{"args": {"max_len": 5}}], [],
     "data_processor.task_pipeline.operators[0] has no name: each operator is {name: <operator>, args: {...}}, the "
     "operators being text_length_filter, document_deduplicator, document_minhash_deduplicator, "
     "llm_difficulty_score_filter, difficulty_filter, curriculum_order (rft/data/operators.py) or the dotted path of "
     "your own."),
    ([{"name": "text_length_filter", "args": {"max_lenn": 5}}], [],
     "data_processor.task_pipeline.operators[0].args has ['max_lenn'], which text_length_filter does not take "
     "(max_lenn: did you mean max_len?); its arguments are ['min_len', 'max_len', 'key']."),
    ([], [{"name": "reward_filter", "args": {"min_reward": 1, "max_reward": 0}}],
     "data_processor.experience_pipeline.operators[0] (reward_filter): min_reward=1 > max_reward=0: no row could be "
     "kept; give min_reward <= max_reward."),
    ([], [{"name": "reward_shaping_mapper", "args": {"reward_shaping_configs": [{"stats_key": "q", "op_type": "POW"}]}}],
     "data_processor.experience_pipeline.operators[0] (reward_shaping_mapper): reward_shaping_configs[0]="
     "{'stats_key': 'q', 'op_type': 'POW'}: give stats_key (a reward part or info key), op_type (one of ADD, SUB, "
     "MUL, DIV) and weight (default 1.0), and nothing else."),
])
def test_bad_operators_are_one_paragraph(tmp_path, task_ops, exp_ops, message):
    with pytest.raises(ConfigError) as e:
        check_operators(config(tmp_path, task_ops, exp_ops))
    assert str(e.value) == message


def test_bad_curriculum_settings(tmp_path):
    with pytest.raises(ConfigError, match=r"window=8 must be >= 1 and eps=0.0 > 0"):
        check_operators(config(tmp_path, enable=True, eps=0.0))
    cfg = config(tmp_path, enable=True)
    cfg.explorer.partial_rollout = True
    with pytest.raises(ConfigError, match="explorer.partial_rollout takes later steps' tasks ahead"):
        check_operators(cfg)


# ---------------------------------------------------------------- the task pipeline's cache


def write_tasks(path, qs):
    path.write_text("".join(json.dumps({"question": q, "answer": "1"}) + "\n" for q in qs))


@pytest.mark.slow  # ~1.5 s, most of it importing `datasets` (which reads the rows)
def test_task_pipeline_is_cached_by_its_input_and_operators(tmp_path):
    calls = []

    def counted(rs, ctx):  # an operator of the test's own: counts the times the pipeline really runs
        calls.append(len(rs))
        return rs

    TASK_OPERATORS["counted"] = counted
    try:
        write_tasks(tmp_path / "tasks.jsonl", ["1+1", "12+34", "123+456", "1+1"])
        cfg = config(tmp_path, [{"name": "document_deduplicator"}, {"name": "counted"},
                                {"name": "text_length_filter", "args": {"max_len": 5}}])
        assert describe_rows(cfg)[0][1].startswith("document_deduplicator() -> counted() -> text_length_filter("
                                                   "max_len=5); not run yet")
        first = run_task_pipeline(cfg, say=lambda s: None)
        assert not first["cached"] and calls == [3]
        assert [(s["name"], s["rows_in"], s["rows_out"]) for s in first["operators"]] == [
            ("document_deduplicator", 4, 3), ("counted", 3, 3), ("text_length_filter", 3, 2)]
        out = taskset_of(cfg)
        assert out.path == first["output"] and [json.loads(x)["question"] for x in open(out.path)] == ["1+1", "12+34"]
        assert "cached in" in describe_rows(cfg)[0][1] and describe_rows(cfg)[0][1].endswith(
            "4 rows of " + str(tmp_path / "tasks.jsonl") + " -> document_deduplicator 3 -> counted 3 -> text_length_filter 2")
        # the same config again: the output is reused, the operators do not run
        again = run_task_pipeline(cfg, say=lambda s: None)
        assert again["cached"] and again["output"] == first["output"] and calls == [3]
        # another arg: a new output
        cfg.data_processor.task_pipeline.operators[2].args.max_len = 7
        changed = run_task_pipeline(cfg, say=lambda s: None)
        assert not changed["cached"] and changed["output"] != first["output"] and calls == [3, 3]
        assert changed["operators"][2]["rows_out"] == 3
        # another input (same operators): a new output
        write_tasks(tmp_path / "tasks.jsonl", ["1+1", "2+2"])
        assert not run_task_pipeline(cfg, say=lambda s: None)["cached"] and calls == [3, 3, 2]
    finally:
        del TASK_OPERATORS["counted"]


def test_a_pipeline_that_keeps_no_rows_says_so(tmp_path):
    write_tasks(tmp_path / "tasks.jsonl", ["123+456"])
    cfg = config(tmp_path, [{"name": "text_length_filter", "args": {"max_len": 3}}])
    with pytest.raises(ConfigError, match=r"data_processor.task_pipeline left no rows of .*tasks.jsonl \(1 rows of "
                                          r".* -> text_length_filter 0\). Loosen the operators' args."):
        run_task_pipeline(cfg, say=lambda s: None)


# ---------------------------------------------------------------- the online curriculum


def observe_fixed(cur, rates, window):
    """Each task i's last `window` outcomes: round(rates[i] * window) passes (rewards 1), the rest fails."""
    for i, p in enumerate(rates):
        passes = round(p * window)
        cur.observe([Experience([0, 1], 1, [], reward=float(k < passes), task_id=f"ts/{i}") for k in range(window)])


def test_curriculum_draws_follow_the_pass_rates():
    cur = OnlineCurriculum(4, "ts", window=4, eps=0.05, threshold=1.0, seed=0)
    observe_fixed(cur, [0.0, 0.25, 0.5, 1.0], 4)
    # p(1-p) + eps: 0.05, 0.1875 + 0.05, 0.25 + 0.05, 0.05 -> sum 0.6375
    want = [0.05 / 0.6375, 0.2375 / 0.6375, 0.3 / 0.6375, 0.05 / 0.6375]   # 0.078, 0.373, 0.471, 0.078
    assert cur.weights() == pytest.approx([0.05, 0.2375, 0.3, 0.05])
    # README's logged names: of the 4 tasks seen, one always solved (p = 1) and one never (p = 0)
    assert cur.metrics() == {"curriculum/solved_frac": 0.25, "curriculum/unsolved_frac": 0.25, "curriculum/seen_frac": 1.0}
    # 8000 draws: a frequency's standard error is at most sqrt(0.25 / 8000) = 0.0056; 0.02 is 3.5 of them
    counts = Counter(i for step in range(8000) for i in cur.draw(step, 1))
    assert [counts[i] / 8000 for i in range(4)] == pytest.approx(want, abs=0.02)
    # a task not yet seen counts as p = 0.5; only the last `window` outcomes count
    fresh = OnlineCurriculum(2, "ts", window=2, eps=0.05, threshold=1.0, seed=0)
    fresh.observe([Experience([0, 1], 1, [], reward=r, task_id="ts/0") for r in (0.0, 0.0, 1.0, 1.0)])
    assert fresh.weights() == [0.05, 0.3]
    # one task of 2 seen, its last 2 outcomes both passes
    assert fresh.metrics() == {"curriculum/solved_frac": 1.0, "curriculum/unsolved_frac": 0.0, "curriculum/seen_frac": 0.5}


def test_curriculum_state_resumes_the_same_draws():
    def run(stop_at=None):
        cur, rng, draws = OnlineCurriculum(10, "ts", window=3, eps=0.05, threshold=1.0, seed=7), random.Random(1), []
        for step in range(12):
            if step == stop_at:  # a checkpoint, through JSON as state.json holds it, into a new process's object
                saved = json.loads(json.dumps(cur.state()))
                cur = OnlineCurriculum(10, "ts", window=3, eps=0.05, threshold=1.0, seed=7)
                cur.load(saved)
            rows = cur.draw(step, 3)
            draws.append(rows)
            cur.observe([Experience([0, 1], 1, [], reward=float(rng.random() < r / 10), task_id=f"ts/{r}")
                         for r in rows for _ in range(2)])
        return draws

    assert run() == run(stop_at=5)
    assert len({tuple(d) for d in run()}) > 1


# ---------------------------------------------------------------- end to end


def even_answer(prompt, response, task):
    """A reward whose pass rate is known whatever the model says: 1 for a task with an even answer."""
    return float(int(task.answer) % 2 == 0)


@pytest.mark.slow
def test_a_run_with_both_pipelines_and_the_curriculum(tmp_path):
    """Through run.py: the task pipeline drops a long prompt and a duplicate, scores the tasks with
    the model (the reward passes exactly the even answers) and keeps the easy ones; the run trains on
    them, its experience pipeline and curriculum logged; the rerun reuses the cached output."""
    data = tmp_path / "tasks.jsonl"
    qs = [("1+1", 2), ("1+2", 3), ("2+2", 4), ("2+3", 5), ("3+3", 6), ("3+4", 7), ("4+4", 8), ("4+5", 9),
          ("1+1", 2), ("1+1+1+1+1+1+1+1", 8)]
    data.write_text("".join(json.dumps({"question": q, "answer": str(a)}) + "\n" for q, a in qs))
    ops_ = ("[{name: text_length_filter, args: {max_len: 5}}, {name: document_deduplicator},"
            " {name: llm_difficulty_score_filter, args: {n: 2, max_score: 0.5}}, {name: curriculum_order}]")
    args = ["stages=[]", "cluster=inline", "monitor=console", "name=dp", "buffer.total_steps=2", "buffer.batch_size=2",
            "algorithm.repeat_times=2", f"buffer.explorer_input.taskset.path={data}", "buffer.explorer_input.generator=null",
            "buffer.explorer_input.eval_tasksets=[]", "buffer.explorer_input.default_reward_fn_type=test_data_pipeline.even_answer",
            f"data_processor.task_pipeline.operators={ops_}", "data_processor.online_curriculum.enable=true",
            "data_processor.experience_pipeline.operators=[{name: reward_filter, args: {min_reward: 0.5}}]"]
    env = {**os.environ, "RFT_CHECKPOINT_ROOT_DIR": str(tmp_path / "runs"), "PYTHONPATH": str(ROOT / "tests")}
    # run.py forked from a process that imported torch (resume_support: the same command without a fresh
    # interpreter's imports, ~4 s a run)
    r = run_to_end(args, env, tmp_path / "first_run")
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "runs" / "rft" / "dp"
    report = json.loads((run / "task_pipeline.json").read_text())
    # 10 rows -> 9 (the long one) -> 8 (the duplicate "1+1") -> 4 (the even answers: pass rate 1, difficulty 0)
    assert [s["rows_out"] for s in report["operators"]] == [9, 8, 4, 4] and report["rows"] == 10
    kept = [json.loads(x) for x in open(report["output"])]
    assert [(k["question"], k["pass_rate"], k["difficulty"]) for k in kept] == [
        ("1+1", 1.0, 0.0), ("2+2", 1.0, 0.0), ("3+3", 1.0, 0.0), ("4+4", 1.0, 0.0)]
    steps = [json.loads(x) for x in open(run / "metrics.jsonl")][1:]
    assert [m["step"] for m in steps] == [1, 2]
    # every drawn task has an even answer: reward 1, all 4 experiences kept by the reward filter
    assert all(m["reward/mean"] == 1.0 and m["experience_pipeline/kept"] == 4 for m in steps)
    assert [m["curriculum/solved_frac"] for m in steps] == [1.0, 1.0]
    assert "task pipeline: 10 rows of" in r.stdout
    again = run_to_end(args, env, tmp_path / "again_run")
    assert again.returncode == 0 and "task pipeline (cached): 10 rows of" in again.stdout, again.stderr[-3000:]


@pytest.mark.slow  # ~1.5 s, importing `datasets`
def test_a_malformed_row_the_task_pipeline_kept_is_named_in_its_input(tmp_path):
    """The error named the pipeline's output in the cache and said to fix the row there: an edited
    output is rebuilt from the input (its manifest no longer matches), the same row again."""
    from rft.runtime.main import dataset_size

    (tmp_path / "tasks.jsonl").write_text('{"question": "1+1", "answer": "2"}\n{"question": "2+2"}\n')
    cfg = config(tmp_path, [{"name": "text_length_filter", "args": {"max_len": 5}}])
    out = run_task_pipeline(cfg, say=lambda s: None)["output"]
    with pytest.raises(ConfigError) as e:
        dataset_size(cfg)
    assert str(e.value) == (
        f"buffer.explorer_input.taskset: row 1 (line 2 of its JSONL file) of '{out}' has no 'answer' "
        f"(format.response_key: the reference answer the reward function reads as task.answer). Fix the row, or set "
        f"buffer.explorer_input.taskset.format.response_key=null if your reward needs no answer. That file is "
        f"data_processor.task_pipeline's output of '{tmp_path / 'tasks.jsonl'}' (made again from it whenever it "
        f"changes): the row is one of the input's that the operators kept; fix it there, or add an operator that "
        f"drops it.")
