"""A checkpoint sharded over 2 fully_sharded ranks reads back whole in one process and exports to GPT-2; every family
loaded from a Hugging Face folder and fine-tuned on 2 fully_sharded ranks exports as shards that transformers loads
with shardlab's logits."""

from __future__ import annotations

import json

import pytest
import torch

from shardlab.checkpoint.weights import read_full
from shardlab_commands import export_hf, generate
from tests.distributed.harness import run_spawned
from tests.hf_folders import FAMILIES, make_folder


def test_sharded_checkpoint_reads_whole_and_exports(tiny_lm, tmp_path):
    cfg = tiny_lm(
        "distributed.backend=fully_sharded",
        "model.tie_embeddings=false",
        "optimization.max_steps=2",
        "checkpoint.interval_steps=2",
        "validation.interval_steps=2",
    )
    run_spawned([cfg], world_size=2, run_dirs=[tmp_path / "run"])
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000002"

    state = read_full(checkpoint)
    model, _, _ = generate.load_model(checkpoint)  # DCP's own resharding load into one process: the reference
    expected = model.state_dict()
    assert sorted(state) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name

    out = export_hf.main([str(checkpoint), "--out", str(tmp_path / "hf")])
    config = json.loads((out / "config.json").read_text())
    assert (config["n_layer"], config["n_embd"], config["tie_word_embeddings"]) == (2, 64, False)


def test_every_family_fine_tuned_on_two_sharded_ranks_exports_shards_transformers_reads_as_shardlab(tiny_lm, tmp_path):
    transformers = pytest.importorskip("transformers")
    folders = {family: make_folder(family, tmp_path / family) for family in FAMILIES}
    steps = ["optimization.max_steps=3", "checkpoint.interval_steps=3", "validation.interval_steps=3"]
    cfgs = [
        tiny_lm("distributed=fully_sharded", "distributed.world_size=2", *steps, f"model.pretrained={folder}")
        for folder in folders.values()
    ]
    run_dirs = [tmp_path / f"run_{family}" for family in folders]
    run_spawned(cfgs, 2, run_dirs=run_dirs)
    tokens = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(0))
    for family, run_dir in zip(folders, run_dirs, strict=True):
        checkpoint = run_dir / "checkpoints" / "step_00000003"
        out = export_hf.main([str(checkpoint), "--out", str(tmp_path / f"hf_{family}"), "--max-shard-mb", "0.05"])
        assert len(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]) > 0
        assert len(list(out.glob("model-*.safetensors"))) >= 2, family
        ours, _, _ = generate.load_model(checkpoint)
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        source = transformers.AutoModelForCausalLM.from_pretrained(folders[family], dtype=torch.float32).eval()
        assert type(hf) is type(source), family
        with torch.no_grad():
            theirs, mine, before = hf(tokens).logits, ours(tokens), source(tokens).logits
        torch.testing.assert_close(theirs, mine, rtol=1e-4, atol=1e-5, msg=family)
        assert (theirs - before).abs().max() > 1e-3, family  # the fine-tuning changed the model that was exported
