"""model.pretrained on 2 fully_sharded ranks (CPU, gloo): every family, read slice by slice into the FSDP2 shards by
the trainer's own start, computes transformers' logits and first-step loss; a resume continues its own checkpoint.
The other layouts the loader serves, each one rank start for the families that read the most unusual ways: 2 DDP
ranks (whole tensors on every rank) and hybrid sharding on 4 ranks (2 replicas of 2 shards: a 2-D mesh whose
placements are (Replicate, Shard))."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from shardlab.data import GlobalOrder
from tests.distributed.harness import run_spawned
from tests.hf_folders import FAMILIES, make_folder, reference

BATCH = 8
COMMON = [
    "optimization.max_steps=1", "optimizer.lr=1e-30", "lr_scheduler.warmup_steps=0", f"optimization.batch_size={BATCH}"
]  # fmt: skip
"""One step that leaves every weight as read (optimizer.lr=1e-30: w - 1e-30 rounds to w), so the logits after fit
are the loaded model's; the first step's loss is computed before the update in any case."""
LAYOUT_FAMILIES = ("llama3_tied", "gpt2")
"""Tied embeddings (one parameter under two checkpoint names, read once) and GPT-2's Conv1D weights (stored (in, out),
read transposed into the local shard)."""


def _wrapper(model: torch.nn.Module) -> str:
    """What the backend wrapped the model in: "ddp", "fsdp", or else its class."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return "ddp"
    return "fsdp" if isinstance(model, torch.distributed.fsdp.FSDPModule) else type(model).__name__


def inspect(trainer) -> dict:
    """What rank 0 computes after fit: logits of the loaded model on a fixed batch, the first global batch (as the
    trainer drew it), where the run's weights came from, and how they are laid out (the wrapper's type and a
    parameter's DTensor placements)."""
    task, cfg = trainer.task, trainer.cfg
    order = GlobalOrder(len(task.train_dataset), cfg.seed, shuffle=True)
    first_batch = torch.stack([task.train_dataset[i] for i in order.indices(0, cfg.optimization.batch_size)])
    tokens = torch.randint(0, 257, (2, cfg.data.seq_len + 1), generator=torch.Generator().manual_seed(1))
    param = next(trainer.model.parameters())  # before the forward, which leaves the root's parameters gathered
    placements = [str(p) for p in getattr(param, "placements", ())]
    with torch.no_grad():
        logits = trainer.model(tokens[:, :-1])
    return {
        "layout": (_wrapper(trainer.model), placements),
        "tokens": tokens,
        "logits": logits,
        "first_batch": first_batch,
        "resumed_from": str(trainer.resumed_from) if trainer.resumed_from else None,
        "initialized_from": str(trainer.initialized_from) if trainer.initialized_from else None,
    }


def assert_computes_as_transformers(folder, result: dict, family: str) -> None:
    """The run loaded ``folder``, its model's logits equal transformers' fp32 model's (rtol 1e-4) and its first
    step's loss equals transformers' loss on the same batch."""
    logits, _ = reference(folder, result["tokens"])
    torch.testing.assert_close(result["logits"], logits, rtol=1e-4, atol=1e-5, msg=family)
    _, first_loss = reference(folder, result["first_batch"])
    train = [r for r in result["history"] if r["split"] == "train"]
    assert train[0]["step"] == 1 and result["initialized_from"] == str(folder)
    assert train[0]["loss"] == pytest.approx(first_loss.item(), rel=1e-5), family


def test_every_family_loads_into_two_sharded_ranks_as_transformers_computes_it(tiny_lm, tmp_path):
    folders = {family: make_folder(family, tmp_path / family) for family in FAMILIES}
    common = ["distributed=fully_sharded", "distributed.world_size=2", *COMMON]
    cfgs = [tiny_lm(*common, f"model.pretrained={folder}") for folder in folders.values()]
    # then a run of qwen3 that saves at step 2 and one that continues it: it resumes its checkpoint, not the folder
    resume = [*common[:2], "optimization.max_steps=2", "checkpoint.interval_steps=2", "lr_scheduler.warmup_steps=0"]
    resume += [f"model.pretrained={folders['qwen3']}"]
    cfgs += [tiny_lm(*resume), tiny_lm(*resume, "optimization.max_steps=3")]
    run_dirs = [tmp_path / f"run_{family}" for family in folders] + [tmp_path / "resumed"] * 2
    results = run_spawned(cfgs, 2, run_dirs=run_dirs, inspect=inspect)
    for family, result in zip(folders, results, strict=False):
        assert_computes_as_transformers(folders[family], result, family)
    started, resumed = results[-2:]
    assert started["initialized_from"] == str(folders["qwen3"]) and started["resumed_from"] is None
    assert resumed["initialized_from"] is None and resumed["resumed_from"].endswith("step_00000002")
    assert [r["step"] for r in resumed["history"] if r["split"] == "train"] == [3]
    assert OmegaConf.select(cfgs[-1], "model.pretrained")  # the folder is still named: the checkpoint won over it


@pytest.mark.parametrize(
    ("layout", "world", "wrapped"),
    [
        pytest.param(["distributed=ddp"], 2, ("ddp", []), id="ddp"),
        pytest.param(
            ["distributed=fully_sharded", "distributed.sharding_degree=2"], 4, ("fsdp", ["R", "S(0)"]), id="hybrid"
        ),
    ],
)
def test_pretrained_loads_on_ddp_and_hybrid_ranks_as_transformers_computes_it(
    tiny_lm, tmp_path, layout, world, wrapped
):
    folders = {family: make_folder(family, tmp_path / family) for family in LAYOUT_FAMILIES}
    layout = [*layout, f"distributed.world_size={world}", *COMMON]
    cfgs = [tiny_lm(*layout, f"model.pretrained={folder}") for folder in folders.values()]
    results = run_spawned(cfgs, world, run_dirs=[tmp_path / f"run_{family}" for family in folders], inspect=inspect)
    # rank 0's logits see its own replica's weights only; the first loss, averaged over every rank's part of the
    # global batch, sees the other replica's (ranks 2 and 3 reading wrong values fail it: tried)
    for family, result in zip(folders, results, strict=True):
        assert result["layout"] == wrapped, result["layout"]  # the layout asked for, not a fallback
        assert_computes_as_transformers(folders[family], result, family)
