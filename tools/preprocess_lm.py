"""`python tools/preprocess_lm.py` as before: the command is now `shardlab-preprocess`
(shardlab_commands/preprocess_lm.py), installed on the PATH.

Kept for a clone's habits and for the preprocessing benchmarks, which run it as a script (shardlab_bench/preprocess.py,
preprocess_scaling.py)."""

from shardlab_commands.preprocess_lm import cli

if __name__ == "__main__":
    cli()
