"""An audit of every formula in rft/algorithms against /ALGORITHMS.md's definitions and the papers.

Each registered function is compared with a float64 reference written here from the formula (never
by calling rft), on float32 and float64 inputs and on the edge cases: equal rewards, a group of one,
rewards of 1e6 and 1e-8, all-zero masks, long against short rows, |log-ratio| = 50, a NaN or inf
where the mask is 0, ratios exactly on the clip bounds. Where the gradient is what the paper
defines (clipping), the gradient is checked too. Hand-computed values say their arithmetic.
"""

import math
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from rft.algorithms import ADVANTAGE_FNS, KL_FNS, POLICY_LOSS_FNS, agg_loss, distill, off_policy, rollout_is, shaping
from rft.config import AlgorithmConfig

NAN, INF = float("nan"), float("inf")
F32, F64 = torch.float32, torch.float64
TOL = {F32: dict(rtol=2e-5, atol=2e-6), F64: dict(rtol=1e-11, atol=1e-12)}


def algo(**kw):
    return OmegaConf.structured(AlgorithmConfig(**kw))


def close(got, want, dtype):
    """`got` (rft's, in `dtype`) against the float64 reference `want`."""
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), torch.as_tensor(want, dtype=F64), **TOL[dtype])
    return True  # raised otherwise: `assert close(...)` reads as the check it is


# ---------------------------------------------------------------- advantages (sequence level)

def ref_outcome(name, rewards, groups, tau=1.0, baseline="mean"):
    """Per sequence, in exact arithmetic where it can be (Fraction means): grpo, dr_grpo, rloo, opmd."""
    out = []
    for r, g in zip(rewards, groups):
        members = [Fraction(x) for x, h in zip(rewards, groups) if h == g]
        G, mean = len(members), sum(members) / len(members)
        dev = float(Fraction(r) - mean)
        if name == "grpo":  # (R - mean) / (unbiased std + 1e-6); a group of one: 0
            std = math.sqrt(float(sum((x - mean) ** 2 for x in members) / (G - 1))) if G > 1 else 0.0
            out.append(dev / (std + 1e-6) if G > 1 else 0.0)
        elif name == "dr_grpo" or (name == "opmd" and baseline == "mean"):
            out.append(dev)
        elif name == "rloo":  # R_i - mean of the others
            out.append(float(Fraction(r) - (sum(members) - Fraction(r)) / (G - 1)) if G > 1 else 0.0)
        else:  # opmd logavgexp: tau * (logsumexp(R / tau) - log G), shifted by the max for python floats
            # = (R - max) - tau * log(mean exp((R_j - max) / tau)): no cancellation of two 1e6s
            top = max(float(x) for x in members)
            out.append((r - top) - tau * math.log(sum(math.exp((float(x) - top) / tau) for x in members) / G))
    return out


REWARD_CASES = {
    "random": ([0.3, -1.2, 2.5, 0.7, 0.1, 0.9, 0.4], [0, 0, 0, 1, 1, 1, 1]),
    "all_equal": ([0.1, 0.1, 0.1, 0.9, 0.9, 0.9], [0, 0, 0, 1, 1, 1]),
    "group_of_one": ([5.0, 1.0, 2.0], [0, 1, 1]),
    "large": ([1e6, 1e6 + 1, 1e6 + 3, 1e6], [0, 0, 0, 0]),
    "tiny": ([1e-8, 0.0, 3e-8, 2e-8], [0, 0, 1, 1]),
}


@pytest.mark.parametrize("case", REWARD_CASES)
@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("name, kw", [("grpo", {}), ("dr_grpo", {}), ("rloo", {}), ("opmd", {}),
                                      ("opmd", dict(opmd_baseline="logavgexp", tau=0.05)),
                                      ("opmd", dict(opmd_baseline="logavgexp", tau=50.0))])
def test_outcome_advantages_match_the_formula(name, kw, dtype, case):
    rewards, groups = REWARD_CASES[case]
    r = torch.tensor(rewards, dtype=dtype)
    # a short row, a long row, and a row with no response token at all (it stays 0)
    mask = torch.zeros(len(rewards), 4, dtype=dtype)
    mask[:, :1] = 1
    mask[1::2] = 1
    mask[-1] = 0
    got = ADVANTAGE_FNS[name]({"rewards": r, "group_index": torch.tensor(groups), "response_mask": mask}, algo(**kw))
    want = ref_outcome(name, r.double().tolist(), groups, kw.get("tau", 1.0), kw.get("opmd_baseline", "mean"))
    close(got, torch.tensor(want, dtype=F64)[:, None] * mask.double(), dtype)
    if case in ("all_equal", "group_of_one"):
        # no signal is exactly 0, not rounding noise (a flat group's mean is one rounding off)
        flat = torch.tensor([g == 0 or case == "all_equal" for g in groups])
        assert (got[flat] == 0).all()


