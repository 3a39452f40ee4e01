"""Each role's devices by index: `cluster.device_mapping`, as ROLL's device_mapping.

    devices      = 0 .. node_num x gpu_per_node - 1, node by node (device d is GPU d % gpu_per_node
                   of node d // gpu_per_node); on a CPU-only cluster, slots of cpus_per_actor CPUs
    trainer      = a rank on each listed device (trainer=torch: one device)
    explorer     = engine_num engines, each on tensor_parallel_size consecutive devices of one node
    reward_model = one device per reward-model worker, in rft.plan.placement.reward_models' order
    reference, critic = live in the trainer's ranks, so the trainer's devices (or null)
One mapping serves every stage of a run: a stage that only evaluates (mode=train: one engine) or
starts fewer reward models than a list holds takes its first devices.

Roles whose lists overlap share those devices (colocated: rft.config.colocated), as `cluster.colocate=true`
does for the counts' placement; disjoint lists are separated. Ray cannot put an actor on a GPU by
its index, so each node's GPUs are reserved whole as one bundle, and an actor on mapped devices
asks Ray for no GPU and is shown its devices by CUDA_VISIBLE_DEVICES, set in its process before
anything touches CUDA (`visible_devices`, called by rft.runtime.actors). Part of planning: imports
nothing that runs.
"""

from __future__ import annotations

from rft.config import device_mapping as mapping
from rft.errors import ConfigError


def mapped_trainer_ranks(cfg, ranks: bool) -> int | None:
    """The trainer's processes a mapping gives: one per device of device_mapping.trainer (`ranks`:
    the backend runs ranks, fsdp2; else one process on one device). None without a mapping."""
    m = mapping(cfg)
    if m is None or "trainer" not in m:
        return None
    n, tr = len(m["trainer"]), cfg.trainer
    if not ranks and n != 1:
        raise ConfigError(
            f"cluster.device_mapping.trainer names {n} devices, but trainer.trainer_strategy={tr.trainer_strategy} "
            f"is one process on one device. List one device, or use trainer=fsdp2 for a rank on each.")
    if ranks and tr.ranks is not None and tr.ranks != n:
        raise ConfigError(
            f"trainer.ranks={tr.ranks} but cluster.device_mapping.trainer names {n} devices (a rank on each). "
            f"Set trainer.ranks=null (the mapping's count) or list {tr.ranks} devices.")
    return n


