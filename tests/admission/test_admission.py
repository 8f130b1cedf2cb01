"""Feature admission (veloce.admission): the k-th sighting inserts, refused ids read and
train the table's default row, eval reads it, find() reports them absent, the policies'
arguments, rates and the sketch's bounds."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import DEVICES

import veloce
from veloce.admission import Frequency, NoAdmission, Probability, count_sightings, resolve
from veloce.optim import SGD

D = 4


def _emb(device: str, admission, mode: str = "sum", optimizer=None, **kw) -> veloce.DynamicEmbedding:
    return veloce.DynamicEmbedding(D, mode=mode, optimizer=optimizer or SGD(lr=0.5), device=device,
                                   admission=admission, **kw)


def _lookup(emb, ids, device):
    ids = torch.tensor(ids, device=device)
    return emb(ids, torch.arange(ids.numel(), device=device))


def _found(emb, ids, device) -> list[bool]:
    return emb.find(torch.tensor(ids, device=device))[1].tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_kth_sighting_inserts(device, k):
    """An id gets its row on its k-th sighting, one lookup (and one backward) at a time."""
    emb = _emb(device, Frequency(min_count=k))
    for sighting in range(1, k + 2):
        out = _lookup(emb, [7], device)
        assert _found(emb, [7], device) == [sighting >= k], f"sighting {sighting}"
        out.sum().backward()
    assert len(emb) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_kth_sighting_across_backwards_and_repeats(device):
    """Repeats in one lookup count once each; several backward passes before a step."""
    emb = _emb(device, Frequency(min_count=3))
    _lookup(emb, [1, 1, 2], device).sum().backward()  # 1 seen twice, 2 once
    assert _found(emb, [1, 2], device) == [False, False]
    _lookup(emb, [1, 2], device).sum().backward()  # 1: 3rd sighting, 2: 2nd
    assert _found(emb, [1, 2], device) == [True, False]
    emb.step()
    _lookup(emb, [2], device).sum().backward()
    assert _found(emb, [1, 2], device) == [True, True]


@pytest.mark.parametrize("device", DEVICES)
def test_eval_and_prefetch_do_not_count(device):
    emb = _emb(device, Frequency(min_count=2))
    emb.eval()
    for _ in range(3):
        _lookup(emb, [5], device)
    emb.train()
    emb.prefetch(torch.tensor([5], device=device))
    _lookup(emb, [5], device)
    assert _found(emb, [5], device) == [False]
    _lookup(emb, [5], device)
    assert _found(emb, [5], device) == [True]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_refused_gradient_trains_default_row(device, mode):
    """Refused ids read the default row; its gradient is their summed gradient (SGD by hand)."""
    emb = _emb(device, Frequency(min_count=2), mode=mode)
    row0 = emb.table.default_rows().clone()
    ids = torch.tensor([10, 11, 12, 13], device=device)
    offsets = torch.tensor([0, 2], device=device)
    out = emb(ids, offsets)  # every id refused (first sightings)
    torch.testing.assert_close(out, row0.expand(2, D) * (2.0 if mode == "sum" else 1.0))
    g = torch.arange(8, dtype=torch.float32, device=device).view(2, D)
    (out * g).sum().backward()
    emb.step()
    per_bag = g * (1.0 if mode == "sum" else 0.5)
    torch.testing.assert_close(emb.table.default_rows(), row0 - 0.5 * 2 * per_bag.sum(0, keepdim=True))
    assert len(emb) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_bag_gradients(device):
    """A bag of an admitted and a refused id: the admitted row and the default row each get
    the bag's gradient (mean over both positions)."""
    emb = _emb(device, Frequency(min_count=2), mode="mean")
    _lookup(emb, [1], device).sum().backward()
    emb.zero_grad()
    row0 = emb.table.default_rows().clone()
    ids = torch.tensor([1, 2], device=device)  # 1 admitted on its 2nd sighting, 2 refused
    out = emb(ids, torch.tensor([0], device=device))
    rows, found = emb.find(torch.tensor([1], device=device))
    assert found.tolist() == [True]
    torch.testing.assert_close(out, (rows + row0) / 2)
    out.sum().backward()
    emb.step()
    torch.testing.assert_close(emb.table.default_rows(), row0 - 0.5 * 0.5)
    torch.testing.assert_close(emb.find(torch.tensor([1], device=device))[0], rows - 0.5 * 0.5)


