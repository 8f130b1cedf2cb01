"""The hash table behind a :class:`veloce.DynamicEmbedding`: state as tensors, and growth.

A :class:`HashTable` owns five buffers (``keys``, ``digests``, ``scores``, ``weights``,
``opt_state``; layout in ``docs/ops.md``) and drives the ``torch.ops.veloce`` hash-table
ops over them. The ops never allocate table state; growth happens here: past ``grow_at``,
or when an insert finds no room, the table rehashes into twice the slots and the call is
retried. ``max_capacity`` bounds the rows (``len``), exactly: the slots stop growing at
:func:`final_capacity` (``max_capacity`` rows at load :data:`FULL_LOAD`), and the inserts
keep to the rows left (the ops' ``room``). A new id that arrives at ``len ==
max_capacity`` evicts a row by score (LRU or LFU) or, with ``eviction="none"``, raises an
error that says how full it is and what to change; a time-to-live policy also expires
rows (:mod:`veloce.eviction`). (Memory per row: ``docs/memory.md``.)

Every change of the id -> slot mapping of keys already present (growth, eviction,
expiry, erase) bumps :attr:`HashTable.version`; holders of slots (pending gradients, saved
autograd contexts) compare versions and re-resolve their slots by key.
"""

from __future__ import annotations

import contextlib
import numbers
import warnings
from collections.abc import Iterator
from fractions import Fraction
from typing import Any, Callable, NoReturn, Optional, Sequence, TypeVar

import torch
from torch import nn

from veloce import _capture, _ext
from veloce import eviction as _eviction
from veloce._device import current_stream
from veloce._memory import empty_table
from veloce._update_stream import UpdateFence, beside_updates, release_done, wait_prefetch_origin
from veloce.init import Initializer
from veloce.ops.hash_table import expire

__all__ = [
    "HashTable", "TableFullError", "BUCKET_SIZE", "FULL_LOAD", "find_or_insert_many", "final_capacity",
    "round_capacity",
]  # fmt: skip

