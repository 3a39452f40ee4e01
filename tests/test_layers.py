"""The package's layers, read from its imports (every import statement, also those inside
functions): no import cycles; planning imports nothing that runs; trainer and engines meet only in
the sync contract; and a dry run loads neither torch nor transformers nor Ray."""

import ast
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

PKG = ROOT / "rft"
TRAINER_SIDE = {"rft.trainer", "rft.fsdp", "rft.critic"}
ENGINE_SIDE = {"rft.engine", "rft.vllm_engine", "rft.vllm_worker"}
# what planning may reach: configuration, names and data readers, nothing that trains or serves
PLANNING = {"rft.plan", "rft.config"}
RUNTIME = TRAINER_SIDE | ENGINE_SIDE | {"rft.explorer", "rft.runner", "rft.actors", "rft.sync", "rft.buffer",
                                        "rft.models", "rft.monitor", "rft.bench"}


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
    assert "rft.sync" in g["rft.trainer"] and "rft.plan" in g["rft.main"]


def test_no_import_cycles():
    g = imports()
    cycles = sorted(f"{a} -> ... -> {a}" for a in g if a in reach(g, a))
    assert cycles == []


def test_trainer_and_engines_meet_only_in_the_sync_contract():
    g = imports()
    for t in TRAINER_SIDE:
        assert not reach(g, t) & ENGINE_SIDE, t
    for e in ENGINE_SIDE:
        assert not reach(g, e) & TRAINER_SIDE, e
    assert "rft.sync" in g["rft.trainer"] and "rft.sync" in g["rft.engine"]


def test_planning_imports_nothing_that_runs():
    g = imports()
    for m in PLANNING:
        assert not reach(g, m) & RUNTIME, m


def test_a_dry_run_loads_neither_torch_nor_transformers_nor_ray(tmp_path):
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['run.py', 'dry_run=true', 'checkpoint_root_dir={tmp_path}']\n"
        "try:\n    runpy.run_path('run.py', run_name='__main__')\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print('LOADED', sorted(m for m in ('torch', 'transformers', 'ray', 'vllm') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "batch plan: stage sft_warmup" in out.stdout  # it planned both stages
    assert "LOADED []" in out.stdout


def test_the_closed_sets_of_names_are_the_runtime_registries():
    from rft import config
    from rft.actors import ACTOR_BACKENDS
    from rft.explorer import ENGINES
    from rft.models import torch_dtype
    from rft.sync import SYNC_METHODS

    assert set(config.SYNC_METHODS) == set(SYNC_METHODS)
    assert set(config.ENGINE_TYPES) == set(ENGINES)
    assert set(config.BACKENDS) == set(ACTOR_BACKENDS)
    # every dtype name the config accepts is a torch dtype, and aliases agree with their names
    assert {str(torch_dtype(a)) for a in config.DTYPES} == {"torch.float32", "torch.bfloat16", "torch.float16"}
    assert all(str(torch_dtype(a)) == f"torch.{n}" for a, n in config.DTYPES.items())


def test_every_registered_algorithm_function_imports():
    from rft.algorithms import ADVANTAGE_FNS, KL_FNS, POLICY_LOSS_FNS

    for registry in (ADVANTAGE_FNS, POLICY_LOSS_FNS, KL_FNS):
        for name in registry:
            assert callable(registry[name]), name
