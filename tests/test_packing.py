"""The trainer at size, on the tiny model in float32: packed rows (trainer.use_remove_padding),
chunked log-probs (trainer.logprob_chunk_size), the output layer in float32, token-budget
micro-batches (trainer.use_dynamic_bsz), gradient checkpointing: each gives the numbers of the
plain padded computation. And the step's throughput metrics."""

import pytest
import torch
from conftest import compose_cfg
from test_trainer import experiences, make_trainer

from rft.data.experience import collate
from rft.errors import ConfigError
from rft.plan.batch import format_plan, make_plan, stage_configs
from rft.trainer import micro_batches
from rft.trainer.fsdp import FSDPTrainer
from rft.trainer.logprobs import token_logprobs

# per-row sampling params as the explorer records them: plain, temperature, top-k, top-p, both
SAMPLING = [{}, {"temperature": 0.7}, {"temperature": 1.0, "top_k": 5}, {"temperature": 1.3, "top_p": 0.8},
            {"temperature": 0.9, "top_p": 0.9, "top_k": 6}]


def batch(n_groups=4, group=4):
    exps = experiences(n_groups, group)
    for i, e in enumerate(exps):
        e.sampling = SAMPLING[i % len(SAMPLING)]
    return exps


def logprobs_and_grads(model, full, **kw):
    """Log-probs, entropies and the gradient of a loss that reads both, on the response tokens."""
    model.zero_grad(set_to_none=True)
    logp, ent = token_logprobs(model, full["input_ids"], full["attention_mask"], full["temperature"],
                               full["top_p"], full["top_k"], **kw)
    m = full["response_mask"]
    ((logp * m).sum() + 0.1 * (ent * m).sum()).backward()
    return logp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def trainer():
    return make_trainer(128)


@pytest.mark.parametrize("kw", [{"packed": True}, {"chunk_size": 7}, {"chunk_size": 1},
                                {"packed": True, "chunk_size": 16}, {"fp32_head": True}])
@pytest.mark.slow  # 2.8 s alone, over the fast tier's second
def test_packed_and_chunked_log_probs_and_gradients_equal_the_padded_ones(trainer, kw):
    full = collate(batch(), trainer.tokenizer.pad_token_id)
    # responses of 1 to 6 tokens after 15-token prompts: rows of 16 to 21 tokens, so the padded
    # batch has padding and the packed row has 16 sequence boundaries
    lengths = full["attention_mask"].sum(-1)
    assert lengths.min() < lengths.max()
    ref_logp, ref_ent, ref_g = logprobs_and_grads(trainer.model, full)
    logp, ent, g = logprobs_and_grads(trainer.model, full, **kw)
    # every position that predicts a token of its own row is compared (prompt ones too), and the
    # padding positions are 0 in both
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    for name in ref_g:
        # float32 sums over ~300 positions in another order: within 1e-5 of the tensor's largest
        # entry (a position left out or counted twice moves it by ~1/300)
        assert (g[name] - ref_g[name]).abs().max() <= 1e-5 * ref_g[name].abs().max(), name
    has_next = torch.arange(full["input_ids"].shape[1] - 1)[None] < (lengths[:, None] - 1)
    assert (ref_logp[~has_next] == 0).all() and (ref_logp[has_next] < 0).all()


