"""Typed schemas for every config group, stored in Hydra's ConfigStore.

`conf/config.yaml` starts its defaults list with `rft_schema` (the `Config` dataclass below), so
every group file and every command-line override is merged into a typed, struct-mode config: a
misspelt key or a wrong type fails when Hydra composes the config, before anything starts.

Key names follow Trinity-RFT's configuration guide where one exists (`buffer.batch_size`,
`algorithm.repeat_times`, `explorer.rollout_model.engine_num`, `synchronizer.sync_interval`,
`trainer.save_interval`, ...). Where we rename, the field comment says the old name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

# Closed sets of names are Enum fields: a value outside the set fails when Hydra composes the config
# ("Invalid value 'x', expected one of [...]"), before anything starts. They are StrEnums, so a
# value compares, prints and hashes as its string (cfg.mode == "both"). The runtime modules that
# implement a set (engines, synchronizers, actor backends) have exactly these keys (tested).


class Mode(StrEnum):
    both = "both"
    explore = "explore"
    train = "train"
    bench = "bench"


class SyncMethod(StrEnum):
    memory = "memory"
    checkpoint = "checkpoint"
    collective = "collective"


class SyncStyle(StrEnum):
    fixed = "fixed"
    dynamic_by_explorer = "dynamic_by_explorer"


class Backend(StrEnum):
    ray = "ray"
    inline = "inline"


class StorageType(StrEnum):
    queue = "queue"
    sql = "sql"
    file = "file"


class OffPolicyCorrection(StrEnum):
    behavior = "behavior"
    decoupled = "decoupled"
    none = "none"


class WarmupStyle(StrEnum):
    constant = "constant"
    cosine = "cosine"


class RmPairs(StrEnum):
    """algorithm.rm_pairs: where a reward model's preference pairs come from."""
    dataset = "dataset"
    groups = "groups"


class PromptType(StrEnum):
    plaintext = "plaintext"
    messages = "messages"


class OpmdBaseline(StrEnum):
    mean = "mean"
    logavgexp = "logavgexp"


class DistillDivergence(StrEnum):
    reverse_kl = "reverse_kl"
    jsd = "jsd"


