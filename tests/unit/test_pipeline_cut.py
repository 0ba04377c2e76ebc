"""The model cut into pipeline stages (shardlab.distributed.pipeline): which layers each stage and each rank holds,
under which names, and that the stages run one after another compute what the whole model computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardlab.distributed.pipeline import layer_ranges, pruned, rank_stages
from shardlab.task import PipelineCut
from shardlab_tasks.lm.config import GPTConfig, LlamaConfig
from shardlab_tasks.lm.models.llama import Llama
from shardlab_tasks.lm.models.model import GPT

CUT = PipelineCut(layers="blocks", num_layers=5, first=("embed",), last=("head",))


def test_layers_split_as_evenly_as_the_count_allows_the_first_stages_taking_one_more():
    assert layer_ranges(5, 2) == [range(0, 3), range(3, 5)]
    assert layer_ranges(4, 4) == [range(i, i + 1) for i in range(4)]
    assert [len(r) for r in layer_ranges(10, 4)] == [3, 3, 2, 2]


def test_interleaved_stages_go_round_the_pipeline_ranks():
    assert rank_stages(0, 2, 2) == [0, 2]
    assert rank_stages(1, 2, 2) == [1, 3]
    assert rank_stages(1, 4, 1) == [1]


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_stages_in_order_compute_the_whole_model_under_its_own_names(arch):
    torch.manual_seed(0)
    if arch == "gpt":
        model = GPT(GPTConfig(num_layers=5, dim=32, num_heads=4, max_seq_len=16, tie_embeddings=False), 64)
    else:
        model = Llama(LlamaConfig(num_layers=5, dim=32, num_heads=4, num_kv_heads=2, ffn_dim=64, max_seq_len=16), 64)
    model.eval()
    ranges = layer_ranges(5, 3)
    stages = [pruned(model, CUT, r, first=i == 0, last=i == 2) for i, r in enumerate(ranges)]
    idx = torch.randint(0, 64, (2, 16))
    x = idx
    for stage in stages:
        x = stage(x)
    torch.testing.assert_close(x, model(idx), rtol=0, atol=0)
    full = model.state_dict()
    names = [set(stage.state_dict()) for stage in stages]
    assert set().union(*names) == set(full) and sum(map(len, names)) == len(full)  # every key once, unsplit names
    assert {".".join(k.split(".")[:2]) for k in names[1]} == {"blocks.2", "blocks.3"}
    assert isinstance(stages[1].embed, nn.Identity) and stages[2].blocks["4"] is model.blocks[4]  # shared, not copied
    assert model.embed is not None and len(model.blocks) == 5  # the model itself is untouched
