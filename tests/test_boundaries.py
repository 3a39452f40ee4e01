"""What rft reads at its boundaries, crafted or damaged: the task pipeline's cached report, a sweep's
multirun.yaml, a sharded model's index, a reward server's request body, a study's module names, a
user's experience operator; and what a kill midway or an early Slurm warning leaves behind."""

import json

import pytest
from omegaconf import OmegaConf

from rft import manifest
from rft.config import Config
from rft.errors import ConfigError, RunError

# ---------------------------------------------------------------- the task pipeline's cached report


def pipeline_config(tmp_path):
    cfg = OmegaConf.structured(Config)
    cfg.cache_dir = str(tmp_path / "cache")
    cfg.model.model_path = str(tmp_path / "model")
    cfg.buffer.explorer_input.taskset.path = str(tmp_path / "tasks.jsonl")
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps({"question": q, "answer": "1"}) + "\n"
                                                  for q in ["1+1", "12+34"]))
    ops = [{"name": "document_deduplicator"}]
    return OmegaConf.merge(cfg, {"data_processor": {"task_pipeline": {"operators": ops}}})


def sealed_output(cfg, report_text: str):
    """The pipeline's output folder for `cfg`, its report.json `report_text`, sealed as rft seals it:
    what a hand edit followed by a new manifest (or another rft's report) leaves."""
    from rft.data.pipeline import output_dir

    d = output_dir(cfg)
    d.mkdir(parents=True)
    (d / "train.jsonl").write_text(json.dumps({"question": "1+1", "answer": "1"}) + "\n")
    (d / "report.json").write_text(report_text)
    manifest.seal(d, {"built": "task pipeline output"})
    return d


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000,  # json: RecursionError
                                  "[1, 2]",                         # not a dict: {**report} a TypeError
                                  '{"rows": 2}',                    # no operators: format_report a KeyError
                                  '{"rows": 2, "input": "t", "operators": [{"name": "x"}]}'])
def test_a_sealed_report_that_rft_did_not_write_is_not_cached(tmp_path, text):
    from rft.data.pipeline import cached_report, describe_rows

    cfg = pipeline_config(tmp_path)
    sealed_output(cfg, text)
    assert cached_report(cfg) is None
    # the dry run says it has not run yet (it is made again when the run starts)
    assert "not run yet" in describe_rows(cfg)[0][1]


@pytest.mark.slow  # ~1.5 s, importing `datasets` (which reads the rows)
def test_the_pipeline_builds_again_over_a_sealed_report_it_cannot_read(tmp_path):
    from rft.data.pipeline import cached_report, run_task_pipeline

    cfg = pipeline_config(tmp_path)
    d = sealed_output(cfg, "[" * 100_000)
    said = []
    report = run_task_pipeline(cfg, say=said.append)
    # built again: 2 rows in, none the same, 2 out; the damaged folder kept beside it
    assert not report["cached"] and report["rows"] == 2 and report["operators"][0]["rows_out"] == 2
    assert cached_report(cfg)["rows"] == 2
    aside = [p for p in d.parent.iterdir() if p.name.startswith(d.name + ".damaged-")]
    assert len(aside) == 1 and (aside[0] / "report.json").read_text() == "[" * 100_000
    assert said[0] == (f"warning: the task pipeline output in {d} is damaged (its report.json is not one rft "
                       f"writes); moved it to {aside[0].name} and building it again")


# ---------------------------------------------------------------- a sweep's multirun.yaml

BASIC = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def multirun(tmp_path, params: str, task: str = "[]"):
    """A sweep directory with one job done (its overrides only) and `multirun.yaml` of `params`."""
    d = tmp_path / "sweep"
    (d / "0" / ".hydra").mkdir(parents=True)
    (d / "0" / ".hydra" / "overrides.yaml").write_text("- seed=0\n")
    (d / "multirun.yaml").write_text(f"hydra:\n  sweeper:\n    _target_: {BASIC}\n    params: {params}\n"
                                     f"  overrides:\n    task: {task}\n")
    return d