MODES = tuple(Mode)
SYNC_METHODS = tuple(SyncMethod)
BACKENDS = tuple(Backend)
# names with hyphens cannot be Enum members: checked when planning
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# model.dtype and its aliases -> the torch / vLLM name
DTYPES = {"float32": "float32", "fp32": "float32", "float": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16", "half": "float16"}


@dataclass
class OptimizerConfig:
    lr: float = 1e-6
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.01
    # linear warm-up over this many optimizer steps (verl: lr_warmup_steps)
    warmup_steps: int = 0
    # after warm-up: constant | cosine (Trinity: warmup_style)
    warmup_style: WarmupStyle = WarmupStyle.constant
    # cosine decays to lr * min_lr_ratio
    min_lr_ratio: float = 0.0


class RolloutIS(StrEnum):
    """algorithm.rollout_is (rft/algorithms/rollout_is.py)."""
    none = "none"
    tis = "tis"
    mis = "mis"


@dataclass
class AlgorithmConfig:
    # a label for logs and checkpoints; behaviour comes from the *_fn keys below, set by
    # `algorithm=<name>` (Trinity-RFT's algorithm_type picks the algorithm; here a label that names
    # a conf/algorithm file whose functions are not the ones run stops the plan)
    algorithm_type: str = "grpo"
    # rollouts per task (ROLL: num_return_sequences_in_group, LightRFT: n_samples_per_prompt)
    repeat_times: int = 8
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    # name in rft.algorithms.ADVANTAGE_FNS
    advantage_fn: str = "grpo"
    # name in rft.algorithms.POLICY_LOSS_FNS
    policy_loss_fn: str = "ppo_clip"
    # keyword arguments of policy_loss_fn beyond (logp, batch, cfg), and of advantage_fn beyond
    # (batch, cfg): a study's own function takes its own settings here (+algorithm.args.beta=0.5),
    # checked against its signature when planning; the built-in ones read the keys of this section
    args: Dict[str, Any] = field(default_factory=dict)
    advantage_args: Dict[str, Any] = field(default_factory=dict)
    # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    loss_agg_mode: str = "token-mean"
    # PPO clip range: ratio is clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    # dual clip for A < 0 (verl: clip_ratio_c, usually 3.0; must be > 1); null disables it
    clip_ratio_c: Optional[float] = None
    # discount of per-token returns (reinforce_pp)
    gamma: float = 1.0
    # OPMD temperature: loss / (1 + tau), and the logavgexp baseline's temperature
    tau: float = 1.0
    # OPMD baseline: mean | logavgexp
    opmd_baseline: OpmdBaseline = OpmdBaseline.mean
    # KL to a frozen reference model as a loss term: none | k1 | k2 | k3 | abs
    kl_loss_fn: str = "none"
    kl_loss_coef: float = 0.001
    # KL to the reference subtracted from the reward (sum over the response): none | k1 | k2 | k3 | abs
    kl_penalty_fn: str = "none"
    kl_penalty_coef: float = 0.001
    # PPO's critic (advantage_fn=gae): learning rate, value clipping, GAE lambda, and how many
    # first steps train only the critic (Trinity-RFT's verl trainer_config: critic.optim.lr,
    # critic.cliprange_value, trainer.critic_warmup)
    critic_lr: float = 1e-5
    value_clip: float = 0.5
    lam: float = 1.0
    critic_warmup: int = 0
    # mix: loss = RL loss + sft_loss_weight * SFT loss on sft_batch_size rows a step from the
    # auxiliary buffer named sft_buffer (0: off)
    sft_loss_weight: float = 0.0
    sft_buffer: str = "sft_dataset"
    sft_batch_size: int = 32
    # DPO's beta: the strength of the implicit KL to the reference
    dpo_beta: float = 0.1
    # algorithm=rm: where its preference pairs come from. dataset: the pairs of
    # buffer.trainer_input.experience_buffer (mode=train); groups: each explore step's groups
    # (mode=both, a queue buffer): the stage's starting policy, never updated in the stage, samples
    # repeat_times responses a task, and a group whose rewards differ gives one pair, its first
    # best-reward response over its first worst-reward one (rft.data.operators.best_worst_pairs)
    rm_pairs: RmPairs = RmPairs.dataset
    # experiences from older weights (staleness >= 1, see synchronizer.max_staleness):
    # behavior: the PPO ratio is taken against the sampling log-probs the explorer stored, so
    #   the clip bounds the update around the weights that sampled (fresh experiences keep the
    #   recomputed ones); decoupled: the ratio against the recomputed log-probs, each token's
    #   policy loss (not the KL or entropy terms) weighted by pi_prox / pi_behav capped at
    #   behavior_weight_cap (AReaL's decoupled PPO, arXiv 2505.24298); none: stale
    #   experiences are treated as fresh. On this repo's offline test (10 steps on 10 stored
    #   steps) behavior went 0.155 -> 0.885, decoupled -> 0.205, none -> 0.005
    off_policy_correction: OffPolicyCorrection = OffPolicyCorrection.behavior
    behavior_weight_cap: float = 5.0
    # the rollout engine's sampling log-probs (Experience.logprobs) differ from the trainer's
    # log-probs of the same weights (vLLM vs HF kernels, bf16), which makes on-policy training
    # silently off-policy. Each token's policy loss (not the KL or entropy terms; not sft or dpo)
    # is weighted, without gradient, by r = pi_trainer / pi_engine: tis: min(r, rollout_is_cap)
    # (truncated IS, Yao et al. 2025; TRL's vllm_importance_sampling_correction, cap 2); mis: r,
    # or 0 (the token masked) where r > rollout_is_cap (one-sided, as TRL's token_mask; verl's and
    # IcePop's masks also drop r below a lower bound, this one keeps it);
    # none: off. Only tokens with sampling log-probs whose old log-probs off_policy_correction
    # left alone (fresh experiences; stale ones too with off_policy_correction=none): one
    # importance weight per token, never two. With the hf engine r is 1 to ~1e-5. Logged (also
    # with none): actor/tis_weight_mean|max (uncapped r), actor/tis_capped_frac (r > cap)
    rollout_is: RolloutIS = RolloutIS.tis
    # C above: must be > 1 (float noise alone puts r on both sides of 1)
    rollout_is_cap: float = 2.0
    # entropy bonus: loss -= entropy_coef * entropy
    entropy_coef: float = 0.0
    # DAPO dynamic sampling: draw up to this many task batches per step to fill it with groups
    # whose rewards differ (0 or 1: off)
    dynamic_sampling_max_tries: int = 0
    # DAPO overlong shaping: responses in the last overlong_buffer_frac of the response budget
    # are penalised linearly, down to -overlong_penalty_factor at the limit (0: off; the paper's
    # 4096 of 20480 tokens is 0.2; verl sets the length in tokens: overlong_buffer.len). A
    # multi-turn row is measured by its longest assistant turn (each turn has the limit)
    overlong_buffer_frac: float = 0.0
    overlong_penalty_factor: float = 1.0
    # on-policy distillation (algorithm=opd; rft/algorithms/distill.py): each sampled response
    # token's advantage gains distill_coef x (log p_teacher - log p_student) of that token, the
    # negative of the per-token reverse KL (Agarwal et al. 2024, arXiv 2306.13649; Thinking
    # Machines' on-policy distillation). Added to whatever advantage_fn gives: algorithm=opd has
    # none (pure distillation); grpo with distill_coef > 0 mixes the task reward in. 0: off
    distill_coef: float = 0.0
    # the teacher: a causal LM with the policy's tokenizer (a local directory or a hub id), frozen,
    # computed in the trainer like the reference model (trainer.ref_offload offloads it too)
    teacher_model_path: Optional[str] = None
    # reverse_kl: the advantage above, on the sampled token; jsd: GKD's generalised Jensen-Shannon
    # divergence between the teacher's and the student's next-token distributions at each response
    # position, a loss term distill_coef x JSD_beta differentiated through the student, on the
    # teacher's distill_top_k most likely tokens plus a bucket for the rest of the mass
    distill_divergence: DistillDivergence = DistillDivergence.reverse_kl
    # JSD_beta = beta KL(teacher || M) + (1 - beta) KL(student || M), M = beta teacher + (1 - beta)
    # student; 0: the forward KL(teacher || student), 1: the reverse KL(student || teacher)
    distill_jsd_beta: float = 0.5
    # how many of the teacher's most likely tokens the JSD compares at each position (the rest of
    # the mass is one bucket; [rows, positions, k] log-probs and ids are kept for the step)
    distill_top_k: int = 20


class LoraSync(StrEnum):
    merged = "merged"
    adapter = "adapter"


@dataclass
class LoraConfig:
    # the adapters' rank; 0: no LoRA
    rank: int = 0
    # the scale of the update is alpha / rank
    alpha: float = 16.0
    # module names to adapt (a list, or "all-linear": every linear layer but the output layer)
    target_modules: Any = "all-linear"
    # dropout on the adapters' input: must stay 0 (the trainer computes without dropout, so that
    # its log-probs are the engine's; the plan refuses another value)
    dropout: float = 0.0
    # what a weight sync sends the engines: merged (the whole model, W + the adapters' update: any
    # engine, any sync method) or adapter (the adapters alone, served by vLLM as a LoRA request on
    # the base weights it keeps: a sync moves the adapters' bytes only; explorer=vllm with
    # sync=memory or checkpoint)
    sync: LoraSync = LoraSync.merged


@dataclass
class ModelConfig:
    # hub id or local directory in Hugging Face format
    model_path: str = MISSING
    # "tiny": the project builds the model at model_path on first use (see rft/models.py)
    builder: Optional[str] = None
    # model.builder tiny or tiny_tools: strings its tokenizer takes as one token each, as a BPE
    # vocabulary merges frequent strings (a study's own tool call: '{"name":"convert","arguments":
    # {"value":"'); its character-level tokenizer spells anything else one character a token
    extra_tokens: List[str] = field(default_factory=list)
    # the critic's starting checkpoint (PPO); defaults to model_path
    critic_model_path: Optional[str] = None
    # jinja chat template that replaces the tokenizer's own
    custom_chat_template: Optional[str] = None
    # the token ids that end a response, in every engine (kept in it and trained on, as the eos
    # token). null: the tokenizer's eos_token_id and the model's generation_config.json
    # eos_token_id (an id or a list: Qwen2.5-Instruct's <|im_end|> and <|endoftext|>,
    # Llama-3-Instruct's <|eot_id|>...), what vLLM stops on by itself; [] none (max_tokens only)
    stop_token_ids: Optional[List[int]] = None
    # how the OpenAI endpoint reads tool calls in this model's replies (rft/data/tool_calls.py):
    # hermes (<tool_call>{json}</tool_call>: Qwen2.5/3, Hermes, tiny_tools) | mistral | module.function
    tool_call_parser: str = "hermes"
    max_prompt_tokens: int = 1024
    max_response_tokens: int = 1024
    # defaults to max_prompt_tokens + max_response_tokens
    max_model_len: Optional[int] = None
    # float32 | bfloat16 | float16
    dtype: str = "bfloat16"
    trust_remote_code: bool = False
    # the attention kernel: sdpa | flash_attention_2 | eager; null: transformers' default (sdpa)
    attn_implementation: Optional[str] = None
    # the trainer's output layer (logits, log-probs) in float32 for a bfloat16/float16 model:
    # narrows the gap between the trainer's and the engine's log-probs
    fp32_lm_head: bool = False
    # LoRA adapters (PEFT) on a frozen base; rank 0: train every weight (rft/trainer/lora.py)
    lora: LoraConfig = field(default_factory=lambda: LoraConfig())
    # the model's config.json numbers (hidden_size, intermediate_size, num_hidden_layers,
    # num_attention_heads, num_key_value_heads, head_dim, vocab_size, tie_word_embeddings) for the
    # dry run's memory estimate before the model is on this machine; its own config.json wins
    architecture: Optional[Dict[str, Any]] = None


@dataclass
class FormatConfig:
    # plaintext: the prompt is a string in prompt_key; messages: a list of chat messages
    prompt_type: PromptType = PromptType.plaintext
    prompt_key: str = "question"
    # the reference answer (a taskset: task.answer, what the reward function checks; a training
    # dataset: the response to learn); null for a taskset whose reward needs none
    response_key: Optional[str] = "answer"
    messages_key: str = "messages"
    # a training dataset of `messages` rows (whole conversations): train on every assistant turn
    # of a row at once, as one sequence (the others' turns and the template's tokens masked
    # out), rather than on a prompt and one response (rft/data/chat.py conversation_ids)
    enable_concatenated_multi_turn: bool = False
    system_prompt: Optional[str] = None
    # preference pairs (DPO): columns of the preferred and the dispreferred response
    chosen_key: Optional[str] = None
    rejected_key: Optional[str] = None


@dataclass
class RolloutArgs:
    # 0 means greedy
    temperature: float = 1.0
    top_p: float = 1.0
    # -1 disables top-k
    top_k: int = -1
    # defaults to model.max_response_tokens
    max_tokens: Optional[int] = None
    # strings that end a response (kept in it); the end-of-sequence token always does
    stop: List[str] = field(default_factory=list)


@dataclass
class TasksetConfig:
    name: str = "taskset"
    # a JSONL/Parquet file, a directory of them, or a Hugging Face dataset id
    path: str = MISSING
    # datasets.load_dataset(name=...)
    subset_name: Optional[str] = None
    split: str = "train"
    format: FormatConfig = field(default_factory=FormatConfig)
    rollout_args: RolloutArgs = field(default_factory=RolloutArgs)
    # rollouts per task; defaults to algorithm.repeat_times (taskset) or 1 (eval tasksets)
    repeat_times: Optional[int] = None
    # the reward (rft/rewards/scoring.py): a name in rft.rewards.verifiers.REWARD_FNS (or a served reward: remote,
    # judge, reward_model; or module.function), or a list of parts
    # [{fn, weight, args, name, normalize}, ...] whose weighted sum is the reward and whose parts are
    # logged (reward/<name>/mean) and stored (Experience.reward_parts); defaults to
    # explorer_input.default_reward_fn_type (Trinity-RFT: the taskset's default_reward_fn_type)
    reward_fn: Any = None
    # name in rft.rollout.workflows.single_turn.WORKFLOWS (or module.function): how a task becomes
    # experiences (Trinity-RFT: default_workflow_type, and explorer_input.default_workflow_type)
    workflow: str = "single_turn"
    # keyword arguments the workflow takes (ctx.args)
    workflow_args: Dict[str, Any] = field(default_factory=dict)
    # an eval set's pass@k, for each k (<= repeat_times) listed; with repeat_times > 1 it also
    # reports mean@n, best@n and maj@n, each with its standard error (rft/rewards/eval_metrics.py)
    pass_k: List[int] = field(default_factory=list)
    # the reward at or above which a sample is correct (pass@k, maj@n)
    pass_threshold: float = 1.0
    # an eval set's task column (difficulty, source): its metrics also per value of that column
    group_by: Optional[str] = None


@dataclass
class ReasoningGymDataset:
    # a dataset of the reasoning-gym package (reasoning_gym.factory.DATASETS: basic_arithmetic,
    # chain_sum, spell_backward, ...); the fields are its DatasetSpec's
    name: str = MISSING
    # its share of the rows, relative to the other datasets' weights
    weight: float = 1.0
    # the dataset's own config keys (its <Name>Config dataclass: min_digits, operators, ...);
    # not seed or size, which reasoning_gym.seed and .size set
    config: Dict[str, Any] = field(default_factory=dict)


@dataclass
class ReasoningGymConfig:
    # task=reasoning_gym (rft/data/reasoning_gym.py): the datasets whose rows are mixed by weight
    datasets: List[ReasoningGymDataset] = field(default_factory=list)
    # training rows (the train split)
    size: int = 2000
    # held-out rows (the test split): distinct questions, none of them in the train split
    eval_size: int = 200
    # the data's seed (not the run's: every training seed sees the same rows)
    seed: int = 0
    # teacher_answer (the SFT warm-up's demonstrations) is the answer with its last character one
    # too high (9 -> 0, z -> a) in this share of the rows, as the embedded tasks' sloppy teacher
    teacher_error_rate: float = 0.0


@dataclass
class ExplorerInputConfig:
    taskset: TasksetConfig = field(default_factory=TasksetConfig)
    eval_tasksets: List[TasksetConfig] = field(default_factory=list)
    # the reward of a taskset without reward_fn (a name, or a list of parts as reward_fn takes)
    default_reward_fn_type: Any = "exact_match"
    # name in rft.data.tasks.GENERATORS: writes the taskset files when they are missing
    generator: Optional[str] = None
    # generator=reasoning_gym: which of reasoning-gym's datasets, how many rows, which seed
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)


