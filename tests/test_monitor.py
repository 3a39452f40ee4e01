"""rft/reporting/monitor.py: progress on a terminal and in a log file, and the per-step JSONL logs of a run
that was killed (a line cut short, a resume with and without a checkpoint)."""

import io
import json
import sys

import pytest

from conftest import compose_cfg

from rft.reporting.monitor import Monitor, read_metrics


def _cfg():
    return compose_cfg(["monitor=console"])  # console_keys: reward/mean eval/accuracy loss/policy timing/step_s


def _run(monitor, steps, start=0):
    """What the runner logs: the startup eval at step 0 (fresh runs only), then each step, with an eval
    every 20 steps; a message half-way."""
    if start == 0:
        monitor.log(0, {"eval/accuracy": 0.25}, advance=False)
    for step in range(start + 1, steps + 1):
        metrics = {"reward/mean": step / 100, "loss/policy": 0.0123, "timing/step_s": 0.51, "other": 1.0}
        if step % 20 == 0:
            metrics["eval/accuracy"] = 0.35
        monitor.log(step, metrics)
        if step == 30:
            monitor.print("[grpo] a message")
    monitor.close()


def test_progress_is_plain_lines_in_a_log_file_and_a_bar_on_a_terminal(tmp_path, capsys, monkeypatch):
    # capsys: stdout and stderr are not terminals, as in a Slurm log or `> run.log`
    _run(Monitor(_cfg(), _new(tmp_path, "a"), 60, 0, "grpo"), 60)
    out, err = capsys.readouterr()
    assert err == "" and "\r" not in out
    lines = out.splitlines()
    # 60 steps: a line every 5 (about 10 to 20 lines), the first (step 0, the startup eval) and the last
    steps = [int(line.split()[2].split("/")[0]) for line in lines if line.startswith("[grpo] step ")]
    assert steps == [0, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55, 60]
    assert lines[0] == "[grpo] step 0/60  eval.accuracy=0.25"
    assert "[grpo] step 20/60  reward.mean=0.2 eval.accuracy=0.35 loss.policy=0.0123 timing.step_s=0.51" in lines
    assert lines.index("[grpo] a message") == lines.index("[grpo] step 30/60  reward.mean=0.3 eval.accuracy=0.35 "
                                                          "loss.policy=0.0123 timing.step_s=0.51") + 1

    # resumed from the checkpoint of step 7: its first step (8), then every 5, then the last
    _run(Monitor(_cfg(), _new(tmp_path, "b"), 60, 7, "grpo"), 60, start=7)
    out = capsys.readouterr().out
    assert [int(line.split()[2].split("/")[0]) for line in out.splitlines() if " step " in line] == [
        8, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55, 60]

    # a short run: every step
    _run(Monitor(_cfg(), _new(tmp_path, "c"), 4, 0, "sft"), 4)
    assert [line.split()[2] for line in capsys.readouterr().out.splitlines()] == ["0/4", "1/4", "2/4", "3/4", "4/4"]

    # on a terminal: tqdm's bar (redrawn with carriage returns) and the messages as lines above it
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    _run(Monitor(_cfg(), _new(tmp_path, "d"), 60, 0, "grpo"), 60)
    assert "\r" in terminal.getvalue() and "grpo: 100%" in terminal.getvalue() and "60/60" in terminal.getvalue()
    assert "[grpo] step" not in terminal.getvalue() + capsys.readouterr().out


def _new(tmp_path, name):
    (tmp_path / name).mkdir()
    return tmp_path / name


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _rows(*steps):
    return "".join(json.dumps({"step": s, "reward/mean": s / 10}) + "\n" for s in steps)


