"""Which batches a DataLoader worker on a given rank produces.

Both data sets cut their rows into consecutive blocks of ``batch_size`` rows (block
``b`` is rows ``[b * batch_size, (b + 1) * batch_size)``) and deal the blocks out:
block ``b`` goes to rank ``b % world_size``; on that rank its ``j``-th block
(``j = b // world_size``) goes to worker ``j % num_workers``. A ``DataLoader`` reads
its workers round-robin, so a rank sees its blocks in increasing order whatever
``num_workers`` is, and every block is produced exactly once over all ranks and workers.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.utils.data import get_worker_info


@dataclass(frozen=True)
class Shard:
    """The blocks one worker of one rank produces."""

    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1

    def owns(self, block: int) -> bool:
        """Whether block ``block`` (0-based, counted from the first row read) is this shard's."""
        if block % self.world_size != self.rank:
            return False
        return (block // self.world_size) % self.num_workers == self.worker


def current_shard(rank: int, world_size: int) -> Shard:
    """The shard of the calling process: the given rank, and its DataLoader worker if any."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    info = get_worker_info()
    if info is None:
        return Shard(rank, world_size, 0, 1)
    return Shard(rank, world_size, info.id, info.num_workers)


def rank_blocks(num_blocks: int, rank: int, world_size: int) -> int:
    """How many of ``num_blocks`` blocks go to ``rank``."""
    return len(range(rank, num_blocks, world_size))
