"""Hand-computed values for every advantage function and policy loss beyond GRPO's."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from rft.algorithms import ADVANTAGE_FNS, POLICY_LOSS_FNS, agg_loss
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


# Equal rewards carry no signal: every estimator must give exactly 0 for them, whatever the value.
# None of these is exact in binary: a float mean of n copies of 0.9 is one rounding step off 0.9
# (in float64 too), which GRPO's std then blows up to advantages of +-0.05..0.3.
EQUAL_REWARDS = (0.9, -0.9, 1.9350059, 0.1, 1 / 3, 1e6 + 0.1, -3.7e-5)
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# name -> (advantage fn, config); gae: values 0 and gamma = lam = 1 make A_t = R on every token
ESTIMATORS = {
    "grpo": ("grpo", {}),
    "dr_grpo": ("dr_grpo", {}),
    "rloo": ("rloo", {}),
    "opmd_mean": ("opmd", {"opmd_baseline": "mean"}),
    "opmd_logavgexp": ("opmd", {"opmd_baseline": "logavgexp", "tau": 1.0}),
    "opmd_logavgexp_cold": ("opmd", {"opmd_baseline": "logavgexp", "tau": 0.01}),
    "reinforce_pp": ("reinforce_pp", {"gamma": 1.0}),
    "reinforce_pp_baseline": ("reinforce_pp_baseline", {"gamma": 0.9}),
    "gae": ("gae", {"gamma": 1.0, "lam": 1.0}),
}
# those that baseline each group on its own (reinforce_pp_baseline whitens over the batch after)
GROUPWISE = ("grpo", "dr_grpo", "rloo", "opmd_mean", "opmd_logavgexp", "opmd_logavgexp_cold")


def response_mask(n):
    """Rows of 2, 1 and 0 response tokens (in turn) after a prompt token."""
    shapes = ([0.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0])
    return torch.tensor([shapes[i % 3] for i in range(n)])


def advantages_in(estimator, rewards, groups, dtype):
    """The estimator's advantages [N, 3] for rewards given in dtype, on `response_mask` rows."""
    name, cfg = ESTIMATORS[estimator]
    b = {"rewards": torch.tensor(rewards, dtype=dtype), "group_index": torch.tensor(groups),
         "response_mask": response_mask(len(rewards)), "values": torch.zeros(len(rewards), 3, dtype=dtype)}
    adv = ADVANTAGE_FNS[name](b, algo(**cfg))
    assert adv.dtype in (torch.float32, torch.float64, dtype)
    return adv


def representable(value, dtype):
    return bool(torch.isfinite(torch.tensor(value, dtype=dtype)))  # 1e6 overflows float16


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_equal_rewards_give_exactly_zero_advantages(estimator, dtype):
    for value in filter(lambda v: representable(v, dtype), EQUAL_REWARDS):
        for size in range(1, 9):  # one group of `size` equal rewards
            adv = advantages_in(estimator, [value] * size, [0] * size, dtype)
            assert torch.equal(adv, torch.zeros(size, 3)), (value, size, adv)
        # groups of sizes 1..8 in one batch, interleaved: 36 equal rewards
        groups = [g for g in range(8) for _ in range(g + 1)]
        groups = [groups[(i * 7) % 36] for i in range(36)]  # 7 is prime to 36: a permutation
        adv = advantages_in(estimator, [value] * 36, groups, dtype)
        assert torch.equal(adv, torch.zeros(36, 3)), (value, adv)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("estimator", GROUPWISE + ("reinforce_pp_baseline",))
def test_groups_of_equal_rewards_give_zero_whatever_each_group_value(estimator, dtype):
    # every group flat at its own value, group g of size g + 1: the group baselines leave exactly 0
    values = [v for v in EQUAL_REWARDS if representable(v, dtype)]
    groups = [g for g in range(len(values)) for _ in range(g + 1)]
    adv = advantages_in(estimator, [values[g] for g in groups], groups, dtype)
    assert torch.equal(adv, torch.zeros(len(groups), 3)), adv


