"""Writes the study's data: 3-digit subtractions without borrows ("857-213" -> "644").

    python experiments/dpo_then_grpo/make_data.py checkpoints/dpo_then_grpo_data

train.jsonl (2000 rows) has the study's own column names: `question`, `good` (the exact
difference), `bad` (a sloppy teacher's typical mistake: the last digit one too high) and
`teacher` (what the teacher wrote: `bad` in 60% of rows, else `good`), which the SFT warm-up
imitates. test.jsonl (200 other questions) has `question` and `good`.
"""
import json
import random
import sys
from pathlib import Path


def problem(rng):
    # each digit of the subtrahend at most the minuend's: no borrow
    top = [rng.randint(1, 9)] + [rng.randint(0, 9) for _ in range(2)]
    low = [rng.randint(0, d) for d in top]
    q = "".join(map(str, top)) + "-" + "".join(map(str, low))
    good = "".join(str(a - b) for a, b in zip(top, low))
    last = (int(good[-1]) + 1) % 10
    return q, good, good[:-1] + str(last)


def main(out):
    rng = random.Random(7)
    seen, rows = set(), []
    while len(rows) < 2200:
        q, good, bad = problem(rng)
        if q in seen:
            continue
        seen.add(q)
        rows.append({"question": q, "good": good, "bad": bad,
                     "teacher": bad if rng.random() < 0.6 else good})
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train.jsonl", "w") as f:
        for r in rows[:2000]:
            f.write(json.dumps(r) + "\n")
    with open(out / "test.jsonl", "w") as f:
        for r in rows[2000:]:
            f.write(json.dumps({"question": r["question"], "good": r["good"]}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "checkpoints/dpo_then_grpo_data")
