"""The trainer: the policy, its optimizer, and one RL step of updates from a batch of experiences.

One `train_step` = prepare -> update -> metrics, each a method below:
  1. `_prepare`: collate the experiences; log-probs of the current weights ("old", no grad; not
     recomputed when they equal the update's own, see `_old_is_current`) and, when the algorithm
     needs it, of the reference model; the off-policy correction
     (rft.algorithms.off_policy); the KL penalty on the reward (rft.algorithms.shaping); the
     critic's values; the advantages (ADVANTAGE_FNS[algorithm.advantage_fn]).
  2. `_update`: for each of ppo_epochs, for each mini-batch: the critic's update, then the
     policy's: gradients accumulated over micro-batches, each micro-batch loss normalised by the
     whole mini-batch's counts (`agg_loss`), clip, step. The per-token loss is the policy loss
     times its rollout IS weight (`algorithm.rollout_is`, rft.algorithms.rollout_is) plus the
     optional terms the config turns on (`self.terms`: KL, behaviour weights, entropy), and
     algorithm=mix's SFT loss.
  3. `_metrics`.
trainer=fsdp2 (rft.trainer.fsdp.FSDPTrainer) runs the same step; it overrides only the data-parallel hooks.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import get_scheduler

from rft.algorithms import ADVANTAGE_FNS, KL_FNS, POLICY_LOSS_FNS, off_policy, rollout_is, shaping, with_args
from rft.algorithms.advantages import gae_returns
from rft.algorithms.aggregation import agg_loss
from rft.data.experience import WHERE, Experience, batch_record, collate
from rft.models import (
    enable_gradient_checkpointing,
    load_hf_weights,
    load_model,
    load_tokenizer,
    local_device,
    peak_flops,
)
from rft.sync.weights import SharedWriter, fingerprint, for_safetensors, node_id, one_thread, shared_fits, to_arrays
from rft.trainer import lora, micro_batches
from rft.trainer.critic import Critic, explained_variance
from rft.trainer.logprobs import can_share_prompts, one_row, prompt_units, token_logprobs

log = logging.getLogger(__name__)


@dataclass
class Step:
    """One train_step's batch and what is derived from it, then its running sums."""
    full: dict  # collated tensors: input_ids, attention_mask, response_mask, sampling params
    mask: torch.Tensor  # response_mask [n, L-1]: the tokens the loss counts
    n: int
    old_logp: torch.Tensor | None = None  # None: the update's own detached log-probs (_old_is_current)
    engine_logp: torch.Tensor | None = None  # the explorer's sampling log-probs, [n, L-1]
    engine_mask: torch.Tensor | None = None  # the tokens that have one, in fresh experiences
    is_mask: torch.Tensor | None = None  # the tokens algorithm.rollout_is weights (rollout_is.weighted_rows)
    is_rows: bool = False  # whether any row has such tokens
    is_max: float = 0.0  # the largest rollout IS ratio the update saw
    trained: int = 0  # the actor update forwards rows 0..trained-1 (the rest: advantages all 0)
    exps: list = field(default_factory=list)  # the experiences, in the order of the rows
    correct_in_update: bool = False  # the off-policy correction is applied in _actor_update
    ref_logp: torch.Tensor | None = None
    behavior_w: torch.Tensor | None = None
    batch: dict = field(default_factory=dict)  # what advantage functions read
    kl_penalty: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    adv: torch.Tensor | None = None
    # the same keys on every data-parallel rank (_metrics sums them over the ranks in one tensor)
    sums: dict = field(default_factory=lambda: {"loss/policy": 0.0, "actor/entropy": 0.0, "actor/kl": 0.0,
                                                "rollout/logprob_diff": 0.0, "rollout_is/weight_sum": 0.0,
                                                "rollout_is/capped": 0.0, "rollout_is/tokens": 0.0})
    loss_metric_sums: dict = field(default_factory=dict)  # the policy loss's metrics, token sums
    loss_metric_counts: dict = field(default_factory=dict)  # the counts of those given as (sum, count)
    critic_sums: dict = field(default_factory=dict)
    grad_norms: list = field(default_factory=list)


