"""LoRA (`model.lora.rank` > 0) through PEFT: the trainer trains low-rank adapters on a frozen base.

- Only the adapters' parameters train (the optimizer holds nothing else).
- The reference model is the same module with its adapters switched off (`reference()`): the
  base weights, with no second copy of the model.
- Everything that leaves the trainer (syncs, fingerprints, checkpoints' hf/) is the merged model,
  W + (alpha / rank) B A, under the base model's own parameter names, computed into new tensors
  (`merged_state_dict`): the base weights are never changed in place, so no rounding builds up
  in them over many syncs, and an engine loads it like any full model.
- Checkpoints also keep the adapter alone (`adapter/`, PEFT's format) for resume.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch

from rft.errors import ConfigError


log = logging.getLogger(__name__)


def enabled(model_cfg) -> bool:
    lora = model_cfg.get("lora")
    return bool(lora) and (lora.rank or 0) > 0


def apply(model, lora_cfg):
    """The model with LoRA adapters on `target_modules` (PEFT), the base frozen."""
    from peft import LoraConfig, get_peft_model

    targets = lora_cfg.target_modules
    targets = targets if isinstance(targets, str) else list(targets)
    try:
        peft = get_peft_model(model, LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                                                target_modules=targets, bias="none"))
    except ValueError as e:  # PEFT: "Target modules ... not found in the base model"
        raise ConfigError(f"model.lora.target_modules={targets!r}: {str(e).splitlines()[0]} Give module names of "
                          f"{type(model).__name__} (e.g. q_proj, v_proj) or all-linear.") from e
    # what the dry run's `lora` row planned, as PEFT built it (the run's log: run.log, the trainer's)
    trained, total = peft.get_nb_trainable_parameters()
    base = total - trained
    log.info("LoRA rank %d, alpha %g on %d modules: %s adapter parameters train, %.1f%% of the base model's %s "
             "(frozen)", lora_cfg.rank, lora_cfg.alpha, sum(1 for _ in _lora_layers(peft.get_base_model(), False)),
             f"{trained:,}", 100 * trained / max(base, 1), f"{base:,}")
    return peft


def is_lora(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


def reference(model):
    """A context in which `model` computes as the reference: LoRA's base (adapters off)."""
    return model.disable_adapter() if is_lora(model) else nullcontext()


def merged_state_dict(model, state: dict | None = None) -> dict[str, torch.Tensor]:
    """The base model's state dict with each adapted weight replaced by W + delta (new tensors;
    the others are the given ones, not copied).

    `state` None: the module's own tensors, each delta PEFT's own (get_delta_weight). `state`: the
    whole PeftModel's state dict gathered from trainer=fsdp2's shards, whose A and B give the deltas
    (the module's own are shards)."""
    base = model.get_base_model()
    with torch.no_grad():
        if state is None:
            state, deltas = base.state_dict(), {}
            for name, module in _lora_layers(base, linear_only=False):
                for adapter in module.active_adapters:
                    d = module.get_delta_weight(adapter)
                    deltas[name] = d if name not in deltas else deltas[name] + d
        else:
            state = _relative(model, state)
            deltas = _gathered_deltas(base, state)
        out = {}
        for key, value in state.items():
            if ".lora_" in key:
                continue
            key = key.replace(".base_layer.", ".")
            module_name, _, leaf = key.rpartition(".")
            if leaf == "weight" and module_name in deltas:
                value = (value + deltas[module_name].to(value.dtype)).detach()
            out[key] = value
    return out


def _lora_layers(base, linear_only: bool = True):
    """(name, module) of each LoRA layer of the base model. `linear_only`: a LoRA layer of another
    kind (an Embedding's) is a ConfigError, as trainer=fsdp2 merges Linear layers' adapters alone."""
    from peft.tuners.lora import Linear, LoraLayer

    for name, module in base.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if linear_only and not isinstance(module, Linear):
            raise ConfigError(
                f"model.lora.target_modules names {name} ({type(module.get_base_layer()).__name__}), but trainer=fsdp2 "
                f"merges the adapters of Linear layers only. Name linear layers alone in model.lora.target_modules "
                f"(e.g. q_proj, v_proj, or all-linear), or use trainer=torch.")
        yield name, module


