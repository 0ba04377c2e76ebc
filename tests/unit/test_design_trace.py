"""docs/design.md's trace from `python -m shardlab.train` to `fully_shard` stays true: each hop names one function,
which exists in the file named and is called by the hop before it, in the order shown; the README's architecture
paragraph names the trace's files in its order; and a run is assembled in one place only."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DESIGN = REPO / "docs" / "design.md"
ROW = re.compile(r"^(\d+)( +)(\S+\.py) +(.+?)(?: {2,}.*)?$")
FUNCTION = re.compile(r"([\w.]+)\(\)")
PATH_COLUMN = 4
"""Where a top-level row's file begins; each level of indentation adds 2."""
ASSEMBLY = ("shardlab/trainer.py", "assemble")
"""The one function that makes a Trainer (shardlab.trainer.assemble)."""


@dataclass
class Hop:
    number: int
    depth: int
    path: str
    column: str
    """What the row names in its function column: one ``name()`` (``Class.method()`` for a method)."""

    @property
    def function(self) -> str | None:
        """The one function the hop names, or None if it names none or more than one."""
        match = FUNCTION.fullmatch(self.column)
        return match[1] if match else None


def trace(text: str) -> list[Hop]:
    """The numbered rows of the code block under "From `python -m shardlab.train` to `fully_shard`"."""
    section = text.split("## From `python -m shardlab.train` to `fully_shard`", 1)[1]
    block = section.split("```", 2)[1]
    hops = []
    for line in block.splitlines():
        if match := ROW.match(line):
            column = len(match[1]) + len(match[2])
            hops.append(Hop(int(match[1]), (column - PATH_COLUMN) / 2, match[3], match[4].strip()))
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
    """(line, name, the receiver's name or '') of every call in function ``name`` of ``path``, and of every function
    it hands to a call by name (as ``launch_local`` hands ``_spawned_entry`` to torch.multiprocessing), in source
    order. Only this function's own body: a function it calls that calls the next hop does not count."""
    out: list[tuple[int, int, str, str]] = []
    for node in ast.walk(definitions(path)[name]):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        if called:
            out.append((node.lineno, node.col_offset, called, getattr(getattr(func, "value", None), "id", "")))
        handed = [*node.args, *(k.value for k in node.keywords)]
        out += [(arg.lineno, arg.col_offset, arg.id, "") for arg in handed if isinstance(arg, ast.Name)]
    return [(line, called, receiver) for line, _, called, receiver in sorted(out)]


def reaches(caller: tuple[str, str], callee: str, after: int = 0) -> int | None:
    """The line in ``caller`` (path, function) where it calls ``callee`` after line ``after``. A method is called
    through a name that ends its class's name: ``trainer.setup()`` is Trainer.setup, ``backend.parallelize()`` is
    FullyShardedBackend.parallelize, and ``backend.setup()`` is not Trainer.setup."""
    cls, _, method = callee.rpartition(".")
    for line, called, receiver in calls(REPO / caller[0], caller[1]):
        if called == method and line > after and (not cls or (receiver and cls.lower().endswith(receiver.lower()))):
            return line
    return None


def hop_problems(hop: Hop) -> list[str]:
    """What is wrong with one row on its own: not one function, an indentation off the grid, a missing file or
    function."""
    if hop.function is None:
        named = FUNCTION.findall(hop.column)
        return [f"row {hop.number} names {len(named)} functions ({hop.column}); a hop is one function: one row each"]
    if hop.depth != int(hop.depth) or hop.depth < 0:
        return [f"row {hop.number}: its file is indented off the 2-space grid"]
    path = REPO / hop.path
    if not path.is_file():
        return [f"row {hop.number}: {hop.path} does not exist"]
    if hop.function not in definitions(path):
        return [f"row {hop.number}: {hop.path} defines no {hop.function}()"]
    return []


def trace_problems(text: str) -> list[str]:
    """What of the trace in ``text`` is not true of the code: a row that names other than one function, a file or
    function that does not exist, a hop not called by the one before it (a row by the row above it, an indented row
    by the row it is under, siblings in their order)."""
    hops = trace(text)
    problems = [p for hop in hops for p in hop_problems(hop)]
    if problems:
        return problems
    last_call: dict[int, int] = {}  # a parent hop's number -> the line of its call of its latest child
    for i, hop in enumerate(hops[1:], start=1):
        parent = next(h for h in reversed(hops[:i]) if h.depth < hop.depth or h.depth == hop.depth == 0)
        line = reaches((parent.path, parent.function), hop.function, after=last_call.get(parent.number, 0))
        if line is None:
            problems.append(
                f"row {hop.number}: {parent.function}() does not call {hop.function}() after the row before"
            )
        else:
            last_call[parent.number] = line
    return problems


