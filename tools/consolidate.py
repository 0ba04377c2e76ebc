"""`python tools/consolidate.py` as before: the command is now `shardlab-consolidate`
(shardlab_commands/consolidate.py), installed on the PATH.

Kept for a clone's habits."""

from shardlab_commands.consolidate import cli

if __name__ == "__main__":
    cli()
