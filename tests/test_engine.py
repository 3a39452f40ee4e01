"""The hf rollout engine, experience collation and the weight fingerprint, on the tiny model."""

import math
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from rft.data.experience import Experience, collate
from rft.data.readers import encode_prompt
from rft.models import build_tiny_model, load_tokenizer
from rft.rollout.engines import hf
from rft.rollout.engines.hf import DrawOne, HFEngine, StopStrings, sdpa_grouped
from rft.sync.weights import fingerprint
from rft.trainer.trainer import token_logprobs


def tiny_engine_and_prompts(cache_dir, generate_batch_size: int, questions: list[str]):
    """The tiny model's HF engine and the questions' encoded prompts (also used by test_step_work)."""
    path = build_tiny_model(cache_dir / "models" / "tiny-qwen2-v2")
    model_cfg = OmegaConf.create(dict(model_path=str(path), dtype="float32", trust_remote_code=False,
                                      custom_chat_template=None, max_response_tokens=6))
    tok = load_tokenizer(model_cfg)
    engine = HFEngine(model_cfg, SimpleNamespace(generate_batch_size=generate_batch_size), tok)
    return tok, engine, [encode_prompt(tok, [{"role": "user", "content": q}], 24) for q in questions]


@pytest.fixture(scope="module")
def tiny(cache_dir):
    return tiny_engine_and_prompts(cache_dir, 5, ["123+456", "7+2", "000+000"])


def args(t, stop=()):
    return SimpleNamespace(temperature=t, top_p=1.0, top_k=-1, max_tokens=None, stop=list(stop))


def stop_cut(tok, ids, stop):
    """How many of `ids` the stop strings keep: up to the first token after which the decoded
    response contains one; None if none does. Decodes every prefix, unlike the engines."""
    for k in range(1, len(ids) + 1):
        if any(s in tok.decode(ids[:k], skip_special_tokens=True) for s in stop):
            return k
    return None


