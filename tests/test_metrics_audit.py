"""An audit of the numbers a researcher reads from a run, against counts made here from the raw
records the run leaves (the experiences in buffer=sql's buffer.db, batches.jsonl, the eval
trajectories, the checkpoints' weights) and from what torch itself returned during the run
(clip_grad_norm_'s norms, the learning rate each optimizer step applied), never from rft's own
metric code.

Two short real runs of the tiny model from its random weights, one each for the module
(a reward of the response's bytes gives varied values, so advantages are not all 0):
- GRPO: 3 steps of 4 tasks x 4 rollouts, two optimizer updates a step (mini-batches of 8),
  micro-batches of 4, a 2-update lr warm-up, an eval at steps 0, 2 and 3 with 2 samples a task;
- PPO with a critic and a KL term: one update a step in micro-batches of 4, a checkpoint every
  step, so each step's entropy and KL can be computed again from the weights it started from.
"""

import json
import math
import sqlite3
import statistics
from pathlib import Path

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tests.conftest import compose_cfg

pytestmark = pytest.mark.slow

MAX_TOKENS = 6  # model=tiny's model.max_response_tokens: the responses' length limit


def varied(prompt, response, task):
    """The test's reward: sevenths of the response's bytes, 0 to 1 in steps of 1/6 (no 0/1 verifier
    would vary on a random model's output)."""
    return (sum(map(ord, response)) % 7) / 6


class Recorder:
    """What torch returned or applied during a run: each clip_grad_norm_ return (the norm before
    clipping) and each optimizer step's learning rate, with the optimizer that took it."""

    def __init__(self, monkeypatch):
        self.norms, self.lrs = [], []
        real = torch.nn.utils.clip_grad_norm_

        def clip(params, *a, **k):
            params = list(params)
            norm = real(params, *a, **k)
            self.norms.append((len(params), float(norm)))
            return norm

        monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
        self.hook = register_optimizer_step_pre_hook(
            lambda opt, args, kwargs: self.lrs.append((id(opt), opt.param_groups[0]["lr"])))


def _run(tmp_path_factory, name, overrides):
    import rft.runtime.main

    mp = pytest.MonkeyPatch()
    rec = Recorder(mp)
    root = tmp_path_factory.mktemp(name)
    cfg = compose_cfg(["stages=[]", "cluster=inline", "monitor=console", "buffer=sql", f"checkpoint_root_dir={root}",
                       "buffer.total_steps=3", "buffer.batch_size=4", "algorithm.repeat_times=4",
                       f"buffer.explorer_input.default_reward_fn_type={__name__}.varied", *overrides])
    try:
        rft.runtime.main.main(cfg)
    finally:
        rec.hook.remove()
        mp.undo()
    run = root / "rft" / cfg.name
    return run, rec, cfg


@pytest.fixture(scope="module")
def grpo(tmp_path_factory):
    return _run(tmp_path_factory, "grpo", [
        "trainer.mini_batch_size=8", "trainer.micro_batch_size_per_gpu=4", "algorithm.optimizer.warmup_steps=2",
        "explorer.eval_interval=2", "buffer.explorer_input.eval_tasksets.0.repeat_times=2",
        "buffer.explorer_input.eval_tasksets.0.pass_k=[1,2]",
        "buffer.explorer_input.eval_tasksets.0.rollout_args.temperature=1.0"])


@pytest.fixture(scope="module")
def ppo(tmp_path_factory):
    return _run(tmp_path_factory, "ppo", [
        "algorithm=ppo", "trainer.micro_batch_size_per_gpu=4", "trainer.save_interval=1", "explorer.eval_interval=100",
        "algorithm.kl_loss_fn=k3", "algorithm.kl_loss_coef=0.01"])


# ---------------------------------------------------------------- the raw records


