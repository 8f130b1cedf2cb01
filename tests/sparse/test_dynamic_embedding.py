"""DynamicEmbedding against nn.EmbeddingBag + torch optimizers, and the table's contract."""

from __future__ import annotations

import copy
import functools
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import veloce
from conftest import DEVICES, counting_syncs, deterministic_algorithms, keys_in_buckets_0_and_1, ref_init_rows

I64_MIN, I64_MAX = -(2**63), 2**63 - 1
EXTREME = [I64_MIN, I64_MAX, -1, 0, 1, 2**31, -(2**31), 2**62]
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def snapshot(emb: veloce.DynamicEmbedding) -> dict:
    """Everything observable about a table, for 'unchanged' checks."""
    out = {k: v.clone() for k, v in emb.export().items()}
    out["len"] = len(emb)
    out["capacity"] = emb.capacity
    return out


def assert_same_snapshot(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def sorted_table(emb):
    e = emb.export()
    order = torch.argsort(e["keys"])
    return {k: (v[order] if v.dim() else v) for k, v in e.items()}


ids_st = st.lists(st.one_of(st.sampled_from(EXTREME), st.integers(-50, 50), st.integers(I64_MIN, I64_MAX)), max_size=40)


@st.composite
def bag_batches(draw):
    ids = draw(ids_st)
    n = len(ids)
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=8)))
    offsets = [0] + cuts
    return ids, offsets


# ---- forward ----------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@SETTINGS
@given(
    batch=bag_batches(),
    dim=st.sampled_from([1, 4, 16, 33]),
    mode=st.sampled_from(["sum", "mean"]),
    use_psw=st.booleans(),
    use_pad=st.booleans(),
    ilo=st.booleans(),
)
def test_forward_matches_embedding_bag(device, batch, dim, mode, use_psw, use_pad, ilo):
    ids, offsets = batch
    use_psw = use_psw and mode == "sum"
    pad = (ids[0] if ids else 7) if use_pad else None
    init = veloce.init.uniform(-1, 1)
    emb = veloce.DynamicEmbedding(dim, mode=mode, initializer=init, padding_idx=pad, include_last_offset=ilo,
                                  capacity=16, device=device, seed=3)
    if ilo:
        offsets = offsets + [len(ids)]
    ids_t = torch.tensor(ids, dtype=torch.long, device=device)
    off_t = torch.tensor(offsets, dtype=torch.long, device=device)
    psw = torch.rand(len(ids), device=device) if use_psw else None
    out = emb(ids_t, off_t, psw)

    uniq = sorted(set(ids))
    index = {k: i for i, k in enumerate(uniq)}
    w = ref_init_rows(uniq, dim, init, seed=3).to(device) if uniq else torch.zeros(0, dim, device=device)
    w = torch.cat([w, torch.zeros(1, dim, device=device)])  # a row for the padding index if absent
    idx = torch.tensor([index[k] for k in ids], dtype=torch.long, device=device)
    pad_idx = index.get(pad, len(uniq)) if use_pad else None
    ref = F.embedding_bag(idx, w, off_t, mode=mode, per_sample_weights=psw, padding_idx=pad_idx,
                          include_last_offset=ilo)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # training inserts every non-padding id exactly once
    assert len(emb) == len({k for k in ids if k != pad})


@pytest.mark.parametrize("device", DEVICES)
def test_2d_input_and_eval_never_inserts(device):
    emb = veloce.DynamicEmbedding(8, mode="mean", device=device)
    x = torch.tensor([[5, -9, 5], [2**62, I64_MIN, 0]], device=device)
    out = emb(x)
    flat = emb(x.reshape(-1), torch.tensor([0, 3], device=device))
    torch.testing.assert_close(out, flat)
    assert len(emb) == 5
    emb.eval()
    before = snapshot(emb)
    unseen = torch.tensor([[123456789, 5]], device=device)
    got = emb(unseen)
    assert_same_snapshot(before, snapshot(emb))
    init_rows = ref_init_rows([123456789], 8, emb.table.initializer).to(device)
    row5, found = emb.find(torch.tensor([5], device=device))
    assert bool(found.all())
    torch.testing.assert_close(got, (init_rows + row5) / 2)
    emb.unknown = "zeros"
    torch.testing.assert_close(emb(unseen), row5 / 2)


# ---- training vs torch optimizers --------------------------------------------------------
def _torch_reference(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=0.1, eps=1e-10)
    if kind == "adam":
        return torch.optim.SparseAdam(params, lr=0.01, betas=(0.8, 0.95), eps=1e-8)
    raise AssertionError(kind)


OPTS = {
    "sgd": veloce.optim.SGD(lr=0.1),
    "adagrad": veloce.optim.Adagrad(lr=0.1, eps=1e-10),
    "adam": veloce.optim.Adam(lr=0.01, betas=(0.8, 0.95), eps=1e-8),
    "rowwise": veloce.optim.RowWiseAdagrad(lr=0.1, eps=1e-8),
}


def _batches(seed, steps=10, n=60, bags=12, space=200, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(-space, space, (n,), generator=g) * 7919 + 2**40
        cuts = torch.sort(torch.randint(0, n + 1, (bags - 1,), generator=g)).values
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), cuts])
        target = torch.randn(bags, 1, generator=g)
        out.append((ids.to(device), offsets.to(device), target.to(device)))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_name", list(OPTS))
