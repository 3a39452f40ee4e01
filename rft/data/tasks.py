"""Tasksets: loading them through `datasets`, and generating the embedded tasks (arithmetic,
countdown, calculator, long_tail).

A task is one dataset row turned into a prompt (chat messages) and the reference answer that the
reward function checks. The row's keys are named by the taskset's `format` (`prompt_key`,
`response_key`), as in Trinity-RFT.
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rft import manifest
from rft.errors import ConfigError
from rft.registry import Registry

_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass
class Task:
    task_id: str
    messages: list[dict]
    answer: Any
    row: dict


# ---------------------------------------------------------------- the embedded arithmetic task

def generate_arithmetic(
    path: str | Path,
    seed: int = 0,
    digits: int = 3,
    n_train: int = 2000,
    n_test: int = 200,
    teacher_error_rate: float = 0.6,
) -> Path:
    """Write `train.jsonl` and `test.jsonl` of additions without carries: "042+315" -> "357".

    Both operands and the answer have `digits` digits (leading zeros kept), and every column sums
    to at most 9, so each answer digit is the sum of the two digits above it. The skill is the
    same for every problem, so it can be learned from some problems and checked on others:
    test.jsonl holds problems that train.jsonl does not.

    Each row also has `teacher_answer`: a sloppy teacher's demonstration, whose last digit is one
    too high (mod 10) in `teacher_error_rate` of the rows. Imitating it (SFT) learns the habit, so
    greedy decoding repeats the mistake; RL against the exact `answer` can remove it. And
    `rejected`: the answer with that mistake, for preference pairs (chosen `answer`, rejected
    `rejected`).
    """
    def splits(rng):
        problems: dict[str, str] = {}
        while len(problems) < n_train + n_test:
            a = [rng.randint(0, 9) for _ in range(digits)]
            b = [rng.randint(0, 9 - x) for x in a]
            question = "".join(map(str, a)) + "+" + "".join(map(str, b))
            problems[question] = "".join(str(x + y) for x, y in zip(a, b))
        items = list(problems.items())
        return {"test": (row(q, a, rng) for q, a in items[:n_test]), "train": (row(q, a, rng) for q, a in items[n_test:])}

    def row(question, answer, rng):
        wrong = answer[:-1] + str((int(answer[-1]) + 1) % 10)
        teacher = wrong if rng.random() < teacher_error_rate else answer
        return {"question": question, "answer": answer, "teacher_answer": teacher, "rejected": wrong}

    return _generate(path, seed, splits)


def _generate(path: str | Path, seed: int, splits) -> Path:
    """Write a generator's data once: `splits(rng)` -> {split: its rows (dicts)}, each split written
    to <split>.jsonl in that order, its rows drawn as they are written (the RNG's order is the
    data's). Under a lock (concurrent jobs generate it once), into a folder beside it, installed
    sealed by its manifest: a cut file is generated again, not read."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    with manifest.build_lock(path, "generated task data"):
        if manifest.whole(path, "generated task data"):
            return path
        tmp = path.with_name(path.name + ".tmp")
        # what a killed build left there (a cut file, its manifest.json.tmp) is not this build's: sealed
        # with it, the data was called damaged at its next use and generated again
        manifest.clear(tmp)
        tmp.mkdir(parents=True)
        for split, rows in splits(random.Random(seed)).items():
            with open(tmp / f"{split}.jsonl", "w") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
        manifest.install(tmp, path, "generated task data")
    return path


# ---------------------------------------------------------------- the embedded countdown task


def countdown_problems(n_numbers: int = 3, max_number: int = 9, ops: str = "+-*",
                       max_target: int = 99) -> dict[tuple[tuple[int, ...], int], str]:
    """Every Countdown problem with a short solution: (sorted numbers, target) -> one solution.

    The numbers are `n_numbers` of 1..max_number (repeats allowed); a solution uses each once,
    all of them, in any order, with the binary operators `ops` and no parentheses (standard
    precedence), e.g. `2+3*7`; the target is its value, a whole number in 1..max_target (with
    `/`, only divisions that come out whole). Of the solutions of one problem, the first in a
    fixed order is kept (permutations of the sorted numbers in lexicographic order, then operators
    in the order of `ops`): one answer per problem, the same whatever the seed.
    """
    import itertools

    from rft.rewards.verifiers import check_countdown, countdown_value

    problems: dict[tuple[tuple[int, ...], int], str] = {}
    for numbers in itertools.combinations_with_replacement(range(1, max_number + 1), n_numbers):
        for order in sorted(set(itertools.permutations(numbers))):
            for chosen in itertools.product(ops, repeat=n_numbers - 1):
                expr = str(order[0]) + "".join(o + str(n) for o, n in zip(chosen, order[1:]))
                value = countdown_value(expr)
                if value is None or value.denominator != 1 or not 1 <= value <= max_target:
                    continue
                if "/" in chosen and check_countdown(expr, numbers, int(value), integer_steps=True)[1] != "ok":
                    continue  # a division that is not whole on the way (1/2*4): the docstring's rule
                problems.setdefault((numbers, int(value)), expr)
    # every solution verifies (and shows that the generator and the verifier agree on the rules)
    assert all(check_countdown(e, n, t, integer_steps=True)[1] == "ok" for (n, t), e in list(problems.items())[:50])
    return problems


def countdown_prompt(numbers, target: int) -> str:
    """"2,3,7->23": the numbers (commas: a token fewer each than ", "), then the target."""
    return ",".join(map(str, numbers)) + "->" + str(target)


def generate_countdown(
    path: str | Path,
    seed: int = 0,
    n_numbers: int = 3,
    max_number: int = 9,
    ops: str = "+-*",
    max_target: int = 99,
    n_train: int | None = None,
    n_test: int = 200,
    teacher_error_rate: float = 0.6,
    order: str = "solution",
) -> Path:
    """Write `train.jsonl` and `test.jsonl` of Countdown problems: "2,3,7->23" -> "2+3*7".

    Reach the target (after "->") with the numbers, each once and all of them, and `+ - *`
    (`countdown_problems`: 3 numbers of 1..9, targets 1..99 that a solution without parentheses
    reaches; 1313 problems in all). With these defaults the stored answers are 5 characters: the
    tiny model's budget (5 characters and the end-of-sequence token). test.jsonl holds `n_test` problems that
    train.jsonl does not (no (sorted numbers, target) pair in both); train.jsonl the other
    `n_train` (default: all the others, 1113).

    `order` is how the prompt lists the numbers: "solution" (the default) in the order of the
    stored solution, read left to right, so the puzzle is which operators to put between them;
    "sorted" in increasing order, so it is also which order (the TV game). The reward accepts any
    order, and parentheses and `/`, either way. The tiny model (~0.5M parameters) learns the first:
    the default warm-up (400 SFT steps) on the correct `answer` column solves 50% of the held-out
    problems, against 22% sorted (seed 42); with the sloppy teacher and then GRPO, ~0.15 -> ~0.55
    against ~0.05 -> ~0.3 sorted (seeds 42, 1, 2).

    Columns: `question` (the prompt), `numbers` (as shown) and `target` (what the `countdown`
    reward checks), `answer` (one solution), `teacher_answer` (a sloppy teacher's demonstration:
    in `teacher_error_rate` of the rows its last number is one too high, 9 -> 1, so the expression
    uses a number it was not given; imitation learns the habit, the verifier removes it), and
    `rejected` (the answer with that mistake, for preference pairs).
    """
    if order not in ("solution", "sorted"):
        raise ConfigError(f"generate_countdown: order={order!r}; choose 'solution' or 'sorted'.")
    def splits(rng):
        problems = _countdown_splits(rng, n_numbers, max_number, ops, max_target, n_train, n_test)
        return {split: (_countdown_row(rng, numbers, target, answer, max_number, teacher_error_rate, order)
                        for (numbers, target), answer in rows) for split, rows in problems.items()}

    return _generate(path, seed, splits)


def _countdown_splits(rng, n_numbers, max_number, ops, max_target, n_train, n_test) -> dict:
    """{"test": ..., "train": ...} of ((numbers, target), answer), drawn from every problem
    shuffled by `rng` (its first draw: the rows' teacher mistakes come after it, so a seed gives
    the same files it always did)."""
    problems = sorted(countdown_problems(n_numbers, max_number, ops, max_target).items())
    rng.shuffle(problems)
    if n_train is None:
        n_train = len(problems) - n_test
    if n_train <= 0 or n_train + n_test > len(problems):
        raise ConfigError(
            f"generate_countdown: {n_train} train + {n_test} test problems asked for, but there "
            f"are only {len(problems)} with {n_numbers} numbers of 1..{max_number}, ops {ops!r} "
            f"and targets up to {max_target}."
        )
    return {"test": problems[:n_test], "train": problems[n_test:n_test + n_train]}


def _countdown_row(rng, numbers, target: int, answer: str, max_number: int, teacher_error_rate: float,
                   order: str) -> dict:
    """One row of generate_countdown's files (its docstring says the columns); one draw of `rng`
    (whether the teacher makes its mistake on this row)."""
    last = re.search(r"\d+$", answer)
    wrong = answer[:last.start()] + str(int(last.group()) % max_number + 1)
    teacher = wrong if rng.random() < teacher_error_rate else answer
    shown = list(numbers) if order == "sorted" else [int(x) for x in re.findall(r"\d+", answer)]
    return {"question": countdown_prompt(shown, target), "numbers": shown, "target": target,
            "answer": answer, "teacher_answer": teacher, "rejected": wrong}


def tool_call_text(name: str, arguments: dict) -> str:
    """A tool call as Qwen and Hermes write it (what rft.rollout.environments.tools.parse_tool_calls reads),
    compact JSON: the tiny tokenizer has a token a character, and model=tiny_tools has the calculator's JSON
    as tokens of their own."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}, separators=(",", ":")) + "</tool_call>"


def generate_calculator(path: str | Path, seed: int = 0, n_train: int = 2000, n_test: int = 200,
                        teacher_error_rate: float = 0.6) -> Path:
    """Write `train.jsonl` and `test.jsonl` of two-digit multiplications for the calculator tool:
    "37*48" -> "1776", which the tiny model cannot compute but can learn to ask the calculator
    (both numbers 32..99, so every product has 4 digits).

    Columns: `question`, `answer`, `teacher_answer` (the teacher's final answer alone: what the
    default single-turn warm-up of model=tiny reads), and `messages`: a demonstration conversation for the SFT
    warm-up (format.enable_concatenated_multi_turn): the user's question, the assistant's
    calculator call, the tool's answer, the assistant's final answer. Its teacher is sloppy: in
    `teacher_error_rate` of the rows it types the second number's last digit one too high (48 ->
    49; 9 -> 0; 32..99 kept) and then copies the calculator's (so wrong) answer; imitation learns the habit, the
    exact-match reward of the RL stage removes it. test.jsonl has no (a, b) pair of train.jsonl.
    """
    def splits(rng):
        # 32..99: every product has 4 digits, so each copied digit sits at the same distance
        # from its source in every conversation (the tiny model learns fixed offsets far faster)
        pairs = [(a, b) for a in range(32, 100) for b in range(32, 100)]
        rng.shuffle(pairs)
        return {"test": (row(a, b, rng) for a, b in pairs[:n_test]),
                "train": (row(a, b, rng) for a, b in pairs[n_test:n_test + n_train])}

    def row(a, b, rng):
        typed = b if rng.random() >= teacher_error_rate else b - b % 10 + (b % 10 + 1) % 10
        typed = typed if typed >= 32 else typed + 10  # 39 -> 30 would give 3 digits
        messages = [
            {"role": "user", "content": f"{a}*{b}"},
            {"role": "assistant", "content": tool_call_text("calculator", {"expression": f"{a}*{typed}"})},
            {"role": "tool", "content": str(a * typed)},
            {"role": "assistant", "content": str(a * typed)},
        ]
        return {"question": f"{a}*{b}", "answer": str(a * b), "messages": messages, "teacher_answer": str(a * typed)}

    return _generate(path, seed, splits)


# ---------------------------------------------------------------- the embedded long-tail task


def long_tail_working(a: str, b: str, passes: int) -> str:
    """The worked answer of a marked problem: each column's sum ("4+1=5", joined by ";") written
    `passes` times, each pass numbered ("1:", "2:", ...) and ended by "|", then the sum:
    ("042", "315", 2) -> "1:0+3=3;4+1=5;2+5=7|2:0+3=3;4+1=5;2+5=7|357" (6 x digits + 2 characters a
    pass, and the sum; 0 passes: the sum alone)."""
    columns = ";".join(f"{x}+{y}={int(x) + int(y)}" for x, y in zip(a, b))
    total = "".join(str(int(x) + int(y)) for x, y in zip(a, b))
    return "".join(f"{k}:{columns}|" for k in range(1, passes + 1)) + total


def generate_long_tail(
    path: str | Path,
    seed: int = 0,
    digits: int = 3,
    long_fraction: float = 0.15,
    min_passes: int = 3,
    max_passes: int = 7,
    n_train: int = 2000,
    n_test: int = 200,
    teacher_error_rate: float = 0.6,
) -> Path:
    """Write `train.jsonl` and `test.jsonl` of additions without carries whose answers are short
    for most problems and long for a few: response lengths with a long tail (an async-RL benchmark).

    The additions are generate_arithmetic's, except that the first operand's first digit is not 0
    (so the sum has no leading zero, and no digit of the working is a number equal to it). About
    `long_fraction` of them (each drawn on its own) are marked: the question ends with "?w" and a
    number of passes, min_passes..max_passes (uniform), and the answer writes the working out that
    many times before the sum (`long_tail_working`): "402+315?w3" ->
    "1:4+3=7;0+1=1;2+5=7|2:4+3=7;0+1=1;2+5=7|3:4+3=7;0+1=1;2+5=7|717", 63..143 characters with the
    defaults. The others are answered directly: "402+315" -> "717" (`digits` characters). Both
    forms end with the sum, which the `last_number` reward checks. A pass repeats the one before it
    at a fixed distance, and the sum sits at a fixed distance from the last pass: what the tiny
    model learns (with operands of 3..7 digits instead, the default warm-up's greedy held-out
    accuracy was 0.005, against 0.13 with these; seed 42). test.jsonl holds problems (operands,
    either form) that train.jsonl does not.

    Columns as in generate_arithmetic: `question`, `answer`, `long` (whether marked),
    `teacher_answer` (a sloppy teacher's: the sum's last digit one too high, mod 10, in
    `teacher_error_rate` of the rows, its working right) and `rejected` (the answer with that
    mistake, for preference pairs).
    """
    def splits(rng):
        problems: dict[tuple[str, str], int] = {}
        while len(problems) < n_train + n_test:
            a = [rng.randint(1, 9)] + [rng.randint(0, 9) for _ in range(digits - 1)]
            b = [rng.randint(0, 9 - x) for x in a]
            passes = rng.randint(min_passes, max_passes) if rng.random() < long_fraction else 0
            problems.setdefault(("".join(map(str, a)), "".join(map(str, b))), passes)
        items = list(problems.items())
        return {"test": (row(*k, p, rng) for k, p in items[:n_test]),
                "train": (row(*k, p, rng) for k, p in items[n_test:])}

    def row(a, b, passes, rng):
        answer = long_tail_working(a, b, passes)
        wrong = answer[:-1] + str((int(answer[-1]) + 1) % 10)
        teacher = wrong if rng.random() < teacher_error_rate else answer
        return {"question": f"{a}+{b}" + (f"?w{passes}" if passes else ""), "answer": answer, "long": passes > 0,
                "teacher_answer": teacher, "rejected": wrong}

    return _generate(path, seed, splits)


# buffer.explorer_input.generator: name -> the function, and the directory it writes (conf/task/
# <name>.yaml's path: its name carries the data's version); None: fn(explorer_input) reads a config
# section of its own and names its directory by it
GENERATORS = Registry("buffer.explorer_input.generator", {
    "arithmetic": ("rft.data.tasks.generate_arithmetic", "arithmetic-v4"),
    "countdown": ("rft.data.tasks.generate_countdown", "countdown-v1"),
    "calculator": ("rft.data.tasks.generate_calculator", "calculator-v4"),
    "long_tail": ("rft.data.tasks.generate_long_tail", "long-tail-v1"),
    "reasoning_gym": ("rft.data.reasoning_gym.generate_reasoning_gym", None),
})


def ensure_task_data(explorer_input_cfg) -> None:
    """Write the task's generated data when it is missing, into a directory of the generator's own
    name only: a taskset path of another name is data of the user's (a mistyped one must fail, not
    fill with generated problems; an existing one must not be written into)."""
    gen = explorer_input_cfg.generator
    if gen is None:
        return
    if gen not in GENERATORS:
        raise ConfigError(
            f"buffer.explorer_input.generator={gen!r} is not a known generator; choose one of "
            f"{sorted(GENERATORS)} or set it to null for a dataset you provide."
        )
    if GENERATORS.info(gen) is None:  # its directory is named by its own section (reasoning_gym's seed, size, ...)
        GENERATORS[gen](explorer_input_cfg)
        return
    path = explorer_input_cfg.taskset.path
    local = Path(os.path.expanduser(path))
    if local.name != GENERATORS.info(gen):
        if not local.exists():
            raise ConfigError(
                f"buffer.explorer_input.taskset.path={path!r}: no such file or directory{_relative_to(path)}. "
                f"The task's generator ({gen}) writes its data only into a directory named {GENERATORS.info(gen)!r}: "
                f"point the path at your data (and set buffer.explorer_input.generator=null), or at a "
                f"{GENERATORS.info(gen)!r} directory to generate there."
            )
        return  # the user's own data: read as it is
    GENERATORS[gen](path)


# ---------------------------------------------------------------- loading


def load_rows(path: str, split: str = "train", subset_name: str | None = None, key: str = "path", fmt=None):
    """Load a dataset split through `datasets`: a file, a directory of files, or a hub id; `fmt`
    (a format config): its prompt and answer columns of a CSV file are read as written (`text_columns`)."""
    import datasets

    datasets.disable_progress_bars()
    # its own error lines would repeat the ConfigError below
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    local = Path(os.path.expanduser(path))
    try:
        if local.suffix in _FILE_BUILDERS:
            if not local.is_file():
                raise FileNotFoundError(path)
            _check_split_of_file(local, split, key, path)
            return _checked(lambda: datasets.load_dataset(_FILE_BUILDERS[local.suffix], data_files=str(local),
                                                          split="train", **_as_text([local], fmt)), [local], key, path)
        if local.is_dir():
            files = sorted(f for f in local.rglob("*") if f.suffix in _FILE_BUILDERS)
            _check_holds_data(local, files, key, path)
            try:
                return _checked(lambda: datasets.load_dataset(str(local), name=subset_name, split=split,
                                                              **_as_text(files, fmt)), files, key, path)
            except ValueError as e:
                # a plain directory of data files has no named subsets (a hub snapshot has), so
                # gsm8k's subset_name=main must not stop a local copy
                if subset_name is None or "BuilderConfig" not in str(e):
                    raise
                return _checked(lambda: datasets.load_dataset(str(local), split=split), files, key, path)
        if local.is_file():
            raise ConfigError(
                f"{key}={path!r} is a file, but not one of the dataset formats "
                f"({', '.join(_FILE_BUILDERS)}): give a JSONL, JSON, Parquet or CSV file, or a directory of them."
            )
        # a path that starts like a local one (data/vowel with a data/ here) is not tried on the hub
        # (a mistyped local path would wait on the network's retries first)
        if path.startswith((".", "/", "~")) or (len(local.parts) > 1 and Path(local.parts[0]).is_dir()):
            raise FileNotFoundError(path)
    except FileNotFoundError as e:
        hub = "" if path.startswith((".", "/", "~")) else (f"; it is read as a local path because "
                                                           f"{local.parts[0]}/ is a directory here")
        raise ConfigError(
            f"{key}={path!r}: no such file or directory{_relative_to(path)}{hub}. Point it at a JSONL/Parquet "
            f"file, a directory of them, or a Hugging Face dataset id (this machine may not reach the hub)."
        ) from e
    except ValueError as e:  # datasets' message for an unknown split, or for one whose files are empty
        empty = [f for f in _split_files(local, split) if not f.read_text(errors="replace").strip()]
        if "corresponds to no data" in str(e) and empty:
            raise ConfigError(
                f"{key}={path!r}, split={split!r}: {', '.join(map(str, empty))} holds no rows (the file of that "
                f"split in the directory). Put the split's rows in it, or point {key} at data that has them."
            ) from e
        raise ConfigError(f"{key}={path!r}, split={split!r}: {e}") from e
    return _from_hub(datasets, path, split, subset_name, key)


def text_columns(fmt) -> list[str]:
    """The columns of a format that hold text: the prompt (plaintext), the answer, a pair's two."""
    keys = [fmt.prompt_key if fmt.prompt_type == "plaintext" else None, fmt.response_key,
            getattr(fmt, "chosen_key", None), getattr(fmt, "rejected_key", None)]
    return [k for k in keys if k]


