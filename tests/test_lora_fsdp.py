"""LoRA with trainer=fsdp2: the ranks shard the frozen base and the adapters together and train the
adapters as trainer=torch does; what leaves them (syncs, fingerprints, checkpoints) is trainer=torch's
LoRA: the merged model under the base's names, the adapter in PEFT's format."""

import threading

import pytest
import ray
import torch
import torch.distributed as dist
from conftest import compose_cfg
from test_fsdp import assert_same_model, configs, fsdp_group
from test_trainer import experiences, make_trainer

from rft.errors import ConfigError
from rft.models import ensure_model, load_model
from rft.plan.batch import make_plan, stage_configs
from rft.sync.weights import broadcast, fingerprint, open_group, same_weights
from rft.trainer.fsdp import FSDPTrainer
from rft.trainer.trainer import Trainer

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "algorithm.optimizer.lr=1e-2"]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def one_rank(*extra) -> FSDPTrainer:
    """trainer=fsdp2 with LoRA as one rank in this process (its store hosted here, as the driver does)."""
    cfg = stage_configs(compose_cfg(["stages=[]", "trainer=fsdp2", "trainer.ranks=1", "trainer.micro_batch_size_per_gpu=64",
                                     *LORA, *extra]))[0]
    ensure_model(cfg.model)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    trainer = FSDPTrainer(cfg, make_plan(cfg, 2000), None, 0, 1, ("127.0.0.1", store.port))
    trainer._store = store  # alive as long as the trainer
    return trainer


def split(state: dict) -> tuple[dict, dict]:
    """A PeftModel's state dict as (base, adapters), copies (one CPU rank's gathered tensors may be
    its own parameters)."""
    return ({k: v.clone() for k, v in state.items() if ".lora_" not in k},
            {k: v.clone() for k, v in state.items() if ".lora_" in k})


def engine_fingerprint(cfg_model, weights: dict) -> str:
    """The fingerprint an hf engine computes after loading `weights` (its parameters, tied ones once)."""
    engine = load_model(cfg_model)
    engine.load_state_dict(weights)
    return fingerprint(engine.parameters())


def test_the_plan_takes_lora_with_fsdp2():
    cfg = stage_configs(compose_cfg(["stages=[]", "trainer=fsdp2", *LORA]))[0]
    assert make_plan(cfg, 2000).dp_size == 2


@pytest.mark.slow  # 3.6 s alone, over the fast tier's second
def test_one_rank_trains_the_adapters_bit_for_bit_as_trainer_torch():
    # one rank, micro-batches of 64 as trainer=torch's: the same computation in the same order, so
    # the same bits (two ranks: tests below, equal up to summation order)
    fsdp, torch_ = one_rank(), make_trainer(64, LORA)
    try:
        base0, adapters0 = split(fsdp._full_state())
        assert fsdp.fingerprint() == torch_.fingerprint()
        # the optimizer holds the adapters alone: 2 layers x 7 linear layers x r x (in + out)
        held = sum(p.numel() for g in fsdp.optimizer.param_groups for p in g["params"])
        assert held == sum(v.numel() for v in adapters0.values()) == sum(
            p.numel() for p in torch_.model.parameters() if p.requires_grad)
        for seed in range(2):
            m_f, m_t = fsdp.train_step(experiences(seed=seed)), torch_.train_step(experiences(seed=seed))
            assert m_f["loss/policy"] == m_t["loss/policy"]
        base, adapters = split(fsdp._full_state())
        assert all(torch.equal(base[k], v) for k, v in base0.items())  # the frozen base, bitwise
        assert all(not torch.equal(adapters[k], v) for k, v in adapters0.items())  # B moves first, then A
        assert fsdp.fingerprint() == torch_.fingerprint()
        w_f, w_t = fsdp.weights(), torch_.weights()
        assert set(w_f) == set(w_t) and all(torch.equal(w_f[k], w_t[k]) for k in w_t)
        assert fsdp.weights_manifest() == torch_.weights_manifest()
    finally:
        fsdp.close()


@pytest.mark.parametrize("extra", [[], ["model.dtype=bfloat16", "trainer.fp32_master_weights=true"]],
                         ids=["float32", "fp32_masters"])
