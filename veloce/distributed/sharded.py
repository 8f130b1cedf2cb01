"""``DynamicEmbedding`` tables sharded row-wise across ranks: the lookup and its gradient exchange.

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
"""

from __future__ import annotations

import contextlib
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from veloce.runtime.device import current_stream, host_tensor
from veloce.runtime.update_stream import on_prefetch_stream, record_streams
from veloce.distributed._comm import (
    DeferredFailure, ExchangeError, Group, abandon_exchange, agree_sum, agree_sum_tensor, all_to_all,
    all_to_all_rows, Header, begin_headers, finish_headers, raise_deferred_failures, modes_code, wire_code, wire_dtype,
)  # fmt: skip
from veloce.ops.exchange import bucketize_bags, combine_parts, regroup_blocks
from veloce.sparse import Pending, autograd_anchor, check_offsets_many, lookup_groups, offsets_flags, reresolve
from veloce.table import find_or_insert_many, pooled_many

__all__ = ["Shard", "table_shard", "sharded_lookup"]

_SUM = 0


def table_shard(module: Any) -> tuple[int, int]:
    """``(rank, world_size)`` of a ``DynamicEmbedding``'s sharding; ``(0, 1)`` when it is
    not sharded (a single process, or a replica)."""
    shard = getattr(module, "_shard", None)
    return (0, 1) if shard is None else (shard.group.rank, shard.group.size)


@dataclass
class _InFlight:
    """An async gradient exchange, as one table sees it: ``grad()`` waits and returns
    this table's received part gradients."""

    step: int  # the optimizer step whose backward sent it
    grad: Callable[[], torch.Tensor]
    owner: "_Served"


@dataclass
class Shard:
    """How one ``DynamicEmbedding`` is sharded (set by ``HybridParallel``).

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
    in_flight: deque = field(default_factory=deque)

    def lookup(self, module, ids, offsets, psw, layouts: Sequence[tuple] = ()) -> torch.Tensor:
        """The sharded equivalent of ``module``'s local pooled lookup (``layouts``: see
        :func:`sharded_lookup`)."""
        return sharded_lookup([module], [(ids, offsets, psw)], layouts)[0]

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
        while self.in_flight and self.in_flight[0].step <= self.steps - 1 - self.staleness:
            f = self.in_flight.popleft()
            _record([module], [f.owner], [f.grad()], noted=True)

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
        owners' agreement there instead (see :func:`_finish`)."""
        try:
            yield
        except Exception as e:
            if group is None and self.group.prefetched:
                # raises with lookup_errors="raise"
                _finish(self, _complete(self.group, self.group.prefetched.popleft()), refusal=e)
                # "raise_next": the other ranks go on and raise at their next step(); this
                # one cannot go on with input it cannot read, and they may wait for it in
                # a later collective (docs/distributed.md says so).
                raise
            abandon_exchange(group or self.group)
            e._veloce_abandoned = True  # the other ranks learn of it in this exchange's header (deferring_errors)
            raise

    def flush(self, module) -> None:
        """Waits for every gradient in flight and adds it to the pending gradient."""
        while self.in_flight:
            f = self.in_flight.popleft()
            _record([module], [f.owner], [f.grad()], noted=True)


# ---- one exchange for K tables --------------------------------------------------------------
@dataclass
class _Served:
    """What an owner served one table in a forward: the received parts and their slots.
    (None in its place: the owner failed, and the parts' gradients are dropped.)"""

    ids: torch.Tensor  # (R,) received ids
    slots: torch.Tensor  # (R,) their slots at forward time
    offsets: torch.Tensor  # (Q,) start of each received part
    psw: Optional[torch.Tensor]  # (R,) received per-sample weights
    version: int  # the table version of slots


@dataclass
class _Exchange:
    """Everything backward needs about one grouped lookup."""

    modules: list
    shard: Shard
    batch: "_Batch"  # the requester's bags, padding dropped
    perm: torch.Tensor
    bag_of_part: torch.Tensor
    scale: Optional[torch.Tensor]  # (sum B,) 1 / bag length for mean tables, 1 for sum tables
    id_splits: list[int]
    part_splits: list[int]
    recv_ids_n: list[int]
    recv_parts_n: list[int]
    recv_parts_nk: list  # [k][peer]: parts received of table k from each peer
    recv_ids_nk: list  # [k][peer]: ids received of table k from each peer
    served: list  # _Served per table
    refused: bool = False  # a prefetched exchange this rank's forward could not use (see _run_forward)
    prefetched_psw_grad: bool = False  # refused: what the other ranks' backward does (their signature's)

    def backward(self, grads, psw_grad: list[bool]) -> list:
        return _backward(self, grads, psw_grad)


