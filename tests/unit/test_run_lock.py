"""One run directory, one writer: a second job is refused in one line naming the first; a lock whose holder is gone
(its process ended, its node stopped beating, or it was this job before a requeue) is taken over."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardlab.errors import RunFolderInUse
from shardlab.jobs import run_lock, run_record
from shardlab.jobs.run_lock import LOCK_FILE, RunLock
from tests.conftest import TINY_LM

ROOT = Path(__file__).resolve().parents[2]


def write_holder(run_dir: Path, **fields) -> None:
    holder = {"job": None, "host": socket.gethostname(), "pid": 1, "pid_start": None, "token": "other",
              "heartbeat": time.time(), **fields}  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK_FILE).write_text(json.dumps(holder))


@pytest.fixture
def other_process():
    """A live process on this host that is not us (the holder of someone else's lock)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_live_holder_keeps_a_second_job_out_naming_it(tmp_path, other_process, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "222")
    write_holder(tmp_path, job="111", pid=other_process.pid, pid_start=run_lock._process_start(other_process.pid))
    with pytest.raises(RunFolderInUse) as e:
        RunLock(tmp_path).acquire()
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"{tmp_path} is in use by job 111 (host {socket.gethostname()}, pid {other_process.pid}")


def test_a_lock_whose_process_ended_is_taken_over(tmp_path, other_process):
    pid, started = other_process.pid, run_lock._process_start(other_process.pid)
    other_process.kill()
    other_process.wait()
    write_holder(tmp_path, pid=pid, pid_start=started)
    lock = RunLock(tmp_path)
    lock.acquire()
    assert lock.held()
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_reused_pid_does_not_keep_a_dead_holders_lock(tmp_path, other_process):
    write_holder(tmp_path, pid=other_process.pid, pid_start="1")  # that pid, but a process started at another time
    lock = RunLock(tmp_path)
    lock.acquire()
    lock.release()


def test_another_nodes_lock_is_taken_over_only_after_its_heartbeat_stops(tmp_path, monkeypatch):
    write_holder(tmp_path, host="node-that-died", pid=4242, heartbeat=time.time() - 10)
    with pytest.raises(RunFolderInUse, match="host node-that-died, pid 4242, last heartbeat 10 s ago"):
        RunLock(tmp_path).acquire()
    write_holder(tmp_path, host="node-that-died", pid=4242, heartbeat=time.time() - run_lock.LEASE_S - 1)
    lock = RunLock(tmp_path)
    lock.acquire()
    lock.release()


