"""The eval metrics papers report, from `n` samples per task (an eval taskset's `repeat_times`).

Per eval set, over its tasks (a task's samples are its group):

    mean@n   the mean reward of all samples (n = 1: the accuracy)
    best@n   the mean over tasks of the best reward among a task's samples
    pass@k   the mean over tasks of 1 - C(n - c, k) / C(n, k), c the task's correct samples (reward
             >= the set's pass_threshold): the unbiased estimator of the chance that at least one
             of k samples is correct (Chen et al. 2021, "Evaluating Large Language Models Trained
             on Code"), for every k the set asks (`pass_k`, each <= n)
    maj@n    the mean over tasks of whether the majority answer is correct: the answers are what
             the set's verifier reads from a response (`rft.rewards.verifiers.ANSWERS`; the
             stripped response for a reward without one), and two answers its verifier judges
             equal are one (`rft.rewards.verifiers.same_answer`: for `math`, `1/2`, `0.5` and
             `\\frac{1}{2}` vote together; for `countdown`, `3+7` and `7+3`; for `reasoning_gym`,
             what the task's dataset's scorer takes for one, `1,000` and `1000` for chain_sum; for
             `last_number`, its numbers in one spelling per value (rft/rewards/numbers.py: `7.50`,
             `7.5` and `15/2`; `1e16` is 10000000000000000, as the reward reads it); else equal strings);
             the vote's answer is its first sample's, and a tie goes to the answer sampled
             first; samples without an answer do not vote

Each comes with its standard error over tasks (`<metric>_se`: the sample standard deviation of the
per-task values over sqrt(tasks); 0 with one task), and, with the set's `group_by` naming a task
column, the same per value of that column (`<column>=<value>/<metric>`).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k), as a product (no large binomials): 1 when fewer than k samples
    are wrong. n=5, c=2: k=1 0.4, k=2 0.7, k=3 0.9, k=4 and 5 1.0."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def majority(answers: list, same=None) -> int | None:
    """The index of the first sample of the answer the most samples gave (ties: the answer sampled
    first); None answers do not vote; None when no sample has an answer. `same(a, b)`: whether two
    answers are one (the verifier's judgement, rft.rewards.verifiers.same_answer; None: equal
    strings): each answer joins the first answer sampled before it that it equals."""
    firsts: list[int] = []  # each distinct answer's first sample, in sampling order
    vote_of: dict = {}  # answer -> the first sample of the answer it is (one judgement per string)
    votes: Counter = Counter()
    for i, a in enumerate(answers):
        if a is None:
            continue
        if a not in vote_of:
            vote_of[a] = next((f for f in firsts if same is not None and same(answers[f], a)), i)
            if vote_of[a] == i:
                firsts.append(i)
        votes[vote_of[a]] += 1
    if not votes:
        return None
    top = max(votes.values())
    return next(f for f in firsts if votes[f] == top)


def task_values(rewards: list[float], answers: list, ks: list[int], threshold: float, same=None) -> dict[str, float]:
    """One task's values of every metric, from its samples' rewards and answers (`same`: majority's)."""
    n, c = len(rewards), sum(r >= threshold for r in rewards)
    values = {f"mean@{n}": sum(rewards) / n, f"best@{n}": max(rewards)}
    for k in ks:
        values[f"pass@{k}"] = pass_at_k(n, c, k)
    # the vote is judged only where it can matter: with no sample passing (an untrained model's
    # answers, all different: n(n-1)/2 of the verifier's comparisons, ~6 ms each for math) the
    # majority cannot pass, and with every sample passing it cannot fail
    chosen = majority(answers, same) if 0 < c < n else None
    values[f"maj@{n}"] = float(c == n and any(a is not None for a in answers)
                               or chosen is not None and rewards[chosen] >= threshold)
    return values


def summarize(per_task: list[dict[str, float]], prefix: str) -> dict[str, float]:
    """The mean of each metric over tasks, and its standard error (`<name>_se`)."""
    out: dict[str, float] = {}
    for name in per_task[0] if per_task else []:
        xs = [v[name] for v in per_task]
        out[f"{prefix}/{name}"] = sum(xs) / len(xs)
        out[f"{prefix}/{name}_se"] = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0
    return out


def eval_metrics(samples: list[tuple[list[float], list, str | None]], ks: list[int], threshold: float,
                 prefix: str, same=None) -> dict[str, float]:
    """`samples`: per task, (its samples' rewards, their answers, its group as "<column>=<value>" or
    None); `same`: whether two answers are one vote (None: equal strings), or a list of one such per
    task (a verifier that judges against the task's row). A failed task counts as n samples of reward
    0 without answers (as the accuracy counts it)."""
    judges = same if isinstance(same, list) else [same] * len(samples)
    per_task = [task_values(r, a, ks, threshold, j) for (r, a, _), j in zip(samples, judges)]
    out = summarize(per_task, prefix)
    for value in sorted({g for _, _, g in samples if g is not None}, key=str):
        mine = [v for v, (_, _, g) in zip(per_task, samples) if g == value]
        out.update(summarize(mine, f"{prefix}/{value}"))
    return out


def response_text(exp) -> str | None:
    """The response a sample's answer is read from: a single-turn one's text, or a conversation's
    last assistant message."""
    if "response" in exp.info:
        return str(exp.info["response"])
    said = [m.get("content") for m in exp.info.get("conversation") or [] if m.get("role") == "assistant"]
    return str(said[-1]) if said and said[-1] is not None else None


def rollout_samples(group: list | None, n: int) -> list[tuple[float, str | None]]:
    """A task's samples, one per rollout: (its reward, the response its answer is read from). An
    openai_agent run whose calls do not continue each other is several experiences with the run's
    reward and `info["rollout"]`: one sample, its last call's response (counted per experience, a
    run of 3 calls was 3 samples). A failed task (None), or rollouts missing, count as samples of
    reward 0 without a response, so every task has n."""
    runs: dict = {}
    for i, e in enumerate(group or []):
        runs[e.info.get("rollout", ("exp", i))] = e  # the last experience of a run wins
    samples = [(float(e.reward), response_text(e)) for e in runs.values()]
    return samples + [(0.0, None)] * (n - len(samples))


def paper_metrics(ts, tasks: list, groups: list, reward_spec, prefix: str) -> dict[str, float]:
    """An eval set's metrics above from what the workflow returned (`groups`, one per task, None
    for a failed task): {} for a set of one greedy sample per task without pass_k or group_by,
    whose accuracy says it all."""
    from rft.rewards.verifiers import answer_of, same_answer

    n = ts.repeat_times or 1
    if n == 1 and not ts.pass_k and not ts.group_by:
        return {}
    samples = []
    for task, group in zip(tasks, groups):
        label = None if not ts.group_by else f"{ts.group_by}={(task.row or {}).get(ts.group_by)}"
        runs = rollout_samples(group, n)
        if len(runs) > n:  # each task's metrics would be of another n (mean@5 beside mean@4), not comparable
            from rft.errors import ConfigError

            raise ConfigError(
                f"eval set {ts.name!r}: workflow {ts.workflow!r} returned {len(runs)} rollouts for task {task.task_id!r}, "
                f"and the set asks for {n} (its repeat_times): a workflow returns at most n rollouts per task (an "
                f"openai_agent run of several calls is one, by its info['rollout']).")
        samples.append(([r for r, _ in runs], [None if t is None else answer_of(reward_spec, t) for _, t in runs], label))
    return eval_metrics(samples, list(ts.pass_k), ts.pass_threshold, prefix, [same_answer(reward_spec, t) for t in tasks])
