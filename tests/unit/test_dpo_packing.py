"""task=dpo with data.pack=true: a micro-batch's chosen and rejected answers packed into shared rows as segments
(shardlab_tasks/lm/finetuning/preference.py: pack_pairs) give each pair the log-probabilities, and a run the losses,
rewards and gradients, that one answer a row gives (rtol 1e-5), with LoRA (reference: the adapters off, packed too) and
full fine-tuning (reference: precomputed through the same packing, each pair at its own index), in fewer rows."""

from __future__ import annotations

import json

import pytest
import torch

from shardlab.cli.preflight import compose_config
from shardlab.distributed import env as dist_env
from shardlab.runner import run_rank
from shardlab_tasks.lm.dpo_task import PreferenceTask
from shardlab_tasks.lm.finetuning.preference import collate_pairs, pack_pairs
from shardlab_tasks.lm.sft_packing import IGNORE, PAD_SEGMENT, packed_row
from tests.unit.test_dpo_trl import records

STEPS = 3
METRICS = ("loss", "gnorm", "logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected")
REWARD_ATOL = 1e-6
"""A reward is beta times the difference of two sums of ~30 fp32 log-probabilities (~-100 each) that packing adds in
another order: ~1e-6 absolute apart where the rewards themselves are ~0 (the first step), no relative tolerance
holds there."""
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.target_modules=[attn.*,mlp.*]"]


def item(index: int, chosen: list[int], rejected: list[int], prompt: int, seq_len: int) -> dict:
    """A PairRows item: each answer's ids (the first ``prompt`` tokens not trained on) in a row of its own."""
    rows = [packed_row([(ids, [i >= prompt for i in range(len(ids))])], seq_len, 0) for ids in (chosen, rejected)]
    return {"rows": torch.stack(rows), "index": torch.tensor(index)}


def test_pack_pairs_numbers_each_answer_by_its_pair_and_fills_rows_in_order():
    items = [item(7, [1, 2, 3, 4], [1, 2, 5], 2, 8), item(3, [6, 7, 8, 9, 10, 11], [6, 7, 12], 2, 8)]
    batch = pack_pairs(items, seq_len=8, pad_id=0)
    rows = batch["rows"]
    assert batch["index"].tolist() == [7, 3]
    # answer lengths (positions) 3, 2, 5, 2: next fit in rows of 8 gives [0, 1] and [2, 3]; cut after 7 positions
    assert rows.shape == (2, 3, 7)
    assert rows[0, 2].tolist() == [0, 0, 0, 1, 1, PAD_SEGMENT, PAD_SEGMENT]
    assert rows[1, 2].tolist() == [2, 2, 2, 2, 2, 3, 3]
    assert rows[0, 0, :5].tolist() == [1, 2, 3, 1, 2] and rows[0, 1, :5].tolist() == [IGNORE, 3, 4, IGNORE, 5]
    assert rows[1, 1].tolist() == [IGNORE, 8, 9, 10, 11, IGNORE, 12]
    assert (rows[0, 1, 5:] == IGNORE).all()  # padding carries no loss
    unpacked = collate_pairs(items)["rows"]
    assert int((unpacked[:, :, 1] != IGNORE).sum()) == int((rows[:, 1] != IGNORE).sum())


SHORT_RUN = [
    "task=dpo", "model.num_layers=1", "model.dim=32", "model.num_heads=2", "data.seq_len=128",
    "data.valid_percent=25", "optimization.batch_size=8", f"optimization.max_steps={STEPS}", "optimizer.lr=3e-3",
    "lr_scheduler.warmup_steps=0", "validation.interval_steps=0", "validation.batch_size=1",
    "checkpoint.interval_steps=0", "logging.interval_steps=1", "logging.progress_bar=false",
    "logging.tensorboard=false",
]  # fmt: skip
"""On the pairs of test_dpo_trl.records: ~40 positions an answer, 3 to a packed row of 128."""
RUNS = {"packed": ["data.pack=true"], "unpacked": ["data.pack=false"], "lora_packed": ["data.pack=true", *LORA],
        "lora_unpacked": ["data.pack=false", *LORA]}  # fmt: skip


def counted_run(overrides: list[str], run_dir, seen: list) -> dict:
    """run_rank of SHORT_RUN + overrides, each batch the task collates (pairs, rows) appended to ``seen``."""
    collate = PreferenceTask.collate

    def counting(self, samples):
        batch = collate(self, samples)
        seen.append((len(samples), batch["rows"].shape[0] * (2 if batch["rows"].dim() == 4 else 1)))
        return batch

    PreferenceTask.collate = counting
    try:
        return run_rank(compose_config([*SHORT_RUN, *overrides]), run_dir, dist_env.detect())
    finally:
        PreferenceTask.collate = collate


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The RUNS, and the (pairs, rows) of every batch each collated (the reference pass's and validation's too)."""
    data = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records(40)))
    results, shapes = {}, {}
    for name, overrides in RUNS.items():
        shapes[name] = []
        results[name] = counted_run([f"data.path={data}", *overrides], tmp_path_factory.mktemp(name), shapes[name])
    return results, shapes


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_packed_pairs_train_as_unpacked_ones_in_fewer_rows(runs, lora):
    results, shapes = runs
    prefix = "lora_" if lora else ""
    got, expected = ({r["step"]: r for r in results[prefix + k]["history"] if r["split"] == "train"}
                     for k in ("packed", "unpacked"))  # fmt: skip
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    assert abs(expected[STEPS]["rewards/chosen"]) > 1e-3  # the policy moved off its reference
    for metric in METRICS:
        torch.testing.assert_close(
            torch.tensor([got[s][metric] for s in got], dtype=torch.float64),
            torch.tensor([expected[s][metric] for s in got], dtype=torch.float64),
            rtol=1e-5, atol=REWARD_ATOL if metric.startswith("rewards/") else 0, msg=lambda m, k=metric: f"{k}: {m}",
        )  # fmt: skip
    packed, unpacked = shapes[prefix + "packed"], shapes[prefix + "unpacked"]
    assert [p for p, _ in packed] == [p for p, _ in unpacked]  # the same micro-batches of pairs (reference pass too)
    assert all(rows == 2 * pairs for pairs, rows in unpacked)
    assert sum(rows for _, rows in packed) * 2 <= sum(rows for _, rows in unpacked)  # short pairs: 2+ answers a row


def test_the_packing_benchmark_writes_its_figures(tmp_path):
    from shardlab_bench import dpo_packing as bench_dpo_packing

    out = tmp_path / "p.json"
    tiny = ["model.num_layers=1", "model.dim=32", "model.num_heads=2", "optimization.batch_size=4"]
    result = bench_dpo_packing.main(["--steps", "1", "--rounds", "1", "--out", str(out), *tiny])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    packed, unpacked = result["packed"], result["unpacked"]
    assert packed["real_tokens_per_step"] == unpacked["real_tokens_per_step"] > 0  # the same pairs on both sides
    assert unpacked["rows_per_step"] == 8 and packed["rows_per_step"] <= 8
    assert packed["real_tokens_per_s"] > 0 and result["meta"]["commit"] is not None
