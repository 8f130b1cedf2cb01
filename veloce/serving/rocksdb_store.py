"""A serving store whose parts of rows are RocksDB databases (:class:`RocksDBStore`): the
same library as the RocksDB storage tier (``veloce._rocksdb``), so a reader looks rows up
by id (a batched ``MultiGet``) instead of loading a part whole.

Everything else is :class:`~veloce.serving.FileStore`'s: the manifests (commit markers),
the lease, and the other parts (dense state, a snapshot's changed ids) as safetensors
files. A part of rows is the database ``data/<version>/<part>.rocksdb`` with one entry
per id: its row and score 0, or a zero row and score -1 for a removed id.

A RocksDB database is opened by one process at a time: a reader process keeps the parts
it reads open, so one serving process reads a store (the publisher writes new versions
beside it, and opens no part a reader holds).
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Sequence

import torch

from veloce.ops import rocksdb as _rocksdb
from veloce.serving.store import FileStore

__all__ = ["RocksDBStore"]

_CHUNK = 1 << 16


class RocksDBStore(FileStore):
    """A serving store in a local directory with RocksDB databases for rows (see the
    module docstring).

    Args:
        path: the store's directory (created if missing).
        block_cache_bytes: each opened database's RocksDB block cache.

    Raises:
        ImportError: ``veloce._rocksdb`` is not built (RocksDB missing when veloce was built).
    """

    def __init__(self, path: str | os.PathLike, block_cache_bytes: int = 8 << 20) -> None:
        _rocksdb.require()
        super().__init__(path)
        self.block_cache_bytes = int(block_cache_bytes)
        self._dbs: dict[tuple[int, str], Any] = {}

    def __repr__(self) -> str:
        return f"RocksDBStore({self.path!r})"

    def _db_dir(self, version: int, part: str) -> str:
        return self._part_file(version, part)[: -len(".safetensors")] + ".rocksdb"

    def _open(self, version: int, part: str, dim: int, dtype: torch.dtype) -> Any:
        key = (int(version), part)
        db = self._dbs.get(key)
        if db is None:
            db = _rocksdb.open_store(self._db_dir(version, part), dim, 0, dtype, torch.float32, self.block_cache_bytes,
                                     16 << 20, False)  # fmt: skip
            self._dbs[key] = db
        return db

    def _layout(self, version: int, part: str) -> tuple[int, torch.dtype]:
        table = part.split("/")[1]
        meta = self.manifest(version)["tables"][table]
        return int(meta["dim"]), getattr(torch, meta["stored_dtype"])

    def write_part(self, version: int, part: str, tensors: dict[str, torch.Tensor]) -> None:
        if not part.startswith("t/"):
            return super().write_part(version, part, tensors)
        keys, weights, removed = tensors["keys"], tensors["weights"], tensors["removed"]
        path = self._db_dir(version, part)
        shutil.rmtree(path, ignore_errors=True)  # a part is written once, whole
        db = _rocksdb.open_store(path, weights.size(1), 0, weights.dtype, torch.float32, 0, 64 << 20, False)
        try:
            n = keys.numel()
            for s in range(0, n, _CHUNK):
                e = min(s + _CHUNK, n)
                db.put(keys[s:e], weights[s:e].contiguous(), torch.empty(e - s, 0), torch.zeros(e - s, dtype=torch.long),
                       True)  # fmt: skip
            if removed.numel():
                db.put(removed, weights.new_zeros(removed.numel(), weights.size(1)), torch.empty(removed.numel(), 0),
                       torch.full((removed.numel(),), -1, dtype=torch.long), True)  # fmt: skip
            db.flush()
        finally:
            db.close()

    def _opened(self, version: int, part: str) -> Any:
        if not os.path.isdir(self._db_dir(version, part)):
            raise self._part_missing(version, part)
        return self._open(version, part, *self._layout(version, part))

    def read_part(self, version: int, part: str) -> dict[str, torch.Tensor]:
        if not part.startswith("t/"):
            return super().read_part(version, part)
        db = self._opened(version, part)
        keys, rows, gone = [], [], []
        after, more = 0, False
        while True:
            ids, weights, _, scores = db.chunk(after, more, _CHUNK)
            if not ids.numel():
                break
            live = scores >= 0
            keys.append(ids[live])
            rows.append(weights[live])
            gone.append(ids[~live])
            after, more = int(ids[-1]), True
        dim, dtype = self._layout(version, part)
        no_ids = torch.empty(0, dtype=torch.long)
        return {"keys": torch.cat(keys) if keys else no_ids,
                "weights": torch.cat(rows) if rows else torch.empty(0, dim, dtype=dtype),
                "removed": torch.cat(gone) if gone else no_ids}  # fmt: skip

    def lookup(self, parts: Sequence[tuple[int, str]], ids: torch.Tensor
               ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:  # fmt: skip
        out = []
        for version, part in parts:
            found, weights, _, scores = self._opened(version, part).get(ids)
            out.append((found & (scores >= 0), weights, found & (scores < 0)))
        return out

    def delete(self, version: int) -> None:
        for key in [k for k in self._dbs if k[0] == int(version)]:
            self._dbs.pop(key).close()
        super().delete(version)

    def close(self) -> None:
        for db in self._dbs.values():
            db.close()
        self._dbs.clear()
