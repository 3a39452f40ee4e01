"""The studio's runs, compose and rollouts pages in Debian's headless Chromium, against one studio
over a checkpoint root of hand-written runs (module fixtures: one studio, one browser): the runs
table's values against the runs' files, kept in place as it refreshes, its columns, search, sort,
filter, grouping, config diff and CSV export; a bench run's table; the curves' legend, names and
stages; the layout at 390 px; the compose page's group menus and tab order; the rollouts filter
and paging, a GRPO group side by side opened from a curve's point; the static files. Names and
values from a run's files are data: never markup.
"""

import csv
import io
import json
import os
import socket
from pathlib import Path

import httpx
import pytest
import yaml
from test_studio import CHROMIUM, _fake_run, _set_key, _shot, _stop, _studio, _two_stage_run

pytestmark = pytest.mark.slow

XSS = "<img src=x onerror=window.pwned=1>"
FORMULA = '=HYPERLINK("http://example.com")'


def _run_with_config(root: Path, rel: str, metrics: list[dict], overrides: list[str], total: int) -> Path:
    run = _fake_run(root, rel, metrics, overrides)
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"stages": [{"stage_name": "grpo", "buffer": {"total_steps": total}}]}))
    return run


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("studio_pages")
    lr = "algorithm.optimizer.lr"
    _run_with_config(root, "rft/a", [{"step": 1, "eval/accuracy": 0.1, "timing/step_s": 1.5},
                                     {"step": 2, "eval/accuracy": 0.5, "timing/step_s": 1.25}], [f"{lr}=1e-3", "seed=1"], 2)
    _run_with_config(root, "rft/b", [{"step": 1, "eval/accuracy": 0.2}, {"step": 2, "eval/accuracy": 0.3}],
                     [f"{lr}=1e-3", "seed=2"], 2)
    _run_with_config(root, "rft/c", [{"step": 1, "eval/accuracy": 0.7}, {"step": 3, "eval/accuracy": 0.75}],
                     [f"{lr}=3e-3", "seed=1", f"trainer.tag={FORMULA}"], 3)
    # stopped at step 2 of 10, its process gone: failed
    failed = _run_with_config(root, "rft/failed", [{"step": 2, "eval/accuracy": 0.25}], [f"{lr}=3e-3", "seed=2"], 10)
    (failed / ".run.lock").write_text(f"pid 999999999 on {socket.gethostname()}\n")
    # its lock held by a live process (this one), no metrics yet: starting
    starting = root / "rft" / "starting"
    (starting / ".hydra").mkdir(parents=True)
    (starting / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"{lr}=1e-4", "seed=1"]))
    (starting / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"stages": [{"stage_name": "grpo"}]}))
    (starting / ".run.lock").write_text(f"pid {os.getpid()} on {socket.gethostname()}\n")
    _fake_run(root, f"rft/{XSS}", [{"step": 1, "eval/accuracy": 0.0}], [f"seed={XSS}"])
    _two_stage_run(root, "rft/two")
    bench = _fake_run(root, "rft/bench_run", [{"step": 1, "eval/accuracy": 0.4}], ["mode=bench"])
    (bench / "bench").mkdir()
    (bench / "bench" / "results.csv").write_text("stage,step,eval/arith/accuracy,checkpoint\nstart,0,0.125,tiny\ngrpo,1,0.375,x/step_1\n")
    from PIL import Image

    Image.new("RGB", (40, 20), (200, 30, 30)).save(bench / "bench" / "results.png")
    return root


@pytest.fixture(scope="module")
def studio(root):
    proc, url, token = _studio(root)
    yield url, token
    _stop(proc)


@pytest.fixture(scope="module")
def chromium():
    if not Path(CHROMIUM).exists():
        if os.environ.get("RFT_REQUIRE_BROWSER"):
            pytest.fail(f"{CHROMIUM} is missing (RFT_REQUIRE_BROWSER=1): apt-get install chromium")
        pytest.skip("no Chromium here: apt-get install chromium (make test does, as root)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu", "--no-first-run",
                                                              "--disable-background-networking", "--disable-sync"])
        yield b
        b.close()


