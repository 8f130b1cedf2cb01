"""Inserts into several tables at once (one op call, one read-back for all of them), the
counts of deferred inserts read later, and running an insert beside the sparse updates in
flight."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Callable, NoReturn, Optional, Sequence, TypeVar

import torch

from veloce.ops import extension as _ext
from veloce.ops import hash_table as _ops
from veloce.runtime import capture as _capture
from veloce.runtime.device import current_stream
from veloce.runtime.update_stream import beside_updates
from veloce.table.capacity import TableFullError

if TYPE_CHECKING:
    from veloce.table.hash_table import HashTable

__all__ = ["DeferredCounts", "find_or_insert_many", "insert_beside_updates"]

_T = TypeVar("_T")


def find_or_insert_many(
    tables: Sequence[HashTable],
    ids: Sequence[torch.Tensor],
    padding_ids: Sequence[int | None] | None = None,
    bad_input: torch.Tensor | None = None,
    on_refused: Callable[[], None] | None = None,
    allow_defer: bool = True,
    sightings: Sequence[torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """``[t.find_or_insert(i, p) for t, i, p in zip(tables, ids, padding_ids)]`` in one op.

    The result and every table's state are those of the separate calls. On CUDA the
    tables share their host syncs (one or two for the whole call instead of per
    table), which is what makes a step over many tables fast. Tables may differ in
    capacity, dim, dtype, policies and device (one op call per device), but each table
    is listed once. A table that finds no room grows (or evicts) and retries alone, as its own
    call would; if one raises :class:`TableFullError`, it is unchanged, the tables the
    op placed keep their inserts, and the other tables that found no room stay unchanged
    too (they are not retried).

    ``bad_input`` is :meth:`HashTable.find_or_insert`'s flag for the whole call: when it is
    true, ``ValueError`` is raised and no table changes. It rides on the one op call, so
    every table must be on its device. When every table defers (:class:`HashTable`,
    ``defer``), the call reads nothing back and a set flag is raised later, as
    :meth:`HashTable.find_or_insert` says (``on_refused``, ``allow_defer``). ``sightings``:
    per table, :meth:`HashTable.find_or_insert`'s (None: one sighting per position).
    """
    padding_ids = [None] * len(tables) if padding_ids is None else list(padding_ids)
    sightings = [None] * len(tables) if sightings is None else list(sightings)
    if not len(tables) == len(ids) == len(padding_ids):
        raise ValueError(
            f"find_or_insert_many: one entry per table: {len(tables)} tables, {len(ids)} id tensors, "
            f"{len(padding_ids)} padding ids"
        )
    if len({id(t) for t in tables}) < len(tables):
        raise ValueError(
            "find_or_insert_many: a table is listed twice; pass each table once (an insert into a table "
            "can move the rows of the slots an earlier call returned)"
        )
    if bad_input is not None and (not tables or any(t.device != bad_input.device for t in tables)):
        where = ", ".join(sorted({str(t.device) for t in tables})) or "no device (no tables)"
        raise ValueError(
            f"find_or_insert_many: bad_input is on {bad_input.device} but the tables are on {where}; one flag "
            f"covers one op call, so every table (at least one) must be on its device"
        )
    by_device: dict[torch.device, list[int]] = {}
    for k, t in enumerate(tables):
        by_device.setdefault(t.device, []).append(k)
    out: list[Optional[torch.Tensor]] = [None] * len(tables)
    for batch in by_device.values():
        if len(batch) == 1:
            out[batch[0]] = tables[batch[0]].find_or_insert(ids[batch[0]], padding_ids[batch[0]], bad_input,
                                                            on_refused, allow_defer, sightings[batch[0]])  # fmt: skip
            continue
        slots = _find_or_insert_batch([tables[k] for k in batch], [ids[k] for k in batch],
                                      [padding_ids[k] for k in batch], bad_input, on_refused, allow_defer,
                                      [sightings[k] for k in batch])  # fmt: skip
        for k, s in zip(batch, slots):
            out[k] = s
    return out  # type: ignore[return-value]


def _find_or_insert_batch(tables: Sequence[HashTable], ids: Sequence[torch.Tensor],
                          padding_ids: Sequence[int | None], bad_input: torch.Tensor | None = None,
                          on_refused: Callable[[], None] | None = None, allow_defer: bool = True,
                          sightings: Sequence[torch.Tensor | None] | None = None) -> list[torch.Tensor]:  # fmt: skip
    """find_or_insert_many over distinct tables: one op call, then per-table growth retries
    (or one deferred op call, when every table may defer)."""
    _ext.require()
    sightings = [None] * len(tables) if sightings is None else sightings
    for t, i, p in zip(tables, ids, padding_ids):
        t.prepare_insert(i, p, bad_input)
    admits = [t._admit_of(i, p, bad_input, n) for t, i, p, n in zip(tables, ids, padding_ids, sightings)]
    out = _insert_batch(tables, ids, padding_ids, bad_input, on_refused, allow_defer, admits)
    for t, s, n in zip(tables, out, sightings):
        t._note_admission(s, n)
    return out


def _insert_batch(tables: Sequence[HashTable], ids: Sequence[torch.Tensor], padding_ids: Sequence[int | None],
                  bad_input: torch.Tensor | None, on_refused: Callable[[], None] | None, allow_defer: bool,
                  admits: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:  # fmt: skip
    """:func:`_find_or_insert_batch` once the sightings are counted (``admits``: each table's
    op ``admit``)."""
    with _ticked_clocks(tables) as booked:
        if allow_defer and all(t._deferrable([i], bad_input) for t, i in zip(tables, ids)):
            out = _insert_deferred(tables, ids, padding_ids, bad_input, on_refused, admits)
            booked.update(id(t) for t in tables)
            return out
        for t in tables:
            t._maybe_grow(bad_input)
        evict = [t._allow_evict() for t in tables]
        args = [t._find_or_insert_args(i, p, e) for t, i, p, e in zip(tables, ids, padding_ids, evict)]
        states = [t._state(join=e) for t, e in zip(tables, evict)]
        per_arg = [list(a) for a in zip(*args)]
        rooms = [t._room() for t in tables]
        room = None if all(r < 0 for r in rooms) else rooms
        inits = [t._initial_state() for t in tables]
        init_state = None if all(i is None for i in inits) else inits
        admit = None if all(a is None for a in admits) else list(admits)
        slots, counts, evicted = insert_beside_updates(
            tables, lambda: _ops.find_or_insert_many(states, *per_arg, bad_input=bad_input, room=room,
                                                     init_state=init_state, admit=admit)  # fmt: skip
        )
        out = list(slots.split([i.numel() for i in ids]))
        counts = counts.tolist()  # a CPU tensor: no device sync
        num_evicted = [c[2] for c in counts]
        # Nothing evicted (the rule): each table's last_evicted is the empty whole, not a split of it.
        evicted = evicted.split(num_evicted) if any(num_evicted) else [evicted] * len(tables)
        for k, (t, (inserted, failed, _)) in enumerate(zip(tables, counts)):
            if failed == 0:
                t._note_inserted(inserted, evicted[k])
                booked.add(id(t))
        for k, (t, (_, failed, _)) in enumerate(zip(tables, counts)):  # after every success is booked
            if failed == 0:
                continue
            t._no_room(failed, ids[k], padding_ids[k])  # grows, or raises TableFullError; the table is unchanged
            out[k] = t._insert(t._find_or_insert_call(ids[k], padding_ids[k], admit=admits[k]), ids=ids[k],
                               padding_id=padding_ids[k])  # fmt: skip
            booked.add(id(t))
    return out


class DeferredCounts:
    """The counts of one deferred insert on their way to the host: on CUDA copied into
    pinned memory behind the op, on its stream, with an event after the copy (on the CPU
    they are there already). Shared by the tables of the call (one row each)."""

    __slots__ = ("event", "host", "on_refused", "refused_raised", "rows")

    def __init__(self, counts: torch.Tensor, on_refused: Callable[[], None] | None) -> None:
        self.host, self.event = counts, None
        if counts.is_cuda:
            self.host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
            self.host.copy_(counts, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(current_stream(counts.device))
        self.rows: Optional[list[list[int]]] = None  # the host values, once read
        self.on_refused = on_refused
        self.refused_raised = False

    def arrived(self, wait: bool) -> bool:
        """Whether the counts are on the host (with ``wait``: after waiting for them)."""
        if self.rows is None:
            if self.event is not None:
                if wait:
                    self.event.synchronize()
                elif not self.event.query():
                    return False
            rows = self.host.tolist()
            self.rows = rows if self.host.dim() == 2 else [rows]  # one table's (2,): one row
        return True

    def row(self, k: int) -> tuple[int, int]:
        """Table k's ``(inserted, failed)``; failed -1: refused for bad_input."""
        assert self.rows is not None
        return self.rows[k][0], self.rows[k][1]

    def refuse(self) -> None:
        """Raises the call's bad_input error, once for all its tables: ``on_refused()`` when
        given (it may return when it raised for another call already), else a ValueError."""
        if self.refused_raised:
            return
        self.refused_raised = True
        if self.on_refused is not None:
            self.on_refused()
            return
        _raise_refused()


