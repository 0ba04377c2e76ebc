"""The Llama family's tensor-parallel plan (shardlab_tasks/lm/models/tensor_parallel.py) applied by
shardlab.distributed. tensor_parallel on a one-rank mesh: every parameter of every option (GQA, biases, q/k norms, tied
embeddings) is placed, a tied weight stays one parameter, and a frozen one stays frozen."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from shardlab.distributed.tensor_parallel import apply_tensor_parallel
from shardlab_tasks.lm.config import LlamaConfig
from shardlab_tasks.lm.models.llama import Llama

OPTIONS = {
    "llama3": {},
    "qwen2": {"qkv_bias": True, "tie_embeddings": True},
    "qwen3": {"qk_norm": True, "head_dim": 32},
}


@pytest.fixture
def tp_mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def tiny(**options) -> Llama:
    cfg = OmegaConf.structured(
        LlamaConfig(num_layers=2, dim=64, num_heads=4, num_kv_heads=2, max_seq_len=32, **options)
    )
    with torch.device("meta"):
        return Llama(cfg, 128)


@pytest.mark.parametrize("family", OPTIONS)
def test_every_parameter_is_placed_and_a_tied_weight_stays_one(family, tp_mesh):
    model = tiny(**OPTIONS[family])
    model.embed.weight.requires_grad_(False)
    apply_tensor_parallel(model, model.tensor_parallel_plan(), tp_mesh)
    unplaced = [name for name, p in model.named_parameters(remove_duplicate=False) if not isinstance(p, DTensor)]
    assert unplaced == []
    assert (model.head.out.weight is model.embed.weight) == bool(OPTIONS[family].get("tie_embeddings"))
    assert not model.embed.weight.requires_grad and model.blocks[0].attn.q.weight.requires_grad


def test_a_plan_that_places_a_tied_weight_two_ways_is_refused(tp_mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel

    model = tiny(tie_embeddings=True)  # column-wise, an embedding splits its dim (1), a linear its outputs (0)
    with pytest.raises(ValueError, match=r"places the tied weight weight differently .*Shard\(dim=1\).*Shard\(dim=0\)"):
        apply_tensor_parallel(model, {"embed": ColwiseParallel(), "head.out": ColwiseParallel()}, tp_mesh)


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_gpts_fused_qkv_columns_reach_the_rank_of_their_head(ranks):
    """Rank s holds the fused output's columns s*3d/T .. (s+1)*3d/T (contiguous rows of the qkv weight); after the
    exchange head_exchange plans, rank r holds the queries, then keys, then values of its own heads, in order."""
    from shardlab_tasks.lm.models.tensor_parallel import head_exchange

    dim = 12
    width = 3 * dim // ranks
    sent = {}  # (source, destination) -> the global columns sent
    for s in range(ranks):
        order, sends, receives = head_exchange(width, dim, ranks, s)
        ordered = torch.arange(s * width, (s + 1) * width)[order]
        for r, chunk in enumerate(ordered.split(list(sends))):
            sent[s, r] = chunk
    for r in range(ranks):
        _, _, receives = head_exchange(width, dim, ranks, r)
        assert list(receives) == [len(sent[s, r]) for s in range(ranks)]
        got = torch.cat([sent[s, r] for s in range(ranks)])
        heads = dim // ranks
        expected = torch.cat([torch.arange(p * dim + r * heads, p * dim + (r + 1) * heads) for p in range(3)])
        assert torch.equal(got, expected), (r, got, expected)


@pytest.mark.parametrize("tied", [True, False])
def test_every_gpt_parameter_is_placed(tied, tp_mesh):
    from shardlab_tasks.lm.config import GPTConfig
    from shardlab_tasks.lm.models.model import GPT

    cfg = OmegaConf.structured(GPTConfig(num_layers=2, dim=64, num_heads=4, max_seq_len=32, tie_embeddings=tied))
    with torch.device("meta"):
        model = GPT(cfg, 128)
    apply_tensor_parallel(model, model.tensor_parallel_plan(), tp_mesh)
    assert [n for n, p in model.named_parameters(remove_duplicate=False) if not isinstance(p, DTensor)] == []
    assert (model.head.out.weight is model.embed.tok.weight) == tied


@pytest.mark.parametrize("rank", [0, 1])
def test_a_vocabulary_split_embedding_looks_up_its_rows_and_its_backward_writes_only_them(rank):
    """Rank ``rank`` of 2 (torch's fake process group: collectives answer without communicating, so the test reads
    the rank's own partial sums): the tokens in its half of the vocabulary get their rows, the others zeros, and the
    backward's gradient is the rank's 32 rows, where torch's RowwiseParallel computes all 64
    (tests/unit/test_torch_internals.py)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Partial, Replicate, Shard

    from shardlab.memory.fake_group import fake_process_group
    from shardlab_tasks.lm.models.tensor_parallel import VocabularySplitEmbedding

    whole = torch.nn.Embedding(64, 8)
    tokens = torch.tensor([[3, 40, 31, 32, 63, 0]])
    lookups = []
    with fake_process_group(2, rank):
        mesh = DeviceMesh("cpu", [0, 1])
        split = VocabularySplitEmbedding(Replicate())._apply(torch.nn.Embedding(64, 8), mesh)
        split.weight.to_local().data.copy_(whole.weight.data[32 * rank : 32 * (rank + 1)])
        original = DTensor.redistribute

        def partial_sums(self, *args, **kwargs):  # the rank's own sums, before the fake all-reduce
            if self.placements == (Partial(),):
                lookups.append(self.to_local().detach().clone())
            return original(self, *args, **kwargs)

        DTensor.redistribute = partial_sums
        try:
            split(tokens).sum().backward()
        finally:
            DTensor.redistribute = original
    mine = (tokens >= 32 * rank) & (tokens < 32 * (rank + 1))
    expected = torch.where(mine.unsqueeze(-1), whole(tokens), torch.zeros(()))
    torch.testing.assert_close(lookups[0], expected.detach())
    assert split.weight.grad.placements == (Shard(0),) and split.weight.grad.to_local().shape == (32, 8)
