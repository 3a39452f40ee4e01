"""Hand-computed values for every advantage function and policy loss beyond GRPO's."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from rft.algorithms import ADVANTAGE_FNS, POLICY_LOSS_FNS
from rft.config import AlgorithmConfig


def loss_fn(name, logp, old, adv, mask, cfg, ref=None):
    """Call a registered policy loss with its batch dict."""
    return POLICY_LOSS_FNS[name](logp, {"old_logp": old, "advantages": adv, "response_mask": mask, "ref_logp": ref}, cfg)


def algo(**overrides):
    return OmegaConf.structured(AlgorithmConfig(**overrides))


def batch(rewards, groups, mask=None):
    mask = torch.ones(len(rewards), 1) if mask is None else torch.tensor(mask, dtype=torch.float32)
    return {"rewards": torch.tensor(rewards, dtype=torch.float32), "group_index": torch.tensor(groups),
            "response_mask": mask}


REWARDS, GROUPS = [1, 0, 0, 1, 2, 4, 7], [0, 0, 0, 0, 1, 1, 2]  # group 2 is a group of one


def test_dr_grpo_is_reward_minus_group_mean():
    # group 0 mean 0.5 -> +-0.5; group 1 mean 3 -> -1, +1; group of one -> 7 - 7 = 0
    adv = ADVANTAGE_FNS["dr_grpo"](batch(REWARDS, GROUPS), algo())[:, 0]
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, -1.0, 1.0, 0.0]))


def test_rloo_is_reward_minus_mean_of_the_others():
    # rollout 0: 1 - (0 + 0 + 1) / 3 = 2/3; rollout 1: 0 - (1 + 0 + 1) / 3 = -2/3
    # group 1: 2 - 4 = -2, 4 - 2 = 2; a group of one has no others: 0
    adv = ADVANTAGE_FNS["rloo"](batch(REWARDS, GROUPS), algo())[:, 0]
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, -2.0, 2.0, 0.0]))


def test_opmd_baselines():
    # mean baseline: as dr_grpo
    adv = ADVANTAGE_FNS["opmd"](batch([0, 1], [0, 0]), algo(opmd_baseline="mean"))[:, 0]
    torch.testing.assert_close(adv, torch.tensor([-0.5, 0.5]))
    # logavgexp, tau 1: baseline = ln((e^0 + e^1) / 2) = ln(1.859141) = 0.620115
    adv = ADVANTAGE_FNS["opmd"](batch([0, 1], [0, 0]), algo(opmd_baseline="logavgexp", tau=1.0))[:, 0]
    torch.testing.assert_close(adv, torch.tensor([-0.620115, 0.379885]), atol=1e-6, rtol=0)
    # tau -> 0 tends to the max: baseline 1 (tau 0.01: 0.01 * (ln(1 + e^100) - ln 2) = 0.993069)
    adv = ADVANTAGE_FNS["opmd"](batch([0, 1], [0, 0]), algo(opmd_baseline="logavgexp", tau=0.01))[:, 0]
    torch.testing.assert_close(adv, torch.tensor([-0.993069, 0.006931]), atol=1e-5, rtol=0)


def test_reinforce_pp_returns_whitened_over_the_batch():
    # gamma 1: returns [[1, 1, -], [-1, -, -]]; tokens [1, 1, -1]: mean 1/3,
    # unbiased var ((2/3)^2 * 2 + (4/3)^2) / 2 = 4/3, std 1.154701
    b = batch([1, -1], [0, 1], mask=[[1, 1, 0], [1, 0, 0]])
    adv = ADVANTAGE_FNS["reinforce_pp"](b, algo(gamma=1.0))
    s = math.sqrt(4 / 3)
    torch.testing.assert_close(adv, torch.tensor([[(2 / 3) / s, (2 / 3) / s, 0.0], [(-4 / 3) / s, 0.0, 0.0]]))
    # gamma 0.5: returns [[0.5, 1], [-1]]: mean 1/6; deviations 1/3, 5/6, -7/6;
    # var (1/9 + 25/36 + 49/36) / 2 = 13/12
    adv = ADVANTAGE_FNS["reinforce_pp"](b, algo(gamma=0.5))
    s = math.sqrt(13 / 12)
    torch.testing.assert_close(adv, torch.tensor([[(1 / 3) / s, (5 / 6) / s, 0.0], [(-7 / 6) / s, 0.0, 0.0]]))


def test_reinforce_pp_baseline_subtracts_the_group_mean_first():
    # rewards [1, 0] in one group -> [0.5, -0.5]; two tokens each: tokens [.5, .5, -.5, -.5],
    # mean 0, var (4 * 0.25) / 3 = 1/3 -> +-0.5 / 0.577350 = +-0.866025
    b = batch([1, 0], [0, 0], mask=[[1, 1], [1, 1]])
    adv = ADVANTAGE_FNS["reinforce_pp_baseline"](b, algo())
    a = 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(adv, torch.tensor([[a, a], [-a, -a]]), atol=1e-5, rtol=0)


def test_ppo_dual_clip_caps_negative_advantage_losses():
    # ratio e^2 = 7.389 with A = -1: max(7.389, 1.2) = 7.389, capped at -A * 3 = 3
    logp, old, mask = torch.tensor([[2.0]]), torch.zeros(1, 1), torch.ones(1, 1)
    loss, _ = loss_fn("ppo_clip", logp, old, -torch.ones(1, 1), mask, algo(clip_ratio_c=3.0))
    assert loss.item() == pytest.approx(3.0)
    loss, _ = loss_fn("ppo_clip", logp, old, -torch.ones(1, 1), mask, algo())
    assert loss.item() == pytest.approx(math.exp(2))


def test_ppo_clip_higher_counts_low_and_high_clips_separately():
    # ratios [1.25, 0.7]: eps_high 0.28 leaves 1.25 unclipped for A > 0; 0.7 < 0.8 clips for A < 0
    logp = torch.log(torch.tensor([[1.25, 0.7]]))
    loss, m = loss_fn("ppo_clip", logp, torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]),
                                          torch.ones(1, 2), algo(clip_ratio_high=0.28))
    # A=+1: max(-1.25, -1.25) = -1.25; A=-1: max(0.7, 0.8) = 0.8 (clipped, low side)
    torch.testing.assert_close(loss, torch.tensor([[-1.25, 0.8]]))
    assert (m["actor/clip_frac_low"], m["actor/clip_frac_high"]) == (1.0, 0.0)


def test_gspo_uses_one_ratio_per_sequence():
    # log-ratios [ln 2, 0] -> sequence ratio exp(ln 2 / 2) = sqrt(2) = 1.414214 on both tokens
    logp = torch.tensor([[math.log(2.0), 0.0]], requires_grad=True)
    old, mask = torch.zeros(1, 2), torch.ones(1, 2)
    cfg = algo(clip_ratio_low=0.2, clip_ratio_high=0.2)
    # A = +1: max(-1.414214, -1.2) = -1.2 (clipped: no gradient)
    loss, _ = loss_fn("gspo", logp, old, torch.ones(1, 2), mask, cfg)
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -1.2]]))
    # A = -1: max(1.414214, 1.2) = 1.414214; d loss_t / d logp_t = -A * s = 1.414214 per token, and
    # the mean over the two tokens is exactly the gradient of the sequence ratio -A * s
    loss, _ = loss_fn("gspo", logp, old, -torch.ones(1, 2), mask, cfg)
    torch.testing.assert_close(loss.detach(), torch.full((1, 2), math.sqrt(2)))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.full((1, 2), math.sqrt(2)))


def test_gmpo_geometric_mean_with_sign_aware_log_clipping():
    old, mask, cfg = torch.zeros(1, 2), torch.ones(1, 2), algo(clip_ratio_low=0.4, clip_ratio_high=0.4)
    logp = torch.tensor([[0.6, -0.2]])
    # A = +1: clipped [0.4, -0.2], min with unclipped [0.4, -0.2], mean 0.1 -> loss -e^0.1 = -1.105171
    loss, _ = loss_fn("gmpo", logp, old, torch.ones(1, 2), mask, cfg)
    torch.testing.assert_close(loss, torch.full((1, 2), -math.exp(0.1)))
    # A = -1: max with unclipped [0.6, -0.2], mean 0.2 -> loss +e^0.2 = 1.221403
    loss, _ = loss_fn("gmpo", logp, old, -torch.ones(1, 2), mask, cfg)
    torch.testing.assert_close(loss, torch.full((1, 2), math.exp(0.2)))
    # A = +1 with log-ratios [-0.6, 0.1]: min(-0.6, -0.4) = -0.6, 0.1 -> mean -0.25 -> -e^-0.25
    loss, _ = loss_fn("gmpo", torch.tensor([[-0.6, 0.1]]), old, torch.ones(1, 2), mask, cfg)
    torch.testing.assert_close(loss, torch.full((1, 2), -math.exp(-0.25)))


def test_cpgd_clamps_the_log_prob():
    logp = torch.log(torch.tensor([[1.5, 0.5]]))
    old, mask, cfg = torch.zeros(1, 2), torch.ones(1, 2), algo()
    # A = +1: min(logp, ln 1.2) = [ln 1.2, ln 0.5] -> loss [-0.182322, 0.693147]
    loss, m = loss_fn("cpgd", logp, old, torch.ones(1, 2), mask, cfg)
    torch.testing.assert_close(loss, torch.tensor([[-math.log(1.2), math.log(2.0)]]))
    assert m["actor/clip_frac"] == 1.0
    # A = -1: max(logp, ln 0.8) = [ln 1.5, ln 0.8] -> loss [0.405465, -0.223144]
    loss, _ = loss_fn("cpgd", logp, old, -torch.ones(1, 2), mask, cfg)
    torch.testing.assert_close(loss, torch.tensor([[math.log(1.5), math.log(0.8)]]))


def test_opmd_loss():
    # -A * logp / (1 + tau) = -2 * -0.5 / 2 = 0.5
    loss, _ = loss_fn("opmd", torch.tensor([[-0.5]]), None, torch.tensor([[2.0]]), None, algo(tau=1.0))
    assert loss.item() == pytest.approx(0.5)


@pytest.mark.parametrize("name", [n for n in POLICY_LOSS_FNS if n != "sft"])
def test_every_loss_is_finite_on_a_huge_log_ratio_and_a_masked_row(name):
    logp = torch.tensor([[60.0, -60.0], [0.3, 0.1]], requires_grad=True)
    old = torch.zeros(2, 2)
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])  # the second row is fully masked
    loss, _ = loss_fn(name, logp, old, torch.tensor([[1.0, 1.0], [-1.0, -1.0]]), mask, algo(), ref=old)
    (loss * mask).sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(logp.grad).all()
    assert torch.equal(logp.grad[1], torch.zeros(2))


@pytest.mark.parametrize(
    "length, expected",
    [
        (10, 0.0),  # well inside the budget
        (16, 0.0),  # max 20 - buffer 4 = 16: the buffer starts after here
        (18, -0.5),  # -(18 - 16) / 4 * 1
        (20, -1.0),  # at the limit: -factor
    ],
)
def test_dapo_overlong_penalty(length, expected):
    from rft.rewards import overlong_penalty

    assert overlong_penalty(length, max_len=20, buffer_len=4, factor=1.0) == pytest.approx(expected)


def test_dpo_loss_hand_computed():
    # one pair: chosen row 0 (2 tokens), rejected row 1 (1 token); beta 0.5
    # chosen: sum logp -1.0 - ref -2.0 = +1.0; rejected: sum logp -3.0 - ref -1.0 = -2.0
    # margin = 0.5 * (1.0 - (-2.0)) = 1.5; loss = -log sigmoid(1.5) = log(1 + e^-1.5) = 0.201413
    logp = torch.tensor([[-0.25, -0.75], [-3.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0], [-1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, m = loss_fn("dpo", logp, None, None, mask, algo(dpo_beta=0.5), ref=ref)
    pair = math.log1p(math.exp(-1.5))
    # spread over each row's tokens: row 0 gets pair/2 per token, row 1 pair on its one token
    torch.testing.assert_close(loss.detach(), torch.tensor([[pair / 2, pair / 2], [pair, 0.0]]))
    assert m["dpo/accuracy"] / 3 == pytest.approx(1.0)  # token sums: 3 response tokens
    assert m["dpo/reward_margin"] / 3 == pytest.approx(1.5)
    # seq-mean-token-sum over the 2 rows = (pair + pair) / 2 = pair; its gradient on the chosen
    # row's tokens: -beta * (1 - sigmoid(1.5)) = -0.5 * 0.182426 = -0.091213 each
    (loss * mask).sum().div(2).backward()
    g = -0.5 * (1 - 1 / (1 + math.exp(-1.5)))
    torch.testing.assert_close(logp.grad, torch.tensor([[g, g], [-g, 0.0]]))


def test_gae_hand_computed():
    from rft.algorithms.advantages import gae_returns

    # one row, prompt position 0 masked out, response at positions 1..3, reward 1 on position 3
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    values = torch.tensor([[9.0, 0.5, 0.25, 0.75]])  # the prompt's value must not leak in
    # gamma 1, lam 1: A_t = R - V_t (Monte Carlo): [0.5, 0.75, 0.25]; returns = 1 on every token
    adv, ret = gae_returns(torch.tensor([1.0]), values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.5, 0.75, 0.25]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 1.0, 1.0, 1.0]]))
    # lam 0 (one-step TD): delta_3 = 1 - 0.75 = 0.25; delta_2 = 0.75 - 0.25 = 0.5;
    # delta_1 = 0.25 - 0.5 = -0.25
    adv, _ = gae_returns(torch.tensor([1.0]), values, mask, gamma=1.0, lam=0.0)
    torch.testing.assert_close(adv, torch.tensor([[0.0, -0.25, 0.5, 0.25]]))
    # gamma 0.5, lam 1: delta_3 = 0.25; delta_2 = 0.5 * 0.75 - 0.25 = 0.125;
    # delta_1 = 0.5 * 0.25 - 0.5 = -0.375; A_3 = 0.25, A_2 = 0.125 + 0.5 * 0.25 = 0.25,
    # A_1 = -0.375 + 0.5 * 0.25 = -0.25
    adv, _ = gae_returns(torch.tensor([1.0]), values, mask, gamma=0.5, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.0, -0.25, 0.25, 0.25]]))


def test_explained_variance():
    from rft.critic import explained_variance

    mask = torch.ones(1, 4)
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    # a constant critic explains nothing: Var(R - c) = Var(R)
    assert explained_variance(returns, torch.full((1, 4), 2.5), mask) == pytest.approx(0.0)
