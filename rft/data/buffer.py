"""Buffers: the only thing the explorer and the trainer share.

Three storages behind one interface (`put`, `get`, `state`, `restore`, `close`, `len`), chosen
by `storage_type` and built by `make_buffer`:

- `QueueBuffer` (queue): in memory, bounded by `capacity`; optionally a replay buffer that hands
  out read experiences again, highest priority first.
- `SQLBuffer` (sql): a SQLite database; durable, several writer processes, and a read cursor
  stored in the database so a restarted reader goes on where it stopped.
- `FileBuffer` (file): a JSONL file of experiences, appended under a file lock.

`DatasetReader` reads a dataset of prompt/response rows as experiences, for training without an
explorer (an SFT or DPO stage); `rft.data.experience.is_experience_file` tells such a dataset from a
`FileBuffer`'s file.

`read_experiences` and `count_experiences` look into a sql or file buffer without moving its
reader; `python -m rft.data.buffer <path>` prints what it holds.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import sqlite3
import sys
import threading
import time
from collections import Counter, deque
from contextlib import contextmanager
from pathlib import Path

import sqlalchemy as sa
from filelock import FileLock
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from rft.data.experience import (MAX_EXPERIENCE_LINE, PRIORITY_FNS, WHERE, Experience, check_priority_fn,
                                 is_experience_file, too_long)
from rft.errors import ConfigError, RunError
from rft.manifest import read_lines
from rft.registry import Registry

POLL_S = 0.05  # how often a waiting reader looks again where no writer can wake it


def _timeout(name: str, n: int, timeout: float, where: str) -> TimeoutError:
    return TimeoutError(
        f"buffer {name!r}: no experiences arrived within {timeout}s (wanted {n}). The writer (explorer) "
        f"may have stopped or be slow; raise {where}.max_read_timeout to wait longer."
    )


def _not_stored(what: str, e: Exception, cause: str, fix: str) -> RunError:
    """A stored buffer's row or line that does not read back as an experience (`e`): `what` names
    it, `cause` says why rft did not make it so, `fix` how to clear it."""
    return RunError(f"the buffer {what} is not a stored experience ({type(e).__name__}: {str(e)[:200]}); {cause}. "
                    f"{fix}, then run the same command again to resume from the newest checkpoint.")


def _needs_path(buf_cfg, where: str, what: str, suffix: str) -> Path:
    """The buffer's file, `~` expanded and its directory created; a sqlite:/// URL is a file too."""
    if not buf_cfg.path:
        raise ConfigError(
            f"{where}.storage_type={buf_cfg.storage_type} needs {where}.path: the {what} that holds the "
            f"experiences. Set it, e.g. {where}.path=~/rft-buffers/{buf_cfg.name}{suffix}, "
            f"or set {where}.storage_type=queue."
        )
    path = str(buf_cfg.path)
    if path.startswith("sqlite:///"):
        path = path[len("sqlite:///"):]
    path = Path(os.path.expanduser(path))
    if path.is_dir():  # a folder given for the buffer: the file buffer's first put was a raw IsADirectoryError
        raise ConfigError(
            f"{where}.path={str(buf_cfg.path)!r} is a folder; the buffer is one {what} (rft makes it). Name a file in "
            f"it, e.g. {where}.path={str(buf_cfg.path).rstrip('/')}/{buf_cfg.name}{suffix}.")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _no_replay(buf_cfg, where: str) -> None:
    if buf_cfg.replay_buffer.enable:
        raise ConfigError(
            f"{where}.replay_buffer.enable=true works with {where}.storage_type=queue only "
            f"(got {buf_cfg.storage_type}). Set {where}.storage_type=queue or disable the replay buffer."
        )


# ---------------------------------------------------------------- queue (in memory)

