"""python -m rft.reporting.report on a hand-written multirun: the table's rows and values, the CSV, the PNG."""

import csv
import json
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT

from rft.reporting import report

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


def tables(md):
    """report.md's tables: lists of their `|` lines (header, ---, rows)."""
    out, current = [], []
    for line in md.read_text().splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            out, current = out + [current], []
    return out


def test_rows_hold_the_final_and_best_metrics_of_the_last_stage(sweep):
    out = report.report(sweep)
    assert {k: p.name for k, p in out.items()} == {"md": "report.md", "csv": "report.csv", "png": "rewards.png"}
    lines = out["md"].read_text().splitlines()
    assert lines[0] == "# Sweep report: 2026-11-22_10-00-00"  # Hydra's multirun.yaml says it is one
    assert "Common to all jobs: `cluster=inline`" in lines
    table, by_config = tables(out["md"])
    assert table[0] == ("| job | seed | algorithm | stage | status | steps | final reward/mean | final eval/accuracy"
                        " | best eval/accuracy | best eval/accuracy at step | time_s |")
    # time: the reported stage's steps, evals and saves, not the warm-up's 3.25 s (GRPO:
    # 1 + 2 + 2 + 1 + 2 + 0.5 = 8.5 s; up to step 2: 1 + 2 + 2 + 1 = 6 s)
    assert table[2] == "| 0 | 1 | grpo | grpo | done | 3 | 0.700 | 0.500 | 0.600 | 2 | 8.500 |"
    assert table[3] == "| 1 | 2 | dr_grpo | dr_grpo | incomplete (2/3 steps) | 2 | 0.500 | 0.600 | 0.600 | 2 | 6.000 |"
    assert table[4].startswith("| 2 | 3 | grpo |  | no metrics")
    assert len(table) == 5
    # jobs 0 and 2 differ only in seed: one configuration, whose one seed with metrics is its value
    # (no ±); job 2's missing metrics show in its status and n
    assert by_config == [
        "| algorithm | seed | stage | status | n | final reward/mean | final eval/accuracy | best eval/accuracy | time_s |",
        "|---|---|---|---|---|---|---|---|---|",
        "| grpo | 1,3 | grpo | 1/2 done | 1 | 0.700 | 0.500 | 0.600 | 8.500 |",
        "| dr_grpo | 2 | dr_grpo | incomplete (2/3 steps) | 1 | 0.500 | 0.600 | 0.600 | 6.000 |"]

    rows = list(csv.DictReader(out["csv"].open()))
    assert [r["job"] for r in rows] == ["0", "1", "2", "", ""]
    assert rows[0]["seed"] == "1" and rows[1]["algorithm"] == "dr_grpo"
    assert float(rows[0]["final reward/mean"]) == 0.7 and float(rows[0]["time_s"]) == 8.5
    assert rows[1]["best eval/accuracy at step"] == "2" and rows[1]["status"] == "incomplete (2/3 steps)"
    assert rows[2]["final reward/mean"] == "" and rows[2]["status"].startswith("no metrics")
    assert rows[0]["n"] == rows[0]["final reward/mean mean"] == ""  # job rows leave the group columns empty
    assert (rows[3]["seed"], rows[3]["n"], rows[3]["final reward/mean mean"], rows[3]["final reward/mean std"]) == \
        ("1,3", "1", "0.7", "")  # one seed: no std


def test_the_png_has_one_curve_per_job_with_metrics(sweep):
    jobs = report.read_jobs(sweep)
    keys = report.differing_keys(jobs)
    fig = report.plot(jobs, keys, "test", group=False)
    reward_ax, eval_ax = fig.axes
    assert [line.get_label() for line in reward_ax.lines] == ["seed=1 algorithm=grpo", "seed=2 algorithm=dr_grpo"]
    assert list(reward_ax.lines[0].get_xdata()) == [1, 2, 3]
    assert list(eval_ax.lines[1].get_ydata()) == [0.2, 0.6]
    assert not reward_ax.collections  # one job each: no band

    png = report.report(sweep)["png"]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 10_000 < len(data) < 1_000_000
    from PIL import Image

    img = Image.open(png).convert("RGB")
    assert img.size == (1200, 450)
    colors = {c for _, c in img.getcolors(maxcolors=1 << 20)}
    # matplotlib's first two cycle colours are drawn (configurations grpo and dr_grpo); the third
    # is not: job 2 (no metrics) is counted with grpo, not drawn as a configuration of its own
    assert (0x1F, 0x77, 0xB4) in colors and (0xFF, 0x7F, 0x0E) in colors
    assert (0x2C, 0xA0, 0x2C) not in colors


