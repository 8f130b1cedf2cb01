"""The calls through which a table with rows below its cache (:mod:`veloce.storage`'s
tiered tables) takes part in lookups and steps: no-ops on a :class:`~veloce.table.HashTable`
whose rows all live in its own buffers, so that the layers above call them on every table
without asking which kind it is (one Python call each, no tensor work).

- ``prepare_insert(ids, padding_id, bad_input)``: before each training insert
  (:meth:`~veloce.table.HashTable.find_or_insert` and
  :func:`~veloce.table.find_or_insert_many` call it): a tiered table brings the batch's
  rows into its cache and makes room there, so that the insert neither misses a stored
  row nor evicts.
- ``after_step()``: once the sparse optimizer step queued the update of the table's
  pending gradient (:mod:`veloce.sparse.step`): the rows kept for it may leave the cache.
- ``hold_pins(steps)``: the rows stay that many steps more (gradients that arrive late:
  ``HybridParallel(sparse="async")``).
- ``prefetch(ids, padding_id)``: the rows of a coming training batch, brought up ahead of it.
- ``rows_below(ids, missing)``: an evaluation lookup's rows of ids the cache lacks.
- ``stats(reset)``: the table's telemetry, one dict (its health: :mod:`veloce.table.health`).
- ``export_chunks(rows)``: every entry in chunks (an export that never holds every row).
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch

__all__ = ["StoreHooks"]


class StoreHooks:
    """:class:`~veloce.table.HashTable`'s side of the tiered-table calls (see the module
    docstring): every row is in the table's buffers, so there is nothing to bring up,
    release or read below."""

    def prepare_insert(self, ids: torch.Tensor, padding_id: Optional[int] = None,
                       bad_input: Optional[torch.Tensor] = None) -> None:  # fmt: skip
        """Called before a training insert of ``ids``; a table whose rows all live in its
        buffers has nothing to prepare."""

    def after_step(self) -> None:
        """Called once a sparse optimizer step queued the update of the table's pending
        gradient; nothing is held for it here."""

    def hold_pins(self, steps: int) -> None:
        """Keeps the rows of a step's lookups close ``steps`` more steps (a sharded table
        whose gradients arrive ``staleness`` steps late); nothing is held here."""

    def prefetch(self, ids: torch.Tensor, padding_id: Optional[int] = None) -> None:
        """Brings the rows of a coming training batch of ``ids`` close; here they are
        already."""

    def rows_below(self, ids: torch.Tensor, missing: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The rows of ``ids[missing]`` held below the table's buffers, for an evaluation
        lookup (which changes nothing): ``(found, rows)``, each over ``ids[missing]``, or
        None when the table keeps no rows below its buffers (here)."""
        return None

    def stats(self, reset: bool = False) -> dict[str, Any]:
        """The table's telemetry: ``rows`` (``len``), ``capacity`` (slots), ``max_capacity``
        (None: unbounded), ``evicted`` (rows evicted at ``max_capacity`` since creation),
        ``evicted_last_lookup`` (by the latest training lookup: one lookup per step, the
        last step's), ``clock`` (training lookups), and the health keys of
        :mod:`veloce.table.health` (``evicted_within_n``, ``returned_within_n``,
        ``return_window``, ``oldest_row_age``, ``min_use_count``). ``reset`` clears the
        counters that count since the last reset (none here)."""
        out = {"rows": len(self), "capacity": self.capacity, "max_capacity": self.max_capacity,  # type: ignore[attr-defined]
               "evicted": self.num_evicted, "evicted_last_lookup": int(self.last_evicted.numel()),  # type: ignore[attr-defined]
               "clock": self.clock}  # type: ignore[attr-defined]  # fmt: skip
        out.update(self.health_stats())  # type: ignore[attr-defined]
        return out

    def export_chunks(self, rows: int = 1 << 20) -> Iterator[dict[str, torch.Tensor]]:
        """Every entry, in dicts of at most ``rows`` entries (``keys``, ``weights``,
        ``optimizer_state``, ``scores``; chunks of slots, so a chunk may hold fewer): what a
        checkpoint streams. The table must not change while the iterator is in use.

        Raises:
            ValueError: ``rows`` is not an int >= 1.
        """
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"export_chunks: rows must be an int >= 1, got {rows!r}")
        capacity = self.capacity  # type: ignore[attr-defined]
        for start in range(0, capacity, rows):
            chunk = self._export_slots(start, min(start + rows, capacity))  # type: ignore[attr-defined]
            if chunk["keys"].numel():
                yield chunk