def check_mapping(cfg, trainer: int, engines: int, reward_models: list) -> list[tuple[int, ...]]:
    """The devices of each actor (trainer ranks, explorers, then reward models), checked: every role
    that runs is mapped, with devices that exist, none twice in a role, an engine's on one node."""
    m, c = mapping(cfg), cfg.cluster
    tp = cfg.explorer.rollout_model.tensor_parallel_size
    _check_roles(cfg, m, trainer, engines, reward_models)
    total = c.node_num * c.gpu_per_node
    for role, devices in m.items():
        _check_devices(role, devices, total)
    for role in ("reference", "critic"):
        if role in m and m[role] != m.get("trainer"):
            raise ConfigError(
                f"cluster.device_mapping.{role}={m[role]} differs from device_mapping.trainer={m.get('trainer')}: "
                f"the {role} lives in the trainer's ranks (a shard on each), so it uses the trainer's devices. "
                f"Drop device_mapping.{role}, or move it off the GPU between uses with "
                f"trainer.{'ref' if role == 'reference' else 'critic'}_offload=true.")
    explorer = m.get("explorer", [])[:engines * tp]
    groups = [tuple(explorer[i:i + tp]) for i in range(0, len(explorer), tp)]
    for g in groups:
        if c.gpu_per_node and len({d // c.gpu_per_node for d in g}) > 1:
            raise ConfigError(
                f"cluster.device_mapping.explorer puts one engine on devices {list(g)}, which are on different "
                f"nodes (gpu_per_node={c.gpu_per_node}): an engine's tensor_parallel_size={tp} devices must share "
                f"a node. List each engine's devices within one node.")
    return ([(d,) for d in m.get("trainer", [])[:trainer]] + groups
            + [(d,) for d in m.get("reward_model", [])[:len(reward_models)]])


def check_nccl(cfg) -> None:
    """NCCL takes one process per GPU in a group (from NCCL 2.5 a second one is an error, "Duplicate
    GPU detected"), and the collective sync's group is the trainer's first rank and every engine's
    workers: none of them may share the trainer's GPU."""
    c, m = cfg.cluster, mapping(cfg)
    if str(cfg.synchronizer.sync_method) != "collective" or not c.gpu_per_node or cfg.mode != "both":
        return
    if m is None and not c.colocate:
        return
    first = None if m is None else m.get("trainer", [None])[0]
    if m is not None and first not in m.get("explorer", ()):
        return
    where = ("cluster.colocate=true puts them on one GPU" if m is None else
             f"device {first}, the trainer's first, is in cluster.device_mapping.explorer too")
    raise ConfigError(
        f"synchronizer.sync_method=collective broadcasts over NCCL, which allows one process per GPU in a group, "
        f"but the trainer shares its GPU with an engine ({where}). Use sync=memory (the engines read the weights "
        f"from a shared-memory segment on the node), or give the engines devices of their own.")


def _check_roles(cfg, m: dict, trainer: int, engines: int, reward_models: list) -> None:
    """Every role that runs has a list of the right length; cluster.colocate is not set with it."""
    c, rm = cfg.cluster, cfg.explorer.rollout_model
    if c.backend != "ray":
        raise ConfigError(
            f"cluster.device_mapping places Ray actors, but cluster.backend={c.backend} runs everything in this "
            f"one process. Use cluster=local (or cluster=ray), or drop cluster.device_mapping.")
    if c.colocate:
        raise ConfigError(
            "cluster.colocate=true and cluster.device_mapping both say where the actors go: drop colocate "
            "(roles whose device lists overlap share those devices).")
    if trainer and "trainer" not in m:
        raise ConfigError(f"cluster.device_mapping names {', '.join(m)} but not trainer, which runs in mode={cfg.mode}. "
                          f"Add cluster.device_mapping.trainer=[...].")
    want, have = engines * rm.tensor_parallel_size, len(m.get("explorer", ()))
    # a stage that only evaluates (mode=train) runs one engine, on the list's first devices: one
    # mapping serves every stage of a run (an sft stage before a grpo one)
    explores = cfg.mode in ("both", "explore")
    if engines and (have != want if explores else have < want):
        mode = "" if explores else " (mode=train runs one, to evaluate)"
        raise ConfigError(
            f"cluster.device_mapping.explorer names {have} devices, but {engines} engine{'s' * (engines > 1)}"
            f"{mode} of tensor_parallel_size {rm.tensor_parallel_size} take{'s' * (engines == 1)} {want}. "
            + (f"Set explorer.rollout_model.engine_num={have // rm.tensor_parallel_size}, or list {want} "
               if have and have % rm.tensor_parallel_size == 0 and not mode else f"List {want} ")
            + f"device{'s' * (want > 1)}.")
    if len(m.get("reward_model", ())) < len(reward_models):  # a stage may start fewer: the first ones
        raise ConfigError(
            f"cluster.device_mapping.reward_model names {len(m.get('reward_model', ()))} devices, but the stage "
            f"starts {len(reward_models)} reward-model worker{'s' * (len(reward_models) != 1)} "
            f"({', '.join(r.where for r in reward_models)}): list one device for each.")
    for r in reward_models:
        if r.args["colocate"]:
            raise ConfigError(
                f"{r.where}: colocate: true shares the trainer's device, but cluster.device_mapping.reward_model "
                f"says where reward models go. Drop colocate from its args.")


def _check_devices(role: str, devices: list[int], total: int) -> None:
    """Indices that exist (on GPUs: below node_num x gpu_per_node), each once."""
    key = f"cluster.device_mapping.{role}"
    if any(d < 0 for d in devices):
        raise ConfigError(f"{key}={devices} has a negative device; devices are numbered from 0.")
    if total and max(devices, default=0) >= total:
        raise ConfigError(
            f"{key}={devices} names device {max(devices)}, but cluster.node_num x gpu_per_node = {total} "
            f"devices (0-{total - 1}). List devices below {total}, or raise cluster.node_num / gpu_per_node "
            f"to what the job has.")
    twice = sorted({d for d in devices if devices.count(d) > 1})
    if twice:
        raise ConfigError(f"{key}={devices} names device{'s' * (len(twice) > 1)} {twice} twice; a role takes "
                          f"each device once (roles share devices by naming the same ones).")


def bundles_and_slots(cfg, actors: list[tuple[int, ...]]) -> tuple[list, list, list]:
    """Ray bundles (one per node the mapping uses: all its GPUs, cpus_per_actor CPUs per device in
    use; on CPU one bundle of them all), each actor's (bundle, share of its CPUs) and its devices on
    its node, "0,1". An actor's CPUs: cpus_per_actor for each of its devices, split among the
    actors on that device."""
    c = cfg.cluster
    gpn = c.gpu_per_node
    on = {}  # device -> actors using it
    for a in actors:
        for d in a:
            on[d] = on.get(d, 0) + 1
    node_of = (lambda d: d // gpn) if gpn else (lambda d: 0)
    nodes = sorted({node_of(d) for d in on})
    bundles = []
    for n in nodes:
        cpus = c.cpus_per_actor * sum(node_of(d) == n for d in on)
        bundles.append({"GPU": gpn, "CPU": cpus} if gpn else {"CPU": cpus})
    slots, local = [], []
    for a in actors:
        b = nodes.index(node_of(a[0]))
        slots.append((b, c.cpus_per_actor * sum(1 / on[d] for d in a) / bundles[b]["CPU"]))
        local.append(",".join(str(d % gpn if gpn else d) for d in a))
    return bundles, slots, local


def visible_devices(local: str, parent: str | None, name: str) -> str:
    """CUDA_VISIBLE_DEVICES for an actor on its node's devices `local` ("0,1"): those entries of
    the node's own list (`parent`, what its processes see, as a Slurm job sets it), or the
    indices themselves where the node sets none."""
    ids = [int(i) for i in local.split(",")]
    if not parent:
        return local
    seen = [p.strip() for p in parent.split(",") if p.strip()]
    if max(ids) >= len(seen):
        raise ConfigError(
            f"cluster.device_mapping puts {name} on GPU {max(ids)} of its node, but the node shows its "
            f"processes {len(seen)} (CUDA_VISIBLE_DEVICES={parent}). Set cluster.gpu_per_node to what each node "
            f"has, and map devices within it.")
    return ",".join(seen[i] for i in ids)
