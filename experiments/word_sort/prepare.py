"""The study's data: `train.jsonl` (400 rows) and `test.jsonl` (100 held-out rows) of
{"letters": "sort dbca", "ordered": "abcd", "teacher_answer": "abdc"}: three or four distinct
letters to put in alphabetical order. `teacher_answer` is a sloppy teacher's answer for the
SFT warm-up: in half of its rows it swaps the last two letters (seed 0, the same bytes each time).

    python experiments/word_sort/prepare.py [--out ~/.cache/rft/data/word_sort]
"""

import argparse
import json
import os
import random
from pathlib import Path

LETTERS = "abcdefghij"


def row(rng: random.Random) -> dict:
    word = rng.sample(LETTERS, rng.choice((3, 4)))
    ordered = "".join(sorted(word))
    teacher = ordered[:-2] + ordered[-1] + ordered[-2] if rng.random() < 0.5 else ordered
    return {"letters": "sort " + "".join(word), "ordered": ordered, "teacher_answer": teacher}


def write_data(folder: Path, n_train: int = 400, n_test: int = 100) -> Path:
    rng = random.Random(0)
    seen, rows = set(), []
    while len(rows) < n_train + n_test:  # distinct prompts, so the test rows are held out
        r = row(rng)
        if r["letters"] not in seen:
            seen.add(r["letters"])
            rows.append(r)
    folder.mkdir(parents=True, exist_ok=True)
    for split, part in (("train", rows[:n_train]), ("test", rows[n_train:])):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    return folder


if __name__ == "__main__":
    cache = os.environ.get("RFT_CACHE_DIR", "~/.cache/rft")
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=f"{cache}/data/word_sort")
    print(write_data(Path(ap.parse_args().out).expanduser()))
