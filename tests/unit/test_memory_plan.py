"""The memory plan's arithmetic and its use before launch: backend=auto, memory_budget_gb, the peak meter.

What it predicts against what runs really use is tests/distributed/test_memory_plan.py and shardlab_bench/max_model.py.
"""

from __future__ import annotations

import re

import pytest
import torch

import shardlab.registry
from shardlab.distributed.units import model_on_meta
from shardlab.errors import ConfigError
from shardlab.memory import budget as memory_budget
from shardlab.memory.console import describe
from shardlab.memory.devices import GiB
from shardlab.memory.estimate import estimate
from shardlab.memory.layout import Layout, layout_of
from shardlab.memory.meter import PeakMeter, memory_gib, process_peak
from shardlab.memory.plan import profile_config
from shardlab.registry import OPTIMIZERS
from shardlab.runner import build_task
from tests.conftest import compose_config

GPT_125M = ["model=gpt_125m", "data.seq_len=512", "optimization.batch_size=32"]


def planned(overrides: list[str], world: int):
    cfg = compose_config(overrides)
    task = build_task(cfg, world_size=world)
    return cfg, profile_config(cfg, task, world, model_on_meta(task))


def test_state_is_sixteen_bytes_per_parameter_divided_by_the_shard_group_and_ddp_adds_its_buckets():
    _, (profile, ctx) = planned([*GPT_125M, "distributed=fully_sharded"], 4)
    P = profile.params
    ddp = estimate(profile, Layout("ddp"), ctx)
    full = estimate(profile, Layout("fully_sharded", 4), ctx)
    assert ddp.params + ddp.optimizer + ddp.grads == 16 * P  # fp32 param, grad and two Adam moments
    assert ddp.grad_buffers == 4 * P  # the bucket copy of the gradients, kept between steps
    assert full.params + full.optimizer + full.grads == pytest.approx(16 * P / 4, abs=64)
    assert full.between_steps < ddp.between_steps / 4


def test_gathered_units_follow_reshard_and_prefetch():
    _, (profile, ctx) = planned([*GPT_125M, "distributed=fully_sharded"], 4)
    reshard = estimate(profile, Layout("fully_sharded", 4), ctx)
    keep = estimate(profile, Layout("fully_sharded", 4, reshard_after_forward=False), ctx)
    unit = max(profile.unit_params)
    # Resharding holds a few units in flight; not resharding holds every unit from forward to backward.
    assert reshard.gathered == 4 * (profile.root_params + 4 * unit)
    assert keep.gathered == 4 * (profile.root_params + sum(profile.unit_params) + 3 * unit)
    cfg = compose_config([*GPT_125M, "distributed=fully_sharded", "distributed.prefetch_units=3"])
    task = build_task(cfg, world_size=4)
    _, deeper = profile_config(cfg, task, 4, model_on_meta(task))
    assert estimate(profile, Layout("fully_sharded", 4), deeper).gathered == reshard.gathered + 2 * 4 * unit


