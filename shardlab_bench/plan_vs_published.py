"""The memory plan against published GPU measurements: each published FSDP2 run of a Llama-class model planned with
its settings and `distributed.plan_device`, written to one JSON that docs/memory-plan.md's table renders.

    python -m shardlab_bench plan_vs_published --out docs/bench/plan_vs_published.json

Nothing is measured here: the published figures are typed below with their sources (file, commit, table, row), and
the plans are dry runs on the meta device (seconds each, on any machine). The published figure is what torchtitan
logs as `memory:`, the peak of the CUDA caching allocator's *reserved* bytes (`torch.cuda.memory_stats()
["reserved_bytes.all.peak"]`, torchtitan/metrics.py at 9dec370, lines 56-64), so the plan's figure to set beside it
is its allocated peak plus its allocator term (block rounding and the fragmentation allowance), without the CUDA
context and NCCL's buffers, which live outside the allocator.

Two plans per run, both what `dry_run=true` prints for the shardlab run with the keys below:
  plan            activation checkpointing as torchtitan applies it, in shardlab's keys: to the transformer blocks
                  only (distributed.ac_skip_units=[0,-1]: not the embedding, not the output head), and for selective
                  op keeping the outputs of the 1st, 3rd, 5th and 7th matmul of each block (wq, wv, w1, w2;
                  distributed.ac_matmul_save_every=2: torchtitan's policy saves "every other mm", counting from one in
                  each block's forward; torchtitan/distributed/activation_checkpoint.py, SelectiveAC);
  mode defaults   the same mode with shardlab's defaults (every unit checkpointed; selective_op keeping every matmul
                  output), to show what those two keys are worth.
No modelling override: both are the plan's own arithmetic. Neither models torch.compile or float8 (torchao): rows that
used them show how far they move the figure.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from shardlab_bench.provenance import collect, finish

REPO = Path(__file__).resolve().parent.parent

TITAN = "https://github.com/pytorch/torchtitan/blob"
DEC_2024 = "31a17bfdb70bab6f62a13d21816a5339b911d6e3"  # benchmarks/llama3_h100_202412_torchtitan.md as stored
JUN_2025 = "bcdeaa37c92d1eaceeec3351e7ac81be6a1488af"  # benchmarks/llama3_8b_h200_2025-06_torchtitan.md as stored
H100_FILE = "benchmarks/llama3_h100_202412_torchtitan.md"
H200_FILE = "benchmarks/llama3_8b_h200_2025-06_torchtitan.md"
RESERVED = "peak reserved (torchtitan's `memory:`: reserved_bytes.all.peak), max over ranks"
DEC_RUN = (
    "torch 1963fc8 (2024-12-23), torchao eab345c, torchtitan 9dec370 (2024-12-26); train_configs/llama3_8b.toml there: "
    "seq_len 8192, AdamW, bf16 params / fp32 reduce, selective op AC; H100 SXM 96 GB HBM2e at 500 W, NVLink"
)
JUN_RUN = (
    "torch 2.8.0a0+5228986c39 (NGC 25.05), torchao 0afa4c1, torchtitan e7c0cae (2025-06-13); its llama3_8b.toml: "
    "seq_len 8192, AdamW, bf16 params / fp32 reduce, selective op AC; --training.compile also compiles the loss "
    "there (torchtitan/components/loss.py); float8 with fp8 all-gather; 8 H200 per host, 400 Gb/s RDMA per GPU"
)


def published(
    key: str, path: str, commit: str, table: str, row: str, gib: float, world: int, local: int, seq: int, ac: str,
    compile_: bool, float8: str, device: str, gpu: str, run: str, leaves_out: str,
) -> dict[str, Any]:  # fmt: skip
    return {
        "key": key,
        "source": {
            "url": f"{TITAN}/{commit}/{path}",
            "repo": "pytorch/torchtitan",
            "file": path,
            "commit": commit,
            "table": table,
            "row": row,
            "run": run,
        },  # fmt: skip
        "published_gib": gib,
        "measures": RESERVED,
        "model": "Llama 3.1 8B",
        "gpu": gpu,
        "world_size": world,
        "local_batch": local,
        "seq_len": seq,
        "activation_checkpointing": ac,
        "compile": compile_,
        "float8": float8,
        "precision": "bf16 params, fp32 gradient reduction (FSDP2 MixedPrecisionPolicy)",
        "optimizer": "AdamW",
        "plan_device": device,
        "plan_leaves_out": leaves_out,
    }


T1 = "Table 1: FSDP, Llama 3.1 8B, 8 GPUs, local batch 2, selective AC"
T2 = "Table 2: FSDP + CP + torch.compile + Float8, Llama 3.1 8B, 8 GPUs, local batch 1, full AC"
T3 = "Table 3: FSDP, Llama 3.1 8B, 128 GPUs, local batch 2, selective AC"
H100, H200 = "H100 SXM 96 GB (HBM2e)", "H200 SXM 141 GB"
SAME = "nothing: the same settings"
BLOCKS = "torch.compile of each block (fusion; inductor's own choice of what to save under the AC policy)"
FLOAT8 = BLOCKS + "; float8 linears (their fp8 casts; _scaled_mm is not in torchtitan's save list)"
FULL = (
    "torch.compile and float8 inside the one block being recomputed (full AC keeps only block inputs, which neither "
    "changes; the loss was not compiled at 9dec370)"
)
LOSS = FLOAT8 + "; the compiled loss (no fp32 copy of the logits); fp8 all-gather (half the gathered bytes)"
PUBLISHED = [
    published("t1_fsdp", H100_FILE, DEC_2024, T1, "FSDP", 82.4, 8, 2, 8192, "selective_op", False, "none",
              "h100_80gb", H100, DEC_RUN, SAME),
    published("t1_compile", H100_FILE, DEC_2024, T1, "FSDP + torch.compile", 77.0, 8, 2, 8192, "selective_op", True,
              "none", "h100_80gb", H100, DEC_RUN, BLOCKS),
    published("t1_compile_float8", H100_FILE, DEC_2024, T1, "FSDP + torch.compile + Float8", 76.8, 8, 2, 8192,
              "selective_op", True, "linear layers", "h100_80gb", H100, DEC_RUN, FLOAT8),
    published("t3_fsdp", H100_FILE, DEC_2024, T3, "FSDP", 67.0, 128, 2, 8192, "selective_op", False, "none",
              "h100_80gb", H100, DEC_RUN, SAME),
    published("t3_compile", H100_FILE, DEC_2024, T3, "FSDP + torch.compile", 62.0, 128, 2, 8192, "selective_op", True,
              "none", "h100_80gb", H100, DEC_RUN, BLOCKS),
    published("t3_compile_float8", H100_FILE, DEC_2024, T3, "FSDP + torch.compile + Float8", 61.8, 128, 2, 8192,
              "selective_op", True, "linear layers", "h100_80gb", H100, DEC_RUN, FLOAT8),
    published("t2_fsdp8_cp1", H100_FILE, DEC_2024, T2, "FSDP 8, CP 1, sequence 32768", 83.9, 8, 1, 32768, "full", True,
              "linear layers", "h100_80gb", H100, DEC_RUN, FULL),
    published("h200_32", H200_FILE, JUN_2025, "Results (100th iteration)", "NUM_NODES 4 (32 GPUs)", 47.96, 32, 2, 8192,
              "selective_op", True, "linear layers + fp8 all-gather", "h200_141gb", H200, JUN_RUN, LOSS),
    published("h200_64", H200_FILE, JUN_2025, "Results (100th iteration)", "NUM_NODES 8 (64 GPUs)", 46.97, 64, 2, 8192,
              "selective_op", True, "linear layers + fp8 all-gather", "h200_141gb", H200, JUN_RUN, LOSS),
]  # fmt: skip


TORCHTITAN_AC = {
    # torchtitan wraps only model.layers (ActivationCheckpointing.apply), and SelectiveAC saves every other mm.
    "selective_op": ["distributed.ac_matmul_save_every=2", "distributed.ac_skip_units=[0,-1]"],
    "full": ["distributed.ac_skip_units=[0,-1]"],
}
"""The shardlab keys that make each checkpointing mode what torchtitan applies (units: embedding, blocks, head)."""


def overrides(p: dict[str, Any], as_torchtitan: bool = True) -> list[str]:
    """The shardlab keys of a published run (optimization.batch_size is global); ``as_torchtitan=False``: the
    checkpointing mode with shardlab's defaults instead of torchtitan's choice."""
    world, seq, ac = p["world_size"], p["seq_len"], p["activation_checkpointing"]
    return [
        "model=llama3_8b", "distributed=fully_sharded", f"distributed.world_size={world}",
        f"distributed.plan_device={p['plan_device']}", f"data.seq_len={seq}", f"model.max_seq_len={max(seq, 8192)}",
        f"optimization.batch_size={p['local_batch'] * world}", f"validation.batch_size={p['local_batch'] * world}",
        "distributed.precision=bf16", f"distributed.activation_checkpointing={ac}",
        *(TORCHTITAN_AC[ac] if as_torchtitan else []),
    ]  # fmt: skip


def plan(p: dict[str, Any]) -> dict[str, Any]:
    """Plan one published run: the peak, the allocator's term, the reserved figure, with torchtitan's checkpointing
    and with the mode's defaults."""
    from shardlab.cli.preflight import compose_config
    from shardlab.distributed.units import model_on_meta
    from shardlab.memory.estimate import estimate
    from shardlab.memory.layout import layout_of
    from shardlab.memory.plan import profile_config
    from shardlab.runner import build_task

    world = p["world_size"]
    cfg = compose_config(overrides(p))
    task = build_task(cfg, world_size=world)
    profile, ctx = profile_config(cfg, task, world, model_on_meta(task))

    def figures(as_torchtitan: bool) -> dict[str, int]:
        # Only the checkpointing keys differ between the two, so one profile serves both.
        est = estimate(profile, layout_of(compose_config(overrides(p, as_torchtitan)).distributed, world), ctx)
        return {
            "peak_bytes": est.peak, "allocator_bytes": est.allocator, "reserved_bytes": est.peak + est.allocator,
            "outside_bytes": est.outside, "device_bytes": est.device_peak, "state_bytes": est.state,
            "gathered_bytes": est.gathered, "activation_bytes": est.activations or 0,
        }  # fmt: skip

    return {
        "overrides": overrides(p),
        "plan": figures(True),
        "mode_defaults": figures(False),
        "largest_outside_bytes": profile.largest_outside,
        "capacity_bytes": ctx.capacity,
    }


def run(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    planned: dict[tuple, dict[str, Any]] = {}  # rows that differ only in compile/float8 share one plan
    out = []
    for p in rows:
        key = tuple(overrides(p))
        if key not in planned:
            planned[key] = plan(p)
        out.append({**p, **planned[key]})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the JSON to write")
    args = parser.parse_args(argv)
    meta = collect(__file__, argv)
    results = {"tool": "plan_vs_published", "rows": run(PUBLISHED)}
    results["meta"] = finish(meta)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}: {len(results['rows'])} published runs planned in {results['meta']['seconds']} s")
    return 0
