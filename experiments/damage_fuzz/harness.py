"""Damage every file a run reads back, one damage at a time, resume, and classify what the run did.

A template run (the default's two stages, the warm-up cut to 100 steps, GRPO 2 steps with a
checkpoint after each, cluster=inline) is made once; each case copies it, damages one file and
runs the same command with buffer.total_steps=3 (a resume that lengthens the RL stage, so the
newest checkpoint's trainer_state.pt is read too). A stage-cache file is damaged under a fresh
run name instead (the only run that reads the cache). The outcome is compared with resuming an
undamaged copy:

  a  detected: the run named the damage and set it aside, or stopped with one paragraph
  b  harmless: exit 0, the same result, nothing said (the file is not read, or is rewritten)
  c  SILENT:   exit 0 with another result than the undamaged resume
  d  hang:     still running after --timeout seconds
  e  raw traceback

    python experiments/damage_fuzz/harness.py --work <scratch dir> --buffer sql --jobs 2

Results are appended to <work>/results.jsonl (one line a case); --table prints the table.
"""

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DAMAGES = ["flip", "truncate", "append", "empty", "other_step", "delete", "link_zero", "fifo", "dir"]
# files a run may find beside the ones the template holds: SQLite's journals, a file added to a
# sealed checkpoint, a stage-cache entry's
EXTRA = ["grpo/buffer.db-wal", "grpo/buffer.db-journal", "grpo/checkpoints/step_2/extra.bin"]
# what a run says of a damage it saw (compared lower case)
SAID = ("damaged", "set aside", "moved aside", "warning", "is not", "not read", "has no", "cut")


EXTRA_ARGS: list[str] = []  # --extra: more overrides, the same for every run of the study


def base_args(buffer: str, root: Path, name: str, steps: int) -> list[str]:
    return [*EXTRA_ARGS, "cluster=inline", "monitor=console", f"buffer={buffer}", "buffer.batch_size=4",
            "algorithm.repeat_times=4", "trainer.save_interval=1", "explorer.eval_interval=2",
            "explorer.eval_on_startup=false", "stages.0.buffer.total_steps=100",
            "+stages.0.trainer.save_interval=50", f"checkpoint_root_dir={root}", f"name={name}",
            f"buffer.total_steps={steps}"]


def run(args: list[str], timeout: float) -> tuple[int | str, str]:
    """The command in a fresh process (a hang must be killable); its exit code and output."""
    cmd = [sys.executable, str(ROOT / "run.py"), *args]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        out, _ = p.communicate()
        return "timeout", out


def result(run_dir: Path, step: int) -> dict:
    """What a resume produced: the final weights' tensors and the step's batch and reward."""
    from safetensors.torch import load_file
    out = {}
    hf = run_dir / "grpo" / "checkpoints" / f"step_{step}" / "hf" / "model.safetensors"
    if hf.is_file() and not hf.is_symlink():
        t = load_file(hf)
        h = hashlib.sha256()
        for k in sorted(t):
            h.update(k.encode() + t[k].float().numpy().tobytes())
        out["weights"] = h.hexdigest()[:16]
    for name, key in (("batches.jsonl", "digest"), ("metrics.jsonl", "reward/mean")):
        f = run_dir / "grpo" / name
        try:
            lines = f.read_text(errors="replace").splitlines()
        except OSError as e:
            out[name] = f"unreadable: {type(e).__name__}"
            continue
        rows = []
        for line in lines:  # a damaged line the run warned of and kept is not the run's result
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass
        out[name] = [r.get(key) for r in rows if isinstance(r, dict) and r.get("step") == step]
    return out


