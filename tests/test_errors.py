"""User mistakes end in one clear paragraph, a non-zero exit, and nothing started."""

import json
import os
import re
from pathlib import Path

import pytest
from conftest import CONF, compose_cfg, driver_modules_env, run_cli

import rft.runtime.main
from rft.reporting.monitor import read_metrics


@pytest.fixture
def run_root(tmp_path):
    return {"RFT_CHECKPOINT_ROOT_DIR": str(tmp_path / "ck"), "RFT_CACHE_DIR": str(tmp_path / "cache")}


def assert_nothing_started(env):
    from pathlib import Path

    # no model built, no checkpoint written
    assert not (Path(env["RFT_CACHE_DIR"]) / "models").exists()
    assert not list(Path(env["RFT_CHECKPOINT_ROOT_DIR"]).rglob("checkpoints"))


def test_misspelt_key(run_root):
    r = run_cli("algorithm.repeat_time=4", env=run_root)
    assert r.returncode != 0
    assert "Could not override 'algorithm.repeat_time'" in r.stderr
    assert "Key 'repeat_time' not in 'AlgorithmConfig'" in r.stderr
    assert "Traceback" not in r.stderr
    assert_nothing_started(run_root)


@pytest.mark.slow
def test_a_misspelt_key_added_with_plus_is_caught_too(run_root):
    # +key adds a key where Hydra would take it silently: into the schema's own sections too
    r = run_cli("+trainer.save_intervall=1", env=run_root)
    assert r.returncode == 2
    assert ("Could not add 'trainer.save_intervall': Key 'save_intervall' not in 'TrainerConfig' ('TrainerConfig' "
            "is a section of the schema: a + adds keys only to free-form ones such as stages). Did you mean "
            "trainer.save_interval") in r.stderr
    assert "Traceback" not in r.stderr
    assert_nothing_started(run_root)
    # into a free-form list or dict it is the way: planned like any stage key
    r = run_cli("+stages.0.trainer.save_interval=2", "dry_run=true", env=run_root)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.slow  # a real engine, Ray or training run
def test_a_model_that_cannot_be_downloaded_is_a_configuration_error_before_anything_starts(run_root):
    # a hub id neither here nor in the cache, offline: the driver says so before Ray starts (the
    # explorer's constructor would find it minutes later)
    r = run_cli("stages=[]", "model.model_path=someorg/nomodel", "model.builder=null", "buffer.total_steps=2",
                "cluster=local", env={**run_root, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2, r.stderr[-3000:]
    assert ("rft: configuration error: model.model_path='someorg/nomodel' is not a directory on this machine nor in "
            "its Hugging Face cache, and HF_HUB_OFFLINE is set (no download is tried). Download it where the hub is "
            "reachable (huggingface-cli download someorg/nomodel)") in r.stderr
    assert "Started a local Ray instance" not in r.stderr
    assert "Traceback" not in r.stderr
    assert not list(Path(run_root["RFT_CHECKPOINT_ROOT_DIR"]).rglob("checkpoints"))


@pytest.mark.slow  # a real engine, Ray or training run
def test_a_dataset_stage_through_ray_reads_its_dataset_in_the_trainer(tmp_path, run_root, monkeypatch):
    """SFT from a file with Ray: the trainer tokenizes the dataset (the driver imports no torch),
    a bad row stops the run with the ConfigError naming it, and a good file trains."""
    good = [{"question": f"{a}+{b}", "answer": str(a + b)} for a in range(4) for b in range(2)]
    bad = write_jsonl(tmp_path / "bad.jsonl", good[:2] + [{"question": "2+2", "answer": None}] + good[3:])
    common = ["stages=[]", "algorithm=sft", "buffer.explorer_input.generator=null", "buffer.explorer_input.eval_tasksets=[]",
              "buffer.train_batch_size=4", "buffer.total_steps=2", "cluster=local", "monitor=console"]
    r = run_cli(*common, f"buffer.explorer_input.taskset.path={bad}", "name=bad", env=run_root)
    assert r.returncode == 2, r.stderr[-3000:]
    assert (f"rft: configuration error: buffer.trainer_input.experience_buffer: row 2 (line 3 of its JSONL file) "
            f"of '{bad}' has no 'answer' (format.response_key); its keys are ['question']. Fix the row (or leave "
            f"it out), or set buffer.trainer_input.experience_buffer.format.response_key to the column that "
            f"holds it." in r.stderr) and "Traceback" not in r.stderr
    data = write_jsonl(tmp_path / "good.jsonl", good)
    # the tiny model built, as after any first run: the driver finds it before importing torch (the
    # bad row above now stops the run in planning, before any process built it)
    from rft.models import ensure_model

    monkeypatch.setenv("RFT_CACHE_DIR", run_root["RFT_CACHE_DIR"])
    ensure_model(compose_cfg().model)
    hook_env, modules = driver_modules_env(tmp_path)
    r = run_cli(*common, f"buffer.explorer_input.taskset.path={data}", "name=good", env={**run_root, **hook_env})
    assert r.returncode == 0, r.stderr[-3000:]
    driver = set(modules.read_text().split())
    assert "ray" in driver and not driver & {"torch", "transformers", "datasets"}
    run = Path(run_root["RFT_CHECKPOINT_ROOT_DIR"]) / "rft" / "good"
    metrics = [m for m in read_metrics(run / "metrics.jsonl") if "loss/policy" in m]
    # 8 rows, 4 a step: each step trains on 4 whole rows, none cut (3-character questions, 1-digit answers)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all((m["train/truncated_prompts"], m["train/truncated_responses"]) == (0, 0) for m in metrics)
    batches = read_metrics(run / "batches.jsonl")
    assert [b["step"] for b in batches] == [1, 2] and all(len(b["groups"]) == 4 for b in batches)


def test_wrong_type(run_root):
    """A value the typed key does not take is rft's one paragraph with status 2 (Hydra's was five lines,
    a HYDRA_FULL_ERROR hint and status 1), before anything starts."""
    r = run_cli("buffer.batch_size=lots", env=run_root)
    assert r.returncode == 2
    assert r.stderr.strip() == (
        "rft: configuration error: buffer.batch_size=lots: Value 'lots' of type 'str' could not be converted "
        "to Integer. The key's type and its comment are in rft/config.py; `python run.py --cfg job` prints the "
        "composed config.")
    assert_nothing_started(run_root)


@pytest.mark.parametrize("args, says", [
    (["synchronizer.sync_method=nccl"], "synchronizer.sync_method=nccl: Invalid value 'nccl', expected one of "
                                        "[memory, checkpoint, collective]."),
    (["seed=abc"], "seed=abc: Value 'abc' of type 'str' could not be converted to Integer."),
    (["buffer.batch_size=1.5"], "buffer.batch_size=1.5: Value '1.5' of type 'float' could not be converted to Integer."),
    # a sweep: each of its values is tried, the first that does not fit named
    (["-m", "seed=1,x"], "seed=1,x: Value 'x' of type 'str' could not be converted to Integer."),
])
def test_a_value_its_key_does_not_take_is_one_paragraph(run_root, args, says):
    r = run_cli(*args, "dry_run=true", env=run_root)
    assert r.returncode == 2 and "HYDRA_FULL_ERROR" not in r.stderr
    assert r.stderr.strip().startswith("rft: configuration error: " + says), r.stderr
    assert_nothing_started(run_root)


@pytest.mark.slow
def test_non_divisible_batch(run_root):
    r = run_cli("trainer.mini_batch_size=48", env=run_root)
    assert r.returncode == 2
    # the override applies to both stages; the first stage (64 experiences per step) fails first
    assert (
        "rft: configuration error: stage sft_warmup: trainer.mini_batch_size=48 must divide "
        "buffer.train_batch_size=64 (experiences per step) into whole optimizer steps."
    ) in r.stderr
    assert "Traceback" not in r.stderr
    assert_nothing_started(run_root)


@pytest.mark.slow
def test_missing_dataset_file(run_root, tmp_path):
    missing = tmp_path / "nowhere" / "train.jsonl"
    r = run_cli("buffer.explorer_input.generator=null", f"buffer.explorer_input.taskset.path={missing}",
                "stages=[]", env=run_root)
    assert r.returncode == 2
    assert f"buffer.explorer_input.taskset.path='{missing}': no such file or directory." in r.stderr
    assert "Traceback" not in r.stderr
    assert_nothing_started(run_root)


@pytest.mark.slow
def test_a_warm_up_dataset_row_without_its_response_fails_the_dry_run(run_root, tmp_path):
    # the default's SFT warm-up reads the taskset's teacher_answer; one row lacks it, another has null
    rows = [{"question": f"{a}+1", "answer": str(a + 1), "teacher_answer": str(a + 1)} for a in range(8)]
    rows[5].pop("teacher_answer")
    rows[6]["teacher_answer"] = None
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = run_cli("dry_run=true", "buffer.explorer_input.generator=null", f"buffer.explorer_input.taskset.path={data}",
                "buffer.explorer_input.eval_tasksets=[]", "buffer.batch_size=2", "stages.0.buffer.train_batch_size=2",
                env=run_root)
    assert r.returncode == 2, r.stderr[-3000:]
    assert (f"rft: configuration error: stage sft_warmup: buffer.trainer_input.experience_buffer: row 5 (line 6 "
            f"of its JSONL file) of '{data}' has no 'teacher_answer' (format.response_key); its keys are "
            f"['answer', 'question']. Fix the row (or leave it out)") in r.stderr
    assert "Traceback" not in r.stderr
    assert_nothing_started(run_root)


@pytest.mark.slow
def test_row_without_prompt_key(run_root, tmp_path):
    data = tmp_path / "tasks.jsonl"
    rows = [{"question": "1+1", "answer": "2"}, {"question": "2+2", "answer": "4"}, {"prompt": "3+3", "answer": "6"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = run_cli("buffer.explorer_input.generator=null", f"buffer.explorer_input.taskset.path={data}",
                "buffer.batch_size=1", "stages=[]", env=run_root)
    assert r.returncode == 2
    assert (
        f"buffer.explorer_input.taskset: row 2 (line 3 of its JSONL file) of '{data}' has no 'question' "
        f"(format.prompt_key); its keys are ['answer', 'prompt']."
    ) in r.stderr
    assert "Traceback" not in r.stderr
    assert_nothing_started(run_root)


@pytest.mark.slow
def test_a_ray_driver_reads_the_datasets_in_a_child_with_the_same_plans_and_errors(tmp_path):
    """plan_stages(isolated=True), as a Ray run's driver calls it, reads the datasets in a child
    process (the driver then holds no `datasets`): the same batch plans as in-process, and a
    dataset's ConfigError word for word, stage name included."""
    from rft.errors import ConfigError
    from rft.runtime.main import plan_stages

    # the default: the warm-up's generated dataset, then the generated tasks
    cfg = compose_cfg()
    inline, child = plan_stages(cfg)[1], plan_stages(cfg, isolated=True)[1]
    assert child == inline and len(child) == 2 and all(p.dataset_size > 0 for p in child)
    rows = [{"question": f"{a}+1", "answer": str(a + 1)} for a in range(10)]
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = compose_cfg(["stages=[]", "buffer.explorer_input.generator=null", f"buffer.explorer_input.taskset.path={data}",
                       "buffer.explorer_input.eval_tasksets=[]", "buffer.batch_size=2"])
    assert [p.dataset_size for p in plan_stages(cfg, isolated=True)[1]] == [10]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows[:3] + [{"question": "9+9"}] + rows[4:]))
    errors = []
    for isolated in (False, True):
        with pytest.raises(ConfigError) as e:
            plan_stages(cfg, isolated=isolated)
        errors.append(str(e.value))
    assert errors[0] == errors[1]
    assert errors[1].startswith(f"buffer.explorer_input.taskset: row 3 (line 4 of its JSONL file) of '{data}' has no 'answer'")


@pytest.mark.slow
def test_dry_run_prints_the_plan_and_starts_nothing(run_root):
    r = run_cli("dry_run=true", env=run_root)
    assert r.returncode == 0, r.stderr
    assert "batch plan: stage sft_warmup (sft)" in r.stdout
    assert "batch plan: stage grpo (grpo)" in r.stdout
    assert re.search(r"experiences per step +128  buffer.train_batch_size", r.stdout)
    assert_nothing_started(run_root)


@pytest.mark.slow  # 1.1 s alone, over the fast tier's second
def test_dry_run_never_touches_ray_or_a_model(monkeypatch):
    """In-process: dry_run returns before any model load or Ray start (both would raise here)."""
    import ray

    import rft.models

    def boom(*a, **k):
        raise AssertionError("dry_run must not start this")

    monkeypatch.setattr(ray, "init", boom)
    monkeypatch.setattr(rft.models, "load_model", boom)
    monkeypatch.setattr(rft.models, "ensure_model", boom)
    assert rft.runtime.main.main(compose_cfg(["dry_run=true"])) is None


# ---------------------------------------------------------------- caught while planning, named


def plan_error(tmp_path, *overrides) -> str:
    """The ConfigError `python run.py <overrides>` stops with, before anything starts. Planned with
    cluster=inline (an override may name another): the datasets are read in this process, where a
    Ray run's driver reads them in a child process that imports `datasets` afresh, ~1 s a call; the
    child's ConfigError is this one word for word
    (test_a_ray_driver_reads_the_datasets_in_a_child_with_the_same_plans_and_errors)."""
    with pytest.raises(rft.runtime.main.ConfigError) as e:
        rft.runtime.main._main(compose_cfg([f"checkpoint_root_dir={tmp_path / 'ck'}", "cluster=inline", *overrides]))
    assert not (tmp_path / "ck").exists()  # nothing written
    return str(e.value)


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def taskset(path):
    return ["buffer.explorer_input.generator=null", f"buffer.explorer_input.taskset.path={path}", "stages=[]",
            "buffer.explorer_input.eval_tasksets=[]", "buffer.batch_size=2"]


@pytest.mark.slow
def test_empty_and_malformed_datasets_name_the_file_and_line(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert plan_error(tmp_path, *taskset(empty)) == (
        f"buffer.explorer_input.taskset.path='{empty}' is empty: it holds no rows.")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "1+1", "answer": "2"}])
    bad.write_text(bad.read_text() + '{"question": "2+2", "answer": 4\n')
    # the line ends after 4, where json wanted ',' or '}' (json itself said "line 2 column 1")
    assert plan_error(tmp_path, *taskset(bad)).startswith(
        f"buffer.explorer_input.taskset.path='{bad}': line 2 of {bad} is not valid JSON (Expecting ',' "
        f"delimiter at the end of the line). Each line")
    # '{"question": "3+3" "answer": "6"}': json reads past the space after "3+3" and stops at the
    # quote of "answer", the line's 20th character, where it wanted ',' or '}'
    bad.write_text('{"question": "3+3" "answer": "6"}\n')
    assert f"line 1 of {bad} is not valid JSON (Expecting ',' delimiter at column 20)." in plan_error(
        tmp_path, *taskset(bad))
    # a value nested 2,000 deep: json's RecursionError, which was a raw traceback (and a whole .json file too);
    # twice the limit of ~1,000 (5,000 took datasets' reader ~3 s of the ~0.4 s it takes now)
    deep = '{"question": "4+4", "answer": "8", "x": ' + "[" * 2000 + "]" * 2000 + "}"
    bad.write_text('{"question": "1+1", "answer": "2"}\n' + deep + "\n")
    too_deep = "is not valid JSON (nested too deeply to read (more than about 1,000 levels of brackets))."
    assert f"line 2 of {bad} {too_deep}" in plan_error(tmp_path, *taskset(bad))
    whole = tmp_path / "deep.json"
    whole.write_text("[" + deep + "]")
    assert f"line 1 of {whole} {too_deep}" in plan_error(tmp_path, *taskset(whole))


