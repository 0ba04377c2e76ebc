"""Binarize a text corpus for the LM task (the fairseq-preprocess analogue).

    python tools/preprocess_lm.py /my/text/dir                 # -> ~/.cache/shardlab/<name>-<hash>/
    python tools/preprocess_lm.py /my/text/dir --valid-percent 1

Training runs this step themselves on first use (data.path=/my/text/dir) and reuse the result; run it ahead of time
to preprocess once for many jobs. Output: train.bin / valid.bin (uint16 token ids) and meta.json.
"""

from __future__ import annotations

import argparse
import json

from shardlab.cli import run_tool
from tasks.lm.config import LMDataConfig
from tasks.lm.data import prepare_corpus


def main(argv: list[str] | None = None) -> None:
    defaults = LMDataConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", nargs="?", default=None, help="text file or directory; omit for the embedded corpus")
    parser.add_argument("--cache-dir", default=defaults.cache_dir)
    parser.add_argument("--tokenizer", default=defaults.tokenizer)
    parser.add_argument("--valid-percent", type=float, default=defaults.valid_percent)
    parser.add_argument("--max-corpus-mb", type=float, default=defaults.max_corpus_mb)
    args = parser.parse_args(argv)
    out = prepare_corpus(args.path, args.cache_dir, args.tokenizer, args.valid_percent, args.max_corpus_mb)
    meta = json.loads((out / "meta.json").read_text())
    print(
        f"{out}: {meta['train_tokens']:,} train / {meta['valid_tokens']:,} valid tokens "
        f"({meta['documents']['train']} / {meta['documents']['valid']} documents)"
    )


if __name__ == "__main__":
    run_tool(main)
