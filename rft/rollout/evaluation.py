"""An explorer's evals (`evaluate_sets`: its eval tasksets' accuracies, pass@k, maj@n, ...), the
metrics of multi-turn conversations, and the saved eval samples: the explorer's eval side, apart
from its explore steps (rft/rollout/explorer.py), which share `conversation_metrics` with it.
"""

from __future__ import annotations

import logging
import os

from rft.rewards.eval_metrics import paper_metrics, rollout_samples
from rft.rewards.scoring import part_metrics, spec_of

log = logging.getLogger(__name__)


def evaluate_sets(explorer, step: int, save_dir: str | None = None) -> dict:
    """Mean reward on each eval taskset (`eval/<name>/accuracy`; the first one also as
    `eval/accuracy`), and pass@k, maj@n, ... (rft/rewards/eval_metrics.py). A failed task counts
    as reward 0, in `eval/<name>/failed_tasks`; when every task of a set failed, `eval_failed`
    (not a metric) names the set and its last error, for the runner to stop the run
    (rft.runtime.explorers ExplorerPool.evaluate). With `save_dir`, every sample (prompt and
    response, or a conversation's turns and tool calls) goes to <save_dir>/step_<step>/<name>.jsonl.
    """
    metrics = {}
    for i, (ts, tasks, scorer) in enumerate(explorer.eval_tasksets):
        n = ts.repeat_times or 1
        counters: dict = {}
        groups = explorer._run(ts, scorer, tasks, n, step, 2, counters)
        samples = [rollout_samples(g, n) for g in groups]  # per rollout (an agent's run is one); failed: n zeros
        acc = sum(r for s in samples for r, _ in s) / max(sum(map(len, samples)), 1)
        failed = sum(g is None for g in groups)
        metrics[f"eval/{ts.name}/accuracy"] = acc
        # a reward of several parts: each part's mean too
        parts = part_metrics([e for g in groups if g for e in g], prefix=f"eval/{ts.name}")
        if len(parts) > 1:
            metrics.update(parts)
        metrics[f"eval/{ts.name}/failed_tasks"] = failed
        exps = [e for g in groups if g for e in g]
        metrics.update(conversation_metrics(exps, prefix=f"eval/{ts.name}"))
        spec = spec_of(ts.reward_fn, explorer.cfg.buffer.explorer_input.default_reward_fn_type)
        metrics.update(paper_metrics(ts, tasks, groups, spec, f"eval/{ts.name}"))  # pass@k, maj@n, ...
        if save_dir and exps:
            save_trajectories(exps, os.path.join(save_dir, f"step_{step}", f"{ts.name}.jsonl"), spec)
        if tasks and failed == len(tasks):
            source, last = counters.get("last_error") or (None, None)
            last = last or "none recorded (timeouts)"
            log.warning("every task of eval set %s failed at step %d (the last error: %s)", ts.name, step, last)
            metrics.setdefault("eval_failed", (i, last, source, counters.get("timeouts", 0) > 0))
        if i == 0:
            metrics["eval/accuracy"] = acc
            metrics["eval/failed_tasks"] = failed
    return metrics


def conversation_metrics(exps: list, prefix: str = "rollout") -> dict:
    """Multi-turn conversations (rft/rollout/workflows/multi_turn.py): turns and every number its
    environment's `info` counts (ToolEnv's tool_calls, tool_failures; an environment of a study's
    own, its own, and no tool_calls of 0 it never counted), each as <prefix>/<name>_mean (0 where a
    conversation lacks it); drift, budget and turn limits."""
    convs = [e for e in exps if "turns" in e.info]
    if not convs:
        return {}
    n = len(convs)
    counted = {k for e in convs for k, v in e.info.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {
        **{f"{prefix}/{k}_mean": sum(e.info.get(k, 0) for e in convs) / n
           for k in sorted(counted)},
        # conversations whose held ids the chat template does not render (rft/rollout/workflows/multi_turn.py)
        f"{prefix}/drift_frac": sum(bool(e.info.get("drift")) for e in convs) / n,
        f"{prefix}/budget_truncated_frac": sum(bool(e.info.get("budget_truncated")) for e in convs) / n,
        f"{prefix}/turn_limit_frac": sum(bool(e.info.get("turn_limit")) for e in convs) / n,
    }


def save_trajectories(exps: list, path: str, reward_spec=None) -> None:
    """One JSON line per sample: the task, its messages (a single turn's prompt and response; a
    conversation's tool calls and answers as the model and the tools wrote them), the answer the
    reward's verifier reads (maj@n's vote), the reward and its parts, and the counters."""
    import json

    from rft.rewards.eval_metrics import response_text
    from rft.rewards.verifiers import answer_of

    os.makedirs(os.path.dirname(path), exist_ok=True)
    keys = ("turns", "tool_calls", "tool_failures", "tool_errors", "finish_reason", "drift", "budget_truncated", "turn_limit")
    with open(path + ".tmp", "w") as f:
        for e in exps:
            messages = e.info.get("conversation") or [{"role": "user", "content": e.info.get("prompt")},
                                                      {"role": "assistant", "content": e.info.get("response")}]
            text = response_text(e)
            row = {"task_id": e.task_id, "group_id": e.group_id, "reward": e.reward, "reward_parts": e.reward_parts,
                   "answer": None if text is None else answer_of(reward_spec, text),
                   "messages": messages, **{k: e.info[k] for k in keys if k in e.info}}
            f.write(json.dumps(row) + "\n")
    os.replace(path + ".tmp", path)
