"""The studio (python -m rft.studio): its pieces by value, and its pages in a real browser
(Debian's headless Chromium driven by Playwright), exercised as a person would.

Browser tests need /usr/bin/chromium (`make test` installs it where it can: apt, as root); without
it they skip, unless RFT_REQUIRE_BROWSER=1 (CI), where they fail. Screenshots of each page go to
tests/artifacts/studio/ (not tracked).
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rft.studio import compose as C
from rft.studio import rollouts as R
from rft.studio import runs as U

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
ARTIFACTS = ROOT / "tests" / "artifacts" / "studio"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


# ---------------------------------------------------------------- the pieces, no browser


def test_an_options_first_comment_leaves_out_the_package_and_usage_lines(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text("# @package _global_\n# python run.py algorithm=x\n# First line of what it is,\n# second line.\n"
                 "# python run.py algorithm=x seed=2\nkey: 1\n# later comment\n")
    assert C.first_comment(f) == "First line of what it is, second line."
    groups = C.groups(CONF)
    assert "hydra" not in groups and set(groups) >= {"algorithm", "model", "buffer", "trainer", "experiment"}
    dapo = next(o for o in groups["algorithm"] if o["name"] == "dapo")
    assert dapo["comment"].startswith("DAPO (arXiv 2503.14476)")
    assert groups["experiment"][0]["name"] == "null"


def test_the_schema_lists_every_leaf_key_with_type_default_and_comment():
    import rft.config

    fields = {f["key"]: f for f in C.schema()}
    from omegaconf import OmegaConf

    # every leaf of the typed schema, and nothing else; a dict-typed field is one value (edited as JSON)
    leaves = set(rft.config.flat(OmegaConf.to_container(OmegaConf.structured(rft.config.Config))))
    args = "buffer.trainer_input.experience_buffer.replay_buffer.priority_fn_args"
    assert set(fields) == leaves - {args + ".decay"} | {args}
    assert fields[args]["default"] == json.dumps({"decay": 2.0}) or fields[args]["default"].startswith("{")
    rank = fields["model.lora.rank"]
    assert (rank["type"], rank["default"], rank["comment"]) == ("int", "0", "the adapters' rank; 0: no LoRA")
    mode = fields["mode"]
    assert mode["choices"] == ["both", "explore", "train", "bench"] and mode["default"] == "both"
    assert fields["dry_run"]["choices"] == ["true", "false"]
    assert fields["model.attn_implementation"]["type"] == "Optional[str]"


@pytest.mark.slow
def test_compose_shows_the_plan_error_naming_the_key_then_the_plan():
    defaults = C.default_choices(CONF)
    bad = C.compose(CONF, {**defaults, "algorithm": "dapo"}, {"buffer.batch_size": "0"}, defaults)
    assert bad.command == "python run.py algorithm=dapo buffer.batch_size=0"
    assert "buffer.batch_size=0 must be >= 1" in bad.error and bad.plan == ""
    good = C.compose(CONF, {**defaults, "algorithm": "dapo"}, {"buffer.batch_size": "4"}, defaults)
    assert good.error == "" and "tasks per step" in good.plan and "stage grpo (dapo)" not in good.plan
    assert "(dapo)" in good.plan and good.values["buffer.batch_size"] == "4"
    assert good.choices["algorithm"] == "dapo"


@pytest.mark.slow
def test_the_default_plan_shows_no_rollouts_for_the_sft_stage_and_an_rl_batch_error_names_the_rl_stage():
    defaults = C.default_choices(CONF)
    plan = C.compose(CONF, defaults, {}, defaults).plan
    sft, grpo = plan.split("batch plan: stage grpo (grpo)")
    # the warm-up generates nothing: no "tasks per step 0" or "rollouts per task 0"
    assert sft.startswith("batch plan: stage sft_warmup (sft)") and "rollouts per task" not in sft and "tasks per step" not in sft
    assert re.search(r"tasks per step +16 ", grpo) and re.search(r"rollouts per task +8 ", grpo)
    for key in ("buffer.batch_size", "algorithm.repeat_times"):
        error = C.compose(CONF, defaults, {key: "0"}, defaults).error
        assert error.startswith(f"stage grpo: {key}=0 must be >= 1"), error


@pytest.mark.slow
@pytest.mark.parametrize("groups", [{}, {"model": "tiny_tools", "task": "calculator"}, {"experiment": "algorithms_countdown"}])
def test_every_value_the_page_shows_is_an_override_that_composes_to_itself(groups):
    """What an input shows is what it would send: all of them sent back compose the same config."""
    defaults = C.default_choices(CONF)
    first = C.compose(CONF, {**defaults, **groups}, {}, defaults, plan=False)
    assert first.error == ""
    again = C.compose(CONF, {**defaults, **groups}, dict(first.values), defaults, plan=False)
    assert again.error == "" and yaml.safe_load(again.yaml) == yaml.safe_load(first.yaml)
    assert again.values == first.values


def test_override_text_is_hydras_grammar_quoting_where_needed():
    text = C._override_text
    assert text({"decay": 2.0, "names": ["a b", "null", "1.5", "x'y"]}) == "{decay: 2.0, names: ['a b', 'null', '1.5', 'x\\'y']}"
    assert (text(None), text(True), text(1e-3), text("all-linear"), text("${a.b}-${c}")) == (
        "null", "true", "0.001", "all-linear", "${a.b}-${c}")


def test_compose_errors_are_one_paragraph_naming_the_key():
    defaults = C.default_choices(CONF)
    assert C.compose(CONF, defaults, {"mode": "both2"}, defaults).error == (
        "Error merging override mode=both2: Invalid value 'both2', expected one of [both, explore, train, bench]")
    misspelt = C.compose(CONF, defaults, {"buffer.batch_sze": "8"}, defaults).error
    assert misspelt.startswith("Could not override 'buffer.batch_sze'") and "buffer.batch_size" in misspelt
    assert "could not be converted to Integer" in C.compose(CONF, defaults, {"seed": "abc"}, defaults).error


@pytest.mark.slow
def test_a_saved_study_composes_what_the_page_composed(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    defaults = C.default_choices(conf)
    comp = C.compose(conf, {**defaults, "algorithm": "dapo", "buffer": "sql"},
                     {"buffer.batch_size": "4", "algorithm.optimizer.lr": "1e-3", "model.lora.target_modules": "[q_proj,v_proj]"},
                     defaults, plan=False)
    path = C.save_study(conf, "my_study", comp, defaults)
    text = path.read_text()
    assert text.splitlines()[:2] == ["# @package _global_", "# python run.py experiment=my_study"]
    study = C.compose(conf, {**defaults, "experiment": "my_study"}, {}, defaults, plan=False)
    page = yaml.safe_load(comp.yaml)
    saved = yaml.safe_load(study.yaml)
    assert saved.pop("name") == "my_study"
    page.pop("name")
    assert saved == page and saved["algorithm"]["optimizer"]["lr"] == 0.001
    with pytest.raises(FileExistsError, match="exists: choose another name"):
        C.save_study(conf, "my_study", comp, defaults)
    with pytest.raises(ValueError, match="study name '../x'"):
        C.save_study(conf, "../x", comp, defaults)
    # `++seed=3` was saved as a key '++seed', and the study then failed to compose
    comp = C.compose(conf, defaults, {"++seed": "3"}, defaults, plan=False)
    assert not comp.error
    C.save_study(conf, "forced", comp, defaults)
    study = C.compose(conf, {**defaults, "experiment": "forced"}, {}, defaults, plan=False)
    assert not study.error and yaml.safe_load(study.yaml)["seed"] == 3
    comp = C.compose(conf, defaults, {"~seed": ""}, defaults, plan=False)
    with pytest.raises(ValueError, match=r"^~seed=: a study file holds values, and a deletion has no form there"):
        C.save_study(conf, "deleted", comp, defaults)


def _fake_run(root: Path, rel: str, metrics: list[dict], overrides=(), stage="grpo"):
    run = root / rel
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(list(overrides)))
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"stages": [{"stage_name": stage, "buffer": {"total_steps": metrics[-1]["step"]}}]}))
    (run / stage).mkdir()
    (run / stage / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return run


def test_runs_lists_runs_and_sweeps_with_their_curves_and_table(tmp_path):
    _fake_run(tmp_path, "rft/a", [{"step": 1, "eval/accuracy": 0.1, "reward/mean": 0.2}, {"step": 2, "eval/accuracy": 0.5}])
    for n, (seed, acc) in enumerate([(1, 0.4), (2, 0.6)]):
        _fake_run(tmp_path, f"rft/multirun/2026-01-01_00-00-00/{n}", [{"step": 1, "eval/accuracy": acc}], [f"seed={seed}"])
    (tmp_path / "rft" / "stage_cache" / "x" / ".hydra").mkdir(parents=True)  # never listed
    runs = U.Runs(tmp_path)
    listing = runs.listing()
    ids = sorted(r["id"] for r in listing["runs"])
    assert ids == ["rft/a", "rft/multirun/2026-01-01_00-00-00/0", "rft/multirun/2026-01-01_00-00-00/1"]
    a = next(r for r in listing["runs"] if r["id"] == "rft/a")
    assert (a["stage"], a["steps"], a["last_eval"], a["status"], a["detail"]) == ("grpo", 2, 0.5, "done", "done")
    # the override that differs between the runs is a column; a's has none
    assert listing["columns"] == ["seed"] and a["params"] == {} and a["config"] == "(defaults)"
    assert listing["sweeps"] == [{"id": "rft/multirun/2026-01-01_00-00-00", "jobs": 2, "planned": None}]  # no multirun.yaml
    traces = runs.curves(["rft/a", "rft/multirun/2026-01-01_00-00-00/1"], "eval/accuracy")
    assert [(t["x"], t["y"]) for t in traces] == [([1, 2], [0.1, 0.5]), ([1], [0.6])]
    # legend and hover names: what is left of each run's name after the directories they share
    assert [t["name"] for t in traces] == ["a (grpo)", "multirun/2026-01-01_00-00-00/1 (grpo)"]
    assert runs.metric_names(["rft/a"])[:2] == ["eval/accuracy", "reward/mean"]
    table = runs.sweep_table("rft/multirun/2026-01-01_00-00-00")
    assert [r["job"] for r in table["jobs"]] == ["0", "1"]
    # one configuration over two seeds: mean 0.5, sample std sqrt(((0.4-0.5)^2 + (0.6-0.5)^2) / 1) = 0.1414
    assert len(table["configs"]) == 1 and table["configs"][0]["final eval/accuracy"] == "0.5 ± 0.14"
    for bad in ("../../etc", "rft/../../x"):
        with pytest.raises(ValueError, match="not under the checkpoint root"):
            runs.curves([bad], "eval/accuracy")
        with pytest.raises(ValueError, match="not under the checkpoint root"):
            runs.diff("rft/a", bad)
    # a run of two stages: its last by default, one named, or each
    _two_stage_run(tmp_path, "rft/two")
    assert runs.stages(["rft/two", "rft/a"]) == ["sft_warmup", "grpo"]
    assert [(t["stage"], t["y"]) for t in runs.curves(["rft/two"], "eval/accuracy")] == [("grpo", [0.15, 0.9])]
    assert [(t["stage"], t["y"]) for t in runs.curves(["rft/two"], "eval/accuracy", "sft_warmup")] == [("sft_warmup", [0.0, 0.15])]
    every = runs.curves(["rft/two", "rft/a"], "eval/accuracy", "all")
    assert [t["name"] for t in every] == ["two (sft_warmup)", "two (grpo)", "a (grpo)"]
    # every stage after the one before: two's GRPO steps 0, 2 come after its warm-up's last step (2)
    assert [(t["x"], t["step"], t["offset"]) for t in every] == [([0, 2], [0, 2], 0), ([2, 4], [0, 2], 2), ([1, 2], [1, 2], 0)]
    assert runs.curves(["rft/a"], "eval/accuracy", "sft_warmup") == []  # a has no such stage


def test_the_index_reads_a_growing_log_from_where_it_stopped_and_a_replaced_one_whole(tmp_path, monkeypatch):
    from rft.studio import index as X

    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1, "a": 1.0, "b": 2}\n{"step": 2, "a": 0.5}\n{"step": 3, "a"')  # a line being written
    files = X.CachedFiles(("step", "a"))
    assert files.jsonl(log) == [{"step": 1, "a": 1.0}, {"step": 2, "a": 0.5}]  # b is not kept
    reads = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: reads.append(p) or real_open(p, *a, **k))
    assert files.jsonl(log) == [{"step": 1, "a": 1.0}, {"step": 2, "a": 0.5}] and reads == []  # unchanged: not opened
    with real_open(log, "a") as f:
        f.write(': 0.25}\n{"step": 4, "a": 0.125}\n')
    assert [m["a"] for m in files.jsonl(log)] == [1.0, 0.5, 0.25, 0.125] and len(reads) == 1
    # a resumed run rewrites its log (a new file renamed over it): read whole again
    (tmp_path / "new").write_text('{"step": 1, "a": 9.0}\n')
    (tmp_path / "new").replace(log)
    assert files.jsonl(log) == [{"step": 1, "a": 9.0}]


def test_a_run_is_running_while_the_process_named_in_its_lock_lives(tmp_path):
    import socket

    from rft.studio import index as X

    lock = tmp_path / ".run.lock"
    assert X.holder_alive(tmp_path) is None  # no lock taken
    lock.write_text(f"pid {os.getpid()} on {socket.gethostname()}\n")  # this process, which started before
    assert X.holder_alive(tmp_path) is True
    started = X._started(os.getpid())
    os.utime(lock, (started - 3600, started - 3600))  # written an hour before this process started: a pid used again
    assert X.holder_alive(tmp_path) is False
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(f"pid {dead.pid} on {socket.gethostname()}\n")
    assert X.holder_alive(tmp_path) is False
    lock.write_text(f"pid {os.getpid()} on another-host\n")
    assert X.holder_alive(tmp_path) is None  # another machine's run: told by its metrics


def _two_stage_run(root: Path, rel: str) -> Path:
    run = root / rel
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("[]\n")
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"stages": [
        {"stage_name": "sft_warmup", "buffer": {"total_steps": 2}}, {"stage_name": "grpo", "buffer": {"total_steps": 2}}]}))
    for stage, accs in (("sft_warmup", [0.0, 0.15]), ("grpo", [0.15, 0.9])):
        (run / stage).mkdir()
        (run / stage / "metrics.jsonl").write_text("".join(json.dumps({"step": 2 * k, "eval/accuracy": a}) + "\n"
                                                          for k, a in enumerate(accs)))
    return run


def _sql_buffer(run: Path):
    """A sql buffer of 4 experiences with rewards 0, 0.5, 1, 1 (versions 1, 1, 2, 2) and one multi-turn."""
    from omegaconf import OmegaConf

    from rft.config import ExperienceBufferConfig
    from rft.data.buffer import SQLBuffer
    from rft.data.experience import Experience

    (run / "grpo").mkdir(parents=True, exist_ok=True)
    buf = SQLBuffer(OmegaConf.structured(ExperienceBufferConfig(storage_type="sql", path=str(run / "grpo" / "buffer.db"))))
    exps = [Experience(tokens=[1, 2, 3, 4], prompt_length=2, logprobs=[-0.1, -0.2], reward=r, task_id=f"t{i}", policy_version=v,
                       info={"prompt": f"p{i}", "response": f"r{i}"}) for i, (r, v) in enumerate([(0, 1), (0.5, 1), (1, 2), (1, 2)])]
    exps.append(Experience(tokens=[1, 2, 3, 4, 5, 6], prompt_length=2, logprobs=[-0.1] * 4, reward=1.0, task_id="mt", policy_version=2,
                           loss_mask=[1, 0, 0, 1], reward_parts={"correct": 1.0},
                           info={"conversation": [{"role": "user", "content": "37*48"}, {"role": "assistant", "content": "<tool_call>x</tool_call>"},
                                                  {"role": "tool", "content": "1776"}, {"role": "assistant", "content": "1776"}]}))
    buf.put(exps)
    return run


def test_rollouts_reads_a_buffer_with_filters_and_masked_turns(tmp_path):
    run = _sql_buffer(tmp_path / "rft" / "r")
    assert R.sources(run) == [{"path": "grpo/buffer.db", "kind": "experiences", "count": 5}]
    everything = R.read(run, "grpo/buffer.db")
    assert (everything["total"], everything["matched"]) == (5, 5)
    assert [r["reward"] for r in R.read(run, "grpo/buffer.db", min_reward=0.5)["rows"]] == [0.5, 1.0, 1.0, 1.0]
    assert [r["task_id"] for r in R.read(run, "grpo/buffer.db", max_reward=0.5, step=1)["rows"]] == ["t0", "t1"]
    mt = R.read(run, "grpo/buffer.db", step=2)["rows"][-1]
    assert [(t["role"], t["trained"]) for t in mt["turns"]] == [("user", False), ("assistant", True), ("tool", False), ("assistant", True)]
    assert mt["trained_tokens"] == 2 and mt["parts"] == {"correct": 1.0}


def test_with_the_stages_tokenizer_a_response_shows_its_loss_mask_token_exact(tmp_path, cache_dir):
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from rft.config import ExperienceBufferConfig
    from rft.data.buffer import SQLBuffer
    from rft.data.experience import Experience
    from rft.models import build_tiny_model

    tok = AutoTokenizer.from_pretrained(build_tiny_model(cache_dir / "models" / "tiny-qwen2-v2"))
    run = tmp_path / "rft" / "r"
    tok.save_pretrained(run / "grpo" / "checkpoints" / "step_2" / "hf")
    ids = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    response = ids("12") + ids("+3=") + ids("15")
    # the model wrote "12" and "15"; "+3=" came from a tool: loss mask 0 (character tokens: 3 of them)
    mask = [1] * len(ids("12")) + [0] * len(ids("+3=")) + [1] * len(ids("15"))
    buf = SQLBuffer(OmegaConf.structured(ExperienceBufferConfig(storage_type="sql", path=str(run / "grpo" / "buffer.db"))))
    buf.put([Experience(tokens=ids("q?") + response, prompt_length=len(ids("q?")), logprobs=[0.0] * len(response),
                        reward=1.0, loss_mask=mask),
             Experience(tokens=ids("q?") + ids("7"), prompt_length=len(ids("q?")), logprobs=[0.0], reward=0.0)])
    rows = R.read(run, "grpo/buffer.db")["rows"]
    assert rows[0]["segments"] == [{"text": "12", "trained": True}, {"text": "+3=", "trained": False},
                                   {"text": "15", "trained": True}]
    assert rows[1]["segments"] == [{"text": "7", "trained": True}]  # no mask: every response token trained


@pytest.mark.slow
def test_a_damaged_buffer_is_listed_with_why_and_reading_it_says_so(tmp_path):
    import httpx

    run = tmp_path / "rft" / "r"
    (run / "grpo").mkdir(parents=True)
    (run / "grpo" / "buffer.db").write_bytes(b"not a database at all" * 100)
    (listed,) = R.sources(run)
    assert (listed["path"], listed["count"]) == ("grpo/buffer.db", None) and "is not a database" in listed["error"]
    proc, url, token = _studio(tmp_path)
    try:
        r = httpx.get(f"{url}/api/rollouts", params={"run": "rft/r", "source": "grpo/buffer.db"},
                      headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 400 and "is not a database of stored experiences" in r.json()["detail"]
    finally:
        _stop(proc)


def test_rollouts_say_when_the_filters_saw_only_the_first_rows(tmp_path, monkeypatch):
    run = _sql_buffer(tmp_path / "rft" / "r")
    monkeypatch.setattr(R, "MAX_ROWS", 3)
    got = R.read(run, "grpo/buffer.db", min_reward=0.5)
    # the first 3 stored (rewards 0, 0.5, 1) were read, of 5; 2 of them pass
    assert (got["matched"], got["read"], got["total"]) == (2, 3, 5)


def test_saved_eval_trajectories_are_a_source_turn_by_turn(tmp_path):
    run = tmp_path / "rft" / "r"
    d = run / "grpo" / "eval_trajectories" / "step_4"
    d.mkdir(parents=True)
    rows = [{"task_id": "0", "reward": 1.0, "reward_parts": {"correct": 1.0}, "turns": 2, "tool_calls": 1,
             "messages": [{"role": "user", "content": "37*48"}, {"role": "assistant", "content": "<tool_call>{}</tool_call>"},
                          {"role": "tool", "content": "1776"}, {"role": "assistant", "content": "1776"}]},
            {"task_id": "1", "reward": 0.0, "reward_parts": {"correct": 0.0}, "messages": [{"role": "user", "content": "12*10"},
                                                                                          {"role": "assistant", "content": "100"}]}]
    (d / "calculator_test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert R.sources(run) == [{"path": "grpo/eval_trajectories/step_4/calculator_test.jsonl", "kind": "eval", "count": 2}]
    got = R.read(run, "grpo/eval_trajectories/step_4/calculator_test.jsonl", min_reward=0.5)
    assert (got["matched"], got["total"]) == (1, 2)
    row = got["rows"][0]
    assert (row["step"], row["prompt"], row["response"]) == (4, "37*48", "<tool_call>{}</tool_call>\n1776")
    assert [t["trained"] for t in row["turns"]] == [False, True, False, True]
    assert R.read(run, "grpo/eval_trajectories/step_4/calculator_test.jsonl", step=3)["matched"] == 0


def test_a_launch_command_is_run_py_with_the_overrides_and_for_a_sweep_its_values_and_launcher():
    from rft.studio.bodies import sweep_args
    from rft.studio.launch import command

    assert command(["algorithm=dapo", "buffer.batch_size=4"]) == ["algorithm=dapo", "buffer.batch_size=4"]
    # a single run ignores the sweep fields
    assert command(["seed=3"], False, ["seed=1,2"], "slurm") == ["seed=3"]
    swept = sweep_args({"sweep_params": "seed=1,2,3 'algorithm.optimizer.lr=1e-3,3e-3'"})
    assert swept == ["seed=1,2,3", "algorithm.optimizer.lr=1e-3,3e-3"]
    assert command(["algorithm=dapo"], True, swept, "slurm") == [
        "-m", "algorithm=dapo", "seed=1,2,3", "algorithm.optimizer.lr=1e-3,3e-3", "hydra/launcher=slurm"]
    assert command([], True, ["seed=1,2"], "basic") == ["-m", "seed=1,2"]


# ---------------------------------------------------------------- in a browser


def _studio(root: Path, conf: Path = CONF, extra_env=None, args=()):
    proc = subprocess.Popen([sys.executable, "-m", "rft.studio", "--port", "0", "--root", str(root), "--conf", str(conf), *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(extra_env or {})})
    lines = []
    deadline = time.time() + 60
    while time.time() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        m = re.search(r"open (http://127\.0\.0\.1:(\d+))/compose#token=(\S+)", line)
        if m:
            proc.said, proc.link = "".join(lines), m.group(0)[len("open "):]
            return proc, m.group(1), m.group(3)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError("the studio did not start:\n" + "".join(lines))


@pytest.fixture
def browser(request):
    """Headless Chromium. The studio's Content-Security-Policy runs only its own script files, while
    Playwright's wait_for_function evaluates its condition as a string (eval): pages that wait so
    are opened with bypass_csp=True; tests/test_studio_guard.py shows the pages work under the CSP.
    One Chromium serves a test module (starting one takes a second or more); each page
    (browser.new_page, browser.new_context) is a context of its own, with its own storage, so no
    test sees another's token or pages, and a test's contexts are closed after it."""
    module = request.node.getparent(pytest.Module)
    b = getattr(module, "rft_chromium", None) or _start_chromium(module)
    yield b
    for context in b.contexts:
        context.close()


def _start_chromium(module) -> object:
    """A Chromium kept on the module's node, closed when its last test is done."""
    if not Path(CHROMIUM).exists():
        if os.environ.get("RFT_REQUIRE_BROWSER"):
            pytest.fail(f"{CHROMIUM} is missing (RFT_REQUIRE_BROWSER=1): apt-get install chromium")
        pytest.skip("no Chromium here: apt-get install chromium (make test does, as root)")
    from playwright.sync_api import sync_playwright

    p = sync_playwright().start()
    try:
        b = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
    except BaseException:
        p.stop()
        raise

    def close():
        del module.rft_chromium
        b.close()
        p.stop()

    module.rft_chromium = b
    module.addfinalizer(close)
    return b


