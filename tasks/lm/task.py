"""Causal language modelling: next-token cross-entropy on fixed-length blocks of a preprocessed corpus."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from shardlab.registry import MODELS
from shardlab.task import Task
from tasks.lm.data import open_splits, prepare_corpus
from tasks.lm.model import init_gpt_tensor  # importing it registers the gpt architecture
from tasks.lm.tokenizer import load_tokenizer


def padded_vocab(vocab_size: int) -> int:
    """Round the embedding up to a multiple of 64: faster matmuls, and shardable over many ranks."""
    return (vocab_size + 63) // 64 * 64


class LanguageModelingTask(Task):
    unit = "tokens"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        # Loaded here, before any data or model work, so a bad tokenizer file stops the run in its first second.
        # .get: configs stored in checkpoints written before data.eod_token existed lack the key.
        self.tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data.get("eod_token"))
        self.vocab_size = cfg.model.vocab_size or padded_vocab(self.tokenizer.vocab_size)

    def config_errors(self) -> list[str]:
        m, d = self.cfg.model, self.cfg.data
        errors = [
            f"model.{key} must be >= 1, got {m[key]}"
            for key in ("num_layers", "dim", "num_heads", "max_seq_len")
            if m[key] < 1
        ]
        if int(m.mlp_ratio * m.dim) < 1:
            errors.append(f"model.mlp_ratio ({m.mlp_ratio}) x model.dim ({m.dim}) must give an MLP at least 1 wide")
        if not 0 <= m.dropout < 1:
            errors.append(f"model.dropout must be in [0, 1), got {m.dropout}")
        if m.num_heads >= 1 and m.dim % m.num_heads:
            errors.append(f"model.num_heads ({m.num_heads}) must divide model.dim ({m.dim})")
        if d.seq_len < 1 or d.seq_len > m.max_seq_len:
            errors.append(
                f"data.seq_len ({d.seq_len}) must be in [1, model.max_seq_len={m.max_seq_len}]; "
                "raise model.max_seq_len or lower data.seq_len"
            )
        if self.vocab_size < self.tokenizer.vocab_size:
            errors.append(
                f"model.vocab_size ({self.vocab_size}) is smaller than the vocabulary of data.tokenizer "
                f"({self.tokenizer.name}: {self.tokenizer.vocab_size} tokens); use model.vocab_size=null to follow it"
            )
        if not 0 <= d.valid_percent < 100:
            errors.append(f"data.valid_percent must be in [0, 100), got {d.valid_percent}")
        return errors

    def prepare_data(self) -> None:
        corpus = self.corpus()
        self.meta = json.loads((corpus / "meta.json").read_text())
        self.train_dataset, self.valid_dataset = open_splits(corpus, self.cfg.data.seq_len)

    def corpus(self) -> Path:
        """The preprocessed corpus of data.* (built on first use, then read from data.cache_dir)."""
        d = self.cfg.data
        return prepare_corpus(
            d.path,
            d.cache_dir,
            self.tokenizer,
            d.valid_percent,
            d.max_corpus_mb,
            d.get("jsonl_field", "text"),  # absent from configs of older checkpoints (generate.py reloads those)
            d.get("num_preprocess_workers", -1),
        )

    def build_model(self) -> nn.Module:
        return MODELS.build(self.cfg.model.arch, self.cfg.model, self.vocab_size, key="model.arch")

    def init_tensor(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        init_gpt_tensor(self.cfg.model, name, tensor, generator)

    def fsdp_units(self, model: nn.Module) -> list[nn.Module]:
        # Tied embeddings share one parameter between the first and last module, which FSDP2 cannot place in two
        # units: then both stay in the root unit and only the blocks are sharded separately.
        if self.cfg.model.tie_embeddings:
            return list(model.blocks)
        return [model.embed, *model.blocks, model.head]

    def example_batch(self, batch_size: int) -> torch.Tensor:
        return torch.zeros(batch_size, self.cfg.data.seq_len + 1, dtype=torch.long, device="meta")

    def loss(self, model: nn.Module, batch: torch.Tensor, device: torch.device):
        batch = batch.to(device, non_blocking=True)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = model(inputs)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
        n = targets.numel()
        return loss, {"loss_sum": loss.detach() * n, "count": torch.tensor(float(n))}

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        loss = sums["loss_sum"] / max(sums["count"], 1)
        return {"loss": loss, "ppl": math.exp(min(loss, 50.0))}

    def num_units(self, batch: torch.Tensor) -> int:
        return batch.shape[0] * (batch.shape[1] - 1)
