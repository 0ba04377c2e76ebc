"""A bare, hand-written FSDP2 (or DDP) training loop over the LM task's GPT, to measure shardlab's overhead against.

    python -m shardlab_bench reference --world-size 2 --steps 20 --warmup 5 --out bench_reference.json

No shardlab code runs in the timed loop except shardlab_tasks/lm/models/model.py, for the identical model (and the comm
of
--reduce-scatter); the launch uses shardlab's free-port and rank-environment helpers. The defaults are model=gpt_small
with the LM task's defaults (seq_len 128, global batch 32, AdamW lr 3e-3 / betas 0.9, 0.95 / weight decay 0.1 on
matrices, clip_norm 1.0); tokens are random. fully_shard goes on every block (all but the last reshard after forward,
as torchtitan does) and on the root with FSDP2's default (the root does not reshard). AdamW is fused. The ranks get
OMP_NUM_THREADS = cores // ranks and keep freed pages (glibc's mmap threshold at its ceiling), as shardlab's local
launcher and CPU ranks do (distributed.cpu_allocator=auto without a budget). ``--prefetch`` issues each block's
all-gather asynchronously one block ahead (FSDP2 overlaps all-gathers through CUDA streams; on CPU/gloo every unshard
otherwise blocks); ``--reduce-scatter all_reduce`` issues
FSDP2's reduce-scatter as an all-reduce through FSDP2's custom-comm hook, overlapped with the next block's backward
(shardlab's opt-in distributed.reduce_scatter=all_reduce); ``--parallel ddp`` wraps in DDP instead.

Writes the same keys as train.py: tokens_per_s (global tokens per step / median step time), tokens_per_s_mean,
median_step_ms, mean_step_ms, step_ms, optimizer_step_ms (rank 0; the ranks run in lockstep).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardlab.distributed.cpu_allocator import configure_cpu_allocator
from shardlab.distributed.env import free_port, set_local_rank_defaults
from shardlab_bench.provenance import collect, finish
from shardlab_tasks.lm.config import GPTConfig
from shardlab_tasks.lm.models.model import GPT


def shard(model: GPT, args: argparse.Namespace):
    """fully_shard on every block and the root (the last block stays unsharded after forward), with prefetching and
    the all-reduce form of reduce-scatter as the options ask; returns that reduce-scatter's comm, or None."""
    from torch.distributed.fsdp import fully_shard

    for i, block in enumerate(model.blocks):
        fully_shard(block, reshard_after_forward=i < len(model.blocks) - 1)
    fully_shard(model)
    if args.prefetch:
        # FSDP2 overlaps its all-gathers through CUDA streams; on CPU (gloo) every unshard blocks unless it is
        # issued asynchronously ahead of time: prefetch the next block in forward and the previous in backward.
        blocks = list(model.blocks)
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 2])
            block.set_modules_to_backward_prefetch(blocks[i - 1 : i] if i else [])
        model._set_unshard_async_op(True)
    if args.reduce_scatter != "all_reduce":
        return None
    from shardlab.distributed.gloo_comms import AllReduceReduceScatter

    reduce_comm = AllReduceReduceScatter()
    reduce_comm.overlap = True  # fp32, no accumulation: each reduce may finish under the next block's backward
    for module in [*model.blocks, model]:
        module.set_custom_reduce_scatter(reduce_comm)
    return reduce_comm


def build(args: argparse.Namespace, g: torch.Generator) -> tuple[torch.nn.Module, object]:
    """The GPT on meta, sharded (fsdp) or wrapped (ddp), then materialized with seeded weights: (model, the
    reduce-scatter comm or None)."""
    cfg = GPTConfig(num_layers=args.layers, dim=args.dim, num_heads=args.heads, max_seq_len=args.max_seq_len)
    with torch.device("meta"):
        model = GPT(cfg, args.vocab)
    reduce_comm = shard(model, args) if args.parallel == "fsdp" else None
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = p.to_local() if hasattr(p, "to_local") else p
            if p.ndim >= 2:
                t.copy_(torch.randn(t.shape, generator=g) * 0.02)
            else:
                t.fill_(1.0 if ".ln_" in name or "ln_f" in name else 0.0)
    if args.parallel == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    return model, reduce_comm


def adamw(params: list[torch.nn.Parameter]) -> torch.optim.AdamW:
    """optimizer=adamw's defaults and groups: weight decay on matrices only."""
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), fused=True)


