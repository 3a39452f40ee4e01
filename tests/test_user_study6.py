"""A new user's study from the README alone (experiments/lora_sweep/): LoRA against full
fine-tuning on the tiny model, a task of the study's own (reverse a three-letter word), swept on
Slurm, the best adapter used outside rft. Each test is a defect that study met, or a promise it
checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, compose_cfg, load_script, run_cli
from rft.errors import ConfigError
from rft.plan.batch import make_plan, stage_configs
from test_slurm import slurm  # noqa: F401 (the fixture: skips without a Slurm cluster, as there)

STUDY = ROOT / "experiments" / "lora_sweep"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """The tiny model's files (its weights are what the plan reads module names from)."""
    from rft.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _plan(*overrides):
    cfg = stage_configs(compose_cfg(["stages=[]", *overrides]))[0]
    return cfg, make_plan(cfg, 2000)


def _plan_error(*overrides) -> str:
    with pytest.raises(ConfigError) as e:
        _plan(*overrides)
    return str(e.value)


def test_a_target_module_the_model_lacks_stops_the_dry_run(tiny):
    # `model.lora.target_modules=[qkv_proj]` (a fused name of other architectures) passed the dry run,
    # whose checkpoint row then read "trainer state 0.0 MB", and a Slurm sweep queued every job, each
    # failing as its trainer was built. A list naming one module right and one wrong ([q_proj, v_prj])
    # ran with q_proj alone adapted: PEFT skips a name that matches nothing while another matches.
    # The plan now reads the module names from the model's safetensors headers (the tiny model's:
    # q/k/v/o_proj, gate/up/down_proj; embed_tokens) and names each one that matches none.
    at = f"model.model_path={tiny}"
    linear = "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"
    assert _plan_error(at, "model.lora.rank=4", "model.lora.target_modules=[qkv_proj]") == (
        f"model.lora.target_modules: 'qkv_proj' names no module of the model at model.model_path (its linear "
        f"layers: {linear}). PEFT matches a name against the end of each module's full name "
        f"(down_proj: model.layers.0.mlp.down_proj); give those names, or all-linear.")
    assert "'v_prj' names no module" in _plan_error(at, "model.lora.rank=4",
                                                    "model.lora.target_modules=[q_proj,v_prj]")
    # (PEFT itself on [q_proj, v_prj] at rank 4: 2048 trainable parameters, q_proj's 2 x 4 x 256 alone)
    # full names and suffixes of them match, as PEFT matches them, and the plan counts what PEFT
    # adapts: q_proj in both layers 2 x 4 x (128 + 128) = 2048, up_proj of layer 1 4 x (128 + 512)
    # = 2560: 4608, PEFT's get_nb_trainable_parameters() for the same list
    from rft.plan.memory import adapter_parameters

    cfg, _ = _plan(at, "model.lora.rank=4", "model.lora.target_modules=[self_attn.q_proj,model.layers.1.mlp.up_proj]")
    assert adapter_parameters(str(tiny), cfg.model.lora) == 4608


@pytest.mark.slow  # 3.8 s alone, over the fast tier's second
def test_the_dry_run_says_what_lora_trains(tiny):
    # Nothing in the dry run or the run's logs said LoRA was on, or how much trained: a study's
    # `model.lora.rank=8` and a misspelt or ignored one (rank 0 is "no LoRA", every weight trains)
    # looked alike until the checkpoints' adapter/ folders. The dry run now has a `lora` row.
    # Hand count, the tiny model (hidden 128, intermediate 512, 2 layers, 4 heads of 32, 4 kv heads):
    # rank x (in + out) per adapted layer: q k v o 4 x (128 + 128) = 1024, gate up 2 x (128 + 512)
    # = 1280, down 512 + 128 = 640; 2944 a layer, 5888 for 2, x rank 8 = 47,104 of its 538,880
    # parameters (embeddings 103 x 128 = 13,184 tied; a layer 4 x 128^2 + 3 x 128 q/k/v biases
    # + 3 x 128 x 512 + 2 x 128 norms = 262,784; the final norm 128): 8.7%
    out = run_cli("stages=[]", f"model.model_path={tiny}", "model.lora.rank=8", "dry_run=true")
    assert out.returncode == 0, out.stderr
    assert ("lora           rank 8, alpha 16 (updates scaled by alpha / rank = 2), target_modules all-linear: "
            "47,104 adapter parameters train, 8.7% of the 538,880; the base weights are frozen") in out.stdout
    out = run_cli("stages=[]", f"model.model_path={tiny}", "model.lora.alpha=32", "dry_run=true")
    assert ("lora           off (model.lora.rank=0): every weight trains, though model.lora.alpha=32 is set"
            in out.stdout)


