"""The Experience: what an explorer hands the trainer for one sampled response."""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from rft.errors import ConfigError
from rft.registry import Registry

# the config key of the trainer's input, named in errors about it
WHERE = "buffer.trainer_input.experience_buffer"


@dataclass
class Experience:
    tokens: list[int]  # prompt + response token ids
    prompt_length: int
    # sampling log-prob of each response token (empty for SFT data). The "response" is everything
    # after the first prompt: in a multi-turn workflow it holds later turns of the user or an
    # environment too (their log-probs are not used: loss_mask leaves them out)
    logprobs: list[float]
    reward: float = 0.0
    group_id: str = ""  # rollouts of the same task in the same step share it
    task_id: str = ""
    # the weights version that generated it: with partial rollouts (explorer.partial_rollout) the
    # oldest of its tokens' versions, which is what its staleness counts
    policy_version: int = 0
    # how it was sampled: {"temperature", "top_p", "top_k"} (rollout_args); the trainer computes
    # log-probs under the same distribution. Empty: unknown (a dataset row, an old buffer):
    # temperature 1, no truncation
    sampling: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    # one entry per response token: 1 where the model is trained on the token, 0 where not (a
    # multi-turn workflow's user or tool turns). Empty: every response token
    loss_mask: list[int] = field(default_factory=list)
    # each reward part's value before weighting (rft/rewards/scoring.py): {"countdown": 1.0, "format": 1.0};
    # `reward` is their weighted sum
    reward_parts: dict = field(default_factory=dict)
    # one entry per response token: the weights version that sampled it (a partial rollout's
    # tokens come from the versions that held the engine while each chunk was generated); empty:
    # every token is policy_version's
    token_versions: list[int] = field(default_factory=list)

    def __post_init__(self):
        # a workflow passes on what ctx.score gave it (rft.rewards.scoring.Reward: a float with its parts)
        if not self.reward_parts and getattr(self.reward, "parts", None):
            self.reward_parts = dict(self.reward.parts)
        self.reward = float(self.reward)

    @property
    def response_length(self) -> int:
        return len(self.tokens) - self.prompt_length

    def to_dict(self) -> dict:
        """A JSON-able plain dict of every field: what the sql and file buffers store.

        Numbers are made plain Python ints and floats (an engine may hand out numpy or torch
        scalars); JSON writes floats in their shortest exact form, so they read back bit for bit.
        """
        return {
            "tokens": [int(t) for t in self.tokens],
            "prompt_length": int(self.prompt_length),
            "logprobs": [float(x) for x in self.logprobs],
            "reward": float(self.reward),
            "group_id": self.group_id,
            "task_id": self.task_id,
            "policy_version": int(self.policy_version),
            "sampling": dict(self.sampling),
            "info": copy.deepcopy(self.info),
            "loss_mask": [int(m) for m in self.loss_mask],
            "reward_parts": {str(k): float(v) for k, v in self.reward_parts.items()},
            "token_versions": [int(v) for v in self.token_versions],
        }

    @classmethod
    def from_dict(cls, d: dict, typed: bool = False) -> "Experience":
        """The inverse of `to_dict`; keys that are not fields (a newer writer's) are ignored. A
        ValueError names the first field that is not what to_dict writes (a damaged row, another
        tool's file): logprobs of every token, prompt included, were placed from the prompt's end
        and trained on as the response's, without a word. `typed`: the lists come from arrays of
        their types (rft.data.buffer.unpack_experiences), so only their lengths are checked (the
        check of each element was three quarters of reading 4,096 experiences of 1,024 tokens)."""
        if not isinstance(d, dict):
            raise ValueError(f"a JSON {type(d).__name__}, not an object")
        exp = cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})
        _check_stored(exp, typed)
        return exp


