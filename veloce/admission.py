"""Feature admission of a :class:`veloce.table.HashTable`: which new ids earn a row of their own.

Without admission every id a training lookup sees gets a row. With a policy, an absent id
whose lookup the policy refuses gets no row: it reads the table's *default row*, one
``(1, D)`` row per table (initialized by the table's initializer for the reserved seed
:data:`DEFAULT_ROW_SEED`, with the optimizer's initial state) that the gradients of the
refused ids train, in training and in eval (an unknown id reads it instead of the
initializer's value). ``find()`` reports such ids as absent.

- :class:`NoAdmission` (the default): every id gets a row.
- :class:`Frequency` (``Frequency(min_count=k)``): an id gets its row on its k-th sighting.
- :class:`Probability` (``Probability(p)``): each sighting admits with probability ``p``,
  deterministic per (seed, id, sighting number).

**Sightings.** A sighting is one occurrence of an id in a training lookup: an id repeated
in one batch counts once per occurrence. Prefetches (``DynamicEmbedding.prefetch``) do not
count (the training lookup that follows counts the batch), evaluation lookups never count,
and a lookup of a frozen table is no training lookup. Counts are never reset: an evicted or
erased id keeps its count, so it comes back on its next sighting.

**The sketch.** Counts live in a count-min sketch of ``depth x width`` int32 counters
(``4 * depth * width`` bytes per table, kept on the table's device): each id adds its
sightings to one counter per row (a hash of the id and the row picks it), and its estimate
is the minimum of its ``depth`` counters. The estimate never undercounts; collisions only
add: with ``N`` sightings in all, an id's estimate exceeds its true count by at most
``e / width * N`` with probability at least ``1 - e^-depth`` (Cormode and Muthukrishnan,
2005). A too-high estimate admits an id early (a false admission); it never refuses one
that earned its row. Counters saturate at :data:`COUNT_LIMIT` (never overflow).

**Shards and world sizes.** On a table sharded by :class:`veloce.distributed.HybridParallel`
the owner of an id decides: its shard's sketch counts every occurrence the ranks' lookups
send it (with ``dedup=True`` each distinct id travels once with its number of
occurrences), so the k-th sighting inserts whichever ranks the sightings come from. A
shard's sketch counts only its own ids: it has fewer collisions than one process's sketch
of the same shape, so the admissions are those of one process except where that
process's sketch overcounted (an id admitted early there is admitted at its k-th sighting
here). The default row is one row for the whole table: every rank keeps a replica (the
owners serve it for the ids they refuse), and each step sums its gradient over the ranks
before applying it, so the replicas stay identical (:mod:`veloce.sparse.default_row`).
The admission telemetry of ``stats()`` is per shard (each owner books the sightings it
counted; the shards' counts add up to one process's). A checkpoint keeps each saved
shard's sketch; a load sums them: counts of disjoint id sets add, and two ids of
different shards that share a counter add there exactly as they would in one sketch of
the whole table, so the sum is that sketch (the same admissions after the load, whatever
the world size). Every shard then holds the loaded sketch, and ranks other than 0 save
only what they count themselves after it (``HashTable.own_sketch``), so a later sum
counts each sighting once. The default row is rank 0's, and every rank loads it.

The decision runs on the table's device: one fused op, ``veloce::sketch_admit``
(``docs/ops.md``), adds the batch's sightings to the counters, reads each id's minimum and
decides (:meth:`AdmissionPolicy.fused_rule`), with no host sync; ``veloce::admission_tally``
books the insert's outcome in the telemetry in one more pass. The counters are saved with the table (``state_dict``, ``veloce.checkpoint``).
"""

from __future__ import annotations

import math
import numbers
from typing import ClassVar, Optional, Union

import torch

from veloce.ops.sketch import sketch_count

__all__ = [
    "COUNT_LIMIT",
    "DEFAULT_ROW_SEED",
    "DEFAULT_WIDTH",
    "AdmissionPolicy",
    "Frequency",
    "NoAdmission",
    "Probability",
    "count_sightings",
    "resolve",
    "sketch_slots",
]  # fmt: skip

#: The default sketch width: with the default depth 4, 4 MiB of counters per table.
DEFAULT_WIDTH = 1 << 18
#: Where a sketch counter saturates. A batch adds fewer than 2^31 - COUNT_LIMIT sightings
#: to a counter (ids are fewer than 2^30 per lookup), so an int32 counter never overflows.
COUNT_LIMIT = (1 << 30) - 1
#: The seed for which the table's initializer makes the default row's initial value.
DEFAULT_ROW_SEED = 0x5EED_DEFA
#: The id whose initial row (for :data:`DEFAULT_ROW_SEED`) is the default row's.
DEFAULT_ROW_ID = 0

_MAX_IDS = 1 << 30