class QueueBuffer:
    """Experiences in this process's memory, shared by the threads that put and get.

    Without a replay buffer it is a plain FIFO. `put` blocks while the unread experiences would
    exceed `capacity`: a trainer that falls behind slows the explorers down instead of letting
    memory grow (back-pressure).

    With `replay_buffer.enable`, a read experience goes back in with its use count + 1 and can be
    read again after `reuse_cooldown_time` seconds (never, if null); among the experiences ready to
    be read, the highest `priority_fn` comes first, the oldest among equals. Used experiences do
    not hold back writers: when the buffer is over capacity the lowest-priority used ones go.
    `clock` times the cooldowns only (injectable, so tests need no sleeps); timeouts use real time.
    """

    def __init__(self, buf_cfg, where: str = WHERE, clock=time.monotonic):
        self.name, self.where = buf_cfg.name, where
        self.capacity = buf_cfg.capacity
        if self.capacity < 1:
            raise ConfigError(f"{where}.capacity={self.capacity} must be >= 1 (experiences held in memory).")
        self.put_timeout = buf_cfg.max_read_timeout
        rb = buf_cfg.replay_buffer
        self.replay = rb.enable
        self.cooldown = rb.reuse_cooldown_time
        check_priority_fn(rb.priority_fn, rb.priority_fn_args, f"{where}.replay_buffer")
        self.priority_fn, self.priority_args = PRIORITY_FNS[rb.priority_fn], dict(rb.priority_fn_args or {})
        self.clock = clock
        self._cond = threading.Condition()
        self._fifo: deque[Experience] = deque()  # without replay
        # with replay: [seq, times_used, ready_at, exp]; seq orders equal priorities oldest first
        self._entries: list[list] = []
        self._seq = 0

    def _unread(self) -> int:
        return sum(e[1] == 0 for e in self._entries) if self.replay else len(self._fifo)

    def put(self, exps: list[Experience]) -> None:
        if len(exps) > self.capacity:
            raise ConfigError(
                f"{self.where}.capacity={self.capacity} is smaller than one write of {len(exps)} experiences, "
                f"which could never fit. Raise {self.where}.capacity to at least {len(exps)}."
            )
        deadline = time.monotonic() + self.put_timeout
        with self._cond:
            while self._unread() + len(exps) > self.capacity:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"buffer {self.name!r} is full ({self.capacity} unread experiences) and no reader made "
                        f"room within {self.put_timeout}s. The trainer may have stopped; raise "
                        f"{self.where}.capacity or {self.where}.max_read_timeout if it is only slow."
                    )
                self._cond.wait(left)
            if not self.replay:
                self._fifo.extend(exps)
            else:
                for e in exps:
                    self._entries.append([self._seq, 0, float("-inf"), e])
                    self._seq += 1
                self._evict_used()
            self._cond.notify_all()

    def _evict_used(self) -> None:
        over = len(self._entries) - self.capacity
        if over > 0:
            used = [e for e in self._entries if e[1] > 0]
            drop = {id(e) for e in heapq.nsmallest(over, used, key=self._rank)}
            self._entries = [e for e in self._entries if id(e) not in drop]

    def _rank(self, entry) -> tuple:
        """Sort key: larger is read first (higher priority, then older)."""
        seq, used, _, exp = entry
        return (self.priority_fn(exp, used, **self.priority_args), -seq)

    def _ready(self) -> list:
        now = self.clock()
        return [e for e in self._entries if e[2] <= now]

    def get(self, n: int, timeout: float) -> list[Experience]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                have = len(self._ready()) if self.replay else len(self._fifo)
                left = deadline - time.monotonic()
                if have >= n or left <= 0:
                    break
                # cooldowns end without a notify: look again now and then
                self._cond.wait(min(left, POLL_S) if self.replay else left)
            if have == 0:
                raise _timeout(self.name, n, timeout, self.where)
            if not self.replay:
                out = [self._fifo.popleft() for _ in range(min(n, have))]
            else:
                taken = heapq.nlargest(n, self._ready(), key=self._rank)
                gone = {id(e) for e in taken}
                self._entries = [e for e in self._entries if id(e) not in gone]
                if self.cooldown is not None:
                    now = self.clock()
                    self._entries += [[seq, used + 1, now + self.cooldown, exp] for seq, used, _, exp in taken]
                out = [e[3] for e in taken]
            self._cond.notify_all()  # room for blocked writers
            return out

    def _parts(self) -> tuple[dict, list[Experience]]:
        """The state without its experiences, and the experiences: the unread ones, oldest first,
        then (replay) the used ones in write order, each with its place in the write order, its use
        count and the cooldown it has left, as the priority ranks them by these: a resumed run reads
        again what an uninterrupted one would. At most `capacity` experiences in all
        (`_evict_used`), which bounds a checkpoint's size."""
        with self._cond:
            if not self.replay:
                return {"items": len(self._fifo)}, list(self._fifo)
            now, entries = self.clock(), sorted(self._entries, key=lambda e: e[0])
            unread, used = [e for e in entries if e[1] == 0], [e for e in entries if e[1] > 0]
            return ({"items": len(unread), "item_seqs": [e[0] for e in unread],
                     "used": [{"seq": seq, "uses": n, "cooldown_left": max(0.0, ready - now)} for seq, n, ready, _ in used],
                     "next_seq": self._seq}, [e[3] for e in unread + used])

    def state(self) -> dict:
        """`_parts` as one JSON-able dict, each experience `Experience.to_dict` in place ("items", and
        each used entry's "exp"); a checkpoint stores `stored_state` instead."""
        meta, exps = self._parts()
        dicts = [e.to_dict() for e in exps]
        n = meta["items"]
        state = {**meta, "items": dicts[:n]}
        if "used" in meta:
            state["used"] = [{**u, "exp": d} for u, d in zip(meta["used"], dicts[n:])]
        return state

    def stored_state(self) -> tuple[dict, bytes | None]:
        """What a checkpoint stores: `_parts`'s dict ("items" the number of unread experiences),
        naming the file (EXPERIENCES_FILE) that holds the experiences as `pack_experiences` bytes
        (none where there is none: a run that trained on all it explored writes no file).
        As JSON numbers in state.json they took 18.5 KB an experience of 1,024 tokens (at 4,096: 76 MB,
        1.6 s to write, 1.2 s to verify and read back on 2 cores); packed, 6.4 KB (26 MB, 0.3 s and
        0.4 s: python tests/test_buffer_checkpoint.py)."""
        meta, exps = self._parts()
        return ({**meta, "experiences": EXPERIENCES_FILE}, pack_experiences(exps)) if exps else (meta, None)

    def restore(self, state: dict, experiences: list[Experience] | None = None) -> None:
        """Back to `state`: a `state()` (the experiences in it, as every checkpoint before
        `stored_state` holds them), or a `stored_state()` dict with its `experiences` unpacked. A
        ValueError names the entry that is not what either writes (a hand edit)."""
        items, used, seqs, next_seq = _restored(state, experiences, self.replay)
        with self._cond:
            self._fifo = deque([] if self.replay else items)
            self._entries, self._seq = [], len(items)
            if self.replay:
                now = self.clock()
                self._entries = [[s, 0, float("-inf"), e] for s, e in zip(seqs, items)]
                self._entries += [[u["seq"], u["uses"], now + u["cooldown_left"], e] for u, e in used]
                self._seq = next_seq
            self._cond.notify_all()

    def close(self) -> None:
        pass

    def __len__(self) -> int:
        with self._cond:
            return self._unread()


