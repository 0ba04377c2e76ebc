"""docs/design.md's trace from `python -m shardlab.train` to `fully_shard` stays true: every file and function it
names exists, each hop calls the next in the order shown, and a run is assembled in one place only."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DESIGN = REPO / "docs" / "design.md"
ROW = re.compile(r"^(\d+)( +)(\S+\.py) +(.+?)(?: {2,}.*)?$")
ASSEMBLY = ("shardlab/trainer.py", "assemble")
"""The one function that makes a Trainer (shardlab.trainer.assemble)."""


@dataclass
class Hop:
    number: int
    depth: int
    path: str
    functions: list[tuple[str, bool]]
    """Each function the hop names, in order, and whether it is bracketed (taken on some paths only)."""


def trace(text: str) -> list[Hop]:
    """The numbered rows of the code block under "From `python -m shardlab.train` to `fully_shard`"."""
    section = text.split("## From `python -m shardlab.train` to `fully_shard`", 1)[1]
    block = section.split("```", 2)[1]
    hops = []
    for line in block.splitlines():
        if match := ROW.match(line):
            functions = []
            for part in match[4].split(" -> "):
                bracketed = part.startswith("[")
                functions += [(name, bracketed) for name in re.findall(r"([\w.]+)\(\)", part)]
            hops.append(Hop(int(match[1]), (len(match[2]) - 2) // 2, match[3], functions))
    return hops


def definitions(path: Path) -> dict[str, ast.FunctionDef]:
    """Module functions by name, methods as ``Class.method``."""
    tree = ast.parse(path.read_text())
    out: dict[str, ast.FunctionDef] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = node
        elif isinstance(node, ast.ClassDef):
            out |= {f"{node.name}.{f.name}": f for f in node.body if isinstance(f, ast.FunctionDef)}
    return out


def calls(path: Path, name: str) -> list[tuple[int, str, str]]:
    """(line, called name, the receiver's name or '') of every call in function ``name`` of ``path``, in source
    order, with the calls of the module's own functions it uses (called, or handed on as ``_spawned_entry`` is)
    spliced in where they are used."""
    defs = definitions(path)
    out: list[tuple[int, str, str]] = []
    seen = {name}

    def walk(function: ast.FunctionDef, at: int | None) -> None:
        nodes = sorted(
            (n for n in ast.walk(function) if isinstance(n, (ast.Call, ast.Name)) and n is not function),
            key=lambda n: (n.lineno, n.col_offset),
        )
        for node in nodes:
            line = at if at is not None else node.lineno
            if isinstance(node, ast.Call):
                func = node.func
                called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                receiver = getattr(getattr(func, "value", None), "id", "")
                if called:
                    out.append((line, called, receiver))
            elif node.id in defs and node.id not in seen:
                seen.add(node.id)
                walk(defs[node.id], line)

    walk(defs[name], None)
    return out


def reaches(caller: tuple[str, str], callee: str, after: int = 0) -> int | None:
    """The line in ``caller`` (path, function) where it calls ``callee`` after line ``after``. A method is called
    through a name that ends its class's name: ``trainer.setup()`` is Trainer.setup, ``backend.parallelize()`` is
    FullyShardedBackend.parallelize, and ``backend.setup()`` is not Trainer.setup."""
    cls, _, method = callee.rpartition(".")
    for line, called, receiver in calls(REPO / caller[0], caller[1]):
        if called == method and line > after and (not cls or (receiver and cls.lower().endswith(receiver.lower()))):
            return line
    return None


def trace_problems(text: str) -> list[str]:
    """What of the trace in ``text`` is not true of the code: a file or function that does not exist, a hop not
    called by the one it follows (a row by the row above it, an indented row by the row it is under, siblings in
    their order)."""
    hops = trace(text)
    problems = []
    for hop in hops:
        path = REPO / hop.path
        if not path.is_file():
            problems.append(f"row {hop.number}: {hop.path} does not exist")
            continue
        defined = definitions(path)
        problems += [f"row {hop.number}: {hop.path} defines no {n}()" for n, _ in hop.functions if n not in defined]
    if problems:
        return problems
    last_call: dict[int, int] = {}  # a parent hop's number -> the line of its call of its latest child
    for i, hop in enumerate(hops):
        chain = [(hop.path, name) for name, bracketed in hop.functions if not bracketed]
        for (path, caller), (_, callee) in zip(chain, chain[1:], strict=False):
            if not reaches((path, caller), callee):
                problems.append(f"row {hop.number}: {caller}() does not call {callee}()")
        if i == 0:
            continue
        parent = next(h for h in reversed(hops[:i]) if h.depth < hop.depth or h.depth == hop.depth == 0)
        caller = (parent.path, [n for n, b in parent.functions if not b][-1])
        line = reaches(caller, chain[0][1], after=last_call.get(parent.number, 0))
        if line is None:
            problems.append(f"row {hop.number}: {caller[1]}() does not call {chain[0][1]}() after the row before")
        else:
            last_call[parent.number] = line
    return problems


def test_the_trace_is_true_of_the_code():
    hops = trace(DESIGN.read_text())
    assert [h.number for h in hops] == list(range(1, len(hops) + 1)), "docs/design.md: the trace's rows are numbered"
    assert ("assemble", False) in [f for h in hops for f in h.functions], "the trace goes through the assembly"
    assert trace_problems(DESIGN.read_text()) == []


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        ("4    shardlab/memory/plan.py", "4    shardlab/registry.py", "shardlab/registry.py does not exist"),
        ("FullyShardedBackend.parallelize()", "FullyShardedBackend.shard()", "defines no FullyShardedBackend.shard()"),
        (
            "3  shardlab/trainer.py                      assemble()",
            "3  shardlab/trainer.py  Trainer.fit()",
            "fit() does not call plan_run()",
        ),
    ],
)
def test_a_trace_that_is_not_true_is_caught(old, new, problem):
    text = DESIGN.read_text()
    assert old in text
    problems = trace_problems(text.replace(old, new))
    assert problems and problem in problems[0], problems


def test_hops_out_of_order_are_caught():
    """plan_run and Trainer.setup swapped: assemble calls setup only after plan_run."""
    lines = DESIGN.read_text().splitlines()
    plan = next(i for i, line in enumerate(lines) if line.startswith("4    shardlab/memory/plan.py"))
    lines[plan], lines[plan + 1] = "4" + lines[plan + 1][1:], "5" + lines[plan][1:]
    assert "assemble() does not call plan_run() after the row before" in trace_problems("\n".join(lines))[0]


def constructions_of_trainer(path: Path) -> list[str]:
    """Where ``path`` calls ``Trainer(...)`` (or ``module.Trainer(...)``), as 'path:line in function'."""
    found = []

    class Visitor(ast.NodeVisitor):
        where = ["<module>"]

        def visit_FunctionDef(self, node):
            self.where.append(node.name)
            self.generic_visit(node)
            self.where.pop()

        visit_AsyncFunctionDef = visit_FunctionDef

        def visit_Call(self, node):
            func = node.func
            if (func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)) == "Trainer":
                found.append(f"{path.relative_to(REPO)}:{node.lineno} in {self.where[-1]}")
            self.generic_visit(node)

    Visitor().visit(ast.parse(path.read_text()))
    return found


def test_only_the_assembly_makes_a_trainer():
    places = []
    for folder in ("shardlab", "tasks", "tools", "tests", "benchmarks", "hydra_plugins"):
        places += [p for path in sorted((REPO / folder).rglob("*.py")) for p in constructions_of_trainer(path)]
    elsewhere = [p for p in places if not p.startswith(f"{ASSEMBLY[0]}:") or not p.endswith(f" in {ASSEMBLY[1]}")]
    assert places and not elsewhere, (
        f"a Trainer is made outside shardlab.trainer.assemble: {elsewhere}; assemble the run there (one order)"
    )


@pytest.mark.parametrize("source", ["def f():\n    return Trainer(cfg)\n", "x = trainer.Trainer(cfg)\n"])
def test_a_trainer_made_elsewhere_is_found(tmp_path, monkeypatch, source):
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    (tmp_path / "m.py").write_text(source)
    assert constructions_of_trainer(tmp_path / "m.py") == [
        f"m.py:{source.count(chr(10))} in {'f' if 'def' in source else '<module>'}"
    ]
