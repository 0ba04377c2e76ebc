"""The byte mutations the fuzz tests share (tests/unit/test_corpus_fuzz.py, test_hf_folder_fuzz.py): each test gives
the crafted pieces its own reader should meet."""

from __future__ import annotations

import random


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
