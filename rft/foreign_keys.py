"""Keys of the systems our users come from (verl, ROLL, LightRFT/OpenRLHF, TRL), and rft's for each.

Someone who knows verl types `algorithm.adv_estimator=grpo` or `actor_rollout_ref.rollout.n=8`; the
schema's own check then suggested the nearest of rft's names ("Did you mean algorithm.gamma?"), or
nothing. `rft.config.key_mistake` asks `foreign_key` first, so such a key, on the command line, with
`+`, in an overlay or in a stage, is one paragraph naming whose key it is, rft's key or group choice
for it, and what differs in meaning (verl counts its mini-batch in prompts, rft in experiences), or
that rft has none. LightRFT's and OpenRLHF's keys are flags: run.py's `--name` check
(rft.plan.overlays.foreign_flag) reads the same table.

FOREIGN_KEYS is that table, a `Registry` like every name table: an entry is a key as its system
writes it (dotted where the system nests it; `section.*` for the rest of a section, tried after
the exact keys) and a `ForeignKey`. Its meanings were checked against each system's own
configuration reference and against rft/config.py; tests/test_foreign_keys.py checks that every
key of rft an entry names exists. A study may add its own: `FOREIGN_KEYS["my.key"] = ForeignKey(...)`.
Trinity-RFT's keys are rft's own names (rft/config.py's comments name its renamed ones); the table
holds those of its keys rft lacks or renamed, and its trainer.trainer_config, whose verl keys are verl's entries.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from rft.registry import Registry


@dataclass(frozen=True)
class ForeignKey:
    """Whose key it is, rft's keys or group choices for it (empty: none; None: not translated, a
    section's other keys), and what differs in meaning or value, as sentences."""

    systems: tuple[str, ...]
    ours: tuple[str, ...] | None = ()
    note: str = ""

    def message(self, prefix: str = "") -> str:
        """The paragraph (`prefix`: a stage's, stages.<i>., put before rft's keys)."""
        whose = f"that is {_owners(self.systems)} key, not rft's"
        if self.ours is None:
            return f"{whose}, and has no translation here: {self.note}"
        if not self.ours:
            return f"{whose}, and rft has no counterpart: {self.note}"
        # a group choice (algorithm=grpo) is the command line's; a key is a stage's too
        ours = [o if "=" in o else prefix + o for o in self.ours]
        named = ours[0] if len(ours) == 1 else ", ".join(ours[:-1]) + " and " + ours[-1]
        return f"{whose}; rft's {'is' if len(ours) == 1 else 'are'} {named}.{' ' + self.note if self.note else ''}"


def _owners(systems: tuple[str, ...]) -> str:
    names = [f"{s}'s" for s in systems]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def foreign_key(key: str, prefix: str = "") -> str | None:
    """The paragraph for a key rft's schema does not have when it is another system's (its entry,
    else the first section pattern it falls under); None when it is no other system's. A verl key
    under Trinity-RFT's trainer.trainer_config (which hands them to verl) is translated as verl's."""
    if key.startswith(_TRINITY_VERL + "."):
        inner = foreign_key(key[len(_TRINITY_VERL) + 1:], prefix)
        if inner:
            return f"{_TRINITY_VERL} holds verl's keys in Trinity-RFT; {key[len(_TRINITY_VERL) + 1:]}: {inner}"
        key = _TRINITY_VERL
    entry = FOREIGN_KEYS[key] if key in FOREIGN_KEYS else next(
        (FOREIGN_KEYS[p] for p in FOREIGN_KEYS if "*" in p and fnmatch.fnmatchcase(key, p)), None)
    return entry.message(prefix) if entry else None


VERL, ROLL, TRL, TRINITY = ("verl",), ("ROLL",), ("TRL",), ("Trinity-RFT",)
_TRINITY_VERL = "trainer.trainer_config"
LIGHTRFT = ("LightRFT", "OpenRLHF")  # LightRFT extends OpenRLHF: the same flags
OPENRLHF = LIGHTRFT[1:]
_TASKSET = "buffer.explorer_input.taskset"
_ROLLOUT = "explorer.rollout_model"
# sentences several entries share
_STEPS = ("ROLL counts pipeline steps, as rft counts steps (buffer.batch_size tasks each); TRL counts optimizer "
          "steps, of which a step here makes buffer.train_batch_size / trainer.mini_batch_size x "
          "trainer.ppo_epochs")
_KL_FNS = ("names are taken as they are (kl, mse and low_var_kl are k1, k2 and k3; abs); full has no counterpart; "
           "none turns the term off")
_OTHER = ("rft's keys, each with a comment, are in rft/config.py; `python run.py --cfg job` prints the composed "
          "config.")
_FORWARDS = ("One size for every forward of the trainer: the update's, and the log-probs of the policy and the "
             "reference.")

def _envs(systems: tuple[str, ...]) -> ForeignKey:
    return ForeignKey(systems, (), "set environment variables in the environment run.py starts from (a Ray instance "
                      "rft starts passes them to its workers).")


_ENVS = _envs(ROLL)
_WORKFLOWS = ("Trinity-RFT's math_workflow and simple_workflow are single_turn here (the default; the reward is "
              "named apart, reward_fn), a conversation with an environment multi_turn, an agent through the "
              "OpenAI API openai_agent, a study's own its dotted path (module.function).")
_TASKSET_STORAGE = ("a taskset is read from its path: a JSONL, Parquet or CSV file, a folder of them or a Hugging "
                    "Face dataset id (Trinity-RFT's file); there are no sql or queue tasksets. Remove the key.")
# Trinity-RFT's <fn>_args dicts: rft's algorithm section holds the built-in functions' settings itself
_FN_ARGS = (
    ("kl_loss_fn", "algorithm.kl_loss_coef", "Trinity-RFT's kl_coef is algorithm.kl_loss_coef (0.001 by default, "
                                             "as there)."),
    ("kl_penalty_fn", "algorithm.kl_penalty_coef", "Trinity-RFT's kl_coef is algorithm.kl_penalty_coef."),
    ("entropy_loss_fn", "algorithm.entropy_coef", "Trinity-RFT's entropy_coef is algorithm.entropy_coef."),
    ("policy_loss_fn", "algorithm.args", (
        "The built-in losses read the algorithm section's own keys (clip_ratio_low, clip_ratio_high, clip_ratio_c, "
        "loss_agg_mode); the mix algorithm's mu, the SFT term's weight, is nearest algorithm.sft_loss_weight "
        "(algorithm=mix adds sft_loss_weight x the SFT loss to the RL loss); a study's own loss takes its "
        "keywords from algorithm.args.")),
    ("advantage_fn", "algorithm.advantage_args", (
        "The built-in advantage functions read the algorithm section's own keys (gamma, lam, tau); a study's own "
        "function takes its keywords from algorithm.advantage_args.")),
)
# gspo's and gmpo's files set other bounds, of another quantity: a PPO-style 0.2 there is no translation
_CLIP = ("The ratio is clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]: give both the value. Not so under "
         "algorithm=gspo, whose bounds are the sequence's ratio's (3e-4 and 4e-4 there), or algorithm=gmpo, whose are "
         "the log-ratio's (0.4 there): 0.2 with them is another clip than PPO's.")
