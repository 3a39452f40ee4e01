"""A fourth audit of rft/algorithms: float64 references written from ALGORITHMS.md and the papers as
plain loops (one sequence, one token at a time), compared with rft's functions on float32 and
float64 inputs, the value and the autograd gradient. The cases the other audits leave out: inf or
NaN *advantages* where the mask is 0 (the advantage contract allows them there), a policy loss
under each of the four aggregation modes at once with log-ratios of +-30, a token exactly on
CPGD's bound, GMPO's clip side for a row whose token advantages differ in sign, a study's advantage
function leaving values off the mask, batches with no response token, one token, or one row for
every advantage function.
Where rft departs from the formula on purpose (GSPO's cap at 10, the +-20 clamp of a token's
log-ratio, the overlong penalty's floor) the reference applies the same departure, named there.
"""

import math

import pytest
import torch
from omegaconf import OmegaConf

from rft.algorithms import ADVANTAGE_FNS, POLICY_LOSS_FNS, agg_loss, shaping
from rft.config import AlgorithmConfig

NAN, INF = float("nan"), float("inf")
F32, F64 = torch.float32, torch.float64
MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def algo(**kw):
    return OmegaConf.structured(AlgorithmConfig(**kw))


def near(got, want, dtype):
    """rft's value (in `dtype`) against the float64 reference, relative to max(1, |want|)."""
    tol = 2e-5 if dtype == F32 else 1e-10
    got, want = got.double(), torch.as_tensor(want, dtype=F64)
    assert torch.isfinite(got).all(), got
    err = ((got - want).abs() / want.abs().clamp(min=1)).max().item()
    assert err <= tol, (err, got, want)
    return True


# ---------------------------------------------------------------- references (loops, float64)

def groups(gids):
    out = {}
    for i, g in enumerate(gids):
        out.setdefault(g, []).append(i)
    return out.values()


def ref_outcome(name, R, gids):
    """grpo (unbiased std, eps 1e-6), dr_grpo, rloo, opmd (mean baseline); a group of one: 0."""
    A = [0.0] * len(R)
    for idx in groups(gids):
        vals = [R[i] for i in idx]
        mu = sum(vals) / len(vals)
        for i in idx:
            if name == "opmd":
                A[i] = R[i] - mu
            elif len(idx) == 1:
                A[i] = 0.0
            elif name == "grpo":
                sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / (len(vals) - 1))
                A[i] = (R[i] - mu) / (sd + 1e-6)
            elif name == "dr_grpo":
                A[i] = R[i] - mu
            else:  # rloo: R_i minus the mean of the others
                A[i] = R[i] - (sum(vals) - R[i]) / (len(vals) - 1)
    return A


def whiten(x, m):
    """(x - mean) / (unbiased std + 1e-6) over the batch's response tokens; 0 elsewhere."""
    vals = [v for row, mr in zip(x, m) for v, k in zip(row, mr) if k]
    mu = sum(vals) / len(vals)
    sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / (len(vals) - 1))
    return [[(v - mu) / (sd + 1e-6) if k else 0.0 for v, k in zip(row, mr)] for row, mr in zip(x, m)]


def ref_returns(R, m, gamma):
    """REINFORCE++: the reward on the last response token, discounted back over response tokens."""
    out = []
    for r, mr in zip(R, m):
        ret, run = [0.0] * len(mr), 0.0
        for k, t in enumerate(reversed([t for t, v in enumerate(mr) if v])):
            run = (r if k == 0 else 0.0) + gamma * run
            ret[t] = run
        out.append(ret)
    return out


def ref_gae(R, V, m, gamma, lam):
    """delta_t = r_t + gamma V_next - V_t, A_t = delta_t + gamma lam A_next over response tokens."""
    out = []
    for r, vr, mr in zip(R, V, m):
        A, last, nextv = [0.0] * len(mr), 0.0, 0.0
        for k, t in enumerate(reversed([t for t, v in enumerate(mr) if v])):
            last = (r if k == 0 else 0.0) + gamma * nextv - vr[t] + gamma * lam * last
            A[t], nextv = last, vr[t]
        out.append(A)
    return out


