"""Tests of the hash_table ops against a slot-exact plain-Python reference (docs/ops.md)."""

from __future__ import annotations

import random
from dataclasses import dataclass, fields

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import veloce
from veloce.ops import hash_table as ht

pytestmark = pytest.mark.skipif(not veloce.ops.extension.loaded, reason="veloce._C is not built")

I64_MIN, I64_MAX = -(2**63), 2**63 - 1
EXTREME_IDS = [I64_MIN, I64_MAX, -1, 0, 1, I64_MIN + 1, I64_MAX - 1]
M64 = (1 << 64) - 1

from conftest import DEVICES, counting_syncs, deterministic_algorithms, keys_in_buckets_0_and_1, probe  # noqa: E402
from conftest import ref_init_value as init_value  # noqa: E402  (the pure-Python initializer)
HYP = settings(deadline=None, max_examples=30, suppress_health_check=[HealthCheck.function_scoped_fixture])


@dataclass
class Table:
    keys: torch.Tensor
    digests: torch.Tensor
    scores: torch.Tensor
    weights: torch.Tensor
    opt_state: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))

    def clone(self) -> Table:
        return Table(*(t.clone() for t in self.tensors()))

    def assert_equal(self, other: Table) -> None:
        for f in fields(self):
            a, b = getattr(self, f.name).cpu(), getattr(other, f.name).cpu()
            assert a.dtype == b.dtype and a.shape == b.shape, f.name
            assert torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                               b.view(torch.uint8) if b.is_floating_point() else b), f"{f.name} differs"


def make_table(capacity: int, dim: int = 4, state: int = 2, dtype=torch.float32, device="cpu") -> Table:
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return Table(
        keys=torch.zeros(capacity, dtype=torch.int64, device=device),
        digests=torch.zeros(capacity, dtype=torch.uint8, device=device),
        scores=torch.zeros(capacity, dtype=torch.int64, device=device),
        weights=torch.zeros(capacity, dim, dtype=dtype, device=device),
        opt_state=torch.zeros(capacity, state, dtype=state_dtype, device=device),
    )


def ids_tensor(ids, device="cpu") -> torch.Tensor:
    return torch.tensor(list(ids), dtype=torch.int64, device=device)


# ---- the reference: hashing, init and table semantics in plain Python ----------------


class Ref:
    """A slot-exact model of the table: lists for keys/digests/scores, a dict key -> slot."""

    def __init__(self, t: Table):
        self.keys, self.digests, self.scores = t.keys.tolist(), t.digests.tolist(), t.scores.tolist()
        self.weights, self.opt_state = t.weights.cpu().clone(), t.opt_state.cpu().clone()
        self.nb = len(self.keys) // 32
        self.where = {k: s for s, (k, d) in enumerate(zip(self.keys, self.digests)) if d}

    def table(self, device) -> Table:
        digests = torch.tensor(self.digests, dtype=torch.uint8, device=device)
        return Table(ids_tensor(self.keys, device), digests, ids_tensor(self.scores, device),
                     self.weights.to(device), self.opt_state.to(device))

    def _insert_all(self, ids, allow_evict, pad=None, room=-1):
        """Phase 2; returns (slots, changes) or (None, num_failed) after undoing. ``room``:
        how many new ids may take an empty slot (-1: any); the later ones must evict."""
        slots = [None if i == pad else self.where.get(i, -3) for i in ids]
        touched = {s for s in slots if s is not None and s >= 0}
        changes, failed, claimed = [], set(), 0
        for i, id_ in enumerate(ids):
            if slots[i] != -3:
                continue
            s = self.where.get(id_)
            if s is None:
                a, b, d = probe(id_, self.nb)
                ea, eb = ([s for s in range(k * 32, k * 32 + 32) if not self.digests[s]] for k in (a, b))
                if a == b:
                    eb = []
                if (room < 0 or claimed < room) and (ea or eb):
                    s = (ea if len(ea) >= len(eb) else eb)[0]
                    claimed += 1
                elif allow_evict:  # the occupied candidates the call did not touch
                    cands = [s for k in ((a,) if a == b else (a, b)) for s in range(k * 32, k * 32 + 32)
                             if s not in touched and self.digests[s]]
                    s = min(cands, key=lambda s: self.scores[s]) if cands else None  # min keeps the first
                if s is None:
                    failed.add(id_)
                    continue
                changes.append((s, self.keys[s], self.digests[s]))
                if self.digests[s]:
                    del self.where[self.keys[s]]
                self.keys[s], self.digests[s], self.where[id_] = id_, d, s
                touched.add(s)
            slots[i] = s
        if failed:
            for s, k, d in reversed(changes):
                if self.digests[s]:
                    del self.where[self.keys[s]]
                self.keys[s], self.digests[s] = k, d
                if d:
                    self.where[k] = s
            fresh = len(changes) + len(failed)  # the call's distinct new ids
            return None, fresh - room if not allow_evict and 0 <= room < fresh else len(failed)
        return slots, changes

    def _scores(self, slots, changes, policy, value):
        for s, _, _ in changes:
            self.scores[s] = value if policy == 1 else 0
        for s in slots:
            if s is not None:
                self.scores[s] = value if policy == 1 else self.scores[s] + (policy == 2)

    def find(self, ids):
        return [self.where.get(i, -1) for i in ids]

    def find_or_insert(self, ids, policy=0, value=0, allow_evict=False, seed=0, kind=0, a=0.0, b=0.0,
                       pad=None, room=-1):
        slots, changes = self._insert_all(ids, allow_evict, pad, room)
        if slots is None:
            return None, [0, changes], []
        for s, _, _ in changes:
            row = [init_value(seed, self.keys[s], j, kind, a, b) for j in range(self.weights.shape[1])]
            row = torch.tensor(row, dtype=torch.float64)  # rounded to float first, as the kernels do
            if self.weights.dtype != torch.float64:
                row = row.float().to(self.weights.dtype)
            self.weights[s] = row
            self.opt_state[s] = 0
        self._scores(slots, changes, policy, value)
        return [-1 if s is None else s for s in slots], [len(changes), 0], [k for _, k, d in changes if d]

    def insert_or_assign(self, ids, values, opt_values=None, score_values=None, policy=0, value=0,
                         allow_evict=False, room=-1):
        slots, changes = self._insert_all(ids, allow_evict, room=room)
        if slots is None:
            return None, [0, changes], []
        if opt_values is None:
            for s, _, _ in changes:
                self.opt_state[s] = 0
        for i, s in enumerate(slots):  # in order: the last occurrence wins
            self.weights[s] = values[i]
            if opt_values is not None:
                self.opt_state[s] = opt_values[i]
            if score_values is not None:
                self.scores[s] = int(score_values[i])
        if score_values is None:
            self._scores(slots, changes, policy, value)
        return slots, [len(changes), 0], [k for _, k, d in changes if d]

    def erase(self, ids):
        out = []
        for i in ids:
            s = self.where.pop(i, None)
            if s is not None:
                self.digests[s] = 0
            out.append(s is not None)
        return out


def check_insert_result(result, expected):
    slots, counts, evicted = result
    exp_slots, exp_counts, exp_evicted = expected
    assert counts.device.type == "cpu" and counts.dtype == torch.int64  # on every backend
    assert counts.tolist() == exp_counts
    assert evicted.tolist() == exp_evicted
    if exp_slots is not None:
        assert slots.tolist() == exp_slots


# ---- reference equivalence ---------------------------------------------------------------

id_values = st.one_of(st.integers(-40, 40), st.sampled_from(EXTREME_IDS), st.integers(I64_MIN, I64_MAX))
op_strategy = st.tuples(
    st.sampled_from(["find_or_insert", "insert_or_assign", "erase", "find"]),
    st.lists(id_values, max_size=80),
    st.integers(0, 2),  # score policy
    st.booleans(),  # allow_evict
    st.integers(0, 3),  # init kind / which optional inputs
    st.one_of(st.just(-1), st.integers(0, 24)),  # room: new ids that may take an empty slot
)


@pytest.mark.parametrize("device", DEVICES)
@HYP
@given(capacity=st.sampled_from([32, 64, 96, 128, 160]), ops=st.lists(op_strategy, min_size=1, max_size=10),
       seed=st.integers(I64_MIN, I64_MAX), fill=st.integers(0, 160))
