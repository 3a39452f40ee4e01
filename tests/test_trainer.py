"""The trainer's update: micro-batching does not change the gradient; a GRPO step moves the policy."""

import math
import pickle
import random
from pathlib import Path

import pytest
import torch
from conftest import compose_cfg

from rft.data.experience import Experience
from rft.errors import ConfigError
from rft.models import ensure_model
from rft.plan.batch import make_plan, stage_configs
from rft.trainer.trainer import Trainer


def make_trainer(micro: int, extra=(), resume=None):
    """`resume`: a checkpoint directory the trainer is built from (its `load` must follow)."""
    cfg = stage_configs(compose_cfg(["stages=[]", "cluster=inline", f"trainer.micro_batch_size_per_gpu={micro}",
                                     *extra]))[0]
    ensure_model(cfg.model)
    return Trainer(cfg, make_plan(cfg, 2000), None, resume)


def experiences(n_groups=16, group=8, seed=0):
    """A GRPO batch with responses of 1 to 6 tokens, so micro-batches hold unequal token counts."""
    rng = random.Random(seed)
    exps = []
    for g in range(n_groups):
        prompt = [1, 5, 102] + [rng.randint(7, 16) for _ in range(7)] + [2, 102, 1, 6, 102]
        for _ in range(group):
            response = [rng.randint(7, 16) for _ in range(rng.randint(0, 5))] + [2]
            exps.append(Experience(prompt + response, len(prompt), [0.0] * len(response),
                                   reward=float(rng.random() < 0.5), group_id=f"0/{g}"))
    return exps


@pytest.mark.slow
def test_micro_batches_of_unequal_length_give_the_one_batch_gradient():
    batch = experiences()
    whole, split = make_trainer(128), make_trainer(16)
    m_whole, m_split = whole.train_step(batch), split.train_step(batch)
    # 8 micro-batches of 16 sequences with different token counts vs one of 128: same gradient
    for (name, a), (_, b) in zip(whole.model.named_parameters(), split.model.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-7, msg=name)
    assert m_split["loss/policy"] == pytest.approx(m_whole["loss/policy"], abs=1e-6)
    assert m_split["actor/grad_norm"] == pytest.approx(m_whole["actor/grad_norm"], rel=1e-5)


def test_grpo_step_raises_the_likelihood_of_rewarded_responses():
    batch = experiences()
    trainer = make_trainer(128, ["algorithm.optimizer.lr=1e-3"])
    before = torch.nn.utils.parameters_to_vector(trainer.model.parameters()).clone()
    metrics = trainer.train_step(batch)
    after = torch.nn.utils.parameters_to_vector(trainer.model.parameters())
    assert not torch.equal(before, after)
    assert metrics["actor/lr"] == pytest.approx(1e-3)
    assert metrics["advantage/mean"] == pytest.approx(0.0, abs=0.2)
    # first update is on-policy: ratio exactly 1, nothing clipped, approx KL 0
    assert metrics["actor/clip_frac"] == 0.0 and metrics["actor/approx_kl"] == pytest.approx(0.0, abs=1e-9)
    # a second pass over the same batch: the advantage-weighted log-likelihood went up
    from rft.data.experience import collate
    from rft.trainer.trainer import token_logprobs

    full = {k: v.to(trainer.device) for k, v in collate(batch, trainer.tokenizer.pad_token_id).items()}
    adv = torch.tensor([e.reward for e in batch], device=trainer.device) - 0.5
    with torch.no_grad():
        logp, _ = token_logprobs(trainer.model, full["input_ids"], full["attention_mask"])
    score_after = ((logp * full["response_mask"]).sum(-1) * adv).sum()
    torch.nn.utils.vector_to_parameters(before, trainer.model.parameters())
    with torch.no_grad():
        logp0, _ = token_logprobs(trainer.model, full["input_ids"], full["attention_mask"])
    score_before = ((logp0 * full["response_mask"]).sum(-1) * adv).sum()
    assert score_after > score_before