def _check_stored(e: Experience, typed: bool = False) -> None:
    whole = (lambda v: type(v) is int)  # noqa: E731 (JSON's true is no token id)
    number = (lambda v: type(v) in (int, float))  # noqa: E731
    each = (lambda ok, v: typed or all(map(ok, v)))  # noqa: E731
    if not (isinstance(e.tokens, list) and e.tokens and each(whole, e.tokens)):
        raise ValueError("tokens is not a non-empty list of token ids (whole numbers)")
    if not (whole(e.prompt_length) and 1 <= e.prompt_length <= len(e.tokens)):
        raise ValueError(f"prompt_length {e.prompt_length!r} is not a whole number from 1 to the {len(e.tokens)} tokens")
    for name, ok in (("logprobs", number), ("loss_mask", whole), ("token_versions", whole)):
        v = getattr(e, name)
        if not (isinstance(v, list) and each(ok, v)):
            raise ValueError(f"{name} is not a list of {'numbers' if ok is number else 'whole numbers'}")
        if v and len(v) != e.response_length:
            raise ValueError(f"{name} has {len(v)} entries for the {e.response_length} response tokens (tokens after "
                             f"prompt_length {e.prompt_length}): one per response token, or none")
    if not whole(e.policy_version):
        raise ValueError(f"policy_version {e.policy_version!r} is not a whole number")


def versions_of(exp: Experience) -> list[int]:
    """The version of each of its response tokens (policy_version for every one, without per-token
    versions)."""
    return list(exp.token_versions) if exp.token_versions else [exp.policy_version] * exp.response_length


def add_part(exp, name: str, value: float, weight: float = 1.0) -> None:
    """The one way (shaping's, a workflow's) to change a reward after the reward function gave it:
    a part of its own, added with its weight."""
    exp.reward_parts[name] = float(value)
    exp.reward = float(exp.reward) + weight * float(value)


def collate(exps: list[Experience], pad_id: int) -> dict:
    """Right-pad a list of experiences into tensors.

    Returns input_ids/attention_mask [n, L] and, aligned with the next-token targets
    input_ids[:, 1:], response_mask [n, L-1] (1 where the target is a response token the loss
    counts: the experience's loss_mask, all of them when it is empty); and the
    sampling parameters per row [n]: temperature (greedy and unknown count as 1), top_p, top_k
    (<= 0: off); and prompt_length [n].
    """
    import torch  # here, so storing and viewing experiences does not pay for importing torch

    L = max(len(e.tokens) for e in exps)
    # as padded Python lists, then one tensor each (a tensor write per row cost ~2 ms for 128 rows)
    ids, attention, response = [], [], []
    for e in exps:
        t, pad = len(e.tokens), L - len(e.tokens)
        ids.append(list(e.tokens) + [pad_id] * pad)
        attention.append([1] * t + [0] * pad)
        # target position t predicts token t+1: response tokens sit at prompt_length..len-1
        if e.prompt_length < 1:
            raise ValueError(f"experience {e.task_id!r}: prompt_length {e.prompt_length}: a response needs a "
                             f"prompt of at least one token to be predicted from")
        if e.loss_mask:
            if len(e.loss_mask) != e.response_length:
                raise ValueError(f"experience {e.task_id!r}: loss_mask has {len(e.loss_mask)} entries for "
                                 f"{e.response_length} response tokens (one per token after the prompt)")
            counted = [float(m) for m in e.loss_mask]
        else:
            counted = [1.0] * (t - e.prompt_length)
        response.append([0.0] * (e.prompt_length - 1) + counted + [0.0] * pad)
    input_ids = torch.tensor(ids, dtype=torch.long)
    attention_mask = torch.tensor(attention, dtype=torch.long)
    response_mask = torch.tensor(response, dtype=torch.float32)
    params = [sampling_params(e.sampling) for e in exps]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "response_mask": response_mask,
            "temperature": torch.tensor([p[0] for p in params], dtype=torch.float32),
            "top_p": torch.tensor([p[1] for p in params], dtype=torch.float32),
            "top_k": torch.tensor([p[2] for p in params], dtype=torch.long),
            "prompt_length": torch.tensor([e.prompt_length for e in exps], dtype=torch.long)}


