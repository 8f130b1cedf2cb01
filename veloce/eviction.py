"""Eviction policies of a :class:`veloce.table.HashTable`: what a table keeps when it is full,
and when its rows expire.

Every slot of a table holds an int64 *score* that its training lookups update; an insert at
``max_capacity`` rows replaces the lowest score of the new id's two buckets. How a lookup
changes a score is a score functor in C++ (``csrc/include/veloce/score.h``: ``on_insert``,
``on_hit``), shared by the CPU and CUDA kernels; a policy here names one (its
:attr:`~EvictionPolicy.score_policy`) and adds what the table does around the lookups:

- :class:`LRU` (``"lru"``): the score is the table's clock at the row's last training
  lookup; a full table evicts the least recently seen row.
- :class:`LFU` (``"lfu"``): the score counts the row's occurrences in training lookups; a
  full table evicts the least frequently seen row.
- :class:`NoEviction` (``"none"``): a full table raises :class:`veloce.table.TableFullError`;
  the scores are LRU's (the last-seen step, informative).
- :class:`TTL` (``TTL(steps=N)``): rows expire, full or not, once ``N`` training lookups of
  the table went by without them; a full table evicts as LRU does.

A table's clock ticks once per training lookup (:attr:`veloce.table.HashTable.clock`), so
for LRU, TTL and NoEviction a row's score is its *last-seen step*:
:meth:`veloce.table.HashTable.last_seen` reads it.

Adding a policy: a score functor and its registry line in ``csrc/include/veloce/score.h``
(when no existing score fits), a class here whose ``score_policy`` is its id, and a line in
:data:`POLICIES` when it has a name without arguments (``docs/eviction.md``).
"""

from __future__ import annotations

import numbers
from typing import ClassVar, Optional, Union

# The ids of the score functors (csrc/include/veloce/score.h, VELOCE_SCORE_POLICIES).
from veloce.ops.hash_table import SCORE_LFU, SCORE_LRU

__all__ = ["EvictionPolicy", "LRU", "LFU", "NoEviction", "TTL", "POLICIES", "resolve"]


class EvictionPolicy:
    """What a table does with its rows' scores. Subclasses set the class attributes; a
    policy object holds its own arguments only, no table state (one object may serve
    several tables).

    Attributes:
        name: the policy's name (a table's ``eviction`` attribute).
        score_policy: the id of its score functor (``csrc/include/veloce/score.h``).
        evicts: a new id at ``max_capacity`` rows evicts (True) or raises
            :class:`veloce.table.TableFullError` (False).
        last_seen_scores: the score is the row's last-seen step (the clock of its last
            training lookup), which :meth:`veloce.table.HashTable.last_seen` reads.
        expires: rows expire (:meth:`expire_before` may return a score).
    """

    name: ClassVar[str]
    score_policy: ClassVar[int]
    evicts: ClassVar[bool] = True
    last_seen_scores: ClassVar[bool] = True
    expires: ClassVar[bool] = False

    def expire_before(self, clock: int) -> Optional[int]:
        """Whether the table expires rows after the training lookup that ticked its clock to
        ``clock``: the score below which rows go, or None for no expiry after it. A function of
        the clock alone, which checkpoints keep, so that a restored table expires as the
        saved one would have. Only time-to-live policies expire."""
        return None

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(vars(self).items()))))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class LRU(EvictionPolicy):
    """Evicts the least recently used row of a full bucket pair (``"lru"``)."""

    name = "lru"
    score_policy = SCORE_LRU


class LFU(EvictionPolicy):
    """Evicts the least frequently used row of a full bucket pair (``"lfu"``): the score
    counts the row's positions in training lookups since it was inserted."""

    name = "lfu"
    score_policy = SCORE_LFU
    last_seen_scores = False


class NoEviction(EvictionPolicy):
    """Never evicts (``"none"``): a new id at ``max_capacity`` rows raises
    :class:`veloce.table.TableFullError`. Scores are LRU's (the last-seen step)."""

    name = "none"
    score_policy = SCORE_LRU
    evicts = False


class TTL(EvictionPolicy):
    """Time to live: a row expires (is erased) once ``steps`` training lookups of its table
    went by without it, whether or not the table is full; at ``max_capacity`` rows a new id
    evicts the least recently used row, as :class:`LRU`.

    The boundary: at the table's clock ``T`` (the tick of its latest training lookup), a row
    last seen at step ``s`` is kept while ``T - s <= steps`` and expires once ``T - s >
    steps``. So ``steps=N`` keeps the rows of the last ``N + 1`` lookups, the current one
    included: the one tick of slack keeps the rows of the lookup before it (a batch whose
    gradient is still pending, or the rows an earlier lookup of the same step or a prefetch
    holds slots of) whatever ``N``; the current lookup's rows are never expired.

    Expiry is one bulk op over the table's slots (``torch.ops.veloce.expire``), run after
    the training lookups that tick the clock to a multiple of ``check_every``, so a row goes
    between ``steps + 1`` and ``steps + check_every`` ticks after it was last seen. An
    expired row that comes back is a new row, initialized from ``(seed, id)``; a gradient
    still pending for it is dropped (the slots are found again by id, as after an eviction).

    Args:
        steps: ticks (training lookups of the table) a row lives unseen; an int >= 1.
        check_every: ticks between two expiry passes; an int >= 1, default ``max(1, steps
            // 8)``: a pass reads every slot (and on CUDA its count back, a host sync), so
            for a large table it runs a few times per lifetime, not every step.

    Raises:
        ValueError: ``steps`` or ``check_every`` is not an int >= 1.
    """

    name = "ttl"
    score_policy = SCORE_LRU
    expires = True

    def __init__(self, steps: int, check_every: Optional[int] = None) -> None:
        for arg, value in (("steps", steps), ("check_every", check_every)):
            if value is None and arg == "check_every":
                continue
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"TTL: {arg} must be an int >= 1 (training lookups of the table), got {value!r}"
                )
        self.steps = int(steps)
        self.check_every = max(1, self.steps // 8) if check_every is None else int(check_every)

    def expire_before(self, clock: int) -> Optional[int]:
        if clock % self.check_every:
            return None
        return clock - self.steps  # score < clock - steps <=> clock - score > steps


# The policies a name selects (the strings DynamicEmbedding, HashTable and the config accept).
POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRU, "lfu": LFU, "none": NoEviction}


def resolve(eviction: Union[str, EvictionPolicy]) -> EvictionPolicy:
    """The policy object of ``eviction``: a name of :data:`POLICIES` or a policy object.

    Raises:
        ValueError: neither (the message lists what is accepted).
    """
    if isinstance(eviction, EvictionPolicy):
        return eviction
    if isinstance(eviction, str) and eviction in POLICIES:
        return POLICIES[eviction]()
    names = ", ".join(repr(n) for n in POLICIES)
    hint = " (a time to live takes its steps: veloce.eviction.TTL(steps=N))" if eviction == "ttl" else ""
    raise ValueError(
        f"eviction must be one of {names} or a veloce.eviction policy (LRU(), LFU(), NoEviction(), "
        f"TTL(steps=N)), got {eviction!r}{hint}"
    )
