"""Tensor parallelism's cost in shardlab: its TP 2 step (train.py, the trainer as users run it) against a
hand-written loop on the same torch APIs and shapes, interleaved in pairs, on CPU/gloo.

    python -m shardlab_bench tensor_parallel --pairs 3 --out docs/bench/tensor_parallel.json
    python -m shardlab_bench tensor_parallel --loop-only --steps 5 --out loop.json      # the hand-written side alone

Shapes (both sides): model=llama_tiny (4 blocks, dim 192, 6 query and 2 key/value heads, SwiGLU width 576, untied,
vocabulary 320: the byte tokenizer's, padded), 2 tensor-parallel ranks with sequence parallelism, 8 sequences of 128
tokens per step (shardlab: optimization.batch_size=8), fused AdamW (shardlab's optimizer.implementation=auto) lr
3e-3 betas (0.9, 0.95) weight decay 0.1 (shardlab exempts norms from the decay: the same work), clipping by the
global norm 1.0. The loop: each rank builds the same shardlab_tasks.lm.models.llama.Llama, applies torch's
parallelize_module with the same plan (shardlab_tasks/lm/models/tensor_parallel.py's llama_plan, its logits split over
the vocabulary and the loss on the splits inside torch's loss_parallel, as distributed.loss_parallel's default) over a
1-D mesh of the 2 ranks, random tokens, no FSDP
(one data-parallel rank: nothing to shard), no data loading, checks or logging; freed pages kept (glibc's mmap
threshold at its ceiling) as a shardlab CPU rank does without a memory budget. shardlab also wraps the model in FSDP2
over its one data-parallel rank (the mesh's dp_shard axis, kept at size 1 so TP and FSDP share one root mesh) and
reads the corpus. Each pair alternates which side runs first; the figure is the median ratio of tokens/s
(shardlab / loop). Each run is a fresh set of processes.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardlab_bench import against_loop
from shardlab_bench.against_loop import AgainstLoop

SHAPES = {"layers": 4, "dim": 192, "heads": 6, "kv_heads": 2, "ffn": 576, "vocab": 320, "seq_len": 128, "batch": 8}
SHARDLAB = [
    "model=llama_tiny", f"data.seq_len={SHAPES['seq_len']}", "data.max_corpus_mb=1",
    f"optimization.batch_size={SHAPES['batch']}", "distributed.backend=fully_sharded", "distributed.world_size=2",
    "distributed.tensor_parallel_degree=2", f"validation.batch_size={SHAPES['batch']}",
]  # fmt: skip


def clip(params: list[torch.nn.Parameter], max_norm: float) -> None:
    """Clip by the norm over every rank's shards (a split weight's norm is a DTensor: made whole first)."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if isinstance(norm, torch.distributed.tensor.DTensor):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)


def loop_rank(rank: int, args: argparse.Namespace, port: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    from shardlab.distributed.cpu_allocator import configure_cpu_allocator
    from shardlab_tasks.lm.config import LlamaConfig
    from shardlab_tasks.lm.models.llama import Llama
    from shardlab_tasks.lm.models.tensor_parallel import llama_plan, vocabulary_split_logits

    configure_cpu_allocator("fast")  # as a shardlab CPU rank without a memory budget (and reference.py)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    s = SHAPES
    torch.manual_seed(0)
    cfg = LlamaConfig(num_layers=s["layers"], dim=s["dim"], num_heads=s["heads"], num_kv_heads=s["kv_heads"],
                      ffn_dim=s["ffn"], max_seq_len=256)  # fmt: skip
    plan = vocabulary_split_logits(llama_plan(qk_norm=False))  # shardlab's default, distributed.loss_parallel
    model = parallelize_module(Llama(cfg, s["vocab"]), init_device_mesh("cpu", (2,)), plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    params = list(model.parameters())
    times = []
    generator = torch.Generator().manual_seed(1)  # both ranks draw the same tokens (one data-parallel rank)
    for _ in range(args.warmup + args.steps):
        started = time.perf_counter()
        tokens = torch.randint(0, s["vocab"], (s["batch"], s["seq_len"] + 1), generator=generator)
        with loss_parallel():  # the logits split over the vocabulary, the loss on the splits
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
            loss.backward()
        clip(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    against_loop.finish_loop(rank, args, times, s["batch"] * s["seq_len"], SHAPES)


BENCH = AgainstLoop(
    tool="tensor_parallel",
    label="TP 2 (sequence parallel)",
    what="TP step",
    shardlab=SHARDLAB,
    shapes=SHAPES,
    loop_rank=loop_rank,
    default_out="tensor_parallel.json",
)


def main(argv: list[str] | None = None) -> dict:
    return against_loop.main(BENCH, argv, __doc__)
