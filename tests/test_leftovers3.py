"""Leftovers of earlier audits: the dry run's placement against a local Ray instance's CPUs, files a
run reads back bounded, misspelt keys in free-form args."""

import pytest
from conftest import compose_cfg

import rft.runtime.main
from rft.errors import ConfigError

RM = ("buffer.explorer_input.taskset.reward_fn=[{fn: exact_match, weight: 1}, "
      "{fn: reward_model, weight: 0.5, args: {model_path: '/m/rm', num_cpus: 2}}]")


def test_the_dry_run_refuses_actors_a_local_ray_instance_cannot_place(tmp_path):
    """cluster.num_cpus=3 for trainer 1 + engine 1 + a reward model of args.num_cpus=2 = 4 CPUs: the
    dry run passed it and the run stopped once Ray had started; now the dry run says so, in the words
    the start uses (rft.plan.placement.check_resources, one check for both)."""
    with pytest.raises(ConfigError) as e:
        rft.runtime.main._main(compose_cfg(["dry_run=true", "cluster.num_cpus=3", f"checkpoint_root_dir={tmp_path}", RM]))
    assert str(e.value) == (
        "stage grpo: the actors need 4 CPU (cluster.cpus_per_actor=1, gpu_per_node=0, "
        "explorer.rollout_model.engine_num=1, colocate=False, reward model workers=1) but the Ray cluster has 3. "
        "Lower those, or start Ray with more (cluster.num_cpus for a local instance: it may exceed this machine's "
        "cores, e.g. cluster.num_cpus=4; or cluster=inline).")


def test_the_dry_runs_placement_row_lists_the_reward_model_workers(tmp_path, capsys):
    """They reserve CPUs (or a GPU) like the actors; the row named the engines and the trainer alone."""
    rft.runtime.main._main(compose_cfg(["dry_run=true", "cluster.num_cpus=4", f"checkpoint_root_dir={tmp_path}", RM]))
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("placement")]
    # the warm-up stage has no reward model; the grpo stage's 4 CPUs fit cluster.num_cpus=4
    assert "reward model" not in rows[0]
    assert rows[1].endswith("trainer torch, 1 rank; reward model buffer.explorer_input.taskset.reward_fn[1].args "
                            "on 2 CPU (args.num_cpus); weights by sync=memory")


@pytest.mark.parametrize("args, cluster, place", [
    ("num_cpus: 2", "cluster.gpu_per_node=3", "on a GPU of its own"),
    ("colocate: true", "cluster.gpu_per_node=2", "sharing bundle 0 (args.colocate)"),
    ("num_cpus: 2", "cluster.colocate=true", "sharing the one bundle"),
])
def test_the_placement_row_says_where_a_reward_model_goes(args, cluster, place):
    from rft.plan.memory import _placement

    cfg = compose_cfg(["stages=[]", RM.replace("num_cpus: 2", args), cluster])
    assert f"reward model buffer.explorer_input.taskset.reward_fn[1].args {place}" in _placement(cfg)


def test_without_num_cpus_the_plan_leaves_the_count_to_ray():
    """cluster.num_cpus null is every CPU of the machine Ray starts on, which the plan's may not be:
    counted at start (ray.cluster_resources()), not here; a cluster the run joins likewise."""
    from rft.plan.placement import check_placement, local_resources

    assert local_resources(compose_cfg(["stages=[]", RM])) is None
    assert local_resources(compose_cfg(["stages=[]", "cluster=ray", RM])) is None
    assert local_resources(compose_cfg(["stages=[]", "cluster.num_cpus=4"])) == {"CPU": 4, "GPU": 0}
    assert len(check_placement(compose_cfg(["stages=[]", RM])).bundles) == 3  # 1 + 1 + the reward model's 2 CPUs
