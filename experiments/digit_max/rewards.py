"""The study's rewards, named by dotted path (experiments.digit_max.rewards.<fn>)."""

import time
import zlib

from rft.rewards.verifiers import exact_match


def exact_short(prompt: str, response: str, task, per_char: float = 0.1) -> dict:
    """Exact match (the built-in verifier) and a penalty of `per_char` for each character past the
    reference's length, as two named parts: their sum is the reward."""
    extra = max(0, len(response.strip()) - len(str(task.answer).strip()))
    return {"correct": exact_match(prompt, response, task), "length": -per_char * extra}


def flaky(prompt: str, response: str, task, raise_every: int = 0, hang_every: int = 0,
          hang_s: float = 3600.0) -> float:
    """exact_match, but like a real scorer that calls out to something: it raises on one response in
    `raise_every` and hangs `hang_s` seconds on one in `hang_every` (chosen by a checksum of the
    prompt and response, so the same response fails the same way on a retry)."""
    h = zlib.crc32(f"{prompt}\x00{response}".encode())
    if raise_every and h % raise_every == 0:
        raise ValueError(f"scorer backend refused {response!r}")
    if hang_every and (h // 7) % hang_every == 0:
        time.sleep(hang_s)
    return exact_match(prompt, response, task)