def test_a_last_line_cut_short_by_a_kill_is_skipped_and_dropped_on_resume(tmp_path, capsys):
    run = tmp_path / "grpo"
    cut = '{"step": 3, "reward/me'
    _write(run / "metrics.jsonl", _rows(0, 1, 2) + cut)
    _write(run / "batches.jsonl", _rows(1, 2) + cut)
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == [0, 1, 2]
    assert capsys.readouterr().err == ""  # what a kill leaves is expected: no warning

    # resumed from the checkpoint of step 2: the cut line is gone, the run appends step 3 after step 2
    monitor = Monitor(_cfg(), run, 4, 2, "grpo")
    monitor.log(3, {"reward/mean": 0.3})
    monitor.close()
    assert (run / "metrics.jsonl").read_text() == _rows(0, 1, 2) + json.dumps({"step": 3, "reward/mean": 0.3}) + "\n"
    assert (run / "batches.jsonl").read_text() == _rows(1, 2)
    assert capsys.readouterr().err == ""


def test_a_damaged_line_inside_the_file_is_kept_and_warned_about(tmp_path, capsys):
    """A kill cuts only the last line; a bad line before it is damage from elsewhere (two runs
    writing one directory, an edit): readers skip it with a warning naming the file and line, and a
    resume keeps it in the file as it is."""
    run = tmp_path / "grpo"
    damaged = '{"step": 2, "rew{"step": 2, "reward/mean": 0.2}\n'  # line 4, after a blank line
    _write(run / "metrics.jsonl", _rows(0, 1) + "\n" + damaged + _rows(3, 4))
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == [0, 1, 3, 4]
    err = capsys.readouterr().err
    assert f"rft: warning: {run / 'metrics.jsonl'} line 4 is not a JSON record" in err and err.count("\n") == 1

    Monitor(_cfg(), run, 6, 3, "grpo").close()  # resumed from the checkpoint of step 3
    assert (run / "metrics.jsonl").read_text() == _rows(0, 1) + damaged + _rows(3)
    assert "line 4 is not a JSON record" in capsys.readouterr().err


def test_a_run_killed_before_its_first_checkpoint_starts_its_logs_afresh(tmp_path):
    """No checkpoint: the run starts again at step 0 (the startup eval included), so nothing the
    killed run logged is kept; from the checkpoint of step s, the rows up to s are."""
    run = tmp_path / "grpo"
    _write(run / "metrics.jsonl", _rows(0, 1))
    _write(run / "batches.jsonl", _rows(1))
    monitor = Monitor(_cfg(), run, 4, 0, "grpo")
    monitor.log(0, {"reward/mean": 0.0}, advance=False)
    monitor.close()
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == [0]
    assert read_metrics(run / "batches.jsonl") == []

    _write(run / "metrics.jsonl", _rows(0, 1, 2, 3))
    Monitor(_cfg(), run, 4, 2, "grpo").close()
    assert (run / "metrics.jsonl").read_text() == _rows(0, 1, 2)


def test_a_resume_names_the_trained_steps_whose_lines_batches_jsonl_lost(tmp_path, capsys):
    """A kill never costs batches.jsonl a line (a step's line is written before its checkpoint and
    its metrics row). Damage does (a line cut out, a last line cut short by a copy or a disk that
    lost its tail): the resumed run went on without those steps' lines and said nothing, where the
    same damage to metrics.jsonl is named. The steps that trained are those whose metrics row has
    train/experiences (a step whose every task failed trains on nothing and has no line)."""
    run = tmp_path / "grpo"

    def trained(*steps):
        return "".join(json.dumps({"step": s, "train/experiences": 8}) + "\n" for s in steps)

    def lines(*steps):
        return "".join(json.dumps({"step": s, "groups": [], "versions": [], "digest": "0"}) + "\n" for s in steps)

    # step 4 trained nothing; step 5 is the checkpoint's, its metrics row restored from the checkpoint
    _write(run / "metrics.jsonl", _rows(0) + trained(1, 2, 3) + _rows(4))
    _write(run / "batches.jsonl", lines(1, 3) + '{"step": 5, "gro')
    monitor = Monitor(_cfg(), run, 8, 5, "grpo")
    monitor.ensure_logged(5, {"train/experiences": 8})
    monitor.record_batch({"step": 6, "groups": [], "versions": [], "digest": "0"})
    monitor.close()
    assert capsys.readouterr().err == (
        f"rft: warning: {run / 'batches.jsonl'} has no line for steps 2, 5, which this run trained up to its "
        f"checkpoint of step 5 (metrics.jsonl has their rows): the file was cut or edited since, and no checkpoint "
        f"holds what those steps trained on, so it goes on without them.\n")
    assert [r["step"] for r in read_metrics(run / "batches.jsonl")] == [1, 3, 6]
    # a whole file: no word
    _write(run / "metrics.jsonl", _rows(0) + trained(1, 2))
    _write(run / "batches.jsonl", lines(1, 2))
    monitor = Monitor(_cfg(), run, 8, 2, "grpo")
    monitor.ensure_logged(2, {"train/experiences": 8})
    monitor.close()
    assert capsys.readouterr().err == ""


