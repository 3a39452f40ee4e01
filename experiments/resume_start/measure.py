"""What a resumed run's start costs, by part: the seconds, the bytes read from the disk, the peak memory.

    .venv/bin/python experiments/resume_start/measure.py [--root /tmp/resume_start] [--repeats 5]
        [--arms grpo grpo-kl ppo] [--cache warm cold]

For each arm, once: a 2-step run of the Qwen2.5-0.5B shape (COMMON below, the arm's overrides,
buffer.total_steps=2). Then, --repeats times for each cache state: a copy of that run resumed by
the same command with buffer.total_steps=3 (it loads checkpoint step_2 and trains step 3), in a
fresh process with timers around the parts of its start, which ends after the first train step;
cold: the starting model's and the checkpoint's files evicted from the page cache first
(posix_fadvise DONTNEED), as after a requeue on another node. cluster=inline: the driver, trainer
and explorer are one process, so the figures are one process's.

Each cell: seconds, and GB read from the disk during the part (/proc/self/io read_bytes: page
cache hits are not counted). Safetensors weights are memory-mapped, so a model's bytes are read
where they are first touched (by a copy into them, by a forward), not always where it is built.
    verify          the checkpoint's files against its manifest (rft.runtime.checkpoint.damage)
    trainer build   Trainer.__init__: the tokenizer, every model below, the optimizer
      policy load   the policy as the trainer builds it (from the starting model, or the checkpoint's hf/)
      reference     the reference model (the starting model), where the algorithm has one
      critic build  the critic's value model (PPO)
    trainer load    Trainer.load: the checkpoint over what the trainer built
      state read    trainer_state.pt (optimizer moments, RNG, scheduler, the critic's weights)
      hf/ read      the checkpoint's hf/ weights copied into the built policy (none when built from them)
    explorer        the explorer and its engine (the HF engine maps the checkpoint's hf/)
    stage start     StageRun.__init__: all of the above and the rest, up to the first step
    to step         from the process's start (imports, config) to the first step
    train step      the first train step (its forwards touch what the start left mapped)
Medians over the repeats; the last column is the process's peak resident set (VmHWM) at the first
step and after the first train step, MB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# model.builder=null: the built model read as any local model is (a built one's files are checked
# against their manifest at every start, a read of the starting model a real one does not have)
COMMON = ["model=qwen2.5-0.5b-shape", "model.builder=null", "stages=[]", "cluster=inline", "monitor=console", "buffer.batch_size=1",
          "algorithm.repeat_times=2", "model.max_response_tokens=8", "explorer.eval_on_startup=false",
          "buffer.explorer_input.eval_tasksets=[]"]
ARMS = {"grpo": [], "grpo-kl": ["algorithm.kl_loss_fn=k3"], "ppo": ["algorithm=ppo"]}
PARTS = ["verify", "trainer build", "policy load", "reference", "critic build", "trainer load", "state read",
         "hf/ read", "explorer", "stage start", "to step", "train step"]


def evict(d: Path) -> None:
    """Drop the folder's files from the page cache (the checkpoint-verify study's own way)."""
    sys.path.insert(0, str(ROOT))
    from experiments.checkpoint_verify.measure import evict as drop

    drop(d)


def read_gb() -> float:
    """Bytes this process has had read from the disk so far (not from the page cache), GB."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1]) / 1e9
    return float("nan")


