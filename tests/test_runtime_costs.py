"""What a run spends outside the model (issue 14): torch threads per actor, the memory sync's
payload, Ray's metrics export, and the TRL comparison's arithmetic."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from conftest import compose_cfg

from rft.errors import ConfigError
from rft.plan.placement import torch_threads
from rft.sync.weights import fingerprint, from_arrays, same_weights, to_arrays, weight_sums


@pytest.mark.parametrize("overrides, want", [
    # Ray on CPU, synchronous: explorer and trainer take turns, each uses the 1 + 1 CPUs they reserve
    (["synchronizer.sync_offset=0"], 2),
    (["synchronizer.sync_offset=0", "cluster.cpus_per_actor=2"], 4),
    # the explorer one step ahead (by default with Ray): both run at once, each on its own CPUs
    ([], 1),
    (["synchronizer.sync_offset=1"], 1),
    (["cluster.cpus_per_actor=2"], 2),
    # one process: the CPUs it is given
    (["cluster=inline"], 1),
    # 2 explorers then 1 trainer take turns over 3 CPUs: 3 // 2 each
    (["explorer.rollout_model.engine_num=2"], 1),
    (["explorer.rollout_model.engine_num=3"], 1),
    # 1 explorer, 2 fsdp2 ranks: 3 CPUs, 2 at once in the trainer's phase
    (["trainer=fsdp2"], 1),
    (["cluster.threads_per_actor=3"], 3),
    (["cluster.colocate=true"], 1),
])
def test_torch_threads_per_actor(overrides, want):
    assert torch_threads(compose_cfg(["stages=[]", *overrides])) == want


@pytest.mark.parametrize("overrides,want", [
    ([], 1),  # Ray, mode=both, explorer and trainer on CPUs of their own: side by side
    (["cluster=inline"], 0),  # one process: nothing runs side by side
    (["cluster.colocate=true"], 0),  # one bundle shared: they take turns
    (["mode=train", "buffer=sql"], 0),  # no explorer to run ahead
    (["synchronizer.sync_offset=0"], 0),  # what the user sets is kept
    (["synchronizer.sync_offset=2"], 2),
])
def test_a_null_sync_offset_is_settled_per_stage(overrides, want):
    from rft.plan.batch import check_config, stage_configs
    from rft.plan.placement import sync_offset

    cfg = compose_cfg(["stages=[]", *overrides])
    assert cfg.synchronizer.sync_offset in (None, want)  # null unless set
    assert sync_offset(cfg) == want
    (stage,) = stage_configs(cfg)
    assert stage.synchronizer.sync_offset == want
    check_config(cfg)  # an unsettled config is checked as its stage would be


def test_the_default_study_runs_its_explorer_one_step_ahead():
    from rft.plan.batch import stage_configs

    warmup, grpo = stage_configs(compose_cfg([]))
    # the warm-up (mode=train) has no explorer to run ahead; the GRPO stage's runs one step ahead
    assert (warmup.synchronizer.sync_offset, grpo.synchronizer.sync_offset) == (0, 1)


def test_threads_per_actor_below_one_is_a_config_error():
    with pytest.raises(ConfigError) as e:
        torch_threads(compose_cfg(["stages=[]", "cluster.threads_per_actor=0"]))
    assert str(e.value) == "cluster.threads_per_actor=0 must be >= 1 (or null)."


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_memory_sync_payload_round_trips_bit_for_bit(dtype):
    torch.manual_seed(0)
    sd = {"a": torch.randn(3, 4).to(dtype), "b": torch.randn(5).to(dtype)}
    arrays = to_arrays(sd)
    back = from_arrays(arrays)
    for k in sd:
        assert back[k].dtype == dtype
        assert torch.equal(back[k].view(torch.uint8), sd[k].view(torch.uint8))
    # the CPU tensors are viewed, not copied: the payload costs no copy before the object store's
    assert arrays["a"][0].__array_interface__["data"][0] == sd["a"].data_ptr()


def test_the_fingerprint_sums_each_elements_bits_as_an_integer():
    t = torch.tensor([1.0, -2.0, 3.0])
    # float32 bits as int32: 1.0 = 0x3F800000 = 1065353216, -2.0 = 0xC0000000 = -1073741824,
    # 3.0 = 0x40400000 = 1077936128; sum 1069547520 = 0x3FC00000
    assert weight_sums([t]) == [3, 1069547520]
    assert fingerprint([t]) == "3:000000003fc00000"
    # a tensor listed twice (tied weights) counts once; empty ones count nothing
    assert weight_sums({"emb": t, "head": t, "none": torch.empty(0)}) == [3, 1069547520]
    assert weight_sums([]) == [0, 0]
    # bfloat16 bits as int16: 1.0 = 0x3F80 = 16256, -2.0 = 0xC000 = -16384; -128 mod 2**64
    assert fingerprint([torch.tensor([1.0, -2.0], dtype=torch.bfloat16)]) == "2:ffffffffffffff80"
    # the same values in another dtype are other weights (a cast on one side is caught)
    assert fingerprint([t.double()]) != fingerprint([t])
    # exact whatever the summation order: the sum of the halves' is the whole's (as fsdp adds its shards')
    w = torch.randn(1_000_000, generator=torch.Generator().manual_seed(1))
    (n1, s1), (n2, s2) = weight_sums([w[:400_001]]), weight_sums([w[400_001:]])
    assert fingerprint([w]) == f"{n1 + n2}:{(s1 + s2) % 2**64:016x}"
    # one flipped bit (the lowest of one element's mantissa, a change of 1e-7 relative) changes it
    w2 = w.clone()
    w2.view(torch.int32)[123] ^= 1
    assert same_weights(fingerprint([w]), fingerprint([w.clone()]))
    assert not same_weights(fingerprint([w]), fingerprint([w2]))
    # a strided view is read as its elements
    m = torch.arange(6.0).view(2, 3)
    assert fingerprint([m.t()]) == fingerprint([m.t().contiguous()]) == fingerprint([m])


def test_a_local_ray_instance_exports_no_metrics_unless_asked(monkeypatch, tmp_path):
    import rft.runtime.main

    calls = []
    monkeypatch.delenv("RAY_enable_metrics_collection", raising=False)
    monkeypatch.setattr("ray.is_initialized", lambda: False)
    monkeypatch.setattr("ray.init", lambda **kw: calls.append((kw, os.environ.get("RAY_enable_metrics_collection"))))
    monkeypatch.setattr(rft.runtime.main, "_start_reaper", lambda: None)
    rft.runtime.main._start_ray(compose_cfg(["stages=[]"]), tmp_path)
    assert calls[-1][0]["include_dashboard"] is False and calls[-1][1] == "0"
    monkeypatch.delenv("RAY_enable_metrics_collection", raising=False)
    monkeypatch.setattr("ray._private.utils.get_dashboard_dependency_error", lambda: None)  # as with ray[default]
    rft.runtime.main._start_ray(compose_cfg(["stages=[]", "monitor.ray_dashboard=true"]), tmp_path)
    assert calls[-1][0]["include_dashboard"] is True and calls[-1][1] is None


def test_the_dashboard_without_its_packages_is_one_paragraph_before_ray_starts(monkeypatch, tmp_path):
    # the project installs minimal Ray (no aiohttp_cors): ray.init raised 'Cannot include dashboard with
    # missing packages' after its own log lines
    import rft.runtime.main
    from rft.errors import ConfigError

    monkeypatch.setattr("ray.is_initialized", lambda: False)
    monkeypatch.setattr("ray._private.utils.get_dashboard_dependency_error",
                        lambda: ModuleNotFoundError("No module named 'aiohttp_cors'"))
    monkeypatch.setattr("ray.init", lambda **kw: pytest.fail("ray.init called"))
    with pytest.raises(ConfigError) as e:
        rft.runtime.main._start_ray(compose_cfg(["stages=[]", "monitor.ray_dashboard=true"]), tmp_path)
    assert str(e.value) == (
        "monitor.ray_dashboard=true: Ray's dashboard needs the packages of ray[default], and this environment has "
        "minimal Ray (No module named 'aiohttp_cors'). Install them (pip install 'ray[default]'), or set "
        "monitor.ray_dashboard=false (the run's metrics are in its monitor: console, tensorboard, wandb or mlflow).")


def _bench():
    path = Path(__file__).resolve().parents[1] / "experiments" / "trl_comparison" / "benchmark.py"
    spec = importlib.util.spec_from_file_location("trl_comparison_benchmark", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_trl_comparison_summarizes_by_hand():
    steps = [{"step": k, "step_s": s, "generate_s": g, "train_s": 0.2}
             for k, s, g in [(1, 1.0, 0.1), (2, 0.5, 0.1), (3, 0.4, 0.05), (4, 0.5, 0.25), (5, 0.6, 0.1)]]
    run = {"steps": steps, "evals": {0: 0.1, 2: 0.85, 4: 0.92}, "start": 0.1,
           "peak": {"driver": 2**29, "actors": 2**28, "ray": 2**28}}
    s = _bench().summarize(run, 0.9)
    # steps 3..5: median of 0.4, 0.5, 0.6 = 0.5; generate median 0.1
    assert s["step_s"] == pytest.approx(0.5) and s["generate_s"] == pytest.approx(0.1)
    # each step's overhead: 1 - 0.25/0.4 = 0.375, 1 - 0.45/0.5 = 0.1, 1 - 0.3/0.6 = 0.5 -> median 0.375
    # (not 1 - (0.1 + 0.2) / 0.5 = 0.4 from the medians taken apart); in ms: 150, 50, 300 -> 150
    assert s["overhead"] == pytest.approx(0.375) and s["overhead_ms"] == pytest.approx(150)
    # first eval >= 0.9 at step 4: steps 1..4 took 1.0 + 0.5 + 0.4 + 0.5 = 2.4 s
    assert s["to_target_step"] == 4 and s["to_target_s"] == pytest.approx(2.4)
    # peak PSS by role: 0.5 + 0.25 + 0.25 GB = 1 GB in all
    assert s["final"] == 0.92 and s["peak_gb"] == 1.0 and (s["driver_gb"], s["actors_gb"], s["ray_gb"]) == (0.5, 0.25, 0.25)
    bench = _bench()
    assert bench.role(["ray::_Host.run"], False) == "actors" and bench.role(["ray::DashboardAgent"], False) == "ray"
    assert bench.role(["/venv/bin/python", "run.py"], True) == "driver" and bench.role(["raylet"], False) == "ray"
    assert _bench().summarize({**run, "evals": {0: 0.1, 2: 0.5}}, 0.9)["to_target_s"] is None


def test_the_trl_comparison_at_the_05b_shape_gives_both_sides_the_same_step():
    """--shape 0.5b: rft's overrides compose and pass the plan's checks; each step is 4 prompts x
    8 completions of up to 128 new tokens on both sides, from the same model, no eval; a run
    without evals summarizes with no accuracy."""
    from rft.plan.batch import check_config

    bench = _bench()
    shape = bench.SHAPES["0.5b"]
    cfg = compose_cfg(["stages=[]", *shape["rft"], "cluster=inline", "cluster.threads_per_actor=2"])
    check_config(cfg)
    assert cfg.model.builder == "qwen2.5-0.5b-shape" and not cfg.buffer.explorer_input.eval_tasksets
    assert cfg.buffer.batch_size * cfg.algorithm.repeat_times == 32 and cfg.model.max_response_tokens == 128
    assert not cfg.trainer.skip_zero_advantage and cfg.model.dtype == "bfloat16"
    trl = dict(zip(shape["trl"][::2], shape["trl"][1::2]))
    # TRL: 4 prompts x 8 generations = 32 rows, 128 new tokens, the weights in bfloat16
    assert trl == {"--prompts": "4", "--max-new-tokens": "128", "--dtype": "bfloat16"}
    steps = [{"step": k, "step_s": 10.0 + k, "generate_s": 6.0, "train_s": 3.0} for k in (1, 2, 3, 4)]
    s = bench.summarize({"steps": steps, "evals": {}, "start": None, "peak": {"driver": 2**31}}, 0.9)
    # steps 3 and 4: 13 and 14 s -> 13.5; overheads 1 - 9/13 and 1 - 9/14 -> their median
    assert s["step_s"] == pytest.approx(13.5) and s["final"] is None and s["to_target_s"] is None
    assert s["overhead"] == pytest.approx(((1 - 9 / 13) + (1 - 9 / 14)) / 2) and s["peak_gb"] == 2.0


def test_a_worker_rays_memory_monitor_killed_is_one_paragraph(monkeypatch, tmp_path, capsys):
    # Ray's OutOfMemoryError reached the user as Hydra's 'Error executing job' and Ray's traceback
    import ray.exceptions

    import rft.runtime.main

    said = ("Task was killed due to the node running low on memory.\nMemory on the node (IP: 10.0.0.5, ID: ab12) "
            "where the task (actor ID: cd34, name=Trainer.__init__, pid=4242, memory used=0.30GB) was running was "
            "23.20GB / 23.54GB (0.985), which exceeds the memory usage threshold of 0.95. Ray killed this worker")

    def fail(cfg):
        raise ray.exceptions.OutOfMemoryError(said)

    monkeypatch.setattr(rft.runtime.main, "_main", fail)
    cfg = compose_cfg(["stages=[]", f"checkpoint_root_dir={tmp_path}"])
    with pytest.raises(SystemExit) as e:
        rft.runtime.main.main(cfg)
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("\nrft: the run stopped: Ray's memory monitor killed one of the run's workers: the "
                          "machine's memory was nearly full (23.20GB of 23.54GB in use). Run the same command again "
                          "to resume (no checkpoint was saved yet: the run starts over).")
    assert "RAY_memory_usage_threshold (0.95)" in err and "Traceback" not in err

    def other(cfg):  # any other error is not taken for it
        raise ValueError("x")

    monkeypatch.setattr(rft.runtime.main, "_main", other)
    with pytest.raises(ValueError):
        rft.runtime.main.main(cfg)
