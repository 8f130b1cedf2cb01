"""Storage specs: where a :class:`veloce.DynamicEmbedding`'s rows and optimizer state live
(``DynamicEmbedding(..., storage=...)``). A spec holds its own arguments only and makes
the table: :meth:`StorageSpec.make_table` takes :class:`~veloce.table.HashTable`'s
arguments and returns a table that the layers above use through the row-store calls
alone, whatever its kind.

- :class:`Device`: every row in the table's buffers on its device (the default).
- :class:`HostCached`: the rows in host memory (:class:`~veloce.storage.host.HostStore`),
  the hot ones cached on the table's device (:class:`~veloce.storage.tiered.TieredTable`).

A spec for another tier subclasses :class:`HostCached` (the cache's arguments) and makes its
own :class:`~veloce.storage.base.BackingStore` (:meth:`HostCached.make_store`), as
:class:`veloce.storage.rocksdb.RocksDB` does. ``docs/storage.md`` says how to choose.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from veloce.eviction import resolve
from veloce.ops.hash_table import SCORE_LFU
from veloce.storage.base import BackingStore
from veloce.storage.host import HostStore
from veloce.storage.tiered import TieredTable
from veloce.table import FULL_LOAD, HashTable, state_dtype
from veloce.table.capacity import is_int

__all__ = ["Device", "HostCached", "StorageSpec", "cache_row_bytes"]

_POLICIES = ("lru", "lfu")


def cache_row_bytes(dim: int, state_dim: int, dtype: torch.dtype) -> float:
    """The device bytes one cached row takes: its row, optimizer state, key (8), score (8)
    and digest (1) per slot, at 1.25 slots a row (a full cache's load,
    :data:`veloce.table.FULL_LOAD`)."""
    return (dim * dtype.itemsize + state_dim * state_dtype(dtype).itemsize + 8 + 8 + 1) / FULL_LOAD


class StorageSpec:
    """Where a table's rows live: :meth:`make_table` makes the table (see the module docstring)."""

    def make_table(self, **hash_table_kwargs: Any) -> HashTable:
        """The table, from :class:`~veloce.table.HashTable`'s arguments (``dim``,
        ``state_dim``, ``capacity``, ``max_capacity``, ``eviction``, ``initializer``,
        ``seed``, ``dtype``, ``device``, ``init_state``)."""
        raise NotImplementedError

    @staticmethod
    def store_args(hash_table_kwargs: dict[str, Any]) -> dict[str, Any]:
        """A :class:`~veloce.storage.base.BackingStore`'s arguments for the table of
        ``hash_table_kwargs``: ``dim``, ``state_dim``, ``dtype``, ``state_dtype``, and
        ``max_capacity`` (the most rows of every tier)."""
        dtype = hash_table_kwargs.get("dtype", torch.float32)
        return {"dim": hash_table_kwargs["dim"], "state_dim": hash_table_kwargs["state_dim"], "dtype": dtype,
                "state_dtype": state_dtype(dtype), "max_capacity": hash_table_kwargs.get("max_capacity")}  # fmt: skip

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(vars(self).items()))))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if v is not None)
        return f"{type(self).__name__}({args})"


class Device(StorageSpec):
    """Every row and its optimizer state in the table's buffers, on the table's device."""

    def make_table(self, **hash_table_kwargs: Any) -> HashTable:
        return HashTable(**hash_table_kwargs)