def _as_text(files: list[Path], fmt) -> dict:
    """load_dataset's arguments that read a CSV file's text columns as written: the csv reader types
    a column whose every value parses as a number, so the answer `02` reached the reward as the number
    2 (`1.50` as 1.5, `true` as True) and a right answer scored 0, without a word. Other columns keep
    their types (a `difficulty` to sort by); JSONL and Parquet files say their types themselves."""
    if fmt is None or not files or any(f.suffix != ".csv" for f in files):
        return {}
    return {"converters": {c: str for c in text_columns(fmt)}}


def _from_hub(datasets, path: str, split: str, subset_name: str | None, key: str):
    """A split of a Hugging Face hub dataset. Asked first whether the hub answers at all: when it
    does not, `datasets` retries for ~25 s, a warning a try, before it says so or reads its cache."""
    unreachable = None if _hub_cached(path) else _hub_unreachable(path)
    try:
        if unreachable:
            raise ConnectionError(unreachable)
        return datasets.load_dataset(path, name=subset_name, split=split)
    except Exception as e:
        why = unreachable or f"loading it as a Hugging Face dataset id failed ({type(e).__name__}: " \
                             f"{str(e).splitlines()[0] if str(e) else ''})"
        raise ConfigError(
            f"{key}={path!r}: there is no such local file or directory{_relative_to(path)}, and {why}. "
            f"Give the local path (absolute, or relative to the directory you run from), or download "
            f"the dataset first and point {key} at the local copy."
        ) from e


