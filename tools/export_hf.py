"""`python tools/export_hf.py` as before: the command is now `shardlab-export` (shardlab_commands/export_hf.py),
installed on the PATH.

Kept for a clone's habits."""

from shardlab_commands.export_hf import cli

if __name__ == "__main__":
    cli()
