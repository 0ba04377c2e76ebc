"""Context parallelism's pieces that run without CUDA attention (shardlab/distributed/context_parallel.py,
shardlab_tasks/lm/models/context_parallel.py): the load balancer's positions, the FSDP mesh over dp_shard x cp on the
fake process group (torch's flatten and the public fallback alike), and the LM models at the positions a context rank
holds. Sharding by torch's context_parallel over real ranks: tests/distributed/test_context_parallel.py."""

from __future__ import annotations

import pytest
import torch

from shardlab.distributed import torch_internals
from shardlab.distributed.context_parallel import data_mesh_with_context, head_tail_positions
from shardlab.distributed.mesh import ParallelDims
from shardlab.memory.verify import fake_process_group


def test_head_tail_positions_partition_the_sequence_with_equal_causal_work():
    """cp 4 over 16 positions: rank r holds chunks r and 7 - r of 8; together every position once, and each rank's
    queries attend to the same number of keys (causal: position p to p + 1 keys)."""
    held = [head_tail_positions(16, 4, rank) for rank in range(4)]
    assert held[0] == [0, 1, 14, 15] and held[3] == [6, 7, 8, 9]
    assert sorted(p for positions in held for p in positions) == list(range(16))
    assert {sum(p + 1 for p in positions) for positions in held} == {34}


@pytest.mark.parametrize("flatten", [True, False])
@pytest.mark.parametrize(
    ("dims", "rank", "names", "ranks"),
    [
        (ParallelDims(cp=2), 1, ("dp_shard_cp",), [0, 1]),
        (ParallelDims(dp_shard=2, cp=2, tp=2), 5, ("dp_shard_cp",), [1, 3, 5, 7]),
        (ParallelDims(dp_replicate=2, cp=2, tp=2), 5, ("dp_replicate", "dp_shard_cp"), [[1, 3], [5, 7]]),
    ],
)
def test_fsdp_shards_over_the_data_shard_and_context_ranks(flatten, dims, rank, names, ranks, monkeypatch):
    """The mesh FSDP2 gets under context parallelism: dp_shard x cp as one dimension (replicated over dp_replicate),
    the same ranks whether torch's private flatten or the public fallback built it."""
    if not flatten:
        monkeypatch.setattr(torch_internals, "flatten_mesh", lambda mesh, name: None)
    with fake_process_group(dims.world_size, rank):
        mesh = data_mesh_with_context(dims.build("cpu", keep=("dp_shard",)), "cpu")
        assert mesh.mesh_dim_names == names and mesh.mesh.tolist() == ranks


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_the_models_read_tokens_in_load_balanced_order_at_their_true_positions(arch, monkeypatch):
    """What the ring computes, emulated in one process: the sequence in the head-tail order of its cp 2 ranks, each
    token given its true position, attention causal by true position (the ring's rule). Put back in order, the logits
    are the model's over the ordered sequence: the models embed and rotate each token where it belongs."""
    import torch.nn.functional as F
    from omegaconf import OmegaConf

    from shardlab_tasks.lm.config import GPTConfig, LlamaConfig
    from shardlab_tasks.lm.models.llama import Llama
    from shardlab_tasks.lm.models.model import GPT

    torch.manual_seed(0)
    if arch == "gpt":
        model = GPT(OmegaConf.structured(GPTConfig(num_layers=2, dim=16, num_heads=2, max_seq_len=16)), 32)
    else:
        cfg = LlamaConfig(num_layers=2, dim=16, num_heads=2, num_kv_heads=1, ffn_dim=32, max_seq_len=16)
        model = Llama(OmegaConf.structured(cfg), 32)
    idx = torch.randint(32, (2, 16))
    whole = model(idx)
    assert torch.equal(model(idx, positions=torch.arange(16)), whole)
    order = torch.tensor([p for rank in range(2) for p in head_tail_positions(16, 2, rank)])
    sdpa = F.scaled_dot_product_attention

    def causal_by_true_position(q, k, v, attn_mask=None, is_causal=False, **kwargs):
        assert attn_mask is None and is_causal  # the LM's pretraining attention: what the ring has a rule for
        return sdpa(q, k, v, attn_mask=order[None, :] <= order[:, None], **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", causal_by_true_position)
    balanced = model(idx[:, order], positions=order)
    torch.testing.assert_close(balanced[:, order.argsort()], whole, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(model(idx[:, order]), balanced, atol=1e-3)  # without the positions: other logits
