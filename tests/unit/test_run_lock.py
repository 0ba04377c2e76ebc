"""One run directory, one writer: a second job is refused in one line naming the first (the same Slurm job id too,
unless it is that job's requeue); a lock whose holder is gone (its process ended, its heartbeat stopped moving for the
lease on the taker's own clock, or it was this job before a requeue) is taken over; a refused job changes nothing in
the folder; a holder keeps its lock through a moment without it, and stops with a save when another job holds it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from shardlab.errors import RunFolderInUse
from shardlab.files import liveness
from shardlab.jobs import run_lock, run_record
from shardlab.jobs.run_lock import LOCK_FILE, RunLock
from tests.conftest import TINY_LM

ROOT = Path(__file__).resolve().parents[2]


def write_holder(run_dir: Path, **fields) -> None:
    holder = {"job": None, "host": socket.gethostname(), "pid": 1, "pid_start": None, "token": "other",
              "heartbeat": time.time(), **fields}  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK_FILE).write_text(json.dumps(holder))


def take_over(run_dir: Path, deadline_s: float = 5.0, **fields) -> None:
    """Another job's lock replaces ours, once, and our heartbeat reports the lock lost. The holder never writes its
    lock after creating it (its beat only touches the file), so nothing it does puts its lock back over the other
    job's (test_a_takeover_between_the_beats_check_and_its_write_is_never_undone)."""
    write_holder(run_dir, **fields)
    deadline = time.monotonic() + deadline_s
    while run_lock.lost(run_dir) is None and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.fixture
def other_process():
    """A live process on this host that is not us (the holder of someone else's lock)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_live_holder_keeps_a_second_job_out_naming_it(tmp_path, other_process, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "222")
    write_holder(tmp_path, job="111", pid=other_process.pid, pid_start=liveness.process_start(other_process.pid))
    with pytest.raises(RunFolderInUse) as e:
        RunLock(tmp_path).acquire()
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"{tmp_path} is in use by job 111 (host {socket.gethostname()}, pid {other_process.pid}")


def test_a_lock_whose_process_ended_is_taken_over(tmp_path, other_process):
    pid, started = other_process.pid, liveness.process_start(other_process.pid)
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


def test_a_requeued_job_takes_over_its_own_lock_from_another_node_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # Slurm's count of this job's requeues
    write_holder(tmp_path, job="4242", restart=0, host="the-node-before-the-requeue", pid=77)
    started = time.monotonic()
    lock = RunLock(tmp_path)
    lock.acquire()
    assert time.monotonic() - started < run_lock.LEASE_S / 10, "no lease to wait for: Slurm ran that one before"
    assert json.loads((tmp_path / LOCK_FILE).read_text())["host"] == socket.gethostname()
    lock.release()


def test_a_second_job_with_the_same_slurm_job_id_is_refused(tmp_path, other_process, monkeypatch):
    """Two runs inside one allocation (another job step, or another process of the same step) share SLURM_JOB_ID and
    its restart count: the second is refused like any other job. It used to take the live lock over as a requeue."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    write_holder(tmp_path, job="4242", restart=0, pid=other_process.pid,
                 pid_start=liveness.process_start(other_process.pid))  # fmt: skip
    before = (tmp_path / LOCK_FILE).read_bytes()
    with pytest.raises(
        RunFolderInUse, match=f"in use by job 4242 \\(host {socket.gethostname()}, pid {other_process.pid}"
    ):
        RunLock(tmp_path).acquire()
    assert (tmp_path / LOCK_FILE).read_bytes() == before


class RemoteHolder:
    """A holder on another host whose wall clock is off by ``skew_s``: it creates its lock (``since`` its wall time)
    and touches it every 20 ms, the mtime its skewed wall time, until ``die()``."""

    def __init__(self, run_dir: Path, skew_s: float) -> None:
        self.path, self.skew_s = run_dir / LOCK_FILE, skew_s
        self.stop = threading.Event()
        holder = {"job": "77", "restart": 0, "host": "node-b", "pid": 4242, "pid_start": "1", "token": "remote",
                  "since": time.time() + skew_s}  # fmt: skip
        self.path.write_text(json.dumps(holder))
        self.touch()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def touch(self) -> None:
        now = time.time_ns() + int(self.skew_s * 1e9)
        os.utime(self.path, ns=(now, now))

    def run(self) -> None:
        while not self.stop.wait(0.02):
            self.touch()

    def die(self) -> None:
        self.stop.set()
        self.thread.join()