@dataclass
class ReplayBufferConfig:
    # put experiences back after they are read, to be read again (queue buffers only)
    enable: bool = False
    # seconds before a read experience can be read again
    reuse_cooldown_time: Optional[float] = None
    # name in rft.data.experience.PRIORITY_FNS: which ready experience is read first
    priority_fn: str = "linear_decay"
    # linear_decay: priority = policy_version - decay * times_used
    priority_fn_args: Dict[str, Any] = field(default_factory=lambda: {"decay": 2.0})


@dataclass
class ExperienceBufferConfig:
    name: str = "experience_buffer"
    # queue: in memory between explorer and trainer (bounded by capacity);
    # sql: a SQLite database at path (durable, several writers, a read cursor that survives restarts);
    # file: a JSONL file at path. As the trainer's input, a file that is not one of stored
    #       experiences is read as a dataset of prompt/response rows (an SFT or DPO stage)
    storage_type: StorageType = StorageType.queue
    path: Optional[str] = None
    split: str = "train"
    format: FormatConfig = field(default_factory=FormatConfig)
    # seconds the trainer waits for a full batch; then it trains on what arrived (none: an error)
    max_read_timeout: float = 1800.0
    # a dataset's held-out split (a file read as a dataset): a reward model (algorithm=rm) reports its
    # accuracy on the pairs there (eval/pair_accuracy: the chosen response scored above the
    # rejected one) every explorer.eval_interval steps and at its last. null: no such eval
    eval_split: Optional[str] = None
    # queue: most experiences held; a writer waits for room (back-pressure)
    capacity: int = 100_000
    replay_buffer: ReplayBufferConfig = field(default_factory=ReplayBufferConfig)


