"""The output distribution of a sharded lookup: the owners' lookups (the forward's second
half), their partial sums sent back, and each bag's parts combined on the requester.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from veloce.distributed._comm import all_to_all_rows, wire_dtype
from veloce.distributed.backward import send_gradients
from veloce.distributed.input_dist import Dispatched
from veloce.distributed.layout import Batch, mean_scale, received_order, split_outputs
from veloce.distributed.owner import serve_inserted
from veloce.ops.exchange import combine_parts

__all__ = ["Exchange", "finish_lookup"]


@dataclass
class Exchange:
    """Everything backward needs about one grouped lookup."""

    modules: list
    shard: Any
    batch: "Batch"  # the requester's bags, padding dropped
    perm: torch.Tensor
    bag_of_part: torch.Tensor
    scale: Optional[torch.Tensor]  # (sum B,) 1 / bag length for mean tables, 1 for sum tables
    id_splits: list[int]
    part_splits: list[int]
    recv_ids_n: list[int]
    recv_parts_n: list[int]
    recv_parts_nk: list  # [k][peer]: parts received of table k from each peer
    recv_ids_nk: list  # [k][peer]: ids received of table k from each peer
    served: list  # Served per table
    refused: bool = False  # a prefetched exchange this rank's forward could not use (see _run_forward)
    prefetched_psw_grad: bool = False  # refused: what the other ranks' backward does (their signature's)

    def backward(self, grads, psw_grad: list[bool]) -> list:
        return send_gradients(self, grads, psw_grad)


def finish_lookup(shard: Any, d: Dispatched, refusal: Optional[Exception] = None):
    """The forward's second half: the owners' lookups and agreement, the partial sums back,
    combined per bag. ``refusal``: this rank cannot use a prefetched ``d`` (its forward's
    inputs differ): it still takes part in every collective, and fails through the owners'
    agreement, so that every rank raises, none waits."""
    g, modules, cb = shard.group, d.modules, d.batch
    dtype, dev = modules[0].table.dtype, cb.ids.device
    error = d.error or refusal
    changed = [m.backend.tag for m, v in zip(modules, d.versions) if m.table.version != v]
    if error is None and changed:  # prefetched slots of a table grown, evicted or erased since
        error = ValueError(
            f"HybridParallel.prefetch: table(s) {changed} changed between prefetch and this forward (an insert, "
            f"erase or load grew the table or moved its rows); call prefetch after step() and before the forward, "
            f"with nothing in between that inserts into the tables"
        )  # fmt: skip
    served, pooled = serve_inserted(modules, d.ids, d.starts, d.psw, d.slots, error, d.training)
    # The partial sums narrowed to the wire dtype in their regrouping, and summed from it
    # into the table's dtype: no pass of its own for either conversion.
    wire = wire_dtype(shard.exchange_dtype, dtype)
    partial = received_order(pooled, d.recv_parts_nk, wire)
    parts = all_to_all_rows(g, partial, d.recv_parts_n, d.part_splits, wire)
    # bag_of_part comes from bucketize_bags: in range, so no check (on CUDA, a host sync).
    total_bags = sum(cb.num_bags)
    out = combine_parts(parts, d.bag_of_part, total_bags, check_bags=False, dtype=dtype)
    scale = mean_scale(modules, cb, dtype, dev)
    if scale is not None:
        out = out * scale.unsqueeze(1)
    ex = Exchange(modules, shard, cb, d.perm, d.bag_of_part, scale, d.id_splits, d.part_splits, d.recv_ids_n,
                   d.recv_parts_n, d.recv_parts_nk, d.recv_ids_nk, served)  # fmt: skip
    return split_outputs(out, cb.num_bags), ex
