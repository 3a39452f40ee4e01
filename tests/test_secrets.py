"""Secrets at rest and on show: a token or API key in a run's config is masked (`***`) where rft
saves or shows it (trackers, the report, the studio), the studio takes none on its form (its
launches put the form's values on a command line, which `ps` shows every local user), a masked
token composed again is taken from the environment, and the studio's run list follows no link
that leaves its root (rft/reporting/redact.py, rft/studio/runs.py)."""

import json
import os
import sys

import pytest
import yaml

from conftest import compose_cfg

from rft.reporting import redact as R

TOKEN = "SEKRETtok123456789abc"
REMOTE = f'buffer.explorer_input.taskset.reward_fn=[{{fn: remote, args: {{url: "http://127.0.0.1:9", token: {TOKEN}}}}}]'


def test_secret_values_are_masked_and_names_of_variables_are_kept():
    tree = {"reward_fn": [{"fn": "remote", "args": {"url": "http://127.0.0.1:9", "token": TOKEN}},
                          {"fn": "judge", "args": {"api_key": "OPENAI_API_KEY", "base_url": "https://u:pw@h/v1"}},
                          {"fn": "judge", "args": {"api_key": "sk-abc", "Password": "p", "token": None}}],
            "model": {"max_tokens": 5, "stop_token_ids": [1], "prompt_key": "question"},
            "template": "Rate it. token: {response}",
            "hydra": {"overrides": {"task": [f"x.args.token={TOKEN}"]}, "job": {"override_dirname": f"a.token={TOKEN},b=1"}}}
    assert R.redact(tree) == {
        "reward_fn": [{"fn": "remote", "args": {"url": "http://127.0.0.1:9", "token": "***"}},
                      # a variable's name is not the key; a URL's password is
                      {"fn": "judge", "args": {"api_key": "OPENAI_API_KEY", "base_url": "https://u:***@h/v1"}},
                      {"fn": "judge", "args": {"api_key": "***", "Password": "***", "token": None}}],
        "model": {"max_tokens": 5, "stop_token_ids": [1], "prompt_key": "question"},  # keys merely like them: kept
        "template": "Rate it. token: {response}",  # text, not an override: as written
        "hydra": {"overrides": {"task": ["x.args.token=***"]}, "job": {"override_dirname": "a.token=***,b=1"}}}
    assert tree["reward_fn"][0]["args"]["token"] == TOKEN  # a copy: the config itself is unchanged
    assert R.redact(R.redact(tree)) == R.redact(tree)


@pytest.mark.parametrize("override, shown", [
    (REMOTE, 'buffer.explorer_input.taskset.reward_fn=[{fn: remote, args: {url: "http://127.0.0.1:9", token: ***}}]'),
    (f"+buffer.explorer_input.taskset.reward_fn.0.args.token={TOKEN}", "+buffer.explorer_input.taskset.reward_fn.0.args.token=***"),
    ("x.reward_fn=[{fn: judge, args: {api_key: 'sk-1', model: m}}]", "x.reward_fn=[{fn: judge, args: {api_key: '***', model: m}}]"),
    ('x.args={"token": "a b", "url": "http://h/?token=abc&x=1"}', 'x.args={"token": "***", "url": "http://h/?token=***&x=1"}'),
    ("x.reward_fn=[{fn: judge, args: {api_key: MY_KEY}}]", "x.reward_fn=[{fn: judge, args: {api_key: MY_KEY}}]"),
    ("model.max_tokens=5", "model.max_tokens=5"), ("x.stop_token=abc", "x.stop_token=abc"),
])
def test_an_override_shows_no_secret(override, shown):
    assert R.redact_override(override) == shown