def test_tiny_model_is_an_hf_model_with_a_chat_template(tiny):
    tok, engine, prompts = tiny
    assert engine.model.config.model_type == "qwen2"
    assert engine.model.config.head_dim >= 32  # vLLM's CPU attention needs it
    text = tok.apply_chat_template([{"role": "user", "content": "1+2"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user1+2<|im_end|><|im_start|>assistant"
    # one token per character: "1+2" is three tokens between the role and <|im_end|>
    assert len(prompts[1]) == len(prompts[0]) - 4


def test_generate_shapes_and_finish_reasons(tiny):
    tok, engine, prompts = tiny
    out = engine.generate(prompts, n=4, args=args(1.0), seed=0)
    assert [len(g) for g in out] == [4, 4, 4]
    for group in out:
        for s in group:
            assert len(s.token_ids) == len(s.logprobs) >= 1
            if s.finish_reason == "stop":
                assert s.token_ids[-1] == tok.eos_token_id and tok.eos_token_id not in s.token_ids[:-1]
            else:
                assert s.finish_reason == "length" and len(s.token_ids) == 6


def test_seeded_sampling_is_reproducible_and_seeds_differ(tiny):
    _, engine, prompts = tiny
    ids = lambda out: [s.token_ids for g in out for s in g]
    a = engine.generate(prompts, 4, args(1.0), seed=3)
    assert ids(a) == ids(engine.generate(prompts, 4, args(1.0), seed=3))
    assert ids(a) != ids(engine.generate(prompts, 4, args(1.0), seed=4))


def test_generation_passes_the_kv_cache_by_the_name_this_transformers_takes(tiny):
    """transformers renamed past_key_values to cache; the old name warns on every generate there
    (hundreds of lines in a run's log). Shared prompts (n > 1) take the prefill path too."""
    import warnings

    from rft.rollout.engines.hf import cache_keyword

    tok, engine, prompts = tiny
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        groups = engine.generate(prompts, 4, args(1.0), seed=0)
    assert len(groups) == 3 and all(len(g) == 4 for g in groups)
    assert cache_keyword(engine.model) in ("cache", "past_key_values")


def test_generation_computes_the_output_layer_for_one_position_per_row(tiny):
    """Neither the shared prefill nor a step computes logits for every position: at a real
    vocabulary that is [rows, prompt tokens, 151,936] for a prefill that only fills the KV cache.
    The output layer sees one position per row in every call, for n = 1 and n = 4 (prefill path)."""
    tok, engine, prompts = tiny
    head, shapes = engine.model.get_output_embeddings(), []
    hook = head.register_forward_hook(lambda module, inputs, output: shapes.append(tuple(inputs[0].shape[:2])))
    try:
        for n in (1, 4):
            engine.generate(prompts, n, args(1.0), seed=0)
    finally:
        hook.remove()
    # generate_batch_size 5: n=1 -> the 3 prompts in one chunk, 3 rows a step; n=4 -> one prompt
    # a chunk (5 // 4), its prefill (1 row), then its 4 samples (4 rows a step)
    assert set(shapes) == {(3, 1), (1, 1), (4, 1)}


def test_sampling_logprobs_match_the_trainers_recomputation(tiny):
    """The engine's sampling log-probs equal the trainer's forward pass on the same tokens."""
    tok, engine, prompts = tiny
    for t in (1.0, 0.7):
        out = engine.generate(prompts, 2, args(t), seed=1)
        exps = [Experience(p + s.token_ids, len(p), s.logprobs) for p, g in zip(prompts, out) for s in g]
        batch = collate(exps, tok.pad_token_id)
        with torch.no_grad():
            logp, _ = token_logprobs(engine.model, batch["input_ids"], batch["attention_mask"], temperature=t)
        for i, e in enumerate(exps):
            got = logp[i][batch["response_mask"][i].bool()]
            torch.testing.assert_close(got, torch.tensor(e.logprobs), atol=1e-4, rtol=1e-4)


def engine_memory_benchmark():
    """experiments/engine_memory/benchmark.py as a module: its kept-scores engine (the engine as it
    was before it recorded one step at a time) is the reference the recorder is checked against."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "experiments" / "engine_memory" / "benchmark.py"
    spec = importlib.util.spec_from_file_location("engine_memory_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("block", [2, 3, 4096])
def test_draw_one_samples_the_processed_distribution(monkeypatch, block):
    """DrawOne (one uniform per row, looked up in the float64 cumulative distribution) draws each
    token as often as its probability says, never one of probability 0, and leaves the drawn token
    the only one possible for generate's greedy step."""
    monkeypatch.setattr(DrawOne, "block", block)  # blocks of 2 and 3 entries, and one of the 7
    torch.manual_seed(0)
    probs = torch.tensor([0.0, 0.5, 0.25, 0.0, 0.15, 0.1, 0.0])  # zeros first, inside and last
    rows = 200_000
    out = DrawOne()(None, probs.log().expand(rows, -1).contiguous())
    assert ((out == 0).sum(1) == 1).all() and torch.isinf(out).sum() == rows * 6
    counts = torch.bincount(out.argmax(1), minlength=7)
    assert counts[[0, 3, 6]].tolist() == [0, 0, 0]
    for token, p in enumerate(probs.tolist()):
        sigma = math.sqrt(rows * p * (1 - p))  # binomial; p = 0.5: 224 of 100,000
        assert abs(counts[token].item() - rows * p) <= 5 * sigma


@pytest.mark.parametrize("block", [2, 3, 4096])
@pytest.mark.parametrize("u,token", [(0.0, 1), (1.0, 1), (0.25, 2), (0.5, 4), (0.75, 5)])
def test_draw_one_at_the_edges_of_the_uniform(monkeypatch, u, token, block):
    """Four tokens of probability 1/4 (logits 0: exact in float32), zero-probability ones first,
    inside and last. Cumulative: 0, .25, .5, .5, .75, 1, 1. u = 0: the first token of non-zero
    probability, not the one before it; u = .5 falls past token 2's end (right=True) and token 3
    has probability 0: token 4; u * total rounded up to the total (u = 1 here): the most likely
    token (the first of the four), not a zero-probability one after the last, nor one past the
    vocabulary. In blocks of 2 the block sums are .25 each (cumulative .25, .5, .75, 1): u = .5
    falls in the third block, tokens 4 and 5; in blocks of 3 (.5, .5, 0) in the second, 3 to 5."""
    monkeypatch.setattr(DrawOne, "block", block)
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.full(shape, u, dtype=kw["dtype"]))
    inf = float("inf")
    logits = torch.tensor([[-inf, 0.0, 0.0, -inf, 0.0, 0.0, -inf]])
    assert DrawOne()(None, logits).argmax(1).item() == token


def test_grouped_query_attention_takes_the_heads_as_they_are(cache_dir, tmp_path, tiny):
    """On CPU the engine's attention is sdpa_grouped: with a padding mask and 2 query heads per
    key/value head, the same samples as transformers' sdpa (which repeats the keys and values),
    bit for bit, and without calling the repeat."""
    from transformers.integrations import sdpa_attention

    tok, _, prompts = tiny
    path = build_tiny_model(tmp_path / "gqa", arch=dict(num_attention_heads=4, num_key_value_heads=2))
    cfg = OmegaConf.create(dict(model_path=str(path), dtype="float32", trust_remote_code=False,
                                custom_chat_template=None, max_response_tokens=12))
    grouped = HFEngine(cfg, SimpleNamespace(generate_batch_size=64), tok)
    stock = HFEngine(cfg, SimpleNamespace(generate_batch_size=64), tok)
    stock.model.set_attn_implementation("sdpa")
    assert grouped.model.config._attn_implementation == "rft_sdpa_grouped"
    repeats = []
    real = sdpa_attention.repeat_kv
    sdpa_attention.repeat_kv = lambda h, n: repeats.append(n) or real(h, n)
    try:
        new = grouped.generate(prompts, 4, args(1.0), seed=3)
        assert repeats == []  # prefill and decode: no key/value head repeated
        old = stock.generate(prompts, 4, args(1.0), seed=3)
        assert repeats and set(repeats) == {2}  # the stock path repeats each for its 2 query heads
    finally:
        sdpa_attention.repeat_kv = real
    assert [[(x.token_ids, x.logprobs) for x in g] for g in new] == [[(x.token_ids, x.logprobs) for x in g] for g in old]
    assert len({len(p) for p in prompts}) > 1  # left padding: a mask at every step


def test_a_cache_written_in_place_samples_what_the_concatenated_one_does(tiny, monkeypatch):
    """The shared prefill's cache reserved for prompt + new tokens (ReservedLayer, written in place
    and read as views) gives the samples of DynamicLayer's concatenation bit for bit; a layer
    past its capacity goes on by concatenation (the capacity here leaves room for 3 tokens)."""
    tok, engine, prompts = tiny
    a = args(1.0)
    want = engine.generate(prompts, 3, a, seed=4)
    real = hf.reserve
    layers = []

    def spy(cache, capacity):
        real(cache, capacity)
        layers.extend(cache.layers)

    monkeypatch.setattr(hf, "reserve", spy)
    assert engine.generate(prompts, 3, a, seed=4) == want
    reserved = [layer for layer in layers if type(layer).__name__ == "ReservedLayer"]
    # a cache per chunk of generate_batch_size 5 rows: one group of 3 each, 3 prompts
    assert len(reserved) == len(layers) == 3 * engine.model.config.num_hidden_layers
    # views of the reserved tensors: the prompt but its last token, then 1 + 5 fed back, of 6 new
    assert all(layer.keys.data_ptr() == layer._keys.data_ptr() for layer in reserved)
    assert reserved[0]._keys.shape[-2] == max(len(p) for p in prompts) + 6
    # a cache's layers are views of one allocation (one per cache: 3 chunks)
    assert len({layer._keys.untyped_storage().data_ptr() for layer in reserved}) == 3
    monkeypatch.setattr(hf, "reserve", lambda cache, capacity: real(cache, capacity - 6 + 3))
    layers.clear()
    assert engine.generate(prompts, 3, a, seed=4) == want
    assert all(layer.keys.shape[-2] > layer._keys.shape[-2] for layer in layers)  # it went past


def test_reserve_puts_layers_of_one_shape_in_one_block_and_others_each_in_their_own():
    from transformers.cache_utils import DynamicCache, DynamicLayer

    def cache(*heads):
        c = DynamicCache()
        c.layers = [DynamicLayer() for _ in heads]
        for layer, h in zip(c.layers, heads):  # 2 rows, h key/value heads, 3 tokens, head dim 4
            layer.update(torch.randn(2, h, 3, 4), torch.randn(2, h, 3, 4))
        return c

    same, mixed = cache(2, 2, 2), cache(2, 1)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in same.layers + mixed.layers]
    hf.reserve(same, 5)
    hf.reserve(mixed, 5)
    layers = same.layers + mixed.layers
    assert all(type(layer).__name__ == "ReservedLayer" for layer in layers)
    # block [3 layers, keys and values, 2, 2, 5, 4]: layer j's keys start j x 2 x 80 elements in
    assert [layer._keys.storage_offset() for layer in same.layers] == [0, 160, 320]
    assert len({layer._keys.untyped_storage().data_ptr() for layer in same.layers}) == 1
    assert len({layer._keys.untyped_storage().data_ptr() for layer in mixed.layers}) == 2
    for layer, (k, v) in zip(layers, before):
        assert layer._keys.shape[-2] == 5 and torch.equal(layer.keys, k) and torch.equal(layer.values, v)
        new_k = torch.randn(2, k.shape[1], 1, 4)
        keys, _ = layer.update(new_k, new_k)
        assert torch.equal(keys, torch.cat([k, new_k], -2)) and keys.data_ptr() == layer._keys.data_ptr()


def test_sdpa_grouped_equals_the_repeated_heads():
    """Attention of one new token over 9 cached ones, the first 3 masked out (left padding), 6
    query heads over 2 key/value heads, and a prefill of 5 queries with a causal-and-padding mask:
    equal to sdpa over keys and values repeated 3 times."""
    torch.manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    for q_len, kv_len in [(1, 9), (5, 5)]:
        q, k, v = torch.randn(2, 6, q_len, 8), torch.randn(2, 2, kv_len, 8), torch.randn(2, 2, kv_len, 8)
        mask = torch.ones(2, 1, q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
        mask[1, :, :, :3] = False
        mask[1, :, :, -1] = True  # every query of row 1 sees at least one key
        out, _ = sdpa_grouped(module, q, k, v, mask)
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=mask)
        assert out.shape == (2, q_len, 6, 8)
        torch.testing.assert_close(out, want.transpose(1, 2), rtol=0, atol=1e-6)


@pytest.mark.parametrize("temperature,top_p,top_k,stop", [
    (0.0, 1.0, -1, ()),         # greedy
    (1.0, 1.0, -1, ()),         # plain sampling
    (0.7, 1.0, -1, ()),         # temperature
    (1.0, 0.8, -1, ()),         # top-p
    (1.3, 0.9, 5, ()),          # top-k then top-p, at a temperature
    (1.2, 1.0, -1, ("1", "a")),  # stop strings
])
@pytest.mark.slow  # 3.8 s alone, over the fast tier's second
def test_sampled_logprobs_equal_those_of_the_kept_scores(cache_dir, tiny, temperature, top_p, top_k, stop):
    """The recorder (one step's log-softmax at a time) samples the same tokens as the engine that
    kept every step's scores (generate's output_scores, compute_transition_scores), with the same log-probs to float32 rounding: per step, log_softmax
    runs over a contiguous [rows, vocabulary] row; compute_transition_scores runs it over a strided
    [rows, vocabulary, steps] view, summing in another order (measured: at most 9.5e-7 apart, and
    both within 1e-6 of the float64 log-softmax of the same scores)."""
    tok, _, _ = tiny
    prompts = tiny_engine_and_prompts(cache_dir, 64, ["123+456", "7+2", "000+000", "98765+1", "3*4-5"])[2]
    cfg = OmegaConf.create(dict(model_path=str(cache_dir / "models" / "tiny-qwen2-v2"), dtype="float32",
                                trust_remote_code=False, custom_chat_template=None, max_response_tokens=24))
    kept_scores = engine_memory_benchmark().kept_scores_engine()
    engine, kept = (cls(cfg, SimpleNamespace(generate_batch_size=64), tok) for cls in (HFEngine, kept_scores))
    a = SimpleNamespace(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=None, stop=list(stop))
    for n in (1, 4):
        new, old = engine.generate(prompts, n, a, seed=5), kept.generate(prompts, n, a, seed=5)
        pairs = [(x, y) for g, h in zip(new, old) for x, y in zip(g, h)]
        assert [(x.token_ids, x.finish_reason) for x, _ in pairs] == [(y.token_ids, y.finish_reason) for _, y in pairs]
        assert {y.finish_reason for _, y in pairs} >= ({"stop"} if stop else {"length"})
        sequences, scores = kept.scores
        exact = kept.model.compute_transition_scores(sequences, tuple(s.double() for s in scores), normalize_logits=True)
        for i, (x, y) in enumerate(pairs):
            assert x.logprobs == pytest.approx(y.logprobs, abs=2e-6, rel=0)
            assert x.logprobs == pytest.approx(exact[i, :len(x.logprobs)].tolist(), abs=1e-6, rel=0)
            assert all(lp <= 0 for lp in x.logprobs)
        if temperature == 0:  # greedy: each token is the most likely, so at least 1/vocabulary likely
            assert min(lp for x, _ in pairs for lp in x.logprobs) >= -math.log(len(tok))


def test_a_checkpoints_generation_config_does_not_change_the_rollouts(cache_dir, tmp_path, tiny):
    """generate() filled what it was not given (top_k when off, the repetition penalty) from the
    checkpoint's generation_config.json: with top_k 1 there, every sampled token had log-prob 0
    (one token left), whatever rollout_args said."""
    import json
    import shutil

    tok, engine, prompts = tiny
    src = cache_dir / "models" / "tiny-qwen2-v2"
    dst = tmp_path / "tiny-with-generation-config"
    shutil.copytree(src, dst)
    config = json.loads((dst / "generation_config.json").read_text())
    (dst / "generation_config.json").write_text(json.dumps({**config, "top_k": 1, "repetition_penalty": 5.0}))
    model_cfg = OmegaConf.create(dict(model_path=str(dst), dtype="float32", trust_remote_code=False,
                                      custom_chat_template=None, max_response_tokens=6))
    other = HFEngine(model_cfg, SimpleNamespace(generate_batch_size=5), tok)
    want, got = engine.generate(prompts, 2, args(1.0), seed=3), other.generate(prompts, 2, args(1.0), seed=3)
    assert [[s.token_ids for s in g] for g in got] == [[s.token_ids for s in g] for g in want]
    assert [[s.logprobs for s in g] for g in got] == [[s.logprobs for s in g] for g in want]
    assert any(lp < -1e-3 for g in got for s in g for lp in s.logprobs)  # not one token left


def test_a_stop_string_ends_a_greedy_response_right_after_it(tiny):
    tok, engine, prompts = tiny
    base = engine.generate(prompts, 1, args(0), seed=0)
    ids, logprobs = base[0][0].token_ids, base[0][0].logprobs
    text = tok.decode(ids, skip_special_tokens=True)
    first = len(tok.decode(ids[:1], skip_special_tokens=True))
    # the response's 2nd-3rd characters, and four across the boundary of its first two tokens
    for stop in (text[1:3], text[first - 1 : first + 3]):
        k = stop_cut(tok, ids, [stop])
        assert k is not None and k < len(ids)  # the premise: the stop string cuts the response
        s = engine.generate(prompts, 1, args(0, [stop]), seed=0)[0][0]
        assert s.token_ids == ids[:k] and s.finish_reason == "stop", (stop, s)
        assert stop in tok.decode(s.token_ids, skip_special_tokens=True)
        # one log-prob per kept token, those of the uncut response
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(logprobs[:k]))