def sharded_lookup(modules: Sequence, bags: Sequence[tuple], layouts: Sequence[tuple] = ()) -> list[torch.Tensor]:
    """Pooled lookups of K sharded tables (same group, dim and dtype) in one exchange.

    ``bags[k]`` is ``(ids, offsets, per_sample_weights)`` as validated by the module, but
    for the offsets' values of the bag ``layouts`` its ``_bags`` deferred: those are checked
    on the device and read back with the exchange's header (one host sync for both). A bad
    layout raises its error on this rank, and the other ranks raise ExchangeError."""
    from veloce.distributed import static

    plan = static.take_plan(modules)
    if plan is not None:  # a step of static exchanges (veloce.graphs.CUDAGraphStep)
        return static.lookup(modules, bags, plan)
    shard = modules[0]._shard
    raise_deferred_failures(shard.group)  # an earlier forward's failure first, before anything moves
    training = _training(modules)  # read here: the autograd Function's forward runs without gradients
    anchor_needed = any(training)
    psws = [b[2] for b in bags]
    psw_grad = anchor_needed and any(p is not None and p.requires_grad for p in psws)
    dispatched = _take_dispatched(shard.group, modules, bags, psw_grad, training)
    if not anchor_needed:
        with torch.no_grad():
            outs, _ = _run_forward(shard, modules, bags, False, layouts, dispatched, training)
        return list(outs)
    return list(_GroupedLookup.apply(autograd_anchor(bags[0][0].device), shard, modules, bags, psw_grad, layouts,
                                     dispatched, training, *psws))  # fmt: skip


def _training(modules: Sequence) -> tuple[bool, ...]:
    """Per table, whether its lookup now is a training lookup (it inserts, and its gradient
    is exchanged): training mode with gradients enabled, as
    :func:`veloce.embedding.training_lookup` says."""
    grad = torch.is_grad_enabled()
    return tuple(grad and m.training for m in modules)


def _run_forward(shard: Shard, modules: list, bags: Sequence[tuple], psw_grad: bool, layouts: Sequence[tuple],
                 dispatched: Optional[tuple], training: tuple[bool, ...]):  # fmt: skip
    if dispatched is None:
        return _forward_for(shard)(shard, modules, bags, psw_grad, layouts, training)
    d, refusal = dispatched
    outs, ex = _finish(shard, d, refusal)  # raises here with lookup_errors="raise"
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


def dispatch_group(modules: Sequence, bags: Sequence[tuple], layouts: Sequence[tuple] = (),
                   depth: str = "inserts") -> None:  # fmt: skip
    """Runs the first half of a later :func:`sharded_lookup` of ``modules`` (one exchange)
    now and queues it on the group, where that lookup takes it (see
    :meth:`veloce.distributed.HybridParallel.prefetch`). ``depth="header"``: only its start
    (bucketing, the header swap queued; no host sync): the lookup runs the rest."""
    shard = modules[0]._shard
    check_prefetchable(modules)
    psw_grad = any(b[2] is not None and b[2].requires_grad for b in bags)
    training = _training(modules)
    if depth == "header":  # nothing moves in the tables: an earlier failure is raised by the lookup
        with deferring_errors(shard, modules, depth) as failed:  # _begin abandons its header on an error
            begun = _begin(shard, list(modules), bags, psw_grad, layouts, training, shard.dispatch_group,
                           note_read=True)  # fmt: skip
        if not failed:
            shard.group.prefetched.append(begun)
        return
    raise_deferred_failures(shard.group)
    shard.group.prefetched.append(_dispatch(shard, list(modules), bags, psw_grad, layouts, training,
                                            shard.dispatch_group))  # fmt: skip


def check_prefetchable(modules: Sequence) -> None:
    """Raises ``ValueError`` when ``modules`` (one exchange) cannot be prefetched now: with
    dedup, or a table with a prefetched lookup no forward has taken yet. The same on every
    rank (so all raise, none waits): checked before the input, whose errors abandon the
    exchange."""
    shard = modules[0]._shard
    if shard.dedup:
        raise ValueError(
            "HybridParallel.prefetch: not available with dedup=True (the exchange of distinct ids is not split "
            "in two halves); construct HybridParallel with dedup=False to prefetch"
        )  # fmt: skip
    # An insert into a table whose prefetched slots no forward has taken yet could grow it
    # or evict under them. (The queue is the same on every rank: all raise here, none waits.)
    pending = {id(m.table) for d in shard.group.prefetched for m in d.modules}
    clash = [m._shard.tag for m in modules if id(m.table) in pending]
    if clash:
        raise ValueError(
            f"HybridParallel.prefetch: table(s) {clash} already have a prefetched lookup that no forward has taken "
            f"yet: prefetch one batch ahead (after step(), before the next forward), and a model must look each "
            f"table up once per forward to be prefetched"
        )  # fmt: skip


def drop_failed_gradients(modules: Sequence) -> None:
    """After an owner's deferred failure (``lookup_errors="raise_next"``), before it raises:
    the sparse gradients not yet applied are dropped, pending ones and, in async mode, those
    the failed step's backward sent (earlier steps' stay in flight), so no part of that
    forward's gradient is applied later."""
    for m in modules:
        m._forget_gradient()
        shard = m._shard
        if shard is not None and shard.in_flight:
            shard.in_flight = deque(f for f in shard.in_flight if f.step < shard.steps)


def _take_dispatched(group: Group, modules: Sequence, bags: Sequence[tuple], psw_grad: bool,
                     training: tuple[bool, ...]) -> Optional[tuple]:  # fmt: skip
    """The prefetched first half of this lookup, if one is queued: ``(dispatched,
    refusal)``. It must be this lookup's: the same tables in the same mode (the same on
    every rank: else every rank raises here, and the queue is dropped), inputs of the same
    shapes (this rank's own: else ``refusal``, which :func:`_finish` turns into an error on
    every rank)."""
    if not group.prefetched:
        return None
    d = group.prefetched.popleft()
    tags = [m._shard.tag for m in modules]
    if [id(m) for m in d.modules] != [id(m) for m in modules] or d.training != training:
        group.prefetched.clear()
        raise ValueError(
            f"HybridParallel.prefetch: this lookup of tables {tags} (training={list(training)}) is not the one "
            f"prefetched next (tables {[m._shard.tag for m in d.modules]}, training={list(d.training)}); call "
            f"forward with the inputs given to prefetch, in the order prefetched, in the same train/eval mode "
            f"(a lookup under torch.no_grad() is an evaluation lookup)"
        )  # fmt: skip
    d = _complete(group, d)  # every rank, whatever its inputs: the rest of the first half is collective
    if d.shapes != _bag_shapes(bags) or d.psw_grad != psw_grad:
        return d, ValueError(
            f"HybridParallel.prefetch: the inputs of this lookup of tables {tags} differ in shape (or in whether "
            f"per-sample weights require grad) from those prefetched for it; call forward with the inputs given "
            f"to prefetch"
        )  # fmt: skip
    return d, None


