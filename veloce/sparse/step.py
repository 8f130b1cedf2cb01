"""The sparse optimizer step: every pending gradient of a step applied by fused updates,
the tables that share their arguments grouped into one op call (:func:`step_tables`)."""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Sequence

import torch

from veloce.ops import extension as _ext
from veloce.ops.optimizer import HyperparameterBuffer, accumulate_and_update, accumulate_and_update_many
from veloce.optim import Adam
from veloce.runtime import capture as _capture
from veloce.runtime.update_stream import run_update
from veloce.sparse.base import MODES, TableModule
from veloce.sparse.default_row import agreed_default_gradients, shares_default_row
from veloce.sparse.pending import Pending, default_codes, merge_entries
from veloce.table import UpdateTarget
from veloce.sparse.nonfinite import (
    CHECKED, DeferredCheck, FiniteCheck, drop_bags, raise_deferred, raise_nonfinite,
)  # fmt: skip

__all__ = ["Stepping", "step_tables"]


class Stepping:
    """A table module's step (:class:`veloce.DynamicEmbedding`'s)."""

    @torch.no_grad()
    def step(self, lr: Optional[float] = None) -> None:
        """Applies the sparse optimizer to every row with a pending gradient, then
        forgets the gradient. ``lr`` overrides the configured learning rate (an LR
        scheduler sets it through :class:`veloce.CombinedOptimizer`).

        The gradient of each touched row is summed and applied in one fused pass
        (``torch.ops.veloce.accumulate_and_update``); rows evicted since their forward
        pass get nothing, and a row that moved (growth) is found by its id.

        On CUDA the update is queued on an update stream (:mod:`veloce.runtime.update_stream`):
        the next forward's insert runs beside it, and every read of the rows waits for it
        on the device.

        NaN/Inf gradients (``nonfinite_grad``): with "raise", step() waits for the
        device's check of the gradient and raises ``FloatingPointError`` before anything
        is applied (the gradient stays pending). With "raise_next" it does not wait: the
        update is queued behind the check and skips itself on the device when the check
        fails, and the *next* step() raises ``FloatingPointError`` before applying
        anything of its own. The failed step is then not counted (``step_count``) and its
        gradient is gone; the gradient pending at the raise is kept (``zero_grad()`` drops
        it, ``step()`` applies it). On a GPU this saves a wait for the whole backward pass
        in every step. Reading ``step_count``, ``export()`` or ``state_dict()`` reads the
        check first, so they never count a step that was not applied. When one call steps
        tables on several devices, or with a "raise" table, the check is read at once, as
        with "raise". A failed check skips every update of its call, those of "skip" and
        "apply" tables in it too; each of its tables then raises at its next step()."""
        step_tables([self], [lr])

    def _apply_pending(self, lr: Optional[float]) -> None:
        """Applies the pending gradient (its nonfinite_grad check included) and books the step."""
        raise_deferred([self])
        update = self._prepare_update(lr)
        shared = agreed_default_gradients([self])
        if update is not None:
            _apply_updates([self], [update], shared=shared)
        _step_shared_defaults([self], [update], [lr], shared)
        self._book(update)

    def _prepare_update(self, lr: Optional[float], known_finite: bool = False) -> Optional["_Update"]:
        """The arguments of the accumulate_and_update that applies the pending gradient
        (learning rate, step count, nonfinite_grad="skip" masking, merged and re-resolved
        pending batches), or None when no row has a pending gradient. ``known_finite``: the
        "raise" check is done by the caller (step_tables). Books nothing: :func:`_apply_updates`
        runs the update, with those of other tables that share its arguments, and
        :meth:`_book` counts the step once it is applied."""
        bad = None if known_finite else self._check_finite()
        if not self._pending:
            return None
        _ext.require()
        if bad is not None:
            self._pending = [drop_bags(e, b) for e, b in zip(self._pending, bad)]
            if self._pending_default:  # one entry per pass beside the table's (_accumulate_default)
                self._pending_default = [drop_bags(e, b) for e, b in zip(self._pending_default, bad)]
        e = self._merged()
        slots = self._resolved(e) if e.ids is not None else e.slots
        target = self.table.update_target()
        extra = None
        if self._folds_default():
            # The default row is the row past the table's own (slot C) in the table's update:
            # one sort and one kernel for both, where an update of its own sorted every position again.
            slots = slots.masked_fill(e.refused, target.tensors[0].shape[0])
            extra = self.table.default_update_target()
        opt = self.optimizer
        # include_last_offset=True becomes False with the last offset dropped (a view; the
        # offsets passed _bags' checks, so the last one is N): the same bags, and one value
        # of the flag for every table of a grouped call.
        offsets = e.offsets[:-1] if e.include_last_offset else e.offsets
        # The step count as step_count reads it: both callers read the last step's check
        # first (raise_deferred), so there is none left to read.
        return _Update(
            target, e.grad, slots, offsets, e.psw, e.mode, opt.kind, float(opt.lr if lr is None else lr),
            tuple(opt.hyperparameters()), float(opt.weight_decay), self._steps + 1, lr, extra,
        )  # fmt: skip

    def _folds_default(self) -> bool:
        """Whether this step trains the default row (admission) in the table's own update: the
        table is not sharded (a sharded one's default row takes the gradient summed over its
        ranks, :mod:`veloce.sparse.default_row`) and its pending default entries mirror the
        table's, one per pass with the same gradient (``refused`` marks the positions): not
        so after ``clip_grad_value_``, which keeps the clamped sums of the rows instead."""
        pending, default = self._pending, self._pending_default
        return (bool(default) and len(default) == len(pending) and all(e.refused is not None for e in pending)
                and not shares_default_row(self))  # fmt: skip

    def _book(self, update: Optional["_Update"]) -> None:
        """Counts a step once its update is applied (``update``), or when there was nothing
        to apply (None), and forgets the applied gradient. Sets only the attributes that
        change: each set is a call of PlainAttrs.__setattr__, for every table in every step."""
        self.table.after_step()  # the rows kept for the applied gradient may leave a tiered table's cache
        if self._unapplied_since is not None:  # (async gradients in flight are the next steps' to apply)
            self._unapplied_since = None
            self._unapplied_passes = 0
        if update is None:
            # A gradient over no rows (a lookup of no ids, or a shard that received none)
            # still counts as a step, as for torch's SparseAdam: every shard of a table
            # keeps the step count of one process.
            if self._had_backward:
                self._steps += 1
                self._had_backward = False
            return
        self._pending.clear()
        self._steps = update.step
        if self._last_lr is not update.requested_lr:
            self._last_lr = update.requested_lr
        if self._had_backward:
            self._had_backward = False


    def _scalar_update(self, lr: Optional[float]) -> "_Update":
        """The scalar arguments of this step's update (no rows, no gradient): what the
        default row's update of a shard that received no gradient of its own needs
        (:func:`_step_shared_defaults`)."""
        opt = self.optimizer
        return _Update(None, None, None, None, None, MODES["sum"], opt.kind, float(opt.lr if lr is None else lr),
                       tuple(opt.hyperparameters()), float(opt.weight_decay), self._steps + 1, lr)  # fmt: skip

    def _step_default_row(self, update: "_Update", skip: Optional[torch.Tensor] = None,
                          hparams: Optional[torch.Tensor] = None, entry: Optional[Pending] = None) -> None:  # fmt: skip
        """Applies the default row's pending gradient (admission: the gradient of the
        positions it served) with the step's optimizer, hyperparameters (``hparams``: a
        captured step's device tensor) and ``skip`` flag: the fused update over the
        ``(1, D)`` row and its ``(1, S)`` state, queued on the current stream (the stream
        that reads the row next). ``entry``: the gradient to apply instead of the pending
        one (a sharded table's, summed over its ranks: :mod:`veloce.sparse.default_row`)."""
        e = entry if entry is not None else merge_entries(self._pending_default, lambda x: x.slots, 0)
        e = e._replace(slots=default_codes(e))
        self._pending_default = []
        table = self.table
        weights, state = table.default_update_target()
        offsets = e.offsets[:-1] if e.include_last_offset else e.offsets
        if hparams is None:
            hparams = _HPARAMS.fill(weights.device, update.kind, update.hparams())
        accumulate_and_update(
            weights, state, e.grad, e.slots, offsets, e.psw, e.mode, False, update.kind, check_inputs=False,
            skip=skip, hparams=hparams,
        )  # fmt: skip


