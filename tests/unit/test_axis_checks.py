"""The pre-flight's refusals of the mesh's axes beyond data parallelism (shardlab/cli/axis_checks.py): each one line
naming the key, before any process starts; through the command line, exit code 2 and no run folder."""

from __future__ import annotations

import pytest

from shardlab.cli import checks
from shardlab.errors import ConfigError
from tests.conftest import compose_config

LLAMA = ["model=llama_tiny", "model.dim=64", "model.num_heads=4", "model.num_kv_heads=2", "model.ffn_dim=128"]
TP = ["distributed.backend=fully_sharded", "distributed.tensor_parallel_degree"]
MOE = ["model=moe_tiny", "model.dim=64", "model.num_heads=4", "model.num_kv_heads=2"]
EP = "distributed.expert_parallel_degree"
VISION = ["task=image_classification", "distributed.backend=fully_sharded", "optimization.batch_size=8",
          "validation.batch_size=8"]  # fmt: skip

REFUSED = {
    "degrees that do not fill the world": (
        [*LLAMA, f"{TP[0]}", f"{TP[1]}=4", "distributed.world_size=6"],
        r"the mesh's degrees multiply to tp 4 = 4 ranks, but the world size is 6",
    ),
    "heads": ([*LLAMA, TP[0], f"{TP[1]}=4", "model.num_heads=2", "model.num_kv_heads=1", "distributed.world_size=4"],
              r"^distributed.tensor_parallel_degree \(4\) must divide model.num_heads \(2\)"),
    "kv heads": ([*LLAMA, TP[0], f"{TP[1]}=2", "model.num_kv_heads=1", "distributed.world_size=2"],
                 r"^distributed.tensor_parallel_degree \(2\) must divide model.num_kv_heads \(1\)"),
    "ffn width": ([*LLAMA, TP[0], f"{TP[1]}=2", "model.ffn_dim=129", "distributed.world_size=2"],
                  r"^distributed.tensor_parallel_degree \(2\) must divide model.ffn_dim \(the FFN width\) \(129\)"),
    "vocabulary": ([*LLAMA, TP[0], f"{TP[1]}=2", "model.vocab_size=321", "distributed.world_size=2"],
                   r"^distributed.tensor_parallel_degree \(2\) must divide the vocabulary \(321\)"),
    "row length": ([*LLAMA, TP[0], f"{TP[1]}=2", "data.seq_len=31", "distributed.world_size=2"],
                   r"^data.seq_len \(31\) must be a multiple of distributed.tensor_parallel_degree \(2\)"),
    "gpt positions": (
        [TP[0], f"{TP[1]}=2", "model.max_seq_len=33", "distributed.world_size=2"],
        r"^distributed.tensor_parallel_degree \(2\) must divide model.max_seq_len \(33\)",
    ),
    "ddp": ([*LLAMA, "distributed.backend=ddp", f"{TP[1]}=2", "distributed.world_size=2"],
            r"^distributed.tensor_parallel_degree \(2\) needs distributed.backend=fully_sharded"),
    "vision tensor": ([*VISION, f"{TP[1]}=2", "distributed.world_size=2"],
                      r"^distributed.tensor_parallel_degree \(2\): task image_classification's models do not split "
                      r"that way; they stay data-parallel"),
    "vision pipeline": ([*VISION, "distributed.pipeline_parallel_degree=2", "distributed.world_size=2"],
                        r"^distributed.pipeline_parallel_degree \(2\): task image_classification's models do not"),
    "context on cpu": ([*LLAMA, TP[0], "distributed.context_parallel_degree=2", "distributed.world_size=2"],
                       r"^distributed.context_parallel_degree \(2\) needs CUDA"),
    "async tp on cpu": ([*LLAMA, TP[0], f"{TP[1]}=2", "distributed.async_tensor_parallel=true",
                         "distributed.world_size=2"], r"^distributed.async_tensor_parallel is a CUDA feature"),
    "expert parallel on a dense model": ([*LLAMA, TP[0], f"{EP}=2", "distributed.world_size=2"],
                                         r"^distributed.expert_parallel_degree \(2\) needs a mixture-of-experts model"),
    "experts the degree does not divide": ([*MOE, TP[0], f"{EP}=4", "model.moe.num_experts=6",
                                            "distributed.world_size=4"],
                                           r"^distributed.expert_parallel_degree \(4\) must divide "
                                           r"model.moe.num_experts \(6\)"),
    "expert parallel beyond the sharding ranks": ([*MOE, TP[0], f"{EP}=4", "distributed.sharding_degree=2",
                                                   "distributed.world_size=4"],
                                                  r"^distributed.expert_parallel_degree \(4\) must divide the "
                                                  r"data-sharding ranks \(2"),
    "expert parallel under ddp": ([*MOE, "distributed.backend=ddp", f"{EP}=2", "distributed.world_size=2"],
                                  r"^distributed.expert_parallel_degree \(2\) needs distributed.backend=fully_sharded"),
    "expert parallel with pipeline stages": ([*MOE, TP[0], f"{EP}=2", "distributed.pipeline_parallel_degree=2",
                                              "distributed.world_size=4"],
                                             r"distributed.expert_parallel_degree \(2\) is not composed yet with "
                                             r"distributed.pipeline_parallel_degree \(2\) \(it composes with the data "
                                             r"axes and distributed.tensor_parallel_degree\): set one of them to 1"),
    "expert parallel with context parallel": ([*MOE, TP[0], f"{EP}=2", f"{TP[1]}=2",
                                               "distributed.context_parallel_degree=2", "distributed.world_size=8"],
                                              r"^distributed.expert_parallel_degree \(2\) is not composed yet with "
                                              r"distributed.context_parallel_degree \(2\) \(it composes"),
    "expert parallel with tensor parallel, heads": ([*MOE, TP[0], f"{EP}=2", f"{TP[1]}=4", "model.num_kv_heads=2",
                                                     "distributed.world_size=8"],
                                                    r"^distributed.tensor_parallel_degree \(4\) must divide "
                                                    r"model.num_kv_heads \(2\)"),
    "expert parallel degree zero": ([*MOE, TP[0], f"{EP}=0", "distributed.world_size=2"],
                                    r"^distributed.expert_parallel_degree \(0\) must be at least 1"),
}  # fmt: skip


