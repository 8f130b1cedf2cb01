"""A tiered table's calls over both of its tiers (:class:`BothTiers`, a part of
:class:`~veloce.storage.tiered.TieredTable`): reads of rows below the cache, writes,
erases, expiry, exports, loads and snapshots. The cache's part of each is
:class:`~veloce.table.HashTable`'s; the store's goes through the
:class:`~veloce.storage.base.BackingStore` calls, in batches."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Iterable, Iterator, NamedTuple, Optional

import torch

from veloce.ops.hash_table import SCORE_LFU, SCORE_LRU
from veloce.table import HashTable

if TYPE_CHECKING:
    from veloce.storage.base import BackingStore

__all__ = ["BothTiers", "TieredSnapshot"]

_CHUNK = 1 << 20


class TieredSnapshot(NamedTuple):
    """What :meth:`TieredTable.snapshot` keeps: the cache's snapshot and the store's."""

    cache: Any
    store: Any


class BothTiers:
    """:class:`~veloce.storage.tiered.TieredTable`'s calls over both tiers (see the module
    docstring); ``super()`` here is the cache, a :class:`~veloce.table.HashTable`."""

    store: "BackingStore"
    cache_rows: int

    # ---- reads -----------------------------------------------------------------------
    def rows_below(self, ids: torch.Tensor, missing: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The store's rows of ``ids[missing]`` (ids the cache lacks): ``(found, rows)`` on
        the table's device, read without moving them (an evaluation lookup changes
        nothing); None while the store is empty."""
        if not len(self.store):
            return None
        below = ids[missing]
        distinct, inverse = torch.unique(below, return_inverse=True)
        entries = self.store.get(distinct.cpu())
        dev = ids.device
        return entries.found.to(dev)[inverse], entries.weights.to(dev, self.dtype)[inverse]

    def last_seen(self, ids: torch.Tensor) -> torch.Tensor:
        out = super().last_seen(ids)
        missing = out < 0
        if len(self.store) and bool(missing.any()):
            distinct, inverse = torch.unique(ids[missing], return_inverse=True)
            e = self.store.get(distinct.cpu())
            seen = torch.where(e.found, e.scores, torch.full_like(e.scores, -1))
            out[missing] = seen.to(out.device)[inverse]
        return out

    # ---- writes over both tiers ---------------------------------------------------------
    def insert(self, ids: torch.Tensor, values: torch.Tensor, opt_values: Optional[torch.Tensor] = None,
               score_values: Optional[torch.Tensor] = None, evict: bool = True) -> torch.Tensor:  # fmt: skip
        """insert_or_assign over both tiers: rows in the cache are written there, the others
        in the store (new ones get the initial optimizer state and the policy's score, as
        the op gives them). Returns the cache's slots of ``ids``, -1 for rows in the store."""
        self._refuse_capture()
        n = ids.numel()
        bound = self.cache_rows if self.max_capacity is None else min(self.cache_rows, self.max_capacity)
        if not len(self.store) and self.size + n <= bound:
            return super().insert(ids, values, opt_values, score_values, evict)
        slots = self.find(ids)
        cached = slots >= 0
        parts = [(cached, True), (~cached, False)]
        for mask, in_cache in parts:
            idx = mask.nonzero().squeeze(1)
            if not idx.numel():
                continue
            opt = None if opt_values is None else opt_values[idx]
            sc = None if score_values is None else score_values[idx]
            if in_cache:  # present ids: assigned in place, nothing inserted
                super().insert(ids[idx], values[idx], opt, sc, evict=False)
            else:
                self._insert_below(ids[idx], values[idx], opt, sc, evict, ids)
        return self.find(ids)

    def _insert_below(self, ids: torch.Tensor, values: torch.Tensor, opt_values: Optional[torch.Tensor],
                      score_values: Optional[torch.Tensor], evict: bool, protect: torch.Tensor) -> None:  # fmt: skip
        """:meth:`insert` of ids the cache lacks, into the store (``protect``: the call's ids,
        which an eviction past ``max_capacity`` leaves in the cache)."""
        ids = ids.cpu()
        distinct, inverse = torch.unique(ids, return_inverse=True)
        # the last occurrence of each id wins, as insert_or_assign's
        last = torch.full((distinct.numel(),), -1, dtype=torch.long)
        last.scatter_reduce_(0, inverse, torch.arange(ids.numel()), "amax")
        uses = torch.bincount(inverse, minlength=distinct.numel())
        held = self.store.get(distinct)
        new = int((~held.found).sum())
        if new:
            self._make_room(0, new, evict, protect.to(self.device), keep=distinct[held.found])
        rows = values.cpu()[last]
        if opt_values is not None:
            state = opt_values.cpu()[last]
        else:
            init = torch.zeros(self.state_dim, dtype=self.state_dtype) if self.init_state is None else self.init_state
            state = torch.where(held.found.unsqueeze(1), held.optimizer_state, init.to(self.state_dtype))
        if score_values is not None:
            scores = score_values.cpu().long()[last]
        else:
            old = torch.where(held.found, held.scores, torch.zeros_like(held.scores))
            if self.score_policy == SCORE_LRU:
                scores = torch.full_like(old, self.clock)
            elif self.score_policy == SCORE_LFU:
                scores = old + uses
            else:
                scores = old
        self.store.put(distinct, rows.to(self.dtype), state, scores)

    def erase(self, ids: torch.Tensor) -> int:
        """Removes ``ids`` from both tiers; returns how many were present."""
        erased = super().erase(ids)  # (books the cache's tombstones)
        below = ids.cpu()
        if self.tracks_removed() and below.numel():
            distinct = below.unique()
            self._log_removed(distinct[self.store.get(distinct).found])
        return erased + self.store.erase(below)

    def clear(self) -> None:
        """Removes every entry of both tiers (keeps the capacity)."""
        super().clear()
        self.store.clear()
        self._release_pins()

    def expire(self, before: int) -> int:
        erased = super().expire(before)
        if self.tracks_removed():  # the store's stale ids, listed before it drops them
            for chunk in self.store.chunks(_CHUNK):
                self._log_removed(chunk["keys"][chunk["scores"] < before])
        below = self.store.expire(int(before))
        if below:
            self.num_expired += below
        return erased + below

    def reserve(self, n: int) -> None:
        """Pre-sizes the cache (up to ``cache_rows``) and the store, when it can, for ``n``
        rows in all.

        Raises:
            ValueError: ``n`` is not an int >= 0, or it is more than ``max_capacity``.
        """
        super().reserve(n)  # (checks n; the cache's slots stop at its final size)
        reserve = getattr(self.store, "reserve", None)
        if reserve is not None and n > self.cache_rows:
            reserve(n - self.cache_rows)

    def _changed_below(self, since: int, values_only: bool) -> list[dict[str, torch.Tensor]]:
        """The store's rows scored above ``since`` (a scan of its chunks)."""
        out = []
        for chunk in self.store.chunks(_CHUNK):
            keep = chunk["scores"] > since
            if bool(keep.any()):
                names = ("keys", "weights", "scores") if values_only else ("keys", "weights", "scores", "optimizer_state")
                out.append({name: chunk[name][keep] for name in names})
        return out

    # ---- export, load, snapshots --------------------------------------------------------
    def export(self, start: int = 0, end: Optional[int] = None) -> dict[str, torch.Tensor]:
        """Every entry of both tiers (keys, weights, optimizer_state, scores) as host
        tensors, the cache's first. :meth:`export_chunks` streams them instead.

        Raises:
            ValueError: ``start`` or ``end`` given (a tiered table exports whole).
        """
        if start != 0 or end is not None:
            raise ValueError("a tiered table exports every entry: call export() without start / end, or export_chunks()")
        parts = list(self.export_chunks(_CHUNK))
        if not parts:
            return {k: v.cpu() for k, v in self._export_slots().items()}
        return {name: torch.cat([p[name] for p in parts]) for name in parts[0]}

    def export_chunks(self, rows: int = _CHUNK) -> Iterator[dict[str, torch.Tensor]]:
        """Every entry of both tiers in dicts of at most ``rows`` entries, as host tensors:
        the cache's chunks, then the store's."""
        for chunk in super().export_chunks(rows):
            yield {k: v.cpu() for k, v in chunk.items()}
        yield from self.store.chunks(rows)

    def load_entries(self, entries: dict[str, torch.Tensor]) -> None:
        """Replaces the contents of both tiers with exported ``entries``: the highest scores
        fill the cache, the rest go to the store. Checks them first; a failure leaves the
        table as it was (the store's part where the store keeps snapshots)."""
        n = self._check_entries(entries)
        self.settle(refusals=False)
        keys, scores = entries["keys"], entries["scores"]
        order = torch.argsort(scores.long(), descending=True, stable=True)
        k = min(n, self.cache_rows)
        top, rest = order[:k], order[k:]
        saved = self.snapshot()
        self.store.clear()
        try:
            self._load_checked({name: entries[name][top] for name in ("keys", "weights", "optimizer_state", "scores")}, k)
            if rest.numel():
                self.store.put(keys[rest].cpu().long(), entries["weights"][rest].cpu().to(self.dtype),
                               entries["optimizer_state"][rest].cpu().to(self.state_dtype),
                               scores[rest].cpu().long(), fresh=True)  # fmt: skip
        except BaseException:
            self.restore(saved)
            raise
        self._release_pins()

    def load_chunks(self, chunks: Iterable[dict[str, torch.Tensor]]) -> int:
        """Replaces the contents of both tiers with exported entries given in ``chunks``
        (dicts as :meth:`export_chunks` yields them), holding one chunk at a time: each goes
        to the store, then the highest scores of all move up into the cache, as
        :meth:`load_entries` places them. Returns the rows loaded.

        Raises:
            ValueError: a chunk that :meth:`load_entries` would refuse, an id in more than
                one chunk, or more rows than ``max_capacity``; the table is then as it was
                (the store's part where the store keeps snapshots).
        """
        self.settle(refusals=False)
        saved = self.snapshot()
        self.store.clear()  # (the cache's buffers are replaced at the end, which keeps its snapshot)
        total = 0
        top_scores = torch.empty(0, dtype=torch.long)  # the highest scores so far, for the cache
        top_keys = torch.empty(0, dtype=torch.long)
        try:
            for chunk in chunks:
                n = self._check_entries(chunk)
                total += n
                if self.max_capacity is not None and total > self.max_capacity:
                    raise ValueError(f"the chunks hold more than max_capacity {self.max_capacity} entries (the most "
                                     f"rows of this table, in every tier)")  # fmt: skip
                keys, scores = chunk["keys"].cpu().long(), chunk["scores"].cpu().long()
                self.store.put(keys, chunk["weights"].cpu().to(self.dtype),
                               chunk["optimizer_state"].cpu().to(self.state_dtype), scores)  # fmt: skip
                if len(self.store) != total:
                    raise ValueError(f"an id appears in more than one chunk ({total - len(self.store)} repeated): "
                                     f"each id must appear once")  # fmt: skip
                top_scores, top_keys = torch.cat([top_scores, scores]), torch.cat([top_keys, keys])
                if top_keys.numel() > self.cache_rows:
                    top_scores, at = torch.topk(top_scores, self.cache_rows, sorted=False)
                    top_keys = top_keys[at]
            up = self.store.take(top_keys)
            none = {"keys": top_keys[:0], "weights": up.weights[:0], "optimizer_state": up.optimizer_state[:0],
                    "scores": up.scores[:0]}  # fmt: skip
            self._load_checked(none, 0)  # fresh cache buffers (the snapshot keeps the old ones)
            if top_keys.numel():
                dev = self.device
                HashTable.insert(self, top_keys.to(dev), up.weights.to(dev, self.dtype),
                                 up.optimizer_state.to(dev, self.state_dtype), up.scores.to(dev), evict=False)  # fmt: skip
        except BaseException:
            self.restore(saved)
            raise
        self._release_pins()
        return total

    def snapshot(self) -> TieredSnapshot:
        """The cache's snapshot and the store's (None where the store keeps none)."""
        return TieredSnapshot(super().snapshot(), self.store.snapshot())

    def restore(self, snapshot: TieredSnapshot) -> None:
        """Puts back what :meth:`snapshot` kept; a store that kept none keeps its rows, with a warning."""
        super().restore(snapshot.cache)
        if snapshot.store is not None:
            self.store.restore(snapshot.store)
        else:
            warnings.warn(f"veloce: {self.store!r} keeps no snapshots: its rows are not rolled back", RuntimeWarning,
                          stacklevel=2)  # fmt: skip
        self._release_pins()
