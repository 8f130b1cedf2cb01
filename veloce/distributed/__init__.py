"""Sharding contract of hybrid-parallel training (stand-in until the real module lands on main).

- :func:`owner_of` maps ids to the rank that owns them under a world size.
- :func:`table_shard` says how a ``DynamicEmbedding`` is sharded: ``(rank, world_size)``,
  ``(0, 1)`` when it is not sharded (a replica or a single process).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["owner_of", "table_shard"]

_MIX = -49064778989728563  # 0xFF51AFD7ED558CCD as int64 (fmix64's first constant)


def owner_of(ids: torch.Tensor, world_size: int) -> torch.Tensor:
    """(N,) int64 owner rank of each id in ``ids`` (N,): a hash of the id mod ``world_size``."""
    h = ids ^ (ids >> 33)
    h = h * _MIX
    h = h ^ (h >> 33)
    return torch.remainder(h, world_size)


def table_shard(module: nn.Module) -> tuple[int, int]:
    """``(rank, world_size)`` of a ``DynamicEmbedding``'s sharding; ``(0, 1)`` when unsharded."""
    return getattr(module, "_veloce_shard", (0, 1))
