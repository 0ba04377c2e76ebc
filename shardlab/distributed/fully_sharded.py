"""fully_sharded: PyTorch's FSDP2 (`fully_shard`) over the task's unit plan, with every knob as a config field.

Order (nanochat/torchtitan): the model is built on meta, each unit is sharded (after activation-checkpoint wrapping),
the root last, then weights are materialized shard by shard (shardlab.distributed.materialize): no rank ever holds
the full model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from shardlab.distributed import torch_internals
from shardlab.distributed.activation_checkpointing import checkpoint_units
from shardlab.distributed.base import Backend
from shardlab.distributed.expert_parallel import expert_fsdp_mesh, expert_shard_placement, split_experts
from shardlab.distributed.gloo_comms import AllReduceReduceScatter, make_reduce_comm
from shardlab.distributed.grad_scaler import ShardedGradScaler
from shardlab.distributed.units import generic_units
from shardlab.registry import BACKENDS


@BACKENDS.register("fully_sharded")
class FullyShardedBackend(Backend):
    name = "fully_sharded"
    casts_in_forward = False

    def setup(self, prepare_data: Callable[[], str] | None = None) -> None:
        """Join the process group, then build the one mesh (self.mesh, from self.dims): FSDP2 shards over its
        'dp_shard' axis (kept at size 1 under tensor parallelism, so TP and FSDP share one root mesh, as FSDP2 + TP
        requires) and replicates over 'dp_replicate' (hybrid); tensor parallelism runs over 'tp'."""
        super().setup(prepare_data)
        self.mesh = self.dims.build(self.device.type, keep=("dp_shard",))
        self.sharding_degree = self.dims.dp_shard

    def fsdp_mesh(self) -> DeviceMesh:
        """The data axes of the mesh, which FSDP2 shards over ('dp_shard') and replicates across ('dp_replicate',
        HSDP), or, with context parallelism, over 'dp_shard' x 'cp' flattened (shardlab.distributed.context_parallel).
        A mesh made elsewhere without 'dp_shard' (memory.verify's) is all data axes."""
        names = self.mesh.mesh_dim_names or ()
        if "cp" in names:
            if getattr(self, "_context_data_mesh", None) is None:  # flattened once: torch keeps the name it gets
                from shardlab.distributed.context_parallel import data_mesh_with_context

                self._context_data_mesh = data_mesh_with_context(self.mesh, self.device.type)
            return self._context_data_mesh
        if "dp_shard" not in names:
            return self.mesh
        data = tuple(name for name in ("dp_replicate", "dp_shard") if name in names)
        return self.mesh if names == data else self.mesh[data]

    def process_groups(self) -> list:
        return [None, *(self.mesh.get_group(dim) for dim in range(self.mesh.ndim))]

    @property
    def reduce_scatter_via_all_reduce(self) -> bool:
        """distributed.reduce_scatter=all_reduce, on CPU (validate refuses it where CUDA devices exist)."""
        return self.cfg.reduce_scatter == "all_reduce" and self.device.type == "cpu"

    @property
    def param_device(self) -> torch.device:
        return torch.device("cpu") if self.cfg.cpu_offload else self.device

    def parallelize(
        self,
        model: nn.Module,
        units: list[nn.Module],
        materialize: Callable[[nn.Module], None],
        full_precision_modules: Sequence[nn.Module] = (),
        tensor_parallel_plan: dict | None = None,
        expert_modules: Sequence[nn.Module] = (),
        recomputed: Sequence[int] | None = None,
    ) -> nn.Module:
        """Tensor parallelism (the task's plan over mesh["tp"]), expert parallelism (``expert_modules``, given when
        distributed.expert_parallel_degree > 1), activation checkpointing and compile, then FSDP2 over the data
        axes (experts first), then the weights materialized into the shards (torchtitan's order)."""
        if tensor_parallel_plan is not None:
            self.apply_tensor_parallel(model, tensor_parallel_plan)
        expert_mesh = self.dims.expert_mesh(self.device.type) if expert_modules else None
        if expert_mesh is not None:  # the experts split by rows over 'ep' (shardlab/distributed/expert_parallel.py)
            split_experts(expert_modules, expert_mesh["ep"])
        units = units or generic_units(model, self.cfg.wrap_min_num_params)
        units = checkpoint_units(model, units, self.cfg, recomputed)
        self.units = units
        self.compile_units(units or [model])
        self.reduce_comm: AllReduceReduceScatter | None = None
        self.unshard_async = False
        if self.stages_unsharded:  # a pipeline stage alone on its data axis, in fp32: FSDP2 would only copy
            materialize(model)
            return model
        kwargs = self.shard_kwargs()
        if self.param_dtype != torch.float32 or self.reduce_dtype != torch.float32:
            fp32 = {**kwargs, "mp_policy": MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)}
            for module in full_precision_modules:  # each its own fp32 unit (Task.full_precision_modules)
                fully_shard(module, reshard_after_forward=self.cfg.reshard_after_forward, **fp32)
        self.shard_experts(expert_modules, expert_mesh, kwargs)  # before the blocks that hold them
        for i, unit in enumerate(units):
            # The last unit's params are needed again at once by backward: resharding them would only re-gather.
            reshard = self.cfg.reshard_after_forward and i < len(units) - 1
            fully_shard(unit, reshard_after_forward=reshard, **kwargs)
        # The root's params (embeddings, head) are used again first thing in backward: resharding them only re-gathers.
        fully_shard(model, reshard_after_forward=False, **kwargs)
        self.prefetch(model, units)
        self._forwarded: set[int] = set()
        if self.reduce_scatter_via_all_reduce:
            self.reduce_comm = make_reduce_comm()  # None on an untested torch: the native reduce-scatter runs
            for module in model.modules() if self.reduce_comm is not None else ():
                if isinstance(module, FSDPModule):
                    module.set_custom_reduce_scatter(self.reduce_comm)
                    module.register_forward_pre_hook(self._note_forward)
        materialize(model)
        if self.cfg.cpu_offload and self.device.type != "cpu":
            for module in model.modules():  # FSDP offloads parameters only; buffers must sit on the compute device
                for key, buf in module._buffers.items():
                    if buf is not None:
                        module._buffers[key] = buf.to(self.device)
        return model

    @property
    def stages_unsharded(self) -> bool:
        """Whether pipeline stages stay plain modules: each stage alone on its data axis (pipeline parallelism and no
        other axis), fp32 parameters and reductions, no CPU offload. FSDP2 over a group of one only copies each unit's
        parameters into its unsharded buffer and back, and its hooks around every unit and micro-batch cost ~20% of a
        small PP step's CPU (docs/benchmarks.md, pipeline section). Plain stages hold the same values under the same
        names: the schedule accumulates their gradients, clipping and the optimizer see plain tensors, and DCP saves
        and loads them to and from any layout. Mixed precision or offload keeps FSDP2, which casts and offloads."""
        d = self.dims
        fp32 = self.param_dtype == torch.float32 and self.reduce_dtype == torch.float32
        return d.pp > 1 and d.world_size == d.pp and d.ep == 1 and fp32 and not self.cfg.cpu_offload

    def prefetch(self, model: nn.Module, units: list[nn.Module]) -> None:
        """distributed.prefetch_units > 0: issue the next units' all-gathers before this unit's compute, so they overlap
        it."""
        k = self.cfg.prefetch_units
        if k == 0:
            return
        for i, unit in enumerate(units):
            unit.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + k])
            unit.set_modules_to_backward_prefetch(units[max(0, i - k) : i][::-1])
        if self.device.type == "cpu":
            # On CPU FSDP2 issues a prefetched all-gather as a blocking op unless unshards are async; on CUDA
            # they overlap on FSDP2's side streams, where the async flag would stop copy-in/casts overlapping.
            self.unshard_async = torch_internals.set_unshard_async_op(model)

    def shard_experts(self, modules: Sequence[nn.Module], expert_mesh: DeviceMesh | None, kwargs: dict) -> None:
        """Each expert module its own FSDP2 unit over the expert mesh's data ranks outside 'ep', by rows where a rank
        has fewer experts than those ranks (expert_parallel.expert_shard_placement)."""
        if expert_mesh is None:
            return
        mesh = expert_fsdp_mesh(expert_mesh)
        degree = mesh.size(mesh.ndim - 1)  # the shard axis (HSDP: replicated over the one before)
        for module in modules:
            fully_shard(
                module, reshard_after_forward=self.cfg.reshard_after_forward,
                shard_placement_fn=lambda p: expert_shard_placement(p, degree), **kwargs | {"mesh": mesh},
            )  # fmt: skip

    def apply_tensor_parallel(self, model: nn.Module, plan: dict) -> None:
        """The task's plan over the mesh's 'tp' axis (shardlab.distributed.tensor_parallel), and async TP where asked
        (the pre-flight allows it on CUDA with compile only)."""
        from shardlab.distributed.tensor_parallel import apply_tensor_parallel, enable_async_tensor_parallel

        apply_tensor_parallel(model, plan, self.mesh["tp"])
        wanted = self.cfg.async_tensor_parallel and self.device.type == "cuda"
        self.async_tensor_parallel = wanted and enable_async_tensor_parallel(self.mesh["tp"])

    def shard_kwargs(self) -> dict:
        return {
            "mesh": self.fsdp_mesh(),
            "mp_policy": MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype),
            "offload_policy": CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
            if self.cfg.cpu_offload
            else OffloadPolicy(),
        }

    @contextlib.contextmanager
    def grad_sync(self, model: nn.Module, is_last_microbatch: bool) -> Iterator[None]:
        if not self.cfg.reduce_every_microbatch:
            # Accumulate unsharded gradients locally and reduce-scatter once, on the last micro-batch.
            model.set_requires_gradient_sync(is_last_microbatch)
        comm = self.reduce_comm
        if comm is None:
            yield
            return
        comm.overlap = self.can_overlap_reduce(model)
        self._forwarded.clear()
        try:
            yield
        except BaseException:
            comm.discard()
            raise
        else:
            comm.wait()
        finally:
            comm.overlap = False  # a backward outside this context (no wait() after it) must not overlap

    def can_overlap_reduce(self, model: nn.Module) -> bool:
        """Whether each unit's gradient reduce may finish under the next unit's backward: only where nothing reads the
        reduced shard before grad_sync's wait(). FSDP2 reads it at once for a cast to another dtype (reduce_dtype
        bf16), HSDP's all-reduce across replicas (2-D mesh), accumulation into gradients an earlier micro-batch left,
        and post-accumulate-grad hooks; a CUDA copy to pinned CPU memory (cpu_offload) would copy it unwritten."""
        params = list(model.parameters())
        return (
            self.device.type == "cpu"
            and self.mesh.ndim == 1  # the data axis alone: no hybrid, no tensor parallelism
            and self.reduce_dtype == torch.float32
            and torch_internals.in_backward() is not None  # _note_forward must tell recomputation apart
            # `is False`: a torch that cannot tell whether hooks exist does not overlap
            and all(p.grad is None and torch_internals.has_post_accumulate_grad_hooks(p) is False for p in params)
        )

    def _note_forward(self, module: nn.Module, args) -> None:
        """A unit run twice in one step is reduced twice in its backward, the second time accumulating into the
        first's (still unwritten) shard: no overlap then. Recomputation in backward does not count."""
        if self.reduce_comm is None or torch_internals.in_backward():
            return
        if id(module) in self._forwarded:
            self.reduce_comm.overlap = False
        self._forwarded.add(id(module))

    def make_grad_scaler(self):
        if torch.float16 not in (self.param_dtype, self.reduce_dtype):
            return None
        return ShardedGradScaler(self.device.type)

    def describe(self) -> Iterator[str]:
        yield from super().describe()
        mesh = "x".join(map(str, self.mesh.shape))
        yield (
            f"fully_sharded: mesh {mesh} {self.mesh.mesh_dim_names}, reshard_after_forward="
            f"{self.cfg.reshard_after_forward}, param/reduce dtype {self.param_dtype}/{self.reduce_dtype}, "
            f"cpu_offload={self.cfg.cpu_offload}, activation_checkpointing={self.cfg.activation_checkpointing}, "
            f"reduce-scatter {'as overlapped all-reduce' if self.reduce_comm is not None else 'native'}, "
            f"prefetch_units={self.cfg.prefetch_units}{' (async unshard)' if self.unshard_async else ''}"
        )
        if self.dims.pp > 1:
            per_rank = self.cfg.pipeline_stages_per_rank
            placed = (
                "plain modules (one data rank each)" if self.stages_unsharded else "each sharded over its data ranks"
            )
            yield (f"pipeline: {self.dims.describe()}; {self.cfg.pipeline_schedule} over {self.dims.pp * per_rank} "
                   f"stages ({per_rank} per rank), {placed}")  # fmt: skip
        if self.dims.cp > 1:
            ring, shard = self.cfg.context_parallel_rotate_method, self.fsdp_mesh().mesh_dim_names
            yield (f"context parallel: {self.dims.describe()}; each sequence split over {self.dims.cp} ranks (torch's "
                   f"ring, {ring}), FSDP2 over {shard}")  # fmt: skip
        if self.dims.tp > 1:
            overlapped = getattr(self, "async_tensor_parallel", False)
            overlap = "async (overlapped in compiled graphs)" if overlapped else "sync"
            yield (f"tensor parallel: {self.dims.describe()}; each layer split over {self.dims.tp} ranks, sequence-"
                   f"parallel between blocks, collectives {overlap}")  # fmt: skip
        if self.dims.ep > 1:
            ep, rest = self.dims.ep, self.dims.dp_shard // self.dims.ep
            yield (f"expert parallel: each MoE layer's experts split over groups of {ep} consecutive ranks (1/{ep} of "
                   f"them per rank, tokens exchanged by all-to-all), each expert sharded over the {rest} data rank(s) "
                   "outside its group")  # fmt: skip
