"""Pending gradients: what a backward pass leaves in a table until its ``step()`` (the
inputs of each pass, summed per row only by the fused update), and the bookkeeping that
notices a loop that never steps the tables."""

from __future__ import annotations

import weakref
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from veloce.ops.embedding import accumulate_grad, bag_of
from veloce.sparse.base import MODES, TableModule
from veloce.sparse.torch_steps import torch_step_count
from veloce.table import HashTable

__all__ = ["LIVE", "Pending", "PendingGradient", "PendingState", "default_codes", "reresolve", "waiting_tables"]

# Every DynamicEmbedding alive in the process: torch's gradient clipping asks which hold a
# gradient it cannot see (veloce.sparse.clip).
LIVE: "weakref.WeakSet[TableModule]" = weakref.WeakSet()


def waiting_tables() -> list[TableModule]:
    """The live tables holding a gradient that arrived since the last step of any torch
    optimizer and waits for their step() (pending, or in flight in async mode): what a
    gradient clipping of the dense parameters alone would leave unclipped."""
    steps = torch_step_count()
    return [t for t in list(LIVE) if t._unapplied_since == steps]


class Pending(NamedTuple):
    """The inputs of one backward pass, kept until step(): the gradient is summed per row
    and applied by one fused kernel then (never materialised per row)."""

    ids: Optional[torch.Tensor]  # (N,) for re-resolving slots if the table changes
    slots: torch.Tensor  # (N,) slots at forward time (codes -1 / -2 allowed)
    offsets: torch.Tensor  # (B,) or (B + 1,)
    psw: Optional[torch.Tensor]  # (N,) or None
    grad: torch.Tensor  # (B, D) gradient of the pooled output
    mode: int
    include_last_offset: bool
    version: int  # table version the slots belong to
    # (N,) bool: positions the table's default row served (admission), -2 in ``slots`` whatever
    # their ids find later; None: none
    refused: Optional[torch.Tensor] = None


class PendingState(NamedTuple):
    """What :meth:`PendingGradient.pending_state` keeps of a table module: the inputs of the
    backward passes waiting for step(), and the NaN/Inf error that a "raise_next" check
    left for the next step() (None: none), and the default row's pending gradient (admission)."""

    entries: tuple
    error: Optional[FloatingPointError]
    default_entries: tuple = ()


def reresolve(table: HashTable, ids: torch.Tensor, slots: torch.Tensor,
              refused: Optional[torch.Tensor] = None) -> torch.Tensor:  # fmt: skip
    """Slots of ``ids`` under the table's current mapping: evicted ids become -2 (still
    counted by mean, no gradient), padding (-1 in ``slots``) stays -1, and so do the
    positions the default row served (``refused``, -2: their gradient went to it, not to
    a row their id may have got since)."""
    fresh = table.find(ids)
    fresh = fresh.masked_fill(fresh < 0, -2).masked_fill(slots == -1, -1)
    return fresh if refused is None else fresh.masked_fill(refused, -2)


def default_codes(entry: Pending) -> torch.Tensor:
    """The slots of a pending default-row ``entry`` in the row's one-row table: 0 where it
    served the position, -1 at padding, -2 elsewhere (counted by mean pooling, no
    gradient). An entry with ``refused`` marks holds its table's slots (the positions the
    row served among them, :func:`default_entry`): the codes are made from them; one
    without holds the codes already (a clamped or summed gradient)."""
    if entry.refused is None:
        return entry.slots
    return torch.where(entry.refused, 0, torch.where(entry.slots == -1, -1, -2))


