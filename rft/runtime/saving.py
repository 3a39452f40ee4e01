"""A stage's checkpoints as the runner uses them: the trainer loaded from the newest one that loads,
the buffer put back where that one left it, and a step's checkpoint written. (The format, and
which checkpoint is usable: rft.runtime.checkpoint; what state.json holds: rft.runtime.schedule,
which writes it and reads it back.)"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from rft.data.buffer import unpack_experiences
from rft.data.readers import step_seed
from rft.errors import RunError
from rft.runtime import checkpoint
from rft.runtime.checkpoint import Checkpoint, Owner, set_aside, usable_checkpoint
from rft.runtime.faults import TrainerCalls, TrainerDied, actor_died

log = logging.getLogger(__name__)


def own_groups(cfg, first_step: int):
    """Whether a group id is of this run's explore step `first_step` or later. A group id is
    f"{step}/{seed}/{task_id}" (rft/rollout/workflows), its seed `step_seed(cfg.seed, step, salt)`
    with a salt below 1000 x the explorers (rft/rollout/explorer.py: 1000 x the shard, plus DAPO's
    tries): another run's differs unless it has the same seed (explorers that share a buffer
    sample with seeds of their own, or they would write the same rollouts)."""
    shards = cfg.explorer.rollout_model.engine_num

    def own(group_id: str) -> bool:
        step, _, rest = group_id.partition("/")
        seed = rest.partition("/")[0]
        if not (step.isdigit() and seed.isdigit()) or int(step) < first_step:
            return False
        return (int(seed) - step_seed(cfg.seed, int(step))) % 2**31 < 1000 * shards

    return own


def lora_base(base: str, run_dir: Path, ckpt_dir: Path) -> dict:
    """How a LoRA checkpoint at `ckpt_dir` names the model its adapter goes on, for state.json:
    `lora_base`, a local folder's absolute path or a hub id as given; and, for a folder inside the
    run's directory (an earlier stage's model), `lora_base_relative`, its path from the checkpoint's
    folder, which stays right when the run's directory is moved or copied elsewhere. The adapter's
    adapter_config.json (PEFT's base_model_name_or_path, written by save_pretrained as the absolute
    path the base was loaded from) then names it from the run's directory: `cd <run>` and
    AutoPeftModelForCausalLM.from_pretrained("<stage>/checkpoints/step_<N>/adapter") loads it."""
    local = Path(os.path.expanduser(str(base)))
    if not local.exists():  # a hub id: itself (os.path.abspath made it a folder under the working directory)
        return {"lora_base": str(base)}
    local = Path(os.path.abspath(local))
    out = {"lora_base": str(local)}
    run_dir = Path(os.path.abspath(run_dir))
    if local.is_relative_to(run_dir):
        # ckpt_dir may be step_<N>.tmp, renamed beside itself: the same depth, so the same relative path
        out["lora_base_relative"] = os.path.relpath(local, os.path.abspath(ckpt_dir))
        config = Path(ckpt_dir) / "adapter" / "adapter_config.json"
        if config.is_file():
            import json

            adapter = json.loads(config.read_text())
            adapter["base_model_name_or_path"] = local.relative_to(run_dir).as_posix()
            config.write_text(json.dumps(adapter, indent=2, sort_keys=True))
    return out


class StageCheckpoints:
    def __init__(self, cfg, plan, stage_dir: Path, title: str, owner: Owner, init_path: str | None):
        self.cfg, self.plan, self.dir, self.title, self.owner, self.init_path = cfg, plan, stage_dir, title, owner, init_path

    def load(self, trainer: TrainerCalls, latest: Checkpoint | None) -> Checkpoint | None:
        """Load the newest whole checkpoint into the trainer; a trainer_state.pt that does not load
        sets that checkpoint aside and the one before is tried (None: start from the beginning)."""
        while latest is not None:
            try:
                trainer.actor.call("load", str(latest.path))
                log.info("resumed %s from %s", self.title, latest.path)
                return latest
            except Exception as e:
                if actor_died(e) or isinstance(e, TrainerDied):  # not the checkpoint's fault: nothing set aside
                    raise
                cause = getattr(e, "cause", e)
                # a refused pickle says why itself (rft.trainer.state.load_state: it would run code)
                why = (str(cause).split(". ")[0] if type(cause).__name__ == "UnpicklingError" and "is refused" in str(cause)
                       # the weights' file named (rft.trainer.state.reading)
                       else str(cause) if type(cause).__name__ == "CheckpointFileError"
                       else f"{latest.path / 'trainer_state.pt'} does not load: {type(cause).__name__}")
                set_aside(latest, why, self.title, print)
                latest = usable_checkpoint(self.dir, self.owner, self.title, print, before=latest.step)
        return None

    def restore_buffer(self, buffer, state: dict | None, latest: Checkpoint | None) -> None:
        """Put the buffer back where the checkpoint left it, and make sure it still holds what the
        checkpoint counts on: the experiences explored ahead and not yet read."""
        eb = self.cfg.buffer.trainer_input.experience_buffer
        if self.cfg.mode == "both" and hasattr(buffer, "truncate_after"):
            # this run is the only writer: what it wrote after its checkpoint (or, with no
            # checkpoint, at all) is written again, identically
            dropped = buffer.truncate_after(state["last_id"] if state else 0)
            if dropped:
                log.info("dropped %d experiences written after the checkpoint", dropped)
            if state and buffer.state()["last_id"] < state["last_id"]:
                # the file was deleted, replaced or cut since the checkpoint
                if state.get("cursor", state.get("offset")) != state["last_id"]:
                    raise RunError(
                        f"the buffer {eb.path} no longer holds the experiences checkpoint step "
                        f"{latest.step} explored ahead and had not trained on yet (it was deleted, "
                        f"replaced or cut since). Put the file back, or start this stage again "
                        f"(continue_from_checkpoint=false)."
                    )
                print(f"[{self.title}] the buffer {eb.path} was deleted or cut since the checkpoint; "
                      f"nothing in it was still to be read, so the run goes on")
                state = buffer.state()  # read from its (new) end
                state = {**state, "cursor": state["last_id"], "offset": state["last_id"]}
        if self.cfg.mode == "explore" and hasattr(buffer, "keep_written"):
            # explore steps' rows are written before their step's checkpoint: what this run wrote
            # after it stays, and exploring those steps again it does not write it again. Nothing
            # is removed: a trainer elsewhere may be reading the buffer live, and other explorers
            # may write to it too (rft.data.buffer._KeepsWhatItWrote). With no checkpoint yet, after
            # where the buffer ended when the stage first started (checkpoint.explore_start)
            start = state["last_id"] if state else checkpoint.explore_start(self.dir, buffer, eb.path)
            first = latest.state.get("next_explore", 0) if state else 0
            kept = 0 if start is None else buffer.keep_written(start, own_groups(self.cfg, first))
            if kept:
                log.info("%d experiences this run wrote after the checkpoint stay; they are not written again", kept)
        if state:
            self._check_unread(buffer, state, latest)
            self._restore(buffer, state, latest)
        elif eb.storage_type == "sql":
            buffer.restore({"cursor": 0})  # a fresh run reads from the start

    def _restore(self, buffer, state: dict, latest: Checkpoint) -> None:
        """`buffer.restore(state)`, a queue's experiences read from the file beside state.json
        that `state["experiences"]` names (checked against the manifest with the rest); a state
        or file that does not restore (edited, the manifest sealed again) is one paragraph."""
        where = latest.path / "state.json"
        try:
            name = state.get("experiences")
            if name is None:  # a sql or file buffer, or a queue's checkpoint that holds them in state.json
                buffer.restore(state)
                return
            if not (isinstance(name, str) and name == Path(name).name and name.endswith(".safetensors")):
                raise ValueError(f'its "experiences" ({str(name)[:80]}) is not the name of a .safetensors file beside it')
            where = latest.path / name
            experiences = unpack_experiences(where.read_bytes())
            where = latest.path / "state.json"
            buffer.restore(state, experiences)
        except (ValueError, KeyError, TypeError, OSError) as e:
            why = f"{type(e).__name__}: {e}" if isinstance(e, (KeyError, TypeError, OSError)) else str(e)
            raise RunError(
                f"{where}: the buffer's part of checkpoint step {latest.step} does not restore ({why}); rft writes "
                f"it whole, so it was edited or damaged since (and the checkpoint's manifest sealed again). Put "
                f"it back as it was, or move {latest.path} away to resume from the checkpoint before it, or "
                f"start this stage again (continue_from_checkpoint=false)."
            ) from None

    def buffer_state(self, buffer) -> tuple[dict, dict[str, bytes]]:
        """The buffer's part of a checkpoint, and the files that go beside state.json: its read and
        write positions; in mode=both (this run its only writer) also the digest of the experiences
        explored ahead and not read yet, which the resume checks (`_check_unread`). A queue's
        experiences go in a file of their own (QueueBuffer.stored_state)."""
        if hasattr(buffer, "stored_state"):
            state, data = buffer.stored_state()
            return state, {state["experiences"]: data} if data is not None else {}
        state = buffer.state()
        if self.cfg.mode == "both" and hasattr(buffer, "unread_digest"):
            state["unread_digest"] = buffer.unread_digest(state.get("cursor", state.get("offset")), state["last_id"])
        return state, {}

    def _check_unread(self, buffer, state: dict, latest: Checkpoint | None) -> None:
        """A sql or file buffer's experiences explored ahead, still to be trained on, must be those the
        checkpoint saved: neither SQLite nor a JSONL file checksums its rows, so a changed byte (a
        token id, a reward) would otherwise be trained on unnoticed."""
        if "unread_digest" not in state:  # a queue (state.json holds its items), or an older checkpoint
            return
        if buffer.unread_digest(state.get("cursor", state.get("offset")), state["last_id"]) != state["unread_digest"]:
            raise RunError(
                f"the buffer {self.cfg.buffer.trainer_input.experience_buffer.path} does not hold the experiences "
                f"checkpoint step {latest.step} explored ahead and had not trained on yet as it saved them (their "
                f"digest differs: the file was damaged or edited since). Put the file back, or start this stage "
                f"again (continue_from_checkpoint=false)."
            )

    def write(self, step: int, state: dict, trainer: TrainerCalls | None, say, files: dict | None = None) -> None:
        """The checkpoint of step `step`: the trainer (if any), `files` (name -> bytes: the buffer's,
        `buffer_state`), then `state` (state.json), written last. `say`: where a note on pruning old
        checkpoints goes."""

        def save_trainer(tmp: Path) -> dict:
            # the parameters' fingerprint: what an explorer serving this checkpoint checks its load
            # against (the files themselves are checked by the manifest checkpoint.write adds)
            trainer("save", str(tmp), with_hf)
            out = {"fingerprint": trainer("fingerprint")}
            if self.cfg.model.lora.rank:  # the base the adapter goes on (python -m rft.runtime.export merges them)
                run_dir = self.dir.parent if self.cfg.get("stage_name") else self.dir
                out.update(lora_base(self.init_path or self.cfg.model.model_path, run_dir, tmp))
            return out

        # LoRA (trainer.save_hf_checkpoint): the merged model in hf/ at every save, the last, or never
        when = self.cfg.trainer.save_hf_checkpoint
        with_hf = when == "always" or (when == "last" and step >= self.plan.total_steps)
        # an explorer's place (mode=explore): only the newest matters, its pruning not worth a line
        if trainer is None:
            checkpoint.write(self.dir, step, state, keep=1, owner=self.owner, files=files)
        else:
            checkpoint.write(self.dir, step, state, save_trainer, keep=self.cfg.trainer.max_ckpt_to_keep,
                             say=lambda m: say(f"[{self.title}] trainer.max_ckpt_to_keep: {m}"),
                             owner=self.owner, files=files)
