"""Sweeps through submitit (`python run.py -m hydra/launcher=slurm|local ...`): a job that died
ends the sweep with one paragraph instead of a traceback.

Hydra's submitit launcher waits for each job's result in turn. When a job ended without one
(cancelled, killed, out of memory, past its time limit, its node lost, or `rft` exiting on a
config error), submitit raises UncompletedJobError holding the job's whole stderr, progress bars
included, and Hydra prints it under a traceback. `explain` turns it into: which job, its final
state, the last lines of its log that are not progress bars, where the full log is, and what
happens to the other jobs.

Hydra only instantiates launchers from the `hydra_plugins` package, so conf/hydra/launcher/ cannot
name a subclass of ours; `install()` (called by run.py) wraps the plugin's `launch` instead.
Whether a dead job is noticed at all is up to Slurm's accounting: without slurmdbd, `sacct` knows
nothing of it and submitit waits forever (launchers/slurm_local.sh starts one).
"""

from __future__ import annotations

import re
from pathlib import Path

from hydra.errors import CompactHydraException

# submitit's UncompletedJobError message: "Job <id> (task: <n>) with path <result.pkl>\n
# has not produced any output (state: <STATE>)"
_UNCOMPLETED = re.compile(
    r"Job (?P<job>\S+) \(task: (?P<task>\d+)\) with path (?P<pickle>\S+)\s+"
    r"has not produced any output \(state: (?P<state>[^)]*)\)"
)


class SweepJobError(CompactHydraException):
    """Hydra prints a CompactHydraException as its message alone and exits with status 1."""


def log_tail(path: Path, lines: int = 8) -> list[str]:
    """The last lines of a job's log, without progress bars (carriage-return redraws) or blanks."""
    if not path.exists():
        return []
    kept = []
    for line in path.read_text(errors="replace").splitlines():
        line = line.split("\r")[-1].strip()
        if line and "it/s" not in line and "s/it" not in line and "%|" not in line:
            kept.append(line)
    return kept[-lines:]


def explain(error: Exception, sweep_dir: str) -> str:
    m = _UNCOMPLETED.search(str(error))
    if m is None:  # a job that raised inside submitit itself: its message is the traceback
        return f"rft: a job of the sweep failed; the sweep stopped.\n{error}"
    job, task, state = m["job"], m["task"], m["state"]
    folder = Path(m["pickle"]).parent
    err, out = folder / f"{job}_{task}_log.err", folder / f"{job}_{task}_log.out"
    tail = "\n".join(f"    {line}" for line in log_tail(err)) or "    (nothing)"
    return (
        f"rft: the sweep stopped: job {job} ended with state {state} and no result (killed, "
        f"cancelled, out of memory or time, its node lost, or rft exiting on an error). The last "
        f"lines of its log:\n{tail}\nIts whole output: {err} and {out}. The other jobs are not "
        f"cancelled: each keeps its outputs in {sweep_dir}/<job number>/ (squeue shows those "
        f"still running; `python -m rft.report {sweep_dir}` tabulates them). The same sweep with "
        f"hydra.sweep.dir={sweep_dir} resumes each job from its newest checkpoint."
    )


def install() -> None:
    """Wrap hydra-submitit-launcher's `launch` so a dead job raises SweepJobError."""
    from hydra.core.plugins import Plugins

    # Hydra's plugin scan executes every hydra_plugins module once (again, if it was imported
    # before), defining the launcher classes anew: scan first, then wrap what the scan defined
    Plugins.instance()
    try:
        from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
        from submitit.core.utils import FailedJobError, UncompletedJobError
    except ImportError:  # the launcher plugin is not installed: nothing to wrap
        return
    launch = BaseSubmititLauncher.launch
    if getattr(launch, "rft_explains", False):
        return

    def launch_and_explain(self, job_overrides, initial_job_idx):
        try:
            return launch(self, job_overrides, initial_job_idx)
        except (UncompletedJobError, FailedJobError) as e:
            raise SweepJobError(explain(e, str(self.config.hydra.sweep.dir))) from None

    launch_and_explain.rft_explains = True
    BaseSubmititLauncher.launch = launch_and_explain
