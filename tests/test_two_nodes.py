"""One run over two Ray nodes through launchers/ray_slurm.sbatch, the trainer on one node and the
explorer on the other, with each weight sync method crossing between them.

No Slurm here has two nodes (launchers/slurm_local.sh makes one), so the script runs under bash
with two stand-ins on PATH: `scontrol show hostnames` names two nodes, and `srun ... -w <node>
<command>` runs the command on this machine. The rest is the script's own: a Ray head, a worker
joining it (a second raylet: a Ray node of its own, with its own node id), the wait for both,
run.py joined to them, and Ray stopped at the end. Each node has 1 CPU (SLURM_CPUS_PER_TASK=1)
and the trainer and the explorer reserve 1 CPU each, so the placement group cannot put them on
one node. The nodes share this machine's /dev/shm, but memory sync decides by Ray node id
(rft.sync.weights.MemorySync), so it takes the object store, as it would across machines.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import ROOT

from rft.reporting.monitor import read_metrics

pytestmark = pytest.mark.slow

SCONTROL = """#!/usr/bin/env bash
# stand-in: `scontrol show hostnames a,b` prints one node name a line (plain comma lists only)
[[ $1 == show && $2 == hostnames ]] || { echo "fake scontrol: only 'show hostnames'" >&2; exit 2; }
tr ',' '\\n' <<<"$3"
"""
SRUN = """#!/usr/bin/env bash
# stand-in: drop srun's options (-w <node> among them) and run the command here, in this process
while [[ $# -gt 0 && $1 == -* ]]; do
    case $1 in -w|-N|-n) shift 2 ;; *) shift ;; esac
