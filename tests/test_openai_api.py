"""The explorer's OpenAI-compatible endpoint (rft/serving/openai_api.py) and the openai_agent workflow:
the official `openai` client against a real server (uvicorn on 127.0.0.1) on the tiny model."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import openai
import pytest
from omegaconf import OmegaConf

from rft.data.chat import render
from rft.data.tasks import Task
from rft.errors import ConfigError
from rft.models import build_tiny_model, load_tokenizer
from rft.rewards.scoring import Reward
from rft.rollout.engines.hf import HFEngine
from rft.rollout.workflows.single_turn import WorkflowContext
from rft.rollout.workflows.openai_agent import experiences_of, openai_agent
from rft.serving.openai_api import ROLLOUT_HEADER, Call, OpenAIServer

ARGS = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=6, stop=[])
MESSAGES = [{"role": "user", "content": "12+34"}]


def engine_for(path):
    cfg = OmegaConf.create(dict(model_path=str(path), dtype="float32", trust_remote_code=False,
                                custom_chat_template=None, max_response_tokens=6))
    tok = load_tokenizer(cfg)
    return HFEngine(cfg, SimpleNamespace(generate_batch_size=64), tok), tok


@pytest.fixture(scope="module")
def served(cache_dir, tmp_path_factory):
    engine, tok = engine_for(build_tiny_model(cache_dir / "models" / "tiny-qwen2-v2"))
    judge, judge_tok = engine_for(build_tiny_model(tmp_path_factory.mktemp("judge") / "m", seed=1))
    server = OpenAIServer({"policy": (engine, tok), "judge": (judge, judge_tok)}, "policy", ARGS, 6).start()
    yield server, engine, tok
    server.stop()


def client(server, **kw):
    return openai.OpenAI(base_url=server.url, api_key=kw.pop("api_key", server.token), max_retries=0, **kw)


def test_the_client_gets_exactly_what_the_engine_samples_with_the_same_seed(served):
    server, engine, tok = served
    server.open("", ARGS)  # calls without a rollout header are recorded under ""
    reply = client(server).chat.completions.create(model="policy", messages=MESSAGES, n=2, seed=7, logprobs=True)
    calls = server.take_history("")
    prompt = render(tok, MESSAGES, generation_prompt=True)
    direct = engine.generate([prompt], 2, ARGS, seed=7)[0]
    assert [c.token_ids for c in calls] == [s.token_ids for s in direct]
    assert [c.logprobs for c in calls] == [s.logprobs for s in direct]
    assert all(c.prompt_ids == prompt for c in calls)
    assert [ch.message.content for ch in reply.choices] == [tok.decode(s.token_ids, skip_special_tokens=True) for s in direct]
    assert [lp.logprob for lp in reply.choices[0].logprobs.content] == direct[0].logprobs
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == sum(len(s.token_ids) for s in direct)
    # /v1/completions: a text prompt (encoded without the chat template) and a prompt of ids
    server.open("", ARGS)
    text = client(server).completions.create(model="policy", prompt="12+34=", seed=3, max_tokens=4)
    ids = tok.encode("12+34=", add_special_tokens=False)
    [s] = engine.generate([ids], 1, SimpleNamespace(**{**vars(ARGS), "max_tokens": 4}), seed=3)[0]
    assert text.choices[0].text == tok.decode(s.token_ids, skip_special_tokens=True)
    by_ids = client(server).completions.create(model="policy", prompt=ids, seed=3, max_tokens=4)
    assert by_ids.choices[0].text == text.choices[0].text
    assert [c.token_ids for c in server.take_history("")] == [s.token_ids, s.token_ids]


def test_the_token_is_required_and_the_server_listens_on_loopback(served):
    server, _, _ = served
    server.open("", ARGS)
    assert server.url.startswith("http://127.0.0.1:") and server.server.config.host == "127.0.0.1"
    r = httpx.post(server.url + "/chat/completions", json={"messages": MESSAGES})
    assert r.status_code == 401 and r.json()["error"]["message"].startswith("refused: no Authorization header")
    r = httpx.post(server.url + "/chat/completions", json={"messages": MESSAGES}, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["message"].startswith("refused: a wrong token")
    with pytest.raises(openai.AuthenticationError):
        client(server, api_key="nope").chat.completions.create(model="policy", messages=MESSAGES)
    with pytest.raises(openai.NotFoundError, match=r"model 'gpt-4' is not served here; the models are \['judge', 'policy'\]"):
        client(server).chat.completions.create(model="gpt-4", messages=MESSAGES)
    assert server.take_history("") == []  # nothing refused was sampled


def test_an_auxiliary_model_is_served_and_not_recorded(served):
    server, engine, tok = served
    server.open("", ARGS)
    reply = client(server).chat.completions.create(model="judge", messages=MESSAGES, seed=7)
    assert reply.model == "judge" and server.take_history("") == []
    server.open("", ARGS)
    policy = client(server).chat.completions.create(model="policy", messages=MESSAGES, seed=7)
    # another model (built with seed 1): other weights, another answer to the same seeded request
    assert reply.choices[0].message.content != policy.choices[0].message.content
    assert len(server.take_history("")) == 1  # the policy's call alone


# ---------------------------------------------------------------- what a request may ask

def post(server, path, body, token=None):
    return httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {token or server.token}"})


def assert_refused(r, status, param, message):
    assert r.status_code == status, r.text
    assert r.json() == {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": status}}


CHAT = {"model": "policy", "messages": MESSAGES}


@pytest.mark.parametrize("field,value,param,message", [
    # measured at 0ef6a02: n=1,000,000 and max_tokens=1e9 were passed to the engine
    ("n", 1_000_000, "n", "n: Input should be less than or equal to 128 (got 1000000)"),
    ("n", 0, "n", "n: Input should be greater than or equal to 1 (got 0)"),
    # the tiny model's budget is model.max_response_tokens = 6 here
    ("max_tokens", 10**9, "max_tokens", "max_tokens=1000000000 is over this model's budget of 6 new tokens "
                                        "(model.max_response_tokens)"),
    ("max_completion_tokens", 7, "max_tokens", "max_tokens=7 is over this model's budget of 6 new tokens "
                                               "(model.max_response_tokens)"),
    ("max_tokens", 0, "max_tokens", "max_tokens: Input should be greater than or equal to 1 (got 0)"),
    ("temperature", "hot", "temperature", "temperature: Input should be a valid number (got hot)"),
    ("temperature", 3, "temperature", "temperature: Input should be less than or equal to 2 (got 3)"),
    ("top_p", 0, "top_p", "top_p: Input should be greater than 0 (got 0)"),
    ("top_k", -2, "top_k", "top_k: Input should be greater than or equal to -1 (got -2)"),
    ("seed", "7", "seed", "seed: Input should be a valid integer (got 7)"),
    ("n", True, "n", "n: Input should be a valid integer (got True)"),
    ("stop", ["a", "b", "c", "d", "e"], "stop", "stop: List should have at most 4 items after validation, not 5 "
                                                "(got ['a', 'b', 'c', 'd', 'e'])"),
    ("stop", [1], "stop", "stop[0]: Input should be a valid string (got 1)"),
    # "" is in every text: each completion ended after its first token, silently (as the plan refuses
    # it in rollout_args.stop)
    ("stop", "", "stop", "stop[0]: String should have at least 1 character (got )"),
    ("stop", ["\n", ""], "stop", "stop[1]: String should have at least 1 character (got )"),
    # a stop string of any length was taken (the engine searches each after every token): 256 as rollout_args.stop
    ("stop", ["\n", "ab" * 200], "stop", "stop[1]: String should have at most 256 characters (got " + "ab" * 50 + ")"),  # got: 100 chars
    ("messages", [], "messages", "messages: List should have at least 1 item after validation, not 0 (got [])"),
    ("messages", "hi", "messages", "messages: Input should be a valid list (got hi)"),
    ("messages", [{"content": "hi"}], "messages", "messages[0].role: Field required (got {'content': 'hi'})"),
    ("model", ["policy"], "model", "model: Input should be a valid string (got ['policy'])"),
    ("logprobs", 3, "logprobs", "logprobs: Input should be a valid boolean (got 3)"),
    # measured before the fix: top_logprobs was ignored, any value, and each token's list came back empty
    ("top_logprobs", 5, "top_logprobs", "top_logprobs=5: this endpoint returns the log-prob of each sampled token "
                                        "only, not the most likely alternatives; send top_logprobs=0 or leave it out"),
    ("top_logprobs", 21, "top_logprobs", "top_logprobs: Input should be less than or equal to 20 (got 21)"),
    ("top_logprobs", -1, "top_logprobs", "top_logprobs: Input should be greater than or equal to 0 (got -1)"),
    # sampling the endpoint does not apply was ignored (200, sampled without it, the call recorded as
    # if asked for): an agent's presence_penalty=0.5 got text sampled without the penalty
    ("presence_penalty", 0.5, "presence_penalty", "presence_penalty=0.5: this endpoint samples by temperature, "
     "top_p, top_k and seed only (the trainer recomputes each token's log-prob under those); leave presence_penalty "
     "out or send its neutral value"),
    ("frequency_penalty", -1.0, "frequency_penalty", "frequency_penalty=-1.0: this endpoint samples by temperature, "
     "top_p, top_k and seed only (the trainer recomputes each token's log-prob under those); leave frequency_penalty "
     "out or send its neutral value"),
    ("repetition_penalty", 1.2, "repetition_penalty", "repetition_penalty=1.2: this endpoint samples by temperature, "
     "top_p, top_k and seed only (the trainer recomputes each token's log-prob under those); leave repetition_penalty "
     "out or send its neutral value"),
    ("min_p", 0.1, "min_p", "min_p=0.1: this endpoint samples by temperature, top_p, top_k and seed only (the "
     "trainer recomputes each token's log-prob under those); leave min_p out or send its neutral value"),
    ("logit_bias", {"50256": -100}, "logit_bias", "logit_bias={'50256': -100.0}: this endpoint samples by "
     "temperature, top_p, top_k and seed only (the trainer recomputes each token's log-prob under those); leave "
     "logit_bias out or send its neutral value"),
    ("presence_penalty", 3.0, "presence_penalty", "presence_penalty: Input should be less than or equal to 2 (got 3.0)"),
])
def test_a_field_out_of_range_is_a_400_naming_it_and_nothing_is_sampled(served, field, value, param, message):
    server, _, _ = served
    server.open("", ARGS)
    assert_refused(post(server, "/chat/completions", {**CHAT, field: value}), 400, param, message)
    assert server.take_history("") == []


def test_the_neutral_values_clients_send_by_default_are_accepted(served):
    # OpenAI's clients (and frameworks on them) send presence/frequency_penalty 0 and logit_bias {}
    server, _, _ = served
    neutral = {"presence_penalty": 0.0, "frequency_penalty": 0, "repetition_penalty": 1.0, "min_p": 0.0,
               "logit_bias": {}}
    assert post(server, "/chat/completions", {**CHAT, **neutral}).status_code == 200
    assert post(server, "/completions", {"prompt": "12+34", **neutral}).status_code == 200


def test_completions_asking_for_the_likeliest_alternatives_is_a_400(served):
    # measured before the fix: logprobs=3 came back 200 with "top_logprobs": null
    server, _, _ = served
    assert_refused(post(server, "/completions", {"prompt": "12+34", "logprobs": 3}), 400, "logprobs",
                   "logprobs=3: this endpoint returns the log-prob of each sampled token only, not the most likely "
                   "alternatives; send logprobs=0 or leave it out")
    assert post(server, "/completions", {"prompt": "12+34", "logprobs": 0}).status_code == 200


def test_a_body_that_is_not_an_object_or_not_json_is_a_400(served):
    server, _, _ = served
    # measured at 0ef6a02: a JSON list was a 500 ('list' object has no attribute 'get')
    for body, got in [(b'[{"messages": []}]', "list"), (b'"hello"', "str"), (b"null", "NoneType")]:
        r = httpx.post(server.url + "/chat/completions", content=body,
                       headers={"Authorization": f"Bearer {server.token}"})
        assert_refused(r, 400, "body", f"the request body must be a JSON object, not {got}")
    r = httpx.post(server.url + "/chat/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {server.token}"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("malformed JSON: Expecting property name")
    r = httpx.post(server.url + "/chat/completions", content=b"[" * 100_000,
                   headers={"Authorization": f"Bearer {server.token}"})
    assert_refused(r, 400, "body", "malformed JSON: maximum recursion depth exceeded while decoding a JSON array from a "
                            "unicode string")
    # NaN is JSON to Python's reader, not a temperature
    r = httpx.post(server.url + "/chat/completions", content=b'{"messages": [{"role": "user", "content": "1"}], '
                   b'"temperature": NaN}', headers={"Authorization": f"Bearer {server.token}"})
    assert_refused(r, 400, "temperature", "temperature: Input should be a finite number (got nan)")


def test_a_prompt_id_outside_the_vocabulary_or_the_context_is_a_400_before_the_engine(served, monkeypatch):
    server, engine, tok = served
    # the engine is never called: an id past the embedding would be a device assert on CUDA
    monkeypatch.setattr(engine, "generate", lambda *a, **k: pytest.fail("the engine was called"))
    vocab = len(tok)
    for bad in [vocab, -1, 10**12]:
        # measured at 0ef6a02: an id of len(tokenizer) was a 500 (IndexError in the embedding)
        assert_refused(post(server, "/completions", {"prompt": [5, bad]}), 400, "prompt",
                f"prompt: token id {bad} is outside the vocabulary (0 <= id < {vocab})")
    for prompt, shown in [([5, True], "[5, True]"), ([], "[]"), ("", ""), ({"a": 1}, "{'a': 1}"),
                          (["12+", "34"], "['12+', '34']"), ([[5], [6]], "[[5], [6]]")]:
        assert_refused(post(server, "/completions", {"prompt": prompt}), 400, "prompt",
                f"prompt must be one non-empty text or list of token ids (one prompt per request), not {shown}")
    # the tiny model's context is 256 positions: 251 prompt ids + 6 new tokens do not fit, 250 do
    assert_refused(post(server, "/completions", {"prompt": [5] * 251, "max_tokens": 6}), 400, "max_tokens",
            "the prompt's 251 tokens and max_tokens=6 are over the model's context of 256 tokens")
    monkeypatch.undo()
    assert post(server, "/completions", {"prompt": [5] * 250, "max_tokens": 6, "seed": 1}).status_code == 200


def test_a_temperature_near_zero_samples_greedily(served):
    server, _, _ = served
    # logits / 1e-40 overflow to inf and sampling fails (a 500 at 0ef6a02); below 1e-5 is greedy, as in vLLM
    tiny = post(server, "/chat/completions", {**CHAT, "temperature": 1e-40, "seed": 1})
    greedy = post(server, "/chat/completions", {**CHAT, "temperature": 0, "seed": 2})
    assert tiny.status_code == 200 and tiny.json()["choices"] == greedy.json()["choices"]


def test_a_chat_template_that_cannot_render_the_messages_is_a_400(served, monkeypatch):
    server, _, tok = served
    # a template that refuses what it cannot render, as real ones do with raise_exception
    monkeypatch.setattr(tok, "chat_template", "{% for m in messages %}{% if m['content'] is not string %}"
                        "{{ raise_exception('content must be text') }}{% endif %}{{ m['content'] }}{% endfor %}")
    assert_refused(post(server, "/chat/completions", {"messages": [{"role": "user", "content": {"a": 1}}]}), 400,
            "messages", "messages: the chat template cannot render them: TemplateError: content must be text")


@pytest.mark.slow
def test_a_prompt_that_takes_seconds_to_render_holds_up_no_other_request(served):
    import threading
    import time

    from rft.serving.openai_api import Limits

    server, _, _ = served
    # 20,000 messages take seconds to render and tokenise (50,000: 21 s); that ran on the server's
    # event loop, so every other agent's request, /v1/models too, waited for it (measured: 21 s).
    # The tiny model's context refuses them untokenised now: a context of 2,000,000 tokens lets them in.
    saved = server.limits["policy"], server.max_messages
    server.limits["policy"], server.max_messages = Limits(6, 103, 2_000_000), 2_000_000
    try:
        big = {**CHAT, "messages": [{"role": "user", "content": "hello world " * 10}] * 20_000}
        answers = []
        slow = threading.Thread(target=lambda: answers.append(httpx.post(
            server.url + "/chat/completions", json=big, headers={"Authorization": f"Bearer {server.token}"},
            timeout=120)))
        slow.start()
        time.sleep(0.5)  # its body is in: the render has begun
        answered = 0  # /v1/models answers while the long prompt renders
        while slow.is_alive():
            assert httpx.get(server.url + "/models", headers={"Authorization": f"Bearer {server.token}"},
                             timeout=120).status_code == 200
            answered += slow.is_alive()  # answered before the long request ended
            time.sleep(0.1)
        slow.join()
    finally:
        server.limits["policy"], server.max_messages = saved
    # 20,000 x 123 tokens (<|im_start|> user, 120 characters, spaces included, <|im_end|>) + 2
    assert_refused(answers[0], 400, "prompt", "the prompt's 2460002 tokens and max_tokens=6 are over the model's "
                                              "context of 2000000 tokens")
    # a render on the event loop let none answer until it ended (then at most the one waiting)
    assert answered >= 3, answered


def test_a_prompt_too_long_for_the_context_is_refused_before_it_is_tokenised(served):
    server, _, tok = served
    auth = {"Authorization": f"Bearer {server.token}"}
    # the tiny vocabulary's longest token is <|endoftext|>, 13 bytes: a text over 256 x 13 = 3,328
    # bytes is more than 256 tokens whatever it says. 20 MB took 21 s of CPU to tokenise, then this 400
    limit = "over the 3328 bytes that can fit the model's context of 256 tokens (13 bytes per token at most); " \
            "it was not tokenised"
    assert server.limits["policy"].token_bytes == max(len(t.encode()) for t in tok.get_vocab()) == 13
    text = "hello world " * (20 * 2**20 // 12)  # 20,971,512 bytes
    r = httpx.post(server.url + "/completions", json={"prompt": text}, headers=auth, timeout=60)
    assert_refused(r, 400, "prompt", f"the prompt's 20971512 bytes of text are {limit}")
    # rendered by the chat template: + "<|im_start|>user" (16) + "<|im_end|>" (10) + "<|im_start|>assistant" (21)
    r = httpx.post(server.url + "/chat/completions", json={"messages": [{"role": "user", "content": text}]},
                   headers=auth, timeout=60)
    assert_refused(r, 400, "messages", f"the prompt's 20971559 bytes of text are {limit}")
    # 3,328 bytes exactly may fit (a token of 13 bytes each): tokenised, and then refused by its tokens
    r = httpx.post(server.url + "/completions", json={"prompt": "1" * 3328}, headers=auth, timeout=60)
    assert_refused(r, 400, "prompt", "the prompt's 3328 tokens and max_tokens=6 are over the model's context of "
                                     "256 tokens")


@pytest.mark.slow  # 1.4 s alone, over the fast tier's second
def test_more_messages_than_the_context_has_tokens_are_refused_before_they_are_read(served):
    server, _, _ = served
    auth = {"Authorization": f"Bearer {server.token}"}
    # 1,000,000 messages (30 MB) took 4 s to validate on the event loop (/v1/models waited 4 s), then
    # 1 s to render and 14 s to tokenise, to be refused as over 256 tokens
    r = httpx.post(server.url + "/chat/completions", headers=auth, timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}] * 1_000_000})
    assert_refused(r, 400, "messages", "1000000 messages cannot fit the served models' context of 256 tokens "
                                       "(a message is one token at least)")
    # 256 are read and rendered: 256 x 28 bytes ("<|im_start|>userhi<|im_end|>") + 21 = 7,189 bytes
    r = httpx.post(server.url + "/chat/completions", headers=auth, timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}] * 256})
    assert_refused(r, 400, "messages", "the prompt's 7189 bytes of text are over the 3328 bytes that can fit the "
                                       "model's context of 256 tokens (13 bytes per token at most); it was not tokenised")


@pytest.mark.slow  # 1.2 s alone, over the fast tier's second
def test_a_reply_the_client_left_before_is_not_recorded(served):
    import time

    server, _, tok = served
    auth = {"Authorization": f"Bearer {server.token}", ROLLOUT_HEADER: "a"}
    server.open("a", ARGS)
    server.open("b", ARGS)  # b never asks: a's requests wait the batcher's idle 0.5 s for it
    try:
        calls = server.batchers["policy"].calls
        # an agent's own client with a timeout (or an asyncio cancel) gives up before the reply; the
        # sample was recorded all the same (measured: 1 call), and its retry made a second experience
        # of the same turn, the first one never read by the agent, both trained on with its reward
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server.url + "/chat/completions", json={**CHAT, "max_tokens": 2}, headers=auth, timeout=0.1)
        for _ in range(300):  # its batch goes after 0.5 s idle: the retry is then a batch of its own
            if server.batchers["policy"].calls > calls:
                break
            time.sleep(0.01)
        time.sleep(0.1)  # its handler looks at the connection right after the engine call
        retry = httpx.post(server.url + "/chat/completions", json={**CHAT, "max_tokens": 2}, headers=auth, timeout=60)
        assert retry.status_code == 200 and server.batchers["policy"].calls == calls + 2  # both were sampled
        [call] = server.take_history("a")
        assert tok.decode(call.token_ids, skip_special_tokens=True) == retry.json()["choices"][0]["message"]["content"]
    finally:
        server.take_history("a"), server.take_history("b")


def test_a_body_over_32_mib_is_a_413(served):
    server, _, _ = served
    r = httpx.post(server.url + "/chat/completions", content=b"x" * (33 * 2**20),
                   headers={"Authorization": f"Bearer {server.token}"})
    assert_refused(r, 413, None, "the request body is over the 32 MiB this server accepts.")


def test_the_history_of_rollouts_nobody_opens_or_takes_is_bounded(cache_dir, caplog):
    engine, tok = engine_for(build_tiny_model(cache_dir / "models" / "tiny-qwen2-v2"))
    server = OpenAIServer({"policy": (engine, tok)}, "policy", ARGS, 6, max_rollouts=2).start()
    try:
        c = lambda key: client(server, default_headers={ROLLOUT_HEADER: key})  # noqa: E731
        # measured at 0ef6a02: each key nobody opened kept its calls for the server's life
        for key in ["a", "b", "c"]:
            c(key).chat.completions.create(model="policy", messages=MESSAGES, max_tokens=2)
        assert server.rollouts == {} and server.take_history("a") == []
        # opened and never taken: the third one opened drops the oldest, counted and warned about
        server.open("r1", ARGS)
        c("r1").chat.completions.create(model="policy", messages=MESSAGES, max_tokens=2)
        server.open("r2", ARGS)
        server.open("r3", ARGS)
        assert list(server.rollouts) == ["r2", "r3"] and server.dropped_rollouts == 1
        assert "rollout 'r1' was opened and its calls never taken; dropped its 1 calls to keep 2 rollouts open " \
               "at most (1 dropped so far)" in caplog.text
        c("r3").chat.completions.create(model="policy", messages=MESSAGES, max_tokens=2)
        assert len(server.take_history("r3")) == 1 and list(server.rollouts) == ["r2"]
    finally:
        server.stop()


def raises(client, task, model, seed):
    client.chat.completions.create(model=model, messages=task.messages, seed=seed)
    raise RuntimeError("the agent failed")


def test_an_agent_that_raises_leaves_no_history_behind(served):
    server, engine, _ = served
    jobs = []

    def call(fn, js, runners):  # as run_jobs (one after another): a job that raises is a failed task (None)
        out = []
        for j in js:
            try:
                out.append(fn(j))
            except RuntimeError:
                out.append(None)
            jobs.append(j)
        return out

    ctx = ctx_for(server, "test_openai_api.raises")
    ctx.call = call
    assert openai_agent([Task("t/0", MESSAGES, "x", {})], engine, ctx) == [None]
    assert len(jobs) == 2 and server.rollouts == {}  # at 0ef6a02 both rollouts' calls stayed


# ---------------------------------------------------------------- the workflow

def one_call(client, task, model, seed):
    """An agent as a user writes it: one chat call, its answer's length as the reward."""
    r = client.chat.completions.create(model=model, messages=task.messages, seed=seed)
    return float(len(r.choices[0].message.content))


