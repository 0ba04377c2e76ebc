"""The Hugging Face side of the MoE block (shardlab_tasks/lm/models/moe.py), ready for shardlab_tasks/lm/hf/hf_models.py
to call: a config.json's MoE fields as a ``model.moe`` section, and where each hub tensor of a layer lands in the
block's grouped weights.

Hub files hold one tensor per expert; the block holds them stacked. For MoE layer N, F = ffn_dim, and the hub prefix
``model.layers.N.mlp.`` (Mixtral: ``model.layers.N.block_sparse_moe.``), block tensors under ``blocks.N.mlp.``:

- ``router.weight`` <- ``gate.weight``
- ``experts.gate_up_proj[E, :F]`` <- ``experts.E.gate_proj.weight`` (Mixtral ``experts.E.w1.weight``)
- ``experts.gate_up_proj[E, F:]`` <- ``experts.E.up_proj.weight`` (Mixtral ``w3``)
- ``experts.down_proj[E]`` <- ``experts.E.down_proj.weight`` (Mixtral ``w2``)
- ``shared.{gate,up,down}.weight`` <- ``shared_expert.*_proj.weight`` (Qwen2-MoE), ``shared_experts.*`` (DeepSeek-V3)
- ``shared.output_gate.weight`` <- ``shared_expert_gate.weight`` (Qwen2-MoE)
- ``router.score_bias`` <- ``gate.e_score_correction_bias`` (DeepSeek-V3)

Each placement is a slice of one expert's rows: a rank that holds experts [a, b) (FSDP2's shards of the experts'
dim, expert parallelism) reads only the hub tensors of those experts (shardlab/checkpoint/hf_folder.py, ``pieces``),
and the export writes each slice back under its hub name, bit-exact (no arithmetic: views of the grouped tensor).
shardlab_tasks/lm/hf/hf_models.py reads a folder's config.json through ``moe_section`` and ``attention_options``, and
names the model's tensors through ``single_names`` and ``expert_pieces``. No transformers import: config.json is JSON.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from shardlab_tasks.lm.config import ModelSection
from shardlab_tasks.lm.hf import hf_fields as fields
from shardlab_tasks.lm.hf.hf_fields import HFConfigError
from shardlab_tasks.lm.models.moe import family_config

MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")


class Placement(NamedTuple):
    hub_key: str
    """The tensor's name in the Hugging Face checkpoint."""
    ours: str
    """The block tensor it lands in (under blocks.N.mlp.)."""
    index: tuple
    """Where in that tensor: () for all of it, (E,) one expert, (E, slice) part of one expert's rows."""
    expert: int | None
    """The routed expert it belongs to (None: router, shared expert): what expert parallelism shards by."""


def moe_section(hf: dict[str, Any], path: Any) -> dict[str, Any]:
    """The ``model.moe`` fields of a config.json of an MoE family (with ``family``: its model_type), or one line
    naming the field that cannot be expressed, is of the wrong type or out of range
    (shardlab_tasks/lm/hf/hf_fields.py)."""
    model_type = hf.get("model_type")
    if model_type not in MOE_FAMILIES:
        raise HFConfigError(f"{path}: model_type={model_type!r} is not an MoE family; known: {MOE_FAMILIES}")
    if fields.number(hf, "router_jitter_noise", path, 0.0, positive=False):
        raise HFConfigError(f"{path}: router_jitter_noise={hf['router_jitter_noise']} is not implemented; set 0")
    if fields.integer(hf, "decoder_sparse_step", path, 1) != 1 or hf.get("mlp_only_layers"):
        raise HFConfigError(f"{path}: decoder_sparse_step/mlp_only_layers (dense layers between MoE ones) unsupported")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFConfigError(f"{path}: hidden_act={hf['hidden_act']!r} is not supported; the experts gate with silu")
    coef = fields.number(hf, "router_aux_loss_coef", path, 0.0, positive=False)
    if coef < 0:
        raise HFConfigError(f"{path}: router_aux_loss_coef={coef} must be a finite number >= 0")
    section = {"top_k": fields.integer(hf, "num_experts_per_tok", path), "aux_loss_coef": coef}
    if model_type == "mixtral":
        experts, ffn = fields.integer(hf, "num_local_experts", path), fields.integer(hf, "intermediate_size", path)
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        # Released Qwen checkpoints say num_experts; transformers 5 writes num_local_experts. Both default
        # norm_topk_prob to false (transformers' default; Qwen3-30B-A3B's config.json sets it true).
        key = "num_experts" if "num_experts" in hf else "num_local_experts"
        experts, ffn = fields.integer(hf, key, path), fields.integer(hf, "moe_intermediate_size", path)
        section["norm_topk_prob"] = fields.flag(hf, "norm_topk_prob", path, False)
        if model_type == "qwen2_moe":
            section["shared_ffn_dim"] = fields.integer(hf, "shared_expert_intermediate_size", path)
    else:
        experts, ffn = None, None
        section |= _deepseek_section(hf, path)
    if experts is not None:
        section |= {"num_experts": experts, "ffn_dim": ffn}
    if section["top_k"] > section["num_experts"]:
        raise HFConfigError(f"{path}: num_experts_per_tok={section['top_k']} is more than the experts there are")
    cfg = family_config(model_type, **section)
    return {"family": model_type, **{key: getattr(cfg, key) for key in section}, **_family_defaults(model_type)}


