"""`python tools/evaluate.py` as before: the command is now `shardlab-evaluate` (shardlab_commands/evaluate.py),
installed on the PATH.

Kept for a clone's habits and for the benchmark JSON that recorded this path (shardlab_bench/tables.py --rerun)."""

from shardlab_commands.evaluate import cli

if __name__ == "__main__":
    cli()