def test_expert_parallelism_within_the_data_sharding_ranks_passes(tiny_lm):
    """EP 2 on 2 ranks, and FSDP 2 x EP 2 on 4 (each expert group of 2 inside 4 sharding ranks); TP 2 x EP 2 on 4
    and TP 2 alone on an MoE model (its FFN width not a multiple of the degree: the MoE blocks are not split)."""
    for world in (2, 4):
        checks.check(tiny_lm(*MOE, TP[0], f"{EP}=2", f"distributed.world_size={world}"), num_cuda_devices=0)
    checks.check(tiny_lm(*MOE, TP[0], f"{TP[1]}=2", f"{EP}=2", "distributed.world_size=4"), num_cuda_devices=0)
    odd_width = ["model.moe.ffn_dim=33", "model.moe.num_experts=3", "model.moe.top_k=1"]
    checks.check(tiny_lm(*MOE, *odd_width, TP[0], f"{TP[1]}=2", "distributed.world_size=2"), num_cuda_devices=0)


@pytest.mark.parametrize("case", REFUSED)
def test_each_axis_refusal_names_its_key(case, tiny_lm):
    overrides, pattern = REFUSED[case]
    with pytest.raises(ConfigError, match=pattern) as refused:
        checks.check(tiny_lm(*overrides) if "task=" not in overrides[0] else compose_config(overrides),
                     num_cuda_devices=0)  # fmt: skip
    assert "\n" not in str(refused.value)


def test_the_batch_splits_over_the_data_parallel_ranks_only(tiny_lm):
    """FSDP 2 x TP 2 on 4 ranks: the batch is split in 2, not 4; a batch of 6 fits it."""
    checks.check(tiny_lm(*LLAMA, TP[0], f"{TP[1]}=2", "distributed.world_size=4", "optimization.batch_size=6",
                         "validation.batch_size=6"), num_cuda_devices=0)  # fmt: skip
    with pytest.raises(ConfigError, match=r"must be divisible by the data-parallel ranks \(world / tensor x pipe"):
        checks.check(tiny_lm(*LLAMA, TP[0], f"{TP[1]}=2", "distributed.world_size=4", "optimization.batch_size=5",
                             "validation.batch_size=6"), num_cuda_devices=0)  # fmt: skip