def ref_ppo_clip(x, a, lo, hi, c=None):
    """One token's PPO loss from x = logp - old (a float64 scalar with grad): max(-A r, -A clip(r,
    1 - lo, 1 + hi)), r = exp(x clamped to +-20); the dual clip caps it at -A c for A < 0."""
    r = torch.exp(x.clamp(-20, 20))
    loss = torch.maximum(-a * r, -a * r.clamp(1 - lo, 1 + hi))
    return loss.clamp(max=-a * c) if c is not None and a < 0 else loss


def ref_seq_loss(name, xs, a, lo, hi):
    """One row's token losses from its log-ratios xs (a list of float64 scalars with grad)."""
    n = len(xs)
    if name == "gspo":
        # s = exp(mean x), token form sg[s] * exp(x - sg[x]); departure (as verl): mean capped at 10
        mean = sum(xs) / n
        s = torch.exp(mean.clamp(max=10.0)).detach()
        toks = [s * torch.exp(x - x.detach()) if mean < 10 else s + 0 * x for x in xs]
        return [torch.maximum(-a * t, -a * t.clamp(1 - lo, 1 + hi)) for t in toks]
    # gmpo: x clamped to +-20 (departure, documented), then to [-lo, hi] on sign(a)'s side only
    sg = (a > 0) - (a < 0)
    kept = [sg * torch.minimum(sg * x.clamp(-20, 20), sg * x.clamp(-20, 20).clamp(-lo, hi)) for x in xs]
    return [-a * torch.exp(sum(kept) / n)] * n


def ref_agg(rows, mode, n_rows, max_len):
    """rows: per row, the list of its response tokens' losses (empty rows included)."""
    flat = [v for r in rows for v in r]
    zero = torch.zeros((), dtype=F64)
    if mode == "token-mean":
        return sum(flat, zero) / len(flat)
    if mode == "seq-mean-token-sum":
        return sum((sum(r, zero) for r in rows), zero) / n_rows
    if mode == "seq-mean-token-mean":  # an empty row adds 0 and counts (aggregation.py's docstring)
        return sum((sum(r, zero) / len(r) for r in rows if r), zero) / n_rows
    return sum(flat, zero) / (n_rows * max_len)  # Dr. GRPO's constant normaliser


# ---------------------------------------------------------------- advantages

# group 0 all equal, group 1 with an empty row and a one-token row, group 2 of one, group 3 a pair
REWARDS = [1.0, 1.0, 1.0, 0.0, 1.0, 0.25, 0.5, 3.0, 2.0]
GIDS = [0, 0, 0, 1, 1, 1, 2, 3, 3]
MASK = [[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0],
        [1, 0, 1, 0, 1, 1], [1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]]


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "opmd", "reinforce_pp", "reinforce_pp_baseline", "gae"])
def test_every_advantage_function_matches_its_loop_reference(name, dtype):
    torch.manual_seed(4)
    mask = torch.tensor(MASK, dtype=dtype)
    values = torch.randn(mask.shape, dtype=dtype)
    values[mask == 0] = NAN  # the critic's values outside the mask: anything, never read
    batch = dict(rewards=torch.tensor(REWARDS, dtype=dtype), group_index=torch.tensor(GIDS), response_mask=mask,
                 values=values)
    for gamma, lam in [(1.0, 1.0), (0.9, 0.95)]:
        got = ADVANTAGE_FNS[name](batch, algo(gamma=gamma, lam=lam))
        if name in ("reinforce_pp", "reinforce_pp_baseline"):
            R = REWARDS if name == "reinforce_pp" else ref_outcome("dr_grpo", REWARDS, GIDS)
            want = whiten(ref_returns(R, MASK, gamma), MASK)
        elif name == "gae":
            want = whiten(ref_gae(REWARDS, values.double().tolist(), MASK, gamma, lam), MASK)
        else:
            want = [[a * k for k in mr] for a, mr in zip(ref_outcome(name, REWARDS, GIDS), MASK)]
        assert got.dtype == dtype
        assert near(got, want, dtype)
    # the equal group and the group of one: exactly 0, not rounding noise
    if name in ("grpo", "dr_grpo", "rloo", "opmd"):
        assert (got[[0, 1, 2, 6]] == 0).all()


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "opmd", "reinforce_pp", "reinforce_pp_baseline", "gae",
                                  "none"])