def _restored(state, experiences: list[Experience] | None, replay: bool) -> tuple[list, list, list, int]:
    """(the unread experiences, [(used entry, its experience)], the unread ones' places in the write
    order, the next place) of a QueueBuffer state (see `QueueBuffer.restore`); a ValueError names
    the first entry that is not what QueueBuffer writes. A checkpoint written before the used
    experiences were kept has only "items"; without replay the used ones are not read."""
    if not isinstance(state, dict):
        raise ValueError(f"it is a JSON {type(state).__name__}, not an object")
    raw = state.get("items")
    if experiences is None and not isinstance(raw, list):
        experiences = []  # a stored_state() with nothing to store names no file
    if experiences is None:
        if not isinstance(raw, list):
            raise ValueError(f'its "items" ({str(raw)[:80]}) is not a list of experiences')
        items = [_stored_experience(d, f'its "items" entry {i}') for i, d in enumerate(raw)]
    elif type(raw) is int and 0 <= raw <= len(experiences):
        items = experiences[:raw]
    else:
        raise ValueError(f'its "items" ({str(raw)[:80]}) is not a whole number from 0 to the {len(experiences)} '
                         f'experiences stored')
    if not replay:
        return items, [], [], len(items)
    seqs = state.get("item_seqs", list(range(len(items))))
    if not (isinstance(seqs, list) and len(seqs) == len(items) and all(type(s) is int for s in seqs)):
        raise ValueError(f'its "item_seqs" is not a list of {len(items)} whole numbers (one an unread experience)')
    raw_used, stored = state.get("used", []), None if experiences is None else experiences[len(items):]
    if not isinstance(raw_used, list) or (stored is not None and len(raw_used) != len(stored)):
        raise ValueError(f'its "used" is not a list of {"entries" if stored is None else len(stored)} entries '
                         f'(one a used experience)')
    used = []
    for i, u in enumerate(raw_used):
        why = _bad_used(u, stored is None)
        if why:
            shown = json.dumps({k: v for k, v in u.items() if k != "exp"} if isinstance(u, dict) else u)[:200]
            raise ValueError(f'its "used" entry {i} ({shown}) {why}')
        used.append((u, stored[i] if stored is not None else _stored_experience(u["exp"], f'its "used" entry {i}\'s "exp"')))
    next_seq = state.get("next_seq", len(items))
    if type(next_seq) is not int:
        raise ValueError(f'its "next_seq" ({str(next_seq)[:80]}) is not a whole number')
    return items, used, seqs, next_seq


def _bad_used(u, with_exp: bool) -> str | None:
    """What is wrong with a replay buffer's used entry as a state holds it, or None."""
    if not isinstance(u, dict):
        return "is not an object"
    missing = [k for k in ("seq", "uses", "cooldown_left", *(["exp"] if with_exp else [])) if k not in u]
    if missing:
        return f"has no {' and no '.join(map(repr, missing))}"
    if type(u["seq"]) is not int:
        return '"seq" is not a whole number'
    if not (type(u["uses"]) is int and u["uses"] >= 1):
        return '"uses" is not a whole number of 1 or more'
    if not (type(u["cooldown_left"]) in (int, float) and 0 <= u["cooldown_left"] < float("inf")):
        return '"cooldown_left" is not a number of seconds, 0 or more'
    return None


def _stored_experience(d, where: str, typed: bool = False) -> Experience:
    try:
        return Experience.from_dict(d, typed)
    except (ValueError, TypeError) as e:  # TypeError: a field missing
        raise ValueError(f"{where} is not a stored experience ({type(e).__name__}: {str(e)[:200]})") from None


# ---------------------------------------------------------------- experiences in a checkpoint

EXPERIENCES_FILE = "buffer_experiences.safetensors"  # beside state.json, sealed by its manifest
_PER_TOKEN = ("tokens", "logprobs", "loss_mask", "token_versions")  # lists: one array each, and their lengths
_PER_EXPERIENCE = {"prompt_length": "int64", "policy_version": "int64", "reward": "float64"}


def pack_experiences(exps: list[Experience]) -> bytes:
    """Experiences as safetensors bytes: each per-token list of them all in one array (token ids as
    int32 where they fit, log-probs as float32 where every one is a float32, as an engine's are:
    exact either way) with each one's length, the per-experience numbers in arrays, the rest as
    one JSON text. `unpack_experiences` gives them back equal, bit for bit."""
    import itertools

    import numpy as np
    from safetensors.numpy import save

    arrays = {}
    for name in _PER_TOKEN:
        values = [getattr(e, name) for e in exps]
        lengths = np.array([len(v) for v in values], dtype=np.int64)
        flat = np.fromiter(itertools.chain.from_iterable(values), dtype=np.float64 if name == "logprobs" else np.int64,
                           count=int(lengths.sum()))
        arrays[name], arrays[f"{name}.lengths"] = _narrowed(flat), lengths
    for name, dtype in _PER_EXPERIENCE.items():
        arrays[name] = np.array([getattr(e, name) for e in exps], dtype=dtype)
    # as Experience.to_dict has them: a reward part may come as a numpy or torch scalar
    text = json.dumps([{"group_id": e.group_id, "task_id": e.task_id, "sampling": e.sampling, "info": e.info,
                        "reward_parts": {str(k): float(v) for k, v in e.reward_parts.items()}} for e in exps]).encode()
    arrays["fields"] = np.frombuffer(text, dtype=np.uint8)
    return save(arrays, metadata={"format": "rft experiences 1"})


def _narrowed(a):
    import numpy as np

    small = a.astype(np.float32 if a.dtype.kind == "f" else np.int32)
    return small if np.array_equal(small.astype(a.dtype), a, equal_nan=a.dtype.kind == "f") else a


