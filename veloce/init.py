"""Initializers for new rows of a :class:`veloce.DynamicEmbedding`.

A new row's value is a deterministic function of ``(seed, id)``: it does not depend on
insertion order, batch composition, device or number of ranks (see
``csrc/include/veloce/init.h``). That is what makes sharded training bit-comparable to
one process.

Example::

    emb = veloce.DynamicEmbedding(16, initializer=veloce.init.uniform(-0.05, 0.05))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Initializer", "zeros", "constant", "uniform", "normal"]


@dataclass(frozen=True)
class Initializer:
    """An initializer spec: ``kind`` and its two parameters (see the factory functions).

    Attributes:
        kind: 0 zeros, 1 constant (``a``), 2 uniform on ``[a, b)``, 3 normal (mean ``a``, std ``b``).
        a: first parameter.
        b: second parameter.
    """

    kind: int
    a: float = 0.0
    b: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in (0, 1, 2, 3):
            raise ValueError(f"Initializer.kind must be 0, 1, 2 or 3, got {self.kind}")
        for name in ("a", "b"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ValueError(f"Initializer.{name} must be finite, got {value}")
        if self.kind == 2 and not self.a <= self.b:
            raise ValueError(f"uniform(a, b) needs a <= b, got a={self.a}, b={self.b}")
        if self.kind == 3 and self.b < 0:
            raise ValueError(f"normal(std=...) needs std >= 0, got {self.b}")

    def check_fits(self, dtype: "torch.dtype") -> None:
        """Raises ValueError when rows of ``dtype`` could not hold this initializer's values
        (they would become inf): a constant or a bound beyond the dtype's largest value, a
        uniform range wider than a double holds, or a normal whose draws (within 9 std of
        the mean: the sampler's reach) could pass it."""
        import torch

        largest = torch.finfo(dtype).max
        if self.kind == 1:
            reach = abs(self.a)
        elif self.kind == 2:
            reach = max(abs(self.a), abs(self.b))
            if not math.isfinite(self.b - self.a):
                reach = math.inf
        elif self.kind == 3:
            reach = abs(self.a) + 9.0 * self.b
        else:
            return
        if not reach <= largest:
            raise ValueError(f"initializer {self!r} makes values beyond {dtype}'s range (largest {largest:g}): new "
                             f"rows would hold inf; choose a smaller scale or a wider dtype")  # fmt: skip

    def __repr__(self) -> str:
        if self.kind == 0:
            return "zeros()"
        if self.kind == 1:
            return f"constant({self.a})"
        if self.kind == 2:
            return f"uniform({self.a}, {self.b})"
        return f"normal(mean={self.a}, std={self.b})"


def zeros() -> Initializer:
    """New rows are all zeros."""
    return Initializer(0)


def constant(value: float) -> Initializer:
    """New rows are filled with ``value``."""
    return Initializer(1, float(value))


def uniform(a: float = -0.05, b: float = 0.05) -> Initializer:
    """New rows are drawn from U(a, b)."""
    return Initializer(2, float(a), float(b))


def normal(mean: float = 0.0, std: float = 0.01) -> Initializer:
    """New rows are drawn from N(mean, std**2)."""
    return Initializer(3, float(mean), float(std))
