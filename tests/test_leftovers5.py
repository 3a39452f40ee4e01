"""A hung ray.init, what a kill during it leaves, a refused start's run directory, exported files' modes."""

import os
import re
import shlex
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from conftest import ROOT, compose_cfg

from rft.runtime import reaper


def _env() -> dict[str, str]:
    """This environment with RFT_CACHE_DIR (the session's cache) its only RFT_* variable: the resume
    command starts with it (`_prefix`)."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("RFT_")},
            "RFT_CACHE_DIR": os.environ["RFT_CACHE_DIR"]}


def _prefix() -> str:
    return re.escape(f"RFT_CACHE_DIR={shlex.quote(os.environ['RFT_CACHE_DIR'])} ")


# a driver whose ray.init never returns, in the way it hung: blocked in C while holding Python's lock
# (ctypes.PyDLL keeps the GIL through the call), so no thread or signal handler of the driver runs
HUNG_DRIVER = textwrap.dedent("""
    import ctypes, sys
    from pathlib import Path
    sys.path.insert(0, {root!r}); sys.path.insert(0, {root!r} + "/tests")
    from conftest import compose_cfg
    import ray
    from rft.runtime import main
    main.INIT_PROGRESS_S = 1.0
    ray.init = lambda **kw: ctypes.PyDLL(None).sleep(600)
    cfg = compose_cfg(["cluster=local", "cluster.init_timeout_s=5", "checkpoint_root_dir={tmp}"])
    main._start_ray(cfg, Path({tmp!r}))
    print("ray.init returned")
""")


@pytest.mark.slow  # 6.0 s alone, over the fast tier's second
def test_a_ray_init_that_hangs_holding_the_gil_is_stopped_past_init_timeout_s_with_a_paragraph(tmp_path):
    # it waited for ever (20 minutes seen, under memory pressure and a load of 18), printing nothing
    code = HUNG_DRIVER.format(root=str(ROOT), tmp=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=_env())
    assert proc.returncode == -9, proc.stderr[-3000:]  # the reaper's SIGKILL: a shell says 137
    assert "ray.init returned" not in proc.stdout
    # lines from 1 s on, each at twice the time of the one before (1, 2, 4 s: said at the reaper's next
    # look, once a second, so a loaded machine may say 2, 3, 5 or skip one), then the paragraph at 5 s
    lines = [int(n) for n in re.findall(r"^rft: starting Ray\.\.\. \((\d+) s\)$", proc.stderr, re.M)]
    assert lines and lines[0] >= 1 and lines == sorted(set(lines)), proc.stderr
    said = re.search(r"^rft: the run stopped: Ray's local instance did not start: ray\.init waited (\d+) s for its GCS "
                     r"and raylet to answer, past cluster\.init_timeout_s=5, and the driver is stopped \(exit 137\)\. "
                     r"Likely causes: memory or load \(the machine's memory is \d+% in use, [\d.]+ GiB available, its load "
                     r"[\d.]+ on \d+ cores: Ray's processes start slowly, or stall, where either is high\); (.*)"
                     r"Ray's processes of this run are stopped\. Try again when memory and load are lower \(or with "
                     r"a larger cluster\.init_timeout_s where the machine is slow but not stuck; cluster=inline runs "
                     r"without Ray\): Run the same command again to resume \(no checkpoint was saved yet: the run "
                     r"starts over\)\. The command: " + _prefix() + "python -c$", proc.stderr, re.M)
    assert said and int(said[1]) >= 5 and lines[-1] <= int(said[1]), proc.stderr
    assert said[2].endswith("or Ray's session files (/tmp/ray) are on a disk that is full or slow. ")
    assert "Traceback" not in proc.stderr


@pytest.mark.slow  # 2.9 s alone, over the fast tier's second
def test_a_driver_that_ray_ends_in_ray_init_gets_the_paragraph_after_rays_line(tmp_path):
    # a raylet frozen as the driver connects: after 30 s Ray's C++ code ends the driver (exit 1) with its
    # one line, "Failed to get the system config from raylet because it is dead. Worker will terminate.",
    # and nothing of rft's (seen with a SIGSTOPped raylet); here Ray's end is an _exit(1) after 2 s
    code = HUNG_DRIVER.format(root=str(ROOT), tmp=str(tmp_path)).replace(
        "ray.init = lambda **kw: ctypes.PyDLL(None).sleep(600)",
        "import os, time; ray.init = lambda **kw: (time.sleep(2), print('Worker will terminate.', file=sys.stderr, "
        "flush=True), os._exit(1))").replace("main.INIT_PROGRESS_S = 1.0", "main.INIT_PROGRESS_S = 100.0")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=_env())
    assert proc.returncode == 1, proc.stderr[-3000:]
    said = re.search(r"^Worker will terminate\.\n\nrft: the run stopped: the run's process ended (\d+) s into "
                     r"ray\.init, before Ray's local instance answered \(Ray's line above, if any, says why\)\. "
                     r"Likely causes: memory or load .*\. Ray's processes of this run are stopped\. Try again when "
                     r"memory and load are lower .*: Run the same command again to resume \(no checkpoint was saved "
                     r"yet: the run starts over\)\. The command: " + _prefix() + r"python -c\n", proc.stderr, re.M)
    assert said and int(said[1]) >= 2, proc.stderr


@pytest.mark.slow  # 1.6 s alone, over the fast tier's second
def test_the_reaper_counts_a_ray_init_bound_only_while_the_driver_says_it_waits():
    # ray.init done ({"init": null}) before its bound of 0.5 s: the driver is left alone after it
    import threading

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    done = threading.Event()
    lines = ['{"init": 0.5, "progress": 100, "resume": "r"}\n', '{"init": null}\n']
    t = threading.Thread(target=reaper.watch, args=(sleeper.pid, 0.1, _open_until(lines, done)), daemon=True)
    try:
        t.start()
        time.sleep(1.5)  # three times the bound
        assert sleeper.poll() is None
    finally:
        done.set()
        sleeper.kill()
        sleeper.wait()
    t.join(10)
    assert not t.is_alive()  # the watch ends with its driver


def _open_until(lines: list[str], done):
    """The driver's stdin: `lines`, then open (no EOF) until `done`."""
    yield from lines
    done.wait()


