"""A table whose rows live in two tiers: a cache on the table's device (the
:class:`~veloce.table.HashTable` itself, bounded to ``cache_rows`` rows) above a
:class:`~veloce.storage.base.BackingStore` (host memory, RocksDB). Tiers are exclusive:
a row is in the cache or in the store, so the table holds the rows of both.

**A training insert.** Before the insert op runs (:meth:`TieredTable.prepare_insert`,
which :meth:`~veloce.table.HashTable.find_or_insert` and
:func:`~veloce.table.find_or_insert_many` call), the table finds the batch's distinct ids
in the cache, takes the missing ones from the store, and makes room: past
``max_capacity`` (rows of every tier) it evicts the store's lowest scores (loudly, counted
in ``num_evicted``; ``eviction="none"`` raises :class:`~veloce.table.TableFullError`);
when the cache lacks room it writes its lowest-scored unpinned rows back to the store, a
few percent of the cache at once (``evict_fraction``) so that the next batches find room.
Then the fetched entries go into the cache with their scores, and the op inserts the new
ids (initial values a function of ``(seed, id)``, as in any table) and scores every id.
The op itself never evicts. The rows move in bulk: one store call and, on CUDA, one
copy each way (:mod:`veloce.storage.transfer`); the host reads the device two or three
times per table per insert.

**Pinned rows.** The rows of every training lookup since the last sparse optimizer step,
and those of :meth:`TieredTable.prefetch`, stay in the cache: their pending gradients
find them by slot (or by id, after the cache's slots changed: a write-back erases, which
bumps ``version``). The ids are kept, not slots, and turned into a mask when victims are
chosen; the step engine releases them (:meth:`TieredTable.after_step`). If the pinned
rows and the batch do not fit, the insert raises before anything changes.

**Everything else** spans both tiers (:mod:`veloce.storage.both_tiers`): ``len()``,
``insert``, ``erase``, ``clear``, ``export`` / ``export_chunks`` (host tensors),
``load_entries``, ``snapshot`` / ``restore``, ``last_seen``, ``expire``, ``reserve``,
``stats()``. Inside, the cache's own insert and erase are ``HashTable.insert`` /
``HashTable._erase_ids`` called by name (``super()`` is the part over both tiers). ``find`` and the slots
it returns are the cache's; an evaluation lookup reads the store's rows of the other ids
through :meth:`TieredTable.rows_below`, changing nothing. A tiered table never defers its
inserts and cannot be captured in a CUDA graph (its inserts read the device back).
"""

from __future__ import annotations

import collections
import math
from typing import Any, NoReturn, Optional

import torch

from veloce.eviction import EvictionPolicy
from veloce.init import Initializer
from veloce.runtime import capture as _capture
from veloce.storage.base import BackingStore
from veloce.storage.both_tiers import BothTiers
from veloce.storage.counters import TierCounters, entry_bytes
from veloce.storage.transfer import PinnedStaging
from veloce.table import HashTable, TableFullError, final_capacity
from veloce.table.capacity import is_int

__all__ = ["TieredTable"]

_INT64_MAX = (1 << 63) - 1