# ---------------------------------------------------------------- seeds, stages, metrics, runs

LR = "algorithm.optimizer.lr"
# per lr, per seed 1, 2, 3: the final (step 3) reward/mean and the accuracy on the two eval sets
FINALS = {"1e-4": [(0.5, 0.6, 0.1), (0.7, 0.6, 0.2), (0.9, 0.9, 0.3)],
          "3e-4": [(0.2, 0.3, 0.0), (0.4, 0.5, 0.0), (0.9, 0.7, 0.3)]}


def grpo_with_two_eval_sets(reward, arith, hard):
    """GRPO's metrics as the explorer logs them: eval/<set>/accuracy per set, and the first set's
    also as eval/accuracy; reward 0.2 below its final at step 1, 0.1 below at step 2."""
    def evals(a, h):
        return {"eval/arith/accuracy": a, "eval/accuracy": a, "eval/hard/accuracy": h, "timing/eval_s": 1.0}
    return [{"step": 0, **evals(0.1, 0.0)},
            {"step": 1, "reward/mean": reward - 0.2, "timing/step_s": 2.0},
            {"step": 2, "reward/mean": reward - 0.1, "timing/step_s": 2.0},
            {"step": 3, "reward/mean": reward, "timing/step_s": 2.0, **evals(arith, hard)}]


@pytest.fixture
def lr_sweep(tmp_path):
    """`python run.py -m algorithm.optimizer.lr=1e-4,3e-4 seed=1,2,3`: 6 jobs, all done.
    Time per job: SFT 3.25 s; GRPO 3 steps x 2 s + 2 evals x 1 s = 8 s (its time_s: the warm-up's is not counted)."""
    d = tmp_path / "lr_sweep"
    num = 0
    for lr, finals in FINALS.items():
        for seed, final in enumerate(finals, 1):
            write_job(d, num, [f"{LR}={lr}", f"seed={seed}"], "grpo",
                      {"sft_warmup": SFT, "grpo": grpo_with_two_eval_sets(*final)})
            num += 1
    return d


def test_seeds_are_grouped_into_mean_and_std_per_configuration(lr_sweep):
    out = report.report(lr_sweep)
    table, by_config = tables(out["md"])
    # default metrics: reward/mean and each eval set (eval/accuracy repeats arith: left out)
    assert table[0] == (f"| job | {LR} | seed | stage | status | steps | final reward/mean"
                        " | final eval/arith/accuracy | best eval/arith/accuracy | best eval/arith/accuracy at step"
                        " | final eval/hard/accuracy | best eval/hard/accuracy | best eval/hard/accuracy at step | time_s |")
    assert table[2] == "| 0 | 1e-4 | 1 | grpo | done | 3 | 0.500 | 0.600 | 0.600 | 3 | 0.100 | 0.100 | 3 | 8.000 |"
    assert len(table) == 2 + 6
    assert by_config[0] == (f"| {LR} | seed | stage | status | n | final reward/mean | final eval/arith/accuracy"
                            " | best eval/arith/accuracy | final eval/hard/accuracy | best eval/hard/accuracy | time_s |")
    # lr=1e-4: reward 0.5 0.7 0.9 -> mean 0.7, std sqrt((0.04 + 0 + 0.04) / 2) = 0.2
    #          arith 0.6 0.6 0.9 -> mean 0.7, std sqrt((0.01 + 0.01 + 0.04) / 2) = 0.173
    #          hard 0.1 0.2 0.3 -> mean 0.2, std 0.1; time 8 each (GRPO only) -> std 0
    # lr=3e-4: reward 0.2 0.4 0.9 -> mean 0.5, std sqrt((0.09 + 0.01 + 0.16) / 2) = 0.361
    #          arith 0.3 0.5 0.7 -> mean 0.5, std 0.2; hard 0 0 0.3 -> mean 0.1, std 0.173
    assert by_config[2:] == [
        "| 1e-4 | 1,2,3 | grpo | done | 3 | 0.700 ± 0.200 | 0.700 ± 0.173 | 0.700 ± 0.173 | 0.200 ± 0.100"
        " | 0.200 ± 0.100 | 8.000 ± 0.000 |",
        "| 3e-4 | 1,2,3 | grpo | done | 3 | 0.500 ± 0.361 | 0.500 ± 0.200 | 0.500 ± 0.200 | 0.100 ± 0.173"
        " | 0.100 ± 0.173 | 8.000 ± 0.000 |"]

    rows = list(csv.DictReader(out["csv"].open()))
    groups = [r for r in rows if r["job"] == ""]
    assert [(r[LR], r["seed"], r["n"]) for r in groups] == [("1e-4", "1,2,3", "3"), ("3e-4", "1,2,3", "3")]
    assert float(groups[0]["final reward/mean mean"]) == pytest.approx(0.7)
    assert float(groups[0]["final reward/mean std"]) == pytest.approx(0.2)
    assert float(groups[1]["final reward/mean std"]) == pytest.approx((0.26 / 2) ** 0.5)

    # --no-group: the six job rows only
    out = report.report(lr_sweep, group=False)
    assert len(tables(out["md"])) == 1
    assert [r["job"] for r in csv.DictReader(out["csv"].open())] == ["0", "1", "2", "3", "4", "5"]