@dataclass
class TrainerInputConfig:
    experience_buffer: ExperienceBufferConfig = field(default_factory=ExperienceBufferConfig)
    # extra datasets the trainer reads by name (algorithm=mix reads algorithm.sft_buffer from here);
    # each value has the keys of experience_buffer (checked when read; typed dict values cannot be
    # added from the command line)
    auxiliary_buffers: Dict[str, Any] = field(default_factory=dict)


@dataclass
class BufferConfig:
    # tasks per step; do not multiply by algorithm.repeat_times yourself
    batch_size: int = 32
    # experiences per step; defaults to batch_size * algorithm.repeat_times
    train_batch_size: Optional[int] = None
    total_epochs: int = 1
    # if set, total_epochs is ignored
    total_steps: Optional[int] = None
    explorer_input: ExplorerInputConfig = field(default_factory=ExplorerInputConfig)
    trainer_input: TrainerInputConfig = field(default_factory=TrainerInputConfig)


@dataclass
class RolloutModelConfig:
    # hf: transformers generate (the CPU default); vllm: vLLM (pip install -e .[vllm]; Trinity-RFT's
    # vllm and vllm_async); a name of rft.registry.ENGINES or the dotted path of a study's own
    # engine class
    engine_type: str = "hf"
    engine_num: int = 1
    tensor_parallel_size: int = 1
    # hf: sequences per generate() call inside the engine
    generate_batch_size: int = 256
    # vllm: the share of GPU memory the engine may take (weights + KV cache)
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = False
    # vllm: no CUDA graphs (faster start, slower decoding; CPU needs true)
    enforce_eager: bool = True
    # vllm: float32 | bfloat16 | float16; null: model.dtype
    dtype: Optional[str] = None
    # vllm: the engine's own seed; null: 0. Each request samples with a seed of its own, from the
    # run's seed and the step (rft.data.readers.step_seed), whatever this is
    seed: Optional[int] = None
    # vllm on GPU: release weights and KV cache while the trainer trains (colocated explorer and
    # trainer, sync_offset=0); not available on CPU
    enable_sleep_mode: bool = False
    # vllm on CPU: GiB of memory for the KV cache (VLLM_CPU_KVCACHE_SPACE)
    cpu_kvcache_space_gb: int = 1
    # serve /v1/chat/completions and /v1/completions from this engine (rft/serving/openai_api.py) on
    # 127.0.0.1 with a per-explorer token, for agent code written against the OpenAI client
    # (workflow: openai_agent); the auxiliary models are served too, under their names
    enable_openai_api: bool = False
    # record every policy call's prompt ids, sampled ids and log-probs: the openai_agent
    # workflow's experiences (false: served only, nothing to train on; Trinity-RFT's default)
    enable_history: bool = True


@dataclass
class AuxiliaryModelConfig:
    # what a workflow calls it: ctx.auxiliary[name], or `model=name` on the OpenAI endpoint
    name: str = MISSING
    # model_path, builder, dtype, max_response_tokens, ... as the policy's `model`
    model: ModelConfig = field(default_factory=ModelConfig)
    # engine_type, and the engine's settings, as explorer.rollout_model
    rollout_model: RolloutModelConfig = field(default_factory=RolloutModelConfig)


@dataclass
class OverRolloutConfig:
    # each step waits for (1 - ratio) of its tasks, then at most wait_after_min seconds for the rest;
    # the rest are dropped and counted (rollout/over_rollout_dropped)
    ratio: float = 0.0
    wait_after_min: float = 30.0


@dataclass
class ExplorerConfig:
    name: str = "explorer"
    rollout_model: RolloutModelConfig = field(default_factory=RolloutModelConfig)
    # extra engines a workflow may call (a judge, a teacher, a user simulator): each explorer
    # loads them beside its rollout engine, on its device; never trained, never synced
    auxiliary_models: List[AuxiliaryModelConfig] = field(default_factory=list)
    # concurrent workflow runners per engine: tasks whose reward functions run at the same time
    runner_per_model: int = 8
    # seconds a task's workflow (reward included) may take before it counts as failed
    max_timeout: float = 900.0
    # a failed or timed-out task is retried this many times, then recorded as failed
    max_retry_times: int = 2
    over_rollout: OverRolloutConfig = field(default_factory=OverRolloutConfig)
    # mode=bench: evaluate only the newest checkpoint (false: every checkpoint and the starting model)
    bench_on_latest_checkpoint: bool = False
    # mode=bench: evaluate only the starting model (model.model_path), no trained run needed
    bench_on_starting_model: bool = False
    # evaluate on buffer.explorer_input.eval_tasksets every this many steps (and after the last)
    eval_interval: int = 100
    # evaluate before the first step (skipped on resume)
    eval_on_startup: bool = True
    # stop the run after this many steps in a row in which every task failed (its reward function
    # or environment raised or timed out each time; a run of fewer steps: after all of them), or at
    # an eval in which every task of a set failed: nothing can be learned or measured (0: never stop)
    max_failed_steps: int = 3
    # seconds to wait for Ray to restart a dead explorer before the run stops
    restart_timeout: float = 300.0
    # generation is interruptible (synchronizer.sync_style=dynamic_by_explorer, mode=both): responses are
    # generated partial_chunk_tokens at a time; new weights go in between chunks (the sequences in
    # flight keep their tokens, the prefix is encoded again under the new weights), and an explore
    # step returns as soon as it has its batch_size finished groups: the unfinished ones go on in
    # the next step instead of holding this one (each token records the version that sampled it)
    partial_rollout: bool = False
    partial_chunk_tokens: int = 16
    # partial rollouts: groups in flight, in explore steps' worth (1.5: a step's and half the
    # next's); the tasks are taken in the order of the steps they belong to. Above 1, a step ends
    # on the groups that finish first and the long ones go on beside the next step's (the more,
    # the staler the long responses' first tokens)
    partial_in_flight: float = 1.5


