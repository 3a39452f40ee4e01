"""A study's module named like one of Python's standard modules, where Python looks first.

`python run.py` imports a study's own code from run.py's folder and the folders in PYTHONPATH
(rft.registry's dotted paths), and Python searches those before the standard library, in the driver
and in every process it starts (Ray's workers, a sweep's jobs inherit PYTHONPATH). So a study's
`random.py` or `code.py` there is what every `import random` gets, Hydra's and torch's included: the
run died inside Hydra's imports ("cannot import name 'shuffle' from 'random' (<study>/random.py)"),
or a name the interpreter had already imported (`time`) stayed the standard one, and the study's own
`from time import ...` failed. run.py checks first, before anything else is imported; this module
imports nothing itself, so no name of the study's can break the check.
"""

import os
import sys


def study_folders(script_dir: str | None = None, env=os.environ) -> list[tuple[str, str]]:
    """(folder, why it is searched) for run.py's folder and each PYTHONPATH entry, in Python's order."""
    folders = [] if script_dir is None else [(script_dir, "the folder of run.py")]
    entries = env.get("PYTHONPATH", "")
    return folders + [(p or os.getcwd(), "in PYTHONPATH") for p in entries.split(os.pathsep)] if entries else folders


def shadowing(folders: list[tuple[str, str]]) -> list[tuple[str, str, str]]:
    """(file, standard module, why its folder is searched) for each module or package in `folders`
    named like a standard module (a folder without __init__.py is a namespace package: the standard
    module wins over it)."""
    found = []
    for folder, why in folders:
        try:
            names = sorted(os.listdir(folder))
        except OSError:  # not there: Python skips it too
            continue
        for name in names:
            path = os.path.join(folder, name)
            stem = name[:-3] if name.endswith(".py") and os.path.isfile(path) else (
                name if os.path.isfile(os.path.join(path, "__init__.py")) else None)
            if stem in sys.stdlib_module_names:
                found.append((path, stem, f"{folder}, {why}"))
    return found


def exit_on_shadowing(script_dir: str | None = None, env=os.environ) -> None:
    """One paragraph and exit status 2 when a study's module shadows a standard one (see the module)."""
    found = shadowing(study_folders(script_dir, env))
    if not found:
        return
    files = "; ".join(f"{path} is named like Python's standard module `{mod}` ({why})" for path, mod, why in found)
    print(f"\nrft: configuration error: {files}. Python searches these folders before its standard library, so "
          f"every import of that name in this run (Hydra's, torch's, rft's and Ray's workers' included) would load "
          f"the study's instead, and fail far from it. Rename it (and the imports and dotted paths that name "
          f"it), or keep the study's modules in a package of its own (my_study/{found[0][1]}.py is imported as "
          f"my_study.{found[0][1]}, which shadows nothing).\n", file=sys.stderr)
    sys.exit(2)
