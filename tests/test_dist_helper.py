"""tests/_dist.run_ranks: results come back in rank order; a failed or hung rank fails the
test, named, with its traceback."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks


def _all_reduce(rank: int, world_size: int, scale: float) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return scale * t.item() + rank


def _rank_one_fails(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank one")
    dist.all_reduce(torch.zeros(1))  # waits for rank 1, which never comes


def _rank_one_hangs(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(3600)


def test_results_come_back_in_rank_order():
    assert run_ranks(_all_reduce, 3, 60, 2.0) == [6.0, 7.0, 8.0]


def test_a_failing_rank_is_named_with_its_traceback():
    with pytest.raises(AssertionError, match=r"(?s)rank 1 failed:.*ValueError: boom on rank one"):
        run_ranks(_rank_one_fails, 2, 60)


def test_a_hung_rank_is_named():
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank 1 did not finish within 8s \(hung; killed\)"):
        run_ranks(_rank_one_hangs, 2, 8)
    assert time.monotonic() - start < 30
