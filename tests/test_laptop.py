"""What a laptop that is not this project's Linux CI box gets: macOS's platform facts simulated
(monkeypatch), and the Makefile on a machine whose python3 is too old or missing."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch  # imported before sys.platform is patched: torch's own imports ask it

from rft.errors import ConfigError
from rft.models import local_device, peak_memory

ROOT = Path(__file__).resolve().parents[1]


def test_peak_memory_reads_macos_ru_maxrss_as_bytes(monkeypatch):
    """Linux reports ru_maxrss in KiB, macOS in bytes: read as KiB on a Mac, a 100 MiB process
    showed perf/max_memory_gb = 100 (1024 x its size)."""
    import resource

    monkeypatch.setattr(resource, "getrusage", lambda who: SimpleNamespace(ru_maxrss=100 * 2**20))
    monkeypatch.setattr(sys, "platform", "darwin")
    assert peak_memory("cpu") == 100 * 2**20  # bytes as given: 104,857,600
    monkeypatch.setattr(sys, "platform", "linux")
    assert peak_memory("cpu") == 100 * 2**30  # the same figure read as KiB: x 1024


def test_sandbox_refuses_on_macos_with_one_paragraph_even_unisolated(monkeypatch):
    """No bubblewrap, memfd or /proc on macOS: the python tool's sandbox refuses before trying, with
    allow_unisolated too (that path reads /proc and calls os.memfd_create, an AttributeError there)."""
    from rft.rollout.environments import sandbox

    monkeypatch.setattr(sys, "platform", "darwin")
    for unisolated in (False, True):
        with pytest.raises(ConfigError) as e:
            sandbox.check(allow_unisolated=unisolated)
        msg = str(e.value)
        assert "this platform (darwin) does not have" in msg and "on a Linux machine" in msg
        assert "\n" not in msg  # one paragraph


def test_shared_memory_sync_falls_back_without_dev_shm(monkeypatch):
    """macOS has POSIX shared memory but no /dev/shm to measure: memory sync takes the other way
    (the weights through Ray) rather than risk a segment it cannot size; sweep finds nothing to do."""
    from rft.sync import weights

    def no_dir(path):
        raise FileNotFoundError(2, "No such file or directory", path)

    monkeypatch.setattr(os, "statvfs", no_dir)
    monkeypatch.setattr(os, "listdir", no_dir)
    assert weights.shared_fits(1) is False
    assert weights.sweep() is None  # returns quietly: no FileNotFoundError


def test_segment_names_fit_macos_31_character_limit():
    """macOS refuses a POSIX shm name over 31 characters with its leading '/' (PSHMNAMLEN); its
    pids go up to 99,999: '/' + 'rft_' + 5 + '_' + 6 + '_' + 12 = 1 + 4 + 5 + 1 + 6 + 1 + 12 = 30."""
    import secrets

    from rft.sync import weights

    name = "/" + weights.segment_prefix().replace(f"_{os.getpid()}_", "_99999_") + secrets.token_hex(6)
    assert len(name) == 30


def test_default_device_is_cpu_with_apple_mps(monkeypatch):
    """A Mac's MPS device is not picked (nor crashed on): with gpu_per_node=0 every role computes on CPU."""
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert local_device(SimpleNamespace(gpu_per_node=0)) == torch.device("cpu")
    assert local_device(SimpleNamespace(gpu_per_node=1)) == torch.device("cpu")


