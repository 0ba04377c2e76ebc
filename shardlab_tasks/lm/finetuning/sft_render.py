"""A chat template rendered in a child process with limits: a wall-clock limit per record, a memory limit and an
output-size limit, each refused in one line naming the record and the template.

Jinja2's sandbox (shardlab_tasks/lm/finetuning/sft_template.py) keeps a template from reaching Python (it blocked 22
injection attempts), but not from costing without bound: nested ``range(100000)`` loops ran past 15 s, and
``'a'*10**10``,
``tojson(indent=10**9)`` and ``strftime_now('%Y'*10**8)`` each passed 1.5 GB in seconds. A template is a model
folder's file, that is someone else's code: every record of data.format=chat is rendered by one child process
(``python -m shardlab_tasks.lm.finetuning.sft_render``: jinja2 and this module, no torch), started once per data load,
whose address space is capped (RLIMIT_AS: its size at start plus ``memory_bytes``) and which the parent kills when a
record takes longer than ``timeout_s``. The child streams the output and stops past RENDER_MAX_CHARS. Records go in as
pickles (the parent's own objects), answers come back as JSON.
"""

from __future__ import annotations

import json
import os
import pickle
import select
import struct
import subprocess
import sys
import time
from pathlib import Path

from shardlab.errors import DataError

RENDER_TIMEOUT_S = 10.0
"""The longest one record may take to render (a real template renders a record in milliseconds)."""
RENDER_MEMORY_BYTES = 2 * 2**30
"""The memory the child may take beyond what it holds at start (RLIMIT_AS)."""
_HEADER = struct.Struct("<Q")


class BoundedRenderer:
    """``assistant_spans`` of a ChatTemplate, computed in a child process with limits; a context manager (the child
    ends with it). Duck-types the template for shardlab_tasks/lm/finetuning/sft.py's chat_sample."""

    def __init__(self, template, timeout_s: float | None = None, memory_bytes: int | None = None) -> None:
        self.template, self.origin, self.marks_generation = template, template.origin, template.marks_generation
        self.timeout_s = RENDER_TIMEOUT_S if timeout_s is None else timeout_s
        self.memory_bytes = RENDER_MEMORY_BYTES if memory_bytes is None else memory_bytes
        self._child: subprocess.Popen | None = None

    def __enter__(self) -> BoundedRenderer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.wait()
            self._child = None

    def _start(self) -> subprocess.Popen:
        if self._child is None:
            root = str(
                Path(__file__).resolve().parents[2]
            )  # the folder holding shardlab_tasks/, whatever sys.path says
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
            self._child = subprocess.Popen(
                [sys.executable, "-m", "shardlab_tasks.lm.finetuning.sft_render", str(self.memory_bytes),
                 str(self.memory_bytes >> 20)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
            )  # fmt: skip
            t = self.template
            _send(self._child.stdin, pickle.dumps((t.source, t.special_tokens, t.origin)))
        return self._child

    def assistant_spans(self, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
        child = self._start()
        try:
            _send(child.stdin, pickle.dumps((messages, where)))
            answer = _receive(child.stdout, time.monotonic() + self.timeout_s)
        except BrokenPipeError:  # the child is gone (killed from outside, say)
            answer = EOFError
        if answer is None:
            self.close()
            raise DataError(
                f"{where}: the chat template of {self.origin} took more than {self.timeout_s:g} s to render it; "
                "refused: fix the template or delete the record"
            )
        if answer is EOFError:
            code = child.poll()
            self.close()
            raise DataError(
                f"{where}: the chat template of {self.origin} ended its renderer (exit code {code}); refused"
            )
        reply = json.loads(answer)
        if "error" in reply:
            raise DataError(reply["error"])
        return reply["text"], [tuple(s) for s in reply["spans"]]


def _send(pipe, payload: bytes) -> None:
    pipe.write(_HEADER.pack(len(payload)) + payload)
    pipe.flush()


def _receive(pipe, deadline: float) -> bytes | None | type[EOFError]:
    """One framed message from ``pipe``; None once ``deadline`` passes first, EOFError when the writer is gone."""
    fd, data, need = pipe.fileno(), b"", _HEADER.size
    header = None
    while len(data) < need:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, need - len(data))
        if not chunk:
            return EOFError
        data += chunk
        if header is None and len(data) == need:
            header, data = _HEADER.unpack(data)[0], b""
            need = header
            deadline = max(deadline, time.monotonic() + 60)  # the answer is written: its bytes are read in full
    return data


# ---- the child ---------------------------------------------------------------------------------------------------
def _read_exact(stream, n: int) -> bytes | None:
    data = stream.read(n)
    return data if len(data) == n else None


def _limit_memory(extra_bytes: int) -> None:
    """Cap this process's address space at its size now plus ``extra_bytes``: past it an allocation fails
    (MemoryError) instead of growing without bound."""
    import resource

    with open("/proc/self/statm") as f:  # the kernel's own file
        size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (size + extra_bytes, size + extra_bytes))


def _answer(template, messages, where: str, memory_mib: str) -> dict:
    try:
        text, spans = template.assistant_spans(messages, where)
    except MemoryError:
        return {"error": f"{where}: the chat template of {template.origin} needed more than the {memory_mib} MiB of "
                         "memory a render may take; refused: fix the template or delete the record"}  # fmt: skip
    except DataError as e:
        return {"error": str(e)}
    return {"text": text, "spans": spans}


def main() -> None:
    from shardlab_tasks.lm.finetuning.sft_template import ChatTemplate

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    header = _read_exact(stdin, _HEADER.size)
    source, special, origin = pickle.loads(stdin.read(_HEADER.unpack(header)[0]))
    template = ChatTemplate(source, special, origin)
    _limit_memory(int(sys.argv[1]))
    while (header := _read_exact(stdin, _HEADER.size)) is not None:
        messages, where = pickle.loads(stdin.read(_HEADER.unpack(header)[0]))
        _send(stdout, json.dumps(_answer(template, messages, where, sys.argv[2])).encode())


if __name__ == "__main__":
    main()
