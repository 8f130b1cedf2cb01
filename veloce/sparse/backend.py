"""The lookup backend of a table module: where its lookups go and which ranks its counts
agree over.

Every table module holds one (``module.backend``). :class:`LocalBackend`, the default,
serves lookups from the module's own rows in this process.
:class:`veloce.distributed.HybridParallel` installs a sharded backend
(:class:`veloce.distributed.Shard`) on the tables it shards, which sends each id to the
rank that owns it; the engine (lookups, the step, the NaN/Inf policy, clipping,
checkpoints) asks the backend and never needs to know which one it holds. A backend
drives its tables' engine through this module's functions (:func:`validated_bags`,
:func:`keep_gradient`, ...).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence

import torch

from veloce.sparse.default_row import default_entry
from veloce.sparse.pending import Pending

__all__ = [
    "LookupBackend", "LocalBackend", "apply_pending", "check_unapplied", "eval_slots", "forget_gradient",
    "keep_gradient", "note_backward", "validated_bags",
]  # fmt: skip


class LookupBackend:
    """What the engine asks of a table module's backend. The defaults are those of a
    table held whole by this process (:class:`LocalBackend`); a sharded backend
    overrides them.

    Attributes:
        sharded: whether the table's rows are spread over several ranks (each rank holds
            those it owns; lookups and counts are collectives over them).
        rank: this process's rank among the table's shards (0 when not sharded).
        world_size: the number of shards (1 when not sharded).
        staleness: steps between a backward pass and the update of its gradient (async
            sharding; 0 otherwise).
        exchange_dtype: the dtype rows and gradients travel in between ranks (None: the
            table's own, or no travel at all).
    """

    sharded: bool = False
    rank: int = 0
    world_size: int = 1
    staleness: int = 0
    exchange_dtype: Optional[torch.dtype] = None

    @property
    def group_id(self) -> Optional[int]:
        """Identifies the ranks this backend agrees with: tables whose backends share it
        agree in one collective (None: no other rank to agree with)."""
        return None

    @property
    def in_flight(self) -> int:
        """Gradient exchanges sent by backward passes and not yet joined to the table's
        pending gradient (async sharding); a checkpoint or a clip must wait for them."""
        return 0

    def exchange_key(self) -> Optional[tuple]:
        """What lookups of several tables must share to travel in one exchange
        (:func:`veloce.sparse.lookup_groups` adds the dim, dtype and training mode); None
        for a table looked up in this process."""
        return None

    def forward(self, module: Any, input: torch.Tensor, offsets: Optional[torch.Tensor],
                per_sample_weights: Optional[torch.Tensor], training: bool) -> torch.Tensor:  # fmt: skip
        """``module``'s pooled lookup of ``input`` (its forward; ``training``: a training
        lookup, see :func:`veloce.sparse.training_lookup`)."""
        return module._local_forward(input, offsets, per_sample_weights, training)

    def lookup_many(self, modules: Sequence[Any], bags: Sequence[tuple],
                    layouts: Sequence[tuple] = ()) -> list[torch.Tensor]:  # fmt: skip
        """The pooled lookups of ``modules``, which share this backend's exchange key, from
        their validated ``bags`` (``layouts``: the bag layouts whose offsets' values are
        still to check). Only sharded backends group lookups so."""
        raise NotImplementedError(f"{type(self).__name__} serves lookups one module at a time")

    @contextlib.contextmanager
    def abandon_on_error(self) -> Iterator[None]:
        """Around the input checks of a lookup: if they raise, the other ranks that wait for
        this one in the lookup's exchange raise too. Nothing to do in one process."""
        yield

    def check_owned(self, ids: torch.Tensor) -> None:
        """Raises ``ValueError`` when ``ids`` (for :meth:`DynamicEmbedding.insert`) hold an id
        this process does not own. A local table owns every id."""

    def owned_entries(self, module: Any, entries: dict[str, Any]) -> dict[str, Any]:
        """The entries of a state dict of the whole table (keys (M,) and per-row tensors)
        that this process keeps: all of them for a local table."""
        return entries

    def collect(self, module: Any) -> None:
        """Before ``module``'s step: gradients that other ranks sent and that are due join its
        pending gradient. Nothing to collect in one process."""

    def flush(self, module: Any) -> None:
        """Waits for every gradient in flight to ``module`` and adds it to its pending gradient."""

    def agree(self, count: int) -> int:
        """The sum of ``count`` over the ranks (a collective where sharded)."""
        return count

    def agree_all(self, counts: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """The sums (``op="max"``: the largest) of ``counts`` over the ranks, without reading
        them back (a collective where sharded)."""
        return counts

    def raise_deferred_failures(self) -> None:
        """Raises a failure of an earlier lookup that was deferred (sharded lookups with
        ``lookup_errors="raise_next"``); nothing in one process."""


class LocalBackend(LookupBackend):
    """The backend of a table held whole by this process: lookups read its own rows, and
    every count is this process's own."""

    def __repr__(self) -> str:
        return "LocalBackend()"


# ---- the engine's steps a backend runs on its table modules ---------------------------------
def validated_bags(module: Any, input: torch.Tensor, offsets: Optional[torch.Tensor], psw: Optional[torch.Tensor],
                   deferred: Optional[list] = None,
                   aranges: Optional[dict] = None) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:  # fmt: skip
    """``module``'s forward input checked and normalised, before anything changes:
    ``(ids (N,), offsets, per_sample_weights or None)``. ``deferred``: a list that takes
    the bag layouts whose offsets' values are checked later (on the device); ``aranges``:
    the offsets of 2-D inputs, shared by the tables of one call."""
    return module._bags(input, offsets, psw, deferred=deferred, aranges=aranges)


def check_unapplied(module: Any) -> None:
    """Before a training lookup of ``module``: raises when its waiting gradient shows a loop
    that does not step it (see :class:`veloce.DynamicEmbedding`)."""
    module._check_unapplied()


def eval_slots(module: Any, ids: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The slots an evaluation lookup of ``ids`` reads in ``module``'s table, and the rows of
    the ids it does not hold (``unknown="init"``), to read past the table's capacity."""
    return module._eval_slots(ids)


def keep_gradient(module: Any, entry: Pending, noted: bool = False) -> None:
    """Keeps one backward pass's gradient of ``module``'s rows until its step().
    ``noted``: the pass was counted by :func:`note_backward` when its gradient was sent.
    With admission, ``entry.refused`` marks the positions the table's default row served
    (-2 in ``entry.slots``): their gradient is kept for the default row."""
    module._accumulate(entry, noted)
    if entry.refused is not None:
        module._accumulate_default(default_entry(entry))


def note_backward(module: Any) -> None:
    """Counts a backward pass whose gradient is on its way to ``module`` (async sharding)."""
    module._note_backward()


def forget_gradient(module: Any) -> None:
    """Drops ``module``'s pending gradient and its bookkeeping."""
    module._forget_gradient()


def apply_pending(module: Any) -> None:
    """Applies ``module``'s pending gradient now, at the learning rate of its last step()
    (a flush of gradients that arrived after it)."""
    module._apply_pending(module._last_lr)
