"""Pipeline parallelism: the model cut into stages by layers, each rank's stages parallelized alone, and one of the
schedules torch ships (torch.distributed.pipelining) running a step's micro-batches through them.

The cut is the task's (shardlab.task.PipelineCut: which ModuleList holds the layers, which modules go with the first
and the last stage). With P = distributed.pipeline_parallel_degree and S = pipeline_stages_per_rank there are P x S
stages of consecutive layers (as even as the count allows, the first stages taking one more); stage i runs on
pipeline rank i mod P. Each stage is a shallow copy of
the model on meta that keeps only its layers under their own names ('blocks.5'), so the backend shards it (FSDP over
the data-parallel ranks of its stage) and materializes it like a whole model, and its state-dict keys - and the
checkpoint's - are the unsplit model's.

Micro-batches: each of the optimization.update_freq micro-batches the trainer would accumulate is one pipeline
micro-batch, so a step reads the same samples and takes the same mean gradient as without a pipeline. The loss is
computed on the last stage; its sums are added on the last stage's ranks only, so the trainer's all-reduce over
every rank logs the same numbers everywhere. Gradient clipping measures the norm over all stages' parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardlab.config import TrainConfig
from shardlab.task import PipelineCut, Task

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
}
"""distributed.pipeline_schedule's names for torch's schedules. Not the zero-bubble ones (ScheduleInterleavedZeroBubble,
ScheduleZBVZeroBubble): they train on CPU, but torch 2.14's forward-only eval() of them fails ("can't
steal_bwd_input if this stage doesn't have backward"), so validation could not run through them."""

MULTI_STAGE = ("interleaved_1f1b",)
"""Schedules that run several stages per rank (distributed.pipeline_stages_per_rank >= 2)."""


def layer_ranges(num_layers: int, num_stages: int) -> list[range]:
    """Each stage's layers: consecutive, as even as the count allows, the first stages taking one more."""
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for stage in range(num_stages):
        ranges.append(range(start, start + base + (stage < extra)))
        start = ranges[-1].stop
    return ranges