@pytest.mark.slow
def test_an_empty_split_file_in_a_dataset_directory_is_named(tmp_path):
    # datasets said only 'Instruction "test" corresponds to no data!'
    data = tmp_path / "mine"
    write_jsonl(data / "train.jsonl", [{"question": "1+1", "answer": "2"}] * 4)
    for empty in ["", "\n\n"]:
        (data / "test.jsonl").write_text(empty)
        assert plan_error(tmp_path, *taskset(data)[:-2], f"buffer.explorer_input.eval_tasksets.0.path={data}",
                          "buffer.batch_size=2") == (
            f"buffer.explorer_input.eval_tasksets[0].path='{data}', split='test': {data / 'test.jsonl'} holds no rows "
            f"(the file of that split in the directory). Put the split's rows in it, or point "
            f"buffer.explorer_input.eval_tasksets[0].path at data that has them.")


def test_a_file_that_is_not_utf8_names_its_line_and_byte(tmp_path):
    # a latin-1 "café" on line 3 (its é the 18th byte of '{"question": "café"'): pyarrow read it
    # without a word, and the first read of that row raised UnicodeDecodeError as a raw traceback
    f = write_jsonl(tmp_path / "tasks.jsonl", [{"question": "1+1", "answer": "2"}] * 2)
    f.write_bytes(f.read_bytes() + '{"question": "café", "answer": "1"}\n'.encode("latin-1"))
    assert plan_error(tmp_path, "dry_run=true", *taskset(f)) == (
        f"buffer.explorer_input.taskset.path='{f}': line 3 of {f} is not UTF-8 text (byte b'\\xe9' at column 18); "
        f"datasets are read as UTF-8. Convert the file (e.g. iconv -f latin1 -t utf-8 tasks.jsonl > "
        f"tasks.utf8.jsonl) or fix the line.")


