"""How preprocessing scales with tasks: the same generated corpus cut into shards and tokenized by 1, 2 and 4 local
tasks (tools/preprocess_lm.py --tasks N --workers 0: one process, hence about one core, per task), as JSON.

    python tools/bench_preprocess_scaling.py --generate-mb 512 --tasks 1 2 4 --out docs/bench/preprocess_scaling.json

Each run is measured as tools/bench_preprocess.py measures one (the tool in a child process, its whole process
tree's memory sampled every 0.2 s, its CPU time): wall time, MB per CPU-second, the peak RSS of the largest single
process (a task) and of the tree, and the speedup over 1 task. The runs also check that every task count wrote the
same tokens (the manifest's content digest). From the 1-task run's MB per CPU-second the JSON projects the wall time
of a 1 TB corpus at 1, 16 and 256 cores (tasks), assuming the rate per core holds, as it does across an array's nodes
that share nothing but the filesystem.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from bench_meta import collect, finish  # tools/bench_meta.py
from bench_preprocess import generate_jsonl, run_preprocess  # tools/bench_preprocess.py

PROJECTED_CORES = (1, 16, 256)
TB = 1e12


def measure(corpus: Path, tmp: Path, tasks: int, extra: list[str]) -> dict:
    cache = tmp / f"cache-{tasks}"
    run = run_preprocess(corpus, cache, ["--tasks", str(tasks), "--shards", str(tasks), "--workers", "0", *extra])
    meta = json.loads(next(cache.glob("*/meta.json")).read_text())
    run.update(tasks=tasks, shards=len(meta["shards"]), content_digest=meta["content_digest"])
    shutil.rmtree(cache)  # ~2 bytes a character: three caches of a large corpus would fill a small disk
    return run


def project(mb_per_cpu_s: float) -> dict:
    """Hours to preprocess 1 TB at each core count, at ``mb_per_cpu_s`` per core."""
    return {str(c): round(TB / 1e6 / mb_per_cpu_s / c / 3600, 2) for c in PROJECTED_CORES}


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--generate-mb", type=float, default=512, help="size of the generated JSONL corpus")
    parser.add_argument("--files", type=int, default=16, help="files of the generated corpus (shards fall between)")
    parser.add_argument("--tasks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--out", type=Path, default=Path("docs/bench/preprocess_scaling.json"))
    args = parser.parse_args(argv)
    meta = collect(__file__, sys.argv[1:], settings={**{k: str(v) for k, v in vars(args).items()}, "extra": extra})
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench_scaling-") as tmp:
        (Path(tmp) / "corpus").mkdir()
        corpus = generate_jsonl(Path(tmp) / "corpus", args.generate_mb, args.files)
        for n in args.tasks:
            runs.append({"load_average_at_start": os.getloadavg()[0], **measure(corpus, Path(tmp), n, extra)})
            print(json.dumps({k: runs[-1][k] for k in ("tasks", "wall_s", "cpu_s", "mb_per_cpu_s")}), flush=True)
    base = runs[0]
    for r in runs:
        r["speedup"] = round(base["wall_s"] / r["wall_s"], 2)
    result = {
        "tool": "bench_preprocess_scaling",
        "cpus": os.cpu_count(),
        "runs": runs,
        "same_tokens": len({r["content_digest"] for r in runs}) == 1,
        "projected_hours_1tb_by_cores": project(base["mb_per_cpu_s"]),
        "meta": finish(meta),
    }
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