def check_fsdp(model) -> None:
    """Raise the ConfigError of `_lora_layers` now, before any step, for a model trainer=fsdp2 could not merge."""
    for _ in _lora_layers(model.get_base_model()):
        pass


def _relative(model, state: dict) -> dict:
    """`state` keyed as the base model's own state dict: the PeftModel's prefix ("base_model.model.") off."""
    base = model.get_base_model()
    prefix = next(n for n, m in model.named_modules() if m is base)
    prefix = prefix + "." if prefix else ""
    return {k.removeprefix(prefix): v for k, v in state.items()}


def _gathered_deltas(base, state: dict) -> dict[str, torch.Tensor]:
    """Each LoRA layer's delta (float32) from the gathered A and B: scaling x B A, as PEFT computes it
    (get_delta_weight: in float32 on a CPU for 16-bit weights, transposed for fan_in_fan_out)."""
    deltas = {}
    for name, module in _lora_layers(base):
        for adapter in module.active_adapters:
            a, b = state[f"{name}.lora_A.{adapter}.weight"], state[f"{name}.lora_B.{adapter}.weight"]
            d = (b.float() @ a.float()) * module.scaling[adapter]
            d = d.T if module.fan_in_fan_out else d
            deltas[name] = d if name not in deltas else deltas[name] + d
    return deltas


def adapter_keys(model) -> dict[str, str]:
    """PEFT's adapter-file key -> the model's own state-dict key ("...q_proj.lora_A.weight" ->
    "...q_proj.lora_A.default.weight"), by PEFT's own naming (get_peft_model_state_dict)."""
    from peft import get_peft_model_state_dict

    own = {k: v for k, v in model.state_dict().items() if ".lora_" in k}
    name = {id(v): k for k, v in own.items()}
    return {k: name[id(v)] for k, v in get_peft_model_state_dict(model, state_dict=own).items()}


def adapter_state_dict(model, state: dict | None = None) -> dict[str, torch.Tensor]:
    """The adapters' parameters alone (what the optimizer trains and a checkpoint's adapter/ holds),
    under PEFT's adapter-file keys; from `state` (trainer=fsdp2's gathered one) when given."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, state_dict=state)


def load_adapter(model, state: dict) -> None:
    """The adapter file's tensors into `model`'s LoRA layers: every one of them, or a RuntimeError
    (PEFT loads what is there and says nothing of the rest, so an adapter file missing some or all
    of its tensors resumed with those layers as freshly made, under the saved optimizer state)."""
    from peft import set_peft_model_state_dict

    missing = [k for k in adapter_keys(model) if k not in state]
    if missing:
        raise RuntimeError(f"the adapter does not match the model's LoRA config: missing {missing[:5]}"
                           f"{f' and {len(missing) - 5} more' if len(missing) > 5 else ''}")
    result = set_peft_model_state_dict(model, state)
    unexpected = getattr(result, "unexpected_keys", None) or []
    if unexpected:
        raise RuntimeError(f"the adapter does not match the model's LoRA config: unexpected {unexpected[:5]}")


def adapter_for_model(model, state: dict) -> dict[str, torch.Tensor]:
    """An adapter file's tensors (PEFT's keys) under the model's own state-dict keys, for
    torch.distributed.checkpoint's set_model_state_dict (trainer=fsdp2's shards)."""
    keys = adapter_keys(model)
    unexpected, missing = [k for k in state if k not in keys], [k for k in keys if k not in state]
    if unexpected or missing:
        raise RuntimeError(f"the adapter does not match the model's LoRA config: unexpected {unexpected[:5]}, "
                           f"missing {missing[:5]}")
    return {keys[k]: v for k, v in state.items()}
