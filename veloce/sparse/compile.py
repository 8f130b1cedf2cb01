"""``DynamicEmbedding`` lookups inside ``torch.compile`` and ``torch.export``.

A training lookup checks its input, inserts new ids, grows or evicts, and reads the device
back while doing so: Python over table tensors whose size changes. Traced by dynamo, that
Python breaks the graph at every host read, and the table's buffers become graph inputs
whose sizes are guarded, so every growth recompiles. Inside a compiled graph a lookup is
therefore ONE opaque op, ``veloce::lookup``, whose arguments are the call's ids, offsets and
per-sample weights, and the int handles of its modules in a process-wide registry of weak
references (:func:`register`). No table tensor, and no table attribute that growth changes,
is a graph input or a guard: tables grow and evict outside the graph's view. A call of
:func:`veloce.lookup_many` over K tables is one op too (the models' whole forward is then
one graph).

- Forward: the op's implementation runs the module's own eager path (input checks, insert,
  growth, pooled lookup: ``DynamicEmbedding.forward`` or ``lookup_many``), with a
  :class:`_Recorder` in place of the eager autograd node, which keeps what the backward
  needs: the slots of the ids, the bag layout looked up with and the table's version.
  These leave the op as outputs (``index``, ``versions``) that the graph saves for backward.
- Backward: a second opaque op, ``veloce::lookup_backward``, does what the eager backward
  does (``embedding._table_backward``): it leaves each table's pooled gradient pending
  until ``step()`` and returns the per-sample weights' gradients. It also returns the
  gradient of the lookups' autograd anchor (an empty tensor): an output the graph passes
  on, so that the op, whose effect is on the tables, is never dead code.
- ``torch.export`` (eval mode only): the lookup is traced over the table's buffers instead
  (``find`` + ``pooled_lookup``): the exported program holds the rows as they are at export
  time, as an exported ``nn.EmbeddingBag`` holds its weight, and needs no registry.

Tables sharded by :class:`veloce.distributed.HybridParallel` are looked up eagerly: their
lookups exchange ids and gradients between ranks inside autograd, which the opaque op does
not carry. The call is then a graph break whose reason says so (an error with
``fullgraph=True``).
"""

from __future__ import annotations

import inspect
import itertools
import weakref
from typing import Any, Optional, Sequence

import torch

from veloce.ops import extension as _ext
from veloce.ops.hash_table import initialize
from veloce.sparse import autograd as _autograd
from veloce.sparse.autograd import autograd_anchor
from veloce.sparse.base import MODES, TableModule
from veloce.sparse.lookup import install_compiled_path, lookup_many

__all__ = ["is_compiling", "is_exporting", "lookup", "register"]

is_compiling = getattr(torch.compiler, "is_compiling", None)
if is_compiling is None:  # torch < 2.3

    def is_compiling() -> bool:  # type: ignore[misc]
        """Whether dynamo is tracing (torch.compile, torch.export)."""
        return torch._dynamo.is_compiling()


_torch_is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)


def is_exporting() -> bool:
    """Whether dynamo traces for torch.export (not torch.compile).

    Reads the flag torch.export sets: dynamo reads it as a global (guarded), where torch 2.11
    folds ``torch.compiler.is_exporting()`` to True under torch.compile too. torch < 2.5
    cannot tell an export from a compile: an export then holds the opaque op too, which runs
    in the exporting process only (its handles name modules of that process)."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return bool(flag) if flag is not None else _torch_is_exporting()

_MODULES: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)  # a row dtype as an op argument

def register(module: Any) -> int:
    """A new handle of ``module`` (a ``DynamicEmbedding``) for the lookup op. The registry
    holds a weak reference: a module that is gone leaves its handle unresolvable."""
    handle = next(_HANDLES)
    _MODULES[handle] = module
    return handle


def _modules(handles: Sequence[int], op: str) -> list:
    out = []
    for h in handles:
        m = _MODULES.get(h)
        if m is None:
            raise RuntimeError(
                f"veloce::{op}: the DynamicEmbedding of handle {h} no longer exists (a compiled graph outlived "
                f"the module it was compiled for); compile the model that holds the tables you train"
            )
        out.append(m)
    return out


class _Recorder:
    """The training lookups that one ``veloce::lookup`` call's eager path makes: for each
    pooled output (by identity), its slots, bag offsets and the table's version at lookup."""

    def __init__(self) -> None:
        self.lookups: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, Optional[torch.Tensor]]] = {}

    def record(self, modules: Sequence[Any], ids: Sequence[torch.Tensor], slots: Sequence[torch.Tensor],
               offsets: Sequence[torch.Tensor],
               psws: Sequence[Optional[torch.Tensor]]) -> tuple[torch.Tensor, ...]:  # fmt: skip
        """``embedding._train_lookups`` without its autograd node: the pooled outputs."""
        outs, argmax = _autograd._pooled(modules, slots, offsets, psws)
        for m, out, s, o, a in zip(modules, outs, slots, offsets, argmax):
            self.lookups[id(out)] = (out, s, o, m.table.version, a)
        return tuple(outs)


