"""A Hugging Face model folder's files fuzzed (issue 47, item 8), like tests/unit/test_corpus_fuzz.py for corpus
records: seeded mutations of config.json, model.safetensors.index.json, tokenizer.json, tokenizer_config.json and a
safetensors shard's header, each folder read as a start reads it (config.json as the model section, the index's files
and their headers, a tensor of each file, the tokenizer and its end-of-text token). Every case must end in bounded
time and memory, either read or refused in one line (a shardlab error); nothing else."""

from __future__ import annotations

import functools
import json
import math
import random
import struct
from pathlib import Path

import pytest

from shardlab.checkpoint.hf_folder import INDEX_FILE, read_tensors, tensor_files, weight_files
from shardlab.errors import ShardlabError
from shardlab_tasks.lm.corpus.tokenizer import FileTokenizer
from shardlab_tasks.lm.hf.hf_models import eos_token, model_section, read_config_json
from tests import fuzzing
from tests.hf_folders import make_folder

SEED = 47
CASES = 60
"""Cases per file: the whole file runs in ~20 s on the 2-core development machine."""
MAX_SECONDS = 3.0
MAX_PEAK_BYTES = 96 << 20
"""Python allocations at the peak of a case (tracemalloc; the Rust readers' own are not counted): the folder's files
are kilobytes, so a reader that builds anything from a crafted size fails."""

WEIRD = [None, True, False, 0, -1, 3.7, -16, 2**63, 10**400 // 10**390, math.nan, math.inf, -math.inf, "", "abc",
         "64", [], [1, 2], [None], {}, {"a": 1}, "x" * 5000, [[[[[]]]]]]  # fmt: skip
"""Values put in place of a JSON value: each type and range a field could be wrong in."""


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> dict[str, bytes]:
    folder = make_folder("llama3", tmp_path_factory.mktemp("hf") / "llama3")
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def replace_a_value(rng: random.Random, tree):
    """The JSON ``tree`` with one value somewhere (a key's, a list item's, or the whole tree) made WEIRD."""
    if not isinstance(tree, (dict, list)) or not tree or rng.random() < 0.15:
        return rng.choice(WEIRD)
    keys = list(tree) if isinstance(tree, dict) else list(range(len(tree)))
    key = rng.choice(keys)
    tree[key] = replace_a_value(rng, tree[key])
    return tree


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    """One to three of: bytes flipped, inserted or dropped, a cut, a piece repeated, or a crafted piece spliced in."""
    crafted = [b"[" * 100_000, b"9" * 50_000, b"\xff\xfe\xc3\x28", b"NaN", b"-Infinity", b'"\\ud800"', b"\x00" * 64]
    return fuzzing.mutate(rng, data, crafted)


def mutate_json(rng: random.Random, data: bytes) -> bytes:
    if rng.random() < 0.5:
        return mutate_bytes(rng, data)
    return json.dumps(replace_a_value(rng, json.loads(data))).encode()


def mutate_safetensors(rng: random.Random, data: bytes) -> bytes:
    """A shard with its header damaged: its length field crafted, or its JSON mutated (length kept or fixed)."""
    (length,) = struct.unpack("<Q", data[:8])
    header, body = data[8 : 8 + length], data[8 + length :]
    if rng.random() < 0.25:
        size = rng.choice([0, 1, length - 1, length + 1, 2**40, 2**63, 2**64 - 1, len(data)])
        return struct.pack("<Q", size) + data[8:]
    header = mutate_json(rng, header)
    size = len(header) if rng.random() < 0.8 else length
    return struct.pack("<Q", size) + header + body


def read_as_a_start_does(folder: Path) -> None:
    """config.json as the model section, the weight files the index names with their headers and a tensor of each,
    the tokenizer and its end-of-text token."""
    model_section(read_config_json(folder), folder / "config.json")
    stored = tensor_files(weight_files(folder))
    first: dict[Path, str] = {}
    for key, (file, _, _) in stored.items():
        first.setdefault(file, key)
    for file, key in first.items():
        read_tensors(file, [key], folder)
    FileTokenizer(folder / "tokenizer.json", eos_token(folder))


def one_case(rng: random.Random, target: str, original: dict[str, bytes], folder: Path) -> None:
    """``folder`` as the original, with ``target`` (a file name, or "shard") mutated."""
    for name, data in original.items():
        (folder / name).write_bytes(data)
    if target == "shard":
        shard = rng.choice(sorted(n for n in original if n.endswith(".safetensors")))
        (folder / shard).write_bytes(mutate_safetensors(rng, original[shard]))
    else:
        (folder / target).write_bytes(mutate_json(rng, original[target]))


@pytest.mark.parametrize("target", ["config.json", INDEX_FILE, "tokenizer.json", "tokenizer_config.json", "shard"])
def test_fuzzed_model_folder_files_are_read_or_refused_in_one_line_in_bounded_time_and_memory(
    original, tmp_path, target
):
    rng = random.Random(f"{SEED}-{target}")
    folder = tmp_path / "model"
    folder.mkdir()
    outcomes = {"read": 0, "refused": 0}
    for i in range(CASES):
        one_case(rng, target, original, folder)
        fuzzing.bounded_read(
            functools.partial(read_as_a_start_does, folder),
            ShardlabError,
            outcomes,
            f"case {i} ({target})",
            MAX_SECONDS,
            MAX_PEAK_BYTES,
        )
    assert outcomes["refused"], outcomes  # the mutations reach the refusals
