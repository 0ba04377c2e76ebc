"""Time a model.pretrained start spends before its first step on the weights: every weight drawn from its seeded
init and then overwritten by the folder's (what shardlab did before Task.pretrained_keys), against only what the
folder lacks drawn, then the folder read (what it does now): docs/bench/pretrained_init.json.

    python -m shardlab_bench pretrained_init --out docs/bench/pretrained_init.json     # a 0.85B Llama, ~1 minute
    python -m shardlab_bench pretrained_init --layers 2 --dim 512 --ffn-dim 1024          # a small one, seconds

One process on the CPU, through the trainer's own steps: the model built on meta (model_on_meta), materialize (with
or without the task's pretrained_keys), then task.load_pretrained. The folder is a Llama written by hand (bf16
safetensors, 4 files, zeros: the values do not change the time), made once under --root. One untimed start fills the
page cache, then the two starts alternate --rounds times, so both read the files from memory.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

from shardlab_bench.provenance import collect, finish

ROOT = Path(__file__).resolve().parents[1]


def make_folder(root: Path, layers: int, dim: int, ffn_dim: int, vocab: int) -> Path:
    """A Llama folder (config.json, 4 bf16 safetensors with their index, a byte tokenizer) under ``root``, once."""
    import torch
    from safetensors.torch import save_file

    from tests.hf_folders import write_tokenizer

    folder = root / f"llama_{layers}x{dim}x{ffn_dim}_v{vocab}"
    if (folder / "model.safetensors.index.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": dim,
        "intermediate_size": ffn_dim, "num_hidden_layers": layers, "num_attention_heads": dim // 128,
        "num_key_value_heads": max(1, dim // 512), "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu",
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    write_tokenizer(folder)
    task, model = _task_and_model(folder, "dry_run=true")  # no weights yet: a config.json alone plans
    from shardlab_tasks.lm.hf.hf_models import weight_names

    names = weight_names(task.cfg.model)
    shapes = {names[n].key: tuple(p.shape) for n, p in model.named_parameters()}
    keys, weight_map = sorted(shapes), {}
    for i in range(4):
        file = f"model-{i + 1:05d}-of-00004.safetensors"
        save_file({k: torch.zeros(shapes[k], dtype=torch.bfloat16) for k in keys[i::4]}, str(folder / file))
        weight_map |= {k: file for k in keys[i::4]}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def _task_and_model(folder: Path, *overrides: str):
    from shardlab.cli.preflight import compose_config
    from shardlab.distributed.units import model_on_meta
    from shardlab.runner import build_task

    task = build_task(compose_config([f"model.pretrained={folder}", "data.seq_len=64", *overrides]), world_size=1)
    return task, model_on_meta(task)


def start(folder: Path, skip: bool) -> dict:
    """Seconds to materialize (every weight drawn, or what the folder lacks only) and to load the folder."""
    import torch

    from shardlab.distributed.materialize import materialize

    task, model = _task_and_model(folder)
    began = time.perf_counter()
    materialize(model, torch.device("cpu"), task.init_tensor, 0, task.pretrained_keys() if skip else None)
    drawn = time.perf_counter()
    task.load_pretrained(model, torch.device("cpu"))
    loaded = time.perf_counter()
    params = sum(p.numel() for p in model.parameters())
    del model
    gc.collect()
    return {"params": params, "init_s": drawn - began, "load_s": loaded - drawn, "total_s": loaded - began}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--ffn-dim", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the shared 2-core machine: 1)")
    parser.add_argument("--root", type=Path, default=Path("/tmp/shardlab-bench-pretrained"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    import torch

    from shardlab.cli.run_names import register_resolvers
    from shardlab.registry import load_plugins

    register_resolvers()
    load_plugins()
    torch.set_num_threads(args.threads)
    meta = collect(__file__, argv, vars(args) | {"root": str(args.root), "out": str(args.out)})
    folder = make_folder(args.root, args.layers, args.dim, args.ffn_dim, args.vocab)
    start(folder, skip=True)  # the page cache: every timed start reads the files from memory
    rounds = [{"every_weight_drawn": start(folder, False), "folder_lacks_only": start(folder, True)}]
    rounds += [{"every_weight_drawn": start(folder, False), "folder_lacks_only": start(folder, True)}
               for _ in range(args.rounds - 1)]  # fmt: skip
    result = {"meta": finish(meta), "rounds": rounds}
    for r in rounds:
        before, after = r["every_weight_drawn"], r["folder_lacks_only"]
        print(f"{before['params'] / 1e9:.2f}B parameters: start {before['total_s']:.2f} s -> {after['total_s']:.2f} s "
              f"(init {before['init_s']:.2f} s -> {after['init_s']:.2f} s)")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result
