"""The tensor-parallel plans of the LM architectures, as data (Megatron's layout, as torchtitan writes it for Llama):
each module path to the torch ParallelStyle that splits it over distributed.tensor_parallel_degree ranks.

Between blocks the residual stream is split by sequence (sequence parallelism: Shard(1)), so norms and the residual
adds run on a 1/tp slice of the tokens. Entering attention or the MLP it is all-gathered; q, k, v, gate and up are
column-wise (each rank computes its own heads, its own slice of the FFN width), o and down row-wise, their partial
sums reduce-scattered back onto the sequence. The embedding is split by vocabulary rows and hands on the sequence
slice; the head is column-wise over the vocabulary, its logits gathered whole, so the task's loss is unchanged. A tied
embedding and head share one weight split by vocabulary rows both ways. Qwen3's q/k norms are sequence-parallel over
the heads dimension (their weight's gradient is summed over the tensor-parallel ranks, each of which saw its heads).
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)


def llama_plan(qk_norm: bool) -> dict:
    """tasks.lm.llama.Llama (Llama 3.x, Qwen2 with biases, Qwen3 with q/k norms, Mistral): Block.forward takes
    (x, cos, sin, mask), so attention's prepared inputs are four, the rotary tables and mask left alone."""
    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
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
        "head.out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    if qk_norm:  # (batch, length, local heads, head_dim): the local heads are dimension 2's shard
        plan["blocks.*.attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["blocks.*.attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def divisibility_errors(degree: int, sizes: dict[str, int]) -> list[str]:
    """One line per size (key -> value) that ``degree`` tensor-parallel ranks cannot split evenly."""
    return [
        f"distributed.tensor_parallel_degree ({degree}) must divide {key} ({value}): each rank holds 1/{degree} of it"
        for key, value in sizes.items()
        if value % degree
    ]
