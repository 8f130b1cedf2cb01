"""Eviction policies (veloce.eviction): the registry, the expire op against a plain-Python
reference (CPU and CUDA), and the time-to-live policy on tables and modules: expiry while
not full, its boundary, LRU eviction at max_capacity, re-initialisation, pending gradients,
checkpoints, and a hypothesis model of a table's ids and last-seen steps."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import veloce
from veloce import checkpoint as ckpt
from veloce.eviction import LFU, LRU, POLICIES, TTL, NoEviction, resolve
from veloce.ops import hash_table as ht
from veloce.optim import SGD
from veloce.table import HashTable

from conftest import DEVICES, ref_init_rows  # noqa: E402

pytestmark = pytest.mark.skipif(not veloce.ops.extension.loaded, reason="veloce._C is not built")
HYP = settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def ids(values, device="cpu") -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64, device=device)


def contents(table: HashTable) -> dict[int, int]:
    """id -> score of every row of a table."""
    e = table.export()
    return dict(zip(e["keys"].tolist(), e["scores"].tolist()))


# ---- the registry ------------------------------------------------------------------------


def test_names_select_their_policies():
    assert {n: type(resolve(n)) for n in ("lru", "lfu", "none")} == {"lru": LRU, "lfu": LFU, "none": NoEviction}
    assert POLICIES == {"lru": LRU, "lfu": LFU, "none": NoEviction}
    ttl = TTL(steps=10)
    assert resolve(ttl) is ttl and ttl.check_every == 1 and TTL(steps=800).check_every == 100
    assert TTL(5, check_every=2) == TTL(5, 2) != TTL(5, 3) and repr(TTL(5, 2)) == "TTL(steps=5, check_every=2)"
    for name, score in (("lru", 1), ("lfu", 2), ("none", 1)):
        t = HashTable(4, 0, eviction=name)
        assert t.eviction == name and t.score_policy == score
    t = HashTable(4, 0, eviction=TTL(3))
    assert t.eviction == "ttl" and t.score_policy == 1 and "TTL(steps=3" in repr(t)


@pytest.mark.parametrize("bad", ["fifo", "ttl", 3, None])
def test_unknown_eviction_names_the_accepted_values(bad):
    with pytest.raises(ValueError, match=r"eviction must be one of 'lru', 'lfu', 'none' or a veloce.eviction"):
        veloce.DynamicEmbedding(4, eviction=bad)
    if bad == "ttl":
        with pytest.raises(ValueError, match=r"TTL\(steps=N\)"):
            HashTable(4, 0, eviction=bad)


@pytest.mark.parametrize("kw", [{"steps": 0}, {"steps": -3}, {"steps": 1.5}, {"steps": True}, {"steps": "4"},
                                {"steps": 4, "check_every": 0}, {"steps": 4, "check_every": 2.0}])  # fmt: skip
def test_ttl_refuses_bad_arguments(kw):
    with pytest.raises(ValueError, match=r"TTL: (steps|check_every) must be an int >= 1"):
        TTL(**kw)


def test_last_seen_needs_step_scores_and_expire_an_int():
    with pytest.raises(ValueError, match="last_seen: .*use counts"):
        HashTable(4, 0, eviction="lfu").last_seen(ids([1]))
    with pytest.raises(ValueError, match="expire: before must be an int"):
        HashTable(4, 0).expire(1.5)


# ---- the expire op -------------------------------------------------------------------------


def filled(n: int, capacity: int, device, seed: int = 0):
    """A table of ``capacity`` slots holding ids 1000.. with random scores in [0, 50)."""
    g = torch.Generator().manual_seed(seed)
    t = [torch.zeros(capacity, dtype=torch.int64, device=device), torch.zeros(capacity, dtype=torch.uint8, device=device),
         torch.zeros(capacity, dtype=torch.int64, device=device), torch.zeros(capacity, 2, device=device),
         torch.zeros(capacity, 0, device=device)]  # fmt: skip
    keys = ids(range(1000, 1000 + n), device)
    scores = torch.randint(0, 50, (n,), generator=g).to(device)
    _, counts, _ = ht.insert_or_assign(*t, keys, torch.zeros(n, 2, device=device), score_values=scores)
    assert counts.tolist() == [n, 0]
    return t, dict(zip(keys.tolist(), scores.tolist()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("before", [-5, 0, 20, 50, 1 << 40])
def test_expire_erases_the_rows_scored_below_before(device, before):
    t, ref = filled(700, 1024, device)
    erased = ht.expire(t[0], t[1], t[2], before)
    assert erased.dim() == 0 and erased.device == t[0].device
    assert int(erased) == sum(s < before for s in ref.values())
    keys, _, _, scores = ht.export(*t, 0, 1024)
    assert dict(zip(keys.tolist(), scores.tolist())) == {k: s for k, s in ref.items() if s >= before}
    assert int(ht.expire(t[0], t[1], t[2], before)) == 0  # nothing left below it


@CUDA
def test_cuda_expire_equals_cpu():
    cpu, _ = filled(30000, 40960, "cpu", seed=3)
    gpu = [x.cuda() for x in cpu]
    assert int(ht.expire(cpu[0], cpu[1], cpu[2], 25)) == int(ht.expire(gpu[0], gpu[1], gpu[2], 25))
    for a, b in zip(cpu, gpu):
        assert torch.equal(a, b.cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_expire_checks_its_table_and_opchecks(device):
    t, _ = filled(10, 64, device)
    with pytest.raises(RuntimeError, match=r"veloce::expire: scores must have as many slots"):
        ht.expire(t[0], t[1], t[2][:32], 3)
    torch.library.opcheck(torch.ops.veloce.expire.default, (t[0], t[1].clone(), t[2], 20))


# ---- TTL on a table ------------------------------------------------------------------------


def lookup(table: HashTable, batch, device="cpu") -> torch.Tensor:
    """A training lookup's insert (one clock tick)."""
    return table.find_or_insert(ids(batch, device))


