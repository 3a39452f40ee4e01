"""What the studio refuses: a page on another port of 127.0.0.1 (same-site for the browser) posting
forms and fetches at it, a foreign Host (DNS rebinding), requests without the header token, bodies
that are not JSON or too big; and what the compose page warns of before a launch (the dotted paths
the config will import from outside rft and this repository).

The attacks run in Debian's headless Chromium (tests/test_studio.py's fixtures): the browser has the
studio open, as its user would, and then visits a page served from another port.
"""

import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_studio import CONF, ROOT, _stop, _studio, browser  # noqa: F401  (browser: a fixture)

from rft.studio import compose as C

# a run that trains long enough to be seen running (the stop attack needs one)
LONG_RUN = {"choices": {"cluster": "inline", "monitor": "console"}, "keys": {"stages": "[]", "buffer.total_steps": "100000"}}


class _Attacker:
    """A page on another port of 127.0.0.1, as a notebook or `python -m http.server` serves one; it
    records the headers every request to it carried (a cookie for 127.0.0.1 reaches it too)."""

    def __init__(self, html: str):
        seen = self.headers = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                seen.append(dict(self.headers))
                body = html.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _form(action: str, body: dict) -> str:
    """A plain HTML form whose text/plain encoding (name=value) is the JSON `body`: the name holds
    all of it but its last string's closing, the value closes it."""
    text = json.dumps({**body, "pad": ""})
    name, value = text[:-2], text[-2:]  # ...,"pad": "  |  "}
    return (f'<form method="POST" action="{action}" enctype="text/plain">'
            f"<input name='{name}' value='{value}'></form>")


def _attack_page(studio: str, launch_id: int) -> str:
    forms = {"launch": _form(f"{studio}/api/launch", LONG_RUN),
             "study": _form(f"{studio}/api/study", {"choices": {}, "keys": {}, "name": "pwned"}),
             "stop": _form(f"{studio}/api/launch/{launch_id}/stop", {})}
    fetches = [f"fetch('{studio}/api/launch', {{method: 'POST', credentials: 'include', mode: 'no-cors', "
               f"headers: {{'Content-Type': 'text/plain'}}, body: {json.dumps(json.dumps(LONG_RUN))}}})",
               f"fetch('{studio}/api/study', {{method: 'POST', credentials: 'include', "
               f"headers: {{'Content-Type': 'application/json'}}, body: '{{\"name\": \"pwned2\"}}'}})",
               f"fetch('{studio}/api/launch/{launch_id}/stop', {{method: 'POST', credentials: 'include', mode: 'no-cors', body: '{{}}'}})"]
    script = "window.attack = () => Promise.allSettled([" + ", ".join(fetches) + "]);"
    return "".join(f'<div id="{k}">{v}</div>' for k, v in forms.items()) + f"<script>{script}</script>"


def _launches(url, token):
    import httpx

    return httpx.get(url + "/api/launches", headers={"Authorization": f"Bearer {token}"}).json()


@pytest.mark.slow
def test_a_page_on_another_port_can_neither_launch_save_nor_stop_and_gets_no_token(browser, tmp_path):  # noqa: F811
    import httpx

    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    proc, url, token = _studio(tmp_path, conf)
    attacker, running = None, None
    auth = {"Authorization": f"Bearer {token}"}
    try:
        running = httpx.post(url + "/api/launch", json=LONG_RUN, headers=auth, timeout=120).json()
        assert running["status"] == "running"
        attacker = _Attacker(_attack_page(url, running["id"]))
        context = browser.new_context(bypass_csp=True)
        studio = context.new_page()
        studio.goto(proc.link)  # the user has the studio open, as printed
        studio.wait_for_function("document.body.dataset.composed")
        page = context.new_page()
        answers = []
        page.on("response", lambda r: answers.append((r.url, r.status)))
        page.goto(attacker.url)
        page.evaluate("window.attack()")  # awaits the three fetches (Promise.allSettled)
        said = []
        for form in ("launch", "study", "stop"):
            page.goto(attacker.url)
            with page.expect_navigation() as nav:
                page.eval_on_selector(f"#{form} form", "f => f.submit()")
            said.append((form, nav.value.status, page.inner_text("body")))
        # the three fetches (one refused at its preflight) and the three forms: each refused
        refused = [(u, s) for u, s in answers if u.startswith(url)]
        assert len(refused) >= 5 and all(s == 403 for u, s in refused), refused
        for form, status, text in said:
            assert status == 403 and "\n" not in text.strip() and text.startswith("refused: "), (form, status, text)
        assert [launch["id"] for launch in _launches(url, token)] == [running["id"]]  # no run started
        assert httpx.get(f"{url}/api/launch/{running['id']}", headers=auth).json()["status"] == "running"  # not stopped
        assert not list((conf / "experiment").glob("pwned*"))  # no study written
        # the page's own server saw no token: the studio sets no cookie for it to receive
        assert attacker.headers and not any(token in json.dumps(h) for h in attacker.headers), attacker.headers
    finally:
        if running and "id" in running:  # a 100,000-step run outlives the studio: stopped even when a check failed
            httpx.post(f"{url}/api/launch/{running['id']}/stop", json={}, headers=auth, timeout=60)
        if attacker:
            attacker.close()
        _stop(proc)