def step_tables(tables: Sequence[TableModule], lrs: Optional[Sequence[Optional[float]]] = None) -> None:
    """``t.step(lr)`` for every table, with one device read-back for all of them and one
    fused update per group of alike tables.

    The ``nonfinite_grad="raise"`` check of every table reduces on the device into one
    flag per table (for sharded tables summed over their ranks in one all-reduce per
    process group), read back in one copy: a step over K tables waits for the device once
    instead of K times. When the tables share one device, the updates do not wait for that
    read: they are queued behind the check, each op carrying "some flag is set" as its
    ``skip`` argument, and the host reads the flags while the GPU runs them. A table whose
    flag is set takes the per-table path, which counts its bad bags and raises; nothing is
    applied to any table (the queued updates skipped themselves on the device). Every rank
    must step its sharded tables in the same calls and order. The default rows of sharded
    tables with admission are replicated: their gradients are summed over the ranks in one
    all-reduce per process group (:mod:`veloce.sparse.default_row`) before the updates.

    The updates themselves are grouped: tables on one device with the same dtype, embedding
    dim, pooling of their pending gradient, optimizer kind and hyperparameters, learning
    rate, weight decay and (Adam) step count are applied by one
    ``torch.ops.veloce.accumulate_and_update_many`` call (on CUDA one sort and one fused
    kernel for all of them, instead of about a dozen launches per table). The result is
    that of stepping each table alone, bit for bit. A table listed twice is stepped once.
    :class:`veloce.CombinedOptimizer` steps its tables this way.
    """
    lrs = [None] * len(tables) if lrs is None else list(lrs)
    if len(lrs) != len(tables):
        raise ValueError(f"step_tables: {len(tables)} tables but {len(lrs)} learning rates")
    # The last step's "raise_next" check first, before anything of this step (async
    # gradients stay in flight: zero_grad() after the error does not drop them; an owner's
    # deferred lookup failure drops the failed step's, see HybridParallel(lookup_errors=)).
    raise_deferred(tables)
    for t in tables:
        t.backend.collect(t)  # gradients other ranks sent for this shard's rows
    once: dict[int, tuple[TableModule, Optional[float]]] = {}  # stepping a table again finds nothing
    for t, lr in zip(tables, lrs):
        once.setdefault(id(t), (t, lr))
    tables, lrs = [t for t, _ in once.values()], [lr for _, lr in once.values()]
    checked = [t for t in tables if t.nonfinite_grad in CHECKED]
    check = FiniteCheck(checked)
    # On one device the updates are queued behind the check with its result as their skip
    # flag, and the host reads that result afterwards: it waits for the check, not for the
    # updates, and the GPU never idles between them. Otherwise the result is read first.
    skip = check.skip_flag({t.table.device for t in tables})
    capture = _capture.ACTIVE
    if skip is None and checked and capture is not None:
        raise RuntimeError(
            "veloce: a step over tables on several devices cannot be captured in a CUDA graph: its NaN/Inf check "
            "is read before the updates; capture each device's tables in a step of their own"
        )
    if skip is None:
        raise_nonfinite(tables, check.result())
    updates = [t._prepare_update(lr, known_finite=t.nonfinite_grad in CHECKED) for t, lr in zip(tables, lrs)]
    # Sharded tables with admission: their default rows' gradients summed over the ranks
    # (after _prepare_update, whose nonfinite_grad="skip" filter drops bad bags per rank).
    shared = agreed_default_gradients(tables)
    ready = [i for i, u in enumerate(updates) if u is not None]
    applied: list[int] = []  # indices into ready, of the updates whose op call returned
    try:
        _apply_updates([tables[i] for i in ready], [updates[i] for i in ready], skip, applied, shared)
        _step_shared_defaults(tables, updates, lrs, shared, skip)
    except BaseException:
        # (a captured step reads no check: its capture fails, and nothing was booked)
        if capture is None and (skip is None or all(check.result().values())):  # the calls that ran did apply
            for j in applied:
                tables[ready[j]]._book(updates[ready[j]])
        raise
    # "raise_next" alone: the host does not read the check now. Every update carried its
    # flag, so if it failed nothing was applied: reading it later rolls the booking back.
    # A captured step reads every check so (veloce.graphs reads each replay's).
    deferred = skip is not None and (capture is not None or all(t.nonfinite_grad == "raise_next" for t in checked))
    if skip is not None and not deferred and not all(check.result().values()):
        # Nothing was applied (every call carried the set flag): raise, before any booking.
        raise_nonfinite(tables, check.result())
    if capture is not None:
        if checked:
            capture.checks.append(_capture.CheckLog(check, list(tables)))
        for t, u in zip(tables, updates):
            capture.requested_lr[id(t)] = None if u is None else u.requested_lr
    verdict = DeferredCheck(check, tables) if deferred and checked and capture is None else None
    for t, u in zip(tables, updates):
        t._book(u)
    if verdict is not None:
        for t in tables:
            t._verdict = verdict


