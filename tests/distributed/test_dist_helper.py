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
    """Each rank's batches (a batch of kind k has k + rank samples), rank 0's loader the
    shorter, rank 2's empty: on a gloo group of their own the ranks agree on each step's
    kind (the lowest; a zero-row batch counts as 1) and samples, and step until the longest
    loader is done; the others run zero-row batches meanwhile (rank 2 has none of its own:
    it takes another rank's batch's form). Nothing is dropped, nothing warns."""
    import warnings

    from veloce.train.lockstep import lockstep

    kinds = {0: [2, 1, 2, 2], 1: [2, 2, 1, 2, 2], 2: []}[rank]
    batches = [((torch.full((k + rank, 3), k),), torch.ones(k + rank)) for k in kinds]
    group = torch.distributed.new_group(backend="gloo")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        steps = list(lockstep(iter(batches), torch.device("cpu"), "test", kind=lambda b: b[1].numel() - rank,
                              group=group))  # fmt: skip
    got = [(s.kind, s.rows, s.total, s.drawn, tuple(s.batch[0][0].shape)) for s in steps]
    return got, [str(w.message) for w in caught]


def test_lockstep_runs_every_rank_batch_and_pads_the_shorter_loaders():
    (got0, warn0), (got1, warn1), (got2, warn2) = run_ranks(_lockstep_kinds, 3, timeout=60)
    assert [g[0] for g in got0] == [g[0] for g in got1] == [g[0] for g in got2] == [1, 1, 1, 1, 1]  # rank 2 is empty
    assert [g[2] for g in got0] == [g[2] for g in got1] == [g[2] for g in got2] == [2 + 3, 1 + 3, 2 + 2, 2 + 3, 3]
    assert [g[1:] for g in got0] == [(2, 5, True, (2, 3)), (1, 4, True, (1, 3)), (2, 4, True, (2, 3)),
                                    (2, 5, True, (2, 3)), (0, 3, False, (0, 3))]  # fmt: skip
    assert [g[3] for g in got1] == [True] * 5
    assert [g[1:] for g in got2] == [(0, 5, False, (0, 3)), (0, 4, False, (0, 3)), (0, 4, False, (0, 3)),
                                    (0, 5, False, (0, 3)), (0, 3, False, (0, 3))]  # fmt: skip
    assert not warn0 and not warn1 and not warn2


def _lockstep_kinds_agreed(rank, world):
    from veloce.train.lockstep import lockstep

    kinds = {0: [2, 1, 2, 2], 1: [2, 2, 1, 2, 2]}[rank]
    steps = lockstep(iter([((torch.zeros(4, 1),), torch.ones(4))] * len(kinds)), torch.device("cpu"), "test",
                     stage=lambda b: kinds.pop(0) if b[1].numel() else "zero rows", kind=lambda k: k)  # fmt: skip
    return [(s.batch, s.kind) for s in steps]


def test_lockstep_agrees_on_each_batch_kind():
    """The staged batches' kinds: each step's lowest over the ranks; rank 0's zero-row step is eager."""
    got0, got1 = run_ranks(_lockstep_kinds_agreed, 2, timeout=60)
    assert [k for _, k in got0] == [k for _, k in got1] == [2, 1, 1, 2, 1]
    assert [b for b, _ in got0] == [2, 1, 2, 2, "zero rows"] and [b for b, _ in got1] == [2, 2, 1, 2, 2]
