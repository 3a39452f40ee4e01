"""A reward model trained by an earlier stage of the run, as a later stage's reward.

    stages:
      - {stage_name: rm, ...algorithm=rm's keys...}          # trains a reward model (Needs.reward_head)
      - stage_name: grpo
        buffer: {explorer_input: {taskset: {reward_fn: [{fn: reward_model, args: {model_path: "stage:rm"}}]}}}

`model_path: stage:<title>` in a reward_model part (a taskset's or an eval set's reward_fn, or
default_reward_fn_type) names the final model of the earlier reward-model stage <title>; the runner
puts that directory in its place when the stage starts (the stage's config on disk keeps the
reference, so a re-run compares like with like). A reward-model stage is not a policy: the stage
after it starts from the policy before it (rft/runtime/main.py).
"""

from __future__ import annotations

from omegaconf import DictConfig, ListConfig, OmegaConf

from rft.errors import ConfigError

PREFIX = "stage:"


def _parts(cfg: DictConfig):
    """(where, part) for every reward part of the stage's tasksets that is a mapping with args."""
    inp = cfg.buffer.explorer_input
    sources = [("buffer.explorer_input.default_reward_fn_type", inp.default_reward_fn_type),
               ("buffer.explorer_input.taskset.reward_fn", inp.taskset.reward_fn)]
    sources += [(f"buffer.explorer_input.eval_tasksets.{i}.reward_fn", ts.reward_fn)
                for i, ts in enumerate(inp.eval_tasksets)]
    for where, value in sources:
        items = value if isinstance(value, ListConfig) else [value]
        for j, part in enumerate(items):
            if isinstance(part, DictConfig) and isinstance(part.get("args"), DictConfig):
                yield (f"{where}.{j}" if isinstance(value, ListConfig) else where), part


def references(cfg: DictConfig) -> list[tuple[str, str]]:
    """(where, stage title) of each reward part whose model_path is stage:<title>."""
    return [(f"{where}.args.model_path", str(part.args.model_path)[len(PREFIX):])
            for where, part in _parts(cfg) if str(part.args.get("model_path")).startswith(PREFIX)]


def fixed_paths(cfg: DictConfig) -> list[str]:
    """model_path of each reward part that names a directory or hub id (not stage:<title>)."""
    return [str(part.args.model_path) for _, part in _parts(cfg)
            if part.args.get("model_path") is not None and not str(part.args.model_path).startswith(PREFIX)]


def check(stages: list, plans: list) -> None:
    """Each stage:<title> names a reward-model stage that runs before the stage reading it."""
    earlier: list[str] = []
    for s, plan in zip(stages, plans):
        title = s.stage_name or s.algorithm.algorithm_type
        for where, ref in references(s):
            if ref not in earlier:
                raise ConfigError(
                    f"stage {title}: {where}=stage:{ref} names no reward-model stage before it (earlier reward-model "
                    f"stages: {earlier or 'none'}). stage:<title> is the final model of an earlier stage that trains a "
                    f"reward model (algorithm=rm); put that stage first, or give a directory."
                )
        if plan.needs.reward_head:
            earlier.append(title)


def resolve(cfg: DictConfig, reward_models: dict[str, str]) -> DictConfig:
    """The stage's config with each stage:<title> replaced by that stage's final model."""
    if not references(cfg):
        return cfg
    out = cfg.copy()
    OmegaConf.set_readonly(out, False)
    for _, part in _parts(out):
        path = str(part.args.get("model_path"))
        if path.startswith(PREFIX):
            part.args.model_path = reward_models[path[len(PREFIX):]]
    return out
