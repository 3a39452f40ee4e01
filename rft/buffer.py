"""Buffers: the only thing the explorer and the trainer share.

- `QueueBuffer` (storage_type=queue): experiences in memory, first in first out.
- `DatasetReader` (storage_type=file): a dataset of prompt/response rows read as experiences,
  for training without an explorer (an SFT stage).
"""

from __future__ import annotations

import random
import time
from collections import deque

from rft.errors import ConfigError
from rft.experience import Experience
from rft.tasks import load_rows, rows_to_messages
from rft.workflows import encode_prompt


def epoch_batch(n_items: int, per_step: int, step: int, epoch_seed) -> list[int]:
    """Indices of step `step`'s batch: each epoch is a fresh shuffle seeded by epoch_seed(epoch).

    A pure function of the step, so a resumed run reads exactly what an uninterrupted one would.
    """
    epoch, pos = divmod(step, n_items // per_step)
    order = list(range(n_items))
    random.Random(epoch_seed(epoch)).shuffle(order)
    return order[pos * per_step : (pos + 1) * per_step]


class QueueBuffer:
    def __init__(self):
        self._items: deque[Experience] = deque()

    def put(self, exps: list[Experience]) -> None:
        self._items.extend(exps)

    def get(self, n: int, timeout: float) -> list[Experience]:
        deadline = time.monotonic() + timeout
        while len(self._items) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the buffer held {len(self._items)} experiences after {timeout}s; wanted {n}")
            time.sleep(0.01)
        return [self._items.popleft() for _ in range(n)]

    def __len__(self) -> int:
        return len(self._items)


class DatasetReader:
    """Prompt/response rows as experiences; step k's batch is a function of (seed, k)."""

    def __init__(self, buf_cfg, tokenizer, max_prompt_tokens: int, max_response_tokens: int, seed: int,
                 where: str = "buffer.trainer_input.experience_buffer"):
        if not buf_cfg.path:
            raise ConfigError(f"{where}.storage_type=file needs {where}.path (a dataset of prompt/response rows).")
        rows = load_rows(buf_cfg.path, buf_cfg.split, key=f"{where}.path")
        fmt = buf_cfg.format
        # with chosen_key and rejected_key set, each row is a preference pair: two experiences,
        # chosen then rejected, always kept next to each other
        keys = [fmt.chosen_key, fmt.rejected_key] if fmt.chosen_key and fmt.rejected_key else [fmt.response_key]
        self.items = []  # one entry per row: the list of its experiences
        for i, row in enumerate(rows):
            messages = rows_to_messages(row, fmt, where, i, buf_cfg.path)
            prompt = encode_prompt(tokenizer, messages, max_prompt_tokens)
            item = []
            for key in keys:
                if row.get(key) is None:
                    raise ConfigError(
                        f"{where}: row {i} of {buf_cfg.path!r} has no {key!r} (in {where}.format); "
                        f"its keys are {sorted(k for k, v in row.items() if v is not None)}."
                    )
                response = tokenizer.encode(str(row[key]), add_special_tokens=False)
                response = response[: max_response_tokens - 1] + [tokenizer.eos_token_id]
                item.append(Experience(prompt + response, len(prompt), [], task_id=f"{buf_cfg.name}/{i}", group_id=str(i)))
            self.items.append(item)
        self.rows_per_item = len(keys)
        self.seed = seed

    def __len__(self) -> int:
        return len(self.items)

    def batch(self, step: int, size: int) -> list[Experience]:
        """`size` experiences (size / 2 pairs for preference data), epoch-wise shuffled rows."""
        rows = epoch_batch(len(self.items), size // self.rows_per_item, step, lambda epoch: self.seed * 1_000_003 + epoch)
        return [e for i in rows for e in self.items[i]]
