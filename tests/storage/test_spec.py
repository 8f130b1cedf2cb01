"""veloce.storage's specs: Device and HostCached make their tables, cache_bytes in rows,
the cache policy against the table's scores, and clear errors for bad arguments."""

from __future__ import annotations

import pytest
import torch

import veloce
from _tiers import DIM, make
from veloce.storage import Device, HostCached, TieredTable, cache_row_bytes
from veloce.table import HashTable


def test_device_is_the_default_and_makes_a_plain_table():
    emb = make(None)
    assert type(emb.table) is HashTable and emb.storage == Device()
    assert "storage" not in repr(emb)
    assert type(make(Device()).table) is HashTable


def test_host_cached_makes_a_tiered_table_with_its_cache_rows():
    emb = make(HostCached(cache_rows=100), max_capacity=5000, eviction="lfu")
    t = emb.table
    assert isinstance(t, TieredTable) and t.cache_rows == 100 and emb.max_capacity == 5000
    assert "HostCached(cache_rows=100" in repr(emb) and "cache_rows=100" in repr(t)
    assert make(HostCached(cache_rows=100), max_capacity=10).table.cache_rows == 10  # never more than the table


def test_cache_bytes_count_rows_with_their_state_key_score_and_slot_overhead():
    state = veloce.optim.Adam().state_dim(DIM)
    per_row = (DIM * 4 + state * 4 + 8 + 8 + 1) / 0.8
    assert cache_row_bytes(DIM, state, torch.float32) == pytest.approx(per_row)
    assert make(HostCached(cache_bytes=int(per_row * 50) + 1)).table.cache_rows == 50
    with pytest.raises(ValueError, match="holds no row of this table"):
        make(HostCached(cache_bytes=10))


@pytest.mark.parametrize("kwargs, match", [
    ({}, "exactly one of cache_rows"),
    ({"cache_rows": 10, "cache_bytes": 1000}, "exactly one of cache_rows"),
    ({"cache_rows": 0}, "cache_rows must be an int >= 1, got 0"),
    ({"cache_rows": 2.5}, "cache_rows must be an int >= 1, got 2.5"),
    ({"cache_bytes": True}, "cache_bytes must be an int >= 1, got True"),
    ({"cache_rows": 10, "policy": "fifo"}, "policy must be 'lru', 'lfu' or None"),
    ({"cache_rows": 10, "evict_fraction": 0}, r"evict_fraction must be a number in \(0, 1\]"),
    ({"cache_rows": 10, "evict_fraction": 1.5}, r"evict_fraction must be a number in \(0, 1\]"),
])  # fmt: skip
def test_bad_host_cached_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HostCached(**kwargs)


def test_the_cache_policy_must_rank_the_tables_scores():
    make(HostCached(cache_rows=10, policy="lru"), eviction="none")
    make(HostCached(cache_rows=10, policy="lfu"), eviction="lfu")
    with pytest.raises(ValueError, match="policy='lru'.*keeps use counts"):
        make(HostCached(cache_rows=10, policy="lru"), eviction="lfu")
    with pytest.raises(ValueError, match="policy='lfu'.*keeps last-seen steps"):
        make(HostCached(cache_rows=10, policy="lfu"), eviction=veloce.eviction.TTL(steps=5))


def test_a_tiered_tables_max_capacity_is_checked():
    with pytest.raises(ValueError, match="max_capacity must be an int >= 1 or None, got 0"):
        make(HostCached(cache_rows=10), max_capacity=0)


def test_storage_must_be_a_spec():
    with pytest.raises(TypeError, match="storage must be a veloce.storage spec"):
        make("host")


def test_prefetch_of_a_sharded_table_points_to_hybrid_parallel(monkeypatch):
    emb = make(HostCached(cache_rows=10))
    monkeypatch.setattr(type(emb.backend), "sharded", True)
    with pytest.raises(RuntimeError, match="HybridParallel.prefetch"):
        emb.prefetch(torch.tensor([1, 2]))