def test_a_live_holder_with_a_slow_clock_is_not_taken_over(tmp_path, monkeypatch, capsys):
    """Its clock runs 301 s slow: judged by its wall time, its heartbeat looked older than the 300 s lease."""
    monkeypatch.setattr(run_lock, "LEASE_S", 300.0)
    holder = RemoteHolder(tmp_path, skew_s=-301)
    try:
        with pytest.raises(RunFolderInUse, match="host node-b, pid 4242, its heartbeat moved while this job watched"):
            RunLock(tmp_path).acquire()
    finally:
        holder.die()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == "remote"
    (line,) = capsys.readouterr().out.splitlines()
    assert "its host is not this one, so this job watches the lock" in line and "300 s by this host's clock" in line


def test_a_dead_holder_with_a_fast_clock_is_taken_over_a_lease_after_its_last_beat(tmp_path, monkeypatch):
    """Its clock ran an hour fast: judged by its wall time, its last heartbeat stayed 'in the future' and blocked the
    folder for an hour past its death. Judged by the taker's own clock, a lease after the beat stopped moving."""
    monkeypatch.setattr(run_lock, "LEASE_S", 0.6)
    holder = RemoteHolder(tmp_path, skew_s=3600)
    time.sleep(0.1)
    holder.die()
    started = time.monotonic()
    lock = RunLock(tmp_path)
    lock.acquire()
    waited = time.monotonic() - started
    assert 0.6 <= waited < 5, waited
    assert lock.held()
    lock.release()


def test_a_lock_judged_stale_whose_holder_beats_before_it_is_removed_goes_back(tmp_path, monkeypatch):
    """Another host's lock stayed unchanged for the lease; its holder's beat (a touch: the bytes stay the same) came
    just before the watcher renamed it aside. The watcher compares the file it moved with the bytes and the mtime it
    judged, puts it back, and is refused: the heartbeat moved."""
    monkeypatch.setattr(run_lock, "LEASE_S", 0.3)
    holder = RemoteHolder(tmp_path, skew_s=0)
    holder.die()
    written = (tmp_path / LOCK_FILE).read_bytes()
    lock = RunLock(tmp_path)
    remove = lock._remove_if_unchanged

    def the_holder_beats_first(judged):
        holder.touch()
        remove(judged)

    lock._remove_if_unchanged = the_holder_beats_first
    with pytest.raises(RunFolderInUse, match="host node-b, pid 4242, its heartbeat moved while this job watched it"):
        lock.acquire()
    assert (tmp_path / LOCK_FILE).read_bytes() == written
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE], "nothing left aside"


