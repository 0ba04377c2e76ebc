"""shardlab's LMs as Hugging Face models: config.json, safetensors shards with their index, tokenizer files. arch=gpt
becomes a GPT-2 (``GPT2LMHeadModel``); arch=llama a ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``
or ``MistralForCausalLM``, with model.moe a ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM`` or
``Qwen3MoeForCausalLM``: the family the run was loaded from (model.pretrained), else the one its options need.

GPT-2 and shardlab's GPT agree point by point, checked against shardlab_tasks/lm/models/model.py:
  learned token + position embeddings (wte, wpe), pre-LayerNorm blocks, eps 1e-5 (nn.LayerNorm's default = GPT-2's);
  fused q|k|v projection with bias, heads split as (3, heads, head_dim), softmax scale 1/sqrt(head_dim) (SDPA's
  default = GPT-2's scale_attn_weights, no per-layer scaling); MLP of width int(mlp_ratio * dim) with biases and
  tanh-approximated GELU (GPT-2's "gelu_new"); final LayerNorm; output projection without bias, tied or not.
GPT-2's Conv1D stores weights as (in, out), the transpose of nn.Linear's (out, in).

shardlab's Llama (shardlab_tasks/lm/models/llama.py) follows LlamaForCausalLM's conventions, so its export renames and
nothing more (the names: shardlab_tasks/lm/hf/hf_models.py, the mapping loading reads too). Its options choose the
family: q/k RMSNorm is Qwen3's, q/k/v biases without an output bias Qwen2's, the four biases together any family's
``attention_bias``; an output bias alone, or q/k norms with q/k/v biases but none on the output, no family expresses,
and is refused. With ``model.moe`` the family is Qwen3-MoE (q/k norms), Qwen2-MoE (a gated shared expert) or Mixtral
(shardlab_tasks/lm/hf/moe_hub.py: ``moe_family``, ``export_refusal``, ``hf_moe_fields``), and the grouped experts are
written back one hub tensor per expert, each a view of its grouped tensor (``ExportTensor.index``), bit-exact.

The weights are streamed (shardlab/checkpoint/hf_folder.py): a group of tensors at a time is read from the
checkpoint, converted to the export's dtype and appended to its shard, so no process holds the model. A LoRA run's
step folder holds its adapters only: its export reads each base tensor from where the run began (``lora_base``:
model.pretrained's folder or checkpoint.init_from) and merges the adapters into it on the way
(shardlab_tasks.lm.models.lora.merged_reader), tensor by tensor, the same streaming.
transformers is not imported: the files are written by hand (safetensors' format, JSON).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from shardlab.checkpoint.export_folder import staged_folder
from shardlab.checkpoint.hf_folder import (
    ExportTensor,
    Reader,
    read_tensors,
    safetensors_reader,
    step_folder_reader,
    tensor_files,
    weight_files,
    write_shards,
)
from shardlab.errors import CheckpointError, ConfigError
from shardlab_tasks.lm.corpus.tokenizer import ByteTokenizer, Tokenizer, byte_tokenizer_json
from shardlab_tasks.lm.hf import moe_hub
from shardlab_tasks.lm.hf.hf_models import expert_pieces, read_config_json, weight_names
from shardlab_tasks.lm.models.llama import ffn_width

HF_ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
HF_ARCHITECTURES |= {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM"}
HF_ARCHITECTURES |= {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
"""config.json model_type -> the transformers class its export loads as."""

EMBEDDINGS = ("transformer.wte.weight", "model.embed_tokens.weight")
"""The token embedding's name in each family: its rows are the vocabulary."""

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""--dtype -> the dtype the shards are written in."""

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
    "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json",
)  # fmt: skip
"""Files of the folder a run came from (model.pretrained) that an export carries over as they are: the tokenizer, its
chat template (in tokenizer_config.json or a file of its own) and the generation defaults."""

SOURCE_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings", "sliding_window")
SOURCE_KEYS += ("use_sliding_window", "max_window_layers", "layer_types")
"""config.json fields an export keeps from the folder the run came from: token ids and attention-window settings that
the model section reads but does not keep as they were (Mistral's window becomes model.max_seq_len)."""


def export_refusal(model_cfg: dict) -> str | None:
    """Why no Hugging Face architecture can express this model config, or None when one can."""
    arch = model_cfg.get("arch", "gpt")
    if arch == "gpt":
        return gpt2_refusal(model_cfg)
    if arch != "llama":
        return f"model.arch={arch!r} has no Hugging Face counterpart; exported are gpt (GPT-2) and llama"
    if model_cfg.get("moe") is not None:
        return moe_hub.export_refusal(model_cfg)
    return llama_refusal(model_cfg)


def llama_refusal(model_cfg: dict) -> str | None:
    """Why no family's attention biases match this Llama config's, or None when one's do."""
    qkv, out = bool(model_cfg.get("qkv_bias")), bool(model_cfg.get("out_bias"))
    if out and not qkv:
        return "model.out_bias=true without model.qkv_bias: no Hugging Face family has an output bias alone"
    if qkv and not out and model_cfg.get("qk_norm"):
        return "model.qk_norm with model.qkv_bias but no out_bias: Qwen3's attention_bias sets all four or none"
    return None


def gpt2_refusal(model_cfg: dict) -> str | None:
    """Why GPT-2 cannot express this GPT config, or None when it can."""
    hidden = model_cfg["mlp_ratio"] * model_cfg["dim"]
    if hidden != int(hidden):
        return f"model.mlp_ratio * model.dim = {hidden} is fractional; GPT-2's n_inner is a whole number"
    return None


def family(model_cfg: dict, source: dict | None = None) -> str:
    """The config.json model_type the export writes: the source folder's when it expresses the model, else the one
    the Llama's options need (Qwen3 for q/k norms, Qwen2 for q/k/v biases without an output bias, else Llama)."""
    if model_cfg.get("arch", "gpt") == "gpt":
        return "gpt2"
    if model_cfg.get("moe") is not None:
        return moe_hub.moe_family(model_cfg)
    if model_cfg.get("qk_norm"):
        return "qwen3"
    if model_cfg.get("qkv_bias") and not model_cfg.get("out_bias"):
        return "qwen2"
    named = (source or {}).get("model_type")
    return "mistral" if named == "mistral" and not model_cfg.get("qkv_bias") else "llama"  # Mistral has no biases


def export_tensors(model_cfg: dict, shapes: dict[str, tuple]) -> list[ExportTensor]:
    """What the export writes, in the Hugging Face checkpoint's order: each tensor's name there, its name in the
    checkpoint (``shapes``: name -> shape as stored) and whether it is transposed; refused in one line when the
    checkpoint is not the model its config describes."""
    names = weight_names({**model_cfg, "arch": model_cfg.get("arch", "gpt")})
    pieces = expert_pieces(model_cfg) if model_cfg.get("arch") == "llama" else {}
    expected = set(names) | set(pieces)
    optional = {"head.out.weight"} if model_cfg.get("tie_embeddings") else set()  # a tied head: the embedding alone
    missing, extra = sorted(expected - set(shapes)), sorted(set(shapes) - expected - optional)
    if missing or extra:
        raise ConfigError(
            f"the checkpoint is not shardlab's {model_cfg.get('arch', 'gpt')} as its config describes it (missing: "
            f"{', '.join(missing[:3]) or '-'}; no Hugging Face place for: {', '.join(extra[:3]) or '-'}); not exported"
        )
    out = [ExportTensor(hf.key, ours, tuple(shapes[ours]), hf.transposed) for ours, hf in names.items()]
    for ours, parts in pieces.items():  # an MoE block's grouped experts, written back one hub tensor per expert
        out += [ExportTensor(key, ours, _piece_shape(shapes[ours], index), index=index) for key, index in parts]
    return out


def _piece_shape(shape: tuple, index: tuple) -> tuple[int, ...]:
    return tuple(torch.empty(shape, device="meta")[index].shape)


def llama_config(model_cfg: dict, vocab_size: int, model_type: str) -> dict:
    """config.json of the Llama family ``model_type`` that computes what ``model_cfg`` does."""
    head_dim = model_cfg.get("head_dim") or model_cfg["dim"] // model_cfg["num_heads"]
    theta = float(model_cfg["rope_theta"])
    scaling = model_cfg.get("rope_scaling")
    rope = {"rope_type": "default", "rope_theta": theta} if not scaling else {**scaling, "rope_theta": theta}
    config = {
        "architectures": [HF_ARCHITECTURES[model_type]],
        "model_type": model_type,
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
        # transformers 5 reads rope_parameters, 4.x reads rope_theta and rope_scaling: both, saying the same.
        "rope_theta": theta,
        "rope_scaling": dict(scaling) if scaling else None,
        "rope_parameters": rope,
        "attention_dropout": 0.0,
        "tie_word_embeddings": bool(model_cfg.get("tie_embeddings")),
        "initializer_range": model_cfg["init_std"],
        "use_cache": True,
    }
    if model_type not in ("qwen2", "qwen2_moe", "mixtral"):  # Qwen2's biases: q/k/v on, output off; Mixtral's none
        config["attention_bias"] = bool(model_cfg.get("qkv_bias"))
    if model_cfg.get("moe") is not None:
        config |= moe_hub.hf_moe_fields(model_cfg)
    if model_type in ("llama", "mistral", "mixtral"):
        config |= {"mlp_bias": False, "pretraining_tp": 1} if model_type == "llama" else {"sliding_window": None}
    else:
        config |= {"use_sliding_window": False, "sliding_window": None}
    return config


def gpt2_config(model_cfg: dict, vocab_size: int) -> dict:
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
        "use_cache": True,
    }


