"""cluster.device_mapping (ROLL's device_mapping): each role's devices by index, checked by the plan,
reserved as whole nodes, and shown to each actor as its CUDA_VISIBLE_DEVICES (rft/plan/devices.py)."""

import pytest
from conftest import compose_cfg, run_cli
from test_runtime import base, env_for, evals

from rft.config import colocated
from rft.errors import ConfigError
from rft.plan.devices import visible_devices
from rft.plan.memory import describe_devices, estimate
from rft.plan.placement import check_placement, trainer_ranks
from rft.reporting.monitor import read_metrics

VERL_STYLE = ["cluster.gpu_per_node=8", "trainer=fsdp2", "explorer.rollout_model.engine_num=8",
              "cluster.device_mapping.trainer=[0,1,2,3,4,5,6,7]", "cluster.device_mapping.explorer=[0,1,2,3,4,5,6,7]"]
SEPARATED = ["cluster.node_num=2", "cluster.gpu_per_node=4", "trainer=fsdp2", "explorer.rollout_model.engine_num=2",
             "explorer.rollout_model.tensor_parallel_size=2", "cluster.device_mapping.trainer=[0,1,2,3]",
             "cluster.device_mapping.explorer=[4,5,6,7]"]


def placed(*overrides):
    return check_placement(compose_cfg(["stages=[]", *overrides]))


def error(*overrides) -> str:
    with pytest.raises(ConfigError) as e:
        placed(*overrides)
    return str(e.value)


def test_every_role_on_every_gpu_shares_each_gpu_between_a_rank_and_an_engine():
    p = placed(*VERL_STYLE)
    # one node's 8 GPUs as one bundle; 8 devices in use x cpus_per_actor 1 = 8 CPUs
    assert p.bundles == [{"GPU": 8, "CPU": 8}] and p.strategy == "PACK"
    # 8 trainer ranks, then 8 engines; two actors on each device: half its CPU each = 0.5 / 8
    assert p.slots == ((0, 0.0625),) * 16
    assert p.devices == tuple("01234567") * 2
    cfg = compose_cfg(["stages=[]", *VERL_STYLE])
    assert trainer_ranks(cfg) == 8 and colocated(cfg)


def test_separated_roles_on_two_nodes_with_two_gpu_engines():
    p = placed(*SEPARATED)
    # device d is GPU d % 4 of node d // 4: the trainer's 0-3 on node 0, the engines' 4-7 on node 1
    assert p.bundles == [{"GPU": 4, "CPU": 4}, {"GPU": 4, "CPU": 4}] and p.strategy == "STRICT_SPREAD"
    # a rank: 1 CPU of node 0's 4; an engine: 2 devices x 1 CPU of node 1's 4
    assert p.slots == ((0, 0.25),) * 4 + ((1, 0.5),) * 2
    assert p.devices == ("0", "1", "2", "3", "0,1", "2,3")
    assert not colocated(compose_cfg(["stages=[]", *SEPARATED]))


def test_on_cpu_the_devices_are_slots_of_cpus_per_actor_cpus():
    p = placed("trainer=fsdp2", "explorer.rollout_model.engine_num=2", "cluster.cpus_per_actor=2",
               "cluster.device_mapping.trainer=[0,1]", "cluster.device_mapping.explorer=[1,2]")
    # devices 0, 1, 2 x 2 CPUs = 6; rank 0 alone on device 0 (2 CPUs = 1/3), rank 1 and engine 0 half
    # of device 1 each (1 CPU = 1/6), engine 1 alone on device 2 (1/3)
    assert p.bundles == [{"CPU": 6}]
    assert [b for b, _ in p.slots] == [0] * 4
    assert [s for _, s in p.slots] == pytest.approx([1 / 3, 1 / 6, 1 / 6, 1 / 3])
    assert p.devices == ("0", "1", "1", "2") and p.explorer_gpus == 0


def test_a_reward_model_takes_a_device_of_its_own_list(tmp_path):
    reward = (f"buffer.explorer_input.taskset.reward_fn=[{{fn: exact_match, weight: 1}}, {{fn: reward_model, "
              f"weight: 0.5, args: {{model_path: {tmp_path}}}}}]")
    p = placed("cluster.gpu_per_node=2", "cluster.device_mapping.trainer=[0]", "cluster.device_mapping.explorer=[1]",
               "cluster.device_mapping.reward_model=[0]", reward)
    # device 0: the trainer and the reward model, half its CPU each; device 1: the engine
    assert p.slots == ((0, 0.25), (0, 0.5), (0, 0.25)) and p.devices == ("0", "1", "0")
    assert error("cluster.gpu_per_node=2", "cluster.device_mapping.trainer=[0]",
                 "cluster.device_mapping.explorer=[1]", reward) == (
        "cluster.device_mapping.reward_model names 0 devices, but the stage starts 1 reward-model worker "
        "(buffer.explorer_input.taskset.reward_fn[1].args): list one device for each.")


