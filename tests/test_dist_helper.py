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


def _lockstep_kinds(rank, world):
    """Each rank's batches of kinds 2 (a replay) or 1 (eager), rank 0 with a short loader:
    the agreed kinds are each batch's lowest over the ranks, on a gloo group of its own, and
    every rank stops at the shortest loader (the longer one warns)."""
    import warnings

    from veloce._training import lockstep

    kinds = {0: [2, 1, 2, 2], 1: [2, 2, 1, 2, 2]}
    group = torch.distributed.new_group(backend="gloo")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = list(lockstep(iter(kinds[rank]), torch.device("cpu"), "test", kind=lambda k: k, group=group))
    return got, [str(w.message) for w in caught]


def test_lockstep_agrees_on_each_batch_kind():
    (got0, warn0), (got1, warn1) = run_ranks(_lockstep_kinds, 2, timeout=60)
    assert got0 == [(2, 2), (1, 1), (2, 1), (2, 2)]
    assert got1 == [(2, 2), (2, 1), (1, 1), (2, 2)]
    assert not warn0 and any("more batches than another rank" in w for w in warn1)
