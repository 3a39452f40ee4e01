"""trainer=fsdp2: the trainer as `ranks` data-parallel processes with torch FSDP2 (fully_shard).

Every rank gets the whole batch (advantages need whole groups, and it is small next to the
model) and trains on its share of each mini-batch:

    rows per rank  = ceil(mini-batch rows / ranks), rounded up to whole preference pairs
    rank r's rows  = a contiguous block of the mini-batch; the last ranks may get fewer or none
    passes         = the same count on every rank (FSDP gathers and reduces inside each forward
                     and backward, so a rank that skipped one would hang the others): a rank
                     short of rows runs "dead" micro-batches whose loss is multiplied by 0

Each rank's loss is its rows' part of the one-process loss (normalised by the whole
mini-batch's counts), times the number of ranks because FSDP averages gradients; so one
update equals trainer=torch's up to float summation order (tests/test_fsdp.py checks it).

Weights leave the trainer whole: syncs, checkpoints (`hf/` in Hugging Face format and a full
optimizer state, loadable by trainer=torch too) gather them on rank 0. A fingerprint adds up
each rank's shard sums instead of gathering anything.

With LoRA (model.lora.rank > 0) the shards hold the frozen base and the adapters side by side,
and the optimizer the adapters alone. What leaves is trainer=torch's: the merged model, which
rank 0 computes from the gathered state (rft.trainer.lora.merged_state_dict), its fingerprint
included (a shard of W cannot be merged without the whole A); checkpoints keep the adapter in
PEFT's format, hf/ only `with_hf`.

The ranks meet through a TCPStore that the driver hosts (`start_trainer`), so no rank has to
be started before the others to learn an address.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import torch

from rft.models import local_device, torch_dtype
from rft.sync.weights import fingerprint, format_fingerprint, hf_tensors, weight_sums
from rft.trainer import lora, micro_batches
from rft.trainer.state import check_state, load_state, reading, save_state, weights_file
from rft.trainer.trainer import Trainer, _lengths


class FSDPTrainer(Trainer):
    def __init__(self, cfg, plan, init_path, rank: int, world: int, store_address: tuple[str, int],
                 resume: str | None = None):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.rank, self.world = rank, world
        cuda = local_device(cfg.cluster).type == "cuda"
        if dist.is_initialized():  # cluster=inline: the previous stage's trainer lived in this process
            dist.destroy_process_group()
        host, port = store_address
        timeout = datetime.timedelta(seconds=cfg.synchronizer.sync_timeout)
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        # on GPUs, gloo beside NCCL for CPU tensors: with param_offload (or the critic's offload)
        # the shards and their gradients are on the CPU, and the gradient clip's norm and the
        # gathers of them are collectives of CPU tensors, which NCCL refuses
        dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo", store=dist.PrefixStore("fsdp", store),
                                rank=rank, world_size=world, timeout=timeout)
        self.mesh = init_device_mesh("cuda" if cuda else "cpu", (world,))
        self.loss_scale = world
        super().__init__(cfg, plan, init_path, resume)

    # ------------------------------------------------------------------ data-parallel hooks

    def _wrap(self, model, offload: bool = False):
        """Shard each transformer block (transformers names them in _no_split_modules), then the rest.
        `offload` (the reference's and critic's own switches) or trainer.param_offload: in CPU memory."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        # trainer.param_offload: the shards of weights and gradients live in CPU memory, copied to
        # the device block by block for each forward and backward; the optimizer steps on the CPU
        cuda = self.device.type == "cuda"
        offload = CPUOffloadPolicy(pin_memory=cuda) if offload or self.cfg.trainer.param_offload else OffloadPolicy()
        # trainer.fp32_master_weights: each block's float32 shards are gathered cast to model.dtype
        # for its compute, and the gradients reduced in float32 into the float32 shards
        mixed = MixedPrecisionPolicy()
        if self.master_dtype is not None:
            mixed = MixedPrecisionPolicy(param_dtype=torch_dtype(self.cfg.model.dtype), reduce_dtype=torch.float32)
        # (the critic's ValueModel holds the transformer as .base: its blocks are named there)
        blocks = {b for m in model.modules() for b in (getattr(m, "_no_split_modules", None) or [])}
        if lora.is_lora(model):  # (a block's frozen base and trained adapters shard together)
            lora.check_fsdp(model)  # a LoRA layer the merge cannot read is refused before any step
        for module in model.modules():
            if type(module).__name__ in blocks:
                fully_shard(module, mesh=self.mesh, offload_policy=offload, mp_policy=mixed)
        fully_shard(model, mesh=self.mesh, offload_policy=offload, mp_policy=mixed)
        return model

    def _optimizer_step(self, optimizer) -> None:
        """trainer.optimizer_offload (without param_offload, which steps on the CPU anyway): Adam's
        moments wait in CPU memory between steps, on the device only for the step itself."""
        if not (self.cfg.trainer.optimizer_offload and not self.cfg.trainer.param_offload):
            return optimizer.step()
        _move_optimizer_state(optimizer, self.device)
        optimizer.step()
        _move_optimizer_state(optimizer, torch.device("cpu"))

    def _my_micro_batches(self, full, start: int, end: int):
        unit, lengths = self._unit, _lengths(full)
        if self.cfg.trainer.use_dynamic_bsz:  # shares of about equal token counts
            blocks = micro_batches.balanced_blocks(lengths, start, end, self.world, unit)
        else:
            blocks = [micro_batches.fixed_share(start, end, r, self.world, unit) for r in range(self.world)]
        # every rank knows every rank's micro-batches (each holds the whole batch): as many passes as the most
        mine = [self._micro_batches(lengths, a, b) for a, b in blocks]
        for i in range(max(len(m) for m in mine)):
            if i < len(mine[self.rank]):
                yield *mine[self.rank][i], True
            else:  # a dead pass on real rows, weighted 0
                yield start, min(start + unit, end), False

    def _all_sum(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(t)
        return t

    def close(self) -> None:
        """Leave the ranks' process group (before the driver's store goes away)."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ whole weights

    def _full_state(self) -> dict:
        """The whole model's state dict on rank 0 (CPU), {} on the others; every rank must call it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def _state_dict(self) -> dict[str, torch.Tensor]:
        """`_full_state`, with LoRA merged (on rank 0; every rank must call it)."""
        sd = self._full_state()
        return lora.merged_state_dict(self.model, sd) if sd and lora.is_lora(self.model) else sd

    def weights(self) -> dict[str, torch.Tensor]:
        # a copy (a snapshot must not change with the next step): one rank on a CPU gathers its own
        # parameters, not copies of them
        own = {p.to_local().data_ptr() for p in self.model.parameters()}
        return {k: v.clone() if v.data_ptr() in own else v for k, v in self._engine_state().items()}

    def _sync_state(self) -> dict[str, torch.Tensor]:
        return self._engine_state()

    def _adapter_state(self) -> dict[str, torch.Tensor]:
        sd = self._full_state()  # every rank gathers; rank 0 holds the result
        return lora.adapter_state_dict(self.model, sd) if sd else {}

    def fingerprint(self) -> str:
        if lora.is_lora(self.model):  # rank 0's is the group's answer (the others': of nothing)
            return fingerprint(t for _, t in self._named_parameters())
        # a cast is element by element: the shards' cast sums add up to the whole cast model's
        shards = self._served(dict(self.model.named_parameters()))
        count, total = weight_sums([p.to_local() for p in shards.values()])
        # the sum in two 32-bit halves: the ranks' halves add up without overflowing an int64
        parts = torch.tensor([count, total & 0xFFFFFFFF, total >> 32], dtype=torch.int64, device=self.device)
        count, low, high = self._all_sum(parts).tolist()
        return format_fingerprint(count, low + (high << 32))

    def collective_address(self):
        return super().collective_address() if self.rank == 0 else None

    def collective_init(self, address: str, port: int, world: int, rank: int) -> None:
        # only rank 0 is in the trainer -> explorers group
        if self.rank == 0:
            super().collective_init(address, port, world, rank)

    def collective_send(self) -> None:
        from rft.sync.weights import broadcast

        with self._timed("sync_send_s"):
            if lora.is_lora(self.model):  # merged on rank 0 from one gather, in the manifest's order
                merged = [t for _, t in self._named_parameters()]
                if self.rank == 0:
                    broadcast(self.group, (t.to(self.device) for t in merged))
                return
            for _, p in sorted(self.model.named_parameters()):
                full = p.full_tensor()  # every rank takes part in the gather
                if self.rank == 0:  # (with param_offload the shards, so the gathered whole, are on the CPU)
                    broadcast(self.group, [t.to(self.device) for t in self._served({"": full}).values()])

    def save_weights(self, path: str) -> str:
        from safetensors.torch import save_file

        from rft.sync.weights import for_safetensors

        with self._timed("sync_send_s"):
            sd = self._engine_state()
            if self.rank == 0:
                save_file(for_safetensors(sd), path + ".tmp")
                os.replace(path + ".tmp", path)
        return self.sync_fingerprint()

    def save(self, directory: str, with_hf: bool = True) -> None:
        """The same checkpoint as trainer=torch's (whole model, whole optimizer state), written by
        rank 0. With LoRA: the adapter (adapter/), and hf/ (merged) only `with_hf`."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        sd = self._full_state()
        whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
        optim = get_optimizer_state_dict(self.model, self.optimizer, options=whole)
        critic = None
        if self.critic is not None:  # gathered like the actor's, in trainer=torch's form
            critic = {"model": get_model_state_dict(self.critic.model, options=whole),
                      "optimizer": get_optimizer_state_dict(self.critic.model, self.critic.optimizer, options=whole)}
        if self.rank != 0:
            return
        d = Path(directory)
        hf_model = self.model
        if lora.is_lora(self.model):  # PEFT picks the adapter's tensors out of the gathered state
            self.model.save_pretrained(d / "adapter", state_dict=sd)
            hf_model, sd = self.model.get_base_model(), (lora.merged_state_dict(self.model, sd) if with_hf else None)
        if sd is not None:
            hf_model.save_pretrained(d / "hf", state_dict=sd)
            self.tokenizer.save_pretrained(d / "hf")
        save_state({"optimizer": optim, "scheduler": self.scheduler.state_dict(), "version": self.version,
                    "rng": torch.get_rng_state(), "critic": critic}, d / "trainer_state.pt")

    def load(self, directory: str) -> None:
        """Every rank reads the whole checkpoint (a filesystem all nodes share) and keeps its shard."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        d = Path(directory)
        # the state first: a damaged file then leaves the model as it was (the runner falls back)
        state = load_state(d / "trainer_state.pt")
        # its shapes before anything loads (a resealed state of another model's), as trainer=torch's
        check_state(state, self.optimizer, self.scheduler, d / "trainer_state.pt",
                    names={id(p): n for n, p in self.model.named_parameters()}, critic=self.critic)
        if lora.is_lora(self.model):  # the adapter alone: the base is the stage's starting model
            from safetensors.torch import load_file

            with reading(d / "adapter" / "adapter_model.safetensors") as path:
                sd = lora.adapter_for_model(self.model, load_file(path))
        else:  # (none where the ranks built the policy from this checkpoint's hf/: Trainer's `resume`)
            with reading(weights_file(d / "hf")):
                sd = {} if self._weights_built_from(d) else dict(hf_tensors(d / "hf"))
        # tied weights are saved once (save_pretrained): strict=False lets the tie fill them (with
        # LoRA, leaves the base as it is)
        if sd:
            set_model_state_dict(self.model, sd, options=StateDictOptions(full_state_dict=True, strict=False))
        set_optimizer_state_dict(self.model, self.optimizer, _by_name(state["optimizer"], self.model, self.optimizer),
                                 options=StateDictOptions(full_state_dict=True))
        if self.critic is not None:
            c = state["critic"]
            set_model_state_dict(self.critic.model, c["model"], options=StateDictOptions(full_state_dict=True))
            set_optimizer_state_dict(self.critic.model, self.critic.optimizer,
                                     _by_name(c["optimizer"], self.critic.model, self.critic.optimizer),
                                     options=StateDictOptions(full_state_dict=True))
            # torch.distributed.checkpoint gives the groups' betas back as a list: torch's tuple again, as
            # a fresh optimizer has it, so a resumed run's checkpoints are the uninterrupted run's to the
            # bit (the policy's groups get theirs from the config: _configured_optimizer)
            for group in self.critic.optimizer.param_groups:
                group["betas"] = tuple(group["betas"])
        self.scheduler.load_state_dict(state["scheduler"])
        self._configured_optimizer()
        self.version = state["version"]
        self._fp_cache = None  # other weights under what may be the same version number
        torch.set_rng_state(state["rng"])


def _move_optimizer_state(optimizer, device) -> None:
    for state in optimizer.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and k != "step":  # Adam keeps `step` on the CPU
                state[k] = v.to(device, non_blocking=True)


def _by_name(optim: dict, model, optimizer) -> dict:
    """An optimizer state dict keyed by parameter name, as torch.distributed.checkpoint loads it.

    trainer=torch saves torch's own form, parameters numbered in the order the optimizer holds
    them (with LoRA the adapters alone, not every parameter); a checkpoint written by FSDP ranks
    is keyed by name already; torch loads both alike."""
    groups = optim["param_groups"]
    if all(isinstance(i, str) for g in groups for i in g["params"]):
        return optim
    name = {id(p): n for n, p in model.named_parameters()}
    names = [name[id(p)] for g in optimizer.param_groups for p in g["params"]]
    return {
        "state": {names[i]: v for i, v in optim["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in groups],
    }