# run.py's process only: its raylet frozen (SIGSTOP, as a machine out of memory stalls it) just as the
# driver connects to it, after the raylet registered; the driver then blocks holding the GIL, as the
# one that hung for 20 minutes did reading the raylet's socket (Ray's own connect to a frozen raylet
# gives up after 30 s, so it stands in for that read, and the bound can be generous under load)
FREEZE_RAYLET = textwrap.dedent("""
    import sys
    if sys.argv and sys.argv[0].endswith("run.py"):
        import ctypes
        import psutil
        import rft.runtime.main as main
        start = main._init_ray
        def _init_ray(*args, **kwargs):
            import ray._private.worker as worker
            def frozen(*a, **k):
                ray_procs = psutil.Process().children(recursive=True)
                for p in ray_procs:
                    if p.name() == "raylet":
                        p.suspend()
                open({out!r}, "w").write(" ".join(f"{{p.pid}}:{{p.create_time()}}" for p in ray_procs))
                ctypes.PyDLL(None).sleep(600)
            worker.connect = frozen
            return start(*args, **kwargs)
        main._init_ray = _init_ray
""")


@pytest.mark.slow  # Ray's start and a bound of 25 s
def test_a_run_whose_raylet_stalls_in_ray_init_stops_past_the_bound_and_leaves_no_ray_process(tmp_path):
    # it sat in ray.init for 20 minutes, printing nothing. The bound only has to outlast Ray's start up
    # to the frozen connect: measured 9.5-11.5 s into ray.init at a load of 12-14 on 2 cores
    hook, pids = tmp_path / "hook", tmp_path / "ray_pids.txt"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FREEZE_RAYLET.format(out=str(pids)))
    args = ["cluster=local", "cluster.init_timeout_s=25", "monitor=console", "stages=[]", "name=stalled"]
    run = subprocess.Popen([sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env={**_env(), "RFT_CHECKPOINT_ROOT_DIR": str(tmp_path),
                                                                   "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT)])})
    out, err = run.communicate(timeout=300)
    proc = subprocess.CompletedProcess(run.args, run.returncode, out, err)
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert re.search(r"^rft: the run stopped: Ray's local instance did not start: ray\.init waited \d+ s for its GCS "
                     r"and raylet to answer, past cluster\.init_timeout_s=25, and the driver is stopped \(exit 137\)\.",
                     proc.stderr, re.M), proc.stderr[-3000:]
    assert "Ray's processes of this run are stopped." in proc.stderr
    # after the RFT_* variables it was started with (a new shell has neither)
    assert re.search("The command: " + _prefix() + re.escape(f"RFT_CHECKPOINT_ROOT_DIR={shlex.quote(str(tmp_path))} "
                     f"python {ROOT / 'run.py'} {' '.join(args[:3])} 'stages=[]' name=stalled"), proc.stderr)
    assert "Traceback" not in proc.stderr
    # the GCS, the raylet (frozen) and what they started: each ended (a zombie has, its parent gone)
    time.sleep(2)
    assert pids.exists(), "ray.init did not reach its connect within the bound"
    frozen = dict(p.split(":") for p in pids.read_text().split())
    assert len(frozen) >= 2  # the GCS and the raylet at least
    # and any process of the Ray session the driver started (Ray names it with the driver's pid)
    left = [(p.pid, p.info["cmdline"][:1]) for p in psutil.process_iter(["cmdline", "status"])
            if re.search(rf"/session_[\d_-]+_{run.pid}/", " ".join(p.info["cmdline"] or []))
            and p.info["status"] != psutil.STATUS_ZOMBIE]
    assert left == []
    for pid, started in frozen.items():
        try:
            p = psutil.Process(int(pid))
            assert p.create_time() != float(started) or p.status() == psutil.STATUS_ZOMBIE, p
        except psutil.NoSuchProcess:
            pass


@pytest.mark.slow  # 2.2 s alone, over the fast tier's second
def test_rays_own_startup_timeout_is_a_paragraph_not_its_traceback(tmp_path, monkeypatch, capsys):
    # a raylet that never registers (stopped before it did): after Ray's own 30 s, Hydra's "Error
    # executing job" and Ray's bare Exception ("The current node timed out during startup...")
    import ray

    import rft.runtime.main as main

    def times_out(**kwargs):
        raise Exception("The current node timed out during startup. This could happen because some of the raylet "
                        "failed to startup or the GCS has become overloaded.")

    monkeypatch.setattr(ray, "init", times_out)
    for name in [k for k in os.environ if k.startswith("RFT_")]:  # none set: the command line alone
        monkeypatch.delenv(name)
    monkeypatch.setattr(main, "_start_reaper", lambda: None)
    cfg = compose_cfg(["cluster=local", f"checkpoint_root_dir={tmp_path}", "name=slow"])
    with pytest.raises(SystemExit) as e:
        main.main(cfg)
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("\nrft: the run stopped: Ray's local instance did not start: its raylet did not register "
                          "within Ray's own 30 s (Ray: The current node timed out during startup. This could happen "
                          "because some of the raylet failed to startup or the GCS has become overloaded.). The "
                          "machine may be short of memory or heavily loaded, or Ray's session files (/tmp/ray) on a "
                          "full disk. Run the same command again to resume (no checkpoint was saved yet: the run "
                          "starts over). The command: python "), err


@pytest.mark.slow  # 5.5 s alone, over the fast tier's second
def test_a_start_refused_after_the_run_lock_leaves_no_run_directory(tmp_path):
    # monitor.ray_dashboard=true on minimal Ray is refused as Ray starts, after the run took its lock:
    # it left <run>/.hydra/ (the refused config as the run's record), .run.lock and run.log (its line
    # "built the tiny model", in a fresh cache), and a later
    # continue_from_checkpoint=false moved them to previous_<time>/ as "the earlier outputs"
    env = {"RFT_CHECKPOINT_ROOT_DIR": str(tmp_path)}
    from conftest import run_cli

    proc = run_cli("name=refused", "monitor.ray_dashboard=true", "stages=[]", env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "rft: configuration error: monitor.ray_dashboard=true: Ray's dashboard needs the packages" in proc.stderr
    assert not (tmp_path / "rft" / "refused").exists()
    proc = run_cli("name=refused", "monitor.ray_dashboard=true", "stages=[]", "continue_from_checkpoint=false", env=env)
    assert proc.returncode == 2 and "moved the earlier outputs" not in proc.stdout, proc.stdout
    assert not (tmp_path / "rft" / "refused").exists()


def test_a_refused_start_leaves_a_lock_another_run_holds_and_a_used_directory(tmp_path):
    import fcntl

    from rft.runtime import rundir

    held = tmp_path / "held"
    held.mkdir()
    with open(held / rundir.RUN_LOCK, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a run of the same name that started meanwhile
        rundir.remove_if_unused(held)
        assert (held / rundir.RUN_LOCK).is_file()
    used = tmp_path / "used"
    (used / "grpo").mkdir(parents=True)
    (used / rundir.RUN_LOCK).write_text("pid 1 on host\n")
    rundir.remove_if_unused(used)
    assert sorted(p.name for p in used.iterdir()) == [rundir.RUN_LOCK, "grpo"]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / rundir.RUN_LOCK).write_text("")
    rundir.remove_if_unused(empty)
    assert not empty.exists()


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_an_exports_files_all_follow_the_umask(umask, tmp_path):
    # model.safetensors came out 0600 (safetensors writes through a temporary file) beside 0644 files:
    # a colleague, or a serving process of another user, could read the config but not the weights
    import shutil
    from pathlib import Path

    from rft.models import ensure_model
    from rft.runtime import checkpoint
    from rft.runtime.checkpoint import Owner
    from rft.runtime.export import export

    model = compose_cfg(["model=tiny"]).model
    ensure_model(model)

    def save_files(tmp):
        shutil.copytree(Path(model.model_path).expanduser(), tmp / "hf")
        return {"fingerprint": "1/2/3"}

    stage = tmp_path / "grpo"
    checkpoint.write(stage, 1, {"version": 1}, save_files, owner=Owner(run="rft/x", stage="grpo", config="c0ffee00",
                                                                         model=str(model.model_path)))
    before = os.umask(umask)
    try:
        out = export(stage / "checkpoints" / "step_1", tmp_path / "out")
    finally:
        os.umask(before)
    modes = {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()}
    assert "model.safetensors" in modes and "manifest.json" in modes and "config.json" in modes
    # 0666 less the umask: 0644 with 022, 0640 with 027 (a group may read, others not)
    assert set(modes.values()) == {0o666 & ~umask}, {k: oct(v) for k, v in modes.items()}


def test_a_checkpoints_files_follow_the_umask(tmp_path):
    # its hf/model.safetensors was 0600 (safetensors' temporary file) beside a 0644 trainer_state.pt:
    # the checkpoint was not private, its weights alone unreadable to others (model.model_path=<it>/hf)
    from rft.runtime import checkpoint

    def save_files(tmp):
        (tmp / "hf").mkdir()
        fd = os.open(tmp / "hf" / "model.safetensors", os.O_WRONLY | os.O_CREAT, 0o600)  # as safetensors makes it
        os.write(fd, b"weights")
        os.close(fd)
        (tmp / "trainer_state.pt").write_bytes(b"\1")
        return {}

    before = os.umask(0o022)
    try:
        step = checkpoint.write(tmp_path / "grpo", 1, {}, save_files)
    finally:
        os.umask(before)
    modes = {str(f.relative_to(step)): f.stat().st_mode & 0o777 for f in step.rglob("*") if f.is_file()}
    assert modes == {"hf/model.safetensors": 0o644, "trainer_state.pt": 0o644, "state.json": 0o644,
                     "manifest.json": 0o644}, {k: oct(v) for k, v in modes.items()}


# run.py's process only: when ray.init has started the GCS and the raylet and the driver is about to
# connect to them, a process of the session that outlives the driver, as Ray's dashboard and
# runtime-env agents did (up to 27 s under load), and not its descendant (started through a shell
# that exits: one the reaper has not seen); then a file says so, and the driver waits, to be killed
MARK_IN_INIT = textwrap.dedent("""
    import sys
    if sys.argv and sys.argv[0].endswith("run.py"):
        import subprocess, time
        import rft.runtime.main as main
        start = main._init_ray
        def _init_ray(*args, **kwargs):
            import ray._private.worker as worker
            def connect(node, *a, **k):
                agent = f"{{sys.executable}} -c 'import time; time.sleep(120)' {{node.get_session_dir_path()}}/agent"
                subprocess.run(["sh", "-c", f"setsid {{agent}} >/dev/null 2>&1 &"])
                open({out!r}, "w").write("in ray.init")
                time.sleep(120)
            worker.connect = connect
            return start(*args, **kwargs)
        main._init_ray = _init_ray
""")


def _session_processes(driver_pid: int) -> list:
    """The processes of the Ray session a driver started (Ray names it with the driver's pid), but zombies."""
    return [(p.pid, p.info["cmdline"][:1]) for p in psutil.process_iter(["cmdline", "status"])
            if re.search(rf"/session_[\d_-]+_{driver_pid}/", " ".join(p.info["cmdline"] or []))
            and p.info["status"] != psutil.STATUS_ZOMBIE]


@pytest.mark.slow  # Ray's start
def test_a_driver_killed_during_ray_init_leaves_no_ray_process(tmp_path):
    # the reaper started once ray.init had returned: Ray's processes of a driver SIGKILLed during it
    # were left to Ray's own fate-sharing, which the dashboard and runtime-env agents outlive
    hook, mark = tmp_path / "hook", tmp_path / "in_init"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(MARK_IN_INIT.format(out=str(mark)))
    run = subprocess.Popen([sys.executable, str(ROOT / "run.py"), "cluster=local", "stages=[]", "name=killed"], cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env={**os.environ, "RFT_CHECKPOINT_ROOT_DIR": str(tmp_path),
                                "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT)])})
    deadline = time.time() + 240
    while not mark.exists():
        assert run.poll() is None and time.time() < deadline, "run.py ended before it was in ray.init"
        time.sleep(0.1)
    assert _session_processes(run.pid)  # the GCS and the raylet at least
    run.kill()
    run.wait()
    deadline = time.time() + 5  # the reaper looks once a second
    while _session_processes(run.pid) and time.time() < deadline:
        time.sleep(0.2)
    assert _session_processes(run.pid) == []