def test_the_plot_draws_a_mean_curve_and_a_std_band_per_configuration(lr_sweep):
    jobs = report.read_jobs(lr_sweep)
    keys = report.differing_keys(jobs)
    fig = report.plot(jobs, keys, "t", report.choose_metrics(jobs, None))
    assert [ax.get_title() for ax in fig.axes] == ["reward/mean", "eval/arith/accuracy", "eval/hard/accuracy"]
    reward_ax = fig.axes[0]
    assert [line.get_label() for line in reward_ax.lines] == [f"{LR}=1e-4 (3 seeds)", f"{LR}=3e-4 (3 seeds)"]
    assert all(len(ax.lines) == 2 and len(ax.collections) == 2 for ax in fig.axes)  # a line and a band each
    # lr=1e-4 at steps 1, 2, 3: every seed 0.2 and 0.1 below its final -> means 0.5 0.6 0.7, std 0.2
    assert list(reward_ax.lines[0].get_xdata()) == [1, 2, 3]
    assert list(reward_ax.lines[0].get_ydata()) == pytest.approx([0.5, 0.6, 0.7])
    band = reward_ax.collections[0].get_paths()[0].vertices[:, 1]
    assert (band.min(), band.max()) == pytest.approx((0.5 - 0.2, 0.7 + 0.2))
    # the two configurations keep their colours in every panel
    assert len({ax.lines[0].get_color() for ax in fig.axes}) == 1
    assert reward_ax.lines[0].get_color() != reward_ax.lines[1].get_color()

    fig = report.plot(jobs, keys, "t", ["reward/mean"], group=False)
    (ax,) = fig.axes
    assert len(ax.lines) == 6 and not ax.collections
    assert ax.lines[0].get_label() == f"{LR}=1e-4 seed=1"


