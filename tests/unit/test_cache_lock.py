"""One writer per corpus cache: concurrent processes wait for it and reuse its files, a dead writer's lock is taken
over (same host: at once; another host: after its heartbeat stops), and a failed build leaves no lock or cache behind,
only its error for the processes that waited for it."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from filelock import OwnerRecord, SoftFileLease
from filelock._soft import encode_marker  # the marker's format, to stage writers that are not there

from shardlab.errors import DataError
from shardlab_tasks.lm.corpus import cache_lock
from shardlab_tasks.lm.corpus.cache import prepare_corpus
from shardlab_tasks.lm.corpus.cache_lock import build_once, lock_path, temp_prefix

ROOT = Path(__file__).resolve().parents[2]


def _build_slowly(
    out: str, log: str, seconds: float, heartbeat_s: float = cache_lock.HEARTBEAT_S, stale_s: float = cache_lock.STALE_S
) -> None:
    """A process that wants the cache: its builder writes a marker naming itself, slowly."""
    cache_lock.HEARTBEAT_S, cache_lock.STALE_S = heartbeat_s, stale_s

    def build():
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(seconds)
        tmp = Path(out + ".tmp")
        tmp.mkdir()
        (tmp / "meta.json").write_text(json.dumps({"by": os.getpid()}))
        os.replace(tmp, out)

    build_once(Path(out), build, lambda line: None)


def _marker(out: Path, pid: int, host: str, start: int | None = None) -> None:
    """A lock as filelock's SoftFileLease writes it, of a writer this test makes up (its pid, host, start token)."""
    record = OwnerRecord(pid, host, "lease", token="0" * 32, lease_duration=cache_lock.STALE_S, start=start)
    lock_path(out).write_bytes(encode_marker(record))


def _this_host() -> str:
    """This host as filelock records it (with a container's pid-namespace mark), read from a lease held here."""
    lease = SoftFileLease(Path(tempfile.mkdtemp()) / "probe.lock")
    with lease:
        return lease.owner.hostname


def finish(out: Path) -> None:
    """A build in one step: the cache directory with its completion marker."""
    out.mkdir()
    (out / "meta.json").write_text("{}")


def test_concurrent_processes_build_a_cache_once_and_all_find_it(tmp_path):
    out, log = tmp_path / "corpus-abc", tmp_path / "builds.log"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_build_slowly, args=(str(out), str(log), 1.5)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    builders = log.read_text().split()
    assert len(builders) == 1  # the other two waited for the first one's meta.json
    assert json.loads((out / "meta.json").read_text())["by"] == int(builders[0])
    assert not lock_path(out).exists()


def test_lock_of_a_killed_process_on_this_host_is_taken_over_and_its_temp_dir_removed(tmp_path):
    """A writer killed (SIGKILL: nothing of it runs to release the lock) while it holds the lock and its temporary
    directory: the next process takes the lock over at once, not after the stale timeout, and removes the directory."""
    out = tmp_path / "corpus-abc"
    code = (
        "import os, signal, sys; from pathlib import Path\n"
        "from shardlab_tasks.lm.corpus.cache_lock import _lease, temp_prefix\n"
        "out = Path(sys.argv[1]); lease = _lease(out); lease.acquire(); print(os.getpid(), flush=True);"
        "(out.parent / (temp_prefix(out) + 'xyz')).mkdir(); os.kill(os.getpid(), signal.SIGKILL)"
    )
    killed = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, cwd=ROOT)
    assert killed.returncode == -9, killed.stderr
    orphan = tmp_path / (temp_prefix(out, socket.gethostname(), int(killed.stdout)) + "xyz")
    assert orphan.is_dir() and lock_path(out).exists()
    built = []
    started = time.monotonic()
    build_once(out, lambda: built.append(finish(out)), lambda line: None)
    assert time.monotonic() - started < cache_lock.STALE_S / 2
    assert built and (out / "meta.json").is_file()
    assert not orphan.exists() and not lock_path(out).exists()


def test_a_dead_writers_pid_now_running_another_process_does_not_keep_its_lock(tmp_path, monkeypatch):
    """The writer's pid was reused by an unrelated process: its start time tells them apart (filelock's check), so the
    lock is taken over at once rather than after STALE_S without heartbeats."""
    monkeypatch.setattr(cache_lock, "STALE_S", 30.0)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        out = tmp_path / "corpus-abc"
        _marker(out, other.pid, _this_host(), start=1)
        started = time.monotonic()
        build_once(out, lambda: finish(out), lambda line: None)
        assert (out / "meta.json").is_file() and time.monotonic() - started < 5
    finally:
        other.kill()
        other.wait()


