"""The Trainer's prefetch of the next batch's rows into tiered tables' caches.

A model with a tiered table (a ``DynamicEmbedding`` whose ``storage`` is not
``Device()``) that says its lookups (``sparse_lookups(*inputs)``, as ``veloce.models``
do) gets the next batch's ids prefetched after each batch's backward and optimizer step:
the rows come up from the table's lower tier before that batch's forward, which then finds
them in the cache (``docs/storage.md``). In one process each tiered table's
``prefetch(ids)`` does it; over several ranks ``HybridParallel.prefetch(*inputs)`` (its
owners insert the ids they will serve, which brings the rows of each rank's tiered shard
up), except with ``dedup=True``, which cannot prefetch.

The next batch is drawn from the loader before the current step runs (a loader that
draws from torch's global RNG per batch does not resume exactly), and an interrupt
(Ctrl-C) is seen one step later. Models without tiered tables draw no batch ahead.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Optional

import torch
from torch import nn

from veloce.embedding import DynamicEmbedding
from veloce.sparse.inputs import padded_args
from veloce.storage import Device
from veloce.train.lockstep import Step, call_model, move_to

__all__ = ["NextBatchPrefetch", "tiered_tables"]


def tiered_tables(model: nn.Module) -> list[DynamicEmbedding]:
    """The model's tables whose rows live in tiers (``storage`` other than ``Device()``)."""
    return [m for m in model.modules()
            if isinstance(m, DynamicEmbedding) and not isinstance(m.storage, Device)]  # fmt: skip


class NextBatchPrefetch:
    """Prefetches a coming batch's rows into ``module``'s tiered tables (see the module docstring).

    Args:
        model: what the Trainer calls (``module``, or the ``HybridParallel`` around it).
        module: the user's model.
        device: where the model lives (the ids go there in one process).
        world_size: the ranks training together.
    """

    def __init__(self, model: nn.Module, module: nn.Module, device: torch.device, world_size: int) -> None:
        self.model, self.module, self.device, self.world_size = model, module, device, world_size
        self.tiered = {id(m) for m in tiered_tables(module)}
        says_lookups = callable(getattr(module, "sparse_lookups", None))
        sharded_prefetch = world_size == 1 or (callable(getattr(model, "prefetch", None)) and
                                               not getattr(model, "dedup", False))  # fmt: skip
        self.enabled = bool(self.tiered) and says_lookups and sharded_prefetch

    def ahead(self, steps: Iterable[Step]) -> Iterator[tuple[Step, Optional[Step]]]:
        """Each step with the next one (None for the last); when prefetching is off, with
        None, drawing nothing ahead."""
        if not self.enabled:
            for step in steps:
                yield step, None
            return
        it = iter(steps)
        step = next(it, None)
        while step is not None:
            coming = next(it, None)
            yield step, coming
            step = coming

    def __call__(self, inputs: Any) -> None:
        """Prefetches the rows of a coming batch's ``inputs`` (the loader's, not yet moved)."""
        if self.world_size > 1:
            call_model(self.model.prefetch, inputs)  # type: ignore[arg-type]  # collective: every rank calls it
            return
        lookups = self.module.sparse_lookups  # type: ignore[attr-defined]
        for tables, table_inputs in call_model(lookups, move_to(inputs, self.device)):
            for table, x in zip(tables, table_inputs):
                if id(table) in self.tiered:
                    table.prefetch(padded_args(x)[0].reshape(-1))