def test_the_heartbeat_touches_the_lock_and_never_writes_it(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    lock = RunLock(tmp_path)
    lock.acquire()
    path = tmp_path / LOCK_FILE
    written, first = path.read_bytes(), path.stat()
    holder = json.loads(written)
    assert (holder["host"], holder["pid"], holder["job"]) == (socket.gethostname(), os.getpid(), None)
    assert holder["since"].startswith(time.strftime("%Y-")), "a wall time for people"
    time.sleep(0.5)
    assert path.stat().st_mtime_ns != first.st_mtime_ns, "the heartbeat moves"
    assert path.read_bytes() == written and path.stat().st_ino == first.st_ino, "the same file, never rewritten"
    lock.release()


def test_a_heartbeat_moves_where_mtimes_keep_whole_seconds_and_the_clock_stepped_back(tmp_path, monkeypatch):
    """Watchers compare a beat with the last one only: each beat is at least a second past the last, so it shows."""
    path = tmp_path / "lock"
    path.write_text("{}")
    later = time.time_ns() + 3600 * 10**9  # the last beat came from a clock an hour ahead of this one now
    os.utime(path, ns=(later, later))
    liveness.touch(path)
    assert path.stat().st_mtime_ns >= later + 10**9
    now = time.time_ns()
    os.utime(path, ns=(now - 3600 * 10**9, now - 3600 * 10**9))
    liveness.touch(path)
    assert now <= path.stat().st_mtime_ns <= time.time_ns(), "the wall time otherwise, for people who list it"


def test_a_holder_whose_lock_is_renamed_away_and_back_for_a_second_keeps_it(tmp_path, monkeypatch):
    """Another starter renames the lock aside to compare it (or NFS fails a read): the heartbeat used to read that as
    "not ours" and stop for good, so a job on another host took the folder a lease later while this one trained."""
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    lock = RunLock(tmp_path)
    lock.acquire()
    aside = tmp_path / "aside"
    os.rename(tmp_path / LOCK_FILE, aside)
    time.sleep(1.0)
    os.rename(aside, tmp_path / LOCK_FILE)
    beat = (tmp_path / LOCK_FILE).stat().st_mtime_ns
    time.sleep(0.5)
    assert getattr(lock, "lost", None) is None and lock.held()
    assert (tmp_path / LOCK_FILE).stat().st_mtime_ns != beat, "the heartbeat goes on"
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_lock_another_job_holds_now_is_lost_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    said = []
    (lock,) = run_lock.take(tmp_path)
    lock.say = lambda line, **_: said.append(line)
    (tmp_path / LOCK_FILE).write_text("{not json")  # unreadable for a moment: not lost
    time.sleep(0.3)
    assert run_lock.lost(tmp_path) is None
    take_over(tmp_path, job="999", host="node-c", pid=31, token="theirs")
    reason = run_lock.lost(tmp_path)
    assert reason.startswith(f"the lock of {tmp_path} was taken over by job 999 (host node-c, pid 31)")
    assert said == [f"[run] {reason}"] and "\n" not in reason
    assert run_lock.taken_over(tmp_path)
    run_lock.release(tmp_path)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == "theirs", "the other job's lock stays"


def replace_with_another_jobs_lock(run_dir: Path, **fields) -> None:
    """Another job's lock in place of the one there, in one step (a taker renames the stale lock aside and creates
    its own; the end is the same)."""
    holder = {"job": "999", "restart": 0, "host": "node-c", "pid": 31, "pid_start": "1", "token": "theirs", **fields}
    tmp = run_dir / ".theirs.tmp"
    tmp.write_text(json.dumps(holder))
    os.replace(tmp, run_dir / LOCK_FILE)


def test_a_takeover_between_the_beats_check_and_its_write_is_never_undone(tmp_path, monkeypatch):
    """The holder's beat read the lock as its own; before its write, another job took the lock over (this beat had
    stalled a lease long on a hung NFS mount, so a job on another host judged the lock stale). The beat replaced the
    whole file to bump a counter, writing its lock over the new holder's: that job's heartbeat then found another
    holder's lock and stopped, while the stale one went on. The beat only touches the file now: the touch lands on
    the new holder's lock (harmless: that job is alive), and the next beat finds the lock is another job's."""
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    check, taken = run_lock._owner, threading.Event()

    def check_then_another_job_takes_over(*args, **kwargs):
        seen = check(*args, **kwargs)
        if threading.current_thread().name == "shardlab-run-lock" and seen[0] == "ours" and not taken.is_set():
            replace_with_another_jobs_lock(tmp_path)
            taken.set()
        return seen

    monkeypatch.setattr(run_lock, "_owner", check_then_another_job_takes_over)
    lock = RunLock(tmp_path)
    lock.acquire()
    deadline = time.monotonic() + 5
    while lock.lost is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert taken.is_set()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == "theirs", "the job that took over keeps it"
    assert lock.lost is not None and lock.lost.startswith(f"the lock of {tmp_path} was taken over by job 999")
    lock.release()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == "theirs"


def test_a_takeover_just_after_the_released_lock_was_checked_is_left_standing(tmp_path, monkeypatch):
    """A holder releasing its lock checked that the lock was its own, then removed it by name: a takeover in between
    (this holder judged stale meanwhile) lost the new holder its lock. The lock is renamed aside first and checked
    there, so only the file checked is removed, and another job's goes back."""
    lock = RunLock(tmp_path)
    lock.acquire()  # no beat during the test: HEARTBEAT_S is 30 s
    check, taken = run_lock._owner, threading.Event()

    def check_then_another_job_takes_over(*args, **kwargs):
        seen = check(*args, **kwargs)
        if seen[0] == "ours" and not taken.is_set():
            replace_with_another_jobs_lock(tmp_path)
            taken.set()
        return seen

    monkeypatch.setattr(run_lock, "_owner", check_then_another_job_takes_over)
    lock.release()
    assert taken.is_set()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == "theirs", "the job that took over keeps it"
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE], "nothing left aside"


