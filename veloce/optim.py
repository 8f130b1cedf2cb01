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
``FTRL(lr, lr_power, l1,      2D           ``tf.keras.optimizers.Ftrl`` (FTRL-Proximal)
l2, initial_accumulator_value,
beta)``
============================  ===========  ==========================================

Each config names its kernel rule (``kind``, an id of ``veloce.ops.optimizer.RULES``) and
gives the kernels its own hyperparameters (:meth:`SparseOptimizer.hyperparameters`) and the
state new rows start from (:meth:`SparseOptimizer.initial_state`). Adding an optimizer is a
rule header in ``csrc/include/veloce/optim/``, a line in its registry (and in ``RULES``) and
a config here (docs/ops.md, "Adding an optimizer").

Example::

    model = MyModel()                         # holds veloce.DynamicEmbedding modules
    opt = veloce.optim.CombinedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1000, gamma=0.5)  # scales both
    loss.backward(); opt.step(); opt.zero_grad(); sched.step()
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = [
    "SparseOptimizer", "SGD", "Adagrad", "RowWiseAdagrad", "Adam", "FTRL", "CombinedOptimizer", "clip_grad_norm_",
    "clip_grad_value_",
]  # fmt: skip


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

    def hyperparameters(self) -> list[float]:
        return [float(self.eps)]


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


# ---- gradient clipping over dense parameters and tables ------------------------------------
def _clip_targets(
    parameters: nn.Module | torch.Tensor | Iterable[Any], tables: Optional[Iterable[Any]], what: str
) -> tuple[list[torch.Tensor], list[Any]]:
    """The gradients and the tables that ``what`` clips: those of a module (its parameters
    and ``DynamicEmbedding`` submodules), or the tensors and tables of an iterable;
    ``tables``, when given, replaces the tables found. Raises when no table is found while
    some table holds a gradient that this clipping would leave unclipped."""
    from veloce.embedding import DynamicEmbedding, waiting_tables

    found: list[Any] = []
    if isinstance(parameters, nn.Module):
        params = list(parameters.parameters())
        found = [m for _, m in _sparse_modules(parameters)]
    else:
        params = []
        for p in [parameters] if isinstance(parameters, torch.Tensor) else parameters:
            if isinstance(p, DynamicEmbedding):
                found.append(p)
            elif isinstance(p, torch.Tensor):
                params.append(p)
            else:
                raise TypeError(f"{what}: parameters must hold tensors or DynamicEmbedding modules, got {type(p)}")
    if tables is not None:
        found = list(tables)
        bad = [type(t).__name__ for t in found if not isinstance(t, DynamicEmbedding)]
        if bad:
            raise TypeError(f"{what}: tables must be DynamicEmbedding modules, got {bad[0]}")
    elif not found:
        waiting = waiting_tables()
        if waiting:
            raise ValueError(
                f"{what}: {len(waiting)} DynamicEmbedding table(s) hold a gradient, but parameters holds none of "
                f"them: their rows are not parameters, so they would stay unclipped. Pass the model itself "
                f"({what}(model, max_norm) clips its dense gradients and its tables' jointly), or tables=() to clip "
                f"these parameters alone"
            )  # fmt: skip
    unique = list({id(t): t for t in found}.values())  # a table listed twice is clipped once
    for t in unique:
        if t._shard is not None and t._shard.in_flight:
            raise ValueError(
                f"{what}: a table sharded with HybridParallel(sparse='async') has gradients in flight to their "
                f"owners (applied {t._shard.staleness} step(s) later): they cannot be clipped with this step's. "
                f"Clip with sparse='sync'"
            )  # fmt: skip
    return [p.grad for p in params if p.grad is not None], unique


def _table_norms(tables: Sequence[Any], norm_type: float) -> list[torch.Tensor]:
    """Per table, the norm of its pending row gradients; over all ranks for a table sharded
    by HybridParallel (each rank holds the gradients of the rows it owns: one all-reduce
    per process group)."""
    norms = [torch.linalg.vector_norm(t._pending_rows()[1], norm_type) for t in tables]
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(tables):
        if t._shard is not None and t._shard.group.size > 1:
            groups.setdefault(id(t._shard.group), []).append(i)
    for idx in groups.values():
        shard = tables[idx[0]]._shard
        local = torch.stack([norms[i] for i in idx]).to(torch.float64)
        if math.isinf(norm_type):
            total = shard.agree_all(local, op="max")
        else:
            total = shard.agree_all(local.pow(norm_type)).pow(1.0 / norm_type)
        for k, i in enumerate(idx):
            norms[i] = total[k].to(norms[i].device, norms[i].dtype)
    return norms


