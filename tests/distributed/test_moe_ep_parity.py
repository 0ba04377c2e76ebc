"""Expert parallelism (distributed.expert_parallel_degree) trains exactly like one process (CPU, gloo): EP 2 on 2
ranks, EP 4 on 4 ranks (one expert per rank), FSDP 2 x EP 2 on 4 ranks (each group's experts sharded again over
the other group; also under activation checkpointing; with 2 experts, each rank's one sharded by rows) and hybrid
2 x EP 2 (replicated across it), 10 steps of a tiny MoE whose router moves its balancing bias after every step
(DeepSeek-V3's update, from the load summed over the ranks). Losses, gradient norms and the final weights and biases
are compared.
A step folder written at EP 4 holds the unsplit model's names and shapes; it resumes at EP 2 and on one process,
continuing the uninterrupted curve.

The auxiliary balancing loss is off here (aux_loss_coef=0): like transformers' and Megatron's, it is computed per
rank's micro-batch, a product of two per-batch means, so it differs between layouts by design whatever the experts'
placement; the z-loss (a mean over tokens) stays on."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import DTensor

from tests.distributed.harness import run_spawned
from tests.distributed.test_tensor_parallel import assert_trains_as_one_process, inspect, single, train_records

EXPERTS = 4
MOE = [
    "model=moe_tiny", "model.num_layers=2", "model.dim=32", "model.num_heads=2", "model.num_kv_heads=2",
    f"model.moe.num_experts={EXPERTS}", "model.moe.ffn_dim=32", "model.moe.aux_loss_coef=0",
    "model.moe.z_loss_coef=0.001", "model.moe.score_bias=true", "model.moe.bias_update_rate=0.05",
]  # fmt: skip
TWO_EXPERTS = [*(o for o in MOE if not o.startswith("model.moe.num_experts")), "model.moe.num_experts=2",
               "model.moe.top_k=1"]  # fmt: skip
"""Fewer experts than ranks: at FSDP 2 x EP 2 each rank's one expert is sharded over the other group by rows."""
CKPT = ["checkpoint.interval_steps=5"]
ACCUMULATE = ["optimization.update_freq=2", "distributed.reduce_every_microbatch=false"]
"""Two micro-batches a step, the gradients reduced after the last only (the experts' own FSDP unit included); the
step's load, summed over both, moves the bias once."""


def ep(degree: int) -> list[str]:
    return ["distributed.backend=fully_sharded", f"distributed.expert_parallel_degree={degree}"]


def inspect_experts(trainer) -> dict:
    """The full weights, and where each expert weight lives: its mesh's axes, placements and the rows (experts, or
    slices of them) this rank holds."""
    experts = {
        name: (param.device_mesh.mesh_dim_names, [str(p) for p in param.placements], param.to_local().shape[0])
        for name, param in trainer.model.named_parameters()
        if "experts" in name and isinstance(param, DTensor)
    }
    return {**inspect(trainer), "experts": experts}


@pytest.fixture(scope="module")
def runs(tiny_lm, tmp_path_factory) -> dict:
    """One process (the reference); on 4 ranks EP 4 (saving at step 5) and FSDP 2 x EP 2; on 2 ranks EP 2 and EP 2
    resuming EP 4's step 5; one process resuming it too."""
    reference_dir, ep4_dir = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("ep4")
    results = {"reference": single(tiny_lm(*MOE, *CKPT), reference_dir)}
    four = {
        "ep4": tiny_lm(*MOE, *ep(4), *CKPT),
        "fsdp2_ep2": tiny_lm(*MOE, *ep(2)),
        "hybrid2_ep2": tiny_lm(*MOE, *ep(2), "distributed.sharding_degree=2"),
        "fsdp2_ep2_ac": tiny_lm(*MOE, *ep(2), "distributed.activation_checkpointing=full"),
        "fsdp2_ep2_rows": tiny_lm(*TWO_EXPERTS, *ep(2)),
    }
    run_dirs = [ep4_dir, *(tmp_path_factory.mktemp(name) for name in list(four)[1:])]
    results |= zip(four, run_spawned(list(four.values()), 4, run_dirs, inspect=inspect_experts), strict=True)
    step5 = ep4_dir / "checkpoints" / "step_00000005"
    two = {
        "ep2": tiny_lm(*MOE, *ep(2)),
        "ep2_from_ep4": tiny_lm(*MOE, *ep(2), f"checkpoint.resume={step5}"),
        "ep2_accumulating": tiny_lm(*MOE, *ep(2), *ACCUMULATE),
    }
    results |= zip(two, run_spawned(list(two.values()), 2, inspect=inspect_experts), strict=True)
    results["reference_accumulating"] = single(tiny_lm(*MOE, *ACCUMULATE), tmp_path_factory.mktemp("acc"))
    results["single_from_ep4"] = single(tiny_lm(*MOE, f"checkpoint.resume={step5}"), tmp_path_factory.mktemp("s"))
    results["reference_two_experts"] = single(tiny_lm(*TWO_EXPERTS), tmp_path_factory.mktemp("two"))
    results["no_bias_update"] = single(tiny_lm(*MOE, "model.moe.bias_update_rate=0"), tmp_path_factory.mktemp("n"))
    return {**results, "ep4_step5": step5, "reference_step5": reference_dir / "checkpoints" / "step_00000005"}


