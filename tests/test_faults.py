"""Faults outside a checkpoint's own files: a kill at a chosen point of a copy or an export, two
runs of one name at once, a full disk away from the checkpoint, damaged caches rft built itself,
a checkpoint from before manifests copied over another's step. Each ends in a run equal to an
uninterrupted one, or in one paragraph saying what to do; none in a traceback or a silently
different result. (Damage to checkpoints themselves: test_damage.py, test_checkpoints_manifest.py.)"""

import datetime
import json
import shutil
from types import SimpleNamespace

from rft import checkpoint, rundir
from rft.checkpoint import Owner, usable_checkpoint

OWNER = Owner(run="rft/study", stage="grpo", config="c0ffee00c0ffee00", model="/models/tiny")


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