@pytest.mark.parametrize("params, task, count", [
    ("{seed: 'range(0,1000000000)'}", "[]", "1,000,000,000 jobs"),  # listed: ~500 GB
    # 2 x 3 x 16,667 = 100,002; the command line's lr (3 values) replaces the params' (2)
    ("{a: '1,2', lr: '1,2'}", "['lr=1,2,3', 'b=range(0,100001,6)']", "100,002 jobs"),
    ("{x: 'range(0,inf,1.0)'}", "[]", "endless jobs"),
])
def test_a_sweep_of_too_many_jobs_is_refused_before_they_are_listed(tmp_path, capsys, params, task, count):
    from rft.reporting import report

    d = multirun(tmp_path, params, task)
    assert report.main([str(d)]) == 2
    assert capsys.readouterr().err == (
        f"rft.reporting.report: {d / 'multirun.yaml'} plans {count} (its hydra.sweeper.params and "
        f"hydra.overrides.task), more than the 100,000 a report lists: not a sweep Hydra ran, or one no table could "
        f"show. If it is not the file Hydra wrote, move it out of {d} and report again: the report then lists the job "
        f"directories found, without the jobs never started.\n")


def test_a_sweep_of_the_most_jobs_is_listed(tmp_path):
    from rft.reporting import report

    # 10 x 10,000 = 100,000: the limit itself is listed, in Hydra's order
    jobs = report.planned_jobs(multirun(tmp_path, "{a: 'range(0,10)', b: 'range(0,10000)'}"))
    assert len(jobs) == 100_000 and jobs[0] == {"a": "0", "b": "0"} and jobs[-1] == {"a": "9", "b": "9999"}


@pytest.mark.parametrize("params", [
    "{algorithm: &a 'grpo,dapo', seed: *a}",  # one alias: Hydra never writes one
    # nine lists of nine aliases: 9^9 = 387,420,489 values once expanded
    "{a: &a [x,x,x,x,x,x,x,x,x], " + ", ".join(f"{c}: &{c} [{','.join(['*' + p] * 9)}]"
                                                for p, c in zip("abcdefgh", "bcdefghi")) + "}",
    "{seed: " + "[" * 100_000 + "]" * 100_000 + "}",  # nested past libyaml's limit
])
def test_a_multirun_yaml_hydra_did_not_write_lists_the_jobs_found(tmp_path, params):
    from rft.reporting import report

    d = multirun(tmp_path, params)
    assert report.planned_jobs(d) == []
    assert [j.num for j in report.read_jobs(d)] == ["0"]


# ---------------------------------------------------------------- a sharded model's index