@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("dim", [4, 33])
def test_ten_steps_match_torch(device, opt_name, mode, dim):
    batches = _batches(seed=dim, device=device)
    init = veloce.init.normal(std=0.1)
    emb = veloce.DynamicEmbedding(dim, mode=mode, initializer=init, optimizer=OPTS[opt_name], capacity=32,
                                  device=device)
    all_ids = sorted(set(torch.cat([b[0] for b in batches]).tolist()))
    index = {k: i for i, k in enumerate(all_ids)}
    ref = torch.nn.EmbeddingBag(len(all_ids), dim, mode=mode, sparse=True).to(device)
    with torch.no_grad():
        ref.weight.copy_(ref_init_rows(all_ids, dim, init))
    state = torch.zeros(len(all_ids), device=device)
    topt = None if opt_name == "rowwise" else _torch_reference(opt_name, ref.parameters())
    for ids, offsets, target in batches:
        loss = ((emb(ids, offsets) - target) ** 2).sum()
        loss.backward()
        emb.step()
        emb.zero_grad()
        ridx = torch.tensor([index[k] for k in ids.tolist()], device=device)
        rloss = ((ref(ridx, offsets) - target) ** 2).sum()
        rloss.backward()
        if topt is not None:
            topt.step()
            topt.zero_grad()
        else:  # FBGEMM row-wise Adagrad reference
            g = ref.weight.grad.coalesce()
            rows, vals = g.indices()[0], g.values()
            with torch.no_grad():
                state[rows] += (vals * vals).mean(1)
                ref.weight[rows] -= 0.1 * vals / (state[rows].sqrt() + 1e-8).unsqueeze(1)
            ref.weight.grad = None
    table = sorted_table(emb)
    assert table["keys"].tolist() == all_ids
    torch.testing.assert_close(table["weights"], ref.weight.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_gradient_accumulation_across_backward_calls(device, mode):
    (ids1, off1, t1), (ids2, off2, t2) = _batches(seed=1, steps=2, device=device)
    pad = int(ids1[0])  # a padding id, present in the first batch
    a = veloce.DynamicEmbedding(8, mode=mode, optimizer=veloce.optim.Adagrad(lr=0.1), device=device,
                                padding_idx=pad)
    b = copy.deepcopy(a)
    # a: two forward/backward passes, one step; b: one pass over both batches at once
    (a(ids1, off1) * t1).sum().backward()
    (a(ids2, off2) * t2).sum().backward()
    a.step()
    ids = torch.cat([ids1, ids2])
    off = torch.cat([off1, off2 + ids1.numel()])
    (b(ids, off) * torch.cat([t1, t2])).sum().backward()
    b.step()
    ta, tb = sorted_table(a), sorted_table(b)
    assert torch.equal(ta["keys"], tb["keys"])
    torch.testing.assert_close(ta["weights"], tb["weights"], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_per_sample_weights_gradient(device):
    emb = veloce.DynamicEmbedding(4, mode="sum", device=device)
    ids = torch.tensor([1, 2, 3, 1], device=device)
    off = torch.tensor([0, 2], device=device)
    psw = torch.rand(4, device=device, requires_grad=True)
    emb(ids, off, psw).sum().backward()
    rows, _ = emb.find(ids)
    torch.testing.assert_close(psw.grad, rows.sum(1))


@pytest.mark.parametrize("device", DEVICES)
def test_combined_optimizer_and_lr_scheduler(device):
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {"emb": veloce.DynamicEmbedding(4, mode="sum", optimizer=veloce.optim.SGD(lr=1.0), device=device,
                                         initializer=veloce.init.zeros()),
         "lin": torch.nn.Linear(4, 1).to(device)}
    )
    opt = veloce.CombinedOptimizer(torch.optim.SGD(model["lin"].parameters(), lr=0.1), model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ids = torch.tensor([[11, 12]], device=device)
    lrs = []
    for _ in range(3):
        before, _ = model["emb"].find(torch.tensor([11], device=device))
        out = model["emb"](ids)
        out.sum().backward()
        opt.step()
        opt.zero_grad()
        after, _ = model["emb"].find(torch.tensor([11], device=device))
        lrs.append(float((before - after)[0, 0]))  # SGD: step = lr * grad (grad = 1)
        sched.step()
    assert lrs == pytest.approx([1.0, 0.5, 0.25])
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.125)


# ---- growth, eviction, determinism ----------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_lookup_many_equals_calling_each_table(device):
    """lookup_many inserts every training table's ids in one op: same outputs, tables and
    gradients as calling the tables one by one, with a table listed twice, a table in
    eval mode, padding, 1-D bags, a table that must grow and one that evicts."""

    def make():
        torch.manual_seed(0)
        return [
            veloce.DynamicEmbedding(4, mode="sum", capacity=16, device=device, padding_idx=5, seed=1),  # grows
            veloce.DynamicEmbedding(8, mode="mean", capacity=64, device=device, seed=2,
                                    optimizer=veloce.optim.Adam(lr=0.1)),  # fmt: skip
            veloce.DynamicEmbedding(4, mode="sum", capacity=32, max_capacity=32, eviction="lru", device=device, seed=3),
            veloce.DynamicEmbedding(3, mode="sum", device=device, seed=4),
        ]

    g = torch.Generator().manual_seed(3)
    steps = []
    for _ in range(3):
        ids0 = torch.randint(0, 40, (12, 4), generator=g).to(device)
        ids1 = torch.randint(-(2**62), 2**62, (30,), generator=g).to(device)
        offsets1 = torch.tensor([0, 3, 3, 10, 29], device=device)
        ids2 = torch.randint(0, 10**6, (10, 2), generator=g).to(device)  # 20 new ids a step in 32 slots: evicts
        ids3 = torch.randint(0, 50, (6, 2), generator=g).to(device)
        steps.append([ids0, (ids1, offsets1), ids2, ids3, ids0[:, :2]])
    results = []
    for grouped in (False, True):
        tables = make()
        tables[3].eval()  # never inserts
        order = [tables[0], tables[1], tables[2], tables[3], tables[0]]  # tables[0] twice
        outs = []
        for inputs in steps:
            if grouped:
                got = veloce.lookup_many(order, inputs)
            else:
                got = [t(*x) if isinstance(x, tuple) else t(x) for t, x in zip(order, inputs)]
            sum((o * (k + 1)).sum() for k, o in enumerate(got[:3] + got[4:])).backward()
            veloce.step_tables(tables[:3])
            outs.append([o.detach().cpu() for o in got])
        results.append((outs, [sorted_table(t) for t in tables], [len(t) for t in tables]))
    (outs_a, tabs_a, lens_a), (outs_b, tabs_b, lens_b) = results
    assert lens_a == lens_b and lens_a[3] == 0 and lens_a[2] == 32 and make()[0].capacity < 64 <= tables[0].capacity
    for a, b in zip(outs_a, outs_b):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    for a, b in zip(tabs_a, tabs_b):
        for k in a:
            assert torch.equal(a[k], b[k]), k
    with pytest.raises(ValueError, match="listed twice"):
        veloce.table.find_or_insert_many([tables[0].table] * 2, [steps[0][0].view(-1)] * 2)


def test_hash_table_bad_input_refuses_before_anything_changes():
    """HashTable.find_or_insert and find_or_insert_many pass bad_input to the op: set, they
    raise and leave every table as it was (its LRU clock included); unset, nothing differs."""
    from veloce.table import HashTable, find_or_insert_many

    def tables():  # the last one holds 30 of 32 slots: it grows before its next insert
        out = [HashTable(4, 0, capacity=c, seed=k) for k, c in enumerate([64, 64, 32])]
        for t, n in zip(out, [10, 10, 30]):
            t.find_or_insert(torch.arange(n))
        return out

    def state(t):
        return [x.clone() for x in t._state()] + [len(t), t.clock, t.capacity, t.version]

    def same(x, y):
        assert all(torch.equal(p, q) if isinstance(p, torch.Tensor) else p == q for p, q in zip(x, y))

    yes, no = torch.tensor(True), torch.tensor([False])
    ids = [torch.arange(5, 20), torch.arange(30, 40), torch.arange(25, 35)]
    ts = tables()
    before = [state(t) for t in ts]
    for call in (lambda: ts[0].find_or_insert(ids[0], bad_input=yes),  # refused by the op
                 lambda: ts[2].find_or_insert(ids[2], bad_input=yes),  # refused before growing
                 lambda: find_or_insert_many(ts, ids, bad_input=yes),
                 lambda: find_or_insert_many(ts[:1], ids[:1], bad_input=yes)):  # fmt: skip
        with pytest.raises(ValueError, match="bad_input is set"):
            call()
        for t, b in zip(ts, before):
            same(state(t), b)
    with pytest.raises(ValueError, match=r"bad_input is on meta but the tables are on cpu; one flag covers"):
        find_or_insert_many(ts, ids, bad_input=torch.tensor(False, device="meta"))
    with pytest.raises(ValueError, match=r"the tables are on no device \(no tables\)"):
        find_or_insert_many([], [], bad_input=no)
    ref = tables()
    got = find_or_insert_many(ts, ids, bad_input=no)
    want = find_or_insert_many(ref, ids)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    for t, r in zip(ts, ref):
        same(state(t), state(r))
    assert ts[2].capacity == 64


def test_growth_from_16_to_200k():
    emb = veloce.DynamicEmbedding(4, mode="sum", capacity=16, initializer=veloce.init.uniform(-1, 1))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(I64_MIN, I64_MAX, (200_000,), generator=g, dtype=torch.long).unique()
    for chunk in ids.split(20_000):
        emb(chunk.view(-1, 1))
    assert len(emb) == ids.numel()
    assert emb.capacity >= ids.numel()
    rows, found = emb.find(ids)
    assert bool(found.all())
    sample = ids[:50]
    torch.testing.assert_close(rows[:50], ref_init_rows(sample.tolist(), 4, emb.table.initializer))


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_eviction_keeps_hot_ids(policy):
    emb = veloce.DynamicEmbedding(4, mode="sum", capacity=1024, max_capacity=1024, eviction=policy)
    hot = torch.arange(100) * 1_000_003
    g = torch.Generator().manual_seed(0)
    for step in range(300):
        cold = torch.randint(2**40, 2**41, (200,), generator=g)
        batch = torch.cat([hot, cold]) if policy == "lru" or step % 2 == 0 else cold
        emb(batch.view(-1, 1))
        assert len(emb) <= 1024
    assert emb.table.num_evicted > 0
    _, found = emb.find(hot)
    assert found.float().mean() >= 0.99
    keys = emb.export()["keys"]
    assert keys.unique().numel() == keys.numel()


@pytest.mark.parametrize("device", DEVICES)
def test_eviction_none_raises_and_leaves_table_unchanged(device):
    """A full table that may not evict raises and stays as it was: entries, size and its
    LRU clock (a state_dict entry), alone or in a grouped lookup, whose other tables keep
    their inserts and clock ticks."""
    emb = veloce.DynamicEmbedding(4, mode="sum", capacity=32, max_capacity=32, eviction="none", device=device)
    emb(torch.arange(20, device=device).view(-1, 1))
    before, clock = snapshot(emb), emb.table.clock
    with pytest.raises(veloce.TableFullError, match="max_capacity 32"):
        emb(torch.arange(100, 200, device=device).view(-1, 1))
    assert_same_snapshot(before, snapshot(emb))
    assert emb.table.clock == clock
    other = veloce.DynamicEmbedding(4, mode="sum", device=device)
    with pytest.raises(veloce.TableFullError, match="max_capacity 32"):
        veloce.lookup_many([other, emb], [(torch.arange(5, device=device).view(-1, 1),),
                                          (torch.arange(100, 200, device=device).view(-1, 1),)])  # fmt: skip
    assert_same_snapshot(before, snapshot(emb))
    assert emb.table.clock == clock
    assert len(other) == 5 and other.table.clock == 1


# ---- max_capacity, reserve and memory per row --------------------------------------------


def _new_ids(start: int, n: int, device) -> torch.Tensor:
    return (torch.arange(start, start + n, device=device) * 7919 + 11).view(-1, 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_max_capacity_1000_holds_at_most_1000_rows(device, policy):
    """A table asked for at most 1,000 rows holds 1,000, not the 1,024 of a power of two:
    it fills to exactly 1,000 without evicting, then each new id evicts one row and the
    table stays at 1,000."""
    emb = veloce.DynamicEmbedding(4, mode="sum", max_capacity=1000, eviction=policy, device=device)
    assert emb.max_capacity == 1000
    for k in range(10):
        emb(_new_ids(100 * k, 100, device))
        assert len(emb) == 100 * (k + 1) and emb.table.num_evicted == 0
    assert emb.capacity <= veloce.table.final_capacity(1000) == 1280
    for k in range(10, 15):
        emb(_new_ids(100 * k, 100, device))
        assert len(emb) == 1000 and emb.table.num_evicted == 100 * (k - 9)
    assert len(emb.export()["keys"]) == 1000


@pytest.mark.parametrize("device", DEVICES)
def test_eviction_none_fills_to_max_capacity_before_raising(device):
    """eviction='none' raises only when the new ids would pass max_capacity: a table of
    max_capacity 1000 takes 1000 rows; a batch that does not fit changes nothing, one that
    fits exactly is taken, and any new id after that raises."""
    emb = veloce.DynamicEmbedding(4, mode="sum", max_capacity=1000, eviction="none", device=device)
    emb(_new_ids(0, 950, device))
    before, clock = sorted_table(emb), emb.table.clock  # (the call may grow the slots first: past grow_at)
    with pytest.raises(veloce.TableFullError, match="holds 950 rows of max_capacity 1000 and 51 new id"):
        emb(torch.cat([_new_ids(900, 100, device), _new_ids(2000, 1, device)]))  # 50 present, 51 new
    after = sorted_table(emb)
    assert all(torch.equal(before[k], after[k]) for k in before) and emb.table.clock == clock
    emb(_new_ids(900, 100, device))  # 50 present, 50 new
    assert len(emb) == 1000
    emb(_new_ids(0, 1000, device))  # every id present: no new row
    with pytest.raises(veloce.TableFullError, match="max_capacity 1000"):
        emb(_new_ids(1000, 1, device))
    assert len(emb) == 1000


@pytest.mark.parametrize("device", DEVICES)
def test_eviction_none_table_whose_bucket_overflows_adds_slots_instead_of_raising(device):
    """Below max_capacity rows, a full bucket pair at the final size adds slots: the rows,
    not the slots, are bounded. (70 ids that all hash into 2 of the 4 buckets of the final
    size of max_capacity 100.)"""
    emb = veloce.DynamicEmbedding(4, mode="sum", max_capacity=100, eviction="none", device=device)
    assert emb.capacity == veloce.table.final_capacity(100) == 128
    emb(torch.tensor(keys_in_buckets_0_and_1(4, 70), device=device).view(-1, 1))
    assert len(emb) == 70 and emb.capacity > 128


@pytest.mark.parametrize("device", DEVICES)
def test_reserve_presizes_in_one_rehash(device):
    """reserve(n) rehashes once; inserting up to n rows after it never grows the table."""
    emb = veloce.DynamicEmbedding(4, mode="sum", device=device)
    emb(_new_ids(0, 10, device))
    version = emb.table.version
    emb.reserve(20_000)
    assert emb.table.version == version + 1 and emb.capacity >= 20_000 / 0.8
    capacity = emb.capacity
    for k in range(10):
        emb(_new_ids(10 + 1999 * k, 1999, device))
    assert len(emb) == 20_000 and emb.capacity == capacity and emb.table.version == version + 1
    emb.reserve(100)  # never shrinks
    assert emb.capacity == capacity and emb.table.version == version + 1


@pytest.mark.parametrize("device", DEVICES)
def test_reserve_up_to_max_capacity_takes_the_final_size_and_more_raises(device):
    emb = veloce.DynamicEmbedding(4, mode="sum", max_capacity=5000, device=device)
    emb.reserve(5000)
    assert emb.capacity == veloce.table.final_capacity(5000)
    emb(_new_ids(0, 5000, device))
    assert len(emb) == 5000 and emb.capacity == veloce.table.final_capacity(5000)
    with pytest.raises(ValueError, match=r"reserve: n \(5001\) is more than max_capacity \(5000\)"):
        emb.reserve(5001)
    with pytest.raises(ValueError, match="reserve: n must be an int >= 0, got -1"):
        emb.reserve(-1)


def _state_bytes(emb: veloce.DynamicEmbedding) -> int:
    return sum(b.numel() * b.element_size() for b in emb.table._buffers.values())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim", [8, 16, 64])
@pytest.mark.parametrize("optimizer", ["SGD", "Adagrad", "Adam"])
def test_memory_per_row_at_max_capacity_is_within_1_5x_of_the_payload(device, dim, optimizer):
    """A table grown from its default capacity to max_capacity rows takes at most 1.5 times
    the bytes of its rows, optimizer state, keys, scores and digests."""
    opt = {"SGD": veloce.optim.SGD(lr=0.1), "Adagrad": veloce.optim.Adagrad(lr=0.1),
           "Adam": veloce.optim.Adam(lr=0.1)}[optimizer]  # fmt: skip
    emb = veloce.DynamicEmbedding(dim, mode="sum", max_capacity=2100, optimizer=opt, device=device)
    emb(_new_ids(0, 2100, device))
    assert len(emb) == 2100
    state = emb.table.state_dim
    payload = 2100 * (dim * 4 + state * 4 + 8 + 8 + 1)
    assert _state_bytes(emb) <= 1.5 * payload


@pytest.mark.parametrize("device", DEVICES)
def test_full_table_checkpoint_loads_into_a_table_of_the_same_max_capacity(device):
    """A table full at max_capacity 1000 (1000 rows exactly) saves and loads into a new table
    of max_capacity 1000, whatever its capacity."""
    emb = veloce.DynamicEmbedding(4, mode="sum", max_capacity=1000, eviction="lru", device=device)
    for k in range(12):
        emb(_new_ids(100 * k, 100, device))
    assert len(emb) == 1000
    for capacity in (32, 1024):
        other = veloce.DynamicEmbedding(4, mode="sum", capacity=capacity, max_capacity=1000, eviction="lru",
                                        device=device)
        other.load_state_dict(emb.state_dict())
        assert len(other) == 1000
        assert torch.equal(sorted_table(other)["weights"], sorted_table(emb)["weights"])
    small = veloce.DynamicEmbedding(4, mode="sum", max_capacity=999, device=device)
    with pytest.raises(Exception, match="1000 entries do not fit max_capacity 999"):
        small.load_state_dict(emb.state_dict())


def test_gradient_of_evicted_row_is_dropped():
    emb = veloce.DynamicEmbedding(4, mode="sum", capacity=32, max_capacity=32, eviction="lru",
                                  optimizer=veloce.optim.SGD(lr=1.0))
    first = torch.arange(32).view(-1, 1)
    out = emb(first)
    out.sum().backward()  # gradients pending for ids 0..31
    emb(torch.arange(1000, 1032).view(-1, 1))  # evicts rows of ids 0..31 (no backward for this one)
    before = sorted_table(emb)
    emb.step()
    after = sorted_table(emb)
    survivors = torch.isin(before["keys"], first.view(-1))
    # rows of new ids are untouched (gradient of old ids never applied to them)
    torch.testing.assert_close(after["weights"][~survivors], before["weights"][~survivors])
    # surviving old ids did get their update
    if bool(survivors.any()):
        torch.testing.assert_close(after["weights"][survivors], before["weights"][survivors] - 1.0)


def test_deterministic_five_runs():
    def run():
        torch.manual_seed(0)
        emb = veloce.DynamicEmbedding(16, mode="mean", capacity=64, optimizer=veloce.optim.Adam(lr=0.01))
        for ids, offsets, target in _batches(seed=5, steps=5, n=500, bags=50, space=10_000):
            ((emb(ids, offsets) - target) ** 2).mean().backward()
            emb.step()
            emb.zero_grad()
        return emb.export()

    runs = [run() for _ in range(5)]
    for other in runs[1:]:
        for k in runs[0]:
            assert torch.equal(runs[0][k], other[k]), k


# ---- state ------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_round_trip_any_size(device):
    src = veloce.DynamicEmbedding(8, mode="sum", capacity=32, optimizer=veloce.optim.Adam(), device=device)
    for ids, offsets, target in _batches(seed=2, steps=3, device=device):
        (src(ids, offsets) * target).sum().backward()
        src.step()
        src.zero_grad()
    dst = veloce.DynamicEmbedding(8, mode="sum", capacity=4096, optimizer=veloce.optim.Adam(), device=device)
    dst.load_state_dict(src.state_dict())
    a, b = sorted_table(src), sorted_table(dst)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # and training continues identically
    for ids, offsets, target in _batches(seed=9, steps=2, device=device):
        for m in (src, dst):
            (m(ids, offsets) * target).sum().backward()
            m.step()
            m.zero_grad()
    a, b = sorted_table(src), sorted_table(dst)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_state_dict_wrong_dim_is_refused():
    src = veloce.DynamicEmbedding(8)
    src(torch.tensor([[1, 2]]))
    dst = veloce.DynamicEmbedding(4)
    with pytest.raises(RuntimeError, match=r"weights must be \(N, 4\)"):
        dst.load_state_dict(src.state_dict())


def _bad_state_dicts(src):
    """(what is wrong, state dict, error pattern): each must be refused with the table unchanged."""
    def edited(**changes):
        sd = src.state_dict()
        sd.update(changes)
        return sd

    sd = src.state_dict()
    return [
        ("step not a scalar", edited(step=torch.tensor([5, 6])), r"step must be an int >= 0"),
        ("fractional step", edited(step=torch.tensor(1.5)), r"step must be an int >= 0"),
        ("negative clock", edited(clock=torch.tensor(-1)), r"clock must be an int >= 0"),
        ("float keys", edited(keys=sd["keys"].double()), r"keys must be an int64 tensor, got torch.float64"),
        ("repeated keys", edited(keys=torch.zeros_like(sd["keys"])), r"keys hold 2 repeated id\(s\) \(id 0 is one\)"),
        ("2-D keys", edited(keys=sd["keys"].view(1, -1)), r"keys must be 1-D"),
        ("integer weights", edited(weights=sd["weights"].long()), r"weights must be a floating-point tensor"),
        ("float scores", edited(scores=sd["scores"].float()), r"scores must be an int64 tensor"),
    ]


@pytest.mark.parametrize("case", range(8))
def test_load_state_dict_refuses_bad_entries_and_changes_nothing(case):
    """Every entry is checked before the table changes: a bad step or clock used to be read
    only after the rows were replaced, float keys were rounded, and repeated keys made a
    table whose len() disagreed with what was loaded."""
    src = veloce.DynamicEmbedding(4, mode="sum", optimizer=veloce.optim.Adam(lr=0.1))
    src(torch.tensor([1, 2, 123456789012345679]), torch.tensor([0])).sum().backward()
    src.step()
    name, sd, pattern = _bad_state_dicts(src)[case]
    dst = veloce.DynamicEmbedding(4, mode="sum", optimizer=veloce.optim.Adam(lr=0.1))
    dst(torch.tensor([7]), torch.tensor([0]))
    before = snapshot(dst)
    with pytest.raises(RuntimeError, match=pattern):
        dst.load_state_dict(sd)
    assert_same_snapshot(before, snapshot(dst))
    assert dst.step_count == 0, name


def test_load_state_dict_strict_reports_unexpected_keys():
    src = veloce.DynamicEmbedding(4)
    src(torch.tensor([[1, 2]]))
    model = nn.ModuleDict({"emb": veloce.DynamicEmbedding(4)})
    sd = {f"emb.{k}": v for k, v in src.state_dict().items()}
    sd["emb.wieghts"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "emb.wieghts"'):
        model.load_state_dict(sd)
    result = model.load_state_dict(sd, strict=False)
    assert result.unexpected_keys == ["emb.wieghts"] and result.missing_keys == []
    assert sorted(model["emb"].export()["keys"].tolist()) == [1, 2]


def test_load_state_dict_forgets_a_backward_before_it():
    """A backward, then a load: the next step() has nothing to apply and counts no step
    (Adam's bias correction would be one step off)."""
    src = veloce.DynamicEmbedding(4, mode="sum", optimizer=veloce.optim.Adam(lr=0.1))
    src(torch.tensor([1]), torch.tensor([0]))
    dst = veloce.DynamicEmbedding(4, mode="sum", optimizer=veloce.optim.Adam(lr=0.1))
    dst(torch.tensor([5]), torch.tensor([0])).sum().backward()
    dst.load_state_dict(src.state_dict())
    dst.step()
    assert dst.step_count == 0
    assert_same_snapshot(snapshot(src), snapshot(dst))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cast", ["half", "bfloat16", "double"])
def test_module_cast_keeps_optimizer_state_dtype(device, cast):
    """.half() / .bfloat16() cast every floating buffer, but 16-bit rows keep their
    optimizer state in float32 (as a table made in that dtype does), unrounded; the cast
    table trains like one made in that dtype from the same rows."""
    def trained(dtype):
        e = veloce.DynamicEmbedding(4, mode="sum", optimizer=veloce.optim.Adam(lr=0.1), dtype=dtype, device=device)
        e(torch.tensor([1, 2, 3], device=device), torch.tensor([0], device=device)).sum().backward()
        e.step()
        return e

    emb = trained(torch.float32)
    state = emb.table.opt_state.clone()
    getattr(emb, cast)()
    dtype = emb.table.weights.dtype
    want = torch.float64 if dtype == torch.float64 else torch.float32
    assert emb.table.opt_state.dtype == want
    assert torch.equal(emb.table.opt_state, state.to(want))
    ref = veloce.DynamicEmbedding(4, mode="sum", optimizer=veloce.optim.Adam(lr=0.1), dtype=dtype, device=device)
    ref.load_state_dict(emb.state_dict())
    for m in (emb, ref):
        m(torch.tensor([1, 2, 4], device=device), torch.tensor([0], device=device)).sum().backward()
        m.step()
    assert_same_snapshot(snapshot(ref), snapshot(emb))


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(max_capacity=0), r"max_capacity must be an int >= 1 or None, got 0"),
    (dict(capacity=2.5), r"capacity must be an int >= 1, got 2.5"),
    (dict(padding_idx=2**64), r"padding_idx must be an int64 id or None, got 18446744073709551616"),
    (dict(padding_idx=True), r"padding_idx must be an int64 id or None, got True"),
    (dict(seed=-(2**63) - 1), r"seed must be an int in the int64 range"),
])  # fmt: skip
def test_constructor_names_the_bad_argument(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        veloce.DynamicEmbedding(4, **kwargs)


@pytest.mark.parametrize("init, dtype, wider", [
    (veloce.init.constant(1e39), torch.float32, torch.float64),
    (veloce.init.uniform(-1e308, 1e308), torch.float64, None),  # b - a is inf even in float64
    (veloce.init.normal(std=1e4), torch.float16, torch.float32),
    (veloce.init.uniform(-1e5, 0.0), torch.float16, torch.bfloat16),
])  # fmt: skip
def test_an_initializer_beyond_the_dtype_is_refused(init, dtype, wider):
    """Its rows would hold inf (the checks of the initializer alone are in float64)."""
    with pytest.raises(ValueError, match=r"makes values beyond .* range"):
        veloce.DynamicEmbedding(4, initializer=init, dtype=dtype)
    if wider is not None:
        emb = veloce.DynamicEmbedding(4, initializer=init, dtype=wider)
        assert torch.isfinite(emb(torch.tensor([[1, 2, 3]]))).all()


def test_constructor_takes_numpy_integers():
    np = pytest.importorskip("numpy")
    emb = veloce.DynamicEmbedding(4, mode="sum", padding_idx=np.int64(3), seed=np.int32(5), capacity=np.int64(64))
    assert emb.padding_idx == 3 and type(emb.padding_idx) is int and emb.table.seed == 5
    out = emb(torch.tensor([3, 1]), torch.tensor([0]))  # the padding id contributes nothing
    assert len(emb) == 1 and torch.equal(out, emb.find(torch.tensor([1]))[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["autograd.grad", "backward(inputs=)"])
def test_a_pass_asked_for_other_gradients_does_not_train_the_table(device, how):
    """torch.autograd.grad(out, psw) and out.backward(inputs=[psw]) leave an
    nn.EmbeddingBag's weight.grad alone; they give the table nothing either, while the
    per-sample weights get their gradient."""
    emb = veloce.DynamicEmbedding(2, mode="sum", optimizer=veloce.optim.SGD(lr=1.0),
                                  initializer=veloce.init.constant(1.0), device=device)  # fmt: skip
    ids, offsets = torch.tensor([1, 2], device=device), torch.tensor([0], device=device)
    w = torch.tensor([1.0, 2.0], device=device, requires_grad=True)
    out = emb(ids, offsets, w)
    if how == "autograd.grad":
        (g,) = torch.autograd.grad(out.sum(), w)
    else:
        out.sum().backward(inputs=[w])
        g = w.grad
    assert g.tolist() == [2.0, 2.0]
    emb.step()
    assert emb.step_count == 0
    assert emb.find(ids)[0].tolist() == [[1.0, 1.0], [1.0, 1.0]]


@pytest.mark.parametrize("device", DEVICES)
def test_autograd_grad_then_backward_trains_the_table_once(device):
    """The gradient of the per-sample weights taken first (torch.autograd.grad, keeping the
    graph), then loss.backward(): the table gets the loss's gradient once (it used to get
    it from both passes), the same as from loss.backward() alone."""
    ids, offsets = torch.tensor([1, 2, 2], device=device), torch.tensor([0, 1], device=device)
    tables = []
    for first in (False, True):
        torch.manual_seed(0)
        emb = veloce.DynamicEmbedding(3, mode="sum", optimizer=veloce.optim.SGD(lr=0.5), device=device)
        lin = nn.Linear(3, 1).to(device)
        w = torch.tensor([1.0, 0.5, 2.0], device=device, requires_grad=True)
        loss = lin(emb(ids, offsets, w)).pow(2).sum()
        if first:
            torch.autograd.grad(loss, w, retain_graph=True)
        loss.backward()
        emb.step()
        tables.append(snapshot(emb))
    assert_same_snapshot(*tables)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", ["raise", "raise_next", "skip"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_per_sample_weight_counts_as_a_nonfinite_gradient(device, policy, bad):
    """A NaN/Inf per-sample weight makes its rows' gradient NaN/Inf even when the pooled
    gradient is finite: "raise" and "raise_next" apply nothing, "skip" drops that bag."""
    emb = veloce.DynamicEmbedding(2, mode="sum", optimizer=veloce.optim.SGD(lr=1.0), nonfinite_grad=policy,
                                  initializer=veloce.init.zeros(), device=device)  # fmt: skip
    ids = torch.tensor([1, 2, 3, 4], device=device)
    offsets = torch.tensor([0, 2], device=device)
    w = torch.tensor([1.0, bad, 1.0, 2.0], device=device)
    torch.nan_to_num(emb(ids, offsets, w)).sum().backward()
    before = snapshot(emb)
    if policy == "raise":
        with pytest.raises(FloatingPointError, match="1 bag"):
            emb.step()
        assert_same_snapshot(before, snapshot(emb))
        return
    emb.step()
    if policy == "raise_next":
        with pytest.raises(FloatingPointError, match="NaN or Inf"):
            emb.step()
        assert_same_snapshot(before, snapshot(emb))
        return
    assert emb.find(ids)[0][:, 0].tolist() == [0.0, 0.0, -1.0, -2.0]


def test_nonfinite_gradient_policy():
    emb = veloce.DynamicEmbedding(4, mode="sum", optimizer=veloce.optim.SGD(lr=1.0))
    ids = torch.tensor([[1, 2]])
    (emb(ids) * float("nan")).sum().backward()
    before = snapshot(emb)
    with pytest.raises(FloatingPointError, match="NaN or Inf"):
        emb.step()
    assert_same_snapshot(before, snapshot(emb))
    emb.zero_grad()
    emb.nonfinite_grad = "skip"
    (emb(ids) * float("inf")).sum().backward()
    emb.step()
    assert torch.isfinite(emb.export()["weights"]).all()


def test_nonfinite_gradient_in_one_table_applies_no_table():
    """CombinedOptimizer steps every table with one finiteness read-back: a NaN gradient in
    the second table raises before the first (finite) one is applied."""
    a, b = (veloce.DynamicEmbedding(4, mode="sum", optimizer=veloce.optim.SGD(lr=1.0)) for _ in range(2))
    model = torch.nn.ModuleDict({"a": a, "b": b})
    opt = veloce.CombinedOptimizer(None, model)
    ids = torch.tensor([[1, 2]])
    (a(ids).sum() + (b(ids) * float("nan")).sum()).backward()
    before = (snapshot(a), snapshot(b))
    with pytest.raises(FloatingPointError, match="NaN or Inf"):
        opt.step()
    assert_same_snapshot(before[0], snapshot(a))
    assert_same_snapshot(before[1], snapshot(b))
    assert a.step_count == 0 and b.step_count == 0
    opt.zero_grad()  # drops both pending gradients; training goes on
    (a(ids).sum() + b(ids).sum()).backward()
    opt.step()
    assert a.step_count == 1 and b.step_count == 1


# ---- nonfinite_grad="raise_next": the check read one step late --------------------------------
def _raise_next_pair(device, optimizer=None):
    """Two identical tables, "raise" and "raise_next"."""
    return [
        veloce.DynamicEmbedding(8, mode="sum", optimizer=optimizer or veloce.optim.Adam(lr=0.1), seed=4,
                                nonfinite_grad=nf, device=device)
        for nf in ("raise", "raise_next")
    ]  # fmt: skip


def _train_batch(emb, ids, scale=1.0):
    (emb(ids) * scale).sum().backward()


def _trained(emb) -> dict:
    """What the optimizer changes: rows, their optimizer state, the step count (a lookup
    also moves eviction scores; those are left out)."""
    return {k: v for k, v in emb.export().items() if k != "scores"}


def _assert_same_training(a: dict, b: dict) -> None:
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("device", DEVICES)
def test_raise_next_with_finite_gradients_equals_raise(device):
    """With finite gradients "raise_next" trains bit for bit like "raise" (Adam: the step
    counts agree too)."""
    eager, late = _raise_next_pair(device)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        ids = torch.randint(0, 40, (16, 3), generator=g).to(device)
        for t in (eager, late):
            _train_batch(t, ids)
            t.step()
            t.zero_grad()
    a, b = eager.export(), late.export()
    assert int(b["step"]) == int(a["step"]) == 4
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("device", DEVICES)
def test_raise_next_applies_nothing_of_a_bad_step_and_raises_at_the_next(device):
    """A NaN gradient under "raise_next": step() returns, the update skips itself (rows and
    optimizer state unchanged), the step is not counted, and the next step() raises before
    applying its own gradient, which stays pending. Training then goes on exactly as a
    table that never saw the bad batch."""
    ref, emb = _raise_next_pair(device)
    ids = torch.tensor([[1, 2], [3, 4]], device=device)
    for t in (ref, emb):
        _train_batch(t, ids)
        t.step()
        t.zero_grad()
    before = _trained(emb)
    _train_batch(emb, ids, float("nan"))
    emb.step()  # no raise: the host did not read the check
    emb.zero_grad()
    _assert_same_training(before, _trained(emb))  # reads the rows (and the check): nothing applied
    assert emb.step_count == 1
    _train_batch(emb, ids)
    with pytest.raises(FloatingPointError, match="previous step"):
        emb.step()
    _assert_same_training(before, _trained(emb))
    assert emb._pending and emb.step_count == 1  # this step's gradient is kept
    emb.step()  # applies it: the error was raised once
    emb.zero_grad()
    _train_batch(ref, ids)
    ref.step()
    ref.zero_grad()
    _assert_same_training(_trained(ref), _trained(emb))


@pytest.mark.parametrize("device", DEVICES)
def test_raise_next_failed_step_is_not_counted_by_exports_and_loads(device):
    """state_dict() right after a failed "raise_next" step holds the step count before it;
    loading a state_dict drops the pending error (the table is replaced)."""
    _, emb = _raise_next_pair(device)
    ids = torch.tensor([[5, 6]], device=device)
    _train_batch(emb, ids)
    emb.step()
    emb.zero_grad()
    _train_batch(emb, ids, float("inf"))
    emb.step()
    emb.zero_grad()
    sd = emb.state_dict()
    assert int(sd["step"]) == 1
    emb.load_state_dict(sd)
    _train_batch(emb, ids)
    emb.step()  # no error: the load replaced the table
    assert emb.step_count == 2


@pytest.mark.parametrize("device", DEVICES)
def test_raise_next_bad_table_rolls_back_every_table_of_its_step(device):
    """A bad gradient in one "raise_next" table of a step_tables call: no table of that call
    was applied (they shared the skip flag), none counts the step, and each raises once."""
    a, b = (veloce.DynamicEmbedding(4, mode="sum", optimizer=veloce.optim.Adam(), nonfinite_grad="raise_next",
                                    seed=k, device=device) for k in range(2))  # fmt: skip
    ids = torch.tensor([[1, 2]], device=device)
    _train_batch(a, ids)
    _train_batch(b, ids, float("nan"))
    before = (_trained(a), _trained(b))
    veloce.step_tables([a, b])
    _assert_same_training(before[0], _trained(a))
    _assert_same_training(before[1], _trained(b))
    assert (a.step_count, b.step_count) == (0, 0)
    with pytest.raises(FloatingPointError, match="1 of its 2 checked"):
        veloce.step_tables([a, b])
    veloce.step_tables([a, b])  # the error was raised once; nothing pending, nothing counted
    assert (a.step_count, b.step_count) == (0, 0)


def test_raise_next_error_comes_before_the_dense_step_of_combined_optimizer():
    """CombinedOptimizer raises the last step's "raise_next" error before its dense step:
    the call applies nothing, dense or sparse, and the next call applies this step once."""
    emb = veloce.DynamicEmbedding(4, mode="sum", nonfinite_grad="raise_next", seed=3)
    lin = torch.nn.Linear(4, 1)
    model = torch.nn.ModuleDict({"emb": emb, "lin": lin})
    opt = veloce.CombinedOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1), model)
    ids = torch.tensor([[1, 2]])
    (lin(emb(ids)).sum() + (emb(ids) * float("nan")).sum()).backward()  # NaN reaches the table only
    opt.step()
    opt.zero_grad()
    lin(emb(ids)).sum().backward()
    dense = [p.detach().clone() for p in lin.parameters()]
    rows = _trained(emb)
    with pytest.raises(FloatingPointError, match="previous step"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(dense, lin.parameters()))
    _assert_same_training(rows, _trained(emb))
    opt.step()  # applies this step's gradients, dense and sparse, once
    assert not all(torch.equal(a, b) for a, b in zip(dense, lin.parameters()))
    assert emb.step_count == 1