@pytest.mark.parametrize(
    ("name", "axes", "rows"),
    [
        ("ep2", ("dp_shard_mod_ep", "ep"), 2),
        ("ep4", ("dp_shard_mod_ep", "ep"), 1),
        ("fsdp2_ep2", ("dp_shard_mod_ep", "ep"), 1),
        ("hybrid2_ep2", ("dp_replicate", "dp_shard_mod_ep", "ep"), 2),
        ("fsdp2_ep2_ac", ("dp_shard_mod_ep", "ep"), 1),
        ("ep2_accumulating", ("dp_shard_mod_ep", "ep"), 2),
    ],
)
def test_expert_parallel_ranks_train_as_one_process(name, axes, rows, runs):
    """Each rank holds num_experts / ep experts (FSDP 2 x EP 2: half of its group's 2, by rows; hybrid 2 x EP 2:
    its group's 2, replicated across the other group), split by experts on the 'ep' axis; the balancing biases,
    moved from the summed load, equal one process's; activation checkpointing recomputes the exchanges alike."""
    result, reference = runs[name], runs["reference_accumulating" if name.endswith("accumulating") else "reference"]
    assert result["experts"], "no expert weight was split"
    for layout in result["experts"].values():
        assert layout[0] == axes and layout[1][-1] == "S(0)" and layout[2] == rows, result["experts"]
    assert_trains_as_one_process(result, reference)


def test_an_expert_per_rank_over_two_sharding_ranks_is_sharded_by_rows_and_trains_as_one_process(runs):
    """2 experts at FSDP 2 x EP 2: each rank's group holds 1 expert, which FSDP2 shards over the 2 ranks outside the
    group by rows (Shard(1): half an expert each, no padded whole expert); the curve is one process's."""
    result = runs["fsdp2_ep2_rows"]
    assert result["experts"], "no expert weight was split"
    for axes, placements, rows in result["experts"].values():
        assert axes == ("dp_shard_mod_ep", "ep") and placements == ["S(1)", "S(0)"] and rows == 1, result["experts"]
    assert_trains_as_one_process(result, runs["reference_two_experts"])


def test_the_balancing_bias_moves_and_changes_the_routing(runs):
    """The reference's curve is not that of the same model whose bias stays at 0 (a bias that moved from step 1 on;
    the sign updates may oscillate back to 0 by the last step, so the end values alone cannot tell)."""
    reference, fixed = train_records(runs["reference"], "loss"), train_records(runs["no_bias_update"], "loss")
    assert reference[0] == fixed[0] and not torch.equal(reference, fixed), (reference, fixed)


def saved_model_tensors(step_dir) -> dict:
    """The model's entries of a step folder's DCP metadata: name -> global shape."""
    metadata = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    return {k: tuple(v.size) for k, v in metadata.items() if k.startswith("model.") and hasattr(v, "size")}


def test_an_ep4_step_folder_resumes_at_ep2_and_on_one_process(runs):
    """The names and global shapes EP 4 wrote are one process's; both resumes continue the uninterrupted curve
    (steps 6-10) and end on its weights."""
    saved = saved_model_tensors(runs["ep4_step5"])
    assert saved and saved == saved_model_tensors(runs["reference_step5"])
    assert saved["model.blocks.0.mlp.experts.gate_up_proj"][0] == EXPERTS
    reference = runs["reference"]
    for name in ("ep2_from_ep4", "single_from_ep4"):
        resumed = runs[name]
        steps = [r["step"] for r in resumed["history"] if r["split"] == "train"]
        assert steps == [6, 7, 8, 9, 10], steps
        torch.testing.assert_close(
            train_records(resumed, "loss"), train_records(reference, "loss")[5:], rtol=1e-5, atol=0
        )
        for key, value in reference["params"].items():
            torch.testing.assert_close(
                resumed["params"][key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}"
            )
