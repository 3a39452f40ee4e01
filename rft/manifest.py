"""A directory that proves what it is: its manifest.json, written last, lists every other file in
it (recursively) with its size and digest, and says whose the directory is (its identity).

    {"format": 1, "hash": "xxh3_128",
     "identity": {"run": "rft/grpo-tiny-arithmetic", "stage": "grpo", "step": 8, "config": "...", "model": "..."},
     "files": {"hf/model.safetensors": [2048000, "9f3c..."], "state.json": [812, "04ab..."], ...}}

Checkpoints, stage-cache entries and exports are written this way, and `verify` runs before one is
used: a file changed, cut, missing, added, or replaced by a link, and a manifest that does not
parse or names a path outside its directory, are each reported naming the file.

The digest is against damage (a failing disk, a cut copy, a hand edit, a file of another
checkpoint put in the place of this one's), not against someone who means harm: whoever can
rewrite a file can rewrite the manifest beside it. So it is chosen for speed: xxh3-128 hashes
~5.3 GB/s on one core of these machines, where crc32 does 2.4, sha256 1.0 and blake2b 0.55
(1 GiB from the page cache, 8 MiB reads), and its 128 bits leave a change unnoticed with odds of
~2^-128. `python -m rft.manifest DIR` checks a directory by hand.

Directories rft builds itself on first use, in cache_dir (the tiny model, rft/models.py, and the
generated task data, rft/data/tasks.py) are built in <dir>.tmp, sealed and renamed into place
(`install`), and checked before each use (`whole`). A damaged one (a cut train.jsonl, a cut
config.json, a zeroed block of weights) is moved aside to <dir>.damaged-<time>, said, and built
again; its builder is deterministic, so the new one is the one that was damaged. Unchecked, a
train.jsonl cut at a line's end was trained on as it was. One built by an rft from before these
manifests is built again and compared: the same files are sealed where they are (their
modification times, part of the stage cache's keys, kept); others are moved aside as damaged. Not
a model folder with its config.json and no manifest: that is taken for the user's own (a
checkpoint's hf/, an export) and started from as it is (rft.models.not_built_here).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import sys
import time
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

MANIFEST = "manifest.json"
FORMAT = 1
HASH = "xxh3_128"
_CHUNK = 8 << 20  # 8 MiB reads: the hash, not the calls, sets the pace
_MAX_MANIFEST = 64 << 20  # a manifest lists files, not data: anything larger is not one
MAX_RECORD = 64 << 20  # state.json, config.yaml, a stage's marks: records, not data; a larger one is damage
MAX_LINE = 16 << 20  # a line of a log rft writes (a step's metrics, its batch record) is kilobytes: a longer one is damage


def digest(path: Path) -> str:
    """The file's xxh3-128, read in large chunks; a link is never followed (O_NOFOLLOW)."""
    import xxhash

    h = xxhash.xxh3_128()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with open(fd, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def listing(d: Path) -> tuple[dict[str, int], list[str]]:
    """The regular files under `d` (relative POSIX path -> size), the manifest itself left out, and
    the entries that are neither a file nor a folder (links, sockets): a link to a folder is
    listed, never entered."""
    files, odd = {}, []
    for root, dirs, names in os.walk(d):  # followlinks=False
        for name in dirs + names:
            p = Path(root) / name
            st = p.lstat()
            rel = p.relative_to(d).as_posix()
            if stat.S_ISREG(st.st_mode):
                files[rel] = st.st_size
            elif not stat.S_ISDIR(st.st_mode):
                odd.append(rel)
    files.pop(MANIFEST, None)
    return files, sorted(odd)


def umask() -> int:
    """The process's umask, read without changing it where Linux says it (/proc/self/status, since
    4.7): setting it to read it leaves a moment in which a file another thread makes gets 0666."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)  # elsewhere: set, so that the moment's files are private, not public
    os.umask(mask)
    return mask


def follow_umask(folder: Path) -> None:
    """Each file in `folder` given the mode a new file gets here (0666 less the umask; 0644 with
    the usual 022): safetensors writes through a temporary file made 0600, so the weights alone
    were unreadable to a colleague or a serving process of another user, beside a 0644 config.
    Checkpoints and exports call it before they are sealed."""
    mode = 0o666 & ~umask()
    for f in Path(folder).rglob("*"):
        if f.is_file() and not f.is_symlink():
            f.chmod(mode)


def seal(d: Path, identity: dict, known: dict | None = None) -> dict:
    """Write `d`'s manifest (atomically: a temporary file, fsync, rename), last. `known`: digests
    already computed (relative path -> [size, digest]), reused for files of that size instead of
    reading them again. Returns the manifest."""
    d = Path(d)
    files, odd = listing(d)
    if odd:  # nothing rft writes makes one
        raise OSError(f"{d / odd[0]} is not a regular file: a sealed directory holds only files")
    known = known or {}
    entries = {rel: known[rel] if rel in known and known[rel][0] == size else [size, digest(d / rel)]
               for rel, size in sorted(files.items())}
    manifest = {"format": FORMAT, "hash": HASH, "identity": identity, "files": entries}
    # JSON with a file a line, for a person reading it
    lines = ",\n".join(f"  {json.dumps(rel)}: {json.dumps(v)}" for rel, v in entries.items())
    write_atomic(d / MANIFEST, f'{{"format": {FORMAT}, "hash": "{HASH}",\n "identity": {json.dumps(identity)},\n'
                               f' "files": {{\n{lines}\n }}}}\n')
    return manifest


def write_atomic(path: Path, text: str | bytes) -> None:
    """`path` holds `text` (or bytes: a figure rendered in memory) whole or not at all, even across a
    crash: tmp, fsync, rename, fsync the folder. The tmp is made anew, never opened through a link:
    a <path>.tmp planted as a link in a run directory someone handed over (or a shared results
    folder) had the write truncate and fill the file it points to (a ~/.bashrc)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)  # a leftover (a killed write), or a link: the link goes, not its target
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
    with open(fd, "wb" if isinstance(text, bytes) else "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_regular(path: Path):
    """`path` opened to read bytes, where it is a regular file (a link to one is followed); an OSError
    where it is not. A FIFO blocks the open and then every read until something writes to it, and
    /dev/zero never ends: a results folder others write to, or a run directory handed over, may
    hold either under the name of a log or record rft reads back (the studio's pages hung, the
    report ran out of memory)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO's open returns at once
    f = open(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise OSError(errno.EINVAL, "not a regular file (a FIFO, a device or a socket)", str(path))
    return f


def read_regular(path: Path, most: int = -1) -> bytes:
    """The bytes of regular file `path` (its first `most`): `open_regular`."""
    with open_regular(path) as f:
        if most >= 0:  # f.read(n) takes n bytes before it reads: a manifest's damaged size (100 GB) for a file of 2 kB
            most = min(most, os.fstat(f.fileno()).st_size + 1)  # (+1: a file grown past its size still reads long)
        return f.read(most)


def read_lines(f, start: int = 0, most: int = MAX_LINE, step: int = 1 << 20):
    """Each line of regular file `f` (open_regular) from byte `start`, one at a time: (its bytes, the
    newline included where it has one, and the offset after it); None for the bytes of a line longer
    than `most`, passed without being held. A log read whole (metrics.jsonl, batches.jsonl: a run's,
    or a handed-over one's, read by the monitor, the report and the studio) took the memory of its
    size: a sparse 20 GB file (truncate -s), one line of zeros, was a MemoryError or the OOM killer.
    `step`: the bytes read at a time, held beside the line (a reader of long lines one at a time,
    a buffer's experiences, keeps its peak near one line with a smaller one)."""
    fd, pos = f.fileno(), start  # pos: the offset of buf[0]; pread leaves f's own position alone
    # buf: from the next line's start on, grown in place, and searched from `seen` (before it, no
    # newline): copied whole and searched again at each MiB, a line near a bound of 64 MiB took ~2 s
    buf, seen = bytearray(), 0
    while True:
        nl = buf.find(b"\n", seen)
        if nl < 0 and len(buf) <= most:  # no whole line left, the one begun within the bound: read on
            chunk = os.pread(fd, step, pos + len(buf))
            if chunk:
                seen = len(buf)
                buf += chunk
                continue
            if buf:
                yield bytes(buf), pos + len(buf)  # the last line, with no newline (a kill cut it, or it is being written)
            return
        if nl >= 0 and nl <= most:
            yield bytes(buf[:nl + 1]), pos + nl + 1
            del buf[:nl + 1]  # a bytearray drops its front without moving the rest
            pos, seen = pos + nl + 1, 0
            continue
        end = pos + nl + 1 if nl >= 0 else _past_line(fd, pos + len(buf))
        yield None, end
        buf, pos, seen = bytearray(), end, 0


def _past_line(fd: int, pos: int) -> int:
    """The offset after the first newline from `pos` on, or the file's end. A sparse file's holes are
    zeros, no newline, so they are passed unread (SEEK_DATA): read, 2 GB of them took 10 s here."""
    while True:
        try:
            pos = os.lseek(fd, pos, getattr(os, "SEEK_DATA", os.SEEK_SET))
        except OSError as e:
            if e.errno == errno.ENXIO:  # nothing but a hole from pos to the end
                return max(pos, os.fstat(fd).st_size)
        chunk = os.pread(fd, _CHUNK, pos)
        if not chunk:
            return pos
        nl = chunk.find(b"\n")
        if nl >= 0:
            return pos + nl + 1
        pos += len(chunk)


def read_record(path: Path, most: int = MAX_RECORD) -> bytes:
    """The bytes of small record `path` (a state.json, a config.yaml rft wrote): an OSError where it
    is not a regular file or holds more than `most` bytes. Read whole, a damaged or planted 10 GB
    file under such a name took that much memory before it failed to parse."""
    data = read_regular(path, most + 1)
    if len(data) > most:
        raise OSError(errno.EFBIG, f"larger than {most} bytes, which no record rft writes is", str(path))
    return data


def read(d: Path) -> tuple[dict | None, str | None]:
    """(the manifest, None), (None, what is wrong with it), or (None, None) when there is none."""
    path = Path(d) / MANIFEST
    try:
        if path.lstat().st_size > _MAX_MANIFEST or not path.is_file() or path.is_symlink():
            return None, "is not a manifest (too large, or not a regular file)"
        m = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError, RecursionError):  # RecursionError: nested ten thousand deep
        return None, "does not parse (cut short or overwritten)"
    if not (isinstance(m, dict) and isinstance(m.get("identity"), dict) and isinstance(m.get("files"), dict)
            and all(isinstance(v, list) and len(v) == 2 and isinstance(v[0], int) and isinstance(v[1], str)
                    for v in m["files"].values())):
        return None, "does not parse as a manifest (identity, files: {path: [size, digest]})"
    if m.get("format") != FORMAT or m.get("hash") != HASH:
        return None, f"has format {m.get('format')!r} and hash {m.get('hash')!r}; this rft reads {FORMAT} and {HASH}"
    bad = next((p for p in m["files"] if not _inside(p)), None)
    if bad is not None:
        return None, f"lists {bad!r}, which is not a path inside its directory (not followed)"
    return m, None


def _inside(rel: str) -> bool:
    """A plain relative path below the directory: no '..', no absolute path, no '.', not the manifest."""
    p = PurePosixPath(rel)
    return (bool(rel) and not p.is_absolute() and p.as_posix() == rel and ".." not in p.parts
            and "\\" not in rel and "\0" not in rel and rel != MANIFEST)


def verify(d: Path, skip: tuple[str, ...] = ()) -> str | None:
    """What is wrong with sealed directory `d`, naming the file, or None when every file is the
    one saved. The cheap checks (the manifest, the set of files, their sizes) come first, then the
    digests, but for the files in `skip` (relative paths of large files the caller does not read,
    such as a trainer_state.pt of a model that is only served: their size is checked)."""
    d = Path(d)
    manifest, why = read(d)
    if manifest is None:
        return f"{d / MANIFEST}: {why or 'missing'}"
    try:
        return _compare(d, manifest["files"], skip)
    except OSError as e:  # removed or unreadable while it is read (another run pruning its checkpoints)
        return f"{e.filename or d}: cannot be read ({e.strerror or e})"


def _compare(d: Path, listed: dict, skip: tuple[str, ...]) -> str | None:
    files, odd = listing(d)
    if odd:
        return f"{d / odd[0]}: a link or other special file, where the save wrote a regular file or nothing"
    extra = sorted(set(files) - set(listed))
    if extra:
        return f"{d / extra[0]}: not in {MANIFEST} (added after the save)"
    for rel, (size, _) in listed.items():
        if rel not in files:
            return f"{d / rel}: missing"
        if files[rel] != size:
            return f"{d / rel}: {files[rel]} bytes, {size} when saved (cut short or written over)"
    for rel, (_, want) in listed.items():
        if rel not in skip and digest(d / rel) != want:
            return f"{d / rel}: its contents are not the ones saved (their digest differs)"
    return None


# ---------------------------------------------------------------- moving aside, built directories

def put_aside(path: Path, why: str) -> Path:
    """Move `path` to <path>.<why>-<time> (-2, -3, ... after it when that is taken), never deleting."""
    stamp = f"{path.name}.{why}-{time.strftime('%Y%m%d_%H%M%S')}"
    aside, n = path.with_name(stamp), 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{stamp}-{n}")
    os.replace(path, aside)
    return aside


@contextmanager
def build_lock(path: Path, what: str):
    """Held while built directory `path` (the `what`) is checked and built: <path>.lock, so that jobs
    that need it at once build it once. A lock that cannot be opened (a folder in its place, or a
    link, which filelock refuses with O_NOFOLLOW) is one paragraph, as the stage cache's is
    (rft.runtime.rundir.stage_lock): it was a raw IsADirectoryError or 'Too many levels of symbolic links'."""
    from filelock import FileLock

    from rft.errors import RunError

    lock = FileLock(str(path) + ".lock")
    try:
        lock.acquire()
    except OSError as e:
        where = Path(lock.lock_file)
        why = f"it is a link (to {os.readlink(where)}), which rft never makes there" if where.is_symlink() else e.strerror
        raise RunError(f"the lock {where} of the {what} in {path.parent} cannot be opened: {why}. Remove it (rft makes "
                       f"the lock again) and run the same command again.") from None
    try:
        yield
    finally:
        lock.release()


def clear(path: Path) -> None:
    """`path` removed, whatever stands there: a folder (a killed build's leftovers), a file, or a link,
    the link alone and never what it points to. shutil.rmtree refuses a link and a file, and with
    ignore_errors nothing said so: a <dir>.tmp that was a link had the build write through it into
    the folder it points to (and the link renamed into place as the build), a file ended the run in
    a raw FileExistsError."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path, ignore_errors=True)  # a folder of another user's files: the mkdir after it says so
    else:
        os.unlink(path)


def whole(path: Path, what: str) -> bool:
    """Whether built directory `path` is there and whole: nothing to build. A damaged one is moved
    aside and said; one without a manifest (an older rft's) is left for `install` to compare. Call
    it under the builder's lock."""
    if not path.exists() or read(path) == (None, None):
        return False
    why = verify(path)
    if why is None:
        return True
    aside = put_aside(path, "damaged")
    _say(f"the {what} in {path} is damaged ({why}); moved it to {aside.name} and building it again")
    return False


def install(tmp: Path, path: Path, what: str) -> None:
    """Seal the freshly built `tmp` and put it at `path`, where an older rft's build may be: kept
    (and sealed) if its files are the same, else moved aside."""
    seal(tmp, {"built": what})
    if path.exists():
        shutil.copy2(tmp / MANIFEST, path / MANIFEST)
        why = verify(path)
        if why is None:
            shutil.rmtree(tmp)
            return
        (path / MANIFEST).unlink()
        aside = put_aside(path, "damaged")
        _say(f"the {what} in {path}, from an rft before built files were checked, is not the one this rft builds "
             f"({why}: damaged, or built by other versions of its libraries); moved it to {aside.name}")
    os.replace(tmp, path)


def _say(text: str) -> None:
    print(f"rft: warning: {text}", file=sys.stderr, flush=True)


def written_yaml(text: str):
    """A YAML file rft or Hydra wrote (a stage's config.yaml, a run's .hydra/ files), read back;
    a yaml.YAMLError when it is not one. Neither writes an alias (OmegaConf's dumper writes none),
    so one is refused before loading: nine aliases of nine (a "billion laughs") load as shared
    lists in a millisecond, then the fingerprint or table of what they hold never ends. libyaml,
    where there is one, stops at nesting ~1000 deep with its own error, not Python's RecursionError."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    for event in yaml.parse(text, Loader=loader):
        if isinstance(event, yaml.AliasEvent):
            mark = event.start_mark
            raise yaml.YAMLError(f"an alias (*{event.anchor}) at line {mark.line + 1}, which rft and Hydra never write")
    return yaml.load(text, Loader=loader)  # noqa: S506 (a safe loader)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m rft.manifest DIR   (a checkpoint, a stage-cache entry or an export)", file=sys.stderr)
        return 2
    d = Path(args[0]).expanduser()
    if not d.is_dir():  # verify would call a file's missing manifest.json "does not parse"
        print(f"{d}: {'not a folder' if d.exists() else 'no such folder'}; give a checkpoint (step_<N>), a "
              f"stage-cache entry or an export folder", file=sys.stderr)
        return 2
    why = verify(d)
    if why is not None:
        print(f"damaged: {why}", file=sys.stderr)
        return 1
    manifest, _ = read(d)
    print(f"{d}: whole ({len(manifest['files'])} files as saved); identity {json.dumps(manifest['identity'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