def test_a_requeued_job_takes_over_its_own_lock_from_another_node(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    write_holder(tmp_path, job="4242", host="the-node-before-the-requeue", pid=77)
    lock = RunLock(tmp_path)
    lock.acquire()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["host"] == socket.gethostname()
    lock.release()


def test_the_heartbeat_keeps_the_lock_fresh(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    lock = RunLock(tmp_path)
    lock.acquire()
    first = json.loads((tmp_path / LOCK_FILE).read_text())["heartbeat"]
    time.sleep(0.5)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["heartbeat"] > first
    lock.release()


TWO_JOBS_AT_ONCE = """
import json, multiprocessing as mp, subprocess, sys, time
from pathlib import Path
from shardlab.errors import RunFolderInUse
from shardlab.jobs import run_lock

def job(root, barrier, held, who, stale):
    run_lock.HEARTBEAT_S = 3600
    judge = run_lock.RunLock._live_holder

    def slow_judge(self, holder):  # the second job acts up to 90 ms after judging (a loaded node, a slow NFS)
        verdict = judge(self, holder)
        time.sleep(0.03 * (i % 4))
        return verdict

    if stale and who == 1:
        run_lock.RunLock._live_holder = slow_judge
    for i in range(FOLDERS):
        barrier.wait()
        try:
            run_lock.RunLock(Path(root) / f"run{i}").acquire()
            held[(who, i)] = True
        except RunFolderInUse:
            held[(who, i)] = False
    barrier.wait()  # neither exits while the other may still read its lock: a dead holder's lock is rightly stale

if __name__ == "__main__":
    root, stale = sys.argv[1], sys.argv[2] == "stale"
    FOLDERS = 100 if stale else 300
    if stale:  # every folder holds the lock of a job that died
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        for i in range(FOLDERS):
            (Path(root) / f"run{i}").mkdir()
            (Path(root) / f"run{i}" / run_lock.LOCK_FILE).write_text(json.dumps(
                {"job": None, "host": run_lock.socket.gethostname(), "pid": dead.pid, "token": "dead"}))
    ctx = mp.get_context("fork")
    barrier, held = ctx.Barrier(2), ctx.Manager().dict()
    jobs = [ctx.Process(target=job, args=(root, barrier, held, who, stale)) for who in (0, 1)]
    [j.start() for j in jobs]
    [j.join() for j in jobs]
    both = sum(held[(0, i)] and held[(1, i)] for i in range(FOLDERS))
    print(both, sum(held[(0, i)] or held[(1, i)] for i in range(FOLDERS)), FOLDERS)
"""


@pytest.mark.parametrize("folders", ["new", "stale"])
def test_two_jobs_starting_in_one_folder_at_once_never_both_hold_it(tmp_path, folders):
    """Two jobs' rank 0 take the lock of many run directories at the same moments, new ones or ones whose holder
    died. A lock created empty and written after was read empty by the other job, taken for stale and held by both
    (8-13 of 300 new folders here); a stale lock was taken over by writing ours onto it and reading it back 50 ms
    later, so a job that acted more than 50 ms after judging the lock stale wrote over the first's and both held it
    (28 of 100 stale folders here)."""
    proc = subprocess.run([sys.executable, "-c", TWO_JOBS_AT_ONCE, str(tmp_path), folders], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    both, some, folders = map(int, proc.stdout.split())
    assert (both, some) == (0, folders)


@pytest.mark.parametrize("links", [True, False], ids=["hard-links", "no-hard-links"])
def test_a_stale_lock_taken_over_by_another_job_since_it_was_judged_is_left_to_that_job(
    tmp_path, other_process, monkeypatch, links
):
    """This job judged the lock stale; before it removed it, another job took it over. Removing by name would have
    removed the other job's fresh lock: the file is checked to be the one judged, put back, and this job refused."""
    if not links:
        monkeypatch.setattr(run_lock.os, "link", no_links)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_holder(tmp_path, pid=dead.pid)
    first, second = RunLock(tmp_path), RunLock(tmp_path)
    first.me = {**first.me, "pid": other_process.pid, "pid_start": run_lock._process_start(other_process.pid)}
    remove = second._remove_if_unchanged

    def the_other_job_takes_over_first(judged):
        first.acquire()
        remove(judged)

    second._remove_if_unchanged = the_other_job_takes_over_first
    holder = f"in use by a job \\(host {socket.gethostname()}, pid {other_process.pid},"
    with pytest.raises(RunFolderInUse, match=holder):
        second.acquire()
    assert first.held()
    first.release()
    assert list(tmp_path.iterdir()) == [], "nothing left aside"


def no_links(source, target):
    raise PermissionError(1, "Operation not permitted")


def test_without_hard_links_the_lock_is_created_by_an_exclusive_open(tmp_path, monkeypatch, other_process):
    monkeypatch.setattr(run_lock.os, "link", no_links)
    lock = RunLock(tmp_path)
    lock.acquire()
    assert lock.held() and json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    second = RunLock(tmp_path)
    second.me = {**second.me, "pid": other_process.pid, "token": "second"}  # another live job on this host
    with pytest.raises(RunFolderInUse, match=f"pid {os.getpid()}"):
        second.acquire()
    lock.release()
    assert list(tmp_path.iterdir()) == []


def test_a_second_training_job_on_a_folder_in_use_fails_in_one_line_naming_the_first(tmp_path, corpus_cache):
    cmd = [sys.executable, "-m", "shardlab.train", *TINY_LM, f"data.cache_dir={corpus_cache}",
           f"hydra.run.dir={tmp_path}", "optimization.max_steps=100000", "validation.interval_steps=0"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": "5151"}
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while (run_record.read(tmp_path) or {}).get("step", 0) < 1:
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()[-2000:]
            time.sleep(0.2)
        second = subprocess.run(cmd, cwd=ROOT, env={**env, "SLURM_JOB_ID": "5152"}, capture_output=True, text=True,
                                timeout=180)  # fmt: skip
        assert second.returncode == 2
        (line,) = second.stderr.strip().splitlines()
        assert line.startswith(f"error: {tmp_path} is in use by job 5151 (host {socket.gethostname()}, pid {first.pid}")
        assert run_record.read(tmp_path)["job_id"] == "5151", "the refused job left the running job's status alone"
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
