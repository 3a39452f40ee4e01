"""Where the actors run: devices per actor, checked against the config and then against Ray.

    devices      = cluster.node_num x cluster.gpu_per_node GPUs (0: a CPU-only cluster)
    explorers    = explorer.rollout_model.engine_num engines x tensor_parallel_size GPUs each
    trainer      = the GPUs the explorers do not take (colocate=false), or all of them shared
                   (colocate=true); trainer_strategy=torch is one process on one of them,
                   fsdp2 is trainer.ranks processes with a GPU each (`trainer_ranks`)
    on CPU       = each actor reserves cluster.cpus_per_actor CPUs (colocate=true: they share one
                   set of cpus_per_actor)
    reward models = a worker per distinct reward_model part (`reward_models`, rft/rewards/reward_model.py),
                   placed like an engine: a bundle of its own after the explorers' (CPU: args.num_cpus,
                   default 1; GPU: one GPU, taken before the trainer's), or with args.colocate=true a
                   share of bundle 0 (the trainer's, or the first explorer's), which its actors split
                   evenly; with cluster.colocate=true, one more actor sharing the one bundle
    device_mapping = each role's devices by index in place of all the above (rft/plan/devices.py)

`check_placement(cfg)` runs with the batch plan, before Ray starts: a device mapping that cannot
fit is a ConfigError naming the keys (the case the seeds know as a `node2pg` KeyError).
`rft.runtime.actors.placement_for(cfg)` then reserves the devices as one Ray placement group. This module
is part of planning: it imports nothing that runs (no torch, no Ray).
"""

from __future__ import annotations

from dataclasses import dataclass

from rft.errors import ConfigError
from rft.config import colocated, device_mapping as mapping
from rft.plan.devices import bundles_and_slots, check_mapping, check_nccl


@dataclass(frozen=True)
class Placement:
    explorer_gpus: int  # per explorer (= tensor_parallel_size) or 0
    trainer_gpus: int  # GPUs the trainer takes (0 on CPU)
    bundles: list  # one Ray resource bundle per actor: trainer first, then each explorer
    # with colocate=true the actors share bundle 0, each asking for this fraction of it
    share: float
    # (bundle index, fraction of it) per actor: trainer ranks, explorers, then reward models
    slots: tuple = ()
    # the reward-model workers (RewardModelPlace), in the order of their slots
    reward_models: tuple = ()
    # cluster.device_mapping: per slot, its devices on its node ("0,1"), which the actor is shown
    # in place of GPUs Ray assigns (rft.plan.devices); empty without a mapping
    devices: tuple = ()
    # Ray's placement strategy: a mapping's bundles are whole nodes, each on a node of its own
    strategy: str = "PACK"


@dataclass(frozen=True)
class RewardModelPlace:
    """A reward-model worker the stage starts (rft/rewards/reward_model.py)."""
    name: str  # its Ray actor's name (rft.rewards.scoring.worker_name)
    where: str  # the config key of the first part that uses it
    args: dict  # the part's args, checked, defaults filled in (rft.rewards.scoring.worker_args)


def explorer_count(cfg) -> int:
    """Explorer actors: engine_num when the stage explores; mode=train still runs one to evaluate
    when there are eval tasksets."""
    if cfg.mode in ("both", "explore"):
        return cfg.explorer.rollout_model.engine_num
    from rft.algorithms import algorithm_needs

    if algorithm_needs(cfg.algorithm).reward_head:
        return 0  # a reward model generates nothing: its eval is its held-out pairs (eval/pair_accuracy)
    return 1 if cfg.buffer.explorer_input.eval_tasksets else 0


