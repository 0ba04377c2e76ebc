"""A Llama-style decoder: pre-RMSNorm blocks, rotary positions, grouped-query causal attention, SwiGLU MLP; by default
an untied output projection and no biases. The options of the families it loads from Hugging Face folders
(shardlab_tasks/lm/hf/hf_models.py): an explicit head_dim, tied embeddings, q/k/v (and output) biases (Qwen2), q/k
RMSNorm (Qwen3), Llama 3.1's RoPE frequency scaling.

Every convention is Hugging Face's LlamaForCausalLM, so an export is a renaming (shardlab_tasks/lm/hf/export_hf.py):
RMSNorm in fp32 cast back before the weight; RoPE in the rotate-half layout (the first half of each head pairs with the
second, not neighbouring channels), frequencies theta^(-2i/head_dim) in fp32; query head h reads key/value head
h // (num_heads / num_kv_heads); softmax scale 1/sqrt(head_dim).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shardlab_tasks.lm.config import LlamaConfig
from shardlab_tasks.lm.models.architecture import LMArchitecture, below_one
from shardlab_tasks.lm.models.moe import MoEBlock, init_moe_tensor, moe_config_errors
from shardlab_tasks.lm.sft_packing import document_mask, segment_positions


def ffn_width(dim: int, ffn_dim: int | None) -> int:
    """The SwiGLU hidden width: model.ffn_dim, or 8/3 x model.dim rounded up to a multiple of 64."""
    return ffn_dim or math.ceil(8 * dim / 3 / 64) * 64


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def head_width(cfg: LlamaConfig) -> int:
    """Each attention head's width: model.head_dim, or model.dim / model.num_heads."""
    return cfg.head_dim or cfg.dim // cfg.num_heads


