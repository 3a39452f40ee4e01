"""SIGKILL anywhere: a tiny run killed at a uniformly random moment (sometimes once more during its
resume), then run again to its end, against the same run uninterrupted.

    python experiments/kill_anywhere/harness.py --cluster inline --buffer queue --trials 10 --out <dir>

Each trial: `python run.py <args>` started in a process group of its own, killed with SIGKILL at
U(0, 1.5 T) seconds (T: the uninterrupted run's wall time; a kill after the end is none), the whole group (a crash of the machine's
session: Ray's children too) or the driver alone; with probability --second-kill its resume is
killed the same way; then the same command runs to its end. The trial's outcome:

  same      final weights (the last checkpoint's *.safetensors bytes), its trainer_state.pt bytes (the
            optimizer, and a critic's weights and optimizer), metrics.jsonl (its wall-clock figures left
            out) and batches.jsonl of every stage equal the reference's
  differs   exit 0, something above not equal (named)
  failed    the last run's exit status was not 0 (its stderr's tail kept)
  hung      the last run did not end within --timeout seconds
  leftover  a process of the trial's (its RFT_CHECKPOINT_ROOT_DIR in its environment) still alive
            10 s after a kill (Ray's must be reaped by the run)

One JSON line per trial goes to <out>/trials.jsonl (kill times, the runs' exit statuses, outcome).
"""

import argparse
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from rft.reporting.monitor import read_metrics  # noqa: E402

# wall-clock and process figures differ between two processes (tests/resume_support.py's list)
VOLATILE = ("timing/", "tokens_per_s", "perf/tflops", "perf/mfu", "max_memory_gb", "rollout/partial_s")

# the default two-stage study (SFT warm-up, then GRPO), at its smallest: 12 SFT steps, 4 GRPO steps
# of 4 prompts x 4 answers, a checkpoint every 2 steps, an eval every 2
TINY = ["monitor=console", "stages.0.buffer.total_steps=12", "stages.0.algorithm.optimizer.warmup_steps=4",
        "buffer.total_steps=4", "trainer.save_interval=2",
        "buffer.batch_size=4", "algorithm.repeat_times=4", "explorer.eval_interval=2",
        "explorer.eval_on_startup=false", "stages.0.explorer.eval_interval=100"]


# --layout: the overrides that make the layout, and the name of its last (the RL or DPO) stage, the
# stage whose kills count as "in the RL stage" and a --clock-from path of which starts with {rl}
LAYOUTS = {
    "default": ([], "grpo"),
    # two data-parallel ranks (gloo on CPU) as Ray actors (with the explorer: 3 CPUs, the Ray
    # instance told so on a 2-core machine); --rank-frac kills one rank alone
    "fsdp2": (["trainer=fsdp2", "trainer.ranks=2", "cluster.num_cpus=3"], "grpo"),
    # a critic beside the policy: its weights and optimizer state are checkpointed and resumed too
    "ppo": (["algorithm=ppo"], "ppo"),
    # LoRA adapters in the RL stage (from the full warm-up: a LoRA warm-up of 400 steps leaves every
    # reward 0): checkpoints of the adapters, the engine given the merged weights
    "lora": (["+stages.1.model.lora.rank=4"], "grpo"),
    # the shipped multi-turn tool task (the calculator conversations; its warm-up with
    # --full-warmup, else TINY's 12 steps of it)
    "multiturn": (["experiment=calculator_tool"], "grpo"),
    # partial rollouts (generation in chunks, unfinished groups carried to the next step; single-turn
    # tasks only: the plan refuses them for multi-turn), on the fixed schedule of a test mode so that
    # a run is a function of its config; needs cluster=local and --sync-offset 1
    "partial": (["explorer.partial_rollout=true", "synchronizer.sync_style=dynamic_by_explorer",
                 "synchronizer.fixed_interrupts=true"], "grpo"),
    # weights synced every 2nd step: experiences of an older policy in the buffer at a kill
    "interval2": (["synchronizer.sync_interval=2"], "grpo"),
    # DPO from the taskset's preference pairs after the warm-up: mode=train, no explorer
    "dpo": (["algorithm=dpo"], "dpo"),
}


