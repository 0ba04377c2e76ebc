"""Every file a run reads is read through the project's one reader (shardlab/files/regular_file.py: no link out of
its folder, no FIFO or device, bounded size): no ``read_text``, ``read_bytes``, ``open(`` or ``json.load`` anywhere else
in shardlab/ or shardlab_tasks/. A cache's plan.json as a FIFO once blocked every training start, and a
tokenizer_config.json of 4 GB was read whole, because each was read by a ``read_text`` beside the reader.

What is exempt, and why: files opened for writing (a mode with w, a or x: shardlab creates them), the kernel's files
(a path written as a "/proc/..." literal), and the short list below of reads of a file this process wrote itself or
holds open already, each with its reason."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
READER = "shardlab/files/regular_file.py"

ALLOWED = {
    # the temporary file this process wrote a line before, copied into a lock where hard links are not supported
    ("shardlab/jobs/run_lock.py", "RunLock._create"),
    # the result file in a temporary folder this process created (mkdtemp) for its spawned ranks
    ("shardlab/runner/__init__.py", "launch_local"),
    # the kernel's /proc/self/status, through a module constant
    ("shardlab/memory/meter.py", "_status_kib"),
    # torch.load of /proc/self/fd/N: the descriptor the reader opened and checked (open_file), not a path
    ("shardlab_tasks/image_classification/pretrained.py", "_load"),
}
"""(file, function) pairs that may read outside the reader, each for the reason above it. Keep it short."""

WRITE_MODES = set("wax")
OPENERS = {"io", "gzip", "bz2", "lzma", "codecs", "builtins", "tarfile", "zipfile"}
"""Modules whose ``open`` reads a path; any other receiver's ``.open(`` is a Path's (``path.open()``), bar these:"""
NOT_PATH_OPENERS = {"os", "Image"}
"""``os.open`` returns a descriptor (read with os.read: the reader's own tool, or fsync), PIL's ``Image.open`` is
handed a file object the reader opened."""


def _mode(call: ast.Call, position: int) -> str | None:
    """The literal mode of an open call (positional ``position`` or ``mode=``), None when not a literal."""
    node = call.args[position] if len(call.args) > position else None
    node = next((k.value for k in call.keywords if k.arg == "mode"), node)
    if node is None:
        return "r"
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _is_read(call: ast.Call) -> str | None:
    """What kind of unchecked read ``call`` is, or None."""
    func = call.func
    receiver = ast.unparse(func.value) if isinstance(func, ast.Attribute) else ""
    if "/proc/" in receiver or any("/proc/" in ast.unparse(a) for a in call.args):
        return None  # the kernel's files
    if isinstance(func, ast.Attribute) and func.attr in ("read_text", "read_bytes"):
        return func.attr
    if isinstance(func, ast.Attribute) and func.attr == "load" and receiver == "json":
        return "json.load"
    is_open = isinstance(func, ast.Name) and func.id == "open"
    module_open = isinstance(func, ast.Attribute) and func.attr == "open" and receiver in OPENERS
    path_open = isinstance(func, ast.Attribute) and func.attr == "open" and receiver not in OPENERS | NOT_PATH_OPENERS
    if not (is_open or module_open or path_open):
        return None
    mode = _mode(call, 0 if path_open else 1)
    if mode is not None and WRITE_MODES & set(mode) and "+" not in mode:
        return None  # a file shardlab creates or appends to
    return "open("


def unchecked_reads(source: str, name: str, allowed: set[tuple[str, str]] = ALLOWED) -> list[str]:
    """``name:line (function): kind`` of each read in ``source`` outside the reader and ``allowed``."""
    found = []

    def visit(node: ast.AST, qualname: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, f"{qualname}.{child.name}" if qualname else child.name)
                continue
            if isinstance(child, ast.Call):
                kind = _is_read(child)
                if kind and (name, qualname) not in allowed:
                    found.append(f"{name}:{child.lineno} ({qualname or 'module'}): {kind}")
            visit(child, qualname)

    visit(ast.parse(source), "")
    return found


def reads_outside_the_reader(root: Path) -> list[str]:
    """Every unchecked read of shardlab/, shardlab_tasks/ and shardlab_commands/ under ``root``."""
    found = []
    for folder in ("shardlab", "shardlab_tasks", "shardlab_commands"):
        for path in sorted((root / folder).rglob("*.py")):
            name = str(path.relative_to(root))
            if name != READER:
                found += unchecked_reads(path.read_text(), name)
    return found


def test_every_read_of_shardlab_and_tasks_goes_through_the_one_reader():
    found = reads_outside_the_reader(ROOT)
    assert not found, (
        "reads outside shardlab/files/regular_file.py: " + "; ".join(found) + ". Read through open_file / "
        "read_file / read_small_file / read_json_file (or a CheckpointError wrapper), or, for a file this process "
        "wrote itself, add it to ALLOWED with the reason"
    )


def test_every_allowed_read_still_exists():
    """An allow-list entry whose read is gone is removed: the list stays the short list of real exceptions."""
    for file, function in ALLOWED:
        reads = unchecked_reads((ROOT / file).read_text(), file, allowed=set())
        assert any(f"({function})" in r for r in reads), f"{file}: {function} reads nothing now; drop it from ALLOWED"


PLANTED = """
import json
from pathlib import Path


def plan(cache):
    return json.loads((Path(cache) / "shards" / "plan.json").read_text())


class Template:
    def load(self, path):
        with open(path) as f:
            return json.load(f)

    def raw(self, path):
        return Path(path).read_bytes(), Path(path).open("rb"), open(path, mode="rb"), gzip.open(path)

    def kernel(self):
        return Path("/proc/self/status").read_text()

    def write(self, path):
        with open(path, "w") as f, Path(path).open("ab") as g:
            f.write("x")
"""


def test_the_check_finds_each_kind_of_planted_read_by_line_and_function():
    found = unchecked_reads(PLANTED, "shardlab_tasks/lm/planted.py")
    assert found == [
        "shardlab_tasks/lm/planted.py:7 (plan): read_text",
        "shardlab_tasks/lm/planted.py:12 (Template.load): open(",
        "shardlab_tasks/lm/planted.py:13 (Template.load): json.load",
        "shardlab_tasks/lm/planted.py:16 (Template.raw): read_bytes",
        "shardlab_tasks/lm/planted.py:16 (Template.raw): open(",
        "shardlab_tasks/lm/planted.py:16 (Template.raw): open(",
        "shardlab_tasks/lm/planted.py:16 (Template.raw): open(",
    ]


def test_the_check_fails_on_a_read_planted_in_a_copy_of_the_tree(tmp_path):
    for folder in ("shardlab", "shardlab_tasks"):
        (tmp_path / folder).mkdir()
    (tmp_path / "shardlab_tasks" / "clean.py").write_text("def f(path):\n    return path.name\n")
    assert reads_outside_the_reader(tmp_path) == []
    (tmp_path / "shardlab_tasks" / "lm" / "corpus").mkdir(parents=True)
    (tmp_path / "shardlab_tasks" / "lm" / "corpus" / "shards.py").write_text(
        "import json\n\n\ndef progress(out):\n    return json.loads((out / 'plan.json').read_text())\n"
    )
    assert reads_outside_the_reader(tmp_path) == ["shardlab_tasks/lm/corpus/shards.py:5 (progress): read_text"]
    # the reader itself and an allowed (file, function) are not reported
    (tmp_path / "shardlab" / "files").mkdir()
    (tmp_path / READER).write_text("def read(path):\n    return open(path).read()\n")
    (tmp_path / "shardlab" / "runner").mkdir()
    (tmp_path / "shardlab" / "runner" / "__init__.py").write_text("def launch_local(f):\n    return f.read_text()\n")
    assert reads_outside_the_reader(tmp_path) == ["shardlab_tasks/lm/corpus/shards.py:5 (progress): read_text"]