def _shot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.evaluate("() => { window.scrollTo(0, 0); document.querySelectorAll('.col').forEach(c => c.scrollTop = 0); }")
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=False)


def _stop(proc):
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.mark.slow
def test_the_studio_refuses_requests_without_its_token_and_binds_loopback(tmp_path):
    import httpx

    proc, url, token = _studio(tmp_path)
    try:
        assert url.startswith("http://127.0.0.1:")
        port = int(url.rsplit(":", 1)[1])
        for path in ("/api/runs", "/api/page/compose", "/api/launches"):
            r = httpx.get(url + path)
            assert r.status_code == 401 and r.text.startswith("refused: the rft studio needs its token"), path
        assert httpx.get(url + "/api/runs", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(url + "/api/runs", headers={"Authorization": f"Bearer {token}"}).json() == {"runs": [], "columns": [], "sweeps": []}
        # a page is a shell without data or token (its script fetches the rest with the token); no cookie is set
        page = httpx.get(f"{url}/compose")
        assert page.status_code == 200 and token not in page.text and "data-group" not in page.text
        assert not page.cookies and "set-cookie" not in page.headers
        # loopback only: the port does not answer on this machine's other addresses
        import socket

        others = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)} - {"127.0.0.1", "127.0.1.1"}
        for addr in others:
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"http://{addr}:{port}/compose", timeout=5)
        out = subprocess.run(["ss", "-ltn"], capture_output=True, text=True).stdout if shutil.which("ss") else ""
        listening = [line for line in out.splitlines() if f":{port} " in line]
        assert all("127.0.0.1:" in line for line in listening), listening
    finally:
        _stop(proc)


