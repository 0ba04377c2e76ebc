"""A LoRA run's adapters as a peft adapter folder (adapter_config.json, adapter_model.safetensors): the Hugging Face
side of LoRA (shardlab_tasks/lm/models/lora.py holds the layers), beside the name mapping it reads
(shardlab_tasks/lm/hf/hf_models.py), so the models never import the Hugging Face interop."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from shardlab.errors import CheckpointError
from shardlab.files.durable import follow_umask
from shardlab_tasks.lm.config import ModelSection
from shardlab_tasks.lm.hf.hf_models import weight_names
from shardlab_tasks.lm.models.lora import ADAPTER_PARTS, is_adapter, lora_on


def _layer_names(model_cfg: ModelSection, layers: list[str]) -> dict[str, str]:
    """shardlab layer name -> the transformers module name that carries its weight (hf_models.weight_names)."""
    names = weight_names(model_cfg)
    out = {}
    for layer in layers:
        hf = names.get(f"{layer}.weight")
        if hf is None:  # a tied output projection: transformers has no weight of its own there
            raise ValueError(f"model.lora: {layer} has no weight of its own in the Hugging Face model; do not adapt it")
        out[layer] = hf.key.removesuffix(".weight")
    return out


def peft_adapter(state: Mapping[str, torch.Tensor], model_cfg: ModelSection) -> tuple[dict, dict[str, torch.Tensor]]:
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


def write_peft_adapter(state: Mapping[str, torch.Tensor], model_cfg: ModelSection, folder: Path) -> Path:
    """Write ``folder``/adapter_config.json and adapter_model.safetensors (``peft_adapter``); returns the folder."""
    from safetensors.torch import save_file

    config, tensors = peft_adapter(state, model_cfg)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    follow_umask(folder / "adapter_model.safetensors")  # safetensors writes 0600
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def adapter_from_checkpoint(checkpoint: Path, out: Path) -> Path:
    """A LoRA run's step folder (its adapters only: small, read whole on the CPU) as a peft adapter folder."""
    from shardlab.checkpoint import weights

    model_cfg = weights.describe(checkpoint)["model_config"]
    if not lora_on(model_cfg):
        raise CheckpointError(f"{checkpoint} is not of a LoRA run (its model.lora.rank is 0); it has no adapter")
    return write_peft_adapter(weights.read_full(checkpoint), model_cfg, out)
