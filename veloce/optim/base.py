"""The base of the sparse optimizer configs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

__all__ = ["SparseOptimizer"]


@dataclass(frozen=True)
class SparseOptimizer:
    """Base of the sparse optimizer configs.

    Attributes:
        lr: learning rate (> 0). The table's current rate can follow a torch LR
            scheduler through :class:`CombinedOptimizer`.
        weight_decay: L2 penalty added to the gradient of the rows a step touches (lazy).
    """

    lr: float = 0.01
    weight_decay: float = 0.0

    kind: ClassVar[int] = -1

    def __post_init__(self) -> None:
        name = type(self).__name__
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"{name}.lr must be a positive finite number, got {self.lr}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"{name}.weight_decay must be >= 0, got {self.weight_decay}")

    def state_dim(self, dim: int) -> int:
        """Width S of the per-row optimizer state for embedding dim ``dim``."""
        raise NotImplementedError

    def hyperparameters(self) -> list[float]:
        """The rule's own hyperparameters, in kernel order: the ops' ``hparams`` is
        ``[lr, step, weight_decay, *hyperparameters()]`` (``veloce.ops.optimizer.RULES``
        names them)."""
        return []

    def initial_state(self, dim: int) -> Optional[torch.Tensor]:
        """The ``(state_dim(dim),)`` optimizer state every new row starts from, or None for
        zeros. The table casts it to its state dtype and device."""
        return None