def test_matches_reference(device, capacity, ops, seed, fill):
    t = make_table(capacity, dim=3, state=2, device=device)
    ref = Ref(t)
    # Start (nearly) full, so that later ops meet full buckets: evictions and failures.
    fill_ids = [(i * 0x9E3779B97F4A7C15) % 2**64 - 2**63 for i in range(fill)]
    evict = fill % 2 == 0
    got = ht.find_or_insert(*t.tensors(), ids_tensor(fill_ids, device), 2, 0, evict, seed, 2, 0.0, 1.0)
    check_insert_result(got, ref.find_or_insert(fill_ids, 2, 0, evict, seed, 2, 0.0, 1.0))
    if fill % 3 == 0:  # spread the LFU scores
        got = ht.find_or_insert(*t.tensors(), ids_tensor(fill_ids[::3], device), 2, 0, False)
        check_insert_result(got, ref.find_or_insert(fill_ids[::3], 2, 0, False))
    for step, (op, ids, policy, evict, kind, room) in enumerate(ops):
        x = ids_tensor(ids, device)
        if op == "find":
            assert ht.find(t.keys, t.digests, x).tolist() == ref.find(ids)
        elif op == "erase":
            assert ht.erase(t.keys, t.digests, x).tolist() == ref.erase(ids)
        elif op == "find_or_insert":
            pad = ids[0] if (ids and kind == 3) else None
            got = ht.find_or_insert(*t.tensors(), x, policy, step + 7, evict, seed, kind, -0.5, 0.5, pad, room=room)
            want = ref.find_or_insert(ids, policy, step + 7, evict, seed, kind, -0.5, 0.5, pad, room)
            check_insert_result(got, want)
        else:
            gen = torch.Generator().manual_seed(step)
            values = torch.randn(len(ids), 3, generator=gen)
            opt_values = torch.randn(len(ids), 2, generator=gen) if kind & 1 else None
            score_values = torch.randint(0, 100, (len(ids),), generator=gen) if kind & 2 else None
            dev = [None if v is None else v.to(device) for v in (values, opt_values, score_values)]
            got = ht.insert_or_assign(*t.tensors(), x, *dev, policy, step + 7, evict, room)
            check_insert_result(got, ref.insert_or_assign(ids, values, opt_values, score_values, policy,
                                                          step + 7, evict, room))
        t.assert_equal(ref.table(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", [0, 1, 2, 3])
def test_initialize_matches_formula(device, kind):
    ids = EXTREME_IDS + list(range(-5, 5))
    a, b = (0.25, 2.0) if kind == 3 else (-0.1, 0.3)
    got = ht.initialize(ids_tensor(ids, device), 7, 1234, kind, a, b, torch.float64).cpu()
    want = [[init_value(1234, i, j, kind, a, b) for j in range(7)] for i in ids]
    want = torch.tensor(want, dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_dtypes(device, dtype):
    t = make_table(256, dim=5, state=0, dtype=dtype, device=device)
    ids = ids_tensor(EXTREME_IDS + list(range(2, 102)), device)
    slots, counts, _ = ht.find_or_insert(*t.tensors(), ids, 0, 0, False, 9, 3, 0.0, 1.0)
    assert counts.tolist() == [len(ids), 0]
    assert torch.equal(t.weights[slots], ht.initialize(ids, 5, 9, 3, 0.0, 1.0, dtype))
    values = torch.randn(len(ids), 5, device=device).to(dtype)
    ht.insert_or_assign(*t.tensors(), ids, values)
    assert torch.equal(t.weights[ht.find(t.keys, t.digests, ids)], values)
    k, w, s, sc = ht.export(*t.tensors(), 0, 256)
    assert w.dtype == dtype and s.shape == (len(ids), 0) and sorted(k.tolist()) == sorted(ids.tolist())


# ---- focused semantics -----------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_extreme_and_duplicate_ids(device):
    t = make_table(64, device=device)
    ids = ids_tensor([I64_MIN, 5, I64_MAX, -1, 0, 5, I64_MIN, 0], device)
    slots, counts, evicted = ht.find_or_insert(*t.tensors(), ids, 2, 0, False, 1, 2, -1.0, 1.0)
    assert counts.tolist() == [5, 0] and evicted.numel() == 0
    s = slots.tolist()
    assert s[1] == s[5] and s[0] == s[6] and s[4] == s[7] and len(set(s)) == 5
    assert torch.equal(ht.find(t.keys, t.digests, ids), slots)
    assert t.keys[slots].tolist() == ids.tolist()
    keys, weights, opt_state, scores = ht.export(*t.tensors(), 0, 64)
    assert sorted(keys.tolist()) == sorted(set(ids.tolist()))
    assert torch.equal(weights, ht.initialize(keys, 4, 1, 2, -1.0, 1.0, torch.float32))
    assert not opt_state.any()
    counts_by_key = {k: ids.tolist().count(k) for k in keys.tolist()}
    assert scores.tolist() == [counts_by_key[k] for k in keys.tolist()]  # LFU: one per occurrence
    assert ht.find(t.keys, t.digests, ids_tensor([7, -2, I64_MAX - 1], device)).tolist() == [-1, -1, -1]
    erased = ht.erase(t.keys, t.digests, ids)
    assert erased.tolist() == [True, True, True, True, True, False, False, False]
    assert ht.find(t.keys, t.digests, ids).tolist() == [-1] * 8
    assert ht.export(*t.tensors(), 0, 64)[0].numel() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_many_repeats_of_few_ids_group_per_id(device):
    """100k positions over 300 ids, two of them hot (one is I64_MIN, which the CUDA grouping's
    scratch set cannot store as a key): each id is inserted once, every position of an id
    gets its slot, LFU scores count the positions, insert_or_assign keeps the value of an
    id's last position and erase flags its first."""
    gen = torch.Generator().manual_seed(5)
    distinct = ids_tensor(EXTREME_IDS + list(range(2, 295)))
    idx = torch.randint(0, distinct.numel(), (100_000,), generator=gen)
    idx[::3] = 0  # I64_MIN, a third of the positions
    idx[1::7] = 9
    ids = distinct[idx].to(device)
    t = make_table(1024, dim=2, state=0, device=device)
    slots, counts, _ = ht.find_or_insert(*t.tensors(), ids, 2, 0, False, 1, 2, -1.0, 1.0)  # LFU
    assert counts.tolist() == [distinct.numel(), 0]
    slot_of = dict(zip(ids.tolist(), slots.tolist()))
    assert len(set(slot_of.values())) == distinct.numel()
    assert slots.tolist() == [slot_of[i] for i in ids.tolist()]
    occurrences = torch.bincount(idx, minlength=distinct.numel())
    assert t.scores[slots[:0].new_tensor([slot_of[i] for i in distinct.tolist()])].tolist() == occurrences.tolist()

    values = torch.arange(2 * ids.numel(), dtype=torch.float32).view(-1, 2).to(device)
    slots2, counts2, _ = ht.insert_or_assign(*t.tensors(), ids, values)
    assert counts2.tolist() == [0, 0] and torch.equal(slots2, slots)
    last = {i: p for p, i in enumerate(ids.tolist())}
    want = torch.stack([values[last[i]] for i in distinct.tolist()])
    assert torch.equal(t.weights[ht.find(t.keys, t.digests, distinct.to(device))], want)

    erased = ht.erase(t.keys, t.digests, ids).cpu()
    first = {}
    for p, i in enumerate(ids.tolist()):
        first.setdefault(i, p)
    assert erased.nonzero().squeeze(1).tolist() == sorted(first.values())


@pytest.mark.skipif(not torch.cuda.is_available() or not veloce.ops.extension.has_cuda_kernels(), reason="needs a GPU")
@pytest.mark.parametrize("kind", [0, 1, 2, 3])
@pytest.mark.parametrize("dim", [1, 5, 37, 128])
def test_cuda_initial_rows_equal_the_cpu_ones(kind, dim):
    """A row's first value does not depend on the device: the CUDA kernels (a Box-Muller
    pair per lane, lanes per row sized to the dim) give the CPU's values, up to the last
    bits of float64: CUDA's log, sin and cos differ from the C library's by an ulp or two,
    and nvcc fuses a multiply and an add where the CPU build rounds twice."""
    ids = ids_tensor(EXTREME_IDS + list(range(-300, 300, 7)))
    a, b = (0.25, 2.0) if kind == 3 else (-0.1, 0.3)
    for dtype, tol in ((torch.float32, 1.2e-7), (torch.float64, 1e-14)):
        cpu = ht.initialize(ids, dim, 99, kind, a, b, dtype)
        cuda = ht.initialize(ids.cuda(), dim, 99, kind, a, b, dtype).cpu()
        if kind < 2:
            assert torch.equal(cuda, cpu), dtype
        torch.testing.assert_close(cuda, cpu, rtol=tol, atol=tol, msg=lambda m, dtype=dtype: f"{dtype}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", [2, 3], ids=["uniform", "normal"])
def test_many_new_rows_in_one_call(device, kind):
    """50k new ids in one call: the CUDA kernels write several rows per warp then (rows per
    warp grow with the number of rows; 12 on an H100 here), including a last warp with
    fewer rows. Every new row is the initializer's, every assigned row its value."""
    ids = (torch.randperm(1 << 20, generator=torch.Generator().manual_seed(3))[:50_000] * 7919 - 12345).to(device)
    t = make_table(1 << 17, dim=6, state=2, device=device)
    slots, counts, _ = ht.find_or_insert(*t.tensors(), ids, 1, 5, False, 7, kind, -0.5, 0.5)
    assert counts.tolist() == [ids.numel(), 0] and slots.unique().numel() == ids.numel()
    assert torch.equal(t.weights[slots], ht.initialize(ids, 6, 7, kind, -0.5, 0.5, torch.float32))
    assert not t.opt_state[slots].any() and bool((t.scores[slots] == 5).all())
    values = torch.arange(ids.numel() * 6, dtype=torch.float32, device=device).view(-1, 6)
    slots2, counts2, _ = ht.insert_or_assign(*t.tensors(), ids, values)
    assert counts2.tolist() == [0, 0] and torch.equal(slots2, slots) and torch.equal(t.weights[slots], values)


@pytest.mark.parametrize("device", DEVICES)
def test_init_is_independent_of_order_batch_and_capacity(device):
    ids = EXTREME_IDS + list(range(-50, 50, 3))
    rows = []
    for capacity, order in [(64, ids), (1024, ids[::-1]), (256, sorted(ids, key=lambda i: (i * 7919) % 101))]:
        t = make_table(capacity, dim=6, device=device)
        for chunk in (order[:5], order[5:]):  # two batches
            ht.find_or_insert(*t.tensors(), ids_tensor(chunk, device), 0, 0, False, 42, 3, 0.0, 0.1)
        k, w, _, _ = ht.export(*t.tensors(), 0, capacity)
        rows.append(w[k.argsort()])
    assert torch.equal(rows[0], rows[1]) and torch.equal(rows[0], rows[2])


@pytest.mark.parametrize("device", DEVICES)
def test_lru_and_lfu_scores(device):
    t = make_table(64, device=device)
    ht.find_or_insert(*t.tensors(), ids_tensor([1, 2], device), 1, 10)
    slots, _, _ = ht.find_or_insert(*t.tensors(), ids_tensor([2, 3, 3], device), 1, 11)
    s1 = ht.find(t.keys, t.digests, ids_tensor([1], device))
    assert t.scores[s1].tolist() == [10] and t.scores[slots].tolist() == [11, 11, 11]
    ht.find_or_insert(*t.tensors(), ids_tensor([1, 1, 1, 4], device), 2, 99)  # LFU adds, ignores value
    assert t.scores[ht.find(t.keys, t.digests, ids_tensor([1, 4, 2], device))].tolist() == [13, 1, 11]
    ht.find_or_insert(*t.tensors(), ids_tensor([4, 5], device), 0, 99)  # none: leaves, new start at 0
    assert t.scores[ht.find(t.keys, t.digests, ids_tensor([4, 5], device))].tolist() == [1, 0]


def full_one_bucket_table(device, scores):
    """A 32-slot table (one bucket) holding keys 100.. with the given scores."""
    t = make_table(32, device=device)
    ht.insert_or_assign(*t.tensors(), ids_tensor(range(100, 132), device), torch.zeros(32, 4, device=device),
                        score_values=ids_tensor(scores, device))
    return t


@pytest.mark.parametrize("device", DEVICES)
def test_eviction_keeps_high_scores(device):
    scores = [50 + i for i in range(32)]
    scores[7], scores[20], scores[3] = 1, 2, 1
    t = full_one_bucket_table(device, scores)
    # key 107 (score 1, slot 7) is touched by this call: protected; 103 (1) goes, then 120 (2).
    slots, counts, evicted = ht.find_or_insert(*t.tensors(), ids_tensor([500, 107, 501], device), 2, 0, True)
    assert counts.tolist() == [2, 0] and evicted.tolist() == [103, 120]
    assert slots.tolist() == [3, 7, 20]
    k = set(ht.export(*t.tensors(), 0, 32)[0].tolist())
    assert {500, 501, 107} <= k and not {103, 120} & k and len(k) == 32
    # Ties go to the lowest slot.
    t = full_one_bucket_table(device, [5] * 32)
    _, _, evicted = ht.find_or_insert(*t.tensors(), ids_tensor([600, 601], device), 0, 0, True)
    assert evicted.tolist() == [100, 101]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("allow_evict", [False, True])
@pytest.mark.parametrize("op", ["find_or_insert", "insert_or_assign"])
def test_no_room_leaves_table_bit_identical(device, allow_evict, op):
    t = full_one_bucket_table(device, list(range(32)))
    ht.erase(t.keys, t.digests, ids_tensor([110], device))  # one free slot, stale key inside
    before = t.clone()
    # 33 distinct ids: with eviction every candidate is touched before the last one.
    ids = ids_tensor([105] + list(range(1000, 1032)), device)
    if op == "find_or_insert":
        slots, counts, evicted = ht.find_or_insert(*t.tensors(), ids, 1, 5, allow_evict, 3, 2, 0.0, 1.0)
    else:
        values = torch.ones(len(ids), 4, device=device)
        slots, counts, evicted = ht.insert_or_assign(*t.tensors(), ids, values, None, None, 2, 0, allow_evict)
    assert counts[0] == 0 and counts[1] > 0 and evicted.numel() == 0
    assert counts[1] == (1 if allow_evict else 31)
    t.assert_equal(before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["find_or_insert", "insert_or_assign"])
@pytest.mark.parametrize("allow_evict, present, want_counts, want_evicted", [
    (False, [109], [0, 1], []),  # no room
    (True, [109], [1, 0], [104]),  # evicts the lowest-scored untouched key
    (True, list(range(100, 132)), [0, 1], []),  # every candidate touched: no room
])
def test_lone_new_id_in_full_buckets(device, op, allow_evict, present, want_counts, want_evicted):
    # One new id shares its buckets with no other new id of the call, so CUDA knows its
    # outcome before placing anything (hash_table.cu, classify_kernel).
    scores = [50 + i for i in range(32)]
    scores[9], scores[4] = 1, 2
    t = full_one_bucket_table(device, scores)
    before = t.clone()
    ids = ids_tensor(present + [700], device)
    if op == "find_or_insert":
        got = ht.find_or_insert(*t.tensors(), ids, 0, 0, allow_evict)
    else:
        got = ht.insert_or_assign(*t.tensors(), ids, torch.ones(len(ids), 4, device=device), None, None, 0, 0,
                                  allow_evict)
    check_insert_result(got, (None, want_counts, want_evicted))
    if want_counts[1]:
        t.assert_equal(before)
    else:
        assert ht.find(t.keys, t.digests, ids_tensor([700, 104], device)).tolist() == [4, -1]


@pytest.mark.parametrize("device", DEVICES)
def test_eviction_reads_scores_at_any_offset(device):
    """A table whose scores are a view one element into a buffer (not 16-byte aligned)
    evicts as one of its own tensor does (CUDA's evict_kernel reads them one by one instead
    of in 16-byte vectors). Digests must start on 16 bytes on CUDA (a checked rule)."""
    scores = [50 + i for i in range(32)]
    scores[9], scores[4] = 1, 2
    t = full_one_bucket_table(device, scores)
    t.scores = torch.zeros(33, dtype=torch.int64, device=device)[1:].copy_(t.scores)
    assert t.scores.data_ptr() % 16
    got = ht.find_or_insert(*t.tensors(), ids_tensor([109, 700], device), 0, 0, True)
    check_insert_result(got, (None, [1, 0], [104]))  # 109 is touched: the next lowest score goes
    assert ht.find(t.keys, t.digests, ids_tensor([700, 104, 109], device)).tolist() == [4, -1, 9]
    # Two buckets: lone new ids, each one call, evict as on the CPU from both buckets' scores.
    full = filled_table(64, torch.Generator().manual_seed(3), 10_000)
    new_ids = [-1 - i for i in range(8)]
    assert any(probe(i, 2)[0] != probe(i, 2)[1] for i in new_ids)  # some have two buckets
    want = full.clone()
    t = Table(*(x.to(device) for x in full.tensors()))
    t.scores = torch.zeros(65, dtype=torch.int64, device=device)[1:].copy_(t.scores)
    for i in new_ids:
        got = ht.find_or_insert(*t.tensors(), ids_tensor([i], device), 0, 0, True)
        expected = ht.find_or_insert(*want.tensors(), ids_tensor([i]), 0, 0, True)
        assert got[1].tolist() == expected[1].tolist() and got[2].tolist() == expected[2].tolist(), i
    t.assert_equal(want)


@pytest.mark.parametrize("device", DEVICES)
def test_padding_id(device):
    t = make_table(64, device=device)
    ids = ids_tensor([-1, 3, -1, 4], device)
    slots, counts, _ = ht.find_or_insert(*t.tensors(), ids, 2, 0, False, padding_id=-1)
    assert counts.tolist() == [2, 0] and slots[0] == -1 and slots[2] == -1
    assert ht.find(t.keys, t.digests, ids_tensor([-1], device)).tolist() == [-1]
    assert t.scores.sum() == 2


@pytest.mark.parametrize("device", DEVICES)
def test_deterministic(device):
    with deterministic_algorithms():  # CUDA then places conflicting new ids in order
        _check_deterministic(device)


def _check_deterministic(device):
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(-3000, 3000, (2000,), generator=gen) for _ in range(4)]
    results = []
    for _ in range(5):
        t = make_table(2048, dim=8, device=device)
        outs = [ht.find_or_insert(*t.tensors(), b.to(device), 2, 0, True, 7, 3, 0.0, 1.0) for b in batches]
        results.append((t, outs))
    for t, outs in results[1:]:
        t.assert_equal(results[0][0])
        for a, b in zip(outs, results[0][1]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


def _high_load_ids(capacity: int, device) -> torch.Tensor:
    rng = random.Random(1)
    return ids_tensor(list({rng.getrandbits(64) - 2**63 for _ in range(int(capacity * 0.92))}), device)


@pytest.mark.parametrize("device", DEVICES)
def test_high_load_factor(device):
    """Filling a table to 92% in calls of 4096 ids never fails with the CPU's placement (on
    CUDA, deterministic mode: every new id placed in order of first occurrence)."""
    capacity = 1 << 14
    ids = _high_load_ids(capacity, device)
    t = make_table(capacity, dim=2, state=0, device=device)
    with deterministic_algorithms():
        for chunk in ids.split(4096):
            _, counts, _ = ht.find_or_insert(*t.tensors(), chunk)
            assert counts[1] == 0
    slots = ht.find(t.keys, t.digests, ids)
    assert (slots >= 0).all() and torch.equal(t.keys[slots], ids)
    assert int((t.digests != 0).sum()) == len(ids)
    if device == "cuda":
        cpu = make_table(capacity, dim=2, state=0, device="cpu")
        for chunk in ids.cpu().split(4096):
            ht.find_or_insert(*cpu.tensors(), chunk)
        cpu.assert_equal(t)  # in order: the CPU's placement, slot for slot


@pytest.mark.skipif(not torch.cuda.is_available(), reason="racing placement is CUDA's")
def test_high_load_factor_racing_cuda():
    """Racing placement near capacity (more than 256 new ids of a call share buckets): the
    order in which ids take slots is the GPU's, so whether a call finds room for every id
    may differ from the CPU's (two-choice placement depends on the order). What holds: a
    call either places every new id or changes nothing at all, and every placed id is found."""
    capacity = 1 << 14
    ids = _high_load_ids(capacity, "cuda")
    t = make_table(capacity, dim=2, state=0, device="cuda")
    placed = []
    for i, chunk in enumerate(ids.split(4096)):
        before = t.clone()
        _, counts, _ = ht.find_or_insert(*t.tensors(), chunk)
        if counts[1] > 0:
            # Only the last call (75% -> 92% full) may find no room: two 32-slot buckets per
            # id are practically never both full below 75%.
            assert i == 3, f"call {i} (the table at most {(i + 1) * 4096 / capacity:.0%} full) failed"
            assert counts[0] == 0
            t.assert_equal(before)
        else:
            assert counts[0] == len(chunk)
            placed.append(chunk)
    kept = torch.cat(placed)
    slots = ht.find(t.keys, t.digests, kept)
    assert (slots >= 0).all() and torch.equal(t.keys[slots], kept)
    assert int((t.digests != 0).sum()) == len(kept)


@pytest.mark.parametrize("device", DEVICES)
def test_export_in_chunks(device):
    t = make_table(256, device=device)
    ht.find_or_insert(*t.tensors(), ids_tensor(range(-90, 90), device), 1, 3, False, 0, 2, 0.0, 1.0)
    full = ht.export(*t.tensors(), 0, 256)
    parts = [ht.export(*t.tensors(), s, min(s + 48, 256)) for s in range(0, 256, 48)]
    for i in range(4):
        assert torch.equal(full[i], torch.cat([p[i] for p in parts]))
    assert torch.equal(full[0], t.keys[t.digests != 0])
    assert ht.export(*t.tensors(), 256, 256)[0].numel() == 0


# ---- find_or_insert_many: K tables in one op ------------------------------------------------


def many_case(device):
    """Tables that differ in capacity, dim, dtype, state width and policy, with their ids and
    per-table arguments. Between them: known and new ids, duplicates, padding, an empty
    batch, evictions among new ids that share buckets (a full one-bucket table), and a
    table without room (it fails and must stay unchanged while the others insert)."""
    gen = torch.Generator().manual_seed(7)
    tables = [
        make_table(64, dim=4, device=device),
        make_table(256, dim=8, state=0, dtype=torch.float64, device=device),
        full_one_bucket_table(device, list(range(32))),
        make_table(1024, dim=2, state=1, dtype=torch.bfloat16, device=device),
        make_table(32, dim=4, device=device),
        make_table(64, dim=4, device=device),
    ]
    ht.find_or_insert(*tables[0].tensors(), ids_tensor(range(0, 40, 2), device))  # some known ids
    ht.find_or_insert(*tables[4].tensors(), ids_tensor(range(300, 330), device))  # nearly full
    ids = [
        ids_tensor(torch.randint(0, 60, (80,), generator=gen).tolist(), device),
        ids_tensor(torch.randint(-(2**62), 2**62, (150,), generator=gen).tolist() + [7, 7, I64_MIN], device),
        ids_tensor([105, 900, 901, 902, 900, 131], device),  # evicts (allow_evict below)
        ids_tensor([], device),
        ids_tensor(range(500, 520), device),  # 20 new ids, 2 free slots, no eviction: fails
        ids_tensor([3, 3, 3], device),
    ]
    args = dict(
        score_policy=[1, 2, 2, 1, 1, 0], score_value=[5, 0, 0, 7, 2, 0], allow_evict=[False, False, True, False,
        False, False], seed=[1, 2, 3, 4, 5, 6], init_kind=[3, 2, 1, 0, 2, 3], init_a=[0.0, -1.0, 0.5, 0.0, 0.0, 1.0],
        init_b=[1.0, 1.0, 0.0, 0.0, 1.0, 0.1], padding_id=[None, 7, None, None, None, 3],
    )  # fmt: skip
    return tables, ids, args


@pytest.mark.parametrize("device", DEVICES)
def test_find_or_insert_many_equals_separate_calls(device):
    tables, ids, args = many_case(device)
    expected = [t.clone() for t in tables]
    want = [
        ht.find_or_insert(*t.tensors(), i, *(args[k][j] for k in args))
        for j, (t, i) in enumerate(zip(expected, ids))
    ]  # fmt: skip
    slots, counts, evicted = ht.find_or_insert_many([t.tensors() for t in tables], ids, *args.values())
    assert counts.device.type == "cpu"
    assert counts.tolist() == [w[1].tolist() + [w[2].numel()] for w in want]
    assert counts[4, 1] > 0 and counts[2, 2] > 0  # the failing and the evicting table are exercised
    slots = slots.split([i.numel() for i in ids])
    evicted = evicted.split(counts[:, 2].tolist())
    for j, (t, e, w) in enumerate(zip(tables, expected, want)):
        if counts[j, 1] == 0:  # slots are undefined where the table had no room
            assert torch.equal(slots[j].cpu(), w[0].cpu()), f"table {j}"
        assert torch.equal(evicted[j].cpu(), w[2].cpu()), f"table {j}"
        t.assert_equal(e)


def filled_table(capacity: int, gen: torch.Generator, first_id: int) -> Table:
    """A CPU table filled id by id from first_id (no eviction) until it is full or
    two-choice placement finds no room for an id, with random scores."""
    t = make_table(capacity, dim=3)
    next_id = first_id
    while int((t.digests != 0).sum()) < capacity and next_id < first_id + 4 * capacity:
        ht.insert_or_assign(*t.tensors(), ids_tensor([next_id]), torch.zeros(1, 3),
                            score_values=ids_tensor([int(torch.randint(0, 50, (1,), generator=gen))]),
                            allow_evict=False)  # fmt: skip
        next_id += 1
    return t


@pytest.mark.parametrize("device", DEVICES)
def test_failed_evicting_table_beside_an_evicting_one(device):
    """Two full tables evict in one find_or_insert_many call. The first (64 slots, 300 new
    ids) runs out of candidates once each of its 64 slots was taken and must come back
    unchanged with no evicted keys; the second (2048 slots, 300 new ids) evicts and
    succeeds. On CUDA both have more than 256 new ids sharing buckets, so they race through
    evict_kernel, and their outcome is read back after their new rows, slots and scores
    were queued: the failed table's must write nothing, and its evicted keys (listed before
    the failure was known) must not shift the other table's."""
    gen = torch.Generator().manual_seed(5)
    tables = [filled_table(64, gen, 10_000), filled_table(2048, gen, 50_000)]  # no key in both
    assert all(int((t.digests != 0).sum()) >= 0.95 * t.keys.numel() for t in tables)
    ids = [ids_tensor(range(-300, 0)), ids_tensor(range(-900, -600))]
    n = len(tables)
    args = ([1] * n, [60] * n, [True] * n, [3] * n, [2] * n, [-0.5] * n, [0.5] * n, [None] * n)
    before = [t.clone() for t in tables]
    want_counts = ht.find_or_insert_many([t.clone().tensors() for t in tables], ids, *args)[1]  # the CPU's
    assert want_counts[0, 1] > 0 and want_counts[1, 1] == 0 and want_counts[1, 2] > 0  # the case it claims
    on_device = [Table(*(x.to(device) for x in t.tensors())) for t in tables]
    slots, counts, evicted = ht.find_or_insert_many([t.tensors() for t in on_device], [i.to(device) for i in ids],
                                                    *args)  # fmt: skip
    assert counts[:, 0].tolist() == want_counts[:, 0].tolist() and counts[0, 1] > 0 and counts[1, 1] == 0
    on_device[0].assert_equal(before[0])
    assert torch.equal(slots[:300].cpu(), torch.full((300,), -1))
    # Racing ids may take other slots than the CPU's order does, and so evict other keys.
    assert counts[0, 2] == 0 and counts[1, 2] == evicted.numel() > 0
    old = set(before[1].keys[before[1].digests != 0].tolist())
    gone = set(evicted.cpu().tolist())
    assert len(gone) == evicted.numel() and gone <= old  # none of the failed table's keys
    t = on_device[1]
    keys = t.keys.cpu()
    assert set(keys[t.digests.cpu() != 0].tolist()) == (old - gone) | set(ids[1].tolist())
    assert torch.equal(keys[slots[300:].cpu()], ids[1])
    new = slots[300:].cpu()
    assert (t.scores.cpu()[new] == 60).all()  # the call's score (LRU)
    init = ht.initialize(ids[1].to(device), 3, 3, 2, -0.5, 0.5).cpu()  # as the same device computes them
    assert torch.equal(t.weights.cpu()[new], init) and (t.opt_state.cpu()[new] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_evicting_table_between_tables_that_may_evict_but_do_not(device):
    """Three tables that may evict in one find_or_insert_many: the first has room for its
    new ids, the second is full and evicts, the third gets known ids only. On CUDA the
    evicted keys' memory is taken for all three before the first read-back, and only the
    second's are listed, at the start of the list: they must be the CPU's keys, and the
    other two tables must report none. Few new ids, so the CUDA insert places them in
    order, as the CPU does."""
    gen = torch.Generator().manual_seed(11)
    roomy, full, known = make_table(1024, dim=3), filled_table(64, gen, 70_000), make_table(256, dim=3)
    ht.find_or_insert(*roomy.tensors(), ids_tensor(range(0, 200, 5)))
    ht.find_or_insert(*known.tensors(), ids_tensor(range(40)))
    ids = [ids_tensor(list(range(1, 60, 3)) + [5, 10]), ids_tensor(range(-20, 0)), ids_tensor(range(0, 40, 2))]
    n = len(ids)
    args = ([1] * n, [60] * n, [True] * n, [3] * n, [2] * n, [-0.5] * n, [0.5] * n, [None] * n)
    cpu = [t.clone() for t in (roomy, full, known)]
    want_slots, want_counts, want_evicted = ht.find_or_insert_many([t.tensors() for t in cpu], ids, *args)
    assert want_counts[:, 2].tolist() == [0, 20, 0] and want_counts[:, 1].tolist() == [0, 0, 0]  # the case
    on_device = [Table(*(x.to(device) for x in t.tensors())) for t in (roomy, full, known)]
    slots, counts, evicted = ht.find_or_insert_many([t.tensors() for t in on_device], [i.to(device) for i in ids],
                                                    *args)  # fmt: skip
    assert counts.tolist() == want_counts.tolist()
    assert torch.equal(slots.cpu(), want_slots) and torch.equal(evicted.cpu(), want_evicted)
    for got, want in zip(on_device, cpu):
        live = want.digests != 0
        assert torch.equal(got.digests.cpu(), want.digests) and torch.equal(got.keys.cpu()[live], want.keys[live])
        assert torch.equal(got.scores.cpu()[live], want.scores[live])


@pytest.mark.parametrize("device", DEVICES)
def test_find_or_insert_many_places_conflicting_ids_of_many_tables_like_the_cpu(device):
    """40 small tables (two buckets each), every one with new ids that share buckets, the
    first ten also at max capacity and evicting: one call places the conflicted ids of all
    tables in order of first occurrence (on CUDA one sort and one launch for all of them),
    so slots, evicted keys and every table's state equal the CPU kernel's, table by table.
    More tables than one launch group of any per-launch limit, some with no ids."""
    gen = torch.Generator().manual_seed(21)
    names = ("score_policy", "score_value", "allow_evict", "seed", "init_kind", "init_a", "init_b", "padding_id")
    tables, ids, args = [], [], {name: [] for name in names}
    for j in range(40):
        evicting = j < 10
        t = make_table(32 if evicting else 64, dim=3, device="cpu")
        if evicting:  # full: every new id evicts
            ht.insert_or_assign(*t.tensors(), ids_tensor(range(1000, 1032)), torch.zeros(32, 3),
                                score_values=ids_tensor(torch.randint(0, 50, (32,), generator=gen).tolist()))
        tables.append(t)
        n = 0 if j % 13 == 12 else int(torch.randint(5, 20 if evicting else 40, (1,), generator=gen))
        ids.append(ids_tensor(torch.randint(-500, 500, (n,), generator=gen).tolist()))
        for name, v in zip(names, (1 + j % 2, j + 1, evicting, j, 2, -0.5, 0.5, None)):
            args[name].append(v)
    want_tables = [t.clone() for t in tables]
    want = ht.find_or_insert_many([t.tensors() for t in want_tables], ids, *args.values())
    got_tables = [Table(*(x.to(device) for x in t.tensors())) for t in tables]
    got = ht.find_or_insert_many([t.tensors() for t in got_tables], [i.to(device) for i in ids], *args.values())
    assert got[1].tolist() == want[1].tolist()
    assert want[1][:10, 2].sum() > 0 and want[1][:, 1].sum() == 0  # evictions, and no table without room
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[2].cpu(), want[2])
    for j, (g, w) in enumerate(zip(got_tables, want_tables)):
        g.assert_equal(w)


@pytest.mark.parametrize("device", DEVICES)
def test_find_or_insert_many_bad_input_changes_no_table(device):
    tables, ids, args = many_case(device)
    before = [t.clone() for t in tables]
    bad = list(ids)
    bad[3] = bad[3].float()
    with pytest.raises(RuntimeError, match=r"find_or_insert_many \(table 3\).*ids"):
        ht.find_or_insert_many([t.tensors() for t in tables], bad, *args.values())
    with pytest.raises(ValueError, match="table 1 appears twice"):
        ht.find_or_insert_many([tables[0].tensors()] * 2, ids[:2], *(v[:2] for v in args.values()))
    short = dict(args, seed=args["seed"][:-1])
    with pytest.raises(ValueError, match="keys has 6 but seed has 5"):
        ht.find_or_insert_many([t.tensors() for t in tables], ids, *short.values())
    for t, b in zip(tables, before):
        t.assert_equal(b)
    slots, counts, evicted = ht.find_or_insert_many([], [], [], [], [], [], [], [], [], [])
    assert slots.numel() == 0 and evicted.numel() == 0 and counts.shape == (0, 3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_flag", [False, True], ids=["no bad_input", "bad_input False"])
def test_find_or_insert_many_opcheck(device, with_flag):
    tables, ids, args = many_case(device)
    keep = [0, 1, 2, 5]  # the failing table's slots are undefined: opcheck compares outputs of two runs
    cols = [[tables[k].tensors()[c] for k in keep] for c in range(5)]
    per_table = [[v[k] for k in keep] for v in args.values()]
    extra = (torch.zeros(1, dtype=torch.bool, device=device),) if with_flag else ()
    torch.library.opcheck(torch.ops.veloce.find_or_insert_many.default,
                          (*cols, [ids[k] for k in keep], *per_table, *extra))  # fmt: skip


# ---- bad_input: the caller's device-side input check, read with the op's first read-back ----


def flag(value: bool, device, shape=()) -> torch.Tensor:
    return torch.full(shape, value, dtype=torch.bool, device=device)


def fi_case(device):
    """A table with known ids and LFU scores, and ids that mix known, new, duplicate and
    padding positions (a call changes keys, digests, scores, weights and opt_state)."""
    t = make_table(64, device=device)
    ht.find_or_insert(*t.tensors(), ids_tensor(range(10), device), 2, 0, False, 1, 2, -1.0, 1.0)
    args = {"score_policy": 2, "score_value": 0, "allow_evict": False, "seed": 1, "init_kind": 2,
            "init_a": -1.0, "init_b": 1.0, "padding_id": 4}  # fmt: skip
    return t, ids_tensor([3, 4, 20, 21, 3, 20, 9], device), args


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(), (1,)], ids=["0-dim", "(1,)"])
def test_bad_input_false_changes_no_result(device, shape):
    """An unset flag (0-dim or one element) gives what the call without it gives."""
    t, ids, args = fi_case(device)
    u = t.clone()
    want = ht.find_or_insert(*t.tensors(), ids, **args)
    got = ht.find_or_insert(*u.tensors(), ids, **args, bad_input=flag(False, device, shape))
    for w, g in zip(want, got):
        assert torch.equal(w.cpu(), g.cpu())
    u.assert_equal(t)
    tables, many_ids, many_args = many_case(device)
    copies = [x.clone() for x in tables]
    want = ht.find_or_insert_many([x.tensors() for x in tables], many_ids, *many_args.values())
    got = ht.find_or_insert_many([x.tensors() for x in copies], many_ids, *many_args.values(),
                                 bad_input=flag(False, device, shape))  # fmt: skip
    assert torch.equal(want[1], got[1]) and torch.equal(want[2].cpu(), got[2].cpu())
    keep = torch.cat([torch.full((i.numel(),), bool(c == 0)) for i, c in zip(many_ids, want[1][:, 1])])
    assert torch.equal(want[0].cpu()[keep], got[0].cpu()[keep])  # a failing table's slots are undefined
    for x, y in zip(copies, tables):
        x.assert_equal(y)


BAD_INPUT_SET = r"bad_input is set: the caller's check of this call's input failed; nothing was inserted"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("empty", [False, True], ids=["ids", "no ids"])
def test_bad_input_true_refuses_find_or_insert(device, empty):
    """A set flag raises ValueError before the table changes: no insert, no score update
    (LFU would count every position), whether or not there are ids to probe."""
    t, ids, args = fi_case(device)
    ids = ids[:0] if empty else ids
    before = t.clone()
    with pytest.raises(ValueError, match="veloce::find_or_insert: " + BAD_INPUT_SET):
        ht.find_or_insert(*t.tensors(), ids, **args, bad_input=flag(True, device, (1,)))
    t.assert_equal(before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("empty", [False, True], ids=["ids", "no ids"])
def test_bad_input_true_refuses_find_or_insert_many(device, empty):
    """One flag covers every table of the call: none changes (the evicting one, the one
    without room and the ones that would insert included)."""
    tables, ids, args = many_case(device)
    ids = [i[:0] for i in ids] if empty else ids
    before = [t.clone() for t in tables]
    with pytest.raises(ValueError, match="veloce::find_or_insert_many: " + BAD_INPUT_SET):
        ht.find_or_insert_many(
            [t.tensors() for t in tables], ids, *args.values(), bad_input=flag(True, device)
        )
    for t, b in zip(tables, before):
        t.assert_equal(b)


def _other_device(device) -> str:
    """A device bad_input must not be on, next to a table on `device` (meta: the fake kernel
    checks it, as it does for ids on meta)."""
    return "meta" if device == "cpu" else "cpu"


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_of_the_wrong_kind_is_refused(device):
    """A flag of the wrong dtype, size or device: a clear error naming bad_input, table unchanged."""
    t, ids, args = fi_case(device)
    before = t.clone()
    other = _other_device(device)
    cases = [
        (torch.zeros(1, dtype=torch.int64, device=device), r"bad_input must be a bool tensor of one element, got torch.int64 of shape \[1\]"),
        (torch.zeros(1, dtype=torch.uint8, device=device), r"bad_input must be a bool tensor of one element, got torch.uint8 of shape \[1\]"),
        (flag(False, device, (2,)), r"bad_input must be a bool tensor of one element, got torch.bool of shape \[2\]"),
        (flag(False, device, (0,)), r"bad_input must be a bool tensor of one element, got torch.bool of shape \[0\]"),
        (
            flag(False, device, (1, 1, 2)),
            r"bad_input must be a bool tensor of one element, got torch.bool of shape \[1, 1, 2\]",
        ),
        (flag(False, other), f"bad_input is on {other} but keys is on {device}"),
    ]
    for bad, match in cases:
        with pytest.raises(RuntimeError, match="veloce::find_or_insert: " + match):
            ht.find_or_insert(*t.tensors(), ids, **args, bad_input=bad)
    t.assert_equal(before)
    tables, many_ids, many_args = many_case(device)
    before = [x.clone() for x in tables]
    for bad, match in cases:
        with pytest.raises(RuntimeError, match="veloce::find_or_insert_many: " + match):
            ht.find_or_insert_many(
                [x.tensors() for x in tables], many_ids, *many_args.values(), bad_input=bad
            )
    with pytest.raises(ValueError, match="find_or_insert_many: bad_input was given but there are no tables"):
        ht.find_or_insert_many([], [], [], [], [], [], [], [], [], [], bad_input=flag(False, device))
    for x, b in zip(tables, before):
        x.assert_equal(b)


@pytest.mark.skipif(not torch.cuda.is_available() or not veloce.ops.extension.has_cuda_kernels(), reason="needs a GPU")
def test_bad_input_on_cuda_beside_a_cpu_table_is_refused():
    """A CUDA flag dispatches to the CUDA kernel: its error names bad_input, not the table."""
    t, ids, args = fi_case("cpu")
    cuda_flag = flag(False, "cuda")
    with pytest.raises(RuntimeError, match="::find_or_insert: bad_input is on cuda:0 but keys is on cpu"):
        ht.find_or_insert(*t.tensors(), ids, **args, bad_input=cuda_flag)
    with pytest.raises(RuntimeError, match="find_or_insert_many: bad_input is on cuda:0 but keys is on cpu"):
        ht.find_or_insert_many([t.tensors()], [ids], *([v] for v in args.values()), bad_input=cuda_flag)


def may_run_out_of_room(t: Table, ids: torch.Tensor) -> bool:
    """The CUDA insert's rule for a second host sync, from the reference hash: whether some
    new id of `ids` shares a bucket with another new id (conflicted) while each of its two
    buckets has fewer empty slots than new ids that may take them."""
    nb = t.keys.numel() // 32
    keys, digests = t.keys.tolist(), t.digests.tolist()
    present = {k for k, d in zip(keys, digests) if d}
    new = [i for i in dict.fromkeys(ids.tolist()) if i not in present]
    use: dict[int, int] = {}
    pairs = []
    for i in new:
        a, b, _ = probe(i, nb)
        pairs.append((a, b))
        for k in {a, b}:
            use[k] = use.get(k, 0) + 1

    def free(k):
        return digests[k * 32 : k * 32 + 32].count(0)

    return any((use[a] > 1 or use[b] > 1) and free(a) < use[a] and free(b) < use[b] for a, b in pairs)


def nearly_full_table(capacity: int) -> Table:
    """A CPU table filled in chunks of 64 ids until a chunk no longer fits (a failing insert
    leaves the table unchanged)."""
    t = make_table(capacity)
    for start in range(0, capacity, 64):
        _, counts, _ = ht.find_or_insert(*t.tensors(), ids_tensor(range(start, start + 64)), 0, 0, False, 0, 0, 0.0, 0.0)
        if counts[1] > 0:
            return t
    raise AssertionError("the table never filled up")


@pytest.mark.skipif(not torch.cuda.is_available() or not veloce.ops.extension.has_cuda_kernels(), reason="needs a GPU")
@pytest.mark.parametrize("case", ["known", "alone", "shared", "nearly full"])
@pytest.mark.parametrize("with_flag", [False, True], ids=["no bad_input", "bad_input False"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["racing", "in order"])
def test_find_or_insert_many_syncs_once_per_stage_on_cuda(case, with_flag, deterministic, capfd):
    """Eight tables cost the host syncs of one: 1 (no new ids; new ids alone in their buckets;
    new ids sharing buckets with room for all of them), 2 only when new ids that share
    buckets may fill both of theirs (the sync debug mode reports each device-to-host read on
    stderr). An unset bad_input flag rides on the first and adds none. Either way the
    outcome equals the CPU kernel's from the same tables: counts and the ids present, and
    in deterministic mode (new ids sharing buckets placed in order) every count, slot and
    evicted key; racing, the inserted counts, which tables fail, and the keys present."""
    if case == "nearly full":
        tables = [nearly_full_table(4096) for _ in range(8)]
        ids = [ids_tensor(range(100_000 + 1000 * k, 100_300 + 1000 * k)) for k in range(8)]
    else:
        tables = [make_table(4096) for _ in range(8)]
        for t in tables:
            ht.find_or_insert(*t.tensors(), ids_tensor(range(1000)), 1, 3, False, 0, 0, 0.0, 0.0)
        if case == "known":
            ids = [ids_tensor(range(k * 100, k * 100 + 300)) for k in range(8)]
        elif case == "alone":
            ids = [ids_tensor([10_000 + k]) for k in range(8)]
        else:  # 600 new ids in 128 buckets, about 24 empty slots each: more than 256 race
            ids = [ids_tensor(range(20_000 + 1000 * k, 20_600 + 1000 * k)) for k in range(8)]
    short = [may_run_out_of_room(t, i) for t, i in zip(tables, ids)]
    assert any(short) == (case == "nearly full")  # each case is what it claims to be
    on_cpu = [t.clone() for t in tables]
    tables = [Table(*(x.cuda() for x in t.tensors())) for t in tables]
    n = len(tables)
    evicting = [k % 2 == 1 for k in range(n)]  # nearly full: the odd tables evict, the even ones fail
    args = ([1] * n, [3] * n, evicting, [0] * n, [0] * n, [0.0] * n, [0.0] * n, [None] * n)
    bad_input = torch.zeros((), dtype=torch.bool, device="cuda") if with_flag else None
    on_device = [i.cuda() for i in ids]  # copied before the count starts
    (slots, counts, evicted), syncs = counting_syncs(
        lambda: ht.find_or_insert_many([t.tensors() for t in tables], on_device, *args, bad_input=bad_input),
        capfd, deterministic,
    )
    assert syncs == 1 + any(short)
    before = [set(c.keys[c.digests != 0].tolist()) for c in on_cpu]
    want_slots, want_counts, want_evicted = ht.find_or_insert_many([t.tensors() for t in on_cpu], ids, *args)
    # Inserted, and whether the table failed: near capacity, racing ids may use the empty
    # slots otherwise than the CPU's order does, and so fail in other numbers.
    assert torch.equal(counts[:, 0], want_counts[:, 0]) and torch.equal(counts[:, 1] > 0, want_counts[:, 1] > 0)
    assert bool((counts[:, 0] > 0).any()) == (case != "known")
    if case == "nearly full":  # both outcomes of the second sync: failures and evictions
        assert bool((counts[0::2, 1] > 0).all()) and bool((counts[1::2, 2] > 0).all())
    sizes = [len(i) for i in ids]
    if deterministic:
        for t, c in zip(tables, on_cpu):
            t.assert_equal(c)
        assert torch.equal(counts, want_counts)
        assert torch.equal(slots.cpu(), want_slots) and torch.equal(evicted.cpu(), want_evicted)
        return
    # Racing ids may take other slots than the CPU's, and so evict other keys: a failed
    # table unchanged, else each position's slot holding its id and the keys present those
    # before, less the evicted ones, plus the call's ids.
    for k, (t, c, old) in enumerate(zip(tables, on_cpu, before)):
        keys, digests = t.keys.cpu(), t.digests.cpu()
        gone = set(evicted.cpu().split(counts[:, 2].tolist())[k].tolist())
        if counts[k, 1] > 0:
            t.assert_equal(c)
            continue
        assert len(gone) == counts[k, 2] and gone <= old
        assert set(keys[digests != 0].tolist()) == (old - gone) | set(ids[k].tolist())
        assert torch.equal(keys[slots.cpu().split(sizes)[k]], ids[k])


def decided_case(nb: int = 1024) -> tuple[Table, list[int], list[int], list[int]]:
    """A table whose insert the CUDA kernel settles at its first sync although new ids share
    buckets: buckets 0 to nb/2 - 1 full, the others half full, scores 0-2 (ties). Returns
    (table, alone, shared, touched): 155 new ids alone in full buckets (5 of them with both
    buckets the same), which evict (or fail); 600 new ids sharing half-full buckets, none of
    which can run out of room; and keys of the alone ids' buckets, found by the call and so
    not evictable (all of bucket_a for every fourth id: its victim comes from bucket_b)."""
    rng = random.Random(7)
    t = make_table(nb * 32)
    keys, digests, fill = [0] * (nb * 32), [0] * (nb * 32), [0] * nb
    want = [32 if q < nb // 2 else 16 for q in range(nb)]
    left, cand = sum(want), 1
    while left:  # each key in its bucket_a
        a, _, d = probe(cand, nb)
        if fill[a] < want[a]:
            keys[a * 32 + fill[a]], digests[a * 32 + fill[a]] = cand, d
            fill[a] += 1
            left -= 1
        cand += 1
    t.keys.copy_(ids_tensor(keys))
    t.digests.copy_(torch.tensor(digests, dtype=torch.uint8))
    t.scores.copy_(torch.tensor([rng.randrange(3) for _ in range(nb * 32)]))
    alone, used, same = [], set(), 0
    for c in range(10**7, 10**7 + 10**6):
        a, b, _ = probe(c, nb)
        if a >= nb // 2 or b >= nb // 2 or {a, b} & used or (a == b and same == 5) or (a != b and len(alone) - same == 150):
            continue
        alone.append(c)
        used |= {a, b}
        same += a == b
        if len(alone) == 155:
            break
    assert len(alone) == 155
    shared = [c for c in range(2 * 10**7, 2 * 10**7 + 10**5) if min(probe(c, nb)[:2]) >= nb // 2][:600]
    touched = []
    for j, c in enumerate(alone):
        a, b, _ = probe(c, nb)
        bucket = keys[a * 32 : a * 32 + 32]
        touched += bucket if j % 4 == 0 and a != b else rng.sample(bucket, rng.randrange(20))
    return t, alone, shared, touched


@pytest.mark.skipif(not torch.cuda.is_available() or not veloce.ops.extension.has_cuda_kernels(), reason="needs a GPU")
@pytest.mark.parametrize("op", ["find_or_insert", "insert_or_assign"])
@pytest.mark.parametrize("case", ["evict", "no room", "doomed"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["racing", "in order"])
def test_cuda_insert_settled_at_the_first_sync_equals_cpu(op, case, deterministic, capfd):
    """New ids that share buckets with room for all of them beside new ids alone in full
    buckets: one host sync, and the CPU kernel's outcome. With eviction every alone id
    evicts its bucket pair's least-score untouched key (from bucket_b where bucket_a is all
    touched); without, the call fails on them; "doomed": one id finds every candidate
    touched and fails the call. Counts, evicted keys and the alone ids' slots equal the CPU's
    (in deterministic mode every slot and the whole table)."""
    t, alone, shared, touched = decided_case()
    nb = t.keys.numel() // 32
    ids = alone + shared + touched
    random.Random(3).shuffle(ids)
    if case == "doomed":
        a, b, _ = probe(alone[1], nb)
        ids += t.keys[a * 32 : a * 32 + 32].tolist() + t.keys[b * 32 : b * 32 + 32].tolist()
    assert not may_run_out_of_room(t, ids_tensor(ids))
    evict = case != "no room"
    want, want_evicts = {"evict": ([755, 0], 155), "no room": ([0, 155], 0), "doomed": ([0, 1], 0)}[case]

    def call(x: Table, ids_: torch.Tensor):
        if op == "find_or_insert":
            return ht.find_or_insert(*x.tensors(), ids_, 1, 9, evict, 0, 0, 0.0, 0.0)
        values = torch.ones(len(ids_), x.weights.shape[1], device=ids_.device)
        return ht.insert_or_assign(*x.tensors(), ids_, values, None, None, 1, 9, evict)

    cpu = t.clone()
    want_slots, want_counts, want_evicted = call(cpu, ids_tensor(ids))
    assert want_counts.tolist() == want and want_evicted.numel() == want_evicts
    gpu = Table(*(x.cuda() for x in t.tensors()))
    on_device = ids_tensor(ids, "cuda")
    (slots, counts, evicted), syncs = counting_syncs(lambda: call(gpu, on_device), capfd, deterministic)
    assert syncs == 1
    assert counts.tolist() == want and torch.equal(evicted.cpu(), want_evicted)  # the same victims, in order
    if deterministic or counts[1] > 0:  # in order (placed as on the CPU), or failed (unchanged)
        gpu.assert_equal(cpu)
        if counts[1] == 0:
            assert torch.equal(slots.cpu(), want_slots)
        return
    alone_set = set(alone)
    is_alone = torch.tensor([i in alone_set for i in ids])
    assert torch.equal(slots.cpu()[is_alone], want_slots[is_alone])  # unconflicted: placed as on the CPU
    keys, digests = gpu.keys.cpu(), gpu.digests.cpu()
    assert set(keys[digests != 0].tolist()) == set(cpu.keys[cpu.digests != 0].tolist())
    assert torch.equal(keys[slots.cpu()], ids_tensor(ids))


@pytest.mark.skipif(not torch.cuda.is_available() or not veloce.ops.extension.has_cuda_kernels(), reason="needs a GPU")
@pytest.mark.parametrize("empty", [False, True], ids=["ids", "no ids"])
def test_cuda_bad_input_is_read_in_one_sync(empty, capfd):
    """A set flag is read with the miss counts (sync a), or alone when no table has ids:
    one sync, then the error; nothing after it runs."""
    tables = [make_table(4096, device="cuda") for _ in range(3)]
    ids = [ids_tensor([] if empty else range(100 * k, 100 * k + 50), "cuda") for k in range(3)]
    before = [t.clone() for t in tables]
    n = len(tables)
    args = ([2] * n, [0] * n, [False] * n, [0] * n, [0] * n, [0.0] * n, [0.0] * n, [None] * n)
    bad_input = torch.ones((), dtype=torch.bool, device="cuda")

    def both_calls():
        with pytest.raises(ValueError, match="bad_input is set"):
            ht.find_or_insert_many([t.tensors() for t in tables], ids, *args, bad_input=bad_input)
        with pytest.raises(ValueError, match="bad_input is set"):
            ht.find_or_insert(*tables[0].tensors(), ids[0], bad_input=bad_input)

    _, syncs = counting_syncs(both_calls, capfd)
    assert syncs == 2  # one per call
    for t, b in zip(tables, before):
        t.assert_equal(b)


# ---- opcheck ------------------------------------------------------------------------------


def opcheck_samples(device):
    t = full_one_bucket_table(device, list(range(32)))
    ids = ids_tensor([105, 2000, 2001, 105, I64_MIN], device)
    values = torch.randn(5, 4, device=device)
    yield "find", (t.keys, t.digests, ids)
    yield "find_or_insert", (*t.clone().tensors(), ids, 2, 0, True, 1, 2, -1.0, 1.0, 2001)  # evicts
    yield "find_or_insert", (*t.clone().tensors(), ids, 1, 4, False, 1, 3, 0.0, 1.0, None)  # fails
    unset = torch.zeros(1, dtype=torch.bool, device=device)
    yield "find_or_insert", (*t.clone().tensors(), ids, 2, 0, True, 1, 2, -1.0, 1.0, 2001, unset)  # evicts
    yield "insert_or_assign", (*t.clone().tensors(), ids, values, torch.ones(5, 2, device=device),
                               ids_tensor(range(5), device), 0, 0, True)
    yield "erase", (t.keys, t.digests.clone(), ids)
    yield "export", (*t.tensors(), 8, 40 - 8)
    yield "initialize", (ids, 6, 3, 3, 0.0, 1.0, torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for name, args in opcheck_samples(device):
        torch.library.opcheck(getattr(torch.ops.veloce, name).default, args)


# ---- bad input -----------------------------------------------------------------------------


def _fi(t, ids, weights=None, opt_state=None, **kw):
    """find_or_insert on t, optionally with replaced row tensors."""
    args = dict(score_policy=0, score_value=0, allow_evict=False, seed=0, init_kind=0, init_a=0.0, init_b=0.0)
    args.update(kw)
    w = t.weights if weights is None else weights
    s = t.opt_state if opt_state is None else opt_state
    return ht.find_or_insert(t.keys, t.digests, t.scores, w, s, ids, **args)


def _ia(t, n, values_shape=None, dtype=torch.float32, opt_values=None, score_values=None):
    """insert_or_assign of ids 1..n on t."""
    d = t.keys.device
    values = torch.ones(values_shape or (n, 4), dtype=dtype, device=d)
    return ht.insert_or_assign(*t.tensors(), ids_tensor(range(1, n + 1), d), values, opt_values, score_values)


def _one(d):
    return ids_tensor([1], d)


# (name, call(table, device), regex the message must match)
BAD_INPUTS = [
    ("ids float", lambda t, d: _fi(t, torch.ones(3, device=d)),
     r"find_or_insert: ids must be torch.int64, got torch.float32"),
    ("ids 2-D", lambda t, d: _fi(t, torch.ones(2, 2, dtype=torch.long, device=d)), r"ids must be 1-D"),
    ("ids device", lambda t, d: ht.find(t.keys, t.digests, torch.ones(2, dtype=torch.long, device="meta")),
     r"veloce::find: ids is on meta but keys is on"),
    ("find ids int32", lambda t, d: ht.find(t.keys, t.digests, torch.ones(2, dtype=torch.int32, device=d)),
     r"veloce::find: ids must be torch.int64, got torch.int32"),
    ("weights rows", lambda t, d: _fi(t, _one(d), weights=t.weights[:32]),
     r"weights.size\(0\) must equal .*64.*got 32"),
    ("opt_state rows", lambda t, d: _fi(t, _one(d), opt_state=t.opt_state[:5]),
     r"opt_state.size\(0\) must equal"),
    ("opt_state dtype", lambda t, d: _fi(t, _one(d), opt_state=t.opt_state.double()),
     r"opt_state must be torch.float32 .*got torch.float64"),
    ("weights int", lambda t, d: _fi(t, _one(d), weights=t.weights.int()),
     r"weights must be float32, float64, float16 or bfloat16, got torch.int32"),
    ("digests dtype", lambda t, d: ht.find(t.keys, t.digests.int(), _one(d)),
     r"digests must be torch.uint8, got torch.int32"),
    ("capacity", lambda t, d: ht.find(t.keys[:48], t.digests[:48], _one(d)), r"capacity.*got 48"),
    ("score_policy", lambda t, d: _fi(t, _one(d), score_policy=3), r"score_policy must be one of .*got 3"),
    ("init_kind", lambda t, d: _fi(t, _one(d), init_kind=7), r"init_kind must be one of .*got 7"),
    ("uniform bounds", lambda t, d: _fi(t, _one(d), init_kind=2, init_a=1.0, init_b=0.0),
     r"init_a <= init_b"),
    ("values dim", lambda t, d: _ia(t, 2, (2, 3)),
     r"values.size\(1\) must equal the embedding dim .*4.*got 3"),
    ("values rows", lambda t, d: _ia(t, 2, (3, 4)), r"values.size\(0\) must equal the number of ids"),
    ("values dtype", lambda t, d: _ia(t, 1, dtype=torch.float64), r"values must be torch.float32, got torch.float64"),
    ("opt_values width", lambda t, d: _ia(t, 1, opt_values=torch.ones(1, 3, device=d)),
     r"opt_values.size\(1\)"),
    ("score_values dtype", lambda t, d: _ia(t, 1, score_values=torch.ones(1, device=d)),
     r"score_values must be torch.int64, got torch.float32"),
    ("erase ids dtype", lambda t, d: ht.erase(t.keys, t.digests, torch.ones(1, device=d)),
     r"erase: ids must be torch.int64"),
    ("export range", lambda t, d: ht.export(*t.tensors(), 10, 65), r"start <= end <= capacity.*end = 65"),
    ("export reversed", lambda t, d: ht.export(*t.tensors(), 20, 10), r"start = 20, end = 10"),
    ("initialize dim", lambda t, d: ht.initialize(_one(d), -2), r"dim must be >= 0, got -2"),
    ("initialize dtype", lambda t, d: ht.initialize(_one(d), 2, dtype=torch.int32), r"dtype must be"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,call,match", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input(device, name, call, match):
    t = make_table(64, device=device)
    ht.find_or_insert(*t.tensors(), ids_tensor(range(20), device), 2, 0, False, 0, 2, 0.0, 1.0)
    before = t.clone()
    with pytest.raises(RuntimeError, match=match):
        call(t, device)
    t.assert_equal(before)



@pytest.mark.parametrize("device", DEVICES)
def test_resize_whose_rehash_overflows_a_bucket_takes_more_slots_and_keeps_every_entry(device):
    """A rehash that overflows a bucket pair (70 keys whose choices all fall in 2 of the 4
    buckets of a 128-slot table) takes more slots, even at the final size of max_capacity
    (it bounds rows, not slots), and every entry keeps its row."""
    keys = keys_in_buckets_0_and_1(4, 70)
    t = veloce.table.HashTable(4, 2, capacity=1024, device=device)
    slots = t.find_or_insert(torch.tensor(keys, device=device))
    t.weights[slots] += torch.arange(70, dtype=t.weights.dtype, device=device).unsqueeze(1)  # rows of their own
    before, version = t.export(), t.version
    t.max_capacity, t._final_capacity = 100, veloce.table.final_capacity(100)  # as if built with it
    assert t._final_capacity == 128
    t.resize(128)
    assert t.capacity > 128 and t.capacity % 32 == 0 and t.size == 70 and t.version == version + 1
    order = before["keys"].argsort()
    assert torch.equal(t.weights[t.find(before["keys"][order])], before["weights"][order])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_buckets", [1, 3, 5, 40, 1000])
def test_any_number_of_buckets_holds_a_table(device, num_buckets):
    """Tables of any whole number of buckets (a table sized for max_capacity rows is not a
    power of two): ids spread over every bucket, and each is found where it went."""
    cap = 32 * num_buckets
    t = make_table(cap, device=device)
    ids = ids_tensor(range(7, 7 + cap * 3 // 4), device)
    slots, counts, _ = ht.find_or_insert(*t.tensors(), ids)
    assert counts.tolist() == [ids.numel(), 0]
    assert torch.equal(ht.find(t.keys, t.digests, ids), slots)
    used = (slots // 32).unique().numel()
    assert used == num_buckets
    assert sorted(ht.export(*t.tensors(), 0, cap)[0].tolist()) == ids.tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_capacity_of_a_table_is_checked(device):
    t = make_table(96, device=device)
    with pytest.raises(RuntimeError, match="positive multiple of 32, got 95"):
        ht.find(t.keys[:95], t.digests[:95], ids_tensor([1], device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["find_or_insert", "insert_or_assign"])
def test_room_of_zero_makes_every_new_id_evict_though_slots_are_empty(device, op):
    """room=0 (a table at max_capacity rows): each new id evicts the lowest-scored occupied
    row of its buckets that the call did not touch, never an empty slot; a present id stays."""
    t = make_table(64, device=device)
    old = list(range(100, 140))
    ht.insert_or_assign(*t.tensors(), ids_tensor(old, device), torch.zeros(40, 4, device=device), None,
                        ids_tensor(range(40), device))  # scores 0..39
    ref = Ref(t)
    ids = [105, 900, 901, 902]
    if op == "find_or_insert":
        got = ht.find_or_insert(*t.tensors(), ids_tensor(ids, device), 1, 50, True, room=0)
        want = ref.find_or_insert(ids, 1, 50, True, room=0)
    else:
        values = torch.ones(4, 4)
        got = ht.insert_or_assign(*t.tensors(), ids_tensor(ids, device), values.to(device), None, None, 1, 50,
                                  True, 0)
        want = ref.insert_or_assign(ids, values, None, None, 1, 50, True, room=0)
    check_insert_result(got, want)
    assert got[1].tolist() == [3, 0] and got[2].numel() == 3 and 105 not in got[2].tolist()
    assert int((t.digests != 0).sum()) == 40  # as many rows as before
    t.assert_equal(ref.table(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("room", [0, 2, 5])
def test_room_without_eviction_fails_with_the_new_ids_past_it(device, room):
    """Without eviction, a call whose new ids pass its room changes nothing and reports
    new ids - room as failed; one within its room inserts."""
    t = make_table(64, device=device)
    before = t.clone()
    slots, counts, _ = ht.find_or_insert(*t.tensors(), ids_tensor([1, 2, 3, 2, 4, 1], device), room=room)
    if room >= 4:
        assert counts.tolist() == [4, 0]
    else:
        assert counts.tolist() == [0, 4 - room] and slots.tolist() == [-1] * 6
        t.assert_equal(before)


@pytest.mark.parametrize("device", DEVICES)
def test_room_between_zero_and_the_new_ids_fills_empty_slots_first_then_evicts(device):
    """A room of 3 for 6 new ids: the first 3 (in order of first occurrence) take empty
    slots, the last 3 evict, so the table ends as full as the room allows; the many-table
    op keeps each table's room."""
    def table():
        t = make_table(96, device=device)
        ht.insert_or_assign(*t.tensors(), ids_tensor(range(100, 150), device), torch.zeros(50, 4, device=device),
                            None, ids_tensor(range(50), device))
        return t

    t, ref = table(), None
    ref = Ref(t)
    ids = [7, 8, 7, 9, 10, 101, 11, 12]
    got = ht.find_or_insert(*t.tensors(), ids_tensor(ids, device), 1, 60, True, room=3)
    check_insert_result(got, ref.find_or_insert(ids, 1, 60, True, room=3))
    assert got[1].tolist() == [6, 0] and got[2].numel() == 3
    assert int((t.digests != 0).sum()) == 53
    t.assert_equal(ref.table(device))
    a, b = table(), table()
    slots, counts, evicted = ht.find_or_insert_many(
        [a.tensors(), b.tensors()], [ids_tensor(ids, device), ids_tensor(ids, device)], [1, 1], [60, 60],
        [True, True], [0, 0], [0, 0], [0.0, 0.0], [0.0, 0.0], [None, None], room=[3, -1])
    assert counts.tolist() == [[6, 0, 3], [6, 0, 0]]
    a.assert_equal(ref.table(device))
    assert int((b.digests != 0).sum()) == 56


@pytest.mark.parametrize("device", DEVICES)
def test_room_must_be_minus_one_or_more_and_is_refused_with_defer(device):
    t = make_table(64, device=device)
    with pytest.raises(ValueError, match="room must be >= 0"):
        ht.find_or_insert(*t.tensors(), ids_tensor([1], device), room=-2)
    with pytest.raises(ValueError, match="defer=True with room=3"):
        ht.find_or_insert(*t.tensors(), ids_tensor([1], device), defer=True, room=3)
    with pytest.raises(ValueError, match="one value per table"):
        ht.find_or_insert_many([t.tensors()], [ids_tensor([1], device)], [0], [0], [False], [0], [0], [0.0], [0.0],
                               [None], room=[1, 2])


# ---- defer: find_or_insert(_many) with no device read-back ----------------------------------


def _no_evict(args: dict) -> dict:
    return dict(args, allow_evict=[False] * len(args["allow_evict"]))


def assert_same_contents(a: Table, b: Table) -> None:
    """The same entries (keys, rows, state, scores), wherever each key sits: a deferred CUDA
    insert races the new ids that share buckets, which the read-back one may place in order."""
    ea, eb = ht.export(*a.tensors(), 0, a.keys.numel()), ht.export(*b.tensors(), 0, b.keys.numel())
    oa, ob = torch.argsort(ea[0]), torch.argsort(eb[0])
    for x, y in zip(ea, eb):
        assert torch.equal(x[oa].cpu(), y[ob].cpu())


def assert_slots_hold_ids(t: Table, slots: torch.Tensor, ids: torch.Tensor, padding_id=None) -> None:
    """Every position's slot holds its id (padding: -1)."""
    pad = ids == padding_id if padding_id is not None else torch.zeros_like(ids, dtype=torch.bool)
    assert torch.equal(slots[pad].cpu(), torch.full((int(pad.sum()),), -1))
    assert torch.equal(t.keys[slots[~pad]].cpu(), ids[~pad].cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_deferred_find_or_insert_many_equals_the_read_back_one(device):
    """defer=True: the same tables, slots that hold the same ids and the same counts (on the
    tables' device), a table without room unchanged with every slot -1, the others inserted."""
    tables, ids, args = many_case(device)
    args = _no_evict(args)  # the full one-bucket table (2) now fails too
    expected = [t.clone() for t in tables]
    _, want_counts, _ = ht.find_or_insert_many([t.tensors() for t in expected], ids, *args.values())
    slots, counts, evicted = ht.find_or_insert_many([t.tensors() for t in tables], ids, *args.values(), defer=True)
    assert counts.device == tables[0].keys.device and evicted.numel() == 0
    counts = counts.cpu()
    assert torch.equal(counts[:, 0], want_counts[:, 0]) and counts[:, 2].tolist() == [0] * len(ids)
    assert torch.equal(counts[:, 1] > 0, want_counts[:, 1] > 0) and counts[2, 1] > 0 and counts[4, 1] > 0
    for j, (t, e, s, i) in enumerate(zip(tables, expected, slots.split([i.numel() for i in ids]), ids)):
        assert_same_contents(t, e)
        if counts[j, 1] > 0:
            t.assert_equal(e)
            assert s.tolist() == [-1] * i.numel(), f"table {j}"
        else:
            assert_slots_hold_ids(t, s, i, args["padding_id"][j])


@pytest.mark.parametrize("device", DEVICES)
def test_deferred_find_or_insert_equals_the_read_back_one(device):
    t, ids, args = fi_case(device)
    e = t.clone()
    want = ht.find_or_insert(*e.tensors(), ids, **args)
    slots, counts, evicted = ht.find_or_insert(*t.tensors(), ids, **args, defer=True)
    assert counts.device == t.keys.device and counts.tolist() == want[1].tolist() == [2, 0]
    assert evicted.numel() == 0
    assert_same_contents(t, e)
    assert_slots_hold_ids(t, slots, ids, args["padding_id"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("present, new", [
    ([109], [700]),  # one new id, alone in full buckets: the call claims nothing
    ([105], list(range(1000, 1032))),  # 32 new ids for one free slot: they race (CUDA), one claims, all roll back
], ids=["decided", "raced"])  # fmt: skip
def test_deferred_insert_without_room_changes_nothing(device, present, new):
    t = full_one_bucket_table(device, list(range(32)))
    ht.erase(t.keys, t.digests, ids_tensor([110], device))  # one free slot, a stale key in it
    if len(new) == 1:
        ht.find_or_insert(*t.tensors(), ids_tensor([110], device))  # full again
    before = t.clone()
    ids = ids_tensor(present + new, device)
    slots, counts, evicted = ht.find_or_insert(*t.tensors(), ids, 1, 5, False, 3, 2, 0.0, 1.0, defer=True)
    assert counts[0] == 0 and counts[1] > 0 and evicted.numel() == 0
    assert slots.tolist() == [-1] * len(ids)
    t.assert_equal(before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("empty", [False, True], ids=["ids", "no ids"])
def test_deferred_insert_reports_a_set_bad_input_and_changes_nothing(device, empty):
    t, ids, args = fi_case(device)
    ids = ids[:0] if empty else ids
    before = t.clone()
    slots, counts, _ = ht.find_or_insert(*t.tensors(), ids, **args, bad_input=flag(True, device), defer=True)
    assert counts.tolist() == [0, -1] and slots.tolist() == [-1] * ids.numel()
    t.assert_equal(before)
    tables, many_ids, many_args = many_case(device)
    befores = [x.clone() for x in tables]
    slots, counts, _ = ht.find_or_insert_many([x.tensors() for x in tables], many_ids, *_no_evict(many_args).values(),
                                              bad_input=flag(True, device), defer=True)  # fmt: skip
    assert counts.tolist() == [[0, -1, 0]] * len(tables) and set(slots.tolist()) <= {-1}
    for x, b in zip(tables, befores):
        x.assert_equal(b)


@pytest.mark.parametrize("device", DEVICES)
def test_deferred_insert_refuses_eviction(device):
    t, ids, args = fi_case(device)
    before = t.clone()
    with pytest.raises(ValueError, match=r"find_or_insert: defer=True with allow_evict=True"):
        ht.find_or_insert(*t.tensors(), ids, **dict(args, allow_evict=True), defer=True)
    tables, many_ids, many_args = many_case(device)
    with pytest.raises(ValueError, match=r"find_or_insert_many: defer=True with allow_evict=True \(table 2\)"):
        ht.find_or_insert_many([x.tensors() for x in tables], many_ids, *many_args.values(), defer=True)
    t.assert_equal(before)


@pytest.mark.skipif(not torch.cuda.is_available() or not veloce.ops.extension.has_cuda_kernels(), reason="needs a GPU")
def test_deferred_cuda_insert_refuses_deterministic_mode():
    t, ids, args = fi_case("cuda")
    before = t.clone()
    with deterministic_algorithms(True), pytest.raises(ValueError, match="defer=True under torch.use_deterministic"):
        ht.find_or_insert(*t.tensors(), ids, **args, defer=True)
    t.assert_equal(before)


@pytest.mark.skipif(not torch.cuda.is_available() or not veloce.ops.extension.has_cuda_kernels(), reason="needs a GPU")
@pytest.mark.parametrize("with_flag", [False, True], ids=["no bad_input", "bad_input False"])
def test_deferred_cuda_insert_makes_no_host_sync(with_flag, capfd):
    tables, ids, args = many_case("cuda")
    args = _no_evict(args)
    bad = flag(False, "cuda", (1,)) if with_flag else None
    cols = [t.tensors() for t in tables]
    (_, counts, _), syncs = counting_syncs(
        lambda: ht.find_or_insert_many(cols, ids, *args.values(), bad_input=bad, defer=True), capfd
    )
    assert syncs == 0
    fresh = make_table(1024, device="cuda")
    (_, counts1, _), syncs1 = counting_syncs(
        lambda: ht.find_or_insert(*fresh.tensors(), ids_tensor(range(100, 120), "cuda"), bad_input=bad, defer=True),
        capfd,
    )
    assert syncs1 == 0
    assert counts[:, 0].sum() > 0 and counts1.tolist() == [20, 0]


@pytest.mark.parametrize("device", DEVICES)
def test_deferred_insert_of_many_repeats_makes_one_row_per_id(device):
    """Concurrency: 200k positions over 5000 new ids (a tenth of them the same hot id), so
    many blocks insert each id at once: one row each, every position pointing at it."""
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(-(2**40), 2**40, (5000,), generator=gen)[torch.randint(0, 5000, (200_000,), generator=gen)]
    ids[::10] = 77
    ids = ids.to(device)
    t = make_table(16384, device=device)
    slots, counts, _ = ht.find_or_insert(*t.tensors(), ids, 2, 0, False, 1, 2, -1.0, 1.0, defer=True)
    distinct = torch.unique(ids)
    assert counts.tolist() == [distinct.numel(), 0]
    assert_slots_hold_ids(t, slots, ids)
    assert torch.unique(slots).numel() == distinct.numel()
    assert int(t.scores[ht.find(t.keys, t.digests, ids_tensor([77], device))]) == int((ids == 77).sum())  # LFU


def lone_new_ids(t: Table, n: int, start: int) -> list[int]:
    """n ids from ``start`` on (none in ``t``) whose buckets no other id of the list uses: a
    deferred CUDA insert places them as the read-back one does (no two race for a slot)."""
    nb = t.keys.numel() // 32
    used: set[int] = set()
    out = []
    i = start
    while len(out) < n:
        a, b, _ = probe(i, nb)
        if not {a, b} & used:
            out.append(i)
            used |= {a, b}
        i += 1
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_deferred_insert_opcheck(device):
    """opcheck compares the outputs of several runs: new ids alone in their buckets, so that
    racing placement (CUDA) puts them in the same slots every run."""
    args = {"score_policy": 2, "score_value": 0, "allow_evict": False, "seed": 1, "init_kind": 2,
            "init_a": -1.0, "init_b": 1.0, "padding_id": 4}  # fmt: skip
    tables, ids = [], []
    for k, (dim, dtype) in enumerate([(4, torch.float32), (8, torch.float64), (2, torch.bfloat16)]):
        t = make_table(2048, dim=dim, dtype=dtype, device=device)
        ht.find_or_insert(*t.tensors(), ids_tensor(range(10), device))
        new = lone_new_ids(t, 6, 1000 * (k + 1))
        tables.append(t)
        ids.append(ids_tensor([3, 4] + new + [new[0], 9], device))
    torch.library.opcheck(torch.ops.veloce.find_or_insert.default,
                          (*tables[0].tensors(), ids[0], *args.values(), flag(False, device, (1,)), True))  # fmt: skip
    cols = [[t.tensors()[c] for t in tables] for c in range(5)]
    torch.library.opcheck(torch.ops.veloce.find_or_insert_many.default,
                          (*cols, ids, *([v] * len(tables) for v in args.values()), None, True))  # fmt: skip
