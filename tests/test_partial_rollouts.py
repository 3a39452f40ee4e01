"""Partial rollouts and the dynamic schedule's per-token bookkeeping (rft/rollout/partial.py,
rft/runtime/dynamic.py): which version wrote each token, with which log-prob; the staleness bound
over token versions; the per-token off-policy weights; the weight gate's turns."""

import math
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from rft.algorithms.off_policy import correct, fresh_tokens
from rft.data.experience import Experience, collate
from rft.data.readers import encode_prompt
from rft.models import build_tiny_model, load_model, load_tokenizer
from rft.rollout.engines.hf import HFEngine
from rft.rollout.partial import PartialRollouts, WeightGate, stop_cut
from rft.runtime.schedule import Schedule, token_ages
from rft.trainer.trainer import token_logprobs


@pytest.fixture(scope="module")
def tiny(cache_dir):
    """A randomly initialised tiny model (it rarely samples end-of-sequence: rows run to the budget)."""
    path = build_tiny_model(cache_dir / "models" / "tiny-qwen2-v2")
    model_cfg = OmegaConf.create(dict(model_path=str(path), dtype="float32", trust_remote_code=False,
                                      custom_chat_template=None, max_response_tokens=12))
    tok = load_tokenizer(model_cfg)
    engine = HFEngine(model_cfg, SimpleNamespace(generate_batch_size=8), tok)
    prompts = [encode_prompt(tok, [{"role": "user", "content": q}], 24) for q in ("12+34", "5+6")]
    return model_cfg, tok, engine, prompts


def args(t=1.0, max_tokens=12, stop=()):
    return SimpleNamespace(temperature=t, top_p=1.0, top_k=-1, max_tokens=max_tokens, stop=list(stop))


def _nudged(state: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}


def test_a_response_interrupted_by_two_syncs_holds_three_versions_each_with_its_own_logprobs(tiny):
    """Chunks of 4 tokens, new weights after the first and the second chunk: each 12-token response
    holds tokens 0-3 of version 0, 4-7 of version 1, 8-11 of version 2, and each token's recorded
    log-prob is the trainer's recomputation (token_logprobs) under the snapshot of its version."""
    model_cfg, tok, engine, prompts = tiny
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    snapshots = [original, _nudged(original, 1)]
    snapshots.append(_nudged(snapshots[1], 2))
    gate = WeightGate(0)
    partial = PartialRollouts(engine, tok, gate, chunk_tokens=4, max_tokens=12)
    partial.admit([0, 1], prompts, 2, step=0)

    def interrupt(chunks):  # what a sync does between chunks: load, then record the version
        if chunks in (1, 2):
            with gate.loading():
                engine.update_weights(snapshots[chunks])
                gate.set_version(chunks)

    try:
        done, counters = partial.run(2, args(0.8), seed=5, interrupt=interrupt)
    finally:
        engine.update_weights(original)
    assert counters["partial_chunks"] == 3 and counters["max_token_versions"] == 3
    rows = [(g.prompt, r) for g in done for r in g.rows]
    full = [r for _, r in rows if len(r.tokens) == 12]
    assert full, "no row ran to the budget"
    for r in full:
        assert r.versions == [0] * 4 + [1] * 4 + [2] * 4
    exps = [Experience(p + r.tokens, len(p), r.logprobs, token_versions=r.versions) for p, r in rows]
    batch = collate(exps, tok.pad_token_id)
    trainer_model = load_model(model_cfg)
    for v, state in enumerate(snapshots):
        trainer_model.load_state_dict(state)
        with torch.no_grad():
            logp, _ = token_logprobs(trainer_model, batch["input_ids"], batch["attention_mask"], temperature=0.8)
        for i, e in enumerate(exps):
            got = logp[i][batch["response_mask"][i].bool()]
            mine = torch.tensor([x == v for x in e.token_versions])
            torch.testing.assert_close(got[mine], torch.tensor(e.logprobs)[mine], atol=1e-4, rtol=1e-4)