def test_kl_loss_uses_a_frozen_reference():
    trainer = make_trainer(128, ["algorithm.kl_loss_fn=k3", "algorithm.kl_loss_coef=0.1"])
    batch = experiences()
    first = trainer.train_step(batch)
    # the reference equals the policy before the first update: k3 is 0 there
    assert first["actor/kl"] == pytest.approx(0.0, abs=1e-7)
    second = trainer.train_step(batch)
    assert second["actor/kl"] > 0
    assert all(not p.requires_grad for p in trainer.ref_model.parameters())


def scaled_grpo(batch, cfg):
    """A custom advantage function, given to the trainer by dotted path."""
    from rft.algorithms import ADVANTAGE_FNS

    return 2.0 * ADVANTAGE_FNS["grpo"](batch, cfg)


def test_custom_advantage_function_by_dotted_path():
    trainer = make_trainer(128, ["algorithm.advantage_fn=test_trainer.scaled_grpo"])
    # a study's function, called through rft.algorithms.contract's checks of what it returns
    assert trainer.advantage_fn is not scaled_grpo and trainer.advantage_fn.__qualname__ == "checked.<locals>.advantages"
    default = make_trainer(128)
    batch = experiences()
    # advantages doubled: |A| mean doubles (the GRPO advantages of this batch are not all zero)
    a, b = trainer.train_step(batch), default.train_step(batch)
    assert a["advantage/abs_mean"] == pytest.approx(2 * b["advantage/abs_mean"]) and b["advantage/abs_mean"] > 0


def test_kl_penalty_comes_off_the_reward():
    trainer = make_trainer(128, ["algorithm.kl_penalty_fn=k1", "algorithm.kl_penalty_coef=0.5",
                                 "algorithm.optimizer.lr=1e-2"])
    batch = experiences()
    # before any update the policy is the reference: sum of k1 = 0, rewards unchanged
    assert trainer.train_step(batch)["reward/kl_penalty"] == pytest.approx(0.0, abs=1e-6)
    # after one update the sampled responses' log-probs moved from the reference's
    second = trainer.train_step(batch)
    assert second["reward/kl_penalty"] != pytest.approx(0.0, abs=1e-4)


def test_ppo_critic_is_saved_and_restored(tmp_path):
    trainer = make_trainer(128, ["algorithm=ppo", "algorithm.critic_lr=1e-3"])
    start = {k: v.clone() for k, v in trainer.critic.model.state_dict().items()}
    metrics = trainer.train_step(experiences())
    assert metrics["critic/value_loss"] > 0 and "critic/explained_variance" in metrics
    trained = trainer.critic.model.state_dict()
    assert any(not torch.equal(start[k], trained[k]) for k in start)
    trainer.save(str(tmp_path))
    restored = make_trainer(128, ["algorithm=ppo", "algorithm.critic_lr=1e-3"])
    restored.load(str(tmp_path))
    for k, v in restored.critic.model.state_dict().items():
        assert torch.equal(v, trained[k]), k
    assert restored.critic.optimizer.state_dict()["state"]  # Adam moments came back too


def test_ppo_critic_warmup_trains_only_the_critic():
    trainer = make_trainer(128, ["algorithm=ppo", "algorithm.critic_warmup=1"])
    before = torch.nn.utils.parameters_to_vector(trainer.model.parameters()).clone()
    trainer.train_step(experiences())
    assert torch.equal(before, torch.nn.utils.parameters_to_vector(trainer.model.parameters()))
    trainer.train_step(experiences())
    assert not torch.equal(before, torch.nn.utils.parameters_to_vector(trainer.model.parameters()))


def test_resumed_trainer_keeps_the_stage_start_as_its_reference(tmp_path):
    trainer = make_trainer(128, ["algorithm.kl_loss_fn=k3", "algorithm.optimizer.lr=1e-3"])
    start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train_step(experiences())
    trainer.save(str(tmp_path))
    resumed = make_trainer(128, ["algorithm.kl_loss_fn=k3", "algorithm.optimizer.lr=1e-3"])
    resumed.load(str(tmp_path))
    for k, v in resumed.ref_model.state_dict().items():
        assert torch.equal(v, start[k]), k
    trained = trainer.model.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in resumed.model.state_dict().items())
    assert any(not torch.equal(trained[k], start[k]) for k in start)


