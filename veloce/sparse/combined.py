"""One torch optimizer for a model's dense parameters and all its tables."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from veloce.sparse.base import TableModule
from veloce.sparse.nonfinite import raise_deferred
from veloce.sparse.step import step_tables

__all__ = ["CombinedOptimizer", "sparse_modules"]


def sparse_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The table modules of ``model`` (``DynamicEmbedding``), with their names."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, TableModule)]


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
        self.tables = sparse_modules(model)
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
        # A "raise_next" error of the last step is raised before the dense step too: this
        # step then applies nothing, dense or sparse.
        raise_deferred([table for _, table in self.tables])
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
