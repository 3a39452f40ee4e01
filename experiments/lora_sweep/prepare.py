"""Writes the study's data (seed 0): data/train.jsonl and data/test.jsonl.

Each row reverses a three-letter word: {"question": "rev cat", "answer": "tac", "teacher_answer": ...}.
`teacher_answer` is what the default SFT warm-up of model=tiny imitates: a sloppy teacher whose
last letter is one too far in the alphabet in 60% of rows ("tad" for "tac"), as in the embedded
tasks, so the warm-up learns the format and the habit and the RL stage has something to fix.
"""
import json
import random
import string
from pathlib import Path

HERE = Path(__file__).parent


def rows(words, rng):
    out = []
    for w in words:
        answer = w[::-1]
        teacher = answer
        if rng.random() < 0.6:
            teacher = answer[:-1] + string.ascii_lowercase[(string.ascii_lowercase.index(answer[-1]) + 1) % 26]
        out.append({"question": f"rev {w}", "answer": answer, "teacher_answer": teacher})
    return out


def main():
    rng = random.Random(0)
    words = sorted({"".join(rng.choice(string.ascii_lowercase) for _ in range(3)) for _ in range(2600)})
    rng.shuffle(words)
    test, train = words[:200], words[200:2200]  # held-out words are never trained on
    (HERE / "data").mkdir(exist_ok=True)
    for split, ws in (("train", train), ("test", test)):
        with open(HERE / "data" / f"{split}.jsonl", "w") as f:
            for r in rows(ws, rng):
                f.write(json.dumps(r) + "\n")
    print(f"{len(train)} train, {len(test)} test rows in {HERE / 'data'}")


if __name__ == "__main__":
    main()
