"""The resume command with the run's RFT_* variables, the cosine schedule past its end, a reward of
the wrong type, lines of unbounded length, a launcher log outside the sweep."""

import os
import sys

import pytest
from conftest import compose_cfg

# ---------------------------------------------------------------- the resume command and RFT_* variables


def _no_rft_variables(monkeypatch) -> None:
    for name in [k for k in os.environ if k.startswith("RFT_")]:
        monkeypatch.delenv(name)


def _stopped(monkeypatch, tmp_path, capsys, stop: BaseException) -> tuple[int, str]:
    """main.main of a run that `stop` ends at once, started as
    `RFT_CACHE_DIR=/c RFT_CHECKPOINT_ROOT_DIR='<tmp>/a b' RFT_REWARD_TOKEN=... python run.py name=inline`;
    its exit status and stderr."""
    import rft.runtime.main as main

    _no_rft_variables(monkeypatch)
    root = tmp_path / "a b"  # a space: the value is shell-quoted
    monkeypatch.setenv("RFT_CACHE_DIR", "/c")
    monkeypatch.setenv("RFT_CHECKPOINT_ROOT_DIR", str(root))
    monkeypatch.setenv("RFT_REWARD_TOKEN", "s3cr3t-token")
    monkeypatch.setenv("RFT_DEVICES", "0,1")  # rft's own (an actor's devices): not the user's
    monkeypatch.setattr(sys, "argv", ["run.py", "name=inline"])
    cfg = compose_cfg(["name=inline"])

    def stops(cfg):
        raise stop

    monkeypatch.setattr(main, "_main", stops)
    with pytest.raises(SystemExit) as e:
        main.main(cfg)
    return e.value.code, capsys.readouterr().err


def test_the_command_sigterm_prints_starts_with_the_rft_variables_the_run_was_started_with(monkeypatch, tmp_path,
                                                                                          capsys):
    # it said `python run.py name=inline`: typed in a new shell it started a fresh run in ./checkpoints
    from rft.runtime import preemption

    code, err = _stopped(monkeypatch, tmp_path, capsys, preemption.Terminated("after step 3 of stage grpo"))
    assert code == 143, err
    assert err.rstrip().endswith(
        f"The command: RFT_CACHE_DIR=/c RFT_CHECKPOINT_ROOT_DIR='{tmp_path}/a b' python run.py name=inline (set "
        f"RFT_REWARD_TOKEN again too: a secret, not shown here)"), err
    assert "s3cr3t" not in err and "RFT_DEVICES" not in err


def test_ctrl_c_names_the_rft_variables_a_new_shell_needs(monkeypatch, tmp_path, capsys):
    code, err = _stopped(monkeypatch, tmp_path, capsys, KeyboardInterrupt())
    assert code == 130, err
    assert err.strip() == (
        f"rft: interrupted. Run the same command again to resume (no checkpoint was saved yet: the run starts "
        f"over). In a new shell, set the same environment: RFT_CACHE_DIR=/c RFT_CHECKPOINT_ROOT_DIR='{tmp_path}/a b' "
        f"(set RFT_REWARD_TOKEN again too: a secret, not shown here).")


def test_without_rft_variables_the_command_is_the_command_line_alone(monkeypatch):
    import rft.runtime.main as main

    _no_rft_variables(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["run.py", "stages=[]"])
    assert main._resume_command() == "python run.py 'stages=[]'"
    assert main._env_note() == ""


# ---------------------------------------------------------------- the cosine schedule past its planned end


