"""Slurm's warning that it is about to stop a job (a preemption, or the time limit coming): the
step in progress ends, its checkpoint is saved, then submitit requeues the job, so the requeued
job goes on from the step it was at, not from its last regular checkpoint (up to
trainer.save_interval steps back: hours at 7B).

How the warning arrives. hydra/launcher=slurm asks Slurm for SIGUSR2 `signal_delay_s` before the
time limit (`#SBATCH --signal=USR2@120`); a cluster with PreemptParameters=send_user_signal sends
it on preemption too. submitit's handler in the driver (SignalHandler.checkpoint_and_try_requeue)
requeues the job (`scontrol requeue`) and exits at once: it knows nothing of our checkpoints. And
Slurm sends the signal to every process of the job step, not only the driver: Ray's GCS, raylet
and actors, reward workers, vLLM's engine processes, for all of which SIGUSR2's default action is
to terminate (a Ray run lost its actors at the signal; a save after it would fail).

launchers/ray_slurm.sbatch (one run over several nodes, no submitit) asks for the signal to its batch
shell alone (`--signal=B:USR2@120`: Ray's processes, in job steps of their own, never get it), which
forwards it to the driver, and sets RFT_REQUEUE_SIGNAL=USR2: there `requeue_self` stands in for
submitit's handler (`scontrol requeue` of the job, which runs the same script again and resumes).

So `watch()`, around a run in a submitit Slurm job or such a script (anywhere else it does nothing):
- blocks the signal in the driver's main thread before anything starts: every thread and process
  started afterwards inherits it blocked (pending, never acted on), so nothing but the driver's
  watcher thread, which takes it with sigwait, is stopped or disturbed by it;
- while a stage's step loop runs (`steps`), the schedule ends the step in progress, saves its
  checkpoint (the usual save: written whole then renamed into place; every trainer rank saves
  because the driver asks them all, as at any checkpoint, so no rank decides alone), and then
  calls `requeue`: submitit's own handler, in the main thread, as before;
- outside a step loop (setting up, between stages, after the last step) no step is lost: the main
  thread runs submitit's handler at once, as before;
- if the step and its save have not ended REQUEUE_MARGIN_S before Slurm stops the job (its end
  time: the time limit, or on preemption the signal's time + the partition's GraceTime), the
  watcher requeues the job itself, so a late save never costs the requeue: Slurm then stops the
  job, the save in progress is cut (step_<N>.tmp, never a step_<N>), and the newest whole
  checkpoint stays the resume point.

SIGTERM saves nothing: outside Slurm it is `kill`, `timeout`, another scheduler or the studio's stop,
which must stop the run at once (the studio sends SIGKILL 15 s later, less than a large model's step
and save take, so a save begun then would mostly be cut anyway); inside Slurm it comes at the very
end (KillWait, 30 s by default, before SIGKILL), too late for a save. Slurm's early warning is the
signal above. Where nothing else handles SIGTERM (`sigterm_stops`), it stops the run as Ctrl-C does,
at once, so that the run can say where it stopped, what is saved and how to resume (it died without
a word); in a submitit job (whose own handler ignores it, waiting for Slurm's warning) and in a job
`watch` watches, it is left as it was.
"""

from __future__ import annotations

import _thread
import logging
import os
import signal
import sys
import threading
from contextlib import contextmanager, nullcontext

log = logging.getLogger(__name__)

# what is kept of the time left for the requeue itself: submitit's `scontrol requeue` (it waits up
# to 60 s for it, though it takes well under a second on a sane controller) and Slurm taking the job
# back before its end time stops it (TIMEOUT, or cancelled by the preemption: not requeued)
REQUEUE_MARGIN_S = 30.0

current: Preemption | None = None  # the watcher of this process's run (None: not a Slurm job that requeues itself)