def ref_whiten(values):
    """(x - mean) / (unbiased std + 1e-6) over a flat list."""
    n = len(values)
    mean = math.fsum(values) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / max(n - 1, 1))
    return [(v - mean) / (std + 1e-6) for v in values]


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("baseline", [False, True])
def test_reinforce_pp_discounts_then_whitens_over_the_batch(dtype, baseline):
    rewards, groups, gamma = [1.0, 0.0, 3.0, 2.0], [0, 0, 1, 1], 0.9
    # row 1 has a gap (a multi-turn environment turn) and row 3 no response token
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=dtype)
    centred = ref_outcome("dr_grpo", rewards, groups) if baseline else rewards
    # the reward on each row's last response token, gamma^(tokens after t) * R before it
    returns = {}
    for i, row in enumerate(mask.tolist()):
        where = [t for t, m in enumerate(row) if m]
        for k, t in enumerate(where):
            returns[(i, t)] = gamma ** (len(where) - 1 - k) * centred[i]
    white = dict(zip(returns, ref_whiten(list(returns.values()))))
    want = torch.tensor([[white.get((i, t), 0.0) for t in range(4)] for i in range(4)], dtype=F64)
    batch = {"rewards": torch.tensor(rewards, dtype=dtype), "group_index": torch.tensor(groups), "response_mask": mask}
    name = "reinforce_pp_baseline" if baseline else "reinforce_pp"
    assert close(ADVANTAGE_FNS[name](batch, algo(gamma=gamma)), want, dtype)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_gae_matches_the_recursion_then_whitens(dtype):
    gamma, lam = 0.95, 0.8
    rewards = [1.0, -0.5, 2.0]
    values = torch.tensor([[0.2, 0.4, -0.1, 0.3], [0.5, 0.0, 0.1, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=dtype)
    # row 0's third position is an environment token (mask 0): the recursion steps over it
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=dtype)
    values = values * mask
    adv = {}
    for i in range(3):
        counted = [t for t in range(4) if mask[i, t]]
        nxt_v = nxt_a = 0.0
        for k in reversed(range(len(counted))):
            t = counted[k]
            r = rewards[i] if k == len(counted) - 1 else 0.0  # the reward on the last response token
            delta = r + gamma * nxt_v - float(values[i, t])
            nxt_a = delta + gamma * lam * nxt_a
            nxt_v = float(values[i, t])
            adv[(i, t)] = nxt_a
    white = dict(zip(adv, ref_whiten(list(adv.values()))))
    want = torch.tensor([[white.get((i, t), 0.0) for t in range(4)] for i in range(3)], dtype=F64)
    batch = {"rewards": torch.tensor(rewards, dtype=dtype), "values": values, "response_mask": mask}
    assert close(ADVANTAGE_FNS["gae"](batch, algo(gamma=gamma, lam=lam)), want, dtype)



def test_gae_keeps_float64_rewards_whatever_the_masks_dtype():
    # rewards 1e6 + 0.01 and 1e6 differ by less than float32's spacing there (0.0625): in float32
    # both are 1e6 and the whitened advantages 0. gamma = lam = 1, values 0, one token a row: A = R,
    # whitened over the 2 tokens: (+-0.005) / (sqrt(0.01^2 / 2) + 1e-6) = +-0.707036
    batch = {"rewards": torch.tensor([1e6 + 0.01, 1e6], dtype=F64), "values": torch.zeros(2, 1),
             "response_mask": torch.ones(2, 1)}
    a = 0.005 / (math.sqrt(0.01**2 / 2) + 1e-6)
    assert close(ADVANTAGE_FNS["gae"](batch, algo(gamma=1.0, lam=1.0)), [[a], [-a]], F64)


@pytest.mark.slow
def test_the_trainer_computes_advantages_from_the_rewards_as_given():
    # (builds the tiny model's trainer: ~2 s) the rewards reach the advantage function in float64,
    # as the reward function gave them: GRPO's +-0.707 for 1e6 + 0.01 against 1e6, not 0
    from test_trainer import make_trainer

    from rft.data.experience import Experience

    prompt = [1, 5, 102, 7, 8, 9, 2, 102, 1, 6, 102]
    exps = [Experience(prompt + [7, 2], len(prompt), [0.0, 0.0], reward=r, group_id="0/0") for r in (1e6 + 0.01, 1e6)]
    step = make_trainer(2)._prepare(exps)
    a = 0.005 / (math.sqrt(0.01**2 / 2) + 1e-6)
    torch.testing.assert_close(step.adv * step.mask, torch.tensor([[a], [-a]]) * step.mask)
    assert step.adv.dtype == torch.float32  # what the loss multiplies the float32 ratios with

# ---------------------------------------------------------------- policy losses

def call_loss(name, logp, old, adv, mask, ref=None, **kw):
    batch = {"old_logp": old, "advantages": adv, "response_mask": mask, "ref_logp": ref}
    return POLICY_LOSS_FNS[name](logp, batch, algo(**kw))


def ref_ppo(lp, old, a, lo, hi, c=None):
    """One token's PPO loss and d loss / d logp: max(-A r, -A clip(r, 1-lo, 1+hi)), the dual clip
    min(., -A c) for A < 0; the log-ratio clamped to +-20 (no gradient beyond)."""
    x = lp - old
    lr = min(max(x, -20.0), 20.0)
    r = math.exp(lr)
    l1, l2 = -a * r, -a * min(max(r, 1 - lo), 1 + hi)
    loss, grad = (l1, -a * r) if l1 >= l2 else (l2, 0.0)
    if c is not None and a < 0 and -a * c < loss:
        loss, grad = -a * c, 0.0
    return loss, (grad if -20 < x < 20 else 0.0)


# per token (logp - old, A): ordinary values, both bounds of both signs, |log-ratio| = 50
PPO_TOKENS = [(0.1, 1.0), (-0.3, 1.0), (0.4, -1.0), (-0.4, -0.5), (0.05, -2.0), (0.0, 0.0),
              (50.0, 1.0), (50.0, -1.0), (-50.0, 1.0), (-50.0, -1.0), (1.3, -1.0), (2.0, -0.7)]


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("c", [None, 3.0])
def test_ppo_clip_value_and_gradient_match_the_formula(dtype, c):
    lo, hi = 0.2, 0.28  # DAPO's clip-higher
    old = torch.linspace(-3.0, -0.5, len(PPO_TOKENS), dtype=dtype)[None]
    logp = (old + torch.tensor([[x for x, _ in PPO_TOKENS]], dtype=dtype)).requires_grad_()
    adv = torch.tensor([[a for _, a in PPO_TOKENS]], dtype=dtype)
    loss, m = call_loss("ppo_clip", logp, old, adv, torch.ones_like(adv), clip_ratio_low=lo, clip_ratio_high=hi,
                        clip_ratio_c=c)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    ref = [ref_ppo(lp, o, a, lo, hi, c) for lp, o, a in zip(logp[0].tolist(), old[0].tolist(), adv[0].tolist())]
    close(loss, [[v for v, _ in ref]], dtype)
    close(grad, [[g for _, g in ref]], dtype)
    # clip fractions are token counts: the tokens where the clipped branch binds (pg2 > pg1): A > 0
    # above 1 + hi (log-ratio 50: 1 token), A < 0 below 1 - lo (log-ratios -0.4 and -50: 2 tokens)
    assert (m["actor/clip_frac"], m["actor/clip_frac_high"], m["actor/clip_frac_low"]) == (3.0, 1.0, 2.0)



@pytest.mark.parametrize("c", [1.0, 0.5])
def test_a_dual_clip_at_or_below_1_is_refused(c):
    # dual clip (arXiv 1912.09729) needs c > 1: with c = 0.5, every A < 0 token at r = 1 has the
    # loss min(-A, -0.5 A) = -0.5 A, a constant, so the negative samples give no gradient at all
    from test_config import plan_for

    from rft.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        plan_for([f"algorithm.clip_ratio_c={c}"])
    assert str(e.value) == (
        f"algorithm.clip_ratio_c={c} must be > 1 (or null: no dual clip): the dual clip caps the loss of a token "
        f"with a negative advantage at -A x clip_ratio_c, where its ratio is above clip_ratio_c; at or below 1 it "
        f"caps tokens whose ratio has not moved, and they give no gradient. 3 is the usual value.")

@pytest.mark.parametrize("dtype", [F32, F64])
def test_ppo_clip_on_the_bounds_keeps_the_gradient(dtype):
    # r exactly 1 - 0.2 and 1 + 0.2 (in float64; float32 rounds log(r) by < 1 ulp): the clip is not
    # yet active, so the loss is -A r, the gradient -A r, and nothing counts as clipped
    r = torch.tensor([[0.8, 1.2, 0.8, 1.2]], dtype=F64)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=dtype)
    logp = torch.log(r).to(dtype).requires_grad_()
    loss, m = call_loss("ppo_clip", logp, torch.zeros_like(adv), adv, torch.ones_like(adv))
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    close(loss, -adv.double() * r, dtype)
    close(grad, -adv.double() * r, dtype)
    assert m["actor/clip_frac"] == 0.0