def _signed(x: int) -> int:
    """An unsigned 64-bit constant as the int64 torch holds it."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` by ``k`` (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer over int64 ``x`` (wrapping int64 arithmetic): a bijection
    that spreads nearby ids over all 64 bits."""
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def _splitmix_int(x: int) -> int:
    """:func:`_splitmix` of one Python int (the per-row salts)."""
    z = (x + 0x9E3779B97F4A7C15) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return _signed(z ^ (z >> 31))


def sketch_slots(ids: torch.Tensor, depth: int, width: int, seed: int) -> torch.Tensor:
    """The counter of each id in each sketch row, as flat indices into the ``(depth,
    width)`` counters: ``(depth, N)`` int64, row ``d`` in ``[d * width, (d + 1) * width)``.

    Args:
        ids: (N,) int64 ids.
        depth, width: the sketch's shape.
        seed: the sketch's seed (each row's hash is salted by it and the row number).
    """
    rows = []
    for d in range(depth):
        h = _splitmix(ids ^ _splitmix_int(seed * 1_000_003 + d))
        rows.append((h & ((1 << 63) - 1)) % width + d * width)
    return torch.stack(rows) if rows else ids.new_empty(0, ids.numel())


def count_sightings(counters: torch.Tensor, ids: torch.Tensor, seed: int, counted: Optional[torch.Tensor] = None,
                    sightings: Optional[torch.Tensor] = None) -> torch.Tensor:  # fmt: skip
    """Adds one sighting per position of ``ids`` (``sightings[i]`` at position ``i`` when
    given) to the sketch ``counters`` (in place) and returns each position's estimate
    after it: the minimum of its id's counters, (N,) int64.

    Args:
        counters: (depth, width) int32 counters, on ids' device (changed in place).
        ids: (N,) int64 ids of one training lookup, fewer than 2^30.
        seed: the sketch's seed.
        counted: optional (N,) bool, false where a position is no sighting (padding, or a
            lookup the caller's input check refused): it adds nothing (its estimate is still
            read).
        sightings: optional (N,) integer tensor >= 0, the occurrences each position stands
            for (a lookup that sent each distinct id once with its multiplicity,
            ``HybridParallel(dedup=True)``), together fewer than 2^30; None: one each.
            Each is clamped to ``[0, COUNT_LIMIT]`` in the kernel (a count outside would
            wrap the int32 counters).
    """
    if ids.numel() >= _MAX_IDS:
        raise ValueError(f"admission: a lookup of {ids.numel()} ids; the sketch counts fewer than 2^30 per lookup")
    return sketch_count(counters, ids, seed, counted, sightings)


class AdmissionPolicy:
    """Which absent ids a training lookup inserts. Subclasses set the class attributes and
    :meth:`admit`; a policy object holds its own arguments only, no table state (the
    table keeps the sketch), so one object may serve several tables.

    Attributes:
        name: the policy's name.
        admits_all: every id is admitted (no sketch, no default row, no cost).
    """

    name: ClassVar[str]
    admits_all: ClassVar[bool] = False
    depth: int = 0
    width: int = 0
    seed: int = 0

    def admit(self, ids: torch.Tensor, estimate: torch.Tensor) -> torch.Tensor:
        """Whether each position's id, if absent, gets a row: (N,) bool on ids' device.

        Args:
            ids: (N,) int64 ids of a training lookup.
            estimate: (N,) int64, each id's sighting count with this lookup's (the sketch's
                estimate, :func:`count_sightings`).
        """
        raise NotImplementedError

    def fused_rule(self) -> Optional[tuple[int, float]]:
        """``(min_count, p)`` when :meth:`admit` is ``estimate >= min_count`` and, for
        ``p < 1``, the draw of :class:`Probability` below ``p`` (seeded by ``seed``): then a
        table counts and decides in one op (:func:`veloce.ops.sketch.sketch_admit`). None: the
        table counts with :func:`count_sightings` and calls :meth:`admit`."""
        return None

    @property
    def sketch_bytes(self) -> int:
        """The memory of a table's sketch, in bytes (``4 * depth * width``)."""
        return 4 * self.depth * self.width

    def false_admission(self, counters: torch.Tensor) -> Optional[float]:
        """The estimated probability that the sketch ``counters`` admits an id at its first
        sighting, though it needs more (None where the question does not apply)."""
        return None

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(vars(self).items()))))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class NoAdmission(AdmissionPolicy):
    """Every id gets a row on its first sighting (the default): no sketch, no default row."""

    name = "none"
    admits_all = True

    def admit(self, ids: torch.Tensor, estimate: torch.Tensor) -> torch.Tensor:
        return torch.ones(ids.shape, dtype=torch.bool, device=ids.device)


