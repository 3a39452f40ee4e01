"""rft against TRL's GRPOTrainer on the same cores, warm start, prompts per step, loss and settings.

    .venv/bin/python experiments/trl_comparison/benchmark.py [--seeds 1 2 3] [--steps 30] [--arms ...]
    .venv/bin/python experiments/trl_comparison/benchmark.py --shape 0.5b     # --seeds 1 --steps 4

1. Makes `.venv-trl` on first use (TRL in a venv of its own: never a dependency of rft).
2. Makes the warm start once: rft's default SFT warm-up stage (conf/model/tiny.yaml), whose last
   checkpoint both sides start from (eval accuracy 0.18).
3. Runs the arms interleaved, seed by seed (A B C ... A B C ...), each in a fresh process:
   - `rft-inline`: `cluster=inline` (one process, torch given 1 thread);
   - `rft-ray`: `cluster=local` as the default study runs it (Ray: explorer and trainer actors
     reserving 1 CPU each and running side by side, the explorer one step ahead: a null
     `synchronizer.sync_offset` is 1 here, rft.plan.placement.sync_offset; the default off-policy
     correction; torch given 1 thread in each);
   - `rft-ray-sync`: the same with `synchronizer.sync_offset=0`: the actors take turns, each with
     torch given both CPUs (rft.plan.placement.torch_threads);
   - `trl-1`, `trl-2`: experiments/trl_comparison/trl_arm.py with torch given 1 and 2 threads.
   Every arm evaluates every --eval-interval steps (greedy, the 200 held-out problems); eval time
   is left out of step times.
4. Prints, per arm, medians over seeds of: s per RL step (median over steps 3..N), the engine's
   generate and the trainer's compute per step, the framework overhead of a synchronous step
   (each step's 1 - (generate + train compute) / step, the median over steps), time to the first
   eval >= 0.9 (the sum of the step times up to it), and peak memory of the process tree (PSS:
   shared pages such as torch's libraries count once across processes, as they occupy memory
   once), and for the Ray arms how it splits between the driver, the actors and Ray's own
   processes; then the ratios the README quotes.

`--shape 0.5b`: a real model's size instead. Both sides start from the same random model of
Qwen2.5-0.5B's shape (model=qwen2.5-0.5b-shape: 494M parameters, vocabulary 151,936, bfloat16,
built once by rft), and a step is 4 prompts x 8 completions of 128 new tokens (a random model
writes them all: its ids are not the tokenizer's and decode to nothing, so every reward is 0; rft
is told not to set zero-advantage rows aside, trainer.skip_zero_advantage=false, so both sides
forward and backward every row). No eval. Arms: `rft-inline-2` (one process, torch given both
CPUs), `rft-ray-sync` and `trl-2`; per-step figures are medians over steps 3..N.

Timings on a shared machine are noisy: compare the ratios of one invocation, not numbers across
machines. Outputs go to --out (default: a temporary directory, removed at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRL_VENV = ROOT / ".venv-trl"
ARMS = ("rft-inline", "rft-inline-2", "rft-ray", "rft-ray-sync", "trl-1", "trl-2")
# --shape: what each side is given, and the defaults of the command line
SHAPES = {
    "tiny": dict(arms=("rft-inline", "rft-ray", "rft-ray-sync", "trl-1", "trl-2"), seeds=[1, 2, 3], steps=30,
                 rft=[], trl=["--prompts", "16", "--max-new-tokens", "6", "--dtype", "float32"]),
    "0.5b": dict(arms=("rft-inline-2", "rft-ray-sync", "trl-2"), seeds=[1], steps=4,
                 rft=["model=qwen2.5-0.5b-shape", "buffer.batch_size=4", "algorithm.repeat_times=8",
                      "model.max_response_tokens=128", "trainer.skip_zero_advantage=false",
                      "explorer.eval_on_startup=false", "buffer.explorer_input.eval_tasksets=[]"],
                 trl=["--prompts", "4", "--max-new-tokens", "128", "--dtype", "bfloat16"]),
}


def ensure_trl_venv() -> Path:
    py = TRL_VENV / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", "import trl"], capture_output=True).returncode == 0:
        return py
    print(f"making {TRL_VENV} (torch, rft, trl; a few minutes, once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
    pip = [str(py), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, "torch==2.13.0"], check=True)  # the CPU build, as the Makefile installs it
    subprocess.run([*pip, "-e", str(ROOT), "trl==1.16.*"], check=True)
    subprocess.run([str(py), "-m", "pip", "uninstall", "--quiet", "--yes", "torchvision"], check=False)
    return py


def role(cmdline: list[str], top: bool) -> str:
    """Whose a process of the tree is: the driver (the command run), an rft actor (Ray names its
    workers' processes "ray::<class>", ours are all rft.runtime.actors._Host), or Ray's own and helpers
    (GCS, raylet, dashboard and agents, monitors, rft's reaper, multiprocessing's trackers)."""
    if top:
        return "driver"
    return "actors" if cmdline and cmdline[0].startswith("ray::_Host") else "ray"


def tree_pss(pid: int) -> dict[str, int]:
    """Bytes of PSS of a process and all its descendants (0 for those already gone), by role."""
    import psutil

    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    parts = {"driver": 0, "actors": 0, "ray": 0}
    for p in procs:
        try:
            parts[role(p.cmdline(), p.pid == pid)] += p.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return parts


def run_measured(cmd: list[str], log: Path, env: dict | None = None) -> dict[str, int]:
    """Run `cmd` (output to `log`); returns the PSS of its process tree by role (tree_pss) when
    the whole was largest, sampled every 2 s (reading PSS walks each process's page tables:
    sampled every 0.2 s it took enough CPU from a 2-core machine to slow a Ray run by a third)."""
    peak: list[dict] = [{}]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

        def sample():
            while proc.poll() is None:
                parts = tree_pss(proc.pid)
                if sum(parts.values()) > sum(peak[0].values()):
                    peak[0] = parts
                time.sleep(2.0)

        t = threading.Thread(target=sample, daemon=True)
        t.start()
        rc = proc.wait()
        t.join()
    if rc != 0:
        sys.exit(f"{' '.join(cmd[:4])} ... failed (exit {rc}); its output: {log}")
    return peak[0]


def warm_start(out: Path) -> Path:
    """The last checkpoint of rft's default SFT warm-up (one GRPO step after it, not used)."""
    root = out / "warm"
    hf = sorted((root / "rft" / "warm" / "sft_warmup" / "checkpoints").glob("step_*/hf"),
                key=lambda p: int(p.parent.name.split("_")[1]))
    if not hf:
        print("warm start: rft's SFT warm-up stage (about a minute)", flush=True)
        run_measured([sys.executable, "run.py", "name=warm", f"checkpoint_root_dir={root}", "monitor=console",
                      "buffer.total_steps=1", "explorer.eval_on_startup=false"], out / "warm.log")
        hf = sorted((root / "rft" / "warm" / "sft_warmup" / "checkpoints").glob("step_*/hf"),
                    key=lambda p: int(p.parent.name.split("_")[1]))
    return hf[-1]


def rft_arm(arm: str, seed: int, args, warm: Path | None, out: Path) -> dict:
    name = f"{arm}-s{seed}"
    model = [f"model.model_path={warm}", "model.builder=null"] if warm else []
    cmd = [sys.executable, "run.py", "stages=[]", f"name={name}", f"seed={seed}", f"checkpoint_root_dir={out}",
           "monitor=console", *model, *SHAPES[args.shape]["rft"], f"buffer.total_steps={args.steps}",
           f"explorer.eval_interval={args.eval_interval}", f"trainer.save_interval={args.steps * 10}",
           "cluster=inline" if arm.startswith("rft-inline") else "cluster=local"]
    if arm == "rft-inline-2":
        cmd.append("cluster.threads_per_actor=2")
    if arm == "rft-ray-sync":
        cmd.append("synchronizer.sync_offset=0")
    peak = run_measured(cmd, out / f"{name}.log")
    from rft.reporting.monitor import read_metrics

    steps, evals = [], {}
    for m in read_metrics(out / "rft" / name / "metrics.jsonl"):
        if "eval/accuracy" in m:
            evals[m["step"]] = m["eval/accuracy"]
        if "timing/step_s" in m:
            steps.append({"step": m["step"], "step_s": m["timing/step_s"], "generate_s": m.get("timing/generate_s", 0.0),
                          "train_s": m.get("timing/train_compute_s", 0.0)})
    return {"steps": steps, "evals": evals, "start": evals.get(0), "peak": peak}


def trl_arm(arm: str, seed: int, args, warm: Path | None, out: Path, py: Path) -> dict:
    threads = int(arm.split("-")[1])
    name = f"{arm}-s{seed}"
    res = out / f"{name}.json"
    cache = Path(os.path.expanduser(os.environ.get("RFT_CACHE_DIR", "~/.cache/rft")))
    model = warm or cache / "models" / "qwen2.5-0.5b-shape-v2"
    cmd = [str(py), str(Path(__file__).with_name("trl_arm.py")), "--model", str(model), "--data",
           str(cache / "data" / "arithmetic-v4"), "--out", str(res), "--seed", str(seed), "--steps", str(args.steps),
           "--eval-interval", str(args.eval_interval if warm else 0), "--threads", str(threads),
           *SHAPES[args.shape]["trl"]]
    env = {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    peak = run_measured(cmd, out / f"{name}.log", env)
    d = json.loads(res.read_text())
    steps = [{"step": r["step"], "step_s": r["step_s"], "generate_s": r["generate_s"],
              "train_s": r["step_s"] - r["score_s"]} for r in d["steps"]]
    evals = {r["step"]: r["eval_accuracy"] for r in d["steps"] if "eval_accuracy" in r}
    return {"steps": steps, "evals": evals, "start": d["start_accuracy"], "peak": peak}


def summarize(run: dict, target: float) -> dict:
    steady = [s for s in run["steps"] if s["step"] >= 3] or run["steps"]
    med = {k: statistics.median(s[k] for s in steady) for k in ("step_s", "generate_s", "train_s")}
    reached = next((k for k in sorted(run["evals"]) if k > 0 and run["evals"][k] >= target), None)
    to_target = None if reached is None else sum(s["step_s"] for s in run["steps"] if s["step"] <= reached)
    # a step's overhead is its own time minus its own generate and compute (the three are paired
    # per step; the difference of three medians taken apart mixes steps and is twice as noisy)
    overhead = statistics.median(1 - (s["generate_s"] + s["train_s"]) / s["step_s"] for s in steady)
    return {**med, "overhead": overhead, "overhead_ms": statistics.median(
                s["step_s"] - s["generate_s"] - s["train_s"] for s in steady) * 1000,
            "to_target_s": to_target, "to_target_step": reached, "peak_gb": sum(run["peak"].values()) / 2**30,
            **{f"{k}_gb": v / 2**30 for k, v in run["peak"].items()},
            "final": run["evals"][max(run["evals"])] if run["evals"] else None, "start": run["start"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES), help="the model and step size (module doc)")
    ap.add_argument("--seeds", type=int, nargs="+", help="default: 1 2 3 (tiny), 1 (0.5b)")
    ap.add_argument("--steps", type=int, help="default: 30 (tiny), 4 (0.5b)")
    ap.add_argument("--eval-interval", type=int, default=2)
    ap.add_argument("--target", type=float, default=0.9, help="the eval accuracy 'time to' is measured to")
    ap.add_argument("--arms", nargs="+", choices=ARMS, help="default: the shape's (module doc)")
    ap.add_argument("--out", help="keep the runs here (default: a temporary directory)")
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    args.seeds, args.steps = args.seeds or shape["seeds"], args.steps or shape["steps"]
    args.arms = args.arms or list(shape["arms"])
    sys.path.insert(0, str(ROOT))
    py = ensure_trl_venv() if any(a.startswith("trl") for a in args.arms) else None
    tmp = None if args.out else tempfile.TemporaryDirectory()
    out = Path(args.out or tmp.name).resolve()
    out.mkdir(parents=True, exist_ok=True)
    warm = warm_start(out) if args.shape == "tiny" else build_shape_model()
    print(f"{'warm start' if args.shape == 'tiny' else 'model'}: {warm}", flush=True)
    results: dict[str, list[dict]] = {a: [] for a in args.arms}
    for seed in args.seeds:
        for arm in args.arms:
            run = (trl_arm(arm, seed, args, warm, out, py) if arm.startswith("trl")
                   else rft_arm(arm, seed, args, warm if args.shape == "tiny" else None, out))
            s = summarize(run, args.target)
            results[arm].append(s)
            line = (f"  seed {seed} {arm:13s} {s['step_s']:.3f} s/step, generate {s['generate_s']:.3f}, "
                    f"train {s['train_s']:.3f}, peak {s['peak_gb']:.2f} GB")
            if s["final"] is not None:  # no eval at --shape 0.5b
                line += f", eval {s['start']:.3f} -> {s['final']:.3f}, >= {args.target} at step {s['to_target_step']}"
            print(line, flush=True)
    report(results, args)
    if tmp:
        tmp.cleanup()


def build_shape_model() -> Path:
    """The random model of Qwen2.5-0.5B's shape that both sides start from (--shape 0.5b)."""
    from rft.models import BUILDERS

    cache = Path(os.path.expanduser(os.environ.get("RFT_CACHE_DIR", "~/.cache/rft")))
    print("the model of Qwen2.5-0.5B's shape (built once, ~20 s)", flush=True)
    return BUILDERS["qwen2.5-0.5b-shape"](str(cache / "models" / "qwen2.5-0.5b-shape-v2"))


def report(results: dict[str, list[dict]], args) -> None:
    def med(arm, key):
        vals = [r.get(key) for r in results[arm] if r.get(key) is not None]
        return statistics.median(vals) if vals and len(vals) == len(results[arm]) else None

    fmt = lambda v, f: "never" if v is None else format(v, f)  # noqa: E731
    print(f"\nmedians over seeds {args.seeds} ({args.steps} RL steps each, steps 3..{args.steps} for per-step times)")
    print(f"| arm | s / RL step | generate s | train s | overhead (sync step) | time to eval >= {args.target} s "
          "| peak PSS of the process tree GB |")
    print("|---|---|---|---|---|---|---|")
    for arm in args.arms:
        overhead = (f"{med(arm, 'overhead'):.1%} ({med(arm, 'overhead_ms'):.1f} ms)"
                    if arm in ("rft-inline", "rft-inline-2", "rft-ray-sync") else "–")
        print(f"| {arm} | {med(arm, 'step_s'):.3f} | {med(arm, 'generate_s'):.3f} | {med(arm, 'train_s'):.3f} | "
              f"{overhead} | {fmt(med(arm, 'to_target_s'), '.2f')} | {med(arm, 'peak_gb'):.2f} |")
    print("\npeak PSS by process (GB): the driver, rft's actors, Ray's own processes and helpers")
    for arm in args.arms:
        if arm.startswith("rft-ray"):
            print(f"  {arm}: driver {med(arm, 'driver_gb'):.2f}, actors {med(arm, 'actors_gb'):.2f}, "
                  f"Ray {med(arm, 'ray_gb'):.2f}")
    print()
    pairs = [("rft-inline", "trl-1", "step_s"), ("rft-inline-2", "trl-2", "step_s"), ("rft-ray", "trl-2", "step_s"),
             ("rft-ray-sync", "trl-2", "step_s"), ("rft-inline", "trl-1", "to_target_s"),
             ("rft-ray", "trl-2", "to_target_s"), ("rft-ray", "rft-inline", "peak_gb"),
             ("rft-inline-2", "trl-2", "peak_gb"), ("rft-ray-sync", "trl-2", "peak_gb")]
    for a, b, key in pairs:
        if a in results and b in results and med(a, key) and med(b, key):
            print(f"{a} / {b} ({key}): {med(a, key) / med(b, key):.2f}x")


if __name__ == "__main__":
    main()
