"""Checkpoints written by earlier shardlab versions still resume, and continue the run they came from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from shardlab.cli.preflight import compose_config
from shardlab.config import OptimizerConfig
from shardlab.distributed import env as dist_env
from shardlab.runner import run_rank
from shardlab_commands import evaluate, generate

OLD_CHECKPOINT = Path(__file__).parent.parent / "data" / "checkpoint_0b6f597" / "step_00000002"
OLD_RUN = [
    "model.num_layers=1",
    "model.dim=32",
    "model.num_heads=2",
    "model.max_seq_len=32",
    "data.seq_len=32",
    "data.max_corpus_mb=1",
    "optimization.batch_size=4",
    "optimization.max_steps=4",
    "lr_scheduler.warmup_steps=1",
    "validation.interval_steps=0",
    "validation.num_batches=1",
    "validation.batch_size=4",
    "checkpoint.interval_steps=2",
    "checkpoint.keep_last=2",
    "logging.interval_steps=1",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
]


def train_losses(result) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in result["history"] if r["split"] == "train"}


def test_checkpoint_written_before_the_package_layout_resumes_exactly(corpus_cache, tmp_path):
    cfg = compose_config([*OLD_RUN, f"data.cache_dir={corpus_cache}"])
    uninterrupted = run_rank(cfg, tmp_path / "fresh", dist_env.detect())

    run_dir = tmp_path / "old"
    shutil.copytree(OLD_CHECKPOINT, run_dir / "checkpoints" / OLD_CHECKPOINT.name)
    resumed = run_rank(cfg, run_dir, dist_env.detect())

    expected = train_losses(uninterrupted)
    got = train_losses(resumed)
    assert sorted(got) == [3, 4], "the old checkpoint's step 2 must be where the run continues"
    assert torch.equal(torch.tensor([got[3], got[4]]), torch.tensor([expected[3], expected[4]]))
    assert resumed["final"] == uninterrupted["final"]


def test_the_tools_read_an_old_checkpoint_whose_config_lacks_keys_added_since(corpus_cache, tmp_path):
    """Its recorded config predates optimizer.trust_coefficient (and other keys): the tools fill them with today's
    defaults, and the weights they load are the ones the resumed run starts from."""
    recorded = json.loads((OLD_CHECKPOINT / "shardlab.json").read_text())["config"]
    assert "trust_coefficient" not in recorded["optimizer"]
    model, _, cfg = generate.load_model(OLD_CHECKPOINT)
    assert cfg.optimizer.trust_coefficient == OptimizerConfig().trust_coefficient
    assert cfg.optimizer.lr == recorded["optimizer"]["lr"]  # what it holds is kept
    text = generate.main([str(OLD_CHECKPOINT), "--max-new-tokens", "4", "--top-k", "0"])
    assert text.startswith("def ")
    result = evaluate.main([str(OLD_CHECKPOINT), f"data.cache_dir={corpus_cache}"])
    assert result["ppl"] > 1 and result["tokens"] > 0

    def first_weights(trainer) -> dict:
        return {"embed": trainer.model.embed.tok.weight.detach().clone()}

    run_dir = tmp_path / "old"
    shutil.copytree(OLD_CHECKPOINT, run_dir / "checkpoints" / OLD_CHECKPOINT.name)
    cfg = compose_config([*OLD_RUN, f"data.cache_dir={corpus_cache}", "optimization.max_steps=2"])
    resumed = run_rank(cfg, run_dir, dist_env.detect(), after_fit=first_weights)
    assert torch.equal(model.embed.tok.weight, resumed["embed"])
