"""Where the explorer and trainer objects live: Ray actors, or plain objects in this process.

Both wrappers have the same three methods, so the loop in `rft.runtime.runner` never asks which one it has:
`submit(method, *args)` starts a call and returns a future, `get(future)` waits for it, and
`call(method, *args)` does both. With Ray, a future passed as an argument to another actor's call
travels between the actors directly (the object store), not through this process.
"""

from __future__ import annotations

import functools

import datetime
import gc
import logging
import os
import socket
from contextlib import contextmanager
from pathlib import Path

from rft.config import frozen
from rft.errors import ConfigError, RunError
from rft.registry import Registry


def setup_actor_logging(log_dir: str, name: str, level: str) -> logging.Handler:
    """Send this process's `rft` logs to <run>/log/<name>.log (one file per actor); the handler,
    for an actor that ends before its process does (cluster=inline) to take away."""
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger("rft")
    logger.setLevel(level)
    handler = logging.FileHandler(Path(log_dir) / f"{name}.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    # the pid lets a person (or a test) find, inspect or kill this actor's process; the host and
    # Ray node, which actor a multi-node run placed where (memory sync shares memory within a node)
    from rft.sync.weights import node_id

    node = node_id()  # "" outside Ray
    logger.info("%s started in process %d%s", name, os.getpid(),
                f" on host {socket.gethostname()}, Ray node {node}" if node else "")
    return handler


# a third threshold no build reaches: a full collection runs after that many middle ones
FULL_COLLECTIONS_OFF = 10**9


@contextmanager
def long_lived():
    """What is made inside lives as long as the process (modules, the model, the tasks): no full
    garbage collection while it is made, one after, and then it is frozen (gc.freeze), so later
    full collections scan only what the steps make. Without this a Ray actor spent ~1.5 s of its
    start on 2 CPUs in full collections over its growing heap, and the last of them landed in
    the first steps (a 355 ms pause inside an explore call). Young collections go on inside (they
    free the loading code's short-lived cycles, which may hold tensors). Cycles among frozen
    objects are not collected until gc.unfreeze (StageRun.close, for the next stage of a
    one-process run)."""
    young, middle, full = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_COLLECTIONS_OFF)
    try:
        yield
    finally:
        gc.set_threshold(young, middle, full)
    # only what was made whole: a stage that failed to start (a config error as its engine loads)
    # is garbage, and frozen it outlived the interpreter's shutdown (triton's bindings then printed
    # ~30 lines of "nanobind: leaked ..." under the error's paragraph)
    gc.collect()
    gc.freeze()


def _build(cls, threads, args):
    """`cls`: a class, or "module.Class" to import here (the trainer: the driver of a Ray run
    never imports torch, saving a third of a GB)."""
    with long_lived():
        import torch

        if isinstance(cls, str):
            import importlib

            module, _, attr = cls.rpartition(".")
            cls = getattr(importlib.import_module(module), attr)

        # torch's thread count, chosen for the actor by rft.plan.placement.torch_threads
        torch.set_num_threads(threads)
        return cls(*args)


class InlineActor:
    def __init__(self, cls, *args, name: str, log_dir: str, level: str, threads: int = 1, **resources):
        self.name = name
        # taken away by kill: one process may run stage after stage (a sweep's jobs under Hydra's
        # basic launcher), and a later run's lines must not land in an earlier run's files
        self.log_handler = setup_actor_logging(log_dir, name, level)
        try:
            self.obj = _build(cls, threads, args)
        except BaseException:
            self.kill()
            raise

    def submit(self, method: str, *args):
        return getattr(self.obj, method)(*args)

    def get(self, future, timeout: float | None = None):
        return future

    def call(self, method: str, *args):
        return self.submit(method, *args)

    def kill(self) -> None:
        self.obj = None
        logging.getLogger("rft").removeHandler(self.log_handler)
        self.log_handler.close()


class _Host:
    """The Ray-side shell: builds the object after setting up its log file, forwards calls."""

    def __init__(self, cls, log_dir, name, level, threads, args, devices=None):
        setup_actor_logging(log_dir, name, level)  # for the life of the process
        if devices is not None:
            _pin(devices, name)
        self.obj = _build(cls, threads, args)

    def run(self, method, *args):
        return getattr(self.obj, method)(*args)


