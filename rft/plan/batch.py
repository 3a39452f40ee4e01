"""Planning, the bottom layer: the stages, and each stage's batch plan, derived and checked in one
place before anything starts. It imports nothing that runs (no torch, no engine, no actor): a dry
run is this module and the datasets it reads.

A plan holds, besides the numbers below, what everything later reads instead of deciding again:
what the trainer learns from (`input_kind`), the algorithm's needs (a reference model, a critic,
groups, pairs), the number of explorer actors and trainer ranks, algorithm=mix's expert data.

    tasks per step           = buffer.batch_size
    rollouts per task        = algorithm.repeat_times
    experiences per step     = buffer.train_batch_size (default batch_size * repeat_times)
    optimizer steps per step = train_batch_size / mini_batch_size * ppo_epochs
    micro-batches per update = mini_batch_size / (micro_batch_size_per_gpu * data-parallel size)

Each violated constraint is a ConfigError that names the keys, their values and the fix.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rft import config as C
from rft.algorithms import ADVANTAGE_FNS, KL_FNS, POLICY_LOSS_FNS, Needs, algorithm_needs, check_args
from rft.errors import ConfigError
from rft.registry import ENGINES, TRAINER_BACKENDS
from rft.plan import memory
from rft.plan.ranges import check_ranges, stored_experiences, warn_unread
from rft.plan.placement import check_placement, explorer_count, sync_offset, trainer_ranks
from rft.plan.sync import check_lora_sync

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- stages

def stage_configs(cfg: DictConfig) -> list[DictConfig]:
    """One config per stage: the global config with the stage's dict merged on top."""
    base = cfg.copy()
    OmegaConf.resolve(base)
    stages = list(base.stages)
    base.stages = []
    _open_free_dicts(base)
    if not stages:
        return [_settled(base)]
    out, names = [], {}
    for i, stage in enumerate(stages):
        if not isinstance(stage, DictConfig) or "stage_name" not in stage:
            raise ConfigError(f"stages[{i}] must be a mapping with a stage_name (got {stage!r}).")
        try:
            merged = OmegaConf.merge(base, stage)
            OmegaConf.resolve(merged)
        except OmegaConfBaseException as e:
            raise ConfigError(f"stages[{i}] ({stage.get('stage_name')}): {_merge_problem(e)}") from e
        # each stage's directory is named after it: on macOS's (and Windows') file systems names
        # differing only in case are one directory, where a stage would take the other's checkpoints
        other = names.get(str(merged.stage_name).casefold())
        if other == merged.stage_name:
            raise ConfigError(f"stages[{i}].stage_name={merged.stage_name!r} is used twice; stage names must be unique.")
        if other is not None:
            raise ConfigError(f"stages[{i}].stage_name={merged.stage_name!r} differs from the stage_name {other!r} "
                              f"of an earlier stage only in case: on a case-insensitive file system (macOS's, "
                              f"Windows') both are one directory. Rename one.")
        names[str(merged.stage_name).casefold()] = merged.stage_name
        out.append(_settled(merged))
    return out


def _open_free_dicts(node) -> None:
    """The schema's free-form dicts (workflow_args, env_args, a reward's args: Dict[str, Any]) take
    keys a stage adds (`+stages.1.buffer.explorer_input.taskset.workflow_args.agent=...` stopped
    with "Key 'agent' is not in struct"); the typed sections stay closed, so a misspelt key in a
    stage is still an error."""
    if isinstance(node, DictConfig):
        if OmegaConf.get_type(node) is dict:
            OmegaConf.set_struct(node, False)
        for key in node:
            _open_free_dicts(node._get_node(key))
    elif isinstance(node, ListConfig) and not node._is_none():  # an Optional list left null
        for item in node:
            _open_free_dicts(item)


def _settled(cfg: DictConfig) -> DictConfig:
    """A stage's config with the values that default to "decide from the rest" decided: a null
    synchronizer.sync_offset (rft.plan.placement.sync_offset)."""
    cfg.synchronizer.sync_offset = sync_offset(cfg)
    return cfg


def _first_line(e: Exception) -> str:
    return " ".join(str(e).split("\n")[:2])


def _merge_problem(e: OmegaConfBaseException) -> str:
    """A stage key the schema lacks with the nearest names (OmegaConf's own text named neither the
    fix nor the key as a stage writes it); any other merge error as OmegaConf words it."""
    key = getattr(e, "full_key", None)
    problem = key and C.key_mistake(OmegaConf.structured(C.Config), key)
    return f"{key}: {problem}" if problem else _first_line(e)


def stage_sources(cfg: DictConfig) -> list[dict[str, str]]:
    """Per stage, the key the user sets for each key its dict sets, so that an error about a value
    names a key that changes it: the other key of an interpolation ({key: "${other.key}"}: the
    warm-up's dataset path is the taskset's), else the stage's own, `stages.<i>.<key>` (the
    warm-up's response_key: the same key at the top level is overridden by the stage's)."""
    from rft.config import flat

    out = []
    for i, stage in enumerate(cfg.stages or [{}]):
        raw = OmegaConf.to_container(stage, resolve=False) if isinstance(stage, DictConfig) else {}
        out.append({k: v[2:-1] if isinstance(v, str) and v.startswith("${") and v.endswith("}") else f"stages.{i}.{k}"
                    for k, v in flat(raw).items()})
    return out


def label(sources: dict, key: str) -> str:
    return f"{sources[key]} (read by {key})" if key in sources else key


# ---------------------------------------------------------------- the batch plan

@dataclass(frozen=True)
class BatchPlan:
    mode: str
    dataset_size: int  # tasks (mode=both) or training rows (mode=train)
    tasks_per_step: int
    rollouts_per_task: int
    experiences_per_step: int
    mini_batch_size: int
    ppo_epochs: int
    optimizer_steps_per_step: int
    micro_batch_size: int
    micro_batches_per_update: int
    dp_size: int  # the trainer's data-parallel ranks (processes)
    steps_per_epoch: int
    total_steps: int
    total_optimizer_steps: int
    warmup_steps: int
    # what the trainer reads (`input_kind`): rollouts | experiences | dataset | none
    input_kind: str = "rollouts"
    explorers: int = 1  # explorer actors (mode=train: 1 to evaluate, or 0)
    needs: Needs = Needs()  # what the algorithm needs (a reference model, a critic, ...)
    # algorithm.sft_loss_weight > 0: the expert data (an ExperienceBufferConfig) and its config key
    sft_data: Any = None
    # trainer.use_dynamic_bsz: tokens per micro-batch (rft.trainer.micro_batches); None: fixed row counts
    max_token_len_per_gpu: Optional[int] = None


def input_kind(cfg) -> str:
    """What the trainer learns from, decided once here: `rollouts` (this stage's explorers),
    `experiences` (a buffer an explorer stored: mode=train from sql, or a file of experiences),
    `dataset` (prompt/response rows or preference pairs: mode=train from any other file), or
    `none` (mode=explore trains nothing)."""
    if cfg.mode == "explore":
        return "none"
    if cfg.mode != "train":
        return "rollouts"
    return "experiences" if stored_experiences(cfg.buffer.trainer_input.experience_buffer) else "dataset"


