"""The exchange op family: what a sharded lookup does around its all-to-all.

Typed wrappers over ``torch.ops.veloce.owner_of``, ``bucketize_bags``, ``combine_parts``
and ``regroup_blocks`` (with ``dtype``: ``combine_parts_as`` and ``regroup_blocks_as``;
kernels: ``csrc/cpu/exchange.cpp``, ``csrc/cuda/exchange.cu``), their fake kernels, and
the autograd registrations of the last four. Semantics: docs/ops.md.

Shape glossary: ``N`` ids, ``B`` bags, ``W`` world size, ``M`` non-padding ids, ``P``
parts (one per bag and owner it has ids on), ``D`` embedding dim.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from veloce.ops import extension as _ext

__all__ = ["Buckets", "owner_of", "bucketize_bags", "combine_parts", "regroup_blocks"]


class Buckets(NamedTuple):
    """A batch of bags cut by owner (what :func:`bucketize_bags` returns).

    Attributes:
        perm: (M,) positions of the non-padding ids, stably sorted by owner.
        id_splits: (W,) ids per owner (``perm`` is their concatenation).
        bag_of_part: (P,) the bag of each part; parts are ordered by (owner, bag).
        part_lengths: (P,) ids per part; part ``p``'s ids are consecutive in ``perm``.
        part_splits: (W,) parts per owner.

    With ``bucketize_bags(..., exact_sizes=False)``, ``perm``, ``bag_of_part`` and
    ``part_lengths`` have N rows: ``perm`` ends with the padding positions, the parts
    arrays hold the ``part_splits.sum()`` parts first, then zeros.
    """

    perm: torch.Tensor
    id_splits: torch.Tensor
    bag_of_part: torch.Tensor
    part_lengths: torch.Tensor
    part_splits: torch.Tensor


def owner_of(ids: torch.Tensor, world_size: int) -> torch.Tensor:
    """The rank that owns each id: a hash of the id (independent of the table's) mod
    ``world_size``. Any int64 id is valid.

    Shape: ids ``(N,)`` int64 -> ``(N,)`` int64 in ``[0, world_size)``.

    Example::

        >>> owner_of(torch.tensor([0, -1, 2**63 - 1]), 4).tolist()  # doctest: +SKIP
        [1, 3, 0]
    """
    _ext.require()
    return torch.ops.veloce.owner_of(ids, world_size)


def bucketize_bags(
    ids: torch.Tensor,
    offsets: torch.Tensor,
    world_size: int,
    include_last_offset: bool = False,
    padding_id: Optional[int] = None,
    exact_sizes: bool = True,
) -> Buckets:
    """Groups the ids of a batch of bags by owner and cuts each bag into per-owner parts.

    Padding ids are dropped. Rank ``r`` receives ``ids[perm]``'s ``r``-th split and the
    ``r``-th split of ``part_lengths``: it pools each part (a partial bag), and
    :func:`combine_parts` adds the parts coming back into the bags.

    Args:
        ids: (N,) int64 ids.
        offsets: start of each bag, as ``nn.EmbeddingBag`` (``(B,)``, or ``(B + 1,)`` with
            ``include_last_offset``).
        world_size: number of owners W >= 1.
        include_last_offset: as ``nn.EmbeddingBag``.
        padding_id: an id that is dropped.
        exact_sizes: False returns the same values without waiting for the device (on
            CUDA the exact sizes need a host sync), in tensors of upper-bound sizes: ``perm``
            has N entries (the padding positions last), ``bag_of_part`` and
            ``part_lengths`` have N, the ``P = part_splits.sum()`` parts first and zeros
            after. The CUDA kernel then does not check the offsets' values (that check is
            read back with the sizes): it stays in bounds on any offsets, and the caller
            checks the layout itself (the sharded lookup sends its check in the exchange's
            header, read back with the split sizes).

    Returns:
        :class:`Buckets`.
    """
    _ext.require()
    # (the op's schema has include_last_offset before world_size: a call in that order would
    # pass a bool as world_size)
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"bucketize_bags: world_size must be an int, got {world_size!r} (the wrapper takes ids, "
                        f"offsets, world_size, include_last_offset, ...)")  # fmt: skip
    if not isinstance(include_last_offset, bool):
        raise TypeError(f"bucketize_bags: include_last_offset must be a bool, got {include_last_offset!r}")
    return Buckets(*torch.ops.veloce.bucketize_bags(ids, offsets, include_last_offset, world_size, padding_id,
                                                    exact_sizes))  # fmt: skip


def combine_parts(parts: torch.Tensor, bag_of_part: torch.Tensor, num_bags: int, check_bags: bool = True,
                  dtype: Optional[torch.dtype] = None) -> torch.Tensor:  # fmt: skip
    """Sums parts into bags: ``out[b] = sum(parts[p] for p with bag_of_part[p] == b)``, in
    part order (deterministic on every device). Differentiable w.r.t. ``parts``.

    Shape: parts ``(P, D)``, bag_of_part ``(P,)`` int64 in ``[0, num_bags)`` -> ``(num_bags, D)``.

    ``check_bags=False`` is for a ``bag_of_part`` that comes from :func:`bucketize_bags`: on
    CUDA it skips the range check's device read (a host sync); an index out of range then
    gives wrong sums, never a bad memory access. The CPU kernel always checks.

    ``dtype``: the output's dtype (float32, float64, float16 or bfloat16; default parts').
    The sums are accumulated in float64 when the parts or ``dtype`` are float64, else in
    float32, and converted once, in the op (``torch.ops.veloce.combine_parts_as``):
    bfloat16 parts sum straight into float32 bags, equal to converting the parts first,
    without that pass.
    """
    _ext.require()
    if dtype is None or dtype == parts.dtype:
        return torch.ops.veloce.combine_parts(parts, bag_of_part, num_bags, check_bags)
    return torch.ops.veloce.combine_parts_as(parts, bag_of_part, num_bags, check_bags, dtype)


def regroup_blocks(sources: Sequence[torch.Tensor], counts: Sequence[Sequence[int]],
                   to_group_major: bool, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The rows an all-to-all moves, regrouped between peer-major and group-major order.

    An all-to-all that carries G groups of rows (the tables of a grouped lookup, say) to or
    from W peers moves one block per (group, peer): ``counts[g][p]`` rows. It delivers them
    peer-major (peer 0's blocks of groups 0..G-1, then peer 1's, ...), while an owner
    serves each group from one run of rows: group-major (group 0's blocks from peers
    0..W-1, then group 1's, ...). One copy (on CUDA one launch per 128 blocks), where
    ``torch.split`` into the G * W blocks and ``torch.cat`` cost a tensor per block on the
    host. Differentiable w.r.t. ``sources`` (the gradient is regrouped back).

    Args:
        sources: ``to_group_major``: one tensor, the rows in peer-major order; else G
            tensors, group g's rows in peer order. Same dtype, device and row shape
            ``(*, ...)``.
        counts: G lists of W non-negative row counts (``counts[g][p]``).
        to_group_major: the direction (see ``sources``).
        dtype: the output's dtype (default the sources'). Rows of float32, float64,
            float16 and bfloat16 are converted in the same copy
            (``torch.ops.veloce.regroup_blocks_as``), to the values ``Tensor.to`` gives (a
            NaN stays NaN, its payload bits may differ from ``Tensor.to``'s on CPU): an
            exchange that sends rows in 16 bits narrows or widens them without a pass of
            its own.

    Returns:
        One tensor of all the rows: group-major when ``to_group_major``, else peer-major.

    Example::

        >>> rows = torch.arange(5)  # from peer 0: group 0 [0], group 1 [1, 2]; peer 1: [3], [4]
        >>> regroup_blocks([rows], [[1, 1], [2, 1]], to_group_major=True).tolist()  # doctest: +SKIP
        [0, 3, 1, 2, 4]
    """
    _ext.require()
    if not len(sources):
        raise ValueError("regroup_blocks: sources is empty; it holds the rows (one tensor, or one per group)")
    W = len(counts[0]) if len(counts) else 0
    if W == 0 or any(len(row) != W for row in counts):
        raise ValueError(f"regroup_blocks: counts must be G >= 1 lists of W >= 1 row counts each (one per peer), "
                         f"got lists of lengths {[len(row) for row in counts]}")  # fmt: skip
    return _regroup(list(sources), [c for row in counts for c in row], len(counts), to_group_major, dtype)