def test_a_sync_reports_its_parts_and_the_snapshot_reuses_its_fingerprint(monkeypatch, tmp_path):
    """sync_payload's parts come back once with the next step's metrics; keep_snapshots takes the
    fingerprint the sync just computed for the same weights, and computes it after they change."""
    trainer = make_trainer(128, ["algorithm.optimizer.lr=1e-3"])
    calls = []
    real = trainer.fingerprint
    monkeypatch.setattr(trainer, "fingerprint", lambda: calls.append(1) or real())
    weights, fp = trainer.sync_payload(None)
    assert fp == real() and len(calls) == 1
    trainer.keep_snapshots(0, [0])
    assert trainer.snapshot_fingerprint(0) == fp and len(calls) == 1  # not computed again
    m = trainer.train_step(experiences())
    assert m["timing/sync_send_s"] > 0 and m["timing/sync_fingerprint_s"] > 0
    assert "timing/sync_send_s" not in trainer.train_step(experiences())  # reported once
    trainer.keep_snapshots(2, [2])  # other weights (version 2): computed
    assert len(calls) == 2 and trainer.snapshot_fingerprint(2) == real() != fp
    # a load puts other weights under what may be the same version: computed again
    trainer.save(str(tmp_path))
    trainer.sync_payload(None)
    trainer.load(str(tmp_path))
    trainer.keep_snapshots(3, [3])
    assert len(calls) == 4


