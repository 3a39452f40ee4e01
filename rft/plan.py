"""The batch plan: every batch number derived and checked in one place, before anything starts.

    tasks per step           = buffer.batch_size
    rollouts per task        = algorithm.repeat_times
    experiences per step     = buffer.train_batch_size (default batch_size * repeat_times)
    optimizer steps per step = train_batch_size / mini_batch_size * ppo_epochs
    micro-batches per update = mini_batch_size / (micro_batch_size_per_gpu * data-parallel size)

Each violated constraint is a ConfigError that names the keys, their values and the fix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from rft.errors import ConfigError


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
    dp_size: int
    steps_per_epoch: int
    total_steps: int
    total_optimizer_steps: int
    warmup_steps: int


def make_plan(cfg, dataset_size: int) -> BatchPlan:
    buf, algo, tr = cfg.buffer, cfg.algorithm, cfg.trainer
    _check_names(cfg)
    from rft.algorithms.advantages import NEEDS_CRITIC
    from rft.fsdp import trainer_ranks

    dp = trainer_ranks(cfg)  # trainer_strategy=torch is one process
    if tr.trainer_strategy == "fsdp2" and algo.advantage_fn in NEEDS_CRITIC:
        raise ConfigError(
            f"algorithm.advantage_fn={algo.advantage_fn} trains a critic, which trainer=fsdp2 does "
            f"not shard yet. Use trainer=torch for it."
        )
    if cfg.mode not in ("both", "explore", "train"):
        raise ConfigError(f"mode={cfg.mode!r} is not supported; choose both, explore, train or bench.")
    _check_runtime(cfg)
    if buf.batch_size < 1:
        raise ConfigError(f"buffer.batch_size={buf.batch_size} must be >= 1 (tasks per step).")
    if algo.repeat_times < 1:
        raise ConfigError(f"algorithm.repeat_times={algo.repeat_times} must be >= 1 (rollouts per task).")
    if cfg.mode in ("both", "explore") and algo.advantage_fn in ("grpo", "rloo", "dr_grpo") and algo.repeat_times < 2:
        raise ConfigError(
            f"algorithm.advantage_fn={algo.advantage_fn} compares rollouts within a group, but "
            f"algorithm.repeat_times={algo.repeat_times} gives groups of one (every advantage 0). "
            f"Set algorithm.repeat_times to 2 or more (8 is common)."
        )

    explores = cfg.mode in ("both", "explore")
    stored = cfg.mode == "train" and stored_experiences(buf.trainer_input.experience_buffer)
    if stored:
        # RL from experiences an explorer stored: whole groups per step, as in mode=both
        produced = buf.batch_size * algo.repeat_times
        train_bs = buf.train_batch_size or produced
        if algo.advantage_fn in ("grpo", "rloo", "dr_grpo", "opmd") and train_bs % algo.repeat_times:
            raise ConfigError(
                f"buffer.train_batch_size={train_bs} must be a multiple of algorithm.repeat_times "
                f"({algo.repeat_times}) so that each step reads whole groups of rollouts."
            )
        # with total_steps set the trainer may read experiences still being written
        per_epoch = dataset_size // train_bs or (1 if buf.total_steps else 0)
        unit, unit_key = train_bs, "buffer.train_batch_size"
    elif explores:
        produced = buf.batch_size * algo.repeat_times
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

    mini = tr.mini_batch_size or train_bs
    if mini < 1 or train_bs % mini:
        raise ConfigError(
            f"trainer.mini_batch_size={mini} must divide buffer.train_batch_size={train_bs} "
            f"(experiences per step) into whole optimizer steps. Choose a divisor of {train_bs}, "
            f"e.g. {_divisor_near(train_bs, mini)}."
        )
    # a micro-batch larger than the mini-batch means "the whole mini-batch at once"
    micro = min(tr.micro_batch_size_per_gpu, mini // dp)
    if micro < 1 or mini % (micro * dp):
        raise ConfigError(
            f"trainer.micro_batch_size_per_gpu={micro} x data-parallel size {dp} must divide "
            f"trainer.mini_batch_size={mini}. Choose a divisor of {mini // dp}, "
            f"e.g. {_divisor_near(mini // dp, micro)}."
        )
    fmt = buf.trainer_input.experience_buffer.format
    from rft.algorithms.losses import NEEDS_PAIRS

    if algo.policy_loss_fn in NEEDS_PAIRS and (cfg.mode != "train" or stored or not (fmt.chosen_key and fmt.rejected_key)):
        raise ConfigError(
            f"algorithm.policy_loss_fn={algo.policy_loss_fn} learns from preference pairs in a dataset "
            f"(mode=train, buffer.trainer_input.experience_buffer.storage_type=file with format.chosen_key "
            f"and format.rejected_key set), but this stage has mode={cfg.mode}, storage_type="
            f"{buf.trainer_input.experience_buffer.storage_type}, chosen_key={fmt.chosen_key}, "
            f"rejected_key={fmt.rejected_key}. Give it a dataset of pairs (a taskset whose format sets "
            f"chosen_key and rejected_key serves by default)."
        )
    if cfg.mode == "train" and fmt.chosen_key and fmt.rejected_key:
        # preference pairs (two rows each) must not be split across batches
        for key, value in [("buffer.train_batch_size", train_bs), ("trainer.mini_batch_size", mini),
                           ("trainer.micro_batch_size_per_gpu", micro)]:
            if value % 2:
                raise ConfigError(
                    f"{key}={value} must be even with preference pairs (format.chosen_key and "
                    f"rejected_key set): each pair is two experiences that stay together."
                )
    if tr.ppo_epochs < 1:
        raise ConfigError(f"trainer.ppo_epochs={tr.ppo_epochs} must be >= 1.")

    if buf.total_steps is not None:
        if buf.total_steps < 1:
            raise ConfigError(f"buffer.total_steps={buf.total_steps} must be >= 1 (or null to use total_epochs).")
        total = buf.total_steps
    else:
        if buf.total_epochs < 1:
            raise ConfigError(f"buffer.total_epochs={buf.total_epochs} must be >= 1.")
        total = buf.total_epochs * per_epoch
    opt_per_step = train_bs // mini * tr.ppo_epochs
    warmup = algo.optimizer.warmup_steps
    if not 0 <= warmup <= total * opt_per_step:
        raise ConfigError(
            f"algorithm.optimizer.warmup_steps={warmup} must be between 0 and the run's "
            f"{total * opt_per_step} optimizer steps ({total} steps x {opt_per_step} per step)."
        )
    for key, value in [
        ("trainer.save_interval", tr.save_interval),
        ("explorer.eval_interval", cfg.explorer.eval_interval),
        ("synchronizer.sync_interval", cfg.synchronizer.sync_interval),
    ]:
        if value < 1:
            raise ConfigError(f"{key}={value} must be >= 1 (in steps).")
    model = cfg.model
    _check_model(model)
    need = model.max_prompt_tokens + model.max_response_tokens
    if model.max_model_len is not None and model.max_model_len < need:
        raise ConfigError(
            f"model.max_model_len={model.max_model_len} is smaller than model.max_prompt_tokens "
            f"({model.max_prompt_tokens}) + model.max_response_tokens ({model.max_response_tokens}) "
            f"= {need}. Raise max_model_len or lower the token budgets."
        )
    return BatchPlan(
        mode=cfg.mode,
        dataset_size=dataset_size,
        tasks_per_step=buf.batch_size if explores else 0,
        rollouts_per_task=algo.repeat_times if explores else 0,
        experiences_per_step=train_bs,
        mini_batch_size=mini,
        ppo_epochs=tr.ppo_epochs,
        optimizer_steps_per_step=opt_per_step,
        micro_batch_size=micro,
        micro_batches_per_update=mini // (micro * dp),
        dp_size=dp,
        steps_per_epoch=per_epoch,
        total_steps=total,
        total_optimizer_steps=total * opt_per_step,
        warmup_steps=warmup,
    )


def _check_model(model) -> None:
    from rft.models import DTYPES

    for key in ("max_prompt_tokens", "max_response_tokens"):
        if model[key] < 1:
            raise ConfigError(f"model.{key}={model[key]} must be >= 1 (tokens).")
    if model.dtype not in DTYPES:
        raise ConfigError(f"model.dtype={model.dtype!r} is not a dtype; choose one of {', '.join(DTYPES)}.")
    path = os.path.expanduser(model.model_path)
    # a hub id ("org/name") cannot be checked here (no hub may be reachable); a local path can
    looks_local = path.startswith(("/", ".")) or path.count("/") > 1
    if model.builder is None and looks_local and not os.path.isdir(path):
        raise ConfigError(
            f"model.model_path={model.model_path!r}: no such directory (relative paths are relative "
            f"to {os.getcwd()}). Give a local directory in Hugging Face format or a hub id "
            f"(e.g. Qwen/Qwen2.5-0.5B-Instruct)."
        )


def sft_buffer_config(cfg):
    """The expert data algorithm.sft_loss_weight > 0 (mix) learns from, as (ExperienceBufferConfig,
    the key to name in errors): buffer.trainer_input.auxiliary_buffers[algorithm.sft_buffer], or,
    when there is no such entry, the taskset's own prompts and reference answers."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from rft.config import ExperienceBufferConfig

    aux, name = cfg.buffer.trainer_input.auxiliary_buffers, cfg.algorithm.sft_buffer
    if name in aux:
        where = f"buffer.trainer_input.auxiliary_buffers.{name}"
        return _typed_buffer(aux[name], where), where
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
        merged = OmegaConf.merge(OmegaConf.structured(ExperienceBufferConfig),
                                 {"name": name, "storage_type": "file", "path": ts.path, "split": ts.split,
                                  "format": ts.format})
    except OmegaConfBaseException as e:  # pragma: no cover - the taskset's format is typed already
        raise ConfigError(f"{where}: {str(e).splitlines()[0]}") from e
    return merged, where