def _open(chromium, studio, path, width=1400, height=1000):
    url, token = studio
    page = chromium.new_page(bypass_csp=True, viewport={"width": width, "height": height})
    page.goto(f"{url}{path}#token={token}")
    return page


def _cells(page, run: str) -> dict:
    """The runs table's row of `run`: {column: text}."""
    return page.evaluate("""run => {
        const tr = [...document.querySelectorAll('#runs tbody tr[data-run]')].find(t => t.dataset.run === run);
        return Object.fromEntries([...tr.querySelectorAll('td[data-col]')].map(td => [td.dataset.col, td.textContent]));
    }""", run)


def _shown(page) -> list[str]:
    return page.evaluate("[...document.querySelectorAll('#runs tbody tr[data-run]')].filter(t => !t.hidden).map(t => t.dataset.run)")


def test_the_runs_table_shows_the_files_values_and_keeps_its_rows_and_focus(chromium, studio):
    page = _open(chromium, studio, "/runs")
    page.wait_for_function("document.querySelectorAll('#runs tbody tr[data-run]').length == 8")
    a = _cells(page, "rft/a")
    # the files: last step 2, last eval 0.5 (no trailing zeros), 1.5 + 1.25 = 2.75 s of steps, its 2 of 2 steps: done
    assert (a["status"], a["steps"], a["last_eval"], a["train_s"], a["stage"]) == ("done", "2", "0.5", "2.75", "grpo")
    # the overrides that differ between the runs are columns
    assert (a["p:algorithm.optimizer.lr"], a["p:seed"]) == ("1e-3", "1")
    assert _cells(page, "rft/c")["p:trainer.tag"] == FORMULA
    assert (_cells(page, "rft/failed")["status"], _cells(page, "rft/starting")["status"]) == ("failed", "starting")
    assert page.get_attribute('tr[data-run="rft/failed"] td.status', "title") == "incomplete (2/10 steps)"
    # a run's name and values are text, never markup
    assert page.evaluate("window.pwned") is None and _cells(page, f"rft/{XSS}")["id"] == f"rft/{XSS}"
    # the table refreshes every 2 s in place: the same row elements, the focus kept
    page.focus('[data-pick="rft/b"]')
    page.evaluate("document.querySelector('tr[data-run=\"rft/b\"]').mark = 1")
    # two refreshes drawn (runs.render counted), not a fixed 4.5 s: a page that stopped refreshing fails here
    page.evaluate("(() => { const draw = runs.render; window.drawn = 0; "
                  "runs.render = function (...a) { const out = draw.apply(this, a); window.drawn++; return out; }; })()")
    page.wait_for_function("window.drawn >= 2", timeout=15000)
    assert page.evaluate("document.activeElement.dataset.pick") == "rft/b"
    assert page.evaluate("document.querySelector('tr[data-run=\"rft/b\"]').mark") == 1
    # search, status filter, sort, grouping
    page.fill("#run-search", "3e-3")
    page.wait_for_function("document.querySelector('#runs-count').textContent.includes('2 shown')")
    assert sorted(_shown(page)) == ["rft/c", "rft/failed"]
    page.fill("#run-search", "")
    page.select_option("#status-filter", "starting")
    assert _shown(page) == ["rft/starting"]
    page.select_option("#status-filter", "")
    page.click('button[data-sort="last_eval"]')  # ascending; runs without an eval last
    evals = [_cells(page, r)["last_eval"] for r in _shown(page)]
    assert evals == ["0", "0.25", "0.3", "0.4", "0.5", "0.75", "0.9", ""], evals  # two's: its GRPO's last, 0.9
    page.check("#group-config")
    groups = page.eval_on_selector_all("#runs tr.config-group", "trs => trs.map(t => t.textContent)")
    assert "algorithm.optimizer.lr=1e-3: 2 runs, 2 done" in groups, groups
    # a configuration's row spans the table
    assert page.evaluate("(t => t.querySelector('tr.config-group td').offsetWidth >= t.querySelector('tbody tr[data-run]').offsetWidth - 2)"
                         "(document.querySelector('#runs'))")
    _shot(page, "runs-table")