def test_the_cosine_lr_stays_at_its_minimum_past_the_planned_updates():
    # transformers' cosine went on round the circle: update 7 of a 6-update plan took 2.318e-4 again, and
    # update 2 x 6 - 2 = 10 (p = 8/4 = 2) lr itself
    import math

    from test_formula_audit5 import _applied, _scheduled

    # lr 1e-3, warm-up 2 of 6, min 0.1: 0, 5e-4, then p = 0/4 .. 3/4: 1e-3, 8.682e-4, 5.5e-4, 2.318e-4;
    # update 6 (p = 4/4) takes 1e-4 + 9e-4 x (1 + cos(pi)) / 2 = 1e-4, and so do 7..10 (p held at 1)
    c = math.cos(math.pi / 4)
    within = [0, 5e-4, 1e-3, 1e-4 + 9e-4 * (1 + c) / 2, 5.5e-4, 1e-4 + 9e-4 * (1 - c) / 2]
    assert _applied(_scheduled("cosine", 2, 6), 11) == pytest.approx(within + [1e-4] * 5, rel=1e-12)
    # without warm-up: 4 updates planned, 1e-3 at 0, then 1e-4 from update 4 on (old: 1e-3 again at 8)
    assert _applied(_scheduled("cosine", 0, 4), 9)[4:] == pytest.approx([1e-4] * 5, rel=1e-12)
    # the constant schedule's linear warm-up ends at lr and stays there: 0, 2.5e-4 .. 7.5e-4, then 1e-3
    assert _applied(_scheduled("constant", 4, 6), 9) == pytest.approx([0, 2.5e-4, 5e-4, 7.5e-4] + [1e-3] * 5)


# ---------------------------------------------------------------- a reward of the wrong type is not retried


@pytest.mark.parametrize("value, said", [
    (None, "reward 'p0' returned NoneType None, not a number"),
    ("1.0", "reward 'p0' returned str '1.0', not a number (text is never read as one: return a float, e.g. "
            "float(answer == task.answer))"),
    ({}, "reward 'p0' returned an empty dict: give it at least one part, e.g. {'correct': 0.0}"),
    ([1.0], "reward 'p0' returned 1 values for 2 responses"),  # served (the group at once): a list one short
    ("yes", "reward 'p0' returned str 'yes' for a group of 2 responses: a served reward returns a list of one "
            "reward per response"),
])
def test_a_reward_of_the_wrong_type_is_called_once_not_retried(value, said):
    # it was called 1 + explorer.max_retry_times (here 2) = 3 times, as a flaky one, each time the same
    from test_user_faults import _scorer, _task

    from rft.rewards.scoring import Part, Scorer
    from rft.rollout.explorer import run_jobs

    calls = []

    def per_response(prompt, response, task):
        calls.append(response)
        return value

    def served(prompt, responses, task):  # a served reward (rft.rewards.remote's kind) is given the group
        calls.append(responses)
        return value

    group = isinstance(value, list) or value == "yes"
    scorer = Scorer([Part("p0", 1.0, served)]) if group else _scorer(per_response)
    # a function scored per response is given one response here: one call an attempt
    results, c = run_jobs(lambda job: scorer(*job), [("q", ["357", "1"] if group else ["357"], _task())], runners=1,
                          timeout=5.0, retries=2)
    assert len(calls) == 1, calls
    assert results == [None] and (c["errors"], c["retries"], c["failed"]) == (1, 0, 1)
    assert c["last_error"] == f"ValueError: {said}"  # the message as before


def test_a_reward_that_raises_or_is_not_finite_is_still_retried():
    from test_user_faults import _scorer, _task

    from rft.rollout.explorer import run_jobs

    for value in (RuntimeError("the judge's server dropped the call"), float("nan")):
        calls = []

        def flaky(prompt, response, task, value=value):
            calls.append(response)
            if isinstance(value, Exception):
                raise value
            return value

        results, c = run_jobs(lambda job: _scorer(flaky)(*job), [("q", ["357"], _task())], runners=1, timeout=5.0,
                              retries=2)
        # 1 call + 2 retries, each of the one response
        assert len(calls) == 3 and results == [None] and (c["errors"], c["retries"], c["failed"]) == (3, 2, 1)


# ---------------------------------------------------------------- lines of unbounded length

HOLE = 4 << 30  # a sparse file's 4 GiB of zeros, one line: read whole, a MemoryError or the OOM killer