_NO_SP = ("there is no sequence parallelism; for long sequences lower trainer.max_token_len_per_gpu (with "
          "trainer.use_dynamic_bsz=true), or set trainer.logprob_chunk_size and trainer.gradient_checkpointing=true.")

FOREIGN_KEYS = Registry("a key of another system", shape="a ForeignKey (rft/foreign_keys.py)", table={
    # ---------------------------------------------------------------- verl (Hydra, dotted)
    "data.train_batch_size": ForeignKey(VERL, ("buffer.batch_size",), (
        "Both count prompts (tasks) per step, each sampled algorithm.repeat_times times; rft's "
        "buffer.train_batch_size is the step's experiences (batch_size x repeat_times).")),
    "data.max_prompt_length": ForeignKey(VERL, ("model.max_prompt_tokens",)),
    "data.max_response_length": ForeignKey(VERL, ("model.max_response_tokens",)),
    "data.train_files": ForeignKey(VERL, (f"{_TASKSET}.path",), "A JSONL or Parquet file, a folder of them or a "
                                   "Hugging Face dataset id."),
    "data.val_files": ForeignKey(VERL, ("buffer.explorer_input.eval_tasksets",), (
        "A list of tasksets, each with its own name and path.")),
    "data.prompt_key": ForeignKey(VERL, (f"{_TASKSET}.format.messages_key", f"{_TASKSET}.format.prompt_type"), (
        "verl's prompt column holds chat messages: here that is format.prompt_type=messages with the column in "
        "format.messages_key (format.prompt_key names a plain-text prompt's column).")),
    "actor_rollout_ref.model.path": ForeignKey(VERL, ("model.model_path",)),
    "actor_rollout_ref.model.enable_gradient_checkpointing": ForeignKey(VERL, ("trainer.gradient_checkpointing",)),
    "actor_rollout_ref.model.use_remove_padding": ForeignKey(VERL, ("trainer.use_remove_padding",),
                                                             "On by default here (verl: off)."),
    "actor_rollout_ref.model.trust_remote_code": ForeignKey(VERL, ("model.trust_remote_code",)),
    "actor_rollout_ref.model.lora_rank": ForeignKey(VERL, ("model.lora.rank",)),
    "actor_rollout_ref.model.lora_alpha": ForeignKey(VERL, ("model.lora.alpha",)),
    "actor_rollout_ref.actor.strategy": ForeignKey(VERL, ("trainer=fsdp2",), (
        "trainer=torch is one process; there is no Megatron backend.")),
    "actor_rollout_ref.actor.ppo_mini_batch_size": ForeignKey(VERL, ("trainer.mini_batch_size",), (
        "Both are global (all ranks) and make one optimizer step, but verl counts prompts, rft experiences "
        "(responses): verl multiplies its value by actor_rollout_ref.rollout.n itself, so ppo_mini_batch_size=16 "
        "with rollout.n=8 is trainer.mini_batch_size=128.")),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": ForeignKey(VERL, ("trainer.micro_batch_size_per_gpu",), (
        "Both count experiences per GPU in one forward and backward.")),
    "actor_rollout_ref.actor.ppo_micro_batch_size": ForeignKey(VERL, ("trainer.micro_batch_size_per_gpu",), (
        "verl's (deprecated) one is global: divide it by the data-parallel ranks.")),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": ForeignKey(VERL, (
        "trainer.micro_batch_size_per_gpu",), _FORWARDS),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": ForeignKey(VERL, (
        "trainer.micro_batch_size_per_gpu",), _FORWARDS),
    "actor_rollout_ref.actor.ppo_epochs": ForeignKey(VERL, ("trainer.ppo_epochs",)),
    "actor_rollout_ref.actor.use_dynamic_bsz": ForeignKey(VERL, ("trainer.use_dynamic_bsz",)),
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": ForeignKey(VERL, ("trainer.max_token_len_per_gpu",)),
    # the memory knobs Trinity-RFT's FAQ gives for an out-of-memory trainer
    "actor_rollout_ref.actor.entropy_from_logits_with_chunking": ForeignKey(VERL, ("trainer.logprob_chunk_size",), (
        "Tokens per chunk, not a switch: each chunk's logits are recomputed in the backward, so the whole "
        "[tokens, vocab] logits never exist at once.")),
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": ForeignKey(VERL, (), _NO_SP),
    "actor_rollout_ref.actor.grad_clip": ForeignKey(VERL, ("trainer.grad_clip",)),
    "actor_rollout_ref.actor.clip_ratio": ForeignKey(VERL, ("algorithm.clip_ratio_low", "algorithm.clip_ratio_high"),
                                                     _CLIP),
    "actor_rollout_ref.actor.clip_ratio_low": ForeignKey(VERL, ("algorithm.clip_ratio_low",)),
    "actor_rollout_ref.actor.clip_ratio_high": ForeignKey(VERL, ("algorithm.clip_ratio_high",)),
    "actor_rollout_ref.actor.clip_ratio_c": ForeignKey(VERL, ("algorithm.clip_ratio_c",), (
        "verl clips at 3.0 by default; here the default null is no dual clip.")),
    "actor_rollout_ref.actor.entropy_coeff": ForeignKey(VERL, ("algorithm.entropy_coef",)),
    "actor_rollout_ref.actor.loss_agg_mode": ForeignKey(VERL, ("algorithm.loss_agg_mode",), "The same four modes."),
    "actor_rollout_ref.actor.use_kl_loss": ForeignKey(VERL, ("algorithm.kl_loss_fn",), (
        "The KL loss term is on when algorithm.kl_loss_fn is k1, k2, k3 or abs (verl's low_var_kl is k3), off with "
        "none.")),
    "actor_rollout_ref.actor.kl_loss_coef": ForeignKey(VERL, ("algorithm.kl_loss_coef",)),
    "actor_rollout_ref.actor.kl_loss_type": ForeignKey(VERL, ("algorithm.kl_loss_fn",), f"verl's {_KL_FNS}."),
    "actor_rollout_ref.actor.optim.lr": ForeignKey(VERL, ("algorithm.optimizer.lr",)),
    "actor_rollout_ref.actor.optim.lr_warmup_steps": ForeignKey(VERL, ("algorithm.optimizer.warmup_steps",), (
        "Optimizer steps, as in verl; there is no ratio form (verl's -1).")),
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": ForeignKey(VERL, ("algorithm.optimizer.warmup_steps",), (
        "Give the optimizer steps; `dry_run=true` prints a stage's steps.")),
    "actor_rollout_ref.actor.optim.warmup_style": ForeignKey(VERL, ("algorithm.optimizer.warmup_style",)),
    "actor_rollout_ref.actor.optim.min_lr_ratio": ForeignKey(VERL, ("algorithm.optimizer.min_lr_ratio",)),
    "actor_rollout_ref.actor.optim.weight_decay": ForeignKey(VERL, ("algorithm.optimizer.weight_decay",)),
    "actor_rollout_ref.actor.fsdp_config.param_offload": ForeignKey(VERL, ("trainer.param_offload",),
                                                                    "With trainer=fsdp2."),
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": ForeignKey(VERL, ("trainer.optimizer_offload",),
                                                                        "With trainer=fsdp2."),
    "actor_rollout_ref.ref.fsdp_config.param_offload": ForeignKey(VERL, ("trainer.ref_offload",),
                                                                  "With trainer=fsdp2."),
    "actor_rollout_ref.rollout.n": ForeignKey(VERL, ("algorithm.repeat_times",), "Responses sampled per prompt."),
    "actor_rollout_ref.rollout.name": ForeignKey(VERL, ("explorer=vllm", "explorer=hf"), (
        "The engine is a config group here; there is no sglang engine.")),
    "actor_rollout_ref.rollout.temperature": ForeignKey(VERL, (f"{_TASKSET}.rollout_args.temperature",)),
    "actor_rollout_ref.rollout.top_p": ForeignKey(VERL, (f"{_TASKSET}.rollout_args.top_p",)),
    "actor_rollout_ref.rollout.top_k": ForeignKey(VERL, (f"{_TASKSET}.rollout_args.top_k",), "-1 disables it."),
    "actor_rollout_ref.rollout.gpu_memory_utilization": ForeignKey(VERL, (f"{_ROLLOUT}.gpu_memory_utilization",), (
        "The share of the GPU's whole memory vLLM takes (weights and KV cache), as verl's with vLLM 0.7 and later.")),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": ForeignKey(VERL, (f"{_ROLLOUT}.tensor_parallel_size",)),
    "actor_rollout_ref.rollout.enforce_eager": ForeignKey(VERL, (f"{_ROLLOUT}.enforce_eager",)),
    "actor_rollout_ref.rollout.dtype": ForeignKey(VERL, (f"{_ROLLOUT}.dtype",)),
    "algorithm.adv_estimator": ForeignKey(VERL, ("algorithm=<name>",), (
        "The algorithm is a config group here (conf/algorithm/): verl's grpo is algorithm=grpo, gae "
        "algorithm=ppo, rloo algorithm=rloo, reinforce_plus_plus algorithm=reinforce_pp, "
        "reinforce_plus_plus_baseline algorithm=reinforce_pp_baseline.")),
    "algorithm.norm_adv_by_std_in_grpo": ForeignKey(VERL, ("algorithm.advantage_fn",), (
        "verl's false (no division by the group's std) is algorithm.advantage_fn=dr_grpo (algorithm=dr_grpo "
        "also sets loss_agg_mode=seq-mean-token-sum-norm); true is grpo's.")),
    "algorithm.use_kl_in_reward": ForeignKey(VERL, ("algorithm.kl_penalty_fn",), (
        "The KL to the reference is subtracted from the reward when algorithm.kl_penalty_fn is k1, k2, k3 or "
        "abs, not with none.")),
    "algorithm.kl_penalty": ForeignKey(VERL, ("algorithm.kl_penalty_fn",), f"verl's {_KL_FNS}."),
    "algorithm.kl_ctrl.kl_coef": ForeignKey(VERL, ("algorithm.kl_penalty_coef",), (
        "A fixed coefficient, as verl's fixed controller.")),
    "algorithm.kl_ctrl.*": ForeignKey(VERL, (), (
        "the reward's KL coefficient is fixed here (algorithm.kl_penalty_coef); there is no adaptive controller.")),
    "critic.optim.lr": ForeignKey(VERL, ("algorithm.critic_lr",)),
    "critic.cliprange_value": ForeignKey(VERL, ("algorithm.value_clip",)),
    "critic.model.path": ForeignKey(VERL, ("model.critic_model_path",)),
    "trainer.total_epochs": ForeignKey(VERL, ("buffer.total_epochs",)),
    "trainer.total_training_steps": ForeignKey(VERL, ("buffer.total_steps",)),
    "trainer.n_gpus_per_node": ForeignKey(VERL, ("cluster.gpu_per_node",)),
    "trainer.nnodes": ForeignKey(VERL, ("cluster.node_num",)),
    "trainer.nnode": ForeignKey(VERL, ("cluster.node_num",), "verl's FAQ writes it so; verl's key is trainer.nnodes."),
    "trainer.save_freq": ForeignKey(VERL, ("trainer.save_interval",)),
    "trainer.test_freq": ForeignKey(VERL, ("explorer.eval_interval",)),
    "trainer.val_before_train": ForeignKey(VERL, ("explorer.eval_on_startup",)),
    "trainer.val_only": ForeignKey(VERL, ("explorer.bench_on_starting_model",), (
        "It is a mode=bench run's, with a name of its own: python run.py mode=bench "
        "explorer.bench_on_starting_model=true name=base_eval (the table in <run>/bench/results.md).")),
    "trainer.project_name": ForeignKey(VERL, ("project",)),
    "trainer.experiment_name": ForeignKey(VERL, ("name",)),
    "trainer.logger": ForeignKey(VERL, ("monitor.monitor_type",), (
        "A list of tensorboard, wandb, mlflow (monitor=wandb chooses one); the console is always on.")),
    "trainer.default_local_dir": ForeignKey(VERL, ("checkpoint_root_dir",), (
        "A run writes to <checkpoint_root_dir>/<project>/<name>/, as verl's default "
        "checkpoints/<project_name>/<experiment_name>.")),
    "trainer.resume_mode": ForeignKey(VERL, ("continue_from_checkpoint", "trainer.resume_from_path"), (
        "verl's auto is continue_from_checkpoint=true (the default), disable is false, resume_path is "
        "trainer.resume_from_path.")),
    "trainer.critic_warmup": ForeignKey(VERL, ("algorithm.critic_warmup",)),
    "trainer.max_actor_ckpt_to_keep": ForeignKey(VERL, ("trainer.max_ckpt_to_keep",)),
    "trainer.wandb_proxy": ForeignKey(VERL, (), (
        "set WANDB_HTTPS_PROXY (and WANDB_HTTP_PROXY) in the environment run.py starts from: wandb alone uses it, as "
        "verl's key, where HTTPS_PROXY would also send a judge's and a remote reward's requests through the proxy.")),
    "ray_init.num_cpus": ForeignKey(VERL, ("cluster.num_cpus",), (
        "CPUs of the Ray instance rft starts itself (not of a running cluster it joins).")),
    "ray_init.timeline_file": ForeignKey(VERL, ("monitor.enable_ray_timeline",), (
        "A switch here, not a path: the timeline is written to <stage>/monitor/timeline.json.")),
    "custom_reward_function.path": ForeignKey(VERL, (f"{_TASKSET}.reward_fn",), (
        "The dotted path of a function importable from where run.py runs (module.function), called as "
        "fn(prompt, response, task) -> float, where verl's compute_score takes data_source, solution_str, "
        "ground_truth and extra_info.")),
    "custom_reward_function.name": ForeignKey(VERL, (f"{_TASKSET}.reward_fn",), (
        "reward_fn names the function with its module: module.function.")),
    "actor_rollout_ref.*": ForeignKey(VERL, None, _OTHER),
    "data.*": ForeignKey(VERL, None, _OTHER),
    "ray_init.*": ForeignKey(VERL, None, _OTHER),
    "critic.*": ForeignKey(VERL + ROLL, None, _OTHER),
    "reward_model.*": ForeignKey(VERL + ROLL, None, _OTHER),
    # ---------------------------------------------------------------- ROLL (YAML, roles as sections)
    "num_return_sequences_in_group": ForeignKey(ROLL, ("algorithm.repeat_times",), "Responses sampled per prompt."),
    "actor_train.device_mapping": ForeignKey(ROLL, ("cluster.device_mapping.trainer",), (
        "A YAML list of device indices ([0,1,2,3]), not ROLL's list(range(0,4)).")),
    "actor_infer.device_mapping": ForeignKey(ROLL, ("cluster.device_mapping.explorer",), (
        "A YAML list of device indices ([0,1,2,3]), not ROLL's list(range(0,4)).")),
    "reference.device_mapping": ForeignKey(ROLL, ("cluster.device_mapping.reference",), (
        "The reference model lives in the trainer's ranks: the trainer's devices or null, never devices of its "
        "own as in ROLL's separated mode.")),
    "critic.device_mapping": ForeignKey(ROLL, ("cluster.device_mapping.critic",), (
        "The critic lives in the trainer's ranks: the trainer's devices or null.")),
    "actor_train.training_args.learning_rate": ForeignKey(ROLL, ("algorithm.optimizer.lr",)),
    "actor_train.training_args.weight_decay": ForeignKey(ROLL, ("algorithm.optimizer.weight_decay",)),
    "actor_train.training_args.warmup_steps": ForeignKey(ROLL, ("algorithm.optimizer.warmup_steps",)),
    "actor_train.training_args.per_device_train_batch_size": ForeignKey(ROLL, ("trainer.micro_batch_size_per_gpu",)),
    "actor_train.training_args.gradient_accumulation_steps": ForeignKey(ROLL, ("trainer.mini_batch_size",), (
        "rft sets the experiences per optimizer step instead, ROLL's global_batch_size: per_device_train_batch_size "
        "x gradient_accumulation_steps x data-parallel ranks.")),
    "actor_train.model_args.disable_gradient_checkpointing": ForeignKey(ROLL, ("trainer.gradient_checkpointing",), (
        "Its opposite: disable_gradient_checkpointing=false is trainer.gradient_checkpointing=true.")),
    "actor_infer.strategy_args.strategy_config.gpu_memory_utilization": ForeignKey(
        ROLL, (f"{_ROLLOUT}.gpu_memory_utilization",)),
    "actor_infer.generating_args.temperature": ForeignKey(ROLL, (f"{_TASKSET}.rollout_args.temperature",)),
    "actor_infer.generating_args.top_p": ForeignKey(ROLL, (f"{_TASKSET}.rollout_args.top_p",)),
    "actor_infer.generating_args.top_k": ForeignKey(ROLL, (f"{_TASKSET}.rollout_args.top_k",)),
    "actor_infer.generating_args.max_new_tokens": ForeignKey(ROLL, ("model.max_response_tokens",)),
    "adv_estimator": ForeignKey(ROLL, ("algorithm=<name>",), (
        "The algorithm is a config group here (conf/algorithm/): ROLL's grpo is algorithm=grpo, gae "
        "algorithm=ppo; its reinforce and agentic estimators have no file of their own.")),
    "exp_name": ForeignKey(ROLL, ("name",)),
    "prompt_length": ForeignKey(ROLL, ("model.max_prompt_tokens",)),
    "response_length": ForeignKey(ROLL, ("model.max_response_tokens",)),
    "sequence_length": ForeignKey(ROLL, ("model.max_response_tokens",), (
        "rft sets the response's budget itself: ROLL's sequence_length - prompt_length.")),
    "num_gpus_per_node": ForeignKey(ROLL, ("cluster.gpu_per_node",)),
    "num_nodes": ForeignKey(ROLL, ("cluster.node_num",)),
    "track_with": ForeignKey(ROLL, ("monitor.monitor_type",), "A list: tensorboard, wandb, mlflow."),
    "pg_clip": ForeignKey(ROLL, ("algorithm.clip_ratio_low", "algorithm.clip_ratio_high"), _CLIP),
    "pg_clip_low": ForeignKey(ROLL, ("algorithm.clip_ratio_low",)),
    "pg_clip_high": ForeignKey(ROLL, ("algorithm.clip_ratio_high",)),
    "dual_clip_loss": ForeignKey(ROLL, ("algorithm.clip_ratio_c",), (
        "A number here, not a switch: the dual clip's bound (usually 3.0); null turns it off.")),
    "add_token_level_kl": ForeignKey(ROLL, ("algorithm.kl_penalty_fn",), (
        "The KL to the reference is subtracted from the reward when algorithm.kl_penalty_fn is k1, k2, k3 or "
        "abs; its coefficient is algorithm.kl_penalty_coef.")),
    "kl_penalty": ForeignKey(ROLL, ("algorithm.kl_penalty_fn",), f"ROLL's {_KL_FNS}."),
    "entropy_loss_coef": ForeignKey(ROLL, ("algorithm.entropy_coef",)),
    "max_grad_norm": ForeignKey(ROLL + TRL, ("trainer.grad_clip",)),
    "system_envs": _ENVS,
    "system_envs.*": _ENVS,
    "profiler_output_dir": ForeignKey(ROLL, ("monitor.enable_ray_timeline",), (
        "A switch: Ray's timeline is written to <stage>/monitor/timeline.json.")),
    "actor_train.*": ForeignKey(ROLL, None, _OTHER),
    "actor_infer.*": ForeignKey(ROLL, None, _OTHER),
    "reference.*": ForeignKey(ROLL, None, _OTHER),
    # ---------------------------------------------------------------- LightRFT and OpenRLHF (flags)
    "rollout_batch_size": ForeignKey(ROLL + LIGHTRFT, ("buffer.batch_size",), (
        "Both count prompts (tasks) per step; a step's experiences are that x algorithm.repeat_times "
        "(buffer.train_batch_size).")),
    "n_samples_per_prompt": ForeignKey(LIGHTRFT, ("algorithm.repeat_times",), "Responses sampled per prompt."),
    "train_batch_size": ForeignKey(LIGHTRFT, ("trainer.mini_batch_size",), (
        "Experiences per optimizer step (DeepSpeed's global batch). rft's buffer.train_batch_size is not it: that "
        "is every experience of a step, buffer.batch_size x algorithm.repeat_times (LightRFT's "
        "rollout_batch_size x n_samples_per_prompt).")),
    "micro_train_batch_size": ForeignKey(LIGHTRFT, ("trainer.micro_batch_size_per_gpu",), (
        "Both count experiences per GPU in one forward and backward.")),
    "micro_rollout_batch_size": ForeignKey(LIGHTRFT, (), (
        "the engine batches generation (explorer=hf: explorer.rollout_model.generate_batch_size sequences a call), "
        "and the trainer's log-probs of the policy and the reference go by trainer.micro_batch_size_per_gpu.")),
    "pretrain": ForeignKey(ROLL + LIGHTRFT, ("model.model_path",)),
    "critic_pretrain": ForeignKey(LIGHTRFT, ("model.critic_model_path",)),
    "advantage_estimator": ForeignKey(LIGHTRFT, ("algorithm=<name>",), (
        "The algorithm is a config group here (conf/algorithm/): group_norm is algorithm=grpo, gae algorithm=ppo, "
        "rloo algorithm=rloo, reinforce algorithm=reinforce_pp, reinforce_baseline algorithm=reinforce_pp_baseline, "
        "OpenRLHF's dr_grpo algorithm=dr_grpo.")),
    "init_kl_coef": ForeignKey(ROLL + LIGHTRFT, ("algorithm.kl_penalty_coef", "algorithm.kl_loss_coef"), (
        "A KL to the reference subtracted from the reward is algorithm.kl_penalty_coef (with algorithm.kl_penalty_fn, "
        "none by default); LightRFT's and OpenRLHF's with --use_kl_loss weigh a loss term, algorithm.kl_loss_coef "
        "(with algorithm.kl_loss_fn). The coefficient is fixed: there is no adaptive controller (kl_target).")),
    "use_kl_loss": ForeignKey(ROLL + LIGHTRFT, ("algorithm.kl_loss_fn",), (
        "The KL loss term is on when algorithm.kl_loss_fn is k1, k2, k3 or abs, off with none; its coefficient is "
        "algorithm.kl_loss_coef.")),
    "kl_estimator": ForeignKey(LIGHTRFT, ("algorithm.kl_loss_fn", "algorithm.kl_penalty_fn"), (
        "The same names, k1, k2 and k3: kl_loss_fn for a loss term, kl_penalty_fn for the reward's penalty.")),
    "actor_learning_rate": ForeignKey(LIGHTRFT, ("algorithm.optimizer.lr",)),
    "critic_learning_rate": ForeignKey(LIGHTRFT, ("algorithm.critic_lr",)),
    "lr_warmup_ratio": ForeignKey(LIGHTRFT, ("algorithm.optimizer.warmup_steps",), (
        "Give the optimizer steps; `dry_run=true` prints a stage's steps.")),
    "adam_betas": ForeignKey(LIGHTRFT, ("algorithm.optimizer.betas",), (
        "A list, [0.9, 0.999] by default here (OpenRLHF's 0.9 0.95).")),
    "l2": ForeignKey(LIGHTRFT, ("algorithm.optimizer.weight_decay",), "0.01 by default here (OpenRLHF's 0)."),
    "max_norm": ForeignKey(LIGHTRFT, ("trainer.grad_clip",)),
    "lambd": ForeignKey(ROLL + LIGHTRFT, ("algorithm.lam",), "GAE's lambda: 1.0 by default here, as OpenRLHF's (ROLL's 0.95)."),
    "max_epochs": ForeignKey(LIGHTRFT, ("trainer.ppo_epochs",), "Passes over each step's experiences."),
    "num_episodes": ForeignKey(LIGHTRFT, ("buffer.total_epochs",), "Passes over the prompts."),
    "prompt_max_len": ForeignKey(LIGHTRFT, ("model.max_prompt_tokens",)),
    "generate_max_len": ForeignKey(LIGHTRFT, ("model.max_response_tokens",)),
    "eps_clip": ForeignKey(LIGHTRFT, ("algorithm.clip_ratio_low", "algorithm.clip_ratio_high"), _CLIP),
    "zero_stage": ForeignKey(LIGHTRFT, (), (
        "there is no DeepSpeed here; trainer=fsdp2 shards the weights, gradients and optimizer state over its "
        "ranks.")),
    "fsdp": ForeignKey(LIGHTRFT[:1], ("trainer=fsdp2",)),
    "fsdp_cpu_offload": ForeignKey(LIGHTRFT[:1], ("trainer.param_offload",), (
        "With trainer=fsdp2: the weights and gradients in CPU memory, the optimizer stepping on the CPU.")),
    "engine_mem_util": ForeignKey(LIGHTRFT[:1], (f"{_ROLLOUT}.gpu_memory_utilization",)),
    "engine_tp_size": ForeignKey(LIGHTRFT[:1], (f"{_ROLLOUT}.tensor_parallel_size",)),
    "enable_engine_sleep": ForeignKey(LIGHTRFT[:1], (f"{_ROLLOUT}.enable_sleep_mode",), (
        "Off by default here; vLLM on GPUs, the engines sharing the trainer's devices.")),
    "packing_samples": ForeignKey(LIGHTRFT, ("trainer.use_remove_padding",), "On by default here."),
    "flash_attn": ForeignKey(LIGHTRFT, ("model.attn_implementation",), "Its value flash_attention_2."),
    "gradient_checkpointing": ForeignKey(LIGHTRFT + TRL, ("trainer.gradient_checkpointing",)),
    "reward_running_norm": ForeignKey(LIGHTRFT[:1], (f"{_TASKSET}.reward_fn",), (
        "A reward part's normalize: true ({fn: ..., normalize: true} in the reward_fn list), which subtracts the "
        "running mean before dividing by the running std: LightRFT does so only with "
        "--reward_running_norm_minus_mean.")),
    "use_wandb": ForeignKey(LIGHTRFT, ("monitor=wandb",), (
        "Its value is wandb's API key there; wandb reads it from WANDB_API_KEY (or `wandb login`).")),
    "wandb_project": ForeignKey(LIGHTRFT, ("project",)),
    "wandb_run_name": ForeignKey(LIGHTRFT, ("name",), "wandb's run is <name>/<stage>."),
    "wandb_org": ForeignKey(LIGHTRFT, (), "wandb reads the entity from WANDB_ENTITY."),
    "save_path": ForeignKey(LIGHTRFT, ("checkpoint_root_dir",), (
        "A run's checkpoints (resumable state and Hugging Face weights) go to "
        "<checkpoint_root_dir>/<project>/<name>/.")),
    "ckpt_path": ForeignKey(LIGHTRFT, ("checkpoint_root_dir", "trainer.resume_from_path"), (
        "A run's checkpoints go to <checkpoint_root_dir>/<project>/<name>/; trainer.resume_from_path resumes from "
        "a given one.")),
    "load_checkpoint": ForeignKey(LIGHTRFT, ("continue_from_checkpoint",), (
        "On by default here: a run of the same name resumes from its newest checkpoint.")),
    "max_ckpt_num": ForeignKey(LIGHTRFT, ("trainer.max_ckpt_to_keep",)),
    "save_interval": ForeignKey(LIGHTRFT[:1], ("trainer.save_interval",)),
    # the flags of OpenRLHF's train_ppo_ray.py a user types first (LightRFT renamed its vllm_* ones engine_*)
    "eps_clip_low_high": ForeignKey(OPENRLHF, ("algorithm.clip_ratio_low", "algorithm.clip_ratio_high"), (
        "Its two values are the two keys': --eps_clip_low_high 0.2 0.28 (clip-higher) is algorithm.clip_ratio_low=0.2 "
        "algorithm.clip_ratio_high=0.28, which algorithm=dapo sets.")),
    "dual_clip": ForeignKey(OPENRLHF, ("algorithm.clip_ratio_c",), "Off (null) by default, as there."),
    "policy_loss_type": ForeignKey(OPENRLHF, ("algorithm=gspo",), (
        "The loss comes with its algorithm's file here: algorithm=gspo also sets loss_agg_mode=seq-mean-token-mean "
        "and the paper's clip bounds on the sequence's ratio, 3e-4 and 4e-4, where OpenRLHF clips it at --eps_clip "
        "(0.2): algorithm.clip_ratio_low=0.2 algorithm.clip_ratio_high=0.2 for OpenRLHF's. ppo is the other files' "
        "ppo_clip.")),
    "no_advantage_std_norm": ForeignKey(OPENRLHF, ("algorithm.advantage_fn",), (
        "algorithm.advantage_fn=dr_grpo subtracts the group's mean without dividing by its std (algorithm=dr_grpo "
        "also sets loss_agg_mode=seq-mean-token-sum-norm).")),
    "entropy_loss_coef": ForeignKey(OPENRLHF, ("algorithm.entropy_coef",), "0 (no bonus) by default here."),
    "async_train": ForeignKey(OPENRLHF, ("synchronizer.sync_offset",), (
        "Training one step behind generation is synchronizer.sync_offset=1, which the default (null) already is "
        "where the explorer and the trainer have resources of their own; OpenRLHF's synchronous default is "
        "synchronizer.sync_offset=0. The dry run's explorer line says which a run gets.")),
    "prompt_data": ForeignKey(OPENRLHF, (f"{_TASKSET}.path",), (
        "A JSONL, Parquet or CSV file, a folder of them or a Hugging Face dataset id.")),
    "input_key": ForeignKey(OPENRLHF, (f"{_TASKSET}.format.prompt_key",)),
    "label_key": ForeignKey(OPENRLHF, (f"{_TASKSET}.format.response_key",), (
        "The reward function gets that column's value as its task's answer.")),
    "eval_dataset": ForeignKey(OPENRLHF, ("buffer.explorer_input.eval_tasksets",), (
        "A list of tasksets, each with its own name, path and rollout_args.")),
    "eval_temperature": ForeignKey(OPENRLHF, ("buffer.explorer_input.eval_tasksets",), (
        "Each eval taskset's rollout_args.temperature: 0 (greedy) by default here, OpenRLHF's 0.6; its "
        "repeat_times is OpenRLHF's --eval_n_samples_per_prompt (1 here, 4 there).")),
    "remote_rm_url": ForeignKey(OPENRLHF, (f"{_TASKSET}.reward_fn",), (
        "A reward part {fn: remote, args: {url: ...}} in the reward_fn list, which speaks to rft's own reward "
        "server (rft/serving/reward_server.py, POST /score), not to OpenRLHF's; README, \"Rewards served "
        "by a model or a server\".")),
    "reward_pretrain": ForeignKey(OPENRLHF, (f"{_TASKSET}.reward_fn",), (
        "A reward part {fn: reward_model, args: {model_path: ..., kind: classifier}} in the reward_fn list; "
        "several parts, each with its weight, are summed.")),
    "normalize_reward": ForeignKey(OPENRLHF, (f"{_TASKSET}.reward_fn",), (
        "A reward part's normalize: true ({fn: ..., normalize: true} in the reward_fn list): the running mean "
        "subtracted, then divided by the running std.")),
    "vllm_num_engines": ForeignKey(OPENRLHF, (f"{_ROLLOUT}.engine_num",), "With explorer=vllm on GPUs."),
    "vllm_enable_sleep": ForeignKey(OPENRLHF, (f"{_ROLLOUT}.enable_sleep_mode",), (
        "Off by default here; vLLM on GPUs, the engines sharing the trainer's devices.")),
    "colocate_all_models": ForeignKey(OPENRLHF, ("cluster.colocate",)),
    "adam_offload": ForeignKey(OPENRLHF, ("trainer.optimizer_offload",), "With trainer=fsdp2."),
    "ref_reward_offload": ForeignKey(OPENRLHF, ("trainer.ref_offload",), (
        "With trainer=fsdp2; a reward model runs on a worker of its own.")),
    "dynamic_filtering": ForeignKey(OPENRLHF, ("algorithm.dynamic_sampling_max_tries",), (
        "Groups whose rewards are all alike are replaced by new tries, up to that many (algorithm=dapo: 4).")),
    "use_tensorboard": ForeignKey(OPENRLHF, ("monitor.monitor_type",), (
        "TensorBoard is on by default here, written to <stage>/tensorboard/ (not to a path of its own).")),
    "save_hf_ckpt": ForeignKey(OPENRLHF, ("trainer.save_hf_checkpoint",), (
        "always by default here: each checkpoint's hf/ loads with from_pretrained.")),
    # ---------------------------------------------------------------- Trinity-RFT's keys that rft lacks
    _TRINITY_VERL: ForeignKey(TRINITY, None, (
        "it hands verl's keys to verl; here each is one of rft's own keys, set by itself (name one as "
        "trainer.trainer_config.<verl's key>=<value> to be told which). " + _OTHER)),
    "trainer.trainer_config_path": ForeignKey(TRINITY, (), (
        "verl's keys in a file of their own: here each is one of rft's keys, in an overlay file "
        "(conf/experiment/*.yaml, `python run.py experiment=<name>`) or on the command line.")),
    "trainer.trainer_type": ForeignKey(TRINITY, ("trainer=torch", "trainer=fsdp2"), (
        "There is no verl backend: the trainer is rft's own, one process (torch) or data-parallel ranks (fsdp2).")),
    "monitor.monitor_args": ForeignKey(TRINITY, (), (
        "wandb reads WANDB_API_KEY and WANDB_BASE_URL from the environment run.py starts from; MLflow's server is "
        "monitor.mlflow_tracking_uri, its login MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD.")),
    "monitor.monitor_args.*": ForeignKey(TRINITY, (), (
        "wandb reads WANDB_API_KEY and WANDB_BASE_URL from the environment run.py starts from; MLflow's server is "
        "monitor.mlflow_tracking_uri, its login MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD.")),
    "model.chat_template_path": ForeignKey(TRINITY, ("model.custom_chat_template",), (
        "It takes the template's Jinja text, not a file's path (a YAML block, key: |, holds a long one).")),
    "model.enable_prompt_truncation": ForeignKey(TRINITY, ("model.max_prompt_tokens",), (
        "A longer prompt is always cut here, from the left (its end kept), and counted per step "
        "(rollout/truncated_prompts).")),
    "model.min_response_tokens": ForeignKey(TRINITY, (), "a response may end at its first token."),
    "algorithm.entropy_loss_fn": ForeignKey(TRINITY, ("algorithm.entropy_coef",), (
        "One entropy bonus, loss -= entropy_coef x entropy; 0 (the default) turns it off.")),
    "algorithm.sample_strategy": ForeignKey(TRINITY, (
        "buffer.trainer_input.experience_buffer.replay_buffer.priority_fn",), (
        "Which ready experience a queue buffer gives the trainer first, with replay_buffer.enable=true "
        "(linear_decay: the newest weights' first, less each time it was read); otherwise the order written.")),
    "service": ForeignKey(TRINITY, (), "there are no services (Data-Juicer) to start."),
    "service.*": ForeignKey(TRINITY, (), "there are no services (Data-Juicer) to start."),
    "explorer.dynamic_timeout": ForeignKey(TRINITY, ("explorer.max_timeout",), "A fixed time a task may take."),
    "explorer.dynamic_timeout.*": ForeignKey(TRINITY, ("explorer.max_timeout",), "A fixed time a task may take."),
    "explorer.env_vars": _envs(TRINITY),
    "trainer.ulysses_sequence_parallel_size": ForeignKey(TRINITY, (), _NO_SP),
    # its renamed keys (rft/config.py's comments name them): the schema's nearest names pointed a
    # taskset's storage_type at the experience buffer's, and default_workflow_type nowhere
    "buffer.explorer_input.default_workflow_type": ForeignKey(TRINITY, (f"{_TASKSET}.workflow",), (
        "Each taskset names its own (an eval set's too, buffer.explorer_input.eval_tasksets.<i>.workflow). "
        + _WORKFLOWS)),
    "buffer.explorer_input.default_eval_workflow_type": ForeignKey(TRINITY, ("buffer.explorer_input.eval_tasksets",), (
        "Each eval set names its own workflow (buffer.explorer_input.eval_tasksets.<i>.workflow, single_turn "
        "unless set). " + _WORKFLOWS)),
    f"{_TASKSET}.default_workflow_type": ForeignKey(TRINITY, (f"{_TASKSET}.workflow",), _WORKFLOWS),
    "buffer.explorer_input.eval_tasksets.*.default_workflow_type": ForeignKey(TRINITY, (
        "buffer.explorer_input.eval_tasksets",), "The set's own workflow key (buffer.explorer_input.eval_tasksets.<i>"
        ".workflow). " + _WORKFLOWS),
    f"{_TASKSET}.default_reward_fn_type": ForeignKey(TRINITY, (f"{_TASKSET}.reward_fn",), (
        "buffer.explorer_input.default_reward_fn_type is the run's default, as in Trinity-RFT.")),
    "buffer.explorer_input.eval_tasksets.*.default_reward_fn_type": ForeignKey(TRINITY, (
        "buffer.explorer_input.eval_tasksets",), "The set's own reward_fn key (buffer.explorer_input.eval_tasksets.<i>"
        ".reward_fn); buffer.explorer_input.default_reward_fn_type is the run's default."),
    f"{_TASKSET}.storage_type": ForeignKey(TRINITY, (), _TASKSET_STORAGE),
    "buffer.explorer_input.eval_tasksets.*.storage_type": ForeignKey(TRINITY, (), _TASKSET_STORAGE),
    "trainer.total_steps": ForeignKey(TRINITY, ("buffer.total_steps",), (
        "Trinity-RFT's two keys are one here.")),
    "algorithm.optimizer.lr_warmup_steps_ratio": ForeignKey(TRINITY, ("algorithm.optimizer.warmup_steps",), (
        "Give the optimizer steps; `dry_run=true` prints a stage's steps.")),
    **{f"algorithm.{fn}_args{tail}": ForeignKey(TRINITY, (ours,), note)
       for fn, ours, note in _FN_ARGS for tail in ("", ".*")},
    "explorer.runner_state_report_interval": ForeignKey(TRINITY, (), (
        "the workflow runners do not report their state; a task that fails or runs past explorer.max_timeout is "
        "counted in the step's metrics (rollout/failed_tasks, rollout/timeouts).")),
    # ---------------------------------------------------------------- TRL (GRPOConfig's fields)
    "num_generations": ForeignKey(TRL, ("algorithm.repeat_times",), "Responses sampled per prompt."),
    "per_device_train_batch_size": ForeignKey(ROLL + TRL, ("trainer.micro_batch_size_per_gpu",), (
        "Both count experiences (completions) per GPU in one forward and backward.")),
    "gradient_accumulation_steps": ForeignKey(ROLL + TRL, ("trainer.mini_batch_size",), (
        "rft sets the experiences per optimizer step instead: per_device_train_batch_size x "
        "gradient_accumulation_steps x data-parallel ranks.")),
    "beta": ForeignKey(TRL, ("algorithm.kl_loss_coef", "algorithm.dpo_beta"), (
        "GRPOConfig's beta weighs a k3 KL loss term: algorithm.kl_loss_coef with algorithm.kl_loss_fn=k3 "
        "(kl_loss_fn=none is beta=0); DPOConfig's beta is algorithm.dpo_beta.")),
    "epsilon": ForeignKey(TRL, ("algorithm.clip_ratio_low", "algorithm.clip_ratio_high"), (
        "The ratio is clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]; TRL's epsilon sets both unless "
        "epsilon_high is given.")),
    "epsilon_high": ForeignKey(TRL, ("algorithm.clip_ratio_high",)),
    # TRL clamps the unclipped ratio at delta inside the min: for A > 0 min(r, 1 + eps) already caps it, so
    # only A < 0 changes, where -A x min(max(r, clip(r)), delta) is the dual clip's bound
    "delta": ForeignKey(TRL, ("algorithm.clip_ratio_c",), (
        "TRL's two-sided clip (INTELLECT-2) caps a negative advantage's ratio at delta: the dual clip, the same loss "
        "and gradient for delta above 1 + epsilon_high.")),
    "num_iterations": ForeignKey(TRL, ("trainer.ppo_epochs",), "Passes over each step's experiences."),
    "max_prompt_length": ForeignKey(TRL, ("model.max_prompt_tokens",)),
    "max_completion_length": ForeignKey(TRL, ("model.max_response_tokens",)),
    "loss_type": ForeignKey(TRL, ("algorithm.loss_agg_mode",), (
        "TRL's grpo is seq-mean-token-mean, dr_grpo seq-mean-token-sum-norm, dapo token-mean; bnpo, normalised by "
        "its local batch's tokens, is nearest token-mean, which normalises by the whole mini-batch's; cispo, sapo and "
        "luspo have no counterpart.")),
    "scale_rewards": ForeignKey(TRL, ("algorithm.advantage_fn",), (
        "TRL's group (or true) is grpo's advantage; none (or false) is algorithm.advantage_fn=dr_grpo; batch and "
        "mean have no counterpart.")),
    "learning_rate": ForeignKey(TRL, ("algorithm.optimizer.lr",)),
    "weight_decay": ForeignKey(TRL, ("algorithm.optimizer.weight_decay",), "0.01 by default here (TRL: 0)."),
    "warmup_steps": ForeignKey(TRL, ("algorithm.optimizer.warmup_steps",)),
    "lr_scheduler_type": ForeignKey(TRL, ("algorithm.optimizer.warmup_style",), (
        "constant or cosine after the warm-up; TRL's default linear decay has no counterpart.")),
    "use_vllm": ForeignKey(TRL, ("explorer=vllm",)),
    "vllm_gpu_memory_utilization": ForeignKey(OPENRLHF + TRL, (f"{_ROLLOUT}.gpu_memory_utilization",)),
    "vllm_tensor_parallel_size": ForeignKey(OPENRLHF + TRL, (f"{_ROLLOUT}.tensor_parallel_size",)),
    "temperature": ForeignKey(LIGHTRFT + TRL, (f"{_TASKSET}.rollout_args.temperature",)),
    "top_p": ForeignKey(LIGHTRFT + TRL, (f"{_TASKSET}.rollout_args.top_p",)),
    "top_k": ForeignKey(TRL, (f"{_TASKSET}.rollout_args.top_k",), "-1 disables it here (TRL: 0)."),
    "num_train_epochs": ForeignKey(TRL, ("buffer.total_epochs",)),
    "max_steps": ForeignKey(ROLL + TRL, ("buffer.total_steps",), f"{_STEPS}."),
    "save_steps": ForeignKey(ROLL + TRL, ("trainer.save_interval",), f"{_STEPS}."),
    "eval_steps": ForeignKey(ROLL + TRL, ("explorer.eval_interval",), f"{_STEPS}."),
    "report_to": ForeignKey(TRL, ("monitor.monitor_type",), "A list: tensorboard, wandb, mlflow."),
    "output_dir": ForeignKey(ROLL + TRL, ("checkpoint_root_dir",), (
        "A run writes to <checkpoint_root_dir>/<project>/<name>/.")),
    "bf16": ForeignKey(LIGHTRFT + TRL, ("model.dtype",), "bfloat16, the default here."),
})


