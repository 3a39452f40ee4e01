"""The studio's rollouts page, without the page: what a run's policy wrote. The sources are the
run's stored experiences (sql and file buffers: `buffer.db`, `experiences.jsonl`, read with
rft.data.buffer's reader) and its saved eval trajectories (`eval_trajectories/step_N/<set>.jsonl`,
written for multi-turn evals). A queue buffer (the default) keeps no experiences: run with
`buffer=sql` or `buffer=file` to read them here. Where the stage saved a checkpoint, its tokenizer decodes each
experience's response in runs of equal loss mask: what was trained on, token-exact.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from rft import manifest
from rft.data.buffer import SQL_SUFFIXES, count_experiences, read_experiences
from rft.errors import ConfigError

# at most this many rows are read for one view (filters apply within them)
MAX_ROWS = 5000
# the rows view's orders (the page's menu): "" is the order stored
SORTS = {"": "stored order", "reward_desc": "reward, highest first", "reward_asc": "reward, lowest first",
         "length_desc": "length, longest first"}


# the fields of a stored experience the page reads, and their types; a row of another shape (a
# damaged file, or one rft did not write) is a 400 naming it: its text, list or object was a 500
# (tokens, prompt_length, loss_mask, logprobs, policy_version: Experience.from_dict checks them as it reads)
FIELDS = {"group_id": str, "task_id": str, "info": dict, "reward_parts": dict}
# an eval trajectory's fields and their types (null: absent); a message's content may be anything (shown as JSON)
EVAL_FIELDS = {"messages": list, "reward": (int, float), "task_id": str, "group_id": str, "reward_parts": dict}
JSON_NAMES = {int: "a whole number", float: "a number", str: "a string", list: "a list", dict: "an object", bool: "a boolean",
              type(None): "null"}


def _not_of_rft(where: str, field: str, value, kind) -> ValueError:
    kind = float if kind == (int, float) else kind
    return ValueError(f"{where}: {field} is {JSON_NAMES.get(type(value), 'a ' + type(value).__name__)} "
                      f"({json.dumps(value, default=str)[:80]}), not {JSON_NAMES[kind]}; the file is damaged or was not "
                      f"written by rft.")


def experiences(path: Path, source: str) -> list:
    """The source's first MAX_ROWS stored experiences; a ValueError naming the first that does not
    read or whose fields are not of the types rft stores."""
    try:
        exps = read_experiences(str(path), MAX_ROWS)
    except ConfigError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, RecursionError) as e:
        raise ValueError(f"{source}: a stored experience does not read ({type(e).__name__}: {e}); the file is "
                         f"damaged or was not written by rft.") from None
    for n, e in enumerate(exps):
        for field, kind in FIELDS.items():
            value = getattr(e, field)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise _not_of_rft(f"{source}, experience {n}", field, value, kind)
    return exps


def _reward(x) -> float:
    """A row's reward for sorting ((i, experience) or an eval row); none sorts as -inf."""
    r = x[1].reward if isinstance(x, tuple) else x["reward"]
    return r if isinstance(r, (int, float)) else float("-inf")


def sources(run: Path) -> list[dict]:
    """{"path" (relative to the run), "kind": "experiences" | "eval", "count"} for each source; one
    that cannot be read has count None and its "error" (a link out of the run among them: read()
    refuses it, and counting its lines read a file from outside the checkpoint root)."""
    from rft.studio.runs import inside

    run = Path(run)
    out = []
    for p in sorted(run.rglob("*")):
        rel = p.relative_to(run)
        if not p.is_file() or any(part.startswith("previous_") or part == "checkpoints" for part in rel.parts):
            continue
        kind = ("eval" if "eval_trajectories" in rel.parts and p.suffix == ".jsonl" else
                "experiences" if p.suffix in SQL_SUFFIXES or p.name.endswith("experiences.jsonl") else None)
        if kind is None:
            continue
        entry = {"path": rel.as_posix(), "kind": kind}
        try:
            inside(run, rel.as_posix())
        except ValueError:
            out.append({**entry, "count": None, "error": "a link out of the run directory: not read"})
            continue
        if kind == "eval":  # a line at a time (rft.manifest.read_lines): a line too long counts, read names it
            with open(p, "rb") as f:
                out.append({**entry, "count": sum(1 for line, _ in manifest.read_lines(f) if line is None or line.strip())})
            continue
        try:
            out.append({**entry, "count": count_experiences(str(p))})
        except Exception as e:  # damaged, or not a buffer: listed, saying why it cannot be read
            out.append({**entry, "count": None, "error": str(e)})
    return out