def stable(obj):
    if isinstance(obj, dict):
        return {k: stable(v) for k, v in obj.items() if not (k.startswith(VOLATILE) or k.endswith(VOLATILE))}
    if isinstance(obj, list):
        return [stable(v) for v in obj]
    return obj


def outputs(run: Path) -> dict:
    """What a run leaves, per stage: the last checkpoint's weights' digest, metrics and batches."""
    out = {}
    for stage in sorted(p for p in run.iterdir() if (p / "checkpoints").is_dir()):
        ckpts = sorted((c for c in (stage / "checkpoints").glob("step_*") if c.name[5:].isdigit()),
                       key=lambda c: int(c.name[5:]))
        last = ckpts[-1] if ckpts else None
        digest, state = hashlib.sha256(), hashlib.sha256()
        # every safetensors file of it: hf/ and, with LoRA, the adapter's own (PEFT's format)
        for f in sorted(last.rglob("*.safetensors")) if last else []:
            digest.update(str(f.relative_to(last)).encode() + f.read_bytes())
        # the trainer's state: the optimizer's moments and step, the scheduler, the RNG, and with
        # PPO the critic's weights and optimizer (torch.save writes the same bytes for the same state)
        if last and (last / "trainer_state.pt").exists():
            state.update((last / "trainer_state.pt").read_bytes())
        out[stage.name] = {"last": last and last.name, "weights": digest.hexdigest(), "state": state.hexdigest(),
                           "metrics": stable(read_metrics(stage / "metrics.jsonl")),
                           "batches": read_metrics(stage / "batches.jsonl")}
    return out


def compare(ref: dict, got: dict) -> list[str]:
    diffs = []
    for stage in sorted(ref.keys() | got.keys()):
        a, b = ref.get(stage), got.get(stage)
        if a is None or b is None:
            diffs.append(f"{stage}: only in {'the resumed run' if a is None else 'the reference'}")
            continue
        for key in a:
            if a[key] != b[key]:
                where = ""
                if key in ("metrics", "batches"):
                    sa, sb = [r.get("step") for r in a[key]], [r.get("step") for r in b[key]]
                    if sa != sb:
                        where = f" (steps {sa} vs {sb})"
                    else:
                        bad = [(r.get("step"), sorted(k for k in r.keys() | s.keys() if r.get(k) != s.get(k)))
                               for r, s in zip(a[key], b[key]) if r != s]
                        where = f" {bad[:3]}"
                diffs.append(f"{stage}/{key}{where}")
    return diffs


def trial_procs(root: Path) -> list[psutil.Process]:
    """The processes whose environment names this trial's checkpoint root (run.py, Ray's, the actors)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("RFT_CHECKPOINT_ROOT_DIR") == str(root):
                found.append(p)
        except (psutil.Error, OSError):
            pass
    return found


def sweep(root: Path) -> int:
    """Kill what is left of a trial's processes; how many there were."""
    procs = trial_procs(root)
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)
    return len(procs)


