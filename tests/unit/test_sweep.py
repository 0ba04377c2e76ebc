"""Sweep summaries from run directories: what each point is doing or how it ended."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from shardlab.jobs import run_record, sweep
from shardlab.jobs.preemption import StopSignals


def make_point(sweep_dir: Path, num: int, overrides: list[str], **status) -> Path:
    run_dir = sweep_dir / f"{num}_point"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text("\n".join(f"- {o}" for o in overrides))
    if status:
        run_record.start(run_dir, overrides, max_steps=10)
        run_record.update(run_dir, **status)
    return run_dir


def test_summary_lists_every_point_with_status_metrics_and_error(tmp_path, capsys):
    make_point(tmp_path, 0, ["lr=1", "model=a"], status="completed", step=10, final={"loss": 2.5, "ppl": 12.2})
    make_point(tmp_path, 1, ["lr=2", "model=a"], status="failed", step=0, error="model.num_heads (3) must divide")
    make_point(tmp_path, 2, ["lr=3", "model=a"], status="running", step=4)
    rows = sweep.summarize(tmp_path)
    assert [(r["status"], r["step"], r["final"].get("loss")) for r in rows] == [
        ("completed", 10, 2.5),
        ("failed", 0, None),
        ("running", 4, None),
    ]
    table = capsys.readouterr().out
    assert "common overrides: model=a" in table
    assert "job 1 (lr=2) failed: model.num_heads (3) must divide" in table
    assert json.loads((tmp_path / "summary.json").read_text()) == rows
    csv_lines = (tmp_path / "summary.csv").read_text().splitlines()
    assert csv_lines[0].startswith("job,overrides,status,step,wall_s,max_steps,loss,ppl,error") and len(csv_lines) == 4


def test_manifest_points_that_never_started_are_pending(tmp_path):
    run_dir = make_point(tmp_path, 0, ["lr=1"], status="completed", step=10)
    sweep.write_manifest(
        tmp_path,
        [
            {"num": 0, "job_id": "7_0", "overrides": ["lr=1"], "run_dir": str(run_dir)},
            {"num": 1, "job_id": "7_1", "overrides": ["lr=2"], "run_dir": str(tmp_path / "1_never")},
        ],
    )
    rows = sweep.collect(tmp_path)
    assert [(r["job"], r["overrides"], r["status"]) for r in rows] == [
        ("7_0", "lr=1", "completed"),
        ("7_1", "lr=2", "pending"),
    ]


def test_a_reader_never_sees_the_manifest_half_written(tmp_path):
    """The submitter rewrites sweep.json as it submits while a summary (or a waiting test) reads it: every read is
    the old manifest or the new one, never an empty or cut file (a Slurm test read it empty mid-write and failed)."""
    import threading

    jobs = [{"num": n, "overrides": [f"optimizer.lr={n}e-4"] * 20, "run_dir": f"/r/{n}"} for n in range(400)]
    sweep.write_manifest(tmp_path, jobs[:1])
    seen, errors, done = [], [], threading.Event()

    def read():
        while not done.is_set():
            try:
                seen.append(len(sweep.read_manifest(tmp_path / sweep.MANIFEST)))
            except Exception as error:  # the point: nothing is raised
                errors.append(error)

    reader = threading.Thread(target=read)
    reader.start()
    for k in range(2, 400, 4):
        sweep.write_manifest(tmp_path, jobs[:k])
    done.set()
    reader.join()
    assert not errors, errors[:3]
    assert seen and all(n >= 1 for n in seen)
    assert not [p for p in tmp_path.iterdir() if p.name != sweep.MANIFEST]  # no temp file left beside it


def test_summary_callback_exits_nonzero_only_when_a_point_did_not_finish(tmp_path):
    from omegaconf import OmegaConf

    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    make_point(tmp_path, 0, ["lr=1"], status="completed", step=10)
    sweep.SweepSummary().on_multirun_end(config)  # no exit
    make_point(tmp_path, 1, ["lr=2"], status="stopped", step=4)
    with pytest.raises(SystemExit) as exit_info:
        sweep.SweepSummary().on_multirun_end(config)
    assert exit_info.value.code == 1


def test_stop_signal_is_recorded_then_forwarded_to_the_previous_handler():
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        stop = StopSignals()
        stop.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.received == signal.SIGUSR1 and stop.name == "SIGUSR1" and seen == []
        stop.restore()
        stop.forward(speaks_for_job=True)
        assert seen == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize(
    "speaks_for_job, submitit, received, requeued",
    [
        (True, False, signal.SIGUSR2, True),  # rank 0 of a plain sbatch job, at the time-limit warning
        (False, False, signal.SIGUSR2, False),  # any other rank
        (True, True, signal.SIGUSR2, False),  # submitit requeues its own jobs (its handler gets the signal)
        (True, False, signal.SIGTERM, False),  # Slurm requeues (or cancels) by itself
    ],
)
def test_a_slurm_job_without_submitit_is_requeued_by_rank0_after_a_time_limit_warning(
    tmp_path, monkeypatch, speaks_for_job, submitit, received, requeued
):
    calls = tmp_path / "calls"
    fake = tmp_path / "scontrol"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    if submitit:
        monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    previous = {sig: signal.signal(sig, signal.SIG_DFL) for sig in (signal.SIGUSR2, signal.SIGTERM)}
    try:
        stop = StopSignals()
        stop.install()
        stop.received = received  # as if the signal had arrived
        stop.forward(speaks_for_job=speaks_for_job)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert (calls.read_text() if calls.exists() else "") == ("requeue 77\n" if requeued else "")


def test_rank0_reports_the_rank_that_failed_first_not_its_own_timeout_after_it(tmp_path, monkeypatch):
    """One task per rank (Slurm, torchrun): rank 1's error makes rank 0 fail in a collective; status.json, which the
    submitter and the sweep summary read, must name rank 1's error."""
    run_record.start(tmp_path, [], 10)
    run_record.note_rank_error(tmp_path, 1, "RuntimeError: injected fault on rank 1")
    recorded = run_record.fail_with_first_cause(tmp_path, "DistBackendError: timed out after 30 s", world_size=2)
    assert recorded.startswith("rank 1 failed first: RuntimeError: injected fault on rank 1 (rank 0: DistBackendError")
    assert run_record.read(tmp_path)["error"] == recorded
    run_record.note_rank_error(tmp_path, 2, "RuntimeError: Connection closed by peer")  # a consequence, later
    run_record.note_rank_error(tmp_path, 1, "RuntimeError: injected fault on rank 1")  # passing run_job: no new time
    assert run_record.first_rank_error(tmp_path, wait_s=0)["rank"] == 1
    alike = tmp_path / "alike"
    run_record.note_rank_error(alike, 1, "DataError: data.path: no such file")  # every rank failed alike
    assert run_record.fail_with_first_cause(alike, "DataError: data.path: no such file", world_size=2) == (
        "DataError: data.path: no such file"
    )
    # A note left by an earlier attempt (before this process started) is not this attempt's cause.
    monkeypatch.setattr(run_record, "PROCESS_STARTED", run_record.PROCESS_STARTED + 3600)
    assert run_record.fail_with_first_cause(tmp_path, "ValueError: bad", world_size=2, wait_s=0) == "ValueError: bad"
    assert run_record.fail_with_first_cause(tmp_path, "ValueError: alone", world_size=1) == "ValueError: alone"


