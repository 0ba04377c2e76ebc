"""Binarize a corpus for the LM task (the fairseq-preprocess analogue), optionally training its tokenizer first.

    python tools/preprocess_lm.py /my/text/dir                          # -> ~/.cache/shardlab/<name>-<hash>/
    python tools/preprocess_lm.py /data/shards --text-field text         # *.jsonl(.gz/.zst): a line; *.parquet: a row
    python tools/preprocess_lm.py /my/text/dir --tokenizer gpt2/tokenizer.json
    python tools/preprocess_lm.py --train-tokenizer bpe --vocab-size 4096   # a byte-level BPE of the embedded corpus

Training runs this step themselves on first use (data.path=..., data.tokenizer=...) and reuse the result; run it
ahead of time to preprocess once for many jobs. Output: train.bin / valid.bin (uint16 token ids, uint32 for
vocabularies above 65,536), meta.json, and with --train-tokenizer the tokenizer.json to train with.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from shardlab.errors import ConfigError
from shardlab.train import run_tool
from tasks.lm.cache import corpus_sources, prepare_corpus
from tasks.lm.config import LMDataConfig
from tasks.lm.corpus import iter_texts
from tasks.lm.tokenizer import FileTokenizer, load_tokenizer, train_bpe


def main(argv: list[str] | None = None) -> Path:
    defaults = LMDataConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "path", nargs="?", default=None, help="text/JSONL file or directory; omit for the embedded corpus"
    )
    parser.add_argument("--cache-dir", default=defaults.cache_dir)
    parser.add_argument("--tokenizer", default=defaults.tokenizer, help="'byte' or the path of a tokenizer.json")
    parser.add_argument("--eod-token", default=defaults.eod_token, help="end-of-document token of --tokenizer")
    parser.add_argument("--train-tokenizer", choices=["bpe"], help="train a byte-level BPE on the corpus first")
    parser.add_argument("--vocab-size", type=int, default=8192, help="vocabulary of the trained tokenizer")
    parser.add_argument("--tokenizer-sample-mb", type=float, default=100.0, help="MB of the corpus to train it on")
    parser.add_argument(
        "--text-field", "--jsonl-field", default=defaults.text_field, help="JSONL key or Parquet/Arrow column of text"
    )
    parser.add_argument("--valid-percent", type=float, default=defaults.valid_percent)
    parser.add_argument("--max-corpus-mb", type=float, default=defaults.max_corpus_mb)
    parser.add_argument("--workers", type=int, default=defaults.num_preprocess_workers, help="-1: one per core")
    args = parser.parse_args(argv)

    cache_dir = Path(args.cache_dir).expanduser()
    if args.train_tokenizer:
        if args.tokenizer != "byte":
            raise ConfigError("--train-tokenizer trains a new tokenizer; drop --tokenizer, or drop --train-tokenizer")
        sources, _ = corpus_sources(args.path)
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="tokenizer-", dir=cache_dir) as tmp:
            print(f"training a byte-level BPE ({args.vocab_size} tokens) on {args.tokenizer_sample_mb:g} MB ...")
            sample = iter_texts(sources, args.text_field, int(args.tokenizer_sample_mb * 2**20))
            tok_file = train_bpe(sample, args.vocab_size, Path(tmp) / "tokenizer.json")
            out = _prepare(args, FileTokenizer(tok_file), {"tokenizer.json": tok_file})
    else:
        out = _prepare(args, load_tokenizer(args.tokenizer, args.eod_token), None)
    meta = json.loads((out / "meta.json").read_text())
    print(
        f"{out}: {meta['train_tokens']:,} train / {meta['valid_tokens']:,} valid tokens "
        f"({meta['documents']['train']} / {meta['documents']['valid']} documents, {meta['dtype']})"
    )
    if args.train_tokenizer:
        print(f"train with: python -m shardlab.train data.tokenizer={out / 'tokenizer.json'}{_data_overrides(args)}")
    return out


def _data_overrides(args) -> str:
    """The data.* overrides that make training find this cache (the ones that differ from the defaults)."""
    d = LMDataConfig()
    pairs = [
        ("path", str(Path(args.path).expanduser().resolve()) if args.path else None, d.path),
        ("cache_dir", args.cache_dir, d.cache_dir),
        ("text_field", args.text_field, d.text_field),
        ("valid_percent", args.valid_percent, d.valid_percent),
        ("max_corpus_mb", args.max_corpus_mb, d.max_corpus_mb),
    ]
    return "".join(f" data.{key}={value}" for key, value, default in pairs if value != default)


def _prepare(args, tokenizer, extra_files) -> Path:
    return prepare_corpus(
        args.path,
        args.cache_dir,
        tokenizer,
        args.valid_percent,
        args.max_corpus_mb,
        args.text_field,
        args.workers,
        extra_files,
    )


if __name__ == "__main__":
    run_tool(main)
