"""experiments/claims_dr_grpo/eval_lengths.py: the greedy eval's answer lengths by kind and correctness."""

import json

from conftest import load_script


def _script():
    return load_script("experiments/claims_dr_grpo/eval_lengths.py", "eval_lengths")


def _row(question: str, answer: str, reward: float) -> dict:
    return {"reward": reward, "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def test_eval_lengths_by_kind_and_correctness(tmp_path):
    mod = _script()
    rows = [_row("402+315?w3", "x" * 63, 1.0), _row("402+315?w3", "x" * 100, 0.0), _row("111+111?w2", "x" * 40, 0.0),
            _row("402+315", "717", 1.0), _row("402+315", "71", 0.0)]
    # marked wrong: (100 + 40) / 2 = 70; a reward under 1 is wrong; no kind is missing here
    assert mod.lengths(rows) == {"marked right": 63.0, "marked wrong": 70.0, "plain right": 3.0, "plain wrong": 2.0}
    assert "plain wrong" not in mod.lengths(rows[:4])  # a kind with no row is left out, not 0
    d = tmp_path / "eval_trajectories" / "step_10"
    d.mkdir(parents=True)
    (d / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    assert mod.job_lengths(tmp_path) == {10: {"marked right": 63.0, "marked wrong": 100.0}}
