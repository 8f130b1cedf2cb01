"""A sharded lookup's first half run ahead of its forward (:meth:`HybridParallel.prefetch`):
queued on the process group, checked against the forward that takes it, and finished
there when only its start was prefetched (``prefetch_depth="header"``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from veloce.distributed import input_dist  # its halves called through the module: tests count begin_dispatch
from veloce.distributed._comm import Group, raise_deferred_failures
from veloce.distributed.input_dist import Begun, Dispatched
from veloce.distributed.layout import bag_shapes, training_modes
from veloce.runtime.update_stream import on_prefetch_stream, record_streams
from veloce.sparse import lookup_groups, validated_bags

__all__ = [
    "dispatch_group", "check_prefetchable", "take_dispatched", "deferring_errors", "complete_prefetched",
    "complete", "dispatch_many",
]  # fmt: skip


def dispatch_group(modules: Sequence, bags: Sequence[tuple], layouts: Sequence[tuple] = (),
                   depth: str = "inserts") -> None:  # fmt: skip
    """Runs the first half of a later :func:`veloce.distributed.sharded.sharded_lookup` of
    ``modules`` (one exchange) now and queues it on the group, where that lookup takes it (see
    :meth:`veloce.distributed.HybridParallel.prefetch`). ``depth="header"``: only its start
    (bucketing, the header swap queued; no host sync): the lookup runs the rest."""
    shard = modules[0].backend
    check_prefetchable(modules)
    psw_grad = any(b[2] is not None and b[2].requires_grad for b in bags)
    training = training_modes(modules)
    if depth == "header":  # nothing moves in the tables: an earlier failure is raised by the lookup
        with deferring_errors(shard, modules, depth) as failed:  # begin_dispatch abandons its header on an error
            begun = input_dist.begin_dispatch(shard, list(modules), bags, psw_grad, layouts, training, shard.dispatch_group,
                           note_read=True)  # fmt: skip
        if not failed:
            shard.group.prefetched.append(begun)
        return
    raise_deferred_failures(shard.group)
    shard.group.prefetched.append(input_dist.dispatch(shard, list(modules), bags, psw_grad, layouts, training,
                                            shard.dispatch_group))  # fmt: skip


def check_prefetchable(modules: Sequence) -> None:
    """Raises ``ValueError`` when ``modules`` (one exchange) cannot be prefetched now: with
    dedup, or a table with a prefetched lookup no forward has taken yet. The same on every
    rank (so all raise, none waits): checked before the input, whose errors abandon the
    exchange."""
    shard = modules[0].backend
    if shard.dedup:
        raise ValueError(
            "HybridParallel.prefetch: not available with dedup=True (the exchange of distinct ids is not split "
            "in two halves); construct HybridParallel with dedup=False to prefetch"
        )  # fmt: skip
    # An insert into a table whose prefetched slots no forward has taken yet could grow it
    # or evict under them. (The queue is the same on every rank: all raise here, none waits.)
    pending = {id(m.table) for d in shard.group.prefetched for m in d.modules}
    clash = [m.backend.tag for m in modules if id(m.table) in pending]
    if clash:
        raise ValueError(
            f"HybridParallel.prefetch: table(s) {clash} already have a prefetched lookup that no forward has taken "
            f"yet: prefetch one batch ahead (after step(), before the next forward), and a model must look each "
            f"table up once per forward to be prefetched"
        )  # fmt: skip


def take_dispatched(group: Group, modules: Sequence, bags: Sequence[tuple], psw_grad: bool,
                     training: tuple[bool, ...]) -> Optional[tuple]:  # fmt: skip
    """The prefetched first half of this lookup, if one is queued: ``(dispatched,
    refusal)``. It must be this lookup's: the same tables in the same mode (the same on
    every rank: else every rank raises here, and the queue is dropped), inputs of the same
    shapes (this rank's own: else ``refusal``, which
    :func:`veloce.distributed.output_dist.finish_lookup` turns into an error on every rank)."""
    if not group.prefetched:
        return None
    d = group.prefetched.popleft()
    tags = [m.backend.tag for m in modules]
    if [id(m) for m in d.modules] != [id(m) for m in modules] or d.training != training:
        group.prefetched.clear()
        raise ValueError(
            f"HybridParallel.prefetch: this lookup of tables {tags} (training={list(training)}) is not the one "
            f"prefetched next (tables {[m.backend.tag for m in d.modules]}, training={list(d.training)}); call "
            f"forward with the inputs given to prefetch, in the order prefetched, in the same train/eval mode "
            f"(a lookup under torch.no_grad() is an evaluation lookup)"
        )  # fmt: skip
    d = complete(group, d)  # every rank, whatever its inputs: the rest of the first half is collective
    if d.shapes != bag_shapes(bags) or d.psw_grad != psw_grad:
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
def deferring_errors(shard: Any, modules: Sequence, depth: str):
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
        shard.group.prefetched.append(_Abandoned(list(modules), training_modes(modules), e))


def complete_prefetched(group: Group) -> None:
    """Finishes every header-only prefetch queued on ``group`` now (in queue order, the same
    on every rank), before the forward that takes them queues anything: its own work (a
    model's transpose of its ids beside the updates, on the same high-priority stream) would
    otherwise make their ids' all-to-all and inserts wait for the previous step's tail. An
    earlier forward's deferred failure is raised first, as the lookup would."""
    if not any(isinstance(d, (Begun, _Abandoned)) for d in group.prefetched):
        return
    raise_deferred_failures(group)
    for i in range(len(group.prefetched)):
        group.prefetched[i] = complete(group, group.prefetched[i])


def complete(group: Group, d: Any) -> Dispatched:
    """A prefetched first half taken from ``group``'s queue, finished if only its start was
    prefetched (``prefetch_depth="header"``): the header read back, the ids' all-to-all and
    the owners' inserts, on the prefetch stream (their host syncs wait for them alone, not
    for the previous step's tail on the current stream) and the prefetch's process group.
    If that raises (on every rank: a rank's bad input abandoned the header), the queue is
    dropped, as after any failed exchange."""
    if not isinstance(d, (Begun, _Abandoned)):
        return d
    try:
        if isinstance(d, _Abandoned):
            raise d.error
        with on_prefetch_stream(d.batch.ids.device) as main:
            done = input_dist.end_dispatch(d)
    except BaseException:
        group.prefetched.clear()
        raise
    if main is not None:
        record_streams(done.tensors(), main)  # allocated on the prefetch stream, used on the current one
    return done


def dispatch_many(tables: Sequence, inputs: Sequence[Any], depth: str = "inserts") -> None:
    """The first half of a later ``lookup_many(tables, inputs)`` of sharded tables, run now:
    each exchange's ids go to their owners, which insert them
    (:meth:`veloce.distributed.HybridParallel.prefetch` calls it; local tables are looked
    up in full later). The later call finds it and runs only the second half.
    ``depth="header"``: only the first half's start (no host sync); the later call runs the rest."""
    args, groups, _ = lookup_groups(tables, inputs, "prefetch")
    aranges: dict = {}
    for idx in groups.values():
        shard = tables[idx[0]].backend
        group_tables = [tables[i] for i in idx]
        check_prefetchable(group_tables)  # before the input's checks, which abandon the exchange on an error
        with deferring_errors(shard, group_tables, depth) as failed:
            with shard.abandon_on_error(shard.dispatch_group or shard.group):  # bad input fails every rank
                layouts: list = []
                bags = [validated_bags(tables[i], *args[i], deferred=layouts, aranges=aranges) for i in idx]
        if not failed:
            dispatch_group(group_tables, bags, layouts, depth)