@pytest.mark.parametrize("device", DEVICES)
def test_eval_reads_default_row(device):
    emb = _emb(device, Frequency(min_count=5))
    _lookup(emb, [3], device).sum().backward()
    emb.step()
    emb.eval()
    out = _lookup(emb, [3, 4], device)
    torch.testing.assert_close(out, emb.table.default_rows().expand(2, D))
    plain = _emb(device, None)
    plain.eval()
    assert not torch.equal(_lookup(plain, [3], device), out[:1])


@pytest.mark.parametrize("device", DEVICES)
def test_deterministic_across_runs(device):
    def run():
        emb = _emb(device, Frequency(min_count=2, width=64, depth=2))
        g = torch.Generator().manual_seed(0)
        for _ in range(5):
            ids = torch.randint(0, 40, (30,), generator=g).to(device)
            emb(ids, torch.arange(0, 30, 3, device=device)).square().sum().backward()
            emb.step()
        return emb.export(), emb.table.default_rows().clone(), emb.stats()
    (a, da, sa), (b, db, sb) = run(), run()
    assert torch.equal(a["keys"], b["keys"]) and torch.equal(a["weights"], b["weights"])
    assert torch.equal(da, db) and sa == sb


@pytest.mark.parametrize("device", DEVICES)
def test_stats(device):
    emb = _emb(device, Frequency(min_count=2))
    _lookup(emb, [1, 2, 3], device)
    _lookup(emb, [1, 1, 4], device)
    s = emb.stats()
    assert (s["admitted"], s["refused"], s["admitted_last"], s["refused_last"]) == (2, 4, 2, 1)
    assert s["default_row_share"] == pytest.approx(4 / 6)
    assert s["sketch_bytes"] == 4 * 4 * veloce.admission.DEFAULT_WIDTH
    emb.stats(reset=True)
    assert emb.stats()["admitted"] == 0
    assert "admitted" not in _emb(device, None).stats()


@pytest.mark.parametrize("device", DEVICES)
def test_probability_rate(device):
    """Each sighting admits with probability p: the first-sighting admissions of n ids are
    Binomial(n, p) (6 sigma bounds), and deterministic per (seed, id, sighting)."""
    p, n = 0.25, 20000
    emb = _emb(device, Probability(p, seed=3))
    ids = torch.arange(n, device=device) * 7919
    emb(ids, torch.arange(n, device=device))
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(len(emb) - n * p) < 6 * sigma
    again = _emb(device, Probability(p, seed=3))
    again(ids, torch.arange(n, device=device))
    assert torch.equal(emb.export()["keys"].sort()[0], again.export()["keys"].sort()[0])
    # the second sighting of the refused ones admits about p of them again
    refused = ids[~emb.find(ids)[1]]
    emb(refused, torch.arange(refused.numel(), device=device))
    second = len(emb) - again.__len__()
    sigma2 = math.sqrt(refused.numel() * p * (1 - p))
    assert abs(second - refused.numel() * p) < 6 * sigma2


def test_sketch_memory_bounded():
    """The sketch's size depends on its shape only, not on the ids seen."""
    emb = _emb("cpu", Frequency(min_count=2, width=1024, depth=3))
    counts = emb.table._buffers["admission_counts"]
    assert counts.shape == (3, 1024) and counts.dtype == torch.int32
    _lookup(emb, list(range(5000)), "cpu")
    assert emb.table._buffers["admission_counts"].shape == (3, 1024)
    assert Frequency(2, width=1024, depth=3).sketch_bytes == 4 * 3 * 1024


