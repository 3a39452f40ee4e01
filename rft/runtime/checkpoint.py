"""Checkpoints: their layout on disk, whose they are, listing, verifying and writing them.

    <stage>/checkpoints/step_<N>/
        hf/                the model in Hugging Face format (mode=explore: none)
        adapter/           LoRA: the adapter alone (what a LoRA run resumes from)
        trainer_state.pt   optimizer, scheduler, step, RNG, critic
        state.json         the schedule's place: buffer position, metrics, reward statistics
        buffer_experiences.safetensors
                           a queue buffer's experiences (rft.data.buffer.pack_experiences), which
                           state.json's buffer part names
        manifest.json      written last (rft/manifest.py): every other file's size and digest, and
                           the checkpoint's identity: run, stage, step, the stage config's
                           fingerprint and the model the stage starts from

A checkpoint is written in step_<N>.tmp and renamed into place once its manifest is written, so a
killed save leaves no step_<N>. Before one is used (resume, trainer.resume_from_path, mode=explore's
pickup, the stage cache, export) its files are checked against the manifest: a damaged one is
moved aside to step_<N>.damaged-<time> and the one before is used. One of another stage, model or
configuration stops the run, naming both (resume_with_changes=true accepts another model or
configuration, as it accepts a changed config).

Checkpoints written before manifests existed (a state.json, no manifest.json) are resumed with a
one-line warning and without a check of their files, but for their state.json being of the step
their directory names (another step's checkpoint copied over one is set aside as damaged); as
trainer.resume_from_path from outside the stage's own checkpoints/ (whose they are cannot be told)
only with resume_with_changes=true; a stage-cache entry of that age is set aside and the stage
trained again.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from rft import manifest
from rft.errors import ConfigError, RunError


@dataclass(frozen=True)
class Owner:
    """The stage that writes and resumes checkpoints: the identity it writes into their manifests
    and checks in those it resumes. `config` is rundir.config_fingerprint of the stage's config;
    `model` what the stage starts from (model.model_path, and the stage before it, if any)."""
    run: str
    stage: str
    config: str
    model: str
    changes_ok: bool = False  # resume_with_changes=true
    # `config` as an rft from before secrets were masked in it wrote it (a token whole): the same
    # configuration, so its checkpoints resume after an upgrade
    unmasked_config: str = ""
    # `config` less the keys an update of rft added since the stage ran, at their defaults
    # (rundir.upgraded): the same configuration, so its checkpoints resume after the update
    upgraded_config: str = ""

    def identity(self, step: int) -> dict:
        return {"run": self.run, "stage": self.stage, "step": step, "config": self.config, "model": self.model}

    def differences(self, saved: dict, keys=("stage", "model", "config")) -> list[str]:
        also = {c for c in (self.unmasked_config, self.upgraded_config) if c}
        return [k for k in keys if saved.get(k) != getattr(self, k) and not (k == "config" and saved.get(k) in also)]


@dataclass
class Checkpoint:
    step: int
    path: Path
    state: dict
    identity: dict | None  # None: written before manifests (legacy)
    problem: str | None = None  # found while reading it: a manifest or state.json that does not parse

    @property
    def hf_path(self) -> Path:
        return self.path / "hf"


def shown(value) -> str:
    """A value read from a checkpoint's manifest, as the console shows it: its repr where it holds
    a control character (an escape sequence in a handed-over checkpoint's identity would otherwise
    reach the terminal, which may act on it: set the clipboard, rewrite what is shown)."""
    text = str(value)
    return text if text.isprintable() else repr(text)


def describe(identity: dict) -> str:
    return (f"run {shown(identity.get('run'))}, stage {shown(identity.get('stage'))}, model "
            f"{shown(identity.get('model'))}, config {shown(identity.get('config'))}")


def read_checkpoint(d: Path) -> Checkpoint | None:
    """The checkpoint in directory `d` (step_<N>), or None when it is not one (neither a manifest
    nor a state.json). Reads the two small files only: `damage` checks the rest."""
    d = Path(d)
    named = int(d.name[5:]) if d.name.startswith("step_") and d.name[5:].isdigit() else None
    sealed, why = manifest.read(d)
    if sealed is None and why is None and not (d / "state.json").exists():
        return None
    try:  # a FIFO there: an OSError, not a hang
        state = json.loads(manifest.read_record(d / "state.json", state_bound(sealed)))
        problem = None if isinstance(state, dict) and isinstance(state.get("step"), int) else "holds no step"
    except (ValueError, OSError, RecursionError) as e:
        state, problem = {}, ("missing" if isinstance(e, FileNotFoundError) else f"does not read ({e.strerror})"
                              if isinstance(e, OSError) else "does not parse")
    state = state if isinstance(state, dict) else {}
    problem = problem and f"{d / 'state.json'}: {problem}"
    identity = sealed["identity"] if sealed else None
    if why is not None:
        problem, identity = f"{d / manifest.MANIFEST}: {why}", {}
    elif sealed is None and state.get("manifest"):  # written with one, which is gone: not legacy
        problem, identity = f"{d / manifest.MANIFEST}: missing", {}
    elif sealed is None and problem is None and named is not None and state["step"] != named:
        # legacy: its state.json is all that can tell another step's checkpoint copied over this one
        problem = (f"{d / 'state.json'}: it is the state of step {state['step']}, in the directory of step {named} "
                   f"(copied over it?)")
    step = named if named is not None else (identity or state).get("step", -1)
    return Checkpoint(step if isinstance(step, int) else -1, d, state, identity, problem)


def state_bound(sealed: dict | None) -> int:
    """How many bytes of a checkpoint's state.json are read: the size its manifest lists, where that
    is over the bound on records (a sealed state.json's size is the run's own record of it). A long
    run's state can pass that bound legitimately (data_processor.online_curriculum over 3,000,000
    tasks of window 8: 64.7 MiB), and resume moved every checkpoint aside as damaged and started
    over. A file with no manifest keeps the bound; one longer than listed is damage either way."""
    listed = (sealed or {}).get("files", {}).get("state.json")
    return max(manifest.MAX_RECORD, listed[0]) if listed else manifest.MAX_RECORD


def list_checkpoints(stage_dir: Path) -> list[Checkpoint]:
    """The stage's checkpoints, oldest first (a killed save, step_<N>.tmp, is not one; neither is
    one moved aside)."""
    found = [read_checkpoint(d) for d in (Path(stage_dir) / "checkpoints").glob("step_*") if d.name[5:].isdigit()]
    return sorted((c for c in found if c is not None), key=lambda c: c.step)


def latest_checkpoint(stage_dir: Path) -> Checkpoint | None:
    """The newest checkpoint that reads (not verified: for messages, and the one just written)."""
    found = [c for c in list_checkpoints(stage_dir) if c.problem is None]
    return found[-1] if found else None


def damage(ckpt: Checkpoint, skip: tuple[str, ...] = ()) -> str | None:
    """What is wrong with a checkpoint, naming the file, or None: its manifest's check (every
    file's digest, but those in `skip`: manifest.verify), and that it is the step its directory says."""
    if not ckpt.identity:  # legacy (nothing to check against), or a manifest that does not read
        return ckpt.problem
    why = manifest.verify(ckpt.path, skip)  # state.json included: its verdict comes first
    if why is None and ckpt.identity.get("step") != ckpt.step:
        why = (f"{ckpt.path / manifest.MANIFEST}: it is the checkpoint of step {shown(ckpt.identity.get('step'))}, in the "
               f"directory of step {ckpt.step} (copied over it?)")
    return why or ckpt.problem


