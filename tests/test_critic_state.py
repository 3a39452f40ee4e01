"""algorithm=ppo's value model on resume: its part of trainer_state.pt goes through the same shape check
as the policy's (rft.trainer.state.check_state), before anything loads."""

import pytest
import torch
from test_read_back2 import edited
from test_trainer import experiences, make_trainer

from rft.trainer.state import CheckpointFileError


@pytest.fixture(scope="module")
def saved_ppo(tmp_path_factory):
    t = make_trainer(128, ["algorithm=ppo"])
    t.train_step(experiences())
    d = tmp_path_factory.mktemp("ckpt")
    t.save(str(d))
    return t, d


def critic_moment(state):
    """The critic's Adam exp_avg of its first parameter tripled to [3, *shape]: torch's
    Optimizer.load_state_dict took it without a word."""
    m = state["critic"]["optimizer"]["state"][0]
    m["exp_avg"] = torch.zeros(3, *m["exp_avg"].shape)


def critic_weight(state):
    """A weight of the value model's that another model's checkpoint would hold."""
    name = next(iter(state["critic"]["model"]))
    state["critic"]["model"][name] = torch.zeros(7, 7)


@pytest.mark.slow
def test_a_critic_state_of_another_shape_is_refused_before_anything_loads(saved_ppo, tmp_path):
    t, d = saved_ppo
    (tmp_path / "moment").mkdir()
    ckpt = edited(d, tmp_path / "moment", critic_moment)
    shape = list(t.critic.optimizer.state_dict()["state"][0]["exp_avg"].shape)
    fresh = make_trainer(128, ["algorithm=ppo"])
    before = fresh.fingerprint()
    with pytest.raises(CheckpointFileError) as e:
        fresh.load(str(ckpt))
    assert str(e.value) == (f"{ckpt / 'trainer_state.pt'} does not load (its critic's optimizer's exp_avg of "
                            f"parameter 0 has shape {[3, *shape]}, the parameter {shape}: the trainer never saves one so)")
    assert fresh.fingerprint() == before and fresh.version == 0
    (tmp_path / "weight").mkdir()
    ckpt = edited(d, tmp_path / "weight", critic_weight)
    name = next(iter(t.critic.model.state_dict()))
    with pytest.raises(CheckpointFileError) as e:
        fresh.load(str(ckpt))
    assert str(e.value) == (f"{ckpt / 'trainer_state.pt'} does not load (its critic's weight {name!r} is [7, 7], "
                            f"which this value model does not hold so: the trainer never saves one so)")
    fresh.load(str(d))  # as saved: loads
    assert fresh.version == 1