def ref_seq(name, lp, old, a, mask, lo, hi):
    """GSPO / GMPO: one loss per sequence (on each of its tokens) and its gradient per token.
    GSPO: s = exp(min(mean_t (lp - old), 10)), loss = max(-A s, -A clip(s, 1-lo, 1+hi)).
    GMPO: per token lr clamped +-20 then to [-lo, hi] on the side of sign(A) only; the ratio is
    exp(mean_t lr_clipped), loss = -A ratio."""
    n = sum(mask)
    if n == 0:
        return 0.0, [0.0] * len(lp)
    xs = [(p - o) for p, o, m in zip(lp, old, mask) if m]
    if name == "gspo":
        mean = sum(xs) / n
        s = math.exp(min(mean, 10.0))
        l1, l2 = -a * s, -a * min(max(s, 1 - lo), 1 + hi)
        live = l1 >= l2 and mean < 10.0
        loss, d = max(l1, l2), (-a * s / n if live else 0.0)
        return loss, [d * m for m in mask]
    sign = (a > 0) - (a < 0)
    kept, free = [], []
    for x in xs:
        x = min(max(x, -20.0), 20.0)
        c = min(max(x, -lo), hi)
        kept.append(sign * min(sign * x, sign * c))
        free.append(sign * x <= sign * c and -20 < x < 20)
    ratio = math.exp(sum(kept) / n)
    free = iter(free)
    return -a * ratio, [(-a * ratio / n if next(free) else 0.0) if m else 0.0 for m in mask]


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("name, lo, hi", [("gspo", 3e-4, 4e-4), ("gspo", 0.2, 0.2), ("gmpo", 0.4, 0.4)])
def test_sequence_ratio_losses_match_the_formula(name, lo, hi, dtype):
    # rows: near 1; far above (clipped for A > 0); far below; a short row; |log-ratio| 50; empty
    diffs = [[1e-4, -2e-4, 3e-4, 0.0], [0.6, 0.9, 0.1, 0.5], [-0.8, -0.2, -0.7, 0.0], [0.3, 0.0, 0.0, 0.0],
             [50.0, -50.0, 50.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]],
                        dtype=dtype)
    for sign in (1.0, -1.0):
        adv = sign * torch.tensor([[1.0], [2.0], [0.5], [1.5], [1.0], [1.0]], dtype=dtype).expand(6, 4) * mask
        old = torch.full((6, 4), -1.5, dtype=dtype)
        logp = (old + torch.tensor(diffs, dtype=dtype)).requires_grad_()
        loss, m = call_loss(name, logp, old, adv, mask, clip_ratio_low=lo, clip_ratio_high=hi)
        # seq-mean-token-mean gives the mean over the 6 sequences of their losses
        total = agg_loss(loss, mask, "seq-mean-token-mean", 6, int(mask.sum()), 4)
        (grad,) = torch.autograd.grad(total, logp)
        ref = [ref_seq(name, logp[i].tolist(), old[i].tolist(), float(adv[i, 0]), mask[i].tolist(), lo, hi)
               for i in range(6)]
        assert close(total, sum(v for v, _ in ref) / 6, dtype)
        assert close(grad, [[g / 6 for g in gs] for _, gs in ref], dtype)
        assert close(loss * mask, [[v * float(x) for x in mask[i]] for i, (v, _) in enumerate(ref)], dtype)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_cpgd_opmd_sft_match_the_formula(dtype):
    lo, hi, tau = 0.2, 0.28, 0.5
    x = torch.tensor([[0.1, 0.5, -0.5, -0.1, 0.3, 50.0, -50.0]], dtype=dtype)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 0.0, 2.0, -2.0]], dtype=dtype)
    old = torch.full_like(x, -2.0)
    logp = (old + x).requires_grad_()
    ones = torch.ones_like(x)
    loss, m = call_loss("cpgd", logp, old, adv, ones, clip_ratio_low=lo, clip_ratio_high=hi)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    want, dwant = [], []
    for lp, o, a in zip(logp[0].tolist(), old[0].tolist(), adv[0].tolist()):
        # clamp logp <= old + log(1 + hi) for A > 0, >= old + log(1 - lo) for A < 0; loss -A logp_c
        c = min(lp, o + math.log(1 + hi)) if a > 0 else max(lp, o + math.log(1 - lo)) if a < 0 else lp
        want.append(-a * c)
        dwant.append(-a if c == lp else 0.0)
    close(loss, [want], dtype)
    close(grad, [dwant], dtype)
    assert m["actor/clip_frac"] == 4.0  # 0.5 (A>0), -0.5 (A<0), 50 (A>0), -50 (A<0); A = 0 has no bound
    loss, _ = call_loss("opmd", logp, old, adv, ones, tau=tau)
    close(loss, -adv.double() * logp.detach().double() / (1 + tau), dtype)
    loss, _ = call_loss("sft", logp, None, None, ones)
    close(loss, -logp.detach().double(), dtype)


MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "gmpo", "cpgd", "opmd", "sft"])
def test_a_nan_or_inf_where_the_mask_is_0_changes_no_loss_gradient_or_metric(name):
    """Positions the mask leaves out may hold anything (padding, an environment's tokens): the
    loss, its gradient and the metrics are those of the same batch with finite values there."""
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0]])
    adv = torch.tensor([[1.0], [-0.5]]) * mask

    def run(fill, mode):
        logp = torch.tensor([[-1.0, -2.0, fill, fill], [-0.5, fill, -1.2, fill]], requires_grad=True)
        old = torch.tensor([[-1.1, -1.9, fill, -1.0], [-0.4, -1.0, -1.0, fill]])
        loss, metrics = call_loss(name, logp, old, adv, mask, clip_ratio_c=3.0)
        total = agg_loss(loss, mask, mode, 2, 4, 4)
        (grad,) = torch.autograd.grad(total, logp)
        return total, grad, metrics

    for mode in MODES:
        want_total, want_grad, want_metrics = run(-1.0, mode)
        for bad in (NAN, INF, -INF):
            total, grad, metrics = run(bad, mode)
            torch.testing.assert_close(total, want_total, msg=f"{mode}, {bad}: loss")
            torch.testing.assert_close(grad, want_grad, msg=f"{mode}, {bad}: gradient")
            assert metrics == pytest.approx(want_metrics), (mode, bad)


