"""Growth of a :class:`~veloce.table.HashTable`: doubling past ``grow_at``, rehashing,
``reserve`` and ``resize``, and what an insert that found no room does (grow, or raise
:class:`~veloce.table.TableFullError`)."""

from __future__ import annotations

import torch

from veloce.table.batch import _refuse_if_set
from veloce.ops import extension as _ext
from veloce.ops import hash_table as _ops
from veloce.table.capacity import FULL_LOAD, STATE_NAMES, TableFullError, is_int, slots_for, whole_buckets

__all__ = ["Growth"]


class Growth:
    """:class:`~veloce.table.HashTable`'s methods for growth."""

    def _at_max(self) -> bool:
        """Whether the slots reached the final size (:func:`final_capacity`): no more growth."""
        return self._final_capacity is not None and self.capacity >= self._final_capacity

    def _next_capacity(self) -> int:
        """The slots of the next growth step: twice the slots, at most the final size."""
        cap = self.capacity * 2
        return cap if self._final_capacity is None else min(cap, self._final_capacity)

    def _more_slots(self) -> int:
        """The slots for a table at its final size whose bucket pair overflowed before its rows
        reached max_capacity (two-choice placement; rare at :data:`FULL_LOAD`): an eighth
        more, at least a bucket. max_capacity bounds the rows, not the slots."""
        return self.capacity + whole_buckets(self.capacity // 8)

    def _grow(self) -> None:
        self._rehash(self._next_capacity())

    def _maybe_grow(self, bad_input: torch.Tensor | None = None) -> None:
        # Grow ahead of time when the table is already past grow_at; inserts that still
        # find no room trigger growth reactively (_no_room). A call refused for bad_input
        # must not grow either: read the flag first (growth reads the device back anyway).
        if self.size > self.grow_at * self.capacity and not self._at_max():
            _refuse_if_set(bad_input)
            self._grow()

    def _new_ids(self, ids: torch.Tensor, padding_id: int | None) -> int:
        """How many distinct ids of ``ids`` (but ``padding_id``) the table does not hold."""
        missing = ids[self.find(ids) < 0]
        if padding_id is not None:
            missing = missing[missing != padding_id]
        return int(missing.unique().numel())

    def _no_room(self, failed: int, ids: torch.Tensor | None = None, padding_id: int | None = None,
                 evict: bool = True) -> None:  # fmt: skip
        """After an insert of ``ids`` that found no room (and changed nothing): grows the
        table, or raises :class:`TableFullError`."""
        may_evict = evict and self.eviction_policy.evicts
        room = self._room()
        # Without eviction the call fails once its new ids pass the rows left (the ops'
        # room); else a bucket pair overflowed. Only a call of more ids than rows left can
        # be the former: count its new ids then.
        if not may_evict and room >= 0 and ids is not None and ids.numel() > room:
            new = self._new_ids(ids, padding_id)
            if new > room:
                if not self.eviction_policy.evicts:
                    raise TableFullError(
                        f"DynamicEmbedding table is full: it holds {self.size} rows of max_capacity "
                        f"{self.max_capacity} and {new} new id(s) arrived, with eviction='none'. Raise max_capacity, "
                        f"or set eviction='lru' or 'lfu' to evict cold rows. The table is unchanged."
                    )
                raise TableFullError(
                    f"DynamicEmbedding table is full: {new} new id(s) being loaded do not fit the {room} row(s) "
                    f"left of max_capacity {self.max_capacity} (size {self.size}); loading never evicts. Raise "
                    f"max_capacity. The table is unchanged."
                )
        if not self._at_max():
            self._grow()
            return
        if may_evict:  # each id past the room evicts: these found only rows the call touched
            raise TableFullError(
                f"DynamicEmbedding table cannot hold this batch: {failed} new id(s) found only rows touched by the "
                f"same batch to evict (size {self.size}, max_capacity {self.max_capacity}). The batch holds too "
                f"many distinct ids for max_capacity; raise max_capacity. The table is unchanged."
            )
        self._rehash(self._more_slots())

    def reserve(self, n: int) -> None:
        """Pre-sizes the table for ``n`` rows in one rehash, so that inserting up to ``n``
        rows never grows it (growing there from a small table rehashes every row at each
        doubling, at about twice the memory of the rows at the last one). The slots hold
        ``n`` rows at a load of ``min(grow_at, FULL_LOAD)`` at most, and at most the final
        size (:func:`final_capacity`); a table that has as many slots already is left as
        it is (reserve never shrinks).

        Raises:
            ValueError: ``n`` is not an int >= 0, or it is more than ``max_capacity``.
        """
        if not is_int(n) or n < 0:
            raise ValueError(f"reserve: n must be an int >= 0, got {n!r}")
        if self.max_capacity is not None and n > self.max_capacity:
            raise ValueError(
                f"reserve: n ({n}) is more than max_capacity ({self.max_capacity}), the most rows this table holds; "
                f"raise max_capacity or reserve at most {self.max_capacity}"
            )
        target = slots_for(n, min(self.grow_at, FULL_LOAD))
        if self._final_capacity is not None:
            target = min(target, self._final_capacity)
        if target > self.capacity:
            self._rehash(target)

    def resize(self, capacity: int) -> None:
        """Rehashes every entry into a table of ``capacity`` slots (rounded up to whole
        32-slot buckets; at most the final size :func:`final_capacity` of ``max_capacity``).
        Bumps :attr:`version`. A rehash whose two-choice placement overflows a bucket pair
        (rare) takes an eighth more slots and places them again. If memory runs out, it
        raises and the table is unchanged."""
        new_cap = whole_buckets(max(int(capacity), 1))
        if self._final_capacity is not None:
            new_cap = min(new_cap, max(self._final_capacity, self.capacity))
        self._rehash(new_cap)

    def _rehash(self, new_cap: int) -> None:
        """:meth:`resize` to ``new_cap`` slots (whole buckets), whatever max_capacity says."""
        _ext.require()
        entries = self._export_slots()  # the table's own slots (a tiered table's export adds its store)
        if entries["keys"].numel() > new_cap:
            raise ValueError(f"cannot resize to {new_cap} slots: the table holds {entries['keys'].numel()} entries")
        dtype, device = self.weights.dtype, self.device
        saved = {name: self._buffers[name] for name in STATE_NAMES}
        try:
            while True:
                self._allocate(new_cap, dtype, device)
                _, counts, _ = _ops.insert_or_assign(
                    *self._state(), entries["keys"], entries["weights"], entries["optimizer_state"],
                    entries["scores"], score_policy=0, score_value=0, allow_evict=False,
                )  # fmt: skip
                if int(counts[1]) == 0:
                    break
                # Two-choice placement overflowed a bucket pair: rare; use more slots.
                new_cap += whole_buckets(new_cap // 8)
        except BaseException:
            self._restore(saved)
            raise
        self.version += 1
        self._note_changed()

    def _restore(self, buffers: dict[str, torch.Tensor]) -> None:
        """Puts back the state buffers an allocation replaced (after a failed rehash or load)."""
        for name, t in buffers.items():
            self.register_buffer(name, t, persistent=False)
        self.row_dtype = self._buffers["weights"].dtype
        self._note_changed()  # work on them may be queued on the current stream since
