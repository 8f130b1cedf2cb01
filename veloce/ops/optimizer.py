"""The optimizer op family: the fused sparse optimizer step over table rows.

Typed wrappers over ``torch.ops.veloce.sparse_update`` and ``nonfinite_flags`` (kernels:
``csrc/cpu/optimizer.cpp``), ``accumulate_and_update`` and ``accumulate_and_update_many``
(kernels: ``csrc/cpu/embedding.cpp``) and their fake kernels. Semantics: docs/ops.md,
section "optimizer".

Shape glossary: ``C`` rows of the table, ``D`` embedding dim, ``S`` optimizer state
width (0 SGD, D Adagrad, 1 RowWiseAdagrad, 2D Adam), ``U`` updated rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from veloce.ops import extension as _ext

__all__ = [
    "OPTIMIZERS", "accumulate_and_update", "accumulate_and_update_many", "nonfinite_flags", "sparse_update",
    "state_width",
]  # fmt: skip

#: Optimizer ids by name.
OPTIMIZERS = {"sgd": 0, "adagrad": 1, "rowwise_adagrad": 2, "adam": 3}


def _optimizer_id(optimizer: int | str) -> int:
    if isinstance(optimizer, str):
        key = optimizer.lower()
        if key not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)} (or 0-3), got {optimizer!r}")
        return OPTIMIZERS[key]
    return int(optimizer)


def state_width(optimizer: int | str, dim: int) -> int:
    """The optimizer state width ``S`` of ``optimizer`` for embedding dim ``dim``.

    Example::

        >>> state_width("adam", 64)
        128
    """
    opt = _optimizer_id(optimizer)
    if opt not in (0, 1, 2, 3):
        raise ValueError(f"optimizer must be 0 (SGD), 1 (Adagrad), 2 (RowWiseAdagrad) or 3 (Adam), got {opt}")
    return (0, dim, 1, 2 * dim)[opt]


def sparse_update(
    weights: torch.Tensor,
    opt_state: torch.Tensor,
    slots: torch.Tensor,
    grads: torch.Tensor,
    optimizer: int | str,
    lr: float,
    eps: float = 1e-10,
    beta1: float = 0.9,
    beta2: float = 0.999,
    weight_decay: float = 0.0,
    step: int = 1,
) -> None:
    """Applies one optimizer step, in place, to the rows ``slots`` of ``weights`` and ``opt_state``.

    One fused pass per row reads the row and its state and writes both back.
    ``weight_decay`` adds ``weight_decay * w`` to the gradient of the touched rows only.
    Rules (g the gradient, s / m / v the state):

    - ``"sgd"`` (0): ``w -= lr * g`` (``torch.optim.SGD``)
    - ``"adagrad"`` (1): ``s += g^2; w -= lr * g / (sqrt(s) + eps)`` (``torch.optim.Adagrad``)
    - ``"rowwise_adagrad"`` (2): ``s += mean(g^2); w -= lr * g / (sqrt(s) + eps)`` (FBGEMM)
    - ``"adam"`` (3): ``torch.optim.SparseAdam``, state ``[m, v]``, ``step`` 1-based.

    Every argument is checked before anything is written: a bad call changes nothing.

    Args:
        weights: the table rows; float32, float64, float16 or bfloat16, contiguous.
        opt_state: the optimizer state; float32 (float64 with float64 weights), contiguous.
        slots: int64 unique rows to update.
        grads: the gradient of each updated row, dtype of ``weights``.
        optimizer: a name of :data:`OPTIMIZERS` or its id.
        lr: learning rate.
        eps: added to the denominator (Adagrad, RowWiseAdagrad, Adam).
        beta1: Adam's first-moment decay.
        beta2: Adam's second-moment decay.
        weight_decay: L2 penalty applied to touched rows.
        step: the 1-based step count (Adam's bias correction).

    Shape:
        - weights: ``(C, D)``; opt_state: ``(C, S)``; slots: ``(U,)``; grads: ``(U, D)``

    Example::

        >>> w, s = torch.zeros(8, 4), torch.zeros(8, 4)
        >>> sparse_update(w, s, torch.tensor([2, 5]), torch.ones(2, 4), "adagrad", lr=0.1)
        >>> w[2, 0].item()
        -0.10000000149011612
    """
    _ext.require()
    torch.ops.veloce.sparse_update(
        weights, opt_state, slots, grads, _optimizer_id(optimizer), lr, eps, beta1, beta2, weight_decay, step
    )


def accumulate_and_update(
    weights: torch.Tensor,
    opt_state: torch.Tensor,
    grad_output: torch.Tensor,
    slots: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    mode: int | str,
    include_last_offset: bool,
    optimizer: int | str,
    lr: float,
    eps: float = 1e-10,
    beta1: float = 0.9,
    beta2: float = 0.999,
    weight_decay: float = 0.0,
    step: int = 1,
    check_inputs: bool = True,
    skip: torch.Tensor | None = None,
    lr_step: torch.Tensor | None = None,
) -> None:
    """The backward of ``pooled_lookup`` and the optimizer step in one pass, in place.

    Same result as ``accumulate_grad(grad_output, slots, offsets, per_sample_weights, mode,
    include_last_offset, C)`` followed by :func:`sparse_update` on its output, but each
    unique row's gradient is summed and applied at once and never written out (no
    ``(U, D)`` buffer). This is what ``DynamicEmbedding.step()`` runs.

    Args:
        weights: the table rows (updated in place).
        opt_state: the optimizer state (updated in place).
        grad_output: the gradient of the pooled output, dtype of ``weights``.
        slots: int64 slots of each position (codes -1 / -2 get no gradient).
        offsets: int64 bag starts, as ``pooled_lookup``.
        per_sample_weights: per-position scales (sum mode), or None.
        mode: "sum" (0) or "mean" (1).
        include_last_offset: as ``pooled_lookup``.
        optimizer, lr, eps, beta1, beta2, weight_decay, step: as :func:`sparse_update`.
        check_inputs: as :func:`veloce.ops.pooled_lookup`: ``False`` skips the checks of the
            offsets layout and slot values (on CUDA then no host sync at all).
        skip: a one-element bool tensor on ``weights``' device, or None. When it holds
            True the op changes nothing. It is read on the device (no host sync on CUDA),
            so an update can be queued behind a device-side check whose result the host
            reads later: ``DynamicEmbedding``'s NaN/Inf check of the gradient does this.
        lr_step: a ``(2,)`` float64 tensor ``[lr, step]`` on ``weights``' device, or None.
            When given it replaces ``lr`` and ``step`` and is read on the device (on CUDA
            by the kernels: no host sync), so that a call captured in a CUDA graph applies
            the learning rate and (Adam) step count the tensor holds when the graph is
            replayed. The CPU checks its values as it checks ``lr`` and ``step``; on CUDA
            they are not read on the host, so a bad value (a negative learning rate, an
            Adam step below 1) is the caller's. Rows too wide for the fused kernel's
            registers (over 512 fp32 columns, or 128 when rows are not 16-byte aligned)
            read it on the host, with a sync.

    On CUDA the whole op runs without a host synchronization when ``check_inputs`` is
    False: the sort, run-length encode and the fused reduce + update keep every size on
    the device.

    Shape:
        - weights: ``(C, D)``; opt_state: ``(C, S)``; grad_output: ``(B, D)``; slots: ``(N,)``;
          offsets: ``(B,)`` or ``(B + 1,)``; per_sample_weights: ``(N,)``
    """
    from veloce.ops.embedding import _mode_id

    _ext.require()
    torch.ops.veloce.accumulate_and_update(
        weights, opt_state, grad_output, slots, offsets, per_sample_weights, _mode_id(mode), include_last_offset,
        _optimizer_id(optimizer), lr, eps, beta1, beta2, weight_decay, step, check_inputs, skip, lr_step,
    )  # fmt: skip


def accumulate_and_update_many(
    weights: Sequence[torch.Tensor],
    opt_state: Sequence[torch.Tensor],
    grad_output: Sequence[torch.Tensor],
    slots: Sequence[torch.Tensor],
    offsets: Sequence[torch.Tensor],
    per_sample_weights: Sequence[torch.Tensor | None] | None,
    mode: int | str,
    include_last_offset: bool,
    optimizer: int | str,
    lr: float,
    eps: float = 1e-10,
    beta1: float = 0.9,
    beta2: float = 0.999,
    weight_decay: float = 0.0,
    step: int = 1,
    check_inputs: bool = True,
    skip: torch.Tensor | None = None,
    lr_step: torch.Tensor | None = None,
) -> None:
    """:func:`accumulate_and_update` of K tables in one call, in place.

    The result is that of ``accumulate_and_update(weights[k], opt_state[k], grad_output[k],
    slots[k], offsets[k], per_sample_weights[k], ...)`` for every k, bit for bit; the
    difference is speed on CUDA, where one sort and one fused kernel serve all the tables
    (about a dozen launches in all instead of a dozen per table: a step over many small
    tables is otherwise bound by the host). ``DynamicEmbedding``'s :func:`veloce.step_tables`
    steps its tables this way.

    The tables must share device, dtype and embedding dim (they may differ in rows, bags and
    ids, and some may have no ids); the other arguments are shared too. No table may appear
    twice (its weights or opt_state in two entries): the tables are updated at once. Every
    table is checked before any is written; messages name the table (``(table k)``).

    Args:
        weights, opt_state, grad_output, slots, offsets: one entry per table, as
            :func:`accumulate_and_update` takes them.
        per_sample_weights: one entry per table (None for a table without them), or None
            for no table.
        mode, include_last_offset, optimizer, lr, eps, beta1, beta2, weight_decay, step,
            check_inputs, skip, lr_step: as :func:`accumulate_and_update`, for every table
            (``skip`` and ``lr_step`` on the tables' device; with ``skip`` every table is
            updated, or none).

    Shape:
        - per table k: weights ``(C_k, D)``; opt_state ``(C_k, S)``; grad_output ``(B_k, D)``;
          slots ``(N_k,)``; offsets ``(B_k,)`` or ``(B_k + 1,)``; per_sample_weights ``(N_k,)``

    Example::

        >>> w = [torch.zeros(8, 4), torch.zeros(32, 4)]
        >>> s = [torch.zeros(8, 0), torch.zeros(32, 0)]  # SGD keeps no state
        >>> g = [torch.ones(1, 4), torch.ones(2, 4)]
        >>> slots = [torch.tensor([2, 2]), torch.tensor([5, 31])]
        >>> offsets = [torch.tensor([0]), torch.tensor([0, 1])]
        >>> accumulate_and_update_many(w, s, g, slots, offsets, None, "sum", False, "sgd", lr=0.1)
        >>> w[0][2, 0].item(), w[1][31, 0].item()
        (-0.20000000298023224, -0.10000000149011612)
    """
    from veloce.ops.embedding import _mode_id

    _ext.require()
    weights, opt_state = list(weights), list(opt_state)
    psw = [None] * len(weights) if per_sample_weights is None else list(per_sample_weights)
    if not weights and not opt_state and not grad_output and not slots and not offsets and not psw:
        return  # no table: nothing to do (and no tensor to dispatch on)
    torch.ops.veloce.accumulate_and_update_many(
        weights, opt_state, list(grad_output), list(slots), list(offsets), psw, _mode_id(mode), include_last_offset,
        _optimizer_id(optimizer), lr, eps, beta1, beta2, weight_decay, step, check_inputs, skip, lr_step,
    )  # fmt: skip


def nonfinite_flags(tensors: Sequence[torch.Tensor], owner: Sequence[int], num_owners: int) -> torch.Tensor:
    """Which groups of tensors hold a NaN or an infinity, as flags on the device (no sync).

    Returns a ``(num_owners + 1,)`` bool tensor on the tensors' device: entry ``k`` is True
    when some ``tensors[i]`` with ``owner[i] == k`` holds a NaN or an infinity, the last
    entry when any tensor does. Every element is read once, as its raw bits (the test
    ``torch.isfinite`` makes), in one kernel per dtype: on CUDA, no host sync and a
    couple of launches for any number of tensors. ``flags[num_owners:]`` is a ready
    ``skip`` argument of :func:`accumulate_and_update`: the update can be queued behind
    the check, and the host read the flags later. ``DynamicEmbedding``'s
    ``nonfinite_grad="raise"`` check of its pending gradients runs this.

    Args:
        tensors: floating-point tensors (any shape, dtype and layout) on one device; at
            least one.
        owner: the flag of each tensor, in ``[0, num_owners)``.
        num_owners: the number of flags before the last ("any") one.

    Example::

        >>> g = [torch.ones(2, 3), torch.tensor([1.0, float("nan")]), torch.zeros(4)]
        >>> nonfinite_flags(g, [0, 1, 1], 3).tolist()
        [False, True, False, True]
    """
    _ext.require()
    tensors = list(tensors)
    if not tensors:  # the dispatcher needs a tensor to choose a backend: say what is wrong here
        raise ValueError("veloce::nonfinite_flags: tensors must hold at least one tensor (the flags are made on its device)")
    return torch.ops.veloce.nonfinite_flags(tensors, list(owner), num_owners)


def _fake_nonfinite_flags(tensors, owner, num_owners):
    torch._check(len(tensors) > 0, lambda: "nonfinite_flags: tensors must hold at least one tensor")
    return tensors[0].new_empty((num_owners + 1,), dtype=torch.bool)


def _check_lr_step_fake(op: str, lr_step, ref: torch.Tensor) -> None:
    """The op's checks of ``lr_step`` (shape, dtype, device), for fake tensors."""
    if lr_step is None:
        return
    torch._check_value(
        lr_step.dtype == torch.float64 and lr_step.dim() == 1 and lr_step.shape[0] == 2,
        lambda: f"veloce::{op}: lr_step must be a float64 tensor of shape (2,) ([lr, step]), got {lr_step.dtype} "
        f"of shape {tuple(lr_step.shape)}",
    )
    torch._check_value(
        lr_step.device == ref.device, lambda: f"veloce::{op}: lr_step is on {lr_step.device} but weights is on {ref.device}"
    )