@pytest.mark.parametrize("name", ["dpo", "bradley_terry"])
def test_pairwise_losses_ignore_what_the_mask_leaves_out(name):
    # rows: chosen, rejected; their third position is masked and holds NaN / -inf
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])

    def run(fill, fill_ref):
        logp = torch.tensor([[-1.0, -0.5, fill], [-2.0, -1.0, fill]], requires_grad=True)
        ref = torch.tensor([[-1.2, -0.7, fill_ref], [-1.8, -1.1, fill_ref]])
        loss, metrics = call_loss(name, logp, None, None, mask, ref=ref, dpo_beta=0.1)
        total = agg_loss(loss, mask, "seq-mean-token-sum", 2, 4, 3)
        (grad,) = torch.autograd.grad(total, logp)
        return total, grad, metrics

    total, grad, metrics = run(NAN, -INF)
    want_total, want_grad, want_metrics = run(0.0, 0.0)
    torch.testing.assert_close(total, want_total)
    torch.testing.assert_close(grad, want_grad)
    assert metrics == want_metrics


def test_gspo_approx_kl_is_the_per_token_kl_like_every_other_loss():
    # two tokens with log-ratios +0.5 and -0.5: the sequence's mean log-ratio is 0 (s = 1, nothing
    # clipped), but the policy moved. approx KL(old || new) is k3 = r - 1 - log r per token, summed:
    # (e^0.5 - 1.5) + (e^-0.5 - 0.5) = 0.148721 + 0.106531 = 0.255252, what ppo_clip logs for them
    logp, old = torch.tensor([[0.5, -0.5]], dtype=F64), torch.zeros(1, 2, dtype=F64)
    ones = torch.ones(1, 2, dtype=F64)
    k3 = (math.exp(0.5) - 1.5) + (math.exp(-0.5) - 0.5)
    for name in ("gspo", "ppo_clip", "gmpo", "cpgd"):
        _, m = call_loss(name, logp, old, ones, ones)
        assert m["actor/approx_kl"] == pytest.approx(k3, rel=1e-12), name