@dataclass
class TrainerConfig:
    name: str = "trainer"
    # torch: one process; fsdp2: `ranks` data-parallel processes, the weights, gradients and
    # optimizer state sharded over them (torch FSDP2: nccl on GPU, gloo on CPU); a name of
    # rft.registry.TRAINER_BACKENDS or the dotted path of a study's own trainer class
    trainer_strategy: str = "torch"
    # fsdp2: trainer processes; null: one per GPU the explorers leave (2 on a CPU-only cluster)
    ranks: Optional[int] = None
    # save a resumable checkpoint every this many steps (and after the last)
    save_interval: int = 100
    # experiences per optimizer step (verl: ppo_mini_batch_size); defaults to train_batch_size
    mini_batch_size: Optional[int] = None
    # experiences per forward/backward (verl: ppo_micro_batch_size_per_gpu)
    micro_batch_size_per_gpu: int = 8
    # passes over each step's experiences (verl: ppo_epochs)
    ppo_epochs: int = 1
    grad_clip: float = 1.0
    # recompute each transformer block's activations in the backward (memory for compute)
    # (Trinity-RFT's verl trainer_config: actor_rollout_ref.model.enable_gradient_checkpointing)
    gradient_checkpointing: bool = False
    # pack each micro-batch's sequences end to end, attention never crossing from one to the
    # next, instead of padding every row to the longest: same log-probs, no compute on padding
    use_remove_padding: bool = True
    # with use_remove_padding and sdpa or eager attention: the rows of a group (same prompt ids)
    # are one sequence, the prompt computed once and each response attending to it (rft/trainer/logprobs.py);
    # for groups whose prompt is at least as long as their mean response. Same log-probs
    share_prompts: bool = True
    # micro-batches by token count (max_token_len_per_gpu) instead of micro_batch_size_per_gpu
    # rows, and data-parallel ranks' shares balanced by tokens (verl: use_dynamic_bsz)
    use_dynamic_bsz: bool = False
    # tokens per micro-batch with use_dynamic_bsz (counted as computed: with use_remove_padding
    # the rows' lengths, else rows x the longest); null: micro_batch_size_per_gpu x max_model_len
    max_token_len_per_gpu: Optional[int] = None
    # trainer=fsdp2: keep the sharded weights and gradients in CPU memory (the optimizer then
    # steps on the CPU); each block's shard goes to the device for its forward and backward
    param_offload: bool = False
    # trainer=fsdp2: keep Adam's moments in CPU memory between steps
    optimizer_offload: bool = False
    # trainer=fsdp2: the reference model's shards in CPU memory, each block copied to the device
    # for its forward (run once a step, forward only); on with param_offload
    ref_offload: bool = False
    # trainer=fsdp2: PPO's critic (weights, gradients, Adam) in CPU memory, as param_offload keeps
    # the policy's; on with param_offload
    critic_offload: bool = False
    # trainer=fsdp2: mixed precision. The weights, gradients and Adam's moments in float32 while
    # the forward and backward compute in model.dtype (bfloat16: FSDP2 casts each block's weights
    # as it gathers them, and reduces gradients in float32); updates smaller than a bfloat16
    # weight's rounding step are kept, not lost. The engines get the weights cast to model.dtype,
    # the trainer's compute weights exactly; checkpoints keep float32 (a resume loses nothing)
    fp32_master_weights: bool = False
    # keep only the newest this many checkpoints of a stage (null: all); the oldest are deleted
    # after each save (Trinity-RFT's verl trainer_config: trainer.max_actor_ckpt_to_keep)
    max_ckpt_to_keep: Optional[int] = None
    # LoRA runs: write the merged model (hf/) at every save (always), only at the stage's last
    # step (last), or never; the adapter (adapter/, what resume reads) is always written. Full
    # fine-tuning writes hf/ at every save: it is what resume reads (Trinity-RFT's default, last,
    # is refused there with that reason)
    save_hf_checkpoint: str = "always"
    # resume from this checkpoint (<run>/<stage>/checkpoints/step_<N>) instead of the newest;
    # newer ones of the stage are moved aside (step_<N>.superseded-<time>)
    resume_from_path: Optional[str] = None
    # compute log-probs and entropy this many tokens at a time, each chunk's logits recomputed in
    # the backward: the [tokens, vocab] float32 logits never exist whole; null: all at once
    logprob_chunk_size: Optional[int] = None
    # an update in one optimizer step does not forward the rows whose advantages are all 0 when
    # the loss declares that such a row adds nothing (GRPO's groups whose rewards are all equal),
    # fresh or stale: same gradient, less compute; the ratio's metrics are over the rows forwarded
    skip_zero_advantage: bool = True


@dataclass
class SynchronizerConfig:
    # memory: through the Ray object store; checkpoint: through safetensors files on disk;
    # collective: torch.distributed broadcast (nccl on GPU, gloo on CPU) (Trinity: nccl)
    sync_method: SyncMethod = SyncMethod.memory
    # steps between weight syncs from trainer to explorer
    sync_interval: int = 1
    # the explorer runs this many steps ahead of the trainer (bounded off-policy; 0: on-policy);
    # null: 1 where explorers and trainer have resources of their own and so can run side by side
    # (Ray, mode=both, not colocated), else 0 (rft.plan.placement.sync_offset). Trinity-RFT's
    # guide sets 0: synchronizer.sync_offset=0 for its on-policy schedule
    sync_offset: Optional[int] = None
    # seconds to wait for a sync before failing
    sync_timeout: float = 1200.0
    # the staleness bound: experiences generated more than this many trainer steps ago are
    # dropped and counted (staleness/dropped); null: no bound
    max_staleness: Optional[int] = None
    # fixed: the explorers take new weights between explore steps, on the schedule above (a run
    # is a function of its config). dynamic_by_explorer (Trinity's name): the trainer takes a batch
    # as soon as the buffer holds one, publishes its weights after every step, and each explorer
    # takes the newest at its next safe point (between generate chunks with
    # explorer.partial_rollout, else between explore steps); rft/runtime/dynamic.py
    sync_style: SyncStyle = SyncStyle.fixed
    # dynamic_by_explorer + explorer.partial_rollout, a test mode: explore step s takes the weights
    # of training step s right after its first generate chunk, waiting for them, and at no other
    # point, so the schedule (which version wrote each token) is the same in every run and a
    # resumed run equals an uninterrupted one bit for bit (the explorer waits for the trainer)
    fixed_interrupts: bool = False
    # mode=explore: take new weights from the newest checkpoint of this train-mode stage directory
    # (<run>/<stage>, or its checkpoints/; a run of several stages: <run>, its stage of this stage's
    # name) every sync_interval steps; null: keep the starting weights
    checkpoint_dir: Optional[str] = None


