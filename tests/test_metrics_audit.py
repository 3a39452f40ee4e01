"""An audit of the numbers a researcher reads from a run, against counts made here from the raw
records the run leaves (the experiences in buffer=sql's buffer.db, batches.jsonl, the eval
trajectories, the checkpoints' weights) and from what torch itself returned during the run
(clip_grad_norm_'s norms, the learning rate each optimizer step applied), never from rft's own
metric code.

Two short real runs of the tiny model from its random weights, one each for the module
(a reward of the response's bytes gives varied values, so advantages are not all 0):
- GRPO: 3 steps of 4 tasks x 4 rollouts, two optimizer updates a step (mini-batches of 8),
  micro-batches of 4, clip bounds of 0.01, a 2-update lr warm-up, an eval at steps 0, 2 and 3 with 2
  samples a task; the weights each update started from are kept (an optimizer pre-step hook);
- PPO with a critic, a KL term in the loss (k3) and a KL penalty on the reward (k1, coefficient
  0.1): one update a step in micro-batches of 4, a checkpoint every step, so each step's entropy,
  KL and values can be computed again from the weights it started from.
"""

import csv
import json
import math
import sqlite3
import statistics
from pathlib import Path

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from conftest import compose_cfg

MAX_TOKENS = 6  # model=tiny's model.max_response_tokens: the responses' length limit


def varied(prompt, response, task):
    """The test's reward: the response's bytes modulo 9, 0 to 1 in steps of 1/8 (no 0/1 verifier
    would vary on a random model's output). Eighths, so that a group's mean is exact: with sixths a
    response whose reward is its group's mean (1/6, 5/6, 1/2, 1/2) got an advantage of -2e-16 in
    float64 rather than 0, and clip_frac_low counted its tokens as clipped (8 of a step's 28)."""
    return (sum(map(ord, response)) % 9) / 8


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
        self.snapshots = []  # the trained weights each optimizer step started from, in the optimizer's order

        def before_step(opt, args, kwargs):
            self.lrs.append((id(opt), opt.param_groups[0]["lr"]))
            self.snapshots.append([p.detach().clone() for g in opt.param_groups for p in g["params"]])

        self.hook = register_optimizer_step_pre_hook(before_step)


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
        # bounds the second update's ratios cross (the first's are 1): clipped tokens on both sides
        "algorithm.clip_ratio_low=0.01", "algorithm.clip_ratio_high=0.01",
        "explorer.eval_interval=2", "buffer.explorer_input.eval_tasksets.0.repeat_times=2",
        "buffer.explorer_input.eval_tasksets.0.pass_k=[1,2]",
        "buffer.explorer_input.eval_tasksets.0.rollout_args.temperature=1.0"])


@pytest.fixture(scope="module")
def ppo(tmp_path_factory):
    return _run(tmp_path_factory, "ppo", [
        "algorithm=ppo", "trainer.micro_batch_size_per_gpu=4", "trainer.save_interval=1", "explorer.eval_interval=100",
        "algorithm.kl_loss_fn=k3", "algorithm.kl_loss_coef=0.01", "algorithm.kl_penalty_fn=k1",
        "algorithm.kl_penalty_coef=0.1"])


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


@pytest.mark.slow  # the module's short training run
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
        assert m["response_length/min"] == min(lengths) >= 1
        # clipped: cut at max_tokens without an EOS (one that ended with EOS as its 6th token was not cut)
        eos = {r["tokens"][-1] for r in rows if r["info"]["finish_reason"] == "stop"}
        assert len(eos) <= 1
        cut = [n == MAX_TOKENS and r["tokens"][-1] not in eos for n, r in zip(lengths, rows)]
        assert [r["info"]["finish_reason"] == "length" for r in rows] == cut
        assert m["rollout/truncated_frac"] == sum(cut) / 16
    # the run's responses ended both ways, so the clipping check above was tried on both
    assert 0 < sum(metrics[s]["rollout/truncated_frac"] for s in exps) < 3


# ---------------------------------------------------------------- the optimizer: lr, grad norm


@pytest.mark.slow  # the module's short training run
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


