"""Hand-computed values for the GRPO advantage, the clipped loss, KL estimators and aggregation."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from rft.algorithms import ADVANTAGE_FNS, KL_FNS, POLICY_LOSS_FNS, agg_loss
from rft.config import AlgorithmConfig

grpo = ADVANTAGE_FNS["grpo"]


def algo(**overrides):
    """The algorithm config with its schema defaults (clip 0.2/0.2, no dual clip, tau 1, gamma 1)."""
    return OmegaConf.structured(AlgorithmConfig(**overrides))


CLIP = algo()


def loss_fn(name, logp, old, adv, mask, cfg, ref=None):
    """Call a registered policy loss with its batch dict."""
    return POLICY_LOSS_FNS[name](logp, {"old_logp": old, "advantages": adv, "response_mask": mask, "ref_logp": ref}, cfg)


def adv_of(rewards, groups, T=1):
    batch = {
        "rewards": torch.tensor(rewards, dtype=torch.float32),
        "group_index": torch.tensor(groups),
        "response_mask": torch.ones(len(rewards), T),
    }
    return grpo(batch, None)


def test_grpo_advantage_hand_computed():
    # group 0: rewards [1, 0, 0, 1] -> mean 0.5; unbiased std = sqrt((4 * 0.25) / 3) = 0.57735
    # A = +-0.5 / (0.57735 + 1e-6) = +-0.866024
    # group 1: rewards [2, 4] -> mean 3, std = sqrt((1 + 1) / 1) = 1.41421 -> A = -+0.707106
    adv = adv_of([1, 0, 0, 1, 2, 4], [0, 0, 0, 0, 1, 1])[:, 0]
    s = math.sqrt(1 / 3)
    expected = [0.5 / (s + 1e-6), -0.5 / (s + 1e-6), -0.5 / (s + 1e-6), 0.5 / (s + 1e-6),
                -1 / (math.sqrt(2) + 1e-6), 1 / (math.sqrt(2) + 1e-6)]
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_grpo_group_of_one_and_equal_rewards_give_zero():
    # group 0 has one member (no baseline: A = 0, not A = R); group 1 all equal (std 0: A = 0)
    adv = adv_of([5.0, 1.0, 1.0, 1.0], [0, 1, 1, 1])
    assert torch.equal(adv, torch.zeros(4, 1))


def test_rewards_whose_squares_overflow_still_give_their_advantages():
    """The group std squared each deviation: rewards of 1e200 (float64; 1e20 in float32 before they
    were taken to float64 alone) squared to inf, and every advantage came out 0 with no word.
    Group [1e200, 3e200]: mean 2e200, deviations -+1e200, std sqrt(2e400 / 1) = 1.41421e200 ->
    A = -+0.707107 (eps negligible); reinforce_pp whitens [1e200, 3e200] over the batch the same way."""
    batch = {"rewards": torch.tensor([1e200, 3e200, 1e-200, 3e-200], dtype=torch.float64),
             "group_index": torch.tensor([0, 0, 1, 1]), "response_mask": torch.ones(4, 1)}
    # group 1: deviations -+1e-200, std 1.41421e-200, far below eps: A = -+1e-200 / 1e-6 ~ -+1e-194
    adv = grpo(batch, None)[:, 0]
    torch.testing.assert_close(adv[:2], torch.tensor([-1, 1], dtype=torch.float64) / math.sqrt(2))
    assert adv[2] < 0 < adv[3] and abs(adv[3]) < 1e-190
    rpp = ADVANTAGE_FNS["reinforce_pp"](
        {"rewards": batch["rewards"][:2], "response_mask": torch.ones(2, 1), "group_index": torch.tensor([0, 1])},
        algo(gamma=1.0))[:, 0]
    torch.testing.assert_close(rpp, torch.tensor([-1, 1], dtype=torch.float64) / math.sqrt(2))


def test_grpo_advantage_broadcasts_over_response_tokens_only():
    batch = {
        "rewards": torch.tensor([1.0, 0.0]),
        "group_index": torch.tensor([0, 0]),
        "response_mask": torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]]),
    }
    # mean 0.5, std sqrt(0.5) = 0.70711 -> A = +-0.70711 on the masked-in tokens, 0 elsewhere
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(grpo(batch, None), torch.tensor([[0.0, a, a], [0.0, -a, 0.0]]))


def test_ppo_clip_hand_computed():
    # log-ratios [0, ln 1.5, ln 0.5] -> ratios [1, 1.5, 0.5]
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.0, 1.5, 0.5]]))
    mask = torch.ones(1, 3)
    # A = +1: pg1 = -[1, 1.5, 0.5]; clipped ratio [1, 1.2, 0.8] -> pg2 = -[1, 1.2, 0.8]
    # max -> [-1, -1.2, -0.5]; token 1 is clipped (pg2 > pg1)
    loss, m = loss_fn("ppo_clip", logp, old, torch.ones(1, 3), mask, CLIP)
    torch.testing.assert_close(loss, torch.tensor([[-1.0, -1.2, -0.5]]))
    assert m["actor/clip_frac"] == 1.0  # a sum over tokens: one clipped token
    # A = -1: pg1 = [1, 1.5, 0.5]; pg2 = [1, 1.2, 0.8] -> max [1, 1.5, 0.8]; token 2 clipped
    loss, m = loss_fn("ppo_clip", logp, old, -torch.ones(1, 3), mask, CLIP)
    torch.testing.assert_close(loss, torch.tensor([[1.0, 1.5, 0.8]]))
    assert m["actor/clip_frac"] == 1.0


def test_ppo_clip_gradient_vanishes_when_clipped():
    # ratio 1.5 with A > 0 is clipped at 1.2: the loss is constant there, so no gradient
    logp = torch.log(torch.tensor([[1.5, 1.1]])).requires_grad_()
    loss, _ = loss_fn("ppo_clip", logp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), CLIP)
    loss.sum().backward()
    # d(-A r)/d logp = -A r: token 0 clipped -> 0; token 1 unclipped -> -1.1
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -1.1]]))


def test_ppo_clip_huge_log_ratio_stays_finite():
    logp = torch.tensor([[1000.0, -1000.0]])
    loss, m = loss_fn("ppo_clip", logp, torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2), CLIP)
    # log-ratio clamped to +-20: A=-1 -> max(e^20, 1.2) = e^20; A=+1 -> max(-e^-20, -0.8) = -e^-20
    torch.testing.assert_close(loss, torch.tensor([[math.exp(20), -math.exp(-20)]]))
    assert math.isfinite(m["actor/approx_kl"])


def test_sft_loss_is_negative_logp():
    logp = torch.tensor([[-0.5, -2.0]])
    loss, _ = loss_fn("sft", logp, None, None, torch.ones(1, 2), None)
    torch.testing.assert_close(loss, torch.tensor([[0.5, 2.0]]))


def test_kl_estimators_hand_computed():
    # x = logp - ref = ln 2 -> k1 = 0.693147, k2 = 0.240227, k3 = e^-x + x - 1 = 0.5 + 0.693147 - 1
    logp, ref = torch.tensor([[math.log(2.0)]]), torch.zeros(1, 1)
    assert KL_FNS["k1"](logp, ref).item() == pytest.approx(0.693147, abs=1e-6)
    assert KL_FNS["k2"](logp, ref).item() == pytest.approx(0.5 * math.log(2) ** 2, abs=1e-6)
    assert KL_FNS["k3"](logp, ref).item() == pytest.approx(0.193147, abs=1e-6)
    assert KL_FNS["abs"](-logp, ref).item() == pytest.approx(0.693147, abs=1e-6)
    # k3 clamps: x = -100 -> input clamped to 20 -> e^20 - 20 - 1, then output clamped to 10
    assert KL_FNS["k3"](torch.tensor([[-100.0]]), torch.zeros(1, 1)).item() == 10.0


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [5.0, 6.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # row 2 fully masked


@pytest.mark.parametrize(
    "mode, expected",
    [
        # (1 + 2 + 3 + 4) / 4 tokens
        ("token-mean", 10 / 4),
        # (6 + 4 + 0) / 3 sequences
        ("seq-mean-token-sum", 10 / 3),
        # (6/3 + 4/1 + 0) / 3 sequences
        ("seq-mean-token-mean", 6 / 3),
        # (6 + 4 + 0) / (3 sequences * max_len 5)
        ("seq-mean-token-sum-norm", 10 / 15),
    ],
)
def test_aggregation_modes_hand_computed(mode, expected):
    got = agg_loss(LOSS, MASK, mode, num_seqs=3, num_tokens=4, max_len=5)
    assert got.item() == pytest.approx(expected)


def test_unknown_aggregation_mode_names_the_choices():
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'"):
        agg_loss(LOSS, MASK, "mean", 3, 4, 5)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_of_unequal_tokens_accumulate_to_the_full_batch_gradient(mode):
    """Gradient accumulation over micro-batches with 1 and 6 tokens equals the one-batch gradient."""
    torch.manual_seed(0)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    adv = torch.tensor([[1.0], [-0.5], [2.0]], dtype=torch.float64).expand(3, 5)
    mask = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float64)
    cfg = algo()
    old = (x @ w).detach() - 0.1

    def share(rows):
        logp = x[rows] @ w
        loss, _ = loss_fn("ppo_clip", logp, old[rows], adv[rows], mask[rows], cfg)
        return agg_loss(loss, mask[rows], mode, num_seqs=3, num_tokens=int(mask.sum()), max_len=5)

    (g_full,) = torch.autograd.grad(share(slice(0, 3)), w)
    # micro-batches: row 0 (1 token), rows 1-2 (6 tokens)
    (g_acc,) = torch.autograd.grad(share(slice(0, 1)) + share(slice(1, 3)), w)
    torch.testing.assert_close(g_acc, g_full, rtol=1e-12, atol=1e-12)
    # the classic bug, normalising each micro-batch by its own token count, gives another gradient
    if mode == "token-mean":
        def own(rows):
            logp = x[rows] @ w
            loss, _ = loss_fn("ppo_clip", logp, old[rows], adv[rows], mask[rows], cfg)
            return agg_loss(loss, mask[rows], mode, 3, int(mask[rows].sum()), 5) / 2
        (g_bug,) = torch.autograd.grad(own(slice(0, 1)) + own(slice(1, 3)), w)
        assert not torch.allclose(g_bug, g_full)
