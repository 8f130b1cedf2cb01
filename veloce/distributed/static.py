"""A sharded lookup whose exchanges have static shapes, for a training step captured in a
CUDA graph (:class:`veloce.graphs.CUDAGraphStep` over a ``HybridParallel`` model).

The eager exchange (:mod:`veloce.distributed.sharded`) reads its split sizes back to the
host and moves exactly the ids and rows each peer needs: a graph cannot hold that, since
its shapes are fixed at capture. This exchange runs in two phases:

1. **Counting** (:func:`count`, captured once as a small graph of its own): the bags are
   bucketed by owner as the eager exchange does, and a header all-to-all (on the tables'
   ``dispatch_group``, a communicator of its own, so that the next step's counting phase
   can run while a step's exchanges do) tells each owner
   how many ids and parts it will receive per table. One all-reduce (max) over the ranks
   then gives every rank the largest block any rank sends any peer. The host reads the
   needs (the step's one host sync) and picks capacities (:class:`Caps`): the needs plus
   an eighth, rounded, and never lower than before, so that after a few steps they stop
   changing. The blocks' capacities are the same on every rank (the all-to-alls split
   equally); an owner sizes its per-table buffers by what it receives itself (a table's
   hot ids all go to one owner: the largest over the owners would make the others'
   buffers several times too large). Whether any rank's capacities change is agreed too,
   so that every rank makes room (or fails, if it cannot) together.
2. **The step** (:func:`veloce.distributed.static_lookup.lookup`, inside the step's
   graph, one graph per set of capacities): every block travels padded to its capacity in an all-to-all of equal
   splits; padding ids are :data:`SENTINEL`, which the owners' inserts skip (their
   ``padding_id``) and whose slots (-1) the lookup and the update skip; the requester's
   padding parts are empty, and an owner's padding ids make up its padding parts, whose
   sums (zeros) are spread over the bags. The gradients' way back is the same, reversed.

The results are those of the eager exchange bit for bit: each bag's parts are summed in
the same (owner) order, and each owner sees the same ids, parts and gradients (plus
padding that changes nothing). A batch holding the id ``SENTINEL`` itself is flagged by
the counting phase, on every rank, and that step runs eagerly.

Limits (checked by :func:`check_static`): ``sparse="sync"``, ``dedup=False``, no
per-sample weights, no ``padding_idx``, each table once per exchange.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, fields, replace
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from veloce.distributed._comm import ExchangeError, Group, agree_sum, wire_code, wire_dtype
from veloce.distributed.input_dist import (
    counts_per_owner_and_table,
    layout_flag,
    raise_bad_layout,
    run_bounds,
)
from veloce.distributed.layout import tags_hash
from veloce.ops.exchange import bucketize_bags
from veloce.runtime.device import host_tensor
from veloce.sparse import lookup_groups, validated_bags

__all__ = ["SENTINEL", "Caps", "Counted", "Plan", "check_static", "count", "agree", "prepare", "take_plan", "PLANNED",
           "staged", "stage", "ExchangeError", "agree_sum"]

SENTINEL = -(1 << 63)  # the padding id of a static exchange (int64's lowest value)
_STATIC_BIT = 1 << 8  # in the header's signature: a static exchange never pairs with an eager one
_SIG = 6  # ints of a static header's signature
_FLAGS = 4  # per group, after the sizes: signatures disagree, SENTINEL met, a bag layout bad, a table capacity passed

# The plans of the static lookups the step about to run (or be captured) makes, in call
# order: each sharded lookup takes the first (:func:`take_plan`).
PLANNED: deque = deque()
EXPECTING = False  # a captured step is planned: every sharded lookup must find its plan


def check_static(modules: Sequence, bags: Sequence[tuple] = ()) -> None:
    """Raises ``ValueError`` when ``modules`` (one exchange) cannot run a static exchange."""
    shard = modules[0].backend
    tags = [m.backend.tag for m in modules]
    why = None
    if shard.mode != "sync":
        why = f"sparse={shard.mode!r} (a graph needs sparse='sync')"
    elif shard.dedup:
        why = "dedup=True"
    elif any(m.padding_idx is not None for m in modules):
        why = "a table with padding_idx"
    elif len({id(m.table) for m in modules}) < len(modules):
        why = "a table looked up twice in one exchange"
    elif any(b[2] is not None for b in bags):
        why = "per-sample weights"
    if why is not None:
        raise ValueError(f"CUDAGraphStep: sharded tables {tags} cannot be captured with {why}")


def _level(n: int, cap: int) -> int:
    """A capacity for ``n``: ``cap`` when ``n`` fits, else ``n`` plus an eighth, rounded up
    to a sixteenth of its power of two (a few sizes per octave, so that captures repeat)."""
    if n <= cap:
        return cap
    want = n + (n >> 3) + 1
    unit = 1 << max(0, want.bit_length() - 5)
    return -(-want // unit) * unit


@dataclass(frozen=True)
class Caps:
    """The padded sizes of one static exchange (the same on every rank)."""

    ids: int  # ids per block a rank sends a peer
    parts: int  # parts per block
    table_ids: tuple  # per table: ids an owner receives, from all peers
    table_parts: tuple  # per table: parts an owner receives (at least one more: the padding ids' part)

    def fit(self, need: "Caps") -> "Caps":
        """Capacities for ``need``: these where they suffice, larger where they do not."""
        return Caps(_level(need.ids, self.ids), _level(need.parts, self.parts),
                    tuple(_level(n, c) for n, c in zip(need.table_ids, self.table_ids)),
                    tuple(_level(n, c) for n, c in zip(need.table_parts, self.table_parts)))  # fmt: skip

    @staticmethod
    def zero(k: int) -> "Caps":
        return Caps(0, 0, (0,) * k, (0,) * k)


@dataclass
class Counted:
    """The counting phase of one exchange (:func:`count`): static tensors that the step reads."""

    modules: list
    group: Group  # the step's exchanges'
    count_group: Group  # the counting phase's (its own communicator: it may run beside a step)
    ids: torch.Tensor  # (M,) the bags' ids, table after table
    num_bags: list[int]
    starts: torch.Tensor  # (B,) bag starts into ids
    perm: torch.Tensor  # (M,) positions sorted by owner
    bag_of_part: torch.Tensor  # (M,) the parts first (by owner, bag), zeros after
    part_lengths: torch.Tensor  # (M,)
    id_splits: torch.Tensor  # (W,)
    part_splits: torch.Tensor  # (W,)
    recv_ids: torch.Tensor  # (K, W) ids of table k this rank receives from peer p
    recv_parts: torch.Tensor  # (K, W)
    needs: torch.Tensor  # (2 + 2K + _FLAGS,) this rank's: see :func:`agree`
    layouts: list  # the bags' deferred layouts, for the detailed error of a bad one
    shapes: tuple


class Constants:
    """Small device tensors made from host values once, outside any capture (a graph would
    copy them from host memory that may since hold something else)."""

    def __init__(self) -> None:
        self._made: dict[tuple, torch.Tensor] = {}

    def get(self, key: tuple, values: Sequence[int], dev: torch.device) -> torch.Tensor:
        t = self._made.get(key)
        if t is None:
            if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"veloce internal error: static exchange constant {key[0]} first made in a capture")
            t = self._made[key] = host_tensor(list(values), dev)
        return t


def count(modules: Sequence, bags: Sequence[tuple], layouts: Sequence[tuple], consts: Constants,
          bound: Optional[torch.Tensor] = None) -> Counted:  # fmt: skip
    """The counting phase of one exchange of ``modules`` (validated ``bags``, their deferred
    ``layouts``): bucketing, the header's all-to-all; no host sync (capturable once
    ``consts`` holds its constants). ``bound``: (2, K) int64 on the device, this owner's
    per-table capacities of ids and parts now (flags a need past them)."""
    check_static(modules, bags)
    if not all(m.training for m in modules):
        raise ValueError(
            f"CUDAGraphStep: sharded tables {[m.backend.tag for m in modules]} are in eval mode: a captured sharded "
            f"step trains every sharded table it looks up (an evaluation lookup's initialised rows need host work)"
        )  # fmt: skip
    modules = list(modules)
    shard = modules[0].backend
    g, K = shard.group, len(modules)
    cg = shard.dispatch_group or g
    W = g.size
    dev = bags[0][0].device
    ids = torch.cat([b[0] for b in bags]) if K > 1 else bags[0][0]
    num_ids = [b[0].numel() for b in bags]
    starts_l = [b[1][:-1] if m.include_last_offset else b[1] for m, b in zip(modules, bags)]
    num_bags = [s.numel() for s in starts_l]
    starts = torch.cat(starts_l) if K > 1 else starts_l[0]
    bases = [0, *itertools.accumulate(num_ids)][:-1]
    if any(bases):  # each table's starts shifted past the ids of the tables before it
        shift = consts.get(("shift", tuple(num_bags), tuple(num_ids)),
                           [b for b, n in zip(bases, num_bags) for _ in range(n)], dev)  # fmt: skip
        starts = starts + shift
    bad_layout = layout_flag(layouts, dev)
    try:
        b = bucketize_bags(ids, starts, W, exact_sizes=False)
    except RuntimeError:  # (CPU) the concatenated layout is bad: say which table's is
        raise_bad_layout(layouts)
        raise
    bounds = consts.get(("bounds", W, tuple(num_bags)), run_bounds(num_bags, W), dev)
    parts_nk, ids_nk = counts_per_owner_and_table(b, num_bags, W, dev, bounds)
    wire = wire_dtype(shard.exchange_dtype, modules[0].table.dtype)
    sig = consts.get(("sig", tuple(m.backend.tag for m in modules)),
                     [K, tags_hash(modules), modules[0].embedding_dim, modules[0].table.dtype.itemsize,
                      wire_code(wire), _STATIC_BIT], dev)  # fmt: skip
    row = torch.cat([sig.expand(W, _SIG), parts_nk.view(W, K), ids_nk.view(W, K)], 1)
    theirs = torch.empty_like(row)
    dist.all_to_all_single(theirs, row, group=cg.group)
    recv_parts = theirs[:, _SIG : _SIG + K].t().contiguous()
    recv_ids = theirs[:, _SIG + K :].t().contiguous()
    no = torch.zeros((), dtype=torch.bool, device=dev)
    flags = torch.stack([
        (theirs[:, :_SIG] != row[:, :_SIG]).any(),
        (ids == SENTINEL).any(),
        bad_layout.reshape(()) if bad_layout is not None else no,
        ((recv_ids.sum(1) > bound[0]) | (recv_parts.sum(1) + 1 > bound[1])).any() if bound is not None else no,
    ]).long()  # fmt: skip
    zero = torch.zeros(1, dtype=torch.long, device=dev)
    needs = torch.cat([torch.cat([b.id_splits, zero]).max().view(1), torch.cat([b.part_splits, zero]).max().view(1),
                       recv_ids.sum(1), recv_parts.sum(1), flags])  # fmt: skip
    return Counted(modules, g, cg, ids, num_bags, starts, b.perm, b.bag_of_part, b.part_lengths, b.id_splits,
                   b.part_splits, recv_ids, recv_parts, needs, list(layouts),
                   tuple(tuple(x[0].shape) for x in bags))  # fmt: skip


def agree(counted: Sequence[Counted], status: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Every exchange's needs, this rank's then the maxima over the ranks, as one tensor
    (an all-reduce; no host read): what :func:`needs_from` reads. ``status``: a (1,) int64
    on the device, this rank's own verdict (0: it can run the step; else it raises), last."""
    if len({id(c.group) for c in counted}) != 1:
        raise ValueError("CUDAGraphStep: the sharded tables of a captured step must share one process group")
    dev = counted[0].ids.device
    own = status if status is not None else torch.zeros(1, dtype=torch.long, device=dev)
    mine = torch.cat([*(c.needs for c in counted), own])
    top = mine.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=counted[0].count_group.group)
    return torch.cat([mine, top])