@pytest.mark.parametrize("packed", [False, True])
def test_from_the_last_prompt_token_the_log_probs_and_gradients_are_the_whole_rows(trainer, monkeypatch, packed):
    """`first` (the trainer's: prompt length - 1): only the positions that predict a response
    token go through the output layer; what the loss reads is unchanged."""
    import rft.trainer.logprobs

    seen = []
    real = rft.trainer.logprobs._chunk_logprobs
    monkeypatch.setattr(rft.trainer.logprobs, "_chunk_logprobs", lambda h, *a: seen.append(h.shape[0]) or real(h, *a))
    full = collate(batch(), trainer.tokenizer.pad_token_id)
    first = full["prompt_length"] - 1
    ref_logp, ref_ent, ref_g = logprobs_and_grads(trainer.model, full, packed=packed)
    seen.clear()
    logp, ent, g = logprobs_and_grads(trainer.model, full, packed=packed, first=first)
    # 16 rows of a 15-token prompt and a response of 1 to 6 tokens: the output layer took one
    # position per response token (position 14 predicts the first), not the 14 prompt ones before
    responses = full["attention_mask"].sum(-1) - full["prompt_length"]
    assert (full["prompt_length"] == 15).all() and seen == [int(responses.sum())]
    m = full["response_mask"].bool()
    torch.testing.assert_close(logp[m], ref_logp[m], rtol=0, atol=1e-6)
    torch.testing.assert_close(ent[m], ref_ent[m], rtol=0, atol=1e-6)
    assert (logp[:, :14] == 0).all() and (ent[:, :14] == 0).all() and (logp[m] < 0).all()
    for name in ref_g:
        assert (g[name] - ref_g[name]).abs().max() <= 1e-5 * ref_g[name].abs().max(), name


def test_packed_sequences_never_attend_to_each_other(trainer):
    full = collate(batch(1, 3), trainer.tokenizer.pad_token_id)
    logp, _ = token_logprobs(trainer.model, full["input_ids"], full["attention_mask"], packed=True)
    # row 0 changed entirely: in the packed row it precedes rows 1 and 2, whose log-probs stay put
    changed = full["input_ids"].clone()
    n0 = int(full["attention_mask"][0].sum())
    changed[0, :n0] = torch.randint(7, 17, (n0,))
    logp2, _ = token_logprobs(trainer.model, changed, full["attention_mask"], packed=True)
    assert not torch.allclose(logp2[0], logp[0])
    torch.testing.assert_close(logp2[1:], logp[1:], rtol=0, atol=1e-6)


def test_chunks_never_hold_more_positions_than_the_chunk_size(trainer, monkeypatch):
    import rft.trainer.logprobs

    seen = []
    real = rft.trainer.logprobs._chunk_logprobs
    monkeypatch.setattr(rft.trainer.logprobs, "_chunk_logprobs", lambda h, *a: seen.append(h.shape[0]) or real(h, *a))
    full = collate(batch(), trainer.tokenizer.pad_token_id)
    logp, _ = token_logprobs(trainer.model, full["input_ids"], full["attention_mask"], chunk_size=10)
    logp.sum().backward()
    # positions with a next token of their own row: the rows' lengths - 1 each
    positions = int((full["attention_mask"].sum(-1) - 1).sum())
    forward = [min(10, positions - a) for a in range(0, positions, 10)]
    # the forward's chunks, then each recomputed once in the backward (activation checkpointing)
    assert seen[:len(forward)] == forward and sorted(seen[len(forward):]) == sorted(forward)


