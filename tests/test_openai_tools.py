"""Tool calling on the explorer's OpenAI-compatible endpoint (rft/serving/openai_chat.py): `tools`
through the chat template, `tool_calls` in OpenAI's shape, tool results sent back, streaming; and a
two-tool agent written against the `openai` client alone, run as the openai_agent workflow.

The model is model=tiny_tools (its template renders tools); a scripted engine says what the model
"says", so the ids, the loss mask and the log-probs can be checked position by position."""

from __future__ import annotations

import json
import random
import re
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
from omegaconf import OmegaConf

from rft.data.chat import render
from rft.data.tasks import Task, tool_call_text
from rft.data.tool_calls import ToolCall, hermes, mistral
from rft.models import build_tiny_model, load_tokenizer
from rft.registry import EngineInfo
from rft.rollout.engines.hf import HFEngine, Sample
from rft.rollout.workflows.openai_agent import openai_agent
from rft.rollout.workflows.single_turn import WorkflowContext
from rft.serving.openai_api import OpenAIServer

ARGS = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=64, stop=[])
TOOLS = [{"type": "function", "function": {"name": name, "description": f"a {op} b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
    for name, op in [("add", "+"), ("mul", "*")]]
IMPL = {"add": lambda a, b: a + b, "mul": lambda a, b: a * b}
QUESTION = [{"role": "user", "content": "(2+3)*4"}]


def two_tool_agent(client, task, model, seed, max_turns=4):
    """An agent as a user writes it against OpenAI's API: call the tools the model asks for, send
    their results back, until the model answers (or `max_turns` replies, task=calculator's
    workflow_args.max_turns); 1.0 for the right answer."""
    messages = list(task.messages)
    for turn in range(max_turns):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, seed=seed + turn)
        msg = reply.choices[0].message
        if not msg.tool_calls:
            return float(msg.content == task.answer)
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls:
            result = IMPL[call.function.name](**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
    return 0.0


class ByTurn:
    """An engine that answers the k-th assistant turn of a conversation with script[k] (then the
    eos token); log-probs -0.01 * (position + 1), so each token's can be told apart."""

    def __init__(self, tok, script):
        self.tok, self.script, self.prompts = tok, script, []

    def generate(self, prompts, n, args, seed):
        out = []
        for p in prompts:
            self.prompts.append(list(p))
            turn = self.tok.decode(p).count("<|im_start|>assistant") - 1
            ids = self.tok.encode(self.script[turn], add_special_tokens=False) + [self.tok.eos_token_id]
            out.append([Sample(ids, [-0.01 * (i + 1) for i in range(len(ids))], "stop") for _ in range(n)])
        return out


ADD = tool_call_text("add", {"a": 2, "b": 3})
MUL = tool_call_text("mul", {"a": 5, "b": 4})


@pytest.fixture(scope="module")
def tok(cache_dir):
    path = build_tiny_model(cache_dir / "models" / "tiny-qwen2-tools-v4", tools=True)
    return load_tokenizer(OmegaConf.create(dict(model_path=str(path), trust_remote_code=False, custom_chat_template=None)))


@pytest.fixture
def serve(tok):
    servers = []

    def start(script, **kw):
        engine = ByTurn(tok, script)
        servers.append(OpenAIServer({"policy": (engine, tok)}, "policy", ARGS, 64, **kw).start())
        return servers[-1], engine

    yield start
    for s in servers:
        s.stop()


def client(server):
    return openai.OpenAI(base_url=server.url, api_key=server.token, max_retries=0)


def post(server, body):
    return httpx.post(server.url + "/chat/completions", json={"messages": QUESTION, **body},
                      headers={"Authorization": f"Bearer {server.token}"})


# ---------------------------------------------------------------- the parsers

def test_the_parsers_split_content_from_calls():
    text = "I add.<tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 2}}</tool_call><tool_call>{\"name\":\"mul\"," \
           "\"arguments\":\"{\\\"b\\\": 1}\"}</tool_call>"
    assert hermes(text) == ("I add.", [ToolCall("add", {"a": 2}), ToolCall("mul", {"b": 1})])
    assert hermes("56") == ("56", [])
    [bad] = hermes("<tool_call>{name: add}</tool_call>")[1]
    assert bad.error == "the tool call is not valid JSON (Expecting property name enclosed in double quotes): '{name: add}'"
    assert mistral('Sure [TOOL_CALLS][{"name": "add", "arguments": {"a": 2}}]') == ("Sure", [ToolCall("add", {"a": 2})])
    assert mistral("no calls") == ("no calls", [])
    # arguments as a JSON string nested too deep for the reader: a failed call, not a RecursionError out of
    # the parser (measured before the fix: mistral raised it, and the multi-turn environment's step with it)
    deep = '"' + "[" * 100_000 + '"'
    for parse, text in [(mistral, f'[TOOL_CALLS][{{"name": "add", "arguments": {deep}}}]'),
                        (hermes, f'<tool_call>{{"name": "add", "arguments": {deep}}}</tool_call>')]:
        assert parse(text)[1] == [ToolCall("add", error="the arguments are not JSON (nested too deep): '" + "[" * 80 + "'")]


# ---------------------------------------------------------------- the endpoint

def test_a_request_with_tools_gets_tool_calls_and_renders_them_back(serve, tok):
    server, engine = serve([ADD, MUL, "20"])
    reply = client(server).chat.completions.create(model="policy", messages=QUESTION, tools=TOOLS, seed=1)
    [choice] = reply.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 5 + 24
    assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 2, "b": 3})
    # the tools reach the model through its template: one system line of signatures
    assert tok.decode(engine.prompts[0]) == "<|im_start|>systemtools:add(a,b);mul(a,b)<|im_end|><|im_start|>user(2+3)*4" \
                                            "<|im_end|><|im_start|>assistant"  # (the tiny template writes no newlines)
    # the call and the tool's result sent back, as an agent does: rendered as the model wrote the call
    back = QUESTION + [choice.message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    second = client(server).chat.completions.create(model="policy", messages=back, tools=TOOLS, seed=2)
    assert second.choices[0].message.tool_calls[0].function.name == "mul"
    assert tok.decode(engine.prompts[1]).endswith(f"<|im_start|>assistant{ADD}<|im_end|><|im_start|>tool5<|im_end|>"
                                                  f"<|im_start|>assistant")
    # the second prompt continues the first's ids and its sampled ids (the call and the eos token)
    first_ids = engine.prompts[0] + tok.encode(ADD, add_special_tokens=False) + [tok.eos_token_id]
    assert engine.prompts[1][: len(first_ids)] == first_ids


def test_a_call_that_does_not_parse_is_plain_content_and_tool_choice_none_reads_none(serve):
    server, _ = serve(["<tool_call>{name: add}</tool_call>"])
    r = post(server, {"tools": TOOLS})
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "<tool_call>{name: add}</tool_call>"}
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    server, _ = serve([ADD])
    none = post(server, {"tools": TOOLS, "tool_choice": "none"}).json()["choices"][0]
    assert none["message"]["content"] == ADD and none["finish_reason"] == "stop"
    without = post(server, {}).json()["choices"][0]  # no tools sent: the text is not read for calls
    assert without["message"]["content"] == ADD


