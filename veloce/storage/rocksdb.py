"""The RocksDB tier: a tiered table's entries in a RocksDB database on local disk.

- :class:`RocksDBStore`: a :class:`~veloce.storage.base.BackingStore` over one database
  (the handle of :mod:`veloce.ops.rocksdb`): every batch one sorted ``MultiGet`` or one
  atomic ``WriteBatch`` in C++, the exact entry count kept in the database beside the
  entries it counts.
- :class:`RocksDB`: the user's spec, ``DynamicEmbedding(storage=RocksDB(path, cache_rows=...))``:
  a cache in memory over a :class:`RocksDBStore`.

The database is one directory. Its layout (dim, state_dim, dtypes, format version) is
written when it is created and checked on every open; one process opens it at a time
(RocksDB's LOCK file). Every write is in the write-ahead log before it returns, so a
killed process loses nothing it wrote and a torn batch is dropped whole on reopening;
``sync=True`` (or :meth:`RocksDBStore.flush`) also survives a crash of the machine.
docs/storage.md ("RocksDB tier") gives the bytes per row on disk and what each fault does.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterator, Optional

import torch

from veloce.ops import rocksdb as rocksdb_ops
from veloce.storage.base import BackingStore, Entries
from veloce.table import state_dtype as state_dtype_of

try:
    from veloce.storage.tiered import TieredTable
except ImportError:
    TieredTable = None

__all__ = ["RocksDB", "RocksDBStore"]

_MiB = 1 << 20


class RocksDBStore(BackingStore):
    """A tiered table's entries in the RocksDB database at ``path`` (created if missing).

    Args:
        path: the database's directory; its parent must exist.
        dim: row width D.
        state_dim: optimizer state width S per row.
        dtype: the rows' dtype (float32, float64, float16 or bfloat16).
        state_dtype: the optimizer state's dtype.
        block_cache_bytes: RocksDB's cache of disk blocks in host memory (0: none).
        write_buffer_bytes: the memtable RocksDB fills before writing a file.
        sync: fsync every batch (a batch then survives a crash of the machine, not only
            of the process), at the cost of one disk flush per batch.

    Raises:
        ImportError: ``veloce._rocksdb`` is not built (the message says how to build it).
        NotADirectoryError: ``path`` exists and is not a directory.
        FileNotFoundError: ``path``'s parent does not exist.
        ValueError: the database was written by another layout (both are named).
        RuntimeError: another process holds the database, or RocksDB cannot open it.

    Example::

        store = RocksDBStore("/data/emb0", dim=128, state_dim=256)
        store.put(ids, rows, state, scores)
        found, rows, state, scores = store.get(ids)
    """

    def __init__(self, path: str | os.PathLike, dim: int, state_dim: int, dtype: torch.dtype = torch.float32,
                 state_dtype: Optional[torch.dtype] = None, block_cache_bytes: int = 256 * _MiB,
                 write_buffer_bytes: int = 128 * _MiB, sync: bool = False) -> None:  # fmt: skip
        state_dtype = state_dtype_of(dtype) if state_dtype is None else state_dtype
        super().__init__(dim, state_dim, dtype, state_dtype)
        self.path = os.path.abspath(os.fspath(path))
        _check_path(self.path)
        self._handle: Optional[torch.ScriptObject] = rocksdb_ops.open_store(
            self.path, self.dim, self.state_dim, dtype, state_dtype, block_cache_bytes, write_buffer_bytes, sync
        )

    def __len__(self) -> int:
        return int(self._open().size())

    def get(self, ids: torch.Tensor) -> Entries:
        return Entries(*self._open().get(_flat(ids)))

    def take(self, ids: torch.Tensor) -> Entries:
        return Entries(*self._open().take(_flat(ids)))

    def put(self, ids: torch.Tensor, weights: torch.Tensor, optimizer_state: torch.Tensor, scores: torch.Tensor,
            fresh: bool = False) -> None:  # fmt: skip
        self._open().put(_flat(ids), weights, optimizer_state, scores, bool(fresh))

    def erase(self, ids: torch.Tensor) -> int:
        return int(self._open().erase(_flat(ids)))

    def lowest(self, n: int) -> torch.Tensor:
        return self._open().lowest(int(n))

    def chunks(self, rows: int) -> Iterator[dict[str, torch.Tensor]]:
        if int(rows) < 1:
            raise ValueError(f"rows must be >= 1, got {rows!r}")
        handle, after = self._open(), None
        while True:
            keys, weights, state, scores = handle.chunk(0 if after is None else after, after is not None, int(rows))
            if keys.numel() > 0:
                yield {"keys": keys, "weights": weights, "optimizer_state": state, "scores": scores}
            if keys.numel() < rows:
                return
            after = int(keys[-1])

    def clear(self) -> None:
        self._open().clear()

    def flush(self) -> None:
        self._open().flush()

    def compact(self) -> None:
        """Writes the memtable to disk and compacts every file, dropping deleted entries'
        space: the directory then holds the live entries only (a measurement, or before a copy)."""
        self._open().compact()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def stats(self) -> dict[str, float]:
        """``rocksdb_entries``, ``rocksdb_disk_bytes`` (table files), ``rocksdb_memtable_bytes``
        and ``rocksdb_block_cache_bytes`` (in use)."""
        return {f"rocksdb_{k}": float(v) for k, v in self._open().stats().items()}

    def __enter__(self) -> "RocksDBStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self) -> torch.ScriptObject:
        if self._handle is None:
            raise RuntimeError(f"the RocksDB store at {self.path} is closed; open a new RocksDBStore to use it")
        return self._handle


@dataclasses.dataclass(frozen=True)
class RocksDB:
    """Rows and optimizer state in a RocksDB database on local disk, the hot rows cached in
    memory (on the table's device) above it.

    Args:
        path: the database's directory (created if missing; its parent must exist). One
            table per path: a sharded table gives each rank its own.
        cache_rows: rows of the cache above the database, or
        cache_bytes: its size in bytes (rows, optimizer state, key, score and digest of
            each cached row); exactly one of the two.
        policy: the cache's eviction policy, ``"lru"`` or ``"lfu"``.
        block_cache_bytes: RocksDB's own cache of disk blocks in host memory.
        write_buffer_bytes: the memtable RocksDB fills before writing a file.
        sync: fsync every batch written to the database (see :class:`RocksDBStore`).

    Example::

        emb = veloce.DynamicEmbedding(128, storage=veloce.storage.RocksDB("/data/emb", cache_rows=1 << 20))
    """

    path: str
    cache_rows: Optional[int] = None
    cache_bytes: Optional[int] = None
    policy: str = "lru"
    block_cache_bytes: int = 256 * _MiB
    write_buffer_bytes: int = 128 * _MiB
    sync: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not os.fspath(self.path):
            raise ValueError(f"path must be a directory path, got {self.path!r}")
        if (self.cache_rows is None) == (self.cache_bytes is None):
            raise ValueError(f"give exactly one of cache_rows and cache_bytes, got cache_rows={self.cache_rows!r}, "
                             f"cache_bytes={self.cache_bytes!r}")  # fmt: skip
        for name in ("cache_rows", "cache_bytes", "block_cache_bytes", "write_buffer_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.cache_rows is not None and self.cache_rows < 1:
            raise ValueError(f"cache_rows must be >= 1, got {self.cache_rows!r}")
        if self.policy not in ("lru", "lfu"):
            raise ValueError(f"policy must be 'lru' or 'lfu', got {self.policy!r}")
        if self.write_buffer_bytes < _MiB:
            raise ValueError(f"write_buffer_bytes must be >= 1 MiB, got {self.write_buffer_bytes!r}")

    def rows_for(self, dim: int, state_dim: int, dtype: torch.dtype) -> int:
        """The cache's rows for a table of this layout (``cache_rows``, or what ``cache_bytes`` holds)."""
        if self.cache_rows is not None:
            return self.cache_rows
        per_row = _row_bytes(dim, state_dim, dtype)
        rows = self.cache_bytes // per_row
        if rows < 1:
            raise ValueError(f"cache_bytes={self.cache_bytes} holds no row of this table ({per_row} bytes per row)")
        return rows

    def make_store(self, dim: int, state_dim: int, dtype: torch.dtype = torch.float32) -> RocksDBStore:
        """Opens the database for a table of this layout."""
        return RocksDBStore(self.path, dim, state_dim, dtype, state_dtype_of(dtype), self.block_cache_bytes,
                            self.write_buffer_bytes, self.sync)  # fmt: skip

    def make_table(self, **hash_table_kwargs):
        """The tiered table: a cache of :meth:`rows_for` rows over :meth:`make_store`.

        Args:
            **hash_table_kwargs: the cache's :class:`~veloce.table.HashTable` arguments
                (``dim``, ``state_dim``, ``dtype``, ...).
        """
        rocksdb_ops.require()
        if TieredTable is None:
            raise ImportError("veloce.storage.tiered (the tiered table) is not available in this build of veloce")
        dim, state_dim = hash_table_kwargs["dim"], hash_table_kwargs["state_dim"]
        dtype = hash_table_kwargs.get("dtype", torch.float32)
        return TieredTable(store=self.make_store(dim, state_dim, dtype),
                           cache_rows=self.rows_for(dim, state_dim, dtype), policy=self.policy,
                           **hash_table_kwargs)  # fmt: skip


def _row_bytes(dim: int, state_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one cached row: the row, its optimizer state, key (8), score (8), digest (1)."""
    state = state_dtype_of(dtype)
    return dim * dtype.itemsize + state_dim * state.itemsize + 17


def _flat(ids: torch.Tensor) -> torch.Tensor:
    return ids.reshape(-1).contiguous() if ids.dim() != 1 or not ids.is_contiguous() else ids


def _check_path(path: str) -> None:
    """Clear errors for the paths RocksDB would reject with a terse IO error."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotADirectoryError(f"the RocksDB path {path} exists and is not a directory: give the database a "
                                 "directory of its own (it is created if missing)")  # fmt: skip
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"the RocksDB path {path} is in a directory that does not exist ({parent}): "
                                "create it first")  # fmt: skip
