"""SIGTERM outside Slurm says where the run stopped and how to resume it."""

import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import ROOT
from test_studio import browser  # noqa: F401  (a fixture: headless Chromium)

from rft.runtime import preemption

# small steps (4 tasks x 2 rollouts) and no eval at the start: the signal comes once step 2's checkpoint is
# whole, and what it says depends on no step's size
LONG = ["stages=[]", "cluster=inline", "monitor=console", "buffer.total_steps=400", "trainer.save_interval=2",
        "explorer.eval_interval=1000", "explorer.eval_on_startup=false", "buffer.batch_size=4", "algorithm.repeat_times=2"]


def _env(root: Path) -> dict[str, str]:
    """This environment with RFT_CACHE_DIR (the session's cache) and RFT_CHECKPOINT_ROOT_DIR=`root` its only
    RFT_* variables: the resume command starts with them (`_prefix`)."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("RFT_")},
            "RFT_CACHE_DIR": os.environ["RFT_CACHE_DIR"], "RFT_CHECKPOINT_ROOT_DIR": str(root)}


def _prefix(root: Path) -> str:
    """What the resume command starts with for `_env(root)`: typed in a new shell without them, the
    same command started a fresh run in ./checkpoints."""
    return f"RFT_CACHE_DIR={shlex.quote(os.environ['RFT_CACHE_DIR'])} RFT_CHECKPOINT_ROOT_DIR={shlex.quote(str(root))} "


def _terminated_at_step_2(args: list[str], root: Path, checkpoints: str) -> tuple[int, str]:
    """`python run.py <args>`, sent SIGTERM once the checkpoint of step 2 matching `checkpoints` (a
    glob under `root`) is whole; its exit status and stderr."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT, env=_env(root),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not list(root.glob(checkpoints)):
        assert proc.poll() is None and time.time() < deadline, "the run ended before its step-2 checkpoint"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # what kill, timeout, or a scheduler other than Slurm sends
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


@pytest.mark.slow  # a training run
@pytest.mark.parametrize("cluster", ["inline", "local"])
def test_sigterm_stops_a_run_with_where_it_stopped_and_the_command_that_resumes_it(cluster, tmp_path):
    # it died by the signal without a word (exit -15: the console and run.log ended mid-stage); with a
    # Ray instance (cluster=local), ray.init's handler exited 15 after a stack trace of absl's
    args = [*LONG, f"cluster={cluster}", "name=stopped"]
    rc, err = _terminated_at_step_2(args, tmp_path, "rft/stopped/checkpoints/step_2/state.json")
    assert rc == 143, err[-3000:]  # 128 + 15, as a shell reports a process SIGTERM ended
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "SIGTERM received" not in err, err[-3000:]
    run = tmp_path / "rft" / "stopped"
    said = re.search(r"^rft: stopped by SIGTERM after step (\d+) of stage grpo\. Run the same command again to "
                     r"resume \(the newest checkpoint: (\S+)\)\. The command: (.*)$", err, re.M)
    assert said, err[-3000:]
    step, newest = int(said[1]), Path(said[2])
    # the newest whole checkpoint at the signal: step 2 or a later one (every 2 steps), at most the last to end
    assert newest.parent == run / "checkpoints" and (newest / "state.json").exists()
    assert 2 <= int(newest.name.removeprefix("step_")) <= step
    # as a shell takes it: stages=[] quoted (a glob's brackets), after the RFT_* variables the run was started with
    assert said[3] == _prefix(tmp_path) + shlex.join(["python", str(ROOT / "run.py"), *args])
    # and the run's log ends with the same line
    assert (run / "run.log").read_text().rstrip().endswith(said[0].removeprefix("rft: "))


