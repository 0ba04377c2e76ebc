"""What the LM task asks of a model architecture, so that it serves GPT, Llama and a user's own without knowing them.

An architecture is an ``nn.Module`` subclass of ``LMArchitecture`` registered in MODELS under the name that
``model.arch`` selects, with its config dataclass: ``MODELS.register_lazy("llama",
"shardlab_tasks.lm.models.llama:Llama", dataclass=LlamaConfig)`` in shardlab_tasks/lm/config.py, or
``@MODELS.register(name, dataclass=...)`` on a user_dir's class. It is built as ``cls(model_cfg, vocab_size)`` and maps
``(batch, length)`` token ids to ``(batch, length, vocab_size)`` logits. Its model section has at least ``max_seq_len``
and ``vocab_size`` (the task reads both); every other key is the architecture's own, and the task refuses keys of the
section that ``config_class`` does not declare (a GPT key set on a Llama, say). The hooks below get the model section
as the task holds it (shardlab_tasks.lm.config.ModelConfig), read by attribute: in a run an instance of
``config_class``, in the pre-flight and the tools a DictConfig.
"""

from __future__ import annotations

from dataclasses import fields
from typing import ClassVar

import torch
from torch import nn

from shardlab_tasks.lm.config import ModelConfig


class LMArchitecture(nn.Module):
    config_class: ClassVar[type]
    """The dataclass of this architecture's model section (also its schema in Hydra's ConfigStore)."""

    @classmethod
    def config_errors(cls, cfg: ModelConfig) -> list[str]:
        """Problems of the model section, each naming its dotted key (``model.dim``); checked before anything runs."""
        return []

    @classmethod
    def init_tensor(cls, cfg: ModelConfig, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Fill the full value of parameter or buffer ``name`` in place from ``generator`` alone, so every rank of
        every world size draws the same model (shardlab.distributed.materialize)."""
        raise NotImplementedError(f"{cls.__name__} does not say how to initialise {name}")

    def fsdp_units(self) -> list[nn.Module]:
        """Submodules to shard as separate FSDP units (and to checkpoint), in forward order; the rest stays in the
        root unit. Parameters shared by two modules (tied embeddings) must stay in the root."""
        return []

    def tensor_parallel_plan(self) -> dict | None:
        """This model's tensor-parallel plan (shardlab_tasks/lm/models/tensor_parallel.py: module paths to torch
        ParallelStyles), or None: it cannot split over distributed.tensor_parallel_degree ranks."""
        return None

    @classmethod
    def tensor_parallel_errors(cls, cfg: ModelConfig, vocab_size: int, degree: int) -> list[str]:
        """Why the model section cannot split over ``degree`` tensor-parallel ranks, each line naming the key."""
        return []

    @classmethod
    def config_keys(cls) -> set[str]:
        return {f.name for f in fields(cls.config_class)}


def below_one(cfg: ModelConfig, keys: tuple[str, ...]) -> list[str]:
    """Errors for the ``keys`` of the model section that are below 1."""
    return [f"model.{key} must be >= 1, got {getattr(cfg, key)}" for key in keys if getattr(cfg, key) < 1]