# ---- the traced entry ----------------------------------------------------------------------
def lookup(modules: Sequence[Any], inputs: Sequence[Any], many: bool) -> list[torch.Tensor]:
    """The lookups of ``modules`` on ``inputs`` (per module a tensor of ids, or a tuple
    ``(input, offsets[, per_sample_weights])``) while dynamo traces: what
    ``DynamicEmbedding.forward`` (``many=False``) and :func:`veloce.lookup_many` run then.

    Returns:
        One pooled ``(B, D)`` tensor per module.
    """
    if is_exporting():
        return [_exported_lookup(m, *_args(x)) for m, x in zip(modules, inputs)]
    args = [_args(x) for x in inputs]
    if not _opaque(modules, args):
        return _eager_lookups(modules, inputs, many)
    training = [bool(m.training) for m in modules]
    grad = torch.is_grad_enabled()
    # The autograd anchor makes the op differentiable when no input requires grad (as in eager).
    needs_anchor = grad and any(training)
    anchor = _anchor(args[0][0].device) if needs_anchor else None
    # Tensor lists without None (autograd of a custom op passes gradients through those only).
    outs, _, _ = torch.ops.veloce.lookup(
        anchor, [a[0] for a in args], [a[1] for a in args if a[1] is not None],
        [a[2] for a in args if a[2] is not None], [a[1] is not None for a in args], [a[2] is not None for a in args],
        [m._handle for m in modules], [m.embedding_dim for m in modules],
        [_DTYPES.index(m.table.row_dtype) for m in modules], training, [bool(m.include_last_offset) for m in modules],
        [m.mode == "max" for m in modules], grad, many,
    )  # fmt: skip
    return list(outs)


def _args(x: Any) -> tuple:
    """One lookup's ``(input, offsets, per_sample_weights)``, the missing ones None."""
    if isinstance(x, torch.Tensor):
        return (x, None, None)
    a = tuple(x) if isinstance(x, (tuple, list)) else (x,)
    return a + (None,) * (3 - len(a))


def _opaque(modules: Sequence[Any], args: Sequence[tuple]) -> bool:
    """Whether the op serves these lookups: local tables, tensor arguments of nn.EmbeddingBag's
    shapes (anything else runs eagerly, which raises the eager path's own error for bad
    arguments)."""
    if not modules or len(modules) != len(args):
        return False
    for m, a in zip(modules, args):
        if not isinstance(m, TableModule) or m.backend.sharded or len(a) != 3:
            return False
        x, offsets, psw = a
        if not isinstance(x, torch.Tensor) or any(t is not None and not isinstance(t, torch.Tensor) for t in a[1:]):
            return False
        # The shapes the fake kernel reads: 2-D bags, or 1-D ids with 1-D offsets (the values are the op's to check).
        if not (x.dim() == 2 and offsets is None or x.dim() == 1 and offsets is not None and offsets.dim() == 1):
            return False
    return True


def _eager_lookups(modules: Sequence[Any], inputs: Sequence[Any], many: bool) -> list[torch.Tensor]:
    """The lookups run eagerly: a graph break (sharded tables, or arguments the op does not
    take) whose reason says so."""
    _make_eager()
    return _EAGER["fn"](modules, inputs, many)


