"""Export a saved checkpoint as a Hugging Face model folder.

    python -m rft.runtime.export <run>/<stage>/checkpoints/step_<N> <out dir> [--max-shard-size 5GB]

Any trainer checkpoint works (trainer=torch or fsdp2, full or LoRA): its files are checked first
against its manifest, then the model is written with its tokenizer as `save_pretrained` writes it,
loadable with `AutoModelForCausalLM.from_pretrained`, into a new (or empty) folder, sealed with a
manifest of its own (the checkpoint's identity and where it came from: `python -m rft.manifest
<out dir>` checks it). A checkpoint's hf/ is the whole model (LoRA: merged); a LoRA checkpoint
saved without hf/ (trainer.save_hf_checkpoint) is merged here from its adapter/ and the base model
its state.json names. It is written in <out dir>.partial and renamed into place once sealed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rft.errors import ConfigError


def _checkpoints_near(path: Path) -> list[Path]:
    """The complete checkpoints a user who gave `path` may have meant: its siblings (a step that is
    not there), its parent's (an hf/ inside one), a stage's or a run's (the directory given); the
    newest three of each stage."""
    places = {path.parent, path.parent.parent, path / "checkpoints", *path.glob("*/checkpoints")}
    found = {d for p in places for d in p.glob("step_*") if d.is_dir() and d.name[5:].isdigit()
             and (d / "manifest.json").is_file()}
    ordered = sorted(found, key=lambda d: (str(d.parent), int(d.name[5:])))
    return [d for d in ordered if sum(o.parent == d.parent and int(o.name[5:]) > int(d.name[5:]) for o in ordered) < 3]


def lora_base(ckpt_path: Path, state: dict) -> str | None:
    """The model a LoRA checkpoint's adapter goes on (rft.runtime.saving.lora_base): an earlier stage's
    model by its path from the checkpoint (right in a run directory moved or copied elsewhere), else
    `lora_base` as saved: a folder's absolute path, or a hub id."""
    relative = state.get("lora_base_relative")
    if isinstance(relative, str) and (ckpt_path / relative).is_dir():
        return os.path.normpath(ckpt_path / relative)
    return state.get("lora_base")


def export(checkpoint_dir: str | Path, out_dir: str | Path, max_shard_size: str = "5GB") -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rft import manifest
    from rft.runtime.checkpoint import damage, read_checkpoint

    ckpt_dir = Path(checkpoint_dir).expanduser()
    ckpt = read_checkpoint(ckpt_dir) if ckpt_dir.is_dir() else None
    if ckpt is None:
        near = ", ".join(str(c) for c in _checkpoints_near(ckpt_dir))
        raise ConfigError(f"{ckpt_dir} {'is not a checkpoint' if ckpt_dir.exists() else 'does not exist'}: a checkpoint "
                          f"is a directory <run>/<stage>/checkpoints/step_<N> with a manifest.json (one without it is "
                          f"a save that did not finish).{f' The checkpoints there: {near}.' if near else ''}")
    out = Path(out_dir).expanduser()
    if out.is_symlink():  # the sealed folder is renamed onto `out`, which a link cannot take (a raw ENOTDIR at the end)
        raise ConfigError(f"{out} is a link (to {os.readlink(out)}): the export is written beside its folder and "
                          f"renamed into place. Give the folder itself ({out.resolve()}), or a new folder.")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} is not an empty folder: the export is sealed with a manifest of every file in "
                          f"its folder. Give a new folder (or empty this one).")
    adapter = ckpt.path / "adapter"
    if not ckpt.hf_path.is_dir() and not adapter.is_dir():
        raise ConfigError(f"{ckpt_dir} holds no model (no hf/, no adapter/): a mode=explore checkpoint records "
                          f"only its place in the schedule. Export a checkpoint of a run that trains.")
    why = damage(ckpt, skip=("trainer_state.pt",))  # the optimizer's state is not exported
    if why is not None:
        raise ConfigError(f"{ckpt_dir} is damaged: {why}. Export another checkpoint.")
    if ckpt.identity is None:
        print(f"warning: {ckpt_dir} has no manifest.json (written by an rft from before checkpoints carried one): "
              f"exported without a check of its files", file=sys.stderr)
    if ckpt.hf_path.is_dir():
        model, tokenizer_dir = AutoModelForCausalLM.from_pretrained(ckpt.hf_path), ckpt.hf_path
    else:
        from peft import PeftModel

        base = lora_base(ckpt.path, ckpt.state)
        if not base or (not Path(base).is_dir() and (os.path.isabs(base) or base.startswith((".", "~")))):
            raise ConfigError(f"{ckpt_dir}: its LoRA base model {base!r} is not a directory here; the adapter "
                              f"alone is in {adapter} (PEFT's format, for PeftModel.from_pretrained on that base).")
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).merge_and_unload()
        tokenizer_dir = base
    # written beside it and renamed to `out` once sealed: a killed export leaves no `out` (one held a model
    # without its tokenizer, which from_pretrained loads); the next export of `out` removes the rest
    tmp = out.with_name(out.name + ".partial")
    # a link planted in a shared folder goes (the model went where it pointed, and `out` became the
    # link), as does a file of that name (its mkdir was a raw FileExistsError after the model loaded)
    manifest.clear(tmp)
    tmp.mkdir()  # made here: one made in its place since is an error, not a folder written into
    model.save_pretrained(tmp, max_shard_size=max_shard_size)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp)
    manifest.follow_umask(tmp)
    manifest.seal(tmp, {**(ckpt.identity or {"step": ckpt.step}), "exported_from": str(ckpt_dir.resolve())})
    os.replace(tmp, out)  # over an empty folder too
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rft.runtime.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="a checkpoint directory: <run>/<stage>/checkpoints/step_<N>")
    ap.add_argument("out", help="the folder to write (Hugging Face format)")
    ap.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    args = ap.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out, args.max_shard_size)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} (load it with AutoModelForCausalLM.from_pretrained)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
