"""shardlab.files.regular_file, the one way an untrusted file is opened: a regular file comes back open, with its
fstat; a symlink (not followed), a FIFO (without blocking), a folder, a socket, a device and a file past its cap are
refused saying what they are; a link the user may give is resolved, and kept inside its root when one is given. And
no other module of shardlab/ or shardlab_tasks/ opens a file its own way (a twin of it could not come back)."""

from __future__ import annotations

import ast
import os
import socket
import stat
import threading
from pathlib import Path

import pytest

from shardlab.files.regular_file import LINK, NotAFile, kind_of, open_file, read_small_file, stat_file

ROOT = Path(__file__).resolve().parents[2]
HOME = Path("shardlab/files/regular_file.py")


def opened(path: Path, **how) -> bytes:
    fd, st = open_file(path, **how)
    try:
        assert st.st_size == os.fstat(fd).st_size
        return os.read(fd, 100)
    finally:
        os.close(fd)


def refusal(path: Path, **how) -> NotAFile:
    with pytest.raises(NotAFile) as e:
        open_file(path, **how)
    assert "\n" not in str(e.value) and str(e.value) == e.value.reason
    return e.value


def test_a_regular_file_is_opened_and_within_its_cap_too(tmp_path):
    (tmp_path / "a").write_bytes(b"12345")
    assert opened(tmp_path / "a") == b"12345"
    assert opened(tmp_path / "a", max_bytes=5) == b"12345"
    assert stat_file(tmp_path / "a").st_size == 5


def test_a_symlink_is_refused_unless_followed(tmp_path):
    (tmp_path / "a").write_bytes(b"x")
    (tmp_path / "link").symlink_to(tmp_path / "a")
    (tmp_path / "zero").symlink_to("/dev/zero")
    assert refusal(tmp_path / "link").kind == LINK
    assert refusal(tmp_path / "zero").reason == f"is {LINK}, not a regular file"
    assert opened(tmp_path / "link", follow_links=True) == b"x"
    assert refusal(tmp_path / "zero", follow_links=True).kind == "a character device"  # followed, still no file


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    outcome: list[BaseException | None] = []

    def open_it() -> None:
        try:
            open_file(fifo)
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    worker = threading.Thread(target=open_it, daemon=True)
    worker.start()
    worker.join(timeout=10)
    if worker.is_alive():  # a blocking open waits for a writer: be one, so the thread ends, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("opening a FIFO blocked")
    assert isinstance(outcome[0], NotAFile) and outcome[0].kind == "a FIFO"


def test_a_folder_a_socket_and_a_device_are_refused_by_name(tmp_path):
    assert refusal(tmp_path).reason == "is a folder, not a regular file"
    assert refusal(Path("/dev/null"), follow_links=True).kind == "a character device"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tmp_path / "sock"))  # a socket cannot be opened at all: it is named, not "no such device"
        assert refusal(tmp_path / "sock").kind == "a socket"


def test_a_file_past_its_cap_is_refused_unread(tmp_path):
    (tmp_path / "big").write_bytes(b"x" * 101)
    refused = refusal(tmp_path / "big", max_bytes=100)
    assert (refused.size, refused.cap) == (101, 100)
    assert refused.reason == "holds 101 bytes, more than the 100 allowed"


def test_a_link_is_followed_inside_its_root_and_refused_out_of_it(tmp_path):
    (tmp_path / "corpus" / "in").mkdir(parents=True)
    (tmp_path / "corpus" / "in" / "a").write_bytes(b"inside")
    (tmp_path / "secret").write_bytes(b"outside")
    (tmp_path / "corpus" / "b").symlink_to("in/a")
    (tmp_path / "corpus" / "leak").symlink_to(tmp_path / "secret")
    assert opened(tmp_path / "corpus" / "b", root=tmp_path / "corpus") == b"inside"
    refused = refusal(tmp_path / "corpus" / "leak", root=tmp_path / "corpus")
    assert (refused.real, refused.kind) == (tmp_path / "secret", LINK)
    assert refused.reason == f"is a link to {tmp_path / 'secret'}, outside {tmp_path / 'corpus'}"


def test_what_the_kind_cannot_explain_passes_through_as_an_oserror(tmp_path):
    with pytest.raises(FileNotFoundError):
        open_file(tmp_path / "gone")
    (tmp_path / "loop").symlink_to("loop")
    with pytest.raises(OSError, match="Too many levels of symbolic links"):
        open_file(tmp_path / "loop", follow_links=True)  # a loop is no kind of file: the caller words the error


def test_the_kind_namer_names_every_kind():
    kinds = {stat.S_IFREG: "a regular file", stat.S_IFLNK: LINK, stat.S_IFDIR: "a folder", stat.S_IFIFO: "a FIFO",
             stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
             0: "not a file"}  # fmt: skip
    assert {mode: kind_of(mode | 0o644) for mode in kinds} == kinds