@pytest.mark.slow  # the module's short training run
def test_grad_norm_is_the_mean_of_clip_grad_norm_returns(grpo):
    run, rec, _ = grpo
    metrics = metrics_rows(run)
    norms = [n for _, n in rec.norms]
    assert len(norms) == 6 and all(n > 0 for n in norms)
    for step in (1, 2, 3):  # the norm before clipping (grad_clip 1.0 clipped every one of these)
        assert metrics[step]["actor/grad_norm"] == pytest.approx(statistics.fmean(norms[2 * step - 2: 2 * step]), rel=1e-9)


# ---------------------------------------------------------------- advantages


@pytest.mark.slow  # the module's short training run
def test_advantage_stats_are_token_weighted_over_the_batch(grpo):
    """GRPO's advantage of a response, (r - group mean) / (group std (N - 1) + 1e-6), counted once
    per response token: advantage/mean and abs_mean are token means, advantage/std the tokens' std."""
    run, _, _ = grpo
    metrics, exps = metrics_rows(run), step_experiences(run)
    for step, rows in exps.items():
        groups: dict = {}
        for r in rows:
            groups.setdefault(r["group_id"], []).append(r["reward"])
        per_token = []
        for r in rows:
            g = groups[r["group_id"]]
            adv = (r["reward"] - statistics.fmean(g)) / (statistics.stdev(g) + 1e-6)
            per_token += [adv] * (len(r["tokens"]) - r["prompt_length"])
        m = metrics[step]
        assert m["advantage/mean"] == pytest.approx(statistics.fmean(per_token), abs=1e-6)
        assert m["advantage/abs_mean"] == pytest.approx(statistics.fmean(map(abs, per_token)), abs=1e-6)
        assert m["advantage/std"] == pytest.approx(statistics.stdev(per_token), abs=1e-6)


# ---------------------------------------------------------------- evals


@pytest.mark.slow  # the module's short training run
def test_eval_metrics_are_the_saved_samples(grpo):
    """eval/<set>/accuracy is the mean reward over the saved samples; mean@2, best@2 and pass@k
    (1 - C(2 - c, k) / C(2, k), c the task's samples with reward >= 1) means over tasks."""
    run, _, _ = grpo
    metrics = metrics_rows(run)
    evals = sorted(int(p.name.split("_")[1]) for p in (run / "eval_trajectories").iterdir())
    assert evals == [0, 2, 3] and [s for s in metrics if "eval/accuracy" in metrics[s]] == evals
    for step in evals:
        samples = [json.loads(x) for x in (run / "eval_trajectories" / f"step_{step}" / "arithmetic_test.jsonl")
                   .read_text().splitlines()]
        tasks: dict = {}
        for s in samples:
            tasks.setdefault(s["task_id"], []).append(s["reward"])
        assert len(tasks) == 200 and {len(v) for v in tasks.values()} == {2}
        m, pre = metrics[step], "eval/arithmetic_test"
        assert m[f"{pre}/accuracy"] == m["eval/accuracy"] == pytest.approx(
            statistics.fmean(s["reward"] for s in samples), abs=1e-12)
        assert m[f"{pre}/mean@2"] == pytest.approx(statistics.fmean(statistics.fmean(v) for v in tasks.values()), abs=1e-12)
        assert m[f"{pre}/best@2"] == pytest.approx(statistics.fmean(max(v) for v in tasks.values()), abs=1e-12)
        for k in (1, 2):
            ref = statistics.fmean(1 - math.comb(2 - sum(r >= 1 for r in v), k) / math.comb(2, k) for v in tasks.values())
            assert m[f"{pre}/pass@{k}"] == pytest.approx(ref, abs=1e-12)
        assert 0 < m[f"{pre}/pass@1"] < m[f"{pre}/pass@2"]  # some tasks had one right sample of 2
        # maj@2: of 2 answers, the one given twice, else (a tie) the first sample's; none: no vote
        maj = []
        for task in tasks:
            votes = [(x["answer"], x["reward"]) for x in samples if x["task_id"] == task and x["answer"] is not None]
            maj.append(float(bool(votes) and votes[0][1] >= 1))
        assert m[f"{pre}/maj@2"] == pytest.approx(statistics.fmean(maj), abs=1e-12)
        # a standard error over the 200 tasks: their values' std (N - 1) / sqrt(200)
        means = [statistics.fmean(v) for v in tasks.values()]
        assert m[f"{pre}/mean@2_se"] == pytest.approx(statistics.stdev(means) / math.sqrt(200), abs=1e-12)


