"""The Backend interface: how a model is placed on devices and ranks, and how its gradients are reduced.

The trainer talks only to this interface, so a new backend is a new registered class, not a trainer change.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import DistError, PrefixStore, TCPStore
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from shardlab.config import DistributedConfig
from shardlab.distributed import network
from shardlab.distributed.env import DistEnv, free_port
from shardlab.distributed.join import agent_hosts_store, prepare_and_agree, store_timeout
from shardlab.distributed.mesh import ParallelDims
from shardlab.errors import ConfigError, RankFailed, one_line
from shardlab.registry import BACKENDS

DTYPE_BY_NAME = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_dtypes(cfg: DistributedConfig) -> tuple[torch.dtype, torch.dtype]:
    """(param_dtype, reduce_dtype) from the explicit fields or the ``precision`` shorthand.

    fairseq's --fp16 reduces in fp16 too; bf16 reduces in fp32 by default because bf16 sums lose bits fast.
    """
    # precision=auto is fp32 until a rank settles it (distributed/precision.py: settle, before the plan and the model)
    precision = "fp32" if cfg.precision == "auto" else cfg.precision
    param = cfg.param_dtype or precision
    reduce = cfg.reduce_dtype or ("fp32" if precision == "bf16" else precision)
    return DTYPE_BY_NAME[param], DTYPE_BY_NAME[reduce]


def pick_device(local_rank: int) -> torch.device:
    """This rank's device: its GPU among the visible ones (a cluster that binds one GPU per task shows each rank one
    device, index 0, whatever its local rank), else the CPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def process_group_backend(device: torch.device) -> str:
    """torch.distributed's backend string. On CUDA a device-mapped group (as torchtitan's): NCCL for CUDA tensors and
    gloo for CPU ones, so collectives on CPU tensors - cpu_offload's sharded gradients in clipping and the fp16
    scaler's found-inf vote - run instead of failing on NCCL. Groups made later (device mesh, synced BN) inherit it."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def join_process_group(
    env: DistEnv,
    device: torch.device,
    timeout_s: float,
    prepare_data: Callable[[], str] | None = None,
    init_timeout_s: float = 600.0,
) -> network.Joined:
    """Prepare this rank's data with ``prepare_data()`` (it returns what the rank opened), then join the job's process
    group (once per process: when it exists, only ``prepare_data`` runs).

    The ranks first meet in the launcher's rendezvous store, where data preparation may take as long as it needs and
    all ranks agree they opened the same data (shardlab.distributed.join) and learn what each sees of the network,
    from which each chooses the interface gloo/NCCL offer their peers (shardlab.distributed.network); only then is the
    process group made, with ``timeout_s`` for its collectives. A rank that cannot reach the master fails after
    ``init_timeout_s``, as rank 0 gives up on one that never came. Returns the hosts of the ranks and the interface
    chosen (the same as the first time, when the group exists)."""
    global _joined
    if dist.is_initialized():
        if prepare_data is not None:
            prepare_data()
        return _joined
    store = _rendezvous_store(env, timeout_s, init_timeout_s)
    interface, hosts, addresses = None, [socket.gethostname()], []
    if env.world_size > 1 and prepare_data is not None:  # without data to agree on, the ranks meet in the group
        route = network.local_route(env.master_addr)
        routes = prepare_and_agree(
            store, env.rank, env.world_size, prepare_data, route=route.to_json(),
            appear_s=init_timeout_s,
        )  # fmt: skip
        everyone = [network.Route(**r) for r in routes]
        interface = network.choose_interface(route, everyone, network.interfaces())
        hosts, addresses = [r.host for r in everyone], network.peer_addresses(everyone)
    elif prepare_data is not None:
        prepare_data()
    interface = network.apply_interface(interface)
    timeout = timedelta(seconds=timeout_s)
    store.set_timeout(timeout)
    dist.init_process_group(
        backend=process_group_backend(device),
        store=PrefixStore("default_pg", store),  # the keys torch's own init_method path uses
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
    )
    _joined = network.Joined(hosts, interface, addresses)
    return _joined


_joined = network.Joined([socket.gethostname()], None)
"""What this process's join learned (its process group is made once per process)."""

AGENT_STORE_CONNECT_S = 20.0
"""torchrun's agent starts its store before any worker: one that cannot be reached for this long has ended."""


