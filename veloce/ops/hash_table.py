"""Typed wrappers and fake kernels for the hash_table ops (``csrc/cpu/hash_table.cpp``).

A table is a set of tensors of ``C = num_buckets * 32`` slots, any ``num_buckets`` from 1 to
2^32 (docs/ops.md, "Table layout"):

Shape:
    - keys: (C,) int64, the id stored in each slot.
    - digests: (C,) uint8, 0 = empty slot.
    - scores: (C,) int64, eviction score (LRU last-seen step or LFU count).
    - weights: (C, D) float32, float64, float16 or bfloat16.
    - opt_state: (C, S) float32 (float64 with float64 weights); S may be 0.

Every int64 value is a valid id. Ops that insert return ``counts = [num_inserted,
num_failed]``, a CPU tensor on every backend (reading it never waits for the device);
``num_failed > 0`` means the table had no room and nothing was changed.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from veloce.ops import extension as _ext

__all__ = [
    "SCORE_NONE",
    "SCORE_LRU",
    "SCORE_LFU",
    "INIT_ZEROS",
    "INIT_CONSTANT",
    "INIT_UNIFORM",
    "INIT_NORMAL",
    "find",
    "find_or_insert",
    "find_or_insert_many",
    "insert_or_assign",
    "erase",
    "expire",
    "export",
    "initialize",
]

SCORE_NONE, SCORE_LRU, SCORE_LFU = 0, 1, 2
INIT_ZEROS, INIT_CONSTANT, INIT_UNIFORM, INIT_NORMAL = 0, 1, 2, 3


def find(keys: Tensor, digests: Tensor, ids: Tensor) -> Tensor:
    """Looks ids up without inserting.

    Args:
        keys: (C,) int64 table keys.
        digests: (C,) uint8 table digests.
        ids: (N,) int64 ids, any value.

    Returns:
        slots: the slot of each id, -1 where the id is absent.

    Shape:
        keys (C,), digests (C,), ids (N,) -> slots (N,) int64.

    Example::

        slots = find(keys, digests, torch.tensor([3, -7]))
    """
    _ext.require()
    return torch.ops.veloce.find(keys, digests, ids)


def find_or_insert(
    keys: Tensor,
    digests: Tensor,
    scores: Tensor,
    weights: Tensor,
    opt_state: Tensor,
    ids: Tensor,
    score_policy: int = SCORE_NONE,
    score_value: int = 0,
    allow_evict: bool = False,
    seed: int = 0,
    init_kind: int = INIT_ZEROS,
    init_a: float = 0.0,
    init_b: float = 0.0,
    padding_id: Optional[int] = None,
    bad_input: Tensor | None = None,
    defer: bool = False,
    clock: Tensor | None = None,
    room: int = -1,
    init_state: Tensor | None = None,
    admit: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Looks ids up, inserting the missing ones; mutates the table tensors in place.

    New rows get ``initialize(id, ...)`` values and the optimizer state ``init_state``
    (zeros when None). Scores follow
    ``score_policy`` (0 none, 1 LRU: set to ``score_value``, 2 LFU: +1 per occurrence).
    With ``allow_evict``, a key whose two buckets are full replaces the lowest-scored key
    there that this call did not touch.

    ``bad_input`` lets a caller check its input on the device without a host sync of its
    own: the op reads the flag with its first device read-back (on CUDA in the same copy
    as the count of missing ids, which it reads anyway) and, when it is true, raises
    ``ValueError`` before changing the table (nothing inserted, no score changed).

    Args:
        keys, digests, scores, weights, opt_state: the table (mutated).
        ids: (N,) int64 ids.
        score_policy: 0 none, 1 LRU, 2 LFU.
        score_value: the LRU score (e.g. the step number).
        allow_evict: evict instead of failing when both buckets are full.
        seed, init_kind, init_a, init_b: the initializer (see :func:`initialize`).
        padding_id: positions holding this id get slot -1 and are ignored.
        bad_input: optional one-element bool tensor on the table's device, the result of
            the caller's own check of this call's input; true raises ``ValueError`` and
            changes nothing.
        defer: read nothing back from the device (on CUDA: no host sync). ``counts`` is
            then a tensor on the table's device, valid once the op's work has run, and a
            set ``bad_input`` is reported instead of raised: ``num_failed = -1``, nothing
            changed. A deferred call never evicts (``allow_evict`` must be False) and, on
            CUDA, cannot run under ``torch.use_deterministic_algorithms(True)``; the
            caller decides growth without the count (``veloce.table.HashTable`` bounds it
            by the positions of the calls not read yet).
        clock: optional (1,) int64 tensor on the table's device that replaces
            ``score_value``, read on the device (on CUDA by the kernels, no host read): a
            call captured in a CUDA graph stamps the value the tensor holds when the graph
            is replayed. Its value is checked on no backend (any int64 is a score).
        room: how many new ids may take an empty slot (the rows left to a table bounded
            by ``max_capacity``), or -1 for no limit. In order of first occurrence, the
            first ``room`` new ids take empty slots (an id whose two buckets are full
            evicts, with ``allow_evict``); each later one evicts the lowest-scored occupied
            key of its buckets that the call did not touch (``allow_evict``), else the call
            fails and changes nothing, with ``num_failed = new ids - room``. -1 with ``defer``.
        init_state: optional (S,) tensor of ``opt_state``'s dtype and device: the optimizer
            state every new row starts from (the optimizer's
            :meth:`~veloce.optim.SparseOptimizer.initial_state`); None starts them at zeros.
        admit: optional (N,) bool tensor on the ids' device, one per id (None admits
            every id): an id absent from the table at a position whose ``admit`` is false
            is not inserted nor scored and gets the slot C (the capacity, ``keys.numel()``:
            the pooling ops' extra row 0, where :mod:`veloce.admission`'s default row
            goes); present ids are found as always. The repeats of an id should agree (a
            refused position of an id that another position inserts still gets C).

    Returns:
        ``(slots, counts, evicted_keys)``: slots (N,) int64; counts (2,) int64 on the CPU
        (with ``defer``: on the table's device) = ``[num_inserted, num_failed]`` (when
        ``num_failed != 0`` the table is unchanged and every slot is -1); evicted_keys (E,)
        int64.

    Shape:
        ids (N,) -> slots (N,), counts (2,), evicted_keys (E,) with E <= num_inserted.

    Example::

        t = [torch.zeros(64, dtype=torch.int64), torch.zeros(64, dtype=torch.uint8),
             torch.zeros(64, dtype=torch.int64), torch.zeros(64, 8), torch.zeros(64, 0)]
        slots, counts, evicted = find_or_insert(*t, torch.tensor([5, -1, 5]), seed=1,
                                                init_kind=INIT_NORMAL, init_b=0.01)
    """
    _ext.require()
    return torch.ops.veloce.find_or_insert(
        keys, digests, scores, weights, opt_state, ids, score_policy, score_value, allow_evict,
        seed, init_kind, init_a, init_b, padding_id, bad_input, defer, clock, room, init_state, admit,
    )


