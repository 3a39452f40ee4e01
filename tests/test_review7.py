"""A long run's sealed state.json over the bound on records still resumes, a damaged or unsealed
one over it is still refused."""
import json

import pytest
from test_checkpoints_manifest import OWNER, said

from rft import manifest
from rft.runtime import checkpoint
from rft.runtime.checkpoint import read_checkpoint, usable_checkpoint

WINDOW = 4096  # data_processor.online_curriculum.window (no upper bound): long outcome strings, few objects


def long_state(d, tasks=17_000):
    """Checkpoint step_2 of stage `d` whose state.json holds an online curriculum's outcomes for
    `tasks` tasks, written as the run writes it and sealed: each entry '"<row>": "<4096 digits>", '
    is ~4,100 bytes, 17,000 of them ~69.8 MB (66.6 MiB), over the 64 MiB bound."""
    outcomes = {str(r): ("01" if r % 2 else "10") * (WINDOW // 2) for r in range(tasks)}
    checkpoint.write(d, 1, {"version": 1}, owner=OWNER)
    return checkpoint.write(d, 2, {"version": 2, "curriculum": {"outcomes": outcomes}}, owner=OWNER)


def test_a_sealed_state_json_over_the_record_bound_resumes(tmp_path):
    d = tmp_path / "grpo"
    step2 = long_state(d)
    size = (step2 / "state.json").stat().st_size
    assert size > manifest.MAX_RECORD  # 67 MiB > 64 MiB
    assert json.loads((step2 / manifest.MANIFEST).read_text())["files"]["state.json"][0] == size
    lines, say = said()
    ckpt = usable_checkpoint(d, OWNER, "grpo", say)
    assert ckpt.step == 2 and ckpt.problem is None and lines == []  # nothing moved aside
    assert len(ckpt.state["curriculum"]["outcomes"]) == 17_000
    assert ckpt.state["curriculum"]["outcomes"]["3"] == "01" * 2048
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ["step_1", "step_2"]


def test_a_long_state_json_grown_past_its_listed_size_is_damaged(tmp_path):
    d = tmp_path / "grpo"
    step2 = long_state(d)
    size = (step2 / "state.json").stat().st_size
    with open(step2 / "state.json", "ab") as f:
        f.write(b" ")  # one byte more than the manifest lists: not read, damage
    assert read_checkpoint(step2).problem == (f"{step2 / 'state.json'}: does not read (larger than {size} bytes, "
                                              f"which no record rft writes is)")
    lines, say = said()
    assert usable_checkpoint(d, OWNER, "grpo", say).step == 1  # the one before
    assert len(lines) == 1 and "checkpoint step 2 is damaged" in lines[0]


def test_an_unsealed_state_json_over_the_bound_is_still_refused(tmp_path):
    """No manifest (a legacy checkpoint): nothing vouches for its size, so the bound holds."""
    d = tmp_path / "grpo"
    step2 = long_state(d)
    (step2 / manifest.MANIFEST).unlink()
    state = json.loads((step2 / "state.json").read_text())
    del state["manifest"]  # written before manifests: no mark of one
    (step2 / "state.json").write_text(json.dumps(state))
    assert read_checkpoint(step2).problem == (f"{step2 / 'state.json'}: does not read (larger than "
                                              f"{manifest.MAX_RECORD} bytes, which no record rft writes is)")


def test_a_conversation_budget_over_the_context_is_refused_at_planning():
    """vLLM's engine holds model.max_model_len (else max_prompt_tokens + max_response_tokens) and
    refused a longer conversation mid-run, where the plan had taken it (KV cache sized 56 tokens)."""
    from conftest import compose_cfg

    from rft.errors import ConfigError
    from rft.plan.batch import make_plan, stage_configs

    def plan(*overrides):
        return make_plan(stage_configs(compose_cfg(["model=tiny_tools", "task=calculator", *overrides]))[-1], 2000)

    ts, ev = "buffer.explorer_input.taskset", "buffer.explorer_input.eval_tasksets.0"
    with pytest.raises(ConfigError) as e:
        plan(f"+{ts}.workflow_args.max_total_tokens=100")  # tiny_tools: 24 + 32 = 56
    assert str(e.value) == (
        f"{ts}.workflow_args.max_total_tokens=100 is over the context the run is sized for, model.max_prompt_tokens "
        "+ model.max_response_tokens = 56: explorer=vllm's engine holds only that context and would stop the run at "
        "the first conversation longer than it ('longer than the maximum model length'), and the memory plan does not "
        "size for the longer one. Raise model.max_model_len to 100 (or model.max_response_tokens to 76), or lower "
        "max_total_tokens to 56 or less.")  # 76 = 100 - 24
    with pytest.raises(ConfigError) as e:
        plan(f"+{ev}.workflow_args.max_total_tokens=81", "model.max_model_len=80")
    assert str(e.value).startswith("buffer.explorer_input.eval_tasksets[0].workflow_args.max_total_tokens=81 is over "
                                   "the context the run is sized for, model.max_model_len=80: ")
    assert str(e.value).endswith("Raise model.max_model_len to 81, or lower max_total_tokens to 80 or less.")
    # within the context: planned as before
    plan(f"+{ts}.workflow_args.max_total_tokens=56")
    plan(f"+{ts}.workflow_args.max_total_tokens=80", "model.max_model_len=80")


def test_an_unknown_loss_arg_gets_no_hint_rather_than_a_wrong_one(tmp_path):
    """kl_beta (another system's KL weight) given to GRPO's loss was told 'Did you mean algorithm.dpo_beta
    (not kl_beta)? ... set algorithm.dpo_beta=<value>': a key GRPO never reads, so the run went on as
    if the KL were weighted. The message now lists the loss's own arguments and stops there. (TRL's
    delta, told dpo_beta alike, now names the dual clip it is: algorithm.clip_ratio_c, 15c66f6.)"""
    import rft.runtime.main
    from conftest import compose_cfg

    from rft.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        rft.runtime.main._main(compose_cfg(["stages=[]", "+algorithm.args.kl_beta=0.1", "dry_run=true",
                                            f"checkpoint_root_dir={tmp_path}"]))
    assert str(e.value) == ("algorithm.args has ['kl_beta'], which algorithm.policy_loss_fn=ppo_clip does not take; "
                            "its own arguments are [] (the rest of its settings are the algorithm.* keys it reads "
                            "from cfg).")


@pytest.mark.parametrize("name", ["kl_target", "kl_beta", "clip_ratio_dual", "optim", "args"])
def test_a_key_near_in_spelling_only_is_not_named(name):
    # before: delta and kl_beta -> algorithm.dpo_beta, kl_target -> algorithm.args ('set
    # algorithm.args=<value>'), clip_ratio_dual -> algorithm.clip_ratio_low (the dual clip is
    # clip_ratio_c), optim -> algorithm.optimizer, a section, not a setting. (delta is TRL's name of
    # the dual clip, named as algorithm.clip_ratio_c since 15c66f6: tests/test_foreign_keys.py)
    from rft.config import near_args

    assert near_args([name], ["epsilon"], section="algorithm") == ""


@pytest.mark.parametrize("name, key", [
    ("lamda", "lam"), ("lambda", "lam"), ("gae_lambda", "lam"),  # a word cut short, another system's prefix
    ("entropy_coeff", "entropy_coef"), ("kl_loss_coefficient", "kl_loss_coef"), ("clip_ratio_lower", "clip_ratio_low"),
    ("rollout_is_capp", "rollout_is_cap"), ("actor_entropy_coef", "entropy_coef"),
])
def test_a_misspelt_setting_is_still_named(name, key):
    from rft.config import near_args

    assert near_args([name], ["epsilon"], section="algorithm") == (
        f" Did you mean algorithm.{key} (not {name})? That is a key of algorithm itself, which the function reads "
        f"from cfg, not an argument: set algorithm.{key}=<value>, and drop {name} from the args.")


def _sleeper(job_id, folder, child_pid_file=None):
    """A process as a local job's task: submitit's controller's environment (its job id, and its
    command naming the job's folder); with `child_pid_file`, it starts a child of its own, which
    inherits that environment, and writes the child's pid there."""
    import os
    import subprocess
    import sys

    code = "import time; time.sleep(120)"
    if child_pid_file:
        code = (f"import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', {code!r}]); "
                f"open({str(child_pid_file)!r}, 'w').write(str(c.pid)); time.sleep(120)")
    return subprocess.Popen([sys.executable, "-c", code], env={
        **os.environ, "SUBMITIT_LOCAL_JOB_ID": job_id,
        "SUBMITIT_LOCAL_COMMAND": f"{sys.executable} -u -m submitit.core._submit '{folder}/%j'"})


def test_orphans_are_those_of_the_jobs_folder_not_another_sweeps_job_of_the_same_id(tmp_path):
    """The job id of a local job is its controller's pid: after pid reuse, another sweep's job can
    have the same one. Its task (SUBMITIT_LOCAL_COMMAND naming the other sweep's folder) was killed."""
    import os
    import time

    import psutil

    from rft.reporting.sweep import stop_orphans

    job_id = f"t{os.getpid()}r"
    ours, theirs = tmp_path / "ours" / ".submitit", tmp_path / "theirs" / ".submitit"
    task = _sleeper(job_id, ours, tmp_path / "child.pid")
    other = _sleeper(job_id, theirs)
    try:
        for _ in range(500):  # the child started and said its pid
            if (tmp_path / "child.pid").exists() and (tmp_path / "child.pid").read_text():
                break
            time.sleep(0.02)
        child = int((tmp_path / "child.pid").read_text())
        killed, unlooked = stop_orphans(job_id, ours / job_id)
        assert sorted(killed) == sorted([task.pid, child]) and unlooked is None  # the child inherited both keys
        assert task.wait(timeout=10) == -9
        for _ in range(500):  # not ours to wait for: gone, or a zombie its new parent has not reaped
            if not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE:
                break
            time.sleep(0.02)
        assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
        assert other.poll() is None  # the other sweep's job runs on
    finally:
        for p in (task, other):
            p.kill()
            p.wait()


def test_a_process_table_that_cannot_be_listed_is_said_not_a_traceback(tmp_path, monkeypatch, capsys):
    import psutil
    from submitit.core.utils import UncompletedJobError
    from test_sweep_local import FakeJob

    from rft.reporting.sweep import watch

    def hidden(*a, **k):
        raise PermissionError(13, "Permission denied", "/proc")

    monkeypatch.setattr(psutil, "process_iter", hidden)
    dead = UncompletedJobError(f"Job 41 (task: 0) with path {tmp_path}/41/41_0_result.pkl\n"
                               "has not produced any output (state: INTERRUPTED)")

    class Killed(FakeJob):
        state = "INTERRUPTED"

    with pytest.raises(UncompletedJobError):
        watch([Killed("41", tmp_path / "%j", 1, dead)], [["seed=1"]], 1, str(tmp_path), poll_s=0.01)
    assert capsys.readouterr().out.splitlines()[-1] == (
        "[sweep] job 1 (41) ended with state INTERRUPTED and no result; what it left running could not be looked "
        "for (PermissionError: [Errno 13] Permission denied: '/proc'): stop any process whose environment holds "
        "SUBMITIT_LOCAL_JOB_ID=41 (`ps eww`) [1/1 ended]")