def unpack_experiences(data: bytes) -> list[Experience]:
    """The experiences `pack_experiences` packed; a ValueError names what is not as it writes."""
    import numpy as np
    from safetensors import SafetensorError
    from safetensors.numpy import load

    try:
        arrays = load(data)
        fields = json.loads(arrays["fields"].tobytes())
    except (SafetensorError, KeyError, ValueError, RecursionError) as e:
        raise ValueError(f"not a safetensors file of experiences ({type(e).__name__}: {str(e)[:200]})") from None
    if not (isinstance(fields, list) and all(isinstance(f, dict) for f in fields)):
        raise ValueError("its 'fields' is not a JSON list of objects, one an experience")
    n, columns = len(fields), {}
    for name in (*_PER_TOKEN, *_PER_EXPERIENCE):
        per = arrays.get(f"{name}.lengths" if name in _PER_TOKEN else name)
        if per is None or per.shape != (n,) or (name in _PER_TOKEN and (
                name not in arrays or (per < 0).any() or int(per.sum()) != arrays[name].size)):
            raise ValueError(f"its {name!r} is not {'lists' if name in _PER_TOKEN else 'values'} of the {n} "
                             f"experiences its 'fields' lists")
        if arrays[name].dtype.kind != ("f" if name in ("logprobs", "reward") else "i"):
            raise ValueError(f"its {name!r} is of {arrays[name].dtype}, not of {'floats' if name in ('logprobs', 'reward') else 'integers'}")
        if name in _PER_TOKEN:
            # each experience's slice made a list by itself: a list of all tokens first (8 bytes a
            # token beside what the experiences hold) raised a restore's peak from 1,287 to 1,413 MiB
            # (4,096 experiences of 4,096 tokens, held in 1,030)
            flat, ends = arrays[name], np.cumsum(per).tolist()
            columns[name] = [flat[a:b].tolist() for a, b in zip([0, *ends], ends)]
        else:
            columns[name] = per.tolist()
    # the arrays' dtypes (checked above) make every element of its type: only lengths are checked
    return [_stored_experience({**fields[i], **{k: v[i] for k, v in columns.items()}}, f"experience {i}", typed=True)
            for i in range(n)]


# ---------------------------------------------------------------- sql (SQLite)

_metadata = sa.MetaData()
_experiences = sa.Table(
    "experiences", _metadata,
    # AUTOINCREMENT: ids are never reused, even after truncate_after deletes the newest rows, so
    # a row written later always gets an id above every cursor, and no reader skips it
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("policy_version", sa.Integer, nullable=False),
    sa.Column("task_id", sa.Text, nullable=False),
    sa.Column("group_id", sa.Text, nullable=False),
    sa.Column("reward", sa.Float, nullable=False),
    sa.Column("prompt_length", sa.Integer, nullable=False),
    sa.Column("response_length", sa.Integer, nullable=False),
    sa.Column("tokens", sa.Text, nullable=False),  # JSON
    sa.Column("logprobs", sa.Text, nullable=False),  # JSON
    sa.Column("info", sa.Text, nullable=False),  # JSON
    sa.Column("sampling", sa.Text),  # JSON: temperature, top_p, top_k (absent in older files)
    sa.Column("extra", sa.Text),  # JSON: every other Experience field (loss_mask, ...)
    # for people reading the database, not for the trainer
    sa.Column("prompt_text", sa.Text),
    sa.Column("response_text", sa.Text),
    sqlite_autoincrement=True,
)
_cursors = sa.Table(
    "read_cursors", _metadata,
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("position", sa.Integer, nullable=False),  # the last id read
)


# the columns SQLBuffer.unread_digest covers, fixed: a column added by a later version is not among
# them, as its ALTER TABLE (_add_missing_columns) gives every stored row a NULL there, which would
# change the digest a checkpoint of the earlier version recorded and stop a legitimate resume
_DIGESTED = ("id", "created_at", "policy_version", "task_id", "group_id", "reward", "prompt_length",
             "response_length", "tokens", "logprobs", "info", "sampling", "extra", "prompt_text", "response_text")


def _engine(path: Path, read_only: bool = False) -> sa.Engine:
    # the URL made from its parts, never parsed from text: in f"sqlite:///{path}" a path holding '?'
    # (a run named "lr?1") had the rest taken for the URL's query, so the buffer was the file before
    # it (<project>/lr, shared by every such run) or a raw ValueError (?timeout=...), '%' was decoded
    # ("50%25" -> "50%"), and in the read-only file: URI a '#' ended the path (another file read)
    if read_only:  # a uri with mode=ro: never creates the file, never writes
        from urllib.parse import quote

        return sa.create_engine(sa.URL.create("sqlite", database=f"file:{quote(str(path))}",
                                              query={"mode": "ro", "uri": "true"}))
    engine = sa.create_engine(sa.URL.create("sqlite", database=str(path)))

    @sa.event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn, _record):
        cur = dbapi_conn.cursor()
        # wait for another process's write lock instead of failing at once (first, so that
        # switching to WAL waits too); WAL lets the reader read while writers write; NORMAL
        # syncs at checkpoints, not at every commit: a power cut may lose the last commits but
        # cannot corrupt the file, and a killed process loses nothing it committed
        cur.execute("PRAGMA busy_timeout=60000")
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    return engine


# Experience fields kept in columns of their own; every other field goes into `extra` (JSON), so a
# new field (a workflow's loss_mask) needs no new column
_COLUMN_FIELDS = ("tokens", "prompt_length", "logprobs", "reward", "group_id", "task_id", "policy_version",
                  "sampling", "info")


def _row(exp: Experience, now: float) -> dict:
    d = exp.to_dict()
    prompt, response = exp.info.get("prompt"), exp.info.get("response")
    return dict(extra=json.dumps({k: v for k, v in d.items() if k not in _COLUMN_FIELDS}),
        created_at=now, policy_version=d["policy_version"], task_id=d["task_id"], group_id=d["group_id"],
        reward=d["reward"], prompt_length=d["prompt_length"], response_length=exp.response_length,
        tokens=json.dumps(d["tokens"]), logprobs=json.dumps(d["logprobs"]), info=json.dumps(d["info"]),
        sampling=json.dumps(d["sampling"]),
        prompt_text=None if prompt is None else str(prompt), response_text=None if response is None else str(response),
    )