def _check_sketch(width: object, depth: object, seed: object) -> None:
    for name, value in (("width", width), ("depth", depth)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1 (the sketch's {name}), got {value!r}")
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool) or not -(1 << 63) <= seed < 1 << 63:
        raise ValueError(f"seed must be an int in the int64 range, got {seed!r}")


class Frequency(AdmissionPolicy):
    """An id gets its row on its ``min_count``-th sighting in training; before that it reads
    the default row (module docstring).

    Counts are kept in a count-min sketch of ``depth x width`` int32 counters: ``4 * depth
    * width`` bytes per table (4 MiB with the defaults), whatever the number of ids. Its
    estimate never undercounts, so an id is never admitted late; collisions make it
    overcount, admitting some ids early: after ``N`` sightings in all, an id's estimate
    exceeds its count by at most ``e / width * N`` with probability ``1 - e^-depth`` (98 %
    for depth 4). Widen the sketch when ``N * e / width`` nears ``min_count``.

    Args:
        min_count: the sighting that inserts an id, an int >= 1 (1 admits every id, as
            without admission, but keeps the counts).
        width: counters per sketch row, an int >= 1.
        depth: sketch rows (hashes per id), an int >= 1.
        seed: the sketch's hash seed.

    Raises:
        ValueError: an argument out of range.

    Example::

        emb = veloce.DynamicEmbedding(16, admission=veloce.admission.Frequency(min_count=2))
    """

    name = "frequency"

    def __init__(self, min_count: int, width: int = DEFAULT_WIDTH, depth: int = 4, seed: int = 0) -> None:
        if not isinstance(min_count, numbers.Integral) or isinstance(min_count, bool) or min_count < 1:
            raise ValueError(f"min_count must be an int >= 1 (the sighting that inserts an id), got {min_count!r}")
        _check_sketch(width, depth, seed)
        self.min_count = int(min_count)
        self.width = int(width)
        self.depth = int(depth)
        self.seed = int(seed)

    def admit(self, ids: torch.Tensor, estimate: torch.Tensor) -> torch.Tensor:
        return estimate >= self.min_count

    def fused_rule(self) -> tuple[int, float]:
        return self.min_count, 1.0

    def false_admission(self, counters: torch.Tensor) -> Optional[float]:
        """An id never seen is admitted at its first sighting when each of its ``depth``
        counters already holds ``min_count - 1`` sightings of other ids: the product over
        the sketch's rows of the share of counters at or above it (one pass over the
        sketch; a host sync). None for ``min_count=1``, which admits every id anyway."""
        if self.min_count <= 1:
            return None
        share = (counters >= self.min_count - 1).double().mean(dim=1)
        return float(share.prod())


class Probability(AdmissionPolicy):
    """Each sighting of an absent id admits it with probability ``p``, deterministically: the
    draw is a hash of (seed, id, sighting number), where the sighting number is the id's
    count in a count-min sketch (as :class:`Frequency` keeps it; its collisions change
    which draw an id takes, not the probability). An id repeated in one lookup draws once,
    at the number it reaches there. The expected sightings before an id is admitted: ``1 / p``.

    Args:
        p: the admission probability per sighting, in (0, 1].
        width, depth: the sketch's shape, as for :class:`Frequency` (``4 * depth * width``
            bytes).
        seed: the seed of the draws and of the sketch's hashes.

    Raises:
        ValueError: an argument out of range.
    """

    name = "probability"

    def __init__(self, p: float, seed: int = 0, width: int = DEFAULT_WIDTH, depth: int = 4) -> None:
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not (0.0 < float(p) <= 1.0) or math.isnan(p):
            raise ValueError(f"p must be a probability in (0, 1] (the chance that a sighting admits an id), got {p!r}")
        _check_sketch(width, depth, seed)
        self.p = float(p)
        self.seed = int(seed)
        self.width = int(width)
        self.depth = int(depth)

    def admit(self, ids: torch.Tensor, estimate: torch.Tensor) -> torch.Tensor:
        h = _splitmix(_splitmix(ids ^ _splitmix_int(self.seed)) + estimate * _GOLDEN)
        u = _shr(h, 11).double() * (1.0 / (1 << 53))  # uniform in [0, 1)
        return u < self.p

    def fused_rule(self) -> tuple[int, float]:
        return 0, self.p


_NAMES: dict[str, type[AdmissionPolicy]] = {"none": NoAdmission}


def resolve(admission: Union[str, AdmissionPolicy, None]) -> AdmissionPolicy:
    """The policy object for ``admission``: a policy (returned as is), None or ``"none"``
    (:class:`NoAdmission`).

    Raises:
        ValueError: an unknown name.
        TypeError: neither a name, None nor a policy.
    """
    if admission is None:
        return NoAdmission()
    if isinstance(admission, AdmissionPolicy):
        return admission
    if isinstance(admission, str):
        if admission in _NAMES:
            return _NAMES[admission]()
        raise ValueError(
            f"admission must be None, 'none' or a veloce.admission policy (Frequency(min_count=k), Probability(p)), "
            f"got {admission!r}"
        )
    raise TypeError(
        f"admission must be None, 'none' or a veloce.admission policy (Frequency(min_count=k), Probability(p)), got "
        f"{type(admission).__name__}"
    )
