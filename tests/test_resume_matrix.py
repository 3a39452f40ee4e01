"""A run killed with SIGKILL and run again with the same command ends where the uninterrupted run
ends (README, Resume), for each feature a study turns on: the final weights bit for bit, every
piece of state a checkpoint carries (optimizer, scheduler, RNG, critic, the schedule's state.json:
buffer position, experiences explored ahead, curriculum, reward statistics), the batches trained
on and the metric rows.

Each case is a short run from the session's SFT warm start (conftest.warm_start): 4 GRPO steps of
4 tasks x 4 rollouts, a checkpoint every 2, no eval set (but for the eval case). It runs straight,
then again, SIGKILLed once its step-2 checkpoint is written (or, in the middle of a step, by
itself the moment its buffer has taken an explore step's experiences that no checkpoint accounts
for yet), then the same command once more. rft has no fault hooks of its own: the self-kill is a
sitecustomize the test puts on the killed run's PYTHONPATH.
"""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, run_cli
from safetensors.torch import load_file

from rft.reporting.monitor import read_metrics

pytestmark = pytest.mark.slow

# wall-clock and process figures differ between two processes
VOLATILE = ("timing/", "tokens_per_s", "perf/tflops", "perf/mfu", "max_memory_gb", "rollout/partial_s")

SHORT = ["stages=[]", "cluster=inline", "monitor=console", "buffer.total_steps=4", "trainer.save_interval=2",
         "buffer.batch_size=4", "algorithm.repeat_times=4", "explorer.eval_interval=100",
         "explorer.eval_on_startup=false"]
NO_EVAL = ["buffer.explorer_input.eval_tasksets=[]"]


def stable(obj):
    """`obj` without its wall-clock figures, at any depth."""
    if isinstance(obj, dict):
        return {k: stable(v) for k, v in obj.items() if not (k.startswith(VOLATILE) or k.endswith(VOLATILE))}
    if isinstance(obj, list):
        return [stable(v) for v in obj]
    return obj


def same(a, b, where="") -> None:
    """Two loaded trainer states equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, set(a) ^ set(b))
        for k in a:
            same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}/{i}")
    else:
        assert a == b, (where, a, b)


def weights(ckpt: Path) -> dict:
    files = sorted((ckpt / "hf").glob("*.safetensors")) + sorted((ckpt / "adapter").glob("*.safetensors"))
    assert files, ckpt
    out = {}
    for f in files:
        out.update({f"{f.parent.name}/{k}": v for k, v in load_file(f).items()})
    return out


def launch(args, env):
    return subprocess.Popen([sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def kill_when(args, env, ready, timeout: float = 300) -> None:
    """`python run.py <args>`, SIGKILLed as soon as `ready()`; fails if the run ends first."""
    proc = launch(args, env)
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None and time.time() < deadline, "the run ended before the point of its kill"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL


def at_checkpoint(run: Path, step: int):
    return lambda: (run / "checkpoints" / f"step_{step}" / "state.json").exists()


# the run kills itself (SIGKILL) the moment its buffer has taken its KILL_AFTER_PUT-th write of
# experiences: an explore step's experiences are in, the checkpoint that would account for them is not
KILL_AFTER_PUT = """
import os, sys
if sys.argv and sys.argv[0].endswith("run.py") and os.environ.get("KILL_AFTER_PUT"):
    import rft.data.buffer as b
    calls = [0]
    def hooked(put):
        def wrapper(self, exps):
            put(self, exps)
            calls[0] += 1
            if calls[0] == int(os.environ["KILL_AFTER_PUT"]):
                os.kill(os.getpid(), 9)
        return wrapper
    for cls in (b.QueueBuffer, b.SQLBuffer, b.FileBuffer):
        cls.put = hooked(cls.put)
