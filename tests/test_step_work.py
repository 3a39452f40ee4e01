"""The work a train step and a rollout save, and that saving it changes no result:

1. an update whose old log-probs are its own (one optimizer step per RL step, fresh experiences,
   no KL penalty on the reward) runs no separate no-grad "old log-prob" forward: the update's own
   detached log-probs are the old ones (ratio exactly 1);
2. trainer.skip_zero_advantage: rows whose advantages are all 0 are not forwarded when the loss
   declares they add nothing;
3. rollout/logprob_diff: |trainer log-prob - explorer's sampling log-prob| per fresh token;
4. the hf engine prefills each distinct prompt once and repeats its KV cache for its n samples.

On the tiny model, no Ray, no training runs.
"""

import random
from types import SimpleNamespace

import pytest
import torch
from test_engine import tiny_engine_and_prompts
from test_trainer import make_trainer

import rft.trainer.trainer
from rft.data.experience import Experience, collate
from rft.trainer.trainer import token_logprobs

# ---------------------------------------------------------------- helpers


def grouped(rewards, seed=0, policy_version=0):
    """A GRPO batch: one group per entry of `rewards` (that group's rewards), each group one
    prompt of 15 tokens and responses of 2 to 6 tokens (so rows have different lengths)."""
    rng = random.Random(seed)
    exps = []
    for g, group in enumerate(rewards):
        prompt = [1, 5, 102] + [rng.randint(7, 16) for _ in range(7)] + [2, 102, 1, 6, 102]
        for r in group:
            response = [rng.randint(7, 16) for _ in range(rng.randint(1, 5))] + [2]
            exps.append(Experience(prompt + response, len(prompt), [0.0] * len(response), reward=float(r),
                                   group_id=f"0/{g}", policy_version=policy_version))
    return exps


MIXED = [[1, 0, 0, 1], [0, 1, 1, 1]]  # every group has a signal: nothing to skip
ONE_FLAT = [[1, 1, 1, 1], [1, 0, 0, 1]]  # the first group's rewards are all equal: advantages 0
ALL_FLAT = [[1, 1, 1, 1], [0, 0, 0, 0]]


def params(trainer):
    return {k: p.detach().clone() for k, p in trainer.model.named_parameters()}


def grads(trainer):
    return {k: p.grad.detach().clone() for k, p in trainer.model.named_parameters()}


