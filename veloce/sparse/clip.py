"""Gradient clipping over dense gradients and tables together, and torch's clipping made
to refuse while a table holds a gradient it cannot see."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from typing import Any, Callable, Optional

import torch
from torch import nn

from veloce.sparse.base import TableModule
from veloce.sparse.combined import sparse_modules
from veloce.sparse.default_row import agreed_default_gradients
from veloce.sparse.pending import waiting_tables

__all__ = ["clip_grad_norm_", "clip_grad_value_"]


def _clip_targets(
    parameters: nn.Module | torch.Tensor | Iterable[Any], tables: Optional[Iterable[Any]], what: str
) -> tuple[list[torch.Tensor], list[Any]]:
    """The gradients and the tables that ``what`` clips: those of a module (its parameters
    and ``DynamicEmbedding`` submodules), or the tensors and tables of an iterable;
    ``tables``, when given, replaces the tables found. Raises when no table is found while
    some table holds a gradient that this clipping would leave unclipped."""
    found: list[Any] = []
    if isinstance(parameters, nn.Module):
        params = list(parameters.parameters())
        found = [m for _, m in sparse_modules(parameters)]
    else:
        params = []
        for p in [parameters] if isinstance(parameters, torch.Tensor) else parameters:
            if isinstance(p, TableModule):
                found.append(p)
            elif isinstance(p, torch.Tensor):
                params.append(p)
            else:
                raise TypeError(f"{what}: parameters must hold tensors or DynamicEmbedding modules, got {type(p)}")
    if tables is not None:
        found = list(tables)
        bad = [type(t).__name__ for t in found if not isinstance(t, TableModule)]
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
        if t.backend.in_flight:
            raise ValueError(
                f"{what}: a table sharded with HybridParallel(sparse='async') has gradients in flight to their "
                f"owners (applied {t.backend.staleness} step(s) later): they cannot be clipped with this step's. "
                f"Clip with sparse='sync'"
            )  # fmt: skip
    return [p.grad for p in params if p.grad is not None], unique


def _table_norms(tables: Sequence[Any], norm_type: float) -> list[torch.Tensor]:
    """Per table, the norm of its pending row gradients; over all ranks for a table sharded
    by HybridParallel (each rank holds the gradients of the rows it owns: one all-reduce
    per process group)."""
    # the default row's gradient (admission) is one row more of its table's; a sharded table's
    # replicated default row holds a part of it on each rank: its norm is that of the parts' sum
    shared = agreed_default_gradients(tables)
    norms = [torch.linalg.vector_norm(torch.cat([t._pending_rows()[1], t._default_grad_rows()[1]]), norm_type)
             if t._pending_default and id(t) not in shared
             else torch.linalg.vector_norm(t._pending_rows()[1], norm_type)
             for t in tables]  # fmt: skip
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(tables):
        if t.backend.world_size > 1:
            groups.setdefault(t.backend.group_id, []).append(i)
    for idx in groups.values():
        shard = tables[idx[0]].backend
        local = torch.stack([norms[i] for i in idx]).to(torch.float64)
        if math.isinf(norm_type):
            total = shard.agree_all(local, op="max")
        else:
            total = shard.agree_all(local.pow(norm_type)).pow(1.0 / norm_type)
        for k, i in enumerate(idx):
            norms[i] = total[k].to(norms[i].device, norms[i].dtype)
    for i, t in enumerate(tables):
        entry = shared.get(id(t))
        if entry is not None:  # (a row no rank's lookups reached has slot -2: no gradient)
            row = torch.linalg.vector_norm(entry.grad * (entry.slots >= 0).to(entry.grad.dtype), norm_type)
            norms[i] = torch.linalg.vector_norm(torch.stack([norms[i], row.to(norms[i].dtype)]), norm_type)
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
        opt.step(); opt.zero_grad()                  # a veloce.CombinedOptimizer
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
    shared = agreed_default_gradients(clipped)  # a sharded table's default row: its parts summed first
    for t in clipped:
        t._clamp_pending(clip_value)
        entry = shared.get(id(t))
        if entry is not None:  # rank 0 keeps the clamped sum, the others nothing: the step's sum is it
            if t.backend.rank != 0:
                entry = entry._replace(slots=torch.full_like(entry.slots, -2), grad=torch.zeros_like(entry.grad))
            t._pending_default = [entry._replace(grad=entry.grad.clamp(-clip_value, clip_value))]


def _refusing_tables(name: str, torch_fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch_fn`` (torch's ``name``), raising first when a table holds a gradient that it
    would leave unclipped; otherwise the same call, arguments and result."""

    @functools.wraps(torch_fn)
    def clip(*args: Any, **kwargs: Any) -> Any:
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