def _pin(devices: str, name: str) -> None:
    """cluster.device_mapping: show this process only its devices, before anything touches CUDA
    (Ray sets CUDA_VISIBLE_DEVICES only for actors that ask it for GPUs, and these ask none)."""
    from rft.plan.devices import visible_devices

    parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices(devices, parent, name)
    os.environ["RFT_DEVICES"] = devices  # an engine of several devices starts its workers in-process
    logging.getLogger("rft").info("devices %s of its node (cluster.device_mapping): CUDA_VISIBLE_DEVICES=%s",
                                  devices, os.environ["CUDA_VISIBLE_DEVICES"])


@functools.cache  # one class; Ray imported when a Ray actor is first made
def _weights_host():
    """A Ray host whose weight loads run beside its other calls (partial rollouts: an explorer takes
    new weights between two chunks of the explore step it is in, rft.rollout.partial.WeightGate).
    Each concurrency group runs its calls one at a time, in the order they were made."""
    import ray

    @ray.remote(max_concurrency=1, concurrency_groups={"weights": 1, "control": 1})
    class WeightsHost(_Host):
        @ray.method(concurrency_group="weights")
        def run_weights(self, method, *args):
            return getattr(self.obj, method)(*args)

        # questions a sync or a restart asks (its node, its pid) answered while an explore runs
        # and a load waits for the explore's next chunk
        @ray.method(concurrency_group="control")
        def run_control(self, method, *args):
            return getattr(self.obj, method)(*args)

    return WeightsHost


# the explorer's calls that load weights (rft.rollout.weights.WeightsMixin), and those that ask it
# something without touching its engine
WEIGHT_LOADS = frozenset({"update_weights", "receive_weights", "load_weights", "collective_init", "collective_receive"})
QUESTIONS = frozenset({"node", "ping", "open_gate"})


class RayActor:
    """A Ray actor running `cls(*args)`.

    `resources`: num_cpus, num_gpus, max_restarts (Ray re-runs the constructor with the same
    arguments after the process dies; calls in flight fail and the caller decides what to redo),
    scheduling_strategy (a placement group bundle, see rft.plan.placement).
    """

    def __init__(self, cls, *args, name: str, log_dir: str, level: str, threads: int = 1,
                 concurrent_loads: bool = False, devices: str | None = None, **resources):
        import ray

        self._ray = ray
        self.name = name
        self.log = Path(log_dir) / f"{name}.log"
        self.concurrent_loads = concurrent_loads
        if concurrent_loads:
            host = _weights_host()
        else:
            host = ray.remote(max_concurrency=1)(_Host)
        self.actor = host.options(name=name, **resources).remote(cls, log_dir, name, level, threads, args, devices)

    def submit(self, method: str, *args):
        if self.concurrent_loads and method in WEIGHT_LOADS:
            return self.actor.run_weights.remote(method, *args)
        if self.concurrent_loads and method in QUESTIONS:
            return self.actor.run_control.remote(method, *args)
        return self.actor.run.remote(method, *args)

    def get(self, future, timeout: float | None = None):
        """The call's result; raises TimeoutError after `timeout` seconds (None: wait)."""
        try:
            return self._ray.get(future, timeout=timeout)
        except self._ray.exceptions.GetTimeoutError as e:
            raise TimeoutError(f"{self.name} did not answer within {timeout} s") from e
        except self._ray.exceptions.RayActorError as e:
            raise not_started(e, self.name, self.log) or named(e, self)


    def call(self, method: str, *args):
        return self.get(self.submit(method, *args))

    def kill(self) -> None:
        self._ray.kill(self.actor)


# cluster.backend -> how a component runs: a Ray actor, or an object in this process
ACTOR_BACKENDS = Registry("cluster.backend", {"ray": "rft.runtime.actors.RayActor",
                                              "inline": "rft.runtime.actors.InlineActor"})


