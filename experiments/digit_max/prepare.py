"""The study's inputs: data/train.jsonl and data/test.jsonl (columns `puzzle`, "max 381", and
`target`, "8"; seed 0), and a base model at <cache_dir>/models/digit-max-base-v2: the project's tiny
model with its chat template removed, as a base model's tokenizer comes.

    python experiments/digit_max/prepare.py [--cache-dir ~/.cache/rft]
"""

import argparse
import json
import os
import random
import shutil
from pathlib import Path

from rft.models import build_tiny_model

HERE = Path(__file__).resolve().parent


def rows(n: int, rng: random.Random) -> list[dict]:
    out = []
    for _ in range(n):
        digits = "".join(rng.choice("0123456789") for _ in range(3))
        out.append({"puzzle": f"max {digits}", "target": max(digits)})
    return out


def write_data(folder: Path) -> None:
    rng = random.Random(0)
    every = rows(260, rng)
    folder.mkdir(parents=True, exist_ok=True)
    for split, part in (("train", every[:200]), ("test", every[200:])):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))


def write_base_model(cache_dir: Path) -> Path:
    # named by the tiny model's version (rft.models.TINY_VERSION): one built by v1, whose tokenizer
    # dropped spaces, is not taken for it (conf/model/digit_max_base.yaml names the same folder)
    dest = cache_dir / "models" / "digit-max-base-v2"
    if not dest.exists():
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        build_tiny_model(tmp)
        (tmp / "chat_template.jinja").unlink(missing_ok=True)
        cfg = json.loads((tmp / "tokenizer_config.json").read_text())
        cfg.pop("chat_template", None)
        (tmp / "tokenizer_config.json").write_text(json.dumps(cfg))
        (tmp / "manifest.json").unlink(missing_ok=True)  # the built model's, no longer its files
        tmp.rename(dest)
    return dest


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache-dir", default=os.environ.get("RFT_CACHE_DIR", "~/.cache/rft"))
    ap.add_argument("--data-dir", default=str(HERE / "data"))
    args = ap.parse_args()
    write_data(Path(args.data_dir))
    print(write_base_model(Path(args.cache_dir).expanduser()))
