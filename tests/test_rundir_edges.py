"""A run directory's records at its edges: each small record rft reads back is read to a bound (a
damaged or planted huge file under its name is not read whole), and a stage cache entry's path is
shown escaped."""
import json
import os

import pytest
from test_checkpoints_manifest import OWNER, said, stage  # noqa: F401 (stage: a fixture)

from rft import manifest
from rft.runtime import checkpoint, rundir
from rft.runtime.checkpoint import Owner, read_checkpoint


def huge(path):
    """`path` made a sparse file one byte over the bound (no disk used; read whole, 64 MiB of memory)."""
    path.unlink(missing_ok=True)
    with open(path, "wb") as f:
        f.truncate(manifest.MAX_RECORD + 1)


def test_a_record_over_the_bound_is_an_oserror_naming_the_file(tmp_path):
    f = tmp_path / "state.json"
    huge(f)
    with pytest.raises(OSError) as e:
        manifest.read_record(f)
    assert e.value.strerror == f"larger than {manifest.MAX_RECORD} bytes, which no record rft writes is"
    assert e.value.filename == str(f)
    f.write_text('{"step": 3}')
    assert manifest.read_record(f) == b'{"step": 3}'  # 11 bytes: under the bound, read whole
    assert manifest.read_record(f, 11) == b'{"step": 3}'  # exactly at the bound still reads
    with pytest.raises(OSError):
        manifest.read_record(f, 10)


def test_a_huge_state_json_is_a_damaged_checkpoint_not_read_whole(stage):  # noqa: F811
    d = stage / "checkpoints" / "step_2"
    huge(d / "state.json")
    ckpt = read_checkpoint(d)
    assert ckpt.problem == (f"{d / 'state.json'}: does not read (larger than {manifest.MAX_RECORD} bytes, which no "
                            f"record rft writes is)")


def test_every_record_a_stage_reads_back_is_read_to_the_bound(stage, monkeypatch):  # noqa: F811
    """config.yaml, the data record, the explore mark and state.json: each read goes through
    read_regular with a bound (most >= 0), never a whole-file read_text."""
    seen = []
    real = manifest.read_regular

    def spy(path, most=-1):
        seen.append((os.path.basename(path), most))
        return real(path, most)

    monkeypatch.setattr(manifest, "read_regular", spy)
    monkeypatch.setattr(rundir, "data_digests", lambda cfg: {})  # no datasets: the record's read is what is checked
    (stage / "config.yaml").write_text("# fingerprint: x\na: 1\n")
    (stage / rundir.DATA_RECORD).write_text("{}")
    (stage / checkpoint.EXPLORE_START).write_text(json.dumps({"path": "b.db", "last_id": 4}))
    assert rundir.saved_config(stage) == {"a": 1}
    assert rundir.record_problem(stage).startswith("is not the one saved")
    assert rundir.data_differences(stage, {}) == []  # {} recorded, {} now
    assert checkpoint.explore_start(stage, None, "b.db") == 4
    read_checkpoint(stage / "checkpoints" / "step_2")
    names = {name for name, _ in seen}
    assert {"config.yaml", rundir.DATA_RECORD, checkpoint.EXPLORE_START, "state.json"} <= names
    assert all(most == manifest.MAX_RECORD + 1 for _, most in seen)


def test_a_stage_cache_path_with_control_characters_is_shown_escaped(stage, tmp_path):  # noqa: F811
    (stage / "metrics.jsonl").write_text('{"step": 2}\n')
    entry = tmp_path / "cache\x1b]52;c;ZWNobw==\x07" / "key"  # OSC 52: sets the terminal's clipboard
    entry.parent.mkdir()
    rundir.publish(entry, stage, stage / "checkpoints" / "step_2", print)
    lines, say = said()
    assert rundir.reuse(entry, tmp_path / "second", Owner(**{**vars(OWNER), "run": "rft/second"}), "grpo", say)
    assert len(lines) == 1 and "\x1b" not in lines[0] and "\x07" not in lines[0]
    assert lines[0].endswith(f"copied from the stage cache {str(entry)!r}")  # repr: \x1b and \x07 as text