@dataclass
class _Abandoned:
    """A prefetch (``prefetch_depth="header"``) that failed on this rank before its header
    (bad input): this rank abandoned the header swap, and the forward that takes it raises
    ``error`` here, the others :class:`ExchangeError` (see :func:`deferring_errors`)."""

    modules: list
    training: tuple
    error: Exception

    def tensors(self) -> list:
        return []


@contextlib.contextmanager
def deferring_errors(shard: Shard, modules: Sequence, depth: str):
    """Around the part of a prefetch of ``modules`` that abandons its header swap on an
    error (bad input; :meth:`Shard.abandon_on_error`). With ``depth="header"`` the error is
    kept for the forward that takes the prefetch, where every rank raises (this rank its
    own error, the others an ExchangeError from the abandoned header): prefetch has no host
    sync in which the other ranks could learn of it, and raising here would leave them
    waiting in their next collective. Yields a list that holds the error once kept. Other
    depths raise at once (every rank does, in the prefetch's own header swap)."""
    failed: list = []
    try:
        yield failed
    except Exception as e:
        if depth != "header" or not getattr(e, "_veloce_abandoned", False):
            raise  # (an error after the header was queued: nothing tells the other ranks)
        failed.append(e)
        shard.group.prefetched.append(_Abandoned(list(modules), _training(modules), e))


def complete_prefetched(group: Group) -> None:
    """Finishes every header-only prefetch queued on ``group`` now (in queue order, the same
    on every rank), before the forward that takes them queues anything: its own work (a
    model's transpose of its ids beside the updates, on the same high-priority stream) would
    otherwise make their ids' all-to-all and inserts wait for the previous step's tail. An
    earlier forward's deferred failure is raised first, as the lookup would."""
    if not any(isinstance(d, (_Begun, _Abandoned)) for d in group.prefetched):
        return
    raise_deferred_failures(group)
    for i in range(len(group.prefetched)):
        group.prefetched[i] = _complete(group, group.prefetched[i])


def _complete(group: Group, d: Any) -> _Dispatched:
    """A prefetched first half taken from ``group``'s queue, finished if only its start was
    prefetched (``prefetch_depth="header"``): the header read back, the ids' all-to-all and
    the owners' inserts, on the prefetch stream (their host syncs wait for them alone, not
    for the previous step's tail on the current stream) and the prefetch's process group.
    If that raises (on every rank: a rank's bad input abandoned the header), the queue is
    dropped, as after any failed exchange."""
    if not isinstance(d, (_Begun, _Abandoned)):
        return d
    try:
        if isinstance(d, _Abandoned):
            raise d.error
        with on_prefetch_stream(d.batch.ids.device) as main:
            done = _end(d)
    except BaseException:
        group.prefetched.clear()
        raise
    if main is not None:
        record_streams(done.tensors(), main)  # allocated on the prefetch stream, used on the current one
    return done


def _forward_for(shard: Shard):
    """The exchange a shard uses: partial sums per bag part, or (dedup) one row per distinct id."""
    if shard.dedup:
        from veloce.distributed.dedup import forward_rows

        return forward_rows
    return _forward


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
class _Batch:
    """The bags of K tables, padding dropped, concatenated table after table."""

    ids: torch.Tensor  # (M,)
    starts: torch.Tensor  # (B,) bag starts into ids
    psw: Optional[torch.Tensor]  # (M,) per-sample weights (ones for tables without), or None
    kept: list  # per table: positions kept, or None when nothing was dropped
    num_ids: list[int]  # per table: ids given (padding included)
    num_kept: list[int]  # per table: ids kept
    num_bags: list[int]  # per table: bags


def _concat_bags(modules: list, bags: Sequence[tuple], dtype: torch.dtype, dev: torch.device) -> _Batch:
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
    starts_all = _shift_segments(torch.cat(starts_l), num_bags, num_kept)
    psw_all = torch.cat(psw_l) if any_psw else None
    return _Batch(torch.cat(ids_l), starts_all, psw_all, kept_l, num_ids, num_kept, num_bags)


def _shift_segments(values: torch.Tensor, lengths: list[int], sizes: list[int]) -> torch.Tensor:
    """``values`` cut into segments of ``lengths``, each plus the sum of ``sizes`` of the
    segments before it (per-table positions made positions into the concatenation)."""
    bases = [0, *itertools.accumulate(sizes)][:-1]
    if not any(b and n for b, n in zip(bases, lengths)):
        return values
    dev = values.device
    both = host_tensor([bases, lengths], dev)  # (2, segments): one copy
    shift = torch.repeat_interleave(both[0], both[1], output_size=values.numel())
    return values + shift