def test_empty_prompts_are_an_error_naming_the_rows(tmp_path):
    # rows 1, 3, 5, 7 and 9 of 10 have "" or blanks: those tasks asked the model nothing (exit 0)
    rows = [{"question": "" if i % 2 else f"{i}+1", "answer": str(i + 1)} for i in range(10)]
    rows[3]["question"] = "  "
    f = write_jsonl(tmp_path / "tasks.jsonl", rows)
    assert plan_error(tmp_path, "dry_run=true", *taskset(f)) == (
        f"buffer.explorer_input.taskset: 5 of the 10 rows of '{f}' have an empty prompt in 'question' "
        f"(format.prompt_key): rows 1, 3, 5, 7, 9 (lines 2, 4, 6, 8, 10 of the file). Fill or remove those rows, "
        f"or set buffer.explorer_input.taskset.format.prompt_key to the column that holds the prompts.")
    # a training dataset (an SFT stage) is checked before the run too
    rows += [{"question": "", "answer": "1"}] * 3
    f = write_jsonl(tmp_path / "sft.jsonl", rows)
    assert plan_error(tmp_path, "dry_run=true", "stages=[]", "algorithm=sft", "buffer.explorer_input.eval_tasksets=[]",
                      f"buffer.trainer_input.experience_buffer.path={f}", "buffer.batch_size=2") == (
        f"buffer.trainer_input.experience_buffer: 8 of the 13 rows of '{f}' have an empty prompt in 'question' "
        f"(format.prompt_key): rows 1, 3, 5, 7, 9 and 3 more (lines 2, 4, 6, 8, 10 and 3 more of the file). Fill "
        f"or remove those rows, or set buffer.trainer_input.experience_buffer.format.prompt_key to the column "
        f"that holds the prompts.")


def test_blank_responses_of_a_training_dataset_are_an_error_naming_the_rows(tmp_path):
    # an SFT stage on them taught the model to answer nothing (exit 0)
    rows = [{"question": f"{i}+1", "answer": "" if i in (2, 5) else str(i + 1)} for i in range(8)]
    f = write_jsonl(tmp_path / "sft.jsonl", rows)
    assert plan_error(tmp_path, "dry_run=true", "stages=[]", "algorithm=sft", "buffer.explorer_input.eval_tasksets=[]",
                      f"buffer.trainer_input.experience_buffer.path={f}", "buffer.batch_size=2") == (
        f"buffer.trainer_input.experience_buffer: 2 of the 8 rows of '{f}' have an empty response in 'answer' "
        f"(format.response_key): rows 2, 5 (lines 3, 6 of the file). Fill or remove those rows, or set "
        f"buffer.trainer_input.experience_buffer.format.response_key to the column that holds the responses.")


def test_eval_sets_of_one_name_are_an_error(tmp_path):
    # their metrics, eval/<name>/accuracy, overwrote each other's
    ev = "{name: ev, path: ${cache_dir}/data/arithmetic-v4, split: test}"
    assert plan_error(tmp_path, "dry_run=true", "stages=[]", f"buffer.explorer_input.eval_tasksets=[{ev},{ev}]") == (
        "buffer.explorer_input.eval_tasksets: the name 'ev' is given to 2 eval sets; each needs a name of its own "
        "(their metrics are eval/<name>/...).")


def test_a_split_a_single_file_is_not_named_for_is_an_error(tmp_path):
    # an eval set of split=validation on the training file read its training rows (exit 0)
    f = write_jsonl(tmp_path / "tasks.jsonl", [{"question": "1+1", "answer": "2"}] * 4)
    assert plan_error(tmp_path, "dry_run=true", *taskset(f), "buffer.explorer_input.taskset.split=validation") == (
        f"buffer.explorer_input.taskset.path='{f}' is a single file, read whole, so split='validation' cannot pick "
        f"rows from it (they would be its rows, whatever the split). Point the path at the file that holds the "
        f"'validation' rows (a file whose name says 'validation', or a directory with validation.jsonl beside "
        f"train.jsonl), or set split=train to read this file as it is.")
    # a file named for its split is read for it
    test = write_jsonl(tmp_path / "gsm8k_test.jsonl", [{"question": "1+2", "answer": "3"}] * 4)
    rft.runtime.main._main(compose_cfg([f"checkpoint_root_dir={tmp_path / 'ck'}", "dry_run=true", *taskset(f),
                                f"+buffer.explorer_input.eval_tasksets=[{{path: {test}, split: test}}]"]))


def test_a_directory_without_data_files_says_what_it_holds(tmp_path):
    # its notes.txt was read as a dataset of one column 'text'
    d = tmp_path / "data"
    d.mkdir()
    (d / "notes.txt").write_text("the tasks are elsewhere")
    (d / "plot.png").write_bytes(b"\x89PNG")
    assert plan_error(tmp_path, "dry_run=true", *taskset(d)) == (
        f"buffer.explorer_input.taskset.path='{d}' is a directory with no JSONL, JSON, Parquet or CSV file in it "
        f"(it holds notes.txt, plot.png). Point it at a dataset file, a directory of them (train.jsonl, "
        f"test.jsonl), or a Hugging Face dataset id.")


def test_a_model_directory_without_a_model_is_named_when_planning(tmp_path):
    # transformers raised "Couldn't instantiate the backend tokenizer" in the explorer, a raw traceback
    d = tmp_path / "mymodel"
    d.mkdir()
    (d / "notes.txt").write_text("weights to come")
    assert plan_error(tmp_path, "dry_run=true", "stages=[]", "model.builder=null", f"model.model_path={d}") == (
        f"model.model_path='{d}' is a directory, but not a model in Hugging Face format: it has no config.json (it "
        f"holds notes.txt). Point it at the model's own directory (config.json, the weights, the tokenizer files).")


@pytest.mark.slow
def test_a_relative_path_says_relative_to_what(tmp_path):
    msg = plan_error(tmp_path, *taskset("./nowhere/tasks.jsonl"))
    assert msg.startswith(f"buffer.explorer_input.taskset.path='./nowhere/tasks.jsonl': no such file or directory "
                          f"(relative to {os.getcwd()}).")


