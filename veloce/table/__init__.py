"""The hash table behind a :class:`veloce.DynamicEmbedding`: ids -> slots, where the rows
and their optimizer state live, growth and eviction.

- :class:`HashTable`: one table's state as tensors, its lookups, inserts and growth.
- :func:`find_or_insert_many`: one insert into several tables.
- :mod:`veloce.table.rows`: the row store (below).
- :mod:`veloce.table.capacity`: growth sizes and the final size of a bounded table.
- :mod:`veloce.eviction`: the eviction policies (a layer below the table).

**The row store.** Nothing above this package reads a table's tensors (``keys``,
``digests``, ``scores``, ``weights``, ``opt_state``); it holds slots and asks the table,
so that a store keeping its rows elsewhere (a host-memory cache, an SSD tier) plugs in
behind the same calls. What a table provides, by job:

- ids -> slots: ``find(ids)``, ``find_or_insert(ids, ...)`` (and
  :func:`find_or_insert_many`), ``version`` (bumped whenever a present id may change
  slot: holders of slots re-resolve them by id), ``ids_at(slots)``;
- reading rows at slots: ``rows(slots)`` (a gather), ``pooled(...)`` and ``max_pooled(...)``
  (the pooled lookup of bags), :func:`pooled_many` (several tables' lookups in one op
  call), ``psw_grad(...)`` (a lookup's per-sample weights' gradient);
- updating rows: ``update_target()``, an :class:`UpdateTarget` the step engine passes
  through to the fused update op, then ``track_update(fence)`` once the op is queued on
  the update stream; ``join_update()``;
- checkpoints: ``export()``, ``load_entries(entries)``, ``snapshot()`` / ``restore(s)``;
- a captured CUDA graph (:mod:`veloce.graphs`): ``state_addresses()`` (what the graph
  baked in), ``has_deferred_room(n)`` / ``make_deferred_room(n)``,
  ``add_deferred_counts(...)`` (a replay's inserts), ``bookkeeping()`` /
  ``restore_bookkeeping(b)``, ``forget_in_flight()``, ``hand_over_update(stream, origin)``.

Every read waits (on the device, no host sync) for the update in flight, and each call
hands the op the table's own tensors: no copy, and at most one Python call per table per
lookup or update.
"""

from veloce.table.batch import DeferredCounts, find_or_insert_many, insert_beside_updates
from veloce.table.capacity import (
    BUCKET_SIZE, FULL_LOAD, STATE_NAMES, TableFullError, final_capacity, is_int64, round_capacity, state_dtype,
)  # fmt: skip
from veloce.table.deferred import TableBookkeeping
from veloce.table.hash_table import HashTable
from veloce.table.rows import RowStore, UpdateTarget, pooled_many

__all__ = [
    "DeferredCounts", "HashTable", "RowStore", "TableBookkeeping", "TableFullError", "UpdateTarget", "BUCKET_SIZE",
    "FULL_LOAD", "STATE_NAMES", "find_or_insert_many", "final_capacity", "insert_beside_updates", "is_int64",
    "pooled_many", "round_capacity", "state_dtype",
]  # fmt: skip