def test_activations_scale_with_the_batch_linearly_in_sequence_length_and_halve_in_bf16():
    base = [*GPT_125M, "distributed=fully_sharded"]
    _, (p32, _) = planned(base, 4)
    _, (p32x2, _) = planned([*GPT_125M[:-1], "optimization.batch_size=64", "distributed=fully_sharded"], 4)
    _, (long, _) = planned(["model=gpt_125m", "data.seq_len=1024", "optimization.batch_size=32"], 4)
    _, (p16, _) = planned([*base, "distributed.precision=bf16"], 4)
    assert p32x2.activations == pytest.approx(2 * p32.activations, rel=1e-3)
    # A fused attention keeps no (length x length) matrix: twice the tokens per sample, twice the bytes.
    assert sum(long.unit_activations) == pytest.approx(2 * sum(p32.unit_activations), rel=0.01)
    assert sum(p16.unit_activations) == pytest.approx(sum(p32.unit_activations) / 2, rel=0.05)
    assert p32.unit_activations[0] > 10 * p32.unit_inputs[0]  # a block keeps far more than its input
    # the model's output, the fp32 logits (what a pipeline's last stage keeps per micro-batch): batch x seq x vocab
    assert p32.output == 4 * (32 // 4) * 512 * compose_config(base).model.vocab_size
    assert p16.output == p32.output // 2


def test_activation_checkpointing_keeps_unit_inputs_and_one_recomputed_unit():
    _, (profile, ctx) = planned([*GPT_125M, "distributed=fully_sharded"], 4)
    plain = estimate(profile, Layout("fully_sharded", 4), ctx)
    ckpt = estimate(profile, Layout("fully_sharded", 4, activation_checkpointing=True), ctx)
    outside = profile.activations - sum(profile.unit_activations)
    kept = outside + sum(profile.unit_inputs) + max(profile.unit_activations)
    assert ckpt.activations - plain.activations == kept - profile.activations
    assert ckpt.peak < plain.peak


def test_cpu_offload_moves_state_to_the_host_on_cuda_only():
    _, (profile, ctx) = planned([*GPT_125M, "distributed=fully_sharded"], 4)
    offload = Layout("fully_sharded", 4, cpu_offload=True)
    on_cpu = estimate(profile, offload, ctx)
    cuda_ctx = type(ctx)(**{**ctx.__dict__, "device": "cuda"})
    on_cuda = estimate(profile, offload, cuda_ctx)
    assert on_cpu.host == 0 and on_cpu.params > 0  # one memory: nothing leaves it
    assert on_cuda.params == on_cuda.optimizer == on_cuda.grads == 0
    assert on_cuda.host == on_cpu.params + on_cpu.optimizer + on_cpu.grads
    assert on_cuda.runtime == 0  # CUDA: the allocator's peak, which the CUDA context and kernels stay out of


def test_plan_warns_of_accumulation_without_sync_and_of_an_unsplit_model():
    overrides = [*GPT_125M, "distributed=fully_sharded", "optimization.update_freq=4"]
    _, (profile, ctx) = planned([*overrides, "distributed.reduce_every_microbatch=false"], 4)
    lines = describe(profile, Layout("fully_sharded", 4), ctx, compare=False)
    assert any("reduce_every_microbatch=false keeps unsharded gradients" in line for line in lines)
    synced = estimate(profile, Layout("fully_sharded", 4), ctx)
    _, (_, ctx_sync) = planned(overrides, 4)
    assert synced.gathered - estimate(profile, Layout("fully_sharded", 4), ctx_sync).gathered == 4 * (
        profile.params - -(-profile.params // 4)
    )
    _, (vision, vctx) = planned(["task=image_classification", "distributed=fully_sharded"], 2)
    whole = type(vision)(**{**vision.__dict__, "unit_params": [vision.params - 10]})
    lines = describe(whole, Layout("fully_sharded", 2), vctx, compare=False)
    assert any("one FSDP unit holds 100% of the parameters" in line for line in lines)


@pytest.fixture
def own_optimizers(monkeypatch):
    """OPTIMIZERS as it is, with what a test registers forgotten afterwards."""
    for table in ("_factories", "_origins", "_state_tensors"):
        monkeypatch.setattr(OPTIMIZERS, table, dict(getattr(OPTIMIZERS, table)))
    return OPTIMIZERS


def test_a_registered_optimizer_is_planned_with_the_state_tensors_its_registration_declares(own_optimizers):
    own_optimizers.register("three_moments", state_tensors=3)(lambda model, cfg: None)
    own_optimizers.register("momentum_twice", state_tensors=lambda cfg: 2 * (cfg.momentum > 0))(lambda m, c: None)
    own_optimizers.register("undeclared")(lambda model, cfg: None)
    _, (profile, adam) = planned([*GPT_125M, "distributed=fully_sharded"], 4)
    _, (_, three) = planned([*GPT_125M, "distributed=fully_sharded", "optimizer.name=three_moments"], 4)
    T = profile.trainable_params
    assert (adam.optimizer_state_bytes, three.optimizer_state_bytes) == (8, 12)
    assert estimate(profile, Layout("ddp"), three).optimizer == 3 * 4 * T  # not Adam's 2 * 4 * T
    assert estimate(profile, Layout("fully_sharded", 4), three).optimizer == pytest.approx(3 * 4 * T / 4, abs=64)
    assert not any("declares no state" in line for line in describe(profile, Layout("ddp"), three, compare=False))
    for momentum, expected in (("0.9", 8), ("0.0", 0)):  # a function of the optimizer's config
        _, (_, ctx) = planned([*GPT_125M, "optimizer.name=momentum_twice", f"optimizer.momentum={momentum}"], 4)
        assert ctx.optimizer_state_bytes == expected
    _, (_, guessed) = planned([*GPT_125M, "optimizer.name=undeclared"], 4)
    assert guessed.optimizer_state_bytes == 8  # planned as Adam, and the plan says so
    assert any(
        line.startswith("warning: optimizer 'undeclared' declares no state per parameter")
        for line in describe(profile, Layout("ddp"), guessed, compare=False)
    )


@pytest.mark.parametrize(
    "registry, declared, message",
    [
        ("OPTIMIZERS", -1, r"^optimizer 'bad' \(.*\): state_tensors=-1 must be a count of tensors"),
        ("OPTIMIZERS", True, r"^optimizer 'bad' \(.*\): state_tensors=True must be a count of tensors"),
        ("MODELS", 2, r"^model architecture 'bad' \(.*\): state_tensors= is an optimizer's state; drop it"),
    ],
)
def test_a_wrong_state_declaration_is_refused_where_it_is_registered(own_optimizers, registry, declared, message):
    with pytest.raises(ConfigError, match=message):
        getattr(shardlab.registry, registry).register("bad", state_tensors=declared)(lambda model, cfg: None)
    assert "bad" not in shardlab.registry.OPTIMIZERS.names() + shardlab.registry.MODELS.names()


# auto_tune=false: the fixed preference, decided when the task is built (tests/distributed/test_autotune.py measures).
def test_auto_picks_ddp_when_it_fits_and_sharding_when_it_does_not(capsys):
    overrides = [*GPT_125M, "distributed.backend=auto", "distributed.auto_tune=false", "distributed.world_size=4"]
    cfg = compose_config([*overrides, "distributed.memory_budget_gb=40"])
    build_task(cfg, world_size=4)
    assert cfg.distributed.backend == "ddp"
    assert "distributed.backend=auto chose ddp: fits in 40 GiB per rank" in capsys.readouterr().out

    _, (profile, ctx) = planned([*GPT_125M, "distributed=ddp"], 4)
    ddp_needs = memory_budget.needed(estimate(profile, Layout("ddp"), ctx)) / GiB
    cfg = compose_config([*overrides, f"distributed.memory_budget_gb={ddp_needs - 0.2:.2f}"])
    build_task(cfg, world_size=4)
    out = capsys.readouterr().out
    assert cfg.distributed.backend == "fully_sharded", out
    assert re.search(r"\(ddp needs [\d.]+ GiB per rank\)", out)
    chosen = estimate(profile, layout_of(cfg.distributed, 4), ctx)
    assert memory_budget.needed(chosen) <= cfg.distributed.memory_budget_gb * GiB


def test_auto_offload_switches_adamw_to_cpu_adam_and_a_budget_per_machine_divides_by_its_ranks():
    cfg, (profile, ctx) = planned([*GPT_125M, "distributed=fully_sharded"], 4)
    layouts = memory_budget.auto_candidates(4, 4, sharded_only=False)
    offload = next(layout for layout in layouts if layout.cpu_offload and not layout.activation_checkpointing)
    memory_budget.apply_choice(cfg, memory_budget.Choice(offload, estimate(profile, offload, ctx), ""), 4)
    assert cfg.distributed.cpu_offload is True and cfg.optimizer.name == "cpu_adam"
    machine = compose_config(["distributed.memory_budget_gb=16", "distributed.memory_budget_per=machine"])
    assert memory_budget.budget_per_rank(machine.distributed, ranks_per_node=4) == 4 * GiB


def test_a_budget_nothing_fits_names_the_smallest_that_would():
    overrides = [*GPT_125M, "distributed.backend=auto", "distributed.auto_tune=false", "distributed.world_size=4"]
    with pytest.raises(ConfigError) as error:
        build_task(compose_config([*overrides, "distributed.memory_budget_gb=0.5"]), world_size=4)
    message = str(error.value)
    assert "\n" not in message
    match = re.search(r"fits no layout at world size 4: the smallest \((.+)\) needs ([\d.]+) GiB per rank", message)
    assert match, message
    # That budget (rounded up) is enough: auto then picks that layout.
    cfg = compose_config([*overrides, f"distributed.memory_budget_gb={match[2]}"])
    build_task(cfg, world_size=4)
    assert cfg.distributed.activation_checkpointing == "full"


def test_an_explicit_backend_over_its_budget_is_refused_before_launch():
    with pytest.raises(ConfigError, match=r"memory_budget_gb=2 \(per rank\): the memory plan predicts [\d.]+ GiB"):
        build_task(compose_config([*GPT_125M, "distributed=ddp", "distributed.memory_budget_gb=2"]), world_size=4)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["distributed.backend=auto"], "distributed.backend=auto chooses a layout to fit distributed.memory_budget_gb"),
        (
            ["distributed.backend=auto", "distributed.memory_budget_gb=8", "distributed.cpu_offload=true"],
            "distributed.cpu_offload is what distributed.backend=auto chooses",
        ),
        (["distributed.memory_budget_per=node"], "memory_budget_per must be one of rank, machine, got 'node'"),
    ],
)
def test_budget_keys_are_checked(overrides, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        build_task(compose_config(overrides), world_size=1)


@pytest.mark.skipif(not PeakMeter(torch.device("cpu")).resettable, reason="needs Linux's /proc/self/clear_refs")
def test_peak_meter_sees_a_step_allocation_and_forgets_it_after_reset():
    meter = PeakMeter(torch.device("cpu"))
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    meter.sample()
    del block
    assert meter.peak_above_baseline >= 60 * 2**20
    first = meter.peak
    meter.reset()
    assert meter.current_peak() < first - 32 * 2**20  # freed (mmap-served) and the high-water mark was reset
    # What reads the process's peak (the logged mem_gib, the benchmarks) still sees the block the reset forgot.
    # (Linux batches its per-thread resident counters: readings of one peak can differ by a few pages.)
    assert process_peak(torch.device("cpu")) > first - 2**20
    assert memory_gib(torch.device("cpu")) * 2**30 > meter.current_peak() + 32 * 2**20


def test_a_model_that_cannot_run_on_meta_is_planned_without_activations_and_keeps_its_dtypes():
    from torch import nn

    from shardlab.memory.console import describe
    from shardlab.memory.profile import profile_model

    class NoMetaTask:
        def example_batch(self, batch_size):
            return torch.zeros(batch_size, 4, device="meta")

        def loss(self, model, batch, device):
            raise RuntimeError("this op has no meta kernel")

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    profile = profile_model(model, [model[0]], NoMetaTask(), 2, torch.bfloat16)
    assert profile.activations is None and profile.params == 4 * 8 + 8 + 8 * 2 + 2
    assert all(p.dtype == torch.float32 for p in model.parameters())  # cast for the count, then put back
    _, (_, ctx) = planned([*GPT_125M, "distributed=fully_sharded"], 4)
    lines = describe(profile, Layout("fully_sharded", 4), ctx, compare=False)
    assert (
        "activations not planned: the model's forward fails on meta (RuntimeError: this op has no meta kernel)"
        in (lines[1])
    )


# ---- autocast (single, ddp in bf16/fp16): what a real forward under torch.autocast keeps, measured ----------------
def measured_autocast_forward(task, cfg, local_batch: int) -> tuple[int, int]:
    """(bytes a real bf16 CPU autocast forward keeps at its end: what autograd saved plus autocast's cached weight
    copies, each storage once; of those, the weight copies). Copies are seen as they are made: the casts of
    parameters that reach the dispatcher under autocast."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from shardlab.distributed.materialize import materialize
    from shardlab.distributed.units import meta_model

    model = meta_model(task.build_model)
    materialize(model, torch.device("cpu"), task.init_tensor, cfg.seed)
    params = {p.data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}  # storage pointer -> bytes
    copies: dict[int, int] = {}

    class Casts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in params:
                copies[out.untyped_storage().data_ptr()] = out.untyped_storage().nbytes()
            return out

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    batch = task.collate([task.train_dataset[i] for i in range(local_batch)])
    model.train()
    with Casts(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            task.loss(model, batch, torch.device("cpu"))
    return sum({**kept, **copies}.values()), sum(copies.values())


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.num_layers=2", "model.dim=128", "model.num_heads=4", "data.seq_len=32", "data.max_corpus_mb=1"],
        ["task=image_classification", "model.depth=3", "data.image_size=16", "data.num_train=64", "data.num_valid=64"],
    ],
    ids=["lm", "vision"],
)
def test_autocast_plan_counts_the_weight_copies_and_activations_a_real_autocast_forward_keeps(overrides, corpus_cache):
    lm = [f"data.cache_dir={corpus_cache}"] if "task=image_classification" not in overrides else []
    cfg = compose_config([*overrides, *lm, "distributed.precision=bf16", "optimization.batch_size=8",
                          "validation.batch_size=8"])  # fmt: skip
    task = build_task(cfg, world_size=1)
    task.prepare_data()
    profile, ctx = profile_config(cfg, task, 1, model_on_meta(task))
    kept, copies = measured_autocast_forward(task, cfg, 8)
    planned_autocast = profile.autocast
    assert copies > 0 and planned_autocast.autocast_copies == copies  # one low-precision copy per cast weight
    assert planned_autocast.activations == pytest.approx(kept, rel=0.05)
    # The plan of a single (autocast) run holds them; the same model sharded (FSDP's own casts) has no copies.
    assert estimate(profile, Layout("single"), ctx).activations >= kept
    assert profile.activations < planned_autocast.activations


# ---- planning for a named device (distributed.plan_device) ---------------------------------------------------------
LLAMA_8B_H100 = [
    "model=llama3_8b", "distributed=fully_sharded", "distributed.plan_device=h100_80gb", "data.seq_len=1024",
    "optimization.batch_size=8", "validation.batch_size=8", "distributed.precision=bf16",
]  # fmt: skip


def test_a_named_gpu_is_planned_from_this_cpu_with_its_allocator_context_nccl_and_offload_to_the_host():
    from shardlab.memory import devices

    _, (profile, ctx) = planned(LLAMA_8B_H100, 8)
    assert (ctx.device, ctx.target, ctx.capacity, ctx.local) == ("cuda", "h100_80gb", 81559 * 2**20, False)
    assert profile.params == 8_030_261_248  # Llama 3 8B's published size
    full = estimate(profile, Layout("fully_sharded", 8), ctx)
    offload = estimate(profile, Layout("fully_sharded", 8, cpu_offload=True), ctx)
    assert full.outside == devices.CUDA_CONTEXT + 2 * devices.NCCL_PER_COMMUNICATOR  # default group + shard group
    assert full.allocator >= devices.FRAGMENTATION * full.peak  # rounding plus the fragmentation allowance
    assert full.device_peak == full.peak + full.allocator + full.outside
    assert offload.params == offload.grads == offload.optimizer == 0
    assert offload.host == full.params + full.grads + full.optimizer > 0
    lines = describe(profile, Layout("fully_sharded", 8), ctx, compare=True)
    assert any("on h100_80gb:" in line and "of 79.65" in line for line in lines)
    assert any("flash SDPA on h100_80gb" in line for line in lines)


def test_fsdp2_row_shards_are_padded_to_the_first_and_the_last_ranks_hold_less():
    from shardlab.memory.layout import shard_numel, shard_rows

    assert [shard_rows(37, 8, r) for r in range(8)] == [5, 5, 5, 5, 5, 5, 5, 2]
    assert shard_rows(37, 8) == 5  # every rank allocates the padded shard
    assert [shard_rows(3, 8, r) for r in range(8)] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert shard_numel([(37, 10), (3, 2)], 8) == 5 * 10 + 1 * 2


def test_an_unknown_plan_device_is_refused_in_one_line_naming_the_key_and_the_known_devices():
    cfg = compose_config([*LLAMA_8B_H100[:2], "distributed.plan_device=h100"])
    with pytest.raises(ConfigError) as e:
        build_task(cfg, world_size=8)
    message = str(e.value)
    assert "distributed.plan_device: 'h100' is not a known plan device" in message and "\n" not in message
    assert "h100_80gb" in message and "mi300x" in message and "Did you mean 'h100_80gb'?" in message


def test_auto_for_another_machines_gpu_chooses_by_the_plan_alone_and_says_so(capsys):
    overrides = [o for o in LLAMA_8B_H100 if o != "distributed=fully_sharded"]
    cfg = compose_config([*overrides, "distributed.backend=auto", "distributed.memory_budget_gb=80"])
    build_task(cfg, world_size=8)
    out = capsys.readouterr().out
    assert "by the plan alone" in out and "no trial can run on a h100_80gb" in out
    assert cfg.distributed.backend == "fully_sharded"


def test_verify_plan_private_torch_names_still_behave():
    """shardlab.memory.verify's private torch names: fails loudly, naming what moved, when a torch upgrade changes
    one (the fake backend, FSDP2's parameter groups and their padded shard storage)."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardlab.distributed import torch_internals
    from shardlab.memory.verify import fake_process_group

    if not torch_internals.tested():
        pytest.skip(f"torch {torch.__version__} is outside TESTED_TORCH: verify_plan refuses to run on it")
    with fake_process_group(8, 7):
        mesh = init_device_mesh("cpu", (8,))
        with torch.device("meta"):
            layer = nn.Linear(10, 37)
        fully_shard(layer, mesh=mesh)
        group = layer._get_fsdp_state()._fsdp_param_group
        assert group is not None, "FSDPModule._get_fsdp_state()._fsdp_param_group moved"
        weight = next(fp for fp in group.fsdp_params if fp.sharded_param.dim() == 2)
        assert weight._sharded_param_data.numel() == 5 * 10, "FSDPParam._sharded_param_data is not the padded shard"
        assert weight.sharded_param.to_local().shape == (2, 10)  # rank 7 of 8: rows 35-36 of 37
        assert weight.sharded_param.is_meta  # nothing allocated
        assert group.mesh_info.shard_mesh_size == 8 and group.post_forward_mesh_info is not None
        assert group.mp_policy.param_dtype is None
