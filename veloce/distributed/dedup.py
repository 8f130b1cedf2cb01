"""The deduplicated exchange of a sharded lookup (``HybridParallel(dedup=True)``).

Each distinct (table, id) of a batch travels once: the requester sends its distinct ids
to their owners (for tables with admission, with the number of times each occurs: the
owner counts every occurrence as a sighting), owners send back one row per id, and the
requester pools its bags locally from those rows (``pooled_lookup`` over the received
rows, so sums run in position order exactly as on one process). In backward the requester sums each distinct
row's gradient (``accumulate_grad``) and sends one gradient row per id back.

It moves ``U`` rows each way instead of one partial sum per (bag, owner): a win when ids
repeat within a batch (hot ids of Zipf-distributed features, bags of one id), a loss for
long bags of distinct ids, where partial sums are fewer. Per-sample-weight gradients
are computed locally (the requester holds the rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from veloce.distributed._comm import (
    all_to_all,
    all_to_all_rows,
    exchange_headers,
    modes_code,
    wire_code,
    wire_dtype,
)
from veloce.distributed.backward import deliver
from veloce.distributed.layout import (
    SUM,
    Batch,
    cat_grads,
    concat_bags,
    mean_scale,
    received_order,
    split_outputs,
    split_psw_grads,
    table_major,
    tags_hash,
)  # fmt: skip
from veloce.distributed.owner import serve_tables
from veloce.ops.exchange import owner_of
from veloce.runtime.device import host_tensor
from veloce.ops.embedding import accumulate_grad, pooled_lookup, psw_gradient
from veloce.sparse import check_offsets_many

__all__ = ["forward_rows"]


@dataclass
class _RowExchange:
    """Everything backward needs about one deduplicated lookup."""

    modules: list
    shard: Any  # the group's Shard (veloce.distributed.sharded)
    batch: Batch
    inverse: torch.Tensor  # (M,) distinct-id index of every kept position
    rows: torch.Tensor  # (U, D) the rows the owners sent
    scale: Optional[torch.Tensor]  # (sum B,) 1 / bag length for mean tables, 1 for sum tables
    send_order: torch.Tensor  # (U,) distinct ids in the order sent (by owner, table)
    id_splits: list[int]
    recv_ids_n: list[int]
    recv_ids_nk: list  # [k][peer]: ids received of table k from each peer
    served: list

    def backward(self, grads, psw_grad: list[bool]) -> list:
        batch, g = self.batch, self.shard.group
        grad = cat_grads(self.modules, grads, batch.num_bags, self.rows.device)
        pooled_grad = grad if self.scale is None else grad * self.scale.unsqueeze(1)
        U = self.rows.shape[0]
        slots, per_row = accumulate_grad(pooled_grad, self.inverse, batch.starts, batch.psw, SUM, False, num_rows=U)
        row_grads = torch.zeros_like(self.rows).index_copy_(0, slots, per_row) / g.size  # averaged, as DDP
        deliver(self.shard, self.modules, self.served, row_grads[self.send_order], self.id_splits,
                 self.recv_ids_n, self.recv_ids_nk, sync=False)  # fmt: skip
        if not any(psw_grad):
            return [None] * len(self.modules)

        flat = psw_gradient(self.rows, self.inverse, batch.starts, pooled_grad, False)
        return split_psw_grads(flat, batch.kept, batch.num_ids, psw_grad)


def _distinct(ids: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first position of every distinct (table, id), in (table, id) order; the distinct
    index of every position)."""
    order = torch.argsort(ids, stable=True)
    order = order[torch.argsort(table[order], stable=True)]
    sid, stab = ids[order], table[order]
    new = torch.ones(ids.numel(), dtype=torch.bool, device=ids.device)
    if ids.numel() > 1:
        new[1:] = (sid[1:] != sid[:-1]) | (stab[1:] != stab[:-1])
    inverse = torch.empty_like(order).index_copy_(0, order, torch.cumsum(new, 0) - 1)
    return order[new], inverse