def _make_eager() -> bool:
    """Wraps :func:`_run_eagerly` in ``torch.compiler.disable``, once. Dynamo runs this at trace
    time rather than tracing it (like :func:`_anchor`): the wrapper cannot be made in traced
    code, nor at import (``torch.compiler.disable`` imports dynamo)."""
    if "fn" not in _EAGER:
        reason = ("veloce: lookups of tables sharded by HybridParallel run eagerly (and lookups of arguments "
                  "unlike nn.EmbeddingBag's, which raise there); lookups of local tables are one op in the graph")  # fmt: skip
        kw = {"reason": reason} if "reason" in inspect.signature(torch.compiler.disable).parameters else {}
        _EAGER["fn"] = torch.compiler.disable(_run_eagerly, **kw)
    return True


_make_eager._dynamo_marked_constant = True  # type: ignore[attr-defined]
_EAGER: dict[str, Any] = {}


def _run_eagerly(modules: Sequence[Any], inputs: Sequence[Any], many: bool) -> list[torch.Tensor]:
    if many:
        return lookup_many(modules, inputs)
    return [modules[0].forward(*_args(inputs[0]))]


def _anchor(device: torch.device) -> torch.Tensor:
    """The lookups' autograd anchor of ``device`` (``embedding.autograd_anchor``), made and
    returned at trace time, where the graph takes it as an input: creating a leaf that
    requires grad is not traceable, and the anchor is one tensor per device for the whole
    process. (What ``torch._dynamo.assume_constant_result`` marks, without importing dynamo.)
    Its gradient accumulator is kept (:func:`_trains` asks whether a pass runs it): the op's
    backward runs below autograd, where it cannot be looked up."""
    anchor = autograd_anchor(device)
    edge = getattr(torch.autograd.graph, "get_gradient_edge", None)
    if edge is not None and device not in _ANCHOR_NODES:
        with torch.enable_grad():
            _ANCHOR_NODES[device] = edge(anchor).node
    return anchor


_ANCHOR_NODES: dict[torch.device, Any] = {}
_anchor._dynamo_marked_constant = True  # type: ignore[attr-defined]


# ---- veloce::lookup ------------------------------------------------------------------------
_LOOKUP_SCHEMA = (
    "(Tensor? anchor, Tensor[] inputs, Tensor[] offsets, Tensor[] per_sample_weights, bool[] has_offsets, "
    "bool[] has_psw, int[] handles, int[] dims, int[] dtypes, bool[] training, bool[] include_last_offset, "
    "bool[] max_mode, bool grad_enabled, bool many) "
    "-> (Tensor[] outs, Tensor index, Tensor versions)"
)
_BACKWARD_SCHEMA = (
    "(Tensor?[] grads, Tensor[] inputs, Tensor?[] offsets, Tensor?[] per_sample_weights, Tensor index, "
    "Tensor versions, int[] handles, bool[] psw_grad) -> (Tensor anchor_grad, Tensor[] psw_grads)"
)