# ---------------------------------------------------------------- entropy and KL from the weights


def _policy_stats(model, rows):
    """Per response token of `rows`, under `model` (a transformers model, or the folder to load it
    from; one sequence a forward, float64 softmax at each row's sampling temperature): (log p(sampled
    token), entropy)."""
    from transformers import AutoModelForCausalLM

    if not isinstance(model, torch.nn.Module):
        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    logp, ent = [], []
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r["tokens"]])
            logits = model(ids).logits[0].double() / r["sampling"].get("temperature", 1.0)
            lp = torch.log_softmax(logits, -1)
            for t in range(r["prompt_length"], len(r["tokens"])):  # position t - 1 predicts token t
                logp.append(lp[t - 1, r["tokens"][t]].item())
                ent.append(-(lp[t - 1].exp() * lp[t - 1]).sum().item())
    return logp, ent


@pytest.mark.slow  # the module's short training run
def test_entropy_and_kl_are_token_means_of_the_weights_the_step_started_from(ppo):
    """A PPO step of one update (micro-batches of 4 of unequal token counts): actor/entropy is the
    policy's entropy per response token and actor/kl the k3 estimate of KL(policy || start) per
    token, both under the weights before the step's update (the start, then step N - 1's
    checkpoint), a mean over the batch's tokens, not over the micro-batches' means."""
    run, _, cfg = ppo
    metrics, exps = metrics_rows(run), step_experiences(run)
    start = cfg.model.model_path
    for step, rows in exps.items():
        assert {r["sampling"].get("temperature") for r in rows} == {1.0}
        logp, ent = _policy_stats(start if step == 1 else run / "checkpoints" / f"step_{step - 1}" / "hf", rows)
        ref, _ = _policy_stats(start, rows) if step > 1 else (logp, ent)
        k3 = [math.exp(r - p) - (r - p) - 1 for p, r in zip(logp, ref)]
        m = metrics[step]
        assert m["train/zero_advantage_rows_skipped"] == 0  # every row trained: the means are over all tokens
        assert m["actor/entropy"] == pytest.approx(statistics.fmean(ent), rel=1e-5)
        assert m["actor/kl"] == pytest.approx(statistics.fmean(k3), rel=1e-3, abs=1e-9)
    assert metrics[3]["actor/kl"] > 1e-6  # the policy moved from the start: the KL check compared something


def _values(run: Path, start: str, step: int, rows) -> list[float]:
    """The critic's value of each response token of `rows` before step `step`'s update: 0 at the
    first step (a zero head), then from step - 1's trainer_state.pt (transformers' base model and
    the head's weights, position t - 1's hidden state for token t)."""
    if step == 1:
        return [0.0] * sum(len(r["tokens"]) - r["prompt_length"] for r in rows)
    from transformers import AutoModel

    state = torch.load(run / "checkpoints" / f"step_{step - 1}" / "trainer_state.pt", map_location="cpu",
                       weights_only=False)["critic"]["model"]
    base = AutoModel.from_pretrained(start, dtype=torch.float32).eval()
    base.load_state_dict({k[len("base."):]: v for k, v in state.items() if k.startswith("base.")})
    out = []
    with torch.no_grad():
        for r in rows:
            hidden = base(torch.tensor([r["tokens"]])).last_hidden_state[0].double()
            v = hidden @ state["head.weight"][0].double() + state["head.bias"][0].double()
            out += v[r["prompt_length"] - 1: len(r["tokens"]) - 1].tolist()
    return out