def test_a_rank_its_launcher_spawned_learns_that_the_launchers_lock_was_lost(tmp_path, monkeypatch):
    """Local ranks are children of the holder: rank 0 follows the lock files the launcher named in its environment."""
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.02)
    write_holder(tmp_path, token="the-launchers")
    monkeypatch.setenv(run_lock.HOLDER_ENV, json.dumps({str(tmp_path / LOCK_FILE): "the-launchers"}))
    assert run_lock.lost(tmp_path) is None
    time.sleep(0.1)
    assert run_lock.lost(tmp_path) is None
    write_holder(tmp_path, job="999", host="node-c", pid=31, token="theirs")
    deadline = time.monotonic() + 5
    while run_lock.lost(tmp_path) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert run_lock.lost(tmp_path).startswith(f"the lock of {tmp_path} was taken over by job 999 (host node-c")


def test_losing_the_lock_stops_training_at_the_next_step_saving_nothing_with_one_line(tmp_path, tiny_lm, monkeypatch):
    """The heartbeat sees another job's lock: every rank stops at the step's end and nothing is written into the
    folder, which is that job's now (it used to save this step there, publishing and pruning)."""
    from shardlab import runner
    from shardlab.trainer import Trainer

    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.02)
    step = Trainer.train_step

    def another_job_takes_the_folder_during_step_3(self, *args):
        if self.state.step == 2:
            take_over(
                tmp_path, job="999", host="node-c", pid=31, token="theirs", restart=1, since="2031-01-02 03:04:05"
            )
        return step(self, *args)

    monkeypatch.setattr(Trainer, "train_step", another_job_takes_the_folder_during_step_3)
    cfg = tiny_lm("checkpoint.interval_steps=0", "validation.interval_steps=0")
    with pytest.raises(RunFolderInUse) as e:
        runner.run_job(cfg, tmp_path, [])
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(
        f"the lock of {tmp_path} was taken over by job 999 (host node-c, pid 31, restart 1), which holds it since "
        "2031-01-02 03:04:05 by its host's clock; this job no longer writes, publishes or prunes there"
    )
    assert "did not reach" not in message
    assert message.endswith("stopped at step 3 and saved nothing: its steps of this run are dropped")
    assert not (tmp_path / "checkpoints").exists(), "nothing saved into the folder the other job holds"
    assert run_record.read(tmp_path)["status"] == "running", "status.json is the other job's now: not marked failed"
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == "theirs"


def plant_checkpoint(root: Path, step: int, marker: str) -> None:
    folder = root / f"step_{step:08d}"
    folder.mkdir(parents=True)
    (folder / "shardlab.json").write_text(json.dumps({"step": step, "save_index": 100 + step, "marker": marker}))
    (folder / ".metadata").write_text(marker)


@pytest.mark.parametrize("when", ["before the save", "during the save"])
def test_a_save_after_the_folder_was_taken_over_changes_none_of_the_new_holders_checkpoints(
    tmp_path, tiny_lm, monkeypatch, when
):
    """The takeover came between two heartbeats (none runs in this test): the lock's token is read again immediately
    before the save starts, before it is published and before it prunes. The new holder's step 4 (the name this save
    would publish, replacing it) and step 1 (which keep_last=1 would prune) stay byte for byte, and no rank leaves
    anything of its own there. It used to remove step_4.tmp, replace step 4 and prune step 1."""
    from shardlab import runner
    from shardlab.checkpoint import manager
    from shardlab.trainer import Trainer

    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 3600.0)
    ckpt = tmp_path / "checkpoints"

    def take_over_now():
        replace_with_another_jobs_lock(tmp_path, since="2031-01-02 03:04:05")
        plant_checkpoint(ckpt, 1, "theirs-1")
        plant_checkpoint(ckpt, 4, "theirs-4")

    if when == "before the save":
        step = Trainer.train_step

        def another_job_takes_the_folder_during_step_3(self, *args):
            if self.state.step == 2:
                take_over_now()
            return step(self, *args)

        monkeypatch.setattr(Trainer, "train_step", another_job_takes_the_folder_during_step_3)
    else:  # after the shards are written, before rank 0 publishes
        monkeypatch.setattr(manager.Checkpointer, "_complete", _taking_over_before(manager.Checkpointer._complete,
                                                                                   take_over_now))  # fmt: skip
    cfg = tiny_lm("checkpoint.interval_steps=4", "checkpoint.keep_last=1", "validation.interval_steps=0")
    with pytest.raises(RunFolderInUse, match=f"^the lock of {tmp_path} was taken over by job 999 \\(host node-c"):
        runner.run_job(cfg, tmp_path, [])
    for step, marker in ((1, "theirs-1"), (4, "theirs-4")):
        folder = ckpt / f"step_{step:08d}"
        assert sorted(p.name for p in folder.iterdir()) == [".metadata", "shardlab.json"]
        assert json.loads((folder / "shardlab.json").read_text())["marker"] == marker
    left = sorted(p.name for p in ckpt.iterdir())
    expected = ["step_00000001", "step_00000004"] + (["step_00000004.tmp"] if when == "during the save" else [])
    assert left == expected, "a save under way leaves its unfinished folder to the new holder, publishing nothing"


