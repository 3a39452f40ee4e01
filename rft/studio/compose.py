"""The studio's compose page, without the page: config groups and their options read from `conf/`,
every key of the typed schema with its type, default and comment, and one composition (Hydra's
compose API, the same `conf/` and schema as `python run.py`) with its batch plan or its error.

Nothing here keeps a second copy of the config: the groups are the directories of `conf/`, an
option's text is its file's first comment, a key's comment is the one above its field in
rft/config.py, and a composition is Hydra's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import inspect
import itertools
import math
import re
import shlex
import threading
import typing
import unicodedata
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf, open_dict

from rft import config as C
from rft.reporting.redact import config_yaml, redact
from rft.studio import imports as I
from rft.studio import writes as W

# groups the page offers; hydra/ (launchers) is chosen on the launch form
SKIP_GROUPS = {"hydra"}
NONE = "null"  # the choice "no option" (experiment: null)
# Hydra's compose API and HydraConfig are process-wide singletons: one composition at a time
_LOCK = threading.Lock()
REPO = Path(__file__).resolve().parents[2]
ENV_REF = re.compile(r"\$\{oc\.env:\s*([A-Za-z_]\w*)")


def first_comment(path: Path) -> str:
    """The file's first comment that says what the option is: its opening comment lines, less the
    `# @package` line and the `# python run.py ...` usage lines."""
    out = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            if out or line.strip():
                break
            continue
        text = line[1:].strip()
        if text.startswith("@package") or text.startswith("python ") or (not text and not out):
            if out:
                break
            continue
        out.append(text)
    return " ".join(out)


def groups(conf_dir: Path) -> dict[str, list[dict]]:
    """{group: [{"name": option, "comment": first comment}, ...]} for every group directory."""
    out = {}
    for d in sorted(p for p in Path(conf_dir).iterdir() if p.is_dir() and p.name not in SKIP_GROUPS):
        options = [{"name": f.stem, "comment": first_comment(f)} for f in sorted(d.glob("*.yaml"))]
        if d.name == "experiment":
            options.insert(0, {"name": NONE, "comment": "no named study"})
        out[d.name] = options
    return out


# ---------------------------------------------------------------- the schema


def _field_comments(cls) -> dict[str, str]:
    """{field: the comment lines just above it (or at the end of its line)} in cls's source."""
    comments, pending = {}, []
    for line in inspect.getsource(cls).splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped[1:].strip())
            continue
        m = re.match(r"\s+(\w+)\s*:", line)
        if m and not stripped.startswith(("def ", "@")):
            inline = line.split("#", 1)[1].strip() if "#" in line and "=" in line.split("#", 1)[0] else ""
            comments[m.group(1)] = " ".join(pending + ([inline] if inline else []))
        pending = []
    return comments


def _type_name(hint) -> str:
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of " + " | ".join(e.value for e in hint)
    text = getattr(hint, "__name__", None) if isinstance(hint, type) else None
    return text or str(hint).replace("typing.", "")


SAFE = re.compile(r"^[\w./:@+\-~]+$")
WORDS = {"null", "true", "false", "nan", "inf", "-inf"}


def _override_text(value) -> str:
    """A value as a command-line override writes it (what the page's inputs hold): Hydra's
    grammar, which is not JSON (a dict's keys are bare), with strings quoted where needed."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_override_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_override_text(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if "${" in text or (SAFE.match(text) and text.lower() not in WORDS and not _number(text)):
        return text  # interpolations are Hydra's own grammar, quoted or not
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


@functools.lru_cache(maxsize=1)
def schema() -> list[dict]:
    """Every leaf key of the typed schema, in its order: {"key", "type", "choices" (an enum's or a
    bool's values, else None), "default" (the schema's, as override text), "comment"}. Read from
    rft/config.py's source once per process (every composition lists its values): do not change it."""
    out = []

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        comments = _field_comments(cls)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            if dataclasses.is_dataclass(hint):
                walk(hint, f"{prefix}{f.name}.")
                continue
            inner = [a for a in typing.get_args(hint) if a is not type(None)]
            base = inner[0] if typing.get_origin(hint) is typing.Union and len(inner) == 1 else hint
            if isinstance(base, type) and issubclass(base, enum.Enum):
                choices = [e.value for e in base]
            elif base is bool:
                choices = ["true", "false"]
            else:
                choices = None
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = None
            default = "???" if default == "???" else _override_text(default)
            out.append({"key": prefix + f.name, "type": _type_name(hint), "choices": choices,
                        "default": default, "comment": comments.get(f.name, "")})

    walk(C.Config, "")
    return out


