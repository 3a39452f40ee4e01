"""One RL step's metrics, as the Trainer (rft.trainer.trainer) returns them from train_step.

`MetricsMixin` holds them apart from the step itself: each rank summed its own rows' parts into
the Step (rft.trainer.step), and these methods add them up over the ranks (the Trainer's
`_all_sum`, `_all_max`) and turn them into per-token, per-update and per-second values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rft.algorithms import distill
from rft.models import peak_flops, peak_memory
from rft.trainer.critic import explained_variance

if TYPE_CHECKING:
    from rft.trainer.step import Step

# the tokens a step's forwards computed, summed over the ranks (see _forward and _perf_metrics):
# with and without a gradient (a shared prompt counted once), the rows' tokens a shared prompt
# saved computing again (trainer.share_prompts), and what the forwards paid for (padding included)
WORK = ("perf/grad_tokens", "perf/nograd_tokens", "perf/shared_tokens", "perf/computed_tokens")


class MetricsMixin:
    """The Trainer's step metrics (see the module's docstring)."""

    def _metrics(self, step: Step, elapsed: float) -> dict:
        mask, adv = step.mask, step.adv
        self._sum_over_ranks(step)
        sums = step.sums
        updates = max(len(step.grad_norms), 1)
        total_tokens = mask.sum().item() * self.cfg.trainer.ppo_epochs
        trained_tokens = mask[:step.trained].sum().item() * self.cfg.trainer.ppo_epochs
        metrics = {
            "actor/skipped_updates": step.skipped,  # a gradient that was not finite: not applied
            # the mean lr the step's updates applied; none applied: the lr the next one will take
            "actor/lr": sum(step.lrs) / len(step.lrs) if step.lrs else self.scheduler.get_last_lr()[0],
            "advantage/mean": (adv.sum() / mask.sum()).item(),
            "advantage/std": adv[mask.bool()].std().item() if mask.sum() > 1 else 0.0,
            "advantage/abs_mean": ((adv.abs() * mask).sum() / mask.sum()).item(),
            "train/experiences": step.n,
            "train/tokens_per_s": total_tokens / elapsed,
            # inside the trainer's process: the runtime benchmark's "model compute"
            "timing/train_compute_s": elapsed,
        }
        if step.grad_norms:  # PPO's critic warm-up updates no policy: no loss or norm to report (not 0)
            metrics.update({"loss/policy": sums["loss/policy"] / updates, "actor/grad_norm": sum(step.grad_norms) / updates})
        metrics.update(self._perf_metrics(sums, elapsed))
        metrics.update(self._update_metrics(step, trained_tokens))
        metrics.update(self._term_metrics(step, total_tokens, updates))
        if self.critic is not None:
            metrics.update(self._critic_metrics(step, total_tokens))
        return metrics

    def _sum_over_ranks(self, step: Step) -> None:
        """Each rank summed its own rows' parts: every sum of the step, replaced by its sum over
        the ranks (one reduction of one tensor, the keys in the same order on every rank)."""
        sums, pm_sums, pm_counts, c_sums = step.sums, step.loss_metric_sums, step.loss_metric_counts, step.critic_sums
        names = [(d, k) for d in (sums, pm_sums, pm_counts, c_sums) for k in sorted(d)]
        total = self._all_sum(torch.tensor([d[k] for d, k in names], dtype=torch.float64, device=self.device)).tolist()
        for (d, k), v in zip(names, total):
            d[k] = v

    def _update_metrics(self, step: Step, trained_tokens: float) -> dict:
        """What the policy update's passes saw: the loss's own metrics, the entropy, the rows set
        aside, the trainer's log-probs against the engine's, and the rollout IS weights."""
        sums, pm_counts, metrics = step.sums, step.loss_metric_counts, {}
        # the loss's ratio metrics, over the tokens the update computed (a row set aside for a
        # zero advantage has none; on-policy its ratio is 1 and would add 0 anyway); those given
        # as (sum, count) over their own count (none counted: not logged)
        for k, v in step.loss_metric_sums.items():
            if k not in pm_counts:
                metrics[k] = v / max(trained_tokens, 1)
            elif pm_counts[k]:
                metrics[k] = v / pm_counts[k]
        if trained_tokens and step.grad_norms:
            # over the tokens the update computed (rows set aside for a zero advantage are not;
            # none in PPO's critic warm-up, whose steps update no policy)
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
        return metrics

    def _term_metrics(self, step: Step, total_tokens: float, updates: int) -> dict:
        """The optional parts of the loss and the reward the config turned on: the KL term, the
        KL penalty, the behaviour weights, the SFT loss."""
        algo, sums, mask, metrics = self.cfg.algorithm, step.sums, step.mask, {}
        if self.kl_fn is not None:
            metrics["actor/kl"] = sums["actor/kl"] / total_tokens
        if step.kl_penalty is not None:
            metrics["reward/kl_penalty"] = step.kl_penalty.mean().item()
        if step.behavior_w is not None and step.trained:
            w, m = step.behavior_w[:step.trained], mask[:step.trained]  # the rows the update forwarded
            metrics["actor/behavior_weight_mean"] = ((w * m).sum() / m.sum().clamp(min=1)).item()
            metrics["actor/behavior_weight_capped_frac"] = (
                ((w >= algo.behavior_weight_cap) * m).sum() / (m * (w != 1.0)).sum().clamp(min=1)).item()
        if step.teacher_logp is not None:
            # on-policy distillation: the per-token reverse KL to the teacher before this step's update
            # (falls as the student learns the teacher), and the teacher's log-prob of the sampled tokens
            metrics["distill/reverse_kl"] = distill.reverse_kl(step.teacher_logp, step.old_logp, mask)
            metrics["distill/teacher_logprob"] = ((step.teacher_logp * mask).sum() / mask.sum().clamp(min=1)).item()
        if "distill/jsd" in sums:  # distill_divergence=jsd: the term's mean per token over the update's passes
            metrics["distill/jsd"] = sums["distill/jsd"] / total_tokens
        if "loss/sft" in sums:
            metrics["loss/sft"] = sums["loss/sft"] / updates
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
        mem = peak_memory(self.device)
        out["perf/max_memory_gb"] = self._all_max(torch.tensor(float(mem), dtype=torch.float64,
                                                               device=self.device)).item() / 2**30
        return out

    def _critic_metrics(self, step: Step, total_tokens: float) -> dict:
        values, mask = step.batch["values"], step.mask
        return {
            # the mean over the updates that ran: a step of fewer rows than the plan's runs fewer
            "critic/value_loss": step.critic_sums["critic/value_loss"] / max(step.critic_updates, 1),
            "critic/vf_clip_frac": step.critic_sums["critic/vf_clip_tokens"] / total_tokens,
            # how much of the return variance the values (before this step's updates) explained
            "critic/explained_variance": explained_variance(step.returns, values, mask),
            "critic/values_mean": (values.sum() / mask.sum()).item(),
        }
