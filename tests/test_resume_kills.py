"""A run killed in the middle of a step (queue, sql, file, async), a trainer on a stored buffer, on-policy
distillation, multi-turn tools, a replay buffer that reads experiences again, and an explorer run
beside another writer: each resumed run ends where the uninterrupted one does (the helpers and the
comparison: tests/resume_support.py; the features one by one: tests/test_resume_matrix.py)."""

import os
from pathlib import Path

import pytest
from resume_support import NO_EVAL, SHORT, check_resumes, killed_after_put, run_here, run_to_end, stored_rows

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", ["queue", "sql", "file"])
def test_a_run_killed_in_the_middle_of_a_step_resumes_to_the_uninterrupted_one(kind, warm_start, tmp_path):
    """Killed the moment explore step 2's experiences are in the buffer (its third write), in
    training step 3, after the step-2 checkpoint: the resume drops what a stored buffer holds after
    the checkpoint and explores step 2 again, identically."""
    rows, _ = check_resumes(tmp_path, warm_start, [f"buffer={kind}"], after_put=3)
    assert [m["step"] for m in rows if "reward/mean" in m] == [1, 2, 3, 4]  # every step trained, once


def test_an_async_run_killed_in_the_middle_of_a_step_resumes_to_the_uninterrupted_one(warm_start, tmp_path):
    """sync_offset=1 on a sql buffer: the step-2 checkpoint holds explore step 2's experiences,
    explored ahead; killed once explore step 3's are in (the buffer's fourth write)."""
    rows, _ = check_resumes(tmp_path, warm_start, ["buffer=sql", "synchronizer.sync_offset=1"], after_put=4)
    assert [m["step"] for m in rows if "reward/mean" in m] == [1, 2, 3, 4]  # every step trained, once


def test_a_trainer_run_on_a_stored_buffer_resumes_to_the_uninterrupted_one(warm_start, tmp_path):
    """mode=train from a sql buffer a mode=explore run wrote (4 steps of 16): each run reads its own
    copy (a buffer's read cursor is its reader's), the killed one resumes its cursor."""
    import shutil

    run_here([*SHORT, *NO_EVAL, f"model.model_path={warm_start}", "model.builder=null", "mode=explore", "buffer=sql",
                   f"buffer.trainer_input.experience_buffer.path={tmp_path / 'explored.db'}", "name=explorer"], tmp_path)
    for name in ("straight", "killed"):
        shutil.copy(tmp_path / "explored.db", tmp_path / f"{name}.db")
    own_copy = "buffer.trainer_input.experience_buffer.path=${checkpoint_root_dir}/${name}.db"
    _, state = check_resumes(tmp_path, warm_start, ["mode=train", "buffer=sql", own_copy])
    assert state["buffer"]["cursor"] == 4 * 16


def test_on_policy_distillation_resumes_to_the_uninterrupted_run(warm_start, tmp_path):
    """algorithm=opd: the randomly initialised tiny model learns from the warm start as its teacher
    (every token's advantage is the teacher's log-prob less the student's: weights move at once)."""
    rows, _ = check_resumes(tmp_path, None, ["algorithm=opd", f"algorithm.teacher_model_path={warm_start}"])
    assert [m["step"] for m in rows if "reward/mean" in m] == [1, 2, 3, 4]


def test_a_multi_turn_tool_run_resumes_to_the_uninterrupted_run(tmp_path):
    """experiment=calculator_tool (a warm-up on the teacher's conversations, then GRPO over
    conversations with the calculator), its warm-up shortened to 20 steps (0.69-0.94 tool calls a
    conversation in the GRPO steps, 1.0-1.06 after 60): the GRPO stage killed and resumed. The
    killed run takes its warm-up from the stage cache."""
    metrics, _ = check_resumes(tmp_path, None, ["experiment=calculator_tool", "stages.0.buffer.total_steps=20",
                                             "stages.0.algorithm.optimizer.warmup_steps=10",
                                             "stages.0.explorer.eval_interval=1000",
                                             "buffer.explorer_input.eval_tasksets=[]"], stage="grpo",
                               short=[x for x in SHORT if x != "stages=[]"])
    assert any(m.get("rollout/tool_calls_mean", 0) > 0 for m in metrics)  # conversations with the tool