def _make(tmp_path, python: str) -> subprocess.CompletedProcess:
    """`make venv` in a copy of the Makefile, with PYTHON=python (no .venv there: it would create one)."""
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").write_text("")
    return subprocess.run(["make", "-s", "venv", f"PYTHON={python}"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_refuses_an_old_or_missing_python_with_one_line(tmp_path):
    """macOS's /usr/bin/python3 is 3.9: pip failed deep in the install (`requires a different
    Python`); a missing one failed as `python3: No such file or directory`."""
    old = tmp_path / "python3.9"
    # what macOS's python3 answers: its version, and False to `sys.version_info >= (3, 11)`
    old.write_text("#!/bin/sh\ncase \"$1\" in --version) echo 'Python 3.9.6';; *) exit 1;; esac\n")
    old.chmod(0o755)
    r = _make(tmp_path, str(old))
    assert r.returncode != 0 and not (tmp_path / ".venv").exists()
    assert f"make: rft needs Python >= 3.11, and {old} is Python 3.9.6" in r.stderr
    r = _make(tmp_path, "rft-no-such-python")
    assert r.returncode != 0
    assert "make: rft needs Python >= 3.11, and rft-no-such-python is not installed" in r.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_installs_the_cpu_build_of_torch_on_linux_and_pypis_on_macos(tmp_path):
    """On Linux PyPI's torch is the CUDA build (multi-GB of nvidia packages): `pip install
    torch==2.13.0` gave it to a laptop without a GPU; the CPU build is on PyTorch's index. macOS's
    torch on PyPI is the CPU one (no +cpu there). `make -n` prints what it would run."""
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").write_text("")

    def torch_install(env=None) -> list[str]:
        r = subprocess.run(["make", "-n", "venv"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                           env={**os.environ, **(env or {})})
        assert r.returncode == 0, r.stderr
        return [line for line in r.stdout.splitlines() if "pip install" in line and "torch" in line]

    assert torch_install() == [".venv/bin/python -m pip install --quiet --no-deps torch==2.13.0+cpu "
                               "--extra-index-url https://download.pytorch.org/whl/cpu"]
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "uname").write_text("#!/bin/sh\necho Darwin\n")
    (fake / "uname").chmod(0o755)
    assert torch_install({"PATH": f"{fake}:{os.environ['PATH']}"}) == [
        ".venv/bin/python -m pip install --quiet torch==2.13.0"]


def test_an_unwritable_home_stops_the_run_naming_cache_dir(tmp_path, monkeypatch):
    """HOME on a file (a service account's /nonexistent, a read-only home): the default cache_dir
    (~/.cache/rft) could not be made, and the run stopped with the dataset child's traceback
    (NotADirectoryError in rft/data/tasks.py)."""
    import rft.runtime.main
    from conftest import compose_cfg

    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("HOME", str(tmp_path / "afile" / "home"))
    monkeypatch.delenv("RFT_CACHE_DIR", raising=False)
    with pytest.raises(ConfigError) as e:
        rft.runtime.main._main(compose_cfg(["dry_run=true", f"checkpoint_root_dir={tmp_path}/ck"]))
    assert str(e.value) == (f"cannot write to {tmp_path}/afile/home/.cache/rft (NotADirectoryError: Not a directory). "
                            f"Point cache_dir (or RFT_CACHE_DIR) at a writable directory.")


@pytest.mark.slow
def test_a_one_cpu_ray_instance_is_told_it_may_count_more_cpus_than_cores(tmp_path):
    """The default's explorer and trainer reserve a CPU each: with cluster.num_cpus=1 (or a machine of
    one core) the run stopped at "Lower those", which cpus_per_actor=1 cannot be. Ray's count is a
    reservation: `taskset -c 0 python run.py` (one core, Ray counting 2) ran the default to 0.965."""
    from conftest import run_cli

    r = run_cli("cluster.num_cpus=1", f"checkpoint_root_dir={tmp_path}", timeout=120)
    assert r.returncode == 2
    assert ("but the Ray cluster has 1. Lower those, or start Ray with more (cluster.num_cpus for a local "
            "instance: it may exceed this machine's cores, e.g. cluster.num_cpus=2; or cluster=inline).") in r.stderr


def test_an_unwritable_hugging_face_cache_stops_the_run_naming_it(tmp_path, monkeypatch):
    """With cache_dir elsewhere, `datasets` still caches under HOME: the run stopped with
    "buffer.explorer_input.eval_tasksets[0].path=... could not be read as a dataset (NotADirectoryError:
    ... home)", blaming a dataset rft had just written."""
    import rft.runtime.main
    from conftest import compose_cfg

    (tmp_path / "afile").write_text("")
    for var in ("HF_HOME", "HF_DATASETS_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "afile" / "datasets"))
    with pytest.raises(ConfigError) as e:
        rft.runtime.main._main(compose_cfg(["dry_run=true", f"checkpoint_root_dir={tmp_path}/ck",
                                            f"cache_dir={tmp_path}/cache"]))
    assert str(e.value) == (f"cannot write to {tmp_path}/afile/datasets (NotADirectoryError: Not a directory). "
                            f"Point the environment variable HF_DATASETS_CACHE (or HF_HOME: Hugging Face's cache) "
                            f"at a writable directory.")


@pytest.mark.parametrize("second, msg", [
    ("SFT_Warmup", "stages[1].stage_name='SFT_Warmup' differs from the stage_name 'sft_warmup' of an earlier stage "
                   "only in case: on a case-insensitive file system (macOS's, Windows') both are one directory. Rename one."),
    ("sft_warmup", "stages[1].stage_name='sft_warmup' is used twice; stage names must be unique."),
])
def test_stage_names_differing_only_in_case_are_refused(second, msg):
    """Each stage writes <run>/<stage_name>/: on a Mac, stages sft_warmup and SFT_Warmup shared one
    directory, the second resuming the first's checkpoints as its own (exit 0, a wrong model)."""
    from conftest import compose_cfg
    from rft.plan.batch import stage_configs

    with pytest.raises(ConfigError) as e:
        stage_configs(compose_cfg([f"stages.1.stage_name={second}"]))
    assert str(e.value) == msg


def test_an_unwritable_home_gives_the_local_ray_instance_its_token_through_the_environment(tmp_path, monkeypatch):
    """Ray's init wrote the token of a new local instance to ~/.ray/auth_token and failed there with
    NotADirectoryError under an unwritable HOME (HOME=<a file>/home python run.py stopped at ray.init)."""
    from rft.runtime import main

    (tmp_path / "afile").write_text("")
    # the environment is the test's own: a RAY_AUTH_TOKEN left in this process's made its next Ray
    # instance fail ("InvalidAuthToken": this process had read the file's token, Ray's new processes
    # the variable's)
    monkeypatch.setattr(os, "environ", dict(os.environ))
    for var in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        os.environ.pop(var, None)
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["HOME"] = str(tmp_path / "home")  # writable: the token goes to its file
    main.ray_token()
    assert "RAY_AUTH_TOKEN" not in os.environ
    token = (tmp_path / "home" / ".ray" / "auth_token").read_text()
    assert len(token) == 64  # 32 random bytes in hex
    assert (tmp_path / "home" / ".ray" / "auth_token").stat().st_mode & 0o777 == 0o600
    main.ray_token()  # a token there is kept
    assert (tmp_path / "home" / ".ray" / "auth_token").read_text() == token
    os.environ["HOME"] = str(tmp_path / "afile" / "home")
    main.ray_token()
    assert len(os.environ["RAY_AUTH_TOKEN"]) == 64


@pytest.mark.slow  # 3.6 s alone, over the fast tier's second
def test_runs_starting_at_once_on_a_fresh_machine_share_one_ray_token(tmp_path):
    """Ray wrote ~/.ray/auth_token (opened "w": truncated, then written) in each run that found none:
    two starting at once on a fresh machine (a sweep's jobs, the test session's workers) each wrote
    theirs, and a Ray instance whose processes read the other's token failed to start
    ("InvalidAuthToken"). Sixteen processes settle the token at once: one file, one token, which each
    of them read back whole."""
    code = ("import os, sys\nfrom pathlib import Path\nfrom rft.runtime.main import ray_token\n"
            "sys.stdin.read()\nray_token()\n"  # all released together
            "print(Path(os.environ['HOME'], '.ray', 'auth_token').read_text(), end='')")
    env = {**os.environ, "HOME": str(tmp_path), "RAY_AUTH_MODE": "token"}
    env.pop("RAY_AUTH_TOKEN", None)
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for _ in range(16)]
    time.sleep(3)  # each has imported rft and waits on its stdin
    for p in procs:
        p.stdin.close()
    outs = [p.stdout.read() for p in procs]
    assert [p.wait() for p in procs] == [0] * 16
    assert len(set(outs)) == 1 and len(outs[0]) == 64, outs
    assert os.listdir(tmp_path / ".ray") == ["auth_token"]  # no name of a process's own is left


def test_the_studio_sees_a_running_process_without_proc(monkeypatch):
    """The studio read a run's lock holder's start time from /proc/<pid>/stat: on macOS (no /proc)
    every run showed as not running."""
    import time

    from rft.studio import index

    real = Path.read_text

    def no_proc(self, *a, **k):
        if str(self).startswith("/proc"):
            raise FileNotFoundError(2, "No such file or directory", str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", no_proc)
    started = index._started(os.getpid())
    assert started is not None and started <= time.time()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    while child.poll() is None:
        time.sleep(0.01)
    assert index._started(child.pid) is None  # ended and reaped


def test_sync_copies_use_threads_without_sched_getaffinity(monkeypatch):
    """macOS has no os.sched_getaffinity: a sync's copies and sums ran on one thread there, not on
    up to 4 (half the time on 2 cores)."""
    import threading

    from rft.sync import weights

    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(weights, "_POOL", [])
    ran_on = set()
    # 2 x (2^23 + 1) = 2^24 + 2 elements, past the threshold (views of one float: no memory taken)
    items = [torch.zeros(1).expand(weights._THREADED // 2 + 1) for _ in range(2)]
    weights.in_threads(lambda t: ran_on.add(threading.current_thread().name), items)
    assert ran_on and all(name.startswith("rft-sync") for name in ran_on)
    weights._POOL[0].shutdown()
