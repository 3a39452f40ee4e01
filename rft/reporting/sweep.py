"""Sweeps through submitit (`python run.py -m hydra/launcher=slurm|local ...`): the driver says
where each job's outputs and logs are, reports each job as it ends, and a job that died ends the
sweep with one paragraph instead of a traceback.

Hydra's submitit launcher submits the jobs, then waits for each job's result in turn without a
word. `install()` (called by run.py) replaces that wait with `watch`: one line per job as
submitted, one line per job as it ends, in the order they end. (Hydra only instantiates launchers
from the `hydra_plugins` package, so conf/hydra/launcher/ cannot name a subclass of ours; install()
wraps the plugin's `launch` instead.) When a job ended without a result (cancelled, killed, out of
memory, past its time limit, its node lost, or `rft` exiting on a config error), submitit raises
UncompletedJobError holding the job's whole stderr, progress bars included, and Hydra would print
it under a traceback. `explain` turns it into: which job, its final state, the last lines of its
log that are not progress bars, where the full log is, and how to resume.

A dead job does not stop the wait: the driver waits for the other jobs, then raises. The other
jobs keep running either way (Slurm does not cancel them), and a driver that returned early would
invite running the same sweep again to resume it while they still run, two runs then writing one
job directory. Whether a dead job is noticed at all is up to Slurm's accounting: without slurmdbd,
`sacct` knows nothing of it and submitit waits forever (launchers/slurm_local.sh starts one).
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

from rft.manifest import open_regular, write_atomic
from rft.reporting.redact import redact_file, redact_overrides, redact_text, typed_secrets

# submitit's UncompletedJobError message: "Job <id> (task: <n>) with path <result.pkl>\n
# has not produced any output (state: <STATE>)"
_UNCOMPLETED = re.compile(
    r"Job (?P<job>\S+) \(task: (?P<task>\d+)\) with path (?P<pickle>\S+)\s+"
    r"has not produced any output \(state: (?P<state>[^)]*)\)"
)


# sacct's states of a job whose process Slurm ended (scancel, its time limit, memory, its node)
SLURM_ENDED_IT = ("CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "DEADLINE", "BOOT_FAIL")

# what Slurm writes into a job's log when it ends it: "*** JOB 12 ON vm CANCELLED AT ... ***"
SCHEDULER_LINE = re.compile(r"\*\*\* (JOB|STEP) \S+ ON .* \*\*\*")


def log_tail(path: Path, lines: int = 8) -> list[str]:
    """The last lines of a job's log, without progress bars (carriage-return redraws) or blanks;
    Slurm's own lines saying why it ended the job come first when the job printed more after them
    (it goes on until Slurm's KillWait runs out)."""
    if not path.exists():
        return []
    kept = []
    for line in path.read_text(errors="replace").splitlines():
        line = line.split("\r")[-1].strip()
        if line and "it/s" not in line and "s/it" not in line and "%|" not in line:
            kept.append(line)
    tail = kept[-lines:]
    said = [line for line in kept[:-lines] if SCHEDULER_LINE.search(line)]
    return said + tail


def no_result(state: str) -> str:
    """How a job that left no result ended, from submitit's state for it."""
    if state == "FINISHED":
        # the local launcher's word once the job's controller exited, though the job's own process
        # was killed (SIGKILL, the OOM killer): "ended with state FINISHED" read as a success
        return ("ended with no result: its process stopped without one (submitit's local launcher calls "
                "that state FINISHED)")
    return f"ended with state {state} and no result"


def stop_orphans(job_id: str, folder) -> tuple[list[int], str | None]:
    """Kill what a local job's killed controller left running: the pid the sweep prints for a
    job is its controller's, which runs the job's task as a child; `kill -9` of it orphans the task,
    which trained on to its end in the job's directory after the sweep had said the job ended (a
    SIGTERM is passed on to the task, a SIGKILL cannot be). The task, and what it started, carry
    SUBMITIT_LOCAL_JOB_ID=<job id> and SUBMITIT_LOCAL_COMMAND (which names the job's submitit
    folder, `folder`: job.paths.folder) in their environment: both must match, as the job id alone
    (the controller's pid) may be another sweep's job's after pid reuse. Returns the pids killed,
    and why no process could be looked at (None: all were), where the process table cannot be
    listed (/proc mounted hidepid or unreadable), which ended the sweep's watch in a traceback."""
    import psutil

    killed = []
    try:
        procs = list(psutil.process_iter())
    except (psutil.Error, OSError) as e:
        return killed, f"{type(e).__name__}: {e}"
    for p in procs:
        try:
            env = p.environ()
            if (p.pid != os.getpid() and env.get("SUBMITIT_LOCAL_JOB_ID") == str(job_id)
                    and _job_folder(env.get("SUBMITIT_LOCAL_COMMAND"), job_id) == Path(folder)):
                p.kill()
                killed.append(p.pid)
        except psutil.Error:  # another user's (not readable), or gone meanwhile
            continue
    return killed, None


def _job_folder(command: str | None, job_id: str) -> Path | None:
    """The job folder submitit's local controller was started for: the last word of its
    SUBMITIT_LOCAL_COMMAND (`python -u -m submitit.core._submit <folder with %j>`), `%j` as `job_id`."""
    from submitit.core.utils import JobPaths

    try:
        return JobPaths(shlex.split(command or "")[-1], str(job_id)).folder
    except (ValueError, IndexError):  # not a controller's command, or a folder of %a outside an array
        return None


def explain(error: Exception, sweep_dir: str) -> str:
    cause = error.__cause__
    if isinstance(cause, subprocess.CalledProcessError) and "sbatch" in str(cause.cmd):
        # submitit's submission (one sbatch for the sweep's array) failed: no job was queued
        said = " ".join(str(cause.stderr or error).split()) or f"sbatch exited with status {cause.returncode}"
        return (f"rft: Slurm refused the sweep's jobs, so none was queued: {said}. Check the launcher's keys "
                f"against the cluster's partitions and nodes (hydra.launcher.partition, gpus_per_node, cpus_per_task, "
                f"mem_gb, timeout_min, additional_parameters: `python run.py -m <the same overrides> --cfg hydra -p "
                f"hydra.launcher` prints them; `sinfo` lists what the cluster has) and that Slurm answers (`sinfo`), "
                f"then run the same command again.")
    m = _UNCOMPLETED.search(str(error))
    if m is None:  # a job that raised inside submitit itself: its message is the traceback
        return f"rft: a job of the sweep failed; the sweep stopped.\n{error}"
    job, task, state = m["job"], m["task"], m["state"]
    folder = Path(m["pickle"]).parent
    err, out = folder / f"{job}_{task}_log.err", folder / f"{job}_{task}_log.out"
    # a job killed outright (SIGKILL, the OOM killer) writes no error: where it was is in its output
    lines, log = (log_tail(err), err) if log_tail(err) else (log_tail(out), out)
    tail = "\n".join(f"    {line}" for line in lines) or "    (nothing)"
    return (
        f"rft: the sweep stopped: job {job} {no_result(state)}. It was killed, cancelled, out of memory "
        f"or time, its node lost, or rft exited on an error. The last "
        f"lines of its log ({log.name}):\n{tail}\nIts whole output: {err} and {out}. The other jobs ran to their "
        f"end (the lines above say how each ended) and keep their outputs in {sweep_dir}/<job number>/ "
        f"(`python -m rft.reporting.report {sweep_dir}` tabulates them). The same sweep with "
        f"hydra.sweep.dir={sweep_dir} resumes each job from its newest checkpoint; a finished job "
        f"is not run again."
    )


# ---------------------------------------------------------------- which launcher log is a job's own

# <job dir>/.launcher_log: the path of the job's own launcher log (submitit's stderr of it), relative
# to the sweep's directory where it lies below it; the job writes it as it starts
# (rft.runtime.callbacks). hydra/launcher=local names each job's .submitit folder by the process id
# of its controller, which says nothing of the job's number, and hydra.launcher.submitit_folder may
# name any folder: the report (rft.reporting.report.why_stopped) could not tell whose log was whose
OWN_LOG = ".launcher_log"
# what submitit names a job's stderr (JobPaths.stderr: <job id>_<task>_log.err): anything else
# recorded there (a record in a folder others write to) is not read
_LOG_NAME = re.compile(r"[\w.-]+_\d+_log\.err")


def record_own_log(job_dir) -> Path | None:
    """In a job that submitit runs: write OWN_LOG into `job_dir`; returns the log (None outside one)."""
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return None
    import submitit

    try:
        log = submitit.JobEnvironment().paths.stderr
    except (KeyError, ValueError):  # a job environment submitit did not make whole: nothing to tell
        return None
    job_dir = Path(job_dir).absolute()
    try:
        text = str(log.relative_to(job_dir.parent))
    except ValueError:  # a submitit_folder outside the sweep's
        text = str(log)
    write_atomic(job_dir / OWN_LOG, text + "\n")
    return log


def own_log(job_dir: Path) -> Path | None:
    """The launcher log the job of `job_dir` recorded as its own (record_own_log), or None: none
    recorded, or a record that does not name a submitit log."""
    try:
        with open_regular(job_dir / OWN_LOG) as f:
            text = f.read(4097).decode().strip()
    except (OSError, UnicodeDecodeError):
        return None
    if not text or len(text) > 4096 or "\n" in text or "\0" in text or not _LOG_NAME.fullmatch(Path(text).name):
        return None
    return job_dir.parent / text  # an absolute path stays itself


def planned_jobs(hydra, most: int | None = None) -> list[list[str]]:
    """Each job's overrides, as Hydra's basic sweeper launches them (hydra.sweeper.params, then the
    command line's hydra.overrides.task), from a sweep's Hydra config (the driver's, or the saved
    multirun.yaml's); [] for another sweeper (it chooses values as it goes). `most`: a TooManyJobs
    for a sweep of more jobs, raised before they are listed (a crafted range(0,1000000000) would
    list them until memory runs out)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if hydra.sweeper.get("_target_") != f"{BasicSweeper.__module__}.{BasicSweeper.__name__}":
        return []
    params = [f"{k}={v}" for k, v in (hydra.sweeper.get("params") or {}).items()]
    args = params + list(OmegaConf.to_container(hydra.overrides.task, resolve=False))
    overrides = OverridesParser.create().parse_overrides(args)
    if most is not None and (n := job_count(overrides)) > most:
        raise TooManyJobs(n)
    return [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]


class TooManyJobs(ValueError):
    """A sweep of more jobs than asked for; `count` is how many (math.inf: a float range of step 0)."""

    def __init__(self, count: float):
        super().__init__(f"{count:,} jobs" if count != float("inf") else "endless jobs")
        self.count = count


def job_count(overrides) -> float:
    """How many jobs Hydra's basic sweeper makes of parsed `overrides`, without listing them: the
    product of each key's number of values (a later override of a key replaces an earlier one)."""
    import decimal
    import math

    from hydra.core.override_parser.types import ChoiceSweep, RangeSweep

    per_key = {}
    for o in overrides:
        v, n = o.value(), 1
        if isinstance(v, ChoiceSweep):
            n = len(v.list)
        elif isinstance(v, RangeSweep):  # Hydra's range(start, stop, step): ints, or floats stepped as Decimal
            exact = all(isinstance(x, int) for x in (v.start, v.stop, v.step))
            start, stop, step = (x if exact else decimal.Decimal(x) for x in (v.start, v.stop, v.step))
            try:
                steps = -(-(stop - start) // step) if exact else math.ceil((stop - start) / step)
                n = max(0, steps) if step != 0 else 0  # step 0: Hydra refuses the range when it lists it
            except (ZeroDivisionError, decimal.InvalidOperation, OverflowError, ValueError):  # 0, inf or nan
                n = 0 if step == 0 else math.inf
        per_key[o.get_key_element()] = n
    return math.prod(per_key.values())


def distinct_overrides(job_overrides) -> list[list[str]]:
    """Each job's overrides that not all jobs share (all of them for a lone job)."""
    from hydra.core.utils import filter_overrides

    lists = [filter_overrides(o) for o in job_overrides]
    shared = set.intersection(*map(set, lists)) if len(lists) > 1 else set()
    return [[o for o in overrides if o not in shared] for overrides in lists]


def _outcome(ret) -> str:
    """A finished job's line: its objective (what rft.runtime.main.main returned), or its error."""
    from hydra.core.utils import JobStatus

    if ret.status != JobStatus.COMPLETED:  # rft raised: Hydra raises it again once all have ended
        error = ret._return_value  # the public return_value raises it
        return f"failed: {type(error).__name__}: {next(iter(str(error).splitlines()), '')}"
    value = ret.return_value
    name = OmegaConf.select(ret.cfg, "objective", default="objective")
    return f"finished, {name} = {f'{value:.4g}' if isinstance(value, float) else value}"


def requeued(job) -> bool:
    """Whether a Slurm job whose attempt ended is queued again (requeued on preemption or at its
    time limit, conf/hydra/launcher/slurm.yaml): squeue still lists it. submitit may have read the
    ended attempt's state (FAILED, CANCELLED) from sacct and keeps it as the job's, finished."""
    import shutil
    import subprocess

    if "Slurm" not in type(job).__name__ or not shutil.which("squeue"):
        return False
    try:
        listed = subprocess.run(["squeue", "-h", "-j", str(job.job_id), "-o", "%T"], capture_output=True, text=True,
                                timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return False
    return bool(listed)


def _slurm_ended_it(job, looked: dict) -> bool:
    """Whether Slurm's line ending a Slurm job ("*** JOB 12 ON vm CANCELLED AT ... ***": scancel,
    its time limit, its node lost) came into the job's .err since the last look (`looked`: the
    offset read to, by job)."""
    if "Slurm" not in type(job).__name__:
        return False
    start = looked.get(job.job_id, 0)
    try:
        with open_regular(job.paths.stderr) as f:  # a FIFO in its place would hang the sweep
            f.seek(start)
            new = f.read()
    except OSError:  # no log yet, or no file
        return False
    # a line half written is read whole at the next look; a progress bar's \r ends its text too, so
    # a bar redrawn for hours (no \n) is not read again at every poll
    whole = new[: max(new.rfind(b"\n"), new.rfind(b"\r")) + 1]
    looked[job.job_id] = start + len(whole)
    return bool(SCHEDULER_LINE.search(whole.decode(errors="replace")))


def _ended(jobs: list, poll_s: float):
    """The jobs as they end (finished, failed or cancelled, and not requeued), in that order.

    submitit asks sacct for the jobs' states less and less often as they run (every age/2, up to
    every 10 min), so a job that Slurm ended was reported minutes later; Slurm's line in its log
    has sacct asked now, and at each poll for 30 s after (accounting may lag the line): one call
    for all the jobs."""
    import time

    pending, looked, ask_until = list(jobs), {}, 0.0
    while pending:
        if [j for j in pending if _slurm_ended_it(j, looked)]:  # (each job's log read: no short cut)
            ask_until = time.monotonic() + 30
        if time.monotonic() < ask_until:
            pending[0].get_info(mode="force")  # the watcher's one sacct call, for every job
        for job in [j for j in pending if j.done() and (j.paths.result_pickle.exists() or not requeued(j))]:
            pending.remove(job)
            yield job
        if pending:
            time.sleep(poll_s)


def watch(jobs, job_overrides, first_num: int, sweep_dir: str, poll_s: float = 1.0) -> None:
    """Print each job as submitted (number, submitit id, its own overrides, outputs, logs), then
    each job as it ends, in the order they end; wait for them all (a requeued job: until its last
    attempt ends). A job that ended without a result raises its error (submitit's) after that,
    the first by job number."""
    from submitit.core.utils import FailedJobError, UncompletedJobError

    nums = {}
    for i, (job, overrides) in enumerate(zip(jobs, distinct_overrides(job_overrides))):
        nums[job.job_id] = num = first_num + i
        own = " ".join(redact_overrides(overrides)) or "no overrides"
        print(f"[sweep] job {num} is {job.job_id} ({own}): outputs in {sweep_dir}/{num}, "
              f"log in {job.paths.stdout} and .err", flush=True)
    dead = {}
    for ended, job in enumerate(_ended(jobs, poll_s), 1):
        num = nums[job.job_id]
        # the local launcher's controller killed by a signal: its task runs on; stopped now, not
        # after results() has waited 15 s for the result file that will not come
        state = str(getattr(job, "state", ""))
        interrupted = state == "INTERRUPTED"
        left, unlooked = stop_orphans(job.job_id, job.paths.folder) if interrupted else ([], None)
        if state.startswith(SLURM_ENDED_IT):
            # Slurm ended the job's process, so no result file is coming: results() need not wait
            # its 15 s for one that a shared filesystem shows late (a job that ran to its end,
            # COMPLETED or FAILED with rft's error, may still have one on the way)
            job._results_timeout_s = 0
        try:
            what = _outcome(job.results()[0])
        except (UncompletedJobError, FailedJobError) as e:
            dead[num] = e
            m = _UNCOMPLETED.search(str(e))
            what = no_result(m["state"]) if m else "failed in submitit"
            what += "".join(f"; its process {pid}, which outlived it, stopped" for pid in left)
            what += (f"; what it left running could not be looked for ({unlooked}): stop any process whose "
                     f"environment holds SUBMITIT_LOCAL_JOB_ID={job.job_id} (`ps eww`)" if unlooked else "")
        print(f"[sweep] job {num} ({job.job_id}) {what} [{ended}/{len(jobs)} ended]", flush=True)
    if dead:
        raise dead[min(dead)]


def install() -> None:
    """Make hydra-submitit-launcher's `launch` report its jobs (`watch`) and explain a dead one, and
    keep a secret typed on the command line out of what the launchers write (rft.reporting.redact)."""
    from hydra.core.plugins import Plugins

    # Hydra's plugin scan executes every hydra_plugins module once (again, if it was imported
    # before), defining the launcher classes anew: scan first, then wrap what the scan defined
    Plugins.instance()
    # the launchers log each job's overrides (Hydra's "#0 : ..." lines): a secret among them masked
    for name in ("hydra_plugins.hydra_submitit_launcher.submitit_launcher", "hydra._internal.core_plugins.basic_launcher"):
        logging.getLogger(name).addFilter(_masks_secrets)
    try:
        import submitit
        from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
        from submitit.core.utils import FailedJobError, UncompletedJobError
    except ImportError:  # the launcher plugin is not installed: nothing to wrap
        return
    launch = BaseSubmititLauncher.launch
    if getattr(launch, "rft_watches", False):
        return

    def launch_and_watch(self, job_overrides, initial_job_idx):
        sweep_dir = str(self.config.hydra.sweep.dir)
        map_array = submitit.AutoExecutor.map_array
        # Hydra's sweeper wrote it just now, the command line's secrets whole: masked before any job waits in a queue
        redact_file(Path(sweep_dir) / "multirun.yaml")
        if typed_secrets(self.config.hydra.overrides.task):
            private_folder(str(self.params["submitit_folder"]), sweep_dir)

        # The plugin's launch submits with executor.map_array, then waits on each job's results()
        # in turn. For the length of this call map_array also watches the jobs it submitted to
        # their end, so the plugin's own wait finds them done and returns their results in
        # submission order, as Hydra expects; the submission stays the plugin's.
        def submit_and_watch(executor, fn, *args):
            jobs = map_array(executor, fn, *args)
            watch(jobs, job_overrides, initial_job_idx, sweep_dir)
            return jobs

        submitit.AutoExecutor.map_array = submit_and_watch
        try:
            return launch(self, job_overrides, initial_job_idx)
        except (UncompletedJobError, FailedJobError) as e:
            # the paragraph alone, status 1 (Hydra would add its HYDRA_FULL_ERROR line to an exception)
            print(explain(e, sweep_dir), file=sys.stderr, flush=True)
            sys.exit(1)
        finally:
            del submitit.AutoExecutor.map_array  # submitit's own (Executor's) again

    launch_and_watch.rft_watches = True
    BaseSubmititLauncher.launch = launch_and_watch


def _masks_secrets(record: logging.LogRecord) -> bool:
    """A logging filter: the record's message with its secrets masked (rft.reporting.redact.redact_text)."""
    record.msg, record.args = redact_text(record.getMessage()), ()
    return True


def private_folder(submitit_folder: str, sweep_dir: str) -> Path | None:
    """Make the sweep's submitit folder (<sweep>/.submitit: submitit_folder up to its first %-field)
    readable by its owner alone, before submitit writes into it; returns it (None: a folder outside
    the sweep's, a shared one perhaps, is left as it is). Each job's pickles hold its call, the
    sweep's config and the job's overrides in it: a secret typed on the command line whole (the job
    needs it), written with the umask's mode, again at each requeue, and its result too."""
    parts = Path(submitit_folder).parts
    fixed = Path(*parts[:next((i for i, p in enumerate(parts) if "%" in p), len(parts))])
    sweep = Path(sweep_dir).absolute()
    if not fixed.absolute().is_relative_to(sweep) or fixed.absolute() == sweep:
        return None
    fixed.mkdir(parents=True, exist_ok=True)
    os.chmod(fixed, 0o700)
    return fixed
