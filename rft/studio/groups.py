"""The rollouts page's group view, without the page: a GRPO group (one task's n rollouts of one
explore step, those sharing a `group_id`) side by side, each response with its reward and its
advantage, and the task's reference answer.

The run stores no advantages, so they are computed here from the stored rewards with the stage's
own `algorithm.advantage_fn` (rft.algorithms.ADVANTAGE_FNS, with `algorithm.advantage_args`),
over the explore step's stored rollouts grouped by `group_id`, as the trainer's step does
(rft/trainer/step.py). The reference answer is the taskset row's `format.response_key`, the row
found by the task id (`<taskset name>/<row>`, rft.data.tasks.load_tasks) in the tasksets of the
stage's saved config (`<stage>/config.yaml`).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
from pathlib import Path

from rft import manifest
from rft.studio.rollouts import _eval_rows, _experience_row, experiences

SORTS = {"": "stored order", "spread": "reward spread, widest first", "mean_desc": "mean reward, highest first",
         "mean_asc": "mean reward, lowest first"}


def explore_step(group_id: str) -> int | None:
    """The explore step that sampled a group: its id's first part ("12/<seed>/<task>")."""
    head = str(group_id or "").split("/", 1)[0]
    return int(head) if head.isdigit() else None


def _records(run: Path, source: str) -> tuple[list[dict], int]:
    """(every stored rollout of the source, as the rows view shows one, with its "group_id" and
    explore "step"; how many the source holds). An eval file's rows are of its step's eval."""
    from rft.data.buffer import count_experiences
    from rft.studio.runs import inside

    path = inside(run, source)
    if "eval_trajectories" in Path(source).parts:
        rows, total = _eval_rows(path, source, None)
        with manifest.open_regular(path) as f:  # _eval_rows keeps no group ids: the same lines again (checked there)
            ids = [json.loads(line).get("group_id") or "" for line in itertools.islice((x for x in f if x.strip()), len(rows))]
        at = path.parent.name[5:]
        for r, g in zip(rows, ids):
            r["group_id"], r["step"] = g or f"{r['i']}", int(at) if at.isdigit() else None
        return rows, total
    rows = []
    for i, e in enumerate(experiences(path, source)):
        r = _experience_row(i, e)
        r["group_id"], r["step"], r["version"] = e.group_id, explore_step(e.group_id), e.policy_version
        rows.append(r)
    return rows, count_experiences(str(path))


def _stage_config(run: Path, source: str) -> dict:
    """The config of the stage that wrote the source: <stage>/config.yaml (a run of one stage
    keeps its buffer and config in the run's own directory)."""
    from rft.runtime.rundir import saved_config

    parts = Path(source).parts
    stage = parts[:parts.index("eval_trajectories")] if "eval_trajectories" in parts else parts[:-1]
    return saved_config(Path(run).joinpath(*stage)) or {}


def advantage_of(algo: dict, rows: list[dict]) -> tuple[list[float] | None, str]:
    """Each row's advantage under the stage's advantage_fn, the rows one batch grouped by
    group_id (as the trainer collates a step), and a sentence saying how; None where it cannot
    be computed from what the run stores."""
    import torch
    from omegaconf import OmegaConf

    from rft.algorithms import ADVANTAGE_FNS, with_args

    name = algo.get("advantage_fn") or "grpo"
    try:
        if ADVANTAGE_FNS.info(name).critic:
            return None, f"advantage_fn={name} needs the critic's values, which the run does not store: not shown."
        fn = with_args(ADVANTAGE_FNS, name, algo.get("advantage_args"), "algorithm.advantage_args")
    except Exception as e:  # a study's own function that no longer imports: the rewards still show
        return None, f"advantage_fn={name}: {str(e).splitlines()[0]}; not shown."
    index = {g: k for k, g in enumerate(dict.fromkeys(r["group_id"] for r in rows))}
    # float64, as the trainer hands them to the advantage function (1e6 + 0.01 vs 1e6: not merged)
    batch = {"rewards": torch.tensor([float(r["reward"] or 0) for r in rows], dtype=torch.float64),
             "group_index": torch.tensor([index[r["group_id"]] for r in rows]),
             "response_mask": torch.ones(len(rows), 1)}
    adv = fn(batch, OmegaConf.create(algo))[:, 0].tolist()
    how = (f"advantage: algorithm.advantage_fn={name}, computed here with rft.algorithms.advantages from the "
           f"stored rewards of the step's {len(rows)} rollouts grouped by group_id, as the trainer does; the run "
           f"stores no advantages.")
    if (algo.get("kl_penalty_fn") or "none") != "none":
        how += (f" The trainer first subtracts kl_penalty_coef={algo.get('kl_penalty_coef')} x KL "
                f"({algo['kl_penalty_fn']}) from each reward: not stored, so not in these.")
    return adv, how