def _hub_cached(path: str) -> bool:
    """Whether this machine downloaded hub dataset `path` before (datasets reads it offline)."""
    import datasets
    from huggingface_hub import constants

    return ((Path(constants.HF_HUB_CACHE) / f"datasets--{path.replace('/', '--')}").is_dir()
            or (Path(datasets.config.HF_DATASETS_CACHE) / path.replace("/", "___")).is_dir())


def _hub_unreachable(path: str) -> str | None:
    """Why the hub cannot be asked for `path` from here; None when it answers (even 'no such dataset':
    datasets' own message says that)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    if any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return "it is not in this machine's Hugging Face cache, and HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set"
    try:
        HfApi().dataset_info(path, timeout=10)
    except HfHubHTTPError:  # the hub answered (no such dataset, gated, a bad id): datasets words it
        return None
    except Exception as e:  # no network, DNS, a proxy, a timeout
        return (f"it is not in this machine's Hugging Face cache, and the hub cannot be reached from here "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
    return None


def _check_split_of_file(f: Path, split: str, key: str, path: str) -> None:
    """A single file is one split, read whole: a split it is not named for (an eval set's
    split=test on the training file) would silently read the training rows."""
    words = re.split(r"[^A-Za-z0-9]+", f.stem.lower())
    if split != "train" and split.lower() not in words:
        raise ConfigError(
            f"{key}={path!r} is a single file, read whole, so split={split!r} cannot pick rows from it (they "
            f"would be its rows, whatever the split). Point the path at the file that holds the {split!r} rows "
            f"(a file whose name says {split!r}, or a directory with {split}.jsonl beside train.jsonl), or "
            f"set split=train to read this file as it is."
        )


def _split_files(d: Path, split: str) -> list[Path]:
    """The data files of directory `d` whose name says `split` (test.jsonl, test-00000.parquet)."""
    if not d.is_dir():
        return []
    return sorted(f for f in d.rglob("*") if f.suffix in _FILE_BUILDERS
                  and split.lower() in re.split(r"[^A-Za-z0-9]+", f.stem.lower()))


def _check_holds_data(d: Path, files: list[Path], key: str, path: str) -> None:
    """A local directory holds data files `datasets` reads as ours (else it would read notes.txt
    as a column 'text', or say only that it found no data files)."""
    if files or any(f.suffix in (".arrow", ".py") for f in d.rglob("*")):  # save_to_disk, a loading script
        return
    held = sorted(str(f.relative_to(d)) for f in d.rglob("*") if f.is_file())
    shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
    raise ConfigError(
        f"{key}={path!r} is a directory with no JSONL, JSON, Parquet or CSV file in it "
        f"({'it holds ' + shown if held else 'it is empty'}). Point it at a dataset file, a directory of "
        f"them (train.jsonl, test.jsonl), or a Hugging Face dataset id."
    )


def _first_non_utf8(f: Path) -> tuple[int, int, bytes] | None:
    """(line, column, the byte) of the first byte of text file `f` that is not UTF-8; None if all are.
    Read in blocks of whole lines, so a large file costs about what reading it does."""
    line = 1
    with open(f, "rb") as fh:
        while block := fh.read(1 << 24):
            block += fh.readline()
            try:
                block.decode("utf-8")
            except UnicodeDecodeError as e:
                start = block.rfind(b"\n", 0, e.start) + 1
                return line + block.count(b"\n", 0, e.start), e.start - start + 1, block[e.start:e.start + 1]
            line += block.count(b"\n")
    return None


def _relative_to(path: str) -> str:
    return "" if os.path.isabs(os.path.expanduser(path)) else f" (relative to {os.getcwd()})"


def _checked(load, files: list[Path], key: str, path: str):
    """`load()`, with the first unreadable line of a JSON file named when it fails, and an empty
    dataset called one."""
    for f in files:
        # pyarrow reads such bytes without a word; the row that holds them raises UnicodeDecodeError
        # when it is read (a raw traceback mid-run, or at the first task)
        bad = _first_non_utf8(f) if f.suffix in (".jsonl", ".json", ".csv") else None
        if bad:
            line, col, byte = bad
            raise ConfigError(
                f"{key}={path!r}: line {line} of {f} is not UTF-8 text (byte {byte!r} at column {col}); "
                f"datasets are read as UTF-8. Convert the file (e.g. iconv -f latin1 -t utf-8 {f.name} > "
                f"{f.stem}.utf8{f.suffix}) or fix the line."
            )
    try:
        rows = load()
    except Exception as e:
        for f in files:
            bad = _first_bad_json_line(f) if f.suffix in (".jsonl", ".json") else None
            if bad:
                line, err = bad
                raise ConfigError(
                    f"{key}={path!r}: line {line} of {f} is not valid JSON ({err}). Each line of a JSONL "
                    f"file must be one JSON object, e.g. {{\"question\": \"1+1\", \"answer\": \"2\"}}; fix "
                    f"or remove that line."
                ) from e
        if files and all(_blank(f) for f in files):  # blank lines too: datasets says its split "corresponds to no data"
            raise ConfigError(f"{key}={path!r} is empty: it holds no rows.") from e
        if isinstance(e, (ValueError, KeyError)):  # an unknown split or subset: the caller's to word
            raise
        raise ConfigError(f"{key}={path!r} could not be read as a dataset ({type(e).__name__}: {e}).") from e
    if len(rows) == 0:
        raise ConfigError(f"{key}={path!r} is empty: it holds no rows.")
    return rows


def _blank(f: Path) -> bool:
    """Whether file `f` holds nothing but whitespace (read a MiB at a time, up to the first other byte)."""
    with open(f, "rb") as fh:
        while chunk := fh.read(2**20):
            if chunk.strip():
                return False
    return True


def _first_bad_json_line(f: Path):
    if f.suffix == ".json":
        try:
            json.loads(f.read_text())
            return None
        except RecursionError:
            return 1, TOO_DEEP
        except ValueError as e:
            return getattr(e, "lineno", 1), _json_why(e)  # a whole .json file: json's line is the file's
    with open(f) as fh:
        for i, line in enumerate(fh, 1):
            if line.strip():
                try:
                    if not isinstance(json.loads(line), dict):
                        return i, "not a JSON object"
                except RecursionError:
                    return i, TOO_DEEP
                except ValueError as e:
                    return i, _json_why(e, line)
    return None


# json's (and Python's) limit: a value nested deeper is a RecursionError, which no reader here expects
TOO_DEEP = "nested too deeply to read (more than about 1,000 levels of brackets)"


def _json_why(e: ValueError, line: str | None = None) -> str:
    """What json found, and where in the line: its own "line 2 column 1 (char 32)" counts the lines
    of the text it was given (one JSONL line and its newline), not the file's, beside which it misled."""
    if not isinstance(e, json.JSONDecodeError):
        return str(e)
    if line is None:
        return f"{e.msg} at column {e.colno}"
    end = len(line.rstrip("\r\n"))
    return f"{e.msg} at the end of the line" if e.pos >= end else f"{e.msg} at column {e.pos + 1}"


