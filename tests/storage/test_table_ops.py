"""A TieredTable's calls over both tiers against an all-in-memory HashTable: insert,
erase, len, find, export, load_entries, clear, snapshot / restore, max_capacity (lru
evicts from the store, "none" raises), TTL expiry, last_seen, stats() counts, and the
refusal of CUDA graph capture."""

from __future__ import annotations

import copy

import pytest
import torch

import veloce
from _tiers import DIM, assert_same_entries, batches, cached, make
from conftest import DEVICES
from veloce.storage import HostCached, HostStore, TieredTable
from veloce.table import HashTable, TableFullError

STATE = 2


def _pair(device: str, cache_rows: int = 16, **kwargs) -> tuple[HashTable, TieredTable]:
    ref = HashTable(DIM, STATE, device=device, **kwargs)
    tiered = HostCached(cache_rows=cache_rows).make_table(dim=DIM, state_dim=STATE, device=device, **kwargs)
    return ref, tiered


def _rows(n: int, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, DIM, generator=g).to(device), torch.randn(n, STATE, generator=g).to(device),
            torch.randint(0, 100, (n,), generator=g).to(device))  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_insert_erase_find_export_over_both_tiers(eviction, device):
    ref, tiered = _pair(device, eviction=eviction)
    ids = torch.randperm(1000)[:300].to(device)
    w, o, s = _rows(300, 0, device)
    for t in (ref, tiered):
        t.insert(ids[:10], w[:10])  # fits the cache: written there
        t.insert(ids, w, o, s)  # most go to the store
    assert len(tiered) == len(ref) == 300 and tiered.size <= 16
    assert_same_entries(tiered.export(), ref.export())
    # assign: rows in either tier keep their optimizer state; scores follow the policy (LFU counts uses)
    again = torch.cat([ids[:50], ids[:5]])
    for t in (ref, tiered):
        t.insert(again, torch.ones(again.numel(), DIM, device=device))
    assert_same_entries(tiered.export(), ref.export())
    # new ids past the cache with no state given take the initial state and the policy's score
    new = torch.arange(5000, 5040, device=device)
    for t in (ref, tiered):
        t.clock = 9
        t.insert(new, torch.zeros(40, DIM, device=device))
    assert_same_entries(tiered.export(), ref.export())
    gone = torch.cat([ids[::3], torch.tensor([-1, 123456], device=device)])
    assert tiered.erase(gone) == ref.erase(gone) == 100
    assert len(tiered) == len(ref) == 240
    assert_same_entries(tiered.export(), ref.export())
    chunks = list(tiered.export_chunks(7))
    assert all(c["keys"].numel() <= 7 for c in chunks) and sum(c["keys"].numel() for c in chunks) == 240
    tiered.clear()
    assert len(tiered) == 0 and tiered.export()["keys"].numel() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_load_entries_fills_the_cache_with_the_hottest_rows(device):
    ref, tiered = _pair(device)
    keys = torch.randperm(10_000)[:500].to(device)
    w, o, s = _rows(500, 1, device)
    entries = {"keys": keys, "weights": w, "optimizer_state": o, "scores": s}
    ref.load_entries(entries)
    tiered.load_entries(entries)
    assert len(tiered) == 500 and tiered.size == 16
    assert_same_entries(tiered.export(), ref.export())
    cached_scores = tiered.export_chunks(1 << 20).__next__()["scores"]
    assert cached_scores.min() >= s.sort(descending=True).values[15].cpu()
    with pytest.raises(ValueError, match="repeated"):
        tiered.load_entries({k: torch.cat([v, v[:1]]) for k, v in entries.items()})
    assert_same_entries(tiered.export(), ref.export())  # a refused load changes nothing


