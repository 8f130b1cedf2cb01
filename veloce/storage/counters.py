"""A tiered table's counts behind its ``stats()``: the cache's lookups of distinct ids,
and the rows fetched from and written back to the store, since the last reset and in the
last step."""

from __future__ import annotations

import torch

__all__ = ["TierCounters", "entry_bytes"]


def entry_bytes(dim: int, state_dim: int, dtype: torch.dtype, state_dtype: torch.dtype) -> int:
    """The bytes one entry moves between tiers: its row, optimizer state, key and score."""
    return dim * dtype.itemsize + state_dim * state_dtype.itemsize + 8 + 8


class TierCounters:
    """Counts of one tiered table (plain ints, bumped once per insert and per step)."""

    def __init__(self) -> None:
        self.reset()
        self.step_fetched = self.step_written_back = 0  # in the step under way
        self.last_fetched = self.last_written_back = 0  # in the last step

    def reset(self) -> None:
        """Restarts the counts since the last reset (the last step's stay)."""
        self.hits = self.misses = self.fetched = self.written_back = 0

    def lookup(self, hits: int, misses: int, fetched: int) -> None:
        """Books an insert's distinct ids: ``hits`` found in the cache, ``misses`` not (of
        which ``fetched`` came from the store, the others are new)."""
        self.hits += hits
        self.misses += misses
        self.fetched += fetched
        self.step_fetched += fetched

    def wrote_back(self, rows: int) -> None:
        """Books ``rows`` written back to the store."""
        self.written_back += rows
        self.step_written_back += rows

    def close_step(self) -> None:
        """The step under way becomes the last step."""
        self.last_fetched, self.last_written_back = self.step_fetched, self.step_written_back
        self.step_fetched = self.step_written_back = 0

    def as_dict(self, entry_bytes: int) -> dict[str, float]:
        """The counts as ``stats()`` keys; ``entry_bytes``: the bytes one entry moves (row,
        optimizer state, key, score)."""
        looked = self.hits + self.misses
        return {
            "hits": self.hits, "misses": self.misses, "hit_rate": self.hits / looked if looked else 0.0,
            "fetched": self.fetched, "written_back": self.written_back,
            "fetched_last_step": self.last_fetched, "written_back_last_step": self.last_written_back,
            "bytes_fetched": self.fetched * entry_bytes, "bytes_written_back": self.written_back * entry_bytes,
        }  # fmt: skip
