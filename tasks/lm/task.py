"""Causal language modelling: next-token cross-entropy on fixed-length blocks of a preprocessed corpus."""

from __future__ import annotations

import json
import math

import torch
import torch.nn.functional as F
from torch import nn

from shardlab.errors import ConfigError
from shardlab.registry import MODELS
from shardlab.task import Task
from tasks.lm.data import open_splits, prepare_corpus
from tasks.lm.tokenizer import load_tokenizer

ARCHITECTURE_METHODS = ("fsdp_units", "init_tensor")
"""What the LM task asks of a model architecture: a module class registered in MODELS under model.arch, built as
``cls(model_cfg, vocab_size)``, mapping token ids (B, T) to logits (B, T, vocab), with ``fsdp_units(self)`` (its
submodules to shard as separate units, in forward order) and the classmethod ``init_tensor(cfg, name, tensor,
generator)`` (fills one full parameter or buffer from the generator alone); optionally the classmethod
``config_errors(cfg)``. GPT in tasks/lm/model.py; a user_dir's in docs/tutorial.md."""


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
        self.vocab_size = cfg.model.get("vocab_size") or padded_vocab(self.tokenizer.vocab_size)

    @property
    def architecture(self) -> type[nn.Module]:
        """The model.arch class: builds the model and says how to check, initialise and shard it."""
        arch = MODELS.get(self.cfg.model.arch, key="model.arch")
        missing = [name for name in ARCHITECTURE_METHODS if not callable(getattr(arch, name, None))]
        if not isinstance(arch, type) or missing:
            raise ConfigError(
                f"model.arch={self.cfg.model.arch}: {getattr(arch, '__name__', arch)} is not a language-model "
                f"architecture: the LM task builds a module class defining {' and '.join(ARCHITECTURE_METHODS)} "
                "(tasks/lm/task.py: ARCHITECTURE_METHODS)"
            )
        return arch

    def config_errors(self) -> list[str]:
        m, d = self.cfg.model, self.cfg.data
        try:
            arch = self.architecture
        except ConfigError as e:
            return [str(e)]
        errors = list(getattr(arch, "config_errors", lambda m: [])(m))
        max_seq_len = m.get("max_seq_len", d.seq_len)  # an architecture without a position limit may omit it
        if d.seq_len < 1 or d.seq_len > max_seq_len:
            errors.append(
                f"data.seq_len ({d.seq_len}) must be in [1, model.max_seq_len={max_seq_len}]; "
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
        d = self.cfg.data
        corpus = prepare_corpus(
            d.path,
            d.cache_dir,
            self.tokenizer,
            d.valid_percent,
            d.max_corpus_mb,
            d.get("jsonl_field", "text"),  # absent from configs of older checkpoints (generate.py reloads those)
            d.get("num_preprocess_workers", -1),
        )
        self.meta = json.loads((corpus / "meta.json").read_text())
        self.train_dataset, self.valid_dataset = open_splits(corpus, d.seq_len)

    def build_model(self) -> nn.Module:
        return self.architecture(self.cfg.model, self.vocab_size)

    def init_tensor(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        self.architecture.init_tensor(self.cfg.model, name, tensor, generator)

    def fsdp_units(self, model: nn.Module) -> list[nn.Module]:
        return model.fsdp_units()

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
