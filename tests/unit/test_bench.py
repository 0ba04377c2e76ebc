"""shardlab_bench/train.py: one JSON with throughput, step time, state bytes, peak memory and collective counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardlab_bench import train as bench


def tiny_overrides(tmp_path: Path) -> list[str]:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):  # the smallest corpus leaves one document for validation
        (corpus / f"{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 400)
    return [
        f"data.path={corpus}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.seq_len=16",
        "model.num_layers=2",
        "model.dim=32",
        "model.num_heads=2",
        "model.max_seq_len=16",
        "optimization.batch_size=4",
        "validation.batch_size=4",
    ]


def test_bench_writes_json_with_positive_figures(tmp_path):
    out = tmp_path / "bench.json"
    result = bench.main([*tiny_overrides(tmp_path), "--steps", "2", "--warmup", "1", "--out", str(out)])
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(result))
    for key in ("tokens_per_s", "median_step_ms", "mean_step_ms", "optimizer_step_ms"):
        assert written[key] > 0, key
    assert written["unit"] == "tokens" and written["tokens_per_step"] == 4 * 16
    assert len(written["step_ms"]) == 2
    assert written["meta"]["argv"][0] == "train" and written["meta"]["settings"]["steps"] == 2
    (rank,) = written["per_rank"]
    num_params = written["num_params"]
    assert rank["param_bytes"] == rank["grad_bytes"] == 4 * num_params  # fp32, one rank holds everything
    assert rank["optimizer_state_bytes"] >= 2 * 4 * num_params  # exp_avg + exp_avg_sq (+ step scalars)
    assert rank["state_bytes"] == rank["param_bytes"] + rank["grad_bytes"] + rank["optimizer_state_bytes"]
    assert rank["peak_memory_bytes"] > rank["state_bytes"]
    assert written["collectives_per_step"] == {}  # one process, backend single: no collectives


def test_bench_rejects_bad_overrides_in_one_line(tmp_path):
    from shardlab.errors import ConfigError

    with pytest.raises(ConfigError, match="distributed.backend"):
        bench.main(["distributed.backend=fuly_sharded", "--out", str(tmp_path / "x.json")])


def test_collective_kinds_are_named_by_type():
    assert bench.collective_kind("c10d._allgather_base_.default") == "all_gather"
    assert bench.collective_kind("c10d._reduce_scatter_base_.default") == "reduce_scatter"
    assert bench.collective_kind("c10d.allreduce_.default") == "all_reduce"
    assert bench.collective_kind("_c10d_functional.all_reduce.default") == "all_reduce"
    assert bench.collective_kind("_c10d_functional.wait_tensor.default") is None
    assert bench.collective_kind("aten.mm.default") is None


def test_collective_counter_counts_bytes_of_a_real_all_reduce():
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        counter = bench.CollectiveCounter()
        with counter:
            dist.all_reduce(torch.ones(10))
            torch.ones(3) + 1
        assert counter.counts == {"all_reduce": {"count": 1, "bytes": 40}}
    finally:
        if created:
            dist.destroy_process_group()


def test_bench_counts_fully_sharded_collectives_as_the_plan_expects(tmp_path):
    """2 gloo ranks: FSDP2 gathers every unit for forward and the resharded ones again for backward, and
    reduce-scatters every gradient once; the counted bytes equal those from the unit plan. Also: MFU is reported."""
    out = tmp_path / "bench.json"
    result = bench.main(
        [
            *tiny_overrides(tmp_path),
            "distributed.backend=fully_sharded",
            "distributed.world_size=2",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--out",
            str(out),
        ]
    )
    counted, expected = result["collectives_per_step"], result["expected_collectives"]
    param_bytes = 4 * result["num_params"]
    assert counted["all_gather"]["bytes"] == expected["all_gather"]["bytes"]
    assert param_bytes < counted["all_gather"]["bytes"] <= 2 * param_bytes
    # Every gradient is reduce-scattered once (distributed.reduce_scatter=native, the default); the only all-reduces
    # are a few scalars (the clipping norm, the logged loss sums).
    assert counted["reduce_scatter"]["bytes"] == expected["reduce_scatter"]["bytes"] == param_bytes
    assert counted["all_reduce"]["bytes"] < 1024
    assert [r["param_bytes"] for r in result["per_rank"]] == [param_bytes // 2] * 2  # dims divide by 2: no padding
    # Model FLOPs: at least 6 per parameter per token (the matmuls; embeddings are lookups but the tied head is not),
    # counted by FlopCounterMode, and a measured CPU peak that the run cannot exceed.
    tokens = result["tokens_per_step"]
    position_table = result["model"]["max_seq_len"] * result["model"]["dim"]  # a lookup: no FLOPs
    assert 6 * (result["num_params"] - position_table) * tokens <= result["model_flops_per_step"]
    assert result["model_flops_per_step"] <= 2 * 6 * result["num_params"] * tokens
    assert 0 < result["mfu"] < 1 and result["peak_method"].startswith("measured fp32 GEMM")


def test_bench_collectives_times_each_op_and_the_all_reduce_form_matches_native(tmp_path):
    from shardlab_bench import collectives as bench_collectives

    out = tmp_path / "collectives.json"
    result = bench_collectives.main(["--world-sizes", "2", "--sizes", "10K,64K", "--iters", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["meta"]["settings"]["sizes"] == "10K,64K"  # what it was measured with (shardlab_bench/provenance.py)
    rows = result["rows"]
    assert [(r["world_size"], r["numel"]) for r in rows] == [(2, 10_000), (2, 64_000)]
    for row in rows:
        for op in ("all_reduce", "reduce_scatter_native", "reduce_scatter_via_all_reduce", "all_gather_native"):
            assert row[f"{op}_ms"] > 0, op
        assert row["max_abs_diff_vs_native"] < 1e-6  # rounding at most, on every rank's chunk; a wrong chunk: ~1
