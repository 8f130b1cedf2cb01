"""The host-memory tier: a :class:`~veloce.storage.base.BackingStore` over a CPU
:class:`~veloce.table.HashTable`, whose kernels give the batched find, insert, erase and
export of whole entries (row, optimizer state, score) the store's calls need.

The store never evicts by itself: the tiered table above it keeps the rows of every tier
within ``max_capacity`` and chooses the victims (:meth:`HostStore.lowest`), so a write
past its bound raises :class:`~veloce.table.TableFullError` rather than dropping a row.
Its tensors stay in pageable memory; a cache on CUDA moves entries through pinned
staging buffers of its own (:mod:`veloce.storage.tiered`), never pinning the whole store.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch

from veloce.storage.base import BackingStore, Entries
from veloce.table import HashTable
from veloce.table import state_dtype as _state_dtype_of

__all__ = ["HostStore"]

_INT64_MAX = (1 << 63) - 1


class HostStore(BackingStore):
    """Entries in host memory, in a CPU hash table (see the module docstring).

    Args:
        dim: row width D.
        state_dim: optimizer state width S per row.
        dtype: the rows' dtype.
        state_dtype: the optimizer state's dtype (the table's: float64 for float64 rows,
            else float32).
        max_capacity: the most entries it holds (a write past it raises
            :class:`~veloce.table.TableFullError`); None: unbounded.
        capacity: its initial slots (it grows as a table does).

    Raises:
        ValueError: ``state_dtype`` is not the one ``dtype`` calls for.
    """

    def __init__(self, dim: int, state_dim: int, dtype: torch.dtype, state_dtype: torch.dtype,
                 max_capacity: Optional[int] = None, capacity: int = 1024) -> None:  # fmt: skip
        super().__init__(dim, state_dim, dtype, state_dtype)
        want = _state_dtype_of(dtype)
        if state_dtype != want:
            raise ValueError(f"HostStore: state_dtype must be {want} for rows of {dtype}, got {state_dtype}")
        self.max_capacity = max_capacity
        self._capacity = int(capacity)
        self._table = self._new_table()

    def _new_table(self) -> HashTable:
        # eviction="none": the store never drops an entry by itself (see the module docstring)
        return HashTable(self.dim, self.state_dim, capacity=self._capacity, max_capacity=self.max_capacity,
                         eviction="none", dtype=self.dtype, device="cpu")  # fmt: skip

    def __len__(self) -> int:
        return len(self._table)

    def __repr__(self) -> str:
        return f"HostStore(rows={len(self)}, max_capacity={self.max_capacity})"

    def get(self, ids: torch.Tensor) -> Entries:
        t = self._table
        slots = t.find(ids)
        found = slots >= 0
        at = slots.clamp(min=0)
        return Entries(found, t.weights[at], t.opt_state[at], t.scores[at])

    def take(self, ids: torch.Tensor) -> Entries:
        entries = self.get(ids)
        if bool(entries.found.any()):
            self._table.erase(ids[entries.found])
        return entries

    def put(self, ids: torch.Tensor, weights: torch.Tensor, optimizer_state: torch.Tensor, scores: torch.Tensor,
            fresh: bool = False) -> None:  # fmt: skip
        if ids.numel():
            # insert_or_assign with every column given: the op either writes all or, with no
            # room, changes nothing and raises (evict=False)
            self._table.insert(ids, weights.to(self.dtype), optimizer_state.to(self.state_dtype), scores, evict=False)

    def erase(self, ids: torch.Tensor) -> int:
        return self._table.erase(ids) if ids.numel() else 0

    def lowest(self, n: int) -> torch.Tensor:
        t = self._table
        k = min(int(n), len(t))
        if k <= 0:
            return torch.empty(0, dtype=torch.long)
        ranked = t.scores.masked_fill(t.digests == 0, _INT64_MAX)  # empty slots last
        _, slots = torch.topk(ranked, k, largest=False, sorted=True)  # ascending: the coldest first
        return t.keys[slots]

    def chunks(self, rows: int) -> Iterator[dict[str, torch.Tensor]]:
        return self._table.export_chunks(rows)

    def clear(self) -> None:
        # A fresh table, not the old one emptied in place: a snapshot keeps the old one.
        self._table = self._new_table()

    def expire(self, before: int, rows: int = 1 << 20) -> int:
        return self._table.expire(int(before))

    def reserve(self, n: int) -> None:
        """Pre-sizes the store for ``n`` entries (:meth:`veloce.table.HashTable.reserve`)."""
        self._table.reserve(n)

    def cast(self, dtype: torch.dtype) -> None:
        """Converts the rows to ``dtype`` (and the optimizer state to the dtype it calls for)."""
        self._table.to(dtype)
        self.dtype, self.state_dtype = dtype, _state_dtype_of(dtype)

    def snapshot(self) -> Any:
        return self._table  # kept, not copied: clear() and loads replace it

    def restore(self, snapshot: Any) -> None:
        self._table = snapshot

    def stats(self) -> dict[str, float]:
        t = self._table
        held = sum(x.numel() * x.element_size() for x in (t.keys, t.digests, t.scores, t.weights, t.opt_state))
        return {"store_bytes": float(held), "store_capacity": float(self._table.capacity)}