@pytest.mark.slow
def test_requests_that_change_state_need_json_the_header_token_and_the_studios_own_origin(tmp_path):
    import httpx

    proc, url, token = _studio(tmp_path)
    try:
        host = url.removeprefix("http://")
        auth = {"Authorization": f"Bearer {token}"}
        body = json.dumps({"choices": {}, "keys": {}})

        def post(path="/api/compose", content=body, **headers):
            return httpx.post(url + path, content=content, headers={"Content-Type": "application/json", **auth, **headers},
                              timeout=120)

        own = post()
        assert own.status_code == 200 and "plan" in own.json()  # the studio's own page's request
        # a page reached through a name that resolves to 127.0.0.1 (DNS rebinding): refused, reads too
        for r in (post(Host=f"rebind.example:{url.rsplit(':', 1)[1]}"),
                  httpx.get(url + "/api/runs", headers={**auth, "Host": "rebind.example"})):
            assert r.status_code == 403 and r.text.startswith("refused: Host 'rebind.example") and "\n" not in r.text
        r = post(Origin="http://127.0.0.1:8888")  # a page on another port
        assert r.status_code == 403 and r.text == (
            f"refused: a request from the page at http://127.0.0.1:8888, not from the studio's own page (http://{host}); "
            f"other pages, other ports of this host included, cannot use the studio.")
        assert post(Origin=f"http://{host}").status_code == 200
        for site in ("same-site", "cross-site", "none"):
            r = post(**{"Sec-Fetch-Site": site})
            assert r.status_code == 403 and r.text.startswith(f"refused: a {site} request (Sec-Fetch-Site)"), site
        assert post(**{"Sec-Fetch-Site": "same-origin"}).status_code == 200
        # reads: a typed URL ("none") or the page itself; another port's fetch is same-site, refused
        assert httpx.get(url + "/api/runs", headers={**auth, "Sec-Fetch-Site": "none"}).status_code == 200
        assert httpx.get(url + "/api/runs", headers={**auth, "Sec-Fetch-Site": "same-site"}).status_code == 403
        # what a plain form can send: not JSON
        for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            r = post(**{"Content-Type": kind})
            assert r.status_code == 415 and r.text == (f"refused: Content-Type {kind.split(';')[0]!r}; send the body as JSON, "
                                                       f"with Content-Type: application/json."), kind
        # the token: in the header; a cookie or the URL's query alone is nothing
        no_header = {"Content-Type": "application/json"}
        for r in (httpx.post(url + "/api/compose", content=body, headers=no_header, cookies={"rft_studio_token": token}),
                  httpx.post(f"{url}/api/compose?token={token}", content=body, headers=no_header),
                  httpx.get(url + "/api/runs", cookies={"rft_studio_token": token})):
            assert r.status_code == 401 and r.text.startswith("refused: the rft studio needs its token in 'Authorization: Bearer")
        # bodies: at most 1 MiB, and a JSON object
        r = post(content=b" " * ((1 << 20) + 1))
        assert r.status_code == 413 and r.text == f"refused: a body of {(1 << 20) + 1} bytes; the studio takes at most {1 << 20}."
        r = post(content=b"{not json")
        assert r.status_code == 400 and r.json()["detail"].startswith("the request body is not JSON (Expecting property name")
        r = post(content=b"[" * 100_000)
        assert r.status_code == 400 and r.json()["detail"] == "the request body nests too deep; send a JSON object of groups and keys."
        r = post(content=b"[]")
        assert r.status_code == 400 and r.json()["detail"].startswith("the request body is a JSON list; send a JSON object")
        r = post(content=json.dumps({"choices": []}))
        assert r.status_code == 400 and r.json()["detail"] == "choices: a JSON object of choices is expected, not a list."
        r = post(content=json.dumps({"choices": {"algorithm": "../../etc/passwd"}}))
        assert r.status_code == 400 and r.json()["detail"].startswith("choices.algorithm='../../etc/passwd' is not a file of conf/algorithm/")
        # no page may frame the studio (a click on "launch" through a transparent frame)
        assert httpx.get(url + "/compose").headers["x-frame-options"] == "DENY"
    finally:
        _stop(proc)


@pytest.mark.slow
def test_a_launch_log_offset_outside_the_log_is_a_400_saying_so(tmp_path):
    import httpx

    proc, url, token = _studio(tmp_path)
    try:
        auth = {"Authorization": f"Bearer {token}"}
        launched = httpx.post(url + "/api/launch", json={"choices": {}, "keys": {"dry_run": "true"}}, headers=auth, timeout=120).json()
        log = f"{url}/api/launch/{launched['id']}"
        deadline = time.time() + 120
        while httpx.get(log, headers=auth).json()["status"] == "running" and time.time() < deadline:
            time.sleep(0.1)
        whole = httpx.get(log, headers=auth).json()
        size = whole["offset"]  # the dry run printed its plan: `size` bytes
        assert size > 0 and "batch plan" in whole["text"]
        assert httpx.get(log, params={"offset": size}, headers=auth).json()["text"] == ""
        for offset in (-1, size + 1, 10**30):
            r = httpx.get(log, params={"offset": offset}, headers=auth)
            assert r.status_code == 400 and r.json()["detail"] == (
                f"offset={offset}: launch {launched['id']}'s console has {size} bytes; give an offset from 0 to {size} "
                f"(the `offset` the last answer returned)."), offset
        assert httpx.get(f"{url}/api/launch/99", headers=auth).status_code == 404
    finally:
        _stop(proc)


@pytest.mark.slow
def test_a_value_with_a_line_break_cannot_write_yaml_into_a_saved_study(tmp_path):
    import httpx
    import yaml

    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    defaults = C.default_choices(conf)
    # Hydra takes a quoted value with a newline: the study's comment line would end there
    comp = C.compose(conf, defaults, {"project": "'x\nevil: 1'"}, defaults, plan=False)
    assert comp.error == ""
    with pytest.raises(ValueError, match=r"^project: holds '\\n' \(U\+000A\), a line break or another control character"):
        C.save_study(conf, "broken", comp, defaults)
    assert not (conf / "experiment" / "broken.yaml").exists()
    proc, url, token = _studio(tmp_path, conf)
    try:
        auth = {"Authorization": f"Bearer {token}"}
        # a newline; YAML's other line break; a right-to-left override (the shown command would read otherwise)
        for value, char in [("'x\nevil: 1'", "'\\n' (U+000A)"), ("'x\u2028evil: 1'", "'\\u2028' (U+2028)"),
                            ("'x\u202eevil'", "'\\u202e' (U+202E)")]:
            r = httpx.post(url + "/api/study", json={"choices": {}, "keys": {"project": value}, "name": "broken"}, headers=auth, timeout=120)
            assert r.status_code == 400 and r.json()["detail"] == (
                f"keys['project']: holds {char}, a line break or another control character; a value is one line of printable "
                f"text: take it out.")
        assert not (conf / "experiment" / "broken.yaml").exists()
        # YAML's own characters in a value are the value's: the file holds its three comment lines and the keys set
        r = httpx.post(url + "/api/study", json={"choices": {}, "keys": {"project": "'a: b # c'"}, "name": "quoted"}, headers=auth,
                       timeout=120)
        assert r.status_code == 200, r.text
        text = (conf / "experiment" / "quoted.yaml").read_text()
        assert [line for line in text.splitlines() if line.startswith("#")] == [
            "# @package _global_", "# python run.py experiment=quoted", "# saved by the studio from: python run.py 'project='\"'\"'a: b # c'\"'\"''"]
        assert yaml.safe_load(text) == {"defaults": ["_self_"], "name": "quoted", "project": "a: b # c"}
    finally:
        _stop(proc)


