"""The owner's side of a sharded lookup: the received ids inserted (training) or found,
each part pooled from the owner's rows, the owners' agreement on whether any failed, and
the part gradients kept as the tables' pending gradients until the owner's step().
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from veloce.distributed._comm import DeferredFailure, ExchangeError, Group, agree_sum
from veloce.distributed.layout import SUM
from veloce.sparse import Pending, eval_slots, keep_gradient, reresolve
from veloce.table import find_or_insert_many, pooled_many

__all__ = [
    "Served", "insert_tables", "serve_tables", "serve_inserted", "serve_all", "current_slots", "record",
]  # fmt: skip


@dataclass
class Served:
    """What an owner served one table in a forward: the received parts and their slots.
    (None in its place: the owner failed, and the parts' gradients are dropped.)"""

    ids: torch.Tensor  # (R,) received ids
    slots: torch.Tensor  # (R,) their slots at forward time
    offsets: torch.Tensor  # (Q,) start of each received part
    psw: Optional[torch.Tensor]  # (R,) received per-sample weights
    version: int  # the table version of slots
    # (R,) bool: the positions the table's default row served (admission; -2 in ``slots``), or None
    refused: Optional[torch.Tensor] = None


def insert_tables(modules: list, ids: Sequence[torch.Tensor], training: tuple[bool, ...],
                   sightings: Optional[Sequence[Optional[torch.Tensor]]] = None,
                   ) -> tuple[list, Optional[Exception]]:  # fmt: skip
    """The owner inserts the received ids of the tables whose lookup is a training lookup
    (``training[k]``): one op for all of them. ``sightings``: per table, the occurrences
    each received id stands for (deduplicated ids: the owner's admission counts every
    occurrence); None: one each.
    Returns per table the slots (None for evaluation tables, and for a table listed twice,
    or shared by two modules, after its first: it inserts on its own when served, after
    its first part is, since an insert may move its rows), and the error that stopped the
    inserts, if one did (every rank must learn of it before any raises)."""
    slots: list = [None] * len(modules)
    try:
        first: dict[int, int] = {}
        train = [k for k, m in enumerate(modules) if training[k] and first.setdefault(id(m.table), k) == k]
        # Never deferred (DynamicEmbedding(defer_inserts=)): a full owner must fail this step on every rank.
        tables = [modules[k].table for k in train]
        counts = None if sightings is None else [sightings[k] for k in train]
        for k, s in zip(train, find_or_insert_many(tables, [ids[k] for k in train], allow_defer=False,
                                                   sightings=counts)):  # fmt: skip
            slots[k] = s
    except Exception as e:  # e.g. TableFullError on this owner: every rank must stop, not wait
        return slots, e
    return slots, None


def serve_tables(modules: list, ids: Sequence[torch.Tensor], starts: Sequence[torch.Tensor],
                  psw: Sequence[Optional[torch.Tensor]], training: tuple[bool, ...],
                  sightings: Optional[Sequence[Optional[torch.Tensor]]] = None) -> tuple[list, list]:  # fmt: skip
    """The owner's half of a grouped lookup: each table serves its block (parts starting
    at ``starts[k]`` in ``ids[k]``). Returns per table its :class:`Served` and its pooled
    parts (:func:`insert_tables`, then :func:`serve_inserted`; ``sightings`` as there)."""
    slots, error = insert_tables(modules, ids, training, sightings)
    return serve_inserted(modules, ids, starts, psw, slots, error, training, sightings)


def serve_inserted(modules: list, ids: Sequence[torch.Tensor], starts: Sequence[torch.Tensor],
                    psw: Sequence[Optional[torch.Tensor]], slots: list, error: Optional[Exception],
                    training: tuple[bool, ...],
                    sightings: Optional[Sequence[Optional[torch.Tensor]]] = None) -> tuple[list, list]:  # fmt: skip
    """The owner's lookups after :func:`insert_tables` (its ``slots`` and ``error``), and
    the owners' agreement on whether any failed.

    If this owner failed (a full table, a lookup out of memory), every rank must stop, and
    none may be left waiting in a collective. With ``lookup_errors="raise"`` the ranks
    agree on it here (a collective and a host read) and raise. With "raise_next" the
    agreement stays on the device (:class:`DeferredFailure`): a failed owner serves zero
    partial sums (and None for each :class:`Served`: its gradients are dropped), and
    every rank raises at its next step(), lookup or flush()."""
    served: list = []
    pooled: list = []
    if error is None:
        try:
            # insert_tables left None for a training table only where it repeats an earlier one
            repeated = any(t and s is None for t, s in zip(training, slots))
            if not repeated:  # one lookup op
                served, pooled = serve_all(modules, ids, starts, psw, slots)
            else:
                slots = list(slots)
                for k, (m, ids_k, starts_k, psw_k) in enumerate(zip(modules, ids, starts, psw)):
                    if training[k] and slots[k] is None:
                        slots[k] = m.table.find_or_insert(ids_k, allow_defer=False,
                                                          sightings=None if sightings is None else sightings[k])
                    s, p = serve_all([m], [ids_k], [starts_k], [psw_k], [slots[k]])
                    served += s
                    pooled += p
        except Exception as e:  # e.g. out of memory for the lookup's output
            error = e
    # After serving, not right after the inserts: a lookup can fail too (out of memory for
    # its output), and a rank raising past the agreement would leave the others waiting.
    shard = modules[0].backend
    if shard.lookup_errors == "raise":
        _agree_no_failure(shard.group, error)
        return served, pooled
    what = f"DynamicEmbedding tables {[m.backend.tag for m in modules]}"
    shard.group.unread.append(DeferredFailure(shard.group, error, what))
    if error is None:
        return served, pooled
    dtype, dim, dev = modules[0].table.dtype, modules[0].embedding_dim, ids[0].device
    return [None] * len(modules), [torch.zeros((s.numel(), dim), dtype=dtype, device=dev) for s in starts]


def _agree_no_failure(group: Group, error: Optional[Exception]) -> None:
    """Every rank learns whether any failed: this rank raises its own ``error``, or
    :class:`ExchangeError` when only others failed (a collective: every rank calls it)."""
    failed = agree_sum(group, int(error is not None))
    if error is not None or failed:
        group.prefetched.clear()  # every rank stops: what was prefetched is not taken
    if error is not None:
        raise error
    if failed:  # only other ranks failed
        raise ExchangeError(f"a sharded lookup failed on {failed} other rank(s) (their errors say why, e.g. a full "
                            f"table); every rank stops here")  # fmt: skip


def serve_all(modules: list, ids: Sequence[torch.Tensor], offsets: Sequence[torch.Tensor],
               psw: Sequence[torch.Tensor | None], slots: list) -> tuple[list, list]:
    """The owner's half of a lookup for tables ``modules``: per table its :class:`Served`
    and the sum of each received part (parts start at ``offsets[k]``), from the received
    ids' ``slots[k]`` (training: inserted already) or, for None, the slots of an evaluation
    lookup. One lookup op for all tables (:func:`veloce.table.pooled_many`). With admission,
    a training lookup's refused ids (slot ``C``) read the table's default row, and their
    :class:`Served` slots are -2, marked ``refused`` (their gradient trains that row)."""
    extra: list = [None] * len(modules)
    refused: list = [None] * len(modules)
    slots = list(slots)
    for k, m in enumerate(modules):
        if slots[k] is None:
            slots[k], extra[k] = eval_slots(m, ids[k])
        elif m.table.admits:
            extra[k] = m.table.default_rows()
            refused[k] = slots[k] == m.table.capacity
    tables = [m.table for m in modules]
    partial = pooled_many(tables, slots, offsets, psw, [SUM] * len(modules), [False] * len(modules), extra)
    served = [Served(i, s if r is None else s.masked_fill(r, -2), o, p, t.version, r)
              for t, i, s, o, p, r in zip(tables, ids, slots, offsets, psw, refused)]  # fmt: skip
    return served, partial


def current_slots(module, served: Served) -> torch.Tensor:
    """The served slots under the table's current mapping (re-resolved by id if it changed;
    the positions the default row served stay -2)."""
    if served.version == module.table.version:
        return served.slots

    return reresolve(module.table, served.ids, served.slots, served.refused)


def record(modules: Sequence, served: Sequence[Optional[Served]], grads: Sequence[torch.Tensor],
            noted: bool = False) -> None:  # fmt: skip
    """The owner keeps each table's received part gradients until its step(), like a local
    backward (none where it failed to serve them: that step raises). ``noted``: async
    gradients, counted as waiting when they were sent
    (:func:`veloce.distributed.backward.deliver`)."""

    for module, s, grad in zip(modules, served, grads):
        if s is not None:
            keep_gradient(module, Pending(s.ids, s.slots, s.offsets, s.psw, grad, SUM, False, s.version, s.refused),
                          noted)  # fmt: skip