def llama3_scaled(inv_freq: torch.Tensor, scaling) -> torch.Tensor:
    """Llama 3.1's long-context frequencies (transformers' ``rope_type: llama3``): wavelengths longer than the original
    context / low_freq_factor are divided by ``factor``, shorter than original / high_freq_factor kept, and those
    between interpolated smoothly."""
    original = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = original / scaling.low_freq_factor, original / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (original / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotary_tables(
    length: int,
    head_dim: int,
    theta: float,
    device: torch.device,
    dtype: torch.dtype,
    scaling=None,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each (position, channel) angle, (length, head_dim), computed in fp32 (elementwise, so autocast
    leaves them alone) and cast to the activations' dtype. Computed once per forward and shared by every block: a
    table kept as a buffer would need initialising and sharding for no saving. ``scaling``: model.rope_scaling.
    ``positions`` (length,): the positions to rotate by, where they are not 0..length-1 (context parallelism)."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is not None:
        inv_freq = llama3_scaled(inv_freq, scaling)
    at = torch.arange(length, device=device) if positions is None else positions
    angles = at.to(torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each channel pair (i, i + head_dim/2) of ``x`` (batch, heads, length, head_dim) by its angle."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = head_width(cfg)
        self.q = nn.Linear(cfg.dim, cfg.num_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k = nn.Linear(cfg.dim, cfg.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v = nn.Linear(cfg.dim, cfg.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o = nn.Linear(cfg.num_heads * self.head_dim, cfg.dim, bias=cfg.out_bias)
        # Qwen3: each head's queries and keys normalised over head_dim, before RoPE.
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds its own num_heads / tp (and num_kv_heads / tp) of them.
        q = self.q(x).view(b, t, -1, self.head_dim)
        k = self.k(x).view(b, t, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if self.num_kv_heads < self.num_heads:
            # Expanded here rather than by SDPA's enable_gqa: CUDA's memory-efficient kernel (the fp32 one) has no
            # GQA and would fall back to the math kernel's (length x length) matrices; expanded, every device keeps
            # what a fused kernel keeps, which is what the memory plan counts.
            group = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        # A packed row's mask (shardlab_tasks/lm/sft_packing.py) keeps attention within each sample; without one, the
        # causal kernel of pretraining, untouched.
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        hidden = ffn_width(cfg.dim, cfg.ffn_dim)
        self.gate = nn.Linear(cfg.dim, hidden, bias=False)
        self.up = nn.Linear(cfg.dim, hidden, bias=False)
        self.down = nn.Linear(hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg) if getattr(cfg, "moe", None) is None else MoEBlock(cfg.moe, cfg.dim)
        self.routing_stats = None
        """An MoE block's RoutingStats of its last forward (shardlab_tasks/lm/models/moe.py), for the task's auxiliary
        loss: kept here rather than returned so the blocks keep one tensor in, one out (pipeline stages,
        checkpointing)."""

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        if isinstance(self.mlp, SwiGLU):
            return x + self.mlp(self.mlp_norm(x))
        out, self.routing_stats = self.mlp(self.mlp_norm(x))
        return x + out


class Head(nn.Module):
    """Final norm and output projection: one FSDP unit unless tied to the token embedding."""

    def __init__(self, cfg: LlamaConfig, vocab_size: int) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.out = nn.Linear(cfg.dim, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


class Llama(LMArchitecture):
    config_class = LlamaConfig

    def __init__(self, cfg: LlamaConfig, vocab_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.head = Head(cfg, vocab_size)
        if cfg.tie_embeddings:
            self.head.out.weight = self.embed.weight

    def forward(
        self, idx: torch.Tensor, segments: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits of ``idx`` (batch, length); ``segments`` (batch, length), for packed rows: which sample each
        position belongs to (shardlab_tasks/lm/sft_packing.py): positions restart and attention stays within each.
        ``positions`` (length,): each token's index in the whole sequence, under context parallelism (this rank's
        load-balanced slice of it, shardlab_tasks/lm/models/context_parallel.py)."""
        x = self.embed(idx)
        cos, sin = rotary_tables(
            idx.shape[1], head_width(self.cfg), self.cfg.rope_theta, x.device, x.dtype, self.cfg.rope_scaling,
            positions=positions,
        )  # fmt: skip
        mask = None
        if segments is not None:
            positions = segment_positions(segments)
            cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # (batch, 1, length, head_dim)
            mask = document_mask(segments)
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        return self.head(x)

    def take_routing_stats(self) -> list:
        """The MoE blocks' RoutingStats of the last forward, in layer order ([] for a dense model), let go of by the
        blocks so no graph outlives its step. The Block modules themselves, not ``self.blocks``' entries: under
        activation checkpointing those are wrappers, where setting the attribute would shadow the block's own from
        the next step on (its loads and auxiliary loss silently gone)."""
        blocks = [module for module in self.modules() if isinstance(module, Block)]
        stats = [block.routing_stats for block in blocks if block.routing_stats is not None]
        for block in blocks:
            block.routing_stats = None
        return stats

    def fsdp_units(self) -> list[nn.Module]:
        # Untied, the embedding and the head are the two largest matrices of a small model: each its own unit. Tied,
        # their shared weight cannot sit in two units: both stay in the root (as GPT's).
        if self.cfg.tie_embeddings:
            return list(self.blocks)
        return [self.embed, *self.blocks, self.head]

    def tensor_parallel_plan(self) -> dict:
        from shardlab_tasks.lm.models.tensor_parallel import llama_plan

        return llama_plan(qk_norm=self.cfg.qk_norm, moe=getattr(self.cfg, "moe", None) is not None)

    @classmethod
    def tensor_parallel_errors(cls, m: LlamaConfig, vocab_size: int, degree: int) -> list[str]:
        from shardlab_tasks.lm.models.tensor_parallel import divisibility_errors

        sizes = {"model.num_heads": m.num_heads, "model.num_kv_heads": m.num_kv_heads}
        if getattr(m, "moe", None) is None:  # an MoE block is not split: it runs on each rank's tokens
            sizes["model.ffn_dim (the FFN width)"] = ffn_width(m.dim, m.ffn_dim)
        return divisibility_errors(degree, sizes | {"the vocabulary": vocab_size})

    @classmethod
    def config_errors(cls, m: LlamaConfig) -> list[str]:
        errors = below_one(m, ("num_layers", "dim", "num_heads", "num_kv_heads", "max_seq_len"))
        if m.head_dim is not None:
            if m.head_dim < 2 or m.head_dim % 2:
                errors.append(f"model.head_dim must be even and >= 2 (RoPE rotates channel pairs), got {m.head_dim}")
        elif m.num_heads >= 1 and m.dim % m.num_heads:
            errors.append(f"model.num_heads ({m.num_heads}) must divide model.dim ({m.dim}), or set model.head_dim")
        elif m.num_heads >= 1 and (m.dim // m.num_heads) % 2:
            errors.append(
                f"model.dim / model.num_heads = {m.dim // m.num_heads} must be even: RoPE rotates channel pairs"
            )
        errors += rope_scaling_errors(m.rope_scaling)
        if m.num_kv_heads >= 1 and m.num_heads % m.num_kv_heads:
            errors.append(f"model.num_kv_heads ({m.num_kv_heads}) must divide model.num_heads ({m.num_heads})")
        if m.ffn_dim is not None and m.ffn_dim < 1:
            errors.append(f"model.ffn_dim must be >= 1 (or null for 8/3 x dim), got {m.ffn_dim}")
        if m.rope_theta <= 0 or m.norm_eps <= 0:
            errors.append(f"model.rope_theta ({m.rope_theta}) and model.norm_eps ({m.norm_eps}) must be > 0")
        if m.init_std <= 0:  # normal_ would fail at init, after the process group is up
            errors.append(f"model.init_std must be > 0, got {m.init_std}")
        if getattr(m, "moe", None) is not None:
            errors += moe_config_errors(m.moe)
        return errors

    @classmethod
    def init_tensor(cls, cfg: LlamaConfig, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """N(0, init_std) weights (embedding and head too), the residual projections (attn.o, mlp.down) scaled by
        1/sqrt(2 * layers) as in GPT-2, unit norms; an MoE block's tensors alike
        (shardlab_tasks.lm.models.moe.init_moe_tensor)."""
        std, residual_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)
        if getattr(cfg, "moe", None) is not None and init_moe_tensor(name, tensor, generator, std, residual_std):
            return
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
        elif name.endswith("bias"):
            tensor.zero_()
        elif name.endswith(("attn.o.weight", "mlp.down.weight")):
            tensor.normal_(0.0, residual_std, generator=generator)
        else:
            tensor.normal_(0.0, cfg.init_std, generator=generator)


def rope_scaling_errors(scaling) -> list[str]:
    """Problems of model.rope_scaling (null, or Llama 3.1's llama3 scaling)."""
    if scaling is None:
        return []
    if scaling.rope_type != "llama3":
        return [f"model.rope_scaling.rope_type={scaling.rope_type!r} is not implemented; llama3 is (or null for none)"]
    errors = []
    if scaling.factor <= 0 or scaling.original_max_position_embeddings < 1:
        errors.append("model.rope_scaling.factor and original_max_position_embeddings must be > 0")
    if not 0 < scaling.low_freq_factor < scaling.high_freq_factor:
        errors.append(
            f"model.rope_scaling needs 0 < low_freq_factor ({scaling.low_freq_factor}) < high_freq_factor "
            f"({scaling.high_freq_factor})"
        )
    return errors