def test_a_hub_id_that_cannot_be_loaded_says_no_local_path_first(tmp_path, monkeypatch):
    import datasets

    import rft.data.tasks

    def offline(*a, **k):
        raise ConnectionError("Couldn't reach 'data/tasks' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    monkeypatch.setattr(rft.data.tasks, "_hub_cached", lambda path: False)
    monkeypatch.setattr(rft.data.tasks, "_hub_unreachable", lambda path: None)  # the hub answers; the load fails
    # planned in this process (cluster=inline), where the patch is: a Ray run's planning child would
    # wait ~20 s on the hub's retries before the same message
    assert plan_error(tmp_path, "cluster=inline", *taskset("data/tasks")).startswith(
        f"buffer.explorer_input.taskset.path='data/tasks': there is no such local file or directory (relative to "
        f"{os.getcwd()}), and loading it as a Hugging Face dataset id failed (ConnectionError: Couldn't reach")


def test_a_dataset_missing_a_column_a_stage_needs_fails_the_dry_run(tmp_path):
    # the default's warm-up imitates `teacher_answer`; a taskset of the user's own may lack it
    d = tmp_path / "mytask"
    write_jsonl(d / "train.jsonl", [{"question": "1+1", "answer": "2"}] * 64)
    write_jsonl(d / "test.jsonl", [{"question": "1+2", "answer": "3"}] * 4)
    msg = plan_error(tmp_path, "dry_run=true", "buffer.explorer_input.generator=null",
                     f"buffer.explorer_input.taskset.path={d}", f"buffer.explorer_input.eval_tasksets.0.path={d}")
    assert msg == (
        f"stage sft_warmup: buffer.trainer_input.experience_buffer.path='{d}' has no column 'teacher_answer' "
        f"(buffer.trainer_input.experience_buffer.format.response_key, set by "
        f"stages.0.buffer.trainer_input.experience_buffer.format.response_key); its columns are ['answer', "
        f"'question']. Add the column to the data, or set "
        f"stages.0.buffer.trainer_input.experience_buffer.format.response_key to the column that holds it."
    )


@pytest.mark.slow
def test_a_taskset_without_its_answer_column_is_an_error_not_a_run_of_zero_rewards(tmp_path):
    data = write_jsonl(tmp_path / "t.jsonl", [{"question": "1+1", "solution": "2"}] * 4)
    assert plan_error(tmp_path, *taskset(data)) == (
        f"buffer.explorer_input.taskset.path='{data}' has no column 'answer' "
        f"(buffer.explorer_input.taskset.format.response_key); its columns are ['question', 'solution']. Add "
        f"the column to the data, or set buffer.explorer_input.taskset.format.response_key to the column that holds it."
    )


@pytest.mark.slow
def test_a_bad_taskset_path_is_named_by_the_key_the_user_set(tmp_path):
    # the warm-up stage reads the taskset's files by interpolation: name that key, not its own
    msg = plan_error(tmp_path, "buffer.explorer_input.generator=null", "buffer.explorer_input.taskset.path=/nowhere/data")
    assert msg.startswith("stage sft_warmup: buffer.explorer_input.taskset.path (read by "
                          "buffer.trainer_input.experience_buffer.path)='/nowhere/data': no such file or directory.")


def test_a_column_a_stage_names_is_named_by_the_key_that_sets_it(tmp_path):
    # the warm-up's entry sets its response_key (teacher_answer) itself and its prompt_key as the
    # taskset's: the message said "or set buffer.trainer_input.experience_buffer.format.response_key",
    # which the stage's own value overrides, so the same error came back (the dry run's message:
    # test_a_dataset_missing_a_column_a_stage_needs_fails_the_dry_run)
    from rft.runtime.main import dataset_size, split_stages

    data = write_jsonl(tmp_path / "d" / "train.jsonl", [{"q": "1+1", "a": "2"}, {"a": "3"}])
    where = "buffer.trainer_input.experience_buffer"
    ts = "buffer.explorer_input.taskset.format"

    def error(*overrides):
        stages, sources = split_stages(compose_cfg(
            ["buffer.explorer_input.generator=null", f"buffer.explorer_input.taskset.path={data.parent}",
             f"{ts}.prompt_key=q", f"{ts}.response_key=a", "buffer.explorer_input.eval_tasksets=[]", *overrides]))
        with pytest.raises(rft.runtime.main.ConfigError) as e:
            dataset_size(stages[0], sources[0])
        return str(e.value)

    assert error() == (
        f"{where}.path='{data.parent}' has no column 'teacher_answer' ({where}.format.response_key, set by "
        f"stages.0.{where}.format.response_key); its columns are ['a', 'q']. Add the column to the data, or set "
        f"stages.0.{where}.format.response_key to the column that holds it.")
    # row 1 has no prompt: the key to change is the taskset's, which the stage reads
    assert error(f"stages.0.{where}.format.response_key=a") == (
        f"{where}: row 1 (line 2 of train.jsonl) of '{data.parent}' has no 'q' (format.prompt_key); its keys "
        f"are ['a']. Fix the row (or leave it out), or set {ts}.prompt_key to the column that holds it.")


def test_a_plan_error_about_a_key_a_stage_sets_names_the_stages_key(tmp_path):
    # a shorter warm-up than its 50 warm-up steps: the message named algorithm.optimizer.warmup_steps,
    # which set at the top level is overridden by the model's warm-up entry (the same error again)
    assert plan_error(tmp_path, "dry_run=true", "stages.0.buffer.total_steps=30") == (
        "stage sft_warmup: algorithm.optimizer.warmup_steps=50 must be between 0 and the run's 30 optimizer steps "
        "(30 steps x 1 per step). The stage's own entry sets algorithm.optimizer.warmup_steps: change it there, "
        "stages.0.algorithm.optimizer.warmup_steps (the same key outside the stage does not change it).")
    # a key the stage does not set is the top-level one: no word more
    assert plan_error(tmp_path, "dry_run=true", "stages=[]", "buffer.total_steps=4",
                      "algorithm.optimizer.warmup_steps=5") == (
        "algorithm.optimizer.warmup_steps=5 must be between 0 and the run's 4 optimizer steps (4 steps x 1 per step).")


@pytest.mark.parametrize("overrides,message", [
    (["stages.0.mode=foo"], "stages[0].mode='foo' is not a mode; choose one of both, explore, train, bench."),
    (["model.max_response_tokens=0"], "stage sft_warmup: model.max_response_tokens=0 must be >= 1 (tokens)."),
    (["model.dtype=bf8"], "stage sft_warmup: model.dtype='bf8' is not a dtype; choose one of float32, fp32, float, "
                          "bfloat16, bf16, float16, fp16, half."),
    (["stages=[]", "model.builder=null", "model.model_path=/nowhere/model"],
     "model.model_path='/nowhere/model': no such directory (relative paths are relative to {cwd}). Give a local "
     "directory in Hugging Face format or a hub id (e.g. Qwen/Qwen2.5-0.5B-Instruct)."),
    (["stages=[]", "+buffer.trainer_input.auxiliary_buffers.extra.pathh=x.jsonl"],
     "buffer.trainer_input.auxiliary_buffers.extra: Key 'pathh' not in 'ExperienceBufferConfig'. Its keys are those "
     "of buffer.trainer_input.experience_buffer: ['capacity', 'eval_split', 'format', 'max_read_timeout', 'name', "
     "'path', 'replay_buffer', 'split', 'storage_type']."),
    (["stages=[]", "explorer.rollout_model.engine_type=sglang"],
     "explorer.rollout_model.engine_type='sglang' is not one of ['hf', 'vllm']; give a registered name or the dotted "
     "path of a class with the methods of rft/rollout/engines/base.py (module.Class)."),
    (["stages=[]", "trainer.trainer_strategy=deepspeed"],
     "trainer.trainer_strategy='deepspeed' is not one of ['fsdp2', 'torch']; give a registered name or the dotted "
     "path of a class with the methods of rft/trainer/base.py (module.Class)."),
    (["stages=[]", "+buffer.trainer_input.experience_buffer.replay_buffer.priority_fn_args.decayy=3"],
     "buffer.trainer_input.experience_buffer.replay_buffer.priority_fn_args has ['decayy'], which "
     "priority_fn=linear_decay does not take; its arguments are ['decay']. Did you mean decay (not decayy)?"),
])
@pytest.mark.slow
def test_user_mistakes_found_while_planning(tmp_path, overrides, message):
    assert plan_error(tmp_path, *overrides) == message.format(cwd=os.getcwd())


@pytest.mark.parametrize("override, choices", [
    ("mode=foo", "[both, explore, train, bench]"),
    ("buffer.trainer_input.experience_buffer.storage_type=redis", "[queue, sql, file]"),
    ("sync=memory synchronizer.sync_method=nccl", "[memory, checkpoint, collective]"),
])
@pytest.mark.slow
def test_a_closed_set_of_names_fails_when_the_config_is_composed(override, choices):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as e:
        compose_cfg(override.split())
    assert f"expected one of {choices}" in str(e.value.__cause__ or e.value)


def test_dtype_aliases_are_accepted():
    from rft.models import canonical_dtype, torch_dtype

    assert torch_dtype("bf16") is torch_dtype("bfloat16") and canonical_dtype("fp16") == "float16"
    rft.runtime.main._main(compose_cfg(["model.dtype=bf16", "dry_run=true"]))


@pytest.mark.slow
def test_an_existing_file_that_is_not_a_dataset_is_not_called_missing(tmp_path):
    f = tmp_path / "experiences.db"
    f.write_text("x")
    msg = plan_error(tmp_path, "stages=[]", "mode=train", "buffer=file", f"buffer.trainer_input.experience_buffer.path={f}")
    assert msg == (f"buffer.trainer_input.experience_buffer.path='{f}' is a file, but not one of the dataset formats "
                   f"(.jsonl, .json, .parquet, .csv): give a JSONL, JSON, Parquet or CSV file, or a directory of them.")


def test_an_unwritable_output_directory_fails_before_any_step(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(rft.runtime.main.ConfigError) as e:
        rft.runtime.main._main(compose_cfg(["stages=[]", "cluster=inline", f"checkpoint_root_dir={blocker}/out"]))
    run = blocker / "out" / "rft" / "grpo-tiny-arithmetic"
    assert str(e.value).startswith(f"cannot write to {run} (NotADirectoryError: ")
    assert str(e.value).endswith("Point checkpoint_root_dir (or RFT_CHECKPOINT_ROOT_DIR) at a writable directory.")


def test_misspelt_keys_get_the_nearest_names(run_root):
    r = run_cli("trainer.lr=1e-3", env=run_root)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "Could not override 'trainer.lr': Key 'lr' not in 'TrainerConfig'. Did you mean algorithm.optimizer.lr" in r.stderr


def test_two_algorithms_print_different_dry_runs(capsys):
    rft.runtime.main._main(compose_cfg(["dry_run=true", "stages=[]"]))
    grpo = capsys.readouterr().out
    rft.runtime.main._main(compose_cfg(["dry_run=true", "stages=[]", "algorithm=dr_grpo"]))
    dr = capsys.readouterr().out
    assert "algorithm      grpo: advantage_fn=grpo, policy_loss_fn=ppo_clip, loss_agg_mode=token-mean" in grpo
    assert "advantage_fn=dr_grpo" in dr and "loss_agg_mode=seq-mean-token-sum-norm" in dr
    for out in (grpo, dr):
        assert "reward         exact_match(prompt, response, task) with task.answer = column 'answer'" in out
        assert "eval sets      arithmetic_test (" in out and "learning rate  0.0002 (algorithm.optimizer.lr)" in out
        assert "outputs        " in out


@pytest.mark.slow  # a real engine, Ray or training run
def test_prompts_and_responses_past_the_token_budgets_are_counted_and_warned_about(tmp_path, capsys):
    # the tiny model's chat template takes 5 tokens (<|im_start|> user ... <|im_end|> <|im_start|>
    # assistant) around one token per character, spaces included: the long question's 30
    # characters make 35 > max_prompt_tokens=24. An answer keeps
    # max_response_tokens=6 - 1 tokens (then the end token): "4444444444" + end = 11 > 6
    rows = [{"question": "1+1", "answer": "2"}, {"question": "what is 1+1 plus 2+2 plus 3+3?", "answer": "12"},
            {"question": "2+2", "answer": "4444444444"}, {"question": "3+3", "answer": "6"}]
    data = write_jsonl(tmp_path / "t.jsonl", rows)
    common = ["buffer.explorer_input.generator=null", f"buffer.explorer_input.taskset.path={data}",
              "buffer.explorer_input.eval_tasksets=[]", "cluster=inline", "monitor=console", "buffer.total_steps=1",
              f"checkpoint_root_dir={tmp_path}", "stage_cache_dir=null"]
    rft.runtime.main.main(compose_cfg([*common, "stages=[]", "buffer.batch_size=4", "algorithm.repeat_times=2", "name=rl"]))
    out = capsys.readouterr().out
    import gc

    assert gc.get_freeze_count() == 0  # what the stage froze (rft.runtime.actors.long_lived), unfrozen at its end
    assert (f"rft: warning: stage grpo: 1 of the first 4 prompts of buffer.explorer_input.taskset ({data}) are "
            f"longer than model.max_prompt_tokens=24 tokens (the longest has 35, chat template included) and "
            f"will be cut from the left") in out
    from rft.reporting.monitor import read_metrics

    assert read_metrics(tmp_path / "rft" / "rl" / "metrics.jsonl")[-1]["rollout/truncated_prompts"] == 1
    rft.runtime.main.main(compose_cfg([*common, "algorithm=sft", "stages=[]", "buffer.train_batch_size=4", "name=sft"]))
    out = capsys.readouterr().out
    assert "1 of its first 4 responses are longer than model.max_response_tokens=6 (end-of-sequence token included; " \
           "the longest has 11) and will be cut" in out
    m = read_metrics(tmp_path / "rft" / "sft" / "metrics.jsonl")[-1]
    assert (m["train/truncated_prompts"], m["train/truncated_responses"]) == (1, 1)


@pytest.mark.slow  # a real engine, Ray or training run
def test_ctrl_c_says_how_to_resume_without_a_traceback(run_root):
    import signal
    import time

    from resume_support import Forked

    env = {**os.environ, **run_root}
    # small steps and no eval at the start: the interrupt comes once step 2's checkpoint is whole
    args = ["stages=[]", "cluster=inline", "monitor=console", "name=stopped", "buffer.total_steps=400",
            "trainer.save_interval=2", "explorer.eval_interval=1000", "explorer.eval_on_startup=false",
            "buffer.batch_size=4", "algorithm.repeat_times=2"]
    # `python run.py <args>` forked from a process that imported torch (resume_support.Forked: the
    # same run without a fresh interpreter's imports; SIGINT's handler is Python's own, as there)
    proc = Forked(args, env, Path(run_root["RFT_CHECKPOINT_ROOT_DIR"]).parent / "stopped_run")
    step_2 = Path(run_root["RFT_CHECKPOINT_ROOT_DIR"]) / "rft" / "stopped" / "checkpoints" / "step_2"
    deadline = time.time() + 300
    while not (step_2 / "state.json").exists():
        assert proc.poll() is None and time.time() < deadline, "the run ended before its step-2 checkpoint"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)  # what Ctrl-C sends
    proc.wait(timeout=120)
    err = (Path(run_root["RFT_CHECKPOINT_ROOT_DIR"]).parent / "stopped_run.err").read_text()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    newest = re.search(r"rft: interrupted\. Run the same command again to resume \(the newest checkpoint: (\S+)\)\.",
                       err)
    assert newest, err[-3000:]
    # the newest at the moment of the interrupt: step 2 or a later one
    assert Path(newest.group(1)).parent == step_2.parent and (Path(newest.group(1)) / "state.json").exists()


@pytest.mark.slow  # a real engine, Ray or training run
def test_ctrl_c_in_a_sweep_says_how_to_resume_that_sweep(run_root):
    # it said "Run the same command again", which starts the sweep over in a new directory
    import signal
    import time

    from conftest import ROOT
    from resume_support import Forked, forked_to_end

    args = ["-m", "stages=[]", "cluster=inline", "monitor=console", "buffer.total_steps=400", "trainer.save_interval=2",
            "explorer.eval_interval=1000", "explorer.eval_on_startup=false", "buffer.batch_size=4",
            "algorithm.repeat_times=2", "seed=1,2"]
    # forked as in test_ctrl_c_says_how_to_resume_without_a_traceback (the basic launcher runs the jobs in it)
    out = Path(run_root["RFT_CHECKPOINT_ROOT_DIR"]).parent / "sweep_run"
    proc = Forked(args, {**os.environ, **run_root}, out)
    sweeps = Path(run_root["RFT_CHECKPOINT_ROOT_DIR"]) / "rft" / "multirun"
    deadline = time.time() + 300
    while not list(sweeps.glob("*/0/checkpoints/step_2/state.json")):
        assert proc.poll() is None and time.time() < deadline, "the sweep ended before its step-2 checkpoint"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)
    proc.wait(timeout=120)
    err = out.with_suffix(".err").read_text()
    [sweep] = sweeps.iterdir()
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert (f"rft: interrupted. Run the same command again with hydra.sweep.dir={sweep} to resume this sweep (the "
            f"newest checkpoint: {sweep}/0/checkpoints/step_") in err, err[-3000:]
    assert "without it, the sweep starts over in a new directory." in err
    # a job the run stops says so too
    r = forked_to_end(["-m", "stages=[]", "cluster=inline", "buffer.total_steps=2", "seed=1,2",
                       "buffer.explorer_input.default_reward_fn_type=faulty_reward.always_raises"],
                      {**os.environ, **run_root, "PYTHONPATH": str(ROOT / "tests")}, out.parent / "failing_sweep")
    [second] = [d for d in sweeps.iterdir() if d != sweep]
    assert r.returncode == 1 and "rft: the run stopped: every task of the eval set" in r.stderr, r.stderr[-3000:]
    assert (f"run the same command again to resume from the newest checkpoint: none yet. explorer.max_failed_steps=0 "
            f"lets a run go on regardless. In this sweep, the same command is the sweep with "
            f"hydra.sweep.dir={second} added; without it, the sweep starts over in a new directory.") in r.stderr


