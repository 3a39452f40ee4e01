"""mode=bench: evaluate a run's saved checkpoints on the eval tasksets and write a table.

    python run.py mode=bench name=<the run's name>      # same project / checkpoint_root_dir

Every complete checkpoint of every stage, oldest first, after the starting model
(explorer.bench_on_latest_checkpoint=true: only the newest one; explorer.bench_on_starting_model=true:
only the starting model, model.model_path, with no trained run: an eval-only run). The explorer runs in this process
with greedy settings as configured for the eval tasksets. Output: <run>/bench/results.md and
results.csv, one row per checkpoint, one column per eval taskset.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from rft import manifest
from rft.errors import ConfigError


def bench(cfg, run_dir: Path) -> float | None:
    from rft.data.tasks import ensure_task_data
    from rft.models import ensure_model
    from rft.plan.batch import stage_configs
    from rft.rollout.explorer import Explorer
    from rft.runtime.checkpoint import damage, list_checkpoints

    stages = stage_configs(cfg)
    first = stages[0]
    if not first.buffer.explorer_input.eval_tasksets:
        raise ConfigError("mode=bench evaluates on buffer.explorer_input.eval_tasksets, and there are none.")
    found = []  # (stage name, checkpoint)
    for s in stages:
        stage_dir = run_dir / s.stage_name if s.stage_name else run_dir
        found += [(s.stage_name or s.algorithm.algorithm_type, c) for c in list_checkpoints(stage_dir)
                  if c.problem is None]
    start_only = _start_only(cfg, first, run_dir, found)
    if not found and not start_only:
        raise ConfigError(
            f"mode=bench found no checkpoints under {run_dir}. Give the trained run's name "
            f"(name=...) and the same project and checkpoint_root_dir; or, to evaluate the starting model alone "
            f"(model.model_path={first.model.model_path}), add explorer.bench_on_starting_model=true."
        )
    for s in stages:  # every checkpoint is evaluated with the first stage's config (the Explorer below)
        for line in eval_differences(first, s.stage_name or s.algorithm.algorithm_type,
                                     run_dir / s.stage_name if s.stage_name else run_dir):
            print(line)
    latest_only = cfg.explorer.bench_on_latest_checkpoint
    if latest_only:
        found = found[-1:]
    if start_only:  # found is empty (_start_only)
        print(f"[bench] evaluating the starting model alone (explorer.bench_on_starting_model): {first.model.model_path}")
    ensure_model(first.model)
    ensure_task_data(first.buffer.explorer_input)
    explorer = Explorer(first)
    out = run_dir / "bench"
    # every sample of every eval, beside the table: bench/samples/<stage>/step_<k>/<eval set>.jsonl
    samples = lambda stage: str(out / "samples" / stage)  # noqa: E731
    rows = []
    if not latest_only:
        rows.append({"stage": "start", "step": 0, "checkpoint": first.model.model_path,
                     **explorer.evaluate(0, samples("start"))})
    for stage, ckpt in found:
        if not ckpt.hf_path.exists():
            continue  # an explore-mode stage saves no model
        why = damage(ckpt, skip=("trainer_state.pt",))  # its files against its manifest: only hf/ is read
        if why is not None:
            print(f"[bench] {stage} step {ckpt.step}: damaged ({why}); not evaluated")
            continue
        explorer.load_weights(str(ckpt.hf_path), ckpt.step, ckpt.state.get("fingerprint"))
        rows.append({"stage": stage, "step": ckpt.step, "checkpoint": str(ckpt.path),
                     **explorer.evaluate(ckpt.step, samples(stage))})
        print(f"[bench] {stage} step {ckpt.step}: eval accuracy {rows[-1].get('eval/accuracy', float('nan')):.3f}")

    _write(out, rows)
    return rows[-1].get("eval/accuracy")


def _start_only(cfg, first, run_dir: Path, found: list) -> bool:
    """explorer.bench_on_starting_model, checked: not with bench_on_latest_checkpoint (the opposite
    ask), and not over a trained run's outputs, whose bench table (bench/results.md, its start row
    the same starting model's) it would overwrite with one row."""
    if not cfg.explorer.bench_on_starting_model:
        return False
    if cfg.explorer.bench_on_latest_checkpoint:
        raise ConfigError("explorer.bench_on_starting_model=true evaluates the starting model alone, and "
                          "explorer.bench_on_latest_checkpoint=true the newest checkpoint alone: set one of them.")
    if found:
        raise ConfigError(
            f"explorer.bench_on_starting_model=true, but {run_dir} holds a trained run ({len(found)} checkpoints): its "
            f"bench table would be overwritten with the starting model's row alone. Its bench without the key "
            f"evaluates the starting model too (the table's start row); for the starting model alone give a name of "
            f"its own (name=...).")
    return True


