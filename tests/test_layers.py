"""The package's layers, read from its imports (every import statement, also those inside
functions). A part is a folder of rft/ (rollout/workflows and rollout/environments one part, the
record and the buffer of data/ parts of their own); the ground floor is the files at the top.
Each part imports only parts on floors below its own: so no cycles between parts, planning
imports nothing that runs, the trainer and the rollout side meet only through the sync contract
and the buffer, and a dry run loads neither torch, transformers, Ray nor a web server."""

import pytest
import ast
import re
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

PKG = ROOT / "rft"
# bottom to top: a part imports only the parts of lower floors (and itself)
FLOORS = [
    {"base"},                          # config.py errors.py registry.py manifest.py foreign_keys.py
    {"experience", "sync", "reporting"},
    {"buffer", "models", "algorithms"},
    {"rewards"},
    {"data"},                          # tasksets and generators check answers with verifiers
    {"serving"},                       # servers score with rewards, render chats
    {"workflows"},                     # handed an engine; call the OpenAI endpoint's helpers
    {"plan", "trainer", "rollout"},    # side by side: none of them imports another
    {"runtime"},
    {"studio"},
]
FLOOR = {part: i for i, parts in enumerate(FLOORS) for part in parts}
TOP_FILES = {"config": "base", "errors": "base", "registry": "base", "manifest": "base", "foreign_keys": "base",
             "models": "models"}