def reward_models(cfg) -> list[RewardModelPlace]:
    """One worker per distinct `args` among the reward_model parts of the reward configs the stage's
    explorers use: the taskset's when it explores, the eval tasksets' when it evaluates (not in
    mode=explore). Checks the args (a ConfigError names the part's key)."""
    from rft.rewards.scoring import entries, spec_of, worker_args, worker_name

    if not explorer_count(cfg):
        return []
    inp = cfg.buffer.explorer_input
    configs = []
    if cfg.mode in ("both", "explore"):
        configs.append(("buffer.explorer_input.taskset.reward_fn", inp.taskset.reward_fn))
    if cfg.mode in ("both", "train"):
        configs += [(f"buffer.explorer_input.eval_tasksets[{i}].reward_fn", ts.reward_fn)
                    for i, ts in enumerate(inp.eval_tasksets)]
    out: dict[str, RewardModelPlace] = {}
    for where, reward_fn in configs:
        for i, e in enumerate(entries(spec_of(reward_fn, inp.default_reward_fn_type), where)):
            if e["fn"] != "reward_model":
                continue
            key = f"{where}[{i}].args"
            try:
                args = worker_args(**e["args"])
            except (ConfigError, TypeError) as err:
                raise ConfigError(f"{key}: {err}") from None
            out.setdefault(worker_name(args), RewardModelPlace(worker_name(args), key, args))
    return list(out.values())


def trainer_ranks(cfg) -> int:
    """Processes of the trainer: 1 for trainer=torch; trainer.ranks (or its default) for a backend of
    ranks (fsdp2)."""
    from rft.plan.devices import mapped_trainer_ranks
    from rft.registry import TRAINER_BACKENDS

    tr, c = cfg.trainer, cfg.cluster
    ranks = TRAINER_BACKENDS.info(tr.trainer_strategy).ranks
    mapped = mapped_trainer_ranks(cfg, ranks)
    if mapped is not None:
        return mapped
    if not ranks:
        return 1
    if tr.ranks is not None:  # (>= 1: rft.plan.ranges)
        return tr.ranks
    if c.gpu_per_node == 0:
        return 2
    if c.colocate:
        return 1
    rm = cfg.explorer.rollout_model
    own_gpu = sum(not r.args["colocate"] for r in reward_models(cfg))  # reward models' GPUs
    return max(c.node_num * c.gpu_per_node - explorer_count(cfg) * rm.tensor_parallel_size - own_gpu, 1)


def sync_offset(cfg) -> int:
    """synchronizer.sync_offset, or where it is null: 1 when the explorers and the trainer can run
    side by side, each on resources of its own (Ray, mode=both, not colocated: on CPU each actor
    reserves its CPUs, on GPUs the explorers have theirs), so the explorers generate the next step
    while the trainer learns from this one (one step stale: algorithm.off_policy_correction
    applies); else 0. On the default study, 2 CPU cores: 0.053 s a step against 0.073, the same
    eval curve within the seeds' spread from step 4 on (experiments/trl_comparison/)."""
    sc, c = cfg.synchronizer, cfg.cluster
    if sc.sync_offset is not None:
        return sc.sync_offset
    if sc.get("sync_style") == "dynamic_by_explorer":  # explorers that never wait for the trainer
        return 1
    return int(c.backend == "ray" and cfg.mode == "both" and not colocated(cfg))


