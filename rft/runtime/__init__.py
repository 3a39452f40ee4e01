"""Running a job: main.py (plan, dry run, Ray, stages in order), runner.py (one stage's
schedule and faults), actors.py (Ray, in-process, rank groups), checkpoint.py, rundir.py (run
records, re-runs, the stage cache), callbacks.py (what Hydra calls first), export.py, bench.py,
reaper.py."""