def test_a_records_yaml_and_a_flat_configs_keys_are_masked_and_interpolations_kept():
    """config_yaml is what a run's record (.hydra/config.yaml, a stage's config.yaml) is written
    with; a flat config (the resume check's identity) has dotted keys; Hydra's override_dirname
    joins overrides with commas."""
    from omegaconf import OmegaConf

    from rft.config import flat

    cfg = compose_cfg([REMOTE])
    text = R.config_yaml(cfg, resolve=True)
    assert TOKEN not in text and "token: '***'" in text
    assert yaml.safe_load(text)["seed"] == cfg.seed  # the rest as it was
    flat_cfg = R.redact(flat(cfg))
    assert flat_cfg["buffer.explorer_input.taskset.reward_fn"][0]["args"]["token"] == "***"
    assert R.redact({"a.b.token": TOKEN, "a.b.tokens": 3}) == {"a.b.token": "***", "a.b.tokens": 3}
    # where the token comes from is not the token: kept, as composed
    assert R.config_yaml(OmegaConf.create({"r": {"token": "${oc.env:RFT_REWARD_TOKEN}"}})) == \
        "r:\n  token: ${oc.env:RFT_REWARD_TOKEN}\n"
    assert R.redact_text(f"a=1,x.args.token={TOKEN},b=2") == "a=1,x.args.token=***,b=2"


def test_trackers_get_the_config_and_command_line_masked(monkeypatch):
    """wandb's run config and MLflow's params are config_dict's; wandb's metadata records sys.argv."""
    from rft.reporting.monitor import config_dict

    cfg = compose_cfg([REMOTE])
    saved = config_dict(cfg)
    assert saved["buffer"]["explorer_input"]["taskset"]["reward_fn"][0]["args"] == {"url": "http://127.0.0.1:9",
                                                                                  "token": "***"}
    assert TOKEN not in repr(saved)
    monkeypatch.setattr(sys, "argv", ["run.py", REMOTE, "seed=1"])
    with R.redacted_argv():
        seen = list(sys.argv)
    assert seen[0] == "run.py" and seen[2] == "seed=1" and "token: ***" in seen[1] and TOKEN not in repr(seen)
    assert sys.argv[1] == REMOTE  # put back after


@pytest.mark.slow  # wandb starts a service process (~2 s)
def test_wandbs_offline_run_file_holds_no_token(tmp_path, monkeypatch, request):
    import wandb

    from rft.plan.batch import stage_configs
    from rft.reporting.monitor import WandB

    request.addfinalizer(wandb.teardown)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setattr(sys, "argv", ["run.py", REMOTE])
    [stage] = stage_configs(compose_cfg(["stages=[]", REMOTE]))
    run = WandB(stage, tmp_path, "grpo", 0)
    run.close()
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files)
    assert [p.name for p in files if TOKEN.encode() in p.read_bytes()] == []


def test_the_sweep_report_shows_overrides_masked(tmp_path):
    from rft.reporting.report import parse_overrides

    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([REMOTE, "seed=1"]))
    assert parse_overrides(tmp_path, "0") == {
        "buffer.explorer_input.taskset.reward_fn": '[{fn: remote, args: {url: "http://127.0.0.1:9", token: ***}}]',
        "seed": "1"}


def test_the_studio_takes_no_secret_and_names_only_the_key():
    from rft.studio.bodies import composition, sweep_args

    key, value = REMOTE.split("=", 1)
    with pytest.raises(ValueError) as e:
        composition({"keys": {key: value}}, {})
    assert str(e.value).startswith(f"keys[{key!r}]: holds a secret (a token, an API key or a password), which the "
                                   f"studio does not take: a run it launches has its values on its command line, "
                                   f"which `ps` shows to every local user")
    assert TOKEN not in str(e.value) and "$RFT_REWARD_TOKEN" in str(e.value)
    with pytest.raises(ValueError, match=r"^sweep_params 'x.args.token': holds a secret") as e:
        sweep_args({"sweep_params": f"seed=1,2 x.args.token={TOKEN}"})
    assert TOKEN not in str(e.value)
    assert composition({"keys": {"x.args.api_key": "OPENAI_API_KEY"}}, {}) == ({}, {"x.args.api_key": "OPENAI_API_KEY"})


def test_the_studios_config_diff_shows_tokens_masked(tmp_path):
    from rft.studio.runs import Runs

    for name, token in (("a", TOKEN), ("b", TOKEN + "x")):
        (tmp_path / name / ".hydra").mkdir(parents=True)
        (tmp_path / name / ".hydra" / "config.yaml").write_text(
            yaml.safe_dump({"seed": 1 if name == "a" else 2, "r": {"args": {"token": token}}}))
    assert Runs(tmp_path).diff("a", "b") == [{"key": "seed", "a": "1", "b": "2"}]  # the tokens differ, unseen


