"""The byte mutations and the bounded read the fuzz tests share (tests/unit/test_corpus_fuzz.py,
test_hf_folder_fuzz.py): each test gives the crafted pieces its own reader should meet, and its reader."""

from __future__ import annotations

import random
import time
import tracemalloc
from collections.abc import Callable


def mutate(rng: random.Random, data: bytes, crafted: list[bytes]) -> bytes:
    """One to three of: bytes flipped, inserted or dropped, a cut, a piece repeated, or one of ``crafted`` spliced
    in."""
    data = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        op, at = rng.randrange(6), rng.randrange(len(data) + 1)
        if op == 0 and data:
            for _ in range(rng.randrange(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif op == 1:
            data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 16)))
        elif op == 2:
            del data[at : at + rng.randrange(1, 64)]
        elif op == 3:
            del data[at:]
        elif op == 4:
            data[at:at] = data[at : at + rng.randrange(1, 256)] * rng.randrange(2, 50)
        else:
            data[at:at] = rng.choice(crafted)
    return bytes(data)


def bounded_read(
    read: Callable[[], object], refusal: type[Exception], outcomes: dict, label: str, max_seconds: float, max_peak: int
) -> None:
    """``read()`` once: it reads (outcomes["read"] counted) or refuses with ``refusal`` in one non-empty line
    (outcomes["refused"]), either way within ``max_seconds`` and ``max_peak`` bytes of Python allocations."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        read()
        outcomes["read"] += 1
    except refusal as e:
        assert "\n" not in str(e) and str(e), f"{label}: {e!r}"
        outcomes["refused"] += 1
    finally:
        seconds = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert seconds < max_seconds, f"{label} took {seconds:.1f} s"
    assert peak < max_peak, f"{label} peaked at {peak >> 20} MiB"