@pytest.mark.parametrize("body,param,message", [
    ({"tool_choice": "required"}, "tool_choice",
     'tool_choice=required: this endpoint samples the model freely and cannot force a tool call; send "auto" or "none"'),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools",
     "tools[0].function.name: Field required (got {'description': 'x'})"),
    ({"messages": QUESTION + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{a: 2"}}]}]}, "messages",
     "messages[1].tool_calls[0].function.arguments is not JSON (Expecting property name enclosed in double quotes: "
     "line 1 column 2 (char 1)): '{a: 2'"),
    # measured before the fix: a 500 (the RecursionError of json.loads went up to uvicorn)
    ({"messages": QUESTION + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "[" * 100_000}}]}]}, "messages",
     "messages[1].tool_calls[0].function.arguments is not JSON (maximum recursion depth exceeded while decoding a "
     "JSON array from a unicode string): '" + "[" * 100 + "'"),
])
def test_a_malformed_tool_field_is_a_400_naming_it(serve, body, param, message):
    server, engine = serve(["x"])
    r = post(server, {"tools": TOOLS, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param and r.json()["error"]["message"] == message
    assert engine.prompts == []


def test_a_streamed_reply_is_the_reply_in_openais_chunks(serve):
    server, _ = serve([ADD])
    whole = client(server).chat.completions.create(model="policy", messages=QUESTION, tools=TOOLS, seed=1)
    chunks = list(client(server).chat.completions.create(model="policy", messages=QUESTION, tools=TOOLS, seed=1,
                                                         stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    [call] = [t for d in deltas for t in (d.tool_calls or [])]
    assert (call.index, call.function.name, call.function.arguments) == (
        0, "add", whole.choices[0].message.tool_calls[0].function.arguments)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # text, through /v1/completions too; the stream ends with data: [DONE]
    server, _ = serve(["56"])
    r = httpx.post(server.url + "/completions", json={"prompt": "7*8=", "stream": True},
                   headers={"Authorization": f"Bearer {server.token}"})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [e.removeprefix("data: ") for e in r.text.strip().split("\n\n")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == "56"


# ---------------------------------------------------------------- the agent as a workflow

def test_the_two_tool_agents_conversation_is_one_experience_masked_to_the_sampled_ids(serve, tok):
    server, engine = serve([ADD, MUL, "20"])
    ctx = WorkflowContext(tokenizer=None, n=1, rollout_args=ARGS, max_prompt_tokens=64, policy_version=1, seed=3,
                          step=0, score=None, args={"agent": "test_openai_tools.two_tool_agent"}, openai=server)
    [[e]] = openai_agent([Task("t/0", QUESTION, "20", {})], engine, ctx)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    S, E = tok.convert_tokens_to_ids("<|im_start|>"), tok.eos_token_id
    add, mul, answer = enc(ADD) + [E], enc(MUL) + [E], enc("20") + [E]
    tool = lambda r: [S] + enc("tool" + r) + [E, S] + enc("assistant")  # noqa: E731  (the template's, not sampled)
    prompt = engine.prompts[0]
    # three calls, each prompt continuing the last: merged into one experience
    assert e.tokens == prompt + add + tool("5") + mul + tool("20") + answer
    assert e.prompt_length == len(prompt) and e.reward == 1.0
    assert e.loss_mask == [1] * len(add) + [0] * len(tool("5")) + [1] * len(mul) + [0] * len(tool("20")) + [1] * len(answer)
    lp = lambda ids: [-0.01 * (i + 1) for i in range(len(ids))]  # noqa: E731  (ByTurn's)
    assert e.logprobs == lp(add) + [0.0] * len(tool("5")) + lp(mul) + [0.0] * len(tool("20")) + lp(answer)


class ToolCallingEngine(HFEngine):
    """The tiny model made to call the tools: turn 0 calls mul or add (a seeded coin per sample) on
    the question's two numbers, turn 1 answers the tool's result. Each token's log-prob is the
    model's own under the weights it holds, so the trainer starts on policy."""

    info = EngineInfo()

    def generate(self, prompts, n, args, seed):
        rng, out = random.Random(seed), []
        for p in prompts:
            text = self.tokenizer.decode(p)
            group = []
            for _ in range(n):
                if "<|im_start|>tool" in text:  # the tool answered: say its result
                    reply = text.rsplit("<|im_start|>tool", 1)[1].split("<|im_end|>")[0]
                else:
                    a, b = re.search(r"(\d+)\*(\d+)", text).groups()
                    reply = tool_call_text(rng.choice(["mul", "add"]), {"a": int(a), "b": int(b)})
                ids = self.tokenizer.encode(reply, add_special_tokens=False) + [self.tokenizer.eos_token_id]
                group.append(Sample(ids, self._logprobs(p, ids), "stop"))
            out.append(group)
        return out

    @torch.no_grad()
    def _logprobs(self, prompt, ids):
        logits = self.model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1: -1].float()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist()


def mul_logprob(exps, tok) -> float:
    """The mean log-prob the engine gave "m" in the mul calls' <tool_call>{"name":"mul", the token
    where they part from the add calls (under the weights of their step)."""
    at = len(tok.encode('<tool_call>{"name":"', add_special_tokens=False))
    mul = [e.logprobs[at] for e in exps if e.tokens[e.prompt_length + at] == tok.convert_tokens_to_ids("m")]
    return sum(mul) / len(mul)


@pytest.mark.slow  # a training run (inline, ~20 s)
def test_the_two_tool_agent_trains_through_the_endpoint(tmp_path, tok):
    """model=tiny_tools task=calculator, the workflow openai_agent with the two-tool agent: the
    rewarded call (mul) grows likelier step by step, and every experience's loss mask covers the
    sampled ids alone."""
    from conftest import compose_cfg

    import rft.runtime.main
    from rft.data.buffer import read_experiences

    cfg = compose_cfg([
        "stages=[]", "cluster=inline", "monitor=console", f"checkpoint_root_dir={tmp_path}", "buffer=sql",
        "model=tiny_tools", "task=calculator", "model.max_prompt_tokens=64", "model.max_response_tokens=96",
        "buffer.total_steps=4", "buffer.batch_size=4", "algorithm.repeat_times=4", "algorithm.optimizer.lr=1e-3",
        "explorer.eval_on_startup=false", "buffer.explorer_input.eval_tasksets=[]",
        "explorer.rollout_model.enable_openai_api=true", "buffer.explorer_input.taskset.workflow=openai_agent",
        "explorer.rollout_model.engine_type=test_openai_tools.ToolCallingEngine",
        # the task's calculator environment is the multi_turn workflow's: the agent is the whole of it
        "~buffer.explorer_input.taskset.workflow_args.env",
        "+buffer.explorer_input.taskset.workflow_args.agent=test_openai_tools.two_tool_agent",
    ])
    rft.runtime.main.main(cfg)
    exps = read_experiences(str(tmp_path / "rft" / cfg.name / "buffer.db"), limit=1000)
    assert len(exps) == 4 * 4 * 4
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    S, E = tok.convert_tokens_to_ids("<|im_start|>"), tok.eos_token_id
    for e in exps:
        call = tok.decode(e.tokens[e.prompt_length:]).split("<|im_end|>")[0]
        a, b = map(int, re.search(r"(\d+)\*(\d+)", tok.decode(e.tokens[:e.prompt_length])).groups())
        result = str(a * b if '"mul"' in call else a + b)
        sampled, template = enc(call) + [E], [S] + enc("tool" + result) + [E, S] + enc("assistant")
        assert e.tokens[e.prompt_length:] == sampled + template + enc(result) + [E]
        assert e.loss_mask == [1] * len(sampled) + [0] * len(template) + [1] * (len(enc(result)) + 1)
        assert e.reward == float(result == str(a * b))
    by_step = [mul_logprob([e for e in exps if e.policy_version == v], tok) for v in range(4)]
    assert by_step == sorted(by_step) and by_step[-1] > by_step[0] + 1.0, by_step