class _Update(NamedTuple):
    """A table's accumulate_and_update arguments for one step (DynamicEmbedding._prepare_update)."""

    target: UpdateTarget  # the table's rows and state, passed through to the op
    grad: torch.Tensor
    slots: torch.Tensor
    offsets: torch.Tensor  # include_last_offset=False
    psw: Optional[torch.Tensor]
    mode: int
    kind: int
    lr: float
    hyper: tuple[float, ...]  # the optimizer's own hyperparameters (SparseOptimizer.hyperparameters)
    weight_decay: float
    step: int  # the table's step count once this update is applied
    requested_lr: Optional[float]  # step()'s lr argument (None: the optimizer's own)
    # (weights, state) of the default row trained in this update as slot C (admission), or None
    extra: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def group_key(self) -> tuple:
        """Updates with equal keys share every scalar argument of one
        accumulate_and_update_many call (and its device, dtype and dim). Only Adam reads
        the step count (its bias correction), so other optimizers group across step counts.

        The pooling mode is part of the key rather than converted: turning a mean pooled
        gradient into sum with per-sample weights 1 / len(bag) would cost several launches
        per table (what grouping saves) and round those weights to the row dtype (not bit
        for bit the mean update for float16 / bfloat16). Tables of a model usually share
        one mode."""
        step = self.step if self.kind == Adam.kind else 0
        return (*self.target.layout, self.mode, self.kind, self.lr, self.hyper, self.weight_decay, step)

    def hparams(self) -> list[float]:
        """The ops' hyperparameter vector: ``[lr, step, weight_decay, *hyper]``."""
        return [self.lr, float(self.step), self.weight_decay, *self.hyper]


