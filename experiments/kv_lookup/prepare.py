"""Write data/train.jsonl and data/test.jsonl: "47-83" -> "5120", with a demonstration
conversation per row (the column `demo`) whose teacher is sloppy: in 60% of rows it types the SKU's
last digit one too high (47-83 -> 47-84, 47-89 -> 47-80, 47-39 -> 47-40: 32..99 kept) and copies that SKU's stock. Seed 0; run once."""

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from study import stock_of  # noqa: E402

HERE = Path(__file__).resolve().parent


def call(sku: str) -> str:
    return '<tool_call>{"name":"stock","arguments":{"sku":"' + sku + '"}}</tool_call>'


def row(sku: str, rng: random.Random) -> dict:
    b = int(sku[3:])
    typed_b = b - b % 10 + (b % 10 + 1) % 10 if rng.random() < 0.6 else b
    typed = f"{sku[:3]}{typed_b if typed_b >= 32 else typed_b + 10}"
    demo = [{"role": "user", "content": f"{sku}"},
            {"role": "assistant", "content": call(typed)},
            {"role": "tool", "content": stock_of(typed)},
            {"role": "assistant", "content": stock_of(typed)}]
    return {"ask": f"{sku}", "truth": stock_of(sku), "demo": demo}


def main():
    rng = random.Random(0)
    skus = [f"{a}-{b}" for a in range(32, 100) for b in range(32, 100)]
    rng.shuffle(skus)
    (HERE / "data").mkdir(exist_ok=True)
    for split, part in (("test", skus[:200]), ("train", skus[200:2200])):
        with open(HERE / "data" / f"{split}.jsonl", "w") as f:
            for sku in part:
                f.write(json.dumps(row(sku, rng)) + "\n")


if __name__ == "__main__":
    main()
