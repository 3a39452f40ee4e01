"""The trainer: the policy, its optimizer, and one RL step of updates from a batch of experiences.

One `train_step` = prepare -> update -> metrics:
  1. `_prepare`: the old and reference log-probs, the off-policy correction, the KL penalty on the
     reward, the critic's values, the advantages;
  2. `_update`: ppo_epochs x mini-batches, each the critic's update then the policy's (gradients
     over micro-batches, clip, step); both in rft.trainer.step;
  3. `_metrics`: in rft.trainer.metrics.
What leaves the trainer as weights (memory sync's payload, the collective send, checkpoint sync's
file, snapshots for restarted explorers) is rft.trainer.weights; its checkpoints (model, optimizer,
scheduler, RNG) rft.trainer.state. Each is a mixin of Trainer, so every method the runner and the
synchronizers call by name stays a method of the trainer actor.

This module holds what they all use: the Trainer's construction, the data-parallel hooks, how
rows are cut into micro-batches and how a model is run over them (`_forward`, the one place a
model is run, counting the tokens it computes), and the step's entry points.
trainer=fsdp2 (rft.trainer.fsdp.FSDPTrainer) runs the same step; it overrides only the data-parallel hooks
and the methods that must gather or scatter the shards (weights, checkpoints).
"""

from __future__ import annotations

import functools
import math
import os
import time
from pathlib import Path

import torch
from transformers import get_scheduler

from rft.algorithms import ADVANTAGE_FNS, KL_FNS, POLICY_LOSS_FNS, contract, rollout_is, with_args
from rft.config import colocated
from rft.data.experience import WHERE, Experience, batch_record, collate
from rft.errors import ConfigError
from rft.models import (
    enable_gradient_checkpointing,
    load_model,
    load_reward_head,
    load_teacher,
    load_tokenizer,
    local_device,
    torch_dtype,
)
from rft.trainer import lora, micro_batches
from rft.trainer.critic import Critic
from rft.trainer.logprobs import can_share_prompts, one_row, prompt_units, reward_scores, token_logprobs
from rft.trainer.metrics import WORK, MetricsMixin
from rft.trainer.state import CheckpointMixin
from rft.trainer.step import StepMixin
from rft.trainer.weights import WeightsMixin



def _held_out_pairs(cfg, tokenizer):
    """The reader of a reward model's held-out pairs (experience_buffer.eval_split; None unset).
    A split the data lacks is named by its own key: the reader's message says `split`."""
    from types import SimpleNamespace

    from rft.data.readers import DatasetReader

    eb = cfg.buffer.trainer_input.experience_buffer
    if not eb.eval_split:
        return None
    held_out = SimpleNamespace(name=f"{eb.name}_{eb.eval_split}", path=eb.path, split=eb.eval_split, format=eb.format)
    try:
        return DatasetReader(held_out, tokenizer, cfg.model.max_prompt_tokens, cfg.model.max_response_tokens, cfg.seed)
    except ConfigError as e:
        raise ConfigError(f"buffer.trainer_input.experience_buffer.eval_split={eb.eval_split!r} (the held-out pairs "
                          f"of eval/pair_accuracy): {e} Name a split the data has, or unset eval_split.") from e

def _lengths(full) -> list[int]:
    """Each row's token count (rows are right-padded)."""
    return full["attention_mask"].sum(-1).tolist()


def cosine_to_min(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """The lr factor of update `step` (from 0): transformers' cosine_with_min_lr (linear warm-up, then
    half a cosine from 1 to min_ratio at update `total`), with the progress held at 1 past `total`:
    transformers' goes on round the cosine, so a run past its planned updates saw its lr rise back
    towards lr (at 2 x total, after warm-up, lr itself). Written in transformers' order of operations:
    within the plan the lrs are its own, bit for bit."""
    if step < warmup:
        return float(step) / float(max(1, warmup))
    progress = min(1.0, float(step - warmup) / float(max(1, total - warmup)))
    factor = 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress))
    return max(0.0, factor * (1 - min_ratio) + min_ratio)