def test_token_budget_micro_batches_hand_computed():
    lengths = [5, 3, 8, 2, 2, 9, 1]
    # packed: a micro-batch costs the sum of its lengths; 5+3=8 <= 10, +8 > 10; 8+2=10, +2 > 10;
    # 2 alone then +9 > 10; 9+1 = 10
    assert micro_batches.token_budget(lengths, 0, 7, 10, packed=True) == [(0, 2), (2, 4), (4, 5), (5, 7)]
    # padded: rows x the longest; [5,3] costs 10, [5,3,8] 24; [8] 8, [8,2] 16; [2,2] 4, [2,2,9] 27;
    # [9,1] 18 > 10: 9 alone, 1 alone
    assert micro_batches.token_budget(lengths, 0, 7, 10, packed=False) == [(0, 2), (2, 3), (3, 5), (5, 6), (6, 7)]
    # a row over the budget is a micro-batch of its own, never dropped; pairs (unit 2) stay together
    assert micro_batches.token_budget([20, 1, 1, 1], 0, 4, 10, packed=True) == [(0, 1), (1, 4)]
    assert micro_batches.token_budget([3, 3, 3, 3, 3, 3], 0, 6, 10, packed=True, unit=2) == [(0, 2), (2, 4), (4, 6)]
    assert micro_batches.token_budget([3, 3], 1, 1, 10, packed=True) == []
    # shares of ~equal tokens: total 30, 15 each; cut before 9 (8+2+2+... running 20 at 2,2: the
    # rows 0..3 hold 18); rows 0-2 hold 16 (>15 by 1, at 5+3 = 8 + 8/2 = 12 < 15 it stays)
    assert micro_batches.balanced_blocks(lengths, 0, 7, 2) == [(0, 3), (3, 7)]
    assert micro_batches.balanced_blocks([1, 1, 1, 1], 0, 4, 3) == [(0, 1), (1, 3), (3, 4)]
    assert micro_batches.balanced_blocks([4], 0, 1, 3) == [(0, 1), (1, 1), (1, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("packed", [True, False])
def test_token_budget_micro_batches_give_the_one_batch_gradient(packed):
    exps = experiences()
    pad = [f"trainer.use_remove_padding={packed}"]
    whole = make_trainer(128, pad)
    budget = make_trainer(128, [*pad, "trainer.use_dynamic_bsz=true", "trainer.max_token_len_per_gpu=100"])
    assert budget.plan.max_token_len_per_gpu == 100
    m_whole, m_budget = whole.train_step(exps), budget.train_step(exps)
    for (name, a), (_, b) in zip(whole.model.named_parameters(), budget.model.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-7, msg=name)
    assert m_budget["loss/policy"] == pytest.approx(m_whole["loss/policy"], abs=1e-6)
    # 128 rows of 16-21 tokens: about 20 micro-batches of <= 100 tokens, each a forward
    lengths = [len(e.tokens) for e in exps]
    n_micro = len(micro_batches.token_budget(lengths, 0, 128, 100, packed))
    assert 128 * 16 / 100 <= n_micro <= 128 * 21 / 50


def test_data_parallel_ranks_share_a_token_budget_and_run_as_many_passes():
    cfg = stage_configs(compose_cfg(["stages=[]", "trainer=fsdp2", "trainer.use_dynamic_bsz=true",
                                     "trainer.max_token_len_per_gpu=40"]))[0]
    plan = make_plan(cfg, 2000)
    lengths = [30, 2, 2, 2, 10, 10, 10, 10, 4]
    full = {"attention_mask": torch.tensor([[1] * n + [0] * (30 - n) for n in lengths])}
    passes = []
    for rank in range(2):
        t = FSDPTrainer.__new__(FSDPTrainer)  # the row bookkeeping alone: no process group
        t.cfg, t.plan, t.rank, t.world = cfg, plan, rank, 2
        passes.append(list(t._my_micro_batches(full, 0, 9)))
    # 80 tokens, 40 a share: rows 0-3 hold 36, and row 4 would take rank 0 to 46, past 40 by more
    # than it stays short: rank 0 rows 0-3, rank 1 rows 4-8 (44 tokens). Rank 1 needs 2 passes of
    # <= 40 (10+10+10+10 = 40, then 4), rank 0 one, plus a dead pass weighted 0
    assert passes[0] == [(0, 4, True), (0, 1, False)]
    assert passes[1] == [(4, 8, True), (8, 9, True)]


def test_gradient_checkpointing_recomputes_each_block_and_keeps_the_gradient():
    exps = experiences(4, 4)
    plain, ckpt = make_trainer(16), make_trainer(16, ["trainer.gradient_checkpointing=true"])
    calls = []
    for layer in ckpt.model.model.layers:
        # a block's own hooks stay outside the checkpoint (transformers checkpoints its forward,
        # for FSDP's hooks); its MLP's run again in the recomputation
        layer.mlp.register_forward_pre_hook(lambda m, a: calls.append(1))
    plain.train_step(exps)
    ckpt.train_step(exps)
    for (name, a), (_, b) in zip(plain.model.named_parameters(), ckpt.model.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)
    # one update forward of every block, and once more in the backward (the step's only forward:
    # the on-policy old log-probs are the update's own)
    assert len(calls) == 2 * len(ckpt.model.model.layers)
    # the attention and MLP inside stay in eval mode (no dropout)
    assert not any(m.training for layer in ckpt.model.model.layers for m in layer.children())


def test_the_step_reports_padding_and_throughput():
    # rows of 16, 16 and 32 tokens. Padded, a forward computes 3 x 32 = 96 for 64 real tokens;
    # packed, the two short ones share a row as wide as the long one: 2 x 32 = 64, no padding
    exps = experiences(1, 3)
    for e, n in zip(exps, (16, 16, 32)):
        e.tokens = e.tokens[:15] + [7 + i % 9 for i in range(n - 16)] + [2]
        e.logprobs, e.reward = [0.0] * (n - 15), float(n > 16)
    padded = make_trainer(8, ["trainer.use_remove_padding=false"]).train_step(exps)
    packed = make_trainer(8).train_step(exps)
    assert padded["perf/padding_frac"] == pytest.approx(1 - 64 / 96)
    assert packed["perf/padding_frac"] == 0.0
    for m in (padded, packed):
        assert m["perf/trainer_tokens_per_s"] > 0 and m["perf/tflops"] > 0 and m["perf/max_memory_gb"] > 0
        assert "perf/mfu" not in m  # a CPU's peak is unknown


def test_packing_fills_rows_as_wide_as_the_longest_first_fit():
    from rft.trainer.logprobs import pack

    lengths = [3, 5, 2, 1]
    ids = torch.tensor([[11, 12, 13, 0, 0], [21, 22, 23, 24, 25], [31, 32, 0, 0, 0], [41, 0, 0, 0, 0]])
    packed, positions, starts = pack(ids, lengths)
    # longest first into rows of 5: [5] | [3, 2] | and 1 fits nowhere (5+1, 3+2+1 > 5): its own row,
    # whose unused end is a filler sequence (positions from 0 again)
    assert packed.tolist() == [[21, 22, 23, 24, 25], [11, 12, 13, 31, 32], [41, 0, 0, 0, 0]]
    assert positions.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1], [0, 0, 1, 2, 3]]
    assert starts.tolist() == [5, 0, 8, 10]
    one, pos1, starts1 = pack(ids, lengths, one_row=True)
    assert one.tolist() == [[21, 22, 23, 24, 25, 11, 12, 13, 31, 32, 41]] and starts1.tolist() == [5, 0, 8, 10]
    assert micro_batches.packed_shape(lengths, False) == (3, 5) and micro_batches.packed_shape(lengths, True) == (1, 11)