def part(module: str) -> str:
    """The part a module of rft belongs to, from its folder."""
    p = module.split(".") + [""]
    if p[1] in TOP_FILES or p[1] == "":  # a file at the top, or rft/__init__.py
        return TOP_FILES.get(p[1], "base")
    if p[1] == "rollout" and p[2] in ("workflows", "environments"):
        return "workflows"
    if p[1] == "data" and p[2] in ("experience", "buffer"):
        return p[2]
    return p[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """module -> the rft modules it imports (the most specific existing module of each import)."""
    modules = {module_name(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from rft.algorithms import advantages` imports the submodule
                targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            else:
                continue
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t.startswith("rft") and t != name:
                    found.add(t)
                    break
        graph[name] = found
    return graph


def reach(graph, start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for m in graph[todo.pop()]:
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def test_the_import_graph_is_read():
    g = imports()
    # a known edge, so that an empty graph cannot pass the checks below
    assert "rft.sync.weights" in g["rft.trainer.weights"] and "rft.plan.batch" in g["rft.runtime.main"]


def test_every_module_is_in_a_part_and_rft_shows_its_parts():
    g = imports()
    assert {m for m in g if m != "rft" and part(m) not in FLOOR} == set()
    assert {p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(FLOOR) - {
        "base", "workflows", "experience", "buffer", "models"}
    assert len([p for p in PKG.iterdir() if p.name != "__pycache__"]) <= 18


def test_no_class_over_300_lines_and_no_function_over_60():
    """Small enough to read whole: a class that grows past 300 lines splits by responsibility (as
    the trainer's step, weights and state did), a function past 60 into named steps."""
    import ast

    big = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and lines > 300 or \
                    isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines > 60:
                big.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert big == []


def test_each_part_imports_only_parts_below_it():
    g = imports()
    upward = sorted(f"{a} -> {b}" for a, bs in g.items() if a != "rft" for b in bs
                    if part(a) != part(b) and FLOOR[part(b)] >= FLOOR[part(a)])
    assert upward == []


def test_no_import_cycles():
    g = imports()
    cycles = sorted(f"{a} -> ... -> {a}" for a in g if a in reach(g, a))
    assert cycles == []


def test_trainer_and_engines_meet_only_in_the_sync_contract():
    g = imports()
    for a, b in [("trainer", "rollout"), ("rollout", "trainer")]:
        for m in (m for m in g if part(m) == a):
            assert not {part(r) for r in reach(g, m)} & {b}, m
    assert "rft.sync.weights" in g["rft.trainer.weights"] and "rft.sync.weights" in g["rft.rollout.engines.hf"]


def test_planning_imports_nothing_that_runs():
    g = imports()
    runs = {"rollout", "trainer", "runtime", "sync", "buffer", "models"}
    for m in (m for m in g if part(m) == "plan"):
        assert not {part(r) for r in reach(g, m)} & runs, m


@pytest.mark.slow
def test_a_dry_run_loads_neither_torch_nor_transformers_nor_ray_nor_a_server(tmp_path):
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['run.py', 'dry_run=true', 'checkpoint_root_dir={tmp_path}']\n"
        "try:\n    runpy.run_path('run.py', run_name='__main__')\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print('LOADED', sorted(m for m in ('torch', 'transformers', 'ray', 'vllm', 'fastapi', 'uvicorn', 'httpx') "
        "if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "batch plan: stage sft_warmup" in out.stdout  # it planned both stages
    assert "LOADED []" in out.stdout


def test_the_closed_sets_of_names_are_the_runtime_registries():
    from rft import config
    from rft.models import torch_dtype
    from rft.runtime.actors import ACTOR_BACKENDS
    from rft.sync.weights import SYNC_METHODS

    assert set(config.SYNC_METHODS) == set(SYNC_METHODS)
    assert set(config.BACKENDS) == set(ACTOR_BACKENDS)
    # every dtype name the config accepts is a torch dtype, and aliases agree with their names
    assert {str(torch_dtype(a)) for a in config.DTYPES} == {"torch.float32", "torch.bfloat16", "torch.float16"}
    assert all(str(torch_dtype(a)) == f"torch.{n}" for a, n in config.DTYPES.items())


def protocol_methods(protocol) -> set[str]:
    return {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")}


def test_every_engine_and_trainer_backend_implements_its_protocol():
    """Each registered class has every method of its Protocol (rft/rollout/engines/base.py,
    rft/trainer/base.py), with the Protocol's parameters: what a new one copies is complete."""
    import inspect

    from rft.registry import ENGINES, TRAINER_BACKENDS
    from rft.rollout.engines.base import Engine
    from rft.trainer.base import TrainerBackend

    pytest.importorskip("vllm")
    for registry, protocol in [(ENGINES, Engine), (TRAINER_BACKENDS, TrainerBackend)]:
        assert len(protocol_methods(protocol)) >= 8
        for name in registry:
            cls = registry[name]
            for method in protocol_methods(protocol):
                assert callable(getattr(cls, method, None)), f"{name}: {cls.__name__} has no {method}"
                want = list(inspect.signature(getattr(protocol, method)).parameters)
                assert list(inspect.signature(getattr(cls, method)).parameters) == want, (name, method)


def test_every_registered_algorithm_function_imports():
    from rft.algorithms import ADVANTAGE_FNS, KL_FNS, POLICY_LOSS_FNS

    for registry in (ADVANTAGE_FNS, POLICY_LOSS_FNS, KL_FNS):
        for name in registry:
            assert callable(registry[name]), name


def _layout_rows() -> dict[str, str]:
    """README "Layout": each row of the drawing (`rft/<part>/` or `rft/<file>.py`, with its
    continuation lines) by the path it starts with."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("\n## Layout\n"):readme.index("\n## Extension points\n")]
    rows: dict[str, str] = {}
    current = None
    for line in section.splitlines():
        if line.startswith("    ") and not line.startswith("     "):  # a row's first line
            current = line.split()[0]
            rows[current] = line
        elif line.startswith("     ") and current:  # its continuation
            rows[current] += " " + line.strip()
        else:
            current = None
    return rows


def test_the_readmes_layout_names_every_module_of_rft():
    """The drawing in README "Layout" is the map a newcomer reads: every file of rft/ is named in
    its part's row (a module left out of it was added since and not said where it sits)."""
    rows = _layout_rows()
    assert "rft/plan/" in rows and "batch.py" in rows["rft/plan/"]  # the rows are read
    missing = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.name in ("__init__.py", "__main__.py"):
            continue
        if len(rel.parts) == 2:  # a file at the top has a row of its own
            named = str(rel) in rows
        else:
            row = rows.get(f"{rel.parts[0]}/{rel.parts[1]}/", "")
            # by its file name; by its name alone only in a row that lists names (the algorithms:
            # `advantages, losses, KL, aggregation`)
            name = rel.name if ".py" in row else rel.stem
            named = re.search(rf"(?<![\w./]){re.escape(name)}(?![\w/])", row, re.IGNORECASE) is not None
        if not named:
            missing.append(str(rel))
    assert missing == [], f"named nowhere in README's Layout (in its part's row): {missing}"