def damage(path: Path, how: str, rng: random.Random, other: Path | None) -> str | None:
    """Apply one damage; None where it does not apply (a note of why otherwise)."""
    exists = path.exists() or path.is_symlink()
    if how in ("flip", "truncate", "empty", "delete", "other_step", "dir") and not exists:
        return "n/a"
    if how == "flip":
        data = bytearray(path.read_bytes())
        if not data:
            return "n/a"
        i = rng.randrange(len(data))
        data[i] ^= rng.randrange(1, 256)
        path.write_bytes(bytes(data))
        return f"byte {i}"
    if how == "truncate":
        size = path.stat().st_size
        if size == 0:
            return "n/a"
        n = rng.randrange(size)
        os.truncate(path, n)
        return f"to {n} of {size}"
    if how == "append":
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as f:
            f.write(bytes(rng.randrange(256) for _ in range(64)))
        return "64 bytes"
    if how == "empty":
        path.write_bytes(b"")
        return ""
    if how == "other_step":
        if other is None or not other.is_file():
            return "n/a"
        if path.read_bytes() == other.read_bytes():
            return "n/a"
        shutil.copyfile(other, path)
        return str(other.name)
    if how == "delete":
        path.unlink()
        return ""
    path.parent.mkdir(parents=True, exist_ok=True)
    if exists:
        path.unlink()
    if how == "dir":  # a folder (holding a file) where the run wrote a file
        path.mkdir()
        (path / "x").write_text("x")
        return ""
    if how == "link_zero":
        path.symlink_to("/dev/zero")
    else:
        os.mkfifo(path)
    return ""


def other_of(template: Path, short: Path, rel: str) -> Path | None:
    """The same file from another step: the other checkpoint of the stage, else the 1-step run's."""
    parts = rel.split("/")
    for i, p in enumerate(parts):
        if p.startswith("step_") and p[5:].isdigit():
            choices = {"grpo": {"1": "2", "2": "1"}, "sft_warmup": {"100": "50", "50": "100"}}
            swap = choices.get(parts[0], {}).get(p[5:])
            return template / "/".join([*parts[:i], f"step_{swap}", *parts[i + 1:]]) if swap else None
    return short / rel


def cases(template: Path) -> list[str]:
    """Every file the template run left, bar the warm-up's checkpoints other than its last two."""
    run_dir = template / "rft" / "t"
    files = []
    for f in sorted(run_dir.rglob("*")):
        rel = f.relative_to(run_dir).as_posix()
        if f.is_dir() or (rel.startswith("sft_warmup/checkpoints/") and
                          not rel.startswith(("sft_warmup/checkpoints/step_100/", "sft_warmup/checkpoints/step_50/"))):
            continue
        files.append(rel)
    files += [e for e in EXTRA if e not in files]
    cache = template / "rft" / "stage_cache"
    files += ["@cache/" + f.relative_to(cache).as_posix() for f in sorted(cache.rglob("*")) if f.is_file()]
    return files


def one(work: Path, buffer: str, rel: str, how: str, seed: int, timeout: float, ref: dict) -> dict:
    rng = random.Random(f"{seed}/{rel}/{how}")
    case = work / "cases" / hashlib.sha1(f"{rel}/{how}".encode()).hexdigest()[:10]
    shutil.rmtree(case, ignore_errors=True)
    shutil.copytree(work / "template", case, symlinks=True)
    fresh = rel.startswith("@cache/")
    if fresh:
        key = rel[len("@cache/"):]
        target = case / "rft" / "stage_cache" / key
        other = None
        if key.endswith(("checkpoint/state.json", "checkpoint/trainer_state.pt", "checkpoint/manifest.json")):
            other = work / "template" / "rft" / "t" / "sft_warmup" / "checkpoints" / "step_50" / Path(key).name
        elif "/checkpoint/hf/" in key:
            other = work / "template" / "rft" / "t" / "sft_warmup" / "checkpoints" / "step_50" / "hf" / Path(key).name
    else:
        target = case / "rft" / "t" / rel
        other = other_of(work / "template" / "rft" / "t", work / "short" / "rft" / "t", rel)
    note = damage(target, how, rng, other)
    row = {"file": rel, "damage": how, "note": note}
    if note == "n/a":
        row["outcome"] = "n/a"
        shutil.rmtree(case, ignore_errors=True)
        return row
    name, steps = ("fresh", 2) if fresh else ("t", 3)
    t0 = time.time()
    rc, out = run(base_args(buffer, case, name, steps), timeout)
    row["seconds"] = round(time.time() - t0, 1)
    row["rc"] = rc
    got = result(case / "rft" / name, steps)
    want = [ref["fresh"]] if fresh else [ref["resume"], ref["whole"]]
    if rc == "timeout":
        outcome = "d"
    elif rc != 0:
        outcome = "e" if "Traceback (most recent call last)" in out else "a"
    elif got not in want:
        outcome = "c"
        row["got"], row["want"] = got, want
    else:
        outcome = "a" if any(w in out.lower() for w in SAID) else "b"
    row["outcome"] = outcome
    # all but the progress lines every run prints
    row["said"] = [line for line in out.splitlines() if line.strip() and not line.startswith(
        ("[sft_warmup] step", "[grpo] step", "[grpo] eval accuracy", "outputs:", "[sft_warmup] already"))][:6]
    if outcome in "cde":
        (work / "logs").mkdir(exist_ok=True)
        (work / "logs" / f"{case.name}.log").write_text(f"{rel} {how} {note}\n{out}")
    shutil.rmtree(case, ignore_errors=True)
    return row


