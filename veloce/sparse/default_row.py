"""The default row of a sharded table with admission (:mod:`veloce.admission`): one logical
row for the whole table, a replica on every rank.

Every owner pools the default row for the refused ids it serves, so every rank keeps a
replica, and each rank's pending gradient of it holds only the positions it served. A
step sums those gradients over the table's ranks (one all-reduce per process group and
accumulation dtype, whatever the number of tables) before the update, and every rank
applies the same sum: the replicas stay identical, and equal to the row one process
would train on the global batch. A rank that served no refused id takes part with a
zero gradient; when no rank did, the update touches no row (as in one process, where
the default row then gets no update at all). Nothing is read back to the host.
"""

from __future__ import annotations

from typing import Sequence

import torch

from veloce.ops.embedding import bag_of
from veloce.sparse.base import MODES, TableModule
from veloce.sparse.pending import Pending

__all__ = ["agreed_default_gradients", "default_entry", "shares_default_row"]


def shares_default_row(t: TableModule) -> bool:
    """Whether ``t``'s default row is replicated over ranks: a sharded table with admission."""
    return t.backend.sharded and t.table.admits


def default_entry(entry: Pending) -> Pending:
    """The default row's part of one backward pass's ``entry`` whose ``refused`` positions
    the default row served, as :meth:`~veloce.sparse.PendingGradient._accumulate_default`
    keeps it: the entry itself, its ``refused`` marking the row's positions
    (:func:`~veloce.sparse.pending.default_codes` gives its slots in the one-row table)."""
    return entry._replace(ids=None, version=0)


def _dense_gradient(entries: Sequence[Pending], dim: int, dtype: torch.dtype,
                    dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The default row's gradient in ``entries`` as a ``(D,)`` vector of ``dtype`` and
    whether any position reached it (a ``(1,)`` count of the entries that did), computed
    on the device: each bag's weight on the row (its per-sample weights of the positions
    with slot 0, over its length for mean bags) times the bag's gradient."""
    total = torch.zeros(dim, dtype=dtype, device=dev)
    touched = torch.zeros(1, dtype=dtype, device=dev)
    for e in entries:
        offsets = e.offsets[:-1] if e.include_last_offset else e.offsets
        n = e.slots.numel()
        bag = bag_of(offsets, n)
        hit = e.refused if e.refused is not None else e.slots == 0
        w = hit.to(dtype) if e.psw is None else hit.to(dtype) * e.psw.to(dtype)
        if e.mode == MODES["mean"]:
            counts = torch.zeros(offsets.numel(), dtype=dtype, device=dev).index_add_(0, bag, (e.slots != -1).to(dtype))
            w = w / counts.clamp(min=1)[bag]
        per_bag = torch.zeros(offsets.numel(), dtype=dtype, device=dev).index_add_(0, bag, w)
        total += per_bag @ e.grad.to(dtype)
        touched += hit.any().to(dtype)
    return total, touched


def agreed_default_gradients(tables: Sequence[TableModule]) -> dict[int, Pending]:
    """The default-row gradient of each table of ``tables`` that :func:`shares_default_row`,
    summed over its ranks, as one pending entry of one bag (slot 0, or -2 when no rank's
    lookups reached the row), keyed by ``id(table)``. A collective: every rank calls it
    with the same sharded tables in the same order. Leaves the tables' pending gradients
    as they are (a step that raises after it keeps the local parts, to be summed again)."""
    groups: dict[tuple, list[TableModule]] = {}
    for t in tables:
        if shares_default_row(t):
            acc = torch.promote_types(t.table.dtype, torch.float32)
            groups.setdefault((t.backend.group_id, t.table.device, acc), []).append(t)
    out: dict[int, Pending] = {}
    for (_, dev, acc), members in groups.items():
        parts = [_dense_gradient(t._pending_default, t.embedding_dim, acc, dev) for t in members]
        flat = torch.cat([g for g, _ in parts] + [c for _, c in parts])
        summed = members[0].backend.agree_all(flat)
        dims = [t.embedding_dim for t in members]
        grads = summed[: sum(dims)].split(dims)
        touched = summed[sum(dims):]
        offsets = torch.zeros(1, dtype=torch.long, device=dev)
        for k, (t, g) in enumerate(zip(members, grads)):
            slot = torch.where(touched[k : k + 1] > 0, 0, -2).long()
            out[id(t)] = Pending(None, slot, offsets, None, g.to(t.table.dtype).view(1, -1), MODES["sum"], False, 0)
    return out

