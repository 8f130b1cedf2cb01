"""The layout of one sharded exchange of K tables, shared by its stages: the bags
concatenated (padding dropped), blocks regrouped between the peer-major order of an
all-to-all and the table-major order of the tables, and the output cut per table.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from veloce.ops.exchange import regroup_blocks
from veloce.runtime.device import host_tensor

__all__ = [
    "SUM", "training_modes", "Batch", "concat_bags", "shift_segments", "bag_shapes", "split_outputs",
    "tags_hash", "table_major", "received_order", "mean_scale", "cat_grads", "split_psw_grads",
]  # fmt: skip

SUM = 0


def training_modes(modules: Sequence) -> tuple[bool, ...]:
    """Per table, whether its lookup now is a training lookup (it inserts, and its gradient
    is exchanged): training mode with gradients enabled, as
    :func:`veloce.sparse.training_lookup` says."""
    grad = torch.is_grad_enabled()
    return tuple(grad and m.training for m in modules)


def _drop_padding(module, ids, offsets, psw):
    """Removes the padding positions of one table's bags (they are neither sent nor
    counted); returns the kept positions too (None when nothing was dropped)."""
    ilo = module.include_last_offset
    starts = offsets[:-1] if ilo else offsets
    if module.padding_idx is None:
        return ids, starts, psw, None
    keep = ids != module.padding_idx
    kept = keep.nonzero().squeeze(1)
    dropped_before = torch.cumsum(~keep, 0) - (~keep).long()  # pads strictly before each position
    n = ids.numel()
    if starts.numel():
        at = starts.clamp(min=0, max=max(n - 1, 0))  # in range even for a layout not yet checked
        shift = dropped_before[at] if n else torch.zeros_like(starts)
        shift = torch.where(starts >= n, (~keep).sum().expand_as(starts), shift)
        starts = starts - shift
    return ids[kept], starts, None if psw is None else psw[kept], kept


@dataclass
class Batch:
    """The bags of K tables, padding dropped, concatenated table after table."""

    ids: torch.Tensor  # (M,)
    starts: torch.Tensor  # (B,) bag starts into ids
    psw: Optional[torch.Tensor]  # (M,) per-sample weights (ones for tables without), or None
    kept: list  # per table: positions kept, or None when nothing was dropped
    num_ids: list[int]  # per table: ids given (padding included)
    num_kept: list[int]  # per table: ids kept
    num_bags: list[int]  # per table: bags


def concat_bags(modules: list, bags: Sequence[tuple], dtype: torch.dtype, dev: torch.device) -> Batch:
    any_psw = any(b[2] is not None for b in bags)
    ids_l, starts_l, psw_l, kept_l, num_ids, num_kept, num_bags = [], [], [], [], [], [], []
    for m, (ids, offsets, psw) in zip(modules, bags):
        num_ids.append(ids.numel())
        ids, starts, psw, kept = _drop_padding(m, ids, offsets, psw)
        num_kept.append(ids.numel())
        num_bags.append(starts.numel())
        ids_l.append(ids)
        starts_l.append(starts)
        if any_psw:
            psw_l.append(psw if psw is not None else torch.ones(ids.numel(), dtype=dtype, device=dev))
        kept_l.append(kept)
    # Each table's bag starts, shifted past the ids of the tables before it: a few launches
    # for all tables, not one per table.
    starts_all = shift_segments(torch.cat(starts_l), num_bags, num_kept)
    psw_all = torch.cat(psw_l) if any_psw else None
    return Batch(torch.cat(ids_l), starts_all, psw_all, kept_l, num_ids, num_kept, num_bags)


def shift_segments(values: torch.Tensor, lengths: list[int], sizes: list[int]) -> torch.Tensor:
    """``values`` cut into segments of ``lengths``, each plus the sum of ``sizes`` of the
    segments before it (per-table positions made positions into the concatenation)."""
    bases = [0, *itertools.accumulate(sizes)][:-1]
    if not any(b and n for b, n in zip(bases, lengths)):
        return values
    dev = values.device
    both = host_tensor([bases, lengths], dev)  # (2, segments): one copy
    shift = torch.repeat_interleave(both[0], both[1], output_size=values.numel())
    return values + shift


def bag_shapes(bags: Sequence[tuple]) -> tuple:
    return tuple((i.shape, o.shape, None if p is None else p.shape) for i, o, p in bags)


def split_outputs(out: torch.Tensor, num_bags: list[int]) -> tuple[torch.Tensor, ...]:
    """The pooled rows of each table, as separate tensors over ``out``'s memory, without a
    copy. Autograd must treat each on its own: views of one tensor returned by an autograd
    Function may not be modified in place, and a user may do that to a lookup's output (as
    with ``nn.EmbeddingBag``'s). So each is a tensor of its own, not a view for autograd
    (``unsafe_split``: one op for all tables, each piece with its own version counter): the
    tables' rows are disjoint, so an in-place change of one touches no other. A clone per
    table cost a launch and a copy of its rows (218 MB per DLRM step of 26 tables); a tensor
    per table ``set_`` on ``out``'s storage cost two ops per table on the host."""
    if len(num_bags) == 1:
        return (out,)
    return tuple(out.contiguous().unsafe_split_with_sizes(num_bags))