done
exec "$@"
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_pids(sid: int) -> list[int]:
    """The processes of session `sid`: the launcher and everything it started (Ray's processes
    make process groups of their own, but stay in the session)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    pids.append(int(entry))
            except OSError:  # ended meanwhile
                pass
    return pids


def stop_session(sid: int, grace_s: float = 40) -> list[int]:
    """SIGTERM every process of the session (the script's trap then stops its Ray nodes), SIGKILL
    what is left after `grace_s`; returns the pids still alive at the first look."""
    left = session_pids(sid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in session_pids(sid):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        while session_pids(sid) and time.monotonic() < deadline:
            time.sleep(0.5)
    return left


@pytest.fixture
def two_node_slurm(tmp_path):
    """The environment under which ray_slurm.sbatch sees a Slurm job of two 1-CPU nodes; its Ray
    files in a short temp dir of their own (Unix socket paths are limited to 107 bytes)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    ray_tmp = tempfile.mkdtemp(prefix="rft2n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", TMPDIR=ray_tmp, RFT_PYTHON=sys.executable,
               RFT_RAY_PORT=str(free_port()), RFT_RAY_HEAD_IP="127.0.0.1", RFT_RAY_WAIT_S="120",
               SLURM_JOB_ID=str(os.getpid()), SLURM_JOB_NODELIST="rftnode1,rftnode2", SLURM_JOB_NUM_NODES="2",
               SLURM_CPUS_PER_TASK="1", SLURM_SUBMIT_DIR=str(ROOT))
    yield env
    shutil.rmtree(ray_tmp, ignore_errors=True)


def run_launcher(env: dict, args: list, timeout_s: float = 420) -> tuple[int, str, list]:
    """bash launchers/ray_slurm.sbatch <args> in a session of its own; (exit status, output, the
    pids still running once it had ended). Every process of the session is stopped before this
    returns, whatever happened."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(["bash", "launchers/ray_slurm.sbatch", *args], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            # the nodes' processes finish stopping (the script waited for `ray start`): up to 1 s
            deadline = time.monotonic() + 1
            while session_pids(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            left = stop_session(proc.pid)
            proc.wait()
        out.seek(0)
        return proc.returncode, out.read(), left


def actor_node(log: Path) -> str:
    """The Ray node id an actor's log says it started on (rft.runtime.actors.setup_actor_logging)."""
    return re.search(r"started in process \d+ on host \S+, Ray node ([0-9a-f]+)", log.read_text())[1]


def assert_across_two_nodes(env: dict, run: Path, code: int, log: str, left: list) -> None:
    """The launcher's run ended well, each of its Ray nodes stopped, the trainer and the explorer
    on the two nodes, and both steps trained with each sync's weights loaded and checked by
    fingerprint."""
    assert code == 0, log[-4000:]
    assert "ray_slurm: 2 Ray node(s) up" in log and "run.py exited with status 0" in log
    assert left == [], f"processes of the launcher still running after it ended: {left}"
    # each raylet names its node in its own log: the head's raylet.out, the worker's raylet.1.out
    ray_logs = Path(env["TMPDIR"]) / f"rft-ray-{env['SLURM_JOB_ID']}" / "session_latest" / "logs"
    raylets = {f.name: re.search(r"Setting node ID node_id=([0-9a-f]+)", f.read_text())[1]
               for f in ray_logs.glob("raylet*.out")}
    trainer, explorer = actor_node(run / "log" / "grpo_trainer.log"), actor_node(run / "log" / "grpo_explorer.log")
    which = {node: file for file, node in raylets.items()}
    print(f"{run.name}: trainer on Ray node {trainer} ({which.get(trainer)}), "
          f"explorer on Ray node {explorer} ({which.get(explorer)})")
    assert len(raylets) == 2 and {trainer, explorer} == set(raylets.values()), (raylets, trainer, explorer)
    metrics = read_metrics(run / "metrics.jsonl")
    assert [(m["step"], m["sync/version"]) for m in metrics] == [(1, 1), (2, 2)], metrics


# sync=checkpoint: the device mapping's run below (its GPUs are Ray's word only: the sync is the same file)
@pytest.mark.parametrize("sync", ["memory", "collective"])
def test_a_run_over_two_ray_nodes_has_trainer_and_explorer_on_different_nodes(sync, two_node_slurm, tmp_path):
    name = f"two_nodes_{sync}"
    code, log, left = run_launcher(two_node_slurm, [
        "stages=[]", "monitor=console", f"name={name}", f"sync={sync}", "cluster.node_num=2",
        "buffer.total_steps=2", "explorer.eval_interval=100", "explorer.eval_on_startup=false",
        f"checkpoint_root_dir={tmp_path}"])
    run = tmp_path / "rft" / name
    assert_across_two_nodes(two_node_slurm, run, code, log, left)
    if sync == "memory":  # another node: the object store, never the trainer's shared-memory segment
        assert "memory sync through shared memory" not in (run / "log" / "grpo_trainer.log").read_text()


def test_a_device_mapping_over_two_nodes_puts_each_role_on_its_nodes_gpus(two_node_slurm, tmp_path):
    # two nodes that say they have 2 GPUs each (ray start --num-gpus=2: Ray takes it as told), the
    # trainer mapped to device 1 (node 0's second GPU), the engine to device 2 (node 1's first):
    # whole nodes reserved as bundles spread one to a node, each actor shown its GPU on its node
    env = {**two_node_slurm, "SLURM_GPUS_ON_NODE": "2"}
    code, log, left = run_launcher(env, [
        "stages=[]", "monitor=console", "name=mapped", "sync=checkpoint", "cluster.node_num=2",
        "cluster.gpu_per_node=2", "cluster.device_mapping.trainer=[1]", "cluster.device_mapping.explorer=[2]",
        "buffer.total_steps=2", "explorer.eval_interval=100", "explorer.eval_on_startup=false",
        f"checkpoint_root_dir={tmp_path}"])
    run = tmp_path / "rft" / "mapped"
    assert_across_two_nodes(env, run, code, log, left)
    trainer, explorer = (run / "log" / "grpo_trainer.log").read_text(), (run / "log" / "grpo_explorer.log").read_text()
    assert "devices 1 of its node (cluster.device_mapping): CUDA_VISIBLE_DEVICES=1" in trainer
    assert "devices 0 of its node (cluster.device_mapping): CUDA_VISIBLE_DEVICES=0" in explorer
    # sync=checkpoint across the nodes: the file both read, the run dir on a filesystem they share
    assert (run / "sync" / "model.safetensors").exists()