def test_raise_next_step_count_set_after_a_failed_step_is_kept():
    """A step count set from outside (a restore) replaces the failed step's bookkeeping:
    reading the check later neither rolls it back nor raises."""
    _, emb = _raise_next_pair("cpu")
    ids = torch.tensor([[1, 2]])
    _train_batch(emb, ids, float("nan"))
    emb.step()
    emb.zero_grad()
    emb.step_count = 100
    assert emb.step_count == 100
    _train_batch(emb, ids)
    emb.step()
    assert emb.step_count == 101


def test_raise_next_copies_and_old_pickles():
    """deepcopy reads the last step's check first (it holds device events); a module
    pickled when step_count was a plain attribute loads with its count."""
    _, emb = _raise_next_pair("cpu")
    ids = torch.tensor([[1, 2]])
    _train_batch(emb, ids)
    emb.step()
    emb.zero_grad()
    _train_batch(emb, ids, float("inf"))
    emb.step()
    twin = copy.deepcopy(emb)
    assert twin.step_count == emb.step_count == 1 and twin._verdict is None
    state = emb.__getstate__()
    state["step_count"] = state.pop("_steps")
    del state["_verdict"], state["_nonfinite_error"]
    old = veloce.DynamicEmbedding.__new__(veloce.DynamicEmbedding)
    old.__setstate__(state)
    assert old.step_count == 1 and old._verdict is None


