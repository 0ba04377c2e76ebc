"""Supervised fine-tuning against TRL's SFTTrainer (trl, a test/bench-only dependency): real tokens per second and the
final answer loss, packed and unpacked, interleaved pairs of fresh processes.

    python -m shardlab_bench sft_trl --pairs 2 --steps 12 --warmup 3 --out docs/bench/sft_trl.json

Both sides get the same tiny Llama (made by transformers in a temporary folder, tests/hf_folders.py), the same
deterministic prompt/completion records (the byte tokenizer: no chat template, so the sample is
``prompt + completion + end-of-text`` on both sides and the loss is on the completion and the end-of-text), the same
LoRA (rank, alpha, the attention and MLP projections, the same initial adapter values: shardlab's seeded init written
as a peft folder), AdamW (lr, betas, eps, no weight decay, constant lr, clip 1.0), fp32 (TRL's bf16 and gradient
checkpointing switched off), one process, and a step batch of every training record (so the two samplers' orders do
not matter and the losses compare step for step); packed, a step is ``--batch`` rows of ``--seq-len`` (8x the records,
each side packing them its own way, so the packed losses are not compared). shardlab runs through its real trainer
(``runner.run_rank``, its logged ``tokens_per_s`` counts non-padding positions); TRL through ``SFTTrainer.train``
with a callback timing each step and the batch's non-padding tokens counted from its attention mask (packed: every
position is a token). Both: tokens/s = real tokens of the steps after ``--warmup`` / their summed step time. Each run
is a fresh process (``--side``); within a pair the order alternates (shardlab first, then TRL first, ...). Each runs
on ``--threads`` torch threads (1 by default): at 2 threads on 2 cores, anything else running made a run 17x slower
at random (measured: shardlab's unpacked run at 10,175 and 588 tokens/s in two pairs, 46,000 steady in-process).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from shardlab_bench import child_env, command, provenance

REPO = Path(__file__).resolve().parent.parent

WORDS = ["red", "green", "blue", "cat", "dog", "sun", "moon", "tree", "river", "stone", "bird", "cloud"]
LORA = {
    "rank": 8,
    "alpha": 16,
    "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
LR = 1e-3


def records(n: int) -> list[dict[str, str]]:
    """Deterministic prompt/completion pairs of different lengths (16 to ~90 bytes)."""
    out = []
    for i in range(n):
        a, b, c = WORDS[i % 12], WORDS[(i * 5 + 3) % 12], WORDS[(i * 7 + 1) % 12]
        out.append({"prompt": f"Q{i}: what goes with {a}?" + " and" * (i % 5) + " A:",
                    "completion": f" {b} and {c}" + ", then " * (i % 4) + "."})  # fmt: skip
    return out


def shardlab_overrides(folder: Path, data: Path, args: argparse.Namespace, packed: bool) -> list[str]:
    return [
        f"model.pretrained={folder}", "data.format=prompt_completion", f"data.path={data}",
        f"data.seq_len={args.seq_len}", "data.valid_percent=0", f"data.pack={str(packed).lower()}",
        f"optimization.batch_size={args.batch}", f"optimizer.lr={LR}", "optimizer.betas=[0.9,0.999]",
        "optimizer.eps=1e-8", "optimizer.weight_decay=0.0", "lr_scheduler=constant", "lr_scheduler.warmup_steps=0",
        f"optimization.max_steps={args.steps}", "optimization.clip_norm=1.0", "validation.interval_steps=0",
        "checkpoint.interval_steps=0", "logging.interval_steps=1", "logging.progress_bar=false",
        "logging.tensorboard=false", f"model.lora.rank={LORA['rank']}", f"model.lora.alpha={LORA['alpha']}",
        "model.lora.target_modules=[attn.*,mlp.*]",
    ]  # fmt: skip


def run_shardlab(folder: Path, data: Path, args: argparse.Namespace, packed: bool, tmp: Path) -> dict:
    from shardlab.cli.preflight import compose_config
    from shardlab.distributed import env as dist_env
    from shardlab.runner import run_rank

    cfg = compose_config(shardlab_overrides(folder, data, args, packed))
    history = [r for r in run_rank(cfg, tmp / "run", dist_env.detect())["history"] if r["split"] == "train"]
    timed = history[args.warmup :]
    seconds = sum(r["ms_per_step"] for r in timed) / 1000
    tokens = sum(r["tokens_per_s"] * r["ms_per_step"] / 1000 for r in timed)
    return {"tokens_per_s": tokens / seconds, "losses": [r["loss"] for r in history], "steps": len(history)}


def initial_adapters(folder: Path, data: Path, args: argparse.Namespace, out: Path) -> Path:
    """shardlab's seeded initial adapters (A uniform, B = 0) as a peft folder, for TRL to start from."""
    import torch

    from shardlab.cli.preflight import compose_config
    from shardlab.distributed.materialize import materialize
    from shardlab.distributed.units import model_on_meta
    from shardlab.runner import build_task
    from shardlab_tasks.lm.hf.peft import write_peft_adapter
    from shardlab_tasks.lm.models.lora import is_adapter

    cfg = compose_config(shardlab_overrides(folder, data, args, packed=False))
    task = build_task(cfg, world_size=1)
    model = model_on_meta(task)
    materialize(model, torch.device("cpu"), task.init_tensor, seed=cfg.seed)
    state = {n: p.detach() for n, p in model.named_parameters() if is_adapter(n)}
    return write_peft_adapter(state, task.cfg.model, out)


