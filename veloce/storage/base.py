"""The store below a table's cache: where the rows and optimizer state of a tiered table
live when they are not on the device (host memory, a RocksDB database).

A :class:`BackingStore` holds whole entries, each an id with its row, its optimizer state
and its score (the eviction policy's value: the last-seen step or a use count), and
works on batches of ids, never one id at a time. Tiers are exclusive: an id's entry is in
the cache or in the store below it, never both (:meth:`BackingStore.take` moves entries
up, :meth:`BackingStore.put` writes evicted ones back), so a table's size is the sum of
its tiers' sizes.

Every tensor crossing this interface is on the CPU: ids int64 (N,), rows (N, dim) in
``dtype``, optimizer state (N, state_dim) in ``state_dtype``, scores int64 (N,).
"""

from __future__ import annotations

import abc
from typing import Any, Iterator, NamedTuple

import torch

__all__ = ["BackingStore", "Entries"]


class Entries(NamedTuple):
    """Entries read from a store: ``found`` (N,) bool says which ids it held; the rows,
    state and scores of the others are unspecified."""

    found: torch.Tensor
    weights: torch.Tensor
    optimizer_state: torch.Tensor
    scores: torch.Tensor


class BackingStore(abc.ABC):
    """The entries of a tiered table below its cache (see the module docstring).

    Args:
        dim: row width D.
        state_dim: optimizer state width S per row.
        dtype: the rows' dtype.
        state_dtype: the optimizer state's dtype.
    """

    def __init__(self, dim: int, state_dim: int, dtype: torch.dtype, state_dtype: torch.dtype) -> None:
        self.dim = int(dim)
        self.state_dim = int(state_dim)
        self.dtype = dtype
        self.state_dtype = state_dtype

    @abc.abstractmethod
    def __len__(self) -> int:
        """The number of entries held, exactly."""

    @abc.abstractmethod
    def get(self, ids: torch.Tensor) -> Entries:
        """The entries of ``ids`` (distinct), left in the store."""

    @abc.abstractmethod
    def take(self, ids: torch.Tensor) -> Entries:
        """The entries of ``ids`` (distinct), removed from the store: what a cache fetches."""

    @abc.abstractmethod
    def put(self, ids: torch.Tensor, weights: torch.Tensor, optimizer_state: torch.Tensor, scores: torch.Tensor,
            fresh: bool = False) -> None:  # fmt: skip
        """Writes the entries of ``ids`` (distinct), replacing those held; all or none of
        them (a failure leaves the store as it was). ``fresh=True`` promises that none of
        ``ids`` is held (a cache writing back what it took), which spares a store the
        check that keeps its count exact."""

    @abc.abstractmethod
    def erase(self, ids: torch.Tensor) -> int:
        """Removes the entries of ``ids``; returns how many were held."""

    @abc.abstractmethod
    def lowest(self, n: int) -> torch.Tensor:
        """The ids of the ``n`` entries with the lowest scores (fewer if fewer are held):
        the victims when the last tier is full."""

    @abc.abstractmethod
    def chunks(self, rows: int) -> Iterator[dict[str, torch.Tensor]]:
        """Every entry, in dicts of at most ``rows`` entries each (``keys``, ``weights``,
        ``optimizer_state``, ``scores``): an export that never holds every row at once.
        The store must not change while the iterator is in use."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Removes every entry."""

    def expire(self, before: int, rows: int = 1 << 20) -> int:
        """Removes every entry scored below ``before`` (a time to live's expiry, under the
        policies whose score is the last-seen step); returns how many went. This one scans
        :meth:`chunks` of ``rows`` entries, then erases what it found; a store that can
        do it in place overrides it."""
        stale = [c["keys"][c["scores"] < before] for c in self.chunks(rows)]
        stale = [k for k in stale if k.numel()]
        return self.erase(torch.cat(stale)) if stale else 0

    def snapshot(self) -> Any:
        """What :meth:`restore` puts back after a failed load of the table above (a
        checkpoint load rolled back), or None when this store cannot keep one (a load
        into it is then not undone)."""
        return None

    def restore(self, snapshot: Any) -> None:
        """Puts back the contents a :meth:`snapshot` kept."""
        raise NotImplementedError(f"{type(self).__name__} keeps no snapshots (its snapshot() returns None)")

    def flush(self) -> None:
        """Makes every write so far durable (a store in memory has nothing to do)."""

    def close(self) -> None:
        """Releases the store's resources (files, locks); it is not used afterwards."""

    def stats(self) -> dict[str, float]:
        """The store's own telemetry (bytes held, ...), merged into the table's ``stats()``."""
        return {}
