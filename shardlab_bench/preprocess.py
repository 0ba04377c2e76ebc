"""Preprocessing throughput and memory against the tokenizers library's own encode speed, as JSON.

    python -m shardlab_bench preprocess --generate-mb 2048 --out preprocess.json \\
        -- --train-tokenizer bpe --vocab-size 8192
    python -m shardlab_bench preprocess --corpus /data/shards --tokenizer ~/tok/tokenizer.json --out preprocess.json
    python -m shardlab_bench preprocess --generate-mb 32 --format parquet --out preprocess_parquet.json -- --workers 2

Runs tools/preprocess_lm.py on the corpus in a child process (arguments after ``--`` are passed on), sampling the
whole process tree's memory (RSS and PSS, workers included) every 0.2 s and its CPU time, and times the reference:
the same tokenizer's encode_batch_fast in this process with all its threads. On a shared machine MB per CPU-second
compares the two more fairly than MB/s, which depends on the CPU share each got.
--generate-mb writes a JSONL corpus of that size under a temporary directory (repeated records of this Python's
standard library, one file per record) and deletes it after; --format converts it first, file by file, to the same
documents as .jsonl.gz, .jsonl.zst, Parquet, Arrow (as datasets' save_to_disk writes it) or .txt.gz (each file's
documents as one text), so the formats' rows compare reading the same text: their "corpus" is the JSONL's size.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shardlab_bench import child_env, command
from shardlab_bench.provenance import collect, finish
from shardlab_tasks.lm.corpus.cache import embedded_corpus_files
from shardlab_tasks.lm.corpus.corpus import find_sources, iter_texts
from shardlab_tasks.lm.corpus.tokenizer import FileTokenizer, train_bpe

ROOT = Path(__file__).resolve().parent.parent


def generate_jsonl(out_dir: Path, megabytes: float, num_files: int = 8) -> Path:
    """~``megabytes`` of JSONL in ``num_files`` files: the stdlib's modules as records, repeated with a counter."""
    records = [
        json.dumps({"text": p.read_text(errors="replace"), "id": i}) for i, p in enumerate(embedded_corpus_files())
    ]
    target, written, n = int(megabytes * 1e6), 0, 0
    files = [open(out_dir / f"part{k:02d}.jsonl", "w") for k in range(num_files)]  # noqa: SIM115
    try:
        while written < target:
            for r in records:
                line = r + "\n"
                files[n % num_files].write(line)
                written += len(line.encode())
                n += 1
                if written >= target:
                    break
    finally:
        for f in files:
            f.close()
    return out_dir


FORMATS = ("jsonl", "jsonl.gz", "jsonl.zst", "parquet", "arrow", "txt.gz")