@pytest.mark.slow
def test_compose_page_shows_the_plan_error_then_the_plan_and_its_command_composes_the_same(browser, tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)  # "save as study" writes here, not into the repo
    proc, url, token = _studio(tmp_path, conf)
    try:
        page = browser.new_page(bypass_csp=True, viewport={"width": 1400, "height": 1000})
        page.goto(f"{url}/compose#token={token}")
        page.wait_for_function("document.body.dataset.composed")
        page.select_option("#group-algorithm", "dapo")
        _set_key(page, "buffer.batch_size", "0")  # the sections start closed: the filter opens its own
        page.wait_for_function("!document.querySelector('#error').hidden")
        error = page.text_content("#error")
        assert "buffer.batch_size=0 must be >= 1" in error
        _shot(page, "compose-error")
        page.fill('[data-key="buffer.batch_size"]', "4")
        page.wait_for_function("document.querySelector('#error').hidden && document.querySelector('#plan').textContent.includes('tasks per step')")
        command = page.text_content("#command")
        assert command == "python run.py algorithm=dapo buffer.batch_size=4"
        shown_yaml = yaml.safe_load(page.text_content("#yaml"))
        _shot(page, "compose")
        # the shown command, run in a shell, composes the same config
        r = subprocess.run(command + " --cfg job", shell=True, cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}, timeout=120)
        assert r.returncode == 0, r.stderr
        assert yaml.safe_load(r.stdout) == shown_yaml
        assert shown_yaml["algorithm"]["algorithm_type"] == "dapo" and shown_yaml["buffer"]["batch_size"] == 4
        # save as study: the file opens with its command line, and composes the same (but its name)
        page.fill("#study-name", "from_the_page")
        page.click("#save-study")
        page.wait_for_function("document.querySelector('#study-result').textContent.startsWith('saved')")
        study = conf / "experiment" / "from_the_page.yaml"
        assert study.read_text().splitlines()[1] == "# python run.py experiment=from_the_page"
        page.click("#save-study")  # again: refused, the file is kept
        page.wait_for_function("document.querySelector('#study-result').textContent.includes('exists')")
        defaults = C.default_choices(conf)
        saved = yaml.safe_load(C.compose(conf, {**defaults, "experiment": "from_the_page"}, {}, defaults, plan=False).yaml)
        assert saved.pop("name") == "from_the_page" and shown_yaml.pop("name")
        assert saved == shown_yaml
    finally:
        _stop(proc)


