"""Checkpoints survive rollbacks, torn files and errors; async saving and consolidated weights change no number."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from shardlab.checkpoint import weights
from shardlab.distributed import env as dist_env
from shardlab.errors import CheckpointError
from shardlab.jobs import run_record
from shardlab.runner import run_rank
from shardlab_commands import consolidate

CKPT = [
    "optimization.max_steps=12",
    "checkpoint.interval_steps=4",
    "checkpoint.keep_last=3",
    "validation.interval_steps=0",
]


def train_losses(result, first_step: int = 1) -> torch.Tensor:
    return torch.tensor(
        [r["loss"] for r in result["history"] if r["split"] == "train" and r["step"] >= first_step],
        dtype=torch.float64,
    )


def names(root) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.fixture(scope="module")
def reference(tiny_lm, tmp_path_factory):
    """An uninterrupted run keeping steps 4, 8 and 12."""
    run_dir = tmp_path_factory.mktemp("reference")
    return run_dir, run_rank(tiny_lm(*CKPT), run_dir, dist_env.detect())


def copy_checkpoints(src_run, dst_run, *steps: int) -> None:
    for step in steps:
        name = f"step_{step:08d}"
        shutil.copytree(src_run / "checkpoints" / name, dst_run / "checkpoints" / name)


def test_rollback_keeps_the_new_line_and_sets_the_old_line_aside(tiny_lm, tmp_path, reference, capsys):
    ref_dir, ref = reference
    copy_checkpoints(ref_dir, tmp_path, 4, 8, 12)
    step4 = tmp_path / "checkpoints" / "step_00000004"
    capsys.readouterr()
    rolled = run_rank(
        tiny_lm(*CKPT, f"checkpoint.resume={step4}", "checkpoint.keep_last=2", "checkpoint.interval_steps=2"),
        tmp_path,
        dist_env.detect(),
    )
    out = capsys.readouterr().out
    assert torch.equal(train_losses(rolled), train_losses(ref, 5))
    # The new line's two newest (10, 12) are kept; its 6 and 8 and the resumed-from 4 are pruned; the old line's
    # 8 and 12 are renamed, not deleted, and were not pruned in place of the new ones.
    assert names(tmp_path / "checkpoints") == [
        "step_00000008.superseded-1",
        "step_00000010",
        "step_00000012",
        "step_00000012.superseded-1",
    ]
    assert out.count("kept aside as step_00000008.superseded-1, step_00000012.superseded-1") == 1
    old12 = json.loads((tmp_path / "checkpoints" / "step_00000012.superseded-1" / "shardlab.json").read_text())
    new12 = json.loads((tmp_path / "checkpoints" / "step_00000012" / "shardlab.json").read_text())
    assert new12["save_index"] > old12["save_index"] and new12["resumed_from"] == str(step4)
    # resume=auto continues the new line: its step 12 is the reference's step 12, bit for bit.
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            weights.read_full(tmp_path / "checkpoints" / "step_00000012").values(),
            weights.read_full(ref_dir / "checkpoints" / "step_00000012").values(),
            strict=True,
        )
    )


def test_torn_newest_checkpoint_is_set_aside_and_the_previous_one_resumed(tiny_lm, tmp_path, reference, capsys):
    ref_dir, ref = reference
    copy_checkpoints(ref_dir, tmp_path, 4, 8)
    shard = next((tmp_path / "checkpoints" / "step_00000008").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a write cut short
    capsys.readouterr()
    resumed = run_rank(tiny_lm(*CKPT), tmp_path, dist_env.detect())
    out = capsys.readouterr().out.splitlines()
    warnings = [line for line in out if "is unreadable" in line]
    assert len(warnings) == 1 and "step_00000008" in warnings[0] and "unreadable-1" in warnings[0]
    assert "a write cut short" in warnings[0]  # the defect found on re-reading it, not only the load's error
    # A rollback is announced loudly: on the console and in status.json.
    assert "[ckpt] ROLLBACK: resuming step 4, not the newest step 8 (unreadable; set aside, not deleted)" in out
    rollback = run_record.read(tmp_path)["rollback"]
    assert (rollback["from_step"], rollback["to_step"], rollback["reason"]) == (8, 4, "unreadable")
    assert torch.equal(train_losses(resumed), train_losses(ref, 5))
    assert resumed["final"] == ref["final"]
    assert "step_00000008.unreadable-1" in names(tmp_path / "checkpoints")


def test_explicit_resume_of_a_torn_checkpoint_stops_in_one_line(tiny_lm, tmp_path, reference):
    ref_dir, _ = reference
    copy_checkpoints(ref_dir, tmp_path, 8)
    ckpt = tmp_path / "checkpoints" / "step_00000008"
    (ckpt / ".metadata").write_bytes(b"")
    with pytest.raises(CheckpointError, match=f"checkpoint {ckpt} could not be loaded") as e:
        run_rank(tiny_lm(*CKPT, f"checkpoint.resume={ckpt}"), tmp_path / "other", dist_env.detect())
    assert "\n" not in str(e.value) and ckpt.is_dir()


def test_async_save_gives_the_same_losses_and_checkpoints_as_sync(tiny_lm, tmp_path, reference):
    ref_dir, ref = reference
    run = run_rank(tiny_lm(*CKPT, "checkpoint.async_save=true"), tmp_path, dist_env.detect())
    assert torch.equal(train_losses(run), train_losses(ref))
    assert names(tmp_path / "checkpoints") == ["step_00000004", "step_00000008", "step_00000012"]
    for step in ("step_00000004", "step_00000012"):  # staged copies, not views the next steps overwrote
        got = weights.read_full(tmp_path / "checkpoints" / step)
        expected = weights.read_full(ref_dir / "checkpoints" / step)
        assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_milestones_are_kept_forever_beside_the_last(tiny_lm, tmp_path):
    run_rank(tiny_lm(*CKPT, "checkpoint.keep_last=1", "checkpoint.keep_every_steps=5"), tmp_path, dist_env.detect())
    assert names(tmp_path / "checkpoints") == ["step_00000005", "step_00000010", "step_00000012"]


def test_time_interval_saves_between_step_intervals(tiny_lm, tmp_path, capsys):
    capsys.readouterr()
    run_rank(
        tiny_lm(*CKPT, "checkpoint.interval_steps=0", "checkpoint.interval_minutes=1e-9"), tmp_path, dist_env.detect()
    )
    saved = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[ckpt] step")]
    assert len(saved) == 12  # every step is past a 60 ns interval


def test_save_on_error_saves_the_last_step_and_reraises(tiny_lm, tmp_path, crash_lm_loss_at, reference):
    _, ref = reference
    restore_loss = crash_lm_loss_at(7)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_rank(tiny_lm(*CKPT, "checkpoint.save_on_error=true"), tmp_path, dist_env.detect())
    restore_loss()
    assert names(tmp_path / "checkpoints") == ["step_00000004", "step_00000006"]
    resumed = run_rank(tiny_lm(*CKPT), tmp_path, dist_env.detect())
    assert torch.equal(train_losses(resumed), train_losses(ref, 7))


def test_stale_temporary_folders_are_removed_at_start(tiny_lm, tmp_path, reference):
    ref_dir, _ = reference
    copy_checkpoints(ref_dir, tmp_path, 12)
    (tmp_path / "checkpoints" / "step_00000004.tmp").mkdir()  # killed mid-save long ago
    run_rank(tiny_lm(*CKPT), tmp_path, dist_env.detect())
    assert names(tmp_path / "checkpoints") == ["step_00000012"]


def test_checkpoint_of_another_task_is_refused_naming_the_key(tiny_lm, tmp_path, reference):
    ref_dir, _ = reference
    copy_checkpoints(ref_dir, tmp_path, 12)
    meta_file = tmp_path / "checkpoints" / "step_00000012" / "shardlab.json"
    meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), "task": "image_classification"}))
    with pytest.raises(CheckpointError, match="task.name='image_classification' but this run has task.name='lm'"):
        run_rank(tiny_lm(*CKPT), tmp_path, dist_env.detect())


def test_consolidated_weights_start_a_run_at_the_same_validation_loss(tiny_lm, tmp_path, reference):
    ref_dir, ref = reference
    out = consolidate.main([str(ref_dir / "checkpoints" / "step_00000012"), "--out", str(tmp_path / "m.safetensors")])
    from safetensors.torch import load_file

    plain = load_file(str(out))  # loadable without shardlab
    assert json.loads(weights.config_file(out).read_text())["model_config"]["dim"] == 64
    assert set(plain) >= {"embed.tok.weight", "head.out.weight"}
    started = run_rank(
        tiny_lm(*CKPT, f"checkpoint.init_from={out}", "optimization.max_steps=2"), tmp_path / "new", dist_env.detect()
    )
    step0 = [r for r in started["history"] if r["split"] == "valid" and r["step"] == 0]
    assert step0 and step0[0]["loss"] == ref["final"]["loss"]
    with pytest.raises(CheckpointError, match=r"saved with model.dim=64 but this run has model.dim=32"):
        run_rank(tiny_lm(*CKPT, "model.dim=32", f"checkpoint.init_from={out}"), tmp_path / "bad", dist_env.detect())


def test_init_from_a_step_directory_loads_its_weights_but_not_its_step(tiny_lm, tmp_path, reference):
    ref_dir, ref = reference
    step12 = ref_dir / "checkpoints" / "step_00000012"
    started = run_rank(
        tiny_lm(*CKPT, f"checkpoint.init_from={step12}", "optimization.max_steps=2"), tmp_path, dist_env.detect()
    )
    valid = [(r["step"], r["loss"]) for r in started["history"] if r["split"] == "valid"]
    assert valid[0] == (0, ref["final"]["loss"])
    assert [r["step"] for r in started["history"] if r["split"] == "train"] == [1, 2]


def test_vision_weights_consolidate_and_start_a_run_with_their_batchnorm_statistics(tmp_path):
    from tests.unit.test_image_classification import TINY_MODEL, vision

    small = [
        *TINY_MODEL,
        "data.num_train=64",
        "data.num_valid=32",
        "optimization.batch_size=16",
        "validation.batch_size=16",
        "lr_scheduler.warmup_steps=0",
        "validation.interval_steps=0",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
    ]
    trained = run_rank(vision(*small, "optimization.max_steps=4"), tmp_path / "run", dist_env.detect())
    out = consolidate.main(
        [str(tmp_path / "run" / "checkpoints" / "step_00000004"), "--out", str(tmp_path / "r.safetensors")]
    )
    assert any(k.endswith("running_mean") for k in weights.read_full(out))
    started = run_rank(
        vision(*small, "optimization.max_steps=1", f"checkpoint.init_from={out}"), tmp_path / "new", dist_env.detect()
    )
    step0 = next(r for r in started["history"] if r["split"] == "valid" and r["step"] == 0)
    assert step0["loss"] == trained["final"]["loss"] and step0["top1"] == trained["final"]["top1"]


def test_negative_checkpoint_intervals_are_refused_naming_the_keys():
    from shardlab.errors import ConfigError
    from shardlab.runner import build_task
    from tests.conftest import compose_config

    with pytest.raises(ConfigError) as e:
        build_task(compose_config(["checkpoint.interval_minutes=-1", "checkpoint.keep_every_steps=-5"]), world_size=1)
    assert "checkpoint.interval_minutes must be >= 0, got -1" in str(e.value)
    assert "checkpoint.keep_every_steps must be >= 0, got -5" in str(e.value)