class Trainer(StepMixin, MetricsMixin, WeightsMixin, CheckpointMixin):
    """trainer_strategy=torch: one process. rft.trainer.fsdp.FSDPTrainer is its data-parallel subclass;
    the hooks it overrides are marked "(data parallel)" below.

    `resume`: the checkpoint directory a resumed stage goes on from (TrainerBackendInfo.
    builds_from_checkpoint), whose `load` must follow: the policy is read from its hf/ (the
    starting model only for LoRA's base and the reference model) and the critic is built without
    weights, its own coming with the checkpoint's trainer_state.pt."""

    def __init__(self, cfg, plan, init_path: str | None = None, resume: str | None = None):
        self.cfg = cfg
        self.plan = plan
        self._shared = None  # memory sync's shared-memory segment (sync_payload), made when first used
        self._sync_s: dict[str, float] = {}  # the parts of the syncs since the last step (sync_timing)
        self._fp_cache = None  # (version, fingerprint) of the last sync (sync_fingerprint)
        torch.manual_seed(cfg.seed)
        # denormal floats (tiny Adam moments, decayed weights) make CPU math many times slower
        torch.set_flush_denormal(True)
        algo = cfg.algorithm
        self.device = local_device(cfg.cluster)
        # trainer.fp32_master_weights: the trained weights' dtype, where it is not model.dtype
        # (the backend computes in model.dtype; what leaves for the engines is cast to it)
        compute = torch_dtype(cfg.model.dtype)
        self.master_dtype = torch.float32 if cfg.trainer.fp32_master_weights and compute != torch.float32 else None
        self.tokenizer = load_tokenizer(cfg.model)
        # in this order: the models, then the critic (its value head) draw from the seeded RNG
        self._build_models(init_path, resume)
        # names are looked up once, here; the update below never branches on them
        # (a study's own function, a dotted path, is checked at each call: rft.algorithms.contract)
        self.advantage_fn = contract.checked(ADVANTAGE_FNS, algo.advantage_fn, with_args(
            ADVANTAGE_FNS, algo.advantage_fn, algo.advantage_args, "algorithm.advantage_args"))
        self.policy_loss_fn = contract.checked(POLICY_LOSS_FNS, algo.policy_loss_fn, with_args(
            POLICY_LOSS_FNS, algo.policy_loss_fn, algo.args, "algorithm.args"))
        self.critic = None
        if plan.needs.critic:
            self.critic = Critic(cfg, os.path.expanduser(cfg.model.critic_model_path or init_path or cfg.model.model_path),
                                 self.device, wrap=lambda m: self._wrap(m, offload=cfg.trainer.critic_offload),
                                 dtype=self.master_dtype, weights=resume is None)
        self._open_datasets()
        self._compose_loss()
        self._build_optimizer()
        self.version = 0  # number of RL steps trained
        self._work = dict.fromkeys(WORK, 0.0)  # this step's tokens forwarded (see _forward)
        self._snapshots: dict[int, tuple[dict, str]] = {}  # version -> (weights, fingerprint)

    def _build_models(self, init_path: str | None, resume: str | None = None) -> None:
        """The policy (with LoRA: adapters on a frozen base) and the reference model."""
        cfg, plan = self.cfg, self.plan
        # algorithm=rm trains a scalar head on the model (Needs.reward_head) instead of its LM head
        load = (lambda m, p, d: load_reward_head(m, p, self.tokenizer, d)) if plan.needs.reward_head else load_model
        # resumed: the checkpoint's weights, read once (its `load` then skips them), not the starting
        # model's to be overwritten (at 7B 15-30 GB and minutes); with LoRA the base is the starting model
        self._built_from = None  # the checkpoint whose weights the policy holds as built
        if resume is not None and not lora.enabled(cfg.model) and (Path(resume) / "hf").is_dir():
            self._built_from = Path(resume)
        source = str(self._built_from / "hf") if self._built_from else init_path
        model = load(cfg.model, source, self.master_dtype).to(self.device)
        # for the FLOPs estimate (perf/mfu): counted before sharding, tied weights once
        self.n_params = sum(p.numel() for p in model.parameters())
        if cfg.trainer.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        if lora.enabled(cfg.model):  # adapters on a frozen base (rft/trainer/lora.py)
            model = lora.apply(model, cfg.model.lora)
        self.model = self._wrap(model)
        # the reference model: a frozen copy, or with LoRA the base itself (adapters off, no copy)
        self.ref_model = None
        self.has_reference = plan.needs.reference
        if plan.needs.reference and not lora.is_lora(self.model):
            ref = load_model(cfg.model, init_path).to(self.device)
            ref.requires_grad_(False)
            self.ref_model = self._wrap(ref, offload=cfg.trainer.ref_offload)
        # on-policy distillation's teacher (algorithm.teacher_model_path): frozen, placed like the reference
        self.teacher_model = None
        if plan.needs.teacher:
            teacher = load_teacher(cfg.model, cfg.algorithm.teacher_model_path, self.tokenizer).to(self.device)
            self.teacher_model = self._wrap(teacher, offload=cfg.trainer.ref_offload)

    def _open_datasets(self) -> None:
        """The readers of the stage's training dataset and of algorithm=mix's SFT rows, if any."""
        cfg, plan = self.cfg, self.plan
        # a stage that trains from a dataset (plan.input_kind) reads it here, where the tokenizer
        # is: the driver then imports neither transformers nor torch. A bad row is a ConfigError
        # naming it (rft.runtime.actors.not_started reports it as one through Ray)
        self.dataset = None
        if plan.input_kind == "dataset":
            from rft.data.readers import DatasetReader

            self.dataset = DatasetReader(cfg.buffer.trainer_input.experience_buffer, self.tokenizer,
                                         cfg.model.max_prompt_tokens, cfg.model.max_response_tokens, cfg.seed)
        # a reward model's held-out pairs (experience_buffer.eval_split): eval/pair_accuracy
        self.eval_pairs = _held_out_pairs(cfg, self.tokenizer) if plan.needs.reward_head else None
        self.sft_reader = None
        if cfg.algorithm.sft_loss_weight > 0:
            from rft.data.readers import DatasetReader

            buf_cfg, where = plan.sft_data  # the plan resolved and checked it
            self.sft_reader = DatasetReader(buf_cfg, self.tokenizer, cfg.model.max_prompt_tokens,
                                            cfg.model.max_response_tokens, cfg.seed, where=where)

    def _compose_loss(self) -> None:
        """The loss's functions and switches, from the algorithm's config."""
        cfg, algo = self.cfg, self.cfg.algorithm
        self.kl_fn = KL_FNS.get(algo.kl_loss_fn)
        # rows whose advantages are all 0 add nothing to an update whose ratio starts at 1 (old
        # log-probs = its own) for a loss that says so, as long as no other term (KL, entropy
        # bonus) reads them
        self.skip_zero_advantage = (cfg.trainer.skip_zero_advantage and algo.kl_loss_fn == "none"
                                    and not algo.entropy_coef
                                    and POLICY_LOSS_FNS.info(algo.policy_loss_fn).zero_at_zero_advantage)
        self.kl_penalty_fn = KL_FNS.get(algo.kl_penalty_fn)
        # algorithm.rollout_is: the weights' mode ("none" for a loss that is no policy gradient
        # over sampled tokens: the metrics are still logged)
        rollout_is.check_config(algo)
        self.rollout_is_mode = "none" if POLICY_LOSS_FNS.info(algo.policy_loss_fn).imitation else str(algo.rollout_is)
        # the per-token loss terms this config turns on, composed in this order by _actor_update:
        # the behaviour weight first, so that it weights the policy loss alone (as rollout_is does)
        self.terms = [t for t, on in [(self._behavior_term, True), (self._kl_term, self.kl_fn is not None),
                                      (self._entropy_term, bool(algo.entropy_coef)),
                                      (self._distill_term, self.teacher_model is not None and algo.distill_divergence == "jsd")]
                      if on]

    def _build_optimizer(self) -> None:
        """AdamW over the trained weights, and its learning-rate schedule over the whole plan."""
        opt, plan = self.cfg.algorithm.optimizer, self.plan
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],  # with LoRA: the adapters
            lr=opt.lr, betas=tuple(opt.betas), weight_decay=opt.weight_decay
        )
        total = plan.total_steps * plan.optimizer_steps_per_step
        if opt.warmup_style == "cosine":
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, functools.partial(
                cosine_to_min, warmup=opt.warmup_steps, total=total, min_ratio=opt.min_lr_ratio))
        else:
            self.scheduler = get_scheduler("constant_with_warmup", self.optimizer, opt.warmup_steps, total)

    # ------------------------------------------------------------------ data-parallel hooks

    def _wrap(self, model, offload: bool = False):
        """(data parallel) The model as this strategy trains it: as loaded for one process.
        `offload`: its shards in CPU memory (trainer.ref_offload, critic_offload), as with param_offload."""
        return model

    def _my_micro_batches(self, full, start: int, end: int):
        """(data parallel) This process's micro-batches of rows start..end of the collated batch
        `full`, as (s, e, live).

        One process takes them all. A data-parallel rank takes its share, padded with dead ones
        (live=False: computed, then weighted 0) so that every rank runs as many passes."""
        for s, e in self._micro_batches(_lengths(full), start, end):
            yield s, e, True

    def _optimizer_step(self, optimizer) -> None:
        """(data parallel) The optimizer's step (FSDP2 may keep its state in CPU memory between steps)."""
        optimizer.step()

    def _all_sum(self, t: torch.Tensor) -> torch.Tensor:
        """(data parallel) The sum of `t` over the ranks (each holds its rows' part)."""
        return t

    def _all_max(self, t: torch.Tensor) -> torch.Tensor:
        """(data parallel) The max of `t` over the ranks: one process holds it; ranks (a process
        group of more than one) reduce it."""
        import torch.distributed as dist

        if self.loss_scale > 1 and dist.is_available() and dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    # a rank's loss is its rows' part of the mini-batch loss; FSDP averages gradients over ranks,
    # so the loss is multiplied by the number of ranks to give the one-process gradient
    loss_scale = 1

    # ------------------------------------------------------------------ micro-batches and the forward

    # rows that stay in one micro-batch (and on one rank): an algorithm's preference pairs (DPO's),
    # as its registry entry declares them (Needs.paired), so no loss is named here
    @property
    def _unit(self) -> int:
        return 2 if self.plan.needs.paired else 1

    def _micro_batches(self, lengths: list[int], start: int, end: int) -> list[tuple[int, int]]:
        """Rows start..end as micro-batches (s, e): a fixed row count, or a token budget
        (trainer.use_dynamic_bsz; rft.trainer.micro_batches)."""
        t = self.cfg.trainer
        if t.use_dynamic_bsz:
            return micro_batches.token_budget(lengths, start, end, self.plan.max_token_len_per_gpu,
                                              t.use_remove_padding, self._unit)
        return micro_batches.fixed(start, end, self.plan.micro_batch_size)

    def _forward(self, model, full, s, e, also=None, live: bool = True):
        # trim the right padding shared by this micro-batch's rows
        lengths = _lengths(full)[s:e]
        L = max(lengths)
        t = self.cfg.trainer
        share = t.use_remove_padding and t.share_prompts and can_share_prompts(model)
        prompts = full["prompt_length"][s:e].tolist() if share else None
        units = prompts and prompt_units(full["input_ids"][s:e], lengths, prompts)
        sequences = units[1] if units else lengths  # what is computed: a shared prompt once
        grad = "grad" if torch.is_grad_enabled() else "nograd"
        # a dead pass (a data-parallel rank short of rows, its result weighted 0) computes rows that
        # another pass already counted: padding, not the rows' tokens (nor their FLOPs)
        self._work[f"perf/{grad}_tokens"] += sum(sequences) * live
        self._work["perf/shared_tokens"] += (sum(lengths) - sum(sequences)) * live
        if t.use_remove_padding:  # the packed rows' unused ends are the padding
            rows, width = micro_batches.packed_shape(sequences, one_row(model))
            self._work["perf/computed_tokens"] += rows * width
        else:
            self._work["perf/computed_tokens"] += len(lengths) * L
        if self.plan.needs.reward_head:
            return reward_scores(model, full["input_ids"][s:e, :L], full["attention_mask"][s:e, :L]), L
        # each row's log-probs under the distribution it was sampled from (its sampling params)
        return token_logprobs(model, full["input_ids"][s:e, :L], full["attention_mask"][s:e, :L],
                              full["temperature"][s:e], full["top_p"][s:e], full["top_k"][s:e],
                              with_entropy_grad=bool(self.cfg.algorithm.entropy_coef),
                              packed=t.use_remove_padding, chunk_size=t.logprob_chunk_size,
                              fp32_head=self.cfg.model.fp32_lm_head, prompt_lengths=prompts,
                              # the loss and the metrics read the response positions alone (response_mask)
                              first=full["prompt_length"][s:e] - 1, also=also), L

    # ------------------------------------------------------------------ the step's entry points

    def train_dataset_step(self, step: int, size: int) -> tuple[dict, dict]:
        """Step `step` of a stage that trains from a dataset: its `size` experiences (a function of
        (seed, step): rft.data.readers.DatasetReader.batch), trained. Returns the step's metrics and what
        it trained on (rft.data.experience.batch_record, for batches.jsonl)."""
        batch = self.dataset.batch(step - 1, size)
        metrics = {f"train/truncated_{k}s": sum(bool(e.info.get(f"{k}_truncated")) for e in batch)
                   for k in ("prompt", "response")}
        metrics.update(self.train_step(batch))
        if step % self.cfg.explorer.eval_interval == 0 or step == self.plan.total_steps:
            metrics.update(self.pair_eval())
        return metrics, batch_record(step, batch)

    def pair_eval(self) -> dict:
        """eval/pair_accuracy on the held-out pairs (experience_buffer.eval_split); none without them."""
        return {} if self.eval_pairs is None else {"eval/pair_accuracy": self.pair_accuracy(self.eval_pairs.items)}

    def pair_accuracy(self, pairs: list[list[Experience]]) -> float:
        """The share of (chosen, rejected) pairs whose chosen response the reward model scores higher."""
        rows = [e for pair in pairs for e in pair]
        full = {k: v.to(self.device) for k, v in collate(rows, self.tokenizer.pad_token_id).items()}
        scores = torch.zeros(len(rows), device=self.device)
        with torch.no_grad():
            for s, e, live in self._my_micro_batches(full, 0, len(rows)):
                (out, _), L = self._forward(self.model, full, s, e, live=live)
                if live:
                    scores[s:e] = out.sum(-1)  # one score per row, the rest of the row 0
        scores = self._all_sum(scores)
        return (scores[0::2] > scores[1::2]).float().mean().item()

    def token_budget_warnings(self) -> list[str]:
        """A sentence when the training dataset's first prompts or responses are longer than the
        model's token budgets (they will be cut); the explorer checks the tasksets."""
        if self.dataset is None:
            return []
        from rft.data.readers import budget_report

        text = budget_report(self.cfg.buffer.trainer_input.experience_buffer, self.tokenizer, self.cfg.model, True, WHERE)
        return [text] if text else []

    def train_step(self, exps: list[Experience]) -> dict:
        """One RL step: prepare the batch -> update (ppo_epochs x mini-batches) -> metrics."""
        t0 = time.perf_counter()
        self._work = dict.fromkeys(WORK, 0.0)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        # a reward model on the groups' pairs (algorithm.rm_pairs=groups): its accuracy on pairs it
        # has not learned from yet, this step's before its update; with one optimizer step a step
        # the loss's own rm/accuracy is that (its forward precedes the step), without a forward more
        online = self.plan.needs.reward_head and self.plan.input_kind == "rollouts"
        several = self.plan.optimizer_steps_per_step > 1
        before = self.pair_accuracy(list(zip(exps[0::2], exps[1::2]))) if online and several else None
        step = self._prepare(exps)
        self._update(step)
        self.version += 1
        step.sums.update(self._work)
        metrics = {**self._metrics(step, time.perf_counter() - t0), **self.sync_timing()}
        if online:
            metrics["rm/online_accuracy"] = metrics["rm/accuracy"] if before is None else before
        if self.device.type == "cuda" and colocated(self.cfg):
            # the engine on this GPU wakes next: the allocator's cached blocks (this step's
            # activations) go back to the driver, else vLLM could not take its share again
            torch.cuda.empty_cache()
        return metrics

    def ping(self) -> int:
        return os.getpid()

    def get_version(self) -> int:
        return self.version

    def skip_step(self) -> None:
        """A step whose experiences were all dropped (too stale) still counts as a step."""
        self.version += 1