def timed_steps(model, reduce_comm, args: argparse.Namespace, g: torch.Generator) -> dict:
    """``args.warmup`` then ``args.steps`` training steps on random tokens: the step and optimizer times (ms, the
    timed steps'), the CPU seconds per second of this rank over them, and the last loss."""
    params = list(model.parameters())
    optimizer = adamw(params)
    tokens = torch.randint(0, 257, (4, args.batch_size // args.world_size, args.seq_len + 1), generator=g)
    ends, opt_ms = [time.perf_counter()], []
    cpu0 = (0.0, 0.0)
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            cpu0 = (ends[-1], time.process_time())
        batch = tokens[step % len(tokens)]
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = model(inputs)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
        loss.backward()
        if reduce_comm is not None:
            reduce_comm.wait()  # the overlapped reduces: gradients are complete from here
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        t0 = time.perf_counter()
        optimizer.step()
        opt_ms.append(1000 * (time.perf_counter() - t0))
        optimizer.zero_grad(set_to_none=True)
        ends.append(time.perf_counter())
    return {
        "step_ms": [1000 * (b - a) for a, b in zip(ends[args.warmup : -1], ends[args.warmup + 1 :], strict=True)],
        "opt_ms": opt_ms[args.warmup :],
        "cpu_per_s": (time.process_time() - cpu0[1]) / (ends[-1] - cpu0[0]),
        "loss": float(loss.detach()),
    }


def result(args: argparse.Namespace, model, timed: dict, meta: dict) -> dict:
    """The JSON rank 0 writes."""
    per_step = args.batch_size * args.seq_len
    step_ms = timed["step_ms"]
    median, mean = statistics.median(step_ms), statistics.fmean(step_ms)
    return {
        "tool": "bench_reference",
        "parallel": args.parallel,
        "prefetch": args.prefetch,
        "reduce_scatter": args.reduce_scatter,
        "world_size": args.world_size,
        "model": {"num_layers": args.layers, "dim": args.dim, "num_heads": args.heads, "vocab": args.vocab},
        "num_params": sum(p.numel() for p in model.parameters()),
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "unit": "tokens",
        "tokens_per_step": per_step,
        "steps": args.steps,
        "warmup": args.warmup,
        "tokens_per_s": per_step / (median / 1000),
        "tokens_per_s_mean": per_step / (mean / 1000),
        "median_step_ms": median,
        "mean_step_ms": mean,
        "step_ms": [round(t, 3) for t in step_ms],
        "optimizer_step_ms": statistics.median(timed["opt_ms"]),
        "final_loss": timed["loss"],
        "cpu_seconds_per_second_rank0": timed["cpu_per_s"],
        "env": {
            "torch": torch.__version__,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "torch_threads": torch.get_num_threads(),
            "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
            "cpu_allocator": "fast",
            "loadavg_1min_at_end": os.getloadavg()[0],
        },
        "meta": finish(meta),
    }


def train(rank: int, args: argparse.Namespace, port: int, meta: dict) -> None:
    configure_cpu_allocator("fast")  # as a shardlab CPU rank without a memory budget (distributed.cpu_allocator=auto)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world_size)
    g = torch.Generator().manual_seed(0)
    model, reduce_comm = build(args, g)
    timed = timed_steps(model, reduce_comm, args, g)
    if rank == 0:
        out = result(args, model, timed, meta)
        Path(args.out).write_text(json.dumps(out, indent=1))
        print(
            f"reference {args.parallel}: tokens_per_s {out['tokens_per_s']:.1f}, "
            f"median_step_ms {out['median_step_ms']:.1f}, optimizer_step_ms {out['optimizer_step_ms']:.1f}; "
            f"wrote {args.out}",
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--parallel", choices=("fsdp", "ddp"), default="fsdp")
    parser.add_argument("--prefetch", action="store_true", help="fsdp: explicit async prefetch of the next block")
    parser.add_argument(
        "--reduce-scatter", choices=("native", "all_reduce"), default="native", help="fsdp: gloo's, or as all-reduce"
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=320, help="the byte tokenizer's 257, padded to 64")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32, help="global, over all ranks")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default="bench_reference.json")
    args = parser.parse_args(argv)
    if args.batch_size % args.world_size:
        parser.error("--batch-size must be divisible by --world-size")
    meta = collect(__file__, argv, settings=vars(args))
    set_local_rank_defaults(args.world_size)  # as shardlab's local launcher
    import torch.multiprocessing as mp

    mp.start_processes(train, args=(args, free_port(), meta), nprocs=args.world_size, join=True, start_method="spawn")
    return json.loads(Path(args.out).read_text())