def test_an_overlay_that_is_not_yaml_is_one_paragraph_not_a_traceback(run_root, tmp_path):
    import shutil
    import subprocess
    import sys

    from conftest import CONF, ROOT

    # a study's copy of run.py and conf/, with an overlay indented wrongly on its line 4
    shutil.copy(ROOT / "run.py", tmp_path / "run.py")
    shutil.copytree(CONF, tmp_path / "conf")
    (tmp_path / "conf" / "experiment" / "mine.yaml").write_text(
        "# @package _global_\nbuffer:\n  total_steps: 20\n   batch_size: 4\n")
    r = subprocess.run([sys.executable, "run.py", "experiment=mine"], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, **run_root}, timeout=120)
    assert r.returncode == 2
    assert ("rft: configuration error: conf/experiment/mine.yaml is not valid YAML: mapping values are not allowed "
            "in this context at line 4, column 14. Fix the file (a common cause: the keys of one mapping "
            "indented by different numbers of spaces, or a tab).") in r.stderr
    assert "Traceback" not in r.stderr
    assert_nothing_started(run_root)


@pytest.mark.slow
def test_an_override_hydra_cannot_read_says_how_to_quote_it(run_root):
    # Hydra said only "LexerNoViableAltException: name=résumé" under a caret
    r = run_cli("name=résumé", "dry_run=true", env=run_root)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert ("rft: configuration error: the override 'name=résumé' does not parse: Hydra's override grammar takes "
            "only ASCII letters in a value that is not quoted. Quote the value, with single quotes around the "
            "whole for the shell: 'name=\"résumé\"'.") in r.stderr
    r = run_cli('name="résumé"', "stages=[]", "dry_run=true", env=run_root)
    assert r.returncode == 0 and "/rft/résumé" in r.stdout
    # a dict the shell split at its space: Hydra's "no viable alternative at input '{path:'"
    r = run_cli("stages=[]", "+buffer.explorer_input.eval_tasksets.1={path:", "data.jsonl}", env=run_root)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert ("the override '+buffer.explorer_input.eval_tasksets.1={path:' does not parse: its list or dict is not "
            "closed, most likely because the shell split it at a space. Put the whole override in single quotes: "
            "'+buffer.explorer_input.eval_tasksets.1={path: ...'.") in r.stderr


def test_an_overlay_naming_a_missing_option_names_its_file_and_line(run_root, tmp_path):
    import shutil
    import subprocess
    import sys

    from conftest import CONF, ROOT

    # Hydra said "In 'config': Could not find 'model/tinyy'", without the overlay's file
    shutil.copy(ROOT / "run.py", tmp_path / "run.py")
    shutil.copytree(CONF, tmp_path / "conf")
    (tmp_path / "conf" / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - base\n  - _self_\n")
    (tmp_path / "conf" / "experiment" / "base.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /algorithm: grpo\n  - override /model: tinyy\n")
    r = subprocess.run([sys.executable, "run.py", "experiment=mine"], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, **run_root}, timeout=120)
    assert r.returncode == 2
    assert ("rft: configuration error: conf/experiment/base.yaml, line 4: its defaults list names 'model/tinyy', "
            "but there is no conf/model/tinyy.yaml (the options of 'model' are qwen2.5-0.5b, qwen2.5-0.5b-shape, qwen2.5-1.5b-shape, qwen7b, tiny, "
            "tiny_tools). Fix the name in that file.") in r.stderr
    assert_nothing_started(run_root)