def test_csv_export_escapes_formulas_and_a_config_diff_lists_the_keys_that_differ(chromium, studio):
    url, token = studio
    r = httpx.get(url + "/api/runs.csv", headers={"Authorization": f"Bearer {token}"})
    assert r.headers["content-disposition"] == 'attachment; filename="runs.csv"'
    rows = {row["id"]: row for row in csv.DictReader(io.StringIO(r.text))}
    # a cell a spreadsheet would run as a formula gets a leading '; a number stays a number
    assert rows["rft/c"]["trainer.tag"] == "'" + FORMULA and rows["rft/c"]["last_eval"] == "0.75"
    assert (rows["rft/a"]["status"], rows["rft/a"]["steps"], rows["rft/a"]["train_s"]) == ("done", "2", "2.75")
    assert httpx.get(url + "/api/runs.csv").status_code == 401
    page = _open(chromium, studio, "/runs")
    page.wait_for_selector('[data-pick="rft/c"]')
    page.check('[data-pick="rft/a"]')
    page.check('[data-pick="rft/c"]')
    page.click("#diff-runs")
    page.wait_for_selector("#table-diff tbody tr")
    diff = page.eval_on_selector_all("#table-diff tbody tr", "trs => trs.map(t => [...t.children].map(c => c.textContent))")
    # the two configs differ in the stage's total steps only (2 and 3)
    assert diff == [["stages[0].buffer.total_steps", "2", "3"]]
    with page.expect_download() as download:
        page.click("#export-csv")
    got = list(csv.DictReader(io.StringIO(Path(download.value.path()).read_bytes().decode())))
    # the same rows (a run that is starting has a wall time that grows between the two)
    assert [{k: v for k, v in row.items() if k != "duration_s"} for row in got] == \
        [{k: v for k, v in row.items() if k != "duration_s"} for row in rows.values()]


def test_a_bench_run_shows_its_table_and_plot(chromium, studio):
    page = _open(chromium, studio, "/runs")
    page.click('button[data-bench="rft/bench_run"]')
    page.wait_for_selector("#table-bench tbody tr")
    rows = page.eval_on_selector_all("#table-bench tbody tr", "trs => trs.map(t => [...t.children].map(c => c.textContent))")
    assert rows == [["start", "0", "0.125", "tiny"], ["grpo", "1", "0.375", "x/step_1"]]  # bench/results.csv
    assert page.evaluate("[document.querySelector('#bench img').naturalWidth, document.querySelector('#bench img').naturalHeight]") == [40, 20]


def test_curves_name_each_run_by_what_tells_it_apart_and_put_every_stage_after_the_one_before(chromium, studio):
    page = _open(chromium, studio, "/runs?run=rft/two&run=rft/a")
    page.wait_for_function("(document.getElementById('chart')?.data || []).length == 2")
    page.select_option("#stage", "all")
    page.wait_for_function("(document.getElementById('chart')?.data || []).length == 3")
    traces = page.evaluate("document.getElementById('chart').data.map(t => [t.name, Array.from(t.x), Array.from(t.customdata)])")
    # two's warm-up logged steps 0 and 2; its GRPO's steps 0 and 2 come after: at 2 and 4
    assert traces == [["two (sft_warmup)", [0, 2], [0, 2]], ["two (grpo)", [2, 4], [0, 2]], ["a (grpo)", [1, 2], [1, 2]]]
    layout = page.evaluate("(({hoverlabel, shapes}) => [hoverlabel.namelength, shapes.map(s => s.x0)])(document.getElementById('chart').layout)")
    assert layout == [-1, [2]]  # whole names on hover; a line where two's GRPO starts
    assert page.get_attribute("#to-dashboard", "href") == "/dashboard?run=rft%2Ftwo&run=rft%2Fa"
    legend = page.eval_on_selector("#chart .legend", "e => e.getBoundingClientRect().toJSON()")
    title = page.eval_on_selector("#chart .g-xtitle", "e => e.getBoundingClientRect().toJSON()")
    apart = (legend["left"] >= title["right"] or legend["right"] <= title["left"] or
             legend["top"] >= title["bottom"] or legend["bottom"] <= title["top"])
    assert apart, (legend, title)
    _shot(page, "runs-every-stage")


