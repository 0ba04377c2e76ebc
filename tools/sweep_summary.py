"""`python tools/sweep_summary.py` as before: the command is now `shardlab-sweep-summary`
(shardlab_commands/sweep_summary.py), installed on the PATH.

Kept for a clone's habits."""

from shardlab_commands.sweep_summary import cli

if __name__ == "__main__":
    cli()
