"""model.pretrained skips the seeded init of the weights its folder fills (Task.pretrained_keys): the trainer draws
only what the folder does not hold (LoRA adapters), and ends with the weights the full init followed by the load
gives. The 2-rank fully_sharded start is tests/distributed/test_hf_pretrained.py (logits equal transformers')."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardlab.distributed import env as dist_env
from shardlab.distributed.materialize import materialize
from shardlab.distributed.units import model_on_meta
from shardlab.registry import BACKENDS
from shardlab.runner import build_task, prepare_data, rank_task
from shardlab.trainer import assemble
from tasks.lm.lora import is_adapter
from tests.hf_folders import make_folder

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.target_modules=[attn.q,mlp.down]"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_folder("llama3_tied", tmp_path_factory.mktemp("hf") / "llama3_tied")


def recording(task) -> list[str]:
    """Names the task's init_tensor is asked to fill, in order (the instance's method is replaced)."""
    drawn: list[str] = []
    init = task.init_tensor

    def record(name, tensor, generator):
        drawn.append(name)
        init(name, tensor, generator)

    task.init_tensor = record
    return drawn


def todays_weights(cfg) -> dict[str, torch.Tensor]:
    """Every tensor drawn from (seed, name), then the folder read over the ones it holds: the start without the skip."""
    task = build_task(cfg, world_size=1)
    model = model_on_meta(task)
    materialize(model, torch.device("cpu"), task.init_tensor, cfg.seed)
    task.load_pretrained(model, torch.device("cpu"))
    return {n: t.detach() for n, t in model.state_dict().items()}


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
    task = rank_task(cfg)
    drawn = recording(task)
    backend = BACKENDS.build(cfg.distributed.backend, cfg.distributed, dist_env.detect(), key="distributed.backend")
    try:
        trainer = assemble(cfg, task, backend, tmp_path, prepare_data=lambda: prepare_data(task), trial=False)
        state = {n: t.detach() for n, t in trainer.model.state_dict().items()}
    finally:
        backend.teardown()
    assert trainer.initialized_from == task.pretrained
    assert sorted(drawn) == sorted(n for n in state if is_adapter(n))  # the adapters: seeded, as before
    assert bool(lora) == bool(drawn)
    expected = todays_weights(cfg)
    assert state.keys() == expected.keys()
    for name, value in state.items():
        assert torch.equal(value, expected[name]), name


def test_a_backend_auto_trial_draws_every_weight_since_it_reads_no_folder(tiny_lm, folder, tmp_path):
    cfg = tiny_lm(f"model.pretrained={folder}", "data.seq_len=32", *LORA)
    task = rank_task(cfg)
    drawn = recording(task)
    backend = BACKENDS.build(cfg.distributed.backend, cfg.distributed, dist_env.detect(), key="distributed.backend")
    try:
        trainer = assemble(cfg, task, backend, tmp_path, prepare_data=lambda: prepare_data(task), trial=True)
        names = [n for n, _ in trainer.model.named_parameters()]
    finally:
        backend.teardown()
    assert trainer.initialized_from is None and sorted(drawn) == sorted(names)
    planning = build_task(tiny_lm(f"model.pretrained={folder}", "data.seq_len=32", "dry_run=true"), world_size=1)
    assert planning.pretrained_keys() is None and task.pretrained_keys() is not None
