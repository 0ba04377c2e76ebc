"""The whole training path of context parallelism on 2 gloo ranks against one process, with only the attention kernel
stood in for: torch 2.14 has no CPU rule for its ring attention, so inside shardlab's context (torch's own
context_parallel, which shards the micro-batch) ``scaled_dot_product_attention`` is replaced by what the ring
computes: this rank's queries against every rank's keys and values (a differentiable all-gather over the "cp" group),
causal by true position. Everything else is the run's: the pre-flight's CPU refusal aside (a rank trusts it), the
trainer's micro-batch split (Trainer._sequence_split, Task.sequence_shards), the LM models at their positions, FSDP2
over dp_shard x cp flattened, the gradient average, the clipping norm, validation, and the loss and token sums.

10 steps of GPT and of Llama (GQA, RoPE): training and validation losses, gradient norms and tokens per step equal one
process's; a step folder written by either resumes on the other on the same curve. What this does not check is
torch's ring kernels themselves (tests/gpu/test_context_parallel_cuda.py).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from shardlab.distributed.context_parallel import head_tail_positions
from tests.distributed.harness import run_spawned
from tests.distributed.test_tensor_parallel import continued_losses, train_records

LLAMA = ["model=llama_tiny", "model.num_kv_heads=2", "model.ffn_dim=null"]
FS = ["distributed.backend=fully_sharded", "optimization.clip_norm=1.0"]
CP2 = ["distributed.context_parallel_degree=2"]
CKPT = ["checkpoint.interval_steps=5"]
LOSS_RTOL = 1e-5
"""Each rank's mean over its half of the tokens, averaged, against one mean over all: rounding only."""


class _AllKeys(torch.autograd.Function):
    """Every context rank's chunk of keys (or values), in rank order along the sequence; backward: the sum over the
    ranks of the gradient of this rank's chunk (one all-reduce: torch.distributed.nn's all_gather backward, through a
    list all_to_all, gave other gradients on gloo)."""

    @staticmethod
    def forward(ctx, chunk: torch.Tensor, group) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group = group
        chunks = [torch.empty_like(chunk) for _ in range(dist.get_world_size(group))]
        dist.all_gather(chunks, chunk.contiguous(), group=group)
        return torch.cat(chunks, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        rank, n = dist.get_rank(ctx.group), grad.shape[2] // dist.get_world_size(ctx.group)
        return grad[:, :, rank * n : (rank + 1) * n], None


def emulated_ring(cp_group, sdpa):
    """scaled_dot_product_attention as torch's load-balanced ring computes it on this rank's chunks (``sdpa``: torch's
    own function, computing the whole)."""
    import torch.distributed as dist

    cp, rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)

    def attention(q, k, v, attn_mask=None, is_causal=False, dropout_p=0.0, **kwargs):
        assert attn_mask is None and is_causal and dropout_p == 0.0  # what the ring has a rule for
        length = q.shape[2] * cp
        mine = torch.tensor(head_tail_positions(length, cp, rank))
        every = torch.tensor([p for r in range(cp) for p in head_tail_positions(length, cp, r)])
        keys, values = _AllKeys.apply(k, cp_group), _AllKeys.apply(v, cp_group)
        return sdpa(q, keys, values, attn_mask=every[None, :] <= mine[:, None], **kwargs)

    return attention


def install_emulated_ring() -> None:
    """Each rank's ``prepare``: shardlab's context as it is, with the attention torch would dispatch to its ring
    replaced by emulated_ring inside it."""
    import torch.nn.functional as F

    from shardlab.distributed import context_parallel as module

    original_context = module.sequence_sharded
    original_sdpa = F.scaled_dot_product_attention

    @contextlib.contextmanager
    def sequence_sharded(cp_mesh, buffers, seq_dims, rotate_method):
        with original_context(cp_mesh, buffers, seq_dims, rotate_method):
            torchs = F.scaled_dot_product_attention  # torch's dispatch to the ring, put back before torch restores
            F.scaled_dot_product_attention = emulated_ring(cp_mesh.get_group(), original_sdpa)
            try:
                yield
            finally:
                F.scaled_dot_product_attention = torchs

    module.sequence_sharded = sequence_sharded


def where_it_ran(trainer) -> dict:
    backend = trainer.backend
    return {"cp": backend.mesh["cp"].size(), "fsdp_mesh": list(backend.fsdp_mesh().mesh_dim_names or ())}


@pytest.fixture(scope="module")
def runs(tiny_lm, tmp_path_factory):
    """One process (Llama saving at step 5); CP 2 for GPT and Llama (saving at step 5), and CP 2 resuming the one
    process's step 5; then one process resuming CP 2's step 5."""
    one_dirs = [tmp_path_factory.mktemp(name) for name in ("gpt_one", "llama_one")]
    cfgs = {"gpt": tiny_lm(*FS), "llama": tiny_lm(*LLAMA, *FS, *CKPT)}
    reference = dict(zip(cfgs, run_spawned(list(cfgs.values()), world_size=1, run_dirs=one_dirs), strict=True))
    cp_dirs = [tmp_path_factory.mktemp(name) for name in ("gpt_cp", "llama_cp", "cp_from_one")]
    cp = [
        tiny_lm(*FS, *CP2),
        tiny_lm(*LLAMA, *FS, *CKPT, *CP2),
        tiny_lm(*LLAMA, *FS, *CP2, f"checkpoint.resume={one_dirs[1] / 'checkpoints' / 'step_00000005'}"),
    ]
    split = run_spawned(cp, world_size=2, run_dirs=cp_dirs, inspect=where_it_ran, prepare=install_emulated_ring)
    results = dict(zip(("gpt", "llama", "cp_from_one"), split, strict=True))
    from_cp = f"checkpoint.resume={cp_dirs[1] / 'checkpoints' / 'step_00000005'}"
    (results["one_from_cp"],) = run_spawned([tiny_lm(*LLAMA, *FS, from_cp)], world_size=1)
    return reference, results


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_context_parallel_ranks_train_as_one_process(model, runs):
    reference, split = runs
    one, two = reference[model], split[model]
    assert two["cp"] == 2 and two["fsdp_mesh"] == ["dp_shard_cp"], two
    assert len(train_records(two, "loss")) == 10
    torch.testing.assert_close(train_records(two, "loss"), train_records(one, "loss"), rtol=LOSS_RTOL, atol=0)
    torch.testing.assert_close(train_records(two, "gnorm"), train_records(one, "gnorm"), rtol=1e-5, atol=0)
    tokens = [train_records(r, "tokens_per_s") * train_records(r, "ms_per_step") / 1000 for r in (two, one)]
    torch.testing.assert_close(*tokens, rtol=1e-6, atol=0)  # each token counted once, not once per context rank
    valid = [torch.tensor([r["loss"] for r in res["history"] if r["split"] == "valid"]) for res in (two, one)]
    torch.testing.assert_close(*valid, rtol=LOSS_RTOL, atol=0)


@pytest.mark.parametrize("name", ["cp_from_one", "one_from_cp"])
def test_checkpoints_move_between_one_process_and_context_parallel_ranks(name, runs):
    """DCP reshards a step folder between FSDP over one rank and over dp_shard x cp: the resumed run continues the
    uninterrupted one-process curve."""
    reference, results = runs
    torch.testing.assert_close(*continued_losses(results[name], reference["llama"]), rtol=LOSS_RTOL, atol=0)