@pytest.mark.slow  # 2.0 s alone, over the fast tier's second
def test_the_engine_gets_the_merged_model_and_its_fingerprint(extra):
    t = one_rank(*extra)
    try:
        t.train_step(experiences())
        weights = t.weights()
        # the base model's own names: an engine loads it as is
        assert not any("lora_" in k or "base_layer" in k or k.startswith("base_model") for k in weights)
        assert "model.layers.0.self_attn.q_proj.weight" in weights
        # served in model.dtype (with float32 masters: the merged float32 weights cast to bfloat16)
        dtype = torch.bfloat16 if extra else torch.float32
        assert {v.dtype for v in weights.values()} == {dtype}
        assert same_weights(engine_fingerprint(t.cfg.model, weights), t.fingerprint())
        # merged = W + (alpha / rank = 8 / 4 = 2) x B A, from the gathered shards
        full = t._full_state()
        prefix = "base_model.model.model.layers.0.self_attn.q_proj."
        w, a, b = (full[prefix + k] for k in ("base_layer.weight", "lora_A.default.weight", "lora_B.default.weight"))
        want = (w + 2 * (b @ a)).to(dtype)
        assert torch.equal(weights["model.layers.0.self_attn.q_proj.weight"], want)
        assert (b @ a).abs().max() > 1e-4  # a step moved B off its initial 0
        # what collective sync sends: the manifest's names, shapes and dtypes, in that order
        manifest = t.weights_manifest()
        engine = load_model(t.cfg.model)
        assert [n for n, _, _ in manifest] == [n for n, _ in sorted(engine.named_parameters())]
        assert {d for _, _, d in manifest} == {str(dtype).removeprefix("torch.")}
    finally:
        t.close()


def test_the_collective_send_is_the_merged_model_in_the_manifests_order():
    t = one_rank()
    try:
        t.train_step(experiences())
        manifest, weights = t.weights_manifest(), t.weights()
        received = [torch.zeros(shape, dtype=getattr(torch, dtype)) for _, shape, dtype in manifest]

        def explorer(address, port):  # rank 1 of the trainer -> explorers group, in a thread here
            broadcast(open_group(address, port, 2, 1, 60, "cpu"), received)

        address, port = t.collective_address()
        thread = threading.Thread(target=explorer, args=(address, port))
        thread.start()
        t.collective_init(address, port, 2, 0)
        t.collective_send()
        thread.join(60)
        assert not thread.is_alive()
        assert all(torch.equal(r, weights[n]) for r, (n, _, _) in zip(received, manifest))
        assert fingerprint(received) == t.fingerprint()
    finally:
        t.close()


@pytest.mark.slow  # 2.1 s alone, over the fast tier's second
def test_checkpoints_are_trainer_torch_lora_checkpoints_both_ways(tmp_path):
    from safetensors.torch import load_file

    fsdp, torch_ = one_rank(), make_trainer(64, LORA)
    try:
        fsdp.train_step(experiences())
        torch_.train_step(experiences())
        (tmp_path / "fsdp").mkdir()
        fsdp.save(str(tmp_path / "fsdp"), with_hf=False)
        (tmp_path / "torch").mkdir()
        torch_.save(str(tmp_path / "torch"), with_hf=False)
        # the same layout: adapter/ in PEFT's format (its keys without the adapter's name), no hf/
        got, want = (load_file(tmp_path / d / "adapter" / "adapter_model.safetensors") for d in ("fsdp", "torch"))
        assert sorted(got) == sorted(want) and "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in got
        assert all(torch.equal(got[k], want[k]) for k in want)  # one rank trains as trainer=torch, bitwise
        assert not (tmp_path / "fsdp" / "hf").exists() and (tmp_path / "fsdp" / "adapter" / "adapter_config.json").exists()
        saved_base, saved = split(fsdp._full_state())
        fsdp.close()
        # a fresh fsdp2 rank resumes its own: the adapters bitwise, the base untouched, the version
        fsdp = one_rank()
        fsdp.load(str(tmp_path / "fsdp"))
        base, adapters = split(fsdp._full_state())
        assert fsdp.version == 1 and all(torch.equal(adapters[k], v) for k, v in saved.items())
        assert all(torch.equal(base[k], v) for k, v in saved_base.items())
        # and trainer=torch's, Adam's moments included: the next step is trainer=torch's to the bit
        fsdp.load(str(tmp_path / "torch"))
        assert fsdp.fingerprint() == torch_.fingerprint()
        m_f, m_t = fsdp.train_step(experiences(seed=1)), torch_.train_step(experiences(seed=1))
        assert m_f["loss/policy"] == m_t["loss/policy"] and fsdp.fingerprint() == torch_.fingerprint()
        # trainer=torch resumes the fsdp2 checkpoint
        resumed = make_trainer(64, LORA)
        resumed.load(str(tmp_path / "fsdp"))
        assert resumed.version == 1
        assert all(torch.equal(v, saved["base_model.model." + k.removeprefix("base_model.model.")])
                   for k, v in resumed.model.state_dict().items() if ".lora_" in k)
    finally:
        fsdp.close()