class RunsCode:
    """A pickled object whose unpickling calls open(marker, "w"): any call would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_a_trainer_state_that_would_run_code_is_refused_and_the_code_never_runs(tmp_path):
    trainer = make_trainer(128)
    trainer.train_step(experiences())
    trainer.save(str(tmp_path))
    path, marker = tmp_path / "trainer_state.pt", tmp_path / "the_code_ran"
    state = torch.load(path, weights_only=True)
    torch.save({**state, "optimizer": RunsCode(marker)}, path)
    fresh = make_trainer(128)
    before = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    with pytest.raises(pickle.UnpicklingError) as e:
        fresh.load(str(tmp_path))
    assert not marker.exists()
    assert str(e.value) == (
        f"{path} is refused: it holds a call of io.open, which is not a tensor, number, string "
        f"or container of them, and loading it would run that code. A trainer_state.pt the trainer wrote never "
        f"holds one: this file was replaced or written by other code. Move this checkpoint away to resume from "
        f"the one before it, or start the stage again (continue_from_checkpoint=false).")
    # nothing of the checkpoint was loaded: the state is read first
    assert all(torch.equal(v, before[k]) for k, v in fresh.model.state_dict().items()) and fresh.version == 0


@pytest.fixture
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("extra", [[], ["algorithm=ppo"], ["model.lora.rank=4", "model.lora.alpha=8"],
                                   ["algorithm.optimizer.warmup_style=cosine", "algorithm.optimizer.warmup_steps=1"]],
                         ids=["grpo", "ppo-critic", "lora", "cosine"])
@pytest.mark.slow
def test_every_trainer_state_loads_as_tensors_and_plain_data_and_resumes_exactly(tmp_path, extra, one_torch_thread):
    """What the trainer saves (Adam moments and step counts, the scheduler, the RNG, the critic
    and its optimizer, LoRA's adapters' optimizer state) is tensors and plain data: it loads with
    weights_only=True and the resumed trainer's next step is the saved trainer's, bit for bit.

    With torch on one thread, as an actor of the default runs on 2 cores has it
    (rft.plan.placement.torch_threads): with two, on a loaded machine, the LoRA backward's
    gradients differed in their last bits between two trainers of the same weights and inputs in
    3 of 8 tries (the forward and the log-probs' gradients equal), with one in none of 8."""
    trainer = make_trainer(128, extra)
    trainer.train_step(experiences())
    trainer.save(str(tmp_path))
    state = torch.load(tmp_path / "trainer_state.pt", weights_only=True)
    assert set(state) == {"optimizer", "scheduler", "version", "rng", "critic"}
    assert (state["critic"] is not None) == ("algorithm=ppo" in extra)
    resumed = make_trainer(128, extra)
    resumed.load(str(tmp_path))
    assert resumed.version == 1 and torch.equal(torch.get_rng_state(), state["rng"])
    assert resumed.scheduler.state_dict() == trainer.scheduler.state_dict()
    torch.set_rng_state(state["rng"])  # the saved trainer's next step draws what the resumed one does
    m_t = trainer.train_step(experiences(seed=1))
    torch.set_rng_state(state["rng"])
    m_r = resumed.train_step(experiences(seed=1))
    assert m_r["loss/policy"] == m_t["loss/policy"] and resumed.fingerprint() == trainer.fingerprint()


@pytest.mark.parametrize("extra,needs_start", [([], False), (["algorithm=ppo", "algorithm.critic_lr=1e-3"], False),
                                               (["algorithm.kl_loss_fn=k3"], True),
                                               (["model.lora.rank=4", "model.lora.alpha=8"], True)],
                         ids=["grpo", "ppo-critic", "reference", "lora"])
@pytest.mark.slow
def test_a_trainer_built_for_its_checkpoint_reads_the_starting_weights_only_where_it_needs_them(
        tmp_path, monkeypatch, extra, needs_start, one_torch_thread):
    """A resumed stage builds its trainer from the checkpoint it loads (Trainer's `resume`): the
    policy's weights are read from hf/ as it is built, and the load reads them no more. The
    starting model's weights are read only for what is the starting model: the reference model
    and LoRA's base; where nothing is, the stage resumes with its weights file gone (a critic's
    weights come from trainer_state.pt). The next step is the saved trainer's, bit for bit, the
    critic's included."""
    import re
    import shutil

    from rft.trainer import state as trainer_state

    tiny = compose_cfg(["stages=[]"]).model
    ensure_model(tiny)
    start = tmp_path / "start"
    shutil.copytree(Path(tiny.model_path).expanduser(), start)
    args = [f"model.model_path={start}", "model.builder=null", "algorithm.optimizer.lr=1e-3", *extra]
    trainer = make_trainer(128, args)
    trainer.train_step(experiences())
    ckpt = tmp_path / "ckpt"
    trainer.save(str(ckpt))
    rng = torch.load(ckpt / "trainer_state.pt", weights_only=True)["rng"]
    if not needs_start:
        (start / "model.safetensors").unlink()  # nothing may read it
    monkeypatch.setattr(trainer_state, "load_hf_weights", lambda *a: pytest.fail("hf/ read a second time"))
    resumed = make_trainer(128, args, resume=ckpt)
    resumed.load(str(ckpt))
    if "algorithm.kl_loss_fn=k3" in extra:  # the stage's start, read from the starting model
        from safetensors.torch import load_file

        first = load_file(start / "model.safetensors")
        assert all(torch.equal(v, first[k]) for k, v in resumed.ref_model.state_dict().items() if k in first)
    torch.set_rng_state(rng)  # the saved trainer's next step draws what the resumed one does
    m_t = trainer.train_step(experiences(seed=1))
    torch.set_rng_state(rng)
    m_r = resumed.train_step(experiences(seed=1))
    assert m_r["loss/policy"] == m_t["loss/policy"] and resumed.fingerprint() == trainer.fingerprint()
    if trainer.critic is not None:
        mine, theirs = resumed.critic.model.state_dict(), trainer.critic.model.state_dict()
        assert m_r["critic/value_loss"] == m_t["critic/value_loss"] > 0
        assert all(torch.equal(v, theirs[k]) for k, v in mine.items())
    if needs_start:  # without the starting model's weights it does not build: they are read
        (start / "model.safetensors").unlink()
        with pytest.raises(ConfigError, match=re.escape(f"model.model_path='{start}' could not be loaded (OSError")):
            make_trainer(128, args, resume=ckpt)


# ---------------------------------------------------------------- the sampling distribution


def sampled(trainer, t, top_p=1.0, top_k=-1, n=8):
    """Experiences the stage's own weights sampled with these rollout args (an hf engine on the
    trainer's model), each carrying its sampling params as the explorer stores them."""
    from types import SimpleNamespace

    from rft.data.readers import encode_prompt
    from rft.rollout.engines.hf import HFEngine

    tok = trainer.tokenizer
    engine = HFEngine(trainer.cfg.model, SimpleNamespace(generate_batch_size=64), tok)
    args = SimpleNamespace(temperature=t, top_p=top_p, top_k=top_k, max_tokens=None)
    prompts = [encode_prompt(tok, [{"role": "user", "content": q}], 24) for q in ["123+456", "7+2", "301+402", "5+5"]]
    out = engine.generate(prompts, n, args, seed=5)
    rng = random.Random(0)
    return [Experience(p + s.token_ids, len(p), s.logprobs, reward=float(rng.random() < 0.5), group_id=str(i),
                       sampling={"temperature": t, "top_p": top_p, "top_k": top_k})
            for i, (p, g) in enumerate(zip(prompts, out)) for s in g]


@pytest.mark.parametrize("t,top_p,top_k", [(0.7, 1.0, -1), (1.3, 0.8, -1), (0.9, 1.0, 4), (0.7, 0.9, 6)])
def test_log_probs_are_recomputed_under_the_distribution_each_experience_was_sampled_from(t, top_p, top_k):
    from rft.data.experience import collate
    from rft.trainer.trainer import token_logprobs

    trainer = make_trainer(128)
    exps = sampled(trainer, t, top_p, top_k)
    full = collate(exps, trainer.tokenizer.pad_token_id)
    with torch.no_grad():
        logp, entropy = token_logprobs(trainer.model, full["input_ids"], full["attention_mask"],
                                       full["temperature"], full["top_p"], full["top_k"])
    for i, e in enumerate(exps):
        got = logp[i][full["response_mask"][i].bool()]
        torch.testing.assert_close(got, torch.tensor(e.logprobs), atol=1e-4, rtol=1e-4)
    assert torch.isfinite(entropy).all()
    if top_k > 0:  # a sampled token's distribution spans at most k tokens: entropy <= log(k)
        assert entropy[full["response_mask"].bool()].max() <= math.log(top_k) + 1e-5


@pytest.mark.parametrize("top_k,top_p", [(2, None), (2, 0.7), (3, None), (1, None)])
def test_a_top_k_cut_keeps_every_token_tied_with_the_kth_as_the_samplers_do(top_k, top_p):
    # transformers' TopKLogitsWarper and vLLM's top-k drop only the logits strictly below the k-th
    # largest, so tokens tied with it stay in the set (bfloat16 logits tie often). Logits
    # [3, 2, 2, 2, 0], k=2: the set is {3, 2, 2, 2}, log p(token 0) = 3 - log(e^3 + 3 e^2)
    # = -log(1 + 3/e) = -0.743668; keeping exactly k tokens gave -log(1 + 1/e) = -0.313262.
    # With top_p=0.7 after it: p = (0.4753, 0.1749 x 3) in that order; a token stays while the
    # mass before it is below 0.7: 0, 0.4753, 0.6502 stay, 0.8251 not: log p(token 0) =
    # -log(1 + 2/e) = -0.551445 (which of the tied tokens goes does not change it).
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    from rft.trainer.logprobs import _from_logits

    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 0.0]])
    target = torch.tensor([0])
    logp, _ = _from_logits(logits, target, torch.ones(1), None if top_p is None else torch.tensor([top_p]),
                           torch.tensor([top_k]), True)
    warped = TopKLogitsWarper(top_k)(None, logits.clone())
    if top_p is not None:
        warped = TopPLogitsWarper(top_p)(None, warped)
    expected = torch.log_softmax(warped, -1)[0, 0]
    torch.testing.assert_close(logp[0], expected, atol=1e-6, rtol=1e-6)
    if (top_k, top_p) == (2, None):
        assert logp.item() == pytest.approx(-math.log(1 + 3 / math.e), abs=1e-6)


