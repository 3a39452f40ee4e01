"""What a review of the workflow-output checks, reward calls and sweeps found, each with its test."""

from __future__ import annotations

import logging

import pytest

from rft.data.tasks import Task
from rft.models import build_tiny_model
from rft.rollout.workflows.multi_turn import multi_turn
from rft.rollout.workflows.single_turn import check_output
from tests.test_multi_turn import CALL, Scripted, ctx_for, tokenizer


@pytest.fixture(scope="module")
def tools_model(cache_dir):
    return build_tiny_model(cache_dir / "models" / "tiny-qwen2-tools-v4", tools=True)


# ---------------------------------------------------------------- multi_turn's budget

def test_a_first_prompt_that_fills_the_conversation_budget_fails_its_task_not_the_run(tools_model, caplog):
    # workflow_args.max_total_tokens is "never an error" (README): a turn is cut to what is left. A
    # first prompt of 8 tokens (<|im_start|> user 7 * 8 <|im_end|> <|im_start|> assistant) under a
    # budget of 8 leaves 0 for the model, so the conversation had no response tokens, and the
    # workflow-output check then stopped the whole run on one long task. It is a failed task now
    # (counted in rollout/failed_tasks), never sent to the engine; the other task goes on.
    tok = tokenizer(tools_model)
    long_task = Task("calc/1", [{"role": "user", "content": "7*8"}], "56", {})
    short = Task("calc/2", [{"role": "user", "content": "7"}], "7", {})  # 6 tokens: room for 2
    engine = Scripted(tok, [(CALL, "stop")])
    with caplog.at_level(logging.WARNING, logger="rft.rollout.workflows.multi_turn"):
        out = multi_turn([long_task, short], engine, ctx_for(tok, {"env": "calculator", "max_total_tokens": 8}, n=2))
    assert out[0] is None
    assert [len(e.tokens) - e.prompt_length for e in out[1]] == [2, 2]  # 8 - 6: the call cut to 2 tokens
    assert engine.calls[0] == [out[1][0].tokens[:6]]  # the short task's prompt alone went to the engine
    check_output(out, [long_task, short], "multi_turn", vocab=len(tok), max_tokens=8)  # nothing to refuse
    assert ("task calc/1 failed: its first prompt is 8 tokens, which leaves no room for the model under the "
            "conversation's budget of 8 tokens (workflow_args.max_total_tokens; default model.max_prompt_tokens + "
            "model.max_response_tokens): raise it, or shorten the task's first message") in caplog.text


# ---------------------------------------------------------------- reward calls past the timeout

def test_a_burst_of_calls_a_little_past_the_timeout_does_not_stop_the_run(monkeypatch):
    # openai_agent runs up to 128 agents at once (and explorer.runner_per_model has no upper bound):
    # a step whose agents all ran a little past explorer.max_timeout abandoned them in one pass, and
    # the 65th stopped the run saying they 'have not returned', though each returned 0.3 s later.
    # The bound counts calls still running a timeout after they were abandoned (MAX_HUNG_CALLS 4
    # here, for 8 calls).
    import time

    from rft.rollout import explorer
    from rft.rollout.explorer import run_jobs

    monkeypatch.setattr(explorer, "MAX_HUNG_CALLS", 4)
    results, c = run_jobs(lambda job: time.sleep(0.5), list(range(8)), runners=8, timeout=0.2, retries=0)
    assert results == [None] * 8 and (c["timeouts"], c["failed"]) == (8, 8)  # timed out, counted, not fatal
    for _ in range(300):  # they return 0.3 s after their timeout
        if not explorer._THREADS.hung:
            break
        time.sleep(0.01)
    assert not explorer._THREADS.hung


# ---------------------------------------------------------------- token ids of another kind