def test_tensorboard_drops_the_step_0_of_a_run_killed_before_its_first_checkpoint(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = compose_cfg(["monitor=tensorboard"])
    killed = Monitor(cfg, tmp_path, 4, 0, "grpo")
    killed.log(0, {"eval/accuracy": 0.1}, advance=False)
    killed.close()
    # TensorBoard reads a directory's event files in the order of their names (the second they were
    # made in, then a counter): the killed run's file must come first
    (old,) = (tmp_path / "tensorboard").iterdir()
    old.rename(old.with_name("events.out.tfevents.0000000001.host.1.0"))
    again = Monitor(cfg, tmp_path, 4, 0, "grpo")
    again.log(0, {"eval/accuracy": 0.2}, advance=False)
    again.log(1, {"eval/accuracy": 0.3})
    again.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, round(e.value, 3)) for e in events.Scalars("eval/accuracy")] == [(0, 0.2), (1, 0.3)]


def test_tensorboard_reads_the_scalars_and_the_staleness_histogram(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monitor = Monitor(compose_cfg(["monitor=tensorboard"]), tmp_path, 4, 0, "grpo")
    monitor.log(1, {"reward/mean": 0.25, "staleness/max": 2})
    monitor.histogram(1, "staleness", [1, 0, 2, 2, 2])
    monitor.histogram(2, "staleness", [])  # nothing trained: nothing drawn
    monitor.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars("staleness/max")] == [(1, 2.0)]
    (h,) = events.Histograms("staleness")
    v = h.histogram_value
    # one bucket per whole number, given by right limits after an empty one that sets the left:
    # (-inf, -0.5] 0, (-0.5, 0.5] one 0, (0.5, 1.5] one 1, (1.5, 2.5] three 2s; sum 7, squares 1+4*3=13
    assert (h.step, v.min, v.max, v.num, v.sum, v.sum_squares) == (1, 0, 2, 5, 7, 13)
    assert list(v.bucket_limit) == [-0.5, 0.5, 1.5, 2.5] and list(v.bucket) == [0, 1, 1, 3]