def check_columns(rows, fmt, where: str, path: str, pairs: bool = False, sources: dict | None = None,
                  every_row: bool = False, split: str = "train") -> None:
    """The dataset has every column its format names (prompt, response, or chosen and rejected);
    `every_row`: and every row a value in them (a training dataset, which the trainer reads row by
    row as it goes: its gap is found here, before the run, not when a step reaches it)."""
    keys = [("messages_key" if fmt.prompt_type == "messages" else "prompt_key",
             fmt.messages_key if fmt.prompt_type == "messages" else fmt.prompt_key)]
    if pairs and fmt.chosen_key and fmt.rejected_key:
        keys += [("chosen_key", fmt.chosen_key), ("rejected_key", fmt.rejected_key)]
    elif fmt.response_key:
        keys.append(("response_key", fmt.response_key))
    columns = list(rows.column_names)
    sources = sources or {}
    for name, col in keys:
        if col not in columns:
            key = f"{where}.format.{name}"
            fix = sources.get(key, key)
            via = f", set by {fix}" if fix != key else ""
            raise ConfigError(
                f"{where}.path={path!r} has no column {col!r} ({key}{via}); its columns are "
                f"{sorted(columns)}. Add the column to the data, or set {fix} to the column that holds it."
            )
        if name != "messages_key":  # messages are lists; the other columns are text
            mixed = mixed_kinds(rows, col, where, path, name, split)
            if mixed:
                raise ConfigError(mixed)
    for name, col in keys if every_row else []:
        values = rows.data.column(col)  # load_rows' dataset: its arrow table, row for row
        fix = sources.get(f"{where}.format.{name}")
        if values.null_count:  # a JSONL row without the key reads as null
            import pyarrow.compute as pc

            i = pc.index(pc.is_null(values), True).as_py()
            raise ConfigError(missing_value(where, path, i, col, name, rows[i], fix, split))
        # a blank response teaches the model to say nothing, a blank prompt asks it nothing
        empty = _empty_rows(values)
        if empty:
            raise ConfigError(empty_values(where, path, name, col, empty, len(rows), fix, split))


