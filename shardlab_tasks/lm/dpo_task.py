"""The LM task on preference pairs (data.format=preference): DPO instead of next-token or answer-token loss.

LanguageModelingTask builds this subclass for data.format=preference, so task.name stays lm: a DPO run begins from an
SFT run's step folder (checkpoint.init_from compares task names), a model folder (model.pretrained) or LoRA adapters
the same way, and its checkpoints export as any LM's (shardlab-export). What differs is here: the pairs
(shardlab_tasks/lm/finetuning/preference.py), the loss and its reference (shardlab_tasks/lm/finetuning/dpo.py), the
metrics.
"""

from __future__ import annotations

import torch
from torch import nn

from shardlab.task import setting
from shardlab_tasks.lm.finetuning.dpo import (
    DPOSettings,
    ReferenceLogProbs,
    dpo_errors,
    preference_loss,
    summarize_preference,
)
from shardlab_tasks.lm.finetuning.preference import collate_pairs, open_preference_splits, pack_pairs
from shardlab_tasks.lm.models.lora import lora_on
from shardlab_tasks.lm.sft_packing import PAD_SEGMENT
from shardlab_tasks.lm.task import LanguageModelingTask


class PreferenceTask(LanguageModelingTask):
    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.dpo = DPOSettings.of(setting(cfg, "task"))
        self.lora = lora_on(self.model_section)
        self.reference: ReferenceLogProbs | None = None
        """Full fine-tuning's precomputed reference (training_state); None with LoRA: the adapters-off forward."""
        self._checked_reference: ReferenceLogProbs | None = None
        """The reference whose table the first loss made sure of: each trainer (a backend=auto trial's too) has one."""

    def sft_errors(self) -> list[str]:
        return dpo_errors(self.dpo) + self.pack_errors()

    def prepare_data(self) -> None:
        d = self.cfg.data
        self.preference_splits = open_preference_splits(d, self.tokenizer, self.chat_template)
        self.train_dataset, self.valid_dataset = self.preference_splits.train, self.preference_splits.valid

    @property
    def sample_name(self) -> str:
        return f"preference pairs (of at most data.seq_len={self.cfg.data.seq_len} tokens)"

    def more_samples_hint(self, split: str) -> str:
        return f"{'raise data.valid_percent, or ' if split == 'validation' else ''}add pairs to data.path"

    def data_identity(self) -> str:
        s = self.preference_splits
        return (
            f"{len(s.train)} train / {len(s.valid)} valid preference pairs, {s.train.answer_tokens:,} answer tokens "
            f"({s.truncated} cut to data.seq_len, {s.dropped} without an answer token left out)"
        )

    def data_summary(self) -> str:
        d = self.cfg.data
        source = d.path or "the embedded demo (this Python's standard library)"
        return self.preference_splits.summary(source, d.seq_len)

    def example_batch(self, batch_size: int) -> dict[str, torch.Tensor]:
        """The largest micro-batch: packed, as many rows as answers when no two share a row."""
        shape = (2 * batch_size,) if self.cfg.data.pack else (batch_size, 2)
        rows = torch.zeros(*shape, 3, self.cfg.data.seq_len, dtype=torch.long, device="meta")
        return {"rows": rows, "index": torch.zeros(batch_size, dtype=torch.long, device="meta")}

    def collate(self, samples: list) -> dict[str, torch.Tensor]:
        """Rows cut to the micro-batch's need, a multiple of the tensor-parallel degree long (sequence parallelism
        splits them evenly: data.seq_len is one)."""
        if self.cfg.data.pack:
            return pack_pairs(samples, self.cfg.data.seq_len, self.tokenizer.eod, self.sequence_multiple)
        return collate_pairs(samples, self.sequence_multiple)

    def training_state(self, train_state, device: torch.device) -> ReferenceLogProbs | None:
        """Full fine-tuning: the reference log-probabilities of every pair, saved and resumed with the run."""
        if self.lora:
            return None
        self.reference = ReferenceLogProbs(len(self.train_dataset) + len(self.valid_dataset), device)
        return self.reference

    def loss(self, model: nn.Module, batch: dict, device: torch.device):
        reference = self.reference if device.type != "meta" else None
        if reference is not None and reference is not self._checked_reference:  # a trainer's first loss: no update yet
            if not reference.ready.item():  # a fresh start (a resume loaded them with its checkpoint)
                reference.compute(model, [self.train_dataset, self.valid_dataset], self.collate, device)
            self._checked_reference = reference
        return preference_loss(model, batch, device, self.dpo, reference, self.lora)

    def loss_count(self, batch) -> None:
        return None  # every micro-batch holds as many pairs: the mean over pairs weighs alike

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        return summarize_preference(sums)

    def num_units(self, batch: dict) -> int:
        return int((batch["rows"].select(-2, 2) != PAD_SEGMENT).sum())  # the answers' positions, padding left out