def _engine_logp(exps: list[Experience], mask: torch.Tensor, version: int, algo):
    """The sampling log-probs the explorer stored, placed like the trainer's [n, L-1]; the mask of
    the tokens that have one in fresh (staleness 0) experiences: what the trainer's own log-probs
    of the same weights are compared with (rollout/logprob_diff); and the mask of the tokens
    algorithm.rollout_is weights (the fresh ones, and the stale ones when off_policy_correction
    leaves their old log-probs alone: rft.algorithms.rollout_is.weighted_rows)."""
    logp, have = torch.zeros_like(mask), torch.zeros_like(mask)
    # every row's entries in one indexed write (a write per row cost ~2 ms for 128 rows)
    rows, cols, values = [], [], []
    for i, e in enumerate(exps):
        if e.logprobs:
            start = e.prompt_length - 1
            rows += [i] * len(e.logprobs)
            cols += range(start, start + len(e.logprobs))
            values += e.logprobs
    if values:
        where = (torch.tensor(rows, device=mask.device), torch.tensor(cols, device=mask.device))
        logp[where] = torch.tensor(values, dtype=mask.dtype, device=mask.device)
        have[where] = 1
    # tokens the loss counts (a workflow's environment turns are masked out, their entries unused)
    have = have * (mask > 0)
    fresh = [off_policy.staleness(e.policy_version, version) == 0 for e in exps]
    weighted = rollout_is.weighted_rows(exps, version, algo)
    rows = lambda flags: torch.tensor(flags, dtype=mask.dtype, device=mask.device)[:, None]  # noqa: E731
    return logp, have * rows(fresh), have * rows(weighted)


def _zero_advantage_rows_last(step: "Step") -> None:
    """Put the rows whose advantages are all 0 last, in every per-row tensor of the step, and set
    step.trained to the number of the others (the order of rows changes no sum in the update)."""
    signal = (step.adv != 0).any(-1)
    order = torch.cat([signal.nonzero().flatten(), (~signal).nonzero().flatten()])
    step.trained = int(signal.sum())
    if step.trained == step.n:
        return
    pick = lambda t: None if t is None else t.index_select(0, order)  # noqa: E731
    step.full = {k: pick(v) for k, v in step.full.items()}
    step.batch = {k: pick(v) for k, v in step.batch.items()}
    step.mask = step.full["response_mask"]
    step.exps = [step.exps[i] for i in order.tolist()]
    for name in ("ref_logp", "behavior_w", "engine_logp", "engine_mask", "is_mask", "kl_penalty", "returns", "adv"):
        setattr(step, name, pick(getattr(step, name)))


# the tokens a step's forwards computed, summed over the ranks (see _forward and _perf_metrics):
# with and without a gradient (a shared prompt counted once), the rows' tokens a shared prompt
# saved computing again (trainer.share_prompts), and what the forwards paid for (padding included)
WORK = ("perf/grad_tokens", "perf/nograd_tokens", "perf/shared_tokens", "perf/computed_tokens")


def _lengths(full) -> list[int]:
    """Each row's token count (rows are right-padded)."""
    return full["attention_mask"].sum(-1).tolist()


def _abs_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return ((a - b).abs() * mask).sum().item()


class _Rows:
    """rows(t): rows s..e of a [n, L-1] tensor, trimmed to this micro-batch's length L."""

    def __init__(self, s: int, e: int, L: int):
        self.s, self.e, self.L = s, e, L

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.s:self.e, : self.L - 1]


def _add(sums: dict, values: dict) -> None:
    for k, v in values.items():
        sums[k] = sums.get(k, 0.0) + v


def _add_loss_metrics(step: "Step", metrics: dict) -> None:
    """A micro-batch's policy-loss metrics: token sums, or (sum, count) pairs (rft.algorithms.losses)."""
    for k, v in metrics.items():
        if isinstance(v, tuple):
            v, count = v
            step.loss_metric_counts[k] = step.loss_metric_counts.get(k, 0.0) + count
        step.loss_metric_sums[k] = step.loss_metric_sums.get(k, 0.0) + v


