"""Checks of the config files a command chooses, before Hydra composes them.

`python run.py experiment=<study>` (or task=<yours>, any group=option) reads that file, then the
files its defaults list names. A study's own files make mistakes that Hydra words in its own terms,
or not at all; each is named here with its file, line and fix (exit_on_config_mistakes, which run.py calls):

- an option that does not exist, on the command line or in a sweep's list (`-m
  algorithm=grpo,drgrpo`: Hydra warned from inside its callback, then printed its message twice);
- no `# @package` line where the group's files need one: Hydra puts the keys under the group's
  name ("Key 'experiment' not in 'Config'"); or another package than theirs (`global`, `_group_`
  in conf/experiment/), whose first key Hydra names as if it were misspelt;
- `/task: mine` in an overlay's defaults list without `override`: Hydra says "Multiple values for
  task" and suggests `override task: mine`, which in an overlay names experiment/task/mine;
- `_self_` before the config a file extends (`defaults: [_self_, grpo]`): that config's values
  replace the file's own, and the run goes on without them;
- a misspelt key anywhere in the file (Hydra names neither the line nor the nearest key).

With `hydra.searchpath` (a study kept outside the repository) the same checks read the files
where Hydra finds them (`Roots`): conf/ first, then each folder of the search path in its order.
"""

from __future__ import annotations

import difflib
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import yaml

_PACKAGE = re.compile(r"#\s*@package\s+(\S+)")


@dataclass
class Entry:
    """One item of a defaults list: `_self_`, a bare name (a config of the file's own group that
    it extends), or `[override ]group: option`, with the group made absolute."""

    line: int
    text: str
    group: str | None = None  # None: _self_
    option: str | None = None
    override: bool = False
    bare: bool = False


@dataclass(frozen=True)
class Roots:
    """The folders config groups are found in, in Hydra's order (hydra/_internal: the primary
    config dir, then each `hydra.searchpath` entry as listed): the first that has group/option.yaml
    is the file Hydra composes, and a group's options are all of theirs. `opaque`: the search
    path also names a package (pkg://), whose options rft cannot list, so a missing one is Hydra's
    to name. Without a search path, conf/ alone: every message as it was before there was one."""

    conf: Path
    extra: tuple[Path, ...] = ()
    opaque: bool = False

    @staticmethod
    def of(where) -> Roots:
        return where if isinstance(where, Roots) else Roots(Path(where))

    @property
    def all(self) -> tuple[Path, ...]:
        return (self.conf, *self.extra)

    def file(self, group: str, option: str) -> Path | None:
        return next((p for r in self.all if (p := r / group / f"{option}.yaml").is_file()), None)

    def has_group(self, group: str) -> bool:
        return any((r / group).is_dir() for r in self.all)

    def options(self, group: str) -> list[str]:
        return sorted({p.stem for r in self.all for p in (r / group).glob("*.yaml")})

    def group(self, path: Path) -> str:
        root = max((r for r in self.all if path.is_relative_to(r)), key=lambda r: len(r.parts))
        own = path.parent.relative_to(root).as_posix()
        return "" if own == "." else own

    def siblings(self, path: Path) -> list[Path]:
        group = self.group(path)
        return [p for r in self.all for p in sorted((r / group).glob("*.yaml")) if p != path]

    def shown(self, path: Path) -> str:
        """conf/'s files as conf/...; a search folder's relative to the current directory when it is
        under it, else absolute (a ../../ path says less, and would change with where one runs)."""
        import os

        if path.is_relative_to(self.conf):
            return str(path.relative_to(self.conf.parent))
        path = Path(os.path.abspath(path))
        return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)

    def absent(self) -> str:
        """A sentence for the search folders that do not exist: a relative one is read from the
        directory the command runs in, so a study's `file://experiments/<study>/conf` is no
        folder from inside that study's own folder."""
        import os

        gone = [str(r) for r in self.extra if not r.is_dir()]
        if not gone:
            return ""
        return (f" The search path's {', '.join(gone)} is no folder from {os.getcwd()}: a relative "
                f"hydra.searchpath entry is read from the directory you run from; run from the folder it "
                f"is relative to, or give it absolute (file:///...).")

    def dirs(self, group: str) -> str:
        """The folders that hold the group's files: `conf/<group>/`, and a search folder's."""
        found = [f"{self.shown(r / group)}/" for r in self.all if (r / group).is_dir()]
        return found[0] if len(found) == 1 else f"{', '.join(found[:-1])} and {found[-1]}"

    def elsewhere(self, group: str, option: str) -> str:
        """A sentence for a study's conf folder (experiments/<study>/conf) that has the option while no
        search path names it: `experiment=kv_lookup` without its hydra.searchpath was told only
        that conf/experiment/ lacks it. (Not where a search path given is no folder from here: that
        sentence, Roots.absent, is the one to read.)"""
        there = sorted(p for p in self.conf.parent.glob(f"experiments/*/conf/{group}/{option}.yaml")
                       if p.parent.parent not in self.all)
        if not there:
            return ""
        folder = there[0].parent.parent.relative_to(self.conf.parent).as_posix()
        return (f" {folder}/{group}/{option}.yaml has it: a study's folder comes in through Hydra's search path, "
                f"'hydra.searchpath=[file://{folder}]' (run from {self.conf.parent}).")

    def missing(self, group: str, option: str) -> str:
        """Where the option's file was looked for: conf/<group>/<option>.yaml, or every folder."""
        if not self.extra:
            return self.shown(self.conf / group / f"{option}.yaml")
        found = [f"{self.shown(r)}/" for r in self.all]
        return f"{group}/{option}.yaml in {', '.join(found[:-1])} or {found[-1]}"