def start(args, root: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "RFT_CHECKPOINT_ROOT_DIR": str(root), "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT, env=env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)


def reached(root: Path) -> list[str]:
    """Where a killed run was: each stage started, its newest complete checkpoint (manifest written)
    and its metrics rows, as `grpo:2/3` ('-': no checkpoint yet)."""
    run = root / "rft" / "k"
    out = []
    for stage in sorted(p for p in run.iterdir() if p.is_dir() and not p.name.startswith(".")) if run.exists() else []:
        done = [int(c.name[5:]) for c in stage.glob("checkpoints/step_*")
                if c.name[5:].isdigit() and (c / "manifest.json").exists()]
        rows = len(read_metrics(stage / "metrics.jsonl"))
        out.append(f"{stage.name}:{max(done) if done else '-'}/{rows}")
    return out


def trainer_ranks(root: Path) -> dict[int, int]:
    """The live trainer ranks' processes of a trial, rank -> pid, from the ranks' logs
    (`<stage>/log/*trainer_<r>.log`: each actor's first line names its process; a stage copied from
    the stage cache brings logs naming processes long gone, whose numbers another may have now)."""
    mine = {p.pid for p in trial_procs(root)}
    ranks = {}
    for log in sorted((root / "rft" / "k").glob("*/log/*trainer_*.log")):
        m = re.search(r"trainer_(\d+)\.log$", log.name)
        pids = re.findall(r"started in process (\d+)", log.read_text(errors="replace"))
        if m and pids and int(pids[-1]) in mine:
            ranks[int(m.group(1))] = int(pids[-1])
    return ranks


def kill_at(proc: subprocess.Popen, at: float, group: bool, clock: Path | None = None,
            rank: int | None = None, root: Path | None = None, timeout: float = 300) -> str:
    """SIGKILL `proc` (its process group, or it alone, or with `rank` the trainer rank of that
    number alone, the driver left to find it dead) `at` seconds after its start (after `clock`
    exists, where given); 'ended' if it ended first, with its exit status."""
    while clock is not None and not clock.exists():
        if proc.poll() is not None:
            return f"ended {proc.returncode}"
        time.sleep(0.01)
    deadline = time.time() + at
    while time.time() < deadline:
        if proc.poll() is not None:
            return f"ended {proc.returncode}"
        time.sleep(0.01)
    if rank is not None:
        pid = trainer_ranks(root).get(rank)
        if pid is None:  # no rank alive at that moment (the start, a stage's end): the driver instead
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            return "killed (no rank: the driver)"
        os.kill(pid, signal.SIGKILL)
        try:  # the driver finds its rank dead: it stops (with what exit status?) or carries on
            proc.wait(timeout=timeout)
            return f"killed rank {rank}, the run ended {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"killed rank {rank}, the run hung"
    if group:
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return "killed"


def timed(proc: subprocess.Popen, clock: Path | None) -> float:
    """`proc`'s wall time to its end, from its start or from when `clock` appeared."""
    t0, seen = time.time(), None
    while proc.poll() is None:
        if seen is None and clock is not None and clock.exists():
            seen = time.time()
        time.sleep(0.01)
    assert proc.returncode == 0, proc.args
    return time.time() - (seen or t0)


def run_trial(args, root: Path, t_ref: float, rng: random.Random, opts) -> dict:
    rec = {"root": str(root)}
    kills = []
    for attempt in range(2 if rng.random() < opts.second_kill else 1):
        at = rng.uniform(0, opts.span * (t_ref if attempt == 0 else t_ref * 0.8))
        group = rng.random() < opts.group_frac
        rank = rng.randrange(opts.ranks) if rng.random() < opts.rank_frac else None
        group = group and rank is None
        proc = start(args, root, root / f"killed{attempt}.log")
        what = kill_at(proc, at, group, opts.clock_from and root / "rft" / "k" / opts.clock_from,
                       rank=rank, root=root, timeout=opts.timeout)
        kills.append({"at": round(at, 2), "group": group, "rank": rank, "result": what, "reached": reached(root)})
        if what.startswith("killed rank"):  # what the run said of its dead rank
            kills[-1]["said"] = (root / f"killed{attempt}.log").read_text(errors="replace")[-800:]
        if what.startswith("killed"):
            # Ray's processes: the reaper's time (a group kill takes only the processes left in the
            # driver's group: one started in a session of its own must be reaped too)
            time.sleep(10 if opts.cluster != "inline" else 0)
            left = trial_procs(root)
            if left:
                kills[-1]["leftover"] = [" ".join(p.cmdline()[:3]) for p in left if p.is_running()]
                rec["leftover"] = kills[-1]["leftover"]
                t0 = time.time()  # do they end by themselves (a slow exit under load), and when?
                while trial_procs(root) and time.time() - t0 < 60:
                    time.sleep(1)
                kills[-1]["left_for_s"] = round(10 + time.time() - t0, 1)
        sweep(root)
    rec["kills"] = kills
    proc = start(args, root, root / "final.log")
    try:
        proc.wait(timeout=opts.timeout)
        rec["exit"] = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rec["exit"] = None
    sweep(root)
    return rec


def mid_steps(kill: dict, rl: str, steps: int) -> bool:
    """Whether a kill fell after the RL stage's first metrics row and before its last checkpoint."""
    for x in kill.get("reached", []):
        if x.startswith(f"{rl}:"):
            ckpt, rows = x[len(rl) + 1:].split("/")
            return int(rows) >= 1 and ckpt != str(steps)
    return False


def summary(out: Path) -> None:
    """The table of every trials.jsonl under `out`: per config, trials, kills and where they fell, outcomes."""
    rows = {}
    for f in sorted(out.glob("*/trials.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            key = (r["config"], r.get("cache", "warm"), r.get("clock_from") or "start")
            row = rows.setdefault(key, {"trials": 0, "kills": 0, "group": 0, "second": 0, "in_rl": 0, "outcomes": {}})
            row["trials"] += 1
            killed = [k for k in r["kills"] if k["result"].startswith("killed")]
            row["kills"] += len(killed)
            row["group"] += sum(k["group"] for k in killed)
            row["rank"] = row.get("rank", 0) + sum(k["result"].startswith("killed rank") for k in killed)
            row["second"] += len(r["kills"]) > 1
            rl = r.get("rl", "grpo")
            row["in_rl"] += sum(any(x.startswith(f"{rl}:") for x in k.get("reached", [])) for k in killed)
            row["mid"] = row.get("mid", 0) + sum(mid_steps(k, rl, r.get("steps", 4)) for k in killed)
            row["outcomes"][r["outcome"]] = row["outcomes"].get(r["outcome"], 0) + 1
    print("| config | stage cache | clock from | trials | kills (group / driver) | 2nd kill | kills in the RL stage "
          "| of them mid-steps | outcomes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (config, cache, clock), r in sorted(rows.items()):
        outs = ", ".join(f"{k} {v}" for k, v in sorted(r["outcomes"].items()))
        ranks = r.get("rank", 0)
        split = f"{r['group']} / {r['kills'] - r['group'] - ranks}" + (f" / one rank {ranks}" if ranks else "")
        print(f"| {config} | {cache} | {clock} | {r['trials']} | {r['kills']} ({split}) "
              f"| {r['second']} | {r['in_rl']} | {r['mid']} | {outs} |")


def parse_opts():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cluster", default="inline")
    ap.add_argument("--buffer", default="queue")
    ap.add_argument("--sync-offset", type=int, default=0)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--second-kill", type=float, default=0.3, help="chance of a second kill, during the resume")
    ap.add_argument("--group-frac", type=float, default=0.5, help="chance a kill takes the process group")
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="default", help="what runs (LAYOUTS)")
    ap.add_argument("--rank-frac", type=float, default=0.0,
                    help="chance a kill takes one trainer rank alone (trainer=fsdp2), not the driver or group")
    ap.add_argument("--full-warmup", action="store_true",
                    help="the default's warm-up (400 steps) rather than TINY's 12, after which every reward is 0")
    ap.add_argument("--steps", type=int, default=None, help="the RL stage's steps (TINY: 4)")
    ap.add_argument("--ranks", type=int, default=2, help="the trainer's ranks (--rank-frac picks one)")
    ap.add_argument("--stage-cache", choices=["warm", "own"], default="warm",
                    help="warm: one stage cache the reference filled (the warm-up is copied from it); "
                         "own: each trial's own, empty (the warm-up runs, and is killed, too)")
    ap.add_argument("--span", type=float, default=1.5,
                    help="kill at U(0, span x T): the machine's load makes a run slower than its timing")
    ap.add_argument("--clock-from", default=None,
                    help="a path in the run's directory (grpo: the RL stage's; {rl}: the layout's last stage's): "
                         "T and the kill's clock start when it appears, so the kills fall in that part of the run")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("extra", nargs="*", help="more overrides")
    return ap.parse_args()


def reference(opts, out: Path, args: list[str], cache: Path) -> tuple[dict, float]:
    """The reference run's outputs (it fills the warm stage cache) and T: an uninterrupted run as
    the trials run it, timed (from `--clock-from`'s path), and checked against the reference too."""
    ref_root = out / "reference"
    if not (ref_root / "done.json").exists():
        ref_root.mkdir(parents=True, exist_ok=True)
        ref_args = [a for a in args if not a.startswith("stage_cache_dir=")] + [f"stage_cache_dir={cache}"]
        proc = start(ref_args, ref_root, ref_root / "final.log")
        assert proc.wait() == 0, (ref_root / "final.log").read_text()[-3000:]
        sweep(ref_root)
        (ref_root / "done.json").write_text("{}")
    ref = outputs(ref_root / "rft" / "k")
    calib = out / f"uninterrupted-{opts.stage_cache}-{(opts.clock_from or 'start').replace('/', '_')}"
    if not (calib / "done.json").exists():
        calib.mkdir(exist_ok=True)
        proc = start(args, calib, calib / "final.log")
        seconds = timed(proc, opts.clock_from and calib / "rft" / "k" / opts.clock_from)
        sweep(calib)
        diffs = compare(ref, outputs(calib / "rft" / "k"))
        assert not diffs, f"an uninterrupted run differs from the reference: {diffs}"
        (calib / "done.json").write_text(json.dumps({"seconds": seconds}))
    return ref, json.loads((calib / "done.json").read_text())["seconds"]


def judge(rec: dict, ref: dict, root: Path) -> None:
    if rec["exit"] is None:
        rec["outcome"] = "hung"
    elif rec["exit"] != 0:
        rec["outcome"] = "failed"
        rec["tail"] = (root / "final.log").read_text()[-1500:]
    else:
        diffs = compare(ref, outputs(root / "rft" / "k"))
        rec["outcome"] = "differs" if diffs else "same"
        if diffs:
            rec["diffs"] = diffs
    if rec.get("leftover"):
        rec["outcome"] += "+leftover"


def main():
    if sys.argv[1:2] == ["--summary"]:
        return summary(Path(sys.argv[2]))
    opts = parse_opts()
    overrides, rl = LAYOUTS[opts.layout]
    if opts.clock_from:
        opts.clock_from = opts.clock_from.format(rl=rl)
    tag = f"{opts.cluster}-{opts.buffer}-off{opts.sync_offset}" + ("" if opts.layout == "default" else f"-{opts.layout}")
    tiny = TINY
    if opts.full_warmup:  # the default's own warm-up (400 SFT steps: rewards above 0 in the RL stage)
        tiny = [a for a in tiny if not a.startswith("stages.0.")]
        tag += "-w400"
    if opts.steps:
        tiny = [a for a in tiny if not a.startswith("buffer.total_steps=")] + [f"buffer.total_steps={opts.steps}"]
        tag += f"-steps{opts.steps}"
    if opts.extra:  # another run, another reference: the overrides in the tag
        tag += "-" + "-".join(a.replace("=", "").replace("/", "_") for a in opts.extra)
    out = opts.out / tag
    out.mkdir(parents=True, exist_ok=True)
    cache = opts.out / "stage_cache"
    args = [*tiny, f"cluster={opts.cluster}", f"buffer={opts.buffer}", f"synchronizer.sync_offset={opts.sync_offset}",
            "name=k", *overrides, *opts.extra, *([f"stage_cache_dir={cache}"] if opts.stage_cache == "warm" else [])]
    ref, t_ref = reference(opts, out, args, cache)
    rng = random.Random(opts.seed)
    with open(out / "trials.jsonl", "a") as log:
        for i in range(opts.trials):
            root = out / f"t{opts.seed}-{i}-{opts.stage_cache}-{(opts.clock_from or 'start').replace('/', '_')}"
            root.mkdir()
            t0 = time.time()
            rec = run_trial(args, root, t_ref, rng, opts)
            rec.update(config=tag, rl=rl, steps=opts.steps or 4, cache=opts.stage_cache, clock_from=opts.clock_from, trial=i,
                       t_ref=round(t_ref, 1), seconds=round(time.time() - t0, 1))
            judge(rec, ref, root)
            print(json.dumps({k: v for k, v in rec.items() if k != "tail"}), flush=True)
            log.write(json.dumps(rec) + "\n")
            log.flush()


if __name__ == "__main__":
    main()
