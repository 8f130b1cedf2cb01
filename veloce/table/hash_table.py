"""The hash table behind a :class:`veloce.DynamicEmbedding`: state as tensors, and growth.

A :class:`HashTable` owns five buffers (``keys``, ``digests``, ``scores``, ``weights``,
``opt_state``; layout in ``docs/ops.md``) and drives the ``torch.ops.veloce`` hash-table
ops over them; the layers above read and update its rows through the row-store calls
(:class:`~veloce.table.rows.RowStore`). The ops never allocate table state; growth
happens here: past ``grow_at``, or when an insert finds no room, the table rehashes into
twice the slots and the call is retried. ``max_capacity`` bounds the rows (``len``), exactly: the slots stop growing at
:func:`final_capacity` (``max_capacity`` rows at load :data:`FULL_LOAD`), and the inserts
keep to the rows left (the ops' ``room``). A new id that arrives at ``len ==
max_capacity`` evicts a row by score (LRU or LFU) or, with ``eviction="none"``, raises an
error that says how full it is and what to change. (Memory per row: ``docs/memory.md``.)

Every change of the id -> slot mapping of keys already present (growth, eviction,
erase) bumps :attr:`HashTable.version`; holders of slots (pending gradients, saved
autograd contexts) compare versions and re-resolve their slots by key.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import nn

from veloce.init import Initializer
from veloce.ops import extension as _ext
from veloce.ops import hash_table as _ops
from veloce.runtime import capture as _capture
from veloce.runtime.attrs import PlainAttrs
from veloce.runtime.device import current_stream
from veloce.runtime.memory import empty_table
from veloce.runtime.update_stream import UpdateFence, release_done, wait_prefetch_origin
from veloce.table.admitting import Admitting
from veloce.table.batch import DeferredCounts, _insert_deferred, _ticked_clocks, insert_beside_updates
from veloce.table.capacity import FULL_LOAD, STATE_NAMES, final_capacity, is_int, is_int64, round_capacity, slots_for, state_dtype
from veloce.table.deferred import DeferredInserts
from veloce.eviction import EvictionPolicy, resolve
from veloce.table.growth import Growth
from veloce.table.health import TableHealth
from veloce.table.hooks import StoreHooks
from veloce.table.rows import RowStore
from veloce.table.versions import RemovedLog, RowVersions

__all__ = ["HashTable"]

_EXPORT_CHUNK = 1 << 20


class TableSnapshot(NamedTuple):
    """A table's contents as :meth:`HashTable.snapshot` keeps them."""

    buffers: dict[str, torch.Tensor]
    size: int
    version: int
    clock: int


