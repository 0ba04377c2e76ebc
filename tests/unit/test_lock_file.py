"""The lock file as a file (issue 41, items 8 and 10): only a regular file of at most MAX_LOCK_BYTES is read, never
through a symlink nor waiting on a FIFO; a lock that names no holder is refused as malformed, in one line naming the
file and its content, at once (not watched for 300 s as another host's, "host ?"); three or more starters at once
leave exactly one holder; and any content costs one line, bounded time and bounded memory (a seeded fuzz)."""

from __future__ import annotations

import json
import os
import random
import resource
import socket
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from shardlab.errors import ConfigError, RunFolderInUse
from shardlab.jobs import run_lock
from shardlab.jobs.run_lock import LOCK_FILE, RunLock

ROOT = Path(__file__).resolve().parents[2]

ACQUIRE = """
import sys, time
from pathlib import Path
from shardlab.errors import RunFolderInUse
from shardlab.jobs import run_lock
started = time.monotonic()
try:
    run_lock.RunLock(Path(sys.argv[1])).acquire()
    print("held")
except RunFolderInUse as e:
    print(f"refused in {time.monotonic() - started:.2f} s: {e}")
"""


def acquire_in_a_process(folder: Path) -> str:
    """acquire() in a process of its own, under 1 GiB of address space and a 20 s limit: a reader that follows a
    symlink to /dev/zero, or waits on a FIFO's writer, fails this instead of the test session."""

    def one_gib() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    done = subprocess.run([sys.executable, "-c", ACQUIRE, str(folder)], cwd=ROOT, capture_output=True, text=True,
                          timeout=20, preexec_fn=one_gib, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


@pytest.mark.parametrize("kind", ["symlink to /dev/zero", "FIFO", "folder", "over 4 KiB"])
def test_a_lock_that_is_not_a_regular_file_is_refused_at_once_in_one_line(tmp_path, kind):
    """``run.lock`` as a symlink to /dev/zero grew the reader to 1.1 GB in 1.5 s; as a FIFO it hung."""
    lock = tmp_path / LOCK_FILE
    if kind == "symlink to /dev/zero":
        lock.symlink_to("/dev/zero")
    elif kind == "FIFO":
        os.mkfifo(lock)
    elif kind == "folder":
        lock.mkdir()
    else:
        lock.write_text(json.dumps({"token": "x", "pad": "y" * 5000}))
    line = acquire_in_a_process(tmp_path)
    assert "\n" not in line
    seconds, _, message = line.removeprefix("refused in ").partition(" s: ")
    assert float(seconds) < 2
    assert message.startswith(f"{lock} is malformed (")
    assert {"symlink to /dev/zero": "a symbolic link", "FIFO": "a FIFO", "folder": "a folder",
            "over 4 KiB": "over 4096 bytes"}[kind] in message  # fmt: skip
    assert f"remove it if no job uses {tmp_path}" in message
    assert os.path.lexists(lock), "left as it was: shardlab cannot tell whose it is"


@pytest.mark.parametrize("content", [b"", b"garbage \x00\xff", b"[1,2]", b'{"job": "7"}', b'{"token": 5}'])
def test_a_lock_that_names_no_holder_is_refused_as_malformed_naming_its_content(tmp_path, content):
    """Garbage, empty or ``[1,2]`` counted as another host's live lock: a 300 s wait, then a takeover saying
    "host ?". The rule now: content that is not a JSON object with a string token, still so after two re-reads
    (0.4 s, a creator without hard links writing it), is refused and left alone."""
    (tmp_path / LOCK_FILE).write_bytes(content)
    started = time.monotonic()
    with pytest.raises(RunFolderInUse) as e:
        RunLock(tmp_path).acquire()
    assert time.monotonic() - started < 2
    message = str(e.value)
    assert "\n" not in message and "host ?" not in message
    assert message.startswith(f"{tmp_path / LOCK_FILE} is malformed (not a JSON object naming a holder: {content!r}")
    assert (tmp_path / LOCK_FILE).read_bytes() == content


THREE_STARTERS = """
import json, random, sys, time
from pathlib import Path
from shardlab.jobs import run_lock
from tests import lock_starters

def pause_between_judging_and_acting(who):
    judge, put_back = run_lock.RunLock._judge, run_lock.RunLock._put_back
    pauses = random.Random(1000 + who)

    def paused_judge(self, holder):  # a descheduled process or a slow file system between judging and acting
        verdict = judge(self, holder)
        time.sleep(pauses.choice([0.0, 0.01, 0.03, 0.06, 0.1]))
        return verdict

    def paused_put_back(self, aside):  # a slow file system while a lock another starter made is set aside
        time.sleep(pauses.choice([0.0, 0.02, 0.05]))
        return put_back(self, aside)

    run_lock.RunLock._judge = paused_judge
    run_lock.RunLock._put_back = paused_put_back

if __name__ == "__main__":
    root, starters, trials = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    lock_starters.dead_holders(root, trials)  # every folder holds the lock of a job that died
    held = lock_starters.race(root, starters, trials, pause_between_judging_and_acting)
    holders = [sum(held[(who, i)] for who in range(starters)) for i in range(trials)]
    owners = [json.loads((root / f"run{i}" / run_lock.LOCK_FILE).read_text())["pid"] for i in range(trials)]
    print(json.dumps({"holders": holders, "files": [sorted(p.name for p in (root / f"run{i}").iterdir())
                                                    for i in range(trials)], "owners": len(set(owners))}))
"""


@pytest.mark.parametrize("starters", [3, 4])
def test_three_or_more_starters_at_once_leave_exactly_one_holder(tmp_path, starters):
    """Every starter pauses between judging a dead holder's lock and acting on it, and before putting back a lock it
    set aside that was not the one it judged. With the rename-aside check
    alone, two of three returned from acquire() in 3 of 6 trials: B's put-back met C's new lock, and B's clean-up
    removed A's. Starters now change the lock one at a time (a flock'ed guard), each acting only on the lock it
    judged: one holder in every trial, its lock the only file left (the guard is gone)."""
    trials = 12
    proc = subprocess.run([sys.executable, "-c", THREE_STARTERS, str(tmp_path), str(starters), str(trials)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout)
    assert seen["holders"] == [1] * trials
    assert seen["files"] == [[LOCK_FILE]] * trials


def test_a_checkpoint_folder_in_another_runs_folder_is_refused_naming_that_job(tmp_path, monkeypatch):
    """Run Y with checkpoint.dir=<run X>/checkpoints, named outright or through a symlink, resumed X's newest step and
    pruned X's others while X trained: Y's lock was <X>/checkpoints/run.lock, which X never takes. The checkpoint
    folder is locked by its real path, and one inside another run's folder is refused in one line naming its job."""
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    x = tmp_path / "runs" / "x"
    (x / "checkpoints" / "step_00000002").mkdir(parents=True)
    (x / "run.lock").write_text(json.dumps({"job": "4242", "restart": 0, "host": "node-x", "pid": 9, "token": "x"}))
    (tmp_path / "link").symlink_to(x / "checkpoints")
    for named in (str(x / "checkpoints"), str(tmp_path / "link"), str(tmp_path / "link" / "sub")):
        with pytest.raises(ConfigError) as e:
            run_lock.take(tmp_path / "runs" / "y", named)
        message = str(e.value)
        assert "\n" not in message
        real = "" if Path(named) == Path(named).resolve() else f" is {Path(named).resolve()},"
        assert message.startswith(f"checkpoint.dir={named}{real} inside another run's folder: "
                                  f"{x} is locked by job 4242 (host node-x, pid 9, restart 0)")  # fmt: skip
        assert not (tmp_path / "runs" / "y" / LOCK_FILE).exists(), "refused before any lock is taken"
    assert sorted(p.name for p in x.iterdir()) == ["checkpoints", "run.lock"]
    assert sorted(p.name for p in (x / "checkpoints").iterdir()) == ["step_00000002"]


def test_a_checkpoint_folder_in_a_finished_runs_folder_is_refused_too(tmp_path):
    x = tmp_path / "x"
    (x / ".hydra").mkdir(parents=True)
    with pytest.raises(ConfigError, match=f"{x} is another run's folder \\(it holds .hydra\\)"):
        run_lock.take(tmp_path / "y", str(x / "checkpoints"))


HOLD = """
import sys, time
from pathlib import Path
from shardlab.jobs import run_lock
run_lock.HEARTBEAT_S = 3600
run_lock.take(Path(sys.argv[1]), sys.argv[2])
print("held", flush=True)
time.sleep(120)
"""


def test_a_symlinked_checkpoint_folder_is_locked_where_it_really_is(tmp_path):
    """Two runs naming one scratch folder by two paths (one a symlink) meet at one lock, at the real path: the second
    is refused naming the folder where it really is."""
    scratch = tmp_path / "scratch" / "ck"
    scratch.mkdir(parents=True)
    (tmp_path / "alias").symlink_to(scratch)
    env = {**os.environ, "SLURM_JOB_ID": "5151"}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "a"), str(scratch)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        assert json.loads((scratch / LOCK_FILE).read_text())["pid"] == holder.pid
        with pytest.raises(RunFolderInUse, match=f"^{scratch} is in use by job 5151"):
            run_lock.take(tmp_path / "b", str(tmp_path / "alias"))
        assert not (tmp_path / "b" / LOCK_FILE).exists(), "the run's own lock is given back"
    finally:
        holder.kill()
        holder.wait()


# ---- fuzz ------------------------------------------------------------------------------------------------------------
def lock_contents(seed: int, n: int) -> list[bytes]:
    """Seeded: a valid lock's JSON with fields dropped, retyped or swollen, random bytes, deep nesting, huge numbers,
    truncations."""
    rng = random.Random(seed)
    valid = {"job": "5", "restart": 0, "host": socket.gethostname(), "pid": 1, "pid_start": None, "token": "t",
             "since": "2030-01-01 00:00:00 +0000"}  # fmt: skip
    odd = [None, True, -1, 2**70, 1e308, "", "x" * 300, "\n\x00\u202e", [], {}, [[1]], {"a": {"b": 1}}]
    cases: list[bytes] = []
    for _ in range(n):
        pick = rng.randrange(6)
        if pick == 0:
            cases.append(rng.randbytes(rng.choice([0, 1, 17, 300, 4096, 4097, 70000])))
        elif pick == 1:
            holder = dict(valid)
            for key in rng.sample(sorted(holder), rng.randrange(1, 4)):
                if rng.random() < 0.3:
                    holder.pop(key)
                else:
                    holder[key] = rng.choice(odd)
            cases.append(json.dumps(holder).encode())
        elif pick == 2:
            depth = rng.choice([10, 1000, 100000])
            cases.append(b"[" * depth + b"]" * depth)
        elif pick == 3:
            cases.append(rng.choice([b"1e999999", b"9" * 4000, b'{"token": "t", "pid": 1e999}', b"NaN", b'"t"']))
        elif pick == 4:
            text = json.dumps(valid).encode()
            cases.append(text[: rng.randrange(len(text))])
        else:
            cases.append(json.dumps({**valid, "host": "elsewhere", "job": rng.choice(odd)}).encode())
    return cases


def test_fuzzed_lock_files_cost_one_line_bounded_time_and_bounded_memory(tmp_path, monkeypatch):
    """200 seeded lock contents: each start holds the folder or is refused in one line (RunFolderInUse), within
    2 CPU s and 16 MiB of Python allocations, and a lock it refused is left byte for byte."""
    monkeypatch.setattr(run_lock, "UNREADABLE_WAIT_S", 0.005)
    monkeypatch.setattr(run_lock, "LEASE_S", 0.05)  # another host's well-formed lock: watched briefly, then taken
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 3600.0)
    outcomes = {"held": 0, "refused": 0}
    for i, content in enumerate(lock_contents(seed=41, n=200)):
        folder = tmp_path / f"f{i}"
        folder.mkdir()
        (folder / LOCK_FILE).write_bytes(content)
        lock = RunLock(folder, say=lambda *a, **k: None)
        tracemalloc.start()
        started = time.process_time()  # CPU time: the suite's other workers share the cores, and wall time counts them
        try:
            lock.acquire()
            outcomes["held"] += 1
            lock.release()
        except RunFolderInUse as e:
            outcomes["refused"] += 1
            assert "\n" not in str(e) and len(str(e)) < 1000, (content[:80], str(e)[:300])
            assert (folder / LOCK_FILE).read_bytes() == content
        finally:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        assert time.process_time() - started < 2, content[:80]
        assert peak < 16 << 20, (content[:80], peak)
    assert outcomes["held"] and outcomes["refused"], outcomes  # the fuzz reached both outcomes