def test_false_admission_rate_within_bound():
    """Count-min: an id's estimate exceeds its count by at most e / width * N with
    probability >= 1 - e^-depth. Checked over many ids seen once (N sightings in all)."""
    width, depth, n = 512, 4, 20000
    counters = torch.zeros(depth, width, dtype=torch.int32)
    ids = torch.arange(n) * 1000003 + 17  # distinct ids, each seen once
    est = count_sightings(counters, ids, seed=5)
    excess = est - 1
    bound = math.e / width * n
    over = (excess > bound).double().mean().item()
    assert over <= math.exp(-depth), (over, bound)
    assert (est >= 1).all()  # never undercounts
    # min_count = k: an id seen once is falsely admitted when its excess reaches k - 1
    k = int(bound) + 2
    assert ((est >= k).double().mean().item()) <= math.exp(-depth)


def _reference_count(counters, ids, seed, counted=None, sightings=None):
    """The sketch in torch ops (sketch_slots' layout): the specification sketch_count fuses."""
    depth, _ = counters.shape
    idx = veloce.admission.sketch_slots(ids, depth, counters.shape[1], seed).reshape(-1)
    flat = counters.view(-1)
    add = torch.ones(ids.numel(), dtype=counters.dtype) if sightings is None else sightings.int()
    if counted is not None:
        add = add * counted.int()
    flat.index_add_(0, idx, add.repeat(depth))
    values = flat[idx].clamp_(max=veloce.admission.COUNT_LIMIT)
    flat[idx] = values
    return values.view(depth, -1).amin(0).long()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("width", [257, 256])  # a power of two takes the kernels' mask instead of the remainder
def test_sketch_count_equals_the_torch_reference(device, masked, weighted, width):
    gen = torch.Generator().manual_seed(3)
    ids = torch.cat([torch.randint(-(1 << 62), 1 << 62, (3000,), generator=gen), torch.arange(50).repeat(7)])
    counted = torch.rand(ids.shape, generator=gen) < 0.7 if masked else None
    sightings = torch.randint(0, 4, ids.shape, generator=gen) if weighted else None
    start = torch.randint(0, 5, (3, width), generator=gen, dtype=torch.int32)
    start[0, :9] = veloce.admission.COUNT_LIMIT - 2  # some counters saturate
    got_counters, want_counters = start.to(device), start.clone()
    for seed in (0, -7, 1 << 40):
        got = count_sightings(got_counters, ids.to(device), seed, None if counted is None else counted.to(device),
                              None if sightings is None else sightings.to(device))  # fmt: skip
        want = _reference_count(want_counters, ids, seed, counted, sightings)
        assert torch.equal(got.cpu(), want)
        assert torch.equal(got_counters.cpu(), want_counters)
    empty = count_sightings(got_counters, ids[:0].to(device), 0)
    assert empty.shape == (0,) and empty.dtype == torch.int64