class ActorGroup:
    """The ranks of a data-parallel trainer (rft.trainer.fsdp), used like one actor.

    A call goes to every rank (each must take part in the collectives inside it); its future, and
    its result, are rank 0's. `get` also waits for the other ranks' calls made since the last
    `get`, so an error on any rank surfaces, and no rank falls behind the others' calls.
    """

    def __init__(self, actors: list, keep=None):
        self.actors = actors
        self.name = actors[0].name
        self._keep = keep  # something the group needs alive as long as it is (the ranks' store)
        self._others: list = []

    def submit(self, method: str, *args):
        futures = [a.submit(method, *args) for a in self.actors]
        self._others += list(zip(self.actors[1:], futures[1:]))
        return futures[0]

    def get(self, future, timeout: float | None = None):
        pending, self._others = [(self.actors[0], future), *self._others], []
        if isinstance(self.actors[0], RayActor):
            self._fail_fast(pending, timeout)
        return [actor.get(f, timeout) for actor, f in pending][0]

    def _fail_fast(self, pending: list, timeout: float | None) -> None:
        """Raise as soon as any rank's call fails: the others may be waiting for it inside a
        collective, and would only notice after the process group's timeout."""
        import time

        ray = self.actors[0]._ray
        owner = {f: actor for actor, f in pending}
        futures = list(owner)
        deadline = None if timeout is None else time.monotonic() + timeout
        while futures:
            left = None if deadline is None else max(deadline - time.monotonic(), 0)
            ready, futures = ray.wait(futures, num_returns=1, timeout=left)
            if not ready:
                raise TimeoutError(f"{self.name} did not answer within {timeout} s")
            try:
                ray.get(ready[0])
            except ray.exceptions.RayActorError as e:
                # a dead rank: the runner reports the trainer as dead, with its checkpoint
                actor = owner[ready[0]]
                raise not_started(e, actor.name, actor.log) or named(e, actor)
            except Exception as e:
                # a live rank's collective failing is most often a symptom of another rank's
                # death (gloo: connection reset); report the death, the cause, when there is one
                for f in futures:
                    try:
                        ray.get(f, timeout=5)
                    except ray.exceptions.RayActorError as died:
                        raise named(died, owner[f]) from e
                    except Exception:
                        pass
                raise

    def call(self, method: str, *args):
        return self.get(self.submit(method, *args))

    def kill(self) -> None:
        for a in self.actors:
            if isinstance(a, InlineActor) and a.obj is not None:
                a.obj.close()  # leave the process group while its store (self._keep) is alive
            a.kill()


# ---------------------------------------------------------------- building the actor set

def placement_for(cfg, timeout_s: float = 60.0):
    """Reserve the actors' resources as one placement group; returns (group, options per actor).

    options[0] is the trainer's (when there is one), then one per explorer, then one per reward
    model worker (rft.plan.placement.reward_models).
    """
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from rft.plan.placement import check_placement, check_resources

    p = check_placement(cfg)
    c = cfg.cluster
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if c.node_num > len(nodes):
        raise ConfigError(
            f"cluster.node_num={c.node_num} but the Ray cluster has {len(nodes)} node(s). Start "
            f"Ray on every node of the allocation, or set cluster.node_num={len(nodes)}."
        )
    check_resources(cfg, p, ray.cluster_resources())
    pg = placement_group(p.bundles, strategy=p.strategy)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(pg)
        raise ConfigError(f"Ray could not place the bundles {p.bundles} within {timeout_s:g} s.")
    opts = []
    for i, (index, share) in enumerate(p.slots):  # trainer ranks, explorers, then reward models
        b = p.bundles[index]
        opts.append(dict(
            num_cpus=b["CPU"] * share,
            # a mapped actor asks no GPU: it is shown its devices itself (_pin), as Ray cannot choose them
            num_gpus=0 if p.devices else b.get("GPU", 0) * share,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
            **({"devices": p.devices[i]} if p.devices else {}),
        ))
    return pg, opts


def start_trainer(Actor, cfg, plan, init_path, name: str, common: dict, options: list[dict],
                  resume: str | None = None):
    """The trainer actor: one process of the trainer backend (trainer=torch), or an ActorGroup of
    its ranks (a backend of ranks: fsdp2), per rft.registry.TRAINER_BACKENDS.

    `options`: Ray options per rank (from placement_for), one per rank. `resume`: the checkpoint
    a resumed stage loads next, from which a backend that can (builds_from_checkpoint) builds.
    """
    from rft.registry import TRAINER_BACKENDS

    cfg = frozen(cfg)  # the component's reads, many a step, as plain dicts (rft.config.Frozen)
    strategy = cfg.trainer.trainer_strategy
    # a registered name goes as its "module.Class", imported in the actor: the driver of a Ray run
    # never imports torch (a third of a GB); a study's own class is a dotted path already
    cls = TRAINER_BACKENDS.path(strategy) or strategy
    info = TRAINER_BACKENDS.info(strategy)
    last = (resume,) if resume is not None and info.builds_from_checkpoint else ()
    if not info.ranks:
        return Actor(cls, cfg, plan, init_path, *last, name=name, **common, **options[0])
    import torch.distributed as dist

    from rft.sync.weights import free_address

    host, _ = free_address()
    # the ranks' meeting point lives in this (the driver's) process for the trainer's lifetime
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=cfg.synchronizer.sync_timeout))
    world = len(options)
    ranks = [Actor(cls, cfg, plan, init_path, r, world, (host, store.port), *last,
                   name=f"{name}_{r}" if world > 1 else name, **common, **options[r])
             for r in range(world)]
    return ActorGroup(ranks, keep=store)