def _typed_buffer(value, where: str):
    """An auxiliary buffer's dict as an ExperienceBufferConfig: a misspelt key fails here, naming it."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from rft.config import ExperienceBufferConfig

    try:
        merged = OmegaConf.merge(OmegaConf.structured(ExperienceBufferConfig), value)
    except OmegaConfBaseException as e:
        keys = sorted(OmegaConf.structured(ExperienceBufferConfig).keys())
        raise ConfigError(
            f"{where}: {str(e).splitlines()[0]}. Its keys are those of "
            f"buffer.trainer_input.experience_buffer: {keys}."
        ) from e
    if not merged.path:
        raise ConfigError(f"{where}.path is not set: give the dataset of prompt/response rows it reads.")
    return merged


def stored_experiences(buf_cfg) -> bool:
    """The trainer's input is experiences an explorer stored (not a dataset of prompt/response rows)."""
    from rft.buffer import is_experience_file

    return buf_cfg.storage_type == "sql" or (
        buf_cfg.storage_type == "file" and bool(buf_cfg.path) and is_experience_file(buf_cfg.path)
    )


def _check_runtime(cfg) -> None:
    """Modes, buffers, the synchronizer's schedule and staleness bound, runners, placement."""
    from rft.placement import check_placement

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
    if sc.sync_offset < 0:
        raise ConfigError(f"synchronizer.sync_offset={sc.sync_offset} must be >= 0 (steps the explorer runs ahead).")
    if sc.sync_style != "fixed":
        raise ConfigError(
            f"synchronizer.sync_style={sc.sync_style!r} is not implemented yet; use fixed (with "
            f"sync_offset for an explorer that runs ahead of the trainer)."
        )
    # mode=explore never syncs from a trainer (it reads checkpoints), so any method is fine there
    if sc.sync_method == "collective" and cfg.cluster.backend != "ray" and cfg.mode != "explore":
        raise ConfigError(
            f"synchronizer.sync_method=collective broadcasts between the trainer's and the explorers' "
            f"processes, so it needs cluster.backend=ray (here {cfg.cluster.backend}). Use cluster=local, "
            f"or sync=memory or sync=checkpoint."
        )
    # with a fixed schedule the staleness of every experience is known: offset + interval - 1 at
    # most. A bound below that would drop experiences every step, so it is an error here.
    worst = sc.sync_offset + sc.sync_interval - 1
    if cfg.mode == "both" and sc.max_staleness is not None and worst > sc.max_staleness:
        raise ConfigError(
            f"synchronizer.max_staleness={sc.max_staleness} is below the staleness this schedule "
            f"produces: sync_offset ({sc.sync_offset}) + sync_interval ({sc.sync_interval}) - 1 = "
            f"{worst}, so experiences would be dropped every step. Raise max_staleness to {worst} "
            f"or lower sync_offset / sync_interval."
        )
    for k, v, lo in [("explorer.runner_per_model", ex.runner_per_model, 1),
                     ("explorer.max_retry_times", ex.max_retry_times, 0)]:
        if v < lo:
            raise ConfigError(f"{k}={v} must be >= {lo}.")
    if ex.max_timeout <= 0:
        raise ConfigError(f"explorer.max_timeout={ex.max_timeout} must be > 0 (seconds).")
    rm = ex.rollout_model
    if rm.enable_sleep_mode and (sc.sync_offset > 0 or not cfg.cluster.colocate):
        raise ConfigError(
            f"explorer.rollout_model.enable_sleep_mode=true frees the GPU for a trainer on the same "
            f"GPUs while it trains, so it needs cluster.colocate=true and synchronizer.sync_offset=0 "
            f"(here colocate={cfg.cluster.colocate}, sync_offset={sc.sync_offset})."
        )
    if rm.engine_type == "vllm" and sc.sync_method == "collective" and rm.tensor_parallel_size > 1:
        raise ConfigError(
            "synchronizer.sync_method=collective with explorer=vllm supports tensor_parallel_size=1 "
            "for now (each tensor-parallel worker would need a rank of its own): use sync=checkpoint."
        )
    from rft.models import DTYPES

    if rm.dtype is not None and rm.dtype not in DTYPES:
        raise ConfigError(f"explorer.rollout_model.dtype={rm.dtype!r} is not a dtype; choose one of {', '.join(DTYPES)} (or null: model.dtype).")
    if not 0 <= ex.over_rollout.ratio < 1:
        raise ConfigError(f"explorer.over_rollout.ratio={ex.over_rollout.ratio} must be in [0, 1).")
    check_placement(cfg)


