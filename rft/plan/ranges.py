"""The numeric settings whose every value outside a range is a mistake, as one table checked when
planning (rft.plan.batch.check_config), so that each ends the command with a paragraph naming the
key, its value, the range and what the value means, before anything starts.

Hydra types each key (an int key refuses 2.5); the ranges are what the type cannot say: the counts
and intervals that size the run (a batch of 0 tasks), the durations (a timeout of 0 s), and the
coefficients and bounds that the trainer or the explorer reads mid-run, where an out-of-range
value did not fail but trained another run than the one asked for, with exit 0 (a negative clip
ratio inverts the clip range, a negative KL coefficient pushes the policy away from its
reference, an infinite weight decay or entropy coefficient fills the model with NaN, a
tensor_parallel_size of 0 split the model in none). A check that compares two keys, or whose
bound is the run's own length or data, stays with the plan (rft.plan.batch).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable

from omegaconf import OmegaConf

from rft.errors import ConfigError

log = logging.getLogger(__name__)

INF = math.inf


@dataclass(frozen=True)
class Range:
    key: str
    lo: float
    hi: float = INF
    lo_open: bool = False  # lo itself is out of range
    hi_open: bool = True  # hi itself is out of range (inf: the value must be finite)
    why: str = ""
    # what the value means, in parentheses after the range: "tasks per step", "0: greedy", "or null: ..."
    note: str = ""
    # whether the stage reads the key (a value it never reads is left alone)
    when: Callable | None = None

    def text(self, v) -> str:
        if self.lo == -INF:
            return "finite"
        if self.hi == INF:
            finite = " and finite" if self.hi_open and isinstance(v, float) else ""
            return f"{'>' if self.lo_open else '>='} {self.lo:g}{finite}"
        return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"

    def message(self, key: str, v) -> str:
        note = f" ({self.note})" if self.note else ""
        return f"{key}={v} must be {self.text(v)}{note}{': ' + self.why if self.why else ''}."

    def keys(self, cfg) -> list[str]:
        """The key, or one per item of the list that `[*]` stands for (each eval set)."""
        if "[*]" not in self.key:
            return [self.key]
        head, tail = self.key.split("[*]", 1)
        return [f"{head}[{i}]{tail}" for i in range(len(OmegaConf.select(cfg, head) or ()))]

    def holds(self, v) -> bool:  # (comparisons with NaN are False: NaN is out of every range)
        above = v > self.lo if self.lo_open else v >= self.lo
        below = v < self.hi if self.hi_open else v <= self.hi
        return bool(above and below)


def _rl(cfg) -> bool:
    """An RL stage (an advantage function): an SFT warm-up inherits the RL keys and reads none of them."""
    return cfg.algorithm.advantage_fn != "none"


def _critic(cfg) -> bool:
    from rft.algorithms import algorithm_needs

    return algorithm_needs(cfg.algorithm).critic


def _kl(fn: str) -> Callable:
    return lambda cfg: cfg.algorithm[fn] != "none"


def _cosine(cfg) -> bool:
    return cfg.algorithm.optimizer.warmup_style == "cosine"


def _mixes_sft(cfg) -> bool:
    return cfg.algorithm.sft_loss_weight > 0


def _vllm(cfg) -> bool:
    return cfg.explorer.rollout_model.engine_type == "vllm"


def _explores(cfg) -> bool:
    return cfg.mode in ("both", "explore")


def _sizes_by_tasks(cfg) -> bool:
    """A stage that only trains reads buffer.batch_size only to size its step (no train_batch_size):
    the SFT warm-up was named in an error about the RL stage's batch."""
    return _explores(cfg) or not cfg.buffer.train_batch_size


def stored_experiences(buf_cfg) -> bool:
    """The trainer's input is experiences an explorer stored (not a dataset of prompt/response rows)."""
    from rft.data.experience import is_experience_file

    return buf_cfg.storage_type == "sql" or (
        buf_cfg.storage_type == "file" and bool(buf_cfg.path) and is_experience_file(buf_cfg.path)
    )


def _reads_groups(cfg) -> bool:
    """algorithm.repeat_times: the explorer's group size, or a stored buffer's whole groups."""
    return _explores(cfg) or stored_experiences(cfg.buffer.trainer_input.experience_buffer)


