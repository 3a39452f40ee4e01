"""Where the explorer and trainer objects live: Ray actors, or plain objects in this process.

Both wrappers have the same three methods, so the loop in `rft.runner` never asks which one it has:
`submit(method, *args)` starts a call and returns a future, `get(future)` waits for it, and
`call(method, *args)` does both. With Ray, a future passed as an argument to another actor's call
travels between the actors directly (the object store), not through this process.
"""

from __future__ import annotations

import logging
from pathlib import Path


def setup_actor_logging(log_dir: str, name: str, level: str) -> None:
    """Send this process's `rft` logs to <run>/log/<name>.log (one file per actor)."""
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger("rft")
    logger.setLevel(level)
    handler = logging.FileHandler(Path(log_dir) / f"{name}.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)


def _build(cls, log_dir, name, level, args):
    setup_actor_logging(log_dir, name, level)
    return cls(*args)


class InlineActor:
    def __init__(self, cls, *args, name: str, log_dir: str, level: str, num_cpus: int = 1):
        self.obj = _build(cls, log_dir, name, level, args)

    def submit(self, method: str, *args):
        return getattr(self.obj, method)(*args)

    def get(self, future):
        return future

    def call(self, method: str, *args):
        return self.submit(method, *args)

    def kill(self) -> None:
        self.obj = None


class _Host:
    """The Ray-side shell: builds the object after setting up its log file, forwards calls."""

    def __init__(self, cls, log_dir, name, level, args):
        self.obj = _build(cls, log_dir, name, level, args)

    def run(self, method, *args):
        return getattr(self.obj, method)(*args)


class RayActor:
    def __init__(self, cls, *args, name: str, log_dir: str, level: str, num_cpus: int = 1):
        import ray

        self._ray = ray
        host = ray.remote(num_cpus=num_cpus, max_concurrency=1)(_Host)
        self.actor = host.options(name=name).remote(cls, log_dir, name, level, args)

    def submit(self, method: str, *args):
        return self.actor.run.remote(method, *args)

    def get(self, future):
        return self._ray.get(future)

    def call(self, method: str, *args):
        return self.get(self.submit(method, *args))

    def kill(self) -> None:
        self._ray.kill(self.actor)


ACTOR_BACKENDS = {"ray": RayActor, "inline": InlineActor}