def sharded(tmp_path, shard_name: str):
    """A model folder whose index names `shard_name` for its one tensor; the weights lie beside
    the folder, in `elsewhere.safetensors` (zeros: not the model's)."""
    import torch
    from safetensors.torch import save_file

    d = tmp_path / "models" / "hf"
    d.mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, str(tmp_path / "models" / "elsewhere.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {"w": shard_name}}))
    return d


@pytest.mark.parametrize("name", ["../elsewhere.safetensors", "ABS", "link.safetensors", "sub/x.safetensors", ".."])
def test_a_shard_outside_the_model_folder_is_refused(tmp_path, name):
    from rft.sync.weights import hf_tensors, hf_weight_files

    outside = tmp_path / "models" / "elsewhere.safetensors"
    name = str(outside) if name == "ABS" else name
    d = sharded(tmp_path, name)
    if name == "link.safetensors":  # a plain name, but a link out of the folder
        (d / name).symlink_to(outside)
    message = (f"{d / 'model.safetensors.index.json'} lists {name!r} as the shard of 'w' (and maybe more), which is "
               f"not a file of {d} itself: a shard is named by its file name beside the index, with no folder, '..' or "
               f"absolute path, and is no link out of the folder. Save the model again with save_pretrained (it writes "
               f"its shards there), or copy the shards into {d} and name them so.")
    for read in (hf_weight_files, lambda d: dict(hf_tensors(d))):
        with pytest.raises(ConfigError) as e:
            read(d)
        assert str(e.value) == message


def test_shards_beside_the_index_are_read(tmp_path):
    import shutil

    from rft.sync.weights import hf_tensors, hf_weight_files

    d = sharded(tmp_path, "model-00001-of-00001.safetensors")
    shutil.copy(tmp_path / "models" / "elsewhere.safetensors", d / "model-00001-of-00001.safetensors")
    assert hf_weight_files(d) == [d / "model-00001-of-00001.safetensors"]
    assert dict(hf_tensors(d))["w"].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("text, why", [("[", "JSONDecodeError: Expecting value: line 1 column 2 (char 1)"),
                                       ("[]", "TypeError: list indices must be integers or slices, not str"),
                                       ('{"weight_map": {"w": ["a"]}}', "TypeError: unhashable type: 'list'")])
def test_an_index_that_does_not_read_is_one_paragraph(tmp_path, text, why):
    from rft.sync.weights import hf_weight_files

    d = sharded(tmp_path, "x")
    (d / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ConfigError) as e:
        hf_weight_files(d)
    assert str(e.value) == (f"{d / 'model.safetensors.index.json'} does not read as a safetensors index, "
                            f"{{\"weight_map\": {{<tensor>: <shard file>}}}} ({why}). Save the model again with "
                            f"save_pretrained, or remove the index where {d} holds one model.safetensors.")


# ---------------------------------------------------------------- moving a run's outputs aside


def used_run(tmp_path):
    """A run directory of four outputs, its lock and an earlier move's folder."""
    run = tmp_path / "run"
    for rel in ("metrics.jsonl", "grpo/checkpoints/step_2/state.json", ".hydra/config.yaml", "run.log"):
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_text(rel)
    (run / ".run.lock").write_text("pid 1 on h\n")
    (run / "previous_20261101_000000").mkdir()
    return run


def killed_after(monkeypatch, run, renames: int):
    """os.rename (what shutil.move calls) of run's outputs raises KeyboardInterrupt after `renames` of them."""
    import os

    real, done = os.rename, []

    def rename(src, dst, *a, **k):
        if os.path.dirname(os.fspath(src)) == str(run) and not os.path.basename(os.fspath(src)).startswith("previous_"):
            if len(done) == renames:
                raise KeyboardInterrupt  # the kill
            done.append(src)
        return real(src, dst, *a, **k)

    monkeypatch.setattr(os, "rename", rename)


def outputs(d):
    return sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())


def test_a_kill_while_outputs_move_aside_leaves_them_whole_in_one_folder(tmp_path, monkeypatch):
    from rft.runtime import rundir

    run = used_run(tmp_path)
    with monkeypatch.context() as m:
        killed_after(m, run, 2)
        with pytest.raises(KeyboardInterrupt):
            rundir.move_aside(run)
    # the same command again: all four in one new folder, none left behind
    moved = rundir.move_aside(run)
    assert sorted(p.name for p in run.iterdir()) == [".run.lock", "previous_20261101_000000", moved.name]
    assert moved.name.startswith("previous_") and not moved.name.endswith(".tmp")
    assert outputs(moved) == [".hydra/config.yaml", "grpo/checkpoints/step_2/state.json", "metrics.jsonl", "run.log"]


