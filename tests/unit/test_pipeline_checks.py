"""The pre-flight refuses what pipeline parallelism cannot run, in one line naming the key, before any rank starts
(shardlab.cli.checks.pipeline_errors; the LM's own in LanguageModelingTask.pipeline_errors)."""

from __future__ import annotations

import pytest

from shardlab.cli import checks
from shardlab.errors import ConfigError
from tests.conftest import compose_config

PP = ["distributed.backend=fully_sharded", "distributed.world_size=2", "distributed.pipeline_parallel_degree=2"]
FITS = [*PP, "model.num_layers=4", "model.tie_embeddings=false", "optimization.update_freq=2"]


def test_a_pipeline_that_fits_passes(tiny_lm):
    checks.check(tiny_lm(*FITS))
    checks.check(
        tiny_lm(*FITS, "distributed.pipeline_schedule=interleaved_1f1b", "distributed.pipeline_stages_per_rank=2")
    )
    checks.check(tiny_lm(*FITS, "distributed.pipeline_schedule=gpipe", "optimization.update_freq=1"))


REFUSED = {  # what a config changes from FITS (overrides split by spaces) -> the line that refuses it
    "distributed.pipeline_stages_per_rank=3": r"distributed.pipeline_parallel_degree x pipeline_stages_per_rank = 6 "
    r"pipeline stages, more than the model's 4 layers",
    "distributed.pipeline_schedule=interleaved_1f1b": r"distributed.pipeline_schedule=interleaved_1f1b runs several "
    r"stages per rank",
    "distributed.pipeline_stages_per_rank=2": r"distributed.pipeline_stages_per_rank \(2\) needs an interleaved",
    "optimization.update_freq=1": r"optimization.update_freq \(1\) gives 1 pipeline micro-batches per step, fewer "
    r"than the 2 stages 1f1b needs",
    "distributed.pipeline_schedule=zbv_zero_bubble": r"distributed.pipeline_schedule must be one of gpipe, 1f1b, "
    r"interleaved_1f1b, got 'zbv_zero_bubble' \(its forward-only pass fails",
    "distributed.pipeline_schedule=2f2b": r"pipeline_schedule must be one of gpipe, 1f1b, interleaved_1f1b, "
    r"got '2f2b'",
    "distributed.backend=ddp": r"distributed.pipeline_parallel_degree \(2\) runs each stage under fully_sharded",
    "optimization.update_freq=4 validation.batch_size=6": r"validation.batch_size \(6\) must be a multiple of "
    r"data-parallel ranks x optimization.update_freq \(4\)",
    "model.tie_embeddings=true": r"model.tie_embeddings: the embedding \(first pipeline stage\) and the head",
    "distributed.world_size=3": r"the mesh's degrees multiply to pp 2 = 2 ranks, but the world size is 3",
    "distributed.precision=fp16": r"distributed.precision fp16 with pipeline_parallel_degree > 1",
}


@pytest.mark.parametrize("override", list(REFUSED))
def test_what_a_pipeline_cannot_run_is_refused_in_one_line_naming_the_key(tiny_lm, override):
    with pytest.raises(ConfigError, match=REFUSED[override]) as refused:
        checks.check(tiny_lm(*FITS, *override.split()))
    assert "\n" not in str(refused.value)


def test_stages_per_rank_without_a_pipeline_is_refused(tiny_lm):
    with pytest.raises(ConfigError, match=r"distributed.pipeline_stages_per_rank \(2\) needs distributed.pipeline_par"):
        checks.check(tiny_lm("distributed.pipeline_stages_per_rank=2"))


def test_an_image_model_is_refused_a_pipeline_degree():
    cfg = compose_config(["task=image_classification", *PP, "optimization.batch_size=8", "validation.batch_size=8"])
    with pytest.raises(ConfigError, match=r"pipeline_parallel_degree \(2\): task image_classification's models do not"):
        checks.check(cfg)


def test_the_command_line_refuses_a_pipeline_in_one_line_and_writes_nothing(tmp_path, cli_forks):
    proc = cli_forks.run(*PP, "distributed.pipeline_schedule=interleaved_1f1b", f"hydra.run.dir={tmp_path}/run")
    err = proc.stderr
    assert proc.returncode == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert "distributed.pipeline_schedule=interleaved_1f1b runs several stages per rank" in err
    assert not (tmp_path / "run").exists()


def test_the_validation_batch_splits_over_the_data_ranks_only_not_the_tensor_ranks(tiny_lm):
    """PP 2 x TP 2 on 4 ranks: one data-parallel rank, so 2 micro-batches need a validation batch of a multiple of 2,
    not of (world / pp) x 2 = 4: the TP ranks share their data rank's batch."""
    tp = [*FITS, "distributed.world_size=4", "distributed.tensor_parallel_degree=2", "optimization.batch_size=2"]
    checks.check(tiny_lm(*tp, "validation.batch_size=6"))
    with pytest.raises(ConfigError, match=r"validation.batch_size \(3\) must be a multiple of data-parallel ranks x "
                       r"optimization.update_freq \(2\)"):  # fmt: skip
        checks.check(tiny_lm(*tp, "validation.batch_size=3"))


def test_fine_tuning_runs_through_a_pipeline_on_unpacked_rows_only():
    """A sample per row (data.pack=false) passes; packed rows are refused naming data.pack: their segments (each
    sample's attention mask and positions) would have to reach every stage, which gets only the hidden states."""
    from tests.unit.test_sft import SFT_TINY

    sft = [*SFT_TINY, *FITS, "optimization.batch_size=4"]
    checks.check(compose_config([*sft, "data.pack=false"]))
    with pytest.raises(ConfigError, match=r"^data.format=\w+ with data.pack=true: packed rows' segments") as refused:
        checks.check(compose_config([*sft, "data.pack=true"]))
    assert "\n" not in str(refused.value)