def start_explorers(Actor, cfg, count: int, weights: str | None, version: int, title: str, common: dict,
                    options: list[dict]) -> list:
    """`count` explorer actors serving `weights` (a checkpoint's hf/ or the starting model) as
    `version`; explorer i takes tasks i, i+count, ... of each step. Ray restarts a dead one."""
    from rft.rollout.explorer import Explorer

    cfg = frozen(cfg)  # the component's reads, many a step, as plain dicts (rft.config.Frozen)
    restarts = dict(max_restarts=cfg.cluster.max_actor_restarts) if cfg.cluster.backend == "ray" else {}
    if cfg.cluster.backend == "ray" and cfg.explorer.partial_rollout and cfg.mode == "both":
        restarts["concurrent_loads"] = True  # new weights between two chunks of an explore step
    return [Actor(Explorer, cfg, weights, version, i, name=f"{title}_{cfg.explorer.name}" + (f"_{i}" if count > 1 else ""),
                  **common, **options[i], **restarts) for i in range(count)]


def start_reward_models(Actor, cfg, common: dict, options: list[dict]) -> list:
    """One Ray actor per reward-model worker of the stage (rft/rewards/reward_model.py), named so the
    explorers' clients find it; takes their options off the end of `options` (from placement_for).
    With the inline backend nothing starts: each client builds its worker in-process. The actors
    load their models while the caller goes on; `wait_reward_models` waits for them."""
    from rft.plan.placement import reward_models
    from rft.rewards.reward_model import start_worker

    if cfg.cluster.backend != "ray":
        return []
    places = reward_models(cfg)
    if not places:
        return []
    mine = options[len(options) - len(places):]
    del options[len(options) - len(places):]
    workers = []
    for place, opts in zip(places, mine):
        actor = Actor(start_worker, place.args, name=place.name, **{**common, "threads": place.args["num_cpus"] or 1},
                      **opts, max_restarts=cfg.cluster.max_actor_restarts)
        actor.place = place
        workers.append(actor)
    return workers


def wait_reward_models(workers: list) -> None:
    """Wait until every reward-model worker has loaded; one that did not is a ConfigError naming
    its key and path."""
    for w in workers:
        try:
            info = w.call("info")
        except Exception as e:
            raise ConfigError(
                f"{w.place.where}: the reward model worker {w.name} for {w.place.args['model_path']!r} did not "
                f"start: {_why(e)} (its log: <stage>/log/{w.name}.log)"
            ) from None
        logging.getLogger(__name__).info("reward model worker %s ready: %s", w.name, info)


def named(e: Exception, actor) -> Exception:
    """`e` (an actor's death) tagged with the actor's name and log, for the run's last message
    (rft.runtime.faults.TrainerCalls.died: which of a trainer's ranks died)."""
    e.rft_actor, e.rft_log = actor.name, str(actor.log)
    return e


def not_started(e: Exception, name: str, log: Path) -> Exception | None:
    """The error to report for an actor whose constructor raised (None for one that died later,
    which Ray may restart): its ConfigError as it is (a bad model path, dataset or reward), any
    other error as a RunError naming the actor. Restarting would only raise it again."""
    if not getattr(e, "actor_init_failed", False):
        return None
    if "ConfigError: " in str(e):
        return ConfigError(_why(e))
    return RunError(f"{name} did not start: {_why(e)} (the traceback is in {log})")


def _why(e: Exception) -> str:
    """The error behind a Ray actor's death (its constructor raised): the traceback's last line."""
    import re

    text = re.sub(r"\x1b\[[0-9;]*m", "", str(getattr(e, "cause", None) or e))
    for marker in ("ConfigError: ",):
        if marker in text:
            return text[text.rindex(marker) + len(marker):].strip().splitlines()[0]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else type(e).__name__