def test_a_run_that_resumes_after_the_kill_finds_no_half_of_the_outputs(tmp_path, caplog):
    from rft.runtime import rundir

    run = used_run(tmp_path)
    # what a kill midway leaves: two outputs moved into the move's folder, two not yet
    tmp = run / "previous_20261128_101010.tmp"
    tmp.mkdir()
    for name in ("run.log", ".hydra"):
        (run / name).rename(tmp / name)
    (run / "run.log").write_text("the next run's first line")  # Hydra's log of the run started after the kill
    with rundir.run_lock(run):  # continue_from_checkpoint=true: no move of its own, yet none of the outputs left
        assert sorted(p.name for p in run.iterdir()) == [".run.lock", "previous_20261101_000000",
                                                         "previous_20261128_101010"]
    moved = run / "previous_20261128_101010"
    # the killed move's four, and the next run's run.log beside its namesake
    assert outputs(moved) == [".hydra/config.yaml", "grpo/checkpoints/step_2/state.json", "metrics.jsonl", "run.log",
                              "run.log-2"]
    assert (moved / "run.log").read_text() == "run.log"
    assert (moved / "run.log-2").read_text() == "the next run's first line"
    said = f"a move of {run}'s earlier outputs, cut short by a kill, is finished: they are all in {moved}"
    assert said in caplog.text


# ---------------------------------------------------------------- a study's module named like a standard one


def test_a_study_module_named_like_a_standard_one_is_named_before_anything_imports_it(tmp_path):
    import os
    import subprocess
    import sys

    from conftest import ROOT

    study = tmp_path / "study"
    study.mkdir()
    (study / "rewards.py").write_text("def mine(prompt, response, task):\n    return 1.0\n")
    (study / "random.py").write_text("def pick(xs):\n    return xs[0]\n")  # Hydra's `from random import shuffle`
    (study / "email").mkdir()  # a folder without __init__.py: a namespace package, which shadows nothing
    env = {**os.environ, "PYTHONPATH": str(study)}
    r = subprocess.run([sys.executable, "run.py", "dry_run=true"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr == (
        f"\nrft: configuration error: {study / 'random.py'} is named like Python's standard module `random` ({study}, "
        f"in PYTHONPATH). Python searches these folders before its standard library, so every import of that name "
        f"in this run (Hydra's, torch's, rft's and Ray's workers' included) would load the study's instead, and fail "
        f"far from it. Rename it (and the imports and dotted paths that name it), or keep the study's modules in a "
        f"package of its own (my_study/random.py is imported as my_study.random, which shadows nothing).\n\n")


def test_which_folders_and_names_shadow(tmp_path):
    from rft.plan.search_path import shadowing, study_folders

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "code").mkdir()
    (tmp_path / "a" / "code" / "__init__.py").write_text("")  # a package named like `code` (pdb imports it)
    (tmp_path / "a" / "rewards.py").write_text("")
    (tmp_path / "a" / "json.txt").write_text("")  # not a module
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "typing.py").write_text("")
    folders = study_folders(str(tmp_path / "b"), {"PYTHONPATH": f"{tmp_path / 'a'}:{tmp_path / 'missing'}"})
    assert folders == [(str(tmp_path / "b"), "the folder of run.py"), (str(tmp_path / "a"), "in PYTHONPATH"),
                       (str(tmp_path / "missing"), "in PYTHONPATH")]
    assert shadowing(folders) == [(str(tmp_path / "b" / "typing.py"), "typing",
                                   f"{tmp_path / 'b'}, the folder of run.py"),
                                  (str(tmp_path / "a" / "code"), "code", f"{tmp_path / 'a'}, in PYTHONPATH")]
    assert study_folders(None, {}) == []


# ---------------------------------------------------------------- an experience operator of the wrong shape


def op_takes_nothing():
    return []


def op_positional_only(experiences, k, /):
    return experiences


def op_task_shaped(rows, ctx):
    return rows


def op_slips(experiences, threshold=1):
    return [e for e in experiences if len(e.reward) > threshold]  # len of a float: the operator's own TypeError


SHAPE = "a function fn(experiences, **args) -> experiences (module.function)"


