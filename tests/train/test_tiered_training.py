"""The Trainer over tiered tables: the same model as over Device tables, the next batch's
rows prefetched, and each table's telemetry in the step records."""

from __future__ import annotations

import json

import pytest
import torch

import veloce
from veloce.data import SyntheticClicks
from veloce.models import DLRM
from veloce.storage import Device, HostCached, TieredTable

NUM_DENSE, NUM_SPARSE, ID_SPACE = 4, 3, 400


def data(n: int = 1024, batch: int = 64) -> SyntheticClicks:
    return SyntheticClicks(n, batch_size=batch, num_dense=NUM_DENSE, num_sparse=NUM_SPARSE, id_space=ID_SPACE,
                           seed=1)  # fmt: skip


def model(storage) -> DLRM:
    torch.manual_seed(0)
    return DLRM(NUM_DENSE, NUM_SPARSE, embedding_dim=4, bottom_mlp=(8, 4), top_mlp=(8, 1),
                embedding_factory=lambda d: veloce.DynamicEmbedding(d, mode="sum", storage=storage,
                                                                     optimizer=veloce.optim.Adam(lr=0.05)))  # fmt: skip


def fit(m, **kw) -> veloce.Trainer:
    t = veloce.Trainer(m, optimizer=torch.optim.Adam(m.parameters(), lr=1e-2), progress=False, max_epochs=2, **kw)
    t.fit(data())
    return t


def rows(m) -> dict[str, torch.Tensor]:
    out = {k: v.detach().clone() for k, v in m.named_parameters()}
    for name, mod in m.named_modules():
        if isinstance(mod, veloce.DynamicEmbedding):
            e = mod.export()
            order = torch.argsort(e["keys"])
            out.update({f"{name}.{k}": e[k][order] for k in ("keys", "weights", "optimizer_state")})
    return out


def test_a_trainer_over_host_cached_tables_trains_the_model_of_device_tables(monkeypatch):
    prefetched = []
    real = TieredTable.prefetch
    monkeypatch.setattr(TieredTable, "prefetch", lambda self, ids, *a: prefetched.append(ids.numel()) or real(self, ids, *a))
    device = fit(model(Device())).module
    tiered = fit(model(HostCached(cache_rows=100))).module  # < the ids each table sees (400): fetches every step
    a, b = rows(device), rows(tiered)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0, msg=k)
    # the next batch of every step but an epoch's last, for each table, all ids of its column
    assert prefetched == [64] * (16 - 1) * 2 * NUM_SPARSE
    for emb in tiered.embeddings.values():
        s = emb.stats()
        assert s["fetched"] > 0 and s["written_back"] > 0 and s["rows"] == s["cache_rows"] + s["store_rows"]


def test_prefetched_rows_are_found_by_the_forward():
    m = model(HostCached(cache_rows=100))
    fit(m)
    for emb in m.embeddings.values():
        s = emb.stats()
        # each batch's ids are looked up twice (its prefetch, then its insert): the insert's all hit
        assert s["hits"] >= s["misses"]


def test_step_records_carry_each_table_telemetry(tmp_path):
    fit(model(HostCached(cache_rows=100)), log_every=4, log_dir=tmp_path)
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["event"] == "step"]
    assert len(steps) == 8
    for r in steps:
        for i in range(NUM_SPARSE):
            p = f"tables/embeddings.sparse_{i}/"
            assert 0 < r[p + "hit_rate"] <= 1 and 0 < r[p + "rows"] <= ID_SPACE
            assert r[p + "fetched_per_step"] >= 0 and r[p + "written_back_per_step"] >= 0
            entry = 4 * 4 + 8 * 4 + 8 + 8  # dim-4 row, Adam's state (2 x dim), key, score
            moved = (r[p + "fetched_per_step"] + r[p + "written_back_per_step"]) * entry
            assert r[p + "bytes_moved_per_step"] == pytest.approx(moved)
    assert sum(r["tables/embeddings.sparse_0/fetched_per_step"] for r in steps) > 0


def test_device_tables_report_rows_only(tmp_path):
    fit(model(Device()), log_every=8, log_dir=tmp_path)
    r = json.loads((tmp_path / "log.jsonl").read_text().splitlines()[0])
    names = [f"tables/embeddings.sparse_{i}/rows" for i in range(NUM_SPARSE)]
    assert sorted(k for k in r if k.startswith("tables/")) == names
    assert all(isinstance(r[k], int) and r[k] > 0 for k in names)


def _rank_fit(rank: int, world: int, tiered: bool) -> dict:
    m = model(HostCached(cache_rows=100) if tiered else Device())
    calls = []
    t = veloce.Trainer(m, optimizer=torch.optim.Adam(m.parameters(), lr=1e-2), progress=False, max_epochs=1)
    real = t.model.prefetch
    t.model.prefetch = lambda *a, **k: calls.append(1) or real(*a, **k)  # HybridParallel.prefetch
    t.fit(SyntheticClicks(512, batch_size=64, num_dense=NUM_DENSE, num_sparse=NUM_SPARSE, id_space=ID_SPACE, seed=1,
                          rank=rank, world_size=world))  # fmt: skip
    return {"rows": rows(m), "prefetches": len(calls)}


def test_two_ranks_prefetch_through_hybrid_parallel_and_train_the_device_model():
    from _dist import run_ranks

    tiered = run_ranks(_rank_fit, 2, True, timeout=240)
    device = run_ranks(_rank_fit, 2, False, timeout=240)
    for a, b in zip(tiered, device):
        assert a["prefetches"] == 512 // 64 - 1 and b["prefetches"] == 0  # every batch but the last
        for k in b["rows"]:
            torch.testing.assert_close(a["rows"][k], b["rows"][k], atol=1e-6, rtol=0, msg=k)