class HashTable(RowStore, RowVersions, StoreHooks, TableHealth, DeferredInserts, Growth, Admitting, PlainAttrs,
                nn.Module):  # fmt: skip
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
        eviction: str | EvictionPolicy = "lru",
        initializer: Initializer = Initializer(0),
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        grow_at: float = 0.9,
        init_state: Optional[torch.Tensor] = None,
    ) -> None:
        super().__init__()
        policy = resolve(eviction)
        if not 0.0 < grow_at <= 1.0:
            raise ValueError(f"grow_at must be in (0, 1], got {grow_at}")
        for name, value in (("capacity", capacity), ("max_capacity", max_capacity)):
            if value is not None and (not is_int(value) or value < 1):
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
        self._unread: list[tuple[DeferredCounts, int, int]] = []  # (counts, row, ids) per unread call
        self.version = 0  # bumped whenever a present key may change slot
        self.clock = 0  # LRU time: one tick per training lookup
        self.num_evicted = 0
        self.num_expired = 0  # rows a time-to-live policy erased
        self.removed_log = RemovedLog()  # tombstones, once track_removed() starts it (veloce.table.versions)
        self.last_evicted = torch.empty(0, dtype=torch.long)
        self._update_fence = None
        self._changed = None
        self._allocate(cap, dtype, torch.device(device) if device is not None else torch.device("cpu"))

    # Bookkeeping set on every training lookup (see PlainAttrs).
    _PLAIN_ATTRS = frozenset({"_size", "version", "clock", "num_evicted", "last_evicted", "_update_fence", "_changed",
                              "num_expired"})

    # The sparse update last queued on a side stream (veloce.runtime.update_stream), until a use of
    # the rows waited for it.
    _update_fence: UpdateFence | None = None
    # After a change of the state outside the training inserts, queued on CUDA and not
    # waited for (clear, erase, resize, insert_or_assign, load_entries): (event, stream),
    # until an op on another stream waited for it. An insert of HybridParallel.prefetch
    # (or of a forward whose exchange was prefetched) runs on the prefetch stream without
    # waiting for the current stream; it must still come after such a change.
    _changed: Any = None

    # The rows' dtype, kept beside the buffers as a plain attribute: a compiled graph reads this
    # (veloce.sparse.compile), where reading the buffer's dtype would tie the graph to the buffer and
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
        that may not evict skips it (:mod:`veloce.runtime.update_stream` says why that is safe)."""
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
        state.setdefault("eviction_policy", resolve(state["eviction"]))
        state.setdefault("num_expired", 0)
        state.setdefault("removed_log", RemovedLog())
        state.setdefault("init_state", None)
        state.setdefault("_init_state_at", None)
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
    def state_dtype(self) -> torch.dtype:
        """The optimizer state's dtype (read without waiting for an update in flight)."""
        return self._buffers["opt_state"].dtype

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
            + ("" if self.admission.admits_all else f", admission={self.admission!r}")
        )

    # ---- lookups ----------------------------------------------------------------------
    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """Slots of ``ids`` (N,), -1 where absent. Never inserts, never scores."""
        _ext.require()
        return _ops.find(self.keys, self.digests, ids)

    def find_or_insert(
        self,
        ids: torch.Tensor,
        padding_id: int | None = None,
        bad_input: torch.Tensor | None = None,
        on_refused: Callable[[], None] | None = None,
        allow_defer: bool = True,
        sightings: torch.Tensor | None = None,
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

        With an admission policy (:meth:`set_admission`), the call counts its ids'
        sightings and an absent id the policy refuses is not inserted: its slot is the
        capacity ``C``, which the lookups serve from :meth:`default_rows`. ``sightings``:
        optional (N,) integer tensor, the occurrences each position stands for (a sharded
        owner's insert of deduplicated ids; :func:`veloce.admission.count_sightings`).
        """
        self.prepare_insert(ids, padding_id, bad_input)
        admit = self._admit_of(ids, padding_id, bad_input, sightings)
        with _ticked_clocks([self]) as booked:
            if allow_defer and self._deferrable([ids], bad_input):
                (slots,) = _insert_deferred([self], [ids], [padding_id], bad_input, on_refused, [admit])
            else:
                slots = self._insert(self._find_or_insert_call(ids, padding_id, bad_input, admit), bad_input=bad_input,
                                     ids=ids, padding_id=padding_id)  # fmt: skip
            booked.add(id(self))
        self._note_admission(slots, sightings)
        return slots


    def _find_or_insert_call(self, ids: torch.Tensor, padding_id: int | None,
                             bad_input: torch.Tensor | None = None, admit: torch.Tensor | None = None):  # fmt: skip
        """The op call ``allow_evict -> (slots, counts, evicted)`` that :meth:`_insert` retries
        (a retry passes ``bad_input`` again: it was false, or the first call had raised;
        and the same ``admit``: the sightings are counted once)."""
        def call(evict: bool):
            state = self._state(join=evict)
            room = self._room()
            init_state = self._initial_state()
            return insert_beside_updates([self], lambda: _ops.find_or_insert(
                *state, *self._find_or_insert_args(ids, padding_id, evict), bad_input=bad_input, room=room,
                init_state=init_state, admit=admit,
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
                lambda allow_evict: _ops.insert_or_assign(
                    *self._state(), ids, values, opt_values, score_values, score_policy=self.score_policy,
                    score_value=self.clock, allow_evict=allow_evict, room=self._room(),
                    init_state=self._initial_state(),
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
            self._log_removed(evicted, outside_lookup=False)
            self._record_evicted(evicted)  # the health telemetry's record (veloce.table.health)

    def erase(self, ids: torch.Tensor) -> int:
        """Removes ``ids``; returns how many were present."""
        return self._erase_ids(ids, log=True)

    def _erase_ids(self, ids: torch.Tensor, log: bool = False) -> int:
        """:meth:`erase`; ``log`` books the erased ids as tombstones (a removal from the
        table, not a move between tiers)."""
        _ext.require()
        self.settle()  # first: a refused deferred call raises before anything changes
        self._join_update()  # a freed slot may be filled by the next insert
        present = _ops.erase(self.keys, self.digests, ids)
        erased = int(present.sum())
        self._note_changed()
        if erased:
            self.size -= erased
            self.version += 1
            if log:
                self._log_removed(ids[present])
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
        if self.tracks_removed():
            self._log_removed(keys[(digests != 0) & (scores < before)])
        erased = int(_ops.expire(keys, digests, scores, int(before)))
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
        return self._export_slots(start, end)

    def _export_slots(self, start: int = 0, end: Optional[int] = None) -> dict[str, torch.Tensor]:
        """:meth:`export` of the table's own slots (what a rehash moves; a tiered table's
        export adds the rows below its cache)."""
        _ext.require()
        end = self.capacity if end is None else end
        parts = [
            _ops.export(*self._state(), s, min(s + _EXPORT_CHUNK, end))
            for s in range(start, end, _EXPORT_CHUNK)
        ] or [_ops.export(*self._state(), start, end)]
        names = ("keys", "weights", "optimizer_state", "scores")
        return {name: torch.cat([p[i] for p in parts]) for i, name in enumerate(names)}

    def clear(self) -> None:
        """Removes every entry (keeps the capacity)."""
        self.settle()  # first: a refused deferred call raises before anything changes
        self._join_update()
        self.digests.zero_()
        self._stop_removed()
        self.size = 0
        self.version += 1
        self._note_changed()

    # ---- serialization ----------------------------------------------------------------
    def snapshot(self) -> TableSnapshot:
        """What :meth:`restore` puts back after a failed :meth:`load_entries` elsewhere (a
        checkpoint load rolled back on every rank): the state buffers, kept rather than
        copied (a load replaces them, it does not write into them), size, version and clock."""
        buffers = {name: self._buffers[name] for name in STATE_NAMES}
        return TableSnapshot(buffers, self.size, self.version, self.clock)

    def restore(self, snapshot: TableSnapshot) -> None:
        """Puts back the contents :meth:`snapshot` kept."""
        self._restore(snapshot.buffers)
        self.size, self.version, self.clock = snapshot.size, snapshot.version, snapshot.clock

    def load_entries(self, entries: dict[str, torch.Tensor]) -> None:
        """Replaces the contents with exported ``entries`` (keys, weights,
        optimizer_state, scores), growing as needed. Checks shapes first."""
        self._load_checked(entries, self._check_entries(entries))

    def _check_entries(self, entries: dict[str, torch.Tensor]) -> int:
        """Checks exported ``entries`` against the table (dtypes, shapes, ``max_capacity``,
        distinct keys) before anything changes; returns their number."""
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
        return n

    def _load_checked(self, entries: dict[str, torch.Tensor], n: int) -> None:
        """:meth:`load_entries` of ``n`` entries that passed :meth:`_check_entries`."""
        keys, weights = entries["keys"], entries["weights"]
        opt, scores = entries["optimizer_state"], entries["scores"]
        self.settle(refusals=False)  # the contents are replaced: a refused call (it changed nothing) is forgotten
        cap = self.capacity  # the slots that hold n rows without growth (as reserve(n) makes them)
        if n > self.grow_at * cap and not self._at_max():
            need = slots_for(n, min(self.grow_at, FULL_LOAD))
            cap = max(cap, need if self._final_capacity is None else min(need, self._final_capacity))
        dev = self.device
        saved = ({name: self._buffers[name] for name in STATE_NAMES}, self.size, self.version)
        self._stop_removed()
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
