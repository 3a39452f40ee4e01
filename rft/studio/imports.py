"""The dotted paths a composed config makes a run import, and those from outside the project: what
the compose page lists before a launch, and what a launch needs confirmed.

The runtime imports a key's value when it is a dotted path (a registry name has no dot): the
algorithm's functions (rft.algorithms.resolve), reward functions and served rewards
(rft.rewards.scoring.resolve_fn), workflows, a multi-turn workflow's environment, an agent, a judge's
parser (rft.rewards.judge), and Hydra's `_target_`. Those keys are IMPORT_KEYS, wherever they sit; any
other string that reads as a dotted path into a module that exists is listed too, so a key added
later is not a way around the list. Hydra's own settings are read as well (foreign_hydra): a config
file may set callbacks and logging handlers there, and the run's environment.
A model config with trust_remote_code runs its folder's Python files: listed too (remote_code).

"Own" code is the project's package (`rft.*`) and what sits at the top of the repository, where
`python run.py` imports a study's own code from (`my_study/rewards.py`, `experiments/...`); a name
that one of them only imports from elsewhere (`rft.rollout.environments.sandbox.subprocess`) is not its own. Everything
else (the standard library, installed packages) is foreign: `subprocess.Popen`, `os.system` and
`builtins.eval` are all listed.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

IMPORT_KEYS = frozenset({"_target_", "advantage_fn", "policy_loss_fn", "kl_loss_fn", "kl_penalty_fn", "reward_fn",
                         "default_reward_fn_type", "fn", "workflow", "env", "agent", "parse", "priority_fn"})
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
# a value like `test.jsonl` under a key the runtime does not import names a file, not a module
FILE_SUFFIXES = frozenset({"json", "jsonl", "parquet", "csv", "tsv", "txt", "yaml", "yml", "db", "sqlite", "arrow",
                           "bin", "pt", "safetensors", "log", "md", "gz", "zip", "tar"})


def paths_in(tree, key: str = "") -> list[tuple[str, str]]:
    """(key, dotted path) for each string in the config tree that the run may import."""
    if isinstance(tree, dict):
        return [p for k, v in tree.items() for p in paths_in(v, f"{key}.{k}" if key else str(k))]
    if isinstance(tree, list):
        return [p for i, v in enumerate(tree) for p in paths_in(v, f"{key}[{i}]")]
    if not isinstance(tree, str) or not DOTTED.fullmatch(tree):
        return []
    leaf = re.sub(r"\[\d+\]$", "", key).rsplit(".", 1)[-1]
    if leaf in IMPORT_KEYS or (_exists(tree.split(".")[0]) and tree.rsplit(".", 1)[1] not in FILE_SUFFIXES):
        return [(key, tree)]
    return []


def _exists(top: str) -> bool:
    """A top-level module of that name can be imported here (found, not imported)."""
    if top in sys.builtin_module_names or top in sys.modules:
        return True
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False


def own(module: str, repo: Path) -> bool:
    top = module.split(".")[0]
    return top == "rft" or (repo / top).is_dir() or (repo / f"{top}.py").is_file()


def origin(path: str, repo: Path) -> str | None:
    """The module that defines what an own dotted path names, when the module named only imports
    it: read from its source (nothing is imported but the packages above it)."""
    module, _, attr = path.rpartition(".")
    try:
        spec = importlib.util.find_spec(module)
        source = Path(spec.origin).read_text() if spec and spec.origin and spec.origin.endswith(".py") else ""
        tree = ast.parse(source)
    except (ImportError, ValueError, OSError, SyntaxError):
        return None  # the run cannot import it either: its plan says so
    for node in tree.body:
        if isinstance(node, ast.Import):
            for a in node.names:
                if (a.asname or a.name.split(".")[0]) == attr:
                    return a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            for a in node.names:
                if (a.asname or a.name) == attr:
                    return f"{node.module}.{a.name}"
    return None


def foreign(tree, repo: Path, key: str = "") -> list[dict]:
    """{"key", "path", "module"} for each dotted path in the config the run would import from
    outside the project: "module" is where what it names is defined."""
    repo = Path(repo).resolve()
    out = []
    for key, path in paths_in(tree, key):
        found = path if not own(path, repo) else origin(path, repo)
        if found and not own(found, repo):
            out.append({"key": key, "path": path, "module": found.rpartition(".")[0] or found})
    return out


REMOTE_CODE = "the Python files of that model's folder or hub repository (trust_remote_code)"


def remote_code(tree, key: str = "") -> list[dict]:
    """{"key", "path", "module"} for each model config that sets trust_remote_code: transformers
    then runs the Python files its model_path (and critic_model_path) hold."""
    if isinstance(tree, list):
        return [i for n, v in enumerate(tree) for i in remote_code(v, f"{key}[{n}]")]
    if not isinstance(tree, dict):
        return []
    here = f"{key}.trust_remote_code" if key else "trust_remote_code"
    out = [{"key": here, "path": str(tree[p]), "module": REMOTE_CODE}
           for p in ("model_path", "critic_model_path") if tree.get("trust_remote_code") is True and tree.get(p)]
    return out + [i for k, v in tree.items() for i in remote_code(v, f"{key}.{k}" if key else str(k))]


# in the hydra node, what Hydra itself names: its launchers and sweepers (its plugins' too) and the
# handlers of its default logging config
HYDRA_OWN = ("hydra.", "hydra_plugins.")
HYDRA_LOGGING = frozenset({"logging.StreamHandler", "logging.FileHandler"})
ENVIRONMENT = "the environment of every process the run starts"


def foreign_hydra(node: dict, repo: Path) -> list[dict]:
    """foreign() of the composed config's hydra node, where a config file (a study, a group's
    option) may set what the page may not: Hydra instantiates its callbacks and builds its logging
    handlers (classes and `()` factories); less Hydra's own. Then each variable hydra.job.env_set
    puts in the run's environment (LD_PRELOAD, PYTHONPATH: code its processes load), as
    "NAME=value"."""
    env = dict((node.get("job") or {}).get("env_set") or {})
    found = [i for i in foreign(node, repo, "hydra") if not i["path"].startswith(HYDRA_OWN)
             and i["path"] not in HYDRA_LOGGING and not i["key"].startswith("hydra.job.env_set.")]
    return found + [{"key": f"hydra.job.env_set.{k}", "path": f"{k}={v}", "module": ENVIRONMENT} for k, v in env.items()]
