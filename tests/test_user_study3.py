"""A new user's study made from the README alone (experiments/kv_lookup/): a multi-turn task whose
model calls the study's own tool (`stock`, a key-value "database" of SKUs), an environment of its own
that scores the final answer with its own reward (`graded`), a JSONL dataset with its own column
names (`ask`, `truth`, `demo`), its own advantage function (`centred`) in the RL stage, kept outside
conf/ behind `hydra.searchpath`; and the mistakes a user makes on the way, each one paragraph."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from conftest import ROOT, load_script, run_cli
from resume_support import Forked, run_to_end

STUDY = ["hydra.searchpath=[file://experiments/kv_lookup/conf]", "experiment=kv_lookup"]
HERE = ROOT / "experiments" / "kv_lookup"


def _error(result) -> str:
    """The one paragraph a run that stopped on its config prints (nothing else on stderr but it)."""
    assert result.returncode == 2, result.stderr[-2000:]
    return result.stderr.strip().removeprefix("rft: configuration error: ")


def test_the_prepared_data_is_what_the_study_reads():
    prepare = load_script("experiments/kv_lookup/prepare.py", "kv_lookup_prepare")
    study = load_script("experiments/kv_lookup/study.py", "kv_lookup_study")
    rows = [json.loads(line) for line in (HERE / "data" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 2000 and set(rows[0]) == {"ask", "truth", "demo"}
    # each row's truth is the database's stock of the SKU asked for; the teacher's call is that SKU
    # or its last digit one higher (47-83 -> 47-84, 47-89 -> 47-80, 47-39 -> 47-40), and its answer
    # is what the tool said to the call
    typo = 0
    for r in rows:
        sku = r["ask"]
        assert study.is_sku(sku) and r["truth"] == study.stock_of(sku)
        called = r["demo"][1]["content"].split('"sku":"')[1][:5]
        assert study.is_sku(called) and called[:3] == sku[:3]
        typo += called != sku
        assert r["demo"][2]["content"] == r["demo"][3]["content"] == study.stock_of(called)
    assert 0.55 < typo / len(rows) < 0.65  # the sloppy teacher's 60%
    # Random(1)'s first draw is 0.134 < 0.6: the teacher mistypes, 83 -> 84
    assert prepare.row("47-83", random.Random(1))["demo"][1]["content"] == (
        '<tool_call>{"name":"stock","arguments":{"sku":"47-84"}}</tool_call>')


def test_the_studys_reward_and_advantage_give_hand_computed_values():
    import torch

    study = load_script("experiments/kv_lookup/study.py", "kv_lookup_study")
    assert study.graded(" 5120 ", "5120", tool_calls=1) == {"correct": 1.0, "digits": 1.0, "guessed": 0.0}
    assert study.graded("5120", "5120", tool_calls=0) == {"correct": 1.0, "digits": 1.0, "guessed": -0.2}
    # 5 and 2 in their places, 1 and 0 swapped: 2 of 4 digits
    assert study.graded("5021", "5120", tool_calls=2) == {"correct": 0.0, "digits": 0.5, "guessed": 0.0}
    # another length: no digit is in its place
    assert study.graded("512", "5120", tool_calls=1) == {"correct": 0.0, "digits": 0.0, "guessed": 0.0}
    # two groups: rewards [1, 0, 0, 1] (mean 0.5) and [1, 1] (mean 1); scale 2: 2 x (r - mean)
    batch = {"rewards": torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]),
             "group_index": torch.tensor([0, 0, 0, 0, 1, 1]),
             "response_mask": torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [0.0, 1.0], [1.0, 1.0], [1.0, 1.0]])}
    adv = study.centred(batch, None, scale=2.0)
    assert adv.tolist() == [[1.0, 1.0], [-1.0, 0.0], [-1.0, -1.0], [0.0, 1.0], [0.0, 0.0], [0.0, 0.0]]


@pytest.mark.slow  # two dry runs of run.py (~6 s)
def test_an_advantage_argument_set_globally_names_the_stage_entry_to_move_it_to():
    """A study's advantage function with an argument, set at the top of the overlay (as README's
    `+algorithm.advantage_args.scale=...` shows), reaches the warm-up stage too, whose
    advantage_fn none takes none; a stage's `advantage_args: {}` does not clear it (a stage's entry
    is merged key by key). The message said "The stage's own entry sets algorithm.advantage_fn:
    change it there", which would break the warm-up; it now says to set the argument in the entry of
    the stage that uses it. A misspelt argument in that entry is named without that sentence."""
    e = _error(run_cli(*STUDY, "dry_run=true", "+algorithm.advantage_args.scale=2"))
    assert e == ("stage sft_warmup: algorithm.advantage_args has ['scale'], which algorithm.advantage_fn=none does "
                 "not take; its own arguments are [] (the rest of its settings are the algorithm.* keys it reads "
                 "from cfg). A stage's entry is merged onto the global config, a dict key by key: `advantage_args: "
                 "{}` in it clears nothing. Set algorithm.advantage_args only in the entry of the stage whose "
                 "function takes it (stages.<i>.algorithm.advantage_args), not globally; this is stages.0.")
    e = _error(run_cli(*STUDY, "dry_run=true", "+stages.1.algorithm.advantage_args.scal=2"))
    assert e == ("stage grpo: algorithm.advantage_args has ['scal'], which algorithm.advantage_fn="
                 "experiments.kv_lookup.study.centred does not take; its own arguments are ['scale'] (the rest "
                 "of its settings are the algorithm.* keys it reads from cfg). Did you mean scale (not scal)?")


@pytest.mark.slow  # one run.py that stops before composing (~2 s)
def test_a_relative_search_path_run_from_the_studys_folder_says_where_it_was_read_from():
    """`python ../../run.py 'hydra.searchpath=[file://experiments/kv_lookup/conf]' ...` from the
    study's own folder: the relative folder is read from there and does not exist. The message
    listed "conf/ or experiments/kv_lookup/conf/" as if that folder had been searched; it now says
    the folder is not there from the directory the command ran in, and how to give it."""
    r = subprocess.run([sys.executable, str(ROOT / "run.py"), *STUDY, "dry_run=true"], cwd=HERE,
                       capture_output=True, text=True, timeout=120)
    e = _error(r)
    assert e.startswith("experiment=kv_lookup: there is no experiment/kv_lookup.yaml in conf/ or "
                        "experiments/kv_lookup/conf/ (the options of 'experiment' are ")
    assert e.endswith(f"The search path's experiments/kv_lookup/conf is no folder from {HERE}: a relative "
                      f"hydra.searchpath entry is read from the directory you run from; run from the folder "
                      f"it is relative to, or give it absolute (file:///...).")
    # the same command from the repository's folder composes (the dry run's plan, status 0); its
    # warm-up reads the `demo` column's conversations (it said "responses in None, prompts in
    # 'question'", two columns the file does not have and the stage does not read)
    r = run_cli(*STUDY, "dry_run=true")
    assert r.returncode == 0, r.stderr[-2000:]
    assert ("trains on      experiments/kv_lookup/data (file; conversations in 'demo', every assistant turn "
            "trained on)\n") in r.stdout


def test_a_tool_that_raises_its_own_exception_says_the_task_is_left_out_and_to_raise_tool_error():
    """The study's tool first written as `return DB[sku]`: an SKU the model made up is a KeyError,
    which fails the whole task (its 8 conversations left out of training, so the made-up call is
    never scored). The warning said only "the environment's step raised or timed out at turn 1";
    it now says what that costs and that a ToolError is a failed call the model reads back."""
    from types import SimpleNamespace

    from rft.rollout.workflows import multi_turn

    study = load_script("experiments/kv_lookup/study.py", "kv_lookup_study")

    class RaisingEnv(study.StockEnv):
        tools = {"stock": lambda sku: {"47-83": "5120"}[sku]}

    def call(fn, convs):  # the explorer's runners: a step that raised comes back as None
        out = []
        for c in convs:
            try:
                out.append(fn(c))
            except Exception:
                out.append(None)
        return out

    env = RaisingEnv()
    env.reset(SimpleNamespace(messages=[], answer="5120"))
    conv = multi_turn.Conversation(SimpleNamespace(task_id="kv_train/0"), env, [], [1, 2])
    conv.turns = 1
    conv.messages.append({"role": "assistant", "content": '<tool_call>{"name":"stock","arguments":{"sku":"47-84"}}</tool_call>'})
    multi_turn._environment_turn([conv], call, RaisingEnv, tok=None, budget=56)
    assert conv.failed == (
        "the environment's step raised or timed out at turn 1 (a tool that raises anything but ToolError fails "
        "its whole task, left out of training and counted in rollout/failed_tasks; the exception and its line are "
        "in the warning before this one. For a call the model got wrong, raise "
        "rft.rollout.environments.tools.ToolError(reason): the model reads `error: <reason>` back and the "
        "conversation goes on)")
    # the study's own tool raises ToolError: a failed call the model reads, counted, the task goes on
    env = study.StockEnv()
    env.reset(SimpleNamespace(messages=[], answer="5120"))
    reply, parts, done = env.step('<tool_call>{"name":"stock","arguments":{"sku":"47-1"}}</tool_call>')
    assert reply == {"role": "tool", "content": "error: no such sku '47-1': two numbers of 32..99 joined by a dash"}
    assert (parts, done, env.info["tool_failures"]) == ({}, False, 1)
    # then an answer: scored by the study's `graded`, a call having been made
    assert env.step("5120") == (None, {"correct": 1.0, "digits": 1.0, "guessed": 0.0}, True)


@pytest.mark.slow  # the study shortened: 250 warm-up steps, 6 GRPO steps, stopped and resumed (~45 s)
def test_the_study_learns_stops_on_ctrl_c_resumes_and_exports_a_policy_transformers_loads(tmp_path):
    """README's path for a user's own study, end to end: the run, Ctrl-C (SIGINT) after a GRPO
    checkpoint, the same command again, then the export loaded with transformers alone. The warm-up
    evaluates only at its start and end (the test reads the GRPO stage's evals alone)."""
    import os
    import signal
    import time

    env = {**os.environ, "RFT_CHECKPOINT_ROOT_DIR": str(tmp_path / "runs")}
    args = [*STUDY, "cluster=inline", "buffer.total_steps=6", "trainer.save_interval=3", "explorer.eval_interval=3",
            "stages.0.explorer.eval_interval=250"]
    grpo = tmp_path / "runs" / "rft" / "kv_lookup" / "grpo"
    # each command a run.py process forked from one that imported torch (resume_support.Forked: the
    # same command, argv and signals without a fresh interpreter's imports, ~4 s a run)
    proc = Forked(args, env, tmp_path / "first_run")
    deadline = time.time() + 400
    while not (grpo / "checkpoints" / "step_3" / "state.json").exists():
        assert proc.poll() is None and time.time() < deadline, "the run ended before its step-3 checkpoint"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=120) == 130, (tmp_path / "first_run.err").read_text()[-2000:]
    err = (tmp_path / "first_run.err").read_text()
    newest = err.split("the newest checkpoint: ")[1].split(")")[0]
    assert err.strip().startswith("rft: interrupted. Run the same command again to resume")
    assert newest.startswith(str(grpo / "checkpoints" / "step_"))

    r = run_to_end(args, env, tmp_path / "resumed_run")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"[grpo] resuming from step {newest.rsplit('_', 1)[1]} ({newest})" in r.stdout
    evals = {json.loads(line)["step"]: json.loads(line)["eval/kv_test/accuracy"]
             for line in (grpo / "metrics.jsonl").read_text().splitlines() if "eval/kv_test/accuracy" in line}
    # the warm start copies the right SKU 40% of the time and little of the tool's reply; 6 steps of
    # the study's partial credit raise the held-out mean reward (0.17 -> 0.40 on our machine; 0.61 -> 1.91
    # with seed=1)
    assert evals[6] > evals[0] + 0.1, evals

    from transformers import AutoModelForCausalLM, AutoTokenizer

    subprocess.run([sys.executable, "-m", "rft.runtime.export", str(grpo / "checkpoints" / "step_6"),
                    str(tmp_path / "policy")], cwd=ROOT, env=env, check=True, capture_output=True)
    tok = AutoTokenizer.from_pretrained(tmp_path / "policy")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    ids = tok.apply_chat_template([{"role": "user", "content": "47-83"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    text = tok.decode(model.generate(**ids, max_new_tokens=12, do_sample=False)[0][ids["input_ids"].shape[1]:])
    assert text.startswith('<tool_call>{"name":"stock","arguments":{"sku":"47-'), text