def test_the_run_logs_what_peft_built(tiny, caplog):
    # the dry run's count is planned from the weights' headers; the run logs PEFT's own count of
    # the model it built, so the two can be compared (47,104 = 5888 x 8: the test above)
    import logging

    from transformers import AutoModelForCausalLM

    from rft.trainer import lora

    cfg = compose_cfg(["stages=[]", "model.lora.rank=8"])
    with caplog.at_level(logging.INFO, logger="rft.trainer.lora"):
        peft = lora.apply(AutoModelForCausalLM.from_pretrained(tiny), cfg.model.lora)
    assert sum(p.numel() for p in peft.parameters() if p.requires_grad) == 47_104
    assert ("LoRA rank 8, alpha 16 on 14 modules: 47,104 adapter parameters train, 8.7% of the base model's "
            "538,880 (frozen)") in caplog.messages


def test_too_few_cpus_for_fsdp2_ranks_names_the_ranks():
    # `trainer=fsdp2 model.lora.rank=4` on 2 cores: "the actors need 3 CPU (cluster.cpus_per_actor=1,
    # gpu_per_node=0, explorer.rollout_model.engine_num=1, colocate=False) but the Ray cluster has 2"
    # named every term of the 3 but the one that made it: fsdp2's 2 trainer ranks (1 engine + 2 ranks)
    from rft.plan.placement import check_placement

    cfg = stage_configs(compose_cfg(["stages=[]", "model.lora.rank=4", "trainer=fsdp2", "cluster.num_cpus=2"]))[0]
    with pytest.raises(ConfigError) as e:
        check_placement(cfg)
    assert str(e.value).startswith(
        "the actors need 3 CPU (cluster.cpus_per_actor=1, gpu_per_node=0, explorer.rollout_model.engine_num=1, "
        "trainer.ranks=2, colocate=False) but the Ray cluster has 2.")


def test_the_study_reward_is_the_answer_column_on_every_row():
    # the reward reads the question (`rev <word>`), not the answer column: both must agree on every
    # row the study ships, or the eval and the data would disagree about what is right
    from types import SimpleNamespace

    reward = load_script("experiments/lora_sweep/rewards.py", "lora_rewards").reversed_word
    for split, n in (("train", 2000), ("test", 200)):
        rows = [json.loads(line) for line in (STUDY / "data" / f"{split}.jsonl").read_text().splitlines()]
        assert len(rows) == n
        assert all(reward("", r["answer"], SimpleNamespace(row=r)) == 1.0 for r in rows)
        assert all(reward("", f" {r['answer']}\n", SimpleNamespace(row=r)) == 1.0 for r in rows[:5])  # stripped
        # the word itself, unreversed, scores 0 (unless it reads the same both ways)
        unreversed = [r for r in rows if r["answer"] != r["question"][4:]]
        assert not any(reward("", r["question"][4:], SimpleNamespace(row=r)) for r in unreversed)
    train = {json.loads(line)["question"] for line in (STUDY / "data" / "train.jsonl").read_text().splitlines()}
    test = {json.loads(line)["question"] for line in (STUDY / "data" / "test.jsonl").read_text().splitlines()}
    assert not train & test  # held-out words are never trained on


def _study(*overrides: str) -> list[str]:
    return [f"hydra.searchpath=[file://{STUDY / 'conf'}]", "experiment=lora_sweep", *overrides]


