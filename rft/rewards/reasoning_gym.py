"""The `reasoning_gym` reward: a reasoning-gym dataset's own scorer, `dataset.score_answer(answer,
entry)`, on the entry the row was generated from (task=reasoning_gym, rft/data/reasoning_gym.py).

The row carries what the scorer needs: `dataset` (the dataset's name), `entry` (the entry as
reasoning-gym made it: question, answer, metadata; JSON text, since a mix's metadata differ in
shape from one dataset to the next and would not make one table column) and `dataset_config` (the
keyword arguments the dataset was made with, JSON). The answer scored is the response's last
`<answer>...</answer>` if it has one (reasoning-gym's `extract_answer`: what its prompts for
instruction-tuned models ask for), else the whole response, stripped (what the tiny model writes).

Also here: importing the package with a one-paragraph error when it is missing, and checking a
dataset's name and config, which the generator shares.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json

from rft.errors import ConfigError
from rft.rewards.verifiers import last_tagged
from rft.rewards.workers import NoWorker, Refused, Workers, serve

EXTRA = "pip install -e '.[reasoning-gym]'"


def library():
    """The reasoning_gym package, or a ConfigError saying which extra installs it."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise ConfigError(
            f"task=reasoning_gym (buffer.explorer_input.generator=reasoning_gym, reward reasoning_gym) needs the "
            f"reasoning-gym package, which is not installed here ({e}). Install the project's extra: {EXTRA} "
            f"(or pip install reasoning-gym)."
        ) from e
    return reasoning_gym


def check_dataset(name: str, config: dict, where: str) -> None:
    """A dataset `name` reasoning-gym has, and a `config` its <Name>Config takes; else one
    paragraph naming the key, the close names or the fields, and the fix."""
    datasets = library().factory.DATASETS
    if name not in datasets:
        close = difflib.get_close_matches(name, datasets, n=3, cutoff=0.6)
        hint = f"Did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
        raise ConfigError(
            f"{where}.name={name!r} is not a reasoning-gym dataset. {hint}Its {len(datasets)} datasets are listed "
            f"by `python -c \"import reasoning_gym; print(sorted(reasoning_gym.factory.DATASETS))\"`; "
            f"set {where}.name to one of them."
        )
    fields = [f.name for f in dataclasses.fields(datasets[name][1])]
    unknown = sorted(set(config) - set(fields))
    if unknown:
        keys = [f for f in fields if f not in ("seed", "size")]
        raise ConfigError(
            f"{where}.config has {unknown}, which {name}'s config ({datasets[name][1].__name__}) does not take; "
            f"its keys are {keys}. Fix or remove them."
        )


def make_dataset(name: str, kwargs: dict, where: str):
    """reasoning_gym.create_dataset(name, **kwargs), its config's own check (an assert or a
    ValueError: min_digits > max_digits) as a ConfigError."""
    check_dataset(name, kwargs, where)
    try:
        return library().create_dataset(name, **kwargs)
    except (AssertionError, ValueError, TypeError) as e:
        shown = {k: v for k, v in kwargs.items() if k not in ("seed", "size")}
        raise ConfigError(
            f"{where}: reasoning-gym rejects {name}'s config {shown} ({type(e).__name__}: {e or 'a failed check'}). "
            f"Fix {where}.config."
        ) from e


@functools.lru_cache(maxsize=64)
def _scorer(name: str, kwargs_json: str):
    """The dataset that scores the rows made with these arguments, made once per process."""
    return make_dataset(name, json.loads(kwargs_json), "reward reasoning_gym")


def answer_of(response: str) -> str:
    """What is scored: the last <answer>...</answer> of the response, else all of it (stripped).

    As reasoning-gym's `extract_answer` reads it, without its regex (`last_tagged`)."""
    tagged = last_tagged(response)
    return (tagged if tagged is not None else response).strip()


def reasoning_gym(prompt: str, response: str, task, timeout_seconds: float = 10.0) -> float:
    """The row's dataset's score_answer(answer, entry): 1.0 for a right answer, partial credit
    where the dataset gives it (its own rules), 0.0 for a wrong one.

    Scored in a confined child process (rft/rewards/workers.py), never in this one: several
    datasets' scorers `eval` the answer or hand it to sympy's parse_expr. An answer the child
    refuses to run, or one not scored within `timeout_seconds`, scores 0."""
    row = task.row or {}
    missing = [k for k in ("dataset", "entry", "dataset_config") if k not in row]
    if missing:
        raise ValueError(
            f"the reasoning_gym reward reads the row's 'dataset', 'entry' and 'dataset_config' columns (written by "
            f"generator=reasoning_gym); this row lacks {missing} (task {task.task_id})"
        )
    library()
    name, config = str(row["dataset"]), str(row["dataset_config"])
    try:
        out = _WORKERS.call([name, config, str(row["entry"]), answer_of(str(response))], timeout_seconds,
                            setup=name + config)
    except TimeoutError:
        return 0.0
    except NoWorker as e:  # never in this process: its scorers run the model's text
        raise RuntimeError(f"the reasoning_gym reward scores in a child process, and {e}") from None
    if "error" in out:
        raise ValueError(f"the reasoning_gym reward, dataset {name!r} (task {task.task_id}): {out['error']}")
    return float(out["score"])


def same_answer(a: str, b: str, task=None, timeout_seconds: float = 10.0) -> bool:
    """maj@n's judgement (rft.rewards.verifiers.SAME_ANSWER): whether the row's dataset's scorer takes
    answers a and b for one, each scoring 1.0 with the other in the entry's answer ("1,000" and
    "+01000.00" for chain_sum, "Olleh" and "olleh" for spell_backward; as strings they split the vote).
    Both ways, so that a scorer that judges by the question's metadata, not the answer (countdown:
    any expression that makes the target), joins two right answers but never a wrong one with a
    right one. No task, a row without the scorer's columns, a timeout or an error: not one."""
    row = (task.row if task is not None else None) or {}
    if any(k not in row for k in ("dataset", "entry", "dataset_config")):
        return False
    library()
    name, config, entry = str(row["dataset"]), str(row["dataset_config"]), json.loads(str(row["entry"]))

    def full(answer: str, reference: str) -> bool:
        try:
            out = _WORKERS.call([name, config, json.dumps({**entry, "answer": reference}, default=str), answer],
                                timeout_seconds, setup=name + config)
        except (TimeoutError, NoWorker):
            return False
        return out.get("score") == 1.0

    return full(b, a) and full(a, b)


def _score(name: str, config: str, entry: str, answer: str) -> dict:
    """In the child: {"score": x}; a refused answer scores 0; any other error is the caller's."""
    try:
        dataset = _scorer(name, config)
        entry = json.loads(entry)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    try:
        return {"score": float(dataset.score_answer(answer, entry))}
    except Refused:  # the answer tried what no scorer needs (rft/rewards/workers.py)
        return {"score": 0.0}
    except Exception as e:
        return {"error": f"its score_answer raised {type(e).__name__}: {e}"}


def _worker() -> None:
    """A scoring child: the package (every dataset's module, sympy) loads before it is confined."""
    library()
    serve(_score)


_WORKERS = Workers("rft.rewards.reasoning_gym:_worker")
