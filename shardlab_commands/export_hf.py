"""Export an LM checkpoint as a Hugging Face folder (no custom code needed to load it): model.arch=gpt as a
GPT2LMHeadModel, model.arch=llama as a Llama, Qwen2, Qwen3 or Mistral ForCausalLM, with model.moe as a Mixtral,
Qwen2-MoE or Qwen3-MoE one, its experts one tensor per expert as the hub holds them (shardlab_tasks/lm/hf/export_hf.py).

    shardlab-export runs/lm/default/checkpoints/step_00000300 --out hf-export
    shardlab-export runs/lm/sft/checkpoints/step_00001000 --dtype bf16 --out hf-bf16  # half the bytes
    shardlab-export model.safetensors --out hf-export       # a file from shardlab-consolidate
    shardlab-export runs/lm/default/checkpoints/step_00000300 --ema --out hf-ema  # optimization.ema's weights
    shardlab-export runs/lm/lora/checkpoints/step_00000300 --out hf-merged  # LoRA: base + adapters merged
    shardlab-export runs/lm/lora/checkpoints/step_00000300 --adapter-only --out adapter  # a peft folder
    python -c "from transformers import AutoModelForCausalLM, AutoTokenizer as T; \
AutoModelForCausalLM.from_pretrained('hf-export'); T.from_pretrained('hf-export')"

Reads a sharded checkpoint of any world size (model weights only, never the optimizer) or a consolidated
safetensors file, a group of tensors at a time (--buffer-mb), never the whole model: one process exports a model of
any size in memory bounded by the group and the largest tensor. Writes config.json, safetensors shards of at most
--max-shard-mb with model.safetensors.index.json, in fp32 or bf16 (--dtype), and the tokenizer: the files of the
Hugging Face folder the run came from (model.pretrained: tokenizer, chat template, generation defaults) when it is
still there, else the run's data.tokenizer, or --tokenizer for one that has moved. The folder is written beside
--out and put in its place once complete, with shardlab_export.json in it: running again over an earlier export
replaces it. Any other --out that exists and holds files is refused, as is one that is a symbolic link, or that is,
lies inside or contains what the export reads (the step folder, the run's folder, its model.pretrained and
checkpoint.init_from, --base, the tokenizer): one line, nothing written (shardlab/checkpoint/export_folder.py).

A LoRA run's step folder holds its adapters only. Its export is the merged model (W + alpha / rank * B @ A): each
base tensor is read from where the run began (model.pretrained's folder, else checkpoint.init_from; --base for one
that has moved), the adapters merged in as it streams by. --adapter-only writes the adapters alone as a peft folder
(adapter_config.json, adapter_model.safetensors) for peft.PeftModel.from_pretrained on the base model.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from shardlab.checkpoint import weights
from shardlab.checkpoint.export_folder import out_refusal, staged_folder
from shardlab.checkpoint.hf_folder import safetensors_reader, step_folder_reader, weights_digest
from shardlab.distributed.cpu_allocator import configure_cpu_allocator
from shardlab.errors import CheckpointError, ConfigError
from shardlab.train import run_tool
from shardlab_tasks.lm.corpus.tokenizer import load_tokenizer
from shardlab_tasks.lm.hf.export_hf import DTYPES, export_hf, export_refusal, lora_base
from shardlab_tasks.lm.hf.peft import adapter_from_checkpoint
from shardlab_tasks.lm.models.lora import base_refusal, lora_on, merged_reader


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a step_N checkpoint directory or a consolidated .safetensors")
    parser.add_argument(
        "--out", type=Path, required=True, help="a new or empty folder to write, or an earlier export to replace"
    )
    parser.add_argument("--tokenizer", help="'byte' or a tokenizer.json; default: the run's data.tokenizer")
    parser.add_argument(
        "--ema", action="store_true", help="export the run's moving average of the weights (optimization.ema)"
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="dtype of the written weights")
    parser.add_argument("--max-shard-mb", type=float, default=5000, help="largest safetensors file (MB; default 5 GB)")
    parser.add_argument("--buffer-mb", type=float, default=256, help="tensors read at a time (MB, as stored)")
    parser.add_argument(
        "--adapter-only", action="store_true", help="a LoRA run: write its adapters as a peft folder, not merged"
    )
    parser.add_argument(
        "--base", type=Path, help="a LoRA run: its frozen base, if no longer at its model.pretrained or init_from"
    )
    return parser.parse_args(argv)


def reader(path: Path, ema: bool):
    """The checkpoint's tensors by name and a reader of them; with ``ema`` the average stands in for each parameter."""
    if not path.is_dir():
        if ema:
            raise CheckpointError(f"{path}: the EMA weights are in step_N checkpoint folders only; give one")
        return safetensors_reader(path)
    if not ema:
        return step_folder_reader(path)
    shapes, read = step_folder_reader(path, ("ema.", "model."))
    average, _ = step_folder_reader(path, ("ema.",))
    model, _ = step_folder_reader(path)
    weights.check_ema_entries(path, average, model)
    return shapes, read


def lora_export(args: argparse.Namespace, config: dict, protected: dict) -> Path | None:
    """A LoRA run's --adapter-only export (its out folder), None otherwise; the LoRA options refused elsewhere."""
    lora = lora_on(config["model"])
    if not lora and (args.adapter_only or args.base):
        option = "--adapter-only" if args.adapter_only else "--base"
        raise ConfigError(f"{option}: {args.checkpoint} is not of a LoRA run (its model.lora.rank is 0); drop it")
    if not args.adapter_only:
        return None
    if args.ema or args.base:
        raise ConfigError(
            f"--adapter-only writes the step folder's adapters as saved; drop {'--ema' if args.ema else '--base'}"
        )
    with staged_folder(args.out, protected) as staging:  # the adapters land whole, or not at all
        adapter_from_checkpoint(Path(args.checkpoint).expanduser(), staging)
    out = Path(args.out)
    print(f"wrote {out / 'adapter_config.json'} and {out / 'adapter_model.safetensors'}")
    return out


