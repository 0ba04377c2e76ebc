"""A Llama checkpoint saved before its model section gained keys (issue 40: head_dim, tie_embeddings, qkv_bias,
out_bias, qk_norm, rope_scaling, pretrained; LoRA's lora) still resumes and starts a run through init_from: the keys
it lacks count as their schema defaults, the old behaviour. A real difference, in an old key or a new one, is still
refused in one line naming it. GPT's old checkpoint (tests/data) lacks pretrained and lora the same way."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from shardlab.checkpoint import weights
from shardlab.cli.preflight import compose_config
from shardlab.distributed import env as dist_env
from shardlab.errors import IncompatibleCheckpointError
from shardlab.runner import run_rank

NEW_LLAMA_KEYS = ("head_dim", "tie_embeddings", "qkv_bias", "out_bias", "qk_norm", "rope_scaling", "pretrained", "lora")
"""The Llama keys added by issue 40's work: a checkpoint saved before holds none of them."""
OLD_GPT_CHECKPOINT = Path(__file__).parent.parent / "data" / "checkpoint_0b6f597" / "step_00000002"

RUN = [
    "model=llama_tiny", "model.num_layers=1", "model.dim=32", "model.num_heads=2", "model.num_kv_heads=1",
    "model.ffn_dim=64", "model.max_seq_len=32", "data.seq_len=32", "data.max_corpus_mb=1",
    "optimization.batch_size=4", "optimization.max_steps=4", "lr_scheduler.warmup_steps=1",
    "validation.interval_steps=0", "checkpoint.interval_steps=2", "checkpoint.keep_last=2", "logging.interval_steps=1",
    "logging.progress_bar=false", "logging.tensorboard=false",
]  # fmt: skip


def train_losses(result) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in result["history"] if r["split"] == "train"}


def strip_new_keys(step: Path) -> None:
    """``step``'s shardlab.json as an earlier shardlab wrote it: no new key in model_config nor config.model."""
    meta_file = step / "shardlab.json"
    meta = json.loads(meta_file.read_text())
    for section in (meta["model_config"], meta["config"]["model"]):
        for key in NEW_LLAMA_KEYS:
            section.pop(key)
    meta_file.write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def old_llama(corpus_cache, tmp_path_factory):
    """An uninterrupted 4-step Llama run, and its step 2 as an earlier shardlab would have saved it."""
    root = tmp_path_factory.mktemp("old_llama")
    cfg = compose_config([*RUN, f"data.cache_dir={corpus_cache}"])
    uninterrupted = run_rank(cfg, root / "fresh", dist_env.detect())
    old = root / "old" / "step_00000002"
    shutil.copytree(root / "fresh" / "checkpoints" / old.name, old)
    strip_new_keys(old)
    return cfg, uninterrupted, old


def test_an_old_llama_checkpoint_resumes_exactly(old_llama, tmp_path):
    cfg, uninterrupted, old = old_llama
    assert not set(NEW_LLAMA_KEYS) & set(weights.describe(old)["model_config"])
    run_dir = tmp_path / "run"
    shutil.copytree(old, run_dir / "checkpoints" / old.name)
    resumed = run_rank(cfg, run_dir, dist_env.detect())
    got, expected = train_losses(resumed), train_losses(uninterrupted)
    assert sorted(got) == [3, 4], "the old checkpoint's step 2 must be where the run continues"
    assert torch.equal(torch.tensor([got[3], got[4]]), torch.tensor([expected[3], expected[4]]))


def test_an_old_llama_checkpoint_starts_a_run_through_init_from(old_llama, corpus_cache, tmp_path):
    _, _, old = old_llama
    # A learning rate of 0 leaves the weights as loaded: after the one step they are the checkpoint's.
    cfg = compose_config([*RUN, f"data.cache_dir={corpus_cache}", "optimization.max_steps=1", "optimizer.lr=0.0",
                          f"checkpoint.init_from={old}"])  # fmt: skip

    def loaded(trainer) -> dict:
        return {"weights": {name: p.detach().clone() for name, p in trainer.model.state_dict().items()}}

    got = run_rank(cfg, tmp_path / "run", dist_env.detect(), after_fit=loaded)["weights"]
    saved = weights.read_full(old)
    assert sorted(got) == sorted(saved)
    for name, tensor in saved.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize(
    ("key", "value"),
    [("dim", 64), ("qkv_bias", True), ("tie_embeddings", True), ("qk_norm", True)],
)
def test_a_real_difference_from_an_old_llama_checkpoint_is_still_refused(old_llama, key, value):
    cfg, _, old = old_llama
    same = OmegaConf.to_container(cfg.model, resolve=True)
    weights.check_compatible(old, weights.describe(old), "lm", same)
    model_config = same | {key: value}
    with pytest.raises(IncompatibleCheckpointError, match=rf"model\.{key}=.* but this run has model\.{key}={value}"):
        weights.check_compatible(old, weights.describe(old), "lm", model_config)


def test_the_old_gpt_checkpoint_counts_its_missing_keys_as_defaults(corpus_cache):
    info = weights.describe(OLD_GPT_CHECKPOINT)
    assert not {"pretrained", "lora"} & set(info["model_config"])
    cfg = compose_config(["model.num_layers=1", "model.dim=32", "model.num_heads=2", "model.max_seq_len=32",
                          f"data.cache_dir={corpus_cache}"])  # fmt: skip
    model_config = OmegaConf.to_container(cfg.model, resolve=True)
    weights.check_compatible(OLD_GPT_CHECKPOINT, info, "lm", model_config)
    with pytest.raises(IncompatibleCheckpointError, match=r"model\.pretrained=None but this run has model\.pretrained"):
        weights.check_compatible(OLD_GPT_CHECKPOINT, info, "lm", model_config | {"pretrained": "/some/hf-folder"})
