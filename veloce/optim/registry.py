"""The sparse optimizers by name: one entry per optimizer."""

from __future__ import annotations

from veloce.optim.adagrad import Adagrad
from veloce.optim.adam import Adam
from veloce.optim.base import SparseOptimizer
from veloce.optim.ftrl import FTRL
from veloce.optim.rowwise_adagrad import RowWiseAdagrad
from veloce.optim.sgd import SGD

__all__ = ["OPTIMIZERS", "get"]

#: name -> the config class of each sparse optimizer.
OPTIMIZERS: dict[str, type[SparseOptimizer]] = {
    "sgd": SGD,
    "adagrad": Adagrad,
    "rowwise_adagrad": RowWiseAdagrad,
    "adam": Adam,
    "ftrl": FTRL,
}


def get(name: str) -> type[SparseOptimizer]:
    """The sparse optimizer class named ``name`` (a key of :data:`OPTIMIZERS`).

    Raises:
        ValueError: ``name`` names no sparse optimizer.
    """
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"unknown sparse optimizer {name!r}; known: {sorted(OPTIMIZERS)}") from None
