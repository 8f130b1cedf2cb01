"""Multi-process training: sparse tables sharded row-wise across ranks, dense data-parallel.

- :class:`HybridParallel` wraps an unchanged model (launch with ``torchrun``; NCCL on
  GPU, gloo on CPU).
- :func:`owner_of` is the sharding: the rank that owns each id for a world size.
- :func:`table_shard` tells a table's ``(rank, world_size)``; checkpoints use it to
  re-route keys when the world size changes.
- :class:`Shard` is the sharded lookup backend that ``HybridParallel`` installs on each
  table (``table.backend``); :mod:`~veloce.distributed.sharded` describes the exchange.
- :func:`all_to_all` is the exchange primitive (split sizes checked before sending);
  :func:`bucketize_bags`, :func:`combine_parts` and :func:`regroup_blocks` are the ops
  around it.
- :func:`agree_sum` and :func:`raise_deferred_failures` are the ranks' agreements that a
  captured step (:mod:`veloce.graphs`) makes between replays.
"""

from veloce.distributed._comm import (
    ExchangeError, Group, agree_sum, all_to_all, exchange_headers, raise_deferred_failures,
)  # fmt: skip
from veloce.distributed.hybrid import HybridParallel
from veloce.distributed.sharded import Shard, table_shard
from veloce.ops.exchange import bucketize_bags, combine_parts, owner_of, regroup_blocks

__all__ = [
    "HybridParallel", "owner_of", "table_shard", "all_to_all", "exchange_headers", "ExchangeError", "Group",
    "Shard", "agree_sum", "bucketize_bags", "combine_parts", "raise_deferred_failures", "regroup_blocks",
]