def test_raise_next_with_a_raise_table_reads_the_check_now():
    """A step over a "raise" and a "raise_next" table reads the check at once (the "raise"
    table's contract): a NaN raises in this step(), and nothing is applied."""
    a = veloce.DynamicEmbedding(4, mode="sum", nonfinite_grad="raise", seed=1)
    b = veloce.DynamicEmbedding(4, mode="sum", nonfinite_grad="raise_next", seed=2)
    ids = torch.tensor([[1, 2]])
    _train_batch(a, ids)
    _train_batch(b, ids, float("nan"))
    before = (snapshot(a), snapshot(b))
    with pytest.raises(FloatingPointError, match="NaN or Inf"):
        veloce.step_tables([a, b])
    assert_same_snapshot(before[0], snapshot(a))
    assert_same_snapshot(before[1], snapshot(b))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_raise_next_step_does_not_wait_for_the_device(capfd):
    """nonfinite_grad='raise_next': step() makes no synchronizing call at all (not even the
    event wait of "raise"): a long device sleep queued before it is still running when it
    returns."""
    emb = veloce.DynamicEmbedding(64, mode="sum", optimizer=veloce.optim.Adam(), device="cuda",
                                  nonfinite_grad="raise_next")  # fmt: skip
    ids = torch.randint(0, 500, (4096, 3), device="cuda")
    emb(ids).sum().backward()
    emb.step()
    emb.zero_grad()
    emb(ids).sum().backward()
    torch.cuda.synchronize()
    capfd.readouterr()
    torch.cuda._sleep(200_000_000)  # ~0.1 s or more of device time, ahead of the check
    torch.cuda.set_sync_debug_mode("warn")
    try:
        emb.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    done = torch.cuda.Event()
    done.record()
    assert not done.query(), "step() waited for the device"
    assert capfd.readouterr().err.count("called a synchronizing CUDA operation") == 0
    assert emb.step_count == 2


# ---- step_tables: alike tables share one fused update ----------------------------------------
class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the calls of each op (by schema name) under the mode."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


# (dim, mode, optimizer, lr given to step_tables, capacity, nonfinite_grad, include_last_offset)
_STEP_TABLES = [
    (16, "sum", veloce.optim.Adagrad(lr=0.05), None, 1024, "raise", False),  # 0
    (16, "sum", veloce.optim.Adagrad(lr=0.05), None, 64, "raise", False),  # 1: grows between two batches
    (16, "mean", veloce.optim.Adagrad(lr=0.05), None, 1024, "raise", False),  # 2: mean pooling
    (16, "mean", veloce.optim.Adagrad(lr=0.05), None, 256, "raise", True),  # 3: mean, include_last_offset
    (16, "sum", veloce.optim.Adagrad(lr=0.05), 0.1, 1024, "raise", False),  # 4: another lr
    (16, "sum", veloce.optim.SGD(lr=0.05), None, 1024, "raise", False),  # 5: another optimizer
    (32, "sum", veloce.optim.Adagrad(lr=0.05), None, 1024, "raise", False),  # 6: another dim
    (16, "sum", veloce.optim.Adam(), None, 1024, "raise", False),  # 7
    (16, "sum", veloce.optim.Adam(), None, 1024, "raise", False),  # 8: no backward in step 1 (a step behind 7)
    (16, "sum", veloce.optim.Adagrad(lr=0.05), None, 1024, "skip", False),  # 9: two batches, a NaN bag in step 2
    (16, "sum", veloce.optim.Adagrad(lr=0.05), None, 1024, "raise", False),  # 10: no backward in step 3
    (16, "sum", veloce.optim.RowWiseAdagrad(lr=0.05), None, 1024, "raise", False),  # 11: per-sample weights
    (16, "sum", veloce.optim.RowWiseAdagrad(lr=0.05), None, 1024, "raise", False),  # 12
]


def _step_tables_round(tables, step, device):
    """The forward and backward passes of one step for every table (the same for any call
    of the same step: the inputs come from a generator seeded by the step)."""
    g = torch.Generator().manual_seed(100 + step)
    for i, t in enumerate(tables):
        if (i == 8 and step == 1) or (i == 10 and step == 3):
            continue
        for batch in range(2 if i in (1, 9) else 1):
            if i == 1 and batch == 1:  # enough new ids to grow the table: batch 0's slots go stale
                ids = torch.randint(1000, 5000, (8, 40), generator=g)
            else:
                ids = torch.randint(0, 60, (8, 5), generator=g)
            if i == 3:  # 1-D with offsets (include_last_offset), one empty bag
                out = t(ids.reshape(-1).to(device), torch.tensor([0, 3, 3, 10, 40], device=device))
            elif i == 11:
                out = t(ids.to(device), per_sample_weights=torch.rand(8, 5, generator=g).to(device))
            else:
                out = t(ids.to(device))
            c = torch.randn(out.shape, generator=g)
            if i == 9 and step == 2 and batch == 0:
                c[0, 0] = float("nan")
            out.backward(c.to(device))


@pytest.mark.parametrize("device", DEVICES)
def test_step_tables_groups_alike_tables_and_equals_stepping_each(device):
    """step_tables over 13 tables equals stepping each table alone, bit for bit, over 3
    steps; tables that share dim, pooling, optimizer, lr and (Adam) step count share one
    accumulate_and_update_many call, the others take accumulate_and_update."""

    def make():
        return [
            veloce.DynamicEmbedding(d, mode=m, optimizer=o, capacity=c, nonfinite_grad=nf, include_last_offset=ilo,
                                    seed=i, device=device)
            for i, (d, m, o, _, c, nf, ilo) in enumerate(_STEP_TABLES)
        ]  # fmt: skip

    grouped, alone = make(), make()
    lrs = [spec[3] for spec in _STEP_TABLES]
    # Groups (tables): Adagrad sum (0, 1, 9, 10), mean (2, 3), RowWiseAdagrad (11, 12); alone:
    # 4, 5, 6, 7, and 8 (Adam a step behind 7) from step 2 on. Table 1's and 9's two batches are
    # merged into sum pooling with per-sample weights.
    expected = {1: (3, 4), 2: (3, 5), 3: (3, 5)}  # step: (many calls, single calls)
    for step in (1, 2, 3):
        for tables in (grouped, alone):
            _step_tables_round(tables, step, device)
        with _CountOps() as ops:
            veloce.step_tables(grouped, lrs)
        got = (ops.counts.get("veloce::accumulate_and_update_many", 0), ops.counts.get("veloce::accumulate_and_update", 0))
        assert got == expected[step], f"step {step}: (grouped, single) calls {got}"
        for t, lr in zip(alone, lrs):
            t.step(lr)
    assert grouped[1].capacity > 64  # it grew, so its pending slots were re-resolved
    for i, (a, b) in enumerate(zip(grouped, alone)):
        assert a.step_count == b.step_count, i
        # By id: on CUDA the slots of a table that grew may differ between two identical runs.
        ea, eb = sorted_table(a), sorted_table(b)
        for key in ea:
            assert torch.equal(ea[key], eb[key]), f"table {i}: {key} differs"
        assert not a._pending


def test_step_tables_steps_a_table_listed_twice_once():
    emb = veloce.DynamicEmbedding(4, mode="sum", optimizer=veloce.optim.SGD(lr=1.0))
    ref = copy.deepcopy(emb)
    for t in (emb, ref):
        t(torch.tensor([[1, 2]])).sum().backward()
    veloce.step_tables([emb, emb])
    ref.step()
    assert emb.step_count == ref.step_count == 1
    assert torch.equal(emb.export()["weights"], ref.export()["weights"])