@pytest.mark.slow  # a training run
def test_sigterm_to_a_sweep_of_the_basic_launcher_names_the_sweeps_directory(tmp_path):
    rc, err = _terminated_at_step_2(["-m", *LONG, "seed=1,2"], tmp_path, "rft/multirun/*/0/checkpoints/step_2/state.json")
    [sweep] = (tmp_path / "rft" / "multirun").iterdir()
    assert rc == 143 and "Traceback" not in err, err[-3000:]
    command = _prefix(tmp_path) + shlex.join(["python", str(ROOT / "run.py"), "-m", *LONG, "seed=1,2",
                                              f"hydra.sweep.dir={sweep}"])
    said = (rf"^rft: stopped by SIGTERM after step \d+ of stage grpo\. Run the same command again with "
            rf"hydra\.sweep\.dir={sweep} to resume this sweep \(the newest checkpoint: {sweep}/0/checkpoints/"
            rf"step_\d+\); without it, the sweep starts over in a new directory\. The command: ")
    assert re.search(said + re.escape(command) + "$", err, re.M), err[-3000:]


def _run_script(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter (its own signal handlers, not pytest's)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_sigterm_raises_terminated_naming_the_stage_and_the_last_step_to_end():
    r = _run_script("""
        import os, signal
        from rft.runtime import preemption

        def term(where):
            try:
                with preemption.sigterm_stops():
                    os.kill(os.getpid(), signal.SIGTERM)
                    for _ in range(10**6):  # the handler runs at the next bytecode
                        pass
            except preemption.Terminated as e:
                print(e.where)
            # the default again once the run is over
            print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)

        term(None)
        with preemption.steps("grpo", print):
            term(None)
            preemption.due(7)
            term(None)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["before the first stage's steps began", "True",
                                     "in stage grpo, before its first step ended", "True",
                                     "after step 7 of stage grpo", "True"]


def test_sigterm_is_left_to_a_handler_already_there_a_fork_and_a_second_signal():
    """submitit's job ignores SIGTERM (its handler `bypass`: Slurm's preemption sends it, the job is
    requeued at the warning): kept. A process forked from the run, and a second SIGTERM, end as before."""
    r = _run_script("""
        import os, signal, time
        from rft.runtime import preemption

        def bypass(signum, frame):
            print("bypassed")

        signal.signal(signal.SIGTERM, bypass)
        with preemption.sigterm_stops():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

        with preemption.sigterm_stops():
            pid = os.fork()
            if pid == 0:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            print("child", os.WIFSIGNALED(status) and os.WTERMSIG(status))
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            except preemption.Terminated:
                print("first")
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
                print("not ended")
    """)
    assert r.stdout.splitlines() == ["bypassed", "child 15", "first"], r.stderr
    assert r.returncode == -signal.SIGTERM


def test_sigterm_is_left_alone_in_a_slurm_job_that_the_watcher_watches():
    """launchers/ray_slurm.sbatch: Slurm's SIGTERM comes at the job's very end, after its requeue."""
    # SIGTERM as a fresh `python run.py` has it: a test before this one in the same pytest worker may have
    # left Ray's own handler (ray.init installs it), which sigterm_stops leaves alone by design
    found = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        before = signal.getsignal(signal.SIGTERM)
        preemption.current = object()  # what `watch` sets in such a job
        try:
            with preemption.sigterm_stops():
                assert signal.getsignal(signal.SIGTERM) is before
        finally:
            preemption.current = None
        with preemption.sigterm_stops():
            assert signal.getsignal(signal.SIGTERM) is not before  # elsewhere it is taken
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGTERM, found)


# ---------------------------------------------------------------- a misspelt launcher

def test_a_misspelt_launcher_says_did_you_mean_as_rfts_own_groups_do():
    """hydra/launcher=locale printed Hydra's 'Could not find' with its search path and HYDRA_FULL_ERROR;
    now the paragraph of a misspelt cluster=inlin. The options are conf/hydra/launcher's files (local,
    slurm) and Hydra's own and its plugins' (basic, submitit_local, submitit_slurm)."""
    from conftest import run_cli

    r = run_cli("-m", "hydra/launcher=locale", "seed=1,2")
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr == (
        "\nrft: configuration error: hydra/launcher=locale: there is no conf/hydra/launcher/locale.yaml (the options "
        "of 'hydra/launcher' are basic, local, slurm, submitit_local, submitit_slurm). Did you mean "
        "hydra/launcher=local?\n\n")


@pytest.mark.parametrize("launcher", ["basic", "submitit_local", "local", "slurm"])
def test_the_launchers_of_hydra_its_plugins_and_conf_pass_the_check(launcher):
    from conftest import CONF

    from rft.plan.overlays import check

    assert check(["-m", f"hydra/launcher={launcher}", "seed=1,2"], CONF) is None


def test_a_misspelt_launcher_in_a_sweeps_list_is_named():
    from conftest import CONF

    from rft.plan.overlays import check

    assert check(["-m", "hydra/launcher=basic,slrum"], CONF) == (
        "hydra/launcher=slrum: there is no conf/hydra/launcher/slrum.yaml (the options of 'hydra/launcher' are basic, "
        "local, slurm, submitit_local, submitit_slurm). Did you mean hydra/launcher=slurm?")


# ---------------------------------------------------------------- the studio's count of a sweep's jobs

SIX = """hydra:
  sweeper:
    _target_: hydra._internal.core_plugins.basic_sweeper.BasicSweeper
    max_batch_size: null
    params: null
  overrides:
    task: ['algorithm=grpo,dapo', 'seed=1,2,3']
"""


def _job(sweep: Path, num: int) -> None:
    import json

    (sweep / str(num) / ".hydra").mkdir(parents=True)
    (sweep / str(num) / ".hydra" / "overrides.yaml").write_text(f"- seed={num}\n")
    (sweep / str(num) / "metrics.jsonl").write_text(json.dumps({"step": 1, "eval/accuracy": 0.5}) + "\n")


def test_the_studios_sweep_list_counts_the_jobs_planned_beside_those_started(tmp_path):
    """6 jobs planned (2 algorithms x 3 seeds), 4 started: the list said "4 jobs"; the planned count
    comes from the report's reading of multirun.yaml (None where it cannot tell: another sweeper, or no
    multirun.yaml)."""
    from rft.studio.runs import Runs

    sweep = tmp_path / "rft" / "multirun" / "2026-11-29_05-00-00"
    for num in range(4):
        _job(sweep, num)
    (sweep / "multirun.yaml").write_text(SIX)
    other = tmp_path / "rft" / "multirun" / "2026-11-29_06-00-00"
    _job(other, 0)
    _job(other, 1)
    os.utime(other, (1, 1))  # the older: listed second
    assert Runs(tmp_path).listing()["sweeps"] == [
        {"id": "rft/multirun/2026-11-29_05-00-00", "jobs": 4, "planned": 6},
        {"id": "rft/multirun/2026-11-29_06-00-00", "jobs": 2, "planned": None}]


@pytest.mark.parametrize("jobs, planned, shown", [(4, 6, "4 of 6 jobs"), (6, 6, "6 jobs"), (2, None, "2 jobs"),
                                                     (7, 6, "7 jobs")])
def test_the_sweep_list_says_how_many_of_the_planned_jobs_started(jobs, planned, shown):
    """studio.js's label of a sweep in the list, run by node."""
    import json
    import shutil

    node = shutil.which("node")
    if node is None:
        pytest.skip("no node to run studio.js's function with")
    js = (ROOT / "rft" / "studio" / "static" / "studio.js").read_text()
    [fn] = re.findall(r"^function sweepLabel\(s\) \{.*?^\}$", js, re.S | re.M)
    r = subprocess.run([node, "-e", f"{fn}\nconsole.log(sweepLabel({json.dumps({'jobs': jobs, 'planned': planned})}))"],
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == shown, r.stderr


# ---------------------------------------------------------------- what a reward prints, capped

def _loud(prompt, response, task):
    print("x" * 99)  # 100 characters a call, its newline included
    return 1.0


def test_what_rewards_print_is_capped_with_one_note_and_the_runs_own_lines_pass(monkeypatch, capsys):
    """A reward's print is multiplied by every response: 1 MB a call wrote 2.9 GB to the console in the
    tiny default's 20 steps. Past the cap (here 250 characters) it is left out, with one note."""
    import threading

    from rft.rewards import scoring, stdout_cap

    monkeypatch.setattr(stdout_cap, "CAP_CHARS", 250)
    scorer = scoring.Scorer([scoring.Part("loud", 1.0, scoring._per_response(_loud, {}), False)])
    task = scoring.Reward(0.0)  # (any object: the function does not read it)
    assert scorer("p", ["a", "b", "c", "d"], task) == [1.0] * 4  # 4 calls, 400 characters
    print("[grpo] step 1/2")  # the run's own line, past the cap: printed
    done = threading.Event()
    threading.Thread(target=lambda: (scorer("p", ["e"], task), done.set())).start()  # an explorer's thread
    assert done.wait(10)
    out = capsys.readouterr().out
    # 250 = 2 whole lines of 100 + 50 characters of the third; then the note, once
    assert out == ("x" * 99 + "\n") * 2 + "x" * 50 + (
        "\nrft: reward 'loud' printed more than 250 characters: what this taskset's rewards print from here on is left "
        "out (every response calls them, so their prints would fill the console and the disk its log is on). Print a "
        "sample of the calls, or write to a file of your own.\n") + "[grpo] step 1/2\n"
    # another Scorer (the eval set's; a sweep's next job in the same process) prints again, up to its own cap
    again = scoring.Scorer([scoring.Part("loud", 1.0, scoring._per_response(_loud, {}), False)])
    assert again("p", ["a"], task) == [1.0] and capsys.readouterr().out == "x" * 99 + "\n"


@pytest.mark.slow  # a training run
def test_a_reward_that_prints_a_megabyte_a_call_leaves_a_console_of_about_a_megabyte(tmp_path):
    """The tiny default (stages=[]), 3 steps and the evals: 612 MB were printed (584 calls)."""
    (tmp_path / "loud_reward.py").write_text("def loud(prompt, response, task):\n    print('x' * 2**20)\n    return 0.0\n")
    from conftest import run_cli

    # 4 tasks x 2 rollouts a step: any call past the first of each taskset's is past its cap already
    r = run_cli("stages=[]", "cluster=inline", "buffer.total_steps=3", "explorer.eval_on_startup=false",
                "buffer.batch_size=4", "algorithm.repeat_times=2",
                "buffer.explorer_input.default_reward_fn_type=loud_reward.loud", "name=loud",
                env={"RFT_CHECKPOINT_ROOT_DIR": str(tmp_path), "PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    from rft.rewards.stdout_cap import CAP_CHARS

    # the cap of each taskset's Scorer (the training set's and the eval set's), a note each (~300 characters) and
    # the run's own lines (~2 KB)
    assert 2 * CAP_CHARS < len(r.stdout) < 2 * CAP_CHARS + 10_000
    assert r.stdout.count("rft: reward 'loud' printed more than 1,048,576 characters: ") == 2
    assert "[grpo] step 3/3" in r.stdout


@pytest.mark.slow  # 6.9 s alone, over the fast tier's second
def test_the_runs_pages_sweep_list_reads_4_of_6_jobs_and_counts_on_as_jobs_start(browser, tmp_path):
    from test_studio import _stop, _studio

    sweep = tmp_path / "rft" / "multirun" / "2026-11-29_05-00-00"
    for num in range(4):
        _job(sweep, num)
    (sweep / "multirun.yaml").write_text(SIX)
    proc, url, token = _studio(tmp_path)
    try:
        page = browser.new_page(bypass_csp=True)
        page.goto(f"{url}/runs#token={token}")
        option = '#sweep-choice option[value="rft/multirun/2026-11-29_05-00-00"]'
        page.wait_for_selector(option, state="attached")
        assert page.text_content(option) == "rft/multirun/2026-11-29_05-00-00 (4 of 6 jobs)"
        _job(sweep, 4)  # a job starts: the list, refreshed every 2 s, counts it
        page.wait_for_function(f"document.querySelector('{option}').textContent.endsWith('(5 of 6 jobs)')",
                               timeout=30000)
    finally:
        _stop(proc)