@pytest.mark.slow  # 7.7 s alone, over the fast tier's second
def test_the_study_plans_as_its_readme_says(tiny):
    # the overlay's sweep as README.md gives it: the warm-up trains every weight, the RL stage adapters
    out = run_cli("-m", *_study("+stages.1.model.lora.rank=4,16", "algorithm.optimizer.lr=1e-3,3e-3",
                                "hydra/launcher=slurm", "dry_run=true"))
    assert out.returncode == 0, out.stderr
    assert "dry_run=true: the sweep's 4 jobs planned here and fit; nothing was queued." in out.stdout + out.stderr
    out = run_cli(*_study("+stages.1.model.lora.rank=16", f"model.model_path={tiny}", "dry_run=true"))
    warmup, grpo = out.stdout.split("batch plan: stage grpo")
    assert "lora " not in warmup
    # 5888 x 16 = 94,208 adapter parameters (the hand count above), 17.5% of 538,880
    assert ("lora           rank 16, alpha 16 (updates scaled by alpha / rank = 1), target_modules all-linear: "
            "94,208 adapter parameters train, 17.5% of the 538,880") in grpo
    # where the weights are not on this machine, the count is the shape's (model.architecture), whose
    # parameter total leaves out the 768 q/k/v biases (2 layers x 3 x 128): 538,112
    out = run_cli(*_study("+stages.1.model.lora.rank=16", "dry_run=true"), env={"RFT_CACHE_DIR": str(tiny.parent)})
    assert "94,208 adapter parameters train, 17.5% of the 538,112" in out.stdout