CP = ["distributed.backend=fully_sharded", "distributed.context_parallel_degree=2", "distributed.world_size=2"]
REFUSED_ON_CUDA = {
    "sequence not a multiple of 2 x cp": ([*LLAMA, *CP, "data.seq_len=30"],
                                          r"^distributed.context_parallel_degree \(2\): data.seq_len \(30\) must be a "
                                          r"multiple of 2 x 2 = 4"),
    "ddp": ([*LLAMA, *CP, "distributed.backend=ddp"],
            r"^distributed.context_parallel_degree \(2\) needs distributed.backend=fully_sharded"),
    "pipeline": ([*LLAMA, *CP, "distributed.pipeline_parallel_degree=2", "distributed.world_size=4",
                  "optimization.update_freq=2"],
                 r"^distributed.context_parallel_degree \(2\) with distributed.pipeline_parallel_degree \(2\)"),
    "rotate method": ([*LLAMA, *CP, "distributed.context_parallel_rotate_method=ring"],
                      r"^distributed.context_parallel_rotate_method must be one of allgather, alltoall, got 'ring'"),
    "dropout": ([*CP, "model.dropout=0.1"], r"^distributed.context_parallel_degree \(2\): model.dropout \(0.1\)"),
    "fine-tuning rows": ([*LLAMA, *CP, "task=sft"], r"^distributed.context_parallel_degree \(2\): data.format="),
    "vision": ([*VISION, "distributed.context_parallel_degree=2", "distributed.world_size=2"],
               r"^distributed.context_parallel_degree \(2\): task image_classification's models do not split"),
}  # fmt: skip


@pytest.mark.parametrize("case", REFUSED_ON_CUDA)
def test_context_parallel_refusals_on_a_cuda_machine(case, tiny_lm):
    """Off CPU the pre-flight goes past "needs CUDA" to what the run cannot split; each refusal one line."""
    overrides, pattern = REFUSED_ON_CUDA[case]
    composed = compose_config(overrides) if "task=image_classification" in overrides else tiny_lm(*overrides)
    with pytest.raises(ConfigError, match=pattern) as refused:
        checks.check(composed, num_cuda_devices=4)
    assert "\n" not in str(refused.value)


def test_context_parallel_with_compile_is_refused_on_a_cuda_machine(tiny_lm):
    """Asked of the axis checks alone: the whole pre-flight would probe this machine's (absent) driver for compile."""
    from shardlab.cli.axis_checks import axis_errors
    from shardlab.runner import rank_task

    cfg = tiny_lm(*LLAMA, *CP, "distributed.compile=true")
    (line,) = axis_errors(cfg, rank_task(cfg), 2, num_cuda_devices=2)
    assert line.startswith("distributed.context_parallel_degree (2) with distributed.compile=true"), line


def test_context_parallel_passes_the_pre_flight_on_a_cuda_machine(tiny_lm):
    """Llama and GPT at data.seq_len 32 = 8 x 4 over 2 context ranks, and FSDP 2 x CP 2 on 4 ranks (the batch split
    over the 2 data ranks only): nothing refused."""
    checks.check(tiny_lm(*LLAMA, *CP), num_cuda_devices=2)
    checks.check(tiny_lm(*CP, "distributed.world_size=4", "optimization.batch_size=6", "validation.batch_size=6"),
                 num_cuda_devices=4)  # fmt: skip


@pytest.mark.parametrize(
    "case",
    # each a CLI start (~15 s here): the others with -m slow, their refusals checked in-process above
    [
        "kv heads",
        *(pytest.param(c, marks=pytest.mark.slow) for c in ("context on cpu", "experts the degree does not divide")),
    ],
)
def test_the_command_line_refuses_before_any_rank_starts(case, tmp_path, corpus_cache, cli_forks):
    """One line, exit code 2, nothing written: the run folder is never made."""
    overrides, pattern = REFUSED[case]
    proc = cli_forks.run(*overrides, f"data.cache_dir={corpus_cache}", f"hydra.run.dir={tmp_path}/run")
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 2 and "[train]" not in out, (out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    import re

    assert re.search(pattern.replace("^", "^error: "), lines[0]), lines[0]
    assert not (tmp_path / "run").exists()
