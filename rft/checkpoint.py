"""Checkpoints: their layout on disk, listing, the newest whole one, and writing one.

    <stage>/checkpoints/step_<N>/
        state.json         written last: a checkpoint without it is not one (a killed save)
        hf/                the model in Hugging Face format (mode=explore: none)
        trainer_state.pt   optimizer, scheduler, step, RNG, critic

A damaged checkpoint (state.json that does not parse, weights whose fingerprint is not the one
the save recorded, a missing file) is moved aside to step_<N>.damaged-<time> and the one before is
used; mode=explore keeps only its newest (a small state.json: its place in the schedule).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from rft.sync import format_fingerprint, same_weights, weight_sums


@dataclass
class Checkpoint:
    step: int
    path: Path
    state: dict = field(default_factory=dict)

    @property
    def hf_path(self) -> Path:
        return self.path / "hf"


def list_checkpoints(stage_dir: Path) -> list[Checkpoint]:
    """Complete checkpoints, oldest first: state.json is written last, so a killed save (no
    state.json) is not one; neither is a state.json that does not parse (use_checkpoint says why)."""
    found = []
    for d in (Path(stage_dir) / "checkpoints").glob("step_*"):
        if not d.name[5:].isdigit() or not (d / "state.json").exists():
            continue
        try:
            state = json.loads((d / "state.json").read_text())
        except (ValueError, OSError):
            state = {"step": int(d.name[5:]), "damaged": "state.json does not parse"}
        found.append(Checkpoint(state["step"], d, state))
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(stage_dir: Path) -> Checkpoint | None:
    found = [c for c in list_checkpoints(stage_dir) if "damaged" not in c.state]
    return found[-1] if found else None


def damage(ckpt: Checkpoint, has_model: bool) -> str | None:
    """What is wrong with a checkpoint (naming the file), or None. With a model: hf/config.json
    parses, trainer_state.pt is there, and hf/model.safetensors holds the weights whose
    fingerprint the save recorded in state.json (a file with zeroed or flipped bytes loads fine
    and trains on; this catches it)."""
    if "damaged" in ckpt.state:
        return f"{ckpt.path / 'state.json'}: {ckpt.state['damaged']}"
    if not has_model:
        return None
    cfg_file, weights = ckpt.hf_path / "config.json", ckpt.hf_path / "model.safetensors"
    try:
        json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        return f"{cfg_file}: {'missing' if isinstance(e, FileNotFoundError) else 'does not parse'}"
    if not (ckpt.path / "trainer_state.pt").is_file():
        return f"{ckpt.path / 'trainer_state.pt'}: missing"
    try:
        if not weights.exists() and not (ckpt.hf_path / "model.safetensors.index.json").exists():
            raise FileNotFoundError(weights)
        got = _file_fingerprint(sorted(ckpt.hf_path.glob("*.safetensors")))
    except Exception as e:  # missing, truncated, a damaged header
        return f"{weights}: {'missing' if not weights.exists() else f'does not load ({type(e).__name__})'}"
    expected = ckpt.state.get("saved_fingerprint")
    if expected is not None and not same_weights(got, expected):
        return f"{weights}: its weights are not the ones saved (fingerprint {got}, state.json has {expected})"
    return None


def _file_fingerprint(files) -> str:
    """The fingerprint of the tensors in safetensors files, read one tensor at a time (a large
    model's weights never sit in this process whole)."""
    from safetensors import safe_open

    total = [0.0, 0.0, 0.0]
    for f in files:
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                total = [a + b for a, b in zip(total, weight_sums([h.get_tensor(k)]))]
    return format_fingerprint(total)


def usable_checkpoint(stage_dir: Path, has_model: bool, title: str, say, before: int | None = None):
    """The newest checkpoint (older than step `before`) that is whole. Damaged ones are moved
    aside to checkpoints/step_N.damaged-<time> and named on the console."""
    for ckpt in reversed(list_checkpoints(stage_dir)):
        if before is not None and ckpt.step >= before:
            continue
        why = damage(ckpt, has_model)
        if why is None:
            return ckpt
        set_aside(ckpt, why, title, say)
    return None


def set_aside(ckpt: Checkpoint, why: str, title: str, say) -> None:
    aside = ckpt.path.with_name(f"{ckpt.path.name}.damaged-{time.strftime('%Y%m%d_%H%M%S')}")
    os.replace(ckpt.path, aside)
    say(f"[{title}] checkpoint step {ckpt.step} is damaged ({why}); moved it to {aside.name} and "
        f"falling back to the previous complete checkpoint")


def write(stage_dir: Path, step: int, state: dict, save_model=None, keep_only_newest: bool = False) -> Path:
    """Write checkpoint `step`: `save_model(tmp_dir) -> dict` (the trainer's files; what it returns
    joins the state), then state.json, then the directory is moved into place in one rename."""
    final = Path(stage_dir) / "checkpoints" / f"step_{step}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {"step": step, **state}
    if save_model is not None:
        state.update(save_model(tmp))
    (tmp / "state.json").write_text(json.dumps(state))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    if keep_only_newest:
        for old in list_checkpoints(stage_dir)[:-1]:
            shutil.rmtree(old.path, ignore_errors=True)
    return final
