"""Lazy Adam (= ``torch.optim.SparseAdam``): moments updated on touched rows only."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from veloce.optim.base import SparseOptimizer

__all__ = ["Adam"]


@dataclass(frozen=True)
class Adam(SparseOptimizer):
    """Lazy Adam (= ``torch.optim.SparseAdam``): moments updated on touched rows only.

    Attributes:
        betas: (beta1, beta2), each in [0, 1).
        eps: added to the square root of the second moment.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    kind: ClassVar[int] = 3

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"Adam.betas must be two numbers in [0, 1), got {self.betas}")
        if not (math.isfinite(self.eps) and self.eps > 0):  # (0 divides 0 by 0 in a column of zero gradients)
            raise ValueError(f"Adam.eps must be a finite number > 0 (as torch.optim.SparseAdam's), got {self.eps}")

    def state_dim(self, dim: int) -> int:
        return 2 * dim

    def hyperparameters(self) -> list[float]:
        return [float(self.eps), float(self.betas[0]), float(self.betas[1])]