def test_a_masked_token_composed_again_is_taken_from_the_environment(monkeypatch):
    from rft.errors import ConfigError
    from rft.rewards.judge import JudgeReward
    from rft.rewards.remote import RemoteReward

    monkeypatch.setenv("RFT_REWARD_TOKEN", "from-env-123")
    remote = RemoteReward("http://127.0.0.1:9", token="***", check=False)
    assert remote.http.client.headers["Authorization"] == "Bearer from-env-123"
    with pytest.raises(ConfigError, match=r"^api_key is '\*\*\*', a key masked in a saved record: set api_key to "
                                          r"the name of the environment variable that holds the key"):
        JudgeReward("http://127.0.0.1:9/v1", "m", api_key="***")
    # a 401's hint ends up in logs: it names the variable, never the key itself
    assert "sk-abc" not in JudgeReward("http://127.0.0.1:9/v1", "m", api_key="sk-abc").http.auth_hint


def test_the_run_list_follows_no_link_that_leaves_the_root(tmp_path):
    from rft.studio import runs as U

    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    for d in (root / "p" / "mine", elsewhere / "theirs"):
        (d / ".hydra").mkdir(parents=True)
    (root / "p" / "out").symlink_to(elsewhere)           # another user's folder
    (root / "p" / "again").symlink_to(root / "p" / "mine")  # a link inside the root: listed, as its route answers
    runs, _ = U.find(root)
    assert [p.relative_to(root).as_posix() for p in runs] == ["p/again", "p/mine"]
    with pytest.raises(ValueError, match="is not under the checkpoint root"):
        U.inside(root, "p/out/theirs")  # what the routes say of the link left out


def _answer(s) -> bytes:
    """One answer's head and its small body off a kept-alive connection."""
    s.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith((b"}", b"]")):
        data += s.recv(65536)
    return data


@pytest.mark.slow  # 1.4 s alone, over the fast tier's second
def test_connections_without_the_token_never_keep_a_client_with_it_out():
    """The slots are the server's (every local user is 127.0.0.1). Measured before: 7 connections
    held by a local user without the token (half-sent heads, or kept alive with a request refused
    401 every few seconds, which re-arms --request-timeout) answered the client with the token
    503 for as long as they were held. Now its connection takes the oldest one's slot; the limit
    still holds against connections that sent the token."""
    import httpx
    from test_reward_server import TOKEN as SERVER_TOKEN, closed_by_server, command, raw, stopped

    proc, url = command("--request-timeout", "30", "--max-connections", "8")
    held = []
    try:
        # 7 held: with the 8th, a request is at uvicorn's limit (len(connections) >= 8: 503)
        held = [raw(url, b"POST /score HTTP/1.1\r\nHost: x\r\nX-Slow: ") for _ in range(3)]
        for _ in range(4):  # whole requests without the token, kept alive
            held.append(raw(url, b"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n\r\n"))
            assert _answer(held[-1]).startswith(b"HTTP/1.1 401")
        auth = {"Authorization": "Bearer " + SERVER_TOKEN}
        assert httpx.get(url + "/health", headers=auth).status_code == 200
        # the oldest went (long before its 30 s), the other 6 are still open
        assert closed_by_server(held[0], 2.0) and not any(closed_by_server(s, 0.1) for s in held[1:])
        for s in held:
            s.close()
        # 7 connections that sent the token, kept alive: with the 8th that asks, at the limit
        held = [raw(url, f"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SERVER_TOKEN}\r\n\r\n".encode())
                for _ in range(7)]
        assert all(_answer(s).startswith(b"HTTP/1.1 200") for s in held)
        r = httpx.get(url + "/health", headers=auth)
        assert r.status_code == 503
    finally:
        for s in held:
            s.close()
        stopped(proc)