class Refused(SystemExit):
    """submitit did not requeue the job (it reached its time limit hydra.launcher.max_num_timeout
    times): the job ends. SystemExit's kind, as submitit's requeue is, so that no `except Exception`
    on the way (a checkpoint's save, a trainer's load, Hydra's job) takes it for its own failure;
    rft.runtime.main says `paragraph` (its UncompletedJobError ended the sweep with a traceback)."""

    def __init__(self, error: BaseException):
        super().__init__(1)
        self.reason = str(error).strip().rstrip(".")
        self.by_script = isinstance(error, RequeueFailed)  # requeue_self's, not submitit's

    def paragraph(self, resume_point: str, sweep: str | None) -> str:
        if self.by_script:
            return (f"Slurm's warning came (SIGUSR2, the job's time limit near or a preemption) and the job could not "
                    f"requeue itself: {self.reason}. The job ends here; {resume_point}. To go on from it, submit the "
                    f"same job script with the same overrides again (sbatch launchers/ray_slurm.sbatch ...): it resumes "
                    f"from that checkpoint.")
        again = (f"run the sweep again with hydra.sweep.dir={sweep} (its finished jobs are skipped; this one resumes "
                 f"from that checkpoint)" if sweep else "run the same command again")
        return (f"Slurm's warning came (SIGUSR2, the job's time limit near or a preemption) and submitit did not "
                f"requeue the job: {self.reason} (a job outlives its time limit, hydra.launcher.timeout_min="
                f"{_launcher_key('timeout_min')}, by a requeue hydra.launcher.max_num_timeout="
                f"{_launcher_key('max_num_timeout')} times). The job ends here; {resume_point}. To go on from it, "
                f"{again}, with a larger hydra.launcher.timeout_min or hydra.launcher.max_num_timeout.")