@pytest.mark.parametrize("overrides, message", [
    # the seeds' `self.node2pg[node_rank] KeyError`: a device past the GPUs the cluster has
    (["cluster.gpu_per_node=8", "cluster.device_mapping.trainer=[0]", "cluster.device_mapping.explorer=[8]"],
     "cluster.device_mapping.explorer=[8] names device 8, but cluster.node_num x gpu_per_node = 8 devices (0-7). "
     "List devices below 8, or raise cluster.node_num / gpu_per_node to what the job has."),
    (["trainer=fsdp2", "cluster.device_mapping.trainer=[0,1,1]", "cluster.device_mapping.explorer=[0]"],
     "cluster.device_mapping.trainer=[0, 1, 1] names device [1] twice; a role takes each device once (roles "
     "share devices by naming the same ones)."),
    (["cluster.device_mapping.trainer=[0]", "cluster.device_mapping.explorer=[-1]"],
     "cluster.device_mapping.explorer=[-1] has a negative device; devices are numbered from 0."),
    (SEPARATED[:-1] + ["cluster.device_mapping.explorer=[3,4,5,6]"],
     "cluster.device_mapping.explorer puts one engine on devices [3, 4], which are on different nodes "
     "(gpu_per_node=4): an engine's tensor_parallel_size=2 devices must share a node. List each engine's "
     "devices within one node."),
    (VERL_STYLE[:2] + VERL_STYLE[3:],
     "cluster.device_mapping.explorer names 8 devices, but 1 engine of tensor_parallel_size 1 takes 1. "
     "Set explorer.rollout_model.engine_num=8, or list 1 device."),
    (["cluster.device_mapping.trainer=[0,1]", "cluster.device_mapping.explorer=[0]"],
     "cluster.device_mapping.trainer names 2 devices, but trainer.trainer_strategy=torch is one process on one "
     "device. List one device, or use trainer=fsdp2 for a rank on each."),
    (["trainer=fsdp2", "trainer.ranks=4", "cluster.device_mapping.trainer=[0,1]", "cluster.device_mapping.explorer=[0]"],
     "trainer.ranks=4 but cluster.device_mapping.trainer names 2 devices (a rank on each). Set trainer.ranks=null "
     "(the mapping's count) or list 4 devices."),
    (["cluster.device_mapping.explorer=[0]"],
     "cluster.device_mapping names explorer but not trainer, which runs in mode=both. Add "
     "cluster.device_mapping.trainer=[...]."),
    (["cluster.device_mapping.trainer=[0]", "cluster.device_mapping.explorer=[1]", "cluster.device_mapping.critic=[1]"],
     "cluster.device_mapping.critic=[1] differs from device_mapping.trainer=[0]: the critic lives in the trainer's "
     "ranks (a shard on each), so it uses the trainer's devices. Drop device_mapping.critic, or move it off the "
     "GPU between uses with trainer.critic_offload=true."),
    (["cluster=inline", "cluster.device_mapping.trainer=[0]", "cluster.device_mapping.explorer=[0]"],
     "cluster.device_mapping places Ray actors, but cluster.backend=inline runs everything in this one process. "
     "Use cluster=local (or cluster=ray), or drop cluster.device_mapping."),
    (["cluster.colocate=true", "cluster.device_mapping.trainer=[0]", "cluster.device_mapping.explorer=[0]"],
     "cluster.colocate=true and cluster.device_mapping both say where the actors go: drop colocate (roles whose "
     "device lists overlap share those devices)."),
])
def test_a_mapping_that_does_not_fit_names_the_role_and_the_devices(overrides, message):
    assert error(*overrides) == message


