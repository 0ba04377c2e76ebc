"""Expert parallelism (shardlab_tasks/lm/models/moe_parallel.py) on 2 gloo ranks: each rank holds 2 of 4 experts, sends
its rows to their experts' ranks and gets the outputs back; outputs and gradients (rows, and each rank's experts, summed
over the ranks' contributions) equal one process computing every expert itself. Uneven sizes, a rank that sends nothing
to the other, and an expert with no rows included."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

EXPERTS, DIM, FFN, WORLD = 4, 8, 12, 2
ROUNDS = [  # per rank: rows it holds for each of the 4 experts
    [[2, 3, 1, 2], [1, 2, 3, 1]],  # both ranks send to every expert: the received rows need regrouping
    [[5, 0, 2, 1], [1, 3, 0, 6]],
    [[5, 0, 0, 0], [0, 0, 4, 2]],  # rank 0 sends nothing to rank 1, rank 1 nothing to rank 0
]


def _rank(rank: int, store_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    from shardlab_tasks.lm.models.moe_experts import run_experts, swiglu_loop
    from shardlab_tasks.lm.models.moe_parallel import expert_parallel_run

    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    weights = torch.Generator().manual_seed(0)
    gate_up, down = (
        torch.randn(EXPERTS, 2 * FFN, DIM, generator=weights),
        torch.randn(EXPERTS, DIM, FFN, generator=weights),
    )
    mine = slice(rank * 2, rank * 2 + 2)
    diffs = {}
    for round_, per_rank in enumerate(ROUNDS):
        for impl in ("grouped_mm", "loop"):
            counts = torch.tensor(per_rank[rank])
            data = torch.Generator().manual_seed(100 * round_ + rank)
            rows = torch.randn(int(counts.sum()), DIM, generator=data)
            upstream = torch.randn(rows.shape, generator=data)
            x, gu, dn = (t.clone().requires_grad_() for t in (rows, gate_up[mine], down[mine]))
            out = expert_parallel_run(x, counts, 2, lambda r, c, gu=gu, dn=dn, i=impl: run_experts(r, c, gu, dn, i))
            (out * upstream).sum().backward()
            x_ref, gu_ref, dn_ref = (t.clone().requires_grad_() for t in (rows, gate_up, down))
            expected = swiglu_loop(x_ref, counts, gu_ref, dn_ref)
            (expected * upstream).sum().backward()
            for grad in (gu_ref.grad, dn_ref.grad):  # every rank's rows reach these experts: sum the contributions
                dist.all_reduce(grad)
            key = f"round{round_}_{impl}"
            diffs[key] = max(
                float((out - expected).abs().max()) if out.numel() else 0.0,
                float((x.grad - x_ref.grad).abs().max()) if x.numel() else 0.0,
                float((gu.grad - gu_ref.grad[mine]).abs().max()),
                float((dn.grad - dn_ref.grad[mine]).abs().max()),
            )
            diffs[key + "_rows"] = int(out.shape[0])
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(diffs))
    dist.destroy_process_group()


def test_expert_parallel_two_ranks_match_one_process_outputs_and_gradients(tmp_path):
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        diffs = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for round_, per_rank in enumerate(ROUNDS):
            for impl in ("grouped_mm", "loop"):
                assert diffs[f"round{round_}_{impl}_rows"] == sum(per_rank[rank])
                assert diffs[f"round{round_}_{impl}"] < 1e-4, (rank, round_, impl, diffs)