@pytest.mark.slow
def test_rollouts_page_lists_experiences_and_filters_by_reward(browser, tmp_path):
    run = _fake_run(tmp_path, "rft/r", [{"step": 1, "eval/accuracy": 0.1}])
    _sql_buffer(run)
    proc, url, token = _studio(tmp_path)
    try:
        page = browser.new_page(bypass_csp=True, viewport={"width": 1400, "height": 900})
        page.goto(f"{url}/rollouts?run=rft/r#token={token}")
        page.wait_for_selector("#rollouts tbody tr")
        assert len(page.query_selector_all("#rollouts tbody tr")) == 5
        assert page.text_content("#rollout-count") == "5 of 5 match"
        page.fill("#min-reward", "0.75")
        page.click("#filter")
        page.wait_for_function("document.querySelector('#rollout-count').textContent.startsWith('3 of 5')")
        rewards = [float(tr.get_attribute("data-reward")) for tr in page.query_selector_all("#rollouts tbody tr")]
        assert rewards == [1.0, 1.0, 1.0]
        turns = page.query_selector_all("#rollouts tbody tr:last-child .turn")
        assert [t.get_attribute("class") for t in turns] == ["turn masked", "turn trained", "turn masked", "turn trained"]
        _shot(page, "rollouts")
    finally:
        _stop(proc)