def torch_threads(cfg) -> int:
    """torch threads in each explorer and trainer actor: cluster.threads_per_actor, or by default
    cpus_per_actor, except where the actors take turns on CPUs of their own (Ray on CPU,
    synchronizer.sync_offset=0 in mode=both, not colocated): then the explorers generate while
    the trainer waits and back, so each phase may use the CPUs all of them reserve (split among
    the actors that run at once: the explorers, or the trainer's ranks)."""
    c = cfg.cluster
    if c.threads_per_actor is not None:
        if c.threads_per_actor < 1:
            raise ConfigError(f"cluster.threads_per_actor={c.threads_per_actor} must be >= 1 (or null).")
        return c.threads_per_actor
    if c.backend != "ray" or c.gpu_per_node or colocated(cfg) or cfg.mode != "both" or sync_offset(cfg):
        return c.cpus_per_actor
    e, r = explorer_count(cfg), trainer_ranks(cfg)
    return max(c.cpus_per_actor * (e + r) // max(e, r), c.cpus_per_actor)


def check_placement(cfg) -> Placement:
    """The actors' bundles, checked against the config; against a local Ray instance's resources too
    where the config gives them (local_resources), so the dry run refuses what Ray could not place."""
    p = _plan(cfg)
    have = local_resources(cfg)
    if have is not None:
        check_resources(cfg, p, have)
    return p


def local_resources(cfg) -> dict | None:
    """What rft's own Ray instance (cluster.ray_address null) will have: cluster.num_cpus CPUs and the
    configured GPUs. None where that is not known before Ray starts (num_cpus null: every CPU of the
    machine Ray starts on, which the dry run's may not be; a cluster it joins), and inline."""
    c = cfg.cluster
    if c.backend != "ray" or c.ray_address is not None or c.num_cpus is None:
        return None
    return {"CPU": c.num_cpus, "GPU": c.node_num * c.gpu_per_node}


def check_resources(cfg, p: Placement, have: dict) -> None:
    """The bundles' resources summed per kind against `have` (local_resources in the plan, Ray's
    cluster_resources() at start: one message for both)."""
    c = cfg.cluster
    need: dict[str, float] = {}
    for b in p.bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0) + v
    for k, v in need.items():
        if have.get(k, 0) >= v:
            continue
        raise ConfigError(
            f"the actors need {v:g} {k} (cluster.cpus_per_actor={c.cpus_per_actor}, "
            f"gpu_per_node={c.gpu_per_node}, explorer.rollout_model.engine_num="
            f"{cfg.explorer.rollout_model.engine_num}"
            + (f", trainer.ranks={trainer_ranks(cfg)}" if trainer_ranks(cfg) > 1 else "") + f", colocate={c.colocate}"
            + (f", reward model workers={len(p.reward_models)}" if p.reward_models else "") + ") but the Ray "
            f"cluster has {have.get(k, 0):g}. Lower those, or start Ray with more "
            f"(cluster.num_cpus for a local instance"
            # Ray's CPUs are reservations, not cores: a machine of one core runs the default's
            # two actors when told it has two (they take turns on it), or cluster=inline runs them in one process
            + (f": it may exceed this machine's cores, e.g. cluster.num_cpus={v:g}; or cluster=inline"
               if k == "CPU" and c.ray_address is None else "") + ")."
        )


def _plan(cfg) -> Placement:
    c, rm = cfg.cluster, cfg.explorer.rollout_model
    # mode=train still runs one explorer for evaluation when there are eval tasksets
    engines = explorer_count(cfg)
    torch_threads(cfg)  # checks cluster.threads_per_actor (read by the runner, which calls it too)
    trainer = trainer_ranks(cfg) if cfg.mode in ("both", "train") else 0
    if trainer > 1 and c.backend != "ray":
        raise ConfigError(
            f"trainer.ranks={trainer} (trainer_strategy=fsdp2) needs a process per rank, but "
            f"cluster.backend={c.backend} runs everything in this one process. Use cluster=local "
            f"(or cluster=ray), or trainer.ranks=1."
        )
    actors = trainer + engines
    rms = reward_models(cfg)
    check_nccl(cfg)
    if mapping(cfg) is not None:
        return _mapped(cfg, trainer, engines, rms)
    if c.gpu_per_node == 0:  # CPU only: every actor reserves its CPUs
        _check_cpus(cfg, trainer, engines)
        if c.colocate:
            return _colocated(c, actors, rms, explorer_gpus=0, trainer_gpus=0)
        bundles = [{"CPU": c.cpus_per_actor}] * actors
        return _with_reward_models(Placement(0, 0, bundles, share=1.0), rms, {})

    total = c.node_num * c.gpu_per_node
    tp = rm.tensor_parallel_size
    if engines and tp > c.gpu_per_node:
        raise ConfigError(
            f"explorer.rollout_model.tensor_parallel_size={tp} is more than cluster.gpu_per_node="
            f"{c.gpu_per_node}: one engine's tensor-parallel ranks must share a node. Lower "
            f"tensor_parallel_size to at most {c.gpu_per_node}."
        )
    if c.colocate:
        _check_colocated_gpus(trainer, engines, tp, total)
        # trainer and explorers time-share the same GPUs (the engines sleep while it trains)
        return _colocated(c, actors, rms, explorer_gpus=tp, trainer_gpus=1 if trainer else 0)
    _check_own_gpus(trainer, engines, tp, total, rms)
    bundles = [{"GPU": 1, "CPU": c.cpus_per_actor}] * trainer + [{"GPU": tp, "CPU": c.cpus_per_actor}] * engines
    return _with_reward_models(Placement(tp, trainer, bundles, share=1.0), rms, {"GPU": 1})


