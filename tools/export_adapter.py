"""Write a LoRA run's adapters as a peft adapter folder (adapter_config.json, adapter_model.safetensors).

    python tools/export_adapter.py runs/lm/default/checkpoints/step_00000300 --out adapter/
    # then: peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(<model.pretrained>), "adapter/")

Reads only the step folder's model.* entries, which in a LoRA run are the adapters alone (the optimizer state never
comes into memory); the tensor names are peft's for the transformers model of the run's model.pretrained folder.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from shardlab.train import run_tool
from tasks.lm.lora import adapter_from_checkpoint


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a step_N checkpoint directory of a run with model.lora.rank > 0")
    parser.add_argument("--out", type=Path, required=True, help="the adapter folder to write")
    args = parser.parse_args(argv)
    out = adapter_from_checkpoint(args.checkpoint, args.out)
    print(f"wrote {out / 'adapter_config.json'} and {out / 'adapter_model.safetensors'}")
    return out


if __name__ == "__main__":
    run_tool(main)
