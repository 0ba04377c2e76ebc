"""`python tools/evaluate.py` as before: the command is now `shardlab-evaluate` (shardlab_commands/evaluate.py),
installed on the PATH.

Kept for a clone's habits and for the self-supervised probes' JSON that recorded this path (docs/bench/ssl_probe_*.json,
which `python -m shardlab_bench tables --rerun ssl_probe` reruns)."""

from shardlab_commands.evaluate import cli

if __name__ == "__main__":
    cli()
