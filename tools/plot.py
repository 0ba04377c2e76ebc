"""`python tools/plot.py` as before: the command is now `shardlab-plot` (shardlab_commands/plot.py), installed on the
PATH.

Kept for a clone's habits."""

from shardlab_commands.plot import cli

if __name__ == "__main__":
    cli()
