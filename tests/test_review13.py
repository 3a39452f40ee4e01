"""Review of the files read back and the ports, attacked as a careless user or an intruder would."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest


def _jobs_json(log_dir: Path, text: str) -> Path:
    log_dir.mkdir(mode=0o700, exist_ok=True)
    path = log_dir / "jobs.json"
    path.unlink(missing_ok=True)
    path.write_text(text)
    path.chmod(0o600)
    return path


GOOD = {"id": 1, "argv": ["python", "run.py"], "log": "launch_1_ab12.log", "pid": 2**22 + 1, "started": 1.0,
        "stopped": False, "returncode": 0, "ended": 2.0, "run": "rft/grpo", "sweep": None}


@pytest.mark.parametrize("records", [
    {"1": GOOD},  # an object for the list: AttributeError ('str' object has no attribute 'get')
    [1],  # AttributeError ('int' ...)
    [{**GOOD, "id": "1"}, {**GOOD, "log": "launch_2_cd34.log"}],  # TypeError in max() at the next launch
    [{**GOOD, "returncode": None, "started": "yesterday"}],  # TypeError in alive(): every /api/launches a 500
    [{**GOOD, "pid": "4194305"}],  # TypeError in os.killpg at a stop
    [{**GOOD, "pid": 0, "returncode": None, "started": 1e12}],  # os.killpg(0): the studio's own process group
])
def test_a_jobs_json_of_other_types_is_warned_of_and_not_listed(tmp_path, capsys, records):
    # the studio writes jobs.json itself, atomically; a damaged or hand-edited one stopped its start
    # with a traceback (or broke a page later): now one warning and no launches listed
    from rft.studio.launch import Launches

    path = _jobs_json(tmp_path / ".studio", json.dumps(records))
    launches = Launches(tmp_path, tmp_path / ".studio")
    assert launches.all == {}
    assert capsys.readouterr().err == (f"rft.studio: WARNING: {path} does not read (not a list of launch records as "
                                       f"the studio writes them); the earlier launches are not listed.\n")
    # still the studio's: the next launch is number 1 and the file is written anew, whole
    _jobs_json(tmp_path / ".studio", json.dumps([GOOD]))
    assert list(Launches(tmp_path, tmp_path / ".studio").all) == [1]


def test_a_fifo_in_the_place_of_jobs_json_does_not_hold_the_studios_start(tmp_path, capsys):
    from rft.studio.launch import Launches

    log_dir = tmp_path / ".studio"
    log_dir.mkdir(mode=0o700)
    os.mkfifo(log_dir / "jobs.json", 0o600)
    got = {}
    t = threading.Thread(target=lambda: got.update(all=Launches(tmp_path, log_dir).all), daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():  # read_text() waits for a writer for ever: open it for one so the thread ends
        os.close(os.open(log_dir / "jobs.json", os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
        pytest.fail("the studio's start waited on a FIFO named jobs.json")
    assert got["all"] == {}
    assert "jobs.json does not read ([Errno 22] not a regular file" in capsys.readouterr().err


# ---------------------------------------------------------------- the build cache (cache_dir)

def _splits(rng):
    return {"train": [{"question": str(rng.random()), "answer": "1"}]}


@pytest.mark.parametrize("planted", ["file", "link"])
def test_generated_data_is_built_whatever_stands_in_its_tmp_folders_place(tmp_path, planted):
    # what a killed build left as <entry>.tmp is removed; a file or a link there was left by
    # rmtree(ignore_errors=True), and the mkdir after it ended in 'FileExistsError: [Errno 17]'
    from rft.data.tasks import _generate

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "mine.txt").write_text("kept")
    tmp = tmp_path / "data.tmp"
    if planted == "file":
        tmp.write_text("x")
    else:
        tmp.symlink_to(elsewhere)
    out = _generate(tmp_path / "data", 0, _splits)
    assert not out.is_symlink() and sorted(p.name for p in out.iterdir()) == ["manifest.json", "train.jsonl"]
    assert sorted(p.name for p in elsewhere.iterdir()) == ["mine.txt"]  # the link went, not its target
    assert not tmp.exists() and not tmp.is_symlink()


@pytest.mark.parametrize("planted", ["folder", "link"])
def test_a_build_lock_that_cannot_be_opened_is_one_paragraph(tmp_path, planted):
    # <entry>.lock in cache_dir a folder, or a link (filelock opens with O_NOFOLLOW): a raw
    # 'IsADirectoryError: [Errno 21]' or 'OSError: [Errno 40] Too many levels of symbolic links',
    # where the stage cache's lock of the same kind is one paragraph (rundir.stage_lock)
    from rft.data.tasks import _generate
    from rft.errors import RunError

    lock = tmp_path / "data.lock"
    lock.mkdir() if planted == "folder" else lock.symlink_to("/dev/zero")
    with pytest.raises(RunError) as e:
        _generate(tmp_path / "data", 0, _splits)
    why = "Is a directory" if planted == "folder" else "it is a link (to /dev/zero), which rft never makes there"
    assert str(e.value) == (f"the lock {lock} of the generated task data in {tmp_path} cannot be opened: {why}. "
                            f"Remove it (rft makes the lock again) and run the same command again.")
    lock.rmdir() if planted == "folder" else lock.unlink()
    assert (_generate(tmp_path / "data", 0, _splits) / "train.jsonl").is_file()  # as the paragraph says


def test_the_tiny_model_is_not_written_through_a_link_in_place_of_its_tmp_folder(tmp_path):
    # the build wrote the model and tokenizer into the folder the link named, then renamed the link
    # into place: the cache entry was a link to that folder (7 files written there)
    from rft.models import build_tiny_model

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "tiny.tmp").symlink_to(elsewhere)
    out = build_tiny_model(tmp_path / "tiny", arch={"num_hidden_layers": 1})
    assert list(elsewhere.iterdir()) == []
    assert not out.is_symlink() and (out / "model.safetensors").is_file() and (out / "manifest.json").is_file()


@pytest.mark.slow  # ~1.5 s, importing `datasets` (which reads the rows)
def test_the_task_pipeline_output_is_not_written_through_a_link_in_place_of_its_tmp_folder(tmp_path):
    from test_boundaries import pipeline_config

    from rft.data.pipeline import output_dir, run_task_pipeline

    cfg = pipeline_config(tmp_path)
    d = output_dir(cfg)
    d.parent.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    d.with_name(d.name + ".tmp").symlink_to(elsewhere)
    report = run_task_pipeline(cfg, say=lambda _: None)
    assert report["rows"] == 2 and not report["cached"]  # 2 rows in ("1+1", "12+34"), none the same
    assert list(elsewhere.iterdir()) == [] and not d.is_symlink() and (d / "train.jsonl").is_file()


# ---------------------------------------------------------------- a folder where the run writes a file

@pytest.mark.parametrize("where", ["run.log", ".run.lock", ".hydra/config.yaml", "grpo/metrics.jsonl",
                                   "grpo/batches.jsonl", "grpo/log/grpo_trainer.log"])
def test_a_folder_in_place_of_a_file_the_run_writes_is_one_paragraph_before_anything_is_written(tmp_path, where):
    # each ended the resumed run in a raw IsADirectoryError (experiments/damage_fuzz, each of the run's
    # files replaced by a folder: 9 of 31 cases): open() of run.log, .run.lock or an actor's log, the
    # monitor reading metrics.jsonl back, os.replace onto .hydra/config.yaml
    from rft.errors import RunError
    from rft.runtime import rundir

    run = tmp_path / "run"
    (run / "grpo" / "checkpoints").mkdir(parents=True)
    (run / where).mkdir(parents=True)
    with pytest.raises(RunError) as e:
        with rundir.run_lock(run):
            pass
    assert str(e.value) == (
        f"{run / where} is a folder, where rft writes a file of that name in the run directory {run} (its log, a "
        f"record it reads back on resume). It was put there by hand or came with a copy of the run. Move it away (a "
        f"file of its contents, if any, is the run's own), or give this run another name (name=...).")


def test_the_folders_a_run_makes_are_not_taken_for_files(tmp_path):
    # a stage's folder is named by its stage_name, which may end so; checkpoints, eval trajectories,
    # logs and a killed save's step_<N>.tmp are folders of the run's own
    from rft.runtime import rundir

    run = tmp_path / "run"
    for d in ["sft.v2.yaml/checkpoints/step_2.tmp/hf", "grpo/eval_trajectories/step_2", "grpo/log", ".hydra",
              "grpo/checkpoints/step_1.damaged-20261129_120000"]:
        (run / d).mkdir(parents=True)
    (run / "grpo" / "eval_trajectories" / "step_2" / "arithmetic_test.jsonl").write_text("")
    assert rundir.planted_links(run) == []


# ---------------------------------------------------------------- export

def _sealed_checkpoint(tmp_path: Path) -> Path:
    from test_trainer import make_trainer

    from rft import manifest

    d = tmp_path / "checkpoints" / "step_1"
    d.mkdir(parents=True)
    make_trainer(128).save(str(d))
    (d / "state.json").write_text('{"step": 1, "manifest": 1}')
    manifest.seal(d, {"step": 1})
    return d


def test_an_export_over_a_file_left_as_its_partial_folder_is_written(tmp_path):
    # <out>.partial a file (not a folder, not a link): rmtree(ignore_errors=True) left it and the
    # mkdir after it was a raw FileExistsError, once the model had loaded
    from rft import manifest
    from rft.runtime.export import export

    (tmp_path / "mine.partial").write_text("x")
    out = export(_sealed_checkpoint(tmp_path), tmp_path / "mine")
    assert out.is_dir() and manifest.verify(out) is None and not (tmp_path / "mine.partial").exists()


def test_an_export_to_a_link_is_refused_before_anything_is_written(tmp_path):
    # the sealed folder is renamed onto <out>: over a link to an empty folder that rename failed
    # ('NotADirectoryError: [Errno 20]') after the whole export had been written beside it
    from rft.errors import ConfigError
    from rft.runtime.export import export

    (tmp_path / "scratch").mkdir()
    (tmp_path / "mine").symlink_to(tmp_path / "scratch", target_is_directory=True)
    with pytest.raises(ConfigError) as e:
        export(_sealed_checkpoint(tmp_path), tmp_path / "mine")
    assert str(e.value) == (f"{tmp_path / 'mine'} is a link (to {tmp_path / 'scratch'}): the export is written beside "
                            f"its folder and renamed into place. Give the folder itself ({tmp_path / 'scratch'}), or a "
                            f"new folder.")
    assert list(tmp_path.glob("mine.partial")) == [] and list((tmp_path / "scratch").iterdir()) == []


# ---------------------------------------------------------------- metrics.jsonl read back on resume

@pytest.mark.parametrize("bad", ['{"step": "1"}', '{"step": null}', '{"step": [1]}', '{"step": 1.5}'])
def test_a_logged_row_whose_step_is_not_a_whole_number_is_a_damaged_line_not_a_traceback(tmp_path, capsys, bad):
    # _read took any object with a "step" for a row: on resume its step was compared with the
    # checkpoint's ('<=' not supported between instances of 'str' and 'int'), and 1.5 was kept as a step
    from rft.reporting.monitor import _reopen, read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text(f'{{"step": 1, "a": 1}}\n{bad}\n{{"step": 2}}\n{{"step": 3}}\n')
    assert read_metrics(path) == [{"step": 1, "a": 1}, {"step": 2}, {"step": 3}]
    f, steps = _reopen(path, 2)  # resumed from step 2's checkpoint: step 3 is logged again
    f.close()
    assert steps == {1, 2}
    assert path.read_text() == f'{{"step": 1, "a": 1}}\n{bad}\n{{"step": 2}}\n'  # the damaged line kept, as said
    assert f"{path} line 2 is not a JSON record" in capsys.readouterr().err


# ---------------------------------------------------------------- a sql buffer under a run name of URL characters

@pytest.mark.slow  # 1.1 s alone, over the fast tier's second
def test_a_sql_buffer_is_the_file_its_path_names_whatever_characters_the_run_name_holds(tmp_path):
    # f"sqlite:///{path}" parsed the path as a URL: in a run named "lr?seed=1" the rest was the URL's
    # query, so the first two runs below wrote one database, <project>/lr, and their buffer.db was
    # never made; "?timeout=1" was a raw ValueError, "50%25" a buffer said to be damaged; and the read-only
    # URI of `python -m rft.data.buffer` and the studio cut a path at its '#' (another file read)
    from test_buffers import buf_cfg, exps, ids

    from rft.data.buffer import count_experiences, make_buffer, read_experiences

    names = ["lr?seed=1", "lr?seed=2", "lr?timeout=1", "50%25data", "x#1"]
    for n, name in enumerate(names):
        path = tmp_path / name / "grpo" / "buffer.db"
        buf = make_buffer(buf_cfg("sql", path=str(path)))
        buf.put(exps(2, start=2 * n))
        assert ids(buf.get(4, timeout=0.2)) == [f"t{2 * n}", f"t{2 * n + 1}"]  # its own rows alone
        buf.close()
        assert path.is_file()
        assert count_experiences(str(path)) == 2 and ids(read_experiences(str(path), 10)) == [f"t{2 * n}", f"t{2 * n + 1}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)  # no database beside the run folders


# ---------------------------------------------------------------- python -m rft.data.buffer on a damaged file

def _stored_line(**fields) -> str:
    from rft.data.experience import Experience

    e = Experience(tokens=[1, 2, 3, 4], prompt_length=2, logprobs=[-0.1, -0.2], reward=1.0, group_id="g",
                   task_id="t", policy_version=0)
    return json.dumps({**e.to_dict(), **fields})


def test_the_buffer_cli_names_the_line_that_does_not_read(tmp_path, capsys):
    # a line cut short in the middle of the file (not the last, which a killed writer leaves) ended
    # `python -m rft.data.buffer` in a raw JSONDecodeError, and one of wrong types in a ValueError
    from rft.data.buffer import main

    good = _stored_line()
    path = tmp_path / "experiences.jsonl"
    path.write_text(f"{good}\n{good[:40]}x\n{good}\n")
    assert main([str(path)]) == 2
    assert capsys.readouterr().err == (
        f"rft.data.buffer: {path}: line 2 is not a stored experience (JSONDecodeError: Expecting ':' delimiter: line 1 "
        f"column 41 (char 40)): the file is damaged or edited there; repair or delete it to read past it.\n")
    path.write_text(f"{good}\n{_stored_line(tokens='abc')}\n")
    assert main([str(path)]) == 2
    assert "line 2 is not a stored experience (ValueError: tokens is not a non-empty list" in capsys.readouterr().err
    assert main([str(path), "--limit", "1"]) == 0  # the lines before it still read


def test_the_buffer_cli_shows_a_stored_id_with_an_escape_sequence_as_its_repr(tmp_path, capsys):
    # task_id and group_id went to the terminal as stored: OSC 52 (here) sets the clipboard, others
    # rewrite what the terminal shows; the prompt and response were repr'd already
    from rft.data.buffer import main

    path = tmp_path / "experiences.jsonl"
    path.write_text(_stored_line(task_id="\x1b]52;c;aGk=\x07", group_id="g\x1b[2J") + "\n")
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out
    assert "[0] task_id='\\x1b]52;c;aGk=\\x07' group_id='g\\x1b[2J' policy_version=0 reward=1" in out


# ---------------------------------------------------------------- names from a handed-over run, on the console

def test_a_damaged_checkpoints_file_name_reaches_the_console_without_its_escape_sequence(tmp_path):
    # the identity in a manifest was shown as its repr (its run name); the name of a file added to a
    # checkpoint, which the damage message names, went out as it was: OSC 52 sets the clipboard
    from rft.runtime import checkpoint

    owner = checkpoint.Owner(run="r", stage="grpo", config="c", model="m")
    stage = tmp_path / "grpo"
    checkpoint.write(stage, 1, {}, owner=owner)
    checkpoint.write(stage, 2, {}, owner=owner)
    (stage / "checkpoints" / "step_2" / "\x1b]52;c;aGk=\x07").write_text("x")
    said = []
    assert checkpoint.usable_checkpoint(stage, owner, "grpo", said.append).step == 1  # step 2 set aside
    assert len(said) == 1 and "\x1b" not in said[0] and "\\x1b]52;c;aGk=\\x07: not in manifest.json" in said[0]


def test_a_planted_entrys_name_in_the_run_directory_reaches_the_console_without_its_escape_sequence(tmp_path):
    from rft.errors import RunError
    from rft.runtime import rundir

    run = tmp_path / "run"
    (run / "grpo").mkdir(parents=True)
    (run / "grpo" / "\x1b[2Jx.log").symlink_to("/tmp/\x1b[2J")
    with pytest.raises(RunError) as e:
        rundir.refuse_links(run)
    assert "\x1b" not in str(e.value)
    assert str(e.value).startswith(f"'{run}/grpo/\\x1b[2Jx.log' is a link (to '/tmp/\\x1b[2J'): ")


@pytest.mark.parametrize("storage", ["file", "sql"])
def test_a_folder_given_as_the_buffers_path_is_one_paragraph(tmp_path, storage):
    # buffer.path=<a folder>: the file buffer's first put was a raw 'IsADirectoryError: [Errno 21]'
    # (after the run had started), the sql buffer's 'not a SQLite database ..., or it is damaged'
    from test_buffers import buf_cfg

    from rft.data.buffer import make_buffer
    from rft.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        make_buffer(buf_cfg(storage, path=f"{tmp_path}/"), "buffer.trainer_input.experience_buffer")
    what, suffix = {"file": ("JSONL file", ".jsonl"), "sql": ("SQLite file", ".db")}[storage]
    name = buf_cfg(storage).name
    assert str(e.value) == (f"buffer.trainer_input.experience_buffer.path='{tmp_path}/' is a folder; the buffer is one "
                            f"{what} (rft makes it). Name a file in it, e.g. buffer.trainer_input.experience_buffer.path="
                            f"{tmp_path}/{name}{suffix}.")


# ---------------------------------------------------------------- the reaper and the user's own tools

def test_the_reaper_leaves_a_users_tool_that_names_a_file_of_the_drivers_session(tmp_path):
    # once the driver ended, every process of this user whose command line named its Ray session
    # (and started after it) was SIGKILLed: also a `tail -f` of the session's logs, a `less`, an editor
    import datetime
    import subprocess
    import sys
    import time

    import psutil

    from rft.runtime import reaper

    me = psutil.Process()
    session = f"session_{datetime.datetime.today().strftime('%Y-%m-%d_%H-%M-%S_%f')}_{me.pid}"
    log = tmp_path / session / "logs" / "raylet.out"
    log.parent.mkdir(parents=True)
    log.write_text("")
    tail = subprocess.Popen(["tail", "-f", str(log)])
    ray_like = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(log)])
    try:
        deadline = time.time() + 10  # its command line is there once the child has exec'd
        while time.time() < deadline and ray_like.pid not in reaper._theirs({}, me.pid, me.create_time(), -1):
            time.sleep(0.05)
        found = reaper._theirs({}, me.pid, me.create_time(), -1)
        assert ray_like.pid in found  # a Python process of the session (as Ray's log monitor, its agents)
        assert tail.pid not in found
    finally:
        for p in (tail, ray_like):
            p.kill()
            p.wait()