def test_the_trace_is_true_of_the_code():
    hops = trace(DESIGN.read_text())
    assert [h.number for h in hops] == list(range(1, len(hops) + 1)), "docs/design.md: the trace's rows are numbered"
    assert ASSEMBLY[1] in [h.function for h in hops], "the trace goes through the assembly"
    assert trace_problems(DESIGN.read_text()) == []


def test_the_trace_counts_its_files_and_hops():
    text = DESIGN.read_text()
    hops = trace(text)
    claim = re.search(r"(\d+) files in (\d+) hops, one function each", text)
    assert claim, "docs/design.md says how many files and hops its trace has"
    assert (int(claim[1]), int(claim[2])) == (len({h.path for h in hops}), len(hops))


def test_the_readme_names_the_traces_files_in_its_order():
    paragraph = next(p for p in (REPO / "README.md").read_text().split("\n\n") if "to `fully_shard` is" in p)
    named = re.findall(r"`([\w/]+\.py)`", paragraph)
    in_trace = list(dict.fromkeys(h.path.removeprefix("shardlab/") for h in trace(DESIGN.read_text())))
    assert named == in_trace, f"README.md's architecture paragraph: {named}; the trace's files in order: {in_trace}"


def renumbered(lines: list[str]) -> str:
    """The trace's rows numbered 1, 2, ... again (after a row was dropped or moved), each number in its own width."""
    out, n = [], 0
    for line in lines:
        if match := ROW.match(line):
            n += 1
            column = len(match[1]) + len(match[2])
            line = f"{n}".ljust(column) + line[column:]
        out.append(line)
    return "\n".join(out)


def row_index(lines: list[str], function: str) -> int:
    return next(i for i, line in enumerate(lines) if (m := ROW.match(line)) and m[4].strip() == f"{function}()")


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        ("10    shardlab/memory/plan.py    ", "10    shardlab/memory/plans.py   ", "memory/plans.py does not exist"),
        ("FullyShardedBackend.parallelize()", "FullyShardedBackend.shard()     ", "no FullyShardedBackend.shard()"),
        ("trainer.py                        assemble()  ", "trainer.py                        Trainer.fit()",
         "row 10: Trainer.fit() does not call"),
        ("run_job()          ", "run_job() -> main()", "row 3 names 2 functions"),
        ("launch_local()     ", "[launch_local()]   ", "row 5 names 1 functions ([launch_local()])"),
    ],
)  # fmt: skip
def test_a_trace_that_is_not_true_is_caught(old, new, problem):
    text = DESIGN.read_text()
    assert old in text
    problems = trace_problems(text.replace(old, new))
    assert problems and problem in problems[0], problems


def test_hops_out_of_order_are_caught():
    """plan_run and Trainer.setup swapped: assemble calls setup only after plan_run."""
    lines = DESIGN.read_text().splitlines()
    plan = row_index(lines, "plan_run")
    lines[plan], lines[plan + 1] = lines[plan + 1], lines[plan]
    assert "assemble() does not call plan_run() after the row before" in trace_problems(renumbered(lines))[0]


@pytest.mark.parametrize(
    ("dropped", "problem"),
    [
        ("_run_rank", "run_rank() does not call assemble()"),  # run_rank reaches assemble only through _run_rank
        ("_spawned_entry", "launch_local() does not call run_rank()"),  # it hands on _spawned_entry, which calls it
    ],
)
def test_a_skipped_hop_is_caught(dropped, problem):
    lines = DESIGN.read_text().splitlines()
    del lines[row_index(lines, dropped)]
    problems = trace_problems(renumbered(lines))
    assert problems and problem in problems[0], problems


def test_the_readme_paragraph_in_another_order_is_caught(monkeypatch, tmp_path):
    readme = (REPO / "README.md").read_text()
    swapped = readme.replace("`memory/plan.py`", "`PLAN`").replace("`trainer.py`", "`memory/plan.py`", 1)
    (tmp_path / "README.md").write_text(swapped.replace("`PLAN`", "`trainer.py`"))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "design.md").write_text(DESIGN.read_text())
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    monkeypatch.setattr(f"{__name__}.DESIGN", tmp_path / "docs" / "design.md")
    with pytest.raises(AssertionError, match="architecture paragraph"):
        test_the_readme_names_the_traces_files_in_its_order()


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
    folders = ("shardlab", "shardlab_tasks", "shardlab_commands", "shardlab_bench", "tools", "tests", "hydra_plugins")
    for folder in (*folders, "examples"):
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
