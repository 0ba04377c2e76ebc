"""Export an LM checkpoint as a Hugging Face directory (no custom code needed to load it): model.arch=gpt as a
GPT2LMHeadModel, model.arch=llama as a LlamaForCausalLM.

    python tools/export_hf.py runs/lm/default/checkpoints/step_00000300 --out hf-export
    python tools/export_hf.py model.safetensors --out hf-export       # a file from tools/consolidate.py
    python tools/export_hf.py runs/lm/default/checkpoints/step_00000300 --ema --out hf-ema  # optimization.ema's weights
    python -c "from transformers import AutoModelForCausalLM, AutoTokenizer as T; \
AutoModelForCausalLM.from_pretrained('hf-export'); T.from_pretrained('hf-export')"

Reads a sharded checkpoint of any world size (model weights only, never the optimizer) or a consolidated
safetensors file (shardlab.checkpoint.weights) and writes config.json,
generation_config.json, model.safetensors (fp32), tokenizer.json and tokenizer_config.json. The tokenizer is the one
the run was trained with (its data.tokenizer), or --tokenizer for one that has moved.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from shardlab.checkpoint import weights
from shardlab.errors import ConfigError
from shardlab.train import run_tool
from tasks.lm.export_hf import export_hf, export_refusal
from tasks.lm.tokenizer import load_tokenizer


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a step_N checkpoint directory or a consolidated .safetensors")
    parser.add_argument("--out", type=Path, required=True, help="directory to write (created)")
    parser.add_argument("--tokenizer", help="'byte' or a tokenizer.json; default: the run's data.tokenizer")
    parser.add_argument(
        "--ema", action="store_true", help="export the run's moving average of the weights (optimization.ema)"
    )
    args = parser.parse_args(argv)

    config = weights.describe(args.checkpoint)["config"]
    if config["task"]["name"] != "lm":
        raise ConfigError(
            f"{args.checkpoint} is a {config['task']['name']} checkpoint; only lm exports to Hugging Face"
        )
    reason = export_refusal(config["model"])  # before reading any weights
    if reason:
        raise ConfigError(f"cannot export {args.checkpoint} to Hugging Face: {reason}")
    spec = args.tokenizer or config["data"]["tokenizer"]
    try:
        tokenizer = load_tokenizer(spec, None if args.tokenizer else config["data"].get("eod_token"))
    except ConfigError as e:
        raise ConfigError(f"{e} (or pass the tokenizer the run used with --tokenizer)") from None
    state = weights.read_full(args.checkpoint, ema=args.ema)
    hf = export_hf(state, config["model"], tokenizer, args.out)
    print(f"wrote {args.out} ({hf['architectures'][0]}, vocabulary {hf['vocab_size']}, tokenizer {spec})")
    return args.out


if __name__ == "__main__":
    run_tool(main)
