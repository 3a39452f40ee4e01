"""LoRA (model.lora.rank > 0): only the adapters train, the reference is the base with adapters
off (no second copy), and what leaves the trainer is the merged model under the base's names."""

from types import SimpleNamespace

import pytest
import torch
from conftest import compose_cfg
from test_trainer import experiences, make_trainer

from rft.data.experience import collate
from rft.errors import ConfigError
from rft.models import load_model
from rft.plan.batch import make_plan, stage_configs
from rft.rollout.engines.hf import HFEngine
from rft.sync.weights import same_weights
from rft.trainer.logprobs import token_logprobs

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "algorithm.optimizer.lr=1e-2"]
KL = ["algorithm.kl_loss_fn=low_var_kl", "algorithm.kl_loss_coef=0.1"]


def numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.slow  # 2.2 s alone, over the fast tier's second
def test_only_the_adapters_train_and_the_base_stays_bitwise():
    t = make_trainer(128, LORA)
    base = {n: p.detach().clone() for n, p in t.model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in t.model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    # the optimizer holds exactly the adapters: 2 layers x 7 linear layers x (A: r x in + B: out x r)
    held = [p for g in t.optimizer.param_groups for p in g["params"]]
    assert sum(p.numel() for p in held) == sum(p.numel() for p in adapters.values())
    t.train_step(experiences())
    t.train_step(experiences(seed=1))
    after = dict(t.model.named_parameters())
    assert all(torch.equal(after[n], v) for n, v in base.items())
    # B starts at 0 (PEFT), so the first step moves B; by the second A moves too
    assert all(not torch.equal(after[n], v) for n, v in adapters.items())


@pytest.mark.slow
def test_the_reference_is_the_base_with_no_second_copy():
    lora_kl, full_kl = make_trainer(128, [*LORA, *KL]), make_trainer(128, KL)
    assert lora_kl.ref_model is None and lora_kl.has_reference
    base = numel(full_kl.model)
    adapters = sum(p.numel() for p in lora_kl.model.parameters() if p.requires_grad)
    # full fine-tuning with a KL term holds two models; LoRA one base and its adapters
    assert numel(full_kl.model) + numel(full_kl.ref_model) == 2 * base
    assert numel(lora_kl.model) == base + adapters and adapters < base / 10
    lora_kl.train_step(experiences())
    lora_kl.train_step(experiences(seed=1))
    # the reference log-probs are the untouched base model's
    full = collate(experiences(2, 2), lora_kl.tokenizer.pad_token_id)
    _, ref, _ = lora_kl._old_and_ref_logp(full, full["response_mask"], old=False)
    plain = load_model(lora_kl.cfg.model)
    with torch.no_grad():
        # from each row's last prompt token, as the trainer computes them (the prompt's are 0)
        want, _ = token_logprobs(plain, full["input_ids"], full["attention_mask"], first=full["prompt_length"] - 1)
    torch.testing.assert_close(ref, want, rtol=0, atol=1e-6)
    assert (ref[full["response_mask"].bool()] < 0).all()


@pytest.mark.slow  # 2.5 s alone, over the fast tier's second
def test_the_engine_gets_the_merged_model_and_computes_what_the_trainer_does():
    t = make_trainer(128, LORA)
    for seed in range(3):
        t.train_step(experiences(seed=seed))
    weights = t.weights()
    # the base model's own names (no PEFT prefixes, no adapters): an engine loads it as is
    assert not any("lora_" in k or "base_layer" in k or k.startswith("base_model") for k in weights)
    engine = HFEngine(t.cfg.model, SimpleNamespace(generate_batch_size=4), t.tokenizer)
    engine.update_weights(weights)
    # the same weights, as every sync checks them (rft.sync.weights.same_weights)
    assert same_weights(engine.fingerprint(), t.fingerprint())
    full = collate(experiences(4, 2, seed=7), t.tokenizer.pad_token_id)
    with torch.no_grad():
        got, _ = token_logprobs(engine.model, full["input_ids"], full["attention_mask"])
        want, _ = token_logprobs(t.model, full["input_ids"], full["attention_mask"])
        base, _ = token_logprobs(load_model(t.cfg.model), full["input_ids"], full["attention_mask"])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (want - base).abs().max() > 1e-2  # the adapters did change the policy
    # the collective sync sends the merged weights under the names the engine's parameters have
    assert [n for n, _, _ in t.weights_manifest()] == [n for n, _ in sorted(engine.model.named_parameters())]


def test_lora_config_errors():
    def error(*overrides):
        with pytest.raises(ConfigError) as e:
            make_plan(stage_configs(compose_cfg(["stages=[]", *overrides]))[0], 2000)
        return str(e.value)

    assert error("model.lora.rank=4", "model.lora.dropout=0.1") == (
        "model.lora.dropout=0.1: the trainer computes without dropout so that its log-probs are the ones the "
        "engine sampled with (the policy ratio's denominator). Set model.lora.dropout=0.")
    assert error("model.lora.rank=-1") == "model.lora.rank=-1 must be >= 0 (0: no LoRA, train every weight)."
    # trainer=fsdp2 trains adapters too (tests/test_lora_fsdp.py)
    assert make_plan(stage_configs(compose_cfg(["stages=[]", "model.lora.rank=4", "trainer=fsdp2"]))[0], 2000).dp_size == 2
    with pytest.raises(ConfigError) as e:
        make_trainer(8, ["model.lora.rank=4", "model.lora.target_modules=[attn_q]"])
    # the plan reads the module names from the weights' headers (tests/test_user_study6.py)
    assert str(e.value).startswith("model.lora.target_modules: 'attn_q' names no module of the model")


@pytest.mark.slow
def test_a_checkpoint_holds_the_merged_model_and_the_adapter_and_resumes(tmp_path):
    from transformers import AutoModelForCausalLM

    t = make_trainer(128, LORA)
    t.train_step(experiences())
    t.save(str(tmp_path))
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    # hf/ is the merged model, loadable by anyone as a plain model
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    full = collate(experiences(2, 2, seed=3), t.tokenizer.pad_token_id)
    with torch.no_grad():
        got, _ = token_logprobs(plain, full["input_ids"], full["attention_mask"])
        want, _ = token_logprobs(t.model, full["input_ids"], full["attention_mask"])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a fresh LoRA trainer resumes it: the same adapters, Adam state, and next step
    resumed = make_trainer(128, LORA)
    resumed.load(str(tmp_path))
    assert resumed.fingerprint() == t.fingerprint() and resumed.version == 1
    m_t, m_r = t.train_step(experiences(seed=1)), resumed.train_step(experiences(seed=1))
    assert m_r["loss/policy"] == m_t["loss/policy"] and resumed.fingerprint() == t.fingerprint()


@pytest.mark.slow
def test_lora_grpo_learns_from_the_warm_start(warm_start, tmp_path):
    from test_algorithms_learn import eval_start_end

    # rank 8 adapters on every linear layer (8% of the tiny model's weights), 10 GRPO steps at a
    # LoRA-sized lr (5x the full model's); measured 0.085 -> 0.995
    start, end = eval_start_end("grpo", warm_start, tmp_path,
                                ["model.lora.rank=8", "model.lora.alpha=16", "algorithm.optimizer.lr=1e-3"])
    assert end >= start + 0.2, (start, end)