def merge_entries(entries: Sequence[Pending], resolved: Callable[[Pending], torch.Tensor], version: int) -> Pending:
    """One batch equivalent to ``entries``: mean bags become sum bags with per-position
    weights 1 / len(bag), offsets are shifted and concatenated; ``resolved(e)`` gives each
    entry's slots. The ``refused`` marks are concatenated (none where an entry has none),
    None when no entry has them."""
    if len(entries) == 1:
        return entries[0]
    slots, offsets, psw, grads = [], [], [], []
    refused = None
    if any(e.refused is not None for e in entries):
        refused = torch.cat([e.refused if e.refused is not None else torch.zeros(e.slots.shape, dtype=torch.bool,
                                                                                 device=e.slots.device)
                             for e in entries])  # fmt: skip
    base = 0
    for e in entries:
        s = resolved(e)
        o = e.offsets[:-1] if e.include_last_offset else e.offsets
        w = e.psw if e.psw is not None else torch.ones(s.numel(), dtype=e.grad.dtype, device=s.device)
        if e.mode == MODES["mean"]:
            bag = bag_of(o, s.numel())
            counts = torch.zeros(o.numel(), dtype=e.grad.dtype, device=s.device)
            counts.index_add_(0, bag, (s != -1).to(e.grad.dtype))
            w = w / counts.clamp(min=1)[bag]
        slots.append(s)
        offsets.append(o + base)
        psw.append(w)
        grads.append(e.grad)
        base += s.numel()
    return Pending(
        ids=None, slots=torch.cat(slots), offsets=torch.cat(offsets), psw=torch.cat(psw),
        grad=torch.cat(grads), mode=MODES["sum"], include_last_offset=False, version=version, refused=refused,
    )  # fmt: skip