"""


def killed_after_put(args, env, tmp_path: Path, n: int) -> None:
    """`python run.py <args>`, killed by itself once its buffer has taken `n` writes."""
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(KILL_AFTER_PUT)
    env = {**env, "KILL_AFTER_PUT": str(n), "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT)])}
    r = subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]


def same_sql_buffer(a: Path, b: Path, sa: dict, sb: dict) -> None:
    """A SQLite buffer's ids are AUTOINCREMENT, never reused (rft/data/buffer.py: a row written
    after a truncation must land above every reader's cursor), so the rows a resume dropped and
    wrote again have new ids: its positions are the uninterrupted run's plus the rows dropped. The
    nearest exact property: the same rows in the same order (but their ids and write times), and
    the same read position among them."""
    def rows(run):
        with sqlite3.connect(f"file:{run / 'buffer.db'}?mode=ro", uri=True) as db:
            db.row_factory = sqlite3.Row
            return [{k: r[k] for k in r.keys() if k not in ("id", "created_at")}
                    for r in db.execute("select * from experiences order by id")]

    assert rows(a) == rows(b) and len(rows(a)) == sa["last_id"]
    shift = sb["last_id"] - sa["last_id"]
    assert shift > 0  # the rows the resume dropped (explore step 2's: 16)
    assert sb["cursor"] - shift == sa["cursor"] and sa.keys() == sb.keys()


def check_resumes(tmp_path: Path, warm_start: Path | None, extra: list[str], after_put: int | None = None,
                   stage: str = "", short=SHORT) -> tuple[list, dict]:
    """Straight, killed, then resumed: the same result. Killed once its step-2 checkpoint is
    written, or (`after_put`) once its buffer has taken that many writes. `warm_start`: the model
    the run starts from (None: the config's own); `stage`: the stage of the run checked (none: a
    run of one stage). Returns the straight run's metrics and final state.json."""
    env = {**os.environ, "RFT_CHECKPOINT_ROOT_DIR": str(tmp_path)}
    model = [f"model.model_path={warm_start}", "model.builder=null"] if warm_start else []

    def args(name):
        evals = any(x.startswith(("explorer.eval_interval=", "experiment=")) for x in extra)
        groups = {x.split("=")[0] for x in extra}  # a group the case chooses replaces SHORT's
        return [*(x for x in short if x.split("=")[0] not in groups), *([] if evals else NO_EVAL), *model, *extra,
                f"name={name}"]

    straight = run_cli(*args("straight"), env=env)
    assert straight.returncode == 0, straight.stderr[-3000:]
    a, b = tmp_path / "rft" / "straight" / stage, tmp_path / "rft" / "killed" / stage
    if after_put:
        killed_after_put(args("killed"), env, tmp_path, after_put)
    else:
        kill_when(args("killed"), env, at_checkpoint(b, 2))
    assert (b / "checkpoints" / "step_2").exists() and not (b / "checkpoints" / "step_4").exists(), \
        "killed too late to test anything"
    resumed = run_cli(*args("killed"), env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from step 2" in resumed.stdout, resumed.stdout[-2000:]

    end_a, end_b = a / "checkpoints" / "step_4", b / "checkpoints" / "step_4"
    wa, wb = weights(end_a), weights(end_b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    # the weights moved after the resume point, so their equality above means something (a LoRA
    # run saving hf/ at its last step only: its adapters)
    mid = weights(b / "checkpoints" / "step_2")
    assert any(not torch.equal(wa[k], mid[k]) for k in wa.keys() & mid.keys())
    # optimizer moments and step counts, scheduler, RNG, version, critic
    same(torch.load(end_a / "trainer_state.pt", weights_only=True),
         torch.load(end_b / "trainer_state.pt", weights_only=True))
    # the schedule's state: buffer position, explored ahead, curriculum, reward statistics, metrics
    sa, sb = (stable(json.loads((d / "state.json").read_text())) for d in (end_a, end_b))
    if (a / "buffer.db").exists():
        same_sql_buffer(a, b, sa.pop("buffer"), sb.pop("buffer"))
    assert sa == sb
    assert read_metrics(a / "batches.jsonl") == read_metrics(b / "batches.jsonl")
    # the rows before the kill (the killed run's) and after it (the resumed run's)
    ma, mb = read_metrics(a / "metrics.jsonl"), read_metrics(b / "metrics.jsonl")
    assert [m["step"] for m in mb] == [m["step"] for m in ma]
    assert stable(ma) == stable(mb)
    return ma, json.loads((end_a / "state.json").read_text())


MIX_DATA = ["algorithm=mix", "algorithm.sft_batch_size=8",
            "+buffer.trainer_input.auxiliary_buffers.sft_dataset.path=${buffer.explorer_input.taskset.path}",
            "+buffer.trainer_input.auxiliary_buffers.sft_dataset.format.response_key=answer"]

CASES = {
    # PPO: the critic (its weights and optimizer in trainer_state.pt) and GAE
    "ppo-critic": ["algorithm=ppo", "algorithm.critic_lr=1e-3"],
    # a KL loss to the reference model (k3) and a KL penalty on the reward (k1), and an entropy bonus
    "kl-reference-entropy": ["algorithm.kl_loss_fn=k3", "algorithm.kl_loss_coef=0.1", "algorithm.kl_penalty_fn=k1",
                             "algorithm.kl_penalty_coef=0.1", "algorithm.entropy_coef=0.01"],
    "lora": ["model.lora.rank=4", "model.lora.alpha=8", "algorithm.optimizer.lr=1e-2"],
    # several optimizer steps a step (mini-batches, two epochs), gradient accumulation over
    # micro-batches, micro-batches by token count
    "epochs-minibatches-accumulation": ["trainer.ppo_epochs=2", "trainer.mini_batch_size=8",
                                        "trainer.micro_batch_size_per_gpu=4", "trainer.use_dynamic_bsz=true",
                                        "trainer.max_token_len_per_gpu=64"],
    "no-packing": ["trainer.use_remove_padding=false"],
    "warmup-cosine": ["algorithm.optimizer.warmup_steps=3", "algorithm.optimizer.warmup_style=cosine",
                      "algorithm.optimizer.min_lr_ratio=0.1"],
    # DAPO: dynamic sampling draws more task batches to fill a step, overlong shaping
    "dapo-dynamic-sampling": ["algorithm=dapo"],
    "online-curriculum": ["data_processor.online_curriculum.enable=true"],
    # the auxiliary SFT buffer's read position
    "mix-auxiliary-sft": MIX_DATA,
    # a reward part normalised by running statistics (kept by the driver, in state.json)
    "reward-normalisation": ["buffer.explorer_input.taskset.reward_fn=[{fn:exact_match,weight:1.0,normalize:true}]"],
    "lora-hf-last": ["model.lora.rank=4", "model.lora.alpha=8", "algorithm.optimizer.lr=1e-2",
                     "trainer.save_hf_checkpoint=last"],
    "ppo-critic-warmup": ["algorithm=ppo", "algorithm.critic_lr=1e-3", "algorithm.critic_warmup=3"],
    "sft-dataset": ["algorithm=sft", "algorithm.optimizer.lr=1e-3"],
    "ray-actors": ["cluster=local"],
    "two-engines": ["explorer.rollout_model.engine_num=2"],
    "async-checkpoint-sync": ["synchronizer.sync_offset=1", "sync=checkpoint"],
    # partial rollouts in the test mode where which version writes which token is fixed (free-running,
    # it depends on timing: tests/test_dynamic.py checks every group is trained once)
    "partial-rollouts-fixed-interrupts": ["synchronizer.sync_style=dynamic_by_explorer", "explorer.partial_rollout=true",
                                          "explorer.partial_chunk_tokens=2", "synchronizer.fixed_interrupts=true",
                                          "cluster=local"],
    "fsdp2-two-ranks": ["trainer=fsdp2", "trainer.ranks=2", "cluster=local", "cluster.num_cpus=3"],
    # replay that never reads a used experience again (the newest version always ranks first)
    "replay-buffer": ["buffer.trainer_input.experience_buffer.replay_buffer.enable=true",
                      "buffer.trainer_input.experience_buffer.replay_buffer.reuse_cooldown_time=0"],
}


# that the feature was at work in the run (metrics rows, the final state.json)
AT_WORK = {
    "dapo-dynamic-sampling": lambda rows, state: max(m.get("rollout/sampling_tries", 0) for m in rows) > 1,
    "online-curriculum": lambda rows, state: len(state["curriculum"]["outcomes"]) > 0,
    "ppo-critic": lambda rows, state: "critic/value_loss" in rows[-1],
    "reward-normalisation": lambda rows, state: state["reward_norm"]["exact_match"][0] == 4 * 16,
    "mix-auxiliary-sft": lambda rows, state: "loss/sft" in rows[-1],
    "kl-reference-entropy": lambda rows, state: rows[-1]["reward/kl_penalty"] != 0,
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_killed_run_resumes_to_the_uninterrupted_one(name, warm_start, tmp_path):
    rows, state = check_resumes(tmp_path, warm_start, CASES[name])
    assert AT_WORK.get(name, lambda rows, state: True)(rows, state)


# an eval at the start and every 2 steps, sampled (temperature 1, 2 samples a task)
SAMPLED_EVAL = ["explorer.eval_interval=2", "explorer.eval_on_startup=true",
                "buffer.explorer_input.eval_tasksets.0.rollout_args.temperature=1.0",
                "+buffer.explorer_input.eval_tasksets.0.repeat_times=2"]


def test_a_run_with_sampled_evals_resumes_and_its_evals_draw_nothing_training_draws(warm_start, tmp_path):
    """The resumed run skips the eval at step 0 that the uninterrupted one made: the same result
    means the eval's sampling shifted nothing of training's; and a run without evals trains the
    same weights on the same batches."""
    rows, _ = check_resumes(tmp_path, warm_start, SAMPLED_EVAL)
    assert [m["step"] for m in rows if "eval/arithmetic_test/maj@2" in m] == [0, 2, 4]
    r = run_cli(*SHORT, *NO_EVAL, f"model.model_path={warm_start}", "model.builder=null", "name=no_eval",
                env={"RFT_CHECKPOINT_ROOT_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = tmp_path / "rft" / "straight", tmp_path / "rft" / "no_eval"
    wa, wb = weights(a / "checkpoints" / "step_4"), weights(b / "checkpoints" / "step_4")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert read_metrics(a / "batches.jsonl") == read_metrics(b / "batches.jsonl")


@pytest.mark.parametrize("kind", ["queue", "sql", "file"])
def test_a_run_killed_in_the_middle_of_a_step_resumes_to_the_uninterrupted_one(kind, warm_start, tmp_path):
    """Killed the moment explore step 2's experiences are in the buffer (its third write), in
    training step 3, after the step-2 checkpoint: the resume drops what a stored buffer holds after
    the checkpoint and explores step 2 again, identically."""
    check_resumes(tmp_path, warm_start, [f"buffer={kind}"], after_put=3)


def test_an_async_run_killed_in_the_middle_of_a_step_resumes_to_the_uninterrupted_one(warm_start, tmp_path):
    """sync_offset=1 on a sql buffer: the step-2 checkpoint holds explore step 2's experiences,
    explored ahead; killed once explore step 3's are in (the buffer's fourth write)."""
    check_resumes(tmp_path, warm_start, ["buffer=sql", "synchronizer.sync_offset=1"], after_put=4)


def test_a_trainer_run_on_a_stored_buffer_resumes_to_the_uninterrupted_one(warm_start, tmp_path):
    """mode=train from a sql buffer a mode=explore run wrote (4 steps of 16): each run reads its own
    copy (a buffer's read cursor is its reader's), the killed one resumes its cursor."""
    import shutil

    env = {**os.environ, "RFT_CHECKPOINT_ROOT_DIR": str(tmp_path)}
    r = run_cli(*SHORT, *NO_EVAL, f"model.model_path={warm_start}", "model.builder=null", "mode=explore", "buffer=sql",
                f"buffer.trainer_input.experience_buffer.path={tmp_path / 'explored.db'}", "name=explorer", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    for name in ("straight", "killed"):
        shutil.copy(tmp_path / "explored.db", tmp_path / f"{name}.db")
    own_copy = "buffer.trainer_input.experience_buffer.path=${checkpoint_root_dir}/${name}.db"
    _, state = check_resumes(tmp_path, warm_start, ["mode=train", "buffer=sql", own_copy])
    assert state["buffer"]["cursor"] == 4 * 16


def test_on_policy_distillation_resumes_to_the_uninterrupted_run(warm_start, tmp_path):
    """algorithm=opd: the randomly initialised tiny model learns from the warm start as its teacher
    (every token's advantage is the teacher's log-prob less the student's: weights move at once)."""
    check_resumes(tmp_path, None, ["algorithm=opd", f"algorithm.teacher_model_path={warm_start}"])


def test_a_multi_turn_tool_run_resumes_to_the_uninterrupted_run(tmp_path):
    """experiment=calculator_tool (a warm-up on the teacher's conversations, then GRPO over
    conversations with the calculator), its warm-up shortened: the GRPO stage killed and resumed.
    The killed run takes its warm-up from the stage cache."""
    metrics, _ = check_resumes(tmp_path, None, ["experiment=calculator_tool", "stages.0.buffer.total_steps=60",
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
    check_resumes(tmp_path, warm_start, ["buffer.trainer_input.experience_buffer.replay_buffer.enable=true",
                                         "buffer.trainer_input.experience_buffer.replay_buffer.reuse_cooldown_time=0",
                                         "buffer.trainer_input.experience_buffer.replay_buffer.priority_fn_args.decay=-2"])


def stored_rows(path: Path) -> list[dict]:
    """A sql or file buffer's rows in order, without a SQLite row's id and write time."""
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines()]
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        db.row_factory = sqlite3.Row
        return [{k: r[k] for k in r.keys() if k not in ("id", "created_at")}
                for r in db.execute("select * from experiences order by id")]


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
    own. The resumed run drops its own rows written after the checkpoint, and no other's, and writes
    them again: the buffer holds the uninterrupted run's rows, each once (it held 80, explore step
    2's 16 twice), and the other explorer's 8."""
    env = {**os.environ, "RFT_CHECKPOINT_ROOT_DIR": str(tmp_path)}
    suffix = ".db" if kind == "sql" else ".jsonl"

    def args(name):
        return [*SHORT, *NO_EVAL, f"model.model_path={warm_start}", "model.builder=null", "mode=explore",
                f"buffer={kind}", f"buffer.trainer_input.experience_buffer.path={tmp_path / name}{suffix}",
                f"name={name}"]

    straight = run_cli(*args("straight"), env=env)
    assert straight.returncode == 0, straight.stderr[-3000:]
    # killed the moment explore step 2's rows are in, before its step's checkpoint (mode=explore
    # saves every step)
    killed_after_put(args("killed"), env, tmp_path, 3)
    assert sorted(p.name for p in (tmp_path / "rft" / "killed" / "checkpoints").iterdir()) == ["step_2"]
    assert len(stored_rows(tmp_path / f"killed{suffix}")) == 3 * 16
    other = another_explorer(tmp_path / f"killed{suffix}", kind)
    resumed = run_cli(*args("killed"), env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = stored_rows(tmp_path / f"straight{suffix}"), stored_rows(tmp_path / f"killed{suffix}")
    assert len(a) == 4 * 16 and len(b) == 4 * 16 + 8
    # the other explorer's rows, each once, where it wrote them: after the killed run's first 32
    assert [{"group_id": r["group_id"], "task_id": r["task_id"]} for r in b[32:40]] == other
    own = b[:32] + b[40:]
    steps = [r["group_id"].split("/")[0] for r in own[::4]]  # a group's id: <explore step>/<seed>/<task>
    assert steps == [s for s in "0123" for _ in range(4)], steps
    assert a == own