@pytest.mark.parametrize("op, args, message", [
    # was: "op_takes_nothing() takes 0 positional arguments but 1 was given; check the types of its args ({})"
    ("op_takes_nothing", {}, ".name='test_boundaries.op_takes_nothing' is test_boundaries.op_takes_nothing(), which "
                             f"cannot be called as {SHAPE}, with args {{}} (too many positional arguments). Give it "
                             "that signature."),
    ("op_positional_only", {"k": 1}, ".name='test_boundaries.op_positional_only' is "
                                     "test_boundaries.op_positional_only(experiences, k, /), which cannot be called as "
                                     f"{SHAPE}, with args {{'k': 1}} ('k' parameter is positional only, but was passed "
                                     "as a keyword). Give it that signature."),
    ("op_task_shaped", {}, ".args lacks ['ctx'], which test_boundaries.op_task_shaped needs; its arguments are ['ctx'] "
                           f"(an operator there is {SHAPE})."),
])
def test_an_experience_operator_of_the_wrong_signature_is_named_at_planning(op, args, message):
    from rft.data.pipeline import ExperiencePipeline

    with pytest.raises(ConfigError) as e:
        ExperiencePipeline([{"name": f"test_boundaries.{op}", "args": args}])
    assert str(e.value) == "data_processor.experience_pipeline.operators[0]" + message


def test_a_builtin_without_a_signature_is_one_paragraph(tmp_path):
    from rft.data.pipeline import check_operators

    cfg = pipeline_config(tmp_path)
    cfg.data_processor.task_pipeline.operators[0].name = "builtins.max"  # was inspect's raw ValueError
    with pytest.raises(ConfigError) as e:
        check_operators(cfg)
    assert str(e.value) == ("data_processor.task_pipeline.operators[0].name='builtins.max': its signature cannot be "
                            "read (no signature found for builtin <built-in function max>); an operator there is a "
                            "function fn(rows, ctx, **args) -> rows (module.function): wrap it in one.")


def test_an_operators_own_type_error_names_its_line():
    from rft.data.experience import Experience
    from rft.data.pipeline import ExperiencePipeline

    pipeline = ExperiencePipeline([{"name": "test_boundaries.op_slips"}])  # on no experiences: no slip
    with pytest.raises(ConfigError) as e:
        pipeline([Experience([1, 2, 3], 2, [-1.0], reward=1.0, task_id="t/0")])
    line = op_slips.__code__.co_firstlineno + 1
    assert str(e.value) == ("data_processor.experience_pipeline.operators[0] (test_boundaries.op_slips): object of "
                            f"type 'float' has no len() at {__file__}, line {line}; check the types of its args "
                            f"({{}}).")


# ---------------------------------------------------------------- Slurm's warning before the driver listens

SCONTROL_STUB = """#!/bin/bash
# stand-in: `scontrol show hostnames` names one node; `scontrol requeue J` is written down
case "$1" in
    show) echo node0 ;;
    requeue) echo "requeue $2" >> "$STUB_DIR/called" ;;
esac
"""
# stand-in for a Ray node's step: stopped by the script's EXIT trap
SRUN_STUB = "#!/bin/bash\nexec sleep 60 >/dev/null 2>&1\n"
# stand-in: no end time known (the watcher then takes its default window), at once
SQUEUE_STUB = "#!/bin/bash\nexit 0\n"
PYTHON_STUB = """#!/bin/bash
# stand-in for RFT_PYTHON: a token as the real one makes it; the Ray wait and the driver, faked
case "$1" in
    -c) exec "$REAL_PY" "$@" ;;
    -) cat > /dev/null; echo "fake: waiting for Ray"; sleep "$FAKE_RAY_WAIT_S" >/dev/null
       echo "ray_slurm: 1 Ray node(s) up" ;;
    run.py) shift
        # a wrapper that runs Python as its child (no exec), as a script loading modules first would
        [[ -n $FAKE_NO_EXEC ]] && { "$REAL_PY" "$STUB_DIR/driver.py" "$@"; exit $?; }
        exec "$REAL_PY" "$STUB_DIR/driver.py" "$@" ;;
esac
"""
# the driver: its imports take a while (SIGUSR2's default, to die, in force), then rft's watcher as run.py's
DRIVER_STUB = """import os, sys, time
print("fake: driver importing", flush=True)
time.sleep(float(os.environ["FAKE_IMPORT_S"]))
from rft.runtime import preemption
with preemption.watch():
    print("fake: driver watching", flush=True)
    end = time.monotonic() + 3
    while time.monotonic() < end:
        time.sleep(0.05)
print("fake: driver done", flush=True)
"""


