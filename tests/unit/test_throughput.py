"""Throughput windows time training only: validation (and saving) inside a window is left out."""

from __future__ import annotations

import time

from shardlab.distributed import env as dist_env
from shardlab.runner import run_rank
from shardlab.trainer import Trainer

PAUSE_S = 1.0


def test_validation_time_is_not_counted_as_training_time(tiny_lm, tmp_path, monkeypatch):
    validate = Trainer.validate

    def slow_validate(self, log):
        time.sleep(PAUSE_S)
        return validate(self, log)

    monkeypatch.setattr(Trainer, "validate", slow_validate)
    cfg = tiny_lm("logging.interval_steps=2", "validation.interval_steps=1", "optimization.max_steps=6")
    result = run_rank(cfg, tmp_path, dist_env.detect())
    train = [r for r in result["history"] if r["split"] == "train"]
    valid = [r for r in result["history"] if r["split"] == "valid"]
    assert len(train) == 3 and len(valid) == 6
    # Windows 2 and 3 each hold two validations (2 x PAUSE_S): counted, ms_per_step would be >= 1000 * PAUSE_S.
    assert all(r["ms_per_step"] < 1000 * PAUSE_S / 2 for r in train[1:]), [r["ms_per_step"] for r in train]
    assert all(0 < r["seconds"] < PAUSE_S for r in valid)  # its own time, measured inside validate