# ---------------------------------------------------------------- one composition


@dataclasses.dataclass
class Composition:
    choices: dict[str, str]  # group -> option, as composed (the defaults filled in)
    overrides: list[str]  # what the command line says: changed groups, then keys
    command: str  # python run.py <overrides>, quoted for a POSIX shell
    values: dict[str, str]  # every schema key's composed value, as override text
    yaml: str  # the composed config, as `python run.py <overrides> --cfg job` prints it
    plan: str  # the batch plan (the dry run's text), or "" when there is an error
    error: str  # the configuration error, one paragraph, or ""
    # the dotted paths the run would import from outside rft and the repository (imports.foreign)
    imports: list[dict] = dataclasses.field(default_factory=list)
    run_dir: str = ""  # where the run writes (checkpoint_root_dir/project/name)
    sweep_dir: str = ""  # where a sweep of it would write (hydra.sweep.dir, as of now)
    # the paths other keys give where the run writes (rft/studio/writes.py), once planned
    writes: list = dataclasses.field(default_factory=list)


def _get(tree: dict, key: str):
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def overrides_of(choices: dict[str, str], keys: dict[str, str], default_choices: dict[str, str]) -> list[str]:
    """Command-line overrides: each group whose option differs from conf/config.yaml's default,
    then each key=value the page set."""
    out = [f"{g}={o}" for g, o in choices.items() if o and default_choices.get(g) != o]
    return out + [f"{k}={v}" for k, v in keys.items()]