def check_owner(ckpt: Checkpoint, owner: Owner, source: str, title: str, say) -> None:
    """A ConfigError when `ckpt` is another stage's, or another model's or configuration's (unless
    resume_with_changes=true); a line on the console when it is another run's or a legacy one."""
    if ckpt.identity is None:
        legacy_warning(ckpt, title, say)
        return
    differ = owner.differences(ckpt.identity)
    if differ and (not owner.changes_ok or "stage" in differ):
        raise ConfigError(foreign(ckpt, owner, source, differ))
    if differ:
        say(f"[{title}] resume_with_changes=true: resuming from checkpoint step {ckpt.step}, written with another "
            f"{' and '.join(differ)} ({describe(ckpt.identity)})")
    elif ckpt.identity.get("run") != owner.run:
        say(f"[{title}] resuming from step {ckpt.step} of run {shown(ckpt.identity.get('run'))} (this run: {owner.run}), "
            f"written with the same stage, model and configuration")


def legacy_warning(ckpt: Checkpoint, title: str, say) -> None:
    say(f"[{title}] warning: checkpoint step {ckpt.step} ({ckpt.path}) has no {manifest.MANIFEST}: written "
        f"by an rft from before checkpoints carried one, it is used without a check of its files")


def foreign(ckpt: Checkpoint, owner: Owner, source: str, differ: list[str]) -> str:
    """One paragraph: what the checkpoint is, what this stage is, and the ways on."""
    hf = ckpt.hf_path if ckpt.hf_path.is_dir() else f"<the folder `python -m rft.runtime.export {ckpt.path} <folder>` writes>"
    fresh = f"set model.model_path={hf} (with stages=[] for a run of one stage) to train from its weights with a new optimizer"
    if "stage" in differ:
        ways = (f"Its optimizer state and place in the schedule are that stage's, so this stage cannot resume "
                f"from it: {fresh}, or resume this stage from one of its own checkpoints.")
    else:
        ways = (f"resume_with_changes=true goes on from it with this run's configuration (as for any changed "
                f"configuration), or {fresh}.")
    return (f"{source} is not a checkpoint of this stage: it is step {ckpt.step} of {describe(ckpt.identity)}, and "
            f"this stage is {describe(owner.identity(0))}; they differ in {', '.join(differ)}. {ways}")