def test_a_replay_buffer_that_reads_experiences_again_resumes_to_the_uninterrupted_run(warm_start, tmp_path):
    """A replay priority that ranks a used experience above a new one (linear_decay with a negative
    decay, as a study's own priority_fn may): the uninterrupted run's step 4 trains on explore step
    0's experiences (stale by 3) for the third time, the resumed one on explore step 2's (stale by
    1), where the checkpoint kept no used experience (weights, reward/mean 0.6875 against 0.75,
    staleness/max 3 against 1): it keeps them now, with their use counts and cooldowns."""
    rows, state = check_resumes(tmp_path, warm_start, ["buffer.trainer_input.experience_buffer.replay_buffer.enable=true",
                                                       "buffer.trainer_input.experience_buffer.replay_buffer.reuse_cooldown_time=0",
                                                       "buffer.trainer_input.experience_buffer.replay_buffer.priority_fn_args.decay=-2"])
    assert rows[-1]["staleness/max"] == 3  # step 4 read explore step 0's experiences again, as the docstring says
    # the used experiences, in the file beside state.json that check_resumes compared
    assert state["buffer"]["used"] and state["buffer"]["experiences"] == "buffer_experiences.safetensors"


def another_explorer(path: Path, kind: str) -> list[dict]:
    """Another explorer writing to the same buffer (its own seed, 7, the same explore step 2): 8 rows."""
    from omegaconf import OmegaConf

    from rft.config import ExperienceBufferConfig
    from rft.data.buffer import make_buffer
    from rft.data.experience import Experience
    from rft.data.readers import step_seed

    buf = make_buffer(OmegaConf.structured(ExperienceBufferConfig(storage_type=kind, path=str(path))))
    buf.put([Experience(tokens=[1, 2, 3], prompt_length=1, logprobs=[-0.5, -0.25], reward=1.0, task_id=f"t{i}",
                        group_id=f"2/{step_seed(7, 2)}/t{i // 4}") for i in range(8)])
    buf.close()
    return [{"group_id": f"2/{step_seed(7, 2)}/t{i // 4}", "task_id": f"t{i}"} for i in range(8)]


@pytest.mark.parametrize("kind", ["sql", "file"])
def test_a_killed_explorer_run_resumes_to_the_rows_an_uninterrupted_one_writes(kind, warm_start, tmp_path):
    """mode=explore into a sql or file buffer (a trainer elsewhere reads it), killed once explore
    step 2 wrote its rows, before its step's checkpoint; then another explorer writes 8 rows of its
    own. The resumed run keeps its own rows written after the checkpoint and does not write them
    again (nothing is removed: a trainer may be reading the buffer live): the buffer holds the
    uninterrupted run's rows, each once (it held 80, explore step 2's 16 twice), and the other
    explorer's 8 where it wrote them."""
    env = {**os.environ, "RFT_CHECKPOINT_ROOT_DIR": str(tmp_path)}
    suffix = ".db" if kind == "sql" else ".jsonl"

    def args(name):
        return [*SHORT, *NO_EVAL, f"model.model_path={warm_start}", "model.builder=null", "mode=explore",
                f"buffer={kind}", f"buffer.trainer_input.experience_buffer.path={tmp_path / name}{suffix}",
                f"name={name}"]

    run_here(args("straight"), tmp_path)
    # killed the moment explore step 2's rows are in, before its step's checkpoint (mode=explore
    # saves every step)
    killed_after_put(args("killed"), env, tmp_path, 3)
    assert sorted(p.name for p in (tmp_path / "rft" / "killed" / "checkpoints").iterdir()) == ["step_2"]
    assert len(stored_rows(tmp_path / f"killed{suffix}")) == 3 * 16
    other = another_explorer(tmp_path / f"killed{suffix}", kind)
    resumed = run_to_end(args("killed"), env, tmp_path / "resumed_run")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = stored_rows(tmp_path / f"straight{suffix}"), stored_rows(tmp_path / f"killed{suffix}")
    assert len(a) == 4 * 16 and len(b) == 4 * 16 + 8
    # the other explorer's rows, each once, where it wrote them: after the killed run's 48
    assert [{"group_id": r["group_id"], "task_id": r["task_id"]} for r in b[48:56]] == other
    own = b[:48] + b[56:]
    steps = [r["group_id"].split("/")[0] for r in own[::4]]  # a group's id: <explore step>/<seed>/<task>
    assert steps == [s for s in "0123" for _ in range(4)], steps
    assert a == own