def test_plan_shows_the_token_budget_and_checks_the_attention_kernel():
    cfg = stage_configs(compose_cfg(["stages=[]", "trainer.use_dynamic_bsz=true"]))[0]
    plan = make_plan(cfg, 2000)
    # default: the micro-batch's rows (128) x the longest sequence (max_prompt_tokens 24 +
    # max_response_tokens 6; no model.max_model_len) = 3840
    assert (plan.micro_batch_size, cfg.model.max_model_len) == (128, None)
    assert plan.max_token_len_per_gpu == 128 * (24 + 6) == 3840
    assert "tokens per micro-batch" in format_plan(plan) and "experiences per micro-batch" not in format_plan(plan)
    with pytest.raises(ConfigError) as e:
        make_plan(stage_configs(compose_cfg(["stages=[]", "model.attn_implementation=flash"]))[0], 2000)
    assert str(e.value) == ("model.attn_implementation='flash' is not an attention kernel; choose one of sdpa, "
                            "flash_attention_2, flash_attention_3, eager, flex_attention (or null for "
                            "transformers' default, sdpa).")


def test_fp32_lm_head_computes_the_output_layer_in_float32():
    t = make_trainer(8, ["model.dtype=bfloat16"])
    full = collate(batch(2, 2), t.tokenizer.pad_token_id)
    head = t.model.get_output_embeddings()
    seen = []
    head.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    with torch.no_grad():
        plain, _ = token_logprobs(t.model, full["input_ids"], full["attention_mask"])
        fp32, _ = token_logprobs(t.model, full["input_ids"], full["attention_mask"], fp32_head=True)
        # the same hidden states through the output layer in float64: the exact log-probs
        h = seen[0][:, :-1].double()
        logits = torch.nn.functional.linear(h, head.weight.double())
        exact = logits.log_softmax(-1).gather(-1, full["input_ids"][:, 1:, None]).squeeze(-1)
    has_next = full["attention_mask"][:, 1:].bool()
    err = lambda x: (x.double() - exact)[has_next].abs().max().item()  # noqa: E731
    # bfloat16 logits carry ~3 significant digits; float32 ones ~7
    assert err(fp32) < 1e-4 < err(plain)