def check(args: list[str], conf_dir: Path) -> str | None:
    """The message for the first mistake in the command line's choices or the files they reach."""
    from omegaconf import OmegaConf

    from rft.config import Config

    roots = Roots.of(conf_dir)
    chosen, message = _choices(args, roots)
    if message or not chosen:
        return message
    schema = OmegaConf.structured(Config)
    primary = {e.group for e in entries(roots.conf / "config.yaml", roots) if e.group and not e.bare}
    reached = _reachable(chosen, roots)
    for path in reached:  # a search folder's files: bad_yaml read conf/ only
        message = (yaml_problem(path, roots.shown(path)) or _package_mistake(path, roots, schema)
                   or _header_mistake(path, roots, schema) or _defaults_mistake(path, roots, primary)
                   or _key_mistake(path, roots, schema))
        if message:
            return message
    return _replaced_stage(args, reached, roots)


def _stages(path: Path) -> list[tuple[str, set, int]]:
    """(stage_name as written, its top-level keys, line) of each entry of a `_global_` file's `stages:` list."""
    root = _node(path)
    found = next((v.value for k, v in getattr(root, "value", []) or []
                  if getattr(k, "value", None) == "stages" and isinstance(v, yaml.SequenceNode)), [])
    out = []
    for item in found:
        keys = {k.value: v for k, v in item.value} if isinstance(item, yaml.MappingNode) else {}
        if isinstance(keys.get("stage_name"), yaml.ScalarNode):
            out.append((keys["stage_name"].value, set(keys), item.start_mark.line + 1))
    return out


def _replaced_stage(args: list[str], reached: list[Path], roots: Roots) -> str | None:
    """An overlay's `stages:` entry named like one of the model file's, lacking keys that entry has: Hydra
    replaces the model's whole list, so `- {stage_name: sft_warmup, buffer: {total_steps: 60}}` ran a
    60-step GRPO stage under the warm-up's name (its mode and algorithm gone), and the run said nothing."""
    if any(a.startswith(("stages=", "+stages=")) for a in args):  # the command line's list replaces the overlay's
        return None
    model = next((a.split("=", 1)[1] for a in reversed(args) if a.startswith("model=") and "," not in a), None)
    model = model or next((e.option for p in reached for e in entries(p, roots) if e.group == "model" and e.option),
                          None) or next((e.option for e in entries(roots.conf / "config.yaml", roots)
                                         if e.group == "model" and e.option), None)
    shipped = roots.file("model", model) if model else None
    theirs = {name: keys for name, keys, _ in _stages(shipped)} if shipped else {}
    for path in (p for p in reached if p != shipped and package(p, roots) == ""):
        for name, keys, line in _stages(path):
            lost = sorted(theirs.get(name, set()) - keys)
            if lost:
                return (f"{roots.shown(path)}, line {line}: its stages entry '{name}' lacks {', '.join(lost)}, "
                        f"which {roots.shown(shipped)}'s entry of that name has. A `stages:` list in an overlay "
                        f"replaces the model's whole list (Hydra replaces lists; it does not merge them), so this "
                        f"stage would run without them. Copy that entry whole "
                        f"and change what differs (conf/experiment/calculator_tool.yaml does), change one key on the "
                        f"command line instead (stages.0.buffer.total_steps=60), or give a new stage a name of its own.")
    return None