def _mapped(cfg, trainer: int, engines: int, rms: list) -> Placement:
    """cluster.device_mapping: whole nodes as bundles, each actor on its devices (rft.plan.devices)."""
    actors = check_mapping(cfg, trainer, engines, rms)
    bundles, slots, devices = bundles_and_slots(cfg, actors)
    tp, gpn = cfg.explorer.rollout_model.tensor_parallel_size, cfg.cluster.gpu_per_node
    return Placement(tp if gpn else 0, trainer if gpn else 0, bundles, share=1.0, slots=tuple(slots),
                     reward_models=tuple(rms), devices=tuple(devices),
                     strategy="STRICT_SPREAD" if len(bundles) > 1 else "PACK")


# CPUs a node may have, at most: more than any machine has, so a count of actors past it is a typo
# (engine_num=1000000000000 built a list of that many Ray bundles: a MemoryError, not a message). The
# cluster's own CPUs are counted where Ray starts (rft.runtime.actors.placement_for): the plan may
# run on a machine other than the cluster's
MAX_CPUS_PER_NODE = 4096


def _check_cpus(cfg, trainer: int, engines: int) -> None:
    """On CPU each actor is a process reserving cluster.cpus_per_actor CPUs (colocate=true: sharing
    one set): no more of them than MAX_CPUS_PER_NODE a node."""
    c = cfg.cluster
    actors, have = trainer + engines, c.node_num * MAX_CPUS_PER_NODE
    if actors <= have:
        return
    raise ConfigError(
        f"explorer.rollout_model.engine_num={engines} engine(s) and {trainer} trainer rank(s) (trainer.ranks) are "
        f"{actors} processes, more than the CPUs of cluster.node_num={c.node_num} node(s) (at most {MAX_CPUS_PER_NODE} "
        f"each, more than any machine has), so they could never all be placed. Lower engine_num or trainer.ranks (to "
        f"the cluster's CPUs over cluster.cpus_per_actor={c.cpus_per_actor} each).")


def _colocated(c, actors: int, rms: list, explorer_gpus: int, trainer_gpus: int) -> Placement:
    """cluster.colocate: one bundle, shared evenly by every actor, reward models included."""
    n = actors + len(rms)
    bundle = {"CPU": c.cpus_per_actor} if c.gpu_per_node == 0 else {"GPU": 1, "CPU": c.cpus_per_actor}
    slots = ((0, 1 / n),) * n
    return Placement(explorer_gpus, trainer_gpus, [bundle], share=1 / n, slots=slots, reward_models=tuple(rms))


def _check_colocated_gpus(trainer: int, engines: int, tp: int, total: int) -> None:
    """With cluster.colocate the trainer is one process on the shared GPU, and the explorers'
    tensor-parallel ranks fit in the cluster's GPUs."""
    explorer_total = engines * tp
    if trainer > 1:
        raise ConfigError(
            f"cluster.colocate=true shares one GPU between the trainer and the explorers, so "
            f"trainer.ranks={trainer} cannot each have one. Set trainer.ranks=1 or colocate=false."
        )
    if explorer_total > total:
        raise ConfigError(
            f"the explorers need engine_num ({engines}) x tensor_parallel_size ({tp}) = "
            f"{explorer_total} GPUs but cluster.node_num x gpu_per_node = {total}."
        )