def test_torch_integer_ids_pass_the_vocabulary_check_and_float_ones_do_not():
    # Experience.to_dict stores an engine's numpy or torch scalars as ints; the check of 9c3a23a took
    # integers for numbers.Integral alone, so a study's workflow that built tokens as list(tensor)
    # was stopped with 'token ids [tensor(5), tensor(6), ...] outside the model's vocabulary (ints
    # 0..99)': ids inside it
    import torch

    from rft.data.experience import Experience
    from rft.errors import ConfigError

    def exp(tokens):
        return Experience(list(tokens), 2, [-1.0, -1.0], group_id="0/1/t", task_id="t")

    ids = exp(torch.tensor([5, 6, 7, 99]))
    check_output([[ids]], [0], "my.workflow", vocab=100, max_tokens=4)
    assert ids.to_dict()["tokens"] == [5, 6, 7, 99]
    for bad, shown in [(torch.tensor([5, 6, 7, 100]), "[tensor(100)]"), (torch.tensor([5.0, 6.0, 7.0, 8.0]),
                       "[tensor(5.), tensor(6.), tensor(7.), tensor(8.)]"), ([5, 6, True, 8], "[True]")]:
        with pytest.raises(ConfigError) as e:
            check_output([[exp(bad)]], [0], "my.workflow", vocab=100, max_tokens=4)
        assert str(e.value) == (f"workflow 'my.workflow' returned an experience (task 't') with token ids {shown} "
                                f"outside the model's vocabulary (ints 0..99): the trainer could not embed them. "
                                f"Give the tokenizer's ids (ctx.tokenizer).")


# ---------------------------------------------------------------- a reward call's copy of its task

def test_a_task_that_cannot_be_copied_is_still_scored():
    # 31d77a0 gives each reward call a deep copy of its task; a study's workflow scoring a task of its
    # own that holds a lock (an open file, a process) then failed every call with 'TypeError: cannot
    # pickle '_thread.lock' object', so every task failed where it had been scored
    import threading

    from rft.rollout.explorer import run_jobs
    from tests.test_user_faults import Served, _scorer

    task = Task("t/7", [{"role": "user", "content": "042+315"}], "357", {"answer": "357", "lock": threading.Lock()})
    scorer = _scorer(lambda p, r, t: float(r == t.answer), Served([0.5, 0.5]))
    results, c = run_jobs(lambda job: scorer(*job), [("q", ["357", "1"], task)], runners=1, timeout=5.0, retries=0)
    assert c["failed"] == 0 and [float(r) for r in results[0]] == [1.5, 0.5]  # 1 + 0.5, 0 + 0.5


def test_calls_over_rollout_drops_still_running_are_hung_calls_and_bounded(monkeypatch):
    # explorer.over_rollout drops the calls still running once enough tasks are done; they keep their
    # threads as timed-out calls do, but were neither counted in rollout/hung_calls nor bounded: a
    # reward that hangs on some task, dropped every step before explorer.max_timeout, piled up
    # threads without a word
    import threading
    import time

    from rft.errors import RunError
    from rft.rollout import explorer
    from rft.rollout.explorer import run_jobs

    release = threading.Event()
    monkeypatch.setattr(explorer, "MAX_HUNG_CALLS", 1)
    fn = lambda job: job or release.wait()  # noqa: E731  job 0 hangs, job 1 returns at once
    try:
        results, c = run_jobs(fn, [0, 1], runners=2, timeout=0.2, retries=0, min_done=1)
        assert results == [None, 1] and c["over_rollout_dropped"] == 1 and c["dropped_jobs"] == [0]
        assert len(explorer._THREADS.hung) == 1  # rollout/hung_calls
        run_jobs(fn, [0, 1], runners=2, timeout=0.2, retries=0, min_done=1)
        time.sleep(0.25)  # a timeout later the 2 dropped calls still run: over the bound of 1 at the next drop
        with pytest.raises(RunError) as e:
            run_jobs(fn, [0, 1], runners=2, timeout=0.2, retries=0, min_done=1)
        assert str(e.value).startswith("2 calls of the workflow's jobs (an environment's steps, say) ran past "
                                       "explorer.max_timeout (0.2 s) and have not returned 0.2 s after that.")
    finally:
        release.set()
    for _ in range(300):
        if not explorer._THREADS.hung:
            break
        time.sleep(0.01)
    assert not explorer._THREADS.hung
