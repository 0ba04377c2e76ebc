"""`python tools/preprocess_lm.py` as before: the command is now `shardlab-preprocess`
(shardlab_commands/preprocess_lm.py), installed on the PATH.

Kept for a clone's habits and for the benchmark JSON that recorded this path (shardlab_bench/tables.py --rerun)."""

from shardlab_commands.preprocess_lm import cli

if __name__ == "__main__":
    cli()