@pytest.mark.slow  # three dry runs (~10 s)
def test_a_study_kept_outside_conf_through_hydra_searchpath_composes(run_root, tmp_path):
    # run.py's check looked for experiment=mine in conf/ only and refused it before Hydra, which
    # would have found it in the search path's folder (and a group of the study's own as a key)
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("# @package _global_\nname: kept_outside\n")
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / "one.yaml").write_text("# @package _global_\nseed: 7\n")
    search = f"hydra.searchpath=[file://{tmp_path}]"
    r = run_cli(search, "experiment=mine", "+probe=one", "stages=[]", "dry_run=true", env=run_root)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "rft/kept_outside" in r.stdout  # the outputs line: the study's name, from the folder outside
    # a misspelt option: rft's paragraph, with the options of both folders (Hydra's "Could not find" had no hint)
    r = run_cli(search, "experiment=mien", "stages=[]", "dry_run=true", env=run_root)
    assert r.returncode == 2 and (f"experiment=mien: there is no experiment/mien.yaml in conf/ or {tmp_path}/ (the "
                                  f"options of 'experiment' are algorithms_countdown, ") in r.stderr
    assert ", mine, " in r.stderr and r.stderr.rstrip().endswith(". Did you mean experiment=mine?")
    # without the search path, rft's own check as before
    r = run_cli("experiment=mine", "stages=[]", "dry_run=true", env=run_root)
    assert r.returncode == 2 and "rft: configuration error: experiment=mine: there is no conf/experiment/mine.yaml" in r.stderr