# ---- one place opens an untrusted file -------------------------------------------------------------------------------
def twins(root: Path) -> list[str]:
    """``path:line`` of each module of shardlab/, shardlab_tasks/ and shardlab_commands/ under ``root``, but
    regular_file.py, that opens a file to read it as regular_file does (os.open with O_NOFOLLOW or O_NONBLOCK, not to
    create it: a run lock's guard file is created so) or names a file's kind itself (S_ISFIFO): a twin of the one
    helper."""
    found = []
    for path in sorted(
        p for top in ("shardlab", "shardlab_tasks", "shardlab_commands") for p in (root / top).rglob("*.py")
    ):
        rel = path.relative_to(root)
        if rel == HOME:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "open":
                if names & {"O_NOFOLLOW", "O_NONBLOCK"} and "O_CREAT" not in names:
                    found.append(f"{rel}:{node.lineno}")
            elif isinstance(node, ast.Attribute) and node.attr == "S_ISFIFO":
                found.append(f"{rel}:{node.lineno}")
    return found


def test_no_other_module_opens_an_untrusted_file_its_own_way():
    assert twins(ROOT) == [], "open it through shardlab.files.regular_file.open_file (or stat_file) instead"


def test_the_twin_finder_finds_a_planted_twin(tmp_path):
    (tmp_path / "shardlab_tasks").mkdir()
    (tmp_path / "shardlab" / "files").mkdir(parents=True)
    (tmp_path / HOME).write_text("import os\nos.open(p, os.O_RDONLY | os.O_NOFOLLOW)\n")  # the home may
    (tmp_path / "shardlab" / "lock.py").write_text("import os\nos.open(p, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW)\n")
    assert twins(tmp_path) == []
    (tmp_path / "shardlab_tasks" / "reader.py").write_text(
        "import os\n\ndef f(p):\n    return os.open(p, os.O_NONBLOCK)\n"
    )
    (tmp_path / "shardlab" / "kinds.py").write_text("import stat\nstat.S_ISFIFO(0)\n")
    assert twins(tmp_path) == ["shardlab/kinds.py:2", "shardlab_tasks/reader.py:4"]


# ---- stat_file: the same refusals, without opening ----------------------------------------------------------------
def outcome_of(probe, path: Path, **how) -> tuple:
    """What ``probe`` says of ``path``: the size of a file, or the refusal's type and words."""
    try:
        result = probe(path, **how)
    except NotAFile as e:
        return ("NotAFile", e.kind, e.reason)
    except OSError as e:
        return (type(e).__name__, e.errno)
    if isinstance(result, os.stat_result):
        return ("file", result.st_size)
    os.close(result[0])  # open_file's descriptor
    return ("file", result[1].st_size)


def test_stat_file_refuses_what_open_file_refuses_without_opening_anything(tmp_path, monkeypatch):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "a").write_bytes(b"12345")
    (tmp_path / "corpus" / "link").symlink_to(tmp_path / "a")
    (tmp_path / "zero").symlink_to("/dev/zero")
    (tmp_path / "loop").symlink_to("loop")
    os.mkfifo(tmp_path / "fifo")
    cases = [("a", {}), ("a", {"max_bytes": 4}), ("zero", {}), ("zero", {"follow_links": True}), ("fifo", {}),
             ("corpus", {}), ("loop", {"follow_links": True}), ("gone", {}), ("corpus/link", {}),
             ("corpus/link", {"follow_links": True}), ("corpus/link", {"root": tmp_path / "corpus"})]  # fmt: skip
    expected = [outcome_of(open_file, tmp_path / name, **how) for name, how in cases]
    opens: list[str] = []
    monkeypatch.setattr(os, "open", lambda path, *a, **k: opens.append(str(path)) or pytest.fail(f"opened {path}"))
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tmp_path / "sock"))
        assert outcome_of(stat_file, tmp_path / "sock") == ("NotAFile", "a socket", "is a socket, not a regular file")
    assert [outcome_of(stat_file, tmp_path / name, **how) for name, how in cases] == expected
    assert opens == []
    assert expected[4] == ("NotAFile", "a FIFO", "is a FIFO, not a regular file")  # the FIFO: refused, never opened
    assert expected[1][2] == "holds 5 bytes, more than the 4 allowed" and expected[0] == ("file", 5)


def test_read_small_file_follows_links_out_of_the_folder_to_a_regular_file_within_its_cap(tmp_path):
    (tmp_path / "blobs").mkdir()
    (tmp_path / "snapshot").mkdir()
    (tmp_path / "blobs" / "abc").write_bytes(b"{}" * 50)
    (tmp_path / "snapshot" / "config.json").symlink_to("../blobs/abc")  # a Hugging Face cache's layout
    (tmp_path / "snapshot" / "zero.json").symlink_to("/dev/zero")
    assert read_small_file(tmp_path / "snapshot" / "config.json", max_bytes=100) == b"{}" * 50
    big = pytest.raises(NotAFile, read_small_file, tmp_path / "snapshot" / "config.json", max_bytes=99).value
    assert big.reason == "holds 100 bytes, more than the 99 allowed"
    assert pytest.raises(NotAFile, read_small_file, tmp_path / "snapshot" / "zero.json").value.kind == (
        "a character device"
    )
