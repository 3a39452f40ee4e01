"""Running a job: main.py (plan, dry run, Ray, stages in order), runner.py (one stage: its
parts' start and end), schedule.py (its step loop), explorers.py (the explorer pool: syncs,
restarts), saving.py (resume, save), faults.py (what a failure says), actors.py (Ray,
in-process, rank groups), checkpoint.py, rundir.py (run records, re-runs, the stage cache),
callbacks.py (what Hydra calls first), export.py, bench.py, reaper.py."""