def reference(work: Path, buffer: str, key: str, name: str, steps: int, timeout: float, fresh_stage=False):
    case = work / f"ref_{key}"
    shutil.rmtree(case, ignore_errors=True)
    shutil.copytree(work / "template", case, symlinks=True)
    if fresh_stage:
        shutil.rmtree(case / "rft" / "t" / "grpo")
    rc, out = run(base_args(buffer, case, name, steps), timeout)
    assert rc == 0, out
    return result(case / "rft" / name, steps)


def prepare(work: Path, buffer: str, timeout: float) -> dict:
    """The template (2 steps), the 1-step run (other steps' files) and the undamaged references."""
    ref_file = work / "reference.json"
    ref = json.loads(ref_file.read_text()) if ref_file.exists() else {}
    if not ref:
        for name, steps in (("template", 2), ("short", 1)):
            rc, out = run(base_args(buffer, work / name, "t", steps), 900)
            assert rc == 0, out
        ref["resume"] = reference(work, buffer, "resume", "t", 3, timeout)
        ref["fresh"] = reference(work, buffer, "fresh", "fresh", 2, timeout)
        assert ref["fresh"] == result(work / "template" / "rft" / "t", 2), "a fresh run from the cache differs"
    if "whole" not in ref:
        # a fallback to step 1 redoes steps 2 and 3 as a run of 3 steps does: with sync_offset > 0
        # its step 3 is explored on the weights of step 1 (ahead), where the undamaged resume of a
        # 2-step run, which explored nothing ahead, explores it on those of step 2
        ref["whole"] = reference(work, buffer, "whole", "t", 3, timeout, fresh_stage=True)
    ref_file.write_text(json.dumps(ref))
    return ref


def table(work: Path) -> str:
    rows = [json.loads(line) for line in (work / "results.jsonl").read_text().splitlines()]
    cells: dict[str, dict[str, str]] = {}
    for r in rows:
        cells.setdefault(r["file"], {})[r["damage"]] = r["outcome"]
    head = "| file | " + " | ".join(DAMAGES) + " |\n|---|" + "---|" * len(DAMAGES) + "\n"
    return head + "".join(f"| {f} | " + " | ".join(c.get(d, "") for d in DAMAGES) + " |\n"
                          for f, c in cells.items())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--buffer", default="sql", choices=["sql", "file"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--only", default="", help="run only files containing one of these (comma-separated)")
    ap.add_argument("--damages", default=",".join(DAMAGES))
    ap.add_argument("--table", action="store_true")
    ap.add_argument("--extra", default="", help="more overrides, space-separated (synchronizer.sync_offset=1)")
    a = ap.parse_args()
    EXTRA_ARGS[:] = a.extra.split()
    a.work.mkdir(parents=True, exist_ok=True)
    if a.table:
        print(table(a.work))
        return
    ref = prepare(a.work, a.buffer, a.timeout)
    done = set()
    res = a.work / "results.jsonl"
    if res.exists():
        done = {(r["file"], r["damage"]) for r in map(json.loads, res.read_text().splitlines())}
    files = [f for f in cases(a.work / "template") if any(o in f for o in a.only.split(","))]
    damages = a.damages.split(",")
    # round robin: every file gets one damage (rotated) before any gets a second
    todo = [(f, damages[(i + k) % len(damages)]) for k in range(len(damages)) for i, f in enumerate(files)]
    todo = [t for t in todo if t not in done]
    with ThreadPoolExecutor(a.jobs) as pool:
        for row in pool.map(lambda t: one(a.work, a.buffer, t[0], t[1], a.seed, a.timeout, ref), todo):
            with open(res, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(row["outcome"], row["file"], row["damage"], row.get("note"), row.get("said", "")[:1], flush=True)


if __name__ == "__main__":
    main()
