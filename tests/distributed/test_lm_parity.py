"""ddp and fully_sharded (every toggle) train exactly like one process on the same global batch (CPU, gloo)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from shardlab.distributed import env as dist_env
from shardlab.runner import run_rank
from tests.distributed.harness import run_spawned

LOSS_RTOL = 1e-5
REDUCE_DTYPES: list[str] = []
OVERLAPPED_REDUCES: list[int] = []


def record_reduce_dtypes() -> None:
    """Patch the collectives FSDP2 reduces gradients with, to see which dtype really reaches them: a reduce-scatter
    (native; whichever of torch's names for it this torch's FSDP2 calls) or all_reduce
    (distributed.reduce_scatter=all_reduce). All-reduces of fewer than 1024 elements are the trainer's scalars
    (clipping norm, found-inf, logged sums), not gradient buffers."""
    import torch.distributed as dist

    def recording(original, kind, name, position, min_numel):
        def collective(*args, **kwargs):
            tensor = kwargs[name] if name in kwargs else args[position]
            if tensor.numel() >= min_numel:
                REDUCE_DTYPES.append(f"{kind}:{tensor.dtype}")
                if kwargs.get("async_op"):  # overlapped with the next unit's backward
                    OVERLAPPED_REDUCES.append(tensor.numel())
            return original(*args, **kwargs)

        return collective

    # (output, input, ...) in every one of them: the input is argument 1, named "input".
    for op in ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base"):
        if hasattr(dist, op):
            setattr(dist, op, recording(getattr(dist, op), "reduce_scatter", "input", 1, 0))
    dist.all_reduce = recording(dist.all_reduce, "all_reduce", "tensor", 0, 1024)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def inspect(trainer) -> dict:
    """Full parameters, this rank's state bytes (params + grads + optimizer state, from the local shards)."""
    model = trainer.model
    unwrapped = getattr(model, "module", model)  # DDP wraps; FSDP2 does not
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    batch = trainer.task.collate([trainer.task.train_dataset[i] for i in range(2)])
    loss, _ = trainer.task.loss(model, batch, trainer.backend.device)
    loss.backward()  # grads exist again, so their bytes can be measured (the trainer frees them after each step)
    params = sum(_local(p).numel() * _local(p).element_size() for p in model.parameters())
    grads = sum(_local(p.grad).numel() * _local(p.grad).element_size() for p in model.parameters())
    optim = sum(
        _local(v).numel() * _local(v).element_size()
        for s in trainer.optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.ndim > 0
    )
    # One unit's worth of state: fp32 param + grad + two Adam moments of the largest block.
    largest_unit = max(
        (sum(p.numel() * 16 for p in u.parameters()) for u in trainer.task.fsdp_units(unwrapped)), default=0
    )
    model.zero_grad(set_to_none=True)
    from torch.distributed.fsdp import FSDPModule

    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]
    reduce_dtypes = sorted(set(REDUCE_DTYPES))
    overlapped = len(OVERLAPPED_REDUCES)
    REDUCE_DTYPES.clear()
    OVERLAPPED_REDUCES.clear()
    return {
        "params": full,
        "state_bytes": params + grads + optim,
        "unit_bytes": largest_unit,
        "reduce_dtypes": reduce_dtypes,
        "overlapped_reduces": overlapped,
        "reducing_units": sum(g is not None for g in groups),  # FSDP units holding parameters: one reduce each
    }


def losses(result: dict) -> torch.Tensor:
    return torch.tensor([r["loss"] for r in result["history"] if r["split"] == "train"], dtype=torch.float64)


def run_single(cfg, tmp_path) -> dict:
    return run_rank(cfg, tmp_path, dist_env.detect(), after_fit=inspect)