def test_sketch_count_refuses_bad_arguments():
    ids = torch.arange(4)
    with pytest.raises(RuntimeError, match="counters must be torch.int32"):
        veloce.ops.sketch.sketch_count(torch.zeros(2, 8), ids, 0)
    with pytest.raises(RuntimeError, match="counted.size\\(0\\) must equal the number of ids"):
        veloce.ops.sketch.sketch_count(torch.zeros(2, 8, dtype=torch.int32), ids, 0, torch.ones(3, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="ids must be torch.int64"):
        veloce.ops.sketch.sketch_count(torch.zeros(2, 8, dtype=torch.int32), ids.int(), 0)


def test_counters_saturate():
    counters = torch.full((2, 8), veloce.admission.COUNT_LIMIT - 1, dtype=torch.int32)
    est = count_sightings(counters, torch.arange(100), seed=0)
    assert (est == veloce.admission.COUNT_LIMIT).all()
    assert int(counters.max()) == veloce.admission.COUNT_LIMIT


@pytest.mark.parametrize("device", DEVICES)
def test_evicted_ids_keep_their_count(device):
    emb = _emb(device, Frequency(min_count=2))
    _lookup(emb, [9], device)
    _lookup(emb, [9], device)
    assert emb.erase(torch.tensor([9], device=device)) == 1
    _lookup(emb, [9], device)
    assert _found(emb, [9], device) == [True]


@pytest.mark.parametrize("device", DEVICES)
def test_padding_is_no_sighting(device):
    emb = _emb(device, Frequency(min_count=2), padding_idx=0)
    _lookup(emb, [0, 0, 0], device)
    out = _lookup(emb, [0], device)
    assert _found(emb, [0], device) == [False]
    assert torch.equal(out, torch.zeros_like(out))
    assert emb.stats()["refused"] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_lookup_many_and_growth(device):
    """Several tables in one insert (find_or_insert_many), through growth."""
    a = _emb(device, Frequency(min_count=2), capacity=32)
    b = _emb(device, None, capacity=32)
    ids = torch.arange(200, device=device)
    offs = torch.arange(0, 200, 4, device=device)
    for _ in range(2):
        oa, ob = veloce.lookup_many([a, b], [(ids, offs), (ids, offs)])
        (oa.sum() + ob.sum()).backward()
        a.step(), b.step()
    assert len(a) == 200 and len(b) == 200


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_round_trip(device):
    emb = _emb(device, Frequency(min_count=3, width=256))
    for _ in range(2):
        _lookup(emb, [1, 2, 3], device).sum().backward()
        emb.step()
    sd = emb.state_dict()
    assert {"admission_counts", "default_weights", "default_state"} <= set(sd)
    other = _emb(device, Frequency(min_count=3, width=256))
    other.load_state_dict(sd)
    assert torch.equal(other.table.default_rows(), emb.table.default_rows())
    _lookup(other, [1], device)  # the 3rd sighting, counted before the save
    assert _found(other, [1], device) == [True]
    with pytest.raises(RuntimeError, match="admission_counts"):
        _emb(device, Frequency(min_count=3, width=128)).load_state_dict(sd)


def test_checkpoint_round_trip(tmp_path):
    model = torch.nn.ModuleDict({"t": _emb("cpu", Frequency(3, width=256), optimizer=veloce.optim.Adagrad())})
    for _ in range(2):
        _lookup(model["t"], [1, 2, 3], "cpu").sum().backward()
        model["t"].step()
    veloce.checkpoint.save(tmp_path / "ck", model, step=1)
    fresh = torch.nn.ModuleDict({"t": _emb("cpu", Frequency(3, width=256), optimizer=veloce.optim.Adagrad())})
    veloce.checkpoint.load(tmp_path / "ck", fresh)
    for name in ("admission_counts", "default_weights", "default_state"):
        assert torch.equal(fresh["t"].table._buffers[name], model["t"].table._buffers[name]), name
    _lookup(fresh["t"], [2], "cpu")
    assert _found(fresh["t"], [2], "cpu") == [True]


def test_host_cached_storage():
    """Admission on a tiered table: the same rows and default row as on the device."""
    ref = _emb("cpu", Frequency(min_count=2))
    tiered = _emb("cpu", Frequency(min_count=2), storage=veloce.storage.HostCached(cache_rows=64))
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        ids = torch.randint(0, 300, (60,), generator=g)
        offs = torch.arange(0, 60, 5)
        oa, ob = ref(ids, offs), tiered(ids, offs)
        torch.testing.assert_close(oa, ob)
        oa.square().sum().backward(), ob.square().sum().backward()
        ref.step(), tiered.step()
    torch.testing.assert_close(ref.table.default_rows(), tiered.table.default_rows())
    ea, eb = ref.export(), tiered.export()
    oa, ob = ea["keys"].argsort(), eb["keys"].argsort()
    assert torch.equal(ea["keys"][oa], eb["keys"][ob])
    torch.testing.assert_close(ea["weights"][oa], eb["weights"][ob])


def test_bad_arguments():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="min_count"):
            Frequency(min_count=bad)
    for bad in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="p must be"):
            Probability(bad)
    with pytest.raises(ValueError, match="width"):
        Frequency(2, width=0)
    with pytest.raises(ValueError, match="depth"):
        Probability(0.5, depth=0)
    with pytest.raises(TypeError, match="admission"):
        _emb("cpu", 3)
    with pytest.raises(ValueError, match="admission"):
        resolve("frequency")
    assert isinstance(resolve(None), NoAdmission)
    assert "admission=Frequency(min_count=2" in repr(_emb("cpu", Frequency(2)))