def _experience(row) -> Experience:
    return Experience.from_dict({
        **json.loads(getattr(row, "extra", None) or "{}"),
        "tokens": json.loads(row.tokens), "prompt_length": row.prompt_length, "logprobs": json.loads(row.logprobs),
        "reward": row.reward, "group_id": row.group_id, "task_id": row.task_id,
        "policy_version": row.policy_version, "sampling": json.loads(getattr(row, "sampling", None) or "{}"),
        "info": json.loads(row.info),
    })


# the columns every version of rft wrote: a table `experiences` without them is another tool's
_FIRST_COLUMNS = ("id", "created_at", "policy_version", "task_id", "group_id", "reward", "prompt_length",
                  "response_length", "tokens", "logprobs", "info")


def _not_anothers_table(path: Path, where: str) -> None:
    """Before rft opens it to write (its WAL mode is the file's own setting) or creates or adds
    anything: a file whose `experiences` table another tool made (a name anyone may use) had rft's
    columns added to it and rows written into it, found only when reading them back."""
    if not path.is_file():
        return
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            have = {r[1] for r in db.execute("PRAGMA table_info(experiences)")}
        finally:
            db.close()
    except sqlite3.DatabaseError:  # not a database, or damaged: opening it below says so
        return
    missing = [name for name in _FIRST_COLUMNS if name not in have]
    if have and missing:
        raise ConfigError(
            f"{where}.path={str(path)!r} holds a table `experiences` that rft did not write (it has no column "
            f"{', '.join(missing)}; another tool's database?). rft changes nothing in it: point {where}.path at "
            f"a file of its own (a new one is started there).")


def _add_missing_columns(c) -> None:
    """A buffer written by an older version lacks newer (nullable) columns: add them."""
    have = {r[1] for r in c.exec_driver_sql("PRAGMA table_info(experiences)")}
    for col in _experiences.columns:
        if col.name not in have:
            c.exec_driver_sql(f"ALTER TABLE experiences ADD COLUMN {col.name} {col.type.compile()}")


def _select_experiences(c):
    """SELECT of the experience columns this file has (a read-only reader cannot add any)."""
    have = {r[1] for r in c.exec_driver_sql("PRAGMA table_info(experiences)")}
    return sa.select(*[col for col in _experiences.columns if col.name in have])


class _KeepsWhatItWrote:
    """A resumed writer's rows written after its checkpoint stay where they are (mode=explore,
    rft.runtime.saving): a trainer elsewhere may be reading the buffer live, its place a row id or a
    byte offset, and removing or rewriting rows under it made it read a row twice and skip another
    (exit 0), or read from the middle of a line; other explorers' rows sit among them. The resumed
    run explores those steps again and `put` leaves out the rows already stored: per group id as
    many as there are (a put is one explore step's rows, each group's in order, so a write killed
    midway leaves the first rows of each group), so each row is stored, and read, once."""

    def keep_written(self, last_id: int, own) -> int:
        """The rows after `last_id` whose group id `own(group_id)` says this writer wrote are not
        written again (`_unwritten`); returns how many."""
        self._written = Counter(self._groups_after(last_id, own))
        return sum(self._written.values())

    def _unwritten(self, exps: list[Experience]) -> list[Experience]:
        written = getattr(self, "_written", None)
        if not written:
            return exps
        out = []
        for e in exps:
            if written[e.group_id] > 0:
                written[e.group_id] -= 1
            else:
                out.append(e)
        return out


