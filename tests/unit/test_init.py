"""Meta build + seeded init: identical everywhere, independent of wrapping, tied weights stay tied."""

from __future__ import annotations

import torch

from shardlab.distributed.materialize import materialize
from shardlab.runner import build_task
from tests.conftest import compose_config


def build(*overrides, seed: int = 7):
    task = build_task(compose_config(["model.num_layers=2", "model.dim=64", "model.num_heads=4", *overrides]), 1)
    with torch.device("meta"):
        model = task.build_model()
    materialize(model, torch.device("cpu"), task.init_tensor, seed=seed)
    return model


def test_materialize_is_deterministic_and_seeded():
    a, b, other_seed = build(), build(), build(seed=8)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(other_seed.blocks[0].attn.qkv.weight, a.blocks[0].attn.qkv.weight)


def test_tied_embeddings_stay_tied_after_materialize():
    model = build()
    assert model.head.out.weight is model.embed.tok.weight
    untied = build("model.tie_embeddings=false")
    assert untied.head.out.weight is not untied.embed.tok.weight


def test_init_follows_gpt2_rules():
    model = build()
    assert torch.equal(model.blocks[0].ln_1.weight, torch.ones(64))
    assert torch.equal(model.blocks[0].attn.qkv.bias, torch.zeros(192))
    std = model.blocks[0].mlp.fc.weight.std().item()
    proj_std = model.blocks[0].mlp.proj.weight.std().item()
    assert abs(std - 0.02) < 0.002 and abs(proj_std - 0.02 / 2) < 0.002  # scaled by 1/sqrt(2 * layers)
