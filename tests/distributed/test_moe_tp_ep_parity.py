"""Expert parallelism composed with tensor parallelism (CPU, gloo): TP 2 x EP 2 on 4 ranks (attention, embedding and
head split over the 'tp' pairs, sequence-parallel between blocks; each MoE block on its rank's slice of the sequence;
the experts split over 'ep' pairs borrowed from dp_shard, so FSDP has 2 data ranks and each expert group is 1 of them)
trains exactly like one process: 10 steps of tests/distributed/test_moe_ep_parity.py's tiny MoE (bias balancing
moved from the load summed over the ranks, z-loss on), losses, gradient norms and final weights; its step-5 folder
resumes on one process continuing the curve. Under -m slow (a spawn of its own), a Qwen2-MoE folder (a gated shared
expert) and a Qwen3-MoE folder (q/k norms) made by transformers, loaded at TP 2 x EP 2 with the auxiliary balancing
loss on: the logits and loss are transformers', and the first step's loss and aux_loss are the mean of transformers'
on each data rank's part of the batch; each tensor-parallel rank routes only half of a part's tokens, so these hold
only if the loads and probabilities are summed over the pair (shardlab_tasks/lm/models/moe.py). Also under -m slow: TP 2
alone (2 ranks, one data rank) with the auxiliary loss on trains as one process, aux_loss included."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_spawned
from tests.distributed.test_hf_pretrained import COMMON
from tests.distributed.test_moe_ep_parity import CKPT, MOE, inspect_experts, saved_model_tensors
from tests.distributed.test_moe_pretrained import inspect as inspect_load
from tests.distributed.test_tensor_parallel import assert_trains_as_one_process, single, train_records
from tests.hf_folders import make_folder, moe_reference

TP2_EP2 = [
    "distributed.backend=fully_sharded", "distributed.tensor_parallel_degree=2",
    "distributed.expert_parallel_degree=2",
]  # fmt: skip
FAMILIES = ("qwen2_moe", "qwen3_moe")


@pytest.fixture(scope="module")
def runs(tiny_lm, tmp_path_factory) -> dict:
    """The tiny MoE at TP 2 x EP 2 on 4 ranks (saving at step 5); on one process the reference and the resume of
    the TP 2 x EP 2 step 5."""
    run_dir = tmp_path_factory.mktemp("tp2_ep2")
    (result,) = run_spawned([tiny_lm(*MOE, *TP2_EP2, *CKPT)], 4, [run_dir], inspect=inspect_experts)
    step5 = run_dir / "checkpoints" / "step_00000005"
    return {
        "tp2_ep2": result,
        "step5": step5,
        "reference": single(tiny_lm(*MOE, *CKPT), tmp_path_factory.mktemp("single")),
        "single_from_tp2_ep2": single(tiny_lm(*MOE, f"checkpoint.resume={step5}"), tmp_path_factory.mktemp("s")),
    }


@pytest.fixture(scope="module")
def loaded(tiny_lm, tmp_path_factory) -> dict:
    """The two folders loaded at TP 2 x EP 2 on 4 ranks (one spawn), one step each; logits gathered whole
    (distributed.loss_parallel=false): inspect takes a loss outside the trainer's loss-parallel context."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("tp_ep_folders")
    folders = {family: make_folder(family, root / family, max_shard_size="20KB") for family in FAMILIES}
    common = [*TP2_EP2, "distributed.world_size=4", "distributed.loss_parallel=false", *COMMON, "data.seq_len=32"]
    cfgs = [tiny_lm(*common, f"model.pretrained={folder}") for folder in folders.values()]
    results = run_spawned(cfgs, 4, [root / f"run_{family}" for family in folders], inspect=inspect_load)
    return {family: (folder, result) for (family, folder), result in zip(folders.items(), results, strict=True)}


def test_tp2_x_ep2_trains_as_one_process_and_resumes_on_one(runs):
    """Each rank holds 2 of the 4 experts (split on 'ep' of the expert mesh, which keeps 'tp' innermost), the
    attention weights split on 'tp'; the curve, gradient norms and weights are one process's; the step-5 folder
    holds one process's names and shapes and continues the curve on one process."""
    result = runs["tp2_ep2"]
    assert result["experts"], "no expert weight was split"
    for axes, placements, rows in result["experts"].values():
        assert axes == ("dp_shard_mod_ep", "ep") and placements[-1] == "S(0)" and rows == 2, result["experts"]
    q_weight = result["placements"]["blocks.0.attn.q.weight"]  # FSDP over dp_shard, column-wise over tp
    assert len(q_weight) == 2 and q_weight[-1] == "S(0)", result["placements"]
    assert_trains_as_one_process(result, runs["reference"])
    reference = runs["reference"]
    assert saved_model_tensors(runs["step5"])["model.blocks.0.mlp.experts.gate_up_proj"][0] == 4
    resumed = runs["single_from_tp2_ep2"]
    assert [r["step"] for r in resumed["history"] if r["split"] == "train"] == [6, 7, 8, 9, 10]
    torch.testing.assert_close(train_records(resumed, "loss"), train_records(reference, "loss")[5:], rtol=1e-5, atol=0)
    for key, value in reference["params"].items():
        torch.testing.assert_close(
            resumed["params"][key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}"
        )


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_moe_folders_at_tp2_x_ep2_compute_transformers_loss_and_aux_loss(family, loaded):
    """The loaded model's logits, loss and auxiliary loss on a fixed batch are transformers'; the first step's loss
    and aux_loss the mean over the 2 data ranks of transformers' on each one's half of the batch."""
    folder, result = loaded[family]
    logits, cross_entropy, aux = moe_reference(folder, result["tokens"])
    torch.testing.assert_close(result["logits"], logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(result["aux"], aux, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(result["loss"], cross_entropy + aux, rtol=1e-5, atol=1e-6)
    parts = [moe_reference(folder, part) for part in result["first_batch"].chunk(2)]
    train = [r for r in result["history"] if r["split"] == "train"][0]
    assert train["aux_loss"] == pytest.approx(sum(p[2].item() for p in parts) / 2, rel=1e-5)
    assert train["loss"] == pytest.approx(sum(p[1].item() for p in parts) / 2, rel=1e-5)


@pytest.mark.slow
def test_tp2_alone_with_the_auxiliary_loss_trains_as_one_process(tiny_lm, tmp_path_factory):
    """TP 2 without expert parallelism on 2 ranks (one data rank: the same batches as one process), every expert on
    both ranks, the auxiliary balancing loss on: each rank routes half of every sequence, and the summed statistics
    give one process's auxiliary loss, curve and gradient norms."""
    aux = [*(o for o in MOE if not o.startswith("model.moe.aux_loss_coef")), "model.moe.aux_loss_coef=0.02"]
    tp2 = ["distributed.backend=fully_sharded", "distributed.tensor_parallel_degree=2"]
    (result,) = run_spawned([tiny_lm(*aux, *tp2)], 2, [tmp_path_factory.mktemp("tp2")], inspect=inspect_experts)
    reference = single(tiny_lm(*aux), tmp_path_factory.mktemp("single_aux"))
    assert_trains_as_one_process(result, reference)
    torch.testing.assert_close(
        train_records(result, "aux_loss"), train_records(reference, "aux_loss"), rtol=1e-5, atol=0
    )