_KINDS = {str: "text", bool: "true/false", int: "number", float: "number", list: "list", dict: "object"}


def mixed_kinds(rows, col: str, where: str, path: str, name: str, split: str = "train") -> str | None:
    """The message for a text column of a JSON(L) file that some rows fill with another kind of value
    (a number, a list): datasets then reads the whole column as JSON (its `Json` feature), and turns
    every text that parses as JSON into that value ("58" the number 58, "007" 7), without a word."""
    if type(rows.features.get(col)).__name__ != "Json":
        return None
    local = _jsonl_of(path, split)
    kinds: list = []
    if local is not None:  # the values as written, before datasets' decoding
        with open(local, encoding="utf-8") as fh:
            try:
                kinds = [_KINDS.get(type(json.loads(line).get(col)), "null") for line in fh if line.strip()]
            except RecursionError:  # a row nested too deep for json: the kinds are not placed by row
                kinds = []
    rows_kinds = [(i, k) for i, k in enumerate(kinds) if k != "null"]
    texts = sum(k == "text" for _, k in rows_kinds)
    if kinds and not texts:  # numbers and lists, say: no text for datasets to turn into another value
        return None
    odd = [(i, k) for i, k in rows_kinds if k != "text"] if texts * 2 >= len(rows_kinds) else []
    if not odd:  # rows this cannot place (a directory, a .json file), or text the fewer
        return (f"{where}.path={path!r}: the column {col!r} (format.{name}) holds values of several kinds (text and "
                f"numbers, lists or objects), so the datasets library reads every value of it as JSON: the text "
                f"'58' would arrive as the number 58. Give every row of the column the same kind (text).")
    one = len(odd) == 1
    shown = odd[:5]
    more = f" and {len(odd) - 5} more" if len(odd) > 5 else ""
    which = ", ".join(str(i) for i, _ in shown) + more
    lines = ", ".join(str(i + 1) for i, _ in shown) + more
    what = ", ".join(dict.fromkeys(f"{'an' if k[0] in 'aeio' else 'a'} {k}" for _, k in odd))
    first = json.dumps(str(rows.data.column(col)[odd[0][0]].as_py()))  # the value as the file writes it
    owner = "that row's value" if one else "those rows' values"
    others = "the other row holds" if texts == 1 else f"the other {texts} rows hold"
    # a list or object as the prompt is most often chat messages under the wrong key
    chat = (f" For chat messages set {where}.format.prompt_type=messages (and format.messages_key)."
            if name == "prompt_key" and any(k in ("list", "object") for _, k in odd) else "")
    return (f"{where}: row{'' if one else 's'} {which} (line{'' if one else 's'} {lines} of {_file_words(path, local)}) of "
            f"{path!r} hold{'s' if one else ''} {what} in {col!r} (format.{name}), where {others} "
            f"text. With two kinds of value in one column, the datasets library reads every value of it as JSON, so "
            f"the text '58' would arrive as the number 58 and '007' as 7. Write {owner} as text ({first}, quoted) or "
            f"give every row of the column the same kind.{chat}")