FSDP = "distributed.backend=fully_sharded"
# Grouped-query attention (2 key/value heads for 4 query heads), RoPE, untied embedding and head as their own units.
LLAMA = ["model=llama_tiny", "model.num_kv_heads=2", "model.ffn_dim=null"]
# torchtitan's selective op checkpointing: every other matmul output kept, the embedding and head units unwrapped.
TORCHTITAN_AC = [
    "distributed.activation_checkpointing=selective_op",
    "distributed.ac_matmul_save_every=2",
    "distributed.ac_skip_units=[0,-1]",
]
# The opt-in CPU path: gradients reduced as overlapped all-reduces, all-gathers prefetched asynchronously.
OVERLAP = [FSDP, "distributed.reduce_scatter=all_reduce", "distributed.prefetch_units=1"]
TWO_RANK_VARIANTS = {
    "ddp": ["distributed.backend=ddp"],
    "fsdp_native": [FSDP],
    "fsdp_reshard": OVERLAP,
    "fsdp_no_reshard": [*OVERLAP, "distributed.reshard_after_forward=false"],
    "fsdp_untied": [*OVERLAP, "model.tie_embeddings=false"],
    "fsdp_offload": [*OVERLAP, "distributed.cpu_offload=true"],
    "fsdp_offload_cpu_adam": [*OVERLAP, "distributed.cpu_offload=true", "optimizer=cpu_adam"],
    "fsdp_act_ckpt": [*OVERLAP, "distributed.activation_checkpointing=full"],
    "fsdp_offload_activations": [*OVERLAP, "distributed.offload_activations=true"],
    "fsdp_accum_every": [*OVERLAP, "optimization.update_freq=2"],
    "fsdp_accum_last": [*OVERLAP, "optimization.update_freq=2", "distributed.reduce_every_microbatch=false"],
    "ddp_accum_last": [
        "distributed.backend=ddp",
        "optimization.update_freq=2",
        "distributed.reduce_every_microbatch=false",
    ],
    "fsdp_bf16": [*OVERLAP, "distributed.precision=bf16"],
    "fsdp_fp16": [*OVERLAP, "distributed.precision=fp16"],
    "fsdp_bf16_reduce": [*OVERLAP, "distributed.precision=bf16", "distributed.reduce_dtype=bf16"],
    "fsdp_fp16_native": [FSDP, "distributed.precision=fp16"],
    "fsdp_fp16_reduce": [FSDP, "distributed.reduce_dtype=fp16"],  # fp32 params, fp16 reduce-scatter: scaled too
    "llama_fsdp_native": [FSDP, *LLAMA],
    "llama_fsdp_act_ckpt": [*OVERLAP, *LLAMA, "distributed.activation_checkpointing=full"],
    "fsdp_sel_layer_ckpt": [FSDP, "distributed.activation_checkpointing=selective_layer"],
    "fsdp_sel_op_ckpt": [FSDP, "distributed.activation_checkpointing=selective_op"],
    "ddp_sel_op_ckpt": ["distributed.backend=ddp", "distributed.activation_checkpointing=selective_op"],
    "llama_fsdp_sel_op_ckpt": [FSDP, *LLAMA, "distributed.activation_checkpointing=selective_op"],
    "llama_fsdp_torchtitan_ckpt": [FSDP, *LLAMA, *TORCHTITAN_AC],
    "llama_ddp_torchtitan_ckpt": ["distributed.backend=ddp", *LLAMA, *TORCHTITAN_AC],
}


@pytest.fixture(scope="module")
def two_rank_results(tiny_lm, tmp_path_factory):
    cfgs = [tiny_lm(*overrides) for overrides in TWO_RANK_VARIANTS.values()]
    results = run_spawned(cfgs, world_size=2, inspect=inspect, prepare=record_reduce_dtypes)
    return dict(zip(TWO_RANK_VARIANTS, results, strict=True))


@pytest.fixture(scope="module")
def single_results(tiny_lm, tmp_path_factory):
    return {
        "plain": run_single(tiny_lm(), tmp_path_factory.mktemp("single")),
        "untied": run_single(tiny_lm("model.tie_embeddings=false"), tmp_path_factory.mktemp("single_untied")),
        "accum": run_single(tiny_lm("optimization.update_freq=2"), tmp_path_factory.mktemp("single_accum")),
        "llama": run_single(tiny_lm(*LLAMA), tmp_path_factory.mktemp("single_llama")),
    }


def reference_for(name: str, single_results: dict) -> dict:
    if name.startswith("llama"):
        return single_results["llama"]
    if "untied" in name:
        return single_results["untied"]
    return single_results["accum"] if "accum" in name else single_results["plain"]