def test_a_seed_that_stopped_early_and_one_without_metrics(tmp_path):
    """Seeds only (like experiment=tiny_seeds): the band covers the steps every seed logged; the
    row's values are the finished seeds' alone, n their count: seed 2, killed after step 2 of 3, was
    averaged in (its step-2 values as if final: 0.600 ± 0.141 over n=2, where the one finished seed
    ended at 0.7)."""
    d = tmp_path / "seeds"
    write_job(d, 0, ["seed=1"], "grpo", {"sft_warmup": SFT, "grpo": GRPO})
    write_job(d, 1, ["seed=2"], "grpo", {"sft_warmup": SFT, "grpo": GRPO[:3]})  # killed after step 2
    write_job(d, 2, ["seed=3"], "grpo")  # failed at start-up
    out = report.report(d)
    _, by_config = tables(out["md"])
    # seed 1 alone is done: final reward 0.7, final eval 0.5, best eval 0.6, GRPO time 3 x 2 + 2 x 1 + 0.5 = 8.5
    assert by_config[2] == "| 1,2,3 | grpo | 1/3 done | 1 | 0.700 | 0.500 | 0.600 | 8.500 |"
    jobs = report.read_jobs(d)
    fig = report.plot(jobs, ["seed"], "t", ["reward/mean"])
    (line,) = fig.axes[0].lines
    # seed 1 logged reward at steps 1 2 3, seed 2 at 1 2: the mean at 1 and 2 (0.3, 0.5 both)
    assert line.get_label() == "seed=1,2,3 (2 seeds)"
    assert list(line.get_xdata()) == [1, 2] and list(line.get_ydata()) == pytest.approx([0.3, 0.5])

    # seed 4 stopped after the warm-up: by default its last stage is its own row, not averaged with GRPO's
    write_job(d, 3, ["seed=4"], "grpo", {"sft_warmup": SFT})
    _, by_config = tables(report.report(d)["md"])
    assert [row.split(" | ")[:5] for row in by_config[2:]] == [["| 1,2,3", "grpo", "1/3 done", "1", "0.700"],
                                                             ["| 4", "sft_warmup", "stopped before stage grpo", "1", ""]]
    fig = report.plot(report.read_jobs(d), ["seed"], "t", ["eval/accuracy"])
    assert [line.get_label() for line in fig.axes[0].lines] == ["seed=1,2,3 (2 seeds)", "seed=4 (stage sft_warmup)"]
    # --stage grpo: seed 4 has no GRPO metrics, so it counts among the seeds not done
    _, by_config = tables(report.report(d, stage="grpo")["md"])
    assert by_config[2].startswith("| 1,2,3,4 | grpo | 1/4 done | 1 | 0.700 |")
    rows = list(csv.DictReader((d / "report.csv").open()))
    assert (rows[3]["job"], rows[3]["status"]) == ("3", "stopped before stage grpo")


@pytest.mark.slow
def test_stage_picks_the_warm_up_or_every_stage(lr_sweep):
    out = report.report(lr_sweep, stage="sft_warmup")
    table, by_config = tables(out["md"])
    # the warm-up logged eval/accuracy only (no reward, no eval sets): final 0.2, best 0.2 at step 2
    # of its 2 planned steps; time_s is the warm-up's own: 0.5 + 1 + 1 + 0.5 + 0.25 = 3.25
    assert table[0] == (f"| job | {LR} | seed | stage | status | steps | final eval/accuracy | best eval/accuracy"
                        " | best eval/accuracy at step | time_s |")
    assert table[2] == "| 0 | 1e-4 | 1 | sft_warmup | done | 2 | 0.200 | 0.200 | 2 | 3.250 |"
    assert by_config[2] == "| 1e-4 | 1,2,3 | sft_warmup | done | 3 | 0.200 ± 0.000 | 0.200 ± 0.000 | 3.250 ± 0.000 |"

    out = report.report(lr_sweep, stage="sft_warmup", metrics="loss/policy")
    table, _ = tables(out["md"])
    assert table[0].endswith("| steps | final loss/policy | time_s |") and "| 2 | 1.000 | 3.250 |" in table[2]

    out = report.report(lr_sweep, stage="all", metrics=["eval/accuracy", "reward/mean"])
    table, by_config = tables(out["md"])
    # a row per job and stage: the 6 warm-ups first, then the 6 GRPO stages
    assert [row.split(" | ")[:4] for row in table[2:]] == \
        [[f"| {n}", lr, str(seed), stage] for stage in ("sft_warmup", "grpo") for n, (lr, seed) in
         enumerate((lr, seed) for lr in FINALS for seed in (1, 2, 3))]
    assert [row.split(" | ")[:3] for row in by_config[2:]] == \
        [["| 1e-4", "1,2,3", "sft_warmup"], ["| 3e-4", "1,2,3", "sft_warmup"], ["| 1e-4", "1,2,3", "grpo"],
         ["| 3e-4", "1,2,3", "grpo"]]
    # the grpo mean of eval/accuracy (arith's) is 0.7 for lr=1e-4, as in the default report
    assert by_config[4].split(" | ")[5] == "0.700 ± 0.173"

    jobs = report.read_jobs(lr_sweep, "all")
    fig = report.plot(jobs, report.differing_keys(jobs), "t", ["eval/accuracy", "reward/mean"])
    # a row of panels per stage; the warm-up logged no reward: that panel is empty
    assert [ax.get_title() for ax in fig.axes] == ["sft_warmup: eval/accuracy", "sft_warmup: reward/mean",
                                                   "grpo: eval/accuracy", "grpo: reward/mean"]
    assert [(len(ax.lines), len(ax.collections)) for ax in fig.axes] == [(2, 2), (0, 0), (2, 2), (2, 2)]
    assert list(fig.axes[0].lines[0].get_ydata()) == pytest.approx([0.0, 0.2])  # SFT eval at steps 0, 2


