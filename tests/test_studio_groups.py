"""The rollouts page's group view against a real training run (inline, buffer=sql): the rewards
a training step logged are those of the explore step before it, the advantages the page computes
have the mean absolute value (over tokens) the trainer logged, and each group's reference answer is its taskset
row's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import compose_cfg

from rft.reporting.monitor import read_metrics


def spread(prompt: str, response: str, task) -> float:
    """A reward with spread within a group from an untrained model: 0, 0.5 or 1 by the response's length."""
    return (len(response) % 3) / 2


@pytest.mark.slow  # a training run (inline, ~20 s)
def test_group_view_rewards_advantages_and_references_match_what_the_trainer_logged(tmp_path):
    import rft.runtime.main
    from rft.studio.groups import read_groups

    cfg = compose_cfg([
        "stages=[]", "cluster=inline", "monitor=console", f"checkpoint_root_dir={tmp_path}", "buffer=sql",
        "buffer.total_steps=3", "buffer.batch_size=4", "algorithm.repeat_times=4", "explorer.eval_on_startup=false",
        "explorer.eval_interval=100", "buffer.explorer_input.eval_tasksets=[]",
        "buffer.explorer_input.taskset.reward_fn=test_studio_groups.spread",
    ])
    rft.runtime.main.main(cfg)
    run = tmp_path / "rft" / cfg.name
    source = next(p.relative_to(run).as_posix() for p in run.rglob("buffer.db"))
    logged = [m for m in read_metrics(run / Path(source).parent / "metrics.jsonl") if "reward/mean" in m]
    assert [m["step"] for m in logged] == [1, 2, 3]
    ts = cfg.buffer.explorer_input.taskset
    rows = [json.loads(line) for line in open(Path(os.path.expanduser(ts.path)) / f"{ts.split}.jsonl")]
    for m in logged:
        got = read_groups(run, source, step=m["step"] - 1, limit=100)
        members = [x for g in got["groups"] for x in g["members"]]
        assert (got["matched"], len(members)) == (4, 16)  # 4 tasks, 4 rollouts each
        assert sum(x["reward"] for x in members) / 16 == pytest.approx(m["reward/mean"], abs=1e-9)
        assert len({x["reward"] for x in members}) > 1  # the check below is not 0 == 0
        # the trainer's mean is over response tokens (rft/trainer/metrics.py): each row's |A| by its length
        tokens = sum(x["length"] for x in members)
        assert sum(abs(x["advantage"]) * x["length"] for x in members) / tokens == pytest.approx(m["advantage/abs_mean"], abs=1e-5)
        for g in got["groups"]:  # "<taskset name>/<row>": the row's answer
            assert g["reference"] == rows[int(g["task_id"].rsplit("/", 1)[1])]["answer"]


def test_the_advantages_shown_keep_rewards_float32_cannot_tell_apart():
    """The page's advantages come from the stored rewards as the trainer's do (float64 into the
    advantage function): 1e6 + 0.01 and 1e6 are one float32 (its spacing at 1e6 is 0.0625), so
    float32 showed 0 for both. GRPO: mean 1e6 + 0.005, sample std 0.01 / sqrt(2) = 0.0070711, each
    +-0.005 / (0.0070711 + 1e-6) = +-0.70700."""
    from rft.studio.groups import advantage_of

    rows = [{"group_id": "g", "reward": 1e6 + 0.01}, {"group_id": "g", "reward": 1e6}]
    adv, how = advantage_of({"advantage_fn": "grpo"}, rows)
    assert adv == pytest.approx([0.70700, -0.70700], abs=1e-4)
    assert how.startswith("advantage: algorithm.advantage_fn=grpo, computed here")
