"""The steps of every torch optimizer in the process, counted by torch's global step hook."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["torch_step_count"]

# Steps of every torch optimizer in the process (CombinedOptimizer's too), counted by
# torch's global step hook. A table notes the count when a gradient reaches it; a
# training lookup of a table whose gradient waited through such a step, unapplied, is the
# mark of a torch optimizer loop that never steps the tables (DynamicEmbedding's forward
# raises then).
_torch_steps = 0


def _count_torch_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    global _torch_steps
    _torch_steps += 1


register_optimizer_step_post_hook(_count_torch_step)


def torch_step_count() -> int:
    """How many ``step()`` calls of torch optimizers (any ``torch.optim.Optimizer``,
    :class:`CombinedOptimizer` included) this process has made."""
    return _torch_steps
