"""The RocksDB tier: a tiered table's entries in a RocksDB database on local disk.

- :class:`RocksDBStore`: a :class:`~veloce.storage.base.BackingStore` over one database
  (the handle of :mod:`veloce.ops.rocksdb`): every batch one sorted ``MultiGet`` or one
  atomic ``WriteBatch`` in C++, the exact entry count kept in the database beside the
  entries it counts.
- :class:`RocksDB`: the user's spec, ``DynamicEmbedding(storage=RocksDB(path, cache_rows=...))``:
  a cache in memory over a :class:`RocksDBStore`, or with ``ram_cache_rows`` over a RAM
  tier over it (:class:`~veloce.storage.chain.CachedStore`).

The database is one directory. Its layout (dim, state_dim, dtypes, format version) is
written when it is created and checked on every open; one process opens it at a time
(RocksDB's LOCK file). Every write is in the write-ahead log before it returns, so a
killed process loses nothing it wrote and a torn batch is dropped whole on reopening;
``sync=True`` (or :meth:`RocksDBStore.flush`) also survives a crash of the machine.
docs/storage.md ("RocksDB tier") gives the bytes per row on disk and what each fault does.
"""

from __future__ import annotations

import os
from typing import Any, Iterator, Optional

import torch

from veloce.ops import rocksdb as rocksdb_ops
from veloce.storage.base import BackingStore, Entries
from veloce.storage.chain import CachedStore
from veloce.storage.spec import HostCached, cache_row_bytes
from veloce.table import HashTable
from veloce.table import state_dtype as state_dtype_of


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


