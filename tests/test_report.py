"""python -m rft.report on a hand-written multirun: the table's rows and values, the CSV, the PNG."""

import csv
import json
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT
from rft import report

# what Hydra saves for a job of the default (SFT warm-up, then a stage named after the algorithm)
CONFIG = """
name: ${algorithm.algorithm_type}-${hydra:runtime.choices.model}
algorithm: {algorithm_type: ALGO}
buffer: {total_steps: 3}
stages:
  - {stage_name: sft_warmup, buffer: {total_steps: 2}}
  - {stage_name: '${algorithm.algorithm_type}'}
"""

SFT = [{"step": 0, "eval/accuracy": 0.0, "timing/eval_s": 0.5},
       {"step": 1, "loss/policy": 2.0, "timing/step_s": 1.0},
       {"step": 2, "loss/policy": 1.0, "timing/step_s": 1.0, "eval/accuracy": 0.2, "timing/eval_s": 0.5,
        "timing/save_s": 0.25}]
GRPO = [{"step": 0, "eval/accuracy": 0.2, "timing/eval_s": 1.0},
        {"step": 1, "reward/mean": 0.3, "timing/step_s": 2.0},
        {"step": 2, "reward/mean": 0.5, "eval/accuracy": 0.6, "timing/step_s": 2.0, "timing/eval_s": 1.0},
        {"step": 3, "reward/mean": 0.7, "eval/accuracy": 0.5, "timing/step_s": 2.0, "timing/save_s": 0.5}]


def write_job(sweep, num, overrides, algo, stages=None):
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (job / ".hydra" / "config.yaml").write_text(CONFIG.replace("ALGO", algo))
    for stage, metrics in (stages or {}).items():
        (job / stage).mkdir()
        (job / stage / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))


@pytest.fixture
def sweep(tmp_path):
    """Three jobs: one done, one stopped after step 2 of its 3 GRPO steps, one with no metrics."""
    d = tmp_path / "2026-11-22_10-00-00"
    write_job(d, 0, ["seed=1", "algorithm=grpo", "cluster=inline"], "grpo", {"sft_warmup": SFT, "grpo": GRPO})
    write_job(d, 1, ["seed=2", "algorithm=dr_grpo", "cluster=inline"], "dr_grpo",
              {"sft_warmup": SFT, "dr_grpo": GRPO[:3]})
    with open(d / "1" / "dr_grpo" / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward/me')  # killed while writing step 3
    write_job(d, 2, ["seed=3", "algorithm=grpo", "cluster=inline"], "grpo")  # failed at start-up
    (d / "multirun.yaml").write_text("hydra: {}\n")  # Hydra's own file: not a job
    return d


def test_rows_hold_the_final_and_best_metrics_of_the_last_stage(sweep):
    out = report.report(sweep)
    assert {k: p.name for k, p in out.items()} == {"md": "report.md", "csv": "report.csv", "png": "rewards.png"}
    lines = out["md"].read_text().splitlines()
    assert "Common to all jobs: `cluster=inline`" in lines
    table = [line for line in lines if line.startswith("|")]
    assert table[0] == ("| job | seed | algorithm | stage | status | steps | final reward/mean | final eval/accuracy"
                        " | best eval/accuracy | best at step | time_s |")
    # time: every stage's steps, evals and saves (SFT 3.25 s; GRPO 8.5 s, or 6 s up to step 2)
    assert table[2] == "| 0 | 1 | grpo | grpo | done | 3 | 0.700 | 0.500 | 0.600 | 2 | 11.750 |"
    assert table[3] == "| 1 | 2 | dr_grpo | dr_grpo | incomplete (2/3 steps) | 2 | 0.500 | 0.600 | 0.600 | 2 | 9.250 |"
    assert table[4].startswith("| 2 | 3 | grpo |  | no metrics")
    assert len(table) == 5

    rows = list(csv.DictReader(out["csv"].open()))
    assert [r["job"] for r in rows] == ["0", "1", "2"]
    assert rows[0]["seed"] == "1" and rows[1]["algorithm"] == "dr_grpo"
    assert float(rows[0]["final reward/mean"]) == 0.7 and float(rows[0]["time_s"]) == 11.75
    assert rows[1]["best at step"] == "2" and rows[1]["status"] == "incomplete (2/3 steps)"
    assert rows[2]["final reward/mean"] == "" and rows[2]["status"].startswith("no metrics")


def test_the_png_has_one_curve_per_job_with_metrics(sweep):
    jobs = [report.read_job(p) for p in report.find_jobs(sweep)]
    keys = report.differing_keys(jobs)
    fig = report.plot(jobs, keys, "test")
    reward_ax, eval_ax = fig.axes
    assert [line.get_label() for line in reward_ax.lines] == ["seed=1 algorithm=grpo", "seed=2 algorithm=dr_grpo"]
    assert list(reward_ax.lines[0].get_xdata()) == [1, 2, 3]
    assert list(eval_ax.lines[1].get_ydata()) == [0.2, 0.6]

    png = report.report(sweep)["png"]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 10_000 < len(data) < 1_000_000
    from PIL import Image

    img = Image.open(png).convert("RGB")
    assert img.size == (1200, 450)
    colors = {c for _, c in img.getcolors(maxcolors=1 << 20)}
    # matplotlib's first two cycle colours are drawn (jobs 0 and 1), the third (job 2) is not
    assert (0x1F, 0x77, 0xB4) in colors and (0xFF, 0x7F, 0x0E) in colors
    assert (0x2C, 0xA0, 0x2C) not in colors


def test_a_single_run_without_stages(tmp_path):
    """stages=[]: metrics.jsonl in the run directory; the final checkpoint says it finished."""
    run = tmp_path / "grpo-tiny-arithmetic"
    (run / ".hydra").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in GRPO))
    (run / "checkpoints" / "step_3").mkdir(parents=True)
    out = report.report(run)
    row = list(csv.DictReader(out["csv"].open()))[0]
    assert (row["stage"], row["status"], row["steps"], row["final eval/accuracy"]) == ("", "done", "3", "0.5")
    assert list(report.plot([report.read_job(run)], [], "one").axes[1].lines[0].get_xdata()) == [0, 2, 3]


def test_the_command_line(sweep, tmp_path):
    r = subprocess.run([sys.executable, "-m", "rft.report", str(sweep)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert str(sweep / "report.md") in r.stdout and str(sweep / "rewards.png") in r.stdout

    r = subprocess.run([sys.executable, "-m", "rft.report", str(tmp_path / "nowhere")], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "nowhere is not a directory" in r.stderr
    (tmp_path / "empty").mkdir()
    r = subprocess.run([sys.executable, "-m", "rft.report", str(tmp_path / "empty")], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "holds no job directories" in r.stderr