class Forwards:
    """Counts the model forwards of the trainer (every one goes through rft.trainer.trainer.token_logprobs):
    `calls` holds (rows, with grad) per call."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = rft.trainer.trainer.token_logprobs

        def counted(model, input_ids, *args, **kwargs):
            self.calls.append((input_ids.shape[0], torch.is_grad_enabled()))
            return real(model, input_ids, *args, **kwargs)

        monkeypatch.setattr(rft.trainer.trainer, "token_logprobs", counted)

    @property
    def no_grad(self):
        return [c for c in self.calls if not c[1]]

    @property
    def with_grad(self):
        return [c for c in self.calls if c[1]]


def force_old_forward(monkeypatch, trainer):
    """The trainer as before the commit: the old log-probs from a forward of their own, whatever
    the trainer decides (patched where the decision is used, not the predicate that makes it)."""
    real = trainer._old_and_ref_logp
    monkeypatch.setattr(trainer, "_old_and_ref_logp", lambda full, mask, old=True, **kw: real(full, mask, old=True, **kw))


def assert_same_weights(a, b, atol, rtol=0.0):
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=atol, rtol=rtol, msg=k)


# ---------------------------------------------------------------- 1. no old forward on-policy


def test_on_policy_step_without_the_old_forward_gives_the_same_weights(monkeypatch):
    exps = grouped(MIXED)
    skip, forced = make_trainer(4), make_trainer(4)
    force_old_forward(monkeypatch, forced)
    before = params(skip)
    assert_same_weights(before, params(forced), atol=0)  # same seed, same start
    forwards = Forwards(monkeypatch)
    m_skip = skip.train_step(exps)
    assert forwards.no_grad == []  # the premise: the skip did happen (and did not in `forced`)
    m_forced = forced.train_step(exps)
    assert len(forwards.no_grad) == 2
    # torch.equal, not allclose: the no-grad forward of the old path runs the same micro-batches
    # (same rows, same trimmed length) through the same kernels as the update's forward, so its
    # log-probs are bitwise the update's own; the ratio exp(logp - old) is exactly 1 in both
    # paths, and the gradient, the clip and the AdamW step are the same float operations.
    after_skip, after_forced = params(skip), params(forced)
    for k in before:
        assert torch.equal(skip.model.get_parameter(k).grad, forced.model.get_parameter(k).grad), k
        assert torch.equal(after_skip[k], after_forced[k]), k
    assert any(not torch.equal(after_skip[k], before[k]) for k in before)  # the step did move them
    for key in ("loss/policy", "actor/grad_norm", "actor/entropy", "actor/approx_kl", "actor/clip_frac"):
        assert m_skip[key] == m_forced[key], key
    assert m_skip["actor/clip_frac"] == 0.0 and m_skip["actor/approx_kl"] == 0.0


def test_on_policy_step_runs_one_forward_per_micro_batch(monkeypatch):
    exps = grouped(MIXED)  # 8 rows, micro-batches of 4, no zero-advantage group
    trainer = make_trainer(4)
    forwards = Forwards(monkeypatch)
    trainer.train_step(exps)
    assert forwards.calls == [(4, True), (4, True)]


def test_old_forward_forced_runs_two_forwards_per_micro_batch(monkeypatch):
    exps = grouped(MIXED)
    trainer = make_trainer(4)
    force_old_forward(monkeypatch, trainer)
    forwards = Forwards(monkeypatch)
    trainer.train_step(exps)
    # the old log-probs (no grad), then the update
    assert forwards.calls == [(4, False), (4, False), (4, True), (4, True)]


@pytest.mark.parametrize("case", ["two epochs", "two mini-batches", "kl penalty"])
def test_not_exactly_on_policy_keeps_the_old_forward(monkeypatch, case):
    """More than one optimizer step per RL step, or a KL penalty on the reward (which needs the old
    log-probs before the advantages): the old log-probs get their own forward."""
    extra = {"two epochs": ["trainer.ppo_epochs=2"], "two mini-batches": ["trainer.mini_batch_size=64"],
             "kl penalty": ["algorithm.kl_penalty_fn=k1", "algorithm.kl_penalty_coef=0.1"]}.get(case, [])
    trainer = make_trainer(4, extra)
    assert trainer.plan.optimizer_steps_per_step == (2 if "two" in case else 1)
    trainer.version = 1
    exps = grouped(MIXED, policy_version=1)  # sampled by version 1: fresh
    forwards = Forwards(monkeypatch)
    trainer.train_step(exps)
    # two micro-batches of 4 rows without grad (and the reference's, for the KL penalty) ...
    assert forwards.no_grad == [(4, False)] * (4 if case == "kl penalty" else 2)
    # ... then the update's: the batch's 8 rows are one mini-batch (the plan's 64 per optimizer
    # step is more than this batch), two micro-batches per epoch
    assert forwards.with_grad == [(4, True)] * 2 * trainer.cfg.trainer.ppo_epochs


# ---------------------------------------------------------------- 2. rows of zero advantage


@pytest.mark.parametrize("micro", [4, 8])
def test_skipping_zero_advantage_rows_changes_no_weight(monkeypatch, micro):
    exps = grouped(ONE_FLAT)  # group 0 (rows 0-3): rewards all 1, advantages all 0
    # no gradient clipping, so the gradients compared below are the loss's own: a clip to norm 1
    # would hide a wrong scale (a normaliser that left out the skipped rows), and so would Adam's
    # first step, which is invariant to the gradient's scale
    # padded rows: packed ones (trainer.use_remove_padding) put 4 or 8 sequences in one row, and
    # the attention kernel's blocking over a longer row rounds differently, which Adam's first step
    # amplifies on gradients near its eps (tests/test_packing.py checks packing itself)
    no_clip = ["trainer.grad_clip=1e9", "trainer.use_remove_padding=false"]
    skip, full = make_trainer(micro, no_clip), make_trainer(micro, ["trainer.skip_zero_advantage=false", *no_clip])
    assert skip.skip_zero_advantage and not full.skip_zero_advantage
    before = params(skip)
    forwards = Forwards(monkeypatch)
    m_skip = skip.train_step(exps)
    skipped_calls, forwards.calls = forwards.calls, []
    m_full = full.train_step(exps)
    # only group 1's 4 rows are forwarded (moved first); without the skip all 8
    assert skipped_calls == [(4, True)]
    assert forwards.calls == [(micro, True)] * (8 // micro)
    assert m_skip["train/zero_advantage_rows_skipped"] == 4 and m_full["train/zero_advantage_rows_skipped"] == 0
    # A row of advantage 0 adds exactly 0 to the loss and its gradient (-0 * ratio), so the two
    # gradients are the same sum. micro=4: the same 4 rows in one micro-batch in both (group 1
    # after group 0's exact zeros): bitwise equal (atol = rtol = 0). micro=8: the trainer without the
    # skip runs the 8 rows as one micro-batch, padded to a longer length, whose reductions may
    # round differently at the float32 ulp level (its loss/policy does, by 1 ulp; the gradients
    # happen to come out bitwise equal here). AdamW's first step moves each weight by about
    # lr * g / |g| = 2e-4, which is insensitive to ulp-level changes of g: atol 1e-9 on weights is
    # 2e5 times below the step, so a wrong row (a skipped row that had a signal, a permutation
    # applied to some tensors but not others) fails it, while rounding cannot.
    atol = 0.0 if micro == 4 else 1e-9
    g_skip, g_full = grads(skip), grads(full)
    for k in before:
        torch.testing.assert_close(g_skip[k], g_full[k], atol=atol, rtol=0 if micro == 4 else 1e-5, msg=k)
    after = params(skip)
    assert_same_weights(params(full), after, atol=atol)
    assert any(not torch.equal(after[k], before[k]) for k in before)
    assert m_skip["loss/policy"] == pytest.approx(m_full["loss/policy"], rel=1e-6, abs=0)
    assert m_skip["actor/grad_norm"] == pytest.approx(m_full["actor/grad_norm"], rel=1e-6)
    assert m_skip["advantage/abs_mean"] == m_full["advantage/abs_mean"]


def test_a_batch_without_signal_forwards_nothing_yet_steps(monkeypatch):
    exps = grouped(ALL_FLAT)
    skip, full = make_trainer(4), make_trainer(4, ["trainer.skip_zero_advantage=false"])
    before = params(skip)
    forwards = Forwards(monkeypatch)
    m = skip.train_step(exps)
    assert forwards.calls == []
    assert m["train/zero_advantage_rows_skipped"] == 8 and m["loss/policy"] == 0.0
    assert m["actor/grad_norm"] == 0.0
    full.train_step(exps)
    assert len(forwards.calls) == 2  # the trainer without the skip forwarded its 2 micro-batches
    # a zero gradient: Adam's update is 0 / (0 + eps) = 0, only AdamW's decoupled weight decay
    # moves the weights: p * (1 - lr * weight_decay). Both are the same float operations on the
    # same values (an all-zero gradient without the skip too), so the weights are equal exactly.
    opt = skip.cfg.algorithm.optimizer
    assert opt.weight_decay == 0.01
    after, after_full = params(skip), params(full)
    for k in before:
        assert torch.equal(after[k], after_full[k]), k
        torch.testing.assert_close(after[k], before[k] * (1 - opt.lr * opt.weight_decay), atol=1e-12, rtol=1e-7)
    assert any(not torch.equal(after[k], before[k]) for k in before)
    # it counted as an optimizer step: Adam's step count and the schedule moved
    assert all(s["step"] == 1 for s in skip.optimizer.state.values())
    assert skip.version == 1


@pytest.mark.parametrize("extra", [["algorithm.entropy_coef=0.01"],
                                   ["algorithm.kl_loss_fn=k3", "algorithm.kl_loss_coef=0.1"],
                                   ["trainer.skip_zero_advantage=false"]])
@pytest.mark.slow
def test_nothing_is_skipped_when_another_term_reads_the_rows(monkeypatch, extra):
    exps = grouped(ONE_FLAT)
    trainer = make_trainer(4, extra)
    assert not trainer.skip_zero_advantage
    forwards = Forwards(monkeypatch)
    m = trainer.train_step(exps)
    assert m["train/zero_advantage_rows_skipped"] == 0
    assert forwards.with_grad == [(4, True), (4, True)]  # every row forwarded for the update


@pytest.mark.parametrize("correction", ["behavior", "decoupled"])
def test_stale_zero_advantage_rows_are_skipped_with_the_same_gradient(monkeypatch, correction):
    """Experiences one step stale (the explorer one step ahead): the correction is applied in the
    update, and a row whose advantages are all 0 adds 0 to the loss and to the gradient whatever
    its ratio, so it is not forwarded; the ratio's metrics are over the rows that were."""
    no_clip = ["trainer.grad_clip=1e9", "trainer.use_remove_padding=false",
               f"algorithm.off_policy_correction={correction}"]
    skip, full = make_trainer(4, no_clip), make_trainer(4, ["trainer.skip_zero_advantage=false", *no_clip])
    # sampled by version 0, with sampling log-probs 0.3 below the current ones (ratios e^0.3)
    exps = with_engine_logprobs(skip, grouped(ONE_FLAT, policy_version=0), [-0.3] * 8)
    skip.version = full.version = 1
    before = params(skip)
    forwards = Forwards(monkeypatch)
    m_skip = skip.train_step(exps)
    skipped_calls, forwards.calls = forwards.calls, []
    m_full = full.train_step(exps)
    # group 0 (rewards all 1) is set aside: one micro-batch of group 1's 4 rows, no old forward
    assert skipped_calls == [(4, True)] and forwards.calls == [(4, True), (4, True)]
    assert m_skip["train/zero_advantage_rows_skipped"] == 4 and m_full["train/zero_advantage_rows_skipped"] == 0
    # group 1's micro-batch is the same 4 rows in both: the same gradient, to float rounding
    g_skip, g_full = grads(skip), grads(full)
    for k in before:
        torch.testing.assert_close(g_skip[k], g_full[k], rtol=1e-6, atol=1e-9, msg=k)
    assert m_skip["loss/policy"] == pytest.approx(m_full["loss/policy"], rel=1e-6)
    if correction == "behavior":
        # the ratio to the sampling log-probs is e^0.3 on every token: approx KL (k3) = r - 1 - log r,
        # the same over any rows (over all rows with the skipped ones counted as 0 it would be 4/15 less)
        k3 = torch.exp(torch.tensor(0.3, dtype=torch.float64)).item() - 1 - 0.3
        assert m_skip["actor/approx_kl"] == pytest.approx(k3, rel=1e-4)
        assert m_full["actor/approx_kl"] == pytest.approx(k3, rel=1e-4)
    else:
        # the ratio is to the current weights (1); the behaviour weight pi_prox / pi_behav is e^0.3
        # on the forwarded rows (the skipped ones, never computed, do not count as 1)
        assert m_skip["actor/approx_kl"] == m_full["actor/approx_kl"] == 0.0
        w = torch.exp(torch.tensor(0.3)).item()
        assert m_skip["actor/behavior_weight_mean"] == pytest.approx(w, rel=1e-4)
        assert m_full["actor/behavior_weight_mean"] == pytest.approx(w, rel=1e-4)