def _layout_flag(layouts: Sequence[tuple], dev: torch.device) -> Optional[torch.Tensor]:
    """Whether any deferred bag layout is bad, as a bool on ``dev`` (nothing read back);
    None when there is nothing to check there (layouts on other devices are checked now)."""
    if not layouts:
        return None

    flags = offsets_flags(layouts)
    if not flags:
        return None
    if set(flags) != {dev}:
        check_offsets_many(layouts, flags)
        return None
    return flags[dev]


def _raise_bad_layout(layouts: Sequence[tuple]) -> None:
    """Raises the detailed error of the first bad layout, if one is bad."""

    check_offsets_many(layouts)


@dataclass
class _Dispatched:
    """A sharded forward's first half (:func:`_dispatch`): the ids at their owners and
    inserted there. Everything up to the forward's last host sync but the owners'
    agreement; :func:`_finish` does the rest (no host sync with lookup_errors="raise_next").
    :meth:`HybridParallel.prefetch` dispatches a later forward's lookups ahead of time."""

    modules: list
    batch: _Batch
    perm: torch.Tensor
    bag_of_part: torch.Tensor
    id_splits: list[int]
    part_splits: list[int]
    recv_ids_n: list[int]
    recv_parts_n: list[int]
    recv_parts_nk: list  # [k][peer]
    recv_ids_nk: list  # [k][peer]
    ids: list  # per table: the ids its owner received (this rank owns them)
    starts: list  # per table: the starts of the received parts in them
    psw: list  # per table: the received per-sample weights, or None
    slots: list  # per table: the slots of the inserted ids (training), or None
    error: Optional[Exception]  # this owner's insert failed (its agreement is in _finish)
    shapes: tuple = ()  # the bags' shapes, to check a prefetched dispatch against its forward's
    training: tuple = ()  # the tables' modes then (an evaluation lookup inserts nothing)
    versions: tuple = ()  # the tables' versions after the inserts (the slots hold until they change)
    psw_grad: bool = False  # per-sample weights' gradients asked for (in the header's signature)

    def tensors(self) -> list:
        """Every tensor the forward's second half and backward use (for record_stream)."""
        b = self.batch
        return [b.ids, b.starts, b.psw, *b.kept, self.perm, self.bag_of_part, *self.ids, *self.starts, *self.psw,
                *self.slots]  # fmt: skip


def _bag_shapes(bags: Sequence[tuple]) -> tuple:
    return tuple((i.shape, o.shape, None if p is None else p.shape) for i, o, p in bags)


def _forward(shard: Shard, modules: list, bags: Sequence[tuple], psw_grad: bool, layouts: Sequence[tuple],
             training: tuple[bool, ...]):  # fmt: skip
    return _finish(shard, _dispatch(shard, modules, bags, psw_grad, layouts, training))


def _dispatch(shard: Shard, modules: list, bags: Sequence[tuple], psw_grad: bool, layouts: Sequence[tuple],
              training: tuple[bool, ...], group: Optional[Group] = None) -> _Dispatched:  # fmt: skip
    """The forward's first half: bucketing, the header (a host sync), the ids' all-to-all
    and the owners' inserts (their host syncs; ``training``: per table, whether it is a
    training lookup, which inserts); nothing of it waits for the tables' rows.
    Its exchanges run on ``group`` (by default the lookups' group; a prefetch has its own,
    so that they do not queue behind the previous step's exchanges)."""
    return _end(_begin(shard, modules, bags, psw_grad, layouts, training, group))


@dataclass
class _Begun:
    """The start of a forward's first half (:func:`_begin`): the ids bucketed by owner and
    the header swap queued, nothing read back. :func:`_end` goes on from there."""

    group: Group
    modules: list
    batch: _Batch
    buckets: Any  # bucketize_bags' result
    header: Header
    layouts: Sequence[tuple]
    shapes: tuple
    training: tuple
    psw_grad: bool
    read: Any = None  # note_read on CUDA: an event after the last read of the inputs, before the header's swap

    def tensors(self) -> list:
        """The tensors :func:`_end` reads (for record_stream)."""
        b, k = self.batch, self.buckets
        return [b.ids, b.starts, b.psw, *b.kept, k.perm, k.bag_of_part, k.part_lengths, k.id_splits, k.part_splits]