@pytest.mark.parametrize("dtype", [F32, F64])
def test_dpo_and_bradley_terry_match_the_formula(dtype):
    beta = 0.1
    # pairs (chosen, rejected): a long and a short row; a pair whose rejected row has no token
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=dtype)
    logp = torch.tensor([[-0.5, -1.0, -0.2, -0.1], [-2.0, 0, 0, 0], [-0.3, -0.4, 0, 0], [0, 0, 0, 0]],
                        dtype=dtype, requires_grad=True)
    ref = torch.tensor([[-0.6, -0.9, -0.4, -0.2], [-1.5, 0, 0, 0], [-0.5, -0.4, 0, 0], [0, 0, 0, 0]], dtype=dtype)
    seq = lambda t: [sum(float(v) * float(m) for v, m in zip(row, mrow)) for row, mrow in zip(t, mask)]  # noqa: E731
    lp, lr = seq(logp.detach()), seq(ref)
    for name in ("dpo", "bradley_terry"):
        loss, metrics = call_loss(name, logp, None, None, mask, ref=ref, dpo_beta=beta)
        total = agg_loss(loss, mask, "seq-mean-token-sum", 4, int(mask.sum()), 4)
        (grad,) = torch.autograd.grad(total, logp)
        # z_k = beta ((lp_c - ref_c) - (lp_r - ref_r)) (DPO) or r_c - r_r, the scores (reward model);
        # loss = mean_k -log sigmoid(z_k); d/d lp_c,t = -sigmoid(-z_k) dz/d lp_c,t / 2 pairs
        scale = beta if name == "dpo" else 1.0
        zs = [scale * ((lp[2 * k] - (lr[2 * k] if name == "dpo" else 0)) - (lp[2 * k + 1] - (lr[2 * k + 1] if name == "dpo" else 0)))
              for k in range(2)]
        close(total, sum(math.log1p(math.exp(-z)) for z in zs) / 2, dtype)
        d = [[-1 / (1 + math.exp(z)) * scale / 2 * (1 if i % 2 == 0 else -1) for _ in range(4)]
             for i, z in enumerate(zs[i // 2] for i in range(4))]
        close(grad, torch.tensor(d, dtype=F64) * mask.double(), dtype)
        key = "dpo/accuracy" if name == "dpo" else "rm/accuracy"
        assert metrics[key] == (sum(z > 0 for z in zs), 2)


# ---------------------------------------------------------------- KL, aggregation

@pytest.mark.parametrize("dtype", [F32, F64])
def test_kl_estimators_match_schulman(dtype):
    x = [-50.0, -3.0, -0.5, 0.0, 1e-4, 0.7, 3.0, 50.0]  # x = logp - ref
    ref = torch.full((1, len(x)), -2.0, dtype=dtype)
    logp = (ref + torch.tensor([x], dtype=dtype)).requires_grad_()
    xs = (logp.detach() - ref).double()[0].tolist()  # the rounded x rft sees

    def k3(v):  # exp(-x) - (-x) - 1, -x clamped to +-20, the value to +-10; no gradient where either binds
        nx = min(max(-v, -20.0), 20.0)
        val = math.exp(nx) - nx - 1
        return min(val, 10.0), (1 - math.exp(nx) if abs(v) < 20 and val < 10 else 0.0)

    refs = {"k1": [(v, 1.0) for v in xs], "kl": [(v, 1.0) for v in xs], "abs": [(abs(v), (v > 0) - (v < 0)) for v in xs],
            "k2": [(v * v / 2, v) for v in xs], "mse": [(v * v / 2, v) for v in xs],
            "k3": [k3(v) for v in xs], "low_var_kl": [k3(v) for v in xs]}
    for name, want in refs.items():
        got = KL_FNS[name](logp, ref)
        (grad,) = torch.autograd.grad(got.sum(), logp)
        assert close(got, [[v for v, _ in want]], dtype)
        assert close(grad, [[g for _, g in want]], dtype)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_aggregation_modes_on_long_short_and_empty_rows(dtype):
    torch.manual_seed(1)
    T, max_len = 64, 100
    loss = torch.randn(4, T, dtype=dtype)
    mask = torch.zeros(4, T, dtype=dtype)
    mask[0] = 1  # 64 tokens
    mask[1, :1] = 1  # 1 token
    mask[2, [0, 5, 9]] = 1  # 3 tokens with gaps; row 3 has none
    rows = [[float(l) for l, m in zip(loss[i], mask[i]) if m] for i in range(4)]
    n_tok, n_seq = sum(map(len, rows)), 4
    want = {
        "token-mean": math.fsum(sum(rows, [])) / n_tok,
        "seq-mean-token-sum": math.fsum(math.fsum(r) for r in rows) / n_seq,
        # the empty row adds 0 and counts as a sequence (its rows count in the normaliser, as
        # rft/algorithms/aggregation.py says)
        "seq-mean-token-mean": math.fsum(math.fsum(r) / len(r) for r in rows if r) / n_seq,
        "seq-mean-token-sum-norm": math.fsum(sum(rows, [])) / (n_seq * max_len),  # Dr. GRPO's constant
    }
    for mode, value in want.items():
        close(agg_loss(loss, mask, mode, n_seq, n_tok, max_len), value, dtype)
    # no token at all: 0 in every mode, not 0/0
    for mode in want:
        assert agg_loss(loss, torch.zeros_like(mask), mode, n_seq, 0, max_len).item() == 0.0


# ---------------------------------------------------------------- shaping, distillation, IS weights

def test_overlong_penalty_is_dapos():
    # Lmax 20, Lbuf 4, factor 1: 0 up to 16 tokens, then -(L - 16) / 4: 17 -> -0.25, 20 -> -1
    got = [shaping.overlong_penalty(n, 20, 4, 1.0) for n in (0, 10, 16, 17, 18, 19, 20)]
    assert got == [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0]
    assert shaping.overlong_penalty(19, 20, 4, 0.5) == -0.375  # -(3 / 4) * 0.5


def test_kl_penalty_and_distillation_signal_ignore_masked_positions():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    old = torch.tensor([[-1.0, -2.0, NAN], [-0.5, -INF, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, -1.0], [-0.5, -1.0, NAN]])
    # k1 summed over each row's response tokens: (0.5 - 1.0) = -0.5 and 0
    torch.testing.assert_close(shaping.kl_penalty(KL_FNS["k1"], old, ref, mask), torch.tensor([-0.5, 0.0]))
    # the distillation advantage, teacher - student on the mask, 0 elsewhere: [0.5, -1, 0], [0, 0, 0]
    adv = distill.distill_advantage(ref, old, mask)
    torch.testing.assert_close(adv, torch.tensor([[-0.5, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    # reverse KL per token: (0.5 - 1.0 + 0) / 3 tokens
    assert distill.reverse_kl(ref, old, mask) == pytest.approx(-0.5 / 3)


def test_the_trainers_kl_term_ignores_masked_positions():
    from rft.trainer.step import StepMixin

    trainer = SimpleNamespace(kl_fn=KL_FNS["k3"], cfg=SimpleNamespace(algorithm=SimpleNamespace(kl_loss_coef=0.5)))
    step = SimpleNamespace(ref_logp=torch.tensor([[-1.0, NAN]]), sums={"actor/kl": 0.0})
    m = torch.tensor([[1.0, 0.0]])

    def run(fill):
        logp = torch.tensor([[-0.5, fill]], requires_grad=True)
        loss = StepMixin._kl_term(trainer, torch.zeros(1, 2), logp, None, m, lambda t: t, step)
        (grad,) = torch.autograd.grad(agg_loss(loss, m, "token-mean", 1, 1, 2), logp)
        return loss, grad

    # k3 at x = 0.5: e^-0.5 + 0.5 - 1 = 0.106531, times 0.5; d/d logp = 0.5 (1 - e^-0.5) = 0.196735
    for fill in (NAN, -INF):
        loss, grad = run(fill)
        assert loss[0, 0].item() == pytest.approx(0.5 * (math.exp(-0.5) - 0.5), rel=1e-6)
        torch.testing.assert_close(grad, torch.tensor([[0.5 * (1 - math.exp(-0.5)), 0.0]]))
    assert step.sums["actor/kl"] == pytest.approx(2 * (math.exp(-0.5) - 0.5), rel=1e-6)


def ref_jsd(p, q, beta):
    """Per position, from probabilities: beta KL(P||M) + (1-beta) KL(Q||M), M = beta P + (1-beta) Q;
    beta 0: KL(P||Q), beta 1: KL(Q||P). 0 log 0 = 0."""
    kl = lambda a, b: math.fsum(x * math.log(x / y) if y > 0 else INF for x, y in zip(a, b) if x > 0)  # noqa: E731
    if beta == 0:
        return kl(p, q)
    if beta == 1:
        return kl(q, p)
    m = [beta * x + (1 - beta) * y for x, y in zip(p, q)]
    return beta * kl(p, m) + (1 - beta) * kl(q, m)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_generalized_jsd_matches_gkd(beta, dtype):
    # the teacher's 3 top tokens and the rest; the student's probabilities of the same buckets
    p = [[0.5, 0.3, 0.1, 0.1], [0.9, 0.05, 0.05, 0.0]]
    q = [[0.2, 0.2, 0.4, 0.2], [0.6, 0.0, 0.3, 0.1]]
    logp = lambda rows: torch.tensor(rows, dtype=F64).log().to(dtype)  # noqa: E731  (0 -> -inf)
    top_p, top_q = logp([r[:3] for r in p]), logp([r[:3] for r in q])
    rest = (logp([r[3:] for r in p]), logp([r[3:] for r in q]))
    got = distill.generalized_jsd(top_p, top_q, beta, rest=rest)
    p_r = [[math.exp(v) for v in row] for row in torch.cat([top_p, rest[0]], -1).double().tolist()]
    q_r = [[math.exp(v) for v in row] for row in torch.cat([top_q, rest[1]], -1).double().tolist()]
    want = [ref_jsd(a, b, beta) for a, b in zip(p_r, q_r)]
    if beta == 0.0:  # KL(P || Q) with q = 0 where p > 0 (the second row's second token) is +inf
        assert got[1].item() == INF
        close(got[:1], want[:1], dtype)
    else:
        close(got, want, dtype)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_rollout_is_weights_match_tis_and_mis(dtype):
    cap = 2.0
    # log r = old - sampling; r exactly C is kept by mis (r <= C), in float64 (float32 rounds log 2 up)
    d = [0.0, 0.5, math.log(2.0) if dtype == F64 else 0.69, 1.0, -3.0, 25.0, 100.0]
    samp = torch.full((1, len(d) + 1), -1.0, dtype=dtype)
    old = samp + torch.tensor([d + [NAN]], dtype=dtype)
    mask = torch.tensor([[1.0] * len(d) + [0.0]], dtype=dtype)  # the last, masked, holds a NaN
    lr = (old - samp)[0, :-1].double().tolist()
    r = [math.exp(min(x, 20.0)) for x in lr]  # every weight bounded by e^20 (LOG_RATIO_CLAMP)
    over = [x > math.log(cap) for x in lr]
    for mode, want in (("tis", [min(x, cap) for x in r]), ("mis", [0.0 if o else x for x, o in zip(r, over)])):
        w, stats = rollout_is.weights(old, samp, mask, mode, cap)
        close(w, [want + [1.0]], dtype)
        assert stats["rollout_is/tokens"] == len(d) and stats["rollout_is/capped"] == sum(over)
        assert stats["rollout_is/weight_sum"] == pytest.approx(math.fsum(r), rel=1e-6)
        assert stats["rollout_is/max"] == pytest.approx(math.exp(20.0), rel=1e-6)


def test_decoupled_behaviour_weights_are_prox_over_behav_capped():
    # one stale row (version 0, trainer at 2): w = min(exp(old - behav), cap = 5); a fresh row: 1
    stale = SimpleNamespace(policy_version=0, logprobs=[-1.0, -2.0, -0.5], prompt_length=2, token_versions=None)
    fresh = SimpleNamespace(policy_version=2, logprobs=[-1.0, -1.0, -1.0], prompt_length=2, token_versions=None)
    old = torch.tensor([[0.0, -0.5, -1.0, 3.0], [0.0, -0.2, -0.3, -0.4]], dtype=F64)
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0]], dtype=F64)
    cfg = SimpleNamespace(off_policy_correction="decoupled", behavior_weight_cap=5.0)
    w = off_policy.correct([stale, fresh], old, mask, 2, cfg)
    # exp(-0.5 + 1) = 1.648721, exp(-1 + 2) = 2.718282, exp(3 + 0.5) = 33.1 -> 5
    torch.testing.assert_close(w, torch.tensor([[1.0, math.exp(0.5), math.e, 5.0], [1.0] * 4], dtype=F64))
    # behavior: the stale row's old log-probs become its sampling ones; the fresh row keeps its own
    assert off_policy.correct([stale, fresh], old, mask, 2, SimpleNamespace(off_policy_correction="behavior", behavior_weight_cap=5.0)) is None
    torch.testing.assert_close(old, torch.tensor([[0.0, -1.0, -2.0, -0.5], [0.0, -0.2, -0.3, -0.4]], dtype=F64))


# ---------------------------------------------------------------- entropy (trainer)

def test_entropy_is_that_of_the_sampled_distribution_with_its_gradient():
    from rft.trainer.logprobs import _from_logits

    torch.manual_seed(0)
    logits = torch.randn(3, 6, dtype=F32)
    logits[2, 4] = -INF  # a token the model rules out
    targets = torch.tensor([int(logits[0].argmax()), 1, 2])  # (a sampled token is in the top-k set)
    temp = torch.tensor([0.7, 1.0, 1.3])
    top_k = torch.tensor([3, 0, 0])  # row 0 sampled from its 3 most likely tokens
    x = logits.clone().requires_grad_()
    logp, ent = _from_logits(x, targets, temp, None, top_k, True)[:2]
    (g,) = torch.autograd.grad(ent.sum(), x)
    # reference: softmax of logits / T over the kept tokens, H = -sum p log p, in float64
    z = logits.double() / temp.double()[:, None]
    keep = torch.ones_like(z, dtype=torch.bool)
    keep[0] = z[0] >= z[0].topk(3).values[-1]
    zr = z.masked_fill(~keep, -INF).requires_grad_()
    lp = torch.log_softmax(zr, -1)
    p = lp.exp()
    h = -(p * torch.where(p > 0, lp, torch.zeros_like(lp))).sum(-1)
    (gr,) = torch.autograd.grad(h.sum(), zr)
    gr = torch.where(keep & torch.isfinite(z), gr / temp.double()[:, None], torch.zeros_like(gr))
    torch.testing.assert_close(ent.double(), h.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logp.double(), lp.detach().gather(-1, targets[:, None])[:, 0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g.double(), gr, rtol=1e-5, atol=1e-6)
