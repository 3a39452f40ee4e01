"""Checkpoints: their layout on disk, listing, the newest whole one, and writing one.

    <stage>/checkpoints/step_<N>/
        state.json         written last: a checkpoint without it is not one (a killed save)
        hf/                the model in Hugging Face format (mode=explore: none)
        trainer_state.pt   optimizer, scheduler, step, RNG, critic

A damaged checkpoint (state.json that does not parse, weights whose fingerprint is not the one
the save recorded, a trainer_state.pt whose checksums fail, a missing file) is moved aside to
step_<N>.damaged-<time> and the one before is used; mode=explore keeps only its newest (a small
state.json: its place in the schedule).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from rft.errors import RunError
from rft.sync import format_fingerprint, hf_weight_files, same_weights, weight_sums


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
    found = [read_checkpoint(d) for d in (Path(stage_dir) / "checkpoints").glob("step_*") if d.name[5:].isdigit()]
    return sorted((c for c in found if c is not None), key=lambda c: c.step)


def read_checkpoint(d: Path) -> Checkpoint | None:
    """The checkpoint in directory `d` (step_<N>), or None when it is not one (no state.json)."""
    d = Path(d)
    if not (d / "state.json").exists():
        return None
    try:
        state = json.loads((d / "state.json").read_text())
        why = None if isinstance(state, dict) and isinstance(state.get("step"), int) else "state.json holds no step"
    except (ValueError, OSError):
        why = "state.json does not parse"
    if why:
        state = {"step": int(d.name[5:]) if d.name[5:].isdigit() else -1, "damaged": why}
    return Checkpoint(state["step"], d, state)


def chosen_checkpoint(stage_dir: Path, path: str, has_model: bool, title: str, say) -> Checkpoint:
    """trainer.resume_from_path: that checkpoint, whole, or a ConfigError naming what is wrong.
    Newer checkpoints of this stage belong to the run it goes back on: they are moved aside
    (step_<N>.superseded-<time>), never deleted."""
    from rft.errors import ConfigError

    d = Path(os.path.expanduser(path))
    ckpt = read_checkpoint(d) if d.is_dir() else None
    if ckpt is None:
        have = ", ".join(str(c.path) for c in list_checkpoints(stage_dir)) or "none yet"
        what = "no such directory" if not d.is_dir() else "not a checkpoint (no state.json: not a step_<N> directory, or a save that did not finish)"
        raise ConfigError(f"trainer.resume_from_path={path!r}: {what}. Give a directory <run>/<stage>/checkpoints/"
                          f"step_<N>; this stage's checkpoints: {have}. Or leave it null to resume from the newest.")
    why = damage(ckpt, has_model)
    if why is not None:
        raise ConfigError(f"trainer.resume_from_path={path!r} is damaged: {why}. Choose another checkpoint.")
    if d.resolve().parent == (Path(stage_dir) / "checkpoints").resolve():
        for newer in [c for c in list_checkpoints(stage_dir) if c.step > ckpt.step]:
            aside = newer.path.with_name(f"{newer.path.name}.superseded-{time.strftime('%Y%m%d_%H%M%S')}")
            os.replace(newer.path, aside)
            say(f"[{title}] trainer.resume_from_path: resuming from step {ckpt.step}; the newer checkpoint "
                f"step {newer.step} is moved to {aside.name}")
    return ckpt


def latest_checkpoint(stage_dir: Path) -> Checkpoint | None:
    found = [c for c in list_checkpoints(stage_dir) if "damaged" not in c.state]
    return found[-1] if found else None


def damage(ckpt: Checkpoint, has_model: bool, trainer_state: bool = True) -> str | None:
    """What is wrong with a checkpoint (naming the file), or None. With a model: hf/config.json
    parses, trainer_state.pt is there and its checksums hold (unless `trainer_state` is False: a
    finished stage another starts from, which reads only the model), and hf/'s safetensors
    (model.safetensors or the shards its index lists) hold the weights whose fingerprint the save
    recorded in state.json (a file with zeroed or flipped bytes loads fine and trains on; this
    catches it). A LoRA checkpoint saved without hf/ (trainer.save_hf_checkpoint) is checked the
    same way on its adapter/."""
    if "damaged" in ckpt.state:
        return f"{ckpt.path / 'state.json'}: {ckpt.state['damaged']}"
    if not has_model:
        return None
    adapter_only = not ckpt.hf_path.exists() and (ckpt.path / "adapter").is_dir()
    folder = ckpt.path / "adapter" if adapter_only else ckpt.hf_path
    cfg_file = folder / ("adapter_config.json" if adapter_only else "config.json")
    try:
        json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        return f"{cfg_file}: {'missing' if isinstance(e, FileNotFoundError) else 'does not parse'}"
    if trainer_state:
        if not (ckpt.path / "trainer_state.pt").is_file():
            return f"{ckpt.path / 'trainer_state.pt'}: missing"
        why = _zip_damage(ckpt.path / "trainer_state.pt")
        if why:
            return f"{ckpt.path / 'trainer_state.pt'}: {why}"
    try:
        files = [folder / "adapter_model.safetensors"] if adapter_only else hf_weight_files(folder)
    except (OSError, ValueError, KeyError):  # no weights, or an index that does not parse
        return f"{folder / 'model.safetensors'}: missing"
    total = [0.0, 0.0, 0.0]
    for f in files:
        try:
            total = [a + b for a, b in zip(total, _file_sums(f))]
        except Exception as e:  # missing, truncated, a damaged header
            return f"{f}: {'missing' if not f.exists() else f'does not load ({type(e).__name__})'}"
    got, expected = format_fingerprint(total), ckpt.state.get("saved_fingerprint")
    if expected is not None and not same_weights(got, expected):
        where = files[0] if len(files) == 1 else folder
        return f"{where}: its weights are not the ones saved (fingerprint {got}, state.json has {expected})"
    return None


def _zip_damage(f: Path) -> str | None:
    """torch.save writes a zip archive with a CRC-32 of each entry, which torch.load does not check:
    a flipped or zeroed block inside the optimizer's state loads and trains on. Checked here (one
    read of the file, when a checkpoint is about to be used)."""
    import zipfile

    try:
        with zipfile.ZipFile(f) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        return f"does not read as the archive torch.save writes ({type(e).__name__}: cut short?)"
    return f"its entry {bad} does not match the checksum written with it" if bad else None


# safetensors dtypes as numpy reads them; BF16 is the upper half of a float32 (numpy has none)
_NUMPY_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8", "I32": "<i4",
                 "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?"}


def _file_sums(f: Path) -> list[float]:
    """weight_sums of the tensors in a safetensors file (rft.sync: the same float64 sums), read
    one tensor at a time from a memory map (a large model's weights never sit in this process
    whole) with numpy: the driver of a Ray run checks checkpoints and the stage cache without
    importing torch (a third of a GB). The format: an 8-byte little-endian header length, the JSON
    header (each tensor's dtype, shape and byte range), then the data."""
    import numpy as np

    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    size = f.stat().st_size - 8 - n
    data = np.memmap(f, dtype=np.uint8, mode="r", offset=8 + n) if size > 0 else None
    tensors = {name: t for name, t in header.items() if name != "__metadata__"}
    if any(t["dtype"] not in _NUMPY_DTYPES for t in tensors.values()):  # float8: torch reads it
        return _file_sums_torch(f)
    total = [0.0, 0.0, 0.0]
    for name, t in tensors.items():
        start, end = t["data_offsets"]
        if end > size:
            raise ValueError(f"tensor {name} ends at byte {end} of {size}: the file is cut short")
        raw = data[start:end].view(_NUMPY_DTYPES[t["dtype"]]) if end > start else np.zeros(0)
        for a in range(0, raw.size, 1 << 18):  # chunks that stay in cache, as weight_sums does
            chunk = raw[a: a + (1 << 18)]
            x = ((chunk.astype(np.uint32) << 16).view(np.float32) if t["dtype"] == "BF16" else chunk).astype(np.float64)
            total = [total[0] + x.sum(), total[1] + np.abs(x).sum(), total[2] + np.dot(x, x)]
    return [float(v) for v in total]


def _file_sums_torch(f: Path) -> list[float]:
    from safetensors import safe_open

    total = [0.0, 0.0, 0.0]
    with safe_open(str(f), "pt") as h:
        for k in h.keys():
            total = [a + b for a, b in zip(total, weight_sums([h.get_tensor(k)]))]
    return total


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


def write(stage_dir: Path, step: int, state: dict, save_model=None, keep: int | None = None, say=None) -> Path:
    """Write checkpoint `step`: `save_model(tmp_dir) -> dict` (the trainer's files; what it returns
    joins the state), then state.json, then the directory is moved into place in one rename.
    Then only the newest `keep` complete checkpoints stay (None: all; trainer.max_ckpt_to_keep;
    mode=explore keeps 1), each one deleted told to `say`; damaged ones moved aside are never touched."""
    final = Path(stage_dir) / "checkpoints" / f"step_{step}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {"step": step, **state}
    try:
        if save_model is not None:
            state.update(save_model(tmp))
        (tmp / "state.json").write_text(json.dumps(state))
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)  # no half-written step_N.tmp left behind
        if isinstance(e, RunError):  # the trainer died: its own message
            raise
        free = shutil.disk_usage(stage_dir).free / 2**30
        previous = [c.step for c in list_checkpoints(stage_dir)]
        cause = getattr(e, "cause", None) or e  # raised in a Ray actor, it arrives wrapped
        what = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
        raise RunError(
            f"writing checkpoint step {step} to {tmp} failed ({what}); "
            f"that disk has {free:.1f} GiB free (a full disk fails this way). Make room, or point "
            f"checkpoint_root_dir at another disk, then run the same command again to resume from the "
            f"newest checkpoint ({f'step {previous[-1]}' if previous else 'none yet: the stage starts over'})."
        ) from e
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    if keep is not None:
        others = [c for c in list_checkpoints(stage_dir) if c.step != step]  # oldest first
        for old in others[:max(0, len(others) + 1 - keep)]:
            shutil.rmtree(old.path, ignore_errors=True)
            if say is not None:
                say(f"deleted checkpoint step {old.step} ({old.path}): keeping the newest {keep}")
    return final
