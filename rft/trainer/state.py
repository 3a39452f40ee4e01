"""The trainer's resumable state: a checkpoint's model (hf/, or with LoRA the adapter alone),
optimizer, scheduler, step count, RNG state and critic, written and read back.

`CheckpointMixin` reads and sets what Trainer.__init__ builds (rft.trainer.trainer); trainer=fsdp2
(rft.trainer.fsdp.FSDPTrainer) overrides `save` and `load` to gather and scatter the shards.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

from rft.models import load_hf_weights
from rft.trainer import lora


class CheckpointMixin:
    """The Trainer's checkpoints (see the module's docstring)."""

    def save(self, directory: str, with_hf: bool = True) -> None:
        """A resumable checkpoint: the model in HF format (hf/) and the optimizer state (the
        checkpoint's manifest, written after, proves the files: rft/manifest.py).
        With LoRA also the adapter alone (adapter/, PEFT's format: what resume reads, the base
        being the stage's starting model), and hf/ (the merged model) only `with_hf`."""
        d = Path(directory)
        if lora.is_lora(self.model):
            self.model.save_pretrained(d / "adapter")
            if not with_hf:
                self._save_state(d)
                return
        sd = self._state_dict()
        hf_model = self.model.get_base_model() if lora.is_lora(self.model) else self.model
        hf_model.save_pretrained(d / "hf", state_dict=sd)
        self.tokenizer.save_pretrained(d / "hf")
        self._save_state(d)

    def _save_state(self, d: Path) -> None:
        save_state(
            {
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "version": self.version,
                "rng": torch.get_rng_state(),
                "critic": None if self.critic is None else self.critic.state_dict(),
            },
            d / "trainer_state.pt",
        )

    def load(self, directory: str) -> None:
        d = Path(directory)
        # the state first: a damaged file then leaves the model as it was (the runner falls back)
        state = load_state(d / "trainer_state.pt")
        check_state(state, self.optimizer, self.scheduler, d / "trainer_state.pt", critic=self.critic)
        if lora.is_lora(self.model):
            from safetensors.torch import load_file

            with reading(d / "adapter" / "adapter_model.safetensors") as path:
                lora.load_adapter(self.model, load_file(path))
        elif not self._weights_built_from(d):
            with reading(weights_file(d / "hf")):
                load_hf_weights(self.model, d / "hf")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self._configured_optimizer()
        self.version = state["version"]
        self._fp_cache = None  # other weights under what may be the same version number
        torch.set_rng_state(state["rng"])
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])

    def _weights_built_from(self, d: Path) -> bool:
        """Whether the policy holds checkpoint `d`'s hf/ weights as it was built (Trainer's `resume`):
        true once, for the load right after the build; any other load reads them."""
        built, self._built_from = getattr(self, "_built_from", None), None
        return built is not None and built == d

    def _configured_optimizer(self) -> None:
        """After loading a checkpoint: the config's optimizer settings, not the checkpoint's. They
        are the same unless the run resumed with changes (resume_with_changes=true) or runs longer;
        the schedule is this run's (its step count restored, its length this plan's)."""
        opt = self.cfg.algorithm.optimizer
        self.scheduler.base_lrs = [opt.lr for _ in self.optimizer.param_groups]
        for group, fn in zip(self.optimizer.param_groups, self.scheduler.lr_lambdas):
            group.update(initial_lr=opt.lr, lr=opt.lr * fn(self.scheduler.last_epoch),
                         betas=tuple(opt.betas), weight_decay=opt.weight_decay)
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]


class CheckpointFileError(Exception):
    """A checkpoint's weights that do not load: the message names the file (the runner sets the
    checkpoint aside with it, as a damaged one)."""


def weights_file(hf: Path) -> Path:
    """What a failed read of hf/ names: its one weights file, or the folder of its shards."""
    return hf / "model.safetensors" if (hf / "model.safetensors").exists() else hf


@contextmanager
def reading(path: Path):
    """Any failure while the weights at `path` are read is named as theirs (a checkpoint from before
    manifests is read unchecked: a cut hf/model.safetensors was said to be trainer_state.pt)."""
    try:
        yield path
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise CheckpointFileError(f"{path} does not load ({type(e).__name__}: {first})") from e


def save_state(state: dict, path: Path) -> None:
    """torch.save without the CRC32 it computes of every record by default: the checkpoint's manifest
    (rft/manifest.py) digests the file right after, and torch.load never checks the CRC (a damaged
    byte loads silently), so it was a second hash of the optimizer's moments, twice the model's
    bytes (~0.3 s of a core for the 0.5B shape's 2 GB; 61 GB at 7B with float32 masters)."""
    from torch.serialization import get_crc32_options, set_crc32_options

    before = get_crc32_options()
    set_crc32_options(False)
    try:
        torch.save(state, path)
    finally:
        set_crc32_options(before)