def _set_key(page, key: str, value: str) -> None:
    """As a person would: find the key with the filter (which opens its section), type the value."""
    page.fill("#key-filter", key)
    page.fill(f'[data-key="{key}"]', value)


def _grpo_from_warm_start(browser, url: str, token: str, warm_start, name: str, steps: int):
    """The compose page set, as a person would, to GRPO from the warm start in one process."""
    page = browser.new_page(bypass_csp=True, viewport={"width": 1400, "height": 1000})
    page.goto(f"{url}/compose#token={token}")
    page.wait_for_function("document.body.dataset.composed")
    for key, value in [("stages", "[]"), ("model.model_path", str(warm_start)), ("model.builder", "null"),
                       ("buffer.total_steps", str(steps)), ("explorer.eval_interval", "2"), ("name", name)]:
        _set_key(page, key, value)
    page.select_option("#group-cluster", "inline")
    page.select_option("#group-monitor", "console")
    return page


def _chart(page) -> list[dict]:
    """The chart's own data: plotly keeps its traces on the div."""
    return page.evaluate("() => (document.getElementById('chart').data || []).map(t => ({name: t.name, x: Array.from(t.x), y: Array.from(t.y)}))")


@pytest.mark.slow
def test_runs_page_overlays_two_runs_and_shows_a_sweep_table(browser, tmp_path):
    _fake_run(tmp_path, "rft/a", [{"step": 1, "eval/accuracy": 0.1}, {"step": 2, "eval/accuracy": 0.5}])
    _fake_run(tmp_path, "rft/b", [{"step": 1, "eval/accuracy": 0.2}, {"step": 2, "eval/accuracy": 0.3}])
    _two_stage_run(tmp_path, "rft/two")
    for n, seed in enumerate([1, 2, 3]):
        _fake_run(tmp_path, f"rft/multirun/2026-01-01_00-00-00/{n}", [{"step": 1, "eval/accuracy": 0.1 * seed}], [f"seed={seed}"])
    proc, url, token = _studio(tmp_path)
    try:
        page = browser.new_page(bypass_csp=True, viewport={"width": 1400, "height": 1000})
        page.goto(f"{url}/runs#token={token}")
        page.wait_for_selector('[data-pick="rft/a"]')
        page.check('[data-pick="rft/a"]')
        page.check('[data-pick="rft/b"]')
        page.wait_for_function("(document.getElementById('chart')?.data || []).length == 2")
        traces = sorted(_chart(page), key=lambda t: t["name"])
        assert traces == [{"name": "a (grpo)", "x": [1, 2], "y": [0.1, 0.5]}, {"name": "b (grpo)", "x": [1, 2], "y": [0.2, 0.3]}]
        # a run of two stages: every stage of it, each a trace of its own
        page.uncheck('[data-pick="rft/b"]')
        page.check('[data-pick="rft/two"]')
        page.select_option("#stage", "all")
        page.wait_for_function("(document.getElementById('chart')?.data || []).length == 3")
        assert sorted(t["name"] for t in _chart(page)) == ["a (grpo)", "two (grpo)", "two (sft_warmup)"]
        page.select_option("#sweep-choice", "rft/multirun/2026-01-01_00-00-00")
        page.wait_for_selector("#table-jobs tbody tr")
        assert len(page.query_selector_all("#table-jobs tbody tr")) == 3
        assert len(page.query_selector_all("#table-configs tbody tr")) == 1
        _shot(page, "runs")
    finally:
        _stop(proc)


