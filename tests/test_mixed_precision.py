"""trainer.fp32_master_weights: trainer=fsdp2 keeps float32 weights, gradients and Adam under
bfloat16 compute. The engines get the weights cast to bfloat16 (the fingerprint is of those), a
checkpoint keeps the float32 ones, and over 50 steps the float32 masters track a float32 run where
pure bfloat16 loses almost every update (each smaller than a weight's rounding step)."""

import os

import pytest
import torch
import torch.distributed as dist
from conftest import compose_cfg
from resume_support import run_to_end
from test_runtime import base, env_for
from test_trainer import experiences

from rft.errors import ConfigError
from rft.models import ensure_model, load_model
from rft.plan.batch import make_plan, stage_configs
from rft.reporting.monitor import read_metrics
from rft.sync.weights import fingerprint
from rft.trainer.fsdp import FSDPTrainer

MASTERS = ["model.dtype=bfloat16", "trainer.fp32_master_weights=true"]


def one_rank(*extra, lr=1e-5, init_path=None, resume=None) -> FSDPTrainer:
    """trainer=fsdp2 as one rank in this process (its store hosted here, as the driver does);
    `resume`: built for that checkpoint, as a resumed stage builds it (its `load` must follow)."""
    cfg = stage_configs(compose_cfg(["stages=[]", "trainer=fsdp2", "trainer.ranks=1", "trainer.micro_batch_size_per_gpu=64",
                                     f"algorithm.optimizer.lr={lr}", *extra]))[0]
    ensure_model(cfg.model)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    trainer = FSDPTrainer(cfg, make_plan(cfg, 2000), init_path, 0, 1, ("127.0.0.1", store.port), resume)
    trainer._store = store  # alive as long as the trainer
    return trainer


@pytest.mark.slow  # 1.2 s alone, over the fast tier's second
def test_masters_are_float32_and_the_engines_get_the_bfloat16_compute_weights(tmp_path):
    t = one_rank(*MASTERS)
    try:
        assert {p.dtype for p in t.model.parameters()} == {torch.float32}
        t.train_step(experiences())
        masters = t._full_state()
        served = t.weights()
        # what leaves for the engines: each float32 master rounded to bfloat16, as FSDP2 casts it
        # for the trainer's own forward; the fingerprint is of those (an engine in bfloat16 equals it)
        assert set(served) == set(masters)
        for k, v in masters.items():
            assert served[k].dtype == torch.bfloat16 and torch.equal(served[k], v.to(torch.bfloat16)), k
        engine = load_model(t.cfg.model)  # as the hf engine holds it: bfloat16, tied weights once
        engine.load_state_dict(served)
        assert t.fingerprint() == fingerprint(engine.parameters()) != fingerprint(p.to_local() for p in t.model.parameters())
        assert {dtype for _, _, dtype in t.weights_manifest()} == {"bfloat16"}
        # the checkpoint keeps the float32 masters: a resumed trainer has them to the bit
        t.save(str(tmp_path))
        t.close()
        t = one_rank(*MASTERS)
        t.load(str(tmp_path))
        assert t.version == 1
        for k, v in t._full_state().items():
            assert v.dtype == torch.float32 and torch.equal(v, masters[k]), k
    finally:
        t.close()


def test_fp32_master_weights_need_fsdp2():
    cfg = stage_configs(compose_cfg(["stages=[]", "cluster=inline", *MASTERS]))[0]
    with pytest.raises(ConfigError) as e:
        make_plan(cfg, 2000)
    assert str(e.value) == (
        "trainer.fp32_master_weights=true needs trainer=fsdp2 (FSDP2 keeps float32 weights and casts them to "
        "model.dtype=bfloat16 for each block's compute; trainer=torch computes in the weights' own dtype). Use "
        "trainer=fsdp2 (trainer.ranks=1 for one process) or set trainer.fp32_master_weights=false.")


def _norm(d: dict) -> float:
    return float(sum((v.double() ** 2).sum() for v in d.values()).sqrt())


