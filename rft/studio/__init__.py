"""rft studio: one local web page to compose a run from the config groups (with its batch plan and
errors live), launch it or a sweep, watch the curves of several runs side by side, and read the
rollouts. `python -m rft.studio` (or `make studio`); see README.md, "The studio".

    compose.py   groups, schema keys and one composition with its plan (no web code)
    runs.py      runs and sweeps under the checkpoint root, curves, a sweep's table
    rollouts.py  a run's stored experiences and eval trajectories
    launch.py    runs started from the page: child processes, their console, stop
    app.py       the FastAPI app: the token check, the pages, the JSON the pages read
"""
