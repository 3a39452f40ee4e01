"""Writes the guess_number study's data: data/train.jsonl (200 rows) and data/test.jsonl (18 rows:
each secret twice), `{"ask": "guess:1-9", "secret": "7", "teacher_answer": "7"}`, seed 0."""

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent


def rows(n: int, rng: random.Random) -> list[dict]:
    # teacher_answer: a first guess of any digit, which the tiny model's SFT warm-up imitates (it
    # learns to answer with one digit; where to guess is left to RL)
    return [{"ask": "guess:1-9", "secret": str(rng.randint(1, 9)), "teacher_answer": str(rng.randint(1, 9))}
            for _ in range(n)]


def main() -> None:
    (HERE / "data").mkdir(exist_ok=True)
    train = rows(200, random.Random(0))
    test = [{"ask": "guess:1-9", "secret": str(d), "teacher_answer": "5"} for d in range(1, 10) for _ in range(2)]
    for name, data in [("train", train), ("test", test)]:
        (HERE / "data" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))


if __name__ == "__main__":
    main()
