"""The LM's models: GPT-2 and Llama-style transformers, mixture-of-experts blocks, LoRA layers, and their tensor- and
context-parallel plans. Imports only shardlab and the plug-in's own config and packed-row format (sft_packing.py)."""
