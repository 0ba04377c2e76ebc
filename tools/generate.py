"""`python tools/generate.py` as before: the command is now `shardlab-generate` (shardlab_commands/generate.py),
installed on the PATH.

Kept for a clone's habits."""

from shardlab_commands.generate import cli

if __name__ == "__main__":
    cli()
