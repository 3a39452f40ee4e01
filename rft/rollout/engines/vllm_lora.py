"""model.lora.sync=adapter: the vLLM engine serves the trainer's LoRA adapters as a LoRA request
on the base weights it keeps, so that a sync moves the adapters' bytes alone (at rank 64 on a 7B
model ~0.3 GB in bfloat16, against 15 GB of merged weights).

Each sync's adapters are written as a PEFT adapter directory (what vLLM loads a LoRA request
from) and added to the engine under a new name and id: vLLM caches an adapter, and keys its
prefix cache, by name, so an adapter reloaded under an old name would be served stale. The
previous one is removed. `add_lora` loads it before any request uses it: an adapter vLLM cannot
serve fails there, with the engine still alive (a bad one inside `generate` kills the engine).
The fingerprint is of the tensors written, as the trainer computes it of the tensors it sent.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

from rft.errors import ConfigError
from rft.sync.weights import pid_alive

# vLLM's max_lora_rank takes these values only: the smallest one that holds model.lora.rank
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def sweep() -> None:
    """Remove the adapter directories of engines whose process is gone (killed before `close`):
    each holds its last adapter (0.3 GB at rank 64 on a 7B model)."""
    for d in Path(tempfile.gettempdir()).glob("rft-lora-*-*"):
        pid = d.name.split("-")[2]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def is_adapter(state: dict) -> bool:
    """Whether a state dict (or its names) holds LoRA adapters (PEFT's keys) rather than a model."""
    return any(".lora_A." in k or k.endswith(".lora_A.weight") for k in state)


class LoraAdapters:
    """The adapter the engine serves: its LoRA request, directory and fingerprint."""

    def __init__(self, model_cfg):
        self.lora = model_cfg.lora
        self.request, self.fingerprint, self.count = None, None, 0
        sweep()
        self.root = Path(tempfile.mkdtemp(prefix=f"rft-lora-{os.getpid()}-"))
        atexit.register(self.close)  # a process Ray kills leaves it to the next engine's sweep

    def engine_args(self) -> dict:
        rank = next((r for r in VLLM_LORA_RANKS if r >= self.lora.rank), None)
        if rank is None:
            raise ConfigError(f"model.lora.rank={self.lora.rank}: vLLM serves adapters of rank up to "
                              f"{VLLM_LORA_RANKS[-1]}. Lower model.lora.rank or set model.lora.sync=merged.")
        return dict(enable_lora=True, max_lora_rank=rank, max_loras=1)

    def serve(self, llm, state: dict) -> None:
        import torch
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        from rft.sync.weights import fingerprint

        tensors = {k: torch.as_tensor(v).contiguous() for k, v in state.items()}
        self.count += 1
        where = self.root / f"v{self.count}"
        where.mkdir()
        save_file(tensors, str(where / "adapter_model.safetensors"))
        (where / "adapter_config.json").write_text(json.dumps(self._config(tensors)))
        request = LoRARequest(f"rft-policy-{self.count}", self.count, str(where))
        try:
            llm.llm_engine.add_lora(request)
        except Exception as e:
            shutil.rmtree(where, ignore_errors=True)
            raise ConfigError(
                f"vLLM could not serve the trainer's LoRA adapters ({str(e).splitlines()[0] if str(e) else type(e).__name__}). "
                f"vLLM takes adapters on a model's linear layers (not the embeddings or the output layer): "
                f"set model.lora.target_modules to those, or model.lora.sync=merged to send merged weights.") from e
        self.drop(llm)
        self.request, self.fingerprint = request, fingerprint(tensors)

    def _config(self, tensors: dict) -> dict:
        """PEFT's adapter_config.json for these tensors: the modules are the ones they adapt (PEFT
        saves "all-linear" as the names it found)."""
        modules = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in tensors})
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.lora.rank, "lora_alpha": self.lora.alpha,
                "lora_dropout": 0.0, "bias": "none", "target_modules": modules, "fan_in_fan_out": False,
                "use_rslora": False, "use_dora": False, "modules_to_save": None}

    def drop(self, llm) -> None:
        """Stop serving the current adapter (a new one, or whole new weights, replace it)."""
        if self.request is not None:
            llm.llm_engine.remove_lora(self.request.lora_int_id)
            shutil.rmtree(self.request.lora_path, ignore_errors=True)
            self.request, self.fingerprint = None, None

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
