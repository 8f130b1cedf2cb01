"""From training to serving: versioned exports of a model to a store, and the inference
model that reads them (``docs/serving.md``).

- :class:`Publisher`: writes a training model's versions (a full snapshot, then deltas of
  the rows changed and the ids removed, the dense state whole) behind one commit marker
  per version, under a lease, keeping the store bounded.
- Stores: :class:`FileStore` (safetensors files and JSON manifests in a directory),
  :class:`RedisStore` (Redis, through ``redis-py``; imported when made),
  :class:`RocksDBStore` (a directory whose rows are RocksDB databases, read by id).
- :class:`InferenceEmbedding`, :func:`inference_twin`, :func:`refresh`: the serving model.
- :class:`Publish`: the :class:`veloce.Trainer` callback that publishes every few steps.
"""

from veloce.serving.callback import Publish
from veloce.serving.inference import InferenceEmbedding, inference_twin, refresh
from veloce.serving.publisher import Publisher
from veloce.serving.redis_store import RedisStore
from veloce.serving.rocksdb_store import RocksDBStore
from veloce.serving.store import FileStore, LeaseHeld, ServingStore, VersionMissing

__all__ = ["FileStore", "InferenceEmbedding", "LeaseHeld", "Publish", "Publisher", "RedisStore", "RocksDBStore", "ServingStore", "VersionMissing",
           "inference_twin", "refresh"]  # fmt: skip
