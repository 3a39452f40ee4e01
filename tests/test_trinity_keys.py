"""Trinity-RFT's keys that mean something else here: algorithm.algorithm_type picks the algorithm
there, it only names the stage here (rft.plan.batch.check_algorithm_label)."""

import pytest
from conftest import ROOT, compose_cfg

from rft.errors import ConfigError
from rft.plan.batch import algorithm_file_fns
from rft.runtime.main import split_stages


def test_algorithm_file_fns_follow_the_files_they_extend():
    conf = ROOT / "conf"
    # dr_grpo.yaml sets advantage_fn and extends grpo.yaml, whose policy_loss_fn it keeps
    assert algorithm_file_fns("dr_grpo", conf) == {"advantage_fn": "dr_grpo", "policy_loss_fn": "ppo_clip"}
    # two files down: reinforce_pp_baseline -> reinforce_pp -> grpo
    assert algorithm_file_fns("reinforce_pp_baseline", conf) == {"advantage_fn": "reinforce_pp_baseline",
                                                                 "policy_loss_fn": "ppo_clip"}
    # a `# @package _global_` file: its keys under algorithm:
    assert algorithm_file_fns("sft", conf) == {"advantage_fn": "none", "policy_loss_fn": "sft"}
    assert algorithm_file_fns("mine", conf) is None


def test_trinity_algorithm_type_that_would_run_another_algorithm_stops():
    with pytest.raises(ConfigError) as e:
        split_stages(compose_cfg(["algorithm.algorithm_type=dpo", "stages=[]"]))
    assert str(e.value) == (
        "algorithm.algorithm_type=dpo is only a name for logs and outputs here (in Trinity-RFT it picks the "
        "algorithm): this stage would run advantage_fn=grpo, policy_loss_fn=ppo_clip, not dpo's advantage_fn=none, "
        "policy_loss_fn=dpo. Choose the algorithm with algorithm=dpo (conf/algorithm/dpo.yaml; in a stage's entry, "
        "its algorithm keys as that file sets them), or give a name that is no algorithm's.")
    # Trinity's stage form: the stage is named and its own entry pointed at
    with pytest.raises(ConfigError) as e:
        split_stages(compose_cfg(["+stages.1.algorithm={algorithm_type: sft}"]))
    assert str(e.value).startswith("stage grpo: algorithm.algorithm_type=sft is only a name")
    assert "this stage would run advantage_fn=grpo, policy_loss_fn=ppo_clip, not sft's advantage_fn=none" in str(e.value)
    assert str(e.value).endswith("The stage's own entry sets algorithm.algorithm_type: change it there, "
                                 "stages.1.algorithm.algorithm_type (the same key outside the stage does not change it).")


@pytest.mark.parametrize("overrides, labels", [
    # the group's own label, a function overridden after it (README: algorithm.policy_loss_fn=my.loss)
    (["algorithm=grpo", "algorithm.policy_loss_fn=gspo", "stages=[]"], ["grpo"]),
    # the default warm-up stage names sft and sets sft's functions
    (["algorithm=dpo"], ["sft", "dpo"]),
    # a label that is no algorithm's file
    (["algorithm.algorithm_type=mine", "stages=[]"], ["mine"]),
])
def test_labels_that_name_what_runs_pass(overrides, labels):
    stages, _ = split_stages(compose_cfg(overrides))
    assert [s.algorithm.algorithm_type for s in stages] == labels