def _ranked(cfg) -> bool:
    """trainer.ranks is read by a backend of ranks (fsdp2; trainer=torch is one process)."""
    from rft.registry import TRAINER_BACKENDS

    return TRAINER_BACKENDS.info(cfg.trainer.trainer_strategy).ranks


def _distils(cfg) -> bool:
    return cfg.algorithm.distill_coef != 0


def _partial(cfg) -> bool:
    return cfg.explorer.partial_rollout


def _tasksets(field: str, *args, **kw) -> tuple[Range, Range]:
    """One range for the training taskset's `field`, read where the stage explores, and one for each
    eval set's, read in every mode (mode=train evaluates too: rft.plan.placement.explorer_count)."""
    return (Range(f"buffer.explorer_input.taskset.{field}", *args, **kw, when=_explores),
            Range(f"buffer.explorer_input.eval_tasksets[*].{field}", *args, **kw))


STEPS = "in steps"
SECONDS = "seconds"

RANGES = (
    # the run's shape first: its errors are the ones a user most likely made
    Range("buffer.batch_size", 1, note="tasks per step", when=_sizes_by_tasks),
    Range("algorithm.repeat_times", 1, note="rollouts per task", when=_reads_groups),
    Range("buffer.train_batch_size", 1, note="or null for the default: batch_size x algorithm.repeat_times in "
          "mode=both"),
    Range("trainer.mini_batch_size", 1, note="or null for the default: buffer.train_batch_size"),
    Range("trainer.micro_batch_size_per_gpu", 1, note="experiences per forward/backward on each rank"),
    Range("trainer.ppo_epochs", 1, note="passes over each step's experiences"),
    Range("buffer.total_steps", 1, note="or null to use total_epochs"),
    Range("buffer.total_epochs", 1, when=lambda cfg: cfg.buffer.total_steps is None),
    Range("trainer.save_interval", 1, note=STEPS),
    Range("explorer.eval_interval", 1, note=STEPS),
    Range("synchronizer.sync_interval", 1, note=STEPS),
    Range("synchronizer.sync_offset", 0, note="steps the explorer runs ahead"),
    Range("model.max_prompt_tokens", 1, note="tokens"),
    Range("model.max_response_tokens", 1, note="tokens"),
    Range("model.lora.rank", 0, note="0: no LoRA, train every weight"),
    # the update is (alpha / rank) B A: with alpha 0 the adapters train but never change the model
    Range("model.lora.alpha", 0, lo_open=True, when=lambda cfg: cfg.model.lora.rank > 0,
          why="with model.lora.rank > 0 the adapters' update is scaled by alpha / rank, so 0 leaves the model as it "
              "started; 16 or 2 x rank is common"),
    Range("trainer.max_token_len_per_gpu", 1, note="or null for the default: micro_batch_size_per_gpu x the longest "
          "sequence"),
    Range("trainer.logprob_chunk_size", 1, note="or null for the default: all tokens at once"),
    Range("trainer.max_ckpt_to_keep", 1, note="or null to keep every checkpoint", why="a run resumes from its newest"),
    # clip_grad_norm_ scales the gradient by grad_clip / norm
    Range("trainer.grad_clip", 0, lo_open=True, hi_open=False, note="the largest gradient norm; inf: no clipping",
          why="0 would zero every update and a negative value reverse it"),
    Range("cluster.node_num", 1, note="nodes"),
    Range("explorer.rollout_model.engine_num", 1, note="rollout engines"),
    Range("cluster.gpu_per_node", 0, note="0: a CPU-only cluster"),
    Range("cluster.gpu_memory_gb", 0, lo_open=True, note="GiB of one GPU's memory; or null: this machine's GPUs'",
          when=lambda cfg: cfg.cluster.gpu_per_node > 0),
    Range("cluster.cpus_per_actor", 1, note="CPUs each actor reserves"),
    Range("trainer.ranks", 1, note="or null for the default", when=_ranked),
    # Ray's -1 (restart for ever) would restart an explorer without the weight snapshots a redone
    # step needs (rft.runtime.explorers keeps them only for max_actor_restarts > 0)
    Range("cluster.max_actor_restarts", 0, note="times Ray restarts a dead explorer actor; 0: never",
          when=lambda cfg: cfg.cluster.backend == "ray"),
    Range("cluster.init_timeout_s", 0, lo_open=True, hi_open=False, note=SECONDS + "; inf: no bound",
          when=lambda cfg: cfg.cluster.backend == "ray" and cfg.cluster.ray_address is None),
    Range("cluster.num_cpus", 1, note="or null: every CPU of this machine",
          why="with none, no actor could ever be placed and the run would wait forever"),
    Range("explorer.max_failed_steps", 0, note="0: never stop a run whose tasks all fail"),
    Range("synchronizer.sync_timeout", 0, lo_open=True, hi_open=False, note=SECONDS),
    Range("explorer.restart_timeout", 0, lo_open=True, hi_open=False, note=SECONDS),
    Range("explorer.max_timeout", 0, lo_open=True, hi_open=False, note=SECONDS),
    Range("explorer.runner_per_model", 1),
    Range("explorer.max_retry_times", 0),
    Range("explorer.over_rollout.ratio", 0, 1),
    Range("explorer.over_rollout.wait_after_min", 0, hi_open=False, note=SECONDS,
          why="how long a step waits for its last tasks once (1 - ratio) of them are done; inf: for all of them"),
    Range("explorer.partial_in_flight", 1, when=_partial,
          note="groups in flight, in explore steps' worth: an explore step needs its batch_size groups"),
    Range("explorer.partial_chunk_tokens", 1, when=_partial,
          note="tokens generated between two chances to take new weights"),
    Range("algorithm.optimizer.lr", 0, why="a negative learning rate ascends the loss"),
    # (a temperature in (0, 0.01), which vLLM raises, and 0 under a grouped advantage: rft.plan.batch)
    *_tasksets("rollout_args.temperature", 0, note="0: greedy"),
    *_tasksets("rollout_args.top_p", 0, 1, lo_open=True, hi_open=False, note="1: no nucleus cut"),
    *_tasksets("rollout_args.max_tokens", 1, note="or null: model.max_response_tokens"),
    *_tasksets("repeat_times", 1, note="or null: the default, algorithm.repeat_times for the taskset, 1 for an eval "
               "set"),
    # every rollout fails at +inf and passes at -inf: pass@k, maj@n and the curriculum's pass rates say nothing
    *_tasksets("pass_threshold", -INF, lo_open=True,
               why="the reward at or above which a sample is correct (pass@k, maj@n, the curriculum's pass rates)"),
    # ratio clipped to [1 - low, 1 + high]: a negative one puts 1 outside the range (inverted clip)
    Range("algorithm.clip_ratio_low", 0, hi_open=False, why="the ratio is clipped to [1 - clip_ratio_low, "
          "1 + clip_ratio_high]: a negative value puts the unchanged policy outside that range; inf: no lower clip"),
    Range("algorithm.clip_ratio_high", 0, hi_open=False, why="the ratio is clipped to [1 - clip_ratio_low, "
          "1 + clip_ratio_high]: a negative value puts the unchanged policy outside that range; inf: no upper clip"),
    Range("algorithm.optimizer.min_lr_ratio", 0, 1, hi_open=False, when=_cosine,
          why="the cosine schedule ends at lr x min_lr_ratio: below 0 the learning rate turns negative (the loss "
              "is ascended), above 1 it grows"),
    Range("algorithm.optimizer.weight_decay", 0,
          why="AdamW shrinks each weight by lr x weight_decay a step: a negative one grows them, an infinite one fills "
              "the model with NaN"),
    Range("algorithm.gamma", 0, 1, hi_open=False, when=_rl,
          why="a discount: 1 sums the rewards, below 1 discounts later ones"),
    Range("algorithm.lam", 0, 1, hi_open=False, when=_critic,
          why="GAE's lambda: 1 is the Monte Carlo return, 0 one step"),
    Range("algorithm.critic_lr", 0, why="a negative learning rate ascends the critic's loss", when=_critic),
    Range("algorithm.value_clip", 0, lo_open=True, hi_open=False, why="the critic's values are clipped to "
          "old +- value_clip; inf: no clipping", when=_critic),
    Range("algorithm.critic_warmup", 0, note="steps that train only the critic; 0: none", when=_critic),
    Range("algorithm.tau", 0, lo_open=True, why="OPMD's temperature (the loss is divided by 1 + tau, the "
          "logavgexp baseline divides by it)", when=_rl),
    Range("algorithm.kl_loss_coef", 0, when=_kl("kl_loss_fn"),
          why="a negative coefficient would reward moving away from the reference"),
    Range("algorithm.kl_penalty_coef", 0, when=_kl("kl_penalty_fn"),
          why="a negative coefficient would reward moving away from the reference"),
    Range("algorithm.entropy_coef", -INF, lo_open=True, why="an infinite coefficient makes the loss infinite"),
    Range("algorithm.sft_loss_weight", 0, why="0 turns the auxiliary SFT term off; a negative weight would unlearn "
          "the expert data"),
    Range("algorithm.sft_batch_size", 1, when=_mixes_sft, note="expert rows a step for the SFT term"),
    Range("algorithm.clip_ratio_c", 1, lo_open=True, hi_open=False, note="or null: no dual clip",
          why="the dual clip caps the loss of a token with a negative advantage at -A x clip_ratio_c, where its ratio "
              "is above clip_ratio_c; at or below 1 it caps tokens whose ratio has not moved, and they give no "
              "gradient. 3 is the usual value"),
    Range("algorithm.dpo_beta", 0, lo_open=True, when=lambda cfg: cfg.algorithm.policy_loss_fn == "dpo",
          why="DPO's beta scales the implicit reward (0.1 is common)"),
    Range("algorithm.behavior_weight_cap", 0, lo_open=True, hi_open=False,
          when=lambda cfg: _rl(cfg) and cfg.algorithm.off_policy_correction == "decoupled",
          why="each stale token's policy loss is weighted by pi_prox / pi_behav capped here: at or below 0 the "
              "weights are 0 or negative; inf: no cap"),
    Range("algorithm.dynamic_sampling_max_tries", 0, note="task batches a step draws; 0 or 1: off", when=_rl),
    Range("algorithm.overlong_buffer_frac", 0, 1, why="the share of the response budget at whose end responses "
          "are penalised (0: off; DAPO's 0.2)", when=_rl),
    Range("algorithm.overlong_penalty_factor", 0, why="the penalty at the length limit: a negative one rewards "
          "overlong responses", when=lambda cfg: cfg.algorithm.overlong_buffer_frac > 0),
    Range("algorithm.distill_coef", 0, why="0 turns distillation off; a negative coefficient moves away from the "
          "teacher"),
    Range("algorithm.distill_jsd_beta", 0, 1, hi_open=False, when=_distils,
          note="0: the forward KL to the teacher, 1: the reverse KL, 0.5: the symmetric JSD"),
    Range("algorithm.distill_top_k", 1, when=_distils, note="the teacher's top tokens the loss compares; 20 is common"),
    Range("buffer.trainer_input.experience_buffer.max_read_timeout", 0, lo_open=True, hi_open=False,
          why="seconds the trainer waits for a full batch (and a writer for room in a full queue); at 0 it never "
              "waits, so a step trains on what happened to be there; inf: wait for ever"),
    Range("explorer.rollout_model.tensor_parallel_size", 1, note="devices each engine is split over"),
    Range("explorer.rollout_model.generate_batch_size", 1, note="sequences per generate() call"),
    Range("explorer.rollout_model.gpu_memory_utilization", 0, 1, lo_open=True, hi_open=False, when=_vllm,
          why="the share of each GPU's memory vLLM may take (0.9 is common)"),
    Range("explorer.rollout_model.cpu_kvcache_space_gb", 1, when=_vllm, note="GiB for vLLM's KV cache on CPU"),
    Range("data_processor.online_curriculum.eps", 0, lo_open=True,
          when=lambda cfg: cfg.data_processor.online_curriculum.enable,
          why="the floor of every task's weight (0.05 is the default): at 0 a task always or never solved is "
              "never drawn again, and an infinite one draws uniformly"),
    Range("data_processor.online_curriculum.window", 1, when=lambda cfg: cfg.data_processor.online_curriculum.enable,
          note="a task's newest rollouts its pass rate counts"),
)