def test_a_checkpoint_with_hf_holds_the_merged_model(tmp_path):
    from transformers import AutoModelForCausalLM

    t = one_rank()
    try:
        t.train_step(experiences())
        t.save(str(tmp_path))
        assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
        assert same_weights(fingerprint(plain.parameters()), t.fingerprint())
    finally:
        t.close()


def test_a_lora_layer_that_is_not_linear_is_refused():
    with pytest.raises(ConfigError) as e:
        one_rank("model.lora.target_modules=[embed_tokens,q_proj]")
    assert str(e.value) == (
        "model.lora.target_modules names model.embed_tokens (Embedding), but trainer=fsdp2 merges the adapters of "
        "Linear layers only. Name linear layers alone in model.lora.target_modules (e.g. q_proj, v_proj, or all-linear), or "
        "use trainer=torch.")


@pytest.mark.slow  # two Ray ranks
def test_two_ranks_train_the_adapters_as_one_process_does(local_ray, tmp_path):
    (one_cfg, one_plan), (two_cfg, two_plan) = configs(*LORA)
    # micro-batches of 4 over 128 experiences: one process 32 passes, each rank 16
    assert (one_plan.micro_batches_per_update, two_plan.micro_batches_per_update) == (32, 16)
    one = Trainer(one_cfg, one_plan)
    two = fsdp_group(two_cfg, two_plan, tmp_path)
    base0, adapters0 = split(two.call("_full_state"))
    assert same_weights(two.call("fingerprint"), one.fingerprint())
    for seed in range(2):
        m_one, m_two = one.train_step(experiences(seed=seed)), two.call("train_step", experiences(seed=seed))
        assert m_two["loss/policy"] == pytest.approx(m_one["loss/policy"], rel=1e-4, abs=1e-6)
        assert m_two["actor/grad_norm"] == pytest.approx(m_one["actor/grad_norm"], rel=1e-4)
    base, adapters = split(two.call("_full_state"))
    assert all(torch.equal(base[k], v) for k, v in base0.items())
    assert all(not torch.equal(adapters[k], v) for k, v in adapters0.items())
    # the merged weights, equal up to summation order (lr 1e-2 x 2 steps: atol 1e-5 is 0.05% of a step)
    weights = two.call("weights")
    assert_same_model(weights, _as_module(one.weights()))
    # the group's fingerprint is of those weights, as an engine loading them computes it
    assert same_weights(engine_fingerprint(one.cfg.model, weights), two.call("fingerprint"))
    assert two.call("weights_manifest") == one.weights_manifest()
    # checkpoints across: trainer=torch resumes the ranks' adapter, the ranks trainer=torch's (each
    # rank keeping its shard); the merge is the same arithmetic on the same bits, so the same fingerprint
    for d in ("two", "one"):
        (tmp_path / d).mkdir()
    two.call("save", str(tmp_path / "two"), False)
    resumed = Trainer(one_cfg, one_plan)
    resumed.load(str(tmp_path / "two"))
    assert resumed.version == 2 and resumed.fingerprint() == two.call("fingerprint")
    one.save(str(tmp_path / "one"), False)
    two.call("load", str(tmp_path / "one"))
    assert two.call("fingerprint") == one.fingerprint()
    base, _ = split(two.call("_full_state"))
    assert all(torch.equal(base[k], v) for k, v in base0.items())
    two.kill()


class _as_module:
    """A state dict as assert_same_model reads a model (its state_dict())."""

    def __init__(self, state: dict):
        self._state = state

    def state_dict(self) -> dict:
        return self._state


def test_one_ranks_weights_are_a_copy_that_training_leaves_alone():
    # (with or without LoRA) one CPU rank gathers its own parameters: weights() copies them, as a
    # snapshot kept for a restarted explorer (keep_snapshots) must stay the version it was taken at
    from test_mixed_precision import one_rank as plain_rank

    t = plain_rank(lr=1e-3)
    try:
        weights = t.weights()
        before = {k: v.clone() for k, v in weights.items()}
        t.train_step(experiences())
        assert all(torch.equal(weights[k], v) for k, v in before.items())
        assert not torch.equal(t.weights()["model.norm.weight"], before["model.norm.weight"])
    finally:
        t.close()


# a LoRA run on two ranks whose rank 0 broadcasts the merged model (sync=collective, each sync
# fingerprint-checked), its checkpoints holding adapter/ and the merged hf/: the Ray case of
# tests/test_resume_matrix.py (fsdp2-two-ranks-ppo-lora-collective), which also resumes it bit for bit
