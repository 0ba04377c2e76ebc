"""Time the collectives FSDP2 issues, on this machine's CPU backend (gloo), and write one JSON.

    python -m shardlab_bench collectives --world-sizes 2,4 --sizes 1M,4M,12M --out collectives.json

For each world size and payload (elements of the full, unsharded buffer, fp32 unless --dtype), the median time of:
  all_reduce                     the whole buffer (DDP's collective)
  reduce_scatter_native          dist.reduce_scatter_single, FSDP2's default
  reduce_scatter_via_all_reduce  shardlab.distributed.gloo_comms.AllReduceReduceScatter (distributed.reduce_scatter=
                                 all_reduce): an all-reduce of the whole buffer, keeping this rank's chunk
  all_gather_native              dist.all_gather_single into the full buffer
This is the collective-level measurement behind the opt-in distributed.reduce_scatter=all_reduce on gloo.
max_abs_diff_vs_native compares the two reduce-scatters' results (ReduceOp.AVG, as FSDP2 asks for in fp32).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from shardlab.distributed.env import free_port
from shardlab.distributed.gloo_comms import AllReduceReduceScatter
from shardlab_bench.provenance import collect, finish


def parse_size(text: str) -> int:
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:].upper(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def time_op(fn, iters: int) -> float:
    fn()  # warm-up: first-use allocations and connection setup
    times = []
    for _ in range(iters):
        dist.barrier()
        t = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - t))
    return statistics.median(times)


def rank_main(rank: int, world: int, port: int, sizes: list[int], dtype: str, iters: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    via_all_reduce = AllReduceReduceScatter()
    for numel in sizes:
        numel -= numel % world
        full = torch.randn(numel, dtype=getattr(torch, dtype))
        shard = torch.empty(numel // world, dtype=full.dtype)
        ops = {
            "all_reduce": partial(dist.all_reduce, full),
            "reduce_scatter_native": partial(dist.reduce_scatter_single, shard, full),
            "reduce_scatter_via_all_reduce": partial(via_all_reduce, shard, full, dist.group.WORLD, dist.ReduceOp.SUM),
            "all_gather_native": partial(dist.all_gather_single, full, shard),
        }
        row = {"world_size": world, "numel": numel, "dtype": dtype}
        row.update({f"{name}_ms": time_op(fn, iters) for name, fn in ops.items()})
        # Same answer as the native collective: both sum the same ranks' values (ring order may round differently).
        native, via = torch.empty_like(shard), torch.empty_like(shard)
        dist.reduce_scatter_single(native, full.clone(), op=dist.ReduceOp.AVG)
        via_all_reduce(via, full.clone(), dist.group.WORLD, dist.ReduceOp.AVG)
        diff = (native - via).abs().max()
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)  # every rank's chunk, not only rank 0's
        row["max_abs_diff_vs_native"] = diff.item()
        row["reduce_scatter_speedup_via_all_reduce"] = (
            row["reduce_scatter_native_ms"] / row["reduce_scatter_via_all_reduce_ms"]
        )
        rows.append(row)
        if rank == 0:
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(rows, indent=1))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", default="2", help="comma-separated, e.g. 2,4")
    parser.add_argument("--sizes", default="1M,4M,12M", help="elements of the full buffer, e.g. 1M,4M,12M")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--out", default="collectives.json")
    args = parser.parse_args(argv)
    meta = collect(__file__, argv, settings=vars(args))
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    rows: list[dict] = []
    for world in (int(w) for w in args.world_sizes.split(",")):
        part = f"{args.out}.world{world}"
        torch.multiprocessing.spawn(
            rank_main, args=(world, free_port(), sizes, args.dtype, args.iters, part), nprocs=world, join=True
        )
        rows += json.loads(Path(part).read_text())
        Path(part).unlink()
    result = {"tool": "bench_collectives", "rows": rows, "meta": finish(meta)}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"bench_collectives: wrote {args.out}")
    return result
