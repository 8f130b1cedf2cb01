"""The NaN/Inf gradient policy (``nonfinite_grad``): the device's check of every pending
gradient of a step, read at once ("raise") or one step late ("raise_next"), and the bags
that "skip" drops."""

from __future__ import annotations

import copy
from typing import Optional, Sequence

import torch

from veloce.ops import optimizer as _ops
from veloce.ops.embedding import bag_of
from veloce.runtime import capture as _capture
from veloce.runtime.device import HostCopy, host_tensor
from veloce.sparse.base import TableModule
from veloce.sparse.pending import Pending

__all__ = ["CHECKED", "NONFINITE", "DeferredCheck", "FiniteCheck", "NonfinitePolicy", "raise_deferred",
           "raise_nonfinite"]  # fmt: skip

NONFINITE = ("raise", "raise_next", "skip", "apply")


CHECKED = ("raise", "raise_next")  # policies whose step() checks every gradient before applying any


class NonfinitePolicy:
    """A table module's NaN/Inf policy (:class:`veloce.DynamicEmbedding`'s)."""

    def _settle_check(self) -> None:
        """Reads the last step's unread "raise_next" check, if any (see DeferredCheck)."""
        if self._verdict is not None:
            self._verdict.settle()

    def _drop_verdict(self) -> None:
        """Before a load replaces the table: settles the last step's check (other tables of
        that step roll back consistently) and forgets its error for this table."""
        self._settle_check()
        self._nonfinite_error = None

    def _check_finite(self) -> Optional[list[torch.Tensor]]:
        """The nonfinite_grad policy on the pooled gradients (one reduction each). "raise"
        raises (on every rank of a sharded table: the ranks agree first, so none is left
        waiting in the next exchange); "skip" returns per pending entry the bags to drop
        (None when every gradient is finite)."""
        if self.nonfinite_grad == "apply":
            return None
        bad: list[torch.Tensor] = []
        num_bad = 0
        n = len(self._pending)
        tensors, owner = _checked_tensors(self._pending)
        flags = _ops.nonfinite_flags(tensors, owner, n).tolist() if n else []
        for e, flagged in zip(self._pending, flags):  # one read-back for all pending gradients
            b = torch.zeros(e.grad.shape[0], dtype=torch.bool, device=e.grad.device)
            if flagged:
                b = _nonfinite_bags(e)
                num_bad += int(b.sum())
            bad.append(b)
        if self.nonfinite_grad in CHECKED:
            where = "this table's (over all ranks)" if self.backend.sharded else "its"
            num_bad = self.backend.agree(num_bad)
            if num_bad:
                raise FloatingPointError(
                    f"DynamicEmbedding.step: {where} gradient of {num_bad} bag(s) holds NaN or Inf; nothing was "
                    f"applied. Call zero_grad() to drop it, or construct with nonfinite_grad='skip' to drop such "
                    f"bags' gradients." + _float16_exchange_hint([self])
                )
            return None
        return bad if num_bad else None


def _float16_exchange_hint(tables: Sequence[TableModule]) -> str:
    """A sentence for a NaN/Inf gradient error when some of ``tables`` receive their
    gradients in float16 (``HybridParallel(exchange_dtype=torch.float16)``), else ''."""
    if not any(t.backend.exchange_dtype == torch.float16 for t in tables):
        return ""
    return (" The gradients travel between ranks in float16 (HybridParallel(exchange_dtype=torch.float16)), "
            "which overflows above 65504: torch.bfloat16 keeps float32's range.")  # fmt: skip