def _apply_updates(
    tables: Sequence[TableModule], updates: Sequence[_Update], skip: Optional[torch.Tensor] = None,
    applied: Optional[list[int]] = None, shared: Optional[dict[int, Pending]] = None,
) -> None:
    """Runs the prepared updates of ``tables`` (one each): those with equal group keys in
    one accumulate_and_update_many, a lone one in accumulate_and_update, every call with
    the ``skip`` flag. Appends to ``applied`` the index of each update whose call
    returned (the caller books them: :meth:`DynamicEmbedding._book`). The default rows of
    the tables in ``shared`` are left to :func:`_step_shared_defaults`. The offsets passed
    _bags' checks and the slots come from the tables: no input checks (on CUDA, no host
    sync)."""
    groups: dict[tuple, list[int]] = {}
    for i, u in enumerate(updates):
        groups.setdefault(u.group_key(), []).append(i)
    calls: list[list[int]] = []
    for idx in groups.values():
        # Modules sharing one table's rows take separate calls, in order: the k-th update of
        # a table goes to the k-th call.
        batches: list[list[int]] = []
        seen: dict[int, int] = {}  # the rows' key -> updates of that table so far
        for i in idx:
            key = updates[i].target.key
            k = seen.get(key, 0)
            seen[key] = k + 1
            if k == len(batches):
                batches.append([])
            batches[k].append(i)
        calls.extend(batches)
    for idx in calls:
        group = [updates[i] for i in idx]
        # On CUDA the update runs on the update stream: the next step's insert does not wait
        # for it (veloce.runtime.update_stream). The fence keeps the inputs alive until the stream they
        # came from waited for it, or it has run.
        # A captured step reads its hyperparameters from the device tensor it advances (veloce.graphs).
        hparams = None if _capture.ACTIVE is None else _capture.ACTIVE.hparams_of([tables[i] for i in idx])
        fence = run_update(group[0].target.layout[0], functools.partial(_launch_update, group, skip, hparams),
                           (group, skip))  # fmt: skip
        if fence is not None:
            for i in idx:
                tables[i].table.track_update(fence)
        for i in idx:  # admission: the default rows of these tables, after their rows' update was queued
            if updates[i].extra is not None:  # trained in that update
                tables[i]._pending_default = []
            elif tables[i]._pending_default and (not shared or id(tables[i]) not in shared):
                tables[i]._step_default_row(updates[i], skip, hparams)
        if applied is not None:  # a failed call leaves its tables' steps pending
            applied.extend(idx)