@pytest.mark.slow  # 1.5 s alone, over the fast tier's second
def test_nccl_takes_one_process_per_gpu_so_a_collective_sync_needs_the_trainers_gpu_to_itself():
    # the group: the trainer's first rank and each engine; a second process on a GPU is NCCL's
    # "Duplicate GPU detected" (an error from NCCL 2.5)
    assert error(*VERL_STYLE, "sync=collective") == (
        "synchronizer.sync_method=collective broadcasts over NCCL, which allows one process per GPU in a group, but "
        "the trainer shares its GPU with an engine (device 0, the trainer's first, is in "
        "cluster.device_mapping.explorer too). Use sync=memory (the engines read the weights from a shared-memory "
        "segment on the node), or give the engines devices of their own.")
    assert "(cluster.colocate=true puts them on one GPU)" in error("cluster.gpu_per_node=1", "cluster.colocate=true",
                                                                  "sync=collective")
    placed(*VERL_STYLE, "sync=memory")
    placed(*SEPARATED, "sync=collective")  # rank 0 on device 0, the engines on 4-7
    placed("cluster.colocate=true", "sync=collective")  # on CPU gloo takes several processes per device


def test_a_stage_that_only_evaluates_takes_the_first_explorer_devices():
    # an sft-like stage (mode=train) of a run mapped for 4 engines: one engine evaluates, on device 4
    p = placed("mode=train", "buffer=sql", "trainer=fsdp2", "cluster.gpu_per_node=8", "cluster.device_mapping.trainer=[0,1,2,3]",
               "cluster.device_mapping.explorer=[4,5,6,7]", "explorer.rollout_model.engine_num=4")
    assert p.devices == ("0", "1", "2", "3", "4")
    assert error("mode=train", "buffer=sql", "cluster.device_mapping.trainer=[0]", "cluster.device_mapping.explorer=[]") == (
        "cluster.device_mapping.explorer names 0 devices, but 1 engine (mode=train runs one, to evaluate) of "
        "tensor_parallel_size 1 takes 1. List 1 device.")


def test_the_reference_may_name_the_trainers_devices():
    p = placed("cluster.device_mapping.trainer=[0]", "cluster.device_mapping.explorer=[1]",
               "cluster.device_mapping.reference=[0]")
    assert p.devices == ("0", "1")


def test_each_actor_sees_its_devices_among_those_its_node_shows():
    assert visible_devices("1,3", None, "e") == "1,3"  # a node that restricts nothing
    assert visible_devices("1,3", "4,5,6,7", "e") == "5,7"  # a Slurm job's GPUs 4-7: its 2nd and 4th
    with pytest.raises(ConfigError) as e:
        visible_devices("2", "4,5", "grpo_explorer_1")
    assert str(e.value) == (
        "cluster.device_mapping puts grpo_explorer_1 on GPU 2 of its node, but the node shows its processes 2 "
        "(CUDA_VISIBLE_DEVICES=4,5). Set cluster.gpu_per_node to what each node has, and map devices within it.")


def test_sleep_mode_takes_overlapping_lists_as_colocated():
    sleep = ["explorer.rollout_model.enable_sleep_mode=true", "synchronizer.sync_offset=0", "cluster.gpu_per_node=2"]
    from rft.plan.batch import make_plan

    make_plan(compose_cfg(["stages=[]", *sleep, "cluster.device_mapping.trainer=[0]",
                           "cluster.device_mapping.explorer=[0]"]), 2000)
    with pytest.raises(ConfigError) as e:
        make_plan(compose_cfg(["stages=[]", *sleep, "cluster.device_mapping.trainer=[0]",
                               "cluster.device_mapping.explorer=[1]"]), 2000)
    assert "needs cluster.colocate=true (or device_mapping lists that share devices)" in str(e.value)
    assert "(here colocate=False, sync_offset=0)" in str(e.value)


def test_the_dry_run_names_each_roles_devices(monkeypatch):
    from rft.plan import memory
    from rft.plan.batch import make_plan, stage_configs

    monkeypatch.setattr(memory, "local_gpus", lambda: [])
    cfg = stage_configs(compose_cfg(["stages=[]", *SEPARATED, "model=qwen2.5-0.5b", "explorer=vllm",
                                     "sync=checkpoint"]))[0]

    rows = dict(describe_devices(cfg, estimate(cfg, make_plan(cfg, 2000))))
    assert rows["placement"] == ("2 vllm engines on devices 4-7 (2 each); trainer fsdp2, 4 ranks on devices 0-3; "
                                 "weights by sync=checkpoint; separated (cluster.device_mapping)")


