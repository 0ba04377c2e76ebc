"""A run killed with SIGKILL at random moments and during saves, restarted each time, ends like an uninterrupted one.

The fast variant of shardlab_bench/kill_loop.py (two kills of a tiny LM); docs/checkpoints.md reports the script on the
default run."""

from __future__ import annotations

import pytest

from shardlab_bench import kill_loop
from tests.conftest import TINY_LM

pytestmark = pytest.mark.e2e  # a training command killed and restarted: CI runs it after the suite (tests/conftest.py)


def test_killed_and_restarted_run_ends_with_the_uninterrupted_weights_and_loss(corpus_cache, tmp_path):
    overrides = [
        *TINY_LM,
        f"data.cache_dir={corpus_cache}",
        "optimization.max_steps=30",
        "checkpoint.interval_steps=3",
        "validation.interval_steps=0",
        "logging.interval_steps=10",
    ]
    result = kill_loop.main(["--kills", "2", "--save-every", "1", "--workdir", str(tmp_path), "--", *overrides])
    assert result["num_killed"] == 2 and result["num_killed_during_save"] == 2
    # each kill landed in a save of its own start, beside a complete checkpoint that was still there after it
    assert result["num_killed_beside_a_complete_checkpoint"] == 2 and result["always_a_complete_checkpoint"]
    assert result["final_weights_equal"] and result["final_killed"] == result["final_uninterrupted"]
