"""The input distribution of a sharded lookup: the requester's bags bucketed by owner, the
header of split sizes and signature, and the ids (with their part lengths and weights)
sent to their owners, which insert them (:mod:`veloce.distributed.owner`).

It runs in two halves a prefetch may split (:class:`Begun`, then :class:`Dispatched`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from veloce.distributed._comm import (
    Group,
    Header,
    all_to_all,
    begin_headers,
    finish_headers,
    modes_code,
    wire_code,
    wire_dtype,
)  # fmt: skip
from veloce.distributed.layout import Batch, bag_shapes, concat_bags, shift_segments, table_major, tags_hash
from veloce.distributed.owner import insert_tables
from veloce.ops.exchange import bucketize_bags, regroup_blocks
from veloce.runtime.device import current_stream, host_tensor
from veloce.sparse import check_offsets_many, offsets_flags

__all__ = [
    "layout_flag", "raise_bad_layout", "Dispatched", "dispatch", "Begun", "begin_dispatch",
    "end_dispatch", "counts_per_owner_and_table", "run_bounds",
]  # fmt: skip


def layout_flag(layouts: Sequence[tuple], dev: torch.device) -> Optional[torch.Tensor]:
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


def raise_bad_layout(layouts: Sequence[tuple]) -> None:
    """Raises the detailed error of the first bad layout, if one is bad."""

    check_offsets_many(layouts)


@dataclass
class Dispatched:
    """A sharded forward's first half (:func:`dispatch`): the ids at their owners and
    inserted there. Everything up to the forward's last host sync but the owners'
    agreement; :func:`veloce.distributed.output_dist.finish_lookup` does the rest (no host
    sync with lookup_errors="raise_next").
    :meth:`HybridParallel.prefetch` dispatches a later forward's lookups ahead of time."""

    modules: list
    batch: Batch
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
    error: Optional[Exception]  # this owner's insert failed (its agreement is in finish_lookup)
    shapes: tuple = ()  # the bags' shapes, to check a prefetched dispatch against its forward's
    training: tuple = ()  # the tables' modes then (an evaluation lookup inserts nothing)
    versions: tuple = ()  # the tables' versions after the inserts (the slots hold until they change)
    psw_grad: bool = False  # per-sample weights' gradients asked for (in the header's signature)

    def tensors(self) -> list:
        """Every tensor the forward's second half and backward use (for record_stream)."""
        b = self.batch
        return [b.ids, b.starts, b.psw, *b.kept, self.perm, self.bag_of_part, *self.ids, *self.starts, *self.psw,
                *self.slots]  # fmt: skip


def dispatch(shard: Any, modules: list, bags: Sequence[tuple], psw_grad: bool, layouts: Sequence[tuple],
              training: tuple[bool, ...], group: Optional[Group] = None) -> Dispatched:  # fmt: skip
    """The forward's first half: bucketing, the header (a host sync), the ids' all-to-all
    and the owners' inserts (their host syncs; ``training``: per table, whether it is a
    training lookup, which inserts); nothing of it waits for the tables' rows.
    Its exchanges run on ``group`` (by default the lookups' group; a prefetch has its own,
    so that they do not queue behind the previous step's exchanges)."""
    return end_dispatch(begin_dispatch(shard, modules, bags, psw_grad, layouts, training, group))


@dataclass
class Begun:
    """The start of a forward's first half (:func:`begin_dispatch`): the ids bucketed by owner and
    the header swap queued, nothing read back. :func:`end_dispatch` goes on from there."""

    group: Group
    modules: list
    batch: Batch
    buckets: Any  # bucketize_bags' result
    header: Header
    layouts: Sequence[tuple]
    shapes: tuple
    training: tuple
    psw_grad: bool
    read: Any = None  # note_read on CUDA: an event after the last read of the inputs, before the header's swap

    def tensors(self) -> list:
        """The tensors :func:`end_dispatch` reads (for record_stream)."""
        b, k = self.batch, self.buckets
        return [b.ids, b.starts, b.psw, *b.kept, k.perm, k.bag_of_part, k.part_lengths, k.id_splits, k.part_splits]


