"""What a benchmark figure was measured with, recorded as ``"meta"`` in the JSON beside it: shardlab_commands'
provenance (commit and the code files that differed from it, date, machine, torch and Python, load average, settings),
with the command as the runner takes it (``python -m shardlab_bench NAME ...``) and ``argv`` as the benchmark's name
and its arguments, which shardlab_bench.tables reruns and prints under each table."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from shardlab_commands import provenance as common

__all__ = ["collect", "finish", "runner_command"]

finish = common.finish


def runner_command(argv: list[str]) -> str:
    """The command line that reruns a benchmark recorded as ``argv`` (its name, then its arguments)."""
    return shlex.join(["python", "-m", "shardlab_bench", *argv])


def collect(tool_file: str, argv: list[str] | None = None, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """The metadata of a run of the benchmark whose module is ``tool_file`` (its ``__file__``) with command-line
    ``argv`` (default: this process's) and its resolved ``settings``, taken when the run starts."""
    meta = common.collect(tool_file, argv, settings)
    meta["argv"] = [Path(tool_file).stem, *meta["argv"][1:]]
    meta["command"] = runner_command(meta["argv"])
    return meta