def attention_options(hf: dict[str, Any], path: Any, model_type: str, bias: bool) -> dict[str, Any]:
    """The attention biases of an MoE family's config.json (``bias``: its attention_bias): Qwen2-MoE's q/k/v carry
    biases as its ``qkv_bias`` says (true unless written false), its o_proj none; Mixtral's none; Qwen3-MoE's all
    four or none, as attention_bias says."""
    if model_type == "qwen2_moe":
        return {"qkv_bias": fields.flag(hf, "qkv_bias", path, True), "out_bias": False}
    if model_type == "mixtral" and bias:
        raise HFConfigError(f"{path}: attention_bias=true is not Mixtral's (its attention has no biases)")
    return {"qkv_bias": bias, "out_bias": bias}


def moe_family(model_cfg: ModelSection) -> str:
    """The hub family whose tensor names an MoE model section's weights carry: Qwen3-MoE's q/k norms, Qwen2-MoE's
    gated shared expert, else Mixtral's (what each family's config.json makes of the section, moe_section)."""
    if model_cfg.get("qk_norm"):
        return "qwen3_moe"
    return "qwen2_moe" if model_cfg["moe"].get("shared_ffn_dim") else "mixtral"


def _all_placements(model_cfg: ModelSection) -> list[tuple[int, Placement]]:
    family, moe = moe_family(model_cfg), dict(model_cfg["moe"])
    return [(i, p) for i in range(model_cfg["num_layers"]) for p in layer_placements(family, i, moe)]


def single_names(model_cfg: ModelSection) -> dict[str, str]:
    """shardlab name -> hub name of an MoE model's block tensors that are one hub tensor each (router, shared
    expert and its gate)."""
    return {f"blocks.{i}.mlp.{p.ours}": p.hub_key for i, p in _all_placements(model_cfg) if p.index == ()}


class Piece(NamedTuple):
    key: str
    """The hub tensor's name."""
    index: tuple
    """Where in the grouped tensor it lies (Placement.index)."""


def expert_pieces(model_cfg: ModelSection) -> dict[str, list[Piece]]:
    """shardlab name of each grouped expert tensor -> the hub tensors it is made of, in expert order."""
    out: dict[str, list[Piece]] = {}
    for i, p in _all_placements(model_cfg):
        if p.index != ():
            out.setdefault(f"blocks.{i}.mlp.{p.ours}", []).append(Piece(p.hub_key, p.index))
    return out


def _deepseek_section(hf: dict[str, Any], path: Any) -> dict[str, Any]:
    if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
        raise HFConfigError(f"{path}: DeepSeek routing other than sigmoid + noaux_tc (V3's) is not supported")
    return {
        "num_experts": hf["n_routed_experts"],
        "ffn_dim": hf["moe_intermediate_size"],
        "shared_ffn_dim": hf.get("n_shared_experts", 0) * hf["moe_intermediate_size"],
        "num_groups": hf.get("n_group", 1),
        "topk_groups": hf.get("topk_group", 1),
        "routed_scaling": float(hf.get("routed_scaling_factor", 1.0)),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
    }


def _family_defaults(model_type: str) -> dict[str, Any]:
    """The family's fixed routing traits (not read from config.json)."""
    cfg = family_config(model_type)
    return {"score_func": cfg.score_func, "shared_expert_gate": cfg.shared_expert_gate, "score_bias": cfg.score_bias}