class Preemption:
    """The watcher of one run: `sig` the signal submitit waits for, `requeue_fn` submitit's handler
    of it (requeues, then exits the process), `window_s` how long Slurm gives between the signal and
    its stop where `time_left()` cannot tell (None): hydra.launcher.signal_delay_s."""

    def __init__(self, sig: int, requeue_fn, window_s: float, time_left=lambda: None):
        self.sig, self.requeue_fn, self.window_s, self.time_left = sig, requeue_fn, window_s, time_left
        self.deadline_s: float | None = None  # set at the signal (`_deadline_s`)
        self.signalled = False  # what the main thread acts on (set once the watcher has said so)
        self._noticed = False  # read and set by the watcher's thread only
        self.say, self.title = _print, None  # set by `steps` while a step loop runs
        self._lock = threading.Lock()
        self._settled = threading.Event()  # the job is requeued (or the run is over): the watcher waits no more
        self._error: BaseException | None = None  # submitit's refusal to requeue, raised by the thread
        self._thread: threading.Thread | None = None
        self._previous = None
        self._stopping = False
        self._now = False  # the watcher asks the main thread to requeue now (`_in_main`)

    # ------------------------------------------------------------------ set up and taken down

    def start(self) -> None:
        self._previous = signal.signal(self.sig, self._in_main)
        signal.pthread_sigmask(signal.SIG_BLOCK, {self.sig})
        self._thread = threading.Thread(target=self._wait, name="rft-preemption", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._settled.set()
        if self._thread.is_alive():
            signal.pthread_kill(self._thread.ident, self.sig)  # wakes its sigwait
            self._thread.join(5)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {self.sig})
        signal.signal(self.sig, self._previous)

    # ------------------------------------------------------------------ the watcher thread

    def _wait(self) -> None:
        while True:
            signal.sigwait({self.sig})
            if self._stopping:
                return
            self._notice()

    def _notice(self) -> None:
        """The signal came (a second one is the same warning: ignored)."""
        if self._noticed:
            return
        self._noticed = True
        self._freeze_verdict()
        self.deadline_s = self._deadline_s()
        with self._lock:  # said before the main thread may act on it (`due` says which step is saved)
            in_loop = self.title is not None
            if in_loop:
                self.tell(f"[{self.title}] preemption signal ({signal.Signals(self.sig).name}): the step in "
                          f"progress ends and its checkpoint is saved, then the job is requeued (if that takes "
                          f"more than {self.deadline_s:.0f} s, it is requeued without that checkpoint)")
            self.signalled = True
        if not in_loop:  # no step to save: submitit's handler, in the main thread, as before
            self.tell("preemption signal: no step in progress to save; the job is requeued now")
            self._interrupt_main()
        if not self._settled.wait(self.deadline_s):
            self.tell(f"[{self.title or 'rft'}] preemption signal: the step and its checkpoint did not end within "
                      f"{self.deadline_s:.0f} s ({REQUEUE_MARGIN_S:.0f} s before Slurm stops the job): the job is "
                      f"requeued now, without it; it resumes from its newest whole checkpoint")
            self._requeue_here()
            self._interrupt_main()  # the main thread exits at its next chance

    def tell(self, text: str) -> None:
        """On the console (the stage's monitor while a step loop runs) and in the run's log."""
        self.say(text)
        log.info(text)  # the log file's level (the console's is WARNING: the line is printed once)

    def _interrupt_main(self) -> None:
        """`_in_main` in the main thread at its next bytecode (a Python handler's call, as a signal's)."""
        self._now = True
        _thread.interrupt_main(self.sig)

    def _deadline_s(self) -> float:
        """How long the step and its save may take from now: until Slurm stops the job, less
        REQUEUE_MARGIN_S. Slurm's end time of the job says when (a time limit's, or on preemption now +
        the partition's GraceTime, which can be shorter than signal_delay_s); where it cannot be read,
        signal_delay_s (the time limit's warning comes that long before it)."""
        left = self.time_left()
        window = self.window_s if left is None else left
        return max(window - REQUEUE_MARGIN_S, window / 2)

    def _freeze_verdict(self) -> None:
        """submitit tells a time limit (counted against max_num_timeout) from a preemption by how
        long the job has run when its handler is called: taken now, at the signal, so that the save
        in between does not turn a preemption into a timeout."""
        handler = getattr(self.requeue_fn, "__self__", None)
        if callable(getattr(handler, "has_timed_out", None)):
            verdict = handler.has_timed_out()
            handler.has_timed_out = lambda: verdict

    def _requeue_here(self) -> None:
        """submitit's handler in this thread: its exit ends only the thread (Slurm stops the job)."""
        with self._lock:
            if self._settled.is_set():
                return
            self._settled.set()
        try:
            self.requeue_fn(self.sig, None)
        except SystemExit:
            pass
        except Exception as e:  # submitit would not requeue (timed out too often): the main thread raises it
            self._error = e

    # ------------------------------------------------------------------ the main thread

    def _in_main(self, signum, frame) -> None:
        if self._now:  # from the watcher: requeue now
            self.requeue()
        else:  # delivered to a thread that started before the signal was blocked: the watcher's
            signal.pthread_kill(self._thread.ident, self.sig)

    def requeue(self) -> None:
        """submitit's handler: `scontrol requeue`, then the process exits (SystemExit); or its
        UncompletedJobError, where it does not requeue (timed out max_num_timeout times)."""
        with self._lock:
            first = not self._settled.is_set()
            self._settled.set()
        if first:
            try:
                self.requeue_fn(self.sig, None)
            except Exception as e:  # (its requeue exits: SystemExit)
                self._error = e
        if self._error is not None:
            raise Refused(self._error) from None
        sys.exit(-1)  # requeued by the watcher already: as submitit's handler exits

    @contextmanager
    def steps(self, title: str, say):
        """A stage's step loop runs: the signal is answered at the end of a step (`due`, then
        `requeue`). A step or save that fails after the signal (an actor another program's signal
        killed, say) requeues the job as before rather than failing it."""
        with self._lock:
            self.title, self.say = title, say
        try:
            yield
        except Exception as e:
            if self.signalled and not self._settled.is_set():
                self.tell(f"[{title}] preemption signal: the step or its checkpoint failed ({type(e).__name__}: "
                          f"{e}); the job is requeued without it")
                self.requeue()
            raise
        finally:
            with self._lock:
                self.title, self.say = None, _print
        if self.signalled:  # came after the last step's end: nothing is left unsaved
            self.requeue()


def _print(text: str) -> None:
    print(text, flush=True)  # a Slurm log is a file, written in blocks: it would hold the line back


def signalled() -> bool:
    """Whether Slurm's warning came (the step in progress will be saved, then the job requeued)."""
    return current is not None and current.signalled