def test_an_explore_step_returns_its_quota_of_finished_groups_and_carries_the_rest(tiny):
    """Three groups, a quota of one: the first group to finish is returned, two stay in flight; a
    copy made from `state` goes on exactly as the original (what a checkpoint or a restarted
    explorer relies on)."""
    _, tok, engine, prompts = tiny
    partial = PartialRollouts(engine, tok, WeightGate(0), chunk_tokens=3, max_tokens=12)
    partial.admit([0, 1, 2], prompts + prompts[:1], 2, step=4)
    done, counters = partial.run(1, args(), seed=1)
    assert len(done) == 1 and counters["partial_carried"] == 2 and len(partial.groups) == 2
    assert all(r.finish for r in done[0].rows) and done[0].step == 4
    copy = PartialRollouts(engine, tok, WeightGate(0), chunk_tokens=3, max_tokens=12)
    copy.load(partial.state())
    a, _ = partial.run(2, args(), seed=2)
    b, _ = copy.run(2, args(), seed=2)
    assert [[r.tokens for r in g.rows] for g in a] == [[r.tokens for r in g.rows] for g in b]
    assert [[r.logprobs for r in g.rows] for g in a] == [[r.logprobs for r in g.rows] for g in b]


def test_a_stop_string_split_between_two_chunks_ends_the_response(tiny):
    """The tokenizer is character-level: "1+" then "2=" holds the stop string "+2" across the
    boundary; the second chunk keeps its first token ("2") only."""
    _, tok, _, prompts = tiny
    ids = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    assert stop_cut(tok, prompts[0], ids("1+"), ids("2="), ["+2"]) == 1
    assert stop_cut(tok, prompts[0], ids("1+"), ids("3="), ["+2"]) is None
    # a stop string wholly inside the earlier tokens was found then: not found again here
    assert stop_cut(tok, prompts[0], ids("+2"), ids("34"), ["+2"]) is None


def test_the_staleness_bound_drops_exactly_the_experiences_with_a_token_over_it():
    """Training step 7 learns with version 6; max_staleness 3. Oldest tokens: versions 3 (age 3:
    kept), 5 (age 1: kept), 2 (age 4: dropped). Token ages of the kept ones: [3, 4, 5] -> 3, 2, 1
    and [5, 5] -> 1, 1: mean (3 + 2 + 1 + 1 + 1) / 5 = 1.6."""
    exps = [Experience([1, 2, 3, 4], 1, [-0.1] * 3, policy_version=3, token_versions=[3, 4, 5]),
            Experience([1, 2, 3], 1, [-0.1] * 2, policy_version=5, token_versions=[5, 5]),
            Experience([1, 2, 3], 1, [-0.1] * 2, policy_version=2, token_versions=[2, 6])]
    schedule = object.__new__(Schedule)
    schedule.cfg = OmegaConf.create({"mode": "both", "algorithm": {"rm_pairs": "dataset"}, "synchronizer": {"max_staleness": 3},
                                     "buffer": {"trainer_input": {"experience_buffer": {"max_read_timeout": 1.0}}}})
    schedule.buffer = SimpleNamespace(get=lambda n, timeout: exps[:n])
    schedule.monitor = SimpleNamespace(histogram=lambda *a: None)
    kept, m = schedule._read_batch(7, 3)
    assert kept == exps[:2]
    assert m["staleness/dropped"] == 1 and m["staleness/max"] == 4 and m["staleness/count_4"] == 1
    assert m["staleness/token_mean"] == pytest.approx(1.6)
    assert m["staleness/token_frac_1"] == pytest.approx(3 / 5)
    # without token versions every response token has the experience's age
    assert token_ages([Experience([1, 2, 3], 1, [], policy_version=4)], 6) == {
        "staleness/token_mean": 2.0, "staleness/token_frac_2": 1.0}


def test_per_token_off_policy_weights_leave_a_partial_rollouts_fresh_tokens_alone():
    """Trainer version 2. One experience, prompt 2 tokens, response 3 tokens of versions 1, 1, 2;
    sampling log-probs -1.0, -2.0, -0.5; the trainer's (old_logp, positions 1..3) -0.8, -2.5, -0.7.
    decoupled: w = exp(old - behav) for the stale tokens: exp(0.2) = 1.2214, exp(-0.5) = 0.6065;
    the fresh third token keeps 1 (its ratio exp(-0.2) is not applied). behavior: the stale
    tokens' old log-probs become -1.0, -2.0; the fresh one keeps -0.7."""
    e = Experience([5, 6, 7, 8, 9], 2, [-1.0, -2.0, -0.5], policy_version=1, token_versions=[1, 1, 2])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    old = torch.tensor([[0.0, -0.8, -2.5, -0.7]])
    cfg = SimpleNamespace(off_policy_correction="decoupled", behavior_weight_cap=10.0)
    w = correct([e], old.clone(), mask, 2, cfg)
    torch.testing.assert_close(w, torch.tensor([[1.0, math.exp(0.2), math.exp(-0.5), 1.0]]))
    fixed = old.clone()
    assert correct([e], fixed, mask, 2, SimpleNamespace(off_policy_correction="behavior", behavior_weight_cap=10.0)) is None
    torch.testing.assert_close(fixed, torch.tensor([[0.0, -1.0, -2.0, -0.7]]))
    # fresh tokens: only the third (its version is the trainer's)
    torch.testing.assert_close(fresh_tokens([e], 2, mask), torch.tensor([[0.0, 0.0, 0.0, 1.0]]))