def test_at_390_px_the_pages_fit_and_tables_scroll_in_their_own_box(chromium, studio):
    ready = {"/runs": "#runs tbody tr", "/compose": "body[data-composed]", "/rollouts": "#run option",
             "/dashboard?run=rft/a&open=eval": ".panel .main-svg"}
    for path, selector in ready.items():
        page = _open(chromium, studio, path, 390, 844)
        page.wait_for_selector(selector, state="attached")
        page.wait_for_timeout(500)
        assert page.get_attribute('meta[name="viewport"]', "content") == "width=device-width, initial-scale=1"
        assert page.evaluate("document.documentElement.scrollWidth") <= 390, path
        if path == "/runs":
            box = page.evaluate("(e => [e.scrollWidth, e.clientWidth])(document.querySelector('#runs').parentElement)")
            assert box[0] > box[1] and box[1] <= 390, box
            _shot(page, "runs-390px")


def test_choosing_an_experiment_sets_the_group_menus_and_launch_is_few_tabs_away(chromium, studio):
    url, token = studio
    page = _open(chromium, studio, "/compose")
    page.wait_for_function("document.body.dataset.composed")
    page.select_option("#group-experiment", "calculator_tool")
    said = httpx.post(url + "/api/compose", json={"choices": {"experiment": "calculator_tool"}, "keys": {}},
                      headers={"Authorization": f"Bearer {token}"}, timeout=120).json()["choices"]
    page.wait_for_function(f"document.querySelector('#group-model').value == {json.dumps(said['model'])}", timeout=60000)
    shown = page.evaluate("Object.fromEntries([...document.querySelectorAll('select[data-group]')].map(s => [s.dataset.group, s.value]))")
    assert shown == said and said["model"] != "tiny", said
    # from the top of the page to the launch button with Tab
    page.evaluate("document.activeElement.blur()")
    for presses in range(1, 80):
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.id") == "launch":
            break
    assert presses <= 45, presses


def test_the_static_files_a_favicon_and_plotly_gzipped_and_cached(studio):
    url, _ = studio
    icon = httpx.get(url + "/favicon.ico")
    assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml" and b"<svg" in icon.content
    r = httpx.get(url + "/static/plotly.min.js", headers={"Accept-Encoding": "gzip"})
    assert r.headers["content-encoding"] == "gzip" and r.headers["cache-control"] == "max-age=86400"
    assert int(r.headers["content-length"]) < len(r.content) / 2  # 4.8 MB as 1.4 MB
    again = httpx.get(url + "/static/plotly.min.js", headers={"If-None-Match": r.headers["etag"]})
    assert again.status_code == 304 and not again.content


