"""task=reasoning_gym: tasksets from the reasoning-gym package's procedural generators (no download).

`buffer.explorer_input.reasoning_gym` names the datasets (one, or a mix drawn by weight, through
reasoning-gym's own CompositeDataset), each with its own config, and the rows: `size` training
rows, `eval_size` held-out ones, `seed`. They are generated once into a directory named by a
fingerprint of that section (conf/task/reasoning_gym.yaml: `reasoning-gym-<12 hex digits>`), so
the same section gives the same bytes, and a changed one (another dataset, weight, config, seed or
size) other data, never the data of the section before it.

Each row: `question` (the prompt), `answer` (the entry's answer), `teacher_answer` (the SFT
warm-up's demonstration: the answer, or with reasoning_gym.teacher_error_rate a sloppy teacher's),
`dataset` (which dataset made it: `group_by: dataset` gives an eval's metrics per dataset), and
what the `reasoning_gym` reward (rft/rewards/reasoning_gym.py) needs to call that dataset's
scorer: `entry` and `dataset_config` (JSON text).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from rft.config import ReasoningGymConfig, fingerprint
from rft.errors import ConfigError
from rft.rewards.reasoning_gym import check_dataset, library, make_dataset

KEY = "buffer.explorer_input.reasoning_gym"
MAX_ROWS = 1_000_000  # a split's rows
PREFIX = "reasoning-gym-"


def _typed(section):
    """The section as the typed schema reads it (a dict of a test, too), a config node."""
    from omegaconf import OmegaConf

    if not OmegaConf.is_config(section):
        section = OmegaConf.create(dict(section))
    return OmegaConf.merge(OmegaConf.structured(ReasoningGymConfig), section)


def section_of(section) -> ReasoningGymConfig:
    """The section as plain objects (a dataset's config a dict of plain values, as reasoning-gym takes it)."""
    from omegaconf import OmegaConf

    return section if isinstance(section, ReasoningGymConfig) else OmegaConf.to_object(_typed(section))


def dir_name(section) -> str:
    """The directory the section's data is written to: what conf/task/reasoning_gym.yaml's
    `${rft.fingerprint:...}` gives for it."""
    return PREFIX + fingerprint(_typed(section))


def check(section) -> None:
    """Every mistake in the section, before anything is generated (a dry run stops here too)."""
    s = section_of(section)
    if not s.datasets:
        raise ConfigError(
            f"{KEY}.datasets is empty: name at least one of reasoning-gym's datasets, e.g. "
            f"'{KEY}.datasets=[{{name: basic_arithmetic}}]', or a weighted mix "
            f"'[{{name: chain_sum, weight: 2}}, {{name: spell_backward, weight: 1}}]'."
        )
    names = [d.name for d in s.datasets]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"{KEY}.datasets names {twice} more than once; give each dataset once (its weight sets "
                          f"its share of the rows).")
    for i, d in enumerate(s.datasets):
        where = f"{KEY}.datasets.{i}"
        set_here = sorted({"seed", "size"} & set(d.config))
        if set_here:
            raise ConfigError(f"{where}.config sets {set_here}: the rows' seed and count are {KEY}.seed, .size and "
                              f".eval_size (one for the whole mix). Remove them from {where}.config.")
        if not d.weight > 0:
            raise ConfigError(f"{where}.weight={d.weight}: a weight is a positive share of the rows; remove the "
                              f"dataset rather than give it 0.")
        check_dataset(d.name, dict(d.config), where)
    if s.size < 1 or s.eval_size < 1:
        raise ConfigError(f"{KEY}.size={s.size}, .eval_size={s.eval_size}: both splits need at least one row "
                          f"(the train split is the taskset, the test split its eval set).")
    if max(s.size, s.eval_size) > MAX_ROWS:
        # every row is generated before the run starts, and held in memory until written: size=10**12 ran for ever
        raise ConfigError(f"{KEY}.size={s.size}, .eval_size={s.eval_size}: at most {MAX_ROWS} rows a split. The "
                          f"rows are generated before the run starts and held in memory while written (~600 bytes "
                          f"each: a million is ~0.6 GB and minutes of generating). Lower them to what the run reads: "
                          f"a step reads buffer.batch_size rows of the train split.")
    if not 0 <= s.teacher_error_rate <= 1:
        raise ConfigError(f"{KEY}.teacher_error_rate={s.teacher_error_rate} is not a share in [0, 1].")