def _taking_over_before(complete, take_over_now):
    def taken_over_first(self, *args, **kwargs):
        take_over_now()
        return complete(self, *args, **kwargs)

    return taken_over_first


HOLD = """
import sys, time
from pathlib import Path
from shardlab.jobs import run_lock
run_lock.HEARTBEAT_S = 3600  # no beat while the test compares the folder
run_lock.take(Path(sys.argv[1]), sys.argv[2]) if len(sys.argv) > 2 else run_lock.RunLock(Path(sys.argv[1])).acquire()
print("held", flush=True)
time.sleep(120)
"""


def hold(run_dir: Path, *checkpoint_dir: str, job: str = "5151") -> subprocess.Popen:
    env = {**os.environ, "SLURM_JOB_ID": job}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir), *checkpoint_dir], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "held"
    return proc


def snapshot(folder: Path) -> dict[str, tuple[bytes | None, int]]:
    """Every file's bytes and every file's and folder's mtime, the folder's own included."""
    return {
        str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns)
        for p in [folder, *sorted(folder.rglob("*"))]
    }


def test_a_refused_job_leaves_the_running_jobs_folder_byte_identical(tmp_path, corpus_cache):
    """The same SLURM_JOB_ID, another process of the allocation: refused in one line, exit code 2, and nothing in the
    running job's folder changes, not a byte nor an mtime. Hydra used to write .hydra/ (the refused job's config)
    before the lock, and the path checks probed the folders with a file."""
    run = tmp_path / "run"
    for name, text in {".hydra/config.yaml": "the running job's config\n", ".hydra/overrides.yaml": "- a=1\n",
                       "status.json": '{"status": "running"}', "train.log": "step 1\n",
                       "checkpoints/step_00000001/.metadata": "m"}.items():  # fmt: skip
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(text)
    holder = hold(run)
    try:
        for p in [run, *run.rglob("*")]:
            os.utime(p, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))  # any touch shows
        before = snapshot(run)
        cmd = [sys.executable, "-m", "shardlab.train", *TINY_LM, f"data.cache_dir={corpus_cache}",
               f"hydra.run.dir={run}", "optimizer.lr=0.5"]  # fmt: skip
        second = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "SLURM_JOB_ID": "5151"}, capture_output=True,
                                text=True, timeout=180)  # fmt: skip
        assert second.returncode == 2, second.stderr[-3000:]
        (line,) = second.stderr.strip().splitlines()
        assert line.startswith(f"error: {run} is in use by job 5151 (host {socket.gethostname()}, pid {holder.pid}")
        assert snapshot(run) == before
    finally:
        holder.kill()
        holder.wait()