class Trainer:
    """trainer_strategy=torch: one process. rft.trainer.fsdp.FSDPTrainer is its data-parallel subclass;
    the hooks it overrides are marked "(data parallel)" below."""

    def __init__(self, cfg, plan, init_path: str | None = None):
        self.cfg = cfg
        self.plan = plan
        self._shared = None  # memory sync's shared-memory segment (sync_payload), made when first used
        torch.manual_seed(cfg.seed)
        # denormal floats (tiny Adam moments, decayed weights) make CPU math many times slower
        torch.set_flush_denormal(True)
        algo = cfg.algorithm
        self.device = local_device(cfg.cluster)
        self.tokenizer = load_tokenizer(cfg.model)
        model = load_model(cfg.model, init_path).to(self.device)
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
            self.ref_model = self._wrap(ref)
        # names are looked up once, here; the update below never branches on them
        self.advantage_fn = with_args(ADVANTAGE_FNS, algo.advantage_fn, algo.advantage_args, "algorithm.advantage_args")
        self.policy_loss_fn = with_args(POLICY_LOSS_FNS, algo.policy_loss_fn, algo.args, "algorithm.args")
        self.critic = None
        if plan.needs.critic:
            self.critic = Critic(cfg, os.path.expanduser(cfg.model.critic_model_path or init_path or cfg.model.model_path),
                                 self.device, wrap=self._wrap)
        # a stage that trains from a dataset (plan.input_kind) reads it here, where the tokenizer
        # is: the driver then imports neither transformers nor torch. A bad row is a ConfigError
        # naming it (rft.runtime.actors.not_started reports it as one through Ray)
        self.dataset = None
        if plan.input_kind == "dataset":
            from rft.data.readers import DatasetReader

            self.dataset = DatasetReader(cfg.buffer.trainer_input.experience_buffer, self.tokenizer,
                                         cfg.model.max_prompt_tokens, cfg.model.max_response_tokens, cfg.seed)
        self.sft_reader = None
        if algo.sft_loss_weight > 0:
            from rft.data.readers import DatasetReader

            buf_cfg, where = plan.sft_data  # the plan resolved and checked it
            self.sft_reader = DatasetReader(buf_cfg, self.tokenizer, cfg.model.max_prompt_tokens,
                                            cfg.model.max_response_tokens, cfg.seed, where=where)
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
        # a loss that imitates given tokens (sft, dpo) is never weighted (its Needs.imitation)
        self.rollout_is_mode = "none" if POLICY_LOSS_FNS.info(algo.policy_loss_fn).imitation else str(algo.rollout_is)
        # the per-token loss terms this config turns on, composed in this order by _actor_update:
        # the behaviour weight first, so that it weights the policy loss alone (as rollout_is does)
        self.terms = [t for t, on in [(self._behavior_term, True), (self._kl_term, self.kl_fn is not None),
                                      (self._entropy_term, bool(algo.entropy_coef))] if on]
        opt = algo.optimizer
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],  # with LoRA: the adapters
            lr=opt.lr, betas=tuple(opt.betas), weight_decay=opt.weight_decay
        )
        total = plan.total_steps * plan.optimizer_steps_per_step
        if opt.warmup_style == "cosine":
            self.scheduler = get_scheduler(
                "cosine_with_min_lr", self.optimizer, opt.warmup_steps, total,
                scheduler_specific_kwargs={"min_lr_rate": opt.min_lr_ratio},
            )
        else:
            self.scheduler = get_scheduler("constant_with_warmup", self.optimizer, opt.warmup_steps, total)
        self.version = 0  # number of RL steps trained
        self._work = dict.fromkeys(WORK, 0.0)  # this step's tokens forwarded (see _forward)
        self._snapshots: dict[int, tuple[dict, str]] = {}  # version -> (weights, fingerprint)

    # ------------------------------------------------------------------ data-parallel hooks

    def _wrap(self, model):
        """(data parallel) The model as this strategy trains it: as loaded for one process."""
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

    # ------------------------------------------------------------------ one step

    # rows that stay in one micro-batch (and on one rank): DPO's preference pairs
    @property
    def _unit(self) -> int:
        return 2 if self.cfg.algorithm.policy_loss_fn == "dpo" else 1

    def _micro_batches(self, lengths: list[int], start: int, end: int) -> list[tuple[int, int]]:
        """Rows start..end as micro-batches (s, e): a fixed row count, or a token budget
        (trainer.use_dynamic_bsz; rft.trainer.micro_batches)."""
        t = self.cfg.trainer
        if t.use_dynamic_bsz:
            return micro_batches.token_budget(lengths, start, end, self.plan.max_token_len_per_gpu,
                                              t.use_remove_padding, self._unit)
        return micro_batches.fixed(start, end, self.plan.micro_batch_size)

    def _forward(self, model, full, s, e):
        # trim the right padding shared by this micro-batch's rows
        lengths = _lengths(full)[s:e]
        L = max(lengths)
        t = self.cfg.trainer
        share = t.use_remove_padding and t.share_prompts and can_share_prompts(model)
        prompts = full["prompt_length"][s:e].tolist() if share else None
        units = prompts and prompt_units(full["input_ids"][s:e], lengths, prompts)
        sequences = units[1] if units else lengths  # what is computed: a shared prompt once
        grad = "grad" if torch.is_grad_enabled() else "nograd"
        self._work[f"perf/{grad}_tokens"] += sum(sequences)
        self._work["perf/shared_tokens"] += sum(lengths) - sum(sequences)
        if t.use_remove_padding:  # the packed rows' unused ends are the padding
            rows, width = micro_batches.packed_shape(sequences, one_row(model))
            self._work["perf/computed_tokens"] += rows * width
        else:
            self._work["perf/computed_tokens"] += len(lengths) * L
        # each row's log-probs under the distribution it was sampled from (its sampling params)
        return token_logprobs(model, full["input_ids"][s:e, :L], full["attention_mask"][s:e, :L],
                              full["temperature"][s:e], full["top_p"][s:e], full["top_k"][s:e],
                              with_entropy_grad=bool(self.cfg.algorithm.entropy_coef),
                              packed=t.use_remove_padding, chunk_size=t.logprob_chunk_size,
                              fp32_head=self.cfg.model.fp32_lm_head, prompt_lengths=prompts), L

    def _old_is_current(self, stale_fix: bool) -> bool:
        """Whether the "old" log-probs (the current weights', before this step's updates) are the
        update's own: with one optimizer step per RL step (one mini-batch, one epoch) the weights
        do not move before the update's forward, so its detached log-probs are the old ones (the
        ratio is exactly 1), and the forward that would recompute them is skipped. Not when a KL
        penalty on the reward needs them before the advantages. A stale experience's correction
        (`stale_fix`) is then applied in the update, micro-batch by micro-batch, in one process
        (data-parallel ranks keep the forward: the correction's metrics are over every rank's rows)."""
        return (self.plan.optimizer_steps_per_step == 1 and self.kl_penalty_fn is None
                and (not stale_fix or self.plan.dp_size == 1))

    def train_dataset_step(self, step: int, size: int) -> tuple[dict, dict]:
        """Step `step` of a stage that trains from a dataset: its `size` experiences (a function of
        (seed, step): rft.data.readers.DatasetReader.batch), trained. Returns the step's metrics and what
        it trained on (rft.data.experience.batch_record, for batches.jsonl)."""
        batch = self.dataset.batch(step - 1, size)
        metrics = {f"train/truncated_{k}s": sum(bool(e.info.get(f"{k}_truncated")) for e in batch)
                   for k in ("prompt", "response")}
        metrics.update(self.train_step(batch))
        return metrics, batch_record(step, batch)

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
        step = self._prepare(exps)
        self._update(step)
        self.version += 1
        step.sums.update(self._work)
        return self._metrics(step, time.perf_counter() - t0)

    # ------------------------------------------------------------------ 1. prepare

    def _prepare(self, exps: list[Experience]) -> "Step":
        """Collate; log-probs of the current weights ("old") and of the reference; the off-policy
        correction; reward shaping (KL penalty); the critic's values; the advantages."""
        algo = self.cfg.algorithm
        full = {k: v.to(self.device) for k, v in collate(exps, self.tokenizer.pad_token_id).items()}
        step = Step(full=full, mask=full["response_mask"], n=len(exps), exps=list(exps))
        step.engine_logp, step.engine_mask, step.is_mask = _engine_logp(exps, step.mask, self.version, algo)
        step.is_rows = any(rollout_is.weighted_rows(exps, self.version, algo))
        # stale experiences whose algorithm.off_policy_correction replaces or reweights old log-probs
        stale_fix = algo.off_policy_correction != "none" and any(
            off_policy.staleness(e.policy_version, self.version) > 0 and e.logprobs for e in exps)
        step.old_logp, step.ref_logp = self._old_and_ref_logp(full, step.mask, old=not self._old_is_current(stale_fix))
        if step.old_logp is None and stale_fix:
            step.correct_in_update = True
            if algo.off_policy_correction == "decoupled":
                step.behavior_w = torch.ones_like(step.mask)  # filled by _actor_update
        if step.old_logp is not None:
            step.behavior_w = off_policy.correct(exps, step.old_logp, step.mask, self.version, algo)
            # every rank holds the whole batch's log-probs here and _metrics sums over ranks:
            # each adds its 1/ranks share (loss_scale is the number of ranks)
            step.sums["rollout/logprob_diff"] = _abs_diff(step.old_logp, step.engine_logp, step.engine_mask) / self.loss_scale
        groups = {g: i for i, g in enumerate(dict.fromkeys(e.group_id for e in exps))}
        step.batch = {
            "rewards": torch.tensor([e.reward for e in exps], dtype=torch.float32, device=self.device),
            "group_index": torch.tensor([groups[e.group_id] for e in exps], device=self.device),
            "response_mask": step.mask,
        }
        if self.kl_penalty_fn is not None:
            step.kl_penalty = shaping.kl_penalty(self.kl_penalty_fn, step.old_logp, step.ref_logp, step.mask)
            step.batch["rewards"] = step.batch["rewards"] - algo.kl_penalty_coef * step.kl_penalty
        if self.critic is not None:
            step.batch["values"] = self.critic.values(full, list(self._my_micro_batches(full, 0, step.n)), self._all_sum)
            _, step.returns = gae_returns(step.batch["rewards"], step.batch["values"], step.mask, algo.gamma, algo.lam)
        step.adv = self.advantage_fn(step.batch, algo)
        step.trained = step.n
        # stale rows too (their correction applied in the update): a zero-advantage row adds 0 to
        # the loss and the gradient whatever its ratio; the ratio's metrics (approx KL, clip
        # fractions, behaviour weights) are then over the rows the update forwarded
        if self.skip_zero_advantage and step.old_logp is None:
            _zero_advantage_rows_last(step)
        return step

    def _old_and_ref_logp(self, full, mask, old: bool = True):
        """Log-probs of the current weights (unless `old` is False: None) and, when needed, of the
        reference model; no grad."""
        roles = [(self.model, nullcontext, old),
                 (self.ref_model or self.model, lambda: lora.reference(self.model), self.has_reference)]
        out = [(m, ctx, torch.zeros_like(mask)) for m, ctx, on in roles if on]
        with torch.no_grad():
            for s, e, live in self._my_micro_batches(full, 0, mask.shape[0]):
                for model, ctx, logp in out:
                    with ctx():
                        (lp, _), L = self._forward(model, full, s, e)
                    if live:
                        logp[s:e, : L - 1] = lp
        # every rank computed its own rows: the sum over ranks is the whole batch's
        sums = iter([self._all_sum(logp) for _, _, logp in out])
        return next(sums) if old else None, next(sums) if self.has_reference else None

    # ------------------------------------------------------------------ 2. update

    def _update(self, step: "Step") -> None:
        """For each of ppo_epochs, for each mini-batch: the critic's update, then the policy's
        (gradients accumulated over micro-batches, normalised by the whole mini-batch's counts)."""
        # PPO's critic warm-up: the first critic_warmup steps train only the critic
        train_actor = self.critic is None or self.version >= self.cfg.algorithm.critic_warmup
        mini = self.plan.mini_batch_size
        for _ in range(self.cfg.trainer.ppo_epochs):
            for m0 in range(0, step.n, mini):
                m1 = min(m0 + mini, step.n)
                num_tokens = int(step.mask[m0:m1].sum())
                if self.critic is not None:
                    cm = self.critic.update(step.full, step.returns, step.batch["values"],
                                            list(self._my_micro_batches(step.full, m0, m1)), num_tokens, self.loss_scale,
                                            self._optimizer_step)
                    _add(step.critic_sums, cm)
                if train_actor:
                    self._actor_update(step, m0, m1, num_tokens)

    def _actor_update(self, step: "Step", m0: int, m1: int, num_tokens: int) -> None:
        algo = self.cfg.algorithm
        self.optimizer.zero_grad(set_to_none=True)
        # rows from step.trained on have advantages all 0 and were set aside (_prepare); they
        # still count in the normaliser (m1 - m0 rows, num_tokens)
        for s, e, live in self._my_micro_batches(step.full, m0, min(m1, step.trained)):
            (logp, entropy), L = self._forward(self.model, step.full, s, e)
            rows = _Rows(s, e, L)
            m = rows(step.mask) * live
            if step.old_logp is None:  # the update's own are the old ones (_old_is_current)
                old_logp = logp.detach()
                step.sums["rollout/logprob_diff"] += _abs_diff(old_logp, rows(step.engine_logp), rows(step.engine_mask) * live)
                if step.correct_in_update:  # what _prepare's correction does, on these rows
                    old_logp = old_logp.clone()
                    w = off_policy.correct(step.exps[s:e], old_logp, rows(step.mask), self.version, algo)
                    if w is not None:
                        step.behavior_w[s:e, : L - 1] = w
            else:
                old_logp = rows(step.old_logp)
            loss_mat, pm = self.policy_loss_fn(logp, {
                "old_logp": old_logp,
                "advantages": rows(step.adv),
                "response_mask": m,
                "ref_logp": None if step.ref_logp is None else rows(step.ref_logp),
            }, algo)
            _add_loss_metrics(step, pm)
            loss_mat = self._rollout_is_weight(loss_mat, old_logp, rows, live, step)
            for term in self.terms:
                loss_mat = term(loss_mat, logp, entropy, m, rows, step)
            loss = agg_loss(loss_mat, m, algo.loss_agg_mode, m1 - m0, num_tokens, self.cfg.model.max_response_tokens)
            (loss * self.loss_scale).backward()
            step.sums["loss/policy"] += loss.item()
            step.sums["actor/entropy"] += (entropy.detach() * m).sum().item()
        if self.sft_reader is not None:
            step.sums["loss/sft"] = step.sums.get("loss/sft", 0.0) + self._sft_backward()
        if step.trained == 0 and self.sft_reader is None:
            # no row had a signal, so no backward ran: still a step (weight decay, Adam's moments
            # move), with the zero gradient that backward would have given the trained weights
            for p in self.model.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.trainer.grad_clip)
        # sharded parameters give a DTensor: the norm over every rank's shards
        step.grad_norms.append((norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item())
        self._optimizer_step(self.optimizer)
        self.scheduler.step()

    def _rollout_is_weight(self, loss, old_logp, rows, live, step):
        """algorithm.rollout_is: the policy loss of each weighted token (step.is_mask) times its
        weight, from r = exp(old_logp - sampling log-prob): min(r, cap) (tis) or r, 0 beyond the
        cap (mis); see rft.algorithms.rollout_is. Applied here, to the policy loss alone, before
        the optional terms (the KL to the reference and the entropy bonus are not weighted), for
        every loss of the registry. `old_logp` is the policy loss's own: the old forward's, or
        on-policy (_old_is_current) the update's own detached log-probs, which are the old ones on
        its first and only pass; the rows a stale correction changed are not weighted. A weight
        is finite, so a row of zero advantages still adds nothing (skip_zero_advantage). Also
        with rollout_is=none, the sums of the metrics."""
        if not step.is_rows:  # no sampling log-probs to compare with (dataset rows): weight 1
            return loss
        w, stats = rollout_is.weights(old_logp, rows(step.engine_logp), rows(step.is_mask) * live,
                                      self.rollout_is_mode, self.cfg.algorithm.rollout_is_cap)
        step.is_max = max(step.is_max, stats.pop("rollout_is/max"))
        _add(step.sums, stats)
        return loss if w is None else loss * w

    # the optional terms of the per-token loss, each `term(loss, logp, entropy, mask, rows, step)`

    def _kl_term(self, loss, logp, entropy, m, rows, step):
        """algorithm.kl_loss_fn: + kl_loss_coef x KL(policy || reference) per token."""
        kl = self.kl_fn(logp, rows(step.ref_logp))
        step.sums["actor/kl"] += (kl.detach() * m).sum().item()
        return loss + self.cfg.algorithm.kl_loss_coef * kl

    def _behavior_term(self, loss, logp, entropy, m, rows, step):
        """off_policy_correction=decoupled: each token's policy loss weighted by pi_prox / pi_behav
        (not the KL to the reference nor the entropy bonus, which come after it)."""
        return loss if step.behavior_w is None else loss * rows(step.behavior_w)

    def _entropy_term(self, loss, logp, entropy, m, rows, step):
        """algorithm.entropy_coef: - entropy_coef x entropy (a bonus for exploring)."""
        return loss - self.cfg.algorithm.entropy_coef * entropy

    # ------------------------------------------------------------------ 3. metrics

    def _metrics(self, step: "Step", elapsed: float) -> dict:
        algo, mask, adv = self.cfg.algorithm, step.mask, step.adv
        # each rank summed its own rows' parts
        sums, pm_sums, pm_counts, c_sums = step.sums, step.loss_metric_sums, step.loss_metric_counts, step.critic_sums
        names = [(d, k) for d in (sums, pm_sums, pm_counts, c_sums) for k in sorted(d)]
        total = self._all_sum(torch.tensor([d[k] for d, k in names], dtype=torch.float64, device=self.device)).tolist()
        for (d, k), v in zip(names, total):
            d[k] = v
        updates = max(len(step.grad_norms), 1)
        total_tokens = mask.sum().item() * self.cfg.trainer.ppo_epochs
        trained_tokens = mask[:step.trained].sum().item() * self.cfg.trainer.ppo_epochs
        metrics = {
            "loss/policy": sums["loss/policy"] / updates,
            "actor/grad_norm": sum(step.grad_norms) / updates,
            "actor/lr": self.scheduler.get_last_lr()[0],
            "advantage/mean": (adv.sum() / mask.sum()).item(),
            "advantage/std": adv[mask.bool()].std().item() if mask.sum() > 1 else 0.0,
            "advantage/abs_mean": ((adv.abs() * mask).sum() / mask.sum()).item(),
            "train/experiences": step.n,
            "train/tokens_per_s": total_tokens / elapsed,
            # inside the trainer's process: the runtime benchmark's "model compute"
            "timing/train_compute_s": elapsed,
        }
        metrics.update(self._perf_metrics(sums, elapsed))
        # the loss's ratio metrics, over the tokens the update computed (a row set aside for a
        # zero advantage has none; on-policy its ratio is 1 and would add 0 anyway); those given
        # as (sum, count) over their own count (none counted: not logged)
        for k, v in pm_sums.items():
            if k not in pm_counts:
                metrics[k] = v / max(trained_tokens, 1)
            elif pm_counts[k]:
                metrics[k] = v / pm_counts[k]
        if trained_tokens:
            # over the tokens the update computed (rows set aside for a zero advantage are not)
            metrics["actor/entropy"] = sums["actor/entropy"] / trained_tokens
        metrics["train/zero_advantage_rows_skipped"] = step.n - step.trained
        engine_tokens = step.engine_mask[:step.trained].sum().item()
        if engine_tokens:
            # |trainer log-prob - engine log-prob| per token of the fresh experiences: the two
            # computations of one distribution should agree (a large value: a sampler, dtype or
            # weight-sync mismatch)
            metrics["rollout/logprob_diff"] = sums["rollout/logprob_diff"] / engine_tokens
        if sums["rollout_is/tokens"]:  # the same on every rank (summed over them)
            # algorithm.rollout_is, over the weighted tokens of every update pass (like the other
            # actor/* metrics, an average over the step): the uncapped r = pi_trainer / pi_engine
            n_is = sums["rollout_is/tokens"]
            metrics["actor/tis_weight_mean"] = sums["rollout_is/weight_sum"] / n_is
            metrics["actor/tis_weight_max"] = self._all_max(
                torch.tensor(step.is_max, dtype=torch.float64, device=self.device)).item()
            metrics["actor/tis_capped_frac"] = sums["rollout_is/capped"] / n_is
        if self.kl_fn is not None:
            metrics["actor/kl"] = sums["actor/kl"] / total_tokens
        if step.kl_penalty is not None:
            metrics["reward/kl_penalty"] = step.kl_penalty.mean().item()
        if step.behavior_w is not None and step.trained:
            w, m = step.behavior_w[:step.trained], mask[:step.trained]  # the rows the update forwarded
            metrics["actor/behavior_weight_mean"] = ((w * m).sum() / m.sum().clamp(min=1)).item()
            metrics["actor/behavior_weight_capped_frac"] = (
                ((w >= algo.behavior_weight_cap) * m).sum() / (m * (w != 1.0)).sum().clamp(min=1)).item()
        if "loss/sft" in sums:
            metrics["loss/sft"] = sums["loss/sft"] / updates
        if self.critic is not None:
            metrics.update(self._critic_metrics(step, total_tokens))
        return metrics

    def _perf_metrics(self, sums: dict, elapsed: float) -> dict:
        """Throughput of the step's policy forwards (every rank's; the critic's not counted):
        the rows' tokens per second, the share of computed positions that were padding, the share
        of the rows' tokens a shared prompt saved computing (trainer.share_prompts), the model FLOPs
        (2 x parameters per token forward, 4 more with a backward; attention's own FLOPs left
        out, as in the usual MFU) against the devices' peak where it is known, and the peak
        memory of the busiest rank."""
        computed = sums["perf/grad_tokens"] + sums["perf/nograd_tokens"]  # a shared prompt once
        real = computed + sums["perf/shared_tokens"]  # the rows' tokens
        out = {"perf/trainer_tokens_per_s": real / elapsed,
               "perf/padding_frac": 1.0 - computed / sums["perf/computed_tokens"] if sums["perf/computed_tokens"] else 0.0,
               "perf/shared_prompt_frac": sums["perf/shared_tokens"] / real if real else 0.0}
        flops = self.n_params * (2 * sums["perf/nograd_tokens"] + 6 * sums["perf/grad_tokens"])
        out["perf/tflops"] = flops / elapsed / 1e12
        peak = peak_flops(self.device)
        if peak:
            out["perf/mfu"] = flops / elapsed / (peak * self.loss_scale)
        if self.device.type == "cuda":
            mem = torch.cuda.max_memory_allocated(self.device)
        else:  # the process's peak resident set (Linux reports KiB)
            import resource

            mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        out["perf/max_memory_gb"] = self._all_max(torch.tensor(float(mem), dtype=torch.float64,
                                                               device=self.device)).item() / 2**30
        return out

    def _critic_metrics(self, step: "Step", total_tokens: float) -> dict:
        values, mask = step.batch["values"], step.mask
        return {
            "critic/value_loss": step.critic_sums["critic/value_loss"] / self.plan.optimizer_steps_per_step,
            "critic/vf_clip_frac": step.critic_sums["critic/vf_clip_tokens"] / total_tokens,
            # how much of the return variance the values (before this step's updates) explained
            "critic/explained_variance": explained_variance(step.returns, values, mask),
            "critic/values_mean": (values.sum() / mask.sum()).item(),
        }

    def _sft_backward(self) -> float:
        """mix: add sft_loss_weight x (token-mean -log p) of this step's auxiliary rows to the gradient."""
        algo = self.cfg.algorithm
        exps = self.sft_reader.batch(self.version, algo.sft_batch_size)
        aux = {k: v.to(self.device) for k, v in collate(exps, self.tokenizer.pad_token_id).items()}
        num_tokens = int(aux["response_mask"].sum())
        total = 0.0
        for s, e, live in self._my_micro_batches(aux, 0, len(exps)):
            (logp, _), L = self._forward(self.model, aux, s, e)
            m = aux["response_mask"][s:e, : L - 1] * live
            loss = algo.sft_loss_weight * agg_loss(-logp, m, "token-mean", len(exps), num_tokens, 1)
            (loss * self.loss_scale).backward()
            total += loss.item()
        return total

    # ------------------------------------------------------------------ weights and checkpoints

    def weights(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the weights (what memory sync sends)."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self._state_dict().items()}

    def _state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights as the engines and checkpoints know them: with LoRA, merged."""
        return lora.merged_state_dict(self.model) if lora.is_lora(self.model) else self.model.state_dict()

    def _named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of each distinct weight (tied ones once), sorted: with LoRA, merged."""
        if not lora.is_lora(self.model):
            return sorted(self.model.named_parameters())
        merged = self._state_dict()
        names = {n.replace(".base_layer.", ".") for n, _ in self.model.get_base_model().named_parameters() if ".lora_" not in n}
        return sorted((n, t) for n, t in merged.items() if n in names)

    def fingerprint(self) -> str:
        return fingerprint(t for _, t in self._named_parameters())

    def _sync_state(self) -> dict[str, torch.Tensor]:
        """(data parallel) The weights memory sync sends: the model's own tensors, not copied (the
        object store copies them once; in-process, the explorer's load does)."""
        return self._state_dict()

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
            with one_thread():
                return self._shared.write(state), self.fingerprint() if with_fingerprint else None
        return to_arrays(state), self.fingerprint() if with_fingerprint else None

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

        self.group = open_group(address, port, world, rank, self.cfg.synchronizer.sync_timeout)

    def collective_send(self) -> None:
        from rft.sync.weights import broadcast

        broadcast(self.group, [p.data for _, p in self._named_parameters()])

    def ping(self) -> int:
        return os.getpid()

    def get_version(self) -> int:
        return self.version

    def skip_step(self) -> None:
        """A step whose experiences were all dropped (too stale) still counts as a step."""
        self.version += 1

    def save_weights(self, path: str) -> str:
        """Write the weights as one safetensors file (for checkpoint sync); returns the fingerprint."""
        from safetensors.torch import save_file

        sd = {k: v.detach().cpu() for k, v in self._state_dict().items()}
        save_file(for_safetensors(sd), path + ".tmp")
        os.replace(path + ".tmp", path)
        return self.fingerprint()

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
        torch.save(
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
        if lora.is_lora(self.model):
            from safetensors.torch import load_file

            lora.load_adapter(self.model, load_file(d / "adapter" / "adapter_model.safetensors"))
        else:
            load_hf_weights(self.model, d / "hf")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self._configured_optimizer()
        self.version = state["version"]
        torch.set_rng_state(state["rng"])
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])

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

    # ------------------------------------------------------------------ snapshots for restarted explorers

    def keep_snapshots(self, version: int, keep: list[int]) -> None:
        """Keep a CPU copy of the current weights as `version` (see rft.runtime.runner StageRun._serve),
        unless one is kept already (the same version's weights), and drop those not in `keep`."""
        if version not in self._snapshots:
            self._snapshots[version] = (self.weights(), self.fingerprint())
        for v in [v for v in self._snapshots if v != version and v not in keep]:
            del self._snapshots[v]

    def snapshot_weights(self, version: int) -> dict[str, torch.Tensor]:
        return self._snapshots[version][0]

    def snapshot_fingerprint(self, version: int) -> str:
        return self._snapshots[version][1]


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