def _turns(messages, mask_roles=("assistant",)) -> list[dict]:
    """A conversation's turns, each marked trained (the assistant's sampled tokens: loss mask 1)
    or masked (the prompt, tool and user turns: in the context, never in the loss)."""
    return [{"role": m.get("role", "?"), "content": _text(m.get("content")),
             "tool_calls": m.get("tool_calls"), "trained": m.get("role") in mask_roles}
            for m in messages or [] if isinstance(m, dict)]


def _text(content) -> str:
    """A message's content as the page shows it: its text, or the JSON of a list of parts."""
    return content if isinstance(content, str) else "" if content is None else json.dumps(content)


def tokenizer_for(stage_dir: Path):
    """The tokenizer saved with the stage's newest checkpoint (hf/), or None: it turns stored token
    ids back into text piece by piece, so the loss mask can be shown token-exact."""
    found = sorted(Path(stage_dir).glob("checkpoints/step_*/hf/tokenizer_config.json"),
                   key=lambda p: int(p.parents[1].name[5:]) if p.parents[1].name[5:].isdigit() else -1)
    return _load_tokenizer(str(found[-1].parent)) if found else None


@functools.lru_cache(maxsize=8)
def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception:  # a tokenizer that needs remote code or is damaged: the text view stays
        return None


def segments(tok, e) -> list[dict]:
    """The response's tokens in runs of equal loss mask, each decoded: {"text", "trained"}."""
    ids = e.tokens[e.prompt_length:]
    mask = list(e.loss_mask) if e.loss_mask else [1] * len(ids)
    out, start = [], 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or mask[k] != mask[start]:
            out.append({"text": tok.decode(ids[start:k]), "trained": bool(mask[start])})
            start = k
    return out


def _experience_row(i: int, e, tok=None) -> dict:
    info = e.info or {}
    conversation = info.get("conversation")
    row = {"i": i, "step": e.policy_version, "task_id": e.task_id, "reward": e.reward,
           "parts": e.reward_parts or {}, "length": e.response_length,
           "prompt": info.get("prompt", f"token ids {e.tokens[:e.prompt_length]}"),
           "response": info.get("response", f"token ids {e.tokens[e.prompt_length:]}"),
           "trained_tokens": sum(e.loss_mask) if e.loss_mask else e.response_length,
           "turns": _turns(conversation) if conversation else None,
           "segments": segments(tok, e) if tok is not None and e.response_length else None}
    if conversation:
        # the first turns up to the first assistant turn are the prompt: masked, as the prompt is
        first = next((k for k, t in enumerate(row["turns"]) if t["role"] == "assistant"), len(row["turns"]))
        for t in row["turns"][:first]:
            t["trained"] = False
    return row


def _eval_row(i: int, step: int | None, d: dict) -> dict:
    messages = d.get("messages") or []
    turns = _turns(messages)
    prompt = next((t["content"] for t in turns if t["role"] == "user"), "")
    response = "\n".join(t["content"] for t in turns if t["role"] == "assistant")
    return {"i": i, "step": step, "task_id": d.get("task_id", ""), "reward": d.get("reward"),
            "parts": d.get("reward_parts") or {}, "length": None, "prompt": prompt, "response": response,
            "trained_tokens": None, "turns": turns}


