"""model.pretrained's memory while loading a mixture of experts (issue 49, "must show" 3 as far as FSDP goes): on 2
fully_sharded ranks (CPU, gloo) a ~40 MB bf16 Qwen3-MoE folder (8 experts, one hub tensor per expert) is read into
FSDP2's shards of the grouped experts (4 experts per rank), each rank reading its own experts' tensors straight into
its shard: its peak while loading stays within its shard plus one tensor, as the dense load's does (the measurement,
its windows and its control: tests/distributed/test_hf_load_memory.py). Expert parallelism is not measured here."""

from __future__ import annotations

import sys

import pytest

from tests.distributed.harness import run_spawned
from tests.distributed.test_hf_load_memory import MB, SLACK, folder_sizes, gather, measure_the_load
from tests.hf_folders import make_folder

SHAPE = dict(hidden_size=512, moe_intermediate_size=384, num_experts=8, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64)  # fmt: skip
"""~22M parameters: ~44 MB in the bf16 files, ~88 MB in the ranks' fp32; a grouped expert tensor 12 MB in fp32 (a
third of a rank's shard of a layer), the largest hub tensor 1 MB."""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the peak is read from /proc (VmHWM, clear_refs)")
def test_each_rank_loads_its_experts_within_its_shard_and_one_tensor(tiny_lm, tmp_path):
    folder = make_folder("qwen3_moe", tmp_path / "qwen3_moe", shape=SHAPE, max_shard_size="8MB")
    stored, model, largest = folder_sizes(folder)
    assert stored > 40 * MB and largest <= 1 * MB and len(list(folder.glob("*.safetensors"))) >= 3
    cfg = tiny_lm(
        f"model.pretrained={folder}", "distributed=fully_sharded", "distributed.world_size=2",
        "distributed.cpu_allocator=lean", "optimization.max_steps=1", "optimization.batch_size=4",
        "data.seq_len=16", "validation.interval_steps=0", "checkpoint.save=false", "lr_scheduler.warmup_steps=0",
    )  # fmt: skip
    (result,) = run_spawned([cfg], 2, run_dirs=[tmp_path / "run"], inspect=gather, prepare=measure_the_load,
                            start_method="spawn")  # fmt: skip
    ranks = result["ranks"]
    lines = [
        f"rank {r}: shard {m['shard'] / MB:.1f} MB, load peak {m['load_peak'] / MB:.1f} MB above the materialized "
        f"shard ({m['with_mapped_pages'] / MB:.1f} MB with the mapped file pages), whole-folder control "
        f"{m['control_peak'] / MB:.1f} MB"
        for r, m in enumerate(ranks)
    ]
    report = f"model {model / MB:.1f} MB fp32 ({stored / MB:.1f} MB bf16 files), largest tensor {largest / MB:.1f} MB"
    print("\n".join([report, *lines]))
    for m in ranks:
        assert m["shard"] == pytest.approx(model / 2, rel=0.05), report
        assert m["load_peak"] < largest + SLACK, "\n".join([report, *lines])
        assert m["shard"] + m["load_peak"] < 0.75 * model  # no rank holds the full model
        assert m["control_peak"] > 0.8 * stored  # the meter sees a folder read whole: the bound above is the loader's
