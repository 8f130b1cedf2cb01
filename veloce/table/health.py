"""A table's health in its ``stats()``: whether it is large enough for the ids it sees.

- ``evicted_within_n`` / ``returned_within_n``: of the ids evicted in the last
  :attr:`TableHealth.return_window` ticks of the table's clock (one tick per training
  lookup), how many are back in the table. A table that evicts ids it needs again soon
  is too small: many returns mean ``max_capacity`` (or ``cache_rows`` over a store that
  evicts) cuts into the working set. The evicted ids are kept in a fixed record of
  :attr:`TableHealth.evicted_record_slots` entries on the table's device (an id and its
  eviction clock, 16 bytes an entry, made on the first eviction): an eviction writes
  its ids there (two scatters, no host sync; evictions are read back to the host
  anyway), and ``stats()`` looks the recorded ids up. An id hashes to one entry, so
  when more ids are evicted within the window than the record holds, later evictions
  overwrite earlier ones and both counts are lower bounds. The record is telemetry: it
  is neither checkpointed nor restored.
- ``oldest_row_age``: the clock minus the lowest score, under the policies whose score
  is a row's last-seen step (lru, ttl, none): the ticks since the least recently used
  row was last looked up (a tiered table's rows of every tier). Under lfu the scores
  count uses: ``oldest_row_age`` is None and ``min_use_count`` is the fewest training
  lookups of any row (the next row lfu evicts).

Everything is computed in ``stats()`` (a few reductions and one read back); training
lookups do no work for it beyond an eviction's record.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["TableHealth", "RETURN_WINDOW", "RECORD_SLOTS"]

RETURN_WINDOW = 1000  # ticks (training lookups of the table)
RECORD_SLOTS = 1 << 16  # entries of the evicted-id record: 1 MiB on the table's device
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as an int64: Fibonacci hashing of ids
_INT64_MAX = (1 << 63) - 1


class TableHealth:
    """The health part of a :class:`~veloce.table.HashTable`'s ``stats()`` (see the module
    docstring). ``return_window`` and ``evicted_record_slots`` may be set per table (a
    power of two for the record; set before the first eviction)."""

    return_window: int = RETURN_WINDOW
    evicted_record_slots: int = RECORD_SLOTS
    # (ids, clocks) of recently evicted ids, on the table's device; None until the first eviction
    _evicted_record: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def _record_evicted(self, ids: torch.Tensor) -> None:
        """Writes ``ids``, evicted at the table's current clock, into the record."""
        device = self._buffers["keys"].device  # type: ignore[attr-defined]
        record = self._evicted_record
        if record is None or record[0].device != device:
            slots = self.evicted_record_slots
            if slots < 1 or slots & (slots - 1):
                raise ValueError(f"evicted_record_slots must be a power of two >= 1, got {slots!r}")
            record = (torch.zeros(slots, dtype=torch.long, device=device),
                      torch.full((slots,), -1, dtype=torch.long, device=device))  # fmt: skip
            object.__setattr__(self, "_evicted_record", record)
        ids = ids.to(device, torch.long)
        keys, clocks = record
        at = _entry(ids, keys.numel())
        keys[at] = ids
        clocks[at] = self.clock  # type: ignore[attr-defined]

    def health_stats(self) -> dict[str, Any]:
        """``evicted_within_n``, ``returned_within_n``, ``return_window``,
        ``oldest_row_age`` and ``min_use_count`` (see the module docstring)."""
        out: dict[str, Any] = {"return_window": int(self.return_window)}
        out["evicted_within_n"], out["returned_within_n"] = self._returns()
        low = self._lowest_score()
        if self.eviction_policy.last_seen_scores:  # type: ignore[attr-defined]
            out["oldest_row_age"] = None if low is None else max(0, self.clock - low)  # type: ignore[attr-defined]
            out["min_use_count"] = None
        else:
            out["oldest_row_age"] = None
            out["min_use_count"] = low
        return out

    def _returns(self) -> tuple[int, int]:
        """(ids of the record evicted within the window, those of them back in the table)."""
        record = self._evicted_record
        if record is None:
            return 0, 0
        device = self._buffers["keys"].device  # type: ignore[attr-defined]
        keys, clocks = (t.to(device) for t in record)  # (the table may be on another device than at the eviction: .to())
        recent = (clocks >= 0) & (clocks >= self.clock - int(self.return_window))  # type: ignore[attr-defined]
        ids = keys[recent]
        if not ids.numel():
            return 0, 0
        present = self.find(ids) >= 0  # type: ignore[attr-defined]
        below = self.rows_below(ids, ~present)  # type: ignore[attr-defined]  # a tiered table's store
        if below is not None:
            present = present.clone()
            present[~present] = below[0].to(present.device)
        return int(ids.numel()), int(present.sum())

    def _lowest_score(self) -> Optional[int]:
        """The lowest score of any row (a tiered table's store included), None when empty."""
        keys, digests, scores, _, _ = self._state()  # type: ignore[attr-defined]
        low = int(scores.masked_fill(digests == 0, _INT64_MAX).min()) if scores.numel() else _INT64_MAX
        store = getattr(self, "store", None)
        if store is not None and len(store):
            coldest = store.lowest(1)
            if coldest.numel():
                low = min(low, int(store.get(coldest).scores[0]))
        return None if low == _INT64_MAX else low


def _entry(ids: torch.Tensor, slots: int) -> torch.Tensor:
    """The record entry of each id (Fibonacci hashing: the top bits of id * golden ratio)."""
    bits = slots.bit_length() - 1
    if bits == 0:
        return torch.zeros_like(ids)
    return ((ids * _GOLDEN) >> (64 - bits)) & (slots - 1)
