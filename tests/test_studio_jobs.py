"""The studio's jobs panel in Debian's headless Chromium (one studio and browser per module, then a
second studio on the same root): every launch listed with its status, console, stop and run;
kept after a reload and after the studio restarts; a launch checked as run.py would check it (a
run of the same name made with another configuration; every job of a sweep planned); a stopped
run reads "stopped" and a run that has not logged yet "starting" on the runs page.
"""

import json
import time
from pathlib import Path

import pytest
from test_studio import ARTIFACTS, _set_key, _shot, _stop, _studio
from test_studio_pages import _cells, chromium  # noqa: F401  (a module fixture)

pytestmark = pytest.mark.slow

LONG = [("stages", "[]"), ("buffer.total_steps", "100000"), ("explorer.eval_interval", "1000"), ("name", "long")]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("studio_jobs")


@pytest.fixture(scope="module")
def studio(root):
    proc, url, token = _studio(root)
    yield proc, url, token
    _stop(proc)


def _compose(chromium, url, token, keys, groups=()):  # noqa: F811
    page = chromium.new_page(bypass_csp=True, viewport={"width": 1400, "height": 1000})
    page.goto(f"{url}/compose#token={token}")
    page.wait_for_function("document.body.dataset.composed")
    for group, option in groups:
        page.select_option(f"#group-{group}", option)
    for key, value in keys:
        if key == "dry_run":  # a boolean: a menu
            page.fill("#key-filter", key)
            page.select_option('[data-key="dry_run"]', value)
        else:
            _set_key(page, key, value)
    return page


def _jobs(page) -> list[list[str]]:
    """The jobs panel's rows: [#, command, status, started, run]."""
    return page.eval_on_selector_all("#jobs tbody tr", "trs => trs.map(t => [...t.children].slice(0, 5).map(c => c.textContent))")


def test_every_launch_is_listed_with_its_console_stop_and_run_and_stays_after_a_restart(chromium, studio, root):  # noqa: F811
    proc, url, token = studio
    page = _compose(chromium, url, token, [("dry_run", "true"), ("name", "planned")])
    page.wait_for_function("document.querySelector('#command').textContent.includes('name=planned')")
    page.click("#launch")
    page.wait_for_function("document.querySelector('#launch-status').dataset.status == 'finished'", timeout=60000)
    assert "batch plan: stage grpo" in page.text_content("#console")
    # a second launch: a run that trains, on the page beside the first
    page.close()
    page = _compose(chromium, url, token, LONG, [("cluster", "inline"), ("monitor", "console")])
    page.wait_for_function("document.querySelector('#command').textContent.includes('name=long')")
    page.click("#launch")
    page.wait_for_function("document.querySelectorAll('#jobs tbody tr').length == 2")
    rows = _jobs(page)
    assert [r[0] for r in rows] == ["2", "1"] and rows[1][2] == "finished" and rows[0][2] == "running", rows
    assert rows[0][1].startswith("python run.py cluster=inline monitor=console 'stages=[]'") and rows[0][4] == "rft/long"
    # the runs page: the run reads "starting" until it logs, then "running"
    runs = chromium.new_page(bypass_csp=True, viewport={"width": 1400, "height": 1000})
    runs.goto(f"{url}/runs#token={token}")
    runs.wait_for_selector('tr[data-run="rft/long"]', timeout=120000)
    seen = {_cells(runs, "rft/long")["status"]}
    metrics = root / "rft" / "long" / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3) and time.time() < deadline:
        seen.add(_cells(runs, "rft/long")["status"])
        time.sleep(0.2)
    runs.wait_for_function("document.querySelector('tr[data-run=\"rft/long\"] td.status').textContent == 'running'")
    assert seen <= {"starting", "running"} and "starting" in seen, seen
    # stop it from its row: stopped in the panel and on the runs page
    page.click('#jobs button[data-stop="2"]')
    page.wait_for_function("document.querySelector('#jobs tr[data-job=\"2\"] td.status').textContent == 'stopped'", timeout=60000)
    runs.wait_for_function("document.querySelector('tr[data-run=\"rft/long\"] td.status').textContent == 'stopped'")
    steps = max(json.loads(line)["step"] for line in metrics.read_text().splitlines())
    assert _cells(runs, "rft/long")["steps"] == str(steps)
    _shot(page, "jobs")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.locator("#jobs").screenshot(path=str(ARTIFACTS / "jobs-panel.png"))
    # the first job's console again, from its row
    page.click('#jobs button[data-show="1"]')
    page.wait_for_function("document.querySelector('#console').textContent.includes('batch plan')")
    # a reload lists both, as they ended
    page.reload()
    page.wait_for_function("document.querySelectorAll('#jobs tbody tr').length == 2")
    page.wait_for_function("document.querySelector('#jobs tr[data-job=\"1\"] td.status').textContent == 'finished'")
    assert [r[2] for r in _jobs(page)] == ["stopped", "finished"]
    # a restarted studio on the same root: the same two, their consoles still readable
    again, url2, token2 = _studio(root)
    try:
        page.goto(f"{url2}/runs#token={token2}")
        page.wait_for_function("document.querySelectorAll('#jobs tbody tr').length == 2")
        assert [(r[0], r[2], r[4]) for r in _jobs(page)] == [("2", "stopped", "rft/long"), ("1", "finished", "")]
        page.click('#jobs button[data-show="1"]')
        page.wait_for_function("document.querySelector('#console').textContent.includes('batch plan: stage grpo')")
    finally:
        _stop(again)


def test_a_launch_is_checked_as_run_py_would_check_it(chromium, studio, root):  # noqa: F811
    proc, url, token = studio
    if not (root / "rft" / "long" / ".hydra").is_dir():
        pytest.skip("needs the run the test before left on disk")
    # the same name, another configuration: run.py would stop on the run on disk; the page says so first
    page = _compose(chromium, url, token, [*LONG, ("algorithm.optimizer.lr", "0.001")], [("cluster", "inline"), ("monitor", "console")])
    page.wait_for_function("!document.querySelector('#error').hidden", timeout=60000)
    error = page.text_content("#error")
    assert "holds a run made with another configuration (stage " in error and "algorithm.optimizer.lr: 0.0002 -> 0.001" in error
    page.click("#launch")
    page.wait_for_function("document.querySelector('#launch-status').dataset.status == 'refused'")
    assert page.text_content("#launch-refused").startswith(f"not launched: the run directory {root / 'rft' / 'long'} holds a run")
    # a sweep: the command shows -m and the values; each job planned before it starts
    page.close()
    page = _compose(chromium, url, token, [("name", "swept"), ("dry_run", "true")])
    page.check("#sweep")
    page.fill("#sweep-params", "buffer.batch_size=0,8")
    page.wait_for_function("document.querySelector('#command').textContent.includes('-m')")
    assert page.text_content("#command") == "python run.py -m name=swept dry_run=true buffer.batch_size=0,8"
    page.click("#launch")
    page.wait_for_function("document.querySelector('#launch-status').dataset.status == 'refused'", timeout=60000)
    assert page.text_content("#launch-refused") == (
        "not launched: job 0 of the sweep (buffer.batch_size=0): stage grpo: buffer.batch_size=0 must be >= 1 "
        "(tasks per step). No job has started: every job is planned first.")
    assert len(_jobs(page)) == 2  # nothing launched
