"""The data pipelines (data_processor in the config; the seeds' key names): operators in order
over the taskset's rows before a run, and over each explore step's experiences during it.

- task pipeline (data_processor.task_pipeline.operators): buffer.explorer_input.taskset's rows
  -> each operator -> the rows the explorers read. Its output is cached in
  <cache_dir>/task_pipeline/<fingerprint>/ (train.jsonl and report.json, sealed by a manifest),
  the fingerprint covering the input files' digests, the taskset's split and format, and the
  operators' names and args (and, for an operator that samples the model, the model's files and
  the rollout settings): a rerun reuses it, a changed arg makes a new one. The report (rows in
  and out of each operator) is printed, written to <stage>/task_pipeline.json, and shown by the
  dry run. rft/runtime/pipelines.py runs it (it holds the model an operator may sample).
- experience pipeline (data_processor.experience_pipeline.operators): where each explore step's
  experiences enter the buffer, in the driver (rft.runtime.schedule.Schedule._collect).

Operators are rft/data/operators.py's; a study adds its own as a dotted path (module.function)
or a registry line (TASK_OPERATORS["mine"] = "my_study.ops.fn").
"""

from __future__ import annotations

import difflib
import inspect
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from rft import manifest
from rft.errors import ConfigError
from rft.registry import Registry, resolve

TASK_KEY = "data_processor.task_pipeline.operators"
EXPERIENCE_KEY = "data_processor.experience_pipeline.operators"


@dataclass(frozen=True)
class OperatorInfo:
    # samples the run's model: the model and rollout settings are part of the cache's fingerprint
    model: bool = False
    # leaves the rows in an order of its own: the explorers read them in it, not shuffled
    orders: bool = False


TASK_OPERATORS = Registry(TASK_KEY, info="info", default=OperatorInfo(),
                          shape="a function fn(rows, ctx, **args) -> rows (module.function)", table={
    "text_length_filter": "rft.data.operators.text_length_filter",
    "document_deduplicator": "rft.data.operators.document_deduplicator",
    "document_minhash_deduplicator": "rft.data.operators.document_minhash_deduplicator",
    "llm_difficulty_score_filter": ("rft.data.operators.llm_difficulty_score_filter", OperatorInfo(model=True)),
    "difficulty_filter": "rft.data.operators.difficulty_filter",
    "curriculum_order": ("rft.data.operators.curriculum_order", OperatorInfo(orders=True)),
})

EXPERIENCE_OPERATORS = Registry(EXPERIENCE_KEY, shape="a function fn(experiences, **args) -> experiences "
                                                      "(module.function)", table={
    "reward_shaping_mapper": "rft.data.operators.reward_shaping_mapper",
    "reward_filter": "rft.data.operators.reward_filter",
    "response_length_filter": "rft.data.operators.response_length_filter",
    "group_diversity_filter": "rft.data.operators.group_diversity_filter",
    "best_worst_pairs": "rft.data.operators.best_worst_pairs",
})


def operators(ops_cfg) -> list[tuple[str, dict]]:
    """(name, args) of each configured operator, as plain values."""
    from omegaconf import DictConfig, OmegaConf

    out = []
    for op in ops_cfg or []:
        args = op.get("args") or {}
        name = op.get("name")  # None when it was left out (a required key of OperatorConfig)
        out.append(("" if name is None else str(name),
                    OmegaConf.to_container(args, resolve=True) if isinstance(args, DictConfig) else dict(args)))
    return out


def experience_operators(cfg) -> list:
    """The experience pipeline's operators: data_processor.experience_pipeline.operators, then
    best_worst_pairs where a reward model learns from the explorers' groups (algorithm.rm_pairs=
    groups): a study's reward shaping or filters act on the rollouts, the pairs are made from what
    they leave."""
    from rft.config import fixed_policy

    dp = cfg.get("data_processor")
    ops = list(dp.experience_pipeline.operators) if dp is not None else []
    return ops + [{"name": "best_worst_pairs"}] if fixed_policy(cfg) else ops


def _function(registry: Registry, name: str, where: str):
    """The operator `name`, or a ConfigError naming the close matches."""
    if not name:
        raise ConfigError(f"{where} has no name: each operator is {{name: <operator>, args: {{...}}}}, the operators "
                          f"being {', '.join(registry)} (rft/data/operators.py) or the dotted path of your own.")
    if name not in registry and "." not in name:
        near = difflib.get_close_matches(name, list(registry), n=2, cutoff=0.5)
        hint = f"Did you mean {' or '.join(near)}? " if near else ""
        raise ConfigError(f"{where}.name={name!r} is not an operator. {hint}The operators are {', '.join(registry)} "
                          f"(rft/data/operators.py), or give the dotted path of your own ({registry.shape}).")
    return resolve(registry, name, f"{where}.name")