@dataclass
class MonitorConfig:
    # any of: tensorboard, wandb, mlflow (console and metrics.jsonl are always on). A list, where
    # Trinity-RFT's is one name: monitor=wandb, or 'monitor.monitor_type=[wandb]'
    monitor_type: List[str] = field(default_factory=lambda: ["tensorboard"])
    # mlflow: where runs go (Trinity-RFT: monitor_args.uri); null: the SQLite store
    # <checkpoint_root_dir>/<project>/mlflow.db (its artifacts beside it in mlartifacts/); or a
    # server's http(s):// address
    mlflow_tracking_uri: Optional[str] = None
    # metrics shown beside the progress bar
    console_keys: List[str] = field(
        default_factory=lambda: ["reward/mean", "eval/accuracy", "loss/policy", "timing/step_s"]
    )
    # write <stage>/monitor/timeline.json (open in Perfetto or chrome://tracing); Ray only
    enable_ray_timeline: bool = False
    # a local Ray instance with its dashboard (http://127.0.0.1:8265) and metrics export; off,
    # Ray's processes leave the cores to the explorer and trainer
    ray_dashboard: bool = False


@dataclass
class DeviceMappingConfig:
    # which devices (0 .. node_num x gpu_per_node - 1, node by node; on CPU, slots of
    # cpus_per_actor CPUs) each role's processes use, as ROLL's device_mapping: roles whose lists
    # overlap share those devices (colocated), disjoint lists are separated. null: the counts and
    # cluster.colocate place them (rft/plan/devices.py)
    # a trainer rank on each (trainer=torch: one device)
    trainer: Optional[List[int]] = None
    # tensor_parallel_size consecutive devices on one node per engine, engine by engine
    explorer: Optional[List[int]] = None
    # the reference model and the critic live in the trainer's ranks: the trainer's devices or null
    reference: Optional[List[int]] = None
    critic: Optional[List[int]] = None
    # one device per reward-model worker, in the order the dry run lists them
    reward_model: Optional[List[int]] = None


@dataclass
class ClusterConfig:
    # ray: explorer and trainer are Ray actors; inline: the same objects in this process
    backend: Backend = Backend.ray
    # None starts a local Ray instance; "auto" joins a running cluster; or "host:port"
    ray_address: Optional[str] = None
    # CPUs for a locally started Ray instance (None: all of them)
    num_cpus: Optional[int] = None
    node_num: int = 1
    gpu_per_node: int = 0
    # GiB of memory of each GPU, for the plan's memory estimate (rft/plan/memory.py); null: this
    # machine's GPUs' (nvidia-smi), or 80 where it has none (a login node planning a GPU job)
    gpu_memory_gb: Optional[float] = None
    # CPUs reserved by each actor; also its torch thread count
    cpus_per_actor: int = 1
    # torch threads in each explorer and trainer actor; null: cpus_per_actor, except with Ray on
    # CPU and synchronizer.sync_offset=0, where the actors take turns (the explorer waits while
    # the trainer trains, and back) and each uses the CPUs they reserve together
    # (rft.plan.placement.torch_threads)
    threads_per_actor: Optional[int] = None
    # explorers and trainer share devices (true) or get their own (false); on GPU, the trainer
    # gets the node_num x gpu_per_node GPUs the explorers' engines do not take
    colocate: bool = False
    # each role's devices by index (ROLL's device_mapping), in place of the counts' placement
    device_mapping: DeviceMappingConfig = field(default_factory=DeviceMappingConfig)
    # times Ray restarts a dead explorer actor (its weights are re-synced, its step re-run)
    max_actor_restarts: int = 3
    # seconds a local Ray instance may take to start (ray.init) before the run stops, saying why;
    # a line says how long it has waited from 15 s on (rft/runtime/reaper.py)
    init_timeout_s: float = 180.0


@dataclass
class OperatorConfig:
    # a name of rft.data.pipeline.TASK_OPERATORS (task_pipeline) or EXPERIENCE_OPERATORS
    # (experience_pipeline), or the dotted path of a study's own function (module.function)
    name: str = MISSING
    # the operator's keyword arguments (each operator's docstring in rft/data/operators.py)
    args: Dict[str, Any] = field(default_factory=dict)


@dataclass
class TaskPipelineConfig:
    # run in order over buffer.explorer_input.taskset's rows before the run (Trinity read the
    # rows of `inputs`; here the taskset's path, split and format); the output, cached in
    # <cache_dir>/task_pipeline/<fingerprint of the input files and operators>, is the taskset the
    # explorers read. Empty: the taskset as it is
    operators: List[OperatorConfig] = field(default_factory=list)


@dataclass
class ExperiencePipelineConfig:
    # run in order over each explore step's experiences where they enter the buffer (reward
    # shaping mappers, filters); empty: none
    operators: List[OperatorConfig] = field(default_factory=list)


@dataclass
class OnlineCurriculumConfig:
    # draw each step's tasks by priority p(1 - p) + eps, p the task's pass rate over its last
    # `window` rollouts (reward >= the taskset's pass_threshold; a task not yet seen counts as
    # p = 0.5): tasks always or never solved are drawn less. false: epoch-wise shuffles
    enable: bool = False
    # a task's newest rollouts its pass rate counts
    window: int = 8
    # the floor of every task's weight (> 0: no task is never drawn)
    eps: float = 0.05


@dataclass
class DataProcessorConfig:
    task_pipeline: TaskPipelineConfig = field(default_factory=TaskPipelineConfig)
    experience_pipeline: ExperiencePipelineConfig = field(default_factory=ExperiencePipelineConfig)
    online_curriculum: OnlineCurriculumConfig = field(default_factory=OnlineCurriculumConfig)


class LogLevel(StrEnum):
    """log.level: logging's level names (another name stopped each actor at its start, a traceback)."""
    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"
    CRITICAL = "CRITICAL"


@dataclass
class LogConfig:
    # DEBUG | INFO | WARNING | ERROR | CRITICAL, for log/<actor>.log
    level: LogLevel = LogLevel.INFO


