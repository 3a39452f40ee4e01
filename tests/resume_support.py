"""What tests/test_resume_matrix.py and tests/test_resume_kills.py share: a short run from the
session's SFT warm start run straight, SIGKILLed (at a checkpoint, or by itself in the middle of a step
through a sitecustomize the process runs first: rft has no fault hooks of its own) and run again, and
the comparison of everything the two runs leave (check_resumes). The straight run runs in the test's
process (run_here); the killed and the resumed run each in a process of its own (launch)."""

import atexit
import json
import os
import select
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


# The killed and resumed runs of an inline case: each a process of its own, forked from a process
# that imported what every run imports first and nothing else (torch, transformers with peft,
# datasets: ~4 of a short run's ~5 CPU seconds), never anything of rft's, never run anything: rft
# starts afresh in each, from `python run.py <args>`'s own code (runpy), its argv, environment and
# working directory. Its stdin takes one job a line; it answers the child's pid, then its exit status.
FORKER = """
import json, os, runpy, sys
import datasets, torch, transformers.optimization  # noqa: F401
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.chdir(job["cwd"])
        os.environ.clear()
        os.environ.update(job["env"])
        for fd, path in ((0, os.devnull), (1, job["out"]), (2, job["err"])):
            f = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
            os.dup2(f, fd)
            os.close(f)
        sys.argv = [job["script"], *job["args"]]
        sys.path[0] = os.path.dirname(job["script"])  # then PYTHONPATH's, as an interpreter puts them
        sys.path[1:1] = [p for p in job["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        if job["hook"]:  # a sitecustomize, which a fresh interpreter would have imported first
            exec(compile(open(job["hook"]).read(), job["hook"], "exec"), {"__name__": "sitecustomize"})
        runpy.run_path(job["script"], run_name="__main__")
        sys.exit(0)  # as the interpreter ends after run.py: atexit handlers, then exit
    print(pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


class Forked:
    """A run forked by the forker: `pid`, `poll()` and `wait()` as subprocess.Popen's."""

    forker = None
    last = None  # the run forked last: its exit status is the forker's next line, before another's pid

    def __init__(self, args, env, out: Path, hook: Path | None = None):
        self._submit(dict(script=str(ROOT / "run.py"), args=list(args), env=dict(env), cwd=str(ROOT),
                          out=str(out.with_suffix(".out")), err=str(out.with_suffix(".err")), hook=hook and str(hook)))

    def _submit(self, job: dict) -> None:
        if Forked.forker is None or Forked.forker.poll() is not None:
            Forked.forker = subprocess.Popen([sys.executable, "-c", FORKER], stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, text=True, cwd=ROOT)
            atexit.register(Forked.forker.stdin.close)  # its loop ends, and it with it
            Forked.last = None
        elif Forked.last is not None and Forked.last.poll() is None:
            # a run a failed test left running (kill_when's assertion): ended and its status read, or
            # the next pid read would be its exit status, 0, and os.kill(0, ...) the whole pytest group
            os.kill(Forked.last.pid, signal.SIGKILL)
            Forked.last.poll(60)
        self.returncode = None
        Forked.forker.stdin.write(json.dumps(job) + "\n")
        Forked.forker.stdin.flush()
        self.pid = int(Forked.forker.stdout.readline())
        assert self.pid > 0, self.pid
        Forked.last = self

    def poll(self, timeout: float = 0):
        if self.returncode is None and select.select([Forked.forker.stdout], [], [], timeout)[0]:
            self.returncode = int(Forked.forker.stdout.readline())
        return self.returncode

    def wait(self, timeout: float = 600):
        if self.poll(timeout) is None:
            os.kill(self.pid, signal.SIGKILL)  # as subprocess.run's timeout, which kills the child
            self.poll(60)
            raise AssertionError(f"run.py (pid {self.pid}) still running after {timeout} s: killed")
        return self.returncode


def inline(args) -> bool:
    return compose_cfg(args).cluster.backend == "inline"


def launch(args, env, out: Path, hook: Path | None = None):
    """`python run.py <args>`, its output in <out>.out and <out>.err: forked (Forked) where the run
    is inline, else in a fresh interpreter (Ray's processes are its children)."""
    if inline(args):
        return Forked(args, env, out, hook)
    if hook:
        env = {**env, "PYTHONPATH": os.pathsep.join([str(hook.parent), str(ROOT)])}
    with open(out.with_suffix(".out"), "w") as stdout, open(out.with_suffix(".err"), "w") as stderr:
        return subprocess.Popen([sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT, env=env, stdout=stdout,
                                stderr=stderr)


def run_to_end(args, env, out: Path, hook: Path | None = None):
    """`python run.py <args>` run to its end: `returncode`, `stdout` and `stderr` as subprocess.run's."""
    proc = launch(args, env, out, hook)
    proc.wait(timeout=600)
    proc.stdout, proc.stderr = out.with_suffix(".out").read_text(), out.with_suffix(".err").read_text()
    return proc


def kill_when(args, env, ready, out: Path, timeout: float = 300) -> None:
    """`python run.py <args>`, SIGKILLed as soon as `ready()`; fails if the run ends first."""
    proc = launch(args, env, out)
    deadline = time.time() + timeout
    while not ready():
        if proc.poll() is not None or time.time() >= deadline:
            if proc.poll() is None:  # not left running for the next test (nor its status for Forked's next pid)
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
            err = out.with_suffix(".err").read_text()[-3000:] if out.with_suffix(".err").exists() else ""
            raise AssertionError(f"the run ended (or ran past {timeout} s) before the point of its kill:\n{err}")
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
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
    proc = run_to_end(args, {**env, "KILL_AFTER_PUT": str(n)}, tmp_path / "killed_run", hook / "sitecustomize.py")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]


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
        kill_when(args("killed"), env, at_checkpoint(b, 2), tmp_path / "killed_run")
    assert (b / "checkpoints" / "step_2").exists() and not (b / "checkpoints" / "step_4").exists(), \
        "killed too late to test anything"
    resumed = run_to_end(args("killed"), env, tmp_path / "resumed_run")
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


def forked_to_end(args, env, out: Path):
    """`python run.py <args>` run to its end in a forked process (Forked), as run_to_end, whatever its
    cluster: for a run that starts no Ray (mode=bench evaluates in its own process, a dry run, a
    configuration error), where a fresh interpreter would add only its imports. A Ray run gains
    nothing here (measured): its driver imports no torch, and a configuration error before Ray
    starts neither (the datasets are read in a child process)."""
    proc = Forked(args, env, out)
    proc.wait(timeout=600)
    proc.stdout, proc.stderr = out.with_suffix(".out").read_text(), out.with_suffix(".err").read_text()
    return proc


class ForkedScript(Forked):
    """`python <script> <args>` for a script of the repository other than run.py (an experiment's),
    forked by the same forker as Forked: `pid`, `poll()` and `wait()` as Forked's."""

    def __init__(self, script: Path, args, env, out: Path):
        self._submit(dict(script=str(script), args=list(args), env=dict(env), cwd=str(ROOT),
                          out=str(out.with_suffix(".out")), err=str(out.with_suffix(".err")), hook=None))


def script_to_end(script: Path, args, out: Path, env=None, timeout: float = 900):
    """`python <script> <args>` (ForkedScript) run to its end, in the repository's root: `returncode`,
    `stdout` and `stderr` as subprocess.run's."""
    proc = ForkedScript(script, args, {**os.environ, **(env or {})}, out)
    proc.wait(timeout=timeout)
    proc.stdout, proc.stderr = out.with_suffix(".out").read_text(), out.with_suffix(".err").read_text()
    return proc