def scored_by_the_taskset(client, task, model, seed):
    client.chat.completions.create(model=model, messages=task.messages, seed=seed)
    return None


def continues_its_ids(client, task, model, seed, tok_path):
    """Two /v1/completions calls, the second's prompt the first's prompt + answer + "=": one experience."""
    tok = load_tokenizer(OmegaConf.create(dict(model_path=tok_path, trust_remote_code=False, custom_chat_template=None)))
    prompt = render(tok, task.messages, generation_prompt=True)
    first = client.completions.create(model=model, prompt=prompt, seed=seed, max_tokens=3, logprobs=0)
    ids = tok.encode(first.choices[0].text, add_special_tokens=False)
    client.completions.create(model=model, prompt=prompt + ids + tok.encode("=", add_special_tokens=False), seed=seed + 1, max_tokens=2)
    return {"a": 1.0, "b": 0.5}


def ctx_for(server, agent, n=2, score=None, **args):
    return WorkflowContext(tokenizer=None, n=n, rollout_args=ARGS, max_prompt_tokens=24, policy_version=1, seed=11,
                           step=4, score=score, args={"agent": agent, **args}, openai=server)


def test_the_workflows_experiences_are_the_direct_engine_calls(served):
    server, engine, tok = served
    tasks = [Task(f"t/{i}", [{"role": "user", "content": q}], "x", {}) for i, q in enumerate(["12+34", "7+2"])]
    out = openai_agent(tasks, engine, ctx_for(server, "test_openai_api.one_call"))
    for i, (task, group) in enumerate(zip(tasks, out)):
        prompt = render(tok, task.messages, generation_prompt=True)
        for j, e in enumerate(group):
            # the agent's seed: the step's seed + the rollout's index in the step (11 + 2i + j)
            [s] = engine.generate([prompt], 1, ARGS, seed=11 + 2 * i + j)[0]
            assert (e.tokens, e.prompt_length, e.logprobs) == (prompt + s.token_ids, len(prompt), s.logprobs)
            assert e.sampling == {"temperature": 1.0, "top_p": 1.0, "top_k": -1} and e.loss_mask == [1] * len(s.token_ids)
            assert e.reward == float(len(tok.decode(s.token_ids, skip_special_tokens=True)))
            assert e.group_id == f"4/11/{task.task_id}" and e.policy_version == 1
    # None: the taskset's reward scores the last answer
    seen = []

    def score(jobs):
        seen.extend(jobs)
        return [[Reward(0.25, {"exact_match": 0.25})] for _ in jobs]

    [[a, b]] = openai_agent(tasks[:1], engine, ctx_for(server, "test_openai_api.scored_by_the_taskset", score=score))
    assert (a.reward, a.reward_parts) == (0.25, {"exact_match": 0.25}) and len(seen) == 2
    assert seen[0][1] == [a.info["response"]] and seen[0][2] is tasks[0]


