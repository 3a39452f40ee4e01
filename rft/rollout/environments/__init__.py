"""Environments a multi-turn workflow steps: tools.py (ToolEnv, the calculator, the python tool),
and the sandbox the python tool runs model-written code in (sandbox.py, seccomp.py)."""