def run_folder(step: Path, config: dict) -> Path | None:
    """The run folder of step folder ``step``: where checkpoint.dir (relative to it) holds the step folders."""
    parts = Path(config["checkpoint"].get("dir") or "checkpoints").parts
    root = step.expanduser().absolute().parent
    if not step.is_dir() or Path(*parts).is_absolute() or root.parts[-len(parts) :] != parts:
        return None
    return root.parents[len(parts) - 1]


def protected_paths(args: argparse.Namespace, info: dict) -> dict[str, Path | str | None]:
    """What the export reads, which its --out may not be, lie in or contain (export_folder.out_refusal)."""
    config, checkpoint = info["config"], Path(args.checkpoint)
    line = info.get("line") or {}
    tokenizer = args.tokenizer or config["data"].get("tokenizer")
    return {
        "the checkpoint": checkpoint,
        "the description beside it": None if checkpoint.is_dir() else weights.config_file(checkpoint),
        "the run's folder": run_folder(checkpoint, config),
        "model.pretrained": config["model"].get("pretrained"),
        "checkpoint.init_from": config["checkpoint"].get("init_from"),
        "checkpoint.init_from as the run read it": line.get("as_written") if line.get("start") == "weights" else None,
        "--base": args.base,
        "the tokenizer": None if tokenizer in (None, "byte") else tokenizer,
    }


def init_from_as_read(info: dict, checkpoint: Path) -> dict:
    """The run's config with a relative checkpoint.init_from made the path the run read. The config keeps the text
    the user wrote (as for data.path and the run's folder name), which the run resolved from the folder it was
    started in; each checkpoint records that path made absolute at the run's start (its ``line``:
    shardlab/checkpoint/resume/line.py), so the export reads the same base wherever it runs. Refused in one line where
    the checkpoint has no such record, since this process's folder could hold another file of that name."""
    config = info["config"]
    init_from = config["checkpoint"].get("init_from")
    if not init_from or Path(init_from).expanduser().is_absolute():
        return config
    line, relative = info.get("line") or {}, Path(init_from).expanduser().parts
    written = Path(line.get("as_written") or "/") if line.get("start") == "weights" else Path("/")
    if written.is_absolute() and len(written.parts) > len(relative) and written.parts[-len(relative) :] == relative:
        return {**config, "checkpoint": {**config["checkpoint"], "init_from": str(written)}}
    raise ConfigError(
        f"checkpoint.init_from={init_from} in {checkpoint}'s config is relative to the folder the run was started in, "
        "which the checkpoint does not record; pass --base <the absolute path of that step folder or .safetensors>"
    )


def main(argv: list[str] | None = None) -> Path:
    args = parse(argv)
    info = weights.describe(args.checkpoint)
    config = info["config"]
    if config["task"]["name"] != "lm":
        raise ConfigError(
            f"{args.checkpoint} is a {config['task']['name']} checkpoint; only lm exports to Hugging Face"
        )
    protected = protected_paths(args, info)
    if reason := out_refusal(args.out, protected):  # before reading any weights
        raise ConfigError(f"--out {reason}")
    if (adapter := lora_export(args, config, protected)) is not None:
        return adapter
    reason = export_refusal(config["model"])  # before reading any weights
    if reason:
        raise ConfigError(f"cannot export {args.checkpoint} to Hugging Face: {reason}")
    spec = args.tokenizer or config["data"]["tokenizer"]
    try:
        tokenizer = load_tokenizer(spec, None if args.tokenizer else config["data"].get("eod_token"))
    except ConfigError as e:
        raise ConfigError(f"{e} (or pass the tokenizer the run used with --tokenizer)") from None
    shapes, read = reader(Path(args.checkpoint).expanduser(), args.ema)
    if lora_on(config["model"]):  # the step folder holds the adapters: merged into the base as it streams by
        base, source = lora_base(config if args.base else init_from_as_read(info, args.checkpoint), args.base)
        if reason := base_refusal(config["model"], weights_digest(source), str(source), f"{args.checkpoint}'s run"):
            raise CheckpointError(f"{reason}; give the base it began from (--base, or put it back at that path)")
        shapes, read = merged_reader(base, (shapes, read), config["model"], str(source))
    mb = 1 << 20
    hf = export_hf(
        shapes, read, config["model"], tokenizer, args.out, DTYPES[args.dtype],
        max_shard_bytes=int(args.max_shard_mb * mb), buffer_bytes=int(args.buffer_mb * mb), protected=protected,
    )  # fmt: skip
    print(f"wrote {args.out} ({hf['architectures'][0]}, {args.dtype}, vocabulary {hf['vocab_size']}, tokenizer {spec})")
    return args.out


def cli() -> None:
    """The console script (pyproject.toml's [project.scripts]): a mistake is one line and exit code 2."""
    # Each freed tensor group goes back to the OS (glibc would keep it for reuse): the export's memory stays its
    # bound, not the high-water mark of fragmented heaps (shardlab.distributed.cpu_allocator.configure_cpu_allocator).
    configure_cpu_allocator("lean")
    run_tool(main)


if __name__ == "__main__":
    cli()
