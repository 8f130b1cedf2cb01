"""Typed wrappers and fake kernels for feature admission's ops (``csrc/cpu/sketch.cpp``):
the count-min sketch and the admission telemetry (:mod:`veloce.admission`)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from veloce.ops import extension as _ext

__all__ = ["admission_tally", "sketch_admit", "sketch_count"]


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


def sketch_admit(counters: Tensor, ids: Tensor, seed: int, min_count: int, p: float, draw_seed: int,
                 counted: Optional[Tensor] = None, sightings: Optional[Tensor] = None,
                 skip: Optional[Tensor] = None) -> Tensor:  # fmt: skip
    """:func:`sketch_count`'s adds (none when ``skip``, a one-element bool tensor on the
    device, holds True: read on the device), then whether each position's absent id gets a
    row, from its estimate ``e`` after every add of the call: ``e >= min_count`` and, for
    ``p < 1``, a draw below ``p`` that depends on ``(draw_seed, id, e)`` alone. The same
    decisions as :meth:`veloce.admission.Frequency.admit` (``min_count = k, p = 1``) and
    :meth:`veloce.admission.Probability.admit` (``min_count = 0``) on
    :func:`sketch_count`'s estimates, in one pass less and with no estimate written. No
    host sync.

    Args:
        counters, ids, seed, counted, sightings: as :func:`sketch_count`; sightings are
            clamped to ``[0, 2^30 - 1]`` in the kernel.
        min_count: the least estimate admitted, >= 0.
        p: the chance of admission per draw, in (0, 1].
        draw_seed: the draws' seed (the policy's).
        skip: optional (1,) bool on counters' device.

    Returns:
        (N,) bool on ids' device.
    """
    _ext.require()
    if sightings is not None and sightings.dtype != torch.int64:
        sightings = sightings.long()
    return torch.ops.veloce.sketch_admit(counters, ids, seed, int(min_count), float(p), int(draw_seed), counted,
                                         sightings, skip)  # fmt: skip


def admission_tally(stats: Tensor, slots: Tensor, capacity: int, sightings: Optional[Tensor] = None) -> None:
    """Books one training insert's ``slots`` in the admission telemetry ``stats``, in place:
    a ``(4,)`` int64 tensor ``[admitted, refused, admitted_last, refused_last]``. Positions
    with a row of their own (``0 <= slot < capacity``) add to ``admitted``, those the
    table's default row serves (``slot == capacity``) to ``refused``, each counted
    ``sightings[i]`` times when given; the ``_last`` entries become this call's counts.
    One pass on the device, no host sync."""
    _ext.require()
    if sightings is not None and sightings.dtype != torch.int64:
        sightings = sightings.long()
    torch.ops.veloce.admission_tally(stats, slots, int(capacity), sightings)


def _fake_sketch_count(counters, ids, seed, counted=None, sightings=None):
    return ids.new_empty(ids.shape)


def _fake_sketch_admit(counters, ids, seed, min_count, p, draw_seed, counted=None, sightings=None, skip=None):
    return ids.new_empty(ids.shape, dtype=torch.bool)


def _fake_admission_tally(stats, slots, capacity, sightings=None):
    return None


if _ext.loaded:  # without the extension the op does not exist; require() explains on first use
    torch.library.register_fake("veloce::sketch_count")(_fake_sketch_count)
    torch.library.register_fake("veloce::sketch_admit")(_fake_sketch_admit)
    torch.library.register_fake("veloce::admission_tally")(_fake_admission_tally)