@pytest.mark.slow
def test_a_run_on_mapped_devices_shows_each_actor_its_own_and_learns(warm_start, tmp_path):
    # the CPU twin of verl's layout: 2 fsdp2 ranks and 2 engines, rank i and engine i on device i;
    # the node shows its processes devices "7,5" (as a Slurm job would), so device 0 is 7, device 1 is 5
    r = run_cli(*base(warm_start, "mapped", "cluster=local", "trainer=fsdp2", "explorer.rollout_model.engine_num=2",
                      "cluster.device_mapping.trainer=[0,1]", "cluster.device_mapping.explorer=[0,1]",
                      "buffer.total_steps=3", "explorer.eval_interval=3", "trainer.save_interval=3"),
                env={**env_for(tmp_path), "CUDA_VISIBLE_DEVICES": "7,5"})
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "rft" / "mapped"
    for actor, local, shown in [("grpo_trainer_0", 0, 7), ("grpo_trainer_1", 1, 5),
                                ("grpo_explorer_0", 0, 7), ("grpo_explorer_1", 1, 5)]:
        assert (f"devices {local} of its node (cluster.device_mapping): CUDA_VISIBLE_DEVICES={shown}"
                in (run / "log" / f"{actor}.log").read_text()), actor
    metrics = read_metrics(run / "metrics.jsonl")
    # colocated lists: on-policy (sync_offset 0), so each step trains on the weights just synced
    assert [m["sync/version"] for m in metrics[1:]] == [1, 2, 3]
    first, last = evals(metrics)[0], evals(metrics)[-1]
    assert last >= first + 0.3, (first, last)


def test_the_readmes_mapped_command_plans_without_a_problem(monkeypatch):
    import shlex
    from pathlib import Path

    from rft.plan import memory
    from rft.plan.batch import make_plan, stage_configs

    monkeypatch.setattr(memory, "local_gpus", lambda: [])  # a login node: the plan alone, GPUs of 80 GiB

    text = (Path(__file__).parents[1] / "README.md").read_text()
    start = text.index("    python run.py trainer=fsdp2 explorer=vllm model=qwen7b sync=memory")
    command = text[start:text.index("\n\n", start)].replace("\\\n", " ")
    overrides = shlex.split(command)[2:]
    cfg = stage_configs(compose_cfg(["stages=[]", *overrides]))[0]
    est = estimate(cfg, make_plan(cfg, 2000))
    # 8 ranks and 8 engines, one of each on every GPU; the engine wakes into 0.8 x 80 = 64 GiB beside
    # the ~11.6 GiB the trainer keeps there: 75.6 <= 80
    assert est.problems == ()
    assert dict(describe_devices(cfg, est))["placement"] == (
        "8 vllm engines on devices 0-7 (1 each); trainer fsdp2, 8 ranks on devices 0-7; weights by sync=memory; "
        "colocated (cluster.device_mapping)")


@pytest.fixture
def four_fake_gpus():
    """A Ray instance told this machine has 4 GPUs, whose node shows its processes "3,2,1,0" (the
    order a Slurm job or an operator may give): the GPU branch of the placement, without a GPU."""
    import os

    import ray

    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = "3,2,1,0"
    ray.init(address="local", num_cpus=4, num_gpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES")
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


@pytest.mark.slow
def test_on_gpus_the_node_is_reserved_whole_and_each_actor_sees_its_devices(four_fake_gpus, tmp_path):
    import ray

    from rft.runtime.actors import RayActor, placement_for

    class Probe:
        def seen(self):
            import os

            import ray

            return os.environ["CUDA_VISIBLE_DEVICES"], ray.get_gpu_ids()

    cfg = compose_cfg(["stages=[]", "cluster=local", "cluster.gpu_per_node=4", "trainer=fsdp2",
                       "explorer.rollout_model.engine_num=1", "explorer.rollout_model.tensor_parallel_size=2",
                       "cluster.device_mapping.trainer=[0,1]", "cluster.device_mapping.explorer=[2,3]"])
    pg, options = placement_for(cfg)
    try:
        # the node's 4 GPUs as one bundle, with a CPU per device in use
        assert ray.util.placement_group_table(pg)["bundles"] == {0: {"GPU": 4.0, "CPU": 4.0}}
        actors = [RayActor(Probe, name=f"probe_{i}", log_dir=str(tmp_path), level="INFO", **o)
                  for i, o in enumerate(options)]
        # ranks on devices 0 and 1, the engine on 2 and 3: of the node's "3,2,1,0", "3", "2" and
        # "1,0"; Ray assigned none of them (they asked for no GPU), so it set nothing over ours
        assert [a.call("seen") for a in actors] == [("3", []), ("2", []), ("1,0", [])]
        # each one's log says so
        assert "devices 2,3 of its node (cluster.device_mapping): CUDA_VISIBLE_DEVICES=1,0" in (
            tmp_path / "probe_2.log").read_text()
        for a in actors:
            a.kill()
    finally:
        ray.util.remove_placement_group(pg)