def make_plan(cfg, dataset_size: int) -> BatchPlan:
    check_config(cfg)
    needs = algorithm_needs(cfg.algorithm)
    kind = input_kind(cfg)
    dp = trainer_ranks(cfg)  # trainer_strategy=torch is one process
    _check_algorithm(cfg, needs)
    _check_greedy_groups(cfg, needs)
    _check_greedy_evals(cfg)
    _check_distill(cfg.algorithm, needs)
    _check_reward_head(cfg, needs, kind)
    train_bs, per_epoch = _step_batch(cfg, dataset_size, kind, needs)
    mini, micro = _mini_batches(cfg.trainer, train_bs, dp)
    _check_pairs(cfg, needs, kind, [("buffer.train_batch_size", train_bs), ("trainer.mini_batch_size", mini),
                                     ("trainer.micro_batch_size_per_gpu", micro)])
    total, opt_per_step = _length(cfg, per_epoch, train_bs // mini * cfg.trainer.ppo_epochs)
    _check_schedule(cfg, needs, kind, train_bs, total)
    _warn_stored_steps(cfg, kind, dataset_size, train_bs, total)
    explores = cfg.mode in ("both", "explore")
    return BatchPlan(
        mode=cfg.mode,
        dataset_size=dataset_size,
        tasks_per_step=cfg.buffer.batch_size if explores else 0,
        rollouts_per_task=cfg.algorithm.repeat_times if explores else 0,
        experiences_per_step=train_bs,
        mini_batch_size=mini,
        ppo_epochs=cfg.trainer.ppo_epochs,
        optimizer_steps_per_step=opt_per_step,
        micro_batch_size=micro,
        micro_batches_per_update=mini // (micro * dp),
        dp_size=dp,
        steps_per_epoch=per_epoch,
        total_steps=total,
        total_optimizer_steps=total * opt_per_step,
        warmup_steps=cfg.algorithm.optimizer.warmup_steps,
        input_kind=kind,
        explorers=explorer_count(cfg),
        needs=needs,
        sft_data=sft_buffer_config(cfg) if cfg.algorithm.sft_loss_weight > 0 else None,
        max_token_len_per_gpu=_token_budget(cfg, micro),
    )


def check_config(cfg) -> None:
    """Everything about a stage's config that needs no dataset: names, modes, the schedule, the
    placement and the model's budgets."""
    if cfg.mode not in ("both", "explore", "train"):
        raise ConfigError(f"mode={cfg.mode!r} is not supported; choose both, explore, train or bench.")
    check_run_name(cfg)
    _check_no_nan(cfg)
    names = [ts.name for ts in cfg.buffer.explorer_input.eval_tasksets]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # their metrics (eval/<name>/accuracy) would overwrite each other's
        raise ConfigError(f"buffer.explorer_input.eval_tasksets: the name {twice[0]!r} is given to {names.count(twice[0])} "
                          f"eval sets; each needs a name of its own (their metrics are eval/<name>/...).")
    _check_names(cfg)
    _check_no_nan(cfg, lists=True)
    check_ranges(cfg)  # (before the checks that compare keys: each of those reads keys in range)
    _check_ray_address(cfg.cluster.ray_address)
    _check_runtime(cfg)
    _check_model(cfg.model)
    _check_flash_attention(cfg.model.attn_implementation, cfg.cluster.gpu_per_node)
    _check_hf_tensor_parallel(cfg.explorer.rollout_model)
    if cfg.monitor.enable_ray_timeline and cfg.cluster.backend != "ray":
        # the runner writes Ray's timeline only when there is Ray: without it the switch was a silent no-op
        log.warning("monitor.enable_ray_timeline=true writes Ray's timeline, and cluster=inline runs without Ray: no "
                    "timeline.json will be written. Use cluster=local for one.")
    check_lora_sync(cfg)
    _check_metric_names(cfg)
    if cfg.mode in ("both", "explore"):
        _check_rollouts(cfg)


def _check_metric_names(cfg) -> None:
    """objective and monitor.console_keys as verl (Trinity-RFT's trainer) names its metrics: such a
    name is never logged here, so the progress line left it out and a sweep got None, unsaid."""
    from rft.foreign_keys import FOREIGN_METRICS

    named = [("objective", cfg.objective)] + [("monitor.console_keys", k) for k in cfg.monitor.console_keys]
    for key, name in named:
        if name in FOREIGN_METRICS:
            ours, differs = FOREIGN_METRICS[name]
            raise ConfigError(
                f"{key} names {name}, verl's (and Trinity-RFT's trainer's) name of a metric that rft logs as "
                f"{ours}{differs}; "
                f"{name} is never logged here. Write {ours} (the metrics of a run are the keys of its "
                f"<stage>/metrics.jsonl).")


def check_run_name(cfg) -> None:
    """`project` and `name` name the run's directory, <checkpoint_root_dir>/<project>/<name>/: each a
    relative path that stays below the one before ("" or ".." would make the run's directory the
    project's or the root's, whose other runs continue_from_checkpoint=false moves aside)."""
    for key in ("project", "name"):
        value = str(cfg[key])
        parts = value.replace("\\", "/").split("/")
        if not value.strip() or value.startswith(("/", "~")) or any(p in ("", ".", "..") for p in parts):
            raise ConfigError(f"{key}={value!r}: the run's outputs go to <checkpoint_root_dir>/<project>/<name>/, so "
                              f"{key} must be a non-empty relative name without '.', '..' or empty parts (a/b is "
                              f"fine). Choose another {key}.")


def _check_no_nan(cfg, lists: bool = False) -> None:
    """NaN is no setting anywhere (a NaN coefficient or learning rate trains a model of NaNs, with exit 0).
    `lists`: in a list's items too (an eval set's pass_threshold, an auxiliary model's settings), checked
    after the checks of a list's own kind (a reward's parts), whose messages say more."""
    tree = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True) if isinstance(cfg, DictConfig) else cfg

    def walk(node, key: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(node, list) and lists:
            for i, v in enumerate(node):
                walk(v, f"{key}[{i}]")
        elif isinstance(node, float) and math.isnan(node):
            raise ConfigError(f"{key}=nan is not a number; give it a value (`python run.py --cfg job` shows the "
                              f"defaults).")

    walk(tree, "")


def _check_ray_address(address) -> None:
    if address is not None and address != "auto" and not re.fullmatch(r"(ray://)?\S+:\d+", address):
        raise ConfigError(f"cluster.ray_address={address!r} is not a Ray address: give auto (the cluster `ray start` "
                          f"made on this node), host:port (its GCS, e.g. 10.0.0.1:6379), ray://host:port (Ray "
                          f"Client), or null to start a Ray instance of the run's own.")


def _check_context(model, where: str, max_tokens: int | None) -> None:
    """A taskset's max_tokens fits the context the run is sized for after a prompt of
    model.max_prompt_tokens: vLLM's engine holds that context (model.max_model_len, or prompt +
    response budgets) and ends a longer response there as "length", where the hf engine goes on to
    max_tokens, so the engines would sample different responses from one config."""
    context = model.max_model_len or model.max_prompt_tokens + model.max_response_tokens
    if max_tokens is None or model.max_prompt_tokens + max_tokens <= context:
        return
    need = model.max_prompt_tokens + max_tokens
    named, fix = ((f"model.max_model_len={context}", f"model.max_model_len to {need}") if model.max_model_len else
                  (f"model.max_prompt_tokens + model.max_response_tokens = {context}",
                   f"model.max_response_tokens to {max_tokens}"))
    raise ConfigError(
        f"{where}.rollout_args.max_tokens={max_tokens} does not fit the context the run is sized for: after a "
        f"prompt of model.max_prompt_tokens={model.max_prompt_tokens} it needs {need} tokens, over {named} "
        f"(explorer=vllm would end such a response at {context - model.max_prompt_tokens} tokens, where "
        f"explorer=hf goes on to {max_tokens}). Raise {fix}, or lower max_tokens.")


def _check_total_tokens(model, where: str, ts) -> None:
    """A conversation's budget (workflow_args.max_total_tokens) fits the context the run is sized
    for: vLLM's engine holds only that context and refuses a longer prompt mid-run
    (VLLMValidationError, "longer than the maximum model length"), and the memory plan (KV cache,
    the trainer's micro-batches) sizes for that context, not for the budget."""
    from rft.rollout.workflows.single_turn import WORKFLOWS

    total = (ts.workflow_args or {}).get("max_total_tokens")
    context = model.max_model_len or model.max_prompt_tokens + model.max_response_tokens
    if type(total) is not int or total <= context or WORKFLOWS.info(ts.workflow).endpoint:
        return  # an agent's calls are bounded by the endpoint itself; a non-int: the workflow's own check
    response = total - model.max_prompt_tokens
    named, fix = ((f"model.max_model_len={context}", f"model.max_model_len to {total}") if model.max_model_len else
                  (f"model.max_prompt_tokens + model.max_response_tokens = {context}",
                   f"model.max_model_len to {total} (or model.max_response_tokens to {response})"))
    raise ConfigError(
        f"{where}.workflow_args.max_total_tokens={total} is over the context the run is sized for, {named}: "
        f"explorer=vllm's engine holds only that context and would stop the run at the first conversation longer "
        f"than it ('longer than the maximum model length'), and the memory plan does not size for the longer one. "
        f"Raise {fix}, or lower max_total_tokens to {context} or less.")


# both engines look for every stop string after every token, untimed (vLLM's StopChecker, the hf
# engine's StopStrings): 10,000 strings cost 7 ms a token a row, 32 of 256 characters under 0.1 ms
MAX_STOP_STRINGS, MAX_STOP_CHARS = 32, 256


def _check_stop(where: str, stop: list) -> None:
    """A taskset's rollout_args.stop: non-empty texts, few and short enough to check after every token."""
    if any(not isinstance(x, str) or not x for x in stop):  # "" is in every text: one-token responses
        raise ConfigError(f"{where}.rollout_args.stop={stop!r}: every stop string must be a non-empty "
                          f"text (an empty one ends each response after its first token).")
    longest = max(map(len, stop), default=0)
    if len(stop) > MAX_STOP_STRINGS or longest > MAX_STOP_CHARS:
        raise ConfigError(
            f"{where}.rollout_args.stop has {len(stop)} stop string(s), the longest of {longest} characters: at most "
            f"{MAX_STOP_STRINGS} of at most {MAX_STOP_CHARS} characters each. Both engines search the response for "
            f"every stop string after every token, with no time limit (10,000 strings cost about 7 ms a token for "
            f"each response). Keep the few strings that end an answer (a closing tag such as '</answer>', a turn marker).")


def _check_rollouts(cfg) -> None:
    """The sampling settings of every taskset that compare keys (their ranges: rft.plan.ranges), and the
    training taskset's rollouts per task."""
    inp, algo = cfg.buffer.explorer_input, cfg.algorithm
    ts_keys = [("buffer.explorer_input.taskset", inp.taskset)]
    ts_keys += [(f"buffer.explorer_input.eval_tasksets[{i}]", ts) for i, ts in enumerate(inp.eval_tasksets)]
    for where, ts in ts_keys:
        r = ts.rollout_args
        if 0 < r.temperature < 0.01:  # vLLM's SamplingParams raises it to 0.01 (its _MAX_TEMP)
            raise ConfigError(
                f"{where}.rollout_args.temperature={r.temperature} is below 0.01 (and not 0, greedy): vLLM raises such "
                f"a temperature to 0.01 (against inf and NaN in its sampler), so explorer=vllm would sample at 0.01 "
                f"and return log-probs of that distribution, while the trainer recomputes them at {r.temperature} (and "
                f"explorer=hf samples at {r.temperature}). Set 0.01 or more, or 0 for greedy decoding.")
        _check_context(cfg.model, where, r.max_tokens)
        _check_total_tokens(cfg.model, where, ts)
        _check_stop(where, list(r.stop))
        fmt = ts.format
        if fmt.prompt_type == "plaintext" and fmt.prompt_key == fmt.response_key:
            raise ConfigError(f"{where}.format.prompt_key and response_key both name the column {fmt.prompt_key!r}: "
                              f"the model would be shown the answer it is scored against. Point response_key at the "
                              f"reference answers (or null if the reward needs none).")
    for where, ts in ts_keys[1:]:
        n = ts.repeat_times or 1
        if any(not 1 <= k <= n for k in ts.pass_k):
            raise ConfigError(f"{where}.pass_k={list(ts.pass_k)}: each k must be in 1..{n}, the samples per task "
                              f"(its repeat_times); raise repeat_times to sample more, e.g. {where}.repeat_times="
                              f"{max(ts.pass_k)}.")
    train = (inp.taskset.path, inp.taskset.split, inp.taskset.subset_name)
    for where, ts in ts_keys[1:]:
        if (ts.path, ts.split, ts.subset_name) == train:
            # allowed (a check that a run fits its own data), but never by accident
            log.warning("%s (%s) reads the rows the run trains on (path %s, split %s): its accuracy measures "
                        "fitting the training set, not what was learned. Give it the held-out split to measure that.",
                        where, ts.name, ts.path, ts.split)
        system = inp.taskset.format.system_prompt
        if "plaintext" == ts.format.prompt_type == inp.taskset.format.prompt_type and ts.format.system_prompt != system:
            # each taskset has a format of its own: a system prompt set on the taskset alone left the
            # evals asking without it, their accuracy lower for prompts the run never trained on
            log.warning("%s (%s) has format.system_prompt=%r, the taskset %r: it is measured on prompts the run does "
                        "not train on. Set %s.format.system_prompt to the taskset's (or keep it, if that is the point).",
                        where, ts.name, ts.format.system_prompt, system, where)
    n = inp.taskset.repeat_times
    if n is not None and n != algo.repeat_times:
        # the plan (experiences per step, whole groups) counts algorithm.repeat_times
        raise ConfigError(f"buffer.explorer_input.taskset.repeat_times={n} differs from algorithm.repeat_times="
                          f"{algo.repeat_times}, which the batch plan counts (each step trains on batch_size x "
                          f"algorithm.repeat_times experiences). Set algorithm.repeat_times={n} and leave the "
                          f"taskset's repeat_times null.")


def _check_algorithm(cfg, needs: Needs) -> None:
    from rft.algorithms import rollout_is

    algo = cfg.algorithm
    rollout_is.check_config(algo)
    t = cfg.trainer
    if t.save_hf_checkpoint not in ("always", "last", "never"):
        raise ConfigError(f"trainer.save_hf_checkpoint={t.save_hf_checkpoint!r}: choose always, last or never.")
    if t.save_hf_checkpoint != "always" and not cfg.model.lora.rank:
        raise ConfigError(f"trainer.save_hf_checkpoint={t.save_hf_checkpoint}: only a LoRA run (model.lora.rank > 0) "
                          f"can leave out hf/, as it resumes from its adapter/; full fine-tuning resumes from hf/, "
                          f"written at every save. Use trainer.max_ckpt_to_keep to bound the disk instead.")
    backend = TRAINER_BACKENDS.info(t.trainer_strategy)
    for key in ("param_offload", "optimizer_offload", "ref_offload", "critic_offload"):
        if cfg.trainer[key] and not backend.offload:
            raise ConfigError(f"trainer.{key}=true needs trainer=fsdp2 (FSDP2 moves the shards between CPU and "
                              f"device; trainer=torch keeps everything on its device). Use trainer=fsdp2 "
                              f"(trainer.ranks=1 for one process) or set trainer.{key}=false.")
    if t.fp32_master_weights and not backend.mixed_precision:
        raise ConfigError(f"trainer.fp32_master_weights=true needs trainer=fsdp2 (FSDP2 keeps float32 weights and "
                          f"casts them to model.dtype={cfg.model.dtype} for each block's compute; trainer="
                          f"{t.trainer_strategy} computes in the weights' own dtype). Use trainer=fsdp2 (trainer.ranks=1 "
                          f"for one process) or set trainer.fp32_master_weights=false.")
    if cfg.model.lora.rank and not backend.lora:
        raise ConfigError(
            f"model.lora.rank={cfg.model.lora.rank}: trainer={t.trainer_strategy} does not train LoRA adapters (its "
            f"TrainerBackendInfo says lora=False). Use trainer=torch or trainer=fsdp2, or set model.lora.rank=0 to "
            f"train every weight."
        )
    if cfg.mode in ("both", "explore") and needs.grouped and algo.repeat_times < 2:
        raise ConfigError(
            f"algorithm.advantage_fn={algo.advantage_fn} compares rollouts within a group, but "
            f"algorithm.repeat_times={algo.repeat_times} gives groups of one (every advantage 0). "
            f"Set algorithm.repeat_times to 2 or more (8 is common)."
        )
    _unused_kl_coefs(algo)
    _unused_overlong_factor(algo)
    warn_unread(cfg)


def _check_greedy_groups(cfg, needs: Needs) -> None:
    """Temperature 0 is greedy decoding: a group's rollouts of one prompt are one response repeated, so
    their rewards are equal and an advantage that compares them is 0 for every rollout (the run
    trained nothing, with exit 0). A workflow other than single_turn may differ between rollouts
    (an environment's own randomness): warned about only."""
    ts, algo = cfg.buffer.explorer_input.taskset, cfg.algorithm
    if cfg.mode not in ("both", "explore") or not needs.grouped or algo.repeat_times < 2:
        return
    if ts.rollout_args.temperature != 0:
        return
    text = (f"buffer.explorer_input.taskset.rollout_args.temperature=0 is greedy decoding, so the "
            f"{algo.repeat_times} rollouts of a task (algorithm.repeat_times) are one response repeated, and "
            f"algorithm.advantage_fn={algo.advantage_fn} compares them: every advantage is 0 and nothing is learned. "
            f"Sample (temperature 1.0 is common; the eval sets' temperature can stay 0)")
    if ts.workflow != "single_turn":
        log.warning("%s, unless workflow %s makes the rollouts differ.", text, ts.workflow)
        return
    raise ConfigError(text + ".")


def _check_greedy_evals(cfg) -> None:
    """An eval set that samples a task more than once (repeat_times > 1: pass@k, mean@n, maj@n) at
    temperature 0 (the eval sets' default) gets one response n times: pass@k equals pass@1 for every k,
    a measurement that looks like one."""
    for i, ts in enumerate(cfg.buffer.explorer_input.eval_tasksets):
        n, where = ts.repeat_times or 1, f"buffer.explorer_input.eval_tasksets[{i}]"
        if n > 1 and ts.rollout_args.temperature == 0 and ts.workflow == "single_turn":
            raise ConfigError(
                f"{where}.repeat_times={n} samples each task {n} times, but its rollout_args.temperature=0 is greedy "
                f"decoding: the {n} samples are one response repeated, so pass@k equals pass@1 for every k (and "
                f"mean@n, maj@n, best@n say nothing more). Set {where}.rollout_args.temperature (1.0 is common) for "
                f"samples that differ, or repeat_times=1.")


def _unused_kl_coefs(algo) -> None:
    """A KL coefficient set while its function is none is read by nothing: a sweep over it
    (grpo's kl_loss_fn is none) ran the same job twice, without a word. An SFT stage (no advantage
    function) is left alone: it inherits the RL stage's coefficient and never uses a KL term."""
    defaults = C.AlgorithmConfig()
    for fn, coef, what in (("kl_loss_fn", "kl_loss_coef", "loss"), ("kl_penalty_fn", "kl_penalty_coef", "penalty")):
        if algo[fn] == "none" and algo[coef] != getattr(defaults, coef) and algo.advantage_fn != "none":
            log.warning("algorithm.%s=%s has no effect: algorithm.%s is none, so the stage adds no KL %s. Set "
                        "algorithm.%s (k3 is common) to use it.", coef, algo[coef], fn, what, fn)


def _unused_overlong_factor(algo) -> None:
    """DAPO's overlong penalty factor set while overlong_buffer_frac is 0 (grpo's, dr_grpo's) is read by
    nothing: a sweep over it ran the same job twice, as an unused KL coefficient did."""
    factor = algo.overlong_penalty_factor
    if algo.overlong_buffer_frac <= 0 and factor != C.AlgorithmConfig().overlong_penalty_factor and algo.advantage_fn != "none":
        log.warning("algorithm.overlong_penalty_factor=%s has no effect: algorithm.overlong_buffer_frac is 0, so no "
                    "response is penalised for its length. Set algorithm.overlong_buffer_frac (DAPO's 0.2) to use "
                    "it.", factor)


ALGORITHM_FN_KEYS = ("advantage_fn", "policy_loss_fn")
# keys that turn on what makes an algorithm of conf/algorithm/ more than its parent's functions (mix's
# SFT term, dapo's dynamic sampling and overlong penalty, opd's teacher), each with the value it is
# off at or below: mix and dapo keep grpo's functions, so the functions alone let
# algorithm.algorithm_type=mix run plain GRPO under the name mix
ALGORITHM_SWITCHES = {"sft_loss_weight": 0, "distill_coef": 0, "dynamic_sampling_max_tries": 1,
                      "overlong_buffer_frac": 0}


def check_algorithm_label(cfg, _=None) -> None:
    """algorithm.algorithm_type is a label here; in Trinity-RFT it picks the algorithm. A stage (or
    an override) that names an algorithm of conf/algorithm/ there, other than the `algorithm=`
    group chosen, while its functions are another algorithm's, or none of the file's switches
    (ALGORITHM_SWITCHES) is on, would run that other algorithm under the name it gives (Trinity's
    stage `algorithm: {algorithm_type: sft}` ran GRPO labelled sft; `algorithm_type: mix` GRPO
    without its SFT term). Checked where the stages are split (rft.runtime.main.split_stages), under
    the job's own HydraConfig: a sweep's driver plans each job with the driver's."""
    from pathlib import Path

    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return  # no group was chosen (a config built directly): nothing to compare with
    label = cfg.algorithm.algorithm_type
    if label == HydraConfig.get().runtime.choices.get("algorithm"):
        return  # the label the chosen group gave, whatever functions were overridden after it
    conf = Path(__file__).resolve().parents[2] / "conf"
    wants = algorithm_file_fns(label, conf)
    if not wants:
        return
    runs = {k: cfg.algorithm[k] for k in ALGORITHM_FN_KEYS}
    said = ", ".join(f"{k}={v}" for k, v in runs.items())
    if any(wants.get(k, runs[k]) != runs[k] for k in ALGORITHM_FN_KEYS):
        missing = ", ".join(f"{k}={v}" for k, v in wants.items())
    else:
        # the same functions: the file's switches that are on there, unless the run has one of them on
        on = {k: v for k, v in algorithm_file_fns(label, conf, tuple(ALGORITHM_SWITCHES)).items()
              if v > ALGORITHM_SWITCHES[k]}
        if not on or any(cfg.algorithm[k] > ALGORITHM_SWITCHES[k] for k in on):
            return
        said += " with " + ", ".join(f"{k}={cfg.algorithm[k]}" for k in on)
        missing = ", ".join(f"{k}={v}" for k, v in on.items())
    raise ConfigError(
        f"algorithm.algorithm_type={label} is only a name for logs and outputs here (in Trinity-RFT it picks "
        f"the algorithm): this stage would run {said}, not {label}'s {missing}. Choose the algorithm with "
        f"algorithm={label} (conf/algorithm/{label}.yaml; in a stage's entry, its algorithm keys as that file "
        f"sets them), or give a name that is no algorithm's.")


def algorithm_file_fns(name: str, conf_dir, keys: tuple = ALGORITHM_FN_KEYS) -> dict[str, Any] | None:
    """The keys (advantage_fn and policy_loss_fn unless told) as conf/algorithm/<name>.yaml sets
    them, through the files of its group that it extends (`defaults: [grpo]`); None when there is
    no such file."""
    import yaml

    from rft.plan.overlays import _PACKAGE, entries

    path = conf_dir / "algorithm" / f"{name}.yaml"
    if not path.is_file():
        return None
    got: dict[str, Any] = {}
    for e in entries(path, conf_dir):
        if e.bare and e.option != name:
            got.update(algorithm_file_fns(e.option, conf_dir, keys) or {})
    text = path.read_text()
    own = yaml.safe_load(text) or {}
    package = _PACKAGE.search(text)
    if package and package.group(1) == "_global_":
        own = own.get("algorithm") or {}
    got.update({k: own[k] for k in keys if k in own})
    return got


def _check_distill(algo, needs: Needs) -> None:
    """algorithm.distill_coef has a teacher to distil from and a loss that reads advantages."""
    if not algo.distill_coef:
        return  # a teacher_model_path is then unused (a warm-up stage inherits the RL stage's)
    if not algo.teacher_model_path:
        raise ConfigError(
            f"algorithm.distill_coef={algo.distill_coef} distils from a teacher, but algorithm.teacher_model_path "
            f"is not set. Give the teacher: a local directory or a hub id of a causal LM with the policy's "
            f"tokenizer (algorithm.teacher_model_path=<path>), or set algorithm.distill_coef=0."
        )
    if needs.imitation:
        raise ConfigError(
            f"algorithm.distill_coef={algo.distill_coef} adds the teacher's signal to the advantages, which "
            f"algorithm.policy_loss_fn={algo.policy_loss_fn} never reads (it imitates given tokens). Use a policy-"
            f"gradient loss (ppo_clip, as algorithm=opd does), or set algorithm.distill_coef=0 for this stage."
        )


def _check_reward_head(cfg, needs: Needs, kind: str) -> None:
    """A reward model (algorithm=rm) trains, all its weights, from preference pairs in a dataset
    (algorithm.rm_pairs=dataset) or from the groups of a fixed policy's rollouts (groups)."""
    algo = cfg.algorithm
    if not needs.reward_head:
        if algo.rm_pairs == "groups":
            raise ConfigError(
                f"algorithm.rm_pairs=groups makes preference pairs for a reward model, but algorithm.policy_loss_fn="
                f"{algo.policy_loss_fn} trains no reward model (bradley_terry does). Use algorithm=rm with "
                f"algorithm.rm_pairs=groups, or leave algorithm.rm_pairs=dataset (it is then unused).")
        return
    if algo.rm_pairs == "groups":
        _check_online_pairs(cfg)
    elif kind != "dataset":
        raise ConfigError(
            f"algorithm.policy_loss_fn={algo.policy_loss_fn} trains a reward model from preference pairs in "
            f"a dataset (mode=train, buffer.trainer_input.experience_buffer a file with format.chosen_key and "
            f"rejected_key), but this stage's trainer would read {kind} (mode={cfg.mode}). algorithm=rm sets that up; "
            f"for pairs from the groups of the policy's own rollouts set algorithm.rm_pairs=groups with mode=both."
        )
    if cfg.model.lora.rank:
        raise ConfigError(f"model.lora.rank={cfg.model.lora.rank}: a reward model (algorithm.policy_loss_fn="
                          f"{cfg.algorithm.policy_loss_fn}) trains all its weights here; set model.lora.rank=0.")


def _check_online_pairs(cfg) -> None:
    """algorithm.rm_pairs=groups: the explorers sample groups from the stage's starting policy (never
    synced), each group whose rewards differ gives a pair, the trainer trains the reward model on them."""
    algo, eb = cfg.algorithm, cfg.buffer.trainer_input.experience_buffer
    if cfg.mode != "both":
        raise ConfigError(
            f"algorithm.rm_pairs=groups trains the reward model on pairs made from each explore step's groups, so "
            f"the stage explores and trains at once (mode=both), but mode={cfg.mode}. Set mode=both, or "
            f"algorithm.rm_pairs=dataset to learn from the pairs in buffer.trainer_input.experience_buffer (mode=train).")
    if eb.storage_type != "queue":
        raise ConfigError(
            f"algorithm.rm_pairs=groups passes the pairs to the trainer in memory, so buffer.trainer_input."
            f"experience_buffer.storage_type must be queue (it is {eb.storage_type}; algorithm=rm sets file, to read a "
            f"dataset's pairs); its path, format and eval_split then name the held-out pairs of eval/pair_accuracy "
            f"alone. Set buffer.trainer_input.experience_buffer.storage_type=queue.")
    if algo.repeat_times < 2:
        raise ConfigError(
            f"algorithm.rm_pairs=groups pairs a group's best response with its worst, but algorithm.repeat_times="
            f"{algo.repeat_times} gives groups of one (no pair ever). Set algorithm.repeat_times to 2 or more (8 "
            f"is common: more responses, more tasks whose rewards differ).")
    if cfg.synchronizer.sync_style != "fixed":
        raise ConfigError(
            f"synchronizer.sync_style={cfg.synchronizer.sync_style} has the explorers pick up the trainer's weights, "
            f"but with algorithm.rm_pairs=groups they serve the stage's starting policy throughout (the trainer's "
            f"model is the reward model). Set synchronizer.sync_style=fixed.")


def _step_batch(cfg, dataset_size: int, kind: str, needs: Needs) -> tuple[int, int]:
    """(experiences per step, steps per epoch)."""
    buf, algo = cfg.buffer, cfg.algorithm
    produced = buf.batch_size * algo.repeat_times
    if kind == "experiences":
        # RL from experiences an explorer stored: whole groups per step, as in mode=both
        train_bs = buf.train_batch_size or produced
        if needs.grouped and train_bs % algo.repeat_times:
            raise ConfigError(
                f"buffer.train_batch_size={train_bs} must be a multiple of algorithm.repeat_times "
                f"({algo.repeat_times}) so that each step reads whole groups of rollouts."
            )
        # with total_steps set the trainer may read experiences still being written
        per_epoch = dataset_size // train_bs or (1 if buf.total_steps else 0)
        unit, unit_key = train_bs, "buffer.train_batch_size"
    elif cfg.mode == "both" and needs.reward_head:  # algorithm.rm_pairs=groups (_check_online_pairs)
        train_bs = buf.train_batch_size or 2 * buf.batch_size
        if train_bs != 2 * buf.batch_size:
            raise ConfigError(
                f"buffer.train_batch_size={train_bs} must equal 2 x buffer.batch_size ({buf.batch_size}) = "
                f"{2 * buf.batch_size} with algorithm.rm_pairs=groups: it counts experiences, and each task's group "
                f"of {algo.repeat_times} responses gives at most one pair, two experiences (chosen, rejected), so a "
                f"step trains on up to {buf.batch_size} pairs (fewer when some groups' rewards are all equal). "
                f"Remove buffer.train_batch_size (it defaults to 2 x batch_size) or set it to {2 * buf.batch_size}."
            )
        per_epoch = dataset_size // buf.batch_size
        unit, unit_key = buf.batch_size, "buffer.batch_size"
    elif cfg.mode in ("both", "explore"):
        train_bs = buf.train_batch_size or produced
        if train_bs != produced:
            raise ConfigError(
                f"buffer.train_batch_size={train_bs} must equal buffer.batch_size ({buf.batch_size}) x "
                f"algorithm.repeat_times ({algo.repeat_times}) = {produced} in mode=both: each step "
                f"trains on exactly the experiences the explorer produced. Remove "
                f"buffer.train_batch_size (it defaults to the product) or set it to {produced}."
            )
        per_epoch = dataset_size // buf.batch_size
        unit, unit_key = buf.batch_size, "buffer.batch_size"
    else:
        train_bs = buf.train_batch_size or buf.batch_size
        per_epoch = dataset_size // train_bs
        unit, unit_key = train_bs, "buffer.train_batch_size"
    if per_epoch == 0:
        raise ConfigError(
            f"the dataset has {dataset_size} rows, fewer than {unit_key}={unit}: one epoch "
            f"would be 0 steps. Lower {unit_key} or use a larger dataset."
        )
    return train_bs, per_epoch


def _mini_batches(tr, train_bs: int, dp: int) -> tuple[int, int]:
    """(experiences per optimizer step, experiences per micro-batch on each rank)."""
    mini = tr.mini_batch_size or train_bs
    if mini < 1 or train_bs % mini:
        raise ConfigError(
            f"trainer.mini_batch_size={mini} must divide buffer.train_batch_size={train_bs} "
            f"(experiences per step) into whole optimizer steps. Choose a divisor of {train_bs}, "
            f"e.g. {_divisor_near(train_bs, mini)}."
        )
    # a micro-batch larger than the mini-batch means "the whole mini-batch at once"
    micro = min(tr.micro_batch_size_per_gpu, mini // dp)
    if mini % dp:  # no micro-batch size can fix that: the message said "choose a divisor of 21, e.g. 21"
        raise ConfigError(
            f"trainer.mini_batch_size={mini} cannot be split evenly over the trainer's data-parallel size {dp} "
            f"(trainer.ranks, or one per device the explorers leave): each rank takes an equal share. Choose "
            f"trainer.ranks that divides {mini}, e.g. {_divisor_near(mini, dp)}, or a mini_batch_size that is a "
            f"multiple of {dp}.")
    if micro < 1 or mini % (micro * dp):
        raise ConfigError(
            f"trainer.micro_batch_size_per_gpu={micro} x data-parallel size {dp} must divide "
            f"trainer.mini_batch_size={mini}. Choose a divisor of {mini // dp}, "
            f"e.g. {_divisor_near(mini // dp, micro)}."
        )
    return mini, micro


_PAIR_AGG = {"seq-mean-token-mean": "would weight each pair by 1 over its length",
             "token-mean": "would scale it by 1 over the step's tokens, a different factor each step",
             "seq-mean-token-sum-norm": "would scale it by 1 over model.max_response_tokens"}


def _check_pair_aggregation(algo) -> None:
    """dpo and bradley_terry spread each pair's one loss over the pair's tokens so that
    seq-mean-token-sum (a mean over rows) is the mean over pairs; seq-mean-token-mean weighted a pair
    by 1/its length (a 2-token pair 50x a 100-token one) and token-mean by 1/the batch's tokens."""
    if algo.policy_loss_fn in ("dpo", "bradley_terry") and algo.loss_agg_mode != "seq-mean-token-sum":
        raise ConfigError(
            f"algorithm.loss_agg_mode={algo.loss_agg_mode} with algorithm.policy_loss_fn={algo.policy_loss_fn}: its "
            f"loss is one value per preference pair, spread over the pair's tokens so that seq-mean-token-sum "
            f"gives the mean over pairs; {algo.loss_agg_mode} {_PAIR_AGG[algo.loss_agg_mode]}. "
            f"Set algorithm.loss_agg_mode=seq-mean-token-sum (algorithm={'dpo' if algo.policy_loss_fn == 'dpo' else 'rm'}'s).")


def _check_pairs(cfg, needs: Needs, kind: str, sizes: list[tuple[str, int]]) -> None:
    """A loss that learns from preference pairs gets a dataset of them, in whole pairs."""
    eb = cfg.buffer.trainer_input.experience_buffer
    fmt = eb.format
    online = kind == "rollouts" and needs.reward_head  # algorithm.rm_pairs=groups: pairs from the groups
    pairs = kind == "dataset" and bool(fmt.chosen_key and fmt.rejected_key) or online
    if needs.paired and not pairs:
        raise ConfigError(
            f"algorithm.policy_loss_fn={cfg.algorithm.policy_loss_fn} learns from preference pairs in a dataset "
            f"(mode=train, buffer.trainer_input.experience_buffer.storage_type=file with format.chosen_key "
            f"and format.rejected_key set), but this stage has mode={cfg.mode}, storage_type="
            f"{eb.storage_type}, chosen_key={fmt.chosen_key}, "
            f"rejected_key={fmt.rejected_key}. Give it a dataset of pairs (a taskset whose format sets "
            f"chosen_key and rejected_key serves by default)."
        )
    _check_pair_aggregation(cfg.algorithm)
    if cfg.mode == "train" and fmt.chosen_key and fmt.rejected_key or online:
        # preference pairs (two rows each) must not be split across batches
        for key, value in sizes:
            if value % 2:
                raise ConfigError(
                    f"{key}={value} must be even with preference pairs ("
                    f"{'algorithm.rm_pairs=groups' if online else 'format.chosen_key and rejected_key set'}): "
                    f"each pair is two experiences that stay together."
                )


def _length(cfg, per_epoch: int, opt_per_step: int) -> tuple[int, int]:
    """(total steps, optimizer steps per step), with the warm-up checked against them."""
    buf = cfg.buffer
    total = buf.total_steps if buf.total_steps is not None else buf.total_epochs * per_epoch
    if buf.total_steps is not None and buf.total_epochs != C.BufferConfig().total_epochs:
        # total_steps wins, as in Trinity-RFT; but a model file may set it (model=tiny: 60), so a
        # user's total_epochs=2 ran 60 steps unsaid
        where = f"stage {cfg.stage_name}: " if cfg.get("stage_name") else ""
        log.warning("%sbuffer.total_epochs=%s has no effect: buffer.total_steps=%s is set and wins (a model or "
                    "experiment file may set it: model=tiny's sets 60, its warm-up stage 400). For %s epochs of %s "
                    "steps, set buffer.total_steps=null (a stage's own, stages.<i>.buffer.total_steps=null).",
                    where, buf.total_epochs, buf.total_steps, buf.total_epochs, per_epoch)
    opt = cfg.algorithm.optimizer
    warmup = opt.warmup_steps
    if not 0 <= warmup <= total * opt_per_step:
        raise ConfigError(
            f"algorithm.optimizer.warmup_steps={warmup} must be between 0 and the run's "
            f"{total * opt_per_step} optimizer steps ({total} steps x {opt_per_step} per step)."
        )
    return total, opt_per_step


def _warn_stored_steps(cfg, kind: str, stored: int, train_bs: int, total: int) -> None:
    """mode=train from an explore job's buffer, for more steps than it holds: each later step waits
    max_read_timeout (30 min) for rows a live explore job may still write, then stops. Said at the
    start, as the steps set may not be the user's (model=tiny's file sets buffer.total_steps=60)."""
    if kind != "experiences" or cfg.buffer.total_steps is None or total * train_bs <= stored:
        return
    eb = cfg.buffer.trainer_input.experience_buffer
    log.warning(
        "mode=train: buffer.total_steps=%s, but %s holds %s experiences, %s steps of buffer.train_batch_size=%s: from "
        "step %s on each step waits up to buffer.trainer_input.experience_buffer.max_read_timeout=%ss for an explore "
        "job still writing there, then stops. If no explore job writes there any more, set buffer.total_steps=null "
        "(the steps stored) or at most %s.", total, eb.path, stored, stored // train_bs, train_bs,
        stored // train_bs + 1, eb.max_read_timeout, stored // train_bs)


def _check_schedule(cfg, needs: Needs, kind: str, train_bs: int, total: int) -> None:
    """What the run's length and a step's size make of the critic's warm-up, the queue and the
    explorers' lead."""
    warmup = cfg.algorithm.critic_warmup
    if needs.critic and cfg.mode != "explore" and warmup >= total:
        raise ConfigError(
            f"algorithm.critic_warmup={warmup} steps train only the critic, but the stage has {total} steps: the policy "
            f"would never be trained. Lower critic_warmup below {total} (0: none), or train for more steps.")
    eb = cfg.buffer.trainer_input.experience_buffer
    if kind == "rollouts" and eb.storage_type == "queue" and eb.path and not eb.eval_split:
        # Trinity-RFT backs a queue up to its path; here nothing is written there, unsaid (an online
        # reward model's queue names its held-out pairs there: eval_split, experiments/rm_online)
        log.warning("buffer.trainer_input.experience_buffer.path=%s is not written: a queue buffer keeps its "
                    "experiences in memory only (Trinity-RFT backs a queue up to its path). For a copy on disk use "
                    "buffer=sql (a SQLite file at that path, read by `python -m rft.data.buffer`), or remove the path.",
                    eb.path)
    if kind == "rollouts" and eb.storage_type == "queue" and eb.capacity < train_bs:
        # the trainer waits for a whole step's batch that the queue can never hold
        raise ConfigError(
            f"buffer.trainer_input.experience_buffer.capacity={eb.capacity} holds fewer experiences than one step "
            f"trains on (buffer.train_batch_size={train_bs}), so the trainer would wait for a batch that never fits. "
            f"Raise capacity to at least {train_bs}.")
    lead = cfg.synchronizer.sync_offset
    if cfg.mode == "both" and lead is not None and lead >= total > 1:
        log.warning("synchronizer.sync_offset=%d is not below the stage's %d steps: the explorers generate every step "
                    "before they take trained weights, so the whole stage learns from its starting policy's rollouts "
                    "(offline). Lower sync_offset (null: 1 or 0) for an online run.", lead, total)


def _check_model(model) -> None:
    if model.dtype not in C.DTYPES:
        raise ConfigError(f"model.dtype={model.dtype!r} is not a dtype; choose one of {', '.join(C.DTYPES)}.")
    path = os.path.expanduser(model.model_path)
    # a hub id ("org/name") cannot be checked here (no hub may be reachable); a local path can
    looks_local = path.startswith(("/", ".")) or path.count("/") > 1
    if re.fullmatch(r"step_\d+", os.path.basename(os.path.realpath(path))) and not os.path.isfile(
            os.path.join(path, "config.json")) and os.path.isfile(os.path.join(path, "hf", "config.json")):
        # a run's checkpoint given where its model is meant: transformers failed on the tokenizer (or
        # model=tiny's builder took the folder for its own), naming neither. By its real name: a link
        # to one (best -> step_40) was the same
        raise ConfigError(f"model.model_path={model.model_path!r} is a run's checkpoint, not a model: its model is in "
                          f"its hf/ folder. Give model.model_path={os.path.join(path, 'hf')!r}.")
    if model.builder is not None and not looks_local and "/" in path and not os.path.exists(path) \
            and not os.path.isdir(path.split("/")[0]):
        # model=tiny's builder kept with a hub id (model.model_path=Qwen/Qwen2.5-0.5B-Instruct): it built a
        # random tiny model in ./Qwen/Qwen2.5-0.5B-Instruct and the run trained that, exit 0
        raise ConfigError(
            f"model.model_path={model.model_path!r} reads as a hub id (org/name: there is no {path.split('/')[0]}/ "
            f"here), and model.builder={model.builder} builds a model of its own with random weights where "
            f"model_path is not there yet: the run would train that, not the hub's model. For a model from the hub "
            f"(or a folder of your own) set model.builder=null too (model=qwen2.5-0.5b does); for a new "
            f"{model.builder} model built there, write the path as ./{path}.")
    if model.builder is None and os.path.isfile(path):
        # a GGUF or a lone weights file: it exists, so "no such directory" would mislead
        raise ConfigError(
            f"model.model_path={model.model_path!r} is a file, and a model in Hugging Face format is a directory "
            f"(config.json, the weights as *.safetensors, the tokenizer files). Give that directory, or a hub id "
            f"(e.g. Qwen/Qwen2.5-0.5B-Instruct); a GGUF file is not read here.")
    if model.builder is None and looks_local and not os.path.isdir(path):
        raise ConfigError(
            f"model.model_path={model.model_path!r}: no such directory (relative paths are relative "
            f"to {os.getcwd()}). Give a local directory in Hugging Face format or a hub id "
            f"(e.g. Qwen/Qwen2.5-0.5B-Instruct)."
        )
    if model.builder is None and os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        held = sorted(os.listdir(path))
        raise ConfigError(
            f"model.model_path={model.model_path!r} is a directory, but not a model in Hugging Face format: it has no "
            f"config.json ({'it holds ' + ', '.join(held[:5]) + (' ...' if len(held) > 5 else '') if held else 'it is empty'}). "
            f"Point it at the model's own directory (config.json, the weights, the tokenizer files)."
        )
    _check_lora(model.lora)
    if model.attn_implementation is not None and model.attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(f"model.attn_implementation={model.attn_implementation!r} is not an attention kernel; "
                          f"choose one of {', '.join(ATTN_IMPLEMENTATIONS)} (or null for transformers' default, sdpa).")
    if model.custom_chat_template is not None:
        check_template(model.custom_chat_template, "model.custom_chat_template")
    need = model.max_prompt_tokens + model.max_response_tokens
    if model.max_model_len is not None and model.max_model_len < need:
        raise ConfigError(
            f"model.max_model_len={model.max_model_len} is smaller than model.max_prompt_tokens "
            f"({model.max_prompt_tokens}) + model.max_response_tokens ({model.max_response_tokens}) "
            f"= {need}. Raise max_model_len or lower the token budgets."
        )
    _check_positions(model)


def _check_positions(model) -> None:
    """The longest sequence the run is sized for fits the model's positions (its config.json's
    max_position_embeddings, times a rope_scaling factor; else model.architecture's): past them the
    hf engine and the trainer went on at positions the model never learned (exit 0), and vLLM
    refused the engine only after the model had loaded."""
    raw, source = memory._read_config(model)
    positions = (raw or {}).get("max_position_embeddings")
    if isinstance(positions, bool) or not isinstance(positions, int) or positions < 1:
        return
    scaling = raw.get("rope_scaling")
    factor = scaling.get("factor") if isinstance(scaling, dict) else None
    limit = int(positions * factor) if isinstance(factor, int | float) and factor > 1 else positions
    need = memory.longest(model)
    if need <= limit:
        return
    named = (f"model.max_model_len={need}" if model.max_model_len else f"model.max_prompt_tokens + "
             f"model.max_response_tokens = {model.max_prompt_tokens} + {model.max_response_tokens} = {need}")
    raise ConfigError(
        f"{named} tokens is more than the model's {limit} positions (max_position_embeddings="
        f"{positions}{f' x rope_scaling factor {factor}' if limit != positions else ''}, in {source}): the "
        f"model never learned positions past them. Lower the token budgets to {limit} tokens in all.")


def _check_lora(lora) -> None:
    import re

    if not lora.rank:  # (its range, and alpha's: rft.plan.ranges)
        return
    if lora.dropout:
        raise ConfigError(f"model.lora.dropout={lora.dropout}: the trainer computes without dropout so that its "
                          f"log-probs are the ones the engine sampled with (the policy ratio's denominator). Set "
                          f"model.lora.dropout=0.")
    tm = lora.target_modules
    names = list(tm) if isinstance(tm, ListConfig | list) else None
    try:
        ok = bool(tm.strip() and re.compile(tm)) if isinstance(tm, str) else bool(
            names and all(isinstance(m, str) and m.strip() for m in names))
    except re.error:
        ok = False
    if not ok:
        shown = "null" if tm is None else repr(tm)
        raise ConfigError(f"model.lora.target_modules={shown} names no module to adapt: give all-linear (every linear "
                          f"layer but the output layer), a list of module names ([q_proj, v_proj]), or a regular "
                          f"expression that PEFT matches against the modules' full names.")


def check_template(template, key: str) -> None:
    """A chat template parses as Jinja the way transformers compiles it (loop controls, and its
    `{% generation %}` blocks); parsed only, with jinja2 alone: planning imports no transformers."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols

    class Generation(Extension):  # transformers' AssistantTracker tag, as far as parsing goes
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    if not isinstance(template, str) or not template.strip():
        raise ConfigError(f"{key}={template!r}: give the Jinja text of a chat template (or null: the tokenizer's own).")
    try:
        parsed = jinja2.Environment(extensions=[Generation, loopcontrols]).parse(template)
    except jinja2.TemplateSyntaxError as e:
        line = template.splitlines()[e.lineno - 1] if 0 < e.lineno <= len(template.splitlines()) else ""
        raise ConfigError(f"{key} is not a valid Jinja template: at its line {e.lineno} ({line.strip()[:80]!r}): "
                          f"{(e.message or '').rstrip('.')}. Fix the template; transformers' chat templating docs "
                          f"show the syntax.") from None
    from jinja2 import meta

    if "messages" not in meta.find_undeclared_variables(parsed):
        # a path given for the text, or a template that forgot them: every prompt the same text
        raise ConfigError(f"{key}={template[:80]!r} never reads `messages`, so every prompt would render as the same "
                          f"text, whatever the task. Give the template's Jinja text (it loops over messages: "
                          f"{{% for m in messages %}}...), not a file's path; a YAML block (key: |) holds "
                          f"a long one.")


ATTN_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "flash_attention_3", "eager", "flex_attention")
# the module each FlashAttention kernel is imported from (transformers' is_flash_attn_*_available)
FLASH_MODULES = {"flash_attention_2": ("flash_attn", "flash-attn"),
                 "flash_attention_3": ("flash_attn_interface", "flash-attn-3")}


def _check_hf_tensor_parallel(rm) -> None:
    """The hf engine loads its model on one device: a tensor_parallel_size above 1 reserved that many
    GPUs an engine and left all but one idle (on CPU it changed nothing), with no word said."""
    if rm.engine_type == "hf" and rm.tensor_parallel_size > 1:
        raise ConfigError(
            f"explorer.rollout_model.tensor_parallel_size={rm.tensor_parallel_size} splits a vLLM engine over GPUs, "
            f"but explorer.rollout_model.engine_type=hf runs each engine on one device (a GPU, or the CPU): the "
            f"other devices would be reserved and idle. Set tensor_parallel_size=1 (more engines: "
            f"explorer.rollout_model.engine_num), or use explorer=vllm on GPUs to split a model over several.")


def _check_flash_attention(kernel: Optional[str], gpus: int) -> None:
    """FlashAttention has CUDA kernels only, in a package of its own: without a GPU, or without the
    package, the run got as far as its actors' model loads and stopped there with transformers'
    ImportError, naming neither the key nor the way back to sdpa. The package is looked for in the
    environment run.py starts from, which the actors it starts share; transformers' `kernels`
    package can stand in for it (a kernel from the Hugging Face hub)."""
    if kernel not in FLASH_MODULES:
        return
    module, package = FLASH_MODULES[kernel]
    fix = "or leave model.attn_implementation null (transformers' default, sdpa, which packs sequences as well)"
    if not gpus:
        raise ConfigError(f"model.attn_implementation={kernel} runs on CUDA GPUs only, and this run has none "
                          f"(cluster.gpu_per_node=0): set cluster.gpu_per_node, {fix}.")
    if importlib.util.find_spec(module) is None and importlib.util.find_spec("kernels") is None:
        raise ConfigError(f"model.attn_implementation={kernel} needs the {package} package, which is not installed "
                          f"in this environment (the one run.py starts from, shared by the actors it starts). "
                          f"Install it (`pip install {package} --no-build-isolation`, built against this torch and "
                          f"CUDA), {fix}.")


def _token_budget(cfg, micro: int) -> int | None:
    """trainer.use_dynamic_bsz: the tokens per micro-batch (default: what micro_batch_size_per_gpu
    rows of max_model_len tokens would hold)."""
    t, model = cfg.trainer, cfg.model
    if not t.use_dynamic_bsz:
        return None
    longest = memory.longest(model)
    budget = t.max_token_len_per_gpu or micro * longest
    if budget < longest:
        log.warning("trainer.max_token_len_per_gpu=%d is below the longest sequence (%d tokens: "
                    "model.max_model_len or max_prompt_tokens + max_response_tokens); a longer sequence "
                    "is a micro-batch of its own, over the budget.", budget, longest)
    return budget


def sft_buffer_config(cfg):
    """The expert data algorithm.sft_loss_weight > 0 (mix) learns from, as (ExperienceBufferConfig,
    the key to name in errors): buffer.trainer_input.auxiliary_buffers[algorithm.sft_buffer], or,
    when there is no such entry, the taskset's own prompts and reference answers."""
    aux, name = cfg.buffer.trainer_input.auxiliary_buffers, cfg.algorithm.sft_buffer
    if name in aux:
        where = f"buffer.trainer_input.auxiliary_buffers.{name}"
        return _typed_buffer(aux[name], where), where
    if aux or name != C.AlgorithmConfig().sft_buffer:
        # a misspelt name (or one whose buffer was left out) fell back to the taskset without a word
        raise ConfigError(
            f"algorithm.sft_buffer={name!r} names no buffer of buffer.trainer_input.auxiliary_buffers (it has "
            f"{sorted(aux)}), so algorithm.sft_loss_weight={cfg.algorithm.sft_loss_weight} would learn from no expert "
            f"data of yours. Set algorithm.sft_buffer to one of those names, or add "
            f"+buffer.trainer_input.auxiliary_buffers.{name}.path=<dataset of prompt/response rows> (with neither, "
            f"algorithm.sft_buffer={C.AlgorithmConfig().sft_buffer} learns from the taskset's reference answers).")
    ts = cfg.buffer.explorer_input.taskset
    where = "buffer.explorer_input.taskset"
    if not ts.format.response_key:
        raise ConfigError(
            f"algorithm.sft_loss_weight={cfg.algorithm.sft_loss_weight} needs expert data: an auxiliary "
            f"buffer algorithm.sft_buffer={name!r} in buffer.trainer_input.auxiliary_buffers (it has "
            f"{sorted(aux)}), or a taskset with reference answers ({where}.format.response_key is null). "
            f"Add +buffer.trainer_input.auxiliary_buffers.{name}.path=<dataset of prompt/response rows>."
        )
    try:
        merged = OmegaConf.merge(OmegaConf.structured(C.ExperienceBufferConfig),
                                 {"name": name, "storage_type": "file", "path": ts.path, "split": ts.split,
                                  "format": ts.format})
    except OmegaConfBaseException as e:  # pragma: no cover - the taskset's format is typed already
        raise ConfigError(f"{where}: {str(e).splitlines()[0]}") from e
    return merged, where


def _typed_buffer(value, where: str):
    """An auxiliary buffer's dict as an ExperienceBufferConfig: a misspelt key fails here, naming it."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(C.ExperienceBufferConfig), value)
    except OmegaConfBaseException as e:
        keys = sorted(OmegaConf.structured(C.ExperienceBufferConfig).keys())
        raise ConfigError(
            f"{where}: {str(e).splitlines()[0]}. Its keys are those of "
            f"buffer.trainer_input.experience_buffer: {keys}."
        ) from e
    if not merged.path:
        raise ConfigError(f"{where}.path is not set: give the dataset of prompt/response rows it reads.")
    return merged


def _check_runtime(cfg) -> None:
    """Modes, buffers, the synchronizer's schedule and staleness bound, runners, placement."""
    sc, ex, eb = cfg.synchronizer, cfg.explorer, cfg.buffer.trainer_input.experience_buffer
    key = "buffer.trainer_input.experience_buffer"
    if cfg.mode == "explore" and eb.storage_type not in ("sql", "file"):
        raise ConfigError(
            f"mode=explore stores experiences for a later or separate mode=train run, so "
            f"{key}.storage_type must be sql or file (it is {eb.storage_type}): add buffer=sql."
        )
    if cfg.mode == "train" and eb.storage_type == "queue":
        raise ConfigError(
            f"mode=train reads {key}, and a queue has no writer without an explorer: use "
            f"buffer=sql (experiences a mode=explore run stored) or storage_type=file with a path."
        )
    if sc.sync_offset is None:  # a config not from stage_configs (tests, notebooks)
        sc = OmegaConf.merge(sc, {"sync_offset": sync_offset(cfg)})
    # mode=explore never syncs from a trainer (it reads checkpoints), so any method is fine there
    if sc.sync_method == "collective" and cfg.cluster.backend != "ray" and cfg.mode != "explore":
        raise ConfigError(
            f"synchronizer.sync_method=collective broadcasts between the trainer's and the explorers' "
            f"processes, so it needs cluster.backend=ray (here {cfg.cluster.backend}). Use cluster=local, "
            f"or sync=memory or sync=checkpoint."
        )
    # a fixed schedule's staleness is known: offset + interval - 1 at most; a bound below it would
    # drop experiences every step (a dynamic one drops what timing made too old, and counts it)
    dynamic = _check_dynamic(cfg, sc)
    worst = sc.sync_offset + sc.sync_interval - 1
    if cfg.mode == "both" and not dynamic and sc.max_staleness is not None and worst > sc.max_staleness:
        raise ConfigError(
            f"synchronizer.max_staleness={sc.max_staleness} is below the staleness this schedule "
            f"produces: sync_offset ({sc.sync_offset}) + sync_interval ({sc.sync_interval}) - 1 = "
            f"{worst}, so experiences would be dropped every step. Raise max_staleness to {worst} "
            f"or lower sync_offset / sync_interval."
        )
    rm = ex.rollout_model
    if rm.enable_sleep_mode and (sc.sync_offset > 0 or not C.colocated(cfg)):
        raise ConfigError(
            f"explorer.rollout_model.enable_sleep_mode=true frees the GPU for a trainer on the same "
            f"GPUs while it trains, so it needs cluster.colocate=true (or device_mapping lists that share "
            f"devices) and synchronizer.sync_offset=0 (here colocate={C.colocated(cfg)}, sync_offset={sc.sync_offset})."
        )
    engine = ENGINES.info(rm.engine_type)
    if not engine.collective_tensor_parallel and sc.sync_method == "collective" and rm.tensor_parallel_size > 1:
        raise ConfigError(
            f"synchronizer.sync_method=collective with explorer.rollout_model.engine_type={rm.engine_type} supports "
            f"tensor_parallel_size=1 for now (each tensor-parallel worker would need a rank of its own): use sync=checkpoint."
        )
    if rm.dtype is not None and rm.dtype not in C.DTYPES:
        raise ConfigError(f"explorer.rollout_model.dtype={rm.dtype!r} is not a dtype; choose one of {', '.join(C.DTYPES)} (or null: model.dtype).")
    check_placement(cfg)


def _check_dynamic(cfg, sc) -> bool:
    """synchronizer.sync_style, explorer.partial_rollout and synchronizer.fixed_interrupts go
    together as rft/runtime/dynamic.py needs them; whether the schedule is dynamic."""
    ex = cfg.explorer
    dynamic = sc.sync_style == "dynamic_by_explorer" and cfg.mode == "both"
    if dynamic and cfg.cluster.backend != "ray":
        raise ConfigError(
            f"synchronizer.sync_style=dynamic_by_explorer runs the explorers and the trainer side by side, "
            f"which needs them in processes of their own (cluster.backend=ray; here {cfg.cluster.backend}, "
            f"where each call waits for the one before). Use cluster=local, or sync_style=fixed.")
    if dynamic and sc.sync_offset < 1:
        raise ConfigError(
            f"synchronizer.sync_style=dynamic_by_explorer needs synchronizer.sync_offset >= 1 (explore steps "
            f"submitted ahead of the trainer; here {sc.sync_offset}): with 0 the explorers would wait for "
            f"every training step, as sync_style=fixed does. Leave sync_offset null (1) or raise it.")
    if ex.partial_rollout:
        if sc.sync_style != "dynamic_by_explorer":
            raise ConfigError(
                "explorer.partial_rollout=true lets new weights into an explore step between its generate "
                "chunks, and only synchronizer.sync_style=dynamic_by_explorer sends them while explorers "
                "generate: add synchronizer.sync_style=dynamic_by_explorer (or partial_rollout=false).")
        ts = cfg.buffer.explorer_input.taskset
        if ts.workflow != "single_turn":
            raise ConfigError(
                f"explorer.partial_rollout=true continues single-turn responses across explore steps; the "
                f"taskset's workflow is {ts.workflow!r}. Use partial_rollout=false for it.")
        if cfg.algorithm.dynamic_sampling_max_tries > 1 or ex.over_rollout.ratio > 0:
            raise ConfigError(
                f"explorer.partial_rollout=true ends each explore step with batch_size finished groups and "
                f"carries the rest over, which algorithm.dynamic_sampling_max_tries="
                f"{cfg.algorithm.dynamic_sampling_max_tries} and explorer.over_rollout.ratio="
                f"{ex.over_rollout.ratio} would do otherwise: set them to 1 and 0, or partial_rollout=false.")
    if sc.fixed_interrupts and not (ex.partial_rollout and sc.sync_offset == 1):
        raise ConfigError(
            f"synchronizer.fixed_interrupts=true (a test mode) makes explore step s wait for the weights of "
            f"training step s after its first chunk, which needs explorer.partial_rollout=true, "
            f"synchronizer.sync_style=dynamic_by_explorer and synchronizer.sync_offset=1 (here "
            f"partial_rollout={ex.partial_rollout}, sync_offset={sc.sync_offset}).")
    return dynamic


def _check_workflow(fn, name: str, key: str) -> None:
    """A workflow of a study's own takes what the explorer calls it with: a function of the wrong
    shape fails here, not in every task of the run."""
    import inspect

    try:
        inspect.signature(fn).bind("tasks", "engine", "ctx")
    except TypeError as e:
        raise ConfigError(
            f"{key}={name!r} cannot be called as fn(tasks, engine, ctx) ({e}); its signature is "
            f"{name}{inspect.signature(fn)}. A workflow takes the step's tasks, the engine and the context "
            f"(ctx.args holds workflow_args) and returns one list of Experience (or None) per task."
        ) from None


def _check_names(cfg) -> None:
    """Every registry name in the config exists (a typo fails here, not mid-run). Only a dotted
    path (a study's own function) is imported."""
    from rft.data.experience import check_priority_fn
    from rft.registry import resolve
    from rft.reporting.monitor import MONITORS
    from rft.rewards.scoring import check as check_reward
    from rft.rewards.scoring import spec_of
    from rft.rollout.workflows.single_turn import WORKFLOWS

    algo, inp = cfg.algorithm, cfg.buffer.explorer_input
    check_args(ADVANTAGE_FNS, algo.advantage_fn, algo.advantage_args, "algorithm.advantage_args")
    check_args(POLICY_LOSS_FNS, algo.policy_loss_fn, algo.args, "algorithm.args")
    TRAINER_BACKENDS.check(cfg.trainer.trainer_strategy)
    for name in cfg.monitor.monitor_type:
        MONITORS.check(name)
    ENGINES.check(cfg.explorer.rollout_model.engine_type)
    for i, aux in enumerate(cfg.explorer.auxiliary_models):
        resolve(ENGINES, aux.rollout_model.engine_type, f"explorer.auxiliary_models[{i}].rollout_model.engine_type")
    kl = ("none", *KL_FNS)
    # the other closed sets are Enum fields, checked when the config was composed; these names have
    # hyphens (agg modes) or include "none" next to registry names (KL)
    checks = [
        ("algorithm.kl_loss_fn", algo.kl_loss_fn, kl),
        ("algorithm.kl_penalty_fn", algo.kl_penalty_fn, kl),
        ("algorithm.loss_agg_mode", algo.loss_agg_mode, C.AGG_MODES),
    ]
    # reward functions and workflows may also be dotted paths to the user's own
    check_reward(spec_of(inp.default_reward_fn_type), "buffer.explorer_input.default_reward_fn_type")
    for i, ts in enumerate([inp.taskset, *inp.eval_tasksets]):
        where = "buffer.explorer_input." + ("taskset" if i == 0 else f"eval_tasksets[{i - 1}]")
        _check_workflow(resolve(WORKFLOWS, ts.workflow, f"{where}.workflow"), ts.workflow, f"{where}.workflow")
        flow = WORKFLOWS.info(ts.workflow)
        _check_taskset_reward(ts, inp, where, flow)
        if flow.check_args:
            resolve({}, flow.check_args, f"{where}.workflow")(dict(ts.workflow_args), f"{where}.workflow_args")
        if flow.endpoint and not cfg.explorer.rollout_model.enable_openai_api:
            raise ConfigError(f"{where}.workflow={ts.workflow} needs the explorer's OpenAI-compatible endpoint: set "
                              f"explorer.rollout_model.enable_openai_api=true.")
        if flow.environment:
            if ts.reward_fn is not None:
                raise ConfigError(
                    f"{where}.reward_fn={spec_of(ts.reward_fn)!r} would never be called: with workflow {ts.workflow} "
                    f"the reward is the parts the environment's step returns ({ts.workflow_args.get('env')}). "
                    f"Score in the environment's step (rft/rollout/environments/tools.py: ToolEnv scores its answer by exact "
                    f"match), or set {where}.reward_fn=null.")
    # dict-typed keys hold typed values too: a typo fails here, not inside an actor
    for name, value in cfg.buffer.trainer_input.auxiliary_buffers.items():
        _typed_buffer(value, f"buffer.trainer_input.auxiliary_buffers.{name}")
    if algo.sft_loss_weight > 0:
        sft_buffer_config(cfg)
    rb = cfg.buffer.trainer_input.experience_buffer.replay_buffer
    check_priority_fn(rb.priority_fn, rb.priority_fn_args, "buffer.trainer_input.experience_buffer.replay_buffer")
    if rb.enable:
        _check_priority_args(rb, "buffer.trainer_input.experience_buffer.replay_buffer")
    for key, value, known in checks:
        if value not in known:
            raise ConfigError(f"{key}={value!r} is not one of {sorted(known)}.")


def _check_taskset_reward(ts, inp, where: str, flow) -> None:
    """A taskset's own reward names functions that exist, and a reward that compares the response
    with the reference answer has one: with format.response_key null every task's answer is None,
    every reward 0, and the run learned nothing (warned of only after 3 steps of zeros)."""
    from rft.rewards.scoring import check as check_reward
    from rft.rewards.scoring import spec_of
    from rft.rewards.verifiers import READS_ANSWER

    if ts.reward_fn is not None:
        check_reward(spec_of(ts.reward_fn), f"{where}.reward_fn")
    spec = spec_of(ts.reward_fn if ts.reward_fn is not None else inp.default_reward_fn_type)
    names = [spec] if isinstance(spec, str) else [p.get("fn") for p in spec if isinstance(p, dict)]
    reads = [n for n in names if n in READS_ANSWER]
    if reads and ts.format.response_key is None and not flow.environment:
        raise ConfigError(
            f"{where}.format.response_key is null, and its reward {reads[0]!r} compares each response with the "
            f"task's reference answer (task.answer): every answer would be None and every reward 0. Set "
            f"{where}.format.response_key to the column that holds the answer, or use a reward that needs none "
            f"({where}.reward_fn=<your module>.<function>).")


def _check_priority_args(rb, where: str) -> None:
    """A replay buffer's priority_fn_args that its function takes as numbers are numbers: 'zzzz' or null
    raised a TypeError in the trainer's first read of the buffer, mid-run."""
    import inspect

    from rft.data.experience import PRIORITY_FNS

    params = inspect.signature(PRIORITY_FNS[rb.priority_fn]).parameters
    for name, value in (rb.priority_fn_args or {}).items():
        kind = getattr(params.get(name), "annotation", None)
        if kind in ("float", "int", float, int) and (isinstance(value, bool) or not isinstance(value, int | float)):
            shown = "null" if value is None else repr(value)
            raise ConfigError(f"{where}.priority_fn_args.{name}={shown} must be a number: priority_fn="
                              f"{rb.priority_fn} takes {name} as {getattr(kind, '__name__', kind)} (its default is "
                              f"{params[name].default}).")


def _divisor_near(n: int, target: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - target), d))


def environment_scores(ts) -> bool:
    """Whether taskset `ts`'s workflow scores through its environment's step (multi_turn: no reward
    function is called, and a failed task is the environment's): its WorkflowInfo."""
    from rft.rollout.workflows.single_turn import WORKFLOWS

    return WORKFLOWS.info(ts.workflow).environment


def agent_scores(ts):
    """The agent of taskset `ts` when an agent scores it (openai_agent: its return value is the
    reward, the reward function only where it returns None), else None."""
    from rft.rollout.workflows.single_turn import WORKFLOWS

    return (ts.workflow_args or {}).get("agent") if WORKFLOWS.info(ts.workflow).endpoint else None


def scored_by(ts, default_reward) -> str:
    """What scores taskset `ts`, for the dry run and messages: its reward config, the environment's
    step (environment_scores), or its agent (agent_scores)."""
    from rft.rewards.scoring import describe as describe_reward
    from rft.rewards.scoring import spec_of

    if environment_scores(ts):
        return f"{ts.workflow_args.get('env')}.step(text)"
    if agent_scores(ts):
        return f"{agent_scores(ts)}(client, task, ...)"
    return describe_reward(spec_of(ts.reward_fn, default_reward))


def _reward_row(ts, default_reward) -> str:
    """dry_run's line on what scores the taskset's rollouts."""
    from rft.rewards.scoring import describe as describe_reward
    from rft.rewards.scoring import spec_of

    if environment_scores(ts):
        return (f"the parts {scored_by(ts, default_reward)} returns (workflow {ts.workflow}; the reward function is "
                f"not called)")
    reward = describe_reward(spec_of(ts.reward_fn, default_reward))
    call = f"{reward}(prompt, response, task)" if "*" not in reward else f"{reward}, each fn(prompt, response, task),"
    answer = f"task.answer = column {ts.format.response_key!r}"
    if agent_scores(ts):
        return (f"what the agent {agent_scores(ts)} returns (a float, or a dict of parts); where it returns None, "
                f"{call.rstrip(',')} on its last answer, with {answer}")
    return f"{call} with {answer}"


def _called(fn: str, args) -> str:
    """A function with its own settings (advantage_args, args), as the dry run shows it: the value a
    sweep or a stage's entry gives is seen to reach the function (the line named the function alone)."""
    return f"{fn}({', '.join(f'{k}={v}' for k, v in sorted((args or {}).items()))})" if args else fn


def describe(cfg, stage_dir, plan: BatchPlan | None = None, more_rows: list | tuple = ()) -> str:
    """What the dry run says besides the numbers: the functions, the data, the outputs; with the
    plan, the devices and the memory per role (rft/plan/memory.py)."""
    algo, inp = cfg.algorithm, cfg.buffer.explorer_input
    eb = cfg.buffer.trainer_input.experience_buffer
    opt = algo.optimizer
    extra = "".join(f", {k}={algo[k]}" for k in ("kl_loss_fn", "kl_penalty_fn") if algo[k] != "none")
    extra += f", entropy_coef={algo.entropy_coef}" if algo.entropy_coef else ""
    extra += f", sft_loss_weight={algo.sft_loss_weight}" if algo.sft_loss_weight else ""
    signal = ("(log p_teacher - log p_student) per token" if algo.distill_divergence == "reverse_kl" else
              f"JSD_{algo.distill_jsd_beta:g}(teacher, student) on the teacher's top {algo.distill_top_k} tokens")
    extra += f", + {algo.distill_coef:g} x {signal} from the teacher {algo.teacher_model_path}" if algo.distill_coef else ""
    rows = [("algorithm", f"{algo.algorithm_type}: advantage_fn={_called(algo.advantage_fn, algo.advantage_args)}, "
                          f"policy_loss_fn={_called(algo.policy_loss_fn, algo.args)}, loss_agg_mode={algo.loss_agg_mode}{extra}"),
            ("learning rate", f"{opt.lr:g} (algorithm.optimizer.lr), {opt.warmup_steps} warm-up optimizer "
                              f"steps, then {opt.warmup_style}")]

    def data(ds) -> str:
        return f"{ds.name} ({ds.path}, split {ds.split})"

    if cfg.mode in ("both", "explore"):
        args = inp.taskset.rollout_args
        rows.append(("rollouts", f"{data(inp.taskset)}: prompt_key={inp.taskset.format.prompt_key}, "
                                 f"temperature {args.temperature:g}, top_p {args.top_p:g}, top_k {args.top_k}"))
        rows.append(("workflow", _workflow_row(inp.taskset)))
        rows.append(("reward", _reward_row(inp.taskset, inp.default_reward_fn_type)))
        if cfg.mode == "both":
            rows += _sync_rows(cfg)
    else:
        fmt = eb.format
        what = (f"pairs of {fmt.chosen_key!r} over {fmt.rejected_key!r}" if fmt.chosen_key and fmt.rejected_key
                else f"responses in {fmt.response_key!r}")
        if fmt.enable_concatenated_multi_turn:  # whole conversations: no prompt or response column is read
            what = f"conversations in {fmt.messages_key!r}, every assistant turn trained on"
        else:
            what += f", prompts in {fmt.prompt_key!r}"
        rows.append(("trains on", f"{eb.path} ({eb.storage_type}; {what})"))
    if algo.sft_loss_weight > 0:
        sft, where = sft_buffer_config(cfg)
        rows.append(("sft data", f"{sft.path} (column {sft.format.response_key!r}; {where})"))
    evals = [f"{data(ts)}: {scored_by(ts, inp.default_reward_fn_type)}" for ts in inp.eval_tasksets]
    if cfg.mode != "explore" and algorithm_needs(algo).reward_head:
        rows.append(("eval", f"eval/pair_accuracy on {eb.path} (split {eb.eval_split}), every "
                             f"{cfg.explorer.eval_interval} steps" if eb.eval_split else
                     "none (buffer.trainer_input.experience_buffer.eval_split names held-out pairs)"))
    elif cfg.mode != "explore":
        rows.append(("eval sets", "; ".join(evals) + f", every {cfg.explorer.eval_interval} steps" if evals else "none"))
        rows += [("eval sampling", _eval_sampling(inp.eval_tasksets))] if evals else []
    if plan is not None:
        from rft.plan.disk import describe_disk
        from rft.plan.memory import describe_devices, estimate

        rows += describe_devices(cfg, estimate(cfg, plan))
        disk, warning = describe_disk(cfg, plan, stage_dir)
        rows += [("checkpoints", disk)] + ([("warning", warning)] if warning else [])
    rows += [*more_rows, ("outputs", str(stage_dir))]  # more_rows: the runtime's (the data pipelines)
    w = max(len(r[0]) for r in rows)
    return "\n".join(f"{a:<{w}}  {b}" for a, b in rows)


def _eval_sampling(eval_tasksets) -> str:
    """dry_run's line on how each eval set samples (the rollouts line shows the taskset's; an eval set's
    temperature and samples a task were nowhere, so a translated eval temperature could not be checked)."""
    def one(ts) -> str:
        n = ts.repeat_times or 1
        return (f"{ts.name}: temperature {ts.rollout_args.temperature:g}, top_p {ts.rollout_args.top_p:g}, "
                f"{n} sample{'s' * (n != 1)} a task")
    return "; ".join(one(ts) for ts in eval_tasksets)


def _sync_rows(cfg) -> list[tuple[str, str]]:
    """dry_run's lines on how far the explorers run ahead and how they get the trainer's weights (mode=both)."""
    if C.fixed_policy(cfg):
        return [("explorer", "serves the stage's starting policy throughout, never synced: the trainer's model is the "
                             "reward model (algorithm.rm_pairs=groups); each group whose rewards differ gives it one "
                             "pair, its best response over its worst (best_worst_pairs)")]
    rows = [("sync style", _dynamic_row(cfg))] if cfg.synchronizer.sync_style == "dynamic_by_explorer" else []
    o, algo, k = cfg.synchronizer.sync_offset, cfg.algorithm, cfg.synchronizer.sync_interval
    # sync_offset=0 with sync_interval > 1 (Trinity-RFT's guide: 0 and 10) is not on-policy: the
    # weights arrive every k steps, so a step between syncs samples from weights up to k - 1 steps old
    waits = ("on-policy: generates, then waits while the trainer learns (synchronizer.sync_offset=0)" if k == 1 else
             f"generates, then waits while the trainer learns (synchronizer.sync_offset=0); the weights come every "
             f"{k} steps (synchronizer.sync_interval), so experiences are up to {k - 1} step{'s' * (k != 2)} stale "
             f"(off_policy_correction={algo.off_policy_correction})")
    rows.append(("explorer", f"{o} step{'s' * (o != 1)} ahead of the trainer (synchronizer.sync_offset; stale "
                             f"experiences: off_policy_correction={algo.off_policy_correction})" if o else waits))
    from rft.plan.sync import route

    way, warning = route(cfg)
    rows.append(("weight sync", way))
    if warning:
        rows.append(("warning", warning))
    return rows


def _workflow_row(ts) -> str:
    """dry_run's line on how a task becomes experiences: the workflow, and its environment or agent."""
    wa = ts.workflow_args or {}
    what = {"env": "environment", "agent": "agent"}
    named = ", ".join(f"{what[k]} {wa[k]}" for k in ("env", "agent") if wa.get(k))
    rest = sorted(k for k in wa if k not in what)
    extra = f"; workflow_args {', '.join(f'{k}={wa[k]}' for k in rest)}" if rest else ""
    return f"{ts.workflow}" + (f" ({named})" if named else "") + extra


def _dynamic_row(cfg) -> str:
    """dry_run's line on synchronizer.sync_style=dynamic_by_explorer."""
    sc, ex = cfg.synchronizer, cfg.explorer
    where = (f"between generate chunks of {ex.partial_chunk_tokens} tokens (partial rollouts: a sequence in "
             f"flight keeps its tokens and goes on under the new weights; {ex.partial_in_flight:g} steps' worth of groups "
             f"in flight, an explore step ends with the batch_size that finish first, the others go on in the "
             f"next)" if ex.partial_rollout
             else "between explore steps (explorer.partial_rollout=false)")
    bound = f"tokens older than {sc.max_staleness} versions drop their experience" if sc.max_staleness is not None \
        else "no staleness bound (synchronizer.max_staleness=null)"
    test = "; test mode fixed_interrupts: step s takes version s after its first chunk" if sc.fixed_interrupts else ""
    return f"sync_style=dynamic_by_explorer: new weights after every training step, taken {where}; {bound}{test}"


def format_plan(plan: BatchPlan, title: str = "batch plan") -> str:
    # a stage that generates nothing (mode=train) has no tasks or rollouts per step: no rows of 0
    explores = [("tasks per step", plan.tasks_per_step, "buffer.batch_size"),
                ("rollouts per task", plan.rollouts_per_task, "algorithm.repeat_times")] if plan.mode != "train" else []
    rows = [
        ("mode", plan.mode, "mode"),
        ("dataset rows", plan.dataset_size, "taskset / experience_buffer"),
        *explores,
        ("experiences per step", plan.experiences_per_step, "buffer.train_batch_size"),
        ("experiences per optimizer step", plan.mini_batch_size, "trainer.mini_batch_size"),
        ("passes per step", plan.ppo_epochs, "trainer.ppo_epochs"),
        ("optimizer steps per step", plan.optimizer_steps_per_step, "derived"),
        ("experiences per micro-batch", plan.micro_batch_size, "trainer.micro_batch_size_per_gpu")
        if plan.max_token_len_per_gpu is None else
        ("tokens per micro-batch", plan.max_token_len_per_gpu, "trainer.max_token_len_per_gpu"),
        ("micro-batches per optimizer step", plan.micro_batches_per_update, "derived"),
        ("data-parallel size", plan.dp_size, "trainer.trainer_strategy"),
        ("steps per epoch", plan.steps_per_epoch, "derived"),
        ("total steps", plan.total_steps, "buffer.total_steps / total_epochs"),
        ("total optimizer steps", plan.total_optimizer_steps, "derived"),
        ("warm-up optimizer steps", plan.warmup_steps, "algorithm.optimizer.warmup_steps"),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(str(r[1])) for r in rows)
    lines = [title, "-" * (w0 + w1 + 30)]
    lines += [f"{a:<{w0}}  {str(b):>{w1}}  {c}" for a, b, c in rows]
    return "\n".join(lines)
