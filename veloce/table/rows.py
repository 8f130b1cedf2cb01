"""The row store: the calls through which the layers above read and update a table's
rows and optimizer state, by slot.

Slots are what :meth:`~veloce.table.HashTable.find` and
:meth:`~veloce.table.HashTable.find_or_insert` return, with the codes of
:mod:`veloce.ops.embedding` (-1 padding, -2 a row of zeros, ``slot >= C`` a row of
``extra_rows``). Every call here reads the rows after the sparse update in flight (on
the device: no host sync) and hands the table's own tensors to the ops, never a copy.

:class:`RowStore` is :class:`~veloce.table.HashTable`'s part of it; :func:`pooled_many`
pools the lookups of several tables in one op call. A store that keeps its rows elsewhere
(a host-memory cache, an SSD tier behind it) implements the same calls over the rows it
has brought to the device for the step's slots.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Sequence

import torch

from veloce.ops.embedding import max_pool, pooled_lookup, pooled_lookup_kernels, psw_gradient

if TYPE_CHECKING:
    from veloce.runtime.update_stream import UpdateFence
    from veloce.table.hash_table import HashTable

__all__ = ["RowStore", "UpdateTarget", "pooled_many"]


class UpdateTarget(NamedTuple):
    """The rows a fused sparse update writes, as the step engine passes them through to the
    op without reading them: the handle a store gives for the rows of one step's update
    (this table's own tensors, no copy).

    ``tensors`` are the ``weights`` and ``opt_state`` arguments of
    :func:`veloce.ops.optimizer.accumulate_and_update` (``op(*target.tensors, grad, ...)``)
    and one table's entries of its ``_many`` form. ``layout`` and ``key`` are read when the
    target is made, so that grouping the updates of a step costs no Python call per table."""

    tensors: tuple[torch.Tensor, torch.Tensor]  # (weights, opt_state)
    layout: tuple[torch.device, torch.dtype, int]  # (device, dtype, dim): updates in one op call share it
    key: int  # equal for the targets of one table's rows (modules sharing a table), distinct across tables


class RowStore:
    """:class:`~veloce.table.HashTable`'s row-store calls (see the module docstring)."""

    _buffers: dict[str, torch.Tensor]
    _update_fence: Optional["UpdateFence"]
    _changed: Any

    def _row_tensor(self) -> torch.Tensor:
        """The rows, after the update in flight (read straight from the buffer dict: a read
        through nn.Module's attribute lookup costs a Python call more, for every table in
        every step)."""
        if self._update_fence is not None:
            self._join_update()  # type: ignore[attr-defined]
        return self._buffers["weights"]

    def rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The rows at ``slots`` (N,), each ``0 <= slot < capacity``: a gather, (N, D)."""
        return self._row_tensor()[slots]

    def ids_at(self, slots: torch.Tensor) -> torch.Tensor:
        """The ids held at ``slots`` (N,), each ``0 <= slot < capacity`` and occupied."""
        return self._buffers["keys"][slots]

    def pooled(
        self,
        slots: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: Optional[torch.Tensor],
        mode: int,
        include_last_offset: bool = False,
        extra_rows: Optional[torch.Tensor] = None,
        check_inputs: bool = True,
    ) -> torch.Tensor:
        """The sum or mean pooled rows of the bags ``slots`` / ``offsets``: the table's
        :func:`veloce.ops.embedding.pooled_lookup` (its arguments and autograd)."""
        if self._update_fence is not None:  # (the read of _row_tensor, inline: once per lookup)
            self._join_update()  # type: ignore[attr-defined]
        return pooled_lookup(self._buffers["weights"], slots, offsets, per_sample_weights, mode,
                             include_last_offset, extra_rows, check_inputs=check_inputs)  # fmt: skip

    def max_pooled(
        self,
        slots: torch.Tensor,
        offsets: torch.Tensor,
        include_last_offset: bool = False,
        extra_rows: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The max pooled rows of the bags and their argmax positions:
        :func:`veloce.ops.embedding.max_pool` over the table's rows."""
        if self._update_fence is not None:
            self._join_update()  # type: ignore[attr-defined]
        return max_pool(self._buffers["weights"], slots, offsets, include_last_offset, extra_rows)

    def psw_grad(
        self,
        slots: torch.Tensor,
        offsets: torch.Tensor,
        grad_output: torch.Tensor,
        include_last_offset: bool = False,
        extra_rows: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """The gradient of a lookup's per-sample weights over the table's rows:
        :func:`veloce.ops.embedding.psw_gradient`."""
        return psw_gradient(self._row_tensor(), slots, offsets, grad_output, include_last_offset, extra_rows)

    def update_target(self) -> UpdateTarget:
        """The rows and optimizer state a fused update of this step writes (after the update
        in flight). The caller queues the op, then hands its fence to :meth:`track_update`."""
        if self._update_fence is not None:
            self._join_update()  # type: ignore[attr-defined]
        b = self._buffers
        w = b["weights"]
        return UpdateTarget((w, b["opt_state"]), (w.device, w.dtype, w.shape[1]), w.data_ptr())

    def track_update(self, fence: "UpdateFence") -> None:
        """Books an update of the rows queued on the update stream
        (:func:`veloce.runtime.update_stream.run_update`): every later use of the rows or
        of the slots waits for it on the device."""
        self._update_fence = fence

    def join_update(self) -> None:
        """Makes the current stream wait (on the device, no host sync) for the update of the
        rows in flight, if any: what a use of the rows outside these calls does first (a
        CUDA graph's replay)."""
        if self._update_fence is not None:
            self._join_update()  # type: ignore[attr-defined]

    def hand_over_update(self, stream: Any, origin: Any) -> None:
        """The update in flight that was queued behind ``stream`` counts as queued behind
        ``origin`` from now on (which waited for ``stream``): ``origin``'s next join drops it."""
        fence = self._update_fence
        if fence is not None and fence.origin == stream:
            fence.origin = origin

    def forget_in_flight(self) -> None:
        """Drops what the table keeps of work queued on other streams (the update in flight,
        the last change of the state). Only once the device has run all of it
        (``torch.cuda.synchronize()``): nothing is left to wait for."""
        self._update_fence = None
        self._changed = None

    def state_addresses(self) -> tuple[int, ...]:
        """The device addresses of the tensors the ops read and write (after the last change
        of the state, which the current stream waits for). They stay while the table
        neither grows, loads nor moves: what a captured CUDA graph baked in."""
        return tuple(x.data_ptr() for x in self._state(join=False))  # type: ignore[attr-defined]


def pooled_many(
    tables: Sequence["HashTable"],
    slots: Sequence[torch.Tensor],
    offsets: Sequence[torch.Tensor],
    per_sample_weights: Sequence[Optional[torch.Tensor]],
    modes: Sequence[int],
    include_last_offset: Sequence[bool],
    extra_rows: Sequence[Optional[torch.Tensor]],
) -> list[Any]:
    """The sum or mean pooled lookups of several tables (one per entry; a table may repeat),
    unchecked and below autograd: :func:`veloce.ops.embedding.pooled_lookup_kernels` over
    their rows, one op call per group of alike tables. For callers that are the lookups'
    autograd themselves; the results do not require grad."""
    return pooled_lookup_kernels([t._row_tensor() for t in tables], slots, offsets, per_sample_weights, modes,
                                 include_last_offset, extra_rows)  # fmt: skip