class _FixedLogits(torch.nn.Module):
    """A model whose every position has the logits `bias` (its output layer's weights 0), -inf
    among them as a model may emit: what token_logprobs reads, in `dtype`."""

    def __init__(self, bias, dtype):
        super().__init__()
        from types import SimpleNamespace

        self.embed = torch.nn.Embedding(4, 2, dtype=dtype)
        self.head = torch.nn.Linear(2, len(bias), dtype=dtype)
        with torch.no_grad():
            self.head.weight.zero_()
            self.head.bias.copy_(torch.tensor(bias, dtype=dtype))
        self.config, self.dtype = SimpleNamespace(final_logit_softcapping=None), dtype

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.head(self.embed(input_ids)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_token_of_probability_0_adds_0_to_the_entropy_and_its_gradient(dtype):
    """A model that emits a -inf logit, with no top-k/top-p cut: the entropy -sum p log p had
    0 x -inf = NaN there (and a NaN gradient), where 0 log 0 is 0 (torch.special.entr, xlogy).
    Logits [0, 0, -inf]: p = (1/2, 1/2, 0), entropy ln 2 = 0.693147; [0, -inf, -inf]: 0.
    [ln 3, 0, -inf]: p = (3/4, 1/4, 0), entropy -(3/4 ln 3/4 + 1/4 ln 1/4) = 0.562335, and
    dH/dz_i = -p_i (ln p_i + H): -3/4 (-0.287682 + 0.562335) = -0.205990, then +0.205990, and 0."""
    from rft.trainer.logprobs import _from_logits, token_logprobs

    inf, one = float("inf"), torch.ones(2, dtype=dtype)
    for row, entropy in [([0.0, 0.0, -inf], math.log(2)), ([0.0, -inf, -inf], 0.0)]:
        logits = torch.tensor([row, row], dtype=dtype, requires_grad=True)
        _, h = _from_logits(logits, torch.tensor([0, 1]), one, None, None, True)
        assert h.dtype == dtype and h.tolist() == pytest.approx([entropy, entropy], abs=1e-7)
        h.sum().backward()
        assert torch.isfinite(logits.grad).all() and logits.grad.abs().max() < 1e-6  # a maximum and a minimum
    logits = torch.tensor([[math.log(3), 0.0, -inf]], dtype=dtype, requires_grad=True)
    _, h = _from_logits(logits, torch.tensor([0]), one[:1], None, None, True)
    h.sum().backward()
    assert h.item() == pytest.approx(0.562335, abs=1e-6)
    assert logits.grad[0].tolist() == pytest.approx([-0.205990, 0.205990, 0.0], abs=1e-6)
    if dtype == torch.float64:  # and the gradient of finite logits, with a top-k cut and without: the numerical one
        for top_k in (None, torch.tensor([2, 3])):
            z = torch.randn(2, 5, dtype=dtype, generator=torch.Generator().manual_seed(0), requires_grad=True)
            assert torch.autograd.gradcheck(lambda z: _from_logits(z, torch.tensor([0, 1]), one, None, top_k, True)[1], z)
    # through a model's output layer, whole and in chunks of one position (each chunk's logits
    # recomputed in the backward): the same, and the layer's gradients finite
    ids, mask = torch.tensor([[1, 2, 3, 1]]), torch.ones(1, 4, dtype=torch.long)
    for chunk in (None, 1):
        model = _FixedLogits([0.0, 0.0, -inf, -inf], dtype)
        _, h = token_logprobs(model, ids, mask, chunk_size=chunk)
        assert h[0].tolist() == pytest.approx([math.log(2)] * 3, abs=1e-7)
        h.sum().backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters()), chunk


