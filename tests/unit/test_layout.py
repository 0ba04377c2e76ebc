"""The package stays a house a newcomer can read: few rooms at the top, floors that only lean on the ones below, and
no two modules that need each other."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "shardlab"
MAX_TOP_LEVEL = 18
"""16 rooms, and two of issue #50: shardlab.files, the file handling checkpoint/, jobs/ and the tasks share, a floor of
its own below them, where it had lived in checkpoint/ "because the top level is full"; and shardlab.cli, what a command
line means (pre-flight, config checks, run names), out of jobs/, which keeps the job's own concerns."""
TOPS = ("shardlab", "shardlab_tasks", "shardlab_commands")
"""The packages a wheel installs (with hydra_plugins, which only Hydra loads): each under shardlab's own name."""
COVERED = (*TOPS, "shardlab_bench")
"""The packages the floors hold: the installed ones and the clone's benchmarks (issue #50)."""

LAYERS: list[tuple[str, ...]] = [
    ("shardlab_bench",),  # the benchmarks and evidence (the clone's, not the wheel's): they run and measure all below
    ("shardlab_commands",),  # the user commands on the PATH: the export and preprocessing read task modules
    ("shardlab_tasks",),  # the built-in plug-ins (a package of their own) use shardlab; shardlab never imports a task
    # the LM plug-in's rooms (issue #50): its task glue on top, then fine-tuning, the Hugging Face interop, the models
    # and corpora, and the leaves every room shares (the schemas, the loss, the packed-row format) at the bottom
    ("shardlab_tasks.lm",),
    ("shardlab_tasks.lm.finetuning",),
    ("shardlab_tasks.lm.hf",),
    ("shardlab_tasks.lm.models", "shardlab_tasks.lm.corpus"),
    ("shardlab_tasks.lm.config", "shardlab_tasks.lm.loss", "shardlab_tasks.lm.sft_packing"),
    ("shardlab.train",),  # the entry (python -m shardlab.train): checked by the CLI's rules, run by the runner
    ("shardlab.runner",),  # the job: local ranks or a launcher's rank; autotune's trials, built by trainer.assemble
    ("shardlab.trainer",),
    ("shardlab.logging",),
    # what a command line means: the pre-flight, every config check, conf options, run names. The runner checks a
    # sweep point by them and the trainer compares a resumed run's keys by them, so it sits below both; the pre-flight
    # takes the run lock, so it sits above jobs/
    ("shardlab.cli",),
    # the run's folder rules, lock, record, stop signals, Slurm launcher and sweep manifest: the trainer writes the
    # record and holds the lock, logging reads the sweep's manifest, so jobs/ sits below them
    ("shardlab.jobs",),
    ("shardlab.checkpoint", "shardlab.optim", "shardlab.memory"),
    ("shardlab.distributed",),
    ("shardlab.registry",),
    ("shardlab.task",),  # the Task interface: a task reads the run's config, typed by the schemas below
    ("shardlab.config",),  # the schemas
    ("shardlab.files",),  # untrusted reads, durable writes, process liveness: for checkpoint/, jobs/ and the tasks
    ("shardlab.data", "shardlab.errors", "shardlab.train_state", "shardlab"),
]
"""The floors from the top down. A module belongs to the longest name here that is it or a package holding it (the
package ``shardlab`` itself only to its own __init__). A module may import its own floor and those below it, at
module level or inside a function alike; within a floor, no two names may import each other."""


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """Every module of the packages COVERED under ``root`` and the modules of those it imports anywhere in
    its code (inside functions too), each with the line of its first import. ``from pkg import sub`` counts as importing
    ``pkg.sub`` when that is a module; ``import pkg.sub`` imports ``pkg.sub``."""
    modules = {module_name(p, root): p for top in COVERED for p in (root / top).rglob("*.py")}
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]  # fmt: skip
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                if target in modules and target != name:
                    graph[name].setdefault(target, node.lineno)
    return graph


@functools.cache
def repo_imports() -> dict[str, dict[str, int]]:
    """``imports`` of this repository, parsed once per session."""
    return imports(ROOT)


def import_graph() -> dict[str, set[str]]:
    """``repo_imports`` without the lines."""
    return {m: set(targets) for m, targets in repo_imports().items()}


def unit_of(module: str) -> str | None:
    """The name in LAYERS that ``module`` belongs to, or None."""
    names = [n for layer in LAYERS for n in layer]
    owners = [n for n in names if module == n or (n != "shardlab" and module.startswith(n + "."))]
    return max(owners, key=len) if owners else None


def floor_of(unit: str) -> int:
    """0 for the top floor, growing downwards."""
    return next(i for i, layer in enumerate(LAYERS) if unit in layer)


def upward_imports(graph: dict[str, dict[str, int]], root: Path = ROOT) -> list[str]:
    """Each import of a module from a floor above its own, as ``path:line: importer -> imported``."""
    found = []
    for module, targets in sorted(graph.items()):
        for target, line in sorted(targets.items()):
            if floor_of(unit_of(target)) < floor_of(unit_of(module)):
                path = Path(*module.split(".")).with_suffix(".py")
                if not (root / path).is_file():
                    path = Path(*module.split("."), "__init__.py")
                found.append(f"{path}:{line}: {module} -> {target}")
    return found


def unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Which names of LAYERS import which others."""
    units: dict[str, set[str]] = {}
    for module, targets in graph.items():
        units.setdefault(unit_of(module), set()).update(unit_of(t) for t in targets)
    return {u: {t for t in targets if t != u} for u, targets in units.items()}


def cycle_from(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_the_package_has_at_most_18_top_level_entries():
    # conf/ is the Hydra configs shipped as package data (issue 50), not a room of code
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name not in ("__pycache__", "conf"))
    assert len(entries) <= MAX_TOP_LEVEL, f"{len(entries)} entries in shardlab/: {entries}; group them into packages"


def test_every_module_has_a_floor():
    homeless = sorted(m for m in repo_imports() if unit_of(m) is None)
    assert not homeless, f"modules on no floor of LAYERS: {homeless}; add their package to LAYERS"


def test_no_module_imports_from_a_floor_above_its_own():
    upward = upward_imports(repo_imports())
    assert not upward, "imports from a higher floor (pass a value or a callable in, or move the code):\n" + "\n".join(
        upward
    )


def test_no_modules_import_each_other():
    cycle = cycle_from(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_two_packages_import_each_other():
    cycle = cycle_from(unit_graph(import_graph()))
    assert cycle is None, "packages that import each other: " + " -> ".join(cycle)


def test_the_schemas_import_no_other_shardlab_package():
    """config.py holds the dataclasses only: its checks are shardlab.cli.checks', the resolvers the CLI's."""
    assert repo_imports()["shardlab.config"] == {}


def test_the_cycle_finder_finds_a_planted_cycle():
    assert cycle_from({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle_from({"a": {"b"}, "b": set()}) is None


def test_the_floor_check_finds_a_planted_upward_import_inside_a_function(tmp_path):
    (tmp_path / "shardlab" / "jobs").mkdir(parents=True)
    (tmp_path / "shardlab_tasks").mkdir()
    for init in ("shardlab", "shardlab/jobs", "shardlab_tasks"):
        (tmp_path / init / "__init__.py").write_text("")
    (tmp_path / "shardlab" / "jobs" / "checks.py").write_text("from shardlab.config import TrainConfig\n")
    (tmp_path / "shardlab" / "config.py").write_text("class TrainConfig: ...\n")
    assert upward_imports(imports(tmp_path), tmp_path) == []
    (tmp_path / "shardlab" / "config.py").write_text("def f():\n    from shardlab.jobs import checks\n")
    assert upward_imports(imports(tmp_path), tmp_path) == [
        "shardlab/config.py:2: shardlab.config -> shardlab.jobs.checks"
    ]
    (tmp_path / "shardlab" / "config.py").write_text("import shardlab_tasks\n")
    assert upward_imports(imports(tmp_path), tmp_path) == ["shardlab/config.py:1: shardlab.config -> shardlab_tasks"]


def test_every_package_names_its_public_face():
    for init in PACKAGE.rglob("__init__.py"):
        if init.parent == PACKAGE:
            continue
        tree = ast.parse(init.read_text())
        assert ast.get_docstring(tree), f"{init} has no docstring saying what the package holds"
        names = {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if hasattr(t, "id")}
        assert "__all__" in names, f"{init} does not name its public face in __all__"


def test_the_benchmarks_are_on_the_top_floor_and_a_command_importing_them_is_caught(tmp_path):
    """shardlab_bench measures everything below it and nothing imports it: a user command that did would need the
    clone's package in the wheel."""
    assert all(unit_of(m) == "shardlab_bench" for m in repo_imports() if m.startswith("shardlab_bench."))
    assert [m for m, targets in repo_imports().items() if unit_of(m) != "shardlab_bench" and any(
        unit_of(t) == "shardlab_bench" for t in targets)] == []  # fmt: skip
    for package in ("shardlab_commands", "shardlab_bench"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "shardlab_bench" / "train.py").write_text("from shardlab_commands import evaluate\n")
    (tmp_path / "shardlab_commands" / "evaluate.py").write_text("x = 1\n")
    assert upward_imports(imports(tmp_path), tmp_path) == []
    (tmp_path / "shardlab_commands" / "evaluate.py").write_text("def f():\n    from shardlab_bench import train\n")
    assert upward_imports(imports(tmp_path), tmp_path) == [
        "shardlab_commands/evaluate.py:2: shardlab_commands.evaluate -> shardlab_bench.train"
    ]


def sys_path_edits(source: str) -> list[int]:
    """The lines of ``source`` that change the import path: a call of a method of ``sys.path`` (insert, append,
    extend, ...) or an assignment to it or to an item of it."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func.value
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            target = next((t.value if isinstance(t, ast.Subscript) else t for t in targets), None)
        else:
            continue
        if target is not None and ast.unparse(target) == "sys.path":
            found.append(node.lineno)
    return found


def test_no_code_outside_tests_edits_sys_path():
    """Issue #50: every package imports as a package (the benchmarks through ``python -m shardlab_bench``), so no
    module of the repository outside tests/ puts a folder on the import path."""
    edits = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted(ROOT.rglob("*.py"))
        if path.relative_to(ROOT).parts[0] != "tests"
        and not any(p.startswith(".") for p in path.relative_to(ROOT).parts)
        for line in sys_path_edits(path.read_text())
    ]
    assert edits == [], f"sys.path edited outside tests/: {edits}; import the package instead"


@pytest.mark.parametrize(
    "source",
    ["import sys\nsys.path.insert(0, 'x')\n", "import sys\nsys.path.append('x')\n",
     "import sys\nsys.path[:0] = ['x']\n", "import sys\nsys.path = ['x']\n", "import sys\nsys.path += ['x']\n"],
)  # fmt: skip
def test_the_sys_path_check_finds_each_kind_of_edit(source):
    assert sys_path_edits(source) == [2]
    assert sys_path_edits("import os\nos.path.join('a', 'b')\nprint(sys.path)\n") == []