@pytest.mark.parametrize("name", [n for n in TWO_RANK_VARIANTS if "16" not in n])
def test_two_ranks_match_single_process_losses_and_params(name, two_rank_results, single_results):
    result, reference = two_rank_results[name], reference_for(name, single_results)
    assert len(losses(result)) == 10
    torch.testing.assert_close(losses(result), losses(reference), rtol=LOSS_RTOL, atol=0)
    # Parameters: rtol 1e-5, plus atol 1e-5 because some gradients are pure rounding noise (the key bias cannot change
    # attention, so its true gradient is 0) and Adam scales noise of any size up to ~lr-sized steps.
    assert result["params"].keys() == reference["params"].keys()
    for key, value in reference["params"].items():
        torch.testing.assert_close(result["params"][key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("name", ["fsdp_bf16", "fsdp_bf16_reduce", "fsdp_fp16", "fsdp_fp16_native", "fsdp_fp16_reduce"])
def test_low_precision_stays_finite_and_tracks_fp32(name, two_rank_results, single_results):
    low, fp32 = losses(two_rank_results[name]), losses(single_results["plain"])
    assert torch.isfinite(low).all()
    # bf16 keeps ~3 significant digits; over 10 steps the curves stay within 2% of each other.
    torch.testing.assert_close(low, fp32, rtol=0.02, atol=0)


def test_fp16_reduce_scatter_reaches_the_collective_in_fp16(two_rank_results):
    dtypes = {name: two_rank_results[name]["reduce_dtypes"] for name in two_rank_results}
    assert dtypes["fsdp_fp16"] == ["all_reduce:torch.float16"]  # the opt-in reduce-scatter as an all-reduce
    assert dtypes["fsdp_fp16_native"] == ["reduce_scatter:torch.float16"]
    assert dtypes["fsdp_fp16_reduce"] == ["reduce_scatter:torch.float16"]
    assert dtypes["fsdp_bf16"] == ["all_reduce:torch.float32"]  # bf16 compute, fp32 reduce
    assert dtypes["fsdp_bf16_reduce"] == ["all_reduce:torch.bfloat16"]
    assert dtypes["fsdp_reshard"] == ["all_reduce:torch.float32"]
    assert dtypes["fsdp_native"] == ["reduce_scatter:torch.float32"]


OVERLAPPING = [  # every fp32-reduce 1-D variant: each unit's reduce runs under the next unit's backward
    "fsdp_reshard",
    "fsdp_no_reshard",
    "fsdp_untied",
    "fsdp_offload",
    "fsdp_offload_cpu_adam",
    "fsdp_act_ckpt",
    "llama_fsdp_act_ckpt",  # its embedding and head are units too
    "fsdp_offload_activations",
    "fsdp_bf16",  # bf16 compute, fp32 reduce
    "fsdp_accum_last",  # one reduce per step, into empty gradients
    "fsdp_accum_every",  # update_freq=2: the first micro-batch overlaps; the second accumulates into it, so must not
]


@pytest.mark.parametrize("name", OVERLAPPING)
def test_gradient_reduces_overlap_backward_where_nothing_reads_them_early(name, two_rank_results):
    """On gloo each unit's reduce runs asynchronously under the next unit's backward (the parity tests above prove
    the gradients come out right): exactly once per unit per step, and never for the evaluation backward that
    inspect() runs outside the trainer's grad_sync."""
    result = two_rank_results[name]
    assert result["reducing_units"] >= 3
    assert result["overlapped_reduces"] == result["reducing_units"] * 10


@pytest.mark.parametrize("name", ["fsdp_fp16", "fsdp_bf16_reduce", "fsdp_native", "fsdp_fp16_native"])
def test_gradient_reduces_block_where_fsdp2_reads_them_at_once(name, two_rank_results):
    # fp16 post-divides at once, a bf16 reduce is cast to fp32 at once; the native reduce-scatter always blocks.
    assert two_rank_results[name]["overlapped_reduces"] == 0


@pytest.mark.parametrize("name", ["fsdp_fp16", "fsdp_fp16_reduce"])
def test_fp16_scales_the_loss_and_halves_the_scale_once_per_skipped_step(name, two_rank_results):
    """fp16 compute, or only an fp16 reduce of fp32 gradients, gets a loss scaler. It starts at 2**16 and, within
    its 2000-step growth interval, only halves - once per step skipped for an overflow - so the logged scale and the
    skipped-step count must agree at every step."""
    train = [r for r in two_rank_results[name]["history"] if r["split"] == "train"]
    assert len(train) == 10
    for r in train:
        assert r["loss_scale"] == 2.0**16 * 0.5 ** r["skipped_steps"], r


def test_fully_sharded_holds_a_world_size_fraction_of_ddp_state(two_rank_results):
    ddp = two_rank_results["ddp"]["state_bytes"]
    fsdp = two_rank_results["fsdp_reshard"]
    assert ddp > 0
    assert fsdp["state_bytes"] <= 1.05 * ddp / 2 + fsdp["unit_bytes"], (fsdp["state_bytes"], ddp, fsdp["unit_bytes"])
