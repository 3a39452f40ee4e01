"""What running a name again does: a changed config stops the run (or is accepted on request), a
dry run writes nothing, a restart keeps the old run's whole record, and a finished stage is
reused by another run with the same stage, once, even by concurrent jobs."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, compose_cfg
from resume_support import forked_to_end
from safetensors.torch import load_file

import rft.runtime.main
from rft.errors import ConfigError
from rft.reporting.monitor import read_metrics
from rft.runtime.rundir import differences, identity

# a single stage that trains in a few seconds in this process
TINY = ["stages=[]", "cluster=inline", "monitor=console", "buffer.batch_size=4", "algorithm.repeat_times=2",
        "buffer.total_steps=2", "explorer.eval_interval=2", "trainer.save_interval=2", "explorer.eval_on_startup=false"]
# the default's two stages on a budget: 4 warm-up steps, then 2 GRPO steps
TWO_STAGES = ["cluster=inline", "monitor=console", "stages.0.buffer.total_steps=4",
              "stages.0.algorithm.optimizer.warmup_steps=0", "buffer.total_steps=2", "buffer.batch_size=4",
              "algorithm.repeat_times=2", "explorer.eval_interval=2", "explorer.eval_on_startup=false"]


def steps(path):
    return [m["step"] for m in read_metrics(path)]


def test_differences_allow_only_a_longer_run():
    old = identity({"seed": 1, "buffer": {"total_steps": 4}, "monitor": {"monitor_type": ["tensorboard"]},
                    "algorithm": {"optimizer": {"lr": 2e-4}}})
    grown = identity({"seed": 1, "buffer": {"total_steps": 6}, "monitor": {"monitor_type": []},
                      "algorithm": {"optimizer": {"lr": 2e-4}}})
    # where the run is watched (monitor) is not part of what it computes; a longer run is allowed
    assert differences(old, grown) == []
    shrunk = identity({"seed": 2, "buffer": {"total_steps": 3}, "algorithm": {"optimizer": {"lr": 1e-3}}})
    assert differences(old, shrunk) == ["algorithm.optimizer.lr: 0.0002 -> 0.001", "buffer.total_steps: 4 -> 3",
                                        "seed: 1 -> 2"]


def test_a_teacher_that_distillation_does_not_read_is_not_part_of_a_stage_identity():
    # a warm-up stage (distill_coef 0) inherits the RL stage's teacher: grpo and opd arms share it
    off = [identity({"algorithm": {"distill_coef": 0.0, "teacher_model_path": t}}) for t in (None, "a", "b")]
    assert off[0] == off[1] == off[2] == {"algorithm.distill_coef": 0.0}
    on = [identity({"algorithm": {"distill_coef": 1.0, "teacher_model_path": t}}) for t in ("a", "b")]
    assert differences(on[0], on[1]) == ["algorithm.teacher_model_path: 'a' -> 'b'"]


@pytest.mark.slow  # a real engine, Ray or training run
def test_a_changed_config_under_the_same_name_stops_and_lists_the_changes(tmp_path):
    args = [*TINY, f"checkpoint_root_dir={tmp_path}", "name=study", "stage_cache_dir=null"]
    rft.runtime.main.main(compose_cfg(args))
    run = tmp_path / "rft" / "study"
    assert (run / "config.yaml").read_text().startswith("# fingerprint: ")
    with pytest.raises(ConfigError) as e:
        rft.runtime.main._main(compose_cfg([*args, "algorithm.optimizer.lr=1e-3"]))
    assert str(e.value) == (
        f"the run directory {run} holds a run made with another configuration (stage grpo: "
        f"algorithm.optimizer.lr: 0.0002 -> 0.001). Running the same name resumes that run, so the change "
        f"would be skipped or mixed in silently. Either give this run another name (name=...), start this "
        f"one again (continue_from_checkpoint=false: the old outputs move to {run}/previous_<time>/), or "
        f"continue it with the new values from its newest checkpoint (resume_with_changes=true)."
    )
    assert steps(run / "metrics.jsonl") == [1, 2]  # nothing ran
    # a longer run is no change: it goes on from step 2
    rft.runtime.main.main(compose_cfg([*args, "buffer.total_steps=4"]))
    assert steps(run / "metrics.jsonl") == [1, 2, 3, 4]
    assert "  total_steps: 4\n" in (run / "config.yaml").read_text()  # the record says how far it went
    # asked for, a change is accepted, and recorded with the stage
    rft.runtime.main.main(compose_cfg([*args, "buffer.total_steps=5", "algorithm.optimizer.lr=1e-3", "resume_with_changes=true"]))
    assert steps(run / "metrics.jsonl") == [1, 2, 3, 4, 5]
    log = (run / "config_changes.log").read_text()
    assert "resume_with_changes=true: algorithm.optimizer.lr: 0.0002 -> 0.001" in log
    assert "lr: 0.001" in (run / "config.yaml").read_text()
    assert read_metrics(run / "metrics.jsonl")[-1]["actor/lr"] == pytest.approx(1e-3)


@pytest.mark.slow  # a real engine, Ray or training run
def test_a_damaged_or_missing_config_record_stops_a_resume_instead_of_skipping_the_check(tmp_path):
    args = [*TINY, f"checkpoint_root_dir={tmp_path}", "name=study", "stage_cache_dir=null"]
    rft.runtime.main.main(compose_cfg(args))
    run = tmp_path / "rft" / "study"
    record = run / "config.yaml"
    text = record.read_text()
    lines = text.splitlines(keepends=True)
    for damaged, problem in [
        ("garbage: [", "does not parse as a config"),
        ("".join(lines[: len(lines) // 2]), "is not the one saved (its first line's fingerprint does not match"),
        (None, "is missing"),
    ]:
        if damaged is None:
            record.unlink()
        else:
            record.write_text(damaged)
        # a changed lr would otherwise be taken on silently from the checkpoint
        with pytest.raises(ConfigError) as e:
            rft.runtime.main._main(compose_cfg([*args, "buffer.total_steps=4", "algorithm.optimizer.lr=5e-2"]))
        assert str(e.value).startswith(f"{record}, the record of the configuration stage grpo ran with, {problem}"), str(e.value)
        assert "resume_with_changes=true" in str(e.value)
        assert steps(run / "metrics.jsonl") == [1, 2]  # nothing ran
    # asked for, the run goes on with its own configuration, which it records
    rft.runtime.main.main(compose_cfg([*args, "buffer.total_steps=4", "resume_with_changes=true"]))
    assert steps(run / "metrics.jsonl") == [1, 2, 3, 4]
    assert "resume_with_changes=true: config.yaml is missing: written anew" in (run / "config_changes.log").read_text()
    assert record.read_text().startswith("# fingerprint: ")


def snapshot(d):
    return {str(p.relative_to(d)): (p.stat().st_mtime_ns, p.stat().st_size) for p in d.rglob("*")}


@pytest.mark.slow
def test_a_dry_run_writes_nothing_and_a_restart_keeps_the_old_record(tmp_path):
    env = {**os.environ, "RFT_CHECKPOINT_ROOT_DIR": str(tmp_path)}
    run = tmp_path / "rft" / "rec"

    def cli(*args):
        """`python run.py <args>`, forked from a process that imported torch (resume_support.Forked:
        the same command, argv and files without a fresh interpreter's imports, ~4 s a run)"""
        return forked_to_end(list(args), env, tmp_path / f"run{len(list(tmp_path.glob('run*.out')))}")

    r = cli(*TINY, "name=rec", "seed=3")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "seed=3" in (run / ".hydra" / "overrides.yaml").read_text()
    assert (run / ".hydra" / "config.yaml").exists() and (run / "run.log").exists()
    before = snapshot(run)

    r = cli(*TINY, "name=rec", "seed=3", "dry_run=true")
    assert r.returncode == 0, r.stderr
    assert "batch plan" in r.stdout and f"outputs        {run}" in r.stdout
    assert snapshot(run) == before  # not one file added, changed or touched
    r = cli(*TINY, "name=never_run", "dry_run=true")
    assert r.returncode == 0 and not (tmp_path / "rft" / "never_run").exists()

    r = cli(*TINY, "name=rec", "seed=4", "continue_from_checkpoint=false")
    assert r.returncode == 0, r.stderr[-3000:]
    (old,) = run.glob("previous_*")
    assert "moved the earlier outputs to" in r.stdout
    # the old run whole: its record, log, metrics and checkpoints; the new one beside it
    assert "seed=3" in (old / ".hydra" / "overrides.yaml").read_text()
    assert (old / "run.log").exists() and (old / "checkpoints" / "step_2" / "hf").is_dir()
    assert steps(old / "metrics.jsonl") == [1, 2]
    assert "seed=4" in (run / ".hydra" / "overrides.yaml").read_text()
    assert steps(run / "metrics.jsonl") == [1, 2]
    assert (run / "run.log").exists() and "seed: 4" in (run / "config.yaml").read_text()


@pytest.mark.slow  # a real engine, Ray or training run
def test_a_finished_stage_is_reused_by_another_run_with_the_same_stage(tmp_path, capsys):
    common = [*TWO_STAGES, f"checkpoint_root_dir={tmp_path}"]
    rft.runtime.main.main(compose_cfg([*common, "name=first"]))
    rft.runtime.main.main(compose_cfg([*common, "name=second", "algorithm.optimizer.lr=1e-3"]))
    out = capsys.readouterr().out
    first, second = tmp_path / "rft" / "first", tmp_path / "rft" / "second"
    # the warm-up (its own lr) is the same stage: copied; the RL stage (another lr) trained
    assert out.count("[sft_warmup] reused: the same stage") == 1
    assert f"finished in {first / 'sft_warmup'}" in out
    assert (second / "sft_warmup" / "reused_from").exists() and not (second / "grpo" / "reused_from").exists()
    a = load_file(first / "sft_warmup" / "checkpoints" / "step_4" / "hf" / "model.safetensors")
    b = load_file(second / "sft_warmup" / "checkpoints" / "step_4" / "hf" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert steps(second / "sft_warmup" / "metrics.jsonl") == steps(first / "sft_warmup" / "metrics.jsonl")
    assert steps(second / "grpo" / "metrics.jsonl") == [1, 2]
    assert read_metrics(second / "grpo" / "metrics.jsonl")[-1]["actor/lr"] == pytest.approx(1e-3)
    # another seed is another warm-up: trained, not reused; with the cache off, nothing is reused
    rft.runtime.main.main(compose_cfg([*common, "name=third", "seed=7"]))
    rft.runtime.main.main(compose_cfg([*common, "name=fourth", "stage_cache_dir=null"]))
    out = capsys.readouterr().out
    assert "reused" not in out
    assert not (tmp_path / "rft" / "third" / "sft_warmup" / "reused_from").exists()


def zero_weights(entry):
    weights = entry / "checkpoint" / "hf" / "model.safetensors"
    # a copy of the file, not the hard link the first run's checkpoint shares, zeroed at its end
    data = bytearray(weights.read_bytes())
    data[-4096:-2048] = bytes(2048)
    weights.unlink()
    weights.write_bytes(data)
    return f"{weights}: its contents are not the ones saved (their digest differs)"


def cut_tokenizer(entry):
    """Before manifests this entry was reused, and its cut tokenizer copied into the next run."""
    tokenizer = entry / "checkpoint" / "hf" / "tokenizer.json"
    data = tokenizer.read_bytes()
    tokenizer.unlink()
    tokenizer.write_bytes(data[: len(data) // 2])
    return f"{tokenizer}: {len(data) // 2} bytes, {len(data)} when saved (cut short or written over)"


@pytest.mark.slow
def test_a_damaged_stage_cache_entry_is_set_aside_and_the_stage_runs(tmp_path, capsys):
    common = [*TWO_STAGES, f"checkpoint_root_dir={tmp_path}"]
    rft.runtime.main.main(compose_cfg([*common, "name=first"]))
    first = tmp_path / "rft" / "first" / "sft_warmup" / "checkpoints" / "step_4" / "hf" / "model.safetensors"
    for i, damage in enumerate([zero_weights, cut_tokenizer]):
        (entry,) = [p for p in (tmp_path / "rft" / "stage_cache").iterdir() if p.is_dir() and "." not in p.name]
        why = damage(entry)
        capsys.readouterr()
        rft.runtime.main.main(compose_cfg([*common, f"name=second{i}", "algorithm.optimizer.lr=1e-3"]))
        out = capsys.readouterr().out
        assert f"[sft_warmup] the stage cache's copy of this stage is damaged ({why}); moved it to {entry}.damaged-" in out
        assert "reused" not in out
        second = tmp_path / "rft" / f"second{i}" / "sft_warmup"
        assert not (second / "reused_from").exists()
        # trained again: the first run's warm-up, bit for bit; and published anew beside the damaged copy
        a, b = load_file(first), load_file(second / "checkpoints" / "step_4" / "hf" / "model.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert (second / "checkpoints" / "step_4" / "hf" / "tokenizer.json").read_bytes() == \
            (first.parent / "tokenizer.json").read_bytes()
        assert entry.is_dir() and len(list(entry.parent.glob(f"{entry.name}.damaged-*"))) == i + 1


@pytest.mark.slow
def test_concurrent_jobs_with_the_same_stage_train_it_once(tmp_path):
    env = {**os.environ, "RFT_CHECKPOINT_ROOT_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, str(ROOT / "run.py"), *TWO_STAGES, f"name=job{i}",
                               f"algorithm.optimizer.lr={lr}", "stages.0.buffer.total_steps=40"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i, lr in enumerate(["1e-4", "3e-4"])]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    # one trained the warm-up while the other waited for it, then copied it
    waited = [o for o in outs if "waiting for another job that trains the same stage" in o]
    assert len(waited) == 1 and "[sft_warmup] reused" in waited[0]
    trained = [o for o in outs if o not in waited][0]
    assert "reused" not in trained
    a, b = (load_file(tmp_path / "rft" / f"job{i}" / "sft_warmup" / "checkpoints" / "step_40" / "hf" /
                      "model.safetensors") for i in (0, 1))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_longer_warm_up_under_a_later_stage_that_already_trained_is_a_change(tmp_path):
    """A later stage starts from the warm-up's final model: a warm-up grown from 4 to 6 steps under
    an RL stage that trained from its 4-step model made the run print "[grpo] already finished" and
    exit 0, its RL result from a warm-up the config no longer says."""
    from rft.plan.batch import stage_configs
    from rft.runtime.rundir import check_unchanged, write_config

    def stage_dirs(overrides):
        stages = stage_configs(compose_cfg([f"checkpoint_root_dir={tmp_path}", "name=study", *overrides]))
        return stages, [tmp_path / s.stage_name for s in stages]

    stages, dirs = stage_dirs(["stages.0.buffer.total_steps=4"])
    for s, d in zip(stages, dirs):
        write_config(s, d)
        (d / "metrics.jsonl").write_text('{"step": 1}\n')
    grown, _ = stage_dirs(["stages.0.buffer.total_steps=6"])
    with pytest.raises(ConfigError) as e:
        check_unchanged(grown[0], grown, dirs, tmp_path)
    assert ("(stage sft_warmup: buffer.total_steps: 4 -> 6, but stage grpo already trained from its 4-step "
            "model)") in str(e.value)
    # the last stage growing is a longer run, as before; and a warm-up no later stage has started yet
    assert check_unchanged(grown[0], *stage_dirs(["stages.0.buffer.total_steps=4", "buffer.total_steps=90"]),
                           tmp_path) == {}
    (dirs[1] / "metrics.jsonl").unlink()
    assert check_unchanged(grown[0], grown, dirs, tmp_path) == {}


@pytest.mark.slow  # 1.4 s alone, over the fast tier's second
def test_regenerated_data_under_a_started_stage_is_a_change(tmp_path):
    """A study's generator run again (a bug fixed, another seed) wrote other rows under the same
    path; the same command said "[grpo] already finished" and kept the results of the old rows, or
    resumed a stage half trained on them and mixed the new ones in, with exit 0."""
    import json as json_

    from rft.plan.batch import stage_configs
    from rft.runtime.rundir import check_unchanged, write_config

    data = tmp_path / "data"
    data.mkdir()

    def write(rows):
        for split in ("train", "test"):
            (data / f"{split}.jsonl").write_text("".join(json_.dumps(r) + "\n" for r in rows))

    write([{"question": "1+1", "answer": "2"}] * 4)
    overrides = [f"checkpoint_root_dir={tmp_path}", "name=study", "stages=[]", "buffer.explorer_input.generator=null",
                 f"buffer.explorer_input.taskset.path={data}", f"buffer.explorer_input.eval_tasksets.0.path={data}"]
    [stage] = stage_configs(compose_cfg(overrides))
    d = tmp_path / "grpo"
    write_config(stage, d)
    (d / "metrics.jsonl").write_text('{"step": 1}\n')
    assert check_unchanged(stage, [stage], [d], tmp_path) == {}
    (data / "train.jsonl").touch()  # the same bytes, a new time (a checkout, a copy): no change
    assert check_unchanged(stage, [stage], [d], tmp_path) == {}
    write([{"question": "1+2", "answer": "3"}] * 4)
    with pytest.raises(ConfigError) as e:
        check_unchanged(stage, [stage], [d], tmp_path)
    assert (f"holds a run made with another configuration (stage grpo: {data}: test.jsonl, train.jsonl changed "
            f"since the stage started). Running the same name resumes that run") in str(e.value)
    # asked for, the change is accepted, and the record then holds the new rows
    accepted = stage_configs(compose_cfg([*overrides, "resume_with_changes=true"]))
    assert check_unchanged(accepted[0], accepted, [d], tmp_path)["grpo"] == [
        f"{data}: test.jsonl, train.jsonl changed since the stage started"]
    (data / "test.jsonl").unlink()
    (data / "valid.jsonl").write_text('{"question": "2+2", "answer": "4"}\n')
    assert check_unchanged(accepted[0], accepted, [d], tmp_path)["grpo"] == [
        f"{data}: train.jsonl changed since the stage started", f"{data}: valid.jsonl is new since the stage started",
        f"{data}: test.jsonl is gone since the stage started"]


def test_a_damaged_dataset_record_is_a_difference_not_taken_for_none(tmp_path):
    """data.json cut short read as no record (a stage from before records): a dataset changed since
    then would have been resumed from unnoticed."""
    from rft.runtime.rundir import data_differences

    cfg = compose_cfg(["stages=[]"])
    assert data_differences(tmp_path, cfg) == []  # no record: a stage recorded before there was one
    (tmp_path / "data.json").write_text('{"/data/arithmetic": {"train.jsonl": "67b6')
    assert data_differences(tmp_path, cfg) == [
        f"{tmp_path / 'data.json'} (the digests of the datasets the stage started with) does not parse (cut short "
        f"or overwritten), so whether they changed cannot be told"]
    (tmp_path / "data.json").write_text("[1, 2]")  # JSON, but not a record
    assert len(data_differences(tmp_path, cfg)) == 1