def test_an_agent_that_continues_its_own_ids_makes_one_experience(served):
    server, engine, tok = served
    path = engine.model.name_or_path
    [[e]] = openai_agent([Task("t/0", MESSAGES, "x", {})], engine,
                         ctx_for(server, "test_openai_api.continues_its_ids", n=1, tok_path=path))
    prompt = render(tok, MESSAGES, generation_prompt=True)
    [first] = engine.generate([prompt], 1, SimpleNamespace(**{**vars(ARGS), "max_tokens": 3}), seed=11)[0]
    ids = tok.encode(tok.decode(first.token_ids, skip_special_tokens=True), add_special_tokens=False)
    eq = tok.encode("=", add_special_tokens=False)
    [second] = engine.generate([prompt + ids + eq], 1, SimpleNamespace(**{**vars(ARGS), "max_tokens": 2}), seed=12)[0]
    if ids != first.token_ids:  # the text re-encodes to other ids (a special token): two experiences then
        pytest.skip("the first answer does not re-encode to its ids")
    assert e.tokens == prompt + first.token_ids + eq + second.token_ids
    assert e.loss_mask == [1] * len(first.token_ids) + [0] * len(eq) + [1] * len(second.token_ids)
    assert e.logprobs == first.logprobs + [0.0] * len(eq) + second.logprobs
    assert (e.reward, e.reward_parts) == (1.5, {"a": 1.0, "b": 0.5})