@pytest.mark.slow  # two jobs planned (~3 s)
def test_a_sweep_of_a_study_kept_outside_conf_is_planned_job_by_job_first(tmp_path):
    """`python run.py -m 'hydra.searchpath=[file://<study>]' model=mine buffer.batch_size=4,0`: the
    check that plans every job first composed each job without the search path, so Hydra printed
    "UserWarning: Callback Checks.on_multirun_start raised MissingConfigException" and the sweep
    started unplanned (job 0 trained before job 1's batch size of 0 stopped it)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import read_write

    from rft.runtime.callbacks import plan_jobs

    (tmp_path / "model").mkdir()  # the study's own model: the tiny one under another name
    (tmp_path / "model" / "mine.yaml").write_text((CONF / "model" / "tiny.yaml").read_text())
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"hydra.searchpath=[file://{tmp_path}]", "model=mine", "stages=[]"],
                      return_hydra_config=True)
        with read_write(cfg.hydra.overrides.task):  # as `-m ... buffer.batch_size=4,0`
            cfg.hydra.overrides.task.append("buffer.batch_size=4,0")
        said = plan_jobs(cfg, "config")
    GlobalHydra.instance().clear()
    assert said.startswith("job 1 of the sweep (buffer.batch_size=0): buffer.batch_size=0 ")
    assert said.endswith(" No job has started: every job is planned first.")


@pytest.mark.slow
def test_a_checkpoint_root_under_a_file_is_one_paragraph_before_hydra_makes_the_run_dir(run_root, tmp_path):
    # Hydra made the run's directory before rft's check: NotADirectoryError under its traceback
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    r = run_cli("stages=[]", f"checkpoint_root_dir={blocker}/out", env=run_root)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert (f"rft: configuration error: cannot write to {blocker}/out/rft/grpo-tiny-arithmetic (NotADirectoryError: "
            f"Not a directory). Point checkpoint_root_dir (or RFT_CHECKPOINT_ROOT_DIR) at a writable directory.") in r.stderr
    # a read-only place: Hydra's PermissionError (root writes anywhere chmod forbids; sysfs refuses it too)
    read_only = tmp_path / "read_only"
    read_only.mkdir(mode=0o555)
    root = Path("/sys") if os.geteuid() == 0 else read_only
    r = run_cli("stages=[]", f"checkpoint_root_dir={root}/out", env=run_root)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert (f"rft: configuration error: cannot write to {root}/out/rft/grpo-tiny-arithmetic (PermissionError: "
            in r.stderr)
    # a name that climbs out of the project's directory is refused before Hydra makes it
    r = run_cli("stages=[]", f"checkpoint_root_dir={tmp_path}/ck", "name=../../escaped", env=run_root)
    assert r.returncode == 2 and "rft: configuration error: name='../../escaped': the run's outputs go to" in r.stderr
    assert not (tmp_path / "escaped").exists()
    # a sweep's directory too (Hydra's sweeper makes it)
    r = run_cli("-m", "stages=[]", "seed=1,2", f"checkpoint_root_dir={blocker}/out", env=run_root)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"rft: configuration error: cannot write to {blocker}/out/rft/multirun/" in r.stderr


def test_a_list_addressed_by_a_name_says_to_use_an_index(run_root):
    # Hydra raised "TypeError: Index 'sft_warmup' (str) is not an int" under a traceback
    r = run_cli("stages.sft_warmup.buffer.total_steps=10", "dry_run=true", env=run_root)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert ("rft: configuration error: Could not override 'stages.sft_warmup.buffer.total_steps': stages is a list, so "
            "its items are addressed by their index (stages.0.<key> for the first), not by a name ('sft_warmup'). "
            "`python run.py --cfg job -p stages` prints it.") in r.stderr
    assert_nothing_started(run_root)


@pytest.mark.slow
def test_a_study_module_that_cannot_be_imported_names_its_file_and_line(tmp_path, monkeypatch):
    # a syntax error, or code that raises at import, ended the dry run in a raw traceback
    study = tmp_path / "my_broken_study"
    study.mkdir()
    (study / "__init__.py").write_text("")
    (study / "syntax.py").write_text("def f(prompt, response, task)\n    return 1.0\n")
    (study / "raises.py").write_text("import os\n\nKEY = os.environ['MY_STUDY_KEY']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("MY_STUDY_KEY", raising=False)
    key = "buffer.explorer_input.default_reward_fn_type"
    assert plan_error(tmp_path, "stages=[]", f"{key}=my_broken_study.syntax.f") == (
        f"{key}='my_broken_study.syntax.f': cannot import it: {study / 'syntax.py'}, line 1: SyntaxError: "
        f"expected ':'. Fix that line.")
    assert plan_error(tmp_path, "stages=[]", f"{key}=my_broken_study.raises.f") == (
        f"{key}='my_broken_study.raises.f': importing my_broken_study.raises raised KeyError: 'MY_STUDY_KEY' "
        f"({study / 'raises.py'}, line 3). Fix the module: its top-level code runs when it is imported.")


MINE = "# @package _global_\n# python run.py experiment=mine\n"


@pytest.mark.parametrize("files, args, message", [
    # Hydra: "In 'experiment/mine': ConfigKeyError ... Key 'temprature' not in 'RolloutArgs'", no line, no nearby key
    ({"experiment/mine.yaml": MINE + "buffer:\n  explorer_input:\n    taskset:\n      rollout_args:\n"
                                     "        temprature: 0.7\n"},
     ["experiment=mine"],
     "conf/experiment/mine.yaml, line 7: buffer.explorer_input.taskset.rollout_args.temprature: Key 'temprature' "
     "not in 'RolloutArgs'. Did you mean buffer.explorer_input.taskset.rollout_args.temperature"),
    # inside an eval set: Hydra's full_key was "format.promt_key", without the eval set
    ({"task/mine.yaml": "# @package buffer.explorer_input\ntaskset:\n  path: data/mine\neval_tasksets:\n"
                        "  - name: mine_test\n    format:\n      promt_key: question\n"},
     ["task=mine"],
     "conf/task/mine.yaml, line 7: buffer.explorer_input.eval_tasksets.0.format.promt_key: Key 'promt_key' not in "
     "'FormatConfig'. Did you mean buffer.explorer_input.eval_tasksets.0.format.prompt_key"),
    ({}, ["buffer.explorer_input.eval_tasksets.0.format.promt_key=question"],
     "Could not override 'buffer.explorer_input.eval_tasksets.0.format.promt_key': Key 'promt_key' not in "
     "'FormatConfig'. Did you mean buffer.explorer_input.eval_tasksets.0.format.prompt_key"),
    # inside an overlay's stages list: the planner's "stages[0] (warm): Key 'totalsteps' not in
    # 'BufferConfig'     full_key: buffer.totalsteps", without the file, line or nearby key
    ({"experiment/mine.yaml": MINE + "stages:\n  - stage_name: warm\n    buffer:\n      totalsteps: 30\n"},
     ["experiment=mine"],
     "conf/experiment/mine.yaml, line 6: stages.0.buffer.totalsteps: Key 'totalsteps' not in 'BufferConfig'. "
     "Did you mean stages.0.buffer.total_steps or stages.0.buffer.total_epochs?"),
    # Hydra: "Could not override 'stages.0.buffer.totalsteps'. To append to your config use
    # +stages.0.buffer.totalsteps=3 / Key 'totalsteps' is not in struct", whose + the planner then refused
    ({}, ["stages.0.buffer.totalsteps=3"],
     "Could not override 'stages.0.buffer.totalsteps': Key 'totalsteps' not in 'BufferConfig'. Did you mean "
     "stages.0.buffer.total_steps or stages.0.buffer.total_epochs?"),
    ({}, ["+stages.1.trainer.save_intervall=3"],
     "Could not add 'stages.1.trainer.save_intervall': Key 'save_intervall' not in 'TrainerConfig'. Did you mean "
     "stages.1.trainer.save_interval or stages.1.trainer.save_hf_checkpoint?"),
    # Hydra: "Key 'experiment' not in 'Config'"
    ({"experiment/mine.yaml": "defaults:\n  - override /task: countdown\n  - _self_\nname: mine\n"},
     ["experiment=mine"],
     "conf/experiment/mine.yaml has no `# @package` line, so Hydra puts its keys under 'experiment', which the "
     "config does not have (it stopped with \"Key 'experiment' not in 'Config'\"). Make its first line "
     "`# @package _global_`, as in the other files of conf/experiment/."),
    # a wrong package: "line 4: global.name: Key 'global' not in 'Config'", naming a key of a right file
    ({"experiment/mine.yaml": "# @package global\ndefaults:\n  - _self_\nname: mine\nbuffer:\n  total_steps: 20\n"
                                "hydra:\n  sweeper:\n    params:\n      seed: 1,2\n"},
     ["experiment=mine"],
     "conf/experiment/mine.yaml, line 1: `# @package global` puts its keys under 'global' (line 4: global.name, "
     "which the config does not have), where the other files of conf/experiment/ have `# @package _global_`. Make "
     "it `# @package _global_`."),
    ({"experiment/mine.yaml": "# @package _group_\nname: mine\n"},
     ["experiment=mine"],
     "conf/experiment/mine.yaml, line 1: `# @package _group_` puts its keys under 'experiment' (line 2: "
     "experiment.name, which the config does not have), where the other files of conf/experiment/ have "
     "`# @package _global_`. Make it `# @package _global_`."),
    ({"task/mine.yaml": "taskset:\n  path: data/mine\n"},
     ["task=mine"],
     "conf/task/mine.yaml has no `# @package` line, so Hydra puts its keys under 'task', which the config does not "
     "have (it stopped with \"Key 'task' not in 'Config'\"). Make its first line `# @package buffer.explorer_input`, "
     "as in the other files of conf/task/."),
    # Hydra: "Multiple values for task. To override a value use 'override task: countdown'", which in an
    # overlay names experiment/task/countdown
    ({"experiment/mine.yaml": MINE + "defaults:\n  - /task: countdown\n  - _self_\n"},
     ["experiment=mine"],
     "conf/experiment/mine.yaml, line 4: its defaults list chooses '/task: countdown', but conf/config.yaml "
     "chooses task already (Hydra: \"Multiple values for task\"). Write `override /task: countdown`."),
    ({"experiment/mine.yaml": MINE + "defaults:\n  - override task: countdown\n  - _self_\n"},
     ["experiment=mine"],
     "conf/experiment/mine.yaml, line 4: its defaults list names 'experiment/task/countdown', but there is no "
     "conf/experiment/task/countdown.yaml (there is no group 'experiment/task'; a group of the whole config takes "
     "a leading /: `override /task: countdown`). Fix the name in that file."),
    # composed without a word: grpo's values replaced the file's own (clip 0.2, algorithm_type grpo)
    ({"algorithm/mine.yaml": "defaults:\n  - _self_\n  - grpo\nalgorithm_type: mine\nclip_ratio_high: 0.28\n"},
     ["algorithm=mine"],
     "conf/algorithm/mine.yaml, line 2: `_self_` comes before 'grpo' in its defaults list, so the values of "
     "conf/algorithm/grpo.yaml replace this file's own (algorithm.algorithm_type, algorithm.clip_ratio_high): "
     "Hydra merges the list in order. Put `_self_` last."),
    # a sweep's option: Hydra warned from its callback ("Callback Checks.on_multirun_start raised
    # MissingConfigException"), then printed the message twice
    ({}, ["-m", "algorithm=grpo,drgrpo"],
     "algorithm=drgrpo: there is no conf/algorithm/drgrpo.yaml (the options of 'algorithm' are cpgd, dapo, dpo, "
     "dr_grpo, gmpo, grpo, gspo, mix, opd, opmd, ppo, reinforce_pp, reinforce_pp_baseline, rloo, rm, sft). Did you mean "
     "algorithm=dr_grpo?"),
])
def test_a_studys_own_config_files_are_checked_before_hydra_composes_them(tmp_path, monkeypatch, capsys, files,
                                                                         args, message):
    import shutil

    from conftest import CONF

    from rft.plan.overlays import exit_on_config_mistakes

    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    for name, text in files.items():
        (conf / name).write_text(text)
    monkeypatch.chdir(tmp_path)  # the files are named relative to where run.py runs
    with pytest.raises(SystemExit) as e:
        exit_on_config_mistakes(args, conf)
    assert e.value.code == 2
    assert f"rft: configuration error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("args, given", [
    (["-m", "hydra/launcher=slurm", "--cfg", "hydra", "-p", "hydra.launcher"], "-m and --cfg"),
    (["--multirun", "seed=1,2", "--cfg=job"], "--multirun and --cfg"),
    (["-c", "job", "--info"], "-c and --info"),
])
def test_two_of_hydras_modes_at_once_are_one_paragraph(capsys, args, given):
    # `python run.py -m hydra/launcher=slurm --cfg hydra -p hydra.launcher` (to see a sweep's
    # launcher keys) was Hydra's raw traceback: "ValueError: Only one of --run, --multirun, --cfg,
    # --info and --shell_completion can be specified"
    from conftest import CONF

    from rft.plan.overlays import exit_on_config_mistakes

    with pytest.raises(SystemExit) as e:
        exit_on_config_mistakes(args, CONF)
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        f"\nrft: configuration error: {given} cannot be given together: Hydra does one of them (-m/--multirun "
        f"runs a sweep, --cfg/-c prints the config and runs nothing, --info prints where it comes from). "
        f"To see a sweep's config, drop -m: the same overrides compose the same config, "
        f"hydra/launcher=slurm's keys included (--cfg hydra -p hydra.launcher).\n\n")


def test_cfg_alone_or_config_name_flags_are_not_read_as_two_modes():
    from conftest import CONF

    from rft.plan.overlays import exit_on_config_mistakes, modes_at_once

    for args in (["hydra/launcher=slurm", "--cfg", "hydra", "-p", "hydra.launcher"],
                 ["-m", "-cn", "config", "seed=1,2"]):  # -cn is the config's name, not -c
        assert modes_at_once(args) is None, args
        assert exit_on_config_mistakes(args, CONF) is None, args  # (a mistake exits with status 2)


@pytest.mark.parametrize("args, flags, unread, line", [
    (["model=tiny", "-m", "seed=1,2", "dry_run=true"], "-m", "seed=1,2 dry_run=true", "-m model=tiny seed=1,2 dry_run=true"),
    (["model=tiny", "--cfg", "job", "seed=3"], "--cfg job", "seed=3", "--cfg job model=tiny seed=3"),
    (["a=1", "-m", "-cn", "config", "b=2"], "-m -cn config", "b=2", "-m -cn config a=1 b=2"),
])
def test_a_flag_after_an_override_is_one_paragraph_with_the_line_reordered(capsys, args, flags, unread, line):
    # `python run.py model=tiny -m seed=1,2` was argparse's usage and "run.py: error: unrecognized
    # arguments: seed=1,2": Hydra's parser reads the overrides as one run, after its flags
    from conftest import CONF

    from rft.plan.overlays import exit_on_config_mistakes

    with pytest.raises(SystemExit) as e:
        exit_on_config_mistakes(args, CONF)
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        f"\nrft: configuration error: {flags} comes after an override: Hydra reads its flags only before the "
        f"overrides, and said \"unrecognized arguments: {unread}\". Put the flags first: python run.py {line}\n\n")


def test_flags_first_or_last_and_an_invalid_choice_are_not_read_as_a_flag_after_an_override():
    from rft.plan.overlays import flag_after_override

    assert flag_after_override(["-m", "model=tiny", "seed=1,2"]) is None
    assert flag_after_override(["model=tiny", "seed=1,2", "-m"]) is None  # argparse reads a trailing flag
    assert flag_after_override(["a=1", "--info", "seed=2"]) is None  # not one of --info's choices: Hydra's words
    assert flag_after_override(["a=1", "--n_samples_per_prompt", "8", "b=2"]) is None  # foreign_flag's


def test_a_reward_fn_list_of_parts_in_a_task_file_passes_the_key_check(tmp_path):
    # README "Writing a reward" puts the parts in conf/task/<yours>.yaml; the key check read the
    # list's items as keys of the schema's Any-typed reward_fn and refused the file ("line 4:
    # buffer.explorer_input.taskset.reward_fn.0.fn: Key '0' not in 'NoneType'")
    import shutil

    from conftest import CONF

    from rft.plan.overlays import check

    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "task" / "mine.yaml").write_text(
        "# @package buffer.explorer_input\ntaskset:\n  reward_fn:\n    - {fn: countdown, weight: 1.0}\n"
        "    - {fn: format, weight: 0.1, name: fmt}\n")
    (conf / "experiment" / "mine.yaml").write_text(
        MINE + "stages:\n  - stage_name: rl\n    buffer:\n      explorer_input:\n        taskset:\n"
               "          reward_fn:\n            - {fn: countdown}\n")
    assert check(["task=mine"], conf) is None
    assert check(["experiment=mine"], conf) is None
    # the typed keys beside the list are still checked
    (conf / "task" / "mine.yaml").write_text(
        "# @package buffer.explorer_input\ntaskset:\n  reward_fn:\n    - {fn: countdown}\n  reward_fnn: format\n")
    assert check(["task=mine"], conf) == (
        "conf/task/mine.yaml, line 5: buffer.explorer_input.taskset.reward_fnn: Key 'reward_fnn' not in "
        "'TasksetConfig'. Did you mean buffer.explorer_input.taskset.reward_fn or buffer.explorer_input.taskset.workflow? "
        "The keys, each with a comment, are in "
        "rft/config.py; `python run.py --cfg job` prints the composed config.")


@pytest.mark.slow
def test_the_shipped_config_files_pass_the_checks_of_a_studys_own():
    from conftest import CONF

    from rft.plan.overlays import check

    for path in sorted(CONF.rglob("*.yaml")):
        group = path.parent.relative_to(CONF).as_posix()
        if group != ".":
            assert check([f"{group}={path.stem}"], CONF) is None, path
    # what Hydra expands or resolves itself is left to it
    assert check(["-m", "algorithm=glob(gr*)", "task=${oc.env:MY_TASK}"], CONF) is None


def test_a_config_file_that_is_not_utf8_is_named_with_its_line(tmp_path, monkeypatch, capsys):
    # an editor that saved "café" as latin-1: UnicodeDecodeError under a traceback of run.py
    import shutil

    from conftest import CONF

    from rft.plan.overlays import exit_on_config_mistakes

    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "experiment" / "mine.yaml").write_bytes("# @package _global_\n# café study\nname: cafe\n".encode("latin-1"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        exit_on_config_mistakes(["experiment=mine"], conf)
    assert e.value.code == 2
    assert ("rft: configuration error: conf/experiment/mine.yaml is not UTF-8 text (byte b'\\xe9' at line 2, column "
            "6); config files are read as UTF-8. Convert it (e.g. iconv -f latin1 -t utf-8 mine.yaml > "
            "mine.utf8.yaml, then rename it) or fix the line.") in capsys.readouterr().err


def test_a_list_key_given_one_value_is_one_paragraph_naming_the_list_form(run_root):
    # Trinity-RFT's guide writes monitor_type: wandb; here it is a list, and Hydra said only
    # "Invalid value assigned: str is not a ListConfig, list or tuple" with its own frame
    from rft.plan.overlays import scalar_for_list

    groups = {p.name for p in CONF.iterdir() if p.is_dir()}
    assert scalar_for_list(["monitor.monitor_type=wandb"], groups) == (
        "monitor.monitor_type=wandb: monitor.monitor_type takes a list; write monitor.monitor_type=[wandb] (a list "
        "of one), or several as [a,b].")
    assert scalar_for_list(["cluster.device_mapping.trainer=0"], groups).startswith(
        "cluster.device_mapping.trainer=0: cluster.device_mapping.trainer takes a list; write "
        "cluster.device_mapping.trainer=[0]")
    # a list of ids given a word: [abc] would only move the mistake into the list
    assert scalar_for_list(["model.stop_token_ids=abc"], groups) == (
        "model.stop_token_ids=abc: model.stop_token_ids takes a list of integers (e.g. token ids), and 'abc' is not "
        "one; write model.stop_token_ids=[a] or [a,b] with whole numbers, or model.stop_token_ids=[] for none.")
    # a list, null, an interpolation, a scalar key, a sweep, a stage's free-form keys, a group: not this mistake
    for fine in (["monitor.monitor_type=[wandb]"], ["cluster.device_mapping.trainer=null"], ["seed=3"],
                 ["monitor.monitor_type=${oc.env:X}"], ["stages.0.seed=3"], ["monitor=console"], ["seed=1,2"]):
        assert scalar_for_list(fine, groups) is None, fine
    r = run_cli("monitor.monitor_type=wandb", env=run_root)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "ListConfig" not in r.stderr
    assert "rft: configuration error: monitor.monitor_type=wandb: monitor.monitor_type takes a list" in r.stderr


def test_a_number_in_a_text_column_of_a_jsonl_file_is_an_error_naming_its_row(tmp_path):
    # one row's answer written as a number made the datasets library read the whole column as JSON:
    # every answer "58" reached the reward as the number 58 ("007" as 7), so a reward comparing
    # text scored every row 0, or raised on each (exit 0, or the eval's failure blamed on the reward)
    rows = [{"question": f"{i}+1", "answer": str(i + 1)} for i in range(6)]
    rows[3]["answer"] = 4
    f = write_jsonl(tmp_path / "tasks.jsonl", rows)
    assert plan_error(tmp_path, "dry_run=true", *taskset(f)) == (
        f"buffer.explorer_input.taskset: row 3 (line 4 of its JSONL file) of '{f}' holds a number in 'answer' "
        f"(format.response_key), where the other 5 rows hold text. With two kinds of value in one column, the "
        f"datasets library reads every value of it as JSON, so the text '58' would arrive as the number 58 and "
        f"'007' as 7. Write that row's value as text (\"4\", quoted) or give every row of the column the same kind.")
    # in a prompt column too ("1e3" would become the prompt "1000.0")
    rows[3]["answer"], rows[1]["question"], rows[2]["question"] = "4", 2, [2]
    write_jsonl(f, rows)
    assert plan_error(tmp_path, "dry_run=true", *taskset(f)) == (
        f"buffer.explorer_input.taskset: rows 1, 2 (lines 2, 3 of its JSONL file) of '{f}' hold a number, a list in "
        f"'question' (format.prompt_key), where the other 4 rows hold text. With two kinds of value in one column, "
        f"the datasets library reads every value of it as JSON, so the text '58' would arrive as the number 58 and "
        f"'007' as 7. Write those rows' values as text (\"2\", quoted) or give every row of the column the same kind. "
        f"For chat messages set buffer.explorer_input.taskset.format.prompt_type=messages (and format.messages_key).")
    # a column of numbers only is read as numbers, row for row: no error
    from rft.data.tasks import load_rows, mixed_kinds

    write_jsonl(f, [{"question": f"{i}+1", "answer": i + 1 if i else [1]} for i in range(6)])  # numbers, a list
    assert mixed_kinds(load_rows(str(f)), "answer", "w", str(f), "response_key") is None


def test_a_hub_dataset_with_no_hub_to_ask_is_one_paragraph_without_the_retries(tmp_path, monkeypatch):
    """Without network, datasets.load_dataset retries the hub for ~25 s (a warning a try) before it
    fails: the hub is asked once first (10 s at most), and a dataset this machine downloaded before
    is still read from the cache."""
    import datasets
    import httpx
    from huggingface_hub import HfApi, constants

    from rft.data.tasks import load_rows
    from rft.errors import ConfigError

    asked, loaded = [], []

    def dataset_info(self, repo_id, timeout=None):
        asked.append((repo_id, timeout))
        raise httpx.ConnectError("[Errno -2] Name or service not known")

    monkeypatch.setattr(HfApi, "dataset_info", dataset_info)
    monkeypatch.setattr(datasets, "load_dataset", lambda path, **k: loaded.append((path, k)) or "rows")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    with pytest.raises(ConfigError) as e:
        load_rows("someorg/sometasks", "train", "main", key="buffer.explorer_input.taskset.path")
    assert str(e.value) == (
        f"buffer.explorer_input.taskset.path='someorg/sometasks': there is no such local file or directory "
        f"(relative to {os.getcwd()}), and it is not in this machine's Hugging Face cache, and the hub cannot be "
        f"reached from here (ConnectError: [Errno -2] Name or service not known). Give the local path (absolute, or "
        f"relative to the directory you run from), or download the dataset first and point "
        f"buffer.explorer_input.taskset.path at the local copy.")
    assert asked == [("someorg/sometasks", 10)] and loaded == []
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # not asked at all
    with pytest.raises(ConfigError, match="it is not in this machine's Hugging Face cache, and "
                                          "HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set. Give the local path"):
        load_rows("someorg/sometasks", "train", "main", key="buffer.explorer_input.taskset.path")
    assert len(asked) == 1 and loaded == []
    (tmp_path / "hub" / "datasets--someorg--sometasks").mkdir(parents=True)  # downloaded before
    assert load_rows("someorg/sometasks", "train", "main") == "rows"
    assert loaded == [("someorg/sometasks", {"name": "main", "split": "train"})] and len(asked) == 1
