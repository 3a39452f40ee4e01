"""Auxiliary models (explorer.auxiliary_models): a second engine a workflow calls, never trained."""

from __future__ import annotations

import pytest
from conftest import compose_cfg

from rft.reporting.monitor import read_metrics
from rft.rollout.workflows.single_turn import single_turn


def judged(tasks, engine, ctx):
    """single_turn, then the auxiliary model `judge` reads each response: its reply's length
    (characters, at most 4) / 4 is the reward part `judge`; the reply and the judge's weights
    fingerprint go into the experience's info."""
    from rft.data.experience import add_part

    out = single_turn(tasks, engine, ctx)
    judge = ctx.auxiliary["judge"]
    for group in out:
        for e in group or []:
            reply = judge.chat([{"role": "user", "content": e.info["response"] + "?"}], max_tokens=4)
            add_part(e, "judge", min(len(reply), 4) / 4)
            e.info["judge_reply"] = reply
            e.info["judge_weights"] = judge.engine.fingerprint()
            e.info["policy_weights"] = engine.fingerprint()
    return out


@pytest.mark.slow  # a training run (inline, ~20 s)
def test_a_workflow_that_asks_an_auxiliary_model_runs_in_the_loop(tmp_path):
    import rft.runtime.main
    from rft.data.buffer import read_experiences
    from rft.models import build_tiny_model

    judge = build_tiny_model(tmp_path / "judge", seed=1)  # another model: other weights than the policy
    cfg = compose_cfg([
        "stages=[]", "cluster=inline", "monitor=console", f"checkpoint_root_dir={tmp_path}",
        "buffer.total_steps=3", "buffer.batch_size=4", "algorithm.repeat_times=4", "explorer.eval_on_startup=false",
        "explorer.eval_interval=100", "buffer.explorer_input.eval_tasksets=[]", "algorithm.optimizer.lr=1e-2",
        "buffer.explorer_input.taskset.workflow=test_auxiliary.judged",
        "buffer=sql",
        f"explorer.auxiliary_models=[{{name: judge, model: {{model_path: '{judge}', dtype: float32, max_response_tokens: 4}}}}]",
    ])
    rft.runtime.main.main(cfg)
    metrics = read_metrics(tmp_path / "rft" / cfg.name / "metrics.jsonl")
    steps = [m for m in metrics if "reward/judge/mean" in m]
    assert len(steps) == 3
    # every experience was judged by the auxiliary model, whose weights stayed as built while the
    # policy's changed from step to step (lr 1e-2)
    exps = read_experiences(str(tmp_path / "rft" / cfg.name / "buffer.db"), limit=1000)
    assert len(exps) == 3 * 4 * 4
    assert len({e.info["judge_weights"] for e in exps}) == 1
    assert len({e.info["policy_weights"] for e in exps}) == 3
    for e in exps:
        assert e.reward_parts["judge"] == min(len(e.info["judge_reply"]), 4) / 4
        assert e.reward == e.reward_parts["exact_match"] + e.reward_parts["judge"]
