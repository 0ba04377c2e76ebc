"""The private torch APIs shardlab uses (shardlab/distributed/torch_internals.py) still exist and behave as relied on.

A torch upgrade that moves one fails here, naming it, rather than silently in a run: then re-check the private path
(or drop it) and extend torch_internals.TESTED_TORCH and pyproject's torch range to the new release.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from shardlab.distributed import torch_internals


def test_installed_torch_is_in_the_tested_range():
    low, high = torch_internals.TESTED_TORCH
    assert torch_internals.tested(), (
        f"torch {torch.__version__} is outside shardlab's tested range {low}-{high}: the private paths fall back to "
        "the public ones. Run tests/unit/test_torch_internals.py's checks, then widen TESTED_TORCH and pyproject.toml"
    )


def test_fsdp2_reduce_scatter_interface_is_where_and_what_we_subclass():
    base = torch_internals.reduce_scatter_base()
    assert base is not None, "torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter moved"
    params = list(inspect.signature(base.__call__).parameters)
    assert params == ["self", "output_tensor", "input_tensor", "group", "op", "async_op"], params
    assert hasattr(base, "allocate"), "ReduceScatter.allocate is gone (FSDP2 allocates the comm's buffers with it)"
    from shardlab.distributed.gloo_comms import make_reduce_comm

    assert isinstance(make_reduce_comm(), base)


def test_fsdp2_unshard_async_flag_exists_on_fsdp_modules():
    from torch.distributed.fsdp import FSDPModule

    assert hasattr(FSDPModule, "_set_unshard_async_op"), "FSDPModule._set_unshard_async_op is gone"
    assert list(inspect.signature(FSDPModule._set_unshard_async_op).parameters) == ["self", "async_op"]


def test_graph_task_id_tells_backward_from_forward():
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(("forward", torch_internals.in_backward()))
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(("backward", torch_internals.in_backward()))
            return grad

    Probe.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert seen == [("forward", False), ("backward", True)]


def test_post_accumulate_grad_hooks_are_visible_on_the_tensor():
    param = nn.Parameter(torch.ones(2))
    assert torch_internals.has_post_accumulate_grad_hooks(param) is False
    param.register_post_accumulate_grad_hook(lambda p: None)
    assert torch_internals.has_post_accumulate_grad_hooks(param) is True


def one_rank_dtensor() -> torch.Tensor:
    """A DTensor sharded over a one-rank gloo group (the caller destroys the group)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return distribute_tensor(torch.arange(6.0).reshape(3, 2), init_device_mesh("cpu", (1,)), [Shard(0)])


def test_a_dtensors_private_local_tensor_is_its_public_local_shard():
    import torch.distributed as dist

    try:
        tensor = one_rank_dtensor()
        shard = torch_internals.local_shard(tensor)
        assert type(shard) is torch.Tensor and shard.data_ptr() == tensor.to_local().data_ptr()
        shard.add_(1)  # the optimizers update the parameter through it, in place
        assert torch.equal(tensor.full_tensor(), torch.arange(1.0, 7.0).reshape(3, 2))
        plain = torch.ones(2)
        assert torch_internals.local_shard(plain) is plain
    finally:
        dist.destroy_process_group()