def _checked_call(fn, registry: Registry, name: str, where: str, /, *lead, **args):
    """fn(*lead, **args) with its signature checked first: `lead` (the rows and ctx, or the
    experiences) in its leading parameters, `args` in the rest; its ConfigError (a bad value) is
    prefixed with the operator's config key. A wrong signature was Python's TypeError ("takes 0
    positional arguments"), which read as a wrong type of an arg."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:  # a builtin without a signature Python can read
        raise ConfigError(f"{where}.name={name!r}: its signature cannot be read ({e}); an operator there is "
                          f"{registry.shape}: wrap it in one.") from None
    params = list(sig.parameters.values())[len(lead):]
    names = [p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params)
    unknown = [] if takes_any else sorted(set(args) - set(names))
    if unknown:
        near = {u: difflib.get_close_matches(u, names, n=1, cutoff=0.5) for u in unknown}
        hints = "; ".join(f"{u}: did you mean {n[0]}?" for u, n in near.items() if n)
        raise ConfigError(f"{where}.args has {unknown}, which {name} does not take{' (' + hints + ')' if hints else ''}; "
                          f"its arguments are {names}.")
    missing = [p.name for p in params if p.default is p.empty and p.name not in args
               and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    if missing:
        raise ConfigError(f"{where}.args lacks {missing}, which {name} needs; its arguments are {names} (an operator "
                          f"there is {registry.shape}).")
    try:
        sig.bind(*lead, **args)
    except TypeError as e:
        raise ConfigError(f"{where}.name={name!r} is {name}{sig}, which cannot be called as {registry.shape}, with "
                          f"args {args} ({e}). Give it that signature.") from None
    try:
        return fn(*lead, **args)
    except ConfigError as e:
        raise ConfigError(f"{where} ({name}): {e}") from None
    except TypeError as e:  # a value of the wrong type (a list where a number goes), or the operator's own slip
        from rft.registry import study_frame

        frame = study_frame(e)
        at = f" at {frame.filename}, line {frame.lineno}" if frame else ""
        raise ConfigError(f"{where} ({name}): {e}{at}; check the types of its args ({args}).") from None


def check_operators(cfg) -> None:
    """Every operator of both pipelines is known and takes its args with good values (each is
    called on no rows); the online curriculum's settings. Planning's check: imports no torch."""
    dp = cfg.get("data_processor")
    if dp is None:
        return
    from rft.data.operators import TaskContext

    ctx = TaskContext(text=lambda row: "")
    for i, (name, args) in enumerate(operators(dp.task_pipeline.operators)):
        where = f"{TASK_KEY}[{i}]"
        _checked_call(_function(TASK_OPERATORS, name, where), TASK_OPERATORS, name, where, [], ctx, **args)
    ExperiencePipeline(dp.experience_pipeline.operators)
    cur = dp.online_curriculum
    if cur.enable:
        if cur.window < 1 or not cur.eps > 0:
            raise ConfigError(f"data_processor.online_curriculum: window={cur.window} must be >= 1 and eps={cur.eps} "
                              f"> 0 (a task of weight 0 would never be drawn again).")
        if cfg.explorer.partial_rollout:
            raise ConfigError("data_processor.online_curriculum.enable=true draws each step's tasks when the step is "
                              "started, from the pass rates seen so far; explorer.partial_rollout takes later steps' "
                              "tasks ahead of that. Turn one of them off.")


# ---------------------------------------------------------------- the task pipeline


def _row_text(fmt):
    """A row's prompt as text, as the taskset's format reads it."""
    if fmt.prompt_type == "messages":
        return lambda row: "\n".join(str(m.get("content") or "") for m in row.get(fmt.messages_key) or [])
    return lambda row: str(row.get(fmt.prompt_key, ""))


def _info(name: str) -> OperatorInfo:
    """A task operator's OperatorInfo (a study's own: its attribute `info`); an unknown name's is
    the default, its error left to check_operators, which names the close matches."""
    return TASK_OPERATORS.info(name) if name in TASK_OPERATORS or "." in name else OperatorInfo()


def _input_identity(ts) -> list:
    """The taskset's input by its data files' digests (a hub id: by its name)."""
    import os

    from rft.data.tasks import _FILE_BUILDERS

    p = Path(os.path.expanduser(ts.path))
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.suffix in _FILE_BUILDERS) if p.is_dir() else []
    if not files:
        return [str(ts.path)]
    return [[str(f.relative_to(p)) if p.is_dir() else f.name, manifest.digest(f)] for f in files]


def _model_identity(cfg) -> dict:
    """What a model-sampling operator's scores depend on: the model's files (names, sizes, times)
    and how the run samples and scores it."""
    import os

    from omegaconf import OmegaConf

    inp, p = cfg.buffer.explorer_input, Path(os.path.expanduser(str(cfg.model.model_path)))
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else []
    ts = inp.taskset

    def plain(v):
        return OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v

    return {"model": [str(p)] + [[str(f.relative_to(p)), f.stat().st_size, f.stat().st_mtime_ns] for f in files],
            "max_tokens": [cfg.model.max_prompt_tokens, cfg.model.max_response_tokens],
            "rollout_args": plain(ts.rollout_args), "reward_fn": plain(ts.reward_fn),
            "default_reward_fn_type": plain(inp.default_reward_fn_type), "workflow": ts.workflow,
            "workflow_args": plain(ts.workflow_args), "pass_threshold": ts.pass_threshold, "seed": cfg.seed}


def fingerprint(cfg) -> str:
    """The task pipeline's cache key: its input (files' digests, split, subset, format) and its
    operators (names and args); with an operator that samples the model, what it samples."""
    import hashlib

    from omegaconf import OmegaConf

    ts, ops = cfg.buffer.explorer_input.taskset, operators(cfg.data_processor.task_pipeline.operators)
    key = {"version": 1, "input": _input_identity(ts), "split": ts.split, "subset": ts.subset_name,
           "format": OmegaConf.to_container(ts.format, resolve=True) if OmegaConf.is_config(ts.format) else dict(ts.format),
           "operators": ops}
    if any(_info(name).model for name, _ in ops):
        key["sampled"] = _model_identity(cfg)
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def output_dir(cfg) -> Path:
    import os

    return Path(os.path.expanduser(str(cfg.cache_dir))) / "task_pipeline" / fingerprint(cfg)


def has_task_pipeline(cfg) -> bool:
    dp = cfg.get("data_processor")
    return bool(dp is not None and dp.task_pipeline.operators) and cfg.mode in ("both", "explore")


def samples_model(cfg) -> bool:
    """Whether an operator of the task pipeline samples the run's model."""
    return has_task_pipeline(cfg) and any(_info(n).model for n, _ in operators(cfg.data_processor.task_pipeline.operators))


