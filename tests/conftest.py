import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

import rft.config  # noqa: F401  (registers the schema)
import rft.runtime.main

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

# Ray's own instances (a run's, a test's ray.init) take a token; it is settled once here, before any
# starts: on a fresh machine the session's workers each wrote ~/.ray/auth_token at once, and a Ray
# instance whose processes read another's token failed to start ("InvalidAuthToken")
os.environ.setdefault("RAY_AUTH_MODE", "token")
rft.runtime.main.ray_token()


def shared_dir(tmp_path_factory) -> Path:
    """The session's directory that every pytest-xdist worker of it shares (each worker has a
    basetemp of its own below it), or the basetemp itself without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def cache_dir(tmp_path_factory):
    """One cache (tiny model, generated data) for the whole session, never the user's own; shared
    by the xdist workers (rft builds into it under a lock per entry, as for concurrent jobs), so
    that the warm start below, keyed by that data and model, is theirs too."""
    d = shared_dir(tmp_path_factory) / "rft-cache"
    d.mkdir(exist_ok=True)
    os.environ["RFT_CACHE_DIR"] = str(d)
    return d


@pytest.fixture(scope="session")
def warm_start(tmp_path_factory):
    """The default's SFT warm-up stage alone (~45 s, once per session, whatever the number of
    xdist workers: the first to need it trains it, under a lock, and the others wait for it); its
    final HF-format model.

    Tests of RL behaviour start here: the model answers about 15% of held-out problems, so
    rewards vary within groups and a few RL steps visibly raise accuracy.
    """
    import rft.runtime.main

    shared = shared_dir(tmp_path_factory)
    root, built = shared / "warm", shared / "warm.built"
    # the default with one GRPO step: the warm-up, a stage the next one starts from, goes into the
    # stage cache <root>/rft/stage_cache, where a test of the whole default reuses it (warm_cache)
    cfg = compose_cfg(["cluster=inline", "monitor=console", f"checkpoint_root_dir={root}", "buffer.total_steps=1"])
    with FileLock(str(shared / "warm.lock")):
        if not built.exists():  # else another worker built it; a build it did not finish is started afresh
            shutil.rmtree(root, ignore_errors=True)
            rft.runtime.main.main(cfg)
            built.touch()
    return root / "rft" / cfg.name / "sft_warmup" / "checkpoints" / "step_400" / "hf"


@pytest.fixture(scope="session")
def warm_cache(warm_start):
    """The stage cache holding the default's warm-up (stage_cache_dir=<this>: it is not run again)."""
    return warm_start.parents[4] / "stage_cache"


def load_script(path: str, name: str):
    """A script of the repository that is no package module (experiments/<study>/<file>.py), imported."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compose_cfg(overrides=(), keep_hydra: bool = False):
    """The config exactly as `python run.py <overrides>` composes it (HydraConfig set, as in a run)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    if not keep_hydra:
        with open_dict(cfg):
            del cfg["hydra"]
    return cfg


def driver_modules_env(tmp_path: Path) -> tuple[dict, Path]:
    """An env under which run.py, at its exit, writes the names of the modules it holds to the
    returned file: a sitecustomize on PYTHONPATH, which every process of the run reads (the driver,
    the child reading the datasets, Ray's and the actors'), acting in run.py's process alone."""
    hook, out = tmp_path / "driver_hook", tmp_path / "driver_modules.txt"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(
        "import atexit, sys\n"
        "def _dump():\n"
        "    if sys.argv and sys.argv[0].endswith('run.py'):\n"
        f"        open({str(out)!r}, 'w').write(' '.join(sorted(sys.modules)))\n"
        "atexit.register(_dump)\n")
    return {"PYTHONPATH": os.pathsep.join([str(hook), str(ROOT)])}, out


def run_cli(*args, env=None, timeout=600):
    """`python run.py *args` in a subprocess; returns the CompletedProcess (text)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, str(ROOT / "run.py"), *args],
        cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout,
    )
