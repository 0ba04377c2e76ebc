"""What a corpus reader refuses and what it costs (issue 41, items 4 and 7): a long line in linear time and bounded by
data.max_corpus_mb, ``**`` globs that read each file once, FIFOs and devices refused, links kept inside the corpus."""

from __future__ import annotations

import gzip
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardlab.errors import DataError
from shardlab_tasks.lm.corpus import corpus
from shardlab_tasks.lm.corpus.cache import prepare_corpus
from shardlab_tasks.lm.corpus.corpus import find_sources, iter_texts, read_blocks
from tests.unit.test_cli import ROOT


def rels(path: Path) -> list[str]:
    return [s.rel for s in find_sources(path)]


def read_time(path: Path, block_bytes: int) -> float:
    (source,) = find_sources(path)
    start = time.perf_counter()
    assert sum(b.size for b in read_blocks(source, block_bytes=block_bytes)) == path.stat().st_size
    return time.perf_counter() - start


def test_a_long_jsonl_line_is_read_in_linear_time(tmp_path):
    # 8 MiB in 4 KiB reads: the reader that joined what it held to each read copied ~8 GiB (seconds), once per read
    size = 8 << 20
    (tmp_path / "one.jsonl").write_text(json.dumps({"text": "a" * size}) + "\n")
    (tmp_path / "many.jsonl").write_text((json.dumps({"text": "a" * 1000}) + "\n") * (size // 1000))
    one_line = min(read_time(tmp_path / "one.jsonl", 4096) for _ in range(2))
    many_lines = min(read_time(tmp_path / "many.jsonl", 4096) for _ in range(2))
    assert one_line < 4 * many_lines + 0.1, (one_line, many_lines)


def test_a_record_past_the_longest_held_is_refused_naming_file_and_line(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "MAX_RECORD_BYTES", 1 << 20)
    path = tmp_path / "bomb.jsonl.gz"
    with gzip.open(path, "wt") as f:  # ~30 KB on disk, a 64 MiB line inside
        f.write('{"text": "a"}\n{"text": "b"}\n{"text": "' + "x" * (64 << 20) + '"}\n')
    (source,) = find_sources(path)
    start = time.perf_counter()
    with pytest.raises(DataError) as refused:
        list(read_blocks(source))
    assert time.perf_counter() - start < 2  # stops at the cap, not at the line's end
    assert str(refused.value) == (
        f"{path}:3: a record longer than 1 MiB, the longest a corpus reader holds; split it into documents, or set "
        "data.max_corpus_mb to stop before it"
    )


def test_max_corpus_mb_ends_the_corpus_inside_a_long_record_without_reading_it(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "MAX_RECORD_BYTES", 4 << 20)  # the cap, lower, must end it before this refusal
    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": f"short {i}"}) + "\n" for i in range(100)))
        f.write(json.dumps({"text": "x" * (64 << 20)}) + "\n" + json.dumps({"text": "after"}) + "\n")
    sources = find_sources(tmp_path / "c.jsonl.gz")
    assert list(iter_texts(sources, "text", 1 << 20)) == [f"short {i}" for i in range(100)]
    out = prepare_corpus(str(tmp_path / "c.jsonl.gz"), str(tmp_path / "cache"), "byte", 5.0, 1.0)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["documents"]["train"] + meta["documents"]["valid"] == 100  # the long record left out, nothing after
    assert meta["valid_tokens"] > 0
    assert (1 << 20) < meta["bytes_read"] <= (1 << 20) + 2 * corpus.BLOCK_BYTES  # the cap, and a block past it


FIND = """import json, sys
from pathlib import Path
from shardlab_tasks.lm.corpus.corpus import find_sources
print(json.dumps([s.rel for s in find_sources(Path(sys.argv[1]))]))
"""


def find_in_child(path: Path) -> subprocess.CompletedProcess:
    """find_sources in a child process, so a reader that never ends (glob.glob over two links to a parent, a FIFO
    opened as a file) fails the test instead of hanging it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        return subprocess.run(
            [sys.executable, "-c", FIND, str(path)], capture_output=True, text=True, timeout=60, env=env
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"find_sources({path}) was still running after 60 s")


def refusals(path: Path) -> list[str]:
    done = find_in_child(path)
    assert done.returncode != 0
    return [line for line in done.stderr.splitlines() if line.startswith("shardlab.errors.DataError")]


def test_a_glob_over_symlink_loops_reads_each_file_once(tmp_path):
    c = tmp_path / "c"
    (c / "sub").mkdir(parents=True)
    (c / "a.txt").write_text("alpha\n")
    (c / "sub" / "b.txt").write_text("beta\n")
    for link, target in (("up", ".."), ("self", "."), ("sub/back", "../..")):
        (c / link).symlink_to(target)  # glob.glob followed them: a.txt 41 times with one, never ending with two
    (c / "sub" / "again.txt").symlink_to("../a.txt")  # a link to a corpus file: the file is read once
    start = time.perf_counter()
    assert json.loads(find_in_child(c / "**" / "*.txt").stdout) == ["a.txt", "sub/b.txt"]
    assert time.perf_counter() - start < 30  # a child's start-up (~1 s alone) on a loaded machine
    assert rels(c) == ["a.txt", "sub/b.txt"]
    assert rels(tmp_path / "*" / "*.txt") == ["c/a.txt"]


def test_a_glob_matches_as_glob_does_without_links(tmp_path):
    for name in ("x/1.txt", "x/y/2.txt", "x/y/z/3.jsonl", ".hidden/4.txt", "x/.5.txt", "w/6.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(json.dumps({"text": name}) + "\n")
    import glob

    for pattern in ("**/*.txt", "*/*.txt", "x/**", "x/*", "*", "**/y/*", "[wx]/*.??"):
        expected = corpus._candidates(tmp_path / pattern)[1]
        found = sorted(Path(p) for p in glob.glob(str(tmp_path / pattern), recursive=True))
        files = sorted({f for m in found for f in ([m] if m.is_file() else corpus._files_under(m, m))})
        assert expected == files, pattern


def test_a_fifo_as_data_path_or_in_it_is_refused_in_one_line(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    assert refusals(tmp_path / "pipe") == [
        f"shardlab.errors.DataError: {tmp_path / 'pipe'} is a FIFO, not a regular file; a corpus holds "
        "files: remove it from data.path"
    ]
    (tmp_path / "a.txt").write_text("text\n")
    assert len(refusals(tmp_path)) == 1  # listed, not opened: refused all the same


def test_devices_and_sockets_are_refused_naming_them(tmp_path):
    with pytest.raises(DataError, match=r"^/dev/zero is a character device, not a regular file"):
        find_sources(Path("/dev/zero"))
    (tmp_path / "a.txt").write_text("text\n")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tmp_path / "sock"))
        with pytest.raises(DataError, match=r"sock is a socket, not a regular file"):
            find_sources(tmp_path)
    (tmp_path / "sock").unlink()
    (tmp_path / "zero.txt").symlink_to("/dev/zero")
    with pytest.raises(DataError, match=r"zero.txt is a link to /dev/zero, outside the corpus folder"):
        find_sources(tmp_path)


def test_a_link_out_of_the_corpus_folder_is_refused_and_one_inside_is_read(tmp_path):
    secret = tmp_path / "private" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("do not train on me\n")
    c = tmp_path / "corpus"
    (c / "in").mkdir(parents=True)
    (c / "in" / "a.txt").write_text("alpha\n")
    (c / "b.txt").symlink_to("in/a.txt")  # inside: read (once, as in/a.txt comes later in order: b.txt)
    assert rels(c) == ["b.txt"]
    (c / "leak.txt").symlink_to(secret)
    with pytest.raises(DataError) as refused:
        find_sources(c)
    assert str(refused.value) == (
        f"{c / 'leak.txt'} is a link to {secret}, outside the corpus folder {c}; copy the file into the corpus "
        "folder, or point data.path at it"
    )
    assert [s.path for s in find_sources(c / "leak.txt")] == [c / "leak.txt"]  # named: read where it leads


def test_a_link_loop_or_a_dangling_link_is_one_line_naming_it(tmp_path):
    (tmp_path / "a.txt").write_text("text\n")
    (tmp_path / "loop.txt").symlink_to("loop2.txt")
    (tmp_path / "loop2.txt").symlink_to("loop.txt")
    with pytest.raises(DataError, match=r"^\S+loop\S*\.txt: cannot be read \(Too many levels of symbolic links\)"):
        find_sources(tmp_path)
    (tmp_path / "loop.txt").unlink()
    with pytest.raises(DataError, match=r"loop2.txt: cannot be read \(No such file or directory\)"):
        find_sources(tmp_path)


def test_a_link_repointed_out_of_the_folder_after_its_open_is_the_same_one_line(tmp_path, monkeypatch):
    from shardlab.files import regular_file
    from shardlab_tasks.lm.corpus import sources

    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.parquet").write_bytes(b"x")
    secret = tmp_path / "secret"

    calls, resolve = [], regular_file.real_path

    def flipped(path, root=None):  # opened inside the folder (first call), the link leads out of it at the second
        calls.append(path)
        if len(calls) == 1:
            return resolve(path, root)
        raise regular_file.NotAFile(path, regular_file.LINK, real=secret, root=root)

    monkeypatch.setattr(regular_file, "real_path", flipped)
    with pytest.raises(DataError) as refused:
        sources.regular_path(tmp_path / "c" / "a.parquet", tmp_path / "c")
    assert str(refused.value).startswith(f"{tmp_path / 'c' / 'a.parquet'} is a link to {secret}, outside the corpus")
    assert len(calls) == 2