class SQLBuffer(_KeepsWhatItWrote):
    """Experiences in a SQLite database: any number of writer processes, one reader per name.

    The reader reads rows in id order after its cursor (the last id it read), which it stores in
    `read_cursors` under `buf_cfg.name` at every read, so a restarted reader goes on where it
    stopped. Why reading "id > cursor" never skips a row, with several writers: SQLite lets one
    writer at a time hold the write lock, and a row's id is assigned under that lock, greater than
    every id already in the table. A transaction's rows become visible together at its commit,
    before the next writer can take the lock. So when a reader sees id k+1, every row with a smaller
    id is already committed and visible; no row can appear later below the cursor.
    """

    def __init__(self, buf_cfg, where: str = WHERE):
        _no_replay(buf_cfg, where)
        self.cfg, self.where, self.name = buf_cfg, where, buf_cfg.name
        self.path = _needs_path(buf_cfg, where, "SQLite file", ".db")
        _not_anothers_table(self.path, where)
        self.engine = _engine(self.path)
        try:
            with self.engine.begin() as c:  # IF NOT EXISTS: several processes may create it at once
                for table in _metadata.sorted_tables:
                    c.execute(sa.schema.CreateTable(table, if_not_exists=True))
                _add_missing_columns(c)
                pos = c.execute(sa.select(_cursors.c.position).where(_cursors.c.name == self.name)).scalar()
        except sa.exc.DatabaseError as e:
            self.engine.dispose()
            raise ConfigError(
                f"{where}.path={str(buf_cfg.path)!r} is not a SQLite database of experiences, or it is "
                f"damaged ({e.orig}). Move the file away (a new buffer is then started there) or point "
                f"{where}.path at another file."
            ) from e
        self.cursor = pos or 0

    def __reduce__(self):
        # a copy sent to another process (a Ray actor) opens the same file; its cursor is in there
        return (type(self), (self.cfg, self.where))

    @contextmanager
    def _damage_named(self):
        """A database damaged while the run uses it (a page, not the header, which opening finds):
        one paragraph naming the file, not SQLAlchemy's traceback."""
        try:
            yield
        except sa.exc.DatabaseError as e:
            code = getattr(e.orig, "sqlite_errorcode", None)
            if code in (sqlite3.SQLITE_FULL, sqlite3.SQLITE_READONLY):  # the file is whole: moving it away loses it
                why, fix = ("its disk is full", "make room") if code == sqlite3.SQLITE_FULL else \
                    ("it or its disk is read-only", "make it writable")
                raise RunError(
                    f"the buffer {self.path} cannot be written: {why} ({e.orig}). The file is whole (the write "
                    f"that failed left nothing in it): {fix}, then run the same command again to resume from the "
                    f"newest checkpoint.") from None
            raise RunError(
                f"the buffer {self.path} is damaged ({e.orig}), so its experiences cannot be read or "
                f"written. Restore the file from a copy and run the same command again to resume from the "
                f"newest checkpoint; without one, move the file away first (the resume then says whether "
                f"the checkpoint needed anything from it)."
            ) from None

    def put(self, exps: list[Experience]) -> None:
        exps = self._unwritten(exps)
        if exps:
            now = time.time()
            with self._damage_named(), self.engine.begin() as c:  # one transaction: all rows or none
                c.execute(_experiences.insert(), [_row(e, now) for e in exps])

    def _save_cursor(self, c) -> None:
        stmt = sqlite_insert(_cursors).values(name=self.name, position=self.cursor)
        c.execute(stmt.on_conflict_do_update(index_elements=["name"], set_={"position": self.cursor}))

    def get(self, n: int, timeout: float) -> list[Experience]:
        deadline = time.monotonic() + timeout
        query = sa.select(_experiences).order_by(_experiences.c.id).limit(n)
        while True:
            with self._damage_named(), self.engine.connect() as c:
                rows = c.execute(query.where(_experiences.c.id > self.cursor)).all()
            if len(rows) >= n or time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        if not rows:
            raise _timeout(self.name, n, timeout, self.where)
        exps = [self._read_row(r) for r in rows]
        self.cursor = rows[-1].id
        with self._damage_named(), self.engine.begin() as c:
            self._save_cursor(c)
        return exps

    def _read_row(self, row) -> Experience:
        try:
            return _experience(row)
        except (ValueError, TypeError, RecursionError) as e:  # not JSON, or not an experience's fields
            raise _not_stored(f"{self.path}: row id {row.id} of table experiences", e,
                              "rft writes each row whole, so something else changed it",
                              f"Repair or delete that row (sqlite3 {self.path} 'DELETE FROM experiences WHERE id = "
                              f"{row.id}')") from None

    def state(self) -> dict:
        return {"cursor": self.cursor, "last_id": self._last_id()}

    def _last_id(self) -> int:
        with self._damage_named(), self.engine.connect() as c:
            return c.execute(sa.select(sa.func.max(_experiences.c.id))).scalar() or 0

    def restore(self, state: dict) -> None:
        self.cursor = int(state["cursor"])
        with self.engine.begin() as c:
            self._save_cursor(c)

    def unread_digest(self, cursor: int, last_id: int) -> str:
        """The xxh3-128 of the rows after `cursor` up to `last_id`, every column: what a checkpoint
        records of the experiences it explored ahead (SQLite checksums no page, so a changed byte in
        a row would read back as another token or reward)."""
        import xxhash

        h = xxhash.xxh3_128()
        columns = [_experiences.c[name] for name in _DIGESTED]
        query = sa.select(*columns).where(_experiences.c.id > cursor, _experiences.c.id <= last_id)
        with self._damage_named(), self.engine.connect() as c:
            for row in c.execute(query.order_by(_experiences.c.id)):
                h.update(json.dumps(list(row), default=str).encode() + b"\n")
        return h.hexdigest()

    def truncate_after(self, last_id: int) -> int:
        """Delete the rows after `last_id`; returns how many.

        A resumed run drops what its explorers wrote after the checkpoint it resumes from: they
        write those experiences again, identically.
        """
        with self.engine.begin() as c:
            return c.execute(sa.delete(_experiences).where(_experiences.c.id > last_id)).rowcount

    def _groups_after(self, last_id: int, own) -> list[str]:
        """The group ids of the rows after `last_id` that `own` says are this writer's, in order."""
        with self._damage_named(), self.engine.connect() as c:
            rows = c.execute(sa.select(_experiences.c.group_id).where(_experiences.c.id > last_id)
                             .order_by(_experiences.c.id))
            return [g for (g,) in rows if own(g)]

    def close(self) -> None:
        self.engine.dispose()

    def __len__(self) -> int:
        with self.engine.connect() as c:
            return c.execute(sa.select(sa.func.count()).where(_experiences.c.id > self.cursor)).scalar()


# ---------------------------------------------------------------- file (JSONL)

