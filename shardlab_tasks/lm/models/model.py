"""A GPT-style decoder: pre-LN blocks, causal attention through scaled_dot_product_attention, GELU MLP."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shardlab_tasks.lm.config import GPTConfig
from shardlab_tasks.lm.models.architecture import LMArchitecture, below_one
from shardlab_tasks.lm.sft_packing import document_mask, segment_positions


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, d = x.shape
        # -1 heads: under tensor parallelism each rank holds num_heads / tp of them
        # (shardlab_tasks/lm/models/tensor_parallel.py).
        q, k, v = self.qkv(x).view(b, t, 3, -1, d // self.num_heads).permute(2, 0, 3, 1, 4)
        # A packed row's mask (shardlab_tasks/lm/sft_packing.py) keeps attention within each sample; without one, the
        # causal kernel of pretraining, untouched.
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=dropout)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hidden = int(cfg.mlp_ratio * cfg.dim)
        self.fc = nn.Linear(cfg.dim, hidden)
        self.proj = nn.Linear(hidden, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.dim)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x), mask))
        return x + self.drop(self.mlp(self.ln_2(x)))


class Embeddings(nn.Module):
    def __init__(self, cfg: GPTConfig, vocab_size: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.tok(idx) + self.pos(positions))


class Head(nn.Module):
    """Final norm and output projection: one FSDP unit (tied to the token embedding when tie_embeddings)."""

    def __init__(self, cfg: GPTConfig, vocab_size: int) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.out = nn.Linear(cfg.dim, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln_f(x))


class GPT(LMArchitecture):
    config_class = GPTConfig

    def __init__(self, cfg: GPTConfig, vocab_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embeddings(cfg, vocab_size)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.head = Head(cfg, vocab_size)
        if cfg.tie_embeddings:
            self.head.out.weight = self.embed.tok.weight

    def forward(
        self, idx: torch.Tensor, segments: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits of ``idx`` (batch, length); ``segments`` (batch, length), for packed rows: which sample each
        position belongs to (shardlab_tasks/lm/sft_packing.py): positions restart and attention stays within each.
        ``positions`` (length,): each token's index in the whole sequence, under context parallelism (this rank's
        load-balanced slice of it, shardlab_tasks/lm/models/context_parallel.py)."""
        if segments is None:
            x, mask = self.embed(idx, positions), None
        else:
            x, mask = self.embed(idx, segment_positions(segments)), document_mask(segments)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)

    def fsdp_units(self) -> list[nn.Module]:
        # Tied embeddings share one parameter between the first and last module, which FSDP2 cannot place in two
        # units: then both stay in the root unit and only the blocks are sharded separately.
        if self.cfg.tie_embeddings:
            return list(self.blocks)
        return [self.embed, *self.blocks, self.head]

    def tensor_parallel_plan(self) -> dict:
        from shardlab_tasks.lm.models.tensor_parallel import gpt_plan

        return gpt_plan(self.cfg.dim)

    @classmethod
    def tensor_parallel_errors(cls, m: GPTConfig, vocab_size: int, degree: int) -> list[str]:
        from shardlab_tasks.lm.models.tensor_parallel import divisibility_errors

        sizes = {
            "model.num_heads": m.num_heads,
            "the MLP width (model.mlp_ratio x model.dim)": int(m.mlp_ratio * m.dim),
        }
        return divisibility_errors(degree, sizes | {"model.max_seq_len": m.max_seq_len, "the vocabulary": vocab_size})

    @classmethod
    def config_errors(cls, m: GPTConfig) -> list[str]:
        errors = below_one(m, ("num_layers", "dim", "num_heads", "max_seq_len"))
        if int(m.mlp_ratio * m.dim) < 1:
            errors.append(f"model.mlp_ratio ({m.mlp_ratio}) x model.dim ({m.dim}) must give an MLP at least 1 wide")
        if not 0 <= m.dropout < 1:
            errors.append(f"model.dropout must be in [0, 1), got {m.dropout}")
        if m.init_std <= 0:  # normal_ would fail at init, after the process group is up
            errors.append(f"model.init_std must be > 0, got {m.init_std}")
        if m.num_heads >= 1 and m.dim % m.num_heads:
            errors.append(f"model.num_heads ({m.num_heads}) must divide model.dim ({m.dim})")
        return errors

    @classmethod
    def init_tensor(cls, cfg: GPTConfig, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """GPT-2 init of the full tensor ``name``: N(0, init_std) weights, residual projections scaled by
        1/sqrt(2 * layers), zero biases, unit norms."""
        if ".ln_" in name or name.startswith("head.ln_f"):
            tensor.fill_(1.0 if name.endswith("weight") else 0.0)
        elif name.endswith("bias"):
            tensor.zero_()
        elif name.endswith(("attn.proj.weight", "mlp.proj.weight")):
            tensor.normal_(0.0, cfg.init_std / math.sqrt(2 * cfg.num_layers), generator=generator)
        else:
            tensor.normal_(0.0, cfg.init_std, generator=generator)
