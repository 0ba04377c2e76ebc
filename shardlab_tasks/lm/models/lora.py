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
``write_peft_adapter`` (shardlab_tasks/lm/hf/peft.py) writes peft's own folder format, which
``peft.PeftModel.from_pretrained`` loads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardlab.errors import CheckpointError
from shardlab_tasks.lm.config import ModelSection

ADAPTER_PARTS = ("lora_A", "lora_B")
"""The adapter submodules of a LoRALinear (peft's names): A projects down to the rank, B back up."""


def is_adapter(name: str) -> bool:
    """Whether the parameter or state-dict key ``name`` belongs to a LoRA adapter."""
    return any(f".{part}." in f".{name}" for part in ADAPTER_PARTS)


def lora_on(model_cfg: ModelSection) -> bool:
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
        self.adapter_on = True
        """False inside ``adapters_off``: the layer computes its base alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.adapter_on:
            return F.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Within it, every LoRALinear of ``model`` computes its frozen base alone: the model before its adapters, the
    reference of preference tuning (shardlab_tasks/lm/finetuning/dpo.py) with no second copy of a weight (peft's
    disable_adapter)."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for layer in layers:
        layer.adapter_on = False
    try:
        yield
    finally:
        for layer in layers:
            layer.adapter_on = True


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


def lora_errors(model_cfg: ModelSection, linear_names: list[str]) -> list[str]:
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


def _settings(model_cfg: Mapping) -> str:
    lora = model_cfg["lora"]
    return f"model.lora.rank={lora['rank']} 'model.lora.target_modules=[{','.join(lora['target_modules'])}]'"


def checkpoint_refusal(path: Path, saved: Mapping, current: Mapping, use: str) -> str | None:
    """Why the checkpoint ``path`` (saved with model section ``saved``) cannot start the run of model section
    ``current`` as ``use`` ("resume" or "init_from") because of model.lora; None when it can. A LoRA step folder
    holds the adapters alone: resuming it needs the same adapters (rank, target_modules; alpha and dropout may
    change), beginning from it needs a base it does not hold, and a folder without adapters resumes no LoRA run."""
    was, now = lora_on(saved), lora_on(current)
    merged = f"its merged export (shardlab-export {path} --out DIR, then model.pretrained=DIR)"
    if was and use == "init_from":
        return (
            f"checkpoint.init_from: {path} holds a LoRA run's adapters only, not a model's weights; begin from "
            f"{merged}, or continue its adapters with checkpoint.resume={path} and {_settings(saved)}"
        )
    if use != "resume" or not (was or now):
        return None
    if was and not now:
        return (
            f"{path} holds a LoRA run's adapters only ({_settings(saved)}), but this run has model.lora.rank=0: set "
            f"{_settings(saved)} to resume it, or train the whole model from {merged}"
        )
    if now and not was:
        return (
            f"{path} was saved without LoRA (model.lora.rank=0) and holds no adapters, but this run has "
            f"model.lora.rank={current['lora']['rank']}: put new adapters on its weights with "
            f"checkpoint.init_from={path} instead, or set model.lora.rank=0 to resume it"
        )
    base = current.get("pretrained") or "(checkpoint.init_from)"
    if reason := base_refusal(saved, current["lora"].get("base_digest"), str(base), f"{path}'s run"):
        return f"{reason}; put the base it began from back at that path"
    for key in ("rank", "target_modules"):
        if saved["lora"][key] != current["lora"][key]:
            return (
                f"{path} holds adapters of model.lora.{key}={saved['lora'][key]!r}, but this run has "
                f"model.lora.{key}={current['lora'][key]!r}: set {_settings(saved)} to resume it (alpha and dropout "
                f"may change), or train new adapters on {merged}"
            )
    return None


def base_refusal(saved: Mapping, digest: str | None, base: str, whose: str) -> str | None:
    """Why the frozen base read now (``digest``: shardlab.checkpoint.hf_folder.weights_digest) is not the one the
    LoRA run of model section ``saved`` recorded (model.lora.base_digest), or None when it is, or either is unknown
    (a checkpoint older than the record). Its adapters on another base compute another model, with no error."""
    recorded = (saved.get("lora") or {}).get("base_digest")
    if not recorded or not digest or recorded == digest:
        return None
    return (
        f"the frozen base {base} is not the one {whose} trained its adapters on: its weight files' names, sizes or "
        f"headers differ from those the run recorded (digest {digest}, recorded {recorded})"
    )


def init_adapter(name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
    """peft's default init: A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming_uniform, a=sqrt(5)), B = 0, so the adapted
    model starts as the base."""
    if ".lora_B." in f".{name}":
        tensor.zero_()
    else:
        bound = 1.0 / math.sqrt(tensor.shape[1])
        tensor.uniform_(-bound, bound, generator=generator)


# ---- the adapters merged into the weights -------------------------------------------------------------------------
def merge_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """One adapted layer's weight with its adapter folded in, in fp32: W + scaling * B @ A (W (out, in), A (rank,
    in), B (out, rank)): the plain layer that computes what the LoRALinear computes."""
    with torch.no_grad():
        return weight.float() + scaling * (b.float() @ a.float())


def scaling_of(model_cfg: ModelSection) -> float:
    """alpha / rank of model.lora: the factor each adapter's output is scaled by."""
    return model_cfg["lora"]["alpha"] / model_cfg["lora"]["rank"]