def test_a_pipeline_schedule_keeps_the_last_stages_outputs_only_when_step_returns_them():
    """The memory plan's _Stage.step_output (shardlab.memory.axes): a schedule's step with return_outputs on (torch's
    default, as torchtitan's published runs called it) ends holding every micro-batch's output in output_chunks and
    returns their concatenation; called as shardlab's PipelineRunner calls it (return_outputs=False) it keeps none."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for returned in (True, False):
            stage = PipelineStage(nn.Linear(4, 6), 0, 1, torch.device("cpu"))
            schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=lambda out, target: (out - target).square().mean())
            losses: list[torch.Tensor] = []
            merged = schedule.step(arg_mbs=[(torch.randn(2, 4),) for _ in range(4)], target_mbs=[torch.zeros(2, 6)] * 4,
                                   losses=losses, return_outputs=returned)  # fmt: skip
            assert len(losses) == 4
            if returned:
                assert [o.shape for o in stage.output_chunks] == [(2, 6)] * 4 and merged.shape == (8, 6)
            else:
                assert stage.output_chunks == [] and merged is None
    finally:
        dist.destroy_process_group()


def test_async_tensor_parallels_switches_are_where_torchtitan_sets_them():
    """distributed.async_tensor_parallel sets inductor's micro-pipeline TP pass flag and enables symmetric memory for
    the tp group (CUDA only; here only that both names exist and the flag is a bool, off by default)."""
    switches = torch_internals.micro_pipeline_tp_switches()
    assert switches is not None, "torch moved _micro_pipeline_tp or enable_symm_mem_for_group: async TP would be off"
    inductor_config, enable = switches
    assert inductor_config._micro_pipeline_tp is False and callable(enable)


def test_context_parallels_private_names_are_where_torchtitan_takes_them():
    """set_rotate_method still sets the ring's rotation (distributed.context_parallel_rotate_method), and
    DeviceMesh._flatten still names the flattened dp_shard x cp mesh FSDP2 shards over (one fake rank)."""
    from torch.distributed.tensor.experimental._attention import _cp_options, _RotateMethod

    before = _cp_options.rotate_method
    try:
        assert torch_internals.set_context_parallel_rotate_method("alltoall") is True
        assert _cp_options.rotate_method == _RotateMethod.ALL_TO_ALL
        assert torch_internals.set_context_parallel_rotate_method("allgather") is True
        assert _cp_options.rotate_method == _RotateMethod.ALL_GATHER
    finally:
        _cp_options.rotate_method = before
    from shardlab.distributed.mesh import ParallelDims
    from shardlab.memory.verify import fake_process_group

    with fake_process_group(8, 5):
        mesh = ParallelDims(dp_shard=2, cp=2, tp=2).build("cpu")
        flat = torch_internals.flatten_mesh(mesh[("dp_shard", "cp")], "dp_shard_cp")
        assert flat is not None, "DeviceMesh._flatten moved: FSDP2 under context parallelism gets a mesh of its own"
        assert flat.mesh_dim_names == ("dp_shard_cp",) and flat.mesh.tolist() == [1, 3, 5, 7]


def test_outside_the_tested_range_every_private_path_falls_back(monkeypatch):
    monkeypatch.setattr(torch_internals, "TESTED_TORCH", ((1, 0), (1, 0)))
    torch_internals.reduce_scatter_base.cache_clear()
    try:
        assert torch_internals.reduce_scatter_base() is None
        assert torch_internals.in_backward() is None
        assert torch_internals.has_post_accumulate_grad_hooks(nn.Parameter(torch.ones(1))) is None
        assert torch_internals.set_unshard_async_op(nn.Linear(1, 1)) is False
        assert torch_internals.micro_pipeline_tp_switches() is None
        assert torch_internals.set_context_parallel_rotate_method("alltoall") is False
        assert torch_internals.flatten_mesh(object(), "dp_shard_cp") is None
        import torch.distributed as dist

        try:
            tensor = one_rank_dtensor()
            assert torch.equal(torch_internals.local_shard(tensor), tensor.to_local())  # through the public to_local
        finally:
            dist.destroy_process_group()
    finally:
        torch_internals.reduce_scatter_base.cache_clear()


def test_fsdp_mem_tracker_counts_shards_grads_and_moments_under_fake_tensors():
    """distributed.verify_plan's second check (shardlab.memory.verify.tracked_state): torch's FSDPMemTracker, over one
    step on fake storage and the fake process group, counts a sharded layer's parameter storage, the gradients FSDP2
    reduce-scatters into it and AdamW's two moments (its step counters left out). Linear(10, 37) over 8 ranks: 5 rows
    (and 5 bias entries) per rank. On the last rank, whose 2 rows are padded to 5, the tracker files the padded storage
    under activations once forward has run (a view of it is made there), which is why verify_plan asks it of rank 0
    only: the day torch changes that, this test says so and the last rank can be checked too."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardlab.memory.verify import fake_process_group, tracked_state

    assert torch_internals.fsdp_mem_tracker() is not None, (
        "torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker moved, or _FSDPRefType no longer names "
        f"{torch_internals.TRACKED_KINDS}: re-check shardlab.memory.verify.tracked_state"
    )
    init = list(inspect.signature(torch_internals.fsdp_mem_tracker().__init__).parameters)
    assert init == ["self", "mod", "optm"], init

    class Task:
        def example_batch(self, n):
            return torch.zeros(n, 10, device="meta")

        def loss(self, model, batch, device):
            return model(batch).sum(), {}

    counted = {}
    for rank in (0, 7):
        with fake_process_group(8, rank):
            mesh = init_device_mesh("cpu", (8,))
            with torch.device("meta"):
                layer = nn.Linear(10, 37)
            fully_shard(layer, mesh=mesh)
            counted[rank] = tracked_state(Task(), layer, optimizer_state_bytes=8, expert_degree=1)
    assert counted[0] == {"params": 55 * 4, "grads": 55 * 4, "optimizer": 2 * 55 * 4}, counted
    assert counted[7] == {"params": 0, "grads": 55 * 4, "optimizer": 2 * 22 * 4}, counted


def test_a_rowwise_parallel_embeddings_gradient_is_the_whole_vocabulary_on_each_rank():
    """The memory plan counts this (shardlab.memory.axes._embedding_gradient_whole): DTensor has no
    vocabulary-sharded strategy for the embedding's backward, so a RowwiseParallel embedding whose output goes on
    split by sequence computes the gradient of the whole table on each tensor-parallel rank (here: 64 rows, not its
    32). When this fails, torch computes a rank's rows only: drop that term from the plan."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
    from torch.utils._python_dispatch import TorchDispatchMode

    from shardlab.memory.verify import fake_process_group

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.backward = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.embedding_dense_backward.default:
                self.backward.append(tuple(out.shape))
            return out

    with fake_process_group(2, 0):
        style = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
        embedding = parallelize_module(nn.Embedding(64, 8), DeviceMesh("cpu", [0, 1]), style)
        assert embedding.weight.to_local().shape == (32, 8)
        out = embedding(torch.zeros(1, 4, dtype=torch.long))
        with Shapes() as seen:
            out.sum().backward()
    assert seen.backward == [(64, 8)], seen.backward
    assert embedding.weight.grad.to_local().shape == (64, 8)
