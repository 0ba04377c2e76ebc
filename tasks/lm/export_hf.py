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
from tasks.lm.hf_models import weight_names
from tasks.lm.llama import ffn_width
from tasks.lm.tokenizer import ByteTokenizer, Tokenizer, byte_tokenizer_json

HF_ARCHITECTURES = {"gpt": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
"""model.arch -> the transformers class its export loads as."""


def export_refusal(model_cfg: dict) -> str | None:
    """Why no Hugging Face architecture can express this model config, or None when one can."""
    arch = model_cfg.get("arch", "gpt")
    if arch not in HF_ARCHITECTURES:
        known = ", ".join(f"{a} ({hf})" for a, hf in HF_ARCHITECTURES.items())
        return f"model.arch={arch!r} has no Hugging Face counterpart; exported are {known}"
    return gpt2_refusal(model_cfg) if arch == "gpt" else llama_refusal(model_cfg)


LOAD_ONLY_OPTIONS = ("head_dim", "tie_embeddings", "qkv_bias", "out_bias", "qk_norm", "rope_scaling")
"""Llama options of the families read from Hugging Face folders that the export does not write yet."""


def llama_refusal(model_cfg: dict) -> str | None:
    """Why the export cannot write this Llama config yet, or None when it can."""
    for key in LOAD_ONLY_OPTIONS:
        if model_cfg.get(key):
            return f"model.{key}={model_cfg[key]!r} is read from Hugging Face folders but not exported yet"
    return None


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


def hf_state_dict(state: dict[str, torch.Tensor], model_cfg: dict) -> dict[str, torch.Tensor]:
    """shardlab parameter names and layouts -> the Hugging Face architecture's (tasks/lm/hf_models.py, the mapping
    loading reads too), in fp32; a tied output projection is left to transformers."""
    arch = model_cfg.get("arch", "gpt")
    names = weight_names({**model_cfg, "arch": arch})
    tied = bool(model_cfg.get("tie_embeddings"))
    optional = {"head.out.weight"} if tied else set()  # a tied head may be stored under the embedding's name only
    _check_names(state, set(names) | optional, optional, "GPT" if arch == "gpt" else "Llama")
    out = {hf.key: state[ours].t() if hf.transposed else state[ours] for ours, hf in names.items()}
    return {k: v.detach().to(torch.float32).contiguous() for k, v in out.items()}


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
    weights = hf_state_dict(state, model_cfg)
    if model_cfg.get("arch", "gpt") == "llama":
        vocab_size = weights["model.embed_tokens.weight"].shape[0]
        config = llama_config(model_cfg, vocab_size, tokenizer.eod)
    else:
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