@pytest.mark.slow  # the module's short training run
def test_kl_penalty_and_critic_metrics_are_the_returns_and_values(ppo):
    """reward/kl_penalty is the mean over responses of the k1 KL summed over each one's tokens
    (before kl_penalty_coef), under the weights the step started from against the start. gamma =
    lam = 1 and a reward at the last token alone: every token's return is its response's reward
    less 0.1 x that KL. critic/values_mean is the token mean of the values before the step's
    update, critic/explained_variance 1 - Var(R - V) / Var(R) over the tokens."""
    run, _, cfg = ppo
    metrics, exps = metrics_rows(run), step_experiences(run)
    start = cfg.model.model_path
    for step, rows in exps.items():
        values = _values(run, start, step, rows)
        logp, _ = _policy_stats(start if step == 1 else run / "checkpoints" / f"step_{step - 1}" / "hf", rows)
        ref, _ = _policy_stats(start, rows)
        kl, returns = [], []
        for r in rows:
            n = len(r["tokens"]) - r["prompt_length"]
            kl.append(sum(p - q for p, q in zip(logp[:n], ref[:n])))
            logp, ref = logp[n:], ref[n:]
            returns += [r["reward"] - 0.1 * kl[-1]] * n
        m = metrics[step]
        assert m["reward/kl_penalty"] == pytest.approx(statistics.fmean(kl), rel=1e-3, abs=1e-7)
        assert m["critic/values_mean"] == pytest.approx(statistics.fmean(values), abs=1e-6)
        ev = 1 - statistics.variance([g - v for g, v in zip(returns, values)]) / statistics.variance(returns)
        assert m["critic/explained_variance"] == pytest.approx(ev, abs=1e-5)
    assert metrics[3]["critic/values_mean"] != 0  # the critic learned: the check compared real values
    assert abs(metrics[3]["reward/kl_penalty"]) > 1e-4  # the policy moved: the penalty was not 0


@pytest.mark.slow  # the module's short training run
def test_update_metrics_are_token_means_over_both_updates(grpo):
    """Two updates a step, each from the weights the optimizer hook kept: mini-batch j (rows
    8j..8j+7, in the buffer's order) at the weights update j started from, the old log-probs at the
    step's first. actor/entropy, approx_kl (k3 of the ratio) and the clip fractions (the clipped
    surrogate larger than the plain one; low: A < 0, high: A > 0) are over the step's 2 x 16 rows'
    tokens; loss/policy is the mean over the updates of each one's token-mean loss."""
    from transformers import AutoModelForCausalLM

    run, rec, cfg = grpo
    metrics, exps = metrics_rows(run), step_experiences(run)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.model_path, dtype=torch.float32).eval()
    names = [n for n, _ in model.named_parameters()]

    def stats(update, rows):
        model.load_state_dict(dict(zip(names, rec.snapshots[update])), strict=False)
        return _policy_stats(model, rows)

    eps = cfg.algorithm.clip_ratio_low
    for step, rows in exps.items():
        groups: dict = {}
        for r in rows:
            groups.setdefault(r["group_id"], []).append(r["reward"])
        adv = [(r["reward"] - statistics.fmean(groups[r["group_id"]])) / (statistics.stdev(groups[r["group_id"]]) + 1e-6)
               for r in rows]
        first = 2 * (step - 1)
        old, _ = stats(first, rows)
        sums = dict(ent=0.0, kl=0.0, low=0, high=0, tokens=0)
        losses = []
        for j in (0, 1):
            part = rows[8 * j: 8 * j + 8]
            logp, ent = stats(first + j, part)
            a = [x for x, r in zip(adv[8 * j: 8 * j + 8], part) for _ in range(len(r["tokens"]) - r["prompt_length"])]
            o = old[sum(len(r["tokens"]) - r["prompt_length"] for r in rows[:8 * j]):][:len(a)]
            loss = 0.0
            for lp, lo, e, x in zip(logp, o, ent, a):
                ratio = math.exp(lp - lo)
                plain, clipped = -x * ratio, -x * min(max(ratio, 1 - eps), 1 + eps)
                loss += max(plain, clipped)
                sums["low" if x < 0 else "high"] += clipped > plain and x != 0
                sums["ent"] += e
                sums["kl"] += ratio - 1 - (lp - lo)
            sums["tokens"] += len(a)
            losses.append(loss / len(a))
        m, n = metrics[step], sums["tokens"]
        assert m["actor/entropy"] == pytest.approx(sums["ent"] / n, rel=1e-5)
        assert m["actor/approx_kl"] == pytest.approx(sums["kl"] / n, rel=1e-3, abs=1e-9)
        assert m["actor/clip_frac_low"] == pytest.approx(sums["low"] / n, abs=1e-12)
        assert m["actor/clip_frac_high"] == pytest.approx(sums["high"] / n, abs=1e-12)
        assert m["actor/clip_frac"] == pytest.approx((sums["low"] + sums["high"]) / n, abs=1e-12)
        assert m["loss/policy"] == pytest.approx(statistics.fmean(losses), abs=1e-6)
    # step 1's first update took lr 0 (the warm-up), so its second started from the same weights:
    # ratios of 1, nothing clipped; steps 2 and 3 clipped on both sides
    assert metrics[1]["actor/clip_frac"] == 0
    assert all(metrics[s]["actor/clip_frac_low"] > 0 and metrics[s]["actor/clip_frac_high"] > 0 for s in (2, 3))