def hwm_mb() -> float:
    """The process's peak resident set (VmHWM), MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(out: str, argv: list[str]) -> None:
    """Run run.py with `argv` in this process, timers around the parts; their sums go to `out`."""
    t_process = time.perf_counter()  # (the interpreter's own start is before this: ~0.05 s)
    sys.path.insert(0, str(ROOT))
    import rft.models
    import rft.runtime.checkpoint as checkpoint
    import rft.runtime.runner as runner
    import rft.rollout.explorer as explorer
    import rft.trainer.critic as critic
    import rft.trainer.state as state
    import rft.trainer.trainer as trainer

    parts: dict[str, list[float]] = {}
    trainer_built = []

    def timed(name, fn, part=None):
        def wrapper(*a, **k):
            t0, b0 = time.perf_counter(), read_gb()
            try:
                return fn(*a, **k)
            finally:
                label = part(*a, **k) if part else name
                s, gb = parts.setdefault(label, [0.0, 0.0])
                parts[label] = [s + time.perf_counter() - t0, gb + read_gb() - b0]
        return wrapper

    # the trainer's models in the order it builds them: the policy, then the reference
    def which_model(*a, **k):
        if trainer_built:
            return "other model"  # (an explorer's engine)
        return "policy load" if "policy load" not in parts else "reference"

    trainer.load_model = timed("", trainer.load_model, which_model)
    trainer.load_reward_head = timed("policy load", trainer.load_reward_head)
    checkpoint.damage = timed("verify", checkpoint.damage)
    critic.ValueModel.__init__ = timed("critic build", critic.ValueModel.__init__)
    state.load_state = timed("state read", state.load_state)
    state.load_hf_weights = timed("hf/ read", state.load_hf_weights)
    init = trainer.Trainer.__init__

    def build(self, *a, **k):
        timed("trainer build", init)(self, *a, **k)
        trainer_built.append(True)

    trainer.Trainer.__init__ = build
    trainer.Trainer.load = timed("trainer load", trainer.Trainer.load)
    explorer.Explorer.__init__ = timed("explorer", explorer.Explorer.__init__)
    start = runner.StageRun.__init__

    def stage(self, *a, **k):
        timed("stage start", start)(self, *a, **k)
        parts["to step"] = [time.perf_counter() - t_process, read_gb()]
        parts["peak at step"] = [0.0, hwm_mb()]

    runner.StageRun.__init__ = stage
    step = trainer.Trainer.train_step

    def first_step(self, *a, **k):  # its first forward reads what the start left memory-mapped
        if "train step" in parts:
            return step(self, *a, **k)
        out_ = timed("train step", step)(self, *a, **k)
        parts["peak after"] = [0.0, hwm_mb()]
        Path(out).write_text(json.dumps(parts))
        os._exit(0)  # what follows (the step's save, 3 GB) is no part of the start

    trainer.Trainer.train_step = first_step
    import runpy

    sys.argv = [str(ROOT / "run.py"), *argv]
    runpy.run_path(str(ROOT / "run.py"), run_name="__main__")


def run(root: Path, argv: list[str], out: Path | None = None) -> None:
    env = {**os.environ, "RFT_CHECKPOINT_ROOT_DIR": str(root)}
    cmd = [sys.executable, __file__, "--child", str(out), "--", *argv] if out else [sys.executable, str(ROOT / "run.py"), *argv]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/tmp/resume_start")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--cache", nargs="+", default=["warm", "cold"], choices=["warm", "cold"])
    ap.add_argument("--child")
    ap.add_argument("argv", nargs="*")
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.argv)
    root = Path(args.root)
    # where model=qwen2.5-0.5b-shape is built (conf/model: ${cache_dir}/models/...)
    cache = Path(os.path.expanduser(os.environ.get("RFT_CACHE_DIR", "~/.cache/rft")))
    starting = cache / "models" / "qwen2.5-0.5b-shape-v2"
    sys.path.insert(0, str(ROOT))
    from rft.models import build_qwen05_shape_model

    build_qwen05_shape_model(starting)
    print(f"| arm | cache | {' | '.join(PARTS)} | peak MB at step / after it |")
    print("|---|---|" + "---|" * (len(PARTS) + 1))
    for arm in args.arms:
        base = root / "rft" / f"base-{arm}"
        if not (base / "checkpoints" / "step_2").is_dir():
            run(root, [*COMMON, *ARMS[arm], f"name=base-{arm}", "buffer.total_steps=2"])
        for state in args.cache:
            runs = []
            for i in range(args.repeats):
                copy = root / "rft" / f"resume-{arm}"
                shutil.rmtree(copy, ignore_errors=True)
                shutil.copytree(base, copy)
                if state == "cold":
                    evict(starting)
                    evict(copy)
                out = root / f"parts-{arm}-{state}-{i}.json"
                run(root, [*COMMON, *ARMS[arm], f"name=resume-{arm}", "buffer.total_steps=3"], out)
                runs.append(json.loads(out.read_text()))
                shutil.rmtree(copy)
            cells = []
            for p in PARTS:
                got = [r[p] for r in runs if p in r]
                cells.append("-" if not got else f"{statistics.median(g[0] for g in got):.2f} s, "
                                                 f"{statistics.median(g[1] for g in got):.2f} GB")
            peaks = [f"{statistics.median(r[p][1] for r in runs):.0f}" for p in ("peak at step", "peak after")]
            print(f"| {arm} | {state} | {' | '.join(cells)} | {' / '.join(peaks)} |", flush=True)


if __name__ == "__main__":
    main()
