"""A checkpoint sharded over 2 fully_sharded ranks reads back whole in one process and exports to GPT-2."""

from __future__ import annotations

import json

import torch

from shardlab.checkpoint.weights import read_full
from tests.distributed.harness import run_spawned
from tools import export_hf, generate


def test_sharded_checkpoint_reads_whole_and_exports(tiny_lm, tmp_path):
    cfg = tiny_lm(
        "distributed.backend=fully_sharded",
        "model.tie_embeddings=false",
        "optimization.max_steps=2",
        "checkpoint.interval_steps=2",
        "validation.interval_steps=2",
    )
    run_spawned([cfg], world_size=2, run_dirs=[tmp_path])
    checkpoint = tmp_path / "checkpoints" / "step_00000002"

    state = read_full(checkpoint)
    model, _, _ = generate.load_model(checkpoint)  # DCP's own resharding load into one process: the reference
    expected = model.state_dict()
    assert sorted(state) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name

    out = export_hf.main([str(checkpoint), "--out", str(tmp_path / "hf")])
    config = json.loads((out / "config.json").read_text())
    assert (config["n_layer"], config["n_embd"], config["tie_word_embeddings"]) == (2, 64, False)