def _choices(args: list[str], roots: Roots) -> tuple[list[Path], str | None]:
    """The files the command line chooses (each value of a sweep's list), or the message for an
    option that does not exist."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        overrides = OverridesParser.create().parse_overrides([a for a in args if "=" in a and not a.startswith("-")])
    except Exception:  # unparsable_override (below) words these
        return [], None
    found = []
    for o in overrides:
        group = o.key_or_group
        hydra = group.startswith("hydra/")  # Hydra's own groups (hydra/launcher): checked for a name only
        if o.is_delete() or not (hydra or (roots.has_group(group) and not group.startswith("hydra"))):
            continue
        try:
            values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
        except Exception:  # glob(*): Hydra expands it against the options itself
            continue
        for option in values:
            if option in ("null", "None") or "$" in option:
                continue
            path = roots.file(group, option)
            if path is None and not roots.opaque:
                options = sorted({*roots.options(group), *(_hydra_options(group) if hydra else ())})
                if hydra and (option in options or not options):  # no group of Hydra's: Hydra says so
                    continue
                near = difflib.get_close_matches(option, options, n=1)
                hint = f" Did you mean {group}={near[0]}?" if near else ""
                return [], (f"{group}={option}: there is no {roots.missing(group, option)} (the options of '{group}' "
                            f"are {', '.join(options)}).{hint}{roots.absent() or roots.elsewhere(group, option)}")
            found += [path] if path and not hydra else []  # (a launcher's keys are no keys of rft's config)
    return found, None


def _hydra_options(group: str) -> list[str]:
    """The options Hydra and its plugins have of one of Hydra's groups: hydra/launcher's basic,
    submitit_local, submitit_slurm (conf/hydra/launcher adds local and slurm)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path

    return ConfigLoaderImpl(config_search_path=create_config_search_path(None)).get_group_options(group)


def _reachable(chosen: list[Path], roots: Roots) -> list[Path]:
    """`chosen` and every config file their defaults lists name, each once."""
    todo, seen = list(chosen), []
    while todo:
        path = todo.pop(0)
        if path in seen or not path.is_file():
            continue
        seen.append(path)
        todo += [p for e in entries(path, roots) if e.group and e.option and (p := roots.file(e.group, e.option))]
    return seen