class DeferredCheck:
    """The nonfinite_grad="raise_next" check of one step_tables call, read when needed.

    Every update of that call was queued with the check's result as its skip flag, so a
    failed check applied nothing: :meth:`settle` then puts every table's step count and
    last learning rate back to what they were before the call and leaves the error for its
    next step(). Sharded tables' flags are summed over the ranks, so every rank reads the
    same result and raises in the same step()."""

    def __init__(self, check: "FiniteCheck", tables: Sequence[TableModule]) -> None:
        self.check = check
        # Read before booking; step_tables read every table's last check first, so _steps
        # is what step_count would read.
        self.before = [(t, t._steps, t._last_lr) for t in tables]

    def settle(self) -> None:
        finite = self.check.result()  # the device finished this check long ago, as a rule
        flagged = sum(not ok for ok in finite.values())
        error = None
        if flagged:
            error = FloatingPointError(
                f"DynamicEmbedding.step: the gradient of the previous step() held NaN or Inf in {flagged} of its "
                f"{len(finite)} checked table(s) (nonfinite_grad='raise_next' reads the device's check one step "
                f"late); nothing of that step was applied and its gradient was dropped. The gradient pending now "
                f"was not applied either: call zero_grad() to drop it, or step() to apply it."
                + _float16_exchange_hint([t for t, _, _ in self.before])
            )  # fmt: skip
        for t, steps, lr in self.before:
            if t._verdict is not self:  # settled already, or a load replaced the table since
                continue
            t._verdict = None
            if error is not None:
                t._steps, t._last_lr, t._nonfinite_error = steps, lr, error


def raise_deferred(tables: Sequence[TableModule]) -> None:
    """Raises the error a "raise_next" check of an earlier step found in any of ``tables``
    (each table's error is raised once), or an owner's failure of a sharded lookup that
    ``HybridParallel(lookup_errors="raise_next")`` deferred. Reads the counts of the
    tables' deferred inserts first (``defer_inserts``): bad offsets they refused raise."""
    groups = {t.backend.group_id: t.backend for t in tables if t.backend.group_id is not None}
    for backend in groups.values():
        backend.raise_deferred_failures()
    for t in tables:  # deferred inserts: a refused one (bad offsets) raises here, before anything is applied
        if t.table._unread:
            t.table.settle()
    error = None
    for t in tables:
        t._settle_check()
        if t._nonfinite_error is not None:
            error, t._nonfinite_error = error or t._nonfinite_error, None
    if error is not None:
        raise error


def raise_nonfinite(tables: Sequence[TableModule], finite: dict[int, bool]) -> None:
    """Every table whose "raise" check flagged its gradient counts its bad bags (a sharded
    one agrees with its peers) and raises, before anything is applied: an error in one
    table applies no other, and no rank skips an agreement another rank waits in."""
    error: Optional[FloatingPointError] = None
    for t in tables:
        if not finite.get(id(t), True):
            try:
                t._check_finite()
            except FloatingPointError as e:
                error = error or e
    if error is not None:
        raise error
    if not all(finite.values()):  # the flags and the per-table count test the same bits
        raise AssertionError("step_tables: a gradient was flagged NaN/Inf, but its table found no such bag")


