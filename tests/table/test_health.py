"""A table's health in stats() (veloce.table.health): evicted ids that came back within the
window, the age of the oldest row (lru) or the fewest uses (lfu), on device tables and on a
tiered table whose evictions leave its store, with known counts."""

from __future__ import annotations

import pytest
import torch

import veloce
from veloce.storage import HostCached
from veloce.table import HashTable

pytestmark = pytest.mark.skipif(not veloce.ops.extension.loaded, reason="veloce._C is not built")


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_a_table_that_never_evicts_reports_no_returns():
    t = HashTable(4, 0)
    s = t.stats()
    assert (s["evicted"], s["evicted_within_n"], s["returned_within_n"]) == (0, 0, 0)
    assert s["oldest_row_age"] is None
    assert s["return_window"] == 1000 and s["min_use_count"] is None and t._evicted_record is None
    t.find_or_insert(ids(1, 2, 3))
    s = t.stats()
    assert (s["rows"], s["clock"], s["oldest_row_age"], s["evicted_last_lookup"]) == (3, 1, 0, 0)


def test_evicted_ids_that_come_back_are_counted_within_the_window():
    t = HashTable(4, 0, max_capacity=1, eviction="lru")
    t.find_or_insert(ids(10))  # clock 1
    t.find_or_insert(ids(20))  # clock 2: evicts 10
    assert t.stats()["evicted_last_lookup"] == 1
    t.find_or_insert(ids(10))  # clock 3: evicts 20; 10 came back
    s = t.stats()
    assert (s["evicted"], s["evicted_within_n"], s["returned_within_n"]) == (2, 2, 1)
    t.return_window = 0  # only the latest lookup's eviction (20, not back)
    s = t.stats()
    assert (s["evicted_within_n"], s["returned_within_n"], s["return_window"]) == (1, 0, 0)
    t.return_window = 1000
    t.find_or_insert(ids(20))  # clock 4: evicts 10 again (its entry's clock moves to 4); 20 came back
    s = t.stats()
    assert (s["evicted"], s["evicted_within_n"], s["returned_within_n"]) == (3, 2, 1)
    for _ in range(5):
        t.find_or_insert(ids(20))  # clock 9
    t.return_window = 4  # evictions at clocks >= 5: none
    assert (t.stats()["evicted_within_n"], t.stats()["returned_within_n"]) == (0, 0)
    t.return_window = 5  # clock 4's: 10 (gone)
    assert (t.stats()["evicted_within_n"], t.stats()["returned_within_n"]) == (1, 0)


def test_returns_match_a_reference_of_the_evicted_ids():
    """A table at max_capacity over a working set twice its size: every eviction (from
    last_evicted) and the ids the table holds at the end give the expected counts."""
    t = HashTable(4, 0, max_capacity=32, eviction="lru")
    g = torch.Generator().manual_seed(0)
    evicted_at: dict[int, int] = {}
    for _ in range(40):
        t.find_or_insert(torch.randint(0, 64, (16,), generator=g))
        for k in t.last_evicted.tolist():
            evicted_at[k] = t.clock
    assert t.num_evicted > 0
    t.return_window = 10
    recent = [k for k, c in evicted_at.items() if c >= t.clock - 10]
    back = int((t.find(torch.tensor(recent, dtype=torch.int64)) >= 0).sum())
    s = t.stats()
    assert (s["evicted_within_n"], s["returned_within_n"]) == (len(recent), back) and back > 0


def test_a_small_record_keeps_the_latest_eviction_of_each_entry():
    t = HashTable(4, 0, max_capacity=1, eviction="lru")
    t.evicted_record_slots = 1
    for k in (1, 2, 3, 4):
        t.find_or_insert(ids(k))  # evicts k - 1
    s = t.stats()
    assert (s["evicted"], s["evicted_within_n"], s["returned_within_n"]) == (3, 1, 0)  # a lower bound
    t2 = HashTable(4, 0, max_capacity=1)
    t2.evicted_record_slots = 3
    t2.find_or_insert(ids(1))
    with pytest.raises(ValueError, match=r"evicted_record_slots must be a power of two >= 1, got 3"):
        t2.find_or_insert(ids(2))


def test_oldest_row_age_under_lru_and_min_use_count_under_lfu():
    t = HashTable(4, 0, eviction="lru")
    t.find_or_insert(ids(1, 2, 3))  # clock 1
    for _ in range(5):
        t.find_or_insert(ids(1))  # clock 6
    s = t.stats()
    assert (s["oldest_row_age"], s["min_use_count"]) == (5, None)
    f = HashTable(4, 0, eviction="lfu")
    f.find_or_insert(ids(1, 2, 2))
    for _ in range(3):
        f.find_or_insert(ids(1, 2))
    s = f.stats()
    assert s["oldest_row_age"] is None and s["min_use_count"] == int(f.export()["scores"].min()) > 0


def test_a_tiered_table_counts_returns_and_ages_over_its_store():
    emb = veloce.DynamicEmbedding(4, optimizer=veloce.optim.SGD(lr=0.1), storage=HostCached(cache_rows=8),
                                  max_capacity=16, eviction="lru")  # fmt: skip
    t = emb.table
    for step in range(6):  # 4 fresh ids a step: 24 ids, 16 rows at most
        t.find_or_insert(torch.arange(4 * step, 4 * step + 4))
        t.after_step()
    assert t.num_evicted == 8
    s = emb.stats()
    assert (s["evicted_within_n"], s["returned_within_n"], s["oldest_row_age"]) == (8, 0, 3)
    t.find_or_insert(t.last_evicted[:2].clone())  # two evicted ids come back (evicting two more)
    t.after_step()
    s = emb.stats()
    assert (s["evicted"], s["evicted_within_n"], s["returned_within_n"]) == (10, 10, 2)
