"""A Slurm submission that cannot start says why: the waiting submitter reads squeue's reasons at each poll, names
the launcher key to change in one line, and cancels a job whose wait can never end (shardlab.jobs.pending). squeue
and sinfo are stand-ins here: their output as the test cluster prints it (partition debug: 1 node, multi: 2)."""

from __future__ import annotations

import logging
import math

import pytest

from shardlab.jobs import pending, run_record
from shardlab.jobs.pending import PendingJob, why_it_cannot_start
from shardlab.jobs.submitit_launcher import _follow

SIZES = {"debug": 1, "multi": 2}  # partition_sizes of SINFO
SINFO = "debug*|1\nmulti|1\nmulti|1\n"  # multi's two nodes in two states: one line each


def squeue_and_sinfo(squeue: str):
    asked = []

    def command(args: list[str]) -> str:
        asked.append(args)
        return squeue if args[0] == "squeue" else SINFO

    return command, asked


def test_partition_sizes_add_up_the_lines_of_each_partition():
    command, _ = squeue_and_sinfo("")
    assert pending.partition_sizes(command) == {"debug": 1, "multi": 2}  # the default's * dropped, as squeue


@pytest.mark.parametrize(
    ("job", "expected", "never"),
    [
        (
            PendingJob("7_0", "PartitionNodeLimit", 2, "multi", "1:00:00"),
            "asks for 2 nodes and partition multi has 2 nodes (PartitionNodeLimit): set hydra.launcher.partition to a "
            "partition with 2 nodes, or lower hydra.launcher.nodes; partitions: debug (1 node), multi (2 nodes)",
            True,
        ),
        (
            PendingJob("7_0", "PartitionNodeLimit", 2, "gpu", "1:00:00"),
            "asks for 2 nodes and partition gpu does not allow that many (PartitionNodeLimit): set "
            "hydra.launcher.partition to a partition with 2 nodes, or lower hydra.launcher.nodes; partitions: debug "
            "(1 node), multi (2 nodes)",
            True,
        ),
        (
            PendingJob("7_1", "Resources", 3, "multi", "1:00:00"),
            "asks for 3 nodes and partition multi has 2 nodes (Resources): set hydra.launcher.partition to a partition "
            "with 3 nodes, or lower hydra.launcher.nodes; partitions: debug (1 node), multi (2 nodes)",
            True,
        ),
        (
            PendingJob("7_0", "PartitionTimeLimit", 1, "multi", "2-00:00:00"),
            "asks for a time limit (2-00:00:00) longer than partition multi allows (PartitionTimeLimit): lower "
            "hydra.launcher.timeout_min, or set hydra.launcher.partition to another",
            True,
        ),
        (
            PendingJob("7_0", "ReqNodeNotAvail, UnavailableNodes:shl-n2", 2, "multi", "1:00:00"),
            "waits for nodes of partition multi that are down, drained or reserved (ReqNodeNotAvail, "
            "UnavailableNodes:shl-n2): it starts when they come back; set hydra.launcher.partition to another to run "
            "elsewhere; partitions: debug (1 node), multi (2 nodes)",
            False,
        ),
    ],
)
def test_a_reason_that_will_not_pass_names_the_key_to_change(job, expected, never):
    assert why_it_cannot_start(job, SIZES) == (expected, never)


@pytest.mark.parametrize("reason", ["Priority", "Resources", "None", "BeginTime", "Dependency"])
def test_a_job_that_only_waits_its_turn_is_left_alone(reason):
    assert why_it_cannot_start(PendingJob("7_0", reason, 2, "multi", "1:00:00"), SIZES) is None


class FakeJob:
    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.cancelled = False

    def done(self) -> bool:
        return False  # a pending job: only the submitter's own cancel ends its wait here

    def cancel(self, check: bool = True) -> None:
        self.cancelled = True


def test_the_waiting_submitter_cancels_a_job_that_cannot_start_and_says_why_in_one_line(tmp_path, monkeypatch, caplog):
    """The README's multi-node line without hydra.launcher.partition=multi: the default partition has 1 node."""
    command, asked = squeue_and_sinfo("41_0|PartitionNodeLimit|2|debug|1:00:00\n41_1|Priority|1|debug|1:00:00\n")
    monkeypatch.setattr(pending, "run_command", command)
    jobs = [FakeJob("41_0")]
    entries = [{"num": 0, "job_id": "41_0", "overrides": [], "run_dir": str(tmp_path / "0"), "log": "x.out"}]
    with caplog.at_level(logging.INFO, logger="shardlab.jobs.submitit_launcher"):
        (ret,) = _follow(jobs, entries, poll_s=0.01, ask_slurm=True)
    assert jobs[0].cancelled and math.isnan(ret.return_value)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("#0 job 41_0 cannot start, cancelled: it asks for 2 nodes and partition debug has 1 node ")
    assert "set hydra.launcher.partition to a partition with 2 nodes" in line and "\n" not in line
    status = run_record.read(tmp_path / "0")
    assert status["status"] == "failed" and status["error"].startswith("cannot start: it asks for 2 nodes")
    assert asked[0] == ["squeue", "-h", "-r", "-t", "PD", "-j", "41", "-o", "%i|%r|%D|%P|%l"]


def test_a_local_sweep_never_asks_slurm(tmp_path, monkeypatch):
    monkeypatch.setattr(pending, "run_command", lambda args: pytest.fail(f"asked {args}"))

    class Done(FakeJob):
        def done(self) -> bool:
            return True

        def results(self):
            return [1.5]

    entries = [{"num": 0, "job_id": "1", "overrides": [], "run_dir": str(tmp_path), "log": "x.out"}]
    (ret,) = _follow([Done("1")], entries, poll_s=0.01)
    assert ret.return_value == 1.5