def _check_own_gpus(trainer: int, engines: int, tp: int, total: int, rms: list) -> None:
    """Not colocated: the explorers' GPUs, then the reward models' own, then a GPU per trainer
    rank fit in the cluster's; each shortfall names what to lower."""
    explorer_total = engines * tp
    if explorer_total > total:  # (mode=explore has no trainer whose check below would say so)
        raise ConfigError(
            f"the explorers need engine_num ({engines}) x tensor_parallel_size ({tp}) = {explorer_total} GPUs but "
            f"cluster.node_num x gpu_per_node = {total}. Lower explorer.rollout_model.engine_num, or add nodes.")
    own_gpu = sum(not r.args["colocate"] for r in rms)
    if own_gpu and total - explorer_total - trainer < own_gpu:
        raise ConfigError(
            f"the reward models ({', '.join(r.where for r in rms if not r.args['colocate'])}) need a GPU "
            f"each ({own_gpu}), but cluster.node_num x gpu_per_node = {total} GPUs leave "
            f"{max(total - explorer_total - trainer, 0)} after the explorers ({explorer_total}) and the "
            f"trainer ({trainer}). Give them colocate: true in their args (a share of the trainer's GPU), "
            f"lower explorer.rollout_model.engine_num, or add GPUs."
        )
    left = total - explorer_total - own_gpu
    if trainer > 1 and left < trainer:
        raise ConfigError(
            f"trainer.ranks={trainer} needs a GPU each, but the explorers (engine_num {engines} x "
            f"tensor_parallel_size {tp} = {explorer_total}) leave {left} of cluster.node_num x "
            f"gpu_per_node = {total}. Lower trainer.ranks (null takes what is left) or engine_num."
        )
    if trainer and left < 1:
        raise ConfigError(
            f"cluster.node_num x gpu_per_node = {total} GPUs, and the explorers take all of them "
            f"(engine_num {engines} x tensor_parallel_size {tp} = {explorer_total}), leaving none "
            f"for the trainer. Lower explorer.rollout_model.engine_num, add nodes, or set "
            f"cluster.colocate=true to share the GPUs."
        )


def _with_reward_models(p: Placement, rms: list, gpu: dict) -> Placement:
    """Not colocated: each actor has its bundle; a reward model gets one after them ({"CPU":
    num_cpus or 1, **gpu}), or with args.colocate a share of bundle 0, split evenly among its actors."""
    actors = len(p.bundles)
    shared = sum(r.args["colocate"] for r in rms)
    first = 1 / (1 + shared)
    if shared and p.bundles[0].get("GPU", 0) > 1:
        raise ConfigError(
            f"a reward model with colocate: true shares bundle 0's GPU, but that bundle has "
            f"{p.bundles[0]['GPU']} GPUs (the first explorer's tensor_parallel_size, with no trainer in "
            f"this mode). Drop colocate from its args (a GPU of its own)."
        )
    bundles, slots = list(p.bundles), [(0, first)] + [(i, 1.0) for i in range(1, actors)]
    for r in rms:
        if r.args["colocate"]:
            slots.append((0, first))
        else:
            slots.append((len(bundles), 1.0))
            bundles.append({**gpu, "CPU": r.args["num_cpus"] or 1})
    return Placement(p.explorer_gpus, p.trainer_gpus, bundles, p.share, tuple(slots), tuple(rms))


def check_allocation(cfg, env=None) -> None:
    """Inside a Slurm job, cluster.node_num and gpu_per_node must be what Slurm allocated.

    Slurm tells the job through its environment (SLURM_JOB_NUM_NODES, SLURM_GPUS_ON_NODE). A
    mismatch would otherwise show up late: Ray waiting for nodes that never join, or actors
    asking for GPUs the job does not have. Outside Slurm this checks nothing.
    """
    import os

    env = os.environ if env is None else env
    if "SLURM_JOB_ID" not in env:
        return
    c, job = cfg.cluster, env["SLURM_JOB_ID"]
    nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)
    gpus = int(env.get("SLURM_GPUS_ON_NODE") or 0)
    if c.node_num != nodes:
        raise ConfigError(
            f"cluster.node_num={c.node_num} but this Slurm job ({job}) has {nodes} node(s) "
            f"(SLURM_JOB_NUM_NODES). Set cluster.node_num={nodes}, or ask Slurm for "
            f"{c.node_num} node(s) (sbatch --nodes={c.node_num} launchers/ray_slurm.sbatch ...)."
        )
    if c.gpu_per_node != gpus:
        raise ConfigError(
            f"cluster.gpu_per_node={c.gpu_per_node} but this Slurm job ({job}) has {gpus} GPU(s) "
            f"on each node (SLURM_GPUS_ON_NODE). Set cluster.gpu_per_node={gpus}, or ask Slurm "
            f"for {c.gpu_per_node} (sbatch --gpus-per-node={c.gpu_per_node}, or "
            f"hydra.launcher.gpus_per_node={c.gpu_per_node} in a sweep)."
        )
