"""The tensor-parallel plans of the LM architectures, as data (Megatron's layout, as torchtitan writes it for Llama):
each module path to the torch ParallelStyle that splits it over distributed.tensor_parallel_degree ranks.

Between blocks the residual stream is split by sequence (sequence parallelism: Shard(1)), so norms and the residual
adds run on a 1/tp slice of the tokens. Entering attention or the MLP it is all-gathered; q, k, v, gate and up are
column-wise (each rank computes its own heads, its own slice of the FFN width), o and down row-wise, their partial
sums reduce-scattered back onto the sequence. The embedding is split by vocabulary rows (VocabularySplitEmbedding:
its backward writes each rank's rows only) and hands on the sequence slice; the head is column-wise over the
vocabulary, its logits gathered whole, or, with distributed.loss_parallel, left split over the vocabulary
(vocabulary_split_logits) for torch's loss-parallel cross-entropy (shardlab_tasks/lm/loss.py). A tied embedding
and head share one weight split by vocabulary rows both ways. Qwen3's q/k norms are sequence-parallel over the heads
dimension (their weight's gradient is summed over the tensor-parallel ranks, each of which saw its heads). LoRA's
adapted layers are split with their adapters (SplitAdaptedLinear); GPT's fused qkv projection with its output
regrouped by heads (FusedQKVColwise).

A mixture-of-experts block (model.moe) is not split: it runs on each rank's slice of the sequence as it comes
(SequenceShardedMoE), each rank routing its own tokens with the whole router, experts and shared expert, held alike on
every rank of the group (expert parallelism splits the experts over data ranks instead: shardlab/distributed/
expert_parallel.py). Tokens never gather for it, so attention's all-gather and reduce-scatter are the only collectives a
layer adds; the block sums its routing statistics and its weights' gradients over the group
(shardlab_tasks/lm/models/moe.py). torchtitan gathers the tokens for its MoE and splits the experts' FFN width or the
tokens again after routing; here the tokens are already split, and the experts, sized for expert parallelism, stay
whole.
"""

from __future__ import annotations

import fnmatch
import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

HEAD = "head.out"
"""The output projection of every LM plan: column-wise over the vocabulary."""


def vocabulary_split_logits(plan: dict) -> dict:
    """``plan`` with the head's logits left split over the vocabulary, as DTensors (distributed.loss_parallel, as
    torchtitan's loss parallel): each rank holds (batch, sequence, vocabulary / tp) of them, never the whole."""
    return {**plan, HEAD: ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}


class SequenceShardedMoE(ParallelStyle):
    """An MoE block (shardlab_tasks.lm.models.moe.MoEBlock) on this rank's slice of the sequence: its input (the
    sequence-parallel norm's Shard(1) DTensor) handed on as the local tensor, its output local like a row-wise layer's,
    its weights left plain tensors (whole on every rank); the tensor-parallel group set as ``token_group`` of the block
    and of its router, experts and shared expert, which sum their statistics and gradients over it."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()
        for part in module.modules():
            if hasattr(part, "token_group"):
                part.token_group = group
        module.register_forward_pre_hook(lambda mod, args: tuple(local_tokens(a) for a in args))
        return module


def local_tokens(x):
    """This rank's tokens of a sequence-split DTensor (its gradient comes back split alike); anything else as is."""
    return x.to_local() if isinstance(x, DTensor) else x


