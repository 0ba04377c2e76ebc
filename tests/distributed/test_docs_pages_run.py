"""Every command of README.md and docs/*.md, run as written (issue #51), page by page, in the order written, on tiny
stand-ins: the walk of tests/doc_walk.py (its docstring says what the harness changes: each training run shortened
to optimization.max_steps=1, said on each command's printed line; the docs' placeholder paths mapped to stand-ins by
its one table, PLACEHOLDERS; a shortened run's documented last step given as the step it reached). Each command must
exit 0, print no traceback and make what it says (a step folder and a final validation, a plan, a sweep's completed
points, an --out file or folder, a tool's text).

Which page runs where:

- the default suite: the planted broken commands (the walk's own checks);
- ``-m e2e`` (CI's pass after the default suite; under ~60 s of real runs): test_the_cheapest_commands_run, one walk
  over a handful of cheap lines (README's --help, a plan, configuration.md's EMA run and its export);
- ``-m slow``: test_every_command_of_the_page_runs, one test per page of PAGES, every command of the page;
- elsewhere: docs/finetuning.md and the README's fine-tuning section (tests/distributed/test_finetuning_commands.py),
  docs/tutorial.md (tests/distributed/test_tutorial.py), the lines that submit to Slurm (hydra/launcher=slurm,
  --slurm: tests/slurm/test_docs_slurm_commands.py, on the test cluster), docs/benchmarks.md (a benchmark takes
  minutes: its tools' options are checked against their --help by tests/unit/test_docs_commands.py).

A line marked ``# not checked: KIND`` is not run (tests/unit/test_docs_commands.py: NOT_CHECKED says why each kind
cannot run here); each walk prints the lines it skipped and why.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.conftest import ROOT
from tests.doc_walk import Walk, page_stand_ins
from tests.unit.test_docs_commands import MARK, line_commands, logical_lines

PAGES = [
    "README.md",
    "docs/configuration.md",
    "docs/memory-plan.md",
    "docs/models.md",
    "docs/tracking.md",
    "docs/checkpoints.md",
    "docs/corpora.md",
    "docs/distributed.md",
    "docs/sweeps-and-slurm.md",
    "docs/compile.md",
    "docs/vision.md",
]
"""The pages this test runs whole (tests/unit/test_docs_commands.py: RUN_AS_WRITTEN)."""
ELSEWHERE = {"## Fine-tuning open models": "tests/distributed/test_finetuning_commands.py"}
"""Sections of the pages run by another test."""
CHEAP = [
    ("README.md", "python -m shardlab.train --help"),
    ("docs/configuration.md", "python -m shardlab.train optimization.ema.enabled=true"),
    ("docs/configuration.md", "shardlab-export runs/lm/optimization.ema.decay=0.999"),
]
"""The default suite's lines, by page and the start of the line: ~45 s at load 8 on 2 cores (a training run, its
export, the CLI's help)."""


def on_slurm(line: str) -> bool:
    """A line that submits to Slurm: run on the test cluster by tests/slurm/test_docs_slurm_commands.py."""
    return any("hydra/launcher=slurm" in argv or "--slurm" in argv for argv in line_commands(line))  # not a comment


def page_lines(page: str) -> list[str]:
    """The page's command lines in order (blank and comment-only lines left out, sections ELSEWHERE too)."""
    lines = [line for line, _ in page_commands(page)]
    return lines


def page_commands(page: str) -> list[tuple[str, str | None]]:
    """(line, the error the docs show it ending with: a ``# error: ...`` line right below it, its first 60
    characters; else None) for each command line of the page, in order (sections ELSEWHERE left out)."""
    text = (ROOT / page).read_text()
    for heading in ELSEWHERE:
        if heading in text:
            start = text.index(heading)
            end = text.find("\n## ", start + 1)
            text = text[:start] + (text[end:] if end >= 0 else "")
    lines = [line.strip() for line in logical_lines(text) if line.strip()]
    found = []
    for i, line in enumerate(lines):
        if not line.startswith("#"):
            below = lines[i + 1] if i + 1 < len(lines) else ""
            found.append((line, below.removeprefix("# error: ")[:60] if below.startswith("# error: ") else None))
    return found


def skipped_why(line: str) -> str | None:
    """Why the walk does not run this line here (None: it runs it)."""
    if mark := MARK.search(line):
        return f"not checked: {mark.group(1)}"
    if on_slurm(line):
        return "Slurm: tests/slurm/test_docs_slurm_commands.py"
    return None


def new_walk(root) -> Walk:
    """A working folder outside the repository (tools/ linked; README.md, docs/, examples/ and tests/data copied:
    the commands name them from the repository's root) with its stand-ins, and a HOME of its own."""
    work, home = root / "work", root / "home"
    work.mkdir()
    home.mkdir()
    (work / "tools").symlink_to(ROOT / "tools")
    shutil.copytree(ROOT / "docs", work / "docs")
    shutil.copy(ROOT / "README.md", work / "README.md")
    shutil.copytree(ROOT / "examples", work / "examples")
    shutil.copytree(ROOT / "tests" / "data" / "llama3_1_8b", work / "tests" / "data" / "llama3_1_8b")
    page_stand_ins(root, home, work)
    env = {**os.environ, "HOME": str(home), "OMP_NUM_THREADS": "1"}
    return Walk(cwd=work, env=env)