@pytest.mark.slow  # 1.1 s alone, over the fast tier's second
def test_stale_experiences_sampled_at_another_temperature_start_at_ratio_one():
    # mode=train on a stored buffer sampled at T=0.7: the stale rows' ratio is taken against their
    # stored sampling log-probs (off_policy_correction=behavior); recomputed at T=0.7 with the
    # same weights it is exp(0) = 1 on every token: nothing clipped, approx KL 0. At T=1 it was not.
    trainer = make_trainer(128)
    exps = sampled(trainer, 0.7, top_p=0.9)
    trainer.version = 1  # the weights that sampled them are version 0: one step stale
    m = trainer.train_step(exps)
    assert m["actor/clip_frac"] == 0.0
    assert m["actor/approx_kl"] == pytest.approx(0.0, abs=1e-8)


def test_sampling_params_survive_every_buffer(tmp_path):
    from omegaconf import OmegaConf

    from rft.config import ExperienceBufferConfig
    from rft.data.buffer import make_buffer, read_experiences

    e = Experience([1, 2, 3], 2, [-0.5], sampling={"temperature": 0.7, "top_p": 0.9, "top_k": 5})
    for kind, path in [("sql", tmp_path / "b.db"), ("file", tmp_path / "b.jsonl")]:
        buf = make_buffer(OmegaConf.structured(ExperienceBufferConfig(storage_type=kind, path=str(path))))
        buf.put([e])
        assert buf.get(1, 1.0)[0].sampling == e.sampling
        assert read_experiences(str(path), 1)[0].sampling == e.sampling
        buf.close()