@pytest.mark.slow
def test_the_preview_shows_an_environment_variable_typed_on_the_page_as_written(monkeypatch, cache_dir):
    monkeypatch.setenv("RFT_TEST_SECRET", "hunter2")
    monkeypatch.delenv("RFT_TEST_UNSET", raising=False)
    defaults = C.default_choices(CONF)
    comp = C.compose(CONF, defaults, {"name": "${oc.env:RFT_TEST_SECRET}-${oc.env:RFT_TEST_UNSET}"}, defaults)
    assert comp.error == ""  # an unset one is no error either: nothing was looked up
    assert "hunter2" not in comp.plan + comp.yaml + json.dumps(comp.values)
    assert "/rft/${oc.env:RFT_TEST_SECRET}-${oc.env:RFT_TEST_UNSET}/grpo" in comp.plan
    with_default = C.compose(CONF, defaults, {"name": "${oc.env:RFT_TEST_SECRET,x}"}, defaults)
    assert "/rft/${oc.env:RFT_TEST_SECRET,x}/grpo" in with_default.plan
    # the variables conf/ reads are read, as the run reads them: the data lies under $RFT_CACHE_DIR
    assert f"trains on      {cache_dir}/data/arithmetic-v4" in comp.plan
    # and the resolver is OmegaConf's own again outside the studio's compositions
    from omegaconf import OmegaConf

    assert OmegaConf.create({"a": "${oc.env:RFT_TEST_SECRET}"}).a == "hunter2"


@pytest.mark.slow
def test_compose_lists_each_dotted_path_it_imports_from_outside_rft_and_this_repository():
    defaults = C.default_choices(CONF)
    ts = "buffer.explorer_input.taskset"
    comp = C.compose(CONF, defaults, {
        f"+{ts}.workflow_args.env": "subprocess.Popen", f"+{ts}.workflow_args.env_args": "{args: 'touch x', shell: true}",
        "algorithm.policy_loss_fn": "builtins.eval",
        f"{ts}.reward_fn": "[{fn: os.system}, {fn: rft.rollout.environments.sandbox.subprocess}, {fn: exact_match}, {fn: rft.rewards.verifiers.exact_match}, "
                           "{fn: tests.faulty_reward.flaky, args: {parse: json.loads}}]",
        f"{ts}.split": "test.jsonl"}, defaults, plan=False)
    assert comp.error == ""
    assert comp.imports == [
        {"key": "algorithm.policy_loss_fn", "path": "builtins.eval", "module": "builtins"},
        {"key": f"{ts}.reward_fn[0].fn", "path": "os.system", "module": "os"},
        # rft.rollout.environments.sandbox only imports subprocess: not rft's own
        {"key": f"{ts}.reward_fn[1].fn", "path": "rft.rollout.environments.sandbox.subprocess", "module": "subprocess"},
        # a key the runtime may import under any name: json exists, so it is listed
        {"key": f"{ts}.reward_fn[4].args.parse", "path": "json.loads", "module": "json"},
        {"key": f"{ts}.workflow_args.env", "path": "subprocess.Popen", "module": "subprocess"}]
    # registry names, rft's and the repository's own functions, and file names are not listed
    assert C.compose(CONF, defaults, {}, defaults, plan=False).imports == []



HIDDEN_STUDY = """# @package _global_
# a study that sets what the run imports in Hydra's own settings, which the page may not set
hydra:
  callbacks:
    touch:
      _target_: subprocess.Popen
      args: [touch, pwned]
  job_logging:
    handlers:
      file:
        (): logging.config.fileConfig
  job:
    env_set:
      LD_PRELOAD: /tmp/x.so
  sweeper:
    params:
      buffer.explorer_input.taskset.reward_fn: exact_match,os.path.join
"""


@pytest.mark.slow
def test_a_study_cannot_hide_what_the_run_imports_in_hydras_own_settings(tmp_path):
    # Hydra instantiates hydra.callbacks, builds hydra.job_logging's handlers, puts hydra.job.env_set
    # in the run's environment (LD_PRELOAD reaches every process the run starts) and sweeps
    # hydra.sweeper.params; the page listed none of them (the hydra node was never read)
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "experiment" / "hidden.yaml").write_text(HIDDEN_STUDY)
    defaults = C.default_choices(conf)
    comp = C.compose(conf, {**defaults, "experiment": "hidden"}, {}, defaults, plan=False)
    assert comp.error == ""
    assert comp.imports == [
        {"key": "hydra.job_logging.handlers.file.()", "path": "logging.config.fileConfig", "module": "logging.config"},
        {"key": "hydra.callbacks.touch._target_", "path": "subprocess.Popen", "module": "subprocess"},
        {"key": "hydra.job.env_set.LD_PRELOAD", "path": "LD_PRELOAD=/tmp/x.so",
         "module": "the environment of every process the run starts"}]
    # the sweep's jobs are its sweeper's params and the page's values together: 2 x 2 jobs
    found, _ = C.check_sweep(conf, comp.overrides, ["seed=1,2"])
    assert [(i["key"], i["path"]) for i in found if i["key"].startswith("buffer")] == [
        ("buffer.explorer_input.taskset.reward_fn", "os.path.join")]
    # Hydra's own launchers, sweepers and default logging, and rft's own callback, are not listed
    assert C.compose(conf, defaults, {}, defaults, plan=False).imports == []
    assert C.compose(conf, {**defaults, "experiment": "tiny_seeds"}, {}, defaults, plan=False).imports == []


@pytest.mark.slow
def test_a_launch_neither_composes_a_file_from_outside_conf_nor_writes_outside_the_root(tmp_path, monkeypatch):
    # `experiment=../../evil` (a key, not a choice: choices are checked) made Hydra compose
    # <conf>/experiment/../../evil.yaml: its hydra.run.dir was where the run wrote, while the studio
    # read the run's directory as <root>/rft/<name> and listed no import; it launched
    from rft.studio import bodies as B
    from rft.studio.app import Refused, launch_args

    conf, root = tmp_path / "conf", tmp_path / "root"
    shutil.copytree(CONF, conf)
    (tmp_path / "evil.yaml").write_text(f"# @package _global_\nhydra:\n  run:\n    dir: {tmp_path / 'outside'}\n")
    root.mkdir()
    monkeypatch.setenv("RFT_CHECKPOINT_ROOT_DIR", str(root))  # as the studio sets it for its compositions
    defaults = C.default_choices(conf)
    options = {g: [o["name"] for o in opts] for g, opts in C.groups(conf).items()}

    def launch(body: dict):
        choices, keys = B.composition(body, options)
        return launch_args(conf, defaults, body, {**defaults, **choices}, keys, root)

    names = ", ".join(repr(p.stem) for p in sorted((conf / "experiment").glob("*.yaml")))
    for body, override, job in [({"keys": {"experiment": "../../evil"}}, "experiment=../../evil", ""),
                                ({"keys": {"+experiment@_global_": "../../evil"}}, "+experiment@_global_=../../evil", ""),
                                ({"sweep": True, "sweep_params": "experiment=tiny_seeds,../../evil"}, "experiment=../../evil",
                                 "job 1 of the sweep (experiment=../../evil): ")]:
        with pytest.raises(Refused) as e:
            launch(body)
        assert e.value.status == 400 and e.value.answer["detail"].startswith(
            f"not launched: {job}{override}: an option of the config group experiment is the name of a file of "
            f"conf/experiment/, without '/'; choose one of [{names}]."), body
    # a checkpoint_root_dir typed on the page: the run would write outside what the studio shows
    for where, run_dir in [("/elsewhere", "/elsewhere/rft/grpo-tiny-arithmetic"), ("rel", "rel/rft/grpo-tiny-arithmetic")]:
        with pytest.raises(Refused) as e:
            launch({"keys": {"checkpoint_root_dir": where}})
        assert e.value.status == 400 and e.value.answer["detail"] == (
            f"not launched: it would write to {run_dir}, outside the checkpoint root {root} that this studio shows and "
            f"launches into. Leave checkpoint_root_dir as it is, or start the studio with --root on the folder you want "
            f"(python -m rft.studio --root DIR).")
    assert launch({"keys": {}}) == ([], "rft/grpo-tiny-arithmetic", None)  # under the root: launched