def convert(folder: Path, fmt: str) -> None:
    """Rewrite every part*.jsonl of ``folder`` as ``fmt`` (the same documents, in the same order), in place."""
    import gzip

    if fmt == "jsonl":
        return  # generated as JSONL already: the row the other formats compare with

    for path in sorted(folder.glob("part*.jsonl")):
        docs = [json.loads(line)["text"] for line in path.read_text().splitlines()]
        out = path.with_suffix("." + fmt)
        if fmt == "jsonl.gz":
            out.write_bytes(gzip.compress(path.read_bytes(), compresslevel=6))
        elif fmt == "jsonl.zst":
            import zstandard

            out.write_bytes(zstandard.ZstdCompressor(level=3).compress(path.read_bytes()))
        elif fmt == "txt.gz":
            out.write_bytes(gzip.compress("\n".join(docs).encode(), compresslevel=6))
        else:
            import pyarrow as pa

            table = pa.table({"text": docs, "id": list(range(len(docs)))})
            if fmt == "parquet":
                import pyarrow.parquet as pq

                pq.write_table(table, out, row_group_size=1000)  # the hub's Parquet: ~1,000-row groups, snappy
            else:
                with pa.OSFile(str(out), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
                    writer.write_table(table, max_chunksize=1000)  # datasets' writer_batch_size
        path.unlink()


def _tree(pid: int) -> list[int]:
    """pid and all its descendants."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found


def _memory_kib(pids: list[int]) -> tuple[int, int, int]:
    """(sum of RSS, sum of PSS, largest single RSS) in KiB."""
    rss = pss = biggest = 0
    for p in pids:
        try:
            rollup = Path(f"/proc/{p}/smaps_rollup").read_text().splitlines()
        except OSError:
            continue
        values = {line.split(":")[0]: int(line.split()[1]) for line in rollup[1:] if line.endswith("kB")}
        rss += values.get("Rss", 0)
        pss += values.get("Pss", 0)
        biggest = max(biggest, values.get("Rss", 0))
    return rss, pss, biggest


def run_preprocess(corpus: Path, cache_dir: Path, extra: list[str], corpus_bytes: int | None = None) -> dict:
    """``corpus_bytes``: the size the MB/s figures divide (the same documents as JSONL, for a converted corpus);
    default: the files' size."""
    cmd = [sys.executable, str(ROOT / "tools" / "preprocess_lm.py"), str(corpus), "--cache-dir", str(cache_dir), *extra]
    start, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = (0, 0, 0)
    while proc.poll() is None:
        now = _memory_kib(_tree(proc.pid))
        peak = tuple(max(a, b) for a, b in zip(peak, now, strict=True))
        time.sleep(0.2)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the tool and its workers (each waited for by its parent)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    output = proc.stdout.read()
    if proc.returncode:
        raise SystemExit(f"preprocess_lm failed ({proc.returncode}):\n{output}")
    out_dir = next(p for p in cache_dir.iterdir() if (p / "meta.json").is_file())
    meta = json.loads((out_dir / "meta.json").read_text())
    disk_bytes = sum(s.path.stat().st_size for s in find_sources(corpus))
    corpus_bytes = corpus_bytes or disk_bytes
    return {
        "command": " ".join(cmd[1:]),
        "corpus_mb": corpus_bytes / 1e6,
        "disk_mb": round(disk_bytes / 1e6, 2),
        "wall_s": round(seconds, 1),
        "mb_per_s_end_to_end": round(corpus_bytes / 1e6 / seconds, 2),
        "mb_per_s_binarize": round(meta["bytes_read"] / 1e6 / meta["seconds"], 2),
        "cpu_s": round(cpu_s, 1),
        "mb_per_cpu_s": round(corpus_bytes / 1e6 / cpu_s, 2),
        "peak_rss_tree_mib": round(peak[0] / 1024, 1),
        "peak_pss_tree_mib": round(peak[1] / 1024, 1),
        "peak_rss_one_process_mib": round(peak[2] / 1024, 1),
        "tokens": meta["train_tokens"] + meta["valid_tokens"],
        "dtype": meta["dtype"],
        "tokenizer": meta["tokenizer"],
        "log_tail": output.strip().splitlines()[-6:],
    }


def reference_speed(tokenizer_file: str, corpus: Path, sample_mb: float) -> dict:
    """The tokenizers library alone on the same text (``sample_mb`` of it; 0: all): no reading, parsing or writing,
    each mode in its own child process (the library's thread pool is sized once per process), its CPU time counted
    with getrusage over the child and all its threads: the library's threads (as preprocessing uses them) and one."""
    result = {}
    for mode, env in (("all_threads", {}), ("one_thread", {"TOKENIZERS_PARALLELISM": "false"})):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        cmd = command("preprocess", "--reference-child", tokenizer_file, str(corpus), str(sample_mb))
        out = subprocess.run(cmd, env=child_env() | env, capture_output=True, text=True, check=True).stdout
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        size, wall_s, load_s = json.loads(out.strip().splitlines()[-1])
        cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime) - load_s
        result |= {"sample_mb": round(size, 1), f"encode_batch_fast_{mode}_mb_per_s": round(size / wall_s, 2),
                   f"encode_batch_fast_{mode}_mb_per_cpu_s": round(size / cpu_s, 2)}  # fmt: skip
    result["encode_batch_fast_mb_per_cpu_s"] = result["encode_batch_fast_all_threads_mb_per_cpu_s"]
    return result