def usable_checkpoint(stage_dir: Path, owner: Owner, title: str, say, before: int | None = None,
                      finished_at: int | None = None):
    """The newest checkpoint (older than step `before`) that is whole; damaged ones are moved aside
    to checkpoints/step_N.damaged-<time> and named on the console. One of another stage, model or
    configuration stops the run (check_owner). One at step `finished_at` or later ends its stage,
    which is not resumed but only read from (its hf/, by the next stage): its trainer_state.pt, the
    optimizer's moments (twice hf/'s bytes; ~61 GB for a 7B model in float32), is not read to check
    it on every re-run (a run that lengthens the stage checks it in full before resuming from it)."""
    for ckpt in reversed(list_checkpoints(stage_dir)):
        if before is not None and ckpt.step >= before:
            continue
        finished = finished_at is not None and ckpt.step >= finished_at
        why = damage(ckpt, skip=("trainer_state.pt",) if finished else ())
        if why is None:
            check_owner(ckpt, owner, f"checkpoint {ckpt.path}", title, say)
            return ckpt
        set_aside(ckpt, why, title, say)
    return None


def chosen_checkpoint(stage_dir: Path, path: str, owner: Owner, title: str, say) -> Checkpoint:
    """trainer.resume_from_path: that checkpoint, whole and this stage's, or a ConfigError naming
    what is wrong. Newer checkpoints of this stage belong to the run it goes back on: they are
    moved aside (step_<N>.superseded-<time>), never deleted."""
    d = Path(os.path.expanduser(path))
    ckpt = read_checkpoint(d) if d.is_dir() else None
    if ckpt is None:
        have = ", ".join(str(c.path) for c in list_checkpoints(stage_dir)) or "none yet"
        what = "no such directory" if not d.is_dir() else "not a checkpoint (no manifest.json: not a step_<N> directory, or a save that did not finish)"
        raise ConfigError(f"trainer.resume_from_path={path!r}: {what}. Give a directory <run>/<stage>/checkpoints/"
                          f"step_<N>; this stage's checkpoints: {have}. Or leave it null to resume from the newest.")
    why = damage(ckpt)
    if why is not None:
        raise ConfigError(f"trainer.resume_from_path={path!r} is damaged: {shown(why)}. Choose another checkpoint.")
    own = d.resolve().parent == (Path(stage_dir) / "checkpoints").resolve()
    if ckpt.identity is None and not own and not owner.changes_ok:
        raise ConfigError(
            f"trainer.resume_from_path={path!r} has no {manifest.MANIFEST} (written by an rft from before checkpoints "
            f"carried one), so whose it is (run, stage, model, configuration) cannot be told, and it is not one of "
            f"this stage's own. resume_with_changes=true resumes from it as it is; or set "
            f"model.model_path={ckpt.hf_path} (with stages=[] for a run of one stage) to train from its weights "
            f"with a new optimizer.")
    check_owner(ckpt, owner, f"trainer.resume_from_path={path!r}", title, say)
    if own:
        for newer in [c for c in list_checkpoints(stage_dir) if c.step > ckpt.step]:
            aside = manifest.put_aside(newer.path, "superseded")
            say(f"[{title}] trainer.resume_from_path: resuming from step {ckpt.step}; the newer checkpoint "
                f"step {newer.step} is moved to {aside.name}")
    return ckpt