def hf_config(model_cfg: dict, vocab_size: int, eod: int, dtype: torch.dtype, source: dict | None) -> dict:
    """The config.json an export writes: the family's fields from the model section, and the source folder's token
    ids and window settings (SOURCE_KEYS) where the run came from one of the same family."""
    model_type = family(model_cfg, source)
    if model_type == "gpt2":
        config = gpt2_config(model_cfg, vocab_size)
    else:
        config = llama_config(model_cfg, vocab_size, model_type)
    config |= {"bos_token_id": eod, "eos_token_id": eod}
    if source and source.get("model_type") == model_type:
        config |= {k: source[k] for k in SOURCE_KEYS if k in source}
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    return {**config, "dtype": name, "torch_dtype": name}  # transformers 5's name for it, and 4.x's


def write_tokenizer(tokenizer: Tokenizer, vocab_size: int, max_seq_len: int, out: Path) -> None:
    """tokenizer.json, tokenizer_config.json and generation_config.json for the run's own tokenizer, which
    AutoTokenizer loads as a PreTrainedTokenizerFast."""
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
    # shardlab's sampler never picks the padding ids above the tokenizer's vocabulary; tell generate() the same.
    generation = {
        "bos_token_id": tokenizer.eod,
        "eos_token_id": tokenizer.eod,
        "suppress_tokens": list(range(tokenizer.vocab_size, vocab_size)) or None,
    }
    text = json.dumps({k: v for k, v in generation.items() if v is not None}, indent=1)
    (out / "generation_config.json").write_text(text)