def due(step: int) -> bool:
    """Whether step `step`, ending now, saves a checkpoint and then requeues the job (Slurm's
    warning came); says so."""
    _progress["step"] = step  # (every step ends here: what a SIGTERM's paragraph names)
    p = current
    if not signalled():
        return False
    p.tell(f"[{p.title}] preemption signal: saving the checkpoint at step {step}, then requeue")
    return True


def requeue_if_signalled() -> None:
    """After a step with a checkpoint: requeue the job if the warning came."""
    if signalled():
        current.requeue()


@contextmanager
def steps(title: str, say):
    """Around a stage's step loop (rft.runtime.runner): `Preemption.steps` where Slurm's warning is
    watched; and the stage's steps are counted for `where`."""
    _progress.update(title=title, step=None)
    with current.steps(title, say) if current is not None else nullcontext():
        yield


# the stage whose steps run (or ran last in this process) and its last step to end (`due`)
_progress: dict = {"title": None, "step": None}


def where() -> str:
    """Where the run is, for a paragraph: "after step 320 of stage sft_warmup"."""
    title, step = _progress["title"], _progress["step"]
    if title is None:
        return "before the first stage's steps began"
    return f"in stage {title}, before its first step ended" if step is None else f"after step {step} of stage {title}"


class Terminated(KeyboardInterrupt):
    """SIGTERM stopped the run (`sigterm_stops`). Ctrl-C's kind: what lets a KeyboardInterrupt
    through (every `except Exception` on the way, a reward scorer that answers None for any other
    BaseException) lets this through too; rft.runtime.main says `where` it stopped and how to resume."""

    def __init__(self, where: str):
        super().__init__(where)
        self.where = where


@contextmanager
def sigterm_stops():
    """Around a run: SIGTERM raises `Terminated` in the main thread, as Ctrl-C raises
    KeyboardInterrupt, where nothing else handles it: not in a submitit job (its handler ignores
    SIGTERM: Slurm's preemption sends it, and the job is requeued at the warning `watch` answers),
    nor in a Slurm job `watch` watches (it comes when Slurm stops the job, as it did). A second
    SIGTERM, and one to a process forked from this one, ends the process at once, as before."""
    if (threading.current_thread() is not threading.main_thread() or current is not None
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return
    owner = os.getpid()

    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if os.getpid() != owner:  # a forked copy (it inherits the handler): ended as without it
            os.kill(os.getpid(), signal.SIGTERM)
            return
        global _terminated
        _terminated = where()
        raise Terminated(_terminated)

    global _sigterm, _terminated
    _terminated = None
    signal.signal(signal.SIGTERM, stop)
    _sigterm = stop
    try:
        yield
    finally:
        _sigterm = None
        if signal.getsignal(signal.SIGTERM) is stop:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


_sigterm = None  # sigterm_stops' handler while it is in force
_terminated = None  # where the run was when its SIGTERM came (`where`), None before one


def terminated(e: BaseException | None) -> str | None:
    """Where SIGTERM stopped the run, for exception `e` on its way out (None: not SIGTERM): a
    `Terminated`, or the plain KeyboardInterrupt that ray.get raises in its place (it turns any
    exception of a signal handler into one: a cluster=local run waits in ray.get most of the time)."""
    if isinstance(e, Terminated):
        return e.where
    return _terminated if isinstance(e, KeyboardInterrupt) else None


def retake_sigterm() -> None:
    """After ray.init, which puts handlers of its own on SIGTERM in the driver (ray.init's, which
    exits with status 15, and beneath it absl's, which prints a stack trace: the run ended so
    without the paragraph), `sigterm_stops`' is put back."""
    if _sigterm is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _sigterm)


def ray_exit_as_terminated(e: SystemExit) -> Terminated | None:
    """The SIGTERM that came while ray.init ran, before `retake_sigterm`: Ray's handler, put on as
    it starts, exits with status 15 (the run ended without a word). Where `sigterm_stops` is on,
    that is its stop, said as any other (None: another exit, or SIGTERM not this run's to say)."""
    if e.code == signal.SIGTERM and _sigterm is not None:
        return Terminated(where())
    return None


