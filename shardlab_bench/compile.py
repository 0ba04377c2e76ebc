"""Compiled against eager, in interleaved pairs of train.py runs; the compile time of a cold and a warm cache.

    python -m shardlab_bench compile --out docs/bench/compile.json  # every case, 3 pairs (~20 min, 2 quiet cores)
    python -m shardlab_bench compile --cases lm_ddp --pairs 2 --steps 10 optimization.batch_size=16

Each case runs train.py (a fresh process per run, so nothing compiled survives in memory) with distributed.compile
false and true, alternating which goes first (eager-compiled, then compiled-eager, ...) so a drift in the machine's load
does not favour one side. Each case gets its own empty inductor cache under --out-dir: its first compiled run compiles
from scratch (cold), the later ones reload what it wrote (warm), and each reports its compile time (train.py's
compile_s: first step minus the median step). Arguments without a leading ``--`` are Hydra overrides added to every
run. Writes every run's bench JSON to --out-dir, the summary (pairs, throughput ratios, compile times, load averages,
and the meta tables.py renders under docs/compile.md's table) to --out, and prints one line per pair.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from shardlab_bench import child_env, command, provenance

CASES = {  # the must-show: gpt_small at world size 2 (fully_sharded and ddp), and regnet_cifar
    "lm_fully_sharded": ["task=lm", "model=gpt_small", "distributed.backend=fully_sharded", "distributed.world_size=2"],
    "lm_ddp": ["task=lm", "model=gpt_small", "distributed.backend=ddp", "distributed.world_size=2"],
    "regnet_fully_sharded": [
        "task=image_classification",
        "model=regnet_cifar",
        "distributed.backend=fully_sharded",
        "distributed.world_size=2",
    ],
}


def run_bench(overrides: list[str], out: Path, steps: int, warmup: int) -> dict:
    """One train.py run in its own process; its JSON plus the load average around it."""
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    cmd = command("train", *overrides, "--steps", str(steps), "--warmup", str(warmup), "--out", str(out))
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=child_env())
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - started
    result["loadavg_1min_before"] = load_before
    return result


def run_case(name: str, overrides: list[str], args: argparse.Namespace, out_dir: Path) -> dict:
    cache = out_dir / f"inductor-{name}"
    shutil.rmtree(cache, ignore_errors=True)  # the first compiled run starts cold
    pairs = []
    for i in range(args.pairs):
        order = ("false", "true") if i % 2 == 0 else ("true", "false")
        runs = {}
        for compiled in order:
            tag = "compiled" if compiled == "true" else "eager"
            run_overrides = [*overrides, f"distributed.compile={compiled}", f"distributed.compile_cache_dir={cache}"]
            runs[tag] = run_bench(run_overrides, out_dir / f"{name}-{i}-{tag}.json", args.steps, args.warmup)
        unit = runs["eager"]["unit"]
        pair = {
            "order": [("compiled" if c == "true" else "eager") for c in order],
            f"eager_{unit}_per_s": runs["eager"][f"{unit}_per_s"],
            f"compiled_{unit}_per_s": runs["compiled"][f"{unit}_per_s"],
            "speedup": runs["compiled"][f"{unit}_per_s"] / runs["eager"][f"{unit}_per_s"],
            "compile_s": runs["compiled"]["compile_s"],
            "cache": "cold" if i == 0 else "warm",
            "eager_first_step_s": runs["eager"]["first_step_s"],
            "loadavg_1min": [runs["eager"]["loadavg_1min_before"], runs["compiled"]["loadavg_1min_before"]],
        }
        pairs.append(pair)
        print(
            f"{name} pair {i + 1}: eager {pair[f'eager_{unit}_per_s']:.1f} {unit}/s, compiled "
            f"{pair[f'compiled_{unit}_per_s']:.1f} ({pair['speedup']:.3f}x); compile {pair['compile_s']:.1f} s "
            f"({pair['cache']} cache); load {pair['loadavg_1min'][0]:.1f}/{pair['loadavg_1min'][1]:.1f}",
            flush=True,
        )
    warm = [p["compile_s"] for p in pairs if p["cache"] == "warm"]
    return {
        "overrides": overrides,
        "unit": unit,
        "pairs": pairs,
        "median_speedup": statistics.median(p["speedup"] for p in pairs),
        "cold_compile_s": pairs[0]["compile_s"],
        "warm_compile_s_median": statistics.median(warm) if warm else None,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--pairs", type=int, default=3, help="eager/compiled pairs per case (>= 2: one cold, warm)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run (train.py --steps)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (train.py --warmup)")
    parser.add_argument("--out-dir", default="bench_compile", help="every run's bench JSON and the inductor caches")
    parser.add_argument("--out", help="the summary JSON (default: OUT_DIR/summary.json)")
    args, overrides = parser.parse_known_args(argv)
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown or args.pairs < 1 or any(o.startswith("-") for o in overrides):
        parser.error(f"unknown cases {unknown}" if unknown else "bad --pairs or an unknown --option")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else out_dir / "summary.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {"cases": args.cases.split(","), "pairs": args.pairs, "steps": args.steps, "warmup": args.warmup}
    meta = provenance.collect(__file__, argv, settings)
    summary = {
        "meta": meta,
        "tool": "bench_compile",
        "steps": args.steps,
        "warmup": args.warmup,
        "extra_overrides": overrides,
        "cases": {},
    }
    for name in args.cases.split(","):
        summary["cases"][name] = run_case(name, [*CASES[name], *overrides], args, out_dir)
        summary["meta"] = provenance.finish(meta)
        out.write_text(json.dumps(summary, indent=1) + "\n")  # partial results survive a stop
    print(f"bench_compile: wrote {out}", flush=True)
    return summary