def test_a_refused_sweep_point_leaves_the_running_points_folder_byte_identical(tmp_path, corpus_cache, cli_forks):
    """The same for a point of a sweep (Hydra's multirun), where Hydra's run_job wrote the point's .hydra/ before the
    task function took the lock: the point's record is now written once the lock is held (preflight:
    write_record_when_held), and a refused point writes none. The sweep goes on past it, the error in its words."""
    run = tmp_path / "sweep" / "p0"
    for name, text in {".hydra/config.yaml": "the running job's config\n", ".hydra/overrides.yaml": "- a=1\n",
                       "status.json": '{"status": "running"}', "train.log": "step 1\n"}.items():  # fmt: skip
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(text)
    holder = hold(run)
    try:
        for p in [run, *run.rglob("*")]:
            os.utime(p, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
        before = snapshot(run)
        args = ["-m", *TINY_LM, f"data.cache_dir={corpus_cache}", f"hydra.sweep.dir={run.parent}",
                "hydra.sweep.subdir=p0", "optimizer.lr=0.5"]  # fmt: skip
        second = cli_forks.run(*args, env={"SLURM_JOB_ID": "5151"}, timeout=180)  # a fork of the warmed CLI
        assert f"error: {run} is in use by job 5151" in second.stderr, second.stderr[-3000:]
        assert "Callback" not in second.stderr  # no callback failed (Hydra turns their errors into warnings)
        assert snapshot(run) == before
    finally:
        holder.kill()
        holder.wait()


def test_a_checkpoint_folder_outside_the_run_is_locked_too(tmp_path):
    """checkpoint.dir named outright (a scratch file system) gets its own lock: two runs never share it."""
    shared = tmp_path / "scratch" / "ckpt"
    holder = hold(tmp_path / "run_a", str(shared))
    try:
        assert (shared / LOCK_FILE).is_file()
        with pytest.raises(RunFolderInUse, match=f"^{shared} is in use by job 5151"):
            run_lock.take(tmp_path / "run_b", str(shared))
        assert not (tmp_path / "run_b" / LOCK_FILE).exists(), "the run's own lock is given back"
        assert run_lock.checkpoint_folder_outside(tmp_path / "run_b", "checkpoints") is None
    finally:
        holder.kill()
        holder.wait()


TWO_JOBS_AT_ONCE = """
import sys, time
from pathlib import Path
from shardlab.jobs import run_lock
from tests import lock_starters

def second_job_slow(who):
    judge = run_lock.RunLock._judge

    def slow_judge(self, holder):  # the second job acts up to 90 ms after judging (a loaded node, a slow NFS)
        verdict = judge(self, holder)
        time.sleep(0.03 * (lock_starters.folder % 4))
        return verdict

    if who == 1:
        run_lock.RunLock._judge = slow_judge

if __name__ == "__main__":
    root, stale = Path(sys.argv[1]), sys.argv[2] == "stale"
    FOLDERS = 100 if stale else 300
    if stale:  # every folder holds the lock of a job that died
        lock_starters.dead_holders(root, FOLDERS)
    held = lock_starters.race(root, 2, FOLDERS, second_job_slow if stale else None)
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
    """This job judged the lock stale; before it acted on it, another job took it over. Removing by name would have
    removed the other job's fresh lock: under the guard, the lock is read again and is not the one judged, so this
    job judges again and is refused."""
    if not links:
        monkeypatch.setattr(run_lock.os, "link", no_links)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_holder(tmp_path, pid=dead.pid)
    first, second = RunLock(tmp_path), RunLock(tmp_path)
    first.me = {**first.me, "pid": other_process.pid, "pid_start": liveness.process_start(other_process.pid)}
    guard, taken = second._guard, []

    def the_other_job_takes_over_first():
        if not taken:
            first.acquire()
            taken.append(True)
        return guard()

    second._guard = the_other_job_takes_over_first
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


def test_a_second_training_job_on_a_folder_in_use_fails_in_one_line_naming_the_first(tmp_path, corpus_cache, cli_forks):
    args = [*TINY_LM, f"data.cache_dir={corpus_cache}", f"hydra.run.dir={tmp_path}", "optimization.max_steps=100000",
            "validation.interval_steps=0"]  # fmt: skip
    cmd = [sys.executable, "-m", "shardlab.train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": "5151"}
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while (run_record.read(tmp_path) or {}).get("step", 0) < 1:
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()[-2000:]
            time.sleep(0.2)
        second = cli_forks.run(*args, env={"SLURM_JOB_ID": "5151"}, timeout=180)  # refused: a fork of the warm CLI
        assert second.returncode == 2
        (line,) = second.stderr.strip().splitlines()
        assert line.startswith(f"error: {tmp_path} is in use by job 5151 (host {socket.gethostname()}, pid {first.pid}")
        assert run_record.read(tmp_path)["job_id"] == "5151", "the refused job left the running job's status alone"
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
