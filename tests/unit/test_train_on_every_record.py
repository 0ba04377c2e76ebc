"""data.valid_percent=0 with validation off trains on every record (fine-tuning records and the LM corpus alike),
and a validation split smaller than validation.batch_size gets a batch that fits it, with a line saying so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardlab.cli.preflight import compose_config
from shardlab.distributed import env as dist_env
from shardlab.errors import DataError
from shardlab.runner import run_rank

SFT = [
    "task=sft", "model.num_layers=1", "model.dim=32", "model.num_heads=2", "model.max_seq_len=64",
    "data.format=prompt_completion", "data.seq_len=64", "optimization.max_steps=2", "optimization.batch_size=4",
    "checkpoint.interval_steps=0", "logging.progress_bar=false", "logging.tensorboard=false",
    "logging.interval_steps=1",
]  # fmt: skip


def records(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i} ", "completion": f"answer {i}"}) + "\n" for i in range(n)))
    return path


def keep_task(trainer) -> dict:
    return {"task": trainer.task, "valid_batch": trainer.cfg.validation.batch_size}


def test_sft_with_valid_percent_0_and_validation_off_trains_on_every_record(tmp_path):
    path = records(tmp_path, 40)
    cfg = compose_config([*SFT, f"data.path={path}", "data.valid_percent=0", "validation.interval_steps=0"])
    result = run_rank(cfg, tmp_path / "run", dist_env.detect(), after_fit=keep_task)
    splits = result["task"].sft_splits
    assert (splits.records, len(splits.train.samples), len(splits.valid)) == (40, 40, 0)
    assert [r["split"] for r in result["history"]].count("train") == 2 and result["final"] == {}
    with pytest.raises(
        DataError,
        match=r"^the validation split is empty \(data.valid_percent=0 holds none out\): set validation.interval_steps",
    ):
        run_rank(compose_config([*SFT, f"data.path={path}", "data.valid_percent=0", "validation.interval_steps=1"]),
                 tmp_path / "run2", dist_env.detect())  # fmt: skip


def test_the_lm_corpus_with_valid_percent_0_and_validation_off_trains_on_every_token(tmp_path, tiny_lm):
    (tmp_path / "doc.txt").write_text("every word of this text is trained on, none held out. " * 40)
    cfg = tiny_lm(f"data.path={tmp_path / 'doc.txt'}", "data.valid_percent=0", "validation.interval_steps=0",
                  "optimization.max_steps=2", "model.dim=32")  # fmt: skip
    result = run_rank(cfg, tmp_path / "run", dist_env.detect(), after_fit=keep_task)
    task = result["task"]
    assert task.meta["valid_tokens"] == 0 and task.meta["train_tokens"] > 0 and len(task.valid_dataset) == 0
    assert result["final"] == {} and [r["split"] for r in result["history"]].count("train") == 2


def test_a_validation_batch_larger_than_the_split_is_lowered_to_fit_it_with_a_line(tmp_path, capsys):
    path = records(tmp_path, 60)
    cfg = compose_config([*SFT, f"data.path={path}", "data.valid_percent=20", "validation.interval_steps=2",
                          "validation.batch_size=32", "data.pack=false"])  # fmt: skip
    result = run_rank(cfg, tmp_path / "run", dist_env.detect(), after_fit=keep_task)
    held = len(result["task"].valid_dataset)
    assert 0 < held < 32 and result["valid_batch"] == held  # 32, lowered to the split
    assert (
        f"validation.batch_size=32 lowered to {held}: the validation split holds {held} rows" in capsys.readouterr().out
    )
    assert result["final"]["loss"] > 0  # validated


def test_the_lowered_batch_validates_when_the_task_holds_its_own_copy_of_the_config(tmp_path):
    """The CLI's pre-flight builds the run's task from its own composition of the command line
    (shardlab.cli.checks.checked): the batch lowered in the task's config is the one validation reads (the README's
    SFT line failed with 'stack expects a non-empty TensorList' at its first validation)."""
    from shardlab.runner import rank_task

    overrides = [*SFT, f"data.path={records(tmp_path, 60)}", "data.valid_percent=20", "validation.batch_size=32"]
    task = rank_task(compose_config(overrides))
    result = run_rank(compose_config(overrides), tmp_path / "run", dist_env.detect(), task=task)
    assert result["final"]["loss"] > 0 and 0 < task.cfg.validation.batch_size < 32


# ---- honest speed (issue 48, item 5) ---------------------------------------------------------------------------------
def test_unpacked_rows_are_padded_to_the_longest_sample_and_give_the_same_loss(tmp_path):
    import torch

    from shardlab_tasks.lm.finetuning.sft import PackedRows, answer_token_loss, record_sample
    from tests.unit.test_sft import sft_task

    task = sft_task(tmp_path, "data.pack=false", "data.seq_len=64")
    samples = [record_sample({"prompt": "q" * n, "completion": "a" * n}, "t", task.cfg.data, task.tokenizer, None)
               for n in (3, 9, 5)]  # fmt: skip
    rows = PackedRows(samples, 64, task.tokenizer.eod, packed=False)
    full = torch.stack([rows[i] for i in range(3)])
    batch = task.collate([rows[i] for i in range(3)])
    assert batch.shape == (3, 3, 9 + 9 + 1 - 1)  # the longest sample's positions, not data.seq_len
    assert task.num_units(batch) == task.num_units(full) == sum(len(s.ids) - 1 for s in samples)
    model = task.build_model()
    cut, _ = answer_token_loss(model, batch, torch.device("cpu"), packed=False)
    padded, _ = answer_token_loss(model, full, torch.device("cpu"), packed=False)
    torch.testing.assert_close(cut, padded)


@pytest.mark.parametrize("pack", ["true", "false"])
def test_tokens_per_s_counts_the_sample_tokens_not_the_padding(tmp_path, pack):
    path = records(tmp_path, 6)
    cfg = compose_config([*SFT, f"data.path={path}", "data.valid_percent=0", "validation.interval_steps=0",
                          "optimization.max_steps=1", f"data.pack={pack}", "optimization.batch_size=1"])  # fmt: skip
    result = run_rank(cfg, tmp_path / "run", dist_env.detect(), after_fit=keep_task)
    rows = result["task"].train_dataset
    first = rows[0]  # the step's one row: the order's first (shuffled)
    record = next(r for r in result["history"] if r["split"] == "train")
    per_step = record["tokens_per_s"] * record["ms_per_step"] / 1000
    real = [int((rows[i][2] >= 0).sum()) for i in range(len(rows))]
    assert any(per_step == pytest.approx(n, rel=1e-6) for n in real) and max(real) < 64, (per_step, real, first.shape)