@pytest.mark.slow
def test_a_lora_job_on_slurm_exports_and_answers_outside_rft_as_its_eval_said(slurm, tiny, tmp_path):
    # the study's part (c) on a budget: one LoRA job of the study on the Slurm launcher (from the
    # built tiny model, no warm-up, 4 steps), its last checkpoint exported as README.md says
    # (python -m rft.runtime.export), loaded with transformers (merged) and with peft (the
    # checkpoint's adapter/ on the base it names), generating greedily: every answer is the one
    # rft's own eval of that step wrote (eval_trajectories/step_4), and the accuracy is its figure
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rft.reporting.monitor import read_metrics

    sweep = tmp_path / "sweep"
    out = run_cli("-m", *_study("hydra/launcher=slurm", "hydra.launcher.timeout_min=10", "stages=[]",
                                f"model.model_path={tiny}", "model.lora.rank=4", "algorithm.optimizer.lr=3e-2",
                                "buffer.total_steps=4", "explorer.eval_interval=4", "trainer.save_interval=4",
                                "monitor=console", f"checkpoint_root_dir={tmp_path}", f"hydra.sweep.dir={sweep}"))
    assert out.returncode == 0, out.stderr[-3000:]
    ckpt = sweep / "0" / "checkpoints" / "step_4"
    assert (ckpt / "adapter" / "adapter_model.safetensors").stat().st_size > 4 * 5888 * 4  # 23,552 float32 + header
    exported = tmp_path / "exported"
    export = subprocess.run([sys.executable, "-m", "rft.runtime.export", str(ckpt), str(exported)], cwd=ROOT,
                            capture_output=True, text=True)
    assert export.returncode == 0, export.stderr
    evals = sweep / "0" / "eval_trajectories" / "step_4" / "rev3_test.jsonl"
    said = [json.loads(line) for line in evals.read_text().splitlines()]
    rows = [json.loads(line) for line in (STUDY / "data" / "test.jsonl").read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(exported)
    merged = AutoModelForCausalLM.from_pretrained(exported).eval()
    base = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), ckpt / "adapter").eval()

    def answer(model, question: str) -> str:
        ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        with torch.no_grad():
            g = model.generate(**ids, max_new_tokens=6, do_sample=False)
        return tok.decode(g[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)

    by_id = {d["task_id"]: d["messages"][-1]["content"] for d in said}
    for i, r in enumerate(rows[:20]):
        assert answer(merged, r["question"]) == answer(adapted, r["question"]) == by_id[f"rev3_test/{i}"], r
    last = [m for m in read_metrics(sweep / "0" / "metrics.jsonl") if "eval/rev3_test/accuracy" in m][-1]
    assert last["step"] == 4 and last["eval/rev3_test/accuracy"] == sum(d["reward"] for d in said) / 200


def _sweep_with_a_stopped_job(tmp_path: Path, err: str) -> Path:
    """A sweep's directory as hydra/launcher=slurm leaves it: job 0 done (30 of 30 steps), job 1
    stopped after 6 of 30, its submitit log ending with `err`."""
    sweep = tmp_path / "sweep"
    (sweep / "multirun.yaml").parent.mkdir(parents=True)
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    for job, steps in (("0", 30), ("1", 6)):
        (sweep / job / ".hydra").mkdir(parents=True)
        (sweep / job / ".hydra" / "overrides.yaml").write_text(f"- algorithm.optimizer.lr={job}e-3\n")
        (sweep / job / ".hydra" / "config.yaml").write_text("stages: [{stage_name: grpo, buffer: {total_steps: 30}}]\n")
        (sweep / job / "grpo" / "checkpoints" / f"step_{steps}").mkdir(parents=True)
        (sweep / job / "grpo" / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": s, "reward/mean": 0.5}) + "\n" for s in range(1, steps + 1)))
        log = sweep / ".submitit" / f"173_{job}" / f"173_{job}_0_log.err"
        log.parent.mkdir(parents=True)
        log.write_text("some warning\n" + (err if job == "1" else ""))
    return sweep


@pytest.mark.parametrize("err, why", [
    ("rft: the run stopped: every task of the eval set failed at step 0. Fix the reward function.\n"
     "srun: error: vm: task 0: Exited with exit code 1\n",
     "the run stopped: every task of the eval set failed at step 0. Fix the reward function."),
    ("slurmstepd-vm: error: *** STEP 170.0 ON vm CANCELLED AT 2026-11-29T07:36:41 ***\n"
     "srun: error: vm: task 0: Killed\n",
     "Slurm: *** STEP 170.0 ON vm CANCELLED AT 2026-11-29T07:36:41 ***"),
])
@pytest.mark.slow  # 3.0 s alone, over the fast tier's second
def test_the_report_says_why_a_sweep_job_stopped(tmp_path, err, why):
    # a sweep job that failed (its reward raised) or was killed showed in the report as
    # `incomplete (6/30 steps)`, as a job still running does: why it stopped was in the sweep's closing
    # message alone, gone with the terminal. The report now lists each job that did not finish with
    # the last line its launcher's log has from rft (or Slurm's line of its end), and that log's path.
    sweep = _sweep_with_a_stopped_job(tmp_path, err)
    out = subprocess.run([sys.executable, "-m", "rft.reporting.report", str(sweep)], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    md = (sweep / "report.md").read_text()
    assert "| 1 | 1e-3 | grpo | incomplete (6/30 steps) | 6 |" in md
    log = sweep / ".submitit" / "173_1" / "173_1_0_log.err"
    assert f"## Jobs that stopped\n\n- job 1, incomplete (6/30 steps): {why} ({log})\n" in md
    assert "- job 0" not in md
    # a sweep of one job is no Slurm array: its log is .submitit/<id>/<id>_0_log.err
    for job in ("0", "1"):
        (sweep / ".submitit" / f"173_{job}" / f"173_{job}_0_log.err").unlink()
    (sweep / ".submitit" / "180").mkdir()
    (sweep / ".submitit" / "180" / "180_0_log.err").write_text(err)
    (sweep / "0" / "grpo" / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    out = subprocess.run([sys.executable, "-m", "rft.reporting.report", str(sweep)], cwd=ROOT, capture_output=True,
                         text=True)
    md = (sweep / "report.md").read_text()
    assert f"- job 0, incomplete (1/30 steps): {why} ({sweep / '.submitit' / '180' / '180_0_log.err'})\n" in md
    assert "- job 1" not in md  # its log is gone
