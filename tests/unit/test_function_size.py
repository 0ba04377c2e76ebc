"""No function in shardlab/, shardlab_tasks/, shardlab_commands/ or shardlab_bench/ (the benchmarks) is longer than a
screen (60 lines, from its ``def`` to its last line): a longer one holds two ideas, and the reader has to scroll to see
what it does (DESIGN.md, "Size")."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 60


def function_lengths(source: str) -> dict[str, int]:
    """Every function and method of a module (nested ones too) by qualified name: its length in lines, from the
    ``def`` line (decorators not counted) to its last line."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                lengths[name] = child.end_lineno - child.lineno + 1
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return lengths


def long_functions() -> dict[str, int]:
    """``path::qualname`` -> lines, for each function over MAX_LINES in the installed packages and the benchmarks."""
    found = {}
    for folder in ("shardlab", "shardlab_tasks", "shardlab_commands", "shardlab_bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for name, lines in function_lengths(path.read_text()).items():
                if lines > MAX_LINES:
                    found[f"{path.relative_to(ROOT)}::{name}"] = lines
    return found


def test_no_function_is_over_60_lines():
    too_long = {name: lines for name, lines in long_functions().items()}
    assert not too_long, (
        f"functions over {MAX_LINES} lines: "
        + ", ".join(f"{name} ({lines})" for name, lines in sorted(too_long.items()))
        + "; split each into steps a reader sees in one screen"
    )


def test_the_size_rule_measures_a_planted_long_method_by_its_qualified_name():
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_LINES - 1))  # with the def line: exactly the limit
    source = f"class A:\n    def fits(self):\n{body}\n\n    @staticmethod\n    def over(self):\n{body}\n        y = 1\n"
    assert function_lengths(source) == {"A.fits": MAX_LINES, "A.over": MAX_LINES + 1}
    nested = "def outer():\n    def inner():\n        return 1\n    return inner\n"
    assert function_lengths(nested) == {"outer": 4, "outer.inner": 2}