def llama_plan(qk_norm: bool, moe: bool = False) -> dict:
    """shardlab_tasks.lm.models.llama.Llama (Llama 3.x, Qwen2 with biases, Qwen3 with q/k norms, Mistral): Block.forward
    takes (x, cos, sin, mask), so attention's prepared inputs are four, the rotary tables and mask left alone. With
    ``moe`` (Mixtral, Qwen2/3-MoE) every block's MLP is an MoE block on the local tokens (SequenceShardedMoE)."""
    plan = {
        "embed": VocabularySplitEmbedding(output_layout=Shard(1)),
        "blocks.*.attn_norm": SequenceParallel(),
        "blocks.*.attn": PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None),
            desired_input_layouts=(Replicate(), None, None, None),
            use_local_output=True,
        ),
        "blocks.*.attn.q": ColwiseParallel(),
        "blocks.*.attn.k": ColwiseParallel(),
        "blocks.*.attn.v": ColwiseParallel(),
        "blocks.*.attn.o": RowwiseParallel(output_layouts=Shard(1)),
        "blocks.*.mlp_norm": SequenceParallel(),
        "blocks.*.mlp": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
        "blocks.*.mlp.gate": ColwiseParallel(),
        "blocks.*.mlp.up": ColwiseParallel(),
        "blocks.*.mlp.down": RowwiseParallel(output_layouts=Shard(1)),
        "head.norm": SequenceParallel(),
        HEAD: ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    if moe:
        for key in ("blocks.*.mlp", "blocks.*.mlp.gate", "blocks.*.mlp.up", "blocks.*.mlp.down"):
            del plan[key]
        plan["blocks.*.mlp"] = SequenceShardedMoE()
    if qk_norm:  # (batch, length, local heads, head_dim): the local heads are dimension 2's shard
        plan["blocks.*.attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["blocks.*.attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


class VocabularySplitEmbedding(ParallelStyle):
    """An nn.Embedding split by vocabulary rows over the tensor-parallel ranks (Megatron's VocabParallelEmbedding):
    each rank looks up the tokens its rows hold, zeros for the others, and the ranks' sums are the output, reduce-
    scattered onto the sequence or all-reduced whole (``output_layout``). Its backward writes the rank's own rows
    only. torch's RowwiseParallel computes the same forward, but DTensor has no vocabulary-sharded strategy for the
    embedding's backward: every rank computes the gradient of the whole table and keeps 1/tp of it, and FSDP2
    accumulates that whole table in fp32 across micro-batches (7.8 GiB a rank at Llama 3.1 405B, TP 8, under a
    pipeline: tests/unit/test_torch_internals.py shows torch's behaviour). The weight is a Shard(0) DTensor, as
    RowwiseParallel places it, so checkpoints, exports and a tied head are unchanged."""

    def __init__(self, output_layout: Shard | Replicate) -> None:
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding) or module.padding_idx is not None or module.max_norm is not None:
            raise ValueError(f"VocabularySplitEmbedding splits a plain nn.Embedding, not {module!r}")
        weight = module.weight
        split = nn.Parameter(distribute_tensor(weight, device_mesh, [Shard(0)]), requires_grad=weight.requires_grad)
        module.register_parameter("weight", split)
        module.forward = functools.partial(vocabulary_split_lookup, module, device_mesh, self.output_layout)
        return module


def vocabulary_split_lookup(
    module: nn.Embedding, device_mesh: DeviceMesh, output_layout, tokens: torch.Tensor
) -> torch.Tensor:
    """The embedding of ``tokens`` (whole on every rank) from this rank's rows of the table, summed over the ranks."""
    local = module.weight.to_local()  # its gradient comes back as this rank's rows (Shard(0))
    start = device_mesh.get_local_rank() * local.shape[0]
    elsewhere = (tokens < start) | (tokens >= start + local.shape[0])
    rows = torch.nn.functional.embedding(torch.where(elsewhere, 0, tokens - start), local)
    partial = DTensor.from_local(rows.masked_fill(elsewhere.unsqueeze(-1), 0), device_mesh, [Partial()])
    return partial.redistribute(device_mesh, [output_layout]).to_local()


def divisibility_errors(degree: int, sizes: dict[str, int]) -> list[str]:
    """One line per size (key -> value) that ``degree`` tensor-parallel ranks cannot split evenly."""
    return [
        f"distributed.tensor_parallel_degree ({degree}) must divide {key} ({value}): each rank holds 1/{degree} of it"
        for key, value in sizes.items()
        if value % degree
    ]