def _step_shared_defaults(tables: Sequence[TableModule], updates: Sequence[Optional[_Update]],
                          lrs: Sequence[Optional[float]], shared: dict[int, Pending],
                          skip: Optional[torch.Tensor] = None) -> None:  # fmt: skip
    """Applies the summed default-row gradient of each table in ``shared``
    (:func:`~veloce.sparse.default_row.agreed_default_gradients`) on this rank's replica, with
    the table's update arguments (``updates[i]``; a shard without a gradient of its own
    takes its scalar ones): every rank applies the same update, its lookups or none."""
    if not shared:
        return
    for t, u, lr in zip(tables, updates, lrs):
        entry = shared.get(id(t))
        if entry is None:
            continue
        capture = _capture.ACTIVE
        hparams = None
        if capture is not None:  # a captured step: the rows' update advanced the table's device step already
            hparams = capture.hparams[id(t)] if u is not None else capture.hparams_of([t])
        t._step_default_row(u if u is not None else t._scalar_update(lr), skip, hparams, entry)


# The hyperparameter tensors of the eager updates: one per (device, optimizer), refreshed in
# place by each call on the stream that runs it.
_HPARAMS = HyperparameterBuffer()


def _launch_update(group: Sequence[_Update], skip: torch.Tensor | None, hparams: torch.Tensor | None = None) -> None:
    """One accumulate_and_update(_many) call for updates that share their group key
    (``hparams``: their hyperparameters on the device, in a captured step)."""
    u = group[0]
    if hparams is None:
        hparams = _HPARAMS.fill(u.target.layout[0], u.kind, u.hparams())
    if len(group) == 1:
        extra = u.extra if u.extra is not None else (None, None)
        accumulate_and_update(
            *u.target.tensors, u.grad, u.slots, u.offsets, u.psw, u.mode, False, u.kind, check_inputs=False,
            skip=skip, hparams=hparams, extra_rows=extra[0], extra_state=extra[1],
        )  # fmt: skip
    else:
        extras = None
        if any(v.extra is not None for v in group):  # (0, D) and (0, S) for the tables without
            extras = [v.extra if v.extra is not None else tuple(t.new_empty((0, t.shape[1])) for t in v.target.tensors)
                      for v in group]  # fmt: skip
        accumulate_and_update_many(
            *map(list, zip(*[v.target.tensors for v in group])), [v.grad for v in group],
            [v.slots for v in group], [v.offsets for v in group], [v.psw for v in group], u.mode, False, u.kind,
            check_inputs=False, skip=skip, hparams=hparams, extra_rows=None if extras is None else [x for x, _ in extras],
            extra_state=None if extras is None else [x for _, x in extras],
        )  # fmt: skip