def _begin(shard: Shard, modules: list, bags: Sequence[tuple], psw_grad: bool, layouts: Sequence[tuple],
           training: tuple[bool, ...], group: Optional[Group] = None, note_read: bool = False) -> _Begun:  # fmt: skip
    """The first half's start, without a host sync: the bags concatenated and bucketed by
    owner, the header swap queued (on ``group``, by default the lookups' group).
    ``note_read``: also an event after the last read of the inputs (``_Begun.read``), for a
    header-only prefetch whose current stream must not overwrite them first."""
    g = group or shard.group
    K = len(modules)
    dev = bags[0][0].device
    dtype = modules[0].table.dtype
    with shard.abandon_on_error(g):  # an error before the header: the other ranks raise in theirs
        bad_layout = _layout_flag(layouts, dev)
        cb = _concat_bags(modules, bags, dtype, dev)
        any_psw = cb.psw is not None
        # Without waiting for the device: its sizes come back with the header's (the split
        # sizes sum to them). The layout is checked by the tables (on CUDA in the header);
        # the CPU kernel checks it again, and fails on a bad concatenated layout.
        try:
            b = bucketize_bags(cb.ids, cb.starts, g.size, exact_sizes=False)
        except RuntimeError:  # the concatenated layout is bad: say which table's is
            _raise_bad_layout(layouts)
            raise

        parts_nk, ids_nk = _counts_per_owner_and_table(b, cb.num_bags, g.size, dev)
    wire = wire_dtype(shard.exchange_dtype, dtype)
    # The last int: 0 = parts (dedup.py sends 1), the rows' wire dtype, and the tables'
    # train/eval modes (a rank in eval and one in training would otherwise meet in
    # different collectives: the trainer's gradient exchange, the other's step).
    signature = (K, _tags_hash(modules), modules[0].embedding_dim, int(any_psw), int(psw_grad),
                 wire_code(wire) << 1 | modes_code(training))  # fmt: skip
    # One column per field: the ids and parts per owner, then per (owner, table) the parts and ids.
    fields = torch.cat([b.id_splits.view(-1, 1), b.part_splits.view(-1, 1), parts_nk.view(g.size, K),
                        ids_nk.view(g.size, K)], 1)  # fmt: skip
    read = None
    if note_read and dev.type == "cuda":  # the inputs, which later current-stream work may overwrite, are read
        read = torch.cuda.Event()
        read.record(current_stream(dev))
    header = begin_headers(g, fields, signature, bad_layout)
    return _Begun(g, list(modules), cb, b, header, layouts, _bag_shapes(bags), tuple(training), bool(psw_grad),
                  read)  # fmt: skip


def _end(begun: _Begun) -> _Dispatched:
    """The first half's end (:func:`_begin` started it): the header read back (a host sync),
    the ids' all-to-all and the owners' inserts (their host syncs), on ``begun.group``."""
    g, modules, cb, b, layouts = begun.group, begun.modules, begun.batch, begun.buckets, begun.layouts
    K = len(modules)
    any_psw = cb.psw is not None
    what = f"DynamicEmbedding tables {[m._shard.tag for m in modules]}"
    sent, recv = finish_headers(g, begun.header, what, lambda: _raise_bad_layout(layouts))
    id_splits, part_splits = sent[0], sent[1]
    recv_ids_n, recv_parts_n = recv[0], recv[1]
    # The parts, without bucketize_bags' padding rows (every position is sent: the
    # concatenated bags hold no padding id).
    P = sum(part_splits)
    bag_of_part, part_lengths = b.bag_of_part[:P], b.part_lengths[:P]
    recv_parts_nk, recv_ids_nk = recv[2 : 2 + K], recv[2 + K :]  # [k][peer]

    recv_ids, recv_len = _all_to_all_pair(g, cb.ids[b.perm], part_lengths, id_splits, part_splits, recv_ids_n,
                                          recv_parts_n)  # fmt: skip
    recv_psw = all_to_all(g, cb.psw[b.perm], id_splits, recv_ids_n) if any_psw else None

    # The owner: what it receives comes in blocks, one per (peer, table), peer-major; each
    # table is served from its own contiguous run (the blocks regrouped table-major).
    parts_per_table = [sum(c) for c in recv_parts_nk]
    ids_per_table = [sum(c) for c in recv_ids_nk]
    t_ids = _table_major(recv_ids, recv_ids_nk).split(ids_per_table)
    t_len = _table_major(recv_len, recv_parts_nk)
    # Each table's part starts: one exclusive sum over all parts, shifted back per table.
    starts = _shift_segments(torch.cumsum(t_len, 0) - t_len, parts_per_table, [-n for n in ids_per_table])
    t_starts = starts.split(parts_per_table)
    t_psw = _table_major(recv_psw, recv_ids_nk).split(ids_per_table) if any_psw else [None] * K
    slots, error = _insert_tables(modules, t_ids, begun.training)
    return _Dispatched(modules, cb, b.perm, bag_of_part, id_splits, part_splits, recv_ids_n, recv_parts_n,
                       recv_parts_nk, recv_ids_nk, list(t_ids), list(t_starts), list(t_psw), slots, error,
                       begun.shapes, begun.training, tuple(m.table.version for m in modules),
                       begun.psw_grad)  # fmt: skip


def _finish(shard: Shard, d: _Dispatched, refusal: Optional[Exception] = None):
    """The forward's second half: the owners' lookups and agreement, the partial sums back,
    combined per bag. ``refusal``: this rank cannot use a prefetched ``d`` (its forward's
    inputs differ): it still takes part in every collective, and fails through the owners'
    agreement, so that every rank raises, none waits."""
    g, modules, cb = shard.group, d.modules, d.batch
    dtype, dev = modules[0].table.dtype, cb.ids.device
    error = d.error or refusal
    changed = [m._shard.tag for m, v in zip(modules, d.versions) if m.table.version != v]
    if error is None and changed:  # prefetched slots of a table grown, evicted or erased since
        error = ValueError(
            f"HybridParallel.prefetch: table(s) {changed} changed between prefetch and this forward (an insert, "
            f"erase or load grew the table or moved its rows); call prefetch after step() and before the forward, "
            f"with nothing in between that inserts into the tables"
        )  # fmt: skip
    served, pooled = _serve_inserted(modules, d.ids, d.starts, d.psw, d.slots, error, d.training)
    # The partial sums narrowed to the wire dtype in their regrouping, and summed from it
    # into the table's dtype: no pass of its own for either conversion.
    wire = wire_dtype(shard.exchange_dtype, dtype)
    partial = _received_order(pooled, d.recv_parts_nk, wire)
    parts = all_to_all_rows(g, partial, d.recv_parts_n, d.part_splits, wire)
    # bag_of_part comes from bucketize_bags: in range, so no check (on CUDA, a host sync).
    total_bags = sum(cb.num_bags)
    out = combine_parts(parts, d.bag_of_part, total_bags, check_bags=False, dtype=dtype)
    scale = _mean_scale(modules, cb, dtype, dev)
    if scale is not None:
        out = out * scale.unsqueeze(1)
    ex = _Exchange(modules, shard, cb, d.perm, d.bag_of_part, scale, d.id_splits, d.part_splits, d.recv_ids_n,
                   d.recv_parts_n, d.recv_parts_nk, d.recv_ids_nk, served)  # fmt: skip
    return _per_table(out, cb.num_bags), ex