def keeps_order(cfg) -> bool:
    """Whether the task pipeline's output is in an order of its own (curriculum_order), which
    the explorers then read in, epoch after epoch."""
    if not has_task_pipeline(cfg):
        return False
    return any(_info(name).orders for name, _ in operators(cfg.data_processor.task_pipeline.operators))


def cached_report(cfg) -> dict | None:
    """The report of the cached output for this config (None: not run yet)."""
    d = output_dir(cfg)
    if not (d / "report.json").is_file() or manifest.verify(d) is not None:
        return None
    return _read_report(d)


def _read_report(d: Path) -> dict | None:
    """<d>/report.json, or None when it is not a report this module wrote. Its manifest matching
    is not enough: one sealed again by hand (or by an rft whose report differs) may hold anything,
    such as brackets nested ten thousand deep (json's RecursionError) or a list."""
    try:
        # bounded: a damaged or planted 10 GB report.json was read whole before it failed to parse
        r = json.loads(manifest.read_record(d / "report.json"))
    except (OSError, ValueError, RecursionError):  # OSError: moved aside by another run between the checks, too large
        return None
    steps = r.get("operators") if isinstance(r, dict) else None
    if not (isinstance(steps, list) and isinstance(r.get("rows"), int) and isinstance(r.get("input"), str)
            and all(isinstance(s, dict) and isinstance(s.get("name"), str) and isinstance(s.get("args"), dict)
                    and isinstance(s.get("rows_in"), int) and isinstance(s.get("rows_out"), int) for s in steps)):
        return None
    return r