def some_flat(prompt, response, task):
    """varied, but 1/2 for every response to a task whose number is a multiple of 3: groups of equal rewards."""
    return 0.5 if int(task.task_id.rsplit("/", 1)[1]) % 3 == 0 else varied(prompt, response, task)


@pytest.mark.slow  # a short training run of its own
def test_rows_set_aside_for_a_zero_advantage_are_not_in_the_entropy(tmp_path_factory):
    """One update a step (GRPO's default), so rows whose advantages are all 0 are set aside
    (trainer.skip_zero_advantage): actor/entropy is the token mean over the other rows alone, as
    README says; the whole batch's would differ."""
    run, _, cfg = _run(tmp_path_factory, "skip", [f"buffer.explorer_input.default_reward_fn_type={__name__}.some_flat",
                                                  "trainer.save_interval=1", "explorer.eval_interval=100",
                                                  "buffer.total_steps=2"])
    metrics, exps = metrics_rows(run), step_experiences(run)
    flat_steps = 0
    for step, rows in exps.items():
        groups: dict = {}
        for r in rows:
            groups.setdefault(r["group_id"], []).append(r["reward"])
        # advantage 0: a group of equal rewards, or a reward equal to its group's mean (exact in eighths)
        flat = [r["reward"] == statistics.fmean(groups[r["group_id"]]) for r in rows]
        assert metrics[step]["train/zero_advantage_rows_skipped"] == sum(flat)
        _, ent = _policy_stats(cfg.model.model_path if step == 1 else run / "checkpoints" / f"step_{step - 1}" / "hf", rows)
        per_row = []
        for r in rows:
            n = len(r["tokens"]) - r["prompt_length"]
            per_row.append(ent[:n])
            ent = ent[n:]
        trained = [e for f, es in zip(flat, per_row) if not f for e in es]
        flat_steps += any(flat) and not all(flat)
        if not trained:  # every group flat: no row forwarded, no entropy logged
            assert "actor/entropy" not in metrics[step]
            continue
        assert metrics[step]["actor/entropy"] == pytest.approx(statistics.fmean(trained), rel=1e-5)
    assert flat_steps  # a step set some rows aside and trained others: the check saw the difference


# ---------------------------------------------------------------- the sweep report's aggregates