def _lookup_impl(anchor, inputs, offsets, per_sample_weights, has_offsets, has_psw, handles, dims, dtypes, training,
                 include_last_offset, max_mode, grad_enabled, many):  # fmt: skip
    """``veloce::lookup``: the modules' eager lookups, with the autograd node's inputs as outputs.

    ``index``: for each table that the call trains (``training[k] and grad_enabled``), in
    order, the slots of its ids then the bag offsets it was looked up with (on CUDA the
    offsets of a deferred insert's refused layout are replaced on the device: the backward
    must read those), then, for a ``mode="max"`` table, its (B, D) argmax positions.
    ``versions``: (K,) int64 on the CPU, each table's version at its lookup, -1 for a table
    not trained."""
    modules = _modules(handles, "lookup")
    _check_unchanged(modules, dims, dtypes, training, include_last_offset, max_mode)
    offsets, per_sample_weights = _unpacked(offsets, has_offsets), _unpacked(per_sample_weights, has_psw)
    args = [(x, o, None if p is None else p.detach()) for x, o, p in zip(inputs, offsets, per_sample_weights)]
    recorder, outer = _Recorder(), _autograd.RECORDER
    _autograd.RECORDER = recorder
    try:
        with torch.set_grad_enabled(grad_enabled):
            if many:
                            outs = lookup_many(modules, args)
            else:
                outs = [modules[0].forward(*args[0])]
    finally:
        _autograd.RECORDER = outer
    parts: list[torch.Tensor] = []
    versions: list[int] = []
    for k, out in enumerate(outs):
        if not (training[k] and grad_enabled):
            versions.append(-1)
            continue
        rec = recorder.lookups.get(id(out))
        if rec is None or rec[0] is not out:
            raise AssertionError(f"veloce::lookup: the training lookup of table {k} recorded nothing for its backward")
        parts += [rec[1], rec[2]] if rec[4] is None else [rec[1], rec[2], rec[4].reshape(-1)]
        versions.append(rec[3])
    if parts:
        index = torch.cat(parts)
    else:
        index = torch.empty(0, dtype=torch.long, device=inputs[0].device)
    return list(outs), index, torch.tensor(versions, dtype=torch.long)


def _check_unchanged(modules: Sequence[Any], dims, dtypes, training, include_last_offset, max_mode) -> None:
    """The attributes a graph was compiled for are still the modules' (dynamo guards them:
    this catches a change that slipped past the guards, before any table changes)."""
    for k, m in enumerate(modules):
        then = (dims[k], _DTYPES[dtypes[k]], bool(training[k]), bool(include_last_offset[k]), bool(max_mode[k]))
        now = (m.embedding_dim, m.table.row_dtype, bool(m.training), bool(m.include_last_offset), m.mode == "max")
        if now != then or m.backend.sharded:
            raise RuntimeError(
                f"veloce::lookup: table {k} changed since its graph was compiled: (embedding_dim, dtype, training, "
                f"include_last_offset, max mode) was {then}, is {now}{', and it is sharded' if m.backend.sharded else ''}; "
                f"call torch._dynamo.reset() and compile again"
            )


def _num_offsets(x: torch.Tensor, offsets: Optional[torch.Tensor], include_last_offset: bool):
    """The number of bag offsets a lookup of ``x`` uses (``(B,)``, or ``(B + 1,)`` with
    include_last_offset; made for a 2-D ``x``)."""
    if x.dim() == 2:
        return x.shape[0] + int(include_last_offset)
    return 0 if offsets is None else offsets.shape[0]


def _lookup_fake(anchor, inputs, offsets, per_sample_weights, has_offsets, has_psw, handles, dims, dtypes, training,
                 include_last_offset, max_mode, grad_enabled, many):  # fmt: skip
    offsets = _unpacked(offsets, has_offsets)
    outs = []
    n = 0
    for k, x in enumerate(inputs):
        num_offsets = _num_offsets(x, offsets[k], include_last_offset[k])
        bags = num_offsets - 1 if include_last_offset[k] else num_offsets
        outs.append(x.new_empty((bags, dims[k]), dtype=_DTYPES[dtypes[k]]))
        if training[k] and grad_enabled:
            n = n + x.numel() + num_offsets + (bags * dims[k] if max_mode[k] else 0)
    index = inputs[0].new_empty((n,), dtype=torch.long)
    return outs, index, torch.empty((len(inputs),), dtype=torch.long, device="cpu")


def _setup_context(ctx, inputs, output) -> None:
    anchor, ids, offsets, psws, has_offsets, has_psw, handles = inputs[:7]
    _, index, versions = output
    ctx.set_materialize_grads(False)  # None stays None: an unused output sends no gradient, as in eager
    ctx.handles = list(handles)
    ctx.has_anchor = anchor is not None
    ctx.sizes = (len(ids), len(offsets), len(psws))
    ctx.has_offsets, ctx.has_psw = list(has_offsets), list(has_psw)
    ctx.psw_grad = [p.requires_grad for p in psws]
    ctx.save_for_backward(*ids, *offsets, *psws, index, versions)