def _sparse_line_after(path, text: str = "") -> None:
    """`path` holding `text`, then a 4 GiB line of zeros (a hole: no disk taken) and a newline."""
    with open(path, "wb") as f:
        f.write(text.encode())
    os.truncate(path, len(text.encode()) + HOLE)
    with open(path, "ab") as f:
        f.write(b"\n")


def _fast(fn, *args):
    """fn(*args)'s error (it must raise), within a few seconds: the line is passed, not read."""
    import time

    t0 = time.monotonic()
    with pytest.raises(Exception) as e:
        fn(*args)
    assert time.monotonic() - t0 < 15, "the line was read"
    return e


def test_a_file_buffer_with_a_line_longer_than_any_experience_names_it(tmp_path):
    import json

    from test_buffers import buf_cfg, exps, ids

    from rft.data.buffer import FileBuffer, count_experiences
    from rft.errors import ConfigError, RunError

    path = tmp_path / "b.jsonl"
    good = "".join(json.dumps(e.to_dict()) + "\n" for e in exps(2))
    _sparse_line_after(path, good)
    buf = FileBuffer(buf_cfg("file", path=str(path)))
    assert len(buf) == 3  # the two experiences and the long line (read, it is named)
    assert ids(buf.get(2, timeout=0.1)) == ["t0", "t1"]
    e = _fast(buf.get, 1, 0.1)
    assert e.type is RunError and str(e.value) == (
        f"the buffer {path}: line 3 is longer than 64 MiB, which no stored experience is: the file is damaged (by "
        f"something other than rft's writer, or it is a sparse file). Repair or delete that line, then run the same "
        f"command again to resume from the newest checkpoint.")
    # counting what it holds (mode=train's plan, python -m rft.data.buffer, the studio's list)
    e = _fast(count_experiences, str(path))
    assert e.type is ConfigError and str(e.value) == (
        f"{path}: line 3 is longer than 64 MiB, which no stored experience is: the file is damaged (by something other "
        f"than rft's writer, or it is a sparse file). Repair or delete that line.")


def test_is_experience_file_names_a_first_line_longer_than_any_experience(tmp_path):
    from rft.data.experience import is_experience_file
    from rft.errors import ConfigError

    path = tmp_path / "data.jsonl"
    _sparse_line_after(path, "\n")  # an empty first line, then the long one
    e = _fast(is_experience_file, path)
    assert e.type is ConfigError and str(e.value) == (
        f"{path}: line 2 is longer than 64 MiB, which no stored experience is: the file is damaged (by something other "
        f"than rft's writer, or it is a sparse file). Repair or delete that line, or give another file.")


def test_an_eval_trajectory_file_with_a_line_longer_than_any_is_named_in_the_studio(tmp_path):
    import json

    from rft.studio import rollouts

    run = tmp_path / "run"
    path = run / "eval_trajectories" / "step_0" / "math.jsonl"
    path.parent.mkdir(parents=True)
    row = {"task_id": "t0", "reward": 1.0, "messages": [{"role": "user", "content": "1+1"},
                                                        {"role": "assistant", "content": "2"}]}
    _sparse_line_after(path, json.dumps(row) + "\n")
    source = "eval_trajectories/step_0/math.jsonl"
    e = _fast(rollouts.read, run, source)
    assert e.type is ValueError and str(e.value) == (
        f"{source}, line 2: longer than 16 MiB, which no conversation rft saves is: the file is damaged (or a "
        f"sparse file).")
    # the run's list of files counts it (2 lines), fast
    [entry] = [s for s in rollouts.sources(run) if s["kind"] == "eval"]
    assert entry["count"] == 2


# ---------------------------------------------------------------- a recorded launcher log outside the sweep


