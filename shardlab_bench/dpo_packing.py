"""What packing preference pairs (task=dpo data.pack=true) buys: real tokens per second of a DPO training step, packed
and unpacked, on the same micro-batches of pairs, one process.

    python -m shardlab_bench dpo_packing --out dpo_packing.json model.max_seq_len=512 data.seq_len=512   # the demo
    python -m shardlab_bench dpo_packing --steps 2 --rounds 1 --out p.json model.dim=32  # Hydra overrides after options

Each side collates the same first ``steps`` micro-batches of ``optimization.batch_size`` training pairs its own way
(packed: shardlab_tasks/lm/finetuning/preference.py pack_pairs; unpacked: collate_pairs) and times a step on them
(forward and backward of the DPO loss, the reference taken as the config says: adapters off with LoRA, a zero table for
full fine-tuning, whose lookup costs nothing). The sides take turns, ``rounds`` times, each round starting with the
other one, after one warm-up step each; the figure is the median step. Reported per side: rows and positions computed,
the real tokens (Task.num_units), the median step and the real tokens per second. One machine's figures: the JSON
records its load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from shardlab.cli.preflight import compose_config
from shardlab.distributed.materialize import materialize
from shardlab.distributed.units import model_on_meta
from shardlab.runner import build_task
from shardlab_bench.provenance import collect, finish
from shardlab_tasks.lm.finetuning.dpo import preference_loss

SIDES = ("unpacked", "packed")


def side_batches(overrides: list[str], steps: int) -> tuple[object, dict[str, list]]:
    """(the packed side's task, each side's micro-batches of the same pairs)."""
    batches, task = {}, None
    for side in SIDES:
        task = build_task(compose_config(["task=dpo", *overrides, f"data.pack={side == 'packed'}"]), world_size=1)
        task.prepare_data()
        b = task.cfg.optimization.batch_size
        if steps * b > len(task.train_dataset):
            raise SystemExit(f"--steps {steps}: {len(task.train_dataset)} training pairs fill fewer batches of {b}")
        batches[side] = [task.collate([task.train_dataset[i] for i in range(s * b, (s + 1) * b)]) for s in range(steps)]
    return task, batches


def measure(overrides: list[str], steps: int, rounds: int) -> dict:
    task, batches = side_batches(overrides, steps)
    cpu = torch.device("cpu")
    model = model_on_meta(task)
    materialize(model, cpu, task.init_tensor, seed=task.cfg.seed)

    def step(batch) -> None:
        loss, _ = preference_loss(model, batch, cpu, task.dpo, None, task.lora)
        loss.backward()
        model.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {side: [] for side in SIDES}
    for side in SIDES:
        step(batches[side][0])  # warm-up
    for r in range(rounds):
        for side in SIDES if r % 2 == 0 else SIDES[::-1]:
            for batch in batches[side]:
                started = time.perf_counter()
                step(batch)
                times[side].append(time.perf_counter() - started)
    out = {}
    for side in SIDES:
        tokens = sum(task.num_units(b) for b in batches[side]) / steps
        median = statistics.median(times[side])
        out[side] = {
            "rows_per_step": sum(b["rows"][..., 0, 0].numel() for b in batches[side]) / steps,
            "positions_per_step": sum(b["rows"][..., 0, :].numel() for b in batches[side]) / steps,
            "real_tokens_per_step": tokens,
            "median_step_s": round(median, 5),
            "real_tokens_per_s": round(tokens / median, 1),
        }
    out["packed_speedup"] = round(out["packed"]["real_tokens_per_s"] / out["unpacked"]["real_tokens_per_s"], 3)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="micro-batches of pairs each side times per round")
    parser.add_argument("--rounds", type=int, default=3, help="turns of the two sides, each round the other first")
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    args, overrides = parser.parse_known_args(argv)
    meta = collect(__file__, argv, {"steps": args.steps, "rounds": args.rounds, "overrides": overrides})
    result = {**measure(overrides, args.steps, args.rounds), "meta": None}
    result["meta"] = finish(meta)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "meta"}, indent=1))
    return result