def _check_names(cfg) -> None:
    """Every registry name in the config exists (a typo fails here, not mid-run)."""
    from rft.actors import ACTOR_BACKENDS
    from rft.algorithms import ADVANTAGE_FNS, AGG_MODES, KL_FNS, POLICY_LOSS_FNS, resolve
    from rft.engine import ENGINES
    from rft.rewards import REWARD_FNS
    from rft.sync import SYNC_METHODS

    inp = cfg.buffer.explorer_input
    # advantage and policy-loss functions may also be dotted paths to the user's own
    resolve(ADVANTAGE_FNS, cfg.algorithm.advantage_fn, "algorithm.advantage_fn")
    resolve(POLICY_LOSS_FNS, cfg.algorithm.policy_loss_fn, "algorithm.policy_loss_fn")
    checks = [
        ("algorithm.kl_loss_fn", cfg.algorithm.kl_loss_fn, {"none": None, **KL_FNS}),
        ("algorithm.kl_penalty_fn", cfg.algorithm.kl_penalty_fn, {"none": None, **KL_FNS}),
        ("algorithm.off_policy_correction", cfg.algorithm.off_policy_correction, ("decoupled", "behavior", "none")),
        ("algorithm.loss_agg_mode", cfg.algorithm.loss_agg_mode, AGG_MODES),
        ("algorithm.optimizer.warmup_style", cfg.algorithm.optimizer.warmup_style, ("constant", "cosine")),
        ("explorer.rollout_model.engine_type", cfg.explorer.rollout_model.engine_type, ENGINES),
        ("synchronizer.sync_method", cfg.synchronizer.sync_method, SYNC_METHODS),
        ("cluster.backend", cfg.cluster.backend, ACTOR_BACKENDS),
        ("trainer.trainer_strategy", cfg.trainer.trainer_strategy, ("torch", "fsdp2")),
        ("buffer.trainer_input.experience_buffer.storage_type",
         cfg.buffer.trainer_input.experience_buffer.storage_type, ("queue", "sql", "file")),
        ("synchronizer.sync_style", cfg.synchronizer.sync_style, ("fixed", "dynamic_by_explorer")),
    ]
    # reward functions may also be dotted paths to the user's own
    resolve(REWARD_FNS, inp.default_reward_fn_type, "buffer.explorer_input.default_reward_fn_type")
    for i, ts in enumerate([inp.taskset, *inp.eval_tasksets]):
        if ts.reward_fn is not None:
            where = "taskset" if i == 0 else f"eval_tasksets[{i - 1}]"
            resolve(REWARD_FNS, ts.reward_fn, f"buffer.explorer_input.{where}.reward_fn")
    # dict-typed keys hold typed values too: a typo fails here, not inside an actor
    for name, value in cfg.buffer.trainer_input.auxiliary_buffers.items():
        _typed_buffer(value, f"buffer.trainer_input.auxiliary_buffers.{name}")
    if cfg.algorithm.sft_loss_weight > 0:
        sft_buffer_config(cfg)
    rb = cfg.buffer.trainer_input.experience_buffer.replay_buffer
    from rft.buffer import check_priority_fn

    check_priority_fn(rb.priority_fn, rb.priority_fn_args, "buffer.trainer_input.experience_buffer.replay_buffer")
    for key, value, known in checks:
        if value not in known:
            raise ConfigError(f"{key}={value!r} is not one of {sorted(known)}.")


