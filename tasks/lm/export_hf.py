"""shardlab's LMs as Hugging Face models: config.json, model.safetensors, tokenizer files. arch=gpt becomes a GPT-2
(``GPT2LMHeadModel``), arch=llama a ``LlamaForCausalLM``.

GPT-2 and shardlab's GPT agree point by point, checked against tasks/lm/model.py:
  learned token + position embeddings (wte, wpe), pre-LayerNorm blocks, eps 1e-5 (nn.LayerNorm's default = GPT-2's);
  fused q|k|v projection with bias, heads split as (3, heads, head_dim), softmax scale 1/sqrt(head_dim) (SDPA's
  default = GPT-2's scale_attn_weights, no per-layer scaling); MLP of width int(mlp_ratio * dim) with biases and
  tanh-approximated GELU (GPT-2's "gelu_new"); final LayerNorm; output projection without bias, tied or not.
GPT-2's Conv1D stores weights as (in, out), the transpose of nn.Linear's (out, in).

shardlab's Llama (tasks/lm/llama.py) follows LlamaForCausalLM's conventions, so its export renames and nothing more:
q/k weights are stored in the rotate-half RoPE layout transformers uses (no permutation, unlike Meta's original
checkpoints), head_dim = dim / num_heads, rope_theta and rms_norm_eps as configured, no biases, untied lm_head.

transformers is not imported: the files are written by hand, so exporting needs only safetensors (and tokenizers for
the byte tokenizer's file).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from shardlab.errors import ConfigError
from tasks.lm.llama import ffn_width
from tasks.lm.tokenizer import ByteTokenizer, Tokenizer, byte_tokenizer_json

LINEAR_NAMES = {"attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}
"""shardlab block Linear -> GPT-2 block Conv1D (weights transposed)."""


LLAMA_NAMES = {
    "attn_norm": "input_layernorm",
    "attn.q": "self_attn.q_proj",
    "attn.k": "self_attn.k_proj",
    "attn.v": "self_attn.v_proj",
    "attn.o": "self_attn.o_proj",
    "mlp_norm": "post_attention_layernorm",
    "mlp.gate": "mlp.gate_proj",
    "mlp.up": "mlp.up_proj",
    "mlp.down": "mlp.down_proj",
}
"""shardlab Llama block module -> LlamaDecoderLayer module (weights only, same layout)."""

HF_ARCHITECTURES = {"gpt": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
"""model.arch -> the transformers class its export loads as."""


def export_refusal(model_cfg: dict) -> str | None:
    """Why no Hugging Face architecture can express this model config, or None when one can."""
    arch = model_cfg.get("arch", "gpt")
    if arch not in HF_ARCHITECTURES:
        known = ", ".join(f"{a} ({hf})" for a, hf in HF_ARCHITECTURES.items())
        return f"model.arch={arch!r} has no Hugging Face counterpart; exported are {known}"
    return gpt2_refusal(model_cfg) if arch == "gpt" else None


def gpt2_refusal(model_cfg: dict) -> str | None:
    """Why GPT-2 cannot express this GPT config, or None when it can."""
    hidden = model_cfg["mlp_ratio"] * model_cfg["dim"]
    if hidden != int(hidden):
        return f"model.mlp_ratio * model.dim = {hidden} is fractional; GPT-2's n_inner is a whole number"
    return None


def _check_names(state: dict[str, torch.Tensor], expected: set[str], optional: set[str], arch: str) -> None:
    missing, extra = sorted(expected - set(state) - optional), sorted(set(state) - expected)
    if missing or extra:
        raise ConfigError(
            f"the checkpoint is not shardlab's {arch} as its config describes it (missing: "
            f"{', '.join(missing[:3]) or '-'}; no Hugging Face place for: {', '.join(extra[:3]) or '-'}); not exported"
        )


def gpt2_state_dict(state: dict[str, torch.Tensor], num_layers: int, tied: bool) -> dict[str, torch.Tensor]:
    """shardlab GPT parameter names and layouts -> GPT2LMHeadModel's (tied: lm_head.weight left to transformers)."""
    expected = {"embed.tok.weight", "embed.pos.weight", "head.ln_f.weight", "head.ln_f.bias", "head.out.weight"}
    expected |= {f"blocks.{i}.{n}" for i in range(num_layers) for n in _block_names()}
    optional = {"head.out.weight"} if tied else set()  # a tied head may be stored under the embedding's name only
    _check_names(state, expected, optional, "GPT")
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


def llama_state_dict(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """shardlab Llama parameter names -> LlamaForCausalLM's (the layouts are the same)."""
    out = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "head.norm.weight"}
    out["lm_head.weight"] = "head.out.weight"
    for i in range(num_layers):
        for ours, theirs in LLAMA_NAMES.items():
            out[f"model.layers.{i}.{theirs}.weight"] = f"blocks.{i}.{ours}.weight"
    _check_names(state, set(out.values()), set(), "Llama")
    return {hf: state[ours].detach().to(torch.float32).contiguous() for hf, ours in out.items()}


def llama_config(model_cfg: dict, vocab_size: int, eod: int) -> dict:
    head_dim = model_cfg["dim"] // model_cfg["num_heads"]
    theta = float(model_cfg["rope_theta"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": model_cfg["dim"],
        "intermediate_size": ffn_width(model_cfg["dim"], model_cfg["ffn_dim"]),
        "num_hidden_layers": model_cfg["num_layers"],
        "num_attention_heads": model_cfg["num_heads"],
        "num_key_value_heads": model_cfg["num_kv_heads"],
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": model_cfg["max_seq_len"],
        "rms_norm_eps": model_cfg["norm_eps"],
        # transformers 5 reads rope_parameters, 4.x reads rope_theta: both, saying the same.
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": model_cfg["init_std"],
        "tie_word_embeddings": False,
        "bos_token_id": eod,
        "eos_token_id": eod,
        "torch_dtype": "float32",
        "use_cache": True,
    }


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


def export_hf(state: dict[str, torch.Tensor], model_cfg: dict, tokenizer: Tokenizer, out: Path) -> dict:
    """Write ``out`` (config.json, generation_config.json, model.safetensors, tokenizer files) for the Hugging Face
    architecture of ``model_cfg['arch']``; returns the config written."""
    from safetensors.torch import save_file

    reason = export_refusal(model_cfg)
    if reason:
        raise ConfigError(f"cannot export to Hugging Face: {reason}")
    if model_cfg.get("arch", "gpt") == "llama":
        weights = llama_state_dict(state, model_cfg["num_layers"])
        vocab_size = weights["model.embed_tokens.weight"].shape[0]
        config = llama_config(model_cfg, vocab_size, tokenizer.eod)
    else:
        weights = gpt2_state_dict(state, model_cfg["num_layers"], bool(model_cfg["tie_embeddings"]))
        vocab_size = weights["transformer.wte.weight"].shape[0]
        config = gpt2_config(model_cfg, vocab_size, tokenizer.eod)
    if vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"the checkpoint's vocabulary ({vocab_size}) is smaller than the tokenizer's ({tokenizer.vocab_size}); "
            "pass the tokenizer the model was trained with (--tokenizer)"
        )
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1))
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
    return config
