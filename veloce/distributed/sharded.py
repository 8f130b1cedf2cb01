"""A ``DynamicEmbedding`` sharded row-wise across ranks: the lookup and its gradient exchange.

Rank ``r`` owns the ids with ``owner_of(id, W) == r`` and keeps only those rows. A lookup
on any rank (the requester) runs, with one all-to-all per arrow::

    requester                                   owner
    bucketize_bags: ids by owner, bags cut
    into parts (one per bag and owner)  --ids, part lengths, [weights]-->  find_or_insert (train) /
                                                                           find (eval), pool each part
    combine_parts: sum each bag's parts <--partial sums (P, D)--
    (mean: / full bag length)

    backward: grad of each part         --(P, D), / W (DDP-style mean)-->  pending gradient, applied
                                                                           by the owner's step()

In ``sync`` mode the gradient exchange blocks in backward, so every update of step t is
applied at step t. In ``async`` mode it is launched without waiting, on a second process
group so it overlaps the next forward's exchanges, and the owner applies the gradients of
step t at step t + staleness (``staleness=0`` is sync).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from veloce.distributed._comm import Group, all_to_all, exchange_headers
from veloce.ops.exchange import bucketize_bags, combine_parts

__all__ = ["Shard", "table_shard"]

_SUM = 0
_MEAN = 1


def table_shard(module: Any) -> tuple[int, int]:
    """``(rank, world_size)`` of a ``DynamicEmbedding``'s sharding; ``(0, 1)`` when it is
    not sharded (a single process, or a replica)."""
    shard = getattr(module, "_shard", None)
    return (0, 1) if shard is None else (shard.group.rank, shard.group.size)


@dataclass
class _InFlight:
    """An async gradient exchange: the owner's received rows arrive in ``grad``."""

    step: int  # the requester step whose backward sent it
    work: Any
    grad: torch.Tensor
    owner: "_OwnerSide"


@dataclass
class _OwnerSide:
    """What an owner served in one forward: the received bags and their slots."""

    ids: torch.Tensor  # (R,) received ids
    slots: torch.Tensor  # (R,) their slots at forward time
    offsets: torch.Tensor  # (Q,) start of each received part
    psw: Optional[torch.Tensor]  # (R,) received per-sample weights
    version: int  # the table version of slots
    parts_from: list[int]  # parts received from each rank