def begin_dispatch(shard: Any, modules: list, bags: Sequence[tuple], psw_grad: bool, layouts: Sequence[tuple],
           training: tuple[bool, ...], group: Optional[Group] = None, note_read: bool = False) -> Begun:  # fmt: skip
    """The first half's start, without a host sync: the bags concatenated and bucketed by
    owner, the header swap queued (on ``group``, by default the lookups' group).
    ``note_read``: also an event after the last read of the inputs (``Begun.read``), for a
    header-only prefetch whose current stream must not overwrite them first."""
    g = group or shard.group
    K = len(modules)
    dev = bags[0][0].device
    dtype = modules[0].table.dtype
    with shard.abandon_on_error(g):  # an error before the header: the other ranks raise in theirs
        bad_layout = layout_flag(layouts, dev)
        cb = concat_bags(modules, bags, dtype, dev)
        any_psw = cb.psw is not None
        # Without waiting for the device: its sizes come back with the header's (the split
        # sizes sum to them). The layout is checked by the tables (on CUDA in the header);
        # the CPU kernel checks it again, and fails on a bad concatenated layout.
        try:
            b = bucketize_bags(cb.ids, cb.starts, g.size, exact_sizes=False)
        except RuntimeError:  # the concatenated layout is bad: say which table's is
            raise_bad_layout(layouts)
            raise

        parts_nk, ids_nk = counts_per_owner_and_table(b, cb.num_bags, g.size, dev)
    wire = wire_dtype(shard.exchange_dtype, dtype)
    # The last int: 0 = parts (dedup.py sends 1), the rows' wire dtype, and the tables'
    # train/eval modes (a rank in eval and one in training would otherwise meet in
    # different collectives: the trainer's gradient exchange, the other's step).
    signature = (K, tags_hash(modules), modules[0].embedding_dim, int(any_psw), int(psw_grad),
                 wire_code(wire) << 1 | modes_code(training))  # fmt: skip
    # One column per field: the ids and parts per owner, then per (owner, table) the parts and ids.
    fields = torch.cat([b.id_splits.view(-1, 1), b.part_splits.view(-1, 1), parts_nk.view(g.size, K),
                        ids_nk.view(g.size, K)], 1)  # fmt: skip
    read = None
    if note_read and dev.type == "cuda":  # the inputs, which later current-stream work may overwrite, are read
        read = torch.cuda.Event()
        read.record(current_stream(dev))
    header = begin_headers(g, fields, signature, bad_layout)
    return Begun(g, list(modules), cb, b, header, layouts, bag_shapes(bags), tuple(training), bool(psw_grad),
                  read)  # fmt: skip


def end_dispatch(begun: Begun) -> Dispatched:
    """The first half's end (:func:`begin_dispatch` started it): the header read back (a host sync),
    the ids' all-to-all and the owners' inserts (their host syncs), on ``begun.group``."""
    g, modules, cb, b, layouts = begun.group, begun.modules, begun.batch, begun.buckets, begun.layouts
    K = len(modules)
    any_psw = cb.psw is not None
    what = f"DynamicEmbedding tables {[m.backend.tag for m in modules]}"
    sent, recv = finish_headers(g, begun.header, what, lambda: raise_bad_layout(layouts))
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
    t_ids = table_major(recv_ids, recv_ids_nk).split(ids_per_table)
    t_len = table_major(recv_len, recv_parts_nk)
    # Each table's part starts: one exclusive sum over all parts, shifted back per table.
    starts = shift_segments(torch.cumsum(t_len, 0) - t_len, parts_per_table, [-n for n in ids_per_table])
    t_starts = starts.split(parts_per_table)
    t_psw = table_major(recv_psw, recv_ids_nk).split(ids_per_table) if any_psw else [None] * K
    slots, error = insert_tables(modules, t_ids, begun.training)
    return Dispatched(modules, cb, b.perm, bag_of_part, id_splits, part_splits, recv_ids_n, recv_parts_n,
                       recv_parts_nk, recv_ids_nk, list(t_ids), list(t_starts), list(t_psw), slots, error,
                       begun.shapes, begun.training, tuple(m.table.version for m in modules),
                       begun.psw_grad)  # fmt: skip


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


def counts_per_owner_and_table(b, num_bags: list[int], world: int, dev,
                                bounds: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per (owner, table), flattened owner-major: the number of parts and of ids sent, for
    the owner to split what it receives by table. ``b`` may hold padding parts after the
    real ones (``bucketize_bags(exact_sizes=False)``: bag 0, length 0); nothing is read back.

    Parts come sorted by (owner, bag), and the bags table after table, so the parts of
    owner r and table k are one run of the sorted keys ``owner * B + bag`` (padding parts:
    owner W, key W * B, past every real key): a search for the W * K run starts gives both
    counts (the ids through a prefix sum of the part lengths). A scatter-add into the W * K
    cells would serialize on their atomics. ``bounds``: :func:`run_bounds` made already
    (a captured caller's, made outside the capture)."""
    B = sum(num_bags)
    P = b.bag_of_part.numel()
    ends = torch.cumsum(b.part_splits, 0)
    owner = torch.searchsorted(ends, torch.arange(P, device=dev), right=True)  # W past the real parts
    keys = owner * B + b.bag_of_part  # non-decreasing
    if bounds is None:
        bounds = host_tensor(run_bounds(num_bags, world), dev)  # known on the host: one copy
    pos = torch.searchsorted(keys, bounds)
    ids_before = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), torch.cumsum(b.part_lengths, 0)])
    return pos.diff(), ids_before[pos].diff()


def run_bounds(num_bags: Sequence[int], world: int) -> list[int]:
    """The starts of the runs of :func:`counts_per_owner_and_table`'s sorted keys: r * B +
    (table k's first bag) for each owner r and table k, then the end W * B."""
    B = sum(num_bags)
    table_starts = [0, *itertools.accumulate(num_bags)][:-1]
    return [r * B + start for r in range(world) for start in table_starts] + [world * B]
