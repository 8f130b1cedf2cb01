"""Deferred inserts of a :class:`~veloce.table.HashTable` (``defer = True``): when an
insert may skip reading back its counts, and reading them later (the class docstring of
:class:`~veloce.table.HashTable` states the rules)."""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple, Sequence

import torch

from veloce.runtime import capture as _capture
from veloce.table.batch import DeferredCounts, _refuse_if_set
from veloce.table.capacity import TableFullError

__all__ = ["DeferredInserts", "TableBookkeeping"]


class TableBookkeeping(NamedTuple):
    """What :meth:`DeferredInserts.bookkeeping` keeps of a table."""

    clock: int
    num_evicted: int
    last_evicted: torch.Tensor
    unread: list[Any]  # the deferred calls not read yet: (counts, row, ids)


class DeferredInserts:
    """:class:`~veloce.table.HashTable`'s methods for deferred inserts."""

    def _deferrable(self, ids: Sequence[torch.Tensor], bad_input: torch.Tensor | None = None) -> bool:
        """Whether an insert of ``ids`` (one tensor per call of the table) may skip its
        read-back: see the class docstring. Reads the counts that already arrived first
        when the bound does not hold with the unread ones.

        A table filling up would otherwise wait for the read-back in every call from the
        moment a batch could pass ``grow_at`` until its size does. So once it is half way
        there (and a batch's ids alone do not pass the bound), it grows now, one doubling
        early, and defers. Growth reads the device back anyway: ``bad_input`` is read
        first, and a set flag raises as the op would, before anything changes."""
        if _capture.ACTIVE is not None:  # a captured insert defers always; the step wrapper made room
            return self._room_in_capture(sum(i.numel() for i in ids))
        if not self.defer or torch.are_deterministic_algorithms_enabled():
            return False
        n = sum(i.numel() for i in ids)
        limit = self._defer_limit()
        if self._size + self._unread_ids() + n <= limit:
            return True
        if self._unread:
            self.settle(wait=False)
            if self._size + self._unread_ids() + n <= limit:
                return True
        if self._size + self._unread_ids() < limit / 2 or n > limit:
            return False
        self.settle()
        if self._size < limit / 2 or self._at_max():
            return self._size + n <= limit
        _refuse_if_set(bad_input)
        self._grow()
        return self._size + n <= self._defer_limit()

    def _defer_limit(self) -> float:
        """The most rows (the table's, the unread calls' ids and a call's) that a deferred
        call may reach: ``grow_at * capacity`` while the table may grow, and never more than
        ``max_capacity`` (a call past it would have to evict, or raise); at the final size
        (:func:`final_capacity`), ``max_capacity`` alone."""
        if self._at_max():
            return self.max_capacity
        limit = self.grow_at * self.capacity
        return limit if self.max_capacity is None else min(limit, self.max_capacity)

    def _room_in_capture(self, n: int) -> bool:
        """While a CUDA graph is captured (veloce.graphs): True when ``n`` more ids fit under
        ``grow_at`` with the deferred calls not read yet; else :class:`NeedsRoom` (the
        wrapper grows the table and captures again). A table that may evict or under
        deterministic algorithms cannot be captured (a deferred insert does neither)."""
        if torch.are_deterministic_algorithms_enabled():
            raise RuntimeError(
                "veloce: a training step cannot be captured in a CUDA graph under torch.use_deterministic_algorithms"
                "(True): a deferred CUDA insert races conflicting new ids instead of placing them in order"
            )
        # with the ids of this step's earlier inserts into the table (a table looked up twice)
        n += sum(k for log in _capture.ACTIVE.inserts for t, k in zip(log.tables, log.num_ids) if t is self)
        if self._size + self._unread_ids() + n > self._defer_limit():
            raise _capture.NeedsRoom(self, n)
        return True

    def has_deferred_room(self, n: int) -> bool:
        """Whether ``n`` more ids fit a deferred insert (under the growth threshold, counting
        the deferred calls not read yet at their bounds) without the table growing."""
        return self._size + self._unread_ids() + n <= self._defer_limit()

    def make_deferred_room(self, n: int) -> None:
        """Grows the table until ``n`` more ids fit a deferred insert (:meth:`has_deferred_room`).

        Raises:
            TableFullError: it cannot without evicting (it is at its final size, or ``n``
                would take it past ``max_capacity``); the table keeps the growth done.
        """
        bound = self.max_capacity
        while not self.has_deferred_room(n):
            if self._at_max() or (bound is not None and self._size + self._unread_ids() + n > bound):
                raise TableFullError(
                    f"a table of max_capacity {bound} ({self._size} rows) has no room for the {n} ids of a step "
                    f"without evicting"
                )
            self._grow()

    def add_deferred_counts(self, counts: DeferredCounts, row: int, num_ids: int) -> None:
        """Books a deferred insert of ``num_ids`` ids whose counts are row ``row`` of
        ``counts`` (read by :meth:`settle`): what a replayed CUDA graph's insert left."""
        self._unread.append((counts, row, num_ids))

    def bookkeeping(self) -> TableBookkeeping:
        """The host's bookkeeping of the table that a training step changes without touching
        the device: clock, evictions, the deferred calls not read yet."""
        return TableBookkeeping(self.clock, self.num_evicted, self.last_evicted, list(self._unread))

    def restore_bookkeeping(self, saved: TableBookkeeping) -> None:
        """Puts back what :meth:`bookkeeping` kept (after a step's Python ran without its
        kernels: a CUDA graph's capture)."""
        self.clock, self.num_evicted, self.last_evicted = saved.clock, saved.num_evicted, saved.last_evicted
        self._unread = list(saved.unread)

    def _unread_ids(self) -> int:
        """The ids of the deferred calls not read yet: an upper bound of what they inserted."""
        return sum(n for _, _, n in self._unread)

    def settle(self, wait: bool = True, refusals: bool = True) -> None:
        """Reads the counts of the deferred inserts not read yet, oldest first (all of
        them, waiting for the device; with ``wait=False`` those that arrived). Books what
        they inserted; a call refused for its ``bad_input`` raises here (its error, once;
        ``refusals=False``: forgotten, for a load that replaces the contents anyway); one
        that found no room warns and grows the table (see the class docstring)."""
        while self._unread:
            counts, row, _ = self._unread[0]
            if not counts.arrived(wait):
                return
            self._unread.pop(0)
            inserted, failed = counts.row(row)
            if failed == 0:
                self._size += inserted
            elif failed < 0:
                if refusals:
                    counts.refuse()  # raises, the first time for this call
            else:
                self._no_room_deferred(failed)

    def _no_room_deferred(self, failed: int) -> None:
        # A deferred call stays within max_capacity rows: it found a bucket pair full.
        target = self._more_slots() if self._at_max() else self._next_capacity()
        warnings.warn(
            f"veloce: a deferred insert found no room for {failed} new id(s) (size {self._size}, capacity "
            f"{self.capacity}): it changed nothing, so that step's lookups of this table read no rows and its "
            f"gradient here was dropped. The table grows to {target} slots now. Turn deferred inserts off "
            f"(DynamicEmbedding(defer_inserts=False)) for exact semantics.",
            RuntimeWarning, stacklevel=3,
        )  # fmt: skip
        self._rehash(target)