@pytest.mark.slow
def test_a_launch_refuses_a_key_that_would_write_outside_the_root(tmp_path, monkeypatch):
    # the run's and the sweep's directory were checked against the root, no other key: a buffer's
    # database, the stage cache, the cache of built models and data, a local MLflow store typed on
    # the page each launched, and the run wrote there, out of the studio's sight
    from rft.studio import bodies as B
    from rft.studio.app import Refused, launch_args

    root, out = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    monkeypatch.setenv("RFT_CHECKPOINT_ROOT_DIR", str(root))
    defaults = C.default_choices(CONF)
    options = {g: [o["name"] for o in opts] for g, opts in C.groups(CONF).items()}

    def launch(body: dict):
        choices, keys = B.composition(body, options)
        return launch_args(CONF, defaults, body, {**defaults, **choices}, keys, root)

    def refused(where: str, path, fix: str, job: str = "") -> str:
        relative = "" if Path(path).is_absolute() else " (a relative path: in the run's working directory, the repository)"
        return (f"not launched: {job}{where}: the run would write to {path}{relative}, outside the checkpoint root {root} "
                f"that this studio shows and launches into. Give a path under {root}, or {fix}, or start the studio with "
                f"--root on a folder that holds it (python -m rft.studio --root DIR).")

    buffer = "buffer.trainer_input.experience_buffer.path"
    unset = "leave it unset (the stage's own buffer.db or experiences.jsonl, in its directory)"
    for body, said in [
        # the RL stage's SQLite buffer (the warm-up stage reads its dataset file: not a write)
        ({"choices": {"buffer": "sql"}, "keys": {buffer: f"{out}/b.db"}},
         refused(f"{buffer}={out}/b.db", out / "b.db", unset)),
        # `..` out of the root: the path as the run resolves it
        ({"keys": {"stage_cache_dir": f"{root}/../outside"}},
         refused(f"stage_cache_dir={root}/../outside", out, "leave it as conf/config.yaml sets it (under the root), or null "
                                                              "(no reuse)")),
        # a relative path: from the run's working directory (cache_dir's rule: the test below; typed
        # here, the plan would generate the taskset there first)
        ({"keys": {"stage_cache_dir": "rel/cache"}},
         refused("stage_cache_dir=rel/cache", "rel/cache", "leave it as conf/config.yaml sets it (under the root), or "
                                                         "null (no reuse)")),
        ({"choices": {"monitor": "mlflow"}, "keys": {"monitor.mlflow_tracking_uri": f"sqlite:///{out}/m.db"}},
         refused(f"monitor.mlflow_tracking_uri=sqlite:///{out}/m.db", out / "m.db",
                 "leave it unset (mlflow.db under the root), or give a server's http(s):// address")),
        # a sweep: each job's
        ({"sweep": True, "sweep_params": f"stage_cache_dir={root}/cache,{out}"},
         refused(f"stage_cache_dir={out}", out, "leave it as conf/config.yaml sets it (under the root), or null (no reuse)",
                 f"job 1 of the sweep (stage_cache_dir={out}): ") + " No job has started: every job is planned first."),
    ]:
        with pytest.raises(Refused) as e:
            launch(body)
        assert (e.value.status, e.value.answer["detail"]) == (400, said), body
    # under the root, a server's address, and what a run only reads (algorithm=sft's dataset in the
    # shared cache, a file buffer read by mode=train): launched
    for body in [{"choices": {"buffer": "sql"}, "keys": {buffer: f"{root}/buffers/b.db"}},
                 {"choices": {"monitor": "mlflow"}, "keys": {"monitor.mlflow_tracking_uri": "http://mlflow.example:5000"}},
                 {"choices": {"algorithm": "sft"}}]:
        args, run, sweep = launch(body)
        assert run is not None and sweep is None, body


@pytest.mark.slow  # three compositions, two planned (~3 s)
def test_the_preview_refuses_a_cache_dir_outside_the_root_before_its_plan_writes_there(tmp_path, monkeypatch):
    # the page's preview plans the run, and planning generates the default taskset's data into
    # cache_dir: a cache_dir typed on the page was written before any launch was asked for
    root, out = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    monkeypatch.setenv("RFT_CHECKPOINT_ROOT_DIR", str(root))
    defaults = C.default_choices(CONF)
    said = (f"cache_dir={out}: the run would write to {out}, outside the checkpoint root {root} that this studio shows "
            f"and launches into. Give a path under {root}, or")
    for keys in ({"cache_dir": str(out)}, {"cache_dir": str(out), "dry_run": "true"}):
        comp = C.compose(CONF, dict(defaults), keys, defaults, True, True, root)
        assert comp.error.startswith(said) and comp.plan == "", (keys, comp.error)
        assert not out.exists(), keys  # nothing generated there
    # without a root (python run.py's own dry run), the plan generates the data where it is told
    comp = C.compose(CONF, dict(defaults), {"cache_dir": str(out), "dry_run": "true"}, defaults, True, True)
    assert comp.error == "" and comp.plan and (out / "data").is_dir()