def layer_placements(model_type: str, layer: int, moe: dict[str, Any]) -> list[Placement]:
    """Every hub tensor of MoE layer ``layer`` and where it lands (``moe`` as moe_section returns it)."""
    mixtral = model_type == "mixtral"
    base = f"model.layers.{layer}.{'block_sparse_moe' if mixtral else 'mlp'}"
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    ffn = moe["ffn_dim"]
    out = [Placement(f"{base}.gate.weight", "router.weight", (), None)]
    for e in range(moe["num_experts"]):
        out += [
            Placement(f"{base}.experts.{e}.{names[0]}.weight", "experts.gate_up_proj", (e, slice(0, ffn)), e),
            Placement(f"{base}.experts.{e}.{names[1]}.weight", "experts.gate_up_proj", (e, slice(ffn, 2 * ffn)), e),
            Placement(f"{base}.experts.{e}.{names[2]}.weight", "experts.down_proj", (e,), e),
        ]
    if moe.get("shared_ffn_dim"):
        shared = f"{base}.shared_expert" if model_type == "qwen2_moe" else f"{base}.shared_experts"
        out += [Placement(f"{shared}.{p}_proj.weight", f"shared.{p}.weight", (), None) for p in ("gate", "up", "down")]
    if moe.get("shared_expert_gate"):
        out.append(Placement(f"{base}.shared_expert_gate.weight", "shared.output_gate.weight", (), None))
    if moe.get("score_bias"):
        out.append(Placement(f"{base}.gate.e_score_correction_bias", "router.score_bias", (), None))
    return out


# ---- the export: which family writes an MoE model section, and its config.json fields --------------------------------
def export_refusal(model_cfg: ModelSection) -> str | None:
    """Why no MoE family shardlab exports (Mixtral, Qwen2-MoE, Qwen3-MoE) computes what this model section does, or
    None when ``moe_family``'s does."""
    moe = model_cfg["moe"]
    if moe.get("score_func") != "softmax" or moe.get("score_bias") or moe.get("num_groups", 1) > 1:
        return (
            "model.moe: sigmoid, group-limited or bias-corrected routing is DeepSeek-V3's; shardlab does not export it"
        )
    if moe.get("routed_scaling", 1.0) != 1.0:
        return (
            f"model.moe.routed_scaling={moe['routed_scaling']}: the exported families do not scale the routed experts"
        )
    family, qkv, out = moe_family(model_cfg), bool(model_cfg.get("qkv_bias")), bool(model_cfg.get("out_bias"))
    if family == "mixtral" and (qkv or out or not moe.get("norm_topk_prob", True)):
        return (
            "model.moe without q/k norms or a shared expert is Mixtral's, which has no attention biases and always "
            "renormalises the top-k weights (norm_topk_prob=true)"
        )
    if family == "qwen2_moe" and (out or not moe.get("shared_expert_gate")):
        return "model.moe.shared_ffn_dim: Qwen2-MoE's shared expert is gated (shared_expert_gate), its o_proj unbiased"
    if family == "qwen3_moe" and (moe.get("shared_ffn_dim") or qkv != out):
        return "model.qk_norm with model.moe is Qwen3-MoE's: no shared expert, attention biases all four or none"
    return None


def hf_moe_fields(model_cfg: ModelSection) -> dict[str, Any]:
    """The config.json fields of ``moe_family``'s model that describe the MoE blocks of ``model_cfg``."""
    moe, family = model_cfg["moe"], moe_family(model_cfg)
    fields_ = {
        "num_experts_per_tok": moe["top_k"],
        "router_aux_loss_coef": moe["aux_loss_coef"],
        "output_router_logits": False,
    }
    if family == "mixtral":
        return fields_ | {
            "num_local_experts": moe["num_experts"],
            "intermediate_size": moe["ffn_dim"],
            "router_jitter_noise": 0.0,
        }
    fields_ |= {
        "num_experts": moe["num_experts"],
        "moe_intermediate_size": moe["ffn_dim"],
        "norm_topk_prob": bool(moe["norm_topk_prob"]),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    if family == "qwen2_moe":
        fields_ |= {"shared_expert_intermediate_size": moe["shared_ffn_dim"], "qkv_bias": bool(model_cfg["qkv_bias"])}
    return fields_