class HostCached(StorageSpec):
    """Rows and optimizer state in host memory, the hot rows cached on the table's device
    (HBM over RAM on a GPU; on the CPU a RAM cache over RAM rows, the same logic).

    The cache brings a training batch's rows up before its insert and writes the coldest
    rows back when it needs room; it never evicts the rows of a lookup whose gradient
    waits for ``step()`` (nor those :meth:`veloce.DynamicEmbedding.prefetch` brought up).
    ``max_capacity`` bounds the rows of both tiers together; past it the table evicts by
    its ``eviction`` policy, the store's rows first.

    Args:
        cache_rows: the rows the cache holds; at least the distinct ids of the training
            lookups between two steps.
        cache_bytes: or the device memory the cache may take: ``cache_bytes //
            cache_row_bytes(...)`` rows (:func:`cache_row_bytes`: row, optimizer state, key,
            score and digest at 1.25 slots a row). Exactly one of the two.
        policy: which cached rows leave first: "lru" (least recently used) or "lfu"
            (least frequently used). They rank by the table's scores, so "lru" needs a
            table whose score is the last-seen step (``eviction`` "lru", "none" or a TTL)
            and "lfu" one with ``eviction="lfu"``; None (default): the table's.
        evict_fraction: the share of the cache written back at least when it needs room,
            so that a few batches find room without writing back again; in (0, 1].

    Raises:
        ValueError: neither or both of ``cache_rows`` / ``cache_bytes``, either not an int
            >= 1, an unknown ``policy``, or a bad ``evict_fraction``; at
            :meth:`make_table`, a ``policy`` that the table's scores cannot rank or a
            ``cache_bytes`` below one row.
    """

    def __init__(self, cache_rows: Optional[int] = None, cache_bytes: Optional[int] = None,
                 policy: Optional[str] = None, evict_fraction: float = 1 / 32) -> None:  # fmt: skip
        if (cache_rows is None) == (cache_bytes is None):
            raise ValueError(
                f"{type(self).__name__}: give exactly one of cache_rows (rows the cache holds) or cache_bytes (device memory "
                f"it may take), got cache_rows={cache_rows!r}, cache_bytes={cache_bytes!r}"
            )  # fmt: skip
        for name, value in (("cache_rows", cache_rows), ("cache_bytes", cache_bytes)):
            if value is not None and (not is_int(value) or value < 1):
                raise ValueError(f"{type(self).__name__}: {name} must be an int >= 1, got {value!r}")
        if policy is not None and policy not in _POLICIES:
            raise ValueError(f"{type(self).__name__}: policy must be 'lru', 'lfu' or None (the table's), got {policy!r}")
        if isinstance(evict_fraction, bool) or not isinstance(evict_fraction, (int, float)) or not 0 < evict_fraction <= 1:
            raise ValueError(f"{type(self).__name__}: evict_fraction must be a number in (0, 1], got {evict_fraction!r}")
        self.cache_rows = None if cache_rows is None else int(cache_rows)
        self.cache_bytes = None if cache_bytes is None else int(cache_bytes)
        self.policy = policy
        self.evict_fraction = float(evict_fraction)

    def rows_for(self, dim: int, state_dim: int, dtype: torch.dtype) -> int:
        """The cache's rows for a table of ``dim``, ``state_dim`` and ``dtype``.

        Raises:
            ValueError: ``cache_bytes`` holds less than one row.
        """
        if self.cache_rows is not None:
            return self.cache_rows
        per_row = cache_row_bytes(dim, state_dim, dtype)
        rows = math.floor(self.cache_bytes / per_row)
        if rows < 1:
            raise ValueError(f"{type(self).__name__}: cache_bytes={self.cache_bytes} holds no row of this table ({per_row:.0f} "
                             f"bytes a cached row); give at least that")  # fmt: skip
        return rows

    def make_table(self, **hash_table_kwargs: Any) -> HashTable:
        policy = resolve(hash_table_kwargs.get("eviction", "lru"))
        if self.policy == "lru" and not policy.last_seen_scores:
            raise ValueError(f"{type(self).__name__}(policy='lru') ranks cached rows by their last-seen step, but the table's "
                             f"eviction={policy!r} keeps use counts; use policy='lfu' or None")  # fmt: skip
        if self.policy == "lfu" and policy.score_policy != SCORE_LFU:
            raise ValueError(f"{type(self).__name__}(policy='lfu') ranks cached rows by use counts, but the table's "
                             f"eviction={policy!r} keeps last-seen steps; use eviction='lfu', or policy='lru' or None")  # fmt: skip
        args = self.store_args(hash_table_kwargs)
        rows = self.rows_for(args["dim"], args["state_dim"], args["dtype"])
        return TieredTable(self.make_store(args), rows, evict_fraction=self.evict_fraction, **hash_table_kwargs)

    def make_store(self, store_args: dict[str, Any]) -> BackingStore:
        """The tier below the cache, from :meth:`StorageSpec.store_args` (a subclass for
        another tier overrides this alone)."""
        return HostStore(**store_args)
