"""The harness of the benchmarks that time shardlab's step against a hand-written loop on the same torch APIs and
shapes (pipeline.py, tensor_parallel.py): interleaved pairs of fresh process sets, each side's
tokens/s and the load before it, the median ratio (shardlab / loop), and JSON in the shape tables.py's
overhead table renders. A tool gives its loop (run on 2 spawned ranks by ``--loop-only``) and shardlab's overrides
(run through train.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shardlab_bench import child_env, command, provenance


@dataclass(frozen=True)
class AgainstLoop:
    tool: str
    """The benchmark's name (its module's): rerun with --loop-only for the loop's side."""
    label: str
    """The row of the overhead table, e.g. 'TP 2 (sequence parallel)'."""
    what: str
    """What the closing line calls shardlab's side, e.g. 'TP step'."""
    shardlab: list[str]
    """train.py's overrides for shardlab's side."""
    shapes: dict
    loop_rank: Callable[[int, argparse.Namespace, int], None]
    """One rank of the hand-written loop: (rank, args, master port); rank 0 writes args.out."""
    default_out: str


def finish_loop(rank: int, args: argparse.Namespace, times: list[float], tokens_per_step: int, shapes: dict) -> None:
    """The end of a loop rank: rank 0 writes the median step's tokens/s (after ``args.warmup`` steps) to ``args.out``;
    then every rank leaves the process group."""
    import torch.distributed as dist

    if rank == 0:
        median = statistics.median(times[args.warmup :])
        out = {"tokens_per_s": tokens_per_step / median, "median_step_ms": median * 1e3, "shapes": shapes}
        Path(args.out).write_text(json.dumps(out, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def run_side(bench: AgainstLoop, side: str, args: argparse.Namespace, out: Path) -> dict:
    timing = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(out)]
    cmd = command(bench.tool, "--loop-only", *timing) if side == "loop" else command("train", *bench.shardlab, *timing)
    load = os.getloadavg()[0]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=child_env())
    return {**json.loads(out.read_text()), "loadavg_1min_before": load}


def run_loop(bench: AgainstLoop, args: argparse.Namespace) -> dict:
    import torch.multiprocessing as mp

    from shardlab.distributed.env import free_port, set_local_rank_defaults

    set_local_rank_defaults(2)  # one intra-op thread share per rank, as shardlab's local launcher
    mp.start_processes(bench.loop_rank, args=(args, free_port()), nprocs=2, join=True, start_method="spawn")
    return json.loads(args.out.read_text())


def pair(bench: AgainstLoop, args: argparse.Namespace, runs: Path, i: int) -> dict:
    """The i-th pair, its first side alternating."""
    order = ("shardlab", "loop") if i % 2 == 0 else ("loop", "shardlab")
    got = {side: run_side(bench, side, args, runs / f"{i}-{side}.json") for side in order}
    ratio = got["shardlab"]["tokens_per_s"] / got["loop"]["tokens_per_s"]
    print(f"pair {i + 1}: shardlab {got['shardlab']['tokens_per_s']:.0f} tokens/s, loop "
          f"{got['loop']['tokens_per_s']:.0f} ({ratio:.3f}x)", flush=True)  # fmt: skip
    return {
        "order": list(order), "ratio": ratio,
        **{f"{side}_tokens_per_s": got[side]["tokens_per_s"] for side in got},
        **{f"{side}_median_step_ms": got[side]["median_step_ms"] for side in got},
        "loadavg_1min": [got[side]["loadavg_1min_before"] for side in order],
    }  # fmt: skip


def main(bench: AgainstLoop, argv: list[str] | None = None, doc: str | None = None) -> dict:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--loop-only", action="store_true", help="run the hand-written loop once (2 ranks)")
    parser.add_argument("--out", type=Path, default=Path(bench.default_out))
    args = parser.parse_args(argv)
    if args.loop_only:
        return run_loop(bench, args)
    settings = {"pairs": args.pairs, "steps": args.steps, "warmup": args.warmup, "shapes": bench.shapes}
    meta = provenance.collect(bench.tool, argv, settings)
    result: dict = {"pairs": [], "shardlab_overrides": bench.shardlab}
    summary = {"meta": meta, "backends": {bench.label: result}}
    runs = args.out.with_name(args.out.name + ".runs")
    runs.mkdir(parents=True, exist_ok=True)
    for i in range(args.pairs):
        result["pairs"].append(pair(bench, args, runs, i))
        result["median_ratio"] = statistics.median(p["ratio"] for p in result["pairs"])
        summary["meta"] = provenance.finish(meta)
        args.out.write_text(json.dumps(summary, indent=1) + "\n")  # partial results survive a stop
    print(f"shardlab's {bench.what} at {result['median_ratio']:.3f}x the hand-written loop (median of {args.pairs} "
          "pairs)")  # fmt: skip
    return summary