class RocksDB(HostCached):
    """Rows and optimizer state in a RocksDB database on local disk, the hot rows cached on
    the table's device above it (on the CPU a RAM cache; on a GPU an HBM cache), and with
    ``ram_cache_rows`` or ``ram_cache_bytes`` the warm rows in a RAM tier between the two
    (:class:`~veloce.storage.chain.CachedStore`: on a GPU, HBM over RAM over disk).

    Args:
        path: the database's directory (created if missing; its parent must exist). One
            table per path. In a process group of several ranks, each rank's table is
            in ``path/rank<R>`` (its shard, under ``veloce.HybridParallel``).
        cache_rows, cache_bytes, policy, evict_fraction: the cache's, as
            :class:`~veloce.storage.HostCached`'s (``evict_fraction`` is the RAM tier's too).
        ram_cache_rows: the rows the RAM tier holds between the cache and the database;
            None (and no ``ram_cache_bytes``): no RAM tier, the cache writes back to the
            database directly.
        ram_cache_bytes: or the host memory the RAM tier may take: ``ram_cache_bytes //
            cache_row_bytes(...)`` rows (a CPU hash table of the cache's layout). At most
            one of the two.
        block_cache_bytes: RocksDB's own cache of disk blocks in host memory (0: none).
        write_buffer_bytes: the memtable RocksDB fills before writing a file (>= 1 MiB).
        sync: fsync every batch written to the database (see :class:`RocksDBStore`).
        existing: what a database that already holds rows (an earlier run's) gives the
            table: ``"error"`` (default) refuses it, so that no run trains on rows it did
            not expect; ``"keep"`` starts the table with them (as a table that persists
            between runs); ``"clear"`` removes them first. A checkpoint load replaces them
            in any case, so a run resumed from a checkpoint may use ``"clear"``.

    Raises:
        ValueError: a bad argument (as :class:`~veloce.storage.HostCached`, or a path that
            is not a string, byte sizes out of range, both ``ram_cache_rows`` and
            ``ram_cache_bytes``, or either not an int >= 1); at :meth:`make_table`, a
            database holding rows with ``existing="error"``, or a ``ram_cache_bytes``
            below one row.
        ImportError: at :meth:`make_table`, ``veloce._rocksdb`` is not built (the message
            says how to build it).

    Example::

        emb = veloce.DynamicEmbedding(128, storage=veloce.storage.RocksDB("/data/emb", cache_rows=1 << 20))
        big = veloce.DynamicEmbedding(128, device="cuda", storage=veloce.storage.RocksDB(
            "/data/big", cache_bytes=20 << 30, ram_cache_bytes=200 << 30))  # HBM over RAM over disk
    """

    def __init__(self, path: str | os.PathLike, cache_rows: Optional[int] = None, cache_bytes: Optional[int] = None,
                 policy: Optional[str] = None, evict_fraction: float = 1 / 32, block_cache_bytes: int = 256 * _MiB,
                 write_buffer_bytes: int = 128 * _MiB, sync: bool = False, existing: str = "error",
                 ram_cache_rows: Optional[int] = None, ram_cache_bytes: Optional[int] = None) -> None:  # fmt: skip
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ValueError(f"RocksDB: path must be a directory path, got {path!r}")
        super().__init__(cache_rows, cache_bytes, policy, evict_fraction)
        for name, value, least in (("block_cache_bytes", block_cache_bytes, 0),
                                   ("write_buffer_bytes", write_buffer_bytes, _MiB)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"RocksDB: {name} must be an int >= {least}, got {value!r}")
        if not isinstance(sync, bool):
            raise ValueError(f"RocksDB: sync must be True or False, got {sync!r}")
        if existing not in ("error", "keep", "clear"):
            raise ValueError(f"RocksDB: existing must be 'error', 'keep' or 'clear', got {existing!r}")
        if ram_cache_rows is not None and ram_cache_bytes is not None:
            raise ValueError(f"RocksDB: give at most one of ram_cache_rows or ram_cache_bytes (the RAM tier's size), got "
                             f"ram_cache_rows={ram_cache_rows!r}, ram_cache_bytes={ram_cache_bytes!r}")  # fmt: skip
        for name, value in (("ram_cache_rows", ram_cache_rows), ("ram_cache_bytes", ram_cache_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"RocksDB: {name} must be an int >= 1 or None (no RAM tier), got {value!r}")
        self.path = os.fspath(path)
        self.block_cache_bytes = block_cache_bytes
        self.write_buffer_bytes = write_buffer_bytes
        self.sync = sync
        self.existing = existing
        self.ram_cache_rows = ram_cache_rows
        self.ram_cache_bytes = ram_cache_bytes

    def ram_rows_for(self, dim: int, state_dim: int, dtype: torch.dtype) -> Optional[int]:
        """The RAM tier's rows for a table of ``dim``, ``state_dim`` and ``dtype`` (None: no RAM tier).

        Raises:
            ValueError: ``ram_cache_bytes`` holds less than one row.
        """
        if self.ram_cache_bytes is None:
            return self.ram_cache_rows
        per_row = cache_row_bytes(dim, state_dim, dtype)  # a bounded CPU hash table: the cache's layout
        rows = int(self.ram_cache_bytes // per_row)
        if rows < 1:
            raise ValueError(f"RocksDB: ram_cache_bytes={self.ram_cache_bytes} holds no row of this table ({per_row:.0f} "
                             f"bytes a row in RAM); give at least that")  # fmt: skip
        return rows

    def make_table(self, **hash_table_kwargs: Any) -> HashTable:
        rocksdb_ops.require()  # first: without the extension, say how to build it
        return super().make_table(**hash_table_kwargs)

    def make_store(self, store_args: dict[str, Any]) -> BackingStore:
        """Opens the database for a table of ``store_args``' layout (``max_capacity`` is
        the tiered table's to keep), below a RAM tier when the spec has one."""
        # first: a bad size opens no database
        ram_rows = self.ram_rows_for(store_args["dim"], store_args["state_dim"], store_args["dtype"])
        path = self.path
        if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            path = os.path.join(path, f"rank{torch.distributed.get_rank()}")
            os.makedirs(self.path, exist_ok=True)
        store = RocksDBStore(path, store_args["dim"], store_args["state_dim"], store_args["dtype"],
                             store_args["state_dtype"], self.block_cache_bytes, self.write_buffer_bytes,
                             self.sync)  # fmt: skip
        held = len(store)
        if held and self.existing == "error":
            store.close()
            raise ValueError(
                f"RocksDB: the database at {path} already holds {held} rows (of an earlier run); pass "
                f"existing='keep' to train on them, existing='clear' to start empty (a checkpoint load replaces "
                f"them either way), or give a new path"
            )  # fmt: skip
        if held and self.existing == "clear":
            store.clear()
        return store if ram_rows is None else CachedStore(ram_rows, store, self.evict_fraction)


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
