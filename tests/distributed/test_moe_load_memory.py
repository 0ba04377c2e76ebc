"""model.pretrained's memory while loading a mixture of experts (issue 49, "must show" 3): on 2 ranks (CPU, gloo) a
~40 MB bf16 Qwen3-MoE folder (8 experts, one hub tensor per expert) is read at expert-parallel 2 (each rank's 4
experts of every layer, split on the 'ep' axis; the other weights FSDP2-sharded over both ranks) and, slow, on 2
fully_sharded ranks (FSDP2's shards of the grouped experts, 4 experts per rank). Each rank reads its own experts'
tensors straight into its shard: its peak while loading stays within its shard plus one tensor, as the dense load's
does (the measurement, its windows and its control: tests/distributed/test_hf_load_memory.py), and the reader, as it
takes each tensor out of a file, takes the hub tensors of the rank's own experts only, each whole and once
(tests/distributed/test_moe_pretrained.py's ``record_reads``)."""

from __future__ import annotations

import sys

import pytest

from tests.distributed.harness import run_spawned
from tests.distributed.test_hf_load_memory import MB, MEASURED, SLACK, folder_sizes, gather, measure_the_load
from tests.distributed.test_moe_pretrained import READ, expert_of, record_reads
from tests.hf_folders import make_folder

SHAPE = dict(hidden_size=512, moe_intermediate_size=384, num_experts=8, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64)  # fmt: skip
"""~22M parameters: ~44 MB in the bf16 files, ~88 MB in the ranks' fp32; a grouped expert tensor 12 MB in fp32 (a
third of a rank's shard of a layer), the largest hub tensor 1 MB."""


def measure_and_record() -> None:
    """In each rank: the hub expert tensors read recorded (below the measurement's windows, so a read is both
    measured and recorded), then the load measured (``measure_the_load``, which loads twice: its second load, the
    meter's reading, reads the same tensors again)."""
    record_reads()
    measure_the_load()


def gather_reads(trainer) -> dict:
    """Every rank's measurements, the hub expert tensors it read (each with how many times) and the experts of
    layer 0 its shard holds."""

    experts = dict(trainer.model.named_parameters())["blocks.0.mlp.experts.gate_up_proj"]
    (chunk,) = experts.__create_chunk_list__()
    held = list(range(chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]))
    MEASURED.update(read={key: READ.count(key) for key in READ}, held=held)
    return gather(trainer)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the peak is read from /proc (VmHWM, clear_refs)")
@pytest.mark.parametrize("ep", [2, pytest.param(1, marks=pytest.mark.slow)], ids=["ep2", "fully_sharded"])
def test_each_rank_loads_its_experts_within_its_shard_and_one_tensor(tiny_lm, tmp_path, ep):
    folder = make_folder("qwen3_moe", tmp_path / "qwen3_moe", shape=SHAPE, max_shard_size="8MB")
    stored, model, largest = folder_sizes(folder)
    assert stored > 40 * MB and largest <= 1 * MB and len(list(folder.glob("*.safetensors"))) >= 3
    cfg = tiny_lm(
        f"model.pretrained={folder}", "distributed=fully_sharded", "distributed.world_size=2",
        f"distributed.expert_parallel_degree={ep}", "distributed.cpu_allocator=lean", "optimization.max_steps=1",
        "optimization.batch_size=4", "data.seq_len=16", "validation.interval_steps=0", "checkpoint.save=false",
        "lr_scheduler.warmup_steps=0",
    )  # fmt: skip
    (result,) = run_spawned([cfg], 2, run_dirs=[tmp_path / "run"], inspect=gather_reads, prepare=measure_and_record,
                            start_method="spawn")  # fmt: skip
    ranks = result["ranks"]
    lines = [
        f"rank {r}: experts {m['held']}, shard {m['shard'] / MB:.1f} MB, load peak {m['load_peak'] / MB:.1f} MB "
        f"above the materialized shard ({m['with_mapped_pages'] / MB:.1f} MB with the mapped file pages), "
        f"whole-folder control {m['control_peak'] / MB:.1f} MB"
        for r, m in enumerate(ranks)
    ]
    report = f"model {model / MB:.1f} MB fp32 ({stored / MB:.1f} MB bf16 files), largest tensor {largest / MB:.1f} MB"
    print("\n".join([report, *lines]))
    assert [m["held"] for m in ranks] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for m in ranks:
        assert m["shard"] == pytest.approx(model / 2, rel=0.05), report
        assert m["load_peak"] < largest + SLACK, "\n".join([report, *lines])
        assert m["shard"] + m["load_peak"] < 0.75 * model  # no rank holds the full model
        assert m["control_peak"] > 0.8 * stored  # the meter sees a folder read whole: the bound above is the loader's
        # its own experts' gate, up and down of every layer, each read whole once a load (the meter's load: twice)
        assert {expert_of(key)[1] for key in m["read"]} == set(m["held"]), m["read"]
        assert len(m["read"]) == SHAPE["num_hidden_layers"] * len(m["held"]) * 3 and set(m["read"].values()) == {2}