def _all_to_all_pair(group: Group, a: torch.Tensor, b: torch.Tensor, a_splits: list[int], b_splits: list[int],
                     a_recv: list[int], b_recv: list[int]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Two all-to-alls of one dtype (the ids and the part lengths) as one: each peer gets
    its block of ``a`` followed by its block of ``b``. Every all-to-all is a point where the
    ranks wait for each other; packing costs two small copies."""
    if group.size == 1:
        return a, b
    send = regroup_blocks([a, b], [a_splits, b_splits], to_group_major=False)
    recv = all_to_all(group, send, [x + y for x, y in zip(a_splits, b_splits)],
                      [x + y for x, y in zip(a_recv, b_recv)])  # fmt: skip
    return regroup_blocks([recv], [a_recv, b_recv], to_group_major=True).split([sum(a_recv), sum(b_recv)])


def _counts_per_owner_and_table(b, num_bags: list[int], world: int, dev,
                                bounds: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per (owner, table), flattened owner-major: the number of parts and of ids sent, for
    the owner to split what it receives by table. ``b`` may hold padding parts after the
    real ones (``bucketize_bags(exact_sizes=False)``: bag 0, length 0); nothing is read back.

    Parts come sorted by (owner, bag), and the bags table after table, so the parts of
    owner r and table k are one run of the sorted keys ``owner * B + bag`` (padding parts:
    owner W, key W * B, past every real key): a search for the W * K run starts gives both
    counts (the ids through a prefix sum of the part lengths). A scatter-add into the W * K
    cells would serialize on their atomics. ``bounds``: :func:`_run_bounds` made already
    (a captured caller's, made outside the capture)."""
    B = sum(num_bags)
    P = b.bag_of_part.numel()
    ends = torch.cumsum(b.part_splits, 0)
    owner = torch.searchsorted(ends, torch.arange(P, device=dev), right=True)  # W past the real parts
    keys = owner * B + b.bag_of_part  # non-decreasing
    if bounds is None:
        bounds = host_tensor(_run_bounds(num_bags, world), dev)  # known on the host: one copy
    pos = torch.searchsorted(keys, bounds)
    ids_before = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), torch.cumsum(b.part_lengths, 0)])
    return pos.diff(), ids_before[pos].diff()


def _run_bounds(num_bags: Sequence[int], world: int) -> list[int]:
    """The starts of the runs of :func:`_counts_per_owner_and_table`'s sorted keys: r * B +
    (table k's first bag) for each owner r and table k, then the end W * B."""
    B = sum(num_bags)
    table_starts = [0, *itertools.accumulate(num_bags)][:-1]
    return [r * B + start for r in range(world) for start in table_starts] + [world * B]


def _per_table(out: torch.Tensor, num_bags: list[int]) -> tuple[torch.Tensor, ...]:
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


def _tags_hash(modules) -> int:
    """A fingerprint of which tables an exchange serves, the same on every rank."""
    h = 0
    for m in modules:
        h = (h * 1_000_003 + m._shard.tag + 1) % (1 << 61)
    return h


