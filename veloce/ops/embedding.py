"""The embedding op family: pooled lookups over table rows and the sparse gradient accumulate.

Typed wrappers over ``torch.ops.veloce.pooled_lookup``, ``accumulate_grad`` and
``bag_layouts_bad`` (kernels: ``csrc/cpu/embedding.cpp``), their fake kernels, and the
autograd registration of ``pooled_lookup``. Semantics: docs/ops.md.

Shape glossary: ``C`` rows of the table, ``D`` embedding dim, ``N`` slots (ids),
``B`` bags, ``M`` extra rows, ``U`` unique slots.

Slot codes: ``-1`` padding (skipped, not counted by mean), ``-2`` a zero row (counted by
mean), ``slot >= C`` reads ``extra_rows[slot - C]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from veloce.ops import extension as _ext

__all__ = ["MODES", "accumulate_grad", "bag_layouts_bad", "bag_of", "max_pool", "max_pool_position_grad", "pooled_lookup",
           "pooled_lookup_many", "psw_gradient"]

#: Pooling modes by name, as in ``nn.EmbeddingBag``.
MODES = {"sum": 0, "mean": 1}


def _mode_id(mode: int | str) -> int:
    if isinstance(mode, str):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {sorted(MODES)} (or 0 / 1), got {mode!r}")
        return MODES[mode]
    return int(mode)


def pooled_lookup(
    weights: torch.Tensor,
    slots: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None = None,
    mode: int | str = "sum",
    include_last_offset: bool = False,
    extra_rows: torch.Tensor | None = None,
    check_inputs: bool = True,
) -> torch.Tensor:
    """Pools rows of ``weights`` per bag, like ``torch.nn.functional.embedding_bag``.

    Differentiable w.r.t. ``weights`` (a dense gradient, for gradcheck; modules route
    sparse gradients with :func:`accumulate_grad` themselves) and ``per_sample_weights``.

    Args:
        weights: the table rows; float32, float64, float16 or bfloat16.
        slots: int64 row of each position, or -1 (padding) / -2 (zero row).
        offsets: int64 start of each bag, starting at 0, non-decreasing.
        per_sample_weights: optional scale of each position (sum mode only), dtype of ``weights``.
        mode: ``"sum"`` / 0 or ``"mean"`` / 1 (divides by the bag's non-padding count).
        include_last_offset: offsets has ``B + 1`` entries, the last equal to ``N``.
        extra_rows: rows read by slots ``>= C`` (e.g. initializer rows of unknown ids).
        check_inputs: check the offsets layout and every slot value (on CUDA one device
            reduction and a host sync). ``False`` skips those checks, for inputs valid by
            construction (``DynamicEmbedding`` passes the slots its table returned); bad
            offsets or slots are then undefined behaviour. Shapes, dtypes and devices are
            always checked.

    Returns:
        The pooled rows; empty bags give zeros.

    Shape:
        - weights: ``(C, D)``; slots: ``(N,)``; offsets: ``(B,)`` or ``(B + 1,)``
        - per_sample_weights: ``(N,)``; extra_rows: ``(M, D)``
        - output: ``(B, D)``, dtype of ``weights``

    Example::

        >>> w = torch.randn(10, 4)
        >>> out = pooled_lookup(w, torch.tensor([1, 2, -1, 7]), torch.tensor([0, 2]), mode="mean")
        >>> out.shape
        torch.Size([2, 4])
    """
    _ext.require()
    return torch.ops.veloce.pooled_lookup(
        weights, slots, offsets, per_sample_weights, _mode_id(mode), include_last_offset, extra_rows, check_inputs
    )


def pooled_lookup_many(
    weights: Sequence[torch.Tensor],
    slots: Sequence[torch.Tensor],
    offsets: Sequence[torch.Tensor],
    per_sample_weights: Sequence[torch.Tensor | None] | None = None,
    mode: Sequence[int | str] | int | str = "sum",
    include_last_offset: bool = False,
    extra_rows: Sequence[torch.Tensor | None] | None = None,
    check_inputs: bool = True,
) -> list[torch.Tensor]:
    """:func:`pooled_lookup` of K tables in one call: entry ``k`` of the result is
    ``pooled_lookup(weights[k], slots[k], offsets[k], per_sample_weights[k], mode[k],
    include_last_offset, extra_rows[k], check_inputs)``, bit for bit, each its own tensor.

    The tables share device, dtype and embedding dim (a table may appear more than once).
    On CUDA one kernel launch serves up to 32 tables, where K calls of
    :func:`pooled_lookup` launch K kernels: on a model with many tables the host time of
    the launches is what the GPU waits for. Not differentiable: for callers that route
    the gradients themselves (``DynamicEmbedding``'s training lookups); inputs that
    require grad are refused (use :func:`pooled_lookup`, which is differentiable).

    Args:
        weights, slots, offsets: per table, as for :func:`pooled_lookup`.
        per_sample_weights: per table, a tensor or None (None: no table has them).
        mode: per table, or one for all: ``"sum"`` / 0 or ``"mean"`` / 1.
        include_last_offset: as for :func:`pooled_lookup`, for every table.
        extra_rows: per table, a tensor or None (None: no table has them).
        check_inputs: as for :func:`pooled_lookup` (on CUDA one host sync per table).

    Returns:
        The K pooled ``(B_k, D)`` tensors.

    Example::

        >>> w = [torch.randn(10, 4), torch.randn(6, 4)]
        >>> outs = pooled_lookup_many(w, [torch.tensor([1, 2]), torch.tensor([5])],
        ...                           [torch.tensor([0, 1]), torch.tensor([0])], mode=["sum", "mean"])
        >>> [tuple(o.shape) for o in outs]
        [(2, 4), (1, 4)]
    """
    _ext.require()
    k = len(weights)
    modes = [_mode_id(mode)] * k if isinstance(mode, (int, str)) else [_mode_id(m) for m in mode]
    psw = [None] * k if per_sample_weights is None else list(per_sample_weights)
    extra = [None] * k if extra_rows is None else list(extra_rows)
    if not weights and not slots and not offsets and not psw and not extra:  # no tensor to dispatch on
        return []
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (*weights, *psw, *extra)):
        raise ValueError(
            "pooled_lookup_many is not differentiable, but an input requires grad; use pooled_lookup per table "
            "for gradients, or call it under torch.no_grad()"
        )
    return list(torch.ops.veloce.pooled_lookup_many(
        list(weights), list(slots), list(offsets), psw, modes, include_last_offset, extra, check_inputs
    ))  # fmt: skip


def accumulate_grad(
    grad_output: torch.Tensor,
    slots: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None = None,
    mode: int | str = "sum",
    include_last_offset: bool = False,
    num_rows: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient of :func:`pooled_lookup` w.r.t. ``weights``, reduced per unique slot.

    Each position ``i`` of bag ``b`` with ``0 <= slots[i] < num_rows`` contributes
    ``grad_output[b] * per_sample_weights[i]`` (sum) or ``grad_output[b] / count(b)``
    (mean); contributions are summed per slot in position order (deterministic).
    Padding, -2 and slots ``>= num_rows`` (extra rows) contribute nothing. Also merges
    gradient batches: pass concatenated slots, ``offsets = arange(n)``, mode sum.

    Args:
        grad_output: gradient of the pooled output.
        slots: int64 slots as given to :func:`pooled_lookup`.
        offsets: int64 bag offsets as given to :func:`pooled_lookup`.
        per_sample_weights: optional per-position scales (sum mode only).
        mode: ``"sum"`` / 0 or ``"mean"`` / 1.
        include_last_offset: as in :func:`pooled_lookup`.
        num_rows: the number of table rows ``C`` (required); larger slots get no gradient.

    Returns:
        ``(unique_slots, grad_rows)``: the touched slots in ascending order and their summed gradients.

    Shape:
        - grad_output: ``(B, D)``; slots: ``(N,)``; offsets: ``(B,)`` or ``(B + 1,)``
        - unique_slots: ``(U,)`` int64; grad_rows: ``(U, D)``, dtype of ``grad_output``

    Example::

        >>> slots, grads = accumulate_grad(torch.ones(2, 4), torch.tensor([3, 3, 1]),
        ...                                torch.tensor([0, 2]), num_rows=10)
        >>> slots.tolist()
        [1, 3]
    """
    _ext.require()
    if num_rows is None:  # (a default of 0 made every slot an extra row: an empty gradient)
        raise TypeError("accumulate_grad: num_rows is required: the number of table rows C (weights.shape[0])")
    return torch.ops.veloce.accumulate_grad(
        grad_output, slots, offsets, per_sample_weights, _mode_id(mode), include_last_offset, num_rows
    )


def bag_layouts_bad(
    offsets: Sequence[torch.Tensor], num_ids: Sequence[int], include_last_offset: Sequence[bool]
) -> torch.Tensor:
    """Whether any of K bag layouts breaks ``nn.EmbeddingBag``'s rules for its offsets.

    Layout k is ``offsets[k]`` (int64, 1-D; every one on one device) over ``num_ids[k]``
    ids. It breaks a rule when ``offsets[k][0] != 0``, when an entry is smaller than the one
    before, when the last entry is past ``num_ids[k]``, or, with ``include_last_offset[k]``,
    when the last entry differs from it; an empty ``offsets[k]`` breaks one when there are ids
    or with ``include_last_offset[k]``.

    Returns a (1,) bool tensor on the offsets' device; nothing is read back (on CUDA one
    launch per 32 layouts, no host sync), so the flag can ride on a later read, as
    ``find_or_insert``'s ``bad_input`` does.

    Example::

        >>> bag_layouts_bad([torch.tensor([0, 2, 1])], [3], [False]).tolist()
        [True]
    """
    _ext.require()
    if not len(offsets):
        raise ValueError("veloce::bag_layouts_bad: offsets must hold at least one tensor (the flag is made on its device)")
    return torch.ops.veloce.bag_layouts_bad(list(offsets), [int(n) for n in num_ids],
                                            [int(i) for i in include_last_offset])  # fmt: skip


def pooled_lookup_kernels(weights: Sequence[torch.Tensor], slots: Sequence[torch.Tensor],
                          offsets: Sequence[torch.Tensor], psws: Sequence[torch.Tensor | None],
                          modes: Sequence[int], include_last_offset: Sequence[bool],
                          extra_rows: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:  # fmt: skip
    """The lookups of K tables with ``check_inputs=False``, straight to the backend kernels,
    below the autograd key: for callers that are the lookups' autograd themselves
    (``DynamicEmbedding``'s training lookups, the owner's half of a sharded lookup), where the
    op's own autograd registration, in Python, would only redispatch. One
    ``pooled_lookup_many`` per group of tables that share device, dtype, dim and
    ``include_last_offset`` (a model's tables are usually one group), ``pooled_lookup`` for a
    table alone in its group. The results do not require grad."""
    groups: dict[tuple, list[int]] = {}
    for k, w in enumerate(weights):
        groups.setdefault((w.device, w.dtype, w.shape[1], bool(include_last_offset[k])), []).append(k)
    out: list = [None] * len(weights)
    with torch._C._AutoDispatchBelowAutograd():
        for (_, _, _, ilo), idx in groups.items():
            if len(idx) == 1:
                k = idx[0]
                out[k] = torch.ops.veloce.pooled_lookup(weights[k], slots[k], offsets[k], psws[k], modes[k], ilo,
                                                        extra_rows[k], False)  # fmt: skip
                continue
            res = torch.ops.veloce.pooled_lookup_many(
                [weights[k] for k in idx], [slots[k] for k in idx], [offsets[k] for k in idx], [psws[k] for k in idx],
                [modes[k] for k in idx], ilo, [extra_rows[k] for k in idx], False,
            )  # fmt: skip
            for k, o in zip(idx, res):
                out[k] = o
    return out


def bag_of(offsets: torch.Tensor, n: int) -> torch.Tensor:
    """(n,) the bag index of each of ``n`` positions, for bag starts ``offsets`` (B,)."""
    return torch.bucketize(torch.arange(n, device=offsets.device), offsets, right=True) - 1


def max_pool(
    weights: torch.Tensor,
    slots: torch.Tensor,
    offsets: torch.Tensor,
    include_last_offset: bool = False,
    extra_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-column max of each bag's rows, as ``nn.EmbeddingBag(mode="max")``, and where it
    was found. Composed of torch ops (a gather and two scatter reductions; no host sync).

    Slot codes as :func:`pooled_lookup`'s: padding (-1) is skipped, -2 is a row of zeros,
    ``slot >= C`` reads ``extra_rows``. An empty bag (or one of padding only) gives zeros,
    as in torch. Ties go to the first position, as torch's CPU kernel. The inputs are not
    checked (callers pass validated bags).

    Args:
        weights: the table rows.
        slots: int64 row of each position.
        offsets: int64 start of each bag.
        include_last_offset: offsets has ``B + 1`` entries, the last equal to ``N``.
        extra_rows: rows read by slots ``>= C``.

    Returns:
        ``(out, argmax)``: the pooled rows, and per bag and column the position whose row
        gave the max (``N`` where the bag has none), for :func:`max_pool_position_grad`.

    Shape:
        - weights: ``(C, D)``; slots: ``(N,)``; offsets: ``(B,)`` or ``(B + 1,)``; extra_rows: ``(M, D)``
        - out: ``(B, D)``, dtype of ``weights``; argmax: ``(B, D)`` int64
    """
    offs = offsets[:-1] if include_last_offset else offsets
    b, n, d = offs.shape[0], slots.shape[0], weights.shape[1]
    c = weights.shape[0]
    bag = bag_of(offs, n)
    rows = weights.index_select(0, slots.clamp(0, max(c - 1, 0))) if c else weights.new_zeros((n, d))
    if extra_rows is not None and extra_rows.shape[0]:
        extra = slots >= c
        picked = extra_rows.index_select(0, (slots - c).clamp(0, extra_rows.shape[0] - 1))
        rows = torch.where(extra.unsqueeze(1), picked, rows)
    valid = slots != -1
    rows = rows.masked_fill((slots < 0).unsqueeze(1), 0)  # -2: a zero row, counted
    rows = rows.masked_fill(~valid.unsqueeze(1), float("-inf"))  # padding never wins
    index = bag.unsqueeze(1).expand(n, d)
    out = weights.new_full((b, d), float("-inf")).scatter_reduce(0, index, rows, "amax", include_self=True)
    count = torch.zeros(b, dtype=torch.long, device=slots.device).index_add_(0, bag, valid.long())
    out = out.masked_fill((count == 0).unsqueeze(1), 0)
    position = torch.arange(n, device=slots.device).unsqueeze(1).expand(n, d)
    hit = (rows == out.index_select(0, bag)) & valid.unsqueeze(1)
    argmax = torch.full((b, d), n, dtype=torch.long, device=slots.device).scatter_reduce(
        0, index, torch.where(hit, position, n), "amin", include_self=True
    )
    return out, argmax


def max_pool_position_grad(
    grad_output: torch.Tensor, argmax: torch.Tensor, offsets: torch.Tensor, num_positions: int,
    include_last_offset: bool = False,
) -> torch.Tensor:
    """The gradient of :func:`max_pool` per position: position ``i`` of bag ``b`` gets
    ``grad_output[b, j]`` in each column ``j`` whose max it holds, zero elsewhere. Read as
    a gradient of ``N`` bags of one position each (``offsets = arange(N)``, mode sum), it
    is the rows' gradient (:func:`accumulate_grad`, a sparse optimizer step).

    Shape:
        - grad_output, argmax: ``(B, D)``; offsets: ``(B,)`` or ``(B + 1,)``
        - output: ``(N, D)``, dtype of ``grad_output``
    """
    offs = offsets[:-1] if include_last_offset else offsets
    n = num_positions
    bag = bag_of(offs, n)
    position = torch.arange(n, device=offs.device).unsqueeze(1)
    mine = argmax.index_select(0, bag) == position
    return torch.where(mine, grad_output.index_select(0, bag), grad_output.new_zeros(()))


def psw_gradient(
    weights: torch.Tensor, slots: torch.Tensor, offsets: torch.Tensor, grad_output: torch.Tensor,
    include_last_offset: bool = False, extra_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gradient of a sum or mean lookup's per-sample weights:
    ``d out[bag(i)] / d psw[i] = <row(i), grad_output[bag(i)]>``, zero for codes -1 and -2;
    slots ``>= C`` read ``extra_rows`` (an eval lookup's unknown ids). Composed of torch ops.

    Shape:
        - weights: ``(C, D)``; slots: ``(N,)``; offsets: ``(B,)`` or ``(B + 1,)``;
          grad_output: ``(B, D)``; extra_rows: ``(M, D)``
        - output: ``(N,)``, dtype of ``grad_output``
    """
    bag = bag_of(offsets[:-1] if include_last_offset else offsets, slots.numel())
    c = weights.shape[0]
    rows = weights[slots.clamp(0, c - 1)]
    if extra_rows is not None:
        picked = extra_rows[(slots - c).clamp(0, extra_rows.shape[0] - 1)]
        rows = torch.where((slots >= c).unsqueeze(1), picked, rows)
    return ((rows * grad_output[bag]).sum(1) * (slots >= 0)).to(grad_output.dtype)


def _num_bags(offsets: torch.Tensor, include_last_offset: bool) -> int:
    n = offsets.shape[0]
    if include_last_offset:
        torch._check(n >= 1, lambda: "offsets must hold at least one entry with include_last_offset=True")
        return n - 1
    return n


def _fake_pooled_lookup(
    weights, slots, offsets, per_sample_weights, mode, include_last_offset, extra_rows=None, check_inputs=True
):
    torch._check(weights.dim() == 2, lambda: f"weights must be 2-D, got {weights.dim()}-D")
    torch._check(slots.dim() == 1, lambda: f"slots must be 1-D, got {slots.dim()}-D")
    torch._check(slots.dtype == torch.int64, lambda: f"slots must be int64, got {slots.dtype}")
    torch._check(mode in (0, 1), lambda: f"mode must be 0 (sum) or 1 (mean), got {mode}")
    return weights.new_empty((_num_bags(offsets, include_last_offset), weights.shape[1]))


def _fake_pooled_lookup_many(weights, slots, offsets, per_sample_weights, mode, include_last_offset, extra_rows,
                             check_inputs=True):  # fmt: skip
    torch._check(
        len(slots) == len(weights) and len(offsets) == len(weights) and len(mode) == len(weights),
        lambda: "pooled_lookup_many: one entry per table in every list",
    )
    return [
        _fake_pooled_lookup(w, s, o, p, m, include_last_offset, e)
        for w, s, o, p, m, e in zip(weights, slots, offsets, per_sample_weights, mode, extra_rows)
    ]


def _fake_bag_layouts_bad(offsets, num_ids, include_last_offset):
    torch._check(len(offsets) >= 1, lambda: "bag_layouts_bad: offsets must hold at least one tensor")
    return offsets[0].new_empty((1,), dtype=torch.bool)


def _fake_accumulate_grad(
    grad_output, slots, offsets, per_sample_weights, mode, include_last_offset, num_rows
):
    torch._check(grad_output.dim() == 2, lambda: f"grad_output must be 2-D, got {grad_output.dim()}-D")
    torch._check(slots.dtype == torch.int64, lambda: f"slots must be int64, got {slots.dtype}")
    num_unique = torch.library.get_ctx().new_dynamic_size()
    return slots.new_empty((num_unique,)), grad_output.new_empty((num_unique, grad_output.shape[1]))


def _setup_context(ctx, inputs, output) -> None:
    weights, slots, offsets, per_sample_weights, mode, include_last_offset, extra_rows, _ = inputs
    ctx.mode = mode
    ctx.include_last_offset = include_last_offset
    ctx.save_for_backward(weights, slots, offsets, per_sample_weights, extra_rows)


def _backward_many(ctx, *grads):
    raise RuntimeError(
        "veloce::pooled_lookup_many has no gradient: call pooled_lookup per table for gradients w.r.t. weights "
        "or per_sample_weights (DynamicEmbedding and lookup_many send their tables' gradients to the tables)"
    )


def _backward(ctx, grad_output: torch.Tensor):
    weights, slots, offsets, per_sample_weights, extra_rows = ctx.saved_tensors
    grad_weights = grad_psw = None
    if ctx.needs_input_grad[0]:
        unique_slots, grad_rows = torch.ops.veloce.accumulate_grad(
            grad_output,
            slots,
            offsets,
            per_sample_weights,
            ctx.mode,
            ctx.include_last_offset,
            weights.shape[0],
        )
        grad_weights = weights.new_zeros(weights.shape).index_add(0, unique_slots, grad_rows)
    if per_sample_weights is not None and ctx.needs_input_grad[3]:
        # d out[b] / d psw[i] = row(i) for i in bag b: the dot of grad_output[bag(i)] and row(i).
        num_bags = _num_bags(offsets, ctx.include_last_offset)
        positions = torch.arange(slots.shape[0], device=slots.device)
        bag = torch.searchsorted(offsets[:num_bags], positions, right=True) - 1
        table = weights if extra_rows is None else torch.cat([weights, extra_rows])
        if table.shape[0] == 0:  # every slot is then -1 or -2
            rows = table.new_zeros((slots.shape[0], table.shape[1]))
        else:
            rows = table[slots.clamp(min=0)] * (slots >= 0).unsqueeze(1).to(table.dtype)
        grad_psw = (grad_output[bag] * rows).sum(1)
    return grad_weights, None, None, grad_psw, None, None, None, None


if _ext.loaded:
    torch.library.register_fake("veloce::pooled_lookup")(_fake_pooled_lookup)
    torch.library.register_fake("veloce::pooled_lookup_many")(_fake_pooled_lookup_many)
    torch.library.register_fake("veloce::accumulate_grad")(_fake_accumulate_grad)
    torch.library.register_fake("veloce::bag_layouts_bad")(_fake_bag_layouts_bad)
    # once_differentiable: the weights' gradient comes from accumulate_grad, which has no
    # derivative of its own; a double backward through it raises instead of being wrong.
    torch.library.register_autograd("veloce::pooled_lookup", once_differentiable(_backward),
                                    setup_context=_setup_context)  # fmt: skip
    torch.library.register_autograd("veloce::pooled_lookup_many", _backward_many)