def test_op_admit_argument():
    """The op: refused misses get slot C and are not inserted; present ids are found."""
    from veloce.ops import hash_table as ops

    c = 64
    t = [torch.zeros(c, dtype=torch.int64), torch.zeros(c, dtype=torch.uint8), torch.zeros(c, dtype=torch.int64),
         torch.zeros(c, 2), torch.zeros(c, 0)]
    ops.find_or_insert(*t, torch.tensor([1]))
    slots, counts, _ = ops.find_or_insert(*t, torch.tensor([1, 2, 3, 2]),
                                          admit=torch.tensor([False, False, True, False]))
    assert slots[0] >= 0 and slots[1] == c and slots[3] == c and 0 <= slots[2] < c
    assert counts.tolist() == [1, 0]
    assert ops.find(t[0], t[1], torch.tensor([2])).tolist() == [-1]
    with pytest.raises(ValueError, match="admit"):
        ops.find_or_insert(*t, torch.tensor([1, 2]), admit=torch.tensor([True]))


@pytest.mark.parametrize("device", DEVICES)
def test_max_mode_reads_and_trains_default_row(device):
    emb = _emb(device, Frequency(min_count=2), mode="max")
    row0 = emb.table.default_rows().clone()
    out = _lookup(emb, [1, 2], device)
    torch.testing.assert_close(out, row0.expand(2, D))
    out.sum().backward()
    emb.step()
    torch.testing.assert_close(emb.table.default_rows(), row0 - 0.5 * 2)


@pytest.mark.parametrize("device", DEVICES)
def test_per_sample_weights_gradient_of_refused_ids(device):
    emb = _emb(device, Frequency(min_count=2))
    ids = torch.tensor([1, 2], device=device)
    w = torch.tensor([0.5, 2.0], device=device, requires_grad=True)
    g = torch.arange(1.0, D + 1, device=device)
    (emb(ids, torch.tensor([0], device=device), w) * g).sum().backward()
    expected = (emb.table.default_rows()[0] * g).sum().expand(2)
    torch.testing.assert_close(w.grad, expected)


def test_clip_grad_norm_counts_the_default_row():
    """Clipping scales the default row's gradient with the rows' (it is one row more)."""
    emb = _emb("cpu", Frequency(min_count=2))
    row0 = emb.table.default_rows().clone()
    (_lookup(emb, [1, 2], "cpu") * 10).sum().backward()
    norm = veloce.clip_grad_norm_([], 1.0, tables=[emb])
    assert float(norm) == pytest.approx(20 * math.sqrt(D))
    emb.step()
    torch.testing.assert_close((row0 - emb.table.default_rows()).norm(), torch.tensor(0.5))


def test_nonfinite_skip_leaves_default_row():
    emb = _emb("cpu", Frequency(min_count=2), nonfinite_grad="skip")
    row0 = emb.table.default_rows().clone()
    (_lookup(emb, [1], "cpu") * float("nan")).sum().backward()
    emb.step()
    torch.testing.assert_close(emb.table.default_rows(), row0)


