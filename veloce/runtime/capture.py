"""What the sparse path does differently while :class:`veloce.graphs.CUDAGraphStep` captures a
training step into a CUDA graph (the hooks of ``veloce.table`` and ``veloce.embedding``).

A graph replays the captured kernels with the arguments they had; the Python around them
runs once, at capture. So while capturing:

- every training insert defers (no read-back) and stamps its tables' LRU clocks from
  device tensors that the graph advances itself (``find_or_insert(..., clock=)``); its
  counts are not read by the host then, but logged, so that the step wrapper can read the
  counts of each replay (the same static tensor, rewritten by every replay);
- every fused update reads its learning rate and step count from a device tensor that the
  graph advances (``accumulate_and_update``'s ``hparams``), and runs on the current stream
  (the update stream's fences would tie the graph to work outside it);
- the NaN/Inf check is read by the host later, as with ``nonfinite_grad="raise_next"``:
  each update skips itself on the device when its check fails, and the wrapper reads the
  flags of each replay before the next one.

``ACTIVE`` is the capture in progress (one at a time, on the thread that captures), or None.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

ACTIVE: Optional["Capture"] = None


class NeedsRoom(Exception):
    """Raised inside a capture when a table lacks room for the ids of a captured insert
    (a graph cannot grow a table): the wrapper grows it and captures again."""

    def __init__(self, table: Any, n: int) -> None:
        super().__init__(f"table of capacity {table.capacity} has no room for {n} more ids")
        self.table, self.n = table, n


@dataclass
class InsertLog:
    """One captured insert: its tables, ids per table, static counts and refusal callback."""

    tables: list
    num_ids: list[int]
    counts: torch.Tensor  # (2,) or (K, 3) on the device, rewritten by every replay
    on_refused: Any  # raises the error of a refused call (bad bag layouts), or None


@dataclass
class UpdateLog:
    """One captured update call: its tables (they share learning rate and step count)."""

    tables: list


@dataclass
class CheckLog:
    """One captured NaN/Inf check (a step_tables call's _FiniteCheck) and its tables."""

    check: Any
    tables: list


@dataclass
class Capture:
    """The device scalars of the tables (created on first use) and what the capture logged."""

    clocks: dict[int, torch.Tensor] = field(default_factory=dict)  # id(HashTable) -> (1,) int64
    # id(DynamicEmbedding) -> its float64 hparams [lr, step, weight_decay, *own] (veloce.ops.optimizer)
    hparams: dict[int, torch.Tensor] = field(default_factory=dict)
    inserts: list[InsertLog] = field(default_factory=list)
    updates: list[UpdateLog] = field(default_factory=list)
    checks: list[CheckLog] = field(default_factory=list)
    requested_lr: dict[int, Optional[float]] = field(default_factory=dict)  # id(module) -> step()'s lr argument
    ticks: dict[int, int] = field(default_factory=dict)  # id(HashTable) -> device clock ticks per replay
    steps: dict[int, int] = field(default_factory=dict)  # id(DynamicEmbedding) -> device steps per replay
    anchor: Optional[torch.Tensor] = None  # the lookups' autograd anchor inside the capture (embedding.py)
    averaging: Any = None  # the HybridParallel whose dense gradients the captured step averages (its DDP bypassed)

    def clock_of(self, table: Any) -> torch.Tensor:
        """The table's device clock, ticked inside the graph (the host ticks its own)."""
        clk = self.clocks.get(id(table))
        if clk is None:
            raise ValueError(_OUTSIDE)
        clk.add_(1)
        self.ticks[id(table)] = self.ticks.get(id(table), 0) + 1
        return clk

    def hparams_of(self, modules: list) -> torch.Tensor:
        """The device hyperparameters of an update call over ``modules`` (they share them):
        the first one's, after every module's step (``hparams[1]``) advanced inside the graph."""
        if any(id(m) not in self.hparams for m in modules):
            raise ValueError(_OUTSIDE)
        for m in modules:
            self.hparams[id(m)][1:2].add_(1.0)
            self.steps[id(m)] = self.steps.get(id(m), 0) + 1
        self.updates.append(UpdateLog(list(modules)))
        return self.hparams[id(modules[0])]


_OUTSIDE = ("CUDAGraphStep: the step trains a DynamicEmbedding that is not in the model it was given; pass the "
            "module that holds every table the step looks up and steps")