@pytest.mark.parametrize("device", DEVICES)
def test_ttl_boundary_keeps_rows_seen_within_steps_ticks(device):
    """steps=3: at clock T a row last seen at s stays while T - s <= 3 and goes at T - s = 4;
    the current lookup's rows always stay, steps=1 included."""
    table = HashTable(4, 0, eviction=TTL(steps=3), device=device)
    lookup(table, [1, 2], device)  # clock 1
    lookup(table, [2, 3], device)  # clock 2
    lookup(table, [4], device)  # clock 3
    lookup(table, [5], device)  # clock 4: id 1 is 3 ticks old: kept
    assert set(contents(table)) == {1, 2, 3, 4, 5}
    lookup(table, [5], device)  # clock 5: id 1 is 4 ticks old: gone; 2 and 3 (seen at 2) stay
    assert set(contents(table)) == {2, 3, 4, 5} and table.num_expired == 1 and len(table) == 4
    assert table.last_seen(ids([2, 3, 4, 5, 1], device)).tolist() == [2, 2, 3, 5, -1]
    one = HashTable(4, 0, eviction=TTL(steps=1), device=device)
    for k in range(5):
        lookup(one, [10 * k, 10 * k + 1], device)
        assert set(contents(one)) == ({10 * (k - 1), 10 * (k - 1) + 1} if k else set()) | {10 * k, 10 * k + 1}


@pytest.mark.parametrize("device", DEVICES)
def test_ttl_expires_a_table_far_from_full_every_check_every_ticks(device):
    table = HashTable(4, 0, capacity=4096, eviction=TTL(steps=2, check_every=4), device=device)
    version = table.version
    for k in range(1, 8):  # ids seen once each, at clock k
        lookup(table, [k], device)
    # expiry ran at clock 4 (rows older than 2 ticks: clock 1) only
    assert set(contents(table)) == {2, 3, 4, 5, 6, 7} and table.version == version + 1
    lookup(table, [8], device)  # clock 8: rows seen before 6 go
    assert set(contents(table)) == {6, 7, 8} and table.num_expired == 5 and len(table) == 3
    assert table.capacity == 4096 and table.max_capacity is None


@pytest.mark.parametrize("device", DEVICES)
def test_ttl_evicts_like_lru_at_max_capacity(device):
    """With a lifetime longer than the run, a TTL table at max_capacity keeps and evicts
    exactly the rows an LRU table does."""
    g = torch.Generator().manual_seed(1)
    lru = HashTable(4, 0, max_capacity=200, eviction="lru", device=device)
    ttl = HashTable(4, 0, max_capacity=200, eviction=TTL(steps=10_000), device=device)
    for _ in range(30):
        batch = torch.randint(0, 600, (40,), generator=g).tolist()
        assert torch.equal(lookup(lru, batch, device), lookup(ttl, batch, device))
        assert torch.equal(lru.last_evicted, ttl.last_evicted)
    assert lru.num_evicted > 0 and len(ttl) == 200 and contents(lru) == contents(ttl)