def _divisor_near(n: int, target: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - target), d))


def describe(cfg, stage_dir) -> str:
    """What the dry run says besides the numbers: the functions, the data, the outputs."""
    algo, inp = cfg.algorithm, cfg.buffer.explorer_input
    eb = cfg.buffer.trainer_input.experience_buffer
    opt = algo.optimizer
    extra = "".join(f", {k}={algo[k]}" for k in ("kl_loss_fn", "kl_penalty_fn") if algo[k] != "none")
    extra += f", entropy_coef={algo.entropy_coef}" if algo.entropy_coef else ""
    extra += f", sft_loss_weight={algo.sft_loss_weight}" if algo.sft_loss_weight else ""
    rows = [("algorithm", f"{algo.algorithm_type}: advantage_fn={algo.advantage_fn}, policy_loss_fn="
                          f"{algo.policy_loss_fn}, loss_agg_mode={algo.loss_agg_mode}{extra}"),
            ("learning rate", f"{opt.lr:g} (algorithm.optimizer.lr), {opt.warmup_steps} warm-up optimizer "
                              f"steps, then {opt.warmup_style}")]

    def data(ds) -> str:
        return f"{ds.name} ({ds.path}, split {ds.split})"

    if cfg.mode in ("both", "explore"):
        reward = inp.taskset.reward_fn or inp.default_reward_fn_type
        args = inp.taskset.rollout_args
        rows.append(("rollouts", f"{data(inp.taskset)}: prompt_key={inp.taskset.format.prompt_key}, "
                                 f"temperature {args.temperature:g}, top_p {args.top_p:g}, top_k {args.top_k}"))
        rows.append(("reward", f"{reward}(prompt, response, task) with task.answer = column "
                               f"{inp.taskset.format.response_key!r}"))
    else:
        fmt = eb.format
        what = (f"pairs of {fmt.chosen_key!r} over {fmt.rejected_key!r}" if fmt.chosen_key and fmt.rejected_key
                else f"responses in {fmt.response_key!r}")
        rows.append(("trains on", f"{eb.path} ({eb.storage_type}; {what}, prompts in {fmt.prompt_key!r})"))
    if algo.sft_loss_weight > 0:
        sft, where = sft_buffer_config(cfg)
        rows.append(("sft data", f"{sft.path} (column {sft.format.response_key!r}; {where})"))
    evals = [f"{data(ts)}: {ts.reward_fn or inp.default_reward_fn_type}" for ts in inp.eval_tasksets]
    if cfg.mode != "explore":
        rows.append(("eval sets", "; ".join(evals) + f", every {cfg.explorer.eval_interval} steps" if evals else "none"))
    rows.append(("outputs", str(stage_dir)))
    w = max(len(r[0]) for r in rows)
    return "\n".join(f"{a:<{w}}  {b}" for a, b in rows)


def format_plan(plan: BatchPlan, title: str = "batch plan") -> str:
    rows = [
        ("mode", plan.mode, "mode"),
        ("dataset rows", plan.dataset_size, "taskset / experience_buffer"),
        ("tasks per step", plan.tasks_per_step, "buffer.batch_size"),
        ("rollouts per task", plan.rollouts_per_task, "algorithm.repeat_times"),
        ("experiences per step", plan.experiences_per_step, "buffer.train_batch_size"),
        ("experiences per optimizer step", plan.mini_batch_size, "trainer.mini_batch_size"),
        ("passes per step", plan.ppo_epochs, "trainer.ppo_epochs"),
        ("optimizer steps per step", plan.optimizer_steps_per_step, "derived"),
        ("experiences per micro-batch", plan.micro_batch_size, "trainer.micro_batch_size_per_gpu"),
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