def _trained(*extra, steps: int) -> tuple[dict, dict]:
    """The weights (float64 copies) before and after `steps` steps of fresh GRPO batches."""
    t = one_rank(*extra)
    try:
        before = {k: v.double() for k, v in t._full_state().items()}
        for s in range(steps):
            t.train_step(experiences(seed=s))
        return before, {k: v.double() for k, v in t._full_state().items()}
    finally:
        t.close()


@pytest.mark.slow  # 3 x 50 steps (~1 min)
def test_fp32_masters_track_a_float32_run_where_pure_bfloat16_loses_the_updates():
    # lr 1e-5: Adam moves a weight by about lr a step, below half the bfloat16 rounding step of a
    # weight of magnitude >= 2^-8 (2^-8 x 2^-8 = 1.5e-5), so pure bfloat16 rounds most updates away
    runs = {"fp32": _trained("model.dtype=float32", steps=50), "bf16": _trained("model.dtype=bfloat16", steps=50),
            "masters": _trained(*MASTERS, steps=50)}
    w0, w = runs["fp32"]
    update = {k: w[k] - w0[k] for k in w}
    # each run's own update (its weights after less its weights before: pure bfloat16 starts from
    # the rounded weights) against the float32 run's, relative to the float32 run's size
    error = {name: _norm({k: b[k] - a[k] - update[k] for k in update}) / _norm(update)
             for name, (a, b) in runs.items() if name != "fp32"}
    # measured: bf16 0.95 (almost every update lost), masters 0.004 (the compute's rounding)
    assert error["masters"] < 0.05 and error["bf16"] > 0.5, error
    assert error["masters"] < error["bf16"] / 10, error


@pytest.mark.slow  # a training run
def test_a_run_with_fp32_masters_syncs_the_bfloat16_weights_to_its_engine(warm_start, tmp_path):
    # every sync compares the engine's fingerprint with the trainer's: a run that finishes agreed
    # run.py forked from a process that imported torch (resume_support.run_to_end: the same command
    # without a fresh interpreter's imports, ~4 s)
    r = run_to_end(base(warm_start, "masters", "cluster=inline", "trainer=fsdp2", "trainer.ranks=1", *MASTERS,
                        "buffer.total_steps=3"), {**os.environ, **env_for(tmp_path)}, tmp_path / "run")
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = read_metrics(next(tmp_path.rglob("metrics.jsonl")))
    assert [m["step"] for m in metrics if "loss/policy" in m] == [1, 2, 3]


@pytest.mark.slow  # 10.1 s alone, over the fast tier's second
def test_the_reference_and_the_critic_offload_on_their_own_and_train_alike():
    # PPO with a KL term: a reference and a critic beside the policy; offloaded, only where their
    # shards live changes (the CPU here too), not one number
    ppo = ["algorithm=ppo", "algorithm.critic_warmup=0", "algorithm.kl_loss_fn=low_var_kl", "algorithm.kl_loss_coef=0.1"]
    metrics = []
    for offload in ([], ["trainer.ref_offload=true", "trainer.critic_offload=true"]):
        t = one_rank(*ppo, *offload, lr=1e-4)
        try:
            from torch.distributed.fsdp import CPUOffloadPolicy

            offloaded = {name: isinstance(m._get_fsdp_state()._fsdp_param_group.offload_policy, CPUOffloadPolicy)
                         for name, m in (("policy", t.model), ("reference", t.ref_model), ("critic", t.critic.model))}
            assert offloaded == {"policy": False, "reference": bool(offload), "critic": bool(offload)}
            metrics.append([t.train_step(experiences(seed=s)) for s in range(2)])
        finally:
            t.close()
    for plain, off in zip(*metrics):
        assert plain["actor/kl"] > 0 or plain is metrics[0][0]  # the reference is read (0 only at the start)
        for key in ("loss/policy", "actor/grad_norm", "critic/value_loss", "actor/kl"):
            assert off[key] == plain[key], key
