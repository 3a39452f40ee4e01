"""One RL step's work on the batch, as the Trainer runs it (rft.trainer.trainer):

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

`StepMixin` holds these methods apart from the Trainer's construction and remote surface; it
reads what Trainer.__init__ builds (model, ref_model, critic, optimizer, scheduler, the
resolved functions, the readers) and calls the Trainer's data-parallel hooks and `_forward`.
"""

from __future__ import annotations

import logging
import math
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from rft.algorithms import distill, off_policy, rollout_is, shaping
from rft.algorithms.advantages import gae_returns
from rft.algorithms.aggregation import agg_loss, masked
from rft.data.experience import Experience, collate
from rft.errors import RunError
from rft.trainer import lora


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
    teacher_logp: torch.Tensor | None = None  # on-policy distillation's teacher, [n, L-1]
    # distill_divergence=jsd: the teacher's top tokens, "top_logp" and "top_ids" [n, L-1, k] and the
    # log of the mass outside them, "top_rest" [n, L-1, 1]; and the student's of the same in the
    # micro-batch the update is on ("at_logp", "at_rest", the term's)
    teacher_top: dict | None = None
    student_top: dict | None = None
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
    critic_updates: int = 0  # the critic's optimizer steps this step ran (the same on every rank)
    grad_norms: list = field(default_factory=list)
    skipped: int = 0  # policy updates whose gradient was not finite, so not applied (StepMixin._apply)
    # the learning rate each applied policy update took: the scheduler's own lr after the step is
    # the next update's (a warm-up's step 1 read 2e-4 where its updates took 0 and 1e-4)
    lrs: list = field(default_factory=list)


log = logging.getLogger(__name__)

# steps in a row in which every policy update had a gradient that was not finite, after which the
# run stops: it would go on without learning (the weights stay as they were), to exit 0 at its end
MAX_NONFINITE_STEPS = 3


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
    # per token: a partial rollout holds tokens of several versions (Experience.token_versions)
    fresh = off_policy.fresh_tokens(exps, version, mask)
    # rollout_is.weighted_rows, token by token
    weighted = off_policy.fresh_tokens(exps, version, mask, at_most=True) if algo.off_policy_correction != "none" \
        else torch.ones_like(mask)
    return logp, have * fresh, have * weighted


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
    if step.teacher_top is not None:
        step.teacher_top = {k: pick(v) for k, v in step.teacher_top.items()}
    for name in ("ref_logp", "teacher_logp", "behavior_w", "engine_logp", "engine_mask", "is_mask", "kl_penalty", "returns", "adv"):
        setattr(step, name, pick(getattr(step, name)))


def _abs_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return masked((a - b).abs(), mask).sum().item()


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


