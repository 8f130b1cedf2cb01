"""The local lookup: a table's own rows read (and, in training, its new ids inserted) in
this process, one table at a time or several in one insert (:func:`lookup_many`)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, NoReturn, Optional, Sequence

import torch

from veloce.ops import extension as _ext
from veloce.ops.hash_table import initialize
from veloce.sparse.autograd import train_lookups
from veloce.sparse.base import MODES, TableModule, training_lookup
from veloce.sparse.inputs import LayoutCheck, check_offsets_many, insert_checked, padded_args
from veloce.table import find_or_insert_many, insert_beside_updates

__all__ = ["LocalLookup", "install_compiled_path", "lookup_groups", "lookup_many", "world_size"]

_DIST_AVAILABLE = torch.distributed.is_available()
# The lookup under torch.compile (veloce.sparse.compile installs it): one opaque op.
_COMPILED: Optional[Callable[..., list]] = None
_IS_COMPILING: Callable[[], bool] = lambda: False


def install_compiled_path(lookup: Callable[..., list], is_compiling: Callable[[], bool]) -> None:
    """Makes :func:`lookup_many` call ``lookup(tables, inputs, many=True)`` while
    ``is_compiling()`` (:mod:`veloce.sparse.compile` installs its opaque op)."""
    global _COMPILED, _IS_COMPILING
    _COMPILED, _IS_COMPILING = lookup, is_compiling


class LocalLookup:
    """A table module's local lookup (:class:`veloce.DynamicEmbedding`'s)."""

    def _local_forward(self, input: torch.Tensor, offsets: Optional[torch.Tensor], per_sample_weights: Optional[torch.Tensor],
                       training: bool) -> torch.Tensor:  # fmt: skip
        """The module's forward on its own rows: a training lookup (``training``) inserts
        its new ids with the bag layouts' check riding on the insert; an evaluation lookup
        reads the rows."""
        layouts: list = []
        if not training:
            return self._lookup(*self._bags(input, offsets, per_sample_weights, deferred=layouts), unchecked=layouts)
        if not self.per_rank and world_size() > 1:
            refuse_replicated_training(self)
        table = self.table

        def checked_insert():  # on the insert stream while an update is in flight (veloce.runtime.update_stream)
            ids, offs, psw = self._bags(input, offsets, per_sample_weights, deferred=layouts)
            slots, check = insert_checked(
                layouts, [table], lambda bad, refused: table.find_or_insert(ids, self.padding_idx, bad, refused)
            )
            return (ids, check.guard(offs, ids.numel(), self.include_last_offset), psw), slots

        self._check_unapplied()
        bags, slots = insert_beside_updates([table], checked_insert)
        (out,) = train_lookups([self], [bags], [slots])
        return out

    def _lookup(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        psw: torch.Tensor | None,
        unchecked: Sequence[tuple] = (),
        check: Optional["LayoutCheck"] = None,
    ) -> torch.Tensor:
        """The local (unsharded) lookup of bags that passed :meth:`_bags`.

        ``unchecked``: the bag layouts whose offsets' values :meth:`_bags` deferred (empty
        when the caller has checked them). In training their check rides on the insert
        (:func:`insert_checked`: no host sync of its own, and a bad layout raises before
        the table changes); in eval they are read back first. ``check``: in training, the
        check that an earlier insert of the same call carried (lookup_many's table listed
        twice), carried again by this one (its layouts are guarded already)."""
        table = self.table
        if training_lookup(self):
            if check is not None:
                slots = table.find_or_insert(ids, self.padding_idx, check.flag, check.refused)
            else:
                slots, check = insert_checked(
                    unchecked, [table], lambda bad, refused: table.find_or_insert(ids, self.padding_idx, bad, refused)
                )
                offsets = check.guard(offsets, ids.numel(), self.include_last_offset)
            (out,) = train_lookups([self], [(ids, offsets, psw)], [slots])
            return out
        check_offsets_many(unchecked)
        slots, extra = self._eval_slots(ids)
        if self.mode == "max":
            return table.max_pooled(slots, offsets, self.include_last_offset, extra)[0]
        # The offsets passed _bags' checks and the slots come from the table: no re-check.
        return table.pooled(slots, offsets, psw, MODES[self.mode], self.include_last_offset, extra,
                            check_inputs=False)  # fmt: skip

    def _eval_slots(self, ids: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        table = self.table
        slots = table.find(ids)
        missing = slots < 0
        if self.padding_idx is not None:
            pad = ids == self.padding_idx
            missing &= ~pad
            slots = slots.masked_fill(pad, -1)
        if not bool(missing.any()):
            return slots, None
        below = table.rows_below(ids, missing)  # a tiered table's stored rows of the ids its cache lacks
        if self.unknown == "zeros" and below is None:
            return slots.masked_fill(missing, -2), None
        idx = missing.nonzero().squeeze(1)
        init = table.initializer
        if self.unknown == "zeros":
            extra = torch.zeros(idx.numel(), self.embedding_dim, dtype=table.dtype, device=ids.device)
        elif table.admits:  # the row that training gave the ids it did not admit
            extra = table.default_rows().expand(idx.numel(), -1)
        else:
            extra = initialize(ids[idx], self.embedding_dim, table.seed, init.kind, init.a, init.b, table.dtype)
        if below is not None:
            found, rows = below
            extra = torch.where(found.unsqueeze(1), rows.to(extra.dtype), extra)
        slots = slots.index_put((idx,), torch.arange(idx.numel(), device=ids.device) + table.capacity)
        return slots, extra


def lookup_many(tables: Sequence[TableModule], inputs: Sequence[Any]) -> list[torch.Tensor]:
    """Looks up several tables at once: ``[t(*x) for t, x in zip(tables, inputs)]``.

    The result is the same as calling each table (forward hooks of the tables aside:
    they are not run); the difference is speed. In training, the new ids of all tables
    are inserted by one op (:func:`veloce.table.find_or_insert_many`), so on a GPU the
    host waits for the device once or twice per call instead of per table. When the
    tables are sharded by :class:`veloce.distributed.HybridParallel`, the ids of every
    table with the same embedding dim also travel in one all-to-all exchange instead of
    one per table. ``veloce.models`` look their features up this way.

    Args:
        tables: ``DynamicEmbedding`` modules.
        inputs: per table, a 2-D ``(B, L)`` tensor of ids, or a tuple ``(input,
            offsets[, per_sample_weights])`` as the module's forward takes.

    Returns:
        One pooled ``(B, D)`` tensor per table.
    """
    if _COMPILED is not None and _IS_COMPILING():  # one opaque op in the graph (veloce.sparse.compile)
        return _COMPILED(tables, inputs, many=True)
    args, groups, local = lookup_groups(tables, inputs, "lookup_many")
    out: list[Optional[torch.Tensor]] = [None] * len(tables)
    aranges: dict = {}  # the offsets of 2-D inputs, shared by the tables (see _bags)
    # Every sharded table's input is checked before any table changes (else a bad input of a
    # later exchange would arrive after the earlier exchanges inserted): this rank then
    # abandons the first exchange, where every other rank raises too. The offsets' values
    # are checked with each exchange's header.
    sharded: list[tuple[list[int], list, list]] = []
    if groups:
        with tables[next(iter(groups.values()))[0]].backend.abandon_on_error():
            for idx in groups.values():
                for i in idx:
                    if training_lookup(tables[i]):
                        tables[i]._check_unapplied()
                layouts_k: list = []
                sharded.append((idx, [tables[i]._bags(*args[i], deferred=layouts_k, aranges=aranges) for i in idx],
                                layouts_k))  # fmt: skip
    if local:
        # A local table's error (bad input, a full table) must not leave the other ranks
        # waiting in this call's first sharded exchange: this rank abandons it, so they
        # raise too (the exchanges after the first are never reached by any rank).
        first_group = tables[next(iter(groups.values()))[0]].backend if groups else None
        with first_group.abandon_on_error() if first_group is not None else contextlib.nullcontext():
            # Every local input (eval tables' and repeated ones' too) is checked before any
            # table changes; then the training tables insert in one op, so the host waits for
            # the device once, not per table. The bag layouts' check rides on that op's
            # read-back (insert_checked), or, with no training table, is read back alone. A
            # table listed twice (or shared by two modules) inserts on its own the second
            # time, after its first lookup (its layout is already checked).
            layouts: list = []
            first: dict[int, int] = {}
            train = [i for i in local if training_lookup(tables[i]) and first.setdefault(id(tables[i].table), i) == i]
            for i in train:
                tables[i]._check_unapplied()
            train_tables = [tables[i].table for i in train]
            if train and world_size() > 1:
                for i in train:
                    if not tables[i].per_rank:
                        refuse_replicated_training(tables[i])

            def checked_insert():  # on the insert stream while an update is in flight (veloce.runtime.update_stream)
                bags = {i: tables[i]._bags(*args[i], deferred=layouts, aranges=aranges) for i in local}
                if not train:
                    return bags, None, None
                slots, check = insert_checked(
                    layouts, train_tables,
                    lambda bad, refused: find_or_insert_many(train_tables, [bags[i][0] for i in train],
                                                             [tables[i].padding_idx for i in train], bad, refused),
                )  # fmt: skip
                return {i: (ids, check.guard(offs, ids.numel(), tables[i].include_last_offset), psw)
                        for i, (ids, offs, psw) in bags.items()}, slots, check  # fmt: skip

            bags, slots, check = insert_beside_updates(train_tables, checked_insert)
            if train:
                for i, o in zip(train, train_lookups([tables[i] for i in train], [bags[i] for i in train], slots)):
                    out[i] = o
            else:
                check_offsets_many(layouts)
            # A training table listed again inserts again, carrying the same check: when the
            # first insert deferred (its check unread), a refused call then changes no table.
            for i in local:
                if out[i] is None:
                    out[i] = tables[i]._lookup(*bags[i], check=check if training_lookup(tables[i]) else None)
    for idx, bags_k, layouts_k in sharded:
        # The layouts' offsets are checked with the exchange's header (one host sync for both).
        backend = tables[idx[0]].backend
        for i, o in zip(idx, backend.lookup_many([tables[i] for i in idx], bags_k, layouts_k)):
            out[i] = o
    return out  # type: ignore[return-value]


def world_size() -> int:
    """The default process group's size; 1 without torch.distributed (one cheap check on
    the training lookups of tables that are not sharded)."""
    if not _DIST_AVAILABLE or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size()


def refuse_replicated_training(table: TableModule) -> NoReturn:
    """Raises for a training lookup of an unsharded table while several ranks run: each
    rank would train a copy of its own. A gradient all-reduce (DDP's, FSDP's, a user's)
    covers parameters, and a table's rows are not parameters, so nothing else notices."""
    ddp_cls = getattr(getattr(torch.nn, "parallel", None), "DistributedDataParallel", None)
    inside_ddp = getattr(ddp_cls, "_active_ddp_module", None) is not None
    why = (
        "torch.nn.parallel.DistributedDataParallel does not synchronise DynamicEmbedding tables (their rows are "
        "not parameters): every rank would train its own copy and the copies drift apart"
        if inside_ddp else
        "every rank would train its own copy of the table and the copies drift apart (DistributedDataParallel, "
        "FSDP and gradient all-reduces synchronise parameters only; a table's rows are not parameters)"
    )  # fmt: skip
    raise RuntimeError(
        f"DynamicEmbedding: training lookup of a table that is not sharded, while torch.distributed runs "
        f"{world_size()} ranks: {why}. Use veloce.distributed.HybridParallel(model) instead of "
        f"DistributedDataParallel(model): it shards the tables across the ranks and runs DDP over the dense "
        f"parameters. For a table that each rank trains on its own on purpose, pass per_rank=True "
        f"(DynamicEmbedding(..., per_rank=True), or set table.per_rank = True)."
    )


def lookup_groups(tables: Sequence[TableModule], inputs: Sequence[Any], what: str):
    """``lookup_many``'s inputs as ``(input, offsets, per_sample_weights)`` per table (the
    missing ones None), the sharded tables grouped by exchange (same backend exchange key
    (:meth:`LookupBackend.exchange_key`: process group and sparse mode), dim, dtype and
    training lookup or not (:func:`training_lookup`): one exchange each), and the local
    tables."""
    if len(tables) != len(inputs):
        raise ValueError(f"{what}: {len(tables)} tables but {len(inputs)} inputs")
    _ext.require()
    args = [padded_args(x) for x in inputs]
    groups: dict[tuple, list[int]] = {}
    local: list[int] = []
    for i, t in enumerate(tables):
        if not isinstance(t, TableModule):
            raise TypeError(f"{what}: tables[{i}] is a {type(t).__name__}, not a DynamicEmbedding")
        exchange = t.backend.exchange_key()
        if exchange is None:
            local.append(i)
            continue
        groups.setdefault((*exchange, t.embedding_dim, t.table.dtype, training_lookup(t)), []).append(i)
    return args, groups, local