# hyper: optimizer, lr, eps, beta1, beta2, weight_decay, step[, check_inputs, skip, lr_step]
def _fake_accumulate_and_update(weights, opt_state, grad_output, slots, offsets, psw, mode, ilo, *hyper, **kw):
    torch._check(weights.dim() == 2, lambda: f"weights must be 2-D, got {weights.dim()}-D")
    torch._check(grad_output.dim() == 2, lambda: f"grad_output must be 2-D, got {grad_output.dim()}-D")
    _check_lr_step_fake("accumulate_and_update", hyper[9] if len(hyper) > 9 else kw.get("lr_step"), weights)


def _fake_accumulate_and_update_many(weights, opt_state, grad_output, slots, offsets, psw, pooling, ilo, *hyper,
                                     **kw):  # fmt: skip
    if len(weights):
        _check_lr_step_fake("accumulate_and_update_many", hyper[9] if len(hyper) > 9 else kw.get("lr_step"),
                            weights[0])  # fmt: skip
    k = len(weights)
    for name, lst in (("opt_state", opt_state), ("grad_output", grad_output), ("slots", slots), ("offsets", offsets),
                      ("per_sample_weights", psw)):  # fmt: skip
        if len(lst) != k:  # list lengths and ranks are static, even under tracing
            raise RuntimeError(f"weights has {k} entries but {name} has {len(lst)}")
    for w, g in zip(weights, grad_output):
        if w.dim() != 2 or g.dim() != 2:
            raise RuntimeError(f"weights and grad_output must be 2-D, got {w.dim()}-D and {g.dim()}-D")


def _fake_sparse_update(
    weights, opt_state, slots, grads, optimizer, lr, eps, beta1, beta2, weight_decay, step
):
    torch._check(weights.dim() == 2, lambda: f"weights must be 2-D, got {weights.dim()}-D")
    torch._check(grads.dim() == 2, lambda: f"grads must be 2-D, got {grads.dim()}-D")


if _ext.loaded:
    torch.library.register_fake("veloce::sparse_update")(_fake_sparse_update)
    torch.library.register_fake("veloce::accumulate_and_update")(_fake_accumulate_and_update)
    torch.library.register_fake("veloce::accumulate_and_update_many")(_fake_accumulate_and_update_many)
    torch.library.register_fake("veloce::nonfinite_flags")(_fake_nonfinite_flags)
