"""What tests/test_resume_matrix.py and tests/test_resume_kills.py share: a short run from the
session's SFT warm start run straight, SIGKILLed (at a checkpoint, or by itself in the middle of a step
through a sitecustomize on its PYTHONPATH: rft has no fault hooks of its own) and run again, and the
comparison of everything the two runs leave (check_resumes)."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import torch
from conftest import ROOT, compose_cfg, run_cli
from safetensors.torch import load_file

import rft.runtime.main
from rft.data.buffer import EXPERIENCES_FILE, unpack_experiences
from rft.reporting.monitor import read_metrics

# wall-clock and process figures differ between two processes
VOLATILE = ("timing/", "tokens_per_s", "perf/tflops", "perf/mfu", "max_memory_gb", "rollout/partial_s")

SHORT = ["stages=[]", "cluster=inline", "monitor=console", "buffer.total_steps=4", "trainer.save_interval=2",
         "buffer.batch_size=4", "algorithm.repeat_times=4", "explorer.eval_interval=100",
         "explorer.eval_on_startup=false"]
NO_EVAL = ["buffer.explorer_input.eval_tasksets=[]"]


def stable(obj):
    """`obj` without its wall-clock figures, at any depth."""
    if isinstance(obj, dict):
        return {k: stable(v) for k, v in obj.items() if not (k.startswith(VOLATILE) or k.endswith(VOLATILE))}
    if isinstance(obj, list):
        return [stable(v) for v in obj]
    return obj


def same(a, b, where="") -> None:
    """Two loaded trainer states equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, set(a) ^ set(b))
        for k in a:
            same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}/{i}")
    else:
        assert a == b, (where, a, b)


def weights(ckpt: Path) -> dict:
    files = sorted((ckpt / "hf").glob("*.safetensors")) + sorted((ckpt / "adapter").glob("*.safetensors"))
    assert files, ckpt
    out = {}
    for f in files:
        out.update({f"{f.parent.name}/{k}": v for k, v in load_file(f).items()})
    return out


def run_here(args, root: Path) -> None:
    """`python run.py <args>` with RFT_CHECKPOINT_ROOT_DIR=<root>, for the files it writes (a reference
    run, a buffer to read): in this process where the run is (cluster=inline; the same files bit for
    bit), which saves a fresh interpreter's imports (~4 s of the ~5 s a short run takes); a run of
    Ray actors in a process of its own. What a test checks of the command itself (its exit, its
    words, a kill and the resume after it) stays in a fresh process: a resume is a new process
    reading what the killed one left."""
    cfg = compose_cfg([*args, f"checkpoint_root_dir={root}"])
    if cfg.cluster.backend != "inline":
        r = run_cli(*args, env={"RFT_CHECKPOINT_ROOT_DIR": str(root)})
        assert r.returncode == 0, r.stderr[-3000:]
        return
    rft.runtime.main.main(cfg)