def reference_child(tokenizer_file: str, corpus: str, sample_mb: str) -> None:
    """In the child: print [MB encoded, seconds of encode_batch_fast, CPU seconds spent before it (loading)]."""
    tok = FileTokenizer(tokenizer_file)
    texts = list(iter_texts(find_sources(Path(corpus)), "text", int(float(sample_mb) * 1e6) or 1 << 62))
    size = sum(len(t.encode()) for t in texts) / 1e6
    load_s = sum(os.times()[:2])
    start = time.perf_counter()
    tok.tok.encode_batch_fast(texts, add_special_tokens=False)
    print(json.dumps([size, time.perf_counter() - start, load_s]))


def train_tokenizer(corpus: Path, vocab_size: int, out: Path) -> str:
    """A byte-level BPE trained on ~8 MB of the corpus before the measured run (training is not preprocessing)."""
    return str(train_bpe(iter_texts(find_sources(corpus), "text", 8_000_000), vocab_size, out))


def main() -> None:
    if sys.argv[1:2] == ["--reference-child"]:
        return reference_child(*sys.argv[2:5])
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, help="corpus to preprocess (or --generate-mb)")
    parser.add_argument("--generate-mb", type=float, default=0, help="generate a JSONL corpus of this size")
    parser.add_argument("--format", choices=FORMATS, help="convert the generated corpus to this format first")
    parser.add_argument("--tokenizer", help="tokenizer.json for preprocessing and the reference (else the trained one)")
    parser.add_argument("--train-bpe", type=int, default=0, help="train a BPE of this vocabulary first, unmeasured")
    parser.add_argument("--reference-mb", type=float, default=0, help="sample size of the reference (0: all)")
    parser.add_argument("--out", type=Path, default=Path("bench_preprocess.json"))
    args = parser.parse_args(argv)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    meta = collect(__file__, sys.argv[1:], settings=settings | {"preprocess_args": extra})
    if not args.corpus and not args.generate_mb:
        parser.error("give --corpus or --generate-mb")
    if args.format and not args.generate_mb:
        parser.error("--format converts the generated corpus: give --generate-mb")
    if args.tokenizer:
        extra += ["--tokenizer", args.tokenizer]

    with tempfile.TemporaryDirectory(prefix="bench_preprocess-") as tmp:
        if not args.corpus:
            (Path(tmp) / "corpus").mkdir()
        corpus = args.corpus or generate_jsonl(Path(tmp) / "corpus", args.generate_mb)
        jsonl_bytes = None
        if args.format:
            jsonl_bytes = sum(p.stat().st_size for p in corpus.glob("*.jsonl"))
            convert(corpus, args.format)
        cache = Path(tmp) / "cache"
        if args.train_bpe:
            args.tokenizer = train_tokenizer(corpus, args.train_bpe, Path(tmp) / "tok" / "tokenizer.json")
            extra += ["--tokenizer", args.tokenizer]
        result = {
            "tool": "bench_preprocess",
            "cpus": os.cpu_count(),
            "load_average_at_start": os.getloadavg(),
            **({"format": args.format} if args.format else {}),
            **run_preprocess(corpus, cache, extra, jsonl_bytes),
        }
        tokenizer = args.tokenizer or next(cache.glob("*/tokenizer.json"), None)
        if tokenizer:
            result["reference"] = reference_speed(str(tokenizer), corpus, args.reference_mb)
            result["share_of_library"] = round(
                result["mb_per_cpu_s"] / result["reference"]["encode_batch_fast_mb_per_cpu_s"], 3
            )
        result["load_average_at_end"] = os.getloadavg()
    result["meta"] = finish(meta)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