def run_trl(folder: Path, data: Path, args: argparse.Namespace, packed: bool, tmp: Path) -> dict:
    import datasets
    import peft
    import torch
    import transformers
    from trl import SFTConfig, SFTTrainer

    adapter = initial_adapters(folder, data, args, tmp / "adapter")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, adapter, is_trainable=True)
    config = SFTConfig(
        output_dir=str(tmp / "trl"), per_device_train_batch_size=args.batch, max_steps=args.steps, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
        adam_epsilon=1e-8, optim="adamw_torch", max_grad_norm=1.0, logging_steps=1, report_to="none",
        save_strategy="no", use_cpu=True, seed=0, max_length=args.seq_len + 1, packing=packed,
        completion_only_loss=True, bf16=False, gradient_checkpointing=False, dataloader_num_workers=0,
    )  # fmt: skip
    steps: list[list[float]] = []  # [seconds, real tokens] per optimizer step

    class Timed(SFTTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            mask = inputs.get("attention_mask")
            steps[-1][1] += float(mask.sum() if mask is not None else inputs["input_ids"].numel())
            return super().training_step(model, inputs, num_items_in_batch)

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            steps.append([time.perf_counter(), 0.0])

        def on_step_end(self, *a, **k):
            steps[-1][0] = time.perf_counter() - steps[-1][0]

    rows = [json.loads(line) for line in data.read_text().splitlines()]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    dataset = datasets.Dataset.from_list(rows)
    trainer = Timed(model=model, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
    timed = steps[args.warmup :]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"tokens_per_s": sum(t for _, t in timed) / sum(s for s, _ in timed), "losses": losses, "steps": len(steps)}


def side(args: argparse.Namespace) -> None:
    """One run in this fresh process; its JSON to ``--out``."""
    import torch

    torch.set_num_threads(args.threads)
    folder, data = Path(args.folder), Path(args.data)
    with tempfile.TemporaryDirectory() as tmp:
        run = run_shardlab if args.side == "shardlab" else run_trl
        result = run(folder, data, args, args.packed, Path(tmp))
    Path(args.out).write_text(json.dumps(result))


def one_run(args: argparse.Namespace, who: str, packed: bool, folder: Path, data: Path, out: Path) -> dict:
    cmd = [*command("sft_trl", "--side", who), "--folder", str(folder), "--data", str(data), "--out", str(out),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch), "--seq-len",
           str(args.seq_len), "--threads", str(args.threads), *(["--packed"] if packed else [])]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=REPO, env=child_env())
    return json.loads(out.read_text())


def mode(args: argparse.Namespace, packed: bool, folder: Path, data: Path, tmp: Path) -> dict:
    pairs = []
    for k in range(args.pairs):
        order = ["shardlab", "trl"] if k % 2 == 0 else ["trl", "shardlab"]
        got = {who: one_run(args, who, packed, folder, data, tmp / f"{who}.json") for who in order}
        shardlab, trl = got["shardlab"], got["trl"]
        pairs.append({
            "order": order, "shardlab_tokens_per_s": shardlab["tokens_per_s"], "trl_tokens_per_s": trl["tokens_per_s"],
            "ratio": shardlab["tokens_per_s"] / trl["tokens_per_s"],
            "shardlab_final_loss": shardlab["losses"][-1], "trl_final_loss": trl["losses"][-1],
        })  # fmt: skip
    final = (pairs[-1]["shardlab_final_loss"], pairs[-1]["trl_final_loss"])
    return {"pairs": pairs, "median_ratio": statistics.median(p["ratio"] for p in pairs),
            "final_loss_relative_difference": abs(final[0] - final[1]) / abs(final[1])}  # fmt: skip


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of tokens/s")
    p.add_argument("--batch", type=int, default=16, help="records per step: the whole training set")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="torch threads of each run (both sides alike)")
    p.add_argument("--out", default="docs/bench/sft_trl.json")
    p.add_argument("--side", choices=["shardlab", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--packed", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.side:
        return side(args)
    settings = {k: v for k, v in vars(args).items() if k not in ("side", "folder", "data", "packed")}
    meta = provenance.collect(__file__, argv, {**settings, "lora": LORA, "lr": LR, "model": "tests/hf_folders llama3"})
    from tests.hf_folders import make_folder

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        folder = make_folder("llama3", tmp_path / "llama")
        result = {}
        for name, packed, n in (("unpacked", False, args.batch), ("packed", True, 8 * args.batch)):
            data = tmp_path / f"{name}.jsonl"
            data.write_text("".join(json.dumps(r) + "\n" for r in records(n)))
            result[name] = {"records": n, **mode(args, packed, folder, data, tmp_path)}
    result["meta"] = provenance.finish(meta)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for name in ("unpacked", "packed"):
        r = result[name]
        print(f"{name}: shardlab/TRL real tokens/s {r['median_ratio']:.3f}x, final loss diff "
              f"{r['final_loss_relative_difference']:.2%}")  # fmt: skip
    return result