def walk_page(walk: Walk, page: str, lines: list[tuple[str, str | None]]) -> list[str]:
    """Run ``lines`` of ``page`` (page_commands) in order, the quickstart first where the page reads its step folder;
    the skipped lines, printed with why."""
    if any("runs/lm/default/" in line or "CHECKPOINT" in line for line, _ in lines):
        walk.run("python -m shardlab.train")  # the quickstart: these commands read its step folder
    skipped = []
    for line, error in lines:
        if why := skipped_why(line):
            skipped.append(f"{line.split('#')[0].strip()}   [{why}]")
        else:
            try:
                walk.run(line, error)
            except AssertionError as e:
                print(f"FAILED: {line}\n{e}", flush=True)  # at once, in -s output (pytest's report comes at the end)
                raise
    print(f"{page}: {len(lines) - len(skipped)} lines run, {len(skipped)} not here:", *skipped, sep="\n  ")
    return skipped


# slow: 0.5-22 min a page on 2 cores at load 3-9, two walks at once (2026-12-05: vision.md 22, 8.6 walked alone;
# memory-plan.md 10, README 8, sweeps-and-slurm.md 7; all 11 pages 63 min); -s prints each command's time
@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_every_command_of_the_page_runs(page, tmp_path, monkeypatch):
    walk = new_walk(tmp_path)
    monkeypatch.setenv("HOME", walk.env["HOME"])  # $HOME in the docs, expanded as the shell would (line_commands)
    skipped = walk_page(walk, page, page_commands(page))
    assert len(skipped) < len(page_lines(page)), skipped  # the page's other lines ran


def cheap_lines() -> list[tuple[str, str]]:
    found = [(page, line) for page, start in CHEAP for line in page_lines(page) if line.startswith(start)]
    assert len(found) == len(CHEAP), found  # each still on its page
    return found


@pytest.mark.e2e  # the docs' commands as written: CI runs it after the suite (tests/conftest.py)
def test_the_cheapest_commands_run(tmp_path, monkeypatch):
    """The end-to-end pass's share: a few lines, one walk (the slow set runs every page)."""
    walk = new_walk(tmp_path)
    monkeypatch.setenv("HOME", walk.env["HOME"])
    for page, line in cheap_lines():
        assert not walk_page(walk, page, [(line, None)])


def test_a_planted_broken_command_fails_the_walk(tmp_path):
    """A documented line rewritten wrongly (a misspelt key), a command that exits non-zero, and one that exits 0
    after a traceback: each fails the walk."""
    walk = Walk(cwd=tmp_path, env={**os.environ, "HOME": str(tmp_path)})
    (_, train), *_ = [(p, line) for p, line in cheap_lines() if "ema.enabled=true" in line]
    with pytest.raises(AssertionError, match="exit 2"):
        walk.run(train.replace("optimization.ema.decay=", "optimization.emma.decay="))
    with pytest.raises(AssertionError, match="exit 3"):
        walk.run("python -c 'import sys; sys.exit(3)'")
    with pytest.raises(AssertionError, match="Traceback"):
        walk.run("python -c 'print(1)' && python -c 'print(\"Traceback (most recent call last):\")'")
    walk.run("python -c 'print(1)'")  # and a sound one passes


def test_a_walk_fails_a_documented_error_that_does_not_come_and_a_run_that_trained_nothing(tmp_path):
    """A line the docs show failing (``# error: ...`` below it) that exits 0, or fails with another error; a training
    command that exits 0 saying its run is complete when this walk never trained that run (issue #51: nothing exits 0
    having done nothing). No spawn of a training run: the walk's checks on what the commands printed."""
    walk = Walk(cwd=tmp_path, env={**os.environ, "HOME": str(tmp_path)})
    with pytest.raises(AssertionError):
        walk.run("python -c 'print(1)'", error="error: data.path")
    with pytest.raises(AssertionError, match="not the documented error"):
        walk.run("python -c 'import sys; sys.exit(\"error: something else\")'", error="error: data.path")
    walk.run("python -c 'import sys; sys.exit(\"error: data.path: no such folder\")'", error="error: data.path")
    complete = "run complete: runs/lm/default has reached optimization.max_steps=300 (its step_00000300); ...\n"
    proc = subprocess.CompletedProcess([], 0, complete, "")
    with pytest.raises(AssertionError, match="complete before this walk trained it"):
        walk.check_result(["python", "-m", "shardlab.train"], proc, set())
    walk.trained.add("runs/lm/default")
    walk.check_result(["python", "-m", "shardlab.train"], proc, set())  # the walk's own run, started again


def test_a_marked_or_slurm_line_is_skipped_and_says_why():
    assert skipped_why("pip install -e .   # not checked: install") == "not checked: install"
    assert "tests/slurm" in skipped_why("python -m shardlab.train -m hydra/launcher=slurm hydra.launcher.nodes=2")
    assert skipped_why("python -m shardlab.train seed=2   # a seed") is None
    assert skipped_why("python -m shardlab.train -m seed=1,2   # hydra/launcher=slurm: on Slurm") is None
    assert all((ROOT / page).is_file() for page in PAGES)
