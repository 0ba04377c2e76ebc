"""What the reference model of full-fine-tuning DPO costs, both ways: precomputed once (what task=dpo does) or a
frozen second model forwarding every step (what it does not), on task=dpo's data and model, one process.

    python -m shardlab_bench dpo_reference --out dpo_reference.json                 # the demo: gpt_tiny, 410 pairs
    python -m shardlab_bench dpo_reference --steps 3 --out r.json model.dim=32      # Hydra overrides after the options

Measured: the whole precomputing pass over the train and validation pairs
(shardlab_tasks.lm.finetuning.dpo.ReferenceLogProbs), a training step of ``optimization.batch_size`` pairs (forward and
backward of the DPO loss), and a no-grad forward of the same pairs (what a frozen reference adds to every step); the
bytes of the precomputed table and of a frozen fp32 copy of the weights. The steps run after one warm-up on the first
batches of the training split.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from shardlab.cli.preflight import compose_config
from shardlab.distributed.materialize import materialize
from shardlab.distributed.units import model_on_meta
from shardlab.runner import build_task
from shardlab_bench.provenance import collect, finish
from shardlab_tasks.lm.finetuning.dpo import ReferenceLogProbs, answer_logps, preference_loss
from shardlab_tasks.lm.finetuning.preference import collate_pairs


def timed(fn, batches: list) -> float:
    """Mean seconds of ``fn`` over ``batches`` after one warm-up call."""
    fn(batches[0])
    started = time.perf_counter()
    for batch in batches:
        fn(batch)
    return (time.perf_counter() - started) / len(batches)


def measure(overrides: list[str], steps: int) -> dict:
    cfg = compose_config(["task=dpo", *overrides])
    task = build_task(cfg, world_size=1)
    task.prepare_data()
    cpu = torch.device("cpu")
    model = model_on_meta(task)
    materialize(model, cpu, task.init_tensor, seed=cfg.seed)
    pairs = len(task.train_dataset) + len(task.valid_dataset)
    reference = ReferenceLogProbs(pairs, cpu)
    started = time.perf_counter()
    reference.compute(model, [task.train_dataset, task.valid_dataset], collate_pairs, cpu)
    precompute = time.perf_counter() - started
    b = cfg.optimization.batch_size
    batches = [collate_pairs([task.train_dataset[i] for i in range(s * b, (s + 1) * b)]) for s in range(steps)]

    def train_step(batch) -> None:
        loss, _ = preference_loss(model, batch, cpu, task.dpo, reference, lora=False)
        loss.backward()

    def reference_forward(batch) -> None:
        with torch.no_grad():
            answer_logps(model, batch["rows"].flatten(0, 1))

    step_s, forward_s = timed(train_step, batches), timed(reference_forward, batches)
    params = sum(p.numel() for p in model.parameters())
    return {
        "pairs": pairs,
        "pairs_per_step": b,
        "precompute_s": round(precompute, 3),
        "train_step_s": round(step_s, 4),
        "frozen_reference_forward_per_step_s": round(forward_s, 4),
        "precompute_in_frozen_reference_steps": round(precompute / forward_s, 1),
        "table_bytes": reference.logps.numel() * reference.logps.element_size(),
        "frozen_copy_bytes_fp32": params * 4,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="training steps (batches) timed after a warm-up")
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    args, overrides = parser.parse_known_args(argv)
    meta = collect(__file__, argv, {"steps": args.steps, "overrides": overrides})
    result = {**measure(overrides, args.steps), "meta": None}
    result["meta"] = finish(meta)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "meta"}, indent=1))
    return result
