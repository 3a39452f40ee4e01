"""Errors the FAQs of Trinity-RFT, ROLL, verl and LightRFT list, met the same way here: each is one
paragraph naming the key and the fix, before the run starts."""

import importlib.util

import pytest
from conftest import compose_cfg

from rft.errors import ConfigError
from rft.plan.batch import _check_flash_attention, make_plan, stage_configs


def test_flash_attention_on_cpu_stops_the_plan():
    # before: the dry run passed, and the run stopped as its explorer loaded the model, with transformers'
    # "FlashAttention2 has been toggled on, but it cannot be used ..." and no key named
    with pytest.raises(ConfigError) as e:
        make_plan(stage_configs(compose_cfg(["stages=[]", "model.attn_implementation=flash_attention_2"]))[0], 2000)
    assert str(e.value) == (
        "model.attn_implementation=flash_attention_2 runs on CUDA GPUs only, and this run has none "
        "(cluster.gpu_per_node=0): set cluster.gpu_per_node, or leave model.attn_implementation null (transformers' "
        "default, sdpa, which packs sequences as well).")


def test_flash_attention_without_its_package_stops(monkeypatch):
    # the Trinity-RFT FAQ's first error: flash_attn's ImportError on a GPU machine without the package
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("flash_attn_interface", "kernels") else real(name, *a))
    with pytest.raises(ConfigError) as e:
        _check_flash_attention("flash_attention_3", 8)
    assert str(e.value) == (
        "model.attn_implementation=flash_attention_3 needs the flash-attn-3 package, which is not installed in this "
        "environment (the one run.py starts from, shared by the actors it starts). Install it (`pip install "
        "flash-attn-3 --no-build-isolation`, built against this torch and CUDA), or leave model.attn_implementation "
        "null (transformers' default, sdpa, which packs sequences as well).")
    # with the package (or transformers' kernels from the hub), and for the other kernels: no objection
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert _check_flash_attention("flash_attention_2", 8) is None
    assert _check_flash_attention("sdpa", 0) is None and _check_flash_attention(None, 0) is None


def test_wandb_without_a_key_names_the_variables_that_fix_it(tmp_path, monkeypatch):
    # Trinity-RFT's FAQ: "UsageError: api_key not configured (no-tty)"; before, the paragraph ended "Fix what it
    # needs", naming neither WANDB_API_KEY nor WANDB_MODE=offline (nor, with a key and no network, the latter)
    from rft.reporting.monitor import start_trackers

    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DISABLED"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no saved login
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    cfg = compose_cfg(["monitor.monitor_type=[wandb]"])
    with pytest.raises(ConfigError) as e:
        start_trackers(cfg, tmp_path, "grpo", 0)
    assert str(e.value).startswith("monitor.monitor_type: the tracker wandb did not start: UsageError: ")
    assert str(e.value).endswith(
        ". wandb takes its key from WANDB_API_KEY (or `wandb login`); without a network to its server, "
        "WANDB_MODE=offline logs into the run's directory (`wandb sync` uploads it later), and WANDB_HTTPS_PROXY sets "
        "a proxy for wandb alone (HTTPS_PROXY would take a judge's and a remote reward's requests too), each in the "
        "environment run.py starts from, or leave it out of monitor.monitor_type (the console and metrics.jsonl are "
        "always on).")


def test_tensor_parallel_with_the_hf_engine_stops_the_plan():
    # before: the dry run planned "1 hf engine on 1 CPU each" and the run went on, the setting changing nothing
    # (on GPUs: two reserved an engine, one of them idle)
    with pytest.raises(ConfigError) as e:
        make_plan(stage_configs(compose_cfg(["stages=[]", "explorer.rollout_model.tensor_parallel_size=2"]))[0], 2000)
    assert str(e.value) == (
        "explorer.rollout_model.tensor_parallel_size=2 splits a vLLM engine over GPUs, but "
        "explorer.rollout_model.engine_type=hf runs each engine on one device (a GPU, or the CPU): the other devices "
        "would be reserved and idle. Set tensor_parallel_size=1 (more engines: explorer.rollout_model.engine_num), or "
        "use explorer=vllm on GPUs to split a model over several.")


def test_a_model_path_that_is_a_file_says_so(tmp_path):
    # before: "model.model_path='.../model.gguf': no such directory", of a file that exists
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ConfigError) as e:
        make_plan(stage_configs(compose_cfg(["stages=[]", "model=qwen2.5-0.5b", f"model.model_path={gguf}"]))[0], 2000)
    assert str(e.value) == (
        f"model.model_path='{gguf}' is a file, and a model in Hugging Face format is a directory (config.json, the "
        f"weights as *.safetensors, the tokenizer files). Give that directory, or a hub id (e.g. "
        f"Qwen/Qwen2.5-0.5B-Instruct); a GGUF file is not read here.")


def test_a_timeline_asked_of_a_run_without_ray_is_warned_about(caplog):
    # verl's FAQ: ray_init.timeline_file (here monitor.enable_ray_timeline). Before: cluster=inline took it, and
    # the run ended with no timeline.json and no word
    make_plan(stage_configs(compose_cfg(["stages=[]", "cluster=inline", "monitor.enable_ray_timeline=true"]))[0], 2000)
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "monitor.enable_ray_timeline=true writes Ray's timeline, and cluster=inline runs without Ray: no timeline.json "
        "will be written. Use cluster=local for one."]
    caplog.clear()
    make_plan(stage_configs(compose_cfg(["stages=[]", "monitor.enable_ray_timeline=true"]))[0], 2000)  # local: Ray
    assert [r for r in caplog.records if r.levelname == "WARNING"] == []