def test_a_model_the_project_would_build_or_data_it_would_generate_is_a_write(tmp_path):
    # model.model_path with a builder, a taskset path with a generator: built or generated there
    # when nothing is there yet (a dry run's plan generates the data too); in the shared cache, or
    # when they exist (read only), no write to check
    from omegaconf import OmegaConf

    from rft.studio import writes as W

    ts = "buffer.explorer_input.taskset.path"
    out, cache = tmp_path / "outside", tmp_path / "cache"
    (tmp_path / "have").mkdir()

    def stage(model_path, data, builder="tiny", generator="arithmetic"):
        return OmegaConf.create({"stage_name": "grpo", "mode": "both", "cache_dir": str(cache),
                                 "model": {"model_path": model_path, "builder": builder},
                                 "buffer": {"explorer_input": {"generator": generator, "taskset": {"path": data}},
                                            "trainer_input": {"experience_buffer": {"storage_type": "queue", "path": None}}},
                                 "monitor": {"monitor_type": []}})

    job = OmegaConf.create({"stage_cache_dir": None, "dry_run": False})
    built = [stage(f"{out}/model", f"{out}/arithmetic-v4")]
    assert W.written(job, built, str(cache)) == [
        W.Write("model.model_path", f"{out}/model", f"{out}/model", "grpo"),
        W.Write(ts, f"{out}/arithmetic-v4", f"{out}/arithmetic-v4", "grpo")]
    # a dry run's plan: the generated data only (the model is built when the run starts)
    assert W.written(OmegaConf.merge(job, {"dry_run": True}), built, str(cache), planning=True) == [
        W.Write(ts, f"{out}/arithmetic-v4", f"{out}/arithmetic-v4", "grpo")]
    for fine in (stage(f"{cache}/models/m", f"{cache}/data/arithmetic-v4"),  # in the shared cache
                 stage(str(tmp_path / "have"), str(tmp_path / "have")),  # there already: read
                 stage(f"{out}/model", f"{out}/data", builder=None, generator=None)):  # nothing to build
        assert W.written(job, [fine], str(cache)) == [], fine
    assert W.refusal(tmp_path / "root", W.written(job, built, str(cache))) == (
        f"model.model_path={out}/model (stage grpo): the run would write to {out}/model, outside the checkpoint root "
        f"{tmp_path}/root that this studio shows and launches into. Give a path under {tmp_path}/root, or leave it as "
        f"the model's config sets it (built in the shared cache), or give a model that exists, or start the studio "
        f"with --root on a folder that holds it (python -m rft.studio --root DIR).")


def test_which_keys_a_run_writes_to_by_storage_mode_and_monitor(tmp_path):
    # the rules of rft/studio/writes.py on configs made by hand (no composition): a sql buffer is
    # written in any mode (its read cursor), a file buffer only where the explorer writes it; a
    # server's MLflow address and conf/config.yaml's shared cache are no paths to check
    from omegaconf import OmegaConf

    from rft.studio import writes as W

    def stage(name, mode, storage, path, monitors=(), uri=None, cache="/cache"):
        return OmegaConf.create({"stage_name": name, "mode": mode, "cache_dir": cache,
                                 "buffer": {"trainer_input": {"experience_buffer": {"storage_type": storage, "path": path}}},
                                 "monitor": {"monitor_type": list(monitors), "mlflow_tracking_uri": uri}})

    eb = "buffer.trainer_input.experience_buffer.path"
    job = OmegaConf.create({"stage_cache_dir": None, "cache_dir": "/cache", "dry_run": False,
                            "buffer": {"trainer_input": {"experience_buffer": {"path": "/data/sft.jsonl"}}}})
    stages = [stage("sft", "train", "file", "/data/sft.jsonl"), stage("rl", "both", "sql", "sqlite:////out/b.db"),
              stage("more", "train", "sql", "~/b.db", ["mlflow"], "http://mlflow:5000"),
              stage("last", "explore", "file", "/data/sft.jsonl", ["tensorboard", "mlflow"], "file:///out/mlruns", "rel")]
    home = os.path.expanduser("~")
    assert W.written(job, stages, "/cache") == [
        W.Write(eb, "sqlite:////out/b.db", "/out/b.db", "rl"), W.Write(eb, "~/b.db", f"{home}/b.db", "more"),
        W.Write("cache_dir", "rel", "rel", "last"), W.Write(eb, "/data/sft.jsonl", "/data/sft.jsonl", None),
        W.Write("monitor.mlflow_tracking_uri", "file:///out/mlruns", "/out/mlruns", "last")]
    assert W.written(OmegaConf.merge(job, {"dry_run": True}), stages, "/cache") == []
    assert W.refusal(tmp_path, [W.Write("cache_dir", "rel", "rel", "last")]) == (
        f"cache_dir=rel (stage last): the run would write to rel (a relative path: in the run's working directory, the "
        f"repository), outside the checkpoint root {tmp_path} that this studio shows and launches into. Give a path "
        f"under {tmp_path}, or leave it as conf/config.yaml sets it (the machine's shared cache of built models and "
        f"data), or start the studio with --root on a folder that holds it (python -m rft.studio --root DIR).")
    # under the root (after `..` and links are resolved): allowed; the first other one is refused
    (tmp_path / "root").mkdir()
    os.symlink("/out", tmp_path / "root" / "link")
    inside = W.Write("stage_cache_dir", f"{tmp_path}/root/a/../b", f"{tmp_path}/root/a/../b")
    assert W.refusal(tmp_path / "root", [inside]) is None
    link = W.Write(eb, f"{tmp_path}/root/link/b.db", f"{tmp_path}/root/link/b.db", "rl")
    assert W.refusal(tmp_path / "root", [inside, link]) == (
        f"{eb}={tmp_path}/root/link/b.db (stage rl): the run would write to /out/b.db, outside the checkpoint root "
        f"{tmp_path}/root that this studio shows and launches into. Give a path under {tmp_path}/root, or leave it unset "
        f"(the stage's own buffer.db or experiences.jsonl, in its directory), or start the studio with --root on a "
        f"folder that holds it (python -m rft.studio --root DIR).")


def test_a_model_whose_own_code_would_run_is_listed_with_the_imports():
    # trust_remote_code runs the Python files of the model's folder (or hub repo): listed before,
    # it launched unasked; the policy's and an auxiliary model's, each with its path
    defaults = C.default_choices(CONF)
    aux = "+explorer.auxiliary_models"
    comp = C.compose(CONF, defaults, {"model.model_path": "someone/remote-code-model", "model.trust_remote_code": "true",
                                      aux: "[{name: judge, model: {model_path: /models/judge, trust_remote_code: true}}]"},
                     defaults, plan=False)
    assert comp.error == ""
    said = "the Python files of that model's folder or hub repository (trust_remote_code)"
    assert comp.imports == [
        {"key": "model.trust_remote_code", "path": "someone/remote-code-model", "module": said},
        {"key": "explorer.auxiliary_models[0].model.trust_remote_code", "path": "/models/judge", "module": said}]


@pytest.mark.slow
def test_a_sweep_too_big_to_check_is_refused_before_its_jobs_are_listed():
    import tracemalloc

    # range(0,100000000) took minutes and GBs before the refusal (each job's overrides were listed
    # first: 2 million of them held 250 MB for 6 s); now the jobs are counted, not listed
    for params in ["seed=range(0,2000000)", "seed=range(0,2000) +x=range(0,1000)", "+x=range(0,1e9,0.5)",
                   "seed=range(0,100000000) +x=shuffle(range(0,100000000))", "seed=range(0,65)"]:
        tracemalloc.start()
        try:
            with pytest.raises(ValueError) as e:
                C.check_sweep(CONF, [], params.split(" "))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert str(e.value) == ("sweep_params: more than 64 jobs; the studio checks each job's imports before a sweep "
                                "starts, up to 64: start a bigger sweep from a shell (python run.py -m ...)."), params
        assert peak < 64 << 20, (params, peak)


