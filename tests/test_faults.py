"""Faults outside a checkpoint's own files: a kill at a chosen point of a copy from the stage cache,
a publish or an export; two runs of one name at once; a disk that fills away from the checkpoint
(a log, the SQL buffer); damaged caches rft built itself; records read back cut short (a resumed
log's rows, a sweep job's overrides); a checkpoint from before manifests copied over another's
step. Each ends in a run equal to an uninterrupted one, or says what was lost or what to do in one
paragraph; none in a traceback or a silently different result. (Damage to checkpoints
themselves: test_damage.py, test_checkpoints_manifest.py.)"""

import csv
import datetime
import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, compose_cfg
from safetensors.torch import load_file

import rft.runtime.main
from rft.data.experience import Experience
from rft.errors import RunError
from rft.reporting.monitor import read_metrics
from rft.runtime import checkpoint, rundir
from rft.runtime.checkpoint import Owner, usable_checkpoint

OWNER = Owner(run="rft/study", stage="grpo", config="c0ffee00c0ffee00", model="/models/tiny")


# a run of 2 steps in this process, in a few seconds (the tiny model; nothing learns, which no test here needs)
TINY = ["stages=[]", "cluster=inline", "monitor=console", "buffer.batch_size=4", "algorithm.repeat_times=2",
        "buffer.total_steps=2", "trainer.save_interval=1", "explorer.eval_on_startup=false",
        "explorer.eval_interval=2", "stage_cache_dir=null"]


def hooked(tmp_path, code: str) -> dict:
    """The environment of a subprocess that runs `code` first (a sitecustomize on PYTHONPATH): a
    hook that kills the process, or pauses it, at a chosen point."""
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(code)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT)])}


def wait_for(path, proc, timeout=300):
    t0 = time.monotonic()
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() - t0 < timeout
        time.sleep(0.2)


def said():
    lines = []
    return lines, lines.append


def legacy(stage, step):
    """Checkpoint `step` as an rft from before manifests wrote it: a state.json, no manifest.json."""
    d = checkpoint.write(stage, step, {"version": step}, owner=OWNER)
    (d / "manifest.json").unlink()
    state = json.loads((d / "state.json").read_text())
    del state["manifest"]
    (d / "state.json").write_text(json.dumps(state))
    return d


def test_a_checkpoint_from_before_manifests_copied_over_another_step_is_set_aside(tmp_path):
    """step_1 copied over step_2: with no manifest nothing was checked, and the run resumed at step 2
    with step 1's optimizer, buffer place and reward statistics (exit 0, another model)."""
    stage = tmp_path / "grpo"
    one, two = legacy(stage, 1), legacy(stage, 2)
    shutil.rmtree(two)
    shutil.copytree(one, two)
    lines, say = said()
    assert usable_checkpoint(stage, OWNER, "grpo", say).step == 1
    (aside,) = (stage / "checkpoints").glob("step_2.damaged-*")
    assert lines[0] == (f"[grpo] checkpoint step 2 is damaged ({two / 'state.json'}: it is the state of step 1, in the "
                        f"directory of step 2 (copied over it?)); moved it to {aside.name} and falling back to the "
                        f"previous complete checkpoint")
    assert lines[1].startswith("[grpo] warning: checkpoint step 1 (")  # the one used: legacy, said so


def test_outputs_moved_aside_twice_in_one_second_keep_both(tmp_path, monkeypatch):
    """continue_from_checkpoint=false twice in one second (or with the clock set back): the second
    raised FileExistsError under a traceback, previous_<time> being taken."""
    fixed = datetime.datetime(2026, 11, 26, 12, 0, 0)
    monkeypatch.setattr(rundir, "datetime", SimpleNamespace(datetime=SimpleNamespace(now=lambda: fixed)))
    for n in range(3):
        (tmp_path / "metrics.jsonl").write_text(f"{n}\n")
        rundir.move_aside(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "previous_20261126_120000", "previous_20261126_120000-2", "previous_20261126_120000-3"]
    assert (tmp_path / "previous_20261126_120000-3" / "metrics.jsonl").read_text() == "2\n"


