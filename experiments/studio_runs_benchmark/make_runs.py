"""Lay out N finished runs under a checkpoint root the way `python run.py` writes them
(rft/runtime/rundir.py): `.hydra/` (config.yaml as composed, overrides.yaml, hydra.yaml), `.run.lock`,
`run.log`, and per stage (sft_warmup then grpo) `config.yaml` with its fingerprint line, `data.json`,
`metrics.jsonl` (the keys a default run logs, an eval every 10 steps), `batches.jsonl` and
`checkpoints/step_<k>/`. A fifth of them are the jobs of sweeps (`multirun/<time>/<n>/`; one sweep,
or `--sweeps` of them), each sweep with the `multirun.yaml` Hydra writes (its lr x seed grid).

    .venv/bin/python experiments/studio_runs_benchmark/make_runs.py /tmp/studio_bench --runs 100

Nothing is trained: the values are drawn from a seeded generator, so the studio has the files of a
hundred runs to list, not their results.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import yaml
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# what a default GRPO step logs (the keys of a real run's metrics.jsonl, in its order)
RL_KEYS = ["timing/wait_rollout_s", "reward/mean", "reward/std", "reward/min", "reward/max", "response_length/mean",
           "response_length/max", "rollout/truncated_frac", "rollout/tokens_per_s", "rollout/zero_variance_group_frac",
           "rollout/truncated_prompts", "rollout/experiences", "rollout/errors", "rollout/timeouts", "rollout/retries",
           "rollout/over_rollout_dropped", "rollout/sampling_tries", "rollout/failed_tasks", "reward/exact_match/mean",
           "timing/reward_s", "timing/generate_s", "perf/explorer_max_memory_gb", "timing/rollout_s", "staleness/mean",
           "staleness/max", "staleness/dropped", "staleness/count_0", "staleness/token_mean", "staleness/token_frac_0",
           "timing/read_s", "loss/policy", "actor/grad_norm", "actor/lr", "advantage/mean", "advantage/std",
           "advantage/abs_mean", "train/experiences", "train/tokens_per_s", "timing/train_compute_s",
           "perf/trainer_tokens_per_s", "perf/padding_frac", "perf/shared_prompt_frac", "perf/tflops", "perf/max_memory_gb",
           "actor/clip_frac", "actor/clip_frac_low", "actor/clip_frac_high", "actor/approx_kl", "actor/entropy",
           "train/zero_advantage_rows_skipped", "rollout/logprob_diff", "actor/tis_weight_mean", "actor/tis_weight_max",
           "actor/tis_capped_frac", "timing/train_s", "timing/sync_s", "sync/version", "timing/step_s"]
SFT_KEYS = ["train/truncated_prompts", "train/truncated_responses", "loss/policy", "actor/grad_norm", "actor/lr",
            "advantage/mean", "advantage/std", "advantage/abs_mean", "train/experiences", "train/tokens_per_s",
            "timing/train_compute_s", "perf/trainer_tokens_per_s", "perf/padding_frac", "perf/shared_prompt_frac",
            "perf/tflops", "perf/max_memory_gb", "actor/entropy", "train/zero_advantage_rows_skipped", "timing/train_s",
            "sync/version", "timing/step_s"]
EVAL_KEYS = ["eval/arithmetic_test/accuracy", "eval/arithmetic_test/failed_tasks", "eval/accuracy", "eval/failed_tasks",
             "timing/eval_s"]


def composed(overrides: list[str]) -> tuple[dict, str]:
    """(the config as composed, unresolved, as .hydra/config.yaml holds it; hydra.yaml's text)."""
    from rft.studio import compose as C

    comp = C.compose_overrides(ROOT / "conf", overrides)
    if comp.error:
        raise SystemExit(f"make_runs: {' '.join(overrides)}: {comp.error}")
    return yaml.safe_load(comp.yaml), yaml.safe_dump({"hydra": {"overrides": {"task": overrides}}})


def metrics(rng: random.Random, steps: int, keys: list[str], eval_every: int, start_acc: float, gain: float) -> str:
    lines = []
    for step in range(0, steps + 1):
        if step % eval_every == 0:
            acc = min(1.0, start_acc + gain * step / steps + rng.gauss(0, 0.02))
            lines.append({"step": step, **dict(zip(EVAL_KEYS, [acc, 0, acc, 0, rng.uniform(0.05, 0.2)]))})
        if step:
            lines.append({"step": step, **{k: round(rng.random(), 6) if "/" in k else 0 for k in keys}})
    return "".join(json.dumps(m) + "\n" for m in lines)


def write_run(run: Path, cfg: dict, hydra_text: str, overrides: list[str], rng: random.Random,
              sft_steps: int, rl_steps: int) -> None:
    from rft.runtime.rundir import fingerprint

    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(cfg)))
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (run / ".hydra" / "hydra.yaml").write_text(hydra_text)
    (run / ".run.lock").write_text("pid 1 on another-host\n")
    (run / "run.log").write_text("[2026-01-01 00:00:00,000][rft][INFO] - started\n" * 10)
    for stage, steps, keys, gain in (("sft_warmup", sft_steps, SFT_KEYS, 0.1), ("grpo", rl_steps, RL_KEYS, 0.5)):
        d = run / stage
        (d / "log").mkdir(parents=True)
        text = yaml.safe_dump(cfg)
        (d / "config.yaml").write_text(f"# fingerprint: {fingerprint(text)}\n{text}")
        (d / "data.json").write_text("{}")
        (d / "metrics.jsonl").write_text(metrics(rng, steps, keys, 10, rng.uniform(0.1, 0.3), gain))
        (d / "batches.jsonl").write_text("".join(json.dumps({"step": s, "tasks": list(range(32))}) + "\n"
                                                 for s in range(1, steps + 1)))
        (d / "log" / f"{stage}_trainer.log").write_text("trainer log\n")
        for k in range(steps // 4, steps + 1, steps // 4):
            (d / "checkpoints" / f"step_{k}").mkdir(parents=True)
            (d / "checkpoints" / f"step_{k}" / "state.json").write_text(json.dumps({"step": k}))


def write_plan(sweep: Path, cfg: dict, jobs: int) -> None:
    """The sweep's multirun.yaml as Hydra writes it (the config with its `hydra` node, in which the
    basic sweeper's params): the four learning rates x as many seeds as make `jobs` (or more)."""
    seeds = ",".join(str(s) for s in range(1, -(-jobs // 4) + 1))
    hydra = {"mode": "MULTIRUN", "sweep": {"dir": "multirun/${now:%Y-%m-%d_%H-%M-%S}", "subdir": "${hydra.job.num}"},
             "sweeper": {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper", "max_batch_size": None,
                         "params": {"algorithm.optimizer.lr": "1e-4,3e-4,1e-3,3e-3", "seed": seeds}},
             "overrides": {"hydra": ["hydra.mode=MULTIRUN"], "task": []}}
    (sweep / "multirun.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create({"hydra": hydra, **cfg})))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", type=Path, help="the checkpoint root to fill (must not exist)")
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--sft-steps", type=int, default=400)
    p.add_argument("--rl-steps", type=int, default=200)
    p.add_argument("--sweeps", type=int, default=1, help="how many sweeps a fifth of the runs are the jobs of")
    args = p.parse_args(argv)
    if args.root.exists():
        raise SystemExit(f"make_runs: {args.root} exists; give a new directory.")
    rng = random.Random(0)
    sweep = args.runs // 5
    per_sweep = -(-sweep // args.sweeps)  # jobs a sweep, the last one's fewer
    base, hydra_text = composed([])
    for n in range(args.runs):
        lr, seed = [1e-4, 3e-4, 1e-3, 3e-3][n % 4], 1 + n // 4
        overrides = [f"algorithm.optimizer.lr={lr}", f"seed={seed}"]
        cfg = {**base, "seed": seed, "algorithm": {**base["algorithm"], "optimizer": {**base["algorithm"]["optimizer"], "lr": lr}}}
        if n < sweep:
            run = args.root / "rft" / "multirun" / f"2026-01-01_00-00-{n // per_sweep:02d}" / str(n % per_sweep)
        else:
            run = args.root / "rft" / f"run_{n:03d}"
            overrides.append(f"name=run_{n:03d}")
        write_run(run, cfg, hydra_text, overrides, rng, args.sft_steps, args.rl_steps)
    for k in range(-(-sweep // per_sweep) if sweep else 0):
        write_plan(args.root / "rft" / "multirun" / f"2026-01-01_00-00-{k:02d}", base, min(per_sweep, sweep - k * per_sweep))
    print(f"wrote {args.runs} runs ({sweep} of them the jobs of {args.sweeps} sweep(s)) under {args.root}")


if __name__ == "__main__":
    main()
