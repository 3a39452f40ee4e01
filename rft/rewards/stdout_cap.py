"""What reward functions print, capped at CAP_CHARS a Scorer (a taskset's rewards in an explorer, or in the
reward server): past it, what they print is left out, with one note where it would have gone.

A reward is called for every response, so a print in it is multiplied: a debugging print of 1 MB
in the tiny default wrote 2.9 GB to the console in 20 steps (22 s; 2,760 calls), and the console is
often a file (a Slurm job's .out, the studio's log of a launch, a Ray worker's log), on the disk the
checkpoints need. Only the calls' own writes count (a thread inside `capped`): the run's own lines,
printed meanwhile by other threads, pass as before. sys.stderr is capped as sys.stdout, against the same
budget (print(..., file=sys.stderr), warnings, logging with no handler of the run's: 1 MB a call filled
a Slurm job's .err as well). Not capped: what reaches the console past sys.stdout and sys.stderr (threads
a reward starts itself, sys.stdout.buffer, os.write(1, ...), a logging handler made before the first call,
which holds the stream itself: the run's console handler)."""

from __future__ import annotations

import logging
import sys
import threading
from contextlib import contextmanager

log = logging.getLogger(__name__)

CAP_CHARS = 2**20  # ~1 MB: thousands of lines of a reward's debugging, a step or two of a large run

_inside = threading.local()  # .call: (the reward's name, its Budget) of the call this thread is in
_lock = threading.Lock()
_running = 0  # calls inside `capped` now, in every thread


class Budget:
    """What the rewards of one Scorer printed so far (characters), and whether the note was said."""

    def __init__(self):
        self.printed, self.noted = 0, False


class _Capped:
    """sys.stdout (and sys.stderr) while rewards may print: a write from a thread inside `capped`
    counts against CAP_CHARS; every other write, and every other attribute, is the stream's own."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        call = getattr(_inside, "call", None)
        if call is None:
            return self._stream.write(text)
        name, budget = call
        with _lock:
            room = max(CAP_CHARS - budget.printed, 0)
            budget.printed += len(text)
            if len(text) <= room:
                return self._stream.write(text)
            note, budget.noted = not budget.noted, True
        if room:
            self._stream.write(text[:room])
        if note:
            said = (f"\nrft: reward {name!r} printed more than {CAP_CHARS:,} characters: what this taskset's rewards "
                    f"print from here on is left out (every response calls them, so their prints would fill the "
                    f"console and the disk its log is on). Print a sample of the calls, or write to a file of your own.\n")
            self._stream.write(said)
            log.info(said.strip())
        return len(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextmanager
def capped(name: str, budget: Budget):
    """Around a call of reward `name`: what this thread prints meanwhile (sys.stdout, sys.stderr) counts
    against `budget` (its Scorer's) and is left out past CAP_CHARS."""
    global _running
    with _lock:
        # (again after something put its own in place: a test's capture); none: print writes nothing.
        # Only while no call runs: a call's redirect_stdout (a code reward capturing its program's
        # output) is sys.stdout for every thread meanwhile, and wrapped, that capture lost what it
        # was to compare past the cap (reward 0 for a right answer)
        for which in ("stdout", "stderr") if not _running else ():  # (`name` is the reward's)
            stream = getattr(sys, which)
            if stream is not None and not isinstance(stream, _Capped):
                setattr(sys, which, _Capped(stream))
        _running += 1
    before, _inside.call = getattr(_inside, "call", None), (name, budget)
    try:
        yield
    finally:
        _inside.call = before
        with _lock:
            _running -= 1