def launch(args, env):
    return subprocess.Popen([sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def kill_when(args, env, ready, timeout: float = 300) -> None:
    """`python run.py <args>`, SIGKILLed as soon as `ready()`; fails if the run ends first."""
    proc = launch(args, env)
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None and time.time() < deadline, "the run ended before the point of its kill"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL


def at_checkpoint(run: Path, step: int):
    return lambda: (run / "checkpoints" / f"step_{step}" / "state.json").exists()


# the run kills itself (SIGKILL) the moment its buffer has taken its KILL_AFTER_PUT-th write of
# experiences: an explore step's experiences are in, the checkpoint that would account for them is not
KILL_AFTER_PUT = """
import os, sys
if sys.argv and sys.argv[0].endswith("run.py") and os.environ.get("KILL_AFTER_PUT"):
    import rft.data.buffer as b
    calls = [0]
    def hooked(put):
        def wrapper(self, exps):
            put(self, exps)
            calls[0] += 1
            if calls[0] == int(os.environ["KILL_AFTER_PUT"]):
                os.kill(os.getpid(), 9)
        return wrapper
    for cls in (b.QueueBuffer, b.SQLBuffer, b.FileBuffer):
        cls.put = hooked(cls.put)
"""


def killed_after_put(args, env, tmp_path: Path, n: int) -> None:
    """`python run.py <args>`, killed by itself once its buffer has taken `n` writes."""
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(KILL_AFTER_PUT)
    env = {**env, "KILL_AFTER_PUT": str(n), "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT)])}
    r = subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]


def same_sql_buffer(a: Path, b: Path, sa: dict, sb: dict) -> None:
    """A SQLite buffer's ids are AUTOINCREMENT, never reused (rft/data/buffer.py: a row written
    after a truncation must land above every reader's cursor), so the rows a resume dropped and
    wrote again have new ids: its positions are the uninterrupted run's plus the rows dropped. The
    nearest exact property: the same rows in the same order (but their ids and write times), and
    the same read position among them."""
    def rows(run):
        with sqlite3.connect(f"file:{run / 'buffer.db'}?mode=ro", uri=True) as db:
            db.row_factory = sqlite3.Row
            return [{k: r[k] for k in r.keys() if k not in ("id", "created_at")}
                    for r in db.execute("select * from experiences order by id")]

    assert rows(a) == rows(b) and len(rows(a)) == sa["last_id"]
    shift = sb["last_id"] - sa["last_id"]
    assert shift > 0  # the rows the resume dropped (explore step 2's: 16)
    assert sb["cursor"] - shift == sa["cursor"] and sa.keys() == sb.keys()


def check_resumes(tmp_path: Path, warm_start: Path | None, extra: list[str], after_put: int | None = None,
                   stage: str = "", short=SHORT) -> tuple[list, dict]:
    """Straight, killed, then resumed: the same result. Killed once its step-2 checkpoint is
    written, or (`after_put`) once its buffer has taken that many writes. `warm_start`: the model
    the run starts from (None: the config's own); `stage`: the stage of the run checked (none: a
    run of one stage). Returns the straight run's metrics and final state.json."""
    env = {**os.environ, "RFT_CHECKPOINT_ROOT_DIR": str(tmp_path)}
    model = [f"model.model_path={warm_start}", "model.builder=null"] if warm_start else []

    def args(name):
        evals = any(x.startswith(("explorer.eval_interval=", "experiment=")) for x in extra)
        groups = {x.split("=")[0] for x in extra}  # a group the case chooses replaces SHORT's
        return [*(x for x in short if x.split("=")[0] not in groups), *([] if evals else NO_EVAL), *model, *extra,
                f"name={name}"]

    run_here(args("straight"), tmp_path)
    a, b = tmp_path / "rft" / "straight" / stage, tmp_path / "rft" / "killed" / stage
    if after_put:
        killed_after_put(args("killed"), env, tmp_path, after_put)
    else:
        kill_when(args("killed"), env, at_checkpoint(b, 2))
    assert (b / "checkpoints" / "step_2").exists() and not (b / "checkpoints" / "step_4").exists(), \
        "killed too late to test anything"
    resumed = run_cli(*args("killed"), env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from step 2" in resumed.stdout, resumed.stdout[-2000:]

    end_a, end_b = a / "checkpoints" / "step_4", b / "checkpoints" / "step_4"
    wa, wb = weights(end_a), weights(end_b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    # the weights moved after the resume point, so their equality above means something (a LoRA
    # run saving hf/ at its last step only: its adapters)
    mid = weights(b / "checkpoints" / "step_2")
    assert any(not torch.equal(wa[k], mid[k]) for k in wa.keys() & mid.keys())
    # optimizer moments and step counts, scheduler, RNG, version, critic
    same(torch.load(end_a / "trainer_state.pt", weights_only=True),
         torch.load(end_b / "trainer_state.pt", weights_only=True))
    # the schedule's state: buffer position, explored ahead, curriculum, reward statistics, metrics
    sa, sb = (stable(json.loads((d / "state.json").read_text())) for d in (end_a, end_b))
    if (a / "buffer.db").exists():
        same_sql_buffer(a, b, sa.pop("buffer"), sb.pop("buffer"))
    assert sa == sb
    # a queue buffer's experiences (explored ahead, or kept for replay) are in a file beside state.json
    stored = [d / EXPERIENCES_FILE for d in (end_a, end_b)]
    assert stored[0].exists() == stored[1].exists()
    if stored[0].exists():
        ea, eb = ([stable(e.to_dict()) for e in unpack_experiences(p.read_bytes())] for p in stored)
        assert ea == eb
    assert read_metrics(a / "batches.jsonl") == read_metrics(b / "batches.jsonl")
    # the rows before the kill (the killed run's) and after it (the resumed run's)
    ma, mb = read_metrics(a / "metrics.jsonl"), read_metrics(b / "metrics.jsonl")
    assert [m["step"] for m in mb] == [m["step"] for m in ma]
    assert stable(ma) == stable(mb)
    return ma, json.loads((end_a / "state.json").read_text())


def stored_rows(path: Path) -> list[dict]:
    """A sql or file buffer's rows in order, without a SQLite row's id and write time."""
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines()]
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        db.row_factory = sqlite3.Row
        return [{k: r[k] for k in r.keys() if k not in ("id", "created_at")}
                for r in db.execute("select * from experiences order by id")]