def _eval_rows(path: Path, source: str, step: int | None) -> tuple[list[dict], int]:
    """(the rows of an eval trajectory file's first MAX_ROWS conversations, how many it holds); a
    ValueError naming the line that is not a JSON object, or is longer than any (read whole, a sparse
    20 GB file was a MemoryError or the OOM killer: rft.manifest.read_lines passes it unread)."""
    rows, total = [], 0
    with manifest.open_regular(path) as f:  # a FIFO or device: an OSError, not a request that never ends
        for i, (line, _) in enumerate(manifest.read_lines(f)):
            if line is None:
                raise ValueError(f"{source}, line {i + 1}: longer than {manifest.MAX_LINE >> 20} MiB, which no "
                                 f"conversation rft saves is: the file is damaged (or a sparse file).")
            if not line.strip():
                continue
            total += 1
            if len(rows) == MAX_ROWS:
                continue
            try:
                d = json.loads(line)
            except (ValueError, RecursionError) as e:
                raise ValueError(f"{source}, line {i + 1}: not JSON ({str(e).split(':')[0]}); each line is one "
                                 f"conversation, a JSON object.") from None
            if not isinstance(d, dict):
                raise ValueError(f"{source}, line {i + 1}: a JSON {type(d).__name__}, not an object; each line is one "
                                 f"conversation, a JSON object.")
            for field, kind in EVAL_FIELDS.items():
                if d.get(field) is not None and (not isinstance(d[field], kind) or isinstance(d[field], bool)):
                    raise _not_of_rft(f"{source}, line {i + 1}", field, d[field], kind)
            rows.append(_eval_row(i, step, d))
    return rows, total


def read(run: Path, source: str, min_reward: float | None = None, max_reward: float | None = None,
         step: int | None = None, limit: int = 200, offset: int = 0, search: str = "", sort: str = "") -> dict:
    """The source's rows that pass the filters (reward within [min, max], policy version or eval
    step equal to `step`, task id, prompt or response holding `search` in any case), in `sort`
    order (SORTS), `limit` of them from the `offset`-th on; {"rows", "matched", "read", "total"}:
    the filters apply to the first MAX_ROWS stored ("read") of the "total". Only the rows shown
    are decoded (a response's tokens piece by piece): 1,024 of them took 8.6 s."""
    if sort not in SORTS:
        raise ValueError(f"sort={sort!r}: one of {', '.join(repr(s) for s in SORTS)}.")
    from rft.studio.runs import inside

    path = inside(run, source)
    if "eval_trajectories" in Path(source).parts:
        step_dir = path.parent.name
        at = int(step_dir[5:]) if step_dir.startswith("step_") and step_dir[5:].isdigit() else None
        rows, total = _eval_rows(path, source, at)
        items = [(r["reward"], r["step"], r) for r in rows]
        text = {id(r): (r["task_id"], r["prompt"], r["response"], r["length"] or 0) for r in rows}
        tok = None
    else:
        items = [(e.reward, e.policy_version, (i, e)) for i, e in enumerate(experiences(path, source))]
        text = {id(x): (x[1].task_id, str(x[1].info.get("prompt", "")), str(x[1].info.get("response", "")),
                        x[1].response_length) for _, _, x in items}
        total = count_experiences(str(path))
        tok = False  # loaded for the first row shown

    def keep(reward, at):
        reward = reward if isinstance(reward, (int, float)) else None
        if min_reward is not None and (reward is None or reward < min_reward):
            return False
        if max_reward is not None and (reward is None or reward > max_reward):
            return False
        return step is None or at == step

    needle = search.lower()
    matched = [x for r, a, x in items if keep(r, a) and (not needle or any(needle in str(t).lower() for t in text[id(x)][:3]))]
    if sort:
        by = {"reward_desc": lambda x: -_reward(x), "reward_asc": _reward, "length_desc": lambda x: -text[id(x)][3]}[sort]
        matched.sort(key=by)  # stable: equal keys keep the stored order
    shown = matched[offset:offset + limit]
    if tok is False:
        tok = tokenizer_for(path.parent) if shown else None
        shown = [_experience_row(i, e, tok) for i, e in shown]
    return {"rows": shown, "matched": len(matched), "read": len(items), "total": total}