# ---- bad input: a clear error naming the argument, table unchanged ------------------------------
def _bad_cases():
    L = torch.long
    return [
        ("float ids", lambda e: e(torch.tensor([1.0, 2.0]), torch.tensor([0])), TypeError, "input must hold int64"),
        ("3-D input", lambda e: e(torch.zeros(2, 2, 2, dtype=L)), ValueError, r"1-D \(with offsets\) or 2-D"),
        ("missing offsets", lambda e: e(torch.tensor([1, 2])), ValueError, "offsets is required"),
        ("2-D with offsets", lambda e: e(torch.tensor([[1, 2]]), torch.tensor([0])), ValueError, "offsets must be None"),
        ("float offsets", lambda e: e(torch.tensor([1, 2]), torch.tensor([0.0])), TypeError, "offsets must be an int64"),
        ("2-D offsets", lambda e: e(torch.tensor([1, 2]), torch.tensor([[0]])), ValueError, "offsets must be 1-D"),
        ("offsets not at 0", lambda e: e(torch.tensor([1, 2]), torch.tensor([1])), ValueError, r"offsets\[0\] = 1"),
        ("decreasing offsets", lambda e: e(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1])), ValueError,
         r"offsets\[1\] = 2 > offsets\[2\] = 1"),
        ("offsets past end", lambda e: e(torch.tensor([1, 2]), torch.tensor([0, 5])), ValueError, "past the end"),
        ("last offset wrong", lambda e: _ilo(e)(torch.tensor([1, 2]), torch.tensor([0, 1])),
         ValueError, "must equal the number of ids"),
        ("empty offsets with ids", lambda e: e(torch.tensor([1, 2]), torch.zeros(0, dtype=L)), ValueError,
         "0 bags"),
        ("psw wrong length", lambda e: e(torch.tensor([1, 2]), torch.tensor([0]), torch.ones(3)), ValueError,
         "per_sample_weights must have shape"),
        ("psw with mean", lambda e: _mean(e)(torch.tensor([1, 2]), torch.tensor([0]), torch.ones(2)), ValueError,
         "only supported with mode='sum'"),
        ("psw integer", lambda e: e(torch.tensor([1, 2]), torch.tensor([0]), torch.ones(2, dtype=L)), TypeError,
         "per_sample_weights must be a floating"),
        ("psw 2-D shape", lambda e: e(torch.tensor([[1, 2]]), None, torch.ones(1, 3)), ValueError,
         "per_sample_weights must have the shape of input"),
        ("not a tensor", lambda e: e([1, 2], torch.tensor([0])), TypeError, "input must be a tensor"),
        ("find float ids", lambda e: e.find(torch.tensor([1.5])), TypeError, "ids must be an int64"),
        ("find 2-D ids", lambda e: e.find(torch.tensor([[1]])), ValueError, "ids must be 1-D"),
        ("insert wrong shape", lambda e: e.insert(torch.tensor([1, 2]), torch.ones(2, 3)), ValueError,
         r"weights must have shape \(2, 8\)"),
        ("insert float ids", lambda e: e.insert(torch.tensor([1.0]), torch.ones(1, 8)), TypeError,
         "ids must be an int64"),
        ("erase 2-D ids", lambda e: e.erase(torch.tensor([[1]])), ValueError, "ids must be 1-D"),
        ("bad state dict", lambda e: e.load_state_dict({**e.state_dict(), "weights": torch.ones(1, 3)}),
         RuntimeError, "weights must be"),
        ("state dict missing key", lambda e: e.load_state_dict({"keys": torch.zeros(0, dtype=L)}), RuntimeError,
         "Missing key"),
    ]


def _ilo(e):
    e.include_last_offset = True
    return e


def _mean(e):
    e.mode = "mean"
    return e


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input_is_refused_and_table_unchanged(case):
    _, fn, exc, pattern = case
    emb = veloce.DynamicEmbedding(8, mode="sum", capacity=64)
    emb(torch.tensor([[1, 2, 3]]))
    (emb(torch.tensor([[1, 5]])).sum()).backward()  # a pending gradient too
    before = snapshot(emb)
    with pytest.raises(exc, match=pattern):
        fn(emb)
    assert_same_snapshot(before, snapshot(emb))


def test_constructor_errors_name_the_argument():
    with pytest.raises(ValueError, match="embedding_dim"):
        veloce.DynamicEmbedding(0)
    with pytest.raises(ValueError, match="mode must be"):
        veloce.DynamicEmbedding(4, mode="min")
    with pytest.raises(ValueError, match="eviction must be"):
        veloce.DynamicEmbedding(4, eviction="fifo")
    with pytest.raises(TypeError, match="optimizer must come from veloce.optim"):
        veloce.DynamicEmbedding(4, optimizer=torch.optim.SGD)
    with pytest.raises(ValueError, match="lr must be a positive"):
        veloce.optim.SGD(lr=-1)
    with pytest.raises(ValueError, match="betas"):
        veloce.optim.Adam(betas=(1.5, 0.9))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("optimizer", [veloce.optim.SGD(lr=0.1), veloce.optim.Adam()])