class FileBuffer(_KeepsWhatItWrote):
    """Experiences as lines of JSON (`Experience.to_dict`) in one file.

    Writers append under a file lock (`<path>.lock`) and fsync. The reader keeps a byte offset
    and reads whole lines only: a last line without its newline is a write still in progress.
    """

    def __init__(self, buf_cfg, where: str = WHERE):
        _no_replay(buf_cfg, where)
        self.cfg, self.where, self.name = buf_cfg, where, buf_cfg.name
        self.path = _needs_path(buf_cfg, where, "JSONL file", ".jsonl")
        self.lock = FileLock(str(self.path) + ".lock")
        self.offset = 0

    def __reduce__(self):
        return (_reopened, (type(self), self.cfg, self.where, self.state()))

    def put(self, exps: list[Experience]) -> None:
        exps = self._unwritten(exps)
        if not exps:
            return
        data = "".join(json.dumps(e.to_dict()) + "\n" for e in exps).encode()
        with self.lock, open(self.path, "ab+") as f:
            # under the lock no write is in progress: a last line without its newline is what a
            # killed writer left, and nobody has read it; cut it off so the file stays whole lines
            end = f.seek(0, os.SEEK_END)
            if end:
                f.truncate(_whole_lines_end(f, end))
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def _read_lines(self, n: int) -> tuple[list[bytes], int]:
        """Up to n whole lines after the offset, and the offset after them. A line longer than any
        experience is a RunError naming it: read whole (readline), a sparse 20 GB file was a
        MemoryError or the OOM killer."""
        lines, offset = [], self.offset
        if not self.path.exists():
            return lines, offset
        with open(self.path, "rb") as f:
            for line, end in _lines(f, offset):
                if len(lines) >= n:
                    break
                if line is None:
                    raise RunError(f"the buffer {too_long(self.path, _line_at(f, offset))}. Repair or delete that "
                                   f"line, then run the same command again to resume from the newest checkpoint.")
                if not line.endswith(b"\n"):  # the end, or a line still being written
                    break
                offset = end
                if line.strip():
                    lines.append(line)
        return lines, offset

    def get(self, n: int, timeout: float) -> list[Experience]:
        deadline = time.monotonic() + timeout
        while True:
            lines, offset = self._read_lines(n)
            if len(lines) >= n or time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        if not lines:
            raise _timeout(self.name, n, timeout, self.where)
        exps = []
        for line in lines:
            try:
                exps.append(Experience.from_dict(json.loads(line)))
            except (ValueError, TypeError, RecursionError) as e:  # not JSON, or not an experience's fields
                raise _not_stored(f"{self.path}: line {self._line_number(line)}", e, "a writer's kill leaves "
                                  "only a last line cut short, so something else damaged the file",
                                  "Repair or delete that line") from None
        self.offset = offset
        return exps

    def _line_number(self, line: bytes) -> int:
        """The number of the first line after the read offset equal to `line` (for a message)."""
        with open(self.path, "rb") as f:
            before = _line_at(f, self.offset) - 1
            for n, (candidate, _) in enumerate(_lines(f, self.offset), before + 1):
                if candidate == line:
                    return n
        return before + 1

    def state(self) -> dict:
        # last_id: the write position, as for SQLBuffer (here the length of the whole lines)
        end = 0
        if self.path.exists():
            with open(self.path, "rb") as f:
                end = _whole_lines_end(f, f.seek(0, os.SEEK_END))
        return {"offset": self.offset, "last_id": end}

    def restore(self, state: dict) -> None:
        self.offset = int(state["offset"])

    def unread_digest(self, offset: int, last_id: int) -> str:
        """The xxh3-128 of the file's bytes from `offset` to `last_id` (as SQLBuffer.unread_digest)."""
        import xxhash

        h = xxhash.xxh3_128()
        if self.path.exists():
            with open(self.path, "rb") as f:
                f.seek(offset)
                left = max(0, last_id - offset)
                while left:
                    chunk = f.read(min(left, 1 << 24))
                    if not chunk:
                        break
                    h.update(chunk)
                    left -= len(chunk)
        return h.hexdigest()

    def truncate_after(self, last_id: int) -> int:
        """Cut the file back to `last_id` bytes (a state's write position); returns lines removed."""
        if not self.path.exists():
            return 0
        with self.lock, open(self.path, "rb+") as f:
            dropped = sum(1 for line, _ in _lines(f, last_id) if line is None or line.strip())
            f.truncate(last_id)
        return dropped

    def _groups_after(self, last_id: int, own) -> list[str]:
        """The group ids of the whole lines after byte `last_id` that `own` says are this writer's,
        in order (a line that does not parse is not this writer's: a reader names it). Line by
        line: read whole, the rows after a checkpoint (other explorers' too, written while this one
        was down) took twice their size in memory, 564 MiB at 4,096 rows of 4,096 tokens."""
        if not self.path.exists():
            return []
        groups = []
        with open(self.path, "rb") as f:
            for line, _ in _lines(f, last_id):  # None: longer than any experience, no writer's
                if line is not None and line.endswith(b"\n"):  # else a cut last line: a killed writer's
                    group = _group_of(line)
                    if group is not None and own(group):
                        groups.append(group)
        return groups

    def close(self) -> None:
        pass

    def __len__(self) -> int:
        if not self.path.exists():
            return 0
        with open(self.path, "rb") as f:  # a line longer than any experience counts: get names it
            return sum(1 for line, _ in _lines(f, self.offset) if line is None or line.endswith(b"\n") and line.strip())


def _lines(f, start: int = 0):
    """(each line, the offset after it) of file `f` from byte `start`, one at a time (rft.manifest's
    read_lines): None for a line longer than MAX_EXPERIENCE_LINE, passed unread. Read 64 KiB at a
    time: the rows after a checkpoint are read with a peak of about one row (a MiB at a time, 4.2 MB
    at rows of 140 KB, where 2.9 MB is one row and its JSON)."""
    return read_lines(f, start, MAX_EXPERIENCE_LINE, 1 << 16)


def _line_at(f, pos: int) -> int:
    """The number of the line of file `f` that starts at byte `pos` (a MiB at a time: it may be GBs in)."""
    n, at = 1, 0
    while at < pos:
        chunk = os.pread(f.fileno(), min(1 << 20, pos - at), at)
        if not chunk:
            break
        n, at = n + chunk.count(b"\n"), at + len(chunk)
    return n


def _group_of(line: bytes) -> str | None:
    try:
        group = json.loads(line).get("group_id")
    except (ValueError, AttributeError, RecursionError):
        return None
    return group if isinstance(group, str) else None


def _whole_lines_end(f, end: int) -> int:
    """The offset just after the last newline of a file of size `end` (0 if none)."""
    pos = end
    while pos > 0:
        start = max(0, pos - 65536)
        f.seek(start)
        i = f.read(pos - start).rfind(b"\n")
        if i >= 0:
            return start + i + 1
        pos = start
    return 0


