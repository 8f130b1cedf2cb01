"""The autograd of training lookups: one node for a call's tables, whose backward leaves
each table's gradient pending in the table (not in autograd) and gives the per-sample
weights theirs."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from veloce.ops.embedding import max_pool_position_grad
from veloce.runtime import capture as _capture
from veloce.sparse.backend import keep_gradient
from veloce.sparse.base import MODES, TableModule
from veloce.sparse.pending import Pending, reresolve
from veloce.table import pooled_many

__all__ = ["RECORDER", "autograd_anchor", "train_lookups"]

#: While ``veloce::lookup`` runs the eager path: the recorder that stands in for the eager
#: autograd node of its training lookups (:func:`train_lookups`), else None
#: (:mod:`veloce.sparse.compile` sets it).
RECORDER: Optional[Any] = None

_ANCHORS: dict[torch.device, torch.Tensor] = {}


def autograd_anchor(device: torch.device) -> torch.Tensor:
    """An empty leaf tensor on ``device`` that requires grad: the input that makes autograd
    run the backward of a lookup whose other inputs need no gradient (the table's rows get
    theirs through the table, not autograd). Its gradient is always None. One per device,
    shared by every lookup: a step over many tables evaluates one AccumulateGrad node for
    it, not one per table, and allocates nothing."""
    capture = _capture.ACTIVE
    if capture is not None:
        # A captured step's own: autograd syncs a leaf's gradient with the stream its
        # AccumulateGrad node was made on, and the shared anchor's was made on another
        # stream, outside the capture (which capture refuses).
        if capture.anchor is None:
            with torch.inference_mode(False):
                capture.anchor = torch.empty(0, device=device, requires_grad=True)
        return capture.anchor
    anchor = _ANCHORS.get(device)
    if anchor is None:
        with torch.inference_mode(False):  # a normal tensor even when first asked for in inference mode
            anchor = _ANCHORS.setdefault(device, torch.empty(0, device=device, requires_grad=True))
    return anchor


class _SparseLookup(torch.autograd.Function):
    """The pooled lookups of K tables (one autograd node for all of them), whose backward
    sends each table's sparse gradient to the table, not to autograd.

    ``anchor`` is an empty tensor that requires grad so that backward runs; each table's
    per-sample weights (``psws``, inputs after the fixed ones) get a real gradient when
    they require one. A table whose output gets no gradient (unused in the loss) receives
    nothing, as if it had not been looked up: no pending gradient, no step counted. One
    node for a model's tables saves the autograd machinery of K - 1 nodes per step on the
    host (:func:`lookup_many`); a module's own forward is the case K = 1.
    """

    @staticmethod
    def forward(ctx, anchor, modules, ids, slots, offsets, *psws):  # type: ignore[override]
        ctx.set_materialize_grads(False)  # None stays None: an unused output sends no gradient
        outs, ctx.argmax = _pooled(modules, slots, offsets, psws)
        ctx.modules = modules
        ctx.versions = [m.table.version for m in modules]
        ctx.capacities = [m.table.capacity for m in modules]  # a refused id's slot (admission)
        ctx.save_for_backward(*ids, *slots, *offsets, *psws)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        k = len(ctx.modules)
        saved = ctx.saved_tensors
        ids, slots, offsets, psws = (saved[j * k : (j + 1) * k] for j in range(4))
        grads = _contiguous_grads(grads, [m.table.dtype for m in ctx.modules])
        trains = _accumulates_into(ctx.next_functions[0][0])
        grad_psws = []
        for j, (module, grad_out) in enumerate(zip(ctx.modules, grads)):
            if grad_out is None:
                grad_psws.append(None)
                continue
            grad_psws.append(_table_backward(module, ids[j], slots[j], offsets[j], psws[j], grad_out,
                                             ctx.versions[j], trains, ctx.needs_input_grad[5 + j],
                                             ctx.argmax[j], ctx.capacities[j]))  # fmt: skip
        return (None, None, None, None, None, *grad_psws)


def _pooled(modules: Sequence[TableModule], slots: Sequence[torch.Tensor], offsets: Sequence[torch.Tensor],
            psws: Sequence[Optional[torch.Tensor]]) -> tuple[list[torch.Tensor], list[Optional[torch.Tensor]]]:  # fmt: skip
    """The pooled rows of the training lookups of ``modules`` at ``slots`` (no autograd),
    and per table the argmax positions its backward needs (``max_pooled``; None for sum
    and mean). Sum and mean tables pool in one kernel launch, max tables by torch ops."""
    outs: list = [None] * len(modules)
    argmax: list = [None] * len(modules)
    rest = [k for k, m in enumerate(modules) if m.mode != "max"]
    if rest:
        res = pooled_many([modules[k].table for k in rest], [slots[k] for k in rest],
                          [offsets[k] for k in rest], [psws[k] for k in rest], [MODES[modules[k].mode] for k in rest],
                          [modules[k].include_last_offset for k in rest],
                          [modules[k].table.default_rows() for k in rest])  # fmt: skip
        for k, o in zip(rest, res):
            outs[k] = o
    for k, m in enumerate(modules):
        if m.mode == "max":
            outs[k], argmax[k] = m.table.max_pooled(slots[k], offsets[k], m.include_last_offset, m.table.default_rows())
    return outs, argmax


def _table_backward(module: TableModule, ids: torch.Tensor, slots: torch.Tensor, offsets: torch.Tensor,
                    psw: Optional[torch.Tensor], grad_out: torch.Tensor, version: int, trains: bool,
                    psw_grad: bool, argmax: Optional[torch.Tensor] = None,
                    capacity: Optional[int] = None) -> Optional[torch.Tensor]:  # fmt: skip
    """One table's part of a training lookup's backward: the pending gradient of its rows
    (when the pass ``trains`` the tables), and the gradient of its per-sample weights (when
    ``psw_grad``). ``slots`` were taken at table ``version``; ``grad_out`` is contiguous, in
    the table's dtype. ``argmax``: a max table's argmax positions (:func:`_pooled`): each
    column's gradient goes to its bag's argmax position, kept as a sum-mode gradient of one
    bag per position. Shared by :class:`_SparseLookup` and the compiled lookup's backward op
    (:mod:`veloce.sparse.compile`). ``capacity``: the table's capacity at forward time
    (None: its capacity at backward), the slot of the positions its default row served (admission): their
    gradient goes to the default row (:meth:`PendingGradient._accumulate_default`)."""
    table = module.table
    refused = None
    if table.admits:
        refused = slots == (table.capacity if capacity is None else capacity)
        slots = slots.masked_fill(refused, -2)
    if version != table.version:  # the table grew or evicted since forward
        slots = reresolve(table, ids, slots, refused)
    ilo = module.include_last_offset
    if trains and argmax is not None:
        grad_rows = max_pool_position_grad(grad_out, argmax, offsets, slots.numel(), ilo)
        positions = torch.arange(slots.numel(), device=slots.device)
        keep_gradient(module, Pending(ids, slots, positions, None, grad_rows, MODES["sum"], False, table.version,
                                      refused))  # fmt: skip
    elif trains:
        keep_gradient(module, Pending(ids, slots, offsets, psw, grad_out, MODES[module.mode], ilo, table.version,
                                      refused))  # fmt: skip
    if psw is None or not psw_grad:
        return None
    if refused is not None:  # the default row's value at the refused positions: the slot C, extra row 0
        return table.psw_grad(slots.masked_fill(refused, table.capacity), offsets, grad_out, ilo, table.default_rows())
    return table.psw_grad(slots, offsets, grad_out, ilo)


_WILL_EXECUTE = getattr(torch._C, "_will_engine_execute_node", None)


def _accumulates_into(anchor_node) -> bool:
    """Whether the backward pass running now accumulates gradients into the anchor's
    leaf (``anchor_node``: its AccumulateGrad node), as ``loss.backward()`` does into every
    leaf. ``torch.autograd.grad(...)`` and ``backward(inputs=[...])`` accumulate only into
    what they are asked for, never into the anchor: such a pass gives the per-sample
    weights their gradient but the tables none, as it leaves an ``nn.EmbeddingBag``'s
    ``weight.grad`` alone."""
    if _WILL_EXECUTE is None:  # no such query in this torch: every pass trains the tables
        return True
    try:
        return bool(_WILL_EXECUTE(anchor_node))
    except RuntimeError:  # autograd.grad(..., inputs=[the anchor]): grad() accumulates into nothing
        return False


def _contiguous_grads(grads: Sequence[Optional[torch.Tensor]],
                      dtypes: Sequence[torch.dtype]) -> list[Optional[torch.Tensor]]:  # fmt: skip
    """The lookups' output gradients as contiguous tensors of their tables' dtypes (what
    the sparse update reads). A model that stacks its tables' outputs (DLRM's and DeepFM's
    interactions) gets each one's gradient as a strided slice of the stack's gradient: a
    copy each, one launch per table on a GPU. The slices of one shape, dtype and device are
    copied by one ``torch.stack`` instead (one launch for all, the same values), whose
    rows then are contiguous views. They share the stack's memory, which lives until the
    last of those tables has stepped (the same total as the per-table copies, when the
    tables step together, as ``step_tables`` and ``CombinedOptimizer`` step them)."""
    out = list(grads)
    groups: dict[tuple, list[int]] = {}
    for j, g in enumerate(grads):
        if g is None:
            continue
        g = g.to(dtypes[j])
        out[j] = g
        if not g.is_contiguous():
            groups.setdefault((g.shape, g.dtype, g.device), []).append(j)
    for idx in groups.values():
        if len(idx) == 1:
            out[idx[0]] = out[idx[0]].contiguous()
            continue
        for j, g in zip(idx, torch.stack([out[j] for j in idx]).unbind(0)):
            out[j] = g
    return out


def train_lookups(modules: Sequence[TableModule], bags: Sequence[tuple],
                   slots: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """The training lookups of distinct tables' validated ``bags`` (ids, offsets, psw), their
    ids inserted at ``slots``: one autograd node for all of them (:class:`_SparseLookup`)."""
    ids, offsets, psws = zip(*bags)
    recorder = RECORDER
    if recorder is not None:  # inside the compiled lookup's op, which is the autograd node itself
        return recorder.record(modules, ids, slots, offsets, psws)
    return _SparseLookup.apply(autograd_anchor(ids[0].device), list(modules), ids, list(slots), offsets, *psws)

