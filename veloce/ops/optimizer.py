"""The optimizer op family: the fused sparse optimizer step over table rows.

Typed wrappers over ``torch.ops.veloce.sparse_update`` and ``nonfinite_flags`` (kernels:
``csrc/cpu/optimizer.cpp``), ``accumulate_and_update`` and ``accumulate_and_update_many``
(kernels: ``csrc/cpu/embedding.cpp``) and their fake kernels. Semantics: docs/ops.md,
section "optimizer".

The optimizers are those of the C++ registry (``csrc/include/veloce/optim/registry.h``):
:data:`RULES` mirrors it, one line each. The ops take the hyperparameters as one float64
tensor, ``hparams = [lr, step, weight_decay, <the optimizer's own values>]`` (built by
:func:`hparams`), read on the device, so a new optimizer never changes a schema and a
captured CUDA graph applies the values the tensor holds when it is replayed.

Shape glossary: ``C`` rows of the table, ``D`` embedding dim, ``S`` optimizer state
width (0 SGD, D Adagrad, 1 RowWiseAdagrad, 2D Adam, 2D FTRL), ``U`` updated rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from veloce.ops import extension as _ext
from veloce.ops.embedding import _mode_id

__all__ = [
    "OPTIMIZERS", "RULES", "HyperparameterBuffer", "Rule", "accumulate_and_update", "accumulate_and_update_many",
    "hparams", "hparam_values", "nonfinite_flags", "sparse_update", "state_width",
]  # fmt: skip


@dataclass(frozen=True)
class Rule:
    """One optimizer of the C++ registry, as Python sees it.

    Attributes:
        id: the ops' ``optimizer`` argument (its line in ``registry.h``).
        name: the rule's name in messages (``"Adam"``).
        own: its own hyperparameters after ``[lr, step, weight_decay]``, in kernel order,
            with their defaults.
        vectors: state vectors of D values per row.
        row_values: state values per row after them.
    """

    id: int
    name: str
    own: tuple[tuple[str, float], ...]
    vectors: int
    row_values: int

    def state_width(self, dim: int) -> int:
        """The state width ``S`` for embedding dim ``dim``."""
        return self.vectors * dim + self.row_values


#: The optimizers by name, one line each (``csrc/include/veloce/optim/<name>.h`` holds the rule).
RULES: dict[str, Rule] = {
    "sgd": Rule(0, "SGD", (), 0, 0),
    "adagrad": Rule(1, "Adagrad", (("eps", 1e-10),), 1, 0),
    "rowwise_adagrad": Rule(2, "RowWiseAdagrad", (("eps", 1e-10),), 0, 1),
    "adam": Rule(3, "Adam", (("eps", 1e-10), ("beta1", 0.9), ("beta2", 0.999)), 2, 0),
    "ftrl": Rule(4, "FTRL", (("lr_power", -0.5), ("l1", 0.0), ("l2", 0.0), ("beta", 0.0)), 2, 0),
}

#: Optimizer ids by name.
OPTIMIZERS = {name: rule.id for name, rule in RULES.items()}

_BY_ID = {rule.id: rule for rule in RULES.values()}


def _choices() -> str:
    ids = [f"{r.id} ({r.name})" for r in _BY_ID.values()]
    return ", ".join(ids[:-1]) + " or " + ids[-1]


def _rule(optimizer: int | str) -> Rule:
    if isinstance(optimizer, str):
        key = optimizer.lower()
        if key not in RULES:
            raise ValueError(f"optimizer must be one of {sorted(RULES)} (or 0-{len(RULES) - 1}), got {optimizer!r}")
        return RULES[key]
    opt = int(optimizer)
    if opt not in _BY_ID:
        raise ValueError(f"optimizer must be {_choices()}, got {opt}")
    return _BY_ID[opt]


def _optimizer_id(optimizer: int | str) -> int:
    if isinstance(optimizer, str):
        return _rule(optimizer).id
    return int(optimizer)  # the op checks it, with the same message


def state_width(optimizer: int | str, dim: int) -> int:
    """The optimizer state width ``S`` of ``optimizer`` for embedding dim ``dim``.

    Example::

        >>> state_width("adam", 64)
        128
    """
    return _rule(optimizer).state_width(dim)


def hparam_values(optimizer: int | str, lr: float, step: int = 1, weight_decay: float = 0.0,
                  **own: float) -> list[float]:  # fmt: skip
    """The hyperparameter vector of ``optimizer``: ``[lr, step, weight_decay, *own]``.

    Args:
        optimizer: a name of :data:`OPTIMIZERS` or its id.
        lr: learning rate.
        step: the 1-based step count (Adam's bias correction).
        weight_decay: L2 penalty added to the gradient of the touched rows.
        **own: the optimizer's own values by name (:data:`RULES`); a missing one takes
            its default, an unknown one raises ``ValueError``.

    Example::

        >>> hparam_values("adam", 0.1, step=3, beta2=0.99)
        [0.1, 3.0, 0.0, 1e-10, 0.9, 0.99]
    """
    rule = _rule(optimizer)
    names = [name for name, _ in rule.own]
    unknown = sorted(set(own) - set(names))
    if unknown:
        raise ValueError(f"{rule.name} has no hyperparameter {unknown[0]!r}; its own are {names} (after lr, step "
                         f"and weight_decay)")  # fmt: skip
    return [float(lr), float(step), float(weight_decay)] + [float(own.get(name, default)) for name, default in rule.own]


def hparams(optimizer: int | str, lr: float, step: int = 1, weight_decay: float = 0.0,
            device: torch.device | str | None = None, **own: float) -> torch.Tensor:  # fmt: skip
    """:func:`hparam_values` as the float64 tensor the updating ops take, on ``device``.

    Example::

        >>> hparams("sgd", 0.5).tolist()
        [0.5, 1.0, 0.0]
    """
    return torch.tensor(hparam_values(optimizer, lr, step, weight_decay, **own), dtype=torch.float64, device=device)


class HyperparameterBuffer:
    """Persistent ``hparams`` tensors, one per (device, optimizer), refreshed in place.

    :meth:`fill` writes new values into the tensor without allocating: on the CPU
    directly, on CUDA from a pinned host buffer with a non-blocking copy on the current
    stream (no host sync). Kernels queued on that stream after the copy read the
    new values; a copy queued later does not disturb them (stream order), so each CUDA
    stream has a tensor of its own. Pinned buffers rotate through a small ring; a buffer
    is rewritten only once its last copy has run (an event query, normally long done).

    Example::

        buf = HyperparameterBuffer()
        h = buf.fill(weights.device, OPTIMIZERS["adam"], hparam_values("adam", 1e-3, step=7))
        accumulate_and_update(weights, opt_state, ..., "adam", hparams=h)
    """

    _RING = 4

    def __init__(self) -> None:
        self._tensors: dict[tuple, torch.Tensor] = {}
        self._ring: dict[tuple, list[tuple[torch.Tensor, Optional[Any]]]] = {}
        self._next: dict[tuple, int] = {}

    def fill(self, device: torch.device | str, optimizer: int, values: Sequence[float]) -> torch.Tensor:
        """The (device, optimizer) tensor, holding ``values`` for the work queued after this
        call (on CUDA: on the current stream)."""
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        stream = torch.cuda.current_stream(dev).stream_id if dev.type == "cuda" else 0
        key = (dev, int(optimizer), stream)
        t = self._tensors.get(key)
        if t is None or t.numel() != len(values):
            t = self._tensors[key] = torch.empty(len(values), dtype=torch.float64, device=dev)
            self._ring.pop(key, None)
        if t.device.type == "cpu":
            t.numpy()[:] = values
            return t
        if t.device.type != "cuda":
            t.copy_(torch.tensor(values, dtype=torch.float64))
            return t
        ring = self._ring.get(key)
        if ring is None:
            ring = self._ring[key] = [(torch.empty(len(values), dtype=torch.float64, pin_memory=True), None)
                                      for _ in range(self._RING)]  # fmt: skip
            self._next[key] = 0
        i = self._next[key]
        self._next[key] = (i + 1) % len(ring)
        host, done = ring[i]
        if done is not None and not done.query():
            done.synchronize()  # its last copy was queued _RING calls ago: normally long done
        host.numpy()[:] = values
        t.copy_(host, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        ring[i] = (host, event)
        return t


def _own_from(rule: Rule, eps: float, beta1: float, beta2: float, hyper: dict[str, float]) -> dict[str, float]:
    """The rule's own values from the wrappers' keyword arguments (eps, beta1, beta2 and
    ``**hyper``); names the rule lacks are ignored among eps, beta1 and beta2 only."""
    given = {"eps": eps, "beta1": beta1, "beta2": beta2}
    names = {name for name, _ in rule.own}
    own = {k: v for k, v in given.items() if k in names}
    own.update(hyper)
    return own


def _hparams_arg(op: str, optimizer: int | str, ref: torch.Tensor, lr: Optional[float], eps: float, beta1: float,
                 beta2: float, weight_decay: float, step: int, hparams_: Optional[torch.Tensor],
                 hyper: dict[str, float], lr_step: Optional[torch.Tensor] = None) -> torch.Tensor:  # fmt: skip
    """The ``hparams`` tensor of a wrapper call: ``hparams_`` as given, or built from the
    scalars on ``ref``'s device (``lr_step``, a device ``[lr, step]``, replacing lr and step)."""
    if hparams_ is not None:
        if lr_step is not None or hyper:
            raise ValueError(f"veloce::{op}: pass hparams alone, or the scalars (lr, step, ...) and no hparams")
        return hparams_
    opt = _optimizer_id(optimizer)
    rule = _BY_ID.get(opt)
    if rule is None:  # the op names the bad id; any tensor reaches it
        return torch.zeros(3, dtype=torch.float64, device=ref.device)
    own = _own_from(rule, eps, beta1, beta2, hyper)
    if lr_step is None:
        if lr is None:
            raise ValueError(f"veloce::{op}: lr is required (or hparams, the whole hyperparameter vector)")
        return hparams(opt, lr, step, weight_decay, device=ref.device, **own)
    if not (lr_step.dtype == torch.float64 and lr_step.dim() == 1 and lr_step.shape[0] == 2):
        raise ValueError(f"veloce::{op}: lr_step must be a float64 tensor of shape (2,) ([lr, step]), got "
                         f"{lr_step.dtype} of shape {list(lr_step.shape)}")  # fmt: skip
    if lr_step.device != ref.device:
        raise ValueError(f"veloce::{op}: lr_step is on {lr_step.device} but weights is on {ref.device}")
    if lr_step.device.type == "cpu":
        step_value = float(lr_step[1])
        if not (math.isfinite(step_value) and step_value == math.floor(step_value) and abs(step_value) < 9.0e15):
            raise ValueError(f"veloce::{op}: lr_step[1] (the step count) must be a whole number, got {step_value}")
    rest = hparams(opt, 0.0, 1, weight_decay, device=ref.device, **own)[2:]
    return torch.cat([lr_step, rest])


def sparse_update(
    weights: torch.Tensor,
    opt_state: torch.Tensor,
    slots: torch.Tensor,
    grads: torch.Tensor,
    optimizer: int | str,
    lr: Optional[float] = None,
    eps: float = 1e-10,
    beta1: float = 0.9,
    beta2: float = 0.999,
    weight_decay: float = 0.0,
    step: int = 1,
    *,
    hparams: Optional[torch.Tensor] = None,
    **hyper: float,
) -> None:
    """Applies one optimizer step, in place, to the rows ``slots`` of ``weights`` and ``opt_state``.

    One fused pass per row reads the row and its state and writes both back.
    ``weight_decay`` adds ``weight_decay * w`` to the gradient of the touched rows only.
    Rules (g the gradient, s / m / v / n / z the state):

    - ``"sgd"`` (0): ``w -= lr * g`` (``torch.optim.SGD``)
    - ``"adagrad"`` (1): ``s += g^2; w -= lr * g / (sqrt(s) + eps)`` (``torch.optim.Adagrad``)
    - ``"rowwise_adagrad"`` (2): ``s += mean(g^2); w -= lr * g / (sqrt(s) + eps)`` (FBGEMM)
    - ``"adam"`` (3): ``torch.optim.SparseAdam``, state ``[m, v]``, ``step`` 1-based.
    - ``"ftrl"`` (4): FTRL-Proximal (``tf.keras.optimizers.Ftrl``), state ``[n, z]``, own
      hyperparameters ``lr_power`` (-0.5), ``l1``, ``l2``, ``beta`` (0) by keyword.

    Every argument is checked before anything is written: a bad call changes nothing. On
    the CPU the hyperparameter values are checked too; on CUDA only the tensor's shape,
    dtype and device (the values stay on the device).

    Args:
        weights: the table rows; float32, float64, float16 or bfloat16, contiguous.
        opt_state: the optimizer state; float32 (float64 with float64 weights), contiguous.
        slots: int64 unique rows to update.
        grads: the gradient of each updated row, dtype of ``weights``.
        optimizer: a name of :data:`OPTIMIZERS` or its id.
        lr: learning rate (unless ``hparams`` is given).
        eps: added to the denominator (Adagrad, RowWiseAdagrad, Adam).
        beta1: Adam's first-moment decay.
        beta2: Adam's second-moment decay.
        weight_decay: L2 penalty applied to touched rows.
        step: the 1-based step count (Adam's bias correction).
        hparams: the whole hyperparameter vector (:func:`hparams`), a float64 tensor on
            ``weights``' device, instead of the scalars.
        **hyper: the optimizer's other own values by name (FTRL's ``lr_power``, ``l1``,
            ``l2``, ``beta``).

    Shape:
        - weights: ``(C, D)``; opt_state: ``(C, S)``; slots: ``(U,)``; grads: ``(U, D)``

    Example::

        >>> w, s = torch.zeros(8, 4), torch.zeros(8, 4)
        >>> sparse_update(w, s, torch.tensor([2, 5]), torch.ones(2, 4), "adagrad", lr=0.1)
        >>> w[2, 0].item()
        -0.10000000149011612
    """
    _ext.require()
    h = _hparams_arg("sparse_update", optimizer, weights, lr, eps, beta1, beta2, weight_decay, step, hparams, hyper)
    torch.ops.veloce.sparse_update(weights, opt_state, slots, grads, _optimizer_id(optimizer), h)


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
    lr: Optional[float] = None,
    eps: float = 1e-10,
    beta1: float = 0.9,
    beta2: float = 0.999,
    weight_decay: float = 0.0,
    step: int = 1,
    check_inputs: bool = True,
    skip: torch.Tensor | None = None,
    lr_step: torch.Tensor | None = None,
    *,
    hparams: Optional[torch.Tensor] = None,
    extra_rows: Optional[torch.Tensor] = None,
    extra_state: Optional[torch.Tensor] = None,
    **hyper: float,
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
        optimizer, lr, eps, beta1, beta2, weight_decay, step, hparams, hyper: as
            :func:`sparse_update`. ``hparams`` is read on the device (on CUDA by the
            kernels: no host sync), so a call captured in a CUDA graph applies the values
            the tensor holds when the graph is replayed.
        check_inputs: as :func:`veloce.ops.pooled_lookup`: ``False`` skips the checks of the
            offsets layout and slot values (on CUDA then no host sync at all).
        skip: a one-element bool tensor on ``weights``' device, or None. When it holds
            True the op changes nothing. It is read on the device (no host sync on CUDA),
            so an update can be queued behind a device-side check whose result the host
            reads later: ``DynamicEmbedding``'s NaN/Inf check of the gradient does this.
        lr_step: a ``(2,)`` float64 tensor ``[lr, step]`` on ``weights``' device, or None:
            when given it replaces ``lr`` and ``step`` (it becomes the head of the
            ``hparams`` built on the device, without a host read). The CPU checks the
            values as it checks ``lr`` and ``step``; on CUDA they are the caller's.
        extra_rows, extra_state: ``(E, D)`` rows of ``weights``' dtype and their ``(E, S)``
            optimizer state, contiguous and on ``weights``' device, both or neither (None):
            rows past the table's own, updated in place as rows of it: slot ``C + e`` is
            extra row ``e``, as :func:`veloce.ops.pooled_lookup` reads ``extra_rows``. The
            result is that of the op on the concatenated rows ``[weights; extra_rows]`` and
            states. A table with admission trains its default row so, in its own pass.

    On CUDA the whole op runs without a host synchronization when ``check_inputs`` is
    False: the sort, run-length encode and the fused reduce + update keep every size on
    the device.

    Shape:
        - weights: ``(C, D)``; opt_state: ``(C, S)``; grad_output: ``(B, D)``; slots: ``(N,)``;
          offsets: ``(B,)`` or ``(B + 1,)``; per_sample_weights: ``(N,)``; extra_rows:
          ``(E, D)``; extra_state: ``(E, S)``
    """
    _ext.require()
    h = _hparams_arg("accumulate_and_update", optimizer, weights, lr, eps, beta1, beta2, weight_decay, step, hparams,
                     hyper, lr_step)  # fmt: skip
    torch.ops.veloce.accumulate_and_update(
        weights, opt_state, grad_output, slots, offsets, per_sample_weights, _mode_id(mode), include_last_offset,
        _optimizer_id(optimizer), h, check_inputs, skip, extra_rows, extra_state,
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
    lr: Optional[float] = None,
    eps: float = 1e-10,
    beta1: float = 0.9,
    beta2: float = 0.999,
    weight_decay: float = 0.0,
    step: int = 1,
    check_inputs: bool = True,
    skip: torch.Tensor | None = None,
    lr_step: torch.Tensor | None = None,
    *,
    hparams: Optional[torch.Tensor] = None,
    extra_rows: Optional[Sequence[torch.Tensor]] = None,
    extra_state: Optional[Sequence[torch.Tensor]] = None,
    **hyper: float,
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
            check_inputs, skip, lr_step, hparams, hyper: as :func:`accumulate_and_update`,
            for every table (``skip``, ``lr_step`` and ``hparams`` on the tables' device;
            with ``skip`` every table is updated, or none).
        extra_rows, extra_state: None, or one entry per table each, as
            :func:`accumulate_and_update` takes them (``(0, D)`` and ``(0, S)`` for a table
            without extra rows).

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
    _ext.require()
    weights, opt_state = list(weights), list(opt_state)
    psw = [None] * len(weights) if per_sample_weights is None else list(per_sample_weights)
    if not weights and not opt_state and not grad_output and not slots and not offsets and not psw:
        return  # no table: nothing to do (and no tensor to dispatch on)
    ref = weights[0] if weights else opt_state[0] if opt_state else list(grad_output)[0]
    h = _hparams_arg("accumulate_and_update_many", optimizer, ref, lr, eps, beta1, beta2, weight_decay, step, hparams,
                     hyper, lr_step)  # fmt: skip
    torch.ops.veloce.accumulate_and_update_many(
        weights, opt_state, list(grad_output), list(slots), list(offsets), psw, _mode_id(mode), include_last_offset,
        _optimizer_id(optimizer), h, check_inputs, skip,
        None if extra_rows is None else list(extra_rows), None if extra_state is None else list(extra_state),
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


def _num_hparams(optimizer: int) -> Optional[int]:
    rule = _BY_ID.get(int(optimizer))
    return None if rule is None else 3 + len(rule.own)


def _check_hparams_fake(op: str, optimizer: int, hparams_: torch.Tensor, ref: torch.Tensor) -> None:
    """The op's checks of ``hparams`` (shape, dtype, device), for fake tensors."""
    n = _num_hparams(optimizer)
    if n is None:
        raise RuntimeError(f"veloce::{op}: optimizer must be {_choices()}, got {optimizer}")
    torch._check_value(
        hparams_.dtype == torch.float64 and hparams_.dim() == 1 and hparams_.shape[0] == n,
        lambda: f"veloce::{op}: hparams must be a float64 tensor of shape ({n},), got {hparams_.dtype} of shape "
        f"{tuple(hparams_.shape)}",
    )
    torch._check_value(
        hparams_.device == ref.device, lambda: f"veloce::{op}: hparams is on {hparams_.device} but weights is on {ref.device}"
    )


def _fake_accumulate_and_update(weights, opt_state, grad_output, slots, offsets, psw, mode, ilo, optimizer, hparams,
                                check_inputs=True, skip=None, extra_rows=None, extra_state=None):  # fmt: skip
    torch._check(weights.dim() == 2, lambda: f"weights must be 2-D, got {weights.dim()}-D")
    torch._check(grad_output.dim() == 2, lambda: f"grad_output must be 2-D, got {grad_output.dim()}-D")
    _check_hparams_fake("accumulate_and_update", optimizer, hparams, weights)
    if (extra_rows is None) != (extra_state is None):
        raise ValueError("accumulate_and_update: extra_rows and extra_state go together")


def _fake_accumulate_and_update_many(weights, opt_state, grad_output, slots, offsets, psw, pooling, ilo, optimizer,
                                     hparams, check_inputs=True, skip=None, extra_rows=None, extra_state=None):  # fmt: skip
    if len(weights):
        _check_hparams_fake("accumulate_and_update_many", optimizer, hparams, weights[0])
    k = len(weights)
    if (extra_rows is None) != (extra_state is None):
        raise ValueError("accumulate_and_update_many: extra_rows and extra_state go together")
    lists = [("opt_state", opt_state), ("grad_output", grad_output), ("slots", slots), ("offsets", offsets),
             ("per_sample_weights", psw)]  # fmt: skip
    if extra_rows is not None:
        lists += [("extra_rows", extra_rows), ("extra_state", extra_state)]
    for name, lst in lists:
        if len(lst) != k:  # list lengths and ranks are static, even under tracing
            raise RuntimeError(f"weights has {k} entries but {name} has {len(lst)}")
    for w, g in zip(weights, grad_output):
        if w.dim() != 2 or g.dim() != 2:
            raise RuntimeError(f"weights and grad_output must be 2-D, got {w.dim()}-D and {g.dim()}-D")


def _fake_sparse_update(weights, opt_state, slots, grads, optimizer, hparams):
    torch._check(weights.dim() == 2, lambda: f"weights must be 2-D, got {weights.dim()}-D")
    torch._check(grads.dim() == 2, lambda: f"grads must be 2-D, got {grads.dim()}-D")
    _check_hparams_fake("sparse_update", optimizer, hparams, weights)


if _ext.loaded:
    torch.library.register_fake("veloce::sparse_update")(_fake_sparse_update)
    torch.library.register_fake("veloce::accumulate_and_update")(_fake_accumulate_and_update)
    torch.library.register_fake("veloce::accumulate_and_update_many")(_fake_accumulate_and_update_many)
    torch.library.register_fake("veloce::nonfinite_flags")(_fake_nonfinite_flags)
