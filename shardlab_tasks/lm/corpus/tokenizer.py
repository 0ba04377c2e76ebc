"""Tokenizers of the LM task: the built-in byte tokenizer, or any Hugging Face ``tokenizer.json``.

``data.tokenizer=byte`` (the default) needs nothing beyond numpy; a path loads a trained tokenizer through the
``tokenizers`` library, imported here only when a path is given, so a byte-level run never imports it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from shardlab.errors import ConfigError, DataError
from shardlab.files.regular_file import NotAFile, read_small_file

TOKENIZER_MAX_BYTES = 1 << 30
"""A tokenizer.json larger than this is refused (the largest published ones hold tens of MB)."""

SEGMENT_CHARS = 1 << 16
"""Tokenize text in ~64 KB pieces cut at line ends: the tokenizers library encodes those ~40% faster than 1 MB."""
EOD_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")
"""End-of-document tokens looked for, in order, in a tokenizer file (GPT-2, Llama 2, Llama 3, Gemma, ..., BERT)."""


class ByteTokenizer:
    """Token = byte value (0..255); 256 = end of document. Lossless for any text, no training needed."""

    name = "byte"
    fingerprint = "byte"
    eod_token = None
    splits_cleanly = True
    eod = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, texts: list[str]) -> np.ndarray:
        """The ids of ``texts`` encoded one by one and concatenated."""
        return np.frombuffer("".join(texts).encode("utf-8"), dtype=np.uint8)

    def encode_documents(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(the ids of ``texts`` concatenated, each text's number of ids). A lookup: one copy of the UTF-8 bytes,
        read in place by numpy, with no Python object per token."""
        data = [t.encode("utf-8") for t in texts]
        return np.frombuffer(b"".join(data), dtype=np.uint8), np.fromiter(map(len, data), np.int64, len(data))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class FileTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer read from its ``tokenizer.json`` (GPT-2's, Llama's, one's own)."""

    def __init__(self, path: str | Path, eod_token: str | None = None) -> None:
        from tokenizers import Tokenizer  # only here: byte-level runs never import tokenizers

        self.path = Path(path).expanduser().resolve()
        self.name = str(self.path)
        self.eod_token = eod_token
        try:  # as a file: a FIFO would hang the tokenizers library's own open, a device feed it for ever
            raw = read_small_file(self.path, max_bytes=TOKENIZER_MAX_BYTES)
        except FileNotFoundError:
            raise ConfigError(
                f"data.tokenizer: {self.path} does not exist; give 'byte' or the path of a tokenizer.json "
                "(shardlab-preprocess --train-tokenizer bpe writes one)"
            ) from None
        except (NotAFile, OSError) as e:
            reason = e.reason if isinstance(e, NotAFile) else f"is unreadable ({e.strerror or type(e).__name__})"
            raise ConfigError(f"data.tokenizer: {self.path} {reason}; give the path of a tokenizer.json") from None
        try:
            self.tok = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # the Rust parser's errors have no common type
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DataError(
                f"data.tokenizer: {self.path} is not a tokenizer.json the tokenizers library can read ({reason}); "
                "give a Hugging Face tokenizer.json or 'byte'"
            ) from None
        self.fingerprint = hashlib.sha1(raw).hexdigest()[:16]
        vocab = self.tok.get_vocab(with_added_tokens=True)
        # Ids, not the count of entries, bound the embedding: some tokenizers leave holes in their id range.
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        self.eod = self._find_eod(vocab, eod_token)
        # Whether text may be encoded in pieces: false for tokenizers that mark each encode's start (SentencePiece's
        # prepended "▁" in Llama's), where every piece would gain a space.
        self.splits_cleanly = self.decode(self.encode("a\n") + self.encode("b")) == "a\nb"

    def _find_eod(self, vocab: dict[str, int], eod_token: str | None) -> int:
        if eod_token is not None:
            if eod_token not in vocab:
                raise ConfigError(f"data.eod_token: {eod_token!r} is not a token of {self.path}; pick one it has")
            return vocab[eod_token]
        for token in EOD_TOKENS:
            if token in vocab:
                return vocab[token]
        raise ConfigError(
            f"data.tokenizer: {self.path} has none of the end-of-document tokens {', '.join(EOD_TOKENS)}; "
            "name one of its tokens with data.eod_token=<token>"
        )

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_array(self, texts: list[str]) -> np.ndarray:
        """The ids of ``texts`` encoded one by one and concatenated. encode_batch_fast skips the offsets encode
        computes: measured ~25% less CPU for the same ids (threads off in workers: TOKENIZERS_PARALLELISM=false)."""
        batch = self.tok.encode_batch_fast(texts, add_special_tokens=False)
        return np.concatenate([np.asarray(e.ids, dtype=np.uint32) for e in batch]) if batch else np.zeros(0, np.uint32)

    def encode_documents(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(the ids of ``texts`` concatenated, each text's number of ids), all of them in one encode_batch_fast
        call (a block's documents, cut into ~64 KB pieces where the tokenizer allows): one call per block rather
        than one per document, and the library's threads, where enabled, share the whole block."""
        pieces = [list(segments(t)) for t in texts] if self.splits_cleanly else [[t] for t in texts]
        batch = self.tok.encode_batch_fast([p for doc in pieces for p in doc], add_special_tokens=False)
        piece_ids = [e.ids for e in batch]
        per_piece = np.fromiter(map(len, piece_ids), np.int64, len(piece_ids))
        ids = np.fromiter((i for p in piece_ids for i in p), np.uint32, int(per_piece.sum()))
        doc_of_piece = np.repeat(np.arange(len(texts)), [len(doc) for doc in pieces])
        per_doc = np.bincount(doc_of_piece, weights=per_piece, minlength=len(texts)).astype(np.int64)
        return ids, per_doc

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


Tokenizer = ByteTokenizer | FileTokenizer


def segments(text: str) -> Iterator[str]:
    """``text`` in pieces of at most SEGMENT_CHARS cut after a line end (between characters where a line is longer)."""
    start = 0
    while start < len(text):
        end = text.rfind("\n", start, start + SEGMENT_CHARS) + 1 if len(text) - start > SEGMENT_CHARS else len(text)
        end = end if end > start else min(start + SEGMENT_CHARS, len(text))
        yield text[start:end]
        start = end


def load_tokenizer(spec: str, eod_token: str | None = None) -> Tokenizer:
    """``byte`` or the path of a tokenizer.json (the value of data.tokenizer)."""
    if spec == "byte":
        if eod_token is not None:
            raise ConfigError("data.eod_token applies to tokenizer files only; the byte tokenizer's is fixed (256)")
        return ByteTokenizer()
    if "/" not in spec and not spec.endswith(".json"):
        raise ConfigError(
            f"data.tokenizer: {spec!r} is neither 'byte' nor a path to a tokenizer.json; "
            "give 'byte' or a path (e.g. ./tokenizer.json)"
        )
    return FileTokenizer(spec, eod_token)


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every token id: uint16 up to 65,536 tokens, uint32 above."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def train_bpe(texts: Iterable[str], vocab_size: int, out: Path) -> Path:
    """Train a byte-level BPE (GPT-2's scheme, <|endoftext|> as end of document) on ``texts``; save it to ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < 257 + 1:
        raise ConfigError(f"--vocab-size ({vocab_size}) must exceed 257 (256 byte tokens + <|endoftext|>)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte stays encodable, seen or not
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return out


def byte_tokenizer_json(vocab_size: int) -> str:
    """A tokenizer.json equivalent to ByteTokenizer, for export: 256 byte tokens (GPT-2's byte-to-unicode alphabet),
    <|endoftext|> at 256, and the model's padding ids as unused special tokens, so ids and decoding match exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_chars = _gpt2_bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split: every byte is its own token, exactly as ByteTokenizer.encode.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", *(f"<|pad_{i}|>" for i in range(257, vocab_size))])
    return tok.to_str()


def _gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (the ByteLevel pre-tokenizer's alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars
