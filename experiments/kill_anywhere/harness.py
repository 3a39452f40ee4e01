"""SIGKILL anywhere: a tiny run killed at a uniformly random moment (sometimes once more during its
resume), then run again to its end, against the same run uninterrupted.

    python experiments/kill_anywhere/harness.py --cluster inline --buffer queue --trials 10 --out <dir>

Each trial: `python run.py <args>` started in a process group of its own, killed with SIGKILL at
U(0, 1.5 T) seconds (T: the uninterrupted run's wall time; a kill after the end is none), the whole group (a crash of the machine's
session: Ray's children too) or the driver alone; with probability --second-kill its resume is
killed the same way; then the same command runs to its end. The trial's outcome:

  same      final weights (hf/*.safetensors bytes), metrics.jsonl (its wall-clock figures left out)
            and batches.jsonl of every stage equal the reference's
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
        digest = hashlib.sha256()
        for f in sorted(last.glob("hf/*.safetensors")) if last else []:
            digest.update(f.read_bytes())
        out[stage.name] = {"last": last and last.name, "weights": digest.hexdigest(),
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


def kill_at(proc: subprocess.Popen, at: float, group: bool, clock: Path | None = None) -> str:
    """SIGKILL `proc` (its process group, or it alone) `at` seconds after its start (after `clock`
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
        proc = start(args, root, root / f"killed{attempt}.log")
        what = kill_at(proc, at, group, opts.clock_from and root / "rft" / "k" / opts.clock_from)
        kills.append({"at": round(at, 2), "group": group, "result": what, "reached": reached(root)})
        if what == "killed":
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


def summary(out: Path) -> None:
    """The table of every trials.jsonl under `out`: per config, trials, kills and where they fell, outcomes."""
    rows = {}
    for f in sorted(out.glob("*/trials.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            key = (r["config"], r.get("cache", "warm"), r.get("clock_from") or "start")
            row = rows.setdefault(key, {"trials": 0, "kills": 0, "group": 0, "second": 0, "in_rl": 0, "outcomes": {}})
            row["trials"] += 1
            killed = [k for k in r["kills"] if k["result"] == "killed"]
            row["kills"] += len(killed)
            row["group"] += sum(k["group"] for k in killed)
            row["second"] += len(r["kills"]) > 1
            row["in_rl"] += sum(any(x.startswith("grpo:") for x in k.get("reached", [])) for k in killed)
            row["outcomes"][r["outcome"]] = row["outcomes"].get(r["outcome"], 0) + 1
    print("| config | stage cache | clock from | trials | kills (group / driver) | 2nd kill | kills in the GRPO stage | outcomes |")
    print("|---|---|---|---|---|---|---|---|")
    for (config, cache, clock), r in sorted(rows.items()):
        outs = ", ".join(f"{k} {v}" for k, v in sorted(r["outcomes"].items()))
        print(f"| {config} | {cache} | {clock} | {r['trials']} | {r['kills']} ({r['group']} / {r['kills'] - r['group']}) "
              f"| {r['second']} | {r['in_rl']} | {outs} |")


def parse_opts():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cluster", default="inline")
    ap.add_argument("--buffer", default="queue")
    ap.add_argument("--sync-offset", type=int, default=0)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--second-kill", type=float, default=0.3, help="chance of a second kill, during the resume")
    ap.add_argument("--group-frac", type=float, default=0.5, help="chance a kill takes the process group")
    ap.add_argument("--stage-cache", choices=["warm", "own"], default="warm",
                    help="warm: one stage cache the reference filled (the warm-up is copied from it); "
                         "own: each trial's own, empty (the warm-up runs, and is killed, too)")
    ap.add_argument("--span", type=float, default=1.5,
                    help="kill at U(0, span x T): the machine's load makes a run slower than its timing")
    ap.add_argument("--clock-from", default=None,
                    help="a path in the run's directory (grpo: the RL stage's): T and the kill's clock start "
                         "when it appears, so the kills fall in that part of the run")
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
    tag = f"{opts.cluster}-{opts.buffer}-off{opts.sync_offset}"
    out = opts.out / tag
    out.mkdir(parents=True, exist_ok=True)
    cache = opts.out / "stage_cache"
    args = [*TINY, f"cluster={opts.cluster}", f"buffer={opts.buffer}", f"synchronizer.sync_offset={opts.sync_offset}",
            "name=k", *opts.extra, *([f"stage_cache_dir={cache}"] if opts.stage_cache == "warm" else [])]
    ref, t_ref = reference(opts, out, args, cache)
    rng = random.Random(opts.seed)
    with open(out / "trials.jsonl", "a") as log:
        for i in range(opts.trials):
            root = out / f"t{opts.seed}-{i}-{opts.stage_cache}-{(opts.clock_from or 'start').replace('/', '_')}"
            root.mkdir()
            t0 = time.time()
            rec = run_trial(args, root, t_ref, rng, opts)
            rec.update(config=tag, cache=opts.stage_cache, clock_from=opts.clock_from, trial=i,
                       t_ref=round(t_ref, 1), seconds=round(time.time() - t0, 1))
            judge(rec, ref, root)
            print(json.dumps({k: v for k, v in rec.items() if k != "tail"}), flush=True)
            log.write(json.dumps(rec) + "\n")
            log.flush()


if __name__ == "__main__":
    main()