def source_folder(model_cfg: dict, tokenizer: Tokenizer) -> Path | None:
    """The Hugging Face folder the run came from (model.pretrained), when it is still there and the run used its
    tokenizer: its tokenizer files and config.json are then carried over."""
    folder = model_cfg.get("pretrained")
    if not folder or not (Path(folder) / "config.json").is_file():
        return None
    used = Path(getattr(tokenizer, "path", "") or "")
    return Path(folder) if used == (Path(folder) / "tokenizer.json").resolve() else None


def export_hf(
    shapes: dict[str, tuple],
    read: Reader,
    model_cfg: dict,
    tokenizer: Tokenizer,
    out: Path,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = 5 << 30,
    buffer_bytes: int = 256 << 20,
    protected: dict[str, Path | str | None] | None = None,
) -> dict:
    """Write ``out`` (config.json, safetensors shards and index, tokenizer and generation files) for the Hugging
    Face family of ``model_cfg``, streaming the tensors ``read`` gives (``shapes``: name -> shape as stored) in groups
    of at most ``buffer_bytes``; written into a staging folder that replaces ``out`` once complete, refused where
    ``out`` is no folder an export may replace or one of ``protected`` (shardlab.checkpoint.export_folder). Returns
    the config written."""
    if reason := export_refusal(model_cfg):
        raise ConfigError(f"cannot export to Hugging Face: {reason}")
    tensors = export_tensors(model_cfg, shapes)
    vocab_size = next(t.shape[0] for t in tensors if t.key in EMBEDDINGS)
    if vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"the checkpoint's vocabulary ({vocab_size}) is smaller than the tokenizer's ({tokenizer.vocab_size}); "
            "pass the tokenizer the model was trained with (--tokenizer)"
        )
    source = source_folder(model_cfg, tokenizer)
    config = hf_config(model_cfg, vocab_size, tokenizer.eod, dtype, read_config_json(source) if source else None)
    with staged_folder(out, protected) as staging:
        write_shards(tensors, read, staging, dtype, max_shard_bytes, buffer_bytes)
        (staging / "config.json").write_text(json.dumps(config, indent=1))
        if source is None:
            write_tokenizer(tokenizer, vocab_size, model_cfg["max_seq_len"], staging)
        else:
            for name in TOKENIZER_FILES:
                if (source / name).is_file():
                    shutil.copyfile(source / name, staging / name)
    return config