def test_batches_record_what_each_step_trained_on_with_a_digest_of_tokens_and_rewards(tmp_path):
    from rft.data.experience import Experience, batch_record

    def exp(tokens, reward, group="g0", version=0):
        return Experience(tokens=tokens, prompt_length=1, logprobs=[0.0] * (len(tokens) - 1), reward=reward,
                          group_id=group, policy_version=version)

    batches = [
        [exp([1, 2, 3], 1.0), exp([1, 4], 0.0, "g1", 1)],
        [exp([1, 2, 3], 1.0), exp([1, 4], 0.0, "g1", 1)],  # the same: the same digest
        [exp([1, 2], 1.0), exp([3, 1, 4], 0.0, "g1", 1)],  # one token moved to the next experience
        [exp([1, 2, 3], 1.0), exp([1, 4], 0.5, "g1", 1)],  # one reward changed
        [exp([1, 2, 3], 1.0), exp([1, 5], 0.0, "g1", 1)],  # one token changed
    ]
    monitor = Monitor(_cfg(), tmp_path, len(batches), 0, "grpo")
    for step, b in enumerate(batches, 1):
        monitor.record_batch(batch_record(step, b))
    monitor.close()
    rows = read_metrics(tmp_path / "batches.jsonl")
    assert rows[0]["groups"] == ["g0", "g1"] and rows[0]["versions"] == [0, 1] and len(rows[0]["digest"]) == 16
    digests = [r["digest"] for r in rows]
    assert digests[0] == digests[1] and len(set(digests[1:])) == 4


class _Opened:
    closed: list = []

    def __init__(self, cfg, run_dir, stage, start_step):
        pass

    def log(self, step, metrics):
        pass

    def close(self):
        _Opened.closed.append(self)


class _NoServer(_Opened):
    def __init__(self, cfg, run_dir, stage, start_step):
        raise ValueError("no tracking server at 127.0.0.1:5000")


def test_a_tracker_that_does_not_start_is_one_paragraph_and_the_others_are_closed(tmp_path):
    from types import SimpleNamespace

    from rft.errors import ConfigError
    from rft.reporting.monitor import start_trackers

    cfg = SimpleNamespace(monitor=SimpleNamespace(monitor_type=["test_monitor._Opened", "test_monitor._NoServer"]))
    with pytest.raises(ConfigError) as e:
        start_trackers(cfg, tmp_path, "grpo", 0)
    assert str(e.value) == (
        "monitor.monitor_type: the tracker test_monitor._NoServer did not start: ValueError: no tracking server at "
        "127.0.0.1:5000. Fix what it needs, or leave it out of monitor.monitor_type (the console and metrics.jsonl "
        "are always on).")
    assert len(_Opened.closed) == 1  # the one started before it
    assert not list(tmp_path.iterdir())  # and no log file opened


@pytest.mark.slow  # a short training run
def test_mlflow_holds_the_runs_params_and_every_metric_of_metrics_jsonl(warm_start, tmp_path):
    """monitor=mlflow: read back with MLflow's own client, each step's value of each metric equals
    metrics.jsonl's (names as mlflow_name writes them), the params hold the whole config, and the
    artifacts hold metrics.jsonl; a second run of the same name (a resume) goes on in the same run."""
    import os

    from mlflow.tracking import MlflowClient
    from resume_support import run_to_end

    from rft.reporting.monitor import mlflow_name, read_metrics

    args = ["stages=[]", f"model.model_path={warm_start}", "model.builder=null", "name=mlf", "cluster=inline",
            "monitor=mlflow", "buffer.total_steps=2", "explorer.eval_interval=2", "trainer.save_interval=2",
            "buffer.explorer_input.eval_tasksets.0.repeat_times=2", "buffer.explorer_input.eval_tasksets.0.pass_k=[2]",
            "buffer.explorer_input.eval_tasksets.0.rollout_args.temperature=1.0"]  # two samples that may differ
    # both commands run.py processes forked from one that imported torch (resume_support.run_to_end: the
    # same command without a fresh interpreter's imports, ~4 s a run)
    env = {**os.environ, "RFT_CHECKPOINT_ROOT_DIR": str(tmp_path)}
    r = run_to_end(args, env, tmp_path / "first_run")
    assert r.returncode == 0, r.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path / 'rft' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("rft").experiment_id])
    assert [x.info.run_name for x in runs] == ["mlf/grpo"] and runs[0].info.status == "FINISHED"
    run_id = runs[0].info.run_id
    params = client.get_run(run_id).data.params
    assert params["algorithm.optimizer.lr"] == "0.0002" and params["buffer.batch_size"] == "16"
    assert params["monitor.monitor_type"] == "['tensorboard', 'mlflow']"
    rows = read_metrics(tmp_path / "rft" / "mlf" / "metrics.jsonl")
    assert "eval/arithmetic_test/pass@2" in rows[-1]
    checked = 0
    for key in {k for row in rows for k in row if k != "step"}:
        want = {row["step"]: float(row[key]) for row in rows if key in row}
        got = {m.step: m.value for m in client.get_metric_history(run_id, mlflow_name(key))}
        assert got == want, key
        checked += 1
    assert checked > 40
    assert "eval/arithmetic_test/pass_at_2" in client.get_run(run_id).data.metrics
    arts = {a.path for a in client.list_artifacts(run_id)}
    assert {"metrics.jsonl", "batches.jsonl"} <= arts
    # the same command again: the stage is finished, nothing new; a longer one resumes in the same run
    r = run_to_end([*[a.replace("buffer.total_steps=2", "buffer.total_steps=3") for a in args], "resume_with_changes=true"],
                   env, tmp_path / "longer_run")
    assert r.returncode == 0, r.stderr[-3000:]
    runs = client.search_runs([client.get_experiment_by_name("rft").experiment_id])
    assert len(runs) == 1 and max(m.step for m in client.get_metric_history(run_id, "reward/mean")) == 3