def _node(path: Path):
    try:
        return yaml.compose(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError:
        return None  # bad_yaml (below) names it


def entries(path: Path, conf_dir: Path) -> list[Entry]:
    """The items of a config file's defaults list, with their lines (conf_dir: a folder, or Roots)."""
    root, own = _node(path), Roots.of(conf_dir).group(path)
    items = next((v.value for k, v in getattr(root, "value", []) or []
                  if getattr(k, "value", None) == "defaults" and isinstance(v, yaml.SequenceNode)), [])
    out = []
    for item in items:
        line = item.start_mark.line + 1
        if isinstance(item, yaml.ScalarNode):
            out.append(Entry(line, "_self_") if item.value == "_self_" else
                       Entry(line, item.value, own, item.value, bare=True))
        elif isinstance(item, yaml.MappingNode) and len(item.value) == 1:
            k, v = item.value[0]
            key = k.value.removeprefix("override ").strip()
            if key.startswith("optional ") or not isinstance(v, yaml.ScalarNode):
                continue
            option = None if v.value in ("", "null", "~") or "${" in v.value else v.value
            group = key.split("@")[0]
            group = group[1:] if group.startswith("/") else f"{own}/{group}".strip("/")
            out.append(Entry(line, f"{k.value}: {v.value}", group, option, k.value.startswith("override ")))
    return out


def package(path: Path, conf_dir: Path) -> str | None:
    """The package its `# @package` line names, read as Hydra does from the comments that open
    the file ('' for _global_); None without one."""
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            break
        m = _PACKAGE.match(line.strip())
        if m:
            name = m.group(1).replace("_group_", Roots.of(conf_dir).group(path).replace("/", "."))
            return name.removeprefix("_global_").lstrip(".")
    return None


def leaves(path: Path, conf_dir: Path) -> list[tuple[str, int]]:
    """(dotted key in the whole config, line) of every value the file sets; not its defaults list
    nor Hydra's own settings."""
    pkg = package(path, conf_dir)
    pkg = Roots.of(conf_dir).group(path).replace("/", ".") if pkg is None else pkg
    out = []

    def walk(node, prefix):
        for k, v in node.value:
            if node is root and k.value == "defaults":
                continue
            key = f"{prefix}{k.value}"
            if isinstance(v, yaml.MappingNode) and v.value:
                walk(v, key + ".")
            elif isinstance(v, yaml.SequenceNode) and any(isinstance(i, yaml.MappingNode) for i in v.value):
                for i, item in enumerate(v.value):  # a list of dicts (eval sets): each item's keys
                    walk(item, f"{key}.{i}.") if isinstance(item, yaml.MappingNode) else None
            else:
                out.append((key, k.start_mark.line + 1))

    root = _node(path)
    if isinstance(root, yaml.MappingNode):
        walk(root, f"{pkg}." if pkg else "")
    return [(k, n) for k, n in out if k.split(".")[0] != "hydra"]


def _package_mistake(path: Path, roots: Roots, schema) -> str | None:
    group = roots.group(path)
    if package(path, roots) is not None or not group or group.startswith("hydra"):
        return None
    top = group.split("/")[0]
    if top in schema:
        return None
    siblings = [package(p, roots) for p in roots.siblings(path)]
    common = Counter(p for p in siblings if p is not None).most_common(1)
    header = f"# @package {(common[0][0] or '_global_') if common else '_global_'}"
    return (f"{roots.shown(path)} has no `# @package` line, so Hydra puts its keys under "
            f"'{top}', which the config does not have (it stopped with \"Key '{top}' not in 'Config'\"). Make "
            f"its first line `{header}`, as in the other files of {roots.dirs(group)}.")



def _header_mistake(path: Path, roots: Roots, schema) -> str | None:
    """A `# @package` line other than its group's files' (`global` or `_group_` for `_global_`) whose
    keys do not fit under it but do under theirs: named by its first wrong key alone, it read as a
    misspelt key in a right file."""
    from rft.config import key_mistake

    own = package(path, roots)
    usual = Counter(package(p, roots) for p in roots.siblings(path)).most_common(1)
    if own is None or not usual or usual[0][0] in (None, own):
        return None
    moved = {k: ".".join(filter(None, [usual[0][0], k.removeprefix(own).lstrip(".")])) for k, _ in leaves(path, roots)}
    keys = [(k, n) for k, n in leaves(path, roots) if moved[k].split(".")[0] != "hydra"]  # Hydra's own settings
    wrong = next(((k, n) for k, n in keys if key_mistake(schema, k)), None)
    if wrong is None or any(key_mistake(schema, moved[k]) for k, _ in keys):
        return None
    line, text = next((i, t.strip()) for i, t in enumerate(path.read_text().splitlines(), 1) if _PACKAGE.match(t.strip()))
    header = f"# @package {usual[0][0] or '_global_'}"
    return (f"{roots.shown(path)}, line {line}: `{text}` puts its keys under '{own}' (line {wrong[1]}: "
            f"{wrong[0]}, which the config does not have), where the other files of {roots.dirs(roots.group(path))} "
            f"have `{header}`. Make it `{header}`.")

def _defaults_mistake(path: Path, roots: Roots, primary: set) -> str | None:
    rel = roots.shown(path)
    items = entries(path, roots)
    for e in items:
        if e.group in primary and not e.override and not e.bare:
            return (f"{rel}, line {e.line}: its defaults list chooses '{e.text}', but conf/config.yaml chooses "
                    f"{e.group} already (Hydra: \"Multiple values for {e.group}\"). Write `override /{e.group}: "
                    f"{e.option}`.")
    selves = [i for i, e in enumerate(items) if e.group is None]
    if not selves:
        return None
    own = {k for k, _ in leaves(path, roots)}
    for e in items[selves[0] + 1:]:
        target = roots.file(str(e.group), e.option) if e.option else None
        if e.override or target is None:
            continue
        lost = sorted(own & {k for k, _ in leaves(target, roots)})
        if lost:
            return (f"{rel}, line {items[selves[0]].line}: `_self_` comes before '{e.text}' in its defaults list, "
                    f"so the values of {roots.shown(target)} replace this file's own "
                    f"({', '.join(lost[:3])}{', ...' if len(lost) > 3 else ''}): Hydra merges the list in order. "
                    f"Put `_self_` last.")
    return None


def _key_mistake(path: Path, roots: Roots, schema) -> str | None:
    from rft.config import key_mistake

    if roots.group(path).startswith("hydra"):
        return None
    for key, line in leaves(path, roots):
        problem = key_mistake(schema, key)
        if problem:
            return f"{roots.shown(path)}, line {line}: {key}: {problem}"
    return None


# ---------------------------------------------------------------- the command line, and every file

def misspelt_override(args: list[str], groups: set[str]) -> str | None:
    """The message for the first command-line override whose key the schema does not have, naming
    the nearest keys; None when every key exists. Group choices (`algorithm=grpo`, `hydra/...`),
    hydra.* keys, deletions (~key) and keys inside dict- or list-typed values (auxiliary_buffers, a
    reward's parts) are left to Hydra; a stage's keys (stages.<i>.<key>) are the whole config's."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from rft.config import Config, key_mistake

    candidates = [a for a in args if "=" in a and not a.startswith("-")]
    try:
        overrides = OverridesParser.create().parse_overrides(candidates)
    except Exception:  # Hydra reports syntax errors itself
        return None
    schema = OmegaConf.structured(Config)
    for o in overrides:
        key = o.key_or_group
        if o.is_delete() or "/" in key or key.split(".")[0] in ("hydra",):
            continue
        # +key adds a key: to a free-form dict or list (stages, auxiliary_buffers, a reward's args)
        # that is the way, but the schema's own sections have every key they take already
        adding = o.is_add() or o.is_force_add()
        if key in groups:
            continue
        problem = key_mistake(schema, key, adding)
        if problem:
            return f"Could not {'add' if adding else 'override'} '{key}': {problem}"
    return None


def _typed_overrides(args: list[str], groups: set[str]):
    """Each command-line override of a key of the typed schema, as (override, key, its schema
    node, the schema): group choices, hydra.* keys, deletions and keys inside free-form dicts and
    lists (a stage, a reward's args: Hydra's to check) are left out, and so is every override when
    one does not parse (unparsable_override words that)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from rft.config import Config

    try:
        overrides = OverridesParser.create().parse_overrides([a for a in args if "=" in a and not a.startswith("-")])
    except Exception:
        return
    schema = OmegaConf.structured(Config)
    for o in overrides:
        key = o.key_or_group
        if o.is_delete() or key in groups or "/" in key or key.startswith("hydra"):
            continue
        parent, _, last = key.rpartition(".")
        try:
            node = (OmegaConf.select(schema, parent) if parent else schema)._get_node(last)
        except Exception:  # inside a free-form dict or list, or a key misspelt_override words
            continue
        yield o, key, node, schema


def _plain(value) -> bool:
    """A single value (not null, a list, a dict or an interpolation) that a typed key can be checked on."""
    return value is not None and not isinstance(value, (list, dict)) and "${" not in str(value)


def scalar_for_list(args: list[str], groups: set[str]) -> str | None:
    """The message for a list-typed key given one value (`monitor.monitor_type=wandb`, as
    Trinity-RFT's guide writes it): Hydra says only "str is not a ListConfig, list or tuple"."""
    from omegaconf._utils import get_list_element_type, is_list_annotation

    for o, key, node, _ in _typed_overrides(args, groups):
        value = o.value()
        if o.is_sweep_override() or not _plain(value) or node is None or not is_list_annotation(node._metadata.ref_type):
            continue
        given = o.input_line.split('=', 1)[1]
        if get_list_element_type(node._metadata.ref_type) is int and not isinstance(value, int):
            return (f"{key}={given}: {key} takes a list of integers (e.g. token ids), and {given!r} is not "
                    f"one; write {key}=[a] or [a,b] with whole numbers, or {key}=[] for none.")
        return f"{key}={given}: {key} takes a list; write {key}=[{value}] (a list of one), or several as [a,b]."
    return None


def wrong_value_override(args: list[str], groups: set[str]) -> str | None:
    """The message for a command-line value the schema's typed key does not take (`seed=abc`,
    `buffer.batch_size=1.5`, `synchronizer.sync_method=nccl`): Hydra says it in five lines with a
    hint at HYDRA_FULL_ERROR and exits 1, unlike rft's other configuration errors. Each value of a
    choice sweep is tried."""
    from hydra.core.override_parser.types import ChoiceSweep
    from omegaconf import OmegaConf, ValueNode
    from omegaconf.errors import OmegaConfBaseException

    for o, key, node, schema in _typed_overrides(args, groups):
        value = o.value()
        values = value.list if isinstance(value, ChoiceSweep) else [] if o.is_sweep_override() else [value]
        for v in values if isinstance(node, ValueNode) else []:
            if not _plain(v):
                continue
            try:
                OmegaConf.update(schema, key, v, merge=True)
            except OmegaConfBaseException as e:
                from rft.foreign_keys import foreign_value

                given = o.input_line.split("=", 1)[1]
                return (f"{key}={given}: {str(e).splitlines()[0]}.{foreign_value(key, v)} The key's type and its "
                        f"comment are in rft/config.py; `python run.py --cfg job` prints the composed config.")
    return None


def flag_after_override(args: list[str]) -> str | None:
    """The message for one of Hydra's flags given after an override that another override follows
    (`python run.py model=x -m seed=1,2`): Hydra's argument parser takes the overrides only as one
    run, so it says just "unrecognized arguments: seed=1,2". The same line with the flags first."""
    import contextlib
    import io

    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # a line Hydra refuses anyway is Hydra's to word
            _, unread = parser.parse_known_args(args)
            parsed, left = parser.parse_known_intermixed_args(args)
    except SystemExit:
        return None
    if not unread or left:
        return None
    overrides, flags = list(parsed.overrides), []
    for a in args:  # the flags (and their values) in their order; the overrides as given
        if overrides and a == overrides[0]:
            overrides.pop(0)
        else:
            flags.append(a)
    return (f"{' '.join(flags)} comes after an override: Hydra reads its flags only before the overrides, "
            f"and said \"unrecognized arguments: {' '.join(unread)}\". Put the flags first: python run.py "
            f"{' '.join(flags + list(parsed.overrides))}")


def foreign_flag(args: list[str]) -> str | None:
    """The message for `--name value` or `--name=value` where name is not one of Hydra's flags but
    another system's key (LightRFT's and OpenRLHF's are flags: --n_samples_per_prompt 8) or the
    last part of one of rft's keys (--gradient_checkpointing): Hydra says only "unrecognized
    arguments". Other unknown flags are left to Hydra."""
    from hydra._internal.utils import get_args_parser

    from rft.config import schema_keys
    from rft.foreign_keys import FOREIGN_KEYS, foreign_key

    hydras = {s for a in get_args_parser()._actions for s in a.option_strings}
    for i, arg in enumerate(args):
        name, eq, value = arg.removeprefix("--").partition("=")
        if not arg.startswith("--") or f"--{name}" in hydras:
            continue
        given = arg
        if not eq:  # `--name value`, or a switch (store_true) before the next flag or override
            after = args[i + 1] if i + 1 < len(args) else ""
            value = after if after and not after.startswith("-") and "=" not in after else "true"
            given = f"{arg} {after}" if value == after else arg
        if name in FOREIGN_KEYS:  # its value need not carry over (lr_warmup_ratio, flash_attn): no key=value
            return f"{given}: rft takes key=value overrides, not flags; {foreign_key(name)}"
        keys = schema_keys()
        ours = [name] if name in keys else [k for k in keys if k.rpartition(".")[2] == name][:3]
        if ours:
            return (f"{given}: rft takes key=value overrides, not flags: write "
                    f"{' or '.join(f'{k}={value}' for k in ours)}.")
    return None


def unparsable_override(args: list[str]) -> str | None:
    """The message for the first command-line override Hydra's grammar cannot read (Hydra says
    only "LexerNoViableAltException: name=résumé" and a caret), with how to quote it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for arg in (a for a in args if "=" in a and not a.startswith("-")):
        try:
            parser.parse_overrides([arg])
        except OverrideParseException as e:
            key, _, value = arg.partition("=")
            quoted = f"'{key}=\"{value}\"'"
            if value.startswith(("[", "{")) and not value.rstrip().endswith(("]", "}")):
                return (f"the override {arg!r} does not parse: its list or dict is not closed, most likely because the "
                        f"shell split it at a space. Put the whole override in single quotes: "
                        f"'{key}={value} ...'.")
            if not value.isascii():
                return (f"the override {arg!r} does not parse: Hydra's override grammar takes only ASCII letters "
                        f"in a value that is not quoted. Quote the value, with single quotes around the whole "
                        f"for the shell: {quoted}.")
            # ~ too (a home-relative path, ~/data: Hydra's grammar takes no ~ in a value not quoted)
            return (f"the override {arg!r} does not parse ({str(e).splitlines()[0]}). A value holding any of "
                    f"( ) [ ] {{ }} , : = ~ ' \" is quoted: {quoted}; a list is [a,b] and a dict {{k: v}} "
                    f"(Hydra's override grammar).")
    return None


def missing_option(args: list[str], conf_dir) -> str | None:
    """The message for a config chosen on the command line (experiment=NAME, or any group=option)
    whose defaults list names an option that does not exist, naming the file and line (Hydra says
    only "In 'config': Could not find 'model/tinyy'"). Options Hydra itself names (on the command
    line, hydra/...) are left to Hydra; so is one a search path's package (pkg://) may hold."""
    roots = Roots.of(conf_dir)
    todo = [roots.file(g, o) for g, _, o in (a.partition("=") for a in args if "=" in a and not a.startswith(("-", "+", "~")))
            if roots.has_group(g) and not g.startswith("hydra")]
    seen: set = set()
    while todo:
        path = todo.pop()
        if path is None or path in seen:
            continue
        seen.add(path)
        # the entries that name a config (not _self_, nor a null or interpolated option)
        for line, group, option in ((e.line, e.group, e.option) for e in entries(path, roots) if e.option):
            target = roots.file(group, option)
            if group.startswith("hydra") or target is not None or roots.opaque:
                todo.append(target)
                continue
            there = roots.options(group)
            options = f"the options of '{group}' are {', '.join(there)}" if there else f"there is no group '{group}'"
            top = group.rpartition("/")[2]
            if not there and roots.has_group(top):  # `task: mine` in an overlay is experiment/task/mine
                options += f"; a group of the whole config takes a leading /: `override /{top}: {option}`"
            return (f"{roots.shown(path)}, line {line}: its defaults list names '{group}/{option}', "
                    f"but there is no {roots.missing(group, option)} ({options}). Fix the name in that file.")
    return None


def exit_on_config_mistakes(args: list[str], conf_dir) -> None:
    """run.py's check before Hydra composes: a config file that is not YAML (Hydra would print a
    traceback of a hundred lines), an override its grammar cannot read, a misspelt key on the
    command line, an overlay naming an option that does not exist, or the mistakes of a study's
    own files (`check` above) exits with status 2 and one paragraph."""
    import sys
    from pathlib import Path

    from rft.rewards.scoring import args_override_mistake

    roots = search_dirs(args, Path(conf_dir))
    groups = {p.name for d in roots.all if d.is_dir() for p in d.iterdir() if p.is_dir()}
    message = (modes_at_once(args) or flag_after_override(args) or foreign_flag(args)
               or bad_yaml(Path(conf_dir)) or unparsable_override(args)
               or misspelt_override(args, groups) or scalar_for_list(args, groups)
               or wrong_value_override(args, groups)
               or missing_option(args, roots) or check(args, roots) or args_override_mistake(args, conf_dir)
               or stage_past_list(args, Path(conf_dir)))
    if message:
        print(f"\nrft: configuration error: {message}\n", file=sys.stderr)
        sys.exit(2)


_STAGE_KEY = re.compile(r"^[+~]{0,2}stages\.(\d+)[.=]")


def stage_past_list(args: list[str], conf_dir: Path) -> str | None:
    """The message for `stages.<i>.key=value` past the run's stage list (`stages.2.buffer.total_steps=5`
    on model=tiny's two): Hydra says "list index out of range" with no word of the stages there
    are. Composes the command's config without those overrides (only when one is given) to count
    them; a command that does not compose is left to Hydra's own message."""
    given = [(a, int(m.group(1))) for a in args if (m := _STAGE_KEY.match(a))]
    if not given:
        return None
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    rest = [a for a in args if not _STAGE_KEY.match(a) and not a.startswith("-")]
    try:
        GlobalHydra.instance().clear()
        with initialize_config_dir(str(conf_dir.resolve()), version_base="1.3"):
            stages = compose("config", overrides=rest).stages
        names = [f"stages.{k} ({s.get('stage_name') or 'unnamed'})" for k, s in enumerate(stages)]
    except Exception:  # (a sweep's a,b values, a mistake Hydra names itself)
        return None
    finally:
        GlobalHydra.instance().clear()
    over = next((a for a, i in given if i >= len(names)), None)
    if over is None:
        return None
    if not names:
        return (f"{over}: this command's run has no stages list (stages=[], or none in the files chosen): it is "
                f"one stage, set by the keys themselves (buffer.total_steps=..., not stages.0.buffer.total_steps=...).")
    return (f"{over}: this command's run has {len(names)} stage{'s' * (len(names) != 1)}, numbered from 0: "
            f"{', '.join(names)}. Name one of them (the list comes from the model or experiment file chosen; "
            f"`python run.py --cfg job -p stages` prints it).")


def modes_at_once(args: list[str]) -> str | None:
    """The message for two of Hydra's modes on one command line (`-m ... --cfg hydra`, to see a
    sweep's launcher keys): Hydra raises a ValueError from its main, a raw traceback."""
    from hydra._internal.utils import get_args_parser

    modes = {"run", "multirun", "cfg", "info", "shell_completion"}
    flags = {s: a.dest for a in get_args_parser()._actions if a.dest in modes for s in a.option_strings}
    given, seen = [], set()
    for a in args:
        dest = flags.get(a.split("=", 1)[0])
        if dest and dest not in seen:
            given.append(a.split("=", 1)[0])
            seen.add(dest)
    if len(given) < 2:
        return None
    return (f"{' and '.join(given)} cannot be given together: Hydra does one of them (-m/--multirun runs a sweep, "
            f"--cfg/-c prints the config and runs nothing, --info prints where it comes from). To see a sweep's "
            f"config, drop -m: the same overrides compose the same config, hydra/launcher=slurm's keys included "
            f"(--cfg hydra -p hydra.launcher).")


def search_dirs(args: list[str], conf_dir: Path) -> Roots:
    """conf/ and the folders of `hydra.searchpath` (a study's config groups kept outside the
    repository), as Hydra 1.3 reads it: the first `hydra.searchpath=` of the command line replaces
    conf/config.yaml's (`+hydra.searchpath=` is no search path to it); `file://` and plain entries
    are folders, relative ones to the current directory; `pkg://` entries are packages."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    given = next((a for a in args if a.startswith("hydra.searchpath=")), None)
    try:
        if given is not None:
            entries = list(OverridesParser.create().parse_overrides([given])[0].value() or [])
        else:
            entries = list((yaml.safe_load((conf_dir / "config.yaml").read_text()) or {}).get("hydra", {}).get("searchpath") or [])
    except Exception:  # unparsable_override or bad_yaml words it
        entries = []
    folders = tuple(Path(str(e).removeprefix("file://")) for e in entries if "://" not in str(e).removeprefix("file://"))
    return Roots(conf_dir, (*_config_dir(args), *folders), opaque=len(folders) < len(entries))


def _config_dir(args: list[str]) -> list[Path]:
    """Hydra's --config-dir (-cd) folder, whose config groups it reads after conf/'s; none where it is no
    folder (Hydra says so itself)."""
    for i, a in enumerate(args):
        flag, eq, value = a.partition("=")
        if flag in ("--config-dir", "-cd"):
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            return [Path(value)] if value and Path(value).is_dir() else []
    return []


def bad_yaml(conf_dir) -> str | None:
    """The message for the first file under `conf_dir` that does not parse as YAML (None: all do);
    ~50 small files, a few ms with libyaml."""
    return next(filter(None, map(yaml_problem, sorted(conf_dir.rglob("*.yaml")))), None)


def yaml_problem(path: Path, shown: str | None = None) -> str | None:
    """The message for a config file that is not UTF-8 or does not parse as YAML; None if it does.
    `shown`: its name in the message (relative to the current directory by default)."""
    import os

    shown = shown or os.path.relpath(path)
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:  # an editor's latin-1: a raw traceback of run.py otherwise
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        return (f"{shown} is not UTF-8 text (byte {data[e.start:e.start + 1]!r} at line {line}, "
                f"column {column}); config files are read as UTF-8. Convert it (e.g. iconv -f latin1 -t utf-8 "
                f"{path.name} > {path.stem}.utf8.yaml, then rename it) or fix the line.")
    try:
        yaml.load(text, Loader=loader)  # noqa: S506 (a safe loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        return (f"{shown} is not valid YAML: {problem}{where}. Fix the file (a common cause: "
                f"the keys of one mapping indented by different numbers of spaces, or a tab).")
    return None