def taskset_of(cfg, before_run: bool = False):
    """The taskset the explorers read: buffer.explorer_input.taskset, or with a task pipeline its
    cached output (its rows in order, format as the input's). `before_run` (a dry run): the input
    itself when the pipeline has not run yet."""
    from omegaconf import OmegaConf

    from rft.config import frozen

    ts = cfg.buffer.explorer_input.taskset
    if not has_task_pipeline(cfg):
        return ts
    d = output_dir(cfg)
    if cached_report(cfg) is None:
        if before_run:
            return ts
        raise ConfigError(f"data_processor.task_pipeline: its output for this config ({d}) is missing; it is made "
                          f"when a run starts (python run.py ...), before anything reads the taskset.")
    # a plain copy (the explorers get the config as a read-only rft.config.Frozen)
    out = OmegaConf.to_container(ts, resolve=True) if OmegaConf.is_config(ts) else json.loads(json.dumps(ts))
    out.update(path=str(d / "train.jsonl"), split="train", subset_name=None)
    return frozen(out)


def in_input(cfg, e: ConfigError) -> ConfigError:
    """A taskset error `e` about a row of the task pipeline's output, pointed at the input: an output
    edited by hand is made again from the input (its manifest no longer matches), row and all."""
    if not has_task_pipeline(cfg) or str(output_dir(cfg)) not in str(e):
        return e
    return ConfigError(f"{e} That file is data_processor.task_pipeline's output of "
                       f"'{cfg.buffer.explorer_input.taskset.path}' (made again from it whenever it changes): the row "
                       f"is one of the input's that the operators kept; fix it there, or add an operator that drops it.")


