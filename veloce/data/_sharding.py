"""Which rows a DataLoader worker on a given rank produces.

Both data sets cut their rows into global batches of ``batch_size`` consecutive rows
(batch ``b`` is rows ``[b * batch_size, (b + 1) * batch_size)``, the last one possibly
shorter) and split every global batch over the ranks: rank ``r`` gets the ``r``-th of
``world_size`` contiguous, nearly equal parts (sizes differ by at most one row; a batch of
fewer rows than ranks leaves the last ranks an empty part). So every rank yields the same
number of batches, and the concatenation in rank order of step ``k``'s batches is exactly
batch ``k`` of one process: training and metrics do not depend on the world size.

On a rank, global batch ``b`` goes to DataLoader worker ``b % num_workers``. A
``DataLoader`` reads its workers round-robin, so a rank sees its batches in increasing
order whatever ``num_workers`` is, and every row is produced exactly once over all ranks
and workers.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.utils.data import get_worker_info


@dataclass(frozen=True)
class Shard:
    """The batches one worker of one rank produces, and the rows of each that are its rank's."""

    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1

    def owns(self, batch: int) -> bool:
        """Whether global batch ``batch`` (0-based, counted from the first row read) is this worker's."""
        return batch % self.num_workers == self.worker

    def part(self, rows: int) -> tuple[int, int]:
        """``(lo, hi)``: this rank's rows ``[lo, hi)`` of a global batch of ``rows`` rows."""
        return rank_part(rows, self.rank, self.world_size)


def rank_part(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(lo, hi)``: rank ``rank``'s contiguous part of ``rows`` rows split over ``world_size``
    ranks; the first ``rows % world_size`` ranks get one row more than the others."""
    base, extra = divmod(rows, world_size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


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