def _stopped_log(path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("rft: the run stopped: a line of a log the sweep does not own\n")


def test_a_recorded_launcher_log_outside_the_sweep_is_refused_with_a_warning(tmp_path, capsys):
    # .launcher_log (in a folder others may write to) named a submitit log anywhere, and the report quoted
    # that file's last line as why the job stopped
    from test_readme_promises3 import _local_sweep

    from rft.reporting import report

    sweep = _local_sweep(tmp_path / "two", jobs=2)
    other = tmp_path / "another_sweep" / ".submitit" / "77" / "77_0_log.err"
    _stopped_log(other)
    (sweep / "1" / ".launcher_log").write_text(f"{other}\n")
    assert {j.num: report.why_stopped(j) for j in report.read_jobs(sweep)} == {"0": None, "1": None}
    err = capsys.readouterr().err
    assert err == (f"rft.reporting.report: warning: job 1's .launcher_log names {other}, which is not in the sweep's "
                   f"folder {sweep} (and no submitit_folder of its own): a log the sweep does not own, not read.\n")
    # relative, out of the sweep by '..': the same
    (sweep / "1" / ".launcher_log").write_text(f"{os.path.relpath(other, sweep)}\n")
    assert report.why_stopped(next(j for j in report.read_jobs(sweep) if j.num == "1")) is None
    assert "a log the sweep does not own, not read" in capsys.readouterr().err


def test_a_recorded_launcher_log_linked_out_of_the_sweep_is_refused(tmp_path, capsys):
    from test_readme_promises3 import _local_sweep

    from rft.reporting import report

    sweep = _local_sweep(tmp_path / "two", jobs=2)
    other = tmp_path / "elsewhere" / "9_0_log.err"
    _stopped_log(other)
    link = sweep / ".submitit" / "9" / "9_0_log.err"  # in the sweep's folder, a link out of it
    link.parent.mkdir()
    link.symlink_to(other)
    (sweep / "1" / ".launcher_log").write_text(".submitit/9/9_0_log.err\n")
    assert report.why_stopped(next(j for j in report.read_jobs(sweep) if j.num == "1")) is None
    assert capsys.readouterr().err == (
        f"rft.reporting.report: warning: job 1's .launcher_log names {link} (a link to {other}), which is not in "
        f"the sweep's folder {sweep} (and no submitit_folder of its own): a log the sweep does not own, not read.\n")


def test_a_recorded_launcher_log_in_the_configured_submitit_folder_is_read_and_another_is_not(tmp_path, capsys):
    # hydra.launcher.submitit_folder may name a folder outside the sweep: its logs are the sweep's
    from test_readme_promises3 import _local_sweep

    from rft.reporting import report

    sweep = _local_sweep(tmp_path / "two", jobs=2)
    logs = tmp_path / "scratch" / "logs"
    (sweep / "multirun.yaml").write_text(
        "hydra:\n  launcher:\n    _target_: hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher\n"
        f"    submitit_folder: {logs}/%j\n")
    own = logs / "41" / "41_0_log.err"
    _stopped_log(own)
    (sweep / "1" / ".launcher_log").write_text(f"{own}\n")
    job = next(j for j in report.read_jobs(sweep) if j.num == "1")
    assert report.why_stopped(job) == ("the run stopped: a line of a log the sweep does not own", own)
    # relative to Hydra's working directory, and under the sweep by its own interpolation (the default)
    (sweep / "multirun.yaml").write_text(
        "hydra:\n  launcher:\n    _target_: hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher\n"
        f"    submitit_folder: scratch/logs/%j\n  runtime:\n    cwd: {tmp_path}\n")
    assert report.why_stopped(job) == ("the run stopped: a line of a log the sweep does not own", own)
    assert capsys.readouterr().err == ""
    # Hydra's working directory elsewhere: the folder is another, and the log is not of this sweep
    (sweep / "multirun.yaml").write_text(
        "hydra:\n  launcher:\n    _target_: hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher\n"
        f"    submitit_folder: scratch/logs/%j\n  runtime:\n    cwd: {sweep}\n")
    assert report.why_stopped(job) is None
    assert capsys.readouterr().err == (
        f"rft.reporting.report: warning: job 1's .launcher_log names {own}, which is not in the sweep's folder {sweep} "
        f"nor in its hydra.launcher.submitit_folder ({sweep}/scratch/logs): a log the sweep does not own, not read.\n")
