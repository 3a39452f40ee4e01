"""The data pipelines' operators (data_processor.task_pipeline / experience_pipeline; registered in
rft/data/pipeline.py). Each is a function over rows with its own keyword arguments:

    task operator        fn(rows: list[dict], ctx: TaskContext, **args) -> list[dict]
    experience operator  fn(exps: list[Experience], **args) -> list[Experience]

An operator checks its arguments before it touches a row, so called on no rows it is the check
made with the plan (rft.data.pipeline.check_operators, from rft.runtime.main.checked_plan); a bad
value is a ConfigError, which the pipeline prefixes with the operator's config key. Filters keep rows in their order; mappers
change rows (or experiences) in place and return them.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import Callable

from rft.errors import ConfigError


@dataclass
class TaskContext:
    """What a task operator may use beside its rows."""
    # a row's prompt as text (the taskset's format: prompt_key, or the messages' contents)
    text: Callable[[dict], str]
    # (rows, n) -> each row's pass rate over n rollouts of the run's model (rft/runtime/pipelines.py);
    # None where no model is at hand (planning)
    pass_rates: Callable[[list[dict], int], list[float]] | None = None


def _text(row: dict, ctx: TaskContext, key: str | None) -> str:
    return ctx.text(row) if key is None else str(row.get(key, ""))


def _check_range(low, high, low_name: str, high_name: str) -> None:
    if low is not None and high is not None and low > high:
        raise ConfigError(f"{low_name}={low} > {high_name}={high}: no row could be kept; give {low_name} <= {high_name}.")


# ---------------------------------------------------------------- task operators


def text_length_filter(rows: list[dict], ctx: TaskContext, min_len: int = 0, max_len: int | None = None,
                       key: str | None = None) -> list[dict]:
    """Keep the rows whose prompt (or column `key`) has min_len..max_len characters (data-juicer's
    text_length_filter; max_len null: no upper bound)."""
    _check_range(min_len, max_len, "min_len", "max_len")
    return [r for r in rows if min_len <= len(_text(r, ctx, key)) <= (math.inf if max_len is None else max_len)]


def _normalised(text: str, lowercase: bool, ignore_non_character: bool) -> str:
    text = text.lower() if lowercase else text
    # "non-characters": whitespace, digits and punctuation (data-juicer's document_deduplicator)
    return re.sub(r"[\W\d_]+", "", text) if ignore_non_character else text


def document_deduplicator(rows: list[dict], ctx: TaskContext, key: str | None = None, lowercase: bool = False,
                          ignore_non_character: bool = False) -> list[dict]:
    """Exact deduplication: the first row of each prompt (or column `key`) text, after the
    normalisation asked (lowercase; ignore_non_character drops whitespace, digits, punctuation)."""
    seen, kept = set(), []
    for r in rows:
        h = hashlib.sha1(_normalised(_text(r, ctx, key), lowercase, ignore_non_character).encode()).digest()
        if h not in seen:
            seen.add(h)
            kept.append(r)
    return kept


def shingles(text: str, window_size: int) -> set[str]:
    """The character n-grams of `text` (n = window_size); a shorter text is its one shingle."""
    return {text[i:i + window_size] for i in range(max(len(text) - window_size + 1, 1))}


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def _bands(num_permutations: int, threshold: float) -> tuple[int, int]:
    """(bands, rows per band) of LSH whose S-curve turns nearest the threshold: two texts of
    Jaccard s share a band with probability 1 - (1 - s^r)^b, which rises steepest at (1/b)^(1/r)."""
    pairs = [(b, num_permutations // b) for b in range(1, num_permutations + 1) if num_permutations % b == 0]
    return min(pairs, key=lambda p: abs((1 / p[0]) ** (1 / p[1]) - threshold))


def _signatures(sets: list[set[str]], num_permutations: int, seed: int):
    """MinHash signatures [rows, num_permutations]: each permutation a universal hash
    (a * h + b) mod (2^61 - 1) of the shingle's 32-bit hash, its minimum over the shingles."""
    import numpy as np

    prime, rng = np.uint64((1 << 61) - 1), np.random.default_rng(seed)
    a = rng.integers(1, (1 << 61) - 1, num_permutations, dtype=np.uint64)
    b = rng.integers(0, (1 << 61) - 1, num_permutations, dtype=np.uint64)
    out = np.empty((len(sets), num_permutations), dtype=np.uint64)
    with np.errstate(over="ignore"):  # uint64 products wrap, as in datasketch: still a hash
        for i, s in enumerate(sets):
            h = np.array([int.from_bytes(hashlib.sha1(x.encode()).digest()[:4], "little") for x in s], dtype=np.uint64)
            out[i] = ((np.outer(h, a) + b) % prime).min(axis=0)
    return out