def train_stage_dir(checkpoint_dir: str, stage: str) -> Path:
    """synchronizer.checkpoint_dir as given -> the train-mode stage directory whose checkpoints/ a
    mode=explore stage serves: that directory, the checkpoints/ in it, or a run's directory of
    several stages (<run>, the stage directories inside), where the stage of the explorer's own
    stage name is the one: read as a stage directory it holds no checkpoints/ and nothing would
    ever be served, silently."""
    path = Path(os.path.expanduser(checkpoint_dir))
    if path.name == "checkpoints":
        return path.parent
    if not (path / "checkpoints").is_dir() and (path / stage).is_dir():
        return path / stage
    return path


def not_served_yet(checkpoint_dir: str, stage: str) -> str | None:
    """mode=explore, at the stage's start: the warning where synchronizer.checkpoint_dir holds no
    checkpoint yet (None: it does). A misspelt path, the checkpoint root or one checkpoint's own
    folder served the starting weights for the whole run, silently; the message names the folder
    read (a relative path is read from where the run started)."""
    stage_dir = train_stage_dir(checkpoint_dir, stage)
    if not stage_dir.is_dir():
        return (f"synchronizer.checkpoint_dir={checkpoint_dir!r}: no such directory yet; the explorers serve their "
                f"starting weights until a train run writes checkpoints there (a train-mode run's directory, or its "
                f"stage directory).")
    if list_checkpoints(stage_dir):
        return None
    return (f"synchronizer.checkpoint_dir={checkpoint_dir!r}: no checkpoint in {stage_dir.absolute() / 'checkpoints'} "
            f"yet; the explorers serve their starting weights until a train run saves there. Name a train-mode run's "
            f"directory or its stage directory (not the checkpoint root, nor one checkpoint).")


def served_checkpoint(stage_dir: Path, owner: Owner, newer_than: int, damaged: set, title: str, say):
    """mode=explore: the newest checkpoint with hf/ of the train run in `stage_dir` that is newer
    than step `newer_than`, whole (but for its trainer_state.pt, which is not read) and of this
    stage's model; None if none. A damaged one is named once (and kept in `damaged`) and skipped,
    never moved: it is another run's."""
    for ckpt in reversed(list_checkpoints(stage_dir)):
        if ckpt.step <= newer_than:
            return None
        if ckpt.path in damaged or not ckpt.hf_path.exists():
            continue
        why = damage(ckpt, skip=("trainer_state.pt",))
        if why is not None:
            damaged.add(ckpt.path)
            say(f"[{title}] synchronizer.checkpoint_dir: checkpoint step {ckpt.step} is damaged ({shown(why)}); not served")
            continue
        if ckpt.identity is not None and owner.differences(ckpt.identity, ("model",)):
            raise ConfigError(
                f"synchronizer.checkpoint_dir={str(stage_dir)!r}: its checkpoint step {ckpt.step} is of "
                f"{describe(ckpt.identity)}, and this explorer serves model {owner.model}: the trained weights "
                f"are of another model. Point synchronizer.checkpoint_dir at the train run of this model, or "
                f"give both runs the same model.model_path.")
        if ckpt.identity is None:
            legacy_warning(ckpt, title, say)
        return ckpt
    return None


def set_aside(ckpt: Checkpoint, why: str, title: str, say) -> None:
    aside = manifest.put_aside(ckpt.path, "damaged")
    # shown: `why` names a file of the checkpoint, whose name (in a handed-over run) may hold an escape sequence
    say(f"[{title}] checkpoint step {ckpt.step} is damaged ({shown(why)}); moved it to {aside.name} and "
        f"falling back to the previous complete checkpoint")