@pytest.mark.slow
def test_a_run_launched_from_the_page_trains_its_curve_grows_and_stop_works(browser, tmp_path, warm_start):
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    proc, url, token = _studio(tmp_path)
    try:
        # GRPO from the default's warm-up, in one process: 50 steps, an eval every 2 (~5 s of
        # training at ~0.06 s a step and ~0.1 s an eval: the page, refreshing every 2 s, sees it grow
        # at two refreshes at least). The warm start's accuracy, ~0.2, is ~0.9 by step 2 already
        page = _grpo_from_warm_start(browser, url, token, warm_start, "from_the_page", 50)
        page.wait_for_function("document.querySelector('#error').hidden && document.querySelector('#plan').textContent.includes('grpo')",
                               timeout=60000)
        page.click("#launch")
        page.wait_for_function("document.querySelector('#launch-status').dataset.status == 'running'")
        # the runs page: the run appears, its eval curve grows while it trains
        runs = browser.new_page(bypass_csp=True, viewport={"width": 1400, "height": 1000})
        runs.goto(f"{url}/runs#token={token}")
        runs.wait_for_selector('[data-pick="rft/from_the_page"]', timeout=120000)
        runs.check('[data-pick="rft/from_the_page"]')
        seen = []
        deadline = time.time() + 400
        while time.time() < deadline:
            data = _chart(runs)
            if data and data[0]["x"] and (not seen or len(data[0]["x"]) > len(seen[-1]["x"])):
                seen.append(data[0])
            if page.get_attribute("#launch-status", "data-status") != "running":
                break
            time.sleep(0.5)
        page.wait_for_function("document.querySelector('#launch-status').dataset.status == 'finished'", timeout=60000)
        try:  # the refresh after the run's last eval, with every point of it
            runs.wait_for_function("((document.getElementById('chart')?.data || [])[0]?.x || []).length >= 26", timeout=15000)
        except PlaywrightTimeout:
            pass  # the asserts below say what was drawn
        final = _chart(runs)[0]
        _shot(runs, "runs-launched")
        _shot(page, "launch")
        assert "rft: " not in page.text_content("#console")  # no configuration or run error
        # seen while it trained: the curve had fewer points than at the end, and grew
        assert len(seen) >= 2 and len(seen[0]["x"]) < len(final["x"]), seen
        assert final["x"] == list(range(0, 51, 2)) and final["y"][-1] >= final["y"][0] + 0.2, final
        # stop: a second launch, stopped while it runs
        _set_key(page, "name", "stopped_from_the_page")
        _set_key(page, "buffer.total_steps", "1000")
        page.wait_for_function("document.querySelector('#command').textContent.includes('stopped_from_the_page')")
        page.click("#launch")
        page.wait_for_function("document.querySelector('#console').textContent.length > 0 && "
                               "document.querySelector('#launch-status').dataset.status == 'running'", timeout=60000)
        page.click("#stop")
        page.wait_for_function("document.querySelector('#launch-status').dataset.status == 'stopped'", timeout=60000)
    finally:
        _stop(proc)