def run_job_script(tmp_path, warn_after: str | None, ray_wait_s=0.0, import_s=0.0, no_exec=False):
    """launchers/ray_slurm.sbatch with stand-ins for Slurm, Ray and the driver; SIGUSR2 sent to the
    batch shell (as Slurm's --signal=B:USR2 does) when the line `warn_after` is printed. Its output,
    exit status, and the `scontrol requeue` calls."""
    import os
    import signal
    import subprocess
    import sys

    from conftest import ROOT

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", SCONTROL_STUB), ("srun", SRUN_STUB), ("squeue", SQUEUE_STUB),
                       ("python", PYTHON_STUB)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "driver.py").write_text(DRIVER_STUB)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "STUB_DIR": str(tmp_path),
           "REAL_PY": sys.executable, "RFT_PYTHON": str(bin_dir / "python"), "SLURM_JOB_ID": "42",
           "SLURM_JOB_NODELIST": "node0", "SLURM_SUBMIT_DIR": str(ROOT), "RFT_RAY_HEAD_IP": "127.0.0.1",
           "FAKE_RAY_WAIT_S": str(ray_wait_s), "FAKE_IMPORT_S": str(import_s),
           "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path), "FAKE_NO_EXEC": "1" if no_exec else ""}
    env.pop("SUBMITIT_EXECUTOR", None)
    p = subprocess.Popen(["bash", str(ROOT / "launchers" / "ray_slurm.sbatch"), "seed=1"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = []
    for line in p.stdout:
        out.append(line)
        if warn_after and line.startswith(warn_after):
            p.send_signal(signal.SIGUSR2)
    rc = p.wait(60)
    called = tmp_path / "called"
    return "".join(out), rc, called.read_text() if called.exists() else ""


@pytest.mark.parametrize("warn_after, ray_wait_s, import_s, says", [
    # while the nodes join Ray: the script requeues the job itself (it died of the signal, unrequeued)
    ("fake: waiting for Ray", 5, 0, "ray_slurm: Slurm warns that it will stop this job (SIGUSR2) before the driver "
                                    "started: requeueing job 42 (scontrol requeue): it runs again and resumes from "
                                    "its newest checkpoint\n"),
    # while the driver imports: held until its watcher listens (passed on at once, it killed the driver)
    ("fake: driver importing", 0, 2, "ray_slurm: Slurm warns that it will stop this job: passed on to the driver\n"),
    # while it runs: passed on, as before
    ("fake: driver watching", 0, 0, "ray_slurm: Slurm warns that it will stop this job: passed on to the driver\n"),
])
@pytest.mark.slow  # 8.6 s alone, over the fast tier's second
def test_slurms_warning_at_any_time_ends_in_a_requeue(tmp_path, warn_after, ray_wait_s, import_s, says):
    out, rc, called = run_job_script(tmp_path, warn_after, ray_wait_s, import_s)
    assert called == "requeue 42\n", out
    assert says in out
    assert "fake: driver done" not in out
    if warn_after != "fake: waiting for Ray":  # the driver's own requeue (rft.runtime.preemption.requeue_self)
        assert "rft: requeueing Slurm job 42 (scontrol requeue)" in out


def test_a_wrapper_as_rft_python_gets_the_warning_to_the_python_it_started(tmp_path):
    # RFT_PYTHON a script that runs Python as its child: the script never listens for SIGUSR2, so the
    # warning was held until the driver ended (the job then stopped at its limit, unrequeued); it goes
    # to the child that listens
    out, rc, called = run_job_script(tmp_path, "fake: driver watching", no_exec=True)
    assert "ray_slurm: Slurm warns that it will stop this job: passed on to the driver\n" in out
    assert called == "requeue 42\n", out
    assert "rft: requeueing Slurm job 42 (scontrol requeue)" in out and "fake: driver done" not in out


@pytest.mark.slow  # 3.2 s alone, over the fast tier's second
def test_without_a_warning_the_job_script_runs_the_driver_to_its_end(tmp_path):
    out, rc, called = run_job_script(tmp_path, None)
    assert rc == 0 and called == "" and "fake: driver done" in out
    assert "ray_slurm: run.py exited with status 0" in out


# ---------------------------------------------------------------- figures, written as the tables are


def test_write_atomic_takes_bytes_and_leaves_no_tmp(tmp_path):
    path = tmp_path / "f.png"
    manifest.write_atomic(path, b"\x89PNG\r\n")
    manifest.write_atomic(path, "text")
    assert path.read_bytes() == b"text" and sorted(p.name for p in tmp_path.iterdir()) == ["f.png"]


@pytest.mark.parametrize("which", ["report", "bench"])
def test_a_figure_that_fails_midway_leaves_the_earlier_one_and_no_tmp(tmp_path, monkeypatch, which):
    """savefig wrote into <name>.png.tmp then renamed (no fsync): a failure midway left the cut .tmp
    beside the figure. Rendered in memory and written by manifest.write_atomic, as the tables are."""
    from matplotlib.figure import Figure

    from rft.reporting import report
    from rft.runtime import bench
    from test_report import GRPO, write_job

    def cut(self, target, **kw):
        if not hasattr(target, "write"):
            target = open(target, "wb")
        target.write(b"\x89PNG cut")
        raise OSError(28, "No space left on device")

    if which == "report":
        write_job(tmp_path, 0, ["seed=1"], "grpo", {"grpo": GRPO})
        png = tmp_path / "rewards.png"
        make = lambda: report.report(tmp_path)  # noqa: E731
    else:
        png = tmp_path / "results.png"
        rows = [{"stage": "grpo", "step": 2, "eval/a/accuracy": 0.5, "eval/a/accuracy_se": 0.1, "checkpoint": "c"}]
        make = lambda: bench._write(tmp_path, rows)  # noqa: E731
    make()
    earlier = png.read_bytes()
    assert earlier.startswith(b"\x89PNG\r\n")
    monkeypatch.setattr(Figure, "savefig", cut)
    with pytest.raises(OSError, match="No space left on device"):
        make()
    assert png.read_bytes() == earlier and not png.with_name(png.name + ".tmp").exists()


# ---------------------------------------------------------------- a job's .hydra/config.yaml in a report

LAUGHS = "\n".join(["a: &a [x,x,x,x,x,x,x,x,x]"] + [f"{c}: &{c} [{','.join(['*' + p] * 9)}]"
                                                     for p, c in zip("abcdefgh", "bcdefghi")]) + "\n"


@pytest.mark.parametrize("text", [
    "x: &x 1\nstages:\n  - {stage_name: '${oc.env:NO_SUCH_VAR,grpo}', y: *x}\n",  # one alias: rft writes none
    # nine of nine (9^9 values, expanded by OmegaConf, which an interpolation sends it to: never ended)
    LAUGHS + "stages:\n  - {stage_name: '${oc.env:NO_SUCH_VAR,grpo}'}\n",
])
def test_a_job_config_rft_did_not_write_is_reported_without_its_plan(tmp_path, text):
    from rft.reporting import report

    (tmp_path / "0" / ".hydra").mkdir(parents=True)
    (tmp_path / "0" / ".hydra" / "config.yaml").write_text(text)
    assert report.planned_stages(tmp_path / "0") == []
    # the same without the alias: OmegaConf's way, the default of the interpolation
    (tmp_path / "0" / ".hydra" / "config.yaml").write_text("stages:\n  - {stage_name: '${oc.env:NO_SUCH_VAR,grpo}'}\n")
    assert report.planned_stages(tmp_path / "0") == [("grpo", None)]