# the non-flat groups of the mixed batch below: [1, 0] (group 1) and [0.5, 2, 1.25] (group 4);
# dyadic, so that they are exact in every dtype
MIXED_EXPECTED = {
    # [1, 0]: mean 0.5, std sqrt(0.5 / 1); [0.5, 2, 1.25]: mean 1.25, deviations -0.75, 0.75, 0,
    # std sqrt((0.5625 + 0.5625) / 2) = 0.75
    "grpo": ([0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6)],
             [-0.75 / (0.75 + 1e-6), 0.75 / (0.75 + 1e-6), 0.0]),
    "dr_grpo": ([0.5, -0.5], [-0.75, 0.75, 0.0]),
    # 1 - 0, 0 - 1; 0.5 - (2 + 1.25) / 2 = -1.125, 2 - (0.5 + 1.25) / 2 = 1.125, 1.25 - 1.25 = 0
    "rloo": ([1.0, -1.0], [-1.125, 1.125, 0.0]),
    "opmd_mean": ([0.5, -0.5], [-0.75, 0.75, 0.0]),
    # tau 1: ln((e + 1) / 2) = 0.620115; ln((e^0.5 + e^2 + e^1.25) / 3) = ln(12.528120 / 3) = 1.429363
    "opmd_logavgexp": ([1 - 0.620115, -0.620115], [0.5 - 1.429363, 2 - 1.429363, 1.25 - 1.429363]),
    # tau 0.01: 0.01 * ln((e^100 + 1) / 2) = 1 - 0.01 ln 2 = 0.993069 (to 1e-44);
    # 0.01 * ln((e^50 + e^200 + e^125) / 3) = 2 - 0.01 ln 3 = 1.989014 (to 1e-35)
    "opmd_logavgexp_cold": ([1 - 0.993069, -0.993069], [0.5 - 1.989014, 2 - 1.989014, 1.25 - 1.989014]),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("estimator", GROUPWISE)
def test_flat_groups_get_zero_beside_groups_with_signal(estimator, dtype):
    # groups 0, 3, 5 flat (sizes 3, 5, 8), 2 a group of one, 1 and 4 with signal; rows shuffled
    values = {0: [0.9] * 3, 1: [1.0, 0.0], 2: [-0.9], 3: [1.9350059] * 5, 4: [0.5, 2.0, 1.25], 5: [1 / 3] * 8}
    expected = {g: [0.0] * len(v) for g, v in values.items()}
    expected[1], expected[4] = MIXED_EXPECTED[estimator]
    rows = [(g, r, a) for g in values for r, a in zip(values[g], expected[g])]
    rows = [rows[(i * 5) % len(rows)] for i in range(len(rows))]  # 5 is prime to 22 rows
    groups, rewards, want = zip(*rows)
    adv = advantages_in(estimator, list(rewards), list(groups), dtype)
    flat = torch.tensor([g in (0, 2, 3, 5) for g in groups])
    assert torch.equal(adv[flat], torch.zeros(int(flat.sum()), 3)), adv
    want = torch.tensor(want, dtype=adv.dtype)[:, None] * response_mask(len(rows)).to(adv.dtype)
    torch.testing.assert_close(adv, want, rtol=1e-5, atol=1e-6)


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
    loss, m = loss_fn("gmpo", torch.tensor([[-0.6, 0.1]]), old, torch.ones(1, 2), mask, cfg)
    torch.testing.assert_close(loss, torch.full((1, 2), -math.exp(-0.25)))
    # -0.6 is past the lower bound, which binds only for A < 0: no token clipped here
    assert m["actor/clip_frac"] == 0.0
    # A = -1 with the same log-ratios: max(-0.6, -0.4) = -0.4 binds on the first token
    _, m = loss_fn("gmpo", torch.tensor([[-0.6, 0.1]]), old, -torch.ones(1, 2), mask, cfg)
    assert m["actor/clip_frac"] == 1.0


