"""Write a checkpoint's model as one safetensors file (unsharded, on the CPU) plus its description as JSON beside it.

    shardlab-consolidate runs/lm/default/checkpoints/step_00000300 --out model.safetensors   # + model.json
    python -m shardlab.train checkpoint.init_from=model.safetensors                         # a new run from it

Reads only the model.* entries of the DCP checkpoint (the optimizer state never comes into memory), from a checkpoint
of any backend and world size. The file loads with plain ``safetensors.torch.load_file``, shardlab-generate and
``checkpoint.init_from``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from shardlab.checkpoint import weights
from shardlab.train import run_tool


def consolidate(checkpoint: Path, out: Path) -> Path:
    # The weights first: a refused index (crafted, overlapping chunks) ends the tool here, before it reads or writes
    # anything else, and an error is never caught to go on.
    state = weights.read_full(checkpoint)
    info = weights.describe(checkpoint)
    keep = ("task", "model_config", "config", "step", "samples_seen")
    return weights.write_safetensors(state, out, {"source": str(checkpoint), **{k: info.get(k) for k in keep}})


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a step_N checkpoint directory")
    parser.add_argument("--out", type=Path, required=True, help="the .safetensors file to write")
    args = parser.parse_args(argv)
    if args.out.suffix != ".safetensors":
        parser.error(f"--out {args.out}: give a name ending in .safetensors (the JSON goes beside it)")
    out = consolidate(args.checkpoint, args.out)
    print(f"wrote {out} and {weights.config_file(out)}")
    return out


def cli() -> None:
    """The console script (pyproject.toml's [project.scripts]): a mistake is one line and exit code 2."""
    run_tool(main)


if __name__ == "__main__":
    cli()
