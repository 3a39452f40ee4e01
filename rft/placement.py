"""Where the actors run: devices per actor, checked against the config and then against Ray.

    devices      = cluster.node_num x cluster.gpu_per_node GPUs (0: a CPU-only cluster)
    explorers    = explorer.rollout_model.engine_num engines x tensor_parallel_size GPUs each
    trainer      = the GPUs the explorers do not take (colocate=false), or all of them shared
                   (colocate=true); trainer_strategy=torch is one process on one of them,
                   fsdp2 is trainer.ranks processes with a GPU each (`trainer_ranks`)
    on CPU       = each actor reserves cluster.cpus_per_actor CPUs (colocate=true: they share one
                   set of cpus_per_actor)

`check_placement(cfg)` runs with the batch plan, before Ray starts: a device mapping that cannot
fit is a ConfigError naming the keys (the case the seeds know as a `node2pg` KeyError).
`rft.actors.placement_for(cfg)` then reserves the devices as one Ray placement group. This module
is part of planning: it imports nothing that runs (no torch, no Ray).
"""

from __future__ import annotations

from dataclasses import dataclass

from rft.errors import ConfigError


@dataclass(frozen=True)
class Placement:
    explorer_gpus: int  # per explorer (= tensor_parallel_size) or 0
    trainer_gpus: int  # GPUs the trainer takes (0 on CPU)
    bundles: list  # one Ray resource bundle per actor: trainer first, then each explorer
    # with colocate=true the actors share bundle 0, each asking for this fraction of it
    share: float


def explorer_count(cfg) -> int:
    """Explorer actors: engine_num when the stage explores; mode=train still runs one to evaluate
    when there are eval tasksets."""
    if cfg.mode in ("both", "explore"):
        return cfg.explorer.rollout_model.engine_num
    return 1 if cfg.buffer.explorer_input.eval_tasksets else 0


def trainer_ranks(cfg) -> int:
    """Processes of the trainer: 1 for trainer=torch; trainer.ranks (or its default) for fsdp2."""
    tr, c = cfg.trainer, cfg.cluster
    if tr.trainer_strategy != "fsdp2":
        return 1
    if tr.ranks is not None:
        if tr.ranks < 1:
            raise ConfigError(f"trainer.ranks={tr.ranks} must be >= 1 (or null for the default).")
        return tr.ranks
    if c.gpu_per_node == 0:
        return 2
    if c.colocate:
        return 1
    rm = cfg.explorer.rollout_model
    return max(c.node_num * c.gpu_per_node - explorer_count(cfg) * rm.tensor_parallel_size, 1)


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
    if c.backend != "ray" or c.gpu_per_node or c.colocate or cfg.mode != "both" or cfg.synchronizer.sync_offset:
        return c.cpus_per_actor
    e, r = explorer_count(cfg), trainer_ranks(cfg)
    return max(c.cpus_per_actor * (e + r) // max(e, r), c.cpus_per_actor)


def check_placement(cfg) -> Placement:
    c, rm = cfg.cluster, cfg.explorer.rollout_model
    # mode=train still runs one explorer for evaluation when there are eval tasksets
    engines = explorer_count(cfg)
    if c.node_num < 1:
        raise ConfigError(f"cluster.node_num={c.node_num} must be >= 1.")
    if rm.engine_num < 1:
        raise ConfigError(f"explorer.rollout_model.engine_num={rm.engine_num} must be >= 1.")
    if c.cpus_per_actor < 1:
        raise ConfigError(f"cluster.cpus_per_actor={c.cpus_per_actor} must be >= 1.")
    torch_threads(cfg)  # checks cluster.threads_per_actor
    trainer = trainer_ranks(cfg) if cfg.mode in ("both", "train") else 0
    if trainer > 1 and c.backend != "ray":
        raise ConfigError(
            f"trainer.ranks={trainer} (trainer_strategy=fsdp2) needs a process per rank, but "
            f"cluster.backend={c.backend} runs everything in this one process. Use cluster=local "
            f"(or cluster=ray), or trainer.ranks=1."
        )
    actors = trainer + engines
    if c.gpu_per_node == 0:  # CPU only: every actor reserves its CPUs
        if c.colocate:
            return Placement(0, 0, [{"CPU": c.cpus_per_actor}], share=1 / actors)
        return Placement(0, 0, [{"CPU": c.cpus_per_actor}] * actors, share=1.0)

    total = c.node_num * c.gpu_per_node
    tp = rm.tensor_parallel_size
    if engines and tp > c.gpu_per_node:
        raise ConfigError(
            f"explorer.rollout_model.tensor_parallel_size={tp} is more than cluster.gpu_per_node="
            f"{c.gpu_per_node}: one engine's tensor-parallel ranks must share a node. Lower "
            f"tensor_parallel_size to at most {c.gpu_per_node}."
        )
    explorer_total = engines * tp
    if c.colocate:
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
        # trainer and explorers time-share the same GPUs (the engines sleep while it trains)
        return Placement(tp, 1 if trainer else 0, [{"GPU": 1, "CPU": c.cpus_per_actor}], share=1 / actors)
    left = total - explorer_total
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
    bundles = [{"GPU": 1, "CPU": c.cpus_per_actor}] * trainer + [{"GPU": tp, "CPU": c.cpus_per_actor}] * engines
    return Placement(tp, trainer, bundles, share=1.0)


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