def test_cpgd_clamps_the_log_prob():
    logp = torch.log(torch.tensor([[1.5, 0.5]]))
    old, mask, cfg = torch.zeros(1, 2), torch.ones(1, 2), algo()
    # A = +1: min(logp, ln 1.2) = [ln 1.2, ln 0.5] -> loss [-0.182322, 0.693147]
    loss, m = loss_fn("cpgd", logp, old, torch.ones(1, 2), mask, cfg)
    torch.testing.assert_close(loss, torch.tensor([[-math.log(1.2), math.log(2.0)]]))
    assert m["actor/clip_frac"] == 1.0
    # A = -1: max(logp, ln 0.8) = [ln 1.5, ln 0.8] -> loss [0.405465, -0.223144]
    loss, m = loss_fn("cpgd", logp, old, -torch.ones(1, 2), mask, cfg)
    torch.testing.assert_close(loss, torch.tensor([[math.log(1.5), math.log(0.8)]]))
    assert m["actor/clip_frac"] == 1.0  # ln 0.5 < ln 0.8: the second token's
    # A = 0: no bound binds (the loss is 0 whatever the log-prob)
    _, m = loss_fn("cpgd", logp, old, torch.zeros(1, 2), mask, cfg)
    assert m["actor/clip_frac"] == 0.0


def test_opmd_loss():
    # -A * logp / (1 + tau) = -2 * -0.5 / 2 = 0.5
    loss, _ = loss_fn("opmd", torch.tensor([[-0.5]]), None, torch.tensor([[2.0]]), torch.ones(1, 1), algo(tau=1.0))
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
    from rft.algorithms.shaping import overlong_penalty

    assert overlong_penalty(length, max_len=20, buffer_len=4, factor=1.0) == pytest.approx(expected)


def test_the_overlong_penalty_changes_the_reward_and_is_logged():
    from types import SimpleNamespace

    from rft.algorithms.shaping import apply_overlong
    from rft.data.experience import Experience
    from rft.rollout.explorer import rollout_metrics

    algo = SimpleNamespace(overlong_buffer_frac=0.2, overlong_penalty_factor=1.0)  # 20 tokens: buffer 4
    long = Experience(list(range(2 + 18)), 2, [0.0] * 18, reward=1.0, group_id="g")  # 18 tokens: -0.5
    short = Experience(list(range(2 + 10)), 2, [0.0] * 10, reward=0.0, group_id="g")  # 10 tokens: 0
    apply_overlong([long, short], algo, max_len=20)
    assert (long.reward, short.reward) == (0.5, 0.0)
    m = rollout_metrics([long, short], [[long, short]], {}, 1.0)
    assert m["reward/overlong/mean"] == -0.25  # (-0.5 + 0) / 2
    assert long.reward_parts == {"overlong": -0.5}  # stored with the experience
    assert m["reward/mean"] == 0.25  # after the penalty: (0.5 + 0) / 2
    apply_overlong([long], SimpleNamespace(overlong_buffer_frac=0.0, overlong_penalty_factor=1.0), max_len=20)
    assert long.reward == 0.5  # off: unchanged


def test_overlong_penalty_measures_a_multi_turn_row_by_its_longest_turn():
    from types import SimpleNamespace

    from rft.algorithms.shaping import apply_overlong
    from rft.data.experience import Experience

    # per-turn limit 100, buffer 0.2 * 100 = 20: the penalty starts past 80 tokens
    algo = SimpleNamespace(overlong_buffer_frac=0.2, overlong_penalty_factor=1.0)
    # three assistant turns of 60, 90 and 60 tokens with two tool answers of 50 between (loss mask 0):
    # 310 tokens after the prompt, but the longest turn is 90: -(90 - 80) / 20 = -0.5
    mask = [1] * 60 + [0] * 50 + [1] * 90 + [0] * 50 + [1] * 60
    e = Experience([0] * (10 + len(mask)), 10, [0.0] * len(mask), reward=1.0, loss_mask=mask)
    apply_overlong([e], algo, max_len=100)
    assert e.reward_parts["overlong"] == -0.5 and e.reward == 0.5
    # a response past the limit (a workflow's own) is penalised -factor, no lower: 130 tokens would be -2.5
    long = Experience([0] * (2 + 130), 2, [0.0] * 130, reward=1.0)
    apply_overlong([long], algo, max_len=100)
    assert long.reward_parts["overlong"] == -1.0


