"""Review of the token-id check (e24d4d3), the reward print cap (02ac0f5, 77357f6) and a reward call's
copy of a task that cannot be deep-copied (f6771d5): inputs of the same kind as those the fixes named."""

import sys

import pytest

from rft.data.experience import Experience
from rft.rollout.workflows.single_turn import check_output

# ---------------------------------------------------------------- token ids: a bool tensor, a tensor of one id


def _exp(tokens):
    return Experience(list(tokens), 2, [-1.0, -1.0], group_id="0/1/t", task_id="t")


def test_a_bool_tensor_or_a_one_element_tensor_is_no_token_id():
    # e24d4d3 took an id for whatever operator.index takes, "not a bool": but torch's bool tensor
    # passes operator.index (as 1), and so does a tensor of one element, tensor([5]) (a workflow's
    # tokens built from a [T, 1] tensor): Experience.to_dict then stored them as 1 and 5, the
    # experience trained on tokens nobody chose
    import numpy as np
    import torch

    from rft.errors import ConfigError

    check_output([[_exp([5, 6, torch.tensor(7), np.int64(8)])]], [0], "my.workflow", vocab=100, max_tokens=4)
    for bad, shown in [([5, 6, torch.tensor(True), 8], "[tensor(True)]"),
                       ([5, 6, torch.tensor([7]), 8], "[tensor([7])]"),
                       ([5, 6, np.array([7]), 8], "[array([7])]"),
                       ([5, 6, np.bool_(True), 8], "[np.True_]")]:
        with pytest.raises(ConfigError) as e:
            check_output([[_exp(bad)]], [0], "my.workflow", vocab=100, max_tokens=4)
        assert str(e.value) == (f"workflow 'my.workflow' returned an experience (task 't') with token ids {shown} "
                                f"outside the model's vocabulary (ints 0..99): the trainer could not embed them. "
                                f"Give the tokenizer's ids (ctx.tokenizer).")


# ---------------------------------------------------------------- what rewards print to stderr, capped too

def _loud_on_stderr(prompt, response, task):
    print("x" * 99, file=sys.stderr)  # 100 characters a call, its newline included
    return 1.0


def test_what_rewards_print_to_stderr_is_capped_as_their_stdout(monkeypatch, capsys):
    # 02ac0f5 capped sys.stdout alone: print(..., file=sys.stderr), warnings and a reward's logging
    # without a handler of the run's (logging.lastResort writes to sys.stderr) were not, and 1 MB a
    # call filled the console (a Slurm job's .err, the studio's launch log) as before
    from rft.rewards import scoring, stdout_cap

    monkeypatch.setattr(stdout_cap, "CAP_CHARS", 250)
    scorer = scoring.Scorer([scoring.Part("loud", 1.0, scoring._per_response(_loud_on_stderr, {}), False)])
    task = scoring.Reward(0.0)  # (any object: the function does not read it)
    assert scorer("p", ["a", "b", "c", "d"], task) == [1.0] * 4  # 4 calls, 400 characters
    print("[grpo] step 1/2", file=sys.stderr)  # the run's own line (a progress bar's), past the cap: printed
    err = capsys.readouterr().err
    # 250 = 2 whole lines of 100 + 50 characters of the third; then the note, once
    assert err == ("x" * 99 + "\n") * 2 + "x" * 50 + (
        "\nrft: reward 'loud' printed more than 250 characters: what this taskset's rewards print from here on is left "
        "out (every response calls them, so their prints would fill the console and the disk its log is on). Print a "
        "sample of the calls, or write to a file of your own.\n") + "[grpo] step 1/2\n"


# ---------------------------------------------------------------- a task that cannot be deep-copied

def test_a_task_holding_a_lock_is_copied_around_it_so_a_rewards_edit_stays_its_own():
    # f6771d5 passed a task that cannot be deep-copied as it is: a reward that edits it (the answer
    # normalised in place, as 31d77a0's copies were made for) changed what the next part scored
    # and the taskset's task for every later epoch, without a word. The lock is now shared and the
    # rest copied around it
    import threading

    from rft.data.tasks import Task
    from rft.rewards import scoring

    class Env:  # an object of the study's own that cannot be copied (a process's handle, say)
        def __init__(self):
            self.lock = threading.Lock()

    lock, env = threading.Lock(), Env()
    task = Task("t/7", [{"role": "user", "content": "042+315"}], "357", {"answer": "357", "lock": lock, "env": env})

    def edits(p, r, t):
        t.answer, t.row["answer"] = "1", "1"  # the next part and a later epoch must not see these
        return 0.0

    def exact(p, r, t):
        assert t.row["lock"] is lock and t.row["env"] is env  # shared, not copied (they cannot be)
        return float(r == t.answer) + float(r == t.row["answer"])

    scorer = scoring.Scorer([scoring.Part("edits", 1.0, scoring._per_response(edits, {}), False),
                             scoring.Part("exact", 1.0, scoring._per_response(exact, {}), False)])
    assert [float(r) for r in scorer("q", ["357", "1"], task)] == [2.0, 0.0]  # 0 + (1 + 1); 0 + (0 + 0)
    assert (task.answer, task.row["answer"], task.row["lock"]) == ("357", "357", lock)  # the taskset's own