def _empty_rows(values) -> list[int]:
    """The rows of an arrow column that hold an empty (or blank) text or an empty list."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        blank = pc.equal(pc.utf8_trim_whitespace(values), "")
    elif pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
        blank = pc.equal(pc.list_value_length(values), 0)
    else:
        return []
    return pc.indices_nonzero(pc.fill_null(blank, False)).to_pylist()


def missing_value(where: str, path: str, index: int, col: str, name: str, row: dict, fix: str | None = None,
                  split: str = "train") -> str:
    """The message for a row of a training dataset without a value in column `col` (format.`name`);
    `fix`: the key that sets that column, where it is not {where}.format.{name} (a stage's own)."""
    return (f"{where}: {_line_hint(path, index, split)} of {path!r} has no {col!r} (format.{name}); its keys are "
            f"{sorted(k for k, v in row.items() if v is not None)}. Fix the row (or leave it out), or set "
            f"{fix or f'{where}.format.{name}'} to the column that holds it.")


def _line_hint(path: str, index: int, split: str = "train") -> str:
    local = _jsonl_of(path, split)
    if local is not None:
        return f"row {index} (line {index + 1} of {_file_words(path, local)})"
    return f"row {index}"


def _jsonl_of(path: str, split: str) -> Path | None:
    """The JSONL file whose lines are the rows of `split` read from `path` (the file itself, or a
    directory's one file of that split, as datasets maps test.jsonl to split test); None where rows
    and lines do not match one to one (Parquet, CSV, several files)."""
    local = Path(os.path.expanduser(path))
    if local.is_dir():
        files = _split_files(local, split)
        local = files[0] if len(files) == 1 else local
    return local if local.suffix == ".jsonl" and local.is_file() else None


def _file_words(path: str, local: Path, own: str = "its JSONL file") -> str:
    """How a message names the JSONL file of a row: a directory's file by its name in it (a
    directory holds one per split: "its file" would leave the user to guess which)."""
    d = Path(os.path.expanduser(path))
    return own if d == local else str(local.relative_to(d))


def plain(fmt):
    """A format config as a plain object: read once per row, a config node's attribute lookups
    cost more than the row itself."""
    from types import SimpleNamespace

    from omegaconf import DictConfig, OmegaConf

    return SimpleNamespace(**OmegaConf.to_container(fmt)) if isinstance(fmt, DictConfig) else fmt


def rows_to_messages(row: dict, fmt, where: str, index: int, path: str, split: str = "train") -> list[dict]:
    """The chat messages for one row, or a ConfigError naming the row and the missing key."""
    key = fmt.messages_key if fmt.prompt_type == "messages" else fmt.prompt_key
    value = row.get(key)
    if value is None:
        raise ConfigError(
            f"{where}: {_line_hint(path, index, split)} of {path!r} has no {key!r} "
            f"(format.{'messages_key' if fmt.prompt_type == 'messages' else 'prompt_key'}); its keys "
            f"are {sorted(k for k, v in row.items() if v is not None)}. Fix the row, or set "
            f"{where}.format.prompt_key to the column that holds the prompt."
        )
    if fmt.prompt_type == "messages":
        return list(value)
    if isinstance(value, (list, dict)):  # str() would make "['1', '2']" the prompt, without a word
        raise ConfigError(
            f"{where}: {_line_hint(path, index, split)} of {path!r} has a {type(value).__name__} in {key!r} "
            f"(format.prompt_key), not a text. For chat messages set {where}.format.prompt_type=messages "
            f"(and format.messages_key); else make the column text."
        )
    messages = [{"role": "system", "content": fmt.system_prompt}] if fmt.system_prompt else []
    return messages + [{"role": "user", "content": str(value)}]


def load_tasks(ts_cfg, where: str) -> list[Task]:
    """Every row of a taskset as a Task; fails on the first row that lacks the prompt key or
    (unless format.response_key is null) the reference answer the reward function reads."""
    rows = load_rows(ts_cfg.path, ts_cfg.split, ts_cfg.subset_name, key=f"{where}.path", fmt=ts_cfg.format)
    check_columns(rows, ts_cfg.format, where, ts_cfg.path, split=ts_cfg.split)
    group_by = getattr(ts_cfg, "group_by", None)  # an eval set's: a column missing put every task in one group
    if group_by and group_by not in rows.column_names:
        raise ConfigError(
            f"{where}.group_by={group_by!r}: {where}.path={ts_cfg.path!r} has no column {group_by!r}, so every "
            f"task would fall in one group '{group_by}=None'; its columns are {sorted(rows.column_names)}. Set "
            f"{where}.group_by to one of them, or to null for the set's metrics alone.")
    fmt, path, name = plain(ts_cfg.format), ts_cfg.path, ts_cfg.name
    answer_key = fmt.response_key
    tasks, empty = [], []
    for i, row in enumerate(rows):
        messages = rows_to_messages(row, fmt, where, i, path, ts_cfg.split)
        if not any(str(m.get("content") or "").strip() for m in messages if m.get("role") != "system"):
            empty.append(i)
        if answer_key and row.get(answer_key) is None:
            raise ConfigError(
                f"{where}: {_line_hint(path, i, ts_cfg.split)} of {path!r} has no {answer_key!r} "
                f"(format.response_key: the reference answer the reward function reads as task.answer). "
                f"Fix the row, or set {where}.format.response_key=null if your reward needs no answer."
            )
        tasks.append(Task(f"{name}/{i}", messages, row.get(answer_key) if answer_key else None, row))
    if empty:
        key = "messages_key" if fmt.prompt_type == "messages" else "prompt_key"
        raise ConfigError(empty_values(where, path, key, getattr(fmt, key), empty, len(rows), split=ts_cfg.split))
    return tasks


def empty_values(where: str, path: str, key: str, column: str, empty: list[int], total: int,
                 fix: str | None = None, split: str = "train") -> str:
    """The message for rows whose prompt (or, in a training dataset, response) in `column`
    (format.`key`) is empty or blank. Any is an error, not a share: a blank prompt asks the model
    nothing but the chat template's scaffolding, and its answers are scored as if it were asked the
    task (a column of mostly blanks, a key naming the wrong column) -- without a word."""
    what = "prompt" if key in ("prompt_key", "messages_key") else "response"
    more = f" and {len(empty) - 5} more" if len(empty) > 5 else ""
    rows = ", ".join(str(i) for i in empty[:5]) + more
    local = _jsonl_of(path, split)
    lines = (f" (line{'s' if len(empty) > 1 else ''} {', '.join(str(i + 1) for i in empty[:5])}{more} of "
             f"{_file_words(path, local, 'the file')})" if local else "")
    return (f"{where}: {len(empty)} of the {total} rows of {path!r} have an empty {what} in {column!r} "
            f"(format.{key}): row{'s' if len(empty) > 1 else ''} {rows}{lines}. Fill or remove those rows, or set {fix or f'{where}.format.{key}'} "
            f"to the column that holds the {what}s.")
