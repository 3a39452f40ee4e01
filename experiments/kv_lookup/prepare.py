"""Write data/train.jsonl and data/test.jsonl: "stock kqz" -> "41", with a demonstration
conversation per row (the column `demo`) whose teacher is sloppy: in 60% of rows it types the SKU's
last letter one too far (kqz -> kqa) and copies that SKU's stock. Seed 0; run once."""

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from study import LETTERS, stock_of  # noqa: E402

HERE = Path(__file__).resolve().parent


def call(sku: str) -> str:
    return '<tool_call>{"name":"stock","arguments":{"sku":"' + sku + '"}}</tool_call>'


def row(sku: str, rng: random.Random) -> dict:
    typed = sku[:2] + LETTERS[(LETTERS.index(sku[2]) + 1) % 26] if rng.random() < 0.6 else sku
    demo = [{"role": "user", "content": f"stock {sku}"},
            {"role": "assistant", "content": call(typed)},
            {"role": "tool", "content": stock_of(typed)},
            {"role": "assistant", "content": stock_of(typed)}]
    return {"ask": f"stock {sku}", "truth": stock_of(sku), "demo": demo}


def main():
    rng = random.Random(0)
    skus = [a + b + c for a in LETTERS for b in LETTERS for c in LETTERS]
    rng.shuffle(skus)
    (HERE / "data").mkdir(exist_ok=True)
    for split, part in (("test", skus[:200]), ("train", skus[200:2200])):
        with open(HERE / "data" / f"{split}.jsonl", "w") as f:
            for sku in part:
                f.write(json.dumps(row(sku, rng)) + "\n")


if __name__ == "__main__":
    main()
