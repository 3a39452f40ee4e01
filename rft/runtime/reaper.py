"""Stop what a killed driver leaves running: `python -m rft.runtime.reaper <driver pid>`.

Ray's own processes share the fate of the driver that started them (they die with it), but the
dashboard and runtime-env agents, which the raylet starts, outlive a driver killed with SIGKILL
(they wait on a GCS that is gone). `rft.runtime.main` starts this watcher next to a local Ray instance:
every second it notes the driver's descendants; once the driver is gone it kills those still
running (the same processes: same pid and start time), then exits.
"""

from __future__ import annotations

import sys
import time

import psutil


def watch(driver_pid: int, poll_s: float = 1.0) -> None:
    me = psutil.Process()
    seen: dict[int, float] = {}  # pid -> start time
    try:
        driver = psutil.Process(driver_pid)
        while driver.is_running() and driver.status() != psutil.STATUS_ZOMBIE:
            for p in driver.children(recursive=True):
                if p.pid != me.pid:
                    try:
                        seen[p.pid] = p.create_time()
                    except psutil.Error:
                        pass
            time.sleep(poll_s)
    except psutil.NoSuchProcess:
        pass
    for pid, started in seen.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == started:
                p.kill()
        except psutil.Error:
            pass


if __name__ == "__main__":
    watch(int(sys.argv[1]))
