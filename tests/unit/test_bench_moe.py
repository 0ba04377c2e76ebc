"""shardlab_bench/moe.py writes its JSON: every expert candidate timed and exact against the per-expert loop, the
balancing toy's plain router collapsed, and the metadata of shardlab_bench.provenance."""

from __future__ import annotations

import json

from shardlab_bench import moe as bench_moe


def test_bench_moe_writes_exact_timed_candidates_and_the_balancing_figures(tmp_path):
    out = tmp_path / "moe.json"
    argv = ["--shapes", "tiny", "--repeats", "1", "--warmup", "0", "--balance-steps", "8", "--balance-tokens", "256"]
    bench_moe.main([*argv, "--balance-rates", "0.05", "--out", str(out)])
    result = json.loads(out.read_text())
    entry = result["experts"]["tiny_threads1"]
    assert set(entry) == set(bench_moe.CANDIDATES)
    for name, figures in entry.items():
        assert figures["median_ms"] > 0 and figures["max_abs_diff_vs_per_expert_loop"] < 1e-5, name
    assert entry["per_expert_loop"]["speedup_vs_per_expert_loop"] == 1.0
    assert result["balancing"]["plain_router"]["worst"] == 4.0  # 8 experts, top 2: every token on the same two
    assert "bias_rate_0.05" in result["balancing"]
    assert result["meta"]["settings"]["shapes"] == "tiny" and result["meta"]["commit"]