@functools.lru_cache(maxsize=8)
def _answers(path: str, split: str, subset: str | None, name: str, key: str, stamp: float) -> dict:
    """{task id: reference answer} of a taskset (`stamp`: its files' mtime, so an edit reads again)."""
    from rft.data.tasks import load_rows

    rows = load_rows(path, split, subset, key="taskset.path")
    return {f"{name}/{i}": v for i, v in enumerate(rows[key])} if key in rows.column_names else {}


def references(cfg: dict, task_ids: set[str]) -> tuple[dict, str]:
    """({task id: reference answer} for the ids asked, a sentence where some cannot be read)."""
    inp = (cfg.get("buffer") or {}).get("explorer_input") or {}
    sets = {t.get("name"): t for t in [inp.get("taskset") or {}, *(inp.get("eval_tasksets") or [])] if isinstance(t, dict)}
    out, problems = {}, []
    for name in sorted({t.rsplit("/", 1)[0] for t in task_ids}):
        ts = sets.get(name)
        key = ((ts or {}).get("format") or {}).get("response_key")
        if not ts or not key or not ts.get("path"):
            problems.append(f"{name}: not a taskset of the stage's config, or one without format.response_key")
            continue
        path = os.path.expanduser(str(ts["path"]))
        try:
            answers = _answers(path, ts.get("split") or "train", ts.get("subset_name"), name, key,
                               os.stat(path).st_mtime)
        except Exception as e:  # moved or deleted data: the rollouts still show
            problems.append(f"{name}: {str(e).splitlines()[0]}")
            continue
        out.update({t: answers[t] for t in task_ids if t in answers})
    return out, "; ".join(problems)


def _matches(group: dict, needle: str) -> bool:
    texts = [group["task_id"], group["prompt"], str(group["reference"] or "")] + [m["response"] for m in group["members"]]
    return any(needle in str(t).lower() for t in texts)


def read_groups(run: Path, source: str, step: int | None = None, search: str = "", sort: str = "",
                offset: int = 0, limit: int = 5) -> dict:
    """The source's groups (of explore step `step`, or every step), those whose task, prompt,
    reference or a response holds `search` (any case), in `sort` order (SORTS), `limit` of them
    from the `offset`-th: {"groups", "matched", "read", "total", "steps", "advantage", "references"}."""
    if sort not in SORTS:
        raise ValueError(f"sort={sort!r}: one of {', '.join(repr(s) for s in SORTS)}.")
    rows, total = _records(run, source)
    steps = sorted({r["step"] for r in rows if r["step"] is not None})
    by_group: dict[str, list[dict]] = {}
    for r in rows:
        if step is None or r["step"] == step:
            by_group.setdefault(r["group_id"], []).append(r)
    groups = [_group(g, members) for g, members in by_group.items()]
    cfg = _stage_config(run, source)
    refs, ref_note = references(cfg, {g["task_id"] for g in groups})
    for g in groups:
        g["reference"] = refs.get(g["task_id"])
    if search:
        groups = [g for g in groups if _matches(g, search.lower())]
    if sort:
        key = {"spread": lambda g: -g["std"], "mean_desc": lambda g: -g["mean"], "mean_asc": lambda g: g["mean"]}[sort]
        groups.sort(key=key)
    shown = groups[offset:offset + limit]
    note = ""
    for s in sorted({g["step"] for g in shown}, key=lambda s: -1 if s is None else s):
        batch = [r for r in rows if r["step"] == s]  # the whole step: a batch-wide estimator sees all of it
        adv, note = advantage_of(cfg.get("algorithm") or {}, batch)
        values = {id(r): a for r, a in zip(batch, adv)} if adv is not None else {}
        for g in shown:
            for m in g["members"] if g["step"] == s else []:
                m["advantage"] = values.get(m.pop("_id"))
    for g in shown:
        for m in g["members"]:
            m.pop("_id", None)
    return {"groups": shown, "matched": len(groups), "read": len(rows), "total": total, "steps": steps,
            "advantage": note, "references": ref_note}


def _group(group_id: str, members: list[dict]) -> dict:
    rewards = [float(m["reward"] or 0) for m in members]
    mean = sum(rewards) / len(rewards)
    # the unbiased std, as grpo divides by (rft/algorithms/advantages.py); a group of one: 0
    std = (sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1)) ** 0.5 if len(rewards) > 1 else 0.0
    first = members[0]
    return {"group_id": group_id, "task_id": first["task_id"], "step": first["step"], "prompt": first["prompt"],
            "reference": None, "mean": mean, "std": std, "size": len(members),
            "members": [{"i": m["i"], "reward": m["reward"], "parts": m["parts"], "length": m["length"],
                         "response": m["response"], "turns": m["turns"], "advantage": None, "_id": id(m)}
                        for m in members]}
