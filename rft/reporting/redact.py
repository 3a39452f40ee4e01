"""Secrets kept out of what a run saves and shows: a config, its overrides, a tracker's copy of them.

A secret is the value of a key named `token`, `api_key`, `password` or `secret` (any letter case;
the remote reward's `args.token`, a judge's `args.api_key`), and the password of a URL
(`https://user:password@host`, an MLflow server's say). It is written `***` (MASK). A judge's
`api_key` that is the name of an environment variable (`OPENAI_API_KEY`: upper-case letters, digits
and `_`, as rft/rewards/judge.py documents it) is not the key and is kept, as is a secret already
written MASK. A value under such a key that is not text (null: none given) is kept.

The remote reward reads MASK as "not given": its token comes from $RFT_REWARD_TOKEN, so that a run
composed again from a saved record (the studio's launch form filled from one) gets the token from
the environment, where it should have been all along, and not the three characters.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from contextlib import contextmanager

MASK = "***"
SECRET_KEYS = frozenset({"token", "api_key", "password", "secret"})
# the name of an environment variable (judge.py's api_key holds one by default): not the secret
ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*\Z")
# scheme://user:password@ -> scheme://user:***@
URL_PASSWORD = re.compile(r"(?<=://)([^/@:\s]*):([^/@\s]+)@")
# a secret key inside an override's value (`reward_fn=[{fn: remote, args: {token: abc}}]`, YAML
# flow or JSON, a URL's query): the key, then its value quoted or up to the next , } ] & or space
# text that is a Hydra override: `key=`, `+key=`, `~key=`, `group@package=`
OVERRIDE = re.compile(r"[+~]*[\w.@/-]+=")
INLINE = re.compile(r"""(?P<key>(?<![\w-])["']?(?P<name>token|api_key|password|secret)["']?\s*[:=]\s*)"""
                    r"""(?P<value>"(?:[^"\\]|\\.)*"|'[^']*'|[^,}\]\s&"']+)""", re.IGNORECASE)


def is_secret(key, value) -> bool:
    """Whether `value`, found under `key` (its last dotted part: a flat config's keys), is a
    secret to hide (module docstring). An interpolation (`${oc.env:RFT_REWARD_TOKEN}`, in a config
    as composed) is where the secret comes from, not the secret: kept."""
    name = key.rsplit(".", 1)[-1].lower() if isinstance(key, str) else None
    if name not in SECRET_KEYS or not isinstance(value, str):
        return False
    value = value.strip().strip("\"'")
    if not value or value == MASK or value.startswith("${"):
        return False
    return not (name == "api_key" and ENV_NAME.match(value))


def redact_text(text: str) -> str:
    """`text` with each URL's password and each inline `token: value` (see INLINE) masked."""
    def inline(m: re.Match) -> str:
        if not is_secret(m["name"], m["value"]):
            return m[0]
        quote = m["value"][0] if m["value"][0] in "\"'" else ""
        return f"{m['key']}{quote}{MASK}{quote}"

    return INLINE.sub(inline, URL_PASSWORD.sub(rf"\1:{MASK}@", text))


def redact(tree):
    """A copy of `tree` (dicts, lists and scalars: a config as plain containers) with every secret
    MASK; text elsewhere has its URLs' passwords masked, and text that is an override (Hydra's
    record of the command line: `hydra.overrides.task`, `override_dirname`) its secrets. Other
    text (a judge's template saying "token: {response}") is left as written."""
    if isinstance(tree, Mapping):
        return {k: MASK if is_secret(k, v) else redact(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [redact(v) for v in tree]
    if isinstance(tree, str):
        # redact_text, not redact_override: override_dirname joins overrides with commas, where it stops
        return redact_text(tree) if OVERRIDE.match(tree) else URL_PASSWORD.sub(rf"\1:{MASK}@", tree)
    return tree


def redact_override(override: str) -> str:
    """A Hydra override (`[+~]key=value`) with its secret masked: the whole value where the key's
    last part is a secret's name (`...args.token=abc`), else the secrets inside the value."""
    key, eq, value = override.partition("=")
    if eq and is_secret(key.lstrip("+~").split("@")[0], value):
        return f"{key}={MASK}"
    return redact_text(override)


def redact_overrides(overrides) -> list[str]:
    return [redact_override(str(o)) for o in overrides]


@contextmanager
def redacted_argv():
    """sys.argv with its secrets masked while the block runs: what a tracker records as the
    command line (wandb's run metadata reads sys.argv) shows no token typed on it."""
    saved = sys.argv
    sys.argv = [saved[0], *redact_overrides(saved[1:])] if saved else saved
    try:
        yield
    finally:
        sys.argv = saved


def config_yaml(cfg, resolve: bool = False) -> str:
    """A config (DictConfig, or plain containers) as YAML with its secrets masked: what a run's
    record (.hydra/config.yaml, as composed; a stage's config.yaml, resolved) should hold."""
    from omegaconf import OmegaConf

    tree = OmegaConf.to_container(cfg, resolve=resolve) if OmegaConf.is_config(cfg) else cfg
    return OmegaConf.to_yaml(OmegaConf.create(redact(tree)))


# where each secret is given instead of on the command line (rft/rewards/remote.py, judge.py,
# rft/reporting/monitor.py): a command line is in `ps` for every local user while the run lives
FROM_ENVIRONMENT = ("the remote reward's token in $RFT_REWARD_TOKEN (or args.token_file), a judge's api_key as the name "
                    "of the environment variable that holds the key, MLflow's password in $MLFLOW_TRACKING_PASSWORD, "
                    "wandb's key in $WANDB_API_KEY")


def typed_secrets(overrides) -> list[str]:
    """The overrides (a command line's) that hold a secret, each as it is shown: masked."""
    return [shown for o in overrides if (shown := redact_override(str(o))) != str(o)]


def command_line_warning(overrides) -> str | None:
    """One line for a command line that holds a secret (None: none does)."""
    typed = typed_secrets(overrides)
    if not typed:
        return None
    return (f"a secret is typed on the command line ({'; '.join(typed)}): every user of this machine sees a "
            f"command line in `ps` while it runs. Give it through the environment instead: {FROM_ENVIRONMENT}. "
            f"What the run writes holds it as {MASK}.")


def redact_file(path) -> bool:
    """Rewrite the YAML record at `path` (a sweep's multirun.yaml, which Hydra writes itself, the
    command line's secrets whole) with its secrets masked; True when it held one. Interpolations
    stay as written (not resolved). A file that is not there or not a mapping is left alone."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from rft import manifest

    path = Path(path)
    try:
        tree = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception:  # missing, or not YAML OmegaConf reads: nothing rft can mask in it
        return False
    masked = redact(tree)
    if masked == tree:
        return False
    manifest.write_atomic(path, OmegaConf.to_yaml(OmegaConf.create(masked)))
    return True