def test_dpo_loss_hand_computed():
    # one pair: chosen row 0 (2 tokens), rejected row 1 (1 token); beta 0.5
    # chosen: sum logp -1.0 - ref -2.0 = +1.0; rejected: sum logp -3.0 - ref -1.0 = -2.0
    # margin = 0.5 * (1.0 - (-2.0)) = 1.5; loss = -log sigmoid(1.5) = log(1 + e^-1.5) = 0.201413
    logp = torch.tensor([[-0.25, -0.75], [-3.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0], [-1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, m = loss_fn("dpo", logp, None, None, mask, algo(dpo_beta=0.5), ref=ref)
    pair = math.log1p(math.exp(-1.5))
    # spread over the pair's 3 tokens, twice (seq-mean-token-sum counts 2 rows per pair): 2 pair / 3
    torch.testing.assert_close(loss.detach(), torch.tensor([[2 * pair / 3, 2 * pair / 3], [2 * pair / 3, 0.0]]))
    # (sum, count) over the pairs: one pair, margin 1.5 > 0
    assert m["dpo/accuracy"] == (1.0, 1.0)
    assert m["dpo/reward_margin"] == (pytest.approx(1.5), 1.0)
    # seq-mean-token-sum over the 2 rows = (pair + pair) / 2 = pair; its gradient on the chosen
    # row's tokens: -beta * (1 - sigmoid(1.5)) = -0.5 * 0.182426 = -0.091213 each
    (loss * mask).sum().div(2).backward()
    g = -0.5 * (1 - 1 / (1 + math.exp(-1.5)))
    torch.testing.assert_close(logp.grad, torch.tensor([[g, g], [-g, 0.0]]))


def test_dpo_pair_with_an_empty_row_counts_as_a_whole_pair():
    # two pairs, one token per row, beta 0.5
    # pair A: chosen lp -1.0 - ref -2.0 = +1; rejected lp -2.0 - ref -1.0 = -1 -> margin 0.5 * 2 = 1.0
    # pair B: chosen lp -0.5 - ref -1.5 = +1; rejected row empty (0 - 0) -> margin 0.5 * 1 = 0.5
    # l_A = log(1 + e^-1) = 0.313262, l_B = log(1 + e^-0.5) = 0.474077; their mean 0.393669
    logp = torch.tensor([[-1.0], [-2.0], [-0.5], [0.0]], requires_grad=True)
    ref = torch.tensor([[-2.0], [-1.0], [-1.5], [0.0]])
    mask = torch.tensor([[1.0], [1.0], [1.0], [0.0]])
    loss, m = loss_fn("dpo", logp, None, None, mask, algo(dpo_beta=0.5), ref=ref)
    l_a, l_b = math.log1p(math.exp(-1.0)), math.log1p(math.exp(-0.5))
    # each token of a pair carries 2 * l / (pair's tokens): A's two tokens 2 l_A / 2, B's one 2 l_B / 1
    torch.testing.assert_close(loss.detach(), torch.tensor([[l_a], [l_a], [2 * l_b], [0.0]]))
    # seq-mean-token-sum over the 4 rows: (l_A + l_A + 2 l_B) / 4 = (l_A + l_B) / 2, the mean over
    # pairs (spreading over each row's own tokens gave (l_A + l_A + l_B) / 4 = 0.275150)
    total = agg_loss(loss, mask, "seq-mean-token-sum", num_seqs=4, num_tokens=3, max_len=1)
    assert total.item() == pytest.approx((l_a + l_b) / 2)
    # d total / d lp_c = 1/2 (pairs) * -beta * sigmoid(-margin) for the pair's chosen row, + for its rejected:
    # A: -0.5 * 0.5 * sigmoid(-1.0) = -0.25 * 0.268941 = -0.067235
    # B: -0.5 * 0.5 * sigmoid(-0.5) = -0.25 * 0.377541 = -0.094385 (-0.047193 when B counted half)
    total.backward()
    g_a, g_b = -0.25 / (1 + math.exp(1.0)), -0.25 / (1 + math.exp(0.5))
    torch.testing.assert_close(logp.grad, torch.tensor([[g_a], [-g_a], [g_b], [0.0]]))
    # metrics are (sum, count) over the 2 pairs: margin 1.0 + 0.5 = 1.5 (a mean of 0.75),
    # accuracy 2 of 2 (both margins > 0)
    assert m["dpo/reward_margin"] == (pytest.approx(1.5), 2.0)
    assert m["dpo/accuracy"] == (2.0, 2.0)


def test_dpo_pair_without_tokens_contributes_nothing():
    # both rows empty: no token can carry the pair's loss (log 2: margin 0); it adds 0, not NaN
    logp = torch.tensor([[-1.0], [-2.0]], requires_grad=True)
    mask = torch.zeros(2, 1)
    loss, m = loss_fn("dpo", logp, None, None, mask, algo(dpo_beta=0.5), ref=torch.zeros(2, 1))
    agg_loss(loss, mask, "seq-mean-token-sum", num_seqs=2, num_tokens=0, max_len=1).backward()
    assert torch.equal(loss.detach(), torch.zeros(2, 1))
    assert torch.equal(logp.grad, torch.zeros(2, 1))
    assert (m["dpo/reward_margin"], m["dpo/accuracy"]) == ((0.0, 0.0), (0.0, 0.0))  # no pair counted


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


def test_gae_steps_over_tokens_the_loss_does_not_count():
    from rft.algorithms.advantages import gae_returns

    # a multi-turn row: turn 1 at position 0, an environment token at 1 (mask 0, a value of 9 that
    # must not be read), turn 2 at 2 with the reward 1
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 0.25]])
    # gamma 1, lam 1: A_2 = 1 - 0.25 = 0.75; position 1 is stepped over, so for position 0
    # V_next = 0.25, A_next = 0.75: delta_0 = 0.25 - 0.5 = -0.25, A_0 = -0.25 + 0.75 = 0.5 = R - V_0
    adv, ret = gae_returns(torch.tensor([1.0]), values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.0, 0.75]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 0.0, 1.0]]))
    # gamma 0.5, lam 1: delta_0 = 0.5 * 0.25 - 0.5 = -0.375, A_0 = -0.375 + 0.5 * 0.75 = 0.0
    # (the return discounted over counted tokens only: 0.5 * 1 = 0.5 = V_0)
    adv, _ = gae_returns(torch.tensor([1.0]), values, mask, gamma=0.5, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.0, 0.75]]))
    # V = 0, gamma 0.99, lam 0.95, gap of two tokens: A = (0.9405^2, 0.9405, 0, 0, 1)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    adv, _ = gae_returns(torch.tensor([1.0], dtype=torch.float64), torch.zeros(1, 5, dtype=torch.float64), mask,
                         gamma=0.99, lam=0.95)
    torch.testing.assert_close(adv, torch.tensor([[0.9405**2, 0.9405, 0.0, 0.0, 1.0]], dtype=torch.float64))


def test_explained_variance():
    from rft.trainer.critic import explained_variance

    mask = torch.ones(1, 4)
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    # a constant critic explains nothing: Var(R - c) = Var(R)
    assert explained_variance(returns, torch.full((1, 4), 2.5), mask) == pytest.approx(0.0)
