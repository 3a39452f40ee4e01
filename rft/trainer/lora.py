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

from contextlib import nullcontext

import torch

from rft.errors import ConfigError


def enabled(model_cfg) -> bool:
    lora = model_cfg.get("lora")
    return bool(lora) and (lora.rank or 0) > 0


def apply(model, lora_cfg):
    """The model with LoRA adapters on `target_modules` (PEFT), the base frozen."""
    from peft import LoraConfig, get_peft_model

    targets = lora_cfg.target_modules
    targets = targets if isinstance(targets, str) else list(targets)
    try:
        return get_peft_model(model, LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                                                target_modules=targets, bias="none"))
    except ValueError as e:  # PEFT: "Target modules ... not found in the base model"
        raise ConfigError(f"model.lora.target_modules={targets!r}: {str(e).splitlines()[0]} Give module names of "
                          f"{type(model).__name__} (e.g. q_proj, v_proj) or all-linear.") from e


def is_lora(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


def reference(model):
    """A context in which `model` computes as the reference: LoRA's base (adapters off)."""
    return model.disable_adapter() if is_lora(model) else nullcontext()


def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """The base model's state dict with each adapted weight replaced by W + delta (new tensors;
    the others are the model's own, not copied)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas = {}
    with torch.no_grad():
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer):
                for adapter in module.active_adapters:
                    d = module.get_delta_weight(adapter)
                    deltas[name] = d if name not in deltas else deltas[name] + d
        out = {}
        for key, value in base.state_dict().items():
            if ".lora_" in key:
                continue
            key = key.replace(".base_layer.", ".")
            module_name, _, leaf = key.rpartition(".")
            if leaf == "weight" and module_name in deltas:
                value = (value + deltas[module_name].to(value.dtype)).detach()
            out[key] = value
    return out


def adapter_state_dict(model) -> dict[str, torch.Tensor]:
    """The adapters' parameters alone (what the optimizer trains and a checkpoint's adapter/ holds)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def load_adapter(model, state: dict) -> None:
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, state)
    unexpected = getattr(result, "unexpected_keys", None) or []
    if unexpected:
        raise RuntimeError(f"the adapter does not match the model's LoRA config: unexpected {unexpected[:5]}")
