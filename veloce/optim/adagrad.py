"""Adagrad with one accumulator per element (= ``torch.optim.Adagrad``, lr_decay 0)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from veloce.optim.base import SparseOptimizer

__all__ = ["Adagrad"]


@dataclass(frozen=True)
class Adagrad(SparseOptimizer):
    """Adagrad with one accumulator per element (= ``torch.optim.Adagrad``, lr_decay 0).

    Attributes:
        eps: added to the square root of the accumulator.
    """

    eps: float = 1e-10
    kind: ClassVar[int] = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (math.isfinite(self.eps) and self.eps >= 0):
            raise ValueError(f"Adagrad.eps must be >= 0, got {self.eps}")

    def state_dim(self, dim: int) -> int:
        return dim

    def hyperparameters(self) -> list[float]:
        return [float(self.eps)]
