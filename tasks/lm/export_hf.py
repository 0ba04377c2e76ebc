"""shardlab's GPT as a Hugging Face GPT-2 (``GPT2LMHeadModel``): config.json, model.safetensors, tokenizer files.

The architectures agree point by point, checked against tasks/lm/model.py:
  learned token + position embeddings (wte, wpe), pre-LayerNorm blocks, eps 1e-5 (nn.LayerNorm's default = GPT-2's);
  fused q|k|v projection with bias, heads split as (3, heads, head_dim), softmax scale 1/sqrt(head_dim) (SDPA's
  default = GPT-2's scale_attn_weights, no per-layer scaling); MLP of width int(mlp_ratio * dim) with biases and
  tanh-approximated GELU (GPT-2's "gelu_new"); final LayerNorm; output projection without bias, tied or not.
GPT-2's Conv1D stores weights as (in, out), the transpose of nn.Linear's (out, in). transformers is not imported:
the files are written by hand, so exporting needs only safetensors (and tokenizers for the byte tokenizer's file).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from shardlab.errors import ConfigError
from tasks.lm.tokenizer import ByteTokenizer, Tokenizer, byte_tokenizer_json

LINEAR_NAMES = {"attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}
"""shardlab block Linear -> GPT-2 block Conv1D (weights transposed)."""


def gpt2_refusal(model_cfg: dict) -> str | None:
    """Why GPT-2 cannot express this model config, or None when it can."""
    if model_cfg.get("arch", "gpt") != "gpt":
        return f"model.arch={model_cfg['arch']!r} is not shardlab's GPT; only arch=gpt maps onto GPT-2"
    hidden = model_cfg["mlp_ratio"] * model_cfg["dim"]
    if hidden != int(hidden):
        return f"model.mlp_ratio * model.dim = {hidden} is fractional; GPT-2's n_inner is a whole number"
    return None


def gpt2_state_dict(state: dict[str, torch.Tensor], num_layers: int, tied: bool) -> dict[str, torch.Tensor]:
    """shardlab GPT parameter names and layouts -> GPT2LMHeadModel's (tied: lm_head.weight left to transformers)."""
    expected = {"embed.tok.weight", "embed.pos.weight", "head.ln_f.weight", "head.ln_f.bias", "head.out.weight"}
    expected |= {f"blocks.{i}.{n}" for i in range(num_layers) for n in _block_names()}
    optional = {"head.out.weight"} if tied else set()  # a tied head may be stored under the embedding's name only
    missing, extra = sorted(expected - set(state) - optional), sorted(set(state) - expected)
    if missing or extra:
        raise ConfigError(
            "the checkpoint is not shardlab's GPT as its config describes it (missing: "
            f"{', '.join(missing[:3]) or '-'}; no GPT-2 place for: {', '.join(extra[:3]) or '-'}); not exported"
        )
    out = {
        "transformer.wte.weight": state["embed.tok.weight"],
        "transformer.wpe.weight": state["embed.pos.weight"],
        "transformer.ln_f.weight": state["head.ln_f.weight"],
        "transformer.ln_f.bias": state["head.ln_f.bias"],
    }
    if not tied:
        out["lm_head.weight"] = state["head.out.weight"]
    for i in range(num_layers):
        src, dst = f"blocks.{i}.", f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            out[dst + f"{ln}.weight"] = state[src + f"{ln}.weight"]
            out[dst + f"{ln}.bias"] = state[src + f"{ln}.bias"]
        for ours, theirs in LINEAR_NAMES.items():
            out[dst + f"{theirs}.weight"] = state[src + f"{ours}.weight"].t()
            out[dst + f"{theirs}.bias"] = state[src + f"{ours}.bias"]
    return {k: v.detach().to(torch.float32).contiguous() for k, v in out.items()}


def _block_names() -> list[str]:
    names = [f"{ln}.{p}" for ln in ("ln_1", "ln_2") for p in ("weight", "bias")]
    return names + [f"{lin}.{p}" for lin in LINEAR_NAMES for p in ("weight", "bias")]


def gpt2_config(model_cfg: dict, vocab_size: int, eod: int) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab_size,
        "n_positions": model_cfg["max_seq_len"],
        "n_embd": model_cfg["dim"],
        "n_layer": model_cfg["num_layers"],
        "n_head": model_cfg["num_heads"],
        "n_inner": int(model_cfg["mlp_ratio"] * model_cfg["dim"]),
        "activation_function": "gelu_new",
        "resid_pdrop": model_cfg["dropout"],
        "embd_pdrop": model_cfg["dropout"],
        "attn_pdrop": model_cfg["dropout"],
        "layer_norm_epsilon": 1e-5,
        "initializer_range": model_cfg["init_std"],
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": bool(model_cfg["tie_embeddings"]),
        "bos_token_id": eod,
        "eos_token_id": eod,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def write_tokenizer(tokenizer: Tokenizer, vocab_size: int, max_seq_len: int, out: Path) -> str:
    """tokenizer.json + tokenizer_config.json that AutoTokenizer loads as a PreTrainedTokenizerFast; returns the
    end-of-document token's text."""
    if isinstance(tokenizer, ByteTokenizer):
        (out / "tokenizer.json").write_text(byte_tokenizer_json(vocab_size))
        eod_text = "<|endoftext|>"
    else:
        shutil.copyfile(tokenizer.path, out / "tokenizer.json")
        eod_text = tokenizer.tok.id_to_token(tokenizer.eod)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": eod_text,
        "eos_token": eod_text,
        "model_max_length": max_seq_len,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return eod_text


def export_gpt2(
    state: dict[str, torch.Tensor], model_cfg: dict, tokenizer: Tokenizer, out: Path
) -> dict[str, torch.Tensor]:
    """Write ``out`` (config.json, generation_config.json, model.safetensors, tokenizer files); returns the weights."""
    from safetensors.torch import save_file

    reason = gpt2_refusal(model_cfg)
    if reason:
        raise ConfigError(f"cannot export to GPT-2: {reason}")
    vocab_size = state["embed.tok.weight"].shape[0]
    if vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"the checkpoint's vocabulary ({vocab_size}) is smaller than the tokenizer's ({tokenizer.vocab_size}); "
            "pass the tokenizer the model was trained with (--tokenizer)"
        )
    weights = gpt2_state_dict(state, model_cfg["num_layers"], bool(model_cfg["tie_embeddings"]))
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(gpt2_config(model_cfg, vocab_size, tokenizer.eod), indent=1))
    # shardlab's sampler never picks the padding ids above the tokenizer's vocabulary; tell generate() the same.
    generation = {
        "bos_token_id": tokenizer.eod,
        "eos_token_id": tokenizer.eod,
        "suppress_tokens": list(range(tokenizer.vocab_size, vocab_size)) or None,
    }
    (out / "generation_config.json").write_text(
        json.dumps({k: v for k, v in generation.items() if v is not None}, indent=1)
    )
    write_tokenizer(tokenizer, vocab_size, model_cfg["max_seq_len"], out)
    return weights