def test_eager_attention_packs_the_same_as_sdpa(trainer):
    from omegaconf import OmegaConf

    from rft.models import load_model

    cfg = OmegaConf.merge(trainer.cfg.model, {"attn_implementation": "eager"})
    eager = load_model(cfg)
    assert eager.config._attn_implementation == "eager"
    full = collate(batch(), trainer.tokenizer.pad_token_id)
    with torch.no_grad():
        want, _ = token_logprobs(trainer.model, full["input_ids"], full["attention_mask"])
        got, _ = token_logprobs(eager, full["input_ids"], full["attention_mask"], packed=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_readme_7b_recipes_compose_and_place():
    """README "The trainer at size": both commands are valid configs that place 4 and 8 trainer
    ranks beside their engines (the plan's checks that need no GPU and no dataset)."""
    import re
    import shlex
    from pathlib import Path

    from rft.plan.batch import check_config
    from rft.plan.placement import check_placement, trainer_ranks

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## The trainer at size"):readme.index("## Sweeps, Slurm")]
    commands = [c.replace("\\\n", " ") for c in re.findall(r"    python run\.py ((?:.*\\\n)*.*)", section)]
    assert len(commands) == 2
    for command, ranks in zip(commands, (4, 8)):
        cfg = compose_cfg(shlex.split(command))
        check_config(cfg)
        assert trainer_ranks(cfg) == ranks and check_placement(cfg).trainer_gpus == ranks
        assert cfg.trainer.use_dynamic_bsz and cfg.trainer.gradient_checkpointing and cfg.trainer.logprob_chunk_size == 2048


def _benchmark():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "experiments" / "trainer_benchmark" / "benchmark.py"
    spec = importlib.util.spec_from_file_location("trainer_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, path


def test_the_trainer_benchmark_summarizes_by_hand():
    bench, _ = _benchmark()
    rows = [{"arm": "padded", "tokens_per_s": 100.0, "peak_mb": 900.0, "padding_frac": 0.5, "micro_batches": 4, "logits_mb": 10.0},
            {"arm": "padded", "tokens_per_s": 120.0, "peak_mb": 1100.0, "padding_frac": 0.5, "micro_batches": 4, "logits_mb": 10.0},
            {"arm": "packed", "tokens_per_s": 200.0, "peak_mb": 500.0, "padding_frac": 0.0, "micro_batches": 4, "logits_mb": 10.0},
            {"arm": "packed", "tokens_per_s": 240.0, "peak_mb": 700.0, "padding_frac": 0.0, "micro_batches": 4, "logits_mb": 10.0}]
    table = bench.summarize(rows)
    # medians: padded 110 tok/s, 1000 MB; packed 220, 600: 2.0x
    assert table["padded"]["tokens_per_s"] == 110 and table["padded"]["peak_mb"] == 1000
    assert table["packed"]["speedup"] == pytest.approx(2.0) and table["packed"]["peak_mb"] == 600
    # long-tailed lengths: within the cut, a few long ones
    lengths = bench.lengths(32, 512)
    assert min(lengths) >= 8 and max(lengths) <= 480 and sorted(lengths)[16] < max(lengths) / 3


@pytest.mark.slow
def test_the_trainer_benchmark_runs_every_arm():
    import json
    import subprocess
    import sys

    _, path = _benchmark()
    r = subprocess.run([sys.executable, str(path), "--small", "--repeats", "1"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    table = json.loads(r.stdout.strip().splitlines()[-1])
    assert list(table) == ["padded", "packed", "packed+budget", "+chunked"]
    assert table["padded"]["padding_frac"] > 0.2 and table["packed"]["padding_frac"] < table["padded"]["padding_frac"]
    assert all(v["tokens_per_s"] > 0 and v["peak_mb"] > 0 for v in table.values())


# ---------------------------------------------------------------- shared prompts (trainer.share_prompts)

def _mixed_batch():
    """Groups sharing a prompt, shuffled among each other; a group whose responses are longer than
    its prompt (not shared); a lone row; a row with an empty response; another prompt length."""
    import random

    from rft.data.experience import Experience

    exps = batch(3, 4)
    rng = random.Random(1)
    long_prompt = [1, 5, 102, 9, 2, 102, 1, 6, 102]  # 9 tokens, responses of 12: not worth sharing
    exps += [Experience(long_prompt + [rng.randint(7, 16) for _ in range(11)] + [2], 9, [0.0] * 12, group_id="long")
             for _ in range(3)]
    short = [1, 5, 102, 12, 13, 2, 102, 1, 6, 102]  # 10 tokens, shared by two rows, one of them prompt only
    exps += [Experience(short + [8, 9, 2], 10, [0.0] * 3, group_id="short"), Experience(short, 10, [], group_id="short")]
    exps.append(Experience([1, 5, 102, 7, 2, 102, 1, 6, 102, 11, 2], 9, [0.0] * 2, group_id="alone"))
    rng.shuffle(exps)
    for i, e in enumerate(exps):
        e.sampling = SAMPLING[i % len(SAMPLING)]
    return exps


@pytest.mark.parametrize("kw", [{}, {"chunk_size": 5}, {"fp32_head": True}])
def test_shared_prompts_give_the_padded_log_probs_and_gradients(trainer, kw):
    from rft.trainer.logprobs import prompt_units

    full = collate(_mixed_batch(), trainer.tokenizer.pad_token_id)
    lengths = full["attention_mask"].sum(-1).tolist()
    units, sizes = prompt_units(full["input_ids"], lengths, full["prompt_length"].tolist())
    # the 3 groups of 4 and "short" are shared; "long" (3 rows of 21) and "alone" are not: 3 + 1 + 3 + 1
    assert sorted(len(m) for _, m in units) == [1, 1, 1, 1, 2, 4, 4, 4]
    assert sum(sizes) == sum(lengths) - 3 * 3 * 15 - 10  # each shared group's prompt once
    ref_logp, ref_ent, ref_g = logprobs_and_grads(trainer.model, full)
    logp, ent, g = logprobs_and_grads(trainer.model, full, packed=True, prompt_lengths=full["prompt_length"], **kw)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    for name in ref_g:
        assert (g[name] - ref_g[name]).abs().max() <= 1e-5 * ref_g[name].abs().max(), name


def test_a_shared_prompt_layout_by_hand():
    from rft.trainer.logprobs import share_prompts

    # rows 0 and 2 share the prompt [5, 6, 7] (responses [8, 9] and [4]); row 1 has another prompt
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 3, 1, 0], [5, 6, 7, 4, 0]])
    packed, positions, mask, where = share_prompts(ids, [5, 4, 4], [3, 3, 3], torch.float32)
    # units: the group (3 + 2 + 1 = 6 tokens) and row 1 alone (4): first-fit in bins of 6
    assert packed.tolist() == [[5, 6, 7, 8, 9, 4], [5, 6, 3, 1, 0, 0]]
    # each response goes on from the prompt's length; the bin's unused end is a filler from 0
    assert positions.tolist() == [[0, 1, 2, 3, 4, 3], [0, 1, 2, 3, 0, 1]]
    # row r's token t sits at flat position where[r, t] (padding: 0, never read)
    assert where.tolist() == [[0, 1, 2, 3, 4], [6, 7, 8, 9, 0], [0, 1, 2, 5, 0]]
    sees = (mask[:, 0] == 0).int().tolist()
    assert sees[0] == [[1, 0, 0, 0, 0, 0],
                       [1, 1, 0, 0, 0, 0],
                       [1, 1, 1, 0, 0, 0],
                       [1, 1, 1, 1, 0, 0],   # row 0's response: the prompt and itself
                       [1, 1, 1, 1, 1, 0],
                       [1, 1, 1, 0, 0, 1]]   # row 2's response: the prompt, not row 0's response
    assert sees[1] == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0],
                       [0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 1, 1]]  # the filler sees only itself
    assert share_prompts(ids[:2], [5, 4], [3, 3], torch.float32) is None  # nothing shared: `pack` serves


