"""A table's feature admission (:mod:`veloce.admission`): the sketch of its ids' sightings,
its default row and the admission telemetry, kept as buffers on the table's device.

A training insert (:meth:`~veloce.table.HashTable.find_or_insert`,
:func:`~veloce.table.find_or_insert_many`) counts its ids' sightings and hands the policy's
decision to the op as ``admit``: a refused absent id gets the slot ``C`` (the capacity),
which the pooling kernels serve from the lookup's first extra row, the default row
(:meth:`Admitting.default_rows`). Nothing here reads the device back.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from veloce.admission import (
    DEFAULT_ROW_ID,
    DEFAULT_ROW_SEED,
    AdmissionPolicy,
    NoAdmission,
    count_sightings,
    resolve,
)
from veloce.ops.hash_table import initialize
from veloce.ops.sketch import admission_tally, sketch_admit

__all__ = ["ADMISSION_STATE", "Admitting"]

#: The admission state a checkpoint keeps (the names of the buffers and of the state-dict entries).
ADMISSION_STATE = ("admission_counts", "default_weights", "default_state")

#: The estimated false-admission rate (:meth:`AdmissionPolicy.false_admission`) past which
#: reading the telemetry warns that the sketch is too narrow.
SATURATED = 0.1

# Admission telemetry, one int64 each: sightings served by a row of their own and by the
# default row, in all since the last reset and in the last training insert.
_ADMITTED, _REFUSED, _ADMITTED_LAST, _REFUSED_LAST = range(4)


class Admitting:
    """:class:`~veloce.table.HashTable`'s admission (module docstring)."""

    admission: AdmissionPolicy = NoAdmission()
    _buffers: dict[str, torch.Tensor]
    # The counts this shard holds but did not count itself (mark_sketch_shared), or None.
    _sketch_base: Optional[torch.Tensor] = None

    def set_admission(self, admission: Any) -> None:
        """Sets the table's admission policy (:func:`veloce.admission.resolve` of
        ``admission``). A policy that refuses ids gets a zeroed sketch, a default row
        (the table's initializer at id 0 for :data:`~veloce.admission.DEFAULT_ROW_SEED`,
        the optimizer's initial state) and zeroed telemetry; :class:`NoAdmission` drops them.

        Raises:
            ValueError, TypeError: as :func:`veloce.admission.resolve`.
        """
        policy = resolve(admission)
        self.admission = policy
        self._sketch_base = None
        if policy.admits_all:
            for name in (*ADMISSION_STATE, "admission_telemetry"):
                self._buffers.pop(name, None)
            return
        dev, dim = self.device, self.dim  # type: ignore[attr-defined]
        init = self.initializer  # type: ignore[attr-defined]
        row = initialize(torch.tensor([DEFAULT_ROW_ID], device=dev), dim, DEFAULT_ROW_SEED, init.kind, init.a, init.b,
                         self.dtype)  # type: ignore[attr-defined]  # fmt: skip
        state = torch.zeros(1, self.state_dim, dtype=self.state_dtype, device=dev)  # type: ignore[attr-defined]
        if self.init_state is not None:  # type: ignore[attr-defined]
            state[0] = self.init_state.to(dev, state.dtype)  # type: ignore[attr-defined]
        counts = torch.zeros(policy.depth, policy.width, dtype=torch.int32, device=dev)
        stats = torch.zeros(4, dtype=torch.long, device=dev)
        for name, value in zip((*ADMISSION_STATE, "admission_telemetry"), (counts, row, state, stats)):
            self.register_buffer(name, value, persistent=False)  # type: ignore[attr-defined]

    @property
    def admits(self) -> bool:
        """Whether the table refuses some ids (a policy other than :class:`NoAdmission`)."""
        return not self.admission.admits_all

    def default_rows(self) -> Optional[torch.Tensor]:
        """The lookups' extra rows: the ``(1, D)`` default row when the table admits, else
        None (slot ``C`` reads extra row 0). After the update in flight, which trains it."""
        if self.admission.admits_all:
            return None
        if self._update_fence is not None:  # type: ignore[attr-defined]
            self._join_update()  # type: ignore[attr-defined]
        return self._buffers["default_weights"]

    def default_update_target(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The default row and its optimizer state, ``(1, D)`` and ``(1, S)``, as the fused
        update of the table's rows trains them (its extra row, slot ``C``)."""
        return self._buffers["default_weights"], self._buffers["default_state"]

    def _admit_of(self, ids: torch.Tensor, padding_id: Optional[int], bad_input: Optional[torch.Tensor],
                  sightings: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:  # fmt: skip
        """Counts a training insert's sightings and returns the op's ``admit`` (None: the
        table admits every id). Padding positions and a lookup refused for ``bad_input``
        count nothing (the flag is read on the device). ``sightings``: the occurrences each
        position stands for (:func:`~veloce.admission.count_sightings`); None: one each."""
        policy = self.admission
        if policy.admits_all:
            return None
        counted = None if padding_id is None else ids != padding_id
        counters = self._buffers["admission_counts"]
        rule = policy.fused_rule()
        if rule is not None:  # one op counts and decides; a refused lookup's flag is read by it
            skip = None if bad_input is None else bad_input.reshape(1)
            return sketch_admit(counters, ids, policy.seed, rule[0], rule[1], policy.seed, counted, sightings, skip)
        if bad_input is not None:
            ok = ~bad_input.reshape(())
            counted = ok.expand(ids.shape) if counted is None else counted & ok
        estimate = count_sightings(counters, ids, policy.seed, counted, sightings)
        return policy.admit(ids, estimate)

    def _note_admission(self, slots: torch.Tensor, sightings: Optional[torch.Tensor] = None) -> None:
        """Books a training insert's slots in the telemetry: positions with a row of their
        own (``0 <= slot < C``) and those the default row serves (``slot == C``), each
        counted ``sightings`` times when given (once each otherwise)."""
        if self.admission.admits_all:
            return
        admission_tally(self._buffers["admission_telemetry"], slots, self.capacity, sightings)  # type: ignore[attr-defined]

    def admission_stats(self, reset: bool = False) -> dict[str, Any]:
        """The admission telemetry (empty without admission): ``admitted`` and ``refused``
        (training sightings served by a row of their own and by the default row, since the
        last reset), ``admitted_last`` and ``refused_last`` (the last training insert's),
        ``default_row_share`` (refused / (admitted + refused), 0.0 before any lookup),
        ``sketch_bytes`` and, for :class:`~veloce.admission.Frequency`, ``false_admission``:
        the estimated probability that an id is admitted at its first sighting though it
        needs more, because its counters are full of other ids' sightings. Past
        :data:`SATURATED` it warns once per table: the sketch is too narrow for the ids it
        counts. Reading it is a host sync."""
        policy = self.admission
        if policy.admits_all:
            return {}
        stats = self._buffers["admission_telemetry"]
        admitted, refused, admitted_last, refused_last = stats.tolist()
        if reset:
            stats[:2] = 0
        seen = admitted + refused
        out = {"admitted": admitted, "refused": refused, "admitted_last": admitted_last,
               "refused_last": refused_last, "default_row_share": refused / seen if seen else 0.0,
               "sketch_bytes": policy.sketch_bytes}  # fmt: skip
        rate = policy.false_admission(self._buffers["admission_counts"])
        if rate is not None:
            out["false_admission"] = rate
            if rate > SATURATED and not getattr(self, "_warned_saturated", False):
                self.__dict__["_warned_saturated"] = True
                width = policy.width * 4  # type: ignore[attr-defined]
                warnings.warn(
                    f"admission: the sketch of this table ({policy!r}) is saturated: an id is admitted at its first "
                    f"sighting with probability about {rate:.2f}, as its counters already hold other ids' sightings. "
                    f"Pass a wider sketch (e.g. width={width}, {4 * policy.depth * width / 2**20:.3g} MiB a table) or "  # type: ignore[attr-defined]
                    f"a smaller min_count; stats()['false_admission'] follows it", stacklevel=3)  # fmt: skip
        return out

    def admission_state(self) -> dict[str, torch.Tensor]:
        """The sketch and the default row (weights, optimizer state), as a checkpoint keeps
        them (:data:`ADMISSION_STATE`; empty without admission)."""
        if self.admission.admits_all:
            return {}
        self._join_update()  # type: ignore[attr-defined]
        return {name: self._buffers[name] for name in ADMISSION_STATE}

    def mark_sketch_shared(self) -> None:
        """Notes that the sketch's counts so far are held by every shard of a sharded table
        (each rank's copy of a whole table's sketch, at sharding or after a checkpoint
        load): :meth:`own_sketch` then leaves them out, so that a checkpoint, which sums its
        shards' sketches, counts them once (rank 0 keeps them). Nothing to note for an
        empty sketch."""
        if self.admission.admits_all:
            return
        counts = self._buffers["admission_counts"]
        self._sketch_base = counts.clone() if bool(counts.any()) else None

    def own_sketch(self) -> torch.Tensor:
        """The sketch's counts less those :meth:`mark_sketch_shared` noted: the sightings
        this shard counted itself (what a checkpoint of several shards saves)."""
        self._join_update()  # type: ignore[attr-defined]
        counts = self._buffers["admission_counts"]
        base = self._sketch_base
        return counts if base is None else (counts - base).clamp_(min=0)

    def load_admission_state(self, state: dict[str, torch.Tensor]) -> None:
        """Puts back :meth:`admission_state`'s tensors (checked first: nothing changes on an
        error). Sketches of several shards of one table are summed by the caller: counts of
        disjoint id sets add.

        Raises:
            ValueError: a tensor is missing or its shape does not fit this table's policy.
        """
        if self.admission.admits_all:
            return
        for name in ADMISSION_STATE:
            if name not in state:
                raise ValueError(f"admission state: {name} is missing (a table with admission={self.admission!r} "
                                 f"keeps {', '.join(ADMISSION_STATE)})")  # fmt: skip
            want, got = self._buffers[name].shape, tuple(state[name].shape)
            if tuple(want) != got:
                raise ValueError(f"admission state: {name} has shape {got}, this table's is {tuple(want)} "
                                 f"(admission={self.admission!r}, dim {self.dim})")  # type: ignore[attr-defined]
        self._join_update()  # type: ignore[attr-defined]
        for name in ADMISSION_STATE:
            buf = self._buffers[name]
            buf.copy_(state[name].to(buf.device, buf.dtype))
        self._sketch_base = None