def generate_reasoning_gym(explorer_input) -> Path | None:
    """buffer.explorer_input.generator=reasoning_gym: the section's data, written once into the
    taskset's path when that is the directory the section names; a path of another name is the
    user's own data (read as it is) unless it is a reasoning-gym directory of another section."""
    section = explorer_input.reasoning_gym
    check(section)
    path = explorer_input.taskset.path
    local = Path(os.path.expanduser(path))
    want = dir_name(section)
    if local.name == want:
        return write(local, section)
    if local.name.startswith(PREFIX):
        raise ConfigError(
            f"buffer.explorer_input.taskset.path={path!r} is reasoning-gym data of another {KEY} than this run's "
            f"(which writes {want!r}): its directory name is the fingerprint of the section that made it. Leave the "
            f"path as conf/task/reasoning_gym.yaml sets it (`${{rft.fingerprint:${{{KEY}}}}}`), or point it at {want!r}."
        )
    if not local.exists():
        raise ConfigError(
            f"buffer.explorer_input.taskset.path={path!r}: no such file or directory. generator=reasoning_gym writes its "
            f"data only into a directory named by its section ({want!r} for this one): leave the path as "
            f"conf/task/reasoning_gym.yaml sets it, or point it at your own data and set "
            f"buffer.explorer_input.generator=null."
        )
    return None  # the user's own data


def write(path: str | Path, section) -> Path:
    """Write train.jsonl and test.jsonl for the section into `path` (once: sealed, under a lock)."""
    from rft.data.tasks import _generate

    s = section_of(section)
    check(s)
    return _generate(path, s.seed, lambda rng: splits(s, rng))


def library_seed(seed: int) -> int:
    """reasoning-gym's seed for ours. Its item `idx` comes from Random(seed + idx) (and a mix's
    datasets get seed + 1, + 2, ...), so seeds 0 and 1 would give the same rows shifted by one:
    ours is spread over 31 bits first."""
    return random.Random(seed).getrandbits(31)


def splits(s: ReasoningGymConfig, rng: random.Random) -> dict[str, list[dict]]:
    """{"test": eval_size distinct questions, "train": size rows none of whose questions is in test},
    read in index order from the weighted mix; `rng` draws the teacher's mistakes, one per row."""
    from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

    library()
    limit = 2 * (s.size + s.eval_size) + 100  # a mix's indices read at most (some datasets index up to their size)
    seed = library_seed(s.seed)
    for i, d in enumerate(s.datasets):  # a config reasoning-gym rejects, named (the mix would say only an assert)
        make_dataset(d.name, {**d.config, "seed": seed + i + 1, "size": 1}, f"{KEY}.datasets.{i}")
    mix = CompositeDataset(CompositeConfig(size=limit, seed=seed, datasets=[
        DatasetSpec(d.name, d.weight, dict(d.config)) for d in s.datasets]))
    test: dict[str, dict] = {}
    train: list[dict] = []
    for idx in range(limit):
        entry = mix[idx]
        if len(test) < s.eval_size:
            test.setdefault(entry["question"], entry)
        elif entry["question"] not in test:
            train.append(entry)
            if len(train) == s.size:
                break
    if len(train) < s.size:
        raise ConfigError(
            f"{KEY}: the mix's first {limit} rows hold {len(test) + len({e['question'] for e in train})} distinct "
            f"questions, too few for eval_size={s.eval_size} held out and size={s.size} rows beside them: its "
            f"datasets' configs allow few problems. Lower {KEY}.eval_size, or widen the configs."
        )
    kwargs = {name: json.dumps({**d.config, "seed": mix.datasets[name].seed, "size": limit}, sort_keys=True)
              for name, d in zip(mix.dataset_names, s.datasets)}
    return {split: [_row(e, kwargs, s.teacher_error_rate, rng) for e in entries]
            for split, entries in (("test", list(test.values())), ("train", train))}


def _row(entry: dict, kwargs: dict[str, str], error_rate: float, rng: random.Random) -> dict:
    """One row of the files (the module's docstring says the columns); one draw of `rng`."""
    answer = str(entry["answer"])
    teacher = answer[:-1] + _one_up(answer[-1]) if rng.random() < error_rate and answer else answer
    name = entry["metadata"]["source_dataset"]
    # JSON keeps what the scorer reads (tuples of the metadata come back as lists); a value JSON
    # has no form for is written as its text
    return {"question": entry["question"], "answer": answer, "teacher_answer": teacher, "dataset": name,
            "entry": json.dumps(entry, sort_keys=True, default=str), "dataset_config": kwargs[name]}


def _one_up(c: str) -> str:
    """The sloppy teacher's slip on an answer's last character: the next digit or letter, round
    its set (9 -> 0, z -> a, Z -> A); any other character is kept."""
    import string

    for chars in (string.digits, string.ascii_lowercase, string.ascii_uppercase):
        if c in chars:
            return chars[(chars.index(c) + 1) % len(chars)]
    return c
