"""What a stage's checkpoints will take on disk, told before it starts (the dry run's `checkpoints`
row, and a warning at the start of a run whose kept checkpoints would not fit where they go).

A checkpoint (rft/runtime/saving.py) holds `hf/`, the policy's weights as the trainer keeps them
(float32 with trainer.fp32_master_weights, else model.dtype), unless trainer.save_hf_checkpoint
says otherwise, and `trainer_state.pt`: Adam's two moments of every trained parameter (the LoRA
adapters alone with model.lora; the adapters themselves in `adapter/`), and PPO's critic with its
moments. A stage saves every trainer.save_interval steps and at its last; trainer.max_ckpt_to_keep
keeps the newest N (null: all). The stage cache publishes by hard links: no second copy.

Planning only: the parameter count is rft.plan.memory's (the model's config.json or
model.architecture), nothing is loaded; the free space is that of the nearest existing folder of
the stage's directory.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

from rft.plan.memory import dtype_bytes, lora_parameters, shape_of


def saves(total_steps: int, interval: int) -> int:
    """The steps of 1..total_steps at which a stage saves: each multiple of `interval`, and the last."""
    return total_steps // interval + (total_steps % interval != 0)


def checkpoint_parts(cfg, plan) -> tuple[int, int] | None:
    """(bytes of hf/, bytes of the resumable state: trainer_state.pt and adapter/) of one
    checkpoint, or None where the model's shape is not known here."""
    shape, _ = shape_of(cfg.model)
    if shape is None:
        return None
    n, t = shape.parameters, cfg.trainer
    kept = 4 if t.fp32_master_weights else dtype_bytes(cfg.model.dtype)  # bytes a parameter, as trained
    lora = cfg.model.lora
    trained = lora_parameters(shape, lora) if lora.rank else n
    state = 2 * trained * kept + (trained * kept if lora.rank else 0)  # Adam's moments; the adapters
    if plan.needs.critic:  # its weights and moments (the policy's shape: rft.plan.memory's estimate too)
        state += 3 * n * kept
    return n * kept, state


def describe_disk(cfg, plan, stage_dir: Path) -> tuple[str, str | None]:
    """(the dry run's `checkpoints` row, a warning when the kept checkpoints do not fit in the free
    space where they go, or None)."""
    if cfg.mode == "explore":
        return "none: mode=explore saves its place (state.json), no weights", None
    parts = checkpoint_parts(cfg, plan)
    t = cfg.trainer
    n = saves(plan.total_steps, t.save_interval)
    kept = min(t.max_ckpt_to_keep, n) if t.max_ckpt_to_keep else n
    # an interval past the stage saves at its last step only: "every 1000 steps" named a save never reached
    when = (f"at the last step, {plan.total_steps}: trainer.save_interval={t.save_interval} is past the stage's "
            f"{plan.total_steps} steps" if t.save_interval > plan.total_steps else None)
    if parts is None:
        return (f"{n} save{'s' * (n != 1)} ({when or f'every {t.save_interval} steps and the last'}), {kept} kept; "
                f"size not known here (set model.architecture, the model's config.json numbers)", None)
    hf, state = parts
    hf_kept = {"always": kept, "last": 1, "never": 0}.get(str(t.save_hf_checkpoint), kept)
    total = kept * state + hf_kept * hf
    free = shutil.disk_usage(_existing(stage_dir)).free
    when = when or f"every {t.save_interval} steps, trainer.save_interval, and the last"
    text = (f"{n} save{'s' * (n != 1)} ({when}), {kept} kept "
            f"(trainer.max_ckpt_to_keep): ~{_gb(hf + state)} each (hf/ {_gb(hf)} + trainer state {_gb(state)}), "
            f"~{_gb(total)} in all; {_gb(free)} free there now")
    if total <= free:
        return text, None
    return text, (f"the stage's kept checkpoints (~{_gb(total)}) would not fit in the {_gb(free)} free under "
                  f"{_existing(stage_dir)}; keep fewer (trainer.max_ckpt_to_keep), save less often "
                  f"(trainer.save_interval), or write elsewhere (checkpoint_root_dir)")


# the rate the Slurm check assumes a checkpoint is written at (a login node cannot measure the
# compute nodes' filesystem; ~1 GB/s is a shared filesystem's usual order)
SAVE_BYTES_PER_S = 1e9


def slow_save(cfg, plan, signal_delay_s, margin_s: float) -> str | None:
    """The warning for a stage on Slurm whose save at a preemption or time-limit signal, and the
    `margin_s` the requeue keeps (rft.runtime.preemption), would take more than half of
    hydra.launcher.signal_delay_s (the rest is for the step in progress), or None. Such a save is
    cut at Slurm's stop and the requeued job resumes from an older checkpoint: up to
    trainer.save_interval steps trained again, which at a large model's size is hours."""
    parts = checkpoint_parts(cfg, plan)
    if parts is None or cfg.mode == "explore" or signal_delay_s is None:
        return None
    hf, state = parts
    # a save before the last step holds hf/ only with save_hf_checkpoint=always (rft/runtime/saving.py)
    nbytes = state + (hf if str(cfg.trainer.save_hf_checkpoint) == "always" else 0)
    need_s = nbytes / SAVE_BYTES_PER_S + margin_s
    if need_s <= float(signal_delay_s) / 2:
        return None
    enough = 60 * math.ceil(2 * need_s / 60)
    title = cfg.stage_name or cfg.algorithm.algorithm_type
    return (f"stage {title}: its checkpoint is ~{_gb(nbytes)}, whose save takes ~{need_s - margin_s:.0f} s "
            f"at ~1 GB/s (an assumed rate); with the {margin_s:.0f} s rft keeps for the requeue that is more "
            f"than half of hydra.launcher.signal_delay_s={signal_delay_s}, the warning Slurm sends before a job's time "
            f"limit (the step in progress needs the rest). A save cut at Slurm's stop costs the requeued job the steps "
            f"since its newest whole checkpoint (up to trainer.save_interval={cfg.trainer.save_interval}). Set "
            f"hydra.launcher.signal_delay_s={enough} or more (README: Sweeps, Slurm and multi-node Ray).")


def _existing(path: Path) -> Path:
    path = Path(path).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:,.1f} GB" if nbytes >= 10**8 else f"{nbytes / 1e6:,.1f} MB"
