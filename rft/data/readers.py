"""Data for the trainer and the explorer: reading datasets, epoch batches, encoding prompts.

- `step_seed` and `epoch_batch`: what a step reads is a pure function of (seed, step), so a
  resumed run reads exactly what an uninterrupted one would.
- `chat_ids` / `encode_prompt`: a prompt's token ids (the chat template, over-long prompts keep
  their end).
- `DatasetReader`: a dataset of prompt/response rows (or preference pairs) as experiences, for
  training without an explorer (an SFT or DPO stage, algorithm=mix's auxiliary data); the
  trainer reads it, with its tokenizer (Trainer.train_dataset_step).
"""

from __future__ import annotations

import functools
import json
import random
import re
import threading
import weakref
from array import array
from collections import OrderedDict

from rft.data.chat import turn_end_id
from rft.data.experience import WHERE, Experience
from rft.data.tasks import load_rows, missing_value, plain, rows_to_messages
from rft.errors import ConfigError


def step_seed(seed: int, step: int, salt: int = 0) -> int:
    return (seed * 1_000_003 + step * 7919 + salt) % (2**31)


def epoch_batch(n_items: int, per_step: int, step: int, epoch_seed) -> list[int]:
    """Indices of step `step`'s batch: each epoch is a fresh shuffle seeded by epoch_seed(epoch).

    A pure function of the step, so a resumed run reads exactly what an uninterrupted one would.
    """
    epoch, pos = divmod(step, n_items // per_step)
    return list(_shuffled(n_items, epoch_seed(epoch))[pos * per_step : (pos + 1) * per_step])


@functools.lru_cache(maxsize=8)
def _shuffled(n_items: int, seed: int) -> tuple[int, ...]:
    # one shuffle per epoch, not one per step (0.3 ms a step for 2000 tasks)
    order = list(range(n_items))
    random.Random(seed).shuffle(order)
    return tuple(order)


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt's token ids: the chat template with the generation prompt."""
    return prompt_ids(tokenizer, [messages])[0]


def prompt_ids(tokenizer, conversations: list[list[dict]]) -> list[list[int]]:
    """`chat_ids` of each conversation, those not seen lately rendered in one call (half the
    time of one call each). Remembered per tokenizer (and template) for the prompts seen last
    (_PROMPTS_KEPT tokens in all): the explorer encodes the same tasks again every epoch."""
    template = getattr(tokenizer, "chat_template", None)
    keys = [(template, json.dumps(m, sort_keys=True, default=str)) for m in conversations]
    cache = _PROMPT_IDS.get(tokenizer) or _PROMPT_IDS.setdefault(tokenizer, _LRU())
    found = [cache.get(k) for k in keys]
    missing = [i for i, ids in enumerate(found) if ids is None]
    if missing:
        batch = [conversations[i] for i in missing]
        new = tokenizer.apply_chat_template(batch if len(batch) > 1 else batch[0], tokenize=True,
                                            add_generation_prompt=True)
        if hasattr(new, "keys"):  # transformers may return a BatchEncoding
            new = new["input_ids"]
        for i, ids in zip(missing, new if len(batch) > 1 else [new]):
            found[i] = array("i", ids)
            cache.put(keys[i], found[i])
    return [ids.tolist() for ids in found]


class _LRU:
    """Token ids by key, the least recently used dropped past _PROMPTS_KEPT tokens in all."""

    def __init__(self):
        self.items: OrderedDict = OrderedDict()
        self.tokens = 0
        self.lock = threading.Lock()  # workflows encode prompts from several threads

    def get(self, key):
        with self.lock:
            ids = self.items.get(key)
            if ids is not None:
                self.items.move_to_end(key)
            return ids

    def put(self, key, ids) -> None:
        with self.lock:
            if key in self.items:
                return
            self.items[key] = ids
            self.tokens += len(ids)
            while self.tokens > _PROMPTS_KEPT and len(self.items) > 1:
                self.tokens -= len(self.items.popitem(last=False)[1])


_PROMPTS_KEPT = 1 << 22  # tokens: 16 MiB at most per tokenizer, as 32-bit ints
_PROMPT_IDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def encode_prompt(tokenizer, messages: list[dict], max_prompt_tokens: int) -> list[int]:
    # keep the end of an over-long prompt: the question and the generation prompt sit there
    return chat_ids(tokenizer, messages)[-max_prompt_tokens:]


class DatasetReader:
    """Prompt/response rows as experiences; step k's batch is a function of (seed, k)."""

    def __init__(self, buf_cfg, tokenizer, max_prompt_tokens: int, max_response_tokens: int, seed: int,
                 where: str = WHERE):
        if not buf_cfg.path:
            raise ConfigError(f"{where}.storage_type=file needs {where}.path (a dataset of prompt/response rows).")
        rows = load_rows(buf_cfg.path, buf_cfg.split, key=f"{where}.path", fmt=buf_cfg.format)
        fmt = plain(buf_cfg.format)
        # with chosen_key and rejected_key set, each row is a preference pair: two experiences,
        # chosen then rejected, always kept next to each other
        keys = [fmt.chosen_key, fmt.rejected_key] if fmt.chosen_key and fmt.rejected_key else [fmt.response_key]
        self.items = []  # one entry per row: the list of its experiences
        if getattr(fmt, "enable_concatenated_multi_turn", False):
            self.items = [[conversation_experience(row, fmt, tokenizer, max_prompt_tokens + max_response_tokens,
                                                   f"{buf_cfg.name}/{i}", where, i, buf_cfg.path, buf_cfg.split)]
                          for i, row in enumerate(rows)]
            rows = []
            keys = [None]
        # a response ends as the chat template ends an assistant turn (Llama-3's <|eot_id|>, where
        # its tokenizer's eos may be <|end_of_text|>): one end token, the one generation stops on
        end = turn_end_id(tokenizer) if rows else None
        for i, row in enumerate(rows):
            messages = rows_to_messages(row, fmt, where, i, buf_cfg.path, buf_cfg.split)
            full_prompt = chat_ids(tokenizer, messages)
            # an over-long prompt keeps its end (the question and the generation prompt sit there)
            prompt = full_prompt[-max_prompt_tokens:]
            item = []
            for key in keys:
                if row.get(key) is None:  # rft.runtime.main.dataset_size's check_columns finds it first
                    name = next(n for n in ("chosen_key", "rejected_key", "response_key") if getattr(fmt, n) == key)
                    raise ConfigError(missing_value(where, buf_cfg.path, i, key, name, row, split=buf_cfg.split))
                full = tokenizer.encode(str(row[key]), add_special_tokens=False)
                response = full[: max_response_tokens - 1] + [end]
                # counted in the step's metrics (train/truncated_prompts, train/truncated_responses)
                cut = {"prompt_truncated": len(full_prompt) > len(prompt), "response_truncated": len(full) >= max_response_tokens}
                item.append(Experience(prompt + response, len(prompt), [], task_id=f"{buf_cfg.name}/{i}",
                                       group_id=str(i), info=cut))
            self.items.append(item)
        self.rows_per_item = len(keys)
        self.seed = seed

    def __len__(self) -> int:
        return len(self.items)

    def batch(self, step: int, size: int) -> list[Experience]:
        """`size` experiences (size / 2 pairs for preference data), epoch-wise shuffled rows."""
        rows = epoch_batch(len(self.items), size // self.rows_per_item, step, lambda epoch: step_seed(self.seed, 0, salt=epoch))
        return [e for i in rows for e in self.items[i]]


def conversation_experience(row: dict, fmt, tokenizer, max_tokens: int, task_id: str, where: str, index: int,
                            path: str, split: str = "train") -> Experience:
    """A `messages` row (a whole conversation) as one experience that trains on every assistant
    turn (format.enable_concatenated_multi_turn; rft/data/chat.py conversation_ids). A
    conversation longer than `max_tokens` (model.max_prompt_tokens + max_response_tokens) keeps
    its beginning."""
    from rft.data.chat import conversation_ids
    from rft.data.tasks import _line_hint

    if fmt.prompt_type != "messages":
        raise ConfigError(f"{where}.format.enable_concatenated_multi_turn=true needs {where}.format.prompt_type=messages "
                          f"(rows of whole conversations in format.messages_key).")
    messages = row.get(fmt.messages_key)
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ConfigError(f"{where}: {_line_hint(path, index, split)} of {path!r}: {fmt.messages_key!r} must be a list of "
                          f"messages ({{'role': ..., 'content': ...}}); got {str(messages)[:80]!r}.")
    try:
        ids, prompt_length, mask = conversation_ids(tokenizer, messages)
    except ConfigError as e:
        raise ConfigError(f"{where}: {_line_hint(path, index, split)} of {path!r}: {e}") from None
    cut = len(ids) > max_tokens
    if cut:
        ids, mask = ids[:max_tokens], mask[: max(max_tokens - prompt_length, 0)]
    return Experience(ids, prompt_length, [], task_id=task_id, group_id=str(index), loss_mask=mask,
                      info={"prompt_truncated": False, "response_truncated": cut})


def budget_report(ds, tokenizer, model_cfg, responses: bool, where: str, first: int = 256) -> str | None:
    """How many of the first rows' prompts (and, for a training dataset, responses) exceed the
    model's token budgets, and hold characters the tokenizer has no token for; None when all fit."""
    rows = load_rows(ds.path, ds.split, getattr(ds, "subset_name", None), key=f"{where}.path")
    rows = rows.select(range(min(first, len(rows))))
    fmt = ds.format
    if getattr(fmt, "enable_concatenated_multi_turn", False):  # whole conversations: one budget
        from rft.data.chat import conversation_ids

        budget = model_cfg.max_prompt_tokens + model_cfg.max_response_tokens
        lens = [len(conversation_ids(tokenizer, list(r[fmt.messages_key]))[0]) for r in rows]
        long = [n for n in lens if n > budget]
        if not long:
            return None
        return (f"{len(long)} of the first {len(lens)} conversations of {where} ({ds.path}) are longer than "
                f"model.max_prompt_tokens + max_response_tokens = {budget} tokens (the longest has {max(long)}) "
                f"and will be cut. Raise the budget or shorten the data (metric: train/truncated_responses).")
    messages = [rows_to_messages(r, fmt, where, i, ds.path) for i, r in enumerate(rows)]
    prompts = [len(chat_ids(tokenizer, m)) for m in messages]
    parts = []
    over = [n for n in prompts if n > model_cfg.max_prompt_tokens]
    if over:
        parts.append(f"{len(over)} of the first {len(prompts)} prompts of {where} ({ds.path}) are longer "
                     f"than model.max_prompt_tokens={model_cfg.max_prompt_tokens} tokens (the longest has "
                     f"{max(over)}, chat template included) and will be cut from the left")
    keys = [fmt.chosen_key, fmt.rejected_key] if fmt.chosen_key and fmt.rejected_key else [fmt.response_key]
    answers = [str(r[k]) for r in rows for k in keys if r.get(k) is not None] if responses and all(keys) else []
    lens = [len(tokenizer.encode(a, add_special_tokens=False)) + 1 for a in answers]
    long = [n for n in lens if n > model_cfg.max_response_tokens]
    if long:
        parts.append(f"{len(long)} of its first {len(lens)} responses are longer than "
                     f"model.max_response_tokens={model_cfg.max_response_tokens} (end-of-sequence token "
                     f"included; the longest has {max(long)}) and will be cut")
    texts = [" ".join(str(m.get("content", "")) for m in ms) for ms in messages]
    out = ["; ".join(parts) + ". Raise the budget or shorten the data (metrics: rollout/truncated_prompts, "
           "train/truncated_*)."] if parts else []
    out += [unknown_characters(tokenizer, texts, answers, f"of {where} ({ds.path})"),
            dropped_spaces(tokenizer, [[str(m.get("content", "")) for m in ms] for ms in messages], answers,
                           f"of {where} ({ds.path})")]
    return " ".join(t for t in out if t) or None


def dropped_spaces(tokenizer, prompts: list[list[str]], answers: list[str], where: str) -> str | None:
    """A sentence when the tokenizer drops the whitespace between two other characters of the
    `prompts` (each its messages' contents) or `answers`, None when it keeps it. A byte-level
    tokenizer whose vocabulary lacks a whitespace byte's token drops it: the tiny model's keeps
    spaces and newlines but not a tab (its v1 dropped all three: "sort dbca" reached the model as
    "sortdbca", and an answer "12 34" could never be written)."""
    gaps = re.compile(r"\S(\s+)\S")
    dropped: dict[str, bool] = {}  # each whitespace character's answer, asked of the tokenizer once

    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    def drops(text: str) -> bool:  # per character: a gap " \t" loses its tab where the space is kept
        for c in {c for m in gaps.finditer(text) for c in m.group(1)}:
            if c not in dropped:
                dropped[c] = enc(f"a{c}b") == enc("ab")
            if dropped[c]:
                return True
        return False

    rows = prompts + [[a] for a in answers]
    hit = [t for row in rows if (t := next((t for t in row if drops(t)), None)) is not None]
    if not hit:
        return None
    what, shown = "prompts and answers" if answers else "prompts", hit[0][:40]
    seen = "".join(c for c in shown if not dropped.get(c))  # what the tokenizer keeps stays
    return (f"{len(hit)} of the first {len(rows)} {what} {where} hold whitespace between two characters "
            f"that the tokenizer drops ({shown!r} reaches the model as {seen!r}): the "
            f"model cannot see where a word ends, nor write an answer that holds a space. Join the parts with a "
            f"character it keeps (a comma, as task=countdown does), or use a model whose tokenizer keeps spaces.")


def unknown_characters(tokenizer, prompts: list[str], responses: list[str], where: str) -> str | None:
    """A sentence naming the characters of the prompts (and responses) that the tokenizer has no
    token for (the tiny model's knows ASCII only, and drops the rest): the model does not see them,
    and a run would not say so. None when it has a token for each (whitespace aside)."""
    unk = tokenizer.unk_token_id
    known: dict[str, bool] = {}

    def unknown(text: str) -> list[str]:
        for c in dict.fromkeys(text):
            if c not in known:
                ids = tokenizer.encode(c, add_special_tokens=False)
                known[c] = c.isspace() or (bool(ids) and (unk is None or unk not in ids))
        return [c for c in dict.fromkeys(text) if not known[c]]

    phrases = []
    for what, texts in (("prompts", prompts), ("responses", responses)):
        found = [unknown(t) for t in texts]
        chars = list(dict.fromkeys(c for f in found for c in f))
        if chars:
            shown = ", ".join(map(repr, chars[:8])) + (", ..." if len(chars) > 8 else "")
            n = sum(map(bool, found))
            phrases.append(f"{n} of its first {len(texts)} {what} ({shown})" if phrases else
                           f"{n} of the first {len(texts)} {what} {where} hold characters the tokenizer has no "
                           f"token for ({shown})")
    if not phrases:
        return None
    return (f"{'; '.join(phrases)}: the model does not see them (each is dropped or read as the one unknown "
            f"token). Use a model whose tokenizer has them, or data without them.")
