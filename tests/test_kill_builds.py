"""SIGKILL while rft builds what it builds once and keeps (the tiny model, generated task data, the
task pipeline's output), at a stage handover, and with two jobs building one cache at once. After
each kill the same command again must reuse a whole build, build it again, or stop naming the file
and the fix: never read a half-written one, never call a whole one damaged. (Kills in a stage's
steady state, a copy from or a publish to the stage cache: test_e2e.py, test_runtime.py,
test_faults.py.)"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT
from omegaconf import OmegaConf

from rft import manifest

# the child kills its own process group (as a scheduler's kill or a closed terminal does) the moment
# it is about to rename the manifest it has written into a build's folder <name>.tmp/: the folder's
# files are all written, its manifest too, under a name that is not yet the manifest's
KILL_AT_SEAL_OF_A_BUILD = """
import os
real = os.replace
def replace(src, dst, *a, **k):
    if str(src).endswith(".tmp/manifest.json.tmp") or str(src).endswith(".tmp" + os.sep + "manifest.json.tmp"):
        os.killpg(os.getpgid(0), 9)
    return real(src, dst, *a, **k)
os.replace = replace
"""


def hooked(tmp_path, code: str) -> dict:
    """The environment of a subprocess that runs `code` first (a sitecustomize on PYTHONPATH)."""
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(code)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT)])}


def files(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_generated_data_killed_as_its_manifest_is_renamed_is_built_whole_by_the_next_run(tmp_path, capsys):
    """The kill left arithmetic-v4.tmp/ holding manifest.json.tmp. The next build wrote into that
    folder as it found it and sealed it with the leftover listed among the data's files, then renamed
    its own manifest.json.tmp away: the data it installed was 'damaged (manifest.json.tmp: missing)',
    moved aside and generated again by the run after, whose new manifest.json then read as the
    dataset changed under a started stage (its data.json digests every file), stopping a resume."""
    from rft.data.tasks import generate_arithmetic

    path = tmp_path / "cache" / "arithmetic-v4"
    code = f"from rft.data.tasks import generate_arithmetic; generate_arithmetic({str(path)!r})"
    r = subprocess.run([sys.executable, "-c", code], env=hooked(tmp_path, KILL_AT_SEAL_OF_A_BUILD), cwd=ROOT,
                       start_new_session=True, capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert not path.exists() and (path.parent / "arithmetic-v4.tmp" / "manifest.json.tmp").is_file()
    generate_arithmetic(path)  # the same command again
    assert manifest.verify(path) is None
    uninterrupted = generate_arithmetic(tmp_path / "fresh" / "arithmetic-v4")
    assert files(path) == files(uninterrupted)  # the manifest too: the same files, nothing else listed
    generate_arithmetic(path)  # and the run after that finds it whole
    assert sorted(p.name for p in path.parent.iterdir()) == ["arithmetic-v4", "arithmetic-v4.lock"]
    assert capsys.readouterr().err == ""


# what a build killed midway leaves in its <name>.tmp/: a file cut short and the manifest not yet renamed
LEFTOVER = {"manifest.json.tmp": '{"format": 1, "hash": "xxh3_128",\n "identity": {"built": ', "stray.bin": "x" * 7}
NARROW = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1,
              num_key_value_heads=1, head_dim=32)


def leave(tmp: Path, cut: str) -> None:
    tmp.mkdir(parents=True)
    for name, text in {**LEFTOVER, cut: "{"}.items():
        (tmp / name).write_text(text)


@pytest.mark.slow  # ~4 s alone, importing torch and transformers (~0.1 s in a session that has)
def test_a_tiny_model_build_killed_midway_leaves_nothing_the_next_build_keeps(tmp_path, capsys):
    from rft.models import build_tiny_model

    path = tmp_path / "tiny"
    leave(tmp_path / "tiny.tmp", cut="model.safetensors")
    build_tiny_model(path, arch=NARROW)
    assert manifest.verify(path) is None
    assert files(path) == files(build_tiny_model(tmp_path / "fresh" / "tiny", arch=NARROW))
    assert capsys.readouterr().err == ""


@pytest.mark.slow  # ~1.5 s, most of it importing `datasets` (which reads the rows)
def test_a_task_pipeline_killed_midway_leaves_nothing_the_next_run_keeps(tmp_path, capsys):
    from rft.config import Config
    from rft.data.pipeline import output_dir, run_task_pipeline

    def config(cache):
        cfg = OmegaConf.structured(Config)
        cfg.cache_dir = str(tmp_path / cache)
        cfg.buffer.explorer_input.taskset.path = str(tmp_path / "tasks.jsonl")
        return OmegaConf.merge(cfg, {"data_processor": {"task_pipeline": {"operators": [
            {"name": "document_deduplicator"}]}}})

    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps({"question": q, "answer": "1"}) + "\n"
                                                  for q in ["1+1", "2+2", "1+1"]))
    cfg, fresh = config("cache"), config("fresh")
    d = output_dir(cfg)
    leave(d.with_name(d.name + ".tmp"), cut="train.jsonl")
    assert run_task_pipeline(cfg, say=lambda s: None)["rows"] == 3
    assert manifest.verify(d) is None
    run_task_pipeline(fresh, say=lambda s: None)
    ours, theirs = files(d), files(output_dir(fresh))
    report = json.loads(ours.pop("report.json"))
    assert report["operators"][0]["rows_out"] == 2  # 1+1 twice: deduplicated to 1+1, 2+2
    assert report["output"] == str(d / "train.jsonl")
    theirs.pop("report.json")  # names its own cache dir and times its operators; the manifest digests it
    assert ours.keys() == theirs.keys() == {"manifest.json", "train.jsonl"}
    assert ours["train.jsonl"] == theirs["train.jsonl"]
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------- a stage copied from the stage cache

class Killed(BaseException):
    """Stands for SIGKILL in this process: no `except Exception` catches it, and what the kill
    would leave on disk is what the raise leaves (nothing on the way cleans up after a copy)."""


def test_a_copy_killed_once_its_checkpoint_is_in_place_is_still_told_reused(tmp_path, monkeypatch):
    """The report tells a stage copied from the stage cache by its `reused_from` (its time_s and
    rollouts are another job's); it was written after the copied checkpoint was moved into place, so
    a kill between the two left a stage that the next run found 'already finished' and the report
    then counted the warm-up's time and rollouts of the job that trained it as this job's."""
    from rft.reporting.report import read_job
    from rft.runtime import checkpoint, rundir
    from rft.runtime.checkpoint import Owner

    owner = Owner(run="rft/first", stage="sft_warmup", config="c0ffee00c0ffee00", model="/models/tiny")

    def save_files(tmp):
        (tmp / "hf").mkdir()
        (tmp / "hf" / "model.safetensors").write_bytes(b"\0" * 64)
        return {}

    first = tmp_path / "first" / "sft_warmup"
    checkpoint.write(first, 2, {"version": 2}, save_files, owner=owner)
    # 2 steps of 3 s (the job that trained it took 6 s)
    (first / "metrics.jsonl").write_text('{"step": 1, "timing/step_s": 3.0}\n{"step": 2, "timing/step_s": 3.0}\n')
    entry = tmp_path / "cache" / "key"
    entry.parent.mkdir()
    rundir.publish(entry, first, first / "checkpoints" / "step_2", print)

    real = rundir._copy_entry

    def copy_then_killed(*a, **k):
        real(*a, **k)
        raise Killed

    monkeypatch.setattr(rundir, "_copy_entry", copy_then_killed)
    second = tmp_path / "second" / "sft_warmup"
    with pytest.raises(Killed):
        rundir.reuse(entry, second, Owner(**{**vars(owner), "run": "rft/second"}), "sft_warmup", print)
    assert (second / "checkpoints" / "step_2").is_dir()  # the next run finds the stage finished ...
    assert (second / "reused_from").read_text() == f"{entry}\n{first}\n"  # ... and copied
    job = read_job(tmp_path / "second", stage="sft_warmup")
    assert job.time_s is None and [m["step"] for m in job.metrics] == [1, 2]
    assert read_job(tmp_path / "first", stage="sft_warmup").time_s == 6.0  # 3 + 3: its own


# the default's two stages, short: a 4-step SFT warm-up (published to the stage cache), 1 GRPO step
TWO_STAGES = ["cluster=inline", "monitor=console", "stages.0.buffer.total_steps=4",
              "stages.0.algorithm.optimizer.warmup_steps=0", "buffer.total_steps=1", "buffer.batch_size=4",
              "algorithm.repeat_times=2", "explorer.eval_on_startup=false"]


@pytest.mark.slow  # two runs of the two stages, in this process (~10 s)
def test_a_copy_killed_before_its_checkpoint_then_trained_is_the_stages_own(tmp_path, monkeypatch, capsys):
    """A copy from the stage cache killed before its checkpoint was in place, then run again
    without that entry (stage_cache_dir=null, or the entry removed): the stage trains itself, and
    what the copy wrote must not call it copied (the report would give it no time of its own)."""
    import rft.runtime.main
    from conftest import compose_cfg
    from rft.reporting.monitor import read_metrics
    from rft.reporting.report import read_job

    common = [*TWO_STAGES, f"checkpoint_root_dir={tmp_path}", f"stage_cache_dir={tmp_path / 'cache'}"]
    rft.runtime.main.main(compose_cfg([*common, "name=first"]))
    first, second = tmp_path / "rft" / "first" / "sft_warmup", tmp_path / "rft" / "second" / "sft_warmup"
    real = manifest.seal

    def seal(d, *a, **k):  # the copy's checkpoint, sealed in step_4.tmp before it is moved into place
        if str(second) in str(d):
            raise Killed
        return real(d, *a, **k)

    monkeypatch.setattr(manifest, "seal", seal)
    with pytest.raises(Killed):
        rft.runtime.main.main(compose_cfg([*common, "name=second"]))
    monkeypatch.setattr(manifest, "seal", real)
    assert (second / "reused_from").exists() and not (second / "checkpoints" / "step_4").exists()
    capsys.readouterr()
    rft.runtime.main.main(compose_cfg([*common, "name=second", "stage_cache_dir=null"]))
    assert "reused" not in capsys.readouterr().out
    assert not (second / "reused_from").exists()
    job = read_job(tmp_path / "rft" / "second", stage="sft_warmup")
    assert job.time_s is not None and job.time_s > 0
    def timeless(rows):  # what a run of the same seed repeats exactly: all but times and rates
        return [{k: v for k, v in m.items() if not k.startswith(("timing/", "perf/")) and "per_s" not in k}
                for m in rows]

    assert timeless(job.metrics) == timeless(read_metrics(first / "metrics.jsonl"))  # trained as the first did


# ---------------------------------------------------------------- a run's record, rewritten at every run of its name

def test_a_rerun_killed_while_it_rewrites_the_runs_record_leaves_the_record_whole(tmp_path, monkeypatch):
    """Every run of a name writes <run>/.hydra/ again (a sweep resumed with hydra.sweep.dir runs its
    finished jobs again). Written in place, a kill midway left config.yaml cut, which the report
    still parsed: a plan of the stages before the cut (the warm-up read as the job's last stage, its
    metrics as the job's result); an overrides.yaml cut at a line end groups the job with another
    configuration. Each file is the old one or the new one, never a part."""
    import builtins
    import io

    from conftest import compose_cfg
    from rft.reporting.report import planned_stages
    from rft.runtime import rundir

    cfg = compose_cfg([f"checkpoint_root_dir={tmp_path}", "seed=3"])
    run = tmp_path / "run"
    rundir.write_record(cfg, run)
    record = {p.name: p.read_text() for p in (run / ".hydra").iterdir()}
    assert set(record) == {"config.yaml", "hydra.yaml", "overrides.yaml"}
    assert planned_stages(run) == [("sft_warmup", 400), ("grpo", 60)]  # the default's two stages
    real_open = builtins.open

    class HalfThenKilled:  # a file whose first write stops halfway, killed
        def __init__(self, f):
            self.f = f

        def write(self, text):
            self.f.write(text[:len(text) // 2])
            self.f.flush()
            raise Killed

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    for name in sorted(record):  # killed in the write of each file in turn
        def killing_open(file, mode="r", *a, name=name, **k):
            # write_atomic opens its tmp by descriptor (made with O_EXCL, never through a link): its name from /proc
            path = Path(os.readlink(f"/proc/self/fd/{file}")) if isinstance(file, int) else Path(file)
            f = real_open(file, mode, *a, **k)
            return HalfThenKilled(f) if "w" in mode and path.name.startswith(name) else f

        monkeypatch.setattr(builtins, "open", killing_open)
        monkeypatch.setattr(io, "open", killing_open)  # OmegaConf.save's
        with pytest.raises(Killed):
            rundir.write_record(compose_cfg([f"checkpoint_root_dir={tmp_path}", "seed=3"]), run)
        monkeypatch.setattr(builtins, "open", real_open)
        monkeypatch.setattr(io, "open", real_open)
        assert {n: (run / ".hydra" / n).read_text() for n in record} == record, name
    assert planned_stages(run) == [("sft_warmup", 400), ("grpo", 60)]


# ---------------------------------------------------------------- the sweep report

@pytest.mark.parametrize("where", ["csv", "png"])
def test_a_report_killed_while_it_writes_leaves_each_file_whole(tmp_path, monkeypatch, where):
    """python -m rft.reporting.report over a sweep again, once more jobs ended, killed midway: a
    report.csv cut after some rows (or empty: the open truncated it) read as a table of fewer jobs,
    and a cut rewards.png as no picture. Each file is the earlier report's or the new one, whole."""
    import csv as csv_module

    import matplotlib.figure

    from rft.reporting import report

    def job(num, seed, rewards):
        d = tmp_path / "sweep" / str(num)
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text(f"- seed={seed}\n")
        (d / ".hydra" / "config.yaml").write_text("buffer: {total_steps: 2}\n")
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "reward/mean": r}) + "\n"
                                                 for i, r in enumerate(rewards)))

    job(0, 1, [0.25, 0.5])
    out = report.report(tmp_path / "sweep")
    before = {k: p.read_bytes() for k, p in out.items()}
    assert set(before) == {"md", "csv", "png"}
    job(1, 2, [0.5, 0.75])

    def killed_midway(real):
        def write(self, *a, **k):
            if where == "png":  # half of the picture reaches the file (or the buffer it is drawn into)
                path = a[0]
                real(self, *a, **k)
                if hasattr(path, "truncate"):
                    path.truncate(100)
                else:
                    Path(path).write_bytes(Path(path).read_bytes()[:100])
            else:
                real(self, *a[:1] and [list(a[0])[:1]], **k)  # the first row of two
            raise Killed
        return write

    if where == "png":
        monkeypatch.setattr(matplotlib.figure.Figure, "savefig", killed_midway(matplotlib.figure.Figure.savefig))
    else:
        monkeypatch.setattr(csv_module.DictWriter, "writerows", killed_midway(csv_module.DictWriter.writerows))
    with pytest.raises(Killed):
        report.report(tmp_path / "sweep")
    after = {k: p.read_bytes() for k, p in out.items()}
    assert after["png"] == before["png"]  # drawn last: the earlier one, whole
    # job 1's final reward 0.75: in the new report, whole (report.md is written first, then report.csv)
    assert after["csv"] == before["csv"] if where == "csv" else after["csv"].count(b"\r\n") == 4
    assert b"| 1 | 2 |  | incomplete (no final checkpoint) | 2 | 0.750 |  |" in after["md"]
    assert b"\r\n1,2,,incomplete (no final checkpoint),2,0.75,,,,,,\r\n" in after["csv"] or where == "csv"


def test_a_bench_killed_while_it_writes_its_table_leaves_the_earlier_one_whole(tmp_path, monkeypatch):
    """mode=bench again after more checkpoints were saved, killed while writing results.csv: the
    table was cut (or emptied), read as fewer checkpoints evaluated."""
    import csv as csv_module

    from rft.runtime import bench

    monkeypatch.setattr(bench, "_plot", lambda *a: False)  # the picture: as the report's (test above)
    rows = [{"stage": "start", "step": 0, "checkpoint": "tiny", "eval/accuracy": 0.25},
            {"stage": "grpo", "step": 2, "checkpoint": "step_2", "eval/accuracy": 0.5}]
    bench._write(tmp_path, rows[:1])
    before = {n: (tmp_path / n).read_bytes() for n in ("results.csv", "results.md")}

    def killed_before_the_rows(self, rs):  # the header is written
        raise Killed

    monkeypatch.setattr(csv_module.DictWriter, "writerows", killed_before_the_rows)
    with pytest.raises(Killed):
        bench._write(tmp_path, rows)
    assert {n: (tmp_path / n).read_bytes() for n in ("results.csv", "results.md")} == before
