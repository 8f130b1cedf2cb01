"""Typed wrapper and fake kernel for the sketch op (``csrc/cpu/sketch.cpp``): feature
admission's count-min sketch (:mod:`veloce.admission`)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from veloce.ops import extension as _ext

__all__ = ["sketch_count"]


def sketch_count(counters: Tensor, ids: Tensor, seed: int, counted: Optional[Tensor] = None,
                 sightings: Optional[Tensor] = None) -> Tensor:
    """Adds each position's sightings of ``ids`` (one, or ``sightings``) to the count-min
    sketch ``counters`` (in place; none where ``counted`` is false) and returns each position's estimate after every
    add of the call: the minimum of its id's counters, saturated at 2^30 - 1. Row ``d``'s
    counter of an id is :func:`veloce.admission.sketch_slots`'s. One fused pass on the
    device (two launches on CUDA); no host sync.

    Args:
        counters: (depth, width) int32, contiguous (changed in place).
        ids: (N,) int64 on counters' device, N < 2^30.
        seed: the sketch's seed.
        counted: optional (N,) bool on counters' device.
        sightings: optional (N,) int64 >= 0 on counters' device, the occurrences each
            position stands for (together fewer than 2^30); None: one each.

    Returns:
        (N,) int64 estimates.
    """
    _ext.require()
    if sightings is not None and sightings.dtype != torch.int64:
        sightings = sightings.long()
    return torch.ops.veloce.sketch_count(counters, ids, seed, counted, sightings)


def _fake_sketch_count(counters, ids, seed, counted=None, sightings=None):
    return ids.new_empty(ids.shape)


if _ext.loaded:  # without the extension the op does not exist; require() explains on first use
    torch.library.register_fake("veloce::sketch_count")(_fake_sketch_count)