def test_mistakes_in_stage_and_metrics_are_one_paragraph(lr_sweep, capsys):
    assert report.main([str(lr_sweep), "--stage", "warmup"]) == 2
    assert capsys.readouterr().err == (
        f"rft.reporting.report: --stage warmup: no job in {lr_sweep} has a stage of that name. The stages found: "
        "sft_warmup, grpo. Give one of them, or --stage all for every stage.\n")
    assert report.main([str(lr_sweep), "--metrics", "reward/mean,eval/acc"]) == 2
    assert capsys.readouterr().err == (
        "rft.reporting.report: --metrics eval/acc: not logged by any job in the stage reported. Did you mean "
        "eval/accuracy (not eval/acc)? The metrics found: "
        "eval/arith/accuracy, eval/accuracy, eval/hard/accuracy, timing/eval_s, reward/mean, timing/step_s. "
        "Give a comma-separated list of them, e.g. --metrics reward/mean,eval/arith/accuracy,eval/hard/accuracy.\n")
    assert not (lr_sweep / "report.md").exists()  # nothing written on a mistake

    with pytest.raises(SystemExit):
        report.main(["--help"])
    help_text = capsys.readouterr().out
    assert all(option in help_text for option in ("--stage STAGE", "--metrics METRICS", "--no-group"))


def test_a_directory_of_runs(tmp_path):
    """checkpoints/rft/: a run per directory (one or two levels down), each a job named by its path;
    the multirun directory beside them (three levels down to a job) and previous_* are not looked in."""
    root = tmp_path / "rft"
    write_job(root, "grpo-tiny-arithmetic", [], "grpo", {"sft_warmup": SFT, "grpo": GRPO})
    write_job(root, "dr_grpo-tiny-arithmetic", [], "dr_grpo", {"sft_warmup": SFT, "dr_grpo": GRPO[:3]})
    (root / "dr_grpo-tiny-arithmetic" / ".hydra" / "overrides.yaml").unlink()  # named by its directory
    write_job(root / "older", "grpo-qwen", ["model=qwen"], "grpo", {"grpo": GRPO})
    write_job(root / "multirun" / "2026-11-22_10-00-00", 0, ["seed=1"], "grpo", {"grpo": GRPO})
    # a stage-less run's outputs moved aside by continue_from_checkpoint=false
    (root / "grpo-tiny-arithmetic" / "previous_20261122_100000").mkdir()
    (root / "grpo-tiny-arithmetic" / "previous_20261122_100000" / "metrics.jsonl").write_text(json.dumps(GRPO[0]))

    out = report.report(root)
    table, = tables(out["md"])  # no configuration has two seeds: no second table
    assert [row.split(" | ")[:5] for row in table[2:]] == [
        ["| dr_grpo-tiny-arithmetic", "", "dr_grpo", "incomplete (2/3 steps)", "2"],
        ["| grpo-tiny-arithmetic", "", "grpo", "done", "3"],
        ["| older/grpo-qwen", "qwen", "grpo", "done", "3"]]  # its warm-up's outputs are gone; grpo is done

    jobs = report.read_jobs(root, "all")
    # every configured stage of every run (grpo-tiny-arithmetic's previous_* is not a stage); the
    # warm-up older/grpo-qwen plans but has no metrics of, though its next stage has, was skipped
    assert [(j.num, j.stage, j.status) for j in jobs] == [
        ("dr_grpo-tiny-arithmetic", "sft_warmup", "done"), ("grpo-tiny-arithmetic", "sft_warmup", "done"),
        ("older/grpo-qwen", "sft_warmup", "no metrics in this stage"),
        ("dr_grpo-tiny-arithmetic", "dr_grpo", "incomplete (2/3 steps)"), ("grpo-tiny-arithmetic", "grpo", "done"),
        ("older/grpo-qwen", "grpo", "done")]