def _tensor_fields(counted: Counted) -> list[str]:
    return [f.name for f in fields(counted) if isinstance(getattr(counted, f.name), torch.Tensor)]


def staged(counted: Counted) -> Counted:
    """A copy of ``counted`` with tensors of its own (made outside any capture), which a
    step reads while the counting phase refills ``counted`` for the next step (see
    :func:`stage`)."""
    return replace(counted, **{n: getattr(counted, n).clone() for n in _tensor_fields(counted)})


def stage(dst: Counted, src: Counted) -> None:
    """Copies ``src``'s tensors (a counting phase's results) into ``dst`` (:func:`staged`),
    on the current stream."""
    for n in _tensor_fields(src):
        getattr(dst, n).copy_(getattr(src, n), non_blocking=True)


def needs_from(counted: Sequence[Counted], values: Sequence[int]) -> tuple[Optional[list[Caps]], bool]:
    """The needs of each exchange from :func:`agree`'s values read back (the blocks' over
    all ranks, the per-table ones this owner's own), and whether some rank's per-table
    capacities must grow. Raises on every rank when an exchange's ranks disagree or a bag
    layout is bad (this rank's own error where its layout is bad); the needs are None when
    some rank's batch holds :data:`SENTINEL` (the step then runs eagerly)."""
    n = len(values) // 2
    mine, top = values[:n], values[n:]
    if top[n - 1]:  # some rank cannot run the step (its own error is raised there)
        raise ExchangeError(
            "CUDAGraphStep: another rank could not run this step (its own error says why, e.g. a table full at its "
            "max_capacity); every rank stops here"
        )  # fmt: skip
    out, at, sentinel, grows = [], 0, False, False
    for c in counted:
        K = len(c.modules)
        v, own = top[at : at + 2 + 2 * K + _FLAGS], mine[at : at + 2 + 2 * K + _FLAGS]
        at += 2 + 2 * K + _FLAGS
        bad_sig, hit, bad_layout, grow = v[-_FLAGS:]
        tags = [m.backend.tag for m in c.modules]
        if own[-2]:
            raise_bad_layout(c.layouts)
            raise ExchangeError(f"DynamicEmbedding tables {tags}: this rank's bag layout was flagged bad, but its "
                                f"check found nothing")  # fmt: skip
        if bad_layout:
            raise ExchangeError(f"DynamicEmbedding tables {tags}: another rank could not take part in this lookup "
                                f"(its own error says why, e.g. bad input); every rank stops here")  # fmt: skip
        if bad_sig:
            raise ExchangeError(
                f"DynamicEmbedding tables {tags}: the ranks disagree on a captured step's exchange (other tables, "
                f"dims, dtypes or exchange_dtype): every rank must run the same step, graphed alike"
            )  # fmt: skip
        sentinel = sentinel or bool(hit)
        grows = grows or bool(grow)
        # The blocks: the most any rank sends any peer. The tables: what this owner receives,
        # one part more (the padding ids' own part).
        out.append(Caps(v[0], v[1], tuple(own[2 : 2 + K]), tuple(x + 1 for x in own[2 + K : 2 + 2 * K])))
    return (None if sentinel else out), grows


