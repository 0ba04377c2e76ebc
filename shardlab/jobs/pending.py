"""Slurm jobs that wait for something that will not come: a job pending for more nodes than its partition has, or
longer than it allows, waits for ever, and the submitter's terminal with it. The waiting submitter asks squeue for
its pending jobs' reasons at each poll (shardlab.jobs.submitit_launcher), says in one line which launcher key to
change, and cancels a job whose wait cannot end.

Slurm's reasons (squeue's %r) that never pass by themselves, what the job asked, and the key that changes it:
PartitionNodeLimit and ``Resources`` with more nodes than the partition holds (hydra.launcher.partition or
hydra.launcher.nodes), PartitionTimeLimit (hydra.launcher.timeout_min), ReqNodeNotAvail (the nodes it needs are down,
drained or reserved: reported, not cancelled, since an administrator may bring them back).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass

Command = Callable[[list[str]], str]
"""Runs a Slurm command and returns its standard output ('' when it fails): squeue and sinfo, or a test's stand-in."""


def run_command(args: list[str]) -> str:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout if done.returncode == 0 else ""


@dataclass(frozen=True)
class PendingJob:
    """One pending array task as squeue shows it."""

    job_id: str
    reason: str
    nodes: int
    partition: str
    time_limit: str


def pending_jobs(base_ids: Iterable[str], command: Command = run_command) -> dict[str, PendingJob]:
    """The pending tasks of these jobs (array ids as submitit names them, ``123_0``), by id."""
    ids = ",".join(dict.fromkeys(base_ids))
    out = command(["squeue", "-h", "-r", "-t", "PD", "-j", ids, "-o", "%i|%r|%D|%P|%l"]) if ids else ""
    found = {}
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 5 and parts[2].isdigit():
            found[parts[0]] = PendingJob(parts[0], parts[1], int(parts[2]), parts[3], parts[4])
    return found


def partition_sizes(command: Command = run_command) -> dict[str, int]:
    """Nodes per partition (sinfo prints one line per partition and node state, and marks the default one with '*',
    which squeue does not)."""
    sizes: dict[str, int] = {}
    for line in command(["sinfo", "-h", "-o", "%P|%D"]).splitlines():
        name, _, count = line.strip().partition("|")
        if count.isdigit():
            sizes[name.rstrip("*")] = sizes.get(name.rstrip("*"), 0) + int(count)
    return sizes


def why_it_cannot_start(job: PendingJob, sizes: dict[str, int]) -> tuple[str, bool] | None:
    """(one line naming the key to change, whether the wait can never end) for a job whose reason will not pass by
    itself; None for a job that only waits its turn (Priority, Resources within its partition, ...)."""
    has = sizes.get(job.partition)
    others = [f"{name} ({count} node{'s' * (count != 1)})" for name, count in sorted(sizes.items())]
    partitions = f"; partitions: {', '.join(others)}" if others else ""
    if job.reason == "PartitionNodeLimit" or (job.reason == "Resources" and has is not None and job.nodes > has):
        held = f"has {has} node{'s' * (has != 1)}" if has is not None else "does not allow that many"
        return (
            f"asks for {job.nodes} nodes and partition {job.partition} {held} ({job.reason}): set "
            f"hydra.launcher.partition to a partition with {job.nodes} nodes, or lower hydra.launcher.nodes"
            f"{partitions}"
        ), True
    if job.reason == "PartitionTimeLimit":
        return (
            f"asks for a time limit ({job.time_limit}) longer than partition {job.partition} allows "
            "(PartitionTimeLimit): lower hydra.launcher.timeout_min, or set hydra.launcher.partition to another"
        ), True
    if job.reason.startswith("ReqNodeNotAvail"):
        return (
            f"waits for nodes of partition {job.partition} that are down, drained or reserved ({job.reason}): it "
            f"starts when they come back; set hydra.launcher.partition to another to run elsewhere{partitions}"
        ), False
    return None
