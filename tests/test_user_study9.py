"""A new user who comes from Trinity-RFT (experiments/from_trinity/): the manual's GRPO example
translated into rft's keys, then the keys, modes and habits such a user brings. Each test is a
defect that study met."""

import pytest
from conftest import compose_cfg

from rft.errors import ConfigError
from rft.runtime.main import split_stages


# ---------------------------------------------------------------- algorithm_type: mix, dapo

@pytest.mark.parametrize("label, said, missing", [
    # mix.yaml keeps grpo's functions and turns on the SFT term (sft_loss_weight 0.1)
    ("mix", "with sft_loss_weight=0.0", "not mix's sft_loss_weight=0.1"),
    # dapo.yaml keeps them too: dynamic sampling (4 tries) and the overlong penalty (last 0.2)
    ("dapo", "with dynamic_sampling_max_tries=0, overlong_buffer_frac=0.0",
     "not dapo's dynamic_sampling_max_tries=4, overlong_buffer_frac=0.2"),
])
def test_trinity_algorithm_type_with_grpos_functions_stops(label, said, missing):
    """Trinity-RFT's `algorithm_type: mix` picks its mix algorithm; here it was a label only, and as
    mix keeps grpo's functions the plan passed it: exit 0, GRPO without the SFT term under the name mix."""
    with pytest.raises(ConfigError) as e:
        split_stages(compose_cfg([f"algorithm.algorithm_type={label}", "stages=[]"]))
    assert str(e.value) == (
        f"algorithm.algorithm_type={label} is only a name for logs and outputs here (in Trinity-RFT it picks the "
        f"algorithm): this stage would run advantage_fn=grpo, policy_loss_fn=ppo_clip {said}, {missing}. "
        f"Choose the algorithm with algorithm={label} (conf/algorithm/{label}.yaml; in a stage's entry, its "
        f"algorithm keys as that file sets them), or give a name that is no algorithm's.")


@pytest.mark.parametrize("overrides, label", [
    # the group chosen: its own label
    (["algorithm=mix"], "mix"),
    # one of the file's switches on: the user set up the SFT term, the label names what runs
    (["algorithm.algorithm_type=mix", "algorithm.sft_loss_weight=0.5"], "mix"),
    (["algorithm.algorithm_type=dapo", "algorithm.dynamic_sampling_max_tries=3"], "dapo"),
])
def test_a_label_whose_switch_is_on_passes(overrides, label):
    stages, _ = split_stages(compose_cfg([*overrides, "stages=[]"]))
    assert [s.algorithm.algorithm_type for s in stages] == [label]
