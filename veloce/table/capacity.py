"""Table layout and sizes: the state buffers, slots per bucket, the growth sizes, the final size of a bounded table, and
the checks of the integers that size, key and seed a table."""

from __future__ import annotations

import numbers
from fractions import Fraction
from typing import Any

import torch

__all__ = [
    "BUCKET_SIZE", "FULL_LOAD", "STATE_NAMES", "TableFullError", "final_capacity", "is_int", "is_int64", "round_capacity",
    "state_dtype",
]  # fmt: skip

STATE_NAMES = ("keys", "digests", "scores", "weights", "opt_state")  # the buffers, in the ops' order
BUCKET_SIZE = 32  # slots per bucket; csrc/include/veloce/hash.h kBucketSize
# The load of a table that holds max_capacity rows (its final size), and the most that
# reserve() plans for. Two-choice placement into 32-slot buckets first overflows a bucket
# near a load of 0.93 (0.96 in small tables): 0.8 leaves a wide margin, for 1.25 slots a row.
FULL_LOAD = 0.8


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The optimizer state's dtype for rows of ``dtype``: float64 for float64 rows, else
    float32 (16-bit rows keep their state in float32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32



class TableFullError(RuntimeError):
    """Raised when an insert cannot keep a table within ``max_capacity`` rows: new ids arrive
    at ``len == max_capacity`` with ``eviction="none"`` (or while loading, which never
    evicts), or a batch's new ids find only rows the batch itself touched to evict. The
    table is unchanged."""


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def is_int(value: Any) -> bool:
    """An integer (Python's, NumPy's, ...), and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_int64(value: Any) -> bool:
    """An integer (not a bool) that an int64 holds: what an id, a padding id or a seed may be."""
    return is_int(value) and _INT64_MIN <= value <= _INT64_MAX


def round_capacity(capacity: int) -> int:
    """The smallest growth size >= ``capacity``: a power-of-two number of 32-slot buckets
    (what a table starts at and doubles through; any whole number of buckets is valid)."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    buckets = 1
    while buckets * BUCKET_SIZE < capacity:
        buckets *= 2
    return buckets * BUCKET_SIZE


def whole_buckets(slots: int) -> int:
    """``slots`` rounded up to whole 32-slot buckets (at least one)."""
    return max(1, -(-int(slots) // BUCKET_SIZE)) * BUCKET_SIZE


def slots_for(rows: int, load: float) -> int:
    """Whole buckets that hold ``rows`` rows at ``load`` at most."""
    frac = Fraction(load).limit_denominator(1 << 20)  # 0.8 is 4/5: no float rounding at a bucket's edge
    return whole_buckets(-(-int(rows) * frac.denominator // frac.numerator))


def final_capacity(max_capacity: int) -> int:
    """The slots of a table bounded by ``max_capacity`` rows once it stops growing: whole
    buckets for ``max_capacity`` rows at load :data:`FULL_LOAD` (1.25 slots a row). Up to
    32 rows, one bucket: both choices of every key are that bucket, which fills to its last
    slot, and a new id may evict any row (in more buckets, a batch of new ids that nearly
    replaces a small table could find its candidates all touched)."""
    if max_capacity <= BUCKET_SIZE:
        return BUCKET_SIZE
    return slots_for(max_capacity, FULL_LOAD)
