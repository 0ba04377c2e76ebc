"""docs/tutorial.md, run as written: every command of its bash blocks, in order, from a directory outside the
repository holding a copy of examples/ (tests/conftest.py: research_root). The tutorial's multirun trains both
plug-ins of examples/my_research sharded on 2 ranks: each point must reproduce its one-process run of the tutorial."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardlab_commands import COMMANDS
from tests.conftest import ROOT
from tests.events import scalars

DOC = ROOT / "docs" / "tutorial.md"


def tutorial_commands() -> list[str]:
    """The commands of the tutorial's ```bash blocks, in order."""
    blocks = re.findall(r"^```bash\n(.*?)^```", DOC.read_text(), flags=re.MULTILINE | re.DOTALL)
    lines = (line.strip() for block in blocks for line in block.replace("\\\n", " ").splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def on_slurm(command: str) -> bool:
    return "hydra/launcher=slurm" in command


def is_multirun(command: str) -> bool:
    return "-m" in shlex.split(command)[3:]  # after `python -m shardlab.train`


def run_command(command: str, cwd: Path, env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess:
    """A tutorial command as a user runs it, with this interpreter as ``python`` (a shardlab-<name> command as its
    module, whose ``cli`` the installed script calls)."""
    args = shlex.split(command)
    assert args[0] == "python" or args[0] in COMMANDS, (
        f"the tutorial's commands start with python or a command: {command}"
    )
    env = {**env, "OMP_NUM_THREADS": "1", "HOME": str(cwd / "home")}
    cmd = (
        [sys.executable, *args[1:]]
        if args[0] == "python"
        else [sys.executable, "-m", f"shardlab_commands.{COMMANDS[args[0]]}", *args[1:]]
    )
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def run_dir(research_root: Path, task: str) -> Path:
    """The directory of the tutorial's one-process run of ``task`` (named by its overrides)."""
    return research_root / "runs" / task / "user_dir=my_research"


def assert_same_curve(got: Path, expected: Path) -> None:
    """Every logged train and validation loss of the run in ``got`` equals the one in ``expected`` (rtol=1e-5)."""
    for tag in ("train/loss", "valid/loss"):
        a, b = scalars(got, tag), scalars(expected, tag)
        assert [s for s, _ in a] == [s for s, _ in b] and a, (tag, a, b)
        torch.testing.assert_close(
            torch.tensor([v for _, v in a], dtype=torch.float64),
            torch.tensor([v for _, v in b], dtype=torch.float64),
            rtol=1e-5,
            atol=0,
        )


@pytest.fixture(scope="module")
def earlier_sweeps(research_root) -> set[Path]:
    """Sweep summaries already in the shared research folder (the Slurm tutorial test's, run first on this worker)."""
    return set(research_root.glob("multirun/*/*/summary.json"))


@pytest.fixture(scope="module")
def ran(research_root, earlier_sweeps) -> dict[str, subprocess.CompletedProcess]:
    local = [c for c in tutorial_commands() if not on_slurm(c)]
    return {command: run_command(command, research_root, dict(os.environ)) for command in local}


def test_the_tutorial_shows_what_it_promises():
    commands = tutorial_commands()
    assert len(commands) >= 6 and all(c.startswith(("python ", "shardlab-")) for c in commands)
    assert any("user_dir=examples/my_research" in c and is_multirun(c) and "world_size=2" in c for c in commands)
    assert any("dry_run=true" in c for c in commands) and sum(on_slurm(c) for c in commands) == 1


@pytest.mark.e2e  # the tutorial's commands as written: CI runs it after the suite (tests/conftest.py)
def test_every_command_of_the_tutorial_runs(ran):
    for command, proc in ran.items():
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        if "--help" in command:
            model_line = next(line for line in proc.stdout.splitlines() if line.startswith("model: "))
            assert "gated_conv_tiny" in model_line and "spiral_mlp" in model_line
        elif "dry_run=true" in command:
            assert "FSDP units (8 + root)" in proc.stdout and "nothing allocated" in proc.stdout
        elif "shardlab-generate" in command:
            assert len(proc.stdout.strip()) > 0
        elif not is_multirun(command):
            assert "final validation: loss" in proc.stdout, proc.stdout[-2000:]
    spirals = ran["python -m shardlab.train user_dir=examples/my_research task=spirals"].stdout
    assert re.search(r"^\[valid\] step 100 \| loss \S+ \| accuracy 0\.9\d* \|", spirals, flags=re.MULTILINE), spirals


@pytest.mark.e2e  # the tutorial's commands as written: CI runs it after the suite (tests/conftest.py)
def test_the_sweep_trains_both_plugins_sharded_on_two_ranks_as_one_process_does(ran, research_root, earlier_sweeps):
    (sweep,) = [c for c in ran if is_multirun(c)]
    assert ran[sweep].returncode == 0, ran[sweep].stderr[-3000:]
    assert ran[sweep].stdout.count("backend fully_sharded: world size 2 (local)") == 2
    (summary,) = set(research_root.glob("multirun/*/*/summary.json")) - earlier_sweeps
    rows = json.loads(summary.read_text())
    tasks = [next(o.split("=")[1] for o in r["overrides"].split() if o.startswith("task=")) for r in rows]
    assert tasks == ["gated_conv_lm", "spirals"] and all(r["status"] == "completed" for r in rows)
    for task, row in zip(tasks, rows, strict=True):
        assert_same_curve(Path(row["run_dir"]), run_dir(research_root, task))