@torch.no_grad()
def clip_grad_norm_(
    parameters: nn.Module | torch.Tensor | Iterable[Any],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Optional[bool] = None,
    *,
    tables: Optional[Iterable[Any]] = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over dense gradients and ``DynamicEmbedding``
    tables together: the total norm is that of every dense gradient and every table's
    pending row gradient (what ``step()`` applies: the gradient an ``nn.EmbeddingBag``'s
    ``weight`` would hold on the rows looked up), and all of them are scaled by
    ``max_norm / total`` when it is below 1. Call it between ``backward()`` and the step.

    ``torch.nn.utils.clip_grad_norm_`` cannot see the tables (their rows are not
    parameters): while a table holds a gradient, veloce makes it raise and name this
    function (so does ``clip_grad_value_``).

    Args:
        parameters: the model (its parameters and tables), or an iterable of tensors and
            ``DynamicEmbedding`` modules, or one tensor.
        max_norm: the largest total norm.
        norm_type: p of the p-norm (``float("inf")`` for the largest absolute value).
        error_if_nonfinite: raise when the total norm is NaN or Inf (as torch's).
        foreach: accepted for torch's signature; the dense gradients are scaled one by one.
        tables: the tables to clip, replacing those found in ``parameters`` (``()``: the
            dense gradients alone, with no table).

    Returns:
        The total norm (a scalar tensor), as torch's.

    Tables sharded by ``veloce.distributed.HybridParallel`` (``sparse="sync"``) are
    clipped by their norm over all ranks (every rank calls this, with the same tables);
    the dense gradients DDP averaged are the same on every rank.

    Example::

        loss.backward()
        veloce.clip_grad_norm_(model, 1.0)
        opt.step(); opt.zero_grad()                  # a veloce.optim.CombinedOptimizer
    """
    del foreach
    max_norm, norm_type = float(max_norm), float(norm_type)
    grads, clipped = _clip_targets(parameters, tables, "veloce.clip_grad_norm_")
    norms = [torch.linalg.vector_norm(g, norm_type) for g in grads] + _table_norms(clipped, norm_type)
    if not norms:
        return torch.tensor(0.0)
    first = norms[0].device
    total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), norm_type)
    if error_if_nonfinite and bool(total.isnan() | total.isinf()):
        raise RuntimeError(
            f"veloce.clip_grad_norm_: the total norm of order {norm_type} of the gradients is non-finite, so they "
            f"cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            f"error_if_nonfinite=False"
        )  # fmt: skip
    factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(factor.to(g.device))
    for t in clipped:
        t._scale_pending(factor)
    return total


@torch.no_grad()
def clip_grad_value_(
    parameters: nn.Module | torch.Tensor | Iterable[Any],
    clip_value: float,
    foreach: Optional[bool] = None,
    *,
    tables: Optional[Iterable[Any]] = None,
) -> None:
    """``torch.nn.utils.clip_grad_value_`` over dense gradients and ``DynamicEmbedding``
    tables together: every dense gradient element and every element of a table's pending
    row gradient (summed over the backward passes and the positions of the row, what
    ``step()`` applies) is clamped to ``[-clip_value, clip_value]``.

    Args:
        parameters: as :func:`clip_grad_norm_`.
        clip_value: the largest absolute value of a gradient element (>= 0).
        foreach: accepted for torch's signature.
        tables: as :func:`clip_grad_norm_`.
    """
    del foreach
    clip_value = float(clip_value)
    if not clip_value >= 0:
        raise ValueError(f"veloce.clip_grad_value_: clip_value must be >= 0, got {clip_value}")
    grads, clipped = _clip_targets(parameters, tables, "veloce.clip_grad_value_")
    for g in grads:
        g.clamp_(-clip_value, clip_value)
    for t in clipped:
        t._clamp_pending(clip_value)


def _refusing_tables(name: str, torch_fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch_fn`` (torch's ``name``), raising first when a table holds a gradient that it
    would leave unclipped; otherwise the same call, arguments and result."""

    @functools.wraps(torch_fn)
    def clip(*args: Any, **kwargs: Any) -> Any:
        from veloce.embedding import waiting_tables

        waiting = waiting_tables()
        if waiting:
            raise RuntimeError(
                f"torch.nn.utils.{name} cannot clip veloce.DynamicEmbedding tables: their rows are not parameters, "
                f"and {len(waiting)} table(s) hold a gradient it would leave unclipped. Use veloce.{name}(model, "
                f"...) instead: it clips the dense gradients and the tables' together"
            )  # fmt: skip
        return torch_fn(*args, **kwargs)

    clip._veloce_torch_fn = torch_fn  # type: ignore[attr-defined]
    return clip


def _guard_torch_clipping() -> None:
    """Replaces ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` (both where torch
    defines them and where it exports them) by :func:`_refusing_tables` wrappers, once."""
    import torch.nn.utils as utils
    from torch.nn.utils import clip_grad

    for name in ("clip_grad_norm_", "clip_grad_value_"):
        fn = getattr(utils, name)
        if hasattr(fn, "_veloce_torch_fn"):
            continue
        wrapped = _refusing_tables(name, fn)
        setattr(utils, name, wrapped)
        if getattr(clip_grad, name, None) is fn:
            setattr(clip_grad, name, wrapped)


_guard_torch_clipping()