class FiniteCheck:
    """The nonfinite_grad="raise" check of step_tables' tables: whether every pending
    gradient of a table is finite (over all ranks for a sharded table). One
    ``torch.ops.veloce.nonfinite_flags`` over the gradients of each device's tables (every
    element read once; no host sync), one all-reduce per process group of sharded tables,
    and at most one read-back per device, queued at construction and waited for by
    :meth:`result` (:class:`veloce.runtime.device.HostCopy`)."""

    def __init__(self, tables: Sequence[TableModule]) -> None:
        self.tables = list(tables)
        self._result: Optional[dict[int, bool]] = None
        by_device: dict[torch.device, list[int]] = {}
        where: dict[int, tuple[torch.device, int]] = {}  # table -> (device, row of its flag)
        groups: dict[int, list[int]] = {}  # the sharded tables per process group
        for i, t in enumerate(self.tables):
            dev = t.table.device
            idx = by_device.setdefault(dev, [])
            where[i] = (dev, len(idx))
            idx.append(i)
            if t.backend.group_id is not None:
                groups.setdefault(t.backend.group_id, []).append(i)
        flags: dict[torch.device, list[torch.Tensor]] = {}  # per device: bool flag rows
        self._any: dict[torch.device, torch.Tensor] = {}  # per device: (1,) "some row is set", where ready
        for dev, idx in by_device.items():
            grads, owner = [], []
            for j, i in enumerate(idx):
                g, _ = _checked_tensors(self.tables[i]._pending)
                grads += g
                owner += [j] * len(g)
            if grads:
                f = _ops.nonfinite_flags(grads, owner, len(idx))
                flags[dev], self._any[dev] = [f[:-1]], f[-1:]
            else:
                flags[dev] = [torch.zeros(len(idx), dtype=torch.bool, device=dev)]
        # Sharded tables: the flags summed over the ranks (every rank steps the same tables
        # in the same order), appended after the device's own rows.
        for idx in groups.values():
            dev = where[idx[0]][0]
            rows = [where[i][1] for i in idx]
            own = flags[dev][0]
            if {where[i][0] for i in idx} == {dev}:  # the usual case: one gather (or none) for the group
                mine = own if rows == list(range(own.numel())) else own[host_tensor(rows, dev)]
            else:
                mine = torch.stack([flags[where[i][0]][0][where[i][1]].to(dev) for i in idx])
            mine = mine.to(torch.long, copy=True)  # agree_all reduces in place: never the local rows
            summed = self.tables[idx[0]].backend.agree_all(mine).to(dev) != 0
            base = sum(f.numel() for f in flags[dev])
            flags[dev].append(summed)
            self._any.pop(dev, None)  # the agreed rows count too
            for k, i in enumerate(idx):
                where[i] = (dev, base + k)
        self._where = where
        self._flags = {dev: fs[0] if len(fs) == 1 else torch.cat(fs) for dev, fs in flags.items()}
        # Queued, not waited for; a captured step's are made after each replay (requeued).
        self._copies = {} if _capture.ACTIVE is not None else self._queue_copies()

    def _queue_copies(self) -> dict:
        return {dev: HostCopy(f) for dev, f in self._flags.items()}

    def requeued(self) -> "FiniteCheck":
        """The same check of the flags' current values (a replayed CUDA graph rewrote them):
        their read-backs queued now, the result not read yet."""
        again = copy.copy(self)
        again._result, again._copies = None, self._queue_copies()
        return again

    def skip_flag(self, devices: set) -> Optional[torch.Tensor]:
        """A (1,) bool on the device of every table in ``devices`` (those to be updated),
        true when some checked gradient is not finite; None when the tables span several
        devices (the caller then reads :meth:`result` before updating)."""
        if len(devices) != 1 or set(self._flags) != devices:  # several devices, or no table to check
            return None
        (dev,) = devices
        ready = self._any.get(dev)
        return ready if ready is not None else self._flags[dev].any().reshape(1)

    def result(self) -> dict[int, bool]:
        """id(table) -> whether its pending gradient is finite (waits for the read-back once)."""
        if self._result is None:
            host = {dev: c.tolist() for dev, c in self._copies.items()}
            self._result = {id(t): not host[self._where[i][0]][self._where[i][1]] for i, t in enumerate(self.tables)}
        return self._result


def _checked_tensors(pending: Sequence[Pending]) -> tuple[list[torch.Tensor], list[int]]:
    """What the NaN/Inf check reads of pending entries, and the entry each tensor belongs
    to: every gradient, and the per-sample weights that scale it into the rows' gradients
    (a NaN weight makes a NaN row gradient out of a finite pooled one)."""
    tensors, owner = [], []
    for j, e in enumerate(pending):
        tensors.append(e.grad)
        owner.append(j)
        if e.psw is not None:
            tensors.append(e.psw)
            owner.append(j)
    return tensors, owner


def _nonfinite_bags(e: Pending) -> torch.Tensor:
    """(B,) bool: the bags of ``e`` whose gradient, or some position's per-sample weight,
    holds NaN or Inf."""
    bad = ~torch.isfinite(e.grad).all(dim=1)
    if e.psw is not None:
        bad[_position_bags(e)[~torch.isfinite(e.psw)]] = True
    return bad


def drop_bags(e: Pending, bad: torch.Tensor) -> Pending:
    """``e`` without the gradient of the ``bad`` bags (nonfinite_grad="skip"): their pooled
    gradient and their positions' per-sample weights become zero."""
    grad = e.grad.masked_fill(bad.unsqueeze(1), 0)
    if e.psw is None:
        return e._replace(grad=grad)
    return e._replace(grad=grad, psw=e.psw.masked_fill(bad[_position_bags(e)], 0))


def _position_bags(e: Pending) -> torch.Tensor:
    """(N,) the bag of each position of a pending entry."""
    return bag_of(e.offsets[:-1] if e.include_last_offset else e.offsets, e.slots.numel())
