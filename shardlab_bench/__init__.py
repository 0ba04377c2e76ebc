"""shardlab's benchmarks and evidence scripts: every measured or planned figure the docs show comes from one of these
modules, run through one runner from the clone's root:

    python -m shardlab_bench                      # the benchmarks, one line each
    python -m shardlab_bench train model=gpt_small --steps 20 --out bench.json
    python -m shardlab_bench tables --check       # the docs' tables are what docs/bench/*.json render

Each benchmark is a module here with a ``main(argv)``; each records what it was measured with through
shardlab_bench.provenance (commit, machine, torch, load average, date and the command that reruns it). The package is
the clone's, not the wheel's: the benchmarks read tests/data and docs/bench and record the clone's commit, and a
user of the installed shardlab runs none of them. It sits above shardlab, shardlab_tasks and shardlab_commands
(tests/unit/test_layout.py) and nothing imports it.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

__all__ = ["HELPERS", "REPO", "benchmarks", "child_env", "command"]

PACKAGE = Path(__file__).resolve().parent
REPO = PACKAGE.parent
HELPERS = ("against_loop", "flops", "provenance")
"""The modules the benchmarks share, which are not benchmarks themselves (no ``main`` of their own to run)."""


def benchmarks() -> dict[str, str]:
    """Every benchmark's name (its module) and the first line of its docstring, read without importing it (most import
    torch): a module of this package with a top-level ``main``."""
    found = {}
    for path in sorted(PACKAGE.glob("*.py")):
        if path.stem.startswith("_") or path.stem in HELPERS:
            continue
        tree = ast.parse(path.read_text())
        if any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body):
            found[path.stem] = (ast.get_docstring(tree) or "").split("\n\n")[0].replace("\n", " ")
    return found


def child_env() -> dict[str, str]:
    """This process's environment with the clone's root first on PYTHONPATH: a benchmark's child process (another
    benchmark, or itself with a child's options) imports shardlab_bench from whatever folder it runs in."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def command(*argv: str) -> list[str]:
    """The argv that runs the runner with ``argv`` (a benchmark's name and its arguments; none: the list) in a child
    process (with ``child_env()``)."""
    return [sys.executable, "-m", "shardlab_bench", *argv]