def rank_stages(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` holds, in order: those with i mod P = rank (a loop)."""
    return [pp_rank + k * pp for k in range(stages_per_rank)]


class KeptLayers(nn.ModuleDict):
    """A stage's layers under their indices in the unsplit model (keys 'blocks.5...'), iterated in order like the
    ModuleList they come from, so the model's forward runs them unchanged."""

    def __iter__(self):
        return iter(self._modules.values())


class Absent(nn.Identity):
    """Stands in for a first or last module on a stage that does not hold it: hands on the activation it is given and
    ignores what else the model's forward passes that module (an embedding's positions under context parallelism)."""

    def forward(self, input: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return input


def pruned(model: nn.Module, cut: PipelineCut, layer_ids: Sequence[int], first: bool, last: bool) -> nn.Module:
    """A shallow copy of ``model`` (its own root, sharing every submodule with it) that holds only the layers
    ``layer_ids``, and the cut's first/last modules where ``first``/``last`` (identities elsewhere)."""
    copy = model.__class__.__new__(model.__class__)
    # The root's dicts (children, parameters, hooks) are copied so that wrapping one stage's root touches no other.
    copy.__dict__.update({k: v.copy() if isinstance(v, (dict, set)) else v for k, v in model.__dict__.items()})
    layers = getattr(model, cut.layers)
    copy._modules[cut.layers] = KeptLayers({str(i): layers[i] for i in layer_ids})
    for names, keep in ((cut.first, first), (cut.last, last)):
        for name in names if not keep else ():
            copy._modules[name] = Absent()
    return copy


class Pipeline:
    """This rank's stages, their schedule, and what a training step and a validation batch run through them."""

    def __init__(
        self, cfg: TrainConfig, task: Task, stages: list[PipelineStage], model: nn.Module, group, device
    ) -> None:
        d = cfg.distributed
        self.task, self.stages, self.group, self.device = task, stages, group, device
        self.model = model
        """This rank's layers under the unsplit model's names: what the optimizer, clipping and checkpoints see."""
        self.num_micro_batches = cfg.optimization.update_freq
        self.is_first = any(s.is_first for s in stages)
        self.is_last = any(s.is_last for s in stages)
        self._stats: list[dict[str, torch.Tensor]] = []
        self._per_term: torch.Tensor | None = None
        self._keys: list[str] | None = None
        """The names of the loss's sums, learned from the last stage at the first run."""
        schedule = SCHEDULES[d.pipeline_schedule]
        self.schedule = schedule(
            stages if d.pipeline_schedule in MULTI_STAGE else stages[0],
            n_microbatches=self.num_micro_batches,
            loss_fn=self._loss,
            scale_grads=True,  # each micro-batch's loss is a mean: the step's gradient is their mean
        )

    def _loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """A micro-batch's mean loss; for a task that counts its loss terms (Task.loss_count: fine-tuning's answer
        tokens, the "count" of pipeline_loss's sums), its weight in the step's mean over all terms (as
        shardlab.data.weighted_micro_batches weighs it without a pipeline: its count x per_term) times the
        micro-batches, which the schedule's scale_grads divides back out. The weight comes from the micro-batch's own
        count: the schedule hands the loss only the targets (a tensor), not which micro-batch they are."""
        loss, stats = self.task.pipeline_loss(output, targets)
        self._stats.append({k: v.detach().float() for k, v in stats.items()})
        if self._per_term is None:
            return loss
        return loss * (stats["count"].to(self._per_term.device) * self._per_term * self.num_micro_batches)

    def _run(
        self, batches: list, train: bool, per_term: torch.Tensor | None = None
    ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        """Every micro-batch through the schedule (``per_term``: see _loss; None: the plain mean); (the last stage's
        losses, empty elsewhere; the sums of its statistics, zeros elsewhere, so that summing over all ranks counts
        each micro-batch once)."""
        self._per_term = per_term
        inputs, targets = zip(*(self.task.pipeline_batch(b, self.device) for b in batches), strict=True)
        losses: list[torch.Tensor] = []
        self._stats = []
        arg_mbs = [(x,) for x in inputs] if self.is_first else None
        if train:  # return_outputs off: the last stage would keep every micro-batch's logits to the step's end
            self.schedule.step(arg_mbs=arg_mbs, target_mbs=list(targets), losses=losses, return_outputs=False)
        else:
            self.schedule.eval(arg_mbs=arg_mbs, target_mbs=list(targets), losses=losses)
        # The schedule may call the loss while it learns the stages' shapes: the micro-batches' are the last ones.
        stats = self._stats[len(self._stats) - len(losses) :] if self.is_last else []
        if self._keys is None:  # once: every rank learns the names of the sums, which only the last stage computes
            names: list[list[str]] = [[] for _ in range(dist.get_world_size())]
            dist.all_gather_object(names, sorted({k for s in stats for k in s}))
            self._keys = sorted({k for rank_names in names for k in rank_names})
        return losses, {k: sum((s[k] for s in stats), torch.zeros(())) for k in self._keys}

    def train_step(
        self, batches: list, per_term: torch.Tensor | None = None
    ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        """Forward and backward of a step's micro-batches (one per batch, in order); gradients accumulate in the
        stages' parameters: their mean over the micro-batches, or with ``per_term`` (the data-parallel ranks over the
        step's loss terms on all ranks: fine-tuning's answer tokens) the step's mean over all its terms."""
        for module in self.stage_modules:
            module.train()
        return self._run(batches, train=True, per_term=per_term)

    @torch.no_grad()
    def evaluate(self, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        """Forward only of a local validation batch, split into the schedule's micro-batches (the pre-flight makes
        validation.batch_size a multiple of data-parallel ranks x update_freq); the last stage's sums."""
        for module in self.stage_modules:
            module.eval()
        return self._run(list(torch.tensor_split(batch, self.num_micro_batches)), train=False)[1]

    @property
    def stage_modules(self) -> list[nn.Module]:
        return [stage.submod for stage in self.stages]

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip to ``max_norm`` (0: only measure) by the norm over every stage's gradients: each rank's norm (over
        its data-parallel shards) squared, summed over the pipeline ranks."""
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squared = norm.float() ** 2
        dist.all_reduce(squared, group=self.group)
        norm = squared.sqrt()
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm.detach().cpu()


def build_pipeline(
    cfg: TrainConfig,
    task: Task,
    backend,
    model: nn.Module,
    units: list[nn.Module],
    materialize: Callable[[nn.Module], None],
    stage_metadata: Callable[[int], dict] | None = None,
) -> Pipeline:
    """This rank's stages of ``model`` (built on meta), each parallelized alone by ``backend`` over the units inside
    it and materialized, and the schedule over them. ``stage_metadata``: PipelineStage's static shapes of a stage
    (its keyword arguments input_args, output_args, ...) by stage index, where torch cannot learn them at the first
    step (on a fake process group: shardlab.memory.stage_step); by default it learns them."""
    from shardlab.distributed.activation_checkpointing import checkpointed_units

    d = cfg.distributed
    cut = task.pipeline_cut()
    pp_mesh = backend.mesh["pp"]  # the one mesh's pipeline axis (fully_sharded builds it from ParallelDims)
    pp, pp_rank = d.pipeline_parallel_degree, pp_mesh.get_local_rank()
    num_stages = pp * d.pipeline_stages_per_rank
    ranges = layer_ranges(cut.num_layers, num_stages)
    held = rank_stages(pp_rank, pp, d.pipeline_stages_per_rank)
    # distributed.ac_skip_units and ac_every_k_units count the whole model's units, as the memory plan does: [0, -1]
    # is the embedding and the head, not each stage's first and last block.
    recomputing = set(checkpointed_units(len(units), d.activation_checkpointing, d.ac_every_k_units, d.ac_skip_units))
    stages = []
    for index in held:
        first, last = index == 0, index == num_stages - 1
        module = pruned(model, cut, ranges[index], first=first, last=last)
        inside = {id(m) for m in module.modules()}
        plan = stage_tensor_parallel_plan(task, module) if backend.dims.tp > 1 else None
        positions = [i for i, u in enumerate(units) if id(u) in inside]
        module = backend.parallelize(
            module,
            [units[i] for i in positions],
            materialize,
            full_precision_modules=task.full_precision_modules(module),
            tensor_parallel_plan=plan,
            recomputed=[k for k, i in enumerate(positions) if i in recomputing],
        )
        if plan is not None and not first:
            whole_sequence_within_stage(module, getattr(module, cut.layers), backend.mesh["tp"])
        static = stage_metadata(index) if stage_metadata is not None else {}
        stages.append(PipelineStage(module, index, num_stages, backend.device, group=pp_mesh.get_group(), **static))
    layer_ids = [i for index in held for i in ranges[index]]
    rank_model = pruned(model, cut, layer_ids, first=0 in held, last=num_stages - 1 in held)
    return Pipeline(cfg, task, stages, rank_model, pp_mesh.get_group(), backend.device)


def stage_tensor_parallel_plan(task: Task, module: nn.Module) -> dict:
    """The task's tensor-parallel plan for one stage: the entries of the modules the stage holds (not of those it
    replaced by identities: the embedding off the first stage, the head off the last)."""
    plan = task.tensor_parallel_plan(module)
    return {
        path: style
        for path, style in plan.items()
        if not isinstance(module.get_submodule(path.split(".")[0]), nn.Identity)
    }


def whole_sequence_within_stage(stage: nn.Module, layers: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Under tensor parallelism the residual stream between layers is split by sequence over the TP ranks (sequence
    parallelism), and it crosses stages split too: each TP rank sends its slice to the same TP rank of the next
    stage, 1/tp of the sequence (torchtitan's stages send their local slice as well), and the receiving stage keeps
    that slice for its backward. A stage after the first all-gathers the slice it receives before its forward, whose
    model code sizes what it builds by its input (the Llama's rotary tables), and its first layer takes its slice
    again: both moves are autograd's (DTensor redistributes), so the gradient sent back is a slice too."""
    stage.register_forward_pre_hook(
        lambda _module, args: (DTensor.from_local(args[0], tp_mesh, [Shard(1)]).full_tensor(), *args[1:])
    )
    next(iter(layers)).register_forward_pre_hook(
        lambda _module, args: (
            DTensor.from_local(args[0], tp_mesh, [Replicate()]).redistribute(tp_mesh, [Shard(1)]).to_local(),
            *args[1:],
        )
    )
