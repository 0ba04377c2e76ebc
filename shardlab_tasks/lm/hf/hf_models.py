"""The Hugging Face families shardlab's LMs read and write: a ``config.json`` as a model section, and the one mapping
between shardlab's parameter names and the checkpoint's, used both to load (shardlab_tasks/lm/task.py) and to export
(shardlab_tasks/lm/hf/export_hf.py).

Families: Llama 3.x, Qwen2/2.5, Qwen3 and Mistral become ``model.arch=llama`` (shardlab_tasks/lm/models/llama.py) with
the options each needs; the mixtures of experts Mixtral, Qwen2-MoE and Qwen3-MoE the same with a ``model.moe`` section
(shardlab_tasks/lm/hf/moe_hub.py: its fields, and where each hub per-expert tensor lands in the grouped experts,
``expert_pieces``); DeepSeek-V3 and gpt-oss are refused in one line naming what shardlab lacks for them; GPT-2 becomes
``model.arch=gpt`` (shardlab_tasks/lm/models/model.py). A field of config.json that would change the
computation and that the architecture cannot express is refused in one line naming it (``HFConfigError``), before
any weight is read. Fields that change nothing shardlab computes in training (token ids, ``use_cache``,
``initializer_range``, ``dtype``) are not read, nor GPT-2's dropout rates: model.dropout is the fine-tuner's choice.
No transformers import: config.json is JSON.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

from omegaconf import DictConfig

from shardlab.config import TrainConfig, as_container
from shardlab.errors import first_cause
from shardlab.files.regular_file import NotAFile, read_small_file
from shardlab.task import setting
from shardlab_tasks.lm.config import ModelSection
from shardlab_tasks.lm.hf import hf_fields as fields
from shardlab_tasks.lm.hf import moe_hub
from shardlab_tasks.lm.hf.hf_fields import HFConfigError

LLAMA_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
"""config.json model_type values read as model.arch=llama."""
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
"""config.json model_type values read as model.arch=llama with model.moe (every block's MLP a mixture of experts)."""
FAMILIES = (*LLAMA_FAMILIES, *MOE_FAMILIES, "gpt2")
REFUSED_FAMILIES = {
    "deepseek_v3": "multi-head latent attention (q_lora_rank, kv_lora_rank, qk_rope_head_dim) and dense first layers "
    "(first_k_dense_replace)",
    "gpt_oss": "attention sinks, alternating sliding-window layers, biased experts and the clamped SwiGLU "
    "(swiglu_limit)",
}
"""MoE families shardlab knows and does not load -> what it lacks for them (said before any weight is read)."""

LLAMA_NAMES = {
    "attn_norm": "input_layernorm",
    "attn.q": "self_attn.q_proj",
    "attn.k": "self_attn.k_proj",
    "attn.v": "self_attn.v_proj",
    "attn.o": "self_attn.o_proj",
    "attn.q_norm": "self_attn.q_norm",
    "attn.k_norm": "self_attn.k_norm",
    "mlp_norm": "post_attention_layernorm",
    "mlp.gate": "mlp.gate_proj",
    "mlp.up": "mlp.up_proj",
    "mlp.down": "mlp.down_proj",
}
"""shardlab Llama block module -> the decoder layer module of LlamaForCausalLM, Qwen2/3's and Mistral's (one layout)."""

GPT2_LINEARS = {"attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}
"""shardlab GPT block Linear -> GPT-2 block Conv1D, whose weight is stored (in, out): the transpose of nn.Linear's."""

IGNORED_CHECKPOINT_KEYS = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")
"""Buffers older transformers saved beside the weights (GPT-2's causal mask, a RoPE table): recomputed, not read."""


class HFName(NamedTuple):
    key: str
    """The tensor's name in the Hugging Face checkpoint."""
    transposed: bool = False
    """Stored as the transpose of shardlab's tensor (GPT-2's Conv1D weights)."""


def weight_names(model_cfg: ModelSection) -> dict[str, HFName]:
    """shardlab parameter name -> its Hugging Face name, for every parameter of the model section ``model_cfg``
    that is one checkpoint tensor (a tied output projection has none: the checkpoint holds the embedding only; an
    MoE block's grouped experts are many: ``expert_pieces``)."""
    if model_cfg["arch"] == "gpt":
        return _gpt2_names(model_cfg["num_layers"], bool(model_cfg["tie_embeddings"]))
    names = _llama_names(model_cfg)
    if model_cfg.get("moe") is None:
        return names
    mlp = [f"blocks.{i}.mlp.{p}.weight" for i in range(model_cfg["num_layers"]) for p in ("gate", "up", "down")]
    single = {ours: HFName(key) for ours, key in moe_hub.single_names(model_cfg).items()}
    return {ours: hf for ours, hf in names.items() if ours not in mlp} | single


def expert_pieces(model_cfg: ModelSection) -> dict[str, list[moe_hub.Piece]]:
    """An MoE model's grouped expert weights -> the hub's per-expert tensors each is made of, and where each lies in
    it ({} for a dense model): what loading reads and the export writes back (shardlab_tasks/lm/hf/moe_hub.py)."""
    return moe_hub.expert_pieces(model_cfg) if model_cfg.get("moe") is not None else {}


def _gpt2_names(num_layers: int, tied: bool) -> dict[str, HFName]:
    names = {"embed.tok.weight": "transformer.wte.weight", "embed.pos.weight": "transformer.wpe.weight"}
    names |= {f"head.ln_f.{p}": f"transformer.ln_f.{p}" for p in ("weight", "bias")}
    out = {ours: HFName(theirs) for ours, theirs in names.items()}
    if not tied:
        out["head.out.weight"] = HFName("lm_head.weight")
    for i in range(num_layers):
        src, dst = f"blocks.{i}.", f"transformer.h.{i}."
        for p in ("weight", "bias"):
            out |= {f"{src}{ln}.{p}": HFName(f"{dst}{ln}.{p}") for ln in ("ln_1", "ln_2")}
            out |= {f"{src}{o}.{p}": HFName(f"{dst}{t}.{p}", p == "weight") for o, t in GPT2_LINEARS.items()}
    return out


def _llama_names(m: Any) -> dict[str, HFName]:
    out = {"embed.weight": HFName("model.embed_tokens.weight"), "head.norm.weight": HFName("model.norm.weight")}
    if not m.get("tie_embeddings"):
        out["head.out.weight"] = HFName("lm_head.weight")
    qk_norms = ("attn.q_norm", "attn.k_norm")
    modules = [n for n in LLAMA_NAMES if n not in qk_norms] + (list(qk_norms) if m.get("qk_norm") else [])
    biases = [n for n, on in (("attn.q", "qkv_bias"), ("attn.k", "qkv_bias"), ("attn.v", "qkv_bias")) if m.get(on)]
    biases += ["attn.o"] if m.get("out_bias") else []
    for i in range(m["num_layers"]):
        for ours in modules:
            out[f"blocks.{i}.{ours}.weight"] = HFName(f"model.layers.{i}.{LLAMA_NAMES[ours]}.weight")
        for ours in biases:
            out[f"blocks.{i}.{ours}.bias"] = HFName(f"model.layers.{i}.{LLAMA_NAMES[ours]}.bias")
    return out


# ---- config.json -> model section -----------------------------------------------------------------------------------
def read_config_json(folder: Path) -> dict[str, Any]:
    """The folder's config.json, or one line saying what is wrong with it."""
    path = folder / "config.json"
    try:
        hf = json.loads(read_small_file(path))
    except (FileNotFoundError, NotADirectoryError):
        raise HFConfigError(
            f"model.pretrained: {folder} has no config.json; give a Hugging Face model folder"
        ) from None
    except NotAFile as e:  # a link to /dev/zero, a FIFO: what it is, not "no config.json"
        raise HFConfigError(f"model.pretrained: {path} {e.reason}; give a Hugging Face model folder") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # nesting past Python's stack
        raise HFConfigError(f"model.pretrained: {path} is not readable JSON ({first_cause(e)})") from None
    if not isinstance(hf, dict):
        raise HFConfigError(f"model.pretrained: {path} holds no JSON object")
    return hf


def model_section(hf: dict[str, Any], path: Path) -> dict[str, Any]:
    """The model section (arch and every key config.json decides) that computes what ``hf`` (a config.json, at
    ``path``) describes; refused in one line naming the first field it cannot express, of the wrong type or out of
    range (shardlab_tasks/lm/hf/hf_fields.py), or a shape beyond the plan's bound (counted before any module is
    built)."""
    model_type = hf.get("model_type")
    if isinstance(model_type, str) and model_type in REFUSED_FAMILIES:
        raise HFConfigError(
            f"{path}: model_type={model_type!r} is not loaded: shardlab does not implement its "
            f"{REFUSED_FAMILIES[model_type]}; it loads {', '.join(FAMILIES)}"
        )
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise HFConfigError(
            f"{path}: model_type={model_type!r} is not a family shardlab loads; it loads {', '.join(FAMILIES)}"
        )
    for architecture in fields.names(hf, "architectures", path):
        if not architecture.endswith("ForCausalLM") and architecture != "GPT2LMHeadModel":
            raise HFConfigError(f"{path}: architectures={architecture!r} is not a causal LM; give a *ForCausalLM")
    section = _gpt2_section(hf, path) if model_type == "gpt2" else _llama_section(hf, path, model_type)
    vocab_size = fields.integer(hf, "vocab_size", path)
    if reason := fields.shape_refusal(section, vocab_size):
        raise HFConfigError(f"{path}: {reason}; is this config.json what you meant?")
    return {**section, "vocab_size": vocab_size}


def _require(hf: dict, path: Path, key: str, allowed: tuple, why: str) -> None:
    """Refuse ``key`` unless absent or one of ``allowed`` (a bool is not taken for 0 or 1, nor 1 for true)."""
    value = hf.get(key, allowed[0])
    if not any(value == ok and type(value) is type(ok) for ok in allowed):
        raise HFConfigError(f"{path}: {key}={value!r} is not supported ({why}); shardlab loads {allowed[0]!r}")


def _head_dim(hf: dict, path: Path, dim: int, heads: int) -> int | None:
    """config.json's head_dim for the section: None where it is dim / heads (the section then reads as shardlab's
    own Llama's); a width the heads do not divide needs one."""
    head_dim = fields.optional_integer(hf, "head_dim", path)
    if head_dim is None and dim % heads:
        raise HFConfigError(
            f"{path}: hidden_size={dim} is not divisible by num_attention_heads={heads} and head_dim is absent; "
            "give head_dim"
        )
    return None if head_dim in (None, dim // heads) and dim % heads == 0 else head_dim


def _llama_section(hf: dict, path: Path, model_type: str) -> dict[str, Any]:
    _require(hf, path, "hidden_act", ("silu",), "the SwiGLU MLP gates with SiLU")
    _require(hf, path, "mlp_bias", (False,), "the MLP has no biases")
    _require(hf, path, "attention_dropout", (0, 0.0), "attention has no dropout")
    _require(hf, path, "pretraining_tp", (1, None), "tensor-parallel slicing of the pretraining is not reproduced")
    _require(hf, path, "use_sliding_window", (False, None), "attention is full causal")
    dim, heads = fields.integer(hf, "hidden_size", path), fields.integer(hf, "num_attention_heads", path)
    bias = fields.flag(hf, "attention_bias", path, False)
    section = {
        "arch": "llama",
        "num_layers": fields.integer(hf, "num_hidden_layers", path),
        "dim": dim,
        "num_heads": heads,
        "num_kv_heads": fields.integer(hf, "num_key_value_heads", path, heads),
        "ffn_dim": fields.integer(hf, "intermediate_size", path),
        "max_seq_len": fields.integer(hf, "max_position_embeddings", path),
        "norm_eps": fields.number(hf, "rms_norm_eps", path),
        "head_dim": _head_dim(hf, path, dim, heads),
        "tie_embeddings": fields.flag(hf, "tie_word_embeddings", path, False),
        "qkv_bias": model_type == "qwen2" or bias,  # Qwen2's q/k/v always carry biases; its o_proj never
        "out_bias": bias and model_type != "qwen2",
        "qk_norm": model_type in ("qwen3", "qwen3_moe"),
        **_rope(hf, path),
    }
    section["moe"] = None  # a dense folder is dense even where the run's model section had experts
    if model_type in MOE_FAMILIES:
        section |= moe_hub.attention_options(hf, path, model_type, bias)
        section["moe"] = {k: v for k, v in moe_hub.moe_section(hf, path).items() if k != "family"}
    # Qwen2-MoE writes sliding_window=0 beside use_sliding_window=false (refused above when true): no window.
    window = fields.optional_integer(hf, "sliding_window", path, minimum=0 if model_type == "qwen2_moe" else 1)
    if window and model_type in ("mistral", "mixtral") and window < section["max_seq_len"]:
        # Mistral 7B v0.1 attends to the last 4096 tokens: the same as full causal attention up to that length.
        section["max_seq_len"] = window
    return section


def _rope(hf: dict, path: Path) -> dict[str, Any]:
    """rope_theta and rope_scaling, from transformers 5's rope_parameters or 4.x's rope_theta/rope_scaling."""
    params = fields.mapping(hf, "rope_parameters", path)
    scaling = fields.mapping(hf, "rope_scaling", path)
    found = [(f"{where}rope_theta", d.pop("rope_theta")) for where, d in (("rope_parameters.", params),
             ("", dict(hf)), ("rope_scaling.", scaling)) if "rope_theta" in d]  # fmt: skip
    thetas = [fields.number({key: value}, key, path) for key, value in found]  # each one given must be a number
    theta = thetas[0] if thetas else 10000.0
    scaling.pop("rope_theta", None)
    params, where = (params, "rope_parameters") if params else (scaling, "rope_scaling")
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default":
        return {"rope_theta": theta, "rope_scaling": None}
    if rope_type != "llama3":
        raise HFConfigError(f"{path}: rope_scaling.rope_type={rope_type!r} is not implemented; default and llama3 are")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    if missing := [k for k in keys if k not in params]:
        raise HFConfigError(f"{path}: rope_scaling (llama3) lacks {', '.join(missing)}")
    if extra := sorted(set(params) - set(keys)):
        raise HFConfigError(f"{path}: rope_scaling.{extra[0]} is not part of llama3 scaling; shardlab cannot use it")
    named = {f"{where}.{k}": v for k, v in params.items()}  # each field named where it is: rope_scaling.factor
    scaled = {k: fields.number(named, f"{where}.{k}", path) for k in keys[:3]}
    scaled[keys[3]] = fields.integer(named, f"{where}.{keys[3]}", path)
    return {"rope_theta": theta, "rope_scaling": {"rope_type": "llama3", **scaled}}


def _gpt2_section(hf: dict, path: Path) -> dict[str, Any]:
    _require(hf, path, "activation_function", ("gelu_new",), "the MLP uses tanh-approximated GELU")
    _require(hf, path, "layer_norm_epsilon", (1e-5,), "shardlab's GPT LayerNorms use eps 1e-5")
    _require(hf, path, "scale_attn_weights", (True,), "attention scales by 1/sqrt(head_dim)")
    _require(hf, path, "scale_attn_by_inverse_layer_idx", (False,), "no per-layer attention scaling")
    _require(hf, path, "reorder_and_upcast_attn", (False,), "attention is not upcast")
    _require(hf, path, "add_cross_attention", (False,), "a decoder only, no cross-attention")
    dim, heads = fields.integer(hf, "n_embd", path), fields.integer(hf, "n_head", path)
    if dim % heads:
        raise HFConfigError(f"{path}: n_embd={dim} is not divisible by n_head={heads}; GPT-2 splits the width evenly")
    inner = fields.optional_integer(hf, "n_inner", path) or 4 * dim
    return {
        "arch": "gpt",
        "num_layers": fields.integer(hf, "n_layer", path),
        "dim": dim,
        "num_heads": heads,
        "mlp_ratio": inner / dim,
        "max_seq_len": fields.integer(hf, "n_positions", path),
        "tie_embeddings": fields.flag(hf, "tie_word_embeddings", path, True),
    }


# ---- model.pretrained: the folder's config.json and tokenizer as the run's model and data sections ------------------
def apply_pretrained(cfg: DictConfig | TrainConfig) -> Path:
    """Write what the folder of model.pretrained decides into ``cfg``: the model section (its arch, shape and options,
    from config.json; init_std and the like stay the section's), and, where data.tokenizer is the default byte
    tokenizer, the folder's tokenizer.json with its end-of-text token. Idempotent (a rank given the resolved config
    resolves it to the same). Returns the folder. ``cfg``: the config the task is built from, rewritten in place: the
    composed DictConfig (the pre-flight's, or a rank's, as the task is built; the run's typed config is made from it
    later, so the run trains with and records the folder's section), or a typed one (its model section replaced by
    the folder's schema's dataclass)."""
    from omegaconf import OmegaConf, open_dict

    from shardlab_tasks.lm.config import GPTConfig, LlamaConfig

    folder = Path(cfg.model.pretrained).expanduser().resolve()
    if not folder.is_dir():
        # A requeue reruns the command that named the folder, so this is also where a deleted folder surfaces: say
        # that a resume needs it too (the checkpoint holds weights, not config.json, the tokenizer or a LoRA base).
        found = "is not a folder" if folder.exists() else "does not exist"
        raise HFConfigError(
            f"model.pretrained: {folder} {found}; every start of a run reads the model's config.json and tokenizer "
            "(with LoRA, its frozen base) from it, a resume from a checkpoint too: give the Hugging Face model folder "
            "at this path"
        )
    section = model_section(read_config_json(folder), folder / "config.json")
    schema = {"gpt": GPTConfig, "llama": LlamaConfig}[section["arch"]]
    kept = {k: v for k, v in as_container(cfg.model).items() if k in schema.__dataclass_fields__}
    model = OmegaConf.merge(OmegaConf.structured(schema), kept, section, {"pretrained": str(folder)})
    if not OmegaConf.is_config(cfg):  # typed: the section becomes the schema's dataclass, as typing would make it
        cfg.model = OmegaConf.to_object(model)
    else:
        with open_dict(cfg):
            cfg.model = model
    tokenizer = folder / "tokenizer.json"
    # Whatever is there (a FIFO, a dangling link) becomes data.tokenizer, for FileTokenizer to refuse in one line:
    # taken for "no tokenizer", the run would fall back to bytes against the folder's vocabulary.
    if cfg.data.tokenizer == "byte" and (tokenizer.exists() or tokenizer.is_symlink()):
        cfg.data.tokenizer = str(tokenizer)
        if setting(cfg.data, "eod_token") is None:
            cfg.data.eod_token = eos_token(folder)
    return folder


def eos_token(folder: Path) -> str | None:
    """The end-of-text token tokenizer_config.json names (eos_token), or None to let the tokenizer's be found."""
    path = folder / "tokenizer_config.json"
    try:
        eos = json.loads(read_small_file(path)).get("eos_token")
    except NotAFile as e:  # a FIFO there hung pre-flight for ever; a device or a huge file is no tokenizer config
        raise HFConfigError(f"model.pretrained: {path} {e.reason}; give a Hugging Face model folder") from None
    except (OSError, ValueError, AttributeError, RecursionError):  # unreadable: the tokenizer's own token is looked up
        return None
    return eos.get("content") if isinstance(eos, dict) else eos