def _regroup(sources: list, counts: list[int], num_groups: int, to_group_major: bool,
             dtype: Optional[torch.dtype]) -> torch.Tensor:  # fmt: skip
    """The op that regroups (flat ``counts``): ``regroup_blocks``, or ``regroup_blocks_as``
    when the rows change dtype."""
    if dtype is None or dtype == sources[0].dtype:
        return torch.ops.veloce.regroup_blocks(sources, counts, num_groups, to_group_major)
    return torch.ops.veloce.regroup_blocks_as(sources, counts, num_groups, to_group_major, dtype)


def _fake_owner_of(ids, world_size):
    return torch.empty_like(ids)


def _fake_bucketize_bags(ids, offsets, include_last_offset, world_size, padding_id=None, exact_sizes=True):
    new = ids.new_empty
    if not exact_sizes:  # upper-bound sizes: static
        n = ids.shape[0]
        return new(n), new(world_size), new(n), new(n), new(world_size)
    ctx = torch.library.get_ctx()
    m, p = ctx.new_dynamic_size(), ctx.new_dynamic_size()
    return new(m), new(world_size), new(p), new(p), new(world_size)


def _fake_combine_parts(parts, bag_of_part, num_bags, check_bags=True, dtype=None):
    """combine_parts's fake kernel, and (with ``dtype``) combine_parts_as's."""
    return parts.new_empty((num_bags, parts.shape[1]), dtype=dtype or parts.dtype)


