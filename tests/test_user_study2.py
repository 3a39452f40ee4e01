"""A new user's study made from the README alone (experiments/digit_max/): its own dataset (a
directory of train.jsonl and test.jsonl, columns `puzzle` and `target`), a system prompt, a local
base model whose tokenizer has no chat template (so a template of the study's own), rewards of its
own by dotted path (a built-in verifier plus a length penalty, as named parts; one that raises
sometimes), kept outside conf/ behind `hydra.searchpath`, swept with `-m` and read with the report."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, load_script, run_cli

STUDY = ["hydra.searchpath=[file://experiments/digit_max/conf]", "experiment=digit_max"]
DATA = ROOT / "experiments" / "digit_max" / "data"


@pytest.fixture(scope="module")
def base_model(cache_dir):
    """prepare.py's base model (the tiny model without its chat template) in the session's cache,
    where the study's model file (${cache_dir}/models/digit-max-base) finds it."""
    return load_script("experiments/digit_max/prepare.py", "digit_max_prepare").write_base_model(cache_dir)


def _error(result) -> str:
    """The one paragraph a run that stopped on its config prints (nothing else on stderr but it)."""
    assert result.returncode == 2, result.stderr[-2000:]
    return result.stderr.strip().removeprefix("rft: configuration error: ")