def test_a_note_of_the_attempt_before_a_torchrun_restart_is_not_this_attempts_cause(tmp_path, monkeypatch):
    """torchrun restarts the workers within seconds of a failure: the last attempt's note is recent, but the rank that
    wrote it started long before this attempt's rank 0 did."""
    attempt_started = run_record.PROCESS_STARTED
    monkeypatch.setattr(run_record, "PROCESS_STARTED", attempt_started - 3600)  # trained an hour, then failed
    run_record.note_rank_error(tmp_path, 2, "RuntimeError: CUDA error (attempt 0)")
    monkeypatch.setattr(run_record, "PROCESS_STARTED", attempt_started)
    run_record.start(tmp_path, [], 10)
    run_record.note_rank_error(tmp_path, 3, "DataError: rank 3 could not read shard 17")
    recorded = run_record.fail_with_first_cause(tmp_path, "RuntimeError: connection closed", world_size=4, wait_s=0)
    assert recorded.startswith("rank 3 failed first: DataError: rank 3 could not read shard 17")


def test_a_rank_told_of_another_ranks_failure_leaves_no_note(tmp_path, monkeypatch, tiny_lm):
    """A rank's RankFailed is another rank's failure (a job refused a folder in use: its rank 0's), so it leaves no
    note where rank 0 would read it as a cause (there: the running job's folder). Its own errors still leave one."""
    from shardlab import runner
    from shardlab.errors import RankFailed

    for key, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(key, value)
    told = RankFailed("rank 0 failed before joining: runs/x is in use by job 7")
    for error, noted in ((told, False), (RuntimeError("injected on rank 1"), True)):

        def fail(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(runner, "build_task", fail)
        with pytest.raises(type(error)):
            runner.run_job(tiny_lm(), tmp_path / type(error).__name__, [])
        assert (tmp_path / type(error).__name__ / run_record.RANK_ERRORS / "rank1.json").exists() == noted


@pytest.mark.slow  # a 2-point sweep of dry runs: ~45 s on a busy 2-core machine
def test_a_sweep_points_record_is_the_one_hydra_writes_without_shardlabs_marker(tmp_path):
    """Each point's .hydra/ is written by shardlab once the point holds its folder (preflight.write_record_when_held),
    not by Hydra before it: the record holds the point's own config and overrides, and Hydra's settings as the user
    gave them (output_subdir .hydra, no marker override or variable)."""
    import subprocess
    import sys

    from omegaconf import OmegaConf

    from shardlab.cli.preflight import RECORD_AFTER_LOCK
    from tests.conftest import ROOT

    sweep_dir = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "shardlab.train", "-m", "dry_run=true", "optimizer.lr=0.1,0.2",
           f"hydra.sweep.dir={sweep_dir}", "hydra.sweep.subdir=p${hydra.job.num}"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Callback" not in done.stderr  # no callback failed (Hydra turns their errors into warnings)
    for num, lr in enumerate((0.1, 0.2)):
        record = sweep_dir / f"p{num}" / ".hydra"
        assert OmegaConf.load(record / "overrides.yaml") == ["dry_run=True", f"optimizer.lr={lr}"]  # Hydra's spelling
        assert OmegaConf.load(record / "config.yaml").optimizer.lr == lr
        hydra = OmegaConf.load(record / "hydra.yaml").hydra
        assert hydra.output_subdir == ".hydra"
        assert RECORD_AFTER_LOCK not in hydra.job.env_set
        assert not any("output_subdir" in o or RECORD_AFTER_LOCK in o for o in hydra.overrides.hydra)
        assert list(hydra.overrides.task) == ["dry_run=True", f"optimizer.lr={lr}"]