def _rendezvous_store(env: DistEnv, timeout_s: float, init_timeout_s: float = 600.0) -> TCPStore:
    """The job's key-value store: torchrun's agent hosts it where torchrun says so (TORCHELASTIC_USE_AGENT_STORE), else
    rank 0 does, at the master address and port (local spawn, Slurm, or one process on any free port). Another rank
    first waits for rank 0's port to answer (network.wait_for_master: notes while waiting, one line on failure after
    ``init_timeout_s``)."""
    agent_hosts = agent_hosts_store(env)
    if env.master_port and env.rank != 0 and not agent_hosts:
        network.wait_for_master(env.rank, env.master_addr, env.master_port, init_timeout_s)
    # Rank 0 may start its store minutes after the others (a slow node, a long import); an agent's store is up before
    # its workers start, so not reaching it soon means that agent ended (its own workers failed) and nobody ever will.
    connect_s = AGENT_STORE_CONNECT_S if agent_hosts else store_timeout(timeout_s).total_seconds()
    try:
        store = TCPStore(
            env.master_addr,
            env.master_port or free_port(),
            world_size=env.world_size,
            is_master=env.rank == 0 and not agent_hosts,
            timeout=timedelta(seconds=connect_s),
            wait_for_workers=False,  # the ranks meet in prepare_and_agree, which tells a slow rank from a dead one
            multi_tenant=True,  # several jobs in one process (tests) share one server per port, as torch's init does
        )
    except DistError as e:
        if not agent_hosts:
            raise
        raise RankFailed(
            f"rank {env.rank}: torchrun's store at {env.master_addr}:{env.master_port} is gone (the first node's "
            f"torchrun ended; its log says why): {one_line(e)}"
        ) from e
    store.set_timeout(store_timeout(timeout_s))
    return store