def test_calls_merge_only_on_an_exact_prefix():
    c = lambda p, t: Call(p, t, [-0.5] * len(t), "stop", {}, "", "", "r")  # noqa: E731
    # the second call's prompt continues the first (1 2 | 3 4 | 9), the third starts over
    [(t1, p1, l1, m1, _), (t2, p2, _, m2, _)] = experiences_of([c([1, 2], [3, 4]), c([1, 2, 3, 4, 9], [5]), c([1, 7], [8])])
    assert (t1, p1, m1) == ([1, 2, 3, 4, 9, 5], 2, [1, 1, 0, 1]) and l1 == [-0.5, -0.5, 0.0, -0.5]
    assert (t2, p2, m2) == ([1, 7, 8], 2, [1])


def test_the_workflow_says_what_is_missing():
    with pytest.raises(ConfigError, match="set explorer.rollout_model.enable_openai_api=true"):
        openai_agent([], None, ctx_for(None, "x.y"))
    server = SimpleNamespace()
    with pytest.raises(ConfigError, match=r"workflow_args.agent='nope.agent': cannot import it"):
        openai_agent([], None, ctx_for(server, "nope.agent"))


def test_an_agents_workflow_args_and_the_endpoint_are_checked_while_planning():
    """Found at the first explore step before (after a whole warm-up stage): a key the agent does
    not take (an overlay switching a multi_turn taskset to openai_agent keeps its env, Hydra merges
    dicts) failed every task with a TypeError, and a missing endpoint stopped the run there."""
    from conftest import compose_cfg

    from rft.plan.batch import make_plan
    from rft.rollout.workflows.single_turn import check_agent_args

    base = ["stages=[]", "buffer.explorer_input.taskset.workflow=openai_agent",
            "+buffer.explorer_input.taskset.workflow_args.agent=test_openai_api.one_call"]
    with pytest.raises(ConfigError) as e:
        make_plan(compose_cfg(base), 2000)
    assert str(e.value) == (
        "buffer.explorer_input.taskset.workflow=openai_agent needs the explorer's OpenAI-compatible endpoint: set "
        "explorer.rollout_model.enable_openai_api=true.")
    base.append("explorer.rollout_model.enable_openai_api=true")
    with pytest.raises(ConfigError) as e:
        make_plan(compose_cfg([*base, "+buffer.explorer_input.taskset.workflow_args.env=calculator"]), 2000)
    assert str(e.value) == (
        "buffer.explorer_input.taskset.workflow_args has ['env'], which the agent test_openai_api.one_call(client, task, "
        "model, seed) does not take: it is called as agent(client, task, model=..., seed=..., **workflow_args without "
        "agent). Remove the key (~buffer.explorer_input.taskset.workflow_args.env on the command line) or give the "
        "agent a parameter of that name (or **kwargs).")
    # the checker itself (composing costs 0.3 s a config)
    with pytest.raises(ConfigError) as e:
        check_agent_args({"agent": "test_openai_api.continues_its_ids"}, "workflow_args")
    assert str(e.value) == (
        "the agent test_openai_api.continues_its_ids(client, task, model, seed, tok_path) needs ['tok_path'], which "
        "have no default: set +workflow_args.tok_path=<value>.")
    with pytest.raises(ConfigError, match=r"workflow_args.agent='nope.agent': cannot import it"):
        check_agent_args({"agent": "nope.agent"}, "workflow_args")
    check_agent_args({"agent": "test_openai_api.continues_its_ids", "tok_path": "p"}, "workflow_args")  # fits