def test_a_batch_with_no_token_one_token_or_one_row_gives_advantages_of_0(name):
    # nothing to compare a reward with: no response token at all (whitening's 0 / 0), one token in
    # the batch (its own mean), one row (its own group)
    cases = [([1.0, 2.0], [0, 0], torch.zeros(2, 3)),
             ([1.0, 2.0], [0, 1], torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])),
             ([3.0], [0], torch.ones(1, 3))]
    for rewards, gids, mask in cases:
        for dtype in (F32, F64):
            batch = dict(rewards=torch.tensor(rewards, dtype=dtype), group_index=torch.tensor(gids),
                         response_mask=mask.to(dtype), values=torch.full(mask.shape, 0.5, dtype=dtype))
            got = ADVANTAGE_FNS[name](batch, algo())
            assert torch.equal(got, torch.zeros_like(got)), (rewards, mask, got)


# ---------------------------------------------------------------- policy losses x aggregation

# per row: log-ratios (logp - old) and the advantage; rows of +-30, an empty row, a one-token row
LOG_RATIOS = [[0.1, -0.3, 0.25, -0.2, 0.0], [0.0] * 5, [30.0, 0, 0, 0, 0], [0.0, -30.0, 0.0, 0.19, 0.28],
              [0.05, 0.02, -0.01, 0.3, -0.25], [-30.0, 30.0, 1.0, -1.0, 0.17]]
