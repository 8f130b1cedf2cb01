"""A store that is itself a cache: a RAM tier (a CPU hash table bounded to ``ram_rows``)
over a lower :class:`~veloce.storage.base.BackingStore` (a RocksDB database). Below a
table's device cache it makes three tiers, HBM over RAM over disk on a GPU (on the CPU a
RAM cache over a RAM cache over disk: the same code).

Tiers stay exclusive, as between the device cache and its store: an entry is in RAM or in
the lower store, never both, so :meth:`CachedStore.__len__` is the sum of theirs.

- **Up.** :meth:`CachedStore.take` takes what RAM holds, then the rest from the lower store
  in one batched call: the device cache above fetches from both, and the rows leave the
  RAM tier (the cache above holds them).
- **Down.** :meth:`CachedStore.put` with ``fresh=True`` (the device cache writing back)
  puts the entries in RAM. When RAM lacks room it first writes its lowest-scored entries
  down to the lower store in one call, at least ``evict_fraction`` of ``ram_rows`` at once
  so that the next write-backs find room; a batch larger than RAM sends its own
  lowest-scored entries down in that same call.
- The rest (``get``, ``erase``, ``lowest``, ``chunks``, ``expire``, ``clear``) spans both
  tiers; :meth:`CachedStore.flush` makes the lower store durable and writes nothing down:
  the RAM tier's rows are in memory only, like the device cache's (a checkpoint carries
  every tier's rows).
"""

from __future__ import annotations

import math
from typing import Any, Iterator, NamedTuple, Optional

import torch

from veloce.storage.base import BackingStore, Entries
from veloce.storage.counters import entry_bytes
from veloce.storage.host import HostStore
from veloce.table import final_capacity
from veloce.table.capacity import is_int

__all__ = ["CachedStore"]


class _Snapshot(NamedTuple):
    ram: Any
    lower: Any