def _buffer_of(run: Path, n: int) -> None:
    """n experiences, rewards k/4 for k = 0..3 in turn, policy versions 1 + k // 100."""
    from omegaconf import OmegaConf

    from rft.config import ExperienceBufferConfig
    from rft.data.buffer import SQLBuffer
    from rft.data.experience import Experience

    (run / "grpo").mkdir(parents=True, exist_ok=True)
    buf = SQLBuffer(OmegaConf.structured(ExperienceBufferConfig(storage_type="sql", path=str(run / "grpo" / "buffer.db"))))
    buf.put([Experience(tokens=[1, 2, 3], prompt_length=2, logprobs=[-0.1], reward=(k % 4) / 4, task_id=f"t{k}",
                        policy_version=1 + k // 100, info={"prompt": f"p{k}", "response": f"r{k}"}) for k in range(n)])


def test_rollouts_say_what_is_wrong_with_a_filter_apply_it_on_enter_and_page_beyond_200(chromium, studio, root):
    _buffer_of(_fake_run(root, "rft/many", [{"step": 1}]), 260)
    page = _open(chromium, studio, "/rollouts?run=rft/many")
    page.wait_for_selector("#rollouts tbody tr")
    assert page.text_content("#rollout-count") == "260 of 260 match; 1-50 shown"
    page.fill("#min-reward", "abc")
    page.press("#min-reward", "Enter")
    page.wait_for_function("document.querySelector('#rollout-count').className == 'error'")
    assert page.text_content("#rollout-count") == "reward from: 'abc' is not a number; leave it empty for no filter."
    # reward 0.75 is every 4th: k = 3, 7, ..., 259: 65 of them
    page.fill("#min-reward", "0.75")
    page.press("#min-reward", "Enter")
    page.wait_for_function("document.querySelector('#rollout-count').textContent.startsWith('65 of 260')")
    page.click("#page-next")
    page.wait_for_function("document.querySelector('#rollout-count').textContent.endsWith('51-65 shown')")
    tasks = page.eval_on_selector_all("#rollouts tbody tr td:nth-child(3)", "tds => tds.map(t => t.textContent)")
    assert tasks == [f"t{k}" for k in range(3 + 4 * 50, 260, 4)]  # the 51st to the 65th match
    page.fill("#min-reward", "")
    page.press("#min-reward", "Enter")
    page.wait_for_function("document.querySelector('#rollout-count').textContent.startsWith('260 of 260')")
    for first in range(51, 252, 50):
        page.click("#page-next")
        page.wait_for_function(f"document.querySelector('#rollout-count').textContent.endsWith('{first}-{min(first + 49, 260)} shown')")
    assert page.is_disabled("#page-next") and not page.is_disabled("#page-prev")
    _shot(page, "rollouts-paging")


def test_first_rollouts_load_decodes_only_the_rows_shown(studio, root):
    url, token = studio
    _buffer_of(_fake_run(root, "rft/thousand", [{"step": 1}]), 1024)
    r = httpx.get(url + "/api/rollouts", params={"run": "rft/thousand", "source": "grpo/buffer.db", "limit": 50,
                                                 "offset": 1000}, headers={"Authorization": f"Bearer {token}"}, timeout=60)
    # 1,024 read and matched; 50 asked from the 1,001st: the last 24
    assert (r.json()["matched"], [x["task_id"] for x in r.json()["rows"]]) == (1024, [f"t{k}" for k in range(1000, 1024)])


def _grouped_run(root: Path) -> Path:
    """A GRPO run's buffer of three groups of 4 (group id <explore step>/7/<task>): explore step 3's
    arith/0 rewards 1, 0, 0, 0.5 and arith/1 four 1s; step 4's arith/2 0, 1, 0, 1. Its metrics: a
    training step logs the rewards of the explore step before it (step 4: (0.375 + 1) / 2 = 0.6875)."""
    from omegaconf import OmegaConf

    from rft.config import ExperienceBufferConfig
    from rft.data.buffer import SQLBuffer
    from rft.data.experience import Experience

    run = _fake_run(root, "rft/groups", [{"step": 4, "reward/mean": 0.6875}, {"step": 5, "reward/mean": 0.5}])
    tasks = root / "arith.jsonl"
    tasks.write_text("".join(json.dumps({"question": f"q{i}", "answer": a}) + "\n" for i, a in enumerate(["357", XSS, "99"])))
    (run / "grpo" / "config.yaml").write_text("# fingerprint\n" + yaml.safe_dump({
        "algorithm": {"advantage_fn": "grpo", "kl_penalty_fn": "none"},
        "buffer": {"explorer_input": {"taskset": {"name": "arith", "path": str(tasks), "split": "train",
                                                  "format": {"response_key": "answer"}}}}}))
    buf = SQLBuffer(OmegaConf.structured(ExperienceBufferConfig(storage_type="sql", path=str(run / "grpo" / "buffer.db"))))
    groups = [(3, 0, [1, 0, 0, 0.5]), (3, 1, [1, 1, 1, 1]), (4, 2, [0, 1, 0, 1])]
    buf.put([Experience(tokens=[1, 2, 3], prompt_length=2, logprobs=[-0.1], reward=r, group_id=f"{s}/7/arith/{t}",
                        task_id=f"arith/{t}", policy_version=s, info={"prompt": f"q{t}", "response": f"answer {t}.{k}" + (XSS if k == 3 else "")})
             for s, t, rewards in groups for k, r in enumerate(rewards)])
    return run


# GRPO's advantages of rewards 1, 0, 0, 0.5: mean 0.375, deviations 0.625, -0.375, -0.375, 0.125,
# squares 0.390625 + 0.140625 + 0.140625 + 0.015625 = 0.6875, unbiased std sqrt(0.6875 / 3) = 0.478714,
# so A = 0.625 / 0.478714 = 1.30558, -0.375 / 0.478714 = -0.78335 (twice), 0.125 / 0.478714 = 0.26112
ADV_A = [1.30558, -0.78335, -0.78335, 0.26112]


def test_groups_api_gives_each_groups_rewards_grpo_advantages_and_reference(studio, root):
    url, token = studio
    _grouped_run(root)
    get = lambda path, **p: httpx.get(url + path, params={"run": "rft/groups", "source": "grpo/buffer.db", **p},
                                      headers={"Authorization": f"Bearer {token}"}, timeout=60)
    r = get("/api/rollouts/groups", step=3).json()
    assert (r["matched"], r["read"], r["steps"]) == (2, 12, [3, 4])
    a, b = r["groups"]
    assert (a["task_id"], a["reference"], [m["reward"] for m in a["members"]]) == ("arith/0", "357", [1, 0, 0, 0.5])
    assert [m["advantage"] for m in a["members"]] == pytest.approx(ADV_A, abs=1e-5)
    assert (a["mean"], a["std"]) == (0.375, pytest.approx(0.478714, abs=1e-6))
    assert [m["advantage"] for m in b["members"]] == [0, 0, 0, 0] and b["reference"] == XSS  # equal rewards: 0
    assert "advantage_fn=grpo, computed here" in r["advantage"] and "12" not in r["advantage"]  # step 3's 8 rollouts
    # the widest spread first; a search in the responses (any case) keeps the groups holding it
    assert [g["task_id"] for g in get("/api/rollouts/groups", sort="spread").json()["groups"]] == ["arith/2", "arith/0", "arith/1"]
    assert [g["task_id"] for g in get("/api/rollouts/groups", search="ANSWER 2.").json()["groups"]] == ["arith/2"]
    assert get("/api/rollouts/groups", sort="best").json()["detail"] == "sort='best': one of '', 'spread', 'mean_desc', 'mean_asc'."
    # the rows view: search and sort too (reward, highest first; the stored order among equals)
    rows = get("/api/rollouts", search="answer 0.", sort="reward_desc").json()["rows"]
    assert [(x["response"][:10], x["reward"]) for x in rows] == [("answer 0.0", 1), ("answer 0.3", 0.5), ("answer 0.1", 0), ("answer 0.2", 0)]
    assert httpx.get(url + "/api/rollouts/groups", params={"run": "rft/groups", "source": "grpo/buffer.db"}).status_code == 401


def test_a_reward_curves_point_opens_its_steps_groups_side_by_side(chromium, studio, root):
    if not (root / "rft" / "groups").exists():
        _grouped_run(root)
    page = _open(chromium, studio, "/runs?run=rft/groups")
    page.wait_for_function("(document.getElementById('chart')?.data || []).length == 1")
    # a real click on step 4's point (pixel from the plot's own axes); again if the page moved
    # under the pointer (the table above it refreshes every 2 s)
    for attempt in range(3):
        page.eval_on_selector("#chart", "e => e.scrollIntoView()")
        x, y = page.evaluate("""(gd => { const L = gd._fullLayout, box = gd.getBoundingClientRect();
            return [box.left + L._size.l + L.xaxis.l2p(4), box.top + L._size.t + L.yaxis.l2p(0.6875)]; })(document.getElementById('chart'))""")
        page.mouse.move(x, y)
        page.mouse.click(x, y)
        try:
            page.wait_for_url("**/rollouts?*", timeout=5000)
            break
        except Exception:
            assert attempt < 2, "the click on the curve's point did not open the rollouts"
    page.wait_for_selector("#group-list section.group-view")
    assert (page.input_value("#view"), page.input_value("#step"), page.input_value("#source")) == ("groups", "3", "grpo/buffer.db")
    cards = page.evaluate("""[...document.querySelectorAll('#group-list section')].map(s => [s.querySelector('h3').textContent,
        s.querySelector('.reference code').textContent, [...s.querySelectorAll('.member')].map(m =>
        [m.querySelector('.reward').textContent, m.querySelector('.advantage').textContent])])""")
    # the buffer's rewards; GRPO's advantages to 4 significant digits (ADV_A)
    assert cards == [["task arith/0 · explore step 3 · 4 rollouts · reward 0.375 ± 0.4787", "357",
                      [["1", "1.306"], ["0", "-0.7833"], ["0", "-0.7833"], ["0.5", "0.2611"]]],
                     ["task arith/1 · explore step 3 · 4 rollouts · reward 1 ± 0", XSS, [["1", "0"]] * 4]], cards
    assert page.evaluate("window.pwned") is None
    assert "training step 4 learned from explore step 3" in page.text_content("#group-notes")
    assert page.text_content("#rollout-count") == "2 groups of 12 rollouts match"
    # side by side: a group's four responses on one row
    tops = page.eval_on_selector_all("#group-list section:first-child .member", "ms => ms.map(m => m.getBoundingClientRect().top)")
    assert len(set(tops)) == 1, tops
    _shot(page, "rollouts-groups")
    page.select_option("#sort", "mean_desc")
    page.wait_for_function("document.querySelector('#group-list h3').textContent.startsWith('task arith/1')")


def _plot(page, metric: str) -> list:
    return page.evaluate("""m => document.querySelector(`.panel[data-metric="${m}"]`).data.map(t =>
        [t.name, Array.from(t.x), Array.from(t.y).map(v => v === null ? null : Math.round(v * 1e5) / 1e5)])""", metric)


def test_the_dashboard_draws_every_metric_by_prefix_with_seed_bands_smoothing_and_its_state_in_the_url(chromium, studio, root):
    page = _open(chromium, studio, "/dashboard?run=rft/a&run=rft/b&run=rft/two&open=eval&open=timing&bands=1")
    page.wait_for_selector('.panel[data-metric="eval/accuracy"] .main-svg')
    assert page.eval_on_selector_all("#panels details", "ds => ds.map(d => [d.dataset.prefix, d.open])") == [["eval", True], ["timing", True]]
    # a and b (lr 1e-3, seeds 1 and 2): their mean 0.15, 0.4 and std (N-1) 0.070711, 0.141421 (eval 0.1, 0.2 and
    # 0.5, 0.3); two alone, its GRPO's steps after its warm-up's: 0, 2 then 2, 4
    lo, hi, mean = (0.15 - 0.070711, 0.4 - 0.141421), (0.15 + 0.070711, 0.4 + 0.141421), (0.15, 0.4)
    got = _plot(page, "eval/accuracy")
    assert got == [["two", [0, 2, 2, 4], [0, 0.15, 0.15, 0.9]],
                   ["algorithm.optimizer.lr=1e-3 - std", [1, 2], [round(lo[0], 5), round(lo[1], 5)]],
                   ["algorithm.optimizer.lr=1e-3 + std", [1, 2], [round(hi[0], 5), round(hi[1], 5)]],
                   ["algorithm.optimizer.lr=1e-3 (mean of 2)", [1, 2], list(mean)]], got
    # two's GRPO starts at step 2: a dotted line there
    assert page.evaluate("document.querySelector('.panel[data-metric=\"eval/accuracy\"]').layout.shapes.map(s => s.x0)") == [2]
    # the runs in the list's order (newest first), a colour each
    assert page.text_content("#dash-key") == "■ two \u00a0 ■ b \u00a0 ■ a \u00a0 ■ algorithm.optimizer.lr=1e-3 (mean ± std of 2)"
    _shot(page, "dashboard")
    # a metric only a logged (timing/step_s): its own curve, no band
    assert _plot(page, "timing/step_s") == [["a", [1, 2], [1.5, 1.25]]]
    assert page.evaluate("document.querySelector('.panel[data-metric=\"timing/step_s\"]').layout.shapes") == []  # two logs none
    # smoothing 0.5, debiased: 0.1; (0.5 * 0.05 + 0.5 * 0.5) / (1 - 0.25) = 0.36667; by time: a's steps
    # took 1.5 and 1.25 s, so x = 1.5, 2.75
    page.uncheck('#dash-runs input[value="rft/b"]')
    page.uncheck('#dash-runs input[value="rft/two"]')
    page.wait_for_function("document.querySelector('#dash-status').textContent.startsWith('1 run,')")
    page.fill("#smooth", "0.5")
    page.dispatch_event("#smooth", "input")
    page.select_option("#xaxis", "time")
    assert _plot(page, "eval/accuracy") == [["rft/a", [1.5, 2.75], [0.1, 0.36667]]]  # alone: its whole name
    # the view is in the address: opened again from it, the same
    url = page.url
    assert "run=rft%2Fa&open=eval&open=timing&smooth=0.5&x=time&bands=1" in url, url
    again = _open(chromium, studio, url[len(studio[0]):])  # a browser of its own: the token in the link
    again.wait_for_selector('.panel[data-metric="eval/accuracy"] .main-svg')
    assert (again.input_value("#smooth"), again.input_value("#xaxis")) == ("0.5", "time")
    assert _plot(again, "eval/accuracy") == [["rft/a", [1.5, 2.75], [0.1, 0.36667]]]
    # a step more in a's metrics (1 s): drawn within the 5 s refresh, the panel in place
    again.evaluate("document.querySelector('.panel[data-metric=\"eval/accuracy\"]').mark = 1")
    with open(root / "rft" / "a" / "grpo" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "eval/accuracy": 0.9, "timing/step_s": 1.0}) + "\n")
    # (meanwhile, another page: the 5 s until the refresh are spent on it)
    # by experiences trained on: 8 a step, summed (8, 16), each stage after the one before (then 16 + 4)
    run = _fake_run(root, "rft/exps", [{"step": 1, "train/experiences": 8, "loss/policy": 0.5},
                                       {"step": 2, "train/experiences": 8, "loss/policy": 0.25}], stage="sft")
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"stages": [{"stage_name": "sft"}, {"stage_name": "grpo"}]}))
    (run / "grpo").mkdir()
    (run / "grpo" / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/experiences": 4, "loss/policy": 0.125}) + "\n")
    exps = _open(chromium, studio, "/dashboard?run=rft/exps&open=loss&x=experiences")
    exps.wait_for_selector('.panel[data-metric="loss/policy"] .main-svg')
    assert _plot(exps, "loss/policy") == [["rft/exps", [8, 16, 20], [0.5, 0.25, 0.125]]]
    assert exps.evaluate("document.querySelector('.panel[data-metric=\"loss/policy\"]').layout.shapes.map(s => s.x0)") == [16]
    again.wait_for_function("document.querySelector('.panel[data-metric=\"eval/accuracy\"]').data[0].x.length == 3", timeout=15000)
    assert _plot(again, "eval/accuracy")[0][1] == [1.5, 2.75, 3.75]
    assert again.evaluate("document.querySelector('.panel[data-metric=\"eval/accuracy\"]').mark") == 1
    assert again.evaluate("window.pwned") is None  # the list holds the run named with markup
    assert httpx.get(studio[0] + "/api/dashboard", params={"run": "rft/a"}).status_code == 401  # no token
