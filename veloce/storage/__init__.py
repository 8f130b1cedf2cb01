"""Where a :class:`veloce.DynamicEmbedding`'s rows live: on the table's device, or in
tiers (a cache on the device over host memory, or over a RocksDB database).

``DynamicEmbedding(..., storage=veloce.storage.HostCached(cache_rows=...))`` picks one;
``docs/storage.md`` says how to choose, what each tier costs per row and how to read
``emb.stats()``.

- :class:`Device`, :class:`HostCached`, :class:`RocksDB`: the storage specs (:class:`StorageSpec`).
- :class:`TieredTable`: a cache over a :class:`BackingStore`, behind the same row-store
  calls as :class:`veloce.table.HashTable` (:mod:`veloce.storage.tiered`).
- :class:`HostStore`: the host-memory tier; :class:`RocksDBStore`: the RocksDB tier
  (:mod:`veloce.storage.rocksdb`; its extension ``veloce._rocksdb`` is built where RocksDB
  is found, and only a table that uses it needs it); :class:`CachedStore`: a RAM tier over
  another store (:mod:`veloce.storage.chain`; ``RocksDB(..., ram_cache_rows=...)``).
"""

from veloce.storage.base import BackingStore, Entries
from veloce.storage.chain import CachedStore
from veloce.storage.host import HostStore
from veloce.storage.rocksdb import RocksDB, RocksDBStore
from veloce.storage.spec import Device, HostCached, StorageSpec, cache_row_bytes
from veloce.storage.tiered import TieredTable

__all__ = ["BackingStore", "CachedStore", "Device", "Entries", "HostCached", "HostStore", "RocksDB", "RocksDBStore",
           "StorageSpec", "TieredTable", "cache_row_bytes"]  # fmt: skip