@dataclass
class Config:
    project: str = "rft"
    name: str = "run"
    # both: explorer + trainer; explore: explorer only, writing buffer.trainer_input.experience_buffer;
    # train: trainer only, from that buffer (or a dataset); bench: evaluate saved checkpoints
    mode: Mode = Mode.both
    seed: int = 42
    checkpoint_root_dir: str = "./checkpoints"
    # where built models and generated datasets are cached (outside the repo)
    cache_dir: str = "~/.cache/rft"
    # resume from the latest checkpoint in <checkpoint_root_dir>/<project>/<name>/
    continue_from_checkpoint: bool = True
    # resume even though the config differs from the one the run was started with (the run stops
    # and lists the differences otherwise); the accepted changes go to <stage>/config_changes.log
    resume_with_changes: bool = False
    # finished stages that a later stage starts from (warm-ups; never a run's last stage) are
    # published here and reused by any stage with the same config, starting model and data (a
    # sweep's shared warm-up runs once per seed); null: no reuse
    stage_cache_dir: Optional[str] = None
    # print the batch plan and exit, without starting Ray or loading a model
    dry_run: bool = False
    # the metric whose last value (in the last stage's metrics.jsonl) the run returns: what a
    # Hydra sweeper such as hydra-optuna-sweeper optimizes
    objective: str = "eval/accuracy"
    # each stage is a dict merged onto this config (stage_name required); run in order
    stages: List[Any] = field(default_factory=list)
    # the stage name, filled in per stage
    stage_name: Optional[str] = None
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    explorer: ExplorerConfig = field(default_factory=ExplorerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    synchronizer: SynchronizerConfig = field(default_factory=SynchronizerConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    log: LogConfig = field(default_factory=LogConfig)
    # the data pipelines (rft/data/pipeline.py) and the online curriculum (rft/data/curriculum.py)
    data_processor: DataProcessorConfig = field(default_factory=DataProcessorConfig)


def near_args(unknown, known, section: str = "") -> str:
    """The " Did you mean ...?" sentence for each misspelt key of a free-form args dict (workflow_args,
    reward_fn[i].args, advantage_args): the list of what it takes alone left the user to spot max_turn
    against max_turns. `section` ("algorithm"): the schema section the function reads the rest of its
    settings from; a key near none it takes but near one of that section's is named as that key, to
    be set there (GAE's lambda given to advantage_args as lamda, lambda or gae_lambda: algorithm.lam)."""
    import difflib

    def close(name, names):
        return next(iter(difflib.get_close_matches(name, names, n=1, cutoff=0.6)), None)

    own = [str(k) for k in known]
    near, moved = [], []
    for u in map(str, unknown):
        if close(u, own):
            near.append(f"{close(u, own)} (not {u})")
        elif keys := _section_keys(u, section):
            moved.append((u, keys))
    said = near + [" and ".join(keys) + (f" (not {u})" if [u] != [k.rpartition(".")[2] for k in keys] else "")
                   for u, keys in moved]
    out = f" Did you mean {', '.join(said)}?" if said else ""
    if moved:
        one = sum(len(keys) for _, keys in moved) == 1
        out += (f" {'That is a key' if one else 'Those are keys'} of {section} itself, which the function reads "
                f"from cfg, not {'an argument' if one else 'arguments'}: set "
                f"{', '.join(k + '=<value>' for _, keys in moved for k in keys)}, "
                f"and drop {', '.join(u for u, _ in moved)} from the args.")
    return out


def _section_keys(name: str, section: str) -> list[str]:
    """The keys of schema section `section` that an argument `name` stands for: those another
    system's key of that name is (rft.foreign_keys: clip_ratio is verl's clip_ratio_low and
    clip_ratio_high, where the nearest spelling, clip_ratio_c, is the dual clip), else a setting
    (not a sub-section such as args or optimizer) that `name` is a misspelling of, word for word
    (`_spelt_as`), or its last words are (another system's prefix on the name: gae_lambda).
    Nearness of spelling alone named keys of other meanings, which a user following the hint set
    to no effect (TRL's delta and kl_beta as dpo_beta, clip_ratio_dual as clip_ratio_low, kl_target
    as args): no hint is better than a wrong one."""
    if not section:
        return []
    import difflib

    from omegaconf import DictConfig, OmegaConf

    from rft.foreign_keys import FOREIGN_KEYS

    theirs = [o for k in FOREIGN_KEYS if "*" not in k and k.rpartition(".")[2] == name
              for o in FOREIGN_KEYS[k].ours or ()]
    if any(o.rpartition(".")[0] != section for o in theirs):
        # another system's name of a key outside the section too (lr: verl's actor's is algorithm.optimizer.lr,
        # its critic's algorithm.critic_lr): the one in the section alone was named, a setting GRPO never reads
        return []
    if theirs:
        return list(dict.fromkeys(theirs))
    node = OmegaConf.select(OmegaConf.structured(Config), section)
    if not isinstance(node, DictConfig):  # a stage's (stages.0.algorithm): not a section of the schema
        return []
    there = [k for k in node.keys() if not isinstance(node._get_node(k), DictConfig)]
    words = name.split("_")
    for tail in ("_".join(words[i:]) for i in range(len(words))):  # the whole name first, then its last words
        spelt = [k for k in there if _spelt_as(tail, k)]
        if spelt:
            return [f"{section}.{max(spelt, key=lambda k: difflib.SequenceMatcher(None, tail, k).ratio())}"]
    return []


def _spelt_as(name: str, key: str) -> bool:
    """Whether `name` is `key` misspelt: in another case (clip_ratio_C), its words joined or split
    (entropycoef, gamma_), or as many words, each the key's word, a typo of it (entropy_coeff), the
    word the key's cuts short (lambda, lamda: lam) or the key's word cut short (hi: high)."""
    import difflib

    name = name.lower()  # the schema's keys are lower case
    if name.replace("_", "") == key.replace("_", ""):
        return True
    pairs = list(zip(name.split("_"), key.split("_")))
    return len(pairs) == len(name.split("_")) == len(key.split("_")) and all(
        a == b or difflib.SequenceMatcher(None, a, b).ratio() >= 0.8 or (len(b) >= 3 and a.startswith(b))
        or (len(a) >= 2 and b.startswith(a)) for a, b in pairs)


def lora_adapter_sync(model_cfg) -> bool:
    """Whether the engines get the LoRA adapters alone (model.lora.sync=adapter), not merged weights."""
    lora = model_cfg.get("lora")
    return bool(lora) and (lora.rank or 0) > 0 and str(lora.get("sync", "merged")) == "adapter"


def fixed_policy(cfg) -> bool:
    """Whether the stage's explorers serve its starting policy throughout, never the trainer's
    weights: a reward model learning from the groups they sample (algorithm.rm_pairs=groups, which
    the plan allows only with algorithm=rm and mode=both)."""
    return cfg.mode == "both" and str(cfg.algorithm.get("rm_pairs", "dataset")) == "groups"


DEVICE_ROLES = ("trainer", "explorer", "reference", "critic", "reward_model")


def device_mapping(cfg) -> dict[str, list[int]] | None:
    """The roles' device lists of cluster.device_mapping, or None where it names none."""
    m = cfg.cluster.get("device_mapping") or {}
    got = {role: list(m[role]) for role in DEVICE_ROLES if m.get(role) is not None}
    return got or None


def colocated(cfg) -> bool:
    """The engines share devices with the trainer: cluster.colocate, or device_mapping lists of the
    trainer and the explorers that overlap (then the engines may sleep while it trains)."""
    m = device_mapping(cfg)
    if m is None:
        return bool(cfg.cluster.colocate)
    return bool(set(m.get("trainer", ())) & set(m.get("explorer", ())))


def fingerprint(node) -> str:
    """12 hex digits of a config value (resolved, as sorted JSON): `${rft.fingerprint:${a.section}}`
    names the data made from that section, so a changed section names other data, never stale data
    (conf/task/reasoning_gym.yaml's path)."""
    import hashlib
    import json

    from omegaconf import Container, OmegaConf

    value = OmegaConf.to_container(node, resolve=True, enum_to_str=True) if isinstance(node, Container) else node
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:12]


def register_configs() -> None:
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name="rft_schema", node=Config)
    OmegaConf.register_new_resolver("rft.fingerprint", fingerprint, replace=True)