def test_a_stop_string_ending_inside_a_token_keeps_the_whole_token(tiny):
    tok, _, prompts = tiny
    p = prompts[0]
    # "assistant" is a single token of the tiny vocabulary (a role name); the others are characters
    rows = [["a", "assistant", "b"], ["x", "s", "s"], ["a", "b", "c"]]
    ids = torch.tensor([p + tok.convert_tokens_to_ids(r) for r in rows])
    stops = StopStrings(tok, [p] * 3, ["ss"], len(p))
    done = [stops(ids[:, : len(p) + n], None).tolist() for n in (1, 2, 3)]  # as generate calls it
    assert done == [[False, False, False], [True, False, False], [True, True, False]]
    assert stops.ends == [2, 3, None]


def test_stop_strings_end_sampled_responses(tiny):
    tok, engine, prompts = tiny
    stop = list("0123456789") + ["ss"]
    out = engine.generate(prompts, 4, args(1.0, stop), seed=0)
    kinds = set()
    for group in out:
        for s in group:
            assert len(s.token_ids) == len(s.logprobs) >= 1
            assert tok.eos_token_id not in s.token_ids[:-1]
            k = stop_cut(tok, s.token_ids, stop)
            if k is not None:  # a stop string, completed by the last token and by no earlier one
                assert k == len(s.token_ids) and s.finish_reason == "stop", (tok.decode(s.token_ids), s)
                kinds.add("stop string")
            elif s.token_ids[-1] == tok.eos_token_id:
                assert s.finish_reason == "stop"
                kinds.add("eos")
            else:
                assert s.finish_reason == "length" and len(s.token_ids) == 6
                kinds.add("length")
    # the fixed seed gives samples cut by a stop string and samples of full length, so both
    # branches ran (the untrained model rarely samples eos)
    assert {"stop string", "length"} <= kinds, kinds