ROW_ADV = [1.0, -1.0, -2.0, 0.5, -0.7, 1.3]
LOSS_MASK = [[1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0], [0, 1, 0, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
LOSSES = [("ppo_clip", dict(clip_ratio_low=0.2, clip_ratio_high=0.28)),  # DAPO's clip-higher
          ("ppo_clip", dict(clip_ratio_c=3.0)),  # dual clip
          ("gspo", dict(clip_ratio_low=3e-4, clip_ratio_high=4e-4)), ("gspo", dict(clip_ratio_low=0.2, clip_ratio_high=0.3)),
          ("gmpo", dict(clip_ratio_low=0.4, clip_ratio_high=0.4)), ("cpgd", dict(clip_ratio_high=0.28)),
          ("opmd", dict(tau=0.5)), ("sft", {})]


def ref_rows(name, kw, x):
    """Each row's response-token losses (float64, with grad through x [N, T])."""
    cfg = AlgorithmConfig(**kw)
    lo, hi = cfg.clip_ratio_low, cfg.clip_ratio_high
    rows = []
    for i, mr in enumerate(LOSS_MASK):
        xs, a = [x[i, t] for t in range(len(mr)) if mr[t]], ROW_ADV[i]
        if not xs:
            rows.append([])
        elif name in ("gspo", "gmpo"):
            rows.append(ref_seq_loss(name, xs, a, lo, hi))
        elif name == "ppo_clip":
            rows.append([ref_ppo_clip(v, a, lo, hi, cfg.clip_ratio_c) for v in xs])
        elif name == "cpgd":  # the log-ratio clamped on A's side (log(1 + hi) above, log(1 - lo) below)
            rows.append([-a * (v.clamp(max=math.log1p(hi)) if a > 0 else v.clamp(min=math.log1p(-lo))) for v in xs])
        elif name == "opmd":
            rows.append([-a * v / (1 + cfg.tau) for v in xs])
        else:
            rows.append([-v for v in xs])
    return rows


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("name, kw", LOSSES)
def test_each_loss_under_each_mode_with_inf_and_nan_outside_the_mask(name, kw, dtype):
    """Value and gradient of agg_loss(loss) against the loop reference, in all four modes, with
    -inf log-probs, NaN old log-probs and inf/NaN advantages where the mask is 0. cpgd and sft are
    compared as functions of x = logp - old with old = 0 (cpgd's loss is -A logp_c; opmd and sft
    read logp itself), so old is 0 on the mask for every loss here."""
    mask = torch.tensor(LOSS_MASK, dtype=dtype)
    x = torch.tensor(LOG_RATIOS, dtype=F64).to(dtype)
    old = torch.zeros_like(x).masked_fill(mask == 0, NAN)
    adv = torch.tensor(ROW_ADV, dtype=dtype)[:, None].expand_as(x).clone()
    adv[mask == 0] = torch.tensor([INF, NAN]).to(dtype).repeat(30)[: int((mask == 0).sum())]
    logp = x.masked_fill(mask == 0, -INF).requires_grad_()
    loss, _ = POLICY_LOSS_FNS[name](logp, dict(old_logp=old, advantages=adv, response_mask=mask, ref_logp=None),
                                    algo(**kw))
    for mode in MODES:
        got = agg_loss(loss, mask, mode, 6, int(mask.sum()), 8)
        (grad,) = torch.autograd.grad(got, logp, retain_graph=True)
        xr = x.double().requires_grad_()
        want = ref_agg(ref_rows(name, kw, xr), mode, 6, 8)
        (gwant,) = torch.autograd.grad(want, xr)
        assert near(got, want, dtype)
        assert near(grad, gwant, dtype)


def test_gmpo_reads_no_advantage_outside_the_mask():
    # mask [1, 1, 0], A = 1 on the mask, inf or NaN beyond (the advantage contract allows anything
    # there); log-ratios 0.1 and 0, inside the 0.2 clip: the ratio is exp((0.1 + 0) / 2) = e^0.05 =
    # 1.0512711, each token's loss -1.0512711 (token-mean: the same), d/dlogp_t = -e^0.05 / 2 =
    # -0.5256355 per token (1 / n of the mean's derivative, 1 / 2 of the token-mean's). Before, the
    # row's sums multiplied NaN by the mask's 0: loss and gradient NaN, and the update skipped.
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    old = torch.tensor([[-1.1, -2.0, -3.0]], dtype=F64)
    for bad in (NAN, INF, -INF):
        logp = torch.tensor([[-1.0, -2.0, -3.0]], dtype=F64, requires_grad=True)
        adv = torch.tensor([[1.0, 1.0, bad]], dtype=F64)
        loss, _ = POLICY_LOSS_FNS["gmpo"](logp, dict(old_logp=old, advantages=adv, response_mask=mask), algo())
        total = agg_loss(loss, mask, "token-mean", 1, 2, 3)
        (grad,) = torch.autograd.grad(total, logp)
        assert total.item() == pytest.approx(-math.exp(0.05), rel=1e-12)
        assert grad[0].tolist() == pytest.approx([-math.exp(0.05) / 2, -math.exp(0.05) / 2, 0.0], rel=1e-12)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_a_cpgd_token_exactly_on_its_bound_keeps_its_whole_gradient(dtype):
    # logp exactly old + log(1 + 0.28) (A > 0) and old + log(1 - 0.2) (A < 0), made as rft makes the
    # bounds, so they are equal in float32 too: the clamp has not bitten yet (as torch.clamp and
    # ppo_clip on its bounds), so d(-A logp_c)/dlogp = -A: [-1, 0.5]. torch.minimum/maximum split a
    # tie's gradient in half: [-0.5, 0.25] before.
    old = torch.tensor([[-1.3, -0.7]], dtype=dtype)
    logp = torch.stack([old[0, 0] + math.log1p(0.28), old[0, 1] + math.log1p(-0.2)])[None].requires_grad_()
    adv = torch.tensor([[1.0, -0.5]], dtype=dtype)
    loss, m = POLICY_LOSS_FNS["cpgd"](logp, dict(old_logp=old, advantages=adv, response_mask=torch.ones_like(adv)),
                                      algo(clip_ratio_low=0.2, clip_ratio_high=0.28))
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    assert grad.tolist() == [[-1.0, 0.5]]
    assert torch.equal(loss, -adv * logp.detach())  # the value: -A logp, the bound itself
    assert m["actor/clip_frac"] == 0.0


def test_gmpo_counts_a_log_ratio_beyond_20_as_20():
    # the documented departure (gmpo_loss's docstring): A = -1, one token 30 nats above the old
    # policy: loss -A e^20 = 4.85e8 with no gradient (the formula: e^30 = 1.07e13); beside a token
    # at 0, the ratio is e^(20 / 2) = e^10 = 22026.47 and only that token's gradient is left: both
    # tokens carry the row's loss -A e^10, so loss.sum()'s is 2 x (-A) e^10 / 2 = e^10
    old = torch.zeros(2, 2, dtype=F64)
    logp = torch.tensor([[30.0, 0.0], [30.0, 0.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]], dtype=F64)
    adv = -mask
    loss, _ = POLICY_LOSS_FNS["gmpo"](logp, dict(old_logp=old, advantages=adv, response_mask=mask),
                                      algo(clip_ratio_low=0.4, clip_ratio_high=0.4))
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    assert loss[:, 0].tolist() == pytest.approx([math.exp(20), math.exp(10)], rel=1e-12)
    assert grad[0].tolist() == [0.0, 0.0]
    assert grad[1].tolist() == pytest.approx([0.0, math.exp(10)], rel=1e-12)


def test_the_overlong_penalty_stops_at_minus_the_factor_past_the_limit():
    # DAPO's min(-(L - (Lmax - Lbuf)) / Lbuf * factor, 0) with Lmax 100, Lbuf 20, factor 0.5:
    # 81 -> -(1 / 20) * 0.5 = -0.025, 100 -> -0.5; 110 would be -(30 / 20) * 0.5 = -0.75 by the
    # formula, -0.5 here (shaping.overlong_penalty's docstring: never below -factor)
    got = [shaping.overlong_penalty(n, 100, 20, 0.5) for n in (80, 81, 100, 110)]
    assert got == [0.0, -0.025, -0.5, -0.5]


def test_a_study_advantage_off_the_mask_reaches_the_trainer_as_0():
    # a study's function (a dotted path) may leave anything off the mask (the contract checks the
    # mask's tokens only): here each row's reward broadcast over all 3 positions, inf on one. The
    # trainer gets 0 there, as from a registered function. Before, its advantage/mean (the sum over
    # every position / the tokens) was (3 x 2 + 2 x -4 + inf) / 3 = inf (-2 without the inf) for
    # the tokens' (2 + 2 - 4) / 3 = 0, and a row whose tokens had 0 was not skipped as one without
    # signal (trainer.skip_zero_advantage)
    from rft.algorithms.contract import checked

    def broadcast(batch, cfg):
        adv = batch["rewards"][:, None].expand_as(batch["response_mask"]).clone()
        adv[1, 2] = INF
        return adv

    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    batch = dict(rewards=torch.tensor([2.0, -4.0], dtype=F64), group_index=torch.tensor([0, 0]), response_mask=mask)
    got = checked(ADVANTAGE_FNS, "my_study.broadcast", broadcast)(batch, algo())
    assert got.tolist() == [[2.0, 2.0, 0.0], [-4.0, 0.0, 0.0]]
    assert got.sum().item() / mask.sum().item() == 0.0  # advantage/mean: (2 + 2 - 4) / 3


def test_gmpo_clips_every_token_on_the_side_of_its_rows_advantage():
    # per-token advantages [+1, -3] (gae or distill_coef give such rows): A = their mean, -1; both
    # log-ratios 0.5, clip 0.4. sgn(A) = -1 clips from below: max(0.5, 0.4) = 0.5 on each token, the
    # ratio e^0.5 = 1.6487213, the row's loss -A e^0.5 = 1.6487213 (seq-mean-token-mean of one row)
    # and d/dlogp_t = -A e^0.5 / 2 = 0.8243606 on each token. Each token's own sign clipped the
    # first at 0.4: the ratio e^0.45 = 1.5683122, and that token had no gradient
    old = torch.zeros(1, 2, dtype=F64)
    logp = torch.tensor([[0.5, 0.5]], dtype=F64, requires_grad=True)
    mask = torch.ones(1, 2, dtype=F64)
    adv = torch.tensor([[1.0, -3.0]], dtype=F64)
    loss, m = POLICY_LOSS_FNS["gmpo"](logp, dict(old_logp=old, advantages=adv, response_mask=mask),
                                      algo(clip_ratio_low=0.4, clip_ratio_high=0.4))
    total = agg_loss(loss, mask, "seq-mean-token-mean", 1, 2, 2)
    (grad,) = torch.autograd.grad(total, logp)
    assert total.item() == pytest.approx(math.exp(0.5), rel=1e-12)
    assert grad[0].tolist() == pytest.approx([math.exp(0.5) / 2] * 2, rel=1e-12)
    assert m["actor/clip_frac"] == 0.0  # for A < 0 the 0.4 upper bound never binds
