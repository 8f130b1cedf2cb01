"""The backward of a sharded lookup: each part's gradient sent to its owner, which keeps
it as its table's pending gradient (at once in sync mode, ``staleness`` steps later in
async mode), and the per-sample weights' gradients computed by the owners and sent back.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from veloce.distributed._comm import all_to_all, all_to_all_rows, wire_dtype
from veloce.distributed.layout import cat_grads, received_order, split_psw_grads, table_major
from veloce.distributed.owner import Served, current_slots, record
from veloce.sparse import forget_gradient, note_backward

__all__ = ["InFlight", "send_gradients", "deliver", "drop_failed_gradients"]


@dataclass
class InFlight:
    """An async gradient exchange, as one table sees it: ``grad()`` waits and returns
    this table's received part gradients."""

    step: int  # the optimizer step whose backward sent it
    grad: Callable[[], torch.Tensor]
    owner: Served


def send_gradients(ex: Any, grads: Sequence[Optional[torch.Tensor]], psw_grad: list[bool]):
    """Sends each part's gradient to its owner; returns per-table per-sample-weight
    gradients (None where not needed)."""
    shard, g = ex.shard, ex.shard.group
    if ex.refused:  # zeros of the prefetched bags' shapes: the same collectives, nothing to apply
        grads = [None] * len(ex.modules)
    grad = cat_grads(ex.modules, grads, ex.batch.num_bags, ex.perm.device)
    if ex.scale is not None:
        grad = grad * ex.scale.unsqueeze(1)
    # Averaged over ranks, as DDP, and, with a narrower exchange dtype, rounded to it once per
    # bag before its parts are gathered: one pass, computed in the table's dtype.
    wire = wire_dtype(shard.exchange_dtype, grad.dtype) or grad.dtype
    grad = torch.div(grad, g.size, out=torch.empty(grad.shape, dtype=wire, device=grad.device))
    grad_parts = grad.index_select(0, ex.bag_of_part)
    if ex.refused:  # the other ranks' collectives, whatever this rank's forward was given
        psw_grad = [ex.prefetched_psw_grad] * len(ex.modules)
    want_psw = any(psw_grad)
    per_table = deliver(shard, ex.modules, ex.served, grad_parts, ex.part_splits, ex.recv_parts_n,
                         ex.recv_parts_nk, sync=want_psw)  # fmt: skip
    if not want_psw:
        return [None] * len(ex.modules)
    psw_grads = _psw_grads(ex, per_table, psw_grad)
    return [None] * len(ex.modules) if ex.refused else psw_grads


def deliver(shard: Any, modules: list, served: list, rows: torch.Tensor, send_splits: list[int],
             recv_splits: list[int], recv_nk: Sequence[Sequence[int]], sync: bool):
    """Sends gradient ``rows`` to their owners, who keep their tables' shares (the received
    rows regrouped per table, ``recv_nk[k][p]`` of table k from peer p) as pending
    gradients: now in sync mode (returns those shares), or ``staleness`` steps later in
    async mode (returns None)."""
    per_table = [sum(c) for c in recv_nk]
    dtype = modules[0].table.dtype  # rows may arrive in a narrower exchange_dtype: regrouped, then widened
    wire = wire_dtype(shard.exchange_dtype, dtype)
    if not sync and shard.mode == "async" and shard.staleness > 0:
        wait = all_to_all_rows(shard.grad_group, rows, send_splits, recv_splits, wire, async_op=True)
        landed: dict[str, list] = {}

        def table_grads() -> list:
            if "grads" not in landed:
                landed["grads"] = table_major(wait(), recv_nk, dtype).split(per_table)
            return landed["grads"]

        for k, m in enumerate(modules):
            m.backend.flights.append(InFlight(m.backend.steps, lambda k=k: table_grads()[k], served[k]))
            note_backward(m)  # waits for step() too (veloce.sparse.check_unapplied)
        return None
    recv = all_to_all_rows(shard.group, rows, send_splits, recv_splits, wire)
    shares = table_major(recv, recv_nk, dtype).split(per_table)
    record(modules, served, shares)
    return shares


def _psw_grads(ex: Any, per_table: Sequence[torch.Tensor], psw_grad: list[bool]) -> list:
    """d out[bag] / d psw[i] = <row(i), grad of i's part>: computed by the owner, sent back."""

    g = ex.shard.group
    mine = [
        _owner_psw_grad(m, s, gk) if s is not None
        else gk.new_zeros(sum(n))  # a failed owner (lookup_errors="raise_next"): the step raises anyway
        for m, s, gk, n in zip(ex.modules, ex.served, per_table, ex.recv_ids_nk)
    ]  # fmt: skip
    back = all_to_all(g, received_order(mine, ex.recv_ids_nk), ex.recv_ids_n, ex.id_splits)
    flat = torch.zeros(ex.perm.numel(), dtype=back.dtype, device=back.device).index_copy_(0, ex.perm, back)
    return split_psw_grads(flat, ex.batch.kept, ex.batch.num_ids, psw_grad)


def _owner_psw_grad(module: Any, served: Served, grad: torch.Tensor) -> torch.Tensor:
    """The owner's per-sample-weight gradients of its served ids: the positions the default
    row served (admission) read it as the lookup did (slot ``C``, extra row 0)."""
    table, slots = module.table, current_slots(module, served)
    if served.refused is None:
        return table.psw_grad(slots, served.offsets, grad, False)
    return table.psw_grad(slots.masked_fill(served.refused, table.capacity), served.offsets, grad, False,
                          table.default_rows())  # fmt: skip


def drop_failed_gradients(modules: Sequence) -> None:
    """After an owner's deferred failure (``lookup_errors="raise_next"``), before it raises:
    the sparse gradients not yet applied are dropped, pending ones and, in async mode, those
    the failed step's backward sent (earlier steps' stay in flight), so no part of that
    forward's gradient is applied later."""
    for m in modules:
        forget_gradient(m)
        shard = m.backend
        if shard.in_flight:
            shard.flights = deque(f for f in shard.flights if f.step < shard.steps)