def find_or_insert_many(
    tables: Sequence[Sequence[Tensor]],
    ids: Sequence[Tensor],
    score_policy: Sequence[int],
    score_value: Sequence[int],
    allow_evict: Sequence[bool],
    seed: Sequence[int],
    init_kind: Sequence[int],
    init_a: Sequence[float],
    init_b: Sequence[float],
    padding_id: Sequence[Optional[int]],
    bad_input: Tensor | None = None,
    defer: bool = False,
    clock: Tensor | None = None,
    room: Sequence[int] | None = None,
    init_state: Sequence[Tensor | None] | None = None,
    admit: Sequence[Tensor | None] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`find_or_insert` on K tables in one op: entry k of every argument is table k's.

    The results and tables equal those of K separate calls. On CUDA the calls share their
    host syncs: one, or two when some new ids share buckets that may both fill up during
    the call (near capacity), however many tables there are (separate calls sync that often
    each).
    The tables must be distinct and on one device; they may differ in everything else.

    Args:
        tables: K tables, each ``(keys, digests, scores, weights, opt_state)`` (mutated).
        ids: K id tensors (N_k,) int64.
        score_policy, score_value, allow_evict, seed, init_kind, init_a, init_b,
            padding_id: K values each, as for :func:`find_or_insert`.
        bad_input: one flag for the whole call, as for :func:`find_or_insert` (on the
            tables' device, read with the call's first read-back): true raises
            ``ValueError`` and changes no table. It needs at least one table.
        defer: as for :func:`find_or_insert`: no device read-back, counts on the tables'
            device (a set ``bad_input`` gives every table ``num_failed = -1``; evicted 0).
        clock: as for :func:`find_or_insert`, (K,) int64: ``clock[k]`` replaces
            ``score_value[k]``.
        room: K values as for :func:`find_or_insert`, or None (no limit for any table).
        init_state: K entries as for :func:`find_or_insert` (None for zeros), or None
            (zeros for every table).
        admit: K entries as for :func:`find_or_insert` (None admits every id), or None
            (every id of every table admitted).

    Returns:
        ``(slots, counts, evicted_keys)``, each table's results concatenated in table order
        (one tensor each, not lists, so that torch.compile can trace the op): slots
        (sum N_k,) int64; counts (K, 3) int64 on the CPU, row k = table k's
        ``[num_inserted, num_failed, num_evicted]`` (a table with failures is unchanged,
        the others are not); evicted_keys (sum of num_evicted,). Split them with
        ``slots.split([len(i) for i in ids])`` and ``evicted_keys.split(counts[:, 2].tolist())``.

    Example::

        def table(c):
            return [torch.zeros(c, dtype=torch.int64), torch.zeros(c, dtype=torch.uint8),
                    torch.zeros(c, dtype=torch.int64), torch.zeros(c, 8), torch.zeros(c, 0)]
        slots, counts, _ = find_or_insert_many([table(64), table(128)], [torch.tensor([5, 6]), torch.tensor([5])],
                                               [0, 0], [0, 0], [False, False], [1, 2], [0, 0], [0.0, 0.0],
                                               [0.0, 0.0], [None, None])
    """
    _ext.require()
    # No tensor to dispatch on (with a flag the op runs: it rejects a flag without tables).
    if not len(tables) and bad_input is None:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, 3, dtype=torch.int64), torch.empty(0, dtype=torch.int64)
    cols = [list(c) for c in zip(*tables)] or [[]] * 5
    return torch.ops.veloce.find_or_insert_many(
        *cols, list(ids), list(score_policy), list(score_value), list(allow_evict), list(seed), list(init_kind),
        list(init_a), list(init_b), list(padding_id), bad_input, defer, clock,
        None if room is None else list(room), None if init_state is None else list(init_state),
        None if admit is None else list(admit),
    )  # fmt: skip


def insert_or_assign(
    keys: Tensor,
    digests: Tensor,
    scores: Tensor,
    weights: Tensor,
    opt_state: Tensor,
    ids: Tensor,
    values: Tensor,
    opt_values: Optional[Tensor] = None,
    score_values: Optional[Tensor] = None,
    score_policy: int = SCORE_NONE,
    score_value: int = 0,
    allow_evict: bool = False,
    room: int = -1,
    init_state: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Writes rows for ids, inserting the missing ones; mutates the table tensors in place.

    With duplicate ids the last occurrence wins. ``opt_values`` and ``score_values`` are
    written when given; otherwise new rows get ``init_state`` (zeros when None) and scores
    follow the policy.

    Args:
        keys, digests, scores, weights, opt_state: the table (mutated).
        ids: (N,) int64 ids.
        values: (N, D) rows, same dtype as weights.
        opt_values: optional (N, S) optimizer state, same dtype as opt_state.
        score_values: optional (N,) int64 scores.
        score_policy, score_value, allow_evict, room, init_state: as in :func:`find_or_insert`.

    Returns:
        ``(slots, counts, evicted_keys)`` as in :func:`find_or_insert`.

    Shape:
        ids (N,), values (N, D), opt_values (N, S), score_values (N,) -> slots (N,),
        counts (2,), evicted_keys (E,).
    """
    _ext.require()
    return torch.ops.veloce.insert_or_assign(
        keys, digests, scores, weights, opt_state, ids, values, opt_values, score_values,
        score_policy, score_value, allow_evict, room, init_state,
    )


def erase(keys: Tensor, digests: Tensor, ids: Tensor) -> Tensor:
    """Removes ids from the table (clears their digests in place).

    Shape:
        ids: (N,) int64. Returns erased: (N,) bool, true at the first position of each
        id that was present.
    """
    _ext.require()
    return torch.ops.veloce.erase(keys, digests, ids)


def expire(keys: Tensor, digests: Tensor, scores: Tensor, before: int) -> Tensor:
    """Removes every occupied slot whose score is below ``before`` (clears its digest in
    place): a time-to-live's expiry, where the scores are LRU's last-seen steps. One pass
    over the slots; no host sync.

    Args:
        keys, digests: the table's key columns (digests mutated).
        scores: (C,) int64, the table's scores.
        before: slots scored below it are erased.

    Returns:
        erased: a 0-dim int64 tensor on the table's device, the number of slots erased.

    Example::

        n = expire(keys, digests, scores, clock - steps)  # rows not seen in the last `steps` ticks
    """
    _ext.require()
    return torch.ops.veloce.expire(keys, digests, scores, before)


def export(
    keys: Tensor, digests: Tensor, scores: Tensor, weights: Tensor, opt_state: Tensor, start: int, end: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The entries of the occupied slots in ``[start, end)``, in slot order.

    Shape:
        Returns keys (M,), weights (M, D), opt_state (M, S), scores (M,).
    """
    _ext.require()
    return torch.ops.veloce.export(keys, digests, scores, weights, opt_state, start, end)


def initialize(
    ids: Tensor,
    dim: int,
    seed: int = 0,
    init_kind: int = INIT_ZEROS,
    init_a: float = 0.0,
    init_b: float = 0.0,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The initializer's rows for ids: a deterministic function of ``(seed, id, column)``.

    Args:
        ids: (N,) int64.
        dim: row width D.
        init_kind: 0 zeros, 1 constant ``init_a``, 2 uniform(``init_a``, ``init_b``),
            3 normal(mean ``init_a``, std ``init_b``).

    Shape:
        Returns (N, dim) of ``dtype`` on ids' device.
    """
    _ext.require()
    return torch.ops.veloce.initialize(ids, dim, seed, init_kind, init_a, init_b, dtype)


# ---- fake (meta) kernels ---------------------------------------------------------------


def _check_table_fake(op: str, keys: Tensor, ids: Tensor) -> None:
    torch._check(ids.dtype == torch.int64, lambda: f"veloce::{op}: ids must be int64, got {ids.dtype}")
    torch._check(ids.dim() == 1, lambda: f"veloce::{op}: ids must be 1-D, got {ids.dim()}-D")
    torch._check(
        ids.device == keys.device,
        lambda: f"veloce::{op}: ids is on {ids.device} but keys is on {keys.device}",
    )


def _check_bad_input_fake(op: str, keys: Tensor, bad_input: Tensor | None) -> None:
    if bad_input is None:
        return
    torch._check(
        bad_input.dtype == torch.bool and bad_input.numel() == 1,
        lambda: f"veloce::{op}: bad_input must be a bool tensor of one element, got {bad_input.dtype} of shape "
        f"{list(bad_input.shape)}",
    )
    torch._check(
        bad_input.device == keys.device,
        lambda: f"veloce::{op}: bad_input is on {bad_input.device} but keys is on {keys.device}",
    )


def _insert_fake(op: str, keys: Tensor, ids: Tensor, defer: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    _check_table_fake(op, keys, ids)
    if defer:  # counts on the table's device, nothing evicted
        return ids.new_empty(ids.shape), keys.new_empty(2), keys.new_empty(0)
    num_evicted = torch.library.get_ctx().new_dynamic_size()
    counts = torch.empty(2, dtype=torch.int64, device="cpu")  # host values on every backend
    return ids.new_empty(ids.shape), counts, keys.new_empty(num_evicted)


def _check_clock_fake(op: str, keys: Tensor, clock: Tensor | None, k: int) -> None:
    """The op's checks of ``clock`` (shape, dtype, device), for fake tensors."""
    if clock is None:
        return
    torch._check_value(
        clock.dtype == torch.int64 and clock.dim() == 1 and clock.shape[0] == k,
        lambda: f"veloce::{op}: clock must be an int64 tensor of shape ({k},) (one value per table), got "
        f"{clock.dtype} of shape {tuple(clock.shape)}",
    )
    torch._check_value(
        clock.device == keys.device,
        lambda: f"veloce::{op}: clock is on {clock.device} but keys is on {keys.device}",
    )


def _register_fakes() -> None:
    @torch.library.register_fake("veloce::find")
    def _(keys, digests, ids):
        _check_table_fake("find", keys, ids)
        return ids.new_empty(ids.shape)

    @torch.library.register_fake("veloce::find_or_insert")
    def _(keys, digests, scores, weights, opt_state, ids, score_policy, score_value, allow_evict, seed,
          init_kind, init_a, init_b, padding_id=None, bad_input=None, defer=False, clock=None, room=-1,
          init_state=None, admit=None):
        _check_bad_input_fake("find_or_insert", keys, bad_input)
        _check_clock_fake("find_or_insert", keys, clock, 1)
        return _insert_fake("find_or_insert", keys, ids, defer)

    @torch.library.register_fake("veloce::find_or_insert_many")
    def _(keys, digests, scores, weights, opt_state, ids, score_policy, score_value, allow_evict, seed,
          init_kind, init_a, init_b, padding_id, bad_input=None, defer=False, clock=None, room=None,
          init_state=None, admit=None):
        for k, i in zip(keys, ids):
            _check_table_fake("find_or_insert_many", k, i)
        if len(keys):
            _check_clock_fake("find_or_insert_many", keys[0], clock, len(keys))
        if bad_input is not None:
            torch._check(
                len(keys) > 0,
                lambda: "veloce::find_or_insert_many: bad_input was given but there are no tables",
            )
            _check_bad_input_fake("find_or_insert_many", keys[0], bad_input)
        slots = keys[0].new_empty(sum(i.shape[0] for i in ids))
        if defer and len(keys):  # counts on the tables' device, nothing evicted
            return slots, keys[0].new_empty(len(ids), 3), keys[0].new_empty(0)
        num_evicted = torch.library.get_ctx().new_dynamic_size()
        counts = torch.empty(len(ids), 3, dtype=torch.int64, device="cpu")  # host values on every backend
        return slots, counts, keys[0].new_empty(num_evicted)

    @torch.library.register_fake("veloce::insert_or_assign")
    def _(keys, digests, scores, weights, opt_state, ids, values, opt_values, score_values, score_policy,
          score_value, allow_evict, room=-1, init_state=None):
        return _insert_fake("insert_or_assign", keys, ids)

    @torch.library.register_fake("veloce::erase")
    def _(keys, digests, ids):
        _check_table_fake("erase", keys, ids)
        return ids.new_empty(ids.shape, dtype=torch.bool)

    @torch.library.register_fake("veloce::expire")
    def _(keys, digests, scores, before):
        return keys.new_empty(())

    @torch.library.register_fake("veloce::export")
    def _(keys, digests, scores, weights, opt_state, start, end):
        m = torch.library.get_ctx().new_dynamic_size()
        return (
            keys.new_empty(m),
            weights.new_empty(m, weights.shape[1]),
            opt_state.new_empty(m, opt_state.shape[1]),
            scores.new_empty(m),
        )

    @torch.library.register_fake("veloce::initialize")
    def _(ids, dim, seed, init_kind, init_a, init_b, dtype):
        return ids.new_empty(ids.shape[0], dim, dtype=dtype)


if _ext.loaded:  # without the extension the ops do not exist; require() explains on first use
    _register_fakes()
