"""experiments/claims_overopt/steps.py: claim 4's table of the gold eval at steps and the proxy over windows."""

from pathlib import Path

from conftest import load_script

from rft.reporting.report import Job


def _script():
    return load_script("experiments/claims_overopt/steps.py", "steps")


def test_the_windows_run_from_the_column_before_and_their_means():
    mod = _script()
    # column 0 is step 1 alone (the starting policy's rollouts); each other column the steps after the one before
    assert mod.WINDOWS == [(1, 1), (1, 3), (4, 5), (6, 10), (11, 20), (21, 30)]
    job = Job("0", Path("."), metrics=[{"step": 0, "eval/accuracy": 0.1}] +
              [{"step": s, "reward/mean": float(s)} for s in range(1, 31)])
    # steps 4 and 5: (4 + 5) / 2 = 4.5; 21..30: (21 + 30) / 2 = 25.5; a window with no values: None
    assert mod.window_mean(job, "reward/mean", 4, 5) == 4.5
    assert mod.window_mean(job, "reward/mean", 21, 30) == 25.5
    assert mod.window_mean(job, "actor/kl", 1, 3) is None
    assert mod.cell([1.0, 2.0, 3.0]) == "2.000 ± 1.000"  # std over seeds (N-1): sqrt((1 + 0 + 1) / 2) = 1
    assert mod.cell([None, None]) == "-"