def batch_record(step: int, exps: list[Experience]) -> dict:
    """What step `step` trained on, for batches.jsonl: its groups, the policy versions, and a
    digest of each experience's tokens and reward (hashed as bytes: a third of the time of JSON)."""
    import hashlib
    import struct
    from array import array

    h = hashlib.sha1()
    for e in exps:
        h.update(struct.pack("<qd", len(e.tokens), float(e.reward)))
        h.update(array("q", e.tokens).tobytes())
    return {"step": step, "groups": sorted({e.group_id for e in exps}),
            "versions": sorted(e.policy_version for e in exps), "digest": h.hexdigest()[:16]}


# the longest line of a stored experience read: ~17 bytes a token (its id, log-prob and mask as JSON),
# so 64 MiB is ~4M tokens, past any context. A longer line is damage (a sparse 20 GB file is one line
# of zeros: read whole, a MemoryError or the OOM killer), named by `too_long`
MAX_EXPERIENCE_LINE = 64 << 20


def too_long(path, n: int) -> str:
    """What a line of a stored buffer longer than MAX_EXPERIENCE_LINE is, for its reader's error."""
    return (f"{path}: line {n} is longer than {MAX_EXPERIENCE_LINE >> 20} MiB, which no stored experience is: "
            f"the file is damaged (by something other than rft's writer, or it is a sparse file)")


def is_experience_file(path) -> bool:
    """True for a JSONL file written by `FileBuffer` (its first line has "tokens"), false for
    anything else, such as a dataset of prompt/response rows. A first line longer than any
    experience is a ConfigError naming it (read whole, a sparse 20 GB file was a MemoryError)."""
    from rft.manifest import read_lines

    path = Path(os.path.expanduser(str(path)))
    if path.suffix != ".jsonl" or not path.is_file():
        return False
    with open(path, "rb") as f:
        for n, (line, _) in enumerate(read_lines(f, 0, MAX_EXPERIENCE_LINE), 1):
            if line is None:
                raise ConfigError(f"{too_long(path, n)}. Repair or delete that line, or give another file.")
            if line.strip():
                try:
                    row = json.loads(line)
                except (ValueError, RecursionError):  # not JSON, or nested a thousand deep
                    return False
                return isinstance(row, dict) and "tokens" in row
    return False


def sampling_params(sampling: dict) -> tuple[float, float, int]:
    """(temperature, top_p, top_k) of an experience's sampling. Greedy sampling (temperature 0)
    counts as temperature 1 with no top-k or top-p cut: both engines store the log-probs of the
    whole untempered distribution then (nothing is drawn from a cut one), whatever rollout_args'
    top_p and top_k say."""
    if not sampling.get("temperature", 1.0):
        return 1.0, 1.0, -1
    return float(sampling.get("temperature", 1.0)), float(sampling.get("top_p", 1.0)), int(sampling.get("top_k", -1))


# ---------------------------------------------------------------- replay priority

def linear_decay(exp: Experience, times_used: int, decay: float = 2.0) -> float:
    """Newer policies first, and each reuse costs `decay` versions of priority."""
    return exp.policy_version - decay * times_used


# name -> fn(exp, times_used, **priority_fn_args) -> priority; the highest is read first
PRIORITY_FNS = Registry("priority_fn", {"linear_decay": "rft.data.experience.linear_decay"})


def check_priority_fn(name: str, args, where: str) -> None:
    """replay_buffer.priority_fn names a known function, and priority_fn_args are arguments it takes."""
    import inspect

    from rft.config import near_args

    if name not in PRIORITY_FNS:
        raise ConfigError(f"{where}.priority_fn={name!r} is not known; choose one of {sorted(PRIORITY_FNS)}.")
    params = list(inspect.signature(PRIORITY_FNS[name]).parameters)[2:]
    unknown = sorted(set(args or {}) - set(params))
    if unknown:
        raise ConfigError(
            f"{where}.priority_fn_args has {unknown}, which priority_fn={name} does not take; "
            f"its arguments are {params}.{near_args(unknown, params)}"
        )