def check_ranges(cfg) -> None:
    """The first key out of its range, in the table's order. A null is left alone: where a key may be
    null its note says what null means (a key that may not be is typed so)."""
    for r in RANGES:
        if r.when is not None and not r.when(cfg):
            continue
        for key in r.keys(cfg):
            v = OmegaConf.select(cfg, key)
            if v is not None and not r.holds(v):
                raise ConfigError(r.message(key, v))
    betas = list(cfg.algorithm.optimizer.betas)
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ConfigError(f"algorithm.optimizer.betas={betas} must be two numbers in [0, 1) (Adam's decay rates of "
                          f"the gradient's mean and of its square; [0.9, 0.999] is the default).")


# keys one kind of algorithm reads: set (away from the schema's default) in an RL stage whose
# functions never read them, they changed nothing, without a word (a sweep over critic_lr under
# grpo ran the same job each time), as an unused KL coefficient did (rft.plan.batch._unused_kl_coefs)
UNREAD = (
    ("algorithm.critic_lr", _critic, "PPO's critic (algorithm.advantage_fn=gae: algorithm=ppo)"),
    ("algorithm.value_clip", _critic, "PPO's critic (algorithm.advantage_fn=gae: algorithm=ppo)"),
    ("algorithm.lam", _critic, "PPO's critic (algorithm.advantage_fn=gae: algorithm=ppo)"),
    ("algorithm.critic_warmup", _critic, "PPO's critic (algorithm.advantage_fn=gae: algorithm=ppo)"),
    ("model.critic_model_path", _critic, "PPO's critic (algorithm.advantage_fn=gae: algorithm=ppo)"),
    ("algorithm.tau", lambda cfg: cfg.algorithm.advantage_fn == "opmd" or cfg.algorithm.policy_loss_fn == "opmd",
     "OPMD (algorithm=opmd)"),
    ("algorithm.opmd_baseline", lambda cfg: cfg.algorithm.advantage_fn == "opmd", "OPMD's advantage (algorithm=opmd)"),
    ("algorithm.dpo_beta", lambda cfg: cfg.algorithm.policy_loss_fn == "dpo", "DPO's loss (algorithm=dpo)"),
    ("algorithm.behavior_weight_cap", lambda cfg: cfg.algorithm.off_policy_correction == "decoupled",
     "algorithm.off_policy_correction=decoupled"),
)