@pytest.mark.parametrize("device", DEVICES)
def test_snapshot_restore_puts_back_both_tiers(device):
    _, tiered = _pair(device)
    w, o, s = _rows(100, 2, device)
    tiered.insert(torch.arange(100, device=device), w, o, s)
    before = tiered.export()
    snap = tiered.snapshot()
    w2, o2, s2 = _rows(60, 3, device)
    tiered.load_entries({"keys": torch.arange(1000, 1060, device=device), "weights": w2, "optimizer_state": o2,
                         "scores": s2})  # fmt: skip
    tiered.restore(snap)
    assert_same_entries(tiered.export(), before, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_max_capacity_counts_every_tier(device):
    emb = make(cached(64), device=device, max_capacity=300)
    for ids, offsets in batches(30, seed=1, device=device):
        emb(ids, offsets).sum().backward()
        emb.step()
        emb.zero_grad()
        assert len(emb) <= 300
    stats = emb.stats()
    assert len(emb) == 300 and stats["evicted"] == emb.table.num_evicted > 0
    assert stats["rows"] == stats["cache_rows"] + stats["store_rows"] == 300
    gone = emb.table.last_evicted
    assert gone.numel() and not emb.find(gone.to(device))[1].any()

    full = make(cached(64), device=device, max_capacity=100, eviction="none")
    it = batches(10, seed=2, device=device)
    for ids, offsets in [next(it), next(it)]:
        full(ids, offsets).sum().backward()
        full.step()
        full.zero_grad()
    before = full.export()
    ids, offsets = next(it)
    with pytest.raises(TableFullError, match="max_capacity 100.*eviction='none'"):
        full(ids, offsets)
    assert_same_entries(full.export(), before, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_ttl_expires_rows_of_both_tiers(device):
    policy = veloce.eviction.TTL(steps=3, check_every=1)
    ref, tiered = make(None, device=device, eviction=policy), make(cached(64), device=device, eviction=policy)
    for ids, offsets in batches(12, seed=3, device=device):
        for t in (ref, tiered):
            t(ids, offsets).sum().backward()
            t.step()
            t.zero_grad()
        assert len(tiered) == len(ref)
    assert tiered.table.num_expired == ref.table.num_expired > 0
    assert_same_entries(tiered.export(), ref.export())
    probe = torch.arange(0, 2000, device=device)
    assert torch.equal(tiered.table.last_seen(probe), ref.table.last_seen(probe))


@pytest.mark.parametrize("device", DEVICES)
def test_stats_count_hits_misses_fetches_and_write_backs(device):
    emb = make(HostCached(cache_rows=4, evict_fraction=0.25), device=device)
    entry = DIM * 4 + emb.table.state_dim * 4 + 16

    def train(ids):
        emb(torch.tensor(ids, device=device), torch.tensor([0], device=device)).sum().backward()
        emb.step()
        emb.zero_grad()

    train([1, 2, 3])  # three new ids
    train([4, 5])  # two new ids; one of 1, 2, 3 written back
    train([1, 2, 3])  # two hits, one fetched; one of 4, 5 written back
    stats = emb.stats(reset=True)
    assert (stats["hits"], stats["misses"], stats["fetched"], stats["written_back"]) == (2, 6, 1, 2)
    assert (stats["fetched_last_step"], stats["written_back_last_step"]) == (1, 1)
    assert stats["bytes_fetched"] == entry and stats["bytes_written_back"] == 2 * entry
    assert stats["hit_rate"] == pytest.approx(2 / 8)
    assert (stats["rows"], stats["cache_rows"], stats["store_rows"], stats["cache_capacity"]) == (5, 4, 1, 4)
    after = emb.stats()
    assert (after["hits"], after["misses"], after["fetched"], after["hit_rate"]) == (0, 0, 0, 0.0)
    plain = make(None, device=device, max_capacity=50).stats()
    # a table on its device: the same call gives its size and health (no tier keys)
    assert {k: plain[k] for k in ("rows", "max_capacity", "evicted", "evicted_within_n", "returned_within_n")} == {
        "rows": 0, "max_capacity": 50, "evicted": 0, "evicted_within_n": 0, "returned_within_n": 0}
    assert not {"cache_rows", "store_rows", "hit_rate"} & set(plain)


def test_a_tiered_table_refuses_cuda_graph_capture_and_deferral():
    emb = make(cached(16), defer_inserts=True)
    for ask in (emb.table.state_addresses, lambda: emb.table.has_deferred_room(4),
                lambda: emb.table.make_deferred_room(4)):  # what CUDAGraphStep asks of a table
        with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
            ask()
    emb(torch.arange(10), torch.tensor([0]))  # never defers: its insert reads the counts at once
    assert not emb.table._unread and len(emb) == 10


def test_a_store_of_other_dims_is_refused():
    store = HostStore(DIM + 1, STATE, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="make the store for this table"):
        TieredTable(store, 16, DIM, STATE)
    with pytest.raises(ValueError, match="state_dtype must be torch.float32"):
        HostStore(DIM, STATE, torch.float16, torch.float16)


def test_a_deep_copy_holds_its_own_store():
    emb = make(cached(16))
    for ids, offsets in batches(3, distinct=12):
        emb(ids, offsets).sum().backward()
        emb.step()
        emb.zero_grad()
    twin = copy.deepcopy(emb)
    assert_same_entries(twin.export(), emb.export(), atol=0)
    twin.erase(twin.export()["keys"])
    assert len(twin) == 0 and len(emb) > 16


def test_dtype_casts_follow_into_the_store():
    emb = make(cached(16))
    for ids, offsets in batches(3, distinct=12):
        emb(ids, offsets).sum().backward()
        emb.step()
        emb.zero_grad()
    emb.double()
    assert emb.table.store.dtype == torch.float64 and emb.export()["weights"].dtype == torch.float64
    assert len(emb) > 16