def test_pruning_a_link_planted_as_a_checkpoint_removes_the_link_never_its_target(stage, tmp_path):  # noqa: F811
    outside = tmp_path / "outside"
    (stage / "checkpoints" / "step_1").rename(outside)  # a whole checkpoint, outside the run
    before = sorted(p.relative_to(outside) for p in outside.rglob("*"))
    (stage / "checkpoints" / "step_1").symlink_to(outside, target_is_directory=True)
    lines, say = said()
    checkpoint.write(stage, 3, {"version": 3}, keep=2, say=say, owner=OWNER)  # keeps step_2 and step_3
    assert not os.path.lexists(stage / "checkpoints" / "step_1")  # the link is gone (it stayed, read as step 1)
    assert sorted(p.relative_to(outside) for p in outside.rglob("*")) == before and len(before) > 3  # untouched
    assert [c.step for c in checkpoint.list_checkpoints(stage)] == [2, 3]


def test_a_linked_checkpoints_folder_is_pruned_inside_its_target(stage, tmp_path):  # noqa: F811
    """checkpoints/ linked to a bigger disk on purpose: saving and pruning work there."""
    disk = tmp_path / "disk"
    (stage / "checkpoints").rename(disk)
    (stage / "checkpoints").symlink_to(disk, target_is_directory=True)
    checkpoint.write(stage, 3, {"version": 3}, keep=2, owner=OWNER)
    assert sorted(p.name for p in disk.iterdir()) == ["step_2", "step_3"]  # step_1 pruned, in the target


@pytest.mark.slow  # two training runs
def test_a_config_error_at_run_time_leaves_a_directory_the_fixed_run_starts_clean_in(tmp_path, monkeypatch, capsys):
    """A ConfigError raised once the directory is made (.hydra/, .run.lock, the stage's config.yaml):
    the next run starts from step 0, is not told another run holds the lock, and logs only its own steps."""
    import rft.runtime.main
    from conftest import compose_cfg
    from test_rundir import TINY, steps

    from rft.errors import ConfigError
    from rft.runtime import runner

    args = [*TINY, f"checkpoint_root_dir={tmp_path}", "name=edge", "stage_cache_dir=null"]
    real = runner.StageRun.loop

    def refuse(self):
        raise ConfigError("trainer.something: checked when the trainer starts")

    monkeypatch.setattr(runner.StageRun, "loop", refuse)
    with pytest.raises(ConfigError):
        rft.runtime.main._main(compose_cfg(args))
    run = tmp_path / "rft" / "edge"
    assert (run / ".hydra" / "config.yaml").exists() and (run / rundir.RUN_LOCK).exists()  # the leftovers
    monkeypatch.setattr(runner.StageRun, "loop", real)
    capsys.readouterr()
    rft.runtime.main.main(compose_cfg([*args, "algorithm.optimizer.lr=1e-3"]))  # the fixed config: not "changed"
    out = capsys.readouterr().out
    assert "resum" not in out.lower() and "another rft process" not in out
    assert steps(run / "metrics.jsonl") == [1, 2]
    assert [c.step for c in checkpoint.list_checkpoints(run)] == [2]
    assert "lr: 0.001" in (run / "config.yaml").read_text()  # the record is the fixed run's, written anew


def test_a_stage_cache_that_cannot_take_a_stage_names_its_folder_escaped(stage, tmp_path, monkeypatch):  # noqa: F811
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(manifest, "seal", full)
    cache = tmp_path / "cache\x1b[2J"  # ESC [2J: clears the terminal
    cache.mkdir()
    lines, say = said()
    rundir.publish(cache / "key", stage, stage / "checkpoints" / "step_2", say)
    assert lines == [f"rft: warning: the stage cache {str(cache)!r} did not take this stage (OSError: [Errno 28] "
                     f"No space left on device); a later run with the same stage trains it again"]