class PendingGradient:
    """A table module's pending gradient (:class:`veloce.DynamicEmbedding`'s)."""

    def _accumulate(self, entry: "Pending", noted: bool = False) -> None:
        """Keeps one backward pass's inputs until step() (gradient accumulation).
        ``noted``: the pass was counted when it was sent (async gradients in flight)."""
        self._had_backward = True
        if not noted:
            self._note_backward()
        if entry.slots.numel():
            self._pending.append(entry)

    def _note_backward(self) -> None:
        """Counts a backward pass whose gradient waits for step() (pending here, or in
        flight to this shard's rows in async mode), and notes the torch optimizer steps
        made when the first of them arrived (see :meth:`_check_unapplied`)."""
        if self._unapplied_since is None:
            self._unapplied_since = torch_step_count()
        self._unapplied_passes += 1

    def pending_state(self) -> PendingState:
        """The gradient waiting for step() and the NaN/Inf error left for the next step(), as
        :meth:`restore_pending_state` puts them back (a checkpoint load that fails does)."""
        return PendingState(tuple(self._pending), self._nonfinite_error, tuple(self._pending_default))

    def restore_pending_state(self, state: Optional[PendingState]) -> None:
        """Puts back a :meth:`pending_state`; None drops the waiting gradient's inputs and the
        error (the count of backward passes since the last step() stays)."""
        self._pending[:] = () if state is None else state.entries
        self._pending_default = [] if state is None else list(state.default_entries)
        self._nonfinite_error = None if state is None else state.error

    def _forget_gradient(self) -> None:
        """Drops the pending gradient and its bookkeeping (zero_grad, a load, a failed step)."""
        self._pending.clear()
        if self._pending_default:
            self._pending_default = []
        if self._had_backward:  # each set is a call of PlainAttrs.__setattr__: only when it changes
            self._had_backward = False
        if self._unapplied_since is not None:
            self._unapplied_since = None
            self._unapplied_passes = 0

    def _check_unapplied(self) -> None:
        """Before a training lookup: raises when the gradient waiting for step() shows a
        loop that does not step this table: a torch optimizer stepped since the gradient
        arrived (the table is no parameter of it), or ``max_pending_backwards`` backward
        passes wait already (their inputs are kept until step(): memory grows with each)."""
        since = self._unapplied_since
        if since is None:
            return
        passes = self._unapplied_passes
        if since < torch_step_count():
            raise RuntimeError(
                f"DynamicEmbedding: a torch optimizer stepped since this table's last backward pass, but the table "
                f"was not stepped: the gradient of {passes} backward pass(es) waits unapplied. Its rows are not "
                f"parameters, so torch.optim optimizers never train them. Step the tables with the dense optimizer: "
                f"opt = veloce.CombinedOptimizer(torch.optim.Adam(model.parameters()), model) (then "
                f"opt.step() and opt.zero_grad() as usual), or call emb.step() (veloce.step_tables(tables)) after "
                f"opt.step(). emb.zero_grad() drops the waiting gradient."
            )  # fmt: skip
        if passes >= self.max_pending_backwards:
            raise RuntimeError(
                f"DynamicEmbedding: {passes} backward passes reached this table since its last step() "
                f"(max_pending_backwards = {self.max_pending_backwards}): each one's inputs are kept until step(). "
                f"Call emb.step() (or veloce.CombinedOptimizer(opt, model).step()) to apply them, or "
                f"emb.zero_grad() to drop them; to accumulate more passes, raise emb.max_pending_backwards."
            )  # fmt: skip

    def _pending_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pending gradient per row, what step() applies (weight decay aside): the
        touched slots ``(U,)`` in ascending order and their summed gradients ``(U, D)``
        (an ``nn.EmbeddingBag``'s ``weight.grad`` on those rows)."""
        if not self._pending:
            dev = self.table.device
            return (torch.empty(0, dtype=torch.long, device=dev),
                    torch.empty(0, self.embedding_dim, dtype=self.table.dtype, device=dev))  # fmt: skip
        e = self._merged()
        slots = self._resolved(e) if e.ids is not None else e.slots
        return accumulate_grad(e.grad, slots, e.offsets, e.psw, e.mode, e.include_last_offset, self.table.capacity)

    def _scale_pending(self, factor: torch.Tensor) -> None:
        """Multiplies the pending gradient by ``factor`` (a scalar tensor): each pooled
        gradient, so each row's gradient, which is linear in them (gradient clipping)."""
        self._pending = [e._replace(grad=e.grad * factor.to(e.grad.device, e.grad.dtype)) for e in self._pending]
        if self._pending_default:
            self._pending_default = [e._replace(grad=e.grad * factor.to(e.grad.device, e.grad.dtype))
                                     for e in self._pending_default]  # fmt: skip

    def _clamp_pending(self, clip_value: float) -> None:
        """Clamps each row's pending gradient to ``[-clip_value, clip_value]``: the pending
        gradient becomes one batch of one bag per touched row, holding its clamped sum."""
        if self._pending_default:
            d_slots, d_rows = self._default_grad_rows()
            positions = torch.arange(d_slots.numel(), device=d_slots.device)
            self._pending_default = [Pending(None, d_slots, positions, None, d_rows.clamp(-clip_value, clip_value),
                                             MODES["sum"], False, 0)]  # fmt: skip
        slots, rows = self._pending_rows()
        if not slots.numel():
            return
        table = self.table
        ids = table.ids_at(slots)  # for step() to find the rows by id if the table changes first
        offsets = torch.arange(slots.numel(), device=slots.device)
        self._pending = [Pending(ids, slots, offsets, None, rows.clamp(-clip_value, clip_value), MODES["sum"], False,
                                  table.version)]  # fmt: skip

    def _resolved(self, entry: "Pending") -> torch.Tensor:
        """The entry's slots under the current table: re-resolved by id if the table grew,
        evicted or erased since; evicted ids become -2 (no gradient), padding stays -1."""
        if entry.version == self.table.version:
            return entry.slots
        return reresolve(self.table, entry.ids, entry.slots, entry.refused)

    def _merged(self) -> "Pending":
        """One batch equivalent to all pending ones (:func:`merge_entries`)."""
        return merge_entries(self._pending, self._resolved, self.table.version)

    def _accumulate_default(self, entry: "Pending") -> None:
        """Keeps one backward pass's gradient of the table's default row until step(): the
        table's entry of the pass, ``refused`` marking the positions the row served
        (:func:`~veloce.sparse.default_row.default_entry`; :func:`default_codes`
        makes its slots in the one-row table only where a path needs them). Kept beside the
        table's entry of the same pass (both or neither), so that a filter of the passes'
        bags (nonfinite_grad="skip") applies to both alike."""
        if entry.slots.numel():
            self._pending_default.append(entry)

    def _default_grad_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The default row's pending gradient: ``(slots, rows)``, ``(1,)`` and ``(1, D)``
        when a pending pass reached it, else empty (as :meth:`_pending_rows`)."""
        if not self._pending_default:
            dev = self.table.device
            return (torch.empty(0, dtype=torch.long, device=dev),
                    torch.empty(0, self.embedding_dim, dtype=self.table.dtype, device=dev))  # fmt: skip
        e = merge_entries(self._pending_default, lambda x: x.slots, 0)
        return accumulate_grad(e.grad, default_codes(e), e.offsets, e.psw, e.mode, e.include_last_offset, 1)
