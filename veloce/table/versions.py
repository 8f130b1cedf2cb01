"""Row versions: which rows of a table changed after a given clock, and which ids left it.

A table's :attr:`~veloce.table.HashTable.clock` ticks once per training lookup, and under
the policies whose score is the last-seen step (``lru``, ``ttl``, ``none``) each row's
score is the clock of the last training lookup that held it. A row's values change only
through that lookup's sparse update, an insert or a load, so the score is the row's
version: the rows changed after clock ``c`` are those scored above ``c``. Nothing is
stored per row beyond the score every table keeps.

Removed ids (erased, evicted, expired; in every tier of a tiered table) leave no row
behind, so they are kept as tombstones ``(id, clock)`` in a bounded log beside the table
(:class:`RemovedLog`), from the moment :meth:`RowVersions.track_removed` starts it until
:meth:`RowVersions.forget_removed` drops them (once published). An eviction of a training
lookup is stamped with that lookup's clock; an erase or an expiry pass made outside a
lookup with the clock after the current one, so that an export at the current clock and
the next one both carry it (a tombstone sent twice removes nothing more).

What the versions cannot see, by construction:

- rows written by ``insert`` or a load take the current clock (or the scores given), so
  a row written between an export at clock ``c`` and the next training lookup is not
  "changed after ``c``": a full export carries it;
- a sparse update applied after the export of the clock of its lookup (gradients that
  arrive late, ``HybridParallel(sparse="async")``) is seen only when the row is looked up
  again: export after a synchronous step;
- ``clear()`` and loads do not list what they removed: they stop the log, and an export
  ``since`` an earlier clock raises until :meth:`RowVersions.track_removed` restarts it
  (after a full export).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["RemovedLog", "RowVersions", "VersionsUnavailable"]

#: The most tombstones a log keeps by default: 16 bytes each (id and clock).
DEFAULT_LIMIT = 1 << 20


class VersionsUnavailable(ValueError):
    """``export(since=c)`` cannot be answered exactly: the tombstones after ``c`` are not all
    known (the log was not started by ``c``, overflowed, or a clear or load stopped it).
    A full export, then ``track_removed()``, starts over."""


class RemovedLog:
    """Tombstones ``(id, clock)`` of one table, in the order they were removed, at most
    ``limit`` of them (the oldest go first, and the log is complete only after their clock).

    Args:
        start: the clock after which every removal is logged (None: the log is stopped).
        limit: the most tombstones kept.
    """

    def __init__(self, start: Optional[int] = None, limit: int = DEFAULT_LIMIT) -> None:
        self.start = start
        self.limit = int(limit)
        self._ids: list[torch.Tensor] = []
        self._clocks: list[int] = []
        self.count = 0

    def add(self, ids: torch.Tensor, clock: int) -> None:
        """Logs the removal of ``ids`` (on any device: moved to the host when read) at ``clock``."""
        if self.start is None or not ids.numel():
            return
        self._ids.append(ids.detach().reshape(-1))
        self._clocks.append(int(clock))
        self.count += ids.numel()
        while self.count > self.limit and self._ids:  # the oldest go; the log is complete after their clock
            self.count -= self._ids.pop(0).numel()
            self.start = max(self.start, self._clocks.pop(0))

    def since(self, clock: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The tombstones stamped after ``clock``: ``(ids, clocks)``, int64 host tensors."""
        parts = [(i.cpu(), c) for i, c in zip(self._ids, self._clocks) if c > clock]
        if not parts:
            empty = torch.empty(0, dtype=torch.long)
            return empty, empty.clone()
        ids = torch.cat([p[0] for p in parts])
        clocks = torch.cat([torch.full((p[0].numel(),), p[1], dtype=torch.long) for p in parts])
        return ids, clocks

    def forget(self, upto: int) -> None:
        """Drops the tombstones stamped at or before ``upto``."""
        keep = [k for k, c in enumerate(self._clocks) if c > upto]
        self._ids = [self._ids[k] for k in keep]
        self._clocks = [self._clocks[k] for k in keep]
        self.count = sum(i.numel() for i in self._ids)

    def stop(self) -> None:
        """Stops the log (a clear or a load removed ids it did not list)."""
        self.start = None
        self._ids, self._clocks, self.count = [], [], 0

    def nbytes(self) -> int:
        """Memory held by the tombstones (ids and clocks)."""
        return 16 * self.count


