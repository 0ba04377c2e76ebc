"""Pipeline parallelism's cost in shardlab: its PP step (train.py, the trainer as users run it) against a
hand-written loop on the same torch APIs and shapes, interleaved in pairs, on CPU/gloo.

    python -m shardlab_bench pipeline --pairs 3 --out docs/bench/pipeline.json
    python -m shardlab_bench pipeline --loop-only --steps 5 --out loop.json      # the hand-written side alone

Shapes (both sides): model=gpt_tiny untied (4 blocks, dim 192, 6 heads, vocabulary 320: the byte tokenizer's,
padded), 2 pipeline ranks of 2 blocks (the embedding on the first, final norm + head + loss on the last), 1F1B over 4
micro-batches of 8 sequences of 128 tokens per step (shardlab: optimization.batch_size=8, update_freq=4), AdamW lr
3e-3, clipping by the norm over both stages. The loop: each rank builds its own stage (nn.Modules written here
around shardlab_tasks/lm/models/model.py's blocks), PipelineStage + Schedule1F1B, random tokens, no FSDP (one rank per
stage: nothing to shard), no data loading, checks or logging; freed pages kept (glibc's mmap threshold at its ceiling)
as a shardlab CPU rank does without a memory budget. shardlab keeps each stage plain (one data-parallel rank, fp32:
fully_sharded's stages_unsharded) and reads the corpus. Each pair alternates which side runs first; the figure is the
median ratio of tokens/s (shardlab / loop). Each run is a fresh set of processes.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardlab_bench import against_loop
from shardlab_bench.against_loop import AgainstLoop

SHAPES = {"layers": 4, "dim": 192, "heads": 6, "vocab": 320, "seq_len": 128, "micro_batch": 8, "micro_batches": 4}
SHARDLAB = [
    "model=gpt_tiny", "model.tie_embeddings=false", f"data.seq_len={SHAPES['seq_len']}", "data.max_corpus_mb=1",
    f"optimization.batch_size={SHAPES['micro_batch']}", f"optimization.update_freq={SHAPES['micro_batches']}",
    "distributed.backend=fully_sharded", "distributed.world_size=2", "distributed.pipeline_parallel_degree=2",
    "distributed.pipeline_schedule=1f1b", f"validation.batch_size={SHAPES['micro_batch']}",
]  # fmt: skip


class Stage(nn.Module):
    """Blocks ``lo..hi`` of a GPT, with the embedding (first) or the final norm and head (last)."""

    def __init__(self, gpt, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = gpt.embed if first else None
        self.blocks = nn.ModuleList(gpt.blocks[lo:hi])
        self.head = gpt.head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x) if self.embed is not None else x
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


def loop_rank(rank: int, args: argparse.Namespace, port: int) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from shardlab.distributed.cpu_allocator import configure_cpu_allocator
    from shardlab_tasks.lm.config import GPTConfig
    from shardlab_tasks.lm.models.model import GPT

    configure_cpu_allocator("fast")  # as a shardlab CPU rank without a memory budget (and reference.py)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    s = SHAPES
    torch.manual_seed(0)
    cfg = GPTConfig(num_layers=s["layers"], dim=s["dim"], num_heads=s["heads"], max_seq_len=256, tie_embeddings=False)
    half = s["layers"] // 2
    stage = Stage(GPT(cfg, s["vocab"]), rank * half, (rank + 1) * half, rank == 0, rank == 1)
    pipe = PipelineStage(stage, rank, 2, torch.device("cpu"))
    loss = lambda logits, targets: F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))  # noqa: E731
    schedule = Schedule1F1B(pipe, n_microbatches=s["micro_batches"], loss_fn=loss)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    times = []
    for _ in range(args.warmup + args.steps):
        started = time.perf_counter()
        tokens = torch.randint(0, s["vocab"], (s["micro_batches"], s["micro_batch"], s["seq_len"] + 1))
        inputs = [(t[:, :-1],) for t in tokens] if rank == 0 else None
        schedule.step(arg_mbs=inputs, target_mbs=[t[:, 1:] for t in tokens], losses=[])
        params = [p for p in stage.parameters() if p.grad is not None]
        squared = torch.nn.utils.get_total_norm([p.grad for p in params]) ** 2
        dist.all_reduce(squared)  # the norm over both stages
        torch.nn.utils.clip_grads_with_norm_(params, 1.0, squared.sqrt())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    against_loop.finish_loop(rank, args, times, s["micro_batches"] * s["micro_batch"] * s["seq_len"], SHAPES)


BENCH = AgainstLoop(
    tool="pipeline",
    label="PP 2, 1F1B, 4 micro-batches",
    what="PP step",
    shardlab=SHARDLAB,
    shapes=SHAPES,
    loop_rank=loop_rank,
    default_out="pipeline.json",
)


def main(argv: list[str] | None = None) -> dict:
    return against_loop.main(BENCH, argv, __doc__)
