"""Review of SIGTERM's stop (1fd4a92), the reward stdout cap (02ac0f5), the servers' write deadline
(f792b31) and the hydra/ group check (b614dcc): legitimate uses each must keep."""

import os
import time
from pathlib import Path

import pytest
from conftest import ROOT

from rft.studio.launch import STOP_GRACE_S, Launches


@pytest.mark.slow  # a training run with a Ray instance
def test_the_studios_stop_of_a_ray_run_ends_it_with_the_paragraph_not_its_sigkill(tmp_path):
    # the studio's stop sends SIGTERM to the run's whole process group, Ray's own processes (GCS,
    # raylet) with it: the run's clean-up then waited on the dead GCS to remove the stage's placement
    # group until the studio's SIGKILL 15 s later, and the console ended without the paragraph
    root = tmp_path / "root"
    launches = Launches(ROOT, tmp_path / "logs", env={**os.environ, "RFT_CHECKPOINT_ROOT_DIR": str(root)})
    launch = launches.start(["stages=[]", "cluster=local", "monitor=console", "buffer.total_steps=400",
                             "trainer.save_interval=2", "explorer.eval_interval=1000", "name=stopped"])
    deadline = time.time() + 300
    while not (root / "rft" / "stopped" / "checkpoints" / "step_2" / "state.json").exists():
        assert launch.alive() and time.time() < deadline, launch.log.read_text()[-3000:]
        time.sleep(0.05)
    launches.stop(launch.id)
    launch.proc.wait(timeout=STOP_GRACE_S + 60)
    console = launches.read(launch.id)["text"]
    assert launch.proc.returncode == 143, console[-3000:]  # not -9, the studio's SIGKILL
    assert "rft: stopped by SIGTERM after step" in console, console[-3000:]
    assert launches.read(launch.id)["status"] == "stopped"
