"""On a CUDA machine: the trainer, trainer=fsdp2 (nccl) and the hf engine run on the GPU and agree
with the CPU. Skipped where no GPU is visible (CI has none; run `pytest tests/test_gpu.py` on one).

Not covered here yet, worth a look on a GPU: trainer.param_offload's peak GPU memory at load (the
model goes whole onto the GPU before fully_shard moves its shards to the CPU); an explorer with
explorer=vllm holding a CUDA context of its own (rft.models.local_device calls current_device);
vLLM's collective receive fingerprinting on a thread beside the load (rft.rollout.engines.vllm_worker).
"""

import pytest
import torch
from conftest import compose_cfg
from test_trainer import experiences

from rft.models import ensure_model, load_tokenizer
from rft.plan.batch import make_plan, stage_configs
from rft.rollout.engines.hf import HFEngine
from rft.runtime.actors import InlineActor, start_trainer
from rft.sync.weights import same_weights
from rft.trainer.trainer import Trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")

# gpu_per_node=2 only so that the plan leaves the trainer a GPU beside the explorer's
COMMON = ["stages=[]", "cluster=inline", "trainer.micro_batch_size_per_gpu=16", "algorithm.optimizer.lr=1e-3"]


def trainer(*extra):
    cfg = stage_configs(compose_cfg([*COMMON, *extra]))[0]
    ensure_model(cfg.model)
    return cfg, make_plan(cfg, 2000)


def test_the_trainer_and_one_fsdp2_rank_train_on_the_gpu_as_on_the_cpu(tmp_path):
    cpu = Trainer(*trainer())
    gpu = Trainer(*trainer("cluster.gpu_per_node=2"))
    cfg, plan = trainer("cluster.gpu_per_node=2", "trainer=fsdp2", "trainer.ranks=1")
    fsdp = start_trainer(InlineActor, cfg, plan, None, "t", dict(log_dir=str(tmp_path), level="INFO"), [{}])
    assert gpu.device.type == "cuda" and next(gpu.model.parameters()).is_cuda
    assert same_weights(fsdp.call("fingerprint"), cpu.fingerprint())
    batch = experiences()
    for rows in (batch, batch[:9], batch):
        m_cpu, m_gpu, m_fsdp = cpu.train_step(rows), gpu.train_step(rows), fsdp.call("train_step", rows)
        for key in ("loss/policy", "actor/grad_norm", "actor/entropy"):
            assert m_gpu[key] == pytest.approx(m_cpu[key], rel=1e-4, abs=1e-6), key
            assert m_fsdp[key] == pytest.approx(m_gpu[key], rel=1e-5, abs=1e-7), key
    for weights in (gpu.weights(), fsdp.call("weights")):
        assert all(not w.is_cuda for w in weights.values())  # what a sync sends is on the CPU
        for k, v in cpu.model.state_dict().items():
            torch.testing.assert_close(weights[k], v, rtol=1e-3, atol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
    # checkpoints cross devices and strategies
    fsdp.call("save", str(tmp_path))
    back = Trainer(*trainer())
    back.load(str(tmp_path))
    assert same_weights(back.fingerprint(), fsdp.call("fingerprint"))
    fsdp.kill()


def test_an_fsdp2_rank_with_its_shards_in_cpu_memory_trains_and_sends_from_the_gpu(tmp_path):
    # trainer.param_offload: shards and gradients on the CPU. The gradient clip's norm over them is
    # a collective of CPU tensors (gloo beside NCCL in the ranks' group); the collective send
    # gathers them on the CPU and broadcasts from the GPU over NCCL (a group of the trainer alone)
    cpu = Trainer(*trainer())
    cfg, plan = trainer("cluster.gpu_per_node=2", "trainer=fsdp2", "trainer.ranks=1", "trainer.param_offload=true")
    fsdp = start_trainer(InlineActor, cfg, plan, None, "t", dict(log_dir=str(tmp_path), level="INFO"), [{}])
    m_cpu, m_fsdp = cpu.train_step(experiences()), fsdp.call("train_step", experiences())
    assert m_fsdp["actor/grad_norm"] == pytest.approx(m_cpu["actor/grad_norm"], rel=1e-4)
    address, port = fsdp.call("collective_address")
    fsdp.call("collective_init", address, port, 1, 0)
    fsdp.call("collective_send")
    weights = fsdp.call("weights")
    for k, v in cpu.model.state_dict().items():  # the step was the CPU's (float summation order apart)
        torch.testing.assert_close(weights[k], v, rtol=1e-3, atol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
    fsdp.kill()


def test_the_hf_engine_generates_on_the_gpu_and_takes_cpu_weights():
    cfg, _ = trainer("cluster.gpu_per_node=2")
    tok = load_tokenizer(cfg.model)
    engine = HFEngine(cfg.model, cfg.explorer.rollout_model, tok, device="cuda")
    assert next(engine.model.parameters()).is_cuda
    args = cfg.buffer.explorer_input.taskset.rollout_args
    out = engine.generate([tok.encode("1+2=")], 4, args, seed=0)
    assert len(out[0]) == 4 and all(len(s.token_ids) == len(s.logprobs) > 0 for s in out[0])
    cpu = Trainer(*trainer())
    engine.update_weights(cpu.weights())
    assert engine.differs(cpu.weights()) == []  # the CPU copies checked against the GPU's bits
    assert same_weights(engine.fingerprint(), cpu.fingerprint())


def test_a_colocated_trainer_hands_its_cached_memory_back_after_a_step():
    # the engine on the same GPU wakes next and takes its gpu_memory_utilization again
    # at the 0.5B shape: a micro-batch's float32 logits over 151,936 tokens alone are ~0.2 GB
    t = Trainer(*trainer("model=qwen2.5-0.5b-shape", "cluster.gpu_per_node=1", "cluster.colocate=true"))
    t.train_step(experiences())
    # the step's activations are freed and their cached blocks returned to the driver: the
    # allocator reserves what is allocated (weights, Adam) and its rounding, not the step's peak
    assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() < 64 * 2**20
    assert torch.cuda.max_memory_allocated() > torch.cuda.memory_reserved() + 2**28


def test_a_run_on_mapped_devices_trains_on_the_gpu_it_was_shown(tmp_path):
    # cluster.device_mapping on this machine's first GPU: the trainer and the engine both on device
    # 0 (colocated), Ray asked for no GPU by them, each shown the GPU by CUDA_VISIBLE_DEVICES
    import os

    pytest.importorskip("ray", reason="cluster=local needs Ray (pip install ray): not installed here")
    from conftest import run_cli

    from rft.reporting.monitor import read_metrics

    first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    r = run_cli("stages=[]", "name=mapped", "monitor=console", "cluster=local", "cluster.gpu_per_node=1",
                "sync=memory", "explorer=hf", "cluster.device_mapping.trainer=[0]", "cluster.device_mapping.explorer=[0]",
                "buffer.total_steps=2", "explorer.eval_interval=100", "explorer.eval_on_startup=false",
                env={"RFT_CHECKPOINT_ROOT_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "rft" / "mapped"
    for actor in ("grpo_trainer", "grpo_explorer"):
        assert f"CUDA_VISIBLE_DEVICES={first}" in (run / "log" / f"{actor}.log").read_text(), actor
    trained = [m for m in read_metrics(run / "metrics.jsonl") if "perf/max_memory_gb" in m]
    # what torch allocated on the GPU for the tiny model (a few MB); on the CPU this would be the
    # process's resident set, over 0.3 GB with torch loaded
    assert len(trained) == 2 and all(0 < m["perf/max_memory_gb"] < 0.2 for m in trained)
