"""A researcher's sweep study (experiments/lr_vs_group/): what the sweep and its report showed."""

from test_report import GRPO, MULTIRUN, SFT, tables, write_job

from rft.reporting import report


def test_a_job_killed_before_its_record_is_reported_with_its_planned_overrides(tmp_path):
    """`kill -9` of a sweep two seconds into its last job left that job's directory empty (rft
    writes .hydra/ only once the run is about to start). The report gave the job no overrides: its
    row had blank sweep keys, the keys common to every job became columns ("Common to all jobs" was
    gone), and the by-configuration table showed it as a configuration of its own with blank keys.
    Its overrides are the ones multirun.yaml planned for its number, as for a job never started."""
    d = tmp_path / "2026-11-29_01-39-17"
    write_job(d, 0, ["algorithm=grpo", "seed=1", "experiment=cmp"], "grpo", {"sft_warmup": SFT, "grpo": GRPO})
    write_job(d, 1, ["algorithm=grpo", "seed=2", "experiment=cmp"], "grpo", {"sft_warmup": SFT, "grpo": GRPO})
    (d / "2").mkdir()  # killed before its record: the directory alone
    (d / "multirun.yaml").write_text(MULTIRUN)  # 4 jobs: grpo 1, grpo 2, dapo 1, dapo 2
    out = report.report(d)
    text = out["md"].read_text()
    assert "Common to all jobs: `experiment=cmp`" in text
    table, by_config = tables(out["md"])
    assert table[0].split(" | ")[:5] == ["| job", "algorithm", "seed", "stage", "status"]
    assert [r.split(" | ")[:5] for r in table[2:]] == [
        ["| 0", "grpo", "1", "grpo", "done"], ["| 1", "grpo", "2", "grpo", "done"],
        ["| 2", "dapo", "1", "", report.NO_METRICS],
        ["| 3", "dapo", "2", "", "not started (no job directory)"]]
    # grpo: both seeds done; dapo: job 2 (killed) and job 3 (never started), none done
    assert [r.split(" | ")[:5] for r in by_config[2:]] == [["| grpo", "1,2", "grpo", "done", "2"],
                                                         ["| dapo", "1,2", "", "0/2 done", "0"]]