def tags_hash(modules) -> int:
    """A fingerprint of which tables an exchange serves, the same on every rank."""
    h = 0
    for m in modules:
        h = (h * 1_000_003 + m.backend.tag + 1) % (1 << 61)
    return h


def table_major(t: torch.Tensor, counts: Sequence[Sequence[int]],
                 dtype: Optional[torch.dtype] = None) -> torch.Tensor:  # fmt: skip
    """Rows received from an all-to-all, one block per (peer, table) in peer-major order
    (``counts[k][p]`` rows of table k from peer p), regrouped table-major (each table's
    blocks in peer order): ``t`` itself when there is one table or one peer, otherwise one
    copy (:func:`~veloce.ops.exchange.regroup_blocks`). ``dtype``: the rows converted to it
    (rows that travelled in 16 bits widened), in that copy when there is one."""
    K, W = len(counts), len(counts[0]) if counts else 0
    if K <= 1 or W <= 1:
        return t if dtype is None else t.to(dtype)
    return regroup_blocks([t], counts, to_group_major=True, dtype=dtype)


def received_order(per_table: Sequence[torch.Tensor], counts: Sequence[Sequence[int]],
                    dtype: Optional[torch.dtype] = None) -> torch.Tensor:  # fmt: skip
    """The inverse of :func:`table_major`: per-table rows (table k's blocks in peer order)
    as one tensor, peer-major, in the order the all-to-all back to the peers sends.
    ``dtype``: the rows converted to it (narrowed for the wire), in the regrouping's copy."""
    if len(counts) == 1:
        return per_table[0] if dtype is None else per_table[0].to(dtype)
    return regroup_blocks(per_table, counts, to_group_major=False, dtype=dtype)  # one peer: a cat


def mean_scale(modules: list, batch: Batch, dtype: torch.dtype, dev: torch.device) -> Optional[torch.Tensor]:
    """1 / (ids in the bag, padding dropped) for the bags of mean tables, 1 elsewhere. No
    host-to-device copy (a graph would replay one from host memory that may since hold
    something else)."""
    if all(m.mode != "mean" for m in modules):
        return None
    ends = torch.cat([batch.starts[1:], batch.starts.new_full((1,), batch.ids.numel())])
    counts = (ends - batch.starts).to(dtype)
    is_mean = torch.cat([torch.full((n,), m.mode == "mean", device=dev) for m, n in zip(modules, batch.num_bags)])
    return torch.where(is_mean, 1.0 / counts.clamp(min=1), torch.ones_like(counts))


def cat_grads(modules: list, grads: Sequence[Optional[torch.Tensor]], num_bags: list[int], dev) -> torch.Tensor:
    """The tables' output gradients as one (sum B, D) tensor (zeros for unused outputs)."""
    dtype, dim = modules[0].table.dtype, modules[0].embedding_dim
    return torch.cat([
        gr.to(dtype) if gr is not None else torch.zeros((n, dim), dtype=dtype, device=dev)
        for gr, n in zip(grads, num_bags)
    ])  # fmt: skip


def split_psw_grads(flat: torch.Tensor, kept: list, num_ids: list[int], wanted: list[bool]) -> list:
    """Per-table per-sample-weight gradients from the gradients of the kept (non-padding)
    positions of all tables, concatenated; padding positions get zero."""
    out, start = [], 0
    for k_idx, n, want in zip(kept, num_ids, wanted):
        k = n if k_idx is None else k_idx.numel()
        piece = flat[start : start + k]
        start += k
        if not want:
            out.append(None)
        elif k_idx is None:
            out.append(piece)
        else:
            out.append(torch.zeros(n, dtype=piece.dtype, device=piece.device).index_copy_(0, k_idx, piece))
    return out
