"""Row-wise Adagrad: one accumulator per row, incremented by the mean of ``g**2``"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from veloce.optim.base import SparseOptimizer

__all__ = ["RowWiseAdagrad"]


@dataclass(frozen=True)
class RowWiseAdagrad(SparseOptimizer):
    """Row-wise Adagrad: one accumulator per row, incremented by the mean of ``g**2``
    (FBGEMM's ``EXACT_ROWWISE_ADAGRAD``). 4 bytes of state per row instead of 4D.

    Attributes:
        eps: added to the square root of the accumulator.
    """

    eps: float = 1e-8
    kind: ClassVar[int] = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (math.isfinite(self.eps) and self.eps >= 0):
            raise ValueError(f"RowWiseAdagrad.eps must be >= 0, got {self.eps}")

    def state_dim(self, dim: int) -> int:
        return 1

    def hyperparameters(self) -> list[float]:
        return [float(self.eps)]
