"""cluster.num_cpus of a local Ray instance against what the actors reserve, reward-model workers
included: a plan that cannot be placed is refused by the dry run (check_placement), not left to hang."""

import pytest
from conftest import compose_cfg

from rft.errors import ConfigError
from rft.plan.placement import check_placement

RM = ("buffer.explorer_input.taskset.reward_fn=[{fn: exact_match, weight: 1}, "
      "{fn: reward_model, weight: 0.5, args: {model_path: '/m/rm', num_cpus: 2}}]")


def test_reward_model_cpus_count_against_a_local_ray_instance():
    # trainer 1 + engine 1 + reward model 2 = 4 CPUs; 3 cannot hold them
    with pytest.raises(ConfigError) as e:
        check_placement(compose_cfg(["stages=[]", "cluster=local", "cluster.num_cpus=3", RM]))
    assert str(e.value) == (
        "the actors need 4 CPUs (cluster.cpus_per_actor=1 for each of the trainer's ranks and "
        "explorer.rollout_model.engine_num=1 engine(s), and 1 reward-model worker(s) "
        "(buffer.explorer_input.taskset.reward_fn[1].args: args.num_cpus each, default 1)), but cluster.num_cpus=3 "
        "gives Ray only that many, so they could never all be placed. Set cluster.num_cpus=4 or more (Ray's CPUs "
        "are reservations, not cores), or lower those.")
    # 4 hold them; without the reward model 2 do; num_cpus null (every CPU) or a cluster of its own: not checked here
    assert len(check_placement(compose_cfg(["stages=[]", "cluster=local", "cluster.num_cpus=4", RM])).bundles) == 3
    assert len(check_placement(compose_cfg(["stages=[]", "cluster=local", "cluster.num_cpus=2"])).bundles) == 2
    assert len(check_placement(compose_cfg(["stages=[]", "cluster=local", RM])).bundles) == 3


def test_without_reward_models_the_message_names_the_actors_alone():
    # trainer 1 + engine_num 3 = 4 CPUs
    with pytest.raises(ConfigError) as e:
        check_placement(compose_cfg(["stages=[]", "cluster=local", "cluster.num_cpus=2",
                                     "explorer.rollout_model.engine_num=3"]))
    assert "need 4 CPUs" in str(e.value) and "engine_num=3 engine(s)), but cluster.num_cpus=2" in str(e.value)
