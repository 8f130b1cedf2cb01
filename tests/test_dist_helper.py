"""tests/_dist.run_ranks: results come back in rank order; a failed or hung rank fails the
test, named, with its traceback; a failure does not wait for the timeout."""

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
    time.sleep(3600)  # like a rank blocked in a collective with the failed one


def _rank_one_hangs(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(3600)


def test_results_come_back_in_rank_order():
    assert run_ranks(_all_reduce, 3, 2.0, timeout=60) == [6.0, 7.0, 8.0]


def test_a_failing_rank_is_named_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"(?s)rank 1 raised:.*ValueError: boom on rank one"):
        run_ranks(_rank_one_fails, 2, timeout=60)
    assert time.monotonic() - start < 30  # rank 0 is killed GRACE_S after, not at the timeout


def test_a_hung_rank_is_named():
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank 1 hung \(no result after 8 s; killed\)"):
        run_ranks(_rank_one_hangs, 2, timeout=8)
    assert time.monotonic() - start < 30