def test_lock_from_another_host_is_taken_over_once_its_heartbeat_stops(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_lock, "STALE_S", 1.0)
    monkeypatch.setattr(cache_lock, "POLL_S", 0.05)
    out = tmp_path / "corpus-abc"
    _marker(out, 1, "another-node")
    said = []
    started = time.monotonic()
    build_once(out, lambda: finish(out), said.append)
    assert (out / "meta.json").is_file() and time.monotonic() - started >= 1.0  # not before STALE_S
    assert said == [f"waiting for another-node pid 1, which is preprocessing {out}"]  # once, naming the writer


def test_a_live_writers_lock_is_waited_for_not_broken(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_lock, "STALE_S", 0.5)
    monkeypatch.setattr(cache_lock, "POLL_S", 0.05)
    out = tmp_path / "corpus-abc"
    ctx = mp.get_context("spawn")
    writer = ctx.Process(target=_build_slowly, args=(str(out), str(tmp_path / "log"), 2.0, 0.1, 0.5))
    writer.start()
    while not lock_path(out).exists():
        time.sleep(0.01)
    build_once(out, lambda: pytest.fail("built although a live writer held the lock"), lambda line: None)
    writer.join(30)
    assert json.loads((out / "meta.json").read_text())["by"] == writer.pid


def test_failed_build_leaves_no_lock_and_the_next_process_builds(tmp_path):
    out = tmp_path / "corpus-abc"

    def fail():
        raise DataError("bad corpus")

    with pytest.raises(DataError, match="bad corpus"):
        build_once(out, fail)
    assert not lock_path(out).exists()
    build_once(out, lambda: finish(out))
    assert (out / "meta.json").is_file()


def _build_and_fail(out: str, log: str, seconds: float, queue, start) -> None:
    """A process that wants the cache (once every process has started); its build fails after ``seconds`` (a full
    disk, a bad file late in the corpus: the same on every try). Puts (its error, when it was raised)."""

    def build():
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(seconds)
        raise OSError(28, "No space left on device")

    start.wait(60)
    try:
        build_once(Path(out), build, lambda line: None)
    except (OSError, DataError) as e:
        queue.put((str(e), time.time()))


def test_a_failed_build_stops_the_processes_waiting_for_it_with_its_error(tmp_path):
    """Three ranks want one new cache and the first one's build fails: the two waiting for it fail with its error at
    once, instead of each building again in turn (3 builds, one after another, before)."""
    out, log = tmp_path / "corpus-abc", tmp_path / "builds.log"
    ctx = mp.get_context("spawn")
    queue, start = ctx.Queue(), ctx.Barrier(3)
    # The build lasts 6 s: a process the loaded machine leaves unscheduled for a while after the barrier must still
    # find it running (one that comes after a failed build builds again, by design); at 2 s a loaded CI run saw two.
    procs = [ctx.Process(target=_build_and_fail, args=(str(out), str(log), 6.0, queue, start)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    errors = sorted((queue.get(timeout=5) for _ in procs), key=lambda e: e[1])
    (builder,) = log.read_text().split()
    assert errors[0][0] == "[Errno 28] No space left on device"
    for error, at in errors[1:]:
        assert error == (f"preprocessing {out} failed in {socket.gethostname()} pid {builder}, which this process "
                         "waited for: OSError: [Errno 28] No space left on device")  # fmt: skip
        assert at - errors[0][1] < 2.0
    assert not lock_path(out).exists()
    build_once(out, lambda: finish(out))  # a process that comes later builds again, and succeeds
    assert (out / "meta.json").is_file() and not cache_lock.failure_path(out).exists()


def _prepare(path: str, cache: str, queue) -> None:
    out = prepare_corpus(path, cache, "byte", 10.0, 0, num_workers=0)
    queue.put(str(out))


def test_two_processes_preprocessing_one_corpus_get_identical_token_files(tmp_path):
    corpus = tmp_path / "text.txt"
    corpus.write_text("".join(f"line {i} of a corpus two processes preprocess at once\n" for i in range(60_000)))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_prepare, args=(str(corpus), str(tmp_path / "cache"), queue)) for _ in range(2)]
    for p in procs:
        p.start()
    outs = {queue.get(timeout=120) for _ in procs}
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    (out,) = outs
    out = Path(out)
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # no temp dir, no lock left
    meta = json.loads((out / "meta.json").read_text())
    tokens = np.fromfile(out / "train.bin", dtype=meta["dtype"])
    assert tokens.size == meta["train_tokens"] > 0


def test_preprocessing_modules_do_not_import_torch():
    """Preprocessing workers import them (spawned, one per core): torch alone would cost each ~650 MB and seconds."""
    code = (
        "import sys, shardlab_tasks.lm.corpus.cache, shardlab_commands.preprocess_lm; "
        "print(sorted(m for m in sys.modules if m == 'torch'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip() == "[]"
