"""docs/finetuning.md and the README's fine-tuning lines, run as written (issues #48 and #51): every command of their
```bash blocks, in the order written, split as the shell splits it (tests/unit/test_docs_commands.py: $HOME expanded,
comments dropped), from a working folder outside the repository whose HOME holds tiny stand-ins at the documented
paths: Hugging Face folders made by transformers (hidden 32, 2 layers) with a byte-level tokenizer and a chat template,
a text corpus, chat records and preference pairs. First the quickstart's ``python -m shardlab.train``, whose step
folder the docs start from, and the README's everyday tools that read that folder (generate, consolidate).

The changes: each training run is shortened to STEPS steps by an appended ``optimization.max_steps=STEPS`` (a key that
does not name the run, so it trains in the folder the command names) and validates one batch, and a later command naming
that run's last step (``step_00000300`` for the LM's 300 steps) is given the run's last step, ``step_0000000{STEPS}``;
any other step folder it names stays as written and must exist. Each command must exit 0 and make what it says: a
training run its step folder and final validation, a dry run its plan, an export its folder, a tool its text or file,
the inline Python its load. The walk, its stand-ins and what it changes: tests/doc_walk.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.doc_walk import STEPS, Walk, stand_ins
from tests.unit.test_docs_commands import line_commands, logical_lines

README_SECTION = "## Fine-tuning open models"
EVERYDAY_TOOLS = ("shardlab-generate", "shardlab-consolidate")
"""The README's everyday tools that read the quickstart's step folder: run straight after it (issue #51). Its
shardlab-evaluate lines read the SwAV run's step or download lm-eval's task: not run here."""


def section(markdown: str, heading: str) -> str:
    """The text from ``heading`` to the next section."""
    text = markdown[markdown.index(heading) :]
    end = text.find("\n## ", 1)
    return text if end < 0 else text[:end]


def fine_tuning_lines(readme: str, finetuning: str) -> list[str]:
    """The command lines of the README's fine-tuning section, then of docs/finetuning.md, in order (blank and
    comment-only lines left out)."""
    lines = logical_lines(section(readme, README_SECTION)) + logical_lines(finetuning)
    return [line for line in lines if line.strip() and not line.strip().startswith("#")]


def everyday_tool_lines(readme: str) -> list[str]:
    """The README's everyday commands that read the quickstart's step folder with a tool of EVERYDAY_TOOLS (not
    ``--lm-eval``, which downloads its task)."""
    lines = logical_lines(section(readme, "## Everyday commands"))
    reads = [line for line in lines if any(line.startswith(f"{t} runs/lm/default/") for t in EVERYDAY_TOOLS)]
    return [line for line in reads if "--lm-eval" not in line]


@pytest.fixture(scope="module")
def walk(tmp_path_factory) -> Walk:
    """A working folder outside the repository (tools/ linked, tests/data copied: the commands name them as paths
    from the repository's root) and its HOME of stand-ins."""
    root = tmp_path_factory.mktemp("finetuning")
    (root / "work").mkdir()
    (root / "work" / "tools").symlink_to(ROOT / "tools")
    shutil.copytree(ROOT / "tests" / "data" / "llama3_1_8b", root / "work" / "tests" / "data" / "llama3_1_8b")
    stand_ins(root / "home")
    env = {**os.environ, "HOME": str(root / "home"), "OMP_NUM_THREADS": "1"}
    return Walk(cwd=root / "work", env=env)


@pytest.mark.slow  # 18 commands, 3 of them starting 8 ranks: ~10 min on a busy 2-core machine (-s prints each time)
def test_every_fine_tuning_command_runs_as_written(walk, monkeypatch):
    monkeypatch.setenv("HOME", walk.env["HOME"])  # $HOME in the docs, expanded as the shell would (line_commands)
    walk.run("python -m shardlab.train")  # the quickstart: the docs start from its step folder
    readme = (ROOT / "README.md").read_text()
    everyday = [command for line in everyday_tool_lines(readme) for command in walk.run(line)]
    assert {argv[0] for argv, _ in everyday} == set(EVERYDAY_TOOLS)
    lines = fine_tuning_lines(readme, (ROOT / "docs" / "finetuning.md").read_text())
    ran = [command for line in lines for command in walk.run(line)]
    assert len(ran) >= 15


# ---- the walk itself, on planted lines (no training) -----------------------------------------------------------------
def test_the_lines_are_the_readme_section_then_the_page_in_order():
    readme = (
        "# x\n```bash\npython -m shardlab.train seed=1\n```\n" + README_SECTION + "\n\n```bash\n"
        "# a comment line\npython -m shardlab.train seed=2 \\\n    seed=3   # trailing\n```\n## Next\n"
        "```bash\npython -m shardlab.train seed=4\n```\n"
    )
    page = "Text.\n\n```bash\nshardlab-export a --out b\n```\n"
    assert fine_tuning_lines(readme, page) == [
        "python -m shardlab.train seed=2      seed=3   # trailing",
        "shardlab-export a --out b",
    ]


def test_the_everyday_tools_read_the_quickstarts_step():
    later = "## Next\n```bash\nshardlab-evaluate runs/lm/default/checkpoints/step_00000300\n```\n"
    readme = "## Everyday commands\n```bash\n" + "\n".join(
        ["shardlab-generate runs/lm/default/checkpoints/step_00000300 --prompt x",
         "shardlab-evaluate runs/swav/default/checkpoints/step_00000540",
         "shardlab-evaluate runs/lm/default/checkpoints/step_00000300 --lm-eval hellaswag",
         "shardlab-consolidate runs/lm/default/checkpoints/step_00000300 --out m.safetensors"]
    ) + "\n```\n" + later  # fmt: skip
    assert [line.split()[0] for line in everyday_tool_lines(readme)] == ["shardlab-generate", "shardlab-consolidate"]


def test_a_planted_broken_command_fails_the_walk(tmp_path):
    walk = Walk(cwd=tmp_path, env={**os.environ, "HOME": str(tmp_path)})
    walk.run("python -c 'print(1)'   # fine")
    with pytest.raises(AssertionError, match="exit 3"):
        walk.run("python -c 'import sys; sys.exit(3)'")
    with pytest.raises(AssertionError, match="exit 2"):  # a key misspelt: refused before training
        walk.run("python -m shardlab.train optimizer.lrr=1e-3")


def test_only_a_shortened_runs_documented_last_step_is_given_the_step_it_reached(tmp_path):
    walk = Walk(cwd=tmp_path, env={})
    walk.last_step["runs/lm/lora/checkpoints/step_00000300"] = f"runs/lm/lora/checkpoints/step_{STEPS:08d}"
    line = "shardlab-export runs/lm/lora/checkpoints/step_00000300 --out m"
    assert walk.argv(line_commands(line)[0]) == [
        sys.executable,
        "-m",
        "shardlab_commands.export_hf",
        f"runs/lm/lora/checkpoints/step_{STEPS:08d}",
        "--out",
        "m",
    ]
    for other in ("runs/lm/lora/checkpoints/step_00001000", "runs/lm/default/checkpoints/step_00000300"):
        assert walk.argv(["shardlab-export", other])[3] == other  # stays, and must exist
    train = walk.argv(["python", "-m", "shardlab.train", "task=sft"])
    plan = walk.argv(["python", "-m", "shardlab.train", "dry_run=true"])
    assert f"optimization.max_steps={STEPS}" in train and plan[-1] == "dry_run=true"


def test_a_run_that_trained_nothing_fails_the_walk(tmp_path):
    """A start that finds its run complete exits 0 and makes no step folder: the walk says it did nothing."""
    walk = Walk(cwd=tmp_path, env={})
    done = subprocess.CompletedProcess([], 0, stdout="the run in runs/lm/default is complete at step 300\n")
    with pytest.raises(AssertionError):
        walk.check_result(["python", "-m", "shardlab.train"], done, set())
    quiet = subprocess.CompletedProcess([], 0, stdout="")
    for tool in (["shardlab-export", "x", "--out", "nothing"], ["shardlab-generate", "x", "--prompt", "def "],
                 ["shardlab-consolidate", "x", "--out", "m.safetensors"]):  # fmt: skip
        with pytest.raises(AssertionError):
            walk.check_result(tool, quiet, set())