def _backward(ctx, grad_outs, grad_index, grad_versions):
    saved = ctx.saved_tensors
    k, n_offsets, n_psws = ctx.sizes
    ids = list(saved[:k])
    offsets = _unpacked(saved[k : k + n_offsets], ctx.has_offsets)
    psws = _unpacked(saved[k + n_offsets : k + n_offsets + n_psws], ctx.has_psw)
    index, versions = saved[-2:]
    psw_grad = _unpacked(ctx.psw_grad, ctx.has_psw, False)
    anchor_grad, psw_grads = torch.ops.veloce.lookup_backward(
        list(grad_outs), ids, offsets, psws, index, versions, ctx.handles, psw_grad
    )
    grad_psws = [g if need else None for g, need, has in zip(psw_grads, psw_grad, ctx.has_psw) if has]
    return (anchor_grad if ctx.has_anchor else None, [None] * k, [None] * n_offsets, grad_psws,
            None, None, None, None, None, None, None, None, None, None)  # fmt: skip


def _unpacked(packed: Sequence[Any], present: Sequence[bool], missing: Any = None) -> list:
    """Per lookup, the entry of ``packed`` (the present ones, in order) or ``missing``."""
    it = iter(packed)
    return [next(it) if has else missing for has in present]


# ---- veloce::lookup_backward ---------------------------------------------------------------
def _lookup_backward_impl(grads, inputs, offsets, per_sample_weights, index, versions, handles, psw_grad):
    """``veloce::lookup``'s backward: each trained table's pooled gradient left pending (as
    the eager backward leaves it, ``embedding._table_backward``), and the per-sample weights'
    gradients (empty where none is asked for). Returns an empty gradient of the anchor too."""

    modules = _modules(handles, "lookup_backward")
    device = inputs[0].device
    vers = versions.tolist()
    grads = _autograd._contiguous_grads(grads, [m.table.dtype for m in modules])
    trains = _trains(device)
    psw_grads: list[torch.Tensor] = []  # an empty tensor where there is none (each its own: no aliases)
    pos = 0
    for k, (m, x) in enumerate(zip(modules, inputs)):
        n = x.numel()
        num_offsets = _num_offsets(x, offsets[k], m.include_last_offset)
        argmax = None
        if vers[k] >= 0:  # the part of index that is this table's (see _lookup_impl)
            slots, offs = index[pos : pos + n], index[pos + n : pos + n + num_offsets]
            pos += n + num_offsets
            if m.mode == "max":
                bags = num_offsets - int(m.include_last_offset)
                argmax = index[pos : pos + bags * m.embedding_dim].view(bags, m.embedding_dim)
                pos += bags * m.embedding_dim
        psw = per_sample_weights[k]
        if grads[k] is None:
            psw_grads.append(torch.empty(0, device=device))
            continue
        ids = x.long().reshape(-1)
        flat_psw = None if psw is None else psw.reshape(-1).to(m.table.dtype)
        if vers[k] >= 0:
            g = _autograd._table_backward(m, ids, slots, offs, flat_psw, grads[k], vers[k], trains, psw_grad[k],
                                          argmax)
        elif psw is not None and psw_grad[k]:
            g = _eval_psw_grad(m, ids, _flat_offsets(x, offsets[k], m.include_last_offset), grads[k])
        else:
            g = None
        psw_grads.append(torch.empty(0, device=device) if g is None else g.reshape(psw.shape).to(psw.dtype))
    return torch.empty(0, device=device), psw_grads


def _lookup_backward_fake(grads, inputs, offsets, per_sample_weights, index, versions, handles, psw_grad):
    device = inputs[0].device
    out = [p.new_empty(p.shape) if p is not None and need else torch.empty(0, device=device)
           for p, need in zip(per_sample_weights, psw_grad)]  # fmt: skip
    return torch.empty(0, device=device), out


def _trains(device: torch.device) -> bool:
    """Whether the backward pass running now accumulates into the lookups' anchor (a
    ``loss.backward()``), so that the tables take its gradient; ``torch.autograd.grad`` and
    ``backward(inputs=...)`` give them none, as in eager (``embedding._accumulates_into``)."""

    node = _ANCHOR_NODES.get(device)
    return True if node is None else _autograd._accumulates_into(node)