class StepMixin:
    """The Trainer's prepare and update (see the module's docstring)."""

    def _old_is_current(self, stale_fix: bool) -> bool:
        """Whether the "old" log-probs (the current weights', before this step's updates) are the
        update's own: with one optimizer step per RL step (one mini-batch, one epoch) the weights
        do not move before the update's forward, so its detached log-probs are the old ones (the
        ratio is exactly 1), and the forward that would recompute them is skipped. Not when a KL
        penalty on the reward needs them before the advantages. A stale experience's correction
        (`stale_fix`) is then applied in the update, micro-batch by micro-batch, in one process
        (data-parallel ranks keep the forward: the correction's metrics are over every rank's rows)."""
        return (self.plan.optimizer_steps_per_step == 1 and self.kl_penalty_fn is None
                and self.teacher_model is None  # distillation reads the student's log-probs first
                and (not stale_fix or self.plan.dp_size == 1))

    # ------------------------------------------------------------------ 1. prepare

    def _prepare(self, exps: list[Experience]) -> "Step":
        """Collate; log-probs of the current weights ("old") and of the reference; the off-policy
        correction; reward shaping (KL penalty); the critic's values; the advantages."""
        algo = self.cfg.algorithm
        full = {k: v.to(self.device) for k, v in collate(exps, self.tokenizer.pad_token_id).items()}
        step = Step(full=full, mask=full["response_mask"], n=len(exps), exps=list(exps))
        step.engine_logp, step.engine_mask, step.is_mask = _engine_logp(exps, step.mask, self.version, algo)
        # (a partial rollout's fresh tokens may be weighted where its row, by its oldest token, is not)
        step.is_rows = any(rollout_is.weighted_rows(exps, self.version, algo)) or any(e.token_versions for e in exps)
        # stale experiences whose algorithm.off_policy_correction replaces or reweights old log-probs
        stale_fix = algo.off_policy_correction != "none" and any(
            off_policy.staleness(e.policy_version, self.version) > 0 and e.logprobs for e in exps)
        jsd = self.teacher_model is not None and algo.distill_divergence == "jsd"
        step.teacher_top = {"top": algo.distill_top_k} if jsd else None
        if jsd:  # the same keys on every rank (_metrics sums them over the ranks)
            step.sums["distill/jsd"] = 0.0
        step.old_logp, step.ref_logp, step.teacher_logp = self._old_and_ref_logp(
            full, step.mask, old=not self._old_is_current(stale_fix), top=step.teacher_top)
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
            # float64, as the reward function gave them: float32 would merge rewards closer than
            # its spacing (0.0625 at 1e6), and the advantage functions work in float64
            "rewards": torch.tensor([e.reward for e in exps], dtype=torch.float64, device=self.device),
            "group_index": torch.tensor([groups[e.group_id] for e in exps], device=self.device),
            "response_mask": step.mask,
        }
        if self.kl_penalty_fn is not None:
            step.kl_penalty = shaping.kl_penalty(self.kl_penalty_fn, step.old_logp, step.ref_logp, step.mask)
            step.batch["rewards"] = step.batch["rewards"] - algo.kl_penalty_coef * step.kl_penalty
        if self.critic is not None:
            step.batch["values"] = self.critic.values(full, list(self._my_micro_batches(full, 0, step.n)), self._all_sum)
            _, returns = gae_returns(step.batch["rewards"], step.batch["values"], step.mask, algo.gamma, algo.lam)
            step.returns = returns.to(step.mask.dtype)
        # in the dtype of the log-probs the loss weights with them
        step.adv = self.advantage_fn(step.batch, algo).to(step.mask.dtype)
        if step.teacher_logp is not None and not jsd:  # algorithm.distill_coef (rft/algorithms/distill.py)
            step.adv = step.adv + algo.distill_coef * distill.distill_advantage(step.teacher_logp, step.old_logp, step.mask)
        step.trained = step.n
        # stale rows too (their correction applied in the update): a zero-advantage row adds 0 to
        # the loss and the gradient whatever its ratio; the ratio's metrics (approx KL, clip
        # fractions, behaviour weights) are then over the rows the update forwarded
        if self.skip_zero_advantage and step.old_logp is None:
            _zero_advantage_rows_last(step)
        return step

    def _old_and_ref_logp(self, full, mask, old: bool = True, top: dict | None = None):
        """Log-probs of the current weights (unless `old` is False: None) and, when needed, of the
        reference model and of the distillation teacher; no grad. All on the batch's own token ids.
        `top` ({"top": k}, distill_divergence=jsd) is filled with the teacher's k most likely tokens
        at each position: "top_logp", "top_ids" [n, L-1, k] and "top_rest" [n, L-1, 1]."""
        roles = [(self.model, nullcontext, old),
                 (self.ref_model or self.model, lambda: lora.reference(self.model), self.has_reference),
                 (self.teacher_model, nullcontext, self.teacher_model is not None)]
        out = [(m, ctx, torch.zeros_like(mask)) for m, ctx, on in roles if on]
        k = top.pop("top") if top is not None else 0
        if k:
            top.update(top_logp=mask.new_zeros(mask.shape + (k,)), top_ids=mask.new_zeros(mask.shape + (k,), dtype=torch.long),
                       top_rest=mask.new_zeros(mask.shape + (1,)))
        with torch.no_grad():
            for s, e, live in self._my_micro_batches(full, 0, mask.shape[0]):
                for model, ctx, logp in out:
                    # the teacher's top tokens among the tokenizer's (a padded embedding's extra rows
                    # are ids the student may have no logit for)
                    also = {"top": k, "below": len(self.tokenizer)} if k and model is self.teacher_model else None
                    with ctx():
                        (lp, _), L = self._forward(model, full, s, e, also=also, live=live)
                    if live:
                        logp[s:e, : L - 1] = lp
                        for name in ("top_logp", "top_ids", "top_rest") if also else ():
                            top[name][s:e, : L - 1] = also[name]
        # every rank computed its own rows: the sum over ranks is the whole batch's
        if k:
            top.update({name: self._all_sum(t) for name, t in top.items()})
        sums = iter([self._all_sum(logp) for _, _, logp in out])
        return (next(sums) if old else None, next(sums) if self.has_reference else None,
                next(sums) if self.teacher_model is not None else None)

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
                    step.critic_updates += 1
                if train_actor:
                    self._actor_update(step, m0, m1, num_tokens)
        self._check_finite(step)

    def _check_finite(self, step: "Step") -> None:
        """A run whose every update was skipped (_apply) for MAX_NONFINITE_STEPS steps in a row stops."""
        every = bool(step.grad_norms) and step.skipped == len(step.grad_norms)
        self._nonfinite_steps = (getattr(self, "_nonfinite_steps", 0) + 1) if every else 0
        # a run shorter than that stops too: it would end with exit 0 having applied no update
        limit = min(MAX_NONFINITE_STEPS, self.plan.total_steps or MAX_NONFINITE_STEPS)
        if self._nonfinite_steps >= limit:
            span = f"the last {limit} steps" if limit == MAX_NONFINITE_STEPS else f"each of this run's {limit} step(s)"
            raise RunError(
                f"the policy's gradient was not finite (NaN or inf) in every update of {span}, so none was applied (actor/skipped_updates) and the model cannot learn: the loss diverged. "
                f"Lower algorithm.optimizer.lr or trainer.grad_clip, check the rewards and the model's scores, or "
                f"resume from an earlier checkpoint.")

    def _apply(self, step: "Step", norm: float) -> None:
        """The optimizer step, unless the gradient is not finite (a diverged loss, a NaN score):
        Adam would carry a NaN into every weight and its moments, for good. Such an update is
        skipped and counted (actor/skipped_updates, and a warning), the learning-rate schedule not
        moved; every rank sees the same norm (the norm over all shards), so all skip it together."""
        if math.isfinite(norm):
            step.lrs.append(self.optimizer.param_groups[0]["lr"])
            self._optimizer_step(self.optimizer)
            self.scheduler.step()  # the schedule counts the updates applied, as if a skipped one never was
            return
        self.optimizer.zero_grad(set_to_none=True)
        step.skipped += 1
        log.warning("policy update skipped: its gradient norm is %s (version %d)", norm, self.version)

    def _actor_update(self, step: "Step", m0: int, m1: int, num_tokens: int) -> None:
        algo = self.cfg.algorithm
        self.optimizer.zero_grad(set_to_none=True)
        # rows from step.trained on have advantages all 0 and were set aside (_prepare); they
        # still count in the normaliser (m1 - m0 rows, num_tokens)
        for s, e, live in self._my_micro_batches(step.full, m0, min(m1, step.trained)):
            # distill_divergence=jsd: the student's log-probs of the teacher's top tokens too
            step.student_top = None if step.teacher_top is None else {"at_ids": step.teacher_top["top_ids"][s:e]}
            (logp, entropy), L = self._forward(self.model, step.full, s, e, also=step.student_top, live=live)
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
        self._apply(step, step.grad_norms[-1])

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
        # the KL functions take no mask: their inputs are 0 where m is, so a -inf or NaN log-prob
        # there reaches neither the metric nor (0 x NaN in k2's or k3's backward) the gradient
        kl = self.kl_fn(masked(logp, m), masked(rows(step.ref_logp), m))
        step.sums["actor/kl"] += (kl.detach() * m).sum().item()
        return loss + self.cfg.algorithm.kl_loss_coef * kl

    def _behavior_term(self, loss, logp, entropy, m, rows, step):
        """off_policy_correction=decoupled: each token's policy loss weighted by pi_prox / pi_behav
        (not the KL to the reference nor the entropy bonus, which come after it)."""
        return loss if step.behavior_w is None else loss * rows(step.behavior_w)

    def _entropy_term(self, loss, logp, entropy, m, rows, step):
        """algorithm.entropy_coef: - entropy_coef x entropy (a bonus for exploring)."""
        return loss - self.cfg.algorithm.entropy_coef * entropy

    def _distill_term(self, loss, logp, entropy, m, rows, step):
        """distill_divergence=jsd: + distill_coef x JSD_beta(teacher, student) per token, on the
        teacher's top tokens (rft/algorithms/distill.py), differentiated through the student."""
        algo = self.cfg.algorithm
        teacher, student = step.teacher_top, step.student_top
        jsd = distill.generalized_jsd(rows(teacher["top_logp"]), student["at_logp"], algo.distill_jsd_beta,
                                      rest=(rows(teacher["top_rest"]), student["at_rest"]))
        step.sums["distill/jsd"] += (jsd.detach() * m).sum().item()
        return loss + algo.distill_coef * jsd

    def _sft_backward(self) -> float:
        """mix: add sft_loss_weight x (token-mean -log p) of this step's auxiliary rows to the gradient."""
        algo = self.cfg.algorithm
        exps = self.sft_reader.batch(self.version, algo.sft_batch_size)
        aux = {k: v.to(self.device) for k, v in collate(exps, self.tokenizer.pad_token_id).items()}
        num_tokens = int(aux["response_mask"].sum())
        total = 0.0
        for s, e, live in self._my_micro_batches(aux, 0, len(exps)):
            (logp, _), L = self._forward(self.model, aux, s, e, live=live)
            m = aux["response_mask"][s:e, : L - 1] * live
            loss = algo.sft_loss_weight * agg_loss(-logp, m, "token-mean", len(exps), num_tokens, 1)
            (loss * self.loss_scale).backward()
            total += loss.item()
        return total
