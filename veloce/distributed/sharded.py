"""``DynamicEmbedding`` tables sharded row-wise across ranks: the sharded lookup backend
(:class:`Shard`) and the lookup it runs.

Rank ``r`` owns the ids with ``owner_of(id, W) == r`` and keeps only those rows. A lookup
of K tables at once (one table is K = 1; :func:`veloce.lookup_many` groups the tables of
a model) runs, with one all-to-all per arrow::

    requester                                   owner
    bucketize_bags: every table's bags
    (concatenated) cut into parts, one
    per bag and owner                   --ids, part lengths, [weights]-->  per table: find_or_insert
                                                                           (train) / find (eval),
                                                                           pool each part
    combine_parts: sum each bag's parts <--partial sums (P, D)--
    (mean: / full bag length)

    backward: grad of each part         --(P, D), / W (DDP-style mean)-->  per table: pending
                                                                           gradient, applied by
                                                                           the owner's step()

Before the payloads, a header all-to-all carries the split sizes (ids and parts per
table) and a signature (tables, dim, weights given), so a receiver knows what comes and
ranks that disagree fail on every rank instead of hanging.

In ``sync`` mode the gradient exchange blocks in backward, so every update of step t is
applied at step t. In ``async`` mode it is launched without waiting, on a second process
group so that it overlaps the next forward's exchanges, and each owner applies the
gradients of step t at step t + staleness.

The partial sums and their gradients travel in the tables' dtype, or in a narrower one
(``HybridParallel(exchange_dtype=torch.bfloat16)``: half the bytes of fp32 rows), and are
summed and applied in the tables' dtype.

The stages live in modules of their own, imported in this order (each only from those
before it): :mod:`~veloce.distributed.layout` (the exchange's shapes),
:mod:`~veloce.distributed.owner` (the owner's inserts, lookups and kept gradients),
:mod:`~veloce.distributed.input_dist` (the ids to their owners),
:mod:`~veloce.distributed.backward` (gradients to their owners),
:mod:`~veloce.distributed.output_dist` (partial sums back, combined),
:mod:`~veloce.distributed.prefetch` (a first half run ahead), then the two other exchanges
(:mod:`~veloce.distributed.dedup`; :mod:`~veloce.distributed.static` and
:mod:`~veloce.distributed.static_lookup` for a step captured in a CUDA graph) and this module.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from veloce.distributed import static, static_lookup
from veloce.distributed._comm import (
    Group,
    abandon_exchange,
    agree_sum,
    agree_sum_tensor,
    raise_deferred_failures,
)
from veloce.distributed.dedup import forward_rows
from veloce.distributed.input_dist import dispatch
from veloce.distributed.layout import training_modes
from veloce.distributed.output_dist import finish_lookup
from veloce.distributed.owner import record
from veloce.distributed.prefetch import complete, take_dispatched
from veloce.ops.exchange import owner_of
from veloce.sparse import LookupBackend, autograd_anchor, check_unapplied, validated_bags

__all__ = ["Shard", "table_shard", "sharded_lookup"]


def table_shard(module: Any) -> tuple[int, int]:
    """``(rank, world_size)`` of a ``DynamicEmbedding``'s sharding; ``(0, 1)`` when it is
    not sharded (a single process, or a replica)."""
    backend = getattr(module, "backend", None)
    return (0, 1) if backend is None else (backend.rank, backend.world_size)


@dataclass
class Shard(LookupBackend):
    """The sharded lookup backend of one ``DynamicEmbedding`` (``HybridParallel`` installs
    it as the table's ``backend``): its lookups go to the ranks that own the ids, and its
    counts agree over them.

    Attributes:
        group: the process group of the lookup exchanges.
        tag: the table's index in the model (exchanges check that ranks agree on it).
        mode: "sync" or "async".
        staleness: async only: steps between a gradient and its update.
        grad_group: async only: a second group for the gradient exchanges.
        dedup: send each distinct id once and pool on the requester (see
            :mod:`veloce.distributed.dedup`) instead of pooling parts on the owners.
        lookup_errors: "raise" (an owner's failure raises on every rank in the forward,
            through a collective read back there) or "raise_next" (agreed on the device,
            read back at the next step(), lookup or flush(); see ``HybridParallel``).
        exchange_dtype: the dtype embedding rows, partial sums and their gradients travel
            as between ranks (None: the table's own; see ``HybridParallel``).
    """

    group: Group
    tag: int
    mode: str = "sync"
    staleness: int = 1
    grad_group: Optional[Group] = None
    dedup: bool = False
    lookup_errors: str = "raise"
    dispatch_group: Optional[Group] = None  # prefetched first halves exchange on it (HybridParallel.prefetch)
    exchange_dtype: Optional[torch.dtype] = None
    wrapper: Any = None  # a weak reference to the HybridParallel that sharded the table
    steps: int = 0  # optimizer steps taken (async bookkeeping)
    flights: deque = field(default_factory=deque)  # InFlight exchanges, oldest first

    sharded = True

    @property
    def rank(self) -> int:  # type: ignore[override]
        return self.group.rank

    @property
    def world_size(self) -> int:  # type: ignore[override]
        return self.group.size

    @property
    def group_id(self) -> int:
        return id(self.group)

    @property
    def in_flight(self) -> int:
        return len(self.flights)

    def exchange_key(self) -> tuple:
        return id(self.group), self.mode

    def forward(self, module: Any, input: torch.Tensor, offsets: Optional[torch.Tensor],
                per_sample_weights: Optional[torch.Tensor], training: bool) -> torch.Tensor:  # fmt: skip
        """The sharded equivalent of ``module``'s local pooled lookup. The offsets' values
        are checked with the exchange's header (:func:`sharded_lookup`)."""
        deferred: list = []
        with self.abandon_on_error():  # bad input here fails every rank, not just this one
            if training:
                check_unapplied(module)
            ids, offsets, psw = validated_bags(module, input, offsets, per_sample_weights, deferred=deferred)
        return sharded_lookup([module], [(ids, offsets, psw)], deferred)[0]

    def check_owned(self, ids: torch.Tensor) -> None:
        rank, world = self.group.rank, self.group.size
        foreign = (owner_of(ids, world) != rank).nonzero()
        if foreign.numel():
            i = int(foreign[0, 0])
            raise ValueError(
                f"ids[{i}] = {int(ids[i])} belongs to rank {int(owner_of(ids[i : i + 1], world))}, not to this "
                f"rank ({rank}) of this sharded table; insert each id on its owner "
                f"(veloce.distributed.owner_of(ids, {world}) == rank). {foreign.numel()} id(s) are not this rank's."
            )

    def owned_entries(self, module: Any, entries: dict[str, Any]) -> dict[str, Any]:
        """The entries of the ids this rank owns."""
        keys = entries["keys"]
        mine = owner_of(keys.to(module.table.device, torch.long), self.group.size).to(keys.device) == self.group.rank
        return {n: (v[mine] if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == keys.shape[0] else v)
                for n, v in entries.items()}  # fmt: skip

    def lookup_many(self, modules: Sequence, bags: Sequence[tuple], layouts: Sequence[tuple] = ()) -> list[torch.Tensor]:
        """The pooled lookups of ``modules`` (sharded on this shard's group, one exchange;
        see :func:`sharded_lookup`)."""
        return sharded_lookup(modules, bags, layouts)

    def raise_deferred_failures(self) -> None:
        """Raises an owner's failure of an earlier lookup on this shard's group that
        ``HybridParallel(lookup_errors="raise_next")`` deferred."""
        raise_deferred_failures(self.group)

    def collect(self, module) -> None:
        """Before the owner's step(): async gradients that are due (sent ``staleness``
        steps ago or more) join the pending gradient."""
        self.steps += 1
        while self.flights and self.flights[0].step <= self.steps - 1 - self.staleness:
            f = self.flights.popleft()
            record([module], [f.owner], [f.grad()], noted=True)

    def agree(self, count: int) -> int:
        """The sum of ``count`` over the ranks (a collective: every rank calls it)."""
        return agree_sum(self.group, count)

    def agree_all(self, counts: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """The sums (``op="max"``: the largest) of ``counts`` over the ranks, on the group's
        device, without reading them back (a collective: every rank calls it)."""
        return agree_sum_tensor(self.group, counts, op)

    @contextlib.contextmanager
    def abandon_on_error(self, group: Optional[Group] = None):
        """If the block raises (bad input found before the exchange), this rank still takes
        part in the exchange's first step (on ``group``, by default the lookups' group) so
        that the other ranks raise too. A lookup whose first half was prefetched starts at
        its second half: this rank takes the prefetched exchange and fails through the
        owners' agreement there instead (see
        :func:`veloce.distributed.output_dist.finish_lookup`)."""
        try:
            yield
        except Exception as e:
            if group is None and self.group.prefetched:
                # raises with lookup_errors="raise"
                finish_lookup(self, complete(self.group, self.group.prefetched.popleft()), refusal=e)
                # "raise_next": the other ranks go on and raise at their next step(); this
                # one cannot go on with input it cannot read, and they may wait for it in
                # a later collective (docs/distributed.md says so).
                raise
            abandon_exchange(group or self.group)
            e._veloce_abandoned = True  # the other ranks learn of it in this exchange's header (deferring_errors)
            raise

    def flush(self, module) -> None:
        """Waits for every gradient in flight and adds it to the pending gradient."""
        while self.flights:
            f = self.flights.popleft()
            record([module], [f.owner], [f.grad()], noted=True)


def sharded_lookup(modules: Sequence, bags: Sequence[tuple], layouts: Sequence[tuple] = ()) -> list[torch.Tensor]:
    """Pooled lookups of K sharded tables (same group, dim and dtype) in one exchange.

    ``bags[k]`` is ``(ids, offsets, per_sample_weights)`` as validated by the module
    (:func:`veloce.sparse.validated_bags`), but for the offsets' values of the bag
    ``layouts`` it deferred: those are checked on the device and read back with the
    exchange's header (one host sync for both). A bad layout raises its error on this
    rank, and the other ranks raise ExchangeError."""
    plan = static.take_plan(modules)
    if plan is not None:  # a step of static exchanges (veloce.graphs.CUDAGraphStep)
        return static_lookup.lookup(modules, bags, plan)
    shard = modules[0].backend
    raise_deferred_failures(shard.group)  # an earlier forward's failure first, before anything moves
    training = training_modes(modules)  # read here: the autograd Function's forward runs without gradients
    anchor_needed = any(training)
    psws = [b[2] for b in bags]
    psw_grad = anchor_needed and any(p is not None and p.requires_grad for p in psws)
    dispatched = take_dispatched(shard.group, modules, bags, psw_grad, training)
    if not anchor_needed:
        with torch.no_grad():
            outs, _ = _run_forward(shard, modules, bags, False, layouts, dispatched, training)
        return list(outs)
    return list(_GroupedLookup.apply(autograd_anchor(bags[0][0].device), shard, modules, bags, psw_grad, layouts,
                                     dispatched, training, *psws))  # fmt: skip


def _run_forward(shard: Shard, modules: list, bags: Sequence[tuple], psw_grad: bool, layouts: Sequence[tuple],
                 dispatched: Optional[tuple], training: tuple[bool, ...]):  # fmt: skip
    if dispatched is None:
        return _forward_for(shard)(shard, modules, bags, psw_grad, layouts, training)
    d, refusal = dispatched
    outs, ex = finish_lookup(shard, d, refusal)  # raises here with lookup_errors="raise"
    if refusal is None:
        return outs, ex
    # "raise_next": every rank raises at its next step(). Until then this rank's forward
    # goes on with zeros of its own bags' shapes, and its backward sends zero gradients of
    # the prefetched sizes (every collective as the other ranks run it).
    ex.refused, ex.prefetched_psw_grad = True, d.psw_grad
    dim, dtype = modules[0].embedding_dim, modules[0].table.dtype
    outs = tuple(torch.zeros((o.numel() - int(m.include_last_offset), dim), dtype=dtype, device=o.device)
                 for m, (_, o, _) in zip(modules, bags))  # fmt: skip
    return outs, ex


def _forward_for(shard: Shard):
    """The exchange a shard uses: partial sums per bag part, or (dedup) one row per distinct id."""
    if shard.dedup:
        return forward_rows
    return _forward


def _forward(shard: Shard, modules: list, bags: Sequence[tuple], psw_grad: bool, layouts: Sequence[tuple],
             training: tuple[bool, ...]):  # fmt: skip
    return finish_lookup(shard, dispatch(shard, modules, bags, psw_grad, layouts, training))


class _GroupedLookup(torch.autograd.Function):
    """K sharded lookups as one autograd node; ``anchor`` (empty, requires grad) makes
    backward run, and each table's per-sample weights get their gradient when they
    require one."""

    @staticmethod
    def forward(ctx, anchor, shard, modules, bags, psw_grad, layouts, dispatched, training,
                *psws):  # type: ignore[override]
        outs, ex = _run_forward(shard, modules, bags, psw_grad, layouts, dispatched, training)
        ctx.ex = ex
        return outs

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        psw_needed = list(ctx.needs_input_grad[8:])
        psw_grads = ctx.ex.backward(grads, psw_needed)
        return (None, None, None, None, None, None, None, None, *psw_grads)