register_configs()


def schema_keys() -> list[str]:
    """Every dotted key of the schema (nodes and leaves)."""
    from omegaconf import DictConfig, OmegaConf

    out = []

    def walk(node, prefix):
        for k in node.keys():
            out.append(prefix + k)
            child = node._get_node(k)
            if isinstance(child, DictConfig) and OmegaConf.get_type(child) not in (dict, None):
                walk(child, prefix + k + ".")

    walk(OmegaConf.structured(Config), "")
    return out


def key_mistake(schema, key: str, adding: bool = False, prefix: str = "") -> str | None:
    """Why the schema (OmegaConf.structured(Config)) has no dotted `key`, naming the nearest keys;
    None when it has it, or when the key is inside a dict- or list-typed value (checked when
    planning). A stage's keys (`stages.<i>.<key>`) are the whole config's; `prefix` is put before
    the names suggested for one."""
    from omegaconf import DictConfig, ListConfig, OmegaConf
    from omegaconf._utils import is_structured_config
    from omegaconf.nodes import AnyNode

    from rft.foreign_keys import foreign_key

    node, parts = schema, key.split(".")
    for i, part in enumerate(parts):
        if isinstance(node, ListConfig) and not part.lstrip("-").isdigit():
            # Hydra raised a TypeError ("Index 'sft_warmup' (str) is not an int") under a traceback
            parent = ".".join(parts[:i])
            return (f"{parent} is a list, so its items are addressed by their index ({parent}.0.<key> for the "
                    f"first), not by a name ('{part}'). `python run.py --cfg job -p {parent}` prints it.")
        if isinstance(node, ListConfig):
            element = node._metadata.element_type
            if i == 1 and parts[0] == "stages" and len(parts) > 2:
                # a stage is merged onto the whole config, so its keys are the schema's: a typo in
                # one was the planner's "Key 'totalsteps' not in 'BufferConfig'", with no file or
                # line, and on the command line Hydra's "use +", whose + the planner then refused
                return key_mistake(schema, ".".join(parts[2:]), prefix=f"{prefix}stages.{part}.")
            if not is_structured_config(element):
                return None  # free-form items: checked when planning
            node = OmegaConf.structured(element)  # a typed list's item (an eval set): its schema
            continue
        if isinstance(node, DictConfig) and (OmegaConf.get_type(node) is dict or (
                node._is_none() and not is_structured_config(node._metadata.ref_type))):
            return None  # free-form values below (a dict, or one null by default): checked when planning
        if isinstance(node, AnyNode):
            return None  # a value typed Any (reward_fn's list of parts): checked when planning
        if not isinstance(node, DictConfig) or part not in node.keys():
            # another system's key (verl's algorithm.adv_estimator): whose it is and rft's for it,
            # not the nearest of rft's names, which would mislead
            foreign = foreign_key(key, prefix)
            if foreign:
                return foreign
            parent = ".".join(parts[:i])
            keys = schema_keys()
            siblings = [f"{parent}.{k}".lstrip(".") for k in node.keys()] if isinstance(node, DictConfig) else []
            # the same name under another parent (trainer.lr -> algorithm.optimizer.lr), then
            # the nearest names at the same level (a typo)
            near = [k for k in keys if k.rpartition(".")[2] == parts[-1] and len(parts) == i + 1][:2]
            near += [k for k in _close(parts, i, siblings, keys) if k not in near]
            where = f"'{OmegaConf.get_type(node).__name__}'"
            hint = f" Did you mean {' or '.join(prefix + k for k in near[:3])}?" if near else ""
            also = (f" ({where} is a section of the schema: a + adds keys only to free-form ones such as "
                    f"stages)") if adding else ""
            return (f"Key '{part}' not in {where}{also}.{hint} The keys, each with a comment, are in "
                    f"rft/config.py; `python run.py --cfg job` prints the composed config.")
        node = node._get_node(part)
    return None


def _close(parts: list[str], i: int, siblings: list[str], keys) -> list[str]:
    """The siblings nearest the missing part `parts[i]` (a typo), each with the rest of the key after
    it where that is a key (else the nearest sibling alone): a misspelt section (synchroniser.sync_interval,
    a British spelling) was compared whole with the section names and got no suggestion."""
    import difflib

    upto, rest = ".".join(parts[: i + 1]), ".".join(parts[i + 1:])
    close = difflib.get_close_matches(upto, siblings, n=2, cutoff=0.6)
    if not rest:
        return close
    full = [f"{k}.{rest}" for k in close if f"{k}.{rest}" in keys]
    return full or close[:1]


def flat(cfg) -> dict[str, Any]:
    """A resolved config as {dotted key: value}; lists are values."""
    from omegaconf import OmegaConf

    tree = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True) if not isinstance(cfg, dict) else cfg
    out: dict[str, Any] = {}

    def walk(node, prefix):
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = node

    walk(tree, "")
    return out


class Frozen(dict):
    """A resolved config node as a dict whose keys also read as attributes (`cfg.trainer.grad_clip`),
    read-only. The explorer and trainer read their config many times a step, and each level of an
    OmegaConf lookup costs ~6 us (~0.5 ms a step in all); they never change it, so they get it
    as this (rft.config.frozen) and a read costs what a dict lookup does. A key named like a dict
    method (`items`, `get`, ...) reads only as `cfg["items"]`; the schema has none. The runtime
    hands it to them (rft.runtime.actors.start_trainer, start_explorers); built directly, they take a
    DictConfig as well."""

    __slots__ = ()

    def __getattr__(self, key: str):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"config has no key {key!r}") from None

    def __setattr__(self, key: str, value) -> None:
        raise TypeError(f"the config is read-only here (setting {key!r})")

    def _readonly(self, *args, **kwargs):
        raise TypeError("the config is read-only here")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _readonly  # type: ignore[assignment]

    def __reduce__(self):  # pickled (to a Ray actor) as what it holds: dict's own would call __setitem__
        return (_frozen_tree, (dict(self),))


def _frozen_tree(node):
    if isinstance(node, dict):
        frozen_node = Frozen()
        for k, v in node.items():
            dict.__setitem__(frozen_node, k, _frozen_tree(v))
        return frozen_node
    if isinstance(node, list):
        return [_frozen_tree(v) for v in node]
    return node


def frozen(cfg) -> Frozen:
    """`cfg` (a DictConfig, or a dict) resolved, as a read-only Frozen tree; lists stay lists."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, Frozen):
        return cfg
    return _frozen_tree(OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg)