# ---- a LoRA run's frozen base, read again for its merged export -----------------------------------------------------
def hf_folder_reader(folder: Path, model_cfg: dict) -> tuple[dict[str, tuple], Reader]:
    """The tensors of the model ``model_cfg`` in the Hugging Face folder ``folder``, by shardlab name and in
    shardlab's layout (GPT-2's Conv1D weights transposed back, an MoE block's experts stacked from the hub's
    per-expert tensors), as {name: shape}, and a Reader that reads each tensor alone from its file (safetensors'
    safe_open: that tensor's bytes only; a grouped expert tensor, its pieces)."""
    names = weight_names({**model_cfg, "arch": model_cfg.get("arch", "gpt")})
    pieces = expert_pieces(model_cfg) if model_cfg.get("arch") == "llama" else {}
    stored = tensor_files(weight_files(folder))  # exactly the files the index names, each checked a file
    wanted = [hf.key for hf in names.values()] + [key for parts in pieces.values() for key, _ in parts]
    if missing := [key for key in wanted if key not in stored]:
        raise CheckpointError(f"{folder} lacks tensor {missing[0]} ({len(missing)} such); is it the run's base?")
    shapes = {ours: tuple(stored[hf.key][1][:: -1 if hf.transposed else 1]) for ours, hf in names.items()}
    shapes |= {
        ours: _stacked_shape([(index, stored[key][1]) for key, index in parts]) for ours, parts in pieces.items()
    }

    def read_keys(keys: list[str]) -> dict[str, torch.Tensor]:
        by_file: dict[Path, list[str]] = {}
        for key in keys:
            by_file.setdefault(stored[key][0], []).append(key)
        return {k: t for file, group in by_file.items() for k, t in read_tensors(file, group, folder).items()}

    def read(wanted: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for name in wanted:
            if name in pieces:  # one grouped tensor: its experts read and stacked, the only one held
                parts = read_keys([key for key, _ in pieces[name]])
                out[name] = torch.empty(shapes[name], dtype=next(iter(parts.values())).dtype)
                for key, index in pieces[name]:
                    out[name][index] = parts.pop(key)
        single = read_keys([names[name].key for name in wanted if name not in pieces])
        for name in (n for n in wanted if n not in pieces):
            tensor = single.pop(names[name].key)
            out[name] = tensor.t() if names[name].transposed else tensor
        return out

    return shapes, read


def _stacked_shape(parts: list[tuple[tuple, tuple]]) -> tuple[int, ...]:
    """The shape of the tensor made of pieces (index, shape): each indexed dim as far as the pieces reach, the
    rest the pieces' own."""
    dims = len(parts[0][0])
    reach = [
        max(i + 1 if isinstance(i, int) else i.stop for i in (index[d] for index, _ in parts)) for d in range(dims)
    ]
    sliced = sum(not isinstance(i, int) for i in parts[0][0])  # the piece keeps a dim for each slice
    return (*reach, *parts[0][1][sliced:])


def lora_base(config: dict, base: Path | None) -> tuple[tuple[dict[str, tuple], Reader], Path]:
    """Where a LoRA run's frozen base is read from for its merged export, as ((shapes, reader), path): ``base`` when
    given, else the run's model.pretrained folder, else its checkpoint.init_from (a step_N folder or a consolidated
    .safetensors). Refused in one line when it is not there, or when the base was the seeded init."""
    pretrained, init_from = config["model"].get("pretrained"), config["checkpoint"].get("init_from")
    if base is None and not (pretrained or init_from):
        raise ConfigError(
            "this LoRA run's frozen base is the seeded init (it has no model.pretrained or checkpoint.init_from), "
            "which the merged export does not rebuild; export the adapters alone with --adapter-only"
        )
    key = "--base" if base is not None else "model.pretrained" if pretrained else "checkpoint.init_from"
    path = Path(base or pretrained or init_from).expanduser()
    if not path.exists():
        raise ConfigError(
            f"{key}={path}, the frozen base of this LoRA run that the merged export reads, is not there; pass "
            "--base <where it is now>, or --adapter-only to export the adapters alone"
        )
    if path.is_file():
        return safetensors_reader(path), path
    if (path / "config.json").is_file() and not (path / "shardlab.json").is_file():
        return hf_folder_reader(path, config["model"]), path
    return step_folder_reader(path), path