def check_state(state, optimizer, scheduler, path: Path, names: dict | None = None, critic=None) -> None:
    """A CheckpointFileError naming trainer_state.pt unless it is the shape the trainer saves, checked
    before any of it is loaded: torch loads an optimizer's moments of another shape without a word
    (the first step then fails in Adam with a bare traceback, or broadcasts), and a scheduler's
    state is put into the scheduler's own attributes as it is (its `optimizer` replaced by a dict).
    `critic` (algorithm=ppo's value model) has its part checked alike: its weights and moments."""
    why = _state_problem(state, optimizer, scheduler, names)
    if why is None and critic is not None:
        why = _critic_problem(state.get("critic"), critic, names is not None)
    if why is not None:
        raise CheckpointFileError(f"{path} does not load ({why}: the trainer never saves one so)")


def _state_problem(state, optimizer, scheduler, names: dict | None = None) -> str | None:
    """`names`: {id(parameter): name} where a state keyed by parameter name may come (trainer=fsdp2's
    checkpoints; torch's own form is keyed by position)."""
    if not isinstance(state, dict) or not {"optimizer", "scheduler", "version", "rng"} <= set(state):
        return "it is not a dict of optimizer, scheduler, version and rng"
    if type(state["version"]) is not int or state["version"] < 0:
        return f"its version {str(state['version'])[:40]!r} is not a step count"
    why = _optimizer_problem(state["optimizer"], optimizer, names, "optimizer")
    if why is not None:
        return why
    sched = state["scheduler"]
    if not isinstance(sched, dict) or not set(sched) <= set(scheduler.state_dict()):
        extra = sorted(set(sched) - set(scheduler.state_dict())) if isinstance(sched, dict) else []
        return f"its scheduler part holds {extra[:3] or 'no dict'}, which is not a state of the trainer's scheduler"
    if type(sched.get("last_epoch", 0)) is not int:
        return f"its scheduler's last_epoch {str(sched['last_epoch'])[:40]!r} is not a step count"
    return None


def _critic_problem(part, critic, by_name: bool) -> str | None:
    """The value model's part: {"model": state dict, "optimizer": its optimizer's} of this critic's shapes
    (load_state_dict checks the weights' shapes but not the optimizer's moments)."""
    if not isinstance(part, dict) or not {"model", "optimizer"} <= set(part) or not isinstance(part["model"], dict):
        return "its critic part is not a dict of model and optimizer"
    own = critic.model.state_dict()
    for k, v in part["model"].items():
        if k not in own or not torch.is_tensor(v) or v.shape != own[k].shape:
            shape = list(v.shape) if torch.is_tensor(v) else type(v).__name__
            return f"its critic's weight {str(k)[:80]!r} is {shape}, which this value model does not hold so"
    names = {id(p): n for n, p in critic.model.named_parameters()} if by_name else None
    return _optimizer_problem(part["optimizer"], critic.optimizer, names, "critic's optimizer")


def _optimizer_problem(opt, optimizer, names: dict | None, what: str) -> str | None:
    if not (isinstance(opt, dict) and isinstance(opt.get("state"), dict) and isinstance(opt.get("param_groups"), list)
            and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in opt["param_groups"])):
        return f"its {what} part is not an optimizer's state (state, param_groups)"
    # torch pairs the saved ids with the optimizer's parameters in this order (Optimizer.load_state_dict)
    saved = [i for g in opt["param_groups"] for i in g["params"]]
    own = [p for g in optimizer.param_groups for p in g["params"]]
    if len(saved) != len(own):
        return f"its {what} holds {len(saved)} parameters, this model's {len(own)}"
    by_name = names is not None and all(isinstance(i, str) for i in saved)
    params = {names.get(id(p)): p for p in own} if by_name else dict(zip(saved, own))
    if by_name and set(saved) != set(params):
        return f"its {what} names parameter {str(next(iter(set(saved) - set(params))))[:80]!r}, which this model lacks"
    for i, moments in opt["state"].items():
        if i not in params or not isinstance(moments, dict):
            return f"its {what}'s state names parameter {str(i)[:40]!r}, which no param group lists"
        for k, v in moments.items():
            if torch.is_tensor(v) and v.dim() > 0 and v.shape != params[i].shape:
                return (f"its {what}'s {k} of parameter {saved.index(i)} has shape {list(v.shape)}, the "
                        f"parameter {list(params[i].shape)}")
    return None


def load_state(path: Path) -> dict:
    """trainer_state.pt, read with weights_only=True: tensors, numbers, strings and containers of
    them, which is all the trainer saves. Unpickling anything else would call code named by the
    file, so such a file is refused with an UnpicklingError saying so (the runner then sets the
    checkpoint aside, as a damaged one)."""
    import pickle
    import re

    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)", str(e))  # torch names what the file would call
        what = f"a call of {found.group(1)}" if found else "an object"
        raise pickle.UnpicklingError(
            f"{path} is refused: it holds {what}, which is not a tensor, number, string or container of them, "
            f"and loading it would run that code. A trainer_state.pt the trainer wrote never holds one: this file "
            f"was replaced or written by other code. Move this checkpoint away to resume from the one before it, "
            f"or start the stage again (continue_from_checkpoint=false).") from None