# ---------------------------------------------------------------- 3. rollout/logprob_diff


def with_engine_logprobs(trainer, exps, offsets):
    """Give each experience stored sampling log-probs: the trainer's own (current weights) plus
    offsets[i]."""
    full = collate(exps, trainer.tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _ = token_logprobs(trainer.model, full["input_ids"], full["attention_mask"])
    for i, e in enumerate(exps):
        own = logp[i][full["response_mask"][i].bool()]
        assert len(own) == e.response_length
        e.logprobs = (own + offsets[i]).tolist()
    return exps


@pytest.mark.slow  # 1.4 s alone, over the fast tier's second
@pytest.mark.parametrize("path", ["on-policy", "old forward"])
def test_logprob_diff_is_the_offset_of_the_stored_logprobs(monkeypatch, path):
    trainer = make_trainer(4)
    if path == "old forward":
        force_old_forward(monkeypatch, trainer)
    exps = with_engine_logprobs(trainer, grouped(MIXED), [0.25] * 4 + [-0.25] * 4)
    m = trainer.train_step(exps)
    assert m["rollout/logprob_diff"] == pytest.approx(0.25, abs=1e-5)


@pytest.mark.parametrize("path", ["as the trainer decides", "old forward"])
def test_logprob_diff_counts_only_fresh_experiences(monkeypatch, path):
    trainer = make_trainer(4, ["algorithm.off_policy_correction=none"])
    if path == "old forward":
        force_old_forward(monkeypatch, trainer)
    trainer.version = 1
    exps = grouped(MIXED, policy_version=1)
    # rows 0-3 fresh with offsets 0.25, -0.5, 0.25, 1.0; rows 4-7 stale (sampled by version 0)
    # with offset 3.0: they must not count
    for e in exps[4:]:
        e.policy_version = 0
    offsets = [0.25, -0.5, 0.25, 1.0, 3.0, 3.0, 3.0, 3.0]
    exps = with_engine_logprobs(trainer, exps, offsets)
    n = [e.response_length for e in exps[:4]]
    # expected = (0.25 n0 + 0.5 n1 + 0.25 n2 + 1.0 n3) / (n0 + n1 + n2 + n3), the token-weighted
    # mean of |offset| over the fresh rows' response tokens: with n = [4, 3, 4, 4] it is
    # (1.0 + 1.5 + 1.0 + 4.0) / 15 = 0.5; counting the stale rows' 14 tokens too would give
    # (7.5 + 3.0 * 14) / 29 = 1.71
    assert n == [4, 3, 4, 4] and sum(e.response_length for e in exps[4:]) == 14
    expected = (0.25 * n[0] + 0.5 * n[1] + 0.25 * n[2] + 1.0 * n[3]) / sum(n)
    assert expected == 0.5
    m = trainer.train_step(exps)
    assert m["rollout/logprob_diff"] == pytest.approx(expected, abs=1e-5)


def test_logprob_diff_skip_path_leaves_out_zero_advantage_rows():
    # on-policy with a group skipped for its zero advantages: its rows are not forwarded, so the
    # metric is over the trained rows only (group 1, offset 0.5), not the set-aside ones (2.0)
    trainer = make_trainer(4)
    exps = with_engine_logprobs(trainer, grouped(ONE_FLAT), [2.0] * 4 + [0.5] * 4)
    m = trainer.train_step(exps)
    assert m["train/zero_advantage_rows_skipped"] == 4
    assert m["rollout/logprob_diff"] == pytest.approx(0.5, abs=1e-5)


# ---------------------------------------------------------------- 4. one prefill per prompt


@pytest.fixture(scope="module")
def tiny_engine(cache_dir):
    # different lengths: left padding in a chunk
    _, engine, prompts = tiny_engine_and_prompts(cache_dir, 12, ["123+456", "7+2", "30+41"])
    assert len({len(p) for p in prompts}) == 3
    return engine, prompts


def rollout_args(t):
    return SimpleNamespace(temperature=t, top_p=1.0, top_k=-1, max_tokens=None, stop=[])


def as_rows(out):
    return [s for group in out for s in group]


def assert_same_samples(grouped_out, flat_out, n):
    a, b = as_rows(grouped_out), as_rows(flat_out)
    assert len(a) == len(b) and [len(g) for g in grouped_out] == [n] * (len(a) // n)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    assert [s.finish_reason for s in a] == [s.finish_reason for s in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)


class ModelCalls:
    """(rows, positions) of each forward of the engine's model."""

    def __init__(self, model):
        self.calls = []
        self.handle = model.register_forward_pre_hook(
            lambda mod, args, kwargs: self.calls.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


@pytest.mark.parametrize("t", [1.0, 0.0])
def test_grouped_generation_equals_repeated_prompts(tiny_engine, t):
    engine, prompts = tiny_engine
    n = 4
    with ModelCalls(engine.model) as calls:
        grouped_out = engine.generate(prompts, n, rollout_args(t), seed=7)
    # one chunk (12 rows): the 3 prompts, all but their last token, prefilled once (3 rows),
    # then every forward over the 12 rows is one position (the last prompt token, then each new one)
    L = max(len(p) for p in prompts)
    assert calls.calls[0] == (3, L - 1)
    assert all(c == (12, 1) for c in calls.calls[1:]) and len(calls.calls) > 1
    flat = engine.generate([p for p in prompts for _ in range(n)], 1, rollout_args(t), seed=7)
    assert_same_samples(grouped_out, flat, n)
    if t:  # sampling: the samples of a group differ (the fixed seed gives distinct ones)
        assert len({tuple(s.token_ids) for s in grouped_out[0]}) > 1


def test_grouped_generation_with_a_chunk_smaller_than_a_group(tiny_engine, monkeypatch):
    engine, prompts = tiny_engine
    n = 4
    monkeypatch.setattr(engine, "batch_size", 2)  # < n: one group (4 rows) per chunk
    with ModelCalls(engine.model) as calls:
        grouped_out = engine.generate(prompts, n, rollout_args(1.0), seed=3)
    prefills = [c for c in calls.calls if c[1] > 1]
    assert prefills == [(1, len(p) - 1) for p in prompts]  # one prefill per prompt, no padding
    assert all(c == (4, 1) for c in calls.calls if c[1] == 1)
    # the same chunks of rows without sharing: 4 rows (one prompt's copies) per chunk
    monkeypatch.setattr(engine, "batch_size", 4)
    flat = engine.generate([p for p in prompts for _ in range(n)], 1, rollout_args(1.0), seed=3)
    assert_same_samples(grouped_out, flat, n)


def test_a_batch_without_signal_leaves_frozen_weights_alone():
    # a frozen weight gets no gradient from a backward either, so AdamW never touches it; the
    # zero gradient filled in for a batch without signal is for the trained weights only
    exps = grouped(ALL_FLAT)
    trainer = make_trainer(4)
    frozen = trainer.model.model.norm.weight
    frozen.requires_grad_(False)
    before = frozen.detach().clone()
    trainer.train_step(exps)
    assert frozen.grad is None
    assert torch.equal(frozen.detach(), before)


@pytest.mark.slow
@pytest.mark.parametrize("correction", ["behavior", "decoupled"])
@pytest.mark.parametrize("stale", ["all stale", "one stale"])
def test_stale_rows_are_corrected_in_the_update_without_the_old_forward(monkeypatch, correction, stale):
    """One optimizer step per RL step in one process: a stale experience's correction (behavior:
    its sampling log-probs replace the old ones; decoupled: weights pi_prox / pi_behav) is applied
    micro-batch by micro-batch to the update's own detached log-probs, which equal what the old
    forward computes; so the step equals the one with the old forward, exactly (same kernels on
    the same rows), weights and metrics, with one forward fewer per micro-batch."""
    # every row forwarded (no skip_zero_advantage), so the correction's metrics cover the same rows
    # in both (the skip of stale rows: test_stale_zero_advantage_rows_are_skipped_with_the_same_gradient)
    extra = [f"algorithm.off_policy_correction={correction}", "trainer.skip_zero_advantage=false"]
    fast, forced = make_trainer(4, extra), make_trainer(4, extra)
    force_old_forward(monkeypatch, forced)
    # ONE_FLAT: a group of equal rewards
    exps = grouped(ONE_FLAT, policy_version=0)
    for t in (fast, forced):
        t.version = 1
    if stale == "one stale":
        exps = grouped(ONE_FLAT, policy_version=1)
        exps[5].policy_version = 0
    # the stored sampling log-probs differ from the trainer's, so the correction does something
    for i, e in enumerate(exps):
        e.logprobs = [lp - 0.05 * (1 + (i + j) % 3) for j, lp in enumerate(e.logprobs)]
    forwards = Forwards(monkeypatch)
    m_fast = fast.train_step([e for e in exps])
    assert forwards.no_grad == []
    assert forwards.with_grad == [(4, True), (4, True)]
    m_forced = forced.train_step([e for e in exps])
    assert m_fast["train/zero_advantage_rows_skipped"] == 0
    for k, v in params(forced).items():
        assert torch.equal(params(fast)[k], v), k
    keys = {"loss/policy", "actor/grad_norm", "actor/approx_kl", "actor/clip_frac"}
    if correction == "decoupled":
        keys |= {"actor/behavior_weight_mean", "actor/behavior_weight_capped_frac"}
    for k in keys:
        assert m_fast[k] == m_forced[k], k
    # the correction changed the step: a stale row's ratio is not 1 (behavior) or its weight
    # not 1 (decoupled)
    if correction == "behavior":
        assert m_fast["actor/approx_kl"] > 0
    else:
        assert m_fast["actor/behavior_weight_mean"] != 1.0
