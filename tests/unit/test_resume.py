"""A run that dies and is restarted with checkpoint.resume=auto ends exactly where an uninterrupted run ends."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from shardlab.distributed import env as dist_env
from shardlab.errors import CheckpointError
from shardlab.runner import run_rank

CKPT = [
    "optimization.max_steps=12",
    "checkpoint.interval_steps=4",
    "checkpoint.keep_last=2",
    "validation.interval_steps=0",
]


def train_losses(result) -> torch.Tensor:
    return torch.tensor([r["loss"] for r in result["history"] if r["split"] == "train"], dtype=torch.float64)


@pytest.fixture(scope="module")
def uninterrupted(tiny_lm, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    return run_dir, run_rank(tiny_lm(*CKPT), run_dir, dist_env.detect())


def test_crashed_run_resumes_bit_exactly(tiny_lm, tmp_path, crash_lm_loss_at, uninterrupted):
    _, reference = uninterrupted
    restore_loss = crash_lm_loss_at(7)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_rank(tiny_lm(*CKPT), tmp_path, dist_env.detect())
    restore_loss()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000004"]

    resumed = run_rank(tiny_lm(*CKPT, "checkpoint.resume=auto"), tmp_path, dist_env.detect())
    steps = [r["step"] for r in resumed["history"] if r["split"] == "train"]
    assert steps == list(range(5, 13))
    assert torch.equal(train_losses(resumed), train_losses(reference)[4:])
    assert resumed["final"] == reference["final"]


def test_only_the_newest_checkpoints_are_kept_and_hold_the_data_position(uninterrupted):
    run_dir, _ = uninterrupted
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert kept == ["step_00000008", "step_00000012"]
    meta = json.loads((run_dir / "checkpoints" / "step_00000012" / "shardlab.json").read_text())
    assert meta["step"] == 12 and meta["samples_seen"] == 12 * 8


def test_a_half_written_checkpoint_is_ignored(tiny_lm, tmp_path, uninterrupted):
    run_dir, _ = uninterrupted
    shutil.copytree(run_dir / "checkpoints" / "step_00000008", tmp_path / "checkpoints" / "step_00000008")
    (tmp_path / "checkpoints" / "step_00000012.tmp").mkdir()  # killed mid-save: never renamed, no shardlab.json
    resumed = run_rank(tiny_lm(*CKPT), tmp_path, dist_env.detect())
    assert [r["step"] for r in resumed["history"] if r["split"] == "train"][0] == 9


def test_corrupt_checkpoint_is_reported_with_its_path(tiny_lm, tmp_path, uninterrupted):
    run_dir, _ = uninterrupted
    ckpt = tmp_path / "checkpoints" / "step_00000012"
    shutil.copytree(run_dir / "checkpoints" / "step_00000012", ckpt)
    for shard in ckpt.glob("*.distcp"):
        shard.write_bytes(b"garbage")
    # Found before the load: the index places entries past the garbage's 7 bytes.
    cut_short = f"{ckpt / '__0_0.distcp'} holds 7 bytes but its index needs [0-9]+ \\(a write cut short\\)\\);"
    with pytest.raises(CheckpointError, match=f"checkpoint {ckpt} could not be loaded \\(CheckpointError: {cut_short}"):
        run_rank(tiny_lm(*CKPT), tmp_path, dist_env.detect())


def test_checkpoint_of_another_model_is_refused_naming_the_key(tiny_lm, tmp_path, uninterrupted):
    run_dir, _ = uninterrupted
    ckpt = run_dir / "checkpoints" / "step_00000012"
    with pytest.raises(CheckpointError, match=r"saved with model.dim=64 but this run has model.dim=32"):
        run_rank(tiny_lm(*CKPT, "model.dim=32", f"checkpoint.resume={ckpt}"), tmp_path, dist_env.detect())


def test_skipped_step_count_survives_resume(tiny_lm, tmp_path, monkeypatch):
    from shardlab.distributed.base import Backend

    clip, calls = Backend.clip_grad_norm, {"n": 0}

    def non_finite_at_step_2(self, model, max_norm):
        calls["n"] += 1
        return torch.tensor(float("inf")) if calls["n"] == 2 else clip(self, model, max_norm)

    monkeypatch.setattr(Backend, "clip_grad_norm", non_finite_at_step_2)
    first = run_rank(tiny_lm("optimization.max_steps=4", "checkpoint.interval_steps=4"), tmp_path, dist_env.detect())
    assert [r["skipped_steps"] for r in first["history"] if r["split"] == "train"] == [0, 1, 1, 1]
    monkeypatch.setattr(Backend, "clip_grad_norm", clip)
    resumed = run_rank(tiny_lm("optimization.max_steps=6"), tmp_path, dist_env.detect())
    assert [r["skipped_steps"] for r in resumed["history"] if r["split"] == "train"] == [1, 1]
