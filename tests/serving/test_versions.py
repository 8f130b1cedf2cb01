"""Row versions: ``export(since=clock)`` returns exactly the rows changed and the ids removed
after a clock (host tensors, whatever the table's device), on device tables and tiered ones
(both tiers), on the CPU and the GPU, under eviction, erase and expiry; the tombstone log's
bounds and the policies that cannot answer."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES

import veloce
from veloce.eviction import TTL
from veloce.storage import HostCached
from veloce.table.versions import VersionsUnavailable


def make(storage=None, eviction="lru", max_capacity=64, device="cpu") -> veloce.DynamicEmbedding:
    return veloce.DynamicEmbedding(4, mode="sum", max_capacity=max_capacity, eviction=eviction, storage=storage,
                                   optimizer=veloce.optim.SGD(lr=0.1), device=device)  # fmt: skip


def train(emb, steps: int, gen: torch.Generator, pool: int = 150) -> set[int]:
    """Training steps on random bags (drawn on the host, looked up on the table's device);
    returns the ids looked up."""
    seen: set[int] = set()
    emb.train()
    for _ in range(steps):
        x = torch.randint(0, pool, (8, 3), generator=gen)
        seen |= set(x.flatten().tolist())
        emb(x.to(emb.table.device)).pow(2).sum().backward()
        emb.step()
    return seen


def rows(emb) -> dict[int, torch.Tensor]:
    e = emb.export()
    return dict(zip(e["keys"].tolist(), e["weights"].cpu()))


STORAGES = {"device": lambda: None, "host_cached": lambda: HostCached(cache_rows=32)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("eviction", ["lru", "none", TTL(steps=3)], ids=["lru", "none", "ttl"])
@pytest.mark.parametrize("storage", sorted(STORAGES))
def test_export_since_is_exact(storage, eviction, device):
    gen = torch.Generator().manual_seed(0)
    emb = make(STORAGES[storage](), eviction, max_capacity=None if eviction == "none" else 64, device=device)
    train(emb, 4, gen)
    emb.track_removed()
    resent: set[int] = set()  # erased outside a lookup after the last export: stamped after its clock, sent again
    for _ in range(3):  # several rounds: each export since the previous clock
        clock, before = emb.table.clock, rows(emb)
        seen = train(emb, 3, gen)
        erased = set(list(before)[:3])
        emb.erase(torch.tensor(sorted(erased), device=device))
        now = rows(emb)
        d = emb.export(since=clock, values_only=True)
        assert "optimizer_state" not in d and int(d["clock"]) == emb.table.clock
        assert all(t.device.type == "cpu" for t in d.values())
        keys, removed = set(d["keys"].tolist()), set(d["removed"].tolist())
        assert len(keys) == d["keys"].numel()
        assert keys == seen & set(now)  # changed: looked up since the clock and still held
        for k, w in zip(d["keys"].tolist(), d["weights"]):
            assert torch.equal(w, now[k])
        for k in set(now) - keys:  # every other row is as it was at the clock
            assert torch.equal(now[k], before[k])
        gone = (set(before) | seen) - set(now)
        assert gone <= removed  # every id removed since the clock has its tombstone
        assert removed - gone <= set(now) | resent  # the others were removed and came back (their row is in keys)
        assert erased <= removed
        assert (d["removed_at"] > clock).all()
        emb.forget_removed(emb.table.clock)
        resent = erased


@pytest.mark.parametrize("device", DEVICES)
def test_evictions_both_tiers_and_counts(device):
    gen = torch.Generator().manual_seed(1)
    emb = make(HostCached(cache_rows=32), max_capacity=48, device=device)
    train(emb, 2, gen)
    emb.track_removed()
    clock = emb.table.clock
    train(emb, 5, gen)
    d = emb.export(since=clock)
    assert emb.table.num_evicted > 0 and d["removed"].numel() >= 1
    assert "optimizer_state" in d and d["optimizer_state"].shape == (d["keys"].numel(), emb.table.state_dim)
    assert emb.table.removed_log.count == d["removed"].numel()
    emb.forget_removed(emb.table.clock)
    assert emb.table.removed_log.count == 0 and emb.export(since=emb.table.clock)["removed"].numel() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_refusals(device):
    gen = torch.Generator().manual_seed(2)
    lfu = make(eviction="lfu", device=device)
    train(lfu, 1, gen)
    lfu.track_removed()
    with pytest.raises(ValueError, match="LFU.*use counts"):
        lfu.export(since=0)
    emb = make(device=device)
    train(emb, 2, gen)
    with pytest.raises(VersionsUnavailable, match="not running"):
        emb.export(since=1)  # the log was never started
    emb.track_removed()
    with pytest.raises(VersionsUnavailable, match="after clock 2"):
        emb.export(since=1)  # before the log started
    with pytest.raises(ValueError, match="since must be an int"):
        emb.export(since=-1)
    emb.export(since=2)
    emb.table.clear()  # removes ids it does not list: the log stops
    with pytest.raises(VersionsUnavailable, match="not running"):
        emb.export(since=2)


@pytest.mark.parametrize("device", DEVICES)
def test_log_bound_drops_oldest(device):
    gen = torch.Generator().manual_seed(3)
    emb = make(max_capacity=32, device=device)
    emb.track_removed(limit=8)
    start = emb.table.clock
    train(emb, 6, gen)
    log = emb.table.removed_log
    assert log.count <= 8 and log.start > start
    with pytest.raises(VersionsUnavailable, match="complete only after"):
        emb.export(since=start)
    emb.export(since=log.start)
    with pytest.raises(ValueError, match="limit must be"):
        emb.track_removed(limit=0)