@pytest.mark.slow
def test_a_launch_that_imports_from_outside_runs_only_once_those_paths_are_confirmed(tmp_path):
    import httpx

    proc, url, token = _studio(tmp_path)
    try:
        auth = {"Authorization": f"Bearer {token}"}
        ts = "buffer.explorer_input.taskset"
        # os.path.join takes (prompt, response, task) as a reward function would: the plan passes; a dry run calls nothing
        body = {"choices": {}, "keys": {f"{ts}.reward_fn": "os.path.join", "dry_run": "true"}}

        def launch(**extra):
            return httpx.post(url + "/api/launch", json={**body, **extra}, headers=auth, timeout=120)

        r = launch()
        assert r.status_code == 409 and r.json() == {
            "detail": f"not launched: it imports from outside rft and this repository: os.path.join ({ts}.reward_fn). "
                      f"Launch it only if you trust that code: confirm each path (confirm_imports).",
            "imports": [{"key": f"{ts}.reward_fn", "path": "os.path.join", "module": "os.path"}]}
        assert launch(confirm_imports=["os.system"]).status_code == 409  # a confirmation is of the paths listed
        # each job of a sweep is checked: the second value of this one imports
        r = launch(sweep=True, sweep_params=f"{ts}.reward_fn=exact_match,os.system", confirm_imports=["os.path.join"])
        assert r.status_code == 409 and [i["path"] for i in r.json()["imports"]] == ["os.system"]
        assert _launches(url, token) == []
        # Hydra's own settings and command-line flags are not the page's to set
        refusals = [
            ({"keys": {"hydra.job.env_set.LD_PRELOAD": "/tmp/x.so"}},
             "keys['hydra.job.env_set.LD_PRELOAD']: the studio does not change Hydra's own settings"),
            ({"keys": {"+experiment@hydra.job.env_set": "tiny_seeds"}},
             "keys['+experiment@hydra.job.env_set']: the studio does not change Hydra's own settings"),
            ({"sweep": True, "sweep_params": "seed=1,2 +hydra.callbacks.x._target_=os.system"},
             "sweep_params '+hydra.callbacks.x._target_=os.system': the studio does not change"),
            ({"sweep": True, "sweep_params": "--experimental-rerun=/tmp/x.pickle"},
             "sweep_params '--experimental-rerun=/tmp/x.pickle': a key is a config key, not a command-line flag"),
            ({"sweep": True, "sweep_params": "seed=1,2", "launcher": "../../x"},
             "launcher='../../x': choose one of ['basic', 'local', 'slurm']"),
            ({"sweep": True, "sweep_params": "seed='1"}, "sweep_params: No closing quotation")]
        for extra, said in refusals:
            r = httpx.post(url + "/api/launch", json={**body, **extra}, headers=auth, timeout=120)
            detail = r.json()["detail"]
            assert r.status_code == 400 and (detail.startswith(said) or detail.startswith("not launched: " + said)), (extra, detail)
        assert _launches(url, token) == []
        launched = launch(confirm_imports=["os.path.join"]).json()
        assert launched["status"] == "running" and f"{ts}.reward_fn=os.path.join" in launched["command"]
    finally:
        _stop(proc)


@pytest.mark.slow
def test_the_compose_page_lists_foreign_imports_and_asks_before_it_launches(browser, tmp_path):  # noqa: F811
    proc, url, token = _studio(tmp_path)
    try:
        page = browser.new_page(bypass_csp=True, viewport={"width": 1400, "height": 1000})
        page.goto(proc.link)
        page.wait_for_function("document.body.dataset.composed")
        assert page.url == f"{url}/compose"  # the token left the address bar (it is in this origin's localStorage)
        assert page.is_hidden("#imports")
        for key, value in [("buffer.explorer_input.taskset.reward_fn", "os.path.join"), ("dry_run", "true")]:
            page.fill("#key-filter", key)
            page.fill(f'[data-key="{key}"]', value) if key != "dry_run" else page.select_option(f'[data-key="{key}"]', value)
        page.wait_for_function("!document.querySelector('#imports').hidden")
        assert page.inner_text("#imports li") == "os.path.join (buffer.explorer_input.taskset.reward_fn)"
        asked = []
        answer = {"accept": False}
        page.on("dialog", lambda d: (asked.append(d.message), d.accept() if answer["accept"] else d.dismiss()))
        page.click("#launch")
        page.wait_for_function("document.querySelector('#launch-status').dataset.status == 'refused'")
        assert len(asked) == 1 and "os.path.join  (buffer.explorer_input.taskset.reward_fn)" in asked[0]
        assert page.text_content("#launch-status").startswith("not launched: it imports from outside rft")
        assert _launches(url, token) == []
        answer["accept"] = True
        page.click("#launch")
        page.wait_for_function("['running', 'finished'].includes(document.querySelector('#launch-status').dataset.status)")
        assert len(asked) == 2 and [launch["id"] for launch in _launches(url, token)] == [1]
        from test_studio import _shot

        _shot(page, "compose-imports")
    finally:
        _stop(proc)


