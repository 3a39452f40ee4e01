"""Directories rft builds itself on first use, in cache_dir: the tiny model (rft/models.py) and the
generated task data (rft/tasks.py). Each is built in <dir>.tmp, sealed with a manifest
(rft/manifest.py) and renamed into place, and checked against it before each use. A damaged one
(a cut train.jsonl, a cut config.json, a zeroed block of weights) is moved aside to
<dir>.damaged-<time>, said, and built again; its builder is deterministic, so the new one is the
one that was damaged. Unchecked, a train.jsonl cut at a line's end was trained on as it was.

One built by an rft from before these manifests is built again and compared: the same files are
sealed where they are (their modification times, part of the stage cache's keys, kept); others
are moved aside as damaged.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from rft import manifest
from rft.checkpoint import put_aside


def whole(path: Path, what: str) -> bool:
    """Whether built directory `path` is there and whole: nothing to build. A damaged one is moved
    aside and said; one without a manifest (an older rft's) is left for `install` to compare. Call
    it under the builder's lock."""
    if not path.exists() or manifest.read(path) == (None, None):
        return False
    why = manifest.verify(path)
    if why is None:
        return True
    aside = put_aside(path, "damaged")
    _say(f"the {what} in {path} is damaged ({why}); moved it to {aside.name} and building it again")
    return False


def install(tmp: Path, path: Path, what: str) -> None:
    """Seal the freshly built `tmp` and put it at `path`, where an older rft's build may be: kept
    (and sealed) if its files are the same, else moved aside."""
    manifest.seal(tmp, {"built": what})
    if path.exists():
        shutil.copy2(tmp / manifest.MANIFEST, path / manifest.MANIFEST)
        why = manifest.verify(path)
        if why is None:
            shutil.rmtree(tmp)
            return
        (path / manifest.MANIFEST).unlink()
        aside = put_aside(path, "damaged")
        _say(f"the {what} in {path}, from an rft before built files were checked, is not the one this rft builds "
             f"({why}: damaged, or built by other versions of its libraries); moved it to {aside.name}")
    os.replace(tmp, path)


def _say(text: str) -> None:
    print(f"rft: warning: {text}", file=sys.stderr, flush=True)
