"""veloce.storage.chain.CachedStore, a RAM tier over a lower store: its calls against a dict
(hypothesis), its writes all or none, and a table over RocksDB with a RAM tier
(``RocksDB(path, cache_rows=..., ram_cache_rows=...)``: a cache over RAM over disk) that
trains as the all-in-memory table, every row passing through all three tiers, and
round-trips checkpoints."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import veloce
from _tiers import apply_table_op, assert_same_entries, assert_same_eval, batches, cached, make, train, train_pair
from conftest import DEVICES
from veloce.ops import rocksdb as rocksdb_ops
from veloce.optim import OPTIMIZERS
from veloce.storage import CachedStore, HostStore, RocksDB, TieredTable, cache_row_bytes

needs_rocksdb = pytest.mark.skipif(
    not rocksdb_ops.available(),
    reason="veloce._rocksdb is not built (RocksDB was not found at build time: apt-get install librocksdb-dev, "
    "then rebuild)",
)
DIM, STATE = 4, 2


def _chain(ram_rows: int = 8, **kwargs) -> CachedStore:
    return CachedStore(ram_rows, HostStore(DIM, STATE, torch.float32, torch.float32), **kwargs)


def _entries(ids: list[int], base: float = 0.0, scores: list[int] | None = None):
    ids_t = torch.tensor(ids, dtype=torch.long)
    w = ids_t.float().unsqueeze(1).repeat(1, DIM) + base
    sc = ids_t.clone() if scores is None else torch.tensor(scores, dtype=torch.long)
    return ids_t, w, torch.full((len(ids), STATE), base), sc


def _keys(store) -> list[int]:
    return sorted(k for c in store.chunks(5) for k in c["keys"].tolist())


def _exclusive(store: CachedStore) -> None:
    assert not set(_keys(store.ram)) & set(_keys(store.lower)), "an id is in both tiers"
    assert len(store.ram) <= store.ram_rows


def test_writes_fill_ram_then_send_the_coldest_down_and_reads_span_both_tiers():
    store = _chain(8, evict_fraction=0.25)
    store.put(*_entries(list(range(6))), fresh=True)
    assert len(store.ram) == 6 and len(store.lower) == 0
    store.put(*_entries([10, 11, 12]), fresh=True)  # 1 short: 2 (a quarter of RAM) go down, the coldest
    assert len(store) == 9 and len(store.ram) == 7 and _keys(store.lower) == [0, 1]
    store.put(*_entries(list(range(100, 120))), fresh=True)  # more than RAM holds: all of RAM and the batch's coldest
    assert len(store) == 29 and _keys(store.ram) == list(range(112, 120))
    _exclusive(store)
    got = store.get(torch.tensor([115, 3, 999]))
    assert got.found.tolist() == [True, True, False] and got.weights[1, 0] == 3 and got.scores[0] == 115
    taken = store.take(torch.tensor([0, 119, 998]))  # one from each tier
    assert taken.found.tolist() == [True, True, False] and taken.weights[:2, 0].tolist() == [0.0, 119.0]
    assert len(store) == 27 and not store.get(torch.tensor([0, 119])).found.any()
    stats = store.stats()
    assert (stats["ram_hits"], stats["read_up"], stats["ram_hit_rate"]) == (1, 1, 0.5)
    assert stats["written_down"] == 2 + 7 + 12 and stats["bytes_written_down"] == 21 * (DIM * 4 + STATE * 4 + 16)
    assert store.lowest(4).tolist() == [1, 2, 3, 4]  # merged: all below, here
    assert sorted(store.lowest(100).tolist()) == _keys(store)
    store.put(*_entries([1, 118, 500], base=0.5))  # replace in either tier, add below
    assert store.get(torch.tensor([1, 118, 500])).weights[:, 0].tolist() == [1.5, 118.5, 500.5]
    assert len(store) == 28 and store.get(torch.tensor([500])).found.all() and len(store.ram) == 7
    _exclusive(store)
    assert store.erase(torch.tensor([1, 118, 12345])) == 2 and len(store) == 26
    assert store.expire(100) == 7  # 2-5 and 10-12, all below
    assert len(store) == 19 and all(int(s) >= 100 for c in store.chunks(4) for s in c["scores"])
    store.reset_stats()
    assert store.stats()["written_down"] == 0
    store.clear()
    assert len(store) == 0


class _FailingPut(HostStore):
    def put(self, *args, **kwargs) -> None:
        raise RuntimeError("disk full")


def test_a_write_down_that_fails_leaves_both_tiers_as_they_were():
    store = CachedStore(4, _FailingPut(DIM, STATE, torch.float32, torch.float32))
    store.put(*_entries([1, 2, 3, 4]), fresh=True)
    with pytest.raises(RuntimeError, match="disk full"):
        store.put(*_entries([5, 6]), fresh=True)
    assert len(store) == 4 and store.get(torch.tensor([1, 2, 3, 4])).found.all()
    assert not store.get(torch.tensor([5, 6])).found.any() and store.stats()["written_down"] == 0


def test_arguments_are_checked():
    lower = HostStore(DIM, STATE, torch.float32, torch.float32)
    for bad in (0, -1, 1.5, None):
        with pytest.raises(ValueError, match="ram_rows must be an int >= 1"):
            CachedStore(bad, lower)
    with pytest.raises(ValueError, match="evict_fraction"):
        CachedStore(4, lower, evict_fraction=0)
    with pytest.raises(ValueError, match="at most one of ram_cache_rows or ram_cache_bytes"):
        RocksDB("/tmp/x", cache_rows=8, ram_cache_rows=8, ram_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="ram_cache_rows must be an int >= 1"):
        RocksDB("/tmp/x", cache_rows=8, ram_cache_rows=0)
    spec = RocksDB("/tmp/x", cache_rows=8, ram_cache_bytes=int(1000 * cache_row_bytes(64, 64, torch.float32)) + 1)
    assert spec.ram_rows_for(64, 64, torch.float32) == 1000
    assert RocksDB("/tmp/x", cache_rows=8).ram_rows_for(64, 64, torch.float32) is None
    with pytest.raises(ValueError, match="ram_cache_bytes=10 holds no row"):
        RocksDB("/tmp/x", cache_rows=8, ram_cache_bytes=10).ram_rows_for(64, 64, torch.float32)


_STORE_OPS = st.lists(st.tuples(st.sampled_from(["fresh", "put", "take", "get", "erase", "lowest", "expire"]),
                                st.lists(st.integers(-10, 40), min_size=1, max_size=12, unique=True),
                                st.integers(0, 50)), min_size=1, max_size=30)  # fmt: skip


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_STORE_OPS, ram_rows=st.integers(1, 10))
def test_a_cached_store_holds_what_a_dict_holds(ops, ram_rows):
    store = _chain(ram_rows, evict_fraction=0.3)
    model: dict[int, tuple[float, int]] = {}  # id -> (weight, score)
    for k, (op, ids, score) in enumerate(ops):
        t = torch.tensor(ids, dtype=torch.long)
        if op == "fresh":  # a write-back: ids held nowhere
            ids = [i for i in ids if i not in model]
            if ids:
                scores = [score + j for j in range(len(ids))]
                store.put(*_entries(ids, float(k), scores), fresh=True)
                model.update({i: (i + float(k), s) for i, s in zip(ids, scores)})
        elif op == "put":
            store.put(*_entries(ids, float(k), [score] * len(ids)))
            model.update({i: (i + float(k), score) for i in ids})
        elif op in ("take", "get"):
            got = store.take(t) if op == "take" else store.get(t)
            assert got.found.tolist() == [i in model for i in ids]
            for i, f, w, s in zip(ids, got.found, got.weights[:, 0], got.scores):
                if f:
                    assert (float(w), int(s)) == model[i]
            if op == "take":
                for i in ids:
                    model.pop(i, None)
        elif op == "erase":
            assert store.erase(t) == sum(i in model for i in ids)
            for i in ids:
                model.pop(i, None)
        elif op == "lowest":
            low = store.lowest(score % 8)
            want = sorted(s for _, s in model.values())[: score % 8]
            assert sorted(model[i][1] for i in low.tolist()) == want
        else:
            assert store.expire(score) == sum(s < score for _, s in model.values())
            model = {i: v for i, v in model.items() if v[1] >= score}
        assert len(store) == len(model)
        _exclusive(store)
    assert _keys(store) == sorted(model)


_TABLE_OPS = st.lists(st.tuples(st.sampled_from(["insert", "erase", "train"]),
                                st.lists(st.integers(-20, 60), min_size=1, max_size=12)), min_size=1, max_size=25)  # fmt: skip


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_TABLE_OPS)
def test_a_table_over_a_cached_store_holds_what_a_dict_holds(ops):
    table = TieredTable(_chain(10), 12, DIM, STATE, seed=3)  # cache 12 rows over RAM 10 over a host store
    model: dict[int, torch.Tensor] = {}
    for k, (op, ids) in enumerate(ops):
        apply_table_op(table, model, k, op, ids)
        assert len(table) == len(model) and table.size <= 12
        _exclusive(table.store)
        out = table.export()
        assert sorted(out["keys"].tolist()) == sorted(model)
        for key, row in zip(out["keys"].tolist(), out["weights"]):
            assert torch.equal(row, model[key])


def test_max_capacity_counts_every_tier_and_evicts_the_coldest_of_ram_and_below():
    table = TieredTable(_chain(10), 12, DIM, STATE, max_capacity=30, seed=3)  # cache 12, RAM 10, below 8 at most
    for step in range(20):
        ids = torch.arange(step * 5, step * 5 + 10)  # 5 new ids a step, 5 of the last step's
        table.find_or_insert(ids)
        table.after_step()
        assert len(table) == min(30, step * 5 + 10) and table.size <= 12 and len(table.store.ram) <= 10
        _exclusive(table.store)
    keys = sorted(table.export()["keys"].tolist())
    assert keys == list(range(75, 105)) and table.num_evicted == 75  # LRU: the 30 newest stay


# ---- a table over RocksDB with a RAM tier -------------------------------------------------
def _three_tiers(path, cache_rows: int = 64, ram_rows: int = 200, **kwargs) -> RocksDB:
    return RocksDB(str(path), cache_rows=cache_rows, ram_cache_rows=ram_rows, **kwargs)




@needs_rocksdb
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sum", "max"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_cache_over_ram_over_rocksdb_trains_as_the_all_in_memory_table(tmp_path, name, mode, device):
    ref = make(None, OPTIMIZERS[name](lr=0.05), mode, device)
    tiered = make(_three_tiers(tmp_path / "db"), OPTIMIZERS[name](lr=0.05), mode, device)
    assert isinstance(tiered.table.store, CachedStore)
    train_pair(ref, tiered, 50, device)
    assert len(tiered) == len(ref) > 1000
    stats = tiered.stats()
    # every tier holds rows, and rows moved across both boundaries both ways
    assert 0 < stats["cache_rows"] <= 64 and 0 < stats["ram_rows"] <= 200
    assert stats["rocksdb_entries"] == len(ref) - stats["cache_rows"] - stats["ram_rows"] > 0
    assert stats["store_rows"] == stats["ram_rows"] + stats["rocksdb_entries"]
    assert stats["fetched"] == stats["ram_hits"] + stats["read_up"]
    assert stats["ram_hits"] > 0 and stats["read_up"] > 0 and stats["written_back"] > 0 and stats["written_down"] > 0
    assert stats["bytes_read_up"] > 0 and 0 < stats["ram_hit_rate"] < 1
    assert_same_entries(tiered.export(), ref.export())
    assert_same_eval(ref, tiered, device)  # eval reads RAM's and the database's rows, changing nothing
    assert tiered.stats(reset=True)["read_up"] == stats["read_up"] and tiered.stats()["read_up"] == 0
    tiered.table.store.close()


@needs_rocksdb
@pytest.mark.parametrize("device", DEVICES)
def test_checkpoints_round_trip_device_three_tiers_host_cached(tmp_path, device):
    ref = make(None, device=device)
    ref_run = train(ref, batches(30, seed=4, device=device), 30)
    it = batches(30, seed=4, device=device)
    first = nn.ModuleDict({"emb": make(None, device=device)})
    run = train(first["emb"], it, 10)
    veloce.checkpoint.save(tmp_path / "a", first, step=10)
    second = nn.ModuleDict({"emb": make(_three_tiers(tmp_path / "db", ram_rows=100), device=device)})
    veloce.checkpoint.load(tmp_path / "a", second)  # Device -> cache over RAM over RocksDB
    assert second["emb"].stats()["rocksdb_entries"] > 0  # a streamed load writes below the cache
    run += train(second["emb"], it, 10)
    stats = second["emb"].stats()
    assert stats["ram_rows"] > 0 and stats["rocksdb_entries"] > 0  # training moved rows through every tier
    veloce.checkpoint.save(tmp_path / "b", second, step=20)
    third = nn.ModuleDict({"emb": make(cached(48), device=device)})  # -> HostCached
    veloce.checkpoint.load(tmp_path / "b", third)
    assert_same_entries(third["emb"].export(), second["emb"].export(), atol=0)
    run += train(third["emb"], it, 10)
    for x, y in zip(run, ref_run):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=0)
    assert_same_entries(third["emb"].export(), ref.export())
    fourth = nn.ModuleDict({"emb": make(_three_tiers(tmp_path / "db2"), device=device)})
    veloce.checkpoint.load(tmp_path / "b", fourth)  # three tiers -> three tiers
    assert_same_entries(fourth["emb"].export(), second["emb"].export(), atol=0)
    second["emb"].table.store.close()
    fourth["emb"].table.store.close()