@pytest.mark.slow
def test_half_sent_requests_cannot_lock_the_studio_out(tmp_path):
    """Measured before: any local user (no token needed) held 1010 connections whose request head
    never ended, still open after 15 s; the studio's 1024 files were then spent and its own page's
    requests were reset. Now, as the servers (rft.serving.auth): each request has --request-timeout
    seconds to arrive whole, and beyond --max-connections requests are answered 503."""
    import socket

    import httpx

    proc, url, token = _studio(tmp_path, args=("--request-timeout", "1", "--max-connections", "8"))
    try:
        port = int(url.rsplit(":", 1)[1])
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
        for s in held:
            s.sendall(b"GET /api/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        time.sleep(0.2)
        auth = {"Authorization": f"Bearer {token}"}
        # 20 held, 8 allowed: the oldest without the token gives its slot up to the request with it
        # (rft.serving.auth; tests/test_secrets.py); the rest are dropped at their deadline
        assert httpx.get(url + "/api/runs", headers=auth).status_code == 200
        for s in held:
            s.settimeout(3)  # each dropped after ~1 s: recv returns at the close
            assert s.recv(100) == b""  # closed by the studio
            s.close()
        assert httpx.get(url + "/api/runs", headers=auth).status_code == 200
    finally:
        _stop(proc)
    r = subprocess.run([sys.executable, "-m", "rft.studio", "--max-connections", "0"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "argument --max-connections: 0 must be > 0" in r.stderr


@pytest.mark.slow
def test_the_token_is_never_on_the_command_line(tmp_path):
    import subprocess
    import sys

    def studio(*args, **env):
        return subprocess.run([sys.executable, "-m", "rft.studio", "--port", "0", "--root", str(tmp_path), *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=60, env={**os.environ, **env})

    r = studio("--token", "a-token-anyone-can-read-in-ps")
    assert r.returncode == 1 and r.stderr.strip() == (
        "rft.studio: --token is refused: a command line is visible to every local user (ps). Put the token in a file "
        "only you can read and pass --token-file FILE, or set $RFT_STUDIO_TOKEN.")
    r = studio(RFT_STUDIO_TOKEN="short")
    assert r.returncode == 1 and "shorter than 16 characters" in r.stderr
    r = studio("--token-file", str(tmp_path / "missing"))
    assert r.returncode == 1 and r.stderr.strip() == f"rft.studio: --token-file {tmp_path / 'missing'}: cannot read it (No such file or directory)."
    f = tmp_path / "token"
    f.write_text("a-token-from-a-file-0123\n")
    f.chmod(0o600)
    proc, url, token = _studio(tmp_path, args=("--token-file", str(f)))
    try:
        assert token == "a-token-from-a-file-0123" and "WARNING" not in proc.said
    finally:
        _stop(proc)


@pytest.mark.slow
def test_what_a_run_directory_holds_is_shown_as_text_never_run_as_script(browser, tmp_path):  # noqa: F811
    """A run directory is data (one copied from elsewhere included): a script in it, run by the page,
    could read the token and drive the studio."""
    from test_studio import _fake_run

    run = _fake_run(tmp_path, "rft/r", [{"step": 1, "eval/accuracy": 0.1}])
    d = run / "grpo" / "eval_trajectories" / "step_4"
    d.mkdir(parents=True)
    evil = '<img src=x onerror="window.pwned = 1">'
    # where text may stand (a reward must be a number: a text one is a 400, test_rollouts_of_the_wrong_
    # shape...): the conversation, as a model or a copied file may write it, and a reward part's name
    (d / "set.jsonl").write_text(json.dumps({"task_id": "0", "reward": 0.5, "reward_parts": {evil: 1.0},
                                             "messages": [{"role": "user", "content": evil},
                                                          {"role": "assistant", "content": evil}]}) + "\n")
    proc, url, token = _studio(tmp_path)
    try:
        page = browser.new_page()
        page.goto(f"{url}/rollouts?run=rft/r#token={token}")
        page.wait_for_selector("#rollouts tbody tr")
        page.wait_for_load_state("networkidle")
        assert page.evaluate("window.pwned") is None
        assert page.inner_text("#rollouts tbody td.reward") == "0.5"
        text = page.inner_text("#rollouts tbody")
        assert f"{evil}=1" in text and text.count(evil) >= 2, text
    finally:
        _stop(proc)


def test_eval_trajectories_of_any_shape_are_a_400_naming_the_line_or_shown_as_text(tmp_path, monkeypatch):
    from rft.studio import rollouts as R

    d = tmp_path / "grpo" / "eval_trajectories" / "step_1"
    d.mkdir(parents=True)
    source = "grpo/eval_trajectories/step_1/set.jsonl"
    # a message's content as a list of parts (multimodal, or a tool's answer) is shown as its JSON
    parts = [{"type": "text", "text": "hi"}]
    (d / "set.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": parts},
                                                          {"role": "assistant", "content": "ok"}]}) + "\n")
    row = R.read(tmp_path, source)["rows"][0]
    assert (row["prompt"], row["response"]) == (json.dumps(parts), "ok")
    # a line that is not an object, or not JSON: a ValueError (the page's 400) naming the file and line;
    # before, an AttributeError (a 500) for the first two
    for line, said in [("[1]", "a JSON list, not an object"), ('"x"', "a JSON str, not an object"),
                       ("{oops", "not JSON (Expecting property name enclosed in double quotes)")]:
        (d / "set.jsonl").write_text('{"messages": []}\n' + line + "\n")
        with pytest.raises(ValueError) as e:
            R.read(tmp_path, source)
        assert str(e.value) == f"{source}, line 2: {said}; each line is one conversation, a JSON object."
    # as for stored experiences, the first MAX_ROWS rows are read (it read every line: 1.2 GB of
    # them was 1.2 GB and more in the studio), and the rest counted
    monkeypatch.setattr(R, "MAX_ROWS", 3)
    (d / "set.jsonl").write_text("".join(json.dumps({"reward": r, "messages": []}) + "\n" for r in range(5)) + "[1]\n")
    got = R.read(tmp_path, source, min_reward=1)
    assert ([r["reward"] for r in got["rows"]], got["matched"], got["read"], got["total"]) == ([1, 2], 2, 3, 6)


@pytest.mark.slow
def test_rollout_filters_that_are_not_numbers_are_a_400_naming_them(tmp_path):
    import httpx
    from test_studio import _sql_buffer

    _sql_buffer(tmp_path / "rft" / "r")
    proc, url, token = _studio(tmp_path)
    try:
        def rows(**params):
            return httpx.get(url + "/api/rollouts", params={"run": "rft/r", "source": "grpo/buffer.db", **params},
                             headers={"Authorization": f"Bearer {token}"})

        assert rows(min_reward="0.5").json()["matched"] == 4  # rewards 0, 0.5, 1, 1, 1: four at or above 0.5
        for params, said in [({"min_reward": "x"}, "reward from: 'x' is not a number"),
                             ({"max_reward": "nan"}, "reward to: 'nan' is not a number"),  # it would keep every row
                             ({"step": "1.5"}, "version / step: '1.5' is not a whole number"),
                             ({"limit": "0"}, "limit=0: give 1 to 5000 rows.")]:
            r = rows(**params)
            assert r.status_code == 400 and r.json()["detail"].startswith(said), (params, r.text)
        assert rows(run="../..").json()["detail"] == "'../..' is not under the checkpoint root"
    finally:
        _stop(proc)


@pytest.mark.slow
def test_the_pages_work_under_their_content_security_policy(browser, tmp_path):  # noqa: F811
    """No bypass here: the pages' own scripts and plotly run with only 'self' scripts allowed."""
    from test_studio import _fake_run

    _fake_run(tmp_path, "rft/a", [{"step": 1, "eval/accuracy": 0.1}, {"step": 2, "eval/accuracy": 0.5}])
    proc, url, token = _studio(tmp_path)
    try:
        page = browser.new_page()
        blocked = []
        page.on("console", lambda m: blocked.append(m.text) if "Content Security Policy" in m.text else None)
        page.goto(proc.link)

        def until(expression: str):  # page.evaluate runs outside the page's CSP, unlike wait_for_function
            deadline = time.time() + 60
            while not page.evaluate(expression) and time.time() < deadline:
                time.sleep(0.2)
            return page.evaluate(expression)

        assert until("document.body.dataset.composed") and "tasks per step" in page.text_content("#plan")
        page.goto(f"{url}/runs")  # the token is kept in this origin's localStorage
        page.wait_for_selector('[data-pick="rft/a"]')
        page.check('[data-pick="rft/a"]')
        assert until("(document.getElementById('chart')?.data || []).map(t => Array.from(t.y).join(',')).join(';')") == "0.1,0.5"
        assert page.query_selector("#chart .main-svg") is not None and blocked == []  # plotly drew its SVG
        import httpx

        csp = httpx.get(url + "/runs").headers["content-security-policy"]
        assert "script-src 'self';" in csp and "frame-ancestors 'none'" in csp
    finally:
        _stop(proc)


