"""The step's half of a static exchange (:mod:`veloce.distributed.static` counts the
exchange and plans its capacities): inside the step's graph, every block travels padded
to its capacity in an all-to-all of equal splits, the owners insert and pool the padded
ids (skipping :data:`~veloce.distributed.static.SENTINEL`), and the partial sums and, in
backward, their gradients go back the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from veloce.distributed._comm import Group, wire_dtype
from veloce.distributed.layout import Batch, cat_grads, mean_scale, split_outputs, training_modes
from veloce.distributed.owner import record, serve_all
from veloce.distributed.static import PLANNED, SENTINEL, Plan, check_static
from veloce.ops.exchange import combine_parts
from veloce.sparse import autograd_anchor
from veloce.table import find_or_insert_many

__all__ = ["lookup"]


def _a2a(t: torch.Tensor, group: Group, zero_row: bool = False) -> torch.Tensor:
    """An all-to-all of equal blocks (dim 0 cut in group.size). ``zero_row``: the result
    has one more row, of zeros, after the received ones (for gathers that pad with it)."""
    if not zero_row:
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t, group=group.group)
        return out
    out = torch.empty((t.shape[0] + 1, *t.shape[1:]), dtype=t.dtype, device=t.device)
    out[-1].zero_()
    dist.all_to_all_single(out[:-1], t, group=group.group)
    return out


def _table_major(n: torch.Tensor, width: int, base: torch.Tensor, trash: int) -> torch.Tensor:
    """For each slot ``(p, j)`` of the blocks an owner receives (``width`` per peer, holding
    ``n[k, p]`` entries of table k from peer p, table after table, then padding): where it
    goes in the owner's table-major buffer (table k's entries from ``base[k]``, in peer
    order), ``trash`` for padding. (W, width)."""
    K, W = n.shape
    incl_k = n.cumsum(0)
    before_k = incl_k - n  # (K, W): entries of the tables before k in p's block
    before_p = n.cumsum(1) - n  # (K, W): entries of table k from the peers before p
    j = torch.arange(width, device=n.device)
    k = torch.searchsorted(incl_k.t().contiguous(), j.expand(W, width).contiguous(), right=True)
    kc = k.clamp(max=K - 1)
    p = torch.arange(W, device=n.device).view(W, 1)
    dest = base[kc] + before_p[kc, p] + j - before_k[kc, p]
    return torch.where(k < K, dest, trash)


@dataclass
class _StaticExchange:
    """What the backward of a static lookup needs."""

    modules: list
    plan: Plan
    served: list
    bag_idx: torch.Tensor  # (W * Cp,) the bag of each received part slot (num_bags: padding)
    dest_parts: torch.Tensor  # (W * Cp,) where each part slot goes in the owner's buffer
    scale: Optional[torch.Tensor]


def _forward(modules: list, plan: Plan, training: tuple[bool, ...]) -> tuple[tuple, _StaticExchange]:
    c, caps = plan.counted, plan.caps
    g, K = c.group, len(modules)
    W, Ci, Cp = g.size, caps.ids, caps.parts
    dev, dtype, dim = c.ids.device, modules[0].table.dtype, modules[0].embedding_dim
    M, B = c.ids.numel(), sum(c.num_bags)
    width = Ci + Cp
    # The requester: its ids, sorted by owner, and its parts' lengths, into one padded block per peer.
    pos = torch.arange(M, device=dev)
    id_ends = torch.cumsum(c.id_splits, 0)
    owner = torch.searchsorted(id_ends, pos, right=True).clamp(max=W - 1)
    id_dest = owner * width + pos - (id_ends - c.id_splits)[owner]
    part_ends = torch.cumsum(c.part_splits, 0)
    part_start = part_ends - c.part_splits
    powner = torch.searchsorted(part_ends, pos, right=True)
    pc = powner.clamp(max=W - 1)
    part_dest = torch.where(powner < W, pc * width + Ci + pos - part_start[pc], W * width)
    send = torch.empty(W * width + 1, dtype=torch.long, device=dev)
    blocks = send[:-1].view(W, width)
    blocks[:, :Ci] = SENTINEL
    blocks[:, Ci:] = 0
    send.index_copy_(0, id_dest, c.ids[c.perm])
    send.index_copy_(0, part_dest, c.part_lengths)  # padding parts (length 0) to the last, dropped, element
    recv = _a2a(send[:-1], g).view(W, width)
    # The owner: each table's ids and part lengths gathered from every peer's block.
    T_ids, T_parts = sum(caps.table_ids), sum(caps.table_parts)
    dest_ids = _table_major(c.recv_ids, Ci, plan.base_ids, T_ids)
    dest_parts = _table_major(c.recv_parts, Cp, plan.base_parts, T_parts).view(-1)
    t_ids = torch.full((T_ids + 1,), SENTINEL, dtype=torch.long, device=dev)
    t_ids.index_copy_(0, dest_ids.view(-1), recv[:, :Ci].reshape(-1))
    t_len = torch.zeros(T_parts + 1, dtype=torch.long, device=dev)
    t_len.index_copy_(0, dest_parts, recv[:, Ci:].reshape(-1))
    # Part starts within each table's ids: padding parts (length 0) start after the real ids,
    # and the first of them holds the padding ids.
    lengths = t_len[:-1]
    per_table = c.recv_ids.sum(1)
    starts = torch.cumsum(lengths, 0) - lengths - (torch.cumsum(per_table, 0) - per_table)[plan.part_table]
    # The padding parts share the padding ids evenly (their slots -1 are skipped, but one
    # part holding them all would keep a lookup's thread busy long after the others).
    n_parts = c.recv_parts.sum(1)
    pad_parts = plan.table_part_caps - n_parts
    q = plan.part_rank - n_parts[plan.part_table]  # >= 0 on padding parts
    spread = per_table[plan.part_table] + q * (plan.table_id_caps - per_table)[plan.part_table] \
        // pad_parts.clamp(min=1)[plan.part_table]
    starts = torch.where(q >= 0, spread, starts)
    ids_k = list(t_ids[:-1].split(list(caps.table_ids)))
    starts_k = list(starts.split(list(caps.table_parts)))
    slots: list = [None] * K
    train = [k for k in range(K) if training[k]]
    if train:
        got = find_or_insert_many([modules[k].table for k in train], [ids_k[k] for k in train],
                                  [SENTINEL] * len(train))  # fmt: skip
        for k, s in zip(train, got):
            slots[k] = s
    served, pooled = serve_all(modules, ids_k, starts_k, [None] * K, slots)
    # The partial sums back, padded per peer as the parts came (the padding: zero rows).
    wire = wire_dtype(modules[0].backend.exchange_dtype, dtype) or dtype
    pooled_all = torch.cat([*pooled, torch.zeros(1, dim, dtype=dtype, device=dev)])
    rows = _a2a(pooled_all.index_select(0, dest_parts).to(wire), g, zero_row=True)  # (W * Cp + 1, dim)
    j = torch.arange(Cp, device=dev)
    slot_part = (part_start.view(W, 1) + j).clamp(max=M)
    bag_ext = torch.cat([c.bag_of_part, torch.full((1,), B, dtype=torch.long, device=dev)])
    bag_idx = torch.where(j < c.part_splits.view(W, 1), bag_ext[slot_part], B).view(-1)  # for the backward
    # The received rows in the eager exchange's order (parts by owner, then zero rows for
    # bucketize's padding parts, each given to another bag: one bag summing them all would
    # run alone, long after the others).
    real = powner < W
    src = torch.where(real, pc * Cp + pos - part_start[pc], W * Cp)
    rows = rows.index_select(0, src)
    bags = torch.where(real, c.bag_of_part, pos % max(B, 1))
    out = combine_parts(rows, bags, B, check_bags=False, dtype=dtype)
    scale = mean_scale(modules, Batch(c.ids, c.starts, None, [None] * K, [], [], c.num_bags), dtype, dev)
    if scale is not None:
        out = out * scale.unsqueeze(1)
    return split_outputs(out, c.num_bags), _StaticExchange(modules, plan, served, bag_idx, dest_parts, scale)


def _backward(ex: _StaticExchange, grads: Sequence[Optional[torch.Tensor]]) -> None:
    c, caps, modules = ex.plan.counted, ex.plan.caps, ex.modules
    g = c.group
    dev, dtype, dim = c.ids.device, modules[0].table.dtype, modules[0].embedding_dim
    grad = cat_grads(modules, grads, c.num_bags, dev)
    if ex.scale is not None:
        grad = grad * ex.scale.unsqueeze(1)
    wire = wire_dtype(modules[0].backend.exchange_dtype, dtype) or dtype
    # Averaged over ranks, as DDP, in the wire's dtype (one pass, as the eager exchange),
    # then gathered to each part's owner (padding parts: the zero row after the bags).
    sent = torch.empty(grad.shape[0] + 1, dim, dtype=wire, device=dev)
    torch.div(grad, g.size, out=sent[:-1])
    sent[-1].zero_()
    recv = _a2a(sent.index_select(0, ex.bag_idx), g)
    t_grad = torch.zeros(sum(caps.table_parts) + 1, dim, dtype=dtype, device=dev)
    t_grad.index_copy_(0, ex.dest_parts, recv.to(dtype))
    record(modules, ex.served, list(t_grad[:-1].split(list(caps.table_parts))))


class _StaticLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, modules, plan, training):  # type: ignore[override]
        outs, ex = _forward(modules, plan, training)
        ctx.ex = ex
        return outs

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        _backward(ctx.ex, grads)
        return None, None, None, None


def lookup(modules: Sequence, bags: Sequence[tuple], plan: Plan) -> list[torch.Tensor]:
    """The pooled lookups of ``modules`` through ``plan``'s static exchange (``bags``: the
    forward's own, which must have the counted shapes)."""
    c = plan.counted
    if tuple(tuple(b[0].shape) for b in bags) != c.shapes:
        PLANNED.clear()
        raise ValueError(
            f"CUDAGraphStep: the lookup of tables {[m.backend.tag for m in modules]} got ids of shapes "
            f"{[tuple(b[0].shape) for b in bags]}, but lookups() gave {list(c.shapes)} for it: it must return "
            f"the forward's own inputs"
        )  # fmt: skip
    check_static(modules, bags)
    training = training_modes(modules)  # read here: the autograd Function's forward runs without gradients
    if not any(training):
        with torch.no_grad():
            return list(_forward(list(modules), plan, training)[0])

    return list(_StaticLookup.apply(autograd_anchor(c.ids.device), list(modules), plan, training))
