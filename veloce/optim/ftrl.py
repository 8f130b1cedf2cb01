"""FTRL-Proximal (= ``tf.keras.optimizers.Ftrl``), lazy: the state of the rows a step touches."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from veloce.optim.base import SparseOptimizer

__all__ = ["FTRL"]


@dataclass(frozen=True)
class FTRL(SparseOptimizer):
    """FTRL-Proximal with the update of ``tf.keras.optimizers.Ftrl`` (its argument meanings;
    no l2 shrinkage), lazy: the state of the rows a step touches. Per element, with
    accumulator n, linear term z, p = ``lr_power`` and g the gradient plus
    ``weight_decay * w``::

        n' = n + g^2;  z += g - (n'^(-p) - n^(-p)) / lr * w
        w = 0 if |z| <= l1 else (sign(z) * l1 - z) / ((beta + n'^(-p)) / lr + 2 * l2);  n = n'

    State per row: n (D, starting at ``initial_accumulator_value``) and z (D, starting at
    0). Pass the arguments after ``lr`` by keyword (the base class's ``weight_decay`` comes
    second among the fields).

    Attributes:
        lr_power: p, <= 0 (-0.5: the square root).
        l1: L1 regularization strength, >= 0 (rows whose |z| stays within it are exactly 0).
        l2: L2 regularization strength, >= 0.
        initial_accumulator_value: n of a new row, >= 0.
        beta: added to n'^(-p) in the denominator (Keras' ``beta``), >= 0.

    Example::

        emb = veloce.DynamicEmbedding(16, optimizer=veloce.optim.FTRL(lr=0.05, l1=1e-3))
    """

    lr: float = 0.001
    lr_power: float = -0.5
    l1: float = 0.0
    l2: float = 0.0
    initial_accumulator_value: float = 0.1
    beta: float = 0.0
    kind: ClassVar[int] = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (math.isfinite(self.lr_power) and self.lr_power <= 0):
            raise ValueError(f"FTRL.lr_power must be a finite number <= 0 (as Keras' learning_rate_power), got "
                             f"{self.lr_power}")  # fmt: skip
        for name in ("l1", "l2", "initial_accumulator_value", "beta"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"FTRL.{name} must be a finite number >= 0, got {value}")

    def state_dim(self, dim: int) -> int:
        return 2 * dim

    def hyperparameters(self) -> list[float]:
        return [float(self.lr_power), float(self.l1), float(self.l2), float(self.beta)]

    def initial_state(self, dim: int) -> Optional[torch.Tensor]:
        n = torch.full((dim,), float(self.initial_accumulator_value), dtype=torch.float64)
        return torch.cat([n, torch.zeros(dim, dtype=torch.float64)])
