"""A checkpoint proves what it is: its manifest (written last) holds every file's size and digest
and its identity (run, stage, step, config, model). Each way a checkpoint can be damaged is named
with its file; one of another stage, model or configuration is refused in one paragraph; a save
that cannot be written stops with one paragraph and leaves nothing half-written; stage-cache
entries and exports are sealed the same way. (End-to-end, on real runs: test_damage.py.)"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import xxhash
from conftest import ROOT, run_cli

from rft import manifest
from rft.errors import ConfigError, RunError
from rft.runtime import checkpoint, rundir
from rft.runtime.checkpoint import Owner, damage, read_checkpoint, served_checkpoint, usable_checkpoint

OWNER = Owner(run="rft/study", stage="grpo", config="c0ffee00c0ffee00", model="/models/tiny")
WEIGHTS = bytes(range(256)) * 64  # 16384 bytes


def save_files(tmp):
    """What a trainer's save writes: a model folder and the optimizer's state."""
    (tmp / "hf").mkdir()
    (tmp / "hf" / "model.safetensors").write_bytes(WEIGHTS)
    (tmp / "hf" / "config.json").write_text('{"hidden_size": 8}')
    (tmp / "trainer_state.pt").write_bytes(b"\1" * 4096)
    return {"fingerprint": "1/2/3"}


@pytest.fixture
def stage(tmp_path):
    """A stage with checkpoints step_1 and step_2."""
    d = tmp_path / "grpo"
    for step in (1, 2):
        checkpoint.write(d, step, {"version": step}, save_files, owner=OWNER)
    return d


def said():
    lines = []
    return lines, lines.append


def test_a_checkpoint_is_written_with_its_manifest_last(stage):
    d = stage / "checkpoints" / "step_2"
    assert sorted(p.name for p in (stage / "checkpoints").iterdir()) == ["step_1", "step_2"]  # no .tmp
    sealed = json.loads((d / "manifest.json").read_text())
    assert sealed["format"] == 1 and sealed["hash"] == "xxh3_128"
    assert sealed["identity"] == {"run": "rft/study", "stage": "grpo", "step": 2, "config": "c0ffee00c0ffee00",
                                  "model": "/models/tiny"}
    state = (d / "state.json").read_bytes()
    assert sealed["files"] == {
        "hf/config.json": [18, xxhash.xxh3_128(b'{"hidden_size": 8}').hexdigest()],
        "hf/model.safetensors": [16384, xxhash.xxh3_128(WEIGHTS).hexdigest()],
        "state.json": [len(state), xxhash.xxh3_128(state).hexdigest()],
        "trainer_state.pt": [4096, xxhash.xxh3_128(b"\1" * 4096).hexdigest()],
    }
    assert json.loads(state) == {"step": 2, "version": 2, "fingerprint": "1/2/3", "manifest": 1}
    assert damage(read_checkpoint(d)) is None


def zero_block(d):
    data = bytearray((d / "hf" / "model.safetensors").read_bytes())
    data[4096:4608] = bytes(512)
    (d / "hf" / "model.safetensors").write_bytes(data)


def edit_manifest(change):
    def damage_it(d):
        sealed = json.loads((d / "manifest.json").read_text())
        change(sealed)
        (d / "manifest.json").write_text(json.dumps(sealed))
    return damage_it


def link_config_outside(d):
    shutil.copy2(d / "hf" / "config.json", d.parents[2] / "config.json")
    (d / "hf" / "config.json").unlink()
    os.symlink(d.parents[2] / "config.json", d / "hf" / "config.json")


NOT_INSIDE = "which is not a path inside its directory (not followed)"
DAMAGES = {  # what is done to step_2 -> what damage() says, after "<step_2>/"
    "zeroed_block": (zero_block, "hf/model.safetensors: its contents are not the ones saved (their digest differs)"),
    "cut_in_half": (lambda d: (d / "hf" / "model.safetensors").write_bytes(WEIGHTS[:8192]),
                    "hf/model.safetensors: 8192 bytes, 16384 when saved (cut short or written over)"),
    "missing": (lambda d: (d / "hf" / "config.json").unlink(), "hf/config.json: missing"),
    "added": (lambda d: (d / "hf" / "extra.bin").write_bytes(b"x"),
              "hf/extra.bin: not in manifest.json (added after the save)"),
    "another_steps_file": (lambda d: shutil.copy2(d.parent / "step_1" / "state.json", d / "state.json"),
                           "state.json: its contents are not the ones saved (their digest differs)"),
    "linked_file": (link_config_outside,
                    "hf/config.json: a link or other special file, where the save wrote a regular file or nothing"),
    "linked_folder": (lambda d: os.symlink(d.parents[2], d / "hf" / "more"),
                      "hf/more: a link or other special file, where the save wrote a regular file or nothing"),
    "manifest_cut": (lambda d: (d / "manifest.json").write_text('{"format": 1, "files": {"hf/'),
                     "manifest.json: does not parse (cut short or overwritten)"),
    "manifest_missing": (lambda d: (d / "manifest.json").unlink(), "manifest.json: missing"),
    "manifest_nested_deep": (lambda d: (d / "manifest.json").write_text("[" * 100000 + "]" * 100000),
                             "manifest.json: does not parse (cut short or overwritten)"),
    "manifest_linked": (lambda d: (os.replace(d / "manifest.json", d.parents[2] / "m.json"),
                                   os.symlink(d.parents[2] / "m.json", d / "manifest.json")),
                        "manifest.json: is not a manifest (too large, or not a regular file)"),
    "manifest_of_another_shape": (edit_manifest(lambda m: m["files"].update({"state.json": "abc"})),
                                  "manifest.json: does not parse as a manifest (identity, files: {path: [size, digest]})"),
    "manifest_of_a_newer_rft": (edit_manifest(lambda m: m.update(format=2)),
                                "manifest.json: has format 2 and hash 'xxh3_128'; this rft reads 1 and xxh3_128"),
    "manifest_entry_up": (edit_manifest(lambda m: m["files"].update({"../x": [1, "0" * 32]})),
                          f"manifest.json: lists '../x', {NOT_INSIDE}"),
    "manifest_entry_deep_up": (edit_manifest(lambda m: m["files"].update({"hf/../../../x": [1, "0" * 32]})),
                               f"manifest.json: lists 'hf/../../../x', {NOT_INSIDE}"),
    "manifest_entry_absolute": (edit_manifest(lambda m: m["files"].update({"/etc/hostname": [1, "0" * 32]})),
                                f"manifest.json: lists '/etc/hostname', {NOT_INSIDE}"),
    "another_checkpoint_copied_over": (lambda d: (shutil.rmtree(d), shutil.copytree(d.parent / "step_1", d)),
                                       "manifest.json: it is the checkpoint of step 1, in the directory of step 2 "
                                       "(copied over it?)"),
}


def test_a_killed_saves_leftover_goes_with_the_next_checkpoint(stage):
    """A job stopped mid-save (Slurm, after its warning gave up on a save that took too long) leaves
    step_3.tmp: no checkpoint (the newest stays step_2), and it is gone once step_4 is in place."""
    leftover = stage / "checkpoints" / "step_3.tmp"
    (leftover / "hf").mkdir(parents=True)
    (leftover / "hf" / "model.safetensors").write_bytes(WEIGHTS[:100])  # cut midway
    assert [c.step for c in checkpoint.list_checkpoints(stage)] == [1, 2]
    checkpoint.write(stage, 4, {"version": 4}, save_files, owner=OWNER)
    assert sorted(p.name for p in (stage / "checkpoints").iterdir()) == ["step_1", "step_2", "step_4"]


@pytest.mark.parametrize("kind", sorted(DAMAGES))
def test_each_damage_is_named_and_nothing_outside_is_read(stage, kind, monkeypatch):
    do, why = DAMAGES[kind]
    d = stage / "checkpoints" / "step_2"
    (stage.parent / "x").write_text("outside")
    do(d)
    read = []
    real = manifest.digest
    monkeypatch.setattr(manifest, "digest", lambda p: read.append(p) or real(p))
    assert damage(read_checkpoint(d)) == f"{d}/{why}"
    assert all(str(p).startswith(f"{d}/") for p in read), read


def test_a_file_removed_while_it_is_checked_is_named_not_raised(stage, monkeypatch):
    """The train run prunes a checkpoint (trainer.max_ckpt_to_keep) while mode=explore checks it."""
    d = stage / "checkpoints" / "step_2"
    real = manifest.digest

    def pruned_first(path):
        shutil.rmtree(d, ignore_errors=True)  # after the listing, before the first file is read
        return real(path)

    monkeypatch.setattr(manifest, "digest", pruned_first)
    assert manifest.verify(d) == f"{d}/hf/config.json: cannot be read (No such file or directory)"


def test_what_is_set_aside_twice_in_one_second_keeps_both(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest.time, "strftime", lambda fmt: "20261126_120000")
    for _ in range(3):
        (tmp_path / "entry").mkdir()
        manifest.put_aside(tmp_path / "entry", "damaged")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "entry.damaged-20261126_120000", "entry.damaged-20261126_120000-2", "entry.damaged-20261126_120000-3"]


def test_a_damaged_newest_checkpoint_is_set_aside_and_the_one_before_used(stage):
    zero_block(stage / "checkpoints" / "step_2")
    lines, say = said()
    ckpt = usable_checkpoint(stage, OWNER, "grpo", say)
    assert ckpt.step == 1
    (aside,) = (stage / "checkpoints").glob("step_2.damaged-*")
    assert lines == [f"[grpo] checkpoint step 2 is damaged ({stage / 'checkpoints' / 'step_2' / 'hf' / 'model.safetensors'}: "
                     f"its contents are not the ones saved (their digest differs)); moved it to {aside.name} and "
                     f"falling back to the previous complete checkpoint"]


def test_a_finished_stages_checkpoint_is_checked_without_its_optimizer_state(stage, monkeypatch):
    """A finished stage is only read from (its hf/): a re-run checked its trainer_state.pt too, twice hf/'s
    bytes (1.98 of 2.97 GB at the 0.5B shape), on every start. Resuming from it still reads it all."""
    step_2 = stage / "checkpoints" / "step_2"
    (step_2 / "trainer_state.pt").write_bytes(b"\2" * 4096)  # damaged, same size: only its digest tells
    read, digest = [], manifest.digest
    monkeypatch.setattr(manifest, "digest", lambda path: read.append(path.relative_to(stage / "checkpoints").as_posix()) or digest(path))
    lines, say = said()
    assert usable_checkpoint(stage, OWNER, "grpo", say, finished_at=2).step == 2
    # hf/'s two files and state.json: 18 + 16384 + ~60 bytes, not the 4096 of trainer_state.pt
    assert sorted(read) == ["step_2/hf/config.json", "step_2/hf/model.safetensors", "step_2/state.json"] and lines == []
    read.clear()
    assert usable_checkpoint(stage, OWNER, "grpo", say, finished_at=3).step == 1  # lengthened: resumed from
    assert "step_2/trainer_state.pt" in read and "step_1/trainer_state.pt" in read and lines == [
        f"[grpo] checkpoint step 2 is damaged ({step_2 / 'trainer_state.pt'}: its contents are not the ones saved "
        f"(their digest differs)); moved it to {next((stage / 'checkpoints').glob('step_2.damaged-*')).name} and "
        f"falling back to the previous complete checkpoint"]


def test_a_checkpoint_from_before_manifests_is_used_with_a_warning(tmp_path):
    d = tmp_path / "checkpoints" / "step_3"
    d.mkdir(parents=True)
    (d / "state.json").write_text(json.dumps({"step": 3, "version": 3}))
    lines, say = said()
    assert usable_checkpoint(tmp_path, OWNER, "grpo", say).step == 3
    assert lines == [f"[grpo] warning: checkpoint step 3 ({d}) has no manifest.json: written by an rft from before "
                     f"checkpoints carried one, it is used without a check of its files"]
    (d / "state.json").write_text("{")  # what was checked before manifests is still checked
    assert damage(read_checkpoint(d)) == f"{d / 'state.json'}: does not parse"


def test_a_checkpoint_from_before_manifests_of_another_run_needs_resume_with_changes(tmp_path):
    d = tmp_path / "other" / "checkpoints" / "step_400"
    d.mkdir(parents=True)
    (d / "state.json").write_text(json.dumps({"step": 400}))
    with pytest.raises(ConfigError) as e:
        checkpoint.chosen_checkpoint(tmp_path / "grpo", str(d), OWNER, "grpo", print)
    assert str(e.value) == (
        f"trainer.resume_from_path={str(d)!r} has no manifest.json (written by an rft from before checkpoints "
        f"carried one), so whose it is (run, stage, model, configuration) cannot be told, and it is not one of this "
        f"stage's own. resume_with_changes=true resumes from it as it is; or set model.model_path={d / 'hf'} (with "
        f"stages=[] for a run of one stage) to train from its weights with a new optimizer.")
    lines, say = said()
    taken = Owner(**{**vars(OWNER), "changes_ok": True})
    assert checkpoint.chosen_checkpoint(tmp_path / "grpo", str(d), taken, "grpo", say).step == 400
    assert lines[0].startswith("[grpo] warning: checkpoint step 400 (")


def test_resume_from_path_refuses_another_stage_in_one_paragraph(stage, tmp_path):
    other = Owner(run="rft/rl", stage="sft_warmup", config="0123456789abcdef", model="/models/qwen")
    d = stage / "checkpoints" / "step_2"
    with pytest.raises(ConfigError) as e:
        checkpoint.chosen_checkpoint(tmp_path / "sft_warmup", str(d), other, "sft_warmup", print)
    assert str(e.value) == (
        f"trainer.resume_from_path={str(d)!r} is not a checkpoint of this stage: it is step 2 of run rft/study, "
        f"stage grpo, model /models/tiny, config c0ffee00c0ffee00, and this stage is run rft/rl, stage sft_warmup, "
        f"model /models/qwen, config 0123456789abcdef; they differ in stage, model, config. Its optimizer state "
        f"and place in the schedule are that stage's, so this stage cannot resume from it: set "
        f"model.model_path={d / 'hf'} (with stages=[] for a run of one stage) to train from its weights with a "
        f"new optimizer, or resume this stage from one of its own checkpoints.")
    # resume_with_changes=true does not make another stage's checkpoint this one's
    with pytest.raises(ConfigError):
        checkpoint.chosen_checkpoint(tmp_path / "x", str(d), Owner(**{**vars(other), "changes_ok": True}), "x", print)
    assert (stage / "checkpoints" / "step_2").is_dir()  # nothing moved


def test_another_config_or_model_needs_resume_with_changes_and_another_run_is_said(stage):
    d = stage / "checkpoints" / "step_1"
    changed = Owner(run="rft/study", stage="grpo", config="ffffffffffffffff", model="/models/tiny")
    with pytest.raises(ConfigError) as e:
        checkpoint.chosen_checkpoint(stage, str(d), changed, "grpo", print)
    assert str(e.value).endswith(
        "they differ in config. resume_with_changes=true goes on from it with this run's configuration (as for "
        f"any changed configuration), or set model.model_path={d / 'hf'} (with stages=[] for a run of one stage) "
        f"to train from its weights with a new optimizer.")
    assert (stage / "checkpoints" / "step_2").is_dir()  # refused before anything moved
    lines, say = said()
    accepted = Owner(**{**vars(changed), "changes_ok": True, "model": "/models/tiny2"})
    assert checkpoint.chosen_checkpoint(stage, str(d), accepted, "grpo", say).step == 1
    assert lines[0] == ("[grpo] resume_with_changes=true: resuming from checkpoint step 1, written with another model "
                        "and config (run rft/study, stage grpo, model /models/tiny, config c0ffee00c0ffee00)")
    lines.clear()
    d = stage / "checkpoints" / "step_1"
    copied = Owner(**{**vars(OWNER), "run": "rft/copy"})
    assert usable_checkpoint(stage, copied, "grpo", say).step == 1
    assert lines == ["[grpo] resuming from step 1 of run rft/study (this run: rft/copy), written with the same stage, "
                     "model and configuration"]


def test_a_foreign_checkpoint_among_a_stages_own_stops_the_resume(stage):
    other = Owner(run="rft/study", stage="sft_warmup", config="c0ffee00c0ffee00", model="/models/tiny")
    with pytest.raises(ConfigError) as e:
        usable_checkpoint(stage, other, "sft_warmup", print)
    assert str(e.value).startswith(f"checkpoint {stage / 'checkpoints' / 'step_2'} is not a checkpoint of this stage: "
                                   f"it is step 2 of run rft/study, stage grpo,")


def test_a_file_where_the_checkpoints_folder_should_be_stops_the_run_in_one_paragraph(tmp_path):
    (tmp_path / "checkpoints").write_text("")
    with pytest.raises(RunError) as e:
        checkpoint.write(tmp_path, 2, {}, save_files, owner=OWNER)
    tmp = tmp_path / "checkpoints" / "step_2.tmp"
    assert str(e.value).startswith(f"writing checkpoint step 2 to {tmp} failed (NotADirectoryError: [Errno 20] "
                                   f"Not a directory: {str(tmp)!r}); that disk has ")
    assert str(e.value).endswith(
        f"GiB free (a full disk fails this way; so do a directory made read-only and a file where a directory "
        f"should be). Make room or make {tmp.parent} writable, or point checkpoint_root_dir at another disk, then "
        f"run the same command again to resume from the newest checkpoint (none yet: the stage starts over).")
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoints"]


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap mounts the folder read-only")
def test_a_checkpoints_folder_made_read_only_mid_run_stops_in_one_paragraph(stage):
    """The root user writes through chmod, so the folder is a read-only mount (bubblewrap)."""
    ckpts = stage / "checkpoints"
    code = ("import sys; from rft.runtime import checkpoint; from rft.errors import RunError\n"
            "import test_checkpoints_manifest as t\n"
            f"try: checkpoint.write({str(stage)!r}, 3, {{}}, t.save_files, owner=t.OWNER)\n"
            "except RunError as e: print(e); sys.exit(1)\n")
    r = subprocess.run(["bwrap", "--dev-bind", "/", "/", "--ro-bind", str(ckpts), str(ckpts), sys.executable, "-c", code],
                       capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"})
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.startswith(f"writing checkpoint step 3 to {ckpts / 'step_3.tmp'} failed (OSError: [Errno 30] "
                               f"Read-only file system: {str(ckpts / 'step_3.tmp')!r}); that disk has ")
    assert r.stdout.rstrip().endswith("run the same command again to resume from the newest checkpoint (step 2).")
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_1", "step_2"]


def test_explore_mode_skips_a_damaged_checkpoint_once_and_refuses_another_model(stage):
    zero_block(stage / "checkpoints" / "step_2")
    bad, lines = set(), []
    explorer = Owner(run="rft/gen", stage="grpo", config="0" * 16, model="/models/tiny")  # mode=explore: another config
    assert served_checkpoint(stage, explorer, 0, bad, "grpo", lines.append).step == 1
    assert lines == [f"[grpo] synchronizer.checkpoint_dir: checkpoint step 2 is damaged ({stage}/checkpoints/step_2/hf/"
                     f"model.safetensors: its contents are not the ones saved (their digest differs)); not served"]
    assert served_checkpoint(stage, explorer, 1, bad, "grpo", lines.append) is None and len(lines) == 1  # said once
    assert (stage / "checkpoints" / "step_2").is_dir()  # the train run's: never moved
    # the optimizer's state is not what the explorer reads: only its size is checked
    (stage / "checkpoints" / "step_1" / "trainer_state.pt").write_bytes(b"\2" * 4096)
    assert served_checkpoint(stage, explorer, 0, bad, "grpo", lines.append).step == 1
    with pytest.raises(ConfigError) as e:
        served_checkpoint(stage, Owner(**{**vars(explorer), "model": "/models/qwen"}), 0, set(), "grpo", print)
    assert str(e.value) == (
        f"synchronizer.checkpoint_dir={str(stage)!r}: its checkpoint step 1 is of run rft/study, stage grpo, model "
        f"/models/tiny, config c0ffee00c0ffee00, and this explorer serves model /models/qwen: the trained weights are "
        f"of another model. Point synchronizer.checkpoint_dir at the train run of this model, or give both runs the "
        f"same model.model_path.")


def test_explore_mode_reads_a_run_of_stages_at_its_own_stage(stage, tmp_path):
    """README "Modes": synchronizer.checkpoint_dir names the train run's directory. The default
    study's train run is two stages (<run>/sft_warmup, <run>/grpo); read as a stage directory the run's
    own held no checkpoints/, and the explorer served its starting weights for good, saying nothing."""
    from rft.runtime.checkpoint import train_stage_dir

    run = tmp_path  # the `stage` fixture's directory is <tmp_path>/grpo: a run of stages
    (run / "sft_warmup").mkdir()
    assert train_stage_dir(str(run), "grpo") == stage
    assert served_checkpoint(train_stage_dir(str(run), "grpo"), OWNER, 0, set(), "grpo", print).step == 2
    # the stage directory itself, or the checkpoints/ in it, as before
    assert train_stage_dir(str(stage), "grpo") == stage
    assert train_stage_dir(str(stage / "checkpoints"), "grpo") == stage
    # a run of one stage (its checkpoints/ at the top) is read as it is, even beside a folder of that name
    (run / "checkpoints").mkdir()
    assert train_stage_dir(str(run), "grpo") == run
    # a run not started yet: the directory as given, served once its checkpoints appear
    assert train_stage_dir(str(tmp_path / "later"), "grpo") == tmp_path / "later"


def test_explore_mode_says_where_it_looks_when_nothing_is_there_to_serve(stage, tmp_path, monkeypatch):
    """mode=explore, at the stage's start: a checkpoint_dir that exists but where no checkpoint will
    ever be found (the checkpoint root, one checkpoint's own folder, a relative path read from
    elsewhere) served the starting weights for the whole run, silently; only a missing one was said."""
    from rft.runtime.checkpoint import not_served_yet

    assert not_served_yet(str(stage), "grpo") is None  # its checkpoints are there
    assert not_served_yet(str(stage / "checkpoints"), "grpo") is None
    assert not_served_yet(str(tmp_path / "lerner"), "grpo") == (
        f"synchronizer.checkpoint_dir={str(tmp_path / 'lerner')!r}: no such directory yet; the explorers serve their "
        f"starting weights until a train run writes checkpoints there (a train-mode run's directory, or its stage "
        f"directory).")
    one = stage / "checkpoints" / "step_2"
    assert not_served_yet(str(one), "grpo") == (
        f"synchronizer.checkpoint_dir={str(one)!r}: no checkpoint in {one / 'checkpoints'} yet; the explorers serve "
        f"their starting weights until a train run saves there. Name a train-mode run's directory or its stage "
        f"directory (not the checkpoint root, nor one checkpoint).")
    # relative: read from where the run was started, and the message says where that is
    monkeypatch.chdir(tmp_path)
    (tmp_path / "checkpoints").mkdir(exist_ok=True)  # the checkpoint root: <root>/checkpoints/<project>/...
    assert not_served_yet("checkpoints", "grpo").startswith(
        f"synchronizer.checkpoint_dir='checkpoints': no checkpoint in {tmp_path / 'checkpoints'} yet;")


def published(stage, tmp_path):
    (stage / "metrics.jsonl").write_text('{"step": 2}\n')
    entry = tmp_path / "cache" / "key"
    entry.parent.mkdir()
    rundir.publish(entry, stage, stage / "checkpoints" / "step_2", print)
    return entry


def test_a_published_stage_is_sealed_and_its_copy_names_the_run_that_reuses_it(stage, tmp_path):
    entry = published(stage, tmp_path)
    assert manifest.verify(entry) is None
    assert set(json.loads((entry / "manifest.json").read_text())["files"]) == {
        "checkpoint/hf/config.json", "checkpoint/hf/model.safetensors", "checkpoint/manifest.json",
        "checkpoint/state.json", "checkpoint/trainer_state.pt", "metrics.jsonl", "source"}
    lines, say = said()
    reuser = Owner(**{**vars(OWNER), "run": "rft/second"})
    hf = rundir.reuse(entry, tmp_path / "second", reuser, "grpo", say)
    assert hf == tmp_path / "second" / "checkpoints" / "step_2" / "hf" and "reused" in lines[0]
    copy = read_checkpoint(hf.parent)
    assert copy.identity["run"] == "rft/second" and damage(copy) is None
    assert read_checkpoint(entry / "checkpoint").identity["run"] == "rft/study"  # the entry's own is untouched
    assert manifest.verify(entry) is None


@pytest.mark.parametrize("kind", ["cut", "another_stage", "unsealed"])
def test_a_damaged_stage_cache_entry_is_set_aside_naming_the_file(stage, tmp_path, kind):
    entry = published(stage, tmp_path)
    f = entry / "checkpoint" / "hf" / "config.json"
    if kind == "cut":  # a new file: the stage's own checkpoint, a hard link to the old one, stays whole
        f.unlink()
        f.write_text('{"hidden')  # 8 of its 18 bytes
        why = f"{f}: 8 bytes, 18 when saved (cut short or written over)"
    elif kind == "unsealed":
        (entry / "manifest.json").unlink()
        why = (f"{entry / 'manifest.json'}: missing (written by an rft from before entries carried one: it cannot "
               f"be checked)")
    else:
        why = ("it is run rft/study, stage grpo, model /models/tiny, config c0ffee00c0ffee00, and this stage is run "
               "rft/study, stage sft_warmup, model /models/tiny, config c0ffee00c0ffee00")
    lines, say = said()
    title = "sft_warmup" if kind == "another_stage" else "grpo"
    assert rundir.reuse(entry, tmp_path / "second", Owner(**{**vars(OWNER), "stage": title}), title, say) is None
    (aside,) = entry.parent.glob("key.damaged-*")
    assert lines == [f"[{title}] the stage cache's copy of this stage is damaged ({why}); moved it to {aside} and "
                     f"running the stage"]
    assert not (tmp_path / "second").exists()  # nothing copied


def test_a_stage_cache_that_cannot_take_a_stage_is_said_not_raised(stage, tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(manifest, "seal", full)
    (tmp_path / "cache").mkdir()
    lines, say = said()
    rundir.publish(tmp_path / "cache" / "key", stage, stage / "checkpoints" / "step_2", say)
    assert lines == [f"rft: warning: the stage cache {tmp_path / 'cache'} did not take this stage (OSError: [Errno 28] "
                     f"No space left on device); a later run with the same stage trains it again"]
    assert list((tmp_path / "cache").iterdir()) == []  # no half-written entry


def test_manifest_command_checks_a_folder(stage):
    d = stage / "checkpoints" / "step_2"
    cmd = [sys.executable, "-m", "rft.manifest", str(d)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.startswith(f"{d}: whole (4 files as saved); identity "), r.stderr
    zero_block(d)
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1
    assert r.stderr == f"damaged: {d}/hf/model.safetensors: its contents are not the ones saved (their digest differs)\n"


@pytest.mark.slow  # the default's warm-up (the session's warm start), then a run that stops before training
def test_resume_from_path_to_another_runs_warm_up_stops_with_one_paragraph(warm_start, tmp_path):
    """Another run's sft_warmup step 400, given to a GRPO run of another model and task: before
    manifests it printed "[grpo] already finished (step 400)" and exited 0."""
    ckpt = warm_start.parent
    r = run_cli("stages=[]", "cluster=inline", "monitor=console", "task=countdown", f"model.model_path={warm_start}",
                "model.builder=null", "name=other", f"trainer.resume_from_path={ckpt}",
                env={"RFT_CHECKPOINT_ROOT_DIR": str(tmp_path)})
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "already finished" not in r.stdout
    warm = read_checkpoint(ckpt).identity
    assert r.stderr.startswith(
        f"\nrft: configuration error: trainer.resume_from_path={str(ckpt)!r} is not a checkpoint of this stage: it is "
        f"step 400 of run {warm['run']}, stage sft_warmup, model {warm['model']}, config {warm['config']}, and this "
        f"stage is run rft/other, stage grpo, model {warm_start}, config "), r.stderr
    assert r.stderr.rstrip().endswith(
        f"; they differ in stage, model, config. Its optimizer state and place in the schedule are that stage's, so "
        f"this stage cannot resume from it: set model.model_path={warm_start} (with stages=[] for a run of one "
        f"stage) to train from its weights with a new optimizer, or resume this stage from one of its own "
        f"checkpoints.")


def test_export_refuses_a_damaged_checkpoint(stage, tmp_path):
    from rft.runtime.export import export

    d = stage / "checkpoints" / "step_2"
    zero_block(d)
    with pytest.raises(ConfigError) as e:
        export(d, tmp_path / "out")
    assert str(e.value) == (f"{d} is damaged: {d}/hf/model.safetensors: its contents are not the ones saved (their "
                            f"digest differs). Export another checkpoint.")
    assert not (tmp_path / "out").exists()


def test_the_umask_is_read_without_being_set(monkeypatch):
    # follow_umask read it by os.umask(0) and back: for that moment a file another thread made
    # (a Ray actor's, a reward's) came out 0666. On Linux it is read from /proc/self/status
    import os

    from rft import manifest

    before = os.umask(0o027)
    try:
        monkeypatch.setattr(os, "umask", lambda m: pytest.fail(f"os.umask({m:o}) called"))
        assert manifest.umask() == 0o027
    finally:
        monkeypatch.undo()
        os.umask(before)