def _insert_deferred(tables: Sequence[HashTable], ids: Sequence[torch.Tensor], padding_ids: Sequence[int | None],
                     bad_input: torch.Tensor | None, on_refused: Callable[[], None] | None,
                     admits: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:  # fmt: skip
    """One find_or_insert(_many) op over distinct CUDA tables on one device with ``defer``
    (the tables said yes to :meth:`HashTable._deferrable`): the slots now, the counts later
    (:class:`DeferredCounts`, read by :meth:`HashTable.settle`). ``admits``: each table's
    op ``admit`` (None admits every id)."""
    capture = _capture.ACTIVE
    if capture is None:
        for t in tables:
            if t._unread:  # keep the list short: read what arrived (one event query per call)
                t.settle(wait=False)
    args = [t._find_or_insert_args(i, p, False) for t, i, p in zip(tables, ids, padding_ids)]
    states = [t._state(join=False) for t in tables]
    inits = [t._initial_state() for t in tables]
    # Captured in a CUDA graph: the LRU stamps come from device clocks the graph ticks.
    clocks = None if capture is None else [capture.clock_of(t) for t in tables]

    def call() -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        if len(tables) == 1:  # counts (2,): DeferredCounts reads it as one row
            clock = None if clocks is None else clocks[0]
            slots, counts, evicted = _ops.find_or_insert(*states[0], *args[0], bad_input=bad_input, defer=True, clock=clock,
                                                         init_state=inits[0], admit=admits[0])  # fmt: skip
            out = [slots]
        else:
            per_arg = [list(a) for a in zip(*args)]
            clock = None if clocks is None else torch.cat(clocks)
            init_state = None if all(i is None for i in inits) else inits
            admit = None if all(a is None for a in admits) else list(admits)
            slots, counts, evicted = _ops.find_or_insert_many(states, *per_arg, bad_input=bad_input, defer=True,
                                                              clock=clock, init_state=init_state,
                                                              admit=admit)  # fmt: skip
            out = list(slots.split([i.numel() for i in ids]))
        return out, counts, evicted

    out, counts, evicted = insert_beside_updates(tables, call)
    if capture is not None:  # read after each replay by the step wrapper (veloce.graphs)
        capture.inserts.append(_capture.InsertLog(list(tables), [i.numel() for i in ids], counts, on_refused))
    else:
        deferred = DeferredCounts(counts, on_refused)  # the copy queued on the op's stream
        for k, (t, i) in enumerate(zip(tables, ids)):
            t._unread.append((deferred, k, i.numel()))
    for t in tables:
        t._note_inserted(0, evicted)  # none evicted; what it inserted is booked when read (settle)
    return out


def insert_beside_updates(tables: Sequence[HashTable], call: Callable[[], _T]) -> _T:
    """``call()``, an inserting op over ``tables`` whose states were taken (joined where the
    insert may evict), or a training forward's input checks and insert. While one of them
    still has an update in flight, it runs on the high-priority insert stream, beside that
    update (:func:`veloce.runtime.update_stream.beside_updates`)."""
    for t in tables:
        if t._update_fence is not None and t.device.type == "cuda":
            return beside_updates(t.device, call)
    return call()


def _refuse_if_set(bad_input: torch.Tensor | None) -> None:
    """Raises the ValueError of a refused call (as the op would) when ``bad_input`` is set.
    Reads the flag back: only for paths that wait for the device anyway (growth)."""
    if bad_input is not None and bool(bad_input):
        _raise_refused()


def _raise_refused() -> NoReturn:
    """The ValueError of a call refused for its ``bad_input`` (as the op raises it)."""
    raise ValueError(
        "find_or_insert: bad_input is set: the caller's check of this call's input failed; nothing was "
        "inserted and no table was changed"
    )


@contextlib.contextmanager
def _ticked_clocks(tables: Sequence[HashTable]) -> Iterator[set[int]]:
    """Around a find_or_insert of ``tables``: ticks their LRU clocks (one tick per training
    lookup). The call adds ``id(t)`` to the yielded set for each table whose insert it
    booked. If it raises an error that leaves the tables it did not book unchanged (bad
    input or a refused ``bad_input``: ValueError; no room: TableFullError), their ticks are
    taken back, so that the call leaves no trace in them (their state_dicts included).
    Other errors (out of memory, an interrupt) may come after an op stamped rows with the
    tick: it stays."""
    for t in tables:
        t.clock += 1
    booked: set[int] = set()
    try:
        yield booked
    except (ValueError, TableFullError):
        for t in tables:
            if id(t) not in booked:
                t.clock -= 1
        raise
    for t in tables:  # after the inserts stamped this lookup's rows: expiry never takes them
        if t.eviction_policy.expires:
            t._expire_due()
