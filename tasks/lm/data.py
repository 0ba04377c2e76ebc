"""Text -> binarized tokens (the fairseq-preprocess analogue) and a dataset of fixed-length blocks.

A preprocessed corpus is a directory with train.bin / valid.bin (uint16 token ids, numpy memmap) and meta.json.
Documents are separated by an end-of-document token; a document goes to valid when a hash of its path says so, so the
split is stable as files are added. The embedded default corpus is this Python's standard library source: real text
that every machine already has.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from shardlab.errors import DataError

FORMAT_VERSION = 1
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".text", ".json", ".csv", ".tex", ".html", ".c", ".h", ""}


class ByteTokenizer:
    """Token = byte value (0..255); 256 = end of document. Lossless for any text, no training needed."""

    name = "byte"
    eod = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


TOKENIZERS = {"byte": ByteTokenizer}


def get_tokenizer(name: str) -> ByteTokenizer:
    if name not in TOKENIZERS:
        from shardlab.errors import ConfigError
        from shardlab.registry import unknown_name_message

        raise ConfigError(unknown_name_message(name, "tokenizer", sorted(TOKENIZERS), "data.tokenizer"))
    return TOKENIZERS[name]()


def embedded_corpus_files() -> list[Path]:
    """The standard library's own modules (tests and vendored packages excluded), in a stable order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "__pycache__", "turtledemo"}
    return sorted(p for p in stdlib.rglob("*.py") if not skip.intersection(p.relative_to(stdlib).parts))


def text_files(path: Path) -> list[Path]:
    """Text files under ``path`` (or ``path`` itself), sorted; raises DataError naming the path if there are none."""
    if not path.exists():
        raise DataError(f"data.path: {path} does not exist; give a text file or a directory of text files")
    files = (
        [path]
        if path.is_file()
        else sorted(
            p
            for p in path.rglob("*")
            if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES and not p.name.startswith(".")
        )
    )
    files = [p for p in files if _looks_like_text(p)]
    if not files:
        raise DataError(
            f"data.path: {path} holds no text files (looked for {', '.join(sorted(TEXT_SUFFIXES - {''}))}"
            " and extensionless files of UTF-8 text); point it at your corpus"
        )
    return files


def _looks_like_text(path: Path) -> bool:
    try:
        head = path.read_bytes()[:4096]
    except OSError:
        return False
    if not head.strip() or b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start > len(head) - 4  # a multi-byte character cut by the 4 KiB window is fine
    return True


def is_valid_document(relative_path: str, valid_percent: float) -> bool:
    digest = int.from_bytes(hashlib.sha1(relative_path.encode()).digest()[:4], "little")
    return digest % 10_000 < valid_percent * 100


def preprocess(
    files: list[Path], root: Path, out_dir: Path, tokenizer: ByteTokenizer, valid_percent: float, max_bytes: int = 0
) -> dict:
    """Tokenize ``files`` into out_dir/{train,valid}.bin + meta.json, written to a temp dir and renamed (atomic)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    splits: dict[str, list[np.ndarray]] = {"train": [], "valid": []}
    counts = {"train": 0, "valid": 0}
    read = 0
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        read += len(text)
        rel = str(f.relative_to(root)) if f != root else f.name
        split = "valid" if is_valid_document(rel, valid_percent) else "train"
        splits[split].append(np.asarray(tokenizer.encode(text) + [tokenizer.eod], dtype=np.uint16))
        counts[split] += 1
        if max_bytes and read >= max_bytes:
            break
    if not splits["valid"] and splits["train"]:  # tiny corpora: hold out the last document rather than nothing
        splits["valid"].append(splits["train"].pop())
        counts["valid"], counts["train"] = 1, counts["train"] - 1
    meta = {
        "format": FORMAT_VERSION,
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "dtype": "uint16",
        "documents": counts,
        "source": str(root),
    }
    for split, arrays in splits.items():
        tokens = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.uint16)
        tokens.tofile(tmp / f"{split}.bin")
        meta[f"{split}_tokens"] = int(tokens.size)
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    try:
        os.replace(tmp, out_dir)
    except OSError:  # another rank or run finished the same cache first: keep theirs
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return json.loads((out_dir / "meta.json").read_text())


def cache_key(files: list[Path], tokenizer: str, valid_percent: float, max_bytes: int) -> str:
    h = hashlib.sha1(f"{FORMAT_VERSION}|{tokenizer}|{valid_percent}|{max_bytes}".encode())
    for f in files:
        st = f.stat()
        h.update(f"{f}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def prepare_corpus(path: str | None, cache_dir: str, tokenizer: str, valid_percent: float, max_mb: float) -> Path:
    """The preprocessed directory for a corpus (built on first use, reused after)."""
    tok = get_tokenizer(tokenizer)
    if path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        files, name = embedded_corpus_files(), f"stdlib-py{sys.version_info.major}{sys.version_info.minor}"
    else:
        root = Path(path).expanduser().resolve()
        files, name = text_files(root), root.name or "corpus"
    max_bytes = int(max_mb * 2**20)
    out = Path(cache_dir).expanduser() / f"{name}-{cache_key(files, tok.name, valid_percent, max_bytes)}"
    if not (out / "meta.json").is_file():
        print(f"preprocessing {len(files)} files from {root} into {out} ...", flush=True)
        meta = preprocess(files, root if root.is_dir() else root.parent, out, tok, valid_percent, max_bytes)
        print(f"  {meta['train_tokens']:,} train / {meta['valid_tokens']:,} valid tokens", flush=True)
    return out


class TokenBlocks(Dataset):
    """Sample i = tokens [i * seq_len, (i + 1) * seq_len + 1): input is the first seq_len, target the last."""

    def __init__(self, bin_file: Path, seq_len: int) -> None:
        self.tokens = np.memmap(bin_file, dtype=np.uint16, mode="r")
        self.seq_len = seq_len
        self.num_samples = (len(self.tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise DataError(
                f"{bin_file} has {len(self.tokens)} tokens, fewer than data.seq_len + 1 = {seq_len + 1}; "
                "use more text or a smaller data.seq_len"
            )

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> torch.Tensor:
        start = i * self.seq_len
        return torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
