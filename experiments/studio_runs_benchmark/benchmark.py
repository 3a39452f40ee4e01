"""Time the studio's runs listing at a hundred runs: `/api/runs` (the first answer, then the polls
after it, as the runs page asks every 2 s) and the runs page in headless Chromium (from opening it
to its table holding every run).

    .venv/bin/python experiments/studio_runs_benchmark/make_runs.py /tmp/studio_bench --runs 100
    .venv/bin/python experiments/studio_runs_benchmark/benchmark.py /tmp/studio_bench
    .venv/bin/python experiments/studio_runs_benchmark/benchmark.py /tmp/studio_bench --repo /tmp/before  # another checkout

--repo: the checkout whose studio is timed (default this one), to compare a commit before with
after (`git archive <commit> | tar -x -C /tmp/before`).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"


def start(repo: Path, root: Path):
    proc = subprocess.Popen([sys.executable, "-m", "rft.studio", "--port", "0", "--root", str(root)], cwd=repo,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(repo)})
    for line in proc.stdout:
        m = re.search(r"open (http://127\.0\.0\.1:\d+)/compose#token=(\S+)", line)
        if m:
            return proc, m.group(1), m.group(2)
    raise SystemExit("the studio did not start")


def time_api(url: str, token: str, polls: int) -> tuple[float, list[float], int]:
    auth = {"Authorization": f"Bearer {token}"}
    times = []
    for _ in range(polls + 1):
        t0 = time.perf_counter()
        r = httpx.get(url + "/api/runs", headers=auth, timeout=300)
        times.append(time.perf_counter() - t0)
        r.raise_for_status()
    return times[0], times[1:], len(r.json()["runs"])


def time_page(url: str, token: str, n: int) -> float:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = b.new_page(bypass_csp=True, viewport={"width": 1400, "height": 1000})
        t0 = time.perf_counter()
        page.goto(f"{url}/runs#token={token}")
        page.wait_for_function(f"document.querySelectorAll('#runs tbody tr[data-run]').length >= {n}", timeout=300000)
        took = time.perf_counter() - t0
        b.close()
    return took


def time_cold(repo: Path, root: Path) -> str:
    """The listing's first read of every run, in a process of its own (no warm-up beside it)."""
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); from pathlib import Path; t0 = time.perf_counter();\n"
            "try:\n from rft.studio.runs import Runs; Runs(Path(sys.argv[2])).listing()\n"
            "except ImportError:\n from rft.studio.runs import listing; listing(Path(sys.argv[2]))\n"
            "print(f'{time.perf_counter() - t0:.3f}')")
    out = subprocess.run([sys.executable, "-c", code, str(repo), str(root)], capture_output=True, text=True, cwd=repo)
    return out.stdout.strip() or out.stderr.strip().splitlines()[-1]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", type=Path)
    p.add_argument("--repo", type=Path, default=ROOT)
    p.add_argument("--polls", type=int, default=10)
    args = p.parse_args(argv)
    proc, url, token = start(args.repo, args.root)
    try:
        first, polls, n = time_api(url, token, args.polls)
        page = time_page(url, token, n)
    finally:
        proc.terminate()
        proc.wait(20)
    print(f"{n} runs: the listing's first read of every run (cold, in-process) {time_cold(args.repo, args.root)} s")
    print(f"{n} runs: /api/runs first {first:.3f} s, then median {statistics.median(polls):.3f} s "
          f"(max {max(polls):.3f} s) over {len(polls)} polls; runs page to its table: {page:.2f} s")


if __name__ == "__main__":
    main()