def test_mlflow_metric_names_spell_at_and_equals_out():
    """README: `@` and `=` in a metric's name become `_at_` and `_eq_` in MLflow (which refuses them);
    any other character it refuses becomes `_`; the characters it takes are kept."""
    from rft.reporting.monitor import mlflow_name

    assert mlflow_name("eval/math_test/level=2/pass@4") == "eval/math_test/level_eq_2/pass_at_4"
    assert mlflow_name("eval/x/mean@8_se") == "eval/x/mean_at_8_se"
    assert mlflow_name("reward/a-b.c: d") == "reward/a-b.c: d" and mlflow_name("reward/a+b") == "reward/a_b"


@pytest.mark.slow  # 5.0 s alone, over the fast tier's second
def test_an_mlflow_server_that_does_not_answer_is_one_paragraph_within_seconds(tmp_path, monkeypatch):
    import time

    from rft.errors import ConfigError
    from rft.reporting.monitor import start_trackers

    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    cfg = compose_cfg(["monitor=mlflow", "monitor.mlflow_tracking_uri=http://127.0.0.1:1", f"checkpoint_root_dir={tmp_path}"])
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="monitor.monitor_type: the tracker mlflow did not start: MlflowException: "
                                          "API request to http://127.0.0.1:1/"):
        start_trackers(cfg, tmp_path, "grpo", 0)
    assert time.monotonic() - t0 < 60  # MLflow's own retries took 4 minutes


def test_a_step_that_logged_no_reward_shows_none_on_the_console(tmp_path, capsys):
    """A step whose every task failed logs no reward (rft.rollout.explorer.rollout_metrics): its
    line showed the last step's reward.mean as if it were this one's. An eval's value is shown
    until the next eval, as before."""
    monitor = Monitor(_cfg(), _new(tmp_path, "a"), 3, 0, "grpo")
    monitor.log(1, {"reward/mean": 0.5, "eval/accuracy": 0.25, "loss/policy": 0.1})
    monitor.log(2, {"rollout/experiences": 0, "rollout/failed_tasks": 4})
    monitor.log(3, {"reward/mean": 0.75, "loss/policy": 0.2})
    monitor.close()
    assert capsys.readouterr().out.splitlines() == ["[grpo] step 1/3  reward.mean=0.5 eval.accuracy=0.25 loss.policy=0.1",
                                                    "[grpo] step 2/3  eval.accuracy=0.25",
                                                    "[grpo] step 3/3  reward.mean=0.75 eval.accuracy=0.25 loss.policy=0.2"]
