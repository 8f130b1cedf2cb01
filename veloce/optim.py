"""Sparse optimizers for :class:`veloce.DynamicEmbedding` and :class:`CombinedOptimizer`.

A sparse optimizer is a frozen config; the table applies it with one fused kernel pass
per touched row (``torch.ops.veloce.sparse_update``). Each matches a torch reference on
the rows a step touches:

============================  ===========  ==========================================
config                        state/row    reference
============================  ===========  ==========================================
``SGD(lr)``                   0            ``torch.optim.SGD``
``Adagrad(lr, eps)``          D            ``torch.optim.Adagrad``
``RowWiseAdagrad(lr, eps)``   1            FBGEMM row-wise Adagrad (mean of g**2)
``Adam(lr, betas, eps)``      2D           ``torch.optim.SparseAdam`` (lazy Adam)
============================  ===========  ==========================================

Example::

    model = MyModel()                         # holds veloce.DynamicEmbedding modules
    opt = veloce.optim.CombinedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1000, gamma=0.5)  # scales both
    loss.backward(); opt.step(); opt.zero_grad(); sched.step()
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["SparseOptimizer", "SGD", "Adagrad", "RowWiseAdagrad", "Adam", "CombinedOptimizer"]


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

    def kernel_args(self) -> tuple[int, float, float, float]:
        """(optimizer id, eps, beta1, beta2) for ``torch.ops.veloce.sparse_update``."""
        return (self.kind, 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class SGD(SparseOptimizer):
    """Plain SGD: ``w -= lr * g`` (= ``torch.optim.SGD`` without momentum)."""

    kind: ClassVar[int] = 0

    def state_dim(self, dim: int) -> int:
        return 0


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

    def kernel_args(self) -> tuple[int, float, float, float]:
        return (self.kind, self.eps, 0.0, 0.0)


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

    def kernel_args(self) -> tuple[int, float, float, float]:
        return (self.kind, self.eps, 0.0, 0.0)


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

    def kernel_args(self) -> tuple[int, float, float, float]:
        return (self.kind, self.eps, float(self.betas[0]), float(self.betas[1]))


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


def _sparse_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from veloce.embedding import DynamicEmbedding

    return [(name, m) for name, m in model.named_modules() if isinstance(m, DynamicEmbedding)]


class CombinedOptimizer(torch.optim.Optimizer):
    """One optimizer for a model's dense parameters and all its ``DynamicEmbedding`` tables.

    ``step()`` runs every table's fused sparse update, then the dense optimizer (with a
    ``closure``, the dense optimizer first: the closure computes the gradients). A table
    that refuses a NaN/Inf gradient (``nonfinite_grad="raise"``) raises before the dense
    step, so that nothing is applied. ``zero_grad()`` clears both. ``param_groups`` holds the dense optimizer's groups
    followed by one group per table (``{"params": [], "lr": ..., "table": name}``),
    so any ``torch.optim.lr_scheduler`` scales the sparse learning rates too.

    Args:
        dense: a torch optimizer over the model's dense parameters, or None when the
            model has no dense parameters to train.
        model: the module whose ``DynamicEmbedding`` submodules are stepped (searched
            recursively; a ``HybridParallel`` wrapper works too).

    Example::

        opt = CombinedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), model)
        loss.backward(); opt.step(); opt.zero_grad()
    """

    def __init__(self, dense: torch.optim.Optimizer | None, model: nn.Module) -> None:
        if dense is not None and not isinstance(dense, torch.optim.Optimizer):
            raise TypeError(f"CombinedOptimizer: dense must be a torch.optim.Optimizer or None, got {type(dense)}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"CombinedOptimizer: model must be an nn.Module, got {type(model)}")
        self.dense = dense
        self.tables = _sparse_modules(model)
        if dense is None and not self.tables:
            raise ValueError("CombinedOptimizer: nothing to optimize: dense is None and model has no DynamicEmbedding")
        self._sparse_groups = [{"params": [], "lr": m.optimizer.lr, "table": name} for name, m in self.tables]
        # Optimizer.__init__ sets up hooks and state; the group it is given is a placeholder
        # (param_groups is derived, below).
        super().__init__([{"params": []}], {})

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The dense optimizer's groups (the same dicts), then one group per table."""
        dense = list(self.dense.param_groups) if self.dense is not None else []
        return dense + self._sparse_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        # Only torch.optim.Optimizer.__init__ assigns it; the groups are derived.
        pass

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: D102 - documented on the class
        from veloce.embedding import _raise_deferred, step_tables  # veloce.embedding imports this module

        # A "raise_next" error of the last step is raised before the dense step too: this
        # step then applies nothing, dense or sparse.
        _raise_deferred([table for _, table in self.tables])
        tables, lrs = [table for _, table in self.tables], [group["lr"] for group in self._sparse_groups]
        if closure is None:
            # The tables first: a NaN/Inf gradient that one of them refuses ("raise") stops
            # the step before the dense one too, so that nothing is applied. One device
            # read-back for every table's finiteness check (see step_tables).
            step_tables(tables, lrs)
            if self.dense is not None:
                self.dense.step()
            return None
        # The closure computes the gradients the tables step with: the dense step (which
        # calls it) first.
        if self.dense is not None:
            loss = self.dense.step(closure)
        else:
            with torch.enable_grad():
                loss = closure()
        step_tables(tables, lrs)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102
        if self.dense is not None:
            self.dense.zero_grad(set_to_none=set_to_none)
        for _, table in self.tables:
            table.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        """The dense optimizer's state and the sparse learning rates. Table rows and
        their optimizer state are part of the model's ``state_dict``."""
        return {
            "dense": self.dense.state_dict() if self.dense is not None else None,
            "sparse": {g["table"]: {k: v for k, v in g.items() if k != "params"} for g in self._sparse_groups},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # noqa: D102
        if self.dense is not None and state_dict.get("dense") is not None:
            self.dense.load_state_dict(state_dict["dense"])
        for group in self._sparse_groups:
            saved = state_dict.get("sparse", {}).get(group["table"])
            if saved is not None:
                group.update(saved)