class CachedStore(BackingStore):
    """A RAM cache of at most ``ram_rows`` entries over the ``lower`` store (see the module
    docstring). Its dims and dtypes are the lower store's.

    Args:
        ram_rows: the most entries the RAM tier holds.
        lower: the store below it (it owns it: :meth:`close` closes it).
        evict_fraction: the share of ``ram_rows`` written down at least when RAM must make
            room, in (0, 1].

    Raises:
        ValueError: ``ram_rows`` is not an int >= 1, or a bad ``evict_fraction``.

    Example::

        store = CachedStore(1 << 20, RocksDBStore("/data/emb0", dim=128, state_dim=256))
        table = TieredTable(store, cache_rows=1 << 18, dim=128, state_dim=256)
    """

    def __init__(self, ram_rows: int, lower: BackingStore, evict_fraction: float = 1 / 32) -> None:
        if not is_int(ram_rows) or ram_rows < 1:
            raise ValueError(f"CachedStore: ram_rows must be an int >= 1 (entries the RAM tier holds), "
                             f"got {ram_rows!r}")  # fmt: skip
        if (isinstance(evict_fraction, bool) or not isinstance(evict_fraction, (int, float))
                or not 0 < evict_fraction <= 1):  # fmt: skip
            raise ValueError(f"CachedStore: evict_fraction must be a number in (0, 1], got {evict_fraction!r}")
        super().__init__(lower.dim, lower.state_dim, lower.dtype, lower.state_dtype)
        self.ram_rows = int(ram_rows)
        self.evict_fraction = float(evict_fraction)
        self.lower = lower
        # bounded to ram_rows as a guard: the writes below keep within it, so the bound never refuses
        self.ram = HostStore(self.dim, self.state_dim, self.dtype, self.state_dtype, max_capacity=self.ram_rows,
                             capacity=min(1024, final_capacity(self.ram_rows)))  # fmt: skip
        self._entry_bytes = entry_bytes(self.dim, self.state_dim, self.dtype, self.state_dtype)
        self.reset_stats()

    def reset_stats(self) -> None:
        """Restarts the counts of :meth:`stats` (a table's ``stats(reset=True)`` calls it)."""
        self.ram_hits = self.read_up = self.written_down = 0

    def __len__(self) -> int:
        return len(self.ram) + len(self.lower)

    def __repr__(self) -> str:
        return f"CachedStore(ram_rows={self.ram_rows}, ram={len(self.ram)}, lower={self.lower!r})"

    # ---- reads ------------------------------------------------------------------------
    def _both(self, ids: torch.Tensor, take: bool) -> tuple[Entries, int]:
        """The entries of ``ids`` from RAM, then the rest from the lower store in one call;
        and how many the lower store held."""
        ids = ids.reshape(-1)
        ram = self.ram.take(ids) if take else self.ram.get(ids)
        rest = (~ram.found).nonzero().squeeze(1)
        if not rest.numel() or not len(self.lower):
            return ram, 0
        low = self.lower.take(ids[rest]) if take else self.lower.get(ids[rest])
        found, weights, state, scores = (t.clone() for t in ram)
        found[rest], weights[rest], state[rest], scores[rest] = low.found, low.weights, low.optimizer_state, low.scores
        return Entries(found, weights, state, scores), int(low.found.sum())

    def get(self, ids: torch.Tensor) -> Entries:
        return self._both(ids, take=False)[0]

    def take(self, ids: torch.Tensor) -> Entries:
        entries, below = self._both(ids, take=True)
        self.ram_hits += int(entries.found.sum()) - below
        self.read_up += below
        return entries

    # ---- writes -----------------------------------------------------------------------
    def put(self, ids: torch.Tensor, weights: torch.Tensor, optimizer_state: torch.Tensor, scores: torch.Tensor,
            fresh: bool = False) -> None:  # fmt: skip
        """Writes entries (see :meth:`BackingStore.put`). ``fresh=True``: into RAM, writing
        its coldest entries down first when it lacks room. Otherwise the ids RAM holds are
        replaced there and the others written to the lower store (replaced or added)."""
        ids = ids.reshape(-1)
        if not ids.numel():
            return
        weights, optimizer_state = weights.to(self.dtype), optimizer_state.to(self.state_dtype)
        scores = scores.long()
        if not fresh:
            in_ram = self.ram.get(ids).found
            if not bool(in_ram.all()):  # first: a failure below leaves RAM as it was too
                out = ~in_ram
                self.lower.put(ids[out], weights[out], optimizer_state[out], scores[out])
            if bool(in_ram.any()):
                self.ram.put(ids[in_ram], weights[in_ram], optimizer_state[in_ram], scores[in_ram], fresh=True)
            return
        n = ids.numel()
        over = max(0, n - self.ram_rows)  # the batch's own coldest go straight down
        short = n - over - (self.ram_rows - len(self.ram))
        down = None
        if over:
            order = torch.argsort(scores, stable=True)
            down, keep = order[:over], order[over:]
        if short > 0 or over:
            least = math.ceil(self.evict_fraction * self.ram_rows)
            k = len(self.ram) if over else min(len(self.ram), max(short, least))
            victims = self.ram.lowest(k)
            old = self.ram.get(victims)
            parts = [(victims, old.weights, old.optimizer_state, old.scores)]
            if down is not None:
                parts.append((ids[down], weights[down], optimizer_state[down], scores[down]))
            cat = [torch.cat(column) for column in zip(*parts)]
            self.lower.put(*cat, fresh=True)  # one call; a failure here changed nothing
            self.ram.erase(victims)
            self.written_down += cat[0].numel()
            if down is not None:
                ids, weights, optimizer_state, scores = ids[keep], weights[keep], optimizer_state[keep], scores[keep]
        self.ram.put(ids, weights, optimizer_state, scores, fresh=True)

    def erase(self, ids: torch.Tensor) -> int:
        ids = ids.reshape(-1)
        erased = self.ram.erase(ids)
        return erased + (self.lower.erase(ids) if len(self.lower) and ids.numel() else 0)

    def lowest(self, n: int) -> torch.Tensor:
        """The ``n`` lowest-scored ids of both tiers: each tier's ``n`` lowest, merged."""
        ram = self.ram.lowest(n)
        low = self.lower.lowest(n) if len(self.lower) else ram[:0]
        if not low.numel():
            return ram
        if not ram.numel():
            return low
        ids = torch.cat([ram, low])
        scores = torch.cat([self.ram.get(ram).scores, self.lower.get(low).scores])
        order = torch.argsort(scores, stable=True)[:n]
        return ids[order]

    def chunks(self, rows: int) -> Iterator[dict[str, torch.Tensor]]:
        """RAM's entries, then the lower store's."""
        yield from self.ram.chunks(rows)
        yield from self.lower.chunks(rows)

    def clear(self) -> None:
        self.ram.clear()
        self.lower.clear()

    def expire(self, before: int, rows: int = 1 << 20) -> int:
        return self.ram.expire(before, rows) + self.lower.expire(before, rows)

    def reserve(self, n: int) -> None:
        """Pre-sizes RAM for ``min(n, ram_rows)`` entries (and the lower store, when it can, for the rest)."""
        self.ram.reserve(min(int(n), self.ram_rows))
        reserve = getattr(self.lower, "reserve", None)
        if reserve is not None and n > self.ram_rows:
            reserve(n - self.ram_rows)

    def cast(self, dtype: torch.dtype) -> None:
        """Converts the rows of both tiers to ``dtype`` (the lower store must be able to).

        Raises:
            TypeError: the lower store cannot change the dtype of its rows.
        """
        cast = getattr(self.lower, "cast", None)
        if cast is None:
            raise TypeError(f"{self.lower!r} cannot change the dtype of its rows; make the table in {self.dtype}")
        cast(dtype)
        self.ram.cast(dtype)
        self.dtype, self.state_dtype = self.ram.dtype, self.ram.state_dtype
        self._entry_bytes = entry_bytes(self.dim, self.state_dim, self.dtype, self.state_dtype)

    # ---- snapshots, durability, telemetry -----------------------------------------------
    def snapshot(self) -> Optional[_Snapshot]:
        """Both tiers' snapshots, or None when the lower store keeps none (then neither
        tier is rolled back: RAM alone would mix an old RAM with a newer lower store)."""
        lower = self.lower.snapshot()
        return None if lower is None else _Snapshot(self.ram.snapshot(), lower)

    def restore(self, snapshot: Any) -> None:
        self.ram.restore(snapshot.ram)
        self.lower.restore(snapshot.lower)

    def flush(self) -> None:
        """Makes the lower store's writes durable; RAM's entries stay in RAM."""
        self.lower.flush()

    def close(self) -> None:
        self.ram.clear()
        self.lower.close()

    def stats(self) -> dict[str, float]:
        """The RAM tier's counts since the store was made or :meth:`reset_stats`:
        ``ram_rows``, ``ram_capacity`` (``ram_rows`` of the spec), ``ram_bytes`` (its memory),
        ``ram_hits`` / ``read_up`` (entries taken from RAM / from the lower store),
        ``ram_hit_rate``, ``written_down`` and the bytes of both moves; then the lower
        store's own keys."""
        taken = self.ram_hits + self.read_up
        out = {
            "ram_rows": float(len(self.ram)), "ram_capacity": float(self.ram_rows),
            "ram_bytes": self.ram.stats()["store_bytes"], "ram_hits": float(self.ram_hits),
            "ram_hit_rate": self.ram_hits / taken if taken else 0.0,
            "read_up": float(self.read_up), "written_down": float(self.written_down),
            "bytes_read_up": float(self.read_up * self._entry_bytes),
            "bytes_written_down": float(self.written_down * self._entry_bytes),
        }  # fmt: skip
        out.update(self.lower.stats())
        return out