def forward_rows(shard: Any, modules: list, bags: Sequence[tuple], psw_grad: bool, layouts: Sequence[tuple],
                 training: tuple[bool, ...]):  # fmt: skip
    """The forward of a deduplicated sharded lookup of ``modules`` (one exchange group of
    ``HybridParallel(dedup=True)``), called by the lookup's autograd function.

    Args:
        shard: the group's :class:`~veloce.distributed.sharded.Shard` (process group, mode).
        modules: the group's ``DynamicEmbedding`` tables, in the same order on every rank.
        bags: per table, ``(ids, offsets, per_sample_weights)`` as ``veloce.sparse.validated_bags``
            returns them (1-D ids, ``include_last_offset=False`` offsets, weights or None).
        psw_grad: whether some table's per-sample weights need a gradient.
        layouts: the bag layouts whose check was deferred; checked first, and a bad one fails
            every rank (this rank abandons the exchange) before any table changes.
        training: per table, whether its lookup is a training lookup (the owner inserts).

    Returns:
        ``(outputs, exchange)``: the pooled ``(B_k, D)`` output of every table, and what the
        backward needs (the rows received, the distinct-id inverse, the split sizes); its
        ``backward(grads, psw_grad)`` sends one gradient row per distinct id to its owner.
    """
    if layouts:  # the deferred bag layouts, checked before anything else (sharded_lookup)

        with shard.abandon_on_error():
            check_offsets_many(layouts)
    g = shard.group
    K, W = len(modules), g.size
    dev = bags[0][0].device
    dtype = modules[0].table.dtype
    batch = concat_bags(modules, bags, dtype, dev)
    table = torch.repeat_interleave(torch.arange(K, device=dev), host_tensor(batch.num_kept, dev),
                                    output_size=batch.ids.numel())  # fmt: skip
    first, inverse = _distinct(batch.ids, table)
    u_ids, u_table = batch.ids[first], table[first]
    cell = owner_of(u_ids, W) * K + u_table
    send_order = torch.argsort(cell, stable=True)  # by owner, then table
    ids_nk = torch.zeros(W * K, dtype=torch.long, device=dev).index_add_(0, cell, torch.ones_like(cell)).view(W, K)
    wire = wire_dtype(shard.exchange_dtype, dtype)
    signature = (K, tags_hash(modules), modules[0].embedding_dim, int(batch.psw is not None), int(psw_grad),
                 1 | wire_code(wire) << 1 | modes_code(training))  # fmt: skip
    what = f"DynamicEmbedding tables {[m.backend.tag for m in modules]}"
    sent, recv = exchange_headers(g, torch.cat([ids_nk.sum(1, keepdim=True), ids_nk], 1), signature, what)
    id_splits, recv_ids_n, recv_ids_nk = sent[0], recv[0], recv[1:]  # recv_ids_nk[k][peer]

    # The owner: per peer, ids come table after table; serve each table's block.
    recv_ids = all_to_all(g, u_ids[send_order], id_splits, recv_ids_n)
    ids_per_table = [sum(c) for c in recv_ids_nk]
    t_ids = table_major(recv_ids, recv_ids_nk).split(ids_per_table)
    sightings = None
    if any(m.table.admits for m in modules):  # (every rank's tables admit alike) each id's occurrences, counted
        counts = torch.bincount(inverse, minlength=first.numel())
        recv_counts = all_to_all(g, counts[send_order], id_splits, recv_ids_n)
        sightings = table_major(recv_counts, recv_ids_nk).split(ids_per_table)
    every = torch.arange(max(ids_per_table, default=0), device=dev)  # parts of one id each: part i starts at i
    served, rows = serve_tables(modules, t_ids, [every[:n] for n in ids_per_table], [None] * K, training,
                                sightings)  # fmt: skip
    back = received_order(rows, recv_ids_nk, wire)  # narrowed for the wire in the regrouping

    got = all_to_all_rows(g, back, recv_ids_n, id_splits, wire).to(dtype)  # rows in the order sent
    u_rows = torch.empty_like(got).index_copy_(0, send_order, got)
    out = pooled_lookup(u_rows, inverse, batch.starts, batch.psw, SUM, False, None, check_inputs=False)
    scale = mean_scale(modules, batch, dtype, dev)
    if scale is not None:
        out = out * scale.unsqueeze(1)
    ex = _RowExchange(modules, shard, batch, inverse, u_rows, scale, send_order, id_splits, recv_ids_n,
                      recv_ids_nk, served)  # fmt: skip
    return split_outputs(out, batch.num_bags), ex