class SplitAdaptedLinear(ParallelStyle):
    """A LoRA-adapted linear (shardlab_tasks.lm.models.lora.LoRALinear) split like ColwiseParallel or RowwiseParallel,
    its adapters with it: column-wise, the weight, bias and B (out, rank) by output rows, A (rank, in) whole on every
    rank; row-wise, the weight and A by input columns, the bias and B whole. Everything inside runs on DTensors, so the
    adapter's partial sums reduce with the base's. (torch's styles split every parameter of the module alike, and
    cannot name a submodule's.)"""

    def __init__(self, like: ColwiseParallel | RowwiseParallel) -> None:
        super().__init__()
        self.columnwise = isinstance(like, ColwiseParallel)
        self.input_layout, self.output_layout = like.input_layouts[0], like.output_layouts[0]
        self.use_local_output = like.use_local_output
        self.desired_input = Replicate() if self.columnwise else Shard(-1)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._split, self._prepare_input, self._prepare_output)

    def _split(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        if name:  # distribute_module visits every submodule: the adapters are placed with their layer
            return
        rows, whole = Shard(0), Replicate()
        placed = {"weight": rows, "bias": rows, "lora_A.weight": whole, "lora_B.weight": rows}
        if not self.columnwise:
            placed = {"weight": Shard(1), "bias": whole, "lora_A.weight": Shard(1), "lora_B.weight": whole}
        for path, placement in placed.items():
            owner_name, _, leaf = path.rpartition(".")
            owner = module.get_submodule(owner_name)
            param = owner._parameters.get(leaf)
            if param is not None:
                split = distribute_tensor(param, device_mesh, [placement])
                owner.register_parameter(leaf, nn.Parameter(split, requires_grad=param.requires_grad))

    def _prepare_input(self, module: nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> tuple:
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, device_mesh, [self.input_layout], run_check=False)
        if x.placements != (self.desired_input,):
            x = x.redistribute(placements=[self.desired_input])
        return (x, *inputs[1:])

    def _prepare_output(self, module: nn.Module, output: DTensor, device_mesh: DeviceMesh):
        if output.placements != (self.output_layout,):
            output = output.redistribute(placements=[self.output_layout])
        return output.to_local() if self.use_local_output else output


def with_adapters(plan: dict, model: nn.Module) -> dict:
    """``plan`` with each column- or row-wise entry whose layers LoRA adapted (model.lora.target_modules) split by
    SplitAdaptedLinear instead."""
    from shardlab_tasks.lm.models.lora import LoRALinear

    adapted = [name.split(".") for name, module in model.named_modules() if isinstance(module, LoRALinear)]

    def names_adapted(path: str) -> bool:  # parallelize_module's matching: each dotted atom against its pattern
        atoms = path.split(".")
        return any(len(n) == len(atoms) and all(map(fnmatch.fnmatchcase, n, atoms)) for n in adapted)

    splits = (ColwiseParallel, RowwiseParallel)
    return {
        path: SplitAdaptedLinear(style) if isinstance(style, splits) and names_adapted(path) else style
        for path, style in plan.items()
    }


class FusedQKVColwise(ColwiseParallel):
    """GPT's fused qkv projection (rows: every head's queries, then keys, then values) split column-wise by contiguous
    rows, as ColwiseParallel splits it, then its output regrouped by heads: rank r gets the queries, keys and values of
    heads r*H/T .. (r+1)*H/T - 1 from whichever ranks computed them, in one all-to-all (its backward is the reverse
    all-to-all). The weight keeps its layout, so checkpoints and exports are one process's."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)  # weight and bias Shard(0), output local
        module.register_forward_hook(lambda mod, args, out: regroup_by_heads(out, self.dim, device_mesh))
        return module


def regroup_by_heads(local: torch.Tensor, dim: int, device_mesh: DeviceMesh) -> torch.Tensor:
    """(..., 3 dim / T) columns r*3dim/T .. of the fused output -> (..., 3 dim / T) as [q, k, v] of rank r's heads."""
    ranks, rank = device_mesh.size(), device_mesh.get_local_rank()
    if ranks == 1:
        return local
    order, sends, receives = head_exchange(local.shape[-1], dim, ranks, rank)
    columns_first = local.movedim(-1, 0).index_select(0, order.to(local.device)).contiguous()
    out = AllToAll.apply(columns_first, list(receives), list(sends), device_mesh.get_group())
    return out.movedim(0, -1)


@functools.cache
def head_exchange(width: int, dim: int, ranks: int, rank: int) -> tuple[torch.Tensor, tuple, tuple]:
    """Which of rank ``rank``'s ``width`` fused-output columns go to which rank: (its columns ordered by the rank whose
    heads they feed, how many it sends each rank, how many it receives from each). Received in source order, the
    columns come in global order: the queries, keys and values of its own heads."""

    def owner(columns: torch.Tensor) -> torch.Tensor:  # the rank whose heads each global column feeds
        return (columns % dim) // (dim // ranks)

    mine = owner(torch.arange(rank * width, (rank + 1) * width))
    sends = tuple(torch.bincount(mine, minlength=ranks).tolist())
    receives = tuple(int((owner(torch.arange(s * width, (s + 1) * width)) == rank).sum()) for s in range(ranks))
    return torch.argsort(mine, stable=True), sends, receives


class AllToAll(torch.autograd.Function):
    """torch.distributed.all_to_all_single along dimension 0 with its gradient: the reverse exchange (the sizes sent
    and received swapped)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, receives: list[int], sends: list[int], group) -> torch.Tensor:
        ctx.receives, ctx.sends, ctx.group = receives, sends, group
        out = tensor.new_empty((sum(receives), *tensor.shape[1:]))
        dist.all_to_all_single(out, tensor, receives, sends, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.sends), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.sends, ctx.receives, group=ctx.group)
        return back, None, None, None


def gpt_plan(dim: int) -> dict:
    """shardlab_tasks.lm.models.model.GPT: the token and position embeddings split by rows (the sum gathered whole, then
    handed on split by sequence), the fused qkv projection by FusedQKVColwise, the rest as the Llama plan."""
    return {
        "embed.tok": VocabularySplitEmbedding(output_layout=Replicate()),
        "embed.pos": VocabularySplitEmbedding(output_layout=Replicate()),
        "embed": PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True
        ),
        "blocks.*.ln_1": SequenceParallel(),
        "blocks.*.attn": PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None), use_local_output=True
        ),
        "blocks.*.attn.qkv": FusedQKVColwise(dim),
        "blocks.*.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
        "blocks.*.ln_2": SequenceParallel(),
        "blocks.*.mlp": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
        "blocks.*.mlp.fc": ColwiseParallel(),
        "blocks.*.mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
        "head.ln_f": SequenceParallel(),
        HEAD: ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
