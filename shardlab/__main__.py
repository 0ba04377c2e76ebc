from shardlab.train import cli

cli()
