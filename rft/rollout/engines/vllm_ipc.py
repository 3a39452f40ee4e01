"""Where vLLM puts its ZMQ ipc sockets: a folder of the engine's process, not /tmp itself.

vLLM names each socket `ipc://$VLLM_RPC_BASE_PATH/<uuid4>` (vllm.utils.network_utils, the base
tempfile.gettempdir() by default). An engine that exits unlinks them; one killed (SIGKILL, a lost
node, the OOM killer) leaves them in /tmp for good, a few a run under uuid names no one can tell
apart. `use_own_ipc_dir` points the base at <tmp>/rft-vllm-ipc-<pid>-<random>/ before the engine
starts, removes it at the process's exit, and removes the folders of processes that are gone
(killed before their exit ran) first, as the LoRA adapters' folders are (rft.rollout.engines.vllm_lora).

One folder per process, kept for its life: vLLM reads the variable once and may cache it
(vllm.envs.enable_envs_cache, called in the engine core), so a second engine of the process must
find the same folder there. Under /tmp rather than the run's directory: a socket's path holds at
most 107 bytes, which a run directory plus 36 of a uuid often passes. A base the user set is kept.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

from rft.sync.weights import pid_alive

ENV = "VLLM_RPC_BASE_PATH"
PREFIX = "rft-vllm-ipc-"
SOCKET_PATH_MAX = 107  # sockaddr_un's sun_path (108 bytes on Linux) less its closing NUL


def sweep() -> list[Path]:
    """Remove the ipc folders of processes that are gone; returns those removed."""
    gone = []
    for d in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-*"):
        pid = d.name.removeprefix(PREFIX).split("-")[0]
        if pid.isdigit() and not pid_alive(int(pid)) and d.is_dir() and not d.is_symlink():
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone


def use_own_ipc_dir() -> str:
    """Set $VLLM_RPC_BASE_PATH to this process's folder (made once, removed at exit) unless the user
    set it; returns the base vLLM will use. An inherited value naming another rft process's folder
    (a child of one) is not the user's: that folder goes with its process."""
    current = os.environ.get(ENV)
    mine = f"{PREFIX}{os.getpid()}-"
    if current and not Path(current).name.startswith(PREFIX):
        return current
    if current and Path(current).name.startswith(mine) and Path(current).is_dir():
        return current  # this process's, made for an earlier engine
    sweep()
    base = tempfile.gettempdir()
    # <base>/<mine><8 random>/<uuid4>: a socket's path past 107 bytes fails to bind (a long $TMPDIR,
    # as a cluster's job folders are): there vLLM keeps its own place, <base>/<uuid4>
    if len(os.fsencode(os.path.join(base, mine + "x" * 8, "u" * 36))) > SOCKET_PATH_MAX:
        os.environ.pop(ENV, None)  # an rft parent's folder: not this process's to use
        return base
    d = tempfile.mkdtemp(prefix=mine)
    os.environ[ENV] = d
    atexit.register(shutil.rmtree, d, True)
    return d