def test_model_written_code_and_the_studios_runs_see_no_token(monkeypatch, tmp_path):
    """The sandbox's code gets PATH, LANG and HOME only (and bubblewrap's PWD; no $RFT_REWARD_TOKEN, ...),
    isolated or not; the studio's token leaves its environment before it starts anything."""
    from rft.rollout.environments import sandbox
    from rft.studio.__main__ import _environments

    for name in ("RFT_REWARD_TOKEN", "OPENAI_API_KEY", "RFT_STUDIO_TOKEN", "WANDB_API_KEY"):
        monkeypatch.setenv(name, TOKEN)
    result = sandbox.run_python("import json, os; print(json.dumps(dict(os.environ)))", timeout_s=10,
                                allow_unisolated=True)
    seen = json.loads(result.stdout)
    assert set(seen) <= {"HOME", "LANG", "PATH", "PWD"} and TOKEN not in result.stdout, result  # PWD: bubblewrap's
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "RFT_CHECKPOINT_ROOT_DIR"):  # _environments sets them
        monkeypatch.setenv(name, os.environ.get(name, "1"))
    launched = _environments(tmp_path)
    assert "RFT_STUDIO_TOKEN" not in launched and "RFT_STUDIO_TOKEN" not in os.environ
    assert launched["RFT_CHECKPOINT_ROOT_DIR"] == str(tmp_path)


def test_a_sweeps_table_follows_no_job_link_that_leaves_the_root(tmp_path):
    """A sweep's jobs (the studio's table and its count) are found as the run list's: a job that is a
    link out of the root is left out; the command line's report still follows it."""
    from rft.reporting.report import find_jobs
    from rft.studio.runs import Runs

    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    sweep = root / "p" / "multirun" / "d"
    for d, seed in ((sweep / "0", 1), (elsewhere / "theirs", 2)):
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"seed={seed}"]))
        (d / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    (sweep / "1").symlink_to(elsewhere / "theirs")
    assert [p.name for p in find_jobs(sweep)] == ["0", "1"]
    runs = Runs(root)
    assert [(j["job"], j["seed"]) for j in runs.sweep_table("p/multirun/d")["jobs"]] == [("0", "1")]
    assert runs.listing()["sweeps"] == [{"id": "p/multirun/d", "jobs": 1, "planned": None}]


@pytest.mark.slow  # 1.2 s alone, over the fast tier's second
def test_the_studios_preview_shows_a_token_from_conf_masked():
    """A token written in a file under conf/ (here the same override) is shown *** in the preview's
    YAML and values, as the trackers show it; the form then sends *** back, which the remote reward
    reads as $RFT_REWARD_TOKEN."""
    from conftest import ROOT

    from rft.studio.compose import compose_overrides

    comp = compose_overrides(ROOT / "conf", [REMOTE])
    assert TOKEN not in comp.yaml and "token: '***'" in comp.yaml
    assert TOKEN not in repr(comp.values) and "token: '***'" in comp.values["buffer.explorer_input.taskset.reward_fn"]
def test_a_runs_record_holds_the_token_masked_and_a_resume_finds_its_config_unchanged(tmp_path):
    from rft.runtime import rundir

    cfg = compose_cfg([REMOTE])
    rundir.write_config(cfg, tmp_path)
    text = (tmp_path / "config.yaml").read_text()
    assert TOKEN not in text and "token: '***'" in text
    assert rundir.record_problem(tmp_path) is None  # its first line's fingerprint is the masked config's
    assert rundir.differences(rundir.identity(rundir.saved_config(tmp_path)), rundir.identity(cfg)) == []


@pytest.mark.slow  # wandb starts a service process (~2 s)
def test_a_run_that_logs_to_wandb_resumes_past_wandbs_own_links(tmp_path, monkeypatch, request):
    # wandb makes links in its folder (wandb/debug.log -> its run's logs, debug-core.log into
    # ~/.cache/wandb), and the run directory's link check refused every resume of a
    # monitor_type=[wandb] run: 'debug-internal.log is a link ... (and 2 more)'
    import wandb

    from rft.plan.batch import stage_configs
    from rft.reporting.monitor import WandB
    from rft.runtime import rundir

    request.addfinalizer(wandb.teardown)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    [stage] = stage_configs(compose_cfg(["stages=[]"]))
    WandB(stage, tmp_path, "grpo", 0).close()
    assert [p.name for p in tmp_path.glob("wandb/*.log") if p.is_symlink()]  # wandb's links are there
    rundir.refuse_links(tmp_path)  # before: RunError
    # a link planted beside wandb's folder is still refused
    (tmp_path / "run.log").symlink_to(tmp_path / "elsewhere.log")
    with pytest.raises(Exception, match="run.log is a link"):
        rundir.refuse_links(tmp_path)
