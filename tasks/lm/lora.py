"""LoRA for shardlab's LMs: low-rank adapters on chosen nn.Linear layers (model.lora), the base frozen and sharded.

``apply_lora`` swaps each matching ``nn.Linear`` of the model on meta for a ``LoRALinear`` (itself an nn.Linear: its
``weight`` and ``bias`` keep their names, so loading model.pretrained, checkpoint.init_from and the export's name
mapping see the model they know) and freezes every parameter but the adapters. FSDP2 then shards base and adapters
in the same units; frozen parameters get no gradient, so the reduce-scatter, the optimizer (its param groups take
trainable parameters only) and the step folders (``checkpointed``) hold the adapters alone.

Why not peft itself: peft's ``inject_adapter_in_model`` does wrap shardlab's modules, and ``fully_shard`` and DCP
accept the result, but (1) importing peft imports transformers, which shardlab never does at run time, and (2) it
renames every adapted weight (``attn.q.weight`` -> ``attn.q.base_layer.weight``) and adds an adapter-name level
(``lora_A.default``), so the Hugging Face name mapping, the seeded init and checkpoints of the base would need a
second set of names. The layer below computes what peft's ``lora.Linear`` computes (tests compare them), and
``write_peft_adapter`` writes peft's own folder format, so ``peft.PeftModel.from_pretrained`` loads the result.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ADAPTER_PARTS = ("lora_A", "lora_B")
"""The adapter submodules of a LoRALinear (peft's names): A projects down to the rank, B back up."""


def is_adapter(name: str) -> bool:
    """Whether the parameter or state-dict key ``name`` belongs to a LoRA adapter."""
    return any(f".{part}." in f".{name}" for part in ADAPTER_PARTS)


def lora_on(model_cfg: Any) -> bool:
    """Whether the model section turns LoRA on (model.lora.rank > 0; sections of older checkpoints have no lora)."""
    lora = model_cfg.get("lora")
    return bool(lora) and lora["rank"] > 0


class LoRALinear(nn.Linear):
    """``base(x) + B(A(dropout(x))) * alpha / rank``: peft's lora.Linear, keeping the base's parameter names."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        like = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, **like)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, **like)
        self.lora_dropout = nn.Dropout(dropout)
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


def _matches(name: str, patterns: list[str]) -> bool:
    return any(fnmatch(name, p) or fnmatch(name, f"*.{p}") for p in patterns)


def target_names(model: nn.Module, patterns: list[str]) -> list[str]:
    """The names of the model's nn.Linear layers that model.lora.target_modules selects."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and _matches(n, list(patterns))]


def apply_lora(model: nn.Module, lora: Any) -> list[str]:
    """Swap the targeted nn.Linear layers of ``model`` for LoRALinear (in place, on any device; meta before sharding)
    and freeze every other parameter; returns the adapted layers' names."""
    names = target_names(model, lora.target_modules)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, LoRALinear(getattr(parent, child), lora.rank, lora.alpha, lora.dropout))
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    return names


def lora_errors(model_cfg: Any, linear_names: list[str]) -> list[str]:
    """Problems of model.lora, given the names of the model's nn.Linear layers (for a pattern that selects none)."""
    lora = model_cfg.lora
    if lora.rank < 0:
        return [f"model.lora.rank must be >= 0 (0 = LoRA off), got {lora.rank}"]
    if lora.rank == 0:
        return []
    errors = []
    if lora.alpha <= 0:
        errors.append(f"model.lora.alpha must be > 0 (the adapters are scaled by alpha / rank), got {lora.alpha}")
    if not 0 <= lora.dropout < 1:
        errors.append(f"model.lora.dropout must be in [0, 1), got {lora.dropout}")
    if not lora.target_modules:
        errors.append("model.lora.target_modules is empty; name the linear layers to adapt, e.g. ['attn.*']")
    for pattern in lora.target_modules:
        if not any(_matches(n, [pattern]) for n in linear_names):
            some = ", ".join(sorted({n.split(".", 2)[-1] for n in linear_names})[:8])
            errors.append(f"model.lora.target_modules: {pattern!r} matches no linear layer of the model; it has {some}")
    return errors