def test_cuda_step_never_waits_for_the_device(optimizer):
    """The sparse step (the fused reduce + update over the table's own slots) and the pooled
    lookup of ids already in the table run without a host synchronization; only the
    finiteness check of nonfinite_grad='raise' reads the device back."""
    emb = veloce.DynamicEmbedding(64, mode="sum", optimizer=optimizer, device="cuda", nonfinite_grad="apply")
    ids = torch.randint(0, 500, (4096, 3), device="cuda")
    emb(ids).sum().backward()  # inserts the ids (the insert path reads sizes back)
    emb.step()
    torch.cuda.synchronize()
    before = emb.export()["weights"].clone()
    out = emb(ids)
    out.sum().backward()
    torch.cuda.set_sync_debug_mode("error")
    try:
        emb.step()
        out2 = torch.ops.veloce.pooled_lookup(
            emb.table.weights, emb.table.find(ids.reshape(-1)), torch.arange(0, ids.numel(), 3, device="cuda"), None,
            0, False, None, False,
        )  # fmt: skip
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not torch.equal(emb.export()["weights"], before)  # the step was applied
    assert out2.shape == (4096, 64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_step_tables_never_waits_for_the_device():
    """step_tables over several tables (grouped into accumulate_and_update_many calls, one
    table alone) runs without a host synchronization when no finiteness check is asked."""
    O = veloce.optim
    specs = [(O.Adagrad(lr=0.05), "sum")] * 4 + [(O.Adagrad(lr=0.05), "mean")] * 2 + [(O.SGD(lr=0.1), "sum")]
    tables = [
        veloce.DynamicEmbedding(64, mode=m, optimizer=o, device="cuda", nonfinite_grad="apply", seed=i)
        for i, (o, m) in enumerate(specs)
    ]
    ids = [torch.randint(0, 300 + 100 * i, (1024, 3), device="cuda") for i in range(len(tables))]
    for t, x in zip(tables, ids):
        t(x).sum().backward()  # inserts the ids (the insert path reads sizes back)
    veloce.step_tables(tables)
    torch.cuda.synchronize()
    before = [t.export()["weights"].clone() for t in tables]
    for t, x in zip(tables, ids):
        t(x).sum().backward()
    torch.cuda.set_sync_debug_mode("error")
    try:
        veloce.step_tables(tables)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for t, b in zip(tables, before):
        assert not torch.equal(t.export()["weights"], b)  # every table was stepped


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_host_values_reach_the_device_without_a_sync():
    """The small index tensors of a step (bag bounds, split counts, flags' owners) are
    queued like kernels, not copied with a blocking host-to-device copy."""
    from veloce.runtime.device import host_tensor

    torch.cuda.set_sync_debug_mode("error")
    try:
        t = host_tensor([3, 1, 2], torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert t.device.type == "cuda" and t.tolist() == [3, 1, 2] and t.dtype == torch.long
    assert host_tensor([0.5], torch.device("cpu"), torch.float32).tolist() == [0.5]


def test_lookup_many_bad_offsets_in_one_table_change_no_table():
    tables = [veloce.DynamicEmbedding(4, mode="sum", seed=k) for k in range(3)]
    ids = torch.arange(6)
    good, bad = torch.tensor([0, 2, 4]), torch.tensor([0, 4, 2])
    before = [snapshot(t) for t in tables]
    with pytest.raises(ValueError, match=r"offsets must be non-decreasing, got offsets\[1\] = 4 > offsets\[2\] = 2"):
        veloce.lookup_many(tables, [(ids, good), (ids, good), (ids, bad)])
    for t, b in zip(tables, before):
        assert_same_snapshot(b, snapshot(t))
    outs = veloce.lookup_many(tables, [(ids, good)] * 3)
    assert [len(t) for t in tables] == [6, 6, 6] and all(o.shape == (3, 4) for o in outs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_lookup_many_of_known_ids_waits_for_the_device_once(capfd):
    """Eight tables with 1-D offsets: one read-back of the inserts' counters (none new)
    carries the flag of every bag layout (bad_input); per table it would be 16 (8 before
    the flag rode on the insert: 2 per call)."""
    # Room for every id: a table due to grow reads the flag before growing (one more sync).
    tables = [veloce.DynamicEmbedding(16, mode="sum", device="cuda", seed=k, capacity=1 << 13) for k in range(8)]
    ids = torch.randint(0, 1000, (4096,), device="cuda")
    offsets = torch.arange(0, 4096, 4, device="cuda")
    veloce.lookup_many(tables, [(ids, offsets)] * 8)  # inserts
    torch.cuda.synchronize()
    capfd.readouterr()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        outs = veloce.lookup_many(tables, [(ids, offsets)] * 8)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert capfd.readouterr().err.count("called a synchronizing CUDA operation") == 1
    assert len(outs) == 8 and outs[0].shape == (1024, 16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_training_forward_of_new_ids_waits_for_the_device_once(capfd):
    """New ids cost no extra wait either: the missing positions are grouped on the device
    without their count being read back, and the one read of the counters decides their
    placement (new ids that share no bucket with each other: a big, empty table)."""
    emb = veloce.DynamicEmbedding(16, mode="sum", capacity=1 << 22, device="cuda")
    ids = torch.arange(16, device="cuda") * 7919  # 32 of 131072 buckets: shared by chance with p < 0.5%
    offsets = torch.arange(0, 16, 4, device="cuda")
    torch.cuda.synchronize()
    capfd.readouterr()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        out = emb(ids, offsets)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert capfd.readouterr().err.count("called a synchronizing CUDA operation") == 1
    assert out.shape == (4, 16) and len(emb) == 16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("layout", ["1-D offsets", "2-D input"])
def test_cuda_training_forward_of_known_ids_waits_for_the_device_once(layout, capfd):
    """A training forward of ids already in the table waits once: the insert's counters,
    which also carry the offsets' flag (it took two reads before). The table is sized so
    that it is not due to grow (growth reads the device back): with the default capacity,
    whether the first call's ~980 ids grew it depended on the random ids."""
    emb = veloce.DynamicEmbedding(16, mode="sum", capacity=1 << 14, device="cuda")
    ids = torch.randint(0, 1000, (4096,), device="cuda")
    args = (ids, torch.arange(0, 4096, 4, device="cuda")) if layout == "1-D offsets" else (ids.view(1024, 4),)
    emb(*args)  # inserts
    torch.cuda.synchronize()
    capfd.readouterr()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        out = emb(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert capfd.readouterr().err.count("called a synchronizing CUDA operation") == 1
    assert out.shape == (1024, 16)


def _no_explicit_offsets_read(layouts, flags=None):
    """Stands in for _check_offsets_many where every layout should ride on an insert."""
    if layouts:
        raise AssertionError("the offsets were read back on their own, not with the insert")


def _spy_flags(monkeypatch, owner, name) -> list:
    """Wraps owner.name (an insert taking a bad_input argument) to record the flags it is given."""
    seen, insert = [], getattr(owner, name)
    signature = inspect.signature(insert)

    def spy(*args, **kwargs):
        seen.append(signature.bind(*args, **kwargs).arguments.get("bad_input"))
        return insert(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return seen


BAD_OFFSETS = [  # (offsets of 6 ids, include_last_offset, the error)
    ([1, 3], False, r"offsets must start at 0, got offsets\[0\] = 1"),
    ([0, 4, 2], False, r"offsets must be non-decreasing, got offsets\[1\] = 4 > offsets\[2\] = 2"),
    ([0, 7], False, r"offsets\[-1\] = 7 is past the end of input \(6 ids\)"),
    ([0, 3, 5], True, r"with include_last_offset=True, offsets\[-1\] must equal the number of ids \(6\)"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("growth_due", [False, True], ids=["no growth", "growth due"])
def test_training_forward_checks_offsets_with_the_insert(device, growth_due, monkeypatch):
    """In training the bag layout's check rides on the insert (its bad_input flag), never
    read back on its own. Bad offsets raise the same errors as ever and change nothing: no
    row, no score, no clock tick, and no growth even when the insert would grow first."""
    emb = veloce.DynamicEmbedding(4, mode="sum", capacity=32 if growth_due else 1024, device=device)
    # 30 of 32 slots when capacity is 32 (past grow_at: the next insert grows first), and a pending gradient
    emb(torch.arange(30, device=device).view(1, 30)).sum().backward()
    assert emb.capacity == (32 if growth_due else 1024)
    for module in (veloce.sparse.lookup, veloce.sparse.inputs):
        monkeypatch.setattr(module, "check_offsets_many", _no_explicit_offsets_read)
    flags = _spy_flags(monkeypatch, veloce.table.HashTable, "find_or_insert")
    before, clock, capacity = snapshot(emb), emb.table.clock, emb.capacity
    ids = torch.arange(100, 106, device=device)
    for offsets, ilo, match in BAD_OFFSETS:
        emb.include_last_offset = ilo
        with pytest.raises(ValueError, match=match):
            emb(ids, torch.tensor(offsets, device=device))
        assert_same_snapshot(before, snapshot(emb))
        assert emb.table.clock == clock
    emb.include_last_offset = False
    assert emb(ids, torch.tensor([0, 2, 2], device=device)).shape == (3, 4)
    assert len(emb) == 36 and emb.table.clock == clock + 1 and (emb.capacity > capacity) == growth_due
    assert [bool(f) for f in flags] == [True] * len(BAD_OFFSETS) + [False]  # every check rode on the insert
    monkeypatch.undo()
    emb.eval()  # eval never inserts: its check reads the offsets back itself
    with pytest.raises(ValueError, match=BAD_OFFSETS[1][2]):
        emb(ids, torch.tensor([0, 4, 2], device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_lookup_many_checks_every_layout_with_the_insert(device, monkeypatch):
    """lookup_many's local tables: the layouts of every input (an eval table's and a table
    listed twice included) are one flag on the grouped insert. A bad one anywhere raises
    its error before any table changes."""
    a, b, ev = (veloce.DynamicEmbedding(4, mode="sum", seed=k, device=device) for k in range(3))
    ev.eval()
    ids = torch.arange(6, device=device)
    good, bad = torch.tensor([0, 2, 4], device=device), torch.tensor([0, 4, 2], device=device)
    veloce.lookup_many([a, b], [(ids[:2], good[:1])] * 2)
    for module in (veloce.sparse.lookup, veloce.sparse.inputs):
        monkeypatch.setattr(module, "check_offsets_many", _no_explicit_offsets_read)
    flags = _spy_flags(monkeypatch, veloce.sparse.lookup, "find_or_insert_many")
    before = [(snapshot(t), t.table.clock) for t in (a, b, ev)]
    cases = [
        ([a, b], [(ids, good), (ids, bad)]),  # the second table's
        ([a, b, a], [(ids, good), (ids, good), (ids, bad)]),  # a table listed twice: its second input
        ([a, b, ev], [(ids, good), (ids, good), (ids, bad)]),  # an eval table's
    ]
    for tables, inputs in cases:
        with pytest.raises(ValueError, match=r"offsets must be non-decreasing, got offsets\[1\] = 4 > "):
            veloce.lookup_many(tables, inputs)
        for t, (snap, clock) in zip((a, b, ev), before):
            assert_same_snapshot(snap, snapshot(t))
            assert t.table.clock == clock
    outs = veloce.lookup_many([a, b, ev, a], [(ids, good)] * 4)
    assert [len(t) for t in (a, b, ev)] == [6, 6, 0] and all(o.shape == (3, 4) for o in outs)
    assert [bool(f) for f in flags] == [True] * len(cases) + [False]  # one flag per call, on its insert


def test_lookup_many_bad_eval_input_changes_no_training_table():
    """Every local input is checked before the grouped insert, an eval table's too."""
    ev, tr = veloce.DynamicEmbedding(4, mode="sum"), veloce.DynamicEmbedding(4, mode="sum")
    ev.eval()
    with pytest.raises(ValueError, match="offsets must start at 0"):
        veloce.lookup_many([ev, tr], [(torch.tensor([1, 2]), torch.tensor([1])), torch.tensor([[1, 2], [3, 4]])])
    assert len(tr) == 0


def test_modules_sharing_a_table_look_up_and_step_as_separate_calls():
    """Two modules over one HashTable (tied embeddings): lookup_many and step_tables give
    what calling and stepping each module in turn gives."""

    def pair():
        a = veloce.DynamicEmbedding(4, mode="sum", optimizer=veloce.optim.Adagrad(lr=0.5), seed=1)
        b = veloce.DynamicEmbedding(4, mode="sum", optimizer=veloce.optim.Adagrad(lr=0.5), seed=1)
        b.table = a.table
        return a, b

    x, y = torch.tensor([[1, 2], [3, 4]]), torch.tensor([[2, 5]])
    a, b = pair()
    outs = veloce.lookup_many([a, b], [x, y])
    (outs[0].sum() + 2 * outs[1].sum()).backward()
    veloce.step_tables([a, b])
    c, d = pair()
    (c(x).sum() + 2 * d(y).sum()).backward()
    c.step()
    d.step()
    for k, v in sorted_table(a).items():
        assert torch.equal(v, sorted_table(c)[k]), k
    assert (a.step_count, b.step_count) == (c.step_count, d.step_count) == (1, 1)


def test_a_failed_update_books_no_step(monkeypatch):
    """The step count moves only once the update is applied: a failing update leaves the
    gradient pending and the count unchanged, so a retry counts the step once."""
    emb = veloce.DynamicEmbedding(4, mode="sum", optimizer=veloce.optim.Adam(lr=0.1))
    emb(torch.tensor([[1, 2]])).sum().backward()

    def fail(*args):
        raise RuntimeError("injected")

    monkeypatch.setattr(torch.ops.veloce, "accumulate_and_update", fail)
    with pytest.raises(RuntimeError, match="injected"):
        emb.step()
    assert emb.step_count == 0 and len(emb._pending) == 1
    monkeypatch.undo()
    emb.step()
    assert emb.step_count == 1 and not emb._pending


def test_finite_gradient_whose_norm_overflows_is_applied():
    """Huge finite gradients, whose squares overflow float32 (a norm-based check would flag
    them), pass the "raise" check: it tests each element. The update is applied: the
    result of a table that does not check."""
    tables = [
        veloce.DynamicEmbedding(4, mode="sum", optimizer=veloce.optim.SGD(lr=1e-30), nonfinite_grad=nf, seed=1)
        for nf in ("raise", "apply")
    ]
    ids = torch.tensor([[1, 2], [2, 3]])
    for t in tables:
        (t(ids) * 1e30).sum().backward()  # |g| = 1e30: finite, but g * g overflows float32
    before = tables[0].export()["weights"].clone()
    veloce.step_tables(tables[:1])
    tables[1].step()
    assert tables[0].step_count == tables[1].step_count == 1 and not tables[0]._pending
    a, b = tables[0].export(), tables[1].export()
    assert torch.equal(a["keys"], b["keys"]) and torch.equal(a["weights"], b["weights"])
    assert not torch.equal(a["weights"], before)  # lr 1e-30 * g 1e30: each row moved by about 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_checked_step_queues_the_update_without_a_stream_sync(capfd):
    """nonfinite_grad='raise': the update is queued behind the NaN/Inf check, and the host
    waits on an event for the check's flags alone (not a stream sync)."""
    emb = veloce.DynamicEmbedding(64, mode="sum", optimizer=veloce.optim.Adam(), device="cuda")
    ids = torch.randint(0, 500, (4096, 3), device="cuda")
    emb(ids).sum().backward()
    emb.step()
    torch.cuda.synchronize()
    before = emb.export()["weights"].clone()
    emb(ids).sum().backward()
    capfd.readouterr()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        emb.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert capfd.readouterr().err.count("called a synchronizing CUDA operation") == 0
    assert not torch.equal(emb.export()["weights"], before) and emb.step_count == 2
    (emb(ids) * float("nan")).sum().backward()
    before = emb.export()["weights"].clone()
    with pytest.raises(FloatingPointError, match="NaN or Inf"):
        emb.step()
    assert torch.equal(emb.export()["weights"], before) and emb.step_count == 2


def test_nonfinite_check_finds_the_table_among_uneven_pending_gradients():
    """The batched NaN/Inf check maps each flag to its table when tables hold different
    numbers of pending gradients (two backward passes, one, none)."""
    make = [veloce.DynamicEmbedding(4, mode="sum", optimizer=veloce.optim.SGD(lr=1.0), seed=k) for k in range(3)]
    a, b, c = make
    ids = torch.tensor([[1, 2]])
    a(ids).sum().backward()
    (a(ids) * float("nan")).sum().backward()  # a: two pending gradients, the second bad
    b(ids).sum().backward()  # b: one, finite; c: none
    before = [snapshot(t) for t in make]
    with pytest.raises(FloatingPointError, match="gradient of 1 bag"):
        veloce.step_tables(make)
    for t, s in zip(make, before):
        assert_same_snapshot(s, snapshot(t))
    a.zero_grad()
    veloce.step_tables(make)
    assert (a.step_count, b.step_count, c.step_count) == (0, 1, 0)


def test_bookkeeping_attributes_set_directly_are_plain_attributes():
    """DynamicEmbedding and HashTable set their per-step bookkeeping without
    nn.Module.__setattr__: those names must stay plain attributes (never a parameter,
    buffer or submodule), and setting them must behave as before."""
    emb = veloce.DynamicEmbedding(4, mode="sum", optimizer=veloce.optim.Adam())
    for module in (emb, emb.table):
        registered = set(module._parameters) | set(module._buffers) | set(module._modules)
        assert not registered & type(module)._PLAIN_ATTRS
        for name in type(module)._PLAIN_ATTRS:
            assert name in module.__dict__, name
    emb(torch.tensor([[1, 2]])).sum().backward()
    emb.step()
    assert (emb.step_count, emb.table.size, emb.table.clock) == (1, 2, 1)
    assert "step_count" not in emb.state_dict() and "table.size" not in emb.state_dict()
    emb.table.register_buffer("extra", torch.zeros(1))  # other names still go through nn.Module
    assert "extra" in emb.table._buffers


def test_lookups_share_one_autograd_anchor_whose_grad_stays_none():
    """Every training lookup's backward hangs off one anchor leaf per device: one
    AccumulateGrad node for a step over many tables, and the anchor never gets a gradient
    (also when first made under inference mode)."""
    from veloce.sparse.autograd import _ANCHORS, autograd_anchor

    _ANCHORS.clear()
    with torch.inference_mode():
        first = autograd_anchor(torch.device("cpu"))
    assert not first.is_inference() and first.requires_grad
    tables = [veloce.DynamicEmbedding(4, mode="sum", optimizer=veloce.optim.SGD(lr=0.1)) for _ in range(3)]
    outs = veloce.lookup_many(tables, [torch.tensor([[1, 2], [3, 4]])] * 3)
    anchors = {id(o.grad_fn.next_functions[0][0]) for o in outs}
    assert len(anchors) == 1  # the same AccumulateGrad node
    sum(o.sum() for o in outs).backward()
    assert first.grad is None
    veloce.step_tables(tables)
    assert all(t.step_count == 1 for t in tables)


def test_lookup_many_is_one_autograd_node_with_per_table_gradients():
    """lookup_many's training tables share one autograd node. Each table still gets what its
    own call gives: its sparse gradient, its per-sample weights' gradient, and nothing
    (no pending gradient, no step) when its output is not used by the loss."""

    def make():
        opt = veloce.optim.Adagrad(lr=0.3)
        return [veloce.DynamicEmbedding(4, mode="sum", optimizer=opt, seed=s) for s in (1, 2, 3)]

    ids = [torch.tensor([1, 2, 3, 2]), torch.tensor([5, 6]), torch.tensor([7, 8, 9])]
    offsets = [torch.tensor([0, 2]), torch.tensor([0, 1]), torch.tensor([0])]
    w = [torch.tensor([0.5, 1.0, 2.0, -1.0]), None, torch.tensor([1.0, 3.0, 0.25])]

    def inputs():
        psws = [None if p is None else p.clone().requires_grad_(True) for p in w]
        return [(i, o, p) for i, o, p in zip(ids, offsets, psws)], psws

    grouped = make()
    args, g_psw = inputs()
    outs = veloce.lookup_many(grouped, args)
    assert len({id(o.grad_fn) for o in outs}) == 1
    (outs[0] * torch.arange(8.0).view(2, 4)).sum().backward()  # tables 1 and 2 unused
    single = make()
    args, s_psw = inputs()
    each = [t(*a) for t, a in zip(single, args)]  # every table looked up (inserts), one used
    (each[0] * torch.arange(8.0).view(2, 4)).sum().backward()
    assert torch.equal(g_psw[0].grad, s_psw[0].grad)
    assert g_psw[2].grad is None and not grouped[1]._pending and not grouped[2]._pending
    veloce.step_tables(grouped)
    veloce.step_tables(single)
    assert [t.step_count for t in grouped] == [t.step_count for t in single] == [1, 0, 0]
    for a, b in zip(grouped, single):
        for k, v in sorted_table(a).items():
            assert torch.equal(v, sorted_table(b)[k]), k


@pytest.mark.parametrize("device", DEVICES)
def test_lookup_many_stacked_outputs_give_each_table_its_gradient(device):
    """A model that stacks the tables' outputs (DLRM, DeepFM) hands the lookup node strided
    slices of one gradient, which the backward copies in one stack per shape and dtype
    (_contiguous_grads). Each table must still get its own slice: tables of two dims and two
    dtypes, some outputs stacked, one used alone and one unused, against each table
    looked up alone and given its gradient as a contiguous tensor."""

    f64 = torch.float64

    def make():
        opt = veloce.optim.Adam(lr=0.1)
        return [
            veloce.DynamicEmbedding(4, mode="sum", optimizer=opt, seed=1, device=device),
            veloce.DynamicEmbedding(4, mode="sum", optimizer=opt, seed=2, device=device),
            veloce.DynamicEmbedding(4, mode="mean", optimizer=opt, seed=3, device=device, dtype=f64),
            veloce.DynamicEmbedding(4, mode="sum", optimizer=opt, seed=4, device=device),
            veloce.DynamicEmbedding(3, mode="sum", optimizer=opt, seed=5, device=device),
            veloce.DynamicEmbedding(4, mode="sum", optimizer=opt, seed=6, device=device),  # unused
            veloce.DynamicEmbedding(4, mode="sum", optimizer=opt, seed=7, device=device, dtype=f64),
            veloce.DynamicEmbedding(3, mode="mean", optimizer=opt, seed=8, device=device),
            veloce.DynamicEmbedding(5, mode="sum", optimizer=opt, seed=9, device=device),  # a lone strided slice
        ]

    g = torch.Generator().manual_seed(7)
    ids = [torch.randint(0, 30, (6, 2), generator=g).to(device) for _ in range(9)]
    weight = torch.randn(6, 4, 4, generator=g).to(device)  # (B, stacked tables, D)
    weight64 = torch.randn(6, 2, 4, generator=g, dtype=f64).to(device)
    w3 = torch.randn(6, 2, 3, generator=g).to(device)
    w5 = torch.randn(6, 5, generator=g).to(device)

    def loss(outs):
        stacked = torch.stack([outs[0], outs[1], outs[2].float(), outs[3]], dim=1)  # (B, 4, D) float32
        stacked64 = torch.stack([outs[2], outs[6]], dim=1)  # float64 slices (table 2's also joins the above)
        stacked3 = torch.stack([outs[4], outs[7]], dim=1)  # dim 3
        wide = torch.cat([outs[8], torch.ones_like(outs[8])], dim=1)  # table 8's gradient: a strided slice
        return ((stacked * weight).pow(2).sum() + (stacked64 * weight64).pow(2).sum().float()
                + (stacked3 * w3).sum() + (wide[:, :5] * w5).sum() + wide[:, 5:].sum())  # fmt: skip

    grouped = make()
    for _ in range(2):
        loss(veloce.lookup_many(grouped, ids)).backward()
        veloce.step_tables(grouped)
    single = make()
    for _ in range(2):
        outs = [t(x) for t, x in zip(single, ids)]
        leaves = [o.detach().requires_grad_(True) for o in outs]
        loss(leaves).backward()
        for o, leaf in zip(outs, leaves):
            if leaf.grad is not None:
                o.backward(leaf.grad.contiguous())
        veloce.step_tables(single)
    assert [t.step_count for t in grouped] == [t.step_count for t in single] == [2, 2, 2, 2, 2, 0, 2, 2, 2]
    for a, b in zip(grouped, single):
        for k, v in sorted_table(a).items():
            assert torch.equal(v, sorted_table(b)[k]), k


def test_zero_grad_clears_dense_parameters_of_subclasses_and_submodules():
    """zero_grad skips nn.Module's parameter walk only when there is nothing to walk: a
    subclass's own parameter and a submodule's are still cleared."""

    class Scaled(veloce.DynamicEmbedding):
        def __init__(self):
            super().__init__(4, mode="sum", optimizer=veloce.optim.SGD(lr=0.1))
            self.scale = nn.Parameter(torch.ones(4))
            self.proj = nn.Linear(4, 4)

        def forward(self, x):
            return self.proj(super().forward(x) * self.scale)

    m = Scaled()
    m(torch.tensor([[1, 2]])).sum().backward()
    assert m.scale.grad is not None and m.proj.weight.grad is not None and m._pending
    m.zero_grad()
    assert m.scale.grad is None and m.proj.weight.grad is None and not m._pending
    plain = veloce.DynamicEmbedding(4, mode="sum")
    plain(torch.tensor([[1, 2]])).sum().backward()
    plain.zero_grad()
    assert not plain._pending and not plain._had_backward


# ---- defer_inserts: training inserts that do not wait for their counts ------------------------


def _pair(device, **kw):
    """Two like modules, the second with deferred inserts."""
    def make(defer):
        return veloce.DynamicEmbedding(4, mode="mean", optimizer=veloce.optim.Adam(lr=0.05), seed=3, device=device,
                                       defer_inserts=defer, **kw)  # fmt: skip
    return make(False), make(True)


@pytest.mark.parametrize("device", DEVICES)
def test_deferred_inserts_train_like_read_back_ones(device):
    """10 steps of new and known ids, with offsets and as 2-D bags, through lookup_many and
    the forward: the same outputs, lengths and tables (by key) as without deferral."""
    gen = torch.Generator().manual_seed(2)
    plain, deferred = _pair(device)
    plain2, deferred2 = _pair(device, capacity=64)  # grows past 64 while deferring
    for step in range(10):
        ids = torch.randint(0, 40 * (step + 1), (24,), generator=gen).to(device)
        offsets = torch.tensor([0, 5, 5, 12, 20], device=device)
        bags2 = ids.view(6, 4) + 1000
        want = [plain(ids, offsets), *veloce.lookup_many([plain, plain2], [bags2, (ids, offsets)])]
        got = [deferred(ids, offsets), *veloce.lookup_many([deferred, deferred2], [bags2, (ids, offsets)])]
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
        sum(o.square().sum() for o in want).backward()
        sum(o.square().sum() for o in got).backward()
        veloce.step_tables([plain, plain2])
        veloce.step_tables([deferred, deferred2])
    for a, b in ((plain, deferred), (plain2, deferred2)):
        assert len(a) == len(b) and a.capacity == b.capacity
        ta, tb = sorted_table(a), sorted_table(b)
        for k in ("keys", "weights", "optimizer_state"):
            torch.testing.assert_close(tb[k], ta[k], rtol=0, atol=1e-6)
    assert deferred2.capacity > 64


@pytest.mark.parametrize("device", DEVICES)
def test_deferred_insert_raises_bad_offsets_at_the_next_step(device):
    """A bad layout with deferral: the forward reads zeros and changes nothing, and the
    optimizer's step() raises the layout's error before applying anything, dense or sparse."""
    emb = veloce.DynamicEmbedding(4, mode="sum", device=device, defer_inserts=True)
    lin = nn.Linear(4, 1).to(device)
    model = nn.ModuleDict({"emb": emb, "lin": lin})
    opt = veloce.CombinedOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1), model)
    ids = torch.arange(6, device=device)
    lin(emb(ids, torch.tensor([0, 3], device=device))).sum().backward()
    opt.step()
    opt.zero_grad()
    before, dense = snapshot(emb), [p.detach().clone() for p in lin.parameters()]
    for offsets, ilo, match in BAD_OFFSETS:
        emb.include_last_offset = ilo
        out = emb(ids + 10, torch.tensor(offsets, device=device))
        assert out.shape == (len(offsets) - ilo, 4) and not out.any()
        lin(out).sum().backward()
        with pytest.raises(ValueError, match=match):
            opt.step()
        assert_same_snapshot(before, snapshot(emb))
        assert all(torch.equal(p, q) for p, q in zip(lin.parameters(), dense))
        opt.zero_grad()
    emb.include_last_offset = False
    lin(emb(ids + 10, torch.tensor([0, 2], device=device))).sum().backward()
    opt.step()
    assert len(emb) == 12


@pytest.mark.parametrize("device", DEVICES)
def test_deferred_insert_without_room_warns_and_grows(device, monkeypatch):
    """An insert forced to defer into a table without room for it (two-choice placement can
    overflow a bucket pair below grow_at): nothing changes, its lookup reads no rows and drops
    its gradient, and the read warns and grows the table; the ids go in at their next lookup."""
    emb = veloce.DynamicEmbedding(4, mode="sum", capacity=32, device=device, defer_inserts=True)
    emb(torch.arange(28, device=device).view(1, 28)).sum().backward()  # 28 <= 0.9 * 32: deferred
    emb.step()
    before = snapshot(emb)
    monkeypatch.setattr(veloce.table.HashTable, "_deferrable", lambda self, ids, bad_input=None: True)
    new = torch.arange(100, 110, device=device).view(2, 5)
    out = emb(new)
    assert not out.any()
    out.sum().backward()
    with pytest.warns(RuntimeWarning, match=r"a deferred insert found no room for \d+ new id\(s\) \(size 28, capacity 32\)"):
        emb.step()
    monkeypatch.undo()
    assert emb.capacity == 64 and len(emb) == 28
    assert torch.equal(sorted_table(emb)["weights"], before["weights"][torch.argsort(before["keys"])])
    assert emb(new).any() and len(emb) == 38


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["deferred", "near grow_at", "at max_capacity", "deterministic", "off"])
def test_when_an_insert_defers(device, case):
    """Whether a training insert defers, seen from outside: a bad layout raises in the
    forward when it does not, and at step() when it does."""
    kw = {"max_capacity": 64, "capacity": 64} if case == "at max_capacity" else {"capacity": 64}
    emb = veloce.DynamicEmbedding(4, mode="sum", device=device, defer_inserts=case != "off", **kw)
    if case == "near grow_at":  # 55 of 64 slots: 55 + 6 ids > 0.9 * 64
        emb(torch.arange(55, device=device).view(1, 55))
    if case == "at max_capacity":  # 64 of 64 rows: a new id evicts
        emb(torch.arange(64, device=device).view(1, 64))
    bad = (torch.arange(6, device=device) + 1000, torch.tensor([0, 4, 2], device=device))
    with deterministic_algorithms(case == "deterministic"):
        if case == "deferred":
            emb(*bad)
            with pytest.raises(ValueError, match="non-decreasing"):
                emb.step()
        else:
            with pytest.raises(ValueError, match="non-decreasing"):
                emb(*bad)
    assert len(emb) == {"near grow_at": 55, "at max_capacity": 64}.get(case, 0)


@pytest.mark.skipif(not torch.cuda.is_available() or not veloce.ops.extension.has_cuda_kernels(), reason="needs a GPU")
@pytest.mark.parametrize("offsets", [False, True], ids=["2-D", "offsets"])
def test_deferred_training_forward_makes_no_host_sync(offsets, capfd):
    """On CUDA a training forward with deferred inserts (its bag layout check included) never
    waits for the device; the same forward without deferral does, once."""
    plain, deferred = _pair("cuda")
    plain2, deferred2 = _pair("cuda")
    ids = torch.arange(24, device="cuda")
    inp = (ids, torch.tensor([0, 5, 12], device="cuda")) if offsets else (ids.view(6, 4),)
    for m, m2, want in ((plain, plain2, 1), (deferred, deferred2, 0)):
        m(*inp)  # the first call allocates
        _, syncs = counting_syncs(functools.partial(m, inp[0] + 100, *inp[1:]), capfd)
        _, syncs_many = counting_syncs(functools.partial(veloce.lookup_many, [m, m2], [inp, inp]), capfd)
        assert (syncs, syncs_many) == (want, want)
    assert len(deferred) == len(plain) == 48 and len(deferred2) == 24


def _counts_in_flight(monkeypatch):
    """Deferred counts that have not reached the host until waited for (as on a busy GPU)."""
    arrived = veloce.table.batch.DeferredCounts.arrived
    monkeypatch.setattr(veloce.table.batch.DeferredCounts, "arrived", lambda self, wait: wait and arrived(self, wait))


@pytest.mark.parametrize("device", DEVICES)
def test_deferred_refusal_in_lookup_many_changes_no_table(device, monkeypatch):
    """lookup_many with a bad layout, its counts not read yet: a table listed twice (its
    second insert) and tables sharing one offsets tensor with other id counts change
    nothing, read zeros, and step() raises the layout's error."""
    _counts_in_flight(monkeypatch)
    a, b, c = (veloce.DynamicEmbedding(4, mode="sum", seed=k, device=device, defer_inserts=True) for k in range(3))
    c.include_last_offset = True
    shared = torch.tensor([0, 5, 10], device=device)
    bad = torch.tensor([0, 4, 2], device=device)
    ids = [torch.arange(n, device=device) + 100 * k for k, n in enumerate((10, 6, 12, 10))]
    outs = veloce.lookup_many([a, b, a, c], [(ids[0], shared), (ids[1], bad), (ids[2], shared), (ids[3], shared)])
    assert all(not o.any() for o in outs)
    with pytest.raises(ValueError, match=r"offsets must be non-decreasing, got offsets\[1\] = 4 > offsets\[2\] = 2"):
        veloce.step_tables([a, b, c])
    assert [len(t) for t in (a, b, c)] == [0, 0, 0]
    outs = veloce.lookup_many([a, c], [(ids[0], shared), (ids[3], shared)])
    assert all(o.any() for o in outs)
    assert [len(t) for t in (a, c)] == [10, 10]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["erase", "clear"])
def test_refusal_read_by_erase_or_clear_raises_first(device, op, monkeypatch):
    _counts_in_flight(monkeypatch)
    emb = veloce.DynamicEmbedding(4, mode="sum", device=device, defer_inserts=True)
    emb(torch.arange(10, device=device).view(2, 5))
    emb(torch.arange(6, device=device) + 50, torch.tensor([0, 4, 2], device=device))  # refused, unread
    with pytest.raises(ValueError, match="non-decreasing"):
        emb.table.erase(torch.arange(5, device=device)) if op == "erase" else emb.table.clear()
    assert len(emb) == 10 and emb.table.find(torch.arange(10, device=device)).min() >= 0
    assert "size>=" not in repr(emb.table)
    emb.table.erase(torch.arange(5, device=device)) if op == "erase" else emb.table.clear()
    assert len(emb) == (5 if op == "erase" else 0)


@pytest.mark.parametrize("device", DEVICES)
def test_a_deferring_table_filling_up_grows_early(device, monkeypatch):
    """A table half way to grow_at that a call would take past it grows first (one doubling
    early) and the call defers; a batch with more ids than grow_at * capacity waits (the
    read-back path grows as it always does)."""
    _counts_in_flight(monkeypatch)
    emb = veloce.DynamicEmbedding(4, mode="sum", capacity=64, device=device, defer_inserts=True)
    emb(torch.arange(40, device=device).view(1, 40))  # 40 <= 0.9 * 64: deferred
    emb(torch.arange(40, 60, device=device).view(1, 20))  # 40 + 20 > 57.6, 40 >= 28.8: grows, defers
    assert emb.capacity == 128 and emb.table._unread
    assert len(emb) == 60 and not emb.table._unread
    bad = (torch.arange(6, device=device) + 1000, torch.tensor([0, 4, 2], device=device))
    emb(*bad)  # deferred: raised at the step
    with pytest.raises(ValueError, match="non-decreasing"):
        emb.step()
    small = veloce.DynamicEmbedding(4, mode="sum", capacity=64, device=device, defer_inserts=True)
    small(torch.arange(10, device=device).view(1, 10))
    with pytest.raises(ValueError, match="non-decreasing"):  # 100 ids > 57.6: the read-back path, which raises here
        small(torch.arange(100, device=device) + 500, torch.tensor([0, 60, 50], device=device))
    assert small.capacity == 64 and len(small) == 10
    small(torch.arange(100, device=device).view(2, 50) + 500)
    assert small.capacity >= 128 and len(small) == 110


@pytest.mark.parametrize("device", DEVICES)
def test_a_load_forgets_an_unread_refusal(device, monkeypatch):
    """A state_dict load replaces the table: a refused deferred forward before it (it changed
    nothing) is forgotten, not raised as a load error; a repr never waits nor raises."""
    _counts_in_flight(monkeypatch)
    src = veloce.DynamicEmbedding(4, mode="sum", device=device)
    src(torch.arange(8, device=device).view(2, 4))
    emb = veloce.DynamicEmbedding(4, mode="sum", device=device, defer_inserts=True)
    emb(torch.arange(6, device=device) + 50, torch.tensor([0, 4, 2], device=device))  # refused, unread
    assert "size>=0" in repr(emb)
    emb.load_state_dict(src.state_dict())
    assert len(emb) == 8 and "size=8" in repr(emb)
    emb.step()  # nothing left to raise


# ---- drop-in for nn.EmbeddingBag: mode="max", argument order, .weight, from_pretrained, TorchScript
def _max_reference(emb, ids, pad=None):
    """An nn.EmbeddingBag(mode="max") over the table's rows of ``ids`` (remapped by a dict),
    with a zero row for an absent padding id; returns (ref, index of each id)."""
    uniq = sorted(set(ids.tolist()) | ({pad} if pad is not None else set()))
    index = {k: i for i, k in enumerate(uniq)}
    rows, _ = emb.find(torch.tensor(uniq, device=ids.device))
    ref = nn.EmbeddingBag(len(uniq), emb.embedding_dim, mode="max", padding_idx=None if pad is None else index[pad],
                          include_last_offset=emb.include_last_offset).to(ids.device)  # fmt: skip
    with torch.no_grad():
        ref.weight.copy_(rows)
    return ref, torch.tensor([index[k] for k in ids.tolist()], dtype=torch.long, device=ids.device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_pad, ilo", [(False, False), (True, False), (False, True), (True, True)])
def test_mode_max_trains_like_embedding_bag_max(device, use_pad, ilo):
    """mode="max" as nn.EmbeddingBag: forward (empty bags, padding, include_last_offset),
    then the rows after five SGD steps (each column's gradient to its bag's argmax row),
    and the eval lookup of the trained rows."""
    g = torch.Generator().manual_seed(5)
    pad = 2**40 + 3 if use_pad else None
    emb = veloce.DynamicEmbedding(6, mode="max", optimizer=veloce.optim.SGD(lr=0.3), padding_idx=pad,
                                  include_last_offset=ilo, initializer=veloce.init.uniform(-1, 1), device=device)
    for _ in range(5):
        ids = torch.randint(0, 12, (30,), generator=g) * 2**40 + 3  # repeats within bags: ties and shared rows
        cuts = torch.sort(torch.randint(0, 31, (7,), generator=g)).values
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), cuts] + ([torch.tensor([30])] if ilo else []))
        ids, offsets = ids.to(device), offsets.to(device)
        target = torch.randn(offsets.numel() - int(ilo), 6, generator=g).to(device)
        out = emb(ids, offsets)
        ref, idx = _max_reference(emb, ids, pad)
        torch.testing.assert_close(out, ref(idx, offsets))
        ((out - target) ** 2).sum().backward()
        ((ref(idx, offsets) - target) ** 2).sum().backward()
        emb.step()
        emb.zero_grad()
        with torch.no_grad():
            ref.weight -= 0.3 * ref.weight.grad
        keys = torch.tensor(sorted(set(ids.tolist()) | ({pad} if pad is not None else set())), device=device)
        rows, _ = emb.find(keys)
        torch.testing.assert_close(rows, ref.weight.detach(), atol=1e-6, rtol=1e-6)
    assert pad is None or not bool(emb.find(torch.tensor([pad], device=device))[1].any())
    emb.eval()
    ref, idx = _max_reference(emb, ids, pad)
    torch.testing.assert_close(emb(ids, offsets), ref(idx, offsets))


@pytest.mark.parametrize("device", DEVICES)
def test_mode_max_with_2d_input_lookup_many_and_unknown_ids_in_eval(device):
    """mode="max" through lookup_many beside a sum table (one autograd node for both), 2-D
    input, and eval lookups of unseen ids (their initial rows, or zeros)."""
    a = veloce.DynamicEmbedding(4, mode="max", optimizer=veloce.optim.SGD(lr=0.5), device=device, seed=1)
    b = veloce.DynamicEmbedding(4, mode="sum", optimizer=veloce.optim.SGD(lr=0.5), device=device, seed=2)
    a2, b2 = copy.deepcopy(a), copy.deepcopy(b)
    x = torch.tensor([[1, 5, 5], [7, 1, 9]], device=device)
    outs = veloce.lookup_many([a, b], [x, x])
    outs2 = [a2(x), b2(x)]
    torch.testing.assert_close(outs[0], outs2[0])
    torch.testing.assert_close(outs[1], outs2[1])
    (outs[0].sum() + outs[1].sum()).backward()
    (outs2[0].sum() + outs2[1].sum()).backward()
    veloce.step_tables([a, b, a2, b2])
    assert_same_snapshot(snapshot(a), snapshot(a2))
    assert_same_snapshot(snapshot(b), snapshot(b2))
    a.eval()
    unseen = torch.tensor([[123, 1]], device=device)
    rows = torch.cat([ref_init_rows([123], 4, a.table.initializer, seed=1).to(device), a.find(unseen[0, 1:])[0]])
    torch.testing.assert_close(a(unseen), rows.max(0).values.unsqueeze(0))
    a.unknown = "zeros"
    torch.testing.assert_close(a(unseen), rows[1:].clamp(min=0))
    with pytest.raises(ValueError, match="per_sample_weights is only supported with mode='sum', got mode='max'"):
        a(x, per_sample_weights=torch.ones(2, 3, device=device))


def test_embedding_bag_argument_order_says_what_to_write():
    """nn.EmbeddingBag(1000, 8) is (num_embeddings, embedding_dim): the error says the
    DynamicEmbedding call that means the same."""
    with pytest.raises(TypeError, match=r"write DynamicEmbedding\(8\) \(capacity=1000 pre-sizes the table"):
        veloce.DynamicEmbedding(1000, 8)
    with pytest.raises(ValueError, match="mode must be 'sum', 'mean' or 'max', got 'min'"):
        veloce.DynamicEmbedding(8, mode="min")


def test_weight_access_says_what_to_use_instead():
    emb = veloce.DynamicEmbedding(4)
    with pytest.raises(AttributeError, match=r"no attribute 'weight': .*find\(ids\).*from_pretrained"):
        emb.weight
    with pytest.raises(AttributeError, match="no attribute 'num_embeddings': there is no vocabulary size"):
        emb.num_embeddings
    assert not hasattr(emb, "weight")
    with pytest.raises(AttributeError, match="no attribute 'bias'$"):
        emb.bias


@pytest.mark.parametrize("device", DEVICES)
def test_from_pretrained_reads_the_rows_and_a_frozen_table_never_changes(device):
    """from_pretrained(weight) looks up like nn.EmbeddingBag.from_pretrained(weight); frozen
    (the default), training changes nothing even after model.train(), and per-sample
    weights still get their gradient; freeze=False trains the rows."""
    weight = torch.randn(10, 3, generator=torch.Generator().manual_seed(0)).to(device)
    x, offsets, psw = (torch.tensor([1, 4, 4, 9], device=device), torch.tensor([0, 1], device=device),
                       torch.rand(4, device=device, requires_grad=True))  # fmt: skip
    ref = nn.EmbeddingBag.from_pretrained(weight, mode="sum")
    emb = veloce.DynamicEmbedding.from_pretrained(weight, mode="sum", optimizer=veloce.optim.SGD(lr=1.0))
    assert emb.frozen and len(emb) == 10 and emb.table.dtype == weight.dtype
    nn.Sequential(emb).train()
    before = snapshot(emb)
    out = emb(torch.cat([x, torch.tensor([77], device=device)]), offsets,
              torch.cat([psw, torch.ones(1, device=device)]))  # an unknown id: no insert
    torch.testing.assert_close(out, ref(x, offsets, psw) + torch.stack(
        [torch.zeros(3, device=device), ref_init_rows([77], 3, emb.table.initializer).to(device)[0]]))
    out.sum().backward()
    emb.step()
    assert_same_snapshot(before, snapshot(emb))
    assert psw.grad is not None and bool((psw.grad != 0).all())
    ids = torch.tensor([5, -3], device=device)
    trained = veloce.DynamicEmbedding.from_pretrained(weight[:2], ids=ids, freeze=False,
                                                      optimizer=veloce.optim.SGD(lr=1.0), mode="sum")  # fmt: skip
    assert not trained.frozen and trained.training
    trained(ids, torch.tensor([0], device=device)).sum().backward()
    trained.step()
    torch.testing.assert_close(trained.find(ids)[0], weight[:2] - 1.0)
    with pytest.raises(ValueError, match=r"ids must be an int64 tensor of shape \(2,\)"):
        veloce.DynamicEmbedding.from_pretrained(weight[:2], ids=torch.tensor([1]))


def test_torchscript_says_it_is_not_supported():
    model = nn.Sequential(veloce.DynamicEmbedding(4), nn.Linear(4, 1))
    with pytest.raises(RuntimeError, match=r"DynamicEmbedding does not support TorchScript \(torch.jit.script\)"):
        torch.jit.script(model)


# ---- a PyTorch user's habits: a plain torch optimizer loop, validation under no_grad ------------
class _Net(nn.Module):
    """A table and a dense layer, trained as a PyTorch user trains an nn.EmbeddingBag model."""

    def __init__(self, device="cpu", **kw):
        super().__init__()
        torch.manual_seed(0)
        self.emb = veloce.DynamicEmbedding(4, mode="sum", device=device, **kw)
        self.lin = nn.Linear(4, 1).to(device)

    def forward(self, ids):
        return self.lin(self.emb(ids)).squeeze(1)


_IDS = torch.tensor([[1, 2, 3], [3, 2**40, -7]])


def test_plain_torch_adam_loop_raises_naming_combined_optimizer():
    model = _Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)  # the tables are not among these parameters
    model(_IDS).sum().backward()
    opt.step()
    opt.zero_grad()
    before = snapshot(model.emb)
    with pytest.raises(RuntimeError, match=r"veloce\.CombinedOptimizer\(") as err:
        model(_IDS + 100)  # the loop goes round: the table was never stepped
    assert "emb.step()" in str(err.value) and "emb.zero_grad()" in str(err.value)
    assert_same_snapshot(before, snapshot(model.emb))  # the refused forward changed nothing
    model.emb.zero_grad()  # the waiting gradient dropped: the loop may go on
    model(_IDS).sum().backward()


def test_combined_optimizer_loop_trains_the_tables():
    model = _Net()
    opt = veloce.CombinedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), model)
    rows = [model.emb.find(torch.tensor([1]))[0]]
    for _ in range(3):
        model(_IDS).sum().backward()
        opt.step()
        opt.zero_grad()
        rows.append(model.emb.find(torch.tensor([1]))[0])
    assert model.emb.step_count == 3
    assert all(not torch.equal(a, b) for a, b in zip(rows, rows[1:]))


def test_dense_step_then_table_step_accumulation_and_validation_stay_allowed():
    model = _Net()
    dense = torch.optim.SGD(model.lin.parameters(), lr=0.1)
    for _ in range(3):
        for _ in range(4):  # gradient accumulation over several backward passes
            model(_IDS).sum().backward()
        with torch.no_grad():  # a validation lookup between the backward and the step
            model(_IDS + 100)
        dense.step()
        model.emb.step()  # after the dense step: allowed
        dense.zero_grad()
        model.emb.zero_grad()
    assert model.emb.step_count == 3


def test_backward_passes_waiting_for_a_step_are_bounded():
    assert veloce.DynamicEmbedding.max_pending_backwards == 1024  # the documented default
    model = _Net()
    model.emb.max_pending_backwards = 3
    for _ in range(3):  # a loop with no optimizer at all: nothing else would stop it
        model(_IDS).sum().backward()
    with pytest.raises(RuntimeError, match=r"3 backward passes .*\(max_pending_backwards = 3\)"):
        model(_IDS)
    model.emb.step()
    model(_IDS).sum().backward()  # the step emptied it


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("no_grad", [torch.no_grad, torch.inference_mode])
def test_validation_under_no_grad_in_train_mode_changes_no_table(device, no_grad):
    emb = veloce.DynamicEmbedding(4, mode="mean", max_capacity=32, device=device)
    trained = torch.arange(24, device=device).view(6, 4)
    emb(trained).sum().backward()
    emb.step()
    emb.zero_grad()
    before, clock = snapshot(emb), emb.table.clock
    val = torch.cat([trained[:2], torch.arange(1000, 1064, device=device).view(8, 8)[:, :4]])  # known and new ids
    with no_grad():  # no model.eval(): the table stays in training mode
        got = emb(val)
        (got_many,) = veloce.lookup_many([emb], [val])
    assert emb.training
    assert_same_snapshot(before, snapshot(emb))  # nothing inserted, evicted or scored
    assert emb.table.clock == clock
    emb.eval()
    want = emb(val)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_many, want)