def test_responses_sharing_a_prompt_never_attend_to_each_other(trainer):
    full = collate(batch(1, 3), trainer.tokenizer.pad_token_id)
    kw = dict(packed=True, prompt_lengths=full["prompt_length"])
    logp, _ = token_logprobs(trainer.model, full["input_ids"], full["attention_mask"], **kw)
    # row 0's response changed: it is laid out before rows 1 and 2's, whose log-probs stay put
    changed = full["input_ids"].clone()
    p, n0 = int(full["prompt_length"][0]), int(full["attention_mask"][0].sum())
    changed[0, p:n0] = torch.randint(7, 17, (n0 - p,))
    logp2, _ = token_logprobs(trainer.model, changed, full["attention_mask"], **kw)
    assert not torch.allclose(logp2[0, p - 1:n0 - 1], logp[0, p - 1:n0 - 1])
    torch.testing.assert_close(logp2[1:], logp[1:], rtol=0, atol=1e-6)


def test_prompts_are_shared_only_where_our_mask_is_what_attention_uses(trainer):
    from types import SimpleNamespace

    from rft.trainer.logprobs import can_share_prompts

    def model(**config):
        return SimpleNamespace(config=SimpleNamespace(**config))

    assert can_share_prompts(trainer.model)  # the tiny Qwen2: sdpa, no sliding window
    assert can_share_prompts(model(_attn_implementation="eager"))
    assert not can_share_prompts(model(_attn_implementation="flash_attention_2"))  # varlen: whole sequences
    assert not can_share_prompts(model(_attn_implementation="sdpa", sliding_window=4096))  # Mistral
    assert can_share_prompts(model(_attn_implementation="sdpa", sliding_window=4096, use_sliding_window=False))
    assert not can_share_prompts(model(_attn_implementation="sdpa", layer_types=["full_attention", "sliding_attention"]))