def metrics_rows(run: Path) -> dict[int, dict]:
    return {m["step"]: m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def step_experiences(run: Path) -> dict[int, list[dict]]:
    """Each training step's experiences, read straight from buffer.db's table, picked by the group
    ids batches.jsonl records for the step."""
    con = sqlite3.connect(run / "buffer.db")
    cols = ["group_id", "reward", "prompt_length", "tokens", "info", "sampling"]
    rows = [dict(zip(cols, r)) for r in con.execute(f"select {', '.join(cols)} from experiences order by id")]
    con.close()
    for r in rows:
        r["tokens"], r["info"], r["sampling"] = json.loads(r["tokens"]), json.loads(r["info"]), json.loads(r["sampling"] or "{}")
    out = {}
    for b in map(json.loads, (run / "batches.jsonl").read_text().splitlines()):
        out[b["step"]] = [r for r in rows if r["group_id"] in set(b["groups"])]
    return out


# ---------------------------------------------------------------- rollouts: rewards, lengths, clipping


def test_reward_and_length_metrics_are_the_batch_they_name(grpo):
    run, _, _ = grpo
    metrics, exps = metrics_rows(run), step_experiences(run)
    assert sorted(exps) == [1, 2, 3]
    for step, rows in exps.items():
        m = metrics[step]
        assert len(rows) == 16 == m["rollout/experiences"]  # 4 tasks x 4 rollouts, the batch trained on
        # the explore step behind training step N is N - 1 (the group id's first field)
        assert {r["group_id"].split("/")[0] for r in rows} == {str(step - 1)}
        rewards = [r["reward"] for r in rows]
        assert len(set(rewards)) > 2  # the check below compares something
        assert m["reward/mean"] == pytest.approx(statistics.fmean(rewards), abs=1e-12)
        assert m["reward/std"] == pytest.approx(statistics.stdev(rewards), abs=1e-12)  # N - 1
        assert (m["reward/min"], m["reward/max"]) == (min(rewards), max(rewards))
        # a response's length is its tokens after the prompt, the EOS the model ended on included
        lengths = [len(r["tokens"]) - r["prompt_length"] for r in rows]
        assert m["response_length/mean"] == pytest.approx(statistics.fmean(lengths), abs=1e-12)
        assert m["response_length/max"] == max(lengths) <= MAX_TOKENS
        # clipped: cut at max_tokens without an EOS (one that ended with EOS as its 6th token was not cut)
        eos = {r["tokens"][-1] for r in rows if r["info"]["finish_reason"] == "stop"}
        assert len(eos) <= 1
        cut = [n == MAX_TOKENS and r["tokens"][-1] not in eos for n, r in zip(lengths, rows)]
        assert [r["info"]["finish_reason"] == "length" for r in rows] == cut
        assert m["rollout/truncated_frac"] == sum(cut) / 16
    # the run's responses ended both ways, so the clipping check above was tried on both
    assert 0 < sum(metrics[s]["rollout/truncated_frac"] for s in exps) < 3


# ---------------------------------------------------------------- the optimizer: lr, grad norm


def test_lr_is_the_one_the_steps_updates_applied_on_the_warmup_formula(grpo):
    """actor/lr of step N is the mean of the lrs its updates applied. The schedule, HF's
    constant_with_warmup over updates k = 0, 1, ...: lr x min(1, k / warmup_steps), so the very
    first update takes lr 0 (2e-4 x 0/2), the second 1e-4 (2e-4 x 1/2), then 2e-4."""
    run, rec, _ = grpo
    metrics = metrics_rows(run)
    applied = [lr for _, lr in rec.lrs]
    assert len({o for o, _ in rec.lrs}) == 1 and len(applied) == 6  # one optimizer, 2 updates x 3 steps
    assert applied == pytest.approx([0.0, 1e-4, 2e-4, 2e-4, 2e-4, 2e-4], rel=1e-12)
    for step in (1, 2, 3):
        # step 1: (0 + 1e-4) / 2 = 5e-5; steps 2 and 3: 2e-4
        assert metrics[step]["actor/lr"] == pytest.approx(statistics.fmean(applied[2 * step - 2: 2 * step]), rel=1e-12)


def test_grad_norm_is_the_mean_of_clip_grad_norm_returns(grpo):
    run, rec, _ = grpo
    metrics = metrics_rows(run)
    norms = [n for _, n in rec.norms]
    assert len(norms) == 6 and all(n > 0 for n in norms)
    for step in (1, 2, 3):  # the norm before clipping (grad_clip 1.0 clipped every one of these)
        assert metrics[step]["actor/grad_norm"] == pytest.approx(statistics.fmean(norms[2 * step - 2: 2 * step]), rel=1e-9)
