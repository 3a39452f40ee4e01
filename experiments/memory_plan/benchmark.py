"""The plan's memory estimate (rft/plan/memory.py) against the peaks a run measures.

    .venv/bin/python experiments/memory_plan/benchmark.py                 # every arm
    .venv/bin/python experiments/memory_plan/benchmark.py --arms tiny 0.5b
    .venv/bin/python experiments/memory_plan/benchmark.py --extra cluster.gpu_per_node=1 cluster.colocate=true

Each arm is a short run with Ray (cluster=local: the trainer and the explorer each a process of its
own), eval off; its peaks are the largest `perf/max_memory_gb` (the trainer's busiest rank) and
`perf/explorer_max_memory_gb` (the explorers' largest) in its metrics.jsonl: on CPU each process's
peak resident set, on a GPU what torch allocated there. The estimate is the dry run's, from the same
overrides. Prints a markdown table: estimate, measured, estimate / measured, per role.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

COMMON = ["stages=[]", "cluster=local", "monitor=console", "explorer.eval_on_startup=false",
          "buffer.explorer_input.eval_tasksets=[]", "buffer.total_steps=3"]
SHAPE = ["model=qwen2.5-0.5b-shape", "explorer=hf", "buffer.batch_size=2", "algorithm.repeat_times=4",
         "trainer.skip_zero_advantage=false"]
ARMS = {
    "tiny": [],
    "0.5b": [*SHAPE, "model.max_response_tokens=16"],
    "0.5b-long": [*SHAPE, "model.max_response_tokens=128"],
    # 2 trainer ranks and an explorer: 3 actors of 1 CPU, on a 2-core machine 3 of Ray's CPUs
    "0.5b-fsdp2": [*SHAPE, "model.max_response_tokens=16", "trainer=fsdp2", "cluster.num_cpus=3"],
}


def estimate(overrides: list[str]) -> dict:
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from rft.plan.batch import make_plan, stage_configs
    from rft.plan.memory import estimate as plan_estimate

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # the run's name reads hydra's choices
    with open_dict(cfg):
        del cfg["hydra"]
    stage = stage_configs(cfg)[0]
    est = plan_estimate(stage, make_plan(stage, 2000))
    return {("trainer" if r.name.startswith("trainer") else "explorer"): (r.total, r.parts) for r in est.roles}


def measure(name: str, overrides: list[str], root: Path) -> dict:
    env = {**os.environ, "RFT_CHECKPOINT_ROOT_DIR": str(root)}
    done = subprocess.run([sys.executable, "run.py", *overrides, f"name={name}"], cwd=ROOT, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise SystemExit(f"arm {name}: run.py exited {done.returncode}:\n{done.stderr[-2000:]}")
    rows = [json.loads(x) for x in (root / "rft" / name / "metrics.jsonl").read_text().splitlines()]
    peak = {"trainer": "perf/max_memory_gb", "explorer": "perf/explorer_max_memory_gb"}
    return {role: max(r[k] for r in rows if k in r) * 2**30 for role, k in peak.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--extra", nargs="*", default=[], help="overrides added to every arm (on one GPU: "
                                                               "cluster.gpu_per_node=1 cluster.colocate=true)")
    args = ap.parse_args()
    print("| arm | role | estimate GiB | measured peak GiB | estimate / measured | the estimate's parts (GiB) |")
    print("|---|---|---|---|---|---|")
    for arm in args.arms:
        overrides = COMMON + ARMS[arm] + args.extra
        est = estimate(overrides)
        with tempfile.TemporaryDirectory() as tmp:
            got = measure(arm.replace(".", "_"), overrides, Path(tmp))
        for role, (total, parts) in est.items():
            shown = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in parts)
            print(f"| {arm} | {role} | {total / 2**30:.2f} | {got[role] / 2**30:.2f} | {total / got[role]:.2f} | {shown} |",
                  flush=True)


if __name__ == "__main__":
    main()
