"""What a short run's trainer trained on, counted from what the run leaves (batches.jsonl, its
metrics and config, the taskset's files), not from rft's own bookkeeping: with the online
curriculum and DAPO's dynamic sampling together, over_rollout dropping tasks, repeat_times 2, two
explorers, and evals on. Every trained group is of a task the run could draw (a row of the training
split, not an eval set's), no group is trained twice nor a task twice in a step, and every step
trains a full batch."""

import json
import os
from collections import Counter
from pathlib import Path

import pytest
from resume_support import run_to_end
from omegaconf import OmegaConf

from rft.reporting.monitor import read_metrics

pytestmark = pytest.mark.slow

STEPS, BATCH, N, TRIES, EXPLORERS, SEED = 6, 4, 2, 3, 2, 42
ARGS = ["stages=[]", "model.builder=null", "cluster=inline", "monitor=console", f"buffer.total_steps={STEPS}",
        f"buffer.batch_size={BATCH}", f"algorithm.repeat_times={N}", f"algorithm.dynamic_sampling_max_tries={TRIES}",
        "data_processor.online_curriculum.enable=true", "explorer.over_rollout.ratio=0.5",
        "explorer.over_rollout.wait_after_min=0", f"explorer.rollout_model.engine_num={EXPLORERS}",
        "explorer.eval_interval=2", "explorer.eval_on_startup=false", "buffer.explorer_input.eval_tasksets.0.repeat_times=2",
        "buffer.explorer_input.eval_tasksets.0.pass_k=[1,2]", "buffer.explorer_input.eval_tasksets.0.rollout_args.temperature=1.0",
        "trainer.save_interval=100", f"seed={SEED}"]


def salt_of(step: int, seed: int) -> int:
    """The salt of a group's sampling seed (single_turn's group id is <explore step>/<seed>/<task>),
    the seed being (run seed x 1000003 + step x 7919 + salt) mod 2^31: 1000 x explorer, plus 100 + t
    for dynamic sampling's try t (t >= 1)."""
    return (seed - (SEED * 1_000_003 + step * 7919)) % 2**31


def test_what_the_trainer_trained_on_is_what_the_run_could_draw(warm_start, tmp_path):
    # run.py forked from a process that imported torch (resume_support: the same command without a fresh
    # interpreter's imports, ~4 s a run)
    done = run_to_end([*ARGS, f"model.model_path={warm_start}", f"checkpoint_root_dir={tmp_path}", "name=counted"],
                      dict(os.environ), tmp_path / "run")
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "rft" / "counted"
    cfg = OmegaConf.load(run / "config.yaml")
    train, test = cfg.buffer.explorer_input.taskset, cfg.buffer.explorer_input.eval_tasksets[0]
    data = Path(train.path).expanduser()
    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines() if line.strip()]
    eval_prompts = {json.loads(line)[test.format.prompt_key] for line in (data / "test.jsonl").read_text().splitlines() if line.strip()}
    batches, metrics = read_metrics(run / "batches.jsonl"), {m["step"]: m for m in read_metrics(run / "metrics.jsonl")}
    assert [b["step"] for b in batches] == list(range(1, STEPS + 1))

    seen_groups, salts = [], Counter()
    for b in batches:
        parsed = [g.split("/", 2) for g in b["groups"]]
        explore_steps = {int(s) for s, _, _ in parsed}
        assert explore_steps == {b["step"] - 1}, b  # sync_offset 1: training step k learns explore step k - 1
        tasks = [t for _, _, t in parsed]
        names = {t.rpartition("/")[0] for t in tasks}
        assert names == {train.name}, names  # never an eval set's task
        task_rows = [int(t.rpartition("/")[2]) for t in tasks]
        assert all(0 <= r < len(rows) for r in task_rows)
        assert not {rows[r][train.format.prompt_key] for r in task_rows} & eval_prompts  # nor its question
        assert len(set(tasks)) == len(tasks), f"step {b['step']} trained a task twice: {Counter(tasks)}"
        # a full batch: BATCH groups of N rollouts each (each try keeps >= ceil(0.5 x 2) = 1 of an explorer's
        # 2 tasks, 3 tries: >= 3 groups an explorer, of which it keeps its 2), as the step's metrics say
        assert len(b["groups"]) == BATCH and len(b["versions"]) == BATCH * N
        assert metrics[b["step"]]["rollout/experiences"] == BATCH * N
        for s, seed, _ in parsed:
            salt = salt_of(int(s), int(seed))
            explorer, t = divmod(salt, 1000)
            assert explorer < EXPLORERS and (t == 0 or 101 <= t < 100 + TRIES), salt
            salts[t] += 1
        seen_groups += b["groups"]
    assert len(seen_groups) == len(set(seen_groups)) == STEPS * BATCH  # no group trained twice
    # over_rollout dropped tasks every step (wait_after_min 0), so some trained groups came from extra tries
    assert sum(metrics[s]["rollout/over_rollout_dropped"] for s in metrics if "rollout/over_rollout_dropped" in metrics[s]) > 0
    assert salts[0] < STEPS * BATCH and salts[0] + sum(salts[t] for t in salts if t) == STEPS * BATCH
    evals = [m for m in metrics.values() if "eval/arithmetic_test/maj@2" in m]
    assert [m["step"] for m in evals] == [2, 4, 6]


def test_curriculum_with_dynamic_sampling_resumes_to_the_uninterrupted_run(warm_start, tmp_path):
    """The curriculum draws each step's extra tasks with its own (in the driver, from the pass rates
    the checkpoint holds): a run killed at its step-2 checkpoint and resumed trains the same batches
    to the same weights as one straight through (resume_support.check_resumes compares them)."""
    from resume_support import check_resumes

    rows, state = check_resumes(tmp_path, warm_start, ["algorithm=dapo", "data_processor.online_curriculum.enable=true"])
    assert max(m.get("rollout/sampling_tries", 0) for m in rows) > 1  # extra tries were drawn
    assert len(state["curriculum"]["outcomes"]) > 4 * 4  # it saw more tasks than 4 steps of 4 drew
