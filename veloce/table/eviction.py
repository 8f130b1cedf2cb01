"""Eviction policies: what a new id does at ``len == max_capacity``, and how the hash-table
ops score rows for it (``csrc/include/veloce/hash.h``)."""

from __future__ import annotations

from veloce.ops.hash_table import SCORE_LFU, SCORE_LRU

__all__ = ["POLICIES", "score_policy"]

# name -> the ops' score policy. "none" raises TableFullError instead of evicting, and
# keeps LRU scores (informative only).
POLICIES: dict[str, int] = {"lru": SCORE_LRU, "lfu": SCORE_LFU, "none": SCORE_LRU}


def score_policy(eviction: str) -> int:
    """The ops' score policy of the eviction policy named ``eviction``.

    Raises:
        ValueError: ``eviction`` names no policy.
    """
    try:
        return POLICIES[eviction]
    except KeyError:
        raise ValueError(f"eviction must be 'lru', 'lfu' or 'none', got {eviction!r}") from None