@dataclass
class Plan:
    """One static exchange of a step: its counting phase, capacities and constants."""

    counted: Counted
    caps: Caps
    base_ids: torch.Tensor  # (K,) where each table's ids start in the owner's buffer
    base_parts: torch.Tensor  # (K,)
    part_table: torch.Tensor  # (sum table_parts,) the table of each part slot
    part_rank: torch.Tensor  # (sum table_parts,) its index within its table
    table_id_caps: torch.Tensor  # (K,) caps.table_ids
    table_part_caps: torch.Tensor  # (K,) caps.table_parts


def prepare(counted: Counted, caps: Caps) -> Plan:
    """The plan of one exchange with capacities ``caps`` (outside any capture)."""
    dev = counted.ids.device
    base_ids = host_tensor([0, *itertools.accumulate(caps.table_ids)][:-1], dev)
    base_parts = host_tensor([0, *itertools.accumulate(caps.table_parts)][:-1], dev)
    part_table = host_tensor([k for k, n in enumerate(caps.table_parts) for _ in range(n)], dev)
    part_rank = host_tensor([i for n in caps.table_parts for i in range(n)], dev)
    return Plan(counted, caps, base_ids, base_parts, part_table, part_rank, host_tensor(list(caps.table_ids), dev),
                host_tensor(list(caps.table_parts), dev))  # fmt: skip