@pytest.mark.parametrize("device", DEVICES)
def test_failed_lookup_takes_back_its_tick_and_expires_nothing(device):
    table = HashTable(4, 0, max_capacity=32, eviction=TTL(steps=1), device=device)
    lookup(table, range(20), device)
    bad = torch.ones(1, dtype=torch.bool, device=device)
    with pytest.raises(ValueError, match="bad_input is set"):
        table.find_or_insert(ids([5], device), bad_input=bad)
    assert table.clock == 1 and len(table) == 20 and table.num_expired == 0


def test_ttl_table_refuses_cuda_graph_capture(monkeypatch):
    """Inside a capture (veloce.runtime.capture.ACTIVE) a TTL table's lookup raises: its expiry
    reads a count back, which a graph cannot."""
    table = HashTable(4, 0, eviction=TTL(steps=2))
    monkeypatch.setattr(veloce.runtime.capture, "ACTIVE", object())
    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
        table._expire_due()


# ---- TTL on a module ----------------------------------------------------------------------


def emb_ttl(device, steps=1, **kw) -> veloce.DynamicEmbedding:
    return veloce.DynamicEmbedding(4, mode="sum", capacity=32, optimizer=SGD(lr=1.0),
                                   eviction=TTL(steps=steps, check_every=1), device=device, **kw)  # fmt: skip


def train(emb, batch, device, backward=True):
    out = emb(ids(batch, device).view(-1, 1))
    if backward:
        out.sum().backward()
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_expired_row_seen_again_is_initialized_from_seed_and_id(device):
    emb = emb_ttl(device, seed=7)
    for _ in range(3):  # id 5 trained away from its initial row
        train(emb, [5], device)
        emb.step()
        emb.zero_grad()
    init = ref_init_rows([5], 4, emb.table.initializer, seed=7).to(device)
    assert not torch.allclose(emb.find(ids([5], device))[0], init)
    for k in range(3):  # three lookups without id 5: it expires
        train(emb, [100 + k], device, backward=False)
    assert not bool(emb.find(ids([5], device))[1].any())
    out = train(emb, [5], device, backward=False)
    torch.testing.assert_close(out, init)


@pytest.mark.parametrize("device", DEVICES)
def test_pending_gradient_of_an_expired_row_is_not_applied_to_the_row_that_took_its_slot(device):
    """One 32-slot bucket: id 1's row expires while its gradient waits, and id 9 takes its
    slot; step() applies nothing to id 9 (it finds id 1 by id, absent)."""
    emb = emb_ttl(device)
    train(emb, [1], device)  # clock 1, slot 0, gradient pending
    slot = int(emb.table.find(ids([1], device)))
    train(emb, [2], device, backward=False)  # clock 2
    train(emb, [3], device, backward=False)  # clock 3: id 1 expires
    train(emb, [9], device, backward=False)  # clock 4: id 9 in id 1's old slot
    assert int(emb.table.find(ids([9], device))) == slot
    before = emb.find(ids([9], device))[0].clone()
    emb.step()
    assert torch.equal(emb.find(ids([9], device))[0], before)
    assert not bool(emb.find(ids([1], device))[1].any())


def test_ttl_table_round_trips_last_seen_and_clock_and_expires_alike(tmp_path):
    a = emb_ttl("cpu", steps=3)
    for k in range(6):
        train(a, [k, k + 1, 50], "cpu")
        a.step()
        a.zero_grad()
    ckpt.save(tmp_path / "c", a)
    b = emb_ttl("cpu", steps=3)
    ckpt.load(tmp_path / "c", b)
    probe = ids(range(60))
    assert b.table.clock == a.table.clock and torch.equal(a.table.last_seen(probe), b.table.last_seen(probe))
    for k in range(6, 12):
        for m in (a, b):
            train(m, [k, 50], "cpu")
            m.step()
            m.zero_grad()
        assert contents(a.table) == contents(b.table)
    assert a.table.num_expired > 0


@pytest.mark.parametrize("device", DEVICES)
@HYP
@given(
    steps=st.integers(1, 4),
    every=st.integers(1, 3),
    batches=st.lists(st.lists(st.integers(0, 12), max_size=6), min_size=1, max_size=14),
)
def test_ttl_table_matches_a_model_of_ids_and_last_seen_steps(device, steps, every, batches):
    table = HashTable(4, 0, eviction=TTL(steps, check_every=every), device=device)
    last: dict[int, int] = {}  # the model: id -> last-seen step
    for clock, batch in enumerate(batches, start=1):
        lookup(table, batch, device)
        last.update({i: clock for i in batch})
        if clock % every == 0:
            last = {i: s for i, s in last.items() if clock - s <= steps}
        assert contents(table) == last and len(table) == len(last)
    probe = ids(range(13), device)
    assert table.last_seen(probe).tolist() == [last.get(i, -1) for i in range(13)]
