"""A new architecture for the LM task: a gated causal-convolution language model (no attention, no positions).

Each block mixes tokens with a depthwise causal convolution gated by a linear projection of its input, then applies
an MLP; RMSNorm before each, a residual around each. One module holds all of it: the config dataclass (its schema),
the model, and the registration that ties both to the name ``gated_conv`` (``model.arch``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardlab.registry import MODELS
from shardlab_tasks.lm.models.architecture import LMArchitecture


@dataclass
class GatedConvConfig:
    arch: str = "gated_conv"
    """A name in MODELS (set by the registration: conf/model/*.yaml need not repeat it)."""
    num_layers: int = 2
    """Blocks, each one FSDP unit."""
    dim: int = 64
    """Residual stream width."""
    kernel_size: int = 4
    """Tokens each convolution sees: itself and the kernel_size - 1 before it."""
    mlp_ratio: float = 2.0
    """MLP hidden width as a multiple of dim."""
    init_std: float = 0.02
    """Std of the normal init of weights; the residual projections are scaled by 1/sqrt(2 * num_layers)."""
    max_seq_len: int = 1024
    """Longest sequence to train on (data.seq_len must not exceed it); the convolution itself has no limit."""
    vocab_size: int | None = None
    """Token vocabulary; null = the tokenizer's (rounded up to a multiple of 64)."""


class GatedConvBlock(nn.Module):
    def __init__(self, cfg: GatedConvConfig) -> None:
        super().__init__()
        self.mix_norm = nn.RMSNorm(cfg.dim)
        self.conv = nn.Conv1d(cfg.dim, cfg.dim, cfg.kernel_size, groups=cfg.dim, padding=cfg.kernel_size - 1)
        self.gate = nn.Linear(cfg.dim, cfg.dim)
        self.mix_out = nn.Linear(cfg.dim, cfg.dim)
        self.mlp_norm = nn.RMSNorm(cfg.dim)
        self.mlp_in = nn.Linear(cfg.dim, int(cfg.mlp_ratio * cfg.dim))
        self.mlp_out = nn.Linear(int(cfg.mlp_ratio * cfg.dim), cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mix_norm(x)
        # Padding on both sides, then keeping the first T outputs: position t sees tokens t-k+1 .. t only.
        mixed = self.conv(h.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
        x = x + self.mix_out(mixed * torch.sigmoid(self.gate(h)))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.mlp_norm(x))))


@MODELS.register("gated_conv", dataclass=GatedConvConfig)
class GatedConvLM(LMArchitecture):
    """Built by the LM task as GatedConvLM(cfg.model, vocab_size); token ids (B, T) -> logits (B, T, vocab)."""

    config_class = GatedConvConfig  # the LM task refuses model keys this dataclass does not declare

    def __init__(self, cfg: GatedConvConfig, vocab_size: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(GatedConvBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def fsdp_units(self) -> list[nn.Module]:
        """Shard each block on its own (gathered one at a time in forward and backward), and the embedding and head
        too: they are the largest matrices. The final norm stays in the root unit, which shardlab wraps last."""
        return [self.embed, *self.blocks, self.head]

    @classmethod
    def config_errors(cls, cfg: GatedConvConfig) -> list[str]:
        """Checked with every other config problem before anything starts; each message names its key."""
        keys = ("num_layers", "dim", "kernel_size", "max_seq_len")
        return [f"model.{key} must be >= 1, got {getattr(cfg, key)}" for key in keys if getattr(cfg, key) < 1]

    @classmethod
    def init_tensor(cls, cfg: GatedConvConfig, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Fill the full tensor ``name``, drawing only from ``generator`` (which shardlab seeds from the run's seed
        and the name): every rank of every world size gets the same weights."""
        if "norm" in name:
            tensor.fill_(1.0)
        elif name.endswith("bias"):
            tensor.zero_()
        elif name.endswith("conv.weight"):
            tensor.normal_(0.0, 1.0 / math.sqrt(cfg.kernel_size), generator=generator)
        elif name.endswith(("mix_out.weight", "mlp_out.weight")):
            tensor.normal_(0.0, cfg.init_std / math.sqrt(2 * cfg.num_layers), generator=generator)
        else:
            tensor.normal_(0.0, cfg.init_std, generator=generator)