def init_adapter(name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
    """peft's default init: A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming_uniform, a=sqrt(5)), B = 0, so the adapted
    model starts as the base."""
    if ".lora_B." in f".{name}":
        tensor.zero_()
    else:
        bound = 1.0 / math.sqrt(tensor.shape[1])
        tensor.uniform_(-bound, bound, generator=generator)


# ---- a PEFT adapter folder, and the adapters merged into the weights -----------------------------------------------
def _layer_names(model_cfg: Any, layers: list[str]) -> dict[str, str]:
    """shardlab layer name -> the transformers module name that carries its weight (tasks/lm/hf_models.py)."""
    from tasks.lm.hf_models import weight_names

    names = weight_names(model_cfg)
    out = {}
    for layer in layers:
        hf = names.get(f"{layer}.weight")
        if hf is None:  # a tied output projection: transformers has no weight of its own there
            raise ValueError(f"model.lora: {layer} has no weight of its own in the Hugging Face model; do not adapt it")
        out[layer] = hf.key.removesuffix(".weight")
    return out


def peft_adapter(state: Mapping[str, torch.Tensor], model_cfg: Any) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, adapter_model.safetensors' tensors) in peft's format for the transformers model of
    ``model_cfg``, from the full (unsharded) adapter tensors of ``state`` (shardlab names; other keys ignored)."""
    lora = model_cfg["lora"]
    layers = sorted({k.rsplit(".", 2)[0] for k in state if is_adapter(k)})
    hf = _layer_names(model_cfg, layers)
    tensors = {
        f"base_model.model.{hf[layer]}.{part}.weight": state[f"{layer}.{part}.weight"].detach().contiguous().cpu()
        for layer in layers
        for part in ADAPTER_PARTS
    }
    gpt2 = model_cfg["arch"] == "gpt"
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": int(lora["rank"]),
        "lora_alpha": float(lora["alpha"]),
        "lora_dropout": float(lora["dropout"]),
        "target_modules": sorted(hf.values()),  # full module names: peft matches exactly these layers
        "bias": "none",
        "fan_in_fan_out": gpt2,  # GPT-2's Conv1D stores its weight (in, out): peft transposes when it merges
        "base_model_name_or_path": model_cfg.get("pretrained"),
        "inference_mode": True,
    }
    return config, tensors


def write_peft_adapter(state: Mapping[str, torch.Tensor], model_cfg: Any, folder: Path) -> Path:
    """Write ``folder``/adapter_config.json and adapter_model.safetensors (``peft_adapter``); returns the folder."""
    from safetensors.torch import save_file

    config, tensors = peft_adapter(state, model_cfg)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


@torch.no_grad()
def merge_lora(state: Mapping[str, torch.Tensor], model_cfg: Any) -> dict[str, torch.Tensor]:
    """The model state with every adapter merged into its layer's weight (W + alpha / rank * B @ A, in fp32, cast
    back to W's dtype) and the adapter keys gone: the state of the plain model that computes the same. Full tensors,
    shardlab names (what tasks/lm/export_hf.py maps to Hugging Face names); without adapters: returned as is."""
    if not lora_on(model_cfg):
        return dict(state)
    scaling = model_cfg["lora"]["alpha"] / model_cfg["lora"]["rank"]
    merged = {k: v for k, v in state.items() if not is_adapter(k)}
    for key in state:
        if key.endswith(".lora_A.weight"):
            layer = key.removesuffix(".lora_A.weight")
            a, b, w = state[key], state[f"{layer}.lora_B.weight"], state[f"{layer}.weight"]
            merged[f"{layer}.weight"] = (w.float() + scaling * (b.float() @ a.float())).to(w.dtype)
    return merged


def adapter_from_checkpoint(checkpoint: Path, out: Path) -> Path:
    """A LoRA run's step folder (its adapters only: small, read whole on the CPU) as a peft adapter folder."""
    from shardlab.checkpoint import weights
    from shardlab.errors import CheckpointError

    model_cfg = weights.describe(checkpoint)["model_config"]
    if not lora_on(model_cfg):
        raise CheckpointError(f"{checkpoint} is not of a LoRA run (its model.lora.rank is 0); it has no adapter")
    return write_peft_adapter(weights.read_full(checkpoint), model_cfg, out)