def test_a_launch_log_is_a_new_file_no_one_could_name_first(tmp_path):
    # its name was launch_<studio pid>_<n>.log, opened for writing: on a checkpoint root other users
    # write to, a link planted there sent the console into any file the studio's user may write
    from rft.studio.launch import Launches

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "run.py").write_text("print('hello')\n")
    logs, target = tmp_path / "logs", tmp_path / "victim.txt"
    logs.mkdir()
    target.write_text("mine")
    os.symlink(target, logs / f"launch_{os.getpid()}_1.log")
    launch = Launches(repo, logs).start([])
    launch.proc.wait(timeout=60)
    assert target.read_text() == "mine"
    assert launch.log.parent == logs and launch.log.read_text() == "hello\n"
    assert launch.log.name.startswith("launch_1_") and (launch.log.stat().st_mode & 0o777) == 0o600


def _client(root: Path):
    """The studio's app in this process (its routes and guard as served), for requests that need no run."""
    from fastapi.testclient import TestClient

    from rft.studio.app import make_app

    token = "t" * 24
    app = make_app(token, root, CONF, ROOT, hosts=frozenset({"testserver"}))
    return TestClient(app, raise_server_exceptions=False, headers={"Authorization": f"Bearer {token}"})


def test_a_damaged_metrics_log_leaves_out_its_rows_and_the_runs_table_still_answers(tmp_path):
    # a text step or a text time in one run's metrics.jsonl was a 500 for the whole runs table (its
    # sum and comparisons raised); times summing past a float's range were an infinity, not JSON
    from test_studio import _fake_run

    _fake_run(tmp_path, "rft/good", [{"step": 1, "eval/accuracy": 0.1}])
    _fake_run(tmp_path, "rft/bad", [{"step": "x", "eval/accuracy": 0.9}, {"step": True},
                                    {"step": 1, "eval/accuracy": "high", "timing/step_s": "slow"},
                                    {"step": 2, "eval/accuracy": 0.5, "timing/step_s": 2.5}, {"step": 3, "timing/step_s": 1.5}])
    _fake_run(tmp_path, "rft/huge", [{"step": 1, "timing/step_s": 1e308}, {"step": 2, "timing/step_s": 1e308}])
    client = _client(tmp_path)
    r = client.get("/api/runs")
    assert r.status_code == 200, r.text
    rows = {row["id"]: row for row in r.json()["runs"]}
    # the rows with steps 1-3 are read; the text values are no values: the last eval 0.5, 2.5 + 1.5 s trained
    assert [rows["rft/bad"][k] for k in ("steps", "last_eval", "train_s")] == [3, 0.5, 4.0]
    assert rows["rft/huge"]["train_s"] is None  # 1e308 + 1e308 is inf: no time rather than a 500
    curves = client.get("/api/curves", params={"run": "rft/bad", "metric": "eval/accuracy"}).json()
    assert [(c["step"], c["y"]) for c in curves] == [([2], [0.5])]
    dash = client.get("/api/dashboard", params=[("run", "rft/bad"), ("run", "rft/huge")])
    assert dash.status_code == 200, dash.text
    bad, huge = dash.json()["runs"]
    assert (bad["step"], bad["time"], huge["time"]) == ([1, 2, 3], [0.0, 2.5, 4.0], [1e308, None])
    assert client.get("/api/sweep", params={"sweep": "rft"}).status_code == 200


def test_rollouts_of_the_wrong_shape_are_a_400_naming_the_row_and_a_nan_reward_is_shown(tmp_path):
    # each of these was a 500 (a TypeError or AttributeError in the rows or the groups view), and a
    # NaN reward (a reward model's overflow, stored as NaN) one for the whole page: JSON has no NaN
    from test_studio import _fake_run

    run = _fake_run(tmp_path, "rft/r", [{"step": 1}])
    evals = run / "grpo" / "eval_trajectories" / "step_1"
    evals.mkdir(parents=True)
    client = _client(tmp_path)

    def answers(source: str) -> list:
        return [client.get(path, params={"run": "rft/r", "source": source})
                for path in ("/api/rollouts", "/api/rollouts/groups")]

    damaged = "the file is damaged or was not written by rft."
    for row, said in [({"group_id": {}}, "group_id is an object ({}), not a string"),
                      ({"messages": 5}, "messages is a whole number (5), not a list"),
                      ({"task_id": [1]}, "task_id is a list ([1]), not a string"),
                      ({"reward": "high"}, 'reward is a string ("high"), not a number')]:
        (evals / "set.jsonl").write_text('{"messages": []}\n' + json.dumps(row) + "\n")
        for r in answers("grpo/eval_trajectories/step_1/set.jsonl"):
            assert r.status_code == 400 and r.json()["detail"] == (
                f"grpo/eval_trajectories/step_1/set.jsonl, line 2: {said}; {damaged}"), (row, r.text)
    stored = {"tokens": [1, 2], "prompt_length": 1, "logprobs": [0.0]}
    unread = ": a stored experience does not read (ValueError: "  # rft.data.experience.Experience.from_dict's check
    for row, said in [({**stored, "tokens": 5}, unread + "tokens is not a non-empty list of token ids (whole numbers))"),
                      ({**stored, "info": [1]}, ", experience 0: info is a list ([1]), not an object"),
                      ({**stored, "loss_mask": ["1"]}, unread + "loss_mask is not a list of whole numbers)"),
                      ({"tokens": [1]}, ": a stored experience does not read (TypeError: Experience.__init__() missing 2 "
                                        "required positional arguments: 'prompt_length' and 'logprobs')")]:
        (run / "grpo" / "experiences.jsonl").write_text(json.dumps(row) + "\n")
        for r in answers("grpo/experiences.jsonl"):
            assert r.status_code == 400 and r.json()["detail"] == f"grpo/experiences.jsonl{said}; {damaged}", (row, r.text)
    (evals / "set.jsonl").write_text("".join(json.dumps({"task_id": "t/0", "group_id": "g", "reward": r, "messages": []}) + "\n"
                                             for r in (float("nan"), 1.0)))
    rows, groups = answers("grpo/eval_trajectories/step_1/set.jsonl")
    assert [x["reward"] for x in rows.json()["rows"]] == ["nan", 1.0]
    assert groups.json()["groups"][0]["mean"] == "nan"  # (nan + 1) / 2, shown as the text nan