class RowVersions:
    """:class:`~veloce.table.HashTable`'s row versions (see the module docstring)."""

    removed_log: RemovedLog
    clock: int

    def track_removed(self, limit: Optional[int] = None) -> None:
        """Starts (or restarts) the tombstone log at the current clock: from here on,
        :meth:`changed_since` of this clock or a later one is exact.

        Args:
            limit: the most tombstones kept (16 bytes each; the oldest go first, and
                ``changed_since`` of a clock before theirs raises). None keeps the current
                limit (:data:`DEFAULT_LIMIT` at first).

        Raises:
            ValueError: ``limit`` is not an int >= 1.
        """
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"track_removed: limit must be an int >= 1 or None, got {limit!r}")
        old = self.__dict__.get("removed_log")
        keep = old.limit if old is not None else DEFAULT_LIMIT
        self.removed_log = RemovedLog(start=int(self.clock), limit=keep if limit is None else limit)

    def forget_removed(self, upto: int) -> None:
        """Drops the tombstones stamped at or before clock ``upto`` (once published)."""
        self._removed().forget(int(upto))

    def _removed(self) -> RemovedLog:
        log = self.__dict__.get("removed_log")
        if log is None:  # a table unpickled from before the log existed
            log = self.removed_log = RemovedLog()
        return log

    def _log_removed(self, ids: torch.Tensor, outside_lookup: bool = True) -> None:
        """Books the removal of ``ids``: at the clock after the current one when made outside
        a training lookup (an erase, a manual expiry), else at the lookup's clock."""
        log = self.__dict__.get("removed_log")
        if log is not None and log.start is not None and ids.numel():
            log.add(ids, self.clock + int(outside_lookup))

    def _stop_removed(self) -> None:
        """A clear or a load removed ids without listing them: the log stops."""
        log = self.__dict__.get("removed_log")
        if log is not None:
            log.stop()

    def tracks_removed(self) -> bool:
        """Whether the tombstone log runs (:meth:`track_removed` started it, and no clear or
        load stopped it since)."""
        log = self.__dict__.get("removed_log")
        return log is not None and log.start is not None

    def changed_since(self, since: int, values_only: bool = True) -> dict[str, torch.Tensor]:
        """The rows changed after clock ``since`` and the ids removed after it (see the
        module docstring): ``keys`` (N,), ``weights`` (N, D), ``scores`` (N,) (each row's
        version), ``optimizer_state`` (N, S) unless ``values_only``, ``removed`` (R,) and
        ``removed_at`` (R,) (the tombstones' clocks); host tensors.

        Raises:
            ValueError: ``since`` is not an int >= 0, or the policy's scores are not
                last-seen steps (``eviction="lfu"`` counts uses).
            VersionsUnavailable: the tombstones after ``since`` are not all known.
        """
        if isinstance(since, bool) or not isinstance(since, int) or since < 0:
            raise ValueError(f"export: since must be an int >= 0 (a table clock), got {since!r}")
        policy = self.eviction_policy  # type: ignore[attr-defined]
        if not policy.last_seen_scores:
            raise ValueError(
                f"export(since=...): this table's eviction={policy!r} keeps use counts in its scores, not the clock "
                f"of each row's last change; use eviction='lru', 'none' or veloce.eviction.TTL(steps=N), or export "
                f"whole (export())"
            )  # fmt: skip
        log = self._removed()
        if log.start is None or since < log.start:
            why = ("the tombstone log is not running (start it with track_removed(), after a full export; a clear "
                   "or a load stops it)" if log.start is None else
                   f"the tombstone log is complete only after clock {log.start}")  # fmt: skip
            raise VersionsUnavailable(f"export(since={since}): the ids removed after clock {since} are not all known: "
                                      f"{why}. Export whole instead")  # fmt: skip
        parts = [self._changed_slots(since, values_only), *self._changed_below(since, values_only)]
        if len(parts) == 1:  # no rows below the slots: the gathered tensors as they are, not copied
            out = dict(parts[0])
        else:
            out = {name: torch.cat([p[name] for p in parts]) for name in parts[0]}
        out["removed"], out["removed_at"] = log.since(since)
        return out

    def _changed_slots(self, since: int, values_only: bool) -> dict[str, torch.Tensor]:
        """The table's own rows scored above ``since``, as host tensors."""
        keys, digests, scores, weights, opt_state = self._state()  # type: ignore[attr-defined]
        idx = ((digests != 0) & (scores > since)).nonzero().squeeze(1)
        # index_select: a gather of whole rows, several times faster on the CPU than t[idx]
        out = {"keys": keys.index_select(0, idx).cpu(), "weights": weights.index_select(0, idx).cpu(),
               "scores": scores.index_select(0, idx).cpu()}  # fmt: skip
        if not values_only:
            out["optimizer_state"] = opt_state.index_select(0, idx).cpu()
        return out

    def _changed_below(self, since: int, values_only: bool) -> list[dict[str, torch.Tensor]]:
        """The rows below the table's own slots scored above ``since`` (none here; a tiered
        table scans its store)."""
        return []