def run_task_pipeline(cfg, pass_rates=None, say=print) -> dict:
    """The task pipeline's output for `cfg` (made, or found in the cache); returns its report."""
    from rft.data.operators import TaskContext
    from rft.data.tasks import load_rows

    ts, d = cfg.buffer.explorer_input.taskset, output_dir(cfg)
    d.parent.mkdir(parents=True, exist_ok=True)
    with manifest.build_lock(d, "task pipeline output"):
        if manifest.whole(d, "task pipeline output") and (d / "report.json").is_file():
            report = _read_report(d)
            if report is not None:
                return {**report, "cached": True}
            aside = manifest.put_aside(d, "damaged")  # built again, as a damaged file the manifest catches
            say(f"warning: the task pipeline output in {d} is damaged (its report.json is not one rft writes); "
                f"moved it to {aside.name} and building it again")
        rows = [dict(r) for r in load_rows(ts.path, ts.split, ts.subset_name, key="buffer.explorer_input.taskset.path",
                                           fmt=ts.format)]
        ctx = TaskContext(text=_row_text(ts.format), pass_rates=pass_rates)
        report = {"input": str(ts.path), "split": ts.split, "rows": len(rows), "output": str(d / "train.jsonl"),
                  "fingerprint": d.name, "operators": []}
        for i, (name, args) in enumerate(operators(cfg.data_processor.task_pipeline.operators)):
            where, before, t0 = f"{TASK_KEY}[{i}]", len(rows), time.perf_counter()
            fn = _function(TASK_OPERATORS, name, where)
            rows = _checked_call(fn, TASK_OPERATORS, name, where, rows, ctx, **args)
            report["operators"].append({"name": name, "args": args, "rows_in": before, "rows_out": len(rows),
                                        "seconds": round(time.perf_counter() - t0, 3)})
            say(f"task pipeline: {describe_step(report['operators'][-1])}")
        if not rows:
            raise ConfigError(f"data_processor.task_pipeline left no rows of {ts.path} ({format_report(report)}). "
                              f"Loosen the operators' args.")
        tmp = d.with_name(d.name + ".tmp")
        manifest.clear(tmp)  # a killed run's leftovers (as rft.data.tasks._generate)
        tmp.mkdir()
        with open(tmp / "train.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(r, default=str) + "\n")
        (tmp / "report.json").write_text(json.dumps(report, indent=1, default=str))
        manifest.install(tmp, d, "task pipeline output")
    return {**report, "cached": False}


def write_report(cfg, stage_dir: Path) -> None:
    """<stage>/task_pipeline.json: the report of the task pipeline output the stage reads (none
    without a task pipeline)."""
    report = cached_report(cfg) if has_task_pipeline(cfg) else None
    if report is not None:
        # write_atomic: never through a link planted under that name in a run directory handed over
        manifest.write_atomic(stage_dir / "task_pipeline.json", json.dumps(report, indent=1, default=str))


def describe_step(step: dict) -> str:
    args = ", ".join(f"{k}={v}" for k, v in step["args"].items())
    return f"{step['name']}({args}): {step['rows_in']} -> {step['rows_out']} rows"


def format_report(report: dict) -> str:
    """One line: the input's rows, then each operator's rows out."""
    steps = " -> ".join(f"{s['name']} {s['rows_out']}" for s in report["operators"])
    return f"{report['rows']} rows of {report['input']} -> {steps}"


def describe_rows(cfg) -> list[tuple[str, str]]:
    """The dry run's rows on the pipelines and the curriculum (none when all are off)."""
    dp, rows = cfg.get("data_processor"), []
    if dp is None:
        return rows
    if has_task_pipeline(cfg):
        report = cached_report(cfg)
        names = " -> ".join(n + "(" + ", ".join(f"{k}={v}" for k, v in a.items()) + ")"
                            for n, a in operators(dp.task_pipeline.operators))
        rows.append(("task pipeline", f"{names}; cached in {output_dir(cfg)}: {format_report(report)}" if report else
                     f"{names}; not run yet: it runs when the run starts, into {output_dir(cfg)} (the plan above "
                     f"counts the input's rows)"))
    if experience_operators(cfg):
        names = " -> ".join(n for n, _ in operators(experience_operators(cfg)))
        rows.append(("experience pipeline", f"{names}, over each explore step's experiences as they enter the buffer"))
    cur = dp.online_curriculum
    if cur.enable and cfg.mode in ("both", "explore"):
        rows.append(("curriculum", f"online: each step's tasks drawn with weight p(1-p)+{cur.eps:g}, p the pass rate "
                                   f"of a task's last {cur.window} rollouts (not yet seen: p=0.5)"))
    elif keeps_order(cfg):
        rows.append(("curriculum", "the task pipeline's order (curriculum_order), epoch after epoch, not shuffled"))
    return rows


class ExperiencePipeline:
    """data_processor.experience_pipeline: its operators in order over a step's experiences; the
    metrics say how many each kept (experience_pipeline/<name>/out) and how many went on (.../kept)."""

    def __init__(self, ops_cfg):
        self.ops = []
        for i, (name, args) in enumerate(operators(ops_cfg)):
            where = f"{EXPERIENCE_KEY}[{i}]"
            fn = _function(EXPERIENCE_OPERATORS, name, where)
            _experiences_out(_operator_call(fn, name, where, [], args), name, where)  # its args checked on no experiences
            self.ops.append((name, args, fn, where))

    def __bool__(self) -> bool:
        return bool(self.ops)

    def __call__(self, exps: list) -> tuple[list, dict]:
        m = {"experience_pipeline/in": len(exps)}
        for name, args, fn, where in self.ops:
            exps = _experiences_out(_operator_call(fn, name, where, exps, args), name, where)
            m[f"experience_pipeline/{name}/out"] = len(exps)
        m["experience_pipeline/kept"] = len(exps)
        return exps, m


def _operator_call(fn, name: str, where: str, exps: list, args: dict):
    """An experience operator on a step's experiences; what its own code raises is a RunError
    naming it and its line (the traceback in the driver's log), not a raw traceback."""
    from rft.errors import RunError
    from rft.registry import study_frame

    try:
        return _checked_call(fn, EXPERIENCE_OPERATORS, name, where, exps, **args)
    except ConfigError:
        raise
    except Exception as e:
        frame = study_frame(e)
        at = f" ({frame.filename}, line {frame.lineno})" if frame else ""
        logging.getLogger(__name__).info("%s (%s) raised", where, name, exc_info=True)
        on = f"a step's {len(exps)} experiences" if exps else "an empty list (each is called on one to check its args)"
        raise RunError(f"{where} ({name}) raised {type(e).__name__}: {e}{at}, called on {on}; its traceback is in "
                       f"the run's log. Fix the operator, then run the same command again: it resumes from the newest "
                       f"checkpoint.") from None


def _experiences_out(out, name: str, where: str) -> list:
    """An experience operator's output, checked: a list of Experience (the ones it was given, or
    new ones), each reward a finite number. A wrong one reached the buffer and the trainer as an
    AttributeError far from the operator, and a NaN reward as NaN advantages (every update skipped)."""
    import math

    from rft.data.experience import Experience

    fix = f"{name} must return the experiences it keeps, a list of Experience (rft/data/experience.py)"
    if not isinstance(out, list):
        raise ConfigError(f"{where} ({name}) returned {type(out).__name__}, not a list: {fix}.")
    for i, e in enumerate(out):
        if not isinstance(e, Experience):
            raise ConfigError(f"{where} ({name}) returned a list whose entry {i} is a {type(e).__name__}: {fix}.")
        r = e.reward
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
            raise ConfigError(f"{where} ({name}) set experience {i}'s reward (task {e.task_id!r}) to {r!r}: a reward "
                              f"is a finite number (float), which the advantages are computed from.")
    return out