def test_a_train_step_with_shared_prompts_equals_one_without():
    from test_trainer import experiences

    exps = experiences(4, 8)
    for e in exps[:8]:
        e.reward = 1.0  # group 0: all rewards equal, its rows not forwarded
    shared, plain = make_trainer(128), make_trainer(128, ["trainer.share_prompts=false"])
    m_shared, m_plain = shared.train_step(exps), plain.train_step(exps)
    # the same gradient (compared, not the weights: Adam's first step is lr x the gradient's sign,
    # which float noise flips on entries near 0)
    for (name, a), (_, b) in zip(plain.model.named_parameters(), shared.model.named_parameters()):
        assert (b.grad - a.grad).abs().max() <= 1e-5 * a.grad.abs().max(), name
    assert m_shared["loss/policy"] == pytest.approx(m_plain["loss/policy"], abs=1e-6)
    # each forwarded group's 15-token prompt computed once instead of 8 times: 7 * 15 tokens saved
    # per group whose rewards differ (the others' rows are not forwarded: skip_zero_advantage)
    groups: dict = {}
    for e in exps:
        groups.setdefault(e.group_id, []).append(e)
    mixed = [g for g in groups.values() if len({e.reward for e in g}) > 1]
    assert len(mixed) == 3
    rows_tokens = sum(len(e.tokens) for g in mixed for e in g)
    assert m_shared["perf/shared_prompt_frac"] == pytest.approx(7 * 15 * len(mixed) / rows_tokens)
    assert m_plain["perf/shared_prompt_frac"] == 0.0
    assert 0.0 <= m_shared["perf/padding_frac"] < 1.0