def document_minhash_deduplicator(rows: list[dict], ctx: TaskContext, key: str | None = None,
                                  jaccard_threshold: float = 0.7, window_size: int = 5, num_permutations: int = 128,
                                  lowercase: bool = True, seed: int = 1) -> list[dict]:
    """Near deduplication: a row is dropped when the Jaccard similarity of its character shingles
    (window_size characters) with an earlier kept row's is >= jaccard_threshold. MinHash
    signatures and LSH bands find the candidate pairs (without comparing every pair); each
    candidate is then checked on the shingle sets themselves, so what is dropped is exact."""
    if not 0 < jaccard_threshold <= 1:
        raise ConfigError(f"jaccard_threshold={jaccard_threshold} must be in (0, 1].")
    if window_size < 1 or num_permutations < 1:
        raise ConfigError(f"window_size={window_size} and num_permutations={num_permutations} must be >= 1.")
    if not rows:
        return rows
    sets = [shingles(_normalised(_text(r, ctx, key), lowercase, False), window_size) for r in rows]
    sig = _signatures(sets, num_permutations, seed)
    bands, r = _bands(num_permutations, jaccard_threshold)
    buckets: dict = {}
    kept = []
    for i in range(len(rows)):
        keys = [(band, sig[i, band * r:(band + 1) * r].tobytes()) for band in range(bands)]
        near = {j for k in keys for j in buckets.get(k, ())}
        if any(jaccard(sets[i], sets[j]) >= jaccard_threshold for j in sorted(near)):
            continue
        kept.append(i)
        for k in keys:
            buckets.setdefault(k, []).append(i)
    return [rows[i] for i in kept]


def llm_difficulty_score_filter(rows: list[dict], ctx: TaskContext, n: int = 8, min_score: float = 0.0,
                                max_score: float = 1.0, column: str = "difficulty") -> list[dict]:
    """Score each task by the run's model (the seeds' llm_difficulty_score_filter): n rollouts of
    it, as the run makes them (workflow, sampling, reward), give its pass rate p (the share with
    reward >= the taskset's pass_threshold), written as column `pass_rate`, and its difficulty
    1 - p, as column `column`; keep the rows whose difficulty is in [min_score, max_score]."""
    if n < 1:
        raise ConfigError(f"n={n}: the pass rate needs at least one rollout per task.")
    _check_range(min_score, max_score, "min_score", "max_score")
    if not rows:
        return rows
    for row, p in zip(rows, ctx.pass_rates(rows, n)):
        row["pass_rate"], row[column] = p, 1.0 - p
    return difficulty_filter(rows, ctx, min_score, max_score, column)


def difficulty_filter(rows: list[dict], ctx: TaskContext, min_score: float = 0.0, max_score: float = 1.0,
                      column: str = "difficulty") -> list[dict]:
    """Keep the rows whose `column` (a difficulty score: llm_difficulty_score_filter's, or the
    data's own) is in [min_score, max_score]; a row without it is an error."""
    _check_range(min_score, max_score, "min_score", "max_score")
    for i, r in enumerate(rows):
        if not isinstance(r.get(column), (int, float)) or _is_nan(r.get(column)):  # NaN is in no range
            raise _no_number(i, column, r.get(column))
    return [r for r in rows if min_score <= r[column] <= max_score]