# the engine's keys only vLLM reads (rft/rollout/engines/vllm.py): LightRFT's --engine_mem_util 0.4 translated
# to gpu_memory_utilization=0.4 under the CPU default's hf engine changed nothing, without a word
VLLM_ONLY = ("gpu_memory_utilization", "enable_prefix_caching", "enforce_eager", "dtype", "seed", "cpu_kvcache_space_gb")


def warn_unread_engine(cfg) -> None:
    """vLLM's keys set (away from the schema's default) while the engine is hf: one warning naming them. A
    study's own engine (a dotted path) may read anything: left alone."""
    from rft.config import RolloutModelConfig

    rm, defaults = cfg.explorer.rollout_model, RolloutModelConfig()
    given = [f"{k}={rm[k]}" for k in VLLM_ONLY if rm[k] != getattr(defaults, k)]
    if rm.engine_type == "hf" and given:
        one = len(given) == 1
        log.warning("explorer.rollout_model.%s: %s no effect, as only the vLLM engine reads %s and this stage's engine "
                    "is explorer.rollout_model.engine_type=hf (transformers' generate). Use explorer=vllm, or leave %s "
                    "out.", ", ".join(given), "it has" if one else "they have", "it" if one else "them",
                    "it" if one else "them")


def warn_unread(cfg) -> None:
    """A key of another algorithm's set in this RL stage: a warning naming what reads it. Functions
    given as a study's dotted path may read anything: left alone."""
    from rft.config import Config

    warn_unread_engine(cfg)
    algo = cfg.algorithm
    if algo.advantage_fn == "none" or "." in algo.advantage_fn or "." in algo.policy_loss_fn:
        return
    defaults = OmegaConf.structured(Config)
    for key, reads, what in UNREAD:
        value = OmegaConf.select(cfg, key)
        if value != OmegaConf.select(defaults, key) and not reads(cfg):
            log.warning("%s=%s has no effect: only %s reads it, and this stage runs algorithm.advantage_fn=%s, "
                        "policy_loss_fn=%s.", key, value, what, algo.advantage_fn, algo.policy_loss_fn)