class Backend:
    """Base class: one process, no wrapping. Subclasses override ``parallelize`` and the gradient hooks."""

    name = "single"

    def __init__(self, cfg: DistributedConfig, env: DistEnv) -> None:
        self.cfg = cfg
        self.env = env
        self.device = self._pick_device()
        self.param_dtype, self.reduce_dtype = resolve_dtypes(cfg)
        self.cpu_allocator: str | None = None
        """What setup applied to this CPU rank's allocator (lean or fast); None on GPU ranks, off glibc, or where the
        user's MALLOC_MMAP_THRESHOLD_ decides."""
        self.network = network.Joined([socket.gethostname()], None)
        """The host of each rank, and the interface gloo/NCCL offer their peers here (None: their default)."""
        self._timeout_s: float = cfg.timeout_s
        """The collective timeout in force (long_timeout raises it for a while)."""
        self.dims = ParallelDims.from_config(cfg, env.world_size)
        """The degree of each mesh axis (shardlab.distributed.mesh); single and ddp use the data axes only."""
        self.mesh: DeviceMesh | None = None
        """The one device mesh over every rank, named by ``dims`` (fully_sharded builds it in setup; slice it by name:
        ``mesh["tp"]``); None where the backend needs none (single, ddp)."""

    # ---- process group -------------------------------------------------------------------------------------------
    def _pick_device(self) -> torch.device:
        return pick_device(self.env.local_rank)

    def setup(self, prepare_data: Callable[[], str] | None = None) -> None:
        """Prepare this rank's data with ``prepare_data()`` (it returns what the rank opened), then join the process
        group (join_process_group): every backend does when world_size > 1 (metrics and checkpoints sync through it),
        and ddp / fully_sharded do at world size 1 too, since DDP and FSDP2 need one."""
        if self.device.type == "cpu":
            from shardlab.distributed.cpu_allocator import configure_cpu_allocator, resolve_cpu_allocator

            mode = resolve_cpu_allocator(self.cfg)
            self.cpu_allocator = mode if configure_cpu_allocator(mode) else None
        if self.env.world_size > 1 or self.name != "single":
            self.network = join_process_group(
                self.env, self.device, self.cfg.timeout_s, prepare_data, self.cfg.init_timeout_s
            )
        elif prepare_data is not None:
            prepare_data()

    def teardown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (which each read a different slice of a batch): the ranks
        of one tensor-parallel group share it, and read the same samples."""
        return self.dims.dp_rank(self.env.rank)

    @property
    def dp_world_size(self) -> int:
        """How many slices each global batch is split into (the data axes' ranks; the world without other axes)."""
        return self.dims.dp

    # ---- model ---------------------------------------------------------------------------------------------------
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
        """Wrap ``model`` (built on meta) for this backend and materialize its weights with ``materialize``.
        ``full_precision_modules`` (Task.full_precision_modules) compute in fp32 whatever the param dtype: their own
        fp32 units under fully_sharded; autocast leaves them alone elsewhere. ``tensor_parallel_plan``
        (Task.tensor_parallel_plan, given when distributed.tensor_parallel_degree > 1): only fully_sharded applies
        one (the pre-flight refuses tensor parallelism elsewhere); so for ``expert_modules`` (Task.expert_modules,
        given when distributed.expert_parallel_degree > 1). ``recomputed``: which of ``units`` activation
        checkpointing wraps, where the caller decided it over the whole model's units (a pipeline stage's:
        checkpoint_units); by default checkpoint_units decides over ``units``."""
        refuse_tensor_parallel(self.name, tensor_parallel_plan, expert_modules)
        materialize(model)
        if self.cfg.activation_checkpointing != "none":
            from shardlab.distributed.activation_checkpointing import checkpoint_units

            units = checkpoint_units(model, units, self.cfg, recomputed)
        self.compile_units(units or [model])
        return model

    def compile_units(self, units: Sequence[nn.Module]) -> None:
        """distributed.compile: compile each unit in place (after activation-checkpoint wrapping, before any
        sharding or DDP wrapping, so their hooks stay outside the graphs)."""
        if self.cfg.compile:
            from shardlab.distributed.compile import compile_units, use_cache_dir

            use_cache_dir(self.cfg)
            compile_units(units)

    def process_groups(self) -> list[dist.ProcessGroup | None]:
        """The groups this backend's collectives use (None: the default group), e.g. to change their timeout."""
        return [None]

    @property
    def param_device(self) -> torch.device:
        """Where parameters live between steps (the CPU under cpu_offload)."""
        return self.device

    def forward_context(self) -> contextlib.AbstractContextManager:
        """Around forward and loss: autocast where the backend does not cast parameters itself, and saved-tensor
        offload to the CPU when distributed.offload_activations is set."""
        stack = contextlib.ExitStack()
        if self.casts_in_forward and self.param_dtype != torch.float32:
            stack.enter_context(torch.autocast(self.device.type, dtype=self.param_dtype))
        if self.cfg.offload_activations:
            stack.enter_context(torch.autograd.graph.save_on_cpu(pin_memory=self.device.type == "cuda"))
        if self.cfg.compile and not torch.is_grad_enabled():  # validation: not worth a second compilation
            from shardlab.distributed.compile import eager_for_inference

            stack.enter_context(eager_for_inference())
        return stack

    casts_in_forward = True
    """True where lower precision comes from autocast; FSDP2 casts parameters itself (MixedPrecisionPolicy)."""

    def grad_sync(self, model: nn.Module, is_last_microbatch: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-batch's backward: backends may skip gradient reduction until the last one."""
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip to ``max_norm`` (0: only measure) and return the global gradient norm as a plain tensor.

        Sharded (DTensor) gradients give DTensor norms whose full value spans every rank of their mesh (the data
        axes' shards summed, tensor-parallel replicas counted once); the norm is made whole before clipping, so the
        coefficient is one plain number however the gradients are placed.
        """
        by_mesh = params_by_mesh(p for p in model.parameters() if p.grad is not None)
        norm = total_grad_norm(by_mesh)
        if max_norm > 0:
            for params in by_mesh:
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm.detach().cpu()

    def make_grad_scaler(self) -> torch.amp.GradScaler | None:
        """A loss scaler whenever anything is computed or reduced in fp16 (an fp16 all-reduce of fp32 gradients
        underflows small ones just as fp16 compute does)."""
        if torch.float16 not in (self.param_dtype, self.reduce_dtype):
            return None
        return torch.amp.GradScaler(self.device.type)

    # ---- collectives for metrics ---------------------------------------------------------------------------------
    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over the ranks that hold different terms of them (losses, counts, tokens): every rank
        without other axes; with them, the data (and context) axes only, in turn, since each tensor-parallel rank of a
        group holds the same values (mesh.ParallelDims.loss_dims)."""
        if not (dist.is_initialized() and self.env.world_size > 1):
            return values
        values = values.clone()
        if self.mesh is None or not self.dims.multi_axis:
            dist.all_reduce(values)
            return values
        for name in self.dims.loss_dims():
            dist.all_reduce(values, group=self.mesh.get_group(name))
        return values

    def any_rank(self, *flags: bool) -> list[bool]:
        """Each flag OR-ed over all ranks, in one small all-reduce. Decisions such as "stop now" or "save now" must
        be the same on every rank, or one rank enters a collective that the others never join."""
        if not (dist.is_initialized() and self.env.world_size > 1):
            return list(flags)
        packed = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=self.device)
        dist.all_reduce(packed, op=dist.ReduceOp.MAX)
        return [bool(v) for v in packed.tolist()]

    def max_over_ranks(self, values: list[float]) -> list[float]:
        """Each value's maximum over all ranks (e.g. the memory peak of the fullest rank)."""
        packed = torch.tensor(values, dtype=torch.float64, device=self.device)
        if dist.is_initialized() and self.env.world_size > 1:
            dist.all_reduce(packed, op=dist.ReduceOp.MAX)
        return packed.tolist()

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    @contextlib.contextmanager
    def long_timeout(self, seconds: float) -> Iterator[None]:
        """Collectives inside wait up to ``seconds`` (never less than distributed.timeout_s): for work whose time grows
        with the model, the data or the file system, which one rank may do while the others wait (checkpoint I/O and
        its folder's clean-up). Nested windows keep the longest until the outermost ends. The caller ends the window
        with a collective (every checkpoint step ends in an agreement), so no rank leaves it while another is still
        inside."""
        previous = self._timeout_s
        self._timeout_s = max(previous, seconds)
        if dist.is_initialized() and self._timeout_s != previous:
            self._set_timeouts(self._timeout_s)
        try:
            yield
        finally:
            if dist.is_initialized() and self._timeout_s != previous:
                self._set_timeouts(previous)
            self._timeout_s = previous

    def _set_timeouts(self, seconds: float) -> None:
        for group in self.process_groups():
            dist.set_timeout(timedelta(seconds=seconds), group)

    def describe(self) -> Iterator[str]:
        yield f"backend {self.name}: world size {self.env.world_size} ({self.env.launcher}), device {self.device}"
        if self.network.interface:
            yield (f"network: {len(set(self.network.hosts))} hosts, master {self.env.master_addr}:"
                   f"{self.env.master_port}; ranks talk on {self.network.interface} "
                   "here (each host chooses its own: docs/distributed.md#multi-node)")  # fmt: skip
        if self.cfg.compile:
            cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
            yield f"compile: every unit builds its graphs in the first training step (inductor cache {cache})"


def params_by_mesh(params: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``params`` grouped by the mesh they are DTensors on (plain tensors together). DTensors of different meshes
    (experts on the expert mesh beside the rest on the data mesh: shardlab/distributed/expert_parallel.py) cannot
    meet in one op, foreach ops included."""
    groups: dict[object, list[torch.Tensor]] = {}
    for param in params:
        groups.setdefault(param.device_mesh if isinstance(param, DTensor) else None, []).append(param)
    return list(groups.values())


def total_grad_norm(by_mesh: list[list[torch.Tensor]]) -> torch.Tensor:
    """The 2-norm of the gradients of every parameter of ``by_mesh`` (params_by_mesh) as a plain tensor: each
    mesh's norm made whole on its own, then the norms combined."""
    norms = []
    for params in by_mesh or [[]]:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))


def refuse_tensor_parallel(backend: str, plan: dict | None, expert_modules: Sequence[nn.Module] = ()) -> None:
    """A backend that does not apply tensor-parallel plans or split experts, given one (the pre-flight refuses this
    config first)."""
    for key, asked in (("tensor_parallel_degree", plan is not None), ("expert_parallel_degree", bool(expert_modules))):
        if asked:
            raise ConfigError(f"distributed.{key} > 1 needs distributed.backend=fully_sharded (not {backend})")


@BACKENDS.register("single")
def build_single(cfg: DistributedConfig, env: DistEnv) -> Backend:
    if env.world_size > 1:
        raise ConfigError(
            f"distributed.backend=single runs one process but this job has {env.world_size} ranks; "
            "use distributed.backend=ddp or fully_sharded"
        )
    return Backend(cfg, env)