def _reopened(cls, buf_cfg, where, state):
    buf = cls(buf_cfg, where)
    buf.restore(state)
    return buf


# name -> class(buf_cfg, where): the storage_type values
BUFFERS = Registry("storage_type", {
    "queue": "rft.data.buffer.QueueBuffer",
    "sql": "rft.data.buffer.SQLBuffer",
    "file": "rft.data.buffer.FileBuffer",
})


def make_buffer(buf_cfg, where: str = WHERE):
    """The buffer that `buf_cfg.storage_type` names (rft.config.StorageType), configured by
    `buf_cfg` (found at `where`)."""
    return BUFFERS[buf_cfg.storage_type](buf_cfg, where)


# ---------------------------------------------------------------- reading stored experiences

SQL_SUFFIXES = (".db", ".sqlite", ".sqlite3")


def _stored(path: str, limit: int, offset: int, located: bool = False) -> tuple[int, list[tuple[int, Experience]]]:
    """(how many are stored, [(id, experience)] of up to `limit` after the first `offset`); `located`:
    one that does not read is a ConfigError naming its line or row (else the reader's own error)."""
    path = str(path)
    local = Path(os.path.expanduser(path[len("sqlite:///"):] if path.startswith("sqlite:///") else path))
    if not local.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if path.startswith("sqlite:///") or local.suffix in SQL_SUFFIXES:
        engine = _engine(local, read_only=True)
        try:
            with engine.connect() as c:
                total = c.execute(sa.select(sa.func.count()).select_from(_experiences)).scalar()
                query = _select_experiences(c).order_by(_experiences.c.id).limit(limit).offset(offset)
                return total, [(r.id, _read_back(_experience, r, f"{path}: row id {r.id}", located))
                               for r in c.execute(query)]
        except sa.exc.DatabaseError as e:
            raise ConfigError(f"{path} is not a database of stored experiences ({e.orig}).") from e
        finally:
            engine.dispose()
    if local.suffix == ".jsonl":
        if local.stat().st_size and not is_experience_file(local):
            raise ConfigError(f"{path} is not a file of stored experiences (a dataset of prompt/response rows?).")
        total, out = 0, []
        with open(local, "rb") as f:
            for n, (line, _) in enumerate(_lines(f), 1):
                if line is None:  # read whole, a sparse 20 GB file was a MemoryError
                    raise ConfigError(f"{too_long(path, n)}. Repair or delete that line.")
                if line.endswith(b"\n") and line.strip():
                    if offset <= total < offset + limit:
                        out.append((total, _read_back(lambda x: Experience.from_dict(json.loads(x)), line,
                                                      f"{path}: line {n}", located)))
                    total += 1
        return total, out
    raise ConfigError(
        f"{path}: not a buffer; expected a SQLite file ({', '.join(SQL_SUFFIXES)} or sqlite:///...) or a .jsonl file."
    )


def _read_back(read, what, where: str, located: bool) -> Experience:
    """`read(what)`, the stored experience; where it is not one and `located`, a ConfigError naming
    `where` (the file and its line or row): a damaged line ended `python -m rft.data.buffer` in a raw
    JSONDecodeError. (The studio says it its own way, naming the run's file.)"""
    try:
        return read(what)
    except (ValueError, TypeError, RecursionError) as e:  # not JSON, or not an experience's fields
        if not located:
            raise
        raise ConfigError(f"{where} is not a stored experience ({type(e).__name__}: {str(e)[:200]}): the file is "
                          f"damaged or edited there; repair or delete it to read past it.") from None


def read_experiences(path: str, limit: int, offset: int = 0) -> list[Experience]:
    """Up to `limit` stored experiences after the first `offset`, oldest first, from a sql buffer
    (.db, .sqlite or a sqlite:/// URL) or a file buffer (.jsonl). Read-only: no cursor moves."""
    return [e for _, e in _stored(path, limit, offset)[1]]


def count_experiences(path: str, key: str = "path") -> int:
    """How many experiences a sql or file buffer holds (read or not)."""
    try:
        return _stored(path, 0, 0)[0]
    except FileNotFoundError as e:
        raise ConfigError(f"{key}={path!r}: no such file (relative paths are relative to {os.getcwd()}).") from e


# ---------------------------------------------------------------- python -m rft.data.buffer <path>

def _shown(text) -> str:
    text = str(text)
    return text if text.isprintable() else repr(text)


def _text(exp: Experience, key: str, tokens: list[int]) -> str:
    text = exp.info.get(key)
    return repr(text) if text is not None else f"token ids {tokens}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rft.data.buffer",
                                     description="Print the experiences stored by a sql or file buffer.")
    parser.add_argument("path", help="a .db/.sqlite file (or sqlite:/// URL) or a .jsonl file")
    parser.add_argument("--limit", type=int, default=4, help="how many to print")
    parser.add_argument("--offset", type=int, default=0, help="how many to skip first")
    args = parser.parse_args(argv)
    try:
        total, rows = _stored(args.path, args.limit, args.offset, located=True)
    except (FileNotFoundError, ConfigError) as e:
        print(f"rft.data.buffer: {e}", file=sys.stderr)
        return 2
    print(f"{args.path}: {total} experiences; showing {len(rows)} from offset {args.offset}")
    for i, e in rows:
        # a stored id is text from the file: with an escape sequence (OSC 52 sets the clipboard) shown as its repr
        print(f"\n[{i}] task_id={_shown(e.task_id)} group_id={_shown(e.group_id)} policy_version={e.policy_version} "
              f"reward={e.reward:g}")
        if e.reward_parts:
            print("  parts:    " + ", ".join(f"{k}={v:g}" for k, v in e.reward_parts.items()))
        print(f"  prompt:   {_text(e, 'prompt', e.tokens[:e.prompt_length])}")
        print(f"  response: {_text(e, 'response', e.tokens[e.prompt_length:])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