def _compose(conf_dir: Path, overrides: list[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(Path(conf_dir).resolve()), version_base="1.3"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # ${hydra:runtime.choices.model} in `name` resolves
    return cfg


def _message(e: Exception) -> str:
    """The error as one paragraph: its text and its cause's (Hydra's "Error merging override
    mode=x" says why in its cause), less OmegaConf's "full_key: ... object_type=..." lines."""
    parts = []
    while e is not None and len(parts) < 3:
        text = str(getattr(e, "cause", None) or e).strip()
        text = " ".join(line.strip() for line in text.splitlines()
                        if not re.match(r"\s*(full_key|reference_type|object_type)\s*[:=]", line))
        if text and not any(text in p for p in parts):
            parts.append(text)
        e = e.__cause__
    return ": ".join(parts)


@functools.lru_cache(maxsize=4)
def conf_env_names(conf_dir: str) -> frozenset[str]:
    """The environment variables conf/'s files read (`${oc.env:NAME...}`), as they were when first
    asked (the studio asks as it starts): the only ones the preview reads."""
    return frozenset(n for f in Path(conf_dir).rglob("*.yaml") for n in ENV_REF.findall(f.read_text()))


@contextlib.contextmanager
def _env_as_written(names: frozenset[str]):
    """`${oc.env:NAME}` resolves as written unless conf/ reads NAME: a value typed on the page
    cannot show the studio's environment (a token, a key) in the preview. OmegaConf's resolvers
    are process-wide: callers hold _LOCK."""
    from omegaconf.resolvers import oc

    unset = object()

    def env(key, default=unset):
        if key in names:
            return oc.env(key) if default is unset else oc.env(key, default)
        return f"${{oc.env:{key}}}" if default is unset else f"${{oc.env:{key},{default}}}"

    OmegaConf.register_new_resolver("oc.env", env, replace=True)
    try:
        yield
    finally:
        OmegaConf.register_new_resolver("oc.env", oc.env, replace=True)


def default_choices(conf_dir: Path) -> dict[str, str]:
    """conf/config.yaml's option for each group."""
    return compose(conf_dir, {}, {}, {}, plan=False).choices


def compose(conf_dir: Path, choices: dict[str, str], keys: dict[str, str],
            defaults: dict[str, str] | None = None, plan: bool = True, existing: bool = True,
            root: Path | None = None) -> Composition:
    """Compose `python run.py <overrides>` and plan it, as a dry run would, and (`existing`) look
    at the run of its name as the run would. Never raises for a mistake in the values: the
    error's one paragraph comes back in `.error`. With `root`, a key that would write outside it
    is that error, found before the plan (which writes: it generates a taskset's data)."""
    conf_dir = Path(conf_dir)
    with _LOCK:
        if defaults is None:
            defaults = dict(_compose(conf_dir, []).hydra.runtime.choices) if (choices or keys) else {}
        return _composition(conf_dir, overrides_of(choices, keys, defaults), dict(choices), plan, existing, root)


def compose_overrides(conf_dir: Path, overrides: list[str], plan: bool = False) -> Composition:
    """`python run.py <overrides>` composed (one job of a sweep), planned if `plan`: a sweep's job
    writes to the sweep's directory, so the run of its name is not looked at."""
    with _LOCK:
        return _composition(Path(conf_dir), list(overrides), {}, plan, existing=False)


def _composition(conf_dir: Path, overrides: list[str], choices: dict[str, str], plan: bool,
                 existing: bool = True, root: Path | None = None) -> Composition:
    from rft.plan.overlays import misspelt_override

    command = "python run.py " + " ".join(shlex.quote(o) for o in overrides) if overrides else "python run.py"
    # group names only (as run.py's check): the options' comments are not needed per keystroke
    group_names = {p.name for p in conf_dir.iterdir() if p.is_dir()}
    misspelt = misspelt_override(overrides, group_names) or option_path(conf_dir, overrides, group_names)
    if misspelt:
        return Composition(choices, overrides, command, {}, "", "", misspelt)
    with _env_as_written(conf_env_names(str(conf_dir.resolve()))):
        try:
            cfg = _compose(conf_dir, overrides)
        except Exception as e:  # Hydra's override and validation errors name the key
            return Composition(choices, overrides, command, {}, "", "", _message(e))
        chosen = {g: (o if o is not None else NONE) for g, o in cfg.hydra.runtime.choices.items() if "/" not in g}
        job = cfg.copy()
        OmegaConf.set_readonly(job, False)
        with open_dict(job):  # what `--cfg job` prints, and what rft.runtime.main receives
            del job["hydra"]
        # a token written in a file under conf/ shows as *** (rft/reporting/redact.py), as the run's trackers show it
        text = config_yaml(job)
        written = redact(OmegaConf.to_container(job, resolve=False, enum_to_str=True))  # `${...}` kept, as the files say
        values = {f["key"]: _override_text(_get(written, f["key"])) for f in schema()}
        resolved = _container(job)
        imports = I.foreign(resolved, REPO) + I.remote_code(resolved) + I.foreign_hydra(_container(cfg.hydra), REPO)
        comp = Composition(chosen, overrides, command, values, text, "", "", imports)
        comp.run_dir, comp.sweep_dir = _dirs(job, cfg)
        if plan:
            comp.error = _writes_outside(job, conf_dir, root) if root is not None else ""
            if comp.error:  # planning would already write there (a generated taskset into cache_dir)
                return comp
            comp.plan, comp.error, stages = _plan(job, existing)
            comp.writes = W.written(job, stages, W.shared_cache(conf_dir)) if stages else []
        return comp


def run_dir_refusal(root: Path, where: str) -> str:
    """The one paragraph for a run's (or sweep's) directory outside `root`, or "". The studio lists,
    links and stops what is under its root; a run written elsewhere (a checkpoint_root_dir typed on
    the page: ~/.ssh, /etc) would be out of its sight."""
    if not where or (Path(where).is_absolute() and Path(where).resolve().is_relative_to(Path(root).resolve())):
        return ""
    return (f"it would write to {where}, outside the checkpoint root {root} that this studio shows and launches into. "
            f"Leave checkpoint_root_dir as it is, or start the studio with --root on the folder you want "
            f"(python -m rft.studio --root DIR).")


def _writes_outside(job: DictConfig, conf_dir: Path, root: Path) -> str:
    """The one paragraph for a key of the stages' configs that would write outside `root`, or "";
    from the stages' configs alone, before anything is planned (one that does not resolve: the
    plan says why). A run's own directory first (a dry run writes none)."""
    from rft.runtime.main import run_dir_of, split_stages

    if not job.get("dry_run"):
        try:
            outside = run_dir_refusal(root, str(run_dir_of(job)))
        except Exception:  # an interpolation only a run resolves
            outside = ""
        if outside:
            return outside
    try:
        stages, _ = split_stages(job)
    except Exception:
        return ""
    cache = W.shared_cache(conf_dir)
    return W.refusal(root, W.written(job, stages, cache) + W.written(job, stages, cache, planning=True)) or ""


def option_path(conf_dir: Path, overrides: list[str], groups: set[str]) -> str | None:
    """The message for the first override that gives a config group a path (`experiment=../../x`):
    Hydra joins group and option into a file name, so '/' leaves conf/<group>/ and composes any
    YAML file on the disk, Hydra's own settings (hydra.run.dir: where the run writes) in it."""
    for o in overrides:
        key, eq, value = o.partition("=")
        group = key.lstrip("+~").split("@", 1)[0]
        if eq and group.split("/", 1)[0] in groups and ("/" in value or "\\" in value):
            options = sorted(p.stem for p in (Path(conf_dir) / group).glob("*.yaml"))
            return (f"{o}: an option of the config group {group} is the name of a file of conf/{group}/, "
                    f"without '/'; choose one of {options}.")
    return None


def _dirs(job: DictConfig, cfg: DictConfig) -> tuple[str, str]:
    """(the run's directory, a sweep's directory as of now); "" where they do not resolve."""
    from rft.runtime.main import run_dir_of

    out = []
    for get in (lambda: str(run_dir_of(job)), lambda: str(cfg.hydra.sweep.dir)):
        try:
            out.append(get())
        except Exception:  # an interpolation only a run resolves
            out.append("")
    return out[0], out[1]


def _container(node: DictConfig) -> dict:
    """The node as plain values, resolved where it resolves: a dotted path may be put together by
    interpolations, and the run imports the resolved value (one that does not resolve: the plan
    says which)."""
    try:
        return OmegaConf.to_container(node, resolve=True, enum_to_str=True)
    except Exception:
        return OmegaConf.to_container(node, resolve=False, enum_to_str=True)


def _plan(job: DictConfig, existing: bool = True) -> tuple[str, str, list]:
    """(the batch plan's text, "", the stages' configs) or ("", the error's one paragraph, []);
    `existing`: also the run of the same name, as the run would find it (the plan's text then
    comes with its error)."""
    from rft.errors import ConfigError
    from rft.runtime.main import plan_stages, plan_text

    try:
        stages, plans, dirs = plan_stages(job)
        text = plan_text(stages, plans, dirs)
        return text, _message(existing_run(job, stages, dirs)) if existing else "", stages
    except ConfigError as e:
        return "", _message(e), []
    except Exception as e:  # an interpolation that does not resolve, a dataset that is not there
        return "", f"{type(e).__name__}: {_message(e)}", []


def existing_run(job: DictConfig, stages: list, dirs: list[Path]) -> Exception | None:
    """What the run would stop on as it starts, found in the directory of its name: a run made
    with another configuration (rft.runtime.rundir.check_unchanged: the resume rules), or another
    process running in it (its lock). None for a dry run, a bench, or a run that starts over."""
    from rft import manifest
    from rft.errors import ConfigError, RunError
    from rft.runtime import rundir
    from rft.runtime.main import run_dir_of
    from rft.studio.index import holder_alive

    run_dir = run_dir_of(job)
    if job.dry_run or job.mode == "bench" or not run_dir.is_dir():
        return None
    if holder_alive(run_dir):
        lock = manifest.read_regular(run_dir / rundir.RUN_LOCK, 4096).decode(errors="replace").strip()
        return RunError(f"another rft process ({lock}) is running in {run_dir}; two runs writing one directory "
                        f"overwrite each other's checkpoints and logs. Wait for it to end (or stop it), or give this "
                        f"run another name (name=...).")
    if not job.continue_from_checkpoint:
        return None
    try:
        rundir.check_unchanged(job, stages, dirs, run_dir)
    except ConfigError as e:
        return e
    return None


# a sweep's jobs are composed one by one before it starts (~0.2 s each): beyond this, from a shell
MAX_SWEEP_JOBS = 64


def _job_count(overrides: list, cap: int) -> int:
    """How many jobs Hydra's basic sweeper makes of these parsed overrides (a later override of a
    key replaces an earlier one), counted without listing them: seed=range(0,100000000) listed
    took minutes and GBs. A sweep that is not a plain range is counted up to cap + 1 values."""
    from hydra.core.override_parser.types import RangeSweep

    sizes = {}
    for o in overrides:
        value = o.value() if o.is_sweep_override() else None
        if value is None:
            sizes[o.get_key_element()] = 1
        elif isinstance(value, RangeSweep) and isinstance(value.range(), range):
            sizes[o.get_key_element()] = len(value.range())
        else:
            sizes[o.get_key_element()] = sum(1 for _ in itertools.islice(o.sweep_string_iterator(), cap + 1))
    return math.prod(sizes.values())


def check_sweep(conf_dir: Path, overrides: list[str], sweep_args: list[str],
                root: Path | None = None) -> tuple[list[dict], str]:
    """Every job of `python run.py -m <overrides> <sweep_args>` composed and planned, as Hydra's
    basic sweeper splits the sweep (the composed config's hydra.sweeper.params, as a study sets
    them, with the sweep's values) and as run.py plans them before the first starts
    (rft.runtime.callbacks): (their imports.foreign, the first job's plan error in the CLI's words
    or "", or the first job's key that would write outside `root`: rft/studio/writes.py). A
    ValueError for a sweep that does not split or compose, or has more than
    MAX_SWEEP_JOBS jobs. The imports come first: a job whose plan fails still lists what it would
    import, which the page asks about before it says anything else."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from rft.reporting.sweep import distinct_overrides
    from rft.runtime.callbacks import _job_error

    try:
        with _LOCK, _env_as_written(conf_env_names(str(Path(conf_dir).resolve()))):
            params = _compose(Path(conf_dir), overrides).hydra.sweeper.get("params") or {}
        # as Hydra's basic sweeper reads them: the config's params first, then the command line's
        parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()] + overrides + sweep_args)
        too_many = _job_count(parsed, MAX_SWEEP_JOBS) > MAX_SWEEP_JOBS
        jobs = [] if too_many else BasicSweeper.split_arguments(parsed, None)[0]
    except Exception as e:
        raise ValueError(f"sweep_params: {_message(e)}") from None
    if too_many:
        raise ValueError(f"sweep_params: more than {MAX_SWEEP_JOBS} jobs; the studio checks each job's imports before a "
                         f"sweep starts, up to {MAX_SWEEP_JOBS}: start a bigger sweep from a shell (python run.py -m ...).")
    found, own, error = {}, distinct_overrides(jobs) if jobs else [], ""
    for n, job in enumerate(jobs):
        comp = compose_overrides(conf_dir, job, plan=True)
        if comp.error and not comp.yaml:  # it did not compose: nothing is known of its imports
            raise ValueError(_job_error(n, own[n], comp.error))
        problem = comp.error or (W.refusal(root, comp.writes) if root is not None else None)
        error = error or (_job_error(n, own[n], problem) if problem else "")
        for i in comp.imports:
            found.setdefault((i["key"], i["path"]), i)
    return list(found.values()), error


def control_character(where: str, text: str) -> None:
    """A ValueError naming `where` when text holds a line break or another control or format
    character (YAML also breaks lines at U+0085, U+2028 and U+2029): such a value could end a
    comment line of a saved study and start lines of its own."""
    for c in text:
        if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp"):
            raise ValueError(f"{where}: holds {c!r} (U+{ord(c):04X}), a line break or another control character; "
                             f"a value is one line of printable text: take it out.")


# ---------------------------------------------------------------- save as study


STUDY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _study_key(key: str, text: str) -> str:
    """An override's key as a study file writes it: `+x` and `++x` (add, force-add) are plain keys
    there; a deletion (`~x`) or a package (`x@pkg`) has no form in a file of values."""
    if key.startswith("~") or "@" in key:
        raise ValueError(f"{key}={text}: a study file holds values, and {'a deletion' if key.startswith('~') else 'a package override'} "
                         f"has no form there. Leave it out to save, or run it from the command line.")
    return key.lstrip("+")


def save_study(conf_dir: Path, name: str, comp: Composition, defaults: dict[str, str],
               overwrite: bool = False) -> Path:
    """Write conf/experiment/<name>.yaml: its command line first (after Hydra's header), then the composition's groups as
    `override /group: option` and its keys as nested values. `python run.py experiment=<name>`
    composes what the page composed (with `name` set to the study's)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not STUDY_NAME.match(name or ""):
        raise ValueError(f"study name {name!r}: use letters, digits, '_', '-' or '.', starting with a letter or digit.")
    path = Path(conf_dir) / "experiment" / f"{name}.yaml"
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists: choose another name, or tick 'overwrite'.")
    for o in comp.overrides:  # the command line becomes a comment line: it must stay one
        control_character(o.split("=", 1)[0] if "=" in o else o, o)
    groups_ = [(g, o) for g, o in comp.choices.items() if g != "experiment" and defaults.get(g) != o]
    keys = [o.split("=", 1) for o in comp.overrides if "=" in o and o.split("=", 1)[0] not in comp.choices]
    body: dict = {}
    for key, text in keys:
        key = _study_key(key, text)
        node = body
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        # the value as the command line reads it (1e-3 a float, [1,2] a list, null None)
        node[leaf] = OverridesParser.create().parse_override(f"{key}={text}").value()
    # Hydra reads the @package header only on the first line; the command line comes next, as in
    # every study of conf/experiment
    lines = ["# @package _global_", f"# python run.py experiment={name}",
             f"# saved by the studio from: {comp.command}", "defaults:"]
    lines += [f"  - override /{g}: {o}" for g, o in groups_] + ["  - _self_", "", f"name: {name}"]
    if body:
        lines.append(yaml.safe_dump(body, sort_keys=False).rstrip())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path
