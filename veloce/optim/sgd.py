"""Plain SGD: ``w -= lr * g`` (= ``torch.optim.SGD`` without momentum)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from veloce.optim.base import SparseOptimizer

__all__ = ["SGD"]


@dataclass(frozen=True)
class SGD(SparseOptimizer):
    """Plain SGD: ``w -= lr * g`` (= ``torch.optim.SGD`` without momentum)."""

    kind: ClassVar[int] = 0

    def state_dim(self, dim: int) -> int:
        return 0
