"""What a POST body to the studio may say, checked before anything is composed: a JSON object whose
groups are conf/'s, whose options are files of their group, whose keys and values are one line of
printable text each, none of them Hydra's own settings; a sweep's values are overrides, never
command-line flags. Each mistake is a ValueError naming the field, which the app answers as a 400.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from rft.reporting.redact import redact_override
from rft.studio.compose import control_character

# Hydra's own settings, in any override form (hydra.job.env_set.X, +hydra..., hydra/launcher=...,
# a group put there: +experiment@hydra.job.env_set=x): they reach logging handlers' classes,
# callbacks' `_target_`s and the job's environment
HYDRA_KEY = re.compile(r"^[+~]*hydra([./@]|$)|@(_global_\.)?hydra([./]|$)")


def parse(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"the request body is not JSON ({e}); send a JSON object.") from None
    except RecursionError:
        raise ValueError("the request body nests too deep; send a JSON object of groups and keys.") from None
    if not isinstance(body, dict):
        raise ValueError(f"the request body is a JSON {type(body).__name__}; send a JSON object "
                         f'({{"choices": {{group: option}}, "keys": {{key: value}}}}).')
    return body


def _mapping(body: dict, field: str) -> dict:
    value = body.get(field)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{field}: a JSON object of {field} is expected, not a {type(value).__name__}.")
    return value


def _key(where: str, key: str) -> None:
    control_character(where, key)
    if key.startswith("-"):
        raise ValueError(f"{where}: a key is a config key, not a command-line flag; take out the leading '-'.")
    if HYDRA_KEY.search(key):
        raise ValueError(f"{where}: the studio does not change Hydra's own settings (hydra.*: its logging, callbacks, "
                         f"launcher, the job's environment); set them in a file under conf/, the launcher on the form.")


def _no_secret(where: str, override: str) -> None:
    """A ValueError naming `where` when the override holds a secret (rft/reporting/redact.py): a
    launched run has its overrides on its command line, which `ps` shows to every local user, and
    the saved study and the launch record would keep it."""
    if redact_override(override) != override:
        raise ValueError(f"{where}: holds a secret (a token, an API key or a password), which the studio does not "
                         f"take: a run it launches has its values on its command line, which `ps` shows to every "
                         f"local user, and a saved study or the launch record would keep it. Set it in the "
                         f"environment the studio starts from ($RFT_REWARD_TOKEN for the remote reward's token; a "
                         f"judge's api_key names the variable that holds its key) and leave it out of the form.")


def composition(body: dict, options: dict[str, list[str]]) -> tuple[dict[str, str], dict[str, str]]:
    """(choices, keys) of a compose, save or launch body: each group one of conf/'s, each option
    one of its files, each key and value one line (a number or a boolean is taken as its text)."""
    choices = {}
    for group, option in _mapping(body, "choices").items():
        if group not in options:
            raise ValueError(f"choices: no config group {group!r}; the groups are {sorted(options)}.")
        if option not in options[group]:
            raise ValueError(f"choices.{group}={option!r} is not a file of conf/{group}/; choose one of {options[group]}.")
        choices[group] = option
    keys = {}
    for key, value in _mapping(body, "keys").items():
        where = f"keys[{key!r}]"
        _key(where, key)
        if not isinstance(value, (str, int, float)):
            raise ValueError(f"{where}: give the value as text (an override's right-hand side), not a {type(value).__name__}.")
        control_character(where, str(value))
        _no_secret(where, f"{key}={value}")
        keys[key] = str(value)
    return choices, keys


def launcher_options(conf_dir: Path) -> list[str]:
    """"basic" (Hydra's own: one job after another) and each file of conf/hydra/launcher/."""
    return ["basic", *sorted(p.stem for p in (Path(conf_dir) / "hydra" / "launcher").glob("*.yaml"))]


def sweep_args(body: dict) -> list[str]:
    """A sweep's values (`seed=1,2,3 'algorithm.optimizer.lr=1e-3,3e-3'`), split as a shell would:
    each one an override."""
    text = body.get("sweep_params") or ""
    if not isinstance(text, str):
        raise ValueError("sweep_params: give the sweep's values as one line of text, e.g. seed=1,2,3.")
    control_character("sweep_params", text)
    try:
        args = shlex.split(text)
    except ValueError as e:
        raise ValueError(f"sweep_params: {e} (quote a value with spaces or commas as a shell would).") from None
    for arg in args:
        if "=" not in arg:
            raise ValueError(f"sweep_params: {arg!r} is not an override; write key=value1,value2 (e.g. seed=1,2,3).")
        _key(f"sweep_params {arg!r}", arg.split("=", 1)[0])
        _no_secret(f"sweep_params {arg.split('=', 1)[0]!r}", arg)  # the key alone: the message shows no secret
    return args


def launcher(body: dict, options: list[str]) -> str:
    name = body.get("launcher") or "basic"
    if name not in options:
        raise ValueError(f"launcher={name!r}: choose one of {options} (conf/hydra/launcher/).")
    return name


def confirmed(body: dict) -> set[str]:
    """The dotted paths the page's user confirmed importing (the page asks; see imports.py)."""
    paths = body.get("confirm_imports") or []
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise ValueError("confirm_imports: a list of the dotted paths confirmed, as the refusal listed them.")
    return set(paths)