def test_a_configuration_mean_over_fewer_seeds_than_n_says_so(tmp_path):
    """Three finished seeds of one configuration; one never logged response_length/correct_mean
    (no response was right: the metric is left out rather than logged as 0). The column's mean is
    over the other two, and the cell says so; `n` (3) is the seeds of the row."""
    from test_report import write_job

    from rft.reporting import report

    d = tmp_path / "seeds"
    base = [{"step": 1, "reward/mean": 0.2}, {"step": 2, "reward/mean": 0.4}, {"step": 3, "reward/mean": 0.6}]
    for seed, correct in ((1, 4.0), (2, 6.0), (3, None)):
        rows = [dict(m) for m in base]
        if correct is not None:  # and an eval set that seed 3's eval never scored (0.5, 0.7)
            rows[2].update({"response_length/correct_mean": correct, "eval/accuracy": correct / 10 + 0.1})
        write_job(d, seed - 1, [f"seed={seed}"], "grpo", {"sft_warmup": [{"step": 1}, {"step": 2}], "grpo": rows})
    out = report.report(d, metrics="reward/mean,response_length/correct_mean")
    md = out["md"].read_text().splitlines()
    # reward: 0.6 x 3 -> 0.600 +- 0.000 over 3; correct_mean: 4 and 6 -> 5.000 +- 1.414 over 2 of the 3
    assert "| 1,2,3 | grpo | done | 3 | 0.600 ± 0.000 | 5.000 ± 1.414 (2 of 3) |  |" in md
    row = [r for r in csv.DictReader(out["csv"].open()) if r["job"] == ""][0]
    assert (row["n"], row["final response_length/correct_mean mean"], row["final response_length/correct_mean n"]) \
        == ("3", "5.0", "2")
    assert "final reward/mean n" not in row  # every seed's: the row's n
    # the studio's sweep table says it too
    from rft.studio.runs import Runs

    (config,) = Runs(tmp_path).sweep_table("seeds")["configs"]
    assert (config["n"], config["final eval/accuracy"]) == (3, "0.6 ± 0.14 (2 of 3)")


# ---------------------------------------------------------------- throughput: tokens per second


@pytest.mark.slow  # the module's short training run
def test_throughputs_are_the_tokens_counted_over_the_time_logged(grpo):
    """train/tokens_per_s x timing/train_compute_s is the batch's response tokens (one pass);
    perf/trainer_tokens_per_s x the same time the tokens the forwards took (prompt and response,
    each row twice: the old log-probs' forward and its update's)."""
    run, _, _ = grpo
    metrics, exps = metrics_rows(run), step_experiences(run)
    for step, rows in exps.items():
        m = metrics[step]
        response = sum(len(r["tokens"]) - r["prompt_length"] for r in rows)
        assert m["train/tokens_per_s"] * m["timing/train_compute_s"] == pytest.approx(response, rel=1e-9)
        forwarded = 2 * sum(len(r["tokens"]) for r in rows)
        assert m["perf/trainer_tokens_per_s"] * m["timing/train_compute_s"] == pytest.approx(forwarded, rel=1e-9)
        # the explorers' generated tokens over their explore time, which holds the generation and
        # lies within the driver's wait for the rollouts: between tokens / rollout_s and tokens / generate_s
        assert response / m["timing/rollout_s"] <= m["rollout/tokens_per_s"] <= response / m["timing/generate_s"]
        # seconds, not ms: a step of the tiny model takes well under one, its train part less
        assert 0 < m["timing/train_compute_s"] <= m["timing/train_s"] < m["timing/step_s"] < 5


@pytest.mark.slow  # a short training run of its own
def test_a_critic_warmup_step_logs_no_policy_numbers(tmp_path_factory):
    """PPO's algorithm.critic_warmup=1: step 1 trains the critic alone. No policy update ran, so
    it logs no policy loss, gradient norm or entropy (they read 0.0, 0.0 and 0.0: a policy with no
    entropy and no gradient); step 2's are the update's."""
    run, rec, _ = _run(tmp_path_factory, "warmup", ["algorithm=ppo", "algorithm.critic_warmup=1", "buffer.total_steps=2",
                                                    "explorer.eval_interval=100"])
    metrics = metrics_rows(run)
    policy_keys = ("loss/policy", "actor/grad_norm", "actor/entropy")
    assert [k for k in policy_keys if k in metrics[1]] == []
    assert "critic/value_loss" in metrics[1]
    assert all(k in metrics[2] for k in policy_keys) and metrics[2]["actor/entropy"] > 4  # ~ln(103) = 4.63, random weights
    # 3 optimizer steps: the critic's at steps 1 and 2, the policy's at step 2 (its lr, 2e-4, logged there)
    assert len(rec.lrs) == 3 and metrics[2]["actor/lr"] == pytest.approx(2e-4)