def _is_nan(v) -> bool:
    return isinstance(v, float) and math.isnan(v)


def _no_number(i: int, column: str, value) -> ConfigError:
    return ConfigError(f"row {i} has no number in column {column!r} (it holds {value!r}); score the rows first "
                       f"(llm_difficulty_score_filter) or name the column that holds the difficulty.")


def curriculum_order(rows: list[dict], ctx: TaskContext, column: str = "difficulty",
                     descending: bool = False) -> list[dict]:
    """Order the rows by `column`, easy to hard (ascending; descending: true the other way); rows
    of equal value keep their order. The explorers then read the taskset in this order, epoch
    after epoch, instead of shuffled."""
    missing = [i for i, r in enumerate(rows) if r.get(column) is None]
    if missing:
        raise ConfigError(f"{len(missing)} rows have no {column!r} (row {missing[0]} first); order by a column every "
                          f"row has, or score the rows first (llm_difficulty_score_filter).")
    # NaN compares false both ways: sorted() would leave the rows around it where they are
    nan = next((i for i, r in enumerate(rows) if _is_nan(r[column])), None)
    if nan is not None:
        raise _no_number(nan, column, rows[nan][column])
    try:
        return sorted(rows, key=lambda r: r[column], reverse=descending)
    except TypeError:  # a number and a text, say: name the first two rows that do not compare
        values = [r[column] for r in rows]
        i, j = next((i, j) for j in range(len(values)) for i in range(j) if not _compare(values[i], values[j]))
        raise ConfigError(f"column {column!r} holds values that do not compare (row {i}: {values[i]!r}, row {j}: "
                          f"{values[j]!r}); order by a column of numbers, or of texts, in every row.") from None


def _compare(a, b) -> bool:
    try:
        return (a < b) in (True, False) and (b < a) in (True, False)
    except TypeError:
        return False


# ---------------------------------------------------------------- experience operators

_OPS = {"ADD": lambda r, v, w: r + w * v, "SUB": lambda r, v, w: r - w * v,
        "MUL": lambda r, v, w: r * w * v, "DIV": lambda r, v, w: r / (w * v)}


def reward_shaping_mapper(exps: list, reward_shaping_configs: list) -> list:
    """The seeds' reward_shaping_mapper: for each {stats_key, op_type, weight} in order, the
    reward becomes reward + weight * v (ADD), reward - weight * v (SUB), reward * weight * v (MUL)
    or reward / (weight * v) (DIV), where v is the experience's reward part or info value named
    stats_key. The change is recorded as a reward part of its own, <op_type>_<stats_key> (lower
    case; rft.data.experience.add_part, the one way to change a reward), logged as reward parts are."""
    from rft.data.experience import add_part

    specs = []
    for i, c in enumerate(reward_shaping_configs or []):
        c = dict(c)
        op, key = str(c.get("op_type", "ADD")).upper(), c.get("stats_key")
        if op not in _OPS or not key or set(c) - {"stats_key", "op_type", "weight"}:
            raise ConfigError(f"reward_shaping_configs[{i}]={c}: give stats_key (a reward part or info key), op_type "
                              f"(one of {', '.join(_OPS)}) and weight (default 1.0), and nothing else.")
        specs.append((key, op, float(c.get("weight", 1.0))))
    for e in exps:
        for key, op, w in specs:
            v = e.reward_parts.get(key, e.info.get(key))
            if not isinstance(v, (int, float)):
                raise ConfigError(f"stats_key {key!r} is not a number on experience {e.task_id!r} (its reward parts: "
                                  f"{sorted(e.reward_parts)}, info keys: {sorted(e.info)}); name one of those.")
            add_part(e, f"{op.lower()}_{key}", _shaped(e, key, op, float(v), w) - e.reward)
    return exps