@torch.no_grad()
def merge_lora(state: Mapping[str, torch.Tensor], model_cfg: ModelSection) -> dict[str, torch.Tensor]:
    """The model state with every adapter merged into its layer's weight (``merge_weight``, cast back to W's dtype)
    and the adapter keys gone: the state of the plain model that computes the same. Full tensors, shardlab names
    (what shardlab_tasks/lm/hf/export_hf.py maps to Hugging Face names); without adapters: returned as is. The export
    streams the same merge a tensor at a time (``merged_reader``)."""
    if not lora_on(model_cfg):
        return dict(state)
    merged = {k: v for k, v in state.items() if not is_adapter(k)}
    for key in state:
        if key.endswith(".lora_A.weight"):
            layer = key.removesuffix(".lora_A.weight")
            a, b, w = state[key], state[f"{layer}.lora_B.weight"], state[f"{layer}.weight"]
            merged[f"{layer}.weight"] = merge_weight(w, a, b, scaling_of(model_cfg)).to(w.dtype)
    return merged


Reader = Callable[[list[str]], dict[str, torch.Tensor]]
"""Reads the named tensors, whole, on the CPU (shardlab.checkpoint.hf_folder.Reader)."""


def merged_reader(
    base: tuple[dict[str, tuple], Reader],
    adapters: tuple[dict[str, tuple], Reader],
    model_cfg: ModelSection,
    source: str,
) -> tuple[dict[str, tuple], Reader]:
    """The plain model's tensors (shapes by name, and a Reader) from the frozen base's and the adapters' (each
    (shapes, reader), shardlab names): an adapted layer's weight is read with its two adapters and merged
    (``merge_weight``, fp32), every other tensor read as the base stores it. A tensor at a time: nothing more is
    held than the tensors asked for and their adapters. Refused in one line, before any tensor is read, when the
    adapters do not fit the base (``source`` names it)."""
    (base_shapes, read_base), (adapter_shapes, read_adapters) = base, adapters
    scaling = scaling_of(model_cfg)
    layers = sorted({k.removesuffix(".lora_A.weight") for k in adapter_shapes if k.endswith(".lora_A.weight")})
    if not layers:
        raise CheckpointError("the step folder holds no LoRA adapters (lora_A, lora_B) though its model.lora.rank > 0")
    for layer in layers:
        weight, a, b = (f"{layer}.{part}weight" for part in ("", "lora_A.", "lora_B."))
        if weight not in base_shapes:
            raise CheckpointError(f"{source} has no {weight} for the adapter {layer}.lora_A; is that the run's base?")
        out, into = base_shapes[weight]
        if adapter_shapes.get(b, (None,))[0] != out or adapter_shapes[a][1] != into:
            raise CheckpointError(
                f"the adapters of {layer} ({list(adapter_shapes[a])}, {list(adapter_shapes.get(b, ()))}) do not fit "
                f"{weight} {[out, into]} in {source}; is that the run's base?"
            )
    adapted = set(layers)

    def read(names: list[str]) -> dict[str, torch.Tensor]:
        state = read_base(names)
        wanted = [n.removesuffix(".weight") for n in names if n.removesuffix(".weight") in adapted]
        pairs = read_adapters([f"{layer}.{part}.weight" for layer in wanted for part in ADAPTER_PARTS])
        for layer in wanted:
            a, b = pairs.pop(f"{layer}.lora_A.weight"), pairs.pop(f"{layer}.lora_B.weight")
            state[f"{layer}.weight"] = merge_weight(state[f"{layer}.weight"], a, b, scaling)
        return state

    return {k: v for k, v in base_shapes.items() if not is_adapter(k)}, read