def test_a_single_run_without_stages(tmp_path):
    """stages=[]: metrics.jsonl in the run directory; the final checkpoint says it finished."""
    run = tmp_path / "grpo-tiny-arithmetic"
    (run / ".hydra").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in GRPO))
    (run / "checkpoints" / "step_3").mkdir(parents=True)
    out = report.report(run)
    assert out["md"].read_text().startswith("# Report: grpo-tiny-arithmetic\n")  # one run: no sweep
    row = list(csv.DictReader(out["csv"].open()))[0]
    assert (row["stage"], row["status"], row["steps"], row["final eval/accuracy"]) == ("", "done", "3", "0.5")
    assert list(report.plot([report.read_job(run)], [], "one").axes[1].lines[0].get_xdata()) == [0, 2, 3]
    with pytest.raises(report.ReportError) as e:
        report.report(run, stage="grpo")
    assert str(e.value) == (f"--stage grpo: the jobs in {run} have no stages (each one's metrics.jsonl sits in "
                            "its own directory). Leave --stage out.")


@pytest.mark.slow
def test_the_command_line(sweep, tmp_path):
    r = subprocess.run([sys.executable, "-m", "rft.reporting.report", str(sweep)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert str(sweep / "report.md") in r.stdout and str(sweep / "rewards.png") in r.stdout

    r = subprocess.run([sys.executable, "-m", "rft.reporting.report", str(tmp_path / "nowhere")], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "nowhere is not a directory" in r.stderr
    (tmp_path / "empty").mkdir()
    r = subprocess.run([sys.executable, "-m", "rft.reporting.report", str(tmp_path / "empty")], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "holds no job directories" in r.stderr


def test_a_stage_reused_from_the_stage_cache_costs_the_job_no_time(sweep):
    # job 0: SFT 0.5 + 1 + 1 + 0.5 + 0.25 = 3.25 s, GRPO 1 + 2 + 2 + 1 + 2 + 0.5 = 8.5 s; its GRPO
    # row is 8.5 s whoever trained the warm-up; the warm-up copied from another job has no time
    (sweep / "0" / "sft_warmup" / "reused_from").write_text("<cache entry>\n<the job that trained it>\n")
    report.report(sweep)
    rows = list(csv.DictReader((sweep / "report.csv").open()))
    assert float(rows[0]["time_s"]) == 8.5
    report.report(sweep, stage="sft_warmup")
    rows = list(csv.DictReader((sweep / "report.csv").open()))
    assert (rows[0]["time_s"], float(rows[1]["time_s"])) == ("", 3.25)


def test_every_stage_puts_a_run_of_one_stage_beside_the_others_last_and_the_legend_outside(tmp_path):
    """--stage all with a run that has no warm-up: its GRPO is drawn in the GRPO row, not in the
    warm-up's; the titles name the stage (no ", sft_warmup" from the stage-less run); one legend,
    the figure's, beside the panels."""
    d = tmp_path / "mixed"
    write_job(d, 0, ["seed=1"], "grpo", {"sft_warmup": SFT, "grpo": GRPO})
    write_job(d, 1, ["seed=2", "stages=[]"], "grpo")
    (d / "1" / ".hydra" / "config.yaml").write_text("buffer: {total_steps: 3}\nstages: []\n")
    (d / "1" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in GRPO))
    jobs = report.read_jobs(d, "all")
    assert [(j.num, j.stage, j.slot) for j in jobs] == [("0", "sft_warmup", 0), ("0", "grpo", 1), ("1", "", 1)]
    fig = report.plot(jobs, report.differing_keys(jobs), "t", ["eval/accuracy"])
    assert [ax.get_title() for ax in fig.axes] == ["sft_warmup: eval/accuracy", "grpo: eval/accuracy"]
    # the warm-up row: job 0's SFT evals (0.0, 0.2) only; the GRPO row: both runs' GRPO evals
    assert [list(line.get_ydata()) for line in fig.axes[0].lines] == [[0.0, 0.2]]
    assert [list(line.get_ydata()) for line in fig.axes[1].lines] == [[0.2, 0.6, 0.5]] * 2
    assert all(ax.get_legend() is None for ax in fig.axes) and len(fig.legends) == 1
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["seed=1", "seed=2 stages=[]"]


def test_the_plan_read_as_plain_yaml_is_omegaconfs(tmp_path, monkeypatch):
    """planned_stages reads plain values and `${a.b}` itself (fast), else through OmegaConf: both
    give the same stages; a resolver it does not know (`${oc.env:...}`) takes OmegaConf's way."""
    write_job(tmp_path, 0, [], "dr_grpo")
    plain = report.planned_stages(tmp_path / "0")
    assert plain == [("sft_warmup", 2), ("dr_grpo", 3)]  # the RL stage's name: ${algorithm.algorithm_type}
    monkeypatch.setattr(report, "_plain_plan", lambda cfg: (_ for _ in ()).throw(report._NotPlain()))
    assert report.planned_stages(tmp_path / "0") == plain
    monkeypatch.undo()
    with pytest.raises(report._NotPlain):
        report._plain_plan({"stages": [{"stage_name": "${oc.env:X,a}"}]})


def test_a_diverged_seed_and_a_damaged_log_leave_the_report_whole(tmp_path):
    """One seed's last reward/mean is NaN (json writes a diverged float as NaN) and another seed's
    metrics.jsonl holds bytes that are not UTF-8 (damage, mid-file): the first made statistics.stdev
    raise AttributeError and the second UnicodeDecodeError, and the sweep had no report at all. The
    NaN is shown as such, mean and std of its configuration too; the damaged line is left out."""
    d = tmp_path / "seeds"
    write_job(d, 0, ["seed=1"], "grpo", {"sft_warmup": SFT, "grpo": GRPO})
    write_job(d, 1, ["seed=2"], "grpo", {"sft_warmup": SFT, "grpo": [*GRPO[:3], {**GRPO[3], "reward/mean": float("nan")}]})
    write_job(d, 2, ["seed=3"], "grpo", {"sft_warmup": SFT, "grpo": GRPO})
    log = d / "2" / "grpo" / "metrics.jsonl"
    lines = log.read_bytes().splitlines(keepends=True)
    log.write_bytes(b"".join([*lines[:2], b'{"step": 9, "reward/mean": 0.\xff\xfe}\n', *lines[2:]]))
    table, by_config = tables(report.report(d)["md"])
    # final reward/mean, final and best eval/accuracy (0.5; best 0.6 at step 2), time: 3 x 2 + 2 x 1 + 0.5 = 8.5
    assert table[2:] == ["| 0 | 1 | grpo | done | 3 | 0.700 | 0.500 | 0.600 | 2 | 8.500 |",
                         "| 1 | 2 | grpo | done | 3 | nan | 0.500 | 0.600 | 2 | 8.500 |",
                         "| 2 | 3 | grpo | done | 3 | 0.700 | 0.500 | 0.600 | 2 | 8.500 |"]
    assert by_config[2:] == ["| 1,2,3 | grpo | done | 3 | nan ± nan | 0.500 ± 0.000 | 0.600 ± 0.000 | 8.500 ± 0.000 |"]


def test_a_long_legend_entry_is_wrapped_and_the_figure_keeps_its_layout(lr_sweep, monkeypatch):
    import io
    import warnings

    jobs = report.read_jobs(lr_sweep)
    # runs that differ by a long override list, as a study's paths and dotted names make them
    long = "name=t_ints buffer.explorer_input.taskset.path=/tmp/bad/ints " * 4  # 244 characters
    monkeypatch.setattr(report, "group_label", lambda js, keys: long + js[0].num)
    fig = report.plot(jobs, report.differing_keys(jobs), "t", ["reward/mean"])
    labels = [line.get_label() for line in fig.axes[0].lines]
    assert all(max(len(part) for part in label.split("\n")) <= 60 for label in labels)
    # the words as they were, on lines of 60 characters at most
    assert labels[0].split() == (long + "0 (3 seeds)").split()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "constrained_layout not applied", where the legend was wider than it
        fig.savefig(io.BytesIO(), dpi=50)


MULTIRUN = """hydra:
  sweeper:
    _target_: hydra._internal.core_plugins.basic_sweeper.BasicSweeper
    max_batch_size: null
    params: {algorithm: 'grpo,dr_grpo,dapo', seed: '1,2,3'}
  overrides:
    task: [experiment=cmp, 'algorithm=grpo,dapo', 'seed=1,2']
"""


def test_an_interrupted_sweep_lists_the_jobs_it_planned_and_never_started(tmp_path):
    """Ctrl-C after two of four jobs: the report read only the two, so it said 'Common to all jobs:
    algorithm=grpo' of a grpo,dapo sweep and left dapo out. multirun.yaml's overrides, expanded as
    Hydra's basic sweeper does (its params, then the command line's, which win), give the four jobs
    in order: grpo 1, grpo 2, dapo 1, dapo 2."""
    d = tmp_path / "2026-11-28_05-00-00"
    write_job(d, 0, ["algorithm=grpo", "seed=1", "experiment=cmp"], "grpo", {"sft_warmup": SFT, "grpo": GRPO})
    write_job(d, 1, ["algorithm=grpo", "seed=2", "experiment=cmp"], "grpo", {"sft_warmup": SFT, "grpo": GRPO[:3]})
    (d / "multirun.yaml").write_text(MULTIRUN)
    assert report.planned_jobs(d) == [{"algorithm": a, "seed": s, "experiment": "cmp"}
                                      for a in ("grpo", "dapo") for s in ("1", "2")]
    out = report.report(d)
    text = out["md"].read_text()
    assert "Common to all jobs: `experiment=cmp`" in text
    table, by_config = tables(out["md"])
    assert [r.split(" | ")[:5] for r in table[2:]] == [
        ["| 0", "grpo", "1", "grpo", "done"], ["| 1", "grpo", "2", "grpo", "incomplete (2/3 steps)"],
        ["| 2", "dapo", "1", "", "not started (no job directory)"],
        ["| 3", "dapo", "2", "", "not started (no job directory)"]]
    assert [r.split(" | ")[:5] for r in by_config[2:]] == [["| grpo", "1,2", "grpo", "1/2 done", "1"],
                                                         ["| dapo", "1,2", "", "0/2 done", "0"]]
    # a sweeper that is not the basic one, a damaged multirun.yaml, a glob only Hydra's config can
    # expand: the jobs found, as before
    for text in ("hydra: {sweeper: {_target_: hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper}}",
                 "hydra: [", MULTIRUN.replace("'algorithm=grpo,dapo'", "'algorithm=glob(*)'")):
        (d / "multirun.yaml").write_text(text)
        assert report.planned_jobs(d) == [] and len(report.read_jobs(d)) == 2


def test_the_rollouts_each_configuration_generated_are_a_column(tmp_path):
    """DAPO's dynamic sampling generates more than it trains on, and its reward/mean is over the
    groups it kept: the `rollouts` column (rollout/generated summed over the stage) shows what each
    arm generated. grpo: 3 steps x 16 = 48; dapo seed 1: 16 + 32 + 48 = 96, seed 2: 16 + 16 + 32 = 64,
    mean 80, sample std sqrt(((96-80)^2 + (64-80)^2) / 1) = 22.627."""
    d = tmp_path / "sweep"
    counts = {("grpo", 1): [16, 16, 16], ("dapo", 1): [16, 32, 48], ("dapo", 2): [16, 16, 32]}
    for num, ((algo, seed), generated) in enumerate(counts.items()):
        logged = [dict(m, **({"rollout/generated": generated[m["step"] - 1]} if m["step"] else {})) for m in GRPO]
        write_job(d, num, [f"algorithm={algo}", f"seed={seed}"], algo, {"sft_warmup": SFT, algo: logged})
    table, by_config = tables(report.report(d)["md"])
    assert table[0].endswith("| time_s | rollouts |")
    assert [r.rsplit(" | ", 1)[1] for r in table[2:]] == ["48 |", "96 |", "64 |"]
    assert by_config[3].endswith("| 80.000 ± 22.627 |")
    text = (d / "report.md").read_text()
    assert "`rollouts`: the responses the stage generated, those it did not train on included" in text


def test_the_common_line_holds_the_search_path_of_a_study_kept_outside_the_repository(sweep):
    # Hydra records hydra.searchpath among its own overrides (.hydra/hydra.yaml), not overrides.yaml:
    # the line read `cluster=inline`, a command that could not find the study's configs
    for job in ("0", "1", "2"):
        (sweep / job / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"overrides": {
            "hydra": ["hydra.searchpath=[file:///studies/mine]", "hydra.mode=MULTIRUN"], "task": []}}}))
    assert report.main([str(sweep)]) == 0
    lines = (sweep / "report.md").read_text().splitlines()
    assert "Common to all jobs: `'hydra.searchpath=[file:///studies/mine]' cluster=inline`" in lines
    (sweep / "0" / ".hydra" / "hydra.yaml").write_text("hydra: [unclosed\n")  # damaged: the line as before
    assert report.main([str(sweep)]) == 0
    assert "Common to all jobs: `cluster=inline`" in (sweep / "report.md").read_text().splitlines()