def test_the_gate_lets_a_load_in_between_chunks_and_in_test_mode_only_where_opened():
    gate = WeightGate(0)
    order = []

    def load(v):
        with gate.loading():
            order.append(f"load {v}")
            gate.set_version(v)

    with gate.generating():
        t = threading.Thread(target=load, args=(1,))
        t.start()
        time.sleep(0.1)
        order.append("chunk")  # the load waits for the chunk
    t.join(5)
    assert order == ["chunk", "load 1"] and gate.version == 1

    fixed = WeightGate(0, fixed=True)

    def load_fixed():
        with fixed.loading():
            fixed.set_version(1)

    t = threading.Thread(target=load_fixed)
    t.start()
    time.sleep(0.1)
    assert fixed.version == 0  # closed: the load waits
    fixed.open_at(1, timeout=5)  # opens, the load goes in, closes again
    assert fixed.version == 1 and not fixed.open
    with pytest.raises(TimeoutError, match="version 2 did not arrive within 0.1 s"):
        fixed.open_at(2, timeout=0.1)


def test_refill_takes_tasks_in_step_order_up_to_the_groups_in_flight(tiny):
    """Steps of 2 tasks, 3 groups in flight: step 0's two, then step 1's first; the cursor stops
    at (1, 1). A finished group still counts until it is returned; once it is, refilling takes
    step 1's second task."""
    _, tok, engine, prompts = tiny
    partial = PartialRollouts(engine, tok, WeightGate(0), chunk_tokens=3, max_tokens=12)
    share = lambda s: ([10 * s, 10 * s + 1], [prompts[0], prompts[1]])  # noqa: E731
    partial.refill(3, 2, share)
    assert [(g.task_index, g.step) for g in partial.groups] == [(0, 0), (1, 0), (10, 1)]
    assert partial.cursor == [1, 1]
    for r in partial.groups[0].rows:
        r.finish = "stop"
    partial.refill(3, 2, share)
    assert len(partial.groups) == 3 and partial.cursor == [1, 1]
    partial.groups.pop(0)  # returned by an explore step
    partial.refill(3, 2, share)
    assert [(g.task_index, g.step) for g in partial.groups] == [(1, 0), (10, 1), (11, 1)] and partial.cursor == [2, 0]


@pytest.mark.parametrize("overrides, message", [
    (["explorer.partial_rollout=true"],
     "explorer.partial_rollout=true lets new weights into an explore step between its generate chunks, and only "
     "synchronizer.sync_style=dynamic_by_explorer sends them while explorers generate"),
    (["synchronizer.sync_style=dynamic_by_explorer", "cluster=inline"],
     "synchronizer.sync_style=dynamic_by_explorer runs the explorers and the trainer side by side, which needs "
     "them in processes of their own (cluster.backend=ray; here inline"),
    (["synchronizer.sync_style=dynamic_by_explorer", "synchronizer.sync_offset=0"],
     "synchronizer.sync_style=dynamic_by_explorer needs synchronizer.sync_offset >= 1"),
    (["synchronizer.sync_style=dynamic_by_explorer", "synchronizer.fixed_interrupts=true"],
     "synchronizer.fixed_interrupts=true (a test mode) makes explore step s wait for the weights of training "
     "step s after its first chunk, which needs explorer.partial_rollout=true"),
    (["synchronizer.sync_style=dynamic_by_explorer", "explorer.partial_rollout=true", "task=calculator",
      "model=tiny_tools"],
     "explorer.partial_rollout=true continues single-turn responses across explore steps; the taskset's "
     "workflow is 'multi_turn'"),
    (["synchronizer.sync_style=dynamic_by_explorer", "explorer.partial_rollout=true", "explorer.partial_in_flight=0.5"],
     "explorer.partial_in_flight=0.5 must be >= 1"),
])
def test_async_settings_that_cannot_work_are_one_paragraph_naming_the_keys(overrides, message):
    from conftest import compose_cfg

    from rft.errors import ConfigError
    from rft.plan.batch import check_config

    with pytest.raises(ConfigError) as e:
        check_config(compose_cfg(overrides))
    assert message in str(e.value)
