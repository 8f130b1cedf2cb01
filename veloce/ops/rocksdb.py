"""The RocksDB store's handle (``csrc/storage/rocksdb_store.cpp``): a
``torch.classes.veloce_rocksdb.Store`` from the optional extension ``veloce._rocksdb``.

The extension is separate from ``veloce._C`` and built only where RocksDB is installed,
so ``import veloce`` never needs RocksDB: :func:`require` raises an ImportError that says
how to get it when the RocksDB tier is asked for.

The handle's methods take and return CPU tensors (ids int64 (N,), rows (N, dim), state
(N, state_dim), scores int64 (N,)); each call is one batch in C++ (a sorted ``MultiGet``,
one atomic ``WriteBatch``) and runs without the GIL:

- ``size() -> int``: the number of entries (a count kept in the database).
- ``get(ids) / take(ids) -> (found, weights, state, scores)``: ids distinct; ``take``
  also removes the found ones. Rows of absent ids are zeros.
- ``put(ids, weights, state, scores, fresh)``: ``fresh`` skips the existence check that
  keeps the count exact (the caller promises that no id is held).
- ``erase(ids) -> int``: how many were held (duplicates counted once).
- ``lowest(n) -> ids``: the ``n`` lowest (score, id) pairs' ids, in that order.
- ``chunk(after, has_after, rows) -> (ids, weights, state, scores)``: at most ``rows``
  entries in id order, after the id ``after`` (from the first when ``has_after`` is false).
- ``clear()``, ``flush()`` (syncs the write-ahead log), ``compact()``, ``close()``,
  ``stats() -> dict``, ``layout() -> str``.
"""

from __future__ import annotations

import importlib

import torch

__all__ = ["available", "open_store", "require"]

_INSTALL = (
    "veloce's RocksDB tier needs the extension veloce._rocksdb, built where RocksDB is installed: "
    "install it (`apt-get install librocksdb-dev`, or set ROCKSDB_ROOT to a prefix with include/ and lib/), "
    "then rebuild veloce (`pip install --no-build-isolation -e .`; VELOCE_ROCKSDB=1 makes the build fail "
    "when RocksDB is not found instead of skipping the extension)."
)

_error: Exception | None = None
_loaded: bool | None = None  # None: not tried yet


def _load() -> bool:
    """Loads the extension on first use, so that ``import veloce`` never loads librocksdb."""
    global _loaded, _error
    if _loaded is None:
        try:
            importlib.import_module("veloce._rocksdb")
            _loaded = True
        except ImportError as exc:  # not built, librocksdb missing, or built against another torch
            _error = exc
            _loaded = False
    return _loaded


def available() -> bool:
    """True when ``veloce._rocksdb`` loads (the RocksDB tier can be used)."""
    return _load()


def require() -> None:
    """Raises an ImportError that says how to build ``veloce._rocksdb`` when it does not load."""
    if not _load():
        raise ImportError(f"{_INSTALL} (loading it failed with: {_error})")


def open_store(path: str, dim: int, state_dim: int, dtype: torch.dtype, state_dtype: torch.dtype,
               block_cache_bytes: int, write_buffer_bytes: int, sync: bool) -> torch.ScriptObject:  # fmt: skip
    """Opens (creating it if missing) the database at ``path`` for entries of this layout.

    Args:
        path: the database's directory (its parent must exist).
        dim: row width D.
        state_dim: optimizer state width S.
        dtype: the rows' dtype (float32, float64, float16 or bfloat16).
        state_dtype: the optimizer state's dtype.
        block_cache_bytes: RocksDB's block cache (0: none).
        write_buffer_bytes: the memtable size before a flush to disk.
        sync: fsync every write (else a write survives a crash of the process, and
            :meth:`flush` makes it survive a crash of the machine).

    Returns:
        The store's handle (methods in the module docstring).

    Raises:
        ImportError: the extension is not built.
        ValueError: the database holds another layout.
        RuntimeError: the database is locked by another process, or cannot be opened.
    """
    require()
    return torch.classes.veloce_rocksdb.Store(
        str(path), int(dim), int(state_dim), _dtype_name(dtype), _dtype_name(state_dtype), int(block_cache_bytes),
        int(write_buffer_bytes), bool(sync),
    )  # fmt: skip


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