@dataclass
class Shard:
    """How one ``DynamicEmbedding`` is sharded (set by ``HybridParallel``).

    Attributes:
        group: the process group of the lookup exchanges.
        tag: the table's index in the model, checked by every exchange.
        mode: "sync" or "async".
        staleness: async only: steps between a gradient and its update.
        grad_group: async only: a second group for the gradient exchanges.
    """

    group: Group
    tag: int
    mode: str = "sync"
    staleness: int = 1
    grad_group: Optional[Group] = None
    steps: int = 0  # optimizer steps taken (async bookkeeping)
    in_flight: deque = field(default_factory=deque)

    # ---- forward --------------------------------------------------------------------
    def lookup(self, module, ids, offsets, psw) -> torch.Tensor:
        """The sharded equivalent of ``module``'s local pooled lookup."""
        if module.training and torch.is_grad_enabled():
            anchor = torch.empty(0, device=ids.device, requires_grad=True)
            return _ShardedLookup.apply(anchor, psw, self, module, ids, offsets)
        with torch.no_grad():
            out, _ = self._forward(module, ids, offsets, psw)
        return out

    def _forward(self, module, ids, offsets, psw):
        g = self.group
        ilo = module.include_last_offset
        b = bucketize_bags(ids, offsets, g.size, ilo, module.padding_idx)
        num_bags = offsets.numel() - int(ilo) if offsets.numel() else 0
        signature = (self.tag, module.embedding_dim, int(psw is not None))
        recv_ids_n, recv_parts_n = exchange_headers(
            g, (b.id_splits, b.part_splits), signature, f"DynamicEmbedding table {self.tag}"
        )
        id_splits, part_splits = b.id_splits.tolist(), b.part_splits.tolist()
        recv_ids = all_to_all(g, ids[b.perm], id_splits, recv_ids_n)
        recv_len = all_to_all(g, b.part_lengths, part_splits, recv_parts_n)
        recv_psw = None if psw is None else all_to_all(g, psw[b.perm], id_splits, recv_ids_n)
        owner, partial = self._serve(module, recv_ids, recv_len, recv_psw, recv_parts_n)
        parts = all_to_all(g, partial, recv_parts_n, part_splits)
        out = combine_parts(parts, b.bag_of_part, num_bags)
        scale = None
        if module.mode == "mean":
            counts = torch.zeros(num_bags, dtype=out.dtype, device=out.device)
            counts.index_add_(0, b.bag_of_part, b.part_lengths.to(out.dtype))
            scale = 1.0 / counts.clamp(min=1)
            out = out * scale.unsqueeze(1)
        req = _RequesterSide(b, id_splits, part_splits, recv_ids_n, recv_parts_n, scale, ids.numel())
        return out, (req, owner)

    def _serve(self, module, ids, lengths, psw, parts_from):
        """The owner's half of a lookup: slots of the received ids (inserting in training)
        and the sum of each received part."""
        offsets = torch.zeros(lengths.numel(), dtype=torch.long, device=ids.device)
        if lengths.numel() > 1:
            torch.cumsum(lengths[:-1], 0, out=offsets[1:])
        table = module.table
        if module.training:
            slots, extra = table.find_or_insert(ids), None
        else:
            slots, extra = module._eval_slots(ids)
        partial = torch.ops.veloce.pooled_lookup(table.weights, slots, offsets, psw, _SUM, False, extra)
        return _OwnerSide(ids, slots, offsets, psw, table.version, parts_from), partial

    # ---- backward -------------------------------------------------------------------
    def backward(self, module, req: "_RequesterSide", owner: _OwnerSide, grad_out: torch.Tensor, psw_grad: bool):
        """Sends each part's gradient to its owner; returns the per-sample-weight gradient
        (or None)."""
        g = self.group
        grad_out = grad_out.to(module.table.weights.dtype)
        if req.scale is not None:
            grad_out = grad_out * req.scale.unsqueeze(1)
        grad_parts = grad_out.index_select(0, req.b.bag_of_part) / g.size  # averaged over ranks, as DDP
        if self.mode == "async" and self.staleness > 0 and not psw_grad:
            recv, work = all_to_all(self.grad_group, grad_parts, req.part_splits, req.recv_parts_n, async_op=True)
            self.in_flight.append(_InFlight(self.steps, work, recv, owner))
        else:
            recv = all_to_all(g, grad_parts, req.part_splits, req.recv_parts_n)
            _record(module, owner, recv)
        if not psw_grad:
            return None
        # d out[bag] / d psw[i] = <row(i), grad of i's part>, computed by the owner.
        from veloce.embedding import _psw_grad

        owner_slots = _current_slots(module, owner)
        mine = _psw_grad(module.table.weights, owner_slots, owner.offsets, recv, False)
        back = all_to_all(g, mine, req.recv_ids_n, req.id_splits)
        return torch.zeros(req.num_ids, dtype=back.dtype, device=back.device).index_put_((req.b.perm,), back)

    # ---- step -----------------------------------------------------------------------
    def collect(self, module) -> None:
        """Before the owner's step(): async gradients that are due (sent ``staleness``
        steps ago or more) join the pending gradient."""
        self.steps += 1
        while self.in_flight and self.in_flight[0].step <= self.steps - 1 - self.staleness:
            self._land(module, self.in_flight.popleft())

    def flush(self, module) -> None:
        """Waits for every gradient in flight and adds it to the pending gradient."""
        while self.in_flight:
            self._land(module, self.in_flight.popleft())

    def _land(self, module, f: _InFlight) -> None:
        f.work.wait()
        _record(module, f.owner, f.grad)


@dataclass
class _RequesterSide:
    """What a requester needs for backward."""

    b: Any  # Buckets
    id_splits: list[int]
    part_splits: list[int]
    recv_ids_n: list[int]
    recv_parts_n: list[int]
    scale: Optional[torch.Tensor]  # mean: 1 / bag length
    num_ids: int


def _current_slots(module, owner: _OwnerSide) -> torch.Tensor:
    if owner.version == module.table.version:
        return owner.slots
    from veloce.embedding import _reresolve

    return _reresolve(module.table, owner.ids, owner.slots)


def _record(module, owner: _OwnerSide, grad: torch.Tensor) -> None:
    """The owner keeps received part gradients until its step(), like a local backward."""
    from veloce.embedding import _Pending

    module._accumulate(
        _Pending(owner.ids, owner.slots, owner.offsets, owner.psw, grad, _SUM, False, owner.version)
    )


class _ShardedLookup(torch.autograd.Function):
    """The sharded lookup as one autograd node; ``anchor`` (empty, requires grad) makes
    backward run, and ``psw`` gets its gradient when it requires one."""

    @staticmethod
    def forward(ctx, anchor, psw, shard, module, ids, offsets):  # type: ignore[override]
        out, (req, owner) = shard._forward(module, ids, offsets, psw)
        ctx.shard, ctx.module, ctx.req, ctx.owner = shard, module, req, owner
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        psw_grad = ctx.shard.backward(ctx.module, ctx.req, ctx.owner, grad_out.contiguous(), ctx.needs_input_grad[1])
        return None, psw_grad, None, None, None, None
