"""How preprocessing scales with tasks: the same generated corpus cut into shards and tokenized by 1, 2 and 4 local
tasks (tools/preprocess_lm.py --tasks N --workers 1: one process of one thread, hence one core, per task) and, with
--slurm-partition, by a Slurm array of N tasks there, one exclusive node per task, as JSON.

    python -m shardlab_bench preprocess_scaling --generate-mb 512 --tasks 1 2 4 --out docs/bench/preprocess_scaling.json
    python -m shardlab_bench preprocess_scaling --generate-mb 4096 --tasks 1 2 4 --slurm-partition multi --array-tasks 2
    python -m shardlab_bench preprocess_scaling --generate-mb 512 --train-bpe 8192 --slurm-partition multi

Each run is measured as preprocess.py measures one (the tool in a child process, its whole process
tree's memory sampled every 0.2 s, its CPU time): wall time, MB per CPU-second, the peak RSS of the largest single
process (a task) and of the tree, and the speedup over 1 task. The runs also check that every task count wrote the
same tokens (the manifest's content digest). An array run is measured from sbatch to the manifest: its wall time
includes Slurm's scheduling; each task reports its own CPU time and peak RSS (getrusage over the tool, its child),
written beside the cache; the corpus's folder must be one every node sees. --train-bpe trains a BPE on ~8 MB of the
corpus first, unmeasured, and every run uses it. From the 1-task run's MB per CPU-second the JSON projects the wall time
of a 1 TB corpus at 1, 16 and 256 cores (tasks), assuming the rate per core holds, as it does across an array's nodes
that share nothing but the filesystem.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shardlab_bench import REPO, child_env, command
from shardlab_bench.preprocess import generate_jsonl, run_preprocess, train_tokenizer
from shardlab_bench.provenance import collect, finish

PROJECTED_CORES = (1, 16, 256)
TB = 1e12


def measure(corpus: Path, tmp: Path, tasks: int, extra: list[str]) -> dict:
    cache = tmp / f"cache-{tasks}"
    run = run_preprocess(corpus, cache, ["--tasks", str(tasks), "--shards", str(tasks), "--workers", "1", *extra])
    meta = json.loads(next(cache.glob("*/meta.json")).read_text())
    run.update(tasks=tasks, shards=len(meta["shards"]), content_digest=meta["content_digest"])
    shutil.rmtree(cache)  # ~2 bytes a character: three caches of a large corpus would fill a small disk
    return run


def array_task(report_dir: Path, command: list[str]) -> None:
    """One array task: the tool as a child, then its CPU time and peak RSS in report_dir/<task id>.json."""
    start = time.perf_counter()
    returncode = subprocess.run(command).returncode
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    task = os.environ.get("SLURM_ARRAY_TASK_ID", "0")
    report = {"task": int(task), "host": os.uname().nodename, "returncode": returncode,
              "wall_s": round(time.perf_counter() - start, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
              "peak_rss_mib": round(usage.ru_maxrss / 1024, 1)}  # fmt: skip
    (report_dir / f"{task}.json").write_text(json.dumps(report))
    sys.exit(returncode)


def measure_array(corpus: Path, tmp: Path, partition: str, tasks: int, extra: list[str]) -> dict:
    """The same preprocessing as ``tasks`` array tasks on ``partition``, one exclusive node each."""
    cache, reports = tmp / f"cache-array-{tasks}", tmp / f"reports-array-{tasks}"
    reports.mkdir()
    tool = [sys.executable, str(REPO / "tools" / "preprocess_lm.py"), str(corpus), "--cache-dir",
            str(cache), "--shards", str(tasks), "--workers", "1", *extra]  # fmt: skip
    niceness = ["nice", "-n", str(os.nice(0))] if os.nice(0) else []  # the array's tasks at the bench's own priority
    child = [*niceness, *command("preprocess_scaling", "--array-task", str(reports), "--", *tool)]
    start = time.perf_counter()
    submitted = subprocess.run(
        ["sbatch", "--parsable", "-p", partition, "--exclusive", f"--array=0-{tasks - 1}", f"--output={reports}/%a.out",
         "--wrap", " ".join(child)], capture_output=True, text=True, check=True, env=child_env(),
    )  # fmt: skip
    job = submitted.stdout.strip().split(";")[0]
    while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
        time.sleep(0.5)
    wall = time.perf_counter() - start
    done = [json.loads(p.read_text()) for p in sorted(reports.glob("*.json"))]
    if len(done) != tasks or any(d["returncode"] for d in done):
        logs = "".join(p.read_text() for p in sorted(reports.glob("*.out")))
        raise SystemExit(f"array {job} failed: {done}\n{logs[-3000:]}")
    meta = json.loads(next(cache.glob("*/meta.json")).read_text())
    corpus_mb = sum(p.stat().st_size for p in corpus.iterdir()) / 1e6
    cpu_s = sum(d["cpu_s"] for d in done)
    shutil.rmtree(cache)
    return {"command": " ".join(tool[1:]), "slurm": f"sbatch -p {partition} --exclusive --array=0-{tasks - 1}",
            "corpus_mb": corpus_mb, "wall_s": round(wall, 1), "cpu_s": round(cpu_s, 1),
            "mb_per_cpu_s": round(corpus_mb / cpu_s, 2),
            "peak_rss_one_process_mib": max(d["peak_rss_mib"] for d in done),
            "tokens": meta["train_tokens"] + meta["valid_tokens"], "tokenizer": meta["tokenizer"],
            "tasks": tasks, "shards": len(meta["shards"]), "array_tasks": done,
            "content_digest": meta["content_digest"]}  # fmt: skip


def project(mb_per_cpu_s: float) -> dict:
    """Hours to preprocess 1 TB at each core count, at ``mb_per_cpu_s`` per core."""
    return {str(c): round(TB / 1e6 / mb_per_cpu_s / c / 3600, 2) for c in PROJECTED_CORES}


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["--array-task"]:
        array_task(Path(argv[1]), argv[argv.index("--") + 1 :])
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--generate-mb", type=float, default=512, help="size of the generated JSONL corpus")
    parser.add_argument("--files", type=int, default=16, help="files of the generated corpus (shards fall between)")
    parser.add_argument("--tasks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--slurm-partition", help="also run a Slurm array on this partition (its nodes see /tmp)")
    parser.add_argument("--array-tasks", type=int, default=2, help="the array's tasks, one exclusive node each")
    parser.add_argument("--train-bpe", type=int, default=0, help="train a BPE of this vocabulary first, unmeasured")
    parser.add_argument("--tmp", type=Path, help="where the corpus and caches go (default: the system's temp folder)")
    parser.add_argument("--out", type=Path, default=Path("docs/bench/preprocess_scaling.json"))
    args = parser.parse_args(argv)
    meta = collect(__file__, sys.argv[1:], settings={**{k: str(v) for k, v in vars(args).items()}, "extra": extra})
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench_scaling-", dir=args.tmp) as tmp:
        (Path(tmp) / "corpus").mkdir()
        corpus = generate_jsonl(Path(tmp) / "corpus", args.generate_mb, args.files)
        if args.train_bpe:
            extra += ["--tokenizer", train_tokenizer(corpus, args.train_bpe, Path(tmp) / "tok" / "tokenizer.json")]
        for n in args.tasks:
            runs.append({"load_average_at_start": os.getloadavg()[0], **measure(corpus, Path(tmp), n, extra)})
            print(json.dumps({k: runs[-1][k] for k in ("tasks", "wall_s", "cpu_s", "mb_per_cpu_s")}), flush=True)
        if args.slurm_partition:
            run = measure_array(corpus, Path(tmp), args.slurm_partition, args.array_tasks, extra)
            runs.append({"load_average_at_start": os.getloadavg()[0], **run})
            print(json.dumps({k: run[k] for k in ("slurm", "wall_s", "cpu_s", "mb_per_cpu_s")}), flush=True)
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
