"""The LM's corpora: reading the sources (text, JSONL, Parquet/Arrow), tokenizing them, preprocessing into the cached
token files (one train.bin or shards), the cache's lock, and the datasets that read them back (blocks, weighted
mixtures). Imports only shardlab and the plug-in's own config and loss, never the models or fine-tuning."""