# Values of rft's own keys as Trinity-RFT (or verl) writes them, and rft's for each: appended to the
# paragraph the schema gives for a typed key. (A registry's names are its own: Registry(foreign=...).)
@dataclass(frozen=True)
class ForeignValue:
    """What another system's value of one of rft's keys is here, as a sentence."""

    note: str


_LEVEL = "rft takes logging's level names in capitals: log.level={}."
FOREIGN_VALUES = Registry("a value of another system", shape="a ForeignValue (rft/foreign_keys.py)", table={
    "synchronizer.sync_method=nccl": ForeignValue("Trinity-RFT's nccl is collective here (sync=collective)."),
    **{f"log.level={v}": ForeignValue(_LEVEL.format(v.upper())) for v in ("debug", "info", "warning", "error", "critical")},
})


def foreign_value(key: str, value) -> str:
    """The sentence for another system's value of one of rft's keys, with a space before it; ''
    when the value is no other system's."""
    entry = f"{key}={value}"
    return " " + FOREIGN_VALUES[entry].note if entry in FOREIGN_VALUES else ""


# verl's metric names (Trinity-RFT's trainer is verl's, so its monitor shows them), each with rft's
# and what differs, for objective and monitor.console_keys (rft.plan.batch._check_metric_names)
FOREIGN_METRICS = {
    "actor/pg_loss": ("loss/policy", ""),
    "actor/pg_clipfrac": ("actor/clip_frac", " (rft leaves out the tokens whose advantage is 0)"),
    "actor/ppo_kl": ("actor/approx_kl", " (verl's is the token mean of log(old/new), rft's of r - 1 - log r: two "
                                        "estimates of the same KL)"),
    "actor/kl_loss": ("actor/kl", ""),
    "critic/score/mean": ("reward/mean", ""),
    "critic/score/max": ("reward/max", ""),
    "critic/score/min": ("reward/min", ""),
    "critic/rewards/mean": ("reward/mean", " (verl's is after its KL penalty, rft's before it: with "
                                           "algorithm.kl_penalty_fn set, subtract algorithm.kl_penalty_coef x "
                                           "reward/kl_penalty)"),
    "critic/advantages/mean": ("advantage/mean", ""),
    "critic/vf_loss": ("critic/value_loss", ""),
    "critic/vf_clipfrac": ("critic/vf_clip_frac", ""),
    "critic/vpred_mean": ("critic/values_mean", ""),
    "timing_s/step": ("timing/step_s", ""),
}
