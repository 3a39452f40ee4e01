"""What leaves the trainer as weights, as the synchronizers (rft.sync.weights) ask for them:
CPU copies and state dicts (with LoRA, merged), the fingerprint, memory sync's payload (arrays or a
shared-memory segment), the collective send, one safetensors file for checkpoint sync, and the
snapshots kept for explorers that restart.

`WeightsMixin` reads the Trainer's model (rft.trainer.trainer); trainer=fsdp2
(rft.trainer.fsdp.FSDPTrainer) overrides the methods that must gather the shards.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

import torch

from rft.config import lora_adapter_sync
from rft.models import torch_dtype
from rft.sync.weights import SharedWriter, fingerprint, for_safetensors, node_id, one_thread, shared_fits, to_arrays
from rft.trainer import lora


class WeightsMixin:
    """The Trainer's weights as the synchronizers read them (see the module's docstring). Its own
    state, set by Trainer.__init__: `_shared` (memory sync's segment) and `_snapshots`."""

    def weights(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the weights (what memory sync sends)."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self._engine_state().items()}

    def _engine_state(self) -> dict[str, torch.Tensor]:
        """What the engines load: the LoRA adapters alone (model.lora.sync=adapter: PEFT's adapter
        file keys, served by vLLM as a LoRA request), else the whole model as `_served` gives it."""
        if lora_adapter_sync(self.cfg.model):
            return self._adapter_state()
        return self._served(self._state_dict())

    def _adapter_state(self) -> dict[str, torch.Tensor]:
        """(data parallel) The LoRA adapters' tensors under PEFT's adapter-file keys."""
        return {k: v.detach() for k, v in lora.adapter_state_dict(self.model).items()}

    def _state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights as checkpoints keep them: with LoRA, merged."""
        return lora.merged_state_dict(self.model) if lora.is_lora(self.model) else self.model.state_dict()

    def _served(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The weights as the engines get them: with float32 master weights (trainer.fp32_master_weights),
        cast to model.dtype, as FSDP2 casts them for the trainer's own forward (the same rounding)."""
        if self.master_dtype is None:
            return state
        dtype, cast = torch_dtype(self.cfg.model.dtype), {}
        for v in state.values():  # tied weights (one tensor under two names) stay one tensor
            if v.is_floating_point() and id(v) not in cast:
                cast[id(v)] = v.to(dtype)
        return {k: cast.get(id(v), v) for k, v in state.items()}

    def _named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of each distinct weight (tied ones once), sorted, as the engines get
        them: with LoRA, merged."""
        if not lora.is_lora(self.model):
            return sorted(self._served(dict(self.model.named_parameters())).items())
        merged = self._served(self._state_dict())
        names = {n.replace(".base_layer.", ".") for n, _ in self.model.get_base_model().named_parameters() if ".lora_" not in n}
        return sorted((n, t) for n, t in merged.items() if n in names)

    def fingerprint(self) -> str:
        """Of the whole model (with LoRA, merged): what a checkpoint's hf/ holds."""
        return fingerprint(t for _, t in self._named_parameters())

    def engine_fingerprint(self) -> str:
        """Of what the engines load (`_engine_state`): the adapters alone with model.lora.sync=adapter."""
        if lora_adapter_sync(self.cfg.model):
            return fingerprint(self._engine_state())
        return self.fingerprint()

    @contextmanager
    def _timed(self, part: str):
        """Time one part of a sync: reported with the next step's metrics (`sync_timing`)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync_s[part] = self._sync_s.get(part, 0.0) + time.perf_counter() - t0

    def sync_timing(self) -> dict[str, float]:
        """The trainer's side of the syncs since the last call: timing/sync_send_s (the weights
        into shared memory, arrays, a file or the broadcast) and timing/sync_fingerprint_s."""
        out, self._sync_s = {f"timing/{k}": v for k, v in self._sync_s.items()}, {}
        return out

    def sync_fingerprint(self) -> str:
        """The fingerprint a sync sends with the weights (timed, as a part of the sync); kept for
        the snapshot of the same version (keep_snapshots), which would compute it again."""
        with self._timed("sync_fingerprint_s"):
            self._fp_cache = (self.version, self.engine_fingerprint())
        return self._fp_cache[1]

    def _version_fingerprint(self) -> str:
        """The weights' fingerprint, the one the last sync computed when the weights are the same
        (a train step changes the version; a load clears the cache)."""
        cached = self._fp_cache
        return cached[1] if cached is not None and cached[0] == self.version else self.engine_fingerprint()

    def _sync_state(self) -> dict[str, torch.Tensor]:
        """(data parallel) The weights memory sync sends: the model's own tensors, not copied (the
        object store copies them once; in-process, the explorer's load does)."""
        return self._engine_state()

    def sync_payload(self, shared: str | None = None, with_fingerprint: bool = True) -> tuple:
        """What memory sync sends, in one call: the weights and their fingerprint. The weights as
        numpy arrays, or with `shared` (the explorers are on this node: the segment's name prefix)
        written into this trainer's shared-memory segment, if /dev/shm has room (rft.sync.weights.SharedWeights).
        `with_fingerprint=False` (one process: the arrays are views of these tensors, which the
        explorer compares what it loaded with): None in its place."""
        state = self._sync_state()  # {} on the ranks of a data-parallel trainer other than 0
        if shared and state and shared_fits(sum(v.numel() * v.element_size() for v in state.values())):
            if self._shared is None:
                self._shared = SharedWriter(shared)
            with one_thread(), self._timed("sync_send_s"):
                weights = self._shared.write(state)
        else:
            with self._timed("sync_send_s"):
                weights = to_arrays(state)
        return weights, self.sync_fingerprint() if with_fingerprint else None

    def close_shared(self) -> None:
        if self._shared is not None:
            self._shared.close()
            self._shared = None

    def node(self) -> str:
        return node_id()

    def collective_address(self) -> tuple[str, int]:
        from rft.sync.weights import free_address

        return free_address()

    def weights_manifest(self) -> list[tuple[str, list[int], str]]:
        """(name, shape, dtype) of what collective_send sends, in order."""
        return [(n, list(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in self._named_parameters()]

    def collective_init(self, address: str, port: int, world: int, rank: int) -> None:
        from rft.sync.weights import open_group

        self.group = open_group(address, port, world, rank, self.cfg.synchronizer.sync_timeout, self.device)

    def collective_send(self) -> None:
        from rft.sync.weights import broadcast

        with self._timed("sync_send_s"):
            broadcast(self.group, [p.data for _, p in self._named_parameters()])

    def save_weights(self, path: str) -> str:
        """Write the weights as one safetensors file (for checkpoint sync); returns the fingerprint."""
        from safetensors.torch import save_file

        with self._timed("sync_send_s"):
            sd = {k: v.detach().cpu() for k, v in self._engine_state().items()}
            save_file(for_safetensors(sd), path + ".tmp")
            os.replace(path + ".tmp", path)
        return self.sync_fingerprint()

    # ------------------------------------------------------------------ snapshots for restarted explorers

    def keep_snapshots(self, version: int, keep: list[int]) -> None:
        """Keep a CPU copy of the current weights as `version` (see rft.runtime.explorers ExplorerPool._serve),
        unless one is kept already (the same version's weights), and drop those not in `keep`."""
        if version not in self._snapshots:
            self._snapshots[version] = (self.weights(), self._version_fingerprint())
        for v in [v for v in self._snapshots if v != version and v not in keep]:
            del self._snapshots[v]

    def snapshot_weights(self, version: int) -> dict[str, torch.Tensor]:
        return self._snapshots[version][0]

    def snapshot_fingerprint(self, version: int) -> str:
        return self._snapshots[version][1]