def _shaped(e, key: str, op: str, v: float, w: float) -> float:
    """The reward after one shaping config; a division by 0 or a reward that is no longer finite
    stops the run naming the experience, where it was a bare ZeroDivisionError, or a NaN reward
    passed silently to the advantages (the workflow's finite-reward check has run by then)."""
    try:
        r = _OPS[op](e.reward, v, w)
    except ZeroDivisionError:
        r = math.nan
    if not math.isfinite(r):
        what = (f"divides it by {w} x {v} = 0: give DIV a stats_key that is never 0 (or use SUB, or ADD with a "
                f"negative weight)" if op == "DIV" and w * v == 0 else
                f"makes it {r}: a reward must stay a finite number; give a stats_key whose values are finite")
        raise ConfigError(f"reward_shaping_configs: {op} by stats_key {key!r} = {v} (weight {w}) on experience "
                          f"{e.task_id!r}, whose reward is {e.reward}, {what}.")
    return r


def reward_filter(exps: list, min_reward: float | None = None, max_reward: float | None = None) -> list:
    """Keep the experiences whose reward is in [min_reward, max_reward] (null: no bound)."""
    _check_range(min_reward, max_reward, "min_reward", "max_reward")
    return [e for e in exps if (min_reward is None or e.reward >= min_reward)
            and (max_reward is None or e.reward <= max_reward)]


def response_length_filter(exps: list, min_tokens: int = 0, max_tokens: int | None = None) -> list:
    """Keep the experiences whose response has min_tokens..max_tokens tokens (null: no bound)."""
    _check_range(min_tokens, max_tokens, "min_tokens", "max_tokens")
    return [e for e in exps if min_tokens <= e.response_length and (max_tokens is None or e.response_length <= max_tokens)]


def group_diversity_filter(exps: list, min_std: float = 0.0) -> list:
    """Drop the groups (rollouts of one task, one group_id) whose rewards' standard deviation
    (population) is <= min_std: with equal rewards a group-relative advantage is 0 everywhere,
    so they add nothing but compute (DAPO's filter, after the fact)."""
    if min_std < 0:
        raise ConfigError(f"min_std={min_std} must be >= 0.")
    groups: dict = {}
    for e in exps:
        groups.setdefault(e.group_id, []).append(e.reward)

    def std(r: list) -> float:
        m = sum(r) / len(r)
        return math.sqrt(sum((x - m) ** 2 for x in r) / len(r))

    keep = {g for g, r in groups.items() if std(r) > min_std}
    return [e for e in exps if e.group_id in keep]


def best_worst_pairs(exps: list) -> list:
    """A reward model's preference pairs from GRPO groups (algorithm.rm_pairs=groups, which puts
    it last in the experience pipeline): each group (one task's rollouts, one group_id) whose
    rewards are not all equal gives one pair, two experiences in a row, chosen then rejected (the
    rows 2k, 2k+1 the Bradley-Terry loss reads): its best-reward response over its worst-reward
    one, the first in rollout order among equals (the same pairs every run); a group of equal
    rewards gives none. Pairs follow the groups' first appearance. The rows keep no sampling
    log-probs: a reward model reads none, and the trainer's off-policy correction must not weigh
    a score against them."""
    from dataclasses import replace

    groups: dict = {}
    for e in exps:
        groups.setdefault(e.group_id, []).append(e)
    out = []
    for group in groups.values():
        best = max(group, key=lambda e: e.reward)  # max and min keep the first of equals
        worst = min(group, key=lambda e: e.reward)
        if best.reward > worst.reward:
            out += [replace(e, logprobs=[], token_versions=[], info={**e.info, "preference": role})
                    for e, role in ((best, "chosen"), (worst, "rejected"))]
    return out
