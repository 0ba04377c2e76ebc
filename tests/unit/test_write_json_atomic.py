"""shardlab.files.durable.write_json_atomic: the one writer of status.json, tracker ids, rank notes and caches."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from shardlab.checkpoint import layout
from shardlab.files.durable import write_json_atomic


def test_writes_the_same_text_as_json_dumps(tmp_path: Path) -> None:
    obj = {"b": [1, 2], "a": {"x": None}}
    write_json_atomic(tmp_path / "s.json", obj, indent=1)
    assert (tmp_path / "s.json").read_text() == json.dumps(obj, indent=1)
    write_json_atomic(tmp_path / "s.json", obj)
    assert (tmp_path / "s.json").read_text() == json.dumps(obj)
    assert os.listdir(tmp_path) == ["s.json"]


def test_an_object_that_cannot_be_written_leaves_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "status.json"
    target.write_text('{"old": 1}')
    # The second value fails after the first was serialised: an in-place writer would leave "" or '{"a": 1, "b": '.
    with pytest.raises(TypeError):
        write_json_atomic(target, {"a": 1, "b": object()}, indent=1)
    assert json.loads(target.read_text()) == {"old": 1}
    assert os.listdir(tmp_path) == ["status.json"]


@pytest.mark.parametrize("fails", ["fsync", "replace"])
def test_a_failure_after_writing_leaves_the_old_file_and_no_temp(tmp_path: Path, monkeypatch, fails: str) -> None:
    """A failure between writing and publishing, as a kill there would be: the target still holds the old content
    (an in-place writer has already overwritten it when its fsync fails), and the temp file is gone."""
    target = tmp_path / "rates.json"
    target.write_text('{"old": 1}')

    def broken(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, fails, broken)
    with pytest.raises(OSError, match="No space left"):
        write_json_atomic(target, {"new": 2}, durable=True)
    monkeypatch.undo()
    assert json.loads(target.read_text()) == {"old": 1}
    assert os.listdir(tmp_path) == ["rates.json"]


def test_durable_fsyncs_the_file_and_its_folder(tmp_path: Path, monkeypatch) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    write_json_atomic(tmp_path / "a.json", {"a": 1})
    assert synced == []
    write_json_atomic(tmp_path / "a.json", {"a": 2}, durable=True)
    assert len(synced) == 2
    assert Path(synced[0]).parent == tmp_path and Path(synced[0]).name.endswith(".tmp")  # the data, before the rename
    assert Path(synced[1]) == tmp_path  # the rename
    assert json.loads((tmp_path / "a.json").read_text()) == {"a": 2}


def test_keeps_the_permissions_an_ordinary_write_gets(tmp_path: Path) -> None:
    """Not mkstemp's 0600: status.json and caches are read by other users and tools."""
    (tmp_path / "plain.json").write_text("{}")
    write_json_atomic(tmp_path / "atomic.json", {})
    assert (tmp_path / "atomic.json").stat().st_mode == (tmp_path / "plain.json").stat().st_mode


def test_threads_writing_one_file_never_collide(tmp_path: Path) -> None:
    """Temp names unique per call, not per process: with one name per pid, two threads' writes would clobber each
    other's temp file or fail to rename one that is already gone."""
    target, errors = tmp_path / "ids.json", []

    def writer(k: int) -> None:
        try:
            for i in range(30):
                write_json_atomic(target, {"writer": k, "i": i, "pad": "x" * 4096 * k})
        except Exception as e:  # noqa: BLE001 - reported by the assert below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    final = json.loads(target.read_text())
    assert final["i"] == 29 and final["pad"] == "x" * 4096 * final["writer"]
    assert os.listdir(tmp_path) == ["ids.json"]


def test_write_json_durably_stays_in_place_for_publish_only(tmp_path: Path) -> None:
    """publish writes shardlab.json in place inside step_N.tmp: a torn one there is never listed, and clean_stale
    removes the folder (the reason write_json_durably need not be atomic)."""
    torn = tmp_path / "step_00000010.tmp"
    torn.mkdir()
    (torn / layout.META_FILE).write_text('{"step": 1')
    assert layout.complete_checkpoints(tmp_path) == []
    assert layout.clean_stale(tmp_path) == ["removed step_00000010.tmp"]
    assert not torn.exists()
