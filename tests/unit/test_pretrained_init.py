"""model.pretrained skips the seeded init of the weights its folder fills (Task.pretrained_keys): the trainer draws
only what the folder does not hold (LoRA adapters), and ends with the weights the full init followed by the load
gives. The 2-rank fully_sharded start is tests/distributed/test_hf_pretrained.py (logits equal transformers')."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardlab.distributed.materialize import materialize
from shardlab.distributed.units import model_on_meta
from shardlab.runner import build_task
from shardlab_tasks.lm.models.lora import is_adapter
from tests.hf_folders import make_folder
from tests.pretrained_starts import full_init_then_load, recording, started

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.target_modules=[attn.q,mlp.down]"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_folder("llama3_tied", tmp_path_factory.mktemp("hf") / "llama3_tied")


def test_materialize_draws_every_name_it_is_not_told_a_file_fills(tiny_lm):
    task = build_task(tiny_lm("model=llama_tiny"), world_size=1)
    full = model_on_meta(task)
    materialize(full, torch.device("cpu"), task.init_tensor, seed=3)
    drawn = recording(task)
    part = model_on_meta(task)
    filled = {"embed.weight", "blocks.0.attn.q.weight"}
    materialize(part, torch.device("cpu"), task.init_tensor, seed=3, loaded=filled.__contains__)
    names = [n for n, _ in full.named_parameters()]
    assert sorted(drawn) == sorted(n for n in names if n not in filled)
    for name, value in part.named_parameters():  # one generator per name: skipping some leaves the rest as today
        if name not in filled:
            assert torch.equal(value, dict(full.named_parameters())[name]), name


@pytest.mark.parametrize("lora", [[], LORA], ids=["full", "lora"])
def test_a_pretrained_run_draws_only_what_its_folder_lacks_and_starts_with_todays_weights(
    tiny_lm, folder, tmp_path, lora
):
    cfg = tiny_lm(f"model.pretrained={folder}", "data.seq_len=32", *lora)
    start = started(cfg, tmp_path)
    assert start.initialized_from == start.task.pretrained
    assert sorted(start.drawn) == sorted(n for n in start.state if is_adapter(n))  # the adapters: seeded, as before
    assert bool(lora) == bool(start.drawn)
    expected = full_init_then_load(cfg)
    assert start.state.keys() == expected.keys()
    for name, value in start.state.items():
        assert torch.equal(value, expected[name]), name


def test_a_backend_auto_trial_draws_every_weight_since_it_reads_no_folder(tiny_lm, folder, tmp_path):
    cfg = tiny_lm(f"model.pretrained={folder}", "data.seq_len=32", *LORA)
    start = started(cfg, tmp_path, trial=True)
    assert start.initialized_from is None and sorted(start.drawn) == sorted(start.parameters)
    planning = build_task(tiny_lm(f"model.pretrained={folder}", "data.seq_len=32", "dry_run=true"), world_size=1)
    assert planning.pretrained_keys() is None and start.task.pretrained_keys() is not None