@pytest.mark.slow  # two trainers built (~10 s)
def test_dpo_metrics_are_per_pair_means_whatever_the_micro_batches():
    from rft.data.tasks import ensure_task_data

    data = "${buffer.explorer_input.taskset.path}"
    extra = ["algorithm=dpo", "mode=train", "buffer.train_batch_size=4",
             "buffer.trainer_input.experience_buffer.storage_type=file",
             f"buffer.trainer_input.experience_buffer.path={data}",
             "buffer.trainer_input.experience_buffer.format.chosen_key=answer",
             "buffer.trainer_input.experience_buffer.format.rejected_key=rejected"]
    prompt = [1, 5, 102, 9, 2, 102, 1, 6, 102]
    # two pairs of unequal length: 1 response token a row, then 5
    pairs = [Experience(prompt + r, len(prompt), [], group_id=g)
             for r, g in [([7], "a"), ([8], "a"), ([9, 10, 11, 12, 13], "b"), ([13, 12, 11, 10, 9], "b")]]
    metrics = []
    for micro in (2, 4):  # a pair per micro-batch, or both in one
        cfg = stage_configs(compose_cfg(["stages=[]", "cluster=inline", f"trainer.micro_batch_size_per_gpu={micro}",
                                         *extra]))[0]
        ensure_model(cfg.model)
        ensure_task_data(cfg.buffer.explorer_input)
        trainer = Trainer(cfg, make_plan(cfg, 2000))
        with torch.no_grad():  # move the policy off its reference, the same way in both
            gen = torch.Generator().manual_seed(0)
            for p in trainer.model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        metrics.append(trainer.train_step(pairs))
    one_each, both = metrics
    assert both["dpo/reward_margin"] != 0.0
    # a mean over the 2 pairs, not weighted by their tokens: the same for both splits (before, a
    # micro-batch's tokens-per-pair scaled it: 0.074 against 0.056)
    assert one_each["dpo/reward_margin"] == pytest.approx(both["dpo/reward_margin"], rel=1e-5)
    assert one_each["dpo/accuracy"] == pytest.approx(both["dpo/accuracy"]) and both["dpo/accuracy"] in (0.0, 0.5, 1.0)
    assert one_each["loss/policy"] == pytest.approx(both["loss/policy"], rel=1e-5)


