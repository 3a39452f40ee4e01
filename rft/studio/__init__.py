"""rft studio: one local web page to compose a run from the config groups (with its batch plan and
errors live), launch it or a sweep, watch the curves of several runs side by side, and read the
rollouts. `python -m rft.studio` (or `make studio`); see README.md, "The studio".

    compose.py   groups, schema keys and one composition with its plan (no web code)
    runs.py      runs and sweeps under the checkpoint root, curves, a sweep's table, a config diff, CSV
    index.py     each run's files read again only when they change; is a run's process alive
    rollouts.py  a run's stored experiences and eval trajectories
    groups.py    a GRPO group side by side: rewards, advantages (the stage's advantage_fn), reference answers
    dashboard.py every metric of the runs asked for, stages end to end, mean ± std per configuration
    imports.py   the dotted paths a config imports from outside the project (listed, confirmed)
    launch.py    runs started from the page: child processes, their console, stop, kept in jobs.json
    guard.py     which requests it answers: Host, Origin, Sec-Fetch-Site, JSON, size, the token
    bodies.py    what a POST body may say: groups, options, one-line keys and values, no hydra.*
    app.py       the FastAPI app: the pages, the JSON the pages read
"""