def test_collate_masks_exactly_the_response_targets():
    # tokens [5, 6, 7 | 8, 9] (prompt of 3) and [5 | 6] (prompt of 1), pad 0
    b = collate([Experience([5, 6, 7, 8, 9], 3, [0.0, 0.0]), Experience([5, 6], 1, [0.0])], pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9], [5, 6, 0, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    # targets are input_ids[:, 1:] = [6, 7, 8, 9] and [6, 0, 0, 0]: responses are 8, 9 and 6
    assert b["response_mask"].tolist() == [[0, 0, 1, 1], [1, 0, 0, 0]]


def test_fingerprint_catches_a_changed_weight(tiny):
    _, engine, _ = tiny
    sd = {k: v.clone() for k, v in engine.model.state_dict().items()}
    before = fingerprint(sd)
    assert fingerprint({k: v.clone() for k, v in sd.items()}) == before
    name = next(iter(sd))
    sd[name].view(-1)[0] += 1e-3
    assert fingerprint(sd) != before
    # the lowest bit of one element
    sd[name].view(-1)[0] -= 1e-3
    after = fingerprint(sd)
    sd[name].view(-1).view(torch.int32 if sd[name].element_size() == 4 else torch.int16)[1] ^= 1
    assert fingerprint(sd) != after


def test_for_safetensors_clones_tied_tensors_and_makes_them_contiguous():
    from safetensors.torch import load, save

    from rft.sync.weights import for_safetensors

    emb = torch.arange(6.0).reshape(2, 3)
    sd = {"embed.weight": emb, "lm_head.weight": emb, "proj.weight": torch.arange(6.0).reshape(3, 2).T}
    with pytest.raises(RuntimeError):  # what the function is for: shared storage is refused
        save(sd)
    out = for_safetensors(sd)
    assert out["embed.weight"] is emb  # the first occurrence is kept as it is
    assert out["lm_head.weight"].data_ptr() != emb.data_ptr() and torch.equal(out["lm_head.weight"], emb)
    assert out["proj.weight"].is_contiguous() and torch.equal(out["proj.weight"], sd["proj.weight"])
    assert {k: v.tolist() for k, v in load(save(out)).items()} == {k: v.tolist() for k, v in sd.items()}


def test_chat_ids_remembers_prompts_but_never_serves_stale_ones(tiny, monkeypatch):
    import rft.data.readers as data

    tok = tiny[0]
    msgs = [{"role": "user", "content": "042+315"}]
    render = tok.apply_chat_template
    plain = lambda m: list(render(m, tokenize=True, add_generation_prompt=True)["input_ids"])  # noqa: E731
    first = data.chat_ids(tok, msgs)
    assert first == plain(msgs)
    first.append(-1)  # the caller's list is its own: the cache is not changed through it
    rendered = []

    def counted(c, **k):  # records how many conversations each call rendered
        batched = isinstance(c[0], list)
        rendered.append(len(c) if batched else 1)
        return [plain(m) for m in c] if batched else plain(c)

    monkeypatch.setattr(tok, "apply_chat_template", counted)
    assert data.chat_ids(tok, msgs) == plain(msgs) and rendered == []  # remembered: not rendered again
    assert data.chat_ids(tok, [{"role": "user", "content": "042+316"}]) == plain([{"role": "user", "content": "042+316"}])
    assert rendered == [1]
    # a step's prompts: the ones not seen lately in one call, in order among the remembered ones
    step = [[{"role": "user", "content": q}] for q in ("9+9", "042+315", "8+8")]
    assert data.prompt_ids(tok, step) == [plain(m) for m in step]
    assert rendered == [1, 2]
    # another template renders again (the key holds the template)
    monkeypatch.setattr(tok, "chat_template", (tok.chat_template or "") + "{# changed #}")
    data.chat_ids(tok, msgs)
    assert rendered == [1, 2, 1]
    # past _PROMPTS_KEPT tokens the least recently used prompts go (room for exactly two of them)
    q = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    monkeypatch.setattr(data, "_PROMPTS_KEPT", len(plain(q("3+3"))) + len(plain(q("1+1"))))
    data._PROMPT_IDS.pop(tok)
    for text in ("1+1", "2+2", "3+3", "1+1"):
        data.chat_ids(tok, q(text))
    cache = data._PROMPT_IDS[tok]
    assert [k[1] for k in cache.items] == [data.json.dumps(q(text), sort_keys=True) for text in ("3+3", "1+1")]
    assert cache.tokens == sum(len(v) for v in cache.items.values())


def test_the_engine_memory_benchmarks_floor_by_hand():
    bench = engine_memory_benchmark()
    qwen = SimpleNamespace(num_hidden_layers=24, num_key_value_heads=2, head_dim=64, hidden_size=896,
                           num_attention_heads=14)
    # Qwen2.5-0.5B in bfloat16: 24 layers x (key + value) x 2 heads x 64 x 2 bytes = 12,288 bytes a
    # token; 32 rows x (24 prompt + 1,024 new) tokens = 33,536 tokens -> 412,090,368 bytes (393 MB)
    assert bench.kv_bytes(qwen, 32, 24 + 1024, 2) == 12288 * 33536 == 412_090_368
    # head_dim absent: hidden_size / heads (896 / 14 = 64), the same
    assert bench.kv_bytes(SimpleNamespace(**{**vars(qwen), "head_dim": None}), 32, 1048, 2) == 412_090_368
    # kept scores: 3 x 32 x 128 x 151,936 x 4 bytes = 49,152 x 151,936 = 7,467,958,272 (6.96 GiB)
    assert bench.kept_scores_bytes(32, 128, 151936) == 7_467_958_272
    rows = [dict(shape="0.5b", arm="sampled", length=128, step_mb=160.0, kv_mb=53.25, weights_mb=942.3,
                 peak_mb=1566.9, seconds=46.1), dict(shape="0.5b", arm="kept-scores", length=512, skipped="~28 GB")]
    table = bench.table(rows).splitlines()
    # 160 / 53.25 = 3.00
    assert table[2] == "| 0.5b | sampled | 128 | 160 | 53 | 3.00 | 942 | 1567 | 46.1 |"
    assert table[3].startswith("| 0.5b | kept-scores | 512 | skipped: ~28 GB |")


def test_the_heap_is_trimmed_every_16_decode_steps_on_cpu(tiny, monkeypatch):
    """TrimHeap changes no score and calls malloc_trim every 16th step; the CPU engine has one."""
    import rft.rollout.engines.hf as hf

    tok, engine, prompts = tiny
    assert hf.malloc_trim() is not None  # glibc
    assert [type(t) for t in engine._trim] == [hf.TrimHeap]
    trims = []
    monkeypatch.setattr(hf, "malloc_trim", lambda: trims.append)
    trim, scores = hf.TrimHeap(), torch.randn(2, 5)
    assert all(trim(None, scores) is scores for _ in range(40))
    assert trims == [0, 0]  # at calls 16 and 32 of 40