def test_the_decoupled_behaviour_weight_weights_the_policy_loss_alone():
    # off_policy_correction=decoupled with a KL loss and an entropy bonus: the trainer's terms in
    # its own order, on one token with policy loss 1, behaviour weight 5, KL (k1) 0.2, entropy 0.3
    from types import SimpleNamespace

    from rft.trainer.step import _Rows

    trainer = make_trainer(128, ["algorithm.off_policy_correction=decoupled", "algorithm.kl_loss_fn=k1",
                                 "algorithm.kl_loss_coef=1.0", "algorithm.entropy_coef=1.0"])
    step = SimpleNamespace(behavior_w=torch.full((1, 2), 5.0), ref_logp=torch.zeros(1, 2), sums={"actor/kl": 0.0})
    loss = torch.ones(1, 1)
    for term in trainer.terms:
        loss = term(loss, torch.full((1, 1), 0.2), torch.full((1, 1), 0.3), torch.ones(1, 1), _Rows(0, 1, 2), step)
    # 5 * 1 + 1.0 * 0.2 - 1.0 * 0.3 = 4.9 (the KL weighted too would give 5 * 1.2 - 0.3 = 5.7)
    assert loss.item() == pytest.approx(4.9)


@pytest.mark.slow  # a tiny trainer, five steps (~3 s)
def test_an_update_whose_gradient_is_not_finite_is_skipped_and_a_diverged_run_stops():
    from rft.errors import RunError
    from rft.sync.weights import same_weights
    from rft.trainer.step import MAX_NONFINITE_STEPS

    t = make_trainer(128, ["algorithm.optimizer.lr=1e-2"])
    before = t.fingerprint()
    # a NaN in one weight's gradient (as a diverged loss or a NaN score gives): clipping would
    # spread it to every gradient, and Adam into every weight and its moments, for good
    poison = t.model.lm_head.weight.register_hook(lambda g: g * float("nan"))
    m = t.train_step(experiences())
    assert m["actor/skipped_updates"] == 1 and math.isnan(m["actor/grad_norm"])
    assert same_weights(t.fingerprint(), before)  # not applied: the weights are as they were
    assert all(not s for s in t.optimizer.state.values())  # nor did Adam's moments take it
    poison.remove()
    m = t.train_step(experiences(seed=1))  # a finite gradient: trained as usual
    assert m["actor/skipped_updates"] == 0 and math.isfinite(m["actor/grad_norm"])
    assert not same_weights(t.fingerprint(), before)
    assert all(torch.isfinite(p).all() for p in t.model.parameters())
    # MAX_NONFINITE_STEPS (3) steps in a row with every update skipped: the run stops
    t.model.lm_head.weight.register_hook(lambda g: g * float("nan"))
    for i in range(MAX_NONFINITE_STEPS - 1):
        assert t.train_step(experiences(seed=2 + i))["actor/skipped_updates"] == 1
    with pytest.raises(RunError) as e:
        t.train_step(experiences(seed=9))
    assert str(e.value) == (
        "the policy's gradient was not finite (NaN or inf) in every update of the last 3 steps, so none was "
        "applied (actor/skipped_updates) and the model cannot learn: the loss diverged. Lower "
        "algorithm.optimizer.lr or trainer.grad_clip, check the rewards and the model's scores, or resume from "
        "an earlier checkpoint.")


@pytest.mark.slow  # a tiny trainer, two steps (~2 s)
def test_a_run_shorter_than_the_divergence_limit_whose_every_update_was_skipped_stops():
    # buffer.total_steps=2 < MAX_NONFINITE_STEPS (3): both steps' updates skipped used to end the
    # run with exit 0 and the starting weights (a study loss returning NaN, on a short test run)
    from rft.errors import RunError

    t = make_trainer(128, ["buffer.total_steps=2"])
    assert t.plan.total_steps == 2
    t.model.lm_head.weight.register_hook(lambda g: g * float("nan"))
    assert t.train_step(experiences())["actor/skipped_updates"] == 1  # one of two: not yet
    with pytest.raises(RunError) as e:
        t.train_step(experiences(seed=1))
    assert str(e.value).startswith(
        "the policy's gradient was not finite (NaN or inf) in every update of each of this run's 2 step(s), so none "
        "was applied (actor/skipped_updates) and the model cannot learn")