class TieredTable(BothTiers, HashTable):
    """A hash table whose buffers cache the hot rows of a larger table kept in ``store``
    (see the module docstring). Made by :class:`veloce.storage.HostCached` (and the other
    storage specs); the arguments after ``cache_rows`` are :class:`~veloce.table.HashTable`'s.

    Args:
        store: the tier below the cache; its dims and dtypes must be the table's.
        cache_rows: the most rows the cache holds (at most ``max_capacity``).
        max_capacity: the most rows of every tier together; None: unbounded.
        evict_fraction: the share of ``cache_rows`` written back at least when the cache
            must make room (more when the batch needs more), in (0, 1].

    Raises:
        ValueError: bad ``cache_rows`` or ``evict_fraction``, or a store of other dims or
            dtypes than the table's.
    """

    def __init__(self, store: BackingStore, cache_rows: int, dim: int, state_dim: int, capacity: int = 1024,
                 max_capacity: Optional[int] = None, eviction: str | EvictionPolicy = "lru",
                 initializer: Initializer = Initializer(0), seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, grow_at: float = 0.9,
                 init_state: Optional[torch.Tensor] = None, evict_fraction: float = 1 / 32) -> None:  # fmt: skip
        if not is_int(cache_rows) or cache_rows < 1:
            raise ValueError(f"cache_rows must be an int >= 1 (rows the cache holds), got {cache_rows!r}")
        if isinstance(evict_fraction, bool) or not isinstance(evict_fraction, (int, float)) or not 0 < evict_fraction <= 1:
            raise ValueError(f"evict_fraction must be a number in (0, 1], got {evict_fraction!r}")
        if max_capacity is not None and (not is_int(max_capacity) or max_capacity < 1):
            raise ValueError(f"max_capacity must be an int >= 1 or None, got {max_capacity!r}")
        # a cache larger than the table holds it all
        cache_rows = int(cache_rows) if max_capacity is None else min(int(cache_rows), int(max_capacity))
        super().__init__(dim, state_dim, capacity=min(int(capacity), final_capacity(cache_rows)),
                         max_capacity=cache_rows, eviction=eviction, initializer=initializer, seed=seed, dtype=dtype,
                         device=device, grow_at=grow_at, init_state=init_state)  # fmt: skip
        self.max_capacity = None if max_capacity is None else int(max_capacity)  # every tier's rows
        mine = (self.dim, self.state_dim, self.dtype, self.state_dtype)
        theirs = (store.dim, store.state_dim, store.dtype, store.state_dtype)
        if mine != theirs:
            raise ValueError(f"store holds entries of (dim, state_dim, dtype, state_dtype) {theirs}, but the table's "
                             f"are {mine}; make the store for this table")  # fmt: skip
        self.store = store
        self.cache_rows = cache_rows
        self.evict_fraction = float(evict_fraction)
        self._pinned: list[torch.Tensor] = []  # distinct ids per training lookup / prefetch since the last step
        self.pin_steps = 0  # steps the rows stay pinned after their own (hold_pins)
        self._held: collections.deque[list[torch.Tensor]] = collections.deque()  # the last pin_steps steps' pins
        self.counters = TierCounters()
        self._no_ids = torch.empty(0, dtype=torch.long)
        self._tier_evicted = self._no_ids  # the ids the last insert's preparation evicted
        self._staging = PinnedStaging()

    _PLAIN_ATTRS = HashTable._PLAIN_ATTRS | {"_tier_evicted"}  # set on every training insert

    # ---- the cache: bounded to cache_rows, never evicting inside an op -------------------
    def _room(self) -> int:
        return max(0, self.cache_rows - self.size)

    def _allow_evict(self, evict: bool = True) -> bool:
        return False  # prepare_insert made room: an op never drops a row that is not written back

    def _no_room(self, failed: int, ids: torch.Tensor | None = None, padding_id: int | None = None,
                 evict: bool = True) -> None:  # fmt: skip
        super()._no_room(failed, ids, padding_id, evict=False)  # grows or takes more slots

    def _note_inserted(self, inserted: int, evicted: torch.Tensor) -> None:
        super()._note_inserted(inserted, evicted)  # (an op of this table evicts nothing)
        self.last_evicted = self._tier_evicted  # what the insert's preparation evicted

    def _deferrable(self, ids, bad_input=None) -> bool:
        self._refuse_capture()
        return False  # prepare_insert reads the device back anyway

    def _refuse_capture(self) -> None:
        if _capture.ACTIVE is not None:
            self._no_capture()

    def _no_capture(self) -> NoReturn:
        raise RuntimeError(
            f"veloce: a tiered table ({self.store!r} below a cache of {self.cache_rows} rows) cannot be captured "
            f"in a CUDA graph: its inserts move rows between tiers and read counts back to the host; train it "
            f"eagerly, or use storage=veloce.storage.Device()"
        )  # fmt: skip

    # What CUDAGraphStep asks of a table before and while it captures: refused.
    def state_addresses(self) -> tuple[int, ...]:
        self._no_capture()

    def has_deferred_room(self, n: int) -> bool:
        self._no_capture()

    def make_deferred_room(self, n: int) -> None:
        self._no_capture()

    def __len__(self) -> int:
        return self.size + len(self.store)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, cache_rows={self.cache_rows}, {self._size_text()} cached, store={self.store!r}, "
                f"max_capacity={self.max_capacity}, eviction={self.eviction_policy!r}, "
                f"initializer={self.initializer!r}")  # fmt: skip

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)
        if self.row_dtype != self.store.dtype:  # .half(), .double(), ...: the store's rows follow
            cast = getattr(self.store, "cast", None)
            if cast is None:
                raise TypeError(f"{self.store!r} cannot change the dtype of its rows; make the table in {self.row_dtype}")
            cast(self.row_dtype)
        return out

    # ---- bringing rows up before an insert -----------------------------------------------
    def prepare_insert(self, ids: torch.Tensor, padding_id: Optional[int] = None,
                       bad_input: Optional[torch.Tensor] = None) -> None:  # fmt: skip
        """Brings the rows of ``ids`` into the cache (fetching stored ones, writing cold
        ones back, evicting past ``max_capacity``) and pins them until :meth:`after_step`;
        see the module docstring. With ``bad_input`` set it does nothing: the insert refuses
        the call and changes nothing either.

        Raises:
            TableFullError: the pinned rows and the batch do not fit the cache, or new ids
                pass ``max_capacity`` with ``eviction="none"``; nothing changed.
        """
        self._refuse_capture()
        distinct = torch.unique(ids)
        slots = self.find(distinct)
        parts = (distinct, slots) if bad_input is None else (distinct, slots, bad_input.reshape(1).to(torch.long))
        host = torch.cat(parts).cpu()  # the batch and the flag read back at once
        if bad_input is not None and bool(host[-1]):
            return
        self._tier_evicted = self._no_ids
        self._pinned.append(distinct)
        try:
            self._bring_up(host[:distinct.numel()], host[distinct.numel():2 * distinct.numel()], distinct, padding_id)
        except BaseException:
            self._pinned.pop()
            raise

    def prefetch(self, ids: torch.Tensor, padding_id: Optional[int] = None) -> None:
        """Brings the rows of a coming training batch into the cache now and pins them until
        the next step (the batch's insert then finds them there): :meth:`prepare_insert`."""
        self.prepare_insert(ids, padding_id)

    def after_step(self) -> None:
        """Releases the pinned rows (the step queued their update; with :meth:`hold_pins`,
        those of the step ``pin_steps`` before) and closes the step's counts."""
        if self.pin_steps:
            self._held.append(self._pinned)
            self._pinned = []
            while len(self._held) > self.pin_steps:
                self._held.popleft()
        elif self._pinned:
            self._pinned.clear()
        self.counters.close_step()

    def hold_pins(self, steps: int) -> None:
        """Keeps each step's pinned rows ``steps`` steps more (``HybridParallel(sparse="async")``
        applies a step's gradients ``staleness`` steps later: their rows must still be cached).

        Raises:
            ValueError: ``steps`` is not an int >= 0.
        """
        if not is_int(steps) or steps < 0:
            raise ValueError(f"hold_pins: steps must be an int >= 0, got {steps!r}")
        self.pin_steps = int(steps)
        while len(self._held) > self.pin_steps:
            self._held.popleft()

    def _release_pins(self) -> None:
        """Forgets every pinned row (the contents were replaced)."""
        self._pinned = []
        self._held.clear()

    def _bring_up(self, ids: torch.Tensor, slots: torch.Tensor, distinct: torch.Tensor,
                  padding_id: Optional[int]) -> None:  # fmt: skip
        """Fetches the missing ones of the distinct ``ids`` (their cache ``slots`` beside
        them, both on the host; ``distinct``: the ids on the device) and makes room."""
        counted = ids != padding_id if padding_id is not None else torch.ones_like(ids, dtype=torch.bool)
        missing = ids[(slots < 0) & counted]
        hits = int(((slots >= 0) & counted).sum())
        fetched = None
        if missing.numel() and len(self.store):
            taken = self.store.take(missing)
            if bool(taken.found.any()):
                f = taken.found
                fetched = (missing[f], taken.scores[f], taken.optimizer_state[f], taken.weights[f])
        n_fetched = 0 if fetched is None else fetched[0].numel()
        n_new = missing.numel() - n_fetched
        try:
            self._make_room(n_fetched + n_new, n_new, True, distinct, n_fetched)
        except BaseException:
            if fetched is not None:  # back where they were: the table is unchanged
                self.store.put(fetched[0], fetched[3], fetched[2], fetched[1], fresh=True)
            raise
        if fetched is not None:
            ids_d, scores_d, state_d, rows_d = self._staging.to_device(fetched, self.device)  # one copy
            HashTable.insert(self, ids_d, rows_d, state_d.to(self.state_dtype), scores_d, evict=False)  # the cache's
        self.counters.lookup(hits, missing.numel(), n_fetched)

    def _make_room(self, coming: int, new: int, evict: bool, protect: torch.Tensor, in_flight: int = 0,
                   keep: Optional[torch.Tensor] = None) -> None:  # fmt: skip
        """Room for ``coming`` rows in the cache (``new`` of them new to the table, and
        ``in_flight`` taken from the store but not in the cache yet): evicts past
        ``max_capacity`` first, then writes cold rows back. ``protect``: ids (on the
        device) that stay in the cache besides the pinned ones; ``keep``: host ids that
        stay in the store (rows an insert assigns there)."""
        if self.max_capacity is not None:
            excess = self.size + len(self.store) + in_flight + new - self.max_capacity
            if excess > 0:
                self._evict(excess, new, evict, protect, keep)
        short = coming - (self.cache_rows - self.size)
        if short > 0:
            self._write_back(short, coming, protect)

    def _coldest(self, k: int, protect: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` lowest scores of the cache and their slots, ascending, pinned rows,
        ``protect`` and empty slots ranked last (at the int64 maximum)."""
        keys, digests, scores, _, _ = self._state()  # after the update in flight and the last change
        cap = keys.numel()
        held = [ids for step in self._held for ids in step]
        pinned = torch.cat([*self._pinned, *held, protect]) if self._pinned or held else protect
        at = self.find(pinned)
        mask = torch.zeros(cap + 1, dtype=torch.bool, device=at.device)
        mask[torch.where(at < 0, cap, at)] = True
        ranked = scores.masked_fill(mask[:cap] | (digests == 0), _INT64_MAX)
        return torch.topk(ranked, min(k, cap), largest=False, sorted=True)

    def _write_back(self, short: int, coming: int, protect: torch.Tensor) -> None:
        """Writes at least ``short`` unpinned rows of the lowest scores back to the store (a
        few percent of the cache at once), and erases them from the cache."""
        k = min(self.size, max(short, math.ceil(self.evict_fraction * self.cache_rows)))
        values, slots = self._coldest(k, protect)
        b = self._buffers
        ids = b["keys"][slots]
        ids_h, scores_h, state_h, rows_h, ok_h = self._staging.to_host(  # one copy, descending element sizes
            (ids, b["scores"][slots], b["opt_state"][slots], b["weights"][slots], values < _INT64_MAX)
        )  # fmt: skip
        n = int(ok_h.sum())  # the unpinned ones: a prefix (ascending)
        if n < short:
            pinned = self.size - n
            raise TableFullError(
                f"the cache of this tiered table (cache_rows={self.cache_rows}) cannot hold this step's rows: "
                f"{pinned} cached row(s) are pinned (looked up in training since the last step(), or prefetched: "
                f"their pending gradients must find them) and {coming} more must come in. Raise cache_rows to at "
                f"least {pinned + coming} (the distinct ids of the lookups between two steps), or step more often. "
                f"The table is unchanged."
            )  # fmt: skip
        self.store.put(ids_h[:n], rows_h[:n], state_h[:n], scores_h[:n], fresh=True)
        HashTable._erase_ids(self, ids[:n])  # the cache's, a move (no tombstone); bumps version: pending gradients re-resolve by id
        self.counters.wrote_back(n)

    def _evict(self, excess: int, new: int, evict: bool, protect: torch.Tensor,
               keep: Optional[torch.Tensor]) -> None:  # fmt: skip
        """Evicts ``excess`` rows of the lowest scores, the store's first (then the cache's
        unpinned ones), or raises :class:`TableFullError` when the table may not evict."""
        if not (evict and self.eviction_policy.evicts):
            how = "loading never evicts" if not evict else f"eviction={self.eviction!r}"
            held = self.max_capacity + excess - new  # (rows taken from the store for this call included)
            raise TableFullError(
                f"DynamicEmbedding table is full: it holds {held} rows of max_capacity {self.max_capacity} "
                f"(in every tier) and {new} new id(s) arrived, with {how}. Raise max_capacity, or set "
                f"eviction='lru' or 'lfu' to evict cold rows. The table is unchanged."
            )  # fmt: skip
        from_store = self.store.lowest(excess + (0 if keep is None else keep.numel()))
        if keep is not None and keep.numel():
            from_store = from_store[~torch.isin(from_store, keep)]
        from_store = from_store[:excess]
        left = excess - from_store.numel()
        gone = [from_store]
        if left > 0:  # the store holds too few: the cache's coldest unpinned rows go too
            values, slots = self._coldest(left, protect)
            if int((values < _INT64_MAX).sum()) < left:
                raise TableFullError(
                    f"DynamicEmbedding table cannot hold this batch: {new} new id(s) and max_capacity "
                    f"{self.max_capacity}, but only pinned rows (this step's) are left to evict. Raise max_capacity. "
                    f"The table is unchanged."
                )  # fmt: skip
            from_cache = self._buffers["keys"][slots]
            HashTable._erase_ids(self, from_cache)  # the cache's (the tombstones are booked below)
            gone.append(from_cache.cpu())
        if from_store.numel():
            self.store.erase(from_store)
        self.last_evicted = self._tier_evicted = torch.cat(gone)
        self.num_evicted += excess
        self._log_removed(self._tier_evicted)  # before the lookup's tick: stamped with its clock
        self._record_evicted(self._tier_evicted)  # the health telemetry's record (veloce.table.health)

    # ---- telemetry ------------------------------------------------------------------------
    def stats(self, reset: bool = False) -> dict[str, Any]:
        """The table's telemetry (``docs/storage.md``): rows of every tier and of each,
        the cache's lookups of distinct ids (``hits``, ``misses``, ``hit_rate``), rows and
        bytes fetched and written back (since the last ``reset``, and in the last step),
        evictions, and the store's own counts. ``reset`` restarts the counts."""
        out = super().stats()
        out.update({"cache_rows": self.size, "cache_capacity": self.cache_rows, "store_rows": len(self.store)})
        out.update(self.counters.as_dict(entry_bytes(self.dim, self.state_dim, self.dtype, self.state_dtype)))
        out.update(self.store.stats())
        if reset:
            self.counters.reset()
            reset_store = getattr(self.store, "reset_stats", None)  # a store that counts (CachedStore)
            if reset_store is not None:
                reset_store()
        return out