def _table_major(t: torch.Tensor, counts: Sequence[Sequence[int]],
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


def _received_order(per_table: Sequence[torch.Tensor], counts: Sequence[Sequence[int]],
                    dtype: Optional[torch.dtype] = None) -> torch.Tensor:  # fmt: skip
    """The inverse of :func:`_table_major`: per-table rows (table k's blocks in peer order)
    as one tensor, peer-major, in the order the all-to-all back to the peers sends.
    ``dtype``: the rows converted to it (narrowed for the wire), in the regrouping's copy."""
    if len(counts) == 1:
        return per_table[0] if dtype is None else per_table[0].to(dtype)
    return regroup_blocks(per_table, counts, to_group_major=False, dtype=dtype)  # one peer: a cat


def _mean_scale(modules: list, batch: _Batch, dtype: torch.dtype, dev: torch.device) -> Optional[torch.Tensor]:
    """1 / (ids in the bag, padding dropped) for the bags of mean tables, 1 elsewhere. No
    host-to-device copy (a graph would replay one from host memory that may since hold
    something else)."""
    if all(m.mode != "mean" for m in modules):
        return None
    ends = torch.cat([batch.starts[1:], batch.starts.new_full((1,), batch.ids.numel())])
    counts = (ends - batch.starts).to(dtype)
    is_mean = torch.cat([torch.full((n,), m.mode == "mean", device=dev) for m, n in zip(modules, batch.num_bags)])
    return torch.where(is_mean, 1.0 / counts.clamp(min=1), torch.ones_like(counts))


def _serve_tables(modules: list, ids: Sequence[torch.Tensor], starts: Sequence[torch.Tensor],
                  psw: Sequence[Optional[torch.Tensor]], training: tuple[bool, ...]) -> tuple[list, list]:  # fmt: skip
    """The owner's half of a grouped lookup: each table serves its block (parts starting
    at ``starts[k]`` in ``ids[k]``). Returns per table its :class:`_Served` and its pooled
    parts (:func:`_insert_tables`, then :func:`_serve_inserted`)."""
    slots, error = _insert_tables(modules, ids, training)
    return _serve_inserted(modules, ids, starts, psw, slots, error, training)


def _insert_tables(modules: list, ids: Sequence[torch.Tensor],
                   training: tuple[bool, ...]) -> tuple[list, Optional[Exception]]:  # fmt: skip
    """The owner inserts the received ids of the tables whose lookup is a training lookup
    (``training[k]``): one op for all of them.
    Returns per table the slots (None for evaluation tables, and for a table listed twice,
    or shared by two modules, after its first: it inserts on its own when served, after
    its first part is, since an insert may move its rows), and the error that stopped the
    inserts, if one did (every rank must learn of it before any raises)."""
    slots: list = [None] * len(modules)
    try:
        first: dict[int, int] = {}
        train = [k for k, m in enumerate(modules) if training[k] and first.setdefault(id(m.table), k) == k]
        # Never deferred (DynamicEmbedding(defer_inserts=)): a full owner must fail this step on every rank.
        tables = [modules[k].table for k in train]
        for k, s in zip(train, find_or_insert_many(tables, [ids[k] for k in train], allow_defer=False)):
            slots[k] = s
    except Exception as e:  # e.g. TableFullError on this owner: every rank must stop, not wait
        return slots, e
    return slots, None


def _serve_inserted(modules: list, ids: Sequence[torch.Tensor], starts: Sequence[torch.Tensor],
                    psw: Sequence[Optional[torch.Tensor]], slots: list, error: Optional[Exception],
                    training: tuple[bool, ...]) -> tuple[list, list]:  # fmt: skip
    """The owner's lookups after :func:`_insert_tables` (its ``slots`` and ``error``), and
    the owners' agreement on whether any failed.

    If this owner failed (a full table, a lookup out of memory), every rank must stop, and
    none may be left waiting in a collective. With ``lookup_errors="raise"`` the ranks
    agree on it here (a collective and a host read) and raise. With "raise_next" the
    agreement stays on the device (:class:`DeferredFailure`): a failed owner serves zero
    partial sums (and None for each :class:`_Served`: its gradients are dropped), and
    every rank raises at its next step(), lookup or flush()."""
    served: list = []
    pooled: list = []
    if error is None:
        try:
            # _insert_tables left None for a training table only where it repeats an earlier one
            repeated = any(t and s is None for t, s in zip(training, slots))
            if not repeated:  # one lookup op
                served, pooled = _serve_all(modules, ids, starts, psw, slots)
            else:
                slots = list(slots)
                for k, (m, ids_k, starts_k, psw_k) in enumerate(zip(modules, ids, starts, psw)):
                    if training[k] and slots[k] is None:
                        slots[k] = m.table.find_or_insert(ids_k, allow_defer=False)
                    s, p = _serve_all([m], [ids_k], [starts_k], [psw_k], [slots[k]])
                    served += s
                    pooled += p
        except Exception as e:  # e.g. out of memory for the lookup's output
            error = e
    # After serving, not right after the inserts: a lookup can fail too (out of memory for
    # its output), and a rank raising past the agreement would leave the others waiting.
    shard = modules[0]._shard
    if shard.lookup_errors == "raise":
        _agree_no_failure(shard.group, error)
        return served, pooled
    what = f"DynamicEmbedding tables {[m._shard.tag for m in modules]}"
    shard.group.unread.append(DeferredFailure(shard.group, error, what))
    if error is None:
        return served, pooled
    dtype, dim, dev = modules[0].table.dtype, modules[0].embedding_dim, ids[0].device
    return [None] * len(modules), [torch.zeros((s.numel(), dim), dtype=dtype, device=dev) for s in starts]


def _agree_no_failure(group: Group, error: Optional[Exception]) -> None:
    """Every rank learns whether any failed: this rank raises its own ``error``, or
    :class:`ExchangeError` when only others failed (a collective: every rank calls it)."""
    failed = agree_sum(group, int(error is not None))
    if error is not None or failed:
        group.prefetched.clear()  # every rank stops: what was prefetched is not taken
    if error is not None:
        raise error
    if failed:  # only other ranks failed
        raise ExchangeError(f"a sharded lookup failed on {failed} other rank(s) (their errors say why, e.g. a full "
                            f"table); every rank stops here")  # fmt: skip


def _serve_all(modules: list, ids: Sequence[torch.Tensor], offsets: Sequence[torch.Tensor],
               psw: Sequence[torch.Tensor | None], slots: list) -> tuple[list, list]:
    """The owner's half of a lookup for tables ``modules``: per table its :class:`_Served`
    and the sum of each received part (parts start at ``offsets[k]``), from the received
    ids' ``slots[k]`` (training: inserted already) or, for None, the slots of an evaluation
    lookup. One lookup op for all tables (:func:`veloce.table.pooled_many`)."""
    extra: list = [None] * len(modules)
    slots = list(slots)
    for k, m in enumerate(modules):
        if slots[k] is None:
            slots[k], extra[k] = m._eval_slots(ids[k])
    tables = [m.table for m in modules]
    partial = pooled_many(tables, slots, offsets, psw, [_SUM] * len(modules), [False] * len(modules), extra)
    served = [_Served(i, s, o, p, t.version) for t, i, s, o, p in zip(tables, ids, slots, offsets, psw)]
    return served, partial


def _backward(ex: _Exchange, grads: Sequence[Optional[torch.Tensor]], psw_grad: list[bool]):
    """Sends each part's gradient to its owner; returns per-table per-sample-weight
    gradients (None where not needed)."""
    shard, g = ex.shard, ex.shard.group
    if ex.refused:  # zeros of the prefetched bags' shapes: the same collectives, nothing to apply
        grads = [None] * len(ex.modules)
    grad = _cat_grads(ex.modules, grads, ex.batch.num_bags, ex.perm.device)
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
    per_table = _deliver(shard, ex.modules, ex.served, grad_parts, ex.part_splits, ex.recv_parts_n,
                         ex.recv_parts_nk, sync=want_psw)  # fmt: skip
    if not want_psw:
        return [None] * len(ex.modules)
    psw_grads = _psw_grads(ex, per_table, psw_grad)
    return [None] * len(ex.modules) if ex.refused else psw_grads


def _cat_grads(modules: list, grads: Sequence[Optional[torch.Tensor]], num_bags: list[int], dev) -> torch.Tensor:
    """The tables' output gradients as one (sum B, D) tensor (zeros for unused outputs)."""
    dtype, dim = modules[0].table.dtype, modules[0].embedding_dim
    return torch.cat([
        gr.to(dtype) if gr is not None else torch.zeros((n, dim), dtype=dtype, device=dev)
        for gr, n in zip(grads, num_bags)
    ])  # fmt: skip


def _split_psw_grads(flat: torch.Tensor, kept: list, num_ids: list[int], wanted: list[bool]) -> list:
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


def _deliver(shard: Shard, modules: list, served: list, rows: torch.Tensor, send_splits: list[int],
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
                landed["grads"] = _table_major(wait(), recv_nk, dtype).split(per_table)
            return landed["grads"]

        for k, m in enumerate(modules):
            m._shard.in_flight.append(_InFlight(m._shard.steps, lambda k=k: table_grads()[k], served[k]))
            m._note_backward()  # waits for step() too (DynamicEmbedding._check_unapplied)
        return None
    recv = all_to_all_rows(shard.group, rows, send_splits, recv_splits, wire)
    shares = _table_major(recv, recv_nk, dtype).split(per_table)
    _record(modules, served, shares)
    return shares


def _psw_grads(ex: _Exchange, per_table: Sequence[torch.Tensor], psw_grad: list[bool]) -> list:
    """d out[bag] / d psw[i] = <row(i), grad of i's part>: computed by the owner, sent back."""

    g = ex.shard.group
    mine = [
        m.table.psw_grad(_current_slots(m, s), s.offsets, gk, False) if s is not None
        else gk.new_zeros(sum(n))  # a failed owner (lookup_errors="raise_next"): the step raises anyway
        for m, s, gk, n in zip(ex.modules, ex.served, per_table, ex.recv_ids_nk)
    ]  # fmt: skip
    back = all_to_all(g, _received_order(mine, ex.recv_ids_nk), ex.recv_ids_n, ex.id_splits)
    flat = torch.zeros(ex.perm.numel(), dtype=back.dtype, device=back.device).index_copy_(0, ex.perm, back)
    return _split_psw_grads(flat, ex.batch.kept, ex.batch.num_ids, psw_grad)


def _current_slots(module, served: _Served) -> torch.Tensor:
    if served.version == module.table.version:
        return served.slots

    return reresolve(module.table, served.ids, served.slots)


def _record(modules: Sequence, served: Sequence[Optional[_Served]], grads: Sequence[torch.Tensor],
            noted: bool = False) -> None:  # fmt: skip
    """The owner keeps each table's received part gradients until its step(), like a local
    backward (none where it failed to serve them: that step raises). ``noted``: async
    gradients, counted as waiting when they were sent (:func:`_deliver`)."""

    for module, s, grad in zip(modules, served, grads):
        if s is not None:
            module._accumulate(Pending(s.ids, s.slots, s.offsets, s.psw, grad, _SUM, False, s.version), noted)


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


def dispatch_many(tables: Sequence, inputs: Sequence[Any], depth: str = "inserts") -> None:
    """The first half of a later ``lookup_many(tables, inputs)`` of sharded tables, run now:
    each exchange's ids go to their owners, which insert them
    (:meth:`veloce.distributed.HybridParallel.prefetch` calls it; local tables are looked
    up in full later). The later call finds it and runs only the second half.
    ``depth="header"``: only the first half's start (no host sync); the later call runs the rest."""
    args, groups, _ = lookup_groups(tables, inputs, "prefetch")
    aranges: dict = {}
    for idx in groups.values():
        shard = tables[idx[0]]._shard
        group_tables = [tables[i] for i in idx]
        check_prefetchable(group_tables)  # before the input's checks, which abandon the exchange on an error
        with deferring_errors(shard, group_tables, depth) as failed:
            with shard.abandon_on_error(shard.dispatch_group or shard.group):  # bad input fails every rank
                layouts: list = []
                bags = [tables[i]._bags(*args[i], deferred=layouts, aranges=aranges) for i in idx]
        if not failed:
            dispatch_group(group_tables, bags, layouts, depth)
