"""Memory as something planned, chosen and measured.

- ``plan``: a run's plan, what one rank will hold at the peak of a training step, predicted on the meta device
  before anything is allocated, for the configured layout and its alternatives (printed before every run; ``dry_run``
  adds the table). Its parts: ``profile`` (the model's forward on meta: what autograd saves, per unit), ``layout``
  (the ways to place the model, and how FSDP2 shards a parameter), ``estimate`` (each layout's bytes per rank: the
  data-parallel ``byte_model``, the model ``axes``, ``experts``; what they depend on, ``context``), ``communication``
  (the collectives a step issues and the bytes they send), ``plan_warnings`` and ``console`` (the lines printed).
- ``budget``: ``distributed.memory_budget_gb`` held against the plan, and ``distributed.backend=auto``'s choice.
- ``verify``: the plan held against the real ``fully_shard`` on a fake process group (``fake_group``;
  ``distributed.verify_plan``);
  ``stage_step``: a pipeline rank's real training step there on fake tensors, its peak of live bytes.
- ``meter``: what a rank really held (the training-step peak above its start), printed beside the plan at the end.
- ``devices``: the devices a plan can be made for, and what a CUDA rank holds besides its tensors.

It plans and measures only: choosing a layout by running trials is the job's (shardlab.runner.autotune).
"""

from __future__ import annotations

__all__ = [
    "budget",
    "communication",
    "console",
    "context",
    "devices",
    "estimate",
    "layout",
    "meter",
    "plan",
    "plan_warnings",
    "profile",
    "stage_step",
    "verify",
]