PAUSE_AT_FIRST_SAVE = """
import os, time
import rft.runtime.checkpoint as c
real = c.write
def write(*a, **k):
    open({paused!r}, "w").close()
    while not os.path.exists({go!r}):
        time.sleep(0.1)
    c.write = real
    return real(*a, **k)
c.write = write
"""


@pytest.mark.slow
def test_a_second_run_of_a_running_name_stops_and_touches_nothing(tmp_path):
    """The same command started again while the first runs (a second terminal, a job requeued while
    it still ran): it trained into the same directory, and with continue_from_checkpoint=false it
    first moved the running run's outputs away; the two then overwrote each other's logs."""
    paused, go = tmp_path / "paused", tmp_path / "go"
    args = [*TINY, f"checkpoint_root_dir={tmp_path}", "name=same"]
    env = hooked(tmp_path, PAUSE_AT_FIRST_SAVE.format(paused=str(paused), go=str(go)))
    first = subprocess.Popen([sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for(paused, first)  # trained step 1, about to save it
        run = tmp_path / "rft" / "same"
        before = sorted(p.name for p in run.iterdir())
        with pytest.raises(RunError) as e:
            rft.runtime.main._main(compose_cfg([*args, "continue_from_checkpoint=false"]))
        assert str(e.value) == (
            f"another rft process (pid {first.pid} on {socket.gethostname()}) is running in {run} (it holds "
            f"{run / '.run.lock'}); two runs writing one directory overwrite each other's checkpoints and logs. "
            f"Wait for it to end (or stop it), or give this run another name (name=...).")
        assert sorted(p.name for p in run.iterdir()) == before  # nothing moved aside, nothing written
    finally:
        go.touch()
        out = first.communicate(timeout=300)[0]
    assert first.returncode == 0, out[-3000:]
    assert [m["step"] for m in read_metrics(tmp_path / "rft" / "same" / "metrics.jsonl")] == [1, 2]
    rft.runtime.main._main(compose_cfg(args))  # once it ended, the name is free: its resume finds it finished


@pytest.mark.slow
def test_a_disk_that_fills_outside_a_checkpoint_save_stops_in_one_paragraph(tmp_path, monkeypatch, capsys):
    """The disk fills (another job's files) just after checkpoint step 2 is saved, as the step's
    metrics line is written: an OSError under a traceback before (a save that fails says so
    itself: test_checkpoints_manifest.py)."""
    from rft.reporting.monitor import Monitor

    real = Monitor.log

    def log(self, step, metrics, advance=True):
        if step == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, step, metrics, advance)

    monkeypatch.setattr(Monitor, "log", log)
    args = [*TINY, f"checkpoint_root_dir={tmp_path}", "name=full"]
    run = tmp_path / "rft" / "full"
    with pytest.raises(SystemExit) as e:
        rft.runtime.main.main(compose_cfg(args))
    assert e.value.code == 1
    err = capsys.readouterr().err
    free = shutil.disk_usage(run).free / 2**30
    assert err == (f"\nrft: the run stopped: writing in {run} failed (OSError: [Errno 28] No space left on device); "
                   f"that disk has {free:.1f} GiB free. Make room (or point checkpoint_root_dir at another disk), then "
                   f"run the same command again to resume (the newest checkpoint: "
                   f"{run / 'checkpoints' / 'step_2'}).\n\n")
    monkeypatch.setattr(Monitor, "log", real)  # room made
    rft.runtime.main.main(compose_cfg(args))
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == [1, 2]  # step 2's row, from its checkpoint


# the default's two stages on a budget: 4 warm-up steps (a stage the stage cache takes), 1 GRPO step
TWO_STAGES = ["cluster=inline", "monitor=console", "stages.0.buffer.total_steps=4",
              "stages.0.algorithm.optimizer.warmup_steps=0", "buffer.total_steps=1", "buffer.batch_size=4",
              "algorithm.repeat_times=2", "explorer.eval_on_startup=false"]

KILL_AT_FIRST_SEAL_UNDER = """
import os
import rft.manifest as m
real = m.seal
def seal(d, *a, **k):
    if {under!r} in str(d):
        os.kill(os.getpid(), 9)
    return real(d, *a, **k)
m.seal = seal
"""


@pytest.mark.slow
def test_a_copy_from_the_stage_cache_killed_midway_is_copied_again(tmp_path, capsys):
    """Killed after the entry's checkpoint was linked in, before its manifest was written anew and the
    logs copied: the same command then stopped ("config.yaml ... is missing"), and with
    resume_with_changes=true went on with the warm-up's metrics.jsonl cut to its last row."""
    common = [*TWO_STAGES, f"checkpoint_root_dir={tmp_path}"]
    rft.runtime.main.main(compose_cfg([*common, "name=first"]))
    first, second = tmp_path / "rft" / "first" / "sft_warmup", tmp_path / "rft" / "second" / "sft_warmup"
    env = hooked(tmp_path, KILL_AT_FIRST_SEAL_UNDER.format(under=str(second)))
    r = subprocess.run([sys.executable, str(ROOT / "run.py"), *common, "name=second"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == -9, r.stderr[-3000:]
    capsys.readouterr()
    rft.runtime.main.main(compose_cfg([*common, "name=second"]))
    out = capsys.readouterr().out
    assert "[sft_warmup] reused: the same stage" in out
    assert read_metrics(second / "metrics.jsonl") == read_metrics(first / "metrics.jsonl")  # steps 1-4, whole
    # the warm-up (mode=train) copied is written with this run's own config.yaml (rundir.reuse: its key
    # leaves the taskset's reward out, so the publisher's may hold another): the name is all that differs
    assert (second / "config.yaml").read_text() == (first / "config.yaml").read_text().replace("name: first",
                                                                                           "name: second")
    a = load_file(first / "checkpoints" / "step_4" / "hf" / "model.safetensors")
    b = load_file(second / "checkpoints" / "step_4" / "hf" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(p.name for p in (second / "checkpoints").iterdir()) == ["step_4"]
    assert checkpoint.read_checkpoint(second / "checkpoints" / "step_4").identity["run"] == "rft/second"


def test_a_generated_taskset_cut_short_is_generated_again(tmp_path, capsys):
    """train.jsonl cut at a line's end (a copy that stopped, a full disk): 100 rows of 2000 were
    trained on, exit 0 (the dry run's plan said 'dataset rows 100', nothing else did)."""
    from rft.data.tasks import generate_arithmetic

    path = tmp_path / "data" / "arithmetic-v4"
    generate_arithmetic(path)
    train = path / "train.jsonl"
    whole = train.read_bytes()
    cut = b"".join(whole.splitlines(keepends=True)[:100])
    train.write_bytes(cut)
    generate_arithmetic(path)
    assert train.read_bytes() == whole  # 2000 rows, the same ones
    (aside,) = path.parent.glob("arithmetic-v4.damaged-*")
    assert (aside / "train.jsonl").read_bytes() == cut  # kept for a look
    assert capsys.readouterr().err == (
        f"rft: warning: the generated task data in {path} is damaged ({train}: {len(cut)} bytes, {len(whole)} when "
        f"saved (cut short or written over)); moved it to {aside.name} and building it again\n")


def test_generated_data_from_before_manifests_is_kept_when_the_same_and_set_aside_when_not(tmp_path, capsys):
    from rft import manifest
    from rft.data.tasks import generate_countdown

    path = tmp_path / "countdown-v1"
    generate_countdown(path)
    (path / "manifest.json").unlink()  # as an rft before manifests left it
    key = rundir.path_identity(str(path))  # what a stage cache key holds of it
    generate_countdown(path)
    assert manifest.verify(path) is None and capsys.readouterr().err == ""
    assert rundir.path_identity(str(path)) == key  # sealed in place: its files untouched, the key the same
    (path / "manifest.json").unlink()
    (path / "test.jsonl").write_text('{"numbers": [1, 2, 3], "target": 7, "answer": "1+2*3"}\n')
    generate_countdown(path)
    (aside,) = tmp_path.glob("countdown-v1.damaged-*")
    assert capsys.readouterr().err.startswith(
        f"rft: warning: the generated task data in {path}, from an rft before built files were checked, is not the "
        f"one this rft builds ({path / 'test.jsonl'}: ")
    assert manifest.verify(path) is None and len((path / "test.jsonl").read_text().splitlines()) > 1


@pytest.mark.slow  # builds the tiny model three times (~7 s each)
def test_the_built_tiny_model_damaged_is_built_again(tmp_path, capsys):
    """A cut config.json said 'model.model_path=... could not be loaded; give a local directory in
    Hugging Face format' of the folder rft itself built; a zeroed block of its weights was trained
    from, exit 0."""
    from rft.models import build_tiny_model

    path = tmp_path / "models" / "tiny-qwen2-v2"
    build_tiny_model(path)
    files = {f.name: f.read_bytes() for f in path.iterdir()}
    weights = bytearray(files["model.safetensors"])
    weights[-4096:-2048] = bytes(2048)
    for name, damaged in [("config.json", files["config.json"][:200]), ("model.safetensors", bytes(weights))]:
        (path / name).write_bytes(damaged)
        build_tiny_model(path)
        assert {f.name: f.read_bytes() for f in path.iterdir()} == files  # the same model, built again
        assert f"rft: warning: the tiny model in {path} is damaged ({path / name}: " in capsys.readouterr().err
    assert len(list(path.parent.glob("tiny-qwen2-v2.damaged-*"))) == 2


@pytest.mark.slow  # an export in a subprocess, killed, then one that finishes (~20 s)
def test_an_export_killed_midway_leaves_no_folder_that_looks_exported(tmp_path, cache_dir):
    """Killed after the model was written, before its manifest: the folder held a model without a
    tokenizer or manifest, which from_pretrained loads, and the same command then refused it as
    'not an empty folder'."""
    from rft.models import build_tiny_model

    model = build_tiny_model(cache_dir / "models" / "tiny-qwen2-v2")
    d = checkpoint.write(tmp_path / "grpo", 1, {},
                         lambda tmp: shutil.copytree(model, tmp / "hf", ignore=shutil.ignore_patterns("manifest.json"))
                         and {}, owner=OWNER)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "rft.runtime.export", str(d), str(out)]
    env = hooked(tmp_path, KILL_AT_FIRST_SEAL_UNDER.format(under=str(tmp_path / "out")))
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == -9, r.stderr[-3000:]
    assert not out.exists()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout == f"wrote {out} (load it with AutoModelForCausalLM.from_pretrained)\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grpo", "hook", "out"]  # no half-written folder beside it
    from rft import manifest
    assert manifest.verify(out) is None
    assert (out / "tokenizer.json").exists()


def test_the_manifest_command_on_what_is_not_a_folder_says_so(tmp_path, capsys):
    """A file was 'damaged: <file>/manifest.json: does not parse (cut short or overwritten)'."""
    from rft import manifest
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 8)
    for given, what in [(tmp_path / "model.safetensors", "not a folder"), (tmp_path / "nowhere", "no such folder")]:
        assert manifest.main([str(given)]) == 2
        assert capsys.readouterr().err == (f"{given}: {what}; give a checkpoint (step_<N>), a stage-cache entry or an "
                                           f"export folder\n")


def test_a_report_over_a_job_whose_overrides_record_is_cut_reports_the_others(tmp_path, capsys):
    """One job's .hydra/overrides.yaml cut short (a full disk as Hydra wrote it, a hand edit): the
    whole sweep's report was a yaml ParserError traceback."""
    from test_report import GRPO, SFT, write_job

    from rft.reporting import report

    d = tmp_path / "sweep"
    write_job(d, 0, ["seed=1", "algorithm.optimizer.lr=1e-3"], "grpo", {"sft_warmup": SFT, "grpo": GRPO})
    write_job(d, 1, ["seed=2", "algorithm.optimizer.lr=1e-3"], "grpo", {"sft_warmup": SFT, "grpo": GRPO})
    cut = d / "1" / ".hydra" / "overrides.yaml"
    cut.write_text("- seed=2\n- 'algorithm.optimizer.lr=1e")  # Hydra quotes a value with special characters
    out = report.report(d)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"rft.reporting.report: warning: {cut} does not parse as YAML (")
    assert err.endswith("); job 1 is reported as a configuration of its own, without its overrides.\n")
    rows = {r["job"]: r for r in csv.DictReader(out["csv"].open())}
    assert rows["0"]["algorithm.optimizer.lr"] == "1e-3" and rows["1"]["algorithm.optimizer.lr"] == ""
    assert rows["0"]["status"] == rows["1"]["status"] == "done"