def write(stage_dir: Path, step: int, state: dict, save_model=None, keep: int | None = None, say=None,
          owner: Owner | None = None, files: dict[str, bytes] | None = None) -> Path:
    """Write checkpoint `step`: `save_model(tmp_dir) -> dict` (the trainer's files; what it returns
    joins the state), `files` (name -> bytes: a queue buffer's experiences), state.json, then the
    manifest (of `owner`'s identity), then the directory is moved into place in one rename. A save that fails for any reason (a full disk, a directory
    made read-only, a file where a directory should be) stops the run with one paragraph and leaves
    no step_<N>.tmp; a killed save's step_<M>.tmp goes once a checkpoint is in place. Then only
    the newest `keep` checkpoints stay (None: all; trainer.max_ckpt_to_keep; mode=explore keeps 1),
    each one deleted told to `say`; damaged ones moved aside are never touched."""
    final = Path(stage_dir) / "checkpoints" / f"step_{step}"
    tmp = final.with_name(final.name + ".tmp")
    state = {"step": step, **state, "manifest": manifest.FORMAT}
    try:
        _remove(tmp)
        tmp.mkdir(parents=True)
        if save_model is not None:
            state.update(save_model(tmp))
        for name, data in (files or {}).items():
            (tmp / name).write_bytes(data)
        (tmp / "state.json").write_text(json.dumps(state))
        manifest.follow_umask(tmp)  # hf/model.safetensors was 0600 beside 0644 files: a model others load too
        manifest.seal(tmp, owner.identity(step) if owner else {"step": step})
        _remove(final)
        os.replace(tmp, final)
        # a save killed before its rename (a job Slurm stopped mid-save after its warning, a kill)
        # left its step_<M>.tmp, which no resume reads (at 7B up to ~92 GB): the stage has one writer
        # (rft.runtime.rundir.run_lock), so every other one is such a leftover
        for stale in final.parent.glob("step_*.tmp"):
            _remove(stale)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)  # no half-written step_N.tmp left behind
        if isinstance(e, RunError):  # the trainer died: its own message
            raise
        raise _unwritable(stage_dir, step, tmp, e) from e
    if keep is not None:
        others = [c for c in list_checkpoints(stage_dir) if c.step != step]  # oldest first
        for old in others[:max(0, len(others) + 1 - keep)]:
            _remove(old.path)
            if say is not None:
                say(f"deleted checkpoint step {old.step} ({old.path}): keeping the newest {keep}")
    return final


def _remove(path: Path) -> None:
    """A checkpoint folder deleted, or where a link stands in its place, the link alone: rmtree
    refuses a link (and ignore_errors hid that), so a link planted as step_<N> stayed, read as a
    checkpoint, and pruning said it deleted it. Its target, outside the run, is never touched."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def _unwritable(stage_dir: Path, step: int, tmp: Path, e: Exception) -> RunError:
    try:
        free = f"{shutil.disk_usage(stage_dir).free / 2**30:.1f} GiB free"
    except OSError:
        free = "an unknown amount of space free"
    previous = [c.step for c in list_checkpoints(stage_dir)]
    cause = getattr(e, "cause", None) or e  # raised in a Ray actor, it arrives wrapped
    what = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
    return RunError(
        f"writing checkpoint step {step} to {tmp} failed ({what}); that disk has {free} (a full disk "
        f"fails this way; so do a directory made read-only and a file where a directory should be). Make "
        f"room or make {tmp.parent} writable, or point checkpoint_root_dir at another disk, then run the same "
        f"command again to resume from the newest checkpoint "
        f"({f'step {previous[-1]}' if previous else 'none yet: the stage starts over'})."
    )


EXPLORE_START = "explore_start.json"  # in the stage directory, beside checkpoints/


def explore_start(stage_dir: Path, buffer, path: str) -> int | None:
    """mode=explore with no checkpoint to resume from: where the buffer at `path` ended (its
    `state()["last_id"]`: a row id, a byte offset) when this stage first started, or None on that
    first start, which records it in <stage>/explore_start.json before any row is written. A run
    killed before its first checkpoint resumes from there as from a checkpoint: the rows after it
    of its seed are its own (rft.runtime.saving.own_groups); without the mark it could not tell them
    from an earlier run's of its seed, and wrote its explore step 0's rows again. A mark of another
    buffer path, or one that does not read, is recorded anew (continue_from_checkpoint=false moves
    the stage directory, mark and all, aside)."""
    mark = Path(stage_dir) / EXPLORE_START
    try:
        saved = json.loads(manifest.read_record(mark))
        if saved["path"] == str(path) and type(saved["last_id"]) is int:
            return saved["last_id"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    mark.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_atomic(mark, json.dumps({"path": str(path), "last_id": buffer.state()["last_id"]}))
    return None