def test_a_port_in_use_is_one_line_naming_it():
    from rft.serving.auth import listening_socket

    sock, host, port = listening_socket("127.0.0.1", 0, "rft.studio")
    try:
        with pytest.raises(SystemExit, match=rf"^rft.studio: cannot listen on 127.0.0.1:{port}: .*Choose another --port"):
            listening_socket("127.0.0.1", port, "rft.studio")
    finally:
        sock.close()


@pytest.mark.slow
def test_a_sweep_launched_from_the_page_runs_each_job_and_its_table_has_a_row_each(browser, tmp_path, warm_start):
    proc, url, token = _studio(tmp_path)
    try:
        page = _grpo_from_warm_start(browser, url, token, warm_start, "swept", 2)
        page.wait_for_function("document.querySelector('#error').hidden && document.querySelector('#command').textContent.includes('swept')",
                               timeout=60000)
        page.check("#sweep")
        page.fill("#sweep-params", "seed=1,2")
        page.select_option("#launcher", "basic")
        page.click("#launch")
        page.wait_for_function("document.querySelector('#launch-status').textContent.includes('python run.py -m ')")
        page.wait_for_function("document.querySelector('#launch-status').dataset.status == 'finished'", timeout=400000)
        assert "seed=1,2" in page.text_content("#launch-status")
        runs = browser.new_page(bypass_csp=True, viewport={"width": 1400, "height": 1000})
        runs.goto(f"{url}/runs#token={token}")
        runs.wait_for_function("document.querySelectorAll('#sweep-choice option').length == 2")
        sweep = runs.eval_on_selector("#sweep-choice", "s => s.options[1].value")
        assert re.fullmatch(r"rft/multirun/[0-9_-]+", sweep), sweep
        runs.select_option("#sweep-choice", sweep)
        runs.wait_for_selector("#table-jobs tbody tr")
        rows = [[td.text_content() for td in tr.query_selector_all("td")] for tr in runs.query_selector_all("#table-jobs tbody tr")]
        header = [th.text_content() for th in runs.query_selector_all("#table-jobs thead th")]
        assert len(rows) == 2 and header[:2] == ["job", "seed"], (header, rows)
        assert [r[1] for r in rows] == ["1", "2"] and all(r[header.index("status")] == "done" for r in rows)
        _shot(runs, "runs-sweep")
    finally:
        _stop(proc)