def _flat_offsets(x: torch.Tensor, offsets: Optional[torch.Tensor], include_last_offset: bool) -> torch.Tensor:
    """The bag offsets of a lookup of ``x``, as ``DynamicEmbedding._bags`` makes them."""
    if x.dim() != 2:
        return offsets.long()
    b, bag_len = x.shape
    num = b + int(include_last_offset)
    if bag_len:
        return torch.arange(0, num * bag_len, bag_len, device=x.device)
    return torch.zeros(num, dtype=torch.long, device=x.device)


def _eval_psw_grad(module: Any, ids: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The per-sample weights' gradient of an eval-mode lookup: ``<row(i), grad[bag(i)]>``,
    the rows as the lookup read them (unknown ids: the initializer's row, or zeros)."""

    slots, extra = module._eval_slots(ids)
    return module.table.psw_grad(slots, offsets, grad, module.include_last_offset, extra)


# ---- torch.export --------------------------------------------------------------------------
def _exported_lookup(module: Any, input: Any, offsets: Any = None, per_sample_weights: Any = None) -> torch.Tensor:
    """An eval-mode lookup traced over the table's buffers (what ``torch.export`` holds):
    ``find``, unknown ids as the eval forward reads them, and a checked ``pooled_lookup``."""

    if module.training:
        raise RuntimeError(
            "torch.export of a DynamicEmbedding in training mode is not supported: a training lookup inserts ids "
            "and grows the table, which an exported program cannot hold. Export the model in eval mode "
            "(model.eval()): its lookups read the rows as they are at export time (unknown ids read the "
            "initializer's value, or zeros with unknown='zeros'). To train with a compiled graph, use torch.compile."
        )
    if module.backend.sharded:
        raise RuntimeError(
            "torch.export of a DynamicEmbedding sharded by HybridParallel is not supported: each rank holds part "
            "of its rows. Export a one-process copy of the model in eval mode (load a checkpoint into it)."
        )
    # The offsets' values are checked by pooled_lookup (check_inputs=True) when the program runs.
    ids, offsets, psw = module._bags(input, offsets, per_sample_weights, deferred=[])
    table = module.table
    slots = table.find(ids)
    missing = slots < 0
    if module.padding_idx is not None:
        pad = ids == module.padding_idx
        missing = missing & ~pad
        slots = slots.masked_fill(pad, -1)
    extra = None
    if module.unknown == "zeros":
        slots = slots.masked_fill(missing, -2)
    elif table.admits:  # the default row (veloce.admission), extra row 0, for every unknown id
        extra = table.default_rows()
        slots = slots.masked_fill(missing, table.capacity)
    else:  # the initializer's row of every id, read where the id is unknown (no data-dependent size)
        init = table.initializer
        extra = initialize(ids, module.embedding_dim, table.seed, init.kind, init.a, init.b, table.dtype)
        slots = torch.where(missing, torch.arange(ids.numel(), device=ids.device) + table.capacity, slots)
    if module.mode == "max":
        return table.max_pooled(slots, offsets, module.include_last_offset, extra)[0]
    return table.pooled(slots, offsets, psw, MODES[module.mode], module.include_last_offset, extra,
                        check_inputs=True)  # fmt: skip


def _register() -> None:
    tags = {"tags": (torch.Tag.cudagraph_unsafe,)} if hasattr(torch.Tag, "cudagraph_unsafe") else {}
    supports_tags = "tags" in inspect.signature(torch.library.custom_op).parameters
    kw = tags if supports_tags else {}
    lookup_op = torch.library.custom_op("veloce::lookup", _lookup_impl, mutates_args=(), schema=_LOOKUP_SCHEMA, **kw)
    lookup_op.register_fake(_lookup_fake)
    lookup_op.register_autograd(_backward, setup_context=_setup_context)
    backward_op = torch.library.custom_op("veloce::lookup_backward", _lookup_backward_impl, mutates_args=(),
                                          schema=_BACKWARD_SCHEMA, **kw)  # fmt: skip
    backward_op.register_fake(_lookup_backward_fake)


if _ext.loaded:
    _register()
install_compiled_path(lookup, is_compiling)