# what an eval's score depends on besides the weights: the bench evaluates every checkpoint with this
# command's config, so a run's overrides left off (task=countdown, an eval set's temperature) changed the
# scores unsaid (a Trinity-RFT user's bench reads the run's own config file)
EVAL_KEYS = ("model.max_prompt_tokens", "model.max_response_tokens", "model.custom_chat_template",
             "buffer.explorer_input.default_reward_fn_type", "buffer.explorer_input.eval_tasksets")


def eval_differences(used, name: str, stage_dir: Path) -> list[str]:
    """A warning naming each EVAL_KEYS value (an eval set's key by key) that differs between the
    stage's saved config.yaml and `used`, the config the bench evaluates with; none for a stage
    without a readable record."""
    from rft.config import flat
    from rft.runtime.rundir import saved_config

    saved = saved_config(stage_dir)
    if saved is None:
        return []
    old, new = _eval_keys(flat(saved)), _eval_keys(flat(used))
    differ = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    if not differ:
        return []
    return [f"[bench] warning: stage {name} was evaluated in its run with other settings than this command's, which "
            f"the bench uses for its checkpoints: {'; '.join(differ)}. Give the run's overrides (its task=, "
            f"experiment=, eval set keys) to evaluate as it did."]


def _eval_keys(keys: dict) -> dict:
    """EVAL_KEYS of a flat config, the eval sets' list spread key by key (eval_tasksets.0.rollout_args.temperature)."""
    from rft.config import flat

    out = {k: keys.get(k) for k in EVAL_KEYS[:-1]}
    for i, ts in enumerate(keys.get(EVAL_KEYS[-1]) or []):
        # an eval set's repeat_times null is 1 sample (rft.config.TasksetConfig)
        out.update({f"{EVAL_KEYS[-1]}.{i}.{k}": 1 if k == "repeat_times" and v is None else v
                    for k, v in flat(dict(ts)).items()})
    return out


def _write(out: Path, rows: list[dict]) -> None:
    """results.csv and results.md (a row per checkpoint, a column per set and metric), results.png."""
    out.mkdir(parents=True, exist_ok=True)
    columns = ["stage", "step"] + [k for k in rows[0] if k.startswith("eval/") and k != "eval/accuracy"] + ["checkpoint"]
    # each file whole or not at all (in memory, then tmp, fsync, rename): a bench run again and killed
    # while writing left a table cut short, read as fewer checkpoints evaluated
    with io.StringIO(newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
        manifest.write_atomic(out / "results.csv", f.getvalue())
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    table = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    table += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    manifest.write_atomic(out / "results.md", "\n".join(table) + "\n")
    print("\n".join(table))
    plotted = _plot(out / "results.png", rows, columns)
    print(f"bench results: {out / 'results.md'}, {out / 'results.csv'}" + (f", {out / 'results.png'}" if plotted else ""))


def _plot(path: Path, rows: list[dict], columns: list[str]) -> bool:
    """A panel per eval set: its metrics (not their standard errors, drawn as bars) per checkpoint."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sets = sorted({c.split("/")[1] for c in columns if c.startswith("eval/") and c.count("/") == 2})
    fig, axes = plt.subplots(1, len(sets), figsize=(5 * len(sets), 3.6), squeeze=False)
    labels = [f"{r['stage']}/{r['step']}" for r in rows]
    for ax, name in zip(axes[0], sets):
        for c in columns:
            parts = c.split("/")
            if len(parts) == 3 and parts[1] == name and not c.endswith(("_se", "failed_tasks")):
                se = [r.get(c + "_se", 0.0) for r in rows]
                ax.errorbar(range(len(rows)), [r.get(c, float("nan")) for r in rows], yerr=se, marker="o", label=parts[2])
        ax.set_xticks(range(len(rows)), labels, rotation=30, fontsize=7)
        ax.set_title(name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    png = io.BytesIO()  # rendered in memory, then written whole (or the earlier one kept)
    fig.savefig(png, dpi=90, format="png")
    manifest.write_atomic(path, png.getvalue())
    plt.close(fig)
    return True