def _with_row(tmp_path, split: str, line: int, row: str):
    """A copy of the study's data with `row` as line `line` of the split's file."""
    d = tmp_path / "data"
    shutil.copytree(DATA, d)
    lines = (d / f"{split}.jsonl").read_text().splitlines()
    lines.insert(line - 1, row)
    (d / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return d


def test_the_prepared_data_is_what_the_study_reads():
    # prepare.py's rows, written again, are the committed files byte for byte (seed 0)
    prepare = load_script("experiments/digit_max/prepare.py", "digit_max_prepare")
    rows = prepare.rows(260, random.Random(0))
    assert (DATA / "train.jsonl").read_text() == "".join(json.dumps(r) + "\n" for r in rows[:200])
    assert (DATA / "test.jsonl").read_text() == "".join(json.dumps(r) + "\n" for r in rows[200:])
    assert rows[0] == {"puzzle": "max 660", "target": "6"}


@pytest.mark.slow  # two dry runs of run.py (~3 s)
def test_a_malformed_row_of_a_data_directory_is_named_by_its_file_and_line(tmp_path, base_model):
    """With a directory of split files (the layout "Starting a new study" suggests), a number among
    the texts of `target` was "the column holds values of several kinds" with no row or file: 200
    rows to search by hand. The row, its line and the split's file are named now; so is a blank
    prompt of the eval set's split, which said "its JSONL file" of a directory of two files."""
    d = _with_row(tmp_path, "train", 42, '{"puzzle": "max 123", "target": 3}')
    out = run_cli(*STUDY, "dry_run=true", f"buffer.explorer_input.taskset.path={d}",
                  f"buffer.explorer_input.eval_tasksets.0.path={d}")
    assert _error(out) == (
        f"buffer.explorer_input.taskset: row 41 (line 42 of train.jsonl) of '{d}' holds a number in 'target' "
        f"(format.response_key), where the other 200 rows hold text. With two kinds of value in one column, the "
        f"datasets library reads every value of it as JSON, so the text '58' would arrive as the number 58 and "
        f"'007' as 7. Write that row's value as text (\"3\", quoted) or give every row of the column the same kind.")
    d = _with_row(tmp_path / "eval", "test", 3, '{"puzzle": " ", "target": "3"}')
    out = run_cli(*STUDY, "dry_run=true", f"buffer.explorer_input.eval_tasksets.0.path={d}")
    assert _error(out) == (
        f"buffer.explorer_input.eval_tasksets[0]: 1 of the 61 rows of '{d}' have an empty prompt in 'puzzle' "
        f"(format.prompt_key): row 2 (line 3 of test.jsonl). Fill or remove those rows, or set "
        f"buffer.explorer_input.eval_tasksets[0].format.prompt_key to the column that holds the prompts.")


@pytest.mark.slow  # a sweep of two 2-step jobs of the tiny model in one run.py (~12 s)
def test_the_study_sweeps_its_length_penalty_and_the_report_compares_the_jobs(tmp_path, base_model):
    from rft.data.buffer import read_experiences

    sweep = tmp_path / "sweep"
    flaky = "{fn: experiments.digit_max.rewards.flaky, args: {raise_every: 7}, name: flaky}"
    out = run_cli("-m", *STUDY, "buffer=sql", "buffer.total_steps=2", f"hydra.sweep.dir={sweep}",
                  f"buffer.explorer_input.taskset.reward_fn=[{{fn: experiments.digit_max.rewards.exact_short, "
                  f"name: exact_short, args: {{per_char: 0.0}}}}, {flaky}]",
                  "buffer.explorer_input.taskset.reward_fn.0.args.per_char=0.0,0.3",
                  env={"RFT_CHECKPOINT_ROOT_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    # the raising reward is named with its file and line, its task retried, the run goes on
    assert "raised ValueError: scorer backend refused" in out.stdout
    rewards = ROOT / "experiments" / "digit_max" / "rewards.py"
    line = next(i for i, text in enumerate(rewards.read_text().splitlines(), 1) if "raise ValueError" in text)
    assert f"({rewards}, line {line})" in out.stdout
    targets = [json.loads(r)["target"] for r in (DATA / "train.jsonl").read_text().splitlines()]
    for job, per_char in ((0, 0.0), (1, 0.3)):
        run = sweep / str(job)
        overrides = (run / ".hydra" / "overrides.yaml").read_text()
        assert f"buffer.explorer_input.taskset.reward_fn.0.args.per_char={per_char}" in overrides
        rows = read_experiences(str(run / "buffer.db"), 1000)
        assert len(rows) > 0
        for e in rows:
            # the study's reward by hand: exact match, minus per_char a character past the answer's 1
            response, target = e.info["response"], targets[int(e.task_id.split("/")[-1])]
            correct = e.reward_parts["exact_short/correct"]
            assert correct == float(response.strip() == target)
            assert e.reward_parts["exact_short/length"] == pytest.approx(-per_char * max(0, len(response.strip()) - 1))
            assert e.reward_parts["flaky"] == correct  # exact_match again, when it did not raise
            assert e.reward == pytest.approx(sum(e.reward_parts.values()))
        metrics = [json.loads(m) for m in (run / "metrics.jsonl").read_text().splitlines()]
        assert sum(m.get("rollout/errors", 0) for m in metrics) > 0
        lengths = [m["reward/exact_short/length/mean"] for m in metrics if "reward/exact_short/length/mean" in m]
        assert len(lengths) == 2 and ((max(lengths) < 0) if per_char else (lengths == [0.0, 0.0]))
    # the report: one row per job, the swept key as its column, the two values in it
    subprocess.run([sys.executable, "-m", "rft.reporting.report", str(sweep)], cwd=ROOT, check=True, capture_output=True)
    table = [row for row in (sweep / "report.md").read_text().splitlines() if row.startswith("| ")]
    assert "buffer.explorer_input.taskset.reward_fn.0.args.per_char" in table[0]
    assert [row.split("|")[1:3] for row in table[1:]] == [[" 0 ", " 0.0 "], [" 1 ", " 0.3 "]]


def test_a_reward_that_hangs_times_out_naming_the_key_that_bounds_it(caplog):
    """A reward that hangs raises nothing: the warning was "job 0 attempt 1 timed out after 3.0 s",
    which named neither what was slow nor the key to raise; it names explorer.max_timeout now."""
    import logging
    import threading

    from rft.rollout.explorer import run_jobs

    release = threading.Event()
    with caplog.at_level(logging.WARNING, logger="rft.rollout.explorer"):
        results, counters = run_jobs(lambda job: release.wait(5), [0], runners=1, timeout=0.05, retries=0)
    release.set()  # the abandoned call's thread ends
    assert results == [None] and counters["timeouts"] == 1 and counters["failed"] == 1
    assert [r.getMessage() for r in caplog.records] == [
        "job 0 attempt 1 timed out after 0.1 s (explorer.max_timeout: its generation and reward together)"]


def test_a_csv_answer_reaches_the_reward_as_written(tmp_path):
    """The study's data as CSV files: the csv reader typed the `target` column as numbers (every
    value parses as one), so the answer `02` reached the reward as the number 2, and a model answering
    `02` scored 0 with exit 0. The prompt and answer columns of a CSV file are read as written now;
    other columns keep their types (`level`, a number to sort or filter by)."""
    from conftest import compose_cfg
    from rft.data.tasks import load_tasks
    from rft.rewards.verifiers import exact_match

    d = tmp_path / "csv"
    d.mkdir()
    for split in ("train", "test"):
        (d / f"{split}.csv").write_text("puzzle,target,level\nmax 012,02,1\nmax 100,1.50,2\nmax 777,10,3\n")
    cfg = compose_cfg([f"hydra.searchpath=[file://{ROOT}/experiments/digit_max/conf]", "experiment=digit_max",
                       f"buffer.explorer_input.taskset.path={d}"])
    tasks = load_tasks(cfg.buffer.explorer_input.taskset, "buffer.explorer_input.taskset")
    assert [t.answer for t in tasks] == ["02", "1.50", "10"]  # were 2.0, 1.5 and 10.0
    assert [t.row["level"] for t in tasks] == [1, 2, 3]
    assert [exact_match("", answer, t) for t, answer in zip(tasks, ["02", "1.50", "10"])] == [1.0, 1.0, 1.0]


@pytest.mark.slow  # one run.py that loads the model and stops (~6 s)
def test_a_base_model_without_a_chat_template_stops_with_one_paragraph_alone(base_model, tmp_path):
    """The study's model has no chat template: the run stops naming model.custom_chat_template. The
    error came up while the stage started, inside rft.runtime.actors.long_lived, which then froze
    (gc.freeze) the half-built stage, the trainer's model included, so it outlived the interpreter's
    shutdown and triton's bindings printed ~30 lines of "nanobind: leaked ..." below the paragraph."""
    out = run_cli(*STUDY, "model.custom_chat_template=null", env={"RFT_CHECKPOINT_ROOT_DIR": str(tmp_path)})
    assert _error(out) == (
        f"model.model_path='{base_model}': its tokenizer has no chat template, and every prompt is rendered "
        "with one (a base model's tokenizer often has none). Set model.custom_chat_template to a Jinja template, "
        "e.g. \"{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\\n{% endfor %}{% if add_generation_prompt "
        "%}assistant: {% endif %}\", or use the model's instruct variant.")


def test_what_long_lived_made_is_not_frozen_when_making_it_failed():
    import gc

    from rft.runtime.actors import long_lived

    before = gc.get_freeze_count()
    with pytest.raises(ValueError):
        with long_lived():
            held = [object() for _ in range(1000)]  # noqa: F841  (a half-built stage's objects)
            raise ValueError("a stage that could not start")
    assert gc.get_freeze_count() == before
    try:
        with long_lived():
            held = [object() for _ in range(1000)]  # noqa: F841
        assert gc.get_freeze_count() >= before + 1000  # a stage that started is frozen, as before
    finally:
        gc.unfreeze()


def test_a_sweep_job_killed_outright_is_reported_with_where_its_output_ended(tmp_path):
    """hydra/launcher=local, job 1 killed with SIGKILL at step ~120: the sweep's paragraph gave "The
    last lines of its log: (nothing)", its .err being empty (rft prints its steps to stdout); the
    lines of its .out, where the job was, are given when its .err holds none."""
    from rft.reporting.sweep import explain

    folder = tmp_path / ".submitit" / "3260"
    folder.mkdir(parents=True)
    (folder / "3260_0_log.err").write_text("")
    (folder / "3260_0_log.out").write_text("[grpo] step 100: eval accuracy 0.000\n"
                                           "[grpo] step 120/300  reward.mean=0 eval.accuracy=0\n")
    error = Exception(f"Job 3260 (task: 0) with path {folder}/3260_0_result.pkl\n"
                      "has not produced any output (state: FINISHED)\nError stream produced:\n...")
    text = explain(error, str(tmp_path))
    assert ("The last lines of its log (3260_0_log.out):\n    [grpo] step 100: eval accuracy 0.000\n"
            "    [grpo] step 120/300  reward.mean=0 eval.accuracy=0\nIts whole output: ") in text


def test_an_eval_set_without_the_tasksets_system_prompt_is_warned_about(caplog):
    """The study first set its system prompt on the taskset alone (the eval set has a format of its
    own): its evals asked without it, prompts the run never trained on, and nothing said so."""
    from conftest import compose_cfg
    from rft.plan.batch import check_config, stage_configs

    ts, ev = "buffer.explorer_input.taskset.format", "buffer.explorer_input.eval_tasksets.0.format"
    check_config(stage_configs(compose_cfg(["stages=[]", f"{ts}.system_prompt=Add."]))[0])
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "buffer.explorer_input.eval_tasksets[0] (arithmetic_test) has format.system_prompt=None, the taskset 'Add.': "
        "it is measured on prompts the run does not train on. Set buffer.explorer_input.eval_tasksets[0]"
        ".format.system_prompt to the taskset's (or keep it, if that is the point)."]
    caplog.clear()
    check_config(stage_configs(compose_cfg(["stages=[]", f"{ts}.system_prompt=Add.", f"{ev}.system_prompt=Add."]))[0])
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
