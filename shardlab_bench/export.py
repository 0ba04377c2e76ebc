"""Peak memory of tools/export_hf.py per process against the size of the model it exports: docs/bench/export.json.

    python -m shardlab_bench export                       # a ~58 MB Llama (fp32), three settings, ~1 minute on 2 CPUs
    python -m shardlab_bench export --layers 16 --dim 512 # a larger one

Trains a Llama for one step (a real step_N folder: DCP shards of its 1 rank, optimizer state beside the weights),
then exports it in a fresh process per setting and reads that process's peak resident memory above its state before
the export (shardlab.memory.meter: VmHWM reset through /proc/self/clear_refs, file-backed pages left out; Linux).
Settings: fp32 and bf16 with a small read buffer (--buffer-mb, the export's bound), and fp32 with a buffer larger
than the model (the whole model read at once): the control, which shows what the meter reads when the model is held.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import subprocess
import tempfile
import time
from pathlib import Path

from shardlab_bench import child_env, command

ROOT = Path(__file__).resolve().parents[1]

RUN = [
    "model=llama_tiny", "model.num_heads=6", "model.num_kv_heads=2", "model.max_seq_len=32", "data.seq_len=32",
    "data.max_corpus_mb=1", "optimization.batch_size=2", "optimization.max_steps=1", "checkpoint.interval_steps=1",
    "validation.interval_steps=1", "validation.num_batches=1", "validation.batch_size=2", "lr_scheduler.warmup_steps=0",
]  # fmt: skip


def make_checkpoint(root: Path, layers: int, dim: int, ffn_dim: int) -> Path:
    """A one-step Llama run's step folder under ``root``."""
    from shardlab.cli.preflight import compose_config
    from shardlab.distributed import env as dist_env
    from shardlab.runner import run_rank

    shape = [f"model.num_layers={layers}", f"model.dim={dim}", f"model.ffn_dim={ffn_dim}"]
    cfg = compose_config([*RUN, *shape, f"data.cache_dir={root / 'cache'}"])
    run_rank(cfg, root / "run", dist_env.detect())
    return root / "run" / "checkpoints" / "step_00000001"


def model_bytes(checkpoint: Path) -> tuple[int, int]:
    """The model's bytes as the checkpoint stores them (fp32), and its largest tensor's."""
    from shardlab.checkpoint.hf_folder import step_folder_reader

    shapes, _ = step_folder_reader(checkpoint)
    sizes = [math.prod(shape) * 4 for shape in shapes.values()]
    return sum(sizes), max(sizes)


def measure(argv: list[str]) -> dict:
    """Run the export (tools/export_hf.py's arguments) in this process: its peak bytes above the process's state
    before it, and its seconds."""
    import safetensors.torch  # noqa: F401  (what the export imports on its way counts as the interpreter's, not its)
    import tokenizers  # noqa: F401
    import torch
    import torch.distributed.checkpoint  # noqa: F401

    from shardlab.distributed.cpu_allocator import configure_cpu_allocator
    from shardlab.memory.meter import PeakMeter
    from shardlab_commands import export_hf

    configure_cpu_allocator("lean")  # as the command line runs it
    meter = PeakMeter(torch.device("cpu"))
    start = time.perf_counter()
    export_hf.main(argv)
    seconds = time.perf_counter() - start
    meter.sample()
    return {"peak_bytes": meter.peak_above_baseline, "seconds": round(seconds, 3)}


def measure_fresh(checkpoint: Path, out: Path, *flags: str) -> dict:
    """``measure`` in a fresh interpreter (no pages of an earlier export resident)."""
    argv = [str(checkpoint), "--out", str(out), *flags]
    done = subprocess.run(
        command("export", "--measure", json.dumps(argv)), capture_output=True, text=True, check=False, env=child_env()
    )
    if done.returncode:
        raise RuntimeError(f"the export failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(root: Path, layers: int, dim: int, ffn_dim: int, buffer_mb: float) -> dict:
    checkpoint = make_checkpoint(root, layers, dim, ffn_dim)
    total, largest = model_bytes(checkpoint)
    settings = {
        f"fp32_buffer_{buffer_mb:g}mb": ["--dtype", "fp32", "--buffer-mb", str(buffer_mb)],
        f"bf16_buffer_{buffer_mb:g}mb": ["--dtype", "bf16", "--buffer-mb", str(buffer_mb)],
        "fp32_whole_model_buffer": ["--dtype", "fp32", "--buffer-mb", str(2 * total / 2**20)],
    }
    results = {}
    for name, flags in settings.items():
        measured = measure_fresh(checkpoint, root / f"hf_{name}", *flags)
        results[name] = {**measured, "peak_over_model": round(measured["peak_bytes"] / total, 3), "flags": flags}
    return {"model_bytes_fp32": total, "largest_tensor_bytes": largest, "results": results}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--ffn-dim", type=int, default=1024)
    parser.add_argument("--buffer-mb", type=float, default=8)
    parser.add_argument("--json", type=Path, default=ROOT / "docs" / "bench" / "export.json")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # internal: the fresh process's export arguments
    args = parser.parse_args(argv)
    if args.measure:
        result = measure(json.loads(args.measure))
        print(json.dumps(result))
        return result
    with tempfile.TemporaryDirectory() as tmp:
        report = run(Path(tmp), args.layers, args.dim, args.ffn_dim, args.buffer_mb)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    report = {
        "what": "tools/export_hf.py peak resident memory per process above its start, against the model's size",
        "model": {"arch": "llama", "layers": args.layers, "dim": args.dim, "ffn_dim": args.ffn_dim},
        "commit": commit.stdout.strip(),
        "date": datetime.date.today().isoformat(),
        **report,
    }
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return report