def test_a_resume_says_which_steps_its_log_lost(tmp_path, capsys):
    """metrics.jsonl cut to its first rows (or edited) before a resume from step 5: the run went on
    without a word, and its log, the report and the 'eval accuracy: start' line then lacked them."""
    from test_monitor import _cfg, _rows, _write

    from rft.reporting.monitor import Monitor

    run = tmp_path / "grpo"
    _write(run / "metrics.jsonl", _rows(0, 1, 4))
    Monitor(_cfg(), run, 8, 5, "grpo").close()
    assert capsys.readouterr().err == (
        f"rft: warning: {run / 'metrics.jsonl'} has no row for steps 2-3, which this run logged before its checkpoint "
        f"of step 5: the file was cut or edited since, and no checkpoint holds them, so the log goes on without "
        f"them.\n")
    _write(run / "metrics.jsonl", _rows(0, 1, 2, 3, 4, 5, 6))  # whole, and a row the resume writes again
    Monitor(_cfg(), run, 8, 5, "grpo").close()
    assert capsys.readouterr().err == ""


def test_a_sql_buffer_on_a_full_disk_is_not_called_damaged(tmp_path):
    """SQLite's 'database or disk is full' was reported as a damaged buffer, with the advice to move
    the file away: for a mode=explore run, every experience it had written."""
    import sqlalchemy as sa
    from test_buffers import buf_cfg, exps

    from rft.data.buffer import SQLBuffer

    path = tmp_path / "b.db"
    buf = SQLBuffer(buf_cfg("sql", path=str(path)))
    buf.put(exps(4))
    buf.engine.dispose()  # new connections, each with a disk that holds no more than the file's pages now
    pages = path.stat().st_size // 4096
    sa.event.listen(buf.engine, "connect", lambda conn, _: conn.execute(f"PRAGMA max_page_count = {pages}"))
    big = [Experience(list(range(50)), 10, [0.0] * 40, task_id=f"t{i}", info={"pad": "x" * 2000}) for i in range(50)]
    with pytest.raises(RunError) as e:
        buf.put(big)
    assert str(e.value) == (
        f"the buffer {path} cannot be written: its disk is full (database or disk is full). The file is whole (the "
        f"write that failed left nothing in it): make room, then run the same command again to resume from the "
        f"newest checkpoint.")
    buf.engine.dispose()
    assert len(SQLBuffer(buf_cfg("sql", path=str(path)))) == 4  # nothing lost, nothing half-written


def test_what_a_publish_killed_midway_left_in_the_stage_cache_is_cleared_by_the_next(tmp_path):
    """Killed before its rename, a publish left <key>.tmp<pid> (the logs copied, the checkpoint
    linked) in the cache for good; the next publish of the key, under the key's lock, removes it."""
    stage = tmp_path / "grpo"
    final = checkpoint.write(stage, 2, {}, lambda tmp: (tmp / "weights.bin").write_bytes(b"w" * 64) and {}, owner=OWNER)
    left = tmp_path / "cache" / "key.tmp4242"
    (left / "checkpoint").mkdir(parents=True)
    (left / "metrics.jsonl").write_text('{"step": 1}\n')
    rundir.publish(tmp_path / "cache" / "key", stage, final, print)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["key"]