def _combine_setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[1])
    ctx.parts_dtype, ctx.nones = inputs[0].dtype, len(inputs) - 1


def _combine_backward(ctx, grad_out: torch.Tensor):
    """Each part's gradient is its bag's, in the parts' dtype (combine_parts and combine_parts_as)."""
    (bag_of_part,) = ctx.saved_tensors
    return grad_out.to(ctx.parts_dtype).index_select(0, bag_of_part), *[None] * ctx.nones


def _fake_regroup_blocks(sources, counts, num_groups, to_group_major, dtype=None):
    """regroup_blocks's fake kernel, and (with ``dtype``) regroup_blocks_as's."""
    return sources[0].new_empty((sum(counts), *sources[0].shape[1:]), dtype=dtype or sources[0].dtype)


def _regroup_setup_context(ctx, inputs, output) -> None:
    ctx.counts, ctx.num_groups, ctx.to_group_major = inputs[1], inputs[2], inputs[3]
    ctx.source_dtype, ctx.nones = inputs[0][0].dtype, len(inputs) - 1


def _regroup_backward(ctx, grad_out: torch.Tensor):
    """The sources' gradients: ``grad_out`` regrouped back, in the sources' dtype
    (regroup_blocks and regroup_blocks_as)."""
    G = ctx.num_groups
    W = len(ctx.counts) // G
    group_rows = [sum(ctx.counts[g * W : (g + 1) * W]) for g in range(G)]
    if ctx.to_group_major:  # the gradient, group-major, goes back peer-major (one source)
        grads = [_regroup(list(grad_out.split(group_rows)), ctx.counts, G, False, ctx.source_dtype)]
    else:  # peer-major back to group-major, cut into the G sources
        grads = list(_regroup([grad_out], ctx.counts, G, True, ctx.source_dtype).split(group_rows))
    return grads, *[None] * ctx.nones


if _ext.loaded:
    torch.library.register_fake("veloce::owner_of")(_fake_owner_of)
    torch.library.register_fake("veloce::bucketize_bags")(_fake_bucketize_bags)
    for name in ("combine_parts", "combine_parts_as"):
        torch.library.register_fake(f"veloce::{name}")(_fake_combine_parts)
        torch.library.register_autograd(f"veloce::{name}", _combine_backward, setup_context=_combine_setup_context)
    for name in ("regroup_blocks", "regroup_blocks_as"):
        torch.library.register_fake(f"veloce::{name}")(_fake_regroup_blocks)
        torch.library.register_autograd(f"veloce::{name}", _regroup_backward, setup_context=_regroup_setup_context)
