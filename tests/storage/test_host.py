"""veloce.storage.host.HostStore: the BackingStore calls over a CPU hash table; and a
tiered table over it against a dict under random inserts, erases and training inserts
(hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _tiers import apply_table_op
from veloce.storage import HostCached, HostStore
from veloce.table import TableFullError

DIM, STATE = 4, 2


def _store(**kwargs) -> HostStore:
    return HostStore(DIM, STATE, torch.float32, torch.float32, **kwargs)


def _entries(ids: list[int], base: float = 0.0):
    n = len(ids)
    ids_t = torch.tensor(ids, dtype=torch.long)
    w = ids_t.float().unsqueeze(1).repeat(1, DIM) + base
    return ids_t, w, torch.full((n, STATE), base), ids_t.clone()


def test_get_take_put_erase_lowest_chunks():
    store = _store()
    ids, w, o, s = _entries(list(range(100)))
    store.put(ids, w, o, s, fresh=True)
    assert len(store) == 100
    got = store.get(torch.tensor([5, 500, 7]))
    assert got.found.tolist() == [True, False, True] and got.weights[0, 0] == 5 and got.scores[2] == 7
    taken = store.take(torch.tensor([1, 2, 1000]))
    assert taken.found.tolist() == [True, True, False] and len(store) == 98
    assert not store.get(torch.tensor([1, 2])).found.any()
    store.put(*_entries([3, 4], base=0.5))  # replaces
    assert store.get(torch.tensor([3])).weights[0, 0] == 3.5 and len(store) == 98
    assert sorted(store.lowest(3).tolist()) == [0, 3, 4]
    assert store.erase(torch.tensor([0, 0, 999])) == 1 and len(store) == 97
    chunks = list(store.chunks(10))
    assert all(c["keys"].numel() <= 10 for c in chunks)
    assert sorted(torch.cat([c["keys"] for c in chunks]).tolist()) == sorted(set(range(100)) - {0, 1, 2})
    assert store.expire(50) == 47 and len(store) == 50
    snap = store.snapshot()
    store.clear()
    assert len(store) == 0
    store.restore(snap)
    assert len(store) == 50 and store.stats()["store_bytes"] > 0


def test_a_bounded_store_refuses_rather_than_drops():
    store = _store(max_capacity=10)
    store.put(*_entries(list(range(10))), fresh=True)
    with pytest.raises(TableFullError):
        store.put(*_entries([10, 11]), fresh=True)
    assert len(store) == 10 and not store.get(torch.tensor([10, 11])).found.any()


_OPS = st.lists(st.tuples(st.sampled_from(["insert", "erase", "train"]),
                          st.lists(st.integers(-20, 60), min_size=1, max_size=12)), min_size=1, max_size=25)  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_OPS)
def test_a_tiered_table_holds_what_a_dict_holds(ops):
    table = HostCached(cache_rows=12).make_table(dim=DIM, state_dim=STATE, seed=3)  # a batch: 12 ids at most
    model: dict[int, torch.Tensor] = {}
    for k, (op, ids) in enumerate(ops):
        apply_table_op(table, model, k, op, ids)
        assert len(table) == len(model) and table.size <= 12
        out = table.export()
        assert sorted(out["keys"].tolist()) == sorted(model)
        for key, row in zip(out["keys"].tolist(), out["weights"]):
            assert torch.equal(row, model[key])