BUCKET_SIZE = 32  # slots per bucket; csrc/include/veloce/hash.h kBucketSize
# The load of a table that holds max_capacity rows (its final size), and the most that
# reserve() plans for. Two-choice placement into 32-slot buckets first overflows a bucket
# near a load of 0.93 (0.96 in small tables): 0.8 leaves a wide margin, for 1.25 slots a row.
FULL_LOAD = 0.8
_EXPORT_CHUNK = 1 << 20


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The optimizer state's dtype for rows of ``dtype``: float64 for float64 rows, else
    float32 (16-bit rows keep their state in float32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


_STATE_NAMES = ("keys", "digests", "scores", "weights", "opt_state")  # the buffers, in the ops' order
_T = TypeVar("_T")


class TableFullError(RuntimeError):
    """Raised when an insert cannot keep a table within ``max_capacity`` rows: new ids arrive
    at ``len == max_capacity`` with ``eviction="none"`` (or while loading, which never
    evicts), or a batch's new ids find only rows the batch itself touched to evict. The
    table is unchanged."""


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _is_int(value: Any) -> bool:
    """An integer (Python's, NumPy's, ...), and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_int64(value: Any) -> bool:
    """An integer (not a bool) that an int64 holds: what an id, a padding id or a seed may be."""
    return _is_int(value) and _INT64_MIN <= value <= _INT64_MAX


def round_capacity(capacity: int) -> int:
    """The smallest growth size >= ``capacity``: a power-of-two number of 32-slot buckets
    (what a table starts at and doubles through; any whole number of buckets is valid)."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    buckets = 1
    while buckets * BUCKET_SIZE < capacity:
        buckets *= 2
    return buckets * BUCKET_SIZE


def _whole_buckets(slots: int) -> int:
    """``slots`` rounded up to whole 32-slot buckets (at least one)."""
    return max(1, -(-int(slots) // BUCKET_SIZE)) * BUCKET_SIZE


def _slots_for(rows: int, load: float) -> int:
    """Whole buckets that hold ``rows`` rows at ``load`` at most."""
    frac = Fraction(load).limit_denominator(1 << 20)  # 0.8 is 4/5: no float rounding at a bucket's edge
    return _whole_buckets(-(-int(rows) * frac.denominator // frac.numerator))


def final_capacity(max_capacity: int) -> int:
    """The slots of a table bounded by ``max_capacity`` rows once it stops growing: whole
    buckets for ``max_capacity`` rows at load :data:`FULL_LOAD` (1.25 slots a row). Up to
    32 rows, one bucket: both choices of every key are that bucket, which fills to its last
    slot, and a new id may evict any row (in more buckets, a batch of new ids that nearly
    replaces a small table could find its candidates all touched)."""
    if max_capacity <= BUCKET_SIZE:
        return BUCKET_SIZE
    return _slots_for(max_capacity, FULL_LOAD)


class PlainAttrs:
    """A mixin for modules whose per-step bookkeeping attributes (the names in the class's
    ``_PLAIN_ATTRS``) are set directly. nn.Module.__setattr__ first looks for a parameter,
    buffer or submodule of the name: a few microseconds per set on the host path of a
    GPU step. Those names must never be one."""

    _PLAIN_ATTRS: frozenset = frozenset()

    def __setattr__(self, name: str, value: Any) -> None:
        if name in type(self)._PLAIN_ATTRS:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)


class HashTable(PlainAttrs, nn.Module):
    """A growable hash table from int64 ids to embedding rows and optimizer state.

    Args:
        dim: embedding dimension D.
        state_dim: optimizer state width S per row.
        capacity: initial number of slots (rounded up by :func:`round_capacity`; at most
            :func:`final_capacity` of ``max_capacity``).
        max_capacity: the most rows the table holds: ``len(table)`` never exceeds it.
            The slots grow to :func:`final_capacity` of it at most (with
            ``eviction="none"``, a bucket pair that overflows before the rows reach it adds
            a few; lru / lfu evict there). None = unbounded.
        eviction: a :mod:`veloce.eviction` policy or its name, "lru", "lfu" or "none":
            what a new id does at ``len == max_capacity`` (evict the least recently /
            frequently used row of its buckets, or raise :class:`TableFullError`), and
            whether rows expire (``veloce.eviction.TTL(steps=N)``).
        initializer: the initial value of new rows, a function of (seed, id).
        seed: initializer seed.
        dtype: dtype of the rows.
        device: where the state lives.
        grow_at: load factor beyond which the table grows before an insert.
        init_state: the ``(state_dim,)`` optimizer state of a new row (the optimizer's
            ``initial_state``), or None for zeros.

    Deferred inserts (``defer = True``; :class:`veloce.DynamicEmbedding`'s
    ``defer_inserts``): a training insert does not wait for the device to say how many ids
    it inserted (on a GPU the wait is a host sync that leaves the device idle while the
    host queues the rest of the step; on the CPU nothing is gained, and the same rules hold
    so that both behave alike). The counts are copied to the host behind the op and
    read later: by the next insert once they arrived (no wait), and with a wait by
    :attr:`size` / ``len()``, growth, ``erase``, ``clear`` and loads, and by the sparse
    optimizer step (:meth:`settle`). A call defers only while the table's size plus the ids
    of the calls not read yet (an upper bound of what they insert) and its own stay at most
    ``grow_at * capacity`` and ``max_capacity`` (it may neither grow nor evict) and
    ``torch.use_deterministic_algorithms`` is off; other calls wait as before. A table
    at least half way to ``grow_at`` that a call would take past it grows first, one
    doubling earlier than it would otherwise (a batch with more ids than ``grow_at *
    capacity`` waits instead). A deferred
    call changes nothing when it finds no room (rare below ``grow_at``: two-choice
    placement overflowing a bucket pair): its slots are all -1, so that step's lookups of
    the table read no rows and its gradient there is dropped; the read warns and grows the
    table. A set ``bad_input`` is raised at the read too (the call changed nothing).
    """

    def __init__(
        self,
        dim: int,
        state_dim: int,
        capacity: int = 1024,
        max_capacity: Optional[int] = None,
        eviction: str | _eviction.EvictionPolicy = "lru",
        initializer: Initializer = Initializer(0),
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        grow_at: float = 0.9,
        init_state: Optional[torch.Tensor] = None,
    ) -> None:
        super().__init__()
        policy = _eviction.resolve(eviction)
        if not 0.0 < grow_at <= 1.0:
            raise ValueError(f"grow_at must be in (0, 1], got {grow_at}")
        for name, value in (("capacity", capacity), ("max_capacity", max_capacity)):
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"{name} must be an int >= 1{' or None' if name == 'max_capacity' else ''}, got {value!r}")
        if not is_int64(seed):
            raise ValueError(f"seed must be an int in the int64 range, got {seed!r}")
        initializer.check_fits(dtype)
        self.dim = int(dim)
        self.state_dim = int(state_dim)
        if init_state is not None and tuple(init_state.shape) != (self.state_dim,):
            raise ValueError(f"init_state must have shape ({self.state_dim},) (the optimizer state of a row), got "
                             f"{tuple(init_state.shape)}")  # fmt: skip
        self.init_state = None if init_state is None else init_state.detach().cpu()
        # init_state on the device and in the dtype of opt_state, made on the first insert there
        self._init_state_at: Optional[torch.Tensor] = None
        self.eviction_policy = policy
        self.eviction = policy.name
        self.score_policy = policy.score_policy
        self.initializer = initializer
        self.seed = int(seed)
        self.grow_at = grow_at
        cap = round_capacity(int(capacity))
        self.max_capacity = None if max_capacity is None else int(max_capacity)  # rows, exactly
        self._final_capacity = None if max_capacity is None else final_capacity(self.max_capacity)
        if self._final_capacity is not None and cap > self._final_capacity:
            cap = self._final_capacity
        self._size = 0  # occupied slots, not counting the deferred inserts not read yet
        self.defer = False  # deferred inserts (see the class docstring)
        self._unread: list[tuple[_DeferredCounts, int, int]] = []  # (counts, row, ids) per unread call
        self.version = 0  # bumped whenever a present key may change slot
        self.clock = 0  # LRU time: one tick per training lookup
        self.num_evicted = 0
        self.num_expired = 0  # rows a time-to-live policy erased
        self.last_evicted = torch.empty(0, dtype=torch.long)
        self._update_fence = None
        self._changed = None
        self._allocate(cap, dtype, torch.device(device) if device is not None else torch.device("cpu"))

    # Bookkeeping set on every training lookup (see PlainAttrs).
    _PLAIN_ATTRS = frozenset({"_size", "version", "clock", "num_evicted", "last_evicted", "_update_fence", "_changed",
                              "num_expired"})

    # The sparse update last queued on a side stream (veloce._update_stream), until a use of
    # the rows waited for it.
    _update_fence: UpdateFence | None = None
    # After a change of the state outside the training inserts, queued on CUDA and not
    # waited for (clear, erase, resize, insert_or_assign, load_entries): (event, stream),
    # until an op on another stream waited for it. An insert of HybridParallel.prefetch
    # (or of a forward whose exchange was prefetched) runs on the prefetch stream without
    # waiting for the current stream; it must still come after such a change.
    _changed: Any = None

    # The rows' dtype, kept beside the buffers as a plain attribute: a compiled graph reads this
    # (veloce._compile), where reading the buffer's dtype would tie the graph to the buffer and
    # recompile it whenever the table grows.
    row_dtype: torch.dtype

    # ---- state ------------------------------------------------------------------------
    def _allocate(self, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        release_done()  # rows of deleted tables whose last update has run
        for old in self._buffers.values():
            # The buffers replaced here may have been read by work queued on a stream other
            # than the one they were allocated on (a growth during HybridParallel.prefetch,
            # on its side stream): their memory must not be reused before that work ran.
            if old is not None and old.is_cuda:
                old.record_stream(current_stream(old.device))
        opt_dtype = state_dtype(dtype)
        shapes = {
            "keys": ((capacity,), torch.long),
            "digests": ((capacity,), torch.uint8),
            "scores": ((capacity,), torch.long),
            "weights": ((capacity, self.dim), dtype),
            "opt_state": ((capacity, self.state_dim), opt_dtype),
        }
        for name, (shape, dt) in shapes.items():
            self.register_buffer(name, empty_table(shape, dt, device), persistent=False)
        self.row_dtype = dtype
        self._note_changed()  # the new buffers' fill, queued on the current stream

    # The state is read straight from the buffer dict: several times per table per step,
    # where each attribute read of a buffer goes through nn.Module.__getattr__.
    def _state(self, join: bool = True) -> tuple[torch.Tensor, ...]:
        """The five state tensors, for an op. ``join=False`` only for an insert that may not
        evict: it runs beside a sparse update still in flight (see :meth:`_join_update`)."""
        if join:
            self._join_update()
        if self._changed is not None:
            self._wait_changed()
        b = self._buffers
        return (b["keys"], b["digests"], b["scores"], b["weights"], b["opt_state"])

    def _join_update(self) -> None:
        """Makes the current stream wait (on the device, no host sync) for the sparse update
        of this table queued on the update stream, if one may still run. Every use of the rows
        or the optimizer state, and every change of the slots, comes after this; only an insert
        that may not evict skips it (:mod:`veloce._update_stream` says why that is safe)."""
        fence = self._update_fence
        if fence is not None and fence.join():  # a join on a stream of the user's own keeps it
            self._update_fence = None
        wait_prefetch_origin(self.device)  # inside HybridParallel.prefetch: after what came before it

    def __getattr__(self, name: str) -> Any:
        # Reading the rows or the optimizer state (``table.weights``, by veloce or by the
        # user) waits for the update in flight. The module's own attributes never get here.
        if self._update_fence is not None and name in ("weights", "opt_state"):
            self._join_update()
        # A buffer is found here, not by nn.Module's lookup (one Python call less, for
        # every table in every step; no parameter or submodule can share a buffer's name).
        buffers = self.__dict__.get("_buffers")
        if buffers is not None and name in buffers:
            return buffers[name]
        return super().__getattr__(name)

    def _rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, opt_state)``, as reading the two attributes gives them (after the
        update in flight), in one call: the sparse update reads both for every table in
        every step."""
        if self._update_fence is not None:
            self._join_update()
        b = self._buffers
        return b["weights"], b["opt_state"]

    def _apply(self, fn, recurse: bool = True):  # .to(), .cuda(), .half(), ...: after the update
        self._join_update()
        if self._changed is not None:  # and after the last change, whatever stream queued it
            self._wait_changed()
            self._changed = None  # the buffers are replaced, on the current stream
        opt = self._buffers["opt_state"]
        out = super()._apply(fn, recurse)
        # A cast of the module (.half(), .to(torch.bfloat16), .double()) casts every floating
        # buffer alike, but the optimizer state keeps the dtype the rows' dtype calls for
        # (float32 for 16-bit rows): it is converted once, from the state before the cast.
        b = self._buffers
        want = state_dtype(b["weights"].dtype)
        if b["opt_state"].dtype != want:
            b["opt_state"] = opt.to(device=b["weights"].device, dtype=want)
        self.row_dtype = b["weights"].dtype
        return out

    def __getstate__(self) -> dict[str, Any]:
        # copy.deepcopy / pickle: the rows after the update and after the last change (a copy
        # reads them on the current stream); the fence and the change event stay here.
        self._join_update()
        if self._changed is not None:
            self._wait_changed()
        self.settle()  # the unread counts hold CUDA events
        state = self.__dict__.copy()
        state["_update_fence"] = None
        state["_changed"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Tables pickled before deferred inserts kept the size as a plain attribute.
        if "size" in state:
            state = dict(state)
            state["_size"] = state.pop("size")
        state.setdefault("defer", False)
        state.setdefault("_unread", [])
        if "_final_capacity" not in state:  # pickled when max_capacity counted slots
            mc = state.get("max_capacity")
            state["_final_capacity"] = None if mc is None else final_capacity(mc)
        state.setdefault("row_dtype", state["_buffers"]["weights"].dtype)
        state.setdefault("eviction_policy", _eviction.resolve(state["eviction"]))
        state.setdefault("num_expired", 0)
        super().__setstate__(state)

    @property
    def size(self) -> int:
        """Occupied slots (reads the counts of deferred inserts first, waiting for them)."""
        if self._unread:
            self.settle()
        return self._size

    @size.setter
    def size(self, value: int) -> None:
        if self._unread:  # a deferred insert read later must not add to the value set now
            self.settle()
        self._size = value

    @property
    def dtype(self) -> torch.dtype:
        """The rows' dtype (read without waiting for an update in flight)."""
        return self._buffers["weights"].dtype

    @property
    def capacity(self) -> int:
        """Number of slots currently allocated."""
        return self._buffers["keys"].numel()

    @property
    def load_factor(self) -> float:
        """size / capacity."""
        return self.size / self.capacity

    @property
    def device(self) -> torch.device:
        return self._buffers["keys"].device

    def __len__(self) -> int:
        return self.size

    def _size_text(self) -> str:
        """``size=N`` for a repr, which must not wait for deferred counts nor raise a
        refusal: ``size>=N`` while some are unread."""
        return f"size{'>=' if self._unread else '='}{self._size}"

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, {self._size_text()}, capacity={self.capacity}, "
            f"max_capacity={self.max_capacity}, "
            f"eviction={self.eviction_policy!r}, initializer={self.initializer!r}"
        )

    # ---- lookups ----------------------------------------------------------------------
    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """Slots of ``ids`` (N,), -1 where absent. Never inserts, never scores."""
        _ext.require()
        return torch.ops.veloce.find(self.keys, self.digests, ids)

    def find_or_insert(
        self,
        ids: torch.Tensor,
        padding_id: int | None = None,
        bad_input: torch.Tensor | None = None,
        on_refused: Callable[[], None] | None = None,
        allow_defer: bool = True,
    ) -> torch.Tensor:
        """Slots of ``ids``, inserting missing ids (growing or evicting as needed).

        Scores are updated (one LRU tick per call). Positions equal to ``padding_id``
        get slot -1. Raises :class:`TableFullError` when there is no room and the
        table may neither grow nor evict; the table is then unchanged.

        ``bad_input``: an optional one-element bool tensor on the table's device, the
        result of the caller's own device-side check of this call's input. The op reads it
        with the read-back it makes anyway (on CUDA: the count of missing ids), so the
        check costs the caller no host sync; when it is true the call raises ``ValueError``
        and changes nothing (no insert, no score, no growth, no clock tick).

        A deferred call (``defer``, see the class docstring) reads nothing back: a set
        ``bad_input`` is raised when its counts are read (:meth:`settle`), by
        ``on_refused()`` when given (it raises, or returns when it raised for another call
        already), with the call's slots all -1 and the table unchanged (its LRU clock
        tick stays). ``allow_defer=False`` reads the counts
        back whatever ``defer`` says (a sharded owner's insert: its failure must reach
        every rank in the same step).
        """
        with _ticked_clocks([self]) as booked:
            if allow_defer and self._deferrable([ids], bad_input):
                (slots,) = _insert_deferred([self], [ids], [padding_id], bad_input, on_refused)
            else:
                slots = self._insert(self._find_or_insert_call(ids, padding_id, bad_input), bad_input=bad_input,
                                     ids=ids, padding_id=padding_id)  # fmt: skip
            booked.add(id(self))
        return slots

    # ---- deferred inserts -------------------------------------------------------------
    def _deferrable(self, ids: Sequence[torch.Tensor], bad_input: torch.Tensor | None = None) -> bool:
        """Whether an insert of ``ids`` (one tensor per call of the table) may skip its
        read-back: see the class docstring. Reads the counts that already arrived first
        when the bound does not hold with the unread ones.

        A table filling up would otherwise wait for the read-back in every call from the
        moment a batch could pass ``grow_at`` until its size does. So once it is half way
        there (and a batch's ids alone do not pass the bound), it grows now, one doubling
        early, and defers. Growth reads the device back anyway: ``bad_input`` is read
        first, and a set flag raises as the op would, before anything changes."""
        if _capture.ACTIVE is not None:  # a captured insert defers always; the step wrapper made room
            return self._room_in_capture(sum(i.numel() for i in ids))
        if not self.defer or torch.are_deterministic_algorithms_enabled():
            return False
        n = sum(i.numel() for i in ids)
        limit = self._defer_limit()
        if self._size + self._unread_ids() + n <= limit:
            return True
        if self._unread:
            self.settle(wait=False)
            if self._size + self._unread_ids() + n <= limit:
                return True
        if self._size + self._unread_ids() < limit / 2 or n > limit:
            return False
        self.settle()
        if self._size < limit / 2 or self._at_max():
            return self._size + n <= limit
        _refuse_if_set(bad_input)
        self._grow()
        return self._size + n <= self._defer_limit()

    def _defer_limit(self) -> float:
        """The most rows (the table's, the unread calls' ids and a call's) that a deferred
        call may reach: ``grow_at * capacity`` while the table may grow, and never more than
        ``max_capacity`` (a call past it would have to evict, or raise); at the final size
        (:func:`final_capacity`), ``max_capacity`` alone."""
        if self._at_max():
            return self.max_capacity
        limit = self.grow_at * self.capacity
        return limit if self.max_capacity is None else min(limit, self.max_capacity)

    def _room_in_capture(self, n: int) -> bool:
        """While a CUDA graph is captured (veloce.graphs): True when ``n`` more ids fit under
        ``grow_at`` with the deferred calls not read yet; else :class:`NeedsRoom` (the
        wrapper grows the table and captures again). A table that may evict or under
        deterministic algorithms cannot be captured (a deferred insert does neither)."""
        if torch.are_deterministic_algorithms_enabled():
            raise RuntimeError(
                "veloce: a training step cannot be captured in a CUDA graph under torch.use_deterministic_algorithms"
                "(True): a deferred CUDA insert races conflicting new ids instead of placing them in order"
            )
        # with the ids of this step's earlier inserts into the table (a table looked up twice)
        n += sum(k for log in _capture.ACTIVE.inserts for t, k in zip(log.tables, log.num_ids) if t is self)
        if self._size + self._unread_ids() + n > self._defer_limit():
            raise _capture.NeedsRoom(self, n)
        return True

    def _unread_ids(self) -> int:
        """The ids of the deferred calls not read yet: an upper bound of what they inserted."""
        return sum(n for _, _, n in self._unread)

    def settle(self, wait: bool = True, refusals: bool = True) -> None:
        """Reads the counts of the deferred inserts not read yet, oldest first (all of
        them, waiting for the device; with ``wait=False`` those that arrived). Books what
        they inserted; a call refused for its ``bad_input`` raises here (its error, once;
        ``refusals=False``: forgotten, for a load that replaces the contents anyway); one
        that found no room warns and grows the table (see the class docstring)."""
        while self._unread:
            counts, row, _ = self._unread[0]
            if not counts.arrived(wait):
                return
            self._unread.pop(0)
            inserted, failed = counts.row(row)
            if failed == 0:
                self._size += inserted
            elif failed < 0:
                if refusals:
                    counts.refuse()  # raises, the first time for this call
            else:
                self._no_room_deferred(failed)

    def _no_room_deferred(self, failed: int) -> None:
        # A deferred call stays within max_capacity rows: it found a bucket pair full.
        target = self._more_slots() if self._at_max() else self._next_capacity()
        warnings.warn(
            f"veloce: a deferred insert found no room for {failed} new id(s) (size {self._size}, capacity "
            f"{self.capacity}): it changed nothing, so that step's lookups of this table read no rows and its "
            f"gradient here was dropped. The table grows to {target} slots now. Turn deferred inserts off "
            f"(DynamicEmbedding(defer_inserts=False)) for exact semantics.",
            RuntimeWarning, stacklevel=3,
        )  # fmt: skip
        self._rehash(target)

    def _find_or_insert_call(self, ids: torch.Tensor, padding_id: int | None,
                             bad_input: torch.Tensor | None = None):  # fmt: skip
        """The op call ``allow_evict -> (slots, counts, evicted)`` that :meth:`_insert` retries
        (a retry passes ``bad_input`` again: it was false, or the first call had raised)."""
        def call(evict: bool):
            state = self._state(join=evict)
            room = self._room()
            init_state = self._initial_state()
            return insert_beside_updates([self], lambda: torch.ops.veloce.find_or_insert(
                *state, *self._find_or_insert_args(ids, padding_id, evict), bad_input, room=room, init_state=init_state
            ))  # fmt: skip

        return call

    def _room(self) -> int:
        """The ops' ``room``: the rows ``max_capacity`` leaves (how many new ids may take an
        empty slot; the later ones evict or fail), or -1 without a bound."""
        return -1 if self.max_capacity is None else max(0, self.max_capacity - self.size)

    def _initial_state(self) -> Optional[torch.Tensor]:
        """The ops' ``init_state``: :attr:`init_state` as opt_state's dtype and device (kept)."""
        if self.init_state is None:
            return None
        opt = self._buffers["opt_state"]
        at = self._init_state_at
        if at is None or at.device != opt.device or at.dtype != opt.dtype:
            at = self._init_state_at = self.init_state.to(device=opt.device, dtype=opt.dtype)
        return at

    def _find_or_insert_args(self, ids: torch.Tensor, padding_id: Optional[int], allow_evict: bool) -> tuple:
        init = self.initializer
        return (ids, self.score_policy, self.clock, allow_evict, self.seed, init.kind, init.a, init.b, padding_id)

    def _allow_evict(self, evict: bool = True) -> bool:
        return evict and self._at_max() and self.eviction_policy.evicts

    def insert(
        self,
        ids: torch.Tensor,
        values: torch.Tensor,
        opt_values: Optional[torch.Tensor] = None,
        score_values: Optional[torch.Tensor] = None,
        evict: bool = True,
    ) -> torch.Tensor:
        """insert_or_assign: writes ``values`` (N, D) to the rows of ``ids``; returns slots.
        With ``evict=False`` a full table raises instead of evicting."""
        try:
            return self._insert(
                lambda allow_evict: torch.ops.veloce.insert_or_assign(
                    *self._state(), ids, values, opt_values, score_values, self.score_policy, self.clock, allow_evict,
                    self._room(), self._initial_state(),
                ),
                evict=evict, ids=ids,
            )
        finally:  # a failed insert queues its rollback too
            self._note_changed()

    def _wait_changed(self) -> None:
        """The current stream waits for the last change's event when another stream queued
        it; then work on either stream comes after the change (one queued it, the other
        waited for it): the current and the prefetch stream, the two that use the state."""
        event, stream = self._changed
        if not self._buffers["keys"].is_cuda:  # moved off the GPU since
            self._changed = None
            return
        current = current_stream(self.device)
        if current != stream:
            current.wait_event(event)
            self._changed = None

    def _note_changed(self) -> None:
        """After a change of the state queued on the current stream (not a training insert):
        its event, which the next op on another stream waits for (see ``_changed``)."""
        if self._buffers["keys"].is_cuda:
            stream = current_stream(self.device)
            event = torch.cuda.Event()
            event.record(stream)
            self._changed = (event, stream)

    def _insert(self, call, evict: bool = True, bad_input: torch.Tensor | None = None,
                ids: torch.Tensor | None = None, padding_id: int | None = None) -> torch.Tensor:  # fmt: skip
        """Runs an inserting op ``call(allow_evict) -> (slots, counts, evicted)`` of ``ids``;
        while it reports no room (and changed nothing), grows the table and calls again.
        ``bad_input``: the flag the call passes to the op (see :meth:`_maybe_grow`)."""
        _ext.require()
        self._maybe_grow(bad_input)
        while True:
            slots, counts, evicted = call(self._allow_evict(evict))
            inserted, failed = counts.tolist()  # a CPU tensor: no device sync
            if failed == 0:
                break
            self._no_room(failed, ids, padding_id, evict)
        self._note_inserted(inserted, evicted)
        return slots

    def _note_inserted(self, inserted: int, evicted: torch.Tensor) -> None:
        """Books an insert that placed ``inserted`` new ids and evicted the ids ``evicted``.
        Sets only what changes: each set is a call of PlainAttrs.__setattr__, for every
        table in every training step."""
        num_evicted = evicted.numel()
        if inserted != num_evicted:
            self.size += inserted - num_evicted
        self.last_evicted = evicted
        if num_evicted:
            self.num_evicted += num_evicted
            self.version += 1

    def erase(self, ids: torch.Tensor) -> int:
        """Removes ``ids``; returns how many were present."""
        _ext.require()
        self.settle()  # first: a refused deferred call raises before anything changes
        self._join_update()  # a freed slot may be filled by the next insert
        erased = int(torch.ops.veloce.erase(self.keys, self.digests, ids).sum())
        self._note_changed()
        if erased:
            self.size -= erased
            self.version += 1
        return erased

    def expire(self, before: int) -> int:
        """Erases every row whose score is below ``before``: under the lru, ttl and none
        policies, the rows last seen before clock ``before`` (:meth:`last_seen`). One pass
        over the slots (``torch.ops.veloce.expire``; on CUDA its count is read back, a host
        sync). Bumps :attr:`version` when a row went, so that a gradient pending for it
        finds its row by id and is dropped. A :class:`veloce.eviction.TTL` table calls it
        after its training lookups.

        Args:
            before: the lowest score kept, an int.

        Returns:
            The number of rows erased.

        Raises:
            ValueError: ``before`` is not an int in the int64 range.
        """
        _ext.require()
        if not is_int64(before):
            raise ValueError(f"expire: before must be an int in the int64 range, got {before!r}")
        self._join_update()  # a freed slot may be filled by the next insert, beside no update of its old row
        keys, digests, scores, _, _ = self._state()
        erased = int(expire(keys, digests, scores, int(before)))
        self._note_changed()
        if erased:
            self._size -= erased  # relative: deferred inserts not read yet add theirs when read
            self.num_expired += erased
            self.version += 1
        return erased

    def _expire_due(self) -> None:
        """After a training lookup of a table whose policy expires rows booked its insert:
        the expiry pass when it is due (:meth:`veloce.eviction.EvictionPolicy.expire_before`)."""
        policy = self.eviction_policy
        if _capture.ACTIVE is not None:
            raise RuntimeError(
                f"veloce: a table with eviction={policy!r} cannot be captured in a CUDA graph: its expiry "
                f"pass reads its count back to the host; train it eagerly"
            )  # fmt: skip
        before = policy.expire_before(self.clock)
        if before is not None:
            self.expire(before)

    def last_seen(self, ids: torch.Tensor) -> torch.Tensor:
        """The last-seen step of each id: the table's :attr:`clock` at the last training
        lookup that held it (its score, under the lru, ttl and none policies; rows written
        by :meth:`insert` or a load take the given scores, else the clock then), -1 where
        the id is not in the table. Kept in the row's score, 8 bytes per slot (the score
        every table keeps: ``docs/memory.md``); saved and restored with checkpoints.

        Args:
            ids: (N,) int64 ids.

        Returns:
            (N,) int64 on the table's device.

        Raises:
            ValueError: the policy's score is not a step (``eviction="lfu"`` counts uses).
        """
        if not self.eviction_policy.last_seen_scores:
            raise ValueError(
                f"last_seen: this table's eviction={self.eviction_policy!r} keeps use counts in its scores, not "
                f"the last-seen step; use eviction='lru', 'none' or veloce.eviction.TTL(steps=N)"
            )  # fmt: skip
        slots = self.find(ids)
        scores = self._state()[2]
        return torch.where(slots >= 0, scores[slots.clamp(min=0)], torch.full_like(slots, -1))

    def export(self, start: int = 0, end: Optional[int] = None) -> dict[str, torch.Tensor]:
        """The occupied entries of slots [start, end): keys, weights, optimizer_state, scores."""
        _ext.require()
        end = self.capacity if end is None else end
        parts = [
            torch.ops.veloce.export(*self._state(), s, min(s + _EXPORT_CHUNK, end))
            for s in range(start, end, _EXPORT_CHUNK)
        ] or [torch.ops.veloce.export(*self._state(), start, end)]
        names = ("keys", "weights", "optimizer_state", "scores")
        return {name: torch.cat([p[i] for p in parts]) for i, name in enumerate(names)}

    def clear(self) -> None:
        """Removes every entry (keeps the capacity)."""
        self.settle()  # first: a refused deferred call raises before anything changes
        self._join_update()
        self.digests.zero_()
        self.size = 0
        self.version += 1
        self._note_changed()

    # ---- growth -----------------------------------------------------------------------
    def _at_max(self) -> bool:
        """Whether the slots reached the final size (:func:`final_capacity`): no more growth."""
        return self._final_capacity is not None and self.capacity >= self._final_capacity

    def _next_capacity(self) -> int:
        """The slots of the next growth step: twice the slots, at most the final size."""
        cap = self.capacity * 2
        return cap if self._final_capacity is None else min(cap, self._final_capacity)

    def _more_slots(self) -> int:
        """The slots for a table at its final size whose bucket pair overflowed before its rows
        reached max_capacity (two-choice placement; rare at :data:`FULL_LOAD`): an eighth
        more, at least a bucket. max_capacity bounds the rows, not the slots."""
        return self.capacity + _whole_buckets(self.capacity // 8)

    def _grow(self) -> None:
        self._rehash(self._next_capacity())

    def _maybe_grow(self, bad_input: torch.Tensor | None = None) -> None:
        # Grow ahead of time when the table is already past grow_at; inserts that still
        # find no room trigger growth reactively (_no_room). A call refused for bad_input
        # must not grow either: read the flag first (growth reads the device back anyway).
        if self.size > self.grow_at * self.capacity and not self._at_max():
            _refuse_if_set(bad_input)
            self._grow()

    def _new_ids(self, ids: torch.Tensor, padding_id: int | None) -> int:
        """How many distinct ids of ``ids`` (but ``padding_id``) the table does not hold."""
        missing = ids[self.find(ids) < 0]
        if padding_id is not None:
            missing = missing[missing != padding_id]
        return int(missing.unique().numel())

    def _no_room(self, failed: int, ids: torch.Tensor | None = None, padding_id: int | None = None,
                 evict: bool = True) -> None:  # fmt: skip
        """After an insert of ``ids`` that found no room (and changed nothing): grows the
        table, or raises :class:`TableFullError`."""
        may_evict = evict and self.eviction_policy.evicts
        room = self._room()
        # Without eviction the call fails once its new ids pass the rows left (the ops'
        # room); else a bucket pair overflowed. Only a call of more ids than rows left can
        # be the former: count its new ids then.
        if not may_evict and room >= 0 and ids is not None and ids.numel() > room:
            new = self._new_ids(ids, padding_id)
            if new > room:
                if not self.eviction_policy.evicts:
                    raise TableFullError(
                        f"DynamicEmbedding table is full: it holds {self.size} rows of max_capacity "
                        f"{self.max_capacity} and {new} new id(s) arrived, with eviction='none'. Raise max_capacity, "
                        f"or set eviction='lru' or 'lfu' to evict cold rows. The table is unchanged."
                    )
                raise TableFullError(
                    f"DynamicEmbedding table is full: {new} new id(s) being loaded do not fit the {room} row(s) "
                    f"left of max_capacity {self.max_capacity} (size {self.size}); loading never evicts. Raise "
                    f"max_capacity. The table is unchanged."
                )
        if not self._at_max():
            self._grow()
            return
        if may_evict:  # each id past the room evicts: these found only rows the call touched
            raise TableFullError(
                f"DynamicEmbedding table cannot hold this batch: {failed} new id(s) found only rows touched by the "
                f"same batch to evict (size {self.size}, max_capacity {self.max_capacity}). The batch holds too "
                f"many distinct ids for max_capacity; raise max_capacity. The table is unchanged."
            )
        self._rehash(self._more_slots())

    def reserve(self, n: int) -> None:
        """Pre-sizes the table for ``n`` rows in one rehash, so that inserting up to ``n``
        rows never grows it (growing there from a small table rehashes every row at each
        doubling, at about twice the memory of the rows at the last one). The slots hold
        ``n`` rows at a load of ``min(grow_at, FULL_LOAD)`` at most, and at most the final
        size (:func:`final_capacity`); a table that has as many slots already is left as
        it is (reserve never shrinks).

        Raises:
            ValueError: ``n`` is not an int >= 0, or it is more than ``max_capacity``.
        """
        if not _is_int(n) or n < 0:
            raise ValueError(f"reserve: n must be an int >= 0, got {n!r}")
        if self.max_capacity is not None and n > self.max_capacity:
            raise ValueError(
                f"reserve: n ({n}) is more than max_capacity ({self.max_capacity}), the most rows this table holds; "
                f"raise max_capacity or reserve at most {self.max_capacity}"
            )
        target = _slots_for(n, min(self.grow_at, FULL_LOAD))
        if self._final_capacity is not None:
            target = min(target, self._final_capacity)
        if target > self.capacity:
            self._rehash(target)

    def resize(self, capacity: int) -> None:
        """Rehashes every entry into a table of ``capacity`` slots (rounded up to whole
        32-slot buckets; at most the final size :func:`final_capacity` of ``max_capacity``).
        Bumps :attr:`version`. A rehash whose two-choice placement overflows a bucket pair
        (rare) takes an eighth more slots and places them again. If memory runs out, it
        raises and the table is unchanged."""
        new_cap = _whole_buckets(max(int(capacity), 1))
        if self._final_capacity is not None:
            new_cap = min(new_cap, max(self._final_capacity, self.capacity))
        self._rehash(new_cap)

    def _rehash(self, new_cap: int) -> None:
        """:meth:`resize` to ``new_cap`` slots (whole buckets), whatever max_capacity says."""
        _ext.require()
        entries = self.export()
        if entries["keys"].numel() > new_cap:
            raise ValueError(f"cannot resize to {new_cap} slots: the table holds {entries['keys'].numel()} entries")
        dtype, device = self.weights.dtype, self.device
        saved = {name: self._buffers[name] for name in _STATE_NAMES}
        try:
            while True:
                self._allocate(new_cap, dtype, device)
                _, counts, _ = torch.ops.veloce.insert_or_assign(
                    *self._state(), entries["keys"], entries["weights"], entries["optimizer_state"],
                    entries["scores"], 0, 0, False,
                )  # fmt: skip
                if int(counts[1]) == 0:
                    break
                # Two-choice placement overflowed a bucket pair: rare; use more slots.
                new_cap += _whole_buckets(new_cap // 8)
        except BaseException:
            self._restore(saved)
            raise
        self.version += 1
        self._note_changed()

    def _restore(self, buffers: dict[str, torch.Tensor]) -> None:
        """Puts back the state buffers an allocation replaced (after a failed rehash or load)."""
        for name, t in buffers.items():
            self.register_buffer(name, t, persistent=False)
        self.row_dtype = self._buffers["weights"].dtype
        self._note_changed()  # work on them may be queued on the current stream since

    # ---- serialization ----------------------------------------------------------------
    def load_entries(self, entries: dict[str, torch.Tensor]) -> None:
        """Replaces the contents with exported ``entries`` (keys, weights,
        optimizer_state, scores), growing as needed. Checks shapes first."""
        for name, kinds in (("keys", "int"), ("weights", "float"), ("optimizer_state", "float"), ("scores", "int")):
            t = entries[name]
            ok = isinstance(t, torch.Tensor) and (
                t.dtype in (torch.int64, torch.int32) if kinds == "int" else t.is_floating_point()
            )
            if not ok:
                want = "an int64" if kinds == "int" else "a floating-point"
                got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} must be {want} tensor, got {got}")
        keys, weights = entries["keys"], entries["weights"]
        opt, scores = entries["optimizer_state"], entries["scores"]
        if keys.dim() != 1:
            raise ValueError(f"keys must be 1-D, got shape {tuple(keys.shape)}")
        n = keys.numel()
        if weights.dim() != 2 or weights.size(1) != self.dim:
            raise ValueError(f"weights must be (N, {self.dim}), got {tuple(weights.shape)}")
        if weights.size(0) != n or scores.numel() != n or opt.size(0) != n:
            raise ValueError(
                f"entries disagree on N: keys {n}, weights {weights.size(0)}, optimizer_state {opt.size(0)}, "
                f"scores {scores.numel()}"
            )
        if opt.dim() != 2 or opt.size(1) != self.state_dim:
            raise ValueError(
                f"optimizer_state must be (N, {self.state_dim}) for this table's optimizer, got {tuple(opt.shape)}"
            )
        if self.max_capacity is not None and n > self.max_capacity:
            raise ValueError(f"{n} entries do not fit max_capacity {self.max_capacity} (the most rows of this table)")
        distinct, counts = keys.unique(return_counts=True)
        if distinct.numel() != n:
            dup = int(distinct[counts > 1][0])
            raise ValueError(f"keys hold {n - distinct.numel()} repeated id(s) (id {dup} is one): each id must appear once")
        self.settle(refusals=False)  # the contents are replaced: a refused call (it changed nothing) is forgotten
        cap = self.capacity  # the slots that hold n rows without growth (as reserve(n) makes them)
        if n > self.grow_at * cap and not self._at_max():
            need = _slots_for(n, min(self.grow_at, FULL_LOAD))
            cap = max(cap, need if self._final_capacity is None else min(need, self._final_capacity))
        dev = self.device
        saved = ({name: self._buffers[name] for name in _STATE_NAMES}, self.size, self.version)
        self._allocate(cap, self.weights.dtype, dev)
        self.size = 0
        self.version += 1
        try:
            if n:
                self.insert(
                    keys.to(dev, torch.long), weights.to(dev, self.weights.dtype), opt.to(dev, self.opt_state.dtype),
                    scores.to(dev, torch.long), evict=False,
                )  # fmt: skip
        except Exception:
            buffers, self.size, self.version = saved  # the table as it was before the load
            self._restore(buffers)
            raise


def find_or_insert_many(
    tables: Sequence[HashTable],
    ids: Sequence[torch.Tensor],
    padding_ids: Sequence[int | None] | None = None,
    bad_input: torch.Tensor | None = None,
    on_refused: Callable[[], None] | None = None,
    allow_defer: bool = True,
) -> list[torch.Tensor]:
    """``[t.find_or_insert(i, p) for t, i, p in zip(tables, ids, padding_ids)]`` in one op.

    The result and every table's state are those of the separate calls. On CUDA the
    tables share their host syncs (one or two for the whole call instead of per
    table), which is what makes a step over many tables fast. Tables may differ in
    capacity, dim, dtype, policies and device (one op call per device), but each table
    is listed once. A table that finds no room grows (or evicts) and retries alone, as its own
    call would; if one raises :class:`TableFullError`, it is unchanged, the tables the
    op placed keep their inserts, and the other tables that found no room stay unchanged
    too (they are not retried).

    ``bad_input`` is :meth:`HashTable.find_or_insert`'s flag for the whole call: when it is
    true, ``ValueError`` is raised and no table changes. It rides on the one op call, so
    every table must be on its device. When every table defers (:class:`HashTable`,
    ``defer``), the call reads nothing back and a set flag is raised later, as
    :meth:`HashTable.find_or_insert` says (``on_refused``, ``allow_defer``).
    """
    padding_ids = [None] * len(tables) if padding_ids is None else list(padding_ids)
    if not len(tables) == len(ids) == len(padding_ids):
        raise ValueError(
            f"find_or_insert_many: one entry per table: {len(tables)} tables, {len(ids)} id tensors, "
            f"{len(padding_ids)} padding ids"
        )
    if len({id(t) for t in tables}) < len(tables):
        raise ValueError(
            "find_or_insert_many: a table is listed twice; pass each table once (an insert into a table "
            "can move the rows of the slots an earlier call returned)"
        )
    if bad_input is not None and (not tables or any(t.device != bad_input.device for t in tables)):
        where = ", ".join(sorted({str(t.device) for t in tables})) or "no device (no tables)"
        raise ValueError(
            f"find_or_insert_many: bad_input is on {bad_input.device} but the tables are on {where}; one flag "
            f"covers one op call, so every table (at least one) must be on its device"
        )
    by_device: dict[torch.device, list[int]] = {}
    for k, t in enumerate(tables):
        by_device.setdefault(t.device, []).append(k)
    out: list[Optional[torch.Tensor]] = [None] * len(tables)
    for batch in by_device.values():
        if len(batch) == 1:
            out[batch[0]] = tables[batch[0]].find_or_insert(ids[batch[0]], padding_ids[batch[0]], bad_input,
                                                            on_refused, allow_defer)  # fmt: skip
            continue
        slots = _find_or_insert_batch([tables[k] for k in batch], [ids[k] for k in batch],
                                      [padding_ids[k] for k in batch], bad_input, on_refused, allow_defer)  # fmt: skip
        for k, s in zip(batch, slots):
            out[k] = s
    return out  # type: ignore[return-value]


def _find_or_insert_batch(tables: Sequence[HashTable], ids: Sequence[torch.Tensor],
                          padding_ids: Sequence[int | None], bad_input: torch.Tensor | None = None,
                          on_refused: Callable[[], None] | None = None,
                          allow_defer: bool = True) -> list[torch.Tensor]:  # fmt: skip
    """find_or_insert_many over distinct tables: one op call, then per-table growth retries
    (or one deferred op call, when every table may defer)."""
    _ext.require()
    with _ticked_clocks(tables) as booked:
        if allow_defer and all(t._deferrable([i], bad_input) for t, i in zip(tables, ids)):
            out = _insert_deferred(tables, ids, padding_ids, bad_input, on_refused)
            booked.update(id(t) for t in tables)
            return out
        for t in tables:
            t._maybe_grow(bad_input)
        evict = [t._allow_evict() for t in tables]
        args = [t._find_or_insert_args(i, p, e) for t, i, p, e in zip(tables, ids, padding_ids, evict)]
        states = list(zip(*(t._state(join=e) for t, e in zip(tables, evict))))
        per_arg = [list(a) for a in zip(*args)]
        rooms = [t._room() for t in tables]
        room = None if all(r < 0 for r in rooms) else rooms
        inits = [t._initial_state() for t in tables]
        init_state = None if all(i is None for i in inits) else inits
        slots, counts, evicted = insert_beside_updates(
            tables, lambda: torch.ops.veloce.find_or_insert_many(*states, *per_arg, bad_input, room=room,
                                                                 init_state=init_state)  # fmt: skip
        )
        out = list(slots.split([i.numel() for i in ids]))
        counts = counts.tolist()  # a CPU tensor: no device sync
        num_evicted = [c[2] for c in counts]
        # Nothing evicted (the rule): each table's last_evicted is the empty whole, not a split of it.
        evicted = evicted.split(num_evicted) if any(num_evicted) else [evicted] * len(tables)
        for k, (t, (inserted, failed, _)) in enumerate(zip(tables, counts)):
            if failed == 0:
                t._note_inserted(inserted, evicted[k])
                booked.add(id(t))
        for k, (t, (_, failed, _)) in enumerate(zip(tables, counts)):  # after every success is booked
            if failed == 0:
                continue
            t._no_room(failed, ids[k], padding_ids[k])  # grows, or raises TableFullError; the table is unchanged
            out[k] = t._insert(t._find_or_insert_call(ids[k], padding_ids[k]), ids=ids[k], padding_id=padding_ids[k])
            booked.add(id(t))
    return out


class _DeferredCounts:
    """The counts of one deferred insert on their way to the host: on CUDA copied into
    pinned memory behind the op, on its stream, with an event after the copy (on the CPU
    they are there already). Shared by the tables of the call (one row each)."""

    __slots__ = ("event", "host", "on_refused", "refused_raised", "rows")

    def __init__(self, counts: torch.Tensor, on_refused: Callable[[], None] | None) -> None:
        self.host, self.event = counts, None
        if counts.is_cuda:
            self.host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
            self.host.copy_(counts, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(current_stream(counts.device))
        self.rows: Optional[list[list[int]]] = None  # the host values, once read
        self.on_refused = on_refused
        self.refused_raised = False

    def arrived(self, wait: bool) -> bool:
        """Whether the counts are on the host (with ``wait``: after waiting for them)."""
        if self.rows is None:
            if self.event is not None:
                if wait:
                    self.event.synchronize()
                elif not self.event.query():
                    return False
            rows = self.host.tolist()
            self.rows = rows if self.host.dim() == 2 else [rows]  # one table's (2,): one row
        return True

    def row(self, k: int) -> tuple[int, int]:
        """Table k's ``(inserted, failed)``; failed -1: refused for bad_input."""
        assert self.rows is not None
        return self.rows[k][0], self.rows[k][1]

    def refuse(self) -> None:
        """Raises the call's bad_input error, once for all its tables: ``on_refused()`` when
        given (it may return when it raised for another call already), else a ValueError."""
        if self.refused_raised:
            return
        self.refused_raised = True
        if self.on_refused is not None:
            self.on_refused()
            return
        _raise_refused()


def _insert_deferred(tables: Sequence[HashTable], ids: Sequence[torch.Tensor], padding_ids: Sequence[int | None],
                     bad_input: torch.Tensor | None,
                     on_refused: Callable[[], None] | None) -> list[torch.Tensor]:  # fmt: skip
    """One find_or_insert(_many) op over distinct CUDA tables on one device with ``defer``
    (the tables said yes to :meth:`HashTable._deferrable`): the slots now, the counts later
    (:class:`_DeferredCounts`, read by :meth:`HashTable.settle`)."""
    capture = _capture.ACTIVE
    if capture is None:
        for t in tables:
            if t._unread:  # keep the list short: read what arrived (one event query per call)
                t.settle(wait=False)
    args = [t._find_or_insert_args(i, p, False) for t, i, p in zip(tables, ids, padding_ids)]
    states = [t._state(join=False) for t in tables]
    inits = [t._initial_state() for t in tables]
    # Captured in a CUDA graph: the LRU stamps come from device clocks the graph ticks.
    clocks = None if capture is None else [capture.clock_of(t) for t in tables]

    def call() -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        if len(tables) == 1:  # counts (2,): _DeferredCounts reads it as one row
            clock = None if clocks is None else clocks[0]
            slots, counts, evicted = torch.ops.veloce.find_or_insert(*states[0], *args[0], bad_input, True, clock,
                                                                     init_state=inits[0])  # fmt: skip
            out = [slots]
        else:
            cols, per_arg = [list(c) for c in zip(*states)], [list(a) for a in zip(*args)]
            clock = None if clocks is None else torch.cat(clocks)
            init_state = None if all(i is None for i in inits) else inits
            slots, counts, evicted = torch.ops.veloce.find_or_insert_many(*cols, *per_arg, bad_input, True, clock,
                                                                          init_state=init_state)  # fmt: skip
            out = list(slots.split([i.numel() for i in ids]))
        return out, counts, evicted

    out, counts, evicted = insert_beside_updates(tables, call)
    if capture is not None:  # read after each replay by the step wrapper (veloce.graphs)
        capture.inserts.append(_capture.InsertLog(list(tables), [i.numel() for i in ids], counts, on_refused))
    else:
        deferred = _DeferredCounts(counts, on_refused)  # the copy queued on the op's stream
        for k, (t, i) in enumerate(zip(tables, ids)):
            t._unread.append((deferred, k, i.numel()))
    for t in tables:
        t._note_inserted(0, evicted)  # none evicted; what it inserted is booked when read (settle)
    return out


def insert_beside_updates(tables: Sequence[HashTable], call: Callable[[], _T]) -> _T:
    """``call()``, an inserting op over ``tables`` whose states were taken (joined where the
    insert may evict), or a training forward's input checks and insert. While one of them
    still has an update in flight, it runs on the high-priority insert stream, beside that
    update (:func:`veloce._update_stream.beside_updates`)."""
    for t in tables:
        if t._update_fence is not None and t.device.type == "cuda":
            return beside_updates(t.device, call)
    return call()


def _refuse_if_set(bad_input: torch.Tensor | None) -> None:
    """Raises the ValueError of a refused call (as the op would) when ``bad_input`` is set.
    Reads the flag back: only for paths that wait for the device anyway (growth)."""
    if bad_input is not None and bool(bad_input):
        _raise_refused()


def _raise_refused() -> NoReturn:
    """The ValueError of a call refused for its ``bad_input`` (as the op raises it)."""
    raise ValueError(
        "find_or_insert: bad_input is set: the caller's check of this call's input failed; nothing was "
        "inserted and no table was changed"
    )


@contextlib.contextmanager
def _ticked_clocks(tables: Sequence[HashTable]) -> Iterator[set[int]]:
    """Around a find_or_insert of ``tables``: ticks their LRU clocks (one tick per training
    lookup). The call adds ``id(t)`` to the yielded set for each table whose insert it
    booked. If it raises an error that leaves the tables it did not book unchanged (bad
    input or a refused ``bad_input``: ValueError; no room: TableFullError), their ticks are
    taken back, so that the call leaves no trace in them (their state_dicts included).
    Other errors (out of memory, an interrupt) may come after an op stamped rows with the
    tick: it stays."""
    for t in tables:
        t.clock += 1
    booked: set[int] = set()
    try:
        yield booked
    except (ValueError, TableFullError):
        for t in tables:
            if id(t) not in booked:
                t.clock -= 1
        raise
    for t in tables:  # after the inserts stamped this lookup's rows: expiry never takes them
        if t.eviction_policy.expires:
            t._expire_due()