def take_plan(modules: Sequence) -> Optional[Plan]:
    """The plan of this lookup of ``modules`` when the step runs static exchanges, else None."""
    if not PLANNED:
        if EXPECTING:
            raise ValueError(
                f"CUDAGraphStep: the step looks up sharded tables {[m.backend.tag for m in modules]} after the "
                f"lookups its lookups() said: lookups(*inputs) must return every group the model's forward looks "
                f"up, in order (veloce.models' sparse_lookups do)"
            )  # fmt: skip
        return None
    plan = PLANNED.popleft()
    if [id(m) for m in plan.counted.modules] != [id(m) for m in modules]:
        PLANNED.clear()
        raise ValueError(
            f"CUDAGraphStep: the step looks up tables {[m.backend.tag for m in modules]} where its lookups() said "
            f"{[m.backend.tag for m in plan.counted.modules]}: lookups(*inputs) must return the groups the "
            f"model's forward looks up, in order (veloce.models' sparse_lookups do)"
        )  # fmt: skip
    return plan


class Planner:
    """Counts the static exchanges of a step and keeps their capacities, which only grow.
    Every rank keeps the same block capacities (it reads the same maxima); an owner's
    per-table capacities are its own. ``changed`` (after :meth:`fit`, the same on every
    rank): whether some rank's capacities changed, so that every rank makes room for them
    together (veloce.graphs)."""

    def __init__(self) -> None:
        self.consts = Constants()
        self.caps: list[Caps] = []
        self.changed = False
        self._bounds: dict[int, torch.Tensor] = {}  # exchange -> (2, K) this owner's table capacities, on the device

    def count(self, lookups: Sequence[tuple]) -> list[Counted]:
        """:func:`count` of each exchange of ``lookups`` (``[(tables, inputs), ...]`` as a
        model's ``sparse_lookups`` returns them), in the order the forward runs them."""

        counted = []
        for tables, inputs in lookups:
            args, groups, _ = lookup_groups(tables, inputs, "CUDAGraphStep")
            aranges: dict = {}
            for idx in groups.values():
                layouts: list = []
                bags = [validated_bags(tables[i], *args[i], deferred=layouts, aranges=aranges) for i in idx]
                bound = self._bounds.get(len(counted))
                if bound is None:  # (made at the first, eager count: a capture reads it in place)
                    bound = self._bounds[len(counted)] = torch.zeros(2, len(idx), dtype=torch.long,
                                                                     device=bags[0][0].device)  # fmt: skip
                counted.append(count([tables[i] for i in idx], bags, layouts, self.consts, bound))
        return counted

    def fit(self, counted: Sequence[Counted], values: Sequence[int]) -> Optional[list[Caps]]:
        """The capacities for :func:`agree`'s ``values`` (read back): grown where the needs
        passed them. None when the step must run eagerly (see :func:`needs_from`)."""
        needs, grows = needs_from(counted, values)
        if needs is None:
            self.changed = False
            return None
        if len(self.caps) != len(needs):
            self.caps = [Caps.zero(len(c.modules)) for c in counted]
        fitted = [have.fit(need) for have, need in zip(self.caps, needs)]
        self.changed = grows or [(c.ids, c.parts) for c in fitted] != [(c.ids, c.parts) for c in self.caps]
        for i, (have, new) in enumerate(zip(self.caps, fitted)):
            if (have.table_ids, have.table_parts) != (new.table_ids, new.table_parts):
                self._bounds[i].copy_(torch.tensor([list(new.table_ids), list(new.table_parts)]))
        self.caps = fitted
        return self.caps