def test_eval_under_compile_reads_default_row():
    emb = _emb("cpu", Frequency(min_count=3))
    _lookup(emb, [1], "cpu").sum().backward()
    emb.step()
    emb.eval()
    x, offsets = torch.tensor([1, 5, 6]), torch.tensor([0, 1])
    torch.testing.assert_close(torch.compile(emb, fullgraph=True)(x, offsets), emb(x, offsets))
    torch.testing.assert_close(emb(x, offsets)[0], emb.table.default_rows()[0])


@pytest.mark.parametrize("device", DEVICES)
def test_sightings_stand_for_repeated_positions(device):
    """A position given n sightings counts as n occurrences (a deduplicated sharded insert):
    the same sketch, estimates, admissions and telemetry as the repeated ids."""
    ids = torch.tensor([4, 4, 4, 9, 5], device=device)
    distinct, counts = torch.tensor([4, 9, 5], device=device), torch.tensor([3, 1, 1], device=device)
    a = torch.zeros(4, 64, dtype=torch.int32, device=device)
    b = torch.zeros_like(a)
    est = count_sightings(a, ids, 0)
    est_d = count_sightings(b, distinct, 0, torch.tensor([True, True, False], device=device), counts)
    assert est[0].item() == est_d[0].item() == 3 and est_d[2].item() == 0  # position 2: not counted
    whole, dedup = _emb(device, Frequency(min_count=3)), _emb(device, Frequency(min_count=3))
    whole.table.find_or_insert(torch.tensor([4, 4, 4, 9], device=device))
    dedup.table.find_or_insert(torch.tensor([4, 9], device=device), sightings=torch.tensor([3, 1], device=device))
    sketches = [t.table.admission_state()["admission_counts"] for t in (whole, dedup)]
    assert torch.equal(*sketches)
    assert _found(whole, [4, 9], device) == _found(dedup, [4, 9], device) == [True, False]
    for key in ("admitted", "refused"):
        assert whole.table.admission_stats()[key] == dedup.table.admission_stats()[key]


@pytest.mark.parametrize("device", DEVICES)
def test_a_saturated_sketch_is_reported_and_warned_once(device):
    """1,000 distinct ids in a sketch of 64 counters a row: after one batch every counter
    holds 2 or more, so each id was admitted at its first sighting; stats() says so and
    warns once. A wide sketch reports a rate near 0 and does not warn."""
    narrow = _emb(device, Frequency(min_count=2, width=64))
    ids = torch.arange(1000, device=device)
    _lookup(narrow, ids.tolist(), device)
    assert all(_found(narrow, ids.tolist(), device))  # every id got a row at its first sighting
    with pytest.warns(UserWarning, match=r"sketch of this table .* is saturated: an id is admitted at its first "
                                         r"sighting with probability about 1.00.*width=256"):  # fmt: skip
        stats = narrow.stats()
    assert stats["false_admission"] == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert narrow.stats()["false_admission"] == 1.0  # once per table
        wide = _emb(device, Frequency(min_count=2))
        _lookup(wide, ids.tolist(), device)
        assert wide.stats()["false_admission"] < 1e-6
        assert not any(_found(wide, ids.tolist(), device))
        three = _emb(device, Frequency(min_count=3, width=64))
        _lookup(three, ids[:40].tolist(), device)  # at most 40 of 64 counters of a row reach 2
        assert three.stats()["false_admission"] < 0.1
    assert "false_admission" not in _emb(device, Probability(0.5)).stats()


@pytest.mark.parametrize("device", DEVICES)
def test_sightings_out_of_range_cannot_wrap_the_counters(device):
    counters = torch.zeros(2, 16, dtype=torch.int32, device=device)
    ids = torch.tensor([1, 2, 3], device=device)
    est = count_sightings(counters, ids, 0, sightings=torch.tensor([-5, 1, (1 << 32) + 3], device=device))
    limit = veloce.admission.COUNT_LIMIT
    assert int(counters.min()) >= 0  # a negative count adds nothing
    assert est[0] >= 0 and est[2] == limit  # a huge one saturates instead of wrapping to 3
