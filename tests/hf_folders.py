"""Tiny Hugging Face model folders of each family shardlab loads, made by transformers itself (random weights, no
download): bf16 safetensors in at least 3 shards with their index, and a byte-level tokenizer.json with
<|endoftext|>. Tests only: shardlab never imports transformers."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 320
"""256 byte tokens, <|endoftext|> at 256, padding ids up to 320 (shardlab_tasks.lm.corpus.tokenizer's
byte_tokenizer_json)."""

_LLAMA_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

FAMILIES = {
    "llama3": ("LlamaConfig", {**_LLAMA_SHAPE, "rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": False}),
    "llama3_tied": ("LlamaConfig", {**_LLAMA_SHAPE, "rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", {**_LLAMA_SHAPE, "tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {**_LLAMA_SHAPE, "head_dim": 32, "tie_word_embeddings": False}),
    "mistral": ("MistralConfig", {**_LLAMA_SHAPE, "sliding_window": 64, "head_dim": 16}),
    "gpt2": (
        "GPT2Config",
        dict(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=128,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=256,
            eos_token_id=256,
        ),
    ),
}
"""family -> (transformers config class, its arguments)."""

_MOE_SHAPE = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256, rms_norm_eps=1e-5, num_experts_per_tok=2, tie_word_embeddings=False,
    router_aux_loss_coef=0.02,
)  # fmt: skip
MOE_FAMILIES = {
    "mixtral": ("MixtralConfig", {**_MOE_SHAPE, "intermediate_size": 16, "num_local_experts": 4}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {**_MOE_SHAPE, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24, "num_experts": 4},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {**_MOE_SHAPE, "moe_intermediate_size": 16, "num_experts": 4, "head_dim": 16, "norm_topk_prob": True},
    ),
}
"""The mixtures of experts shardlab loads (issue 49): 4 experts, top-2, 2 layers; Qwen2-MoE with its gated shared
expert, Qwen3-MoE with q/k norms and a head_dim apart from hidden_size / heads."""


def write_tokenizer(folder: Path) -> None:
    from shardlab_tasks.lm.corpus.tokenizer import byte_tokenizer_json

    (folder / "tokenizer.json").write_text(byte_tokenizer_json(VOCAB))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def make_folder(
    family: str, folder: Path, seed: int = 0, *, shape: dict | None = None, max_shard_size: str = "40KB"
) -> Path:
    """A model of ``family`` saved by transformers in bf16 as >= 3 shards, with the tokenizer files; ``shape``:
    config arguments that replace the family's small ones (a larger model), ``max_shard_size`` transformers'."""
    import transformers

    config_class, kwargs = {**FAMILIES, **MOE_FAMILIES}[family]
    kwargs = {**kwargs, **(shape or {})}
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**kwargs))
    with torch.no_grad():  # transformers zeroes biases and sets norms to 1: random ones test that they are read
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    model.to(torch.bfloat16).save_pretrained(folder, max_shard_size=max_shard_size)
    write_tokenizer(folder)
    return folder


def reference(folder: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' fp32 logits on ``tokens[:, :-1]`` and its loss on ``tokens`` (labels = inputs, shifted inside),
    the model read from ``folder``: the logits and the loss shardlab's LM task computes on the same batch."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=tokens[:, :-1]).logits
        loss = model(input_ids=tokens, labels=tokens).loss
    return logits, loss


def moe_reference(folder: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' fp32 logits on ``tokens[:, :-1]``, and the two parts of the loss shardlab's first step computes
    on ``tokens``: the next-token cross-entropy, and router_aux_loss_coef x the load-balancing loss
    (``output_router_logits``) over the same input tokens."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=tokens[:, :-1], output_router_logits=True)
    loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), tokens[:, 1:].reshape(-1))
    return out.logits, loss, model.config.router_aux_loss_coef * out.aux_loss