@pytest.mark.slow  # a training run (inline, ~15 s)
def test_an_agent_trains_through_the_explorers_endpoint(tmp_path):
    """explorer.rollout_model.enable_openai_api=true and workflow openai_agent in the loop: each
    step's experiences are the agent's recorded calls, rewarded by the agent."""
    from conftest import compose_cfg

    import rft.runtime.main
    from rft.data.buffer import read_experiences
    from rft.reporting.monitor import read_metrics

    cfg = compose_cfg([
        "stages=[]", "cluster=inline", "monitor=console", f"checkpoint_root_dir={tmp_path}", "buffer=sql",
        "buffer.total_steps=2", "buffer.batch_size=4", "algorithm.repeat_times=4", "explorer.eval_on_startup=false",
        "buffer.explorer_input.eval_tasksets=[]", "explorer.rollout_model.enable_openai_api=true",
        "buffer.explorer_input.taskset.workflow=openai_agent",
        "+buffer.explorer_input.taskset.workflow_args.agent=test_openai_api.one_call",
    ])
    rft.runtime.main.main(cfg)
    steps = [m for m in read_metrics(tmp_path / "rft" / cfg.name / "metrics.jsonl") if "reward/mean" in m]
    assert len(steps) == 2
    exps = read_experiences(str(tmp_path / "rft" / cfg.name / "buffer.db"), limit=100)
    assert len(exps) == 2 * 4 * 4
    for e in exps:
        assert e.reward == float(len(e.info["response"])) and e.loss_mask == [1] * e.response_length
