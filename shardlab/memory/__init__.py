"""Memory as something planned, chosen and measured.

- ``plan``: what one rank will hold at the peak of a training step, predicted on the meta device before anything is
  allocated, for the configured layout and its alternatives (printed before every run; ``dry_run`` adds the table).
- ``budget``: ``distributed.memory_budget_gb`` held against the plan, and ``distributed.backend=auto``'s choice.
- ``meter``: what a rank really held (the training-step peak above its start), printed beside the plan at the end.
"""

from __future__ import annotations

__all__ = ["budget", "meter", "plan"]