@pytest.mark.slow
def test_runs_started_from_the_studio_stop_with_it_and_the_plan_reads_datasets_offline(tmp_path):
    import httpx

    proc, url, token = _studio(tmp_path, extra_env={"RFT_STUDIO_TOKEN": "a-fixed-token-of-24-chars"})
    try:
        assert token == "a-fixed-token-of-24-chars"
        auth = {"Authorization": f"Bearer {token}"}
        # a hub dataset is an error at once, not a minute of retries
        r = httpx.post(url + "/api/compose", json={"choices": {"task": "gsm8k"}, "keys": {}}, headers=auth, timeout=120)
        assert ("eval_tasksets[0].path='openai/gsm8k': there is no such local file or directory" in r.json()["error"]
                and "it is not in this machine's Hugging Face cache, and HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set"
                in r.json()["error"])
        # a run that errors in planning is not started: the page says why
        r = httpx.post(url + "/api/launch", json={"choices": {"algorithm": "dapo"}, "keys": {"buffer.batch_size": "0"}},
                       headers=auth, timeout=120)
        # the RL stage's error: the SFT warm-up (its own train_batch_size) does not read buffer.batch_size
        assert r.status_code == 400 and r.json()["detail"].startswith("not launched: stage dapo: buffer.batch_size=0")
        long_run = {"choices": {"cluster": "inline", "monitor": "console"}, "keys": {"stages": "[]", "buffer.total_steps": "100000"}}
        launched = httpx.post(url + "/api/launch", json=long_run, headers=auth, timeout=120).json()
        assert launched["status"] == "running" and launched["command"].startswith("python run.py cluster=inline")
        child = launched["pid"]
        metrics = tmp_path / "rft" / "grpo-tiny-arithmetic" / "metrics.jsonl"
        deadline = time.time() + 120
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.time() < deadline:
            time.sleep(0.2)
        state = httpx.get(f"{url}/api/launch/{launched['id']}", headers=auth).json()
        assert state["status"] == "running" and _alive(child), state["text"][-2000:]  # it trains
    finally:
        _stop(proc)
    deadline = time.time() + 30
    while _alive(child) and time.time() < deadline:
        time.sleep(0.2)
    if _alive(child):
        os.kill(child, 9)
        raise AssertionError("the run the studio started outlived the studio")


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.slow
def test_a_studio_bound_beyond_loopback_warns(tmp_path):
    proc, url, token = _studio(tmp_path, args=("--host", "0.0.0.0"))
    try:
        assert "WARNING: listening on 0.0.0.0, not loopback" in proc.said
    finally:
        _stop(proc)


def test_the_command_lines_defaults_are_the_readmes():
    """README "The studio": `python -m rft.studio [--port 8765] [--root ./checkpoints] [--host
    127.0.0.1]`, `--request-timeout` 10 s, `--max-connections` 256, the token never an argument."""
    from rft.studio.__main__ import _parser

    args = _parser().parse_args([])
    assert (args.host, args.port, args.request_timeout, args.max_connections, args.token_file) == (
        "127.0.0.1", 8765, 10.0, 256, None)
    assert args.root == os.environ.get("RFT_CHECKPOINT_ROOT_DIR", "./checkpoints")


def _jobs_record(log_dir: Path) -> None:
    """A launch a studio recorded before, ended with exit 0 (its process long gone)."""
    log_dir.mkdir(mode=0o700)
    (log_dir / "launch_1_ab12.log").write_text("done\n")
    record = {"id": 1, "argv": [sys.executable, "run.py", "seed=1"], "log": "launch_1_ab12.log", "pid": 2**22 + 1,
              "started": 1.0, "stopped": False, "returncode": 0, "ended": 2.0, "run": "rft/grpo", "sweep": None}
    (log_dir / "jobs.json").write_text(json.dumps([record]))
    (log_dir / "jobs.json").chmod(0o600)


def test_the_launches_are_kept_in_jobs_json_and_read_only_from_this_users_own_file(tmp_path, capsys):
    """README "jobs": the launches are kept in `<root>/.studio/jobs.json` (this user's only: a file
    others could write is not read), so a restarted studio lists them."""
    from rft.studio.launch import Launches

    log_dir = tmp_path / ".studio"
    _jobs_record(log_dir)
    restored = Launches(tmp_path, log_dir).all[1].state()
    assert {k: restored[k] for k in ("command", "status", "returncode", "run")} == {
        "command": "python run.py seed=1", "status": "finished", "returncode": 0, "run": "rft/grpo"}
    # writable by the group: another user could have named any process for "stop" to signal
    (log_dir / "jobs.json").chmod(0o620)
    assert Launches(tmp_path, log_dir).all == {}
    assert capsys.readouterr().err == (f"rft.studio: WARNING: {log_dir / 'jobs.json'} (or its folder) is not this "
                                       f"user's alone: its launches are not listed.\n")
    # the same for a folder others may write (they could replace the file)
    (log_dir / "jobs.json").chmod(0o600)
    log_dir.chmod(0o777)
    assert Launches(tmp_path, log_dir).all == {}
    log_dir.chmod(0o700)
    assert list(Launches(tmp_path, log_dir).all) == [1]