@contextmanager
def watch():
    """Around a run: the watcher of Slurm's warning in a submitit Slurm job or a job script that forwards it
    (RFT_REQUEUE_SIGNAL); elsewhere nothing."""
    global current
    sig, handler = _submitit_handler()
    if handler is None or current is not None or threading.current_thread() is not threading.main_thread():
        yield
        return
    current = Preemption(sig, handler, _signal_delay_s(), _slurm_time_left)
    current.start()
    try:
        yield
    finally:
        current.stop()
        current = None


def _submitit_handler():
    """(the signal, submitit's requeueing handler of it) in a submitit Slurm job; (the signal
    named by RFT_REQUEUE_SIGNAL, `requeue_self`) in another Slurm job whose script forwards it
    (launchers/ray_slurm.sbatch); (None, None) elsewhere, or where something else handles it."""
    import os

    name = os.environ.get("RFT_REQUEUE_SIGNAL", "")
    if name and os.environ.get("SLURM_JOB_ID") and os.environ.get("SUBMITIT_EXECUTOR") != "slurm":
        return getattr(signal, "SIG" + name.upper().removeprefix("SIG")), requeue_self
    if os.environ.get("SUBMITIT_EXECUTOR") != "slurm":
        return None, None
    from submitit import JobEnvironment
    from submitit.core.job_environment import SignalHandler

    sig = getattr(signal, "SIG" + JobEnvironment.USR_SIG)  # SUBMITIT_PREEMPT_SIGNAL, USR2 by default
    handler = signal.getsignal(sig)
    return (sig, handler) if isinstance(getattr(handler, "__self__", None), SignalHandler) else (None, None)


class RequeueFailed(RuntimeError):
    """`scontrol requeue` of the job failed (`requeue_self`)."""


def requeue_self(signum, frame) -> None:
    """submitit's handler where submitit is not there (launchers/ray_slurm.sbatch): `scontrol requeue`
    of this Slurm job (Slurm stops it and queues it again: the same script, the same overrides, so the
    run resumes from its newest checkpoint), then the process exits as submitit's does."""
    import os
    import subprocess

    job = os.environ["SLURM_JOB_ID"]
    # said before, not after: Slurm may stop this step the moment it requeues the job, and a line
    # printed after `scontrol requeue` returns is then never written
    _print(f"rft: requeueing Slurm job {job} (scontrol requeue): it runs again and resumes from its newest checkpoint")
    try:
        r = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
        failed = r.returncode != 0 and (r.stderr or r.stdout).strip()
    except (OSError, subprocess.SubprocessError) as e:
        failed = str(e)
    if failed:  # (a job not requeueable: submitted with --no-requeue where the cluster's JobRequeue=0)
        raise RequeueFailed(f"`scontrol requeue {job}` failed: {failed}")
    sys.exit(-1)


def _slurm_time_left() -> float | None:
    """Seconds until Slurm stops this job (its EndTime, from squeue), or None where that cannot
    be read."""
    import os
    import subprocess
    from datetime import datetime

    try:
        out = subprocess.run(["squeue", "-h", "-j", os.environ["SLURM_JOB_ID"], "-o", "%e"], capture_output=True,
                             text=True, timeout=10, env={**os.environ, "SLURM_TIME_FORMAT": "standard"}).stdout
        return (datetime.fromisoformat(out.strip()) - datetime.now()).total_seconds()
    except (KeyError, OSError, ValueError, subprocess.SubprocessError):  # not in Slurm, no squeue, "Unknown"
        return None


def _signal_delay_s() -> float:
    """hydra.launcher.signal_delay_s of this job: how long before its time limit Slurm warns."""
    delay = _launcher_key("signal_delay_s")
    return 90.0 if delay is None else float(delay)  # not composed by Hydra's launcher: submitit's own default


def _launcher_key(name: str):
    """hydra.launcher.<name> of this job (None where Hydra's launcher did not compose it)."""
    from hydra.core.hydra_config import HydraConfig

    try:
        return HydraConfig.get().launcher.get(name)
    except Exception:
        return None
