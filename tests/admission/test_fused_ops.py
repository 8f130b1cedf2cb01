"""Feature admission's fused ops: ``sketch_admit`` makes the decisions of the policies'
``admit`` on ``sketch_count``'s estimates (the specification), and ``admission_tally``
books an insert's slots as the torch reductions would."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES

import veloce
from veloce.admission import Frequency, Probability, count_sightings
from veloce.ops import extension as _ext
from veloce.ops.sketch import admission_tally, sketch_admit

pytestmark = pytest.mark.skipif(not _ext.loaded, reason="veloce._C is not built")


def _ids(gen):
    # random ids over the int64 range, and hot ids repeated within the call
    return torch.cat([torch.randint(-(1 << 62), 1 << 62, (3000,), generator=gen), torch.arange(50).repeat(7)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", [Frequency(1), Frequency(2), Frequency(5, seed=9), Probability(0.3),
                                    Probability(1.0, seed=-4), Probability(0.05, seed=1 << 40)])  # fmt: skip
@pytest.mark.parametrize("masked,weighted", [(False, False), (True, False), (False, True)])
def test_sketch_admit_equals_count_then_admit(device, policy, masked, weighted):
    gen = torch.Generator().manual_seed(5)
    ids = _ids(gen)
    counted = torch.rand(ids.shape, generator=gen) < 0.7 if masked else None
    sightings = torch.randint(0, 4, ids.shape, generator=gen) if weighted else None
    start = torch.randint(0, 3, (4, 509), generator=gen, dtype=torch.int32)
    start[0, :9] = veloce.admission.COUNT_LIMIT - 2  # some counters saturate
    fused, ref = start.to(device), start.clone().to(device)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    min_count, p = policy.fused_rule()
    for _ in range(3):  # the counts grow over calls: later calls admit more
        got = sketch_admit(fused, ids.to(device), policy.seed, min_count, p, policy.seed, to(counted), to(sightings))
        want = policy.admit(ids.to(device), count_sightings(ref, ids.to(device), policy.seed, to(counted),
                                                            to(sightings)))  # fmt: skip
        assert got.dtype == torch.bool and torch.equal(got, want)
        assert torch.equal(fused, ref)
    assert 0 < int(got.sum()) or isinstance(policy, Probability)


@pytest.mark.parametrize("device", DEVICES)
def test_sketch_admit_skip_counts_nothing(device):
    counters = torch.zeros(4, 64, dtype=torch.int32, device=device)
    ids = torch.arange(10, device=device)
    flag = torch.tensor([True], device=device)
    admit = sketch_admit(counters, ids, 0, 1, 1.0, 0, skip=flag)
    assert int(counters.abs().sum()) == 0 and not admit.any()  # nothing counted: estimates 0 < 1
    admit = sketch_admit(counters, ids, 0, 1, 1.0, 0, skip=~flag)
    assert admit.all() and int(counters.sum()) == 4 * 10


def test_sketch_admit_refuses_bad_arguments():
    counters, ids = torch.zeros(2, 8, dtype=torch.int32), torch.arange(4)
    with pytest.raises(ValueError, match="min_count must be >= 0"):
        sketch_admit(counters, ids, 0, -1, 1.0, 0)
    with pytest.raises(ValueError, match=r"p must be a probability in \(0, 1\]"):
        sketch_admit(counters, ids, 0, 1, 0.0, 0)
    with pytest.raises(RuntimeError, match="skip must be a bool tensor of one element"):
        sketch_admit(counters, ids, 0, 1, 1.0, 0, skip=torch.zeros(2, dtype=torch.bool))
    assert int(counters.abs().sum()) == 0


def _reference_tally(stats, slots, capacity, sightings):
    own, refused = (slots >= 0) & (slots < capacity), slots == capacity
    w = torch.ones_like(slots) if sightings is None else sightings
    now = torch.stack([(own * w).sum(), (refused * w).sum()])
    return torch.cat([stats[:2] + now, now])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("n", [0, 5, 100_000])
def test_admission_tally_equals_the_torch_reference(device, weighted, n):
    gen = torch.Generator().manual_seed(n)
    capacity = 1000
    slots = torch.randint(-2, capacity + 1, (n,), generator=gen)  # codes, rows and the default row (slot C)
    sightings = torch.randint(0, 5, (n,), generator=gen) if weighted else None
    stats = torch.tensor([7, 3, 1, 1], device=device)
    want = stats.cpu()
    for _ in range(2):
        want = _reference_tally(want, slots, capacity, sightings)
        admission_tally(stats, slots.to(device), capacity, None if sightings is None else sightings.to(device))
        assert torch.equal(stats.cpu(), want)


def test_admission_tally_refuses_bad_arguments():
    with pytest.raises(ValueError, match=r"stats must be a contiguous \(4,\) int64 tensor"):
        admission_tally(torch.zeros(3, dtype=torch.long), torch.arange(4), 10)
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        admission_tally(torch.zeros(4, dtype=torch.long), torch.arange(4), -1)
    with pytest.raises(RuntimeError, match=r"sightings.size\(0\) must equal the number of slots"):
        admission_tally(torch.zeros(4, dtype=torch.long), torch.arange(4), 10, torch.ones(3, dtype=torch.long))


@pytest.mark.parametrize("device", DEVICES)
def test_fused_ops_opcheck(device):
    counters = torch.zeros(2, 32, dtype=torch.int32, device=device)
    ids = torch.arange(20, device=device)
    torch.library.opcheck(torch.ops.veloce.sketch_admit.default, (counters, ids, 3, 2, 0.5, 3, None, None, None))
    stats = torch.zeros(4, dtype=torch.long, device=device)
    torch.library.opcheck(torch.ops.veloce.admission_tally.default, (stats, ids, 10, None))
